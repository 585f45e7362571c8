"""A Gemma-3 text decoder for the parity (docs/python.md, "Parity"): sliding-window and full
attention layers, under transformers' parameter names.

Gemma-3 differs from Llama where a KV cache notices it: most layers attend to a sliding window of
the last ``window`` positions (a query at position q reads keys q - window < k <= q), one layer in
``pattern`` attends to every position, and the two kinds rotate positions with different RoPE
bases. The rest is the model's own math, reproduced from transformers' ``Gemma3ForCausalLM``
(eager attention): embeddings scaled by ``sqrt(hidden)``; RMSNorm computed in fp32 and scaled by
``1 + weight``; per head RMSNorm of queries and keys (``q_norm``, ``k_norm``) before RoPE;
attention scaled by ``query_pre_attn_scalar ** -0.5``; four norms per layer (input, post-attention,
pre- and post-feed-forward), the attention and MLP outputs normed before their residual adds; a
GELU (tanh) gated MLP; final RMSNorm and an untied LM head. Parameter names::

    model.embed_tokens.weight                          [vocab, hidden]
    model.layers.{i}.input_layernorm.weight            [hidden]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight   nn.Linear [out, in]
    model.layers.{i}.self_attn.{q,k}_norm.weight       [head_dim]
    model.layers.{i}.post_attention_layernorm.weight   [hidden]
    model.layers.{i}.pre_feedforward_layernorm.weight  [hidden]
    model.layers.{i}.post_feedforward_layernorm.weight [hidden]
    model.layers.{i}.mlp.{gate,up,down}_proj.weight    nn.Linear [out, in]
    model.norm.weight                                  [hidden]
    lm_head.weight                                     [vocab, hidden]  (tie_word_embeddings=False)

Only torch APIs present in torch 1.13 are used; transformers is imported only by
``build_transformers_model``.
"""

import torch
import torch.nn.functional as F

from managedkv import decoder, hf_llama

RMS_NORM_EPS = 1e-6
GLOBAL_ROPE_THETA = 1_000_000.0  # transformers' rope_theta default for Gemma-3's full layers
LOCAL_ROPE_THETA = 10_000.0  # rope_local_base_freq: the sliding layers'
SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(geometry):
    """transformers' layer pattern: layer i is full when (i + 1) % pattern == 0, else sliding."""
    pattern = geometry["pattern"]
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(geometry["layers"])]


