#pragma once
/// \file block_index.h
/// Block digest -> canonical base page (the first producer's), with token verification
/// (docs/context_cache.md, "Keys" and "Publication points").
///
/// Thread-safety: single writer; const members may run concurrently with each other only.

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/recent_digest_set.h"
#include "mkv/types.h"

namespace mkv {

/// What an indexed block was published under, beyond its key: its token-only chain digest and the
/// request-wide extras and block media it was keyed with. Used to explain misses (same text under
/// another salt / adapter / media) and, with verification on, checked on every match.
struct BlockProvenance {
  Hash128 contentKey;
  Hash128 salt;
  Hash128 adapter;
  Hash128 media;
  friend bool operator==(BlockProvenance const&, BlockProvenance const&) = default;
};

/// Maps block keys to canonical base pages: first committer wins, a digest names at most one page
/// and a page is indexed under at most one digest. Page ids are base KV PageIds in
/// [0, pageCapacity).
///
/// *Token verification* (beyond the reference, on by default): each entry also keeps its block's
/// token ids (one flat int32 array of pageCapacity * pageSize), parent digest, provenance and, for
/// media blocks, the exact media positions. A match is accepted only when all of them equal the
/// requesting prompt's block, so a 128-bit digest collision can never hand a request another
/// prompt's KV: it is reported as a miss (PrefixMatch::verificationRejected).
///
/// erasePage() records the erased digest in a bounded FIFO history (wasRecentlyEvicted).
class BlockIndex {
 public:
  /// Throws unless pageCapacity >= 0, pageSize > 0 and evictedHistory >= 0.
  BlockIndex(int32_t pageCapacity, int32_t pageSize, bool verifyTokens, int32_t evictedHistory);

  /// Result of a longest-prefix lookup.
  struct PrefixMatch {
    std::vector<PageId> pages;          ///< canonical page of block i, for i < pages.size()
    bool verificationRejected = false;  ///< the walk stopped at a digest hit whose content differs
  };

  /// Longest run of blocks [firstBlock, firstBlock + k) of `blocks`, firstBlock + k <= maxBlocks,
  /// whose keys are indexed (and, with verification, whose content matches; blocks before
  /// `firstBlock` count as verified by the caller, e.g. in another tier's index). Stops at the
  /// first miss; O(k); no side effects. `pages[i]` is the page of block firstBlock + i.
  PrefixMatch longestPrefix(PromptBlocks const& blocks, int32_t maxBlocks,
                            int32_t firstBlock = 0) const;
  /// True when `page` is indexed under blocks.keys[block] and, with verification on, holds exactly
  /// that block's tokens, parent, media positions, salt and adapter, and the same token-only
  /// content chain. `ancestorsVerified`: the caller has just verified blocks [0, block) of the
  /// same prompt with holds(), so their token comparisons already imply equal content and the
  /// content-chain comparison (which may compute content keys) is skipped. Block 0 needs none.
  bool holds(PageId page, PromptBlocks const& blocks, int32_t block,
             bool ancestorsVerified = false) const;

  /// Indexes block `block` of `blocks` on `page` under `digest` (normally blocks.keys[block]; a
  /// different digest models a collision in tests). First committer wins: an already indexed
  /// digest is left alone and its page returned. Otherwise returns `page`. Throws (nothing
  /// changed) when `page` is already indexed under another digest, or arguments are out of range.
  /// Strong exception guarantee.
  PageId insert(Hash128 digest, PageId page, PromptBlocks const& blocks, int32_t block);
  /// Indexes on `page` the block `source` (an index of the same page size and verification
  /// setting, e.g. the other tier's) holds on `sourcePage`: digest, parent, provenance, token ids
  /// and media positions. An already indexed digest is left alone and its page returned;
  /// otherwise returns `page`. Throws (nothing changed) for pages out of range, a source page that
  /// is not indexed, a different geometry, or `page` indexed under another digest.
  PageId insertCopy(BlockIndex const& source, PageId sourcePage, PageId page);
  /// Removes the entry of `page` (if any); an eviction also remembers its digest as recently
  /// evicted (a rolled-back insertion does not). Returns whether an entry was removed.
  bool erasePage(PageId page, bool rememberEviction = true) noexcept;

  /// Raw lookups, no verification.
  std::optional<PageId> find(Hash128 digest) const noexcept;
  std::optional<Hash128> digestOf(PageId page) const;
  /// Parent digest and provenance recorded for an indexed page (throws if not indexed).
  Hash128 parentOf(PageId page) const;
  BlockProvenance const& provenanceOf(PageId page) const;
  /// Token ids kept for an indexed page (empty when verification is off; throws if not indexed).
  std::span<int32_t const> tokensOf(PageId page) const;
  /// PromptBlocks::extrasDigest of the block indexed on `page` (throws if not indexed).
  Hash128 extrasOf(PageId page) const;
  /// Provenance of every indexed block whose token-only chain digest is `contentKey`.
  std::vector<BlockProvenance> provenanceByContent(Hash128 contentKey) const;
  bool wasRecentlyEvicted(Hash128 digest) const noexcept { return mEvicted.contains(digest); }

  int32_t size() const noexcept { return static_cast<int32_t>(mByDigest.size()); }
  int32_t pageCapacity() const noexcept { return mPageCapacity; }
  int32_t pageSize() const noexcept { return mPageSize; }
  bool verifiesTokens() const noexcept { return mVerifyTokens; }

 private:
  struct Entry {
    bool indexed = false;
    Hash128 digest;
    Hash128 parent;
    BlockProvenance provenance;
  };

  void checkPage(char const* call, PageId page) const;
  /// The allocating steps of an insertion (insert, insertCopy), all or nothing: `digest` and
  /// `contentKey` filed under `page`, and its media positions when given. The entry itself and
  /// the token ids are written by the caller afterwards (they cannot throw).
  void indexMaps(Hash128 digest, Hash128 contentKey, PageId page,
                 std::optional<std::vector<MediaPosition>> media);
  /// holds() without its argument checks: `e` is the entry of `page`, indexed under the block's
  /// key; compares what verification compares (no-op true when verification is off).
  bool verified(Entry const& e, PageId page, PromptBlocks const& blocks, int32_t block,
                bool ancestorsVerified) const;
  static BlockProvenance provenanceOf(PromptBlocks const& blocks, int32_t block);

  int32_t mPageCapacity;
  int32_t mPageSize;
  bool mVerifyTokens;
  std::vector<Entry> mEntries;   ///< by page id
  std::vector<int32_t> mTokens;  ///< page * pageSize + i
  std::unordered_map<Hash128, PageId, Hash128Hasher> mByDigest;
  std::unordered_multimap<Hash128, PageId, Hash128Hasher> mByContent;
  std::unordered_map<PageId, std::vector<MediaPosition>> mMedia;  ///< media blocks only
  RecentDigestSet mEvicted;
};

}  // namespace mkv
