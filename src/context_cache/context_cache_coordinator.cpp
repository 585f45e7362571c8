// ContextCacheCoordinator: handles and this backend's side of the shared request registry
// (src/resources/request_registry.h: synchronisation, clearing rows, freeing residents),
// construction, prefill, decode, compaction, finish and shutdown. Batch admission,
// checkpoints and in-flight admission are the other parts (see the class's private section).

#include "mkv/context_cache/context_cache_coordinator.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "context_cache/coordinator_deployment.h"
#include "context_cache/coordinator_paged_rows.h"
#include "context_cache/coordinator_request.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "core/device.h"
#include "mkv/host_kv_tier.h"
#include "mkv/logging.h"
#include "resources/backend_requests.h"
#include "resources/device_write_queue.h"
#include "resources/request_registry.h"

namespace mkv {

using detail::isHold;
using detail::sequenceAt;

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
      mSynchronizer(std::move(synchronizer)),
      mRequests(std::make_unique<detail::RequestRegistry<Request>>("ContextCacheCoordinator")) {
  detail::DeploymentLayout const layout = detail::validateDeployment(config, profile, resources);
  mMaxBatch = layout.maxBatch;
  mDevice = layout.device;
  mWrites = mResources.deviceWrites;
  if (mWrites == nullptr) {
    mOwnedWrites =
        std::make_unique<detail::DeviceWriteQueue>(mDevice, DeviceWriteTiming::kEachCall);
    mWrites = mOwnedWrites.get();
  }
  mWrites->watch(mResources.basePageTable);
  mWrites->watch(mResources.draftPageTable);
  mWrites->watch(mResources.basePool);
  mWrites->watch(mResources.draftPool);
  if (!mSynchronizer) {
    mSynchronizer = defaultStreamSynchronizer(mDevice);
  }
  ContextCacheManagerOptions options;
  options.verifyTokens = config.verifyTokens;
  options.eventQueueCapacity = config.eventQueueCapacity;
  options.specContract = profile.speculative;
  options.evictionPolicy = config.evictionPolicy;
  options.retentionClock = config.retentionClock;
  if (resources.hostTier != nullptr) {
    options.hostTierPages = resources.hostTier->numPages();
    options.hostTierBytesPerPage = resources.hostTier->bytesPerPage();
  }
  options.windowCache = resources.windowCache;
  mManager = std::make_unique<ContextCacheManager>(layout.blockTokens, layout.capacities,
                                                   config.enabled ? config.maxRecords : 0, options);
  if (profile.usesCheckpointReuse()) {
    mSnapshots =
        std::make_unique<SnapshotStorage>(layout.snapshots, resources.recurrent, resources.basePool,
                                          profile.isHybridMtp() ? resources.draftPool : nullptr);
  }
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
  MKV_REQUIRE(handle.mCoordinator == this, call, "the request handle is {}",
              handle.mCoordinator == nullptr ? "invalid" : "from another coordinator");
  Request* const live = mRequests->find(handle.mId);
  if (live == nullptr) {
    detail::throwContract(call, "request {} is not active", handle.mId);
  }
  return *live;
}

ContextCacheStatus ContextCacheCoordinator::quarantineHandle(RequestHandle& handle,
                                                             uint64_t id) noexcept {
  handle.mCoordinator = nullptr;
  handle.mId = 0;
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

detail::PagedRows ContextCacheCoordinator::rows() const noexcept {
  return detail::PagedRows(mResources, *mWrites, mStream);
}

void ContextCacheCoordinator::clearRows(Requests requests) {
  if (!hasKv()) {
    return;
  }
  detail::PagedRows const table = rows();
  for (auto const& req : requests) {
    for (auto const& sequence : req->sequences) {
      table.clearRow(sequence.resident.slot, pairsDraft(*req));
    }
  }
  table.upload();
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

bool ContextCacheCoordinator::pairsDraft(Request const& req) const noexcept {
  return req.speculative && mProfile.ownsPagedSpecState();
}

bool ContextCacheCoordinator::isHybridMtp(Request const& req) const noexcept {
  return req.speculative && mProfile.isHybridMtp();
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
    rows().bindPrefill(req, pairsDraft(req), isHybridMtp(req));
  }
  if (mSnapshots != nullptr) {
    restoreCheckpoints(req, cold);
    planReusePoints(req);
  }
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
  detail::validateCommonLengths(kCall, req.speculative, req.sequences.size(), commonStateLengths,
                                pairsDraft(req) && !isHybridMtp(req));
  for (std::size_t i = 0; i < advances.size(); ++i) {
    MKV_REQUIRE(req.sequences[i].joined, kCall, "row {} was admitted in flight", i);
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
  }
  if (mSnapshots != nullptr) {
    for (auto& sequence : req.sequences) {
      mManager->releaseRestoredHybridSnapshots(sequence.lease);
      mCounters.prefillPublications += sequence.staged ? 1u : 0u;
    }
    commitReusePoints(req);  // ascending: the points, then the prompt end
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

// ---------------------------------------------------------------- publication of full blocks

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
  PromptView const prefix = detail::prefixOf(sequence, blocks * pageSize);
  // Publication records what the sequence already computed; the completion it belongs to has
  // been applied. Out of host memory, the blocks stay unpublished (the manager rolls the attempt
  // back) and a later completion point of the sequence may publish them.
  try {
    PromptBlocks const digests = hashPromptBlocks(prefix, pageSize);
    PublishResult const published = mManager->publish(sequence.lease, digests, length);
    sequence.publishedBlocks =
        std::max(sequence.publishedBlocks, published.publishedFullBlockCount);
    moveHostTierPages("ContextCacheCoordinator: publication");  // the record limit may evict
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; {} blocks of request {} row {} "
        "were not published",
        blocks - sequence.publishedBlocks, req.id, row);
  }
}

ContextCacheStatus ContextCacheCoordinator::publishCompleted(RequestHandle& handle, Request& req,
                                                             std::span<uint8_t const> completed) {
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
    return quarantineHandle(handle, req.id);
  }
  commitCaptures(req);
  return ContextCacheStatus::kOk;
}

// ---------------------------------------------------------------- decode

ContextCacheStatus ContextCacheCoordinator::prepareDecodeStep(RequestHandle& handle,
                                                              DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "ContextCacheCoordinator::prepareDecodeStep";
  Request& req = request(handle, kCall);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, kCall,
              "a decode step needs an executing request with no pending work");
  detail::validateHeadroom(kCall, headroom, pairsDraft(req));
  if (hasKv()) {
    ContextCacheStatus const grown = growPages(req, headroom);
    if (grown != ContextCacheStatus::kOk) {
      return grown == ContextCacheStatus::kPoisoned ? grown : ContextCacheStatus::kRequestFailed;
    }
  }
  req.stage = RequestStage::kDecoding;  // pure recurrent: no pages to grow
  req.writesMark = mWrites->awaitingFlush();
  return ContextCacheStatus::kOk;
}

