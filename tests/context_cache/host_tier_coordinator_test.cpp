// The host tier through ContextCacheCoordinator, on CPU and GPU tensors: an evicted prefix comes
// back from pinned host memory bit for bit (the KV oracle reads every reused position), a
// corrupted host page is caught by the oracle, failed launches poison and lose nothing else, and
// shutdown() leaves every page of both tiers accounted for (docs/context_cache.md, "Host tier").

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string_view>

#include "coordinator_test_rig.h"
#include "mkv/host_kv_tier.h"

namespace mkv {
namespace {

using test::kVanilla;
using test::Seq;
using test::tokenRun;

constexpr int32_t kPage = 16;

/// Pool (6 pages of 16 tokens), table, host tier (8 pages), coordinator and oracle on one device.
class HostTierCoordinatorTest : public test::DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (IsSkipped()) {
      return;
    }
    KVCachePoolConfig config;
    config.numLayers = 2;
    config.numKVHeads = 1;
    config.headDim = 8;
    config.tokensPerPage = kPage;
    config.numPages = 6;
    config.maxBatchSize = 2;
    config.deviceType = device();
    mPool = std::make_unique<KVCachePool>(config);
    mTable = std::make_unique<KVPageTable>(2, 6, config.numPages, PageTableMode::kDense, device());
    HostKvTierConfig tier;
    tier.numPages = 8;
    tier.faults = mSync.injector();
    mTier = std::make_unique<HostKvTier>(tier, *mPool);
    ContextCacheConfig cache;
    cache.maxRecords = 16;
    cache.eventQueueCapacity = 64;
    cache.evictionPolicy = EvictionPolicyKind::kLru;
    ContextCachePhysicalResources resources{mPool.get(), mTable.get(), nullptr, nullptr, nullptr};
    resources.hostTier = mTier.get();
    mCoordinator =
        std::make_unique<ContextCacheCoordinator>(cache, ContextCacheDeploymentProfile{}, resources,
                                                  nullptr, StreamSynchronizer{}, mSync.injector());
    mOracle = std::make_unique<testing::KvOracle>(*mPool, *mTable);
  }
  void TearDown() override {
    if (mCoordinator) {
      (void)mCoordinator->shutdown();
    }
  }

  /// One request of one sequence: admission, the oracle's prefill (checking the reused prefix
  /// first), publication, finish. Returns the reuse length; -1 when the admission was refused.
  int32_t serve(Seq& seq, testing::OracleReport* reused = nullptr) {
    ContextCacheBatchAdmission const batch = test::promptBatchOf({&seq});
    auto begun = mCoordinator->beginRequest(batch, kVanilla, nullptr);
    mLastStatus = begun.status;
    if (!begun.admission) {
      return -1;
    }
    ContextCacheCoordinator::RequestHandle handle = std::move(begun.admission->request);
    int32_t const start = begun.admission->prefillStarts[0];
    mCoordinator->preparePrefill(handle);
    if (start > 0) {
      testing::OracleReport const report =
          mOracle->verify(seq.resident.slot, seq.digests, 0, start);
      if (reused != nullptr) {
        *reused = report;
      } else {
        EXPECT_TRUE(report.ok()) << "reused prefix: " << report.firstMismatch;
      }
    }
    mOracle->write(seq.resident.slot, seq.digests, start, seq.promptLength);
    seq.materialized = seq.promptLength;
    mPool->writeLengths(0, std::span<int32_t const>(&seq.materialized, 1), nullptr);
    seq.sample();
    ContextCacheSequenceAdvance const advance{&seq.tokens.back(), 1, seq.promptLength};
    EXPECT_EQ(mCoordinator->finalizePrefillPublication(handle, std::span(&advance, 1)),
              ContextCacheStatus::kOk);
    EXPECT_EQ(mCoordinator->finish(handle), ContextCacheStatus::kOk);
    return start;
  }

