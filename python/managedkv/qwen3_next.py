"""A Qwen3-Next decoder for the parity (docs/python.md, "Qwen3-Next"): a hybrid of gated delta net
(linear attention) layers, whose state is one fixed-size row per sequence, and full attention
layers, under transformers' parameter names.

What a KV cache notices: a linear-attention layer keeps no KV at all. Its state after a prefix is
a matrix per value head ``[key_dim, value_dim]`` (the gated delta rule's memory) plus the last
``conv_kernel - 1`` inputs of its causal depthwise convolution, and that state is valid at exactly
one position, so a cache can only resume such a model from an exact checkpoint (managedkv's hybrid
deployment: recurrent rows per resident slot, captured at prompt ends, decode ends and chunk ends,
restored with the full pages and the partial last page of the attention layers).

The math follows transformers' ``Qwen3NextForCausalLM`` (eager attention, the torch fallback of the
delta rule, dense MLPs: ``num_experts`` 0):

* RMSNorm in fp32 scaled by ``1 + weight`` (input, post-attention, q / k norms, final);
* full attention: ``q_proj`` gives per head a query and an output gate (``[.., heads, 2 * head_dim]``,
  split in halves); q / k normed per head; RoPE on the first ``partial_rotary_factor`` of each head
  (rotate_half pairing); grouped-query attention scaled by ``head_dim ** -0.5``; the output times
  ``sigmoid(gate)`` before ``o_proj``;
* gated delta net: ``in_proj_qkvz`` and ``in_proj_ba`` laid out per key head (``[q, k, v, z]`` and
  ``[b, a]`` of each key head's group of value heads); a causal depthwise ``conv1d`` then SiLU over
  the concatenated q, k, v; ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``; q
  and k L2-normalised, q scaled by ``key_dim ** -0.5``, key heads repeated to the value heads; per
  token ``S = S * exp(g)``, ``S += k (beta (v - S^T k))^T``, ``o = S^T q``; the output RMS-normed
  per value head (weight applied directly, not ``1 + weight``) and gated by ``silu(z)`` before
  ``out_proj``;
* SwiGLU MLP, untied LM head.

Parameter names::

    model.embed_tokens.weight                              [vocab, hidden]
    model.layers.{i}.input_layernorm.weight                [hidden]
    model.layers.{i}.post_attention_layernorm.weight       [hidden]
    model.layers.{i}.mlp.{gate,up,down}_proj.weight        nn.Linear [out, in]
    full attention layers:
    model.layers.{i}.self_attn.q_proj.weight               [heads * head_dim * 2, hidden]
    model.layers.{i}.self_attn.{k,v}_proj.weight           [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.o_proj.weight               [hidden, heads * head_dim]
    model.layers.{i}.self_attn.{q,k}_norm.weight           [head_dim]
    linear attention layers:
    model.layers.{i}.linear_attn.in_proj_qkvz.weight       [2 * key_dim + 2 * value_dim, hidden]
    model.layers.{i}.linear_attn.in_proj_ba.weight         [2 * value_heads, hidden]
    model.layers.{i}.linear_attn.conv1d.weight             [2 * key_dim + value_dim, 1, conv_kernel]
    model.layers.{i}.linear_attn.dt_bias                   [value_heads]
    model.layers.{i}.linear_attn.A_log                     [value_heads]
    model.layers.{i}.linear_attn.norm.weight               [value_head_dim]
    model.layers.{i}.linear_attn.out_proj.weight           [hidden, value_dim]
    model.norm.weight                                      [hidden]
    lm_head.weight                                         [vocab, hidden]

(``key_dim`` = key heads x key head dim, ``value_dim`` = value heads x value head dim.)

Only torch APIs present in torch 1.13 are used; transformers is imported only by
``build_transformers_model``.
"""

import torch
import torch.nn.functional as F

from managedkv import decoder, hf_llama

RMS_NORM_EPS = 1e-6
ROPE_THETA = 10_000.0
LINEAR, FULL = "linear_attention", "full_attention"


def layer_types(geometry):
    """transformers' pattern: layer i is full attention when (i + 1) % interval == 0."""
    interval = geometry["full_attention_interval"]
    return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(geometry["layers"])]


