#!/usr/bin/env python3
"""PyTorch baselines for the shapes of mkv_gpu_bench (G1-G6 of docs/benchmarks.md).

Per case, in one process on one stream: torch ``copy_`` of the same bytes (the denominator),
then ``index_select(out=)`` where the case is a gather, ``index_copy_`` with a gathered
temporary, and advanced-index assignment. Every method's output is compared bitwise with an
expected tensor through an int16 view (random bf16 bit patterns contain NaNs, so value
equality would be the wrong check). Times are medians over CUDA-event-bracketed repetitions.

With ``--mkv-csv`` (the CSV of mkv_gpu_bench) it also prints the G6 gates: managedkv
>= 1.0x index_select(out=) and >= 3.5x index_copy_ / advanced-index assignment. With
``--torch-csv`` it measures nothing and prints the G6 gates from an earlier run's two CSVs
(no torch or GPU needed).

Exit status: 0 ran and verified; 2 a verification mismatch; 77 no torch or no CUDA device.
"""

import argparse
import csv
import statistics
import sys

try:
    import torch
except ImportError:  # the development machines have no torch (enough for --torch-csv)
    torch = None

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TOKEN_BYTES = 8 * 128 * 2  # K or V row of one token: 8 heads x 128 dims x bf16
BANDWIDTH_BYTES = GIB


