/// BoundedSwaKVPageManager without a page source: in-flight admission and chunked prefill
/// (docs/architecture.md, "Bounded SWA"). A joiner takes 2M + 1 pages and prefills from 0; the
/// window of a chunked prefill rotates from chunk to chunk within those pages, every chunk reads
/// the window its predecessor kept (checked with the KV oracle through the table's rows), and
/// every contract violation changes nothing. A founder's prefill chunks the same way: its first
/// chunk runs in the prefill step, and it holds as a joiner until its last.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "swa/swa_test_rig.h"

namespace mkv::swa_test {
namespace {

class BoundedSwaJoinerTest : public DeviceTest {
 protected:
  // W = 300, P = 64: M = ceil(300 / 64) + 1 = 6, a sequence's admission 13 pages, decode 7.
  static constexpr int32_t kWindow = 300;
  static constexpr int32_t kPage = 64;

  RigConfig joinerConfig(int32_t maxBatch = 3) const {
    RigConfig config = rigConfig();
    config.window = kWindow;
    config.pageSize = kPage;
    config.maxBatch = maxBatch;
    config.maxPagesPerSeq = 64;
    return config;
  }

  /// A founder on slot 0 that prefilled `length` tokens and decodes.
  static Handle founder(SwaRig& rig, EngineSequence& sequence, int32_t length) {
    Handle handle = admit(rig, {0});
    rig.manager().preparePrefill(handle, std::vector<int32_t>{length});
    sequence.prefill(rig.oracle(), length, kWindow);
    rig.manager().completePrefill(handle);
    return handle;
  }

  /// Both rows decode `steps` steps; then each one's window reads back whole (KV oracle), and the
  /// request finishes with every page free.
  static void decodeVerifyAndFinish(SwaRig& rig, Handle& handle, EngineSequence& first,
                                    EngineSequence& second, int32_t steps) {
    BoundedSwaKVPageManager& manager = rig.manager();
    for (int32_t step = 0; step < steps; ++step) {
      ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk) << "step " << step;
      first.decode(rig.oracle());
      second.decode(rig.oracle());
      manager.completeDecodeStep(handle);
    }
    for (EngineSequence* sequence : {&first, &second}) {
      testing::OracleReport const report = sequence->verifyWindow(rig.oracle(), kWindow);
      EXPECT_TRUE(report.ok()) << report.firstMismatch;
      EXPECT_EQ(report.positionsChecked, kWindow);
    }
    EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
    EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
  }

  static void expectRowMirrorsBindings(SwaRig& rig, SwaSequenceState const& state) {
    EXPECT_EQ(hostRow(rig.table(), state.resident.slot), expectedRow(rig.table(), state.bindings));
    EXPECT_EQ(deviceRow(rig.table(), state.resident.slot),
              expectedRow(rig.table(), state.bindings));
  }

  /// The logical pages a row maps, ascending.
  static std::vector<int32_t> logicalPages(SwaSequenceState const& state) {
    std::vector<int32_t> pages;
    for (SwaPageBinding const& binding : state.bindings) {
      pages.push_back(binding.logicalPage);
    }
    return pages;
  }

  /// Pages covering [begin, end) tokens, ascending.
  static std::vector<int32_t> covering(int32_t begin, int32_t end) {
    std::vector<int32_t> pages;
    for (int32_t page = begin / kPage; page < retainedEnd(end, kPage); ++page) {
      pages.push_back(page);
    }
    return pages;
  }

