#include "mkv/sliding_reuse_request.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "core/check.h"
#include "mkv/logging.h"
#include "resources/backend_requests.h"
#include "resources/shared_synchronizer.h"

namespace mkv {
namespace {

constexpr DecodingKvHeadroom kVanillaHeadroom{1, 0};

void requireVanillaRequest(char const* call, bool speculativeRequest,
                           DecodingKvHeadroom const& headroom,
                           DecodingTokenStateContract tokenStateContract) {
  MKV_REQUIRE(!speculativeRequest, call,
              "the sliding-window reuse backend does not decode speculatively");
  MKV_REQUIRE(headroom == kVanillaHeadroom, call,
              "the sliding-window reuse backend needs headroom {{1, 0}}, got {{{}, {}}}",
              headroom.baseExtraTokens, headroom.draftExtraTokens);
  MKV_REQUIRE(tokenStateContract == DecodingTokenStateContract::kCommittedPlusLookahead, call,
              "the sliding-window reuse backend needs the committed-plus-lookahead contract");
}

/// The SWA half's admission of each row: its prompt, its reuse start and the cached window
/// pages before the start (held by the manager from now on).
std::vector<SwaReuseStart> swaStarts(ContextCacheCoordinator const& coordinator,
                                     ContextCacheRequest const& full,
                                     std::vector<int32_t> const& prompts) {
  std::vector<SwaReuseStart> starts(prompts.size());
  for (std::size_t row = 0; row < prompts.size(); ++row) {
    starts[row].promptTokens = prompts[row];
    starts[row].startTokens = full.prefillStarts()[row];
    starts[row].windowPages =
        coordinator.reusedWindowPages(full.handle(), static_cast<ExecutionRow>(row));
  }
  return starts;
}

}  // namespace

SlidingReuseRequest::SlidingReuseRequest(ContextCacheRequest full, BoundedSwaKVPageManager& manager,
                                         BoundedSwaKVPageManager::RequestHandle handle,
                                         std::vector<int32_t> prompts,
                                         ContextCacheCommitPolicy commitPolicy)
    : mFull(std::move(full)),
      mManager(&manager),
      mHandle(std::move(handle)),
      mPromptTokens(std::move(prompts)),
      mCommitPolicy(commitPolicy) {}

SlidingReuseRequest::~SlidingReuseRequest() {
  detail::SharedSynchronizer::Scope const once(mManager->sharedSynchronizer());
  // Abandoned inside the scope, in the members' order of destruction: the SWA half first.
  ContextCacheRequest const full = std::move(mFull);
  BoundedSwaKVPageManager::RequestHandle const sliding = std::move(mHandle);
}

std::optional<SlidingReuseRequest> SlidingReuseRequest::begin(
    ContextCacheCoordinator& coordinator, BoundedSwaKVPageManager& manager,
    LLMGenerationRequest const& request, DecodingInferenceContext const& context,
    bool speculativeRequest, DecodingKvHeadroom const& headroom,
    std::vector<int32_t> const& mediaTokenIds, DecodingTokenStateContract tokenStateContract,
    ContextCacheCommitPolicy commitPolicy) {
  requireVanillaRequest("SlidingReuseRequest::begin", speculativeRequest, headroom,
                        tokenStateContract);
  std::optional<ContextCacheRequest> full =
      ContextCacheRequest::begin(coordinator, request, context, speculativeRequest, headroom,
                                 mediaTokenIds, tokenStateContract, commitPolicy);
  if (!full) {
    return std::nullopt;
  }
  std::vector<int32_t> prompts;
  prompts.reserve(context.rawBatchedInputIds.size());
  for (auto const& prompt : context.rawBatchedInputIds) {
    prompts.push_back(static_cast<int32_t>(prompt.size()));
  }
  std::vector<SwaReuseStart> const starts = swaStarts(coordinator, *full, prompts);
  auto begun = manager.beginRequest(context.residentRefs, context.stream, starts);
  if (begun.status != SwaKVCacheStatus::kOk) {
    logger()->error(
        "ManagedKVCacheRequest::begin failed on the sliding pool of the sliding-window reuse "
        "backend: {}{}",
        toString(begun.status), manager.poisoned() ? " (backend poisoned)" : " (no capacity)");
    return std::nullopt;  // `full` is abandoned: its leases go back unpublished
  }
  return SlidingReuseRequest(std::move(*full), manager, std::move(*begun.request),
                             std::move(prompts), commitPolicy);
}

bool SlidingReuseRequest::swaStatus(SwaKVCacheStatus status, char const* operation) const {
  if (status == SwaKVCacheStatus::kOk) {
    return true;
  }
  logger()->error("ManagedKVCacheRequest::{} failed on the sliding pool: {}{}", operation,
                  toString(status),
                  mManager->poisoned() ? " (backend poisoned)" : " (request failed)");
  return false;
}

bool SlidingReuseRequest::poisoned() const noexcept {
  return mFull.poisoned() || mManager->poisoned();
}

bool SlidingReuseRequest::preparePrefill() {
  mManager->checkLengthPoolsFree(mHandle, "SlidingReuseRequest::preparePrefill");
  return mFull.preparePrefill();
}

bool SlidingReuseRequest::prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths) {
  constexpr char const* kCall = "SlidingReuseRequest::prepareSwaPrefill";
  std::vector<int32_t> const& starts = mFull.prefillStarts();
  MKV_REQUIRE(effectiveInputLengths.size() == starts.size(), kCall, "{} lengths for a batch of {}",
              effectiveInputLengths.size(), starts.size());
  mSwaLengths.clear();
  for (std::size_t row = 0; row < starts.size(); ++row) {
    // The manager maps up to the endpoint the prefill reaches: start + executed tokens.
    mSwaLengths.push_back(starts[row] + effectiveInputLengths[row]);
  }
  mManager->preparePrefill(mHandle, mSwaLengths);
  return true;
}

