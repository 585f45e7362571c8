// The ManagedKVCacheRequest facade per sequence and step, driven as ReferenceEngine drives it
// (the sampled tokens are appended to the DecodingInferenceContext between the two calls).
// Compare with the same rigs driving the backends directly, in the same run:
// BM_CoordinatorDecodeStep (context_cache_coordinator_bench.cpp) and BM_SwaDecodeStep
// (bounded_swa_kv_page_manager_bench.cpp); the difference is the facade's overhead.
// BM_FacadeSlidingReuseDecodeStep is the composed backend with BM_FacadeReuseDecodeStep's full
// half (growth on) plus a sliding layer: their ratio is what the sliding half adds to a step.

#include <benchmark/benchmark.h>

#include "decode_step_rigs.h"

namespace mkv::bench {
namespace {

using Growth = ReuseDecodeRig::Growth;

void BM_FacadeReuseDecodeStep(benchmark::State& state) {
  Growth const growth = state.range(1) != 0 ? Growth::kEvery16th : Growth::kNone;
  runDecodeSteps<ReuseDecodeRig>(state, static_cast<int32_t>(state.range(0)), /*facade=*/true,
                                 growth);
}
BENCHMARK(BM_FacadeReuseDecodeStep)
    ->ArgNames({"batch", "growth"})
    ->ArgsProduct({{4, 64, 256, 1024}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

void BM_FacadeSwaDecodeStep(benchmark::State& state) {
  runDecodeSteps<SwaDecodeRig>(state, static_cast<int32_t>(state.range(0)), /*facade=*/true);
}
BENCHMARK(BM_FacadeSwaDecodeStep)
    ->ArgName("batch")
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Unit(benchmark::kMicrosecond);

void BM_FacadeSlidingReuseDecodeStep(benchmark::State& state) {
  runDecodeSteps<SlidingReuseDecodeRig>(state, static_cast<int32_t>(state.range(0)));
}
BENCHMARK(BM_FacadeSlidingReuseDecodeStep)
    ->ArgName("batch")
    ->Arg(4)
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace mkv::bench
