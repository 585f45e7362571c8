#include "context_cache/window_block_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <utility>
#include <variant>
#include <vector>

#include "context_cache_test_support.h"
#include "mkv/error.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;
using test::tokenRun;
using test::viewOf;

constexpr int32_t kPage = 4;
constexpr KvCacheGroup kSlidingGroup{1, KvCacheSpecKind::kSlidingWindow, 6};

/// The digests of the BlockRemoved events among `events`, in order (each of the sliding group).
std::vector<Hash128> removedDigests(std::vector<KvEvent> const& events) {
  std::vector<Hash128> digests;
  for (KvEvent const& event : events) {
    if (auto const* removed = std::get_if<BlockRemoved>(&event)) {
      EXPECT_EQ(removed->group, kSlidingGroup);
      digests.push_back(removed->digest);
    }
  }
  return digests;
}

/// Everything a caller can observe of a cache: counts, holders and the digest of every page.
struct CacheState {
  int32_t free = 0;
  int32_t held = 0;
  int32_t cached = 0;
  int32_t evictable = 0;
  std::vector<int32_t> holders;
  std::vector<std::optional<Hash128>> digests;
  friend bool operator==(CacheState const&, CacheState const&) = default;
};

CacheState stateOf(WindowBlockCache const& cache) {
  CacheState state{
      cache.freePages(), cache.heldPages(), cache.cachedBlocks(), cache.evictablePages(), {}, {}};
  for (PageId page = 0; page < cache.totalPages(); ++page) {
    state.holders.push_back(cache.holders(page));
    state.digests.push_back(cache.index().digestOf(page));
  }
  return state;
}

/// Pages the cache hands out, one allocate(count) call (asserting it succeeds).
std::vector<PageId> allocated(WindowBlockCache& cache, int32_t count) {
  std::vector<PageId> pages;
  EXPECT_TRUE(cache.allocate(count, pages));
  return pages;
}

class WindowBlockCacheTest : public ::testing::Test {
 protected:
  // 6 blocks; a window of 6 tokens spans ceil(6 / 4) = 2 blocks.
  std::vector<int32_t> mTokens = tokenRun(6 * kPage + 1, 0);
  std::vector<int32_t> mOther = tokenRun(6 * kPage, 900);
  PromptBlocks mBlocks = hashPromptBlocks(viewOf(mTokens), kPage);
  PromptBlocks mOtherBlocks = hashPromptBlocks(viewOf(mOther), kPage);
  WindowBlockCache mCache{8, kPage, /*windowTokens=*/6, /*verifyTokens=*/true};
  KvEventQueue mEvents{64, kPage};

  WindowBlockCacheTest() { mCache.announceTo(&mEvents, kSlidingGroup); }

  /// The digests of the blocks dropped since the last call, from the queued events.
  std::vector<Hash128> takeDropped() { return removedDigests(mEvents.drain()); }

  /// Allocates a page, publishes block `block` of `blocks` on it and releases it (cached).
  PageId cacheBlock(PromptBlocks const& blocks, int32_t block) {
    PageId const page = allocated(mCache, 1).at(0);
    EXPECT_TRUE(mCache.publish(page, blocks, block));
    mCache.release(page);
    return page;
  }
};

TEST_F(WindowBlockCacheTest, ConstructorRefusesEmptyGeometry) {
  EXPECT_TRUE(throwsError([] { WindowBlockCache(0, kPage, 6, true); },
                          {"WindowBlockCache", "capacity", "0"}));
  EXPECT_TRUE(throwsError([] { WindowBlockCache(8, -1, 6, true); },
                          {"WindowBlockCache", "page size", "-1"}));
  EXPECT_TRUE(throwsError([] { WindowBlockCache(8, kPage, 0, true); },
                          {"WindowBlockCache", "window", "0"}));
  EXPECT_EQ(WindowBlockCache(8, kPage, 4, true).windowBlocks(), 1);
  EXPECT_EQ(WindowBlockCache(8, kPage, 5, true).windowBlocks(), 2);
  EXPECT_EQ(mCache.windowTokens(), 6);
  EXPECT_EQ(mCache.windowBlocks(), 2);
}

TEST_F(WindowBlockCacheTest, AllocateHandsOutFreePagesLowestFirstAllOrNothing) {
  EXPECT_EQ(allocated(mCache, 3), (std::vector<PageId>{0, 1, 2}));
  mCache.release(1);
  mCache.release(0);
  EXPECT_EQ(allocated(mCache, 1), (std::vector<PageId>{0})) << "lowest free id, not last freed";
  std::vector<PageId> out{42};
  CacheState const before = stateOf(mCache);
  EXPECT_FALSE(mCache.allocate(8, out)) << "only 6 are available";
  EXPECT_EQ(out, (std::vector<PageId>{42}));
  EXPECT_EQ(stateOf(mCache), before);
  EXPECT_TRUE(throwsError([&] { mCache.allocate(-2, out); }, {"WindowBlockCache::allocate", "-2"}));
  EXPECT_EQ(stateOf(mCache), before);
  EXPECT_TRUE(mCache.allocate(0, out));
  EXPECT_EQ(out, (std::vector<PageId>{42}));
  EXPECT_EQ(mCache.availablePages(), 6);
  EXPECT_EQ(mCache.heldPages(), 2);
}

