#pragma once
/// \file kv_event_queue.h
/// Bounded queue of block-index events for KV-aware routers (SPEC §8.4).
///
/// Thread-safety: single writer; drain() is called by the same thread that mutates the manager.

#include <cstdint>
#include <variant>
#include <vector>

#include "mkv/context_cache/block_hash.h"
#include "mkv/types.h"

namespace mkv {

/// A block became reusable: `digest` is now indexed on `page` (base KV pool id).
struct BlockStored {
  Hash128 digest;
  Hash128 parent;  ///< previous block's digest, kBlockChainRoot for a first block
  PageId page = kNoPage;
  int32_t tokenCount = 0;
  friend bool operator==(BlockStored const&, BlockStored const&) = default;
};

/// A block stopped being reusable (its page lost its last cache reference).
struct BlockRemoved {
  Hash128 digest;
  PageId page = kNoPage;
  friend bool operator==(BlockRemoved const&, BlockRemoved const&) = default;
};

using KvEvent = std::variant<BlockStored, BlockRemoved>;

/// A fixed ring of events allocated at construction; push() never allocates and never fails.
/// When full, the oldest event is overwritten and droppedCount() increments. Capacity 0 disables
/// the queue (pushes are ignored and not counted as drops).
class KvEventQueue {
 public:
  /// Throws for a negative capacity.
  explicit KvEventQueue(int32_t capacity);

  void push(KvEvent const& event) noexcept;
  /// All queued events, oldest first; the queue is empty afterwards. Strong exception guarantee.
  std::vector<KvEvent> drain();

  int32_t size() const noexcept { return mSize; }
  int32_t capacity() const noexcept { return static_cast<int32_t>(mRing.size()); }
  uint64_t droppedCount() const noexcept { return mDropped; }

 private:
  std::vector<KvEvent> mRing;
  int32_t mHead = 0;
  int32_t mSize = 0;
  uint64_t mDropped = 0;
};

}  // namespace mkv
