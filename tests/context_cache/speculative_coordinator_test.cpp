// ContextCacheCoordinator on speculative deployments (docs/context_cache.md, "Speculative paired
// reuse" and "Hybrid-MTP endpoints"): EAGLE-style paired base + draft reuse with a full-page
// replay, and Hybrid-MTP endpoints with the boundary token private. The base KV, the draft KV and
// the recurrent rows of every execution are written and verified by the oracles, so reuse is
// correct only when it is byte-exact for the consumer's own prefix.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "speculative_test_rig.h"

namespace mkv::test {
namespace {

using Handle = ContextCacheCoordinator::RequestHandle;
constexpr ContextCacheStatus kOk = ContextCacheStatus::kOk;
constexpr ResourceType kDraft = ResourceType::kDraftKvPage;

class SpeculativeCoordinatorTest : public DeviceTest {};
class HybridMtpCoordinatorTest : public DeviceTest {
 protected:
  static SpecRigOptions mtp() {
    SpecRigOptions options;
    options.hybrid = true;
    options.maxBatch = 2;
    return options;
  }
};

// ------------------------------------------------------------------------------- EAGLE

TEST_P(SpeculativeCoordinatorTest, FirstVerificationPublishesThePairAndTheNextRequestReplaysAPage) {
  SpecRig rig(device());
  Seq producer(tokenRun(300, 1), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.prefill(handle, {&producer}, true), kOk);
  EXPECT_TRUE(rig.records().empty()) << "the draft initialisation may still run: nothing yet";
  ASSERT_EQ(rig.step(handle, {&producer}, {2}, {0}, {}, true), kOk);
  ASSERT_EQ(rig.records().size(), 1u) << "the frozen prompt endpoint, after the first round";
  CacheRecord const record = rig.records().front();
  EXPECT_EQ(record.basePagePath.size(), 2u);
  ASSERT_TRUE(record.specState.has_value());
  EXPECT_EQ(record.specState->draftPagePath.size(), 2u);
  EXPECT_EQ(rig.coordinator->counters().specPairPublications, 1u);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  // Same 300 tokens, then another continuation: the draft row 255 depends on token 256, the
  // producer's, so the path's last page is replayed and reuse starts at 128.
  Seq consumer(concatenated(tokenRun(300, 1), tokenRun(40, 9000)), 1);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&consumer}, true, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{128});
  EXPECT_EQ(rig.manager().metrics().specFullPageReplays, 1u);
  EXPECT_EQ(rig.coordinator->draftPages(next, 0)[0], record.specState->draftPagePath[0]);
  ASSERT_EQ(rig.prefill(next, {&consumer}, true), kOk);  // verifies base and draft [0, 128)
  EXPECT_EQ(readAs<int32_t>(rig.draftPool->kvLengths())[0], 340);
  ASSERT_EQ(rig.step(next, {&consumer}, {3}, {1}, {0}, true), kOk);
  ASSERT_EQ(rig.coordinator->finish(next), kOk);
  rig.expectQuiescent();
}

// In-flight admission into a speculative request: the joiner reuses a paired path (base and draft
// pages, the last page replayed), its chunks publish nothing (their draft rows are written by the
// draft initialisation after the last chunk), and its prompt endpoint is frozen at finalisation
// and published after the first round that advances it; a joiner that round holds publishes none.
TEST_P(SpeculativeCoordinatorTest, AJoinerPairsADraftRowAndPublishesItsPromptAfterItsFirstRound) {
  SpecRigOptions options;
  options.maxBatch = 3;
  SpecRig rig(device(), options);
  Seq producer(tokenRun(300, 1), 0);
  Handle first = rig.admit({&producer}, true);
  ASSERT_EQ(rig.prefill(first, {&producer}, true), kOk);
  ASSERT_EQ(rig.step(first, {&producer}, {2}, {0}, {}, true), kOk);
  ASSERT_EQ(rig.coordinator->finish(first), kOk);
  ASSERT_EQ(rig.records().size(), 1u);
  PageId const producerDraft = rig.records().front().specState->draftPagePath[0];

  Seq founder(tokenRun(200, 5000), 0);
  Handle handle = rig.admit({&founder}, true);
  ASSERT_EQ(rig.prefill(handle, {&founder}, true), kOk);
  ASSERT_EQ(rig.step(handle, {&founder}, {1}, {0}, {}, true), kOk);
  ASSERT_EQ(rig.records().size(), 2u) << "the founder's prompt endpoint";

  Seq joiner(concatenated(tokenRun(300, 1), tokenRun(140, 9000)), 1);
  auto const admitted =
      rig.coordinator->admitSequence(handle, promptAdmissionOf(joiner), SpecRig::kSpecHeadroom);
  ASSERT_EQ(admitted.status, kOk);
  EXPECT_EQ(admitted.prefillStart, 128) << "the paired path, its last page replayed";
  ASSERT_FALSE(rig.coordinator->draftPages(handle, 1).empty());
  EXPECT_EQ(rig.coordinator->draftPages(handle, 1)[0], producerDraft) << "a draft row of its own";
  rig.pool.setActiveBatchSize(2);  // the engine seats the joiner's KV-length rows
  rig.draftPool->setActiveBatchSize(2);
  rig.verifyResumed(joiner, 128, 128, "joiner");
  uint64_t const pairs = rig.coordinator->counters().specPairPublications;
  rig.executeBase(joiner, 1, 128, 256);
  ASSERT_EQ(rig.coordinator->completePrefillChunk(handle, 1, 256), kOk);
  EXPECT_EQ(rig.records().size(), 2u) << "a speculative chunk publishes nothing";
  rig.executeBase(joiner, 1, 256, 440);
  joiner.sample();
  rig.executeDraft(joiner, 1, 128, 440);  // the joiner's draft initialisation
  ContextCacheSequenceAdvance const lookahead{&joiner.tokens.back(), 1, 440};
  ASSERT_EQ(rig.coordinator->finalizeSequenceAdmission(handle, 1, lookahead), kOk);
  EXPECT_EQ(rig.records().size(), 2u) << "frozen: the draft initialisation may still run";
  EXPECT_EQ(rig.coordinator->commonLength(handle, 1), 440);

  Seq held(tokenRun(260, 7000), 2);
  auto const second =
      rig.coordinator->admitSequence(handle, promptAdmissionOf(held), SpecRig::kSpecHeadroom);
  ASSERT_EQ(second.status, kOk);
  EXPECT_EQ(second.prefillStart, 0);
  rig.pool.setActiveBatchSize(3);
  rig.draftPool->setActiveBatchSize(3);
  rig.executeBase(held, 2, 0, 260);
  held.sample();
  rig.executeDraft(held, 2, 0, 260);
  ContextCacheSequenceAdvance const heldLookahead{&held.tokens.back(), 1, 260};
  ASSERT_EQ(rig.coordinator->finalizeSequenceAdmission(handle, 2, heldLookahead), kOk);

  // The first round: the joiner advances, the second joiner is held (cancelled).
  ASSERT_EQ(rig.step(handle, {&founder, &joiner, &held}, {1, 2, 0}, {0, 0, 0}, {}, true), kOk);
  ASSERT_EQ(rig.records().size(), 3u) << "the joiner's prompt endpoint, and only it";
  std::vector<CacheRecord> const records = rig.records();
  auto const longest = std::max_element(records.begin(), records.end(),
                                        [](CacheRecord const& a, CacheRecord const& b) {
                                          return a.basePagePath.size() < b.basePagePath.size();
                                        });
  CacheRecord const& published = *longest;
  EXPECT_EQ(published.basePagePath.size(), 3u);
  ASSERT_TRUE(published.specState.has_value());
  EXPECT_EQ(published.specState->draftPagePath.size(), 3u);
  EXPECT_EQ(published.specState->draftPagePath[0], producerDraft);
  EXPECT_EQ(rig.coordinator->counters().specPairPublications, pairs + 1);
  ASSERT_EQ(rig.step(handle, {&founder, &joiner, &held}, {1, 1, 1}, {0, 0, 0}, {}, true), kOk);
  EXPECT_EQ(rig.records().size(), 3u) << "a row the first round held never publishes its prompt";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.records().size(), 3u);
  rig.expectQuiescent();
}

