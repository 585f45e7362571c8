#include "mkv/bounded_swa_kv_page_manager.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <bit>
#include <exception>
#include <limits>
#include <utility>

#include "core/check.h"
#include "core/device.h"
#include "core/faults.h"
#include "mkv/logging.h"
#include "resources/backend_requests.h"
#include "resources/device_write_queue.h"
#include "resources/request_registry.h"
#include "swa/bounded_swa_kv_page_manager_internal.h"

namespace mkv {

using swa_detail::ceilDiv;
using swa_detail::dropAppendedBindings;
using swa_detail::pagesCovering;
using swa_detail::retainedBeginFor;

// ---------------------------------------------------------------- construction

int32_t BoundedSwaKVPageManager::windowPages(int32_t windowTokens, int32_t tokensPerPage) {
  MKV_REQUIRE(windowTokens > 0 && tokensPerPage > 0, "BoundedSwaKVPageManager::windowPages",
              "window {} and page size {} must be positive", windowTokens, tokensPerPage);
  return ceilDiv(windowTokens, tokensPerPage) + 1;
}

int32_t BoundedSwaKVPageManager::admissionPagesPerSequence(int32_t windowTokens,
                                                           int32_t tokensPerPage) {
  return 2 * windowPages(windowTokens, tokensPerPage) + 1;
}

int32_t BoundedSwaKVPageManager::decodePagesPerSequence(int32_t windowTokens,
                                                        int32_t tokensPerPage) {
  return windowPages(windowTokens, tokensPerPage) + 1;
}

BoundedSwaKVPageManager::BoundedSwaKVPageManager(BoundedSwaConfig const& config,
                                                 BoundedSwaResources resources, cudaStream_t stream,
                                                 StreamSynchronizer synchronizer,
                                                 FaultInjector faults)
    : mWindow(config.windowTokens),
      mResources(std::move(resources)),
      mStream(stream),
      mSynchronizer(std::move(synchronizer)),
      mRequests(std::make_unique<detail::RequestRegistry<Request>>("BoundedSwaKVPageManager")) {
  constexpr char const* kCall = "BoundedSwaKVPageManager";
  MKV_REQUIRE(mResources.swaPool != nullptr && mResources.swaPageTable != nullptr, kCall,
              "swaPool and swaPageTable are required");
  KVCachePool const& pool = *mResources.swaPool;
  KVPageTable const& table = *mResources.swaPageTable;
  MKV_REQUIRE(mWindow > 0, kCall, "windowTokens must be positive, got {}", mWindow);
  mPageSize = pool.tokensPerPage();
  MKV_ASSERT(std::has_single_bit(static_cast<uint32_t>(mPageSize)),
             "pool page size {} is not a power of two", mPageSize);
  mPageShift = std::countr_zero(static_cast<uint32_t>(mPageSize));
  mWindowPages = windowPages(mWindow, mPageSize);
  mAdmissionPages = 2 * mWindowPages + 1;
  mDecodePages = mWindowPages + 1;
  MKV_REQUIRE(table.mode() == PageTableMode::kSparseWindow, kCall,
              "the SWA page table must be in sparse-window mode");
  MKV_REQUIRE(table.numPages() == pool.numPages(), kCall,
              "page table addresses {} pages but the SWA pool has {}", table.numPages(),
              pool.numPages());
  MKV_REQUIRE(table.deviceType() == pool.deviceType(), kCall, "table on {} but pool on {}",
              toString(table.deviceType()), toString(pool.deviceType()));
  MKV_REQUIRE(pool.numPages() >= mAdmissionPages, kCall,
              "the SWA pool has {} pages, fewer than one sequence's admission budget 2M+1 = {}",
              pool.numPages(), mAdmissionPages);
  for (KVCachePool const* lengths : mResources.lengthPools) {
    MKV_REQUIRE(lengths != nullptr, kCall, "null length pool");
    MKV_REQUIRE(lengths->maxBatchSize() >= table.maxBatch(), kCall,
                "a length pool holds {} rows but the table has {}", lengths->maxBatchSize(),
                table.maxBatch());
    MKV_REQUIRE(lengths->deviceType() == pool.deviceType(), kCall,
                "length pool on {} but SWA pool on {}", toString(lengths->deviceType()),
                toString(pool.deviceType()));
  }
  if (mResources.recurrent != nullptr) {
    MKV_REQUIRE(mResources.recurrent->numSlots() >= table.maxBatch(), kCall,
                "recurrent pool has {} slots but the table has {} rows",
                mResources.recurrent->numSlots(), table.maxBatch());
  }
  mSynchronizer = detail::withSyncFaults(
      mSynchronizer ? std::move(mSynchronizer) : defaultStreamSynchronizer(pool.deviceType()),
      faults);
  if (mResources.pageSource != nullptr) {
    MKV_REQUIRE(mResources.pageSource->totalPages() == pool.numPages(), kCall,
                "the page source has {} pages but the SWA pool has {}",
                mResources.pageSource->totalPages(), pool.numPages());
  } else {
    mFreePages.reserve(static_cast<std::size_t>(pool.numPages()));
    for (PageId page = pool.numPages() - 1; page >= 0; --page) {
      mFreePages.push_back(page);  // pop_back hands out the lowest id first
    }
  }
  mResidentBusy.assign(static_cast<std::size_t>(table.maxBatch()), 0);
  mDroppedSlots.reserve(static_cast<std::size_t>(table.maxBatch()));
  mWrites = mResources.deviceWrites;
  if (mWrites == nullptr) {
    mOwnedWrites = std::make_unique<detail::DeviceWriteQueue>(
        pool.deviceType(), DeviceWriteTiming::kEachCall, std::move(faults));
    mWrites = mOwnedWrites.get();
  }
  mWrites->watch(mResources.swaPageTable);
  for (KVCachePool* lengths : mResources.lengthPools) {
    mWrites->watch(lengths);
  }
  mMappingUploads = std::make_unique<detail::Int32UploadRegions>(table.maxBatch(), table.maxBatch(),
                                                                 pool.deviceType());
}

// The registry's destructor terminates when requests are still active or quarantined.
BoundedSwaKVPageManager::~BoundedSwaKVPageManager() = default;

// ---------------------------------------------------------------- observers

int32_t BoundedSwaKVPageManager::totalPageCount() const noexcept {
  return mResources.swaPool->numPages();
}

bool BoundedSwaKVPageManager::poisoned() const noexcept { return mRequests->poisoned(); }

int32_t BoundedSwaKVPageManager::quarantinedRequestCount() const noexcept {
  return static_cast<int32_t>(mRequests->quarantined().size());
}

int32_t BoundedSwaKVPageManager::quarantinedPageCount() const noexcept {
  int32_t count = 0;
  for (auto const& request : mRequests->quarantined()) {
    for (auto const& state : request->sequences) {
      count += state.heldPages();
    }
  }
  return count;
}

ResidentRowState BoundedSwaKVPageManager::residentRowState(CacheSlot slot) const noexcept {
  if (slot < 0 || static_cast<std::size_t>(slot) >= mResidentBusy.size() ||
      mResidentBusy[static_cast<std::size_t>(slot)] == 0) {
    return ResidentRowState::kFree;
  }
  return mRequests->quarantineHolds(slot) ? ResidentRowState::kQuarantined
                                          : ResidentRowState::kActive;
}

int32_t BoundedSwaKVPageManager::activeRequestCount() const noexcept {
  return static_cast<int32_t>(mRequests->active().size());
}

BoundedSwaKVPageManager::Request& BoundedSwaKVPageManager::request(RequestHandle const& handle,
                                                                   char const* call) const {
  MKV_REQUIRE(handle.mOwner == this, call, "the request handle is {}",
              handle.mOwner == nullptr ? "invalid" : "from another manager");
  Request* const live = mRequests->find(handle.mId);
  if (live == nullptr) {
    detail::throwContract(call, "request {} is not active", handle.mId);
  }
  return *live;
}

int32_t BoundedSwaKVPageManager::batchSize(RequestHandle const& handle) const {
  return static_cast<int32_t>(
      request(handle, "BoundedSwaKVPageManager::batchSize").sequences.size());
}

SwaSequenceState const& BoundedSwaKVPageManager::state(RequestHandle const& handle,
                                                       int32_t row) const {
  Request const& req = request(handle, "BoundedSwaKVPageManager::state");
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < req.sequences.size(),
              "BoundedSwaKVPageManager::state", "row {} outside the batch of {}", row,
              req.sequences.size());
  return req.sequences[static_cast<std::size_t>(row)];
}

