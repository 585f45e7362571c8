// DeviceWriteTiming::kEngineStep (docs/architecture.md, "Device writes at the engine step"): the
// page-table rows and KV lengths of the lifecycle calls wait on the host until the engine's
// KVCacheRuntime::flushDeviceWrites. Two kinds of proof, on host tensors and on GPU tensors (the
// kGPU instances skip without a CUDA device):
// * call by call: a request's calls launch nothing and leave the device copies as they were; one
//   flush makes them equal to the host rows and lengths in one launch; a row cleared and bound
//   again before a flush reaches the device with its last value;
// * end to end: one workload per deployment (reuse with hits, compaction and joiners, bounded SWA,
//   sliding-window reuse, EAGLE-style speculative decoding, hybrid checkpoints, a host tier) run by
//   the reference engine with the oracle checking every position attention reads, once per
//   timing: the same outcomes and figures, no mismatch, no more launches at the engine step;
// * the fault seam: the same workloads consult every site of kFaultSites (FaultSiteTest).
#include <gtest/gtest.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "device_write_support.h"
#include "mkv/host_kv_tier.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/reference_engine.h"
#include "runtime_test_rig.h"
#include "support/fault_arming.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv {
namespace {

using runtime_test::Backend;
using runtime_test::BackendState;
using runtime_test::CallByCall;
using runtime_test::configFor;
using runtime_test::deviceLengths;
using runtime_test::engineStepConfig;
using runtime_test::expectPrefillFlushed;
using runtime_test::expectPrefillWaiting;
using runtime_test::FacadeDriver;
using runtime_test::kVanilla;
using runtime_test::Rows;
using runtime_test::RuntimeCase;
using runtime_test::RuntimeCaseTest;
using runtime_test::RuntimeRig;
using runtime_test::startEngineStep;
using runtime_test::tableRows;
using test::concatenated;
using test::throwsError;
using test::tokenRun;
using testing::EngineRequest;
using testing::EngineSequence;
using testing::EngineStats;
using testing::ReferenceEngine;
using testing::RequestOutcome;

// ---------------------------------------------------------------- call by call

class DeviceWriteTimingTest : public RuntimeCaseTest {};

INSTANTIATE_TEST_SUITE_P(Backends, DeviceWriteTimingTest,
                         ::testing::ValuesIn(runtime_test::everyBackendCase()),
                         runtime_test::runtimeCaseName);

TEST_P(DeviceWriteTimingTest, ARequestsCallsLaunchNothingAndOneFlushAppliesThemAll) {
  // A length the engine wrote before: the prefill's reset (to 0) must not reach it before the
  // flush.
  auto [runtime, idle, launches] = startEngineStep(backend(), device());
  {
    CallByCall request(*runtime, tokenRun(40, 100));
    request.beginAndPreparePrefill();
    expectPrefillWaiting(*runtime, idle, launches);
    runtime->flushDeviceWrites();
    expectPrefillFlushed(*runtime, launches);
    request.completePrefillAndFinish();
    EXPECT_EQ(runtime->deviceWriteLaunches(), launches + 1) << "finish launched";
    EXPECT_TRUE(runtime->deviceWritesPending()) << "finish cleared no row";
  }
  runtime->flushDeviceWrites();
  Rows const cleared = tableRows(*runtime);
  EXPECT_EQ(cleared.device, cleared.host);
  EXPECT_EQ(cleared.host, idle.host) << "finish left a row bound";
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(DeviceWriteTimingTest, ARowClearedAndBoundAgainBeforeAFlushArrivesWithItsLastValue) {
  auto runtime = KVCacheRuntime::create(engineStepConfig(backend(), device()));
  CacheSlot firstSlot = -1;
  {
    CallByCall first(*runtime, tokenRun(40, 100));
    first.beginAndPreparePrefill();
    runtime->flushDeviceWrites();
    first.completePrefillAndFinish();  // clears its row: waits
    firstSlot = first.slot();
  }
  int64_t const launches = runtime->deviceWriteLaunches();
  CallByCall second(*runtime, tokenRun(56, 900));  // another prompt on the same resident row
  ASSERT_EQ(second.slot(), firstSlot);
  second.beginAndPreparePrefill();
  runtime->flushDeviceWrites();
  EXPECT_EQ(runtime->deviceWriteLaunches(), launches + 1)
      << "the clear and the new binding of one row need one launch";
  Rows const rows = tableRows(*runtime);
  EXPECT_EQ(rows.device, rows.host);
  second.completePrefillAndFinish();
  runtime->flushDeviceWrites();
  EXPECT_TRUE(runtime->shutdown());
}

// The engine commits a row's length (KVCachePool::writeLengths) after a prefill queued its reset
// and before the step's flush: the device ends with the engine's value, as if every write had
// reached it in call order.
TEST_P(DeviceWriteTimingTest, AnEngineLengthWrittenBeforeTheFlushLandsAfterTheQueuedReset) {
  auto [runtime, idle, launches] = startEngineStep(backend(), device());
  CallByCall request(*runtime, tokenRun(40, 100));
  request.beginAndPreparePrefill();
  expectPrefillWaiting(*runtime, idle, launches);
  std::vector<int32_t> const committed{40};  // after the prefill's forward
  runtime->lengthPool().writeLengths(0, committed, runtime->config().stream);
  EXPECT_EQ(deviceLengths(*runtime), committed);
  EXPECT_EQ(runtime->deviceWriteLaunches(), launches + 1) << "the queued reset did not go first";
  runtime->flushDeviceWrites();
  EXPECT_EQ(deviceLengths(*runtime), committed) << "the reset overwrote the engine's length";
  Rows const rows = tableRows(*runtime);
  EXPECT_EQ(rows.device, rows.host);
  request.completePrefillAndFinish();
  runtime->flushDeviceWrites();
  EXPECT_TRUE(runtime->shutdown());
}

/// The prepared work's writes wait on the host and the engine, which forgot to flush, sampled a
/// token: `complete()` must throw naming `call` and change nothing. After the flush and `execute()`
/// (the forward, run again: its KV writes and its sampled token) it must succeed.
void expectRefusedUntilFlushed(RuntimeRig& rig, FacadeDriver& driver, char const* call,
                               std::function<void()> const& execute,
                               std::function<bool()> const& complete) {
  ASSERT_TRUE(rig.runtime().deviceWritesPending());
  BackendState const before = rig.observe();
  std::vector<int32_t>& sampled = driver.context.generatedTokenIds.at(0);
  sampled.push_back(1);
  EXPECT_TRUE(throwsError(complete, {call, "never reached the device", "flushDeviceWrites"}));
  sampled.pop_back();
  rig.expectUnchanged(before);
  EXPECT_TRUE(rig.runtime().deviceWritesPending());
  rig.runtime().flushDeviceWrites();
  execute();
  EXPECT_TRUE(complete());
}

// The engine step's read rule, enforced at the completion points: a prefill or decode step
// completed while the rows and lengths its prepare call wrote still wait on the host (no
// flushDeviceWrites() between the two calls, so its forward read stale rows) is refused, naming
// the call; nothing changes, and after the flush and the forward the completion succeeds.
TEST_P(DeviceWriteTimingTest, ACompletionWhoseWritesNeverReachedTheDeviceIsRefusedUntilAFlush) {
  RuntimeRig rig(engineStepConfig(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 100));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.preparePrefill());
  expectRefusedUntilFlushed(
      rig, driver, "ManagedKVCacheRequest::completePrefill", [&] { driver.executePrefill(); },
      [&] { return driver.completePrefill(); });
  // Decode until a step writes a row (a page mapped, or on the sliding backends a page that left
  // the window cleared): those writes wait for the flush the engine forgets.
  bool mapped = false;
  for (int32_t step = 0; step < 2 * runtime_test::kPageTokens && !mapped; ++step) {
    ASSERT_TRUE(driver.facade().prepareDecodeStep(driver.context, kVanilla));
    mapped = rig.runtime().deviceWritesPending();
    if (mapped) {
      expectRefusedUntilFlushed(
          rig, driver, "ManagedKVCacheRequest::completeDecodeStep", [&] { driver.executeDecode(); },
          [&] { return driver.completeDecode(); });
    } else {
      driver.executeDecode();  // nothing waits: no flush needed
      ASSERT_TRUE(driver.completeDecode());
    }
  }
  EXPECT_TRUE(mapped) << "no decode step mapped a page";
  driver.verify();
  ASSERT_TRUE(driver.finish());
  rig.runtime().flushDeviceWrites();
}

// A founder's first chunk completed in the prefill (completePrefillChunk) after a step that read
// stale rows (its prepare calls' writes never flushed) is refused the same way, on every backend,
// before anything of the founder changes; after the flush it completes and the founder holds.
TEST_P(DeviceWriteTimingTest, AFoundersChunkCompletedBeforeItsRowsReachedTheDeviceIsRefused) {
  RuntimeRig rig(engineStepConfig(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 100));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.preparePrefill());
  ASSERT_TRUE(driver.facade().preparePrefillChunk(0, 20));
  ASSERT_TRUE(rig.runtime().deviceWritesPending());
  BackendState const before = rig.observe();
  EXPECT_TRUE(throwsError([&] { (void)driver.facade().completePrefillChunk(0, 20); },
                          {"ManagedKVCacheRequest::completePrefillChunk",
                           "never reached the device", "flushDeviceWrites"}));
  rig.expectUnchanged(before);
  rig.runtime().flushDeviceWrites();
  ASSERT_TRUE(driver.facade().completePrefillChunk(0, 20));
  ASSERT_TRUE(driver.completePrefill());  // the founder samples nothing: it holds
  ASSERT_TRUE(driver.finish());
  rig.runtime().flushDeviceWrites();
}

