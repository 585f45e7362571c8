// Device writes that fail (docs/errors.md, "Device writes that fail"): the runtime's write queue
// consults the fault seam (KVCacheRuntimeConfig::faults, FaultSite::kDeviceWriteLaunch) before
// each launch of the backends' table rows and KV lengths, on host tensors too, so the host twin
// takes the failure path a failed GPU launch takes. On every backend and device (the kGPU instances
// skip without a CUDA device):
// * engine step: a failed KVCacheRuntime::flushDeviceWrites throws naming itself, the launcher
//   and the CUDA error, leaves the device copies as they were and keeps every write queued; the
//   next flush applies them all in one launch, and the request goes on to the same result;
// * each call: a lifecycle call whose write fails throws naming the facade call and the CUDA error,
//   after its host state changed; the writes stay queued (deviceWritesPending), the next flush
//   applies them, and the request can be ended and its row cleared on the device.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "device_write_support.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "runtime_test_rig.h"
#include "support/fault_arming.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv {
namespace {

using runtime_test::Backend;
using runtime_test::CallByCall;
using runtime_test::configFor;
using runtime_test::engineStepConfig;
using runtime_test::expectPrefillFlushed;
using runtime_test::expectPrefillWaiting;
using runtime_test::FacadeDriver;
using runtime_test::kVanilla;
using runtime_test::Rows;
using runtime_test::RuntimeCase;
using runtime_test::RuntimeCaseTest;
using runtime_test::RuntimeRig;
using runtime_test::tableRows;
using runtime_test::writeEngineLength;
using AdmitStatus = AdmitSequenceStatus;
using test::throwsError;
using test::tokenRun;

constexpr FaultSite kLaunch = FaultSite::kDeviceWriteLaunch;

class DeviceWriteFaultTest : public RuntimeCaseTest {
 protected:
  std::unique_ptr<KVCacheRuntime> makeRuntime(KVCacheRuntimeConfig config) {
    config.faults = mFaults.injector();
    return KVCacheRuntime::create(config);
  }

