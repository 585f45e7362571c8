#pragma once
/// \file context_cache_request.h
/// Translates the runtime's per-request view (LLMGenerationRequest + DecodingInferenceContext)
/// into ContextCacheCoordinator calls for one request.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/generation_request.h"
#include "mkv/media.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

/// Per-position media identity of a prompt: `mediaTokenIds[0]` is the image placeholder token
/// and `mediaTokenIds[1]` (when present) the audio placeholder. Each maximal run of one
/// placeholder maps to the next item of that modality; every position of the run gets the item's
/// content digest and its offset in the run. Returns an empty vector for a text-only prompt.
/// Throws mkv::Error when the prompt has more runs than items, or an image cannot be read on
/// the host (callers check `hostReadable` first).
std::vector<MediaPosition> buildMediaPositions(std::vector<int32_t> const& tokens,
                                               std::vector<int32_t> const& mediaTokenIds,
                                               std::vector<imageUtils::ImageData> const& images,
                                               std::vector<audioUtils::AudioData> const& audios);

/// One request's context-reuse state as the runtime sees it. Move-only. Every bool method
/// returns false (with one log line naming the operation and whether the coordinator is
/// poisoned) for an expected failure, and throws mkv::Error for misuse. Destroying a live
/// request abandons it (see ContextCacheCoordinator::RequestHandle).
class ContextCacheRequest {
 public:
  /// kNoCapacity: transient pool pressure, retry at a later step boundary (the enum is shared
  /// with BoundedSwaRequest, so the facade returns one type for both backends).
  using AdmitSequenceStatus = mkv::AdmitSequenceStatus;

  /// Builds the batch admission (prompts, LoRA and salt identity, per-position media digests,
  /// lookup policies) and admits it. nullopt when the coordinator refuses (capacity / poisoned).
  /// A batch whose images the host cannot read goes on bypass. Throws when the context's sizes
  /// disagree, or the request's LoRA name differs from the context's.
  static std::optional<ContextCacheRequest> begin(
      ContextCacheCoordinator& coordinator, LLMGenerationRequest const& request,
      DecodingInferenceContext const& context, bool speculativeRequest,
      DecodingKvHeadroom const& headroom, std::vector<int32_t> const& mediaTokenIds = {},
      DecodingTokenStateContract tokenStateContract =
          DecodingTokenStateContract::kCommittedPlusLookahead,
      ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens);

  ContextCacheRequest(ContextCacheRequest&&) noexcept = default;
  ContextCacheRequest& operator=(ContextCacheRequest&&) = delete;
  ContextCacheRequest(ContextCacheRequest const&) = delete;
  ContextCacheRequest& operator=(ContextCacheRequest const&) = delete;
  ~ContextCacheRequest() = default;

  /// Reuse length per execution row (execution starts here), compacted with the batch.
  std::vector<int32_t> const& prefillStarts() const noexcept { return mPrefillStarts; }
  int32_t reuseTokenLength(ExecutionRow row) const;

