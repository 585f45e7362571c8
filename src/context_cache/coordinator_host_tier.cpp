// HostTierMover: the host tier's page moves, launched for the coordinator.

#include "context_cache/coordinator_host_tier.h"

#include <spdlog/spdlog.h>

#include <exception>

#include "context_cache/context_cache_manager.h"
#include "context_cache/coordinator_remote_tier.h"
#include "mkv/logging.h"

namespace mkv::detail {

namespace {

void copiesOf(std::vector<HostTransfer> const& moves, bool offload,
              std::vector<HostPageCopy>& copies) {
  copies.clear();
  for (HostTransfer const& move : moves) {
    copies.push_back(offload ? HostPageCopy{move.gpuPage, move.hostPage}
                             : HostPageCopy{move.hostPage, move.gpuPage});
  }
}

}  // namespace

HostTierMover::HostTierMover(ContextCacheManager& manager, HostKvTier* tier, cudaStream_t stream,
                             ContextCacheCoordinatorCounters& counters,
                             std::function<void()> poison)
    : mManager(manager),
      mTier(tier),
      mStream(stream),
      mCounters(counters),
      mPoison(std::move(poison)) {
  if (tier != nullptr) {
    mOffloadCopies.reserve(static_cast<std::size_t>(tier->numPages()));
    mOnboardCopies.reserve(static_cast<std::size_t>(tier->numPages()));
  }
}

bool HostTierMover::move(char const* call) noexcept {
  if (mTier == nullptr) {
    return true;
  }
  HostTransfers const moves = mManager.takeHostTransfers();
  try {
    if (!moves.empty()) {
      copiesOf(moves.offloads, true, mOffloadCopies);
      copiesOf(moves.onboards, false, mOnboardCopies);
      mTier->transfer(call, mOffloadCopies, mOnboardCopies, mStream);
      ++mCounters.hostTierTransfers;
    }
    mTier->orderBefore(call, mStream);
    if (mRemote != nullptr) {
      mRemote->takeMirrored();
    }
    return true;
  } catch (std::exception const& error) {
    logger()->error("{}: moving pages between the GPU and the host tier failed: {}", call,
                    error.what());
  }
  mManager.forgetHostBlocks(moves.offloads);
  (void)mManager.takeMirroredBlocks();  // their copies may never have run: not saved
  mPoison();
  return false;
}

bool HostTierMover::synchronize() noexcept {
  return mTier == nullptr || mTier->synchronize() == cudaSuccess;
}

}  // namespace mkv::detail
