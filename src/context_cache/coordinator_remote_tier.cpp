// RemoteTierLink: the remote tier's lookups, loads and saves for the coordinator.

#include "context_cache/coordinator_remote_tier.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>
#include <utility>

#include "context_cache/context_cache_manager.h"
#include "context_cache/coordinator_paged_rows.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/request_mode.h"
#include "core/check.h"
#include "mkv/logging.h"
#include "mkv/remote_kv_store.h"

namespace mkv::detail {

namespace {

std::unique_ptr<RemoteKvStore> openStore(char const* call, RemoteTierConfig const& config) {
  std::unique_ptr<RemoteKvStore> store;
  try {
    store = config.openStore();
  } catch (std::exception const& error) {
    throwContract(call, "remoteTier.openStore failed: {}", error.what());
  }
  MKV_REQUIRE(store != nullptr, call, "remoteTier.openStore returned no store");
  return store;
}

RemoteTierConfig const& checked(char const* call, RemoteTierConfig const& config) {
  MKV_REQUIRE(static_cast<bool>(config.openStore), call, "remoteTier.openStore is empty");
  MKV_REQUIRE(
      config.maxPendingSaves > 0 && config.maxLoadsInFlight > 0 && config.maxBlocksPerLoad > 0,
      call,
      "remoteTier bounds must be positive: maxPendingSaves {}, maxLoadsInFlight {}, "
      "maxBlocksPerLoad {}",
      config.maxPendingSaves, config.maxLoadsInFlight, config.maxBlocksPerLoad);
  return config;
}

}  // namespace

RemoteTierLink::RemoteTierLink(char const* call, RemoteTierConfig const& config,
                               ContextCacheManager& manager, HostKvTier& tier,
                               KVCachePool const& basePool)
    : mConfig(checked(call, config)),
      mManager(manager),
      mTier(tier),
      mLayers(basePool.numLayers()),
      mPageBytes(basePool.pageBytes()) {
  MKV_REQUIRE(manager.options().verifyTokens, call,
              "the remote tier needs verifyTokens: a saved block carries its token ids");
  KVCachePoolConfig const& pool = basePool.config();
  mDeployment =
      remoteDeploymentIdentity(RemoteDeployment{mConfig.model, pool.numLayers, pool.tokensPerPage,
                                                pool.numKVHeads, pool.headDim, pool.dataType});
  mLookupStore = openStore(call, mConfig);
  mWorker = std::make_unique<RemoteTierWorker>(openStore(call, mConfig));
  mHeldForSave.reserve(static_cast<std::size_t>(mConfig.maxPendingSaves));
  mAwaitingCopy.reserve(static_cast<std::size_t>(mConfig.maxPendingSaves));
}

RemoteTierLink::~RemoteTierLink() {
  mWorker.reset();  // a save in progress reads a held page: stop before anything else goes
}

RemoteTierLookup RemoteTierLink::lookup(PromptBlocks const& blocks, int32_t localBlocks) {
  RemoteTierLookup result;
  result.localTokens = localBlocks * blocks.pageSize;
  int32_t const end = std::min(blocks.fullBlockCount(), localBlocks + mConfig.maxBlocksPerLoad);
  if (localBlocks >= end) {
    return result;
  }
  std::vector<std::string> keys;
  keys.reserve(static_cast<std::size_t>(end - localBlocks));
  for (int32_t b = localBlocks; b < end; ++b) {
    keys.push_back(keyOf(blocks.keys[static_cast<std::size_t>(b)]));
  }
  std::vector<uint8_t> held;
  ++mCounters.lookups;
  if (mLookupStore->contains(keys, held) != RemoteStoreStatus::kOk) {
    ++mCounters.lookupFailures;
    result.storeAvailable = false;
    return result;
  }
  auto const run = std::find(held.begin(), held.end(), uint8_t{0}) - held.begin();
  result.remoteTokens = static_cast<int32_t>(run) * blocks.pageSize;
  return result;
}

RemoteLoadStart RemoteTierLink::startLoad(std::unique_ptr<ContextCacheSequenceAdmission> sequence,
                                          PromptBlocks blocks, int32_t localBlocks) {
  int32_t const end = std::min(blocks.fullBlockCount(), localBlocks + mConfig.maxBlocksPerLoad);
  if (localBlocks >= end) {
    return {};
  }
  if (std::cmp_greater_equal(mLoads.size(), mConfig.maxLoadsInFlight)) {
    ++mCounters.loadsRefused;
    return {};
  }
  uint64_t const ticket = mNextTicket++;
  PendingLoad& pending = mLoads[ticket];
  pending.sequence = std::move(sequence);
  pending.blocks = std::move(blocks);
  pending.firstBlock = localBlocks;
  pending.requestedBlocks = end - localBlocks;
  RemoteTierWorker::LoadJob job;
  job.ticket = ticket;
  job.blocks.reserve(static_cast<std::size_t>(pending.requestedBlocks));
  int64_t const payloadBytes = 2 * int64_t{mLayers} * mPageBytes;
  for (int32_t b = localBlocks; b < end; ++b) {
    Hash128 const key = pending.blocks.keys[static_cast<std::size_t>(b)];
    job.blocks.push_back(
        {keyOf(key), RemoteBlockHeader{mDeployment, key, pending.blocks.parentOf(b),
                                       pending.blocks.extrasDigest(b),
                                       pending.blocks.blockTokens(b), payloadBytes}});
  }
  mWorker->submit(std::move(job));
  ++mCounters.loadsStarted;
  return RemoteLoadStart{ticket, pending.requestedBlocks};
}

void RemoteTierLink::takeMirrored() noexcept {
  for (PageId page : mManager.takeMirroredBlocks()) {
    if (std::cmp_greater_equal(mHeldForSave.size(), mConfig.maxPendingSaves)) {
      ++mCounters.savesSkipped;
      continue;
    }
    try {
      mManager.holdHostPage(page);
    } catch (std::exception const& error) {  // not expected: the page was just stored
      logger()->error("remote tier: holding host page {} failed: {}", page, error.what());
      ++mCounters.savesSkipped;
      continue;
    }
    mHeldForSave.push_back(page);  // reserved: cannot throw
    mAwaitingCopy.push_back(page);
  }
}

void RemoteTierLink::announceSaved(PageId hostPage) noexcept {
  BlockIndex const& host = mManager.hostTier()->index();  // still held: still this block
  mManager.eventQueue().pushStored(BlockStored{*host.digestOf(hostPage),
                                               host.parentOf(hostPage),
                                               kNoPage,
                                               host.pageSize(),
                                               {},
                                               host.extrasOf(hostPage),
                                               KvMedium::kRemote},
                                   host.tokensOf(hostPage));
}

void RemoteTierLink::submitSaves(char const* call) {
  if (mAwaitingCopy.empty() || !mTier.transfersComplete(call)) {
    return;
  }
  BlockIndex const& host = mManager.hostTier()->index();
  for (PageId page : mAwaitingCopy) {
    RemoteTierWorker::SaveJob job;
    job.id = mNextSave++;
    job.hostPage = page;
    job.blockKey = *host.digestOf(page);  // held: still this block
    job.key = keyOf(job.blockKey);
    job.deployment = mDeployment;
    job.parent = host.parentOf(page);
    job.extras = host.extrasOf(page);
    std::span<int32_t const> const tokens = host.tokensOf(page);
    job.tokens.assign(tokens.begin(), tokens.end());
    job.payload.reserve(2 * static_cast<std::size_t>(mLayers));
    for (int32_t layer = 0; layer < mLayers; ++layer) {
      for (int32_t half = 0; half < 2; ++half) {
        job.payload.emplace_back(
            static_cast<std::byte const*>(std::as_const(mTier).hostPage(layer, half, page)),
            static_cast<std::size_t>(mPageBytes));
      }
    }
    mWorker->submit(std::move(job));
  }
  mAwaitingCopy.clear();
}

std::vector<RemoteLoadResult> RemoteTierLink::poll(char const* call) {
  std::vector<RemoteTierWorker::SaveDone> saves;
  mWorker->takeFinished(mFinishedLoads, saves, mPlaced);
  for (RemoteTierWorker::SaveDone const& done : saves) {
    if (done.status == RemoteStoreStatus::kOk) {
      ++mCounters.savedBlocks;
      mCounters.savedBytes += static_cast<uint64_t>(done.valueBytes);
      announceSaved(done.hostPage);
    } else {
      ++mCounters.saveFailures;
    }
    mManager.releaseHostPage(done.hostPage);
    std::erase(mHeldForSave, done.hostPage);
  }
  submitSaves(call);
  std::vector<RemoteLoadResult> results;
  results.reserve(mPlaced.size() + mFinishedLoads.size());
  for (uint64_t const ticket : mPlaced) {
    auto const found = mLoads.find(ticket);
    MKV_ASSERT(found != mLoads.end(), "remote placement {} finished without a load", ticket);
    results.push_back(adopt(ticket, found->second));
    mLoads.erase(found);
    --mPlacements;
  }
  mPlaced.clear();
  if (mFinishedLoads.empty()) {
    return results;
  }
  // A reserved host page may be one a dropped block held, which an onboarding still reads or a
  // decided move still names: reserve only when neither can be.
  if (mManager.hasPendingHostTransfers() || !mTier.transfersComplete(call)) {
    ++mCounters.installsDeferred;
    return results;
  }
  for (RemoteTierWorker::LoadDone& done : mFinishedLoads) {
    uint64_t const ticket = done.ticket;
    auto const found = mLoads.find(ticket);
    MKV_ASSERT(found != mLoads.end(), "remote load {} finished without being started", ticket);
    if (std::optional<RemoteLoadResult> const result =
            place(ticket, found->second, std::move(done))) {
      results.push_back(*result);
      mLoads.erase(found);
    } else {
      ++mPlacements;
    }
  }
  mFinishedLoads.clear();
  return results;
}

bool RemoteTierLink::held(Hash128 block) const {
  return mManager.index().find(block) || mManager.hostTier()->index().find(block);
}

std::optional<RemoteLoadResult> RemoteTierLink::place(uint64_t ticket, PendingLoad& pending,
                                                      RemoteTierWorker::LoadDone done) {
  if (done.status != RemoteStoreStatus::kOk) {
    ++mCounters.loadFailures;
    return RemoteLoadResult{ticket, pending.requestedBlocks, 0, false};
  }
  mCounters.missingBlocks += static_cast<uint64_t>(done.missing);
  mCounters.rejectedBlocks += static_cast<uint64_t>(done.rejected);
  pending.loaded = std::move(done);  // in the map's node: the copies' source stays put
  std::vector<RemoteTierWorker::LoadedBlock> const& blocks = pending.loaded.blocks;
  RemoteTierWorker::PlaceJob job{ticket, {}};
  try {
    pending.placedPages.reserve(blocks.size());  // so that no push below throws
    job.copies.reserve(blocks.size() * 2 * static_cast<std::size_t>(mLayers));
  } catch (std::exception const& error) {
    logger()->error("remote tier: placing load {} failed: {}", ticket, error.what());
    ++mCounters.loadFailures;
    return RemoteLoadResult{ticket, pending.requestedBlocks, 0, true};
  }
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    int32_t const block = pending.firstBlock + static_cast<int32_t>(i);
    std::optional<PageId> page;
    try {
      page = mManager.reserveHostPageForLoad(pending.blocks, block);
    } catch (std::exception const& error) {  // an allocation: nothing changed
      logger()->error("remote tier: placing loaded block {} failed: {}", block, error.what());
      break;
    }
    if (!page) {
      if (!held(pending.blocks.keys[static_cast<std::size_t>(block)])) {
        break;  // every host page is pinned: the rest would not be reachable
      }
      pending.placedPages.push_back(kNoPage);
      continue;
    }
    pending.placedPages.push_back(*page);
    std::byte const* from = blocks[i].payload().data();
    for (int32_t layer = 0; layer < mLayers; ++layer) {
      for (int32_t half = 0; half < 2; ++half) {
        job.copies.push_back({from, static_cast<std::byte*>(mTier.hostPage(layer, half, *page)),
                              static_cast<std::size_t>(mPageBytes)});
        from += mPageBytes;
      }
    }
  }
  if (job.copies.empty()) {
    return adopt(ticket, pending);
  }
  try {
    mWorker->submit(std::move(job));
  } catch (std::exception const& error) {  // the queue's allocation: give the pages back
    logger()->error("remote tier: placing load {} failed: {}", ticket, error.what());
    for (PageId const page : pending.placedPages) {
      if (page != kNoPage) {
        mManager.releaseLoadedHostPage(page);
      }
    }
    ++mCounters.loadFailures;
    return RemoteLoadResult{ticket, pending.requestedBlocks, 0, true};
  }
  return std::nullopt;
}

