#include "mkv/context_cache/context_cache_coordinator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <limits>
#include <new>
#include <utility>

#include "core/check.h"
#include "core/device.h"
#include "mkv/logging.h"

namespace mkv {
namespace {

/// kPrefilling: between preparePrefill and finalizePrefillPublication (the prefill is the pending
/// work); kExecuting: after it (decode steps, compaction and joins).
enum class Phase : uint8_t { kAdmitted, kPrefilling, kExecuting, kFinishing };

int32_t pagesFor(int64_t tokens, int32_t pageSize) {
  return static_cast<int32_t>((tokens + pageSize - 1) / pageSize);
}

/// Block granularity of the digests of a pure-recurrent deployment (it has no pages; checkpoints
/// are keyed by exact prefix digests chained over blocks of this many tokens).
constexpr int32_t kPureRecurrentBlockTokens = 128;

bool isHold(ContextCacheSequenceAdvance const& advance) {
  return advance.acceptedTokenCount == 0 &&
         advance.committedStateLength == kHoldCommittedStateLength;
}

}  // namespace

struct ContextCacheCoordinator::Request {
  struct Sequence {
    CacheRequestLease lease;
    ResidentRef resident;
    std::vector<int32_t> tokens;       // ledger: prompt, then accepted tokens
    std::vector<MediaPosition> media;  // empty, or one entry per ledger token
    BlockKeyExtras extras;
    ContextCacheLookupPolicy policy = ContextCacheLookupPolicy::kUseCache;
    int32_t promptLength = 0;
    int32_t reuseTokenLength = 0;
    int32_t committed = 0;        // tokens with materialised KV
    int32_t publishedBlocks = 0;  // full blocks already published
    bool joined = true;           // false: admitted in flight, not finalised yet
    // Checkpoint deployments: the longest exact checkpoint published, and the capture enqueued
    // but not committed yet (its slots are reservations of the lease).
    int32_t publishedExact = 0;
    // Speculative requests: tokens whose base and draft state are both materialised, and the
    // prompt endpoint frozen until the draft initialisation is known complete.
    int32_t common = 0;
    int32_t frozenPrefill = 0;
    struct StagedCapture {
      SnapshotReservation reservation;
      int32_t exactLength = 0;
    };
    std::optional<StagedCapture> staged;
  };

