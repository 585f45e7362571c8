// ContextCacheCoordinator: in-flight admission. A sequence joins an executing request at the end
// of its batch (admitSequence), is finalised after its own prefill (finalizeSequenceAdmission) or
// undone while it has not joined (retractSequenceAdmission).

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <string_view>

#include "context_cache/coordinator_paged_rows.h"
#include "context_cache/coordinator_request.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/hybrid_mtp_mode.h"
#include "context_cache/request_mode.h"
#include "core/check.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/logging.h"
#include "resources/request_registry.h"

namespace mkv {

std::string_view toString(JoinerPageAllocation allocation) noexcept {
  switch (allocation) {
    case JoinerPageAllocation::kWholePrompt:
      return "whole-prompt";
    case JoinerPageAllocation::kPerChunk:
      return "per-chunk";
  }
  return "unknown";
}

ContextCacheCoordinator::AdmitSequenceResult ContextCacheCoordinator::admitSequence(
    RequestHandle& handle, ContextCacheSequenceAdmission const& admission,
    DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "ContextCacheCoordinator::admitSequence";
  Request& req = request(handle, kCall);
  detail::validateJoinedRequest(kCall, req, mModes->joinable(req.mode), mMaxBatch);
  detail::PagedRows const table = req.mode->rows();  // the base lane
  table.validateHeadroom(kCall, headroom);
  detail::validateJoiner(kCall, admission, headroom, mMaxBatch, mLimits->baseRowPages,
                         mManager->pageSize(), mResources.residentSlots);
  if (req.mode == mModes->hybridMtp) {  // as beginRequest's rules for every founder
    ContextCacheCommitPolicy const policy = admission.commitPolicy.value_or(req.commitPolicy);
    MKV_REQUIRE(policy == ContextCacheCommitPolicy::kPrefillStateOnly, kCall,
                "a Hybrid-MTP request's joiner needs commit policy kPrefillStateOnly, got {}",
                static_cast<int>(policy));
    MKV_REQUIRE(static_cast<std::size_t>(req.replayTailLength) < admission.tokenIds.size(), kCall,
                "the request's replay tail of {} tokens leaves nothing of the joiner's {}-token "
                "prompt",
                req.replayTailLength, admission.tokenIds.size());
  }
  AdmitSequenceResult result;
  if (poisoned()) {  // before the busy check, as in beginRequest
    result.status = ContextCacheStatus::kPoisoned;
    return result;
  }
  ResidentRef const ref = admission.resident;
  MKV_REQUIRE(mResidentBusy[static_cast<std::size_t>(ref.slot)] == 0, kCall,
              "resident slot {} is already held", ref.slot);
  // The request's own policy: the first surviving row after a compaction is not the founder. A
  // speculative joiner with media bypasses the cache (the draft's state is not keyed by media).
  ContextCacheLookupPolicy const policy = req.mode->speculativeRounds() && !admission.media.empty()
                                              ? ContextCacheLookupPolicy::kBypass
                                              : admission.lookupPolicy.value_or(req.batchPolicy);
  LookupRequest lookup = lookupOf(admission, policy, headroom, *req.mode);
  // Per chunk: the lease binds the reused prefix only; preparePrefillChunk grows it chunk by chunk.
  lookup.coverReusedPrefixOnly = mConfig.joinerPages == JoinerPageAllocation::kPerChunk;
  auto const start = std::chrono::steady_clock::now();
  mkv::AdmissionResult acquired = mManager->admit(lookup);
  bool const moved = moveHostTierPages(kCall);
  countPlanning(start);
  if (!moved) {  // poisoned; the lease (an onboarding destination) is released
    result.status = ContextCacheStatus::kPoisoned;
    return result;
  }
  if (!acquired.lease) {
    ++mCounters.liveAdmissionRefusals;
    result.status = ContextCacheStatus::kRequestFailed;
    result.insufficientCapacity = true;
    return result;
  }
  Sequence state = detail::admittedSequence(admission, lookup.policy, req.commitPolicy, acquired);
  state.joined = false;
  req.sequences.push_back(std::move(state));
  try {
    req.mode->bindJoiner(req);
  } catch (...) {
    req.sequences.pop_back();
    try {
      table.clearRow(ref.slot);
    } catch (...) {
      poison();
    }
    throw;
  }
  mResidentBusy[static_cast<std::size_t>(ref.slot)] = 1;
  req.sequences.back().joinWritesMark = mWrites->awaitingFlush();
  ++mCounters.liveAdmissions;
  result.status = ContextCacheStatus::kOk;
  result.prefillStart = req.sequences.back().reuseTokenLength;
  return result;
}

ContextCacheStatus ContextCacheCoordinator::completePrefillChunk(RequestHandle& handle,
                                                                 ExecutionRow row,
                                                                 int32_t prefilledTokens) {
  constexpr char const* kCall = "ContextCacheCoordinator::completePrefillChunk";
  Request& req = request(handle, kCall);
  bool const founder = req.stage == RequestStage::kPrefilling;
  MKV_REQUIRE(founder || req.stage == RequestStage::kSettled, kCall,
              "row {}: a chunk completes after the step that ran it (a founder's before "
              "finalizePrefillPublication, a joiner's in an executing request with no pending "
              "work)",
              row);
  auto& sequence = detail::sequenceAt(req, row, kCall);
  if (founder) {
    requireChunkableFounder(kCall, req, sequence, row);
  } else {
    MKV_REQUIRE(!sequence.joined, kCall, "row {} is not an unfinalised in-flight admission", row);
  }
  MKV_REQUIRE(prefilledTokens >= sequence.committed && prefilledTokens <= sequence.promptLength,
              kCall, "row {}: {} prefilled tokens outside [{} (done so far), {} (the prompt)]", row,
              prefilledTokens, sequence.committed, sequence.promptLength);
  MKV_REQUIRE(prefilledTokens >= sequence.publishedExact || req.mode != mModes->hybridMtp, kCall,
              "row {}: its endpoint at {} tokens was published (publishHybridMtpEndpoint): its "
              "prefill is past {}",
              row, sequence.publishedExact, prefilledTokens);
  MKV_REQUIRE(!founder || !sequence.prefillHeld || prefilledTokens == sequence.committed, kCall,
              "row {}: its first chunk (to {}) completed in this prefill; a founder's next chunks "
              "come after completePrefill, as a joiner's",
              row, sequence.committed);
  req.mode->rows().requireCovered(kCall, row, sequence, prefilledTokens, mManager->pageSize());
  // Its chunks ran through the row its admission (or preparePrefill) bound: that row must have
  // reached the device.
  mWrites->requireReachedDevice(kCall, founder ? req.writesMark : sequence.joinWritesMark);
  if (poisoned()) {
    return ContextCacheStatus::kPoisoned;
  }
  sequence.committed = prefilledTokens;
  if (founder) {
    sequence.prefillHeld = prefilledTokens < sequence.promptLength;
  }
  ++mCounters.prefillChunks;
  req.mode->publishChunk(req, static_cast<std::size_t>(row));
  return ContextCacheStatus::kOk;
}

bool ContextCacheCoordinator::awaitsPrefill(RequestHandle const& handle, ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::awaitsPrefill";
  auto const& sequence = detail::sequenceAt(request(handle, kCall), row, kCall);
  return !sequence.joined || sequence.prefillHeld;
}

void ContextCacheCoordinator::requireChunkableFounder(char const* call, Request const& req,
                                                      Sequence const& sequence,
                                                      ExecutionRow row) const {
  MKV_REQUIRE(mModes->joinable(req.mode) &&
                  req.contract == DecodingTokenStateContract::kCommittedPlusLookahead,
              call,
              "row {}: a founder's prefill goes on in chunks as an in-flight admission, which "
              "this request does not take (pure recurrent, or kFullyCommitted): its founders "
              "prefill whole",
              row);
  MKV_REQUIRE(!sequence.staged, call,
              "row {}: its prompt-end capture was enqueued (enqueuePrefillCaptures): a founder's "
              "chunk completes before it",
              row);
}

ContextCacheCoordinator::Sequence const& ContextCacheCoordinator::prefillChunkRow(
    char const* call, Request const& req, ExecutionRow row, int32_t chunkEnd) const {
  bool const founder = req.stage == RequestStage::kPrefilling;
  MKV_REQUIRE(founder || req.stage == RequestStage::kSettled, call,
              "row {}: a chunk is prepared before the step that runs it (a founder's in the "
              "prefill, a joiner's in an executing request with no pending work)",
              row);
  auto const& sequence = detail::sequenceAt(req, row, call);
  if (founder) {
    requireChunkableFounder(call, req, sequence, row);
    MKV_REQUIRE(!sequence.prefillHeld, call,
                "row {}: its first chunk (to {}) completed in this prefill; a founder's next "
                "chunks come after completePrefill, as a joiner's",
                row, sequence.committed);
  } else {
    MKV_REQUIRE(!sequence.joined, call, "row {} is not an unfinalised in-flight admission", row);
  }
  MKV_REQUIRE(chunkEnd > sequence.committed && chunkEnd <= sequence.promptLength, call,
              "row {}: chunk end {} outside ({} (done so far), {} (the prompt)]", row, chunkEnd,
              sequence.committed, sequence.promptLength);
  return sequence;
}

ContextCacheStatus ContextCacheCoordinator::preparePrefillChunk(RequestHandle& handle,
                                                                ExecutionRow row,
                                                                int32_t chunkEnd) {
  constexpr char const* kCall = "ContextCacheCoordinator::preparePrefillChunk";
  Request& req = request(handle, kCall);
  prefillChunkRow(kCall, req, row, chunkEnd);
  if (poisoned()) {
    return ContextCacheStatus::kPoisoned;
  }
  if (req.stage == RequestStage::kPrefilling) {
    return ContextCacheStatus::kOk;  // a founder: preparePrefill bound its whole prompt's pages
  }
  // The pages up to the chunk's end: a kPerChunk joiner takes them now, a joiner admitted with its
  // whole prompt's pages already holds them (nothing grows).
  detail::PagedRows const table = req.mode->rows();
  Sequence& sequence = req.sequences[static_cast<std::size_t>(row)];
  detail::LaneCounts const needed =
      table.neededPages(chunkEnd, DecodingKvHeadroom{0, 0}, mManager->pageSize());
  switch (growRow(req, sequence, needed, kCall)) {
    case RowGrowth::kUnchanged:
      return ContextCacheStatus::kOk;
    case RowGrowth::kGrown:
      ++mCounters.chunkPageGrowths;
      table.upload();
      sequence.joinWritesMark = mWrites->awaitingFlush();  // the chunk runs through these pages
      return ContextCacheStatus::kOk;
    case RowGrowth::kPoisoned:
      table.upload();
      return ContextCacheStatus::kPoisoned;
    case RowGrowth::kTableFull:  // unreachable: admission checked the prompt fits its row
    case RowGrowth::kNoCapacity:
      break;
  }
  req.failure = RowFailure{RowFailureReason::kNoCapacity, row};
  ++mCounters.growthFailures;
  return ContextCacheStatus::kRequestFailed;
}

DecodeStepDemand ContextCacheCoordinator::prefillChunkDemand(RequestHandle const& handle,
                                                             ExecutionRow row,
                                                             int32_t chunkEnd) const {
  constexpr char const* kCall = "ContextCacheCoordinator::prefillChunkDemand";
  Request const& req = request(handle, kCall);
  Sequence const& sequence = prefillChunkRow(kCall, req, row, chunkEnd);
  detail::PagedRows const table = req.mode->rows();
  detail::LaneCounts const needed =
      table.neededPages(chunkEnd, DecodingKvHeadroom{0, 0}, mManager->pageSize());
  DecodeStepDemand demand;
  table.addGrowth(needed, table.heldPages(sequence), demand);
  return demand;
}

ContextCacheStatus ContextCacheCoordinator::preemptSequence(RequestHandle& handle,
                                                            ExecutionRow row) {
  constexpr char const* kCall = "ContextCacheCoordinator::preemptSequence";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, kCall,
              "row {}: a sequence is preempted between steps (an executing request with no "
              "pending work)",
              row);
  auto const& sequence = detail::sequenceAt(req, row, kCall);
  MKV_REQUIRE(sequence.joined, kCall,
              "row {} is an unfinalised in-flight admission: retract it, or finish its prefill",
              row);
  if (poisoned()) {
    return ContextCacheStatus::kPoisoned;
  }
  ++mCounters.preemptions;
  // Nothing past what is already published may be: a row whose prompt endpoint waits for its
  // draft initialisation publishes with it (a speculative row's rule; the other rows go on).
  if (sequence.commitPolicy != ContextCacheCommitPolicy::kIncludingGeneratedTokens ||
      sequence.endpointFrozen) {
    return ContextCacheStatus::kOk;
  }
  std::vector<uint8_t> completed(req.sequences.size(), 0);
  completed[static_cast<std::size_t>(row)] = 1;
  return publishCompleted(handle, req, completed);
}