  bool preparePrefill();
  /// Bounded-SWA windows only: a no-op here, true.
  bool prepareSwaPrefill(std::vector<int32_t> const& /*effectiveInputLengths*/) { return true; }
  bool enqueuePrefillCaptures();
  /// The reuse points row `row` captures in the prepared prefill
  /// (ContextCacheCoordinator::reusePointCaptures).
  std::span<ReusePointCapture const> reusePointCaptures(ExecutionRow row) const {
    return mCoordinator->reusePointCaptures(mHandle, row);
  }
  /// Prefill advances from the context: the whole prompt, plus the one sampled lookahead token
  /// under kCommittedPlusLookahead (generatedTokenIds[row].size() must be 1, else 0). A founder
  /// whose prefill chunks stopped short of its prompt (awaitsPrefill) samples nothing (its list
  /// must be empty): it holds and goes on as an unfinalised in-flight admission.
  bool completePrefill(DecodingInferenceContext const& context,
                       std::vector<int32_t> const& commonStateLengths);
  /// Whether row `row` has prompt tokens left to prefill before it samples
  /// (ContextCacheCoordinator::awaitsPrefill).
  bool awaitsPrefill(ExecutionRow row) const { return mCoordinator->awaitsPrefill(mHandle, row); }
  bool prepareDecodeStep(DecodingInferenceContext const& context,
                         DecodingKvHeadroom const& headroom);
  /// What the next prepareDecodeStep would take (ContextCacheCoordinator::decodeStepDemand).
  DecodeStepDemand decodeStepDemand(DecodingKvHeadroom const& headroom) const {
    return mCoordinator->decodeStepDemand(mHandle, headroom);
  }
  /// Decode advances from the growth of generatedTokenIds since prepareDecodeStep. A row that
  /// stopped without a new token must be kCancelled or kError (held); rows finished for any
  /// other reason are published.
  bool completeDecodeStep(DecodingInferenceContext const& context,
                          std::vector<int32_t> const& commonStateLengths);
  bool beginBatchCompaction(std::vector<int32_t> const& oldToNew, int32_t newBatchSize,
                            Tensor& deviceBatchMapping);
  /// `keepMapping` must equal the mapping given to beginBatchCompaction.
  bool completeBatchCompaction(std::vector<int32_t> const& keepMapping);
  bool finish();

  /// In-flight admission of a joiner with the founding request's identity (inheritedJoiner) and
  /// `loraWeightsName` as its adapter: the overload below.
  AdmitSequenceStatus admitSequence(std::vector<int32_t> const& tokenIds,
                                    std::string const& loraWeightsName,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {},
                                    std::vector<imageUtils::ImageData> const& imageBuffers = {},
                                    std::vector<audioUtils::AudioData> const& audioBuffers = {});
  /// In-flight admission (ContextCacheCoordinator::admitSequence) of the joiner `joiner`
  /// describes (joinerAdmission). kAdmitted with `prefillStart` set; kNoCapacity, changing
  /// nothing, when the pool cannot hold it; kFailed when poisoned. Throws what joinerAdmission
  /// and the coordinator throw for, for another stream than the request's and while a decode
  /// step is prepared, changing nothing.
  AdmitSequenceStatus admitSequence(LLMGenerationRequest const& joiner,
                                    std::vector<int32_t> const& tokenIds,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {});
  /// The coordinator's admission of a joiner: `tokenIds` keyed by the joiner's LoRA and salt,
  /// its retention, its commit policy, its lookup policy (the sequence's override, else the
  /// request-level one; kBypass when the model takes media and an image is not host-readable)
  /// and the media positions of its images and audio. Throws mkv::Error (naming `call`) unless
  /// `joiner` has exactly one sequence, no replay tail, commit and lookup policies in range and
  /// valid retention, and for what buildMediaPositions throws for.
  static ContextCacheSequenceAdmission joinerAdmission(char const* call,
                                                       LLMGenerationRequest const& joiner,
                                                       std::vector<int32_t> const& tokenIds,
                                                       ResidentRef resident,
                                                       std::vector<int32_t> const& mediaTokenIds);
  /// The joiner the first overload admits: the founding request's cache salt, retention, commit
  /// policy and resolved batch lookup policy, with `loraWeightsName` and one sequence of these
  /// images and audio.
  LLMGenerationRequest inheritedJoiner(
      std::string const& loraWeightsName, std::vector<imageUtils::ImageData> const& imageBuffers,
      std::vector<audioUtils::AudioData> const& audioBuffers) const;
  /// Preemption (ContextCacheCoordinator::preemptSequence); false when poisoned or quarantined.
  bool preemptSequence(ExecutionRow row);
  /// Preemption of either kind (ContextCacheCoordinator::preemptSequence with a PreemptionKind;
  /// kSwap throws without a host tier); false when poisoned or quarantined.
  bool preemptSequence(ExecutionRow row, PreemptionKind kind);
  /// Before the step that runs a joiner's next chunk (ContextCacheCoordinator::
  /// preparePrefillChunk: under JoinerPageAllocation::kPerChunk it allocates the chunk's pages);
  /// false when the pools cannot (lastFailure() names the row, kNoCapacity) or when poisoned.
  bool preparePrefillChunk(ExecutionRow row, int32_t chunkEnd);
  /// What preparePrefillChunk(row, chunkEnd) would allocate
  /// (ContextCacheCoordinator::prefillChunkDemand).
  DecodeStepDemand prefillChunkDemand(ExecutionRow row, int32_t chunkEnd) const {
    return mCoordinator->prefillChunkDemand(mHandle, row, chunkEnd);
  }
  /// A chunk of an in-flight admission's prefill completed
  /// (ContextCacheCoordinator::completePrefillChunk); false when poisoned.
  bool completePrefillChunk(ExecutionRow row, int32_t prefilledTokens);
  bool finalizeSequenceAdmission(ExecutionRow row, int32_t const& lookaheadToken,
                                 int32_t fullInputLength);
  /// Undoes the newest in-flight admission that was not finalised (see the coordinator's): true
  /// when it did; false, changing nothing, when there is none to undo or work is pending; false
  /// and poisoned when the row clear failed on the device. Never throws.
  bool retractSequenceAdmission() noexcept;
  /// Why a call failed (ContextCacheCoordinator::lastFailure).
  RowFailure lastFailure() const noexcept { return mCoordinator->lastFailure(mHandle); }

