#pragma once
/// \file bounded_swa_request.h
/// Translates the runtime's per-request view (LLMGenerationRequest + DecodingInferenceContext)
/// into BoundedSwaKVPageManager calls for one request: the bounded-SWA counterpart of
/// ContextCacheRequest, with the same lifecycle calls, so ManagedKVCacheRequest dispatches to
/// either one way. One request's path through both: docs/architecture.md.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/cuda_types.h"
#include "mkv/generation_request.h"
#include "mkv/media.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

/// One request's bounded-SWA state as the runtime sees it: the manager's handle and the mapping
/// of a begun compaction. Move-only. Every bool method returns false for an expected failure
/// (the manager's kRequestFailed / kPoisoned), logged once with the operation and whether the
/// manager is poisoned, and throws mkv::Error, changing nothing, for misuse, including the calls
/// this backend does not offer (context reuse, Hybrid-MTP). Destroying a live request abandons
/// it (see BoundedSwaKVPageManager::RequestHandle). Thread-safety: single writer.
class BoundedSwaRequest {
 public:
  /// Admits the context's residents (2M + 1 pages each, all or nothing). Throws unless the
  /// request is not speculative, headroom is {1, 0}, the contract is kCommittedPlusLookahead and
  /// the context holds activeBatchSize > 0 prompts and as many residents (`request`, the media
  /// tokens and the commit policy mean nothing without reuse). nullopt when the manager refuses
  /// (no free pages, poisoned).
  static std::optional<BoundedSwaRequest> begin(
      BoundedSwaKVPageManager& manager, LLMGenerationRequest const& request,
      DecodingInferenceContext const& context, bool speculativeRequest,
      DecodingKvHeadroom const& headroom, std::vector<int32_t> const& mediaTokenIds = {},
      DecodingTokenStateContract tokenStateContract =
          DecodingTokenStateContract::kCommittedPlusLookahead,
      ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens);

  BoundedSwaRequest(BoundedSwaRequest&&) noexcept = default;
  BoundedSwaRequest& operator=(BoundedSwaRequest&&) = delete;
  BoundedSwaRequest(BoundedSwaRequest const&) = delete;
  BoundedSwaRequest& operator=(BoundedSwaRequest const&) = delete;
  ~BoundedSwaRequest() = default;

  /// nullptr: nothing is reused, every row executes from position 0.
  std::vector<int32_t> const* prefillStarts() const noexcept { return nullptr; }
  /// Throws: the bounded-SWA backend has no context reuse.
  int32_t reuseTokenLength(ExecutionRow row) const;
  /// No checkpoints on this backend: empty.
  std::span<ReusePointCapture const> reusePointCaptures(ExecutionRow /*row*/) const { return {}; }

