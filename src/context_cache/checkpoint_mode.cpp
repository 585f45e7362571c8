// CheckpointMode and HybridMtpMode: requests that reuse exact checkpoints (checkpoint_mode.h,
// hybrid_mtp_mode.h). A capture reserves snapshot slots, enqueues its copies on the stream, and
// is committed as a record only once a synchronisation (or the runtime's, at prefill end) made
// the copies terminal.

#include "context_cache/checkpoint_mode.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <new>
#include <unordered_set>

#include "context_cache/block_reuse_mode.h"
#include "context_cache/hybrid_mtp_mode.h"
#include "core/check.h"
#include "mkv/logging.h"

namespace mkv::detail {

// ---------------------------------------------------------------- CheckpointMode

CheckpointMode::CheckpointMode(CoordinatorParts const& parts, std::vector<RowLane> lanes,
                               ReuseMode lookupMode, CommonLengths commonLengths)
    : RequestMode(parts, std::move(lanes), lookupMode, commonLengths),
      mSnapshotStorage(*parts.snapshots),
      mPartialKv(rows().laneCount() > 0) {}

void CheckpointMode::bindPrefill(CoordinatorRequest& req) const {
  std::vector<CacheSlot> cold;  // rows that start from the empty state
  cold.reserve(req.sequences.size());
  for (auto const& sequence : req.sequences) {
    if (!sequence.lease.recurrentSnapshotSlot()) {
      cold.push_back(sequence.resident.slot);
    }
  }
  rows().bindPrefill(req);
  restoreCheckpoints(req, cold);
  planReusePoints(req);
}

void CheckpointMode::restoreCheckpoints(CoordinatorRequest& req,
                                        std::span<CacheSlot const> cold) const {
  for (auto const& sequence : req.sequences) {
    restoreCheckpoint(sequence);
  }
  if (!cold.empty()) {
    mParts.recurrent->clearResidentSlots(cold, mParts.stream);
  }
}

bool CheckpointMode::restoreCheckpoint(CoordinatorSequence const& sequence) const {
  std::optional<SnapshotSlot> const recurrent = sequence.lease.recurrentSnapshotSlot();
  if (!recurrent) {
    return false;
  }
  mSnapshotStorage.restoreRecurrent(*recurrent, sequence.resident.slot, mParts.stream);
  if (std::optional<SnapshotSlot> const partial = sequence.lease.partialKvSnapshotSlot()) {
    restorePartialKv(sequence, *partial);
  }
  // Counted once both copies were enqueued (a copy that throws leaves the counters as they were).
  CacheRecord const* hit = mParts.manager.records().get(sequence.lease.hitRecord());
  mParts.counters.reusePointRestores += hit != nullptr && hit->reusePoint ? 1U : 0U;
  ++mParts.counters.checkpointRestores;
  return true;
}

void CheckpointMode::restorePartialKv(CoordinatorSequence const& sequence,
                                      SnapshotSlot slot) const {
  int32_t const pageSize = mParts.manager.pageSize();
  int32_t const reuse = sequence.reuseTokenLength;
  PageId const page = sequence.lease.basePages()[static_cast<std::size_t>(reuse / pageSize)];
  mSnapshotStorage.restorePartialKv(slot, page, reuse % pageSize, kNoPage, mParts.stream);
}

void CheckpointMode::enqueuePrefillCaptures(CoordinatorRequest& req) const {
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    if (!req.sequences[row].prefillHeld) {  // a held founder's state is not at its prompt end
      stageCapture(req, row, req.sequences[row].promptLength);  // a staged row is skipped
    }
  }
}

void CheckpointMode::publishPrefill(CoordinatorRequest& req) const {
  // A founder whose prefill goes on in chunks (not joined) keeps its restored checkpoint's pins,
  // its reuse points and chunk ends until it finalises (publishJoinerPrefill).
  for (auto& sequence : req.sequences) {
    if (sequence.joined) {
      mParts.manager.releaseRestoredHybridSnapshots(sequence.lease);
      mParts.counters.prefillPublications += sequence.staged ? 1U : 0U;
    }
  }
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    if (req.sequences[row].joined) {
      commitReusePoints(req, row);  // ascending: the points, then the prompt end
    }
  }
  commitStaged(req);
}