int32_t SlidingReuseRequest::publishMappedBlocks(std::size_t row, int32_t firstBlock,
                                                 int32_t endBlock) {
  SwaSequenceState const& state = mManager->state(mHandle, static_cast<int32_t>(row));
  int32_t mappedFrom = endBlock;
  mBlockPages.clear();
  auto const take = [&](SwaPageBinding const& binding) {
    if (binding.logicalPage >= firstBlock && binding.logicalPage < endBlock) {
      mappedFrom = std::min(mappedFrom, binding.logicalPage);
      mBlockPages.push_back(binding.page);
    }
  };
  for (SwaPageBinding const& binding : state.pendingRetire) {  // leaving the window now
    take(binding);
  }
  for (SwaPageBinding const& binding : state.bindings) {
    take(binding);
  }
  MKV_ASSERT(static_cast<int32_t>(mBlockPages.size()) == endBlock - mappedFrom,
             "row {}: {} sliding pages mapped for blocks [{}, {})", row, mBlockPages.size(),
             mappedFrom, endBlock);
  if (!mBlockPages.empty()) {
    mFull.coordinator().publishWindowBlocks(mFull.handle(), static_cast<ExecutionRow>(row),
                                            mappedFrom, mBlockPages);
  }
  return mappedFrom;
}

void SlidingReuseRequest::publishPromptBlocks(std::size_t row) {
  int32_t const pageSize = mManager->tokensPerPage();
  int32_t const startBlock = mFull.prefillStarts()[row] / pageSize;
  // Every complete prompt block the prefill executed is still mapped.
  int32_t const mappedFrom = publishMappedBlocks(row, startBlock, mPromptTokens[row] / pageSize);
  MKV_ASSERT(mappedFrom == startBlock, "row {}: prompt blocks from {} mapped, not from {}", row,
             mappedFrom, startBlock);
}

void SlidingReuseRequest::publishGeneratedWindow(std::size_t row) {
  int32_t const pageSize = mManager->tokensPerPage();
  SwaSequenceState const& state = mManager->state(mHandle, static_cast<int32_t>(row));
  // Tokens whose sliding KV exists once the step completes: the coordinator's committed count.
  int32_t const endBlock = state.pendingEndpoint.value_or(state.endpoint) / pageSize;
  (void)publishMappedBlocks(row, mPromptTokens[row] / pageSize, endBlock);
}

bool SlidingReuseRequest::preemptSequence(ExecutionRow row) {
  if (!mFull.preemptSequence(row)) {
    return false;
  }
  if (mCommitPolicy == ContextCacheCommitPolicy::kIncludingGeneratedTokens) {
    publishGeneratedWindow(static_cast<std::size_t>(row));
  }
  return true;
}

bool SlidingReuseRequest::completePrefill(DecodingInferenceContext const& context,
                                          std::vector<int32_t> const& commonStateLengths) {
  // The coordinator publishes the full layers' blocks and marks the prefill complete; then the
  // sliding pages of the same blocks are published, before the SWA half retires the ones that
  // left the window (a published page stays cached). The SWA half's checks come first: neither
  // half changes unless both accept.
  mManager->checkPreparedWritesOnDevice(mHandle, "SlidingReuseRequest::completePrefill");
  bool const fullOk = mFull.completePrefill(context, commonStateLengths);
  if (fullOk) {
    for (std::size_t row = 0; row < mPromptTokens.size(); ++row) {
      publishPromptBlocks(row);
    }
  }
  mManager->completePrefill(mHandle);
  return fullOk;
}

