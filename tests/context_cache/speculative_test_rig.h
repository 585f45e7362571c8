#pragma once
/// \file speculative_test_rig.h
/// A ContextCacheCoordinator on a speculative deployment: EAGLE-style (attention-only base,
/// paged draft) or Hybrid-MTP (hybrid base, paged draft, boundary hidden rows), with real pools,
/// snapshot slabs and a scriptable synchroniser. Its engine model writes and verifies the base
/// KV, the draft KV and (hybrid) the recurrent rows of every execution through the oracles.
///
/// The draft model of the rig depends on one future token, as EAGLE's and MTP's do: its KV at
/// position p is a function of the prefix [0, p + 1]. So a reused draft row is correct only if
/// the consumer's token after it is the producer's too, which is what the full-page replay
/// (EAGLE) and the private boundary token (Hybrid-MTP) guarantee.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "coordinator_test_rig.h"
#include "hybrid_test_rig.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/snapshot_storage.h"
#include "mkv/testing/kv_oracle.h"

namespace mkv::test {

struct SpecRigOptions {
  bool hybrid = false;  ///< true: Hybrid-MTP (recurrent layers), else attention-only EAGLE
  SpecReuseContract contract{true, 1};
  int32_t pageSize = 128;
  int32_t numPages = 16;
  int32_t numDraftPages = 16;
  int32_t maxBatch = 2;
  int32_t maxPagesPerSeq = 4;
  int32_t maxRecords = 16;
  int32_t recurrentSlots = 4;
  int32_t partialSlots = 4;
  int64_t hiddenWidth = 8;  ///< boundary hidden row elements (fp16), Hybrid-MTP only
};

/// The draft's digests of `seq`: entry p covers the prefix [0, p + 1], so there is one entry
/// fewer than ledger tokens.
inline testing::PrefixDigests draftDigestsOf(Seq const& seq) {
  testing::PrefixDigests draft(0xd7af7);
  if (seq.tokens.size() < 2) {
    return draft;
  }
  uint64_t const first = (static_cast<uint64_t>(static_cast<uint32_t>(seq.tokens[0])) << 32) |
                         static_cast<uint32_t>(seq.tokens[1]);
  draft.extend(std::span<uint64_t const>(&first, 1));
  draft.extendTokens(std::span<int32_t const>(seq.tokens).subspan(2));
  return draft;
}

class SpecRig {
 public:
  static constexpr DecodingKvHeadroom kSpecHeadroom{4, 4};

  explicit SpecRig(DeviceType deviceType, SpecRigOptions rigOptions = {})
      : options(rigOptions),
        device(deviceType),
        pool(CoordinatorRig::poolConfig(deviceType, kvOptions(rigOptions, rigOptions.numPages))),
        table(rigOptions.maxBatch, rigOptions.maxPagesPerSeq, rigOptions.numPages,
              PageTableMode::kDense, deviceType),
        oracle(pool, table) {
    if (options.contract.pagedSpecState) {
      draftPool.emplace(
          CoordinatorRig::poolConfig(device, kvOptions(rigOptions, rigOptions.numDraftPages)));
      draftTable.emplace(options.maxBatch, options.maxPagesPerSeq, options.numDraftPages,
                         PageTableMode::kDense, device);
      draftOracle.emplace(*draftPool, *draftTable);
    }
    if (options.hybrid) {
      HybridRigOptions hybrid;
      hybrid.maxBatch = options.maxBatch;
      recurrent.emplace(HybridRig::recurrentConfig(device, hybrid));
      recurrentOracle.emplace(*recurrent);
    }
    coordinator.emplace(cacheConfig(), profile(), resources(), nullptr, StreamSynchronizer{},
                        sync.injector());
  }
  ~SpecRig() { (void)coordinator->shutdown(); }
  SpecRig(SpecRig const&) = delete;
  SpecRig& operator=(SpecRig const&) = delete;