// ---------------------------------------------------------------- admission

void BoundedSwaKVPageManager::validateResidents(char const* call,
                                                std::span<ResidentRef const> residents,
                                                cudaStream_t stream) const {
  MKV_REQUIRE(stream == mStream, call, "stream {} differs from the construction stream {}",
              fmt::ptr(stream), fmt::ptr(mStream));
  int32_t const maxBatch = mResources.swaPageTable->maxBatch();
  MKV_REQUIRE(!residents.empty() && residents.size() <= static_cast<std::size_t>(maxBatch), call,
              "batch of {} residents outside [1, {}]", residents.size(), maxBatch);
  std::vector<uint8_t> seen(static_cast<std::size_t>(maxBatch), 0);
  for (std::size_t i = 0; i < residents.size(); ++i) {
    detail::validateResident(call, i, residents[i], maxBatch, mResources.residentSlots, seen);
  }
}

bool BoundedSwaKVPageManager::residentsAvailable(char const* call,
                                                 std::span<ResidentRef const> residents) const {
  // Poisoned first: a quarantined request still holds its residents, and the runtime may have
  // handed one of those slots out again; that is the poisoned outcome, not a contract error.
  if (mRequests->poisoned()) {
    return false;
  }
  for (ResidentRef const ref : residents) {
    detail::requireResidentFree(call, ref.slot, mResidentBusy);
  }
  return true;
}

