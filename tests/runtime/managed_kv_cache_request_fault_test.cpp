// ManagedKVCacheRequest under the fault model (docs/errors.md, "Poison and quarantine"), on every
// backend (context reuse, bounded SWA, and both composed: sliding-window reuse, whose halves share
// each completion point's one synchronisation): a scripted lifecycle whose synchronisation points
// are made to fail one at a time.
// Each failure must surface as the documented result (false from the call that synchronised;
// poison after an abandonment), keep the request's pages quarantined, refuse admission while
// poisoned, and after shutdown() leave every page accounted for and the runtime serving requests
// again. On host tensors and on GPU tensors (the synchroniser then really waits for the stream
// before failing).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/reference_engine.h"
#include "runtime_test_rig.h"

namespace mkv::runtime_test {
namespace {

class ManagedKVCacheRequestFaultTest : public RuntimeCaseTest {};

INSTANTIATE_TEST_SUITE_P(Backends, ManagedKVCacheRequestFaultTest,
                         ::testing::ValuesIn(everyBackendCase()), runtimeCaseName);

/// Whether the armed synchronisation failed during `call`; the call's pages must then be held
/// exactly as before it (quarantined, not released).
template <typename Call>
bool failedDuring(RuntimeRig& rig, Call&& call) {
  int64_t const failures = rig.faults().failures();
  int32_t const held = rig.heldPages();
  call();
  if (rig.faults().failures() == failures) {
    return false;
  }
  EXPECT_TRUE(rig.poisoned());
  EXPECT_EQ(rig.heldPages(), held) << "a failed synchronisation releases nothing";
  return true;
}

/// The lifecycle the sweep replays. Its synchronisation points, in order: two compactions, a
/// finish while a prefill is pending (the engine's prefill failed), and the abandonment of a
/// request with a decode step pending (the facade destroyed mid-step). Returns the name of the
/// point whose synchronisation failed ("" when none did); it stops there, as an engine that saw
/// the backend poisoned would.
std::string syncScript(RuntimeRig& rig) {
  {
    FacadeDriver driver(rig);
    driver.add(tokenRun(40, 100));
    driver.add(tokenRun(23, 300));
    driver.add(tokenRun(37, 500));
    EXPECT_TRUE(driver.begin());
    EXPECT_TRUE(driver.prefill());
    EXPECT_TRUE(driver.decode());
    EXPECT_TRUE(driver.decode());
    std::vector<int32_t> const mappings[] = {{0, -1, 1}, {-1, 0}};
    for (std::size_t i = 0; i < 2; ++i) {
      bool compacted = false;
      if (failedDuring(rig, [&] { compacted = driver.compact(mappings[i]); })) {
        EXPECT_FALSE(compacted) << "completeBatchCompaction reports the failure";
        EXPECT_FALSE(driver.finish()) << "the quarantined request finishes as poisoned";
        return "compaction " + std::to_string(i + 1);
      }
      EXPECT_TRUE(compacted);
      EXPECT_TRUE(driver.decode());
      driver.verify();
    }
    EXPECT_TRUE(driver.finish());  // nothing pending: no synchronisation
  }
  {
    FacadeDriver driver(rig);
    driver.add(tokenRun(50, 700));
    driver.add(tokenRun(20, 900));
    EXPECT_TRUE(driver.begin());
    EXPECT_TRUE(driver.preparePrefill());
    bool finished = false;
    if (failedDuring(rig, [&] { finished = driver.finish(); })) {
      EXPECT_FALSE(finished);
      return "finish";
    }
    EXPECT_TRUE(finished);
  }
  {
    FacadeDriver driver(rig);
    driver.add(tokenRun(30, 1100));
    EXPECT_TRUE(driver.begin());
    EXPECT_TRUE(driver.prefill());
    EXPECT_TRUE(driver.decode());
    EXPECT_TRUE(driver.prepareDecode());
    if (failedDuring(rig, [&] { driver.drop(); })) {
      return "abandonment";
    }
  }
  return "";
}

TEST_P(ManagedKVCacheRequestFaultTest, EverySynchronisationFailingOnceQuarantinesUntilShutdown) {
  int64_t syncs = 0;
  {
    RuntimeRig clean(configFor(backend(), device()));
    EXPECT_EQ(syncScript(clean), "");
    syncs = clean.faults().calls();
    EXPECT_FALSE(clean.poisoned());
    EXPECT_TRUE(clean.runtime().shutdown());
    EXPECT_EQ(clean.faults().calls(), syncs) << "nothing quarantined: shutdown does not wait";
    clean.expectIdle();
  }
  // Sliding-window reuse completes each point on both halves with one synchronisation.
  ASSERT_EQ(syncs, 4);
  std::vector<std::string> failedAt;
  for (int64_t k = 1; k <= syncs; ++k) {
    SCOPED_TRACE("synchronisation " + std::to_string(k) + " fails");
    RuntimeRig rig(configFor(backend(), device()));
    rig.faults().failCall(k);
    failedAt.push_back(syncScript(rig));
    EXPECT_EQ(rig.faults().failures(), 1);
    EXPECT_EQ(rig.faults().calls(), k) << "nothing synchronises after the failure";
    EXPECT_TRUE(rig.poisoned());
    EXPECT_EQ(rig.activeRequests(), 0);
    EXPECT_GT(rig.heldPages(), 0) << "the failed request's pages stay quarantined";
    // While poisoned, admission is refused and takes nothing.
    {
      FacadeDriver refused(rig);
      refused.add(tokenRun(20, 7));
      BackendState const before = rig.observe();
      EXPECT_FALSE(refused.begin());
      rig.expectUnchanged(before);
    }
    // shutdown() drains the quarantine with one synchronisation and clears the poison.
    EXPECT_TRUE(rig.runtime().shutdown());
    EXPECT_EQ(rig.faults().calls(), k + 1);
    rig.expectIdle();
    // The runtime serves again, the KV oracle checking every position read.
    testing::ReferenceEngine engine(rig.runtime());
    testing::EngineRequest request;
    request.sequences.push_back({tokenRun(45, 2000), 6, {}, {}, {}, -1, 0});
    request.sequences.push_back({tokenRun(18, 3000), 4, {}, {}, {}, -1, 1});
    testing::RequestOutcome const outcome = engine.run(request);
    EXPECT_TRUE(outcome.admitted);
    EXPECT_FALSE(outcome.failed);
    ASSERT_EQ(outcome.sequences.size(), 2u);
    EXPECT_EQ(outcome.sequences[0].reason, FinishReason::kLength);
    EXPECT_EQ(outcome.sequences[1].reason, FinishReason::kLength);
    EXPECT_EQ(outcome.decodeSteps, 5);
    EXPECT_EQ(engine.stats().oracleMismatches, 0);
    EXPECT_GT(engine.stats().oracleChecks, 0);
    EXPECT_TRUE(rig.runtime().shutdown());
    rig.expectIdle();
  }
  EXPECT_EQ(failedAt,
            (std::vector<std::string>{"compaction 1", "compaction 2", "finish", "abandonment"}));
}

// After finish() returned false the engine asks KVCacheRuntime::residentRowState whether it may
// release a resident and reuse its row: kQuarantined until shutdown() drains the quarantine, then
// kFree; a row of a live request is kActive, one never used or released by a clean finish kFree.
TEST_P(ManagedKVCacheRequestFaultTest, ResidentRowStateTellsQuarantinedRowsFromFreeOnes) {
  RuntimeRig rig(configFor(backend(), device()));
  KVCacheRuntime& runtime = rig.runtime();
  std::vector<ResidentRef> residents;
  {
    FacadeDriver driver(rig);
    driver.add(tokenRun(40, 5));
    driver.add(tokenRun(23, 300));
    residents = driver.context.residentRefs;
    EXPECT_EQ(runtime.residentRowState(residents[0].slot), ResidentRowState::kFree)
        << "acquired from the pool, not yet admitted";
    ASSERT_TRUE(driver.begin());
    EXPECT_EQ(runtime.residentRowState(residents[1].slot), ResidentRowState::kActive);
    EXPECT_EQ(runtime.residentRowState(2), ResidentRowState::kFree) << "a row nobody holds";
    EXPECT_EQ(runtime.residentRowState(-1), ResidentRowState::kFree);
    ASSERT_TRUE(driver.preparePrefill());  // the engine's prefill failed: finish synchronises
    rig.faults().failNext();
    EXPECT_FALSE(driver.finish());
    for (ResidentRef const& resident : residents) {
      EXPECT_EQ(runtime.residentRowState(resident.slot), ResidentRowState::kQuarantined)
          << "slot " << resident.slot;
    }
    driver.drop();
    driver.rows.clear();  // the engine keeps quarantined residents until the drain
    driver.context.residentRefs.clear();
  }
  EXPECT_EQ(runtime.residentSlots().available(), runtime.config().maxBatchSize - 2);
  ASSERT_TRUE(runtime.shutdown());
  for (ResidentRef const& resident : residents) {
    EXPECT_EQ(runtime.residentRowState(resident.slot), ResidentRowState::kFree);
    EXPECT_TRUE(runtime.residentSlots().release(resident));
  }
  rig.expectIdle();
}

}  // namespace
}  // namespace mkv::runtime_test