  uint64_t id = 0;
  Phase phase = Phase::kAdmitted;
  bool pending = false;
  bool speculative = false;
  // A speculative request's draft initialisation (enqueued by the runtime after the prefill) is
  // not known complete: the frozen prompt endpoints wait for the first verification round or a
  // synchronisation of the coordinator.
  bool draftInitPending = false;
  DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead;
  ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  ContextCacheLookupPolicy batchPolicy = ContextCacheLookupPolicy::kUseCache;
  std::vector<Sequence> sequences;
  std::vector<int32_t> mapping;
  int32_t newBatchSize = -1;
  Tensor* deviceMapping = nullptr;
};

// ---------------------------------------------------------------- RequestHandle

ContextCacheCoordinator::RequestHandle::RequestHandle(RequestHandle&& other) noexcept
    : mCoordinator(std::exchange(other.mCoordinator, nullptr)), mId(std::exchange(other.mId, 0)) {}

ContextCacheCoordinator::RequestHandle& ContextCacheCoordinator::RequestHandle::operator=(
    RequestHandle&& other) noexcept {
  if (this != &other) {
    abandon();
    mCoordinator = std::exchange(other.mCoordinator, nullptr);
    mId = std::exchange(other.mId, 0);
  }
  return *this;
}

ContextCacheCoordinator::RequestHandle::~RequestHandle() { abandon(); }

void ContextCacheCoordinator::RequestHandle::abandon() noexcept {
  if (mCoordinator != nullptr) {
    mCoordinator->abandon(mId);
    mCoordinator = nullptr;
    mId = 0;
  }
}

// ---------------------------------------------------------------- construction

ContextCacheCoordinator::ContextCacheCoordinator(ContextCacheConfig const& config,
                                                 ContextCacheDeploymentProfile const& profile,
                                                 ContextCachePhysicalResources resources,
                                                 cudaStream_t stream,
                                                 StreamSynchronizer synchronizer)
    : mConfig(config),
      mProfile(profile),
      mResources(resources),
      mStream(stream),
      mSynchronizer(std::move(synchronizer)) {
  constexpr char const* kCall = "ContextCacheCoordinator";
  MKV_REQUIRE(config.maxRecords >= 0, kCall, "maxRecords must be >= 0, got {}", config.maxRecords);
  MKV_REQUIRE(config.eventQueueCapacity >= 0, kCall, "eventQueueCapacity must be >= 0, got {}",
              config.eventQueueCapacity);
  MKV_REQUIRE(config.recurrentSnapshotPoolBytes >= 0 && config.partialKvSnapshotPoolBytes >= 0,
              kCall, "snapshot budgets must be >= 0, got recurrent {} and partial {} bytes",
              config.recurrentSnapshotPoolBytes, config.partialKvSnapshotPoolBytes);
  MKV_REQUIRE(
      static_cast<uint8_t>(profile.baseStateKind) <= static_cast<uint8_t>(BaseStateKind::kHybrid),
      kCall, "base state kind {} out of range", static_cast<int>(profile.baseStateKind));
  if (profile.isSpeculative()) {
    MKV_REQUIRE(profile.speculative->futureDependencyTokens >= 0, kCall,
                "speculative futureDependencyTokens must be >= 0, got {}",
                profile.speculative->futureDependencyTokens);
    MKV_REQUIRE(profile.hasAttention(), kCall,
                "a pure-recurrent deployment cannot be speculative (no KV for a draft to pair "
                "with)");
  }
  bool const mtp = profile.isHybridMtp();
  bool const paged = profile.ownsPagedSpecState();
  MKV_REQUIRE(!mtp || paged, kCall,
              "a Hybrid-MTP deployment needs an own-KV draft: the speculative contract must be "
              "paged");
  MKV_REQUIRE(mtp || profile.boundaryHiddenWidth == 0, kCall,
              "boundaryHiddenWidth {} is for Hybrid-MTP deployments only",
              profile.boundaryHiddenWidth);
  MKV_REQUIRE(!mtp || profile.boundaryHiddenWidth > 0, kCall,
              "a Hybrid-MTP deployment needs boundaryHiddenWidth > 0, got {}",
              profile.boundaryHiddenWidth);
  MKV_REQUIRE(!mtp || dataTypeSize(profile.boundaryHiddenType) > 0, kCall,
              "boundaryHiddenType {} out of range", static_cast<int>(profile.boundaryHiddenType));
  MKV_REQUIRE(paged || (resources.draftPool == nullptr && resources.draftPageTable == nullptr),
              kCall, "draft resources given to a {}",
              profile.isSpeculative() ? "speculative deployment whose draft has no paged KV"
                                      : "non-speculative deployment");
  RecurrentStatePool const* recurrent = resources.recurrent;
  MKV_REQUIRE(!profile.usesCheckpointReuse() || recurrent != nullptr, kCall,
              "a {} deployment needs the recurrent state pool",
              profile.hasAttention() ? "hybrid" : "pure-recurrent");
  if (profile.hasAttention()) {
    MKV_REQUIRE(resources.basePool != nullptr && resources.basePageTable != nullptr, kCall,
                "an attention deployment needs basePool and basePageTable");
    KVCachePool const& pool = *resources.basePool;
    KVPageTable const& table = *resources.basePageTable;
    MKV_REQUIRE(table.mode() == PageTableMode::kDense, kCall, "the base page table must be dense");
    MKV_REQUIRE(table.numPages() == pool.numPages(), kCall,
                "base page table addresses {} pages but the pool has {}", table.numPages(),
                pool.numPages());
    MKV_REQUIRE(table.deviceType() == pool.deviceType(), kCall, "table on {} but pool on {}",
                toString(table.deviceType()), toString(pool.deviceType()));
    MKV_REQUIRE(pool.maxBatchSize() >= table.maxBatch(), kCall,
                "pool KV lengths hold {} rows but the table has {}", pool.maxBatchSize(),
                table.maxBatch());
    mMaxBatch = table.maxBatch();
    mDevice = pool.deviceType();
  } else {
    MKV_REQUIRE(resources.basePool == nullptr && resources.basePageTable == nullptr, kCall,
                "a pure-recurrent deployment has no KV: basePool and basePageTable must be null");
    mMaxBatch = recurrent->numSlots();
    mDevice = recurrent->deviceType();
  }
  if (recurrent != nullptr) {
    MKV_REQUIRE(recurrent->numSlots() >= mMaxBatch, kCall,
                "recurrent pool has {} slots but the table has {} rows", recurrent->numSlots(),
                mMaxBatch);
    MKV_REQUIRE(recurrent->deviceType() == mDevice, kCall, "recurrent pool on {} but KV on {}",
                toString(recurrent->deviceType()), toString(mDevice));
  }
  if (paged) {
    MKV_REQUIRE(resources.draftPool != nullptr && resources.draftPageTable != nullptr, kCall,
                "a paged speculative deployment needs draftPool and draftPageTable");
    KVCachePool const& draft = *resources.draftPool;
    KVPageTable const& table = *resources.draftPageTable;
    MKV_REQUIRE(table.mode() == PageTableMode::kDense, kCall, "the draft page table must be dense");
    MKV_REQUIRE(table.numPages() == draft.numPages(), kCall,
                "draft page table addresses {} pages but the draft pool has {}", table.numPages(),
                draft.numPages());
    MKV_REQUIRE(draft.tokensPerPage() == resources.basePool->tokensPerPage(), kCall,
                "draft pages hold {} tokens but base pages {}", draft.tokensPerPage(),
                resources.basePool->tokensPerPage());
    MKV_REQUIRE(table.deviceType() == mDevice && draft.deviceType() == mDevice, kCall,
                "draft table on {} and draft pool on {} but base KV on {}",
                toString(table.deviceType()), toString(draft.deviceType()), toString(mDevice));
    MKV_REQUIRE(table.maxBatch() == mMaxBatch && draft.maxBatchSize() >= mMaxBatch, kCall,
                "draft table has {} rows and draft pool KV lengths {} but the base table has {}",
                table.maxBatch(), draft.maxBatchSize(), mMaxBatch);
  }
  if (!mSynchronizer) {
    mSynchronizer = defaultStreamSynchronizer(mDevice);
  }
  ResourceDemand capacities{};
  capacities.baseKvPages = hasKv() ? resources.basePool->numPages() : 0;
  capacities.draftKvPages = paged ? resources.draftPool->numPages() : 0;
  SnapshotStorageConfig snapshots;
  if (profile.usesCheckpointReuse()) {
    auto slotsOf = [&](int64_t budget, int64_t bytesPerSlot, char const* field) {
      int64_t const slots = budget / bytesPerSlot;
      MKV_REQUIRE(slots <= std::numeric_limits<int32_t>::max(), kCall,
                  "{} {} gives {} slots, more than int32 holds", field, budget, slots);
      MKV_REQUIRE(!config.enabled || slots >= 1, kCall, "{} {} holds no snapshot slot of {} bytes",
                  field, budget, bytesPerSlot);
      return static_cast<int32_t>(slots);
    };
    // A Hybrid-MTP slot also holds the boundary hidden row, and its partial page the draft's.
    int64_t recurrentBytes = SnapshotStorage::recurrentBytesPerSlot(*recurrent);
    if (mtp) {
      snapshots.boundaryHiddenWidth = profile.boundaryHiddenWidth;
      snapshots.boundaryHiddenType = profile.boundaryHiddenType;
      recurrentBytes += SnapshotStorage::boundaryHiddenBytesPerSlot(profile.boundaryHiddenWidth,
                                                                    profile.boundaryHiddenType);
    }
    snapshots.recurrentSlots =
        slotsOf(config.recurrentSnapshotPoolBytes, recurrentBytes, "recurrentSnapshotPoolBytes");
    if (hasKv()) {
      int64_t partialBytes = SnapshotStorage::partialKvBytesPerSlot(*resources.basePool);
      if (mtp) {
        partialBytes += SnapshotStorage::partialKvBytesPerSlot(*resources.draftPool);
      }
      snapshots.partialKvSlots =
          slotsOf(config.partialKvSnapshotPoolBytes, partialBytes, "partialKvSnapshotPoolBytes");
    }
    capacities.recurrentSnapshotSlots = snapshots.recurrentSlots;
    capacities.partialKvSnapshotSlots = snapshots.partialKvSlots;
  }
  ContextCacheManagerOptions options;
  options.verifyTokens = config.verifyTokens;
  options.eventQueueCapacity = config.eventQueueCapacity;
  options.specContract = profile.speculative;
  mManager = std::make_unique<ContextCacheManager>(
      hasKv() ? resources.basePool->tokensPerPage() : kPureRecurrentBlockTokens, capacities,
      config.enabled ? config.maxRecords : 0, options);
  if (profile.usesCheckpointReuse()) {
    mSnapshots = std::make_unique<SnapshotStorage>(snapshots, resources.recurrent,
                                                   resources.basePool,
                                                   mtp ? resources.draftPool : nullptr);
  }
  mResidentBusy.assign(static_cast<std::size_t>(mMaxBatch), 0);
  mMappingUploads = std::make_unique<detail::Int32UploadRegions>(mMaxBatch, mMaxBatch, mDevice);
}

ContextCacheCoordinator::~ContextCacheCoordinator() {
  if (!mActive.empty() || !mQuarantine.empty()) {
    logger()->critical(
        "ContextCacheCoordinator destroyed with {} active and {} quarantined requests",
        mActive.size(), mQuarantine.size());
    std::terminate();
  }
}

// ---------------------------------------------------------------- helpers

ContextCacheCoordinator::Request& ContextCacheCoordinator::request(RequestHandle const& handle,
                                                                   char const* call) const {
  MKV_REQUIRE(handle.mCoordinator == this, call, "the request handle is {}",
              handle.mCoordinator == nullptr ? "invalid" : "from another coordinator");
  for (auto const& active : mActive) {
    if (active->id == handle.mId) {
      return *active;
    }
  }
  detail::throwContract(call, "request {} is not active", handle.mId);
}

int32_t ContextCacheCoordinator::batchSize(RequestHandle const& handle) const {
  return static_cast<int32_t>(request(handle, "ContextCacheCoordinator::batchSize").sequences.size());
}

namespace {
template <typename Req>
auto& sequenceAt(Req& req, int32_t slot, char const* call) {
  MKV_REQUIRE(slot >= 0 && static_cast<std::size_t>(slot) < req.sequences.size(), call,
              "slot {} outside the batch of {}", slot, req.sequences.size());
  return req.sequences[static_cast<std::size_t>(slot)];
}
}  // namespace

int32_t ContextCacheCoordinator::reuseTokenLength(RequestHandle const& handle, int32_t slot) const {
  constexpr char const* kCall = "ContextCacheCoordinator::reuseTokenLength";
  return sequenceAt(request(handle, kCall), slot, kCall).reuseTokenLength;
}

int32_t ContextCacheCoordinator::committedLength(RequestHandle const& handle, int32_t slot) const {
  constexpr char const* kCall = "ContextCacheCoordinator::committedLength";
  return sequenceAt(request(handle, kCall), slot, kCall).committed;
}

std::span<PageId const> ContextCacheCoordinator::basePages(RequestHandle const& handle,
                                                           int32_t slot) const {
  constexpr char const* kCall = "ContextCacheCoordinator::basePages";
  return sequenceAt(request(handle, kCall), slot, kCall).lease.basePages();
}

std::span<PageId const> ContextCacheCoordinator::draftPages(RequestHandle const& handle,
                                                            int32_t slot) const {
  constexpr char const* kCall = "ContextCacheCoordinator::draftPages";
  return sequenceAt(request(handle, kCall), slot, kCall).lease.draftPages();
}

int32_t ContextCacheCoordinator::commonLength(RequestHandle const& handle, int32_t slot) const {
  constexpr char const* kCall = "ContextCacheCoordinator::commonLength";
  return sequenceAt(request(handle, kCall), slot, kCall).common;
}

bool ContextCacheCoordinator::pairsDraft(Request const& req) const noexcept {
  return req.speculative && mProfile.ownsPagedSpecState();
}

bool ContextCacheCoordinator::isHybridMtp(Request const& req) const noexcept {
  return req.speculative && mProfile.isHybridMtp();
}

void ContextCacheCoordinator::uploadTables(bool paired) {
  mDeviceWrites.flushAfter(mStream, [&] { queueTableUploads(paired); });
}

void ContextCacheCoordinator::queueTableUploads(bool paired) {
  mResources.basePageTable->uploadDirty(mDeviceWrites, mStream);
  if (paired) {
    mResources.draftPageTable->uploadDirty(mDeviceWrites, mStream);
  }
}

bool ContextCacheCoordinator::supportsLiveSequenceAdmission() const noexcept {
  return mProfile.baseStateKind == BaseStateKind::kAttentionOnly && !mProfile.isSpeculative();
}

bool ContextCacheCoordinator::synchronize() noexcept {
  ++mCounters.synchronizations;
  cudaError_t status = cudaErrorUnknown;
  try {
    status = mSynchronizer(mStream);
  } catch (...) {
    status = cudaErrorUnknown;
  }
  if (status != cudaSuccess) {
    logger()->error("ContextCacheCoordinator: stream synchronisation failed ({}); poisoned",
                    detail::cudaErrorName(status));
    mPoisoned = true;
    return false;
  }
  return true;
}

std::unique_ptr<ContextCacheCoordinator::Request> ContextCacheCoordinator::detach(
    uint64_t id) noexcept {
  for (auto it = mActive.begin(); it != mActive.end(); ++it) {
    if ((*it)->id == id) {
      std::unique_ptr<Request> detached = std::move(*it);
      mActive.erase(it);
      return detached;
    }
  }
  return nullptr;
}

void ContextCacheCoordinator::quarantine(std::unique_ptr<Request> req) noexcept {
  if (req == nullptr) {
    return;
  }
  mPoisoned = true;
  ++mCounters.quarantinedRequests;
  mQuarantine.push_back(std::move(req));  // capacity reserved at admission
}

void ContextCacheCoordinator::releaseRows(Request& req) {
  if (!hasKv()) {
    return;
  }
  bool const paired = pairsDraft(req);
  for (auto const& sequence : req.sequences) {
    mResources.basePageTable->clearRow(sequence.resident.slot);
    if (paired) {
      mResources.draftPageTable->clearRow(sequence.resident.slot);
    }
  }
  uploadTables(paired);
}

void ContextCacheCoordinator::abandon(uint64_t id) noexcept {
  std::unique_ptr<Request> abandoned = detach(id);
  if (abandoned == nullptr) {
    return;
  }
  // An abandoned request publishes nothing, not even a frozen speculative prompt endpoint.
  if ((abandoned->pending || abandoned->draftInitPending) && !synchronize()) {
    quarantine(std::move(abandoned));
    return;
  }
  try {
    releaseRows(*abandoned);
  } catch (std::exception const& error) {
    logger()->error("ContextCacheCoordinator: abandoning a request failed: {}", error.what());
    quarantine(std::move(abandoned));
    return;
  }
  for (auto const& sequence : abandoned->sequences) {
    mResidentBusy[static_cast<std::size_t>(sequence.resident.slot)] = 0;
  }
}

// ---------------------------------------------------------------- admission

/// The manager's view of one sequence admission (it refers to `sequence`'s tokens and media).
LookupRequest ContextCacheCoordinator::lookupOf(ContextCacheSequenceAdmission const& sequence,
                                                ContextCacheLookupPolicy policy,
                                                DecodingKvHeadroom const& headroom,
                                                bool speculative) const {
  LookupRequest lookup;
  lookup.prompt = PromptView{sequence.tokenIds, sequence.media, sequence.keyExtras};
  // A vanilla request on a speculative deployment reuses and publishes the base side only.
  bool const checkpoints = mProfile.usesCheckpointReuse();
  if (speculative) {
    lookup.mode = checkpoints ? ReuseMode::kHybridMtp : ReuseMode::kSpec;
    lookup.draftExtraTokens = mProfile.ownsPagedSpecState() ? headroom.draftExtraTokens : 0;
  } else {
    lookup.mode = checkpoints ? ReuseMode::kHybrid : ReuseMode::kVanilla;
  }
  lookup.hasAttention = hasKv();
  lookup.policy = mConfig.enabled ? policy : ContextCacheLookupPolicy::kBypass;
  lookup.baseExtraTokens = headroom.baseExtraTokens;
  return lookup;
}

namespace {

/// `paired`: the request binds draft pages, which then need headroom of their own.
void validateHeadroom(char const* call, DecodingKvHeadroom const& headroom, bool paired) {
  MKV_REQUIRE(headroom.baseExtraTokens > 0, call, "baseExtraTokens must be > 0, got {}",
              headroom.baseExtraTokens);
  if (paired) {
    MKV_REQUIRE(headroom.draftExtraTokens > 0, call,
                "draftExtraTokens must be > 0 for a request with paged draft state, got {}",
                headroom.draftExtraTokens);
  } else {
    MKV_REQUIRE(headroom.draftExtraTokens == 0, call,
                "draftExtraTokens {} given, but the request has no paged draft state",
                headroom.draftExtraTokens);
  }
}

}  // namespace

ContextCacheCoordinator::BeginRequestResult ContextCacheCoordinator::beginRequest(
    ContextCacheBatchAdmission const& admission, DecodingKvHeadroom const& headroom,
    cudaStream_t stream) {
  constexpr char const* kCall = "ContextCacheCoordinator::beginRequest";
  MKV_REQUIRE(stream == mStream, kCall, "stream differs from the coordinator's construction stream");
  MKV_REQUIRE(static_cast<uint8_t>(admission.tokenStateContract) <= 1 &&
                  static_cast<uint8_t>(admission.commitPolicy) <= 1 &&
                  static_cast<uint8_t>(admission.lookupPolicy) <= 1,
              kCall, "contract {} / commit policy {} / lookup policy {} out of range",
              static_cast<int>(admission.tokenStateContract),
              static_cast<int>(admission.commitPolicy), static_cast<int>(admission.lookupPolicy));
  MKV_REQUIRE(!admission.speculativeRequest || mProfile.isSpeculative(), kCall,
              "speculative request on a non-speculative deployment");
  bool const speculative = admission.speculativeRequest;
  bool const paired = speculative && mProfile.ownsPagedSpecState();
  validateHeadroom(kCall, headroom, paired);
  std::size_t const batch = admission.sequences.size();
  MKV_REQUIRE(batch > 0 && batch <= static_cast<std::size_t>(mMaxBatch), kCall,
              "batch of {} sequences outside [1, {}]", batch, mMaxBatch);
  if (speculative && mProfile.isHybridMtp()) {
    // The runtime's Hybrid-MTP prefill publishes one endpoint of one sequence, and the draft KV
    // lags the base by the accepted span, so a decode-end checkpoint would hold short draft state.
    MKV_REQUIRE(batch == 1, kCall, "a Hybrid-MTP request has one sequence, got {}", batch);
    MKV_REQUIRE(admission.commitPolicy == ContextCacheCommitPolicy::kPrefillStateOnly, kCall,
                "a Hybrid-MTP request needs commit policy kPrefillStateOnly, got {}",
                static_cast<int>(admission.commitPolicy));
  }
  int32_t const pageSize = mManager->pageSize();
  std::vector<uint8_t> seen(mResidentBusy.size(), 0);
  for (std::size_t i = 0; i < batch; ++i) {
    auto const& sequence = admission.sequences[i];
    ResidentRef const ref = sequence.resident;
    MKV_REQUIRE(ref.slot >= 0 && ref.slot < mMaxBatch, kCall,
                "sequence {} has resident slot {} outside [0, {})", i, ref.slot, mMaxBatch);
    MKV_REQUIRE(ref.epoch != 0, kCall, "sequence {} (slot {}) has epoch 0", i, ref.slot);
    if (mResources.residentSlots != nullptr) {
      mResources.residentSlots->requireHeld(kCall, ref);
    }
    auto const slot = static_cast<std::size_t>(ref.slot);
    MKV_REQUIRE(seen[slot] == 0, kCall, "resident slot {} appears twice", ref.slot);
    seen[slot] = 1;
    MKV_REQUIRE(!sequence.tokenIds.empty(), kCall, "sequence {} has an empty prompt", i);
    MKV_REQUIRE(sequence.tokenIds.size() <
                    static_cast<std::size_t>(std::numeric_limits<int32_t>::max() - pageSize),
                kCall, "sequence {} has {} tokens, more than int32 positions", i,
                sequence.tokenIds.size());
    if (hasKv()) {
      int32_t const width = mResources.basePageTable->maxPagesPerSeq();
      int64_t const needed = pagesFor(
          static_cast<int64_t>(sequence.tokenIds.size()) + headroom.baseExtraTokens, pageSize);
      MKV_REQUIRE(needed <= width, kCall,
                  "sequence {} needs {} pages ({} tokens + {} headroom) but a row holds {}", i,
                  needed, sequence.tokenIds.size(), headroom.baseExtraTokens, width);
    }
    if (paired) {
      int32_t const width = mResources.draftPageTable->maxPagesPerSeq();
      int64_t const needed = pagesFor(
          static_cast<int64_t>(sequence.tokenIds.size()) + headroom.draftExtraTokens, pageSize);
      MKV_REQUIRE(needed <= width, kCall,
                  "sequence {} needs {} draft pages ({} tokens + {} headroom) but a draft row "
                  "holds {}",
                  i, needed, sequence.tokenIds.size(), headroom.draftExtraTokens, width);
    }
    MKV_REQUIRE(sequence.media.empty() || sequence.media.size() == sequence.tokenIds.size(), kCall,
                "sequence {} has {} media positions for {} tokens", i, sequence.media.size(),
                sequence.tokenIds.size());
    if (sequence.lookupPolicy) {
      MKV_REQUIRE(static_cast<uint8_t>(*sequence.lookupPolicy) <= 1, kCall,
                  "sequence {} lookup policy {} out of range", i,
                  static_cast<int>(*sequence.lookupPolicy));
    }
  }
  BeginRequestResult result;
  // Poisoned first: a quarantined request still holds its residents, and the runtime may have
  // handed one of those slots out again; that is the poisoned outcome, not a contract error.
  if (mPoisoned) {
    result.status = ContextCacheStatus::kPoisoned;
    return result;
  }
  for (auto const& sequence : admission.sequences) {
    MKV_REQUIRE(mResidentBusy[static_cast<std::size_t>(sequence.resident.slot)] == 0, kCall,
                "resident slot {} is held by another request", sequence.resident.slot);
  }

  auto created = std::make_unique<Request>();
  created->id = mNextRequestId;
  created->contract = admission.tokenStateContract;
  created->commitPolicy = admission.commitPolicy;
  created->batchPolicy = admission.lookupPolicy;
  created->speculative = speculative;
  created->sequences.reserve(static_cast<std::size_t>(mMaxBatch));
  // Media in a speculative batch: the draft's state is not keyed by media, so the whole batch
  // bypasses the cache.
  bool const mediaBypass =
      speculative && std::any_of(admission.sequences.begin(), admission.sequences.end(),
                                 [](auto const& sequence) { return !sequence.media.empty(); });
  std::vector<LookupRequest> lookups;
  lookups.reserve(batch);
  for (auto const& sequence : admission.sequences) {
    ContextCacheLookupPolicy const policy =
        mediaBypass ? ContextCacheLookupPolicy::kBypass
                    : sequence.lookupPolicy.value_or(admission.lookupPolicy);
    lookups.push_back(lookupOf(sequence, policy, headroom, speculative));
  }
  auto const start = std::chrono::steady_clock::now();
  auto refuse = [&]() {
    mCounters.planningNanoseconds += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                             start)
            .count());
    ++mCounters.refusedRequests;
    result.status = ContextCacheStatus::kRequestFailed;
  };
  // A refused request changes nothing: one sequence's acquire is all-or-nothing itself; several
  // are admitted together (pins first, one eviction for the whole batch, then allocation),
  // because an earlier sequence's eviction could otherwise cost a later one its hits after
  // records are already gone.
  std::vector<mkv::AdmissionResult> acquiredAll;
  if (batch == 1) {
    acquiredAll.push_back(mManager->acquireWithFallback(lookups[0]));
    if (!acquiredAll[0].lease) {
      refuse();
      return result;
    }
  } else {
    std::vector<LookupResult> looked;
    looked.reserve(batch);
    for (LookupRequest const& lookup : lookups) {
      looked.push_back(mManager->lookup(lookup));
    }
    acquiredAll = mManager->acquireBatch(lookups, std::move(looked));
    if (acquiredAll.empty()) {
      refuse();
      return result;
    }
  }
  for (std::size_t i = 0; i < batch; ++i) {
    auto const& sequence = admission.sequences[i];
    mkv::AdmissionResult& acquired = acquiredAll[i];
    Request::Sequence state;
    state.lease = std::move(*acquired.lease);
    state.resident = sequence.resident;
    state.tokens = sequence.tokenIds;
    state.media = sequence.media;
    state.extras = sequence.keyExtras;
    state.policy = lookups[i].policy;
    state.promptLength = static_cast<int32_t>(sequence.tokenIds.size());
    state.reuseTokenLength = acquired.plan.reuseTokenLength;
    state.committed = acquired.plan.reuseTokenLength;
    state.common = acquired.plan.reuseTokenLength;
    created->sequences.push_back(std::move(state));
  }
  mCounters.planningNanoseconds += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  AdmissionResult admitted;
  admitted.prefillStarts.reserve(batch);
  mActive.reserve(mActive.size() + 1);
  mQuarantine.reserve(mQuarantine.size() + mActive.size() + 1);
  // Nothing below throws: publish the request.
  ++mNextRequestId;
  ++mCounters.requests;
  for (auto const& sequence : created->sequences) {
    admitted.prefillStarts.push_back(sequence.reuseTokenLength);
    mResidentBusy[static_cast<std::size_t>(sequence.resident.slot)] = 1;
  }
  mActive.push_back(std::move(created));
  admitted.request = RequestHandle(this, mActive.back()->id);
  result.status = ContextCacheStatus::kOk;
  result.admission = std::move(admitted);
  return result;
}

