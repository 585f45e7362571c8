#include "mkv/managed_kv_cache_request.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "core/check.h"
#include "mkv/logging.h"

namespace mkv {
namespace {

constexpr DecodingKvHeadroom kVanillaHeadroom{1, 0};

bool swaStatus(SwaKVCacheStatus status, BoundedSwaKVPageManager const& manager,
               char const* operation) {
  if (status == SwaKVCacheStatus::kOk) {
    return true;
  }
  logger()->error("ManagedKVCacheRequest::{} failed on the bounded-SWA backend: {}{}", operation,
                  toString(status), manager.poisoned() ? " (backend poisoned)" : " (request failed)");
  return false;
}

/// The bounded-SWA manager reads no context, but a context whose rows disagree with the batch is
/// the engine bug the context-reuse backend rejects; reject it on both backends alike.
void requireContextRows(char const* call, DecodingInferenceContext const& context,
                        BoundedSwaKVPageManager const& manager,
                        BoundedSwaKVPageManager::RequestHandle const& handle) {
  if (!handle.valid()) {
    return;  // the manager reports the invalid handle itself
  }
  auto const batch = static_cast<std::size_t>(manager.batchSize(handle));
  MKV_REQUIRE(
      context.rawBatchedInputIds.size() == batch && context.generatedTokenIds.size() == batch, call,
      "context has {} prompts / {} generated lists for a batch of {}",
      context.rawBatchedInputIds.size(), context.generatedTokenIds.size(), batch);
}

}  // namespace

ManagedKVCacheRequest::ManagedKVCacheRequest(ContextCacheRequest backend)
    : mBackend(std::in_place_type<ContextCacheRequest>, std::move(backend)) {}

ManagedKVCacheRequest::ManagedKVCacheRequest(SwaBackend backend)
    : mBackend(std::in_place_type<SwaBackend>, std::move(backend)) {}

std::optional<ManagedKVCacheRequest> ManagedKVCacheRequest::begin(
    ContextCacheCoordinator* contextCache, BoundedSwaKVPageManager* swaPageManager,
    LLMGenerationRequest const& request, DecodingInferenceContext const& context,
    bool speculativeRequest, DecodingKvHeadroom const& headroom,
    DecodingTokenStateContract tokenStateContract, ContextCacheCommitPolicy commitPolicy,
    std::vector<int32_t> const& mediaTokenIds) {
  constexpr char const* kCall = "ManagedKVCacheRequest::begin";
  MKV_REQUIRE((contextCache == nullptr) != (swaPageManager == nullptr), kCall,
              "exactly one backend must be given (context cache {}, SWA manager {})",
              contextCache != nullptr ? "set" : "null", swaPageManager != nullptr ? "set" : "null");
  if (contextCache != nullptr) {
    auto backend = ContextCacheRequest::begin(*contextCache, request, context, speculativeRequest,
                                              headroom, mediaTokenIds, tokenStateContract,
                                              commitPolicy);
    if (!backend) {
      return std::nullopt;
    }
    return ManagedKVCacheRequest(std::move(*backend));
  }
  MKV_REQUIRE(!speculativeRequest, kCall, "the bounded-SWA backend does not decode speculatively");
  MKV_REQUIRE(headroom == kVanillaHeadroom, kCall,
              "the bounded-SWA backend needs headroom {{1, 0}}, got {{{}, {}}}",
              headroom.baseExtraTokens, headroom.draftExtraTokens);
  MKV_REQUIRE(tokenStateContract == DecodingTokenStateContract::kCommittedPlusLookahead, kCall,
              "the bounded-SWA backend needs the committed-plus-lookahead contract");
  MKV_REQUIRE(context.activeBatchSize > 0 &&
                  context.rawBatchedInputIds.size() ==
                      static_cast<std::size_t>(context.activeBatchSize) &&
                  context.residentRefs.size() == context.rawBatchedInputIds.size(),
              kCall, "activeBatchSize {} with {} prompts and {} residents", context.activeBatchSize,
              context.rawBatchedInputIds.size(), context.residentRefs.size());
  auto begun = swaPageManager->beginRequest(context.residentRefs, context.stream);
  if (!swaStatus(begun.status, *swaPageManager, "begin")) {
    return std::nullopt;
  }
  return ManagedKVCacheRequest(SwaBackend{swaPageManager, std::move(*begun.request), {}});
}

ContextCacheRequest* ManagedKVCacheRequest::context() noexcept {
  return std::get_if<ContextCacheRequest>(&mBackend);
}

ContextCacheRequest const* ManagedKVCacheRequest::context() const noexcept {
  return std::get_if<ContextCacheRequest>(&mBackend);
}

ManagedKVCacheRequest::SwaBackend& ManagedKVCacheRequest::swa(char const* call) {
  SwaBackend* backend = std::get_if<SwaBackend>(&mBackend);
  MKV_ASSERT(backend != nullptr, "{}: neither backend is held", call);
  return *backend;
}

bool ManagedKVCacheRequest::hasContextReuse() const noexcept { return context() != nullptr; }

std::vector<int32_t> const* ManagedKVCacheRequest::prefillStarts() const noexcept {
  ContextCacheRequest const* backend = context();
  return backend != nullptr ? &backend->prefillStarts() : nullptr;
}

int32_t ManagedKVCacheRequest::reuseTokenLength(int32_t slot) const {
  ContextCacheRequest const* backend = context();
  MKV_REQUIRE(backend != nullptr, "ManagedKVCacheRequest::reuseTokenLength",
              "slot {}: the bounded-SWA backend has no context reuse", slot);
  return backend->reuseTokenLength(slot);
}

bool ManagedKVCacheRequest::publishHybridMtpEndpoint(int32_t slot, int32_t residentStateLength,
                                                     Tensor const& baseHiddenStates,
                                                     int32_t boundaryHiddenRow) {
  ContextCacheRequest* backend = context();
  MKV_REQUIRE(backend != nullptr, "ManagedKVCacheRequest::publishHybridMtpEndpoint",
              "slot {}: the bounded-SWA backend has no context reuse", slot);
  return backend->publishHybridMtpEndpoint(slot, residentStateLength, baseHiddenStates,
                                           boundaryHiddenRow);
}

bool ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden(int32_t slot, Tensor& baseHiddenStates,
                                                           int32_t destinationRow) {
  ContextCacheRequest* backend = context();
  MKV_REQUIRE(backend != nullptr, "ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden",
              "slot {}: the bounded-SWA backend has no context reuse", slot);
  return backend->restoreHybridMtpBoundaryHidden(slot, baseHiddenStates, destinationRow);
}

bool ManagedKVCacheRequest::preparePrefill() {
  ContextCacheRequest* backend = context();
  return backend == nullptr || backend->preparePrefill();
}

bool ManagedKVCacheRequest::prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths) {
  if (context() != nullptr) {
    return true;
  }
  SwaBackend& backend = swa("prepareSwaPrefill");
  backend.manager->preparePrefill(backend.handle, effectiveInputLengths);
  return true;
}

