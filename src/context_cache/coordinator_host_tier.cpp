// ContextCacheCoordinator: the host tier's copies (docs/context_cache.md, "Host tier"). The
// manager decides what moves; this part enqueues the moves right after the manager call that
// decided them and orders the request's stream after them.

#include <spdlog/spdlog.h>

#include <exception>

#include "context_cache/context_cache_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/host_kv_tier.h"
#include "mkv/logging.h"

namespace mkv {

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

bool ContextCacheCoordinator::moveHostTierPages(char const* call) noexcept {
  if (mResources.hostTier == nullptr) {
    return true;
  }
  HostTransfers const moves = mManager->takeHostTransfers();
  try {
    if (!moves.empty()) {
      copiesOf(moves.offloads, true, mOffloadCopies);
      copiesOf(moves.onboards, false, mOnboardCopies);
      mResources.hostTier->transfer(call, mOffloadCopies, mOnboardCopies, mStream);
      ++mCounters.hostTierTransfers;
    }
    mResources.hostTier->orderBefore(call, mStream);
    return true;
  } catch (std::exception const& error) {
    logger()->error("{}: moving pages between the GPU and the host tier failed: {}", call,
                    error.what());
  }
  // The offloaded blocks' bytes may never have arrived: the host tier forgets them. Onboarded
  // pages belong to the caller's leases, which the caller releases or quarantines.
  mManager->forgetHostBlocks(moves.offloads);
  poison();
  return false;
}

}  // namespace mkv
