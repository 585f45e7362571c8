"""Llama weights under transformers' names, and transformers' Llama forward (docs/python.md, "Parity").

The parity's paged engine (``managedkv.parity``) runs its decoder on weights given as a state dict
under the parameter names of ``transformers.LlamaForCausalLM``::

    model.embed_tokens.weight                      [vocab, hidden]
    model.layers.{i}.input_layernorm.weight        [hidden]
    model.layers.{i}.self_attn.q_proj.weight       [heads * head_dim, hidden]     (nn.Linear: [out, in])
    model.layers.{i}.self_attn.k_proj.weight       [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.v_proj.weight       [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.o_proj.weight       [hidden, heads * head_dim]
    model.layers.{i}.post_attention_layernorm.weight [hidden]
    model.layers.{i}.mlp.gate_proj.weight          [ffn, hidden]
    model.layers.{i}.mlp.up_proj.weight            [ffn, hidden]
    model.layers.{i}.mlp.down_proj.weight          [hidden, ffn]
    model.norm.weight                              [hidden]
    lm_head.weight                                 [vocab, hidden]  (tie_word_embeddings=False)

This module holds what that needs without transformers installed:

* ``check_state_dict``: the loader's validation (every name, shape and fp32, nothing missing or
  unknown; the rotary ``inv_freq`` buffer some versions export is ignored);
* ``random_state_dict``: seeded random weights under those names (the parity's own weights);
* ``ReferenceLlamaForCausalLM``: transformers' Llama forward (eager attention, no cache)
  re-implemented in plain torch with transformers' module tree, so that its ``state_dict()`` has the
  names above: RMSNorm in fp32 (``weight * (x * rsqrt(mean(x^2) + eps))``), rotary embedding with
  transformers' ``inv_freq`` and ``rotate_half``, attention scaled by ``head_dim ** -0.5`` with
  grouped-query heads repeated (``repeat_kv``) and an additive causal mask, softmax in fp32,
  SwiGLU ``down(silu(gate(x)) * up(x))``. It is the local stand-in for transformers: the self-check
  (tests/python/test_hf_llama.py) and ``--reference hf-torch`` compare the engine with it, and
  ``--reference transformers`` measures it against transformers itself;
* ``build_transformers_model``: a random-weight ``transformers.LlamaForCausalLM`` built offline
  from a ``LlamaConfig`` (fp32, eager attention), importing transformers only when called.

Only torch APIs present in torch 1.13 are used.
"""

import math

import torch
from torch import nn

from managedkv import decoder

RMS_NORM_EPS = 1e-6
ROPE_THETA = 10000.0


class TransformersMissing(RuntimeError):
    """``--reference transformers`` was asked for where transformers cannot be imported."""


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
            (p + "post_attention_layernorm.weight", (g["hidden"],)),
            (p + "mlp.gate_proj.weight", (g["ffn"], g["hidden"])),
            (p + "mlp.up_proj.weight", (g["ffn"], g["hidden"])),
            (p + "mlp.down_proj.weight", (g["hidden"], g["ffn"])),
        ]
    shapes += [("model.norm.weight", (g["hidden"],)), ("lm_head.weight", (g["vocab"], g["hidden"]))]
    return shapes


