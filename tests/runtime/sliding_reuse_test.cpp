// The sliding-window reuse backend end to end (KVCacheRuntime + ManagedKVCacheRequest driven by
// the reference engine, the KV oracle checking every position attention reads, the reused
// window included): the runtime's choice, hits with their window, the window rule capping a
// hit, the decode bound, page accounting and a failed synchronisation. docs/architecture.md,
// "Sliding windows with context reuse". Host and GPU tensors (kGPU skips without a device).
#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <variant>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "context_cache/window_block_cache.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/reference_engine.h"
#include "runtime_test_rig.h"
#include "support/fault_arming.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv {
using test::concatenated;
using test::tokenRun;
namespace {

using testing::EngineRequest;
using testing::EngineSequence;
using testing::ReferenceEngine;
using testing::ReferenceEngineOptions;

constexpr int32_t kPage = 16;
constexpr int32_t kWindow = 64;  // 4 pages: M = 5, a decoding sequence keeps at most 6

/// One full-attention and two sliding layers, reuse on: the sliding-window reuse backend.
KVCacheRuntimeConfig slidingConfig(DeviceType device, int32_t swaPages = 0) {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = 2;
  config.model.slidingWindowTokens = kWindow;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 1024;
  config.tokensPerPage = kPage;
  config.numSwaPages = swaPages;
  config.contextReuse = true;
  config.deviceType = device;
  return config;
}

EngineRequest single(std::vector<int32_t> prompt, int32_t newTokens = 3) {
  EngineRequest request;
  request.sequences.push_back(EngineSequence{std::move(prompt), newTokens, {}, {}, {}, -1, 0});
  return request;
}

int32_t runOnce(ReferenceEngine& engine, EngineRequest const& request) {
  auto const outcome = engine.run(request);
  EXPECT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  return outcome.admitted ? outcome.sequences.at(0).prefillStart : -1;
}

/// Every page of both pools is free or cached, none held, and the sliding pool adds up.
void expectNothingHeld(KVCacheRuntime& runtime) {
  WindowBlockCache const& window = *runtime.windowBlockCache();
  EXPECT_EQ(window.heldPages(), 0);
  EXPECT_EQ(window.freePages() + window.evictablePages(), window.totalPages());
  EXPECT_EQ(window.cachedBlocks(), window.evictablePages());
  EXPECT_EQ(runtime.contextCache()->activeRequestCount(), 0);
  EXPECT_EQ(runtime.swaPageManager()->activeRequestCount(), 0);
}

/// Runs one request of `prompt` to completion through the facade, so that its blocks are cached.
void cachePrompt(runtime_test::RuntimeRig& rig, std::vector<int32_t> const& prompt) {
  runtime_test::FacadeDriver cached(rig);
  cached.add(prompt);
  ASSERT_TRUE(cached.begin());
  ASSERT_TRUE(cached.prefill());
  ASSERT_TRUE(cached.finish());
}

class SlidingReuseTest : public test::DeviceTest {};
INSTANTIATE_TEST_SUITE_P(Devices, SlidingReuseTest, test::allDeviceTypes(), test::deviceName);

TEST_P(SlidingReuseTest, TheRuntimeComposesBothBackendsForReuseWithSlidingLayers) {
  auto runtime = KVCacheRuntime::create(slidingConfig(device()));
  EXPECT_EQ(runtime->backend(), KVCacheBackend::kSlidingWindowReuse);
  EXPECT_EQ(toString(runtime->backend()), "sliding-window-reuse");
  ASSERT_NE(runtime->contextCache(), nullptr);
  ASSERT_NE(runtime->swaPageManager(), nullptr);
  ASSERT_NE(runtime->windowBlockCache(), nullptr);
  EXPECT_EQ(runtime->fullPool()->numLayers(), 1);
  EXPECT_EQ(runtime->swaPool()->numLayers(), 2);
  EXPECT_EQ(runtime->swaPool()->numPages(), runtime->fullPool()->numPages());  // the default
  EXPECT_EQ(runtime->windowBlockCache()->windowBlocks(), kWindow / kPage);
  EXPECT_TRUE(runtime->supportsSeatedAdmission());
}

TEST_P(SlidingReuseTest, OtherReuseDeploymentsKeepEveryAttentionLayerInTheFullPool) {
  KVCacheRuntimeConfig config = slidingConfig(device());
  config.model.numFullAttentionLayers = 0;  // no full layer: nothing to compose with
  auto runtime = KVCacheRuntime::create(config);
  EXPECT_EQ(runtime->backend(), KVCacheBackend::kContextReuse);
  EXPECT_EQ(runtime->fullPool()->numLayers(), 2);
  config = slidingConfig(device());
  config.maxSequenceLength = 64;  // the decode window (6 pages) is not shorter than a row (4)
  EXPECT_EQ(KVCacheRuntime::create(config)->backend(), KVCacheBackend::kContextReuse);
}

TEST_P(SlidingReuseTest, ATooSmallSlidingPoolIsAConfigurationError) {
  // One sequence's largest prefill: 64 pages per row + 1 spare + 4 window pages = 69.
  EXPECT_NO_THROW(KVCacheRuntime::create(slidingConfig(device(), 69)));
  EXPECT_TRUE(test::throwsError([&] { KVCacheRuntime::create(slidingConfig(device(), 68)); },
                                {"KVCacheRuntime::create: numSwaPages 68 is below one sequence's "
                                 "sliding-window reuse prefill",
                                 "= 69"}));
}

TEST_P(SlidingReuseTest, ASharedPrefixIsReusedWithTheWindowBeforeIt) {
  auto runtime = KVCacheRuntime::create(slidingConfig(device()));
  ReferenceEngine engine(*runtime);  // verify kAll, throws on the first oracle mismatch
  std::vector<int32_t> const shared = tokenRun(256, 0);
  EXPECT_EQ(runOnce(engine, single(concatenated(shared, tokenRun(44, 5000)))), 0);
  // 16 shared blocks; the window before them (blocks 12..15) was published by the first prompt.
  EXPECT_EQ(runOnce(engine, single(concatenated(shared, tokenRun(30, 9000)))), 256);
  // A prefix that ends mid-way reuses its whole blocks, its window included.
  EXPECT_EQ(runOnce(engine, single(concatenated(tokenRun(100, 0), tokenRun(20, 7000)))), 96);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_GT(engine.stats().oracleChecks, 0);
  ContextCacheMetrics const metrics = runtime->contextCache()->metrics();
  EXPECT_EQ(metrics.missCount(MissReason::kWindowEvicted), 0u);
  expectNothingHeld(*runtime);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(SlidingReuseTest, ACorruptedCachedWindowIsCaughtByTheOracle) {
  auto runtime = KVCacheRuntime::create(slidingConfig(device()));
  ReferenceEngineOptions options;
  options.throwOnMismatch = false;
  ReferenceEngine engine(*runtime, options);
  std::vector<int32_t> const shared = tokenRun(256, 0);
  EXPECT_EQ(runOnce(engine, single(concatenated(shared, tokenRun(44, 5000)))), 0);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  // Every sliding page of the second layer, the cached window blocks included, loses its bytes;
  // the full layers stay intact, so only the reused window can be wrong.
  test::fillConstant(runtime->swaPool()->layer(1), 0x5A);
  EXPECT_EQ(runOnce(engine, single(concatenated(shared, tokenRun(30, 9000)))), 256);
  EXPECT_GT(engine.stats().oracleMismatches, 0);
  // The first reused window position, start - W = 192, of the corrupted sliding layer.
  EXPECT_NE(engine.stats().firstMismatch.find("reused prefix: slot 0 position 192"),
            std::string::npos)
      << engine.stats().firstMismatch;
  EXPECT_NE(engine.stats().firstMismatch.find("layer 1"), std::string::npos);
}

TEST_P(SlidingReuseTest, AnEvictedWindowCapsTheHitAndNamesTheReason) {
  // The smallest sliding pool (69 pages) beside a full pool that keeps everything.
  auto runtime = KVCacheRuntime::create(slidingConfig(device(), 69));
  ReferenceEngine engine(*runtime);
  std::vector<int32_t> const shared = tokenRun(256, 0);
  EXPECT_EQ(runOnce(engine, single(concatenated(shared, tokenRun(44, 5000)))), 0);
  // An unrelated 1000-token prompt needs 64 sliding pages: the oldest cached blocks of the first
  // prompt (its first ones) are dropped; the full layers keep all of them.
  EXPECT_EQ(runOnce(engine, single(tokenRun(1000, 20000), 1)), 0);
  int32_t const start = runOnce(engine, single(concatenated(shared, tokenRun(30, 9000))));
  EXPECT_LT(start, 256);
  EXPECT_EQ(start % kPage, 0);
  ContextCacheMetrics const metrics = runtime->contextCache()->metrics();
  EXPECT_EQ(metrics.missCount(MissReason::kWindowEvicted), 1u);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  expectNothingHeld(*runtime);
}

/// A router's view of the KV events: the blocks of each group, built from the events alone.
struct RouterView {
  std::set<Hash128> full;     ///< group 0
  std::set<Hash128> sliding;  ///< group 1
  int32_t clears = 0;

  void apply(std::vector<KvEvent> const& events) {
    for (KvEvent const& event : events) {
      if (auto const* stored = std::get_if<BlockStored>(&event)) {
        ASSERT_EQ(stored->tokens.size(), static_cast<std::size_t>(kPage));
        EXPECT_TRUE(blocksOf(stored->group).insert(stored->digest).second) << "stored twice";
      } else if (auto const* removed = std::get_if<BlockRemoved>(&event)) {
        EXPECT_EQ(blocksOf(removed->group).erase(removed->digest), 1U) << "never stored";
      } else {
        full.clear();
        sliding.clear();
        ++clears;
      }
    }
  }
  std::set<Hash128>& blocksOf(KvCacheGroup const& group) {
    if (group.index == 1) {
      EXPECT_EQ(group, slidingWindowGroup(kWindow));
      return sliding;
    }
    EXPECT_EQ(group, kFullAttentionGroup);
    return full;
  }
};

std::set<Hash128> indexedDigests(BlockIndex const& index) {
  std::set<Hash128> digests;
  for (PageId page = 0; page < index.pageCapacity(); ++page) {
    if (std::optional<Hash128> const digest = index.digestOf(page)) {
      digests.insert(*digest);
    }
  }
  return digests;
}

TEST_P(SlidingReuseTest, KvEventsOfBothPoolsRebuildBothIndexesAndAResetClearsBoth) {
  KVCacheRuntimeConfig config = slidingConfig(device(), 69);  // drops windows as it goes
  config.contextCache.eventQueueCapacity = 4096;
  auto runtime = KVCacheRuntime::create(config);
  ReferenceEngine engine(*runtime);
  WindowBlockCache const& window = *runtime->windowBlockCache();
  RouterView router;
  std::vector<int32_t> const shared = tokenRun(256, 0);
  for (int32_t i = 0; i < 6; ++i) {
    std::vector<int32_t> const prompt =
        i % 2 == 0 ? concatenated(shared, tokenRun(40 + 16 * i, 5000 + 1000 * i))
                   : tokenRun(600 + 50 * i, 20000 + 3000 * i);
    runOnce(engine, single(prompt));
    ASSERT_NO_FATAL_FAILURE(router.apply(runtime->contextCache()->drainEvents()));
    EXPECT_EQ(router.full, indexedDigests(runtime->contextCache()->manager().index()))
        << "request " << i;
    EXPECT_EQ(router.sliding, indexedDigests(window.index())) << "request " << i;
  }
  EXPECT_GT(window.droppedBlocks(), 0) << "the sliding pool must have dropped windows";
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  ContextCacheMetrics const metrics = runtime->contextCache()->metrics();
  EXPECT_EQ(metrics.droppedEvents, 0U);

  ASSERT_GT(window.cachedBlocks(), 0);
  ASSERT_TRUE(runtime->contextCache()->resetPrefixCache());
  EXPECT_EQ(window.cachedBlocks(), 0) << "no window outlives a reset";
  EXPECT_EQ(window.freePages(), window.totalPages());
  std::vector<KvEvent> const cleared = runtime->contextCache()->drainEvents();
  ASSERT_EQ(cleared.size(), 1U) << "one AllBlocksCleared covers both pools";
  router.apply(cleared);
  EXPECT_EQ(router.clears, 1);
  // After the reset the same prompt misses in both pools and publishes both again.
  EXPECT_EQ(runOnce(engine, single(concatenated(shared, tokenRun(40, 5000)))), 0);
  router.apply(runtime->contextCache()->drainEvents());
  EXPECT_EQ(router.sliding, indexedDigests(window.index()));
  EXPECT_FALSE(router.sliding.empty());
  expectNothingHeld(*runtime);
}

TEST_P(SlidingReuseTest, ADecodingSequenceHoldsAtMostMPlusOneSlidingPages) {
  auto runtime = KVCacheRuntime::create(slidingConfig(device()));
  WindowBlockCache const& window = *runtime->windowBlockCache();
  int32_t const perSequence = BoundedSwaKVPageManager::decodePagesPerSequence(kWindow, kPage);
  int32_t peakHeld = 0;
  ReferenceEngineOptions options;
  options.onStep = [&](int64_t) { peakHeld = std::max(peakHeld, window.heldPages()); };
  ReferenceEngine engine(*runtime, options);
  EngineRequest request;
  for (int i = 0; i < 3; ++i) {
    request.sequences.push_back(
        EngineSequence{tokenRun(300 + 37 * i, 1000 * (i + 1)), 70, {}, {}, {}, -1, i});
  }
  auto const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  EXPECT_GT(peakHeld, 0);
  EXPECT_LE(peakHeld, 3 * perSequence);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  expectNothingHeld(*runtime);
}

TEST_P(SlidingReuseTest, AFollowUpTurnReusesThePreviousReplyWithTheWindowBeforeIt) {
  auto runtime = KVCacheRuntime::create(slidingConfig(device()));
  ReferenceEngine engine(*runtime);  // verify kAll, throws on the first oracle mismatch
  std::vector<int32_t> const first = tokenRun(150, 0);
  auto const outcome = engine.run(single(first, 60));
  ASSERT_TRUE(outcome.admitted);
  ASSERT_EQ(outcome.sequences.at(0).reason, FinishReason::kLength);
  std::vector<int32_t> const& reply = outcome.sequences[0].generated;
  ASSERT_EQ(reply.size(), 60u);
  // 150 + 59 tokens have KV (the last sampled one does not): 13 full blocks. The full layers
  // published them at the row's completion, and the sliding pages of its final window (blocks
  // 9..12, all past the prompt's 9 full blocks) were published beside them.
  std::vector<int32_t> const followUp =
      concatenated(concatenated(first, reply), tokenRun(30, 9000));
  EXPECT_EQ(runOnce(engine, single(followUp)), 13 * kPage);
  EXPECT_EQ(runtime->contextCache()->metrics().missCount(MissReason::kWindowEvicted), 0u);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  expectNothingHeld(*runtime);
}

TEST_P(SlidingReuseTest, InFlightJoinersStartFromTheirCachedWindowAndPublishTheirOwn) {
  auto runtime = KVCacheRuntime::create(slidingConfig(device()));
  ReferenceEngine engine(*runtime);  // verify kAll, throws on the first oracle mismatch
  std::vector<int32_t> const shared = tokenRun(200, 0);
  EXPECT_EQ(runOnce(engine, single(shared)), 0);  // publishes 12 blocks with their windows
  std::vector<int32_t> const fresh = tokenRun(150, 5000);
  std::deque<EngineSequence> joiners;
  joiners.push_back(EngineSequence{concatenated(shared, tokenRun(40, 900)), 5, {}, {}, {}, -1, 1});
  joiners.push_back(EngineSequence{fresh, 5, {}, {}, {}, -1, 2});
  auto const outcome = engine.run(single(tokenRun(60, 7000), 12), &joiners);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  ASSERT_EQ(outcome.sequences.size(), 3u);
  EXPECT_TRUE(outcome.sequences[1].joinedInFlight);
  EXPECT_TRUE(outcome.sequences[2].joinedInFlight);
  // The first joiner reads the 12 shared blocks' full KV and the window before block 12 (blocks
  // 8..11) from the cache; the oracle checked both.
  EXPECT_EQ(outcome.sequences[1].prefillStart, 192);
  EXPECT_EQ(outcome.sequences[2].prefillStart, 0);
  EXPECT_EQ(engine.stats().joins, 2);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  expectNothingHeld(*runtime);
  // The second joiner published its 9 blocks with their sliding pages when it was finalised.
  EXPECT_EQ(runOnce(engine, single(concatenated(fresh, tokenRun(20, 8000)))), 144);
  expectNothingHeld(*runtime);
}

TEST_P(SlidingReuseTest, AFounderPrefilledInChunksPublishesBothHalvesWhenItFinalises) {
  auto runtime = KVCacheRuntime::create(slidingConfig(device()));
  ReferenceEngineOptions options;  // verify kAll, throws on the first oracle mismatch
  options.maxBatchedTokens = 64;   // the founder's 200 tokens: 64 in the prefill step, then chunks
  ReferenceEngine engine(*runtime, options);
  std::vector<int32_t> const prompt = tokenRun(200, 0);
  std::deque<EngineSequence> joiners;
  joiners.push_back(EngineSequence{
      concatenated(std::vector<int32_t>(prompt.begin(), prompt.begin() + 100), tokenRun(30, 900)),
      5,
      {},
      {},
      {},
      -1,
      1});
  auto const outcome = engine.run(single(prompt, 8), &joiners);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  ASSERT_EQ(outcome.sequences.size(), 2u);
  EXPECT_EQ(outcome.sequences[0].reason, FinishReason::kLength);
  EXPECT_EQ(runtime->contextCache()->counters().heldPrefills, 1u);
  EXPECT_GE(engine.stats().chunkedPrefills, 1);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  expectNothingHeld(*runtime);
  // Its 12 full blocks and the windows before them were published when it finalised (its chunks
  // published the full layers' blocks only: a joiner meanwhile finds no window before them).
  EXPECT_EQ(runOnce(engine, single(concatenated(prompt, tokenRun(20, 8000)))), 192);
  expectNothingHeld(*runtime);
}

TEST_P(SlidingReuseTest, AJoinerTheSlidingPoolCannotHoldIsRefusedAndTheBatchRunsOn) {
  // 69 sliding pages: the founder keeps at most 6 once decoding, a 1000-token joiner needs 64
  // private pages; the full pool holds both.
  auto runtime = KVCacheRuntime::create(slidingConfig(device(), 69));
  ReferenceEngine engine(*runtime);
  std::deque<EngineSequence> joiners;
  joiners.push_back(EngineSequence{tokenRun(1000, 3000), 3, {}, {}, {}, -1, 1});
  auto const outcome = engine.run(single(tokenRun(100, 0), 6), &joiners);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  EXPECT_EQ(outcome.sequences.size(), 1u);
  EXPECT_EQ(joiners.size(), 1u);  // still queued: refused for capacity, not failed
  EXPECT_GT(engine.stats().joinRefusals, 0);
  EXPECT_EQ(engine.stats().joins, 0);
  // The full half had room, but the sliding half's check refused the joiner before the
  // coordinator was asked: nothing admitted, refused or retracted there.
  ContextCacheCoordinatorCounters const& counters = runtime->contextCache()->counters();
  EXPECT_EQ(counters.liveAdmissionRefusals, 0u);
  EXPECT_EQ(counters.liveAdmissions, 0u);
  EXPECT_EQ(counters.retractedAdmissions, 0u);
  expectNothingHeld(*runtime);
}

TEST_P(SlidingReuseTest, AFailedSynchronisationPoisonsAndShutdownRecoversEveryPage) {
  test::FaultArming faults;
  KVCacheRuntimeConfig config = slidingConfig(device());
  config.faults = faults.injector();
  auto runtime = KVCacheRuntime::create(config);
  ReferenceEngineOptions options;
  options.throwOnMismatch = false;
  options.onStep = [&](int64_t step) {
    if (step == 2) {
      faults.failNext();  // the next synchronisation of either half fails
    }
  };
  ReferenceEngine engine(*runtime, options);
  auto const outcome = engine.run(single(tokenRun(200, 0), 20));
  ASSERT_TRUE(outcome.admitted);
  EXPECT_TRUE(outcome.failed);
  EXPECT_TRUE(runtime->contextCache()->poisoned() || runtime->swaPageManager()->poisoned());
  EXPECT_TRUE(runtime->shutdown());
  EXPECT_FALSE(runtime->contextCache()->poisoned());
  EXPECT_FALSE(runtime->swaPageManager()->poisoned());
  expectNothingHeld(*runtime);
}

/// Random requests over a few shared prefixes on a small sliding pool (windows are dropped and
/// reused all the time): batches of 1-3 sequences, random lengths, cancellations and, now and
/// then, a failed synchronisation. The oracle checks every position attention reads at every
/// step (the reused windows included); after every request nothing is held, and after a poison
/// shutdown recovers every page of both pools.
TEST_P(SlidingReuseTest, RandomRequestsKeepEveryByteAndEveryPage) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed);
    std::mt19937_64 rng(seed);
    test::FaultArming faults;
    KVCacheRuntimeConfig config = slidingConfig(device(), 69 + static_cast<int32_t>(seed) * 7);
    config.numPages = 80 + static_cast<int32_t>(seed) * 16;  // the full pool evicts too
    config.faults = faults.injector();
    auto runtime = KVCacheRuntime::create(config);
    ReferenceEngineOptions options;
    options.throwOnMismatch = false;
    options.seed = seed;
    options.onStep = [&](int64_t) {
      if (std::uniform_int_distribution<int>(0, 199)(rng) == 0) {
        faults.failNext();
      }
    };
    ReferenceEngine engine(*runtime, options);
    std::vector<std::vector<int32_t>> const prefixes = {tokenRun(160, 0), tokenRun(90, 3000),
                                                        tokenRun(300, 6000)};
    auto draw = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    int64_t reused = 0;
    int64_t joined = 0;
    for (int r = 0; r < 40; ++r) {
      EngineRequest request;
      int const sequences = draw(1, 3);
      for (int i = 0; i < sequences; ++i) {
        std::vector<int32_t> prompt = prefixes[static_cast<std::size_t>(draw(0, 2))];
        prompt.resize(static_cast<std::size_t>(draw(1, static_cast<int>(prompt.size()))));
        prompt = concatenated(prompt, tokenRun(draw(1, 120), 10000 + 200 * r + 50 * i));
        int32_t const cancelAt = draw(0, 3) == 0 ? draw(0, 20) : -1;
        request.sequences.push_back(
            EngineSequence{std::move(prompt), draw(1, 60), {}, {}, {}, cancelAt, i});
      }
      std::deque<EngineSequence> joiners;
      for (int j = draw(0, 2); j > 0; --j) {
        std::vector<int32_t> prompt = prefixes[static_cast<std::size_t>(draw(0, 2))];
        prompt.resize(static_cast<std::size_t>(draw(1, static_cast<int>(prompt.size()))));
        prompt = concatenated(prompt, tokenRun(draw(1, 80), 50000 + 200 * r + 50 * j));
        joiners.push_back(EngineSequence{std::move(prompt), draw(1, 30), {}, {}, {}, -1, 10 + j});
      }
      auto const outcome = engine.run(request, &joiners);
      for (auto const& sequence : outcome.sequences) {
        reused += sequence.prefillStart;
        joined += sequence.joinedInFlight ? 1 : 0;
      }
      ASSERT_EQ(engine.stats().oracleMismatches, 0) << engine.stats().firstMismatch;
      if (runtime->contextCache()->poisoned() || runtime->swaPageManager()->poisoned()) {
        ASSERT_TRUE(runtime->shutdown());
      }
      expectNothingHeld(*runtime);
    }
    EXPECT_GT(reused, 0);
    EXPECT_GT(joined, 0);
  }
}

