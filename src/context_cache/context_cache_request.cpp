#include "mkv/context_cache/context_cache_request.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <limits>
#include <utility>

#include "context_cache/block_hash.h"
#include "context_cache/eviction_policy.h"
#include "core/check.h"
#include "mkv/logging.h"
#include "resources/backend_requests.h"

namespace mkv {

std::vector<MediaPosition> buildMediaPositions(std::vector<int32_t> const& tokens,
                                               std::vector<int32_t> const& mediaTokenIds,
                                               std::vector<imageUtils::ImageData> const& images,
                                               std::vector<audioUtils::AudioData> const& audios) {
  constexpr char const* kCall = "buildMediaPositions";
  std::vector<MediaPosition> positions;
  if (mediaTokenIds.empty()) {
    return positions;
  }
  int32_t const imageToken = mediaTokenIds[0];
  bool const hasAudio = mediaTokenIds.size() > 1;
  int32_t const audioToken = hasAudio ? mediaTokenIds[1] : 0;
  std::size_t nextImage = 0;
  std::size_t nextAudio = 0;
  bool any = false;
  int32_t runToken = std::numeric_limits<int32_t>::min();
  Hash128 runDigest;
  int32_t runOffset = 0;
  positions.resize(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    int32_t const token = tokens[i];
    bool const isImage = token == imageToken;
    bool const isAudio = hasAudio && token == audioToken && !isImage;
    if (!isImage && !isAudio) {
      runToken = std::numeric_limits<int32_t>::min();
      continue;
    }
    if (token != runToken) {  // a new run starts
      runToken = token;
      runOffset = 0;
      if (isImage) {
        MKV_REQUIRE(nextImage < images.size(), kCall,
                    "image run {} at position {} has no image (only {} given)", nextImage + 1, i,
                    images.size());
        std::optional<Hash128> const digest = digestImage(images[nextImage++]);
        MKV_REQUIRE(digest.has_value(), kCall, "image {} is not host-readable packed RGB",
                    nextImage - 1);
        runDigest = *digest;
      } else {
        MKV_REQUIRE(nextAudio < audios.size(), kCall,
                    "audio run {} at position {} has no clip (only {} given)", nextAudio + 1, i,
                    audios.size());
        runDigest = digestAudio(audios[nextAudio++]);
      }
    }
    positions[i] = MediaPosition{runDigest, runOffset++};
    any = true;
  }
  if (!any) {
    positions.clear();
  }
  return positions;
}

namespace {

bool imagesHostReadable(std::vector<imageUtils::ImageData> const& images) {
  for (auto const& image : images) {
    if (image.data() == nullptr) {
      return false;
    }
  }
  return true;
}

template <typename Vector>
Vector compacted(Vector const& values, std::vector<int32_t> const& mapping, int32_t newSize) {
  Vector result(static_cast<std::size_t>(newSize));
  for (std::size_t i = 0; i < mapping.size() && i < values.size(); ++i) {
    if (mapping[i] >= 0) {
      result[static_cast<std::size_t>(mapping[i])] = values[i];
    }
  }
  return result;
}

/// ContextCacheRequest::begin's checks of the engine's batch: as many prompts as
/// activeBatchSize (positive), one resident per prompt, per-sequence inputs absent or one per
/// prompt, and a request LoRA that is none or the context's. Throws naming begin.
void validateBeginInputs(LLMGenerationRequest const& request,
                         DecodingInferenceContext const& context) {
  constexpr char const* kCall = "ContextCacheRequest::begin";
  auto const batch = context.rawBatchedInputIds.size();
  MKV_REQUIRE(
      context.activeBatchSize > 0 && batch == static_cast<std::size_t>(context.activeBatchSize),
      kCall, "activeBatchSize {} but {} prompts", context.activeBatchSize, batch);
  MKV_REQUIRE(context.residentRefs.size() == batch, kCall, "{} residents for {} prompts",
              context.residentRefs.size(), batch);
  MKV_REQUIRE(request.requests.empty() || request.requests.size() == batch, kCall,
              "{} per-sequence inputs for {} prompts", request.requests.size(), batch);
  MKV_REQUIRE(request.loraWeightsName.empty() || request.loraWeightsName == context.loraWeightsName,
              kCall, "request LoRA '{}' differs from the context's '{}'", request.loraWeightsName,
              context.loraWeightsName);
}

/// The batch's lookup policy: the request's, or kBypass when the model takes media and some
/// sequence's images are not host-readable (their digests cannot be computed: bypass, not fail).
ContextCacheLookupPolicy batchLookupPolicy(LLMGenerationRequest const& request,
                                           std::vector<int32_t> const& mediaTokenIds) {
  ContextCacheLookupPolicy batchPolicy = request.contextCacheLookupPolicy;
  if (!mediaTokenIds.empty()) {
    for (auto const& sequence : request.requests) {
      if (!imagesHostReadable(sequence.imageBuffers)) {
        batchPolicy = ContextCacheLookupPolicy::kBypass;  // bypass, do not fail
      }
    }
  }
  return batchPolicy;
}

/// One admission sequence per prompt, in batch order: tokens, key extras (LoRA, salt), resident,
/// retention, the per-sequence policy override (forced to kBypass when the batch policy is), and
/// the media positions of sequences that use the cache. Throws what buildMediaPositions throws.
std::vector<ContextCacheSequenceAdmission> admissionSequences(
    LLMGenerationRequest const& request, DecodingInferenceContext const& context,
    std::vector<int32_t> const& mediaTokenIds, ContextCacheLookupPolicy batchPolicy) {
  bool const forcedBypass = batchPolicy == ContextCacheLookupPolicy::kBypass;
  BlockKeyExtras const extras{digestIdentity(context.loraWeightsName),
                              digestIdentity(request.cacheSalt)};
  auto const batch = context.rawBatchedInputIds.size();
  std::vector<ContextCacheSequenceAdmission> sequences(batch);
  for (std::size_t i = 0; i < batch; ++i) {
    auto& sequence = sequences[i];
    sequence.tokenIds = context.rawBatchedInputIds[i];
    sequence.keyExtras = extras;
    sequence.resident = context.residentRefs[i];
    sequence.retention = request.contextCacheRetention;
    std::optional<ContextCacheLookupPolicy> override;
    if (!request.requests.empty()) {
      override = request.requests[i].contextCacheLookupPolicy;
    }
    if (forcedBypass) {
      override = ContextCacheLookupPolicy::kBypass;
    }
    sequence.lookupPolicy = override;
    ContextCacheLookupPolicy const effective = override.value_or(batchPolicy);
    if (effective == ContextCacheLookupPolicy::kUseCache && !request.requests.empty()) {
      sequence.media =
          buildMediaPositions(sequence.tokenIds, mediaTokenIds, request.requests[i].imageBuffers,
                              request.requests[i].audioBuffers);
    }
  }
  return sequences;
}

}  // namespace

ContextCacheRequest::ContextCacheRequest(ContextCacheCoordinator& coordinator,
                                         ContextCacheCoordinator::RequestHandle handle,
                                         std::vector<int32_t> prefillStarts,
                                         DecodingTokenStateContract contract,
                                         LLMGenerationRequest founderIdentity, cudaStream_t stream)
    : mCoordinator(&coordinator),
      mHandle(std::move(handle)),
      mPrefillStarts(std::move(prefillStarts)),
      mContract(contract),
      mFounderIdentity(std::move(founderIdentity)),
      mStream(stream),
      mUnfinalized(mPrefillStarts.size(), 0) {}

std::optional<ContextCacheRequest> ContextCacheRequest::begin(
    ContextCacheCoordinator& coordinator, LLMGenerationRequest const& request,
    DecodingInferenceContext const& context, bool speculativeRequest,
    DecodingKvHeadroom const& headroom, std::vector<int32_t> const& mediaTokenIds,
    DecodingTokenStateContract tokenStateContract, ContextCacheCommitPolicy commitPolicy) {
  validateBeginInputs(request, context);
  ContextCacheBatchAdmission admission;
  admission.speculativeRequest = speculativeRequest;
  admission.tokenStateContract = tokenStateContract;
  admission.lookupPolicy = batchLookupPolicy(request, mediaTokenIds);
  admission.commitPolicy = commitPolicy;
  admission.replayTailLength = request.contextCacheReplayTailLength;
  admission.sequences = admissionSequences(request, context, mediaTokenIds, admission.lookupPolicy);
  auto begun = coordinator.beginRequest(admission, headroom, context.stream);
  if (begun.status != ContextCacheStatus::kOk) {
    logger()->warn("ContextCacheRequest::begin: admission refused ({}{})", toString(begun.status),
                   coordinator.poisoned() ? ", coordinator poisoned" : "");
    return std::nullopt;
  }
  LLMGenerationRequest founderIdentity;
  founderIdentity.contextCacheLookupPolicy = admission.lookupPolicy;
  founderIdentity.contextCacheCommitPolicy = commitPolicy;
  founderIdentity.cacheSalt = request.cacheSalt;
  founderIdentity.contextCacheRetention = request.contextCacheRetention;
  return ContextCacheRequest(coordinator, std::move(begun.admission->request),
                             std::move(begun.admission->prefillStarts), tokenStateContract,
                             std::move(founderIdentity), context.stream);
}

bool ContextCacheRequest::check(ContextCacheStatus status, char const* operation) const {
  if (status == ContextCacheStatus::kOk) {
    return true;
  }
  logger()->error("ContextCacheRequest::{} failed: {}{}", operation, toString(status),
                  mCoordinator->poisoned() ? " (coordinator poisoned)" : " (request failed)");
  return false;
}

int32_t ContextCacheRequest::reuseTokenLength(ExecutionRow row) const {
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < mPrefillStarts.size(),
              "ContextCacheRequest::reuseTokenLength", "row {} outside the batch of {}", row,
              mPrefillStarts.size());
  return mPrefillStarts[static_cast<std::size_t>(row)];
}

