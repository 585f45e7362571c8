// ManagedKVCacheRequest: the dispatch table of each backend (docs/architecture.md, "One request's
// path through the layers, from `begin` to `finish`"; docs/errors.md, "ManagedKVCacheRequest"),
// and the contract: misuse throws mkv::Error naming the call and changes nothing (free and held
// pages, page-table rows, KV lengths, residents, poison, synchronisations), after which the
// request carries on as if nothing had happened and the KV oracle still passes. Every test runs
// on host tensors and on GPU tensors (the kGPU instances skip without a CUDA device).
#include "mkv/managed_kv_cache_request.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <initializer_list>
#include <string_view>
#include <utility>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "runtime_test_rig.h"
#include "support/test_util.h"

namespace mkv::runtime_test {
namespace {

using AdmitStatus = AdmitSequenceStatus;
constexpr auto kLookahead = DecodingTokenStateContract::kCommittedPlusLookahead;
constexpr auto kCommitAll = ContextCacheCommitPolicy::kIncludingGeneratedTokens;

/// `call` throws mkv::Error whose message holds every fragment, and the backend is unchanged.
template <typename Call>
void expectRejected(RuntimeRig& rig, char const* what, Call&& call,
                    std::initializer_list<std::string_view> fragments) {
  SCOPED_TRACE(what);
  BackendState const before = rig.observe();
  EXPECT_TRUE(test::throwsError(std::forward<Call>(call), fragments));
  rig.expectUnchanged(before);
}

/// `call` returns `expected` and the backend is unchanged.
template <typename Call, typename Result>
void expectNoOp(RuntimeRig& rig, char const* what, Call&& call, Result expected) {
  SCOPED_TRACE(what);
  BackendState const before = rig.observe();
  EXPECT_EQ(call(), expected);
  rig.expectUnchanged(before);
}

/// Decodes the survivors to the end of a request and checks their KV: the request works as if
/// no rejected call had been made.
void finishCleanly(RuntimeRig& rig, FacadeDriver& driver) {
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(driver.decode());
    driver.verify();
  }
  EXPECT_TRUE(driver.finish());
  EXPECT_FALSE(rig.poisoned());
  EXPECT_EQ(rig.activeRequests(), 0);
}

class ManagedKVCacheRequestTest : public RuntimeCaseTest {
 protected:
  /// The fragment the backend's own message holds (sliding-window reuse: the coordinator's,
  /// unless its SWA half checks first and says `slidingText`).
  std::string_view pick(std::string_view reuseText, std::string_view swaText,
                        std::string_view slidingText = {}) const {
    if (backend() == Backend::kSlidingWindowReuse && !slidingText.empty()) {
      return slidingText;
    }
    return reuse() ? reuseText : swaText;
  }
};

INSTANTIATE_TEST_SUITE_P(Backends, ManagedKVCacheRequestTest,
                         ::testing::ValuesIn(everyBackendCase()), runtimeCaseName);

/// The tests bound to one backend, on each device.
class ManagedKVCacheRequestBeginTest : public test::DeviceTest {};
class ManagedKVCacheRequestDispatchTest : public test::DeviceTest {};

INSTANTIATE_TEST_SUITE_P(Devices, ManagedKVCacheRequestBeginTest, test::allDeviceTypes(),
                         test::deviceName);
INSTANTIATE_TEST_SUITE_P(Devices, ManagedKVCacheRequestDispatchTest, test::allDeviceTypes(),
                         test::deviceName);

// ---------------------------------------------------------------- begin

TEST_P(ManagedKVCacheRequestBeginTest, NeedsABackendAndBothOnlyFromSlidingWindowReuse) {
  RuntimeRig reuseRig(configFor(Backend::kContextReuse, device()));
  RuntimeRig swaRig(configFor(Backend::kBoundedSwa, device()));
  FacadeDriver driver(reuseRig);
  driver.add(tokenRun(40, 5));
  auto begin = [&](ContextCacheCoordinator* contextCache, BoundedSwaKVPageManager* swa) {
    return ManagedKVCacheRequest::begin(contextCache, swa, driver.request, driver.context, false,
                                        kVanilla, kLookahead, kCommitAll);
  };
  // Both pointers select sliding-window reuse, whose SWA half needs a manager with a page source:
  // a plain bounded-SWA manager refuses before anything of the SWA runtime changes (the
  // coordinator's admission is abandoned again).
  BackendState const swaBefore = swaRig.observe();
  EXPECT_TRUE(test::throwsError(
      [&] { (void)begin(reuseRig.runtime().contextCache(), swaRig.runtime().swaPageManager()); },
      {"ManagedKVCacheRequest::begin"}));
  swaRig.expectUnchanged(swaBefore);
  EXPECT_EQ(reuseRig.runtime().contextCache()->activeRequestCount(), 0);
  expectRejected(reuseRig, "no backend", [&] { (void)begin(nullptr, nullptr); },
                 {"ManagedKVCacheRequest::begin", "both null"});
  // The same request then begins on its one backend and runs.
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  finishCleanly(reuseRig, driver);
}

TEST_P(ManagedKVCacheRequestBeginTest, BoundedSwaRejectsSpeculationOtherHeadroomAndFullCommit) {
  RuntimeRig rig(configFor(Backend::kBoundedSwa, device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(30, 500));
  BoundedSwaKVPageManager* swa = rig.runtime().swaPageManager();
  auto begin = [&](bool speculative, DecodingKvHeadroom headroom,
                   DecodingTokenStateContract contract) {
    return [&, speculative, headroom, contract] {
      (void)ManagedKVCacheRequest::begin(nullptr, swa, driver.request, driver.context, speculative,
                                         headroom, contract, kCommitAll);
    };
  };
  expectRejected(rig, "speculative", begin(true, kVanilla, kLookahead),
                 {"ManagedKVCacheRequest::begin", "does not decode speculatively"});
  expectRejected(rig, "two verify tokens", begin(false, {2, 0}, kLookahead),
                 {"ManagedKVCacheRequest::begin", "needs headroom {1, 0}, got {2, 0}"});
  expectRejected(rig, "draft tokens", begin(false, {1, 1}, kLookahead), {"got {1, 1}"});
  expectRejected(rig, "no headroom", begin(false, {0, 0}, kLookahead), {"got {0, 0}"});
  expectRejected(rig, "fully committed",
                 begin(false, kVanilla, DecodingTokenStateContract::kFullyCommitted),
                 {"ManagedKVCacheRequest::begin", "committed-plus-lookahead contract"});
  ASSERT_TRUE(driver.begin());
  EXPECT_EQ(rig.freePages(), rig.totalPages() - 2 * 7) << "2M + 1 pages per sequence";
  ASSERT_TRUE(driver.prefill());
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestTest, BeginRejectsAContextWhoseSizesDisagree) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.context.activeBatchSize = 2;
  expectRejected(rig, "batch size", [&] { (void)driver.begin(); },
                 {pick("ManagedKVCacheRequest::begin", "ManagedKVCacheRequest::begin"),
                  pick("activeBatchSize 2 but 1 prompts", "activeBatchSize 2 with 1 prompts")});
  driver.context.activeBatchSize = 1;
  std::vector<ResidentRef> const residents = driver.context.residentRefs;
  driver.context.residentRefs.clear();
  expectRejected(rig, "no residents", [&] { (void)driver.begin(); },
                 {pick("0 residents for 1 prompts", "with 1 prompts and 0 residents")});
  driver.context.residentRefs = residents;
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  finishCleanly(rig, driver);
}

// ---------------------------------------------------------------- stale residents

// A ResidentRef whose slot was released and acquired again (its epoch bumped) is refused at every
// entry point that takes one, naming the call, the slot and both epochs; so is a ref of a slot the
// pool does not hold.
TEST_P(ManagedKVCacheRequestTest, AStaleResidentIsRefusedByBegin) {
  RuntimeRig rig(configFor(backend(), device()));
  ResidentSlotPool& slots = rig.runtime().residentSlots();
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ResidentRef const stale = driver.context.residentRefs[0];
  ASSERT_TRUE(slots.release(stale));
  ResidentRef const current = slots.acquire().value();
  ASSERT_EQ(current.slot, stale.slot);
  ASSERT_EQ(current.epoch, stale.epoch + 1);
  expectRejected(rig, "begin with a stale ref", [&] { (void)driver.begin(); },
                 {"ManagedKVCacheRequest::begin",
                  fmt::format("resident slot {} has epoch {}", stale.slot, stale.epoch),
                  fmt::format("current epoch is {}", current.epoch), "stale"});
  ASSERT_TRUE(slots.release(current));
  expectRejected(rig, "begin with a ref of a free slot", [&] { (void)driver.begin(); },
                 {"ManagedKVCacheRequest::begin", "stale"});
  ResidentRef const fresh = slots.acquire().value();
  driver.context.residentRefs[0] = fresh;
  driver.rows[0].resident = fresh;
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestDispatchTest, AStaleResidentIsRefusedByAdmitSequence) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  ResidentSlotPool& slots = rig.runtime().residentSlots();
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ResidentRef const stale = slots.acquire().value();
  ASSERT_TRUE(slots.release(stale));
  ResidentRef const current = slots.acquire().value();
  ASSERT_EQ(current.slot, stale.slot);
  int32_t start = -1;
  expectRejected(rig, "admitSequence with a stale ref",
                 [&] {
                   (void)driver.facade().admitSequence(tokenRun(20, 700), "", kVanilla, start,
                                                       stale, driver.context.stream);
                 },
                 {"ManagedKVCacheRequest::admitSequence",
                  fmt::format("resident slot {} has epoch {}", stale.slot, stale.epoch),
                  fmt::format("current epoch is {}", current.epoch)});
  EXPECT_EQ(start, -1);
  ASSERT_TRUE(slots.release(current));
  ASSERT_EQ(driver.admit(tokenRun(20, 700)), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  driver.verify();
  EXPECT_TRUE(driver.finish());
}

// ---------------------------------------------------------------- lifecycle order

TEST_P(ManagedKVCacheRequestTest, CallsOutOfOrderThrowAndChangeNothing) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(23, 300));
  ManagedKVCacheRequest* facade = nullptr;
  // With its lookahead tokens sampled, as if the engine had run a prefill.
  auto completePrefill = [&] {
    DecodingInferenceContext sampled = driver.context;
    for (std::vector<int32_t>& generated : sampled.generatedTokenIds) {
      generated.assign(1, 1234);
    }
    (void)facade->completePrefill(sampled, {});
  };
  auto prepareDecode = [&] { (void)facade->prepareDecodeStep(driver.context, kVanilla); };
  auto completeDecode = [&] { (void)facade->completeDecodeStep(driver.context, {}); };
  auto beginCompaction = [&] {
    (void)facade->beginBatchCompaction({0, -1}, 1, driver.deviceMapping);
  };
  auto completeCompaction = [&] { (void)facade->completeBatchCompaction({0, -1}); };
  std::vector<int32_t> const joiner = tokenRun(20, 700);

  ASSERT_TRUE(driver.begin());
  facade = &driver.facade();
  // Admitted, nothing prepared.
  expectRejected(
      rig, "completePrefill before preparePrefill", completePrefill,
      {pick("ManagedKVCacheRequest::completePrefill", "ManagedKVCacheRequest::completePrefill"),
       "no prepared prefill"});
  expectRejected(
      rig, "prepareDecodeStep before prefill", prepareDecode,
      {pick("ManagedKVCacheRequest::prepareDecodeStep", "ManagedKVCacheRequest::prepareDecodeStep"),
       pick("needs an executing request", "needs a completed prefill",
            "needs a completed prefill")});
  expectRejected(rig, "completeDecodeStep before prefill", completeDecode,
                 {pick("ManagedKVCacheRequest::completeDecodeStep",
                       "ManagedKVCacheRequest::completeDecodeStep"),
                  pick("no decode step was prepared", "no prepared decode step")});
  expectRejected(rig, "beginBatchCompaction before prefill", beginCompaction,
                 {"beginBatchCompaction", "compaction needs an executing request"});
  expectRejected(rig, "completeBatchCompaction before prefill", completeCompaction,
                 {pick("ManagedKVCacheRequest::completeBatchCompaction",
                       "ManagedKVCacheRequest::completeBatchCompaction"),
                  "no batch compaction was begun"});

  // Prefill prepared, not completed.
  ASSERT_TRUE(driver.preparePrefill());
  if (reuse()) {
    expectRejected(rig, "preparePrefill twice", [&] { (void)facade->preparePrefill(); },
                   {"ManagedKVCacheRequest::preparePrefill", "already prepared"});
    expectRejected(rig, "admitSequence during the prefill", [&] { (void)driver.admit(joiner); },
                   {"ManagedKVCacheRequest::admitSequence", "no pending work"});
  } else {
    expectRejected(rig, "prepareSwaPrefill twice",
                   [&] { (void)facade->prepareSwaPrefill(driver.context.effectivePrefillLengths); },
                   {"ManagedKVCacheRequest::prepareSwaPrefill", "already prepared"});
  }
  expectRejected(rig, "prepareDecodeStep during the prefill", prepareDecode, {"prepareDecodeStep"});
  expectRejected(rig, "beginBatchCompaction during the prefill", beginCompaction,
                 {"beginBatchCompaction", "no pending work"});
  driver.executePrefill();
  ASSERT_TRUE(driver.completePrefill());

  // Prefill completed, no step prepared.
  expectRejected(
      rig, "completePrefill twice", completePrefill,
      {pick("ManagedKVCacheRequest::completePrefill", "ManagedKVCacheRequest::completePrefill")});
  expectRejected(rig, "completeDecodeStep without a prepared step", completeDecode,
                 {"completeDecodeStep", pick("no decode step was prepared", "no prepared")});
  expectRejected(rig, "completeBatchCompaction without beginBatchCompaction", completeCompaction,
                 {pick("ManagedKVCacheRequest::completeBatchCompaction",
                       "ManagedKVCacheRequest::completeBatchCompaction"),
                  "no batch compaction was begun"});
  driver.verify();

  // A decode step prepared.
  ASSERT_TRUE(driver.prepareDecode());
  expectRejected(
      rig, "prepareDecodeStep twice", prepareDecode,
      {"prepareDecodeStep", pick("already prepared", "no pending work", "no pending work")});
  expectRejected(
      rig, "beginBatchCompaction during a step", beginCompaction,
      {"beginBatchCompaction", pick("still prepared", "no pending work", "no pending work")});
  if (reuse()) {
    expectRejected(rig, "finish during a step", [&] { (void)facade->finish(); },
                   {"ManagedKVCacheRequest::finish", "a decode step is still prepared"});
    expectRejected(rig, "admitSequence during a step", [&] { (void)driver.admit(joiner); },
                   {"ManagedKVCacheRequest::admitSequence", "a decode step is prepared"});
  }
  driver.finishRow(1);
  ASSERT_TRUE(driver.completeDecode());

  // A compaction begun.
  ASSERT_TRUE(facade->beginBatchCompaction({0, -1}, 1, driver.deviceMapping));
  expectRejected(rig, "prepareDecodeStep during a compaction", prepareDecode,
                 {"prepareDecodeStep"});
  expectRejected(rig, "beginBatchCompaction twice", beginCompaction, {"beginBatchCompaction"});
  ASSERT_TRUE(facade->completeBatchCompaction({0, -1}));
  driver.compactView({0, -1});
  driver.verify();
  finishCleanly(rig, driver);

  // Finished: the handle is gone; a second finish is a no-op.
  expectRejected(rig, "prepareDecodeStep after finish", prepareDecode, {"invalid"});
  expectNoOp(
      rig, "finish twice", [&] { return facade->finish(); }, true);
}