  /// No lease, no pin; free + cached == capacity on the GPU; host blocks within the tier.
  void expectEveryPageAccountedFor() {
    ResourcePools const& pools = mCoordinator->manager().pools();
    int32_t cached = 0;
    for (PageId page = 0; page < pools.capacity(ResourceType::kBaseKvPage); ++page) {
      EXPECT_EQ(pools.activeRefs({ResourceType::kBaseKvPage, page}), 0) << page;
      cached += pools.cacheRefs({ResourceType::kBaseKvPage, page}) > 0 ? 1 : 0;
    }
    EXPECT_EQ(pools.freeCount(ResourceType::kBaseKvPage) + cached,
              pools.capacity(ResourceType::kBaseKvPage));
    HostBlockTier const* host = mCoordinator->manager().hostTier();
    ASSERT_NE(host, nullptr);
    EXPECT_EQ(host->pinnedPages(), 0);
    EXPECT_LE(host->size(), host->capacity());
  }

  /// Publishes `a` (3 full pages), then a different 5-page prompt that evicts it to the host.
  void publishThenEvict(std::vector<int32_t> const& a) {
    Seq first(a, 0);
    ASSERT_EQ(serve(first), 0);
    Seq other(tokenRun(5 * kPage, 5000), 0);
    ASSERT_EQ(serve(other), 0);
  }

  test::FaultArming mSync;
  ContextCacheStatus mLastStatus = ContextCacheStatus::kOk;
  std::unique_ptr<KVCachePool> mPool;
  std::unique_ptr<KVPageTable> mTable;
  std::unique_ptr<HostKvTier> mTier;
  std::unique_ptr<ContextCacheCoordinator> mCoordinator;
  std::unique_ptr<testing::KvOracle> mOracle;
};

TEST_P(HostTierCoordinatorTest, AnEvictedPrefixComesBackFromTheHostBitForBit) {
  std::vector<int32_t> const a = tokenRun(3 * kPage, 100);
  ASSERT_NO_FATAL_FAILURE(publishThenEvict(a));
  ContextCacheMetrics const evicted = mCoordinator->metrics();
  EXPECT_GE(evicted.offloadedPages, 3U);
  EXPECT_EQ(evicted.offloadedBytes, evicted.offloadedPages * uint64_t(mTier->bytesPerPage()));

  Seq again(test::concatenated(a, tokenRun(5, 900)), 1);
  EXPECT_EQ(serve(again), 3 * kPage) << "the whole evicted prefix is reused";
  ContextCacheMetrics const back = mCoordinator->metrics();
  EXPECT_EQ(back.onboardedPages, 3U);
  EXPECT_EQ(back.hostTierHitTokens, uint64_t{3} * kPage);
  EXPECT_GE(mCoordinator->counters().hostTierTransfers, 2U);
  test::synchronize(device());
  expectEveryPageAccountedFor();
}

TEST_P(HostTierCoordinatorTest, TheOracleCatchesACorruptedHostPage) {
  std::vector<int32_t> const a = tokenRun(3 * kPage, 100);
  ASSERT_NO_FATAL_FAILURE(publishThenEvict(a));
  ASSERT_EQ(mTier->synchronize(), cudaSuccess);
  PromptBlocks const blocks = hashPromptBlocks(PromptView{a, {}, {}}, kPage);
  std::optional<PageId> const page =
      mCoordinator->manager().hostTier()->index().find(blocks.keys[1]);
  ASSERT_TRUE(page.has_value());
  // One byte of V of layer 1 in block 1 (host memory is host-writable, pinned or not).
  auto* bytes = static_cast<unsigned char*>(const_cast<void*>(mTier->hostPage(1, 1, *page)));
  bytes[3] ^= 0x5A;
  Seq again(test::concatenated(a, tokenRun(5, 900)), 1);
  testing::OracleReport reused;
  EXPECT_EQ(serve(again, &reused), 3 * kPage);
  EXPECT_FALSE(reused.ok()) << "a flipped byte of an onboarded page went unnoticed";
}

TEST_P(HostTierCoordinatorTest, AFailedOnboardingPoisonsAndShutdownRecoversEveryPage) {
  std::vector<int32_t> const a = tokenRun(3 * kPage, 100);
  ASSERT_NO_FATAL_FAILURE(publishThenEvict(a));
  int32_t const held = mCoordinator->manager().hostTier()->size();
  mSync.failFromNow(FaultSite::kHostTierOnboard);
  Seq again(test::concatenated(a, tokenRun(5, 900)), 1);
  EXPECT_EQ(serve(again), -1);
  EXPECT_EQ(mLastStatus, ContextCacheStatus::kPoisoned);
  EXPECT_EQ(mCoordinator->manager().hostTier()->size(), held) << "no offload failed";
  Seq refused(tokenRun(kPage, 7000), 0);
  EXPECT_EQ(serve(refused), -1) << "poisoned until shutdown";
  EXPECT_EQ(mLastStatus, ContextCacheStatus::kPoisoned);
  mSync.disarm();
  EXPECT_EQ(mCoordinator->shutdown(), ContextCacheStatus::kOk);
  expectEveryPageAccountedFor();
  EXPECT_EQ(serve(again), 3 * kPage) << "after shutdown the host copy is still good";
}

