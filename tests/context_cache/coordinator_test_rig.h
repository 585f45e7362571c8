#pragma once
/// \file coordinator_test_rig.h
/// Shared pieces of the ContextCacheCoordinator / ContextCacheRequest suites: real pools and a
/// dense page table on one DeviceType, a scriptable stream synchroniser (fault injection), and a
/// tiny engine model that writes and verifies KV through the KvOracle, so a test can prove that
/// reused pages hold exactly the KV of the same prefix.

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "core/device.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/context_cache/context_cache_request.h"
#include "mkv/generation_request.h"
#include "mkv/host_kv_tier.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/testing/kv_oracle.h"
#include "support/fault_arming.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv::test {

inline constexpr DecodingKvHeadroom kVanilla{1, 0};

/// Geometry of a rig. The defaults follow the reference suite: page 128, batch 3, 512 tokens per
/// sequence (4 pages a row), 16 records.
struct RigOptions {
  int32_t pageSize = 128;
  int32_t numPages = 16;
  int32_t maxBatch = 3;
  int32_t maxPagesPerSeq = 4;
  int32_t maxRecords = 16;
  bool verifyTokens = true;
  int32_t eventQueueCapacity = 0;
  bool enabled = true;
  EvictionPolicyKind evictionPolicy = ContextCacheConfig{}.evictionPolicy;
  /// Pages of a host tier (its faults armed through the rig's `sync`); 0: none.
  int32_t hostTierPages = 0;
  JoinerPageAllocation joinerPages = JoinerPageAllocation::kWholePrompt;
};

/// One sequence as the engine sees it. `tokens` is the ledger (prompt, then sampled tokens; the
/// last sampled token has no KV yet); `digests` covers every ledger token.
struct Seq {
  Seq(std::vector<int32_t> prompt, CacheSlot slot, uint64_t seed = 0)
      : resident{slot, 1}, tokens(std::move(prompt)), digests(seed) {
    promptLength = static_cast<int32_t>(tokens.size());
    digests.extendTokens(tokens);
  }
  /// Appends the deterministic next token (a function of the prefix so far).
  int32_t sample() {
    auto const token = static_cast<int32_t>(20000 + digests.at(digests.size() - 1) % 10000);
    tokens.push_back(token);
    digests.extendTokens(std::span<int32_t const>(&tokens.back(), 1));
    return token;
  }
  ResidentRef resident;
  std::vector<int32_t> tokens;
  int32_t promptLength = 0;
  int32_t materialized = 0;  ///< positions with KV
  testing::PrefixDigests digests;
};

/// The admission of `seq`'s prompt (text only, no extras, batch policy).
inline ContextCacheSequenceAdmission promptAdmissionOf(Seq const& seq) {
  ContextCacheSequenceAdmission admission;
  admission.tokenIds =
      std::vector<int32_t>(seq.tokens.begin(), seq.tokens.begin() + seq.promptLength);
  admission.resident = seq.resident;
  return admission;
}

/// The admissions of `seqs`' prompts as one batch (defaults otherwise).
inline ContextCacheBatchAdmission promptBatchOf(std::vector<Seq*> const& seqs) {
  ContextCacheBatchAdmission batch;
  for (Seq const* seq : seqs) {
    batch.sequences.push_back(promptAdmissionOf(*seq));
  }
  return batch;
}

/// Pool, table, coordinator and oracle on one device. Declare handles and requests *after* the
/// rig so they are destroyed first.
class CoordinatorRig {
 public:
  explicit CoordinatorRig(DeviceType device, RigOptions rigOptions = {})
      : options(rigOptions),
        pool(poolConfig(device, rigOptions)),
        table(rigOptions.maxBatch, rigOptions.maxPagesPerSeq, rigOptions.numPages,
              PageTableMode::kDense, device),
        hostTier(hostTierOf(rigOptions, pool, sync)),
        coordinator(cacheConfig(rigOptions), ContextCacheDeploymentProfile{},
                    resourcesOf(pool, table, hostTier.get()), nullptr, {}, sync.injector()),
        oracle(pool, table) {}
  /// Drains what a failed test may have left quarantined (the coordinator would terminate).
  ~CoordinatorRig() { (void)coordinator.shutdown(); }
  CoordinatorRig(CoordinatorRig const&) = delete;
  CoordinatorRig& operator=(CoordinatorRig const&) = delete;