  static RigOptions kvOptions(SpecRigOptions const& o, int32_t pages) {
    RigOptions kv;
    kv.pageSize = o.pageSize;
    kv.numPages = pages;
    kv.maxBatch = o.maxBatch;
    return kv;
  }
  ContextCacheDeploymentProfile profile() const {
    ContextCacheDeploymentProfile p;
    p.baseStateKind = options.hybrid ? BaseStateKind::kHybrid : BaseStateKind::kAttentionOnly;
    p.speculative = options.contract;
    p.boundaryHiddenWidth = options.hybrid ? options.hiddenWidth : 0;
    return p;
  }
  ContextCachePhysicalResources resources() {
    return {&pool, &table, draftPool ? &*draftPool : nullptr, draftTable ? &*draftTable : nullptr,
            recurrent ? &*recurrent : nullptr};
  }
  ContextCacheConfig cacheConfig() const {
    ContextCacheConfig config;
    config.maxRecords = options.maxRecords;
    if (options.hybrid) {
      config.recurrentSnapshotPoolBytes =
          options.recurrentSlots *
          (SnapshotStorage::recurrentBytesPerSlot(*recurrent) +
           SnapshotStorage::boundaryHiddenBytesPerSlot(options.hiddenWidth, DataType::kFloat16));
      config.partialKvSnapshotPoolBytes =
          options.partialSlots * (SnapshotStorage::partialKvBytesPerSlot(pool) +
                                  SnapshotStorage::partialKvBytesPerSlot(*draftPool));
    }
    return config;
  }

  ContextCacheManager const& manager() const { return coordinator->manager(); }
  ResourcePools const& pools() const { return manager().pools(); }
  std::vector<CacheRecord> records() const {
    auto const& lru = manager().records().lruToMru();
    return {lru.begin(), lru.end()};
  }

  ContextCacheBatchAdmission batchOf(std::vector<Seq*> const& seqs, bool speculative) const {
    ContextCacheBatchAdmission batch = promptBatchOf(seqs);
    batch.speculativeRequest = speculative;
    if (speculative && options.hybrid) {
      batch.commitPolicy = ContextCacheCommitPolicy::kPrefillStateOnly;
    }
    return batch;
  }
  DecodingKvHeadroom headroomOf(bool speculative) const {
    return speculative && options.contract.pagedSpecState ? kSpecHeadroom
                                                          : DecodingKvHeadroom{4, 0};
  }
  /// Admits and expects kOk (an empty handle otherwise).
  ContextCacheCoordinator::RequestHandle admit(std::vector<Seq*> const& seqs, bool speculative,
                                               std::vector<int32_t>* starts = nullptr) {
    auto result =
        coordinator->beginRequest(batchOf(seqs, speculative), headroomOf(speculative), nullptr);
    EXPECT_EQ(result.status, ContextCacheStatus::kOk);
    if (!result.admission) {
      return {};
    }
    if (starts != nullptr) {
      *starts = result.admission->prefillStarts;
    }
    return std::move(result.admission->request);
  }

  /// Expected bytes of the base hidden row after the prefix `digest` (fp16 row of hiddenWidth).
  std::vector<uint8_t> hiddenRow(uint64_t digest) const {
    std::vector<uint8_t> row(static_cast<std::size_t>(options.hiddenWidth) * 2);
    testing::KvOracle::expectedRow(digest, 7, 0, row);
    return row;
  }
  /// The base hidden states of a prefill over positions [start, end) of `seq`.
  Tensor hiddenStates(Seq const& seq, int32_t start, int32_t end) const {
    Tensor hidden({std::max(1, end - start), options.hiddenWidth}, DataType::kFloat16, device);
    std::vector<uint8_t> bytes;
    for (int32_t p = start; p < end; ++p) {
      std::vector<uint8_t> const row = hiddenRow(seq.digests.at(p));
      bytes.insert(bytes.end(), row.begin(), row.end());
    }
    bytes.resize(static_cast<std::size_t>(hidden.sizeBytes()), 0);
    writeBytes(hidden, bytes);
    return hidden;
  }

  /// Verifies the state a row resumes from: base [0, base), draft [0, draft), recurrent at base.
  void verifyResumed(Seq const& seq, int32_t base, int32_t draft, char const* when) {
    if (base > 0) {
      testing::OracleReport const report = oracle.verify(seq.resident.slot, seq.digests, 0, base);
      EXPECT_TRUE(report.ok()) << when << " base: " << report.firstMismatch;
    }
    if (draft > 0 && draftOracle) {
      testing::OracleReport const report =
          draftOracle->verify(seq.resident.slot, draftDigestsOf(seq), 0, draft);
      EXPECT_TRUE(report.ok()) << when << " draft: " << report.firstMismatch;
    }
    if (recurrentOracle) {
      testing::OracleReport const report =
          recurrentOracle->verify(seq.resident.slot, seq.digests, base);
      EXPECT_TRUE(report.ok()) << when << " recurrent: " << report.firstMismatch;
    }
  }