  /// What the staged chunk [from, to) maps: the window before `from`, then the pages of
  /// [max(from, to - W), to).
  static std::vector<int32_t> chunkPages(int32_t from, int32_t to) {
    std::vector<int32_t> pages =
        from > 0 ? covering(std::max(0, from - kWindow), from) : std::vector<int32_t>{};
    for (int32_t page : covering(std::max(from, to - kWindow), to)) {
      if (pages.empty() || page > pages.back()) {
        pages.push_back(page);
      }
    }
    return pages;
  }
};

TEST_P(BoundedSwaJoinerTest, AJoinerTakesAnAdmissionBudgetAndMapsItsWholePromptsWindow) {
  SwaRig rig(joinerConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  EngineSequence first(0, 11);
  Handle handle = founder(rig, first, 500);
  int32_t const freeBefore = manager.freePageCount();
  ResidentRef const joiner = residentsFor({1}).front();

  ASSERT_EQ(manager.admitSequence(handle, joiner, {1000, 0, {}}), SwaKVCacheStatus::kOk);
  ASSERT_EQ(manager.batchSize(handle), 2);
  SwaSequenceState const& state = manager.state(handle, 1);
  EXPECT_TRUE(state.joining);
  EXPECT_EQ(state.joinerPromptTokens, 1000);
  EXPECT_EQ(state.endpoint, 0);
  EXPECT_EQ(state.pendingEndpoint, 1000);
  EXPECT_EQ(state.heldPages(), 13);
  EXPECT_EQ(logicalPages(state), covering(700, 1000));  // [10, 16): the window of 1000
  EXPECT_EQ(manager.freePageCount(), freeBefore - 13);
  expectRowMirrorsBindings(rig, state);
  expectPagesAccountedFor(manager, {&handle});

  // The founder decodes while the joiner's prefill is staged; the joiner holds.
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
  first.decode(rig.oracle());
  manager.completeDecodeStep(handle);
  EXPECT_EQ(state.pendingEndpoint, 1000);
  EXPECT_EQ(state.endpoint, 0);

  EngineSequence second(1, 22);
  second.prefill(rig.oracle(), 1000, kWindow);
  manager.finalizeSequenceAdmission(handle, 1);
  EXPECT_FALSE(state.joining);
  EXPECT_EQ(state.joinerPromptTokens, 0);
  EXPECT_EQ(state.endpoint, 1000);
  EXPECT_EQ(state.heldPages(), manager.decodePagesPerSequence());
  EXPECT_EQ(manager.freePageCount(), freeBefore - manager.decodePagesPerSequence());
  expectPagesAccountedFor(manager, {&handle});
  for (int32_t step = 0; step < 150; ++step) {
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk) << "step " << step;
    first.decode(rig.oracle());
    second.decode(rig.oracle());
    manager.completeDecodeStep(handle);
    EXPECT_LE(state.heldPages(), manager.decodePagesPerSequence());
  }
  expectRowMirrorsBindings(rig, state);
  EXPECT_TRUE(first.verifyWindow(rig.oracle(), kWindow).ok());
  testing::OracleReport const report = second.verifyWindow(rig.oracle(), kWindow);
  EXPECT_TRUE(report.ok()) << report.firstMismatch;
  EXPECT_EQ(report.positionsChecked, kWindow);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
}

TEST_P(BoundedSwaJoinerTest, AChunkedPrefillRotatesItsWindowWithinTheAdmissionBudget) {
  SwaRig rig(joinerConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  EngineSequence first(0, 5);
  Handle handle = founder(rig, first, 200);
  int32_t const freeBefore = manager.freePageCount();
  ASSERT_EQ(manager.admitSequence(handle, residentsFor({2}).front(), {2000, 0, {}}),
            SwaKVCacheStatus::kOk);
  SwaSequenceState const& state = manager.state(handle, 1);
  EngineSequence joiner(2, 77);
  // Chunks shorter than the window, a chunk inside one page, one longer than the window, the
  // rest in one go (staged without a prepare call).
  std::vector<int32_t> const ends{100, 250, 260, 700, 1500, 2000};
  int32_t from = 0;
  for (int32_t const end : ends) {
    SCOPED_TRACE(::testing::Message() << "chunk [" << from << ", " << end << ")");
    if (end < 2000) {
      manager.prepareSequenceChunk(handle, 1, end);
    }
    EXPECT_EQ(state.pendingEndpoint, end);
    EXPECT_EQ(logicalPages(state), chunkPages(from, end));
    EXPECT_EQ(state.heldPages(), 13) << "the joiner keeps its admission pages while it prefills";
    expectRowMirrorsBindings(rig, state);
    // The chunk reads the window its predecessor kept, through the rotated rows.
    testing::OracleReport const read = joiner.verifyWindow(rig.oracle(), kWindow);
    EXPECT_TRUE(read.ok()) << read.firstMismatch;
    EXPECT_EQ(read.positionsChecked, std::min(from, kWindow));
    // The founder decodes in the same step; the joiner's chunk writes its last window.
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    first.decode(rig.oracle());
    joiner.prefillChunk(rig.oracle(), from, end, kWindow);
    manager.completeDecodeStep(handle);
    if (end < 2000) {
      manager.completeSequenceChunk(handle, 1, end);
      EXPECT_EQ(state.endpoint, end);
      EXPECT_EQ(logicalPages(state).front(), retainedBegin(end, kWindow, kPage))
          << "the pages before the chunk's window are unmapped";
      EXPECT_EQ(state.pendingEndpoint, 2000) << "the rest of the prompt is staged again";
    }
    expectPagesAccountedFor(manager, {&handle});
    EXPECT_EQ(manager.freePageCount(), freeBefore - 13);
    from = end;
  }
  manager.finalizeSequenceAdmission(handle, 1);
  EXPECT_EQ(state.endpoint, 2000);
  EXPECT_EQ(logicalPages(state), covering(1700, 2000));
  EXPECT_EQ(state.heldPages(), manager.decodePagesPerSequence());
  for (int32_t step = 0; step < 70; ++step) {
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    first.decode(rig.oracle());
    joiner.decode(rig.oracle());
    manager.completeDecodeStep(handle);
  }
  testing::OracleReport const report = joiner.verifyWindow(rig.oracle(), kWindow);
  EXPECT_TRUE(report.ok()) << report.firstMismatch;
  EXPECT_EQ(report.positionsChecked, kWindow);
  EXPECT_TRUE(first.verifyWindow(rig.oracle(), kWindow).ok());
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
}

TEST_P(BoundedSwaJoinerTest, MisuseThrowsNamingTheCallAndChangesNothing) {
  SwaRig rig(joinerConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  EngineSequence first(0, 3);
  Handle handle = founder(rig, first, 100);
  ResidentRef const joiner = residentsFor({1}).front();
  expectContractError(
      [&] {
        (void)manager.admitSequence(handle, joiner, {500, 64, {}});
      },
      {"BoundedSwaKVPageManager::admitSequence", "starts at 64", "nothing is cached"});
  ASSERT_EQ(manager.admitSequence(handle, joiner, {500, 0, {}}), SwaKVCacheStatus::kOk);
  SwaSequenceState const& state = manager.state(handle, 1);
  manager.prepareSequenceChunk(handle, 1, 200);
  auto const bindings = state.bindings;
  auto const reserved = state.reservedPages;
  std::vector<int32_t> const row = hostRow(rig.table(), 1);
  int32_t const freePages = manager.freePageCount();
  auto unchanged = [&] {
    EXPECT_EQ(state.bindings, bindings);
    EXPECT_EQ(state.reservedPages, reserved);
    EXPECT_EQ(state.pendingEndpoint, 200);
    EXPECT_EQ(state.endpoint, 0);
    EXPECT_EQ(hostRow(rig.table(), 1), row);
    EXPECT_EQ(manager.freePageCount(), freePages);
  };
  expectContractError([&] { manager.prepareSequenceChunk(handle, 1, 0); },
                      {"BoundedSwaKVPageManager::prepareSequenceChunk", "chunk end 0 outside",
                       "(0 (done so far), 500 (the prompt)]"});
  expectContractError([&] { manager.prepareSequenceChunk(handle, 1, 501); },
                      {"prepareSequenceChunk", "chunk end 501 outside"});
  expectContractError([&] { manager.prepareSequenceChunk(handle, 0, 50); },
                      {"prepareSequenceChunk", "row 0 is not an unfinalised"});
  expectContractError([&] { manager.prepareSequenceChunk(handle, 2, 50); },
                      {"prepareSequenceChunk", "row 2 outside the batch of 2"});
  expectContractError(
      [&] { manager.completeSequenceChunk(handle, 1, 150); },
      {"BoundedSwaKVPageManager::completeSequenceChunk", "a chunk to 150", "ends at 200"});
  expectContractError([&] { manager.finalizeSequenceAdmission(handle, 1); },
                      {"finalizeSequenceAdmission", "reached 0 of its 500 prompt tokens"});
  unchanged();
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
  expectContractError([&] { manager.prepareSequenceChunk(handle, 1, 300); },
                      {"prepareSequenceChunk", "between steps"});
  expectContractError([&] { manager.completeSequenceChunk(handle, 1, 200); },
                      {"completeSequenceChunk", "between steps"});
  manager.completeDecodeStep(handle);
  unchanged();
  manager.completeSequenceChunk(handle, 1, 200);
  manager.completeSequenceChunk(handle, 1, 200);  // no progress: nothing to do
  EXPECT_EQ(state.endpoint, 200);
  EXPECT_EQ(state.pendingEndpoint, 500);
  manager.finalizeSequenceAdmission(handle, 1);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
}

TEST_P(BoundedSwaJoinerTest, AFoundersPrefillGoesInChunksAndHoldsAsAJoinerUntilItsLastChunk) {
  SwaRig rig(joinerConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 1});
  manager.preparePrefill(handle, std::vector<int32_t>{400, 2000});
  SwaSequenceState const& whole = manager.state(handle, 0);
  SwaSequenceState const& held = manager.state(handle, 1);
  EXPECT_EQ(logicalPages(held), covering(1700, 2000)) << "preparePrefill stages the whole prompt";
  // The prefill step runs founder 1's first chunk only: staged in place of its whole prompt.
  EXPECT_EQ(manager.sequenceChunkDemand(handle, 1, 700), DecodeStepDemand{});
  ASSERT_EQ(manager.prepareSequenceChunk(handle, 1, 700), SwaKVCacheStatus::kOk);
  EXPECT_EQ(held.pendingEndpoint, 700);
  EXPECT_EQ(held.joinerPromptTokens, 2000);
  EXPECT_EQ(logicalPages(held), chunkPages(0, 700));
  EXPECT_EQ(held.heldPages(), 13);
  expectRowMirrorsBindings(rig, held);
  EXPECT_FALSE(manager.awaitsPrefill(handle, 1)) << "its chunk has not run yet";
  EngineSequence first(0, 9);
  EngineSequence second(1, 31);
  first.prefill(rig.oracle(), 400, kWindow);
  second.prefillChunk(rig.oracle(), 0, 700, kWindow);
  ASSERT_EQ(manager.completeSequenceChunk(handle, 1, 700), SwaKVCacheStatus::kOk);
  EXPECT_EQ(held.endpoint, 700);
  EXPECT_EQ(held.pendingEndpoint, 2000) << "the rest of the prompt is staged";
  EXPECT_TRUE(manager.awaitsPrefill(handle, 1));
  EXPECT_FALSE(manager.awaitsPrefill(handle, 0));
  manager.completePrefill(handle);
  EXPECT_TRUE(held.joining) << "the founder goes on as an unfinalised joiner";
  EXPECT_EQ(held.heldPages(), 13) << "it keeps its admission pages while it prefills";
  EXPECT_FALSE(whole.joining);
  EXPECT_EQ(whole.heldPages(), manager.decodePagesPerSequence());
  expectPagesAccountedFor(manager, {&handle});

  // Founder 0 decodes while founder 1's chunks run, the window rotating from chunk to chunk.
  int32_t from = 700;
  for (int32_t const end : {1200, 2000}) {
    SCOPED_TRACE(::testing::Message() << "chunk [" << from << ", " << end << ")");
    ASSERT_EQ(manager.prepareSequenceChunk(handle, 1, end), SwaKVCacheStatus::kOk);
    EXPECT_EQ(logicalPages(held), chunkPages(from, end));
    testing::OracleReport const read = second.verifyWindow(rig.oracle(), kWindow);
    EXPECT_TRUE(read.ok()) << read.firstMismatch;
    EXPECT_EQ(read.positionsChecked, std::min(from, kWindow));
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    first.decode(rig.oracle());
    second.prefillChunk(rig.oracle(), from, end, kWindow);
    manager.completeDecodeStep(handle);
    ASSERT_EQ(manager.completeSequenceChunk(handle, 1, end), SwaKVCacheStatus::kOk);
    EXPECT_EQ(held.endpoint, end);
    from = end;
  }
  manager.finalizeSequenceAdmission(handle, 1);
  EXPECT_FALSE(manager.awaitsPrefill(handle, 1));
  EXPECT_EQ(logicalPages(held), covering(1700, 2000));
  EXPECT_EQ(held.heldPages(), manager.decodePagesPerSequence());
  decodeVerifyAndFinish(rig, handle, first, second, 70);
}

TEST_P(BoundedSwaJoinerTest, AnEmptyFirstChunkHoldsTheFounderWithItsWholePromptStaged) {
  // A token budget the founders before it spent: the prefill step runs none of its prompt.
  SwaRig rig(joinerConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 1});
  manager.preparePrefill(handle, std::vector<int32_t>{400, 700});
  EngineSequence first(0, 4);
  EngineSequence second(1, 8);
  first.prefill(rig.oracle(), 400, kWindow);
  ASSERT_EQ(manager.completeSequenceChunk(handle, 1, 0), SwaKVCacheStatus::kOk);
  EXPECT_TRUE(manager.awaitsPrefill(handle, 1));
  manager.completePrefill(handle);
  SwaSequenceState const& held = manager.state(handle, 1);
  EXPECT_TRUE(held.joining);
  EXPECT_EQ(held.endpoint, 0);
  EXPECT_EQ(held.pendingEndpoint, 700);
  EXPECT_EQ(held.joinerPromptTokens, 700);
  ASSERT_EQ(manager.prepareSequenceChunk(handle, 1, 700), SwaKVCacheStatus::kOk);
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
  first.decode(rig.oracle());
  second.prefillChunk(rig.oracle(), 0, 700, kWindow);
  manager.completeDecodeStep(handle);
  ASSERT_EQ(manager.completeSequenceChunk(handle, 1, 700), SwaKVCacheStatus::kOk);
  manager.finalizeSequenceAdmission(handle, 1);
  decodeVerifyAndFinish(rig, handle, first, second, 10);
}

TEST_P(BoundedSwaJoinerTest, AFoundersFirstChunkPreparedAgainReplacesTheStagedOne) {
  // The engine changes its mind before the step: a first chunk prepared to 700, then to 400 (the
  // window of 400 replaces it), and on another founder back to the whole prompt, which
  // completePrefill then commits as a founder prefilled whole.
  SwaRig rig(joinerConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 1});
  manager.preparePrefill(handle, std::vector<int32_t>{900, 600});
  SwaSequenceState const& held = manager.state(handle, 0);
  SwaSequenceState const& whole = manager.state(handle, 1);
  ASSERT_EQ(manager.prepareSequenceChunk(handle, 0, 700), SwaKVCacheStatus::kOk);
  ASSERT_EQ(manager.prepareSequenceChunk(handle, 0, 400), SwaKVCacheStatus::kOk);
  EXPECT_EQ(held.pendingEndpoint, 400);
  EXPECT_EQ(held.joinerPromptTokens, 900);
  EXPECT_EQ(logicalPages(held), chunkPages(0, 400));
  EXPECT_EQ(held.heldPages(), 13);
  expectRowMirrorsBindings(rig, held);
  ASSERT_EQ(manager.prepareSequenceChunk(handle, 1, 200), SwaKVCacheStatus::kOk);
  ASSERT_EQ(manager.prepareSequenceChunk(handle, 1, 600), SwaKVCacheStatus::kOk);
  EXPECT_EQ(logicalPages(whole), covering(300, 600));
  expectRowMirrorsBindings(rig, whole);
  EngineSequence first(0, 12);
  EngineSequence second(1, 13);
  first.prefillChunk(rig.oracle(), 0, 400, kWindow);
  second.prefill(rig.oracle(), 600, kWindow);
  ASSERT_EQ(manager.completeSequenceChunk(handle, 0, 400), SwaKVCacheStatus::kOk);
  ASSERT_EQ(manager.completeSequenceChunk(handle, 1, 600), SwaKVCacheStatus::kOk);  // no-op
  EXPECT_FALSE(manager.awaitsPrefill(handle, 1)) << "its whole prompt ran in the prefill step";
  manager.completePrefill(handle);
  EXPECT_TRUE(held.joining);
  EXPECT_FALSE(whole.joining);
  EXPECT_EQ(whole.joinerPromptTokens, 0);
  EXPECT_EQ(whole.endpoint, 600);
  EXPECT_EQ(whole.heldPages(), manager.decodePagesPerSequence());
  // The held founder's rest of the prompt, beside a decode step of the other.
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
  second.decode(rig.oracle());
  first.prefillChunk(rig.oracle(), 400, 900, kWindow);
  manager.completeDecodeStep(handle);
  manager.finalizeSequenceAdmission(handle, 0);
  decodeVerifyAndFinish(rig, handle, first, second, 20);
}

