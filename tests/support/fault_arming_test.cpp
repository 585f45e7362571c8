/// FaultArming: the counting and arming every fault-injection verdict of the suites relies on, and
/// how a synchronisation consults the injector (detail::withSyncFaults).

#include "support/fault_arming.h"

#include <gtest/gtest.h>

#include "core/faults.h"

#include <stdexcept>

namespace mkv::test {
namespace {

/// A host synchroniser (nothing to wait for) with `faults`' injector, as a backend builds it.
StreamSynchronizer hostSync(FaultArming const& faults) {
  return detail::withSyncFaults([](cudaStream_t) { return cudaSuccess; }, faults.injector());
}

TEST(FaultArmingTest, FailNextFailsTheNextCallsThenSucceeds) {
  FaultArming faults;
  StreamSynchronizer const sync = hostSync(faults);
  faults.failNext(2);
  EXPECT_EQ(faults.pendingFailures(), 2);
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(sync(nullptr), cudaSuccess);
  EXPECT_EQ(faults.calls(), 3);
  EXPECT_EQ(faults.failures(), 2);
  EXPECT_EQ(faults.pendingFailures(), 0);
}

TEST(FaultArmingTest, FailCallCountsFromConstructionOnceOrFromThenOn) {
  FaultArming once;
  StreamSynchronizer const a = hostSync(once);
  once.failCall(2);
  EXPECT_EQ(a(nullptr), cudaSuccess);
  EXPECT_EQ(a(nullptr), cudaErrorUnknown);
  EXPECT_EQ(a(nullptr), cudaSuccess);

  FaultArming persistent;
  StreamSynchronizer const b = hostSync(persistent);
  persistent.failCall(2, /*fromThenOn=*/true);
  EXPECT_EQ(b(nullptr), cudaSuccess);
  EXPECT_EQ(b(nullptr), cudaErrorUnknown);
  EXPECT_EQ(b(nullptr), cudaErrorUnknown);
  EXPECT_EQ(persistent.failures(), 2);
  EXPECT_EQ(persistent.disarm(), 0) << "failCall is not a pending failNext / throwNext";
  EXPECT_EQ(b(nullptr), cudaSuccess);
}

TEST(FaultArmingTest, ThrowsAreCountedApartFromFailures) {
  FaultArming faults;
  StreamSynchronizer const sync = hostSync(faults);
  faults.throwNext();
  faults.failNext();
  EXPECT_THROW(sync(nullptr), std::runtime_error);
  EXPECT_EQ(faults.throws(), 1);
  EXPECT_EQ(faults.failures(), 0);
  EXPECT_EQ(faults.pendingFailures(), 1) << "a throwing call consumes no failNext";
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(faults.calls(), 2);
}

TEST(FaultArmingTest, DisarmReportsWhatWasStillArmed) {
  FaultArming faults;
  faults.failNext(3);
  faults.throwNext();
  EXPECT_EQ(faults.disarm(), 4);
  EXPECT_EQ(hostSync(faults)(nullptr), cudaSuccess);
  EXPECT_EQ(faults.disarm(), 0);
}

TEST(FaultArmingTest, CopiesShareOneStateAndTheWaitRunsFirst) {
  FaultArming faults;
  int32_t waits = 0;
  int64_t callsSeenByWait = -1;
  StreamSynchronizer const sync = detail::withSyncFaults(
      [&](cudaStream_t) {
        ++waits;
        callsSeenByWait = faults.calls();
        return waits == 1 ? cudaErrorNoDevice : cudaSuccess;
      },
      faults.injector());
  FaultArming copy = faults;
  EXPECT_EQ(sync(nullptr), cudaErrorNoDevice) << "a real failure is reported as it is";
  EXPECT_EQ(callsSeenByWait, 0) << "the wait runs before the injector is consulted";
  copy.failNext();
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(waits, 2);
  EXPECT_EQ(faults.calls(), 2) << "consulted after a failed wait too";
}

TEST(FaultArmingTest, EachSiteIsArmedAndCountedApart) {
  FaultArming faults;
  FaultInjector const inject = faults.injector();
  faults.failNext(1, FaultSite::kPublication);
  faults.throwNext(FaultSite::kHostTierOrder);
  EXPECT_EQ(inject(FaultSite::kStreamSynchronize), cudaSuccess);
  EXPECT_EQ(inject(FaultSite::kPublication), cudaErrorUnknown);
  EXPECT_EQ(inject(FaultSite::kPublication), cudaSuccess);
  EXPECT_THROW(inject(FaultSite::kHostTierOrder), std::runtime_error);
  EXPECT_EQ(faults.calls(), 1);
  EXPECT_EQ(faults.failures(), 0);
  EXPECT_EQ(faults.calls(FaultSite::kPublication), 2);
  EXPECT_EQ(faults.failures(FaultSite::kPublication), 1);
  EXPECT_EQ(faults.throws(FaultSite::kHostTierOrder), 1);
  EXPECT_EQ(faults.calls(FaultSite::kSnapshotCapture), 0);
}

TEST(FaultArmingTest, WithoutSiteLeavesOneSiteOut) {
  FaultArming faults;
  faults.failNext(2);
  faults.failNext(1, FaultSite::kDeviceWriteLaunch);
  FaultInjector const halves =
      detail::withoutSite(faults.injector(), FaultSite::kStreamSynchronize);
  EXPECT_EQ(halves(FaultSite::kStreamSynchronize), cudaSuccess);
  EXPECT_EQ(faults.calls(), 0) << "the left-out site is not consulted";
  EXPECT_EQ(halves(FaultSite::kDeviceWriteLaunch), cudaErrorUnknown);
  EXPECT_FALSE(detail::withoutSite({}, FaultSite::kStreamSynchronize)) << "empty stays empty";
}

}  // namespace
}  // namespace mkv::test
