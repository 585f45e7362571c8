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
  // decode step it was seated before, and the end of the chunk the current step runs (0: none).
  bool prefilling = false;
  int32_t chunks = 0;
  int64_t seatedAtStep = 0;
  int32_t chunkEnd = 0;
  // Preemption: compact this row away as preempted; the step of its last sampled token (time
  // between tokens) and whether it has sampled one.
  bool preempted = false;
  int64_t lastTokenStep = 0;
  bool sampled = false;
};

struct ReferenceEngine::Run {
  EngineRequest const* request = nullptr;
  std::deque<EngineSequence>* joinQueue = nullptr;  // run's join queue (may be null)
  std::deque<EngineSequence> preempted;  // preempted sequences, admitted before the join queue
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

/// The outcome entry of a sequence seated with `prefillStart` reused tokens, `runStep` decode
/// steps into its run. A resumed sequence (EngineSequence::resume) reports its original prompt,
/// the tokens it sampled before, and its first admission's figures once that admission completed
/// its prefill.
inline SequenceOutcome outcomeOf(EngineSequence const& spec, int32_t prefillStart, bool joined,
                                 int64_t runStep) {
  SequenceOutcome outcome{spec.tag,     spec.prompt, {}, FinishReason::kNotFinished,
                          prefillStart, joined};
  outcome.seatedAtRunStep = runStep;
  if (spec.resume) {
    EngineResume const& resume = *spec.resume;
    auto const cut = spec.prompt.end() - resume.generatedTokens;
    outcome.prompt.assign(spec.prompt.begin(), cut);
    outcome.generated.assign(cut, spec.prompt.end());
    outcome.joinedInFlight = resume.joinedInFlight;
    outcome.resumedAtToken = resume.generatedTokens;
    if (resume.generatedTokens > 0) {
      outcome.prefillStart = resume.prefillStart;
    }
  }
  return outcome;
}

/// Whether a row's prefill is its sequence's first completed one (the figures of first
/// admissions): a new sequence, or one preempted before its first prefill completed.
inline bool firstPrefill(EngineSequence const& spec) {
  return !spec.resume || spec.resume->generatedTokens == 0;
}

/// A row's decode figures carried over from before a preemption.
inline void ReferenceEngine::resumeRow(Row& row) {
  if (row.spec.resume && row.spec.resume->generatedTokens > 0) {
    row.steps = row.spec.resume->decodeSteps;
    row.lastTokenStep = row.spec.resume->lastTokenStep;
    row.sampled = true;
  }
}

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
