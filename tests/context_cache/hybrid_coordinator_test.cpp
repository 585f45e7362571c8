// ContextCacheCoordinator on checkpoint deployments (docs/context_cache.md, "Hybrid and
// pure-recurrent checkpoints"): hybrid (attention + recurrent) and pure-recurrent models reuse
// exact checkpoints — recurrent rows plus the valid rows of a partially filled last KV page —
// captured at the prompt end and at decode end, restored in preparePrefill. The KV and the
// recurrent state of every execution are written and verified by the oracles, so a restore is
// correct only if it is byte-exact.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "hybrid_test_rig.h"

namespace mkv::test {
namespace {

using Handle = ContextCacheCoordinator::RequestHandle;
constexpr ContextCacheStatus kOk = ContextCacheStatus::kOk;
constexpr ResourceType kRecurrent = ResourceType::kRecurrentSnapshot;
constexpr ResourceType kPartial = ResourceType::kPartialKvSnapshot;

class HybridCoordinatorTest : public DeviceTest {};

/// Byte offset of K (half 0) or V (half 1) page `page` in a layer of `pool`.
std::size_t pageOffset(KVCachePool const& pool, int32_t half, PageId page) {
  return static_cast<std::size_t>((int64_t{half} * pool.numPages() + page) * pool.pageBytes());
}

/// Bytes of token row `row` of K or V page `page` in a layer's bytes.
std::vector<uint8_t> pageRow(std::vector<uint8_t> const& layer, KVCachePool const& pool,
                             int32_t half, PageId page, int32_t row) {
  auto const tokenBytes = static_cast<std::size_t>(pool.tokenBytes());
  std::size_t const offset =
      pageOffset(pool, half, page) + static_cast<std::size_t>(row) * tokenBytes;
  return {layer.data() + offset, layer.data() + offset + tokenBytes};
}

TEST_P(HybridCoordinatorTest, ACheckpointAt129IsRestoredByteExactIntoA130TokenPrompt) {
  HybridRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  rig.publish(prompt);
  ASSERT_EQ(rig.manager().records().size(), 1u);
  CacheRecord const record = rig.manager().records().lruToMru().front();
  EXPECT_EQ(record.exactCheckpointLength, 129);
  EXPECT_EQ(record.key.fullBlockCount, 1);
  EXPECT_TRUE(record.recurrentSnapshotSlot.has_value());
  EXPECT_TRUE(record.partialKvSnapshotSlot.has_value()) << "129 % 128 != 0: one valid row";
  EXPECT_EQ(rig.coordinator->counters().checkpointCaptures, 1u);
  EXPECT_EQ(rig.coordinator->counters().checkpointPublications, 1u);

  Seq consumer(concatenated(prompt, {7}), 1);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&consumer}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{129}) << "reuse may end mid-page";
  std::span<PageId const> const pages = rig.coordinator->basePages(handle, 0);
  ASSERT_EQ(pages.size(), 2u);
  EXPECT_EQ(pages[0], record.basePagePath[0]);
  PageId const partialPage = pages[1];
  // Poison the private page the partial rows are restored into: only the valid row may change.
  std::vector<uint8_t> layer = readBytes(rig.pool->layer(0));
  for (int32_t half = 0; half < 2; ++half) {
    std::memset(layer.data() + pageOffset(*rig.pool, half, partialPage), 0xA5,
                static_cast<std::size_t>(rig.pool->pageBytes()));
  }
  writeBytes(rig.pool->layer(0), layer);
  auto const stateBytes = static_cast<std::size_t>(rig.recurrent.state(0).sizeBytes());
  writeBytes(rig.recurrent.state(0), std::vector<uint8_t>(stateBytes, 0x5A));  // overwritten

