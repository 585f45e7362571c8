#pragma once
/// \file coordinator_remote_tier.h
/// The coordinator's side of the remote tier (not installed; docs/context_cache.md, "Remote
/// tier"): lookups on the engine thread's store connection, loads and saves through the worker,
/// and the host-tier steps between them — loaded blocks become host-tier blocks, published blocks
/// copied to the host tier are saved from there.

#include <cstdint>
#include <map>
#include <memory>
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
  /// finished saves, and puts finished loads into the host tier while no host transfer is in
  /// flight (otherwise they wait for the next poll). Returns the loads put there. Throws
  /// mkv::Error naming `call` on a CUDA failure of the host tier's query.
  std::vector<RemoteLoadResult> poll(char const* call);
  /// Waits for the worker (a cache reset, shutdown, tests), then polls.
  std::vector<RemoteLoadResult> drain(char const* call);
  /// Host pages held for saves (queued or running).
  int32_t pendingSaves() const noexcept { return static_cast<int32_t>(mHeldForSave.size()); }
  RemoteTierCounters const& counters() const noexcept { return mCounters; }

 private:
  struct PendingLoad {
    std::unique_ptr<ContextCacheSequenceAdmission> sequence;  ///< what `blocks` refers to
    PromptBlocks blocks;
    int32_t firstBlock = 0;
    int32_t requestedBlocks = 0;
  };

  void submitSaves(char const* call);
  /// The BlockStored event (medium kRemote) of the block a finished save wrote from `hostPage`.
  void announceSaved(PageId hostPage) noexcept;
  RemoteLoadResult install(PendingLoad const& pending, RemoteTierWorker::LoadDone const& done);
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
  std::vector<RemoteTierWorker::LoadDone> mFinishedLoads;  ///< waiting to be installed
  uint64_t mNextTicket = 1;
  uint64_t mNextSave = 1;
  std::unique_ptr<RemoteTierWorker> mWorker;  ///< last: stopped before the pages it reads go
};

}  // namespace mkv::detail