  /// The base executes [from, to) of `seq` (row `row`): KV, KV length and recurrent state.
  void executeBase(Seq& seq, int32_t row, int32_t from, int32_t to) {
    oracle.write(seq.resident.slot, seq.digests, from, to);
    pool.writeLengths(row, std::span<int32_t const>(&to, 1), nullptr);
    if (recurrentOracle) {
      recurrentOracle->write(seq.resident.slot, seq.digests, to);
    }
    seq.materialized = to;
  }
  /// The draft executes [from, to) (needs the ledger to reach token `to`).
  void executeDraft(Seq const& seq, int32_t row, int32_t from, int32_t to) {
    if (!draftOracle || to <= from) {
      return;
    }
    draftOracle->write(seq.resident.slot, draftDigestsOf(seq), from, to);
    draftPool->writeLengths(row, std::span<int32_t const>(&to, 1), nullptr);
  }

  /// The EAGLE-style prefill of a speculative (or, `speculative` false, vanilla) batch:
  /// preparePrefill, base prefill, lookahead, draft initialisation, finalisation with the common
  /// lengths (the whole prompt).
  ContextCacheStatus prefill(ContextCacheCoordinator::RequestHandle& handle,
                             std::vector<Seq*> const& seqs, bool speculative) {
    coordinator->preparePrefill(handle);
    std::vector<ContextCacheSequenceAdvance> advances;
    std::vector<int32_t> common;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      Seq& seq = *seqs[i];
      auto const row = static_cast<int32_t>(i);
      int32_t const start = coordinator->reuseTokenLength(handle, row);
      bool const paired = speculative && draftOracle.has_value();
      verifyResumed(seq, start, paired ? start : 0, "prefill");
      executeBase(seq, row, start, seq.promptLength);
      seq.sample();
      if (paired) {
        executeDraft(seq, row, start, seq.promptLength);
      }
      advances.push_back({&seq.tokens.back(), 1, seq.promptLength});
      common.push_back(seq.promptLength);
    }
    coordinator->enqueuePrefillCaptures(handle);
    return coordinator->finalizePrefillPublication(
        handle, advances,
        speculative ? std::span<int32_t const>(common) : std::span<int32_t const>{});
  }