// ---------------------------------------------------------------- the facade, call by call

TEST(SlidingReuseFacadeTest, MisuseThrowsAndChangesNothing) {
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU));
  KVCacheRuntime& runtime = rig.runtime();
  runtime_test::FacadeDriver driver(rig);
  driver.add(tokenRun(100, 0));
  auto const beginWith = [&](bool speculative, DecodingKvHeadroom headroom) {
    return ManagedKVCacheRequest::begin(runtime.contextCache(), runtime.swaPageManager(),
                                        driver.request, driver.context, speculative, headroom,
                                        DecodingTokenStateContract::kCommittedPlusLookahead,
                                        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
  };
  EXPECT_TRUE(test::throwsError(
      [&] {
        beginWith(true, {1, 0});
      },
      {"ManagedKVCacheRequest::begin: the sliding-window reuse backend "
       "does not decode speculatively"}));
  EXPECT_TRUE(test::throwsError(
      [&] {
        beginWith(false, {2, 0});
      },
      {"ManagedKVCacheRequest::begin: the sliding-window reuse backend "
       "needs headroom {1, 0}, got {2, 0}"}));
  EXPECT_EQ(runtime.contextCache()->activeRequestCount(), 0);
  EXPECT_EQ(runtime.windowBlockCache()->heldPages(), 0);

  ASSERT_TRUE(driver.begin());
  ManagedKVCacheRequest& facade = driver.facade();
  EXPECT_TRUE(facade.hasContextReuse());
  ASSERT_NE(facade.prefillStarts(), nullptr);
  EXPECT_TRUE(test::throwsError([&] { (void)driver.admit(tokenRun(40, 500)); },
                                {"ManagedKVCacheRequest::admitSequence", "no pending work"}));
  Tensor hidden;
  EXPECT_TRUE(test::throwsError(
      [&] { facade.publishHybridMtpEndpoint(0, 100, hidden, 0); },
      {"ManagedKVCacheRequest::publishHybridMtpEndpoint: row 0: the sliding-window reuse "
       "backend has no recurrent layers"}));
  EXPECT_TRUE(test::throwsError([&] { facade.restoreHybridMtpBoundaryHidden(0, hidden, 0); },
                                {"ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden"}));
  EXPECT_TRUE(driver.prefill());
  EXPECT_TRUE(driver.decode());
  driver.verify();
  EXPECT_TRUE(driver.finish());
  expectNothingHeld(runtime);
}

