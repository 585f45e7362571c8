#include "runtime_test_rig.h"

#include <algorithm>
#include <numeric>
#include <span>
#include <utility>

#include "context_cache/context_cache_manager.h"
#include "context_cache/window_block_cache.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "support/test_util.h"

namespace mkv::runtime_test {

namespace {

char const* shortName(Backend backend) {
  switch (backend) {
    case Backend::kContextReuse:
      return "reuse";
    case Backend::kBoundedSwa:
      return "swa";
    case Backend::kSlidingWindowReuse:
      return "slidingreuse";
  }
  return "?";
}

}  // namespace

std::string backendName(::testing::TestParamInfo<Backend> const& info) {
  return shortName(info.param);
}

void PrintTo(Backend backend, std::ostream* out) {
  switch (backend) {
    case Backend::kContextReuse:
      *out << "context reuse";
      return;
    case Backend::kBoundedSwa:
      *out << "bounded SWA";
      return;
    case Backend::kSlidingWindowReuse:
      *out << "sliding-window reuse";
      return;
  }
}

void PrintTo(RuntimeCase const& runtimeCase, std::ostream* out) {
  PrintTo(runtimeCase.backend, out);
  *out << " on " << toString(runtimeCase.device);
}

std::string runtimeCaseName(::testing::TestParamInfo<RuntimeCase> const& info) {
  return std::string(shortName(info.param.backend)) + "_" +
         std::string(toString(info.param.device));
}

std::vector<RuntimeCase> allRuntimeCases() {
  std::vector<RuntimeCase> cases;
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    for (Backend backend : {Backend::kContextReuse, Backend::kBoundedSwa}) {
      cases.push_back({backend, device});
    }
  }
  return cases;
}

std::vector<RuntimeCase> everyBackendCase() {
  std::vector<RuntimeCase> cases = allRuntimeCases();
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    cases.push_back({Backend::kSlidingWindowReuse, device});
  }
  return cases;
}

KVCacheRuntimeConfig configFor(Backend backend, DeviceType device) {
  KVCacheRuntimeConfig config;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.kvDataType = DataType::kFloat16;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 256;
  config.tokensPerPage = kPageTokens;
  config.deviceType = device;
  if (backend == Backend::kContextReuse) {
    config.model.numFullAttentionLayers = 2;
  } else {
    config.model.numFullAttentionLayers = 1;
    config.model.numSlidingWindowLayers = 1;
    config.model.slidingWindowTokens = kWindowTokens;
  }
  config.contextReuse = backend != Backend::kBoundedSwa;
  return config;
}

// ---------------------------------------------------------------- RuntimeRig

RuntimeRig::RuntimeRig(KVCacheRuntimeConfig config) {
  config.faults = mFaults.injector();  // every site; arm them through faults()
  mRuntime = KVCacheRuntime::create(config);
}

RuntimeRig::~RuntimeRig() {
  mFaults.disarm();
  if (activeRequests() == 0) {
    (void)mRuntime->shutdown();
  }
}

int32_t RuntimeRig::freePages() const {
  if (ContextCacheCoordinator const* coordinator = mRuntime->contextCache()) {
    return coordinator->manager().pools().freeCount(ResourceType::kBaseKvPage);
  }
  return mRuntime->swaPageManager()->freePageCount();
}

int32_t RuntimeRig::totalPages() const {
  if (ContextCacheCoordinator const* coordinator = mRuntime->contextCache()) {
    return coordinator->manager().pools().capacity(ResourceType::kBaseKvPage);
  }
  return mRuntime->swaPageManager()->totalPageCount();
}

int32_t RuntimeRig::heldPages() const {
  ContextCacheCoordinator const* coordinator = mRuntime->contextCache();
  if (coordinator == nullptr) {
    return totalPages() - freePages();
  }
  ResourcePools const& pools = coordinator->manager().pools();
  int32_t held = 0;
  for (int32_t page = 0; page < totalPages(); ++page) {
    held += pools.activeRefs(ResourceId{ResourceType::kBaseKvPage, page}) > 0 ? 1 : 0;
  }
  if (WindowBlockCache const* window = mRuntime->windowBlockCache()) {
    held += window->heldPages();
  }
  return held;
}