bool ContextCacheRequest::preparePrefill() {
  mCoordinator->preparePrefill(mHandle);
  return true;
}

bool ContextCacheRequest::enqueuePrefillCaptures() {
  mCoordinator->enqueuePrefillCaptures(mHandle);
  return true;
}

bool ContextCacheRequest::completePrefill(DecodingInferenceContext const& context,
                                          std::vector<int32_t> const& commonStateLengths) {
  constexpr char const* kCall = "ContextCacheRequest::completePrefill";
  auto const batch = static_cast<std::size_t>(mCoordinator->batchSize(mHandle));
  MKV_REQUIRE(
      context.generatedTokenIds.size() == batch && context.rawBatchedInputIds.size() == batch,
      kCall, "context has {} prompts / {} generated lists for a batch of {}",
      context.rawBatchedInputIds.size(), context.generatedTokenIds.size(), batch);
  std::vector<ContextCacheSequenceAdvance> advances(batch);
  std::vector<uint8_t> held(batch, 0);  // founders whose prefill goes on in chunks
  for (std::size_t i = 0; i < batch; ++i) {
    auto const& generated = context.generatedTokenIds[i];
    auto const rawSize = static_cast<int32_t>(context.rawBatchedInputIds[i].size());
    if (mCoordinator->awaitsPrefill(mHandle, static_cast<ExecutionRow>(i))) {
      MKV_REQUIRE(generated.empty(), kCall,
                  "row {}: its prefill chunks stopped short of its prompt, so it samples nothing "
                  "yet, got {} generated tokens",
                  i, generated.size());
      advances[i] = {nullptr, 0, kHoldCommittedStateLength};
      held[i] = 1;
      continue;
    }
    if (mContract == DecodingTokenStateContract::kFullyCommitted) {
      MKV_REQUIRE(generated.empty(), kCall,
                  "row {}: a fully committed prefill has no generated token, got {}", i,
                  generated.size());
      advances[i] = {nullptr, 0, rawSize};
    } else {
      MKV_REQUIRE(generated.size() == 1, kCall,
                  "row {}: after prefill exactly one lookahead token is sampled, got {}", i,
                  generated.size());
      advances[i] = {&generated.back(), 1, rawSize};
    }
  }
  if (!check(mCoordinator->finalizePrefillPublication(mHandle, advances, commonStateLengths),
             "completePrefill")) {
    return false;
  }
  for (std::size_t i = 0; i < batch; ++i) {
    mUnfinalized[i] = held[i];  // a held founder finishes as an in-flight admission
  }
  return true;
}

