#pragma once
/// \file checkpoint_mode.h
/// Requests of a deployment with recurrent layers (hybrid, pure recurrent): their state is not
/// prefix-closed, so they reuse exact checkpoints (the recurrent rows, and with attention the
/// partial last page) instead of blocks: at prompt and decode ends, and at the reuse points of
/// ContextCacheConfig::checkpointInterval (docs/context_cache.md, "Checkpoints", "Reuse points").

#include <optional>

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
  bool growLease(CacheRequestLease& lease, LaneCounts const& pages) const override;
  /// Stages a capture of each completed row's exact state (its snapshot copies enqueued).
  bool stageCompleted(CoordinatorRequest& req, std::span<uint8_t const> completed) const override;
  void commitStaged(CoordinatorRequest& req) const override;

 protected:
  /// Restores `sequence`'s partial last page from `slot` (a hit of `reuse` tokens).
  virtual void restorePartialKv(CoordinatorSequence const& sequence, SnapshotSlot slot) const;
  /// Restores the hits' checkpoints; then clears the recurrent rows in `cold`.
  void restoreCheckpoints(CoordinatorRequest& req, std::span<CacheSlot const> cold) const;
  /// Warns at the 1st, 2nd, 4th, ... skip for want of a snapshot slot (`what` names it).
  void countPressureSkip(char const* what, int32_t length) const;

  SnapshotStorage& mSnapshotStorage;
  bool mPartialKv;  ///< attention: an exact length inside a page keeps its partial page

 private:
  bool stageCapture(CoordinatorRequest& req, std::size_t row, int32_t exactLength) const;
  void enqueueCapture(CoordinatorSequence const& sequence, SnapshotReservation const& reservation,
                      int32_t exactLength, bool partial) const;
  void planReusePoints(CoordinatorRequest& req) const;
  void commitReusePoints(CoordinatorRequest& req) const;
};

}  // namespace mkv::detail