TEST_F(WindowBlockCacheTest, HoldCountsHoldersAndRefusesFreePages) {
  PageId const page = allocated(mCache, 1).at(0);
  mCache.hold(page);
  EXPECT_EQ(mCache.holders(page), 2);
  EXPECT_EQ(mCache.heldPages(), 1);
  mCache.release(page);
  EXPECT_EQ(mCache.holders(page), 1);
  mCache.release(page);
  EXPECT_EQ(mCache.freePages(), 8) << "an unpublished page nobody holds is free";
  CacheState const before = stateOf(mCache);
  EXPECT_TRUE(throwsError([&] { mCache.hold(page); }, {"WindowBlockCache::hold", "page 0"}));
  EXPECT_TRUE(throwsError([&] { mCache.hold(8); }, {"WindowBlockCache::hold", "page 8"}));
  EXPECT_TRUE(throwsError([&] { (void)mCache.holders(-1); }, {"WindowBlockCache::holders", "-1"}));
  EXPECT_EQ(stateOf(mCache), before);
}

TEST(WindowBlockCacheDeathTest, ReleasingAPageNobodyHoldsTerminates) {
  WindowBlockCache cache(4, kPage, 6, true);
  EXPECT_DEATH(cache.release(3), "no holder");
}

TEST_F(WindowBlockCacheTest, PublishedPagesStayCachedAndHoldableAfterRelease) {
  PageId const page = cacheBlock(mBlocks, 0);
  EXPECT_EQ(mCache.cachedBlocks(), 1);
  EXPECT_EQ(mCache.evictablePages(), 1);
  EXPECT_EQ(mCache.freePages(), 7);
  EXPECT_EQ(mCache.availablePages(), 8);
  mCache.hold(page);  // a window maps the reused block
  EXPECT_EQ(mCache.evictablePages(), 0);
  EXPECT_EQ(mCache.heldPages(), 1);
  EXPECT_EQ(mCache.availablePages(), 7);
  mCache.release(page);
  EXPECT_EQ(mCache.evictablePages(), 1);
  EXPECT_EQ(mCache.index().digestOf(page), mBlocks.keys[0]);
}

TEST_F(WindowBlockCacheTest, PublishContracts) {
  PageId const page = allocated(mCache, 1).at(0);
  ASSERT_TRUE(mCache.publish(page, mBlocks, 1));
  EXPECT_TRUE(mCache.publish(page, mBlocks, 1)) << "already indexed there";
  CacheState const before = stateOf(mCache);
  EXPECT_TRUE(throwsError([&] { mCache.publish(page, mBlocks, 2); },
                          {"WindowBlockCache::publish", "page 0 already caches"}));
  EXPECT_TRUE(throwsError([&] { mCache.publish(5, mBlocks, 2); },
                          {"WindowBlockCache::publish", "page 5 is not held"}));
  EXPECT_TRUE(
      throwsError([&] { mCache.publish(9, mBlocks, 2); }, {"WindowBlockCache::publish", "page 9"}));
  EXPECT_TRUE(throwsError([&] { mCache.publish(page, mBlocks, 6); },
                          {"WindowBlockCache::publish", "block 6"}));
  std::vector<int32_t> const tokens = tokenRun(2 * 8, 0);
  PromptBlocks const wide = hashPromptBlocks(viewOf(tokens), 8);
  EXPECT_TRUE(throwsError([&] { mCache.publish(page, wide, 0); },
                          {"WindowBlockCache::publish", "page size 8"}));
  EXPECT_EQ(stateOf(mCache), before);
}

TEST_F(WindowBlockCacheTest, FirstCommitterWins) {
  std::vector<PageId> const pages = allocated(mCache, 2);
  ASSERT_TRUE(mCache.publish(pages[0], mBlocks, 0));
  EXPECT_FALSE(mCache.publish(pages[1], mBlocks, 0));
  EXPECT_FALSE(mCache.index().digestOf(pages[1]).has_value());
  EXPECT_EQ(mCache.index().find(mBlocks.keys[0]), pages[0]);
  mCache.release(pages[1]);
  EXPECT_EQ(mCache.freePages(), 7) << "the loser's page is free again";
}

