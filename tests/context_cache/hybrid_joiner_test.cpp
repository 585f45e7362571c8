// In-flight admission on a hybrid deployment (docs/lifecycle.md, "Chunked prefill"): a joiner's
// hit checkpoint is restored into its resident row at admission (or the row is cleared), the
// engine carries the row's recurrent state from chunk to chunk, the coordinator captures the
// state at each chunk's end as a reuse point, and finalisation commits the reuse points, the
// chunk ends and the prompt end after one synchronisation. The KV and recurrent oracles check
// every resumed state.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "hybrid_test_rig.h"

namespace mkv::test {
namespace {

using Handle = ContextCacheCoordinator::RequestHandle;
constexpr ContextCacheStatus kOk = ContextCacheStatus::kOk;
constexpr ResourceType kRecurrent = ResourceType::kRecurrentSnapshot;

class HybridJoinerTest : public DeviceTest {};

/// Pages of 16 tokens, three rows, a point every 32 (0: none).
HybridRigOptions joinerOptions(int32_t interval, int32_t recurrentSlots = 16) {
  HybridRigOptions o;
  o.pageSize = 16;
  o.numPages = 48;
  o.maxBatch = 3;
  o.maxPagesPerSeq = 12;
  o.maxRecords = 32;
  o.recurrentSlots = recurrentSlots;
  o.partialSlots = 16;
  o.checkpointInterval = interval;
  return o;
}

/// An executing request of one founder (slot 0, a 30-token prompt) and the joiners a test adds,
/// driven as an engine would: chunks run through the joiner's row, decode steps advance the
/// founder while the joiners hold.
class JoinerDriver {
 public:
  explicit JoinerDriver(HybridRig& rig) : founder(tokenRun(30, 9000), 0), mRig(rig) {
    handle = rig.admit({&founder});
    EXPECT_EQ(rig.prefill(handle, {&founder}), kOk);
    rows.push_back(&founder);
  }

  /// The founder (slot 0, `founderPrompt`) prefills only its first chunk [0, firstChunkEnd): the
  /// chunk completes in the prefill, and the founder holds at the prefill's completion, an
  /// unfinalised admission from then on (chunk, finish).
  JoinerDriver(HybridRig& rig, std::vector<int32_t> founderPrompt, int32_t firstChunkEnd)
      : founder(std::move(founderPrompt), 0), mRig(rig) {
    handle = rig.admit({&founder});
    rows.push_back(&founder);
    rig.coordinator->preparePrefill(handle);
    EXPECT_EQ(chunk(0, firstChunkEnd), kOk);
    rig.coordinator->enqueuePrefillCaptures(handle);
    ContextCacheSequenceAdvance const hold{nullptr, 0, kHoldCommittedStateLength};
    EXPECT_EQ(rig.coordinator->finalizePrefillPublication(handle, std::span(&hold, 1)), kOk);
  }

  /// Admits `seq` at the end of the batch; its prefill start, or -1 when refused.
  int32_t admit(Seq& seq) {
    auto const result = mRig.coordinator->admitSequence(handle, promptAdmissionOf(seq), kVanilla);
    if (result.status != kOk) {
      return -1;
    }
    rows.push_back(&seq);
    mRig.pool->setActiveBatchSize(static_cast<int32_t>(rows.size()));
    seq.materialized = result.prefillStart;
    return result.prefillStart;
  }

  /// Runs joiner row `row` over [materialized, end): checks the state it resumes from, writes KV
  /// and recurrent state, and the reuse points it passes into their slots.
  void runChunk(int32_t row, int32_t end) {
    Seq& seq = *rows[static_cast<std::size_t>(row)];
    int32_t const from = seq.materialized;
    testing::OracleReport const resumed =
        mRig.recurrentOracle().verify(seq.resident.slot, seq.digests, from);
    EXPECT_TRUE(resumed.ok()) << "row " << row << " at " << from << ": " << resumed.firstMismatch;
    if (from > 0 && seq.materialized == startOf(seq)) {
      testing::OracleReport const reused =
          mRig.oracle->verify(seq.resident.slot, seq.digests, 0, from);
      EXPECT_TRUE(reused.ok()) << "reused prefix: " << reused.firstMismatch;
    }
    mRig.oracle->write(seq.resident.slot, seq.digests, from, end);
    mRig.pool->writeLengths(row, std::span<int32_t const>(&end, 1), nullptr);
    mRig.recurrentOracle().write(seq.resident.slot, seq.digests, end);
    for (ReusePointCapture const& point : mRig.coordinator->reusePointCaptures(handle, row)) {
      if (point.position > from && point.position <= end) {
        mRig.recurrentOracle().writeSnapshot(*mRig.coordinator->snapshots(), point.snapshotSlot,
                                             seq.digests, point.position);
        writtenPoints.push_back(point.position);
      }
    }
    seq.materialized = end;
  }

