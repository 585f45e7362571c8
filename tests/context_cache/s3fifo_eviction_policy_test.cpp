#include "context_cache/s3fifo_eviction_policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "context_cache/lru_eviction_policy.h"
#include "support/victim_order.h"

namespace mkv {
namespace {

using test::victimOrder;

Hash128 keyOf(RecordSlot slot) { return Hash128{0xabcdU, static_cast<uint64_t>(slot) + 1}; }

/// A new record of `weight` resources in `slot`; `reused` as a request that reused cached blocks.
PolicyInsert insertOf(RecordSlot slot, int32_t weight = 1, bool reused = false,
                      int32_t priority = kDefaultRetentionPriority) {
  return PolicyInsert{slot, keyOf(slot), weight, priority, reused, false};
}

class S3FifoEvictionPolicyTest : public ::testing::Test {
 protected:
  S3FifoEvictionPolicyTest() { mPolicy.reserveSlots(32); }
  S3FifoEvictionPolicy mPolicy{64};
};

TEST_F(S3FifoEvictionPolicyTest, NewRecordsWaitInTheSmallQueueAndLeaveInInsertionOrder) {
  for (RecordSlot slot : {2, 0, 1}) {
    mPolicy.onInsert(insertOf(slot));
  }
  EXPECT_FALSE(mPolicy.inMainQueue(0));
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{2, 0, 1}));
}

TEST_F(S3FifoEvictionPolicyTest, AHitPromotesASmallQueueRecordToTheMainQueue) {
  for (RecordSlot slot : {0, 1, 2}) {
    mPolicy.onInsert(insertOf(slot));
  }
  mPolicy.onHit(0);
  EXPECT_TRUE(mPolicy.inMainQueue(0));
  EXPECT_EQ(mPolicy.frequency(0), 0) << "promotion is the hit's whole effect";
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{1, 2, 0}));
  mPolicy.onHit(0);
  mPolicy.onHit(0);
  mPolicy.onHit(0);
  mPolicy.onHit(0);
  EXPECT_EQ(mPolicy.frequency(0), S3FifoEvictionPolicy::kMaxFrequency) << "the counter saturates";
}

TEST_F(S3FifoEvictionPolicyTest, TheSmallQueueLeavesFirstOnlyWhileItHoldsTenPercentOfTheWeight) {
  mPolicy.onInsert(insertOf(0, 10, /*reused=*/true));
  mPolicy.onInsert(insertOf(1, 10, /*reused=*/true));
  mPolicy.onInsert(insertOf(2, 1));
  // Small 1 of 21, then 1 of 11: below 10 %, so the main queue goes first.
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{0, 1, 2}));
  mPolicy.onInsert(insertOf(3, 5));
  // Small 6 of 26, then 5 of 25: both small-queue records go first.
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{2, 3, 0, 1}));
}

TEST_F(S3FifoEvictionPolicyTest, AnEvictedKeyPublishedAgainEntersTheMainQueue) {
  mPolicy.onInsert(insertOf(0));
  mPolicy.onErase(0, /*evicted=*/true);
  EXPECT_TRUE(mPolicy.ghostContains(keyOf(0)));
  mPolicy.onInsert(insertOf(1));
  PolicyInsert again = insertOf(2);
  again.key = keyOf(0);
  mPolicy.onInsert(again);
  EXPECT_TRUE(mPolicy.inMainQueue(2)) << "a ghost hit is re-admitted to the main queue";
  EXPECT_FALSE(mPolicy.inMainQueue(1));
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{1, 2}));

  mPolicy.onInsert(insertOf(3));
  mPolicy.onErase(3, /*evicted=*/false);
  EXPECT_FALSE(mPolicy.ghostContains(keyOf(3))) << "a rolled-back record is not remembered";
}

TEST_F(S3FifoEvictionPolicyTest, ReuseAndAnEvictedPrefixAdmitToTheMainQueue) {
  mPolicy.onInsert(insertOf(0, 1, /*reused=*/true));
  PolicyInsert evictedPrefix = insertOf(1);
  evictedPrefix.evictedPrefix = true;
  mPolicy.onInsert(evictedPrefix);
  mPolicy.onInsert(insertOf(2));
  EXPECT_TRUE(mPolicy.inMainQueue(0));
  EXPECT_TRUE(mPolicy.inMainQueue(1));
  EXPECT_FALSE(mPolicy.inMainQueue(2));
}

