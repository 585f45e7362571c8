// ContextCacheCoordinator (docs/architecture.md, "Context reuse"; docs/context_cache.md): prefix
// reuse over full paged KV on a vanilla attention-only deployment. Every reuse is checked
// byte-wise by the KV oracle; every test runs on host tensors and again on the GPU when a device
// is present.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <variant>

#include "context_cache_test_support.h"
#include "coordinator_test_rig.h"
#include "support/prometheus_text_parser.h"

namespace mkv::test {
namespace {

using Handle = ContextCacheCoordinator::RequestHandle;
constexpr ContextCacheStatus kOk = ContextCacheStatus::kOk;

class ContextCacheCoordinatorTest : public DeviceTest {};

/// Publishes `prompt` through a one-sequence request on slot 0 (prefill publication only).
void publish(CoordinatorRig& rig, std::vector<int32_t> const& prompt) {
  Seq seq(prompt, 0);
  Handle handle = rig.admit({&seq});
  ASSERT_EQ(rig.prefill(handle, {&seq}), kOk);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
}

std::vector<Hash128> keysOf(std::vector<int32_t> const& tokens, int32_t pageSize = 128) {
  return hashFullBlocks(PromptView{tokens, {}, {}}, pageSize);
}

TEST_P(ContextCacheCoordinatorTest, PublishesColdPrefixAndReusesLongestFullBlock) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  Seq cold(prompt, 0);
  std::vector<int32_t> starts;
  Handle first = rig.admit({&cold}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0});
  ASSERT_EQ(rig.prefill(first, {&cold}), kOk);
  ASSERT_EQ(rig.coordinator.finish(first), kOk);

  ContextCacheMetrics metrics = rig.coordinator.metrics();
  EXPECT_EQ(metrics.publishedRecords, 1u);
  EXPECT_EQ(metrics.records, 1);
  EXPECT_EQ(metrics.indexedBlocks, 1);  // 129 tokens: one full block, the tail stays private
  EXPECT_EQ(metrics.missCount(MissReason::kNoPrefix), 1u);
  std::vector<CacheRecord> const records = rig.records();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].key.fullBlockCount, 1);
  EXPECT_EQ(records[0].logicalBlockDigests, keysOf(prompt));

  Seq warm(concatenated(prompt, {7}), 1);
  Handle second = rig.admit({&warm}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{128});
  ASSERT_EQ(rig.coordinator.basePages(second, 0).size(), 2u);  // 130 + 1 headroom
  EXPECT_EQ(rig.coordinator.basePages(second, 0)[0], records[0].basePagePath[0]);
  ASSERT_EQ(rig.prefill(second, {&warm}), kOk);  // verifies the reused 128 positions
  EXPECT_TRUE(rig.verify(warm).ok());
  metrics = rig.coordinator.metrics();
  EXPECT_EQ(metrics.hits, 1u);
  EXPECT_EQ(metrics.matchedTokens, 128u);
  EXPECT_EQ(metrics.reusedTokens, 128u);
  ASSERT_EQ(rig.coordinator.finish(second), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, AdmissionBindsOnlyTheSchedulerOwnedResidentRow) {
  CoordinatorRig rig(device());
  Seq seq(tokenRun(200, 5), 2);
  seq.resident = ResidentRef{2, 7};
  Handle handle = rig.admit({&seq});
  std::vector<PageId> const pages(rig.coordinator.basePages(handle, 0).begin(),
                                  rig.coordinator.basePages(handle, 0).end());
  ASSERT_EQ(pages.size(), 2u);
  rig.coordinator.preparePrefill(handle);
  EXPECT_EQ(rig.mirroredPages(2), pages);
  EXPECT_TRUE(rig.mirroredPages(0).empty());
  EXPECT_TRUE(rig.mirroredPages(1).empty());
  EXPECT_EQ(rig.kvLengths(), std::vector<int32_t>{0});
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  EXPECT_TRUE(rig.mirroredPages(2).empty()) << "finish clears the resident row";
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, ExactFullInputHitReportsTheMatchButRewindsExecution) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(128, 40);
  publish(rig, prompt);
  ContextCacheMetrics const before = rig.coordinator.metrics();
  Seq again(prompt, 1);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&again}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0}) << "the last token must be recomputed for logits";
  ContextCacheMetrics const after = rig.coordinator.metrics();
  EXPECT_EQ(after.fullInputRewinds, before.fullInputRewinds + 1);
  EXPECT_EQ(after.matchedTokens, before.matchedTokens + 128);
  EXPECT_EQ(after.reusedTokens, before.reusedTokens);
  EXPECT_EQ(after.hits, before.hits + 1);
  ASSERT_EQ(rig.prefill(handle, {&again}), kOk);
  EXPECT_TRUE(rig.verify(again).ok());
  EXPECT_EQ(rig.coordinator.metrics().existingRecordsTouched, before.existingRecordsTouched + 1);
  EXPECT_EQ(rig.coordinator.metrics().records, 1);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

/// Forges a digest collision through the manager's publication seam: `content`'s KV (written by
/// the oracle) is published under the block keys of `victim`. The manager is owned non-const by
/// the coordinator, so the const_cast is well defined; tests only.
void publishUnderForeignKeys(CoordinatorRig& rig, std::vector<int32_t> const& content,
                             std::vector<Hash128> const& keys) {
  auto& manager = const_cast<ContextCacheManager&>(rig.manager());
  LookupRequest lookup;
  lookup.prompt = PromptView{content, {}, {}};
  lookup.policy = ContextCacheLookupPolicy::kBypass;
  lookup.baseExtraTokens = 1;
  AdmissionResult acquired = manager.admit(lookup);
  ASSERT_TRUE(acquired.lease.has_value());
  CacheSlot const slot = rig.options.maxBatch - 1;
  rig.table.setRow(slot, acquired.lease->basePages());
  rig.table.uploadDirty(nullptr);
  testing::PrefixDigests digests;
  digests.extendTokens(content);
  rig.oracle.write(slot, digests, 0, static_cast<int64_t>(content.size()));
  PromptBlocks forged = hashPromptBlocks(PromptView{content, {}, {}}, rig.options.pageSize);
  ASSERT_LE(keys.size(), forged.keys.size());
  std::copy(keys.begin(), keys.end(), forged.keys.begin());
  PublishResult const published =
      manager.publish(*acquired.lease, forged, static_cast<int32_t>(content.size()));
  ASSERT_EQ(published.status, PublishStatus::kPublished);
  acquired.lease->release();
  rig.table.clearRow(slot);
  rig.table.uploadDirty(nullptr);
}

