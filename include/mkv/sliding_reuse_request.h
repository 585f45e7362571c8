#pragma once
/// \file sliding_reuse_request.h
/// One request on the composed backend (sliding-window layers with context reuse): the
/// full-attention layers through ContextCacheRequest, the sliding layers through a
/// BoundedSwaKVPageManager in cached mode, with the same lifecycle calls as the two other
/// adapters so that ManagedKVCacheRequest dispatches to it the same way. The design:
/// docs/architecture.md, "Sliding windows with context reuse".

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/context_cache/context_cache_request.h"
#include "mkv/cuda_types.h"
#include "mkv/generation_request.h"
#include "mkv/media.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

/// The two halves of one request: the coordinator's (full layers: prefix reuse capped by the
/// window rule) and the SWA manager's (sliding layers: the reused window mapped from the cache,
/// the prompt's sliding KV published at completePrefill, bounded rotation in decode). Move-only.
/// Every bool method returns false for an expected failure of either half (each logs it once),
/// and throws mkv::Error, changing nothing, for misuse, including the calls this backend does not
/// offer (Hybrid-MTP). Destroying a live request abandons both halves. Each completion point
/// (compaction, finish, abandonment) synchronises the stream once for both halves through the
/// runtime's shared synchroniser: a failure there quarantines both, releasing nothing.
/// Thread-safety: single writer.
class SlidingReuseRequest {
 public:
  /// Admits the batch on the coordinator (its window cache set: every plan is capped by the hit
  /// rule), then on the SWA manager with each row's reuse start and the cached window pages
  /// before it. Both halves are checked before either admits (a dry run of the sliding half with
  /// the starts the coordinator's lookup gives, unless the batch's cold demand fits), so a
  /// refusal changes nothing on either. Throws unless the request is not speculative, headroom
  /// is {1, 0} and the contract is kCommittedPlusLookahead (and whatever ContextCacheRequest::begin
  /// and the SWA manager's beginRequest throw for). nullopt when either half refuses (no
  /// capacity, poisoned).
  static std::optional<SlidingReuseRequest> begin(
      ContextCacheCoordinator& coordinator, BoundedSwaKVPageManager& manager,
      LLMGenerationRequest const& request, DecodingInferenceContext const& context,
      bool speculativeRequest, DecodingKvHeadroom const& headroom,
      std::vector<int32_t> const& mediaTokenIds = {},
      DecodingTokenStateContract tokenStateContract =
          DecodingTokenStateContract::kCommittedPlusLookahead,
      ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens);

  /// What admitting `sequence` would take from the sliding pool now (KVCacheRuntime::
  /// estimateAdmission): the pages its row allocates (its prompt from the reuse start the
  /// coordinator's lookup gives, plus one) and the cached window pages before that start that no
  /// request holds yet (admission pins them). Changes nothing.
  struct SlidingPoolEstimate {
    int32_t privatePages = 0;
    int32_t unheldWindowPages = 0;
  };
  static SlidingPoolEstimate estimateSlidingPool(ContextCacheCoordinator const& coordinator,
                                                 BoundedSwaKVPageManager const& manager,
                                                 ContextCacheSequenceAdmission const& sequence);

  SlidingReuseRequest(SlidingReuseRequest&&) noexcept = default;
  SlidingReuseRequest& operator=(SlidingReuseRequest&&) = delete;
  SlidingReuseRequest(SlidingReuseRequest const&) = delete;
  SlidingReuseRequest& operator=(SlidingReuseRequest const&) = delete;
  /// Abandons a live request's two halves, which synchronise once between them.
  ~SlidingReuseRequest();

  /// Reuse length per execution row (both halves start there).
  std::vector<int32_t> const& prefillStarts() const noexcept { return mFull.prefillStarts(); }
  int32_t reuseTokenLength(ExecutionRow row) const { return mFull.reuseTokenLength(row); }
  /// The full layers' (an attention-only deployment keeps no reuse points: empty).
  std::span<ReusePointCapture const> reusePointCaptures(ExecutionRow row) const {
    return mFull.reusePointCaptures(row);
  }