bool ContextCacheRequest::prepareDecodeStep(DecodingInferenceContext const& context,
                                            DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "ContextCacheRequest::prepareDecodeStep";
  MKV_REQUIRE(!mPreparedCounts.has_value(), kCall, "a decode step is already prepared");
  auto const batch = static_cast<std::size_t>(mCoordinator->batchSize(mHandle));
  MKV_REQUIRE(context.generatedTokenIds.size() == batch, kCall,
              "context has {} generated lists for a batch of {}", context.generatedTokenIds.size(),
              batch);
  // Recorded before the coordinator prepares the step (the scratch is reused, so this rarely
  // allocates): nothing after a prepared step can fail.
  std::vector<std::size_t> counts = std::move(mStepScratch.counts);
  counts.resize(batch);
  for (std::size_t i = 0; i < batch; ++i) {
    counts[i] = context.generatedTokenIds[i].size();
  }
  ContextCacheStatus const status = mCoordinator->prepareDecodeStep(mHandle, headroom);
  if (status != ContextCacheStatus::kOk) {
    mStepScratch.counts = std::move(counts);
    return mCoordinator->poisoned()
               ? check(status, "prepareDecodeStep")
               : detail::refusedStep("ManagedKVCacheRequest::prepareDecodeStep", lastFailure());
  }
  mPreparedCounts = std::move(counts);
  return true;
}