// ---------------------------------------------------------------- prefill

void ContextCacheCoordinator::preparePrefill(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::preparePrefill";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kAdmitted && !req.pending, kCall,
              "prefill was already prepared for this request");
  for (auto const& other : mActive) {
    MKV_REQUIRE(other.get() == &req ||
                    (other->phase != Phase::kExecuting && other->phase != Phase::kPrefilling),
                kCall,
                "request {} is executing; only one request may execute at a time", other->id);
  }
  std::vector<CacheSlot> cold;  // checkpoint deployments: rows that start from the empty state
  if (mSnapshots != nullptr) {
    cold.reserve(req.sequences.size());
    for (auto const& sequence : req.sequences) {
      if (!sequence.lease.recurrentSnapshotSlot()) {
        cold.push_back(sequence.resident.slot);
      }
    }
  }
  if (hasKv()) {
    bool const paired = pairsDraft(req);
    bool const mtp = isHybridMtp(req);
    std::vector<KVPageTable::RowUpdate> rows;
    std::vector<KVPageTable::RowUpdate> draftRows;
    std::vector<int32_t> lengths;
    std::vector<int32_t> draftLengths;
    rows.reserve(req.sequences.size());
    lengths.reserve(req.sequences.size());
    for (auto const& sequence : req.sequences) {
      rows.push_back({sequence.resident.slot, sequence.lease.basePages()});
      lengths.push_back(sequence.reuseTokenLength);
      if (paired) {
        draftRows.push_back({sequence.resident.slot, sequence.lease.draftPages()});
        // The draft row of a Hybrid-MTP boundary token depends on its successor: recomputed.
        int32_t const reuse = sequence.reuseTokenLength;
        draftLengths.push_back(mtp && reuse > 0 ? reuse - 1 : reuse);
      }
    }
    mResources.basePageTable->setRows(rows);
    if (paired) {
      mResources.draftPageTable->setRows(draftRows);
    }
    // The rows and the lengths of both models in one launch (a launch costs the engine thread
    // 4-5 µs: docs/benchmarks.md, "What one launch costs the engine thread").
    mDeviceWrites.flushAfter(mStream, [&] {
      queueTableUploads(paired);
      mResources.basePool->resetForNewSequences(lengths, mDeviceWrites, mStream);
      if (paired) {
        mResources.draftPool->resetForNewSequences(draftLengths, mDeviceWrites, mStream);
      }
    });
  }
  if (mSnapshots != nullptr) {
    restoreCheckpoints(req, cold);
  }
  req.phase = Phase::kPrefilling;
  req.pending = true;
}

