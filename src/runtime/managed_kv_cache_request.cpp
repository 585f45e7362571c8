#include "mkv/managed_kv_cache_request.h"

#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <string_view>
#include <utility>
#include <variant>

#include "core/check.h"
#include "mkv/bounded_swa_request.h"
#include "mkv/context_cache/context_cache_request.h"
#include "mkv/sliding_reuse_request.h"

namespace mkv {
namespace {

/// Runs a backend call on behalf of the facade call `call`; an mkv::Error it throws is rethrown
/// naming `call` (a contract error: the backend validated before it changed anything; a device
/// write that failed keeps the call's host changes, docs/errors.md "Device writes that fail").
template <typename Function>
decltype(auto) asFacadeCall(char const* call, Function&& function) {
  try {
    return std::forward<Function>(function)();
  } catch (Error const& error) {
    // A backend's contract error names its internal call: the integrator reads the facade call
    // it made, then the value and what was expected. An error naming no call keeps its text.
    detail::throwCallError(call, error.call().empty() ? error.what() : error.detail());
  }
}

/// Runs the lifecycle call `method` on whichever adapter `backend` holds, on behalf of the facade
/// call `call` (contract errors renamed, see asFacadeCall). Both adapters offer every call with
/// one signature.
template <typename Impl, typename Method>
decltype(auto) dispatch(char const* call, std::unique_ptr<Impl> const& impl, Method&& method) {
  MKV_REQUIRE(impl != nullptr, call, "the request was moved from");
  return asFacadeCall(call, [&]() -> decltype(auto) {
    return std::visit(std::forward<Method>(method), impl->backend);
  });
}

/// The facade's form of an adapter's prefill starts: a pointer, nullptr when nothing is reused.
std::vector<int32_t> const* startsOf(std::vector<int32_t> const& starts) noexcept {
  return &starts;
}
std::vector<int32_t> const* startsOf(std::vector<int32_t> const* starts) noexcept { return starts; }

}  // namespace

struct ManagedKVCacheRequest::Impl {
  using Backend = std::variant<ContextCacheRequest, BoundedSwaRequest, SlidingReuseRequest>;
  Backend backend;
};

ManagedKVCacheRequest::ManagedKVCacheRequest(std::unique_ptr<Impl> impl) noexcept
    : mImpl(std::move(impl)) {}
ManagedKVCacheRequest::ManagedKVCacheRequest(ManagedKVCacheRequest&&) noexcept = default;
ManagedKVCacheRequest& ManagedKVCacheRequest::operator=(ManagedKVCacheRequest&&) noexcept = default;
ManagedKVCacheRequest::~ManagedKVCacheRequest() = default;

std::optional<ManagedKVCacheRequest> ManagedKVCacheRequest::begin(
    ContextCacheCoordinator* contextCache, BoundedSwaKVPageManager* swaPageManager,
    LLMGenerationRequest const& request, DecodingInferenceContext const& context,
    bool speculativeRequest, DecodingKvHeadroom const& headroom,
    DecodingTokenStateContract tokenStateContract, ContextCacheCommitPolicy commitPolicy,
    std::vector<int32_t> const& mediaTokenIds) {
  constexpr char const* kCall = "ManagedKVCacheRequest::begin";
  MKV_REQUIRE(contextCache != nullptr || swaPageManager != nullptr, kCall,
              "a backend must be given (context cache and SWA manager are both null)");
  auto const held = [](auto adapter) -> std::optional<ManagedKVCacheRequest> {
    if (!adapter) {
      return std::nullopt;
    }
    return ManagedKVCacheRequest(std::make_unique<Impl>(Impl{std::move(*adapter)}));
  };
  return asFacadeCall(kCall, [&] {
    if (contextCache != nullptr && swaPageManager != nullptr) {
      return held(SlidingReuseRequest::begin(*contextCache, *swaPageManager, request, context,
                                             speculativeRequest, headroom, mediaTokenIds,
                                             tokenStateContract, commitPolicy));
    }
    if (contextCache != nullptr) {
      return held(ContextCacheRequest::begin(*contextCache, request, context, speculativeRequest,
                                             headroom, mediaTokenIds, tokenStateContract,
                                             commitPolicy));
    }
    return held(BoundedSwaRequest::begin(*swaPageManager, request, context, speculativeRequest,
                                         headroom, mediaTokenIds, tokenStateContract,
                                         commitPolicy));
  });
}

bool ManagedKVCacheRequest::hasContextReuse() const noexcept {
  return mImpl != nullptr && !std::holds_alternative<BoundedSwaRequest>(mImpl->backend);
}

std::vector<int32_t> const* ManagedKVCacheRequest::prefillStarts() const noexcept {
  if (mImpl == nullptr) {
    return nullptr;
  }
  return std::visit([](auto const& backend) { return startsOf(backend.prefillStarts()); },
                    mImpl->backend);
}

int32_t ManagedKVCacheRequest::reuseTokenLength(ExecutionRow row) const {
  return dispatch("ManagedKVCacheRequest::reuseTokenLength", mImpl,
                  [&](auto const& backend) { return backend.reuseTokenLength(row); });
}

std::span<ReusePointCapture const> ManagedKVCacheRequest::reusePointCaptures(
    ExecutionRow row) const {
  return dispatch("ManagedKVCacheRequest::reusePointCaptures", mImpl,
                  [&](auto const& backend) { return backend.reusePointCaptures(row); });
}

bool ManagedKVCacheRequest::publishHybridMtpEndpoint(ExecutionRow row, int32_t residentStateLength,
                                                     Tensor const& baseHiddenStates,
                                                     int32_t boundaryHiddenRow) {
  return dispatch("ManagedKVCacheRequest::publishHybridMtpEndpoint", mImpl, [&](auto& backend) {
    return backend.publishHybridMtpEndpoint(row, residentStateLength, baseHiddenStates,
                                            boundaryHiddenRow);
  });
}

bool ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden(ExecutionRow row,
                                                           Tensor& baseHiddenStates,
                                                           int32_t destinationRow) {
  return dispatch(
      "ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden", mImpl, [&](auto& backend) {
        return backend.restoreHybridMtpBoundaryHidden(row, baseHiddenStates, destinationRow);
      });
}

bool ManagedKVCacheRequest::preparePrefill() {
  return dispatch("ManagedKVCacheRequest::preparePrefill", mImpl,
                  [](auto& backend) { return backend.preparePrefill(); });
}

bool ManagedKVCacheRequest::prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths) {
  return dispatch("ManagedKVCacheRequest::prepareSwaPrefill", mImpl,
                  [&](auto& backend) { return backend.prepareSwaPrefill(effectiveInputLengths); });
}