bool RuntimeRig::poisoned() const {
  BoundedSwaKVPageManager const* swa = mRuntime->swaPageManager();
  if (ContextCacheCoordinator const* coordinator = mRuntime->contextCache()) {
    return coordinator->poisoned() || (swa != nullptr && swa->poisoned());
  }
  return swa->poisoned();
}

int32_t RuntimeRig::activeRequests() const {
  if (ContextCacheCoordinator const* coordinator = mRuntime->contextCache()) {
    return coordinator->activeRequestCount();
  }
  return mRuntime->swaPageManager()->activeRequestCount();
}

namespace {

void appendRows(KVPageTable const* table, std::vector<int32_t>& out) {
  if (table == nullptr) {
    return;
  }
  for (CacheSlot slot = 0; slot < table->maxBatch(); ++slot) {
    std::span<int32_t const> const row = table->hostRow(slot);
    out.insert(out.end(), row.begin(), row.end());
  }
}

/// The active rows of the pool's KV-length tensor, copied to the host.
std::vector<int32_t> activeLengths(KVCachePool const& pool) {
  return test::readAs<int32_t>(pool.kvLengths());  // shaped [activeBatchSize]
}

}  // namespace

BackendState RuntimeRig::observe() const {
  KVCacheRuntime& runtime = *mRuntime;
  BackendState state;
  state.freePages = freePages();
  state.heldPages = heldPages();
  state.activeRequests = activeRequests();
  state.poisoned = poisoned();
  state.availableResidents = runtime.residentSlots().available();
  appendRows(runtime.fullPageTable(), state.fullTable);
  appendRows(runtime.swaPageTable(), state.swaTable);
  appendRows(runtime.draftPageTable(), state.draftTable);
  for (KVPageTable const* table :
       {runtime.fullPageTable(), runtime.swaPageTable(), runtime.draftPageTable()}) {
    if (table != nullptr) {
      std::vector<int32_t> const device = test::readAs<int32_t>(table->deviceTable());
      state.deviceTables.insert(state.deviceTables.end(), device.begin(), device.end());
    }
  }
  for (KVCachePool const* pool : {runtime.fullPool(), runtime.swaPool(), runtime.draftPool()}) {
    if (pool != nullptr) {
      state.kvLengths.push_back(pool->activeBatchSize());
      std::vector<int32_t> const lengths = activeLengths(*pool);
      state.kvLengths.insert(state.kvLengths.end(), lengths.begin(), lengths.end());
    }
  }
  if (ContextCacheCoordinator const* coordinator = runtime.contextCache()) {
    state.quarantinedRequests = coordinator->quarantinedRequestCount();
    ContextCacheManager const& manager = coordinator->manager();
    ResourcePools const& pools = manager.pools();
    for (int32_t page = 0; page < totalPages(); ++page) {
      state.pageRefs.push_back(pools.activeRefs({ResourceType::kBaseKvPage, page}));
      state.pageRefs.push_back(pools.cacheRefs({ResourceType::kBaseKvPage, page}));
    }
    state.freeRing = pools.freeList(ResourceType::kBaseKvPage);
    for (CacheRecord const& record : manager.records().lruToMru()) {
      state.records.push_back(record.id);
    }
    state.liveLeases = manager.liveLeaseCount();
    for (ResourceType type : {ResourceType::kDraftKvPage, ResourceType::kRecurrentSnapshot,
                              ResourceType::kPartialKvSnapshot}) {
      for (int32_t id = 0; id < pools.capacity(type); ++id) {
        state.snapshotRefs.push_back(pools.activeRefs({type, id}));
        state.snapshotRefs.push_back(pools.cacheRefs({type, id}));
      }
      state.snapshotRefs.push_back(pools.freeCount(type));
    }
  } else {
    state.quarantinedRequests = runtime.swaPageManager()->quarantinedPageCount();
  }
  if (WindowBlockCache* window = runtime.windowBlockCache()) {
    for (PageId page = 0; page < window->totalPages(); ++page) {
      state.windowPages.push_back(window->holders(page));
      std::optional<Hash128> const digest = window->index().digestOf(page);
      state.windowPages.push_back(digest ? static_cast<int64_t>(digest->lo) : 0);
    }
    state.windowPages.push_back(window->freePages());
    state.windowPages.push_back(window->evictablePages());
    state.windowPages.push_back(window->evictableReadPages());
    state.windowPages.push_back(runtime.swaPageManager()->quarantinedPageCount());
  }
  state.synchronizations = mFaults.calls();
  return state;
}

