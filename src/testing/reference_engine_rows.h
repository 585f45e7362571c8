#pragma once
/// \file reference_engine_rows.h
/// The reference engine's per-sequence and per-request state, shared by its parts
/// (reference_engine.cpp: the request loop; reference_engine_speculative.cpp: verification rounds
/// and the draft). Internal to the testing kit.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

#include "mkv/generation_request.h"
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

}  // namespace mkv::testing
