#pragma once
/// \file recent_digest_set.h
/// A bounded FIFO set of digests (the block index's memory of recently evicted blocks, used to
/// classify a miss as kEvicted). Allocation happens only at construction, so insert() is noexcept
/// and can run inside eviction, which must not fail.
///
/// Thread-safety: single writer; const members may be called concurrently with each other.

#include <cstdint>
#include <vector>

#include "context_cache/block_hash.h"

namespace mkv {

/// Remembers the last `capacity` inserted digests (insertion order; re-inserting a digest adds a
/// second occurrence). contains() is O(1) expected: a linear-probing table of ring positions,
/// sized to a power of two >= 2 * capacity, with backward-shift deletion (no tombstones).
class RecentDigestSet {
 public:
  /// capacity 0 disables the set (contains() is always false). Throws for a negative capacity.
  explicit RecentDigestSet(int32_t capacity);

  /// Appends `digest`, forgetting the oldest entry when full.
  void insert(Hash128 digest) noexcept;
  bool contains(Hash128 digest) const noexcept;
  int32_t size() const noexcept { return mSize; }
  int32_t capacity() const noexcept { return static_cast<int32_t>(mRing.size()); }

 private:
  std::size_t home(Hash128 digest) const noexcept;
  void eraseRingPosition(int32_t position) noexcept;

  std::vector<Hash128> mRing;   ///< entries in insertion order, oldest at mHead
  std::vector<int32_t> mTable;  ///< ring positions, -1 = empty
  int32_t mHead = 0;
  int32_t mSize = 0;
};

}  // namespace mkv
