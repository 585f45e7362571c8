#pragma once
/// \file generation_request.h
/// What the runtime tells the KV layer about one request (a batch of sequences) and about the
/// state of its execution. Both are plain data owned by the runtime.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/media.h"
#include "mkv/types.h"

namespace mkv {

/// The request as the user submitted it.
struct LLMGenerationRequest {
  /// Per-sequence inputs, in execution-row order.
  struct Sequence {
    std::vector<imageUtils::ImageData> imageBuffers;  ///< one per image placeholder run
    std::vector<audioUtils::AudioData> audioBuffers;  ///< one per audio placeholder run
    /// Overrides the request-level lookup policy for this sequence when set.
    std::optional<ContextCacheLookupPolicy> contextCacheLookupPolicy;
  };
  std::vector<Sequence> requests;
  ContextCacheLookupPolicy contextCacheLookupPolicy = ContextCacheLookupPolicy::kUseCache;
  ContextCacheCommitPolicy contextCacheCommitPolicy =
      ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  /// Tokens at the end of the prompt (a chat template's generation prompt) that the next turn
  /// will not reproduce; Hybrid-MTP endpoint publication stops before them
  /// (publishHybridMtpEndpoint throws for a length inside the tail). 0 = none; other deployments
  /// refuse a non-zero tail at begin; negative values (the upstream engine's "derive from the chat
  /// template") are refused.
  int32_t contextCacheReplayTailLength = 0;
  /// LoRA adapter of the request; empty = base model. Must equal the context's.
  std::string loraWeightsName;
  /// Tenant isolation: requests with different salts never share cached state.
  std::string cacheSalt;
  /// Retention priorities of the prefixes every sequence of the request (and every sequence it
  /// admits in flight) publishes: ascending, disjoint token ranges of prompt + generated tokens,
  /// each with a priority (0..100, higher is evicted later; kDefaultRetentionPriority outside
  /// them) and an optional duration (ContextCacheConfig::retentionClock units) after which it
  /// falls back to the default. A record takes the range of its last token. Context reuse only.
  std::vector<RetentionRange> contextCacheRetention;
};

/// The runtime's per-request view, read by ManagedKVCacheRequest at every lifecycle call.
/// Per-row vectors are in execution-row order; a vector a call reads has one entry per row the
/// request holds then (joiners included). Which call reads which field: docs/lifecycle.md.
struct DecodingInferenceContext {
  /// Must be the runtime's config().stream (begin throws otherwise): every request's work goes
  /// to that one stream. The library never owns it.
  cudaStream_t stream = nullptr;
  /// Number of execution rows (sequences) in the current batch.
  int32_t activeBatchSize = 0;
  /// Full logical prompt of each row (what context reuse hashes and matches).
  std::vector<std::vector<int32_t>> rawBatchedInputIds;
  /// Prompt tokens the prefill actually executes per row, after reuse and any token pruning:
  /// rawBatchedInputIds[i].size() - prefillStart[i] without pruning.
  std::vector<int32_t> effectivePrefillLengths;
  /// Tokens sampled so far per row. Under kCommittedPlusLookahead the last one has no KV yet.
  std::vector<std::vector<int32_t>> generatedTokenIds;
  /// Stable physical row of each execution row (page-table row == recurrent row == slot).
  std::vector<ResidentRef> residentRefs;
  /// kNotFinished while a row is running; the reason once it stopped.
  std::vector<FinishReason> finishReasons;
  /// LoRA adapter currently applied; empty = base model. Part of every block key.
  std::string loraWeightsName;
};

}  // namespace mkv
