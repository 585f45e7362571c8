// ContextCacheCoordinator, the request core: handle lookup and this backend's side of the shared
// request registry (src/resources/request_registry.h: synchronisation, clearing rows, freeing
// residents), construction, prefill, decode, compaction, finish and shutdown. What differs
// between kinds of request is the request's mode (request_mode.h); batch admission, in-flight
// admission and the checkpoint calls are the other parts (see the class's private section).

#include "mkv/context_cache/context_cache_coordinator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "context_cache/coordinator_deployment.h"
#include "context_cache/coordinator_host_tier.h"
#include "context_cache/coordinator_paged_rows.h"
#include "context_cache/coordinator_remote_tier.h"
#include "context_cache/coordinator_request.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/request_mode.h"
#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "core/device.h"
#include "core/faults.h"
#include "mkv/logging.h"
#include "resources/backend_requests.h"
#include "resources/device_write_queue.h"
#include "resources/request_registry.h"

namespace mkv {

using detail::isHold;
using detail::sequenceAt;

// ---------------------------------------------------------------- construction

ContextCacheCoordinator::ContextCacheCoordinator(ContextCacheConfig const& config,
                                                 ContextCacheDeploymentProfile const& profile,
                                                 ContextCachePhysicalResources resources,
                                                 cudaStream_t stream,
                                                 StreamSynchronizer synchronizer,
                                                 FaultInjector faults)
    : mConfig(config),
      mProfile(profile),
      mResources(resources),
      mStream(stream),
      mSynchronizer(std::move(synchronizer)),
      mFaults(std::move(faults)),
      mRequests(std::make_unique<detail::RequestRegistry<Request>>("ContextCacheCoordinator")),
      mWrites(resources.deviceWrites) {
  detail::DeploymentLayout const layout = detail::validateDeployment(config, profile, resources);
  mMaxBatch = layout.maxBatch;
  mDevice = layout.device;
  if (mWrites == nullptr) {
    mOwnedWrites =
        std::make_unique<detail::DeviceWriteQueue>(mDevice, DeviceWriteTiming::kEachCall, mFaults);
    mWrites = mOwnedWrites.get();
  }
  mWrites->watch(mResources.basePageTable);
  mWrites->watch(mResources.draftPageTable);
  mWrites->watch(mResources.basePool);
  mWrites->watch(mResources.draftPool);
  mSynchronizer = detail::withSyncFaults(
      mSynchronizer ? std::move(mSynchronizer) : defaultStreamSynchronizer(mDevice), mFaults);
  ContextCacheManagerOptions options;
  options.verifyTokens = config.verifyTokens;
  options.eventQueueCapacity = config.eventQueueCapacity;
  options.specContract = profile.speculative;
  options.evictionPolicy = config.evictionPolicy;
  options.retentionClock = config.retentionClock;
  if (resources.hostTier != nullptr) {
    options.hostTierPages = resources.hostTier->numPages();
    options.hostTierBytesPerPage = resources.hostTier->bytesPerPage();
    options.mirrorPublishedBlocks = config.remoteTier && config.remoteTier->saveBlocks;
  }
  options.windowCache = resources.windowCache;
  mManager = std::make_unique<ContextCacheManager>(layout.blockTokens, layout.capacities,
                                                   config.enabled ? config.maxRecords : 0, options);
  if (layout.checkpoints) {
    mSnapshots = std::make_unique<SnapshotStorage>(layout.snapshots, resources.recurrent,
                                                   resources.basePool, layout.snapshotDraftPool);
  }
  mLimits = std::make_unique<detail::AdmissionLimits>(layout.limits);
  mLimits->residentSlots = resources.residentSlots;
  mHostTier = std::make_unique<detail::HostTierMover>(*mManager, resources.hostTier, mStream,
                                                      mCounters, [this] { poison(); });
  if (config.remoteTier) {  // validated: a host tier and a base pool exist
    mRemoteTier = std::make_unique<detail::RemoteTierLink>(
        "ContextCacheCoordinator", *config.remoteTier, *mManager, *resources.hostTier,
        *resources.basePool);
    mHostTier->attachRemoteTier(mRemoteTier.get());
  }
  mParts = std::make_unique<detail::CoordinatorParts>(
      detail::CoordinatorParts{mConfig, *mManager, mSnapshots.get(), resources.recurrent, *mWrites,
                               mStream, mCounters, *mHostTier, mFaults});
  mModes =
      std::make_unique<detail::RequestModes>(detail::makeRequestModes(profile, resources, *mParts));
  mResidentBusy.assign(static_cast<std::size_t>(mMaxBatch), 0);
  mMappingUploads = std::make_unique<detail::Int32UploadRegions>(mMaxBatch, mMaxBatch, mDevice);
  if (resources.windowCache != nullptr && config.eventQueueCapacity > 0) {
    // The sliding pool's blocks are group 1 of the same event stream (docs/context_cache.md,
    // "KV events on the wire").
    resources.windowCache->announceTo(&mManager->eventQueue(),
                                      slidingWindowGroup(resources.windowCache->windowTokens()));
  }
}

// The registry's destructor terminates when requests are still active or quarantined.
ContextCacheCoordinator::~ContextCacheCoordinator() {
  WindowBlockCache* const window = mResources.windowCache;
  if (window != nullptr && window->announcedTo() == &mManager->eventQueue()) {
    window->announceTo(nullptr, {});  // the queue dies with the manager
  }
}

// ---------------------------------------------------------------- request registry

ContextCacheCoordinator::Request& ContextCacheCoordinator::request(RequestHandle const& handle,
                                                                   char const* call) const {
  MKV_REQUIRE(handle.mOwner == this, call, "the request handle is {}",
              handle.mOwner == nullptr ? "invalid" : "from another coordinator");
  Request* const live = mRequests->find(handle.mId);
  if (live == nullptr) {
    detail::throwContract(call, "request {} is not active", handle.mId);
  }
  return *live;
}

ContextCacheStatus ContextCacheCoordinator::quarantineHandle(RequestHandle& handle,
                                                             uint64_t id) noexcept {
  handle.invalidate();
  mRequests->quarantine(id);  // its pages and slots stay leased while device work may run
  countQuarantines();
  return ContextCacheStatus::kPoisoned;
}

void ContextCacheCoordinator::countQuarantines() noexcept {
  mCounters.quarantinedRequests = mRequests->quarantinedTotal();
}

bool ContextCacheCoordinator::synchronize() noexcept {
  ++mCounters.synchronizations;
  if (!detail::synchronizeStream(mSynchronizer, mStream, "ContextCacheCoordinator")) {
    poison();
    return false;
  }
  return true;
}

bool ContextCacheCoordinator::poisoned() const noexcept { return mRequests->poisoned(); }

void ContextCacheCoordinator::poison() noexcept { mRequests->poison(); }

int32_t ContextCacheCoordinator::activeRequestCount() const noexcept {
  return static_cast<int32_t>(mRequests->active().size());
}

int32_t ContextCacheCoordinator::quarantinedRequestCount() const noexcept {
  return static_cast<int32_t>(mRequests->quarantined().size());
}

void ContextCacheCoordinator::clearRows(Requests requests) {
  for (auto const& req : requests) {
    detail::PagedRows const table = req->mode->rows();
    for (auto const& sequence : req->sequences) {
      table.clearRow(sequence.resident.slot);
    }
  }
  if (!requests.empty()) {
    requests.back()->mode->rows().upload();  // one queue settles every lane's rows
  }
}

void ContextCacheCoordinator::releaseResidents(Request const& req) noexcept {
  for (auto const& sequence : req.sequences) {
    mResidentBusy[static_cast<std::size_t>(sequence.resident.slot)] = 0;
  }
}

void ContextCacheCoordinator::abandon(uint64_t id) noexcept {
  // An abandoned request publishes nothing, not even a frozen speculative prompt endpoint.
  mRequests->abandon(
      id, [this] { return synchronize(); }, [this](Requests requests) { clearRows(requests); },
      [this](Request& req) { releaseResidents(req); });
  countQuarantines();
}

void ContextCacheCoordinator::countPlanning(std::chrono::steady_clock::time_point start) noexcept {
  mCounters.planningNanoseconds += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
          .count());
}

