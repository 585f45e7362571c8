#include "context_cache/eviction_planner.h"

#include <gtest/gtest.h>

#include <string>

#include "mkv/error.h"

namespace mkv {
namespace {

using Targets = std::array<std::vector<int32_t>*, kResourceTypeCount>;

std::string policyName(::testing::TestParamInfo<EvictionPolicyKind> const& param) {
  return std::string(toString(param.param));
}

/// Pools and records wired by hand: every slot allocated up front, records take cache refs,
/// then the allocation's active ref is dropped unless the test pins it. Every test runs with each
/// eviction policy: records inserted once and never touched are in insertion order under both
/// (S3-FIFO keeps them in its small queue), so the exactness contracts read the same.
class EvictionPlannerTest : public ::testing::TestWithParam<EvictionPolicyKind> {
 protected:
  static constexpr ResourceDemand kCapacity{4, 2, 0, 0};

  EvictionPlannerTest() {
    std::vector<int32_t> base;
    std::vector<int32_t> draft;
    EXPECT_TRUE(mPools.allocate(kCapacity, Targets{&base, &draft, nullptr, nullptr}));
  }

  RecordId addRecord(std::vector<PageId> basePath, std::vector<PageId> draftPath = {},
                     int32_t priority = kDefaultRetentionPriority) {
    CacheRecord r;
    r.retentionPriority = priority;
    for (std::size_t b = 0; b < basePath.size(); ++b) {
      r.logicalBlockDigests.push_back(Hash128{mNextTag, b});
    }
    ++mNextTag;
    r.key = RecordKey{r.logicalBlockDigests.back(), static_cast<int32_t>(basePath.size())};
    r.basePagePath = std::move(basePath);
    if (!draftPath.empty()) {
      r.specState = SpecState{std::move(draftPath)};
    }
    CacheRecord const* stored = mRecords.insert(std::move(r)).record;
    stored->forEachResource([this](ResourceId id) { mPools.addCache(id); });
    return stored->id;
  }
  /// Drops the allocation references of every slot except `pinned` base pages.
  void settle(std::vector<PageId> const& pinned = {}) {
    for (ResourceType type : {ResourceType::kBaseKvPage, ResourceType::kDraftKvPage}) {
      for (int32_t i = 0; i < kCapacity[type]; ++i) {
        bool const keep = type == ResourceType::kBaseKvPage &&
                          std::find(pinned.begin(), pinned.end(), i) != pinned.end();
        if (!keep) {
          mPools.dropActive({type, i});
        }
      }
    }
  }