std::unique_ptr<BoundedSwaKVPageManager::Request> BoundedSwaKVPageManager::newRequest(
    std::span<ResidentRef const> residents, std::span<int32_t const> pagesPerSequence) {
  auto created = std::make_unique<Request>();
  created->id = mRequests->nextId();
  // In-flight joiners never move the rows (a state reference stays valid).
  created->sequences.reserve(static_cast<std::size_t>(mResources.swaPageTable->maxBatch()));
  created->sequences.resize(residents.size());
  // A compaction's mapping never allocates: a composed request begins this half's compaction
  // after the other half's, which it could not undo.
  created->mapping.reserve(static_cast<std::size_t>(mResources.swaPageTable->maxBatch()));
  // A sequence never holds more than its admission pages, so with these capacities no
  // transition, completion or release allocates (only bindings, a deque, may).
  for (std::size_t i = 0; i < residents.size(); ++i) {
    SwaSequenceState& state = created->sequences[i];
    auto const pages = static_cast<std::size_t>(pagesPerSequence[i]);
    state.resident = residents[i];
    state.reservedPages.reserve(pages);
    state.newBindings.reserve(pages);
    state.pendingRetire.reserve(pages);
  }
  mRequests->reserveAdmission();  // publish and a later quarantine never allocate
  return created;
}

BoundedSwaKVPageManager::BeginRequestResult BoundedSwaKVPageManager::publishRequest(
    std::unique_ptr<Request> created) noexcept {
  for (SwaSequenceState const& state : created->sequences) {
    mResidentBusy[static_cast<std::size_t>(state.resident.slot)] = 1;
  }
  uint64_t const id = mRequests->publish(std::move(created));
  BeginRequestResult result;
  result.status = SwaKVCacheStatus::kOk;
  result.request = RequestHandle(this, id);
  return result;
}

BoundedSwaKVPageManager::BeginRequestResult BoundedSwaKVPageManager::beginRequest(
    std::span<ResidentRef const> residents, cudaStream_t stream) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::beginRequest";
  MKV_REQUIRE(mResources.pageSource == nullptr, kCall,
              "the manager takes its pages from a page source: admit the {} residents with one "
              "SwaReuseStart each",
              residents.size());
  validateResidents(kCall, residents, stream);
  BeginRequestResult result;
  if (!residentsAvailable(kCall, residents)) {
    result.status = SwaKVCacheStatus::kPoisoned;
    return result;
  }
  auto const needed = static_cast<std::size_t>(mAdmissionPages) * residents.size();
  if (needed > mFreePages.size()) {
    result.status = SwaKVCacheStatus::kRequestFailed;
    return result;
  }
  std::vector<int32_t> const pages(residents.size(), mAdmissionPages);
  std::unique_ptr<Request> created = newRequest(residents, pages);
  // Nothing below throws: take the pages and publish the request.
  for (auto& state : created->sequences) {
    for (int32_t p = 0; p < mAdmissionPages; ++p) {
      state.reservedPages.push_back(mFreePages.back());
      mFreePages.pop_back();
    }
  }
  return publishRequest(std::move(created));
}

// ---------------------------------------------------------------- window transitions