TEST(SlidingReuseFacadeTest, APrefillWhileAnotherRequestOwnsTheLengthsThrowsOnBothHalves) {
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU));
  runtime_test::FacadeDriver first(rig);
  runtime_test::FacadeDriver second(rig);
  first.add(tokenRun(100, 0));
  second.add(tokenRun(60, 5000));
  ASSERT_TRUE(first.begin());
  ASSERT_TRUE(first.prefill());  // the sliding half's length pools follow it until it finishes
  ASSERT_TRUE(first.decode());
  ASSERT_TRUE(first.compact({-1}));  // emptied, not finished: the full half executes no request
  ASSERT_TRUE(second.begin());
  {
    runtime_test::BackendState const before = rig.observe();
    EXPECT_TRUE(test::throwsError(
        [&] { (void)second.facade().preparePrefill(); },
        {"ManagedKVCacheRequest::preparePrefill", "the KV-length pools follow request"}));
    rig.expectUnchanged(before);  // the full half bound nothing either
  }
  EXPECT_TRUE(first.finish());
  EXPECT_TRUE(second.prefill());
  EXPECT_TRUE(second.decode());
  second.verify();
  EXPECT_TRUE(second.finish());
  expectNothingHeld(rig.runtime());
}

TEST(SlidingReuseFacadeTest, AJoinerIsAdmittedRetractedAndSeatedOnBothHalves) {
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU));
  KVCacheRuntime& runtime = rig.runtime();
  WindowBlockCache const& window = *runtime.windowBlockCache();
  ContextCacheCoordinatorCounters const& counters = runtime.contextCache()->counters();
  runtime_test::FacadeDriver driver(rig);
  driver.add(tokenRun(100, 0));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  {  // the founder alone: nothing to undo on either half
    runtime_test::BackendState const before = rig.observe();
    EXPECT_FALSE(driver.facade().retractSequenceAdmission());
    rig.expectUnchanged(before);
  }
  int32_t const founderPages = window.heldPages();
  // A 40-token joiner from scratch: ceil(40 / 16) pages and one spare on the sliding half.
  ASSERT_EQ(driver.admit(tokenRun(40, 500)), AdmitSequenceStatus::kAdmitted);
  EXPECT_EQ(window.heldPages(), founderPages + 4);
  EXPECT_EQ(runtime.swaPageManager()->residentRowState(driver.rows[1].resident.slot),
            ResidentRowState::kActive);
  ASSERT_TRUE(driver.retractNewest());
  EXPECT_EQ(window.heldPages(), founderPages);
  EXPECT_EQ(counters.retractedAdmissions, 1u);
  // Admitted again; the founder decodes while the joiner is not seated (it holds on both halves).
  ASSERT_EQ(driver.admit(tokenRun(40, 500)), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(test::throwsError(
      [&] { (void)driver.facade().finalizeSequenceAdmission(0, 7, 100); },
      {"ManagedKVCacheRequest::finalizeSequenceAdmission", "row 0 is not an unfinalised"}));
  ASSERT_TRUE(driver.seatNewest());
  int32_t const perSequence = BoundedSwaKVPageManager::decodePagesPerSequence(kWindow, kPage);
  for (int step = 0; step < 20; ++step) {
    ASSERT_TRUE(driver.decode());
    EXPECT_LE(window.heldPages(), 2 * perSequence);
    driver.verify();
  }
  EXPECT_TRUE(driver.finish());
  expectNothingHeld(runtime);
}