RemoteLoadResult RemoteTierLink::adopt(uint64_t ticket, PendingLoad& pending) {
  RemoteLoadResult result{ticket, pending.requestedBlocks, 0, true};
  bool inRun = true;  // the blocks counted loaded are the run from the first one
  for (std::size_t i = 0; i < pending.placedPages.size(); ++i) {
    int32_t const block = pending.firstBlock + static_cast<int32_t>(i);
    PageId const page = pending.placedPages[i];
    bool present = false;
    if (page == kNoPage) {
      present = held(pending.blocks.keys[static_cast<std::size_t>(block)]);
    } else {
      try {
        if (mManager.adoptLoadedHostPage(pending.blocks, block, page)) {
          ++mCounters.loadedBlocks;
          mCounters.loadedBytes += pending.loaded.blocks[i].payload().size();
        }
        present = true;                        // here, or held already by the GPU or the host tier
      } catch (std::exception const& error) {  // an allocation of the host index: page released
        logger()->error("remote tier: keeping loaded block {} failed: {}", block, error.what());
      }
    }
    inRun = inRun && present;
    if (inRun) {
      ++result.loadedBlocks;
    }
  }
  return result;
}

std::vector<RemoteLoadResult> RemoteTierLink::drain(char const* call) {
  std::vector<RemoteLoadResult> results;
  // Twice: the first poll may place loads and hand the worker saves whose copies just completed.
  for (int pass = 0; pass < 2; ++pass) {
    mWorker->waitIdle();
    (void)mTier.synchronize();  // a failure shows in transfersComplete's query below
    std::vector<RemoteLoadResult> more = poll(call);
    results.insert(results.end(), more.begin(), more.end());
  }
  return results;
}

}  // namespace mkv::detail

