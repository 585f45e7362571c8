// ContextCacheManager: transactional publication (full blocks, spec draft paths, exact
// checkpoints). The rest of the manager (planning, admission, growth, snapshots, eviction) is in
// context_cache_manager.cpp.

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "context_cache/context_cache_manager.h"
#include "core/check.h"

namespace mkv {
namespace {

template <typename T>
std::vector<T> firstOf(std::span<T const> values, int32_t n) {
  return std::vector<T>(values.begin(), values.begin() + n);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Publication internals

/// Canonical page choice of a publication, computed before anything changes.
struct ContextCacheManager::Projection {
  int32_t count = 0;                 ///< publishable blocks (truncated at a verification reject)
  std::vector<PageId> canonical;     ///< canonical base page per block
  std::vector<int32_t> newMappings;  ///< blocks this publication indexes for the first time
  bool verificationRejected = false;
};

/// Undo log of one publication: cache references added, index entries inserted, the record.
/// Everything is rolled back in reverse order unless commit() is called. Storage is reserved up
/// front so recording a step never throws.
class ContextCacheManager::PublicationTransaction {
 public:
  PublicationTransaction(ContextCacheManager& manager, std::size_t refs, std::size_t mappings)
      : mManager(manager) {
    mRefs.reserve(refs);
    mIndexed.reserve(mappings);
    ++mManager.mStateVersion;  // records or index change (a rollback restores them: harmless)
  }
  PublicationTransaction(PublicationTransaction const&) = delete;
  PublicationTransaction& operator=(PublicationTransaction const&) = delete;
  ~PublicationTransaction() {
    if (!mCommitted) {
      rollback();
    }
  }

  void addCache(ResourceId id) {
    MKV_ASSERT(mRefs.size() < mRefs.capacity(), "publication undo log overflow");
    mManager.mPools.addCache(id);
    mRefs.push_back(id);
  }
  void index(PromptBlocks const& blocks, int32_t block, PageId page) {
    MKV_ASSERT(mIndexed.size() < mIndexed.capacity(), "publication undo log overflow");
    PageId const canonical =
        mManager.mIndex.insert(blocks.keys[static_cast<std::size_t>(block)], page, blocks, block);
    MKV_ASSERT(canonical == page, "block {} was indexed on page {} during its own publication",
               block, canonical);
    mIndexed.push_back(page);
  }
  void setRecord(RecordId id) noexcept { mRecord = id; }
  void commit() noexcept { mCommitted = true; }

 private:
  void rollback() noexcept {
    if (mRecord != kNoRecord) {
      mManager.mRecords.erase(mRecord);
    }
    // Reverse order (std::views::reverse does not parse under clang-tidy 14 with libstdc++ 12).
    // NOLINTNEXTLINE(modernize-loop-convert)
    for (auto it = mIndexed.rbegin(); it != mIndexed.rend(); ++it) {
      mManager.mIndex.erasePage(*it, /*rememberEviction=*/false);
    }
    // NOLINTNEXTLINE(modernize-loop-convert)
    for (auto it = mRefs.rbegin(); it != mRefs.rend(); ++it) {
      // Every resource was allocated before this publication referenced it, so dropping the
      // reference restores the previous counts and never frees a slot.
      mManager.mPools.dropCache(*it);
    }
  }

  ContextCacheManager& mManager;
  std::vector<ResourceId> mRefs;
  std::vector<PageId> mIndexed;
  RecordId mRecord = kNoRecord;
  bool mCommitted = false;
};

// ---------------------------------------------------------------------------------------------
// Publication

void ContextCacheManager::checkBoundPrefix(char const* call, CacheRequestLease const& lease,
                                           PromptBlocks const& blocks, int32_t count) const {
  std::size_t const n = std::min(static_cast<std::size_t>(count), lease.mBoundDigests.size());
  for (std::size_t b = 0; b < n; ++b) {
    MKV_REQUIRE(blocks.keys[b] == lease.mBoundDigests[b], call,
                "block {} digest {} differs from the lease's reused block {}", b,
                toString(blocks.keys[b]), toString(lease.mBoundDigests[b]));
  }
}

ContextCacheManager::Projection ContextCacheManager::project(char const* call,
                                                             std::span<PageId const> producerPages,
                                                             PromptBlocks const& blocks,
                                                             int32_t count) const {
  Projection projection;
  projection.canonical.reserve(static_cast<std::size_t>(count));
  std::unordered_map<Hash128, PageId, Hash128Hasher> firstInThisPublication;
  // While every block so far matched an indexed block token by token, the content chain needs
  // no comparison; after the first block that did not, holds() compares it.
  bool ancestorsVerified = true;
  for (int32_t b = 0; b < count; ++b) {
    Hash128 const key = blocks.keys[static_cast<std::size_t>(b)];
    if (std::optional<PageId> const indexed = mIndex.find(key)) {
      if (mIndex.verifiesTokens() && !mIndex.holds(*indexed, blocks, b, ancestorsVerified)) {
        projection.verificationRejected = true;
        break;
      }
      projection.canonical.push_back(*indexed);
      continue;
    }
    ancestorsVerified = false;
    if (auto const it = firstInThisPublication.find(key); it != firstInThisPublication.end()) {
      projection.canonical.push_back(it->second);
      continue;
    }
    PageId const page = producerPages[static_cast<std::size_t>(b)];
    std::optional<Hash128> const other = mIndex.digestOf(page);
    MKV_REQUIRE(!other, call, "page {} of block {} is already indexed under digest {}, not {}",
                page, b, toString(*other), toString(key));
    projection.canonical.push_back(page);
    projection.newMappings.push_back(b);
    firstInThisPublication.emplace(key, page);
  }
  projection.count = static_cast<int32_t>(projection.canonical.size());
  return projection;
}

PublishResult ContextCacheManager::commitNewRecord(CacheRecord record,
                                                   CacheRequestLease const& lease,
                                                   PromptBlocks const& blocks,
                                                   Projection const& projection) {
  // Everything that can throw happens before commit(); after it only noexcept steps remain.
  PublishResult result{PublishStatus::kPublished, kNoRecord, record.basePagePath,
                       record.key.fullBlockCount};
  std::size_t refs = 0;
  record.forEachResource([&refs](ResourceId) { ++refs; });
  PublicationTransaction transaction(*this, refs, projection.newMappings.size());
  record.forEachResource([&transaction](ResourceId id) { transaction.addCache(id); });
  for (int32_t b : projection.newMappings) {
    transaction.index(blocks, b, projection.canonical[static_cast<std::size_t>(b)]);
  }
  RecordStore::InsertResult const inserted = mRecords.insert(
      std::move(record), RecordInsertHint{!lease.mBoundDigests.empty(), lease.mEvictedPrefix});
  MKV_ASSERT(inserted.inserted, "record key already present after the duplicate check");
  transaction.setRecord(inserted.record->id);
  transaction.commit();

  result.record = inserted.record->id;
  ++mMetrics.publishedRecords;
  for (int32_t b : projection.newMappings) {
    auto const block = static_cast<std::size_t>(b);
    mEvents.pushStored(BlockStored{blocks.keys[block],
                                   blocks.parentOf(b),
                                   projection.canonical[block],
                                   mPageSize,
                                   {},
                                   blocks.extrasDigest(b),
                                   KvMedium::kGpu,
                                   eventGroup()},
                       blocks.blockTokens(b));
  }
  if (mOptions.mirrorPublishedBlocks) {
    for (int32_t b : projection.newMappings) {
      auto const block = static_cast<std::size_t>(b);
      mirrorPublished(projection.canonical[block], blocks.keys[block]);
    }
  }
  enforceRecordLimit();
  if (mRecords.get(result.record) == nullptr) {
    result.record = kNoRecord;  // maxRecords == 0: evicted at once
  }
  return result;
}

void ContextCacheManager::checkPublication(char const* call, CacheRequestLease const& lease,
                                           PromptBlocks const& blocks, int32_t count) const {
  MKV_REQUIRE(static_cast<std::size_t>(count) <= lease.mBasePages.size(), call,
              "{} blocks but the lease holds {} base pages", count, lease.mBasePages.size());
  bool const paged = pairedDraft(lease.mode());
  MKV_REQUIRE(!paged || static_cast<std::size_t>(count) <= lease.mDraftPages.size(), call,
              "{} blocks but the lease holds {} draft pages", count, lease.mDraftPages.size());
  checkBoundPrefix(call, lease, blocks, count);
  if (std::optional<SpecReplayDependency> const& dependency = lease.mReplayDependency) {
    MKV_REQUIRE(count >= dependency->pathBlockCount, call,
                "{} blocks do not cover the replayed path of {} blocks", count,
                dependency->pathBlockCount);
    MKV_REQUIRE(blocks.keys[static_cast<std::size_t>(dependency->pathBlockCount - 1)] ==
                    dependency->terminalDigest,
                call, "block {} digest differs from the replayed path's boundary {}",
                dependency->pathBlockCount - 1, toString(dependency->terminalDigest));
  }
}

PublishResult ContextCacheManager::publishExisting(CacheRequestLease const& lease,
                                                   CacheRecord const& existing, int32_t published) {
  PublishResult result{PublishStatus::kExistingRecord, existing.id, existing.basePagePath,
                       published};
  if (pairedDraft(lease.mode()) && !existing.specState) {
    SpecState state{firstOf(lease.draftPages(), published)};
    PublicationTransaction transaction(*this, state.draftPagePath.size(), 0);
    for (PageId page : state.draftPagePath) {
      transaction.addCache({ResourceType::kDraftKvPage, page});
    }
    mRecords.setSpecState(existing.id, std::move(state));
    transaction.commit();
    ++mMetrics.specUpgrades;
    result.status = PublishStatus::kSpecStateAttached;
  } else {
    mRecords.touch(existing.id);
    ++mMetrics.existingRecordsTouched;
  }
  return result;
}

PublishResult ContextCacheManager::publish(CacheRequestLease& lease, PromptBlocks const& blocks,
                                           int32_t residentStateLength, Publication kind) {
  constexpr char const* kCall = "ContextCacheManager::publish";
  checkLease(kCall, lease);
  MKV_REQUIRE(lease.mode() == ReuseMode::kVanilla || lease.mode() == ReuseMode::kSpec, kCall,
              "{} lease; use publishHybrid / publishHybridMtp", toString(lease.mode()));
  MKV_REQUIRE(blocks.pageSize == mPageSize, kCall,
              "blocks hashed with page size {}, manager uses {}", blocks.pageSize, mPageSize);
  MKV_REQUIRE(residentStateLength >= 0, kCall, "negative resident length {}", residentStateLength);
  int32_t const count = std::min(blocks.fullBlockCount(), residentStateLength / mPageSize);
  MKV_REQUIRE(count > 0, kCall, "nothing to publish: {} full blocks, resident length {}",
              blocks.fullBlockCount(), residentStateLength);
  checkPublication(kCall, lease, blocks, count);

  Projection projection = project(kCall, lease.basePages(), blocks, count);
  if (projection.verificationRejected) {
    ++mMetrics.verificationRejects;
  }
  if (projection.count == 0) {
    ++mMetrics.rejectedPublications;
    return {};
  }
  int32_t const published = projection.count;
  RecordKey const key{blocks.keys[static_cast<std::size_t>(published - 1)], published};
  if (CacheRecord const* existing = mRecords.find(key)) {
    PublishResult result = publishExisting(lease, *existing, published);
    replaceChunkRecord(lease, existing->id);  // the cached record holds the chunk's pages too
    return result;
  }

  CacheRecord record;
  record.key = key;
  record.logicalBlockDigests = firstOf(std::span<Hash128 const>(blocks.keys), published);
  record.basePagePath = projection.canonical;
  if (pairedDraft(lease.mode())) {
    record.specState = SpecState{firstOf(lease.draftPages(), published)};
  }
  applyRetention(record, lease, int64_t{published} * mPageSize - 1);
  PublishResult result = commitNewRecord(std::move(record), lease, blocks, projection);
  if (result.record != kNoRecord) {
    replaceChunkRecord(lease, result.record);
    lease.mChunkRecord = kind == Publication::kChunk ? result.record : kNoRecord;
  }
  return result;
}

void ContextCacheManager::settlePublications(CacheRequestLease& lease) noexcept {
  lease.mChunkRecord = kNoRecord;
}

void ContextCacheManager::replaceChunkRecord(CacheRequestLease& lease, RecordId latest) noexcept {
  RecordId const earlier = std::exchange(lease.mChunkRecord, kNoRecord);
  CacheRecord const* const old = mRecords.get(earlier);
  CacheRecord const* const now = mRecords.get(latest);
  if (old == nullptr || now == nullptr || old->isHybrid() ||
      old->key.fullBlockCount >= now->key.fullBlockCount ||
      old->retentionPriority != now->retentionPriority ||
      old->retentionExpiry != now->retentionExpiry ||
      old->specState.has_value() != now->specState.has_value()) {
    return;
  }
  auto const isPrefix = [](std::vector<PageId> const& head, std::vector<PageId> const& path) {
    return head.size() <= path.size() && std::equal(head.begin(), head.end(), path.begin());
  };
  if (!isPrefix(old->basePagePath, now->basePagePath) ||
      (old->specState && !isPrefix(old->specState->draftPagePath, now->specState->draftPagePath))) {
    return;
  }
  // Every resource of the chunk's record is one of the latest's: dropping it frees nothing and
  // leaves the index as it is (each page keeps the latest record's cache reference).
  ++mStateVersion;
  old->forEachResource([&](ResourceId resource) {
    bool const freed = mPools.dropCache(resource);
    MKV_ASSERT(!freed && mPools.cacheRefs(resource) > 0,
               "replaced chunk record {} held {} {} alone", earlier, toString(resource.type),
               resource.index);
  });
  mRecords.erase(earlier);
  ++mMetrics.replacedChunkRecords;
}

int32_t ContextCacheManager::checkCheckpoint(char const* call, CacheRequestLease const& lease,
                                             PromptBlocks const& blocks, int32_t exactLength,
                                             SnapshotReservation const& reservation,
                                             bool mtp) const {
  checkLease(call, lease);
  ReuseMode const mode = mtp ? ReuseMode::kHybridMtp : ReuseMode::kHybrid;
  MKV_REQUIRE(lease.mode() == mode, call, "{} lease; expected {}", toString(lease.mode()),
              toString(mode));
  MKV_REQUIRE(blocks.pageSize == mPageSize, call,
              "blocks hashed with page size {}, manager uses {}", blocks.pageSize, mPageSize);
  MKV_REQUIRE(exactLength > 0 && exactLength <= blocks.tokenCount(), call,
              "checkpoint length {} outside (0, {}]", exactLength, blocks.tokenCount());
  int32_t const full = mtp ? (exactLength - 1) / mPageSize : exactLength / mPageSize;
  bool const attention = lease.hasAttention();
  bool const needsPartial = mtp || (attention && exactLength % mPageSize != 0);
  MKV_REQUIRE(reservation.partialKvSlot.has_value() == needsPartial, call,
              "checkpoint at {} {} a partial-KV snapshot", exactLength,
              needsPartial ? "needs" : "must not carry");
  MKV_REQUIRE(std::find(lease.mReservations.begin(), lease.mReservations.end(), reservation) !=
                  lease.mReservations.end(),
              call, "recurrent slot {} is not a reservation of this lease",
              reservation.recurrentSlot);
  MKV_REQUIRE(!attention || static_cast<std::size_t>(full) <= lease.mBasePages.size(), call,
              "{} full blocks but the lease holds {} base pages", full, lease.mBasePages.size());
  MKV_REQUIRE(!mtp || static_cast<std::size_t>(full) <= lease.mDraftPages.size(), call,
              "{} full blocks but the lease holds {} draft pages", full, lease.mDraftPages.size());
  checkBoundPrefix(call, lease, blocks, full);
  return full;
}

PublishResult ContextCacheManager::publishCheckpoint(char const* call, CacheRequestLease& lease,
                                                     PromptBlocks const& blocks,
                                                     int32_t exactLength,
                                                     SnapshotReservation const& reservation,
                                                     bool mtp, bool reusePoint,
                                                     std::optional<int32_t> speculationRank) {
  int32_t const full = checkCheckpoint(call, lease, blocks, exactLength, reservation, mtp);
  bool const attention = lease.hasAttention();
  Hash128 const digest = exactPrefixDigest(blocks, exactLength);
  // First committer wins within one kind. A plain checkpoint is also cached already when an
  // unaligned Hybrid-MTP one exists (plain plans restore its base side); a Hybrid-MTP checkpoint
  // never counts a base-only one, which its plans cannot use.
  CacheRecord const* existing = mRecords.findHybrid(HybridKey{digest, exactLength, mtp});
  if (existing == nullptr && !mtp && attention && exactLength % mPageSize != 0) {
    existing = mRecords.findHybrid(HybridKey{digest, exactLength, true});
  }
  if (existing != nullptr) {
    mRecords.touch(existing->id);
    ++mMetrics.existingRecordsTouched;
    return {PublishStatus::kExistingRecord, existing->id, existing->basePagePath, full};
  }
  Projection projection;
  if (attention) {
    projection = project(call, lease.basePages(), blocks, full);
  } else {
    projection.count = full;
  }
  if (projection.verificationRejected) {
    ++mMetrics.verificationRejects;
  }
  if (projection.count < full) {
    ++mMetrics.rejectedPublications;  // a checkpoint needs every one of its blocks
    return {};
  }

  CacheRecord record;
  record.key = RecordKey{digest, full};
  record.logicalBlockDigests = firstOf(std::span<Hash128 const>(blocks.keys), full);
  record.basePagePath = projection.canonical;
  if (mtp) {
    record.specState = SpecState{firstOf(lease.draftPages(), full)};
  }
  record.recurrentSnapshotSlot = reservation.recurrentSlot;
  record.partialKvSnapshotSlot = reservation.partialKvSlot;
  record.exactCheckpointLength = exactLength;
  record.reusePoint = reusePoint;
  if (mIndex.verifiesTokens()) {
    std::size_t const covered = record.basePagePath.size() * static_cast<std::size_t>(mPageSize);
    auto const tail =
        blocks.prompt.tokens.subspan(covered, static_cast<std::size_t>(exactLength) - covered);
    record.verificationTokens.assign(tail.begin(), tail.end());
  }
  applyRetention(record, lease, int64_t{exactLength} - 1);
  if (speculationRank) {
    record.speculative = true;
    record.speculationRank = *speculationRank;
    record.heldPriority = record.retentionPriority;
    record.retentionPriority = speculationPriority(*speculationRank, record.heldPriority);
  }
  return commitNewRecord(std::move(record), lease, blocks, projection);
}

PublishResult ContextCacheManager::publishHybrid(CacheRequestLease& lease,
                                                 PromptBlocks const& blocks, int32_t exactLength,
                                                 SnapshotReservation const& reservation,
                                                 bool reusePoint,
                                                 std::optional<int32_t> speculationRank) {
  return publishCheckpoint("ContextCacheManager::publishHybrid", lease, blocks, exactLength,
                           reservation, false, reusePoint, speculationRank);
}

void ContextCacheManager::supersedeHit(CacheRequestLease const& lease,
                                       int32_t exactLength) noexcept {
  CacheRecord const* hit =
      lease.hitRecord() != kNoRecord ? mRecords.get(lease.hitRecord()) : nullptr;
  // A prompt or decode end the line went past; a point inside a prompt is a shared prefix.
  if (hit != nullptr && hit->isHybrid() && !hit->reusePoint &&
      *hit->exactCheckpointLength < exactLength) {
    mRecords.demote(hit->id);
  }
}

PublishResult ContextCacheManager::publishHybridMtp(CacheRequestLease& lease,
                                                    PromptBlocks const& blocks, int32_t exactLength,
                                                    SnapshotReservation const& reservation) {
  return publishCheckpoint("ContextCacheManager::publishHybridMtp", lease, blocks, exactLength,
                           reservation, true, false, std::nullopt);
}

}  // namespace mkv
