#pragma once
/// \file window_block_cache.h
/// CUDA-free bookkeeping of the sliding-window pool of the composed backend (sliding layers plus
/// context reuse): which pages are free, which are held by running windows, and which keep a
/// prompt block's sliding-layer KV after it left every window, keyed and verified like the
/// full-layer index (docs/architecture.md, "Sliding windows with context reuse").
///
/// Thread-safety: single writer (the engine thread).

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/block_index.h"
#include "context_cache/kv_event_queue.h"
#include "context_cache/slot_list.h"
#include "mkv/swa_page_source.h"
#include "mkv/types.h"

namespace mkv {

/// Pages [0, capacity) of the sliding pool. A page is free, held (holder count > 0: the
/// sequences whose window maps it) or cached: indexed under a prompt block's digest with no
/// holder, and dropped for good (unindexed, handed out) when allocate() needs a page and no free
/// one is left. A cached page that a new window maps is held again (and leaves the order) until
/// released; from then on it is a *read* block, as are the blocks keepWindowBefore() marks. The
/// victim order: unread blocks, then the windows before reuse points (keepPointWindow) by rank,
/// lowest first, then read ones, each least recently released first.
///
/// The hit rule of the composed backend: a prefix of k blocks (page-aligned at k * P tokens) is
/// reusable by the sliding layers when the blocks of the window before it, [max(0, k -
/// windowBlocks()), k) with windowBlocks() = ceil(W / P), are all cached here; the full layers'
/// own prefix is the coordinator's business.
class WindowBlockCache final : public SwaPageSource {
 public:
  /// Throws mkv::Error unless capacity > 0, pageSize > 0 and windowTokens > 0.
  WindowBlockCache(int32_t capacity, int32_t pageSize, int32_t windowTokens, bool verifyTokens);

  /// ceil(W / P): the blocks a page-aligned hit needs before it.
  int32_t windowBlocks() const noexcept { return mWindowBlocks; }
  int32_t windowTokens() const noexcept { return mWindowTokens; }

  /// The largest k <= maxBlocks such that every block of [max(0, k - windowBlocks()), k) of
  /// `blocks` is indexed here and (with verification) holds exactly that block
  /// (BlockIndex::holds with the ancestors counted as verified: the caller verified blocks
  /// [0, maxBlocks) of the same prompt in the full-layer index). 0 always qualifies. O(maxBlocks),
  /// no side effects. Throws if `blocks` was hashed with another page size or maxBlocks is
  /// outside [0, blocks.keys.size()].
  int32_t longestWindowedPrefix(PromptBlocks const& blocks, int32_t maxBlocks) const;
  /// The pages of blocks [max(0, endBlock - windowBlocks()), endBlock) of `blocks`, ascending
  /// block order. Throws (naming `call`) unless each is indexed here and verified as above.
  std::vector<PageId> windowPages(char const* call, PromptBlocks const& blocks,
                                  int32_t endBlock) const;

  /// Indexes block `block` of `blocks` on `page`, which must be held (its bytes complete: after
  /// the completion point of the prefill that wrote them). First committer wins: returns false,
  /// and leaves `page` unindexed, when the block's digest is already indexed on another page;
  /// true when it is now indexed on `page` (also when it already was). Throws (nothing changed)
  /// for a page out of range or not held, a page indexed under another digest, or a block out of
  /// range. Strong exception guarantee.
  bool publish(PageId page, PromptBlocks const& blocks, int32_t block);
  /// Moves the cached blocks of the window before block `endBlock` of `blocks`, [max(0, endBlock -
  /// windowBlocks()), endBlock), to the read tier as if a hit had read them: a held block joins
  /// it at its release, one nobody holds becomes its newest. For a point where a lookup found the
  /// full layers' prefix but not its window: hits recur at such points, and the window that miss
  /// recomputed is what the next hit there needs. Blocks not cached (or failing verification)
  /// are skipped. Returns how many blocks were newly marked. Throws (nothing changed) for blocks
  /// hashed with another page size or endBlock outside [0, blocks.fullBlockCount()].
  int32_t keepWindowBefore(PromptBlocks const& blocks, int32_t endBlock);
  /// The same for the window before a reuse point (ContextCacheConfig::checkpointInterval), into
  /// the point tier of `rank` (clamped to [0, kMaxPointRank]) between unread and read blocks: a
  /// window no hit has read yet is kept over the blocks between windows, but never over the
  /// windows hits did read, and lower ranks go first. A block in the windows of several points
  /// keeps the highest rank; a read block stays read. Returns how many blocks were newly raised
  /// (not counted in keptBlocks). The coordinator ranks a point at (2^r x odd) intervals r, as a
  /// hybrid model's speculations (docs/context_cache.md, "Reuse points").
  int32_t keepPointWindow(PromptBlocks const& blocks, int32_t endBlock, int32_t rank = 0);
  /// The highest rank of the point tier (a hybrid model's kMaxSpeculationRank).
  static constexpr int32_t kMaxPointRank = 16;
  /// Drops every cached block (a cache reset): pages nobody holds become free, held pages stay
  /// held and unindexed. Returns how many blocks were dropped. Announces nothing: the reset that
  /// calls it sends one AllBlocksCleared for both pools.
  int32_t clear() noexcept;
  /// From now on, queues a KV event tagged `group` into `queue` (not owned; must outlive this
  /// cache or be replaced first) for every block publish() newly indexes (BlockStored with its
  /// parent, token ids and extras) and every cached block allocate() drops (BlockRemoved), at the
  /// moment it happens, so a block dropped and published again within one drain ends stored.
  /// Null stops the events.
  void announceTo(KvEventQueue* queue, KvCacheGroup group) noexcept {
    mEvents = queue;
    mEventGroup = group;
  }
  KvEventQueue const* announcedTo() const noexcept { return mEvents; }
  /// Blocks dropped since construction (by allocate and clear).
  int64_t droppedBlocks() const noexcept { return mDroppedBlocks; }
  /// Blocks newly indexed by publish since construction.
  int64_t publishedBlocks() const noexcept { return mPublishedBlocks; }
  /// Blocks keepWindowBefore moved to the read tier since construction.
  int64_t keptBlocks() const noexcept { return mKeptBlocks; }
  /// The sliding pool in the Prometheus text format, names starting `prefix` + "sliding_":
  /// gauges of its pages (total, free, held), cached blocks and the read tier, counters of
  /// published, kept and dropped blocks. Throws for a prefix that is not a metric-name prefix.
  std::string toPrometheus(std::string_view prefix) const;