def random_state_dict(geometry, seed):
    """Seeded random fp32 weights under transformers' names: embeddings N(0, 1), each linear map
    N(0, 1/fan_in), each norm weight 1 + N(0, 0.01), so that logits are spread (greedy decoding has
    no near ties) and a norm weight left out of a forward shows. Drawn in the order (and, transposed,
    with the values) of the parity's weights before they took these names."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in parameter_shapes(geometry):
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(*shape, generator=generator)
        elif name == "model.embed_tokens.weight":
            weights[name] = torch.randn(*shape, generator=generator)
        else:  # drawn as [in, out] (x @ W), stored as nn.Linear's [out, in]
            out_features, in_features = shape
            drawn = torch.randn(in_features, out_features, generator=generator) / math.sqrt(in_features)
            weights[name] = drawn.t().contiguous()
    return weights


def check_state_dict(state_dict, geometry):
    """The loader's contract: every parameter of parameter_shapes(geometry), fp32, of its shape,
    and nothing else but rotary ``inv_freq`` buffers. Returns {name: tensor} (detached), raises
    ValueError naming what is wrong."""
    return decoder.check_named_parameters(
        state_dict,
        parameter_shapes(geometry),
        f"Llama state dict does not fit the geometry {dict(geometry)}",
        ignored=("rotary_emb.inv_freq",),
    )


def rope_inv_freq(head_dim, theta):
    """transformers' default rotary inv_freq: 1 / theta ** (arange(0, head_dim, 2) / head_dim)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def config_kwargs(geometry):
    """The LlamaConfig of a geometry (keywords accepted by transformers 4.4x and 5.x)."""
    g = geometry
    return dict(
        vocab_size=g["vocab"],
        hidden_size=g["hidden"],
        intermediate_size=g["ffn"],
        num_hidden_layers=g["layers"],
        num_attention_heads=g["heads"],
        num_key_value_heads=g["kv_heads"],
        head_dim=g["head_dim"],
        hidden_act="silu",
        max_position_embeddings=512,
        rms_norm_eps=g.get("rms_norm_eps", RMS_NORM_EPS),
        rope_theta=g.get("rope_theta", ROPE_THETA),
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        tie_word_embeddings=False,
        use_cache=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


# ----------------------------------------------------------------------------------------------
# transformers' Llama forward in plain torch (the module tree gives transformers' parameter names)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x, n_rep):
    """[B, KVH, T, D] -> [B, KVH * n_rep, T, D], query head h reading KV head h // n_rep."""
    batch, kv_heads, length, dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(batch, kv_heads, n_rep, length, dim).reshape(batch, kv_heads * n_rep, length, dim)


class _RMSNorm(nn.Module):
    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = eps

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(dtype)


class _RotaryEmbedding(nn.Module):
    def __init__(self, head_dim, theta):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta), persistent=False)

    def forward(self, position_ids):
        """cos, sin [B, T, head_dim] of positions [B, T] (the frequencies repeated: cat(f, f))."""
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class _Attention(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.head_dim = g["head_dim"]
        self.groups = g["heads"] // g["kv_heads"]
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(g["hidden"], g["heads"] * self.head_dim, bias=False)
        self.k_proj = nn.Linear(g["hidden"], g["kv_heads"] * self.head_dim, bias=False)
        self.v_proj = nn.Linear(g["hidden"], g["kv_heads"] * self.head_dim, bias=False)
        self.o_proj = nn.Linear(g["heads"] * self.head_dim, g["hidden"], bias=False)

    def forward(self, h, cos, sin, mask):
        batch, length, _ = h.shape
        shape = (batch, length, -1, self.head_dim)
        q = self.q_proj(h).view(shape).transpose(1, 2)
        k = self.k_proj(h).view(shape).transpose(1, 2)
        v = self.v_proj(h).view(shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling + mask
        weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(weights, v).transpose(1, 2).contiguous().reshape(batch, length, -1)
        return self.o_proj(out)


class _MLP(nn.Module):
    def __init__(self, g):
        super().__init__()
        self.gate_proj = nn.Linear(g["hidden"], g["ffn"], bias=False)
        self.up_proj = nn.Linear(g["hidden"], g["ffn"], bias=False)
        self.down_proj = nn.Linear(g["ffn"], g["hidden"], bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, g, eps):
        super().__init__()
        self.self_attn = _Attention(g)
        self.mlp = _MLP(g)
        self.input_layernorm = _RMSNorm(g["hidden"], eps)
        self.post_attention_layernorm = _RMSNorm(g["hidden"], eps)

    def forward(self, h, cos, sin, mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Model(nn.Module):
    def __init__(self, g, eps, theta):
        super().__init__()
        self.embed_tokens = nn.Embedding(g["vocab"], g["hidden"])
        self.layers = nn.ModuleList([_DecoderLayer(g, eps) for _ in range(g["layers"])])
        self.norm = _RMSNorm(g["hidden"], eps)
        self.rotary_emb = _RotaryEmbedding(g["head_dim"], theta)

    def forward(self, input_ids):
        batch, length = input_ids.shape
        h = self.embed_tokens(input_ids)
        positions = torch.arange(length, device=input_ids.device)[None, :].expand(batch, length)
        cos, sin = self.rotary_emb(positions)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        mask = torch.full((length, length), torch.finfo(h.dtype).min, dtype=h.dtype, device=h.device)
        mask = mask.triu(1)[None, None]  # additive: 0 on and below the diagonal
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.norm(h)


class ReferenceLlamaForCausalLM(nn.Module):
    """transformers' ``LlamaForCausalLM`` forward (eager attention, no cache, fp32) in plain torch,
    for a geometry (``vocab``, ``hidden``, ``layers``, ``heads``, ``kv_heads``, ``head_dim``,
    ``ffn``; optional ``rms_norm_eps``, ``rope_theta``). ``forward(input_ids [B, T])`` returns the
    logits [B, T, vocab]; ``load_state_dict`` takes transformers' names."""

    def __init__(self, geometry):
        super().__init__()
        eps = geometry.get("rms_norm_eps", RMS_NORM_EPS)
        theta = geometry.get("rope_theta", ROPE_THETA)
        self.model = _Model(geometry, eps, theta)
        self.lm_head = nn.Linear(geometry["hidden"], geometry["vocab"], bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


# ----------------------------------------------------------------------------------------------
# transformers itself


def _import_transformers():
    try:
        import transformers  # noqa: PLC0415 (only --reference transformers needs it)
    except ImportError as error:
        raise TransformersMissing(
            "--reference transformers needs the transformers package (pip install transformers; "
            f"Debian does not package it), which cannot be imported here: {error}. "
            "--reference hf-torch runs the same comparison against transformers' Llama forward "
            "re-implemented in torch (managedkv.hf_llama.ReferenceLlamaForCausalLM)."
        ) from error
    return transformers


def config_rope(config):
    """(rope_type, rope_theta) of a LlamaConfig: transformers 5 keeps them in ``rope_parameters``,
    4.x in ``rope_theta`` and ``rope_scaling``."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return parameters.get("rope_type", parameters.get("type", "default")), float(parameters["rope_theta"])
    scaling = getattr(config, "rope_scaling", None)
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    return rope_type, float(config.rope_theta)


def build_transformers_model(geometry, seed, device):
    """A ``transformers.LlamaForCausalLM`` of the geometry, built offline from a ``LlamaConfig``
    (no download), fp32, eager attention, in eval mode on ``device``, its weights
    ``random_state_dict(geometry, seed)`` loaded with ``load_state_dict(strict=True)`` (which also
    checks that every name and shape of this module is transformers' own).

    Returns (model, facts): facts has the transformers version, the attention implementation the
    model runs, the config's rms_norm_eps, rope type and theta, tie_word_embeddings, and the
    rotary ``inv_freq`` transformers computed. Raises TransformersMissing without transformers."""
    transformers = _import_transformers()
    kwargs = config_kwargs(geometry)
    try:
        config = transformers.LlamaConfig(attn_implementation="eager", **kwargs)
    except TypeError:  # a version whose config takes no attn_implementation keyword
        config = transformers.LlamaConfig(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)  # transformers' own initialisation, overwritten below
    model = transformers.LlamaForCausalLM(config)
    model.config._attn_implementation = "eager"
    model = model.float()
    model.load_state_dict(random_state_dict(geometry, seed), strict=True)
    model = model.to(device).eval()

    rope_type, theta = config_rope(model.config)
    # The implementation every module's config names (a module may hold its own copy of the config).
    implementations = sorted(
        {
            str(m.config._attn_implementation)
            for m in model.modules()
            if hasattr(getattr(m, "config", None), "_attn_implementation")
        }
    )
    facts = dict(
        transformers=str(transformers.__version__),
        attn_implementation=",".join(implementations),
        rms_norm_eps=float(model.config.rms_norm_eps),
        rope_type=str(rope_type),
        rope_theta=theta,
        tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
        head_dim=int(getattr(model.config, "head_dim", geometry["head_dim"]) or geometry["head_dim"]),
    )
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    facts["inv_freq_source"] = "transformers (model.model.rotary_emb.inv_freq)" if inv_freq is not None else "computed"
    facts["inv_freq"] = (inv_freq if inv_freq is not None else rope_inv_freq(geometry["head_dim"], theta)).detach()

    problems = []
    if facts["attn_implementation"] != "eager":
        problems.append(f"attention implementation {facts['attn_implementation']}, not eager")
    if facts["rope_type"] != "default":
        problems.append(f"rope type {facts['rope_type']}, not default")
    if facts["tie_word_embeddings"]:
        problems.append("tied word embeddings")
    if facts["head_dim"] != geometry["head_dim"]:
        problems.append(f"head_dim {facts['head_dim']}, not {geometry['head_dim']}")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        problems.append("parameters not fp32")
    if problems:
        raise RuntimeError("transformers built a Llama unlike the one asked for: " + "; ".join(problems))
    return model, facts