ContextCacheStatus ContextCacheCoordinator::growPages(Request& req,
                                                      DecodingKvHeadroom const& headroom) {
  bool const paired = pairsDraft(req);
  detail::PagedRows const table = rows();
  int32_t const pageSize = mManager->pageSize();
  bool grew = false;
  // Rows grown before a failing one keep their pages (mapped and uploaded, so host and device
  // agree), and a retry of the step does not grow them again.
  auto fail = [&](RowFailureReason reason, ExecutionRow row) {
    req.stage = RequestStage::kFinishing;
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
      continue;  // an unfinalised joiner holds: its admission bound its prompt's pages
    }
    int64_t const base =
        detail::pagesFor(int64_t{sequence.committed} + headroom.baseExtraTokens, pageSize);
    int64_t const draft =
        paired ? detail::pagesFor(int64_t{sequence.committed} + headroom.draftExtraTokens, pageSize)
               : 0;
    if (base > table.baseRowPages() || (paired && draft > table.draftRowPages())) {
      return fail(RowFailureReason::kTableFull, row);
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
        table.upload();
      }
      throw;
    }
    if (!grown) {
      return fail(RowFailureReason::kNoCapacity, row);
    }
    if (!moveHostTierPages("ContextCacheCoordinator::prepareDecodeStep")) {
      table.mapGrown(sequence, static_cast<std::size_t>(heldBase),
                     static_cast<std::size_t>(heldDraft), paired);
      table.upload();
      return ContextCacheStatus::kPoisoned;
    }
    table.mapGrown(sequence, static_cast<std::size_t>(heldBase),
                   static_cast<std::size_t>(heldDraft), paired);
    ++mCounters.pageGrowths;
    grew = true;
  }
  table.upload();
  return ContextCacheStatus::kOk;
}

