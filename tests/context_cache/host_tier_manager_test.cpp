// The host tier's bookkeeping: HostBlockTier alone, ContextCacheManager with a host tier
// (offload at eviction, lookups that continue into the host tier, onboarding, pins, events,
// metrics, reset), and random operation sequences checked against a model of the bytes each page
// holds (docs/context_cache.md, "Host tier").

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "context_cache/context_cache_manager.h"
#include "context_cache/host_block_tier.h"
#include "context_cache_test_support.h"
#include "mkv/error.h"

namespace mkv {
namespace {

using test::admit;
using test::expectManagerInvariants;
using test::publishCold;
using test::requestOf;
using test::tokenRun;
using test::viewOf;

constexpr int32_t kPage = 4;

ContextCacheManagerOptions hostTierOptions(int32_t hostPages) {
  ContextCacheManagerOptions options;
  options.hostTierPages = hostPages;
  options.hostTierBytesPerPage = 1000;
  options.eventQueueCapacity = 256;
  options.evictionPolicy = EvictionPolicyKind::kLru;
  return options;
}

PromptBlocks blocksOf(std::vector<int32_t> const& tokens) {
  return hashPromptBlocks(viewOf(tokens), kPage);
}

// ---------------------------------------------------------------------------------------------
// HostBlockTier

TEST(HostBlockTierTest, StoresEvictedBlocksAndDropsTheLeastRecentlyUsedWhenFull) {
  std::vector<int32_t> const tokens = tokenRun(12, 0);
  PromptBlocks const blocks = blocksOf(tokens);
  BlockIndex gpu(3, kPage, true, 0);
  for (int32_t b = 0; b < 3; ++b) {
    gpu.insert(blocks.keys[static_cast<std::size_t>(b)], b, blocks, b);
  }
  HostBlockTier tier(2, kPage, true);
  std::vector<HostBlockDropped> dropped;
  EXPECT_EQ(tier.store(gpu, 0, dropped), 0);
  EXPECT_EQ(tier.store(gpu, 1, dropped), 1);
  EXPECT_EQ(tier.store(gpu, 0, dropped), std::nullopt) << "already held: no copy, touched";
  EXPECT_TRUE(dropped.empty());
  EXPECT_EQ(tier.store(gpu, 2, dropped), 1) << "block 1 was the least recently used";
  ASSERT_EQ(dropped.size(), 1U);
  EXPECT_EQ(dropped[0].digest, blocks.keys[1]);
  EXPECT_EQ(tier.longestRun(blocks, 0, 3), (std::vector<PageId>{0}))
      << "the run stops at block 1, which is gone";
  EXPECT_EQ(tier.longestRun(blocks, 2, 3), (std::vector<PageId>{1}));
  EXPECT_TRUE(tier.holds(0, blocks, 0));
  EXPECT_FALSE(tier.holds(1, blocks, 1));
}

TEST(HostBlockTierTest, PinnedPagesAreNeverDroppedAndStoreSkipsWhenEveryPageIsPinned) {
  std::vector<int32_t> const tokens = tokenRun(8, 0);
  PromptBlocks const blocks = blocksOf(tokens);
  BlockIndex gpu(2, kPage, true, 0);
  gpu.insert(blocks.keys[0], 0, blocks, 0);
  gpu.insert(blocks.keys[1], 1, blocks, 1);
  HostBlockTier tier(1, kPage, true);
  std::vector<HostBlockDropped> dropped;
  ASSERT_EQ(tier.store(gpu, 0, dropped), 0);
  tier.pin(0);
  EXPECT_EQ(tier.store(gpu, 1, dropped), std::nullopt);
  EXPECT_TRUE(dropped.empty());
  EXPECT_TRUE(tier.holds(0, blocks, 0));
  tier.unpin(0);
  EXPECT_EQ(tier.store(gpu, 1, dropped), 0);
  EXPECT_EQ(dropped.size(), 1U);
  EXPECT_THROW(tier.pin(5), Error);
}

TEST(HostBlockTierTest, AReservedPageIsNeitherFoundNorClaimedUntilFilled) {
  std::vector<int32_t> const tokens = tokenRun(12, 0);
  PromptBlocks const blocks = blocksOf(tokens);
  BlockIndex gpu(3, kPage, true, 0);
  for (int32_t b = 0; b < 3; ++b) {
    gpu.insert(blocks.keys[static_cast<std::size_t>(b)], b, blocks, b);
  }
  HostBlockTier tier(2, kPage, true);
  std::vector<HostBlockDropped> dropped;
  ASSERT_EQ(tier.store(gpu, 0, dropped), 0);
  std::optional<PageId> const reserved = tier.reserve(dropped);
  ASSERT_EQ(reserved, 1) << "the free page";
  EXPECT_EQ(tier.reservedPages(), 1);
  EXPECT_EQ(tier.size(), 1) << "a reserved page holds no block";
  EXPECT_EQ(tier.store(gpu, 2, dropped), 0) << "store() takes the indexed page, not the reserved";
  ASSERT_EQ(dropped.size(), 1U);
  EXPECT_EQ(dropped[0].digest, blocks.keys[0]);
  tier.pin(0);
  EXPECT_EQ(tier.reserve(dropped), std::nullopt) << "every other page is pinned or reserved";
  tier.unpin(0);

  EXPECT_TRUE(tier.fillReserved(*reserved, blocks, 1));
  EXPECT_EQ(tier.reservedPages(), 0);
  EXPECT_TRUE(tier.holds(1, blocks, 1));
  EXPECT_EQ(tier.longestRun(blocks, 1, 3), (std::vector<PageId>{1, 0}));

  // A digest held already: the reserved page goes back (here it is the LRU block's page).
  std::optional<PageId> const again = tier.reserve(dropped);
  ASSERT_EQ(again, 0);
  EXPECT_FALSE(tier.fillReserved(*again, blocks, 1));
  EXPECT_EQ(tier.reservedPages(), 0);
  EXPECT_EQ(tier.reserve(dropped), 0) << "released to the free list";
  EXPECT_THROW((void)tier.fillReserved(0, blocks, 7), Error);
  EXPECT_EQ(tier.reservedPages(), 0) << "a refused fill releases its page";
  EXPECT_EQ(tier.reserve(dropped), 0);
  tier.releaseReserved(0);
  EXPECT_EQ(tier.reservedPages(), 0);
}

TEST(HostBlockTierTest, VerificationRefusesAHostBlockWithOtherTokensUnderTheSameDigest) {
  std::vector<int32_t> const tokens = tokenRun(4, 0);
  std::vector<int32_t> const other = tokenRun(4, 50);
  PromptBlocks const blocks = blocksOf(tokens);
  PromptBlocks const otherBlocks = blocksOf(other);
  BlockIndex gpu(1, kPage, true, 0);
  gpu.insert(blocks.keys[0], 0, otherBlocks, 0);  // a collision: our key, other tokens
  HostBlockTier tier(1, kPage, true);
  std::vector<HostBlockDropped> dropped;
  ASSERT_EQ(tier.store(gpu, 0, dropped), 0);
  EXPECT_TRUE(tier.longestRun(blocks, 0, 1).empty());
}

// ---------------------------------------------------------------------------------------------
// ContextCacheManager with a host tier

TEST(HostTierManagerTest, EvictionOffloadsAndALookupOnboardsTheEvictedPrefix) {
  ContextCacheManager m(kPage, {3, 0, 0, 0}, 8, hostTierOptions(8));
  std::vector<int32_t> const a = tokenRun(8, 0);  // blocks a0 a1
  publishCold(m, a);                              // GPU pages 0, 1
  (void)m.drainEvents();
  publishCold(m, tokenRun(12, 100));  // needs 3 pages: evicts a, offloads both blocks
  HostTransfers const moved = m.takeHostTransfers();
  ASSERT_EQ(moved.offloads.size(), 2U);
  EXPECT_TRUE(moved.onboards.empty());
  EXPECT_EQ(m.metrics().offloadedPages, 2U);
  EXPECT_EQ(m.metrics().offloadedBytes, 2000U);
  EXPECT_EQ(m.metrics().hostTierBlocks, 2);
  std::vector<KvEvent> const events = m.drainEvents();
  int32_t removedOnGpu = 0;
  int32_t storedOnHost = 0;
  for (KvEvent const& e : events) {
    if (auto const* r = std::get_if<BlockRemoved>(&e)) {
      removedOnGpu += r->medium == KvMedium::kGpu ? 1 : 0;
    } else if (auto const* s = std::get_if<BlockStored>(&e)) {
      storedOnHost += s->medium == KvMedium::kCpu ? 1 : 0;
      if (s->medium == KvMedium::kCpu) {
        EXPECT_EQ(s->tokens.size(), static_cast<std::size_t>(kPage)) << "tokens travel along";
      }
    }
  }
  EXPECT_EQ(removedOnGpu, 2);
  EXPECT_EQ(storedOnHost, 2);

  // A longer prompt over a: both blocks come from the host tier into fresh GPU pages.
  std::vector<int32_t> const longer = test::concatenated(a, {7, 7});
  AdmissionResult admitted = m.admit(requestOf(longer));
  ASSERT_TRUE(admitted.lease);
  EXPECT_EQ(admitted.plan.reuseTokenLength, 8);
  EXPECT_EQ(admitted.plan.hostOnboardPages.size(), 2U);
  EXPECT_EQ(admitted.lease->boundBasePageCount(), 0);
  HostTransfers const back = m.takeHostTransfers();
  ASSERT_EQ(back.onboards.size(), 2U);
  std::span<PageId const> const pages = admitted.lease->basePages();
  EXPECT_EQ(back.onboards[0].gpuPage, pages[0]);
  EXPECT_EQ(back.onboards[1].gpuPage, pages[1]);
  EXPECT_EQ(back.onboards[0].hostPage, moved.offloads[0].hostPage);
  EXPECT_EQ(m.metrics().onboardedPages, 2U);
  EXPECT_EQ(m.metrics().hostTierHitTokens, 8U);
  EXPECT_EQ(m.metrics().reusedTokens, 8U);
  EXPECT_FALSE(admitted.missReason.has_value());
  EXPECT_EQ(m.hostTier()->pinnedPages(), 0) << "pins end with the onboarding";
  // Inclusive: a and b stay on the host; the admission evicted the 100-run (3 more blocks).
  EXPECT_EQ(m.metrics().hostTierBlocks, 5);
  EXPECT_TRUE(m.hostTier()->index().find(blocksOf(a).keys[0]).has_value());
  expectManagerInvariants(m);
}

TEST(HostTierManagerTest, AFullInputMatchRewindsItsLastPageEvenWhenItIsOnTheHost) {
  ContextCacheManager m(kPage, {2, 0, 0, 0}, 8, hostTierOptions(8));
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  publishCold(m, tokenRun(8, 100));  // evicts a
  (void)m.takeHostTransfers();
  AdmissionResult admitted = m.admit(requestOf(a));
  ASSERT_TRUE(admitted.lease);
  EXPECT_EQ(admitted.plan.kind, ReusePlanKind::kFullInputRewind);
  EXPECT_EQ(admitted.plan.matchedTokenLength, 8);
  EXPECT_EQ(admitted.plan.reuseTokenLength, 4);
  EXPECT_EQ(m.takeHostTransfers().onboards.size(), 1U) << "the recomputed page is not copied";
}

TEST(HostTierManagerTest, AHitStartsOnTheGpuAndContinuesOnTheHost) {
  ContextCacheManager m(kPage, {4, 0, 0, 0}, 8, hostTierOptions(8));
  std::vector<int32_t> const a = tokenRun(4, 0);
  std::vector<int32_t> const ab = test::concatenated(a, tokenRun(4, 10));
  publishCold(m, ab);  // record ab: pages 0 (a), 1 (b)
  publishCold(m, a);   // duplicate of block a: touches... a new record over page 0
  // Fill the GPU so that the LRU record (ab) goes: page 1 is offloaded, page 0 stays (record a).
  publishCold(m, tokenRun(12, 100));
  HostTransfers const moved = m.takeHostTransfers();
  ASSERT_EQ(moved.offloads.size(), 1U);
  AdmissionResult admitted = m.admit(requestOf(test::concatenated(ab, {1})));
  ASSERT_TRUE(admitted.lease);
  EXPECT_EQ(admitted.plan.basePageBindings.size(), 1U) << "block a from the GPU";
  EXPECT_EQ(admitted.plan.hostOnboardPages.size(), 1U) << "block b from the host";
  EXPECT_EQ(admitted.plan.reuseTokenLength, 8);
  expectManagerInvariants(m);
}

TEST(HostTierManagerTest, ARefusedAdmissionKeepsEveryHostBlockAndLeavesNoPin) {
  ContextCacheManager m(kPage, {2, 0, 0, 0}, 8, hostTierOptions(8));
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  publishCold(m, tokenRun(8, 100));
  (void)m.takeHostTransfers();
  CacheRequestLease holder = admit(m, requestOf(tokenRun(8, 200)));  // pins both GPU pages
  (void)m.takeHostTransfers();
  int32_t const held = m.hostTier()->size();
  AdmissionResult refused = m.admit(requestOf(test::concatenated(a, {3})));
  EXPECT_FALSE(refused.lease);
  EXPECT_EQ(m.hostTier()->pinnedPages(), 0);
  EXPECT_EQ(m.hostTier()->size(), held);
  EXPECT_TRUE(m.takeHostTransfers().onboards.empty());
}

TEST(HostTierManagerTest, ResetClearsBothTiersWithOneEvent) {
  ContextCacheManager m(kPage, {2, 0, 0, 0}, 8, hostTierOptions(8));
  publishCold(m, tokenRun(8, 0));
  publishCold(m, tokenRun(8, 100));
  (void)m.takeHostTransfers();
  (void)m.drainEvents();
  ASSERT_GT(m.hostTier()->size(), 0);
  ASSERT_TRUE(m.resetPrefixCache());
  EXPECT_EQ(m.hostTier()->size(), 0);
  EXPECT_EQ(m.metrics().hostTierResetPages, 2U);
  std::vector<KvEvent> const events = m.drainEvents();
  ASSERT_EQ(events.size(), 1U);
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(events[0]));
  AdmissionResult cold = m.admit(requestOf(tokenRun(8, 0)));
  ASSERT_TRUE(cold.lease);
  EXPECT_EQ(cold.plan.matchedTokenLength, 0);
}

TEST(HostTierManagerTest, ForgottenHostBlocksAreNeverOnboarded) {
  ContextCacheManager m(kPage, {2, 0, 0, 0}, 8, hostTierOptions(8));
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  publishCold(m, tokenRun(8, 100));
  HostTransfers const moved = m.takeHostTransfers();
  ASSERT_EQ(moved.offloads.size(), 2U);
  (void)m.drainEvents();
  m.forgetHostBlocks(moved.offloads);  // their copy failed
  EXPECT_EQ(m.hostTier()->size(), 0);
  std::vector<KvEvent> const events = m.drainEvents();
  ASSERT_EQ(events.size(), 2U);
  EXPECT_EQ(std::get<BlockRemoved>(events[0]).medium, KvMedium::kCpu);
  AdmissionResult cold = m.admit(requestOf(a));
  ASSERT_TRUE(cold.lease);
  EXPECT_EQ(cold.plan.matchedTokenLength, 0);
}

TEST(HostTierManagerTest, APlanMadeBeforeItsHostPageWasReusedIsRePlanned) {
  ContextCacheManager m(kPage, {2, 0, 0, 0}, 8, hostTierOptions(1));
  std::vector<int32_t> const a = tokenRun(4, 0);
  publishCold(m, a);
  publishCold(m, tokenRun(8, 100));  // evicts a (host page 0)
  (void)m.takeHostTransfers();
  std::vector<int32_t> const prompt = test::concatenated(a, {1});
  LookupRequest const request = requestOf(prompt);
  LookupResult looked = m.lookup(request);
  ASSERT_EQ(looked.plan.hostOnboardPages.size(), 1U);
  publishCold(m, tokenRun(8, 200));  // evicts the 100-run: host page 0 now holds its block
  (void)m.takeHostTransfers();
  AdmissionResult admitted = m.admit(request, std::move(looked));
  ASSERT_TRUE(admitted.lease);
  EXPECT_TRUE(admitted.plan.hostOnboardPages.empty()) << "re-planned against the current tier";
  EXPECT_TRUE(m.takeHostTransfers().onboards.empty());
}

TEST(HostTierManagerTest, ANegativeHostTierIsRefused) {
  ContextCacheManagerOptions options;
  options.hostTierPages = -1;
  EXPECT_THROW(ContextCacheManager(kPage, {2, 0, 0, 0}, 8, options), Error);
}

// ---------------------------------------------------------------------------------------------
// Random operation sequences against a model of the bytes in every page

/// What each page holds, as the key of the block written there (zero: nothing known). The model
/// applies the manager's transfers in the order it hands them out, and a prefill writes the
/// private pages. Every page an admitted lease reuses, every GPU-indexed page and every host
/// block must then hold its block.
class TierBytes {
 public:
  TierBytes(int32_t gpuPages, int32_t hostPages)
      : mGpu(static_cast<std::size_t>(gpuPages)), mHost(static_cast<std::size_t>(hostPages)) {}

