#pragma once
/// \file coordinator_request.h
/// The state of one ContextCacheCoordinator request, shared by the coordinator's parts (not
/// installed). The parts and one request's path through them: docs/architecture.md, "Context
/// reuse".

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "core/check.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "resources/request_stage.h"

namespace mkv::detail {

/// One sequence (execution row) of a coordinator request.
struct CoordinatorSequence {
  CacheRequestLease lease;
  ResidentRef resident;
  std::vector<int32_t> tokens;       // ledger: prompt, then accepted tokens
  std::vector<MediaPosition> media;  // empty, or one entry per ledger token
  BlockKeyExtras extras;
  ContextCacheLookupPolicy policy = ContextCacheLookupPolicy::kUseCache;
  // What it publishes past its prompt (completion, preemption): its admission's, else the batch's.
  ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  int32_t promptLength = 0;
  int32_t reuseTokenLength = 0;
  // Composed backend: prompt tokens the full layers matched beyond reuseTokenLength, refused
  // because the sliding layers' window before them was not cached (the plan's
  // windowLimitedTokens). Their end is a point where a hit happened: its window is kept.
  int32_t windowLimitedTokens = 0;
  // Leading blocks of its prompt the block index held at admission: the prompt branches from
  // cached content there (checkpoint deployments keep a reuse point at that branch).
  int32_t cachedPrefixBlocks = 0;
  int32_t committed = 0;        // tokens with materialised KV
  int32_t publishedBlocks = 0;  // full blocks already published
  bool joined = true;           // false: admitted in flight, not finalised yet
  // A founder whose prefill chunks (completePrefillChunk before finalizePrefillPublication)
  // stopped short of its prompt: the prefill's completion holds it and it goes on as an
  // unfinalised in-flight admission (joined = false).
  bool prefillHeld = false;
  // Preempted with PreemptionKind::kSwap: the compaction that drops the row moves its published
  // blocks to the host tier (ContextCacheManager::demoteToHostTier).
  bool swapOut = false;
  // An in-flight admission: DeviceWriteQueue::awaitingFlush() after its row was bound or last
  // grown for a chunk (-1: nothing waited), checked by the calls that publish what its prefill
  // wrote through that row.
  int64_t joinWritesMark = -1;
  // Checkpoint deployments: the longest exact checkpoint published, and the capture enqueued
  // but not committed yet (its slots are reservations of the lease).
  int32_t publishedExact = 0;
  // Speculative requests: tokens whose base and draft state are both materialised, and the
  // prompt endpoint frozen until the draft initialisation is known complete (endpointFrozen: the
  // row's prompt endpoint waits for it; frozenPrefill its length, 0 once a round held the row).
  int32_t common = 0;
  int32_t frozenPrefill = 0;
  bool endpointFrozen = false;
  struct StagedCapture {
    SnapshotReservation reservation;
    int32_t exactLength = 0;
  };
  std::optional<StagedCapture> staged;
  // Reuse points of the prepared prefill (checkpointInterval): what the engine captures, and the
  // lease's reservation of each, in the same order; committed by finalizePrefillPublication.
  std::vector<ReusePointCapture> reusePoints;
  std::vector<SnapshotReservation> reusePointReservations;
  // An in-flight admission's state at the ends of its prefill chunks (ascending), captured by
  // the coordinator at completePrefillChunk and committed with its reuse points when it
  // finalises.
  std::vector<StagedCapture> chunkEnds;
};

/// One admitted request of a ContextCacheCoordinator (its private `Request`).
struct CoordinatorRequest {
  using Sequence = CoordinatorSequence;

  uint64_t id = 0;
  RequestStage stage = RequestStage::kAdmitted;
  /// DeviceWriteQueue::awaitingFlush() at the end of the prepared prefill or decode step (-1:
  /// nothing waited), checked by the call that completes it.
  int64_t writesMark = -1;
  /// The request's kind (request_mode.h), chosen at admission: owned by the coordinator.
  RequestMode const* mode = nullptr;
  // A speculative request's draft initialisation (enqueued by the runtime after the prefill) is
  // not known complete: the frozen prompt endpoints wait for the first verification round or a
  // synchronisation of the coordinator. Independent of the stage (it spans decode steps and
  // compactions until one of them completes).
  bool draftInitPending = false;
  DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead;
  /// The batch's commit policy: a sequence's unless its admission set one (Sequence::commitPolicy).
  ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  ContextCacheLookupPolicy batchPolicy = ContextCacheLookupPolicy::kUseCache;
  /// Prompt tokens the next turn will not reproduce (Hybrid-MTP only): never published.
  int32_t replayTailLength = 0;
  std::vector<Sequence> sequences;
  /// The row whose page growth failed the request, and why (kNone until one does).
  RowFailure failure;
  // The compaction begun (meaningful in kCompacting only; the mapping keeps its capacity).
  std::vector<int32_t> mapping;
  int32_t newBatchSize = -1;
  Tensor* deviceMapping = nullptr;