TEST_P(HostTierCoordinatorTest, AFailedOffloadForgetsItsBlocksAndLosesNothingElse) {
  std::vector<int32_t> const a = tokenRun(3 * kPage, 100);
  Seq first(a, 0);
  ASSERT_EQ(serve(first), 0);
  (void)mCoordinator->drainEvents();
  mSync.failFromNow(FaultSite::kHostTierOffload);
  Seq other(tokenRun(5 * kPage, 5000), 0);
  EXPECT_EQ(serve(other), -1);
  EXPECT_EQ(mLastStatus, ContextCacheStatus::kPoisoned);
  EXPECT_EQ(mCoordinator->manager().hostTier()->size(), 0) << "the failed offloads are forgotten";
  int32_t removedOnHost = 0;
  for (KvEvent const& event : mCoordinator->drainEvents()) {
    auto const* removed = std::get_if<BlockRemoved>(&event);
    removedOnHost += removed != nullptr && removed->medium == KvMedium::kCpu ? 1 : 0;
  }
  EXPECT_EQ(removedOnHost, 3);
  mSync.disarm();
  EXPECT_EQ(mCoordinator->shutdown(), ContextCacheStatus::kOk);
  expectEveryPageAccountedFor();
  Seq again(test::concatenated(a, tokenRun(5, 900)), 1);
  EXPECT_EQ(serve(again), 0) << "the forgotten blocks are not reused";
}

TEST_P(HostTierCoordinatorTest, AFailedOrderingPoisons) {
  std::vector<int32_t> const a = tokenRun(3 * kPage, 100);
  ASSERT_NO_FATAL_FAILURE(publishThenEvict(a));
  mSync.failFromNow(FaultSite::kHostTierOrder);
  Seq again(test::concatenated(a, tokenRun(5, 900)), 1);
  EXPECT_EQ(serve(again), -1);
  EXPECT_EQ(mLastStatus, ContextCacheStatus::kPoisoned);
  mSync.disarm();
  EXPECT_EQ(mCoordinator->shutdown(), ContextCacheStatus::kOk);
  expectEveryPageAccountedFor();
}

INSTANTIATE_TEST_SUITE_P(Devices, HostTierCoordinatorTest, test::allDeviceTypes(),
                         test::deviceName);

TEST(HostTierDeploymentTest, AHostTierOnAHybridOrDisabledDeploymentIsRefused) {
  KVCachePoolConfig config;
  config.numLayers = 1;
  config.numKVHeads = 1;
  config.headDim = 8;
  config.tokensPerPage = kPage;
  config.numPages = 4;
  config.maxBatchSize = 1;
  config.deviceType = DeviceType::kCPU;
  KVCachePool pool(config);
  KVPageTable table(1, 4, 4, PageTableMode::kDense, DeviceType::kCPU);
  HostKvTierConfig tierConfig;
  tierConfig.numPages = 4;
  HostKvTier tier(tierConfig, pool);
  ContextCachePhysicalResources resources{&pool, &table, nullptr, nullptr, nullptr};
  resources.hostTier = &tier;
  auto refusal = [&](ContextCacheConfig const& cache,
                     ContextCacheDeploymentProfile const& profile) {
    try {
      ContextCacheCoordinator coordinator(cache, profile, resources, nullptr);
    } catch (Error const& error) {
      return std::string(error.what());
    }
    return std::string("accepted");
  };
  ContextCacheConfig disabled;
  disabled.enabled = false;
  EXPECT_NE(refusal(disabled, {}).find("a host tier needs context reuse enabled"),
            std::string::npos);
  ContextCacheDeploymentProfile speculative;
  speculative.speculative = SpecReuseContract{false, 0};
  EXPECT_NE(refusal({}, speculative).find("attention-only, non-speculative"), std::string::npos)
      << refusal({}, speculative);
}

}  // namespace
}  // namespace mkv
