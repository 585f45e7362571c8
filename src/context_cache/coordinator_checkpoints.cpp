// ContextCacheCoordinator: checkpoint capture and restore on hybrid and pure-recurrent
// deployments (recurrent rows plus the valid rows of a partially filled last KV page), and the
// Hybrid-MTP endpoint (with the draft's boundary page and the base hidden row).

#include <spdlog/spdlog.h>

#include <algorithm>
#include <new>
#include <unordered_set>

#include "context_cache/coordinator_request.h"
#include "context_cache/coordinator_validation.h"
#include "core/check.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/logging.h"

namespace mkv {

using detail::prefixOf;
using detail::sequenceAt;

// ---------------------------------------------------------------- restore

void ContextCacheCoordinator::restoreCheckpoints(Request& req, std::span<CacheSlot const> cold) {
  int32_t const pageSize = mManager->pageSize();
  for (auto const& sequence : req.sequences) {
    std::optional<SnapshotSlot> const recurrent = sequence.lease.recurrentSnapshotSlot();
    if (!recurrent) {
      continue;
    }
    mSnapshots->restoreRecurrent(*recurrent, sequence.resident.slot, mStream);
    CacheRecord const* hit = mManager->records().get(sequence.lease.hitRecord());
    mCounters.reusePointRestores += hit != nullptr && hit->reusePoint ? 1U : 0U;
    if (std::optional<SnapshotSlot> const partial = sequence.lease.partialKvSnapshotSlot()) {
      int32_t const reuse = sequence.reuseTokenLength;
      if (sequence.lease.mode() == ReuseMode::kHybridMtp) {
        // The boundary token stays private: its page is the lease's, with 1..page valid rows.
        auto const index = static_cast<std::size_t>((reuse - 1) / pageSize);
        mSnapshots->restorePartialKv(*partial, sequence.lease.basePages()[index],
                                     reuse - static_cast<int32_t>(index) * pageSize,
                                     sequence.lease.draftPages()[index], mStream);
      } else {
        PageId const page = sequence.lease.basePages()[static_cast<std::size_t>(reuse / pageSize)];
        mSnapshots->restorePartialKv(*partial, page, reuse % pageSize, kNoPage, mStream);
      }
    }
    ++mCounters.checkpointRestores;
  }
  if (!cold.empty()) {
    mResources.recurrent->clearResidentSlots(cold, mStream);
  }
}

// ---------------------------------------------------------------- capture

void ContextCacheCoordinator::enqueuePrefillCaptures(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::enqueuePrefillCaptures";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling, kCall,
              "captures are enqueued between preparePrefill and finalizePrefillPublication");
  if (mSnapshots == nullptr || isHybridMtp(req)) {
    // Attention-only deployments keep no checkpoints; a Hybrid-MTP request publishes its
    // endpoint through publishHybridMtpEndpoint only.
    return;
  }
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    stageCapture(req, row, req.sequences[row].promptLength);  // a staged row is skipped
  }
}

bool ContextCacheCoordinator::stageCapture(Request& req, std::size_t row, int32_t exactLength) {
  Request::Sequence& sequence = req.sequences[row];
  if (sequence.policy == ContextCacheLookupPolicy::kBypass ||
      exactLength <= sequence.publishedExact || sequence.staged) {
    return false;
  }
  int32_t const pageSize = mManager->pageSize();
  bool const partial = hasKv() && exactLength % pageSize != 0;
  std::optional<SnapshotReservation> reservation;
  try {
    // A checkpoint already cached under this key needs no copy, and must not evict anything;
    // so does an unaligned Hybrid-MTP one, whose base side plain plans restore (an aligned one
    // keeps its boundary page private and is of no use to them).
    PromptBlocks const blocks = hashPromptBlocks(prefixOf(sequence, exactLength), pageSize);
    Hash128 const digest = exactPrefixDigest(blocks, exactLength);
    if (mManager->records().findHybrid(HybridKey{digest, exactLength, false}) != nullptr ||
        (partial &&
         mManager->records().findHybrid(HybridKey{digest, exactLength, true}) != nullptr)) {
      return false;
    }
    reservation = mManager->reserveHybridSnapshots(sequence.lease, partial);
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the checkpoint of {} tokens of "
        "request {} row {} is not captured",
        exactLength, req.id, row);
    return false;
  }
  if (!reservation) {
    uint64_t const skips = ++mCounters.snapshotPressureSkips;
    if ((skips & (skips - 1)) == 0) {  // 1, 2, 4, 8, ...: the log stays readable under pressure
      logger()->warn(
          "ContextCacheCoordinator: no snapshot slot for a checkpoint of {} tokens; "
          "capture skipped ({} skips so far)",
          exactLength, skips);
    }
    return false;
  }
  try {
    enqueueCapture(sequence, *reservation, exactLength, partial);
  } catch (...) {
    mManager->retireHybridSnapshotReservation(sequence.lease, *reservation);
    throw;
  }
  sequence.staged = Request::Sequence::StagedCapture{*reservation, exactLength};
  ++mCounters.checkpointCaptures;
  return true;
}