// A flush between the prefill's two prepare calls carries only the first one's writes. With
// sliding-window reuse the second (the sliding half's rows) still waits: the completion is
// refused before either half changes (the full half's own writes did reach the device).
TEST_P(DeviceWriteTimingTest, AFlushBeforeTheLastPrepareCallDoesNotCountForIt) {
  RuntimeRig rig(engineStepConfig(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 100));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.facade().preparePrefill());
  rig.runtime().flushDeviceWrites();
  ASSERT_TRUE(driver.facade().prepareSwaPrefill(driver.context.effectivePrefillLengths));
  bool const swaWrites = backend() != Backend::kContextReuse;
  EXPECT_EQ(rig.runtime().deviceWritesPending(), swaWrites);
  if (swaWrites) {
    expectRefusedUntilFlushed(
        rig, driver, "ManagedKVCacheRequest::completePrefill", [&] { driver.executePrefill(); },
        [&] { return driver.completePrefill(); });
  } else {
    driver.executePrefill();
    ASSERT_TRUE(driver.completePrefill());
  }
  rig.runtime().flushDeviceWrites();
  driver.verify();
  ASSERT_TRUE(driver.finish());
  rig.runtime().flushDeviceWrites();
}

/// Staged uploads of every table of the runtime so far.
int64_t stagedUploads(KVCacheRuntime& runtime) {
  int64_t staged = 0;
  for (KVPageTable const* table :
       {runtime.fullPageTable(), runtime.swaPageTable(), runtime.draftPageTable()}) {
    staged += table != nullptr ? table->totalUploadStats().staged : 0;
  }
  return staged;
}