void CheckpointMode::bindJoiner(CoordinatorRequest& req) const {
  bindJoinerRow(req);
  std::unordered_set<Hash128, Hash128Hasher> planned;
  planRowReusePoints(req, req.sequences.size() - 1, /*endsToKeep=*/1, planned);
}

void CheckpointMode::bindJoinerRow(CoordinatorRequest& req) const {
  RequestMode::bindJoiner(req);
  CoordinatorSequence const& joiner = req.sequences.back();
  if (!restoreCheckpoint(joiner)) {  // cold: its resident row must not keep a former owner's state
    CacheSlot const slot = joiner.resident.slot;
    mParts.recurrent->clearResidentSlots(std::span(&slot, 1), mParts.stream);
  }
}

void CheckpointMode::publishChunk(CoordinatorRequest& req, std::size_t row) const {
  CoordinatorSequence& sequence = req.sequences[row];
  int32_t const length = sequence.committed;
  if (sequence.policy == ContextCacheLookupPolicy::kBypass || length == sequence.promptLength ||
      std::ranges::any_of(sequence.reusePoints, [&](ReusePointCapture const& point) {
        return point.position == length;
      })) {
    return;  // the prompt end (finalisation captures it), or a point the engine captures
  }
  if (snapshotSlotsLeft() <= 1) {  // the prompt end keeps its slot
    countPressureSkip("a prefill chunk's end", length);
    return;
  }
  try {
    sequence.chunkEnds.reserve(sequence.chunkEnds.size() + 1);
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the chunk end at {} tokens of request {} "
        "row {} is not captured",
        length, req.id, row);
    return;
  }
  if (std::optional<StagedCapture> const staged = capture(req, row, length)) {
    sequence.chunkEnds.push_back(*staged);  // capacity reserved: no throw
    ++mParts.counters.chunkEndCaptures;
  }
}

bool CheckpointMode::stageJoinerPrefill(CoordinatorRequest& req, std::size_t row) const {
  stageCapture(req, row, req.sequences[row].promptLength);
  CoordinatorSequence const& sequence = req.sequences[row];
  return sequence.staged || !sequence.reusePoints.empty() || !sequence.chunkEnds.empty() ||
         sequence.lease.recurrentSnapshotSlot();
}

void CheckpointMode::publishJoinerPrefill(CoordinatorRequest& req, std::size_t row) const {
  CoordinatorSequence& sequence = req.sequences[row];
  mParts.manager.releaseRestoredHybridSnapshots(sequence.lease);
  mParts.counters.prefillPublications += sequence.staged ? 1U : 0U;
  commitReusePoints(req, row);
  commitStagedRow(req, row);
}

bool CheckpointMode::growLease(CacheRequestLease& lease, LaneCounts const& pages) const {
  return mParts.manager.growBasePages(lease, pages[0]);
}

bool CheckpointMode::stageCompleted(CoordinatorRequest& req,
                                    std::span<uint8_t const> completed) const {
  bool staged = false;
  for (std::size_t row = 0; row < completed.size(); ++row) {
    if (completed[row] != 0 && stageCapture(req, row, req.sequences[row].committed)) {
      ++mParts.counters.decodePublications;
      staged = true;
    }
  }
  if (staged) {
    ++mParts.counters.captureSynchronizations;  // the copies read state the step just wrote
  }
  return staged;
}

void CheckpointMode::countPressureSkip(char const* what, int32_t length) const {
  uint64_t const skips = ++mParts.counters.snapshotPressureSkips;
  if ((skips & (skips - 1)) == 0) {  // 1, 2, 4, 8, ...: the log stays readable under pressure
    logger()->warn(
        "ContextCacheCoordinator: no snapshot slot for {} of {} tokens; skipped ({} skips so far)",
        what, length, skips);
  }
}

