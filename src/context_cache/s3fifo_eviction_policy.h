#pragma once
/// \file s3fifo_eviction_policy.h
/// S3-FIFO (Yang et al., SOSP'23) over published records, within each retention priority.
///
/// Thread-safety: single writer.

#include <array>
#include <cstdint>
#include <vector>

#include "context_cache/eviction_policy.h"
#include "context_cache/recent_digest_set.h"
#include "context_cache/slot_list.h"

namespace mkv {

/// Per priority, a small FIFO for new records and a main FIFO with a frequency counter (0..3);
/// one ghost of the keys of records evicted from the small queue. A one-pass scan of new
/// prefixes stays in the small queue and leaves first, so it does not flush the main queue.
///
/// * insert: into the main queue when the key is in the ghost (an evicted record published
///   again), when the publishing request reused cached blocks, or when its lookup stopped at a
///   recently evicted block (the block index's ghost); into the small queue otherwise.
/// * hit: a small-queue record moves to the main queue (promotion at the hit rather than when it
///   reaches the small queue's end); a main-queue record's counter goes up, to at most 3.
/// * victim order within a priority: the small queue's oldest while its weight (resources of
///   its records) is at least kSmallQueuePercent of the priority's, else the main queue's next
///   record in FIFO order with counter 0; a record with counter c > 0 is passed over c times
///   (each pass decrements it and sends it to the queue's newest end), so the main queue's order
///   is its FIFO order sorted by counter. walkVictims() follows that order without moving
///   anything; an eviction applies the passes over the records before the victim for real.
///
/// Events are O(1) amortised (each pass over a record pays for one earlier hit); the walk costs
/// at most four visits of the main queue's records.
class S3FifoEvictionPolicy final : public EvictionPolicy {
 public:
  static constexpr int32_t kSmallQueuePercent = 10;
  static constexpr uint8_t kMaxFrequency = 3;

  /// ghostCapacity: keys remembered after eviction from the small queue (0 = no ghost).
  explicit S3FifoEvictionPolicy(int32_t ghostCapacity);

  EvictionPolicyKind kind() const noexcept override { return EvictionPolicyKind::kS3Fifo; }
  void reserveSlots(int32_t slots) override;
  void onInsert(PolicyInsert const& insert) noexcept override;
  void onHit(RecordSlot slot) noexcept override;
  void onErase(RecordSlot slot, bool evicted) noexcept override;
  void onPriorityChange(RecordSlot slot, int32_t priority) noexcept override;
  bool walkVictims(SlotVisitor visit) const override;

  /// Observers for tests: whether a record is in the main queue, its counter, the ghost.
  bool inMainQueue(RecordSlot slot) const noexcept { return mSlots[index(slot)].inMain; }
  uint8_t frequency(RecordSlot slot) const noexcept { return mSlots[index(slot)].frequency; }
  bool ghostContains(Hash128 key) const noexcept { return mGhost.contains(key); }
  /// Whether the main queue of `priority` holds less than its share (100 - kSmallQueuePercent %)
  /// of the priority's weight (LoopAwareEvictionPolicy fills it before keeping records out).
  bool mainQueueBelowShare(int32_t priority) const noexcept {
    Level const& level = mLevels[static_cast<std::size_t>(priority)];
    return level.mainWeight * 100 <
           (level.smallWeight + level.mainWeight) * (100 - int64_t{kSmallQueuePercent});
  }

 private:
  struct SlotState {
    Hash128 key;
    int32_t weight = 0;
    int32_t priority = kDefaultRetentionPriority;
    uint8_t frequency = 0;
    bool inMain = false;
  };
  struct Level {
    SlotList small;
    SlotList main;
    int64_t smallWeight = 0;
    int64_t mainWeight = 0;
  };

  static std::size_t index(RecordSlot slot) noexcept { return static_cast<std::size_t>(slot); }
  Level& levelOf(RecordSlot slot) noexcept;
  void push(RecordSlot slot, bool main) noexcept;
  void unlink(RecordSlot slot) noexcept;
  /// What evicting `victim` from the main queue means for the records before it: each is passed
  /// over (counter decremented, moved to the newest end) until `victim` is the oldest with
  /// counter 0.
  void passOverBefore(RecordSlot victim) noexcept;

  SlotLinks mLinks;
  std::vector<SlotState> mSlots;
  std::array<Level, kMaxRetentionPriority + 1> mLevels;
  RecentDigestSet mGhost;
};

}  // namespace mkv