void ContextCacheCoordinator::enqueueCapture(Request::Sequence const& sequence,
                                             SnapshotReservation const& reservation,
                                             int32_t exactLength, bool partial) {
  int32_t const pageSize = mManager->pageSize();
  injectFault(CoordinatorFaultSite::kSnapshotCapture);
  mSnapshots->captureRecurrent(reservation.recurrentSlot, sequence.resident.slot, mStream);
  if (partial) {
    PageId const page =
        sequence.lease.basePages()[static_cast<std::size_t>(exactLength / pageSize)];
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->capturePartialKv(*reservation.partialKvSlot, page, exactLength % pageSize, kNoPage,
                                 mStream);
  }
}

void ContextCacheCoordinator::commitCaptures(Request& req) {
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    Request::Sequence& sequence = req.sequences[row];
    if (!sequence.staged) {
      continue;
    }
    Request::Sequence::StagedCapture const staged = *sequence.staged;
    sequence.staged.reset();
    // As publishReady: out of host memory, the checkpoint stays unpublished.
    try {
      PromptBlocks const blocks =
          hashPromptBlocks(prefixOf(sequence, staged.exactLength), mManager->pageSize());
      PublishResult const published =
          mManager->publishHybrid(sequence.lease, blocks, staged.exactLength, staged.reservation);
      if (published.status != PublishStatus::kVerificationRejected) {
        sequence.publishedExact = staged.exactLength;
        ++mCounters.checkpointPublications;
      }
    } catch (std::bad_alloc const&) {
      logger()->warn(
          "ContextCacheCoordinator: out of host memory; the checkpoint of {} tokens of "
          "request {} row {} was not published",
          staged.exactLength, req.id, row);
    }
    // The record (if any) holds the slots now; otherwise they return to the free rings.
    mManager->retireHybridSnapshotReservation(sequence.lease, staged.reservation);
  }
}

// ---------------------------------------------------------------- reuse points

void ContextCacheCoordinator::planReusePoints(Request& req) {
  int32_t const interval = mConfig.checkpointInterval;
  if (interval == 0 || isHybridMtp(req)) {
    return;  // a Hybrid-MTP request publishes its endpoint only
  }
  int32_t const pageSize = mManager->pageSize();
  // Every row's prompt end comes first (enqueuePrefillCaptures reserves it later): points take
  // a slot only while more than one per capturing row stays free or reclaimable.
  int32_t endsToKeep = 0;
  for (auto const& sequence : req.sequences) {
    endsToKeep += sequence.policy == ContextCacheLookupPolicy::kBypass ? 0 : 1;
  }
  ResourcePools const& pools = mManager->pools();
  auto slotsLeft = [&pools] {
    return pools.freeCount(ResourceType::kRecurrentSnapshot) +
           pools.reclaimableCount(ResourceType::kRecurrentSnapshot);
  };
  // Rows of one batch that share a prefix plan its points once.
  std::unordered_set<Hash128, Hash128Hasher> planned;
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    Request::Sequence& sequence = req.sequences[row];
    int32_t const first = (sequence.reuseTokenLength / interval + 1) * interval;
    if (sequence.policy == ContextCacheLookupPolicy::kBypass || first >= sequence.promptLength) {
      continue;
    }
    try {
      auto const points = static_cast<std::size_t>((sequence.promptLength - 1 - first) / interval);
      sequence.reusePoints.reserve(points + 1);
      sequence.reusePointReservations.reserve(points + 1);
      PromptBlocks const blocks =
          hashPromptBlocks(prefixOf(sequence, sequence.promptLength), pageSize);
      for (int32_t position = first; position < sequence.promptLength; position += interval) {
        // A point cached already (another conversation's, or this prompt's earlier turn) or
        // planned by an earlier row needs no copy and must not evict anything.
        Hash128 const digest = exactPrefixDigest(blocks, position);
        if (mManager->records().findHybrid(HybridKey{digest, position, false}) != nullptr ||
            planned.contains(digest)) {
          continue;
        }
        std::optional<SnapshotReservation> reservation;
        if (slotsLeft() > endsToKeep) {
          planned.insert(digest);  // before the reservation: a throw leaves nothing reserved
          reservation =
              mManager->reserveHybridSnapshots(sequence.lease, hasKv() && position % pageSize != 0);
        }
        if (!reservation) {
          uint64_t const skips = ++mCounters.snapshotPressureSkips;
          if ((skips & (skips - 1)) == 0) {
            logger()->warn(
                "ContextCacheCoordinator: no snapshot slot for the reuse point at {} of request "
                "{} row {}; its later points are skipped too ({} skips so far)",
                position, req.id, row, skips);
          }
          break;
        }
        sequence.reusePoints.push_back(ReusePointCapture{position, reservation->recurrentSlot});
        sequence.reusePointReservations.push_back(*reservation);  // capacity reserved: no throw
        ++mCounters.reusePointCaptures;
      }
    } catch (std::bad_alloc const&) {
      logger()->warn(
          "ContextCacheCoordinator: out of host memory; the reuse points of request {} row {} "
          "past {} tokens are not captured",
          req.id, row, sequence.reusePoints.empty() ? first : sequence.reusePoints.back().position);
    }
  }
}

