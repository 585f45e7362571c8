#pragma once
/// \file host_bench_support.h
/// Pieces shared by the host benchmarks (mkv_host_bench): deterministic token streams, the
/// per-token / per-sequence counters and the runtimes of the decode-step benchmarks. Method and
/// results: docs/benchmarks.md ("Host").
///
/// Every benchmark reports CPU time of whole iterations (Google Benchmark's default): on the
/// shared 2-core machine wall time runs 2-3x CPU time, and reading a clock inside an iteration
/// costs ~85 ns (steady_clock) to ~2 us (thread CPU clock), so nothing is timed per call.

#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "mkv/kv_cache_runtime.h"

namespace mkv::bench {

/// Token ids of the benchmark prompts lie in [0, kVocabulary); ids >= kVocabulary are free for
/// markers that make a prompt unique (see uniqueToken).
inline constexpr int32_t kVocabulary = 128000;

/// `count` pseudo-random token ids in [0, kVocabulary), the same for the same seed.
inline std::vector<int32_t> randomTokens(std::size_t count, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::uniform_int_distribution<int32_t> token(0, kVocabulary - 1);
  std::vector<int32_t> tokens(count);
  for (int32_t& t : tokens) {
    t = token(random);
  }
  return tokens;
}

/// A token id no random prompt contains, distinct for every `serial`.
inline int32_t uniqueToken(int64_t serial) {
  return kVocabulary + static_cast<int32_t>(serial % (int64_t{1} << 30));
}

/// Seconds per unit: Google Benchmark divides a rate counter by the measured seconds and kInvert
/// turns that into seconds per unit. The console prints it with an SI prefix ("2.6ns"); JSON and
/// CSV output hold plain seconds (2.6e-09).
inline benchmark::Counter secondsPer(double unitsPerIteration) {
  return benchmark::Counter(unitsPerIteration, benchmark::Counter::kIsIterationInvariantRate |
                                                   benchmark::Counter::kInvert);
}

/// items_per_second = tokens/s and ns_per_token, for `tokens` tokens per iteration.
inline void setTokenCounters(benchmark::State& state, int64_t tokens) {
  state.SetItemsProcessed(state.iterations() * tokens);
  state.counters["ns_per_token"] = secondsPer(static_cast<double>(tokens));
}

/// items_per_second = sequence-steps/s and ns_per_seq, for one step of `batch` sequences per
/// iteration.
inline void setSequenceStepCounters(benchmark::State& state, int64_t batch) {
  state.SetItemsProcessed(state.iterations() * batch);
  state.counters["ns_per_seq"] = secondsPer(static_cast<double>(batch));
}

/// The stream of the GPU rows: one non-blocking stream for the whole process, as an engine has
/// its own (docs/architecture.md tells engines not to use the legacy default stream); nullptr for
/// CPU runtimes and in a build without CUDA.
inline cudaStream_t benchStream(DeviceType device) {
#if MKV_WITH_CUDA
  if (device == DeviceType::kGPU) {
    static cudaStream_t const stream = [] {
      cudaStream_t created = nullptr;
      (void)cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking);
      return created;
    }();
    return stream;
  }
#endif
  (void)device;
  return nullptr;
}

/// The smallest KV geometry (1 layer, 1 head, head dim 1, fp16), on CPU tensors unless `device`
/// says otherwise: bookkeeping cost does not depend on the bytes per page, and large batches stay
/// within a few tens of MiB. GPU runtimes run on benchStream().
inline KVCacheRuntimeConfig benchRuntimeConfig(int32_t maxBatch, int32_t maxSequenceLength,
                                               int32_t pageSize,
                                               DeviceType device = DeviceType::kCPU) {
  KVCacheRuntimeConfig config;
  config.model.numKVHeads = 1;
  config.model.headDim = 1;
  config.maxBatchSize = maxBatch;
  config.maxSequenceLength = maxSequenceLength;
  config.tokensPerPage = pageSize;
  config.deviceType = device;
  config.stream = benchStream(device);
  return config;
}

}  // namespace mkv::bench
