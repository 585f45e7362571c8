// ContextCacheCoordinator: the composed backend's sliding pool (resources.windowCache). The
// window rule itself is applied by every vanilla lookup of the manager (makeWindowedReusePlan);
// here the sliding pages of a row's committed blocks are published and the cached window before a
// row's prefill start is found (docs/context_cache.md, "Window rule").

#include <algorithm>

#include "context_cache/cache_record.h"
#include "context_cache/coordinator_request.h"
#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv {

namespace {

WindowBlockCache& windowOf(WindowBlockCache* window, char const* call) {
  MKV_REQUIRE(window != nullptr, call,
              "no window cache: the coordinator was built without resources.windowCache");
  return *window;
}

/// Every page may take its block (held, in range, uncached or caching that very block: checked
/// when `blocks` is given) and none is given twice: publishing them all cannot fail a contract
/// half-way.
void checkWindowPages(char const* call, WindowBlockCache const& window, PromptBlocks const* blocks,
                      int32_t firstBlock, std::span<PageId const> pages) {
  for (std::size_t i = 0; i < pages.size(); ++i) {
    PageId const page = pages[i];
    MKV_REQUIRE(page >= 0 && page < window.totalPages(), call,
                "page {} outside the sliding pool [0, {})", page, window.totalPages());
    MKV_REQUIRE(window.holders(page) > 0, call, "sliding page {} is not held", page);
    std::optional<Hash128> const digest = window.index().digestOf(page);
    auto const block = static_cast<std::size_t>(firstBlock) + i;
    MKV_REQUIRE(!digest || blocks == nullptr || *digest == blocks->keys[block], call,
                "sliding page {} already caches another block than block {}", page, block);
    MKV_REQUIRE(std::find(pages.begin(), pages.begin() + static_cast<std::ptrdiff_t>(i), page) ==
                    pages.begin() + static_cast<std::ptrdiff_t>(i),
                call, "sliding page {} given twice", page);
  }
}

}  // namespace

int32_t ContextCacheCoordinator::publishWindowBlocks(RequestHandle const& handle, ExecutionRow row,
                                                     int32_t firstBlock,
                                                     std::span<PageId const> pages) {
  constexpr char const* kCall = "ContextCacheCoordinator::publishWindowBlocks";
  Request& req = request(handle, kCall);
  WindowBlockCache& window = windowOf(mResources.windowCache, kCall);
  Sequence const& sequence = detail::sequenceAt(req, row, kCall);
  MKV_REQUIRE(req.stage != RequestStage::kAdmitted && req.stage != RequestStage::kPrefilling &&
                  sequence.joined,
              kCall, "row {} of request {} has not completed its prefill", row, req.id);
  int32_t const page = mManager->pageSize();
  // The full layers publish generated blocks under the same policy (publishCompleted).
  bool const generated =
      sequence.commitPolicy == ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  int32_t const fullBlocks = (generated ? sequence.committed : sequence.promptLength) / page;
  auto const count = static_cast<int64_t>(pages.size());
  MKV_REQUIRE(firstBlock >= 0 && firstBlock + count <= fullBlocks, kCall,
              "blocks [{}, {}) are not full blocks of row {}'s {} ({} full blocks)", firstBlock,
              firstBlock + count, row, generated ? "committed tokens" : "prompt", fullBlocks);
  if (sequence.policy == ContextCacheLookupPolicy::kBypass) {
    checkWindowPages(kCall, window, nullptr, firstBlock, pages);
    return 0;
  }
  auto const end = static_cast<int32_t>(firstBlock + count);
  PromptBlocks const blocks = hashPromptBlocks(detail::prefixOf(sequence, end * page), page);
  checkWindowPages(kCall, window, &blocks, firstBlock, pages);
  int32_t published = 0;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    published += window.publish(pages[i], blocks, firstBlock + static_cast<int32_t>(i)) ? 1 : 0;
  }
  // A lookup of this row found the full layers' prefix up to hitEnd but not the window before it:
  // keep the window this prefill recomputed there for the next hit at that point.
  int32_t const hitEnd = (sequence.reuseTokenLength + sequence.windowLimitedTokens) / page;
  if (sequence.windowLimitedTokens > 0 && hitEnd > firstBlock && hitEnd <= end) {
    (void)window.keepWindowBefore(blocks, hitEnd);
  }
  // Reuse points: the window before each point these blocks complete is kept, so a later prompt
  // that diverges anywhere lands on the last point before the divergence with its window; the
  // blocks between the windows are the first a full sliding pool drops, then the windows of the
  // points at odd intervals, then those at odd multiples of two intervals, and so on: the pool
  // thins every prompt's points before it drops any prompt's coarse ones.
  if (int32_t const interval = mConfig.checkpointInterval / page; interval > 0) {
    for (int32_t point = (firstBlock / interval + 1) * interval; point <= end; point += interval) {
      (void)window.keepPointWindow(blocks, point, reusePointRank(point / interval));
    }
  }
  return published;
}

std::vector<PageId> ContextCacheCoordinator::reusedWindowPages(RequestHandle const& handle,
                                                               ExecutionRow row) const {
  constexpr char const* kCall = "ContextCacheCoordinator::reusedWindowPages";
  Request const& req = request(handle, kCall);
  WindowBlockCache const& window = windowOf(mResources.windowCache, kCall);
  Sequence const& sequence = detail::sequenceAt(req, row, kCall);
  int32_t const page = mManager->pageSize();
  int32_t const endBlock = sequence.reuseTokenLength / page;
  if (endBlock == 0) {
    return {};
  }
  PromptBlocks const blocks = hashPromptBlocks(detail::prefixOf(sequence, endBlock * page), page);
  return window.windowPages(kCall, blocks, endBlock);
}

}  // namespace mkv
