#include "context_cache/s3fifo_eviction_policy.h"

#include <algorithm>

namespace mkv {

S3FifoEvictionPolicy::S3FifoEvictionPolicy(int32_t ghostCapacity) : mGhost(ghostCapacity) {}

void S3FifoEvictionPolicy::reserveSlots(int32_t slots) {
  auto const n = static_cast<std::size_t>(slots);
  if (n <= mSlots.size()) {
    return;
  }
  std::vector<SlotState> states = mSlots;
  states.resize(n);
  mLinks.resize(n);  // strong guarantee; nothing below throws
  mSlots.swap(states);
}

S3FifoEvictionPolicy::Level& S3FifoEvictionPolicy::levelOf(RecordSlot slot) noexcept {
  return mLevels[static_cast<std::size_t>(mSlots[index(slot)].priority)];
}

void S3FifoEvictionPolicy::push(RecordSlot slot, bool main) noexcept {
  SlotState& state = mSlots[index(slot)];
  Level& level = levelOf(slot);
  state.inMain = main;
  (main ? level.main : level.small).pushNewest(mLinks, slot);
  (main ? level.mainWeight : level.smallWeight) += state.weight;
}

void S3FifoEvictionPolicy::unlink(RecordSlot slot) noexcept {
  SlotState const& state = mSlots[index(slot)];
  Level& level = levelOf(slot);
  (state.inMain ? level.main : level.small).unlink(mLinks, slot);
  (state.inMain ? level.mainWeight : level.smallWeight) -= state.weight;
}

void S3FifoEvictionPolicy::onInsert(PolicyInsert const& insert) noexcept {
  SlotState& state = mSlots[index(insert.slot)];
  state = SlotState{insert.key, std::max(1, insert.weight), insert.priority, 0, false};
  push(insert.slot, insert.reused || insert.evictedPrefix || mGhost.contains(insert.key));
}

void S3FifoEvictionPolicy::onHit(RecordSlot slot) noexcept {
  SlotState& state = mSlots[index(slot)];
  if (!state.inMain) {
    unlink(slot);
    push(slot, /*main=*/true);
  } else if (state.frequency < kMaxFrequency) {
    ++state.frequency;
  }
}

void S3FifoEvictionPolicy::passOverBefore(RecordSlot victim) noexcept {
  SlotList& main = levelOf(victim).main;
  // Terminates: every full turn of the queue decrements the victim's counter.
  while (main.oldest != victim || mSlots[index(victim)].frequency > 0) {
    RecordSlot const passed = main.oldest;
    SlotState& state = mSlots[index(passed)];
    if (state.frequency > 0) {
      --state.frequency;
    }
    main.unlink(mLinks, passed);
    main.pushNewest(mLinks, passed);
  }
}

void S3FifoEvictionPolicy::onErase(RecordSlot slot, bool evicted) noexcept {
  SlotState const& state = mSlots[index(slot)];
  if (evicted) {
    if (state.inMain) {
      passOverBefore(slot);
    } else {
      mGhost.insert(state.key);
    }
  }
  unlink(slot);
}

void S3FifoEvictionPolicy::onPriorityChange(RecordSlot slot, int32_t priority) noexcept {
  bool const main = mSlots[index(slot)].inMain;
  unlink(slot);
  mSlots[index(slot)].priority = priority;
  push(slot, main);
}

bool S3FifoEvictionPolicy::walkVictims(SlotVisitor visit) const {
  for (Level const& level : mLevels) {
    RecordSlot small = level.small.oldest;
    int64_t smallWeight = level.smallWeight;
    int64_t weight = level.smallWeight + level.mainWeight;
    int32_t mainLeft = level.main.count;
    RecordSlot main = level.main.oldest;
    uint8_t pass = 0;
    while (small != kNoRecordSlot || mainLeft > 0) {
      RecordSlot victim = kNoRecordSlot;
      if (small != kNoRecordSlot &&
          (mainLeft == 0 || smallWeight * 100 >= int64_t{kSmallQueuePercent} * weight)) {
        victim = small;
        small = mLinks.newer[index(small)];
        smallWeight -= mSlots[index(victim)].weight;
      } else {
        // The next record of the main queue sorted by counter (pass p visits counter p): the
        // records of counter < p left in earlier passes; mainLeft > 0 bounds p by kMaxFrequency.
        while (main == kNoRecordSlot || mSlots[index(main)].frequency != pass) {
          if (main == kNoRecordSlot) {
            ++pass;
            main = level.main.oldest;
          } else {
            main = mLinks.newer[index(main)];
          }
        }
        victim = main;
        main = mLinks.newer[index(main)];
        --mainLeft;
      }
      weight -= mSlots[index(victim)].weight;
      if (visit(victim)) {
        return true;
      }
    }
  }
  return false;
}

}  // namespace mkv