  /// Hybrid-MTP endpoint publication (ContextCacheCoordinator::publishHybridMtpEndpoint): false
  /// when the capture synchronisation failed (poisoned). Throws on deployments that are not
  /// Hybrid-MTP and for misuse.
  bool publishHybridMtpEndpoint(ExecutionRow row, int32_t residentStateLength,
                                Tensor const& baseHiddenStates, int32_t boundaryHiddenRow);
  /// Hybrid-MTP boundary hidden restore (ContextCacheCoordinator::restoreHybridMtpBoundaryHidden);
  /// throws on deployments that are not Hybrid-MTP and for misuse.
  bool restoreHybridMtpBoundaryHidden(ExecutionRow row, Tensor& baseHiddenStates,
                                      int32_t destinationRow);

  bool poisoned() const noexcept { return mCoordinator->poisoned(); }
  /// The coordinator's handle: invalid (id 0) once finished or quarantined.
  ContextCacheCoordinator::RequestHandle const& handle() const noexcept { return mHandle; }
  ContextCacheCoordinator& coordinator() const noexcept { return *mCoordinator; }

 private:
  ContextCacheRequest(ContextCacheCoordinator& coordinator,
                      ContextCacheCoordinator::RequestHandle handle,
                      std::vector<int32_t> prefillStarts, DecodingTokenStateContract contract,
                      LLMGenerationRequest founderIdentity, cudaStream_t stream);
  bool check(ContextCacheStatus status, char const* operation) const;

  ContextCacheCoordinator* mCoordinator;
  ContextCacheCoordinator::RequestHandle mHandle;
  std::vector<int32_t> mPrefillStarts;
  DecodingTokenStateContract mContract;
  /// The founding request's cache salt, retention, commit policy and resolved batch lookup
  /// policy (no sequences): what inheritedJoiner gives a joiner.
  LLMGenerationRequest mFounderIdentity;
  cudaStream_t mStream;
  /// Per execution row: 1 while an in-flight admission is not finalised.
  std::vector<uint8_t> mUnfinalized;
  /// generatedTokenIds sizes recorded by prepareDecodeStep (empty when no step is prepared).
  std::optional<std::vector<std::size_t>> mPreparedCounts;
  /// Buffers of the decode-step calls, kept between steps so a step allocates nothing.
  struct StepScratch {
    std::vector<std::size_t> counts;
    std::vector<ContextCacheSequenceAdvance> advances;
    std::vector<int32_t> completed;
  } mStepScratch;
  std::vector<int32_t> mPendingMapping;
};

}  // namespace mkv
