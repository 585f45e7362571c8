#include "context_cache/resource_pools.h"

#include "core/check.h"

namespace mkv {

std::string_view toString(ResourceType type) noexcept {
  switch (type) {
    case ResourceType::kBaseKvPage:
      return "base_kv_page";
    case ResourceType::kDraftKvPage:
      return "draft_kv_page";
    case ResourceType::kRecurrentSnapshot:
      return "recurrent_snapshot";
    case ResourceType::kPartialKvSnapshot:
      return "partial_kv_snapshot";
  }
  return "unknown";
}

namespace {

template <typename Demand>
auto& member(Demand& demand, ResourceType type) noexcept {
  switch (type) {
    case ResourceType::kBaseKvPage:
      return demand.baseKvPages;
    case ResourceType::kDraftKvPage:
      return demand.draftKvPages;
    case ResourceType::kRecurrentSnapshot:
      return demand.recurrentSnapshotSlots;
    case ResourceType::kPartialKvSnapshot:
      break;
  }
  return demand.partialKvSnapshotSlots;
}

}  // namespace

int32_t& ResourceDemand::operator[](ResourceType type) noexcept { return member(*this, type); }

int32_t ResourceDemand::operator[](ResourceType type) const noexcept { return member(*this, type); }

int64_t ResourceDemand::total() const noexcept {
  return int64_t{baseKvPages} + draftKvPages + recurrentSnapshotSlots + partialKvSnapshotSlots;
}

bool ResourceDemand::covers(ResourceDemand const& other) const noexcept {
  for (ResourceType type : kAllResourceTypes) {
    if ((*this)[type] < other[type]) {
      return false;
    }
  }
  return true;
}

bool ResourceDemand::hasNegative() const noexcept {
  return baseKvPages < 0 || draftKvPages < 0 || recurrentSnapshotSlots < 0 ||
         partialKvSnapshotSlots < 0;
}

ResourcePools::ResourcePools(ResourceDemand capacities) : mCapacities(capacities) {
  MKV_REQUIRE(!capacities.hasNegative(), "ResourcePools",
              "capacities must be non-negative: base {}, draft {}, recurrent {}, partial {}",
              capacities.baseKvPages, capacities.draftKvPages, capacities.recurrentSnapshotSlots,
              capacities.partialKvSnapshotSlots);
  for (ResourceType type : kAllResourceTypes) {
    auto const n = static_cast<std::size_t>(capacities[type]);
    Pool& p = pool(type);
    p.active.assign(n, 0);
    p.cache.assign(n, 0);
    p.ring.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      p.ring[i] = static_cast<int32_t>(i);
    }
    p.freeCount = capacities[type];
  }
}

ResourceDemand ResourcePools::freeCounts() const noexcept {
  ResourceDemand free;
  for (ResourceType type : kAllResourceTypes) {
    free[type] = pool(type).freeCount;
  }
  return free;
}

void ResourcePools::checkId(char const* call, ResourceId id) const {
  MKV_REQUIRE(static_cast<uint8_t>(id.type) < kResourceTypeCount, call,
              "resource type {} out of range", static_cast<int>(id.type));
  MKV_REQUIRE(id.index >= 0 && id.index < mCapacities[id.type], call, "{} id {} outside [0, {})",
              toString(id.type), id.index, mCapacities[id.type]);
}

int32_t ResourcePools::activeRefs(ResourceId id) const {
  checkId("ResourcePools::activeRefs", id);
  return pool(id.type).active[static_cast<std::size_t>(id.index)];
}

int32_t ResourcePools::cacheRefs(ResourceId id) const {
  checkId("ResourcePools::cacheRefs", id);
  return pool(id.type).cache[static_cast<std::size_t>(id.index)];
}

bool ResourcePools::isFree(ResourceId id) const {
  checkId("ResourcePools::isFree", id);
  auto const i = static_cast<std::size_t>(id.index);
  Pool const& p = pool(id.type);
  return p.active[i] == 0 && p.cache[i] == 0;
}

std::vector<int32_t> ResourcePools::freeList(ResourceType type) const {
  Pool const& p = pool(type);
  std::vector<int32_t> out;
  out.reserve(static_cast<std::size_t>(p.freeCount));
  int32_t const cap = mCapacities[type];
  for (int32_t k = 0; k < p.freeCount; ++k) {
    out.push_back(p.ring[static_cast<std::size_t>((p.head + k) % cap)]);
  }
  return out;
}

