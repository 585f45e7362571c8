// ManagedKVCacheRequest::lastFailure(): after a call answered false, which row could not get its
// next pages and why (no capacity, table full, poisoned), so that a scheduler can tell "preempt
// and retry" from "cap this sequence" from "drain the backend" (docs/errors.md, "How errors
// surface"). Every test runs on host and GPU tensors (kGPU skips without a device).
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/managed_kv_cache_request.h"
#include "runtime_test_rig.h"
#include "support/test_util.h"

namespace mkv::runtime_test {
namespace {

class RowFailureTest : public RuntimeCaseTest {};

INSTANTIATE_TEST_SUITE_P(Backends, RowFailureTest, ::testing::ValuesIn(everyBackendCase()),
                         runtimeCaseName);

/// Decode steps until one fails; the number of steps that succeeded.
int32_t decodeUntilAStepFails(FacadeDriver& driver, int32_t limit) {
  int32_t steps = 0;
  while (steps < limit && driver.decode()) {
    ++steps;
  }
  return steps;
}

TEST_P(RowFailureTest, ARowReachingItsTableWidthIsNamedAsTableFull) {
  // Rows of 16 pages of 16 tokens (256 tokens); row 1 starts 6 tokens short of the width.
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(20, 5));
  driver.add(tokenRun(250, 900));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  EXPECT_EQ(driver.facade().lastFailure(), RowFailure{}) << "nothing failed yet";
  int32_t const steps = decodeUntilAStepFails(driver, 20);
  ASSERT_LT(steps, 20) << "row 1 never reached its table width";
  EXPECT_EQ(driver.facade().lastFailure(), (RowFailure{RowFailureReason::kTableFull, 1}))
      << "after " << steps << " steps: " << toString(driver.facade().lastFailure().reason);
  EXPECT_FALSE(rig.poisoned());
  // The row fails alone: the engine caps it (finished at its length) and compacts it away, and
  // row 0 goes on (before, the request was finishing and the compaction threw).
  std::vector<int32_t> const generatedBefore = driver.generated(0);
  driver.finishRow(1);
  ASSERT_TRUE(driver.compact({0, -1}));
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(driver.decode()) << "step " << step << " after the compaction";
  }
  EXPECT_EQ(driver.generated(0).size(), generatedBefore.size() + 3);
  driver.verify();
  EXPECT_TRUE(driver.finish());
  EXPECT_EQ(driver.facade().lastFailure(), RowFailure{}) << "a finished request holds no failure";
}

TEST_P(RowFailureTest, AnEngineMayStillFinishTheRequestAfterARowFailed) {
  // The seed's loop: a step that answers false ends the request.
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(250, 900));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_LT(decodeUntilAStepFails(driver, 20), 20) << "the row never reached its table width";
  EXPECT_EQ(driver.facade().lastFailure(), (RowFailure{RowFailureReason::kTableFull, 0}));
  EXPECT_TRUE(driver.finish());
  EXPECT_EQ(rig.heldPages(), 0);
}

/// Leased pages of the base and sliding pools (0 for a pool the deployment lacks).
std::pair<int32_t, int32_t> leasedPages(RuntimeRig& rig) {
  KVCacheCapacity const capacity = rig.runtime().capacity();
  return {capacity.base ? capacity.base->leasedPages : 0,
          capacity.sliding ? capacity.sliding->leasedPages : 0};
}