TEST_F(WindowBlockCacheTest, AllocateDropsTheLeastRecentlyReleasedCachedPage) {
  std::vector<PageId> const pages = allocated(mCache, 8);
  for (int32_t b = 0; b < 6; ++b) {
    ASSERT_TRUE(mCache.publish(pages[static_cast<std::size_t>(b)], mBlocks, b));
  }
  for (PageId page : {3, 0, 5}) {
    mCache.release(page);
  }
  mCache.release(6);  // unpublished: free, handed out before any cached page
  EXPECT_EQ(allocated(mCache, 1), (std::vector<PageId>{6}));
  EXPECT_TRUE(takeDropped().empty());
  EXPECT_EQ(allocated(mCache, 2), (std::vector<PageId>{3, 0}));
  EXPECT_EQ(takeDropped(), (std::vector<Hash128>{mBlocks.keys[3], mBlocks.keys[0]}));
  EXPECT_TRUE(takeDropped().empty()) << "the list empties when taken";
  EXPECT_FALSE(mCache.index().find(mBlocks.keys[3]).has_value());
  EXPECT_EQ(mCache.holders(3), 1);
  mCache.hold(5);  // held again: leaves the release order
  std::vector<PageId> out;
  EXPECT_FALSE(mCache.allocate(1, out));
  mCache.release(5);
  EXPECT_EQ(allocated(mCache, 1), (std::vector<PageId>{5}));
  EXPECT_EQ(takeDropped(), (std::vector<Hash128>{mBlocks.keys[5]}));
}

TEST_F(WindowBlockCacheTest, BlocksAHitReadAreDroppedAfterEveryUnreadOne) {
  std::vector<PageId> const pages = allocated(mCache, 8);  // the whole pool: nothing free
  for (int32_t b = 0; b < 3; ++b) {
    ASSERT_TRUE(mCache.publish(pages[static_cast<std::size_t>(b)], mBlocks, b));
  }
  mCache.release(pages[0]);
  mCache.hold(pages[0]);  // a hit's window maps block 0: it is read
  mCache.release(pages[0]);
  mCache.release(pages[1]);  // released later than block 0, but never read
  mCache.release(pages[2]);
  EXPECT_EQ(mCache.evictablePages(), 3);
  EXPECT_EQ(mCache.evictableReadPages(), 1);
  // Least recent release alone would drop block 0 first; unread blocks go before it.
  EXPECT_EQ(allocated(mCache, 2), (std::vector<PageId>{pages[1], pages[2]}));
  EXPECT_EQ(allocated(mCache, 1), (std::vector<PageId>{pages[0]}));
  EXPECT_EQ(takeDropped(),
            (std::vector<Hash128>{mBlocks.keys[1], mBlocks.keys[2], mBlocks.keys[0]}));
  // A page dropped and published again starts unread.
  mCache.release(pages[0]);
  EXPECT_EQ(mCache.evictableReadPages(), 0);
}

TEST_F(WindowBlockCacheTest, KeepWindowBeforeMovesTheWindowToTheReadTier) {
  std::vector<PageId> const pages = allocated(mCache, 8);  // the whole pool: nothing free
  for (int32_t b = 0; b < 4; ++b) {
    ASSERT_TRUE(mCache.publish(pages[static_cast<std::size_t>(b)], mBlocks, b));
  }
  mCache.release(pages[0]);  // cached, nobody holds it
  mCache.release(pages[1]);
  // The window before block 3 is blocks [1, 3) (2 blocks): block 1 is cached and released,
  // block 2 still held by the prefill that recomputed it.
  EXPECT_EQ(mCache.keepWindowBefore(mBlocks, 3), 2);
  EXPECT_EQ(mCache.evictableReadPages(), 1) << "block 1 moved between the orders";
  EXPECT_EQ(mCache.keepWindowBefore(mBlocks, 3), 0) << "already kept";
  EXPECT_EQ(mCache.keptBlocks(), 2);
  mCache.release(pages[2]);  // joins the read tier at its release
  mCache.release(pages[3]);  // block 3 is outside the window: unread
  EXPECT_EQ(mCache.evictableReadPages(), 2);
  // Unread blocks 0 and 3 go first (least recently released first), then the kept window.
  EXPECT_EQ(allocated(mCache, 4), (std::vector<PageId>{pages[0], pages[3], pages[1], pages[2]}));
  EXPECT_EQ(takeDropped(), (std::vector<Hash128>{mBlocks.keys[0], mBlocks.keys[3], mBlocks.keys[1],
                                                 mBlocks.keys[2]}));
}