bool SlidingReuseRequest::prepareDecodeStep(DecodingInferenceContext const& context,
                                            DecodingKvHeadroom const& headroom) {
  requireVanillaRequest("SlidingReuseRequest::prepareDecodeStep", false, headroom,
                        DecodingTokenStateContract::kCommittedPlusLookahead);
  if (!mFull.prepareDecodeStep(context, headroom)) {
    return false;
  }
  return swaStatus(mManager->prepareDecodeStep(mHandle), "prepareDecodeStep");
}

bool SlidingReuseRequest::completeDecodeStep(DecodingInferenceContext const& context,
                                             std::vector<int32_t> const& commonStateLengths) {
  mManager->checkPreparedWritesOnDevice(mHandle, "SlidingReuseRequest::completeDecodeStep");
  bool const fullOk = mFull.completeDecodeStep(context, commonStateLengths);
  if (fullOk && mCommitPolicy == ContextCacheCommitPolicy::kIncludingGeneratedTokens) {
    // The rows the full half just published (ContextCacheRequest: a normal completion).
    for (std::size_t row = 0; row < context.finishReasons.size(); ++row) {
      FinishReason const reason = context.finishReasons[row];
      if (reason != FinishReason::kNotFinished && reason != FinishReason::kCancelled &&
          reason != FinishReason::kError &&
          !mManager->state(mHandle, static_cast<int32_t>(row)).joining) {
        publishGeneratedWindow(row);
      }
    }
  }
  mManager->completeDecodeStep(mHandle);
  return fullOk;
}

bool SlidingReuseRequest::beginBatchCompaction(std::vector<int32_t> const& oldToNew,
                                               int32_t newBatchSize, Tensor& deviceBatchMapping) {
  constexpr char const* kCall = "SlidingReuseRequest::beginBatchCompaction";
  std::vector<int32_t> pending = oldToNew;  // copied first: nothing fails after the calls
  // Each half compacts its own length tensor (the sliding pool's, the full pool's): both halves
  // check everything before either begins, then both copy the same mapping into
  // deviceBatchMapping.
  mManager->checkBeginBatchCompaction(mHandle, oldToNew, newBatchSize, deviceBatchMapping, kCall);
  mFull.coordinator().checkBeginBatchCompaction(mFull.handle(), oldToNew, newBatchSize,
                                                deviceBatchMapping, kCall);
  mManager->beginBatchCompaction(mHandle, oldToNew, newBatchSize, deviceBatchMapping);
  mFull.beginBatchCompaction(oldToNew, newBatchSize, deviceBatchMapping);
  mPendingMapping = std::move(pending);
  return true;
}

bool SlidingReuseRequest::completeBatchCompaction(std::vector<int32_t> const& keepMapping) {
  constexpr char const* kCall = "SlidingReuseRequest::completeBatchCompaction";
  detail::requireBegunMapping(kCall, mPendingMapping, keepMapping);
  // As at the begin: the engine may have resized either half's length tensor since.
  mManager->checkCompactBatch(mHandle, kCall);
  mFull.coordinator().checkCompactBatch(mFull.handle(), kCall);
  detail::SharedSynchronizer::Scope const once(mManager->sharedSynchronizer());
  bool const fullOk = mFull.completeBatchCompaction(keepMapping);
  bool const swaOk = swaStatus(mManager->compactBatch(mHandle), "completeBatchCompaction");
  std::vector<int32_t> kept;
  for (std::size_t row = 0; row < mPendingMapping.size(); ++row) {
    if (mPendingMapping[row] >= 0) {
      kept.push_back(mPromptTokens[row]);  // order-preserving: the k-th survivor goes to k
    }
  }
  mPromptTokens = std::move(kept);
  mPendingMapping.clear();
  return fullOk && swaOk;
}

bool SlidingReuseRequest::finish() {
  detail::SharedSynchronizer::Scope const once(mManager->sharedSynchronizer());
  bool const fullOk = mFull.finish();
  bool const swaOk = swaStatus(mManager->finish(mHandle), "finish");
  return fullOk && swaOk;
}