RowFailure ContextCacheCoordinator::lastFailure(RequestHandle const& handle) const noexcept {
  if (poisoned()) {
    return RowFailure{RowFailureReason::kPoisoned, -1};
  }
  Request const* const live = handle.mCoordinator == this ? mRequests->find(handle.mId) : nullptr;
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
  detail::validateCommonLengths(kCall, req.speculative, req.sequences.size(), commonStateLengths,
                                pairsDraft(req) && !isHybridMtp(req));
  std::vector<uint8_t> const completed =
      detail::validateDecodeCompletion(kCall, req, advances, completedRows, commonStateLengths);
  detail::applyAdvances(req, advances);
  for (std::size_t i = 0; i < advances.size() && req.speculative; ++i) {
    if (!isHold(advances[i])) {
      Request::Sequence& sequence = req.sequences[i];
      sequence.common = commonStateLengths.empty() ? sequence.committed : commonStateLengths[i];
    }
  }
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
    publishFrozenPrefill(req);
  }
  if (req.commitPolicy != ContextCacheCommitPolicy::kIncludingGeneratedTokens) {
    return ContextCacheStatus::kOk;
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
  if (hasKv()) {
    rows().requireLengthBatch(call, static_cast<int32_t>(req.sequences.size()), pairsDraft(req));
  }
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
  if (hasKv()) {  // the engine may have resized the tensor since the begin
    rows().requireLengthBatch(call, static_cast<int32_t>(req.sequences.size()), pairsDraft(req));
    // The device mapping is read only to compact the length tensors.
    detail::requireDeviceMappingUnchanged(call, *req.deviceMapping, mDevice, req.mapping.size());
  }
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
  for (std::size_t i = 0; i < req.mapping.size(); ++i) {
    MKV_ASSERT(!req.sequences[i].staged, "row {} has an uncommitted capture at compaction", i);
    if (req.mapping[i] < 0) {
      dropped.push_back(req.sequences[i].resident.slot);
    }
  }
  enqueueCompaction(req, dropped);
  if (!synchronize()) {
    return quarantineHandle(handle, req.id);
  }
  if (req.draftInitPending) {
    publishFrozenPrefill(req);  // the synchronisation made the draft initialisation complete
  }
  settleCompaction(req, survivors);
  return ContextCacheStatus::kOk;
}

void ContextCacheCoordinator::enqueueCompaction(Request& req, std::span<CacheSlot const> dropped) {
  if (hasKv()) {
    bool const paired = pairsDraft(req);
    detail::PagedRows const table = rows();
    for (CacheSlot slot : dropped) {
      table.clearRow(slot, paired);
    }
    table.upload();
    table.compactLengths(*req.deviceMapping, req.newBatchSize, paired);
  }
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
  handle.mCoordinator = nullptr;
  handle.mId = 0;
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
      publishFrozenPrefill(*finished);
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
  // A failed host-tier launch poisons: its other copies may still run.
  if (poisoned() && mResources.hostTier != nullptr &&
      mResources.hostTier->synchronize() != cudaSuccess) {
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
  return mProfile.baseStateKind == BaseStateKind::kAttentionOnly && !mProfile.isSpeculative();
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
