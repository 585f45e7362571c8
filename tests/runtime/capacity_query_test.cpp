// KVCacheRuntime::capacity() and estimateAdmission(): the page occupancy a scheduler reads and the
// dry run of an admission (docs/integration.md, "Capacity and admission queries"). The queries
// must agree with the page accounting at every step and change nothing. Every test runs on host
// and GPU tensors (the kGPU instances skip without a CUDA device); the lifecycle fuzzer checks the
// same agreement after every operation (tests/fuzz/lifecycle/*_invariants.cpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "context_cache/window_block_cache.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_runtime.h"
#include "runtime_test_rig.h"
#include "support/test_util.h"

namespace mkv::runtime_test {
namespace {

class CapacityQueryTest : public RuntimeCaseTest {};

INSTANTIATE_TEST_SUITE_P(Backends, CapacityQueryTest, ::testing::ValuesIn(everyBackendCase()),
                         runtimeCaseName);

/// Base pages some lease holds (active references), counted page by page.
int32_t leasedBasePages(KVCacheRuntime& runtime) {
  ResourcePools const& pools = runtime.contextCache()->manager().pools();
  int32_t leased = 0;
  for (int32_t page = 0; page < pools.capacity(ResourceType::kBaseKvPage); ++page) {
    leased += pools.activeRefs(ResourceId{ResourceType::kBaseKvPage, page}) > 0 ? 1 : 0;
  }
  return leased;
}

/// capacity() against the backend's own counts: each pool it reports sums to its size, and the
/// free, reclaimable and leased pages are the backend's.
void expectCapacityAgrees(RuntimeRig& rig, char const* when) {
  SCOPED_TRACE(when);
  KVCacheRuntime& runtime = rig.runtime();
  KVCacheCapacity const capacity = runtime.capacity();
  if (rig.boundedSwa()) {
    ASSERT_FALSE(capacity.base.has_value()) << "the identity-mapped full pool is not managed";
    ASSERT_TRUE(capacity.sliding.has_value());
    EXPECT_EQ(capacity.sliding->totalPages, rig.totalPages());
    EXPECT_EQ(capacity.sliding->freePages, rig.freePages());
    EXPECT_EQ(capacity.sliding->reclaimablePages, 0);
    EXPECT_EQ(capacity.sliding->leasedPages, rig.heldPages());
    EXPECT_DOUBLE_EQ(capacity.usage(), capacity.sliding->usage());
    return;
  }
  ASSERT_TRUE(capacity.base.has_value());
  ResourcePools const& pools = runtime.contextCache()->manager().pools();
  EXPECT_EQ(capacity.base->totalPages, rig.totalPages());
  EXPECT_EQ(capacity.base->freePages, rig.freePages());
  EXPECT_EQ(capacity.base->reclaimablePages, pools.reclaimableCount(ResourceType::kBaseKvPage));
  EXPECT_EQ(capacity.base->leasedPages, leasedBasePages(runtime));
  EXPECT_DOUBLE_EQ(capacity.usage(), capacity.base->usage());
  ContextCacheMetrics const metrics = runtime.contextCache()->metrics();
  EXPECT_DOUBLE_EQ(metrics.baseUsage(), capacity.usage());
  if (WindowBlockCache const* window = runtime.windowBlockCache()) {
    ASSERT_TRUE(capacity.sliding.has_value());
    EXPECT_EQ(capacity.sliding->totalPages, window->totalPages());
    EXPECT_EQ(capacity.sliding->freePages, window->freePages());
    EXPECT_EQ(capacity.sliding->reclaimablePages, window->evictablePages());
    EXPECT_EQ(capacity.sliding->leasedPages, window->heldPages());
  } else {
    EXPECT_FALSE(capacity.sliding.has_value());
  }
}

TEST_P(CapacityQueryTest, AgreesWithThePageAccountingThroughARequest) {
  RuntimeRig rig(configFor(backend(), device()));
  expectCapacityAgrees(rig, "new runtime");
  EXPECT_DOUBLE_EQ(rig.runtime().capacity().usage(), 0.0);
  {
    FacadeDriver driver(rig);
    driver.add(tokenRun(40, 5));
    driver.add(tokenRun(33, 9));
    ASSERT_TRUE(driver.begin());
    expectCapacityAgrees(rig, "begin");
    ASSERT_TRUE(driver.prefill());
    expectCapacityAgrees(rig, "prefill");
    EXPECT_GT(rig.runtime().capacity().usage(), 0.0) << "two running rows hold pages";
    ASSERT_TRUE(driver.decode());
    expectCapacityAgrees(rig, "decode step");
    driver.verify();
    EXPECT_TRUE(driver.finish());
  }
  expectCapacityAgrees(rig, "finish");
  KVCacheCapacity const after = rig.runtime().capacity();
  EXPECT_DOUBLE_EQ(after.usage(), 0.0) << "nothing runs";
  if (reuse()) {
    EXPECT_GT(after.base->reclaimablePages, 0) << "the published prompts stay cached";
  }
}

TEST_P(CapacityQueryTest, EstimateAdmissionIsWhatBeginThenDoesAndChangesNothing) {
  RuntimeRig rig(configFor(backend(), device()));
  KVCacheRuntime& runtime = rig.runtime();
  std::vector<int32_t> const prompt = tokenRun(40, 5);
  if (!reuse()) {
    // Bounded SWA reuses nothing; a sequence reserves 2M + 1 = 7 sliding pages (W = 24, P = 16).
    AdmissionEstimate const estimate = runtime.estimateAdmission(prompt);
    EXPECT_EQ(estimate.promptTokens, 40);
    EXPECT_EQ(estimate.reusableTokens, 0);
    EXPECT_EQ(estimate.slidingPages, 7);
    EXPECT_TRUE(estimate.fitsWithoutEviction);
    return;
  }
  AdmissionEstimate const cold = runtime.estimateAdmission(prompt);
  EXPECT_EQ(cold.promptTokens, 40);
  EXPECT_EQ(cold.reusableTokens, 0);
  EXPECT_EQ(cold.demand.baseKvPages, 3) << "ceil((40 + 1 headroom) / 16)";
  EXPECT_EQ(cold.missReason, MissReason::kNoPrefix);
  EXPECT_TRUE(cold.fitsWithoutEviction);
  {
    FacadeDriver producer(rig);
    producer.add(prompt);
    ASSERT_TRUE(producer.begin());
    ASSERT_TRUE(producer.prefill());
    ASSERT_TRUE(producer.decode());
    EXPECT_TRUE(producer.finish());
  }
  BackendState const before = rig.observe();
  ContextCacheMetrics const metricsBefore = runtime.contextCache()->metrics();
  AdmissionEstimate const warm = runtime.estimateAdmission(prompt);
  rig.expectUnchanged(before);  // no pin, no lease, the records in the same recency order
  ContextCacheMetrics const metricsAfter = runtime.contextCache()->metrics();
  EXPECT_EQ(metricsAfter.lookups, metricsBefore.lookups) << "a dry run is not a lookup";
  EXPECT_EQ(metricsAfter.queriedTokens, metricsBefore.queriedTokens);
  EXPECT_EQ(warm.reusableTokens, 32) << "the producer published the prompt's two full blocks";
  EXPECT_EQ(warm.demand.baseKvPages, 3 - warm.reusableTokens / 16);
  EXPECT_EQ(warm.pinnedReclaimable.baseKvPages, warm.reusableTokens / 16)
      << "the reused pages are cached and unleased: admission pins them";
  EXPECT_TRUE(warm.fitsWithoutEviction);
  EXPECT_TRUE(warm.fitsAfterEviction);
  // Tenants do not share: another salt or adapter reuses nothing.
  EXPECT_EQ(runtime.estimateAdmission(prompt, "", "tenant-b").reusableTokens, 0);
  EXPECT_EQ(runtime.estimateAdmission(prompt, "adapter-a").reusableTokens, 0);

  // Admission then does what the estimate said: the same prefill start, the same new pages.
  int32_t const freeBefore = rig.freePages();
  FacadeDriver reader(rig);
  reader.add(prompt);
  ASSERT_TRUE(reader.begin());
  EXPECT_EQ(reader.rows.at(0).prefillStart, warm.reusableTokens);
  EXPECT_EQ(freeBefore - rig.freePages(), warm.demand.baseKvPages);
  ASSERT_TRUE(reader.prefill());
  reader.verify();
  EXPECT_TRUE(reader.finish());
}

/// The fit flags on the context-reuse runtime (64 pages, 16 a row), on each device.
class CapacityFitTest : public test::DeviceTest {};

INSTANTIATE_TEST_SUITE_P(Devices, CapacityFitTest, test::allDeviceTypes(), test::deviceName);

TEST_P(CapacityFitTest, TheFitFlagsFollowTheFreeAndReclaimablePages) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  KVCacheRuntime& runtime = rig.runtime();
  {  // Four distinct 240-token prompts published: 4 x 15 full blocks cached, nothing leased.
    FacadeDriver producer(rig);
    for (int32_t i = 0; i < 4; ++i) {
      producer.add(tokenRun(240, 1000 * (i + 1)));
    }
    ASSERT_TRUE(producer.begin());
    ASSERT_TRUE(producer.prefill());
    EXPECT_TRUE(producer.finish());
  }
  KVCacheCapacity const cached = runtime.capacity();
  ASSERT_EQ(cached.base->leasedPages, 0);
  ASSERT_EQ(cached.base->reclaimablePages, 60);
  ASSERT_EQ(cached.base->freePages, 4);
  // A new 250-token prompt needs ceil(251 / 16) = 16 pages: more than the 4 free, fewer than
  // free + reclaimable.
  std::vector<int32_t> const fresh = tokenRun(250, 9000);
  AdmissionEstimate const estimate = runtime.estimateAdmission(fresh);
  EXPECT_EQ(estimate.demand.baseKvPages, 16);
  EXPECT_FALSE(estimate.fitsWithoutEviction);
  EXPECT_TRUE(estimate.fitsAfterEviction);
  // Four running rows of 200 tokens lease 4 x 13 = 52 pages (admitting them evicts records):
  // then even evicting every record leaves 12 pages, too few for the prompt.
  FacadeDriver running(rig);
  for (int32_t i = 0; i < 4; ++i) {
    running.add(tokenRun(200, 50'000 + 1000 * i));
  }
  ASSERT_TRUE(running.begin());
  KVCacheCapacity const full = runtime.capacity();
  EXPECT_EQ(full.base->leasedPages, 4 * 13);
  AdmissionEstimate const blocked = runtime.estimateAdmission(fresh);
  EXPECT_FALSE(blocked.fitsWithoutEviction);
  EXPECT_FALSE(blocked.fitsAfterEviction) << "64 - 52 leased = 12 pages < 16";
  ASSERT_TRUE(running.prefill());
  EXPECT_TRUE(running.finish());
}

TEST_P(CapacityQueryTest, AnEmptyPromptOrNegativeHeadroomIsRefusedNamingTheCall) {
  RuntimeRig rig(configFor(backend(), device()));
  BackendState const before = rig.observe();
  EXPECT_TRUE(test::throwsError([&] { (void)rig.runtime().estimateAdmission({}); },
                                {"KVCacheRuntime::estimateAdmission", "the prompt is empty"}));
  EXPECT_TRUE(test::throwsError(
      [&] {
        (void)rig.runtime().estimateAdmission(tokenRun(8, 1), "", "", {-1, 0});
      },
      {"KVCacheRuntime::estimateAdmission", "baseExtraTokens must be > 0, got -1"}));
  if (reuse()) {  // the coordinator's own check, named under the runtime's call
    EXPECT_TRUE(test::throwsError(
        [&] { (void)rig.runtime().estimateAdmission(tokenRun(300, 1)); },
        {"KVCacheRuntime::estimateAdmission: ContextCacheCoordinator::estimateAdmission"}));
  }
  rig.expectUnchanged(before);
}

}  // namespace
}  // namespace mkv::runtime_test