// Reserves the slots of row `row`'s checkpoint at `exactLength` and enqueues its copies as the
// row's staged capture; false when the row bypasses the cache, has one staged already, or
// capture() declines.
bool CheckpointMode::stageCapture(CoordinatorRequest& req, std::size_t row,
                                  int32_t exactLength) const {
  CoordinatorSequence& sequence = req.sequences[row];
  if (sequence.staged) {
    return false;
  }
  sequence.staged = capture(req, row, exactLength);
  return sequence.staged.has_value();
}

// Reserves the slots of row `row`'s checkpoint at `exactLength` and enqueues its copies; nullopt
// when the row bypasses the cache, has the length published, it is cached already, or no slot is
// free. A throw (a failed launch) leaves nothing reserved.
std::optional<CoordinatorSequence::StagedCapture> CheckpointMode::capture(
    CoordinatorRequest& req, std::size_t row, int32_t exactLength) const {
  CoordinatorSequence& sequence = req.sequences[row];
  if (sequence.policy == ContextCacheLookupPolicy::kBypass ||
      exactLength <= sequence.publishedExact) {
    return std::nullopt;
  }
  int32_t const pageSize = mParts.manager.pageSize();
  bool const partial = mPartialKv && exactLength % pageSize != 0;
  std::optional<SnapshotReservation> reservation;
  try {
    PromptBlocks const blocks = hashPromptBlocks(prefixOf(sequence, exactLength), pageSize);
    Hash128 const digest = exactPrefixDigest(blocks, exactLength);
    RecordStore const& records = mParts.manager.records();
    if (records.findHybrid(HybridKey{digest, exactLength, false}) != nullptr ||
        (partial && records.findHybrid(HybridKey{digest, exactLength, true}) != nullptr)) {
      return std::nullopt;
    }
    reservation = mParts.manager.reserveHybridSnapshots(sequence.lease, partial);
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the checkpoint of {} tokens of "
        "request {} row {} is not captured",
        exactLength, req.id, row);
    return std::nullopt;
  }
  if (!reservation) {
    countPressureSkip("a checkpoint", exactLength);
    return std::nullopt;
  }
  try {
    enqueueCapture(sequence, *reservation, exactLength, partial);
  } catch (...) {
    mParts.manager.retireHybridSnapshotReservation(sequence.lease, *reservation);
    throw;
  }
  ++mParts.counters.checkpointCaptures;
  return StagedCapture{*reservation, exactLength};
}

void CheckpointMode::enqueueCapture(CoordinatorSequence const& sequence,
                                    SnapshotReservation const& reservation, int32_t exactLength,
                                    bool partial) const {
  int32_t const pageSize = mParts.manager.pageSize();
  mParts.injectFault(FaultSite::kSnapshotCapture);
  mSnapshotStorage.captureRecurrent(reservation.recurrentSlot, sequence.resident.slot,
                                    mParts.stream);
  if (partial) {
    PageId const page =
        sequence.lease.basePages()[static_cast<std::size_t>(exactLength / pageSize)];
    mParts.injectFault(FaultSite::kSnapshotCapture);
    mSnapshotStorage.capturePartialKv(*reservation.partialKvSlot, page, exactLength % pageSize,
                                      kNoPage, mParts.stream);
  }
}

void CheckpointMode::commitStaged(CoordinatorRequest& req) const {
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    commitStagedRow(req, row);
  }
}

void CheckpointMode::commitStagedRow(CoordinatorRequest& req, std::size_t row) const {
  CoordinatorSequence& sequence = req.sequences[row];
  if (!sequence.staged) {
    return;
  }
  StagedCapture const staged = *sequence.staged;
  sequence.staged.reset();
  try {
    PromptBlocks const blocks =
        hashPromptBlocks(prefixOf(sequence, staged.exactLength), mParts.manager.pageSize());
    PublishResult const published = mParts.manager.publishHybrid(
        sequence.lease, blocks, staged.exactLength, staged.reservation);
    if (published.status != PublishStatus::kVerificationRejected) {
      sequence.publishedExact = staged.exactLength;
      ++mParts.counters.checkpointPublications;
      if (branchFirst()) {  // the checkpoint this row restored is superseded for its line
        mParts.manager.supersedeHit(sequence.lease, staged.exactLength);
      }
    }
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the checkpoint of {} tokens of "
        "request {} row {} was not published",
        staged.exactLength, req.id, row);
  }
  mParts.manager.retireHybridSnapshotReservation(sequence.lease, staged.reservation);
}