// A row wider than the inline limit (kernels::kMaxInlinePatchValues) is uploaded through staging,
// with a launch of its own: deviceWriteLaunches() counts it like the batch's.
TEST_P(DeviceWriteTimingTest, AFlushCountsTheLaunchOfARowUploadedThroughStaging) {
  constexpr int32_t kPages = 520;  // K and V ids: 1,040 entries
  KVCacheRuntimeConfig config = engineStepConfig(backend(), device());
  config.maxSequenceLength = kPages * runtime_test::kPageTokens;
  auto runtime = KVCacheRuntime::create(config);
  int64_t const launches = runtime->deviceWriteLaunches();
  int64_t const staged = stagedUploads(*runtime);
  CallByCall request(*runtime, tokenRun(config.maxSequenceLength - 8, 100));
  request.beginAndPreparePrefill();
  EXPECT_EQ(runtime->deviceWriteLaunches(), launches);
  runtime->flushDeviceWrites();
  Rows const rows = tableRows(*runtime);
  EXPECT_EQ(rows.device, rows.host);
  // Bounded SWA: the full layers' table is the static identity written at create and the
  // window's rows are short: one batch launch. Context reuse stages the prompt's dense row after
  // the lengths queued before it have gone (one launch), then launches it (a second). Sliding-
  // window reuse stages a row of each table, the sliding one holding the prompt's blocks until
  // the prefill completes: the lengths' launch and one per staged row.
  int64_t const expectStaged = backend() == Backend::kBoundedSwa     ? 0
                               : backend() == Backend::kContextReuse ? 1
                                                                     : 2;
  int64_t const expectLaunches = 1 + expectStaged;
  EXPECT_EQ(stagedUploads(*runtime) - staged, expectStaged);
  EXPECT_EQ(runtime->deviceWriteLaunches() - launches, expectLaunches);
  request.completePrefillAndFinish();
  runtime->flushDeviceWrites();
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(DeviceWriteTimingTest, EachCallTimingLeavesNothingWaiting) {
  auto runtime = KVCacheRuntime::create(configFor(backend(), device()));
  ASSERT_EQ(runtime->config().deviceWrites, DeviceWriteTiming::kEachCall);
  CallByCall request(*runtime, tokenRun(40, 100));
  request.beginAndPreparePrefill();
  EXPECT_FALSE(runtime->deviceWritesPending());
  Rows const rows = tableRows(*runtime);
  EXPECT_EQ(rows.device, rows.host);
  int64_t const launches = runtime->deviceWriteLaunches();
  runtime->flushDeviceWrites();  // nothing to do
  EXPECT_EQ(runtime->deviceWriteLaunches(), launches);
  request.completePrefillAndFinish();
  EXPECT_FALSE(runtime->deviceWritesPending());
}

// ---------------------------------------------------------------- end to end

/// The deployments of the end-to-end workload.
enum class Deployment : uint8_t { kReuse, kBoundedSwa, kSlidingReuse, kEagle, kHybrid, kHostTier };

struct WorkloadCase {
  Deployment deployment;
  DeviceType device;
};

char const* deploymentName(Deployment deployment) {
  switch (deployment) {
    case Deployment::kReuse:
      return "reuse";
    case Deployment::kBoundedSwa:
      return "swa";
    case Deployment::kSlidingReuse:
      return "sliding";
    case Deployment::kEagle:
      return "eagle";
    case Deployment::kHybrid:
      return "hybrid";
    case Deployment::kHostTier:
      return "hosttier";
  }
  return "unknown";
}

void PrintTo(WorkloadCase const& workload, std::ostream* out) {
  *out << deploymentName(workload.deployment) << " on " << toString(workload.device);
}

std::vector<WorkloadCase> everyWorkloadCase() {
  std::vector<WorkloadCase> cases;
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    for (Deployment deployment :
         {Deployment::kReuse, Deployment::kBoundedSwa, Deployment::kSlidingReuse,
          Deployment::kEagle, Deployment::kHybrid, Deployment::kHostTier}) {
      cases.push_back({deployment, device});
    }
  }
  return cases;
}