void ContextCacheCoordinator::restoreCheckpoints(Request& req, std::span<CacheSlot const> cold) {
  int32_t const pageSize = mManager->pageSize();
  for (auto const& sequence : req.sequences) {
    std::optional<SnapshotSlot> const recurrent = sequence.lease.recurrentSnapshotSlot();
    if (!recurrent) {
      continue;
    }
    mSnapshots->restoreRecurrent(*recurrent, sequence.resident.slot, mStream);
    if (std::optional<SnapshotSlot> const partial = sequence.lease.partialKvSnapshotSlot()) {
      int32_t const reuse = sequence.reuseTokenLength;
      if (sequence.lease.mode() == ReuseMode::kHybridMtp) {
        // The boundary token stays private: its page is the lease's, with 1..page valid rows.
        auto const index = static_cast<std::size_t>((reuse - 1) / pageSize);
        mSnapshots->restorePartialKv(*partial, sequence.lease.basePages()[index],
                                     reuse - static_cast<int32_t>(index) * pageSize,
                                     sequence.lease.draftPages()[index], mStream);
      } else {
        PageId const page =
            sequence.lease.basePages()[static_cast<std::size_t>(reuse / pageSize)];
        mSnapshots->restorePartialKv(*partial, page, reuse % pageSize, kNoPage, mStream);
      }
    }
    ++mCounters.checkpointRestores;
  }
  if (!cold.empty()) {
    mResources.recurrent->clearResidentSlots(cold, mStream);
  }
}

void ContextCacheCoordinator::enqueuePrefillCaptures(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::enqueuePrefillCaptures";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kPrefilling, kCall,
              "captures are enqueued between preparePrefill and finalizePrefillPublication");
  if (mSnapshots == nullptr || isHybridMtp(req)) {
    // Attention-only deployments keep no checkpoints; a Hybrid-MTP request publishes its
    // endpoint through publishHybridMtpEndpoint only.
    return;
  }
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    stageCapture(req, row, req.sequences[row].promptLength);  // a staged row is skipped
  }
}

namespace {

/// The first `length` ledger tokens of a sequence as the cache hashes them.
template <typename Sequence>
PromptView prefixOf(Sequence const& sequence, int32_t length) {
  auto const tokens = static_cast<std::size_t>(length);
  std::span<MediaPosition const> media;
  if (!sequence.media.empty()) {
    media = std::span<MediaPosition const>(sequence.media).first(tokens);
  }
  return PromptView{std::span<int32_t const>(sequence.tokens).first(tokens), media,
                    sequence.extras};
}

}  // namespace

bool ContextCacheCoordinator::stageCapture(Request& req, std::size_t row, int32_t exactLength) {
  Request::Sequence& sequence = req.sequences[row];
  if (sequence.policy == ContextCacheLookupPolicy::kBypass ||
      exactLength <= sequence.publishedExact || sequence.staged) {
    return false;
  }
  int32_t const pageSize = mManager->pageSize();
  bool const partial = hasKv() && exactLength % pageSize != 0;
  std::optional<SnapshotReservation> reservation;
  try {
    // A checkpoint already cached under this key needs no copy, and must not evict anything;
    // so does an unaligned Hybrid-MTP one, whose base side plain plans restore (an aligned one
    // keeps its boundary page private and is of no use to them).
    PromptBlocks const blocks = hashPromptBlocks(prefixOf(sequence, exactLength), pageSize);
    Hash128 const digest = exactPrefixDigest(blocks, exactLength);
    if (mManager->records().findHybrid(HybridKey{digest, exactLength, false}) != nullptr ||
        (partial &&
         mManager->records().findHybrid(HybridKey{digest, exactLength, true}) != nullptr)) {
      return false;
    }
    reservation = mManager->reserveHybridSnapshots(sequence.lease, partial);
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the checkpoint of {} tokens of "
        "request {} row {} is not captured",
        exactLength, req.id, row);
    return false;
  }
  if (!reservation) {
    uint64_t const skips = ++mCounters.snapshotPressureSkips;
    if ((skips & (skips - 1)) == 0) {  // 1, 2, 4, 8, ...: the log stays readable under pressure
      logger()->warn(
          "ContextCacheCoordinator: no snapshot slot for a checkpoint of {} tokens; "
          "capture skipped ({} skips so far)",
          exactLength, skips);
    }
    return false;
  }
  try {
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->captureRecurrent(reservation->recurrentSlot, sequence.resident.slot, mStream);
    if (partial) {
      PageId const page =
          sequence.lease.basePages()[static_cast<std::size_t>(exactLength / pageSize)];
      injectFault(CoordinatorFaultSite::kSnapshotCapture);
      mSnapshots->capturePartialKv(*reservation->partialKvSlot, page, exactLength % pageSize,
                                   kNoPage, mStream);
    }
  } catch (...) {
    mManager->retireHybridSnapshotReservation(sequence.lease, *reservation);
    throw;
  }
  sequence.staged = Request::Sequence::StagedCapture{*reservation, exactLength};
  ++mCounters.checkpointCaptures;
  return true;
}

void ContextCacheCoordinator::commitCaptures(Request& req) {
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    Request::Sequence& sequence = req.sequences[row];
    if (!sequence.staged) {
      continue;
    }
    Request::Sequence::StagedCapture const staged = *sequence.staged;
    sequence.staged.reset();
    // As publishReady: out of host memory, the checkpoint stays unpublished.
    try {
      PromptBlocks const blocks =
          hashPromptBlocks(prefixOf(sequence, staged.exactLength), mManager->pageSize());
      PublishResult const published =
          mManager->publishHybrid(sequence.lease, blocks, staged.exactLength, staged.reservation);
      if (published.status != PublishStatus::kVerificationRejected) {
        sequence.publishedExact = staged.exactLength;
        ++mCounters.checkpointPublications;
      }
    } catch (std::bad_alloc const&) {
      logger()->warn(
          "ContextCacheCoordinator: out of host memory; the checkpoint of {} tokens of "
          "request {} row {} was not published",
          staged.exactLength, req.id, row);
    }
    // The record (if any) holds the slots now; otherwise they return to the free rings.
    mManager->retireHybridSnapshotReservation(sequence.lease, staged.reservation);
  }
}

namespace {

/// Validates a prefill advance of `sequence` under `contract` (the whole prompt plus, for
/// kCommittedPlusLookahead, exactly one lookahead token).
template <typename Sequence>
void validatePrefillAdvance(char const* call, std::size_t row, Sequence const& sequence,
                            ContextCacheSequenceAdvance const& advance,
                            DecodingTokenStateContract contract) {
  auto const ledger = static_cast<int32_t>(sequence.tokens.size());
  if (contract == DecodingTokenStateContract::kFullyCommitted) {
    MKV_REQUIRE(advance.acceptedTokenCount == 0 && advance.committedStateLength == ledger, call,
                "row {}: a fully committed prefill accepts 0 tokens and commits {}, got {} / {}",
                row, ledger, advance.acceptedTokenCount, advance.committedStateLength);
  } else {
    MKV_REQUIRE(advance.acceptedTokenCount == 1 && advance.acceptedTokenIds != nullptr &&
                    advance.committedStateLength == ledger,
                call,
                "row {}: a prefill accepts the 1 lookahead token and commits the {} prompt "
                "tokens, got {} accepted / {} committed",
                row, ledger, advance.acceptedTokenCount, advance.committedStateLength);
  }
}

/// Common state lengths: none for a vanilla request; for a speculative one, one per sequence,
/// which may be left out (derived from the committed lengths) unless `required`.
template <typename Req>
void validateCommonLengths(char const* call, Req const& req, std::span<int32_t const> common,
                           bool required) {
  if (!req.speculative) {
    MKV_REQUIRE(common.empty(), call, "common state lengths are for speculative requests, got {}",
                common.size());
    return;
  }
  MKV_REQUIRE(common.size() == req.sequences.size() || (common.empty() && !required), call,
              "{} common state lengths for a batch of {}{}", common.size(), req.sequences.size(),
              required ? " (one per sequence is required with a paged draft)" : "");
}

/// Makes room for an advance so that applying it cannot throw. A call reserves every advance
/// before it applies the first, so a std::bad_alloc leaves the request as it was. Capacity grows
/// geometrically, as push_back's would.
template <typename Sequence>
void reserveAdvance(Sequence& sequence, ContextCacheSequenceAdvance const& advance) {
  if (isHold(advance)) {
    return;
  }
  std::size_t const size =
      sequence.tokens.size() + static_cast<std::size_t>(advance.acceptedTokenCount);
  auto grow = [size](auto& values) {
    if (values.capacity() < size) {
      values.reserve(std::max(size, 2 * values.capacity()));
    }
  };
  grow(sequence.tokens);
  if (!sequence.media.empty()) {
    grow(sequence.media);
  }
}

template <typename Sequence>
void applyAdvance(Sequence& sequence, ContextCacheSequenceAdvance const& advance) {
  if (isHold(advance)) {
    return;
  }
  sequence.tokens.insert(sequence.tokens.end(), advance.acceptedTokenIds,
                         advance.acceptedTokenIds + advance.acceptedTokenCount);
  if (!sequence.media.empty()) {
    sequence.media.resize(sequence.tokens.size());  // generated tokens are text
  }
  sequence.committed = advance.committedStateLength;
}

}  // namespace