TEST_F(WindowBlockCacheTest, PointWindowsGoByRankAfterUnreadBlocksAndBeforeReadOnes) {
  std::vector<PageId> const pages = allocated(mCache, 8);  // the whole pool: nothing free
  for (int32_t b = 0; b < 6; ++b) {
    ASSERT_TRUE(mCache.publish(pages[static_cast<std::size_t>(b)], mBlocks, b));
    mCache.release(pages[static_cast<std::size_t>(b)]);
  }
  EXPECT_EQ(mCache.keepPointWindow(mBlocks, 2, 1), 2) << "blocks 0 and 1 at rank 1";
  EXPECT_EQ(mCache.keepPointWindow(mBlocks, 4, 0), 2) << "blocks 2 and 3 at rank 0";
  EXPECT_EQ(mCache.keepPointWindow(mBlocks, 3, 0), 0) << "block 1 keeps rank 1, block 2 rank 0";
  EXPECT_EQ(mCache.keepPointWindow(mBlocks, 2, 2), 2) << "raised to rank 2";
  EXPECT_EQ(mCache.evictablePointPages(), 4);
  EXPECT_EQ(mCache.keptBlocks(), 0) << "point windows are not kept reads";
  mCache.hold(pages[5]);  // block 5 read by a hit's window: the read tier
  mCache.release(pages[5]);
  EXPECT_EQ(mCache.keepPointWindow(mBlocks, 6, 3), 1) << "block 4 only: block 5 stays read";
  // Unread first (none left), then rank 0 (2, 3), rank 2 (0, 1), rank 3 (4), then read (5).
  EXPECT_EQ(allocated(mCache, 6),
            (std::vector<PageId>{pages[2], pages[3], pages[0], pages[1], pages[4], pages[5]}));
  EXPECT_EQ(mCache.evictablePointPages(), 0);
}

TEST_F(WindowBlockCacheTest, KeepWindowBeforeSkipsBlocksNotCachedAndChecksItsArguments) {
  PageId const page = cacheBlock(mOtherBlocks, 1);  // another prompt's block 1
  CacheState const before = stateOf(mCache);
  EXPECT_EQ(mCache.keepWindowBefore(mBlocks, 2), 0) << "neither block of the window is cached";
  EXPECT_EQ(mCache.keepWindowBefore(mBlocks, 0), 0) << "an empty window";
  EXPECT_TRUE(throwsError([&] { (void)mCache.keepWindowBefore(mBlocks, 7); },
                          {"WindowBlockCache::keepWindowBefore", "window end block 7"}));
  EXPECT_TRUE(throwsError([&] { (void)mCache.keepWindowBefore(mBlocks, -1); },
                          {"WindowBlockCache::keepWindowBefore", "-1"}));
  std::vector<int32_t> const tokens = tokenRun(16, 0);
  PromptBlocks const wide = hashPromptBlocks(viewOf(tokens), 8);
  EXPECT_TRUE(throwsError([&] { (void)mCache.keepWindowBefore(wide, 1); },
                          {"WindowBlockCache::keepWindowBefore", "page size 8"}));
  EXPECT_EQ(stateOf(mCache), before);
  EXPECT_EQ(mCache.evictableReadPages(), 0);
  EXPECT_EQ(mCache.keepWindowBefore(mOtherBlocks, 2), 1);
  EXPECT_EQ(mCache.evictableReadPages(), 1);
  EXPECT_EQ(mCache.holders(page), 0);
}

TEST_F(WindowBlockCacheTest, PublicationsAndDropsAreAnnouncedWhenTheyHappen) {
  PageId const first = allocated(mCache, 1).at(0);
  ASSERT_TRUE(mCache.publish(first, mBlocks, 0));
  ASSERT_TRUE(mCache.publish(first, mBlocks, 0)) << "already indexed there: no second event";
  PageId const second = allocated(mCache, 1).at(0);
  ASSERT_TRUE(mCache.publish(second, mBlocks, 1));
  EXPECT_FALSE(mCache.publish(allocated(mCache, 1).at(0), mBlocks, 1)) << "first committer wins";
  std::vector<KvEvent> const events = mEvents.drain();
  ASSERT_EQ(events.size(), 2U);
  auto const& stored = std::get<BlockStored>(events[1]);
  EXPECT_EQ(stored.digest, mBlocks.keys[1]);
  EXPECT_EQ(stored.parent, mBlocks.keys[0]);
  EXPECT_EQ(stored.page, second);
  EXPECT_EQ(stored.tokenCount, kPage);
  EXPECT_EQ(stored.tokens, std::vector<int32_t>(mTokens.begin() + kPage, mTokens.begin() + 8));
  EXPECT_EQ(stored.medium, KvMedium::kGpu);
  EXPECT_EQ(stored.group, kSlidingGroup);
  EXPECT_EQ(std::get<BlockStored>(events[0]).parent, kBlockChainRoot);

  // Dropped and published again before the next drain: removed, then stored, in that order.
  mCache.release(first);
  std::vector<PageId> const rest = allocated(mCache, 5);  // every free page
  ASSERT_EQ(allocated(mCache, 1), (std::vector<PageId>{first}));
  ASSERT_TRUE(mCache.publish(first, mBlocks, 0));
  std::vector<KvEvent> const again = mEvents.drain();
  ASSERT_EQ(again.size(), 2U);
  EXPECT_EQ(std::get<BlockRemoved>(again[0]),
            (BlockRemoved{mBlocks.keys[0], first, KvMedium::kGpu, kSlidingGroup}));
  EXPECT_EQ(std::get<BlockStored>(again[1]).digest, mBlocks.keys[0]);

  // A cache that announces nowhere still counts its drops; a clear announces nothing.
  mCache.announceTo(nullptr, {});
  EXPECT_EQ(mCache.announcedTo(), nullptr);
  mCache.release(second);
  EXPECT_EQ(allocated(mCache, 1), (std::vector<PageId>{second}));
  EXPECT_EQ(mCache.droppedBlocks(), 2);
  mCache.announceTo(&mEvents, kSlidingGroup);
  EXPECT_EQ(mCache.clear(), 1);
  EXPECT_EQ(mCache.droppedBlocks(), 3);
  EXPECT_EQ(mEvents.size(), 0);
  (void)rest;
}

