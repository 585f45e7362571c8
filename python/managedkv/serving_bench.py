"""Serving benchmark (docs/benchmarks.md, "A model served through the example engine"): a decoder
with random weights serves the first requests of a Mooncake trace through managedkv.engine, with
prefix reuse and without (the full-storage backend, same lifecycle), and reports for each: prompt
tokens and prefill tokens computed, time to first token, generated tokens per second and the share
of wall time spent inside library calls.

    python3 -m managedkv.serving_bench --trace tests/data/mooncake_first500.jsonl --requests 16 \\
        --geometry llama3-8b --device cuda --dtype bf16 --json out.json

Prompts come from the trace's hash ids: each id is ``--block-tokens`` tokens drawn from a generator
seeded by the id (the trace's 512-token blocks; the same id gives the same tokens, so shared
blocks are shared prefixes), the last block cut to ``input_length``; ``--block-tokens`` smaller
than 512 scales every prompt down by that ratio (a tiny model's CPU run). Every request arrives at
step 0 (an offline batch: the trace's timestamps are not replayed): the first ``--max-batch``
begin a request, the rest join in flight as rows finish, prefilled in chunks under
``--max-batched-tokens``. Generation is greedy, at most ``--max-new-tokens`` per request (the
trace's output length if shorter). Times are wall seconds on the machine that ran it; on CUDA the
library share drains the device before each library call (LibraryClock), which slows the run a
little and keeps the share honest. With ``--reuse both`` the exit status is 1 when the reuse run
reused nothing, or (fp32) when any request generated other tokens than without reuse.
"""

import argparse
import gc
import json
import platform
import sys
import time

import torch

from managedkv import engine, hf_llama, parity

