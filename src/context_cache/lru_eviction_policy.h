#pragma once
/// \file lru_eviction_policy.h
/// Least recently used first, within each retention priority.
///
/// Thread-safety: single writer.

#include <array>
#include <cstdint>
#include <vector>

#include "context_cache/eviction_policy.h"
#include "context_cache/slot_list.h"

namespace mkv {

/// One list per priority, oldest first: an insertion or a hit makes a record the newest of its
/// priority. The `reused` and `evictedPrefix` hints are ignored. Every event is O(1); the walk
/// visits the priorities from the lowest, each list from its oldest record.
class LruEvictionPolicy final : public EvictionPolicy {
 public:
  EvictionPolicyKind kind() const noexcept override { return EvictionPolicyKind::kLru; }
  void reserveSlots(int32_t slots) override;
  void onInsert(PolicyInsert const& insert) noexcept override;
  void onHit(RecordSlot slot) noexcept override;
  void onErase(RecordSlot slot, bool evicted) noexcept override;
  void onPriorityChange(RecordSlot slot, int32_t priority) noexcept override;
  bool walkVictims(SlotVisitor visit) const override;

 private:
  SlotList& listOf(RecordSlot slot) noexcept;

  SlotLinks mLinks;
  std::vector<int32_t> mPriority;  ///< per slot
  std::array<SlotList, kMaxRetentionPriority + 1> mLists;
};

}  // namespace mkv