KVCacheRuntimeConfig workloadConfig(Deployment deployment, DeviceType device,
                                    DeviceWriteTiming timing, FaultInjector faults) {
  KVCacheRuntimeConfig config;
  switch (deployment) {
    case Deployment::kReuse:
      config = configFor(Backend::kContextReuse, device);
      break;
    case Deployment::kBoundedSwa:
      config = configFor(Backend::kBoundedSwa, device);
      break;
    case Deployment::kSlidingReuse:
      config = configFor(Backend::kSlidingWindowReuse, device);
      break;
    case Deployment::kEagle: {
      config = configFor(Backend::kContextReuse, device);
      KVCacheSpeculativeConfig spec;
      spec.numDraftLayers = 1;
      spec.numDraftKVHeads = 1;
      spec.draftHeadDim = 4;
      config.speculative = spec;
      break;
    }
    case Deployment::kHybrid:
      config = configFor(Backend::kContextReuse, device);
      config.model.numRecurrentLayers = 2;
      config.model.recurrentStateBytes = 24;
      config.model.recurrentConvBytes = 8;
      config.contextCache.recurrentSnapshotPoolBytes = int64_t{8} * 2 * (24 + 8);
      // 2 layers x K and V x 16 tokens x 1 head x 4 x fp16 per partial page.
      config.contextCache.partialKvSnapshotPoolBytes = int64_t{8} * 2 * 2 * 16 * 4 * 2;
      break;
    case Deployment::kHostTier:
      config = configFor(Backend::kContextReuse, device);
      config.numPages = 20;  // small: the churn below evicts to the host tier and onboards back
      config.contextCache.evictionPolicy = EvictionPolicyKind::kLru;
      config.hostPoolTokens = int64_t{64} * runtime_test::kPageTokens;
      break;
  }
  config.deviceWrites = timing;
  config.faults = std::move(faults);
  return config;
}

