// ContextCacheCoordinator with a WindowBlockCache (the composed backend's sliding pool): the
// window rule caps every vanilla lookup, publishWindowBlocks / reusedWindowPages, and the
// deployments the coordinator refuses beside a window cache.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "context_cache/window_block_cache.h"
#include "coordinator_test_rig.h"
#include "mkv/host_kv_tier.h"

namespace mkv {
namespace {

using test::CoordinatorRig;
using test::RigOptions;
using test::throwsError;
using test::tokenRun;
using Handle = ContextCacheCoordinator::RequestHandle;

constexpr int32_t kPage = 16;
constexpr int32_t kWindowTokens = 24;  // 2 blocks
constexpr int32_t kSlidingPages = 16;

RigOptions rigOptions(bool enabled = true) {
  RigOptions options;
  options.pageSize = kPage;
  options.numPages = 32;
  options.maxBatch = 3;
  options.maxPagesPerSeq = 8;
  options.enabled = enabled;
  return options;
}

/// A CPU coordinator whose resources carry a window cache, driven by hand; reuse points every
/// `Interval` tokens (0: none).
template <int32_t Interval>
class WindowCoordinatorFixture : public ::testing::Test {
 protected:
  static ContextCacheConfig cacheConfig(RigOptions const& options) {
    ContextCacheConfig config = CoordinatorRig::cacheConfig(options);
    config.checkpointInterval = Interval;
    return config;
  }

  RigOptions mOptions = rigOptions();
  KVCachePool mPool{CoordinatorRig::poolConfig(DeviceType::kCPU, mOptions)};
  KVPageTable mTable{mOptions.maxBatch, mOptions.maxPagesPerSeq, mOptions.numPages,
                     PageTableMode::kDense, DeviceType::kCPU};
  WindowBlockCache mWindow{kSlidingPages, kPage, kWindowTokens, /*verifyTokens=*/true};
  test::FaultArming mSync;
  ContextCacheCoordinator mCoordinator{
      cacheConfig(mOptions), ContextCacheDeploymentProfile{}, resources(), nullptr, {},
      mSync.injector()};
  // 6 full blocks and one more token.
  std::vector<int32_t> mPrompt = tokenRun(6 * kPage + 1, 0);

  void TearDown() override { (void)mCoordinator.shutdown(); }

  ContextCachePhysicalResources resources() {
    ContextCachePhysicalResources r{&mPool, &mTable, nullptr, nullptr, nullptr};
    r.windowCache = &mWindow;
    return r;
  }

  ContextCacheSequenceAdmission admissionOf(std::vector<int32_t> const& prompt, CacheSlot slot) {
    ContextCacheSequenceAdmission admission;
    admission.tokenIds = prompt;
    admission.resident = ResidentRef{slot, 1};
    return admission;
  }

  /// Admits `prompt` on resident `slot` alone; returns the handle, `start` its prefill start.
  Handle admit(std::vector<int32_t> const& prompt, CacheSlot slot, int32_t& start,
               ContextCacheLookupPolicy policy = ContextCacheLookupPolicy::kUseCache) {
    ContextCacheBatchAdmission batch;
    batch.sequences.push_back(admissionOf(prompt, slot));
    batch.lookupPolicy = policy;
    auto result = mCoordinator.beginRequest(batch, test::kVanilla, nullptr);
    EXPECT_EQ(result.status, ContextCacheStatus::kOk);
    start = result.admission->prefillStarts.at(0);
    return std::move(result.admission->request);
  }

  /// preparePrefill and the prefill's completion (the lookahead token, the prompt committed).
  void prefill(Handle& handle, std::vector<int32_t> const& prompt) {
    mCoordinator.preparePrefill(handle);
    int32_t const lookahead = 7;
    ContextCacheSequenceAdvance const advance{&lookahead, 1, static_cast<int32_t>(prompt.size())};
    ASSERT_EQ(mCoordinator.finalizePrefillPublication(handle, {&advance, 1}),
              ContextCacheStatus::kOk);
  }