  rig.coordinator->preparePrefill(handle);
  EXPECT_EQ(rig.coordinator->counters().checkpointRestores, 1u);
  testing::OracleReport const state = rig.recurrentOracle().verify(1, consumer.digests, 129);
  EXPECT_TRUE(state.ok()) << state.firstMismatch;
  layer = readBytes(rig.pool->layer(0));
  auto const tokenBytes = static_cast<std::size_t>(rig.pool->tokenBytes());
  for (int32_t half = 0; half < 2; ++half) {
    std::vector<uint8_t> expected(tokenBytes);
    testing::KvOracle::expectedRow(consumer.digests.at(128), 0, half, expected);
    EXPECT_EQ(pageRow(layer, *rig.pool, half, partialPage, 0), expected) << "half " << half;
    for (int32_t row = 1; row < rig.options.pageSize; ++row) {
      ASSERT_EQ(pageRow(layer, *rig.pool, half, partialPage, row),
                std::vector<uint8_t>(tokenBytes, 0xA5))
          << "half " << half << " row " << row << " is beyond the checkpoint";
    }
  }
  EXPECT_EQ(readAs<int32_t>(rig.pool->kvLengths()), std::vector<int32_t>{129});
  rig.executePrefill(consumer, 0, 129);  // verifies [0, 129) and the recurrent rows
  rig.coordinator->enqueuePrefillCaptures(handle);
  consumer.sample();
  ContextCacheSequenceAdvance const advance{&consumer.tokens.back(), 1, 130};
  ASSERT_EQ(rig.coordinator->finalizePrefillPublication(handle, {&advance, 1}), kOk);
  EXPECT_EQ(rig.manager().records().size(), 2u) << "the consumer checkpointed its own prompt end";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridCoordinatorTest, OnlyCheckpointsStrictlyShorterThanThePromptAreReused) {
  HybridRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  rig.publish(prompt);
  uint64_t const captures = rig.coordinator->counters().checkpointCaptures;
  Seq again(prompt, 1);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&again}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{0}) << "the last token must run to give logits";
  ASSERT_EQ(rig.prefill(handle, {&again}), kOk);  // verifies the zeroed recurrent rows
  EXPECT_EQ(rig.coordinator->counters().checkpointCaptures, captures)
      << "the same checkpoint is cached already: no copy, no slot";
  EXPECT_EQ(rig.manager().records().size(), 1u);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridCoordinatorTest, SequencesThatReuseNothingStartFromZeroedRecurrentRows) {
  HybridRig rig(device());
  for (int32_t layer = 0; layer < rig.recurrent.numLayers(); ++layer) {
    writeBytes(rig.recurrent.state(layer),
               std::vector<uint8_t>(
                   static_cast<std::size_t>(rig.recurrent.state(layer).sizeBytes()), 0x77));
  }
  Seq cold(tokenRun(50, 1), 0);
  Seq bypassed(tokenRun(60, 1), 1);
  ContextCacheBatchAdmission batch = rig.batchOf({&cold, &bypassed});
  batch.sequences[1].lookupPolicy = ContextCacheLookupPolicy::kBypass;
  Handle handle = rig.admit({&cold, &bypassed}, nullptr, &batch);
  rig.coordinator->preparePrefill(handle);
  EXPECT_EQ(rig.recurrentBytes(0), std::vector<uint8_t>(64, 0));
  EXPECT_EQ(rig.recurrentBytes(1), std::vector<uint8_t>(64, 0));
  EXPECT_EQ(rig.coordinator->counters().checkpointRestores, 0u);
  rig.executePrefill(cold, 0, 0);
  rig.executePrefill(bypassed, 1, 0);
  rig.coordinator->enqueuePrefillCaptures(handle);
  EXPECT_EQ(rig.coordinator->counters().checkpointCaptures, 1u) << "bypass rows never capture";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk) << "finished before finalisation";
  EXPECT_EQ(rig.manager().records().size(), 0u) << "an uncommitted capture is never published";
  rig.expectQuiescent();
}

TEST_P(HybridCoordinatorTest, ADecodeEndCheckpointCostsExactlyOneSynchronisation) {
  HybridRig rig(device());
  Seq producer(tokenRun(100, 1), 0);
  Handle handle = rig.admit({&producer});
  int64_t const syncsBefore = rig.sync.calls();
  ASSERT_EQ(rig.prefill(handle, {&producer}), kOk);
  EXPECT_EQ(rig.sync.calls(), syncsBefore) << "the runtime's prefill sync covers the capture";
  ASSERT_EQ(rig.decode(handle, {&producer}), kOk);
  ASSERT_EQ(rig.decode(handle, {&producer}), kOk);
  EXPECT_EQ(rig.sync.calls(), syncsBefore) << "steps that complete nothing capture nothing";
  ASSERT_EQ(rig.decode(handle, {&producer}, {0}), kOk);
  EXPECT_EQ(rig.sync.calls(), syncsBefore + 1);
  EXPECT_EQ(rig.coordinator->counters().captureSynchronizations, 1u);
  EXPECT_EQ(rig.coordinator->committedLength(handle, 0), 103);
  EXPECT_EQ(rig.manager().records().size(), 2u) << "prompt end (100) and decode end (103)";
  EXPECT_EQ(rig.manager().records().lruToMru().back().exactCheckpointLength, 103);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);

  // The ledger (prompt + 3 accepted tokens + the lookahead without KV) continued by one token.
  Seq consumer(concatenated(producer.tokens, {9}), 1);
  std::vector<int32_t> starts;
  Handle next = rig.admit({&consumer}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{103}) << "the longest checkpoint wins";
  ASSERT_EQ(rig.prefill(next, {&consumer}), kOk);  // verifies the restored state
  ASSERT_EQ(rig.coordinator->finish(next), kOk);
  rig.expectQuiescent();
}

