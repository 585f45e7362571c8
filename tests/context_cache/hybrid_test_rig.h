#pragma once
/// \file hybrid_test_rig.h
/// A ContextCacheCoordinator on a checkpoint deployment (hybrid: KV pool + page table +
/// recurrent rows; pure recurrent: recurrent rows only) with real snapshot slabs, a scriptable
/// synchroniser, and an engine model that writes and verifies both the KV (KvOracle) and the
/// recurrent state (RecurrentOracle) of every execution, so a test proves that a restored
/// checkpoint holds exactly the state of the same prefix.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "context_cache_test_support.h"
#include "coordinator_test_rig.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/snapshot_storage.h"
#include "mkv/testing/kv_oracle.h"

namespace mkv::test {

struct HybridRigOptions {
  bool attention = true;  ///< false: pure recurrent (no KV pool, no page table)
  int32_t pageSize = 128;
  int32_t numPages = 16;
  int32_t maxBatch = 2;
  int32_t maxPagesPerSeq = 4;
  int32_t maxRecords = 16;
  int32_t recurrentSlots = 4;      ///< snapshot budget, in slots
  int32_t partialSlots = 4;        ///< snapshot budget, in slots
  int32_t checkpointInterval = 0;  ///< ContextCacheConfig::checkpointInterval (reuse points)
  ReusePointAdmission reusePointAdmission = ContextCacheConfig{}.reusePointAdmission;
};

class HybridRig {
 public:
  explicit HybridRig(DeviceType device, HybridRigOptions rigOptions = {})
      : options(rigOptions), recurrent(recurrentConfig(device, rigOptions)) {
    if (options.attention) {
      RigOptions kv;
      kv.pageSize = options.pageSize;
      kv.numPages = options.numPages;
      kv.maxBatch = options.maxBatch;
      pool.emplace(CoordinatorRig::poolConfig(device, kv));
      table.emplace(options.maxBatch, options.maxPagesPerSeq, options.numPages,
                    PageTableMode::kDense, device);
      oracle.emplace(*pool, *table);
    }
    coordinator.emplace(cacheConfig(), profile(), resources(), nullptr, StreamSynchronizer{},
                        sync.injector());
  }
  /// Drains what a failed test may have left quarantined (the coordinator would terminate).
  ~HybridRig() { (void)coordinator->shutdown(); }
  HybridRig(HybridRig const&) = delete;
  HybridRig& operator=(HybridRig const&) = delete;

  static RecurrentStatePoolConfig recurrentConfig(DeviceType device, HybridRigOptions const& o) {
    RecurrentStatePoolConfig config;
    config.numLayers = 2;
    config.numSlots = o.maxBatch;
    config.stateBytesPerSlot = 24;
    config.convBytesPerSlot = 8;
    config.deviceType = device;
    return config;
  }
  ContextCacheDeploymentProfile profile() const {
    ContextCacheDeploymentProfile p;
    p.baseStateKind = options.attention ? BaseStateKind::kHybrid : BaseStateKind::kPureRecurrent;
    return p;
  }
  ContextCachePhysicalResources resources() {
    return {pool ? &*pool : nullptr, table ? &*table : nullptr, nullptr, nullptr, &recurrent};
  }
  ContextCacheConfig cacheConfig() const {
    ContextCacheConfig config;
    config.maxRecords = options.maxRecords;
    config.checkpointInterval = options.checkpointInterval;
    config.reusePointAdmission = options.reusePointAdmission;
    config.recurrentSnapshotPoolBytes =
        options.recurrentSlots * SnapshotStorage::recurrentBytesPerSlot(recurrent);
    if (pool) {
      config.partialKvSnapshotPoolBytes =
          options.partialSlots * SnapshotStorage::partialKvBytesPerSlot(*pool);
    }
    return config;
  }

  ContextCacheManager const& manager() const { return coordinator->manager(); }
  ResourcePools const& pools() const { return manager().pools(); }
  int32_t freeSlots(ResourceType type) const { return pools().freeCount(type); }

  ContextCacheBatchAdmission batchOf(std::vector<Seq*> const& seqs) const {
    return promptBatchOf(seqs);
  }
  ContextCacheCoordinator::RequestHandle admit(std::vector<Seq*> const& seqs,
                                               std::vector<int32_t>* starts = nullptr,
                                               ContextCacheBatchAdmission* batch = nullptr) {
    auto result =
        coordinator->beginRequest(batch != nullptr ? *batch : batchOf(seqs), kVanilla, nullptr);
    EXPECT_EQ(result.status, ContextCacheStatus::kOk);
    if (!result.admission) {
      return {};
    }
    if (starts != nullptr) {
      *starts = result.admission->prefillStarts;
    }
    return std::move(result.admission->request);
  }

  /// The engine's prefill of one row after preparePrefill: the resumed state (reused KV
  /// positions and recurrent rows) must be this prefix's; then the rest is computed.
  void executePrefill(Seq& seq, int32_t row, int32_t start) {
    testing::OracleReport const resumed =
        recurrentOracle().verify(seq.resident.slot, seq.digests, start);
    EXPECT_TRUE(resumed.ok()) << resumed.firstMismatch;
    if (oracle) {
      if (start > 0) {
        testing::OracleReport const reused =
            oracle->verify(seq.resident.slot, seq.digests, 0, start);
        EXPECT_TRUE(reused.ok()) << "reused prefix: " << reused.firstMismatch;
      }
      oracle->write(seq.resident.slot, seq.digests, start, seq.promptLength);
      int32_t const length = seq.promptLength;
      pool->writeLengths(row, std::span<int32_t const>(&length, 1), nullptr);
    }
    recurrentOracle().write(seq.resident.slot, seq.digests, seq.promptLength);
    seq.materialized = seq.promptLength;
  }