  /// A chunk that does not end the prompt, completed after its step.
  ContextCacheStatus chunk(int32_t row, int32_t end) {
    runChunk(row, end);
    return mRig.coordinator->completePrefillChunk(handle, row, end);
  }

  /// The last chunk, then the lookahead token and the finalisation.
  ContextCacheStatus finish(int32_t row) {
    Seq& seq = *rows[static_cast<std::size_t>(row)];
    runChunk(row, seq.promptLength);
    seq.sample();
    return mRig.coordinator->finalizeSequenceAdmission(handle, row,
                                                       {&seq.tokens.back(), 1, seq.promptLength});
  }

  /// One decode step: the founder (and every finalised joiner) advances, unfinalised rows hold.
  ContextCacheStatus decode(std::vector<bool> const& holding) {
    ContextCacheStatus const prepared = mRig.coordinator->prepareDecodeStep(handle, kVanilla);
    if (prepared != kOk) {
      return prepared;
    }
    std::vector<ContextCacheSequenceAdvance> advances;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Seq& seq = *rows[i];
      if (i < holding.size() && holding[i]) {
        advances.push_back({nullptr, 0, kHoldCommittedStateLength});
        continue;
      }
      EXPECT_TRUE(
          mRig.recurrentOracle().verify(seq.resident.slot, seq.digests, seq.materialized).ok());
      mRig.oracle->write(seq.resident.slot, seq.digests, seq.materialized, seq.materialized + 1);
      int32_t const length = seq.materialized + 1;
      mRig.pool->writeLengths(static_cast<int32_t>(i), std::span<int32_t const>(&length, 1),
                              nullptr);
      mRig.recurrentOracle().write(seq.resident.slot, seq.digests, length);
      seq.materialized = length;
      seq.sample();
      advances.push_back({&seq.tokens.back(), 1, length});
    }
    return mRig.coordinator->completeDecodeStep(handle, advances, {});
  }

  Handle handle;
  Seq founder;
  std::vector<Seq*> rows;
  std::vector<int32_t> writtenPoints;  ///< reuse points the engine wrote, in order

 private:
  int32_t startOf(Seq const& seq) const {
    return mRig.coordinator->reuseTokenLength(
        handle, static_cast<int32_t>(std::find(rows.begin(), rows.end(), &seq) - rows.begin()));
  }