  /// Binds the full layers' rows (the coordinator's preparePrefill). Throws, changing nothing,
  /// when another active request owns the sliding half's KV-length pools (its prepareSwaPrefill
  /// would refuse after the full half had bound its rows).
  bool preparePrefill();
  /// Maps each row's sliding pages for its executed prefill (`effectiveInputLengths[i]` tokens
  /// from its start: the window before the start, then the executed prompt pages).
  bool prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths);
  /// No checkpoints on this backend: the coordinator's no-op, true.
  bool enqueuePrefillCaptures() { return mFull.enqueuePrefillCaptures(); }
  /// After the runtime's prefill synchronisation: completes the full layers' half (which
  /// publishes their blocks), publishes every complete prompt block's sliding page into the
  /// window cache, then completes the sliding half (it retires what left the window, a published
  /// page staying cached, and keeps at most M + 1 pages).
  bool completePrefill(DecodingInferenceContext const& context,
                       std::vector<int32_t> const& commonStateLengths);
  /// Grows the full layers' pages and maps the next window page (headroom {1, 0} only).
  bool prepareDecodeStep(DecodingInferenceContext const& context,
                         DecodingKvHeadroom const& headroom);
  /// Completes the full layers' step (a row that completes publishes its generated blocks under
  /// kIncludingGeneratedTokens), publishes the complete blocks of each completing row's final
  /// window past its prompt (what a follow-up turn reading prompt + reply needs before its hit
  /// point), then the SWA half's step (retirement).
  bool completeDecodeStep(DecodingInferenceContext const& context,
                          std::vector<int32_t> const& commonStateLengths);
  bool beginBatchCompaction(std::vector<int32_t> const& oldToNew, int32_t newBatchSize,
                            Tensor& deviceBatchMapping);
  bool completeBatchCompaction(std::vector<int32_t> const& keepMapping);
  /// Finishes both halves (they synchronise pending work once between them, then each
  /// releases); false when either failed.
  bool finish();

  /// In-flight admission: the coordinator admits the joiner (its full layers' rows, the reuse
  /// start capped by the window rule), then the SWA manager with that start and the cached
  /// window pages before it, both checked first as in begin. kAdmitted with `prefillStart` set;
  /// kNoCapacity, changing nothing, when either half has too few pages; kFailed when poisoned.
  /// Throws what ContextCacheRequest::admitSequence and the SWA manager's admitSequence throw for
  /// and for headroom other than {1, 0}.
  AdmitSequenceStatus admitSequence(std::vector<int32_t> const& tokenIds,
                                    std::string const& loraWeightsName,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {},
                                    std::vector<imageUtils::ImageData> const& imageBuffers = {},
                                    std::vector<audioUtils::AudioData> const& audioBuffers = {});
  /// The same admission of a joiner with its own identity
  /// (ContextCacheRequest::admitSequence's overload for `joiner`): its salt, adapter, retention
  /// and policies key and publish both halves' blocks.
  AdmitSequenceStatus admitSequence(LLMGenerationRequest const& joiner,
                                    std::vector<int32_t> const& tokenIds,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {});
  /// Preemption: the full half publishes the row's committed blocks
  /// (ContextCacheRequest::preemptSequence), then, under the row's commit policy
  /// (ContextCacheCoordinator::commitPolicy), the sliding pages of its complete generated blocks
  /// still mapped (as a completing row's). False when the full half fails.
  bool preemptSequence(ExecutionRow row);
  /// kRecompute: preemptSequence(row). kSwap throws, changing nothing: the composed backend has no
  /// host tier (its deployment refuses one).
  bool preemptSequence(ExecutionRow row, PreemptionKind kind);
  /// Before the step that runs a joiner's next chunk: the full layers' pages up to chunkEnd
  /// (ContextCacheRequest::preparePrefillChunk: allocated now under
  /// JoinerPageAllocation::kPerChunk); the sliding half holds its prompt's window from admission.
  bool preparePrefillChunk(ExecutionRow row, int32_t chunkEnd);
  /// What preparePrefillChunk(row, chunkEnd) would allocate: the full layers' pages.
  DecodeStepDemand prefillChunkDemand(ExecutionRow row, int32_t chunkEnd) const;
  /// A chunk of a joiner's prefill completed: the full layers publish the row's full blocks so
  /// far (ContextCacheRequest::completePrefillChunk); its sliding pages are published at
  /// finalisation, with the whole prompt's.
  bool completePrefillChunk(ExecutionRow row, int32_t prefilledTokens);
  /// After the joiner's prefill: finalises the coordinator's row (its full blocks published),
  /// publishes the row's complete prompt blocks' sliding pages, then retires its window as
  /// completePrefill does. Both halves check before either changes: a throw (work pending, a
  /// row that is no unfinalised joiner) changes nothing. False (poisoned) when the coordinator's
  /// half fails.
  bool finalizeSequenceAdmission(ExecutionRow row, int32_t const& lookaheadToken,
                                 int32_t fullInputLength);
  /// Undoes the newest unfinalised joiner on both halves: true when it did. Never throws: false,
  /// changing nothing, when there is none to undo or work is pending; false and poisoned when a
  /// half's row clear failed on the device (both halves undo the joiner all the same).
  bool retractSequenceAdmission() noexcept;
  /// Why a call failed: the full half's reason, else the sliding half's.
  RowFailure lastFailure() const noexcept;
  /// What the next prepareDecodeStep would take on both halves: the full half's base pages and
  /// the sliding half's page-source pages; the first row either half finds past its table width.
  /// Throws unless headroom is {1, 0}, and where prepareDecodeStep throws.
  DecodeStepDemand decodeStepDemand(DecodingKvHeadroom const& headroom) const;
  /// Throw: Hybrid-MTP needs recurrent layers, which this backend refuses.
  bool publishHybridMtpEndpoint(ExecutionRow row, int32_t residentStateLength,
                                Tensor const& baseHiddenStates, int32_t boundaryHiddenRow);
  bool restoreHybridMtpBoundaryHidden(ExecutionRow row, Tensor& baseHiddenStates,
                                      int32_t destinationRow);

  bool poisoned() const noexcept;

 private:
  SlidingReuseRequest(ContextCacheRequest full, BoundedSwaKVPageManager& manager,
                      BoundedSwaKVPageManager::RequestHandle handle, std::vector<int32_t> prompts,
                      cudaStream_t stream);
  /// admitSequence's dry run of both halves: the joiner's start on the sliding half when both are
  /// to admit it; nullopt (one log line) when the sliding pool cannot hold it or is poisoned.
  /// Throws for what either half's admission throws for. Changes nothing.
  std::optional<SwaReuseStart> planJoiner(LLMGenerationRequest const& joiner,
                                          std::vector<int32_t> const& tokenIds,
                                          ResidentRef resident, cudaStream_t stream,
                                          std::vector<int32_t> const& mediaTokenIds) const;
  /// Whether row `row` publishes its generated tokens (its commit policy, the coordinator's).
  bool publishesGeneratedTokens(std::size_t row) const;
  /// Publishes the sliding pages row `row` still maps for blocks [firstBlock, endBlock) (pages
  /// leaving the window included), which must be a contiguous tail of the range; returns the
  /// first block published (endBlock when none is mapped).
  int32_t publishMappedBlocks(std::size_t row, int32_t firstBlock, int32_t endBlock);
  /// The complete prompt blocks row `row`'s prefill executed (all of them still mapped).
  void publishPromptBlocks(std::size_t row);
  /// Row `row`'s complete blocks past its prompt that are still mapped (its window after the
  /// step being completed, and the page leaving it).
  void publishGeneratedWindow(std::size_t row);
  bool swaStatus(SwaKVCacheStatus status, char const* operation) const;
  /// Throws (naming `call`) once the sliding half is finishing (a decode step it refused leaves
  /// the full half executing, which would accept what a finishing request refuses).
  void requireSlidingHalfExecuting(char const* call) const;

  ContextCacheRequest mFull;
  BoundedSwaKVPageManager* mManager;
  BoundedSwaKVPageManager::RequestHandle mHandle;
  std::vector<int32_t> mPromptTokens;  ///< per execution row, compacted with the batch
  std::vector<int32_t> mSwaLengths;    ///< scratch of prepareSwaPrefill
  std::vector<PageId> mBlockPages;     ///< scratch of publishMappedBlocks
  std::vector<int32_t> mPendingMapping;
  cudaStream_t mStream;  ///< the request's (a joiner's must be the same)
};

}  // namespace mkv