bool ManagedKVCacheRequest::enqueuePrefillCaptures() {
  ContextCacheRequest* backend = context();
  return backend == nullptr || backend->enqueuePrefillCaptures();
}

bool ManagedKVCacheRequest::completePrefill(DecodingInferenceContext const& context_,
                                            std::vector<int32_t> const& commonStateLengths) {
  if (ContextCacheRequest* backend = context()) {
    return backend->completePrefill(context_, commonStateLengths);
  }
  SwaBackend& backend = swa("completePrefill");
  requireContextRows("ManagedKVCacheRequest::completePrefill", context_, *backend.manager,
                     backend.handle);
  backend.manager->completePrefill(backend.handle);
  return true;
}

bool ManagedKVCacheRequest::prepareDecodeStep(DecodingInferenceContext const& context_,
                                              DecodingKvHeadroom const& headroom) {
  if (ContextCacheRequest* backend = context()) {
    return backend->prepareDecodeStep(context_, headroom);
  }
  MKV_REQUIRE(headroom == kVanillaHeadroom, "ManagedKVCacheRequest::prepareDecodeStep",
              "the bounded-SWA backend needs headroom {{1, 0}}, got {{{}, {}}}",
              headroom.baseExtraTokens, headroom.draftExtraTokens);
  SwaBackend& backend = swa("prepareDecodeStep");
  requireContextRows("ManagedKVCacheRequest::prepareDecodeStep", context_, *backend.manager,
                     backend.handle);
  return swaStatus(backend.manager->prepareDecodeStep(backend.handle), *backend.manager,
                   "prepareDecodeStep");
}

