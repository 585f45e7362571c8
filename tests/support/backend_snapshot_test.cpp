/// BackendSnapshot's difference report (the capture itself is exercised by the lifecycle driver
/// and the allocation fault test on every rejected call), and what it sees of a Hybrid-MTP
/// runtime (the draft page table and pool and the checkpoint slabs) and of a sliding-window reuse
/// runtime (its sliding half and pool).

#include "support/backend_snapshot.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/snapshot_storage.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "context_cache/window_block_cache.h"

namespace mkv::test {
namespace {

TEST(BackendSnapshotTest, DifferencesNameEveryDifferingField) {
  BackendSnapshot a;
  BackendSnapshot b;
  EXPECT_EQ(differences(a, b), "");
  b.freePages = 1;
  b.tables = {3};
  b.requests = {1};
  EXPECT_FALSE(a == b);
  EXPECT_EQ(differences(a, b), "free pages, page tables, request views");
}

/// A Hybrid-MTP runtime on host tensors: base and draft pools, recurrent rows, 2 snapshot slots of
/// each kind and a boundary hidden slab.
std::unique_ptr<KVCacheRuntime> hybridMtpRuntime() {
  KVCacheRuntimeConfig config;
  config.deviceType = DeviceType::kCPU;
  config.tokensPerPage = 16;
  config.maxBatchSize = 2;
  config.maxSequenceLength = 64;
  config.model.numFullAttentionLayers = 1;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.numRecurrentLayers = 1;
  config.model.recurrentStateBytes = 16;
  config.model.recurrentConvBytes = 8;
  config.contextReuse = true;
  KVCacheSpeculativeConfig spec;
  spec.numDraftLayers = 1;
  spec.numDraftKVHeads = 1;
  spec.draftHeadDim = 4;
  spec.boundaryHiddenWidth = 8;
  config.speculative = spec;
  config.contextCache.recurrentSnapshotPoolBytes = 2 * (16 + 8 + 8 * 2);
  config.contextCache.partialKvSnapshotPoolBytes = 2 * 2 * (2 * 16 * 4 * 2);
  return KVCacheRuntime::create(config);
}

// Rejected calls of the speculative and Hybrid-MTP runtimes must leave the draft table, the draft
// KV lengths and bytes and the checkpoint slabs as they were: the snapshot sees each of them.
TEST(BackendSnapshotTest, SeesTheDraftTableAndPoolAndTheCheckpointSlabs) {
  std::unique_ptr<KVCacheRuntime> runtime = hybridMtpRuntime();
  ASSERT_NE(runtime->draftPageTable(), nullptr);
  ASSERT_NE(runtime->contextCache()->snapshots(), nullptr);
  BackendSnapshot const before = captureBackend(*runtime, true);

  runtime->draftPageTable()->setEntry(1, 0, 3);
  EXPECT_EQ(differences(before, captureBackend(*runtime, true)), "page tables");
  runtime->draftPageTable()->clearRow(1);
  ASSERT_TRUE(runtime->draftPageTable()->uploadDirty(nullptr));
  EXPECT_EQ(differences(before, captureBackend(*runtime, true)), "");

  runtime->draftPool()->setActiveBatchSize(1);
  EXPECT_EQ(differences(before, captureBackend(*runtime, true)), "KV lengths");
  int32_t const length = 5;
  runtime->draftPool()->writeLengths(0, std::span<int32_t const>(&length, 1), nullptr);
  runtime->draftPool()->setActiveBatchSize(0);
  EXPECT_EQ(differences(before, captureBackend(*runtime, true)), "KV lengths")
      << "the length of row 0, beyond the active batch";
  int32_t const zero = 0;
  runtime->draftPool()->setActiveBatchSize(1);
  runtime->draftPool()->writeLengths(0, std::span<int32_t const>(&zero, 1), nullptr);
  runtime->draftPool()->setActiveBatchSize(0);

  auto flip = [&](Tensor const& buffer) {
    auto* byte = static_cast<uint8_t*>(const_cast<void*>(buffer.rawPointer()));
    *byte ^= 0x40;
    std::string const changed = differences(before, captureBackend(*runtime, true));
    *byte ^= 0x40;
    return changed;
  };
  SnapshotStorage const& slabs = *runtime->contextCache()->snapshots();
  EXPECT_EQ(flip(runtime->draftPool()->layer(0)), "device bytes");
  EXPECT_EQ(flip(slabs.recurrentStateSlab(0)), "device bytes");
  EXPECT_EQ(flip(slabs.recurrentConvSlab(0)), "device bytes");
  EXPECT_EQ(flip(slabs.partialKvSlab(0)), "device bytes");
  EXPECT_EQ(flip(slabs.partialKvSlab(0, true)), "device bytes");
  EXPECT_EQ(flip(slabs.boundaryHiddenSlab()), "device bytes");
  EXPECT_EQ(differences(before, captureBackend(*runtime, true)), "");
}

// Refusals and rejected calls of the sliding-window reuse runtime must leave its sliding half
// and pool as they were: the snapshot sees the sliding pool's pages, holders and cached blocks.
TEST(BackendSnapshotTest, SeesTheSlidingHalfAndPool) {
  KVCacheRuntimeConfig config;
  config.deviceType = DeviceType::kCPU;
  config.tokensPerPage = 16;
  config.maxBatchSize = 2;
  config.maxSequenceLength = 64;
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = 1;
  config.model.slidingWindowTokens = 16;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.contextReuse = true;
  std::unique_ptr<KVCacheRuntime> runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kSlidingWindowReuse);
  WindowBlockCache& window = *runtime->windowBlockCache();
  BackendSnapshot const before = captureBackend(*runtime, true);
  EXPECT_FALSE(before.sliding.empty());
  std::vector<PageId> taken;
  ASSERT_TRUE(window.allocate(1, taken));  // one page held
  EXPECT_EQ(differences(before, captureBackend(*runtime, true)), "sliding half and pool");
  window.release(taken[0]);
  EXPECT_EQ(differences(before, captureBackend(*runtime, true)), "");
}

}  // namespace
}  // namespace mkv::test