def dims(geometry):
    """The gated delta net's widths: (key_dim, value_dim, conv_dim, value heads per key head)."""
    g = geometry
    key_dim = g["linear_key_heads"] * g["linear_key_head_dim"]
    value_dim = g["linear_value_heads"] * g["linear_value_head_dim"]
    return key_dim, value_dim, 2 * key_dim + value_dim, g["linear_value_heads"] // g["linear_key_heads"]


def state_shapes(geometry):
    """One sequence's state of one linear-attention layer, fp32: the delta rule's memory
    [value heads, key head dim, value head dim] and the conv window [conv_dim, conv_kernel - 1]."""
    g = geometry
    _, _, conv_dim, _ = dims(g)
    memory = (g["linear_value_heads"], g["linear_key_head_dim"], g["linear_value_head_dim"])
    return memory, (conv_dim, g["conv_kernel"] - 1)


def parameter_shapes(geometry):
    """(name, shape) of every parameter, in the order random_state_dict draws them."""
    g = geometry
    key_dim, value_dim, conv_dim, _ = dims(g)
    q_out, kv_out = g["heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"]
    shapes = [("model.embed_tokens.weight", (g["vocab"], g["hidden"]))]
    for i, kind in enumerate(layer_types(g)):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (g["hidden"],)))
        if kind == FULL:
            shapes += [
                (p + "self_attn.q_proj.weight", (2 * q_out, g["hidden"])),
                (p + "self_attn.k_proj.weight", (kv_out, g["hidden"])),
                (p + "self_attn.v_proj.weight", (kv_out, g["hidden"])),
                (p + "self_attn.o_proj.weight", (g["hidden"], q_out)),
                (p + "self_attn.q_norm.weight", (g["head_dim"],)),
                (p + "self_attn.k_norm.weight", (g["head_dim"],)),
            ]
        else:
            shapes += [
                (p + "linear_attn.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, g["hidden"])),
                (p + "linear_attn.in_proj_ba.weight", (2 * g["linear_value_heads"], g["hidden"])),
                (p + "linear_attn.conv1d.weight", (conv_dim, 1, g["conv_kernel"])),
                (p + "linear_attn.dt_bias", (g["linear_value_heads"],)),
                (p + "linear_attn.A_log", (g["linear_value_heads"],)),
                (p + "linear_attn.norm.weight", (g["linear_value_head_dim"],)),
                (p + "linear_attn.out_proj.weight", (g["hidden"], value_dim)),
            ]
        shapes += [
            (p + "post_attention_layernorm.weight", (g["hidden"],)),
            (p + "mlp.gate_proj.weight", (g["ffn"], g["hidden"])),
            (p + "mlp.up_proj.weight", (g["ffn"], g["hidden"])),
            (p + "mlp.down_proj.weight", (g["hidden"], g["ffn"])),
        ]
    shapes += [("model.norm.weight", (g["hidden"],)), ("lm_head.weight", (g["vocab"], g["hidden"]))]
    return shapes


def random_state_dict(geometry, seed):
    """Seeded random fp32 weights under transformers' names: embeddings N(0, 1); linear maps and
    the conv N(0, 1/fan_in); the ``1 + weight`` norms N(0, 0.1) and the gated norm 1 + N(0, 0.1),
    so that a norm a forward drops shows; ``dt_bias`` 1 + N(0, 0.1); ``A_log`` the log of a decay
    rate in [0.02, 0.2] per value head (transformers draws it in [0, 16]: a memory that forgets in a
    few tokens would hide a wrong restored state, which this parity exists to catch)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(geometry):
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
            values = 1.0 + 0.1 * values
        elif name.endswith("norm.weight"):
            values = values * 0.1
        elif name.endswith("A_log"):
            rate = 0.02 + 0.18 * torch.rand(shape, generator=generator, dtype=torch.float32)
            values = rate.log()
        elif name.endswith("conv1d.weight"):
            values = values / shape[2] ** 0.5
        elif len(shape) == 2 and not name.endswith("embed_tokens.weight"):
            values = values / shape[1] ** 0.5
        weights[name] = values
    return weights


def l2_normalize(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) over the last dimension (the delta rule's q / k normalisation)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_state_dict(state_dict, geometry):
    """Every parameter of parameter_shapes(geometry), fp32, of its shape, nothing else; returns
    {name: tensor} (detached), raises ValueError naming what is wrong."""
    return decoder.check_named_parameters(
        state_dict, parameter_shapes(geometry), f"Qwen3-Next state dict does not fit the geometry {dict(geometry)}"
    )


class TinyQwen3Next:
    """The decoder path (a) and the paged engine both run. Per layer, ``layer_kind(layer)`` says
    which interface applies: a full-attention layer has the attention interface of the other
    decoders (``qkv`` -> attention over the layer's KV -> ``finish_layer``), a linear-attention
    layer ``mix`` (one sequence's tokens from its state, which it advances in place) ->
    ``finish_mixer``."""

    def __init__(self, geometry, state_dict, device, inv_freq=None, facts=None, dtype=torch.float32):
        self.__dict__.update(geometry)
        self.device = device
        self.dtype = dtype
        facts = facts or {}
        self.eps = facts.get("rms_norm_eps", RMS_NORM_EPS)
        self.types = facts.get("layer_types", layer_types(geometry))
        self.scaling = self.head_dim**-0.5
        self.rotary_dim = int(self.head_dim * facts.get("partial_rotary_factor", geometry["partial_rotary_factor"]))
        self.key_dim, self.value_dim, self.conv_dim, self.value_heads_per_key_head = dims(geometry)
        checked = check_state_dict(state_dict, geometry)
        w = {k: v.to(device=device, dtype=dtype) for k, v in checked.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.blocks = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            self.blocks.append({name[len(p) :]: tensor for name, tensor in w.items() if name.startswith(p)})
        self.final_norm = w["model.norm.weight"]
        self.lm_head = w["lm_head.weight"]
        if inv_freq is None:
            inv_freq = hf_llama.rope_inv_freq(self.rotary_dim, facts.get("rope_theta", ROPE_THETA))
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.memory_shape, self.conv_shape = state_shapes(geometry)

    @classmethod
    def random(cls, geometry, seed, device, dtype=torch.float32):
        return cls(geometry, random_state_dict(geometry, seed), device, dtype=dtype)

    # --- what the engine asks ---------------------------------------------------------------
    def layer_kind(self, layer):
        return self.types[layer]

    def layer_window(self, layer):
        return None  # no sliding layers

    def attention_layers(self):
        return [i for i, kind in enumerate(self.types) if kind == FULL]

    def linear_layers(self):
        return [i for i, kind in enumerate(self.types) if kind == LINEAR]

    def zero_state(self):
        """A sequence's state before any token: the memory and conv window of one layer, zero."""
        return (
            torch.zeros(self.memory_shape, dtype=torch.float32, device=self.device),
            torch.zeros(self.conv_shape, dtype=torch.float32, device=self.device),
        )

    # --- shared pieces ----------------------------------------------------------------------
    def rms_norm(self, x, w):
        """``1 + weight`` RMSNorm, normalised and scaled in fp32, then cast back."""
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + w.float())).to(x.dtype)

    def rope(self, x, positions):
        """RoPE on the first rotary_dim of each head (rotate_half pairing), the rest passed on."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].to(x.dtype)
        sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].to(x.dtype)
        rotated, passed = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        turned = torch.cat([-rotated[..., half:], rotated[..., :half]], dim=-1)
        return torch.cat([rotated * cos + turned * sin, passed], dim=-1)

    def embed_tokens(self, ids):
        return self.embed[ids]

    def mlp(self, layer, h):
        block = self.blocks[layer]
        x = self.rms_norm(h, block["post_attention_layernorm.weight"])
        gate = F.silu(F.linear(x, block["mlp.gate_proj.weight"]))
        return h + F.linear(gate * F.linear(x, block["mlp.up_proj.weight"]), block["mlp.down_proj.weight"])

    def logits(self, h):
        return F.linear(self.rms_norm(h, self.final_norm), self.lm_head)

    # --- full attention layers --------------------------------------------------------------
    def _query_and_gate(self, layer, x):
        projected = F.linear(x, self.blocks[layer]["self_attn.q_proj.weight"]).view(-1, self.heads, 2 * self.head_dim)
        return projected[..., : self.head_dim], projected[..., self.head_dim :].reshape(x.shape[0], -1)

    def qkv(self, layer, h, positions):
        block = self.blocks[layer]
        x = self.rms_norm(h, block["input_layernorm.weight"])
        q, _ = self._query_and_gate(layer, x)
        q = self.rms_norm(q, block["self_attn.q_norm.weight"])
        k = F.linear(x, block["self_attn.k_proj.weight"]).view(-1, self.kv_heads, self.head_dim)
        k = self.rms_norm(k, block["self_attn.k_norm.weight"])
        v = F.linear(x, block["self_attn.v_proj.weight"]).view(-1, self.kv_heads, self.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def attend(self, layer, q, k, v, query_positions):
        """Causal grouped-query attention, scaled by head_dim ** -0.5."""
        return decoder.grouped_query_attention(q, k, v, query_positions, self.scaling)

    def finish_layer(self, layer, h, attention):
        """The attention output gated by sigmoid of q_proj's gate half (recomputed from h), o_proj,
        residual, then the MLP."""
        block = self.blocks[layer]
        _, gate = self._query_and_gate(layer, self.rms_norm(h, block["input_layernorm.weight"]))
        gated = attention.reshape(h.shape[0], -1) * torch.sigmoid(gate)
        return self.mlp(layer, h + F.linear(gated, block["self_attn.o_proj.weight"]))

    # --- linear attention (gated delta net) layers ------------------------------------------
    def mix(self, layer, h, memory, conv):
        """One sequence's tokens h [T, hidden] through linear-attention layer `layer`, resuming
        from its state (``memory`` [value heads, key head dim, value head dim] and ``conv``
        [conv_dim, conv_kernel - 1], fp32), which it advances to the last token in place. Returns
        the layer's output after the residual and the MLP."""
        block = self.blocks[layer]
        T, r = h.shape[0], self.value_heads_per_key_head
        x = self.rms_norm(h, block["input_layernorm.weight"])
        qkvz = F.linear(x, block["linear_attn.in_proj_qkvz.weight"]).view(T, self.linear_key_heads, -1)
        kd, vd = self.linear_key_head_dim, self.linear_value_head_dim
        q, k = qkvz[..., :kd], qkvz[..., kd : 2 * kd]
        v, z = qkvz[..., 2 * kd : 2 * kd + r * vd], qkvz[..., 2 * kd + r * vd :]
        ba = F.linear(x, block["linear_attn.in_proj_ba.weight"]).view(T, self.linear_key_heads, 2 * r)
        b, a = ba[..., :r].reshape(T, -1), ba[..., r:].reshape(T, -1)
        mixed = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
        # Causal depthwise conv: the window's last conv_kernel - 1 inputs, then these tokens.
        window = torch.cat([conv.to(mixed.dtype), mixed.transpose(0, 1)], dim=-1)
        weight = block["linear_attn.conv1d.weight"]
        convolved = F.silu(F.conv1d(window[None], weight, groups=self.conv_dim)[0]).transpose(0, 1)
        conv.copy_(window[:, -conv.shape[1] :].float())
        q = convolved[:, : self.key_dim].reshape(T, -1, kd)
        k = convolved[:, self.key_dim : 2 * self.key_dim].reshape(T, -1, kd)
        v = convolved[:, 2 * self.key_dim :].reshape(T, -1, vd)
        beta = torch.sigmoid(b).float()
        decay = -block["linear_attn.A_log"].float().exp() * F.softplus(a.float() + block["linear_attn.dt_bias"].float())
        q = l2_normalize(q.float()).repeat_interleave(r, dim=1) * kd**-0.5
        k = l2_normalize(k.float()).repeat_interleave(r, dim=1)
        v = v.float()
        out = torch.empty(T, self.linear_value_heads, vd, dtype=torch.float32, device=h.device)
        for t in range(T):
            memory.mul_(decay[t].exp()[:, None, None])
            recalled = torch.einsum("hkv,hk->hv", memory, k[t])
            memory.add_(k[t][:, :, None] * ((v[t] - recalled) * beta[t][:, None])[:, None, :])
            out[t] = torch.einsum("hkv,hk->hv", memory, q[t])
        out = out.to(h.dtype).float()  # the rule's output leaves it in the model's dtype
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = block["linear_attn.norm.weight"] * normed.to(h.dtype)
        gated = (normed * F.silu(z.reshape(T, -1, vd).float())).to(h.dtype)
        return self.mlp(layer, h + F.linear(gated.reshape(T, -1), block["linear_attn.out_proj.weight"]))

    # --- path (a) -----------------------------------------------------------------------------
    def forward_dense(self, tokens):
        """Logits [T, vocab] of every position of ``tokens``: no paging, no reuse, every
        linear-attention layer run from a zero state over the whole sequence."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(len(tokens), device=self.device)
        h = self.embed_tokens(ids)
        for layer, kind in enumerate(self.types):
            if kind == LINEAR:
                h = self.mix(layer, h, *self.zero_state())
            else:
                q, k, v = self.qkv(layer, h, positions)
                h = self.finish_layer(layer, h, self.attend(layer, q, k, v, positions))
        return self.logits(h)


def build_transformers_model(geometry, seed, device):
    """A ``transformers.Qwen3NextForCausalLM`` of the geometry, built offline from a
    ``Qwen3NextConfig`` (fp32, eager attention, dense MLPs, untied LM head), its weights
    ``random_state_dict(geometry, seed)`` loaded strictly. Returns (model, facts): what the engine
    takes from transformers (layer types, norm epsilon, the rotary inv_freq and its fraction of the
    head) and the versions. Raises hf_llama.TransformersMissing without transformers."""
    transformers = hf_llama._import_transformers()
    g = geometry
    kwargs = dict(
        vocab_size=g["vocab"],
        hidden_size=g["hidden"],
        intermediate_size=g["ffn"],
        num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"],
        num_key_value_heads=g["kv_heads"],
        head_dim=g["head_dim"],
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=RMS_NORM_EPS,
        tie_word_embeddings=False,
        use_cache=False,
        attention_bias=False,
        attention_dropout=0.0,
        linear_conv_kernel_dim=g["conv_kernel"],
        linear_key_head_dim=g["linear_key_head_dim"],
        linear_value_head_dim=g["linear_value_head_dim"],
        linear_num_key_heads=g["linear_key_heads"],
        linear_num_value_heads=g["linear_value_heads"],
        num_experts=0,
        mlp_only_layers=list(range(g["layers"])),
        layer_types=layer_types(g),
    )
    rope = dict(rope_type="default", rope_theta=ROPE_THETA, partial_rotary_factor=g["partial_rotary_factor"])
    try:  # transformers 5.x: rope_parameters; 4.x: rope_theta and partial_rotary_factor
        config = transformers.Qwen3NextConfig(rope_parameters=rope, **kwargs)
    except TypeError:
        config = transformers.Qwen3NextConfig(
            rope_theta=ROPE_THETA, partial_rotary_factor=g["partial_rotary_factor"], **kwargs
        )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(config)
    model.config._attn_implementation = "eager"
    model = model.float()
    model.load_state_dict(random_state_dict(g, seed), strict=True)
    model = model.to(device).eval()

    cfg = model.config
    types = list(cfg.layer_types)
    rope_parameters = getattr(cfg, "rope_parameters", None) or {}
    partial = float(rope_parameters.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    inv_freq = model.model.rotary_emb.inv_freq.detach().float()
    modeling = __import__(type(model).__module__, fromlist=["_"])
    facts = dict(
        transformers=str(transformers.__version__),
        attn_implementation=str(cfg._attn_implementation),
        layer_types=types,
        rms_norm_eps=float(cfg.rms_norm_eps),
        partial_rotary_factor=partial,
        rope_theta=float(rope_parameters.get("rope_theta", getattr(cfg, "rope_theta", ROPE_THETA))),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        # Whether transformers ran fla's fused kernels (absent on a plain install) or its torch fallback.
        delta_rule_fast_path=bool(getattr(modeling, "is_fast_path_available", False)),
        inv_freq_equals_default=bool(
            torch.equal(inv_freq.cpu(), hf_llama.rope_inv_freq(int(g["head_dim"] * partial), ROPE_THETA))
        ),
    )
    problems = []
    if facts["attn_implementation"] != "eager":
        problems.append(f"attention implementation {facts['attn_implementation']}, not eager")
    if types != layer_types(g):
        problems.append(f"layer types {types}, not {layer_types(g)}")
    if facts["tie_word_embeddings"]:
        problems.append("tied word embeddings")
    if any("experts" in name for name, _ in model.named_parameters()):
        problems.append("mixture-of-experts layers, which this parity does not model")
    if problems:
        raise RuntimeError("transformers built a Qwen3-Next unlike the one asked for: " + "; ".join(problems))
    return model, dict(facts, inv_freq=inv_freq)
