// ContextCacheCoordinator on CPU tensors:
//   * BM_CoordinatorDecodeStep: prepareDecodeStep + completeDecodeStep per sequence and step
//     (target: <= 200 ns without page growth, docs/benchmarks.md, "What is measured, and how");
//     growth:0 no row ever grows, growth:1 every row grows by one page every 16th step (rig:
//     decode_step_rigs.h);
//   * BM_CoordinatorBeginRequest: beginRequest + finish of a batch of four 32k-token prompts with
//     95 % of their blocks cached and fewer free pages than a cold admission would need, so that
//     the batch feasibility check (batchMayFit) looks every prompt up before the acquisitions.

#include <benchmark/benchmark.h>

#include <exception>
#include <stdexcept>
#include <vector>

#include "decode_step_rigs.h"
#include "host_bench_support.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::bench {
namespace {

using Growth = ReuseDecodeRig::Growth;

void BM_CoordinatorDecodeStep(benchmark::State& state) {
  Growth const growth = state.range(1) != 0 ? Growth::kEvery16th : Growth::kNone;
  runDecodeSteps<ReuseDecodeRig>(state, static_cast<int32_t>(state.range(0)), /*facade=*/false,
                                 growth);
}
BENCHMARK(BM_CoordinatorDecodeStep)
    ->ArgNames({"batch", "growth"})
    ->ArgsProduct({{64, 256, 1024}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

constexpr int32_t kPromptTokens = 32768;
constexpr int32_t kPage = 16;
constexpr int32_t kBatch = 4;

void BM_CoordinatorBeginRequest(benchmark::State& state) {
  int32_t const blocks = kPromptTokens / kPage;
  int32_t const cachedBlocks = blocks * 95 / 100;
  KVCacheRuntimeConfig config = benchRuntimeConfig(kBatch, kPromptTokens + kPage, kPage);
  config.model.numFullAttentionLayers = 1;
  config.contextReuse = true;
  config.numPages = kBatch * blocks + 600;  // cold admission of the batch would need 8196 free
  std::unique_ptr<KVCacheRuntime> const runtime = KVCacheRuntime::create(config);
  ContextCacheCoordinator& coordinator = *runtime->contextCache();
  std::vector<ResidentRef> const residents = acquireResidents(*runtime, kBatch);

  ContextCacheBatchAdmission cached;
  ContextCacheBatchAdmission query;
  for (int32_t i = 0; i < kBatch; ++i) {
    ContextCacheSequenceAdmission sequence;
    sequence.tokenIds = randomTokens(kPromptTokens, 200 + static_cast<uint64_t>(i));
    sequence.resident = residents[static_cast<std::size_t>(i)];
    cached.sequences.push_back(sequence);
    sequence.tokenIds[static_cast<std::size_t>(cachedBlocks * kPage)] = uniqueToken(i);
    query.sequences.push_back(std::move(sequence));
  }
  try {
    auto begun = coordinator.beginRequest(cached, kDecodeHeadroom, nullptr);
    if (begun.status != ContextCacheStatus::kOk) {
      throw std::runtime_error("populating the cache failed");
    }
    coordinator.preparePrefill(begun.admission->request);
    std::vector<ContextCacheSequenceAdvance> const prefill(
        kBatch, ContextCacheSequenceAdvance{&kDecodeToken, 1, kPromptTokens});
    coordinator.finalizePrefillPublication(begun.admission->request, prefill);
    coordinator.finish(begun.admission->request);

    for (auto _ : state) {
      auto admitted = coordinator.beginRequest(query, kDecodeHeadroom, nullptr);
      if (admitted.status != ContextCacheStatus::kOk ||
          admitted.admission->prefillStarts.front() != cachedBlocks * kPage) {
        throw std::runtime_error("admission failed or reused an unexpected length");
      }
      coordinator.finish(admitted.admission->request);
    }
  } catch (std::exception const& error) {
    state.SkipWithError(error.what());
  }
  setTokenCounters(state, int64_t{kBatch} * kPromptTokens);
}
BENCHMARK(BM_CoordinatorBeginRequest)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace mkv::bench