void RuntimeRig::expectUnchanged(BackendState const& before, bool ringOrder) const {
  BackendState now = observe();
  if (!ringOrder) {
    std::vector<int32_t> ring = before.freeRing;
    std::sort(ring.begin(), ring.end());
    std::sort(now.freeRing.begin(), now.freeRing.end());
    EXPECT_EQ(now.freeRing, ring) << "the free pages";
    now.freeRing = before.freeRing;
  }
  EXPECT_EQ(now.freePages, before.freePages);
  EXPECT_EQ(now.heldPages, before.heldPages);
  EXPECT_EQ(now.activeRequests, before.activeRequests);
  EXPECT_EQ(now.quarantinedRequests, before.quarantinedRequests);
  EXPECT_EQ(now.poisoned, before.poisoned);
  EXPECT_EQ(now.availableResidents, before.availableResidents);
  EXPECT_EQ(now.fullTable, before.fullTable);
  EXPECT_EQ(now.swaTable, before.swaTable);
  EXPECT_EQ(now.draftTable, before.draftTable);
  EXPECT_EQ(now.deviceTables, before.deviceTables) << "device page tables";
  EXPECT_EQ(now.kvLengths, before.kvLengths);
  EXPECT_EQ(now.pageRefs, before.pageRefs) << "page references";
  EXPECT_EQ(now.freeRing, before.freeRing);
  EXPECT_EQ(now.records, before.records);
  EXPECT_EQ(now.snapshotRefs, before.snapshotRefs) << "draft pages and snapshot slots";
  EXPECT_EQ(now.liveLeases, before.liveLeases);
  EXPECT_EQ(now.windowPages, before.windowPages) << "the sliding pool's pages";
  EXPECT_EQ(now.synchronizations, before.synchronizations);
}

void RuntimeRig::expectIdle() const {
  KVCacheRuntime& runtime = *mRuntime;
  EXPECT_EQ(activeRequests(), 0);
  EXPECT_FALSE(poisoned());
  EXPECT_EQ(heldPages(), 0);
  if (ContextCacheCoordinator const* coordinator = runtime.contextCache()) {
    EXPECT_EQ(coordinator->quarantinedRequestCount(), 0);
    EXPECT_EQ(coordinator->manager().liveLeaseCount(), 0);
    ResourcePools const& pools = coordinator->manager().pools();
    int32_t cached = 0;
    for (int32_t page = 0; page < totalPages(); ++page) {
      cached += pools.cacheRefs(ResourceId{ResourceType::kBaseKvPage, page}) > 0 ? 1 : 0;
    }
    EXPECT_EQ(freePages() + cached, totalPages()) << "every page is free or cached";
    EXPECT_EQ(pools.reclaimableCount(ResourceType::kBaseKvPage), cached)
        << "evicting the records would free every cached page";
    for (CacheSlot slot = 0; slot < runtime.config().maxBatchSize; ++slot) {
      EXPECT_EQ(runtime.fullPageTable()->liveEntryCount(slot), 0) << "slot " << slot;
    }
    if (WindowBlockCache const* window = runtime.windowBlockCache()) {
      EXPECT_EQ(runtime.swaPageManager()->quarantinedPageCount(), 0);
      EXPECT_EQ(runtime.swaPageManager()->activeRequestCount(), 0);
      EXPECT_EQ(window->heldPages(), 0);
      EXPECT_EQ(window->freePages() + window->evictablePages(), window->totalPages())
          << "every sliding page is free or caches a window block";
      for (CacheSlot slot = 0; slot < runtime.config().maxBatchSize; ++slot) {
        EXPECT_EQ(runtime.swaPageTable()->liveEntryCount(slot), 0) << "sliding slot " << slot;
      }
    }
  } else {
    BoundedSwaKVPageManager const& manager = *runtime.swaPageManager();
    EXPECT_EQ(manager.quarantinedPageCount(), 0);
    EXPECT_EQ(freePages(), totalPages());
    for (CacheSlot slot = 0; slot < runtime.config().maxBatchSize; ++slot) {
      EXPECT_EQ(runtime.swaPageTable()->liveEntryCount(slot), 0) << "slot " << slot;
    }
  }
  EXPECT_EQ(runtime.residentSlots().available(), runtime.residentSlots().capacity());
}

