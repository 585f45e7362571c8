#include "context_cache/resource_pools.h"

#include <gtest/gtest.h>

#include "mkv/error.h"

namespace mkv {
namespace {

constexpr ResourceId base(int32_t i) { return {ResourceType::kBaseKvPage, i}; }

using Targets = std::array<std::vector<int32_t>*, kResourceTypeCount>;

TEST(ResourceDemandTest, AccessTotalsAndCoverage) {
  ResourceDemand d{1, 2, 3, 4};
  EXPECT_EQ(d[ResourceType::kBaseKvPage], 1);
  EXPECT_EQ(d[ResourceType::kDraftKvPage], 2);
  EXPECT_EQ(d[ResourceType::kRecurrentSnapshot], 3);
  EXPECT_EQ(d[ResourceType::kPartialKvSnapshot], 4);
  d[ResourceType::kPartialKvSnapshot] = 5;
  EXPECT_EQ(d.partialKvSnapshotSlots, 5);
  EXPECT_EQ(d.total(), 11);
  EXPECT_TRUE(d.covers({1, 2, 3, 5}));
  EXPECT_FALSE(d.covers({1, 3, 0, 0}));
  EXPECT_TRUE(ResourceDemand{}.isZero());
  EXPECT_TRUE((ResourceDemand{0, -1, 0, 0}.hasNegative()));
  EXPECT_FALSE((ResourceDemand{1, -1, 0, 0}.isZero()));
}

TEST(ResourcePoolsTest, NewAllocationStartsWithOneActiveReference) {
  ResourcePools pools({4, 0, 0, 0});
  std::vector<int32_t> pages;
  ASSERT_TRUE(pools.allocate({2, 0, 0, 0}, Targets{&pages, nullptr, nullptr, nullptr}));
  EXPECT_EQ(pages, (std::vector<int32_t>{0, 1}));
  for (int32_t p : pages) {
    EXPECT_EQ(pools.activeRefs(base(p)), 1);
    EXPECT_EQ(pools.cacheRefs(base(p)), 0);
    EXPECT_FALSE(pools.isFree(base(p)));
  }
  EXPECT_EQ(pools.freeCount(ResourceType::kBaseKvPage), 2);
}

TEST(ResourcePoolsTest, FreeRingReusesAJustReleasedPageLast) {
  ResourcePools pools({3, 0, 0, 0});
  std::vector<int32_t> pages;
  ASSERT_TRUE(pools.allocate({1, 0, 0, 0}, Targets{&pages, nullptr, nullptr, nullptr}));
  EXPECT_EQ(pages[0], 0);
  EXPECT_TRUE(pools.dropActive(base(0)));
  EXPECT_EQ(pools.freeList(ResourceType::kBaseKvPage), (std::vector<int32_t>{1, 2, 0}));
  pages.clear();
  ASSERT_TRUE(pools.allocate({3, 0, 0, 0}, Targets{&pages, nullptr, nullptr, nullptr}));
  EXPECT_EQ(pages, (std::vector<int32_t>{1, 2, 0}));
}

TEST(ResourcePoolsTest, SlotIsFreeOnlyWhenBothCountsAreZero) {
  ResourcePools pools({2, 0, 0, 0});
  std::vector<int32_t> pages;
  ASSERT_TRUE(pools.allocate({1, 0, 0, 0}, Targets{&pages, nullptr, nullptr, nullptr}));
  pools.addCache(base(0));
  EXPECT_EQ(pools.reclaimableCount(ResourceType::kBaseKvPage), 0);
  EXPECT_FALSE(pools.dropActive(base(0))) << "still cached";
  EXPECT_EQ(pools.reclaimableCount(ResourceType::kBaseKvPage), 1);
  EXPECT_EQ(pools.freeCount(ResourceType::kBaseKvPage), 1);
  pools.addActive(base(0));  // pin the cached page
  EXPECT_EQ(pools.reclaimableCount(ResourceType::kBaseKvPage), 0);
  EXPECT_FALSE(pools.dropCache(base(0))) << "still pinned";
  EXPECT_TRUE(pools.dropActive(base(0)));
  EXPECT_TRUE(pools.isFree(base(0)));
  EXPECT_EQ(pools.freeCount(ResourceType::kBaseKvPage), 2);
}

TEST(ResourcePoolsTest, MultiPoolAllocationIsAllOrNothing) {
  ResourcePools pools({4, 1, 2, 2});
  std::vector<int32_t> b;
  std::vector<int32_t> d;
  std::vector<int32_t> r;
  std::vector<int32_t> p;
  Targets const targets{&b, &d, &r, &p};
  EXPECT_FALSE(pools.allocate({2, 2, 1, 1}, targets)) << "draft pool short";
  EXPECT_TRUE(b.empty() && d.empty() && r.empty() && p.empty());
  EXPECT_EQ(pools.freeCounts(), (ResourceDemand{4, 1, 2, 2}));
  EXPECT_TRUE(pools.allocate({2, 1, 1, 1}, targets));
  EXPECT_EQ(pools.freeCounts(), (ResourceDemand{2, 0, 1, 1}));
  EXPECT_EQ(b.size() + d.size() + r.size() + p.size(), 5U);
  EXPECT_TRUE(pools.canAllocate({2, 0, 1, 1}));
  EXPECT_FALSE(pools.canAllocate({0, 1, 0, 0}));
}

TEST(ResourcePoolsTest, ContractViolationsThrowAndChangeNothing) {
  EXPECT_THROW(ResourcePools({-1, 0, 0, 0}), Error);
  ResourcePools pools({2, 0, 0, 0});
  EXPECT_THROW(pools.addActive(base(0)), Error) << "pinning a free page";
  EXPECT_THROW(pools.addCache(base(0)), Error) << "publishing a free page";
  EXPECT_THROW(pools.dropActive(base(0)), Error);
  EXPECT_THROW(pools.dropCache(base(1)), Error);
  EXPECT_THROW(pools.activeRefs(base(2)), Error);
  EXPECT_THROW(pools.activeRefs({ResourceType::kDraftKvPage, 0}), Error);
  EXPECT_THROW(pools.allocate({1, 0, 0, 0}, Targets{}), Error) << "no target";
  EXPECT_THROW(pools.allocate({-1, 0, 0, 0}, Targets{}), Error);
  EXPECT_EQ(pools.freeList(ResourceType::kBaseKvPage), (std::vector<int32_t>{0, 1}));
}

TEST(ResourcePoolsTest, ToStringNamesEveryType) {
  EXPECT_EQ(toString(ResourceType::kBaseKvPage), "base_kv_page");
  EXPECT_EQ(toString(ResourceType::kDraftKvPage), "draft_kv_page");
  EXPECT_EQ(toString(ResourceType::kRecurrentSnapshot), "recurrent_snapshot");
  EXPECT_EQ(toString(ResourceType::kPartialKvSnapshot), "partial_kv_snapshot");
}

}  // namespace
}  // namespace mkv