bool ManagedKVCacheRequest::enqueuePrefillCaptures() {
  return dispatch("ManagedKVCacheRequest::enqueuePrefillCaptures", mImpl,
                  [](auto& backend) { return backend.enqueuePrefillCaptures(); });
}

bool ManagedKVCacheRequest::completePrefill(DecodingInferenceContext const& context,
                                            std::vector<int32_t> const& commonStateLengths) {
  return dispatch("ManagedKVCacheRequest::completePrefill", mImpl, [&](auto& backend) {
    return backend.completePrefill(context, commonStateLengths);
  });
}

bool ManagedKVCacheRequest::prepareDecodeStep(DecodingInferenceContext const& context,
                                              DecodingKvHeadroom const& headroom) {
  return dispatch("ManagedKVCacheRequest::prepareDecodeStep", mImpl,
                  [&](auto& backend) { return backend.prepareDecodeStep(context, headroom); });
}

DecodeStepDemand ManagedKVCacheRequest::decodeStepDemand(DecodingKvHeadroom const& headroom) const {
  return dispatch("ManagedKVCacheRequest::decodeStepDemand", mImpl,
                  [&](auto const& backend) { return backend.decodeStepDemand(headroom); });
}

bool ManagedKVCacheRequest::completeDecodeStep(DecodingInferenceContext const& context,
                                               std::vector<int32_t> const& commonStateLengths) {
  return dispatch("ManagedKVCacheRequest::completeDecodeStep", mImpl, [&](auto& backend) {
    return backend.completeDecodeStep(context, commonStateLengths);
  });
}

bool ManagedKVCacheRequest::beginBatchCompaction(std::vector<int32_t> const& oldToNew,
                                                 int32_t newBatchSize, Tensor& deviceBatchMapping) {
  return dispatch("ManagedKVCacheRequest::beginBatchCompaction", mImpl, [&](auto& backend) {
    return backend.beginBatchCompaction(oldToNew, newBatchSize, deviceBatchMapping);
  });
}

