#include "context_cache/lru_eviction_policy.h"

#include <gtest/gtest.h>

#include <vector>

#include "support/victim_order.h"

namespace mkv {
namespace {

using test::victimOrder;

PolicyInsert insertOf(RecordSlot slot, int32_t priority = kDefaultRetentionPriority) {
  return PolicyInsert{slot, Hash128{1, static_cast<uint64_t>(slot)}, 1, priority, true, true};
}

TEST(LruEvictionPolicyTest, LeastRecentlyInsertedOrHitFirstAndHintsIgnored) {
  LruEvictionPolicy policy;
  policy.reserveSlots(8);
  for (RecordSlot slot : {3, 1, 2}) {
    policy.onInsert(insertOf(slot));
  }
  EXPECT_EQ(victimOrder(policy), (std::vector<RecordSlot>{3, 1, 2}));
  policy.onHit(3);
  EXPECT_EQ(victimOrder(policy), (std::vector<RecordSlot>{1, 2, 3}));
  policy.onErase(2, /*evicted=*/true);
  policy.onInsert(insertOf(2));
  EXPECT_EQ(victimOrder(policy), (std::vector<RecordSlot>{1, 3, 2})) << "a reused slot is new";
}

TEST(LruEvictionPolicyTest, LowerPrioritiesGoFirstAndAPriorityChangeJoinsAsTheNewest) {
  LruEvictionPolicy policy;
  policy.reserveSlots(8);
  policy.onInsert(insertOf(0, 90));
  policy.onInsert(insertOf(1));
  policy.onInsert(insertOf(2, 0));
  policy.onInsert(insertOf(3));
  EXPECT_EQ(victimOrder(policy), (std::vector<RecordSlot>{2, 1, 3, 0}));
  policy.onPriorityChange(0, kDefaultRetentionPriority);
  policy.onHit(1);
  EXPECT_EQ(victimOrder(policy), (std::vector<RecordSlot>{2, 3, 0, 1}));
}

TEST(LruEvictionPolicyTest, GrowingTheSlotTablesKeepsTheOrder) {
  LruEvictionPolicy policy;
  policy.reserveSlots(2);
  policy.onInsert(insertOf(1));
  policy.onInsert(insertOf(0));
  policy.reserveSlots(64);
  policy.onInsert(insertOf(40));
  EXPECT_EQ(victimOrder(policy), (std::vector<RecordSlot>{1, 0, 40}));
}

}  // namespace
}  // namespace mkv