  /// The Hybrid-MTP prefill of one row: restore the boundary hidden row on a hit, base and draft
  /// prefill (the draft's boundary row is recomputed), endpoint publication at the prompt end
  /// (or `publishAt`), lookahead, finalisation.
  ContextCacheStatus mtpPrefill(ContextCacheCoordinator::RequestHandle& handle, Seq& seq,
                                std::optional<int32_t> publishAt = std::nullopt) {
    return mtpPrefill(handle, std::vector<Seq*>{&seq}, publishAt);
  }
  /// The same for every row of a batch (row i runs seqs[i]): each row that hit restores its
  /// boundary hidden row into row i of one [rows, width] tensor (checked), and each publishes
  /// its own endpoint from its own hidden states.
  ContextCacheStatus mtpPrefill(ContextCacheCoordinator::RequestHandle& handle,
                                std::vector<Seq*> const& seqs,
                                std::optional<int32_t> publishAt = std::nullopt) {
    coordinator->preparePrefill(handle);
    auto const rows = static_cast<int64_t>(seqs.size());
    Tensor restored({rows, options.hiddenWidth}, DataType::kFloat16, device);
    std::vector<uint8_t> expected(static_cast<std::size_t>(restored.sizeBytes()), 0xa5);
    writeBytes(restored, expected);
    std::vector<int32_t> reuses;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      Seq& seq = *seqs[i];
      auto const row = static_cast<int32_t>(i);
      int32_t const reuse = coordinator->reuseTokenLength(handle, row);
      reuses.push_back(reuse);
      if (reuse > 0) {
        // The runtime shifts its rows down and restores the boundary's row into its row.
        coordinator->restoreHybridMtpBoundaryHidden(handle, row, restored, row);
        std::vector<uint8_t> const boundary = hiddenRow(seq.digests.at(reuse - 1));
        std::copy(boundary.begin(), boundary.end(),
                  expected.begin() + static_cast<std::ptrdiff_t>(i * boundary.size()));
      }
      verifyResumed(seq, reuse, reuse > 0 ? reuse - 1 : 0, "Hybrid-MTP prefill");
      executeBase(seq, row, reuse, seq.promptLength);
      // Row n - 1 needs the lookahead.
      executeDraft(seq, row, reuse > 0 ? reuse - 1 : 0, seq.promptLength - 1);
    }
    EXPECT_EQ(readBytes(restored), expected) << "the boundary hidden rows of the rows' hits";
    std::vector<ContextCacheSequenceAdvance> advances;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      Seq& seq = *seqs[i];
      int32_t const reuse = reuses[i];
      int32_t const length = publishAt.value_or(seq.promptLength);
      Tensor const hidden = hiddenStates(seq, reuse, seq.promptLength);
      ContextCacheStatus const published = coordinator->publishHybridMtpEndpoint(
          handle, static_cast<ExecutionRow>(i), length, hidden, std::max(0, length - 1 - reuse));
      if (published != ContextCacheStatus::kOk) {
        return published;
      }
    }
    for (Seq* seq : seqs) {
      seq->sample();
      advances.push_back({&seq->tokens.back(), 1, seq->promptLength});
    }
    return coordinator->finalizePrefillPublication(handle, advances);
  }

  /// One verification round: row i accepts accepted[i] tokens (0 = held, e.g. cancelled); the
  /// draft materialises up to committed - lag[i]. `completed` rows finished normally.
  ContextCacheStatus step(ContextCacheCoordinator::RequestHandle& handle,
                          std::vector<Seq*> const& seqs, std::vector<int32_t> const& accepted,
                          std::vector<int32_t> const& lag, std::vector<int32_t> const& completed,
                          bool speculative) {
    ContextCacheStatus const prepared =
        coordinator->prepareDecodeStep(handle, headroomOf(speculative));
    if (prepared != ContextCacheStatus::kOk) {
      return prepared;
    }
    std::vector<ContextCacheSequenceAdvance> advances;
    std::vector<int32_t> common;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      Seq& seq = *seqs[i];
      auto const row = static_cast<int32_t>(i);
      int32_t const before = seq.materialized;
      int32_t const oldCommon = speculative ? coordinator->commonLength(handle, row) : before;
      if (accepted[i] == 0) {
        advances.push_back({nullptr, 0, kHoldCommittedStateLength});
        common.push_back(oldCommon);
        continue;
      }
      bool const paired = speculative && draftOracle.has_value() && !options.hybrid;
      verifyResumed(seq, before, paired ? oldCommon : 0, "decode");
      std::size_t const ledger = seq.tokens.size();
      for (int32_t k = 0; k < accepted[i]; ++k) {
        seq.sample();
      }
      executeBase(seq, row, before, before + accepted[i]);
      int32_t const materialized = std::max(oldCommon, seq.materialized - lag[i]);
      if (paired) {
        executeDraft(seq, row, oldCommon, materialized);
      }
      advances.push_back({seq.tokens.data() + ledger, accepted[i], seq.materialized});
      common.push_back(materialized);
    }
    return coordinator->completeDecodeStep(
        handle, advances, completed,
        speculative ? std::span<int32_t const>(common) : std::span<int32_t const>{});
  }

  /// No live lease and every resource either free or cached by a record.
  void expectQuiescent() const { test::expectQuiescent(manager()); }

  SpecRigOptions options;
  DeviceType device;
  KVCachePool pool;
  KVPageTable table;
  testing::KvOracle oracle;
  std::optional<KVCachePool> draftPool;
  std::optional<KVPageTable> draftTable;
  std::optional<testing::KvOracle> draftOracle;
  std::optional<RecurrentStatePool> recurrent;
  std::optional<testing::RecurrentOracle> recurrentOracle;
  FaultArming sync;  ///< the coordinator's synchroniser
  std::optional<ContextCacheCoordinator> coordinator;
};

}  // namespace mkv::test