bool ManagedKVCacheRequest::completeBatchCompaction(std::vector<int32_t> const& keepMapping) {
  return dispatch("ManagedKVCacheRequest::completeBatchCompaction", mImpl,
                  [&](auto& backend) { return backend.completeBatchCompaction(keepMapping); });
}

bool ManagedKVCacheRequest::finish() {
  return dispatch("ManagedKVCacheRequest::finish", mImpl,
                  [](auto& backend) { return backend.finish(); });
}

AdmitSequenceStatus ManagedKVCacheRequest::admitSequence(
    std::vector<int32_t> const& tokenIds, std::string const& loraWeightsName,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds,
    std::vector<imageUtils::ImageData> const& imageBuffers,
    std::vector<audioUtils::AudioData> const& audioBuffers) {
  return dispatch("ManagedKVCacheRequest::admitSequence", mImpl, [&](auto& backend) {
    return backend.admitSequence(tokenIds, loraWeightsName, headroom, prefillStart, resident,
                                 stream, mediaTokenIds, imageBuffers, audioBuffers);
  });
}

AdmitSequenceStatus ManagedKVCacheRequest::admitSequence(
    LLMGenerationRequest const& joiner, std::vector<int32_t> const& tokenIds,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds) {
  return dispatch("ManagedKVCacheRequest::admitSequence", mImpl, [&](auto& backend) {
    return backend.admitSequence(joiner, tokenIds, headroom, prefillStart, resident, stream,
                                 mediaTokenIds);
  });
}

bool ManagedKVCacheRequest::preemptSequence(ExecutionRow row) {
  return dispatch("ManagedKVCacheRequest::preemptSequence", mImpl,
                  [&](auto& backend) { return backend.preemptSequence(row); });
}

bool ManagedKVCacheRequest::preemptSequence(ExecutionRow row, PreemptionKind kind) {
  return dispatch("ManagedKVCacheRequest::preemptSequence", mImpl,
                  [&](auto& backend) { return backend.preemptSequence(row, kind); });
}

bool ManagedKVCacheRequest::preparePrefillChunk(ExecutionRow row, int32_t chunkEnd) {
  return dispatch("ManagedKVCacheRequest::preparePrefillChunk", mImpl,
                  [&](auto& backend) { return backend.preparePrefillChunk(row, chunkEnd); });
}

DecodeStepDemand ManagedKVCacheRequest::prefillChunkDemand(ExecutionRow row,
                                                           int32_t chunkEnd) const {
  return dispatch("ManagedKVCacheRequest::prefillChunkDemand", mImpl,
                  [&](auto const& backend) { return backend.prefillChunkDemand(row, chunkEnd); });
}

bool ManagedKVCacheRequest::completePrefillChunk(ExecutionRow row, int32_t prefilledTokens) {
  return dispatch("ManagedKVCacheRequest::completePrefillChunk", mImpl, [&](auto& backend) {
    return backend.completePrefillChunk(row, prefilledTokens);
  });
}

bool ManagedKVCacheRequest::finalizeSequenceAdmission(ExecutionRow row,
                                                      int32_t const& lookaheadToken,
                                                      int32_t fullInputLength) {
  return dispatch("ManagedKVCacheRequest::finalizeSequenceAdmission", mImpl, [&](auto& backend) {
    return backend.finalizeSequenceAdmission(row, lookaheadToken, fullInputLength);
  });
}

// The facade's retraction is noexcept by the seed's contract, so every adapter's must be too:
// a throwing one would terminate the engine while it unwinds a failed join.
static_assert(noexcept(std::declval<ContextCacheRequest&>().retractSequenceAdmission()) && noexcept(
    std::declval<BoundedSwaRequest&>()
        .retractSequenceAdmission()) && noexcept(std::declval<SlidingReuseRequest&>()
                                                     .retractSequenceAdmission()));

RowFailure ManagedKVCacheRequest::lastFailure() const noexcept {
  if (mImpl == nullptr) {
    return {};
  }
  return std::visit([](auto const& backend) noexcept { return backend.lastFailure(); },
                    mImpl->backend);
}

bool ManagedKVCacheRequest::retractSequenceAdmission() noexcept {
  if (mImpl == nullptr) {
    return false;
  }
  // Every adapter's retraction is noexcept, so no facade-call wrapper is needed (or allowed).
  return std::visit([](auto& backend) noexcept { return backend.retractSequenceAdmission(); },
                    mImpl->backend);
}

}  // namespace mkv