TEST_F(WindowBlockCacheTest, ClearDropsCachedBlocksAndKeepsHeldPagesHeld) {
  PageId const cached = cacheBlock(mBlocks, 0);
  PageId const held = allocated(mCache, 1).at(0);
  ASSERT_TRUE(mCache.publish(held, mBlocks, 1));
  PageId const plain = allocated(mCache, 1).at(0);
  EXPECT_EQ(mCache.clear(), 2);
  EXPECT_EQ(mCache.cachedBlocks(), 0);
  EXPECT_EQ(mCache.evictablePages(), 0);
  EXPECT_EQ(mCache.holders(held), 1);
  EXPECT_EQ(mCache.holders(plain), 1);
  EXPECT_EQ(mCache.holders(cached), 0);
  EXPECT_EQ(mCache.freePages(), 6);
  EXPECT_EQ(mCache.droppedBlocks(), 2);
  EXPECT_TRUE(takeDropped().empty()) << "the reset's AllBlocksCleared covers a clear";
  mCache.release(held);
  EXPECT_EQ(mCache.freePages(), 7) << "an unindexed page nobody holds is free";
  EXPECT_EQ(mCache.clear(), 0);
}

class WindowedPrefixTest : public WindowBlockCacheTest {};

TEST_F(WindowedPrefixTest, NeedsTheWindowBeforeThePrefixEnd) {
  EXPECT_EQ(mCache.longestWindowedPrefix(mBlocks, 6), 0) << "0 always qualifies";
  for (int32_t b : {1, 2, 4, 5}) {
    cacheBlock(mBlocks, b);
  }
  // Blocks 0 and 3 missing: k = 3 needs {1, 2}; k = 6 needs {4, 5}; k = 4 needs {2, 3}.
  EXPECT_EQ(mCache.longestWindowedPrefix(mBlocks, 6), 6);
  EXPECT_EQ(mCache.longestWindowedPrefix(mBlocks, 5), 3) << "k = 5 needs block 3";
  EXPECT_EQ(mCache.longestWindowedPrefix(mBlocks, 2), 0) << "k = 2 needs block 0";
  EXPECT_EQ(mCache.longestWindowedPrefix(mBlocks, 0), 0);
  EXPECT_EQ(mCache.windowPages("test", mBlocks, 6), (std::vector<PageId>{2, 3}));
  EXPECT_TRUE(mCache.windowPages("test", mBlocks, 0).empty());
  EXPECT_TRUE(throwsError([&] { (void)mCache.windowPages("Caller::call", mBlocks, 5); },
                          {"Caller::call", "block 3"}));
}

TEST_F(WindowedPrefixTest, WindowLongerThanThePrefixNeedsEveryBlock) {
  WindowBlockCache cache(8, kPage, /*windowTokens=*/100, true);  // 25 blocks
  std::vector<PageId> pages;
  ASSERT_TRUE(cache.allocate(3, pages));
  for (int32_t b : {0, 1, 2}) {
    ASSERT_TRUE(cache.publish(pages[static_cast<std::size_t>(b)], mBlocks, b));
  }
  EXPECT_EQ(cache.longestWindowedPrefix(mBlocks, 6), 3);
  EXPECT_EQ(cache.windowPages("test", mBlocks, 3), pages);
  cache.release(pages[0]);
  EXPECT_EQ(cache.longestWindowedPrefix(mBlocks, 6), 3) << "released, still cached";
  std::vector<PageId> more;
  ASSERT_TRUE(cache.allocate(6, more));  // 5 free, then drops block 0
  EXPECT_EQ(cache.longestWindowedPrefix(mBlocks, 6), 0);
}

TEST_F(WindowedPrefixTest, WindowShorterThanAPageNeedsOneBlock) {
  WindowBlockCache cache(8, kPage, /*windowTokens=*/1, true);
  std::vector<PageId> pages;
  ASSERT_TRUE(cache.allocate(1, pages));
  ASSERT_TRUE(cache.publish(pages[0], mBlocks, 4));
  EXPECT_EQ(cache.windowBlocks(), 1);
  EXPECT_EQ(cache.longestWindowedPrefix(mBlocks, 6), 5);
  EXPECT_EQ(cache.longestWindowedPrefix(mBlocks, 4), 0);
  EXPECT_EQ(cache.windowPages("test", mBlocks, 5), pages);
}

