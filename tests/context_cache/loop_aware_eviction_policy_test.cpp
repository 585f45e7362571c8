#include "context_cache/loop_aware_eviction_policy.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <vector>

#include "context_cache/lru_eviction_policy.h"
#include "context_cache/s3fifo_eviction_policy.h"
#include "support/victim_order.h"

namespace mkv {
namespace {

using test::victimOrder;

Hash128 keyOf(RecordSlot slot, uint64_t generation = 0) {
  return Hash128{0xabcdU + generation, static_cast<uint64_t>(slot) + 1};
}

PolicyInsert insertOf(RecordSlot slot, bool reused, bool evictedPrefix, uint64_t generation = 0,
                      int32_t priority = kDefaultRetentionPriority) {
  return PolicyInsert{slot, keyOf(slot, generation), 1, priority, reused, evictedPrefix};
}

/// Drives the policy into the thrashing state: `count` returns to evicted prefixes, no hits.
void thrash(LoopAwareEvictionPolicy& policy, RecordSlot first, int32_t count) {
  for (RecordSlot slot = first; slot < first + count; ++slot) {
    policy.onInsert(insertOf(slot, /*reused=*/true, /*evictedPrefix=*/true));
  }
}

class LoopAwareEvictionPolicyTest : public ::testing::Test {
 protected:
  LoopAwareEvictionPolicyTest() { mPolicy.reserveSlots(64); }
  LoopAwareEvictionPolicy mPolicy{64};
};

TEST_F(LoopAwareEvictionPolicyTest, WithoutThrashingAdmissionIsS3Fifos) {
  mPolicy.onInsert(insertOf(0, false, false));
  mPolicy.onInsert(insertOf(1, true, false));
  mPolicy.onInsert(insertOf(3, true, false));
  mPolicy.onInsert(insertOf(2, false, true));
  EXPECT_FALSE(mPolicy.thrashing()) << "more returns hit than found their prefix evicted";
  EXPECT_FALSE(mPolicy.inMainQueue(0)) << "a new prefix waits in the small queue";
  EXPECT_TRUE(mPolicy.inMainQueue(1)) << "reuse admits to the main queue";
  EXPECT_TRUE(mPolicy.inMainQueue(2)) << "a return to an evicted prefix too, while it hits";
  EXPECT_EQ(mPolicy.kind(), EvictionPolicyKind::kLoopAware);
}

TEST_F(LoopAwareEvictionPolicyTest, WhileThrashingAReturnToAnEvictedPrefixWaitsInTheSmallQueue) {
  mPolicy.onInsert(insertOf(0, false, false));
  mPolicy.onInsert(insertOf(1, false, false));
  thrash(mPolicy, 2, 40);
  EXPECT_TRUE(mPolicy.thrashing());
  EXPECT_TRUE(mPolicy.inMainQueue(2)) << "the main queue fills up to its share first";
  int32_t inMain = 0;
  for (RecordSlot slot = 2; slot < 42; ++slot) {
    inMain += mPolicy.inMainQueue(slot) ? 1 : 0;
  }
  // 42 records: the main queue stops taking evicted returns at 90 % of them (37 of 42 give
  // 88.1 %, 38 give 90.5 %); the others wait in the small queue.
  EXPECT_EQ(inMain, 38 - 1) << "S3-FIFO would have admitted all 40";
  RecordSlot keptOut = 2;
  while (mPolicy.inMainQueue(keptOut)) {
    ++keptOut;
  }
  mPolicy.onHit(keptOut);
  EXPECT_TRUE(mPolicy.inMainQueue(keptOut)) << "a hit promotes as under S3-FIFO";
  mPolicy.onInsert(insertOf(52, /*reused=*/true, /*evictedPrefix=*/false));
  EXPECT_TRUE(mPolicy.inMainQueue(52)) << "a return within reach still enters the main queue";
}

TEST_F(LoopAwareEvictionPolicyTest, HitsEndTheThrashingState) {
  thrash(mPolicy, 0, 8);
  ASSERT_TRUE(mPolicy.thrashing());
  for (RecordSlot slot = 10; slot < 30; ++slot) {
    mPolicy.onInsert(insertOf(slot, /*reused=*/true, /*evictedPrefix=*/false));
  }
  EXPECT_FALSE(mPolicy.thrashing());
  mPolicy.onInsert(insertOf(40, /*reused=*/true, /*evictedPrefix=*/true));
  EXPECT_TRUE(mPolicy.inMainQueue(40));
}

TEST_F(LoopAwareEvictionPolicyTest, TheGhostStillAdmitsAKeyEvictedFromTheSmallQueue) {
  thrash(mPolicy, 0, 8);
  mPolicy.onInsert(insertOf(20, false, false));
  mPolicy.onErase(20, /*evicted=*/true);
  mPolicy.onInsert(insertOf(20, /*reused=*/true, /*evictedPrefix=*/true));
  EXPECT_TRUE(mPolicy.inMainQueue(20)) << "the same key came back: S3-FIFO's ghost hit";
}

TEST_F(LoopAwareEvictionPolicyTest, EventsFollowS3FifoOrderAndWalkingReadsOnly) {
  for (RecordSlot slot : {3, 1, 2}) {
    mPolicy.onInsert(insertOf(slot, false, false));
  }
  mPolicy.onInsert(insertOf(0, false, false, 0, kDefaultRetentionPriority + 10));
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{3, 1, 2, 0}));
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{3, 1, 2, 0})) << "the walk changed it";
  int visited = 0;
  EXPECT_TRUE(mPolicy.walkVictims([&visited](RecordSlot) { return ++visited == 2; }));
  EXPECT_EQ(visited, 2);
  mPolicy.onPriorityChange(3, kDefaultRetentionPriority + 10);
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{1, 2, 0, 3}))
      << "a lower priority goes first; a priority change joins as the newest";
  mPolicy.onErase(1, /*evicted=*/false);
  EXPECT_EQ(victimOrder(mPolicy), (std::vector<RecordSlot>{2, 0, 3}));
  mPolicy.onErase(0, /*evicted=*/true);
  mPolicy.onErase(2, /*evicted=*/true);
  mPolicy.onErase(3, /*evicted=*/true);
  EXPECT_TRUE(victimOrder(mPolicy).empty());
}