TEST_P(ContextCacheCoordinatorTest, DigestCollisionNeverHandsOutAnotherPromptsKv) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const victim = tokenRun(129, 100);
  std::vector<int32_t> const other = tokenRun(129, 9000);
  publishUnderForeignKeys(rig, other, keysOf(victim));
  ASSERT_TRUE(rig.manager().index().find(keysOf(victim)[0]).has_value());

  Seq seq(victim, 0);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&seq}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0}) << "a verified-away digest hit is a miss";
  EXPECT_GE(rig.coordinator.metrics().verificationRejects, 1u);
  ASSERT_EQ(rig.prefill(handle, {&seq}), kOk);
  testing::OracleReport const report = rig.verify(seq);
  EXPECT_TRUE(report.ok()) << report.firstMismatch;
  EXPECT_EQ(rig.coordinator.metrics().rejectedPublications, 1u)
      << "the victim's own publication must not overwrite the first committer either";
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, WithoutVerificationTheForgedCollisionIsCaughtByTheOracle) {
  // Control of the test above: the seam really produces a colliding entry, and reusing it
  // would be data corruption that the oracle reports.
  RigOptions options;
  options.verifyTokens = false;
  CoordinatorRig rig(device(), options);
  std::vector<int32_t> const victim = tokenRun(129, 100);
  publishUnderForeignKeys(rig, tokenRun(129, 9000), keysOf(victim));
  Seq seq(victim, 0);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&seq}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{128});
  rig.coordinator.preparePrefill(handle);
  EXPECT_EQ(rig.oracle.verify(0, seq.digests, 0, 128).mismatches, 128);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
}

TEST_P(ContextCacheCoordinatorTest, LongestPrefixStopsAtTheFirstMissingBlock) {
  RigOptions options;
  options.verifyTokens = false;  // only the hole stops the walk
  CoordinatorRig rig(device(), options);
  std::vector<int32_t> const prompt = tokenRun(394, 300);  // 3 full blocks + 10
  std::vector<Hash128> keys = keysOf(prompt);
  keys[1] = Hash128{0x1234, 0x5678};  // block 1 is indexed under an unrelated digest
  publishUnderForeignKeys(rig, prompt, keys);
  std::vector<Hash128> const real = keysOf(prompt);
  ASSERT_TRUE(rig.manager().index().find(real[0]).has_value());
  ASSERT_FALSE(rig.manager().index().find(real[1]).has_value());
  ASSERT_TRUE(rig.manager().index().find(real[2]).has_value()) << "block 2 is indexed";

  Seq seq(concatenated(prompt, {1}), 0);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&seq}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{128});
  ASSERT_EQ(rig.prefill(handle, {&seq}), kOk);
  EXPECT_TRUE(rig.verify(seq).ok());
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
}

TEST_P(ContextCacheCoordinatorTest, EvictsLruUnderPressureKeepingSharedAncestorsAndPinnedPages) {
  RigOptions options;
  options.numPages = 8;
  options.eventQueueCapacity = 64;
  options.evictionPolicy = EvictionPolicyKind::kLru;  // the order this test pins
  CoordinatorRig rig(device(), options);
  std::vector<int32_t> const s = tokenRun(128, 1000);
  std::vector<int32_t> const a = concatenated(concatenated(s, tokenRun(128, 2000)), {1});
  std::vector<int32_t> const b = concatenated(concatenated(s, tokenRun(128, 3000)), {1});
  std::vector<int32_t> const c = tokenRun(128, 4000);
  publish(rig, a);                     // R_A = [S, A]
  publish(rig, b);                     // R_B = [S, B], shares S
  publish(rig, concatenated(c, {1}));  // R_C = [C]
  publish(rig, a);                     // duplicate: R_A becomes MRU; LRU order is now B, C, A
  ASSERT_EQ(rig.freePages(), 4);
  auto recordOf = [&](std::vector<int32_t> const& tokens, int32_t blocks) -> RecordId {
    CacheRecord const* record = rig.manager().records().find(
        RecordKey{keysOf(tokens)[static_cast<std::size_t>(blocks - 1)], blocks});
    return record != nullptr ? record->id : kNoRecord;
  };
  RecordId const recordA = recordOf(a, 2);
  RecordId const recordB = recordOf(b, 2);
  RecordId const recordC = recordOf(c, 1);
  PageId const pageS = *rig.manager().index().find(keysOf(s)[0]);
  PageId const pageA = *rig.manager().index().find(keysOf(a)[1]);
  PageId const pageB = *rig.manager().index().find(keysOf(b)[1]);
  PageId const pageC = *rig.manager().index().find(keysOf(c)[0]);
  (void)rig.coordinator.drainEvents();

  // A live request pins C (reused) and keeps executing while others are admitted.
  Seq live(concatenated(c, tokenRun(172, 5000)), 0);
  std::vector<int32_t> starts;
  Handle liveHandle = rig.admit({&live}, &starts);
  ASSERT_EQ(starts, std::vector<int32_t>{128});
  ASSERT_EQ(rig.prefill(liveHandle, {&live}), kOk);  // publishes R_L = [C, L0] (MRU)
  ASSERT_EQ(rig.freePages(), 2);
  (void)rig.coordinator.drainEvents();

  auto bypass = [&](int32_t tokens, CacheSlot slot) {
    Seq seq(tokenRun(tokens, 7000 + slot), slot);
    ContextCacheBatchAdmission batch = rig.batchOf({&seq});
    batch.lookupPolicy = ContextCacheLookupPolicy::kBypass;
    return rig.begin(batch);
  };
  auto removedPages = [&]() {
    std::vector<PageId> pages;
    for (KvEvent const& event : rig.coordinator.drainEvents()) {
      if (auto const* removed = std::get_if<BlockRemoved>(&event)) {
        pages.push_back(removed->page);
      }
    }
    std::sort(pages.begin(), pages.end());
    return pages;
  };

  // 3 pages, 2 free: the LRU record R_B goes; S survives through R_A.
  {
    auto first = bypass(300, 1);
    ASSERT_EQ(first.status, kOk);
    EXPECT_FALSE(rig.hasRecord(recordB));
    EXPECT_TRUE(rig.hasRecord(recordC));
    EXPECT_TRUE(rig.hasRecord(recordA));
    EXPECT_EQ(removedPages(), std::vector<PageId>{pageB});
    EXPECT_EQ(rig.cacheRefs(pageS), 1) << "shared ancestor kept by R_A";
    LookupRequest lookup;
    std::vector<int32_t> const reader = concatenated(a, {5});
    lookup.prompt = PromptView{reader, {}, {}};
    lookup.baseExtraTokens = 1;
    EXPECT_EQ(rig.manager().lookup(lookup).plan.reuseTokenLength, 256);
    ASSERT_EQ(rig.coordinator.finish(first.admission->request), kOk);
  }
  // 4 pages, 3 free: R_C is next but its only page is pinned by the live request, so the walk
  // passes over it (evicting it would free nothing) and R_A goes.
  auto second = bypass(400, 2);
  ASSERT_EQ(second.status, kOk);
  EXPECT_TRUE(rig.hasRecord(recordC));
  EXPECT_FALSE(rig.hasRecord(recordA));
  std::vector<PageId> expected{pageS, pageA};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removedPages(), expected);
  EXPECT_EQ(rig.activeRefs(pageC), 1);
  EXPECT_TRUE(rig.manager().index().find(keysOf(c)[0]).has_value()) << "R_L still holds C";
  EXPECT_EQ(rig.coordinator.metrics().evictedRecords, 2u);
  EXPECT_EQ(rig.coordinator.metrics().reclaimed(ResourceType::kBaseKvPage), 3u);

  // Nothing reclaimable is left (R_L's pages are pinned): an admission is refused and changes
  // nothing.
  ManagerState const state = captureState(rig.manager());
  std::vector<std::vector<int32_t>> rows;
  rows.reserve(3);
  for (CacheSlot slot = 0; slot < 3; ++slot) {
    rows.push_back(rig.hostRow(slot));
  }
  Seq refused(tokenRun(200, 9100), 1);
  auto const before = rig.coordinator.counters().refusedRequests;
  EXPECT_EQ(rig.begin(rig.batchOf({&refused})).status, ContextCacheStatus::kRequestFailed);
  EXPECT_EQ(rig.coordinator.counters().refusedRequests, before + 1);
  EXPECT_EQ(captureState(rig.manager()), state);
  for (CacheSlot slot = 0; slot < 3; ++slot) {
    EXPECT_EQ(rig.hostRow(slot), rows[static_cast<std::size_t>(slot)]);
    EXPECT_EQ(rig.deviceRow(slot), rows[static_cast<std::size_t>(slot)]);
  }
  EXPECT_TRUE(removedPages().empty());

  // The live request's KV survived every eviction.
  for (int step = 0; step < 3; ++step) {
    ASSERT_EQ(rig.decode(liveHandle, {&live}), kOk);
  }
  testing::OracleReport const report = rig.verify(live);
  EXPECT_TRUE(report.ok()) << report.firstMismatch;
  EXPECT_EQ(report.positionsChecked, 303);
  ASSERT_EQ(rig.coordinator.finish(second.admission->request), kOk);
  ASSERT_EQ(rig.coordinator.finish(liveHandle), kOk);
  rig.expectQuiescent();
  expectManagerInvariants(rig.manager());
}