// ---------------------------------------------------------------- FacadeDriver

FacadeDriver::FacadeDriver(RuntimeRig& rig) : mRig(rig) {
  KVCacheRuntime& runtime = rig.runtime();
  if (runtime.fullPool() != nullptr) {
    mFullOracle =
        std::make_unique<testing::KvOracle>(*runtime.fullPool(), *runtime.fullPageTable());
  }
  if (runtime.swaPool() != nullptr) {
    mSwaOracle = std::make_unique<testing::KvOracle>(*runtime.swaPool(), *runtime.swaPageTable());
  }
  deviceMapping =
      Tensor({runtime.config().maxBatchSize}, DataType::kInt32, runtime.config().deviceType);
  context.stream = runtime.config().stream;
}

FacadeDriver::~FacadeDriver() {
  managed.reset();
  for (Row const& row : rows) {
    (void)mRig.runtime().residentSlots().release(row.resident);
  }
}

void FacadeDriver::appendRow(std::vector<int32_t> prompt, ResidentRef resident, bool seated) {
  context.rawBatchedInputIds.push_back(prompt);
  context.residentRefs.push_back(resident);
  context.generatedTokenIds.emplace_back();
  context.finishReasons.push_back(FinishReason::kNotFinished);
  Row row;
  row.prompt = std::move(prompt);
  row.resident = resident;
  row.seated = seated;
  rows.push_back(std::move(row));
  context.activeBatchSize = static_cast<int32_t>(rows.size());
}

void FacadeDriver::popRow() {
  (void)mRig.runtime().residentSlots().release(rows.back().resident);
  rows.pop_back();
  context.rawBatchedInputIds.pop_back();
  context.residentRefs.pop_back();
  context.generatedTokenIds.pop_back();
  context.finishReasons.pop_back();
  context.effectivePrefillLengths.pop_back();
  context.activeBatchSize = static_cast<int32_t>(rows.size());
}

void FacadeDriver::add(std::vector<int32_t> prompt) {
  ResidentRef const resident = mRig.runtime().residentSlots().acquire().value();
  appendRow(std::move(prompt), resident, true);
  request.requests.emplace_back();
}

bool FacadeDriver::begin() {
  KVCacheRuntime& runtime = mRig.runtime();
  managed.reset();
  std::optional<ManagedKVCacheRequest> begun = ManagedKVCacheRequest::begin(
      runtime.contextCache(), runtime.swaPageManager(), request, context, false, kVanilla,
      DecodingTokenStateContract::kCommittedPlusLookahead, request.contextCacheCommitPolicy);
  if (!begun) {
    return false;
  }
  managed.emplace(std::move(*begun));
  std::vector<int32_t> const* starts = managed->prefillStarts();
  context.effectivePrefillLengths.clear();
  for (std::size_t i = 0; i < rows.size(); ++i) {
    rows[i].prefillStart = starts != nullptr ? (*starts)[i] : 0;
    context.effectivePrefillLengths.push_back(static_cast<int32_t>(rows[i].prompt.size()) -
                                              rows[i].prefillStart);
  }
  return true;
}

bool FacadeDriver::preparePrefill() {
  return facade().preparePrefill() && facade().prepareSwaPrefill(context.effectivePrefillLengths);
}

