#include "mkv/bounded_swa_request.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <limits>
#include <utility>

#include "core/check.h"
#include "mkv/logging.h"
#include "resources/backend_requests.h"

namespace mkv {
namespace {

constexpr DecodingKvHeadroom kVanillaHeadroom{1, 0};

void requireVanillaHeadroom(char const* call, DecodingKvHeadroom const& headroom) {
  MKV_REQUIRE(headroom == kVanillaHeadroom, call,
              "the bounded-SWA backend needs headroom {{1, 0}}, got {{{}, {}}}",
              headroom.baseExtraTokens, headroom.draftExtraTokens);
}

/// True for kOk; otherwise logs the failed `operation` once and returns false. Worded as the
/// facade's call: ManagedKVCacheRequest is the adapter's caller, and operators read its names.
bool swaStatus(SwaKVCacheStatus status, BoundedSwaKVPageManager const& manager,
               char const* operation) {
  if (status == SwaKVCacheStatus::kOk) {
    return true;
  }
  logger()->error("ManagedKVCacheRequest::{} failed on the bounded-SWA backend: {}{}", operation,
                  toString(status),
                  manager.poisoned() ? " (backend poisoned)" : " (request failed)");
  return false;
}

}  // namespace

BoundedSwaRequest::BoundedSwaRequest(BoundedSwaKVPageManager& manager,
                                     BoundedSwaKVPageManager::RequestHandle handle)
    : mManager(&manager), mHandle(std::move(handle)) {}

std::optional<BoundedSwaRequest> BoundedSwaRequest::begin(
    BoundedSwaKVPageManager& manager, LLMGenerationRequest const& /*request*/,
    DecodingInferenceContext const& context, bool speculativeRequest,
    DecodingKvHeadroom const& headroom, std::vector<int32_t> const& /*mediaTokenIds*/,
    DecodingTokenStateContract tokenStateContract, ContextCacheCommitPolicy /*commitPolicy*/) {
  constexpr char const* kCall = "BoundedSwaRequest::begin";
  MKV_REQUIRE(!speculativeRequest, kCall, "the bounded-SWA backend does not decode speculatively");
  requireVanillaHeadroom(kCall, headroom);
  MKV_REQUIRE(tokenStateContract == DecodingTokenStateContract::kCommittedPlusLookahead, kCall,
              "the bounded-SWA backend needs the committed-plus-lookahead contract");
  MKV_REQUIRE(
      context.activeBatchSize > 0 &&
          context.rawBatchedInputIds.size() == static_cast<std::size_t>(context.activeBatchSize) &&
          context.residentRefs.size() == context.rawBatchedInputIds.size(),
      kCall, "activeBatchSize {} with {} prompts and {} residents", context.activeBatchSize,
      context.rawBatchedInputIds.size(), context.residentRefs.size());
  auto begun = manager.beginRequest(context.residentRefs, context.stream);
  if (begun.status != SwaKVCacheStatus::kOk) {
    swaStatus(begun.status, manager, "begin");
    return std::nullopt;
  }
  return BoundedSwaRequest(manager, std::move(*begun.request));
}

void BoundedSwaRequest::requireContextRows(char const* call,
                                           DecodingInferenceContext const& context) const {
  // The manager reads no context, but a context whose rows disagree with the batch is the engine
  // bug the context-reuse backend rejects; reject it on both backends alike.
  if (!mHandle.valid()) {
    return;  // the manager reports the invalid handle itself
  }
  auto const batch = static_cast<std::size_t>(mManager->batchSize(mHandle));
  MKV_REQUIRE(
      context.rawBatchedInputIds.size() == batch && context.generatedTokenIds.size() == batch, call,
      "context has {} prompts / {} generated lists for a batch of {}",
      context.rawBatchedInputIds.size(), context.generatedTokenIds.size(), batch);
}

int32_t BoundedSwaRequest::reuseTokenLength(ExecutionRow row) const {
  detail::throwContract("BoundedSwaRequest::reuseTokenLength",
                        "row {}: the bounded-SWA backend has no context reuse", row);
}

bool BoundedSwaRequest::prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths) {
  mManager->preparePrefill(mHandle, effectiveInputLengths);
  return true;
}