TEST_P(ContextCacheCoordinatorTest, InfeasibleBatchAdmissionChangesNothing) {
  // Two records are reclaimable, a bystander holds two private pages, two pages are free. The
  // batch's first sequence alone could evict its way in, the whole batch cannot: refused with
  // nothing evicted.
  RigOptions options;
  options.numPages = 8;
  CoordinatorRig rig(device(), options);
  publish(rig, tokenRun(257, 100));
  publish(rig, tokenRun(257, 900));
  Seq bystander(tokenRun(200, 5000), 2);
  Handle held = rig.admit({&bystander});
  ASSERT_EQ(rig.freePages(), 2);
  ManagerState const state = captureState(rig.manager());
  ContextCacheMetrics const before = rig.coordinator.metrics();
  Seq first(tokenRun(300, 7000), 0);
  Seq second(tokenRun(400, 8000), 1);
  ContextCacheBatchAdmission batch = rig.batchOf({&first, &second});
  batch.lookupPolicy = ContextCacheLookupPolicy::kBypass;
  EXPECT_EQ(rig.begin(batch).status, ContextCacheStatus::kRequestFailed);
  EXPECT_EQ(captureState(rig.manager()), state);
  ContextCacheMetrics const after = rig.coordinator.metrics();
  EXPECT_EQ(after.evictedRecords, before.evictedRecords);
  EXPECT_EQ(after.records, before.records);
  EXPECT_EQ(after.indexedBlocks, before.indexedBlocks);
  EXPECT_EQ(after.freeResources, before.freeResources);
  EXPECT_TRUE(rig.mirroredPages(0).empty());
  EXPECT_TRUE(rig.mirroredPages(1).empty());
  // The same residents are free for a batch that fits.
  Seq small(tokenRun(100, 7000), 0);
  Handle fits = rig.admit({&small});
  ASSERT_EQ(rig.coordinator.finish(fits), kOk);
  ASSERT_EQ(rig.coordinator.finish(held), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, RecordLimitEvictsTheLruRecord) {
  RigOptions options;
  options.maxRecords = 2;
  CoordinatorRig rig(device(), options);
  std::vector<int32_t> const first = tokenRun(129, 100);
  publish(rig, first);
  publish(rig, tokenRun(129, 1100));
  publish(rig, tokenRun(129, 2100));
  ContextCacheMetrics const metrics = rig.coordinator.metrics();
  EXPECT_EQ(metrics.records, 2);
  EXPECT_EQ(metrics.evictedRecords, 1u);
  EXPECT_FALSE(rig.manager().index().find(keysOf(first)[0]).has_value());
  Seq again(first, 0);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&again}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0});
  EXPECT_EQ(rig.coordinator.metrics().missCount(MissReason::kEvicted), 1u);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, RecordLimitZeroKeepsNothing) {
  RigOptions options;
  options.maxRecords = 0;
  CoordinatorRig rig(device(), options);
  std::vector<int32_t> const prompt = tokenRun(300, 100);
  publish(rig, prompt);
  EXPECT_EQ(rig.coordinator.metrics().records, 0);
  EXPECT_EQ(rig.coordinator.metrics().indexedBlocks, 0);
  EXPECT_EQ(rig.freePages(), options.numPages);
  Seq again(prompt, 0);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&again}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0});
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, DuplicatePublicationKeepsTheFirstProducer) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  Seq one(prompt, 0);
  Seq two(prompt, 1);
  Handle handle = rig.admit({&one, &two});
  PageId const firstProducer = rig.coordinator.basePages(handle, 0)[0];
  PageId const secondProducer = rig.coordinator.basePages(handle, 1)[0];
  ASSERT_NE(firstProducer, secondProducer);
  ASSERT_EQ(rig.prefill(handle, {&one, &two}), kOk);
  ContextCacheMetrics const metrics = rig.coordinator.metrics();
  EXPECT_EQ(metrics.publishedRecords, 1u);
  EXPECT_EQ(metrics.existingRecordsTouched, 1u);
  EXPECT_EQ(rig.records().at(0).basePagePath, std::vector<PageId>{firstProducer});
  EXPECT_EQ(rig.cacheRefs(secondProducer), 0) << "the duplicate stays private to its lease";
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  EXPECT_EQ(rig.freePages(), rig.options.numPages - 1);

  Seq reader(concatenated(prompt, {3}), 2);
  Handle readerHandle = rig.admit({&reader});
  EXPECT_EQ(rig.coordinator.basePages(readerHandle, 0)[0], firstProducer);
  ASSERT_EQ(rig.prefill(readerHandle, {&reader}), kOk);
  ASSERT_EQ(rig.coordinator.finish(readerHandle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, DecodePublicationIncludesTheGeneratedPageBoundary) {
  CoordinatorRig rig(device());
  Seq seq(tokenRun(255, 100), 0);
  Handle handle = rig.admit({&seq});
  ASSERT_EQ(rig.prefill(handle, {&seq}), kOk);
  EXPECT_EQ(rig.coordinator.metrics().indexedBlocks, 1);
  ASSERT_EQ(rig.decode(handle, {&seq}, {0}), kOk);  // lookahead KV written: 256 committed
  EXPECT_EQ(rig.coordinator.committedLength(handle, 0), 256);
  std::vector<CacheRecord> const records = rig.records();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records.back().key.fullBlockCount, 2);
  EXPECT_EQ(rig.coordinator.counters().decodePublications, 1u);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);

  Seq reader(concatenated(std::vector<int32_t>(seq.tokens.begin(), seq.tokens.begin() + 256), {42}),
             1);
  std::vector<int32_t> starts;
  Handle readerHandle = rig.admit({&reader}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{256});
  ASSERT_EQ(rig.prefill(readerHandle, {&reader}), kOk);  // oracle: generated token's KV reused
  ASSERT_EQ(rig.coordinator.finish(readerHandle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, PrefillStateOnlyPublishesNothingAtDecodeEnd) {
  CoordinatorRig rig(device());
  Seq seq(tokenRun(255, 100), 0);
  ContextCacheBatchAdmission batch = rig.batchOf({&seq});
  batch.commitPolicy = ContextCacheCommitPolicy::kPrefillStateOnly;
  auto begun = rig.begin(batch);
  ASSERT_EQ(begun.status, kOk);
  Handle handle = std::move(begun.admission->request);
  ASSERT_EQ(rig.prefill(handle, {&seq}), kOk);
  ContextCacheMetrics const before = rig.coordinator.metrics();
  EXPECT_EQ(before.publishedRecords, 1u);
  ASSERT_EQ(rig.decode(handle, {&seq}, {0}), kOk);
  ContextCacheMetrics const after = rig.coordinator.metrics();
  EXPECT_EQ(after.publishedRecords, 1u);
  EXPECT_EQ(after.existingRecordsTouched, before.existingRecordsTouched);
  EXPECT_EQ(after.records, 1);
  EXPECT_EQ(rig.coordinator.counters().decodePublications, 0u);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, ASequencesOwnCommitPolicyOverridesTheBatchsAtDecodeEnd) {
  for (ContextCacheCommitPolicy const batchPolicy :
       {ContextCacheCommitPolicy::kIncludingGeneratedTokens,
        ContextCacheCommitPolicy::kPrefillStateOnly}) {
    SCOPED_TRACE(static_cast<int>(batchPolicy));
    ContextCacheCommitPolicy const ownPolicy =
        batchPolicy == ContextCacheCommitPolicy::kPrefillStateOnly
            ? ContextCacheCommitPolicy::kIncludingGeneratedTokens
            : ContextCacheCommitPolicy::kPrefillStateOnly;
    CoordinatorRig rig(device());
    Seq own(tokenRun(255, 100), 0);
    Seq inherits(tokenRun(255, 900), 1);
    ContextCacheBatchAdmission batch = rig.batchOf({&own, &inherits});
    batch.commitPolicy = batchPolicy;
    batch.sequences[0].commitPolicy = ownPolicy;
    auto begun = rig.begin(batch);
    ASSERT_EQ(begun.status, kOk);
    Handle handle = std::move(begun.admission->request);
    EXPECT_EQ(rig.coordinator.commitPolicy(handle, 0), ownPolicy);
    EXPECT_EQ(rig.coordinator.commitPolicy(handle, 1), batchPolicy);
    ASSERT_EQ(rig.prefill(handle, {&own, &inherits}), kOk);
    EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 2u);
    // Both complete at 256 committed tokens; only the row under kIncludingGeneratedTokens
    // publishes its generated block.
    ASSERT_EQ(rig.decode(handle, {&own, &inherits}, {0, 1}), kOk);
    EXPECT_EQ(rig.coordinator.counters().decodePublications, 1u);
    EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 3u);
    ASSERT_EQ(rig.coordinator.finish(handle), kOk);
    rig.expectQuiescent();
  }
}