// ---------------------------------------------------------------- observers

int32_t ContextCacheCoordinator::batchSize(RequestHandle const& handle) const {
  return static_cast<int32_t>(
      request(handle, "ContextCacheCoordinator::batchSize").sequences.size());
}

int32_t ContextCacheCoordinator::reuseTokenLength(RequestHandle const& handle,
                                                  ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::reuseTokenLength";
  return sequenceAt(request(handle, kCall), row, kCall).reuseTokenLength;
}

int32_t ContextCacheCoordinator::committedLength(RequestHandle const& handle,
                                                 ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::committedLength";
  return sequenceAt(request(handle, kCall), row, kCall).committed;
}

ContextCacheCommitPolicy ContextCacheCoordinator::commitPolicy(RequestHandle const& handle,
                                                               ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::commitPolicy";
  return sequenceAt(request(handle, kCall), row, kCall).commitPolicy;
}

std::span<PageId const> ContextCacheCoordinator::basePages(RequestHandle const& handle,
                                                           ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::basePages";
  return sequenceAt(request(handle, kCall), row, kCall).lease.basePages();
}

std::span<PageId const> ContextCacheCoordinator::draftPages(RequestHandle const& handle,
                                                            ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::draftPages";
  return sequenceAt(request(handle, kCall), row, kCall).lease.draftPages();
}

