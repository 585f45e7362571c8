// Bounded-SWA decode bookkeeping per sequence and step (target: O(1), <= 100 ns per sequence per
// step, docs/benchmarks.md, "What is measured, and how"): prepareDecodeStep + completeDecodeStep
// of BoundedSwaKVPageManager for the whole batch on CPU tensors, including the page-table patch
// upload (its host twin). Rig: decode_step_rigs.h.
// The same step through the ManagedKVCacheRequest facade: managed_kv_cache_request_bench.cpp.

#include <benchmark/benchmark.h>

#include "decode_step_rigs.h"

namespace mkv::bench {
namespace {

void BM_SwaDecodeStep(benchmark::State& state) {
  runDecodeSteps<SwaDecodeRig>(state, static_cast<int32_t>(state.range(0)), /*facade=*/false);
}
BENCHMARK(BM_SwaDecodeStep)
    ->ArgName("batch")
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace mkv::bench