// ---------------------------------------------------------------- compaction validation

// Everything completeBatchCompaction needs is validated by beginBatchCompaction: a KV-length
// tensor whose active batch is not the request's (the engine did not grow or shrink it) throws
// there, and a tensor resized between begin and complete throws before anything is cleared.
TEST_P(ManagedKVCacheRequestTest, ALengthTensorThatDisagreesWithTheBatchFailsTheCompactionBegin) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(23, 300));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.prepareDecode());
  driver.finishRow(0);
  ASSERT_TRUE(driver.completeDecode());
  KVCachePool& lengths = rig.runtime().lengthPool();
  lengths.setActiveBatchSize(1);  // an engine that shrank its tensor too early
  expectRejected(rig, "beginBatchCompaction over a tensor of 1 row",
                 [&] {
                   (void)driver.facade().beginBatchCompaction({-1, 0}, 1, driver.deviceMapping);
                 },
                 {"beginBatchCompaction", "active batch is 1", "has 2 rows"});
  lengths.setActiveBatchSize(2);
  if (KVCachePool* sliding = rig.slidingReuse() ? rig.runtime().swaPool() : nullptr) {
    // The other half's tensor: both halves check before either begins or completes.
    sliding->setActiveBatchSize(1);
    expectRejected(rig, "beginBatchCompaction over a sliding tensor of 1 row",
                   [&] {
                     (void)driver.facade().beginBatchCompaction({-1, 0}, 1, driver.deviceMapping);
                   },
                   {"beginBatchCompaction", "active batch is 1", "has 2 rows"});
    sliding->setActiveBatchSize(2);
    ASSERT_TRUE(driver.facade().beginBatchCompaction({-1, 0}, 1, driver.deviceMapping));
    sliding->setActiveBatchSize(3);
    expectRejected(rig, "completeBatchCompaction over a sliding tensor of 3 rows",
                   [&] {
                     (void)driver.facade().completeBatchCompaction({-1, 0});
                   },
                   {"completeBatchCompaction", "active batch is 3", "has 2 rows"});
    sliding->setActiveBatchSize(2);
  } else {
    ASSERT_TRUE(driver.facade().beginBatchCompaction({-1, 0}, 1, driver.deviceMapping));
  }
  lengths.setActiveBatchSize(3);  // resized between begin and complete
  expectRejected(rig, "completeBatchCompaction over a tensor of 3 rows",
                 [&] {
                   (void)driver.facade().completeBatchCompaction({-1, 0});
                 },
                 {"completeBatchCompaction", "active batch is 3", "has 2 rows"});
  lengths.setActiveBatchSize(2);
  ASSERT_TRUE(driver.facade().completeBatchCompaction({-1, 0}));
  driver.compactView({-1, 0});
  driver.verify();
  finishCleanly(rig, driver);
}