TEST_P(HybridCoordinatorTest, PrefillStateOnlySuppressesDecodeEndCaptures) {
  HybridRig rig(device());
  Seq producer(tokenRun(100, 1), 0);
  ContextCacheBatchAdmission batch = rig.batchOf({&producer});
  batch.commitPolicy = ContextCacheCommitPolicy::kPrefillStateOnly;
  Handle handle = rig.admit({&producer}, nullptr, &batch);
  ASSERT_EQ(rig.prefill(handle, {&producer}), kOk);
  int64_t const syncs = rig.sync.calls();
  ASSERT_EQ(rig.decode(handle, {&producer}, {0}), kOk);
  EXPECT_EQ(rig.sync.calls(), syncs);
  EXPECT_EQ(rig.manager().records().size(), 1u) << "only the prompt end";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
}

TEST_P(HybridCoordinatorTest, SnapshotPressureSkipsTheCaptureButNeverTheRequest) {
  HybridRigOptions options;
  options.recurrentSlots = 1;
  options.partialSlots = 1;
  HybridRig rig(device(), options);
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  rig.publish(prompt);
  ASSERT_EQ(rig.freeSlots(kRecurrent), 0);
  ASSERT_EQ(rig.freeSlots(kPartial), 0);
  CacheRecord const record = rig.manager().records().lruToMru().front();

  // The consumer pins the only slots (its restore source): its own capture cannot get one.
  Seq consumer(concatenated(prompt, tokenRun(20, 5)), 1);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&consumer}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{129});
  ASSERT_EQ(rig.prefill(handle, {&consumer}), kOk);
  EXPECT_EQ(rig.coordinator->counters().snapshotPressureSkips, 1u);
  EXPECT_EQ(rig.coordinator->counters().checkpointPublications, 1u) << "the producer's only";
  ASSERT_EQ(rig.manager().records().size(), 1u);
  EXPECT_EQ(rig.manager().records().lruToMru().front().id, record.id) << "kept, not evicted";
  ASSERT_EQ(rig.decode(handle, {&consumer}), kOk) << "the request carries on";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.freeSlots(kRecurrent), 0);
  rig.expectQuiescent();

  // Unpinned, the slots of the LRU record are reclaimed for a new checkpoint.
  rig.publish(tokenRun(50, 9000));
  ASSERT_EQ(rig.manager().records().size(), 1u);
  EXPECT_EQ(rig.manager().records().lruToMru().front().exactCheckpointLength, 50);
  EXPECT_EQ(rig.manager().metrics().evictedRecords, 1u);
  rig.expectQuiescent();
}

TEST_P(HybridCoordinatorTest, APureRecurrentCheckpointNeedsNoKvPage) {
  HybridRigOptions options;
  options.attention = false;
  HybridRig rig(device(), options);
  EXPECT_EQ(rig.pools().capacity(ResourceType::kBaseKvPage), 0);
  EXPECT_EQ(rig.pools().capacity(kPartial), 0);
  rig.publish(tokenRun(3, 40));
  ASSERT_EQ(rig.manager().records().size(), 1u);
  CacheRecord const record = rig.manager().records().lruToMru().front();
  EXPECT_EQ(record.exactCheckpointLength, 3);
  EXPECT_TRUE(record.basePagePath.empty());
  EXPECT_FALSE(record.partialKvSnapshotSlot.has_value());

  Seq consumer(tokenRun(4, 40), 1);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&consumer}, &starts);
  EXPECT_EQ(starts, std::vector<int32_t>{3});
  EXPECT_TRUE(rig.coordinator->basePages(handle, 0).empty());
  ASSERT_EQ(rig.prefill(handle, {&consumer}), kOk);  // verifies the restored rows
  EXPECT_EQ(rig.coordinator->counters().checkpointRestores, 1u);
  ASSERT_EQ(rig.decode(handle, {&consumer}, {0}), kOk);
  Tensor mapping({2}, DataType::kInt32, device());
  std::vector<int32_t> const drop{-1};
  rig.coordinator->beginBatchCompaction(handle, drop, 0, mapping);
  ASSERT_EQ(rig.coordinator->compactBatch(handle), kOk);
  EXPECT_EQ(rig.recurrentBytes(1), std::vector<uint8_t>(64, 0)) << "dropped rows are zeroed";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.manager().records().size(), 3u) << "3, 4 (prompt end) and 5 (decode end)";
  rig.expectQuiescent();
}