  /// A request that computes `mPrompt`, publishes its blocks in both pools and finishes; the
  /// sliding pages are released in `releaseOrder` (block numbers), so they are dropped in it.
  void publishPrompt(std::vector<int32_t> const& releaseOrder) {
    int32_t start = -1;
    Handle handle = admit(mPrompt, 0, start);
    prefill(handle, mPrompt);
    std::vector<PageId> pages;
    ASSERT_TRUE(mWindow.allocate(6, pages));
    EXPECT_EQ(mCoordinator.publishWindowBlocks(handle, 0, 0, pages), 6);
    for (int32_t block : releaseOrder) {
      mWindow.release(pages[static_cast<std::size_t>(block)]);
    }
    EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
  }

  /// Makes the sliding pool drop its `count` least recently released cached blocks.
  void dropOldestWindowBlocks(int32_t count) {
    std::vector<PageId> pages;
    ASSERT_TRUE(mWindow.allocate(mWindow.freePages() + count, pages));
    for (PageId page : pages) {
      mWindow.release(page);
    }
  }

  uint64_t windowMisses() const {
    return mCoordinator.metrics().missCount(MissReason::kWindowEvicted);
  }
};

using WindowCoordinatorTest = WindowCoordinatorFixture<0>;
/// Reuse points every 3 blocks: the windows before blocks 3 and 6 are kept.
using WindowReusePointTest = WindowCoordinatorFixture<3 * kPage>;

TEST_F(WindowReusePointTest, TheWindowBeforeEveryPointIsKeptAndTheBlocksBetweenGoFirst) {
  publishPrompt({0, 1, 2, 3, 4, 5});  // released oldest first: block 0 would go first anyway
  EXPECT_EQ(mWindow.evictablePointPages(), 4) << "blocks 1, 2 (before 3) and 4, 5 (before 6)";
  EXPECT_EQ(mWindow.evictableReadPages(), 0) << "no hit has read them";
  dropOldestWindowBlocks(2);  // the unread blocks 0 and 3, whatever their release order
  EXPECT_EQ(mWindow.evictablePointPages(), 4);
  // A prompt diverging inside block 5: the full layers match 5 blocks, whose window (blocks 3,
  // 4) lost block 3; the hit lands on the point at block 3, whose window (1, 2) is kept.
  std::vector<int32_t> diverging(mPrompt.begin(), mPrompt.begin() + std::ptrdiff_t{5} * kPage + 8);
  diverging.insert(diverging.end(), {9001, 9002, 9003});
  int32_t start = -1;
  Handle handle = admit(diverging, 1, start);
  EXPECT_EQ(start, 3 * kPage);
  EXPECT_EQ(mCoordinator.reusedWindowPages(handle, 0).size(), 2U);
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST_F(WindowReusePointTest, ThePointsAtOddIntervalsGoBeforeTheCoarserOnes) {
  publishPrompt({5, 4, 3, 2, 1, 0});  // by release order the window before 6 would go first
  dropOldestWindowBlocks(2);          // the unread blocks 3 and 0
  EXPECT_EQ(mWindow.evictablePointPages(), 4);
  // Point 3 is one interval (rank 0), point 6 two (rank 1): the pool drops the window before 3.
  dropOldestWindowBlocks(2);
  EXPECT_EQ(mWindow.evictablePointPages(), 2);
  std::vector<int32_t> extending = mPrompt;
  extending.insert(extending.end(), {9001, 9002, 9003});
  int32_t start = -1;
  Handle handle = admit(extending, 1, start);
  EXPECT_EQ(start, 6 * kPage) << "the window before 6, blocks 4 and 5, is still there";
  EXPECT_EQ(mCoordinator.reusedWindowPages(handle, 0).size(), 2U);
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST_F(WindowReusePointTest, AWindowAHitReadOutlastsThePointWindows) {
  publishPrompt({0, 1, 2, 3, 4, 5});
  int32_t start = -1;
  std::vector<int32_t> diverging(mPrompt.begin(), mPrompt.begin() + std::ptrdiff_t{3} * kPage + 5);
  diverging.push_back(9001);
  Handle handle = admit(diverging, 1, start);  // a hit at block 3 reads blocks 1 and 2
  ASSERT_EQ(start, 3 * kPage);
  std::vector<PageId> const reused = mCoordinator.reusedWindowPages(handle, 0);
  for (PageId page : reused) {
    mWindow.hold(page);
  }
  for (PageId page : reused) {
    mWindow.release(page);
  }
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
  EXPECT_EQ(mWindow.evictableReadPages(), 2);
  EXPECT_EQ(mWindow.evictablePointPages(), 2) << "blocks 4 and 5";
  dropOldestWindowBlocks(4);  // unread blocks 0 and 3, then the point window 4, 5
  EXPECT_EQ(mWindow.evictableReadPages(), 2) << "the window the hit read stays";
  EXPECT_EQ(mWindow.evictablePointPages(), 0);
}

TEST_F(WindowCoordinatorTest, WithoutPointsTheReleaseOrderDecides) {
  publishPrompt({0, 1, 2, 3, 4, 5});
  EXPECT_EQ(mWindow.keptBlocks(), 0);
  dropOldestWindowBlocks(2);  // blocks 0 and 1: no window before block 3 is left
  std::vector<int32_t> diverging(mPrompt.begin(), mPrompt.begin() + std::ptrdiff_t{5} * kPage + 8);
  diverging.insert(diverging.end(), {9001, 9002, 9003});
  int32_t start = -1;
  Handle handle = admit(diverging, 1, start);
  EXPECT_EQ(start, 5 * kPage) << "the window before block 5 (blocks 3, 4) happens to be cached";
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST_F(WindowCoordinatorTest, AFullHitWhenTheWindowIsCached) {
  publishPrompt({0, 1, 2, 3, 4, 5});
  EXPECT_EQ(mCoordinator.windowCache(), &mWindow);
  int32_t start = -1;
  Handle handle = admit(mPrompt, 1, start);
  EXPECT_EQ(start, 6 * kPage);
  EXPECT_EQ(mCoordinator.reusedWindowPages(handle, 0), (std::vector<PageId>{4, 5}));
  EXPECT_EQ(windowMisses(), 0U);
  EXPECT_EQ(mCoordinator.metrics().windowLimitedTokens, 0U);
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST_F(WindowCoordinatorTest, TheWindowRuleCapsAHitWhoseWindowWasDropped) {
  publishPrompt({4, 0, 1, 2, 3, 5});  // block 4 is dropped first
  dropOldestWindowBlocks(1);
  int32_t start = -1;
  Handle handle = admit(mPrompt, 1, start);
  // k = 6 needs blocks {4, 5}, k = 5 needs {3, 4}: k = 4 ({2, 3}) is the longest.
  EXPECT_EQ(start, 4 * kPage);
  EXPECT_EQ(mCoordinator.reuseTokenLength(handle, 0), 4 * kPage);
  EXPECT_EQ(mCoordinator.basePages(handle, 0).size(), 7U) << "4 bound + 3 private pages";
  EXPECT_EQ(mCoordinator.reusedWindowPages(handle, 0), (std::vector<PageId>{2, 3}));
  ContextCacheMetrics const metrics = mCoordinator.metrics();
  EXPECT_EQ(windowMisses(), 1U);
  EXPECT_EQ(metrics.windowLimitedTokens, uint64_t{2} * kPage);
  EXPECT_EQ(metrics.reusedTokens, uint64_t{4} * kPage);
  std::string const text = mCoordinator.toPrometheus();
  EXPECT_NE(text.find("managedkv_misses_total{reason=\"window_evicted\"} 1"), std::string::npos);
  EXPECT_NE(text.find("managedkv_window_limited_tokens_total 32"), std::string::npos);
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST_F(WindowCoordinatorTest, TheWindowACappedHitRecomputedIsKeptForTheNextHitThere) {
  publishPrompt({4, 0, 1, 2, 3, 5});
  dropOldestWindowBlocks(1);  // block 4: a hit at block 6 is capped at block 4
  int32_t start = -1;
  Handle second = admit(mPrompt, 1, start);
  ASSERT_EQ(start, 4 * kPage);
  std::vector<PageId> const reused = mCoordinator.reusedWindowPages(second, 0);  // blocks 2, 3
  for (PageId page : reused) {
    mWindow.hold(page);  // the composed request maps the reused window
  }
  prefill(second, mPrompt);
  std::vector<PageId> computed;  // blocks 4 and 5, recomputed
  ASSERT_TRUE(mWindow.allocate(2, computed));
  EXPECT_EQ(mCoordinator.publishWindowBlocks(second, 0, 4, computed), 1)
      << "block 5 is still cached on the first request's page";
  for (PageId page : computed) {
    mWindow.release(page);
  }
  for (PageId page : reused) {
    mWindow.release(page);
  }
  EXPECT_EQ(mCoordinator.finish(second), ContextCacheStatus::kOk);
  // The window before the point the lookup wanted (blocks 4 and 5) is kept with the window the
  // hit read (blocks 2 and 3); only blocks 0 and 1 are unread.
  EXPECT_EQ(mWindow.evictablePages(), 6);
  EXPECT_EQ(mWindow.evictableReadPages(), 4);
  dropOldestWindowBlocks(2);
  Handle third = admit(mPrompt, 2, start);
  EXPECT_EQ(start, 6 * kPage) << "the next hit at block 6 finds its window";
  EXPECT_EQ(mCoordinator.reusedWindowPages(third, 0).size(), 2U);
  EXPECT_EQ(windowMisses(), 1U);
  EXPECT_EQ(mCoordinator.finish(third), ContextCacheStatus::kOk);
}

TEST_F(WindowCoordinatorTest, ACappedFullInputRewindBecomesAStandardPlan) {
  std::vector<int32_t> const aligned(mPrompt.begin(), mPrompt.begin() + std::ptrdiff_t{6} * kPage);
  int32_t start = -1;
  Handle first = admit(aligned, 0, start);
  prefill(first, aligned);
  std::vector<PageId> pages;
  ASSERT_TRUE(mWindow.allocate(6, pages));
  EXPECT_EQ(mCoordinator.publishWindowBlocks(first, 0, 0, pages), 6);
  for (int32_t block : {3, 0, 1, 2, 4, 5}) {
    mWindow.release(pages[static_cast<std::size_t>(block)]);
  }
  EXPECT_EQ(mCoordinator.finish(first), ContextCacheStatus::kOk);
  dropOldestWindowBlocks(1);  // block 3
  Handle second = admit(aligned, 1, start);
  // The rewind keeps 5 blocks; k = 5 needs {3, 4}, k = 3 needs {1, 2}.
  EXPECT_EQ(start, 3 * kPage);
  EXPECT_EQ(mCoordinator.metrics().fullInputRewinds, 0U);
  EXPECT_EQ(mCoordinator.metrics().windowLimitedTokens, uint64_t{2} * kPage);
  EXPECT_EQ(windowMisses(), 1U);
  EXPECT_EQ(mCoordinator.finish(second), ContextCacheStatus::kOk);
}

TEST_F(WindowCoordinatorTest, NoCachedWindowGivesTheColdPlan) {
  publishPrompt({5, 4, 0, 1, 2, 3});
  dropOldestWindowBlocks(2);  // blocks 5 and 4: k = 4 needs {2, 3}, still cached
  int32_t start = -1;
  Handle handle = admit(mPrompt, 1, start);
  EXPECT_EQ(start, 4 * kPage);
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
  dropOldestWindowBlocks(4);  // everything
  Handle cold = admit(mPrompt, 1, start);
  EXPECT_EQ(start, 0);
  EXPECT_TRUE(mCoordinator.reusedWindowPages(cold, 0).empty());
  EXPECT_EQ(windowMisses(), 2U);
  EXPECT_EQ(mCoordinator.metrics().windowLimitedTokens, uint64_t{2 + 6} * kPage);
  EXPECT_EQ(mCoordinator.finish(cold), ContextCacheStatus::kOk);
}

TEST_F(WindowCoordinatorTest, InFlightAdmissionIsCappedTheSameWay) {
  publishPrompt({4, 0, 1, 2, 3, 5});
  dropOldestWindowBlocks(1);
  std::vector<int32_t> const other = tokenRun(2 * kPage + 1, 5000);
  int32_t start = -1;
  Handle handle = admit(other, 0, start);
  prefill(handle, other);
  auto const joined = mCoordinator.admitSequence(handle, admissionOf(mPrompt, 1), test::kVanilla);
  ASSERT_EQ(joined.status, ContextCacheStatus::kOk);
  EXPECT_EQ(joined.prefillStart, 4 * kPage);
  EXPECT_EQ(windowMisses(), 1U);
  EXPECT_EQ(mCoordinator.metrics().windowLimitedTokens, uint64_t{2} * kPage);
  EXPECT_EQ(mCoordinator.reusedWindowPages(handle, 1), (std::vector<PageId>{2, 3}));
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST_F(WindowCoordinatorTest, PublishWindowBlocksContracts) {
  int32_t start = -1;
  Handle handle = admit(mPrompt, 0, start);
  std::vector<PageId> pages;
  ASSERT_TRUE(mWindow.allocate(3, pages));
  constexpr char const* kCall = "ContextCacheCoordinator::publishWindowBlocks";
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 0, pages); },
                          {kCall, "has not completed its prefill"}));
  prefill(handle, mPrompt);
  int32_t const cachedBefore = mWindow.cachedBlocks();
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 1, 0, pages); },
                          {kCall, "row 1"}));
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 4, pages); },
                          {kCall, "blocks [4, 7)", "6 full blocks"}));
  EXPECT_TRUE(
      throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, -1, pages); }, {kCall, "-1"}));
  std::vector<PageId> const twice{pages[0], pages[1], pages[0]};
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 0, twice); },
                          {kCall, "given twice"}));
  std::vector<PageId> const unheld{pages[0], 9};
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 0, unheld); },
                          {kCall, "sliding page 9 is not held"}));
  std::vector<PageId> const outside{pages[0], kSlidingPages};
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 0, outside); },
                          {kCall, "page 16 outside"}));
  EXPECT_EQ(mWindow.cachedBlocks(), cachedBefore) << "nothing published by a refused call";
  EXPECT_EQ(mCoordinator.publishWindowBlocks(handle, 0, 0, pages), 3);
  EXPECT_EQ(mCoordinator.publishWindowBlocks(handle, 0, 0, pages), 3) << "already there";
  std::vector<PageId> more;
  ASSERT_TRUE(mWindow.allocate(2, more));
  EXPECT_EQ(mCoordinator.publishWindowBlocks(handle, 0, 2, more), 1)
      << "block 2 is cached on another page already (first committer wins); block 3 is new";
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 1, more); },
                          {kCall, "already caches another block"}));
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
  EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 0, pages); }, {kCall}));
  EXPECT_TRUE(throwsError([&] { (void)mCoordinator.reusedWindowPages(handle, 0); },
                          {"ContextCacheCoordinator::reusedWindowPages"}));
  for (PageId page : pages) {
    mWindow.release(page);
  }
  for (PageId page : more) {
    mWindow.release(page);
  }
}