TEST_P(BoundedSwaJoinerTest, AFoundersChunkOutsideItsPlaceThrowsAndChangesNothing) {
  SwaRig rig(joinerConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0});
  manager.preparePrefill(handle, std::vector<int32_t>{900});
  SwaSequenceState const& state = manager.state(handle, 0);
  expectContractError([&] { manager.prepareSequenceChunk(handle, 0, 901); },
                      {"BoundedSwaKVPageManager::prepareSequenceChunk", "chunk end 901 outside",
                       "(0 (done so far), 900 (the prompt)]"});
  expectContractError([&] { manager.completeSequenceChunk(handle, 0, 300); },
                      {"completeSequenceChunk", "a chunk to 300", "ends at 900"});
  manager.prepareSequenceChunk(handle, 0, 300);
  auto const bindings = state.bindings;
  auto const reserved = state.reservedPages;
  std::vector<int32_t> const row = hostRow(rig.table(), 0);
  auto unchanged = [&] {
    EXPECT_EQ(state.bindings, bindings);
    EXPECT_EQ(state.reservedPages, reserved);
    EXPECT_EQ(state.pendingEndpoint, 300);
    EXPECT_EQ(state.endpoint, 0);
    EXPECT_FALSE(state.joining);
    EXPECT_EQ(hostRow(rig.table(), 0), row);
  };
  // The prefill step ran the chunk but the engine never completed it.
  expectContractError([&] { manager.completePrefill(handle); },
                      {"BoundedSwaKVPageManager::completePrefill", "row 0",
                       "first chunk to 300 was prepared", "but not completed"});
  unchanged();
  manager.completeSequenceChunk(handle, 0, 300);
  manager.completeSequenceChunk(handle, 0, 300);  // no progress: nothing to do
  expectContractError([&] { manager.prepareSequenceChunk(handle, 0, 600); },
                      {"prepareSequenceChunk", "first chunk (to 300) completed in this prefill",
                       "after completePrefill"});
  expectContractError([&] { manager.completeSequenceChunk(handle, 0, 900); },
                      {"completeSequenceChunk", "first chunk (to 300) completed in this prefill"});
  EXPECT_EQ(state.endpoint, 300);
  EXPECT_EQ(state.pendingEndpoint, 900);
  manager.completePrefill(handle);
  EXPECT_TRUE(state.joining);
  // Its only row holds: the request decodes nothing until the founder finalises.
  manager.finalizeSequenceAdmission(handle, 0);
  EXPECT_EQ(state.endpoint, 900);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
}

