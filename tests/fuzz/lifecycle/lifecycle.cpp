/// \file lifecycle.cpp
/// The lifecycle's frame: set-up from the input, the operation loop (which operation on which
/// request), teardown, and the helpers every operation family uses.

#include "fuzz/lifecycle/lifecycle.h"

#include <algorithm>

#include "mkv/bounded_swa_kv_page_manager.h"

namespace mkv::fuzz::lifecycle {

char const* toString(Stage stage) {
  switch (stage) {
    case Stage::kAdmitted:
      return "admitted";
    case Stage::kPrefill:
      return "prefill";
    case Stage::kIdle:
      return "idle";
    case Stage::kDecode:
      return "decode";
    case Stage::kCompaction:
      return "compaction";
    case Stage::kFinishing:
      return "finishing";
    case Stage::kGone:
      return "gone";
  }
  return "?";
}

Operation operationOf(Family family, bool corrupt) {
  switch (family) {
    case Family::kBegin:
      return corrupt ? Operation::kBadBegin : Operation::kBegin;
    case Family::kPreparePrefill:
      return corrupt ? Operation::kBadPreparePrefill : Operation::kPreparePrefill;
    case Family::kCaptures:
      return corrupt ? Operation::kBadCaptures : Operation::kCaptures;
    case Family::kCompletePrefill:
      return corrupt ? Operation::kBadCompletePrefill : Operation::kCompletePrefill;
    case Family::kPrepareDecode:
      return corrupt ? Operation::kBadPrepareDecode : Operation::kPrepareDecode;
    case Family::kCompleteDecode:
      return corrupt ? Operation::kBadCompleteDecode : Operation::kCompleteDecode;
    case Family::kBeginCompaction:
      return corrupt ? Operation::kBadBeginCompaction : Operation::kBeginCompaction;
    case Family::kCompleteCompaction:
      return corrupt ? Operation::kBadCompleteCompaction : Operation::kCompleteCompaction;
    case Family::kAdmit:
      return corrupt ? Operation::kBadAdmit : Operation::kAdmit;
    case Family::kFinalize:
      return corrupt ? Operation::kBadFinalize : Operation::kFinalize;
    case Family::kRetract:
      return Operation::kRetract;
    case Family::kFinish:
      return Operation::kFinish;
    case Family::kDrop:
      return Operation::kDrop;
    case Family::kShutdown:
      return Operation::kShutdown;
    case Family::kFailSync:
      return Operation::kFailSync;
    case Family::kObserve:
      return Operation::kObserve;
    case Family::kStaleHandle:
    case Family::kCount:
      break;
  }
  return Operation::kStaleHandle;
}

Lifecycle::Lifecycle(std::span<uint8_t const> data, LifecycleOptions const& options)
    : mIn(data), mOptions(options) {
  mSync.failCall(options.syncFaults.failAt, options.syncFaults.persistent);
}

LifecycleResult Lifecycle::run() {
  LifecycleResult result;
  try {
    if (!setUp()) {
      result.stats = mStats;
      return result;
    }
    while (!mIn.exhausted() && mStats.operations < mOptions.maxOperations) {
      ++mStats.operations;
      ++mStats.runtimeOperations[static_cast<std::size_t>(mKind)];
      mStats.engineStepOperations += mEngineStep ? 1 : 0;
      operation();
      checkAll();
    }
    tearDown();
  } catch (Violation const& violation) {
    result.ok = false;
    result.failure = violation.what;
  } catch (std::exception const& error) {
    result.ok = false;
    result.failure = std::string("the driver failed outside a library call: ") + error.what();
  }
  if (!result.ok) {
    result.failure += "\nlast operations:\n";
    for (std::string const& line : mTrace) {
      result.failure += "  " + line + "\n";
    }
    abandonEverything();
  }
  result.stats = mStats;
  return result;
}

// ---------------------------------------------------------------- set-up and teardown

/// The runtime the set-up bytes describe: batch, backend and its geometry, pools and cache
/// settings. The first byte: the batch (byte % 4) and, when bits 6 and 7 are both set,
/// engine-step device writes (no input of the checked-in corpus had them). The second byte picks
/// the runtime: below kNewRuntimes, byte % 3 (context reuse, bounded SWA, full storage: the
/// choice of the first corpus, unchanged); from kNewRuntimes on, (byte - kNewRuntimes) % 3 picks
/// hybrid checkpoints, speculative reuse or Hybrid-MTP. A bounded-SWA byte whose next byte (the
/// full layers: byte % 2) has bits 0 and 3 set picks sliding-window reuse instead (none of the
/// corpus's bounded-SWA inputs).
KVCacheRuntimeConfig Lifecycle::configFromInput() {
  constexpr uint8_t kNewRuntimes = 0xC0;
  constexpr uint8_t kEngineStepBits = 0xC0;
  constexpr uint8_t kSlidingReuseBits = 0x09;
  KVCacheRuntimeConfig config;
  config.tokensPerPage = kPage;
  uint8_t const batchByte = mIn.byte();
  config.maxBatchSize = 1 + batchByte % 4;
  mEngineStep = (batchByte & kEngineStepBits) == kEngineStepBits;
  config.deviceWrites = mEngineStep ? DeviceWriteTiming::kEngineStep : DeviceWriteTiming::kEachCall;
  config.deviceType = DeviceType::kCPU;
  config.stream = kStream;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.kvDataType = DataType::kFloat16;
  config.faults = mSync.injector();
  uint8_t const runtimeByte = mIn.byte();
  mKind = runtimeByte < kNewRuntimes ? static_cast<Runtime>(runtimeByte % 3)
                                     : static_cast<Runtime>(3 + (runtimeByte - kNewRuntimes) % 3);
  if (mKind == Runtime::kBoundedSwa) {
    config.model.numSlidingWindowLayers = 1;
    uint8_t const fullByte = mIn.byte();
    config.model.numFullAttentionLayers = fullByte % 2;
    if ((fullByte & kSlidingReuseBits) == kSlidingReuseBits) {
      mKind = Runtime::kSlidingReuse;  // bit 0 set: one full layer, as before
    }
    config.model.slidingWindowTokens = 1 + mIn.below(3 * kPage);
    int32_t const admission =
        BoundedSwaKVPageManager::admissionPagesPerSequence(config.model.slidingWindowTokens, kPage);
    int32_t const width = admission + 1 + mIn.below(4);
    config.maxSequenceLength = width * kPage - mIn.below(kPage);
    if (mKind == Runtime::kSlidingReuse) {
      slidingReuseConfig(config, width);
    } else if (mIn.oneIn(2)) {
      config.numSwaPages = config.maxBatchSize * admission + mIn.below(2 * admission);
    }
  } else {  // context reuse (and the runtimes built on it) or full storage
    config.model.numFullAttentionLayers = 1 + mIn.below(2);
    int32_t const width = 2 + mIn.below(5);
    config.maxSequenceLength = width * kPage - mIn.below(kPage);
    config.numPages = 2 + mIn.below(config.maxBatchSize * width + 2);
    config.contextReuse = mKind != Runtime::kFullStorage;
    config.contextCache.maxRecords = mIn.below(6);
    if (mKind >= Runtime::kHybrid) {  // keep records more often: reuse is what these runtimes add
      config.contextCache.maxRecords =
          config.contextCache.maxRecords == 0 ? 0 : 2 + config.contextCache.maxRecords;
    }
    // One byte: verification as before (byte % 4, what old corpus inputs meant), the eviction
    // policy from the next bit (byte % 8 >= 4), and on a plain context-reuse runtime a host tier
    // of 1, 3, 5 or 7 pages (bits 6-7) when bits 4-5 are both set (docs/context_cache.md, "Host
    // tier"): small, so that it drops blocks too.
    uint8_t const rawCacheByte = mIn.byte();
    int32_t const cacheByte = rawCacheByte % 8;
    config.contextCache.verifyTokens = cacheByte % 4 != 0;
    config.contextCache.evictionPolicy = cacheByte >= 6   ? EvictionPolicyKind::kLoopAware
                                         : cacheByte >= 4 ? EvictionPolicyKind::kS3Fifo
                                                          : EvictionPolicyKind::kLru;
    // Bit 3: joiners take their pages per prefill chunk (docs/lifecycle.md, "Chunked prefill").
    config.contextCache.joinerPages = (rawCacheByte & 0x08) != 0
                                          ? JoinerPageAllocation::kPerChunk
                                          : JoinerPageAllocation::kWholePrompt;
    if (mKind == Runtime::kContextReuse && (rawCacheByte & 0x30) == 0x30) {
      config.hostPoolTokens = int64_t{kPage} * (1 + 2 * (rawCacheByte >> 6));
    }
    if (mKind == Runtime::kHybrid) {
      // The same bits on a hybrid runtime: reuse points every 1-3 pages, or none (a quarter);
      // bit 6: branch points first, interval points and chunk ends on speculation.
      config.contextCache.checkpointInterval = kPage * ((rawCacheByte >> 4) & 3);
      config.contextCache.reusePointAdmission = (rawCacheByte & 0x40) != 0
                                                    ? ReusePointAdmission::kBranchFirst
                                                    : ReusePointAdmission::kEveryInterval;
    }
    config.contextCache.eventQueueCapacity = 4 * mIn.below(2);
  }
  if ((mKind == Runtime::kBoundedSwa || mKind == Runtime::kFullStorage) && mIn.oneIn(3)) {
    config.model.numRecurrentLayers = 1;
    config.model.recurrentStateBytes = 16;
    config.model.recurrentConvBytes = 8;
  }
  if (mKind == Runtime::kSpeculative || mKind == Runtime::kHybridMtp) {
    KVCacheSpeculativeConfig spec;
    // Hybrid-MTP needs a paged draft; an EAGLE-style runtime may have a draft reading the base KV
    // ({not paged, 0}) or an own-KV draft with (EAGLE, MTP: 1) or without (DFlash-like: 0) replay.
    spec.pagedDraft = mKind == Runtime::kHybridMtp || !mIn.oneIn(4);
    spec.futureDependencyTokens = spec.pagedDraft && !mIn.oneIn(3) ? 1 : 0;
    spec.numDraftLayers = spec.pagedDraft ? 1 : 0;
    spec.numDraftKVHeads = 1;
    spec.draftHeadDim = 4;
    if (spec.pagedDraft && mIn.oneIn(3)) {  // a draft pool smaller than the base pool
      spec.numDraftPages = 2 + mIn.below(config.numPages);
    }
    if (mKind == Runtime::kHybridMtp) {
      spec.boundaryHiddenWidth = kHiddenWidth;
    }
    config.speculative = spec;
  }
  if (mKind == Runtime::kHybrid || mKind == Runtime::kHybridMtp) {
    config.model.numRecurrentLayers = 1 + mIn.below(2);
    config.model.recurrentStateBytes = 16;
    config.model.recurrentConvBytes = 8;
    // 1-4 snapshot slots of each kind, charged as the coordinator charges them: recurrent rows
    // (plus a boundary hidden row for Hybrid-MTP), one page of every base (and draft) layer.
    int64_t const hidden = mKind == Runtime::kHybridMtp ? kHiddenWidth * 2 : 0;
    int64_t const recurrentSlot = config.model.numRecurrentLayers * (16 + 8) + hidden;
    int64_t const pageBytes = 2 * kPage * config.model.numKVHeads * config.model.headDim * 2;
    int32_t const layers =
        config.model.numFullAttentionLayers + (mKind == Runtime::kHybridMtp ? 1 : 0);
    config.contextCache.recurrentSnapshotPoolBytes = (1 + mIn.below(4)) * recurrentSlot;
    config.contextCache.partialKvSnapshotPoolBytes = (1 + mIn.below(4)) * layers * pageBytes;
  }
  return config;
}

/// Sliding-window reuse (the bytes after bounded SWA's geometry): reuse on, a sliding pool from
/// the smallest one the runtime accepts (one sequence's largest prefill: the row, a spare and
/// the window before a hit) up to one row per resident more, so that window blocks are dropped
/// for pages often; the full pool, record limit, verification and eviction policy as on context
/// reuse (no host tier: the composed backend has none).
void Lifecycle::slidingReuseConfig(KVCacheRuntimeConfig& config, int32_t width) {
  config.contextReuse = true;
  int32_t const minimum = width + 1 + ceilPages(config.model.slidingWindowTokens);
  config.numSwaPages = minimum + mIn.below(config.maxBatchSize * width + 1);
  config.numPages = 2 + mIn.below(config.maxBatchSize * width + 2);
  config.contextCache.maxRecords = mIn.below(6);
  uint8_t const rawCacheByte = mIn.byte();
  int32_t const cacheByte = rawCacheByte % 8;
  // Bits 3-4: the windows before reuse points every 1-3 blocks are kept in their own tier, or
  // none are (a quarter).
  config.contextCache.checkpointInterval = kPage * ((rawCacheByte >> 3) & 3);
  config.contextCache.verifyTokens = cacheByte % 4 != 0;
  config.contextCache.evictionPolicy = cacheByte >= 6   ? EvictionPolicyKind::kLoopAware
                                       : cacheByte >= 4 ? EvictionPolicyKind::kS3Fifo
                                                        : EvictionPolicyKind::kLru;
  config.contextCache.eventQueueCapacity = 4 * mIn.below(2);
}

/// False when the runtime could not be created (allocation fault).
bool Lifecycle::setUp() {
  KVCacheRuntimeConfig const config = configFromInput();
  try {
    LibraryCall scope;
    ++mStats.libraryCalls;
    mRuntime = KVCacheRuntime::create(config);
  } catch (std::bad_alloc const&) {
    ++mStats.badAllocs;  // create failed as a whole: nothing to check
    return false;
  }
  bindRuntime(config);
  switch (mKind) {
    case Runtime::kHybrid:
      ++mStats.hybridLifecycles;
      break;
    case Runtime::kSpeculative:
      ++mStats.speculativeLifecycles;
      break;
    case Runtime::kHybridMtp:
      ++mStats.mtpLifecycles;
      break;
    case Runtime::kSlidingReuse:
      ++mStats.slidingReuseLifecycles;
      expectf(mRuntime->backend() == KVCacheBackend::kSlidingWindowReuse,
              "set-up: sliding-window reuse config gave the {} backend",
              toString(mRuntime->backend()));
      break;
    default:
      break;
  }
  mStats.engineStepLifecycles += mEngineStep ? 1 : 0;
  trace(fmt::format("set-up: {} backend{}{}, batch {}, {} pages a row, pool {} pages{}",
                    toString(mRuntime->backend()), mEngineStep ? " (engine-step writes)" : "",
                    mKind == Runtime::kHybrid        ? " (hybrid checkpoints)"
                    : mKind == Runtime::kSpeculative ? (mDraftOracle ? " (speculative, paged draft)"
                                                                     : " (speculative, shared KV)")
                    : mKind == Runtime::kHybridMtp   ? " (Hybrid-MTP)"
                                                     : "",
                    mMaxBatch, mWidth, poolPages(),
                    mSwa != nullptr ? fmt::format(", window {}", mWindow) : std::string()));
  checkAll();
  return true;
}

/// The backend, its oracles and KV-length pools, and the driver's geometry.
void Lifecycle::bindRuntime(KVCacheRuntimeConfig const& config) {
  mCoordinator = mRuntime->contextCache();
  mSwa = mRuntime->swaPageManager();
  mWidth = mRuntime->maxPagesPerSequence();
  mMaxBatch = config.maxBatchSize;
  if (mSwa != nullptr) {
    mWindow = config.model.slidingWindowTokens;
    mWindowPages = BoundedSwaKVPageManager::windowPages(mWindow, kPage);
    mSwaOracle =
        std::make_unique<testing::KvOracle>(*mRuntime->swaPool(), *mRuntime->swaPageTable());
    mLengthPools.push_back(mRuntime->swaPool());
  }
  if (mRuntime->fullPool() != nullptr) {
    mFullOracle =
        std::make_unique<testing::KvOracle>(*mRuntime->fullPool(), *mRuntime->fullPageTable());
    mLengthPools.push_back(mRuntime->fullPool());
  }
  if (mRuntime->draftPool() != nullptr) {
    mDraftLookahead = std::min(1, config.speculative->futureDependencyTokens);
    mDraftOracle =
        std::make_unique<testing::KvOracle>(*mRuntime->draftPool(), *mRuntime->draftPageTable());
  }
  if (mCoordinator != nullptr && mCoordinator->profile().usesCheckpointReuse()) {
    mRecurrentOracle = std::make_unique<testing::RecurrentOracle>(*mRuntime->recurrentState());
  }
  mMapping = Tensor({mMaxBatch}, DataType::kInt32, DeviceType::kCPU);
  mWrongTypeMapping = Tensor({mMaxBatch}, DataType::kFloat32, DeviceType::kCPU);
}

/// Ends every request, shuts the backend down without faults and checks that every page is
/// back and every row is clear.
void Lifecycle::tearDown() {
  mSync.disarm();
  while (!mRequests.empty()) {
    drop(0);
    checkAll();
  }
  shutdown(false);
  if (mEngineStep) {
    flushForStep();  // the engine's next step: the cleared rows reach the device
  }
  checkAll();
  checkEverythingReturned();
  if (mCoordinator != nullptr) {
    resetPrefixCache();  // idle and drained: must succeed, and then every resource is free
    checkAll();
    checkCacheEmpty();
    mStats.snapshotPressureSkips +=
        static_cast<int64_t>(mCoordinator->counters().snapshotPressureSkips);
    mStats.reusePointsRestored += static_cast<int64_t>(mCoordinator->counters().reusePointRestores);
  }
  mRuntime.reset();
}

void Lifecycle::checkEverythingReturned() {
  expect(mQuarantine.empty(), "teardown: the quarantine was not drained");
  expect(!backendPoisoned(), "teardown: the backend is still poisoned after shutdown");
  if (mCoordinator != nullptr) {
    ResourcePools const& pools = mCoordinator->manager().pools();
    expect(mCoordinator->manager().liveLeaseCount() == 0, "teardown: leases are still live");
    // Every page, draft page and snapshot slot is free or held by a record only.
    for (ResourceType type : kAllResourceTypes) {
      for (int32_t id = 0; id < pools.capacity(type); ++id) {
        expectf(pools.activeRefs({type, id}) == 0, "teardown: {} {} is still pinned",
                toString(type), id);
      }
    }
  }
  if (slidingReuse()) {  // every sliding page free or caching a block, none held
    WindowBlockCache const& window = *mRuntime->windowBlockCache();
    expectf(window.heldPages() == 0 && window.evictablePages() == window.cachedBlocks(),
            "teardown: {} sliding pages held, {} of {} cached blocks evictable", window.heldPages(),
            window.evictablePages(), window.cachedBlocks());
  } else if (!coordinatorBackend()) {
    expectf(mSwa->freePageCount() == mSwa->totalPageCount(), "teardown: {} of {} SWA pages free",
            mSwa->freePageCount(), mSwa->totalPageCount());
  }
  for (CacheSlot slot = 0; slot < mainTable()->maxBatch(); ++slot) {
    expectf(mainTable()->liveEntryCount(slot) == 0, "teardown: row {} still maps pages", slot);
    expectf(!slidingReuse() || mRuntime->swaPageTable()->liveEntryCount(slot) == 0,
            "teardown: sliding row {} still maps pages", slot);
    KVPageTable const* draft = mRuntime->draftPageTable();
    expectf(draft == nullptr || draft->liveEntryCount(slot) == 0,
            "teardown: draft row {} still maps pages", slot);
  }
  expect(mRuntime->residentSlots().available() == mMaxBatch, "teardown: residents still held");
}

/// After a reset of an idle coordinator: no record holds anything, every resource is free.
void Lifecycle::checkCacheEmpty() {
  ResourcePools const& pools = mCoordinator->manager().pools();
  for (ResourceType type : kAllResourceTypes) {
    expectf(pools.freeCount(type) == pools.capacity(type), "reset: {} of {} {} free",
            pools.freeCount(type), pools.capacity(type), toString(type));
  }
  if (slidingReuse()) {  // the reset empties the window cache too
    WindowBlockCache const& window = *mRuntime->windowBlockCache();
    expectf(window.cachedBlocks() == 0 && window.freePages() == window.totalPages(),
            "reset: {} window blocks cached, {} of {} sliding pages free", window.cachedBlocks(),
            window.freePages(), window.totalPages());
  }
}

/// After a violation: drops what can be dropped without checks so that nothing terminates.
void Lifecycle::abandonEverything() noexcept {
  try {
    mSync.disarm();
    mRequests.clear();
    if (mRuntime) {
      (void)mRuntime->shutdown();
    }
    mRuntime.reset();
  } catch (...) {
  }
}

// ---------------------------------------------------------------- the operation loop

/// The call that moves a request on.
Family Lifecycle::naturalNext(Req const& req) {
  switch (req.stage) {
    case Stage::kAdmitted:
      return Family::kPreparePrefill;
    case Stage::kPrefill:
      if (req.mtp && std::any_of(req.rows.begin(), req.rows.end(), [](Row const& row) {
            return !row.endpointPublished;
          })) {  // the endpoints (and restores) come first
        return mIn.oneIn(4) ? Family::kCompletePrefill : Family::kCaptures;
      }
      if (mKind == Runtime::kHybrid || mKind == Runtime::kHybridMtp) {  // captures half the time
        return mIn.oneIn(2) ? Family::kCaptures : Family::kCompletePrefill;
      }
      return mIn.oneIn(4) ? Family::kCaptures : Family::kCompletePrefill;
    case Stage::kIdle: {
      bool stopped = false;
      for (Row const& row : req.rows) {
        stopped = stopped || row.reason != FinishReason::kNotFinished;
      }
      if (!req.rows.empty() && !req.rows.back().joined) {
        if (coordinatorBackend()) {
          return mIn.oneIn(4) ? Family::kRetract : Family::kFinalize;
        }
        // A bounded-SWA joiner prefills in chunks while the batch decodes.
        int32_t const choice = mIn.below(16);
        return choice == 0  ? Family::kRetract
               : choice < 9 ? Family::kFinalize
                            : Family::kPrepareDecode;
      }
      if (stopped || mIn.oneIn(16)) {
        return Family::kBeginCompaction;
      }
      // Runtimes without in-flight admission are asked rarely (the call must be rejected).
      if (mIn.oneIn(mRuntime->supportsSeatedAdmission() ? 6 : 24)) {
        return Family::kAdmit;
      }
      return mIn.oneIn(40) ? Family::kFinish : Family::kPrepareDecode;
    }
    case Stage::kDecode:
      // A bounded-SWA joiner's chunk and finalisation calls during the step: refused.
      if (!req.rows.empty() && swaJoiner(req.rows.back()) && mIn.oneIn(8)) {
        return Family::kFinalize;
      }
      return Family::kCompleteDecode;
    case Stage::kCompaction:
      return Family::kCompleteCompaction;
    case Stage::kFinishing:
      return Family::kFinish;
    case Stage::kGone:
      return mIn.oneIn(2) ? Family::kFinish : Family::kDrop;
  }
  return Family::kFinish;
}

/// The request an operation acts on: the input picks one; a request that cannot prefill while
/// another executes usually yields to the executing one.
std::size_t Lifecycle::pickTarget() {
  auto target = static_cast<std::size_t>(mIn.below(static_cast<int32_t>(mRequests.size())));
  if (mRequests[target]->stage == Stage::kAdmitted && prefillBlockedByAnother(*mRequests[target]) &&
      !mIn.oneIn(4)) {
    for (std::size_t i = 0; i < mRequests.size(); ++i) {
      if (executing(mRequests[i]->stage)) {
        return i;
      }
    }
  }
  return target;
}

/// One operation: a selector byte picks the family (a begin, the target's natural next call,
/// or any family on any request), then one byte in eight corrupts the call's arguments.
void Lifecycle::operation() {
  uint8_t const selector = mIn.byte();
  Family family = Family::kBegin;
  std::size_t target = 0;
  if (!mRequests.empty() && selector >= 20) {
    if (selector < 210) {
      target = pickTarget();
      family = naturalNext(*mRequests[target]);
    } else {
      family = static_cast<Family>(mIn.below(static_cast<int32_t>(Family::kCount)));
      target = static_cast<std::size_t>(mIn.below(static_cast<int32_t>(mRequests.size())));
    }
  }
  if (family == Family::kBegin && static_cast<int32_t>(mRequests.size()) >= kMaxLiveRequests + 2) {
    family = Family::kDrop;  // keep the set of requests small
  } else if (family == Family::kBegin && !mQuarantine.empty() && mRequests.empty() &&
             mIn.oneIn(2)) {
    family = Family::kShutdown;  // quarantined pages and residents return only at shutdown
  } else if (family == Family::kBegin && mRuntime->residentSlots().available() == 0) {
    // Every resident is busy: a quarantined request only lets go of its rows at shutdown.
    if (!mQuarantine.empty() && (mRequests.empty() || mIn.oneIn(2))) {
      family = Family::kShutdown;
    } else if (!mRequests.empty()) {
      target = pickTarget();
      family = naturalNext(*mRequests[target]);
    }
  }
  Operation const op = operationOf(family, mIn.oneIn(8));
  bool const onRequest = family != Family::kBegin && family != Family::kShutdown &&
                         family != Family::kFailSync && family != Family::kStaleHandle;
  uint64_t const serial = onRequest && target < mRequests.size() ? mRequests[target]->serial : 0;
  try {
    dispatch(op, target);
  } catch (AllocationFailed const&) {
    recoverFromAllocationFailure(serial);
  }
}

void Lifecycle::dispatch(Operation op, std::size_t target) {
  switch (op) {
    case Operation::kBegin:
      begin();
      return;
    case Operation::kBadBegin:
      badBegin();
      return;
    case Operation::kShutdown:
      shutdown(true);
      return;
    case Operation::kFailSync:
      armSyncFault();
      return;
    case Operation::kStaleHandle:
      staleHandle();
      return;
    default:
      break;
  }
  if (target < mRequests.size()) {
    dispatchOnRequest(op, target);
  }
}

void Lifecycle::dispatchOnRequest(Operation op, std::size_t target) {
  Req& req = *mRequests[target];
  switch (op) {
    case Operation::kPreparePrefill:
      preparePrefill(req);
      return;
    case Operation::kBadPreparePrefill:
      badPreparePrefill(req);
      return;
    case Operation::kCaptures:
      captures(req);
      return;
    case Operation::kBadCaptures:
      badCaptures(req);
      return;
    case Operation::kCompletePrefill:
      completePrefill(req);
      return;
    case Operation::kBadCompletePrefill:
      badCompletePrefill(req);
      return;
    case Operation::kPrepareDecode:
      prepareDecode(req);
      return;
    case Operation::kBadPrepareDecode:
      badPrepareDecode(req);
      return;
    case Operation::kCompleteDecode:
      completeDecode(req);
      return;
    case Operation::kBadCompleteDecode:
      badCompleteDecode(req);
      return;
    case Operation::kBeginCompaction:
      beginCompaction(req);
      return;
    case Operation::kBadBeginCompaction:
      badBeginCompaction(req);
      return;
    case Operation::kCompleteCompaction:
      completeCompaction(req);
      return;
    case Operation::kBadCompleteCompaction:
      badCompleteCompaction(req);
      return;
    case Operation::kAdmit:
      admit(req);
      return;
    case Operation::kBadAdmit:
      badAdmit(req);
      return;
    case Operation::kFinalize:
      finalize(req);
      return;
    case Operation::kBadFinalize:
      badFinalize(req);
      return;
    case Operation::kRetract:
      retract(req);
      return;
    case Operation::kFinish:
      finish(req);
      return;
    case Operation::kDrop:
      drop(target);
      return;
    case Operation::kObserve:
      observe(req);
      return;
    default:
      return;
  }
}

/// A library call threw std::bad_alloc: the request it was made on can no longer be trusted;
/// drop it (abandon: release or quarantine) and let the invariants judge what is left.
void Lifecycle::recoverFromAllocationFailure(uint64_t serial) {
  trace("std::bad_alloc: dropping the request the call was made on");
  mPoisoned = backendPoisoned();
  for (std::size_t i = 0; i < mRequests.size(); ++i) {
    if (mRequests[i]->serial == serial) {
      drop(i);
      break;
    }
  }
  mPoisoned = backendPoisoned();
}

// ---------------------------------------------------------------- small helpers

int32_t Lifecycle::poolPages() const {
  return coordinatorBackend() ? mRuntime->fullPool()->numPages() : mSwa->totalPageCount();
}

KVPageTable* Lifecycle::mainTable() const {
  return coordinatorBackend() ? mRuntime->fullPageTable() : mRuntime->swaPageTable();
}

bool Lifecycle::backendPoisoned() const {
  return coordinatorBackend() ? mCoordinator->poisoned() : mSwa->poisoned();
}

// ---------------------------------------------------------------- engine-step device writes

/// The engine forgets the flush of this step (engine-step runtimes, one step in 16, and only
/// when writes wait for it: otherwise nothing would notice). Reads a byte on engine-step
/// runtimes only, so the input format of the others is unchanged.
bool Lifecycle::forgetFlush() {
  return mEngineStep && mIn.oneIn(16) && mRuntime->deviceWritesPending();
}

/// KVCacheRuntime::flushDeviceWrites() where the engine makes it: after the step's lifecycle
/// calls, before its forward reads the tables and lengths. Afterwards nothing waits and every
/// device table is its host table.
void Lifecycle::flushForStep() {
  if (!mEngineStep) {
    return;
  }
  library("flushDeviceWrites", [&] { mRuntime->flushDeviceWrites(); });
  ++mStats.deviceFlushes;
  checkFlushed();
}

void Lifecycle::checkFlushed() {
  expect(!mRuntime->deviceWritesPending(), "flushDeviceWrites left writes pending");
  for (KVPageTable const* table :
       {mRuntime->fullPageTable(), mRuntime->swaPageTable(), mRuntime->draftPageTable()}) {
    if (table == nullptr) {
      continue;
    }
    expect(!table->dirty(), "a page table is dirty after flushDeviceWrites");
    checkMirrorRows(*table, /*clearedMayLag=*/false, " after the flush");
  }
}

int32_t Lifecycle::maxPromptTokens() const {
  // Context reuse needs the prompt plus its headroom tokens in a row; SWA maps the window only.
  return coordinatorBackend() ? mWidth * kPage - mPromptHeadroom : mWidth * kPage;
}

void Lifecycle::trace(std::string line) {
  if (mOptions.trace) {
    fmt::print(stderr, "[{}] {}\n", mStats.operations, line);
  }
  mTrace.push_back(std::move(line));
  if (mTrace.size() > 24) {
    mTrace.pop_front();
  }
}

void Lifecycle::expectRefusalChangedNothing(std::string const& what, BackendSnapshot before) {
  BackendSnapshot after = snapshot();
  before.counters.clear();
  after.counters.clear();
  expectf(before == after, "{}: refused but changed {}", what, differences(before, after));
}

/// The synchronisations a call made: must be `expected`; returns whether one failed.
bool Lifecycle::synchronised(std::string const& what, int64_t callsBefore, int64_t failuresBefore,
                             int64_t expected) {
  int64_t const made = syncCalls() - callsBefore;
  expectf(made == expected, "{}: made {} synchronisations, expected {}", what, made, expected);
  bool const failed = syncFailures() != failuresBefore;
  if (failed) {
    ++mStats.failedSynchronizations;
  }
  return failed;
}

bool Lifecycle::quarantinedByCapture(Req& req, std::string const& what,
                                     ContextCacheCoordinatorCounters const& before,
                                     int64_t callsBefore, int64_t failuresBefore, bool returned) {
  if (!coordinatorBackend()) {
    return false;
  }
  uint64_t const captureSyncs =
      mCoordinator->counters().captureSynchronizations - before.captureSynchronizations;
  expectf(captureSyncs == 0 || checkpointDeployment(), "{}: capture synchronisation", what);
  if (!synchronised(what, callsBefore, failuresBefore, static_cast<int64_t>(captureSyncs))) {
    return false;
  }
  expect(!returned, what + ": returned true after a failed capture synchronisation");
  quarantine(req);
  req.stage = Stage::kGone;
  trace(what + ": capture synchronisation failed, request quarantined");
  return true;
}

Req* Lifecycle::find(uint64_t serial) {
  for (auto& req : mRequests) {
    if (req->serial == serial) {
      return req.get();
    }
  }
  return nullptr;
}

std::string Lifecycle::describe(Req const& req) const {
  return fmt::format("request {} ({} {}{}, {} rows, {})", req.serial,
                     req.via == Via::kFacade ? "facade" : "direct",
                     slidingReuse()         ? "sliding-reuse"
                     : coordinatorBackend() ? "coordinator"
                                            : "SWA",
                     req.mtp ? ", Hybrid-MTP" : (req.speculative ? ", speculative" : ""),
                     req.rows.size(), toString(req.stage));
}

/// Pages a live SWA row holds (2M + 1 until completePrefill, or a joiner's finalisation, trims
/// it to M + 1).
int32_t Lifecycle::swaRowPages(Req const& req, Row const& row) const {
  return req.trimmed && row.joined ? mWindowPages + 1 : 2 * mWindowPages + 1;
}

int32_t Lifecycle::liveRequests() const {
  int32_t live = 0;
  for (auto const& req : mRequests) {
    live += req->stage != Stage::kGone ? 1 : 0;
  }
  return live;
}

/// Residents currently held by the driver's rows (live or quarantined).
std::vector<ResidentRef> Lifecycle::busyResidents() const {
  std::vector<ResidentRef> busy;
  for (auto const& req : mRequests) {
    if (req->stage != Stage::kGone) {
      for (Row const& row : req->rows) {
        busy.push_back(row.resident);
      }
    }
  }
  for (Quarantined const& q : mQuarantine) {
    for (Row const& row : q.rows) {
      busy.push_back(row.resident);
    }
  }
  return busy;
}

}  // namespace mkv::fuzz::lifecycle