bool ManagedKVCacheRequest::completeDecodeStep(DecodingInferenceContext const& context_,
                                               std::vector<int32_t> const& commonStateLengths) {
  if (ContextCacheRequest* backend = context()) {
    return backend->completeDecodeStep(context_, commonStateLengths);
  }
  SwaBackend& backend = swa("completeDecodeStep");
  requireContextRows("ManagedKVCacheRequest::completeDecodeStep", context_, *backend.manager,
                     backend.handle);
  backend.manager->completeDecodeStep(backend.handle);
  return true;
}

bool ManagedKVCacheRequest::beginBatchCompaction(std::vector<int32_t> const& oldToNew,
                                                 int32_t newBatchSize, Tensor& deviceBatchMapping) {
  if (ContextCacheRequest* backend = context()) {
    return backend->beginBatchCompaction(oldToNew, newBatchSize, deviceBatchMapping);
  }
  SwaBackend& backend = swa("beginBatchCompaction");
  std::vector<int32_t> pending = oldToNew;  // copied first: nothing fails after the manager's call
  backend.manager->beginBatchCompaction(backend.handle, oldToNew, newBatchSize, deviceBatchMapping);
  backend.pendingMapping = std::move(pending);
  return true;
}

bool ManagedKVCacheRequest::completeBatchCompaction(std::vector<int32_t> const& keepMapping) {
  if (ContextCacheRequest* backend = context()) {
    return backend->completeBatchCompaction(keepMapping);
  }
  SwaBackend& backend = swa("completeBatchCompaction");
  // An empty pending mapping: no compaction was begun, which the manager reports.
  MKV_REQUIRE(backend.pendingMapping.empty() || keepMapping == backend.pendingMapping,
              "ManagedKVCacheRequest::completeBatchCompaction",
              "keepMapping ({} entries) differs from the mapping given to beginBatchCompaction "
              "({} entries)",
              keepMapping.size(), backend.pendingMapping.size());
  SwaKVCacheStatus const status = backend.manager->compactBatch(backend.handle);
  backend.pendingMapping.clear();
  return swaStatus(status, *backend.manager, "completeBatchCompaction");
}

bool ManagedKVCacheRequest::finish() {
  if (ContextCacheRequest* backend = context()) {
    return backend->finish();
  }
  SwaBackend& backend = swa("finish");
  return swaStatus(backend.manager->finish(backend.handle), *backend.manager, "finish");
}

ContextCacheRequest::AdmitSequenceStatus ManagedKVCacheRequest::admitSequence(
    std::vector<int32_t> const& tokenIds, std::string const& loraWeightsName,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds,
    std::vector<imageUtils::ImageData> const& imageBuffers,
    std::vector<audioUtils::AudioData> const& audioBuffers) {
  if (ContextCacheRequest* backend = context()) {
    return backend->admitSequence(tokenIds, loraWeightsName, headroom, prefillStart, resident,
                                  stream, mediaTokenIds, imageBuffers, audioBuffers);
  }
  logger()->error(
      "ManagedKVCacheRequest::admitSequence: the bounded-SWA backend has no in-flight admission");
  return ContextCacheRequest::AdmitSequenceStatus::kFailed;
}

bool ManagedKVCacheRequest::finalizeSequenceAdmission(int32_t slot, int32_t const& lookaheadToken,
                                                      int32_t fullInputLength) {
  if (ContextCacheRequest* backend = context()) {
    return backend->finalizeSequenceAdmission(slot, lookaheadToken, fullInputLength);
  }
  logger()->error(
      "ManagedKVCacheRequest::finalizeSequenceAdmission: the bounded-SWA backend has no "
      "in-flight admission");
  return false;
}

bool ManagedKVCacheRequest::retractSequenceAdmission() noexcept {
  if (ContextCacheRequest* backend = context()) {
    return backend->retractSequenceAdmission();
  }
  return true;  // nothing was admitted, so nothing to undo
}

}  // namespace mkv