bool ContextCacheRequest::completeDecodeStep(DecodingInferenceContext const& context,
                                             std::vector<int32_t> const& commonStateLengths) {
  constexpr char const* kCall = "ContextCacheRequest::completeDecodeStep";
  MKV_REQUIRE(mPreparedCounts.has_value(), kCall, "no decode step was prepared");
  std::vector<std::size_t> const& before = *mPreparedCounts;
  auto const batch = before.size();
  MKV_REQUIRE(context.generatedTokenIds.size() == batch && context.finishReasons.size() == batch &&
                  context.rawBatchedInputIds.size() == batch,
              kCall, "the batch changed size since prepareDecodeStep ({} rows prepared)", batch);
  std::vector<ContextCacheSequenceAdvance>& advances = mStepScratch.advances;
  std::vector<int32_t>& completed = mStepScratch.completed;
  advances.resize(batch);
  completed.clear();
  for (std::size_t i = 0; i < batch; ++i) {
    auto const& generated = context.generatedTokenIds[i];
    FinishReason const reason = context.finishReasons[i];
    MKV_REQUIRE(generated.size() >= before[i], kCall, "row {} lost generated tokens ({} -> {})", i,
                before[i], generated.size());
    std::size_t const accepted = generated.size() - before[i];
    if (mUnfinalized[i] != 0) {
      MKV_REQUIRE(accepted == 0, kCall, "row {} is an unfinalised admission but gained tokens", i);
      advances[i] = {nullptr, 0, kHoldCommittedStateLength};
      continue;
    }
    if (accepted == 0) {
      MKV_REQUIRE(reason == FinishReason::kCancelled || reason == FinishReason::kError, kCall,
                  "row {} produced no token but is {}, not cancelled or errored", i,
                  toString(reason));
      advances[i] = {nullptr, 0, kHoldCommittedStateLength};
      continue;
    }
    int64_t const committed = static_cast<int64_t>(context.rawBatchedInputIds[i].size()) +
                              static_cast<int64_t>(generated.size()) -
                              (mContract == DecodingTokenStateContract::kFullyCommitted ? 0 : 1);
    MKV_REQUIRE(committed <= std::numeric_limits<int32_t>::max(), kCall,
                "row {}: committed length {} exceeds int32", i, committed);
    advances[i] = {generated.data() + before[i], static_cast<int32_t>(accepted),
                   static_cast<int32_t>(committed)};
    if (reason != FinishReason::kNotFinished && reason != FinishReason::kCancelled &&
        reason != FinishReason::kError) {
      completed.push_back(static_cast<int32_t>(i));
    }
  }
  // Only once the coordinator accepted the step: a rejected (throwing) call leaves the step
  // prepared, so the runtime can retry with corrected progress.
  ContextCacheStatus const status =
      mCoordinator->completeDecodeStep(mHandle, advances, completed, commonStateLengths);
  mStepScratch.counts = std::move(*mPreparedCounts);
  mPreparedCounts.reset();
  return check(status, "completeDecodeStep");
}

bool ContextCacheRequest::beginBatchCompaction(std::vector<int32_t> const& oldToNew,
                                               int32_t newBatchSize, Tensor& deviceBatchMapping) {
  MKV_REQUIRE(!mPreparedCounts.has_value(), "ContextCacheRequest::beginBatchCompaction",
              "a decode step is still prepared");
  std::vector<int32_t> pending = oldToNew;  // copied before the coordinator begins
  mCoordinator->beginBatchCompaction(mHandle, oldToNew, newBatchSize, deviceBatchMapping);
  mPendingMapping = std::move(pending);
  return true;
}

