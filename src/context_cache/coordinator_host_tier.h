#pragma once
/// \file coordinator_host_tier.h
/// The coordinator's side of the host tier (not installed): launching the page moves between GPU
/// and host pages that the manager decided (offloads of evicted blocks, onboardings of hits). A
/// deployment without a host tier has a mover that has nothing to move.

#include <functional>
#include <vector>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/host_kv_tier.h"

namespace mkv::detail {

class RemoteTierLink;

class HostTierMover {
 public:
  /// `tier` may be null (no host tier). `poison` poisons the coordinator. The copy lists are
  /// reserved here for the most moves one call can make (every host page offloaded or onboarded):
  /// a move never allocates, so running out of host memory cannot poison the coordinator.
  HostTierMover(ContextCacheManager& manager, HostKvTier* tier, cudaStream_t stream,
                ContextCacheCoordinatorCounters& counters, std::function<void()> poison);

  /// Enqueues the moves the manager decided since the last call, then orders the stream after the
  /// tier's copies. False when a launch failed: the offloaded blocks are forgotten and the
  /// coordinator is poisoned (`call` names the integrator's call in the log).
  bool move(char const* call) noexcept;
  /// Waits for the tier's copies; true without a tier or when they completed.
  bool synchronize() noexcept;
  /// The remote tier whose saves read the blocks mirrored to the host tier (or null): after
  /// each successful move it takes the mirrored blocks whose copies that move enqueued.
  void attachRemoteTier(RemoteTierLink* remote) noexcept { mRemote = remote; }

 private:
  ContextCacheManager& mManager;
  HostKvTier* mTier;
  cudaStream_t mStream;
  ContextCacheCoordinatorCounters& mCounters;
  std::function<void()> mPoison;
  RemoteTierLink* mRemote = nullptr;
  std::vector<HostPageCopy> mOffloadCopies;  ///< capacity: the tier's pages
  std::vector<HostPageCopy> mOnboardCopies;
};

}  // namespace mkv::detail