int32_t ContextCacheCoordinator::commonLength(RequestHandle const& handle, ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::commonLength";
  return sequenceAt(request(handle, kCall), row, kCall).common;
}

ResidentRowState ContextCacheCoordinator::residentRowState(CacheSlot slot) const noexcept {
  if (slot < 0 || static_cast<std::size_t>(slot) >= mResidentBusy.size() ||
      mResidentBusy[static_cast<std::size_t>(slot)] == 0) {
    return ResidentRowState::kFree;
  }
  return mRequests->quarantineHolds(slot) ? ResidentRowState::kQuarantined
                                          : ResidentRowState::kActive;
}

// ---------------------------------------------------------------- prefill

void ContextCacheCoordinator::preparePrefill(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::preparePrefill";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kAdmitted, kCall,
              "prefill was already prepared for this request");
  for (auto const& other : mRequests->active()) {
    MKV_REQUIRE(other.get() == &req ||
                    (!isExecuting(other->stage) && other->stage != RequestStage::kPrefilling),
                kCall, "request {} is executing; only one request may execute at a time",
                other->id);
  }
  req.mode->bindPrefill(req);
  req.stage = RequestStage::kPrefilling;
  req.writesMark = mWrites->awaitingFlush();
}

ContextCacheStatus ContextCacheCoordinator::finalizePrefillPublication(
    RequestHandle& handle, std::span<ContextCacheSequenceAdvance const> advances,
    std::span<int32_t const> commonStateLengths) {
  constexpr char const* kCall = "ContextCacheCoordinator::finalizePrefillPublication";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kPrefilling, kCall, "no prepared prefill to finalise");
  mWrites->requireReachedDevice(kCall, req.writesMark);
  MKV_REQUIRE(advances.size() == req.sequences.size(), kCall, "{} advances for a batch of {}",
              advances.size(), req.sequences.size());
  req.mode->validateCommonLengths(kCall, req.sequences.size(), commonStateLengths);
  for (std::size_t i = 0; i < advances.size(); ++i) {
    MKV_REQUIRE(req.sequences[i].joined, kCall, "row {} was admitted in flight", i);
    if (req.sequences[i].prefillHeld) {
      MKV_REQUIRE(detail::isHold(advances[i]), kCall,
                  "row {}: its prefill chunks stopped at {} of its {} prompt tokens, so it holds "
                  "(0 tokens, kHoldCommittedStateLength), got {} accepted / {} committed",
                  i, req.sequences[i].committed, req.sequences[i].promptLength,
                  advances[i].acceptedTokenCount, advances[i].committedStateLength);
      continue;  // a founder's chunked prefill: no common length (joinable requests take none)
    }
    detail::validatePrefillAdvance(kCall, i, static_cast<int32_t>(req.sequences[i].tokens.size()),
                                   advances[i], req.contract);
    MKV_REQUIRE(
        commonStateLengths.empty() || commonStateLengths[i] == advances[i].committedStateLength,
        kCall, "row {}: the common state length after prefill is the prompt's {}, got {}", i,
        advances[i].committedStateLength, commonStateLengths[i]);
  }
  detail::applyAdvances(req, advances);
  // The runtime synchronised before calling: restores and captures are done.
  req.stage = RequestStage::kSettled;
  for (auto& sequence : req.sequences) {
    sequence.common = sequence.committed;
    if (sequence.prefillHeld) {
      // Goes on as an unfinalised in-flight admission: the rows preparePrefill bound reached the
      // device (checked above), and publishPrefill leaves it to finalizeSequenceAdmission.
      sequence.prefillHeld = false;
      sequence.joined = false;
      sequence.joinWritesMark = -1;
      ++mCounters.heldPrefills;
    }
  }
  req.mode->publishPrefill(req);
  return ContextCacheStatus::kOk;
}