  static KVCachePoolConfig poolConfig(DeviceType device, RigOptions const& o) {
    KVCachePoolConfig config;
    config.numLayers = 1;
    config.numKVHeads = 1;
    config.headDim = 4;
    config.tokensPerPage = o.pageSize;
    config.numPages = o.numPages;
    config.maxBatchSize = o.maxBatch;
    config.dataType = DataType::kFloat16;
    config.deviceType = device;
    return config;
  }
  static std::unique_ptr<HostKvTier> hostTierOf(RigOptions const& o, KVCachePool& gpuPool,
                                                FaultArming const& faults) {
    if (o.hostTierPages == 0) {
      return nullptr;
    }
    HostKvTierConfig config;
    config.numPages = o.hostTierPages;
    config.faults = faults.injector();
    return std::make_unique<HostKvTier>(config, gpuPool);
  }
  static ContextCachePhysicalResources resourcesOf(KVCachePool& gpuPool, KVPageTable& pageTable,
                                                   HostKvTier* tier) {
    ContextCachePhysicalResources resources{&gpuPool, &pageTable, nullptr, nullptr, nullptr};
    resources.hostTier = tier;
    return resources;
  }
  static ContextCacheConfig cacheConfig(RigOptions const& o) {
    ContextCacheConfig config;
    config.enabled = o.enabled;
    config.maxRecords = o.maxRecords;
    config.verifyTokens = o.verifyTokens;
    config.eventQueueCapacity = o.eventQueueCapacity;
    config.evictionPolicy = o.evictionPolicy;
    config.joinerPages = o.joinerPages;
    return config;
  }

  ContextCacheManager const& manager() const { return coordinator.manager(); }
  ResourcePools const& pools() const { return coordinator.manager().pools(); }
  /// Records from least to most recently used.
  std::vector<CacheRecord> records() const {
    auto const& lru = manager().records().lruToMru();
    return {lru.begin(), lru.end()};
  }
  bool hasRecord(RecordId id) const { return manager().records().get(id) != nullptr; }
  int32_t freePages() const { return pools().freeCount(ResourceType::kBaseKvPage); }
  int32_t activeRefs(PageId page) const {
    return pools().activeRefs({ResourceType::kBaseKvPage, page});
  }
  int32_t cacheRefs(PageId page) const {
    return pools().cacheRefs({ResourceType::kBaseKvPage, page});
  }

  ContextCacheSequenceAdmission admissionOf(Seq const& seq) const { return promptAdmissionOf(seq); }
  ContextCacheBatchAdmission batchOf(std::vector<Seq*> const& seqs) const {
    return promptBatchOf(seqs);
  }
  ContextCacheCoordinator::BeginRequestResult begin(ContextCacheBatchAdmission const& batch) {
    return coordinator.beginRequest(batch, kVanilla, nullptr);
  }
  /// Admits `seqs` and expects kOk; returns the handle and fills `starts`.
  ContextCacheCoordinator::RequestHandle admit(std::vector<Seq*> const& seqs,
                                               std::vector<int32_t>* starts = nullptr) {
    auto result = begin(batchOf(seqs));
    EXPECT_EQ(result.status, ContextCacheStatus::kOk);
    if (!result.admission) {
      return {};
    }
    if (starts != nullptr) {
      *starts = result.admission->prefillStarts;
    }
    return std::move(result.admission->request);
  }

  /// What the runtime does between preparePrefill and the prefill synchronisation for one row:
  /// the reused positions must already hold this prefix's KV; the rest is computed.
  void executePrefill(Seq& seq, int32_t row, int32_t start) {
    if (start > 0) {
      testing::OracleReport const reused = oracle.verify(seq.resident.slot, seq.digests, 0, start);
      EXPECT_TRUE(reused.ok()) << "reused prefix of slot " << seq.resident.slot << ": "
                               << reused.firstMismatch;
    }
    oracle.write(seq.resident.slot, seq.digests, start, seq.promptLength);
    seq.materialized = seq.promptLength;
    int32_t const length = seq.materialized;
    pool.writeLengths(row, std::span<int32_t const>(&length, 1), nullptr);
  }