  ResourcePools mPools{kCapacity};
  RecordStore mRecords{GetParam()};
  EvictionPlanner mPlanner{kCapacity};
  uint64_t mNextTag = 1;
};

TEST_P(EvictionPlannerTest, FreeCapacityReturnsEmptyFeasiblePlan) {
  RecordId const r = addRecord({0});
  settle();
  ASSERT_EQ(mPools.freeCount(ResourceType::kBaseKvPage), 3);
  EvictionPlan const plan = mPlanner.plan({3, 0, 0, 0}, mPools, mRecords);
  EXPECT_TRUE(plan.feasible);
  EXPECT_TRUE(plan.victims.empty());
  EXPECT_NE(mRecords.get(r), nullptr);
}

TEST_P(EvictionPlannerTest, SelectsRecordsInVictimOrder) {
  RecordId const a = addRecord({0});
  RecordId const b = addRecord({1});
  RecordId const c = addRecord({2});
  addRecord({3});
  settle();
  mRecords.touch(a);  // order b, c, d, a (S3-FIFO: the hit promotes a to the main queue)
  EvictionPlan const plan = mPlanner.plan({2, 0, 0, 0}, mPools, mRecords);
  EXPECT_TRUE(plan.feasible);
  EXPECT_EQ(plan.victims, (std::vector<RecordId>{b, c}));
  EXPECT_EQ(plan.reclaimed, (ResourceDemand{2, 0, 0, 0}));
}

TEST_P(EvictionPlannerTest, SharedAncestorRequiresMultipleVictims) {
  RecordId const a = addRecord({0, 1});
  RecordId const b = addRecord({0, 2});
  addRecord({3});
  settle();
  EXPECT_EQ(mPlanner.plan({1, 0, 0, 0}, mPools, mRecords).victims, (std::vector<RecordId>{a}));
  EvictionPlan const plan = mPlanner.plan({2, 0, 0, 0}, mPools, mRecords);
  EXPECT_EQ(plan.victims, (std::vector<RecordId>{a, b})) << "page 0 frees only with both";
  EXPECT_EQ(plan.reclaimed.baseKvPages, 3);
}

TEST_P(EvictionPlannerTest, ActiveReferencePreventsReclaim) {
  addRecord({0});  // its only page is pinned below
  RecordId const b = addRecord({1});
  settle(/*pinned=*/{0});  // pages 2 and 3 are free
  EvictionPlan const plan = mPlanner.plan({3, 0, 0, 0}, mPools, mRecords);
  EXPECT_TRUE(plan.feasible);
  EXPECT_EQ(plan.victims, (std::vector<RecordId>{b}))
      << "a is passed over: its only page is pinned, evicting it would free nothing";
  EXPECT_EQ(plan.reclaimed.baseKvPages, 1);
  EXPECT_FALSE(mPlanner.plan({4, 0, 0, 0}, mPools, mRecords).feasible);
}

TEST_P(EvictionPlannerTest, ARecordWithOnePagePinnedIsStillAVictimForItsOtherPages) {
  RecordId const a = addRecord({0, 1});
  RecordId const b = addRecord({2});
  settle(/*pinned=*/{0});  // page 3 is free
  EvictionPlan const plan = mPlanner.plan({2, 0, 0, 0}, mPools, mRecords);
  EXPECT_TRUE(plan.feasible);
  EXPECT_EQ(plan.victims, (std::vector<RecordId>{a})) << "page 1 is a's own and unpinned";
  EXPECT_EQ(plan.reclaimed.baseKvPages, 1);
  EXPECT_EQ(mPlanner.plan({3, 0, 0, 0}, mPools, mRecords).victims, (std::vector<RecordId>{a, b}));
}

TEST_P(EvictionPlannerTest, InfeasiblePlanReturnsNoVictimsAndMutatesNothing) {
  addRecord({0, 1});
  addRecord({2});
  settle(/*pinned=*/{3});
  std::vector<int32_t> const cacheBefore{mPools.cacheRefs({ResourceType::kBaseKvPage, 0}),
                                         mPools.cacheRefs({ResourceType::kBaseKvPage, 1}),
                                         mPools.cacheRefs({ResourceType::kBaseKvPage, 2})};
  EvictionPlan const plan = mPlanner.plan({4, 0, 0, 0}, mPools, mRecords);
  EXPECT_FALSE(plan.feasible);
  EXPECT_TRUE(plan.victims.empty());
  EXPECT_EQ(mRecords.size(), 2U);
  EXPECT_EQ(cacheBefore, (std::vector<int32_t>{mPools.cacheRefs({ResourceType::kBaseKvPage, 0}),
                                               mPools.cacheRefs({ResourceType::kBaseKvPage, 1}),
                                               mPools.cacheRefs({ResourceType::kBaseKvPage, 2})}));
  // The scratch was reset: the same question gets the same answer, and a feasible one works.
  EXPECT_EQ(mPlanner.plan({3, 0, 0, 0}, mPools, mRecords).victims.size(), 2U);
  EXPECT_EQ(mPlanner.plan({3, 0, 0, 0}, mPools, mRecords).victims.size(), 2U);
}

TEST_P(EvictionPlannerTest, DemandAcrossTypesMustBeSatisfiedTogether) {
  RecordId const a = addRecord({0});
  RecordId const b = addRecord({1}, {0});
  RecordId const c = addRecord({2, 3}, {1, 1});  // a draft page referenced twice
  settle();
  EXPECT_EQ(mPlanner.plan({1, 0, 0, 0}, mPools, mRecords).victims, (std::vector<RecordId>{a}));
  EXPECT_EQ(mPlanner.plan({0, 1, 0, 0}, mPools, mRecords).victims, (std::vector<RecordId>{a, b}));
  EvictionPlan const both = mPlanner.plan({3, 2, 0, 0}, mPools, mRecords);
  EXPECT_EQ(both.victims, (std::vector<RecordId>{a, b, c}));
  EXPECT_EQ(both.reclaimed, (ResourceDemand{4, 2, 0, 0}));
}

TEST_P(EvictionPlannerTest, ProtectedRecordIsVisitedLast) {
  RecordId const a = addRecord({0});
  RecordId const b = addRecord({1});
  settle();
  EXPECT_EQ(mPlanner.plan({3, 0, 0, 0}, mPools, mRecords, a).victims, (std::vector<RecordId>{b}));
  EXPECT_EQ(mPlanner.plan({4, 0, 0, 0}, mPools, mRecords, a).victims,
            (std::vector<RecordId>{b, a}));
}

TEST_P(EvictionPlannerTest, SeveralProtectedRecordsAreVisitedLastInTheOrderGiven) {
  RecordId const a = addRecord({0});
  RecordId const b = addRecord({1});
  RecordId const c = addRecord({2});
  settle();
  std::vector<RecordId> const protectedRecords{c, kNoRecord, a, c};
  EXPECT_EQ(mPlanner.plan({2, 0, 0, 0}, mPools, mRecords, protectedRecords).victims,
            (std::vector<RecordId>{b}));
  EXPECT_EQ(mPlanner.plan({4, 0, 0, 0}, mPools, mRecords, protectedRecords).victims,
            (std::vector<RecordId>{b, c, a}))
      << "repeats and kNoRecord are skipped";
  EXPECT_EQ(mPlanner.plan({3, 0, 0, 0}, mPools, mRecords, std::span<RecordId const>{}).victims,
            (std::vector<RecordId>{a, b}));
}

TEST_P(EvictionPlannerTest, LowerRetentionPrioritiesAreVisitedFirst) {
  RecordId const high = addRecord({0}, {}, 90);
  RecordId const a = addRecord({1});
  RecordId const low = addRecord({2}, {}, 0);
  RecordId const b = addRecord({3});
  settle();
  EXPECT_EQ(mPlanner.plan({2, 0, 0, 0}, mPools, mRecords).victims, (std::vector<RecordId>{low, a}));
  EXPECT_EQ(mPlanner.plan({4, 0, 0, 0}, mPools, mRecords).victims,
            (std::vector<RecordId>{low, a, b, high}))
      << "the high-priority record, the oldest, is the last victim";
  EXPECT_EQ(mPlanner.plan({4, 0, 0, 0}, mPools, mRecords, a).victims,
            (std::vector<RecordId>{low, b, high, a}))
      << "a protected record still comes after every priority";
}

TEST_P(EvictionPlannerTest, RejectsForeignPoolsAndNegativeDemand) {
  ResourcePools other({5, 2, 0, 0});
  EXPECT_THROW(mPlanner.plan({1, 0, 0, 0}, other, mRecords), Error);
  EXPECT_THROW(mPlanner.plan({-1, 0, 0, 0}, mPools, mRecords), Error);
  EXPECT_THROW(EvictionPlanner({-1, 0, 0, 0}), Error);
}

INSTANTIATE_TEST_SUITE_P(EveryPolicy, EvictionPlannerTest,
                         ::testing::Values(EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo,
                                           EvictionPolicyKind::kLoopAware),
                         policyName);

}  // namespace
}  // namespace mkv