bool BoundedSwaRequest::completePrefill(DecodingInferenceContext const& context,
                                        std::vector<int32_t> const& /*commonStateLengths*/) {
  constexpr char const* kCall = "BoundedSwaRequest::completePrefill";
  requireContextRows(kCall, context);
  for (std::size_t i = 0; i < context.generatedTokenIds.size(); ++i) {
    MKV_REQUIRE(!mManager->awaitsPrefill(mHandle, static_cast<int32_t>(i)) ||
                    context.generatedTokenIds[i].empty(),
                kCall,
                "row {}: its prefill chunks stopped short of its prompt, so it samples nothing "
                "yet, got {} generated tokens",
                i, context.generatedTokenIds[i].size());
  }
  mManager->completePrefill(mHandle);
  return true;
}

bool BoundedSwaRequest::prepareDecodeStep(DecodingInferenceContext const& context,
                                          DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "BoundedSwaRequest::prepareDecodeStep";
  requireVanillaHeadroom(kCall, headroom);
  requireContextRows(kCall, context);
  SwaKVCacheStatus const status = mManager->prepareDecodeStep(mHandle);
  if (status != SwaKVCacheStatus::kOk && !mManager->poisoned()) {
    return detail::refusedStep("ManagedKVCacheRequest::prepareDecodeStep", lastFailure());
  }
  return swaStatus(status, *mManager, "prepareDecodeStep");
}

DecodeStepDemand BoundedSwaRequest::decodeStepDemand(DecodingKvHeadroom const& headroom) const {
  requireVanillaHeadroom("BoundedSwaRequest::decodeStepDemand", headroom);
  return mManager->decodeStepDemand(mHandle);
}

bool BoundedSwaRequest::completeDecodeStep(DecodingInferenceContext const& context,
                                           std::vector<int32_t> const& /*commonStateLengths*/) {
  requireContextRows("BoundedSwaRequest::completeDecodeStep", context);
  mManager->completeDecodeStep(mHandle);
  return true;
}

bool BoundedSwaRequest::beginBatchCompaction(std::vector<int32_t> const& oldToNew,
                                             int32_t newBatchSize, Tensor& deviceBatchMapping) {
  std::vector<int32_t> pending = oldToNew;  // copied first: nothing fails after the manager's call
  mManager->beginBatchCompaction(mHandle, oldToNew, newBatchSize, deviceBatchMapping);
  mPendingMapping = std::move(pending);
  return true;
}

bool BoundedSwaRequest::completeBatchCompaction(std::vector<int32_t> const& keepMapping) {
  detail::requireBegunMapping("BoundedSwaRequest::completeBatchCompaction", mPendingMapping,
                              keepMapping);
  SwaKVCacheStatus const status = mManager->compactBatch(mHandle);
  mPendingMapping.clear();
  return swaStatus(status, *mManager, "completeBatchCompaction");
}

bool BoundedSwaRequest::finish() {
  return swaStatus(mManager->finish(mHandle), *mManager, "finish");
}

AdmitSequenceStatus BoundedSwaRequest::admitSequence(
    std::vector<int32_t> const& tokenIds, std::string const& /*loraWeightsName*/,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& /*mediaTokenIds*/,
    std::vector<imageUtils::ImageData> const& /*imageBuffers*/,
    std::vector<audioUtils::AudioData> const& /*audioBuffers*/) {
  constexpr char const* kCall = "BoundedSwaRequest::admitSequence";
  requireVanillaHeadroom(kCall, headroom);
  MKV_REQUIRE(stream == mManager->stream(), kCall, "stream differs from the request's stream");
  MKV_REQUIRE(tokenIds.size() <= static_cast<std::size_t>(std::numeric_limits<int32_t>::max()),
              kCall, "a prompt of {} tokens", tokenIds.size());
  SwaReuseStart start;  // nothing is cached: the joiner prefills from 0
  start.promptTokens = static_cast<int32_t>(tokenIds.size());
  SwaKVCacheStatus const status = mManager->admitSequence(mHandle, resident, start);
  if (status == SwaKVCacheStatus::kOk) {
    prefillStart = 0;
    return AdmitSequenceStatus::kAdmitted;
  }
  if (status == SwaKVCacheStatus::kRequestFailed) {
    return AdmitSequenceStatus::kNoCapacity;  // fewer than 2M + 1 free pages
  }
  swaStatus(status, *mManager, "admitSequence");
  return AdmitSequenceStatus::kFailed;
}