class Bench:
    def __init__(self, reps, warmups, case_filter):
        self.reps = reps
        self.warmups = warmups
        self.filter = case_filter
        self.rows = []
        self.gen = torch.Generator(device="cpu").manual_seed(20261202)

    def selected(self, name):
        return not self.filter or self.filter in name

    def median_us(self, op, reps=None):
        reps = reps or self.reps
        for _ in range(self.warmups):
            op()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            op()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) * 1000.0)
        return statistics.median(times)

    def random_bf16(self, *shape):
        bits = torch.randint(-32768, 32768, shape, dtype=torch.int16, device="cuda")
        return bits.view(torch.bfloat16)

    def perm(self, n, limit):
        return torch.randperm(limit, generator=self.gen)[:n].to("cuda")

    def add(self, case, method, nbytes, us, denominator_us, ok, note=""):
        row = {
            "case": case,
            "method": method,
            "bytes": nbytes,
            "us": us,
            "tbps": 2.0 * nbytes / (us * 1e6),
            "ratio": denominator_us / us,
            "status": "-",
            "mismatch": not ok,
            "note": note,
        }
        self.rows.append(row)
        print(f"  {case:<30} {method:<40} {us:>10.1f} us {row['tbps']:>6.2f} TB/s "
              f"x{row['ratio']:<6.3f}{'' if ok else ' MISMATCH'} {note}", flush=True)

    @staticmethod
    def same_bits(actual, expected):
        return torch.equal(actual.view(torch.int16), expected.view(torch.int16))

    def copy_row(self, case, flat_src, nbytes):
        """torch copy_ of nbytes contiguous bytes: the same-run denominator."""
        elems = nbytes // 2
        src = flat_src[:elems]
        dst = torch.empty_like(src)
        us = self.median_us(lambda: dst.copy_(src))
        self.add(case, "torch copy_ (same bytes)", nbytes, us, us, self.same_bits(dst, src))
        del dst
        return us

    def gather_methods(self, case, src, dim, src_ids, dst_shape, dst_ids, nbytes, gather):
        """index_select(out=) (gathers only), index_copy_, advanced-index assignment."""
        denominator = self.copy_row(case, src.view(-1), nbytes)
        # Reference through advanced indexing (a different kernel from index_select).
        expected_rows = src[src_ids] if dim == 0 else src[:, src_ids]
        dst = torch.full(dst_shape, -1, dtype=torch.int16, device="cuda").view(torch.bfloat16)
        if gather:
            us = self.median_us(lambda: torch.index_select(src, dim, src_ids, out=dst))
            self.add(case, "torch index_select(out=)", nbytes, us, denominator,
                     self.same_bits(dst, expected_rows))

        def index_copy():
            dst.index_copy_(dim, dst_ids, src.index_select(dim, src_ids))

        def advanced():
            if dim == 0:
                dst[dst_ids] = src[src_ids]
            else:
                dst[:, dst_ids] = src[:, src_ids]

        for method, op in (("torch index_copy_(index_select)", index_copy),
                           ("torch dst[ids] = src[ids]", advanced)):
            dst.view(torch.int16).fill_(-1)
            us = self.median_us(op)
            self.add(case, method, nbytes, us, denominator,
                     self.same_bits(dst.index_select(dim, dst_ids), expected_rows))
        del dst, expected_rows

    def page_cases(self):
        for kind, gather, sequential in (("G1 gather", True, False),
                                         ("G2 scatter-gather", False, False),
                                         ("G3 sequential", True, True)):
            for page_kib in (32, 64, 128, 256):
                case = f"{kind} {page_kib}KiB"
                if not self.selected(case):
                    continue
                page_bytes = page_kib * KIB
                items = BANDWIDTH_BYTES // (2 * page_bytes)
                elems = page_bytes // 2
                src = self.random_bf16(2, 2 * items, elems)  # K and V halves of a 2N-page pool
                if sequential:
                    src_ids = torch.arange(items, device="cuda")
                else:
                    src_ids = self.perm(items, 2 * items)
                dst_pages = items if gather else 2 * items
                dst_ids = (torch.arange(items, device="cuda") if gather
                           else self.perm(items, dst_pages))
                print(f"{case}: {items} items x K+V pages of {page_kib} KiB", flush=True)
                self.gather_methods(case, src, 1, src_ids, (2, dst_pages, elems), dst_ids,
                                    2 * items * page_bytes, gather)
                del src
                torch.cuda.empty_cache()

    def decode_cases(self):
        page_bytes = 32 * KIB
        elems = page_bytes // 2
        for layers in (32, 80):
            for pages in (16, 64, 256):
                case = f"G4 decode L={layers} n={pages}"
                if not self.selected(case):
                    continue
                items = pages // 2
                src = [self.random_bf16(2, pages, elems) for _ in range(layers)]
                dst = [torch.empty_like(s) for s in src]
                src_ids = self.perm(items, pages)
                dst_ids = self.perm(items, pages)
                nbytes = layers * 2 * items * page_bytes
                print(f"{case}: {layers} layers x {items} ids x K+V pages of 32 KiB", flush=True)
                flat = self.random_bf16(nbytes // 2)
                denominator = self.copy_row(case, flat, nbytes)
                del flat

                def index_copy():
                    for s, d in zip(src, dst):
                        d.index_copy_(1, dst_ids, s.index_select(1, src_ids))

                def advanced():
                    for s, d in zip(src, dst):
                        d[:, dst_ids] = s[:, src_ids]

                for method, op in ((f"torch {layers} x index_copy_", index_copy),
                                   (f"torch {layers} x dst[ids] = src[ids]", advanced)):
                    for d in dst:
                        d.view(torch.int16).fill_(-1)
                    us = self.median_us(op)
                    ok = all(self.same_bits(d.index_select(1, dst_ids), s.index_select(1, src_ids))
                             for s, d in zip(src, dst))
                    self.add(case, method, nbytes, us, denominator, ok)
                del src, dst
                torch.cuda.empty_cache()

    def row_cases(self):
        for n in (256, 32768):
            for row_kib in (2, 8, 16, 64):
                row_bytes = row_kib * KIB
                width = row_bytes // 2
                for kind in ("copyRows", "compactBatch", "captureHidden"):
                    case = f"G5 {kind} {row_kib}KiB n={n}"
                    if not self.selected(case):
                        continue
                    print(f"{case}", flush=True)
                    if kind == "compactBatch":
                        self.compact_case(case, n, width, row_bytes)
                        continue
                    src = self.random_bf16(2 * n, width)
                    src_ids = self.perm(n, 2 * n)
                    gather = kind == "copyRows"
                    dst_ids = torch.arange(n, device="cuda") if gather else self.perm(n, n)
                    self.gather_methods(case, src, 0, src_ids, (n, width), dst_ids, n * row_bytes,
                                        gather)
                    del src
                    torch.cuda.empty_cache()

    def compact_case(self, case, n, width, row_bytes):
        keep = torch.rand(n, generator=self.gen) < 0.5
        survivors = torch.nonzero(keep).flatten()
        moved = int((survivors != torch.arange(len(survivors))).sum())
        survivors = survivors.to("cuda")
        k = len(survivors)
        pristine = self.random_bf16(n, width)
        buf = pristine.clone()
        nbytes = moved * row_bytes
        denominator = self.copy_row(case, pristine.view(-1), max(nbytes, 2))
        expected = pristine.index_select(0, survivors)

        def compact():
            buf[:k] = buf[survivors]

        us = self.median_us(compact)
        buf.copy_(pristine)
        compact()
        self.add(case, "torch buf[:k] = buf[survivors]", nbytes, us, denominator,
                 self.same_bits(buf[:k], expected))
        del pristine, buf, expected
        torch.cuda.empty_cache()


def print_table(rows):
    print(f"\n{'case':<30} {'method':<40} {'bytes':>12} {'us (median)':>12} {'TB/s':>7} "
          f"{'ratio':>7} {'target':<18} {'status':<6} note")
    for r in rows:
        print(f"{r['case']:<30} {r['method']:<40} {r['bytes']:>12} {r['us']:>12.1f} "
              f"{r['tbps']:>7.2f} {r['ratio']:>7.3f} {'baseline':<18} {r['status']:<6} "
              f"{'MISMATCH ' if r['mismatch'] else ''}{r['note']}")


def g6_gates(rows, mkv_csv):
    """managedkv >= 1.0x torch index_select(out=), >= 3.5x index_copy_ / advanced assignment."""
    mkv = {}
    with open(mkv_csv, newline="") as f:
        for r in csv.DictReader(f):
            if r["method"].startswith("mkv") and "graph" not in r["method"]:
                mkv[r["case"]] = float(r["us_median"])
    gates = []
    for r in rows:
        if r["case"] not in mkv or "copy_ (same" in r["method"]:
            continue
        # "index_copy_(index_select)" also names index_select: match the method, not a substring.
        need = 1.0 if r["method"].startswith("torch index_select") else 3.5
        speedup = r["us"] / mkv[r["case"]]
        gates.append((r["case"], r["method"], mkv[r["case"]], r["us"], speedup, need))
    print(f"\nG6: managedkv vs torch on the same shapes\n{'case':<30} {'torch method':<40} "
          f"{'mkv us':>10} {'torch us':>10} {'speedup':>8} {'target':<10} status")
    for case, method, mkv_us, torch_us, speedup, need in gates:
        print(f"{case:<30} {method:<40} {mkv_us:>10.1f} {torch_us:>10.1f} {speedup:>8.2f} "
              f"{'>= %.1fx' % need:<10} {'PASS' if speedup >= need else 'MISS'}")
    return gates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="write the rows here")
    parser.add_argument("--mkv-csv", help="CSV of mkv_gpu_bench for the G6 comparison")
    parser.add_argument("--torch-csv", help="measure nothing: G6 gates from this CSV of an "
                        "earlier run (needs --mkv-csv)")
    parser.add_argument("--filter", default="", help="only cases whose name contains this")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmups", type=int, default=3)
    args = parser.parse_args()
    if args.torch_csv:
        if not args.mkv_csv:
            parser.error("--torch-csv needs --mkv-csv")
        with open(args.torch_csv, newline="") as f:
            rows = [{"case": r["case"], "method": r["method"], "us": float(r["us_median"])}
                    for r in csv.DictReader(f)]
        gates = g6_gates(rows, args.mkv_csv)
        return 0 if gates else 1
    if torch is None:
        print("torch_baselines.py: torch is not installed; nothing measured", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("torch_baselines.py: no CUDA device visible; nothing measured", file=sys.stderr)
        return 77
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}; median of {args.reps} "
          f"reps after {args.warmups} warm-ups", flush=True)
    bench = Bench(args.reps, args.warmups, args.filter)
    with torch.no_grad():
        bench.page_cases()
        bench.decode_cases()
        bench.row_cases()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["case", "method", "bytes", "us_median", "tbps_rw", "ratio_vs_copy",
                             "mismatch", "note"])
            for r in bench.rows:
                writer.writerow([r["case"], r["method"], r["bytes"], f"{r['us']:.3f}",
                                 f"{r['tbps']:.4f}", f"{r['ratio']:.4f}", int(r["mismatch"]),
                                 r["note"]])
    print_table(bench.rows)
    if args.mkv_csv:
        g6_gates(bench.rows, args.mkv_csv)
    return 2 if any(r["mismatch"] for r in bench.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
