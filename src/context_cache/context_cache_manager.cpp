#include "context_cache/context_cache_manager.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <limits>

#include "core/check.h"
#include "mkv/logging.h"

namespace mkv {

namespace {

int32_t validatedPageSize(int32_t pageSize, ResourceDemand const& capacities, int32_t maxRecords,
                          ContextCacheManagerOptions const& options) {
  constexpr char const* kCall = "ContextCacheManager";
  MKV_REQUIRE(pageSize > 0, kCall, "page size must be positive, got {}", pageSize);
  MKV_REQUIRE(!capacities.hasNegative(), kCall,
              "capacities must be non-negative: base {}, draft {}, recurrent {}, partial {}",
              capacities.baseKvPages, capacities.draftKvPages, capacities.recurrentSnapshotSlots,
              capacities.partialKvSnapshotSlots);
  MKV_REQUIRE(maxRecords >= 0, kCall, "maxRecords must be non-negative, got {}", maxRecords);
  MKV_REQUIRE(options.eventQueueCapacity >= 0, kCall,
              "event queue capacity must be non-negative, got {}", options.eventQueueCapacity);
  MKV_REQUIRE(options.evictionPolicy == EvictionPolicyKind::kLru ||
                  options.evictionPolicy == EvictionPolicyKind::kS3Fifo ||
                  options.evictionPolicy == EvictionPolicyKind::kLoopAware,
              kCall, "eviction policy {} out of range", static_cast<int>(options.evictionPolicy));
  MKV_REQUIRE(options.hostTierPages >= 0 && options.hostTierBytesPerPage >= 0, kCall,
              "host tier of {} pages of {} bytes: must be non-negative", options.hostTierPages,
              options.hostTierBytesPerPage);
  MKV_REQUIRE(
      options.windowCache == nullptr ||
          (options.hostTierPages == 0 && options.windowCache->index().pageSize() == pageSize),
      kCall, "a window cache of page size {} beside page size {} and {} host tier pages",
      options.windowCache ? options.windowCache->index().pageSize() : 0, pageSize,
      options.hostTierPages);
  MKV_REQUIRE(!options.mirrorPublishedBlocks || options.hostTierPages > 0, kCall,
              "mirroring published blocks for the remote tier needs a host tier");
  MKV_REQUIRE(options.evictedDigestHistory >= -1, kCall,
              "evicted digest history must be >= -1, got {}", options.evictedDigestHistory);
  MKV_REQUIRE(!options.specContract || options.specContract->futureDependencyTokens >= 0, kCall,
              "negative future dependency {}",
              options.specContract ? options.specContract->futureDependencyTokens : 0);
  return pageSize;
}

/// Record keys the S3-FIFO ghost remembers: as many as records are kept (at most 64k).
int32_t ghostCapacityOf(int32_t maxRecords) { return std::min(maxRecords, 1 << 16); }

int32_t historyOf(ContextCacheManagerOptions const& options, ResourceDemand const& capacities) {
  return options.evictedDigestHistory < 0 ? std::max(0, capacities.baseKvPages)
                                          : options.evictedDigestHistory;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Construction

ContextCacheManager::ContextCacheManager(int32_t pageSize, ResourceDemand capacities,
                                         int32_t maxRecords, ContextCacheManagerOptions options)
    : mPageSize(validatedPageSize(pageSize, capacities, maxRecords, options)),
      mMaxRecords(maxRecords),
      mOptions(std::move(options)),
      mPools(capacities),
      mIndex(capacities.baseKvPages, pageSize, mOptions.verifyTokens,
             historyOf(mOptions, capacities)),
      mRecords(mOptions.evictionPolicy, ghostCapacityOf(maxRecords)),
      mEvictionPlanner(capacities),
      mEvents(mOptions.eventQueueCapacity, mPageSize) {
  if (mOptions.hostTierPages > 0) {
    mHostTier =
        std::make_unique<HostBlockTier>(mOptions.hostTierPages, mPageSize, mOptions.verifyTokens);
  }
}

ContextCacheManager::~ContextCacheManager() {
  if (mLiveLeases != 0) {
    logger()->critical("ContextCacheManager destroyed with {} live leases", mLiveLeases);
    std::terminate();
  }
}

// ---------------------------------------------------------------------------------------------
// Validation helpers

void ContextCacheManager::checkLease(char const* call, CacheRequestLease const& lease) const {
  MKV_REQUIRE(lease.mManager == this, call, "the lease is {}",
              lease.valid() ? "of another manager" : "invalid (released or moved from)");
}

bool ContextCacheManager::pairedDraft(ReuseMode mode) const noexcept {
  return mode == ReuseMode::kHybridMtp || (mode == ReuseMode::kSpec && mOptions.specContract &&
                                           mOptions.specContract->pagedSpecState);
}

void ContextCacheManager::checkRequest(char const* call, LookupRequest const& request) const {
  MKV_REQUIRE(static_cast<uint8_t>(request.mode) <= static_cast<uint8_t>(ReuseMode::kSpec), call,
              "reuse mode {} out of range", static_cast<int>(request.mode));
  MKV_REQUIRE(request.policy == ContextCacheLookupPolicy::kUseCache ||
                  request.policy == ContextCacheLookupPolicy::kBypass,
              call, "lookup policy {} out of range", static_cast<int>(request.policy));
  MKV_REQUIRE(!request.prompt.tokens.empty(), call, "empty prompt");
  MKV_REQUIRE(
      request.prompt.tokens.size() < static_cast<std::size_t>(std::numeric_limits<int32_t>::max()),
      call, "prompt of {} tokens exceeds INT32_MAX", request.prompt.tokens.size());
  MKV_REQUIRE(request.mode != ReuseMode::kSpec || mOptions.specContract.has_value(), call,
              "speculative request on a manager without a spec reuse contract");
  MKV_REQUIRE(request.hasAttention || request.mode == ReuseMode::kHybrid, call,
              "only hybrid requests may be pure recurrent (mode {})", toString(request.mode));
  MKV_REQUIRE(request.baseExtraTokens >= 0 && request.draftExtraTokens >= 0, call,
              "negative extra tokens: base {}, draft {}", request.baseExtraTokens,
              request.draftExtraTokens);
  MKV_REQUIRE(request.draftExtraTokens == 0 || pairedDraft(request.mode), call,
              "draft extra tokens {} for a {} request without paired draft state",
              request.draftExtraTokens, toString(request.mode));
  int64_t const n = static_cast<int64_t>(request.prompt.tokens.size());
  MKV_REQUIRE(n + std::max(request.baseExtraTokens, request.draftExtraTokens) <=
                  std::numeric_limits<int32_t>::max(),
              call, "input {} + extra tokens overflows int32", n);
  requireValidRetention(call, request.retention);
}

void ContextCacheManager::applyCoverage(ReusePlan& plan, LookupRequest const& request) const {
  bool const draft = pairedDraft(request.mode);
  if (request.coverReusedPrefixOnly) {
    // The pages of the reused prefix only (onboarding targets and a restored partial page
    // included): the planners sized the demand for the whole prompt.
    int32_t const reused = (plan.reuseTokenLength + mPageSize - 1) / mPageSize;
    auto const beyond = [reused](std::size_t bound) {
      return std::max(0, reused - static_cast<int32_t>(bound));
    };
    plan.demand.baseKvPages = request.hasAttention ? std::min(plan.demand.baseKvPages,
                                                              beyond(plan.basePageBindings.size()))
                                                   : 0;
    plan.demand.draftKvPages =
        draft ? std::min(plan.demand.draftKvPages, beyond(plan.draftPageBindings.size())) : 0;
    return;
  }
  auto const n = static_cast<int32_t>(request.prompt.tokens.size());
  int32_t const base = request.hasAttention ? n + request.baseExtraTokens : 0;
  requireKvPageCoverage(plan, mPageSize, base, draft ? n + request.draftExtraTokens : 0);
}

void ContextCacheManager::checkPlan(ReusePlan const& plan, bool fresh) const {
  constexpr char const* kCall = "ContextCacheManager::acquire";
  checkPlanShape(kCall, plan);
  for (std::size_t b = 0; !fresh && b < plan.basePageBindings.size(); ++b) {
    std::optional<PageId> const page = mIndex.find(plan.matchedBlockDigests[b]);
    MKV_REQUIRE(page == plan.basePageBindings[b], kCall,
                "stale plan: block {} is no longer indexed on page {}", b,
                plan.basePageBindings[b]);
  }
  checkHostPlan(kCall, plan, fresh);
  checkPlanRecords(kCall, plan);
  MKV_REQUIRE(!plan.specReplayDependency || plan.mode == ReuseMode::kSpec, kCall,
              "replay dependency on a {} plan", toString(plan.mode));
}

void ContextCacheManager::checkPlanShape(char const* call, ReusePlan const& plan) const {
  MKV_REQUIRE(static_cast<uint8_t>(plan.mode) <= static_cast<uint8_t>(ReuseMode::kSpec), call,
              "reuse mode {} out of range", static_cast<int>(plan.mode));
  MKV_REQUIRE(plan.mode != ReuseMode::kSpec || mOptions.specContract.has_value(), call,
              "spec plan on a manager without a spec reuse contract");
  MKV_REQUIRE(plan.hybridHasAttention || plan.mode == ReuseMode::kHybrid, call,
              "only hybrid plans may be pure recurrent");
  MKV_REQUIRE(!plan.demand.hasNegative() && plan.demand.recurrentSnapshotSlots == 0 &&
                  plan.demand.partialKvSnapshotSlots == 0,
              call,
              "demand base {}, draft {}, recurrent {}, partial {}: negative, or snapshots "
              "(reserve those with reserveHybridSnapshots)",
              plan.demand.baseKvPages, plan.demand.draftKvPages, plan.demand.recurrentSnapshotSlots,
              plan.demand.partialKvSnapshotSlots);
  MKV_REQUIRE(plan.hybridHasAttention || plan.demand.baseKvPages == 0, call,
              "pure-recurrent plan demands {} base pages", plan.demand.baseKvPages);
  MKV_REQUIRE(
      (plan.draftPageBindings.empty() && plan.demand.draftKvPages == 0) || pairedDraft(plan.mode),
      call, "draft pages for a {} plan without paired draft state", toString(plan.mode));
  bool const pureRecurrent = !plan.hybridHasAttention;
  MKV_REQUIRE(pureRecurrent ? plan.basePageBindings.empty()
                            : plan.basePageBindings.size() == plan.matchedBlockDigests.size(),
              call, "{} base bindings for {} matched blocks", plan.basePageBindings.size(),
              plan.matchedBlockDigests.size());
}

void ContextCacheManager::checkPlanRecords(char const* call, ReusePlan const& plan) const {
  if (plan.specRecord != kNoRecord) {
    CacheRecord const* record = mRecords.get(plan.specRecord);
    MKV_REQUIRE(record != nullptr && record->specState &&
                    record->specState->draftPagePath.size() >= plan.draftPageBindings.size() &&
                    std::equal(plan.draftPageBindings.begin(), plan.draftPageBindings.end(),
                               record->specState->draftPagePath.begin()),
                call, "stale plan: spec record {} no longer holds the bound draft path",
                plan.specRecord);
  } else {
    MKV_REQUIRE(plan.draftPageBindings.empty(), call, "draft bindings without a spec record");
  }
  if (plan.hybridRecord != kNoRecord) {
    CacheRecord const* record = mRecords.get(plan.hybridRecord);
    MKV_REQUIRE(record != nullptr && record->isHybrid() &&
                    record->recurrentSnapshotSlot == plan.recurrentSnapshotBinding &&
                    record->partialKvSnapshotSlot == plan.partialKvSnapshotBinding &&
                    record->basePagePath == plan.basePageBindings,
                call, "stale plan: hybrid record {} no longer holds the bound state",
                plan.hybridRecord);
  } else {
    MKV_REQUIRE(!plan.recurrentSnapshotBinding && !plan.partialKvSnapshotBinding, call,
                "snapshot bindings without a hybrid record");
  }
}

// ---------------------------------------------------------------------------------------------
// Planning and admission

LookupResult ContextCacheManager::lookup(LookupRequest const& request) const {
  checkRequest("ContextCacheManager::lookup", request);
  LookupResult result{hashPromptBlocks(request.prompt, mPageSize), {}, std::nullopt, 0};
  planLookup(request, result);
  return result;
}

void ContextCacheManager::planLookup(LookupRequest const& request, LookupResult& result) const {
  switch (request.mode) {
    case ReuseMode::kVanilla:
      result.plan =
          mOptions.windowCache != nullptr
              ? makeWindowedReusePlan(mIndex, *mOptions.windowCache, result.blocks, request.policy)
              : makeVanillaReusePlan(mIndex, result.blocks, request.policy, mHostTier.get());
      break;
    case ReuseMode::kHybrid:
      result.plan = makeHybridReusePlan(mIndex, mRecords, result.blocks, request.hasAttention,
                                        request.policy);
      break;
    case ReuseMode::kHybridMtp:
      result.plan = makeHybridMtpReusePlan(mIndex, mRecords, result.blocks, request.policy);
      break;
    case ReuseMode::kSpec:
      result.plan = makeSpecReusePlan(mIndex, mRecords, result.blocks, *mOptions.specContract,
                                      request.policy);
      break;
  }
  applyCoverage(result.plan, request);
  result.missReason = request.policy == ContextCacheLookupPolicy::kUseCache
                          ? classifyMiss(mIndex, result.blocks, result.plan)
                          : std::nullopt;
  result.stateVersion = mStateVersion;
}

ReusePlan ContextCacheManager::coldPlanOf(LookupRequest const& request) const {
  checkRequest("ContextCacheManager::coldPlanOf", request);
  ReusePlan plan =
      makeColdReusePlan(request.mode, static_cast<int32_t>(request.prompt.tokens.size()), mPageSize,
                        request.hasAttention, pairedDraft(request.mode));
  applyCoverage(plan, request);
  return plan;
}

bool ContextCacheManager::allocateWithEviction(
    ResourceDemand const& demand, RecordId protectedRecord,
    std::array<std::vector<int32_t>*, kResourceTypeCount> const& targets) {
  // Grow the targets first: once records are evicted, nothing may fail any more. Geometrically:
  // a lease grows by one page every page of decoded tokens.
  for (ResourceType type : kAllResourceTypes) {
    if (std::vector<int32_t>* target = targets[static_cast<std::size_t>(type)]) {
      std::size_t const needed = target->size() + static_cast<std::size_t>(demand[type]);
      if (needed > target->capacity()) {
        target->reserve(std::max(needed, 2 * target->capacity()));
      }
    }
  }
  if (!mPools.canAllocate(demand)) {
    expireRetention();
    EvictionPlan const plan = mEvictionPlanner.plan(demand, mPools, mRecords, protectedRecord);
    if (!plan.feasible) {
      return false;
    }
    for (RecordId victim : plan.victims) {
      evictRecord(victim);
    }
  }
  bool const allocated = mPools.allocate(demand, targets);
  MKV_ASSERT(allocated, "eviction plan was feasible but allocation of {} base pages failed",
             demand.baseKvPages);
  return true;
}

AcquireResult ContextCacheManager::acquire(ReusePlan const& plan) {
  return acquirePlan(plan, /*fresh=*/false);
}

CacheRequestLease ContextCacheManager::pinPlan(ReusePlan const& plan) {
  CacheRequestLease lease;
  lease.mMode = plan.mode;
  lease.mHasAttention = plan.hybridHasAttention;
  lease.mHitRecord = plan.hybridRecord != kNoRecord ? plan.hybridRecord : plan.specRecord;
  lease.mBoundDigests = plan.matchedBlockDigests;
  lease.mReplayDependency = plan.specReplayDependency;
  lease.mBasePages.reserve(plan.basePageBindings.size() +
                           static_cast<std::size_t>(plan.demand.baseKvPages));
  lease.mDraftPages.reserve(plan.draftPageBindings.size() +
                            static_cast<std::size_t>(plan.demand.draftKvPages));
  // Live before the first pin: every exit from here on (refusal, exception) releases the pins.
  lease.mManager = this;
  ++mLiveLeases;
  for (PageId page : plan.basePageBindings) {
    mPools.addActive({ResourceType::kBaseKvPage, page});
    lease.mBasePages.push_back(page);
  }
  for (PageId page : plan.draftPageBindings) {
    mPools.addActive({ResourceType::kDraftKvPage, page});
    lease.mDraftPages.push_back(page);
  }
  if (plan.recurrentSnapshotBinding) {
    mPools.addActive({ResourceType::kRecurrentSnapshot, *plan.recurrentSnapshotBinding});
    lease.mHitRecurrent = plan.recurrentSnapshotBinding;
  }
  if (plan.partialKvSnapshotBinding) {
    mPools.addActive({ResourceType::kPartialKvSnapshot, *plan.partialKvSnapshotBinding});
    lease.mHitPartial = plan.partialKvSnapshotBinding;
  }
  lease.mBoundBasePages = static_cast<int32_t>(lease.mBasePages.size());
  lease.mBoundDraftPages = static_cast<int32_t>(lease.mDraftPages.size());
  pinHostPages(lease, plan);
  return lease;
}

AcquireResult ContextCacheManager::acquirePlan(ReusePlan const& plan, bool fresh) {
  checkPlan(plan, fresh);
  CacheRequestLease lease = pinPlan(plan);
  if (!allocateWithEviction(plan.demand, lease.mHitRecord,
                            {&lease.mBasePages, &lease.mDraftPages, nullptr, nullptr})) {
    return {std::nullopt, AcquireStatus::kInsufficientCapacity};  // the lease drops its pins
  }
  queueOnboarding(lease, plan);
  if (lease.mHitRecord != kNoRecord && mRecords.get(lease.mHitRecord) != nullptr) {
    mRecords.touch(lease.mHitRecord);
  }
  return {std::move(lease), AcquireStatus::kAcquired};
}

AdmissionResult ContextCacheManager::admit(LookupRequest const& request) {
  checkRequest("ContextCacheManager::admit", request);  // errors name this call
  return acquireLooked(request, lookup(request));
}

AdmissionResult ContextCacheManager::admit(LookupRequest const& request, LookupResult looked) {
  constexpr char const* kCall = "ContextCacheManager::admit";
  checkRequest(kCall, request);
  MKV_REQUIRE(looked.blocks.pageSize == mPageSize &&
                  looked.blocks.prompt.tokens.data() == request.prompt.tokens.data() &&
                  looked.blocks.prompt.tokens.size() == request.prompt.tokens.size(),
              kCall, "the lookup result is not this request's ({} tokens, page {})",
              looked.blocks.prompt.tokens.size(), looked.blocks.pageSize);
  if (looked.stateVersion != mStateVersion) {
    planLookup(request, looked);  // records or index changed since: re-plan, no re-hash
  }
  return acquireLooked(request, std::move(looked));
}

void ContextCacheManager::checkBatch(char const* call, std::span<LookupRequest const> requests,
                                     std::vector<LookupResult>& looked) const {
  MKV_REQUIRE(looked.size() == requests.size(), call, "{} lookup results for {} requests",
              looked.size(), requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    checkRequest(call, requests[i]);
    MKV_REQUIRE(looked[i].blocks.pageSize == mPageSize &&
                    looked[i].blocks.prompt.tokens.data() == requests[i].prompt.tokens.data() &&
                    looked[i].blocks.prompt.tokens.size() == requests[i].prompt.tokens.size(),
                call, "lookup result {} is not its request's ({} tokens, page {})", i,
                looked[i].blocks.prompt.tokens.size(), looked[i].blocks.pageSize);
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (looked[i].stateVersion != mStateVersion) {
      planLookup(requests[i], looked[i]);  // records or index changed since: re-plan, no re-hash
    }
    checkPlan(looked[i].plan, /*fresh=*/true);
  }
}

std::vector<AdmissionResult> ContextCacheManager::acquireBatch(
    std::span<LookupRequest const> requests, std::vector<LookupResult> looked) {
  checkBatch("ContextCacheManager::acquireBatch", requests, looked);
  // 1. Every hit pinned while every plan is still current (nothing is evicted before the last).
  BatchPins pins = pinBatch(looked);
  // 2. One exact eviction plan for the whole private demand, with every pin in place.
  bool fits = mPools.canAllocate(pins.total);
  EvictionPlan eviction;
  if (!fits) {
    expireRetention();
    eviction = mEvictionPlanner.plan(pins.total, mPools, mRecords, pins.hits);
    fits = eviction.feasible;
  }
  // The leases' copies of the retention ranges, made before anything is evicted.
  std::vector<std::vector<RetentionRange>> retention(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    retention[i].assign(requests[i].retention.begin(), requests[i].retention.end());
  }
  if (!fits) {
    pins.leases.clear();  // drops every pin: pinned pages are cached, so no free ring moves
    countRefusedBatch(requests, looked);
    return {};
  }
  // 3. Evict, then allocate each plan's demand from the free rings (cannot fail any more: the
  // leases reserved room for their pages when pinned).
  return grantBatch(requests, looked, pins.leases, eviction.victims, retention);
}

ContextCacheManager::BatchPins ContextCacheManager::pinBatch(
    std::vector<LookupResult> const& looked) {
  BatchPins pins;
  pins.leases.reserve(looked.size());
  pins.hits.reserve(looked.size());
  for (LookupResult const& result : looked) {
    pins.leases.push_back(pinPlan(result.plan));
    if (pins.leases.back().mHitRecord != kNoRecord) {
      pins.hits.push_back(pins.leases.back().mHitRecord);
    }
    for (ResourceType type : kAllResourceTypes) {
      pins.total[type] += result.plan.demand[type];
    }
  }
  return pins;
}

void ContextCacheManager::countRefusedBatch(std::span<LookupRequest const> requests,
                                            std::vector<LookupResult>& looked) {
  std::vector<AdmissionResult> refused(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    int32_t const verificationRejects = looked[i].plan.verificationRejects;
    refused[i].plan = std::move(looked[i].plan);
    countAdmission(requests[i], verificationRejects, looked[i].missReason, refused[i]);
  }
}

std::vector<AdmissionResult> ContextCacheManager::grantBatch(
    std::span<LookupRequest const> requests, std::vector<LookupResult>& looked,
    std::vector<CacheRequestLease>& leases, std::vector<RecordId> const& victims,
    std::vector<std::vector<RetentionRange>>& retention) {
  for (RecordId victim : victims) {
    evictRecord(victim);
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    CacheRequestLease& lease = leases[i];
    bool const allocated = mPools.allocate(
        looked[i].plan.demand, {&lease.mBasePages, &lease.mDraftPages, nullptr, nullptr});
    MKV_ASSERT(allocated, "batch eviction was feasible but allocation for sequence {} failed", i);
    queueOnboarding(lease, looked[i].plan);
  }
  std::vector<AdmissionResult> admitted(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    CacheRequestLease& lease = leases[i];
    if (lease.mHitRecord != kNoRecord && mRecords.get(lease.mHitRecord) != nullptr) {
      mRecords.touch(lease.mHitRecord);
    }
    int32_t const verificationRejects = looked[i].plan.verificationRejects;
    adoptRequest(lease, std::move(retention[i]), looked[i].missReason);
    admitted[i].lease = std::move(lease);
    admitted[i].outcome = AdmissionOutcome::kAcquired;
    admitted[i].plan = std::move(looked[i].plan);
    countAdmission(requests[i], verificationRejects, looked[i].missReason, admitted[i]);
  }
  return admitted;
}

AdmissionResult ContextCacheManager::acquireLooked(LookupRequest const& request,
                                                   LookupResult looked) {
  int32_t const verificationRejects = looked.plan.verificationRejects;
  std::optional<MissReason> const blockMiss = looked.missReason;
  std::vector<RetentionRange> retention(request.retention.begin(), request.retention.end());
  AdmissionResult result;
  AcquireResult acquired = acquirePlan(looked.plan, /*fresh=*/true);
  result.outcome =
      acquired.lease ? AdmissionOutcome::kAcquired : AdmissionOutcome::kInsufficientCapacity;
  result.plan = std::move(looked.plan);
  if (acquired.lease) {
    adoptRequest(*acquired.lease, std::move(retention), blockMiss);
  }
  result.lease = std::move(acquired.lease);
  countAdmission(request, verificationRejects, blockMiss, result);
  return result;
}

void ContextCacheManager::adoptRequest(CacheRequestLease& lease,
                                       std::vector<RetentionRange> retention,
                                       std::optional<MissReason> blockMiss) noexcept {
  lease.mRetention = std::move(retention);
  lease.mEvictedPrefix = blockMiss == MissReason::kEvicted;
}

void ContextCacheManager::countAdmission(LookupRequest const& request, int32_t verificationRejects,
                                         std::optional<MissReason> blockMiss,
                                         AdmissionResult& result) {
  bool const useCache = request.policy == ContextCacheLookupPolicy::kUseCache;
  if (useCache) {
    ++mMetrics.lookups;
    mMetrics.queriedTokens += request.prompt.tokens.size();
    mMetrics.verificationRejects += static_cast<uint64_t>(verificationRejects);
    result.missReason = result.outcome == AdmissionOutcome::kAcquired
                            ? blockMiss
                            : std::optional(MissReason::kCapacity);
    if (result.missReason) {
      ++mMetrics.missCount(*result.missReason);
    }
  } else {
    ++mMetrics.bypasses;
  }
  if (!result.lease) {
    ++mMetrics.failedAcquisitions;
    return;
  }
  ++mMetrics.admittedSequences;
  ReusePlan const& plan = result.plan;
  if (plan.matchedTokenLength > 0) {
    ++mMetrics.hits;
  }
  mMetrics.matchedTokens += static_cast<uint64_t>(plan.matchedTokenLength);
  mMetrics.reusedTokens += static_cast<uint64_t>(plan.reuseTokenLength);
  mMetrics.hostTierHitTokens += plan.hostOnboardPages.size() * static_cast<uint64_t>(mPageSize);
  mMetrics.windowLimitedTokens += static_cast<uint64_t>(plan.windowLimitedTokens);
  if (plan.kind == ReusePlanKind::kFullInputRewind) {
    ++mMetrics.fullInputRewinds;
  }
  if (plan.specReplayMode == SpecReplayMode::kFullPage) {
    ++mMetrics.specFullPageReplays;
  }
}

// ---------------------------------------------------------------------------------------------
// Growth and snapshots

bool ContextCacheManager::growBasePages(CacheRequestLease& lease, int32_t count) {
  constexpr char const* kCall = "ContextCacheManager::growBasePages";
  checkLease(kCall, lease);
  MKV_REQUIRE(count >= 0, kCall, "negative page count {}", count);
  MKV_REQUIRE(lease.mode() == ReuseMode::kVanilla ||
                  (lease.mode() == ReuseMode::kHybrid && lease.hasAttention()),
              kCall, "{} lease{}; use growSpecPages for paired leases", toString(lease.mode()),
              lease.hasAttention() ? "" : " without attention");
  if (count == 0) {
    return true;
  }
  return allocateWithEviction(ResourceDemand{count, 0, 0, 0}, lease.mHitRecord,
                              {&lease.mBasePages, nullptr, nullptr, nullptr});
}

bool ContextCacheManager::growSpecPages(CacheRequestLease& lease, int32_t basePages,
                                        int32_t draftPages) {
  constexpr char const* kCall = "ContextCacheManager::growSpecPages";
  checkLease(kCall, lease);
  MKV_REQUIRE(basePages >= 0 && draftPages >= 0, kCall, "negative page counts {} / {}", basePages,
              draftPages);
  MKV_REQUIRE(lease.mode() == ReuseMode::kSpec || lease.mode() == ReuseMode::kHybridMtp, kCall,
              "{} lease; use growBasePages", toString(lease.mode()));
  MKV_REQUIRE(draftPages == 0 || pairedDraft(lease.mode()), kCall,
              "{} draft pages for a lease without paired draft state", draftPages);
  if (basePages == 0 && draftPages == 0) {
    return true;
  }
  return allocateWithEviction(ResourceDemand{basePages, draftPages, 0, 0}, lease.mHitRecord,
                              {&lease.mBasePages, &lease.mDraftPages, nullptr, nullptr});
}

std::optional<SnapshotReservation> ContextCacheManager::reserveHybridSnapshots(
    CacheRequestLease& lease, bool needsPartial) {
  constexpr char const* kCall = "ContextCacheManager::reserveHybridSnapshots";
  checkLease(kCall, lease);
  MKV_REQUIRE(lease.mode() == ReuseMode::kHybrid || lease.mode() == ReuseMode::kHybridMtp, kCall,
              "{} lease holds no hybrid state", toString(lease.mode()));
  MKV_REQUIRE(!needsPartial || lease.hasAttention(), kCall,
              "a pure-recurrent lease has no partial KV page to snapshot");
  lease.mReservations.reserve(lease.mReservations.size() + 1);
  std::vector<int32_t> recurrent;
  std::vector<int32_t> partial;
  if (!allocateWithEviction(ResourceDemand{0, 0, 1, needsPartial ? 1 : 0}, lease.mHitRecord,
                            {nullptr, nullptr, &recurrent, &partial})) {
    return std::nullopt;
  }
  SnapshotReservation const reservation{
      recurrent.front(), needsPartial ? std::optional(partial.front()) : std::nullopt};
  lease.mReservations.push_back(reservation);
  return reservation;
}

void ContextCacheManager::releaseRestoredHybridSnapshots(CacheRequestLease& lease) {
  checkLease("ContextCacheManager::releaseRestoredHybridSnapshots", lease);
  if (lease.mHitRecurrent) {
    mPools.dropActive({ResourceType::kRecurrentSnapshot, *lease.mHitRecurrent});
    lease.mHitRecurrent.reset();
  }
  if (lease.mHitPartial) {
    mPools.dropActive({ResourceType::kPartialKvSnapshot, *lease.mHitPartial});
    lease.mHitPartial.reset();
  }
}

void ContextCacheManager::retireHybridSnapshotReservation(CacheRequestLease& lease,
                                                          SnapshotReservation const& reservation) {
  constexpr char const* kCall = "ContextCacheManager::retireHybridSnapshotReservation";
  checkLease(kCall, lease);
  auto const it = std::find(lease.mReservations.begin(), lease.mReservations.end(), reservation);
  MKV_REQUIRE(it != lease.mReservations.end(), kCall,
              "recurrent slot {} is not a reservation of this lease", reservation.recurrentSlot);
  mPools.dropActive({ResourceType::kRecurrentSnapshot, reservation.recurrentSlot});
  if (reservation.partialKvSlot) {
    mPools.dropActive({ResourceType::kPartialKvSnapshot, *reservation.partialKvSlot});
  }
  lease.mReservations.erase(it);
}

// ---------------------------------------------------------------------------------------------
// Eviction and release

void ContextCacheManager::evictRecord(RecordId id) noexcept {
  CacheRecord const* record = mRecords.get(id);
  bool const reusePoint = record != nullptr && record->reusePoint;
  int32_t const dropped = dropRecord(id, true);
  mMetrics.evictedRecords += static_cast<uint64_t>(dropped);
  mMetrics.evictedReusePoints += reusePoint ? static_cast<uint64_t>(dropped) : 0U;
}

int32_t ContextCacheManager::dropRecord(RecordId id, bool announce) noexcept {
  CacheRecord const* record = mRecords.get(id);
  if (record == nullptr) {
    return 0;
  }
  ++mStateVersion;
  record->forEachResource([&](ResourceId resource) {
    bool const freed = mPools.dropCache(resource);
    // A page without cache references is no longer reusable, even while a lease still pins it.
    if (resource.type == ResourceType::kBaseKvPage && mPools.cacheRefs(resource) == 0) {
      if (std::optional<Hash128> const digest = mIndex.digestOf(resource.index)) {
        if (announce) {
          mEvents.push(BlockRemoved{*digest, resource.index, KvMedium::kGpu, eventGroup()});
          offloadEvicted(resource.index, *digest);  // reads the entry: before it is erased
        }
        mIndex.erasePage(resource.index);
      }
    }
    if (freed) {
      ++mMetrics.reclaimed(resource.type);
    }
  });
  mRecords.evict(id);  // the policy learns of it (S3-FIFO's ghost)
  return 1;
}

KvCacheGroup ContextCacheManager::eventGroup() const noexcept {
  return mOptions.windowCache != nullptr ? kFullAttentionGroup : KvCacheGroup{};
}

bool ContextCacheManager::resetPrefixCache() noexcept {
  if (mLiveLeases > 0) {
    return false;
  }
  while (!mRecords.empty()) {
    mMetrics.resetRecords +=
        static_cast<uint64_t>(dropRecord(mRecords.lruToMru().front().id, false));
  }
  MKV_ASSERT(mIndex.size() == 0, "{} blocks indexed after dropping every record", mIndex.size());
  if (mHostTier) {
    mMetrics.hostTierResetPages += static_cast<uint64_t>(mHostTier->clear());
  }
  mMirroredBlocks.clear();
  mEvents.push(AllBlocksCleared{});
  ++mMetrics.prefixCacheResets;
  return true;
}

void ContextCacheManager::enforceRecordLimit() noexcept {
  if (mRecords.size() > static_cast<std::size_t>(mMaxRecords)) {
    expireRetention();
  }
  while (mRecords.size() > static_cast<std::size_t>(mMaxRecords)) {
    evictRecord(mRecords.firstVictim());
  }
}

int64_t ContextCacheManager::retentionNow() noexcept {
  int64_t now = 0;
  if (mOptions.retentionClock) {
    now = mOptions.retentionClock();
  } else {
    now = std::chrono::duration_cast<std::chrono::milliseconds>(
              std::chrono::steady_clock::now().time_since_epoch())
              .count();
  }
  mRetentionNow = std::max(mRetentionNow, now);
  return mRetentionNow;
}

void ContextCacheManager::expireRetention() noexcept {
  if (std::optional<int64_t> const next = mRecords.nextRetentionExpiry()) {
    if (*next <= retentionNow()) {
      mRecords.expireRetention(mRetentionNow);
    }
  }
}

void ContextCacheManager::applyRetention(CacheRecord& record, CacheRequestLease const& lease,
                                         int64_t lastToken) {
  RetentionChoice const choice = retentionOf(lease.mRetention, lastToken);
  record.retentionPriority = choice.priority;
  if (choice.duration && choice.priority != kDefaultRetentionPriority) {
    int64_t const now = retentionNow();
    record.retentionExpiry = now > std::numeric_limits<int64_t>::max() - *choice.duration
                                 ? std::numeric_limits<int64_t>::max()
                                 : now + *choice.duration;
  }
}

void ContextCacheManager::releaseLease(CacheRequestLease& lease) noexcept {
  for (PageId page : lease.mBasePages) {
    mPools.dropActive({ResourceType::kBaseKvPage, page});
  }
  for (PageId page : lease.mDraftPages) {
    mPools.dropActive({ResourceType::kDraftKvPage, page});
  }
  for (PageId page : lease.mHostPins) {
    mHostTier->unpin(page);
  }
  if (lease.mHitRecurrent) {
    mPools.dropActive({ResourceType::kRecurrentSnapshot, *lease.mHitRecurrent});
  }
  if (lease.mHitPartial) {
    mPools.dropActive({ResourceType::kPartialKvSnapshot, *lease.mHitPartial});
  }
  for (SnapshotReservation const& reservation : lease.mReservations) {
    mPools.dropActive({ResourceType::kRecurrentSnapshot, reservation.recurrentSlot});
    if (reservation.partialKvSlot) {
      mPools.dropActive({ResourceType::kPartialKvSnapshot, *reservation.partialKvSlot});
    }
  }
  --mLiveLeases;
}

// ---------------------------------------------------------------------------------------------
// Observers

ContextCacheMetrics ContextCacheManager::metrics() const {
  ContextCacheMetrics m = mMetrics;
  m.droppedEvents = mEvents.droppedCount();
  m.freeResources = mPools.freeCounts();
  for (ResourceType type : kAllResourceTypes) {
    m.reclaimableResources[type] = mPools.reclaimableCount(type);
  }
  m.capacities = mPools.capacities();
  m.records = static_cast<int64_t>(mRecords.size());
  m.indexedBlocks = mIndex.size();
  m.liveLeases = mLiveLeases;
  if (mHostTier) {
    m.hostTierCapacityPages = mHostTier->capacity();
    m.hostTierBlocks = mHostTier->size();
  }
  return m;
}

}  // namespace mkv