void FacadeDriver::writeLength(std::size_t row) {
  int32_t const length[1] = {rows[row].materialized};
  for (KVCachePool* pool : {mRig.runtime().fullPool(), mRig.runtime().swaPool()}) {
    if (pool != nullptr) {
      pool->writeLengths(static_cast<int32_t>(row), length, context.stream);
    }
  }
}

void FacadeDriver::sample(std::size_t row) {
  Row& r = rows[row];
  auto const token = static_cast<int32_t>(1000 + r.digests.at(r.digests.size() - 1) % 30000);
  context.generatedTokenIds[row].push_back(token);
  r.digests.extendTokens(std::span<int32_t const>(&token, 1));
}

void FacadeDriver::executeRowPrefill(std::size_t row) {
  Row& r = rows[row];
  auto const length = static_cast<int32_t>(r.prompt.size());
  r.digests = testing::PrefixDigests();
  r.digests.extendTokens(r.prompt);
  if (mFullOracle) {  // bounded SWA keeps full layers in an identity-mapped pool: no reuse there
    mFullOracle->write(r.resident.slot, r.digests, mRig.boundedSwa() ? 0 : r.prefillStart, length);
  }
  if (mSwaOracle) {
    // Bounded SWA maps the last window only; sliding-window reuse every executed position (its
    // prompt blocks are published for later hits).
    int32_t const from = mRig.slidingReuse() ? r.prefillStart : std::max(0, length - kWindowTokens);
    mSwaOracle->write(r.resident.slot, r.digests, from, length);
  }
  r.materialized = length;
  writeLength(row);
  sample(row);
}

void FacadeDriver::executePrefill() {
  for (std::size_t i = 0; i < rows.size(); ++i) {
    executeRowPrefill(i);
  }
}

bool FacadeDriver::completePrefill() { return facade().completePrefill(context, {}); }

bool FacadeDriver::prefill() {
  if (!preparePrefill()) {
    return false;
  }
  executePrefill();
  return completePrefill();
}

bool FacadeDriver::prepareDecode() {
  if (!facade().prepareDecodeStep(context, kVanilla)) {
    return false;
  }
  executeDecode();
  return true;
}

void FacadeDriver::executeDecode() {
  for (std::size_t i = 0; i < rows.size(); ++i) {
    Row& r = rows[i];
    if (!r.seated || context.finishReasons[i] != FinishReason::kNotFinished) {
      continue;
    }
    int32_t const position = r.materialized;
    for (testing::KvOracle* oracle : {mFullOracle.get(), mSwaOracle.get()}) {
      if (oracle != nullptr) {
        oracle->write(r.resident.slot, r.digests, position, position + 1);
      }
    }
    r.materialized = position + 1;
    writeLength(i);
    sample(i);
  }
}

bool FacadeDriver::completeDecode() { return facade().completeDecodeStep(context, {}); }

bool FacadeDriver::decode() { return prepareDecode() && completeDecode(); }

void FacadeDriver::cancel(std::size_t row) {
  context.finishReasons[row] = FinishReason::kCancelled;
}

void FacadeDriver::finishRow(std::size_t row) {
  context.finishReasons[row] = FinishReason::kLength;
}

bool FacadeDriver::compact(std::vector<int32_t> const& oldToNew) {
  auto const survivors = static_cast<int32_t>(
      std::count_if(oldToNew.begin(), oldToNew.end(), [](int32_t d) { return d >= 0; }));
  if (!facade().beginBatchCompaction(oldToNew, survivors, deviceMapping) ||
      !facade().completeBatchCompaction(oldToNew)) {
    return false;
  }
  compactView(oldToNew);
  return true;
}