TEST_F(WindowedPrefixTest, VerificationRejectsABlockWithOtherTokens) {
  PageId const page = allocated(mCache, 1).at(0);
  // Another prompt's block 1 under our block 1's digest: a collision in the sliding index.
  ASSERT_EQ(const_cast<BlockIndex&>(mCache.index()).insert(mBlocks.keys[1], page, mOtherBlocks, 1),
            page);
  cacheBlock(mBlocks, 0);
  EXPECT_EQ(mCache.longestWindowedPrefix(mBlocks, 2), 1);
  EXPECT_TRUE(throwsError([&] { (void)mCache.windowPages("Caller::call", mBlocks, 2); },
                          {"Caller::call", "block 1"}));
  WindowBlockCache unverified(8, kPage, 6, /*verifyTokens=*/false);
  std::vector<PageId> pages;
  ASSERT_TRUE(unverified.allocate(2, pages));
  ASSERT_EQ(const_cast<BlockIndex&>(unverified.index())
                .insert(mBlocks.keys[1], pages[1], mOtherBlocks, 1),
            pages[1]);
  ASSERT_TRUE(unverified.publish(pages[0], mBlocks, 0));
  EXPECT_EQ(unverified.longestWindowedPrefix(mBlocks, 2), 2) << "without verification, trusted";
}

TEST_F(WindowedPrefixTest, ArgumentContracts) {
  EXPECT_TRUE(throwsError([&] { (void)mCache.longestWindowedPrefix(mBlocks, 7); },
                          {"WindowBlockCache::longestWindowedPrefix", "maxBlocks 7"}));
  EXPECT_TRUE(throwsError([&] { (void)mCache.longestWindowedPrefix(mBlocks, -1); },
                          {"WindowBlockCache::longestWindowedPrefix", "-1"}));
  std::vector<int32_t> const tokens = tokenRun(16, 0);
  PromptBlocks const wide = hashPromptBlocks(viewOf(tokens), 8);
  EXPECT_TRUE(throwsError([&] { (void)mCache.longestWindowedPrefix(wide, 1); },
                          {"WindowBlockCache::longestWindowedPrefix", "page size 8"}));
  EXPECT_TRUE(throwsError([&] { (void)mCache.windowPages("Caller::call", mBlocks, 7); },
                          {"Caller::call", "7"}));
}

// ---------------------------------------------------------------------------------------------
// Property test: random operations against a model of the pool.

/// The model: holders, digest (block number) and tier per page (unread; the window before a
/// reuse point, by rank; read by a window or kept by keepWindowBefore); the release orders of
/// cached pages nobody holds, one per tier, dropped lowest tier first; and the events the cache
/// must have announced, in order.
struct PoolModel {
  static constexpr int32_t kRead = WindowBlockCache::kMaxPointRank + 2;  ///< tier; 1 + r: rank r
  std::vector<int32_t> holders;
  std::vector<int32_t> block;  ///< -1: unindexed
  std::vector<int32_t> tier;
  std::vector<std::deque<PageId>> released;  ///< per tier, oldest first
  /// (stored?, block): a publication that indexed a block, or an allocation that dropped one.
  std::vector<std::pair<bool, int32_t>> events;
  int64_t kept = 0;  ///< blocks keepWindowBefore marked, over the run

  explicit PoolModel(int32_t capacity)
      : holders(static_cast<std::size_t>(capacity), 0),
        block(static_cast<std::size_t>(capacity), -1),
        tier(static_cast<std::size_t>(capacity), 0),
        released(kRead + 1) {}

  std::size_t evictable() const {
    std::size_t count = 0;
    for (auto const& order : released) {
      count += order.size();
    }
    return count;
  }
  std::size_t pointPages() const { return evictable() - released.front().size() - readPages(); }
  std::size_t readPages() const { return released.back().size(); }
  std::deque<PageId>& orderOf(PageId page) {
    return released[static_cast<std::size_t>(tier[static_cast<std::size_t>(page)])];
  }