  HybridRig& mRig;
};

TEST_P(HybridJoinerTest, AJoinerRestoresTheCheckpointItsPromptHitsAndPublishesItsOwn) {
  HybridRig rig(device(), joinerOptions(0));
  std::vector<int32_t> const earlier = tokenRun(100, 100);
  rig.publish(earlier);  // its prompt end: 100 tokens, mid-page (the partial page kept)
  JoinerDriver driver(rig);
  EXPECT_TRUE(rig.coordinator->supportsLiveSequenceAdmission());
  Seq joiner(concatenated(earlier, tokenRun(20, 5000)), 1);
  ASSERT_EQ(driver.admit(joiner), 100);
  EXPECT_EQ(rig.coordinator->counters().checkpointRestores, 1u) << "the joiner's";
  uint64_t const syncs = rig.coordinator->counters().synchronizations;
  ASSERT_EQ(driver.finish(1), kOk) << "the oracles checked the restored KV and recurrent rows";
  EXPECT_EQ(rig.coordinator->counters().synchronizations, syncs + 1) << "one, at finalisation";
  EXPECT_EQ(checkpointLengths(rig, false), (std::vector<int32_t>{30, 100, 120}));
  // A second joiner reuses what the first one published, while both run on.
  Seq second(concatenated(joiner.tokens, tokenRun(9, 7000)), 2);
  ASSERT_EQ(driver.admit(second), 120);
  ASSERT_EQ(driver.decode({false, false, true}), kOk);
  ASSERT_EQ(driver.finish(2), kOk);
  ASSERT_EQ(driver.decode({}), kOk);
  ASSERT_EQ(rig.coordinator->finish(driver.handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridJoinerTest, AChunkedJoinerCarriesItsStateAcrossChunksAndKeepsEachChunkEnd) {
  HybridRig rig(device(), joinerOptions(32));
  JoinerDriver driver(rig);
  // The joiner's resident row holds a former owner's state: admission clears it.
  Seq former(tokenRun(50, 777), 1);
  rig.recurrentOracle().write(former.resident.slot, former.digests, 50);
  Seq joiner(tokenRun(100, 100), 1);
  ASSERT_EQ(driver.admit(joiner), 0);
  std::vector<int32_t> planned;
  for (ReusePointCapture const& point : rig.coordinator->reusePointCaptures(driver.handle, 1)) {
    planned.push_back(point.position);
  }
  EXPECT_EQ(planned, (std::vector<int32_t>{32, 64, 96}));
  ASSERT_EQ(driver.chunk(1, 40), kOk) << "resumes from zeroed rows";
  ASSERT_EQ(driver.decode({false, true}), kOk) << "the founder decodes, the joiner holds";
  ASSERT_EQ(driver.chunk(1, 64), kOk) << "a planned point: the engine writes it, no capture";
  ASSERT_EQ(driver.chunk(1, 75), kOk);
  EXPECT_EQ(rig.coordinator->counters().chunkEndCaptures, 2u) << "40 and 75";
  EXPECT_EQ(checkpointLengths(rig, true), std::vector<int32_t>{}) << "nothing before finalising";
  ASSERT_EQ(driver.finish(1), kOk);
  EXPECT_EQ(driver.writtenPoints, (std::vector<int32_t>{32, 64, 96})) << "each in its chunk";
  EXPECT_EQ(checkpointLengths(rig, true), (std::vector<int32_t>{32, 40, 64, 75, 96}));
  EXPECT_EQ(checkpointLengths(rig, false), (std::vector<int32_t>{30, 100}));
  ASSERT_EQ(rig.coordinator->finish(driver.handle), kOk);

  // A prompt diverging at 80 restores the chunk end at 75 (mid-page: its partial page too).
  Seq follower(concatenated(std::vector<int32_t>(joiner.tokens.begin(), joiner.tokens.begin() + 80),
                            tokenRun(10, 5000)),
               0);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&follower}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{75});
  ASSERT_EQ(rig.prefill(handle, {&follower}), kOk) << "the oracles checked the restore";
  EXPECT_EQ(rig.coordinator->counters().reusePointRestores, 1u);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridJoinerTest, AFounderPrefilledInChunksKeepsItsPointsAndChunkEndsForTheNextPrompt) {
  HybridRig rig(device(), joinerOptions(32));
  std::vector<int32_t> const prompt = tokenRun(100, 100);
  JoinerDriver driver(rig, prompt, 40);  // points at 32, 64, 96; its first chunk ends at 40
  EXPECT_TRUE(rig.coordinator->awaitsPrefill(driver.handle, 0));
  EXPECT_EQ(rig.coordinator->counters().heldPrefills, 1u);
  EXPECT_EQ(rig.coordinator->counters().chunkEndCaptures, 1u) << "40";
  EXPECT_EQ(checkpointLengths(rig, false), std::vector<int32_t>{}) << "no prompt end yet";
  EXPECT_EQ(rig.coordinator->reusePointCaptures(driver.handle, 0).size(), 3u);
  // A sequence arriving meanwhile joins beside the held founder (nothing committed to hit yet).
  Seq joiner(tokenRun(30, 4000), 1);  // shorter than an interval: no points of its own
  ASSERT_EQ(driver.admit(joiner), 0);
  ASSERT_EQ(driver.finish(1), kOk);
  ASSERT_EQ(driver.decode({true, false}), kOk) << "the joiner decodes, the founder holds";
  ASSERT_EQ(driver.chunk(0, 75), kOk) << "the recurrent oracle checks the state it resumes";
  ASSERT_EQ(driver.decode({true, false}), kOk);
  ASSERT_EQ(driver.finish(0), kOk);
  EXPECT_FALSE(rig.coordinator->awaitsPrefill(driver.handle, 0));
  EXPECT_EQ(driver.writtenPoints, (std::vector<int32_t>{32, 64, 96}));
  EXPECT_EQ(checkpointLengths(rig, true), (std::vector<int32_t>{32, 40, 64, 75, 96}));
  EXPECT_EQ(checkpointLengths(rig, false), (std::vector<int32_t>{30, 100}));
  ASSERT_EQ(driver.decode({}), kOk);
  ASSERT_EQ(rig.coordinator->finish(driver.handle), kOk);
  // A prompt diverging at 80 restores the founder's chunk end at 75.
  Seq follower(
      concatenated(std::vector<int32_t>(prompt.begin(), prompt.begin() + 80), tokenRun(10, 5000)),
      2);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&follower}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{75});
  ASSERT_EQ(rig.prefill(handle, {&follower}), kOk) << "the oracles checked the restore";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridJoinerTest, ChunkEndsLeaveTheSlotThePromptEndNeeds) {
  HybridRig rig(device(), joinerOptions(0, /*recurrentSlots=*/3));
  JoinerDriver driver(rig);  // the founder's prompt end holds one slot, reclaimable
  Seq joiner(tokenRun(100, 100), 1);
  ASSERT_EQ(driver.admit(joiner), 0);
  ASSERT_EQ(driver.chunk(1, 20), kOk);
  ASSERT_EQ(driver.chunk(1, 40), kOk);
  ASSERT_EQ(driver.chunk(1, 60), kOk) << "one slot left: kept for the prompt end";
  EXPECT_EQ(rig.coordinator->counters().chunkEndCaptures, 2u);
  EXPECT_EQ(rig.coordinator->counters().snapshotPressureSkips, 1u);
  ASSERT_EQ(driver.finish(1), kOk);
  EXPECT_EQ(checkpointLengths(rig, true), (std::vector<int32_t>{20, 40}));
  EXPECT_EQ(checkpointLengths(rig, false), std::vector<int32_t>{100})
      << "the founder's prompt end made room for the joiner's";
  ASSERT_EQ(rig.coordinator->finish(driver.handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridJoinerTest, ARetractedJoinerReturnsItsRestoreAndCaptureSlots) {
  HybridRig rig(device(), joinerOptions(32));
  std::vector<int32_t> const earlier = tokenRun(40, 100);
  rig.publish(earlier);  // a reuse point at 32, the prompt end at 40
  JoinerDriver driver(rig);
  int32_t const free = rig.freeSlots(kRecurrent);
  Seq joiner(concatenated(earlier, tokenRun(60, 3000)), 1);
  ASSERT_EQ(driver.admit(joiner), 40);
  EXPECT_EQ(rig.coordinator->reusePointCaptures(driver.handle, 1).size(), 2u) << "64, 96";
  ASSERT_EQ(driver.chunk(1, 70), kOk);
  EXPECT_EQ(rig.freeSlots(kRecurrent), free - 3) << "two points, one chunk end";
  EXPECT_TRUE(rig.coordinator->retractSequenceAdmission(driver.handle));
  EXPECT_EQ(rig.freeSlots(kRecurrent), free) << "nothing committed, every reservation returned";
  EXPECT_EQ(checkpointLengths(rig, true), std::vector<int32_t>{32});
  EXPECT_EQ(checkpointLengths(rig, false), (std::vector<int32_t>{30, 40}));
  ASSERT_EQ(rig.coordinator->finish(driver.handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridJoinerTest, AFailedFinalisationSynchronisationQuarantinesTheRequest) {
  HybridRig rig(device(), joinerOptions(0));
  JoinerDriver driver(rig);
  Seq joiner(tokenRun(50, 100), 1);
  ASSERT_EQ(driver.admit(joiner), 0);
  rig.sync.failNext();
  EXPECT_EQ(driver.finish(1), ContextCacheStatus::kPoisoned);
  EXPECT_FALSE(driver.handle.valid());
  EXPECT_EQ(rig.coordinator->quarantinedRequestCount(), 1);
  EXPECT_EQ(checkpointLengths(rig, false), std::vector<int32_t>{30}) << "nothing committed";
  EXPECT_EQ(rig.coordinator->shutdown(), kOk);
  rig.expectQuiescent();
}

INSTANTIATE_TEST_SUITE_P(Devices, HybridJoinerTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv::test
