/// \file coordinator_invariants.cpp
/// The coordinator's invariants after every operation: request and quarantine counts, page
/// conservation, references against records and the block index, the free ring, leases.

#include "fuzz/lifecycle/lifecycle.h"

namespace mkv::fuzz::lifecycle {

void Lifecycle::checkCoordinator() {
  ContextCacheCoordinator const& c = *mCoordinator;
  expectf(c.activeRequestCount() == liveRequests(),
          "coordinator has {} active requests, the driver {}", c.activeRequestCount(),
          liveRequests());
  expectf(c.quarantinedRequestCount() == static_cast<int32_t>(mQuarantine.size()),
          "coordinator quarantines {} requests, the driver {}", c.quarantinedRequestCount(),
          mQuarantine.size());
  expectf(c.counters().synchronizations == static_cast<uint64_t>(mSync.calls()),
          "coordinator counts {} synchronisations, the synchroniser saw {}",
          c.counters().synchronizations, mSync.calls());
  checkCoordinatorPages();
  checkFreeRing();
  checkCoordinatorLeases();
  checkSnapshotResources();
}

/// Draft pages and snapshot slots (recurrent, partial KV) are conserved like base pages: each
/// one's cache references are the records listing it, it is free, pinned or cached, the
/// reclaimable count agrees, and the free ring holds each free one once.
void Lifecycle::checkSnapshotResources() {
  ContextCacheManager const& m = mCoordinator->manager();
  std::vector<std::vector<int32_t>> refs(kAllResourceTypes.size());
  for (ResourceType type : kAllResourceTypes) {
    refs[static_cast<std::size_t>(type)].assign(static_cast<std::size_t>(m.pools().capacity(type)),
                                                0);
  }
  for (CacheRecord const& record : m.records().lruToMru()) {
    record.forEachResource([&](ResourceId const& id) {
      std::vector<int32_t>& counts = refs[static_cast<std::size_t>(id.type)];
      expectf(id.index >= 0 && id.index < static_cast<int32_t>(counts.size()),
              "record {} lists {} {}", record.id, toString(id.type), id.index);
      ++counts[static_cast<std::size_t>(id.index)];
    });
  }
  for (ResourceType type : kAllResourceTypes) {
    if (type != ResourceType::kBaseKvPage) {  // base pages: checkCoordinatorPages
      checkResourceConservation(type, refs[static_cast<std::size_t>(type)]);
    }
  }
}

void Lifecycle::checkResourceConservation(ResourceType type,
                                          std::vector<int32_t> const& recordRefs) {
  ResourcePools const& pools = mCoordinator->manager().pools();
  int32_t const capacity = pools.capacity(type);
  int32_t used = 0;
  int32_t reclaimable = 0;
  for (int32_t id = 0; id < capacity; ++id) {
    int32_t const active = pools.activeRefs({type, id});
    int32_t const cache = pools.cacheRefs({type, id});
    used += active > 0 || cache > 0 ? 1 : 0;
    reclaimable += cache > 0 && active == 0 ? 1 : 0;
    expectf(cache == recordRefs[static_cast<std::size_t>(id)],
            "{} {} has {} cache references but {} records list it", toString(type), id, cache,
            recordRefs[static_cast<std::size_t>(id)]);
  }
  expectf(pools.freeCount(type) + used == capacity, "{} conservation: {} free + {} held != {}",
          toString(type), pools.freeCount(type), used, capacity);
  expectf(pools.reclaimableCount(type) == reclaimable, "{}: {} reclaimable, the pool says {}",
          toString(type), reclaimable, pools.reclaimableCount(type));
  std::vector<int32_t> const ring = pools.freeList(type);
  expectf(static_cast<int32_t>(ring.size()) == pools.freeCount(type), "{} free ring size",
          toString(type));
  std::vector<uint8_t> inRing(static_cast<std::size_t>(capacity), 0);
  for (int32_t id : ring) {
    expectf(id >= 0 && id < capacity && inRing[static_cast<std::size_t>(id)]++ == 0,
            "{} free ring holds {} twice or out of range", toString(type), id);
    expectf(pools.activeRefs({type, id}) == 0 && pools.cacheRefs({type, id}) == 0,
            "free {} {} has references", toString(type), id);
  }
}

/// Every record's pages are indexed under its digests; every page's cache references are the
/// records listing it; pages are free, pinned or cached, and the reclaimable count agrees.
void Lifecycle::checkCoordinatorPages() {
  ContextCacheManager const& m = mCoordinator->manager();
  ResourcePools const& pools = m.pools();
  constexpr ResourceType kBase = ResourceType::kBaseKvPage;
  int32_t const capacity = pools.capacity(kBase);
  std::vector<int32_t> recordRefs(static_cast<std::size_t>(capacity), 0);
  for (CacheRecord const& record : m.records().lruToMru()) {
    expectf(record.basePagePath.size() == record.logicalBlockDigests.size(),
            "record {} has {} pages for {} blocks", record.id, record.basePagePath.size(),
            record.logicalBlockDigests.size());
    for (std::size_t b = 0; b < record.basePagePath.size(); ++b) {
      PageId const page = record.basePagePath[b];
      expectf(page >= 0 && page < capacity, "record {} lists page {}", record.id, page);
      ++recordRefs[static_cast<std::size_t>(page)];
      std::optional<Hash128> const digest = m.index().digestOf(page);
      expectf(digest.has_value() && *digest == record.logicalBlockDigests[b],
              "record {} block {} on page {} is not indexed under its digest", record.id, b, page);
    }
  }
  int32_t used = 0;
  int32_t reclaimable = 0;
  int32_t indexed = 0;
  for (PageId page = 0; page < capacity; ++page) {
    int32_t const active = pools.activeRefs({kBase, page});
    int32_t const cache = pools.cacheRefs({kBase, page});
    used += active > 0 || cache > 0 ? 1 : 0;
    reclaimable += cache > 0 && active == 0 ? 1 : 0;
    expectf(cache == recordRefs[static_cast<std::size_t>(page)],
            "page {} has {} cache references but {} records list it", page, cache,
            recordRefs[static_cast<std::size_t>(page)]);
    if (m.index().digestOf(page).has_value()) {
      ++indexed;
      expectf(cache > 0, "page {} is indexed without a cache reference", page);
    }
  }
  expectf(pools.freeCount(kBase) + used == capacity,
          "page conservation: {} free + {} pinned or cached != {}", pools.freeCount(kBase), used,
          capacity);
  expectf(pools.reclaimableCount(kBase) == reclaimable, "{} pages reclaimable, the pool says {}",
          reclaimable, pools.reclaimableCount(kBase));
  expectf(m.index().size() == indexed, "the index holds {} digests on {} pages", m.index().size(),
          indexed);
}

/// The free ring holds each free page once, and free pages have no references.
void Lifecycle::checkFreeRing() {
  ResourcePools const& pools = mCoordinator->manager().pools();
  constexpr ResourceType kBase = ResourceType::kBaseKvPage;
  int32_t const capacity = pools.capacity(kBase);
  std::vector<int32_t> const ring = pools.freeList(kBase);
  expect(static_cast<int32_t>(ring.size()) == pools.freeCount(kBase), "free ring size");
  std::vector<uint8_t> inRing(static_cast<std::size_t>(capacity), 0);
  for (int32_t page : ring) {
    expectf(page >= 0 && page < capacity && inRing[static_cast<std::size_t>(page)]++ == 0,
            "free ring holds page {} twice or out of range", page);
    expectf(pools.activeRefs({kBase, page}) == 0 && pools.cacheRefs({kBase, page}) == 0,
            "free page {} has references", page);
  }
}

/// One live lease per row of a live or quarantined request.
void Lifecycle::checkCoordinatorLeases() {
  int32_t leases = 0;
  for (auto const& req : mRequests) {
    leases += req->stage != Stage::kGone ? static_cast<int32_t>(req->rows.size()) : 0;
  }
  for (Quarantined const& quarantined : mQuarantine) {
    leases += static_cast<int32_t>(quarantined.rows.size());
  }
  int32_t const live = mCoordinator->manager().liveLeaseCount();
  expectf(live == leases, "{} live leases for {} rows", live, leases);
}

}  // namespace mkv::fuzz::lifecycle
