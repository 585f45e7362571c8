/// BoundedSwaKVPageManager under the fault model (docs/errors.md, "Poison and quarantine"): every
/// synchronisation point (finish, compaction, abandonment, shutdown) with injected failures. A
/// failure poisons the manager and quarantines the request's pages until shutdown() drains them.

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "swa/swa_test_rig.h"

namespace mkv::swa_test {
namespace {

class BoundedSwaFaultTest : public DeviceTest {
 protected:
  /// A request of two sequences with a completed prefill and one staged decode step.
  Handle decodingRequest(SwaRig& rig, std::vector<int32_t> const& slots) {
    Handle handle = admit(rig, slots);
    std::vector<int32_t> const lengths(slots.size(), 300);
    rig.manager().preparePrefill(handle, lengths);
    rig.manager().completePrefill(handle);
    EXPECT_EQ(rig.manager().prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    return handle;
  }

  /// Poisoned, `quarantined` pages withheld from the free list, admission refused.
  static void expectQuarantined(SwaRig& rig, int32_t quarantined) {
    BoundedSwaKVPageManager& manager = rig.manager();
    EXPECT_TRUE(manager.poisoned());
    EXPECT_EQ(manager.quarantinedPageCount(), quarantined);
    int32_t const freeBefore = manager.freePageCount();
    int64_t const syncsBefore = rig.faults().calls();
    auto const refused = manager.beginRequest(residentsFor({2}), SwaRig::stream());
    EXPECT_EQ(refused.status, SwaKVCacheStatus::kPoisoned);
    EXPECT_FALSE(refused.request.has_value());
    EXPECT_EQ(manager.freePageCount(), freeBefore);
    EXPECT_EQ(rig.faults().calls(), syncsBefore);
  }

  /// shutdown() drains the quarantine and clears the poison; then every page is free.
  static void expectShutdownRecovers(SwaRig& rig) {
    BoundedSwaKVPageManager& manager = rig.manager();
    int64_t const syncsBefore = rig.faults().calls();
    EXPECT_EQ(manager.shutdown(), SwaKVCacheStatus::kOk);
    EXPECT_EQ(rig.faults().calls(), syncsBefore + 1);
    EXPECT_FALSE(manager.poisoned());
    EXPECT_EQ(manager.quarantinedPageCount(), 0);
    EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
    for (CacheSlot slot = 0; slot < rig.table().maxBatch(); ++slot) {
      EXPECT_EQ(hostRow(rig.table(), slot), emptyRow(rig.table()));
      EXPECT_EQ(deviceRow(rig.table(), slot), emptyRow(rig.table()));
    }
    // Admission works again, with the quarantined residents too.
    Handle again = admit(rig, {0, 1});
    EXPECT_TRUE(again.valid());
    EXPECT_EQ(manager.finish(again), SwaKVCacheStatus::kOk);
    EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
  }
};

TEST_P(BoundedSwaFaultTest, FailedFinishSynchronisationQuarantinesUntilShutdown) {
  SwaRig rig(rigConfig());  // 21 pages, M + 1 = 4
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = decodingRequest(rig, {0, 1});
  int32_t const held = heldPages(manager, {&handle});
  ASSERT_EQ(held, 8);
  std::vector<int32_t> const row0 = hostRow(rig.table(), 0);
  rig.faults().failNext();
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kPoisoned);
  EXPECT_EQ(rig.faults().failures(), 1);
  EXPECT_FALSE(handle.valid());
  EXPECT_EQ(handle.id(), 0u);
  EXPECT_EQ(manager.activeRequestCount(), 0);
  EXPECT_EQ(manager.freePageCount(), 21 - held);
  // The rows stay mapped: kernels may still read them.
  EXPECT_EQ(hostRow(rig.table(), 0), row0);
  expectPagesAccountedFor(manager, {});
  expectQuarantined(rig, held);
  // The quarantined residents stay unavailable; a poisoned manager says so by status.
  auto const again = manager.beginRequest(residentsFor({0}), SwaRig::stream());
  EXPECT_EQ(again.status, SwaKVCacheStatus::kPoisoned);
  expectShutdownRecovers(rig);
}

TEST_P(BoundedSwaFaultTest, FailedCompactionSynchronisationQuarantinesTheWholeRequest) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = decodingRequest(rig, {0, 1, 2});
  manager.completeDecodeStep(handle);
  int32_t const held = heldPages(manager, {&handle});
  ASSERT_EQ(held, 12);
  manager.beginBatchCompaction(handle, std::vector<int32_t>{0, -1, 1}, 2, rig.mapping());
  rig.faults().failNext();
  EXPECT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kPoisoned);
  EXPECT_FALSE(handle.valid());
  EXPECT_EQ(handle.id(), 0u) << "an invalidated handle keeps no request id";
  EXPECT_EQ(manager.activeRequestCount(), 0);
  // The dropped sequence's pages are withheld as well as the survivors'.
  EXPECT_EQ(manager.freePageCount(), 21 - held);
  expectPagesAccountedFor(manager, {});
  expectContractError([&] { (void)manager.prepareDecodeStep(handle); },
                      {"prepareDecodeStep", "invalid"});
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kPoisoned);  // invalid handle, poisoned
  expectQuarantined(rig, held);
  expectShutdownRecovers(rig);
}