TEST_F(S3FifoEvictionPolicyTest, TheMainQueueIsItsFifoOrderSortedByCounterAndEvictionAppliesIt) {
  for (RecordSlot slot : {0, 1, 2, 3}) {
    mPolicy.onInsert(insertOf(slot, 1, /*reused=*/true));
  }
  mPolicy.onHit(0);
  mPolicy.onHit(0);
  mPolicy.onHit(2);
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{1, 3, 2, 0}));
  // Evicting slot 1 passes over slot 0 once (its counter 2 -> 1, to the newest end).
  mPolicy.onErase(1, /*evicted=*/true);
  EXPECT_EQ(mPolicy.frequency(0), 1);
  EXPECT_EQ(mPolicy.frequency(2), 1) << "slot 2 came after the victim: not passed over";
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{3, 2, 0}))
      << "what is left of the order the walk announced";
  mPolicy.onErase(3, /*evicted=*/true);
  mPolicy.onErase(2, /*evicted=*/true);
  EXPECT_EQ(mPolicy.frequency(0), 0);
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{0}));
  EXPECT_FALSE(mPolicy.ghostContains(keyOf(1))) << "the ghost remembers small-queue evictions";
}

TEST_F(S3FifoEvictionPolicyTest, WalkingReadsOnlyAndStopsWhereTheVisitorSays) {
  for (RecordSlot slot : {0, 1, 2, 3}) {
    mPolicy.onInsert(insertOf(slot, 1, slot % 2 == 0));
  }
  mPolicy.onHit(2);
  std::vector<RecordSlot> const before = victimOrder(mPolicy);
  std::vector<RecordSlot> visited;
  EXPECT_TRUE(mPolicy.walkVictims([&visited](RecordSlot slot) {
    visited.push_back(slot);
    return visited.size() == 2;
  }));
  EXPECT_EQ(visited, (std::vector<RecordSlot>(before.begin(), before.begin() + 2)));
  EXPECT_EQ(victimOrder(mPolicy), before);
  EXPECT_EQ(mPolicy.frequency(2), 1);
}

TEST_F(S3FifoEvictionPolicyTest, LowerPrioritiesGoFirstAndAPriorityChangeJoinsAsTheNewest) {
  mPolicy.onInsert(insertOf(0, 1, false, 80));
  mPolicy.onInsert(insertOf(1));
  mPolicy.onInsert(insertOf(2, 1, false, 10));
  mPolicy.onInsert(insertOf(3));
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{2, 1, 3, 0}));
  mPolicy.onPriorityChange(0, kDefaultRetentionPriority);
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{2, 1, 3, 0}));
  mPolicy.onPriorityChange(2, kDefaultRetentionPriority);
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{1, 3, 0, 2}));
}

/// A hot working set, referenced once after its publication, then a one-pass scan of new
/// prefixes as large as the cache: the scan's own records are the first victims under S3-FIFO,
/// while LRU evicts the hot set first (it was used before the scan).
template <typename Policy>
std::vector<RecordSlot> firstVictimsAfterAScan(Policy& policy, int32_t hot, int32_t scan) {
  policy.reserveSlots(hot + scan);
  for (RecordSlot slot = 0; slot < hot; ++slot) {
    policy.onInsert(insertOf(slot));
    policy.onHit(slot);
  }
  for (RecordSlot slot = hot; slot < hot + scan; ++slot) {
    policy.onInsert(insertOf(slot));
  }
  std::vector<RecordSlot> victims;
  for (int32_t i = 0; i < scan; ++i) {  // evict one at a time, as the cache does under pressure
    RecordSlot first = kNoRecordSlot;
    policy.walkVictims([&first](RecordSlot slot) {
      first = slot;
      return true;
    });
    policy.onErase(first, /*evicted=*/true);
    victims.push_back(first);
  }
  return victims;
}

TEST(EvictionPolicyScanTest, AOnePassScanDoesNotFlushTheHotSetUnderS3FifoButDoesUnderLru) {
  constexpr int32_t kHot = 4;
  constexpr int32_t kScan = 16;
  auto const hotEvicted = [](std::vector<RecordSlot> const& victims) {
    return std::count_if(victims.begin(), victims.end(),
                         [](RecordSlot slot) { return slot < kHot; });
  };
  S3FifoEvictionPolicy s3fifo(64);
  EXPECT_EQ(hotEvicted(firstVictimsAfterAScan(s3fifo, kHot, kScan)), 0);
  LruEvictionPolicy lru;
  EXPECT_EQ(hotEvicted(firstVictimsAfterAScan(lru, kHot, kScan)), kHot);
}

}  // namespace
}  // namespace mkv
