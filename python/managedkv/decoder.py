"""What the parity's decoders share (``managedkv.parity.TinyLlama``, ``managedkv.gemma3.TinyGemma3``):
the loader's check of a state dict under transformers' names, and the dense forward both run for
path (a). Only torch APIs present in torch 1.13 are used."""

import torch


def check_named_parameters(state_dict, shapes, what, ignored=()):
    """Every parameter of ``shapes`` ((name, shape) pairs), fp32, of its shape, and nothing else
    but names ending in one of ``ignored`` (buffers some versions export). Returns {name: tensor}
    (detached), raises ValueError starting with ``what`` and naming what is wrong."""
    expected = dict(shapes)
    names = set(state_dict.keys())
    missing = sorted(set(expected) - names)
    unknown = sorted(n for n in names - set(expected) if not any(n.endswith(i) for i in ignored))
    problems = []
    if missing:
        problems.append(f"missing {missing}")
    if unknown:
        problems.append(f"unknown {unknown}")
    for name, shape in expected.items():
        tensor = state_dict.get(name)
        if tensor is None:
            continue
        if tuple(tensor.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        elif tensor.dtype != torch.float32:
            problems.append(f"{name}: dtype {tensor.dtype}, expected torch.float32")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
    return {name: state_dict[name].detach() for name in expected}


def grouped_query_attention(q, k, v, query_positions, scaling, window=None):
    """q [Tq, H, D] at absolute positions [Tq]; k, v [Tk, KVH, D] for positions [0, Tk): causal
    grouped-query attention (each KV head repeated for its H / KVH query heads) with matmul +
    softmax in fp32, scores scaled by ``scaling``; with ``window`` only keys q - window < k <= q
    (a sliding layer)."""
    repeat = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(repeat, dim=1)
    v = v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    keys = torch.arange(k.shape[0], device=q.device)
    hidden = keys[None, :] > query_positions[:, None]
    if window is not None:
        hidden = hidden | (keys[None, :] <= query_positions[:, None] - window)
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


class DenseDecoder:
    """Path (a) of a decoder with the paged engine's interface (``embed_tokens``, per layer ``qkv``,
    ``attend``, ``finish_layer``, then ``logits``): every position recomputed from the whole
    sequence, no paging, no reuse."""

    def forward_dense(self, tokens):
        """Logits [T, vocab] of every position of ``tokens``."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(len(tokens), device=self.device)
        h = self.embed_tokens(ids)
        for layer in range(self.layers):
            q, k, v = self.qkv(layer, h, positions)
            h = self.finish_layer(layer, h, self.attend(layer, q, k, v, positions))
        return self.logits(h)