void BoundedSwaKVPageManager::appendBindings(SwaSequenceState& state, int32_t newEndpoint,
                                             char const* call) const {
  MKV_ASSERT(!state.pendingEndpoint.has_value(), "{}: a transition is already staged", call);
  MKV_ASSERT(newEndpoint >= state.endpoint, "{}: endpoint would move back from {} to {}", call,
             state.endpoint, newEndpoint);
  int32_t const newEnd = pagesCovering(newEndpoint, mPageShift);
  if (newEnd == state.retainedEnd && !state.bindings.empty()) {
    return;  // most decode steps: the endpoint moves inside its last page, nothing maps
  }
  int32_t const newBegin = retainedBeginFor(newEndpoint, mWindow, mPageShift);
  int32_t const firstUnbound =
      state.bindings.empty() ? newBegin : state.bindings.back().logicalPage + 1;
  int32_t const mapFrom = std::max(newBegin, firstUnbound);
  int32_t const toMap = std::max(0, newEnd - mapFrom);
  MKV_ASSERT(toMap <= static_cast<int32_t>(state.reservedPages.size()),
             "{}: slot {} needs {} pages but holds {} in reserve", call, state.resident.slot, toMap,
             state.reservedPages.size());
  MKV_ASSERT(state.newBindings.empty(), "{}: slot {} has bindings of an earlier transition", call,
             state.resident.slot);
  for (int32_t logical = mapFrom; logical < newEnd; ++logical) {
    SwaPageBinding const binding{logical, state.reservedPages.back()};
    state.bindings.push_back(binding);     // may allocate; the lists below keep in step with it
    state.newBindings.push_back(binding);  // capacity reserved at admission
    state.reservedPages.pop_back();
  }
}

void BoundedSwaKVPageManager::commitWindow(SwaSequenceState& state,
                                           int32_t newEndpoint) const noexcept {
  int32_t const newBegin = retainedBeginFor(newEndpoint, mWindow, mPageShift);
  while (!state.bindings.empty() && state.bindings.front().logicalPage < newBegin) {
    state.pendingRetire.push_back(state.bindings.front());  // capacity reserved at admission
    state.bindings.pop_front();
  }
  state.pendingEndpoint = newEndpoint;
  state.retainedBegin = newBegin;
  state.retainedEnd = pagesCovering(newEndpoint, mPageShift);
}

RowFailureReason BoundedSwaKVPageManager::stageDecode(SwaSequenceState& state) {
  if (state.endpoint == std::numeric_limits<int32_t>::max()) {
    return RowFailureReason::kTableFull;
  }
  int32_t const next = state.endpoint + 1;
  int32_t const newEnd = pagesCovering(next, mPageShift);
  if (newEnd > mResources.swaPageTable->maxPagesPerSeq()) {
    return RowFailureReason::kTableFull;
  }
  bool const needsPage = newEnd > state.retainedEnd;
  return !needsPage || !state.reservedPages.empty() || takeSpare(state)
             ? RowFailureReason::kNone
             : RowFailureReason::kNoCapacity;
}

void BoundedSwaKVPageManager::mapNewBindings(SwaSequenceState const& state) {
  for (SwaPageBinding const& binding : state.newBindings) {
    mResources.swaPageTable->setEntry(state.resident.slot, binding.logicalPage, binding.page);
  }
}

void BoundedSwaKVPageManager::retire(SwaSequenceState& state) {
  MKV_ASSERT(state.pendingEndpoint.has_value(), "retire without a staged transition (slot {})",
             state.resident.slot);
  for (SwaPageBinding const& binding : state.pendingRetire) {
    mResources.swaPageTable->clearEntry(state.resident.slot, binding.logicalPage);
    if (mResources.pageSource != nullptr) {
      mResources.pageSource->release(binding.page);  // completion point passed
    } else {
      state.reservedPages.push_back(binding.page);
    }
  }
  state.pendingRetire.clear();
  state.newBindings.clear();
  state.endpoint = *state.pendingEndpoint;
  state.pendingEndpoint.reset();
  if (state.reservedPages.empty()) {
    (void)takeSpare(state);  // cached mode; on failure the next step that needs a page retries
  }
}

// ---------------------------------------------------------------- lifecycle

void BoundedSwaKVPageManager::requirePrefillInputs(char const* call, Request const& req,
                                                   std::span<int32_t const> inputLengths) const {
  MKV_REQUIRE(req.stage == RequestStage::kAdmitted, call,
              "prefill was already prepared for this request");
  MKV_REQUIRE(inputLengths.size() == req.sequences.size(), call, "{} lengths for a batch of {}",
              inputLengths.size(), req.sequences.size());
  int64_t const maxTokens = int64_t{mResources.swaPageTable->maxPagesPerSeq()} * mPageSize;
  for (std::size_t i = 0; i < inputLengths.size(); ++i) {
    MKV_REQUIRE(inputLengths[i] > 0 && inputLengths[i] <= maxTokens, call,
                "length {} of row {} outside (0, {}]", inputLengths[i], i, maxTokens);
  }
  for (std::size_t i = 0; i < req.promptTokens.size(); ++i) {  // cached mode
    MKV_REQUIRE(inputLengths[i] == req.promptTokens[i], call,
                "length {} of row {} differs from its admitted promptTokens {}", inputLengths[i], i,
                req.promptTokens[i]);
  }
  // The KV-length tensors are execution-ordered for one batch: resetting them for this request
  // would overwrite the lengths another active request's kernels read.
  // A request that left (finished, abandoned, quarantined) no longer owns them.
  uint64_t const owner = mRequests->find(mLengthOwner) != nullptr ? mLengthOwner : 0;
  MKV_REQUIRE(mResources.lengthPools.empty() || owner == 0 || owner == req.id, call,
              "the KV-length pools follow request {}, still active; request {} cannot reset them",
              owner, req.id);
}

