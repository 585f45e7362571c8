#pragma once
/// \file resource_pools.h
/// The four typed id pools of context reuse with active and cache reference counts
/// (docs/context_cache.md, "Refcounts and pools").
///
/// Thread-safety: single writer (the engine thread); no internal synchronisation.

#include <array>
#include <cstdint>
#include <string_view>
#include <vector>

#include "mkv/context_cache/context_cache_types.h"
#include "mkv/types.h"

namespace mkv {

/// Four fixed pools of ids [0, capacity). Each slot has an *active* refcount (in-flight lease
/// pins) and a *cache* refcount (published records). A slot is free exactly when both are zero,
/// and then it sits in its pool's FIFO free ring: allocation takes from the head, a freed slot
/// goes to the tail, so a just-released page is reused last (its stale contents stay intact the
/// longest). New allocations start at active = 1, cache = 0.
///
/// Refcount calls on a free slot, counts going negative or ids out of range are contract
/// violations (mkv::Error, nothing changed).
class ResourcePools {
 public:
  /// Throws for a negative capacity. Every slot starts free; ring order is 0, 1, 2, ...
  explicit ResourcePools(ResourceDemand capacities);

  ResourceDemand const& capacities() const noexcept { return mCapacities; }
  ResourceDemand freeCounts() const noexcept;
  int32_t capacity(ResourceType type) const noexcept { return mCapacities[type]; }
  int32_t freeCount(ResourceType type) const noexcept { return pool(type).freeCount; }
  /// Slots with cache > 0 and active == 0: what evicting every record would return to the ring.
  int32_t reclaimableCount(ResourceType type) const noexcept { return pool(type).reclaimable; }

  int32_t activeRefs(ResourceId id) const;
  int32_t cacheRefs(ResourceId id) const;
  bool isFree(ResourceId id) const;
  /// The free ring of `type`, head (next allocation) first. O(capacity); for tests and tools.
  std::vector<int32_t> freeList(ResourceType type) const;

  /// True when every pool has at least the demanded free slots.
  bool canAllocate(ResourceDemand const& demand) const noexcept;
  /// All-or-nothing allocation across pools: appends demand[t] ids to *targets[t] (a null target
  /// requires demand[t] == 0) and returns true; or returns false with nothing changed when a pool
  /// is short. Strong exception guarantee (targets are grown before any pool changes).
  bool allocate(ResourceDemand const& demand,
                std::array<std::vector<int32_t>*, kResourceTypeCount> const& targets);

  /// active += 1 on an allocated (non-free) slot: pins a cached resource for a lease.
  void addActive(ResourceId id);
  /// active -= 1. Returns true when the slot became free (and was appended to the ring).
  bool dropActive(ResourceId id);
  /// cache += 1 on an allocated slot: a record takes a reference.
  void addCache(ResourceId id);
  /// cache -= 1. Returns true when the slot became free (and was appended to the ring).
  bool dropCache(ResourceId id);

 private:
  struct Pool {
    std::vector<int32_t> active;
    std::vector<int32_t> cache;
    std::vector<int32_t> ring;  ///< circular; free slots are ring[head .. head + freeCount)
    int32_t head = 0;
    int32_t freeCount = 0;
    int32_t reclaimable = 0;
  };

  Pool& pool(ResourceType type) noexcept { return mPools[static_cast<std::size_t>(type)]; }
  Pool const& pool(ResourceType type) const noexcept {
    return mPools[static_cast<std::size_t>(type)];
  }
  void checkId(char const* call, ResourceId id) const;
  void pushFree(Pool& p, int32_t index) noexcept;

  ResourceDemand mCapacities;
  std::array<Pool, kResourceTypeCount> mPools;
};

}  // namespace mkv