// The engine: a joiner admitted and prefilled, but the KV-length tensor never grown for
// it. The compaction that drops a founder must throw at its begin, before the dropped row is
// cleared in the host table and its device copy.
TEST_P(ManagedKVCacheRequestDispatchTest, AJoinerTheLengthTensorWasNotGrownForFailsTheBegin) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(23, 300));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_EQ(driver.admit(tokenRun(20, 700)), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.prepareDecode());
  driver.finishRow(1);
  ASSERT_TRUE(driver.completeDecode());
  KVCachePool& lengths = *rig.runtime().fullPool();
  lengths.setActiveBatchSize(2);  // as if the engine had never grown it for the joiner
  expectRejected(
      rig, "beginBatchCompaction",
      [&] {
        (void)driver.facade().beginBatchCompaction({0, -1, 1}, 2, driver.deviceMapping);
      },
      {"ManagedKVCacheRequest::beginBatchCompaction", "active batch is 2", "has 3 rows"});
  lengths.setActiveBatchSize(3);
  ASSERT_TRUE(driver.compact({0, -1, 1}));
  driver.verify();
  EXPECT_TRUE(driver.finish());
}

// The audit of the facade's entry points for a throw after a mutation: every rejected call below
// must leave the whole observable state (BackendState: host and device page tables, KV lengths,
// pools, references, the free ring, records, leases, snapshot slots) byte-identical.
TEST_P(ManagedKVCacheRequestTest, ACompactionWhoseDeviceMappingChangedThrowsBeforeClearingRows) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(23, 300));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.prepareDecode());
  driver.finishRow(1);
  ASSERT_TRUE(driver.completeDecode());
  ASSERT_TRUE(driver.facade().beginBatchCompaction({0, -1}, 1, driver.deviceMapping));
  ASSERT_TRUE(driver.deviceMapping.reshape({1}));  // the engine reuses its tensor too early
  expectRejected(rig, "completeBatchCompaction over a reshaped mapping",
                 [&] {
                   (void)driver.facade().completeBatchCompaction({0, -1});
                 },
                 {"ManagedKVCacheRequest::completeBatchCompaction",
                  "deviceMapping was reshaped or replaced", "1 entries", "expected 2"});
  ASSERT_TRUE(driver.deviceMapping.reshape({2}));
  ASSERT_TRUE(driver.facade().completeBatchCompaction({0, -1}));
  driver.compactView({0, -1});
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestDispatchTest,
       AFoundersChunkOnBoundedSwaHoldsItAndMisuseChangesNothing) {
  // Bounded SWA stages a founder's first chunk in place of its whole prompt (preparePrefillChunk
  // in the prefill); completePrefill then holds the founder as an unfinalised joiner. The window
  // through the chunks is checked by BoundedSwaJoinerTest and ReplayRunnerTest (KV oracle).
  RuntimeRig rig(configFor(Backend::kBoundedSwa, device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.preparePrefill());
  ManagedKVCacheRequest& facade = driver.facade();
  expectRejected(
      rig, "completePrefillChunk of a chunk never prepared",
      [&] { (void)facade.completePrefillChunk(0, 20); },
      {"ManagedKVCacheRequest::completePrefillChunk", "row 0", "a chunk to 20", "ends at 40"});
  ASSERT_TRUE(facade.preparePrefillChunk(0, 20));
  expectRejected(rig, "completePrefill before the founder's chunk completed",
                 [&] { (void)driver.completePrefill(); },
                 {"ManagedKVCacheRequest::completePrefill", "row 0",
                  "first chunk to 20 was prepared", "but not completed"});
  ASSERT_TRUE(facade.completePrefillChunk(0, 20));
  expectRejected(rig, "a second chunk in the prefill",
                 [&] { (void)facade.preparePrefillChunk(0, 30); },
                 {"ManagedKVCacheRequest::preparePrefillChunk",
                  "first chunk (to 20) completed in this prefill"});
  driver.context.generatedTokenIds[0] = {7};
  expectRejected(rig, "a held founder that sampled", [&] { (void)driver.completePrefill(); },
                 {"ManagedKVCacheRequest::completePrefill", "row 0",
                  "samples nothing yet, got 1 generated tokens"});
  driver.context.generatedTokenIds[0].clear();
  ASSERT_TRUE(driver.completePrefill());
  expectRejected(rig, "preempting the held founder", [&] { (void)facade.preemptSequence(0); },
                 {"ManagedKVCacheRequest::preemptSequence", "row 0 is an unfinalised"});
  expectRejected(rig, "finalising it with another prompt length",
                 [&] { (void)facade.finalizeSequenceAdmission(0, 7, 39); },
                 {"ManagedKVCacheRequest::finalizeSequenceAdmission", "fullInputLength 39"});
  EXPECT_EQ(facade.prefillChunkDemand(0, 40), DecodeStepDemand{});
  ASSERT_TRUE(facade.preparePrefillChunk(0, 30));  // its next chunk, as a joiner's
  EXPECT_TRUE(driver.finish());
  EXPECT_FALSE(rig.poisoned());
  EXPECT_EQ(rig.activeRequests(), 0);
}

TEST_P(ManagedKVCacheRequestDispatchTest, TheJoinCallsThrowBeforeTheyChangeAnything) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  expectRejected(rig, "enqueuePrefillCaptures before preparePrefill",
                 [&] { (void)driver.facade().enqueuePrefillCaptures(); },
                 {"ManagedKVCacheRequest::enqueuePrefillCaptures", "between preparePrefill"});
  ASSERT_TRUE(driver.prefill());
  expectNoOp(
      rig, "retracting the only row", [&] { return driver.facade().retractSequenceAdmission(); },
      false);
  ASSERT_EQ(driver.admit(tokenRun(20, 700)), AdmitSequenceStatus::kAdmitted);
  expectRejected(rig, "completePrefillChunk of a founder",
                 [&] { (void)driver.facade().completePrefillChunk(0, 40); },
                 {"ManagedKVCacheRequest::completePrefillChunk",
                  "row 0 is not an unfinalised in-flight admission"});
  expectRejected(rig, "completePrefillChunk beyond the joiner's prompt",
                 [&] { (void)driver.facade().completePrefillChunk(1, 21); },
                 {"ManagedKVCacheRequest::completePrefillChunk",
                  "row 1: 21 prefilled tokens outside [0 (done so far), 20 (the prompt)]"});
  int32_t const lookahead = 4242;
  expectRejected(rig, "finalizeSequenceAdmission of a founder",
                 [&] { (void)driver.facade().finalizeSequenceAdmission(0, lookahead, 40); },
                 {"ManagedKVCacheRequest::finalizeSequenceAdmission",
                  "row 0 is not an unfinalised in-flight admission"});
  expectRejected(rig, "finalizeSequenceAdmission with the wrong prompt length",
                 [&] { (void)driver.facade().finalizeSequenceAdmission(1, lookahead, 19); },
                 {"ManagedKVCacheRequest::finalizeSequenceAdmission", "commits the 20 prompt"});
  expectRejected(rig, "finalizeSequenceAdmission beyond the batch",
                 [&] { (void)driver.facade().finalizeSequenceAdmission(2, lookahead, 20); },
                 {"ManagedKVCacheRequest::finalizeSequenceAdmission"});
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.prepareDecode());
  expectNoOp(
      rig, "retracting during a decode step",
      [&] { return driver.facade().retractSequenceAdmission(); }, false);
  ASSERT_TRUE(driver.completeDecode());
  driver.verify();
  EXPECT_TRUE(driver.finish());
  EXPECT_FALSE(rig.poisoned());
}