TEST(SlidingReuseFacadeTest, ARefusalOfTheSlidingPoolHoldsNothingOnEitherHalf) {
  // 69 sliding pages: one 1000-token prompt (64 pages + 1 spare) fits, two do not; the full pool
  // (4 x 64 pages) holds both.
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU, 69));
  KVCacheRuntime& runtime = rig.runtime();
  {
    runtime_test::FacadeDriver driver(rig);
    driver.add(tokenRun(1000, 0));
    driver.add(tokenRun(1000, 3000));
    EXPECT_FALSE(driver.begin());
  }
  EXPECT_EQ(runtime.contextCache()->activeRequestCount(), 0);
  EXPECT_EQ(runtime.swaPageManager()->activeRequestCount(), 0);
  expectNothingHeld(runtime);
  runtime_test::FacadeDriver driver(rig);
  driver.add(tokenRun(1000, 0));
  ASSERT_TRUE(driver.begin());
  EXPECT_TRUE(driver.prefill());
  EXPECT_TRUE(driver.finish());
  expectNothingHeld(runtime);
}

// A refused begin changes nothing on either half. Here the full half could admit the batch only
// by evicting the cached record of an earlier prompt, and the sliding half cannot hold it: the
// refusal must come before the coordinator evicts (or leases, or reorders its free ring).
TEST(SlidingReuseFacadeTest, ABeginTheSlidingPoolCannotHoldChangesNothingOnEitherHalf) {
  // 69 sliding pages hold one 1000-token prompt (63 pages + 1 spare), not two; 150 full pages hold
  // the two only once the 62 cached blocks of the first prompt are evicted.
  KVCacheRuntimeConfig config = slidingConfig(DeviceType::kCPU, 69);
  config.numPages = 150;
  runtime_test::RuntimeRig rig(config);
  KVCacheRuntime& runtime = rig.runtime();
  ASSERT_NO_FATAL_FAILURE(cachePrompt(rig, tokenRun(1000, 0)));
  ContextCacheManager const& manager = runtime.contextCache()->manager();
  ASSERT_EQ(manager.records().size(), 1u);
  ASSERT_LT(manager.pools().freeCount(ResourceType::kBaseKvPage), 2 * 63);
  {
    runtime_test::FacadeDriver driver(rig);
    driver.add(tokenRun(1000, 5000));
    driver.add(tokenRun(1000, 9000));
    runtime_test::BackendState const before = rig.observe();
    EXPECT_FALSE(driver.begin());
    rig.expectUnchanged(before);
  }
  // The cached prompt is still there on both halves: a repeat reuses all but its last block.
  runtime_test::FacadeDriver repeat(rig);
  repeat.add(tokenRun(1000, 0));
  ASSERT_TRUE(repeat.begin());
  EXPECT_EQ(repeat.rows[0].prefillStart, 992);
  ASSERT_TRUE(repeat.prefill());
  repeat.verify();
  ASSERT_TRUE(repeat.finish());
  expectNothingHeld(runtime);
}