void BoundedSwaKVPageManager::checkLengthPoolsFree(RequestHandle const& handle,
                                                   char const* call) const {
  Request const& req = request(handle, call);
  uint64_t const owner = mRequests->find(mLengthOwner) != nullptr ? mLengthOwner : 0;
  MKV_REQUIRE(mResources.lengthPools.empty() || owner == 0 || owner == req.id, call,
              "the KV-length pools follow request {}, still active; request {} cannot reset them",
              owner, req.id);
}

void BoundedSwaKVPageManager::preparePrefill(RequestHandle& handle,
                                             std::span<int32_t const> inputLengths) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::preparePrefill";
  Request& req = request(handle, kCall);
  requirePrefillInputs(kCall, req, inputLengths);
  bool const cached = mResources.pageSource != nullptr;
  // Whatever can fail comes first and is undone on failure: the request stays admitted.
  // The length rows start at the tokens whose KV exists: 0, or a cached sequence's start.
  std::vector<int32_t> startLengths(req.sequences.size());
  try {
    for (std::size_t i = 0; i < inputLengths.size(); ++i) {
      startLengths[i] = req.sequences[i].endpoint;
      if (cached) {
        appendPromptBindings(req.sequences[i], inputLengths[i]);
      } else {
        appendBindings(req.sequences[i], inputLengths[i], kCall);
      }
    }
  } catch (...) {
    for (SwaSequenceState& state : req.sequences) {
      dropAppendedBindings(state);
    }
    throw;
  }
  for (std::size_t i = 0; i < inputLengths.size(); ++i) {
    SwaSequenceState& state = req.sequences[i];
    mResources.swaPageTable->clearRow(state.resident.slot);
    if (cached) {
      stagePrompt(state, inputLengths[i]);
    } else {
      commitWindow(state, inputLengths[i]);
      mapNewBindings(state);
    }
  }
  // The rows and every pool's lengths in one launch, now or at the engine's step (a launch
  // costs the engine thread 1-5 µs: docs/benchmarks.md, "What one launch costs the engine thread").
  mWrites->settleAfter(mStream, [&] {
    for (KVCachePool* lengths : mResources.lengthPools) {
      lengths->resetForNewSequences(startLengths, mWrites->lengths(), mStream);
    }
  });
  if (!mResources.lengthPools.empty()) {
    mLengthOwner = req.id;
  }
  req.stage = RequestStage::kPrefilling;
  req.writesMark = mWrites->awaitingFlush();
}

void BoundedSwaKVPageManager::completePrefill(RequestHandle& handle,
                                              std::span<uint8_t const> held) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::completePrefill";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling, kCall, "no prepared prefill to complete");
  MKV_REQUIRE(
      held.empty() || (mResources.pageSource != nullptr && held.size() == req.sequences.size()),
      kCall, "{} held flags for a batch of {} ({}): only cached mode holds a founder's prefill",
      held.size(), req.sequences.size(),
      mResources.pageSource != nullptr ? "cached mode" : "no page source");
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    SwaSequenceState const& state = req.sequences[row];
    MKV_REQUIRE(state.joining || state.joinerPromptTokens == 0 ||
                    state.pendingEndpoint == state.joinerPromptTokens,
                kCall,
                "row {}: its first chunk to {} was prepared (prepareSequenceChunk) but not "
                "completed (completeSequenceChunk)",
                row, state.pendingEndpoint.value_or(state.endpoint));
  }
  checkPreparedWritesOnDevice(handle, kCall);
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    SwaSequenceState& state = req.sequences[row];
    if (!held.empty() && held[row] != 0) {
      // Its prompt stays staged and mapped, as a cached-mode joiner's from admission.
      state.joining = true;
      state.joinerPromptTokens = *state.pendingEndpoint;
      continue;
    }
    if (state.joining) {
      continue;  // a founder's first chunk completed (completeSequenceChunk): a joiner from here
    }
    state.joinerPromptTokens = 0;  // a first chunk prepared to the whole prompt again
    if (mResources.pageSource != nullptr) {
      completeCachedPrefill(state);
    } else {
      retire(state);
      // Beyond the reference: decode needs at most M + 1 held pages; return the surplus.
      while (state.heldPages() > mDecodePages && !state.reservedPages.empty()) {
        mFreePages.push_back(state.reservedPages.back());
        state.reservedPages.pop_back();
      }
    }
    MKV_ASSERT(!state.reservedPages.empty() && state.heldPages() <= mDecodePages,
               "slot {} holds {} pages after prefill ({} spare), the decode budget is {}",
               state.resident.slot, state.heldPages(), state.reservedPages.size(), mDecodePages);
  }
  req.stage = RequestStage::kSettled;
}