ContextCacheStatus ContextCacheCoordinator::publishCompleted(RequestHandle& handle, Request& req,
                                                             std::span<uint8_t const> completed) {
  if (!req.mode->stageCompleted(req, completed)) {
    return ContextCacheStatus::kOk;
  }
  // The copies read state the step just wrote: one synchronisation makes them terminal.
  if (!synchronize()) {
    return quarantineHandle(handle, req.id);
  }
  req.mode->commitStaged(req);
  return ContextCacheStatus::kOk;
}

// ---------------------------------------------------------------- decode

ContextCacheStatus ContextCacheCoordinator::prepareDecodeStep(RequestHandle& handle,
                                                              DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "ContextCacheCoordinator::prepareDecodeStep";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, kCall,
              "a decode step needs an executing request with no pending work");
  req.mode->rows().validateHeadroom(kCall, headroom);
  ContextCacheStatus const grown = growPages(req, headroom);  // pure recurrent: no pages
  if (grown != ContextCacheStatus::kOk) {
    return grown == ContextCacheStatus::kPoisoned ? grown : ContextCacheStatus::kRequestFailed;
  }
  req.stage = RequestStage::kDecoding;
  req.writesMark = mWrites->awaitingFlush();
  return ContextCacheStatus::kOk;
}

ContextCacheStatus ContextCacheCoordinator::growPages(Request& req,
                                                      DecodingKvHeadroom const& headroom) {
  detail::PagedRows const table = req.mode->rows();
  int32_t const pageSize = mManager->pageSize();
  bool grew = false;
  // A row that cannot grow fails alone: the request stays settled, so that the engine can
  // preempt or drop rows and prepare the step again (or finish). Rows grown before the failing
  // one keep their pages (mapped and uploaded, so host and device agree), and the retry does not
  // grow them again.
  auto fail = [&](RowFailureReason reason, ExecutionRow row) {
    req.failure = RowFailure{reason, row};
    ++mCounters.growthFailures;
    if (grew) {
      table.upload();
    }
    return ContextCacheStatus::kRequestFailed;
  };
  for (auto& sequence : req.sequences) {
    auto const row = static_cast<ExecutionRow>(&sequence - req.sequences.data());
    if (!sequence.joined) {
      continue;  // an unfinalised joiner holds: its chunks take their pages (preparePrefillChunk)
    }
    RowGrowth growth = RowGrowth::kUnchanged;
    try {
      growth = growRow(req, sequence, table.neededPages(sequence.committed, headroom, pageSize),
                       "ContextCacheCoordinator::prepareDecodeStep");
    } catch (...) {
      if (grew) {  // the failed growth changed nothing
        table.upload();
      }
      throw;
    }
    switch (growth) {
      case RowGrowth::kUnchanged:
        break;
      case RowGrowth::kGrown:
        ++mCounters.pageGrowths;
        grew = true;
        break;
      case RowGrowth::kTableFull:
        return fail(RowFailureReason::kTableFull, row);
      case RowGrowth::kNoCapacity:
        return fail(RowFailureReason::kNoCapacity, row);
      case RowGrowth::kPoisoned:
        table.upload();
        return ContextCacheStatus::kPoisoned;
    }
  }
  table.upload();
  return ContextCacheStatus::kOk;
}