ContextCacheStatus ContextCacheCoordinator::finalizePrefillPublication(
    RequestHandle& handle, std::span<ContextCacheSequenceAdvance const> advances,
    std::span<int32_t const> commonStateLengths) {
  constexpr char const* kCall = "ContextCacheCoordinator::finalizePrefillPublication";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kPrefilling, kCall, "no prepared prefill to finalise");
  MKV_REQUIRE(advances.size() == req.sequences.size(), kCall, "{} advances for a batch of {}",
              advances.size(), req.sequences.size());
  validateCommonLengths(kCall, req, commonStateLengths, pairsDraft(req) && !isHybridMtp(req));
  for (std::size_t i = 0; i < advances.size(); ++i) {
    MKV_REQUIRE(req.sequences[i].joined, kCall, "row {} was admitted in flight", i);
    validatePrefillAdvance(kCall, i, req.sequences[i], advances[i], req.contract);
    MKV_REQUIRE(commonStateLengths.empty() ||
                    commonStateLengths[i] == advances[i].committedStateLength,
                kCall, "row {}: the common state length after prefill is the prompt's {}, got {}",
                i, advances[i].committedStateLength, commonStateLengths[i]);
  }
  for (std::size_t i = 0; i < advances.size(); ++i) {
    reserveAdvance(req.sequences[i], advances[i]);
  }
  for (std::size_t i = 0; i < advances.size(); ++i) {
    applyAdvance(req.sequences[i], advances[i]);
  }
  req.phase = Phase::kExecuting;
  req.pending = false;  // the runtime synchronised before calling: restores and captures are done
  for (auto& sequence : req.sequences) {
    sequence.common = sequence.committed;
  }
  if (mSnapshots != nullptr) {
    for (auto& sequence : req.sequences) {
      mManager->releaseRestoredHybridSnapshots(sequence.lease);
      mCounters.prefillPublications += sequence.staged ? 1u : 0u;
    }
    commitCaptures(req);
    return ContextCacheStatus::kOk;
  }
  if (req.speculative) {
    // The runtime enqueues the draft initialisation after this call: the prompt endpoint waits.
    for (auto& sequence : req.sequences) {
      sequence.frozenPrefill = sequence.committed;
    }
    req.draftInitPending = true;
    return ContextCacheStatus::kOk;
  }
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    ++mCounters.prefillPublications;
    publishReady(req, row, req.sequences[row].committed);
  }
  return ContextCacheStatus::kOk;
}

void ContextCacheCoordinator::publishFrozenPrefill(Request& req) {
  req.draftInitPending = false;
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    Request::Sequence const& sequence = req.sequences[row];
    ++mCounters.prefillPublications;
    publishReady(req, row, std::min(sequence.frozenPrefill, sequence.common));
  }
}

void ContextCacheCoordinator::publishReady(Request& req, std::size_t row, int32_t length) {
  Request::Sequence& sequence = req.sequences[row];
  if (sequence.policy == ContextCacheLookupPolicy::kBypass) {
    return;
  }
  int32_t const pageSize = mManager->pageSize();
  int32_t const blocks = length / pageSize;
  if (blocks <= sequence.publishedBlocks) {
    return;
  }
  // A replayed spec hit publishes once its state covers the path it replayed into again.
  std::optional<SpecReplayDependency> const& dependency = sequence.lease.replayDependency();
  if (dependency && blocks < dependency->pathBlockCount) {
    return;
  }
  if (req.speculative) {
    ++mCounters.specPairPublications;
  }
  injectFault(CoordinatorFaultSite::kPublication);
  PromptView const prefix = prefixOf(sequence, blocks * pageSize);
  // Publication records what the sequence already computed; the completion it belongs to has
  // been applied. Out of host memory, the blocks stay unpublished (the manager rolls the attempt
  // back) and a later completion point of the sequence may publish them.
  try {
    PromptBlocks const digests = hashPromptBlocks(prefix, pageSize);
    PublishResult const published = mManager->publish(sequence.lease, digests, length);
    sequence.publishedBlocks =
        std::max(sequence.publishedBlocks, published.publishedFullBlockCount);
  } catch (std::bad_alloc const&) {
    logger()->warn("ContextCacheCoordinator: out of host memory; {} blocks of request {} row {} "
                   "were not published",
                   blocks - sequence.publishedBlocks, req.id, row);
  }
}

// ---------------------------------------------------------------- Hybrid-MTP

namespace {

void validateHiddenRow(char const* call, ContextCacheDeploymentProfile const& profile,
                       DeviceType device, Tensor const& hidden, int32_t row) {
  MKV_REQUIRE(hidden.rank() == 2 && hidden.dim(1) == profile.boundaryHiddenWidth &&
                  hidden.dataType() == profile.boundaryHiddenType && hidden.deviceType() == device,
              call, "the hidden states must be [rows, {}] of {} on {}, got {} of {} on {}",
              profile.boundaryHiddenWidth, toString(profile.boundaryHiddenType), toString(device),
              hidden.shape().toString(), toString(hidden.dataType()),
              toString(hidden.deviceType()));
  MKV_REQUIRE(row >= 0 && row < hidden.dim(0), call, "hidden row {} outside [0, {})", row,
              hidden.dim(0));
}

}  // namespace


ContextCacheStatus ContextCacheCoordinator::publishHybridMtpEndpoint(
    RequestHandle& handle, int32_t slot, int32_t residentStateLength,
    Tensor const& baseHiddenStates, int32_t boundaryHiddenRow) {
  constexpr char const* kCall = "ContextCacheCoordinator::publishHybridMtpEndpoint";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(mProfile.isHybridMtp(), kCall, "the deployment is not Hybrid-MTP (slot {}, length {})",
              slot, residentStateLength);
  MKV_REQUIRE(req.speculative, kCall, "request {} is not speculative (slot {}, length {})", req.id,
              slot, residentStateLength);
  MKV_REQUIRE(req.phase == Phase::kPrefilling, kCall,
              "an endpoint is published between preparePrefill and finalizePrefillPublication");
  Request::Sequence& sequence = sequenceAt(req, slot, kCall);
  MKV_REQUIRE(residentStateLength >= 0 && residentStateLength <= sequence.promptLength, kCall,
              "slot {}: residentStateLength {} outside [0, prompt {}]", slot, residentStateLength,
              sequence.promptLength);
  MKV_REQUIRE(residentStateLength == 0 || residentStateLength >= sequence.reuseTokenLength, kCall,
              "slot {}: residentStateLength {} below the restored reuse length {}", slot,
              residentStateLength, sequence.reuseTokenLength);
  validateHiddenRow(kCall, mProfile, mDevice, baseHiddenStates, boundaryHiddenRow);
  if (sequence.policy == ContextCacheLookupPolicy::kBypass || residentStateLength == 0 ||
      residentStateLength <= sequence.publishedExact) {
    return ContextCacheStatus::kOk;
  }
  int32_t const pageSize = mManager->pageSize();
  int32_t const full = (residentStateLength - 1) / pageSize;
  PromptBlocks const blocks =
      hashPromptBlocks(prefixOf(sequence, residentStateLength), pageSize);
  if (mManager->records().findHybrid(HybridKey{exactPrefixDigest(blocks, residentStateLength),
                                               residentStateLength, true}) != nullptr) {
    // Cached already (a base-only checkpoint of this length does not count): no copy, no slot.
    return ContextCacheStatus::kOk;
  }
  // Reserved with the hit's pins still held, so a std::bad_alloc here changes nothing. Only under
  // pressure are the pins released (the restore copies were enqueued before the captures on the
  // same stream, so a reservation may take over the hit's slots) and the reservation retried.
  std::optional<SnapshotReservation> reservation =
      mManager->reserveHybridSnapshots(sequence.lease, true);
  if (!reservation) {
    mManager->releaseRestoredHybridSnapshots(sequence.lease);
    reservation = mManager->reserveHybridSnapshots(sequence.lease, true);
  }
  if (!reservation) {
    uint64_t const skips = ++mCounters.snapshotPressureSkips;
    if ((skips & (skips - 1)) == 0) {
      logger()->warn(
          "ContextCacheCoordinator: no snapshot slot for a Hybrid-MTP endpoint of {} tokens; "
          "publication skipped ({} skips so far)",
          residentStateLength, skips);
    }
    return ContextCacheStatus::kOk;
  }
  auto const page = static_cast<std::size_t>(full);
  try {
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->captureRecurrent(reservation->recurrentSlot, sequence.resident.slot, mStream);
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->capturePartialKv(*reservation->partialKvSlot, sequence.lease.basePages()[page],
                                 residentStateLength - full * pageSize,
                                 sequence.lease.draftPages()[page], mStream);
    injectFault(CoordinatorFaultSite::kSnapshotCapture);
    mSnapshots->captureBoundaryHidden(reservation->recurrentSlot, baseHiddenStates,
                                      boundaryHiddenRow, mStream);
  } catch (...) {
    // Copies already enqueued into the slots are stream-ordered before any later use of them.
    mManager->retireHybridSnapshotReservation(sequence.lease, *reservation);
    throw;
  }
  // The endpoint supersedes the hit: its pins go now (restoreHybridMtpBoundaryHidden is over).
  mManager->releaseRestoredHybridSnapshots(sequence.lease);
  ++mCounters.checkpointCaptures;
  if (!synchronize()) {
    handle.mCoordinator = nullptr;
    handle.mId = 0;
    quarantine(detach(req.id));  // the reserved slots stay leased while the copies may run
    return ContextCacheStatus::kPoisoned;
  }
  try {
    PublishResult const published =
        mManager->publishHybridMtp(sequence.lease, blocks, residentStateLength, *reservation);
    if (published.status != PublishStatus::kVerificationRejected) {
      sequence.publishedExact = residentStateLength;
      ++mCounters.hybridMtpPublications;
    }
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; the Hybrid-MTP endpoint of {} tokens of "
        "request {} row {} was not published",
        residentStateLength, req.id, slot);
  }
  mManager->retireHybridSnapshotReservation(sequence.lease, *reservation);
  return ContextCacheStatus::kOk;
}