TEST_P(ContextCacheCoordinatorTest, BatchAppliesTheLookupPolicyPerSequence) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  publish(rig, prompt);
  ContextCacheMetrics const before = rig.coordinator.metrics();
  Seq bypassed(concatenated(prompt, {1}), 0);
  Seq cached(concatenated(prompt, {2}), 1);
  ContextCacheBatchAdmission batch = rig.batchOf({&bypassed, &cached});
  batch.sequences[0].lookupPolicy = ContextCacheLookupPolicy::kBypass;
  auto begun = rig.begin(batch);
  ASSERT_EQ(begun.status, kOk);
  EXPECT_EQ(begun.admission->prefillStarts, (std::vector<int32_t>{0, 128}));
  ContextCacheMetrics const after = rig.coordinator.metrics();
  EXPECT_EQ(after.bypasses, before.bypasses + 1);
  EXPECT_EQ(after.hits, before.hits + 1);
  ASSERT_EQ(rig.prefill(begun.admission->request, {&bypassed, &cached}), kOk);
  ASSERT_EQ(rig.coordinator.finish(begun.admission->request), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, BypassUsesManagedPagesAndPublishesNothing) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(255, 100);
  Seq seq(prompt, 1);
  ContextCacheBatchAdmission batch = rig.batchOf({&seq});
  batch.lookupPolicy = ContextCacheLookupPolicy::kBypass;
  auto begun = rig.begin(batch);
  ASSERT_EQ(begun.status, kOk);
  Handle handle = std::move(begun.admission->request);
  EXPECT_EQ(rig.freePages(), rig.options.numPages - 2);
  ASSERT_EQ(rig.prefill(handle, {&seq}), kOk);
  EXPECT_EQ(rig.mirroredPages(1).size(), 2u);
  ASSERT_EQ(rig.decode(handle, {&seq}, {0}), kOk);
  EXPECT_TRUE(rig.verify(seq).ok());
  EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 0u);
  EXPECT_EQ(rig.coordinator.metrics().indexedBlocks, 0);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  Seq reader(concatenated(prompt, {1, 2}), 0);
  std::vector<int32_t> starts;
  Handle readerHandle = rig.admit({&reader}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0});
  EXPECT_EQ(rig.coordinator.metrics().missCount(MissReason::kNoPrefix), 1u);
  ASSERT_EQ(rig.coordinator.finish(readerHandle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, HoldSentinelIsLegalButAZeroAdvanceWithALengthThrows) {
  CoordinatorRig rig(device());
  Seq running(tokenRun(100, 1), 0);
  Seq cancelled(tokenRun(255, 1000), 1);
  Handle handle = rig.admit({&running, &cancelled});
  ASSERT_EQ(rig.prefill(handle, {&running, &cancelled}), kOk);
  ASSERT_EQ(rig.coordinator.prepareDecodeStep(handle, kVanilla), kOk);
  ContextCacheSequenceAdvance const advance = rig.executeDecode(running, 0);
  std::vector<ContextCacheSequenceAdvance> bad{advance, {nullptr, 0, cancelled.promptLength}};
  EXPECT_TRUE(throwsError(
      [&] { rig.coordinator.completeDecodeStep(handle, bad, std::span<int32_t const>{}); },
      {"completeDecodeStep", "hold sentinel"}));
  std::vector<ContextCacheSequenceAdvance> good{advance, {nullptr, 0, kHoldCommittedStateLength}};
  EXPECT_EQ(rig.coordinator.completeDecodeStep(handle, good, std::span<int32_t const>{}), kOk);
  EXPECT_EQ(rig.coordinator.committedLength(handle, 1), 255);
  EXPECT_EQ(rig.coordinator.committedLength(handle, 0), 101);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, RejectsMalformedProgressBeforeMutation) {
  CoordinatorRig rig(device());
  Seq seq(tokenRun(255, 100), 0);
  Handle handle = rig.admit({&seq});
  rig.coordinator.preparePrefill(handle);
  rig.executePrefill(seq, 0, 0);
  seq.sample();
  std::vector<ContextCacheSequenceAdvance> advances{{&seq.tokens.back(), 1, 254}};
  EXPECT_TRUE(throwsError([&] { rig.coordinator.finalizePrefillPublication(handle, advances); },
                          {"finalizePrefillPublication", "254"}));
  EXPECT_EQ(rig.coordinator.committedLength(handle, 0), 0);
  EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 0u);
  advances[0].committedStateLength = 255;
  ASSERT_EQ(rig.coordinator.finalizePrefillPublication(handle, advances), kOk);
  EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 1u);

  ASSERT_EQ(rig.coordinator.prepareDecodeStep(handle, kVanilla), kOk);
  ContextCacheSequenceAdvance step = rig.executeDecode(seq, 0);
  step.committedStateLength += 1;
  std::vector<ContextCacheSequenceAdvance> wrong{step};
  std::vector<int32_t> const completed{0};
  EXPECT_TRUE(throwsError([&] { rig.coordinator.completeDecodeStep(handle, wrong, completed); },
                          {"completeDecodeStep", "257"}));
  EXPECT_EQ(rig.coordinator.committedLength(handle, 0), 255);
  EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 1u);
  wrong[0].committedStateLength = 256;
  ASSERT_EQ(rig.coordinator.completeDecodeStep(handle, wrong, completed), kOk);
  EXPECT_EQ(rig.coordinator.committedLength(handle, 0), 256);
  EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 2u);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
}