/// Decode steps of row 0 past its prompt: `steps` tokens committed, one per step.
void decodeSteps(ContextCacheCoordinator& coordinator,
                 ContextCacheCoordinator::RequestHandle& handle, int32_t committed, int32_t steps) {
  for (int32_t step = 0; step < steps; ++step) {
    ASSERT_EQ(coordinator.prepareDecodeStep(handle, test::kVanilla), ContextCacheStatus::kOk);
    int32_t const token = 100 + step;
    ContextCacheSequenceAdvance const advance{&token, 1, committed + step + 1};
    ASSERT_EQ(coordinator.completeDecodeStep(handle, {&advance, 1}, {}, {}),
              ContextCacheStatus::kOk);
  }
}

TEST_F(WindowCoordinatorTest, GeneratedBlocksArePublishedUnderTheRequestsCommitPolicy) {
  constexpr char const* kCall = "ContextCacheCoordinator::publishWindowBlocks";
  for (ContextCacheCommitPolicy policy : {ContextCacheCommitPolicy::kIncludingGeneratedTokens,
                                          ContextCacheCommitPolicy::kPrefillStateOnly}) {
    SCOPED_TRACE(static_cast<int>(policy));
    ContextCacheBatchAdmission batch;
    batch.sequences.push_back(admissionOf(mPrompt, 0));
    batch.commitPolicy = policy;
    auto result = mCoordinator.beginRequest(batch, test::kVanilla, nullptr);
    ASSERT_EQ(result.status, ContextCacheStatus::kOk);
    Handle handle = std::move(result.admission->request);
    prefill(handle, mPrompt);  // 97 tokens committed: 6 full blocks
    ASSERT_NO_FATAL_FAILURE(decodeSteps(mCoordinator, handle, 6 * kPage + 1, kPage));
    // 113 tokens committed: block 6 (the prompt's last token and 15 generated ones) is full.
    std::vector<PageId> page;
    ASSERT_TRUE(mWindow.allocate(1, page));
    if (policy == ContextCacheCommitPolicy::kIncludingGeneratedTokens) {
      EXPECT_EQ(mCoordinator.publishWindowBlocks(handle, 0, 6, page), 1);
      EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 7, page); },
                              {kCall, "blocks [7, 8)", "committed tokens (7 full blocks)"}));
    } else {
      EXPECT_TRUE(throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 6, page); },
                              {kCall, "blocks [6, 7)", "prompt (6 full blocks)"}));
    }
    EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
    mWindow.release(page[0]);
  }
}