// Preempting a decoding row publishes what it committed even while a joiner's prompt endpoint
// waits for the joiner's draft initialisation (only the waiting row's own publication waits).
TEST_P(SpeculativeCoordinatorTest, APreemptedRowPublishesWhileAJoinersEndpointWaits) {
  SpecRig rig(device());
  Seq founder(tokenRun(250, 5000), 0);
  Handle handle = rig.admit({&founder}, true);
  ASSERT_EQ(rig.prefill(handle, {&founder}, true), kOk);
  ASSERT_EQ(rig.step(handle, {&founder}, {3}, {0}, {}, true), kOk);
  ASSERT_EQ(rig.step(handle, {&founder}, {4}, {0}, {}, true), kOk);  // committed and common 257
  ASSERT_EQ(rig.records().size(), 1u) << "the founder's prompt endpoint, one block";

  Seq joiner(tokenRun(130, 9000), 1);
  ASSERT_EQ(
      rig.coordinator->admitSequence(handle, promptAdmissionOf(joiner), SpecRig::kSpecHeadroom)
          .status,
      kOk);
  rig.pool.setActiveBatchSize(2);
  rig.draftPool->setActiveBatchSize(2);
  rig.executeBase(joiner, 1, 0, 130);
  joiner.sample();
  rig.executeDraft(joiner, 1, 0, 130);
  ContextCacheSequenceAdvance const lookahead{&joiner.tokens.back(), 1, 130};
  ASSERT_EQ(rig.coordinator->finalizeSequenceAdmission(handle, 1, lookahead), kOk);

  ASSERT_EQ(rig.coordinator->preemptSequence(handle, 0), kOk);
  ASSERT_EQ(rig.records().size(), 2u) << "the founder's second block, published at preemption";
  ASSERT_EQ(rig.coordinator->preemptSequence(handle, 1), kOk);
  EXPECT_EQ(rig.records().size(), 2u) << "the joiner's own endpoint still waits";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.records().size(), 3u) << "finish's synchronisation publishes the joiner's prompt";
  rig.expectQuiescent();
}

TEST_P(SpeculativeCoordinatorTest, AnAbandonedSpeculativeRequestPublishesNothing) {
  SpecRig rig(device());
  Seq producer(tokenRun(300, 1), 0);
  {
    Handle handle = rig.admit({&producer}, true);
    ASSERT_EQ(rig.prefill(handle, {&producer}, true), kOk);
    int64_t const syncs = rig.sync.calls();
    handle = Handle{};  // abandoned before the first verification round
    EXPECT_EQ(rig.sync.calls(), syncs + 1) << "the draft initialisation is waited for";
  }
  EXPECT_TRUE(rig.records().empty());
  EXPECT_EQ(rig.coordinator->activeRequestCount(), 0);
  rig.expectQuiescent();
}

TEST_P(SpeculativeCoordinatorTest, WithoutARoundThePromptEndpointIsPublishedAfterTheTerminalSync) {
  SpecRig rig(device());
  Seq viaFinish(tokenRun(200, 1), 0);
  Handle handle = rig.admit({&viaFinish}, true);
  ASSERT_EQ(rig.prefill(handle, {&viaFinish}, true), kOk);
  int64_t syncs = rig.sync.calls();
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.sync.calls(), syncs + 1);
  EXPECT_EQ(rig.records().size(), 1u);

  Seq viaCompaction(tokenRun(200, 5000), 1);
  Handle other = rig.admit({&viaCompaction}, true);
  ASSERT_EQ(rig.prefill(other, {&viaCompaction}, true), kOk);
  Tensor mapping({2}, DataType::kInt32, device());
  std::vector<int32_t> const drop{-1};
  rig.coordinator->beginBatchCompaction(other, drop, 0, mapping);
  syncs = rig.sync.calls();
  ASSERT_EQ(rig.coordinator->compactBatch(other), kOk);
  EXPECT_EQ(rig.sync.calls(), syncs + 1) << "the compaction's own synchronisation";
  EXPECT_EQ(rig.records().size(), 2u);
  EXPECT_EQ(readAs<int32_t>(rig.draftTable->deviceTable())[4], kNoPage)
      << "the dropped row's draft entries are cleared";
  ASSERT_EQ(rig.coordinator->finish(other), kOk);
  rig.expectQuiescent();
}