  /// preparePrefill, execution, enqueuePrefillCaptures, lookahead sampling, finalisation.
  ContextCacheStatus prefill(ContextCacheCoordinator::RequestHandle& handle,
                             std::vector<Seq*> const& seqs) {
    coordinator->preparePrefill(handle);
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      executePrefill(*seqs[i], static_cast<int32_t>(i),
                     coordinator->reuseTokenLength(handle, static_cast<int32_t>(i)));
      // The scan's states at the reuse points, into the slots the coordinator named.
      for (ReusePointCapture const& point :
           coordinator->reusePointCaptures(handle, static_cast<int32_t>(i))) {
        recurrentOracle().writeSnapshot(*coordinator->snapshots(), point.snapshotSlot,
                                        seqs[i]->digests, point.position);
        capturedPoints.push_back(point.position);
      }
    }
    coordinator->enqueuePrefillCaptures(handle);
    std::vector<ContextCacheSequenceAdvance> advances;
    for (Seq* seq : seqs) {
      seq->sample();
      advances.push_back({&seq->tokens.back(), 1, seq->promptLength});
    }
    return coordinator->finalizePrefillPublication(handle, advances);
  }

  /// One vanilla decode step of every row; `completed` rows finish normally at its end.
  ContextCacheStatus decode(ContextCacheCoordinator::RequestHandle& handle,
                            std::vector<Seq*> const& seqs,
                            std::vector<int32_t> const& completed = {}) {
    ContextCacheStatus const prepared = coordinator->prepareDecodeStep(handle, kVanilla);
    if (prepared != ContextCacheStatus::kOk) {
      return prepared;
    }
    std::vector<ContextCacheSequenceAdvance> advances;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      Seq& seq = *seqs[i];
      testing::OracleReport const resumed =
          recurrentOracle().verify(seq.resident.slot, seq.digests, seq.materialized);
      EXPECT_TRUE(resumed.ok()) << resumed.firstMismatch;
      if (oracle) {
        oracle->write(seq.resident.slot, seq.digests, seq.materialized, seq.materialized + 1);
        int32_t const length = seq.materialized + 1;
        pool->writeLengths(static_cast<int32_t>(i), std::span<int32_t const>(&length, 1), nullptr);
      }
      recurrentOracle().write(seq.resident.slot, seq.digests, seq.materialized + 1);
      ++seq.materialized;
      seq.sample();
      advances.push_back({&seq.tokens.back(), 1, seq.materialized});
    }
    return coordinator->completeDecodeStep(handle, advances, completed);
  }

  /// Publishes `prompt` through a one-row request on slot 0: its prompt-end checkpoint.
  void publish(std::vector<int32_t> const& prompt) {
    Seq seq(prompt, 0);
    ContextCacheCoordinator::RequestHandle handle = admit({&seq});
    ASSERT_EQ(prefill(handle, {&seq}), ContextCacheStatus::kOk);
    ASSERT_EQ(coordinator->finish(handle), ContextCacheStatus::kOk);
  }

  testing::RecurrentOracle& recurrentOracle() { return mRecurrentOracle; }
  /// The raw bytes of one resident's recurrent rows (every layer's state, then conv).
  std::vector<uint8_t> recurrentBytes(CacheSlot slot) const {
    std::vector<uint8_t> bytes;
    for (int32_t layer = 0; layer < recurrent.numLayers(); ++layer) {
      for (Tensor const* rows : {&recurrent.state(layer), &recurrent.conv(layer)}) {
        std::vector<uint8_t> const all = readBytes(*rows);
        auto const width = static_cast<std::size_t>(rows->dim(1));
        auto const begin = all.begin() + static_cast<std::ptrdiff_t>(width) * slot;
        bytes.insert(bytes.end(), begin, begin + static_cast<std::ptrdiff_t>(width));
      }
    }
    return bytes;
  }

  /// No live lease and every resource either free or cached by a record.
  void expectQuiescent() const { test::expectQuiescent(manager()); }

  HybridRigOptions options;
  std::optional<KVCachePool> pool;
  std::optional<KVPageTable> table;
  std::optional<testing::KvOracle> oracle;
  RecurrentStatePool recurrent;
  std::vector<int32_t> capturedPoints;  ///< every reuse point prefill() wrote, in order
  FaultArming sync;                     ///< the coordinator's synchroniser
  std::optional<ContextCacheCoordinator> coordinator;

 private:
  testing::RecurrentOracle mRecurrentOracle{recurrent};
};

/// The checkpoint lengths `rig`'s cache holds, reuse points (`reusePoints`) or the others,
/// ascending.
inline std::vector<int32_t> checkpointLengths(HybridRig const& rig, bool reusePoints) {
  std::vector<int32_t> lengths;
  for (CacheRecord const& record : rig.manager().records().lruToMru()) {
    if (record.reusePoint == reusePoints) {
      lengths.push_back(*record.exactCheckpointLength);
    }
  }
  std::sort(lengths.begin(), lengths.end());
  return lengths;
}

}  // namespace mkv::test
