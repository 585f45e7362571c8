#include "context_cache/loop_aware_eviction_policy.h"

namespace mkv {

namespace {

/// One step of a moving average in fixed point: average += (sample - average) / 2^shift.
int32_t movingAverage(int32_t average, bool sample) noexcept {
  int32_t const target = sample ? LoopAwareEvictionPolicy::kOne : 0;
  return average + (target - average) / (1 << LoopAwareEvictionPolicy::kShift);
}

}  // namespace

LoopAwareEvictionPolicy::LoopAwareEvictionPolicy(int32_t ghostCapacity) : mOrder(ghostCapacity) {}

void LoopAwareEvictionPolicy::onInsert(PolicyInsert const& insert) noexcept {
  mEvictedReturns = movingAverage(mEvictedReturns, insert.evictedPrefix);
  mResidentReturns = movingAverage(mResidentReturns, insert.reused && !insert.evictedPrefix);
  if (insert.evictedPrefix && thrashing() && !mOrder.mainQueueBelowShare(insert.priority)) {
    // A return beyond the cache's reach while it thrashes and the main queue is full: the small
    // queue, unless the ghost remembers the key itself (S3-FIFO checks that).
    PolicyInsert cold = insert;
    cold.reused = false;
    cold.evictedPrefix = false;
    mOrder.onInsert(cold);
    return;
  }
  mOrder.onInsert(insert);
}

}  // namespace mkv