TEST_P(SpeculativeCoordinatorTest, DecodeEndPublicationStopsAtTheCommonBaseAndDraftLength) {
  SpecRig rig(device());
  Seq producer(tokenRun(254, 1), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.prefill(handle, {&producer}, true), kOk);
  // committed 257, but the draft materialised 255 only: one block, already published.
  ASSERT_EQ(rig.step(handle, {&producer}, {3}, {2}, {0}, true), kOk);
  EXPECT_EQ(rig.coordinator->committedLength(handle, 0), 257);
  EXPECT_EQ(rig.coordinator->commonLength(handle, 0), 255);
  ASSERT_EQ(rig.records().size(), 1u);
  EXPECT_EQ(rig.records().front().basePagePath.size(), 1u);
  ASSERT_EQ(rig.step(handle, {&producer}, {1}, {0}, {0}, true), kOk);
  ASSERT_EQ(rig.records().size(), 2u) << "common 258 covers two blocks";
  EXPECT_EQ(rig.records().back().specState->draftPagePath.size(), 2u);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(SpeculativeCoordinatorTest,
       VanillaRequestsReuseTheBaseSideAndSpecPlansIgnoreBaseOnlyRecords) {
  SpecRig rig(device());
  Seq producer(tokenRun(300, 1), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.prefill(handle, {&producer}, true), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  int32_t const freeDraft = rig.pools().freeCount(kDraft);
  std::vector<int32_t> const draftTable = readAs<int32_t>(rig.draftTable->deviceTable());

  Seq vanilla(concatenated(tokenRun(300, 1), tokenRun(10, 7000)), 1);
  std::vector<int32_t> starts;
  Handle plain = rig.admit({&vanilla}, false, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{256}) << "no replay: the base KV needs no successor";
  EXPECT_TRUE(rig.coordinator->draftPages(plain, 0).empty());
  ASSERT_EQ(rig.prefill(plain, {&vanilla}, false), kOk);
  ASSERT_EQ(rig.step(plain, {&vanilla}, {1}, {0}, {0}, false), kOk);
  ASSERT_EQ(rig.coordinator->finish(plain), kOk);
  EXPECT_EQ(rig.pools().freeCount(kDraft), freeDraft) << "no draft page taken";
  EXPECT_EQ(readAs<int32_t>(rig.draftTable->deviceTable()), draftTable) << "draft rows untouched";

  // A base-only record cannot reconstruct draft KV: a speculative request ignores it.
  Seq baseOnly(tokenRun(260, 40000), 0);
  Handle publisher = rig.admit({&baseOnly}, false);
  ASSERT_EQ(rig.prefill(publisher, {&baseOnly}, false), kOk);
  ASSERT_EQ(rig.coordinator->finish(publisher), kOk);
  EXPECT_FALSE(rig.records().back().specState.has_value());
  Seq eagle(tokenRun(300, 40000), 1);
  Handle spec = rig.admit({&eagle}, true, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0});
  ASSERT_EQ(rig.prefill(spec, {&eagle}, true), kOk);
  ASSERT_EQ(rig.step(spec, {&eagle}, {1}, {0}, {}, true), kOk);
  EXPECT_TRUE(rig.records().back().specState.has_value())
      << "the pair attaches its draft path to the base-only record";
  ASSERT_EQ(rig.coordinator->finish(spec), kOk);
  rig.expectQuiescent();
}

TEST_P(SpeculativeCoordinatorTest, MediaInOneSequenceBypassesTheWholeSpeculativeBatch) {
  SpecRig rig(device());
  Seq producer(tokenRun(300, 1), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.prefill(handle, {&producer}, true), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  std::size_t const records = rig.records().size();

  Seq text(tokenRun(300, 1), 0);
  Seq image(tokenRun(300, 1), 1);
  ContextCacheBatchAdmission batch = rig.batchOf({&text, &image}, true);
  batch.sequences[1].media.assign(300, MediaPosition{Hash128{1, 2}, 0});
  auto begun = rig.coordinator->beginRequest(batch, SpecRig::kSpecHeadroom, nullptr);
  ASSERT_EQ(begun.status, kOk);
  EXPECT_EQ(begun.admission->prefillStarts, (std::vector<int32_t>{0, 0}));
  Handle both = std::move(begun.admission->request);
  ASSERT_EQ(rig.prefill(both, {&text, &image}, true), kOk);
  ASSERT_EQ(rig.step(both, {&text, &image}, {1, 1}, {0, 0}, {0, 1}, true), kOk);
  ASSERT_EQ(rig.coordinator->finish(both), kOk);
  EXPECT_EQ(rig.records().size(), records) << "bypassed rows publish nothing";
  rig.expectQuiescent();
}

TEST_P(SpeculativeCoordinatorTest, MisusedProgressOrHeadroomThrowsAndChangesNothing) {
  SpecRig rig(device());
  Seq seq(tokenRun(100, 1), 0);
  ContextCacheBatchAdmission const batch = rig.batchOf({&seq}, true);
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->beginRequest(batch, {4, 0}, nullptr);
      },
      {"beginRequest", "draftExtraTokens must be > 0", "got 0"}));
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->beginRequest(rig.batchOf({&seq}, false), {4, 4}, nullptr);
      },
      {"draftExtraTokens 4 given, but the request has no paged draft state"}));
  EXPECT_EQ(rig.manager().liveLeaseCount(), 0);

  Handle handle = rig.admit({&seq}, true);
  rig.coordinator->preparePrefill(handle);
  rig.executeBase(seq, 0, 0, 100);
  seq.sample();
  rig.executeDraft(seq, 0, 0, 100);
  ContextCacheSequenceAdvance const advance{&seq.tokens.back(), 1, 100};
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->finalizePrefillPublication(handle, {&advance, 1});
      },
      {"finalizePrefillPublication", "0 common state lengths for a batch of 1", "required"}));
  std::vector<int32_t> const wrong{99};
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->finalizePrefillPublication(handle, {&advance, 1}, wrong);
      },
      {"row 0: the common state length after prefill is the prompt's 100, got 99"}));
  std::vector<int32_t> const common{100};
  ASSERT_EQ(rig.coordinator->finalizePrefillPublication(handle, {&advance, 1}, common), kOk);
  ASSERT_EQ(rig.coordinator->prepareDecodeStep(handle, SpecRig::kSpecHeadroom), kOk);
  std::vector<int32_t> const tokens{5, 6};
  ContextCacheSequenceAdvance const two{tokens.data(), 2, 102};
  std::vector<int32_t> const beyond{103};
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->completeDecodeStep(handle, {&two, 1}, {}, beyond);
      },
      {"completeDecodeStep", "row 0: common state length 103 outside [100, committed 102]"}));
  ContextCacheSequenceAdvance const skewed{tokens.data(), 2, 103};
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->completeDecodeStep(handle, {&skewed, 1}, {}, common);
      },
      {"a speculative step commits the previous 100 + accepted 2"}));
  EXPECT_EQ(rig.coordinator->committedLength(handle, 0), 100) << "nothing applied";
  EXPECT_EQ(rig.coordinator->commonLength(handle, 0), 100);
  ASSERT_EQ(rig.coordinator->completeDecodeStep(handle, {&two, 1}, {}, common), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
}

INSTANTIATE_TEST_SUITE_P(Devices, SpeculativeCoordinatorTest, allDeviceTypes(), deviceName);

// ------------------------------------------------------------------------------- Hybrid-MTP