// The admission check is exact: a batch whose sliding pages are exactly what the pool can give
// is admitted, one page more is refused with nothing changed. Window pages another request
// already holds cost nothing (holding them again takes nothing from the pool); cached ones nobody
// holds are taken out of what the pool can allocate.
TEST(SlidingReuseFacadeTest, TheAdmissionCheckCountsEveryPageTheSlidingHalfWouldTake) {
  std::vector<int32_t> const shared = tokenRun(200, 0);
  std::vector<int32_t> const prefix(shared.begin(), shared.begin() + 192);  // 12 blocks
  auto const prompt = [&](int32_t length, int32_t seed) {
    return concatenated(prefix, tokenRun(length - 192, seed));
  };
  for (bool const windowHeld : {true, false}) {
    SCOPED_TRACE(windowHeld ? "the window before block 12 held by another request"
                            : "the window before block 12 cached, held by nobody");
    runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU, 80));
    KVCacheRuntime& runtime = rig.runtime();
    WindowBlockCache const& window = *runtime.windowBlockCache();
    {
      runtime_test::FacadeDriver first(rig);  // caches blocks 0..11 in both pools
      first.add(shared);
      ASSERT_TRUE(first.begin());
      ASSERT_TRUE(first.prefill());
      ASSERT_TRUE(first.finish());
    }
    // Begun only: holds the window before block 12 (blocks 8..11) and 4 private pages (232
    // tokens from 192: pages 12..14 and a spare).
    runtime_test::FacadeDriver holder(rig);
    if (windowHeld) {
      holder.add(prompt(232, 7000));
      ASSERT_TRUE(holder.begin());
      ASSERT_EQ(holder.rows[0].prefillStart, 192);
      ASSERT_EQ(window.heldPages(), 8);
    }
    int32_t const available = window.availablePages();
    ASSERT_EQ(available, windowHeld ? 72 : 80);
    // Two rows from block 12, each ceil(L / 16) - 12 + 1 private pages, sharing one window of 4
    // pages that costs 4 more when nobody holds it: 2 x 36 = 72, or 2 x 38 + 4 = 80.
    int32_t const length = windowHeld ? 752 : 784;
    {
      runtime_test::FacadeDriver tooLong(rig);
      tooLong.add(prompt(length, 10000));
      tooLong.add(prompt(length + 1, 20000));  // one page more
      runtime_test::BackendState const before = rig.observe();
      EXPECT_FALSE(tooLong.begin());
      rig.expectUnchanged(before);
    }
    runtime_test::FacadeDriver exact(rig);
    exact.add(prompt(length, 10000));
    exact.add(prompt(length, 20000));
    ASSERT_TRUE(exact.begin());
    EXPECT_EQ(exact.rows[0].prefillStart, 192);
    EXPECT_EQ(exact.rows[1].prefillStart, 192);
    EXPECT_EQ(window.availablePages(), 0);
    if (windowHeld) {
      ASSERT_TRUE(holder.finish());  // the sliding half's length pools follow one request
    }
    ASSERT_TRUE(exact.prefill());
    exact.verify();
    ASSERT_TRUE(exact.finish());
    expectNothingHeld(runtime);
  }
}

