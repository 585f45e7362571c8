#pragma once
/// \file remote_tier_engine.h
/// One engine of the remote tier tests: a pool of 6 pages of 16 tokens, its table, a host tier, a
/// coordinator with a remote tier and the KV oracle, on one device; serve() runs one request of
/// one sequence as an engine would, the oracle checking every reused position.

#include <gtest/gtest.h>

#include <memory>
#include <utility>

#include "coordinator_test_rig.h"
#include "mkv/host_kv_tier.h"

namespace mkv::test {

struct RemoteTierEngine {
  static constexpr int32_t kPage = 16;

  /// Throws what the coordinator's construction throws (hostPages 0: no host tier).
  RemoteTierEngine(DeviceType device, RemoteTierConfig remote, int32_t hostPages = 8) {
    KVCachePoolConfig config;
    config.numLayers = 2;
    config.numKVHeads = 1;
    config.headDim = 8;
    config.tokensPerPage = kPage;
    config.numPages = 6;
    config.maxBatchSize = 2;
    config.deviceType = device;
    pool = std::make_unique<KVCachePool>(config);
    table = std::make_unique<KVPageTable>(2, 6, config.numPages, PageTableMode::kDense, device);
    if (hostPages > 0) {
      tier = std::make_unique<HostKvTier>(HostKvTierConfig{hostPages, {}}, *pool);
    }
    ContextCacheConfig cache;
    cache.maxRecords = 16;
    cache.evictionPolicy = EvictionPolicyKind::kLru;
    cache.eventQueueCapacity = 256;
    cache.remoteTier = std::move(remote);
    ContextCachePhysicalResources resources{pool.get(), table.get(), nullptr, nullptr, nullptr};
    resources.hostTier = tier.get();
    coordinator = std::make_unique<ContextCacheCoordinator>(
        cache, ContextCacheDeploymentProfile{}, resources, nullptr, StreamSynchronizer{});
    oracle = std::make_unique<testing::KvOracle>(*pool, *table);
  }
  ~RemoteTierEngine() {
    if (coordinator) {
      (void)coordinator->shutdown();
    }
  }
  RemoteTierEngine(RemoteTierEngine const&) = delete;
  RemoteTierEngine& operator=(RemoteTierEngine const&) = delete;

  /// One request of `seq`: admission, the oracle's check of the reused prefix, its prefill,
  /// publication, finish; then a poll of the remote tier (the engine's once per step). Returns
  /// the reuse length, -1 when refused.
  int32_t serve(Seq& seq) {
    auto begun = coordinator->beginRequest(promptBatchOf({&seq}), kVanilla, nullptr);
    if (!begun.admission) {
      return -1;
    }
    ContextCacheCoordinator::RequestHandle handle = std::move(begun.admission->request);
    int32_t const start = begun.admission->prefillStarts[0];
    coordinator->preparePrefill(handle);
    if (start > 0) {
      testing::OracleReport const report = oracle->verify(seq.resident.slot, seq.digests, 0, start);
      EXPECT_TRUE(report.ok()) << "reused prefix: " << report.firstMismatch;
    }
    oracle->write(seq.resident.slot, seq.digests, start, seq.promptLength);
    seq.materialized = seq.promptLength;
    pool->writeLengths(0, std::span<int32_t const>(&seq.materialized, 1), nullptr);
    seq.sample();
    ContextCacheSequenceAdvance const advance{&seq.tokens.back(), 1, seq.promptLength};
    EXPECT_EQ(coordinator->finalizePrefillPublication(handle, std::span(&advance, 1)),
              ContextCacheStatus::kOk);
    EXPECT_EQ(coordinator->finish(handle), ContextCacheStatus::kOk);
    (void)coordinator->pollRemoteTier();
    return start;
  }

  std::unique_ptr<KVCachePool> pool;
  std::unique_ptr<KVPageTable> table;
  std::unique_ptr<HostKvTier> tier;
  std::unique_ptr<ContextCacheCoordinator> coordinator;
  std::unique_ptr<testing::KvOracle> oracle;
};

}  // namespace mkv::test