TEST_P(HybridMtpCoordinatorTest, EndpointReuseRestoresThePairedStateAndTheBoundaryHiddenRow) {
  SpecRig rig(device(), mtp());
  Seq producer(tokenRun(129, 100), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, producer), kOk);
  ASSERT_EQ(rig.records().size(), 1u);
  CacheRecord const record = rig.records().front();
  EXPECT_EQ(record.exactCheckpointLength, 129);
  EXPECT_EQ(record.basePagePath.size(), 1u) << "token 128 (the boundary) stays private";
  ASSERT_TRUE(record.specState.has_value());
  EXPECT_EQ(record.specState->draftPagePath.size(), 1u);
  EXPECT_TRUE(record.partialKvSnapshotSlot.has_value());
  EXPECT_EQ(rig.coordinator->counters().hybridMtpPublications, 1u);
  ASSERT_EQ(rig.step(handle, {&producer}, {3}, {0}, {0}, true), kOk);
  EXPECT_EQ(rig.records().size(), 1u) << "kPrefillStateOnly: no decode-end checkpoint";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  Seq consumer(concatenated(tokenRun(129, 100), tokenRun(11, 7)), 1);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&consumer}, true, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{129});
  std::span<PageId const> const draft = rig.coordinator->draftPages(next, 0);
  ASSERT_EQ(draft.size(), 2u);
  EXPECT_EQ(draft[0], record.specState->draftPagePath[0]);
  EXPECT_NE(draft[1], record.specState->draftPagePath[0]);
  // mtpPrefill verifies base [0, 129), draft [0, 128), the recurrent rows and the hidden row.
  ASSERT_EQ(rig.mtpPrefill(next, consumer), kOk);
  EXPECT_EQ(rig.coordinator->counters().checkpointRestores, 1u);
  EXPECT_EQ(rig.coordinator->counters().boundaryHiddenRestores, 1u);
  EXPECT_EQ(rig.records().size(), 2u) << "the consumer's own endpoint at 140";
  ASSERT_EQ(rig.coordinator->finish(next), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, EveryRowOfABatchRestoresAndPublishesItsOwnEndpoint) {
  SpecRigOptions options = mtp();
  options.recurrentSlots = 8;  // six endpoints, none evicted
  options.partialSlots = 8;
  SpecRig rig(device(), options);
  Seq a(tokenRun(129, 100), 0);
  Seq b(tokenRun(200, 300), 1);
  Handle handle = rig.admit({&a, &b}, true);
  // mtpPrefill publishes each row's endpoint from its own hidden states.
  ASSERT_EQ(rig.mtpPrefill(handle, {&a, &b}), kOk);
  EXPECT_EQ(rig.coordinator->counters().hybridMtpPublications, 2u);
  std::vector<int32_t> lengths;
  for (CacheRecord const& record : rig.records()) {
    lengths.push_back(record.exactCheckpointLength.value_or(-1));
  }
  std::sort(lengths.begin(), lengths.end());
  EXPECT_EQ(lengths, (std::vector<int32_t>{129, 200}));
  // Rows accept and lag differently; no decode-end checkpoint (kPrefillStateOnly).
  ASSERT_EQ(rig.step(handle, {&a, &b}, {3, 1}, {0, 1}, {}, true), kOk);
  ASSERT_EQ(rig.step(handle, {&a, &b}, {2, 2}, {1, 0}, {0, 1}, true), kOk);
  EXPECT_EQ(rig.records().size(), 2u);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  // The rows swapped, each the next turn of the other row's producer: each restores its own
  // hit (base, draft one row short, recurrent rows) and its boundary hidden row lands in its
  // own row of the tensor (mtpPrefill checks all of it).
  Seq nextB(concatenated(tokenRun(200, 300), tokenRun(9, 7)), 0);
  Seq nextA(concatenated(tokenRun(129, 100), tokenRun(20, 9)), 1);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&nextB, &nextA}, true, &starts);
  EXPECT_EQ(starts, (std::vector<int32_t>{200, 129}));
  ASSERT_EQ(rig.mtpPrefill(next, {&nextB, &nextA}), kOk);
  EXPECT_EQ(rig.coordinator->counters().checkpointRestores, 2u);
  EXPECT_EQ(rig.coordinator->counters().boundaryHiddenRestores, 2u);
  EXPECT_EQ(rig.records().size(), 4u) << "the next turns' endpoints at 209 and 149";
  ASSERT_EQ(rig.step(next, {&nextB, &nextA}, {1, 2}, {0, 0}, {0, 1}, true), kOk);
  ASSERT_EQ(rig.coordinator->finish(next), kOk);

  // One row hits, the other starts cold: only the hit has a boundary row to restore.
  Seq again(concatenated(tokenRun(129, 100), tokenRun(4, 11)), 0);
  Seq cold(tokenRun(70, 900), 1);
  Handle third = rig.admit({&again, &cold}, true, &starts);
  EXPECT_EQ(starts, (std::vector<int32_t>{129, 0}));
  rig.coordinator->preparePrefill(third);
  Tensor restored({2, rig.options.hiddenWidth}, DataType::kFloat16, device());
  EXPECT_TRUE(throwsError(
      [&] { rig.coordinator->restoreHybridMtpBoundaryHidden(third, 1, restored, 1); },
      {"restoreHybridMtpBoundaryHidden", "row 1 restored no Hybrid-MTP checkpoint (reuse 0)"}));
  rig.coordinator->restoreHybridMtpBoundaryHidden(third, 0, restored, 1);
  std::vector<uint8_t> const rows = readBytes(restored);
  EXPECT_EQ(std::vector<uint8_t>(rows.begin() + rig.options.hiddenWidth * 2, rows.end()),
            rig.hiddenRow(again.digests.at(128)))
      << "row 0's boundary row, into row 1 where the engine asked for it";
  rig.verifyResumed(again, 129, 128, "restored");
  rig.executeBase(again, 0, 129, again.promptLength);
  rig.executeBase(cold, 1, 0, cold.promptLength);
  Tensor const hiddenAgain = rig.hiddenStates(again, 129, again.promptLength);
  Tensor const hiddenCold = rig.hiddenStates(cold, 0, cold.promptLength);
  ASSERT_EQ(rig.coordinator->publishHybridMtpEndpoint(third, 1, cold.promptLength, hiddenCold,
                                                      cold.promptLength - 1),
            kOk);
  ASSERT_EQ(rig.coordinator->publishHybridMtpEndpoint(third, 0, again.promptLength, hiddenAgain,
                                                      again.promptLength - 1 - 129),
            kOk);
  // Its endpoint says its prefill reached 133: a chunk of the prefill cannot end before it.
  EXPECT_TRUE(
      throwsError([&] { (void)rig.coordinator->completePrefillChunk(third, 0, 131); },
                  {"completePrefillChunk", "row 0: its endpoint at 133 tokens was published"}));
  again.sample();
  cold.sample();
  std::vector<ContextCacheSequenceAdvance> const advances{
      {&again.tokens.back(), 1, again.promptLength}, {&cold.tokens.back(), 1, cold.promptLength}};
  ASSERT_EQ(rig.coordinator->finalizePrefillPublication(third, advances), kOk);
  EXPECT_EQ(rig.records().size(), 6u);
  ASSERT_EQ(rig.coordinator->finish(third), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, AJoinerRestoresItsHitInChunksAndPublishesItsEndpoint) {
  SpecRigOptions options = mtp();
  options.recurrentSlots = 8;
  options.partialSlots = 8;
  SpecRig rig(device(), options);
  Seq producer(tokenRun(129, 100), 0);
  Handle first = rig.admit({&producer}, true);
  ASSERT_EQ(rig.mtpPrefill(first, producer), kOk);
  ASSERT_EQ(rig.coordinator->finish(first), kOk);

  Seq founder(tokenRun(60, 700), 0);
  Handle handle = rig.admit({&founder}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, founder), kOk);
  ASSERT_EQ(rig.records().size(), 2u);
  Tensor restored({2, rig.options.hiddenWidth}, DataType::kFloat16, device());
  Tensor const founderHidden = rig.hiddenStates(founder, 0, founder.promptLength);
  EXPECT_TRUE(throwsError(
      [&] { rig.coordinator->restoreHybridMtpBoundaryHidden(handle, 0, restored, 0); },
      {"restoreHybridMtpBoundaryHidden", "row 0: a Hybrid-MTP row restores and publishes"}))
      << "a finalised row has no prefill under way";

  // A joiner's own commit policy cannot lift the rule.
  Seq joiner(concatenated(tokenRun(129, 100), tokenRun(20, 9)), 1);
  ContextCacheSequenceAdmission generated = promptAdmissionOf(joiner);
  generated.commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  int32_t const leases = rig.manager().liveLeaseCount();
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->admitSequence(handle, generated, SpecRig::kSpecHeadroom); },
      {"admitSequence", "joiner needs commit policy kPrefillStateOnly, got 0"}));
  EXPECT_EQ(rig.manager().liveLeaseCount(), leases);

  auto const admitted =
      rig.coordinator->admitSequence(handle, promptAdmissionOf(joiner), SpecRig::kSpecHeadroom);
  ASSERT_EQ(admitted.status, kOk);
  EXPECT_EQ(admitted.prefillStart, 129) << "the producer's endpoint, mid-page";
  rig.pool.setActiveBatchSize(2);  // the engine seats the joiner's KV-length rows
  rig.draftPool->setActiveBatchSize(2);
  // The boundary hidden row of its hit, into row 1 of the engine's tensor; row 0 untouched.
  std::vector<uint8_t> expected(static_cast<std::size_t>(restored.sizeBytes()), 0xa5);
  writeBytes(restored, expected);
  rig.coordinator->restoreHybridMtpBoundaryHidden(handle, 1, restored, 1);
  std::vector<uint8_t> const boundary = rig.hiddenRow(joiner.digests.at(128));
  std::copy(boundary.begin(), boundary.end(),
            expected.begin() + static_cast<std::ptrdiff_t>(boundary.size()));
  EXPECT_EQ(readBytes(restored), expected);
  EXPECT_EQ(rig.coordinator->counters().boundaryHiddenRestores, 1u);
  rig.verifyResumed(joiner, 129, 128, "joiner");  // base, the draft one row short, recurrent

  // Two chunks; the endpoint reads what its chunks computed.
  rig.executeBase(joiner, 1, 129, 140);
  ASSERT_EQ(rig.coordinator->completePrefillChunk(handle, 1, 140), kOk);
  EXPECT_EQ(rig.records().size(), 2u) << "a Hybrid-MTP chunk's end is not kept";
  Tensor const hidden = rig.hiddenStates(joiner, 129, joiner.promptLength);
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->publishHybridMtpEndpoint(handle, 1, joiner.promptLength, hidden,
                                                        joiner.promptLength - 1 - 129);
      },
      {"publishHybridMtpEndpoint",
       "row 1: residentStateLength 149 beyond its completed chunks "
       "(140 tokens): complete its last chunk"}));
  rig.executeBase(joiner, 1, 140, joiner.promptLength);
  rig.executeDraft(joiner, 1, 128, joiner.promptLength - 1);
  ASSERT_EQ(rig.coordinator->completePrefillChunk(handle, 1, joiner.promptLength), kOk);
  ASSERT_EQ(rig.coordinator->publishHybridMtpEndpoint(handle, 1, joiner.promptLength, hidden,
                                                      joiner.promptLength - 1 - 129),
            kOk);
  EXPECT_EQ(rig.records().size(), 3u) << "the joiner's endpoint at 149";
  EXPECT_EQ(rig.coordinator->counters().hybridMtpPublications, 3u);
  joiner.sample();
  ContextCacheSequenceAdvance const lookahead{&joiner.tokens.back(), 1, joiner.promptLength};
  ASSERT_EQ(rig.coordinator->finalizeSequenceAdmission(handle, 1, lookahead), kOk);
  EXPECT_EQ(rig.records().size(), 3u) << "finalisation captures nothing more";
  EXPECT_TRUE(throwsError(
      [&] {
        (void)rig.coordinator->publishHybridMtpEndpoint(handle, 1, joiner.promptLength,
                                                        founderHidden, 0);
      },
      {"row 1: a Hybrid-MTP row restores and publishes"}))
      << "finalised";
  ASSERT_EQ(rig.step(handle, {&founder, &joiner}, {2, 3}, {0, 1}, {0, 1}, true), kOk);
  EXPECT_EQ(rig.records().size(), 3u) << "kPrefillStateOnly: no decode-end checkpoint";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  // The joiner's next turn restores the joiner's endpoint.
  Seq next(concatenated(joiner.tokens, tokenRun(5, 3)), 0);
  std::vector<int32_t> starts;
  Handle third = rig.admit({&next}, true, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{149});
  ASSERT_EQ(rig.mtpPrefill(third, next), kOk);  // verifies base, draft, recurrent and hidden
  ASSERT_EQ(rig.coordinator->finish(third), kOk);
  rig.expectQuiescent();
}