void ContextCacheCoordinator::commitReusePoints(Request& req) {
  int32_t const pageSize = mManager->pageSize();
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    Request::Sequence& sequence = req.sequences[row];
    if (sequence.reusePoints.empty()) {
      continue;
    }
    // As commitCaptures: out of host memory, the remaining points stay unpublished.
    try {
      PromptBlocks const blocks =
          hashPromptBlocks(prefixOf(sequence, sequence.promptLength), pageSize);
      for (std::size_t i = 0; i < sequence.reusePoints.size(); ++i) {
        int32_t const position = sequence.reusePoints[i].position;
        PublishResult const published = mManager->publishHybrid(
            sequence.lease, blocks, position, sequence.reusePointReservations[i], true);
        if (published.status != PublishStatus::kVerificationRejected) {
          sequence.publishedExact = std::max(sequence.publishedExact, position);
        }
        mCounters.reusePointPublications += published.status == PublishStatus::kPublished ? 1U : 0U;
      }
    } catch (std::bad_alloc const&) {
      logger()->warn(
          "ContextCacheCoordinator: out of host memory; reuse points of request {} row {} were "
          "not published",
          req.id, row);
    }
    // The records (if any) hold the slots now; the others return to the free rings.
    for (SnapshotReservation const& reservation : sequence.reusePointReservations) {
      mManager->retireHybridSnapshotReservation(sequence.lease, reservation);
    }
    sequence.reusePoints.clear();
    sequence.reusePointReservations.clear();
  }
}

std::span<ReusePointCapture const> ContextCacheCoordinator::reusePointCaptures(
    RequestHandle const& handle, ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::reusePointCaptures";
  Request const& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling, kCall,
              "reuse points are captured between preparePrefill and finalizePrefillPublication "
              "(row {})",
              row);
  return sequenceAt(req, row, kCall).reusePoints;
}

// ---------------------------------------------------------------- Hybrid-MTP

ContextCacheStatus ContextCacheCoordinator::publishHybridMtpEndpoint(RequestHandle& handle,
                                                                     ExecutionRow row,
                                                                     int32_t residentStateLength,
                                                                     Tensor const& baseHiddenStates,
                                                                     int32_t boundaryHiddenRow) {
  constexpr char const* kCall = "ContextCacheCoordinator::publishHybridMtpEndpoint";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(mProfile.isHybridMtp(), kCall, "the deployment is not Hybrid-MTP (row {}, length {})",
              row, residentStateLength);
  MKV_REQUIRE(req.speculative, kCall, "request {} is not speculative (row {}, length {})", req.id,
              row, residentStateLength);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling, kCall,
              "an endpoint is published between preparePrefill and finalizePrefillPublication");
  Request::Sequence& sequence = sequenceAt(req, row, kCall);
  MKV_REQUIRE(residentStateLength >= 0 && residentStateLength <= sequence.promptLength, kCall,
              "row {}: residentStateLength {} outside [0, prompt {}]", row, residentStateLength,
              sequence.promptLength);
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
    // Cached already (a base-only checkpoint of this length does not count): no copy, no row.
    return ContextCacheStatus::kOk;
  }
  std::optional<SnapshotReservation> const reservation =
      reserveEndpoint(sequence, residentStateLength);
  if (!reservation) {
    return ContextCacheStatus::kOk;
  }
  captureEndpoint(sequence, *reservation, residentStateLength, baseHiddenStates, boundaryHiddenRow);
  if (!synchronize()) {
    return quarantineHandle(handle, req.id);  // the reserved slots stay leased
  }
  commitEndpoint(req, sequence, row, blocks, residentStateLength, *reservation);
  return ContextCacheStatus::kOk;
}

