#pragma once
/// \file loop_aware_eviction_policy.h
/// S3-FIFO over published records whose admission turns loop-resistant while the cache thrashes
/// (docs/context_cache.md, "Eviction policies").
///
/// Thread-safety: single writer.

#include <cstdint>

#include "context_cache/eviction_policy.h"
#include "context_cache/s3fifo_eviction_policy.h"

namespace mkv {

/// S3-FIFO (small queue, main queue with counters, ghost of keys; S3FifoEvictionPolicy does the
/// ordering) with one change to admission. S3-FIFO admits a record whose publishing request's
/// lookup stopped at a recently evicted block (the `evictedPrefix` hint) to the main queue: the
/// cache let that prefix go too early. That is right while returning prefixes mostly still hit,
/// and wrong when the traffic loops over more conversations than the cache holds: then every
/// returning conversation has been evicted, each one admitted to the main queue pushes out the
/// resident conversation that returns next, and nothing hits (LRU's loop pathology).
///
/// The policy keeps two moving averages over publications (weight 1/64 each, fixed point): the
/// share of records whose request returned to an evicted prefix, and the share whose request
/// reused cached blocks without stopping at an evicted one (a return within the cache's reach).
/// While the first exceeds the second the cache is thrashing, and a record with the
/// `evictedPrefix` hint enters the small queue instead once the main queue holds its share of the
/// weight (as LIRS keeps a block whose reuse distance exceeds the resident set's out of that set,
/// once the set is full): it leaves first, and the conversations already resident stay until they
/// return and hit. Otherwise admission is S3-FIFO's, so traffic that does not thrash sees
/// S3-FIFO's order exactly.
///
/// Events are S3-FIFO's plus O(1) arithmetic per insert.
class LoopAwareEvictionPolicy final : public EvictionPolicy {
 public:
  /// Fixed point of the moving averages (1.0 = kOne) and their weight (1 / 2^kShift).
  static constexpr int32_t kOne = 1 << 16;
  static constexpr int32_t kShift = 6;

  /// ghostCapacity: keys the S3-FIFO ghost remembers after eviction from the small queue.
  explicit LoopAwareEvictionPolicy(int32_t ghostCapacity);

  EvictionPolicyKind kind() const noexcept override { return EvictionPolicyKind::kLoopAware; }
  void reserveSlots(int32_t slots) override { mOrder.reserveSlots(slots); }
  void onInsert(PolicyInsert const& insert) noexcept override;
  void onHit(RecordSlot slot) noexcept override { mOrder.onHit(slot); }
  void onErase(RecordSlot slot, bool evicted) noexcept override { mOrder.onErase(slot, evicted); }
  void onPriorityChange(RecordSlot slot, int32_t priority) noexcept override {
    mOrder.onPriorityChange(slot, priority);
  }
  bool walkVictims(SlotVisitor visit) const override { return mOrder.walkVictims(visit); }

  /// Observers for tests.
  bool thrashing() const noexcept { return mEvictedReturns > mResidentReturns; }
  bool inMainQueue(RecordSlot slot) const noexcept { return mOrder.inMainQueue(slot); }

 private:
  S3FifoEvictionPolicy mOrder;
  int32_t mEvictedReturns = 0;  ///< moving share of inserts with the evictedPrefix hint
  int32_t mResidentReturns =
      0;  ///< moving share of inserts that reused, not stopping at an eviction
};

}  // namespace mkv