  /// preparePrefill, execution, lookahead sampling and finalizePrefillPublication.
  ContextCacheStatus prefill(ContextCacheCoordinator::RequestHandle& handle,
                             std::vector<Seq*> const& seqs) {
    coordinator.preparePrefill(handle);
    std::vector<ContextCacheSequenceAdvance> advances;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      executePrefill(*seqs[i], static_cast<int32_t>(i),
                     coordinator.reuseTokenLength(handle, static_cast<int32_t>(i)));
    }
    for (Seq* seq : seqs) {
      seq->sample();
      advances.push_back({&seq->tokens.back(), 1, seq->promptLength});
    }
    return coordinator.finalizePrefillPublication(handle, advances);
  }

  /// Writes the lookahead's KV of row `row` and samples the next token (one decode execution).
  ContextCacheSequenceAdvance executeDecode(Seq& seq, int32_t row) {
    oracle.write(seq.resident.slot, seq.digests, seq.materialized, seq.materialized + 1);
    ++seq.materialized;
    int32_t const length = seq.materialized;
    pool.writeLengths(row, std::span<int32_t const>(&length, 1), nullptr);
    seq.sample();
    return {&seq.tokens.back(), 1, seq.materialized};
  }

  /// One vanilla decode step: every row advances by one token; `completed` are published at
  /// decode end.
  ContextCacheStatus decode(ContextCacheCoordinator::RequestHandle& handle,
                            std::vector<Seq*> const& seqs,
                            std::vector<int32_t> const& completed = {}) {
    ContextCacheStatus const prepared = coordinator.prepareDecodeStep(handle, kVanilla);
    if (prepared != ContextCacheStatus::kOk) {
      return prepared;
    }
    std::vector<ContextCacheSequenceAdvance> advances;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      advances.push_back(executeDecode(*seqs[i], static_cast<int32_t>(i)));
    }
    return coordinator.completeDecodeStep(handle, advances, completed);
  }

  /// Every materialised position of `seq` as attention would read it.
  testing::OracleReport verify(Seq const& seq) const {
    return oracle.verify(seq.resident.slot, seq.digests, 0, seq.materialized);
  }

  /// Live K entries of a host row.
  std::vector<PageId> hostPages(CacheSlot slot) const {
    std::vector<PageId> pages;
    for (int32_t p = 0; p < table.maxPagesPerSeq() && table.entry(slot, p) != kNoPage; ++p) {
      pages.push_back(table.entry(slot, p));
    }
    return pages;
  }
  std::vector<int32_t> hostRow(CacheSlot slot) const {
    std::span<int32_t const> const row = table.hostRow(slot);
    return {row.begin(), row.end()};
  }
  /// The device mirror of a row (what kernels and the oracle read).
  std::vector<int32_t> deviceRow(CacheSlot slot) const {
    auto const width = static_cast<std::size_t>(2 * table.maxPagesPerSeq());
    std::vector<int32_t> row(width);
    synchronize(table.deviceType());
    detail::copyBytes(
        row.data(), DeviceType::kCPU,
        table.deviceTable().dataPointer<int32_t>() + width * static_cast<std::size_t>(slot),
        table.deviceType(), width * sizeof(int32_t), nullptr);
    synchronize(table.deviceType());
    return row;
  }
  /// Host row == device row; returns the live pages.
  std::vector<PageId> mirroredPages(CacheSlot slot) const {
    EXPECT_EQ(hostRow(slot), deviceRow(slot)) << "device mirror of row " << slot << " is stale";
    return hostPages(slot);
  }
  std::vector<int32_t> kvLengths() const { return readAs<int32_t>(pool.kvLengths()); }

  /// No live lease, no pinned page, and free + cached == capacity (page conservation).
  void expectQuiescent() const {
    ResourcePools const& p = pools();
    int32_t cached = 0;
    for (PageId page = 0; page < p.capacity(ResourceType::kBaseKvPage); ++page) {
      EXPECT_EQ(activeRefs(page), 0) << "page " << page << " still pinned";
      cached += cacheRefs(page) > 0 ? 1 : 0;
    }
    EXPECT_EQ(manager().liveLeaseCount(), 0);
    EXPECT_EQ(p.freeCount(ResourceType::kBaseKvPage) + cached,
              p.capacity(ResourceType::kBaseKvPage));
  }

  RigOptions options;
  KVCachePool pool;
  KVPageTable table;
  FaultArming sync;  ///< the coordinator's synchroniser (and the host tier's faults)
  std::unique_ptr<HostKvTier> hostTier;  ///< RigOptions::hostTierPages > 0, else null
  ContextCacheCoordinator coordinator;
  testing::KvOracle oracle;
};