namespace mkv {

detail::RemoteTierLink& ContextCacheCoordinator::remoteTier(char const* call) const {
  MKV_REQUIRE(mRemoteTier != nullptr, call,
              "this deployment has no remote tier (ContextCacheConfig::remoteTier)");
  return *mRemoteTier;
}

LookupResult ContextCacheCoordinator::lookupForRemoteTier(
    char const* call, ContextCacheSequenceAdmission const& sequence) const {
  DecodingKvHeadroom const headroom{};
  detail::RequestMode const& mode = modeFor(false, call);
  mode.rows().validateHeadroom(call, headroom);
  detail::validateSequence(call, 0, sequence, headroom, *mLimits,
                           mode.rows().laneCount() == detail::kMaxRowLanes);
  try {
    return mManager->lookup(
        lookupOf(sequence, ContextCacheLookupPolicy::kUseCache, headroom, mode));
  } catch (Error const& error) {
    detail::throwContract(call, "{}", error.what());
  }
}

namespace {

int32_t localBlocksOf(ReusePlan const& plan) noexcept {
  return static_cast<int32_t>(plan.basePageBindings.size() + plan.hostOnboardPages.size());
}

}  // namespace

RemoteTierLookup ContextCacheCoordinator::lookupRemoteTier(
    ContextCacheSequenceAdmission const& sequence) {
  constexpr char const* kCall = "ContextCacheCoordinator::lookupRemoteTier";
  detail::RemoteTierLink& remote = remoteTier(kCall);
  LookupResult const looked = lookupForRemoteTier(kCall, sequence);
  return remote.lookup(looked.blocks, localBlocksOf(looked.plan));
}

RemoteLoadStart ContextCacheCoordinator::loadFromRemoteTier(
    ContextCacheSequenceAdmission const& sequence) {
  constexpr char const* kCall = "ContextCacheCoordinator::loadFromRemoteTier";
  detail::RemoteTierLink& remote = remoteTier(kCall);
  auto owned = std::make_unique<ContextCacheSequenceAdmission>(sequence);
  LookupResult looked = lookupForRemoteTier(kCall, *owned);
  int32_t const local = localBlocksOf(looked.plan);
  return remote.startLoad(std::move(owned), std::move(looked.blocks), local);
}

std::vector<RemoteLoadResult> ContextCacheCoordinator::pollRemoteTier() {
  return mRemoteTier != nullptr ? mRemoteTier->poll("ContextCacheCoordinator::pollRemoteTier")
                                : std::vector<RemoteLoadResult>{};
}

std::vector<RemoteLoadResult> ContextCacheCoordinator::drainRemoteTier() {
  return mRemoteTier != nullptr ? mRemoteTier->drain("ContextCacheCoordinator::drainRemoteTier")
                                : std::vector<RemoteLoadResult>{};
}

RemoteTierCounters ContextCacheCoordinator::remoteTierCounters() const noexcept {
  return mRemoteTier != nullptr ? mRemoteTier->counters() : RemoteTierCounters{};
}

int32_t ContextCacheCoordinator::pendingRemoteSaves() const noexcept {
  return mRemoteTier != nullptr ? mRemoteTier->pendingSaves() : 0;
}

}  // namespace mkv
