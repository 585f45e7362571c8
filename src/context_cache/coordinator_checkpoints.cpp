// ContextCacheCoordinator: the calls of checkpoint requests (hybrid and pure-recurrent
// deployments, Hybrid-MTP). The captures, restores and publications themselves are the modes'
// (checkpoint_mode.h, hybrid_mtp_mode.h); these calls check the call and dispatch.

#include <optional>

#include "context_cache/coordinator_request.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/hybrid_mtp_mode.h"
#include "core/check.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv {

using detail::prefixOf;
using detail::sequenceAt;

namespace {

/// The Hybrid-MTP calls of a row whose prefill is under way: a founder's between preparePrefill
/// and finalizePrefillPublication, or an unfinalised joiner's (or a founder's held after a
/// chunk) while the request executes with no pending work.
void requireAwaitingPrefill(char const* call, detail::CoordinatorRequest const& req,
                            detail::CoordinatorSequence const& sequence, ExecutionRow row) {
  bool const joiner = !sequence.joined || sequence.prefillHeld;
  MKV_REQUIRE(
      req.stage == RequestStage::kPrefilling || (req.stage == RequestStage::kSettled && joiner),
      call,
      "row {}: a Hybrid-MTP row restores and publishes between preparePrefill and "
      "finalizePrefillPublication, or as an unfinalised in-flight admission before "
      "finalizeSequenceAdmission, with no step pending",
      row);
}

}  // namespace

void ContextCacheCoordinator::enqueuePrefillCaptures(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::enqueuePrefillCaptures";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling, kCall,
              "captures are enqueued between preparePrefill and finalizePrefillPublication");
  req.mode->enqueuePrefillCaptures(req);
}

std::span<ReusePointCapture const> ContextCacheCoordinator::reusePointCaptures(
    RequestHandle const& handle, ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::reusePointCaptures";
  Request const& req = request(handle, kCall);
  auto const& sequence = sequenceAt(req, row, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling || !sequence.joined, kCall,
              "reuse points are captured between preparePrefill and finalizePrefillPublication, "
              "or by an in-flight admission before finalizeSequenceAdmission (row {})",
              row);
  return sequence.reusePoints;
}

ContextCacheStatus ContextCacheCoordinator::publishHybridMtpEndpoint(RequestHandle& handle,
                                                                     ExecutionRow row,
                                                                     int32_t residentStateLength,
                                                                     Tensor const& baseHiddenStates,
                                                                     int32_t boundaryHiddenRow) {
  constexpr char const* kCall = "ContextCacheCoordinator::publishHybridMtpEndpoint";
  Request& req = request(handle, kCall);
  detail::HybridMtpMode const* const mtp = mModes->hybridMtp;
  MKV_REQUIRE(mtp != nullptr, kCall, "the deployment is not Hybrid-MTP (row {}, length {})", row,
              residentStateLength);
  MKV_REQUIRE(req.mode == mtp, kCall, "request {} is not speculative (row {}, length {})", req.id,
              row, residentStateLength);
  Request::Sequence& sequence = sequenceAt(req, row, kCall);
  requireAwaitingPrefill(kCall, req, sequence, row);
  MKV_REQUIRE(residentStateLength >= 0 && residentStateLength <= sequence.promptLength, kCall,
              "row {}: residentStateLength {} outside [0, prompt {}]", row, residentStateLength,
              sequence.promptLength);
  // What the row's state holds: a founder's whole prompt in the prefill (unless it was held
  // after a first chunk); a joiner's or a held founder's, what its completed chunks computed.
  bool const founder = req.stage == RequestStage::kPrefilling;
  int32_t const computed =
      founder && !sequence.prefillHeld ? sequence.promptLength : sequence.committed;
  MKV_REQUIRE(residentStateLength <= computed, kCall,
              "row {}: residentStateLength {} beyond its completed chunks ({} tokens): complete "
              "its last chunk (completePrefillChunk) first",
              row, residentStateLength, computed);
  req.mode->rows().requireCovered(kCall, row, sequence, residentStateLength, mManager->pageSize());
  // The endpoint copies the row's pages: its rows must have reached the device.
  mWrites->requireReachedDevice(kCall, founder ? req.writesMark : sequence.joinWritesMark);
  MKV_REQUIRE(residentStateLength <= sequence.promptLength - req.replayTailLength, kCall,
              "row {}: residentStateLength {} reaches into the replay tail ({} of the prompt's {} "
              "tokens): publish at most {}",
              row, residentStateLength, req.replayTailLength, sequence.promptLength,
              sequence.promptLength - req.replayTailLength);
  MKV_REQUIRE(residentStateLength == 0 || residentStateLength >= sequence.reuseTokenLength, kCall,
              "row {}: residentStateLength {} below the restored reuse length {}", row,
              residentStateLength, sequence.reuseTokenLength);
  detail::validateHiddenRow(kCall, mProfile, mDevice, baseHiddenStates, boundaryHiddenRow);
  if (sequence.policy == ContextCacheLookupPolicy::kBypass || residentStateLength == 0 ||
      residentStateLength <= sequence.publishedExact) {
    return ContextCacheStatus::kOk;
  }
  PromptBlocks const blocks =
      hashPromptBlocks(prefixOf(sequence, residentStateLength), mManager->pageSize());
  if (mManager->records().findHybrid(HybridKey{exactPrefixDigest(blocks, residentStateLength),
                                               residentStateLength, true}) != nullptr) {
    return ContextCacheStatus::kOk;
  }
  std::optional<SnapshotReservation> const reservation =
      mtp->reserveEndpoint(sequence, residentStateLength);
  if (!reservation) {
    return ContextCacheStatus::kOk;
  }
  mtp->captureEndpoint(sequence, *reservation, residentStateLength, baseHiddenStates,
                       boundaryHiddenRow);
  if (!synchronize()) {
    return quarantineHandle(handle, req.id);  // the reserved slots stay leased
  }
  mtp->commitEndpoint(req, sequence, row, blocks, residentStateLength, *reservation);
  return ContextCacheStatus::kOk;
}

void ContextCacheCoordinator::restoreHybridMtpBoundaryHidden(RequestHandle& handle,
                                                             ExecutionRow row,
                                                             Tensor& baseHiddenStates,
                                                             int32_t destinationRow) {
  constexpr char const* kCall = "ContextCacheCoordinator::restoreHybridMtpBoundaryHidden";
  Request& req = request(handle, kCall);
  detail::HybridMtpMode const* const mtp = mModes->hybridMtp;
  MKV_REQUIRE(mtp != nullptr, kCall,
              "the deployment is not Hybrid-MTP (row {}, destination row {})", row, destinationRow);
  Request::Sequence const& sequence = sequenceAt(req, row, kCall);
  requireAwaitingPrefill(kCall, req, sequence, row);
  std::optional<SnapshotSlot> const recurrent = sequence.lease.recurrentSnapshotSlot();
  bool const restoredEndpoint = req.mode == mtp && recurrent.has_value();
  MKV_REQUIRE(restoredEndpoint, kCall, "row {} restored no Hybrid-MTP checkpoint (reuse {}){}", row,
              sequence.reuseTokenLength,
              req.mode == mtp && sequence.reuseTokenLength > 0
                  ? ", or its pins were released by the endpoint's publication"
                  : "");
  detail::validateHiddenRow(kCall, mProfile, mDevice, baseHiddenStates, destinationRow);
  mtp->restoreBoundaryHidden(sequence, *recurrent, baseHiddenStates, destinationRow);
}

}  // namespace mkv
