#pragma once
/// \file coordinator_remote_tier.h
/// The coordinator's side of the remote tier (not installed; docs/context_cache.md, "Remote
/// tier"): lookups on the engine thread's store connection, loads and saves through the worker,
/// and the host-tier steps between them — loaded blocks become host-tier blocks, published blocks
/// copied to the host tier are saved from there.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/remote_tier_worker.h"
#include "mkv/context_cache/context_cache_config.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/host_kv_tier.h"

namespace mkv::detail {

class RemoteTierLink {
 public:
  /// Opens both store connections and starts the worker. `tier` must be the manager's host tier.
  /// Throws mkv::Error naming `call` for a config without openStore or with a bound <= 0, a
  /// manager without token verification (a saved value carries the block's tokens), or a store
  /// that cannot be opened.
  RemoteTierLink(char const* call, RemoteTierConfig const& config, ContextCacheManager& manager,
                 HostKvTier& tier, KVCachePool const& basePool);
  ~RemoteTierLink();
  RemoteTierLink(RemoteTierLink const&) = delete;
  RemoteTierLink& operator=(RemoteTierLink const&) = delete;

  /// How many full blocks after the first `localBlocks` of `blocks` the store holds, in a row
  /// (one round trip on the engine thread's connection, bounded by the store's timeout).
  RemoteTierLookup lookup(PromptBlocks const& blocks, int32_t localBlocks);
  /// Starts loading blocks [localBlocks, ...) of `sequence`'s prompt (owned from now on; `blocks`
  /// are its digests) into the host tier. Ticket 0 when nothing is to load or maxLoadsInFlight
  /// loads are not yet taken.
  RemoteLoadStart startLoad(std::unique_ptr<ContextCacheSequenceAdmission> sequence,
                            PromptBlocks blocks, int32_t localBlocks);
  /// Takes the manager's mirrored blocks (after their offload copies were enqueued) and holds
  /// their host pages until saved; beyond maxPendingSaves a block is not saved.
  void takeMirrored() noexcept;
  /// The engine's poll: hands saves whose copies completed to the worker, releases the pages of
  /// finished saves, reserves host pages for finished loads while no host transfer is in flight
  /// (otherwise they wait for the next poll) and hands the worker the copies into them, and
  /// indexes the host pages of placements the worker finished. Returns the loads now in the host
  /// tier (a failed one at once). Throws mkv::Error naming `call` on a CUDA failure of the host
  /// tier's query.
  std::vector<RemoteLoadResult> poll(char const* call);
  /// Waits for the worker (a cache reset, shutdown, tests), then polls, twice: a load the first
  /// poll placed and a save it submitted are finished by the second.
  std::vector<RemoteLoadResult> drain(char const* call);
  /// Host pages held for saves (queued or running).
  int32_t pendingSaves() const noexcept { return static_cast<int32_t>(mHeldForSave.size()); }
  /// Loads whose blocks the worker is copying into reserved host pages.
  int32_t placementsInFlight() const noexcept { return mPlacements; }
  RemoteTierCounters const& counters() const noexcept { return mCounters; }

 private:
  struct PendingLoad {
    std::unique_ptr<ContextCacheSequenceAdmission> sequence;  ///< what `blocks` refers to
    PromptBlocks blocks;
    int32_t firstBlock = 0;
    int32_t requestedBlocks = 0;
    /// Once placed: the fetched values (the source of the worker's copies) and each block's
    /// reserved host page (kNoPage: the GPU or the host tier held the block already).
    RemoteTierWorker::LoadDone loaded;
    std::vector<PageId> placedPages;
  };

  void submitSaves(char const* call);
  /// The BlockStored event (medium kRemote) of the block a finished save wrote from `hostPage`.
  void announceSaved(PageId hostPage) noexcept;
  /// Reserves a host page for each block of a finished load and hands the worker the copies into
  /// them; returns the result when nothing is left to copy (a failed load, or every block held).
  std::optional<RemoteLoadResult> place(uint64_t ticket, PendingLoad& pending,
                                        RemoteTierWorker::LoadDone done);
  /// Indexes the placed pages of a load whose copies finished.
  RemoteLoadResult adopt(uint64_t ticket, PendingLoad& pending);
  /// Whether the GPU index or the host tier holds `block`.
  bool held(Hash128 block) const;
  std::string keyOf(Hash128 block) const { return remoteBlockKey(mDeployment, block); }

  RemoteTierConfig mConfig;
  ContextCacheManager& mManager;
  HostKvTier& mTier;
  int32_t mLayers;
  int64_t mPageBytes;  ///< one layer's K (or V) page
  Hash128 mDeployment;
  std::unique_ptr<RemoteKvStore> mLookupStore;  ///< the engine thread's connection
  RemoteTierCounters mCounters;
  std::vector<PageId> mHeldForSave;        ///< pinned host pages of saves not finished
  std::vector<PageId> mAwaitingCopy;       ///< of them, not yet handed to the worker
  std::map<uint64_t, PendingLoad> mLoads;  ///< by ticket
  std::vector<RemoteTierWorker::LoadDone> mFinishedLoads;  ///< fetched, waiting to be placed
  std::vector<uint64_t> mPlaced;                           ///< tickets whose copies finished
  int32_t mPlacements = 0;                                 ///< placed loads not yet adopted
  uint64_t mNextTicket = 1;
  uint64_t mNextSave = 1;
  std::unique_ptr<RemoteTierWorker> mWorker;  ///< last: stopped before the pages it reads go
};

}  // namespace mkv::detail
