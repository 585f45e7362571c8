// ContextCacheManager: the host tier's bookkeeping (docs/context_cache.md, "Host tier"):
// offload at eviction, pins and onboarding at admission, the plan checks.

#include <spdlog/spdlog.h>

#include <exception>

#include "context_cache/context_cache_manager.h"
#include "core/check.h"
#include "mkv/logging.h"

namespace mkv {

void ContextCacheManager::offloadEvicted(PageId gpuPage, Hash128 digest) noexcept {
  if (!mHostTier) {
    return;
  }
  std::vector<HostBlockDropped> dropped;
  PageId hostPage = kNoPage;
  try {
    mHostTransfers.offloads.reserve(mHostTransfers.offloads.size() + 1);
    hostPage = mHostTier->store(mIndex, gpuPage, dropped).value_or(kNoPage);
  } catch (std::exception const& error) {
    // Only allocations can fail here: the block is not kept (as without a host tier).
    logger()->error("ContextCacheManager: offloading block {} failed: {}", toString(digest),
                    error.what());
    ++mMetrics.hostTierOffloadFailures;
  }
  for (HostBlockDropped const& gone : dropped) {
    mEvents.push(BlockRemoved{gone.digest, gone.page, KvMedium::kCpu});
    // A block stored earlier in the same batch and dropped again: its copy is not needed, and its
    // page is the destination of the copy queued below.
    std::erase_if(mHostTransfers.offloads,
                  [&gone](HostTransfer const& pending) { return pending.hostPage == gone.page; });
  }
  mMetrics.hostTierDroppedPages += dropped.size();
  if (hostPage == kNoPage) {
    return;
  }
  ++mStateVersion;  // plans made before may onboard a page that now holds another block
  mHostTransfers.offloads.push_back(HostTransfer{gpuPage, hostPage});
  ++mMetrics.offloadedPages;
  mMetrics.offloadedBytes += static_cast<uint64_t>(mOptions.hostTierBytesPerPage);
  BlockIndex const& host = mHostTier->index();
  mEvents.pushStored(BlockStored{digest,
                                 host.parentOf(hostPage),
                                 hostPage,
                                 mPageSize,
                                 {},
                                 host.extrasOf(hostPage),
                                 KvMedium::kCpu},
                     host.tokensOf(hostPage));
}

void ContextCacheManager::forgetHostBlocks(std::span<HostTransfer const> offloads) noexcept {
  for (HostTransfer const& offload : offloads) {
    std::optional<Hash128> const digest = mHostTier->index().digestOf(offload.hostPage);
    if (digest && mHostTier->forget(offload.hostPage)) {
      mEvents.push(BlockRemoved{*digest, offload.hostPage, KvMedium::kCpu});
      ++mMetrics.hostTierDroppedPages;
      ++mStateVersion;
    }
  }
}

void ContextCacheManager::pinHostPages(CacheRequestLease& lease, ReusePlan const& plan) {
  if (plan.hostOnboardPages.empty()) {
    return;
  }
  lease.mHostPins.reserve(plan.hostOnboardPages.size());
  for (PageId page : plan.hostOnboardPages) {
    mHostTier->pin(page);  // checked by checkHostPlan: holds its block
    lease.mHostPins.push_back(page);
  }
}

void ContextCacheManager::queueOnboarding(CacheRequestLease& lease, ReusePlan const& plan) {
  if (plan.hostOnboardPages.empty()) {
    return;
  }
  auto const bound = static_cast<std::size_t>(lease.mBoundBasePages);
  mHostTransfers.onboards.reserve(mHostTransfers.onboards.size() + plan.hostOnboardPages.size());
  for (std::size_t i = 0; i < plan.hostOnboardPages.size(); ++i) {
    PageId const hostPage = plan.hostOnboardPages[i];
    mHostTransfers.onboards.push_back(HostTransfer{lease.mBasePages[bound + i], hostPage});
    mHostTier->touch(hostPage);
    mHostTier->unpin(hostPage);
  }
  lease.mHostPins.clear();
  auto const pages = static_cast<uint64_t>(plan.hostOnboardPages.size());
  mMetrics.onboardedPages += pages;
  mMetrics.onboardedBytes += pages * static_cast<uint64_t>(mOptions.hostTierBytesPerPage);
}

void ContextCacheManager::checkHostPlan(char const* call, ReusePlan const& plan, bool fresh) const {
  if (plan.hostOnboardPages.empty() && plan.hostOnboardDigests.empty()) {
    return;
  }
  MKV_REQUIRE(mHostTier != nullptr && plan.mode == ReuseMode::kVanilla, call,
              "a {} plan onboards {} host pages{}", toString(plan.mode),
              plan.hostOnboardPages.size(), mHostTier ? "" : " on a manager without a host tier");
  MKV_REQUIRE(plan.hostOnboardPages.size() == plan.hostOnboardDigests.size(), call,
              "{} host pages for {} onboarded blocks", plan.hostOnboardPages.size(),
              plan.hostOnboardDigests.size());
  MKV_REQUIRE(std::cmp_less_equal(plan.hostOnboardPages.size(), plan.demand.baseKvPages), call,
              "{} onboarded blocks but a demand of {} base pages", plan.hostOnboardPages.size(),
              plan.demand.baseKvPages);
  for (std::size_t i = 0; !fresh && i < plan.hostOnboardPages.size(); ++i) {
    std::optional<PageId> const page = mHostTier->index().find(plan.hostOnboardDigests[i]);
    MKV_REQUIRE(page == plan.hostOnboardPages[i], call,
                "stale plan: onboarded block {} is no longer on host page {}", i,
                plan.hostOnboardPages[i]);
  }
}

}  // namespace mkv
