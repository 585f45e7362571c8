#!/usr/bin/env python3
"""GPU / CPU ratios of the engine-loop host benchmarks (benchmarks/host/engine_loop_device_bench.cpp).

Reads the JSON of
  mkv_host_bench --benchmark_filter='BM_RequestLifecycle|BM_Engine|BM_InlinePatch' \
      --benchmark_repetitions=N --benchmark_report_aggregates_only=true --benchmark_format=json
and prints, for every benchmark that ran on both devices, the CPU and GPU medians (and the
per-phase counters of BM_RequestLifecycle, and its step_flush_us: the engine's flush of a step,
outside the request's time) with the GPU / CPU ratio against the 1.5x target.
Exit status: 0 when every pair is within the target, 3 when one misses (a measurement, not a
failure: run_on_device.sh reports the misses), 2 when a benchmark row failed, 77 when no GPU row
ran (and 1, Python's own, when the script itself fails).
"""
import json
import re
import sys

TARGET = 1.5
# Rows printed for reference, outside the verdict: the unit cost the target rows are made of.
REFERENCE_ROWS = ("BM_InlinePatchLaunch", "BM_InlinePatchBatchFlush")


def failures(report):
    """Rows that failed for another reason than a missing CUDA device."""
    return sorted({bench["run_name"] for bench in report.get("benchmarks", [])
                   if bench.get("error_occurred") and "no CUDA device" not in
                   bench.get("error_message", "")})


def medians(report):
    rows = {}
    for bench in report.get("benchmarks", []):
        if bench.get("aggregate_name") != "median" or bench.get("error_occurred"):
            continue
        name = bench["run_name"]
        device = re.search(r"/gpu:(\d)", name)
        if device is None:
            continue
        key = name.replace(device.group(0), "")
        # Wall time: what the engine thread loses (a blocked wait costs it too).
        values = {"time": bench["real_time"], "unit": bench["time_unit"]}
        for counter in ("begin_us", "prefill_us", "finish_us", "step_flush_us"):
            if counter in bench:
                values[counter] = bench[counter]
        rows.setdefault(key, {})["gpu" if device.group(1) == "1" else "cpu"] = values
    return rows


def main(path):
    with open(path) as handle:
        report = json.load(handle)
    failed = failures(report)
    for name in failed:
        print(f"FAILED: {name}")
    if failed:
        print(f"{len(failed)} benchmark row(s) failed")
        return 2
    rows = medians(report)
    pairs = {key: row for key, row in rows.items() if "cpu" in row and "gpu" in row}
    if not pairs:
        print("no benchmark ran on both devices (no GPU?)")
        return 77
    missed = 0
    print(f"{'benchmark':<52} {'metric':<11} {'cpu':>10} {'gpu':>10} {'gpu/cpu':>8}")
    for key in sorted(pairs):
        cpu, gpu = pairs[key]["cpu"], pairs[key]["gpu"]
        metrics = ["time"] + [m for m in ("begin_us", "prefill_us", "finish_us", "step_flush_us")
                             if m in cpu]
        for metric in metrics:
            ratio = gpu[metric] / cpu[metric] if cpu[metric] else float("inf")
            mark = ""
            if metric == "time" and key.startswith(REFERENCE_ROWS):
                mark = " (reference)"
            elif metric == "time":
                mark = " ok" if ratio <= TARGET else " MISS"
                missed += ratio > TARGET
            label = f"{metric} ({cpu['unit']})" if metric == "time" else metric
            print(f"{key:<52} {label:<11} {cpu[metric]:>10.3g} {gpu[metric]:>10.3g} "
                  f"{ratio:>7.2f}x{mark}")
    print(f"target: GPU within {TARGET}x of the CPU twin; {missed} miss(es)")
    return 3 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