// The same for an in-flight admission: the joiner is refused before the coordinator admits it,
// so the records it would have evicted, the free ring and the counters are as they were.
TEST(SlidingReuseFacadeTest, AJoinerTheSlidingPoolCannotHoldChangesNothingOnEitherHalf) {
  // 69 sliding pages: the founder keeps 6 once decoding, a fresh 1000-token joiner needs 64; the
  // full pool (120 pages) admits it only by evicting the 62 cached blocks of the first prompt.
  KVCacheRuntimeConfig config = slidingConfig(DeviceType::kCPU, 69);
  config.numPages = 120;
  runtime_test::RuntimeRig rig(config);
  KVCacheRuntime& runtime = rig.runtime();
  ASSERT_NO_FATAL_FAILURE(cachePrompt(rig, tokenRun(1000, 0)));
  runtime_test::FacadeDriver driver(rig);
  driver.add(tokenRun(100, 3000));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.decode());
  ContextCacheManager const& manager = runtime.contextCache()->manager();
  ASSERT_EQ(manager.records().size(), 2u);
  ASSERT_LT(manager.pools().freeCount(ResourceType::kBaseKvPage), 63);
  ContextCacheCoordinatorCounters const counters = runtime.contextCache()->counters();
  runtime_test::BackendState const before = rig.observe();
  EXPECT_EQ(driver.admit(tokenRun(1000, 5000)), AdmitSequenceStatus::kNoCapacity);
  rig.expectUnchanged(before);
  EXPECT_EQ(runtime.contextCache()->counters().liveAdmissions, counters.liveAdmissions);
  EXPECT_EQ(runtime.contextCache()->counters().retractedAdmissions, counters.retractedAdmissions);
  // A joiner the pool holds is admitted and seated as usual.
  ASSERT_EQ(driver.admit(tokenRun(40, 500)), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.decode());
  driver.verify();
  ASSERT_TRUE(driver.finish());
  expectNothingHeld(runtime);
}