RowFailure BoundedSwaKVPageManager::lastFailure(RequestHandle const& handle) const noexcept {
  if (poisoned()) {
    return RowFailure{RowFailureReason::kPoisoned, -1};
  }
  Request const* const live = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  return live != nullptr ? live->failure : RowFailure{};
}

BoundedSwaKVPageManager::DecodeWalk BoundedSwaKVPageManager::walkDecodeStep(
    RequestHandle const& handle, char const* call) const {
  Request const& req = request(handle, call);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, call,
              "a decode step needs a completed prefill or step and no pending work");
  // As stageDecode, row by row: each row that needs a page and has no spare takes one from the
  // page source (without one: none).
  int64_t const available =
      mResources.pageSource != nullptr ? mResources.pageSource->availablePages() : 0;
  DecodeWalk walk;
  for (std::size_t i = 0; i < req.sequences.size(); ++i) {
    SwaSequenceState const& state = req.sequences[i];
    if (state.joining) {
      continue;
    }
    auto const row = static_cast<ExecutionRow>(i);
    auto keepFirst = [row](RowFailure& first, RowFailureReason reason) {
      if (first.reason == RowFailureReason::kNone) {
        first = RowFailure{reason, row};
      }
    };
    if (state.endpoint == std::numeric_limits<int32_t>::max() ||
        pagesCovering(state.endpoint + 1, mPageShift) > mResources.swaPageTable->maxPagesPerSeq()) {
      keepFirst(walk.tableFull, RowFailureReason::kTableFull);
      keepFirst(walk.failure, RowFailureReason::kTableFull);
      continue;
    }
    bool const needsPage = pagesCovering(state.endpoint + 1, mPageShift) > state.retainedEnd;
    if (needsPage && state.reservedPages.empty() && ++walk.sourcePages > available) {
      keepFirst(walk.failure, RowFailureReason::kNoCapacity);
    }
  }
  return walk;
}

RowFailure BoundedSwaKVPageManager::checkPrepareDecodeStep(RequestHandle const& handle,
                                                           char const* call) const {
  return walkDecodeStep(handle, call).failure;
}

DecodeStepDemand BoundedSwaKVPageManager::decodeStepDemand(RequestHandle const& handle) const {
  DecodeWalk const walk = walkDecodeStep(handle, "BoundedSwaKVPageManager::decodeStepDemand");
  DecodeStepDemand demand;
  demand.slidingPages = walk.sourcePages;
  demand.tableFull = walk.tableFull;
  return demand;
}

bool BoundedSwaKVPageManager::finishing(RequestHandle const& handle) const noexcept {
  Request const* const live = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  return live != nullptr && live->stage == RequestStage::kFinishing;
}

SwaKVCacheStatus BoundedSwaKVPageManager::prepareDecodeStep(RequestHandle& handle) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::prepareDecodeStep";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, kCall,
              "a decode step needs a completed prefill or step and no pending work");
  // An unfinalised joiner holds: its prefill is staged, not its next token. A row that cannot
  // stage fails alone: the request stays settled (spares taken by earlier rows stay theirs), and
  // the engine drops or preempts rows and prepares the step again, or finishes.
  for (SwaSequenceState& state : req.sequences) {
    RowFailureReason const failed = state.joining ? RowFailureReason::kNone : stageDecode(state);
    if (failed != RowFailureReason::kNone) {
      req.failure = RowFailure{failed, static_cast<ExecutionRow>(&state - req.sequences.data())};
      return SwaKVCacheStatus::kRequestFailed;
    }
  }
  try {
    for (SwaSequenceState& state : req.sequences) {
      if (!state.joining) {
        appendBindings(state, state.endpoint + 1, kCall);
      }
    }
  } catch (...) {
    for (SwaSequenceState& state : req.sequences) {
      if (!state.joining) {
        dropAppendedBindings(state);
      }
    }
    throw;
  }
  for (SwaSequenceState& state : req.sequences) {
    if (!state.joining) {
      commitWindow(state, state.endpoint + 1);
      mapNewBindings(state);
    }
  }
  mWrites->settle(mStream);
  req.stage = RequestStage::kDecoding;
  req.writesMark = mWrites->awaitingFlush();
  return SwaKVCacheStatus::kOk;
}

