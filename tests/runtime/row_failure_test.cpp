// ManagedKVCacheRequest::lastFailure(): after a call answered false, which row could not get its
// next pages and why (no capacity, table full, poisoned), so that a scheduler can tell "preempt
// and retry" from "cap this sequence" from "drain the backend" (docs/errors.md, "How errors
// surface"). Every test runs on host and GPU tensors (kGPU skips without a device).
#include <gtest/gtest.h>

#include <cstdint>
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
  EXPECT_TRUE(driver.finish());
  EXPECT_EQ(driver.facade().lastFailure(), RowFailure{}) << "a finished request holds no failure";
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