// A finalisation the sliding half refuses (a decode step is prepared) throws before the full half
// finalises anything: the joiner stays unfinalised on both halves, and is finalised between steps.
TEST(SlidingReuseFacadeTest, AFinalisationTheSlidingHalfRefusesChangesNothingOnEitherHalf) {
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU));
  KVCacheRuntime& runtime = rig.runtime();
  runtime_test::FacadeDriver driver(rig);
  driver.add(tokenRun(100, 0));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  std::vector<int32_t> const joiner = tokenRun(40, 500);
  ASSERT_EQ(driver.admit(joiner), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.prepareDecode());
  {
    runtime_test::BackendState const before = rig.observe();
    ContextCacheCoordinatorCounters const counters = runtime.contextCache()->counters();
    EXPECT_TRUE(
        test::throwsError([&] { (void)driver.facade().finalizeSequenceAdmission(1, 7, 40); },
                          {"ManagedKVCacheRequest::finalizeSequenceAdmission", "work is pending"}));
    rig.expectUnchanged(before);
    EXPECT_EQ(runtime.contextCache()->counters().prefillPublications, counters.prefillPublications);
    EXPECT_EQ(runtime.contextCache()->manager().records().size(), 1u);
  }
  ASSERT_TRUE(driver.completeDecode());  // the step prepareDecode executed
  ASSERT_TRUE(driver.seatNewest());      // between steps: both halves finalise
  ASSERT_TRUE(driver.decode());
  driver.verify();
  ASSERT_TRUE(driver.finish());
  expectNothingHeld(runtime);
}

// A decode step the sliding half refuses while the full half could take it (the page a row retires
// is a reused window page another request still holds, so it brings back no spare, and the
// sliding pool is full) is refused on the sliding half alone: nothing is prepared on the full
// half, so the engine can finish the request, or prepare the step again once pages came back.
TEST(SlidingReuseFacadeTest, ADecodeStepTheSlidingHalfRefusesLeavesARequestThatGoesOn) {
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU, 69));
  KVCacheRuntime& runtime = rig.runtime();
  WindowBlockCache const& window = *runtime.windowBlockCache();
  std::vector<int32_t> const shared = tokenRun(128, 0);  // 8 blocks
  ASSERT_NO_FATAL_FAILURE(cachePrompt(rig, shared));
  // Both reuse the 8 blocks and hold the window before block 8 (blocks 4..7).
  runtime_test::FacadeDriver decoding(rig);
  decoding.add(concatenated(shared, tokenRun(8, 1000)));
  runtime_test::FacadeDriver holding(rig);
  holding.add(concatenated(shared, tokenRun(8, 2000)));
  ASSERT_TRUE(decoding.begin());
  ASSERT_TRUE(holding.begin());
  ASSERT_EQ(decoding.rows[0].prefillStart, 128);
  ASSERT_EQ(holding.rows[0].prefillStart, 128);
  ASSERT_TRUE(decoding.prefill());
  // The rest of the sliding pool: a fresh prompt, begun only.
  runtime_test::FacadeDriver filling(rig);
  int32_t const available = window.availablePages();
  ASSERT_GT(available, 2);
  filling.add(tokenRun((available - 1) * kPage, 5000));
  ASSERT_TRUE(filling.begin());
  ASSERT_EQ(window.availablePages(), 0);
  // Each window page the decoding row retires is held by `holding`: no spare comes back, and
  // the next page it needs is not there. decodeStepDemand says so before each step.
  int32_t steps = 0;
  DecodeStepDemand demand;
  while (steps < 64) {
    demand = decoding.facade().decodeStepDemand(runtime_test::kVanilla);
    if (!decoding.decode()) {
      break;
    }
    ++steps;
  }
  ASSERT_LT(steps, 64) << "the sliding half never refused a step";
  EXPECT_EQ(demand.slidingPages, 1) << "the refused step's page, from the page source";
  EXPECT_EQ(window.availablePages(), 0);
  RowFailure const failure = decoding.facade().lastFailure();
  EXPECT_EQ(failure.reason, RowFailureReason::kNoCapacity);
  EXPECT_EQ(failure.row, 0);
  EXPECT_EQ(runtime.contextCache()->counters().growthFailures, 0u);  // the full half had room
  EXPECT_FALSE(runtime.contextCache()->poisoned());
  // The request goes on: once the other request let go of the shared window, the step is
  // prepared again (before, the refusal ended the request).
  EXPECT_TRUE(holding.finish());
  EXPECT_TRUE(filling.finish());
  int32_t const leased = runtime.capacity().sliding->leasedPages;
  ASSERT_EQ(decoding.facade().decodeStepDemand(runtime_test::kVanilla).slidingPages, 1);
  ASSERT_TRUE(decoding.prepareDecode());
  EXPECT_EQ(runtime.capacity().sliding->leasedPages, leased + 1) << "the page the demand named";
  ASSERT_TRUE(decoding.completeDecode());
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(decoding.decode()) << "step " << step << " after the other requests finished";
  }
  decoding.verify();
  EXPECT_TRUE(decoding.finish());
  expectNothingHeld(runtime);
}