// ---------------------------------------------------------------- sizes

// The seed declares the retraction noexcept: an engine calls it while unwinding a failed join.
static_assert(noexcept(std::declval<ManagedKVCacheRequest&>().retractSequenceAdmission()));

TEST_P(ManagedKVCacheRequestTest, ARetractionWithNothingToUndoReturnsFalseAndChangesNothing) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(33, 9));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  auto retract = [&] { return driver.facade().retractSequenceAdmission(); };
  expectNoOp(rig, "retracting a founder", retract, false);
  if (reuse()) {  // bounded SWA admits nothing in flight
    ASSERT_EQ(driver.admit(tokenRun(20, 700)), AdmitStatus::kAdmitted);
    ASSERT_TRUE(driver.prepareDecode());
    expectNoOp(rig, "retracting during a decode step", retract, false);
    ASSERT_TRUE(driver.completeDecode());
    ASSERT_TRUE(driver.seatNewest());
    expectNoOp(rig, "retracting a seated joiner", retract, false);
  }
  ASSERT_TRUE(driver.decode());
  driver.verify();
  EXPECT_TRUE(driver.finish());
  expectNoOp(rig, "retracting after finish", retract, false);
  EXPECT_FALSE(rig.poisoned());
  EXPECT_EQ(rig.activeRequests(), 0);
}