def parameter_shapes(geometry):
    """(name, shape) of every parameter, in the order random_state_dict draws them."""
    g = geometry
    q_out, kv_out = g["heads"] * g["head_dim"], g["kv_heads"] * g["head_dim"]
    shapes = [("model.embed_tokens.weight", (g["vocab"], g["hidden"]))]
    for i in range(g["layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (g["hidden"],)),
            (p + "self_attn.q_proj.weight", (q_out, g["hidden"])),
            (p + "self_attn.k_proj.weight", (kv_out, g["hidden"])),
            (p + "self_attn.v_proj.weight", (kv_out, g["hidden"])),
            (p + "self_attn.o_proj.weight", (g["hidden"], q_out)),
            (p + "self_attn.q_norm.weight", (g["head_dim"],)),
            (p + "self_attn.k_norm.weight", (g["head_dim"],)),
            (p + "post_attention_layernorm.weight", (g["hidden"],)),
            (p + "pre_feedforward_layernorm.weight", (g["hidden"],)),
            (p + "post_feedforward_layernorm.weight", (g["hidden"],)),
            (p + "mlp.gate_proj.weight", (g["ffn"], g["hidden"])),
            (p + "mlp.up_proj.weight", (g["ffn"], g["hidden"])),
            (p + "mlp.down_proj.weight", (g["hidden"], g["ffn"])),
        ]
    shapes += [("model.norm.weight", (g["hidden"],)), ("lm_head.weight", (g["vocab"], g["hidden"]))]
    return shapes


def random_state_dict(geometry, seed):
    """Seeded random fp32 weights under transformers' names: embeddings N(0, 1), each linear map
    N(0, 1/fan_in), each norm weight N(0, 0.1) (Gemma scales by 1 + weight, so a norm left out of a
    forward shows)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(geometry):
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            values = values * 0.1
        elif len(shape) == 2 and not name.endswith("embed_tokens.weight"):
            values = values / shape[1] ** 0.5
        weights[name] = values
    return weights


def check_state_dict(state_dict, geometry):
    """Every parameter of parameter_shapes(geometry), fp32, of its shape, nothing else; returns
    {name: tensor} (detached), raises ValueError naming what is wrong."""
    return decoder.check_named_parameters(
        state_dict, parameter_shapes(geometry), f"Gemma-3 state dict does not fit the geometry {dict(geometry)}"
    )


class TinyGemma3(decoder.DenseDecoder):
    """The decoder the dense reference and the paged engine both run (the engine's interface, as
    parity.TinyLlama's): ``embed_tokens``, per layer ``qkv`` -> ``attend`` (or paged reads) ->
    ``finish_layer``, ``logits``; ``layer_window(layer)`` is the layer's sliding window (None: full)."""

    def __init__(self, geometry, state_dict, device, inv_freq=None, facts=None, dtype=torch.float32):
        self.__dict__.update(geometry)
        self.device = device
        self.dtype = dtype
        facts = facts or {}
        self.eps = facts.get("rms_norm_eps", RMS_NORM_EPS)
        self.types = facts.get("layer_types", layer_types(geometry))
        self.sliding_window = facts.get("sliding_window", geometry["window"])
        self.scaling = facts.get("query_pre_attn_scalar", geometry["head_dim"]) ** -0.5
        self.embed_scale = torch.tensor(facts.get("embed_scale", geometry["hidden"] ** 0.5)).to(torch.float32)
        checked = check_state_dict(state_dict, geometry)
        w = {k: v.to(device=device, dtype=dtype) for k, v in checked.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.blocks = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            block = {name: w[p + name + ".weight"] for name in _LAYER_PARAMETERS}
            self.blocks.append(block)
        self.final_norm = w["model.norm.weight"]
        self.lm_head = w["lm_head.weight"]
        if inv_freq is None:
            inv_freq = {
                SLIDING: hf_llama.rope_inv_freq(self.head_dim, LOCAL_ROPE_THETA),
                FULL: hf_llama.rope_inv_freq(self.head_dim, GLOBAL_ROPE_THETA),
            }
        self.inv_freq = {kind: f.to(device=device, dtype=torch.float32) for kind, f in inv_freq.items()}

    @classmethod
    def random(cls, geometry, seed, device, dtype=torch.float32):
        return cls(geometry, random_state_dict(geometry, seed), device, dtype=dtype)

    def layer_window(self, layer):
        return self.sliding_window if self.types[layer] == SLIDING else None

    def rms_norm(self, x, w):
        """transformers' order: normalised and scaled in fp32, then cast back."""
        f = x.float()
        return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + w.float())).to(x.dtype)

    def rope(self, x, positions, kind):
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[kind][None, :]
        cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def embed_tokens(self, ids):
        return self.embed[ids] * self.embed_scale.to(self.dtype)

    def qkv(self, layer, h, positions):
        block, kind = self.blocks[layer], self.types[layer]
        x = self.rms_norm(h, block["input_layernorm"])
        q = F.linear(x, block["self_attn.q_proj"]).view(-1, self.heads, self.head_dim)
        k = F.linear(x, block["self_attn.k_proj"]).view(-1, self.kv_heads, self.head_dim)
        v = F.linear(x, block["self_attn.v_proj"]).view(-1, self.kv_heads, self.head_dim)
        q = self.rms_norm(q, block["self_attn.q_norm"])
        k = self.rms_norm(k, block["self_attn.k_norm"])
        return self.rope(q, positions, kind), self.rope(k, positions, kind), v

    def attend(self, layer, q, k, v, query_positions):
        """Causal grouped-query attention, and on a sliding layer only keys q - window < k."""
        return decoder.grouped_query_attention(q, k, v, query_positions, self.scaling, self.layer_window(layer))

    def finish_layer(self, layer, h, attention):
        block = self.blocks[layer]
        attention = F.linear(attention.reshape(h.shape[0], -1), block["self_attn.o_proj"])
        h = h + self.rms_norm(attention, block["post_attention_layernorm"])
        x = self.rms_norm(h, block["pre_feedforward_layernorm"])
        gate = F.gelu(F.linear(x, block["mlp.gate_proj"]), approximate="tanh")
        mlp = F.linear(gate * F.linear(x, block["mlp.up_proj"]), block["mlp.down_proj"])
        return h + self.rms_norm(mlp, block["post_feedforward_layernorm"])

    def logits(self, h):
        return F.linear(self.rms_norm(h, self.final_norm), self.lm_head)


_LAYER_PARAMETERS = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def build_transformers_model(geometry, seed, device):
    """A ``transformers.Gemma3ForCausalLM`` of the geometry, built offline from a
    ``Gemma3TextConfig`` (fp32, eager attention, untied LM head), its weights
    ``random_state_dict(geometry, seed)`` loaded strictly. Returns (model, facts): what the engine
    must take from transformers rather than assume (layer types, sliding window, norm epsilon,
    query scalar, embedding scale, the rotary inv_freq of each layer type) and the transformers
    version. Raises hf_llama.TransformersMissing without transformers."""
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
        max_position_embeddings=512,
        rms_norm_eps=RMS_NORM_EPS,
        query_pre_attn_scalar=g["head_dim"],
        sliding_window=g["window"],
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,
    )
    try:  # transformers 5.x names the layer types; 4.x derives them from sliding_window_pattern
        config = transformers.Gemma3TextConfig(layer_types=layer_types(g), **kwargs)
    except TypeError:
        config = transformers.Gemma3TextConfig(sliding_window_pattern=g["pattern"], **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config)
    model.config._attn_implementation = "eager"
    model = model.float()
    model.load_state_dict(random_state_dict(g, seed), strict=True)
    model = model.to(device).eval()

    cfg = model.config
    types = list(getattr(cfg, "layer_types", None) or layer_types(g))
    rotary = model.model.rotary_emb
    inv_freq = {}
    for kind in (SLIDING, FULL):
        buffer = getattr(rotary, f"{kind}_inv_freq", None)
        if buffer is not None:
            inv_freq[kind] = buffer.detach().float()
    if not inv_freq:  # 4.x: one rotary module per kind
        inv_freq[FULL] = rotary.inv_freq.detach().float()
        inv_freq[SLIDING] = model.model.rotary_emb_local.inv_freq.detach().float()
    embed_scale = getattr(model.model.embed_tokens, "embed_scale", None)
    facts = dict(
        transformers=str(transformers.__version__),
        attn_implementation=str(cfg._attn_implementation),
        layer_types=types,
        sliding_window=int(cfg.sliding_window),
        rms_norm_eps=float(cfg.rms_norm_eps),
        query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
        embed_scale=float(embed_scale) if embed_scale is not None else g["hidden"] ** 0.5,
        final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None),
        attn_logit_softcapping=getattr(cfg, "attn_logit_softcapping", None),
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        inv_freq_equals_default={
            kind: bool(
                torch.equal(
                    inv_freq[kind].cpu(),
                    hf_llama.rope_inv_freq(g["head_dim"], LOCAL_ROPE_THETA if kind == SLIDING else GLOBAL_ROPE_THETA),
                )
            )
            for kind in inv_freq
        },
    )
    problems = []
    if facts["attn_implementation"] != "eager":
        problems.append(f"attention implementation {facts['attn_implementation']}, not eager")
    if types != layer_types(g):
        problems.append(f"layer types {types}, not {layer_types(g)}")
    if facts["final_logit_softcapping"] is not None or facts["attn_logit_softcapping"] is not None:
        problems.append("logit softcapping, which this parity does not model")
    if facts["tie_word_embeddings"]:
        problems.append("tied word embeddings")
    if problems:
        raise RuntimeError("transformers built a Gemma-3 unlike the one asked for: " + "; ".join(problems))
    return model, dict(facts, inv_freq=inv_freq)