GEOMETRIES = {
    "tiny": parity.SIZES["tiny"],
    "small": parity.SIZES["small"],
    # Llama-3-8B: 32 layers, 32 query and 8 KV heads of 128, SwiGLU of 14,336, vocab 128,256.
    "llama3-8b": dict(
        vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, page=16,
        rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
}


def random_weights(geometry, seed, device):
    """The kinds of hf_llama.random_state_dict (norms 1 + N(0, 0.01), linear maps N(0, 1/fan_in),
    embeddings N(0, 1)), drawn on `device` (fp32) one tensor at a time:
    an 8B model's weights are made where they run instead of in host memory."""
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in hf_llama.parameter_shapes(geometry):
        values = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
        if name.endswith("norm.weight"):
            values = 1.0 + 0.01 * values
        elif len(shape) == 2 and not name.endswith("embed_tokens.weight"):
            values = values / shape[1] ** 0.5
        weights[name] = values
    return weights


def trace_prompts(path, requests, block_tokens, vocab, max_new_tokens):
    """The first `requests` records of a Mooncake trace as Sequences (see the module docstring)."""
    sequences = []
    with open(path) as trace:
        for index, line in enumerate(trace):
            if index == requests:
                break
            record = json.loads(line)
            length = max(1, record["input_length"] * block_tokens // 512)
            prompt = []
            for block in record["hash_ids"]:
                generator = torch.Generator().manual_seed(1_000_003 * int(block) + 7)
                prompt += torch.randint(1, vocab, (block_tokens,), generator=generator).tolist()
            prompt = prompt[:length]
            new_tokens = max(1, min(max_new_tokens, int(record["output_length"])))
            sequences.append(engine.Sequence(f"r{index}", prompt, new_tokens, arrival=0))
    return sequences


def serve(model, sequences, args, reuse):
    """One run of the engine over fresh copies of `sequences`; returns its figures."""
    fresh = [engine.Sequence(s.name, s.prompt, s.max_new_tokens, arrival=0) for s in sequences]
    longest = max(len(s.prompt) + s.max_new_tokens for s in fresh)
    paged = engine.PagedEngine(
        model,
        args.pool_tokens // model.page,
        max_batch=args.max_batch,
        max_sequence_length=-(-longest // model.page) * model.page + model.page,
        chunk=args.chunk,
        max_batched_tokens=args.max_batched_tokens,
        attention=args.attention,
        keep_logits=False,
        reuse=reuse,
        time_library=True,
    )
    first_token = {}
    original_emit = paged.emit

    def emit(row, token):  # wall time of each sequence's first token
        if not row.seq.generated:
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            first_token[row.seq.name] = time.perf_counter()
        original_emit(row, token)

    paged.emit = emit
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for seq in fresh:
        paged.submit(seq)
    with torch.no_grad():
        paged.run()
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - began
    ttft = sorted(first_token[s.name] - began for s in fresh)
    quantile = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    summary = paged.summary(fresh, wall)
    figures = dict(
        reuse=reuse,
        backend=str(paged.runtime.backend),
        requests=len(fresh),
        prompt_tokens=summary["prompt_tokens"],
        prefill_tokens_computed=summary["prefill_tokens_computed"],
        reused_fraction=summary["reused_fraction"],
        generated_tokens=summary["generated_tokens"],
        ttft_s_p50=round(quantile(0.5), 4),
        ttft_s_p99=round(quantile(0.99), 4),
        wall_s=round(wall, 3),
        generated_tokens_per_s=summary["generated_tokens_per_s"],
        prompt_tokens_per_s=round(summary["prompt_tokens"] / wall, 1),
        library_s=round(paged.library.seconds, 4),
        library_calls=paged.library.calls,
        library_share=round(paged.library.seconds / wall, 5),
        engine_steps=summary["engine_steps"],
        chunked_prefills=summary["chunked_prefills"],
        in_flight_joins=summary["in_flight_joins"],
        evicted_records=summary["evicted_records"],
    )
    paged.runtime.shutdown()
    return figures, [s.generated for s in fresh]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python3 -m managedkv.serving_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash block (512: the trace's)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--pool-tokens", type=int, default=400_000)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-batched-tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--attention", choices=["matmul", "sdpa"], default="sdpa")
    parser.add_argument("--reuse", choices=["both", "on", "off"], default="both")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.attention == "sdpa" and not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        parser.error("--attention sdpa needs torch >= 2.1")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    geometry = dict(GEOMETRIES[args.geometry])
    began = time.perf_counter()
    weights = random_weights(geometry, args.seed, device)
    model = parity.TinyLlama(geometry, weights, device, dtype=dtype)
    del weights
    if device.type == "cuda":
        torch.cuda.empty_cache()
    setup_s = time.perf_counter() - began
    sequences = trace_prompts(args.trace, args.requests, args.block_tokens, model.vocab, args.max_new_tokens)
    runs, outputs = {}, {}
    for reuse in {"both": (True, False), "on": (True,), "off": (False,)}[args.reuse]:
        name = "reuse" if reuse else "no_reuse"
        runs[name], outputs[name] = serve(model, sequences, args, reuse)
        gc.collect()  # the run's engine (its pool) goes before the next one allocates its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = runs[name]
        print(
            f"{name:<9} prompt {r['prompt_tokens']:>8} computed {r['prefill_tokens_computed']:>8} "
            f"(reused {100 * r['reused_fraction']:.1f} %)  TTFT p50 {r['ttft_s_p50']:.3f} s p99 {r['ttft_s_p99']:.3f} s  "
            f"{r['generated_tokens_per_s']:.1f} tok/s  wall {r['wall_s']:.2f} s  library {100 * r['library_share']:.2f} %"
        )
    report = dict(
        geometry=args.geometry,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        dtype=args.dtype,
        attention=args.attention,
        torch=torch.__version__,
        trace=args.trace,
        requests=args.requests,
        block_tokens=args.block_tokens,
        max_new_tokens=args.max_new_tokens,
        max_batch=args.max_batch,
        max_batched_tokens=args.max_batched_tokens,
        pool_tokens=args.pool_tokens,
        setup_s=round(setup_s, 2),
        runs=runs,
    )
    if len(outputs) == 2:
        # Reuse must not change what is generated (greedy; in bf16 a reordered sum may flip a near tie).
        same = sum(a == b for a, b in zip(outputs["reuse"], outputs["no_reuse"]))
        report["same_outputs_with_and_without_reuse"] = f"{same}/{len(sequences)}"
        print(f"outputs equal with and without reuse: {same}/{len(sequences)}")
        # fp32 must generate the same tokens either way; and the reuse run must have reused.
        report["passed"] = (args.dtype != "fp32" or same == len(sequences)) and runs["reuse"]["reused_fraction"] > 0
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0 if report.get("passed", True) else 1


if __name__ == "__main__":
    sys.exit(main())