// vLLM's recompute on Hybrid-MTP: preempting a row publishes nothing more (its prompt endpoint
// is what kPrefillStateOnly keeps); once compacted away, its prompt and generated tokens admitted
// again resume from that endpoint, boundary hidden row included, and go on as a joiner.
TEST_P(HybridMtpCoordinatorTest, APreemptedRowResumesFromItsPromptEndpointAsAJoiner) {
  SpecRigOptions options = mtp();
  options.recurrentSlots = 8;
  options.partialSlots = 8;
  SpecRig rig(device(), options);
  Seq a(tokenRun(70, 100), 0);
  Seq b(tokenRun(129, 300), 1);
  Handle handle = rig.admit({&a, &b}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, {&a, &b}), kOk);
  ASSERT_EQ(rig.step(handle, {&a, &b}, {2, 3}, {0, 1}, {}, true), kOk);
  std::size_t const records = rig.records().size();
  ASSERT_EQ(records, 2u);
  EXPECT_TRUE(
      throwsError([&] { (void)rig.coordinator->preemptSequence(handle, 2); }, {"preemptSequence"}));
  ASSERT_EQ(rig.coordinator->preemptSequence(handle, 1), kOk);
  EXPECT_EQ(rig.coordinator->counters().preemptions, 1u);
  EXPECT_EQ(rig.records().size(), records) << "kPrefillStateOnly: nothing more to publish";
  Tensor mapping({2}, DataType::kInt32, device());
  std::vector<int32_t> const keepFirst{0, -1};
  rig.coordinator->beginBatchCompaction(handle, keepFirst, 1, mapping);
  ASSERT_EQ(rig.coordinator->compactBatch(handle), kOk);
  rig.pool.setActiveBatchSize(1);
  rig.draftPool->setActiveBatchSize(1);

  // The preempted sequence again, on a fresh resident: its prompt and what it generated.
  Seq resumed(b.tokens, 1);
  auto const admitted =
      rig.coordinator->admitSequence(handle, promptAdmissionOf(resumed), SpecRig::kSpecHeadroom);
  ASSERT_EQ(admitted.status, kOk);
  EXPECT_EQ(admitted.prefillStart, 129) << "its prompt endpoint";
  rig.pool.setActiveBatchSize(2);
  rig.draftPool->setActiveBatchSize(2);
  Tensor restored({2, rig.options.hiddenWidth}, DataType::kFloat16, device());
  rig.coordinator->restoreHybridMtpBoundaryHidden(handle, 1, restored, 0);
  std::vector<uint8_t> const rows = readBytes(restored);
  EXPECT_EQ(std::vector<uint8_t>(rows.begin(), rows.begin() + rig.options.hiddenWidth * 2),
            rig.hiddenRow(resumed.digests.at(128)));
  rig.verifyResumed(resumed, 129, 128, "resumed");
  rig.executeBase(resumed, 1, 129, resumed.promptLength);
  rig.executeDraft(resumed, 1, 128, resumed.promptLength - 1);
  ASSERT_EQ(rig.coordinator->completePrefillChunk(handle, 1, resumed.promptLength), kOk);
  Tensor const hidden = rig.hiddenStates(resumed, 129, resumed.promptLength);
  ASSERT_EQ(rig.coordinator->publishHybridMtpEndpoint(handle, 1, resumed.promptLength, hidden,
                                                      resumed.promptLength - 1 - 129),
            kOk);
  resumed.sample();
  ContextCacheSequenceAdvance const lookahead{&resumed.tokens.back(), 1, resumed.promptLength};
  ASSERT_EQ(rig.coordinator->finalizeSequenceAdmission(handle, 1, lookahead), kOk);
  EXPECT_EQ(rig.records().size(), records + 1) << "the resumed prompt's own endpoint";
  ASSERT_EQ(rig.step(handle, {&a, &resumed}, {1, 2}, {0, 0}, {0, 1}, true), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, ThePreparedDraftLengthLeavesTheBoundaryRowToRecompute) {
  SpecRig rig(device(), mtp());
  Seq producer(tokenRun(256, 100), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, producer), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.records().front().basePagePath.size(), 1u)
      << "page-aligned: the boundary page is a full private page";

  Seq consumer(concatenated(tokenRun(256, 100), tokenRun(30, 7)), 1);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&consumer}, true, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{256});
  rig.coordinator->preparePrefill(next);
  EXPECT_EQ(readAs<int32_t>(rig.pool.kvLengths())[0], 256);
  EXPECT_EQ(readAs<int32_t>(rig.draftPool->kvLengths())[0], 255);
  rig.verifyResumed(consumer, 256, 255, "restored");
  ASSERT_EQ(rig.coordinator->finish(next), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, AVanillaRequestRestoresOnlyTheBaseHybridState) {
  SpecRig rig(device(), mtp());
  Seq producer(tokenRun(129, 100), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, producer), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  int32_t const freeDraft = rig.pools().freeCount(kDraft);

  Seq vanilla(concatenated(tokenRun(129, 100), {5}), 1);
  std::vector<int32_t> starts;
  Handle plain = rig.admit({&vanilla}, false, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{129});
  EXPECT_TRUE(rig.coordinator->draftPages(plain, 0).empty());
  EXPECT_EQ(rig.pools().freeCount(kDraft), freeDraft);
  ASSERT_EQ(rig.prefill(plain, {&vanilla}, false), kOk);  // verifies base and recurrent state
  Tensor hidden({1, rig.options.hiddenWidth}, DataType::kFloat16, device());
  EXPECT_TRUE(
      throwsError([&] { (void)rig.coordinator->publishHybridMtpEndpoint(plain, 0, 1, hidden, 0); },
                  {"publishHybridMtpEndpoint", "is not speculative"}));
  ASSERT_EQ(rig.coordinator->finish(plain), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, GuardsSkipAndMisuseThrowsWithoutChangingAnything) {
  SpecRig rig(device(), mtp());
  Seq a(tokenRun(40, 1), 0);
  Seq b(tokenRun(40, 500), 1);
  // Every row's policy: one row's override refuses the whole batch.
  ContextCacheBatchAdmission mixed = rig.batchOf({&a, &b}, true);
  mixed.sequences[1].commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->beginRequest(mixed, SpecRig::kSpecHeadroom, nullptr); },
      {"beginRequest", "needs commit policy kPrefillStateOnly, got 0 (row 1)"}));
  ContextCacheBatchAdmission generated = rig.batchOf({&a}, true);
  generated.commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->beginRequest(generated, SpecRig::kSpecHeadroom, nullptr); },
      {"needs commit policy kPrefillStateOnly, got 0"}));
  // A sequence's own policy cannot lift the rule either.
  ContextCacheBatchAdmission overridden = rig.batchOf({&a}, true);
  overridden.sequences[0].commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->beginRequest(overridden, SpecRig::kSpecHeadroom, nullptr); },
      {"needs commit policy kPrefillStateOnly, got 0"}));
  EXPECT_EQ(rig.manager().liveLeaseCount(), 0);

  Handle handle = rig.admit({&a}, true);
  Tensor hidden = rig.hiddenStates(a, 0, 40);
  Tensor narrow({40, rig.options.hiddenWidth - 1}, DataType::kFloat16, device());
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->publishHybridMtpEndpoint(handle, 0, 40, hidden, 39); },
      {"between preparePrefill and finalizePrefillPublication"}));
  rig.coordinator->preparePrefill(handle);
  rig.executeBase(a, 0, 0, 40);
  Tensor restored({1, rig.options.hiddenWidth}, DataType::kFloat16, device());
  EXPECT_TRUE(throwsError(
      [&] { rig.coordinator->restoreHybridMtpBoundaryHidden(handle, 0, restored, 0); },
      {"restoreHybridMtpBoundaryHidden", "row 0 restored no Hybrid-MTP checkpoint (reuse 0)"}));
  int32_t const freeRecurrent = rig.pools().freeCount(ResourceType::kRecurrentSnapshot);
  int64_t const syncs = rig.sync.calls();
  auto publish = [&](int32_t length, Tensor const& states, int32_t row) {
    return [&, length, row] {
      (void)rig.coordinator->publishHybridMtpEndpoint(handle, 0, length, states, row);
    };
  };
  EXPECT_TRUE(
      throwsError(publish(41, hidden, 39), {"residentStateLength 41 outside [0, prompt 40]"}));
  EXPECT_TRUE(throwsError(publish(-1, hidden, 39), {"residentStateLength -1"}));
  EXPECT_TRUE(throwsError(publish(40, hidden, 40), {"hidden row 40 outside [0, 40)"}));
  EXPECT_TRUE(throwsError(publish(40, narrow, 39), {"must be [rows, 8] of"}));
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->publishHybridMtpEndpoint(handle, 1, 40, hidden, 39); },
      {"row 1 outside the batch of 1"}));
  EXPECT_EQ(rig.coordinator->publishHybridMtpEndpoint(handle, 0, 0, hidden, 0), kOk);
  EXPECT_EQ(rig.sync.calls(), syncs);
  EXPECT_EQ(rig.pools().freeCount(ResourceType::kRecurrentSnapshot), freeRecurrent);
  EXPECT_TRUE(rig.records().empty());
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  Seq bypassed(tokenRun(40, 1), 0);
  ContextCacheBatchAdmission bypass = rig.batchOf({&bypassed}, true);
  bypass.lookupPolicy = ContextCacheLookupPolicy::kBypass;
  auto begun = rig.coordinator->beginRequest(bypass, SpecRig::kSpecHeadroom, nullptr);
  ASSERT_EQ(begun.status, kOk);
  Handle skipped = std::move(begun.admission->request);
  ASSERT_EQ(rig.mtpPrefill(skipped, bypassed), kOk);
  EXPECT_TRUE(rig.records().empty()) << "a bypass row never publishes";
  ASSERT_EQ(rig.coordinator->finish(skipped), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, AFailedEndpointSynchronisationPoisonsAndQuarantines) {
  SpecRig rig(device(), mtp());
  Seq producer(tokenRun(129, 100), 0);
  {
    Handle handle = rig.admit({&producer}, true);
    rig.sync.failNext();
    EXPECT_EQ(rig.mtpPrefill(handle, producer), ContextCacheStatus::kPoisoned);
    EXPECT_FALSE(handle.valid());
    EXPECT_EQ(rig.coordinator->quarantinedRequestCount(), 1);
    EXPECT_TRUE(rig.records().empty());
  }
  EXPECT_EQ(rig.coordinator->shutdown(), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, TheEndpointApiRefusesOtherDeployments) {
  SpecRig rig(device());  // EAGLE
  Seq seq(tokenRun(40, 1), 0);
  Handle handle = rig.admit({&seq}, true);
  rig.coordinator->preparePrefill(handle);
  Tensor hidden({40, 8}, DataType::kFloat16, device());
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->publishHybridMtpEndpoint(handle, 0, 40, hidden, 39); },
      {"publishHybridMtpEndpoint", "the deployment is not Hybrid-MTP (row 0, length 40)"}));
  EXPECT_TRUE(
      throwsError([&] { rig.coordinator->restoreHybridMtpBoundaryHidden(handle, 0, hidden, 0); },
                  {"restoreHybridMtpBoundaryHidden",
                   "the deployment is not Hybrid-MTP (row 0, destination row 0)"}));
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
}