/// Drives one ContextCacheRequest the way a runtime does: the LLMGenerationRequest, the
/// DecodingInferenceContext, and KV written / verified through the rig's oracle.
class RequestDriver {
 public:
  explicit RequestDriver(CoordinatorRig& rig, std::string lora = {}, std::string salt = {})
      : mRig(rig) {
    request.loraWeightsName = lora;
    request.cacheSalt = salt;
    context.loraWeightsName = std::move(lora);
    mSeed = testing::identitySeed(context.loraWeightsName, request.cacheSalt);
  }

  /// Adds a founding row (before begin).
  Seq& add(std::vector<int32_t> prompt, CacheSlot slot,
           std::optional<ContextCacheLookupPolicy> policy = std::nullopt,
           std::vector<imageUtils::ImageData> images = {}) {
    LLMGenerationRequest::Sequence sequence;
    sequence.contextCacheLookupPolicy = policy;
    sequence.imageBuffers = std::move(images);
    request.requests.push_back(std::move(sequence));
    rows.emplace_back(std::move(prompt), slot, mSeed);
    context.rawBatchedInputIds.push_back(std::vector<int32_t>(rows.back().tokens));
    context.residentRefs.push_back(rows.back().resident);
    context.generatedTokenIds.emplace_back();
    context.finishReasons.push_back(FinishReason::kNotFinished);
    context.activeBatchSize = static_cast<int32_t>(rows.size());
    mUnseated.push_back(false);
    return rows.back();
  }
  /// Media positions enter the oracle keys too (KV of an image token depends on the image).
  void useMedia(std::vector<int32_t> mediaTokenIds) { mMediaTokenIds = std::move(mediaTokenIds); }

