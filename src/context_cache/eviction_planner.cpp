#include "context_cache/eviction_planner.h"

#include <algorithm>

#include "core/check.h"

namespace mkv {
namespace {

/// Where the pools' free slots stand against a demand.
enum class Shortfall {
  kCovered,      // the free slots cover it: nothing to evict
  kReclaimable,  // evicting records may cover it
  kUnreachable,  // some type needs more than evicting every record could reclaim
};

/// Stores in `need`, per type in kAllResourceTypes order, what `demand` asks beyond the pools'
/// free slots, stopping at the first type that is unreachable.
Shortfall measureShortfall(ResourceDemand const& demand, ResourcePools const& pools,
                           ResourceDemand& need) {
  bool needsAny = false;
  for (ResourceType type : kAllResourceTypes) {
    need[type] = std::max(0, demand[type] - pools.freeCount(type));
    needsAny = needsAny || need[type] > 0;
    if (need[type] > pools.reclaimableCount(type)) {
      return Shortfall::kUnreachable;
    }
  }
  return needsAny ? Shortfall::kReclaimable : Shortfall::kCovered;
}

/// One simulated eviction walk over the planner's scratch: per resource a simulated cache count
/// (-1 = untouched, filled from the pools on first touch and listed in `touched`). Restores the
/// untouched marker of everything it touched when destroyed, however the walk ends.
class EvictionWalk {
 public:
  EvictionWalk(std::array<std::vector<int32_t>, kResourceTypeCount>& simulated,
               std::vector<ResourceId>& touched, ResourcePools const& pools,
               ResourceDemand const& need, EvictionPlan& result)
      : mSimulated(simulated), mTouched(touched), mPools(pools), mNeed(need), mResult(result) {}
  EvictionWalk(EvictionWalk const&) = delete;
  EvictionWalk& operator=(EvictionWalk const&) = delete;
  ~EvictionWalk() {
    for (ResourceId id : mTouched) {
      mSimulated[static_cast<std::size_t>(id.type)][static_cast<std::size_t>(id.index)] = -1;
    }
    mTouched.clear();
  }

  /// Whether every resource of `record` is pinned by a lease (a running sequence reads it):
  /// evicting it could reclaim nothing in this walk and would only drop its index entries, which
  /// the running sequences never publish again.
  bool fullyLeased(CacheRecord const& record) const {
    bool pinned = true;
    record.forEachResource([&](ResourceId id) { pinned = pinned && mPools.activeRefs(id) > 0; });
    return pinned;
  }

  /// Appends `record` to the victims, counting each of its resources whose simulated cache count
  /// reaches zero while no lease pins it as reclaimed; true once the reclaimed cover the need.
  bool addVictim(CacheRecord const& record) {
    record.forEachResource([&](ResourceId id) {
      int32_t& simulated =
          mSimulated[static_cast<std::size_t>(id.type)][static_cast<std::size_t>(id.index)];
      if (simulated < 0) {
        simulated = mPools.cacheRefs(id);
        mTouched.push_back(id);  // capacity reserved: one entry per distinct slot at most
      }
      MKV_ASSERT(simulated > 0, "record {} holds {} {} without a cache reference", record.id,
                 toString(id.type), id.index);
      if (--simulated == 0 && mPools.activeRefs(id) == 0) {
        ++mResult.reclaimed[id.type];
      }
    });
    mResult.victims.push_back(record.id);
    return mResult.reclaimed.covers(mNeed);
  }

 private:
  std::array<std::vector<int32_t>, kResourceTypeCount>& mSimulated;
  std::vector<ResourceId>& mTouched;
  ResourcePools const& mPools;
  ResourceDemand const& mNeed;
  EvictionPlan& mResult;
};

/// Calls visit(id) for each id of `ids` that does not occur earlier in `ids`, in order, until a
/// call returns true; returns whether one did.
template <typename Visit>
bool anyFirstOccurrence(std::span<RecordId const> ids, Visit&& visit) {
  for (std::size_t i = 0; i < ids.size(); ++i) {
    auto const seen = ids.begin() + static_cast<std::ptrdiff_t>(i);
    if (std::find(ids.begin(), seen, ids[i]) != seen) {
      continue;  // visited already
    }
    if (visit(ids[i])) {
      return true;
    }
  }
  return false;
}

}  // namespace

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
  Shortfall const shortfall = measureShortfall(demand, pools, need);
  if (shortfall == Shortfall::kUnreachable) {
    return {};  // even evicting every record cannot free enough
  }
  if (shortfall == Shortfall::kCovered) {
    return EvictionPlan{true, {}, {}};
  }

  EvictionPlan result;
  EvictionWalk walk{mSimulatedCache, mTouched, pools, need, result};
  auto const isProtected = [&](RecordId id) {
    return std::find(protectedRecords.begin(), protectedRecords.end(), id) !=
           protectedRecords.end();
  };
  if (records.forEachVictim([&](CacheRecord const& record) {
        return !isProtected(record.id) && !walk.fullyLeased(record) && walk.addVictim(record);
      })) {
    result.feasible = true;
    return result;
  }
  if (anyFirstOccurrence(protectedRecords, [&](RecordId id) {
        CacheRecord const* last = records.get(id);
        return last != nullptr && walk.addVictim(*last);
      })) {
    result.feasible = true;
    return result;
  }
  return {};  // cache references outside the store's records: cannot be planned
}

}  // namespace mkv