TEST_P(HybridMtpCoordinatorTest, ABaseOnlyCheckpointAndAnEndpointOfOneLengthCoexist) {
  SpecRig rig(device(), mtp());
  // A vanilla request publishes a base-only checkpoint at 129 (page 128) ...
  Seq vanilla(tokenRun(129, 100), 0);
  Handle plain = rig.admit({&vanilla}, false);
  ASSERT_EQ(rig.prefill(plain, {&vanilla}, false), kOk);
  ASSERT_EQ(rig.coordinator->finish(plain), kOk);
  ASSERT_EQ(rig.records().size(), 1u);
  EXPECT_FALSE(rig.records().front().specState.has_value());
  // ... which must not stop a speculative request from publishing its endpoint at 129.
  Seq producer(tokenRun(129, 100), 1);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, producer), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.coordinator->counters().hybridMtpPublications, 1u);
  ASSERT_EQ(rig.records().size(), 2u);
  Seq consumer(concatenated(tokenRun(129, 100), tokenRun(11, 7)), 0);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&consumer}, true, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{129});
  ASSERT_EQ(rig.mtpPrefill(next, consumer), kOk);
  ASSERT_EQ(rig.coordinator->finish(next), kOk);
  // A second endpoint at 129 is still deduplicated (first committer wins within one kind).
  Seq again(tokenRun(129, 100), 1);
  Handle repeat = rig.admit({&again}, true);
  ASSERT_EQ(rig.mtpPrefill(repeat, again), kOk);
  ASSERT_EQ(rig.coordinator->finish(repeat), kOk);
  EXPECT_EQ(rig.records().size(), 3u) << "the two checkpoints at 129 and the consumer's at 140";
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, AnEndpointDoesNotBlockABaseOnlyCheckpointOfOneLength) {
  SpecRig rig(device(), mtp());
  Seq producer(tokenRun(256, 100), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, producer), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  ASSERT_EQ(rig.records().size(), 1u);
  // Page-aligned: the vanilla plan cannot use the endpoint (1 block, not 2), so the vanilla
  // request must publish its own base-only checkpoint at 256.
  Seq vanilla(tokenRun(256, 100), 1);
  Handle plain = rig.admit({&vanilla}, false);
  ASSERT_EQ(rig.prefill(plain, {&vanilla}, false), kOk);
  ASSERT_EQ(rig.coordinator->finish(plain), kOk);
  EXPECT_EQ(rig.records().size(), 2u);
  Seq consumer(concatenated(tokenRun(256, 100), {5}), 0);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&consumer}, false, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{256});
  ASSERT_EQ(rig.prefill(next, {&consumer}, false), kOk);
  ASSERT_EQ(rig.coordinator->finish(next), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, AnEndpointBelowTheRestoredLengthThrowsAndChangesNothing) {
  SpecRig rig(device(), mtp());
  Seq producer(tokenRun(129, 100), 0);
  Handle handle = rig.admit({&producer}, true);
  ASSERT_EQ(rig.mtpPrefill(handle, producer), kOk);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  Seq consumer(concatenated(tokenRun(129, 100), tokenRun(71, 7)), 1);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&consumer}, true, &starts);
  ASSERT_EQ(starts, std::vector<int32_t>{129});
  rig.coordinator->preparePrefill(next);
  Tensor hidden = rig.hiddenStates(consumer, 129, 200);
  int32_t const freeRecurrent = rig.pools().freeCount(ResourceType::kRecurrentSnapshot);
  int64_t const syncs = rig.sync.calls();
  EXPECT_TRUE(
      throwsError([&] { (void)rig.coordinator->publishHybridMtpEndpoint(next, 0, 100, hidden, 0); },
                  {"publishHybridMtpEndpoint", "residentStateLength 100", "129"}));
  EXPECT_EQ(rig.sync.calls(), syncs);
  EXPECT_EQ(rig.pools().freeCount(ResourceType::kRecurrentSnapshot), freeRecurrent);
  EXPECT_EQ(rig.records().size(), 1u);
  EXPECT_EQ(rig.coordinator->counters().hybridMtpPublications, 1u);
  ASSERT_EQ(rig.coordinator->finish(next), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridMtpCoordinatorTest, TheReplayTailIsNeverPublished) {
  SpecRig rig(device(), mtp());
  std::vector<int32_t> const turn = tokenRun(89, 100);
  Seq producer(concatenated(turn, tokenRun(40, 9000)), 0);  // 40 generation-prompt tokens
  auto begin = [&](ContextCacheBatchAdmission const& batch) {
    return [&rig, batch] {
      (void)rig.coordinator->beginRequest(batch, rig.headroomOf(batch.speculativeRequest), nullptr);
    };
  };
  ContextCacheBatchAdmission batch = rig.batchOf({&producer}, true);
  batch.replayTailLength = -1;
  EXPECT_TRUE(throwsError(begin(batch), {"beginRequest", "replay tail length -1 is negative"}));
  batch.replayTailLength = 129;
  EXPECT_TRUE(throwsError(begin(batch), {"replay tail of 129 tokens leaves nothing"}));
  ContextCacheBatchAdmission plain = rig.batchOf({&producer}, false);
  plain.replayTailLength = 40;
  EXPECT_TRUE(throwsError(begin(plain), {"applies to Hybrid-MTP requests only"}));
  EXPECT_EQ(rig.manager().liveLeaseCount(), 0);

  batch.replayTailLength = 40;
  auto begun = rig.coordinator->beginRequest(batch, SpecRig::kSpecHeadroom, nullptr);
  ASSERT_EQ(begun.status, kOk);
  Handle handle = std::move(begun.admission->request);
  rig.coordinator->preparePrefill(handle);
  Tensor hidden = rig.hiddenStates(producer, 0, 129);
  int64_t const syncs = rig.sync.calls();
  EXPECT_TRUE(throwsError(
      [&] { (void)rig.coordinator->publishHybridMtpEndpoint(handle, 0, 90, hidden, 89); },
      {"publishHybridMtpEndpoint", "residentStateLength 90 reaches into the replay tail",
       "publish at most 89"}));
  EXPECT_EQ(rig.sync.calls(), syncs);
  EXPECT_TRUE(rig.records().empty());
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  // The runtime's split prefill: the stable predecessor, its endpoint, then the tail.
  auto retried = rig.coordinator->beginRequest(batch, SpecRig::kSpecHeadroom, nullptr);
  ASSERT_EQ(retried.status, kOk);
  Handle again = std::move(retried.admission->request);
  rig.coordinator->preparePrefill(again);
  rig.executeBase(producer, 0, 0, 89);
  rig.executeDraft(producer, 0, 0, 88);
  ASSERT_EQ(rig.coordinator->publishHybridMtpEndpoint(again, 0, 89, hidden, 88), kOk);
  rig.executeBase(producer, 0, 89, 129);
  rig.executeDraft(producer, 0, 88, 128);
  producer.sample();
  ContextCacheSequenceAdvance const advance{&producer.tokens.back(), 1, 129};
  ASSERT_EQ(rig.coordinator->finalizePrefillPublication(again, {&advance, 1}), kOk);
  ASSERT_EQ(rig.coordinator->finish(again), kOk);
  EXPECT_EQ(rig.records().size(), 1u) << "one endpoint, at the predecessor's 89 tokens";
  Seq next(concatenated(turn, tokenRun(60, 20000)), 1);  // the next turn: another continuation
  std::vector<int32_t> starts;
  Handle consumer = rig.admit({&next}, true, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{89});
  ASSERT_EQ(rig.mtpPrefill(consumer, next), kOk);
  ASSERT_EQ(rig.coordinator->finish(consumer), kOk);
  rig.expectQuiescent();
}