void BoundedSwaKVPageManager::completeDecodeStep(RequestHandle& handle) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::completeDecodeStep";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kDecoding, kCall, "no prepared decode step to complete");
  checkPreparedWritesOnDevice(handle, kCall);
  for (SwaSequenceState& state : req.sequences) {
    if (!state.joining) {
      retire(state);
    }
  }
  req.stage = RequestStage::kSettled;
}

void BoundedSwaKVPageManager::requireLengthBatch(char const* call, Request const& req) const {
  auto const rows = static_cast<int32_t>(req.sequences.size());
  for (KVCachePool const* pool : mResources.lengthPools) {
    MKV_REQUIRE(pool->activeBatchSize() == rows, call,
                "a KV-length tensor's active batch is {} but the request has {} rows",
                pool->activeBatchSize(), rows);
  }
}

void BoundedSwaKVPageManager::checkBeginBatchCompaction(RequestHandle const& handle,
                                                        std::span<int32_t const> oldToNew,
                                                        int32_t newBatchSize,
                                                        Tensor const& deviceMapping,
                                                        char const* call) const {
  Request const& req = request(handle, call);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, call,
              "compaction needs an executing request with no pending work");
  detail::validateCompactionMapping(call, oldToNew, req.sequences.size(), newBatchSize);
  requireLengthBatch(call, req);
  detail::validateDeviceMapping(call, deviceMapping, mResources.swaPool->deviceType(),
                                oldToNew.size());
}

void BoundedSwaKVPageManager::beginBatchCompaction(RequestHandle& handle,
                                                   std::span<int32_t const> oldToNew,
                                                   int32_t newBatchSize, Tensor& deviceMapping) {
  checkBeginBatchCompaction(handle, oldToNew, newBatchSize, deviceMapping,
                            "BoundedSwaKVPageManager::beginBatchCompaction");
  Request& req = request(handle, "BoundedSwaKVPageManager::beginBatchCompaction");
  auto const oldBatch = static_cast<int32_t>(req.sequences.size());
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
  req.stage = RequestStage::kCompacting;
}

void BoundedSwaKVPageManager::checkCompactBatch(RequestHandle const& handle,
                                                char const* call) const {
  Request const& req = request(handle, call);
  MKV_REQUIRE(req.stage == RequestStage::kCompacting, call, "no batch compaction was begun");
  requireLengthBatch(call, req);  // the engine may have resized a tensor since the begin
  // The device mapping is read only to compact the length pools.
  if (!mResources.lengthPools.empty()) {
    detail::requireDeviceMappingUnchanged(call, *req.deviceMapping,
                                          mResources.swaPool->deviceType(), req.mapping.size());
  }
}

void BoundedSwaKVPageManager::checkPreparedWritesOnDevice(RequestHandle const& handle,
                                                          char const* call) const {
  Request const& req = request(handle, call);
  if (req.stage == RequestStage::kPrefilling || req.stage == RequestStage::kDecoding) {
    mWrites->requireReachedDevice(call, req.writesMark);
  }
}