void ContextCacheCoordinator::restoreHybridMtpBoundaryHidden(RequestHandle& handle, int32_t slot,
                                                             Tensor& baseHiddenStates,
                                                             int32_t destinationRow) {
  constexpr char const* kCall = "ContextCacheCoordinator::restoreHybridMtpBoundaryHidden";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(mProfile.isHybridMtp(), kCall, "the deployment is not Hybrid-MTP (slot {}, row {})",
              slot, destinationRow);
  MKV_REQUIRE(req.phase == Phase::kPrefilling, kCall,
              "the boundary hidden row is restored between preparePrefill and the endpoint's "
              "publication");
  Request::Sequence const& sequence = sequenceAt(req, slot, kCall);
  std::optional<SnapshotSlot> const recurrent = sequence.lease.recurrentSnapshotSlot();
  MKV_REQUIRE(sequence.lease.mode() == ReuseMode::kHybridMtp && recurrent.has_value(), kCall,
              "slot {} restored no Hybrid-MTP checkpoint (reuse {}){}", slot,
              sequence.reuseTokenLength,
              sequence.lease.mode() == ReuseMode::kHybridMtp && sequence.reuseTokenLength > 0
                  ? ", or its pins were released by the endpoint's publication"
                  : "");
  validateHiddenRow(kCall, mProfile, mDevice, baseHiddenStates, destinationRow);
  mSnapshots->restoreBoundaryHidden(*recurrent, baseHiddenStates, destinationRow, mStream);
  ++mCounters.boundaryHiddenRestores;
}

// ---------------------------------------------------------------- decode

ContextCacheStatus ContextCacheCoordinator::prepareDecodeStep(RequestHandle& handle,
                                                              DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "ContextCacheCoordinator::prepareDecodeStep";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kExecuting && !req.pending && req.mapping.empty(), kCall,
              "a decode step needs an executing request with no pending work");
  bool const paired = pairsDraft(req);
  validateHeadroom(kCall, headroom, paired);
  if (!hasKv()) {
    req.pending = true;  // pure recurrent: no pages to grow
    return ContextCacheStatus::kOk;
  }
  KVPageTable& table = *mResources.basePageTable;
  KVPageTable* const draftTable = paired ? mResources.draftPageTable : nullptr;
  int32_t const pageSize = mManager->pageSize();
  bool grew = false;
  // Rows grown before a failing one keep their pages (mapped and uploaded, so host and device
  // agree), and a retry of the step does not grow them again.
  auto fail = [&]() {
    req.phase = Phase::kFinishing;
    ++mCounters.growthFailures;
    if (grew) {
      uploadTables(paired);
    }
    return ContextCacheStatus::kRequestFailed;
  };
  for (auto& sequence : req.sequences) {
    int64_t const base = pagesFor(int64_t{sequence.committed} + headroom.baseExtraTokens, pageSize);
    int64_t const draft =
        paired ? pagesFor(int64_t{sequence.committed} + headroom.draftExtraTokens, pageSize) : 0;
    if (base > table.maxPagesPerSeq() || (paired && draft > draftTable->maxPagesPerSeq())) {
      return fail();
    }
    auto const heldBase = static_cast<int32_t>(sequence.lease.basePages().size());
    auto const heldDraft = static_cast<int32_t>(sequence.lease.draftPages().size());
    int32_t const growBase = std::max(0, static_cast<int32_t>(base) - heldBase);
    int32_t const growDraft = std::max(0, static_cast<int32_t>(draft) - heldDraft);
    if (growBase == 0 && growDraft == 0) {
      continue;
    }
    bool grown = false;
    try {
      ReuseMode const mode = sequence.lease.mode();
      grown = mode == ReuseMode::kSpec || mode == ReuseMode::kHybridMtp
                  ? mManager->growSpecPages(sequence.lease, growBase, growDraft)
                  : mManager->growBasePages(sequence.lease, growBase);
    } catch (...) {
      if (grew) {  // the failed growth changed nothing
        uploadTables(paired);
      }
      throw;
    }
    if (!grown) {
      return fail();
    }
    std::span<PageId const> const pages = sequence.lease.basePages();
    for (auto logical = static_cast<std::size_t>(heldBase); logical < pages.size(); ++logical) {
      table.setEntry(sequence.resident.slot, static_cast<int32_t>(logical), pages[logical]);
    }
    std::span<PageId const> const draftPages = sequence.lease.draftPages();
    for (auto logical = static_cast<std::size_t>(heldDraft); paired && logical < draftPages.size();
         ++logical) {
      draftTable->setEntry(sequence.resident.slot, static_cast<int32_t>(logical),
                           draftPages[logical]);
    }
    ++mCounters.pageGrowths;
    grew = true;
  }
  uploadTables(paired);
  req.pending = true;
  return ContextCacheStatus::kOk;
}

ContextCacheStatus ContextCacheCoordinator::completeDecodeStep(
    RequestHandle& handle, std::span<ContextCacheSequenceAdvance const> advances,
    std::span<int32_t const> completedSlots, std::span<int32_t const> commonStateLengths) {
  constexpr char const* kCall = "ContextCacheCoordinator::completeDecodeStep";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kExecuting && req.pending && req.mapping.empty(), kCall,
              "no prepared decode step to complete");
  MKV_REQUIRE(advances.size() == req.sequences.size(), kCall, "{} advances for a batch of {}",
              advances.size(), req.sequences.size());
  validateCommonLengths(kCall, req, commonStateLengths, pairsDraft(req) && !isHybridMtp(req));
  for (std::size_t i = 0; i < advances.size(); ++i) {
    auto const& sequence = req.sequences[i];
    ContextCacheSequenceAdvance const& advance = advances[i];
    if (isHold(advance)) {
      continue;
    }
    MKV_REQUIRE(sequence.joined, kCall,
                "row {} was admitted in flight and not finalised: it must hold (0 tokens, "
                "committed {})",
                i, kHoldCommittedStateLength);
    MKV_REQUIRE(advance.acceptedTokenCount > 0 && advance.acceptedTokenIds != nullptr, kCall,
                "row {}: a zero advance must use the hold sentinel (committed {}), got {} "
                "tokens / committed {}",
                i, kHoldCommittedStateLength, advance.acceptedTokenCount,
                advance.committedStateLength);
    auto const ledger = static_cast<int64_t>(sequence.tokens.size());
    if (req.contract == DecodingTokenStateContract::kFullyCommitted) {
      MKV_REQUIRE(advance.committedStateLength == ledger + advance.acceptedTokenCount &&
                      ledger == sequence.committed,
                  kCall, "row {}: committed {} but ledger {} + accepted {}", i,
                  advance.committedStateLength, ledger, advance.acceptedTokenCount);
    } else if (req.speculative) {
      MKV_REQUIRE(advance.committedStateLength ==
                          int64_t{sequence.committed} + advance.acceptedTokenCount &&
                      ledger == int64_t{sequence.committed} + 1,
                  kCall,
                  "row {}: a speculative step commits the previous {} + accepted {} (ledger {}), "
                  "got committed {}",
                  i, sequence.committed, advance.acceptedTokenCount, ledger,
                  advance.committedStateLength);
    } else {
      MKV_REQUIRE(advance.acceptedTokenCount == 1 &&
                      advance.committedStateLength == sequence.committed + 1 &&
                      ledger == int64_t{sequence.committed} + 1,
                  kCall,
                  "row {}: vanilla decode accepts 1 token and commits {} (ledger {}), got {} "
                  "accepted / committed {}",
                  i, sequence.committed + 1, ledger, advance.acceptedTokenCount,
                  advance.committedStateLength);
    }
  }
  for (std::size_t i = 0; i < advances.size() && !commonStateLengths.empty(); ++i) {
    int32_t const common = commonStateLengths[i];
    MKV_REQUIRE(isHold(advances[i]) || (common >= req.sequences[i].common &&
                                        common <= advances[i].committedStateLength),
                kCall, "row {}: common state length {} outside [{}, committed {}]", i, common,
                req.sequences[i].common, advances[i].committedStateLength);
  }
  std::vector<uint8_t> completed(req.sequences.size(), 0);
  for (int32_t slot : completedSlots) {
    MKV_REQUIRE(slot >= 0 && static_cast<std::size_t>(slot) < req.sequences.size(), kCall,
                "completed slot {} outside the batch of {}", slot, req.sequences.size());
    MKV_REQUIRE(completed[static_cast<std::size_t>(slot)] == 0, kCall,
                "completed slot {} listed twice", slot);
    MKV_REQUIRE(req.sequences[static_cast<std::size_t>(slot)].joined, kCall,
                "completed slot {} was never finalised", slot);
    completed[static_cast<std::size_t>(slot)] = 1;
  }
  for (std::size_t i = 0; i < advances.size(); ++i) {
    reserveAdvance(req.sequences[i], advances[i]);
  }
  for (std::size_t i = 0; i < advances.size(); ++i) {
    Request::Sequence& sequence = req.sequences[i];
    applyAdvance(sequence, advances[i]);
    if (req.speculative && !isHold(advances[i])) {
      sequence.common = commonStateLengths.empty() ? sequence.committed : commonStateLengths[i];
    }
  }
  req.pending = false;
  if (req.draftInitPending) {
    // The verification round read the draft state the initialisation wrote; the runtime's
    // synchronisation of the round made both complete. A row this round holds was cancelled or
    // errored before its prompt endpoint became publishable: like any stopped row, it publishes
    // nothing (docs/context_cache.md, "Publication points").
    for (std::size_t i = 0; i < advances.size(); ++i) {
      if (isHold(advances[i])) {
        req.sequences[i].frozenPrefill = 0;
      }
    }
    publishFrozenPrefill(req);
  }
  if (req.commitPolicy != ContextCacheCommitPolicy::kIncludingGeneratedTokens) {
    return ContextCacheStatus::kOk;
  }
  if (mSnapshots == nullptr) {
    for (std::size_t i = 0; i < completed.size(); ++i) {
      if (completed[i] != 0) {
        ++mCounters.decodePublications;
        Request::Sequence const& sequence = req.sequences[i];
        publishReady(req, i, req.speculative ? sequence.common : sequence.committed);
      }
    }
    return ContextCacheStatus::kOk;
  }
  bool staged = false;
  for (std::size_t i = 0; i < completed.size(); ++i) {
    if (completed[i] != 0 && stageCapture(req, i, req.sequences[i].committed)) {
      ++mCounters.decodePublications;
      staged = true;
    }
  }
  if (!staged) {
    return ContextCacheStatus::kOk;
  }
  // The copies read state the step just wrote: one synchronisation makes them terminal.
  ++mCounters.captureSynchronizations;
  if (!synchronize()) {
    handle.mCoordinator = nullptr;
    handle.mId = 0;
    quarantine(detach(req.id));  // the slots stay leased while the copies may still run
    return ContextCacheStatus::kPoisoned;
  }
  commitCaptures(req);
  return ContextCacheStatus::kOk;
}

