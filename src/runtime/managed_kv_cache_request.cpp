#include "mkv/managed_kv_cache_request.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <string_view>
#include <utility>

#include "core/check.h"
#include "mkv/logging.h"

namespace mkv {
namespace {

constexpr DecodingKvHeadroom kVanillaHeadroom{1, 0};

/// The message of a backend's contract error as the facade call `call` reports it: the leading
/// "Backend::method: " (the internal call) is replaced by `call`, so the integrator reads the
/// call it made, then the value and what was expected. Other messages (internal invariants)
/// keep their text behind `call`.
std::string renamed(char const* call, std::string_view message) {
  std::size_t const colon = message.find(": ");
  std::string_view const head = message.substr(0, colon);
  bool const isCall =
      colon != std::string_view::npos && !head.empty() &&
      std::all_of(head.begin(), head.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == ':';
      });
  return fmt::format("{}: {}", call, isCall ? message.substr(colon + 2) : message);
}

/// Runs a backend call on behalf of the facade call `call`; an mkv::Error it throws is rethrown
/// naming `call` (the backend validated before it changed anything, so nothing changed).
template <typename Function>
decltype(auto) asFacadeCall(char const* call, Function&& function) {
  try {
    return std::forward<Function>(function)();
  } catch (Error const& error) {
    detail::throwError(renamed(call, error.what()));
  }
}

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
    auto backend = asFacadeCall(kCall, [&] {
      return ContextCacheRequest::begin(*contextCache, request, context, speculativeRequest,
                                        headroom, mediaTokenIds, tokenStateContract, commitPolicy);
    });
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
  MKV_REQUIRE(
      context.activeBatchSize > 0 &&
          context.rawBatchedInputIds.size() == static_cast<std::size_t>(context.activeBatchSize) &&
          context.residentRefs.size() == context.rawBatchedInputIds.size(),
      kCall, "activeBatchSize {} with {} prompts and {} residents", context.activeBatchSize,
      context.rawBatchedInputIds.size(), context.residentRefs.size());
  auto begun = asFacadeCall(
      kCall, [&] { return swaPageManager->beginRequest(context.residentRefs, context.stream); });
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
  constexpr char const* kCall = "ManagedKVCacheRequest::reuseTokenLength";
  ContextCacheRequest const* backend = context();
  MKV_REQUIRE(backend != nullptr, kCall, "slot {}: the bounded-SWA backend has no context reuse",
              slot);
  return asFacadeCall(kCall, [&] { return backend->reuseTokenLength(slot); });
}

bool ManagedKVCacheRequest::publishHybridMtpEndpoint(int32_t slot, int32_t residentStateLength,
                                                     Tensor const& baseHiddenStates,
                                                     int32_t boundaryHiddenRow) {
  constexpr char const* kCall = "ManagedKVCacheRequest::publishHybridMtpEndpoint";
  ContextCacheRequest* backend = context();
  MKV_REQUIRE(backend != nullptr, kCall, "slot {}: the bounded-SWA backend has no context reuse",
              slot);
  return asFacadeCall(kCall, [&] {
    return backend->publishHybridMtpEndpoint(slot, residentStateLength, baseHiddenStates,
                                             boundaryHiddenRow);
  });
}

bool ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden(int32_t slot, Tensor& baseHiddenStates,
                                                           int32_t destinationRow) {
  constexpr char const* kCall = "ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden";
  ContextCacheRequest* backend = context();
  MKV_REQUIRE(backend != nullptr, kCall, "slot {}: the bounded-SWA backend has no context reuse",
              slot);
  return asFacadeCall(kCall, [&] {
    return backend->restoreHybridMtpBoundaryHidden(slot, baseHiddenStates, destinationRow);
  });
}

bool ManagedKVCacheRequest::preparePrefill() {
  ContextCacheRequest* backend = context();
  return backend == nullptr || asFacadeCall("ManagedKVCacheRequest::preparePrefill",
                                            [&] { return backend->preparePrefill(); });
}

bool ManagedKVCacheRequest::prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths) {
  if (context() != nullptr) {
    return true;
  }
  SwaBackend& backend = swa("prepareSwaPrefill");
  asFacadeCall("ManagedKVCacheRequest::prepareSwaPrefill",
               [&] { backend.manager->preparePrefill(backend.handle, effectiveInputLengths); });
  return true;
}

bool ManagedKVCacheRequest::enqueuePrefillCaptures() {
  ContextCacheRequest* backend = context();
  return backend == nullptr || asFacadeCall("ManagedKVCacheRequest::enqueuePrefillCaptures",
                                            [&] { return backend->enqueuePrefillCaptures(); });
}

bool ManagedKVCacheRequest::completePrefill(DecodingInferenceContext const& context_,
                                            std::vector<int32_t> const& commonStateLengths) {
  constexpr char const* kCall = "ManagedKVCacheRequest::completePrefill";
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall(kCall,
                        [&] { return backend->completePrefill(context_, commonStateLengths); });
  }
  SwaBackend& backend = swa("completePrefill");
  requireContextRows(kCall, context_, *backend.manager, backend.handle);
  asFacadeCall(kCall, [&] { backend.manager->completePrefill(backend.handle); });
  return true;
}

