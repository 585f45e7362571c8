// Strong exception safety of ContextCacheManager's mutating calls, proven by failing every
// allocation they make, one at a time: the global operator new of this test binary can be armed to
// throw std::bad_alloc on the n-th allocation from now. After each injected failure the manager
// must be exactly as before (refcounts, free rings, index, records, LRU order, metrics).

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <new>

#include "context_cache/context_cache_manager.h"
#include "context_cache_test_support.h"

#if defined(__SANITIZE_ADDRESS__)
#define MKV_TEST_ALLOCATION_INJECTION 0  // sanitizers own operator new
#else
#define MKV_TEST_ALLOCATION_INJECTION 1
#endif

#if MKV_TEST_ALLOCATION_INJECTION
namespace {
long gAllocationsUntilFailure = -1;  // -1: disarmed. Tests are single-threaded.
}  // namespace

void* operator new(std::size_t size) {
  if (gAllocationsUntilFailure >= 0 && gAllocationsUntilFailure-- == 0) {
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) {
    return p;
  }
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
#endif

namespace mkv {
namespace {

using test::admit;
using test::captureState;
using test::concatenated;
using test::expectManagerInvariants;
using test::publishCold;
using test::requestOf;
using test::tokenRun;
using test::viewOf;

constexpr int32_t kPage = 4;

#if MKV_TEST_ALLOCATION_INJECTION
struct Counters {
  uint64_t published, touched, upgrades, evicted, admitted, lookups, rejects;
  friend bool operator==(Counters const&, Counters const&) = default;
};
Counters countersOf(ContextCacheManager const& m) {
  ContextCacheMetrics const x = m.metrics();
  return {x.publishedRecords,   x.existingRecordsTouched, x.specUpgrades,
          x.evictedRecords,     x.admittedSequences,      x.lookups,
          x.verificationRejects};
}
#endif

/// Runs `operation` with the n-th allocation failing, for n = 0, 1, ... until it succeeds.
/// Returns the number of injected failures. `operation` must be repeatable after a failure.
int32_t failEveryAllocation(ContextCacheManager& m, std::function<void()> const& operation) {
#if MKV_TEST_ALLOCATION_INJECTION
  for (int32_t n = 0;; ++n) {
    test::ManagerState const before = captureState(m);
    Counters const counters = countersOf(m);
    int32_t const leases = m.liveLeaseCount();
    gAllocationsUntilFailure = n;
    try {
      operation();
      gAllocationsUntilFailure = -1;
      return n;
    } catch (std::bad_alloc const&) {
      gAllocationsUntilFailure = -1;
    }
    EXPECT_EQ(captureState(m), before) << "allocation " << n << " left the manager changed";
    EXPECT_EQ(countersOf(m), counters) << "allocation " << n;
    EXPECT_EQ(m.liveLeaseCount(), leases) << "allocation " << n;
    expectManagerInvariants(m);
    if (::testing::Test::HasFailure()) {
      return n;
    }
  }
#else
  (void)m;
  operation();
  return 0;
#endif
}

class ContextCacheManagerRollbackTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if !MKV_TEST_ALLOCATION_INJECTION
    GTEST_SKIP() << "allocation injection is disabled under sanitizers";
#endif
  }
};

TEST_F(ContextCacheManagerRollbackTest, NewRecordPublicationRollsBackEveryStep) {
  ContextCacheManagerOptions options;
  options.eventQueueCapacity = 8;
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8, options);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  std::vector<int32_t> const longer = concatenated(a, tokenRun(8, 50));
  CacheRequestLease lease = admit(m, requestOf(longer));
  PromptBlocks const blocks = hashPromptBlocks(viewOf(longer), kPage);
  (void)m.drainEvents();
  PublishResult result;
  int32_t const failures = failEveryAllocation(m, [&] { result = m.publish(lease, blocks, 16); });
  EXPECT_GT(failures, 5) << "the publication allocates in projection, index and store";
  EXPECT_EQ(result.status, PublishStatus::kPublished);
  EXPECT_EQ(m.drainEvents().size(), 2U) << "no event leaked from a rolled-back attempt";
  expectManagerInvariants(m);
}