ContextCacheCoordinator::RowGrowth ContextCacheCoordinator::growRow(
    Request& req, Sequence& sequence, detail::LaneCounts const& needed, char const* call) {
  detail::PagedRows const table = req.mode->rows();
  if (table.tableFull(needed)) {
    return RowGrowth::kTableFull;
  }
  detail::LaneCounts const held = table.heldPages(sequence);
  detail::LaneCounts growth{};
  bool grows = false;
  for (std::size_t lane = 0; lane < growth.size(); ++lane) {
    growth[lane] = std::max(0, needed[lane] - held[lane]);
    grows = grows || growth[lane] > 0;
  }
  if (!grows) {
    return RowGrowth::kUnchanged;
  }
  if (!req.mode->growLease(sequence.lease, growth)) {  // a throw changes nothing either
    return RowGrowth::kNoCapacity;
  }
  bool const moved = moveHostTierPages(call);  // the blocks the growth evicted
  table.mapGrown(sequence, held);
  return moved ? RowGrowth::kGrown : RowGrowth::kPoisoned;
}

DecodeStepDemand ContextCacheCoordinator::decodeStepDemand(
    RequestHandle const& handle, DecodingKvHeadroom const& headroom) const {
  constexpr char const* kCall = "ContextCacheCoordinator::decodeStepDemand";
  Request const& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, kCall,
              "a decode step needs an executing request with no pending work");
  detail::PagedRows const table = req.mode->rows();
  table.validateHeadroom(kCall, headroom);
  int32_t const pageSize = mManager->pageSize();
  DecodeStepDemand demand;
  for (auto const& sequence : req.sequences) {
    if (!sequence.joined) {
      continue;  // as growPages: an unfinalised joiner grows nothing
    }
    detail::LaneCounts const needed = table.neededPages(sequence.committed, headroom, pageSize);
    if (table.tableFull(needed)) {
      if (demand.tableFull.reason == RowFailureReason::kNone) {
        demand.tableFull = RowFailure{RowFailureReason::kTableFull,
                                      static_cast<ExecutionRow>(&sequence - req.sequences.data())};
      }
      continue;
    }
    table.addGrowth(needed, table.heldPages(sequence), demand);
  }
  return demand;
}

RowFailure ContextCacheCoordinator::lastFailure(RequestHandle const& handle) const noexcept {
  if (poisoned()) {
    return RowFailure{RowFailureReason::kPoisoned, -1};
  }
  Request const* const live = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  return live != nullptr ? live->failure : RowFailure{};
}

ContextCacheStatus ContextCacheCoordinator::completeDecodeStep(
    RequestHandle& handle, std::span<ContextCacheSequenceAdvance const> advances,
    std::span<ExecutionRow const> completedRows, std::span<int32_t const> commonStateLengths) {
  constexpr char const* kCall = "ContextCacheCoordinator::completeDecodeStep";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kDecoding, kCall, "no prepared decode step to complete");
  mWrites->requireReachedDevice(kCall, req.writesMark);
  MKV_REQUIRE(advances.size() == req.sequences.size(), kCall, "{} advances for a batch of {}",
              advances.size(), req.sequences.size());
  req.mode->validateCommonLengths(kCall, req.sequences.size(), commonStateLengths);
  std::vector<uint8_t> completed =
      detail::validateDecodeCompletion(kCall, req, advances, completedRows, commonStateLengths);
  detail::applyAdvances(req, advances);
  req.mode->updateCommonLengths(req, advances, commonStateLengths);
  req.stage = RequestStage::kSettled;
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
    req.mode->publishFrozenPrefill(req);
  }
  // A completed row publishes its generated tokens only under its own commit policy.
  for (std::size_t i = 0; i < completed.size(); ++i) {
    if (req.sequences[i].commitPolicy != ContextCacheCommitPolicy::kIncludingGeneratedTokens) {
      completed[i] = 0;
    }
  }
  return publishCompleted(handle, req, completed);
}

// ---------------------------------------------------------------- compaction

void ContextCacheCoordinator::checkBeginBatchCompaction(RequestHandle const& handle,
                                                        std::span<int32_t const> oldToNew,
                                                        int32_t newBatchSize,
                                                        Tensor const& deviceMapping,
                                                        char const* call) const {
  Request const& req = request(handle, call);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, call,
              "compaction needs an executing request with no pending work");
  detail::validateCompactionMapping(call, oldToNew, req.sequences.size(), newBatchSize);
  req.mode->rows().requireLengthBatch(call, static_cast<int32_t>(req.sequences.size()));
  detail::validateDeviceMapping(call, deviceMapping, mDevice, oldToNew.size());
}