/// `conversations` conversations return in a fixed round-robin order, turn after turn, to a
/// cache of `capacity` records of weight 1 (fewer than the conversations). A returning
/// conversation whose record is resident hits (a duplicate publication); otherwise its new record
/// is published with the evictedPrefix hint (its prefix was evicted recently) and the first
/// victims make room. Returns the hits over the rounds after the first.
int32_t loopHits(EvictionPolicy& policy, int32_t conversations, int32_t capacity, int32_t rounds) {
  policy.reserveSlots(conversations);
  std::vector<bool> resident(static_cast<std::size_t>(conversations), false);
  int32_t residents = 0;
  int32_t hits = 0;
  for (int32_t round = 0; round < rounds; ++round) {
    for (RecordSlot c = 0; c < conversations; ++c) {
      if (resident[static_cast<std::size_t>(c)]) {
        policy.onHit(c);
        hits += round > 0 ? 1 : 0;
        continue;
      }
      while (residents >= capacity) {
        RecordSlot victim = kNoRecordSlot;
        policy.walkVictims([&victim](RecordSlot slot) {
          victim = slot;
          return true;
        });
        policy.onErase(victim, /*evicted=*/true);
        resident[static_cast<std::size_t>(victim)] = false;
        --residents;
      }
      policy.onInsert(insertOf(c, /*reused=*/round > 0, /*evictedPrefix=*/round > 0,
                               static_cast<uint64_t>(round)));
      resident[static_cast<std::size_t>(c)] = true;
      ++residents;
    }
  }
  return hits;
}

TEST(EvictionPolicyLoopTest, ALoopLargerThanTheCacheHitsUnderLoopAwareButNotUnderLruOrS3Fifo) {
  constexpr int32_t kConversations = 40;
  constexpr int32_t kCapacity = 20;
  constexpr int32_t kRounds = 10;
  LruEvictionPolicy lru;
  EXPECT_EQ(loopHits(lru, kConversations, kCapacity, kRounds), 0);
  S3FifoEvictionPolicy s3fifo(64);
  int32_t const s3fifoHits = loopHits(s3fifo, kConversations, kCapacity, kRounds);
  EXPECT_LE(s3fifoHits, kRounds) << "S3-FIFO admits every evicted return to its main queue";
  LoopAwareEvictionPolicy loopAware(64);
  // Once thrashing is seen, the resident conversations (all but the small queue's share) stay
  // and hit every round: at least half the cache's records per round after the first few.
  int32_t const loopAwareHits = loopHits(loopAware, kConversations, kCapacity, kRounds);
  std::printf("loop hits: S3-FIFO %d, loop-aware %d\n", s3fifoHits, loopAwareHits);
  EXPECT_GE(loopAwareHits, (kRounds - 3) * kCapacity / 2);
}

}  // namespace
}  // namespace mkv