TEST_F(WindowCoordinatorTest, ThePrometheusTextCarriesTheSlidingPool) {
  publishPrompt({5, 4, 3, 2, 1, 0});
  std::string const text = mCoordinator.toPrometheus("engine_");
  for (std::string const line :
       {"engine_sliding_pool_pages 16\n", "engine_sliding_pool_free_pages 10\n",
        "engine_sliding_pool_held_pages 0\n", "engine_sliding_window_cached_blocks 6\n",
        "engine_sliding_window_read_blocks 0\n", "engine_sliding_window_published_blocks_total 6\n",
        "engine_sliding_window_dropped_blocks_total 0\n",
        "engine_sliding_window_kept_blocks_total 0\n",
        "# TYPE engine_sliding_window_dropped_blocks_total counter\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << text;
  }
}

TEST_F(WindowCoordinatorTest, ABypassRowPublishesNothing) {
  int32_t start = -1;
  Handle handle = admit(mPrompt, 0, start, ContextCacheLookupPolicy::kBypass);
  prefill(handle, mPrompt);
  std::vector<PageId> pages;
  ASSERT_TRUE(mWindow.allocate(2, pages));
  EXPECT_EQ(mCoordinator.publishWindowBlocks(handle, 0, 0, pages), 0);
  EXPECT_EQ(mWindow.cachedBlocks(), 0);
  std::vector<PageId> const unheld{pages[0], 9};
  EXPECT_TRUE(
      throwsError([&] { mCoordinator.publishWindowBlocks(handle, 0, 0, unheld); },
                  {"ContextCacheCoordinator::publishWindowBlocks", "sliding page 9 is not held"}))
      << "a bypass row's pages are checked all the same";
  EXPECT_TRUE(mCoordinator.reusedWindowPages(handle, 0).empty());
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
  for (PageId page : pages) {
    mWindow.release(page);
  }
}

TEST_F(WindowCoordinatorTest, ReusedWindowPagesThrowsWhenTheWindowLeftTheCache) {
  publishPrompt({0, 1, 2, 3, 4, 5});
  int32_t start = -1;
  Handle handle = admit(mPrompt, 1, start);
  ASSERT_EQ(start, 6 * kPage);
  dropOldestWindowBlocks(6);  // the caller did not hold the window: it was dropped
  EXPECT_TRUE(throwsError([&] { (void)mCoordinator.reusedWindowPages(handle, 0); },
                          {"ContextCacheCoordinator::reusedWindowPages", "block 4"}));
  EXPECT_EQ(mCoordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST(WindowCoordinatorWithoutCacheTest, TheWindowCallsNeedAWindowCache) {
  CoordinatorRig rig(DeviceType::kCPU, rigOptions());
  test::Seq seq(tokenRun(2 * kPage + 1, 0), 0);
  Handle handle = rig.admit({&seq});
  ASSERT_EQ(rig.prefill(handle, {&seq}), ContextCacheStatus::kOk);
  EXPECT_EQ(rig.coordinator.windowCache(), nullptr);
  std::vector<PageId> const pages{0};
  EXPECT_TRUE(throwsError([&] { rig.coordinator.publishWindowBlocks(handle, 0, 0, pages); },
                          {"ContextCacheCoordinator::publishWindowBlocks", "no window cache"}));
  EXPECT_TRUE(throwsError([&] { (void)rig.coordinator.reusedWindowPages(handle, 0); },
                          {"ContextCacheCoordinator::reusedWindowPages", "no window cache"}));
  EXPECT_EQ(rig.coordinator.finish(handle), ContextCacheStatus::kOk);
}

TEST(WindowDeploymentTest, OnlyVanillaAttentionReuseTakesAWindowCache) {
  RigOptions const options = rigOptions();
  KVCachePool pool(CoordinatorRig::poolConfig(DeviceType::kCPU, options));
  KVPageTable table(options.maxBatch, options.maxPagesPerSeq, options.numPages,
                    PageTableMode::kDense, DeviceType::kCPU);
  WindowBlockCache window(8, kPage, kWindowTokens, true);
  WindowBlockCache wide(8, 2 * kPage, kWindowTokens, true);
  HostKvTierConfig tierConfig;
  tierConfig.numPages = 4;
  HostKvTier tier(tierConfig, pool);
  auto refusal = [&](ContextCacheConfig const& config, ContextCacheDeploymentProfile const& profile,
                     WindowBlockCache* cache, HostKvTier* host) {
    ContextCachePhysicalResources resources{&pool, &table, nullptr, nullptr, nullptr};
    resources.windowCache = cache;
    resources.hostTier = host;
    try {
      ContextCacheCoordinator coordinator(config, profile, resources, nullptr);
    } catch (Error const& error) {
      return std::string(error.what());
    }
    return std::string("accepted");
  };
  ContextCacheConfig const enabled = CoordinatorRig::cacheConfig(options);
  EXPECT_EQ(refusal(enabled, {}, &window, nullptr), "accepted");
  ContextCacheConfig points = enabled;
  points.checkpointInterval = 4 * kPage;
  EXPECT_EQ(refusal(points, {}, &window, nullptr), "accepted") << "windows kept before points";
  EXPECT_NE(refusal(points, {}, nullptr, nullptr).find("checkpointInterval 64 is for hybrid"),
            std::string::npos);
  points.checkpointInterval = 40;
  EXPECT_NE(refusal(points, {}, &window, nullptr)
                .find("checkpointInterval 40 is not a multiple of the page size 16"),
            std::string::npos);
  ContextCacheConfig disabled = enabled;
  disabled.enabled = false;
  EXPECT_NE(refusal(disabled, {}, &window, nullptr)
                .find("ContextCacheCoordinator: resources.windowCache needs context reuse enabled"),
            std::string::npos);
  ContextCacheDeploymentProfile hybrid;
  hybrid.baseStateKind = BaseStateKind::kHybrid;
  std::string const hybridRefusal = refusal(enabled, hybrid, &window, nullptr);
  EXPECT_NE(hybridRefusal.find("non-speculative deployments only (this one is hybrid)"),
            std::string::npos)
      << hybridRefusal;
  ContextCacheDeploymentProfile speculative;
  speculative.speculative = SpecReuseContract{false, 0};
  std::string const specRefusal = refusal(enabled, speculative, &window, nullptr);
  EXPECT_NE(specRefusal.find("(this one is attention-only, speculative)"), std::string::npos)
      << specRefusal;
  std::string const tierRefusal = refusal(enabled, {}, &window, &tier);
  EXPECT_NE(tierRefusal.find("resources.windowCache cannot be combined with resources.hostTier"),
            std::string::npos)
      << tierRefusal;
  std::string const pageRefusal = refusal(enabled, {}, &wide, nullptr);
  EXPECT_NE(pageRefusal.find("resources.windowCache has pages of 32 tokens but the base pool 16"),
            std::string::npos)
      << pageRefusal;
}

}  // namespace
}  // namespace mkv
