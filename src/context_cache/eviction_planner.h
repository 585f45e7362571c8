#pragma once
/// \file eviction_planner.h
/// Side-effect-free choice of victims, in the records' victim order, that frees a demand across
/// all pools (docs/context_cache.md, "Eviction").
///
/// Thread-safety: single writer (plan() uses the planner's scratch arrays).

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "context_cache/record_store.h"
#include "context_cache/resource_pools.h"

namespace mkv {

/// Outcome of EvictionPlanner::plan.
struct EvictionPlan {
  bool feasible = false;
  std::vector<RecordId> victims;  ///< evict in this order; empty when infeasible
  ResourceDemand reclaimed;       ///< slots the victims return to the free rings, per type
};

/// Simulates evicting records in the store's victim order (RecordStore::forEachVictim: retention
/// priority, then the eviction policy; protected records, e.g. the requests' own hits, are moved
/// to the very end, in the order given), passing over records every resource of which a lease
/// pins (evicting one would reclaim nothing and only drop blocks a running sequence reads), and
/// returns the shortest victim prefix after which the free slots cover the whole demand in all
/// four pools together. Per visited record it decrements a
/// simulated cache count of each of its resources; a resource counts as reclaimed when that count
/// reaches zero and no lease pins it (active == 0). Shared ancestors therefore free only once every
/// record using them is a victim, and pinned resources never count.
///
/// Cost: O(1) when the free slots already cover the demand or when it cannot be met even by
/// evicting everything (ResourcePools::reclaimableCount); otherwise linear in the resources of the
/// visited records, never in the number of records. The scratch (one int32 per pool slot) is
/// reset incrementally, touching only what the walk touched.
class EvictionPlanner {
 public:
  /// Sizes the scratch for pools of these capacities (throws for negative ones).
  explicit EvictionPlanner(ResourceDemand capacities);

  /// Reads `pools` and `records` only. `protectedRecord` may be kNoRecord. Throws when the pools'
  /// capacities differ from the planner's or the demand is negative.
  EvictionPlan plan(ResourceDemand const& demand, ResourcePools const& pools,
                    RecordStore const& records, RecordId protectedRecord = kNoRecord);
  /// As above with several protected records (kNoRecord entries and repeats are ignored; ids of
  /// records no longer stored are skipped). The walk costs O(protected) extra per visited record,
  /// meant for a batch's few hits.
  EvictionPlan plan(ResourceDemand const& demand, ResourcePools const& pools,
                    RecordStore const& records, std::span<RecordId const> protectedRecords);

 private:
  std::array<std::vector<int32_t>, kResourceTypeCount> mSimulatedCache;  ///< -1 = untouched
  std::vector<ResourceId> mTouched;
  ResourceDemand mCapacities;
};

}  // namespace mkv
