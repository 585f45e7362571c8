#pragma once
/// \file host_block_tier.h
/// CUDA-free bookkeeping of the host tier: which blocks live in which host page, in least
/// recently used order, with the same keys and token verification as the GPU index
/// (docs/context_cache.md, "Host tier"). The bytes live in HostKvTier (mkv/host_kv_tier.h);
/// ContextCacheManager decides what moves and the coordinator moves it.
///
/// Thread-safety: single writer (the manager's thread).

#include <cstdint>
#include <optional>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/block_index.h"
#include "context_cache/slot_list.h"
#include "mkv/types.h"

namespace mkv {

/// A block the tier dropped for good to make room (its digest and the host page it held).
struct HostBlockDropped {
  Hash128 digest;
  PageId page = kNoPage;
};

/// One page's move between the tiers (all layers, K and V).
struct HostTransfer {
  PageId gpuPage = kNoPage;
  PageId hostPage = kNoPage;
  friend bool operator==(HostTransfer const&, HostTransfer const&) = default;
};

/// The moves the manager decided and the coordinator has not yet enqueued, in the order they must
/// run: every offload (GPU -> host: an evicted page may be the destination of an onboarding or
/// the next owner's page), then every onboarding (host -> GPU).
struct HostTransfers {
  std::vector<HostTransfer> offloads;
  std::vector<HostTransfer> onboards;
  bool empty() const noexcept { return offloads.empty() && onboards.empty(); }
};

/// Host pages [0, capacity) holding blocks that left the GPU cache. A block is kept once (keyed by
/// its digest, verified like BlockIndex); the tier is inclusive: onboarding a block back to the
/// GPU leaves it here too, so evicting it from the GPU again costs no copy. When full, storing a
/// block drops the least recently used unpinned one for good. Pins protect the host pages a plan
/// is about to onboard from being reused while the same admission offloads other blocks.
class HostBlockTier {
 public:
  /// Throws unless capacity > 0 and pageSize > 0.
  HostBlockTier(int32_t capacity, int32_t pageSize, bool verifyTokens);

  /// Keeps the block that `gpu` indexes on `gpuPage`. Returns the host page it now occupies (the
  /// caller copies the bytes there), or nullopt when nothing is to copy: the digest is already
  /// here (then it becomes the most recently used) or every host page is pinned. Appends the
  /// block it dropped to make room, if any, to `dropped`. Throws (nothing changed) if `gpuPage` is
  /// not indexed in `gpu` or `gpu` has another geometry; on an allocation failure the block it
  /// dropped stays dropped (and is in `dropped`).
  std::optional<PageId> store(BlockIndex const& gpu, PageId gpuPage,
                              std::vector<HostBlockDropped>& dropped);
  /// A host page for a block the remote tier loaded (docs/context_cache.md, "Remote tier"),
  /// claimed as store() claims one (a free page, else the least recently used unpinned block is
  /// dropped and appended to `dropped`) but holding no block: no store() claims it and no lookup
  /// finds it until fillReserved or releaseReserved. nullopt when every page is pinned.
  std::optional<PageId> reserve(std::vector<HostBlockDropped>& dropped);
  /// Keeps block `block` of `blocks` on the reserved `page`, whose bytes are now the block's:
  /// returns true. Returns false, releasing `page`, when the digest is held here already (that
  /// page becomes the most recently used). Throws (nothing changed but `page` released) for a
  /// block out of range, another page size, or an allocation failure of the index.
  bool fillReserved(PageId page, PromptBlocks const& blocks, int32_t block);
  /// Gives a reserved page back to the free list.
  void releaseReserved(PageId page) noexcept;
  /// Host pages of the longest verified run of blocks [firstBlock, firstBlock + k) of `blocks`
  /// held here, firstBlock + k <= maxBlocks (blocks before firstBlock are verified by the caller).
  /// No side effects.
  std::vector<PageId> longestRun(PromptBlocks const& blocks, int32_t firstBlock,
                                 int32_t maxBlocks) const;
  /// True when `page` holds block `block` of `blocks` (verified as BlockIndex::holds).
  bool holds(PageId page, PromptBlocks const& blocks, int32_t block) const;

  /// Marks `page` (which must hold a block) as in use by an admission: store() does not drop it
  /// until unpin. Pins nest. Throws (nothing changed) for an empty page.
  void pin(PageId page);
  void unpin(PageId page) noexcept;
  /// Makes the block on `page` the most recently used (an onboarding read it).
  void touch(PageId page) noexcept;
  /// Drops the block on `page`, if any (its copy failed); returns whether one was there.
  bool forget(PageId page) noexcept;
  /// Drops every block (the cache reset) and returns how many. Pins must be released first.
  int32_t clear() noexcept;

  int32_t capacity() const noexcept { return mIndex.pageCapacity(); }
  int32_t size() const noexcept { return mIndex.size(); }
  int32_t pinnedPages() const noexcept { return mPinnedPages; }
  int32_t reservedPages() const noexcept { return mReservedPages; }
  BlockIndex const& index() const noexcept { return mIndex; }

 private:
  /// A host page for a new block: a free one, else the least recently used unpinned one (its
  /// block dropped, appended to `dropped`); nullopt when every page is pinned.
  std::optional<PageId> claimPage(std::vector<HostBlockDropped>& dropped);
  void checkHeld(char const* call, PageId page) const;

  BlockIndex mIndex;
  SlotLinks mLinks;   ///< the least-recently-used order of held pages
  SlotList mRecency;  ///< oldest = next to drop
  std::vector<PageId> mFree;
  std::vector<int32_t> mPins;
  int32_t mPinnedPages = 0;
  int32_t mReservedPages = 0;
};

}  // namespace mkv