TEST_P(ManagedKVCacheRequestTest, AMovedFromFacadeRefusesEveryCallAndItsRequestRunsOn) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  ManagedKVCacheRequest owner(std::move(*driver.managed));
  ManagedKVCacheRequest& from = *driver.managed;
  // The noexcept calls answer as if nothing were held; the others throw naming the call.
  EXPECT_FALSE(from.hasContextReuse());
  EXPECT_EQ(from.prefillStarts(), nullptr);
  EXPECT_EQ(from.lastFailure(), RowFailure{});
  EXPECT_FALSE(from.retractSequenceAdmission());
  expectRejected(rig, "preparePrefill", [&] { (void)from.preparePrefill(); },
                 {"ManagedKVCacheRequest::preparePrefill", "moved from"});
  expectRejected(rig, "finish", [&] { (void)from.finish(); },
                 {"ManagedKVCacheRequest::finish", "moved from"});
  // The request itself runs on in the facade it moved to.
  EXPECT_EQ(owner.hasContextReuse(), reuse());
  driver.managed.emplace(std::move(owner));
  ASSERT_TRUE(driver.prefill());
  driver.verify();
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestTest, AMoveAssignmentAbandonsTheHeldRequestAndTakesTheOther) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver abandoned(rig);
  abandoned.add(tokenRun(40, 5));
  ASSERT_TRUE(abandoned.begin());
  ASSERT_TRUE(abandoned.prefill());
  FacadeDriver driver(rig);
  driver.add(tokenRun(33, 9));
  ASSERT_TRUE(driver.begin());
  ASSERT_EQ(rig.activeRequests(), 2);
  int32_t const heldByBoth = rig.heldPages();
  // The slot that held the first request takes the second: the first is abandoned.
  *abandoned.managed = std::move(*driver.managed);
  EXPECT_EQ(rig.activeRequests(), 1);
  EXPECT_LT(rig.heldPages(), heldByBoth);
  expectRejected(rig, "finish", [&] { (void)driver.facade().finish(); },
                 {"ManagedKVCacheRequest::finish", "moved from"});
  // The moved request runs on in its new facade.
  driver.managed.emplace(std::move(*abandoned.managed));
  abandoned.managed.reset();
  ASSERT_TRUE(driver.prefill());
  driver.verify();
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestTest, SizesThatDisagreeWithTheBatchThrowAndChangeNothing) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(23, 300));
  driver.add(tokenRun(37, 600));
  ASSERT_TRUE(driver.begin());
  ManagedKVCacheRequest& facade = driver.facade();
  DecodingInferenceContext& context = driver.context;
  if (!reuse()) {
    expectRejected(rig, "two SWA prefill lengths for three rows",
                   [&] {
                     (void)facade.prepareSwaPrefill({40, 23});
                   },
                   {"ManagedKVCacheRequest::prepareSwaPrefill", "2 lengths for a batch of 3"});
    expectRejected(rig, "an empty SWA prefill",
                   [&] {
                     (void)facade.prepareSwaPrefill({40, 0, 37});
                   },
                   {"ManagedKVCacheRequest::prepareSwaPrefill", "length 0 of row 1"});
    expectRejected(
        rig, "a prefill longer than a row",
        [&] {
          (void)facade.prepareSwaPrefill({40, 257, 37});
        },
        {"ManagedKVCacheRequest::prepareSwaPrefill", "length 257 of row 1 outside (0, 256]"});
  }
  ASSERT_TRUE(driver.preparePrefill());
  driver.executePrefill();
  // The runtime's view with one row too many, then one too few.
  auto withRows = [&](std::size_t rows, auto call) {
    return [&, rows, call] {
      DecodingInferenceContext const saved = context;
      context.generatedTokenIds.resize(rows);
      context.rawBatchedInputIds.resize(rows);
      context.finishReasons.resize(rows);
      try {
        call();
      } catch (...) {
        context = saved;
        throw;
      }
      context = saved;
    };
  };
  for (std::size_t rows : {std::size_t{2}, std::size_t{4}}) {
    expectRejected(
        rig, "completePrefill", withRows(rows, [&] { (void)facade.completePrefill(context, {}); }),
        {pick("ManagedKVCacheRequest::completePrefill", "ManagedKVCacheRequest::completePrefill"),
         "for a batch of 3"});
  }
  ASSERT_TRUE(driver.completePrefill());
  expectRejected(
      rig, "prepareDecodeStep for two rows",
      withRows(2, [&] { (void)facade.prepareDecodeStep(context, kVanilla); }),
      {pick("ManagedKVCacheRequest::prepareDecodeStep", "ManagedKVCacheRequest::prepareDecodeStep"),
       "for a batch of 3"});
  ASSERT_TRUE(driver.prepareDecode());
  expectRejected(rig, "completeDecodeStep for four rows",
                 withRows(4, [&] { (void)facade.completeDecodeStep(context, {}); }),
                 {pick("ManagedKVCacheRequest::completeDecodeStep",
                       "ManagedKVCacheRequest::completeDecodeStep"),
                  pick("the batch changed size", "for a batch of 3")});
  driver.finishRow(1);
  ASSERT_TRUE(driver.completeDecode());

  Tensor floatMapping({4}, DataType::kFloat32, device());
  struct BadMapping {
    std::vector<int32_t> oldToNew;
    int32_t newSize;
    std::string_view fragment;  ///< both backends word it alike
  };
  BadMapping const badMappings[] = {
      {{0, 1}, 2, "mapping has 2 entries for a batch of 3"},
      {{0, -1, 1}, 3, "2 survivors for a new batch of 3"},
      {{1, -1, 0}, 2, "oldToNew[0] = 1, expected 0"},  // survivors out of order
      {{0, -1, 2}, 2, "oldToNew[2] = 2 outside [-1, 2)"},
      {{0, -2, 1}, 2, "oldToNew[1] = -2 outside [-1, 2)"},
  };
  for (BadMapping const& bad : badMappings) {
    expectRejected(
        rig, "beginBatchCompaction",
        [&] { (void)facade.beginBatchCompaction(bad.oldToNew, bad.newSize, driver.deviceMapping); },
        {pick("ManagedKVCacheRequest::beginBatchCompaction",
              "ManagedKVCacheRequest::beginBatchCompaction"),
         bad.fragment});
  }
  expectRejected(rig, "a float mapping tensor",
                 [&] {
                   (void)facade.beginBatchCompaction({0, -1, 1}, 2, floatMapping);
                 },
                 {"int32"});
  ASSERT_TRUE(facade.beginBatchCompaction({0, -1, 1}, 2, driver.deviceMapping));
  expectRejected(rig, "completeBatchCompaction with another mapping",
                 [&] {
                   (void)facade.completeBatchCompaction({0, 1, -1});
                 },
                 {pick("ManagedKVCacheRequest::completeBatchCompaction",
                       "ManagedKVCacheRequest::completeBatchCompaction"),
                  "differs from the"});
  ASSERT_TRUE(facade.completeBatchCompaction({0, -1, 1}));
  if (reuse()) {
    expectRejected(rig, "reuseTokenLength beyond the batch",
                   [&] { (void)facade.reuseTokenLength(2); },
                   {"ManagedKVCacheRequest::reuseTokenLength", "row 2 outside the batch of 2"});
  }
  driver.compactView({0, -1, 1});  // the survivors carry on
  driver.verify();
  finishCleanly(rig, driver);
}

