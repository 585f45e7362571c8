#pragma once
/// \file reference_engine_rows.h
/// The reference engine's per-sequence and per-request state, shared by its parts
/// (reference_engine.cpp: the request loop; reference_engine_decode.cpp: its decode loop;
/// reference_engine_speculative.cpp: verification rounds and the draft). Internal to the testing
/// kit.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "mkv/generation_request.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/reference_engine.h"

namespace mkv::testing {

struct ReferenceEngine::Row {
  EngineSequence spec;
  std::size_t outcome = 0;
  ResidentRef resident;
  PrefixDigests digests;
  std::vector<uint64_t> promptKeys;
  int32_t prefillStart = 0;
  int32_t materialized = 0;            // positions with KV
  int32_t draftMaterialized = 0;       // draft rows with KV of the committed prefix (speculative)
  std::vector<int32_t> pendingTokens;  // a round's tokens, appended once it is submitted
  int32_t steps = 0;
  FinishReason reason = FinishReason::kNotFinished;
  // Chunked prefill of a joiner (maxBatchedTokens > 0): not finalised yet, chunks run so far, the
  // decode step it was seated before, and whether the current step runs one of its chunks.
  bool prefilling = false;
  int32_t chunks = 0;
  int64_t seatedAtStep = 0;
  bool chunkThisStep = false;
};

struct ReferenceEngine::Run {
  EngineRequest const* request = nullptr;
  std::deque<EngineSequence>* joinQueue = nullptr;  // run's join queue (may be null)
  LLMGenerationRequest generation;
  DecodingInferenceContext context;
  std::optional<ManagedKVCacheRequest> managed;
  std::vector<Row> rows;
  RequestOutcome outcome;
  uint64_t seed = 0;
  bool speculative = false;
  DecodingKvHeadroom headroom{1, 0};  // set by beginRequest
  int64_t libraryNanos = 0;           // host time in library calls (kept, not reported)
};

/// Nanoseconds since `start` (the engine's host time in library calls).
inline int64_t nanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

// Defined here: the request loop and the decode loop (reference_engine_decode.cpp) both call it.
template <typename Include>
void ReferenceEngine::writeLengths(Run& run, std::size_t first, std::size_t last, Include include) {
  cudaStream_t const stream = mRuntime.config().stream;
  std::size_t i = first;
  while (i < last) {
    if (!include(i)) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j < last && include(j)) {
      mLengthValues[j] = run.rows[j].materialized;
      ++j;
    }
    std::span<int32_t const> const values(mLengthValues.data() + i, j - i);
    for (KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool()}) {
      if (pool != nullptr) {
        pool->writeLengths(static_cast<int32_t>(i), values, stream);
      }
    }
    if (pairsDraft()) {  // the draft's own lengths, after its steps
      for (std::size_t k = i; k < j; ++k) {
        mDraftLengthValues[k] = run.rows[k].draftMaterialized;
      }
      mRuntime.draftPool()->writeLengths(
          static_cast<int32_t>(i), std::span<int32_t const>(mDraftLengthValues.data() + i, j - i),
          stream);
    }
    i = j;
  }
}

}  // namespace mkv::testing