INSTANTIATE_TEST_SUITE_P(Devices, HybridMtpCoordinatorTest, allDeviceTypes(), deviceName);

// ------------------------------------------------------------------------------- profiles

TEST(SpeculativeCoordinatorConstructionTest, ValidatesProfilesAgainstDraftResourcesAndBudgets) {
  SpecRigOptions const o;
  KVCachePool pool(CoordinatorRig::poolConfig(DeviceType::kCPU, SpecRig::kvOptions(o, 16)));
  KVCachePool draft(CoordinatorRig::poolConfig(DeviceType::kCPU, SpecRig::kvOptions(o, 8)));
  KVPageTable table(o.maxBatch, o.maxPagesPerSeq, 16, PageTableMode::kDense, DeviceType::kCPU);
  KVPageTable draftTable(o.maxBatch, o.maxPagesPerSeq, 8, PageTableMode::kDense, DeviceType::kCPU);
  KVPageTable wrongPages(o.maxBatch, o.maxPagesPerSeq, 9, PageTableMode::kDense, DeviceType::kCPU);
  KVPageTable moreRows(o.maxBatch + 1, o.maxPagesPerSeq, 8, PageTableMode::kDense,
                       DeviceType::kCPU);
  RigOptions smallPages = SpecRig::kvOptions(o, 8);
  smallPages.pageSize = 64;
  KVCachePool otherPage(CoordinatorRig::poolConfig(DeviceType::kCPU, smallPages));
  HybridRigOptions hybridOptions;
  RecurrentStatePool recurrent(HybridRig::recurrentConfig(DeviceType::kCPU, hybridOptions));
  int64_t const recurrentBytes = SnapshotStorage::recurrentBytesPerSlot(recurrent);
  int64_t const hiddenBytes = SnapshotStorage::boundaryHiddenBytesPerSlot(8, DataType::kFloat16);
  int64_t const partialBytes =
      SnapshotStorage::partialKvBytesPerSlot(pool) + SnapshotStorage::partialKvBytesPerSlot(draft);

  ContextCacheConfig config;
  config.recurrentSnapshotPoolBytes = 3 * (recurrentBytes + hiddenBytes) + recurrentBytes;
  config.partialKvSnapshotPoolBytes = 2 * partialBytes + partialBytes / 2;
  ContextCacheDeploymentProfile eagle;
  eagle.speculative = SpecReuseContract{true, 1};
  ContextCacheDeploymentProfile shared;
  shared.speculative = SpecReuseContract{false, 0};
  ContextCacheDeploymentProfile mtp = eagle;
  mtp.baseStateKind = BaseStateKind::kHybrid;
  mtp.boundaryHiddenWidth = 8;
  auto construct = [](ContextCacheConfig const& c, ContextCacheDeploymentProfile const& p,
                      ContextCachePhysicalResources const& r) {
    return [=] { ContextCacheCoordinator coordinator(c, p, r, nullptr); };
  };
  {
    ContextCacheCoordinator coordinator(config, mtp,
                                        {&pool, &table, &draft, &draftTable, &recurrent}, nullptr);
    ResourcePools const& pools = coordinator.manager().pools();
    EXPECT_EQ(pools.capacity(ResourceType::kRecurrentSnapshot), 3)
        << "each slot is charged its boundary hidden row";
    EXPECT_EQ(pools.capacity(ResourceType::kPartialKvSnapshot), 2)
        << "each slot is charged the paired draft page";
    EXPECT_EQ(pools.capacity(kDraft), 8);
    ASSERT_NE(coordinator.snapshots(), nullptr);
    EXPECT_TRUE(coordinator.snapshots()->hasDraft());
    EXPECT_TRUE(coordinator.snapshots()->hasBoundaryHidden());
    EXPECT_TRUE(coordinator.supportsLiveSequenceAdmission()) << "Hybrid-MTP joiners";
  }
  EXPECT_NO_THROW(construct(config, eagle, {&pool, &table, &draft, &draftTable, nullptr})());
  EXPECT_NO_THROW(construct(config, shared, {&pool, &table, nullptr, nullptr, nullptr})());
  EXPECT_TRUE(throwsError(construct(config, eagle, {&pool, &table, nullptr, nullptr, nullptr}),
                          {"ContextCacheCoordinator",
                           "a paged speculative deployment needs draftPool and draftPageTable"}));
  EXPECT_TRUE(
      throwsError(construct(config, shared, {&pool, &table, &draft, &draftTable, nullptr}),
                  {"draft resources given to a speculative deployment whose draft has no paged"}));
  EXPECT_TRUE(throwsError(construct(config, eagle, {&pool, &table, &draft, &wrongPages, nullptr}),
                          {"draft page table addresses 9 pages but the draft pool has 8"}));
  EXPECT_TRUE(throwsError(construct(config, eagle, {&pool, &table, &draft, &moreRows, nullptr}),
                          {"draft table has 3 rows and draft pool KV lengths 2 but the base "
                           "table has 2"}));
  EXPECT_TRUE(
      throwsError(construct(config, eagle, {&pool, &table, &otherPage, &draftTable, nullptr}),
                  {"draft pages hold 64 tokens but base pages 128"}));
  ContextCacheDeploymentProfile bad = eagle;
  bad.speculative->futureDependencyTokens = -1;
  EXPECT_TRUE(throwsError(construct(config, bad, {&pool, &table, &draft, &draftTable, nullptr}),
                          {"futureDependencyTokens must be >= 0, got -1"}));
  bad = mtp;
  bad.speculative = SpecReuseContract{false, 0};
  EXPECT_TRUE(throwsError(construct(config, bad, {&pool, &table, nullptr, nullptr, &recurrent}),
                          {"a Hybrid-MTP deployment needs an own-KV draft"}));
  bad = mtp;
  bad.boundaryHiddenWidth = 0;
  EXPECT_TRUE(throwsError(construct(config, bad, {&pool, &table, &draft, &draftTable, &recurrent}),
                          {"a Hybrid-MTP deployment needs boundaryHiddenWidth > 0, got 0"}));
  bad = eagle;
  bad.boundaryHiddenWidth = 8;
  EXPECT_TRUE(throwsError(construct(config, bad, {&pool, &table, &draft, &draftTable, nullptr}),
                          {"boundaryHiddenWidth 8 is for Hybrid-MTP deployments only"}));
  bad = eagle;
  bad.baseStateKind = BaseStateKind::kPureRecurrent;
  EXPECT_TRUE(throwsError(construct(config, bad, {nullptr, nullptr, nullptr, nullptr, &recurrent}),
                          {"a pure-recurrent deployment cannot be speculative"}));
}

}  // namespace
}  // namespace mkv::test
