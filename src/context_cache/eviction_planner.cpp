#include "context_cache/eviction_planner.h"

#include <algorithm>

#include "core/check.h"

namespace mkv {

EvictionPlanner::EvictionPlanner(ResourceDemand capacities) : mCapacities(capacities) {
  MKV_REQUIRE(!capacities.hasNegative(), "EvictionPlanner", "capacities must be non-negative");
  for (ResourceType type : kAllResourceTypes) {
    mSimulatedCache[static_cast<std::size_t>(type)].assign(
        static_cast<std::size_t>(capacities[type]), -1);
  }
  mTouched.reserve(static_cast<std::size_t>(capacities.total()));
}

EvictionPlan EvictionPlanner::plan(ResourceDemand const& demand, ResourcePools const& pools,
                                   RecordStore const& records, RecordId protectedRecord) {
  return plan(demand, pools, records, std::span<RecordId const>(&protectedRecord, 1));
}

EvictionPlan EvictionPlanner::plan(ResourceDemand const& demand, ResourcePools const& pools,
                                   RecordStore const& records,
                                   std::span<RecordId const> protectedRecords) {
  MKV_REQUIRE(pools.capacities() == mCapacities, "EvictionPlanner::plan",
              "pools of another geometry (base capacity {} vs {})", pools.capacities().baseKvPages,
              mCapacities.baseKvPages);
  MKV_REQUIRE(!demand.hasNegative(), "EvictionPlanner::plan", "negative demand");

  ResourceDemand need;
  bool needsAny = false;
  for (ResourceType type : kAllResourceTypes) {
    need[type] = std::max(0, demand[type] - pools.freeCount(type));
    needsAny = needsAny || need[type] > 0;
    if (need[type] > pools.reclaimableCount(type)) {
      return {};  // even evicting every record cannot free enough
    }
  }
  if (!needsAny) {
    return EvictionPlan{true, {}, {}};
  }

  // Restore the untouched marker of everything the walk touched, however it ends.
  struct ScratchReset {
    EvictionPlanner& planner;
    ~ScratchReset() {
      for (ResourceId id : planner.mTouched) {
        planner.mSimulatedCache[static_cast<std::size_t>(id.type)]
                               [static_cast<std::size_t>(id.index)] = -1;
      }
      planner.mTouched.clear();
    }
  } const reset{*this};

  EvictionPlan result;
  auto const visit = [&](CacheRecord const& record) {
    record.forEachResource([&](ResourceId id) {
      int32_t& simulated =
          mSimulatedCache[static_cast<std::size_t>(id.type)][static_cast<std::size_t>(id.index)];
      if (simulated < 0) {
        simulated = pools.cacheRefs(id);
        mTouched.push_back(id);  // capacity reserved: one entry per distinct slot at most
      }
      MKV_ASSERT(simulated > 0, "record {} holds {} {} without a cache reference", record.id,
                 toString(id.type), id.index);
      if (--simulated == 0 && pools.activeRefs(id) == 0) {
        ++result.reclaimed[id.type];
      }
    });
    result.victims.push_back(record.id);
    return result.reclaimed.covers(need);
  };

  auto const isProtected = [&](RecordId id) {
    return std::find(protectedRecords.begin(), protectedRecords.end(), id) !=
           protectedRecords.end();
  };
  if (records.forEachVictim(
          [&](CacheRecord const& record) { return !isProtected(record.id) && visit(record); })) {
    result.feasible = true;
    return result;
  }
  for (std::size_t i = 0; i < protectedRecords.size(); ++i) {
    RecordId const id = protectedRecords[i];
    if (std::find(protectedRecords.begin(),
                  protectedRecords.begin() + static_cast<std::ptrdiff_t>(i),
                  id) != protectedRecords.begin() + static_cast<std::ptrdiff_t>(i)) {
      continue;  // visited already
    }
    if (CacheRecord const* last = records.get(id); last != nullptr && visit(*last)) {
      result.feasible = true;
      return result;
    }
  }
  return {};  // cache references outside the store's records: cannot be planned
}

}  // namespace mkv