// ---------------------------------------------------------------- dispatch per backend

TEST_P(ManagedKVCacheRequestDispatchTest, ContextReuseBackend) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  EXPECT_TRUE(rig.runtime().supportsSeatedAdmission());
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(23, 300));
  ASSERT_TRUE(driver.begin());
  ManagedKVCacheRequest& facade = driver.facade();
  EXPECT_TRUE(facade.hasContextReuse());
  ASSERT_NE(facade.prefillStarts(), nullptr);
  EXPECT_EQ(*facade.prefillStarts(), (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(facade.reuseTokenLength(1), 0);
  Tensor hidden({4, 8}, DataType::kFloat16, device());
  expectRejected(rig, "publishHybridMtpEndpoint",
                 [&] { (void)facade.publishHybridMtpEndpoint(0, 40, hidden, 0); },
                 {"publishHybridMtpEndpoint", "not Hybrid-MTP"});
  expectRejected(rig, "restoreHybridMtpBoundaryHidden",
                 [&] { (void)facade.restoreHybridMtpBoundaryHidden(0, hidden, 0); },
                 {"restoreHybridMtpBoundaryHidden", "not Hybrid-MTP"});
  ASSERT_TRUE(facade.preparePrefill());
  // The SWA-only call is a no-op here, whatever the lengths.
  expectNoOp(
      rig, "prepareSwaPrefill", [&] { return facade.prepareSwaPrefill({}); }, true);
  expectNoOp(
      rig, "prepareSwaPrefill, bad lengths", [&] { return facade.prepareSwaPrefill({-5}); }, true);
  // Attention only: nothing to capture.
  expectNoOp(
      rig, "enqueuePrefillCaptures", [&] { return facade.enqueuePrefillCaptures(); }, true);
  driver.executePrefill();
  ASSERT_TRUE(driver.completePrefill());
  driver.verify();
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestDispatchTest, RetentionRangesReachTheRecordsAndInvalidOnesThrow) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.request.contextCacheRetention = {RetentionRange{0, std::nullopt, 101, std::nullopt}};
  expectRejected(rig, "begin with priority 101", [&] { (void)driver.begin(); },
                 {"ManagedKVCacheRequest::begin", "priority 101 outside [0, 100]"});
  driver.request.contextCacheRetention = {RetentionRange{0, 32, 90, std::nullopt}};
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  // The prompt's two full blocks end at token 31, inside the range.
  auto const& records = rig.runtime().contextCache()->manager().records().lruToMru();
  ASSERT_EQ(records.size(), 1U);
  EXPECT_EQ(records.front().retentionPriority, 90);
  for (int step = 0; step < 8; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  ASSERT_TRUE(driver.prepareDecode());
  driver.finishRow(0);
  ASSERT_TRUE(driver.completeDecode());
  EXPECT_TRUE(driver.finish());
  // Prompt + generated tokens: three full blocks, the last token (47) outside the range.
  ASSERT_EQ(records.size(), 2U);
  EXPECT_EQ(records.back().key.fullBlockCount, 3);
  EXPECT_EQ(records.back().retentionPriority, kDefaultRetentionPriority);
}

// ---------------------------------------------------------------- joiners of their own

/// A joiner's request with one sequence and the given salt and adapter (defaults elsewhere).
LLMGenerationRequest joinerRequest(std::string salt, std::string lora = {}) {
  LLMGenerationRequest joiner;
  joiner.requests.resize(1);
  joiner.cacheSalt = std::move(salt);
  joiner.loraWeightsName = std::move(lora);
  return joiner;
}

/// A request of one prompt under `salt` and `lora` reuses `expected` tokens, then runs its prefill
/// cleanly (what it reused holds the KV its own identity's writer wrote).
void expectLaterReuse(RuntimeRig& rig, std::vector<int32_t> const& prompt, std::string salt,
                      std::string lora, int32_t expected) {
  SCOPED_TRACE(fmt::format("a later request of salt '{}', LoRA '{}'", salt, lora));
  FacadeDriver later(rig);
  later.request.cacheSalt = std::move(salt);
  later.request.loraWeightsName = lora;
  later.context.loraWeightsName = std::move(lora);
  later.add(prompt);
  ASSERT_TRUE(later.begin());
  EXPECT_EQ(later.facade().reuseTokenLength(0), expected);
  ASSERT_TRUE(later.prefill());
  later.verify();
  EXPECT_TRUE(later.finish());
}

TEST_P(ManagedKVCacheRequestDispatchTest, JoinersOfTwoSaltsShareNoBlocksAndEachSaltReusesItsOwn) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  std::vector<int32_t> const shared = tokenRun(40, 900);  // two full blocks of 16
  {
    FacadeDriver driver(rig);
    driver.request.cacheSalt = "founder";
    driver.add(tokenRun(40, 5));
    ASSERT_TRUE(driver.begin());
    ASSERT_TRUE(driver.prefill());
    LLMGenerationRequest const tenantA = joinerRequest("tenant-a");
    LLMGenerationRequest const tenantB = joinerRequest("tenant-b");
    ASSERT_EQ(driver.admit(shared, &tenantA), AdmitSequenceStatus::kAdmitted);
    EXPECT_EQ(driver.rows.back().prefillStart, 0);
    ASSERT_TRUE(driver.seatNewest());  // publishes tenant A's prompt blocks
    ASSERT_EQ(driver.admit(shared, &tenantB), AdmitSequenceStatus::kAdmitted);
    EXPECT_EQ(driver.rows.back().prefillStart, 0);  // A's blocks are not B's
    ASSERT_TRUE(driver.seatNewest());
    ASSERT_EQ(driver.admit(shared, &tenantA), AdmitSequenceStatus::kAdmitted);
    EXPECT_EQ(driver.rows.back().prefillStart, 32);  // A's own
    ASSERT_TRUE(driver.seatNewest());
    driver.verify();
    finishCleanly(rig, driver);
  }
  expectLaterReuse(rig, shared, "tenant-a", "", 32);
  expectLaterReuse(rig, shared, "founder", "", 0);
}

