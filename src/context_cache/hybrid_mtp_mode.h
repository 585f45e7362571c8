#pragma once
/// \file hybrid_mtp_mode.h
/// Speculative requests of a hybrid deployment (Hybrid-MTP: an own-KV draft beside a hybrid
/// base). Besides a checkpoint request's decode-end captures, the engine publishes endpoints
/// (recurrent rows, the partial base and draft pages, the boundary hidden row) itself
/// (ContextCacheCoordinator::publishHybridMtpEndpoint), a joiner's as a founder's; prefill
/// captures, chunk ends and reuse points are not made (docs/context_cache.md, "Hybrid-MTP").

#include "context_cache/checkpoint_mode.h"

namespace mkv::detail {

class HybridMtpMode final : public CheckpointMode {
 public:
  /// `lanes`: base, and the draft with a restore lag of 1.
  HybridMtpMode(CoordinatorParts const& parts, std::vector<RowLane> lanes);

  /// Restores the hits' endpoints; no reuse points.
  void bindPrefill(CoordinatorRequest& req) const override;
  void enqueuePrefillCaptures(CoordinatorRequest& /*req*/) const override {}
  /// A joiner: its row, its hit's endpoint restored (or its recurrent row cleared); no reuse
  /// points.
  void bindJoiner(CoordinatorRequest& req) const override;
  /// A chunk's end is not kept: it would need the boundary hidden row there.
  void publishChunk(CoordinatorRequest& /*req*/, std::size_t /*row*/) const override {}
  /// Nothing to capture: the engine published the joiner's endpoint (publishHybridMtpEndpoint).
  /// True while the joiner still pins its hit (no endpoint released it): the restore's copies
  /// must be done before finalisation releases the pins.
  bool stageJoinerPrefill(CoordinatorRequest& req, std::size_t row) const override;
  void updateCommonLengths(CoordinatorRequest& req,
                           std::span<ContextCacheSequenceAdvance const> advances,
                           std::span<int32_t const> lengths) const override;
  bool growLease(CacheRequestLease& lease, LaneCounts const& pages) const override;

  /// An endpoint's snapshot slots (recurrent + partial pages + hidden row), releasing the
  /// restored ones' pins if the pool has none free; nullopt (counted, logged) if still none.
  std::optional<SnapshotReservation> reserveEndpoint(CoordinatorSequence& sequence,
                                                     int32_t residentStateLength) const;
  /// Enqueues the endpoint's copies; a throw retires the reservation.
  void captureEndpoint(CoordinatorSequence& sequence, SnapshotReservation const& reservation,
                       int32_t residentStateLength, Tensor const& baseHiddenStates,
                       int32_t boundaryHiddenRow) const;
  /// After the synchronisation: publishes the endpoint and retires the reservation.
  void commitEndpoint(CoordinatorRequest const& req, CoordinatorSequence& sequence,
                      ExecutionRow row, PromptBlocks const& blocks, int32_t residentStateLength,
                      SnapshotReservation const& reservation) const;
  /// Copies the boundary hidden row of `sequence`'s restored endpoint into `destinationRow`.
  void restoreBoundaryHidden(CoordinatorSequence const& sequence, SnapshotSlot slot,
                             Tensor& baseHiddenStates, int32_t destinationRow) const;

 protected:
  void restorePartialKv(CoordinatorSequence const& sequence, SnapshotSlot slot) const override;
};

}  // namespace mkv::detail