TEST_P(HybridCoordinatorTest, AFailedCaptureSynchronisationPoisonsAndQuarantines) {
  HybridRig rig(device());
  Seq producer(tokenRun(100, 1), 0);
  {
    Handle handle = rig.admit({&producer});
    ASSERT_EQ(rig.prefill(handle, {&producer}), kOk);
    int32_t const freeRecurrent = rig.freeSlots(kRecurrent);
    rig.sync.failNext();
    EXPECT_EQ(rig.decode(handle, {&producer}, {0}), ContextCacheStatus::kPoisoned);
    EXPECT_FALSE(handle.valid());
    EXPECT_TRUE(rig.coordinator->poisoned());
    EXPECT_EQ(rig.coordinator->quarantinedRequestCount(), 1);
    EXPECT_EQ(rig.freeSlots(kRecurrent), freeRecurrent - 1)
        << "the capture's slots stay leased while its copies may still run";
    EXPECT_EQ(rig.manager().records().size(), 1u) << "the failed capture is not published";
    EXPECT_EQ(rig.coordinator->finish(handle), ContextCacheStatus::kPoisoned);
  }
  Seq next(tokenRun(10, 1), 1);
  EXPECT_EQ(rig.coordinator->beginRequest(rig.batchOf({&next}), kVanilla, nullptr).status,
            ContextCacheStatus::kPoisoned);
  EXPECT_EQ(rig.coordinator->shutdown(), kOk);
  EXPECT_FALSE(rig.coordinator->poisoned());
  rig.expectQuiescent();
}

TEST_P(HybridCoordinatorTest, CompactionZeroesDroppedRecurrentRowsAndKeepsSurvivors) {
  HybridRig rig(device());
  Seq a(tokenRun(40, 1), 0);
  Seq b(tokenRun(300, 500), 1);
  Handle handle = rig.admit({&a, &b});
  ASSERT_EQ(rig.prefill(handle, {&a, &b}), kOk);
  ASSERT_EQ(rig.decode(handle, {&a, &b}, {0}), kOk);
  std::vector<uint8_t> const survivor = rig.recurrentBytes(1);
  Tensor mapping({2}, DataType::kInt32, device());
  std::vector<int32_t> const dropFirst{-1, 0};
  rig.coordinator->beginBatchCompaction(handle, dropFirst, 1, mapping);
  ASSERT_EQ(rig.coordinator->compactBatch(handle), kOk);
  EXPECT_EQ(rig.recurrentBytes(0), std::vector<uint8_t>(64, 0));
  EXPECT_EQ(rig.recurrentBytes(1), survivor);
  ASSERT_EQ(rig.decode(handle, {&b}, {0}), kOk);  // verifies b resumes from its own state
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  rig.expectQuiescent();
}

INSTANTIATE_TEST_SUITE_P(Devices, HybridCoordinatorTest, allDeviceTypes(), deviceName);