  std::vector<PageId> freePages() const {
    std::vector<PageId> pages;
    for (PageId p = 0; p < static_cast<PageId>(holders.size()); ++p) {
      if (holders[static_cast<std::size_t>(p)] == 0 && block[static_cast<std::size_t>(p)] < 0) {
        pages.push_back(p);
      }
    }
    return pages;
  }
  std::optional<PageId> pageOf(int32_t b) const {
    auto const it = std::find(block.begin(), block.end(), b);
    return it == block.end() ? std::nullopt : std::optional<PageId>(it - block.begin());
  }
  void drop(PageId page, bool announced) {
    if (announced) {
      events.emplace_back(false, block[static_cast<std::size_t>(page)]);
    }
    block[static_cast<std::size_t>(page)] = -1;
    tier[static_cast<std::size_t>(page)] = 0;
  }
  std::vector<PageId> allocate(int32_t count) {
    std::vector<PageId> pages = freePages();
    if (static_cast<int32_t>(pages.size() + evictable()) < count) {
      return {};
    }
    pages.resize(std::min(pages.size(), static_cast<std::size_t>(count)));
    while (static_cast<int32_t>(pages.size()) < count) {
      auto const order = std::find_if(released.begin(), released.end(),
                                      [](std::deque<PageId> const& o) { return !o.empty(); });
      pages.push_back(order->front());
      order->pop_front();
      drop(pages.back(), /*announced=*/true);
    }
    for (PageId p : pages) {
      holders[static_cast<std::size_t>(p)] = 1;
    }
    return pages;
  }
  void hold(PageId page) {
    auto const i = static_cast<std::size_t>(page);
    if (holders[i]++ == 0) {
      std::deque<PageId>& order = orderOf(page);
      order.erase(std::find(order.begin(), order.end(), page));
    }
    if (block[i] >= 0) {
      tier[i] = kRead;
    }
  }
  void release(PageId page) {
    if (--holders[static_cast<std::size_t>(page)] == 0 &&
        block[static_cast<std::size_t>(page)] >= 0) {
      orderOf(page).push_back(page);
    }
  }
  /// Raises the cached blocks of the window of `window` blocks before `end` to `to`; returns
  /// how many it raised.
  int32_t raise(int32_t end, int32_t window, int32_t to) {
    int32_t marked = 0;
    for (int32_t b = std::max(0, end - window); b < end; ++b) {
      std::optional<PageId> const page = pageOf(b);
      if (!page || tier[static_cast<std::size_t>(*page)] >= to) {
        continue;
      }
      bool const cached = holders[static_cast<std::size_t>(*page)] == 0;
      if (cached) {
        std::deque<PageId>& order = orderOf(*page);
        order.erase(std::find(order.begin(), order.end(), *page));
      }
      tier[static_cast<std::size_t>(*page)] = to;
      if (cached) {
        orderOf(*page).push_back(*page);
      }
      ++marked;
    }
    return marked;
  }
  int32_t keepWindowBefore(int32_t end, int32_t window) {
    int32_t const marked = raise(end, window, kRead);
    kept += marked;
    return marked;
  }
  int32_t keepPointWindow(int32_t end, int32_t window, int32_t rank) {
    return raise(end, window, 1 + std::clamp(rank, 0, WindowBlockCache::kMaxPointRank));
  }
  void clear() {
    for (PageId p = 0; p < static_cast<PageId>(block.size()); ++p) {
      if (block[static_cast<std::size_t>(p)] >= 0) {
        drop(p, /*announced=*/false);
      }
    }
    for (auto& order : released) {
      order.clear();
    }
  }
};

void expectMatchesModel(WindowBlockCache const& cache, PoolModel const& model,
                        PromptBlocks const& blocks) {
  int32_t held = 0;
  int32_t cached = 0;
  int32_t evictable = 0;
  for (PageId p = 0; p < cache.totalPages(); ++p) {
    auto const i = static_cast<std::size_t>(p);
    ASSERT_EQ(cache.holders(p), model.holders[i]) << "page " << p;
    std::optional<Hash128> const expected =
        model.block[i] < 0 ? std::nullopt
                           : std::optional(blocks.keys[static_cast<std::size_t>(model.block[i])]);
    ASSERT_EQ(cache.index().digestOf(p), expected) << "page " << p;
    held += model.holders[i] > 0 ? 1 : 0;
    cached += model.block[i] >= 0 ? 1 : 0;
    evictable += model.holders[i] == 0 && model.block[i] >= 0 ? 1 : 0;
  }
  // Free + (held or cached) partition the pool; evictable == cached with no holder.
  ASSERT_EQ(cache.heldPages(), held);
  ASSERT_EQ(cache.cachedBlocks(), cached);
  ASSERT_EQ(cache.evictablePages(), evictable);
  ASSERT_EQ(cache.freePages(), static_cast<int32_t>(model.freePages().size()));
  ASSERT_EQ(cache.freePages() + held + evictable, cache.totalPages());
  ASSERT_EQ(cache.availablePages(), cache.freePages() + evictable);
  ASSERT_EQ(static_cast<int32_t>(model.evictable()), evictable);
  ASSERT_EQ(cache.evictableReadPages(), static_cast<int32_t>(model.readPages()));
  ASSERT_EQ(cache.evictablePointPages(), static_cast<int32_t>(model.pointPages()));
  ASSERT_EQ(cache.keptBlocks(), model.kept);
}

