#include "context_cache/window_block_cache.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <optional>

#include "core/check.h"
#include "core/prometheus_text.h"
#include "mkv/logging.h"

namespace mkv {

namespace {

constexpr char const* kCtor = "WindowBlockCache";

/// Validates the constructor's arguments; returns the window.
int32_t checkedWindow(int32_t capacity, int32_t pageSize, int32_t windowTokens) {
  MKV_REQUIRE(capacity > 0, kCtor, "capacity must be positive, got {} pages", capacity);
  MKV_REQUIRE(pageSize > 0, kCtor, "page size must be positive, got {} tokens", pageSize);
  MKV_REQUIRE(windowTokens > 0, kCtor, "window must be positive, got {} tokens", windowTokens);
  return windowTokens;
}

/// The free pages are a min-heap: allocate() hands out the lowest id first.
void pushFree(std::vector<PageId>& heap, PageId page) noexcept {
  heap.push_back(page);  // reserved to capacity: cannot throw
  std::push_heap(heap.begin(), heap.end(), std::greater<>{});
}

PageId popFree(std::vector<PageId>& heap) noexcept {
  std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
  PageId const page = heap.back();
  heap.pop_back();
  return page;
}

}  // namespace

WindowBlockCache::WindowBlockCache(int32_t capacity, int32_t pageSize, int32_t windowTokens,
                                   bool verifyTokens)
    : mWindowTokens(checkedWindow(capacity, pageSize, windowTokens)),
      mWindowBlocks(
          static_cast<int32_t>((static_cast<int64_t>(windowTokens) + pageSize - 1) / pageSize)),
      mIndex(capacity, pageSize, verifyTokens, /*evictedHistory=*/0) {
  auto const pages = static_cast<std::size_t>(capacity);
  mLinks.resize(pages);
  mHolders.assign(pages, 0);
  mTier.assign(pages, kUnread);
  mFree.reserve(pages);
  for (PageId page = 0; page < capacity; ++page) {
    mFree.push_back(page);  // ascending ids are already a min-heap
  }
}

void WindowBlockCache::checkPage(char const* call, PageId page) const {
  MKV_REQUIRE(page >= 0 && page < totalPages(), call, "page {} outside the sliding pool [0, {})",
              page, totalPages());
}

void WindowBlockCache::checkBlocks(char const* call, PromptBlocks const& blocks) const {
  MKV_REQUIRE(blocks.pageSize == mIndex.pageSize(), call,
              "blocks hashed with page size {}, the window cache uses {}", blocks.pageSize,
              mIndex.pageSize());
}

bool WindowBlockCache::cachesBlock(PromptBlocks const& blocks, int32_t block) const {
  std::optional<PageId> const page = mIndex.find(blocks.keys[static_cast<std::size_t>(block)]);
  return page && mIndex.holds(*page, blocks, block, /*ancestorsVerified=*/true);
}

int32_t WindowBlockCache::longestWindowedPrefix(PromptBlocks const& blocks,
                                                int32_t maxBlocks) const {
  constexpr char const* kCall = "WindowBlockCache::longestWindowedPrefix";
  checkBlocks(kCall, blocks);
  MKV_REQUIRE(maxBlocks >= 0 && maxBlocks <= blocks.fullBlockCount(), kCall,
              "maxBlocks {} outside [0, {}]", maxBlocks, blocks.fullBlockCount());
  // k qualifies when the run of cached blocks ending at block k - 1 covers min(k, windowBlocks).
  int32_t best = 0;
  int32_t run = 0;
  for (int32_t block = 0; block < maxBlocks; ++block) {
    run = cachesBlock(blocks, block) ? run + 1 : 0;
    if (run >= std::min(block + 1, mWindowBlocks)) {
      best = block + 1;
    }
  }
  return best;
}

std::vector<PageId> WindowBlockCache::windowPages(char const* call, PromptBlocks const& blocks,
                                                  int32_t endBlock) const {
  checkBlocks(call, blocks);
  MKV_REQUIRE(endBlock >= 0 && endBlock <= blocks.fullBlockCount(), call,
              "window end block {} outside [0, {}]", endBlock, blocks.fullBlockCount());
  int32_t const first = std::max(0, endBlock - mWindowBlocks);
  std::vector<PageId> pages;
  pages.reserve(static_cast<std::size_t>(endBlock - first));
  for (int32_t block = first; block < endBlock; ++block) {
    MKV_REQUIRE(cachesBlock(blocks, block), call,
                "block {} of the window [{}, {}) is not cached in the sliding pool", block, first,
                endBlock);
    pages.push_back(*mIndex.find(blocks.keys[static_cast<std::size_t>(block)]));
  }
  return pages;
}

bool WindowBlockCache::publish(PageId page, PromptBlocks const& blocks, int32_t block) {
  constexpr char const* kCall = "WindowBlockCache::publish";
  checkPage(kCall, page);
  checkBlocks(kCall, blocks);
  MKV_REQUIRE(block >= 0 && block < blocks.fullBlockCount(), kCall, "block {} outside [0, {})",
              block, blocks.fullBlockCount());
  MKV_REQUIRE(mHolders[static_cast<std::size_t>(page)] > 0, kCall,
              "page {} is not held: only a window's page can be published", page);
  Hash128 const digest = blocks.keys[static_cast<std::size_t>(block)];
  std::optional<Hash128> const current = mIndex.digestOf(page);
  MKV_REQUIRE(!current || *current == digest, kCall,
              "page {} already caches block {}; cannot cache block {} on it", page,
              toString(*current), toString(digest));
  if (current) {
    return true;
  }
  if (mIndex.find(digest)) {
    return false;  // first committer wins
  }
  mIndex.insert(digest, page, blocks, block);  // strong guarantee
  ++mPublishedBlocks;
  if (mEvents != nullptr) {
    mEvents->pushStored(BlockStored{digest,
                                    blocks.parentOf(block),
                                    page,
                                    mIndex.pageSize(),
                                    {},
                                    blocks.extrasDigest(block),
                                    KvMedium::kGpu,
                                    mEventGroup},
                        blocks.blockTokens(block));
  }
  return true;
}

int32_t WindowBlockCache::keepWindowBefore(PromptBlocks const& blocks, int32_t endBlock) {
  int32_t const marked =
      raiseWindowBefore("WindowBlockCache::keepWindowBefore", blocks, endBlock, kRead);
  mKeptBlocks += marked;
  return marked;
}

int32_t WindowBlockCache::keepPointWindow(PromptBlocks const& blocks, int32_t endBlock,
                                          int32_t rank) {
  auto const tier = static_cast<Tier>(kPointWindow + std::clamp(rank, 0, kMaxPointRank));
  return raiseWindowBefore("WindowBlockCache::keepPointWindow", blocks, endBlock, tier);
}

int32_t WindowBlockCache::raiseWindowBefore(char const* call, PromptBlocks const& blocks,
                                            int32_t endBlock, Tier tier) {
  checkBlocks(call, blocks);
  MKV_REQUIRE(endBlock >= 0 && endBlock <= blocks.fullBlockCount(), call,
              "window end block {} outside [0, {}]", endBlock, blocks.fullBlockCount());
  int32_t marked = 0;
  for (int32_t block = std::max(0, endBlock - mWindowBlocks); block < endBlock; ++block) {
    if (!cachesBlock(blocks, block)) {
      continue;
    }
    PageId const page = *mIndex.find(blocks.keys[static_cast<std::size_t>(block)]);
    auto const slot = static_cast<std::size_t>(page);
    if (mTier[slot] >= tier) {
      continue;
    }
    bool const cached = mHolders[slot] == 0;  // in a release order: move it between orders
    if (cached) {
      unlinkCached(page);
    }
    mTier[slot] = tier;
    if (cached) {
      linkCached(page);
    }
    ++marked;
  }
  return marked;
}

std::string WindowBlockCache::toPrometheus(std::string_view prefix) const {
  detail::PrometheusWriter w("WindowBlockCache::toPrometheus", prefix);
  w.gauge("sliding_pool_pages", "Pages of the sliding-window layers' pool.", totalPages());
  w.gauge("sliding_pool_free_pages", "Sliding pages neither held nor caching a block.",
          freePages());
  w.gauge("sliding_pool_held_pages", "Sliding pages held by running windows.", heldPages());
  w.gauge("sliding_window_cached_blocks", "Blocks whose sliding KV is cached (held or not).",
          cachedBlocks());
  w.gauge("sliding_window_read_blocks",
          "Cached blocks nobody holds that a hit's window has read (dropped last).",
          evictableReadPages());
  w.gauge("sliding_window_point_blocks",
          "Cached blocks nobody holds in the window before a reuse point, unread so far.",
          evictablePointPages());
  w.counter("sliding_window_published_blocks_total", "Blocks whose sliding KV was published.",
            mPublishedBlocks);
  w.counter("sliding_window_kept_blocks_total",
            "Cached sliding blocks kept in the read tier for the point a capped lookup wanted.",
            mKeptBlocks);
  w.counter("sliding_window_dropped_blocks_total",
            "Cached sliding blocks dropped to free their page.", mDroppedBlocks);
  return w.take();
}

int32_t WindowBlockCache::clear() noexcept {
  int32_t cleared = 0;
  for (PageId page = 0; page < totalPages(); ++page) {
    if (!mIndex.digestOf(page)) {
      continue;
    }
    ++mDroppedBlocks;
    mIndex.erasePage(page, /*rememberEviction=*/false);
    if (mHolders[static_cast<std::size_t>(page)] == 0) {
      unlinkCached(page);
      pushFree(mFree, page);
    }
    mTier[static_cast<std::size_t>(page)] = kUnread;
    ++cleared;
  }
  return cleared;
}

int32_t WindowBlockCache::availablePages() const noexcept { return freePages() + evictablePages(); }

bool WindowBlockCache::allocate(int32_t count, std::vector<PageId>& out) {
  MKV_REQUIRE(count >= 0, "WindowBlockCache::allocate", "negative page count {}", count);
  if (count > availablePages()) {
    return false;
  }
  out.reserve(out.size() + static_cast<std::size_t>(count));  // may throw: nothing changed yet
  for (int32_t i = 0; i < count; ++i) {
    PageId page = kNoPage;
    if (!mFree.empty()) {
      page = popFree(mFree);
    } else {
      page = firstVictim();
      unlinkCached(page);
      mTier[static_cast<std::size_t>(page)] = kUnread;
      ++mDroppedBlocks;
      if (mEvents != nullptr) {
        mEvents->push(BlockRemoved{*mIndex.digestOf(page), page, KvMedium::kGpu, mEventGroup});
      }
      mIndex.erasePage(page, /*rememberEviction=*/false);
    }
    mHolders[static_cast<std::size_t>(page)] = 1;
    ++mHeldPages;
    out.push_back(page);  // reserved
  }
  return true;
}

void WindowBlockCache::hold(PageId page) {
  constexpr char const* kCall = "WindowBlockCache::hold";
  checkPage(kCall, page);
  int32_t& holders = mHolders[static_cast<std::size_t>(page)];
  MKV_REQUIRE(holders > 0 || mIndex.digestOf(page).has_value(), kCall,
              "page {} is free: only a cached or held page can gain a holder", page);
  if (holders++ == 0) {
    unlinkCached(page);  // a cached page nobody held leaves the release order
    ++mHeldPages;
  }
  if (mIndex.digestOf(page)) {
    mTier[static_cast<std::size_t>(page)] = kRead;  // a window maps a cached block: a hit reads it
  }
}

void WindowBlockCache::release(PageId page) noexcept {
  if (page < 0 || page >= totalPages() || mHolders[static_cast<std::size_t>(page)] == 0)
      [[unlikely]] {
    // An internal bug of the caller's bookkeeping (a double release): the page may already be
    // another window's, so nothing can be trusted any more.
    logger()->critical("WindowBlockCache::release of page {}, which no holder holds", page);
    std::terminate();
  }
  int32_t& holders = mHolders[static_cast<std::size_t>(page)];
  if (--holders > 0) {
    return;
  }
  --mHeldPages;
  if (mIndex.digestOf(page)) {
    linkCached(page);
  } else {
    mTier[static_cast<std::size_t>(page)] = kUnread;
    pushFree(mFree, page);
  }
}

SlotList& WindowBlockCache::orderOf(PageId page) noexcept {
  uint8_t const tier = mTier[static_cast<std::size_t>(page)];
  if (tier == kUnread) {
    return mUnread;
  }
  return tier == kRead ? mRead : mPointWindows[static_cast<std::size_t>(tier - kPointWindow)];
}

PageId WindowBlockCache::firstVictim() const noexcept {
  if (!mUnread.empty()) {
    return mUnread.oldest;
  }
  if (mPointPages > 0) {
    for (SlotList const& rank : mPointWindows) {
      if (!rank.empty()) {
        return rank.oldest;
      }
    }
  }
  return mRead.oldest;
}

bool WindowBlockCache::inPointTier(PageId page) const noexcept {
  uint8_t const tier = mTier[static_cast<std::size_t>(page)];
  return tier != kUnread && tier != kRead;
}

void WindowBlockCache::linkCached(PageId page) noexcept {
  orderOf(page).pushNewest(mLinks, page);
  mPointPages += inPointTier(page) ? 1 : 0;
}

void WindowBlockCache::unlinkCached(PageId page) noexcept {
  orderOf(page).unlink(mLinks, page);
  mPointPages -= inPointTier(page) ? 1 : 0;
}

int32_t WindowBlockCache::holders(PageId page) const {
  checkPage("WindowBlockCache::holders", page);
  return mHolders[static_cast<std::size_t>(page)];
}

}  // namespace mkv
