#include "context_cache/block_index.h"

#include <algorithm>

#include "core/check.h"

namespace mkv {

namespace {

int32_t checkedHistory(int32_t evictedHistory) {
  MKV_REQUIRE(evictedHistory >= 0, "BlockIndex", "evicted history must be non-negative, got {}",
              evictedHistory);
  return evictedHistory;
}

}  // namespace

BlockIndex::BlockIndex(int32_t pageCapacity, int32_t pageSize, bool verifyTokens,
                       int32_t evictedHistory)
    : mPageCapacity(pageCapacity),
      mPageSize(pageSize),
      mVerifyTokens(verifyTokens),
      mEvicted(checkedHistory(evictedHistory)) {
  MKV_REQUIRE(pageCapacity >= 0, "BlockIndex", "page capacity must be non-negative, got {}",
              pageCapacity);
  MKV_REQUIRE(pageSize > 0, "BlockIndex", "page size must be positive, got {}", pageSize);
  mEntries.resize(static_cast<std::size_t>(pageCapacity));
  if (verifyTokens) {
    mTokens.resize(static_cast<std::size_t>(pageCapacity) * static_cast<std::size_t>(pageSize));
  }
  mByDigest.reserve(static_cast<std::size_t>(pageCapacity));
}

void BlockIndex::checkPage(char const* call, PageId page) const {
  MKV_REQUIRE(page >= 0 && page < mPageCapacity, call, "page {} outside [0, {})", page,
              mPageCapacity);
}

BlockProvenance BlockIndex::provenanceOf(PromptBlocks const& blocks, int32_t block) {
  auto const b = static_cast<std::size_t>(block);
  return BlockProvenance{blocks.contentKey(block), blocks.prompt.extras.salt,
                         blocks.prompt.extras.adapter, blocks.mediaDigests[b]};
}

std::optional<PageId> BlockIndex::find(Hash128 digest) const noexcept {
  auto const it = mByDigest.find(digest);
  if (it == mByDigest.end()) {
    return std::nullopt;
  }
  return it->second;
}

std::optional<Hash128> BlockIndex::digestOf(PageId page) const {
  checkPage("BlockIndex::digestOf", page);
  Entry const& e = mEntries[static_cast<std::size_t>(page)];
  return e.indexed ? std::optional<Hash128>(e.digest) : std::nullopt;
}

Hash128 BlockIndex::parentOf(PageId page) const {
  checkPage("BlockIndex::parentOf", page);
  Entry const& e = mEntries[static_cast<std::size_t>(page)];
  MKV_REQUIRE(e.indexed, "BlockIndex::parentOf", "page {} is not indexed", page);
  return e.parent;
}

BlockProvenance const& BlockIndex::provenanceOf(PageId page) const {
  checkPage("BlockIndex::provenanceOf", page);
  Entry const& e = mEntries[static_cast<std::size_t>(page)];
  MKV_REQUIRE(e.indexed, "BlockIndex::provenanceOf", "page {} is not indexed", page);
  return e.provenance;
}

std::span<int32_t const> BlockIndex::tokensOf(PageId page) const {
  checkPage("BlockIndex::tokensOf", page);
  MKV_REQUIRE(mEntries[static_cast<std::size_t>(page)].indexed, "BlockIndex::tokensOf",
              "page {} is not indexed", page);
  if (!mVerifyTokens) {
    return {};
  }
  return std::span<int32_t const>(mTokens).subspan(
      static_cast<std::size_t>(page) * static_cast<std::size_t>(mPageSize),
      static_cast<std::size_t>(mPageSize));
}

Hash128 BlockIndex::extrasOf(PageId page) const {
  BlockProvenance const& kept = provenanceOf(page);
  bool const firstBlock = mEntries[static_cast<std::size_t>(page)].parent == kBlockChainRoot;
  return extrasDigestOf(kept.media, kept.adapter, firstBlock ? kept.salt : Hash128{});
}

std::vector<BlockProvenance> BlockIndex::provenanceByContent(Hash128 contentKey) const {
  std::vector<BlockProvenance> out;
  auto const [first, last] = mByContent.equal_range(contentKey);
  for (auto it = first; it != last; ++it) {
    out.push_back(mEntries[static_cast<std::size_t>(it->second)].provenance);
  }
  return out;
}

bool BlockIndex::holds(PageId page, PromptBlocks const& blocks, int32_t block,
                       bool ancestorsVerified) const {
  checkPage("BlockIndex::holds", page);
  MKV_REQUIRE(block >= 0 && block < blocks.fullBlockCount(), "BlockIndex::holds",
              "block {} outside [0, {})", block, blocks.fullBlockCount());
  MKV_REQUIRE(blocks.pageSize == mPageSize, "BlockIndex::holds",
              "blocks hashed with page size {}, index uses {}", blocks.pageSize, mPageSize);
  Entry const& e = mEntries[static_cast<std::size_t>(page)];
  if (!e.indexed || e.digest != blocks.keys[static_cast<std::size_t>(block)]) {
    return false;
  }
  return verified(e, page, blocks, block, ancestorsVerified);
}

bool BlockIndex::verified(Entry const& e, PageId page, PromptBlocks const& blocks, int32_t block,
                          bool ancestorsVerified) const {
  if (!mVerifyTokens) {
    return true;
  }
  BlockKeyExtras const& extras = blocks.prompt.extras;
  BlockProvenance const& kept = e.provenance;
  if (e.parent != blocks.parentOf(block) || kept.salt != extras.salt ||
      kept.adapter != extras.adapter ||
      kept.media != blocks.mediaDigests[static_cast<std::size_t>(block)]) {
    return false;
  }
  // Equal content chains follow from equal tokens in this block and in every ancestor; compare
  // the chain only when the ancestors were not token-verified in this walk.
  if (block > 0 && !ancestorsVerified && kept.contentKey != blocks.contentKey(block)) {
    return false;
  }
  std::span<int32_t const> const tokens = blocks.blockTokens(block);
  auto const stored = mTokens.begin() + static_cast<std::ptrdiff_t>(page) * mPageSize;
  if (!std::equal(tokens.begin(), tokens.end(), stored)) {
    return false;
  }
  if (e.provenance.media.isZero()) {
    return true;
  }
  auto const media = mMedia.find(page);
  std::span<MediaPosition const> const expected = blocks.blockMedia(block);
  return media != mMedia.end() &&
         std::equal(expected.begin(), expected.end(), media->second.begin(), media->second.end());
}

BlockIndex::PrefixMatch BlockIndex::longestPrefix(PromptBlocks const& blocks, int32_t maxBlocks,
                                                  int32_t firstBlock) const {
  MKV_REQUIRE(blocks.pageSize == mPageSize, "BlockIndex::longestPrefix",
              "blocks hashed with page size {}, index uses {}", blocks.pageSize, mPageSize);
  MKV_REQUIRE(firstBlock >= 0, "BlockIndex::longestPrefix", "first block {} is negative",
              firstBlock);
  PrefixMatch match;
  int32_t const limit = std::clamp(maxBlocks, 0, blocks.fullBlockCount());
  match.pages.reserve(static_cast<std::size_t>(std::max(0, limit - firstBlock)));
  for (int32_t b = firstBlock; b < limit; ++b) {
    auto const it = mByDigest.find(blocks.keys[static_cast<std::size_t>(b)]);
    if (it == mByDigest.end()) {
      break;
    }
    // An indexed digest names an indexed entry of a valid page: holds() minus its checks.
    PageId const page = it->second;
    // Blocks [0, b) were verified by this loop (or, before firstBlock, by the caller): their
    // tokens already imply equal content.
    if (!verified(mEntries[static_cast<std::size_t>(page)], page, blocks, b,
                  /*ancestorsVerified=*/true)) {
      match.verificationRejected = true;
      break;
    }
    match.pages.push_back(page);
  }
  return match;
}

PageId BlockIndex::insert(Hash128 digest, PageId page, PromptBlocks const& blocks, int32_t block) {
  checkPage("BlockIndex::insert", page);
  MKV_REQUIRE(block >= 0 && block < blocks.fullBlockCount(), "BlockIndex::insert",
              "block {} outside [0, {})", block, blocks.fullBlockCount());
  MKV_REQUIRE(blocks.pageSize == mPageSize, "BlockIndex::insert",
              "blocks hashed with page size {}, index uses {}", blocks.pageSize, mPageSize);
  if (std::optional<PageId> const existing = find(digest)) {
    return *existing;
  }
  Entry& e = mEntries[static_cast<std::size_t>(page)];
  MKV_REQUIRE(!e.indexed, "BlockIndex::insert",
              "page {} is already indexed under digest {}; cannot index it under {}", page,
              toString(e.digest), toString(digest));
  BlockProvenance const provenance = provenanceOf(blocks, block);
  std::span<MediaPosition const> const media = blocks.blockMedia(block);
  bool const keepMedia = mVerifyTokens && !provenance.media.isZero();

  indexMaps(digest, provenance.contentKey, page,
            keepMedia ? std::optional(std::vector<MediaPosition>(media.begin(), media.end()))
                      : std::nullopt);
  e = Entry{true, digest, blocks.parentOf(block), provenance};
  if (mVerifyTokens) {
    std::span<int32_t const> const tokens = blocks.blockTokens(block);
    std::copy(tokens.begin(), tokens.end(),
              mTokens.begin() + static_cast<std::ptrdiff_t>(page) * mPageSize);
  }
  return page;
}

PageId BlockIndex::insertCopy(BlockIndex const& source, PageId sourcePage, PageId page) {
  constexpr char const* kCall = "BlockIndex::insertCopy";
  checkPage(kCall, page);
  source.checkPage(kCall, sourcePage);
  MKV_REQUIRE(source.mPageSize == mPageSize && source.mVerifyTokens == mVerifyTokens, kCall,
              "source index has page size {} and verification {}, this one {} and {}",
              source.mPageSize, source.mVerifyTokens, mPageSize, mVerifyTokens);
  Entry const& from = source.mEntries[static_cast<std::size_t>(sourcePage)];
  MKV_REQUIRE(from.indexed, kCall, "source page {} is not indexed", sourcePage);
  if (std::optional<PageId> const existing = find(from.digest)) {
    return *existing;
  }
  Entry& e = mEntries[static_cast<std::size_t>(page)];
  MKV_REQUIRE(!e.indexed, kCall,
              "page {} is already indexed under digest {}; cannot index it under {}", page,
              toString(e.digest), toString(from.digest));
  auto const media = source.mMedia.find(sourcePage);
  indexMaps(from.digest, from.provenance.contentKey, page,
            media != source.mMedia.end() ? std::optional(media->second) : std::nullopt);
  e = from;
  if (mVerifyTokens) {
    std::span<int32_t const> const tokens = source.tokensOf(sourcePage);
    std::copy(tokens.begin(), tokens.end(),
              mTokens.begin() + static_cast<std::ptrdiff_t>(page) * mPageSize);
  }
  return page;
}

void BlockIndex::indexMaps(Hash128 digest, Hash128 contentKey, PageId page,
                           std::optional<std::vector<MediaPosition>> media) {
  // Each allocating step is undone if a later one throws.
  auto const digestIt = mByDigest.emplace(digest, page).first;
  try {
    auto const contentIt = mByContent.emplace(contentKey, page);
    try {
      if (media) {
        mMedia.insert_or_assign(page, std::move(*media));
      }
    } catch (...) {
      mByContent.erase(contentIt);
      throw;
    }
  } catch (...) {
    mByDigest.erase(digestIt);
    throw;
  }
}

bool BlockIndex::erasePage(PageId page, bool rememberEviction) noexcept {
  if (page < 0 || page >= mPageCapacity) {
    return false;
  }
  Entry& e = mEntries[static_cast<std::size_t>(page)];
  if (!e.indexed) {
    return false;
  }
  mByDigest.erase(e.digest);
  auto [first, last] = mByContent.equal_range(e.provenance.contentKey);
  for (auto it = first; it != last; ++it) {
    if (it->second == page) {
      mByContent.erase(it);
      break;
    }
  }
  mMedia.erase(page);
  if (rememberEviction) {
    mEvicted.insert(e.digest);
  }
  e.indexed = false;
  return true;
}

}  // namespace mkv