bool ContextCacheRequest::completeBatchCompaction(std::vector<int32_t> const& keepMapping) {
  detail::requireBegunMapping("ContextCacheRequest::completeBatchCompaction", mPendingMapping,
                              keepMapping);
  int32_t newSize = 0;
  for (int32_t destination : keepMapping) {
    newSize += destination >= 0 ? 1 : 0;
  }
  // Built before the coordinator compacts: nothing after a compaction can fail.
  std::vector<int32_t> starts = compacted(mPrefillStarts, keepMapping, newSize);
  std::vector<uint8_t> unfinalized = compacted(mUnfinalized, keepMapping, newSize);
  ContextCacheStatus const status = mCoordinator->compactBatch(mHandle);
  if (status != ContextCacheStatus::kOk) {
    mPendingMapping.clear();
    return check(status, "completeBatchCompaction");
  }
  mPrefillStarts = std::move(starts);
  mUnfinalized = std::move(unfinalized);
  mPendingMapping.clear();
  return true;
}

bool ContextCacheRequest::finish() {
  MKV_REQUIRE(!mPreparedCounts.has_value(), "ContextCacheRequest::finish",
              "a decode step is still prepared");
  return check(mCoordinator->finish(mHandle), "finish");
}

ContextCacheRequest::AdmitSequenceStatus ContextCacheRequest::admitSequence(
    std::vector<int32_t> const& tokenIds, std::string const& loraWeightsName,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds,
    std::vector<imageUtils::ImageData> const& imageBuffers,
    std::vector<audioUtils::AudioData> const& audioBuffers) {
  return admitSequence(inheritedJoiner(loraWeightsName, imageBuffers, audioBuffers), tokenIds,
                       headroom, prefillStart, resident, stream, mediaTokenIds);
}

ContextCacheSequenceAdmission ContextCacheRequest::joinerAdmission(
    char const* call, LLMGenerationRequest const& joiner, std::vector<int32_t> const& tokenIds,
    ResidentRef resident, std::vector<int32_t> const& mediaTokenIds) {
  MKV_REQUIRE(joiner.requests.size() == 1, call,
              "a joiner's request describes exactly one sequence, got {}", joiner.requests.size());
  MKV_REQUIRE(joiner.contextCacheReplayTailLength == 0, call,
              "a joiner has no replay tail of its own (it takes the request's), got {} tokens",
              joiner.contextCacheReplayTailLength);
  LLMGenerationRequest::Sequence const& inputs = joiner.requests.front();
  ContextCacheLookupPolicy const lookupPolicy =
      inputs.contextCacheLookupPolicy.value_or(joiner.contextCacheLookupPolicy);
  MKV_REQUIRE(static_cast<uint8_t>(joiner.contextCacheCommitPolicy) <= 1 &&
                  static_cast<uint8_t>(lookupPolicy) <= 1,
              call, "the joiner's commit policy {} / lookup policy {} out of range",
              static_cast<int>(joiner.contextCacheCommitPolicy), static_cast<int>(lookupPolicy));
  requireValidRetention(call, joiner.contextCacheRetention);
  ContextCacheSequenceAdmission admission;
  admission.tokenIds = tokenIds;
  admission.keyExtras =
      BlockKeyExtras{digestIdentity(joiner.loraWeightsName), digestIdentity(joiner.cacheSalt)};
  admission.resident = resident;
  admission.retention = joiner.contextCacheRetention;
  admission.commitPolicy = joiner.contextCacheCommitPolicy;
  admission.lookupPolicy = lookupPolicy;
  if (!mediaTokenIds.empty() && !imagesHostReadable(inputs.imageBuffers)) {
    admission.lookupPolicy = ContextCacheLookupPolicy::kBypass;  // bypass, do not fail
  } else {
    admission.media =
        buildMediaPositions(tokenIds, mediaTokenIds, inputs.imageBuffers, inputs.audioBuffers);
  }
  return admission;
}