void ContextCacheCoordinator::beginBatchCompaction(RequestHandle& handle,
                                                   std::span<int32_t const> oldToNew,
                                                   int32_t newBatchSize, Tensor& deviceMapping) {
  constexpr char const* kCall = "ContextCacheCoordinator::beginBatchCompaction";
  checkBeginBatchCompaction(handle, oldToNew, newBatchSize, deviceMapping, kCall);
  Request& req = request(handle, kCall);
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

void ContextCacheCoordinator::checkCompactBatch(RequestHandle const& handle,
                                                char const* call) const {
  Request const& req = request(handle, call);
  MKV_REQUIRE(req.stage == RequestStage::kCompacting, call, "no batch compaction was begun");
  // The engine may have resized the length tensors or the mapping since the begin.
  req.mode->rows().checkCompaction(call, static_cast<int32_t>(req.sequences.size()),
                                   *req.deviceMapping, mDevice, req.mapping.size());
}

ContextCacheStatus ContextCacheCoordinator::compactBatch(RequestHandle& handle) {
  constexpr char const* kCall = "ContextCacheCoordinator::compactBatch";
  checkCompactBatch(handle, kCall);
  Request& req = request(handle, kCall);
  // Allocations first: nothing below allocates, so a std::bad_alloc changes nothing.
  std::vector<CacheSlot> dropped;
  dropped.reserve(req.mapping.size());
  std::vector<Request::Sequence> survivors;
  survivors.reserve(req.sequences.capacity());
  std::vector<std::vector<Hash128>> swapPaths;  // published block keys of dropped swapped rows
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    Request::Sequence const& sequence = req.sequences[i];
    MKV_ASSERT(!sequence.staged, "row {} has an uncommitted capture at compaction", i);
    if (req.mapping[i] < 0) {
      dropped.push_back(sequence.resident.slot);
      if (sequence.swapOut) {
        int32_t const page = mManager->pageSize();
        swapPaths.push_back(
            hashFullBlocks(detail::prefixOf(sequence, sequence.publishedBlocks * page), page));
      }
    }
  }
  enqueueCompaction(req, dropped);
  if (!synchronize()) {
    return quarantineHandle(handle, req.id);
  }
  if (req.draftInitPending) {
    req.mode->publishFrozenPrefill(req);  // the synchronisation completed the draft init
  }
  settleCompaction(req, survivors);
  // Swap preemption: the dropped rows' pages are released; their blocks move in one batch.
  for (std::vector<Hash128> const& path : swapPaths) {
    mManager->demoteToHostTier(path);
  }
  if (!swapPaths.empty() && !moveHostTierPages(kCall)) {
    return ContextCacheStatus::kPoisoned;  // the moved blocks are forgotten
  }
  return ContextCacheStatus::kOk;
}

void ContextCacheCoordinator::enqueueCompaction(Request& req, std::span<CacheSlot const> dropped) {
  detail::PagedRows const table = req.mode->rows();
  for (CacheSlot slot : dropped) {
    table.clearRow(slot);
  }
  table.upload();
  table.compactLengths(*req.deviceMapping, req.newBatchSize);
  if (mResources.recurrent != nullptr && !dropped.empty()) {
    mResources.recurrent->clearResidentSlots(dropped, mStream);
  }
}

void ContextCacheCoordinator::settleCompaction(Request& req,
                                               std::vector<Request::Sequence>& survivors) noexcept {
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    if (req.mapping[i] < 0) {
      mResidentBusy[static_cast<std::size_t>(req.sequences[i].resident.slot)] = 0;
    } else {
      survivors.push_back(std::move(req.sequences[i]));  // capacity reserved by compactBatch
    }
  }
  req.sequences = std::move(survivors);  // dropped leases are released here
  req.mapping.clear();
  req.newBatchSize = -1;
  req.deviceMapping = nullptr;
  req.stage = req.sequences.empty() ? RequestStage::kFinishing : RequestStage::kSettled;
}

// ---------------------------------------------------------------- finish / shutdown