/// Everything one run of the workload yields that does not depend on the timing.
struct WorkloadResult {
  std::vector<RequestOutcome> outcomes;
  EngineStats stats;
  int64_t launches = 0;
  int64_t pagesOnboarded = 0;  ///< from the host tier (kHostTier)
};

/// A batch of three sequences with a shared prefix (one cancelled, so the batch compacts) and two
/// joiners where the backend seats them, then a multi-turn continuation (a hit), then churn with
/// distinct prompts that fills the pool and evicts, then the first prompt again.
WorkloadResult runWorkload(Deployment deployment, DeviceType device, DeviceWriteTiming timing,
                           FaultInjector faults = {}) {
  auto runtime =
      KVCacheRuntime::create(workloadConfig(deployment, device, timing, std::move(faults)));
  testing::ReferenceEngineOptions options;
  options.speculativeWidth = deployment == Deployment::kEagle ? 2 : 0;
  ReferenceEngine engine(*runtime, options);
  WorkloadResult result;
  std::vector<int32_t> const shared = tokenRun(37, 100);
  EngineRequest batch;
  batch.sequences.push_back(
      EngineSequence{concatenated(shared, tokenRun(5, 300)), 9, {}, {}, {}, -1, 0});
  batch.sequences.push_back(
      EngineSequence{concatenated(shared, tokenRun(21, 400)), 12, {}, {}, {}, 2, 1});
  batch.sequences.push_back(EngineSequence{tokenRun(19, 500), 6, {}, {}, {}, -1, 2});
  std::deque<EngineSequence> joiners;
  joiners.push_back(EngineSequence{concatenated(shared, tokenRun(3, 600)), 4, {}, {}, {}, -1, 3});
  joiners.push_back(EngineSequence{tokenRun(30, 700), 5, {}, {}, {}, -1, 4});
  result.outcomes.push_back(engine.run(batch, &joiners));
  std::vector<int32_t> history = batch.sequences[0].prompt;
  std::vector<int32_t> const& generated = result.outcomes.back().sequences.at(0).generated;
  history.insert(history.end(), generated.begin(), generated.end());
  EngineRequest turn;
  turn.sequences.push_back(
      EngineSequence{concatenated(history, tokenRun(11, 800)), 5, {}, {}, {}, -1, 5});
  result.outcomes.push_back(engine.run(turn));
  for (int32_t i = 0; i < 6; ++i) {
    EngineRequest churn;
    churn.sequences.push_back(
        EngineSequence{tokenRun(50 + 7 * i, 1000 + 100 * i), 4, {}, {}, {}, -1, 6 + i});
    result.outcomes.push_back(engine.run(churn));
  }
  result.outcomes.push_back(engine.run(turn));
  result.stats = engine.stats();
  result.launches = runtime->deviceWriteLaunches();
  if (runtime->hostTier() != nullptr) {
    result.pagesOnboarded = runtime->hostTier()->pagesOnboarded();
  }
  EXPECT_TRUE(runtime->shutdown());
  return result;
}

void expectSameOutcomes(std::vector<RequestOutcome> const& each,
                        std::vector<RequestOutcome> const& step) {
  ASSERT_EQ(each.size(), step.size());
  for (std::size_t r = 0; r < each.size(); ++r) {
    EXPECT_EQ(each[r].admitted, step[r].admitted) << "request " << r;
    EXPECT_EQ(each[r].failed, step[r].failed) << "request " << r;
    EXPECT_EQ(each[r].decodeSteps, step[r].decodeSteps) << "request " << r;
    ASSERT_EQ(each[r].sequences.size(), step[r].sequences.size()) << "request " << r;
    for (std::size_t s = 0; s < each[r].sequences.size(); ++s) {
      testing::SequenceOutcome const& a = each[r].sequences[s];
      testing::SequenceOutcome const& b = step[r].sequences[s];
      EXPECT_EQ(a.generated, b.generated) << "request " << r << " sequence " << s;
      EXPECT_EQ(a.prefillStart, b.prefillStart) << "request " << r << " sequence " << s;
      EXPECT_EQ(a.reason, b.reason) << "request " << r << " sequence " << s;
      EXPECT_EQ(a.joinedInFlight, b.joinedInFlight) << "request " << r << " sequence " << s;
    }
  }
}