TEST_P(ManagedKVCacheRequestDispatchTest, EachJoinerKeysItsBlocksWithItsOwnAdapter) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  std::vector<int32_t> const shared = tokenRun(40, 900);
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  LLMGenerationRequest const adapterA = joinerRequest("", "adapter-a");
  LLMGenerationRequest const adapterB = joinerRequest("", "adapter-b");
  ASSERT_EQ(driver.admit(shared, &adapterA), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_EQ(driver.admit(shared, &adapterB), AdmitSequenceStatus::kAdmitted);
  EXPECT_EQ(driver.rows.back().prefillStart, 0);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_EQ(driver.admit(shared, &adapterA), AdmitSequenceStatus::kAdmitted);
  EXPECT_EQ(driver.rows.back().prefillStart, 32);
  ASSERT_TRUE(driver.seatNewest());
  driver.verify();
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestDispatchTest, EachJoinerPublishesUnderItsOwnCommitPolicy) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  LLMGenerationRequest promptOnly = joinerRequest("tenant");
  promptOnly.contextCacheCommitPolicy = ContextCacheCommitPolicy::kPrefillStateOnly;
  LLMGenerationRequest const everything = joinerRequest("tenant");
  ASSERT_EQ(driver.admit(tokenRun(40, 2000), &promptOnly), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_EQ(driver.admit(tokenRun(40, 3000), &everything), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  for (int step = 0; step < 8; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  // Both joiners finish in the same step, 49 tokens committed each (three full blocks).
  ASSERT_TRUE(driver.prepareDecode());
  driver.finishRow(1);
  driver.finishRow(2);
  ASSERT_TRUE(driver.completeDecode());
  std::vector<std::vector<int32_t>> continued;
  for (std::size_t row : {1U, 2U}) {
    continued.push_back(driver.rows[row].prompt);
    continued.back().insert(continued.back().end(), driver.generated(row).begin(),
                            driver.generated(row).end());
  }
  ASSERT_TRUE(driver.compact({0, -1, -1}));
  driver.verify();
  finishCleanly(rig, driver);
  expectLaterReuse(rig, continued[0], "tenant", "", 32);  // its prompt only
  expectLaterReuse(rig, continued[1], "tenant", "", 48);  // prompt and generated tokens
}

TEST_P(ManagedKVCacheRequestDispatchTest, EachJoinersRetentionReachesItsRecords) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  auto const& records = rig.runtime().contextCache()->manager().records().lruToMru();
  FacadeDriver driver(rig);
  driver.request.contextCacheRetention = {RetentionRange{0, std::nullopt, 90, std::nullopt}};
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_EQ(records.size(), 1U);
  EXPECT_EQ(records.back().retentionPriority, 90);
  LLMGenerationRequest kept = joinerRequest("");
  kept.contextCacheRetention = {RetentionRange{0, std::nullopt, 77, std::nullopt}};
  ASSERT_EQ(driver.admit(tokenRun(40, 2000), &kept), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_EQ(records.size(), 2U);
  EXPECT_EQ(records.back().retentionPriority, 77);
  LLMGenerationRequest const plain = joinerRequest("");
  ASSERT_EQ(driver.admit(tokenRun(40, 3000), &plain), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_EQ(records.size(), 3U);
  EXPECT_EQ(records.back().retentionPriority, kDefaultRetentionPriority);  // none of its own
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestDispatchTest, TheSeedsOverloadStillInheritsTheFoundersIdentity) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  auto const& records = rig.runtime().contextCache()->manager().records().lruToMru();
  std::vector<int32_t> const joinerPrompt = tokenRun(40, 2000);
  std::vector<int32_t> continued;
  {
    FacadeDriver driver(rig);
    driver.request.cacheSalt = "founder";
    driver.request.contextCacheRetention = {RetentionRange{0, std::nullopt, 90, std::nullopt}};
    driver.request.contextCacheCommitPolicy = ContextCacheCommitPolicy::kPrefillStateOnly;
    driver.add(tokenRun(40, 5));
    ASSERT_TRUE(driver.begin());
    ASSERT_TRUE(driver.prefill());
    ASSERT_EQ(driver.admit(joinerPrompt), AdmitSequenceStatus::kAdmitted);
    ASSERT_TRUE(driver.seatNewest());
    EXPECT_EQ(records.back().retentionPriority, 90);  // the founder's retention
    for (int step = 0; step < 8; ++step) {
      ASSERT_TRUE(driver.decode());
    }
    ASSERT_TRUE(driver.prepareDecode());
    driver.finishRow(1);
    ASSERT_TRUE(driver.completeDecode());
    continued = joinerPrompt;
    continued.insert(continued.end(), driver.generated(1).begin(), driver.generated(1).end());
    ASSERT_TRUE(driver.compact({0, -1}));
    finishCleanly(rig, driver);
  }
  expectLaterReuse(rig, continued, "founder", "", 32);  // the founder's salt, its prompt only
  expectLaterReuse(rig, joinerPrompt, "", "", 0);
}

TEST_P(ManagedKVCacheRequestTest, TheJoinerOverloadRefusesAMalformedJoinerAndChangesNothing) {
  RuntimeRig rig(configFor(backend(), device()));
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  struct Case {
    char const* what;
    LLMGenerationRequest joiner;
    std::string_view fragment;
  };
  std::vector<Case> cases;
  cases.push_back({"no sequence", joinerRequest("t"), "exactly one sequence, got 0"});
  cases.back().joiner.requests.clear();
  cases.push_back({"two sequences", joinerRequest("t"), "exactly one sequence, got 2"});
  cases.back().joiner.requests.resize(2);
  cases.push_back({"a replay tail", joinerRequest("t"), "no replay tail"});
  cases.back().joiner.contextCacheReplayTailLength = 4;
  cases.push_back({"a commit policy out of range", joinerRequest("t"), "commit policy 7"});
  cases.back().joiner.contextCacheCommitPolicy = static_cast<ContextCacheCommitPolicy>(7);
  cases.push_back({"a lookup policy out of range", joinerRequest("t"), "lookup policy 5"});
  cases.back().joiner.contextCacheLookupPolicy = static_cast<ContextCacheLookupPolicy>(5);
  cases.push_back(
      {"a sequence's lookup policy out of range", joinerRequest("t"), "lookup policy 6"});
  cases.back().joiner.requests[0].contextCacheLookupPolicy =
      static_cast<ContextCacheLookupPolicy>(6);
  // Bounded SWA caches nothing: the retention would rank no record, and is not read there.
  if (reuse()) {
    cases.push_back({"priority 101", joinerRequest("t"), "priority 101 outside [0, 100]"});
    cases.back().joiner.contextCacheRetention = {
        RetentionRange{0, std::nullopt, 101, std::nullopt}};
    cases.push_back({"overlapping ranges", joinerRequest("t"), "ascending and disjoint"});
    cases.back().joiner.contextCacheRetention = {RetentionRange{0, 32, 60, std::nullopt},
                                                 RetentionRange{16, 48, 70, std::nullopt}};
  }
  for (Case const& c : cases) {
    expectRejected(rig, c.what, [&] { (void)driver.admit(tokenRun(20, 700), &c.joiner); },
                   {"ManagedKVCacheRequest::admitSequence", c.fragment});
  }
  // The request carries on, and a well-formed joiner of its own still joins.
  LLMGenerationRequest const joiner = joinerRequest("tenant", driver.context.loraWeightsName);
  ASSERT_EQ(driver.admit(tokenRun(20, 700), &joiner), AdmitSequenceStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  driver.verify();
  finishCleanly(rig, driver);
}

TEST_P(ManagedKVCacheRequestDispatchTest, BoundedSwaBackend) {
  RuntimeRig rig(configFor(Backend::kBoundedSwa, device()));
  EXPECT_TRUE(rig.runtime().supportsSeatedAdmission());
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 5));
  driver.add(tokenRun(23, 300));
  ASSERT_TRUE(driver.begin());
  ManagedKVCacheRequest& facade = driver.facade();
  EXPECT_FALSE(facade.hasContextReuse());
  EXPECT_EQ(facade.prefillStarts(), nullptr);
  expectRejected(rig, "reuseTokenLength", [&] { (void)facade.reuseTokenLength(0); },
                 {"ManagedKVCacheRequest::reuseTokenLength", "row 0", "no context reuse"});
  Tensor hidden({4, 8}, DataType::kFloat16, device());
  expectRejected(rig, "publishHybridMtpEndpoint",
                 [&] { (void)facade.publishHybridMtpEndpoint(1, 23, hidden, 0); },
                 {"ManagedKVCacheRequest::publishHybridMtpEndpoint", "row 1", "no context reuse"});
  expectRejected(rig, "restoreHybridMtpBoundaryHidden",
                 [&] { (void)facade.restoreHybridMtpBoundaryHidden(0, hidden, 2); },
                 {"ManagedKVCacheRequest::restoreHybridMtpBoundaryHidden", "no context reuse"});
  // The context-reuse calls of the prefill are no-ops: nothing is mapped until prepareSwaPrefill.
  expectNoOp(
      rig, "preparePrefill", [&] { return facade.preparePrefill(); }, true);
  ASSERT_TRUE(facade.prepareSwaPrefill(driver.context.effectivePrefillLengths));
  expectNoOp(
      rig, "enqueuePrefillCaptures", [&] { return facade.enqueuePrefillCaptures(); }, true);
  driver.executePrefill();
  ASSERT_TRUE(driver.completePrefill());
  // In-flight admission: nothing is cached, so a joiner prefills from 0 in its own 2M + 1
  // pages; misuse throws naming the facade's call and changes nothing.
  // A stream that is not the request's (never used: the admission refuses it).
  auto* const foreign = reinterpret_cast<cudaStream_t>(  // NOLINT(performance-no-int-to-ptr)
      uintptr_t{0x1234});
  expectRejected(rig, "admitSequence on another stream",
                 [&] {
                   int32_t start = -1;
                   (void)facade.admitSequence(tokenRun(10, 1), {}, kVanilla, start,
                                              driver.rows[0].resident, foreign);
                 },
                 {"ManagedKVCacheRequest::admitSequence", "stream differs"});
  int32_t const freeBefore = rig.freePages();
  ASSERT_EQ(driver.admit(tokenRun(30, 900)), AdmitStatus::kAdmitted);
  EXPECT_EQ(driver.rows.back().prefillStart, 0);
  EXPECT_EQ(rig.freePages(),
            freeBefore - rig.runtime().swaPageManager()->privatePagesPerSequence());
  int32_t const lookahead = driver.generated(0).back();
  expectRejected(rig, "preemptSequence of a joiner", [&] { (void)facade.preemptSequence(2); },
                 {"ManagedKVCacheRequest::preemptSequence", "row 2 is an unfinalised"});
  expectRejected(rig, "preparePrefillChunk past the prompt",
                 [&] { (void)facade.preparePrefillChunk(2, 31); },
                 {"ManagedKVCacheRequest::preparePrefillChunk", "chunk end 31 outside"});
  expectRejected(rig, "completePrefillChunk of an unprepared chunk",
                 [&] { (void)facade.completePrefillChunk(2, 20); },
                 {"ManagedKVCacheRequest::completePrefillChunk", "a chunk to 20"});
  expectRejected(rig, "finalizeSequenceAdmission of a founder",
                 [&] { (void)facade.finalizeSequenceAdmission(0, lookahead, 40); },
                 {"ManagedKVCacheRequest::finalizeSequenceAdmission", "row 0 is not"});
  expectRejected(rig, "finalizeSequenceAdmission with another length",
                 [&] { (void)facade.finalizeSequenceAdmission(2, lookahead, 29); },
                 {"ManagedKVCacheRequest::finalizeSequenceAdmission", "fullInputLength 29"});
  ASSERT_TRUE(facade.preparePrefillChunk(2, 20));
  ASSERT_TRUE(driver.retractNewest());
  EXPECT_EQ(rig.freePages(), freeBefore);
  ASSERT_EQ(driver.admit(tokenRun(30, 900)), AdmitStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  expectNoOp(
      rig, "preemptSequence (nothing to publish)", [&] { return facade.preemptSequence(0); }, true);
  expectNoOp(
      rig, "retractSequenceAdmission (nothing to undo)",
      [&] { return facade.retractSequenceAdmission(); }, false);
  ASSERT_TRUE(driver.prepareDecode());  // prepared and executed, not completed
  expectRejected(rig, "preemptSequence during a step", [&] { (void)facade.preemptSequence(0); },
                 {"ManagedKVCacheRequest::preemptSequence", "between steps"});
  ASSERT_TRUE(driver.completeDecode());
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  driver.verify();
  finishCleanly(rig, driver);
}

}  // namespace
}  // namespace mkv::runtime_test