  test::FaultArming mFaults;  ///< armed at kLaunch
};

INSTANTIATE_TEST_SUITE_P(Backends, DeviceWriteFaultTest,
                         ::testing::ValuesIn(runtime_test::everyBackendCase()),
                         runtime_test::runtimeCaseName);

TEST_P(DeviceWriteFaultTest, AFailedFlushKeepsEveryWriteForTheNextOne) {
  auto runtime = makeRuntime(engineStepConfig(backend(), device()));
  Rows const idle = tableRows(*runtime);
  writeEngineLength(*runtime);
  CallByCall request(*runtime, tokenRun(40, 100));
  request.beginAndPreparePrefill();
  int64_t const launches = runtime->deviceWriteLaunches();

  mFaults.failNext(1, kLaunch);
  EXPECT_TRUE(throwsError(
      [&] { runtime->flushDeviceWrites(); },
      {"KVCacheRuntime::flushDeviceWrites", "InlinePatchBatch::flush", "cudaErrorUnknown"}));
  EXPECT_EQ(mFaults.pendingFailures(kLaunch), 0) << "the flush did not reach its launch";
  expectPrefillWaiting(*runtime, idle, launches);
  runtime->flushDeviceWrites();
  expectPrefillFlushed(*runtime, launches);
  request.completePrefillAndFinish();
  runtime->flushDeviceWrites();
  Rows const cleared = tableRows(*runtime);
  EXPECT_EQ(cleared.device, cleared.host);
  EXPECT_EQ(cleared.host, idle.host) << "finish left a row bound";
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(DeviceWriteFaultTest, ACallWhoseWriteFailsThrowsAndTheNextFlushDeliversIt) {
  auto runtime = makeRuntime(configFor(backend(), device()));
  Rows const idle = tableRows(*runtime);
  DecodingInferenceContext context;
  context.stream = runtime->config().stream;
  context.activeBatchSize = 1;
  context.finishReasons = {FinishReason::kNotFinished};
  context.rawBatchedInputIds = {tokenRun(40, 100)};
  context.generatedTokenIds = {{}};
  context.residentRefs = {runtime->residentSlots().acquire().value()};
  std::optional<ManagedKVCacheRequest> request = ManagedKVCacheRequest::begin(
      runtime->contextCache(), runtime->swaPageManager(), LLMGenerationRequest{}, context, false,
      kVanilla, DecodingTokenStateContract::kCommittedPlusLookahead,
      ContextCacheCommitPolicy::kIncludingGeneratedTokens);
  ASSERT_TRUE(request.has_value());
  context.effectivePrefillLengths = {40};
  int64_t const launches = runtime->deviceWriteLaunches();

  mFaults.failNext(1, kLaunch);
  EXPECT_TRUE(throwsError(
      [&] {
        (void)request->preparePrefill();
        (void)request->prepareSwaPrefill(context.effectivePrefillLengths);
      },
      // The facade call, then the library operation whose launch failed, then the CUDA error.
      {"ManagedKVCacheRequest::prepare", "Prefill: InlinePatchBatch::flush: cudaErrorUnknown"}));
  EXPECT_EQ(mFaults.pendingFailures(kLaunch), 0);
  EXPECT_EQ(runtime->deviceWriteLaunches(), launches);
  EXPECT_TRUE(runtime->deviceWritesPending()) << "the failed call dropped its writes";
  Rows const failed = tableRows(*runtime);
  EXPECT_NE(failed.host, idle.host) << "the call bound no page before its write failed";
  EXPECT_EQ(failed.device, idle.device);

  runtime->flushDeviceWrites();
  EXPECT_FALSE(runtime->deviceWritesPending());
  Rows const flushed = tableRows(*runtime);
  EXPECT_EQ(flushed.device, flushed.host) << "the next flush did not deliver the call's writes";

  EXPECT_TRUE(request->finish());
  request.reset();
  EXPECT_FALSE(runtime->deviceWritesPending());
  Rows const ended = tableRows(*runtime);
  EXPECT_EQ(ended.device, ended.host);
  EXPECT_EQ(ended.host, idle.host) << "the ended request left a row bound";
  EXPECT_TRUE(runtime->residentSlots().release(context.residentRefs[0]));
  EXPECT_TRUE(runtime->shutdown());
}

/// The backends with in-flight admission, on every device.
std::vector<RuntimeCase> joiningCases() {
  std::vector<RuntimeCase> cases;
  for (RuntimeCase const& c : runtime_test::everyBackendCase()) {
    if (c.backend != Backend::kBoundedSwa) {
      cases.push_back(c);
    }
  }
  return cases;
}

class RetractionFaultTest : public RuntimeCaseTest {};

INSTANTIATE_TEST_SUITE_P(Backends, RetractionFaultTest, ::testing::ValuesIn(joiningCases()),
                         runtime_test::runtimeCaseName);

// docs/errors.md, ContextCacheCoordinator: a retraction whose row clear fails on the device
// returns false and poisons; the clear stays queued for the next flush, the request's finish
// quarantines it, and shutdown frees everything.
TEST_P(RetractionFaultTest, ARetractionWhoseRowClearFailsPoisonsAndShutdownClearsTheRow) {
  RuntimeRig rig(configFor(backend(), device()));
  test::FaultArming& faults = rig.faults();  // the rig's injector: its launches too
  {
    FacadeDriver driver(rig);
    driver.add(tokenRun(41, 10));
    ASSERT_TRUE(driver.begin());
    ASSERT_TRUE(driver.prefill());
    ASSERT_EQ(driver.admit(tokenRun(37, 400)), AdmitStatus::kAdmitted);
    CacheSlot const slot = driver.rows[1].resident.slot;
    KVPageTable const& table = *rig.runtime().fullPageTable();
    int32_t const width = table.maxPagesPerSeq();

    faults.failNext(1, kLaunch);
    EXPECT_FALSE(driver.facade().retractSequenceAdmission());
    EXPECT_EQ(faults.pendingFailures(kLaunch), 0) << "the retraction launched nothing";
    EXPECT_TRUE(rig.poisoned());
    EXPECT_EQ(driver.facade().lastFailure(), (RowFailure{RowFailureReason::kPoisoned, -1}));
    ASSERT_NE(driver.facade().prefillStarts(), nullptr);
    EXPECT_EQ(driver.facade().prefillStarts()->size(), 1u)
        << "the joiner was undone: the request's rows follow the backend's";
    EXPECT_EQ(table.liveEntryCount(slot), 0) << "the host row is cleared";
    // The clear stays queued (the composed backend's sliding half already retries it in the
    // same call): the next flush takes it to the device.
    rig.runtime().flushDeviceWrites();
    std::vector<int32_t> const device = test::readAs<int32_t>(table.deviceTable());
    EXPECT_EQ(device[static_cast<std::size_t>(slot * 2 * width)], kNoPage)
        << "the retracted row is still mapped on the device";
    EXPECT_FALSE(driver.finish()) << "a poisoned backend's finish quarantines the request";
  }
  EXPECT_TRUE(rig.runtime().shutdown());
  EXPECT_FALSE(rig.runtime().deviceWritesPending());
  rig.expectIdle();
  Rows const rows = tableRows(rig.runtime());
  EXPECT_EQ(rows.device, rows.host);
}

}  // namespace
}  // namespace mkv