  /// No-op (the windows are mapped by prepareSwaPrefill), true.
  bool preparePrefill() { return true; }
  /// Maps each row's window for its executed prefill length (tokens) and resets the length
  /// pools (BoundedSwaKVPageManager::preparePrefill); true.
  bool prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths);
  /// No-op (no checkpoints), true.
  bool enqueuePrefillCaptures() { return true; }
  /// Retires pages that left the window and trims each row to M + 1 pages; true. A founder whose
  /// first chunk completed short of its prompt (completePrefillChunk in the prefill) holds, as an
  /// unfinalised joiner. Throws when the context's prompts or generated lists disagree with the
  /// batch, or a held founder's generated list is not empty (`commonStateLengths` unread).
  bool completePrefill(DecodingInferenceContext const& context,
                       std::vector<int32_t> const& commonStateLengths);
  /// Maps the next window page and stages one retirement per row. Throws unless headroom is
  /// {1, 0} and the context's rows match the batch; false (request finishing) when a row would
  /// pass the table width.
  bool prepareDecodeStep(DecodingInferenceContext const& context,
                         DecodingKvHeadroom const& headroom);
  /// Commits the step's retirements; true. Throws as completePrefill.
  bool completeDecodeStep(DecodingInferenceContext const& context,
                          std::vector<int32_t> const& commonStateLengths);
  /// Validates `oldToNew` and copies it into deviceBatchMapping; true (throws for misuse).
  bool beginBatchCompaction(std::vector<int32_t> const& oldToNew, int32_t newBatchSize,
                            Tensor& deviceBatchMapping);
  /// `keepMapping` must equal the mapping given to beginBatchCompaction (throws otherwise).
  /// Clears dropped rows, compacts the lengths, synchronises, frees the dropped pages; false
  /// when the synchronisation failed (request quarantined, manager poisoned).
  bool completeBatchCompaction(std::vector<int32_t> const& keepMapping);
  /// Synchronises pending work and releases every page; false when the manager is poisoned or
  /// the synchronisation failed (request quarantined).
  bool finish();

  /// In-flight admission (BoundedSwaKVPageManager::admitSequence without a page source): the
  /// joiner takes 2M + 1 pages and its row maps the window of its whole prompt; nothing is
  /// cached, so `prefillStart` is 0 and the adapter, media and images mean nothing here.
  /// kNoCapacity when fewer than 2M + 1 pages are free, kFailed (one log line) when poisoned.
  /// Throws, changing nothing, unless headroom is {1, 0} and `stream` is the request's, for a
  /// prompt outside (0, the table width], and where the manager's admitSequence throws.
  AdmitSequenceStatus admitSequence(std::vector<int32_t> const& tokenIds,
                                    std::string const& loraWeightsName,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {},
                                    std::vector<imageUtils::ImageData> const& imageBuffers = {},
                                    std::vector<audioUtils::AudioData> const& audioBuffers = {});
  /// The same for a joiner with its own identity (which keys nothing without a cache, and whose
  /// retention is not read); throws as well for a `joiner` that has not exactly one sequence,
  /// has a replay tail, or a commit or lookup policy out of range.
  AdmitSequenceStatus admitSequence(LLMGenerationRequest const& joiner,
                                    std::vector<int32_t> const& tokenIds,
                                    DecodingKvHeadroom const& headroom, int32_t& prefillStart,
                                    ResidentRef resident, cudaStream_t stream,
                                    std::vector<int32_t> const& mediaTokenIds = {});
  /// Nothing is cached for a resumption to reuse: nothing to publish, true (the engine compacts
  /// the row away; resuming recomputes it). Throws during a step or compaction, for a row
  /// outside the batch and for an unfinalised joiner
  /// (BoundedSwaKVPageManager::checkPreemptSequence).
  bool preemptSequence(ExecutionRow row);
  /// kRecompute: preemptSequence(row). kSwap throws, changing nothing: no host tier.
  bool preemptSequence(ExecutionRow row, PreemptionKind kind);
  /// Before the step that runs joiner `row`'s chunk to `chunkEnd` (or, in the prefill, founder
  /// `row`'s first chunk): maps what the chunk reads and keeps
  /// (BoundedSwaKVPageManager::prepareSequenceChunk); false (one log line) when poisoned.
  bool preparePrefillChunk(ExecutionRow row, int32_t chunkEnd);
  /// What preparePrefillChunk would allocate: nothing (the joiner's window rotates within the
  /// 2M + 1 pages its admission took); checks the row and the end as the manager's chunk calls.
  DecodeStepDemand prefillChunkDemand(ExecutionRow row, int32_t chunkEnd) const;
  /// After the step that ran it: commits the chunk, the window rotating
  /// (BoundedSwaKVPageManager::completeSequenceChunk); false when poisoned.
  bool completePrefillChunk(ExecutionRow row, int32_t prefilledTokens);
  /// After the joiner's last chunk (or its whole prefill): it decodes from the next step on
  /// (BoundedSwaKVPageManager::finalizeSequenceAdmission). Throws as the manager does and for a
  /// fullInputLength other than its prompt; false when poisoned.
  bool finalizeSequenceAdmission(ExecutionRow row, int32_t const& lookaheadToken,
                                 int32_t fullInputLength);
  /// Undoes the newest joiner that was not finalised (BoundedSwaKVPageManager::
  /// retractSequenceAdmission): true when it did; never throws.
  bool retractSequenceAdmission() noexcept;
  /// What the next prepareDecodeStep would take (BoundedSwaKVPageManager::decodeStepDemand);
  /// throws unless headroom is {1, 0}.
  DecodeStepDemand decodeStepDemand(DecodingKvHeadroom const& headroom) const;
  /// Why a call failed (BoundedSwaKVPageManager::lastFailure).
  RowFailure lastFailure() const noexcept { return mManager->lastFailure(mHandle); }

  /// Throws: Hybrid-MTP needs context reuse.
  bool publishHybridMtpEndpoint(ExecutionRow row, int32_t residentStateLength,
                                Tensor const& baseHiddenStates, int32_t boundaryHiddenRow);
  /// Throws: Hybrid-MTP needs context reuse.
  bool restoreHybridMtpBoundaryHidden(ExecutionRow row, Tensor& baseHiddenStates,
                                      int32_t destinationRow);

  bool poisoned() const noexcept { return mManager->poisoned(); }
  /// The manager's handle: invalid (id 0) once finished or quarantined.
  BoundedSwaKVPageManager::RequestHandle const& handle() const noexcept { return mHandle; }

 private:
  BoundedSwaRequest(BoundedSwaKVPageManager& manager,
                    BoundedSwaKVPageManager::RequestHandle handle);
  void requireContextRows(char const* call, DecodingInferenceContext const& context) const;

  BoundedSwaKVPageManager* mManager;
  BoundedSwaKVPageManager::RequestHandle mHandle;
  std::vector<int32_t> mPendingMapping;  ///< of beginBatchCompaction, until it completes
};

}  // namespace mkv
