#pragma once
/// \file slot_list.h
/// Intrusive doubly linked lists over record slots, for the eviction policies: the links live in
/// two per-slot arrays shared by every list of one policy, so pushing, moving and unlinking are
/// O(1) and allocate nothing.
///
/// Thread-safety: plain data.

#include <cstdint>
#include <vector>

#include "context_cache/eviction_policy.h"

namespace mkv {

/// The links of every slot (a slot is on at most one list at a time).
struct SlotLinks {
  std::vector<RecordSlot> older;  ///< towards the list's oldest end; kNoRecordSlot at the end
  std::vector<RecordSlot> newer;

  /// Strong guarantee: both arrays grow or neither does.
  void resize(std::size_t slots);
};

/// One list: oldest (evicted first) to newest.
struct SlotList {
  RecordSlot oldest = kNoRecordSlot;
  RecordSlot newest = kNoRecordSlot;
  int32_t count = 0;

  void pushNewest(SlotLinks& links, RecordSlot slot) noexcept;
  void unlink(SlotLinks& links, RecordSlot slot) noexcept;
  bool empty() const noexcept { return count == 0; }
};

}  // namespace mkv