class EngineStepWorkloadTest : public ::testing::TestWithParam<WorkloadCase> {
 protected:
  void SetUp() override { MKV_SKIP_WITHOUT_DEVICE(GetParam().device); }
};

std::string workloadCaseName(::testing::TestParamInfo<WorkloadCase> const& info) {
  return std::string(deploymentName(info.param.deployment)) + "_" +
         std::string(toString(info.param.device));
}

INSTANTIATE_TEST_SUITE_P(Deployments, EngineStepWorkloadTest,
                         ::testing::ValuesIn(everyWorkloadCase()), workloadCaseName);

TEST_P(EngineStepWorkloadTest, TheOracleAgreesAndEveryFigureMatchesWritesAtEachCall) {
  WorkloadCase const workload = GetParam();
  WorkloadResult const each =
      runWorkload(workload.deployment, workload.device, DeviceWriteTiming::kEachCall);
  WorkloadResult const step =
      runWorkload(workload.deployment, workload.device, DeviceWriteTiming::kEngineStep);
  expectSameOutcomes(each.outcomes, step.outcomes);
  EXPECT_EQ(step.stats.oracleMismatches, 0) << step.stats.firstMismatch;
  EXPECT_GT(step.stats.oracleChecks, 0);
  EXPECT_EQ(step.stats.oracleChecks, each.stats.oracleChecks);
  EXPECT_EQ(step.stats.lengthChecks, each.stats.lengthChecks);
  EXPECT_EQ(step.stats.recurrentChecks, each.stats.recurrentChecks);
  EXPECT_EQ(step.stats.draftOracleChecks, each.stats.draftOracleChecks);
  EXPECT_EQ(step.stats.reusedTokens, each.stats.reusedTokens);
  EXPECT_EQ(step.stats.joins, each.stats.joins);
  EXPECT_EQ(step.stats.decodeSteps, each.stats.decodeSteps);
  EXPECT_EQ(step.stats.peakPagesInUse, each.stats.peakPagesInUse);
  if (workload.deployment != Deployment::kBoundedSwa) {
    EXPECT_GT(step.stats.reusedTokens, 0) << "the workload reused nothing";
  }
  if (workload.deployment == Deployment::kReuse ||
      workload.deployment == Deployment::kSlidingReuse) {
    EXPECT_EQ(step.stats.joins, 2) << "the joiners were not seated";
  }
  if (workload.deployment == Deployment::kHostTier) {
    EXPECT_GT(step.pagesOnboarded, 0) << "nothing came back from the host tier";
    EXPECT_EQ(step.pagesOnboarded, each.pagesOnboarded);
  }
  // The reference engine's steps each make one writing call per backend (a batch's finished rows
  // leave by compaction, which applies its writes at once), so one backend launches as often with
  // either timing; the composed backend's two halves share the step's launch. What an engine step
  // saves on single requests is shown call by call above.
  EXPECT_GT(step.launches, 0);
  if (workload.deployment == Deployment::kSlidingReuse) {
    EXPECT_LT(step.launches, each.launches);
  } else {
    EXPECT_EQ(step.launches, each.launches);
  }
}

// The fault seam's one declaration, kFaultSites, is covered: the workloads above (reuse with
// hits and publications, bounded SWA, sliding-window reuse, EAGLE, hybrid checkpoints, a host tier
// that offloads and onboards), at both timings, consult the runtime's injector
// (KVCacheRuntimeConfig
// ::faults) at every site of the table. A site added to the table without a lifecycle that reaches
// it fails here.
TEST(FaultSiteTest, EverySiteOfTheTableIsConsulted) {
  test::FaultArming faults;  // counts every site it is asked about, fails none
  for (WorkloadCase const& workload : everyWorkloadCase()) {
    if (workload.device != DeviceType::kCPU) {
      continue;  // the same sites; the host twin needs no device
    }
    for (DeviceWriteTiming timing :
         {DeviceWriteTiming::kEachCall, DeviceWriteTiming::kEngineStep}) {
      (void)runWorkload(workload.deployment, workload.device, timing, faults.injector());
    }
  }
  for (FaultSiteInfo const& row : kFaultSites) {
    EXPECT_GT(faults.calls(row.site), 0) << "no lifecycle consulted \"" << row.name << "\"";
    EXPECT_EQ(faults.failures(row.site), 0);
    EXPECT_EQ(toString(row.site), row.name);
  }
}

}  // namespace
}  // namespace mkv