// ---------------------------------------------------------------- compaction

void ContextCacheCoordinator::requireLengthBatch(char const* call, Request const& req) const {
  if (!hasKv()) {
    return;
  }
  auto const rows = static_cast<int32_t>(req.sequences.size());
  for (KVCachePool const* pool : {mResources.basePool, pairsDraft(req) ? mResources.draftPool
                                                                       : nullptr}) {
    if (pool == nullptr) {
      continue;
    }
    MKV_REQUIRE(pool->activeBatchSize() == rows, call,
                "the {} KV-length tensor's active batch is {} but the request has {} rows (the "
                "engine grows it with setActiveBatchSize + writeLengths when it seats a joiner)",
                pool == mResources.basePool ? "base" : "draft", pool->activeBatchSize(), rows);
  }
}

void ContextCacheCoordinator::beginBatchCompaction(RequestHandle& handle,
                                                   std::span<int32_t const> oldToNew,
                                                   int32_t newBatchSize, Tensor& deviceMapping) {
  constexpr char const* kCall = "ContextCacheCoordinator::beginBatchCompaction";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kExecuting && !req.pending && req.mapping.empty(), kCall,
              "compaction needs an executing request with no pending work");
  auto const oldBatch = static_cast<int32_t>(req.sequences.size());
  MKV_REQUIRE(oldToNew.size() == req.sequences.size(), kCall,
              "mapping has {} entries for a batch of {}", oldToNew.size(), oldBatch);
  MKV_REQUIRE(newBatchSize >= 0 && newBatchSize <= oldBatch, kCall,
              "new batch size {} outside [0, {}]", newBatchSize, oldBatch);
  int32_t nextSurvivor = 0;
  for (std::size_t i = 0; i < oldToNew.size(); ++i) {
    if (oldToNew[i] == -1) {
      continue;
    }
    MKV_REQUIRE(oldToNew[i] >= 0 && oldToNew[i] < newBatchSize, kCall,
                "oldToNew[{}] = {} outside [-1, {})", i, oldToNew[i], newBatchSize);
    MKV_REQUIRE(oldToNew[i] == nextSurvivor, kCall,
                "survivors must keep their order: oldToNew[{}] = {}, expected {}", i, oldToNew[i],
                nextSurvivor);
    ++nextSurvivor;
  }
  MKV_REQUIRE(nextSurvivor == newBatchSize, kCall, "{} survivors for a new batch of {}",
              nextSurvivor, newBatchSize);
  requireLengthBatch(kCall, req);
  MKV_REQUIRE(deviceMapping.dataType() == DataType::kInt32 && deviceMapping.deviceType() == mDevice,
              kCall, "deviceMapping must be int32 on {}", toString(mDevice));
  MKV_REQUIRE(deviceMapping.capacityBytes() >= static_cast<int64_t>(oldToNew.size_bytes()), kCall,
              "deviceMapping holds {} bytes, needs {}", deviceMapping.capacityBytes(),
              oldToNew.size_bytes());
  bool const reshaped = deviceMapping.reshape({oldBatch});
  MKV_ASSERT(reshaped, "deviceMapping reshape failed after the capacity check");
  if (!oldToNew.empty()) {
    // The request holds its first resident's slot, so that slot's staging region is its own.
    mMappingUploads->upload(req.sequences.front().resident.slot, oldToNew,
                            deviceMapping.rawPointer(), mStream);
  }
  req.mapping.assign(oldToNew.begin(), oldToNew.end());
  req.newBatchSize = newBatchSize;
  req.deviceMapping = &deviceMapping;
  req.pending = true;
}

ContextCacheStatus ContextCacheCoordinator::compactBatch(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::compactBatch";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kExecuting && req.pending && !req.mapping.empty(), kCall,
              "no batch compaction was begun");
  requireLengthBatch(kCall, req);  // the engine may have resized the tensor since the begin
  // The device mapping is read only to compact the length tensors.
  MKV_REQUIRE(!hasKv() || (req.deviceMapping->numel() == static_cast<int64_t>(req.mapping.size()) &&
                           req.deviceMapping->deviceType() == mDevice),
              kCall,
              "deviceMapping was reshaped or replaced since beginBatchCompaction: {} entries on "
              "{}, expected {} on {}",
              req.deviceMapping->numel(), toString(req.deviceMapping->deviceType()),
              req.mapping.size(), toString(mDevice));
  // Allocations first: nothing below allocates, so a std::bad_alloc changes nothing.
  std::vector<CacheSlot> dropped;
  dropped.reserve(req.mapping.size());
  std::vector<Request::Sequence> survivors;
  survivors.reserve(req.sequences.capacity());
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    MKV_ASSERT(!req.sequences[i].staged, "row {} has an uncommitted capture at compaction", i);
    if (req.mapping[i] < 0) {
      dropped.push_back(req.sequences[i].resident.slot);
    }
  }
  if (hasKv()) {
    bool const paired = pairsDraft(req);
    for (CacheSlot slot : dropped) {
      mResources.basePageTable->clearRow(slot);
      if (paired) {
        mResources.draftPageTable->clearRow(slot);
      }
    }
    uploadTables(paired);
    mResources.basePool->compactLengths(*req.deviceMapping, req.newBatchSize, mStream);
    if (paired) {
      mResources.draftPool->compactLengths(*req.deviceMapping, req.newBatchSize, mStream);
    }
  }
  if (mResources.recurrent != nullptr && !dropped.empty()) {
    mResources.recurrent->clearResidentSlots(dropped, mStream);
  }
  if (!synchronize()) {
    handle.mCoordinator = nullptr;
    handle.mId = 0;
    quarantine(detach(req.id));
    return ContextCacheStatus::kPoisoned;
  }
  if (req.draftInitPending) {
    publishFrozenPrefill(req);  // the synchronisation made the draft initialisation complete
  }
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    if (req.mapping[i] < 0) {
      mResidentBusy[static_cast<std::size_t>(req.sequences[i].resident.slot)] = 0;
    } else {
      survivors.push_back(std::move(req.sequences[i]));
    }
  }
  req.sequences = std::move(survivors);  // dropped leases are released here
  req.mapping.clear();
  req.newBatchSize = -1;
  req.deviceMapping = nullptr;
  req.pending = false;
  if (req.sequences.empty()) {
    req.phase = Phase::kFinishing;
  }
  return ContextCacheStatus::kOk;
}

// ---------------------------------------------------------------- finish / shutdown

ContextCacheStatus ContextCacheCoordinator::finish(RequestHandle& handle) {
  if (!handle.valid()) {
    return mPoisoned ? ContextCacheStatus::kPoisoned : ContextCacheStatus::kOk;
  }
  Request& req = request(handle, "ContextCacheCoordinator::finish");
  uint64_t const id = req.id;
  handle.mCoordinator = nullptr;
  handle.mId = 0;
  if ((req.pending || req.draftInitPending) && !synchronize()) {
    quarantine(detach(id));
    return ContextCacheStatus::kPoisoned;
  }
  // Detached first: a publication that throws must not strand the request in mActive (shutdown
  // could not recover its rows and leases any more). The publication is best effort here.
  std::unique_ptr<Request> finished = detach(id);
  if (finished->draftInitPending) {
    try {
      publishFrozenPrefill(*finished);
    } catch (std::exception const& error) {
      logger()->error("ContextCacheCoordinator::finish: publishing the frozen prompt endpoint of "
                      "request {} failed: {}",
                      id, error.what());
    }
  }
  try {
    releaseRows(*finished);
  } catch (std::exception const& error) {
    logger()->error("ContextCacheCoordinator::finish: clearing rows failed: {}", error.what());
    quarantine(std::move(finished));
    return ContextCacheStatus::kPoisoned;
  }
  for (auto const& sequence : finished->sequences) {
    mResidentBusy[static_cast<std::size_t>(sequence.resident.slot)] = 0;
  }
  return mPoisoned ? ContextCacheStatus::kPoisoned : ContextCacheStatus::kOk;
}

ContextCacheStatus ContextCacheCoordinator::shutdown() noexcept {
  if (!mQuarantine.empty()) {
    if (!synchronize()) {
      return ContextCacheStatus::kPoisoned;
    }
    try {
      if (hasKv()) {
        bool paired = false;
        for (auto& quarantined : mQuarantine) {
          paired = paired || pairsDraft(*quarantined);
          for (auto const& sequence : quarantined->sequences) {
            mResources.basePageTable->clearRow(sequence.resident.slot);
            if (pairsDraft(*quarantined)) {
              mResources.draftPageTable->clearRow(sequence.resident.slot);
            }
          }
        }
        uploadTables(paired);
      }
    } catch (std::exception const& error) {
      logger()->error("ContextCacheCoordinator::shutdown: clearing rows failed: {}", error.what());
      return ContextCacheStatus::kPoisoned;
    }
    for (auto& quarantined : mQuarantine) {
      for (auto const& sequence : quarantined->sequences) {
        mResidentBusy[static_cast<std::size_t>(sequence.resident.slot)] = 0;
      }
    }
    mQuarantine.clear();  // leases released
  }
  mPoisoned = false;
  return mActive.empty() ? ContextCacheStatus::kOk : ContextCacheStatus::kRequestFailed;
}

// ---------------------------------------------------------------- in-flight admission