AdmitSequenceStatus BoundedSwaRequest::admitSequence(LLMGenerationRequest const& joiner,
                                                     std::vector<int32_t> const& tokenIds,
                                                     DecodingKvHeadroom const& headroom,
                                                     int32_t& prefillStart, ResidentRef resident,
                                                     cudaStream_t stream,
                                                     std::vector<int32_t> const& mediaTokenIds) {
  constexpr char const* kCall = "BoundedSwaRequest::admitSequence";
  // Its identity keys nothing here (no cache), but a malformed one is the engine bug every
  // backend rejects.
  MKV_REQUIRE(joiner.requests.size() == 1, kCall,
              "a joiner's request describes exactly one sequence, got {}", joiner.requests.size());
  MKV_REQUIRE(joiner.contextCacheReplayTailLength == 0, kCall,
              "a joiner has no replay tail, got {} tokens", joiner.contextCacheReplayTailLength);
  ContextCacheLookupPolicy const lookupPolicy =
      joiner.requests.front().contextCacheLookupPolicy.value_or(joiner.contextCacheLookupPolicy);
  MKV_REQUIRE(static_cast<uint8_t>(joiner.contextCacheCommitPolicy) <= 1 &&
                  static_cast<uint8_t>(lookupPolicy) <= 1,
              kCall, "the joiner's commit policy {} / lookup policy {} out of range",
              static_cast<int>(joiner.contextCacheCommitPolicy), static_cast<int>(lookupPolicy));
  return admitSequence(tokenIds, joiner.loraWeightsName, headroom, prefillStart, resident, stream,
                       mediaTokenIds);
}

bool BoundedSwaRequest::preemptSequence(ExecutionRow row) {
  mManager->checkPreemptSequence(mHandle, row, "BoundedSwaRequest::preemptSequence");
  return true;
}

bool BoundedSwaRequest::preemptSequence(ExecutionRow row, PreemptionKind kind) {
  MKV_REQUIRE(kind == PreemptionKind::kRecompute, "BoundedSwaRequest::preemptSequence",
              "row {}: swap preemption needs a host tier, which the bounded-SWA backend does not "
              "have",
              row);
  return preemptSequence(row);
}

bool BoundedSwaRequest::preparePrefillChunk(ExecutionRow row, int32_t chunkEnd) {
  return swaStatus(mManager->prepareSequenceChunk(mHandle, row, chunkEnd), *mManager,
                   "preparePrefillChunk");
}

DecodeStepDemand BoundedSwaRequest::prefillChunkDemand(ExecutionRow row, int32_t chunkEnd) const {
  return mManager->sequenceChunkDemand(mHandle, row, chunkEnd);
}

bool BoundedSwaRequest::completePrefillChunk(ExecutionRow row, int32_t prefilledTokens) {
  return swaStatus(mManager->completeSequenceChunk(mHandle, row, prefilledTokens), *mManager,
                   "completePrefillChunk");
}

bool BoundedSwaRequest::finalizeSequenceAdmission(int32_t row, int32_t const& /*lookaheadToken*/,
                                                  int32_t fullInputLength) {
  constexpr char const* kCall = "BoundedSwaRequest::finalizeSequenceAdmission";
  mManager->checkFinalizeSequenceAdmission(mHandle, row, kCall);
  int32_t const prompt = mManager->state(mHandle, row).joinerPromptTokens;
  MKV_REQUIRE(fullInputLength == prompt, kCall,
              "row {}: fullInputLength {} differs from its admitted prompt of {} tokens", row,
              fullInputLength, prompt);
  if (mManager->poisoned()) {
    return swaStatus(SwaKVCacheStatus::kPoisoned, *mManager, "finalizeSequenceAdmission");
  }
  mManager->finalizeSequenceAdmission(mHandle, row);
  return true;
}

bool BoundedSwaRequest::retractSequenceAdmission() noexcept {
  return mManager->retractSequenceAdmission(mHandle);
}

bool BoundedSwaRequest::publishHybridMtpEndpoint(ExecutionRow row, int32_t /*residentStateLength*/,
                                                 Tensor const& /*baseHiddenStates*/,
                                                 int32_t /*boundaryHiddenRow*/) {
  detail::throwContract("BoundedSwaRequest::publishHybridMtpEndpoint",
                        "row {}: the bounded-SWA backend has no context reuse", row);
}

bool BoundedSwaRequest::restoreHybridMtpBoundaryHidden(ExecutionRow row,
                                                       Tensor& /*baseHiddenStates*/,
                                                       int32_t /*destinationRow*/) {
  detail::throwContract("BoundedSwaRequest::restoreHybridMtpBoundaryHidden",
                        "row {}: the bounded-SWA backend has no context reuse", row);
}

}  // namespace mkv