  void apply(HostTransfers const& moves) {
    std::set<PageId> hostDestinations;
    std::set<PageId> gpuDestinations;
    for (HostTransfer const& t : moves.offloads) {
      EXPECT_TRUE(hostDestinations.insert(t.hostPage).second)
          << "host page " << t.hostPage << " is written twice by one batch";
    }
    for (HostTransfer const& t : moves.onboards) {
      EXPECT_TRUE(gpuDestinations.insert(t.gpuPage).second)
          << "GPU page " << t.gpuPage << " is written twice by one batch";
    }
    for (HostTransfer const& t : moves.offloads) {
      mHost[static_cast<std::size_t>(t.hostPage)] = mGpu[static_cast<std::size_t>(t.gpuPage)];
    }
    for (HostTransfer const& t : moves.onboards) {
      mGpu[static_cast<std::size_t>(t.gpuPage)] = mHost[static_cast<std::size_t>(t.hostPage)];
    }
  }
  /// The prefill: the lease's pages from the reuse length on get their blocks' keys.
  void prefill(CacheRequestLease const& lease, PromptBlocks const& blocks, int32_t reusedBlocks) {
    std::span<PageId const> const pages = lease.basePages();
    for (int32_t b = reusedBlocks; b < blocks.fullBlockCount(); ++b) {
      mGpu[static_cast<std::size_t>(pages[static_cast<std::size_t>(b)])] =
          blocks.keys[static_cast<std::size_t>(b)];
    }
  }
  void expectReused(CacheRequestLease const& lease, PromptBlocks const& blocks,
                    int32_t reusedBlocks) const {
    for (int32_t b = 0; b < reusedBlocks; ++b) {
      PageId const page = lease.basePages()[static_cast<std::size_t>(b)];
      EXPECT_EQ(mGpu[static_cast<std::size_t>(page)], blocks.keys[static_cast<std::size_t>(b)])
          << "reused block " << b << " on GPU page " << page;
    }
  }
  void expectIndexes(ContextCacheManager const& m) const {
    for (int32_t p = 0; p < static_cast<int32_t>(mGpu.size()); ++p) {
      if (std::optional<Hash128> const digest = m.index().digestOf(p)) {
        EXPECT_EQ(mGpu[static_cast<std::size_t>(p)], *digest) << "GPU page " << p;
      }
    }
    BlockIndex const& host = m.hostTier()->index();
    for (int32_t p = 0; p < static_cast<int32_t>(mHost.size()); ++p) {
      if (std::optional<Hash128> const digest = host.digestOf(p)) {
        EXPECT_EQ(mHost[static_cast<std::size_t>(p)], *digest) << "host page " << p;
      }
    }
  }