  // SwaPageSource.
  int32_t totalPages() const noexcept override { return mIndex.pageCapacity(); }
  int32_t availablePages() const noexcept override;
  bool allocate(int32_t count, std::vector<PageId>& out) override;
  void hold(PageId page) override;
  void release(PageId page) noexcept override;

  int32_t freePages() const noexcept { return static_cast<int32_t>(mFree.size()); }
  /// Pages with at least one holder.
  int32_t heldPages() const noexcept { return mHeldPages; }
  /// Indexed pages (cached blocks), held or not.
  int32_t cachedBlocks() const noexcept { return mIndex.size(); }
  /// Indexed pages nobody holds (evictable).
  int32_t evictablePages() const noexcept {
    return mUnread.count + evictablePointPages() + mRead.count;
  }
  /// Of them, the blocks a hit's window has mapped since they were published (dropped last).
  int32_t evictableReadPages() const noexcept { return mRead.count; }
  /// Of them, the windows before reuse points no hit has read yet (dropped after unread blocks).
  int32_t evictablePointPages() const noexcept { return mPointPages; }
  int32_t holders(PageId page) const;
  BlockIndex const& index() const noexcept { return mIndex; }

 private:
  /// The tier of a cached block, and its release order: unread, the point windows of rank r at
  /// kPointWindow + r, read.
  enum Tier : uint8_t { kUnread = 0, kPointWindow = 1, kRead = kPointWindow + kMaxPointRank + 1 };
  SlotList& orderOf(PageId page) noexcept;
  /// The oldest page of the first non-empty release order (allocate's victim); one must be.
  PageId firstVictim() const noexcept;
  /// Raises the cached blocks of the window before `endBlock` to `tier` (see keepWindowBefore).
  int32_t raiseWindowBefore(char const* call, PromptBlocks const& blocks, int32_t endBlock,
                            Tier tier);
  /// Takes a cached page nobody holds out of its release order.
  void unlinkCached(PageId page) noexcept;
  /// Puts a cached page nobody holds at the newest end of its tier's release order.
  void linkCached(PageId page) noexcept;
  bool inPointTier(PageId page) const noexcept;
  void checkPage(char const* call, PageId page) const;
  void checkBlocks(char const* call, PromptBlocks const& blocks) const;
  /// Block `block` of `blocks` is indexed here and verified (ancestors counted as verified).
  bool cachesBlock(PromptBlocks const& blocks, int32_t block) const;

  int32_t mWindowTokens;
  int32_t mWindowBlocks;
  BlockIndex mIndex;
  SlotLinks mLinks;  ///< the release order of cached pages nobody holds
  /// Cached pages nobody holds, in release orders: blocks no hit has read since they were
  /// published (dropped first, oldest first), the windows before reuse points (then, by rank),
  /// and blocks a hit's window mapped (last). A prefill publishes every prompt block, most of
  /// which no later hit reads; the windows hits do read must not be flushed by the next long
  /// prompt.
  SlotList mUnread;
  std::array<SlotList, kMaxPointRank + 1> mPointWindows;  ///< by rank
  SlotList mRead;
  int32_t mPointPages = 0;     ///< pages in mPointWindows, all ranks
  std::vector<uint8_t> mTier;  ///< per page (a Tier): read by a hit or wanted by a lookup, etc.
  std::vector<PageId> mFree;   ///< a min-heap: the lowest free id is handed out first
  std::vector<int32_t> mHolders;
  int32_t mHeldPages = 0;
  KvEventQueue* mEvents = nullptr;  ///< where publications and drops are announced, or null
  KvCacheGroup mEventGroup{};
  int64_t mDroppedBlocks = 0;
  int64_t mPublishedBlocks = 0;
  int64_t mKeptBlocks = 0;
};

}  // namespace mkv