SwaKVCacheStatus BoundedSwaKVPageManager::compactBatch(RequestHandle& handle) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::compactBatch";
  checkCompactBatch(handle, kCall);
  Request& req = request(handle, kCall);
  // No allocation: the dropped slots' storage is reserved for every row.
  std::vector<CacheSlot>& dropped = mDroppedSlots;
  dropped.clear();
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    if (req.mapping[i] < 0) {
      dropped.push_back(req.sequences[i].resident.slot);
      mResources.swaPageTable->clearRow(req.sequences[i].resident.slot);
    }
  }
  // The length compaction below reads the lengths on the device: what waits goes first.
  if (mResources.lengthPools.empty()) {
    mWrites->settle(mStream);
  } else {
    mWrites->flush(mStream);
  }
  if (mResources.recurrent != nullptr && !dropped.empty()) {
    mResources.recurrent->clearResidentSlots(dropped, mStream);
  }
  for (KVCachePool* lengths : mResources.lengthPools) {
    lengths->compactLengths(*req.deviceMapping, req.newBatchSize, mStream);
  }
  if (!synchronize()) {
    return quarantineHandle(handle, req.id);
  }
  // Compacted in place by move assignment: moving a SwaSequenceState into new storage would
  // allocate (libstdc++'s std::deque move constructor does), assigning it does not.
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    if (req.mapping[i] < 0) {
      releaseSequence(req.sequences[i]);
    }
  }
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    auto const destination = static_cast<std::size_t>(req.mapping[i]);
    if (req.mapping[i] >= 0 && destination != i) {
      req.sequences[destination] = std::move(req.sequences[i]);
    }
  }
  req.sequences.erase(req.sequences.begin() + req.newBatchSize, req.sequences.end());
  req.mapping.clear();
  req.newBatchSize = -1;
  req.deviceMapping = nullptr;
  req.stage = req.sequences.empty() ? RequestStage::kFinishing : RequestStage::kSettled;
  return SwaKVCacheStatus::kOk;
}

SwaKVCacheStatus BoundedSwaKVPageManager::finish(RequestHandle& handle) {
  if (!handle.valid()) {
    return poisoned() ? SwaKVCacheStatus::kPoisoned : SwaKVCacheStatus::kOk;
  }
  uint64_t const id = request(handle, "BoundedSwaKVPageManager::finish").id;
  handle.invalidate();
  std::unique_ptr<Request> finished =
      mRequests->detachSettled(id, [this] { return synchronize(); });
  if (finished == nullptr ||
      !mRequests->release(
          std::move(finished), "finish", [this](Requests requests) { clearRows(requests); },
          [this](Request& req) { releaseRequest(req); })) {
    return SwaKVCacheStatus::kPoisoned;  // quarantined
  }
  return poisoned() ? SwaKVCacheStatus::kPoisoned : SwaKVCacheStatus::kOk;
}

SwaKVCacheStatus BoundedSwaKVPageManager::shutdown() noexcept {
  if (!mRequests->drainQuarantine(
          "shutdown", [this] { return synchronize(); },
          [this](Requests requests) { clearRows(requests); },
          [this](Request& req) { releaseRequest(req); })) {
    return SwaKVCacheStatus::kPoisoned;
  }
  return mRequests->active().empty() ? SwaKVCacheStatus::kOk : SwaKVCacheStatus::kRequestFailed;
}

// ---------------------------------------------------------------- internals

bool BoundedSwaKVPageManager::synchronize() noexcept {
  if (!detail::synchronizeStream(mSynchronizer, mStream, "BoundedSwaKVPageManager")) {
    mRequests->poison();
    return false;
  }
  return true;
}

void BoundedSwaKVPageManager::releasePage(PageId page) noexcept {
  if (mResources.pageSource != nullptr) {
    mResources.pageSource->release(page);
  } else {
    mFreePages.push_back(page);  // within the capacity reserved at construction
  }
}

void BoundedSwaKVPageManager::releaseSequence(SwaSequenceState& state) noexcept {
  for (SwaPageBinding const& binding : state.bindings) {
    releasePage(binding.page);
  }
  for (SwaPageBinding const& binding : state.pendingRetire) {
    releasePage(binding.page);
  }
  for (PageId page : state.reservedPages) {
    releasePage(page);
  }
  state.bindings.clear();
  state.pendingRetire.clear();
  state.reservedPages.clear();
  state.newBindings.clear();
  mResidentBusy[static_cast<std::size_t>(state.resident.slot)] = 0;
}

void BoundedSwaKVPageManager::clearRows(Requests requests) {
  for (auto const& req : requests) {
    for (SwaSequenceState const& state : req->sequences) {
      mResources.swaPageTable->clearRow(state.resident.slot);
    }
  }
  mWrites->settle(mStream);
}

void BoundedSwaKVPageManager::releaseRequest(Request& req) noexcept {
  for (SwaSequenceState& state : req.sequences) {
    releaseSequence(state);
  }
}

SwaKVCacheStatus BoundedSwaKVPageManager::quarantineHandle(RequestHandle& handle,
                                                           uint64_t id) noexcept {
  handle.invalidate();
  mRequests->quarantine(id);  // its pages stay held while device work may touch them
  return SwaKVCacheStatus::kPoisoned;
}

void BoundedSwaKVPageManager::abandon(uint64_t id) noexcept {
  mRequests->abandon(
      id, [this] { return synchronize(); }, [this](Requests requests) { clearRows(requests); },
      [this](Request& req) { releaseRequest(req); });
}

}  // namespace mkv