TEST_P(ContextCacheCoordinatorTest, CompactionRejectsSurvivorReordering) {
  CoordinatorRig rig(device());
  Seq a(tokenRun(50, 1), 0);
  Seq b(tokenRun(60, 100), 1);
  Handle handle = rig.admit({&a, &b});
  ASSERT_EQ(rig.prefill(handle, {&a, &b}), kOk);
  Tensor mapping({3}, DataType::kInt32, device());
  std::vector<int32_t> const reordered{1, 0};
  EXPECT_TRUE(
      throwsError([&] { rig.coordinator.beginBatchCompaction(handle, reordered, 2, mapping); },
                  {"beginBatchCompaction", "order"}));
  // Nothing was staged: the request still decodes and a valid compaction works.
  ASSERT_EQ(rig.decode(handle, {&a, &b}), kOk);
  std::vector<int32_t> const dropFirst{-1, 0};
  rig.coordinator.beginBatchCompaction(handle, dropFirst, 1, mapping);
  EXPECT_EQ(readAs<int32_t>(mapping), dropFirst);
  ASSERT_EQ(rig.coordinator.compactBatch(handle), kOk);
  EXPECT_EQ(rig.coordinator.batchSize(handle), 1);
  EXPECT_EQ(rig.kvLengths(), std::vector<int32_t>{61});
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

/// Which synchronisation point fails in the poison tests.
enum class FailingSync { kAbandonment, kFinish, kCompaction };

TEST_P(ContextCacheCoordinatorTest, EveryFailedSynchronisationPoisonsAndShutdownFreesEveryPage) {
  for (FailingSync point :
       {FailingSync::kAbandonment, FailingSync::kFinish, FailingSync::kCompaction}) {
    SCOPED_TRACE(static_cast<int>(point));
    CoordinatorRig rig(device());
    publish(rig, tokenRun(129, 100));
    Seq a(tokenRun(200, 100), 0);
    Seq b(tokenRun(300, 5000), 1);
    {
      Handle handle = rig.admit({&a, &b});
      ASSERT_EQ(rig.prefill(handle, {&a, &b}), kOk);
      Tensor mapping({3}, DataType::kInt32, device());
      rig.sync.failNext();
      if (point == FailingSync::kAbandonment) {
        ASSERT_EQ(rig.coordinator.prepareDecodeStep(handle, kVanilla), kOk);  // work pending
      } else if (point == FailingSync::kFinish) {
        ASSERT_EQ(rig.coordinator.prepareDecodeStep(handle, kVanilla), kOk);
        EXPECT_EQ(rig.coordinator.finish(handle), ContextCacheStatus::kPoisoned);
        EXPECT_FALSE(handle.valid());
        EXPECT_EQ(handle.id(), 0u);
      } else {
        std::vector<int32_t> const dropSecond{0, -1};
        rig.coordinator.beginBatchCompaction(handle, dropSecond, 1, mapping);
        EXPECT_EQ(rig.coordinator.compactBatch(handle), ContextCacheStatus::kPoisoned);
        EXPECT_FALSE(handle.valid());
        EXPECT_EQ(handle.id(), 0u) << "an invalidated handle keeps no request id";
      }
    }  // abandonment (or nothing left to abandon)
    EXPECT_EQ(rig.sync.pendingFailures(), 0) << "the injected failure was consumed";
    EXPECT_TRUE(rig.coordinator.poisoned());
    EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 1);
    EXPECT_EQ(rig.coordinator.activeRequestCount(), 0);
    EXPECT_GT(rig.manager().liveLeaseCount(), 0) << "quarantined pages stay leased";
    // The runtime hands the (quarantined) resident 0 out again: poisoned, not a contract error.
    Seq next(tokenRun(100, 1), 0);
    ContextCacheStatus status = kOk;
    EXPECT_NO_THROW(status = rig.begin(rig.batchOf({&next})).status);
    EXPECT_EQ(status, ContextCacheStatus::kPoisoned);
    EXPECT_EQ(rig.coordinator.shutdown(), kOk);
    EXPECT_FALSE(rig.coordinator.poisoned());
    EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 0);
    rig.expectQuiescent();
    EXPECT_TRUE(rig.mirroredPages(0).empty());
    EXPECT_TRUE(rig.mirroredPages(1).empty());
    Handle after = rig.admit({&next});
    ASSERT_EQ(rig.coordinator.finish(after), kOk);
  }
}

TEST_P(ContextCacheCoordinatorTest, ShutdownDrainsEveryQuarantinedRequest) {
  CoordinatorRig rig(device());
  Seq a(tokenRun(200, 100), 0);
  Seq b(tokenRun(300, 5000), 1);
  {
    Handle first = rig.admit({&a});
    Handle second = rig.admit({&b});
    rig.coordinator.preparePrefill(first);
    rig.sync.failNext();
    first = Handle{};  // abandoned with pending work: the sync fails
    EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 1);
    rig.coordinator.preparePrefill(second);
    rig.sync.failNext();
  }  // second abandoned, its sync fails too
  EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 2);
  EXPECT_EQ(rig.freePages(), rig.options.numPages - 5);
  rig.sync.failNext();
  EXPECT_EQ(rig.coordinator.shutdown(), ContextCacheStatus::kPoisoned) << "a failed drain";
  EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 2);
  EXPECT_EQ(rig.coordinator.shutdown(), kOk);
  EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 0);
  EXPECT_EQ(rig.freePages(), rig.options.numPages);
  rig.expectQuiescent();
}