bool ResourcePools::canAllocate(ResourceDemand const& demand) const noexcept {
  return !demand.hasNegative() && freeCounts().covers(demand);
}

bool ResourcePools::allocate(ResourceDemand const& demand,
                             std::array<std::vector<int32_t>*, kResourceTypeCount> const& targets) {
  MKV_REQUIRE(!demand.hasNegative(), "ResourcePools::allocate",
              "negative demand: base {}, draft {}, recurrent {}, partial {}", demand.baseKvPages,
              demand.draftKvPages, demand.recurrentSnapshotSlots, demand.partialKvSnapshotSlots);
  for (ResourceType type : kAllResourceTypes) {
    MKV_REQUIRE(demand[type] == 0 || targets[static_cast<std::size_t>(type)] != nullptr,
                "ResourcePools::allocate", "no target for {} {}", demand[type], toString(type));
  }
  if (!canAllocate(demand)) {
    return false;
  }
  for (ResourceType type : kAllResourceTypes) {
    if (std::vector<int32_t>* target = targets[static_cast<std::size_t>(type)]) {
      target->reserve(target->size() + static_cast<std::size_t>(demand[type]));
    }
  }
  for (ResourceType type : kAllResourceTypes) {
    Pool& p = pool(type);
    int32_t const cap = mCapacities[type];
    for (int32_t k = 0; k < demand[type]; ++k) {
      int32_t const index = p.ring[static_cast<std::size_t>(p.head)];
      p.head = (p.head + 1) % cap;
      --p.freeCount;
      p.active[static_cast<std::size_t>(index)] = 1;
      targets[static_cast<std::size_t>(type)]->push_back(index);
    }
  }
  return true;
}

void ResourcePools::pushFree(Pool& p, int32_t index) noexcept {
  auto const cap = static_cast<int32_t>(p.ring.size());
  p.ring[static_cast<std::size_t>((p.head + p.freeCount) % cap)] = index;
  ++p.freeCount;
}

void ResourcePools::addActive(ResourceId id) {
  checkId("ResourcePools::addActive", id);
  Pool& p = pool(id.type);
  auto const i = static_cast<std::size_t>(id.index);
  MKV_REQUIRE(p.active[i] > 0 || p.cache[i] > 0, "ResourcePools::addActive",
              "{} {} is free; allocate it instead of pinning", toString(id.type), id.index);
  if (p.active[i] == 0) {
    --p.reclaimable;
  }
  ++p.active[i];
}

bool ResourcePools::dropActive(ResourceId id) {
  checkId("ResourcePools::dropActive", id);
  Pool& p = pool(id.type);
  auto const i = static_cast<std::size_t>(id.index);
  MKV_REQUIRE(p.active[i] > 0, "ResourcePools::dropActive", "{} {} has no active reference",
              toString(id.type), id.index);
  if (--p.active[i] > 0) {
    return false;
  }
  if (p.cache[i] > 0) {
    ++p.reclaimable;
    return false;
  }
  pushFree(p, id.index);
  return true;
}

void ResourcePools::addCache(ResourceId id) {
  checkId("ResourcePools::addCache", id);
  Pool& p = pool(id.type);
  auto const i = static_cast<std::size_t>(id.index);
  MKV_REQUIRE(p.active[i] > 0 || p.cache[i] > 0, "ResourcePools::addCache",
              "{} {} is free; only allocated resources can be published", toString(id.type),
              id.index);
  ++p.cache[i];  // reclaimable (cache > 0, active == 0) is unchanged: the slot was allocated
}

bool ResourcePools::dropCache(ResourceId id) {
  checkId("ResourcePools::dropCache", id);
  Pool& p = pool(id.type);
  auto const i = static_cast<std::size_t>(id.index);
  MKV_REQUIRE(p.cache[i] > 0, "ResourcePools::dropCache", "{} {} has no cache reference",
              toString(id.type), id.index);
  if (--p.cache[i] > 0 || p.active[i] > 0) {
    return false;
  }
  --p.reclaimable;
  pushFree(p, id.index);
  return true;
}

}  // namespace mkv