TEST_P(BoundedSwaFaultTest, FailedAbandonmentSynchronisationQuarantinesUntilShutdown) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  int32_t held = 0;
  {
    Handle handle = decodingRequest(rig, {0, 1});
    held = heldPages(manager, {&handle});
    rig.faults().failNext();
  }  // dropped with a staged decode step
  EXPECT_EQ(rig.faults().failures(), 1);
  EXPECT_EQ(held, 8);
  EXPECT_EQ(manager.activeRequestCount(), 0);
  EXPECT_EQ(manager.freePageCount(), 21 - held);
  expectPagesAccountedFor(manager, {});
  expectQuarantined(rig, held);
  expectShutdownRecovers(rig);
}

// The shared registry's abandonment (src/resources/request_registry.h): replacing a live handle
// abandons its request; a failed synchronisation quarantines it (counted as a request, its rows
// still mapped), the handle is reset, and shutdown() recovers every page.
TEST_P(BoundedSwaFaultTest, ReplacingAHandleWhoseSynchronisationFailsQuarantinesAndResetsIt) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = decodingRequest(rig, {0, 1});
  int32_t const held = heldPages(manager, {&handle});
  std::vector<int32_t> const row1 = hostRow(rig.table(), 1);
  rig.faults().failNext();
  handle = Handle{};
  EXPECT_EQ(rig.faults().failures(), 1);
  EXPECT_FALSE(handle.valid());
  EXPECT_EQ(handle.id(), 0u);
  EXPECT_EQ(manager.activeRequestCount(), 0);
  EXPECT_EQ(manager.quarantinedRequestCount(), 1);
  EXPECT_EQ(manager.residentRowState(0), ResidentRowState::kQuarantined);
  EXPECT_EQ(manager.residentRowState(1), ResidentRowState::kQuarantined);
  EXPECT_EQ(hostRow(rig.table(), 1), row1) << "kernels may still read the rows";
  expectPagesAccountedFor(manager, {});
  expectQuarantined(rig, held);
  expectShutdownRecovers(rig);
  EXPECT_EQ(manager.quarantinedRequestCount(), 0);
  EXPECT_EQ(manager.residentRowState(0), ResidentRowState::kFree);
}

TEST_P(BoundedSwaFaultTest, FailedPrefillAbandonmentQuarantinesTheAdmissionBudget) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  {
    Handle handle = admit(rig, {1});
    manager.preparePrefill(handle, std::vector<int32_t>{1000});
    rig.faults().failNext();
  }
  EXPECT_EQ(manager.freePageCount(), 21 - 7);
  expectPagesAccountedFor(manager, {});
  expectQuarantined(rig, 7);
  expectShutdownRecovers(rig);
}

