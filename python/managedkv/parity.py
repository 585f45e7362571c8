"""Parity of a tiny decoder run by a reference and through managedkv (docs/python.md, "Parity").

    python3 -m managedkv.parity --model llama|gemma3|hybrid --dtype fp32|bf16 --device cpu|cuda
        --reference dense|hf-torch|transformers --json FILE

The model (``llama``: transformers' Llama, RMSNorm, RoPE, grouped-query attention, SwiGLU;
``gemma3``: transformers' Gemma-3 text decoder, sliding-window and full layers, managedkv.gemma3;
``hybrid``: transformers' Qwen3-Next, gated delta net and full attention layers,
managedkv.qwen3_next, its recurrent state in the library's RecurrentStatePool rows and reused
through exact checkpoints; random weights from a seed, under transformers' parameter names) runs (a) by the reference, every
token's logits recomputed from the whole sequence with no paging and no reuse: ``dense`` the same
decoder code, ``hf-torch`` (Llama) transformers' Llama forward re-implemented in torch
(``managedkv.hf_llama``), ``transformers`` the transformers model itself (eager attention, no
cache; transformers is imported only then), the engine's weights being that module's
``state_dict()``; and (b) through managedkv: each step's K and V are written into the library's
pool pages through the step's ``slotMapping``, and attention reads the pages back through
``blockTable`` (even attention layers, as FlashAttention / vLLM would) or through the FlashInfer
CSR triple (odd ones); a sliding layer reads the sliding pool through the sliding table's views,
whose rows keep only the window; a linear-attention layer advances each row's state in its
resident slot's recurrent rows, which the library captures and restores. The workload has prefix
hits (on the hybrid model checkpoint restores), an in-flight joiner whose prefill is chunked over
decode steps, compaction of finished rows, a hit on KV written by decode steps, eviction from a
small pool and (Llama) a host tier that onboards evicted blocks back. fp32: greedy tokens must be
identical and every logit computed on path (b) within 1e-3 of path (a); bf16: SGLang's KL protocol
(tokens sampled at temperature 1, k3 of decode against re-prefill logprobs at most 3e-3). Each path
must engage what it exists for (reuse, eviction, onboarding, window rotation, restores). Exit status 0 when
everything holds, 1 otherwise, 2 when transformers is asked for and missing.

Only torch APIs present in torch 1.13 are used (attention is matmul + softmax).
"""

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

from managedkv import decoder, gemma3, hf_llama, qwen3_next
from managedkv.engine import PagedEngine, Sequence, flex_available  # noqa: F401 (Sequence: the tests')

LOGIT_TOLERANCE = 1e-3
KL_THRESHOLD = 3e-3  # SGLang's kl_threshold for its cache self-consistency tests