  /// Pending work, or a draft initialisation not known complete: a finish or an abandonment
  /// synchronises first.
  bool needsSynchronization() const noexcept { return hasPendingWork(stage) || draftInitPending; }
};

inline int32_t pagesFor(int64_t tokens, int32_t pageSize) {
  return static_cast<int32_t>((tokens + pageSize - 1) / pageSize);
}

/// An advance that keeps a sequence where it is (cancelled slot, joiner not yet finalised).
inline bool isHold(ContextCacheSequenceAdvance const& advance) {
  return advance.acceptedTokenCount == 0 &&
         advance.committedStateLength == kHoldCommittedStateLength;
}

/// Execution row `slot` of a request; throws (naming `call`) outside the batch.
template <typename Req>
auto& sequenceAt(Req& req, ExecutionRow row, char const* call) {
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < req.sequences.size(), call,
              "row {} outside the batch of {}", row, req.sequences.size());
  return req.sequences[static_cast<std::size_t>(row)];
}

/// The first `length` ledger tokens of a sequence as the cache hashes them.
inline PromptView prefixOf(CoordinatorSequence const& sequence, int32_t length) {
  auto const tokens = static_cast<std::size_t>(length);
  std::span<MediaPosition const> media;
  if (!sequence.media.empty()) {
    media = std::span<MediaPosition const>(sequence.media).first(tokens);
  }
  return PromptView{std::span<int32_t const>(sequence.tokens).first(tokens), media,
                    sequence.extras};
}

/// A sequence of `admission` that holds `acquired`'s lease under lookup `policy` and the
/// admission's commit policy, else `batchCommitPolicy`; its ledger is the prompt and its
/// committed length the reuse length.
inline CoordinatorSequence admittedSequence(ContextCacheSequenceAdmission const& admission,
                                            ContextCacheLookupPolicy policy,
                                            ContextCacheCommitPolicy batchCommitPolicy,
                                            mkv::AdmissionResult& acquired) {
  CoordinatorSequence state;
  state.lease = std::move(*acquired.lease);
  state.resident = admission.resident;
  state.tokens = admission.tokenIds;
  state.media = admission.media;
  state.extras = admission.keyExtras;
  state.policy = policy;
  state.commitPolicy = admission.commitPolicy.value_or(batchCommitPolicy);
  state.promptLength = static_cast<int32_t>(admission.tokenIds.size());
  state.reuseTokenLength = acquired.plan.reuseTokenLength;
  state.windowLimitedTokens = acquired.plan.windowLimitedTokens;
  state.cachedPrefixBlocks = acquired.plan.indexedPrefixBlocks;
  state.committed = acquired.plan.reuseTokenLength;
  return state;
}

/// Makes room for an advance so that applying it cannot throw. A call reserves every advance
/// before it applies the first, so a std::bad_alloc leaves the request as it was. Capacity grows
/// geometrically, as push_back's would.
inline void reserveAdvance(CoordinatorSequence& sequence,
                           ContextCacheSequenceAdvance const& advance) {
  if (isHold(advance)) {
    return;
  }
  std::size_t const size =
      sequence.tokens.size() + static_cast<std::size_t>(advance.acceptedTokenCount);
  auto grow = [size](auto& values) {
    if (values.capacity() < size) {
      values.reserve(std::max(size, 2 * values.capacity()));
    }
  };
  grow(sequence.tokens);
  if (!sequence.media.empty()) {
    grow(sequence.media);
  }
}

/// Appends an advance's accepted tokens to the ledger and sets the committed length (a reserved
/// advance does not throw).
inline void applyAdvance(CoordinatorSequence& sequence,
                         ContextCacheSequenceAdvance const& advance) {
  if (isHold(advance)) {
    return;
  }
  sequence.tokens.insert(sequence.tokens.end(), advance.acceptedTokenIds,
                         advance.acceptedTokenIds + advance.acceptedTokenCount);
  if (!sequence.media.empty()) {
    sequence.media.resize(sequence.tokens.size());  // generated tokens are text
  }
  sequence.committed = advance.committedStateLength;
}

/// One advance per row of a validated call: all reserved, then all applied.
inline void applyAdvances(CoordinatorRequest& req,
                          std::span<ContextCacheSequenceAdvance const> advances) {
  for (std::size_t i = 0; i < advances.size(); ++i) {
    reserveAdvance(req.sequences[i], advances[i]);
  }
  for (std::size_t i = 0; i < advances.size(); ++i) {
    applyAdvance(req.sequences[i], advances[i]);
  }
}

}  // namespace mkv::detail