// The shared registry's abandonment (src/resources/request_registry.h): replacing a live handle
// abandons its request; a failed synchronisation quarantines it (counted), the handle is reset,
// and shutdown() recovers every page.
TEST_P(ContextCacheCoordinatorTest,
       ReplacingAHandleWhoseSynchronisationFailsQuarantinesAndResetsIt) {
  CoordinatorRig rig(device());
  Seq a(tokenRun(200, 100), 0);
  Seq b(tokenRun(300, 5000), 1);
  Handle handle = rig.admit({&a, &b});
  ASSERT_EQ(rig.prefill(handle, {&a, &b}), kOk);
  ASSERT_EQ(rig.coordinator.prepareDecodeStep(handle, kVanilla), kOk);  // work pending
  std::vector<PageId> const mirrored = rig.mirroredPages(1);
  rig.sync.failNext();
  handle = Handle{};
  EXPECT_EQ(rig.sync.failures(), 1);
  EXPECT_FALSE(handle.valid());
  EXPECT_EQ(handle.id(), 0u);
  EXPECT_TRUE(rig.coordinator.poisoned());
  EXPECT_EQ(rig.coordinator.activeRequestCount(), 0);
  EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 1);
  EXPECT_EQ(rig.coordinator.counters().quarantinedRequests, 1u);
  EXPECT_EQ(rig.coordinator.residentRowState(0), ResidentRowState::kQuarantined);
  EXPECT_EQ(rig.coordinator.residentRowState(1), ResidentRowState::kQuarantined);
  EXPECT_EQ(rig.mirroredPages(1), mirrored) << "kernels may still read the rows";
  EXPECT_GT(rig.manager().liveLeaseCount(), 0) << "quarantined pages stay leased";
  EXPECT_EQ(rig.coordinator.shutdown(), kOk);
  EXPECT_FALSE(rig.coordinator.poisoned());
  EXPECT_EQ(rig.coordinator.quarantinedRequestCount(), 0);
  EXPECT_EQ(rig.coordinator.counters().quarantinedRequests, 1u) << "drained ones stay counted";
  EXPECT_EQ(rig.coordinator.residentRowState(0), ResidentRowState::kFree);
  EXPECT_EQ(rig.manager().liveLeaseCount(), 0);
  EXPECT_TRUE(rig.mirroredPages(1).empty());
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, ConcurrentRequestsOverlapButOnlyOneExecutes) {
  CoordinatorRig rig(device());
  Seq a(tokenRun(200, 100), 0);
  Seq b(tokenRun(300, 5000), 1);
  Handle first = rig.admit({&a});
  Handle second = rig.admit({&b});
  EXPECT_EQ(rig.coordinator.activeRequestCount(), 2);
  ASSERT_EQ(rig.prefill(first, {&a}), kOk);
  EXPECT_TRUE(throwsError([&] { rig.coordinator.preparePrefill(second); },
                          {"preparePrefill", "executing"}));
  ASSERT_EQ(rig.decode(first, {&a}), kOk);
  ASSERT_EQ(rig.coordinator.finish(first), kOk);
  ASSERT_EQ(rig.prefill(second, {&b}), kOk);
  EXPECT_TRUE(rig.verify(b).ok());
  ASSERT_EQ(rig.coordinator.finish(second), kOk);
  EXPECT_EQ(rig.coordinator.shutdown(), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, OversizedPromptThrowsAndLeavesNothingHeld) {
  CoordinatorRig rig(device());
  Seq fits(tokenRun(100, 1), 0);
  Seq oversized(tokenRun(512, 1), 1);  // 512 + 1 headroom needs 5 pages of a 4-page row
  EXPECT_TRUE(throwsError(
      [&] {
        rig.begin(rig.batchOf({&fits, &oversized}));
      },
      {"beginRequest", "5 pages"}));
  EXPECT_EQ(rig.coordinator.activeRequestCount(), 0);
  EXPECT_EQ(rig.manager().liveLeaseCount(), 0);
  Seq valid(tokenRun(511, 1), 1);
  Handle handle = rig.admit({&fits, &valid});
  ASSERT_EQ(rig.prefill(handle, {&fits, &valid}), kOk);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, MetricsAndPrometheusIncludeTheCoordinatorCounters) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  publish(rig, prompt);  // cold producer
  Seq reader(concatenated(prompt, {1}), 0);
  Seq bypassed(tokenRun(100, 5), 1);
  ContextCacheBatchAdmission batch = rig.batchOf({&reader, &bypassed});
  batch.sequences[1].lookupPolicy = ContextCacheLookupPolicy::kBypass;
  auto begun = rig.begin(batch);
  ASSERT_EQ(begun.status, kOk);
  Handle handle = std::move(begun.admission->request);
  ASSERT_EQ(rig.prefill(handle, {&reader, &bypassed}), kOk);
  ASSERT_EQ(rig.decode(handle, {&reader, &bypassed}, {0}), kOk);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);

  ContextCacheCoordinatorCounters const& counters = rig.coordinator.counters();
  EXPECT_EQ(counters.requests, 2u);
  EXPECT_EQ(counters.refusedRequests, 0u);
  EXPECT_EQ(counters.prefillPublications, 3u);
  EXPECT_EQ(counters.decodePublications, 1u);
  EXPECT_EQ(counters.synchronizations, 0u) << "the runtime synchronised; nothing was pending";
  ContextCacheMetrics const metrics = rig.coordinator.metrics();
  EXPECT_EQ(metrics.admittedSequences, 3u);
  EXPECT_EQ(metrics.lookups, 2u);
  EXPECT_EQ(metrics.hits, 1u);
  EXPECT_EQ(metrics.bypasses, 1u);
  EXPECT_EQ(metrics.reusedTokens, 128u);
  EXPECT_EQ(metrics.publishedRecords, 1u);
  EXPECT_EQ(metrics.existingRecordsTouched, 1u);  // the reader's prefill end; decode adds no block
  EXPECT_EQ(metrics.capacities.baseKvPages, rig.options.numPages);
  EXPECT_EQ(metrics.freeResources.baseKvPages, rig.options.numPages - 1);

  EXPECT_EQ(metrics.queriedTokens, 259u) << "the producer's 129 and the reader's 130 tokens";

  std::string const text = rig.coordinator.toPrometheus();
  test::PrometheusParse const parsed = test::parsePrometheusText(text);
  ASSERT_TRUE(parsed.text.has_value()) << parsed.error;
  EXPECT_EQ(parsed.text->samples.at("managedkv_prefix_cache_queries_total"), 259);
  EXPECT_EQ(parsed.text->samples.at("managedkv_prefix_cache_hits_total"), 128);
  for (char const* line : {"managedkv_coordinator_requests_total 2\n",
                           "managedkv_coordinator_prefill_publications_total 3\n",
                           "managedkv_coordinator_decode_publications_total 1\n",
                           "managedkv_coordinator_live_admissions_total 0\n",
                           "# TYPE managedkv_coordinator_synchronizations_total counter\n",
                           "managedkv_hits_total 1\n", "managedkv_reused_tokens_total 128\n"}) {
    EXPECT_NE(text.find(line), std::string::npos) << "missing: " << line;
  }
  EXPECT_NE(rig.coordinator.toPrometheus("engine_").find("engine_coordinator_requests_total 2"),
            std::string::npos);
  // Occupancy: the base pool's leased share (0: nothing runs) under our name and vLLM's, and the
  // pages only cached records hold.
  EXPECT_EQ(parsed.text->samples.at("managedkv_kv_usage_ratio"), 0.0);
  EXPECT_EQ(parsed.text->samples.at("managedkv_kv_cache_usage_perc"), 0.0);
  EXPECT_EQ(metrics.reclaimableResources.baseKvPages,
            rig.coordinator.manager().pools().reclaimableCount(ResourceType::kBaseKvPage));
  EXPECT_GT(metrics.reclaimableResources.baseKvPages, 0) << "the published blocks stay cached";
  EXPECT_EQ(metrics.leased(ResourceType::kBaseKvPage), 0);
  EXPECT_NE(text.find(fmt::format("managedkv_pool_reclaimable{{type=\"base_kv_page\"}} {}\n",
                                  metrics.reclaimableResources.baseKvPages)),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("managedkv_pool_leased{type=\"base_kv_page\"} 0\n"), std::string::npos);
  // Every counter is exported, from its one entry in kCoordinatorCounterFields, with its value.
  for (CoordinatorCounterField const& counter : kCoordinatorCounterFields) {
    std::string const series = "managedkv_" + std::string(counter.name) + "_total";
    ASSERT_EQ(parsed.text->samples.count(series), 1u) << "not exported: " << series;
    EXPECT_EQ(parsed.text->samples.at(series), static_cast<double>(counters.*counter.value))
        << series;
  }
  rig.expectQuiescent();
}