SIZES = {
    # vocab, hidden, layers, heads, kv heads, head dim, ffn, tokens per page
    "tiny": dict(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, page=16),
    "small": dict(vocab=512, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, ffn=512, page=16),
}
# Gemma-3: a sliding window of two pages; every third layer full (the real models: every sixth).
GEMMA3_SIZES = {
    size: dict(geometry, layers=3 * (geometry["layers"] // 2), window=2 * geometry["page"], pattern=3)
    for size, geometry in SIZES.items()
}
# Qwen3-Next: gated delta net and full attention layers alternating (the real models: three linear
# layers to one full), the linear layers as wide as the attention (key heads = KV heads, value heads
# = query heads), a conv of 4 taps, RoPE on a quarter of each head.
HYBRID_SIZES = {
    size: dict(
        geometry,
        layers=2 * geometry["layers"],
        full_attention_interval=2,
        linear_key_heads=geometry["kv_heads"],
        linear_value_heads=geometry["heads"],
        linear_key_head_dim=geometry["head_dim"],
        linear_value_head_dim=geometry["head_dim"],
        conv_kernel=4,
        partial_rotary_factor=0.25,
    )
    for size, geometry in SIZES.items()
}
MODEL_SIZES = {"llama": SIZES, "gemma3": GEMMA3_SIZES, "hybrid": HYBRID_SIZES}


class TinyLlama(decoder.DenseDecoder):
    """A Llama decoder in the math of transformers' ``LlamaForCausalLM`` (eager attention): embeddings,
    per layer RMSNorm -> attention (RoPE, grouped-query heads) -> residual -> RMSNorm -> SwiGLU ->
    residual, final RMSNorm, LM head. Its weights are a state dict under transformers' parameter
    names and layouts (nn.Linear's [out, in], applied as ``x @ W.T``), checked by
    ``hf_llama.check_state_dict``: the parity's own seeded random weights (``random``), or a
    ``transformers.LlamaForCausalLM``'s ``state_dict()`` (``--reference transformers``). The dense
    forward and the paged engine both run on the methods below."""

    def __init__(self, geometry, state_dict, device, inv_freq=None, dtype=torch.float32):
        self.__dict__.update(geometry)
        self.device = device
        self.dtype = dtype
        self.eps = geometry.get("rms_norm_eps", hf_llama.RMS_NORM_EPS)
        self.rope_theta = geometry.get("rope_theta", hf_llama.ROPE_THETA)
        self.scaling = self.head_dim**-0.5
        checked = hf_llama.check_state_dict(state_dict, geometry)
        weights = {k: v.to(device=device, dtype=dtype) for k, v in checked.items()}
        self.embed = weights["model.embed_tokens.weight"]
        self.blocks = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            self.blocks.append(
                dict(
                    attn_norm=weights[p + "input_layernorm.weight"],
                    wq=weights[p + "self_attn.q_proj.weight"],
                    wk=weights[p + "self_attn.k_proj.weight"],
                    wv=weights[p + "self_attn.v_proj.weight"],
                    wo=weights[p + "self_attn.o_proj.weight"],
                    mlp_norm=weights[p + "post_attention_layernorm.weight"],
                    w_gate=weights[p + "mlp.gate_proj.weight"],
                    w_up=weights[p + "mlp.up_proj.weight"],
                    w_down=weights[p + "mlp.down_proj.weight"],
                )
            )
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = weights["lm_head.weight"]
        if inv_freq is None:
            inv_freq = hf_llama.rope_inv_freq(self.head_dim, self.rope_theta)
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)

    @classmethod
    def random(cls, geometry, seed, device, dtype=torch.float32):
        return cls(geometry, hf_llama.random_state_dict(geometry, seed), device, dtype=dtype)

    def rms_norm(self, x, w):
        """transformers' order: normalised in fp32, cast back, then scaled."""
        f = x.float()
        return w * (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def rope(self, x, positions):
        """x [T, heads, D] rotated by its absolute positions [T] (transformers' rotate_half
        convention: the first half of each head pairs with the second)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def layer_window(self, layer):
        return None  # every layer attends to every position

    def embed_tokens(self, ids):
        return self.embed[ids]

    def qkv(self, layer, h, positions):
        block = self.blocks[layer]
        x = self.rms_norm(h, block["attn_norm"])
        q = F.linear(x, block["wq"]).view(-1, self.heads, self.head_dim)
        k = F.linear(x, block["wk"]).view(-1, self.kv_heads, self.head_dim)
        v = F.linear(x, block["wv"]).view(-1, self.kv_heads, self.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def attend(self, layer, q, k, v, query_positions):
        """Causal grouped-query attention, scaled by head_dim ** -0.5."""
        return decoder.grouped_query_attention(q, k, v, query_positions, self.scaling)

    def finish_layer(self, layer, h, attention):
        block = self.blocks[layer]
        h = h + F.linear(attention.reshape(h.shape[0], -1), block["wo"])
        x = self.rms_norm(h, block["mlp_norm"])
        return h + F.linear(F.silu(F.linear(x, block["w_gate"])) * F.linear(x, block["w_up"]), block["w_down"])

    def logits(self, h):
        return F.linear(self.rms_norm(h, self.final_norm), self.lm_head)


def make_engine(model, args, num_pages, host_pool_tokens=0):
    """The parity's engine (managedkv.engine.PagedEngine): 4 rows, joiners prefilled in chunks of
    --chunk tokens with no step budget, every computed position's logits kept; greedy (fp32) or
    sampled at temperature 1 from a seeded generator (bf16, SGLang's KL protocol)."""
    sampler = torch.Generator().manual_seed(args.seed + 2) if args.dtype == "bf16" else None
    return PagedEngine(
        model, num_pages, host_pool_tokens=host_pool_tokens, chunk=args.chunk, attention=args.attention, sampler=sampler
    )


def reference_run(reference, seq):
    """Path (a): greedy tokens with every step recomputed from the whole sequence by the reference
    (tokens -> logits [T, vocab]), and the logits of every position of the final sequence."""
    tokens = list(seq.prompt)
    generated = []
    for _ in range(len(seq.generated)):
        token = int(reference(tokens)[-1].argmax())
        generated.append(token)
        tokens.append(token)
    return generated, reference(tokens[:-1])


def compare(reference, sequences):
    """Greedy tokens and logits of path (b) against path (a), over every position (b) computed."""
    tokens_equal, max_diff, positions = True, 0.0, 0
    for seq in sequences:
        generated, reference_logits = reference_run(reference, seq)
        if generated != seq.generated:
            tokens_equal = False
            print(f"  {seq.name}: tokens differ: managedkv {seq.generated}, reference {generated}")
            continue
        for position, logits in seq.logits.items():
            diff = float((logits - reference_logits[position]).abs().max())
            max_diff = max(max_diff, diff)
            positions += 1
    return tokens_equal, max_diff, positions


def compare_kl(reference, sequences):
    """SGLang's cache self-consistency (bf16): the logprob of each token the paged path sampled,
    at the decode that sampled it, against its logprob in a re-prefill of prompt + output by path
    (a) (no cache), through the k3 estimator mean(exp(r) - 1 - r), r = prefill - decode logprob;
    cold sequences (nothing reused) and warm ones apart. Also the largest logit difference over every
    position path (b) computed, and how often the decode's argmax is the re-prefill's."""
    k3 = {"cold": [], "warm": []}
    max_diff, positions, agree = 0.0, 0, 0
    for seq in sequences:
        prefill = reference(seq.prompt + seq.generated[:-1]).float()
        for position, logits in seq.logits.items():
            max_diff = max(max_diff, float((logits.float() - prefill[position]).abs().max()))
            positions += 1
        for j, token in enumerate(seq.generated):
            position = len(seq.prompt) - 1 + j
            decode = seq.logits[position].float()
            r = F.log_softmax(prefill[position], -1)[token] - F.log_softmax(decode, -1)[token]
            k3["warm" if seq.reused > 0 else "cold"].append(float(torch.exp(r) - 1 - r))
            agree += int(int(decode.argmax()) == int(prefill[position].argmax()))
    scored = k3["cold"] + k3["warm"]
    mean = lambda values: sum(values) / len(values) if values else 0.0  # noqa: E731
    return dict(
        kl_k3=mean(scored),
        kl_k3_cold=mean(k3["cold"]),
        kl_k3_warm=mean(k3["warm"]),
        tokens_scored=len(scored),
        warm_tokens_scored=len(k3["warm"]),
        argmax_agreement=agree / len(scored) if scored else 0.0,
        max_abs_logit_diff=max_diff,
        positions_compared=positions,
    )


class Workload:
    """Prompts built from shared prefixes, seeded."""

    def __init__(self, vocab, seed):
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.vocab = vocab
        self.count = 0

    def tokens(self, n):
        return torch.randint(1, self.vocab, (n,), generator=self.generator).tolist()

    def seq(self, prompt, new_tokens, join_step=0, decode_written_from=None):
        """A sequence; a joiner's ``join_step`` counts the decode steps after its batch's prefill
        (PagedEngine.serve)."""
        self.count += 1
        return Sequence(f"s{self.count}", prompt, new_tokens, arrival=join_step, decode_written_from=decode_written_from)


def run_path(name, engine, reference, body, guards, collected, kl=False):
    """Runs `body(engine)` (which returns its sequences, appended to `collected`), compares them
    with the reference (greedy tokens and logits; with `kl`, SGLang's KL protocol) and reports the
    path's metric deltas and whether its guards hold."""
    start_metrics = engine.metrics()
    sequences = body(engine)
    collected.extend(sequences)
    end_metrics = engine.metrics()
    delta = {k: end_metrics[k] - start_metrics[k] for k in end_metrics}
    failed_guards = [g for g in guards if delta[g] == 0]
    if kl:
        figures = compare_kl(reference, sequences)
        figures["tokens_equal"] = None  # sampled: the re-prefill scores the decode's own tokens
        judged = figures["kl_k3"] <= KL_THRESHOLD and figures["tokens_scored"] > 0
        if any(seq.reused > 0 for seq in sequences):
            judged = judged and figures["warm_tokens_scored"] > 0
        summary = f"KL(k3) {figures['kl_k3']:.2e} (cold {figures['kl_k3_cold']:.2e}, warm {figures['kl_k3_warm']:.2e})"
    else:
        tokens_equal, max_diff, positions = compare(reference, sequences)
        figures = dict(max_abs_logit_diff=max_diff, tokens_equal=tokens_equal, positions_compared=positions)
        judged = tokens_equal and max_diff <= LOGIT_TOLERANCE and positions > 0
        summary = f"max|dlogit| {max_diff:.3e}  tokens_equal {tokens_equal}"
    result = dict(
        **figures,
        sequences=len(sequences),
        generated_tokens=sum(len(s.generated) for s in sequences),
        **delta,
        guards=list(guards),
        failed_guards=failed_guards,
    )
    result["passed"] = judged and not failed_guards
    print(
        f"{name:<22} positions {figures['positions_compared']:5d}  {summary}  "
        f"reused {delta['reused_tokens']:4d}  evicted {delta['evicted_records']:3d}  "
        f"onboarded {delta['onboarded_pages']:3d}  joins {delta['in_flight_joins']}  "
        f"chunks {delta['prefill_chunks']}  {'ok' if result['passed'] else 'FAILED ' + str(failed_guards)}"
    )
    return result


REFERENCES = {
    "dense": "the same decoder (TinyLlama) on the same weights, dense: no paging, no reuse",
    "hf-torch": "transformers' LlamaForCausalLM forward re-implemented in torch "
    "(managedkv.hf_llama.ReferenceLlamaForCausalLM), the engine on its state_dict()",
    "transformers": "transformers.LlamaForCausalLM itself (eager attention, fp32, called on the whole "
    "sequence without a cache), the engine on its state_dict()",
}


def build_reference(args, geometry, device):
    """The paged engine's model and path (a) of --reference: (model, reference, facts, stand_in),
    where reference(tokens) gives the logits [T, vocab] of every position, recomputed from the whole
    sequence, facts go into the JSON, and stand_in (for transformers only, else None) is the
    hf-torch forward on transformers' weights. Raises hf_llama.TransformersMissing."""
    if args.model in TRANSFORMERS_MODELS:
        return build_model_reference(args, geometry, device)
    dtype = model_dtype(args)
    if args.reference == "dense":
        model = TinyLlama.random(geometry, args.seed, device, dtype=dtype)
        return model, model.forward_dense, dict(weights="hf_llama.random_state_dict(seed)"), None

    def wrap(module, call):
        def reference(tokens):
            with torch.no_grad():
                return call(module, torch.tensor([tokens], dtype=torch.long, device=device))[0]

        return reference

    if args.reference == "hf-torch":
        module = hf_llama.ReferenceLlamaForCausalLM(geometry)
        module.load_state_dict(hf_llama.random_state_dict(geometry, args.seed), strict=True)
        module = module.to(device).eval()
        model = TinyLlama(geometry, module.state_dict(), device, dtype=dtype)
        cast_parameters(module, dtype)
        facts = dict(
            weights="hf_llama.random_state_dict(seed), loaded into ReferenceLlamaForCausalLM (strict); "
            "the engine loads its state_dict()"
        )
        return model, wrap(module, lambda m, ids: m(ids)), facts, None

    hf, hf_facts = hf_llama.build_transformers_model(geometry, args.seed, device)
    inv_freq = hf_facts.pop("inv_freq")
    engine_geometry = dict(geometry, rms_norm_eps=hf_facts["rms_norm_eps"], rope_theta=hf_facts["rope_theta"])
    model = TinyLlama(engine_geometry, hf.state_dict(), device, inv_freq=inv_freq, dtype=dtype)
    own = hf_llama.rope_inv_freq(geometry["head_dim"], hf_facts["rope_theta"]).to(inv_freq.device)
    hf_facts["inv_freq_equals_computed"] = bool(torch.equal(own, inv_freq.float()))
    reference = wrap(hf, lambda m, ids: m(input_ids=ids, use_cache=False).logits)
    facts = dict(
        weights="hf_llama.random_state_dict(seed), loaded into transformers.LlamaForCausalLM (strict); "
        "the engine loads its state_dict()",
        transformers=hf_facts.pop("transformers"),
        transformers_config=hf_facts,
    )
    # The local stand-in for transformers (what CI checks the loader against), to measure against it.
    stand_in = hf_llama.ReferenceLlamaForCausalLM(engine_geometry)
    stand_in.load_state_dict(hf.state_dict(), strict=True)
    cast_parameters(hf, dtype)
    cast_parameters(stand_in, dtype)
    return model, reference, facts, wrap(stand_in.to(device).eval(), lambda m, ids: m(ids))


def model_dtype(args):
    return torch.bfloat16 if args.dtype == "bf16" else torch.float32


def cast_parameters(module, dtype):
    """The module's parameters in `dtype`, its buffers (rotary inv_freq, embedding scale) kept as
    they are: what loading a checkpoint in that dtype gives, where ``module.to(dtype)`` would round
    the rotary frequencies too."""
    for parameter in module.parameters():
        parameter.data = parameter.data.to(dtype)


TRANSFORMERS_MODELS = {
    # --model: (the decoder's module, its class, transformers' class; no hf-torch stand-in)
    "gemma3": (gemma3, gemma3.TinyGemma3, "Gemma3ForCausalLM"),
    "hybrid": (qwen3_next, qwen3_next.TinyQwen3Next, "Qwen3NextForCausalLM"),
}


def build_model_reference(args, geometry, device):
    """build_reference for --model gemma3 and hybrid: ``dense`` the engine's decoder (gemma3.TinyGemma3,
    qwen3_next.TinyQwen3Next) run densely, ``transformers`` transformers' model of that architecture
    (the module's ``build_transformers_model``), whose state_dict() the engine loads and whose facts
    (layer types, norm epsilon, rotary frequencies; Gemma-3's window, query scalar and embedding
    scale; Qwen3-Next's rotary fraction) it takes."""
    module, decoder_class, hf_class = TRANSFORMERS_MODELS[args.model]
    dtype = model_dtype(args)
    weights = f"{module.__name__.rsplit('.', 1)[-1]}.random_state_dict(seed)"
    if args.reference == "dense":
        model = decoder_class.random(geometry, args.seed, device, dtype=dtype)
        return model, model.forward_dense, dict(weights=weights), None
    if args.reference != "transformers":
        raise SystemExit(f"parity: --model {args.model} takes --reference dense or transformers")
    hf, hf_facts = module.build_transformers_model(geometry, args.seed, device)
    inv_freq = hf_facts.pop("inv_freq")
    model = decoder_class(geometry, hf.state_dict(), device, inv_freq=inv_freq, facts=hf_facts, dtype=dtype)
    cast_parameters(hf, dtype)

    def reference(tokens):
        with torch.no_grad():
            ids = torch.tensor([tokens], dtype=torch.long, device=device)
            return hf(input_ids=ids, use_cache=False).logits[0]

    facts = dict(
        weights=f"{weights}, loaded into transformers.{hf_class} (strict); the engine loads its state_dict()",
        transformers=hf_facts.pop("transformers"),
        transformers_config=hf_facts,
    )
    return model, reference, facts, None


def stand_in_check(stand_in, reference, sequences):
    """Max |logit difference| and argmax agreement of the pure-torch stand-in and transformers over
    the whole final sequences the parity generated."""
    max_diff, positions, argmax_equal = 0.0, 0, True
    for seq in sequences:
        tokens = seq.prompt + seq.generated[:-1]
        a, b = stand_in(tokens), reference(tokens)
        max_diff = max(max_diff, float((a - b).abs().max()))
        argmax_equal = argmax_equal and bool(torch.equal(a.argmax(-1), b.argmax(-1)))
        positions += len(tokens)
    return dict(
        max_abs_logit_diff=max_diff,
        argmax_equal=argmax_equal,
        positions_compared=positions,
        passed=argmax_equal and max_diff <= LOGIT_TOLERANCE,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m managedkv.parity", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        choices=["llama", "gemma3", "hybrid"],
        default="llama",
        help="llama: attention-only; gemma3: sliding-window and full layers (the composed backend); "
        "hybrid: Qwen3-Next, gated delta net and full attention layers (the hybrid deployment: "
        "exact checkpoints)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda with a CUDA build of the module")
    parser.add_argument(
        "--reference",
        choices=sorted(REFERENCES),
        default="dense",
        help="path (a): " + "; ".join(f"{k}: {v}" for k, v in REFERENCES.items()),
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk", type=int, default=16, help="tokens of a joiner's prefill per step")
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fp32: greedy tokens identical, logits within 1e-3; bf16: tokens sampled at temperature "
        "1, SGLang's KL of the decode logprobs against a re-prefill of prompt + output, at most 3e-3",
    )
    parser.add_argument(
        "--attention",
        choices=["matmul", "sdpa", "flex"],
        default="matmul",
        help="path (b)'s attention over the gathered pages: the model's matmul + softmax, or torch's "
        "fused scaled_dot_product_attention (torch >= 2.1); flex: FlexAttention over the whole pool "
        "through the physical-to-logical page map (torch >= 2.5)",
    )
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    if args.attention == "sdpa" and (sdpa is None or "scale" not in (sdpa.__doc__ or "")):
        print("parity: --attention sdpa needs torch >= 2.1 (scaled_dot_product_attention with scale)", file=sys.stderr)
        return 2
    if args.attention == "flex" and not flex_available():
        print("parity: --attention flex needs torch >= 2.5 (torch.nn.attention.flex_attention)", file=sys.stderr)
        return 2

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":  # fp32 parity: no TF32 in matrix products (torch's default, made sure)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    began = time.time()
    geometry = dict(MODEL_SIZES[args.model][args.size])
    try:
        model, reference, facts, stand_in = build_reference(args, geometry, device)
    except hf_llama.TransformersMissing as error:
        print(f"parity: {error}", file=sys.stderr)
        return 2
    work = Workload(model.vocab, args.seed)
    P = model.page
    system_a, system_b = work.tokens(3 * P), work.tokens(2 * P + 8)

    def warm(engine):
        # Founders share nothing yet; the joiner shares system_a (published by the first
        # founder's prefill) and is prefilled in chunks; the second request hits both prefixes.
        first = [work.seq(system_a + work.tokens(7), 6), work.seq(system_b + work.tokens(9), 10)]
        joiner = [work.seq(system_a + work.tokens(30), 5, join_step=1)]
        engine.serve(first, joiner)
        second = [work.seq(system_a + work.tokens(5), 4), work.seq(system_b + work.tokens(12), 4)]
        engine.serve(second)
        return first + joiner + second

    def pressure(engine, rounds):
        sequences = []
        for _ in range(rounds):
            batch = [work.seq(work.tokens(4 * P + 3), 3), work.seq(work.tokens(4 * P + 5), 3)]
            engine.serve(batch)
            sequences += batch
        return sequences

    def evict_then_miss(engine):
        sequences = pressure(engine, 4)
        again = [work.seq(system_a + work.tokens(6), 4)]
        engine.serve(again)
        return sequences + again

    def decode_hit(engine):
        # The second turn's prompt is the first turn's prompt and reply plus a question: its hit
        # reaches into KV the first turn's decode steps wrote (published at completion).
        first = work.seq(work.tokens(2 * P + 5), 3 * P)
        engine.serve([first])
        second = work.seq(
            first.prompt + first.generated + work.tokens(9), 4, decode_written_from=len(first.prompt)
        )
        engine.serve([second])
        return [first, second]

    def host_tier(engine):
        sequences = warm(engine) + pressure(engine, 4)
        again = [work.seq(system_a + work.tokens(6), 4), work.seq(system_b + work.tokens(3), 4)]
        engine.serve(again)
        return sequences + again

    def hybrid_warm(engine):
        # The joiner is cold and chunked: its chunk ends are captured as checkpoints. The second
        # request restores the first founder's prompt end (mid-page: the partial page too), the
        # joiner's chunk end at system_a, and a joiner of its own restores the second founder's
        # decode end (its follow-up turn) at admission.
        first = [work.seq(system_a + work.tokens(7), 6), work.seq(system_b + work.tokens(9), 10)]
        joiner = [work.seq(system_a + work.tokens(30), 5, join_step=1)]
        engine.serve(first, joiner)
        second = [work.seq(first[0].prompt + work.tokens(6), 4), work.seq(system_a + work.tokens(5), 4)]
        follow_up = first[1].prompt + first[1].generated + work.tokens(5)
        joiner2 = [work.seq(follow_up, 4, join_step=1, decode_written_from=len(first[1].prompt))]
        engine.serve(second, joiner2)
        return first + joiner + second + joiner2

    paths, sequences = {}, []
    sliding = args.model == "gemma3"
    hybrid = args.model == "hybrid"
    kl = args.dtype == "bf16"

    def path(name, engine, body, guards):
        paths[name] = run_path(name, engine, reference, body, guards, sequences, kl=kl)

    engine = make_engine(model, args, num_pages=28)
    not_run = {}
    if hybrid:
        # Exact checkpoints: every reuse is a restore of recurrent rows (and of a partial page).
        warm_guards = ["reused_tokens", "restored_checkpoints", "in_flight_joins", "prefill_chunks"]
        warm_guards += ["chunk_end_captures", "mid_page_restores", "decode_kv_reused"]
        path("warm_restore_chunked_join", engine, hybrid_warm, warm_guards)
        path("decode_written_hit", engine, decode_hit, ["decode_kv_reused", "restored_checkpoints"])
    else:
        # On Gemma-3 the warm path's hits map cached windows and its decodes rotate them.
        warm_guards = ["reused_tokens", "in_flight_joins", "prefill_chunks"]
        path("warm_reuse_chunked_join", engine, warm, warm_guards + (["window_pages_dropped"] if sliding else []))
        path("decode_written_hit", engine, decode_hit, ["decode_kv_reused"])
        not_run["restored_checkpoints"] = (
            f"0: {args.model} has no recurrent layers; checkpoint restores belong to hybrid deployments "
            "(--model hybrid)"
        )
    path("eviction_then_miss", engine, evict_then_miss, ["evicted_records", "evicted_misses"])
    if sliding:
        not_run["host_tier_onboard"] = "the composed backend (sliding windows with reuse) has no host tier"
    elif hybrid:
        not_run["host_tier_onboard"] = (
            "the host tier serves attention-only deployments: a hybrid model's checkpoints stay on the device"
        )
    else:
        tiered = make_engine(model, args, num_pages=28, host_pool_tokens=64 * P)
        path("host_tier_onboard", tiered, host_tier, ["reused_tokens", "evicted_records", "onboarded_pages"])
    if stand_in is not None:
        check = stand_in_check(stand_in, reference, sequences)
        facts["hf_torch_vs_transformers"] = check
        print(
            f"hf-torch stand-in vs transformers: positions {check['positions_compared']}  "
            f"max|dlogit| {check['max_abs_logit_diff']:.3e}  argmax_equal {check['argmax_equal']}  "
            f"{'ok' if check['passed'] else 'DIFFERS: the local self-check no longer mirrors transformers'}"
        )

    keys = ["reused_tokens", "evicted_records", "onboarded_pages", "restored_checkpoints", "positions_compared"]
    report = dict(
        model=args.model,
        size=args.size,
        device=args.device,
        dtype=args.dtype,
        attention=args.attention,
        reference=args.reference,
        reference_is=REFERENCES[args.reference],
        seed=args.seed,
        torch=torch.__version__,
        python=platform.python_version(),
        geometry=geometry,
        **facts,
        max_abs_logit_diff=max(p["max_abs_logit_diff"] for p in paths.values()),
        **{k: sum(p[k] for p in paths.values()) for k in keys},
        not_run=not_run,
        paths=paths,
    )
    if kl:
        scored = sum(p["tokens_scored"] for p in paths.values())
        report.update(
            kl_threshold=KL_THRESHOLD,
            kl_k3=sum(p["kl_k3"] * p["tokens_scored"] for p in paths.values()) / max(1, scored),
            kl_k3_max_path=max(p["kl_k3"] for p in paths.values()),
            tokens_scored=scored,
            tokens_equal=None,
        )
        verdict = f"KL(k3) {report['kl_k3']:.2e}, worst path {report['kl_k3_max_path']:.2e} (threshold {KL_THRESHOLD})"
    else:
        report.update(tolerance=LOGIT_TOLERANCE, tokens_equal=all(p["tokens_equal"] for p in paths.values()))
        verdict = (
            f"max|dlogit| {report['max_abs_logit_diff']:.3e} (tolerance {LOGIT_TOLERANCE}), "
            f"tokens_equal {report['tokens_equal']}"
        )
    report["passed"] = all(p["passed"] for p in paths.values())
    report["seconds"] = round(time.time() - began, 2)
    print(
        f"parity ({args.model}, {args.dtype}, {args.reference}) {'PASSED' if report['passed'] else 'FAILED'}: "
        f"{report['positions_compared']} positions, {verdict}, reused {report['reused_tokens']}, "
        f"evicted {report['evicted_records']}, onboarded {report['onboarded_pages']}, "
        f"restored_checkpoints {report['restored_checkpoints']}, {report['seconds']} s"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