ContextCacheCoordinator::AdmitSequenceResult ContextCacheCoordinator::admitSequence(
    RequestHandle& handle, ContextCacheSequenceAdmission const& admission,
    DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "ContextCacheCoordinator::admitSequence";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(supportsLiveSequenceAdmission(), kCall,
              "in-flight admission needs an attention-only, non-speculative deployment");
  MKV_REQUIRE(req.phase == Phase::kExecuting && !req.pending && req.mapping.empty(), kCall,
              "admission needs an executing request with no pending work or compaction");
  MKV_REQUIRE(!req.sequences.empty(), kCall, "the request has no founding sequence");
  // A joiner is finalised with its lookahead token (committed == prompt): the fully committed
  // contract, where every listed token has KV, could never advance it.
  MKV_REQUIRE(req.contract == DecodingTokenStateContract::kCommittedPlusLookahead, kCall,
              "in-flight admission needs the committed-plus-lookahead contract");
  validateHeadroom(kCall, headroom, false);
  KVPageTable& table = *mResources.basePageTable;
  MKV_REQUIRE(req.sequences.size() < static_cast<std::size_t>(table.maxBatch()), kCall,
              "the batch is full ({} sequences)", req.sequences.size());
  ResidentRef const ref = admission.resident;
  MKV_REQUIRE(ref.slot >= 0 && ref.slot < table.maxBatch() && ref.epoch != 0, kCall,
              "invalid resident (slot {}, epoch {})", ref.slot, ref.epoch);
  if (mResources.residentSlots != nullptr) {
    mResources.residentSlots->requireHeld(kCall, ref);
  }
  MKV_REQUIRE(!admission.tokenIds.empty(), kCall, "empty prompt");
  int64_t const needed = pagesFor(
      static_cast<int64_t>(admission.tokenIds.size()) + headroom.baseExtraTokens, mManager->pageSize());
  MKV_REQUIRE(needed <= table.maxPagesPerSeq(), kCall,
              "the prompt needs {} pages but a row holds {}", needed, table.maxPagesPerSeq());
  MKV_REQUIRE(admission.media.empty() || admission.media.size() == admission.tokenIds.size(), kCall,
              "{} media positions for {} tokens", admission.media.size(), admission.tokenIds.size());
  AdmitSequenceResult result;
  if (mPoisoned) {  // before the busy check, as in beginRequest
    result.status = ContextCacheStatus::kPoisoned;
    return result;
  }
  MKV_REQUIRE(mResidentBusy[static_cast<std::size_t>(ref.slot)] == 0, kCall,
              "resident slot {} is already held", ref.slot);
  // The request's own policy: the first surviving row after a compaction is not the founder.
  LookupRequest const lookup =
      lookupOf(admission, admission.lookupPolicy.value_or(req.batchPolicy), headroom, false);
  auto const start = std::chrono::steady_clock::now();
  mkv::AdmissionResult acquired = mManager->acquireWithFallback(lookup);
  mCounters.planningNanoseconds += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
  if (!acquired.lease) {
    ++mCounters.liveAdmissionRefusals;
    result.status = ContextCacheStatus::kRequestFailed;
    result.insufficientCapacity = true;
    return result;
  }
  Request::Sequence state;
  state.lease = std::move(*acquired.lease);
  state.resident = ref;
  state.tokens = admission.tokenIds;
  state.media = admission.media;
  state.extras = admission.keyExtras;
  state.policy = lookup.policy;
  state.promptLength = static_cast<int32_t>(admission.tokenIds.size());
  state.reuseTokenLength = acquired.plan.reuseTokenLength;
  state.committed = acquired.plan.reuseTokenLength;
  state.joined = false;
  req.sequences.push_back(std::move(state));
  try {
    table.setRow(ref.slot, req.sequences.back().lease.basePages());
    table.uploadDirty(mStream);
  } catch (...) {
    req.sequences.pop_back();
    try {
      table.clearRow(ref.slot);
    } catch (...) {
      mPoisoned = true;
    }
    throw;
  }
  mResidentBusy[static_cast<std::size_t>(ref.slot)] = 1;
  ++mCounters.liveAdmissions;
  result.status = ContextCacheStatus::kOk;
  result.prefillStart = req.sequences.back().reuseTokenLength;
  return result;
}

ContextCacheStatus ContextCacheCoordinator::finalizeSequenceAdmission(
    RequestHandle& handle, int32_t slot, ContextCacheSequenceAdvance const& advance) {
  constexpr char const* kCall = "ContextCacheCoordinator::finalizeSequenceAdmission";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.phase == Phase::kExecuting, kCall, "the request is not executing");
  auto& sequence = sequenceAt(req, slot, kCall);
  MKV_REQUIRE(!sequence.joined, kCall, "slot {} is not an unfinalised in-flight admission", slot);
  if (mPoisoned) {
    return ContextCacheStatus::kPoisoned;
  }
  MKV_REQUIRE(advance.acceptedTokenCount == 1 && advance.acceptedTokenIds != nullptr &&
                  advance.committedStateLength == static_cast<int32_t>(sequence.tokens.size()),
              kCall,
              "slot {}: finalising accepts the 1 lookahead token and commits the {} prompt "
              "tokens, got {} / {}",
              slot, sequence.tokens.size(), advance.acceptedTokenCount,
              advance.committedStateLength);
  reserveAdvance(sequence, advance);
  applyAdvance(sequence, advance);
  sequence.joined = true;
  ++mCounters.prefillPublications;
  publishReady(req, static_cast<std::size_t>(slot), sequence.committed);
  return ContextCacheStatus::kOk;
}

bool ContextCacheCoordinator::retractSequenceAdmission(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::retractSequenceAdmission";
  Request& req = request(handle, kCall);
  // Pending device work (a decode step, a compaction) may still read the row's pages.
  MKV_REQUIRE(!req.pending, kCall,
              "request {} has pending work (a decode step or compaction): retract between steps",
              req.id);
  MKV_REQUIRE(req.sequences.size() > 1, kCall,
              "request {} has {} sequence(s): only an in-flight joiner beside the batch can be "
              "retracted",
              req.id, req.sequences.size());
  MKV_REQUIRE(!req.sequences.back().joined, kCall,
              "the newest sequence (row {}) of request {} is not an unfinalised in-flight "
              "admission",
              req.sequences.size() - 1, req.id);
  CacheSlot const slot = req.sequences.back().resident.slot;
  req.sequences.pop_back();  // lease released
  mResidentBusy[static_cast<std::size_t>(slot)] = 0;
  ++mCounters.retractedAdmissions;
  try {
    mResources.basePageTable->clearRow(slot);
    mResources.basePageTable->uploadDirty(mStream);
  } catch (std::exception const& error) {
    logger()->error("ContextCacheCoordinator::retractSequenceAdmission: {}; poisoned", error.what());
    mPoisoned = true;
    return false;
  }
  return true;
}

ResidentRowState ContextCacheCoordinator::residentRowState(CacheSlot slot) const noexcept {
  if (slot < 0 || static_cast<std::size_t>(slot) >= mResidentBusy.size() ||
      mResidentBusy[static_cast<std::size_t>(slot)] == 0) {
    return ResidentRowState::kFree;
  }
  for (auto const& quarantined : mQuarantine) {
    for (auto const& sequence : quarantined->sequences) {
      if (sequence.resident.slot == slot) {
        return ResidentRowState::kQuarantined;
      }
    }
  }
  return ResidentRowState::kActive;
}

// ---------------------------------------------------------------- observability

std::string ContextCacheCoordinator::toPrometheus(std::string_view prefix) const {
  std::string text = mkv::toPrometheus(mManager->metrics(), prefix);
  auto counter = [&](char const* name, char const* help, uint64_t value) {
    text += fmt::format("# HELP {0}{1}_total {2}\n# TYPE {0}{1}_total counter\n{0}{1}_total {3}\n",
                        prefix, name, help, value);
  };
  counter("coordinator_requests", "Requests admitted by beginRequest.", mCounters.requests);
  counter("coordinator_refused_requests", "Requests refused for capacity.",
          mCounters.refusedRequests);
  counter("coordinator_prefill_publications", "Publication attempts at prefill end.",
          mCounters.prefillPublications);
  counter("coordinator_decode_publications", "Publication attempts at decode end.",
          mCounters.decodePublications);
  counter("coordinator_live_admissions", "Sequences admitted into a running batch.",
          mCounters.liveAdmissions);
  counter("coordinator_live_admission_refusals", "In-flight admissions refused for capacity.",
          mCounters.liveAdmissionRefusals);
  counter("coordinator_retracted_admissions", "In-flight admissions retracted.",
          mCounters.retractedAdmissions);
  counter("coordinator_page_growths", "Decode steps that grew a sequence's pages.",
          mCounters.pageGrowths);
  counter("coordinator_growth_failures", "Page growths refused (request failed).",
          mCounters.growthFailures);
  counter("coordinator_synchronizations", "Stream synchronisations made by the coordinator.",
          mCounters.synchronizations);
  counter("coordinator_quarantined_requests", "Requests quarantined after a failed sync.",
          mCounters.quarantinedRequests);
  counter("coordinator_planning_nanoseconds", "Host nanoseconds spent in lookup and acquire.",
          mCounters.planningNanoseconds);
  counter("coordinator_checkpoint_restores", "Sequences started from a restored checkpoint.",
          mCounters.checkpointRestores);
  counter("coordinator_checkpoint_captures", "Checkpoint captures enqueued.",
          mCounters.checkpointCaptures);
  counter("coordinator_checkpoint_publications", "Captured checkpoints committed as records.",
          mCounters.checkpointPublications);
  counter("coordinator_snapshot_pressure_skips", "Checkpoint captures skipped for want of a slot.",
          mCounters.snapshotPressureSkips);
  counter("coordinator_capture_synchronizations",
          "Stream synchronisations made for decode-end captures.",
          mCounters.captureSynchronizations);
  counter("coordinator_spec_pair_publications",
          "Speculative publication attempts at the common base and draft length.",
          mCounters.specPairPublications);
  counter("coordinator_hybrid_mtp_publications", "Hybrid-MTP endpoints committed as records.",
          mCounters.hybridMtpPublications);
  counter("coordinator_boundary_hidden_restores", "Boundary hidden rows restored (Hybrid-MTP).",
          mCounters.boundaryHiddenRestores);
  return text;
}

}  // namespace mkv