// KVCacheRuntime::estimateAdmission on sliding-window reuse counts the sliding pool: the pages
// the row allocates from its reuse start and the cached window pages it pins (before, 0), and a
// pool that cannot give them makes both fit flags false, as begin then refuses.
TEST(SlidingReuseFacadeTest, AnEstimateCountsWhatAdmissionTakesFromTheSlidingPool) {
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU, 69));
  KVCacheRuntime& runtime = rig.runtime();
  std::vector<int32_t> const shared = tokenRun(128, 0);  // 8 blocks
  ASSERT_NO_FATAL_FAILURE(cachePrompt(rig, shared));
  auto slidingLeased = [&] { return runtime.capacity().sliding->leasedPages; };
  // Cold: ceil(70 / 16) + 1 pages. Warm: from 128, ceil(136 / 16) - 8 + 1 private pages and
  // the window's 4 cached pages before the start.
  for (auto const& [prompt, expected] : {std::pair{tokenRun(70, 9000), 5 + 1},
                                         std::pair{concatenated(shared, tokenRun(8, 1)), 2 + 4}}) {
    AdmissionEstimate const estimate = runtime.estimateAdmission(prompt);
    EXPECT_EQ(estimate.slidingPages, expected) << prompt.size() << " tokens";
    EXPECT_TRUE(estimate.fitsWithoutEviction);
    int32_t const before = slidingLeased();
    runtime_test::FacadeDriver driver(rig);
    driver.add(prompt);
    ASSERT_TRUE(driver.begin());
    EXPECT_EQ(slidingLeased() - before, estimate.slidingPages) << prompt.size() << " tokens";
    ASSERT_TRUE(driver.prefill());
    ASSERT_TRUE(driver.finish());
  }
  // A prompt the sliding pool cannot hold beside a running one: both flags false, begin refuses.
  runtime_test::FacadeDriver filling(rig);  // two rows (a row holds at most 64 pages)
  int32_t const fill = runtime.windowBlockCache()->availablePages() - 4;
  ASSERT_GT(fill, 40);
  filling.add(tokenRun(39 * kPage, 7000));                // 40 pages
  filling.add(tokenRun((fill - 40 - 1) * kPage, 17000));  // the rest but 4
  ASSERT_TRUE(filling.begin());
  ASSERT_EQ(runtime.windowBlockCache()->availablePages(), 4);
  std::vector<int32_t> const large = tokenRun(16 * 12, 8000);
  AdmissionEstimate const refused = runtime.estimateAdmission(large);
  EXPECT_EQ(refused.slidingPages, 12 + 1);
  EXPECT_GT(refused.slidingPages, runtime.windowBlockCache()->availablePages());
  EXPECT_FALSE(refused.fitsWithoutEviction);
  EXPECT_FALSE(refused.fitsAfterEviction);
  runtime_test::FacadeDriver late(rig);
  late.add(large);
  EXPECT_FALSE(late.begin());
  EXPECT_TRUE(filling.finish());
  expectNothingHeld(runtime);
}

// Preemption publishes a row's committed blocks on both halves. A row cancelled in a decode step
// produced no token, but its sliding window moved on: its sliding endpoint is one past the
// coordinator's committed count, and only blocks within that count are published (before, the
// block past it was asked of the coordinator, which refused it after publishing its own half).
TEST(SlidingReuseFacadeTest, PreemptingARowCancelledInAStepPublishesItsCommittedBlocks) {
  runtime_test::RuntimeRig rig(slidingConfig(DeviceType::kCPU));
  KVCacheRuntime& runtime = rig.runtime();
  std::vector<int32_t> const prompt = tokenRun(40, 0);
  runtime_test::FacadeDriver driver(rig);
  driver.add(prompt);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  for (int step = 0; step < 23; ++step) {  // committed 40 + 23 = 63: blocks 0..2 complete
    ASSERT_TRUE(driver.decode());
  }
  driver.cancel(0);
  ASSERT_TRUE(driver.decode());  // no token; the sliding window moves to 64
  ASSERT_TRUE(driver.facade().preemptSequence(0));
  std::vector<int32_t> committed = prompt;
  committed.insert(committed.end(), driver.generated(0).begin(), driver.generated(0).begin() + 23);
  ASSERT_TRUE(driver.finish());
  // Block 2 (tokens 32..47) was published by the preemption alone, on both halves: a prompt that
  // continues the committed tokens reuses three blocks with the window before them.
  runtime_test::FacadeDriver next(rig);
  next.add(concatenated(committed, tokenRun(20, 9000)));
  ASSERT_TRUE(next.begin());
  EXPECT_EQ(next.rows[0].prefillStart, 48);
  ASSERT_TRUE(next.prefill());
  next.verify();
  ASSERT_TRUE(next.finish());
  expectNothingHeld(runtime);
}

}  // namespace
}  // namespace mkv