void FacadeDriver::compactView(std::vector<int32_t> const& oldToNew) {
  DecodingInferenceContext next;
  next.stream = context.stream;
  next.loraWeightsName = context.loraWeightsName;
  std::vector<Row> kept;
  std::vector<LLMGenerationRequest::Sequence> sequences;
  for (std::size_t i = 0; i < oldToNew.size(); ++i) {
    if (oldToNew[i] < 0) {
      (void)mRig.runtime().residentSlots().release(rows[i].resident);
      continue;
    }
    next.rawBatchedInputIds.push_back(context.rawBatchedInputIds[i]);
    next.effectivePrefillLengths.push_back(context.effectivePrefillLengths[i]);
    next.generatedTokenIds.push_back(context.generatedTokenIds[i]);
    next.residentRefs.push_back(context.residentRefs[i]);
    next.finishReasons.push_back(context.finishReasons[i]);
    kept.push_back(std::move(rows[i]));
    if (i < request.requests.size()) {
      sequences.push_back(request.requests[i]);
    }
  }
  next.activeBatchSize = static_cast<int32_t>(kept.size());
  context = std::move(next);
  rows = std::move(kept);
  request.requests = std::move(sequences);
}

AdmitSequenceStatus FacadeDriver::admit(std::vector<int32_t> prompt,
                                        LLMGenerationRequest const* joiner) {
  ResidentSlotPool& slots = mRig.runtime().residentSlots();
  ResidentRef const resident = slots.acquire().value();
  int32_t start = -1;
  AdmitSequenceStatus status{};
  try {
    status = joiner != nullptr ? facade().admitSequence(*joiner, prompt, kVanilla, start, resident,
                                                        context.stream)
                               : facade().admitSequence(prompt, context.loraWeightsName, kVanilla,
                                                        start, resident, context.stream);
  } catch (...) {
    (void)slots.release(resident);
    throw;
  }
  if (status != AdmitSequenceStatus::kAdmitted) {
    (void)slots.release(resident);
    return status;
  }
  appendRow(std::move(prompt), resident, false);
  rows.back().prefillStart = start;
  context.effectivePrefillLengths.push_back(static_cast<int32_t>(rows.back().prompt.size()) -
                                            start);
  return status;
}

bool FacadeDriver::seatNewest() {
  std::size_t const row = rows.size() - 1;
  for (KVCachePool* pool : {mRig.runtime().fullPool(), mRig.runtime().swaPool()}) {
    if (pool != nullptr) {
      pool->setActiveBatchSize(static_cast<int32_t>(rows.size()));
    }
  }
  executeRowPrefill(row);
  rows[row].seated = true;
  return facade().finalizeSequenceAdmission(static_cast<int32_t>(row),
                                            context.generatedTokenIds[row].back(),
                                            static_cast<int32_t>(rows[row].prompt.size()));
}

bool FacadeDriver::retractNewest() {
  bool const retracted = facade().retractSequenceAdmission();
  if (retracted) {
    popRow();
  }
  return retracted;
}

bool FacadeDriver::finish() { return facade().finish(); }

void FacadeDriver::verify() const {
  bool allSeated = true;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    Row const& r = rows[i];
    allSeated = allSeated && r.seated;
    if (!r.seated || context.finishReasons[i] != FinishReason::kNotFinished) {
      continue;
    }
    if (mFullOracle) {
      testing::OracleReport const report =
          mFullOracle->verify(r.resident.slot, r.digests, 0, r.materialized);
      EXPECT_TRUE(report.ok()) << "row " << i << ", full layers: " << report.firstMismatch;
      EXPECT_EQ(report.positionsChecked, r.materialized);
    }
    if (mSwaOracle) {
      int32_t const from = std::max(0, r.materialized - kWindowTokens);
      testing::OracleReport const report =
          mSwaOracle->verify(r.resident.slot, r.digests, from, r.materialized);
      EXPECT_TRUE(report.ok()) << "row " << i << ", sliding layers: " << report.firstMismatch;
      EXPECT_EQ(report.positionsChecked, r.materialized - from);
    }
  }
  if (!allSeated) {
    return;  // an unseated joiner's KV length is written when it is seated
  }
  KVCacheRuntime& runtime = mRig.runtime();
  for (KVCachePool const* pool : {runtime.fullPool(), runtime.swaPool()}) {
    if (pool == nullptr) {
      continue;
    }
    std::vector<int32_t> expected;
    for (Row const& r : rows) {
      expected.push_back(r.materialized);
    }
    EXPECT_EQ(activeLengths(*pool), expected) << "device KV lengths";
  }
}

}  // namespace mkv::runtime_test