 private:
  std::vector<Hash128> mGpu;
  std::vector<Hash128> mHost;
};

/// Prompts from a small tree: a shared root, a few branches, a few leaves, so that prefixes are
/// evicted, offloaded and looked up again.
std::vector<int32_t> randomPrompt(std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> pick(0, 3);
  std::vector<int32_t> tokens = tokenRun(kPage * (1 + pick(rng) % 2), 0);
  int32_t const branch = pick(rng);
  std::vector<int32_t> const middle = tokenRun(kPage * (1 + pick(rng)), 100 * (branch + 1));
  tokens.insert(tokens.end(), middle.begin(), middle.end());
  int32_t const tail = pick(rng) % 3;
  for (int32_t i = 0; i < tail; ++i) {
    tokens.push_back(1000 + pick(rng));
  }
  return tokens;
}

class HostTierManagerPropertyTest : public ::testing::TestWithParam<int32_t> {};

// Host tiers of 10 pages (rarely full), 2 and 1 (a block stored and dropped again in one
// eviction batch, whose copy must vanish from the batch).
INSTANTIATE_TEST_SUITE_P(HostPages, HostTierManagerPropertyTest, ::testing::Values(10, 2, 1));

TEST_P(HostTierManagerPropertyTest, EveryReusedPageHoldsItsBlockAcrossBothTiers) {
  constexpr int32_t kGpuPages = 12;
  int32_t const kHostPages = GetParam();
  uint64_t onboarded = 0;
  uint64_t dropped = 0;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    ContextCacheManager m(kPage, {kGpuPages, 0, 0, 0}, 6, hostTierOptions(kHostPages));
    TierBytes bytes(kGpuPages, kHostPages);
    std::vector<std::pair<CacheRequestLease, std::vector<int32_t>>> live;
    for (int32_t step = 0; step < 300; ++step) {
      int32_t const op = std::uniform_int_distribution<int32_t>(0, 9)(rng);
      if (op < 6 || live.empty()) {  // admit and prefill
        std::vector<int32_t> const tokens = randomPrompt(rng);
        AdmissionResult admitted = m.admit(requestOf(tokens));
        bytes.apply(m.takeHostTransfers());
        if (admitted.lease) {
          PromptBlocks const blocks = blocksOf(tokens);
          int32_t const reused = admitted.plan.reuseTokenLength / kPage;
          bytes.expectReused(*admitted.lease, blocks, reused);
          bytes.prefill(*admitted.lease, blocks, reused);
          live.emplace_back(std::move(*admitted.lease), tokens);
        }
      } else if (op < 9) {  // publish and release one
        auto const at = static_cast<std::ptrdiff_t>(
            std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng));
        auto& [lease, tokens] = live[static_cast<std::size_t>(at)];
        if (tokens.size() >= static_cast<std::size_t>(kPage)) {
          (void)test::publishTokens(m, lease, tokens);
          bytes.apply(m.takeHostTransfers());  // the record limit may evict
        }
        live.erase(live.begin() + at);
      } else if (live.empty() && step % 50 == 49) {
        ASSERT_TRUE(m.resetPrefixCache());
      }
      bytes.expectIndexes(m);
      expectManagerInvariants(m);
      ASSERT_EQ(m.hostTier()->pinnedPages(), 0);
      if (::testing::Test::HasFailure()) {
        return;
      }
    }
    live.clear();
    onboarded += m.metrics().onboardedPages;
    dropped += m.metrics().hostTierDroppedPages;
  }
  EXPECT_GT(onboarded, 0U) << "the sequences exercised the host tier";
  EXPECT_TRUE(kHostPages == 10 || dropped > 0) << "a small tier drops blocks";
}

}  // namespace
}  // namespace mkv