std::optional<SnapshotReservation> ContextCacheCoordinator::reserveEndpoint(
    Request::Sequence& sequence, int32_t residentStateLength) {
  // Reserved with the hit's pins still held, so a std::bad_alloc here changes nothing. Only under
  // pressure are the pins released (the restore copies were enqueued before the captures on the
  // same stream, so a reservation may take over the hit's slots) and the reservation retried.
  std::optional<SnapshotReservation> reservation =
      mManager->reserveHybridSnapshots(sequence.lease, true);
  if (!reservation) {
    mManager->releaseRestoredHybridSnapshots(sequence.lease);
    reservation = mManager->reserveHybridSnapshots(sequence.lease, true);
  }
  if (!reservation) {
    uint64_t const skips = ++mCounters.snapshotPressureSkips;
    if ((skips & (skips - 1)) == 0) {
      logger()->warn(
          "ContextCacheCoordinator: no snapshot slot for a Hybrid-MTP endpoint of {} tokens; "
          "publication skipped ({} skips so far)",
          residentStateLength, skips);
    }
  }
  return reservation;
}

void ContextCacheCoordinator::captureEndpoint(Request::Sequence& sequence,
                                              SnapshotReservation const& reservation,
                                              int32_t residentStateLength,
                                              Tensor const& baseHiddenStates,
                                              int32_t boundaryHiddenRow) {
  int32_t const pageSize = mManager->pageSize();
  int32_t const full = (residentStateLength - 1) / pageSize;
  auto const page = static_cast<std::size_t>(full);
  try {
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->captureRecurrent(reservation.recurrentSlot, sequence.resident.slot, mStream);
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->capturePartialKv(*reservation.partialKvSlot, sequence.lease.basePages()[page],
                                 residentStateLength - full * pageSize,
                                 sequence.lease.draftPages()[page], mStream);
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->captureBoundaryHidden(reservation.recurrentSlot, baseHiddenStates,
                                      boundaryHiddenRow, mStream);
  } catch (...) {
    // Copies already enqueued into the slots are stream-ordered before any later use of them.
    mManager->retireHybridSnapshotReservation(sequence.lease, reservation);
    throw;
  }
  // The endpoint supersedes the hit: its pins go now (restoreHybridMtpBoundaryHidden is over).
  mManager->releaseRestoredHybridSnapshots(sequence.lease);
  ++mCounters.checkpointCaptures;
}

void ContextCacheCoordinator::commitEndpoint(Request const& req, Request::Sequence& sequence,
                                             ExecutionRow row, PromptBlocks const& blocks,
                                             int32_t residentStateLength,
                                             SnapshotReservation const& reservation) {
  try {
    PublishResult const published =
        mManager->publishHybridMtp(sequence.lease, blocks, residentStateLength, reservation);
    if (published.status != PublishStatus::kVerificationRejected) {
      sequence.publishedExact = residentStateLength;
      ++mCounters.hybridMtpPublications;
    }
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the Hybrid-MTP endpoint of {} tokens of "
        "request {} row {} was not published",
        residentStateLength, req.id, row);
  }
  mManager->retireHybridSnapshotReservation(sequence.lease, reservation);
}

void ContextCacheCoordinator::restoreHybridMtpBoundaryHidden(RequestHandle& handle,
                                                             ExecutionRow row,
                                                             Tensor& baseHiddenStates,
                                                             int32_t destinationRow) {
  constexpr char const* kCall = "ContextCacheCoordinator::restoreHybridMtpBoundaryHidden";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(mProfile.isHybridMtp(), kCall,
              "the deployment is not Hybrid-MTP (row {}, destination row {})", row, destinationRow);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling, kCall,
              "the boundary hidden row is restored between preparePrefill and the endpoint's "
              "publication");
  Request::Sequence const& sequence = sequenceAt(req, row, kCall);
  std::optional<SnapshotSlot> const recurrent = sequence.lease.recurrentSnapshotSlot();
  MKV_REQUIRE(sequence.lease.mode() == ReuseMode::kHybridMtp && recurrent.has_value(), kCall,
              "row {} restored no Hybrid-MTP checkpoint (reuse {}){}", row,
              sequence.reuseTokenLength,
              sequence.lease.mode() == ReuseMode::kHybridMtp && sequence.reuseTokenLength > 0
                  ? ", or its pins were released by the endpoint's publication"
                  : "");
  detail::validateHiddenRow(kCall, mProfile, mDevice, baseHiddenStates, destinationRow);
  mSnapshots->restoreBoundaryHidden(*recurrent, baseHiddenStates, destinationRow, mStream);
  ++mCounters.boundaryHiddenRestores;
}

}  // namespace mkv
