// ContextCacheManager: the host tier's bookkeeping (docs/context_cache.md, "Host tier"):
// offload at eviction, pins and onboarding at admission, the plan checks.

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <optional>
#include <utility>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "core/check.h"
#include "mkv/logging.h"

namespace mkv {

void ContextCacheManager::offloadEvicted(PageId gpuPage, Hash128 digest) noexcept {
  (void)copyToHostTier(gpuPage, digest);
}

void ContextCacheManager::mirrorPublished(PageId gpuPage, Hash128 digest) noexcept {
  if (std::optional<PageId> const hostPage = copyToHostTier(gpuPage, digest)) {
    try {
      mMirroredBlocks.push_back(*hostPage);
    } catch (std::exception const&) {
      ++mMetrics.hostTierOffloadFailures;  // kept in the host tier, not saved to the store
    }
  }
}

std::optional<PageId> ContextCacheManager::copyToHostTier(PageId gpuPage, Hash128 digest) noexcept {
  if (!mHostTier) {
    return std::nullopt;
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
  announceHostDrops(dropped);
  if (hostPage == kNoPage) {
    return std::nullopt;
  }
  ++mStateVersion;  // plans made before may onboard a page that now holds another block
  mHostTransfers.offloads.push_back(HostTransfer{gpuPage, hostPage});
  ++mMetrics.offloadedPages;
  mMetrics.offloadedBytes += static_cast<uint64_t>(mOptions.hostTierBytesPerPage);
  announceHostStore(hostPage, digest);
  return hostPage;
}

void ContextCacheManager::announceHostDrops(std::span<HostBlockDropped const> dropped) noexcept {
  for (HostBlockDropped const& gone : dropped) {
    mEvents.push(BlockRemoved{gone.digest, gone.page, KvMedium::kCpu});
    // A block stored earlier in the same batch and dropped again: its copy is not needed, and its
    // page is the destination of the copy queued below.
    std::erase_if(mHostTransfers.offloads,
                  [&gone](HostTransfer const& pending) { return pending.hostPage == gone.page; });
    std::erase(mMirroredBlocks, gone.page);  // its save would read another block's bytes
  }
  mMetrics.hostTierDroppedPages += dropped.size();
}

void ContextCacheManager::announceHostStore(PageId hostPage, Hash128 digest) noexcept {
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

std::optional<PageId> ContextCacheManager::reserveHostPageForLoad(PromptBlocks const& blocks,
                                                                  int32_t block) {
  MKV_REQUIRE(mHostTier != nullptr, "ContextCacheManager::reserveHostPageForLoad",
              "the remote tier loads into the host tier, and this manager has none");
  Hash128 const digest = blocks.keys.at(static_cast<std::size_t>(block));
  if (mIndex.find(digest) || mHostTier->index().find(digest)) {
    return std::nullopt;  // held already
  }
  std::vector<HostBlockDropped> dropped;
  std::optional<PageId> const hostPage = mHostTier->reserve(dropped);
  announceHostDrops(dropped);
  return hostPage;
}

bool ContextCacheManager::adoptLoadedHostPage(PromptBlocks const& blocks, int32_t block,
                                              PageId page) {
  bool const inRange = block >= 0 && std::cmp_less(block, blocks.keys.size());
  if (inRange && mIndex.find(blocks.keys[static_cast<std::size_t>(block)])) {
    mHostTier->releaseReserved(page);  // the GPU came to hold it
    return false;
  }
  if (!mHostTier->fillReserved(page, blocks, block)) {  // checks the range, releases on a throw
    return false;
  }
  ++mStateVersion;
  announceHostStore(page, blocks.keys[static_cast<std::size_t>(block)]);
  return true;
}

void ContextCacheManager::holdHostPage(PageId page) { mHostTier->pin(page); }

void ContextCacheManager::releaseHostPage(PageId page) noexcept { mHostTier->unpin(page); }

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

int32_t ContextCacheManager::demoteToHostTier(std::span<Hash128 const> path) noexcept {
  if (!mHostTier) {
    return 0;
  }
  // Allocations first: a std::bad_alloc leaves everything as it was.
  std::vector<PageId> pages;      // the GPU-cached part of the path
  std::vector<RecordId> victims;  // block records ending past the kept prefix
  std::size_t kept = 0;           // blocks that stay on the GPU
  try {
    pages.reserve(path.size());
    for (Hash128 const& key : path) {
      std::optional<PageId> const page = mIndex.find(key);
      if (!page) {
        break;
      }
      pages.push_back(*page);
      if (mPools.activeRefs({ResourceType::kBaseKvPage, *page}) > 0) {
        kept = pages.size();  // a running row still reads it
      }
    }
    auto const room = static_cast<std::size_t>(mHostTier->capacity() - mHostTier->pinnedPages() -
                                               mHostTier->reservedPages());
    kept = std::max(kept, pages.size() > room ? pages.size() - room : std::size_t{0});
    CacheRecord const* longest = nullptr;
    for (std::size_t block = kept; block < pages.size(); ++block) {
      if (CacheRecord const* record =
              mRecords.find(RecordKey{path[block], static_cast<int32_t>(block + 1)})) {
        victims.push_back(record->id);
        longest = record;
      }
    }
    if (longest == nullptr) {
      return 0;
    }
    if (kept > 0 &&
        mRecords.find(RecordKey{path[kept - 1], static_cast<int32_t>(kept)}) == nullptr) {
      CacheRecord head;  // the kept prefix's own record: its pages stay cached
      head.key = RecordKey{path[kept - 1], static_cast<int32_t>(kept)};
      head.logicalBlockDigests.assign(path.begin(),
                                      path.begin() + static_cast<std::ptrdiff_t>(kept));
      head.basePagePath.assign(pages.begin(), pages.begin() + static_cast<std::ptrdiff_t>(kept));
      head.retentionPriority = longest->retentionPriority;
      head.retentionExpiry = longest->retentionExpiry;
      // The last step that can throw; adding cache references to held pages cannot.
      mRecords.insert(std::move(head)).record->forEachResource([this](ResourceId resource) {
        mPools.addCache(resource);
      });
    }
  } catch (std::exception const& error) {
    logger()->error("ContextCacheManager::demoteToHostTier: {}; the blocks stay on the GPU",
                    error.what());
    return 0;
  }
  for (RecordId victim : victims) {
    dropRecord(victim, true);  // offloads each block that loses its last cache reference
  }
  int32_t moved = 0;
  for (std::size_t block = kept; block < pages.size(); ++block) {
    moved += !mIndex.find(path[block]) && mHostTier->index().find(path[block]) ? 1 : 0;
  }
  mMetrics.swappedOutBlocks += static_cast<uint64_t>(moved);
  return moved;
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