TEST(HybridCoordinatorConstructionTest, ValidatesTheProfileAgainstResourcesAndBudgets) {
  HybridRigOptions const o;
  RigOptions kv;
  kv.maxBatch = o.maxBatch;
  KVCachePool pool(CoordinatorRig::poolConfig(DeviceType::kCPU, kv));
  KVPageTable table(o.maxBatch, o.maxPagesPerSeq, kv.numPages, PageTableMode::kDense,
                    DeviceType::kCPU);
  RecurrentStatePool recurrent(HybridRig::recurrentConfig(DeviceType::kCPU, o));
  int64_t const recurrentBytes = SnapshotStorage::recurrentBytesPerSlot(recurrent);
  int64_t const partialBytes = SnapshotStorage::partialKvBytesPerSlot(pool);
  ContextCacheConfig config;
  config.recurrentSnapshotPoolBytes = 3 * recurrentBytes + 1;
  config.partialKvSnapshotPoolBytes = 2 * partialBytes;
  ContextCacheDeploymentProfile hybrid;
  hybrid.baseStateKind = BaseStateKind::kHybrid;
  ContextCacheDeploymentProfile pure;
  pure.baseStateKind = BaseStateKind::kPureRecurrent;
  auto construct = [](ContextCacheConfig const& c, ContextCacheDeploymentProfile const& p,
                      ContextCachePhysicalResources const& r) {
    return [=] { ContextCacheCoordinator coordinator(c, p, r, nullptr); };
  };
  {
    ContextCacheCoordinator coordinator(config, hybrid,
                                        {&pool, &table, nullptr, nullptr, &recurrent}, nullptr);
    EXPECT_EQ(coordinator.manager().pools().capacity(kRecurrent), 3) << "budget / bytes per slot";
    EXPECT_EQ(coordinator.manager().pools().capacity(kPartial), 2);
    ASSERT_NE(coordinator.snapshots(), nullptr);
    EXPECT_EQ(coordinator.snapshots()->totalBytes(), 3 * recurrentBytes + 2 * partialBytes);
    EXPECT_TRUE(coordinator.supportsLiveSequenceAdmission())
        << "a hybrid joiner restores at admission";
  }
  EXPECT_NO_THROW(construct(config, pure, {nullptr, nullptr, nullptr, nullptr, &recurrent})());
  {
    ContextCacheCoordinator coordinator(config, pure,
                                        {nullptr, nullptr, nullptr, nullptr, &recurrent}, nullptr);
    EXPECT_FALSE(coordinator.supportsLiveSequenceAdmission()) << "no page table to bind a joiner";
  }
  EXPECT_TRUE(throwsError(construct(config, hybrid, {&pool, &table, nullptr, nullptr, nullptr}),
                          {"ContextCacheCoordinator", "hybrid deployment needs the recurrent"}));
  EXPECT_TRUE(throwsError(construct(config, pure, {nullptr, nullptr, nullptr, nullptr, nullptr}),
                          {"pure-recurrent deployment needs the recurrent"}));
  EXPECT_TRUE(throwsError(construct(config, pure, {&pool, &table, nullptr, nullptr, &recurrent}),
                          {"pure-recurrent deployment has no KV"}));
  EXPECT_TRUE(
      throwsError(construct(config, hybrid, {nullptr, nullptr, nullptr, nullptr, &recurrent}),
                  {"needs basePool and basePageTable"}));
  ContextCacheConfig small = config;
  small.recurrentSnapshotPoolBytes = recurrentBytes - 1;
  EXPECT_TRUE(throwsError(construct(small, hybrid, {&pool, &table, nullptr, nullptr, &recurrent}),
                          {"recurrentSnapshotPoolBytes 63 holds no snapshot slot of 64 bytes"}));
  small = config;
  small.partialKvSnapshotPoolBytes = 0;
  EXPECT_TRUE(throwsError(construct(small, hybrid, {&pool, &table, nullptr, nullptr, &recurrent}),
                          {"partialKvSnapshotPoolBytes 0 holds no snapshot slot"}));
  EXPECT_NO_THROW(construct(small, pure, {nullptr, nullptr, nullptr, nullptr, &recurrent})())
      << "a pure-recurrent deployment has no partial page";
  small.enabled = false;
  EXPECT_NO_THROW(construct(small, hybrid, {&pool, &table, nullptr, nullptr, &recurrent})())
      << "without reuse no checkpoint is ever taken";
  small = config;
  small.partialKvSnapshotPoolBytes = -1;
  EXPECT_TRUE(throwsError(construct(small, hybrid, {&pool, &table, nullptr, nullptr, &recurrent}),
                          {"snapshot budgets must be >= 0", "partial -1"}));
  ContextCacheDeploymentProfile badKind;
  badKind.baseStateKind = static_cast<BaseStateKind>(7);
  EXPECT_TRUE(throwsError(construct(config, badKind, {&pool, &table, nullptr, nullptr, &recurrent}),
                          {"base state kind 7 out of range"}));
  ContextCacheDeploymentProfile hidden = hybrid;
  hidden.boundaryHiddenWidth = 16;
  EXPECT_TRUE(throwsError(construct(config, hidden, {&pool, &table, nullptr, nullptr, &recurrent}),
                          {"boundaryHiddenWidth 16 is for Hybrid-MTP"}));
  RecurrentStatePoolConfig fewer = HybridRig::recurrentConfig(DeviceType::kCPU, o);
  fewer.numSlots = o.maxBatch - 1;
  RecurrentStatePool tooFew(fewer);
  EXPECT_TRUE(throwsError(construct(config, hybrid, {&pool, &table, nullptr, nullptr, &tooFew}),
                          {"recurrent pool has 1 slots but the table has 2 rows"}));
  if (cudaDeviceAvailable()) {
    RecurrentStatePool onGpu(HybridRig::recurrentConfig(DeviceType::kGPU, o));
    EXPECT_TRUE(throwsError(construct(config, hybrid, {&pool, &table, nullptr, nullptr, &onGpu}),
                            {"recurrent pool on gpu but KV on cpu"}));
  }
}

}  // namespace
}  // namespace mkv::test