AdmitSequenceStatus SlidingReuseRequest::admitSequence(
    std::vector<int32_t> const& tokenIds, std::string const& loraWeightsName,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds,
    std::vector<imageUtils::ImageData> const& imageBuffers,
    std::vector<audioUtils::AudioData> const& audioBuffers) {
  requireVanillaRequest("SlidingReuseRequest::admitSequence", false, headroom,
                        DecodingTokenStateContract::kCommittedPlusLookahead);
  mPromptTokens.reserve(mPromptTokens.size() + 1);  // nothing after the admissions allocates
  int32_t start = 0;
  AdmitSequenceStatus const status =
      mFull.admitSequence(tokenIds, loraWeightsName, headroom, start, resident, stream,
                          mediaTokenIds, imageBuffers, audioBuffers);
  if (status != AdmitSequenceStatus::kAdmitted) {
    return status;
  }
  auto const row = static_cast<ExecutionRow>(mFull.prefillStarts().size() - 1);
  SwaReuseStart swaStart;
  swaStart.promptTokens = static_cast<int32_t>(tokenIds.size());
  swaStart.startTokens = start;
  SwaKVCacheStatus swa = SwaKVCacheStatus::kRequestFailed;
  try {
    swaStart.windowPages = mFull.coordinator().reusedWindowPages(mFull.handle(), row);
    swa = mManager->admitSequence(mHandle, resident, swaStart);
  } catch (...) {
    (void)mFull.retractSequenceAdmission();  // the halves stay in step; the error goes on
    throw;
  }
  if (swa != SwaKVCacheStatus::kOk) {
    (void)swaStatus(swa, "admitSequence");
    bool const retracted = mFull.retractSequenceAdmission();
    return swa == SwaKVCacheStatus::kRequestFailed && retracted ? AdmitSequenceStatus::kNoCapacity
                                                                : AdmitSequenceStatus::kFailed;
  }
  mPromptTokens.push_back(swaStart.promptTokens);
  prefillStart = start;
  return AdmitSequenceStatus::kAdmitted;
}

bool SlidingReuseRequest::finalizeSequenceAdmission(ExecutionRow row, int32_t const& lookaheadToken,
                                                    int32_t fullInputLength) {
  constexpr char const* kCall = "SlidingReuseRequest::finalizeSequenceAdmission";
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < mPromptTokens.size() &&
                  mManager->state(mHandle, row).joining,
              kCall, "row {} is not an unfinalised in-flight admission", row);
  // As completePrefill: the full half publishes its blocks, then the sliding pages of the same
  // blocks are published before the SWA half retires what left the window.
  if (!mFull.finalizeSequenceAdmission(row, lookaheadToken, fullInputLength)) {
    return false;  // poisoned; finish releases the SWA half's joiner
  }
  publishPromptBlocks(static_cast<std::size_t>(row));
  mManager->finalizeSequenceAdmission(mHandle, row);
  return true;
}

RowFailure SlidingReuseRequest::lastFailure() const noexcept {
  RowFailure const full = mFull.lastFailure();
  return full.reason != RowFailureReason::kNone ? full : mManager->lastFailure(mHandle);
}

bool SlidingReuseRequest::retractSequenceAdmission() noexcept {
  // Both halves must hold the same undoable joiner; they can disagree after a call that failed
  // on one half (a decode step the SWA half refused, a quarantined half): then nothing is
  // undone on either, and the engine finishes the request.
  if (!mManager->hasRetractableAdmission(mHandle) ||
      !mFull.coordinator().hasRetractableAdmission(mFull.handle())) {
    return false;
  }
  bool const full = mFull.retractSequenceAdmission();
  bool const swa = mManager->retractSequenceAdmission(mHandle);
  mPromptTokens.pop_back();
  return full && swa;
}

bool SlidingReuseRequest::publishHybridMtpEndpoint(ExecutionRow row,
                                                   int32_t /*residentStateLength*/,
                                                   Tensor const& /*baseHiddenStates*/,
                                                   int32_t /*boundaryHiddenRow*/) {
  detail::throwContract("SlidingReuseRequest::publishHybridMtpEndpoint",
                        "row {}: the sliding-window reuse backend has no recurrent layers", row);
}

bool SlidingReuseRequest::restoreHybridMtpBoundaryHidden(ExecutionRow row,
                                                         Tensor& /*baseHiddenStates*/,
                                                         int32_t /*destinationRow*/) {
  detail::throwContract("SlidingReuseRequest::restoreHybridMtpBoundaryHidden",
                        "row {}: the sliding-window reuse backend has no recurrent layers", row);
}

}  // namespace mkv