TEST_P(BoundedSwaFaultTest, FailingShutdownKeepsTheQuarantine) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  {
    Handle handle = decodingRequest(rig, {0});
    rig.faults().failNext();
  }
  ASSERT_EQ(manager.quarantinedPageCount(), 4);
  rig.faults().failNext();
  EXPECT_EQ(manager.shutdown(), SwaKVCacheStatus::kPoisoned);
  EXPECT_TRUE(manager.poisoned());
  EXPECT_EQ(manager.quarantinedPageCount(), 4);
  EXPECT_EQ(manager.freePageCount(), 17);
  expectPagesAccountedFor(manager, {});
  // A throwing synchronizer is a failure too.
  rig.faults().throwNext();
  EXPECT_EQ(manager.shutdown(), SwaKVCacheStatus::kPoisoned);
  EXPECT_EQ(manager.quarantinedPageCount(), 4);
  expectQuarantined(rig, 4);
  expectShutdownRecovers(rig);
}

TEST_P(BoundedSwaFaultTest, ThrowingSynchronizerAtFinishQuarantines) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = decodingRequest(rig, {0, 2});
  rig.faults().throwNext();
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kPoisoned);
  expectQuarantined(rig, 8);
  expectShutdownRecovers(rig);
}

TEST_P(BoundedSwaFaultTest, SynchronisesOnlyWhenDeviceWorkIsPending) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = decodingRequest(rig, {0});
  manager.completeDecodeStep(handle);
  rig.faults().failNext();  // would poison if finish synchronised
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(rig.faults().calls(), 0);
  EXPECT_FALSE(manager.poisoned());
  EXPECT_EQ(manager.freePageCount(), 21);
  EXPECT_EQ(rig.faults().disarm(), 1);
  // No quarantine: shutdown makes no synchronisation and reports kOk.
  EXPECT_EQ(manager.shutdown(), SwaKVCacheStatus::kOk);
  EXPECT_EQ(rig.faults().calls(), 0);
}

TEST_P(BoundedSwaFaultTest, PoisonLeavesOtherActiveRequestsWorking) {
  RigConfig config = rigConfig();
  config.withLengthPools = false;  // two concurrent batches cannot share one length tensor
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle survivor = decodingRequest(rig, {2});
  manager.completeDecodeStep(survivor);
  {
    Handle failing = decodingRequest(rig, {0, 1});
    rig.faults().failNext();
    EXPECT_EQ(manager.finish(failing), SwaKVCacheStatus::kPoisoned);
  }
  EXPECT_EQ(manager.quarantinedPageCount(), 8);
  expectPagesAccountedFor(manager, {&survivor});
  // The survivor keeps decoding on its own pages while the manager is poisoned.
  for (int32_t step = 0; step < 2 * rig.config().pageSize; ++step) {
    ASSERT_EQ(manager.prepareDecodeStep(survivor), SwaKVCacheStatus::kOk);
    manager.completeDecodeStep(survivor);
    expectPagesAccountedFor(manager, {&survivor});
  }
  // shutdown drains the quarantine but reports the still-active request.
  EXPECT_EQ(manager.shutdown(), SwaKVCacheStatus::kRequestFailed);
  EXPECT_FALSE(manager.poisoned());
  EXPECT_EQ(manager.quarantinedPageCount(), 0);
  EXPECT_EQ(manager.freePageCount(), 21 - 4);
  // finish of a request on a healthy manager is kOk again.
  EXPECT_EQ(manager.finish(survivor), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 21);
  EXPECT_EQ(manager.shutdown(), SwaKVCacheStatus::kOk);
}

TEST_P(BoundedSwaFaultTest, FinishOnAPoisonedManagerReleasesACompletedRequest) {
  RigConfig config = rigConfig();
  config.withLengthPools = false;
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle completed = decodingRequest(rig, {2});
  manager.completeDecodeStep(completed);
  {
    Handle failing = decodingRequest(rig, {0});
    rig.faults().failNext();
  }
  ASSERT_TRUE(manager.poisoned());
  // No device work is pending for `completed`: its pages may return, but the status reports
  // the poisoned manager.
  EXPECT_EQ(manager.finish(completed), SwaKVCacheStatus::kPoisoned);
  EXPECT_EQ(manager.freePageCount(), 21 - 4);
  expectQuarantined(rig, 4);
  expectShutdownRecovers(rig);
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaFaultTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

}  // namespace
}  // namespace mkv::swa_test