TEST(WindowBlockCachePropertyTest, RandomOperationsMatchTheModel) {
  constexpr int32_t kCapacity = 10;
  std::vector<int32_t> const tokens = tokenRun(16 * kPage, 0);
  PromptBlocks const blocks = hashPromptBlocks(viewOf(tokens), kPage);
  for (uint64_t seed = 1; seed <= 20; ++seed) {
    std::mt19937_64 rng(seed);
    WindowBlockCache cache(kCapacity, kPage, /*windowTokens=*/9, true);
    KvEventQueue queue(4096, kPage);
    cache.announceTo(&queue, kSlidingGroup);
    PoolModel model(kCapacity);
    std::vector<PageId> holdings;  // one entry per holder we own
    auto pick = [&rng](auto const& v) {
      return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
    };
    for (int step = 0; step < 400; ++step) {
      int const op = std::uniform_int_distribution<int>(0, 99)(rng);
      SCOPED_TRACE(::testing::Message() << "seed " << seed << " step " << step << " op " << op);
      if (op < 30) {
        int32_t const count = std::uniform_int_distribution<int32_t>(0, 4)(rng);
        std::vector<PageId> const expected = model.allocate(count);
        std::vector<PageId> got;
        bool const ok = cache.allocate(count, got);
        ASSERT_EQ(ok, count == 0 || !expected.empty());
        ASSERT_EQ(got, expected);
        holdings.insert(holdings.end(), got.begin(), got.end());
      } else if (op < 40) {
        std::vector<PageId> const free = model.freePages();
        std::vector<PageId> holdable;
        for (PageId p = 0; p < kCapacity; ++p) {
          if (model.holders[static_cast<std::size_t>(p)] > 0 ||
              model.block[static_cast<std::size_t>(p)] >= 0) {
            holdable.push_back(p);
          }
        }
        if (op % 2 == 0 && !free.empty()) {
          ASSERT_THROW(cache.hold(pick(free)), Error);  // a free page: refused, nothing changed
        } else if (!holdable.empty()) {
          PageId const page = pick(holdable);
          model.hold(page);
          cache.hold(page);
          holdings.push_back(page);
        }
      } else if (op < 70 && !holdings.empty()) {
        std::size_t const i =
            std::uniform_int_distribution<std::size_t>(0, holdings.size() - 1)(rng);
        PageId const page = holdings[i];
        holdings.erase(holdings.begin() + static_cast<std::ptrdiff_t>(i));
        model.release(page);
        cache.release(page);
      } else if (op >= 90 && op < 93) {
        int32_t const end = std::uniform_int_distribution<int32_t>(0, 16)(rng);
        ASSERT_EQ(cache.keepWindowBefore(blocks, end), model.keepWindowBefore(end, 3));
      } else if (op >= 93 && op < 96) {
        int32_t const end = std::uniform_int_distribution<int32_t>(0, 16)(rng);
        int32_t const rank = std::uniform_int_distribution<int32_t>(-1, 3)(rng) +
                             (op == 95 ? WindowBlockCache::kMaxPointRank : 0);  // clamped
        ASSERT_EQ(cache.keepPointWindow(blocks, end, rank), model.keepPointWindow(end, 3, rank));
      } else if (op < 90 && !holdings.empty()) {
        PageId const page = pick(holdings);
        int32_t const b = std::uniform_int_distribution<int32_t>(0, 15)(rng);
        int32_t const current = model.block[static_cast<std::size_t>(page)];
        if (current >= 0 && current != b) {
          ASSERT_THROW(cache.publish(page, blocks, b), Error);
        } else {
          std::optional<PageId> const owner = model.pageOf(b);
          bool const wins = !owner || *owner == page;
          ASSERT_EQ(cache.publish(page, blocks, b), wins);
          if (wins && current < 0) {
            model.events.emplace_back(true, b);
          }
          if (wins) {
            model.block[static_cast<std::size_t>(page)] = b;
          }
        }
      } else if (op >= 96) {
        int32_t const cached = cache.cachedBlocks();
        model.clear();
        ASSERT_EQ(cache.clear(), cached);
      }
      ASSERT_NO_FATAL_FAILURE(expectMatchesModel(cache, model, blocks));
      if (op % 7 == 0) {
        std::vector<std::pair<bool, int32_t>> got;
        for (KvEvent const& event : queue.drain()) {
          auto const* stored = std::get_if<BlockStored>(&event);
          Hash128 const digest =
              stored != nullptr ? stored->digest : std::get<BlockRemoved>(event).digest;
          auto const it = std::find(blocks.keys.begin(), blocks.keys.end(), digest);
          got.emplace_back(stored != nullptr, static_cast<int32_t>(it - blocks.keys.begin()));
        }
        ASSERT_EQ(got, model.events);
        model.events.clear();
      }
    }
  }
}

}  // namespace
}  // namespace mkv
