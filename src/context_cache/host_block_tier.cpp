#include "context_cache/host_block_tier.h"

#include "core/check.h"

namespace mkv {

namespace {

int32_t checkedCapacity(int32_t capacity) {
  MKV_REQUIRE(capacity > 0, "HostBlockTier", "capacity must be positive, got {} pages", capacity);
  return capacity;
}

}  // namespace

HostBlockTier::HostBlockTier(int32_t capacity, int32_t pageSize, bool verifyTokens)
    : mIndex(checkedCapacity(capacity), pageSize, verifyTokens, /*evictedHistory=*/0) {
  auto const pages = static_cast<std::size_t>(capacity);
  mLinks.resize(pages);
  mPins.assign(pages, 0);
  mFree.reserve(pages);
  for (PageId page = capacity - 1; page >= 0; --page) {
    mFree.push_back(page);  // page 0 is claimed first
  }
}

void HostBlockTier::checkHeld(char const* call, PageId page) const {
  MKV_REQUIRE(page >= 0 && page < capacity(), call, "host page {} outside [0, {})", page,
              capacity());
  MKV_REQUIRE(mIndex.digestOf(page).has_value(), call, "host page {} holds no block", page);
}

std::optional<PageId> HostBlockTier::claimPage(std::vector<HostBlockDropped>& dropped) {
  if (!mFree.empty()) {
    PageId const page = mFree.back();
    mFree.pop_back();
    return page;
  }
  for (RecordSlot page = mRecency.oldest; page != kNoRecordSlot;
       page = mLinks.newer[static_cast<std::size_t>(page)]) {
    if (mPins[static_cast<std::size_t>(page)] > 0) {
      continue;
    }
    dropped.push_back(HostBlockDropped{*mIndex.digestOf(page), page});
    mRecency.unlink(mLinks, page);
    mIndex.erasePage(page);
    return page;
  }
  return std::nullopt;
}

std::optional<PageId> HostBlockTier::store(BlockIndex const& gpu, PageId gpuPage,
                                           std::vector<HostBlockDropped>& dropped) {
  std::optional<Hash128> const digest = gpu.digestOf(gpuPage);
  MKV_REQUIRE(digest.has_value(), "HostBlockTier::store", "GPU page {} is not indexed", gpuPage);
  MKV_REQUIRE(
      gpu.pageSize() == mIndex.pageSize() && gpu.verifiesTokens() == mIndex.verifiesTokens(),
      "HostBlockTier::store", "GPU index has page size {}, the host tier {}", gpu.pageSize(),
      mIndex.pageSize());
  if (std::optional<PageId> const held = mIndex.find(*digest)) {
    touch(*held);
    return std::nullopt;
  }
  dropped.reserve(dropped.size() + 1);  // the only allocation of the drop, before anything moves
  std::optional<PageId> const page = claimPage(dropped);
  if (!page) {
    return std::nullopt;
  }
  try {
    mIndex.insertCopy(gpu, gpuPage, *page);
  } catch (...) {
    // Only an allocation of the index can fail here. The dropped block stays dropped (it is in
    // `dropped`); the claimed page goes back to the free list (reserved: cannot throw).
    mFree.push_back(*page);
    throw;
  }
  mRecency.pushNewest(mLinks, *page);
  return page;
}

std::optional<PageId> HostBlockTier::reserve(std::vector<HostBlockDropped>& dropped) {
  dropped.reserve(dropped.size() + 1);
  std::optional<PageId> const page = claimPage(dropped);
  if (page) {
    ++mReservedPages;
  }
  return page;
}

bool HostBlockTier::fillReserved(PageId page, PromptBlocks const& blocks, int32_t block) {
  MKV_DASSERT(mReservedPages > 0 && !mIndex.digestOf(page), "host page {} is not reserved", page);
  try {
    MKV_REQUIRE(block >= 0 && block < blocks.fullBlockCount(), "HostBlockTier::fillReserved",
                "block {} outside the prompt's {} full blocks", block, blocks.fullBlockCount());
    MKV_REQUIRE(blocks.pageSize == mIndex.pageSize(), "HostBlockTier::fillReserved",
                "the prompt has blocks of {} tokens, the host tier {}", blocks.pageSize,
                mIndex.pageSize());
    Hash128 const digest = blocks.keys[static_cast<std::size_t>(block)];
    if (std::optional<PageId> const held = mIndex.find(digest)) {
      touch(*held);
      releaseReserved(page);
      return false;
    }
    mIndex.insert(digest, page, blocks, block);
  } catch (...) {
    releaseReserved(page);
    throw;
  }
  --mReservedPages;
  mRecency.pushNewest(mLinks, page);
  return true;
}

void HostBlockTier::releaseReserved(PageId page) noexcept {
  MKV_DASSERT(mReservedPages > 0, "host page {} is not reserved", page);
  --mReservedPages;
  mFree.push_back(page);  // reserved to capacity: cannot throw
}

std::vector<PageId> HostBlockTier::longestRun(PromptBlocks const& blocks, int32_t firstBlock,
                                              int32_t maxBlocks) const {
  return mIndex.longestPrefix(blocks, maxBlocks, firstBlock).pages;
}

bool HostBlockTier::holds(PageId page, PromptBlocks const& blocks, int32_t block) const {
  return mIndex.holds(page, blocks, block, /*ancestorsVerified=*/true);
}

void HostBlockTier::pin(PageId page) {
  checkHeld("HostBlockTier::pin", page);
  if (mPins[static_cast<std::size_t>(page)]++ == 0) {
    ++mPinnedPages;
  }
}

void HostBlockTier::unpin(PageId page) noexcept {
  int32_t& pins = mPins[static_cast<std::size_t>(page)];
  MKV_DASSERT(pins > 0, "host page {} is not pinned", page);
  if (--pins == 0) {
    --mPinnedPages;
  }
}

void HostBlockTier::touch(PageId page) noexcept {
  mRecency.unlink(mLinks, page);
  mRecency.pushNewest(mLinks, page);
}

bool HostBlockTier::forget(PageId page) noexcept {
  if (page < 0 || page >= capacity() || !mIndex.digestOf(page)) {
    return false;
  }
  MKV_DASSERT(mPins[static_cast<std::size_t>(page)] == 0, "forgetting pinned host page {}", page);
  mRecency.unlink(mLinks, page);
  mIndex.erasePage(page, /*rememberEviction=*/false);
  mFree.push_back(page);  // reserved to capacity: cannot throw
  return true;
}

int32_t HostBlockTier::clear() noexcept {
  MKV_DASSERT(mPinnedPages == 0, "{} host pages pinned while clearing the host tier", mPinnedPages);
  int32_t cleared = 0;
  while (mRecency.oldest != kNoRecordSlot) {
    PageId const page = mRecency.oldest;
    mRecency.unlink(mLinks, page);
    mIndex.erasePage(page, /*rememberEviction=*/false);
    mFree.push_back(page);  // reserved to capacity: cannot throw
    ++cleared;
  }
  return cleared;
}

}  // namespace mkv