ContextCacheStatus ContextCacheCoordinator::preemptSequence(RequestHandle& handle, ExecutionRow row,
                                                            PreemptionKind kind) {
  constexpr char const* kCall = "ContextCacheCoordinator::preemptSequence";
  MKV_REQUIRE(kind == PreemptionKind::kRecompute || mManager->hostTier() != nullptr, kCall,
              "row {}: swap preemption moves the row's blocks to the host tier, and this "
              "coordinator has none (resources.hostTier)",
              row);
  ContextCacheStatus const status = preemptSequence(handle, row);  // validates, then publishes
  if (kind == PreemptionKind::kSwap && status == ContextCacheStatus::kOk) {
    detail::sequenceAt(request(handle, kCall), row, kCall).swapOut = true;
  }
  return status;
}

ContextCacheStatus ContextCacheCoordinator::finalizeSequenceAdmission(
    RequestHandle& handle, ExecutionRow row, ContextCacheSequenceAdvance const& advance) {
  constexpr char const* kCall = "ContextCacheCoordinator::finalizeSequenceAdmission";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(isExecuting(req.stage), kCall, "the request is not executing");
  auto& sequence = detail::sequenceAt(req, row, kCall);
  MKV_REQUIRE(!sequence.joined, kCall, "row {} is not an unfinalised in-flight admission", row);
  req.mode->rows().requireCovered(kCall, row, sequence, sequence.promptLength,
                                  mManager->pageSize());
  mWrites->requireReachedDevice(kCall, sequence.joinWritesMark);
  if (poisoned()) {
    return ContextCacheStatus::kPoisoned;
  }
  MKV_REQUIRE(advance.acceptedTokenCount == 1 && advance.acceptedTokenIds != nullptr &&
                  advance.committedStateLength == static_cast<int32_t>(sequence.tokens.size()),
              kCall,
              "row {}: finalising accepts the 1 lookahead token and commits the {} prompt "
              "tokens, got {} / {}",
              row, sequence.tokens.size(), advance.acceptedTokenCount,
              advance.committedStateLength);
  detail::reserveAdvance(sequence, advance);
  auto const index = static_cast<std::size_t>(row);
  bool const staged = req.mode->stageJoinerPrefill(req, index);  // a throw changes nothing
  detail::applyAdvance(sequence, advance);
  sequence.joined = true;
  // The captures read state the joiner's prefill wrote: one synchronisation makes them terminal.
  if (staged && !synchronize()) {
    return quarantineHandle(handle, req.id);
  }
  req.mode->publishJoinerPrefill(req, index);
  return ContextCacheStatus::kOk;
}

bool ContextCacheCoordinator::hasRetractableAdmission(RequestHandle const& handle) const noexcept {
  Request const* const live = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  // Not when pending device work (a decode step, a compaction) may still read the row's pages,
  // the newest row joined, or it is the batch's only row.
  return live != nullptr && !hasPendingWork(live->stage) && live->sequences.size() >= 2 &&
         !live->sequences.back().joined;
}

bool ContextCacheCoordinator::retractSequenceAdmission(RequestHandle& handle) noexcept {
  Request* const live = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  if (live == nullptr || !hasRetractableAdmission(handle)) {
    return false;
  }
  Request& req = *live;
  CacheSlot const slot = req.sequences.back().resident.slot;
  req.sequences.pop_back();  // lease released
  mResidentBusy[static_cast<std::size_t>(slot)] = 0;
  ++mCounters.retractedAdmissions;
  try {
    detail::PagedRows const table = req.mode->rows();
    table.clearRow(slot);
    table.upload();
  } catch (std::exception const& error) {
    logger()->error("ContextCacheCoordinator::retractSequenceAdmission: {}; poisoned",
                    error.what());
    poison();
    return false;
  }
  return true;
}

}  // namespace mkv