TEST(CoordinatorCounterFieldsTest, ListEveryCounterOnceUnderADistinctName) {
  // Every field of the struct is a uint64_t counter, so the list covers them all exactly when
  // it has one entry per field and no field twice (a field added without an entry fails here).
  EXPECT_EQ(sizeof(ContextCacheCoordinatorCounters),
            kCoordinatorCounterFields.size() * sizeof(uint64_t));
  ContextCacheCoordinatorCounters counters;
  std::set<std::string_view> names;
  uint64_t mark = 1;
  for (CoordinatorCounterField const& counter : kCoordinatorCounterFields) {
    EXPECT_TRUE(names.insert(counter.name).second) << "named twice: " << counter.name;
    EXPECT_FALSE(counter.help.empty()) << counter.name;
    EXPECT_EQ(counters.*counter.value, 0u) << "listed twice: " << counter.name;
    counters.*counter.value = mark++;
  }
}

TEST_P(ContextCacheCoordinatorTest, EventsReportEveryStoredAndRemovedBlock) {
  RigOptions options;
  options.numPages = 4;
  options.eventQueueCapacity = 16;
  CoordinatorRig rig(device(), options);
  std::vector<int32_t> const prompt = tokenRun(300, 100);  // 2 blocks published
  Seq seq(prompt, 0);
  Handle handle = rig.admit({&seq});
  std::vector<PageId> const pages(rig.coordinator.basePages(handle, 0).begin(),
                                  rig.coordinator.basePages(handle, 0).end());
  ASSERT_EQ(rig.prefill(handle, {&seq}), kOk);
  ASSERT_EQ(rig.coordinator.finish(handle), kOk);
  std::vector<Hash128> const keys = keysOf(prompt);
  std::vector<KvEvent> events = rig.coordinator.drainEvents();
  ASSERT_EQ(events.size(), 2u);
  for (std::size_t b = 0; b < 2; ++b) {
    auto const* stored = std::get_if<BlockStored>(&events[b]);
    ASSERT_NE(stored, nullptr);
    EXPECT_EQ(stored->digest, keys[b]);
    EXPECT_EQ(stored->parent, b == 0 ? kBlockChainRoot : keys[b - 1]);
    EXPECT_EQ(stored->page, pages[b]);
    EXPECT_EQ(stored->tokenCount, 128);
  }
  // A 4-page bypass request needs every page: the record is evicted.
  Seq big(tokenRun(400, 7), 1);
  ContextCacheBatchAdmission batch = rig.batchOf({&big});
  batch.lookupPolicy = ContextCacheLookupPolicy::kBypass;
  auto begun = rig.begin(batch);
  ASSERT_EQ(begun.status, kOk);
  events = rig.coordinator.drainEvents();
  ASSERT_EQ(events.size(), 2u);
  std::vector<PageId> removed;
  for (KvEvent const& event : events) {
    auto const* gone = std::get_if<BlockRemoved>(&event);
    ASSERT_NE(gone, nullptr);
    EXPECT_TRUE(gone->digest == keys[0] || gone->digest == keys[1]);
    removed.push_back(gone->page);
  }
  std::sort(removed.begin(), removed.end());
  std::vector<PageId> expected(pages.begin(), pages.begin() + 2);
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);
  ASSERT_EQ(rig.coordinator.finish(begun.admission->request), kOk);
  EXPECT_TRUE(rig.coordinator.drainEvents().empty());
  rig.expectQuiescent();
}

TEST_P(ContextCacheCoordinatorTest, ResetPrefixCacheWaitsForEveryRequestThenClearsTheCache) {
  RigOptions options;
  options.eventQueueCapacity = 16;
  CoordinatorRig rig(device(), options);
  std::vector<int32_t> const prompt = tokenRun(300, 100);
  publish(rig, prompt);
  Seq warm(concatenated(prompt, {7}), 0);
  Handle running = rig.admit({&warm});
  rig.coordinator.drainEvents();
  EXPECT_FALSE(rig.coordinator.resetPrefixCache()) << "a request is active";
  EXPECT_EQ(rig.manager().index().size(), 2);
  ASSERT_EQ(rig.prefill(running, {&warm}), kOk);
  ASSERT_EQ(rig.coordinator.finish(running), kOk);
  {
    Seq abandoned(tokenRun(200, 9000), 1);
    Handle handle = rig.admit({&abandoned});
    rig.coordinator.preparePrefill(handle);
    rig.sync.failNext();
  }  // abandoned with pending work, its synchronisation fails: quarantined, poisoned
  ASSERT_TRUE(rig.coordinator.poisoned());
  EXPECT_FALSE(rig.coordinator.resetPrefixCache()) << "poisoned, a request in quarantine";
  ASSERT_EQ(rig.coordinator.shutdown(), kOk);
  rig.coordinator.drainEvents();
  EXPECT_EQ(rig.coordinator.metrics().prefixCacheResets, 0u);

  ASSERT_TRUE(rig.coordinator.resetPrefixCache());
  std::vector<KvEvent> const events = rig.coordinator.drainEvents();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(events[0]));
  EXPECT_EQ(rig.freePages(), rig.options.numPages);
  EXPECT_EQ(rig.manager().index().size(), 0);
  EXPECT_TRUE(rig.records().empty());
  std::string const text = rig.coordinator.toPrometheus();
  EXPECT_NE(text.find("managedkv_prefix_cache_resets_total 1\n"), std::string::npos) << text;

  Seq again(concatenated(prompt, {8}), 0);
  std::vector<int32_t> starts;
  Handle after = rig.admit({&again}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0}) << "nothing to reuse after the reset";
  ASSERT_EQ(rig.prefill(after, {&again}), kOk);
  EXPECT_TRUE(rig.verify(again).ok());
  ASSERT_EQ(rig.coordinator.finish(after), kOk);
  rig.expectQuiescent();
}

