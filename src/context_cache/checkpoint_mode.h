#pragma once
/// \file checkpoint_mode.h
/// Requests of a deployment with recurrent layers (hybrid, pure recurrent): their state is not
/// prefix-closed, so they reuse exact checkpoints (the recurrent rows, and with attention the
/// partial last page) instead of blocks: at prompt and decode ends, and at the reuse points of
/// ContextCacheConfig::checkpointInterval (docs/context_cache.md, "Checkpoints", "Reuse points").

#include <optional>
#include <unordered_set>

#include "context_cache/request_mode.h"

namespace mkv::detail {

class CheckpointMode : public RequestMode {
 public:
  /// `lanes`: the base lane with attention, none on a pure-recurrent deployment.
  CheckpointMode(CoordinatorParts const& parts, std::vector<RowLane> lanes, ReuseMode lookupMode,
                 CommonLengths commonLengths = CommonLengths::kNone);

  /// Restores each hit's checkpoint and clears the rows that start cold; plans reuse points.
  void bindPrefill(CoordinatorRequest& req) const override;
  void enqueuePrefillCaptures(CoordinatorRequest& req) const override;
  /// Releases the restored snapshots' pins, then commits the reuse points and the prompt end.
  void publishPrefill(CoordinatorRequest& req) const override;
  /// A joiner: its row bound, its hit's checkpoint restored (or its recurrent row cleared), its
  /// reuse points planned.
  void bindJoiner(CoordinatorRequest& req) const override;
  /// A capture of the joiner's state at the chunk's end (a reuse point), while a snapshot slot
  /// beyond the one its prompt end needs is free or reclaimable.
  void publishChunk(CoordinatorRequest& req, std::size_t row) const override;
  /// Enqueues the joiner's prompt-end capture; true when it has restores or captures to settle.
  bool stageJoinerPrefill(CoordinatorRequest& req, std::size_t row) const override;
  /// Releases the restored snapshots' pins, then commits the joiner's reuse points and chunk
  /// ends (ascending) and its prompt end.
  void publishJoinerPrefill(CoordinatorRequest& req, std::size_t row) const override;
  bool growLease(CacheRequestLease& lease, LaneCounts const& pages) const override;
  /// Stages a capture of each completed row's exact state (its snapshot copies enqueued).
  bool stageCompleted(CoordinatorRequest& req, std::span<uint8_t const> completed) const override;
  void commitStaged(CoordinatorRequest& req) const override;

 protected:
  /// Restores `sequence`'s partial last page from `slot` (a hit of `reuse` tokens).
  virtual void restorePartialKv(CoordinatorSequence const& sequence, SnapshotSlot slot) const;
  /// Restores the hits' checkpoints; then clears the recurrent rows in `cold`.
  void restoreCheckpoints(CoordinatorRequest& req, std::span<CacheSlot const> cold) const;
  /// Restores `sequence`'s hit checkpoint; false when its lease hit none.
  bool restoreCheckpoint(CoordinatorSequence const& sequence) const;
  /// The newest joiner: binds its row and restores its hit (a cold one's recurrent row cleared).
  void bindJoinerRow(CoordinatorRequest& req) const;
  /// Warns at the 1st, 2nd, 4th, ... skip for want of a snapshot slot (`what` names it).
  void countPressureSkip(char const* what, int32_t length) const;

  SnapshotStorage& mSnapshotStorage;
  bool mPartialKv;  ///< attention: an exact length inside a page keeps its partial page

 private:
  using StagedCapture = CoordinatorSequence::StagedCapture;

  bool stageCapture(CoordinatorRequest& req, std::size_t row, int32_t exactLength) const;
  std::optional<StagedCapture> capture(CoordinatorRequest& req, std::size_t row,
                                       int32_t exactLength) const;
  void enqueueCapture(CoordinatorSequence const& sequence, SnapshotReservation const& reservation,
                      int32_t exactLength, bool partial) const;
  /// Recurrent snapshot slots free or reclaimable now.
  int32_t snapshotSlotsLeft() const;
  /// ReusePointAdmission::kBranchFirst with a checkpoint interval (without one the setting
  /// changes nothing): points kept on speculation rank below the proven records.
  bool branchFirst() const noexcept;
  /// Under kBranchFirst, where `sequence`'s prompt branches from cached content (the end of the
  /// block prefix the index held at admission) when its reuse stops short of it; else 0.
  int32_t branchPoint(CoordinatorSequence const& sequence) const noexcept;
  /// Under kBranchFirst, the speculation rank of a point at `position` (nullopt for the branch
  /// point, which is kept on evidence): r for an interval point at (2^r x odd) intervals, 0 for
  /// a chunk end off the interval's grid. docs/context_cache.md, "Reuse points".
  std::optional<int32_t> speculationRank(int32_t position, int32_t branch) const noexcept;
  void planReusePoints(CoordinatorRequest& req) const;
  void planRowReusePoints(CoordinatorRequest& req, std::size_t row, int32_t endsToKeep,
                          std::unordered_set<Hash128, Hash128Hasher>& planned) const;
  void commitReusePoints(CoordinatorRequest& req, std::size_t row) const;
  void commitStagedRow(CoordinatorRequest& req, std::size_t row) const;
};

}  // namespace mkv::detail