LLMGenerationRequest ContextCacheRequest::inheritedJoiner(
    std::string const& loraWeightsName, std::vector<imageUtils::ImageData> const& imageBuffers,
    std::vector<audioUtils::AudioData> const& audioBuffers) const {
  LLMGenerationRequest joiner = mFounderIdentity;
  joiner.loraWeightsName = loraWeightsName;
  joiner.requests.push_back({imageBuffers, audioBuffers, std::nullopt});
  return joiner;
}

ContextCacheRequest::AdmitSequenceStatus ContextCacheRequest::admitSequence(
    LLMGenerationRequest const& joiner, std::vector<int32_t> const& tokenIds,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds) {
  constexpr char const* kCall = "ContextCacheRequest::admitSequence";
  MKV_REQUIRE(stream == mStream, kCall, "stream differs from the request's stream");
  MKV_REQUIRE(!mPreparedCounts.has_value(), kCall, "a decode step is prepared");
  ContextCacheSequenceAdmission const admission =
      joinerAdmission(kCall, joiner, tokenIds, resident, mediaTokenIds);
  // Room for the joiner's row before the coordinator admits it: nothing after can fail.
  mPrefillStarts.reserve(mPrefillStarts.size() + 1);
  mUnfinalized.reserve(mUnfinalized.size() + 1);
  auto const result = mCoordinator->admitSequence(mHandle, admission, headroom);
  if (result.status == ContextCacheStatus::kOk) {
    mPrefillStarts.push_back(result.prefillStart);
    mUnfinalized.push_back(1);
    prefillStart = result.prefillStart;
    return AdmitSequenceStatus::kAdmitted;
  }
  if (result.status == ContextCacheStatus::kRequestFailed && result.insufficientCapacity) {
    return AdmitSequenceStatus::kNoCapacity;
  }
  check(result.status, "admitSequence");
  return AdmitSequenceStatus::kFailed;
}

bool ContextCacheRequest::preemptSequence(ExecutionRow row) {
  return check(mCoordinator->preemptSequence(mHandle, row), "preemptSequence");
}

bool ContextCacheRequest::preemptSequence(ExecutionRow row, PreemptionKind kind) {
  return check(mCoordinator->preemptSequence(mHandle, row, kind), "preemptSequence");
}

bool ContextCacheRequest::preparePrefillChunk(ExecutionRow row, int32_t chunkEnd) {
  return check(mCoordinator->preparePrefillChunk(mHandle, row, chunkEnd), "preparePrefillChunk");
}

bool ContextCacheRequest::completePrefillChunk(ExecutionRow row, int32_t prefilledTokens) {
  return check(mCoordinator->completePrefillChunk(mHandle, row, prefilledTokens),
               "completePrefillChunk");
}

bool ContextCacheRequest::finalizeSequenceAdmission(ExecutionRow row, int32_t const& lookaheadToken,
                                                    int32_t fullInputLength) {
  ContextCacheSequenceAdvance const advance{&lookaheadToken, 1, fullInputLength};
  if (!check(mCoordinator->finalizeSequenceAdmission(mHandle, row, advance),
             "finalizeSequenceAdmission")) {
    return false;
  }
  mUnfinalized[static_cast<std::size_t>(row)] = 0;
  return true;
}

bool ContextCacheRequest::retractSequenceAdmission() noexcept {
  if (!mCoordinator->hasRetractableAdmission(mHandle)) {
    return false;
  }
  // The coordinator undoes the admission even when the row clear fails (false, poisoned): this
  // request's rows follow it either way.
  bool const cleared = mCoordinator->retractSequenceAdmission(mHandle);
  mPrefillStarts.pop_back();
  mUnfinalized.pop_back();
  return cleared;
}

bool ContextCacheRequest::publishHybridMtpEndpoint(ExecutionRow row, int32_t residentStateLength,
                                                   Tensor const& baseHiddenStates,
                                                   int32_t boundaryHiddenRow) {
  return check(mCoordinator->publishHybridMtpEndpoint(mHandle, row, residentStateLength,
                                                      baseHiddenStates, boundaryHiddenRow),
               "publishHybridMtpEndpoint");
}

bool ContextCacheRequest::restoreHybridMtpBoundaryHidden(ExecutionRow row, Tensor& baseHiddenStates,
                                                         int32_t destinationRow) {
  mCoordinator->restoreHybridMtpBoundaryHidden(mHandle, row, baseHiddenStates, destinationRow);
  return true;
}

}  // namespace mkv