INSTANTIATE_TEST_SUITE_P(Devices, ContextCacheCoordinatorTest, allDeviceTypes(), deviceName);

TEST(ContextCacheCoordinatorConstructionTest,
     RejectsUnsupportedDeploymentsAndInconsistentResources) {
  RigOptions const options;
  KVCachePool pool(CoordinatorRig::poolConfig(DeviceType::kCPU, options));
  KVPageTable table(options.maxBatch, options.maxPagesPerSeq, options.numPages,
                    PageTableMode::kDense, DeviceType::kCPU);
  KVPageTable sparse(options.maxBatch, options.maxPagesPerSeq, options.numPages,
                     PageTableMode::kSparseWindow, DeviceType::kCPU);
  KVPageTable wider(options.maxBatch, options.maxPagesPerSeq, options.numPages + 1,
                    PageTableMode::kDense, DeviceType::kCPU);
  KVPageTable taller(options.maxBatch + 1, options.maxPagesPerSeq, options.numPages,
                     PageTableMode::kDense, DeviceType::kCPU);
  RecurrentStatePoolConfig recurrentConfig;
  recurrentConfig.numLayers = 1;
  recurrentConfig.numSlots = options.maxBatch - 1;
  recurrentConfig.stateBytesPerSlot = 8;
  recurrentConfig.convBytesPerSlot = 8;
  recurrentConfig.deviceType = DeviceType::kCPU;
  RecurrentStatePool recurrent(recurrentConfig);
  ContextCachePhysicalResources const valid{&pool, &table, nullptr, nullptr, nullptr};
  auto construct = [](ContextCacheConfig const& config,
                      ContextCacheDeploymentProfile const& profile,
                      ContextCachePhysicalResources const& resources) {
    return [=] { ContextCacheCoordinator coordinator(config, profile, resources, nullptr); };
  };
  ContextCacheConfig config;
  ContextCacheDeploymentProfile const attention;
  EXPECT_NO_THROW(construct(config, attention, valid)());

  config.maxRecords = -1;
  EXPECT_TRUE(throwsError(construct(config, attention, valid),
                          {"ContextCacheCoordinator", "maxRecords must be >= 0, got -1"}));
  config = ContextCacheConfig{};
  config.eventQueueCapacity = -2;
  EXPECT_TRUE(throwsError(construct(config, attention, valid), {"eventQueueCapacity", "-2"}));
  config = ContextCacheConfig{};
  config.evictionPolicy = static_cast<EvictionPolicyKind>(7);
  EXPECT_TRUE(throwsError(construct(config, attention, valid),
                          {"ContextCacheCoordinator", "eviction policy 7 out of range"}));
  config = ContextCacheConfig{};
  ContextCacheDeploymentProfile hybrid;
  hybrid.baseStateKind = BaseStateKind::kHybrid;
  EXPECT_TRUE(throwsError(construct(config, hybrid, valid),
                          {"a hybrid deployment needs the recurrent state pool"}));
  ContextCacheDeploymentProfile speculative;
  speculative.speculative = SpecReuseContract{true, 1};
  EXPECT_TRUE(throwsError(construct(config, speculative, valid),
                          {"a paged speculative deployment needs draftPool and draftPageTable"}));
  EXPECT_TRUE(throwsError(construct(config, attention, {&pool, nullptr, nullptr, nullptr, nullptr}),
                          {"needs basePool and basePageTable"}));
  EXPECT_TRUE(throwsError(construct(config, attention, {&pool, &table, &pool, &table, nullptr}),
                          {"draft resources given to a non-speculative deployment"}));
  EXPECT_TRUE(throwsError(construct(config, attention, {&pool, &sparse, nullptr, nullptr, nullptr}),
                          {"the base page table must be dense"}));
  EXPECT_TRUE(throwsError(construct(config, attention, {&pool, &wider, nullptr, nullptr, nullptr}),
                          {"addresses 17 pages but the pool has 16"}));
  EXPECT_TRUE(throwsError(construct(config, attention, {&pool, &taller, nullptr, nullptr, nullptr}),
                          {"pool KV lengths hold 3 rows but the table has 4"}));
  EXPECT_TRUE(
      throwsError(construct(config, attention, {&pool, &table, nullptr, nullptr, &recurrent}),
                  {"recurrent pool has 2 slots but the table has 3 rows"}));
  if (cudaDeviceAvailable()) {
    KVPageTable gpuTable(options.maxBatch, options.maxPagesPerSeq, options.numPages,
                         PageTableMode::kDense, DeviceType::kGPU);
    EXPECT_TRUE(
        throwsError(construct(config, attention, {&pool, &gpuTable, nullptr, nullptr, nullptr}),
                    {"table on gpu but pool on cpu"}));
  }
}

/// Destroys a coordinator while one of its requests is active (the handle outlives it).
void destroyTheCoordinatorWithAnActiveRequest() {
  RigOptions const options;
  KVCachePool pool(CoordinatorRig::poolConfig(DeviceType::kCPU, options));
  KVPageTable table(options.maxBatch, options.maxPagesPerSeq, options.numPages,
                    PageTableMode::kDense, DeviceType::kCPU);
  Handle handle;
  ContextCacheCoordinator coordinator(ContextCacheConfig{}, ContextCacheDeploymentProfile{},
                                      {&pool, &table, nullptr, nullptr, nullptr}, nullptr);
  ContextCacheBatchAdmission admission;
  admission.sequences.resize(1);
  admission.sequences[0].tokenIds = tokenRun(5, 1);
  admission.sequences[0].resident = ResidentRef{0, 1};
  handle = std::move(coordinator.beginRequest(admission, {1, 0}, nullptr).admission->request);
}

TEST(ContextCacheCoordinatorDeathTest, DestroyingTheCoordinatorWithAnActiveRequestTerminates) {
  EXPECT_DEATH(destroyTheCoordinatorWithAnActiveRequest(), "destroyed with 1 active");
}

}  // namespace
}  // namespace mkv::test