ContextCacheStatus ContextCacheCoordinator::finish(RequestHandle& handle) {
  if (!handle.valid()) {
    return poisoned() ? ContextCacheStatus::kPoisoned : ContextCacheStatus::kOk;
  }
  uint64_t const id = request(handle, "ContextCacheCoordinator::finish").id;
  handle.invalidate();
  // Detached first: a publication that throws must not strand the request among the live ones
  // (shutdown could not recover its rows and leases any more).
  std::unique_ptr<Request> finished =
      mRequests->detachSettled(id, [this] { return synchronize(); });
  if (finished == nullptr) {
    countQuarantines();
    return ContextCacheStatus::kPoisoned;
  }
  if (finished->draftInitPending) {  // best effort here
    try {
      finished->mode->publishFrozenPrefill(*finished);
    } catch (std::exception const& error) {
      logger()->error(
          "ContextCacheCoordinator::finish: publishing the frozen prompt endpoint of "
          "request {} failed: {}",
          id, error.what());
    }
  }
  bool const released = mRequests->release(
      std::move(finished), "finish", [this](Requests requests) { clearRows(requests); },
      [this](Request& req) { releaseResidents(req); });
  countQuarantines();
  return !released || poisoned() ? ContextCacheStatus::kPoisoned : ContextCacheStatus::kOk;
}

ContextCacheStatus ContextCacheCoordinator::shutdown() noexcept {
  if (mRemoteTier != nullptr) {
    try {
      (void)mRemoteTier->drain("ContextCacheCoordinator::shutdown");
    } catch (Error const& error) {  // the host tier's CUDA query failed
      logger()->error("ContextCacheCoordinator::shutdown: {}", error.what());
      poison();
    }
  }
  // A failed host-tier launch poisons: its other copies may still run.
  if (poisoned() && !mHostTier->synchronize()) {
    return ContextCacheStatus::kPoisoned;
  }
  // Leases of the quarantined requests are released with them.
  if (!mRequests->drainQuarantine(
          "shutdown", [this] { return synchronize(); },
          [this](Requests requests) { clearRows(requests); },
          [this](Request& req) { releaseResidents(req); })) {
    return ContextCacheStatus::kPoisoned;
  }
  return mRequests->active().empty() ? ContextCacheStatus::kOk : ContextCacheStatus::kRequestFailed;
}

bool ContextCacheCoordinator::resetPrefixCache() noexcept {
  if (poisoned() || !mRequests->active().empty() || !mRequests->quarantined().empty()) {
    return false;
  }
  auto const remoteBusy = [this] {
    return mRemoteTier->pendingSaves() > 0 || mRemoteTier->placementsInFlight() > 0;
  };
  if (mRemoteTier != nullptr && remoteBusy()) {
    // A save reads a held host page, and the reset drops every host block; a placement would
    // index a loaded block after it.
    try {
      (void)mRemoteTier->drain("ContextCacheCoordinator::resetPrefixCache");
    } catch (Error const& error) {
      logger()->error("ContextCacheCoordinator::resetPrefixCache: {}", error.what());
      return false;
    }
    if (remoteBusy()) {
      return false;
    }
  }
  if (!mManager->resetPrefixCache()) {
    return false;
  }
  if (mResources.windowCache != nullptr) {
    // Its AllBlocksCleared covers the sliding pool too; no window may outlive the reset (a
    // reset after new weights must not let a hit read the old sliding KV).
    mResources.windowCache->clear();
  }
  return true;
}

// ---------------------------------------------------------------- observability

bool ContextCacheCoordinator::supportsLiveSequenceAdmission() const noexcept {
  return mModes->plainJoinable || mModes->speculativeJoinable;
}

bool ContextCacheCoordinator::moveHostTierPages(char const* call) noexcept {
  return mHostTier->move(call);
}

ContextCacheMetrics ContextCacheCoordinator::metrics() const { return mManager->metrics(); }

std::vector<KvEvent> ContextCacheCoordinator::drainEvents() { return mManager->drainEvents(); }

std::string ContextCacheCoordinator::toPrometheus(std::string_view prefix) const {
  std::string text = mkv::toPrometheus(mManager->metrics(), prefix);
  for (CoordinatorCounterField const& counter : kCoordinatorCounterFields) {
    text += fmt::format("# HELP {0}{1}_total {2}\n# TYPE {0}{1}_total counter\n{0}{1}_total {3}\n",
                        prefix, counter.name, counter.help, mCounters.*counter.value);
  }
  if (mResources.windowCache != nullptr) {
    text += mResources.windowCache->toPrometheus(prefix);
  }
  return text;
}

}  // namespace mkv