TEST_P(BoundedSwaJoinerTest, RetractionCapacityAndCompactionGiveEveryPageBack) {
  // Two admission budgets: the founder keeps M + 1 = 7 after its prefill, so one joiner fits
  // (13 of the 19 left) and a second does not.
  RigConfig config = joinerConfig();
  config.numPages = 26;
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  EngineSequence first(0, 9);
  Handle handle = founder(rig, first, 100);
  ASSERT_EQ(manager.freePageCount(), 19);
  ASSERT_EQ(manager.admitSequence(handle, residentsFor({1}).front(), {800, 0, {}}),
            SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.admitSequence(handle, residentsFor({2}).front(), {10, 0, {}}),
            SwaKVCacheStatus::kRequestFailed);
  EXPECT_EQ(manager.batchSize(handle), 2);
  EXPECT_EQ(manager.residentRowState(2), ResidentRowState::kFree);
  manager.prepareSequenceChunk(handle, 1, 400);
  EXPECT_TRUE(manager.hasRetractableAdmission(handle));
  EXPECT_TRUE(manager.retractSequenceAdmission(handle));
  EXPECT_EQ(manager.batchSize(handle), 1);
  EXPECT_EQ(manager.freePageCount(), 19);
  EXPECT_EQ(hostRow(rig.table(), 1), emptyRow(rig.table()));
  EXPECT_FALSE(manager.retractSequenceAdmission(handle)) << "the founder: nothing to undo";

  // A joiner left alone by a compaction is not undone: the batch would be empty.
  ASSERT_EQ(manager.admitSequence(handle, residentsFor({1}).front(), {800, 0, {}}),
            SwaKVCacheStatus::kOk);
  for (KVCachePool* pool : {&rig.pool(), rig.fullPool()}) {
    pool->setActiveBatchSize(2);
  }
  std::vector<int32_t> const dropFounder{-1, 0};
  manager.beginBatchCompaction(handle, dropFounder, 1, rig.mapping());
  ASSERT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kOk);
  ASSERT_EQ(manager.batchSize(handle), 1);
  EXPECT_TRUE(manager.state(handle, 0).joining);
  EXPECT_FALSE(manager.hasRetractableAdmission(handle));
  EXPECT_FALSE(manager.retractSequenceAdmission(handle));
  EXPECT_EQ(manager.batchSize(handle), 1);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 26);
  handle = founder(rig, first, 100);

  // A joiner compacted away between two chunks (the engine preempted it): every page returns.
  ASSERT_EQ(manager.admitSequence(handle, residentsFor({1}).front(), {800, 0, {}}),
            SwaKVCacheStatus::kOk);
  manager.prepareSequenceChunk(handle, 1, 400);
  EngineSequence joiner(1, 4);
  joiner.prefillChunk(rig.oracle(), 0, 400, kWindow);
  manager.completeSequenceChunk(handle, 1, 400);
  for (KVCachePool* pool : {&rig.pool(), rig.fullPool()}) {
    pool->setActiveBatchSize(2);  // the engine seated the joiner's length row
  }
  std::vector<int32_t> const oldToNew{0, -1};
  manager.beginBatchCompaction(handle, oldToNew, 1, rig.mapping());
  ASSERT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.batchSize(handle), 1);
  EXPECT_EQ(manager.freePageCount(), 19);
  EXPECT_EQ(hostRow(rig.table(), 1), emptyRow(rig.table()));
  EXPECT_EQ(manager.residentRowState(1), ResidentRowState::kFree);
  expectPagesAccountedFor(manager, {&handle});
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 26);
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaJoinerTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

}  // namespace
}  // namespace mkv::swa_test