bool CheckpointMode::branchFirst() const noexcept {
  return mParts.config.checkpointInterval > 0 &&
         mParts.config.reusePointAdmission == ReusePointAdmission::kBranchFirst;
}

std::optional<int32_t> CheckpointMode::speculationRank(int32_t position,
                                                       int32_t branch) const noexcept {
  if (!branchFirst() || position == branch) {
    return std::nullopt;
  }
  int32_t const interval = mParts.config.checkpointInterval;
  if (position % interval != 0) {  // branchFirst(): interval > 0
    return 0;
  }
  return reusePointRank(position / interval);
}

int32_t CheckpointMode::branchPoint(CoordinatorSequence const& sequence) const noexcept {
  if (!branchFirst()) {
    return 0;
  }
  int32_t const branch = sequence.cachedPrefixBlocks * mParts.manager.pageSize();
  return branch > sequence.reuseTokenLength && branch < sequence.promptLength ? branch : 0;
}

int32_t CheckpointMode::snapshotSlotsLeft() const {
  ResourcePools const& pools = mParts.manager.pools();
  return pools.freeCount(ResourceType::kRecurrentSnapshot) +
         pools.reclaimableCount(ResourceType::kRecurrentSnapshot);
}

// Reserves a recurrent snapshot slot for every multiple of the interval past a row's reuse length
// and short of its prompt end (docs/context_cache.md, "Reuse points"). Points already cached, or
// planned by an earlier row of the batch, are skipped; points stop while no more than one slot
// per capturing row would stay free or reclaimable, so that the prompt ends keep theirs.
void CheckpointMode::planReusePoints(CoordinatorRequest& req) const {
  if (mParts.config.checkpointInterval == 0) {
    return;
  }
  int32_t endsToKeep = 0;
  for (auto const& sequence : req.sequences) {
    endsToKeep += sequence.policy == ContextCacheLookupPolicy::kBypass ? 0 : 1;
  }
  std::unordered_set<Hash128, Hash128Hasher> planned;
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    planRowReusePoints(req, row, endsToKeep, planned);
  }
}

void CheckpointMode::planRowReusePoints(CoordinatorRequest& req, std::size_t row,
                                        int32_t endsToKeep,
                                        std::unordered_set<Hash128, Hash128Hasher>& planned) const {
  int32_t const interval = mParts.config.checkpointInterval;
  CoordinatorSequence& sequence = req.sequences[row];
  if (interval == 0) {
    return;
  }
  int32_t const pageSize = mParts.manager.pageSize();
  int32_t const first = (sequence.reuseTokenLength / interval + 1) * interval;
  int32_t const branch = branchPoint(sequence);
  if (sequence.policy == ContextCacheLookupPolicy::kBypass ||
      (first >= sequence.promptLength && branch == 0)) {
    return;
  }
  try {
    std::vector<int32_t> positions;
    for (int32_t position = first; position < sequence.promptLength; position += interval) {
      positions.push_back(position);
    }
    if (branch != 0 && branch % interval != 0) {  // ascending: the branch among the multiples
      positions.insert(std::upper_bound(positions.begin(), positions.end(), branch), branch);
    }
    sequence.reusePoints.reserve(positions.size());
    sequence.reusePointReservations.reserve(positions.size());
    PromptBlocks const blocks =
        hashPromptBlocks(prefixOf(sequence, sequence.promptLength), pageSize);
    for (int32_t position : positions) {
      Hash128 const digest = exactPrefixDigest(blocks, position);
      if (mParts.manager.records().findHybrid(HybridKey{digest, position, false}) != nullptr ||
          planned.contains(digest)) {
        continue;
      }
      std::optional<SnapshotReservation> reservation;
      if (snapshotSlotsLeft() > endsToKeep) {
        planned.insert(digest);  // before the reservation: a throw leaves nothing reserved
        reservation = mParts.manager.reserveHybridSnapshots(sequence.lease,
                                                            mPartialKv && position % pageSize != 0);
      }
      if (!reservation) {
        countPressureSkip("a reuse point (and the row's later ones)", position);
        break;
      }
      sequence.reusePoints.push_back(ReusePointCapture{position, reservation->recurrentSlot});
      sequence.reusePointReservations.push_back(*reservation);  // capacity reserved: no throw
      ++mParts.counters.reusePointCaptures;
    }
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the reuse points of request {} row {} "
        "past {} tokens are not captured",
        req.id, row, sequence.reusePoints.empty() ? first : sequence.reusePoints.back().position);
  }
}