bool ManagedKVCacheRequest::prepareDecodeStep(DecodingInferenceContext const& context_,
                                              DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "ManagedKVCacheRequest::prepareDecodeStep";
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall(kCall, [&] { return backend->prepareDecodeStep(context_, headroom); });
  }
  MKV_REQUIRE(headroom == kVanillaHeadroom, kCall,
              "the bounded-SWA backend needs headroom {{1, 0}}, got {{{}, {}}}",
              headroom.baseExtraTokens, headroom.draftExtraTokens);
  SwaBackend& backend = swa("prepareDecodeStep");
  requireContextRows(kCall, context_, *backend.manager, backend.handle);
  SwaKVCacheStatus const status =
      asFacadeCall(kCall, [&] { return backend.manager->prepareDecodeStep(backend.handle); });
  return swaStatus(status, *backend.manager, "prepareDecodeStep");
}

bool ManagedKVCacheRequest::completeDecodeStep(DecodingInferenceContext const& context_,
                                               std::vector<int32_t> const& commonStateLengths) {
  constexpr char const* kCall = "ManagedKVCacheRequest::completeDecodeStep";
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall(kCall,
                        [&] { return backend->completeDecodeStep(context_, commonStateLengths); });
  }
  SwaBackend& backend = swa("completeDecodeStep");
  requireContextRows(kCall, context_, *backend.manager, backend.handle);
  asFacadeCall(kCall, [&] { backend.manager->completeDecodeStep(backend.handle); });
  return true;
}

bool ManagedKVCacheRequest::beginBatchCompaction(std::vector<int32_t> const& oldToNew,
                                                 int32_t newBatchSize, Tensor& deviceBatchMapping) {
  constexpr char const* kCall = "ManagedKVCacheRequest::beginBatchCompaction";
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall(kCall, [&] {
      return backend->beginBatchCompaction(oldToNew, newBatchSize, deviceBatchMapping);
    });
  }
  SwaBackend& backend = swa("beginBatchCompaction");
  std::vector<int32_t> pending = oldToNew;  // copied first: nothing fails after the manager's call
  asFacadeCall(kCall, [&] {
    backend.manager->beginBatchCompaction(backend.handle, oldToNew, newBatchSize,
                                          deviceBatchMapping);
  });
  backend.pendingMapping = std::move(pending);
  return true;
}

bool ManagedKVCacheRequest::completeBatchCompaction(std::vector<int32_t> const& keepMapping) {
  constexpr char const* kCall = "ManagedKVCacheRequest::completeBatchCompaction";
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall(kCall, [&] { return backend->completeBatchCompaction(keepMapping); });
  }
  SwaBackend& backend = swa("completeBatchCompaction");
  MKV_REQUIRE(!backend.pendingMapping.empty(), kCall,
              "no batch compaction was begun (keepMapping [{}]; call beginBatchCompaction first)",
              fmt::join(keepMapping, ", "));
  MKV_REQUIRE(keepMapping == backend.pendingMapping, kCall,
              "keepMapping [{}] differs from the mapping [{}] given to beginBatchCompaction",
              fmt::join(keepMapping, ", "), fmt::join(backend.pendingMapping, ", "));
  SwaKVCacheStatus const status =
      asFacadeCall(kCall, [&] { return backend.manager->compactBatch(backend.handle); });
  backend.pendingMapping.clear();
  return swaStatus(status, *backend.manager, "completeBatchCompaction");
}

bool ManagedKVCacheRequest::finish() {
  constexpr char const* kCall = "ManagedKVCacheRequest::finish";
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall(kCall, [&] { return backend->finish(); });
  }
  SwaBackend& backend = swa("finish");
  SwaKVCacheStatus const status =
      asFacadeCall(kCall, [&] { return backend.manager->finish(backend.handle); });
  return swaStatus(status, *backend.manager, "finish");
}

ContextCacheRequest::AdmitSequenceStatus ManagedKVCacheRequest::admitSequence(
    std::vector<int32_t> const& tokenIds, std::string const& loraWeightsName,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds,
    std::vector<imageUtils::ImageData> const& imageBuffers,
    std::vector<audioUtils::AudioData> const& audioBuffers) {
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall("ManagedKVCacheRequest::admitSequence", [&] {
      return backend->admitSequence(tokenIds, loraWeightsName, headroom, prefillStart, resident,
                                    stream, mediaTokenIds, imageBuffers, audioBuffers);
    });
  }
  logger()->error(
      "ManagedKVCacheRequest::admitSequence: the bounded-SWA backend has no in-flight admission");
  return ContextCacheRequest::AdmitSequenceStatus::kFailed;
}

bool ManagedKVCacheRequest::finalizeSequenceAdmission(int32_t slot, int32_t const& lookaheadToken,
                                                      int32_t fullInputLength) {
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall("ManagedKVCacheRequest::finalizeSequenceAdmission", [&] {
      return backend->finalizeSequenceAdmission(slot, lookaheadToken, fullInputLength);
    });
  }
  logger()->error(
      "ManagedKVCacheRequest::finalizeSequenceAdmission: the bounded-SWA backend has no "
      "in-flight admission");
  return false;
}

bool ManagedKVCacheRequest::retractSequenceAdmission() {
  if (ContextCacheRequest* backend = context()) {
    return asFacadeCall("ManagedKVCacheRequest::retractSequenceAdmission",
                        [&] { return backend->retractSequenceAdmission(); });
  }
  return true;  // nothing was admitted, so nothing to undo
}

}  // namespace mkv