TEST_F(ContextCacheManagerRollbackTest, MediaBlockPublicationRollsBack) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const tokens(8, 42);
  std::vector<MediaPosition> media(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    media[i] = {Hash128{3, 3}, static_cast<int32_t>(i)};
  }
  CacheRequestLease lease = admit(m, requestOf(tokens));
  PromptBlocks const blocks = hashPromptBlocks(viewOf(tokens, {}, &media), kPage);
  EXPECT_GT(failEveryAllocation(m, [&] { (void)m.publish(lease, blocks, 8); }), 0);
  EXPECT_EQ(m.records().size(), 1U);
}

TEST_F(ContextCacheManagerRollbackTest, SpecUpgradeAndSpecRecordRollBack) {
  ContextCacheManagerOptions options;
  options.specContract = SpecReuseContract{true, 1};
  ContextCacheManager m(kPage, {16, 16, 0, 0}, 8, options);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);  // base-only record
  CacheRequestLease spec =
      admit(m, requestOf(a, ReuseMode::kSpec, ContextCacheLookupPolicy::kBypass));
  PromptBlocks const blocks = hashPromptBlocks(viewOf(a), kPage);
  PublishResult upgraded;
  EXPECT_GT(failEveryAllocation(m, [&] { upgraded = m.publish(spec, blocks, 8); }), 0);
  EXPECT_EQ(upgraded.status, PublishStatus::kSpecStateAttached);

  std::vector<int32_t> const b = tokenRun(12, 70);
  CacheRequestLease fresh = admit(m, requestOf(b, ReuseMode::kSpec));
  PromptBlocks const freshBlocks = hashPromptBlocks(viewOf(b), kPage);
  PublishResult paired;
  EXPECT_GT(failEveryAllocation(m, [&] { paired = m.publish(fresh, freshBlocks, 12); }), 0);
  EXPECT_EQ(paired.status, PublishStatus::kPublished);
  EXPECT_EQ(m.records().findLongestSpecPath(freshBlocks.keys, 3)->blockCount, 3);
}

TEST_F(ContextCacheManagerRollbackTest, HybridCheckpointPublicationRollsBack) {
  ContextCacheManager m(kPage, {8, 0, 2, 2}, 8);
  std::vector<int32_t> const a = tokenRun(9, 0);
  CacheRequestLease lease = admit(m, requestOf(a, ReuseMode::kHybrid));
  std::optional<SnapshotReservation> const r = m.reserveHybridSnapshots(lease, true);
  ASSERT_TRUE(r);
  PromptBlocks const blocks = hashPromptBlocks(viewOf(a), kPage);
  PublishResult result;
  EXPECT_GT(failEveryAllocation(m, [&] { result = m.publishHybrid(lease, blocks, 6, *r); }), 0);
  EXPECT_EQ(result.status, PublishStatus::kPublished);
  EXPECT_EQ(m.records().hybridCheckpointLengths(10), (std::vector<int32_t>{6}));
}

TEST_F(ContextCacheManagerRollbackTest, AcquireWithEvictionAndGrowthRollBack) {
  ContextCacheManager m(kPage, {6, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  publishCold(m, tokenRun(8, 40));
  publishCold(m, tokenRun(8, 80));  // pool full of cached pages
  std::optional<CacheRequestLease> lease;
  std::vector<int32_t> const prompt = concatenated(a, tokenRun(6, 300));
  EXPECT_GT(failEveryAllocation(m,
                                [&] {
                                  AdmissionResult admitted = m.admit(requestOf(prompt));
                                  lease = std::move(admitted.lease);
                                }),
            0);
  ASSERT_TRUE(lease);
  EXPECT_EQ(m.metrics().evictedRecords, 1U)
      << "the next record was evicted exactly once; a's record, every page pinned, was passed over";
  bool grown = false;
  EXPECT_GE(failEveryAllocation(m, [&] { grown = m.growBasePages(*lease, 2); }), 0);
  EXPECT_TRUE(grown);
  expectManagerInvariants(m);
}

}  // namespace
}  // namespace mkv
