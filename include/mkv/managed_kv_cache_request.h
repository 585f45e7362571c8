#pragma once
/// \file managed_kv_cache_request.h
/// One runtime request facade over the KV backends (three adapters: context reuse, bounded SWA,
/// sliding-window reuse). What each call does on each backend: docs/architecture.md, "One
/// request's path through the layers, from `begin` to `finish`", and docs/errors.md,
/// "ManagedKVCacheRequest". The API is the upstream engine's ManagedKVCacheRequest (the seed's
/// reference page, signatures included); "the reference engine" in these docs is
/// mkv::testing::ReferenceEngine. The engine loop, call by call: docs/lifecycle.md.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/generation_request.h"
#include "mkv/media.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

// The backends a request starts on, named by pointer only (KVCacheRuntime hands them out; an
// engine that calls into one includes its header). The adapters the request runs on
// (ContextCacheRequest, BoundedSwaRequest, SlidingReuseRequest) are behind the facade's Impl.
class BoundedSwaKVPageManager;  // mkv/bounded_swa_kv_page_manager.h
class ContextCacheCoordinator;  // mkv/context_cache/context_cache_coordinator.h

/// One runtime request facade over orthogonal execution paging and context-reuse clients.
///
/// The support matrix selects one backend: bounded SWA when reuse is off (and bounded pages are
/// fewer than full pages), context reuse with full KV storage, or, with reuse on and sliding
/// layers, sliding-window reuse: SlidingReuseRequest composes the two without moving SWA rotation
/// into the coordinator (KVCacheRuntime makes the choice; docs/architecture.md, "Sliding windows
/// with context reuse").
///
/// Return values: `false` / `nullopt` for an expected backend failure (no capacity, poisoned,
/// request failed), each logged once with the operation and whether the backend is poisoned.
/// Contract violations (wrong order, sizes that disagree, a call the backend does not offer)
/// throw mkv::Error and change nothing. Destroying the facade abandons the backend request.
/// A moved-from facade may only be destroyed: its calls throw mkv::Error, its noexcept calls
/// answer false, nullptr or kNone. Thread-safety: single writer (the engine thread).
class ManagedKVCacheRequest {
 public:
  /// Starts a request on the backend the pointers name: the context cache alone, the SWA manager
  /// alone, or both (the sliding-window reuse backend: KVCacheRuntime hands out both exactly
  /// then; throws when both are null). Forwards to ContextCacheRequest::begin,
  /// BoundedSwaRequest::begin or SlidingReuseRequest::begin (which throws unless the
  /// request is not speculative, headroom is {1, 0}, the contract is kCommittedPlusLookahead and
  /// the context holds activeBatchSize > 0 prompts and residents). nullopt on a failed
  /// admission. Every later call forwards to that adapter, its contract errors renamed to the
  /// facade's call.
  static std::optional<ManagedKVCacheRequest> begin(
      ContextCacheCoordinator* contextCache, BoundedSwaKVPageManager* swaPageManager,
      LLMGenerationRequest const& request, DecodingInferenceContext const& context,
      bool speculativeRequest, DecodingKvHeadroom const& headroom,
      DecodingTokenStateContract tokenStateContract, ContextCacheCommitPolicy commitPolicy,
      std::vector<int32_t> const& mediaTokenIds = {});

  /// Defaulted where the adapters are complete (managed_kv_cache_request.cpp).
  ManagedKVCacheRequest(ManagedKVCacheRequest&&) noexcept;
  /// Abandons the request this facade held (as destroying it would), then takes `other`'s;
  /// `other` is left moved from. An engine's request slot can be refilled in place.
  ManagedKVCacheRequest& operator=(ManagedKVCacheRequest&& other) noexcept;
  ManagedKVCacheRequest(ManagedKVCacheRequest const&) = delete;
  ManagedKVCacheRequest& operator=(ManagedKVCacheRequest const&) = delete;
  ~ManagedKVCacheRequest();

  /// True iff a backend with context reuse is held (context reuse or sliding-window reuse).
  bool hasContextReuse() const noexcept;
  /// Per execution row, the reuse length (execution starts there); nullptr for bounded SWA.
  std::vector<int32_t> const* prefillStarts() const noexcept;
  /// Reuse length of one row. Context backend only (throws for bounded SWA).
  int32_t reuseTokenLength(ExecutionRow row) const;