  bool begin(
      DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead,
      ContextCacheCommitPolicy commit = ContextCacheCommitPolicy::kIncludingGeneratedTokens) {
    request.contextCacheCommitPolicy = commit;
    mContract = contract;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      rekey(i);
    }
    cache.reset();
    std::optional<ContextCacheRequest> begun = ContextCacheRequest::begin(
        mRig.coordinator, request, context, false, kVanilla, mMediaTokenIds, contract, commit);
    if (begun) {
      cache.emplace(std::move(*begun));
    }
    return cache.has_value();
  }

  bool prefill() {
    if (!cache->preparePrefill()) {
      return false;
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      mRig.executePrefill(rows[i], static_cast<int32_t>(i),
                          cache->reuseTokenLength(static_cast<int32_t>(i)));
      if (mContract == DecodingTokenStateContract::kCommittedPlusLookahead) {
        context.generatedTokenIds[i].push_back(rows[i].sample());
      }
    }
    return cache->completePrefill(context, {});
  }

  /// A prefill in which founder `i` runs [its reuse length, firstChunkEnds[i]): a founder whose
  /// first chunk is its whole prompt samples its lookahead as prefill() does; one short of it
  /// completes that chunk (completePrefillChunk, before completePrefill), samples nothing and
  /// goes on unseated, as a joiner does (prefillChunk, seat).
  bool prefillFirstChunks(std::vector<int32_t> const& firstChunkEnds) {
    if (!cache->preparePrefill()) {
      return false;
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      auto const row = static_cast<int32_t>(i);
      if (firstChunkEnds[i] == rows[i].promptLength) {
        mRig.executePrefill(rows[i], row, cache->reuseTokenLength(row));
        context.generatedTokenIds[i].push_back(rows[i].sample());
        continue;
      }
      rows[i].materialized = cache->reuseTokenLength(row);
      mUnseated[i] = true;
      if (!prefillChunk(i, firstChunkEnds[i])) {
        return false;
      }
    }
    return cache->completePrefill(context, {});
  }

  /// One decode step. Rows listed in `stopped` produce no token and end with the given reason
  /// (cancel / error before the step's token); `finishAfter` rows produce their token and finish
  /// with that reason.
  bool decode(std::vector<std::pair<std::size_t, FinishReason>> const& finishAfter = {},
              std::vector<std::pair<std::size_t, FinishReason>> const& stopped = {}) {
    for (auto const& [row, reason] : stopped) {
      context.finishReasons[row] = reason;
    }
    if (!cache->prepareDecodeStep(context, kVanilla)) {
      return false;
    }
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (context.finishReasons[i] != FinishReason::kNotFinished || mUnseated[i]) {
        continue;
      }
      mRig.executeDecode(rows[i], static_cast<int32_t>(i));
      context.generatedTokenIds[i].push_back(rows[i].tokens.back());
    }
    for (auto const& [row, reason] : finishAfter) {
      context.finishReasons[row] = reason;
    }
    return cache->completeDecodeStep(context, {});
  }

  /// Drops the rows whose mapping entry is -1 from the runtime's view after a compaction.
  void compactView(std::vector<int32_t> const& mapping) {
    DecodingInferenceContext next;
    next.stream = context.stream;
    next.loraWeightsName = context.loraWeightsName;
    std::vector<Seq> kept;
    std::vector<bool> unseated;
    std::vector<LLMGenerationRequest::Sequence> sequences;
    for (std::size_t i = 0; i < mapping.size(); ++i) {
      if (mapping[i] < 0) {
        continue;
      }
      next.rawBatchedInputIds.push_back(context.rawBatchedInputIds[i]);
      next.generatedTokenIds.push_back(context.generatedTokenIds[i]);
      next.residentRefs.push_back(context.residentRefs[i]);
      next.finishReasons.push_back(context.finishReasons[i]);
      kept.push_back(std::move(rows[i]));
      unseated.push_back(mUnseated[i]);
      sequences.push_back(request.requests[i]);
    }
    next.activeBatchSize = static_cast<int32_t>(kept.size());
    context = std::move(next);
    rows = std::move(kept);
    mUnseated = std::move(unseated);
    request.requests = std::move(sequences);
  }

  /// In-flight admission of one more row: admitSequence only (the row is not seated yet).
  /// `images` go with the placeholder `mediaTokenIds` (the oracle keys stay plain tokens, so use
  /// images the host cannot read, which put the row on bypass).
  ContextCacheRequest::AdmitSequenceStatus admit(
      std::vector<int32_t> prompt, CacheSlot slot, int32_t* start = nullptr,
      std::vector<int32_t> const& mediaTokenIds = {},
      std::vector<imageUtils::ImageData> const& images = {}) {
    Seq seq(std::move(prompt), slot, mSeed);
    int32_t prefillStart = -1;
    auto const status =
        cache->admitSequence(std::vector<int32_t>(seq.tokens), context.loraWeightsName, kVanilla,
                             prefillStart, seq.resident, context.stream, mediaTokenIds, images);
    if (status == ContextCacheRequest::AdmitSequenceStatus::kAdmitted) {
      rows.push_back(std::move(seq));
      context.rawBatchedInputIds.push_back(std::vector<int32_t>(rows.back().tokens));
      context.residentRefs.push_back(rows.back().resident);
      context.generatedTokenIds.emplace_back();
      context.finishReasons.push_back(FinishReason::kNotFinished);
      context.activeBatchSize = static_cast<int32_t>(rows.size());
      request.requests.emplace_back();
      mUnseated.push_back(true);
      rows.back().materialized = prefillStart;  // the reused prefix has KV
    }
    if (start != nullptr) {
      *start = prefillStart;
    }
    return status;
  }
  /// Chunked prefill of unseated row `row`: runs its prompt positions [materialized, end) and
  /// completes them as a chunk (completePrefillChunk); the row stays unseated.
  bool prefillChunk(std::size_t row, int32_t end) {
    Seq& seq = rows[row];
    mRig.pool.setActiveBatchSize(static_cast<int32_t>(rows.size()));
    testing::OracleReport const reused =
        mRig.oracle.verify(seq.resident.slot, seq.digests, 0, seq.materialized);
    EXPECT_TRUE(reused.ok()) << "before the chunk: " << reused.firstMismatch;
    mRig.oracle.write(seq.resident.slot, seq.digests, seq.materialized, end);
    seq.materialized = end;
    mRig.pool.writeLengths(static_cast<int32_t>(row), std::span<int32_t const>(&end, 1), nullptr);
    return cache->completePrefillChunk(static_cast<int32_t>(row), end);
  }
  /// Seats the newest admitted row: its prefill, its KV length, its lookahead, then finalize.
  bool seatNewest() { return seat(rows.size() - 1); }
  /// Seats unseated row `row`: the rest of its prefill, its KV length, its lookahead, finalize.
  bool seat(std::size_t row) {
    mRig.pool.setActiveBatchSize(static_cast<int32_t>(rows.size()));
    mRig.executePrefill(rows[row], static_cast<int32_t>(row), rows[row].materialized);
    int32_t const lookahead = rows[row].sample();
    context.generatedTokenIds[row].push_back(lookahead);
    mUnseated[row] = false;
    return cache->finalizeSequenceAdmission(static_cast<int32_t>(row), lookahead,
                                            rows[row].promptLength);
  }
  /// Retracts the newest never-seated row.
  bool retractNewest() {
    bool const retracted = cache->retractSequenceAdmission();
    if (retracted) {
      rows.pop_back();
      context.rawBatchedInputIds.pop_back();
      context.residentRefs.pop_back();
      context.generatedTokenIds.pop_back();
      context.finishReasons.pop_back();
      context.activeBatchSize = static_cast<int32_t>(rows.size());
      request.requests.pop_back();
      mUnseated.pop_back();
    }
    return retracted;
  }

  LLMGenerationRequest request;
  DecodingInferenceContext context;
  std::vector<Seq> rows;
  std::optional<ContextCacheRequest> cache;

 private:
  /// Oracle keys of a row: its tokens, with the digest of the covering media item mixed in.
  void rekey(std::size_t i) {
    if (mMediaTokenIds.empty()) {
      return;
    }
    Seq& seq = rows[i];
    bool readable = true;
    for (auto const& image : request.requests[i].imageBuffers) {
      readable = readable && image.data() != nullptr;
    }
    std::vector<uint64_t> keys(seq.tokens.begin(), seq.tokens.end());
    if (readable) {
      std::vector<MediaPosition> const media =
          buildMediaPositions(seq.tokens, mMediaTokenIds, request.requests[i].imageBuffers, {});
      for (std::size_t p = 0; p < media.size(); ++p) {
        if (!media[p].content.isZero()) {
          keys[p] ^= media[p].content.hi ^ (media[p].content.lo * 31) ^
                     (static_cast<uint64_t>(media[p].offset) << 40);
        }
      }
    }
    seq.digests = testing::PrefixDigests(mSeed);
    seq.digests.extend(keys);
  }

  CoordinatorRig& mRig;
  uint64_t mSeed = 0;
  std::vector<int32_t> mMediaTokenIds;
  DecodingTokenStateContract mContract = DecodingTokenStateContract::kCommittedPlusLookahead;
  std::vector<bool> mUnseated;  ///< per row: admitted in flight, not seated yet
};

}  // namespace mkv::test
