#include "context_cache/lru_eviction_policy.h"

namespace mkv {

void LruEvictionPolicy::reserveSlots(int32_t slots) {
  auto const n = static_cast<std::size_t>(slots);
  if (n <= mPriority.size()) {
    return;
  }
  std::vector<int32_t> priority = mPriority;
  priority.resize(n, kDefaultRetentionPriority);
  mLinks.resize(n);  // strong guarantee; nothing below throws
  mPriority.swap(priority);
}

SlotList& LruEvictionPolicy::listOf(RecordSlot slot) noexcept {
  return mLists[static_cast<std::size_t>(mPriority[static_cast<std::size_t>(slot)])];
}

void LruEvictionPolicy::onInsert(PolicyInsert const& insert) noexcept {
  mPriority[static_cast<std::size_t>(insert.slot)] = insert.priority;
  listOf(insert.slot).pushNewest(mLinks, insert.slot);
}

void LruEvictionPolicy::onHit(RecordSlot slot) noexcept {
  SlotList& list = listOf(slot);
  list.unlink(mLinks, slot);
  list.pushNewest(mLinks, slot);
}

void LruEvictionPolicy::onErase(RecordSlot slot, bool /*evicted*/) noexcept {
  listOf(slot).unlink(mLinks, slot);
}

void LruEvictionPolicy::onPriorityChange(RecordSlot slot, int32_t priority) noexcept {
  listOf(slot).unlink(mLinks, slot);
  mPriority[static_cast<std::size_t>(slot)] = priority;
  listOf(slot).pushNewest(mLinks, slot);
}

bool LruEvictionPolicy::walkVictims(SlotVisitor visit) const {
  for (SlotList const& list : mLists) {
    for (RecordSlot slot = list.oldest; slot != kNoRecordSlot;) {
      RecordSlot const next = mLinks.newer[static_cast<std::size_t>(slot)];
      if (visit(slot)) {
        return true;
      }
      slot = next;
    }
  }
  return false;
}

}  // namespace mkv