  /// Hybrid-MTP endpoint publication. Context backend only.
  bool publishHybridMtpEndpoint(ExecutionRow row, int32_t residentStateLength,
                                Tensor const& baseHiddenStates, int32_t boundaryHiddenRow);
  /// Copies the checkpoint's boundary hidden row into `destinationRow`. Context backend only.
  bool restoreHybridMtpBoundaryHidden(ExecutionRow row, Tensor& baseHiddenStates,
                                      int32_t destinationRow);

  /// Binds rows and restores state before prefill (bounded SWA: no-op, true).
  bool preparePrefill();
  /// Maps the SWA windows for the executed prefill lengths (context backend: no-op, true).
  /// Call after embeddings and any token pruning fixed the lengths.
  bool prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths);
  /// Between preparePrefill and completePrefill, or for a joiner between admitSequence and
  /// finalizeSequenceAdmission: the reuse points row `row` captures in its prefill, each a
  /// position and the snapshot slot its recurrent state and conv rows go to (hybrid deployments
  /// with a checkpoint interval; empty on other deployments and always on bounded SWA). The
  /// engine's prefill kernels write them, a joiner's in the chunk that passes each position
  /// (docs/context_cache.md, "Reuse points"). Throws outside those spans on the context backends
  /// and for a row outside the batch. An addition beside the reference page's API.
  std::span<ReusePointCapture const> reusePointCaptures(ExecutionRow row) const;
  /// Stages hybrid checkpoint captures at the prompt end (bounded SWA: no-op, true).
  bool enqueuePrefillCaptures();
  /// After the runtime's prefill synchronisation. A founder whose prefill chunks stopped short of
  /// its prompt (completePrefillChunk) holds: its generated list is empty and it finishes as a
  /// joiner. With DeviceWriteTiming::kEngineStep, throws
  /// mkv::Error, changing nothing, when the rows and lengths the prepare calls wrote never reached
  /// the device (no KVCacheRuntime::flushDeviceWrites() returned in between): the engine's forward
  /// read stale rows, an engine bug this detects but cannot undo (docs/errors.md).
  bool completePrefill(DecodingInferenceContext const& context,
                       std::vector<int32_t> const& commonStateLengths);
  /// Before each decode execution. Bounded SWA throws unless headroom is {1, 0}. False when a row
  /// cannot get its next page or passes its table width (lastFailure() names it): that row fails
  /// alone, the step is not prepared and the request stays between steps, so the engine may
  /// preempt or compact rows away and call again, or finish; false and poisoned otherwise.
  bool prepareDecodeStep(DecodingInferenceContext const& context,
                         DecodingKvHeadroom const& headroom);
  /// What prepareDecodeStep(context, headroom) would take if called now, changing nothing: the
  /// pages it would allocate per pool (compare with KVCacheRuntime::capacity(): free plus
  /// reclaimable) and the first row it would find past its table width. A scheduler asks it
  /// before a step to preempt instead of failing one (an addition beside the reference page's
  /// API). Throws where prepareDecodeStep throws (no settled request, a headroom the backend
  /// refuses).
  DecodeStepDemand decodeStepDemand(DecodingKvHeadroom const& headroom) const;
  /// After the runtime's decode synchronisation. Throws like completePrefill when the step's
  /// writes never reached the device.
  bool completeDecodeStep(DecodingInferenceContext const& context,
                          std::vector<int32_t> const& commonStateLengths);
  /// Order-preserving compaction: validates `oldToNew` and copies it into deviceBatchMapping.
  bool beginBatchCompaction(std::vector<int32_t> const& oldToNew, int32_t newBatchSize,
                            Tensor& deviceBatchMapping);
  /// Clears dropped rows, compacts KV lengths, synchronises and releases dropped state.
  /// `keepMapping` must equal the mapping given to beginBatchCompaction.
  bool completeBatchCompaction(std::vector<int32_t> const& keepMapping);
  /// Ends the request (synchronises pending work, releases everything).
  bool finish();

  /// In-flight admission, every backend with attention layers (a speculative request's joiner
  /// takes the request's headroom and gets a draft row, a Hybrid-MTP joiner restores its hit;
  /// docs/context_cache.md, "Speculative paired reuse" and "Hybrid-MTP endpoints";
  /// sliding-window reuse
  /// admits the joiner's sliding window on its SWA half too: SlidingReuseRequest::admitSequence;
  /// bounded SWA caches nothing, so its joiner prefills from 0 in 2M + 1 pages:
  /// BoundedSwaRequest::admitSequence). The joiner takes the founding request's cache salt,
  /// retention and commit and lookup policies, and `loraWeightsName` as its adapter (the overload
  /// below gives it its own). KVCacheRuntime::supportsSeatedAdmission() says whether a deployment
  /// admits joiners. The status is mkv::AdmitSequenceStatus (types.h), the type that the
  /// reference page's ContextCacheRequest::AdmitSequenceStatus names.
  AdmitSequenceStatus admitSequence(std::vector<int32_t> const& tokenIds,
                                    std::string const& loraWeightsName,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {},
                                    std::vector<imageUtils::ImageData> const& imageBuffers = {},
                                    std::vector<audioUtils::AudioData> const& audioBuffers = {});
  /// In-flight admission of a sequence with an identity of its own (several tenants in one
  /// executing batch): `joiner` describes it as begin's request describes a batch of one, and
  /// the founder's settings apply to nothing of it. Its one entry of `requests` gives the images,
  /// audio and lookup-policy override; its cacheSalt and loraWeightsName key its blocks, its
  /// contextCacheRetention ranks its records, its contextCacheCommitPolicy decides what it
  /// publishes when it completes or is preempted, and its contextCacheLookupPolicy applies where
  /// the sequence sets none. Statuses, `prefillStart` and the backends as the overload above.
  /// Throws mkv::Error, changing nothing, for a `joiner` that has not exactly one sequence, a
  /// non-zero replay tail, a commit or lookup policy out of range, or invalid retention
  /// (docs/errors.md), besides what the overload above throws for.
  AdmitSequenceStatus admitSequence(LLMGenerationRequest const& joiner,
                                    std::vector<int32_t> const& tokenIds,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {});
  /// Preemption, vLLM's recompute (an addition beside the reference page's API; docs/lifecycle.md,
  /// "Preemption"): between steps, publishes row `row`'s committed state for reuse; the engine
  /// then compacts the row away (its pages go back), and later resumes it by admitting its
  /// prompt and tokens again, which reuses what was published. False when the backend is
  /// poisoned. Bounded SWA keeps nothing to reuse: true, nothing published. Throws between
  /// prepareDecodeStep and completeDecodeStep, for a row outside the batch and for an unfinalised
  /// joiner.
  bool preemptSequence(ExecutionRow row);
  /// Preemption of either kind (docs/lifecycle.md, "Preemption"): kRecompute is
  /// preemptSequence(row); kSwap also moves the row's published blocks that no other row holds to
  /// the host tier when the compaction drops the row, freeing their GPU pages (resuming onboards
  /// them). kSwap needs a host tier: it throws, changing nothing, on a context-reuse backend
  /// without one, on the sliding-window reuse and the bounded-SWA backends (neither has a host
  /// tier), and as preemptSequence(row) does. False when the backend is poisoned.
  bool preemptSequence(ExecutionRow row, PreemptionKind kind);
  /// Chunked prefill of a joiner (additions beside the reference page's API): the engine may
  /// spread an admitted joiner's prefill over several steps, the joiner holding in their decode
  /// steps. Between steps, before the step that runs the chunk [done so far, chunkEnd),
  /// preparePrefillChunk makes its pages ready: on bounded SWA it maps the window before the
  /// chunk and the pages of the chunk's last W tokens (the window rotates from chunk to chunk
  /// within the joiner's 2M + 1 pages); on the other backends, with
  /// ContextCacheConfig::joinerPages = kPerChunk (vLLM's allocation per scheduled chunk), it
  /// allocates the row's full-attention (and paired draft) pages up to chunkEnd, the joiner's
  /// admission having bound only its reused prefix; with kWholePrompt (the default) the joiner
  /// holds its whole prompt's pages from admission and the call only checks. An engine that
  /// prefills in chunks calls it for every chunk, on every backend; under kPerChunk for the last
  /// chunk and a whole-prompt prefill too (completePrefillChunk and finalizeSequenceAdmission
  /// throw for tokens whose pages were never prepared). A founder's first chunk is prepared in the
  /// prefill, after prepareSwaPrefill and before the step that runs it: bounded SWA stages that
  /// chunk's window in place of the whole prompt's; the other backends bound the founder's whole
  /// prompt at preparePrefill and only check. False when the pools cannot give the
  /// chunk's pages even after eviction (lastFailure(): kNoCapacity and the row; nothing changed,
  /// so the engine may preempt, retract the joiner, or try at a later step) and when poisoned.
  /// Throws between prepareDecodeStep and completeDecodeStep, for a row that is not an
  /// unfinalised joiner (or, in the prefill, a founder that may chunk and has not completed a
  /// chunk) and for a chunkEnd outside (done so far, prompt].
  bool preparePrefillChunk(ExecutionRow row, int32_t chunkEnd);
  /// What preparePrefillChunk(row, chunkEnd) would allocate now, changing nothing (compare with
  /// KVCacheRuntime::capacity(), as for decodeStepDemand): pages only under kPerChunk. Throws as
  /// preparePrefillChunk does. An addition beside the reference page's API.
  DecodeStepDemand prefillChunkDemand(ExecutionRow row, int32_t chunkEnd) const;
  /// After each step that ran a chunk: publishes the joiner's full blocks up to
  /// `prefilledTokens` (a sequence admitted meanwhile reuses them; on a hybrid deployment it
  /// captures the recurrent state the engine carried to the chunk's end as a reuse point, and
  /// finalizeSequenceAdmission commits the row's checkpoints after one synchronisation; on
  /// bounded SWA it unmaps what left the chunk's window); finalizeSequenceAdmission follows the
  /// last chunk. A founder's prefill goes in chunks too, on every backend: after the prefill step
  /// ran the founder's first chunk (prepared with preparePrefillChunk before it; before
  /// enqueuePrefillCaptures and completePrefill) this publishes it (sliding-window reuse: its
  /// full layers; the sliding pages at finalisation, as a joiner's; bounded SWA publishes nothing
  /// and rotates its window); completePrefill then holds the founder (it samples nothing: an
  /// empty generated list) and it goes on as an unfinalised joiner, so sequences admitted from
  /// the next step reuse what it published (docs/lifecycle.md, "Chunked prefill"). False when
  /// poisoned. Throws for a row that is not an unfinalised joiner (or, in the prefill, a founder
  /// of a request that admits joiners: on a deployment with attention layers, under
  /// kCommittedPlusLookahead), a length outside [done so far, prompt], and on
  /// bounded SWA for a chunk that was not prepared.
  bool completePrefillChunk(ExecutionRow row, int32_t prefilledTokens);
  bool finalizeSequenceAdmission(ExecutionRow row, int32_t const& lookaheadToken,
                                 int32_t fullInputLength);
  /// Undoes the newest in-flight admission that was not finalised: true when it did. Never
  /// throws (the seed's contract: an engine calls it while unwinding a failed join). With
  /// nothing to undo (the newest row joined or is the only one, work is pending, the request
  /// finished) it returns false and changes nothing. It also returns
  /// false when the joiner was undone but clearing its row failed on the device: the backend is
  /// then poisoned (lastFailure() says kPoisoned), and the request should be finished.
  bool retractSequenceAdmission() noexcept;
  /// Why the last call that answered false failed, before finish(): the row that could not get
  /// its next pages and why (kNoCapacity: the pool had none even after eviction, so preempting
  /// another request may help; kTableFull: the row reached maxPagesPerSequence() pages), or
  /// kPoisoned (row -1: the backend must be drained, see docs/errors.md). kNone when no call
  /// failed, and after finish(). An addition beside the reference page's API.
  RowFailure lastFailure() const noexcept;

 private:
  /// The one adapter the request runs on (a std::variant of the three); every lifecycle call is
  /// one std::visit over it. Held by pointer so that this header names none of the adapters
  /// (docs/architecture.md, "What is public"); null only once moved from.
  struct Impl;
  explicit ManagedKVCacheRequest(std::unique_ptr<Impl> impl) noexcept;

  std::unique_ptr<Impl> mImpl;
};

}  // namespace mkv