// Publishes the row's reuse points the engine captured and the chunk ends the coordinator
// captured, in ascending order, and retires their reservations.
void CheckpointMode::commitReusePoints(CoordinatorRequest& req, std::size_t row) const {
  CoordinatorSequence& sequence = req.sequences[row];
  if (sequence.reusePoints.empty() && sequence.chunkEnds.empty()) {
    return;
  }
  int32_t const pageSize = mParts.manager.pageSize();
  int32_t const branch = branchPoint(sequence);
  try {
    PromptBlocks const blocks =
        hashPromptBlocks(prefixOf(sequence, sequence.promptLength), pageSize);
    std::size_t point = 0;
    std::size_t chunk = 0;
    while (point < sequence.reusePoints.size() || chunk < sequence.chunkEnds.size()) {
      bool const takePoint =
          chunk == sequence.chunkEnds.size() ||
          (point < sequence.reusePoints.size() &&
           sequence.reusePoints[point].position < sequence.chunkEnds[chunk].exactLength);
      int32_t const position =
          takePoint ? sequence.reusePoints[point].position : sequence.chunkEnds[chunk].exactLength;
      SnapshotReservation const& reservation = takePoint ? sequence.reusePointReservations[point++]
                                                         : sequence.chunkEnds[chunk++].reservation;
      PublishResult const published = mParts.manager.publishHybrid(
          sequence.lease, blocks, position, reservation, true, speculationRank(position, branch));
      if (published.status != PublishStatus::kVerificationRejected) {
        sequence.publishedExact = std::max(sequence.publishedExact, position);
      }
      mParts.counters.reusePointPublications +=
          published.status == PublishStatus::kPublished ? 1U : 0U;
    }
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; reuse points of request {} row {} were "
        "not published",
        req.id, row);
  }
  for (SnapshotReservation const& reservation : sequence.reusePointReservations) {
    mParts.manager.retireHybridSnapshotReservation(sequence.lease, reservation);
  }
  for (StagedCapture const& staged : sequence.chunkEnds) {
    mParts.manager.retireHybridSnapshotReservation(sequence.lease, staged.reservation);
  }
  sequence.reusePoints.clear();
  sequence.reusePointReservations.clear();
  sequence.chunkEnds.clear();
}

// ---------------------------------------------------------------- HybridMtpMode

HybridMtpMode::HybridMtpMode(CoordinatorParts const& parts, std::vector<RowLane> lanes)
    : CheckpointMode(parts, std::move(lanes), ReuseMode::kHybridMtp, CommonLengths::kOptional) {}

void HybridMtpMode::bindPrefill(CoordinatorRequest& req) const {
  std::vector<CacheSlot> cold;
  cold.reserve(req.sequences.size());
  for (auto const& sequence : req.sequences) {
    if (!sequence.lease.recurrentSnapshotSlot()) {
      cold.push_back(sequence.resident.slot);
    }
  }
  rows().bindPrefill(req);
  restoreCheckpoints(req, cold);  // a Hybrid-MTP request publishes its endpoints only
}

void HybridMtpMode::bindJoiner(CoordinatorRequest& req) const { bindJoinerRow(req); }

bool HybridMtpMode::stageJoinerPrefill(CoordinatorRequest& req, std::size_t row) const {
  return req.sequences[row].lease.recurrentSnapshotSlot().has_value();
}

