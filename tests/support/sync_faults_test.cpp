/// SyncFaults: the counting and arming every fault-injection verdict of the suites relies on.

#include "support/sync_faults.h"

#include <gtest/gtest.h>

#include <stdexcept>

namespace mkv::test {
namespace {

TEST(SyncFaultsTest, FailNextFailsTheNextCallsThenSucceeds) {
  SyncFaults faults;
  StreamSynchronizer const sync = faults.synchronizer();
  faults.failNext(2);
  EXPECT_EQ(faults.pendingFailures(), 2);
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(sync(nullptr), cudaSuccess);
  EXPECT_EQ(faults.calls(), 3);
  EXPECT_EQ(faults.failures(), 2);
  EXPECT_EQ(faults.pendingFailures(), 0);
}

TEST(SyncFaultsTest, FailCallCountsFromConstructionOnceOrFromThenOn) {
  SyncFaults once;
  StreamSynchronizer const a = once.synchronizer();
  once.failCall(2);
  EXPECT_EQ(a(nullptr), cudaSuccess);
  EXPECT_EQ(a(nullptr), cudaErrorUnknown);
  EXPECT_EQ(a(nullptr), cudaSuccess);

  SyncFaults persistent;
  StreamSynchronizer const b = persistent.synchronizer();
  persistent.failCall(2, /*fromThenOn=*/true);
  EXPECT_EQ(b(nullptr), cudaSuccess);
  EXPECT_EQ(b(nullptr), cudaErrorUnknown);
  EXPECT_EQ(b(nullptr), cudaErrorUnknown);
  EXPECT_EQ(persistent.failures(), 2);
  EXPECT_EQ(persistent.disarm(), 0) << "failCall is not a pending failNext / throwNext";
  EXPECT_EQ(b(nullptr), cudaSuccess);
}

TEST(SyncFaultsTest, ThrowsAreCountedApartFromFailures) {
  SyncFaults faults;
  StreamSynchronizer const sync = faults.synchronizer();
  faults.throwNext();
  faults.failNext();
  EXPECT_THROW(sync(nullptr), std::runtime_error);
  EXPECT_EQ(faults.throws(), 1);
  EXPECT_EQ(faults.failures(), 0);
  EXPECT_EQ(faults.pendingFailures(), 1) << "a throwing call consumes no failNext";
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(faults.calls(), 2);
}

TEST(SyncFaultsTest, DisarmReportsWhatWasStillArmed) {
  SyncFaults faults;
  faults.failNext(3);
  faults.throwNext();
  EXPECT_EQ(faults.disarm(), 4);
  EXPECT_EQ(faults.synchronizer()(nullptr), cudaSuccess);
  EXPECT_EQ(faults.disarm(), 0);
}

TEST(SyncFaultsTest, CopiesShareOneStateAndTheWaitRunsFirst) {
  SyncFaults faults;
  int32_t waits = 0;
  StreamSynchronizer const sync = faults.synchronizer([&waits](cudaStream_t) {
    ++waits;
    return cudaErrorNoDevice;
  });
  SyncFaults copy = faults;
  EXPECT_EQ(sync(nullptr), cudaErrorNoDevice) << "the wait's status when nothing is armed";
  copy.failNext();
  EXPECT_EQ(sync(nullptr), cudaErrorUnknown);
  EXPECT_EQ(waits, 2);
  EXPECT_EQ(faults.calls(), 2);
}

}  // namespace
}  // namespace mkv::test