TEST_P(RowFailureTest, TheDecodeStepDemandIsWhatTheStepTakes) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(20, 5));
  driver.add(tokenRun(215, 900));  // reaches the 256-token row width after 41 tokens
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  int32_t grownBase = 0;
  int32_t grownSliding = 0;
  for (int step = 0;; ++step) {
    ASSERT_LT(step, 64) << "row 1 never reached its table width";
    BackendState const before = rig.observe();
    DecodeStepDemand const demand = driver.facade().decodeStepDemand(kVanilla);
    rig.expectUnchanged(before);
    EXPECT_EQ(driver.facade().decodeStepDemand(kVanilla), demand) << "asked twice";
    auto const [baseBefore, slidingBefore] = leasedPages(rig);
    if (!driver.prepareDecode()) {
      EXPECT_EQ(demand.tableFull, (RowFailure{RowFailureReason::kTableFull, 1})) << "step " << step;
      EXPECT_EQ(driver.facade().lastFailure(), demand.tableFull);
      break;
    }
    EXPECT_EQ(demand.tableFull, RowFailure{}) << "step " << step;
    auto const [baseAfter, slidingAfter] = leasedPages(rig);
    EXPECT_EQ(baseAfter - baseBefore, demand.basePages) << "step " << step;
    EXPECT_EQ(slidingAfter - slidingBefore, demand.slidingPages) << "step " << step;
    EXPECT_EQ(demand.draftPages, 0);
    grownBase += demand.basePages;
    grownSliding += demand.slidingPages;
    ASSERT_TRUE(driver.completeDecode());
  }
  // Engagement: the steps grew base pages where the backend has a base pool. Sliding rows here
  // always have a spare (the page leaving the window), so they take nothing from the sliding
  // page source; SlidingReuseFacadeTest.ADecodeStepTheSlidingHalfRefusesLeavesARequestThatGoesOn
  // checks a demand on it.
  EXPECT_EQ(grownBase > 0, !rig.boundedSwa());
  EXPECT_EQ(grownSliding, 0);
  // The query throws where prepareDecodeStep throws, naming the facade's call.
  EXPECT_TRUE(test::throwsError(
      [&] {
        (void)driver.facade().decodeStepDemand(DecodingKvHeadroom{0, 0});
      },
      {"ManagedKVCacheRequest::decodeStepDemand"}));
  EXPECT_FALSE(driver.prepareDecode()) << "the full row fails the step again";
  driver.verify();
  EXPECT_TRUE(driver.finish());
}

/// The context-reuse runtime with a pool of 20 pages, on each device.
class RowFailureCapacityTest : public test::DeviceTest {};

INSTANTIATE_TEST_SUITE_P(Devices, RowFailureCapacityTest, test::allDeviceTypes(), test::deviceName);

TEST_P(RowFailureCapacityTest, ARowThePoolCannotGrowIsNamedAsNoCapacity) {
  KVCacheRuntimeConfig config = configFor(Backend::kContextReuse, device());
  config.numPages = 20;
  RuntimeRig rig(config);
  FacadeDriver driver(rig);
  // Two 150-token rows take ceil(151 / 16) = 10 pages each: the whole pool, and the cached
  // prompt blocks are those very (leased) pages, so eviction frees nothing. At 160 committed
  // tokens row 0 needs an 11th page first.
  driver.add(tokenRun(150, 5));
  driver.add(tokenRun(150, 900));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_EQ(rig.runtime().capacity().base->freePages, 0);
  int32_t const steps = decodeUntilAStepFails(driver, 40);
  ASSERT_LT(steps, 40) << "the pool never ran out";
  EXPECT_EQ(driver.facade().lastFailure(), (RowFailure{RowFailureReason::kNoCapacity, 0}))
      << "after " << steps << " steps: " << toString(driver.facade().lastFailure().reason);
  EXPECT_EQ(rig.runtime().contextCache()->counters().growthFailures, 1u);
  EXPECT_FALSE(rig.poisoned());
  // The request goes on: preparing the step again fails the same way and changes nothing.
  BackendState const before = rig.observe();
  EXPECT_FALSE(driver.prepareDecode());
  rig.expectUnchanged(before);
  EXPECT_EQ(driver.facade().lastFailure(), (RowFailure{RowFailureReason::kNoCapacity, 0}));
  // vLLM's answer: preempt the newest row (what it published stays cached, reclaimable),
  // compact it away, and the step goes through for row 0, on pages evicted from the preempted
  // row's blocks (the only ones no lease pins).
  ASSERT_TRUE(driver.facade().preemptSequence(1));
  ASSERT_TRUE(driver.compact({0, -1}));
  for (int step = 0; step < 10; ++step) {
    ASSERT_TRUE(driver.decode()) << "step " << step << " after the preemption";
  }
  driver.verify();
  EXPECT_EQ(rig.runtime().contextCache()->counters().preemptions, 1u);
  EXPECT_TRUE(driver.finish());
}

TEST(RowFailureReasonTest, EveryReasonHasAName) {
  EXPECT_EQ(toString(RowFailureReason::kNone), "none");
  EXPECT_EQ(toString(RowFailureReason::kNoCapacity), "no-capacity");
  EXPECT_EQ(toString(RowFailureReason::kTableFull), "table-full");
  EXPECT_EQ(toString(RowFailureReason::kPoisoned), "poisoned");
}

}  // namespace
}  // namespace mkv::runtime_test