void HybridMtpMode::restorePartialKv(CoordinatorSequence const& sequence, SnapshotSlot slot) const {
  int32_t const pageSize = mParts.manager.pageSize();
  int32_t const reuse = sequence.reuseTokenLength;
  auto const index = static_cast<std::size_t>((reuse - 1) / pageSize);
  mSnapshotStorage.restorePartialKv(slot, sequence.lease.basePages()[index],
                                    reuse - static_cast<int32_t>(index) * pageSize,
                                    sequence.lease.draftPages()[index], mParts.stream);
}

void HybridMtpMode::updateCommonLengths(CoordinatorRequest& req,
                                        std::span<ContextCacheSequenceAdvance const> advances,
                                        std::span<int32_t const> lengths) const {
  advanceCommonLengths(req, advances, lengths);
}

bool HybridMtpMode::growLease(CacheRequestLease& lease, LaneCounts const& pages) const {
  return mParts.manager.growSpecPages(lease, pages[0], pages[1]);
}

std::optional<SnapshotReservation> HybridMtpMode::reserveEndpoint(
    CoordinatorSequence& sequence, int32_t residentStateLength) const {
  std::optional<SnapshotReservation> reservation =
      mParts.manager.reserveHybridSnapshots(sequence.lease, true);
  if (!reservation) {
    mParts.manager.releaseRestoredHybridSnapshots(sequence.lease);
    reservation = mParts.manager.reserveHybridSnapshots(sequence.lease, true);
  }
  if (!reservation) {
    countPressureSkip("a Hybrid-MTP endpoint", residentStateLength);
  }
  return reservation;
}

void HybridMtpMode::captureEndpoint(CoordinatorSequence& sequence,
                                    SnapshotReservation const& reservation,
                                    int32_t residentStateLength, Tensor const& baseHiddenStates,
                                    int32_t boundaryHiddenRow) const {
  int32_t const pageSize = mParts.manager.pageSize();
  int32_t const full = (residentStateLength - 1) / pageSize;
  auto const page = static_cast<std::size_t>(full);
  try {
    mParts.injectFault(FaultSite::kSnapshotCapture);
    mSnapshotStorage.captureRecurrent(reservation.recurrentSlot, sequence.resident.slot,
                                      mParts.stream);
    mParts.injectFault(FaultSite::kSnapshotCapture);
    mSnapshotStorage.capturePartialKv(*reservation.partialKvSlot, sequence.lease.basePages()[page],
                                      residentStateLength - full * pageSize,
                                      sequence.lease.draftPages()[page], mParts.stream);
    mParts.injectFault(FaultSite::kSnapshotCapture);
    mSnapshotStorage.captureBoundaryHidden(reservation.recurrentSlot, baseHiddenStates,
                                           boundaryHiddenRow, mParts.stream);
  } catch (...) {
    mParts.manager.retireHybridSnapshotReservation(sequence.lease, reservation);
    throw;
  }
  mParts.manager.releaseRestoredHybridSnapshots(sequence.lease);
  ++mParts.counters.checkpointCaptures;
}

void HybridMtpMode::commitEndpoint(CoordinatorRequest const& req, CoordinatorSequence& sequence,
                                   ExecutionRow row, PromptBlocks const& blocks,
                                   int32_t residentStateLength,
                                   SnapshotReservation const& reservation) const {
  try {
    PublishResult const published =
        mParts.manager.publishHybridMtp(sequence.lease, blocks, residentStateLength, reservation);
    if (published.status != PublishStatus::kVerificationRejected) {
      sequence.publishedExact = residentStateLength;
      ++mParts.counters.hybridMtpPublications;
    }
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the Hybrid-MTP endpoint of {} tokens of "
        "request {} row {} was not published",
        residentStateLength, req.id, row);
  }
  mParts.manager.retireHybridSnapshotReservation(sequence.lease, reservation);
}

void HybridMtpMode::restoreBoundaryHidden(CoordinatorSequence const& /*sequence*/,
                                          SnapshotSlot slot, Tensor& baseHiddenStates,
                                          int32_t destinationRow) const {
  mSnapshotStorage.restoreBoundaryHidden(slot, baseHiddenStates, destinationRow, mParts.stream);
  ++mParts.counters.boundaryHiddenRestores;
}

}  // namespace mkv::detail
