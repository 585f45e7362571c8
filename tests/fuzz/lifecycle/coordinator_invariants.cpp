/// \file coordinator_invariants.cpp
/// The coordinator's invariants after every operation: request and quarantine counts, page
/// conservation, references against records and the block index, the free ring, leases.

#include <cstring>

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/context_cache/context_cache_coordinator.h"

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
  if (checkpointDeployment()) {
    checkCheckpoints();
  }
}

/// Files the prefix [0, length) of a row under the key a checkpoint of it would have, with the
/// digests of the state it must hold (called wherever a capture may have been committed).
void Lifecycle::noteCheckpoint(Req const& req, Row const& row, int32_t length, bool mtp) {
  if (length <= 0) {
    return;
  }
  std::vector<int32_t> tokens = row.prompt;
  tokens.insert(tokens.end(), row.generated.begin(), row.generated.end());
  tokens.resize(static_cast<std::size_t>(length));
  BlockKeyExtras const extras{digestIdentity(req.lora), digestIdentity(req.salt)};
  PromptBlocks const blocks = hashPromptBlocks(PromptView{tokens, {}, extras}, kPage);
  Hash128 const digest = exactPrefixDigest(blocks, length);
  for (CheckpointPrefix const& known : mCheckpointLedger) {
    if (known.exactDigest == digest && known.length == length && known.mtp == mtp) {
      return;
    }
  }
  CheckpointPrefix prefix{digest, length, mtp, row.digests, row.draft};
  prefix.digests.truncate(length);
  mCheckpointLedger.push_back(std::move(prefix));
}

/// Every checkpoint record holds, bit for bit, the state of the prefix it is filed under: the
/// recurrent rows after it, the valid rows of its partial page (base, and draft for Hybrid-MTP
/// but the boundary token's draft row, which depends on the next token), the boundary hidden row.
void Lifecycle::checkCheckpoints() {
  for (CacheRecord const& record : mCoordinator->manager().records().lruToMru()) {
    std::optional<HybridKey> const key = record.hybridKey();
    if (!key) {
      continue;
    }
    CheckpointPrefix const* prefix = nullptr;
    for (CheckpointPrefix const& known : mCheckpointLedger) {
      if (known.exactDigest == key->exactDigest && known.length == key->exactLength &&
          known.mtp == key->mtp) {
        prefix = &known;
      }
    }
    expectf(prefix != nullptr, "checkpoint record {} ({} tokens{}) of a prefix no row captured",
            record.id, key->exactLength, key->mtp ? ", Hybrid-MTP" : "");
    checkCheckpoint(record, *prefix);
    ++mStats.checkpointSlabChecks;
  }
}

void Lifecycle::checkCheckpoint(CacheRecord const& record, CheckpointPrefix const& prefix) {
  SnapshotStorage const& slabs = *mCoordinator->snapshots();
  RecurrentStatePool const& recurrent = *mRuntime->recurrentState();
  int32_t const length = prefix.length;
  uint64_t const last = prefix.digests.at(length - 1);
  expectf(record.recurrentSnapshotSlot.has_value(), "checkpoint record {} has no recurrent slot",
          record.id);
  auto const slot = static_cast<std::size_t>(*record.recurrentSnapshotSlot);
  std::vector<uint8_t> expected;
  for (int32_t layer = 0; layer < recurrent.numLayers(); ++layer) {
    for (bool conv : {false, true}) {
      Tensor const& slab = conv ? slabs.recurrentConvSlab(layer) : slabs.recurrentStateSlab(layer);
      auto const rowBytes = static_cast<std::size_t>(slab.sizeBytes() / slab.dim(0));
      expected.resize(rowBytes);
      testing::RecurrentOracle::expectedRow(last, layer, conv, expected);
      auto const* found = static_cast<uint8_t const*>(slab.rawPointer()) + slot * rowBytes;
      expectf(std::memcmp(found, expected.data(), rowBytes) == 0,
              "checkpoint record {} ({} tokens): recurrent {} row of layer {} is not the state "
              "of its prefix",
              record.id, length, conv ? "conv" : "state", layer);
    }
  }
  if (prefix.mtp) {
    Tensor const& hidden = slabs.boundaryHiddenSlab();
    std::size_t const rowBytes = static_cast<std::size_t>(kHiddenWidth) * 2;
    expected.resize(rowBytes);
    testing::KvOracle::expectedRow(last, 7, 0, expected);
    expectf(std::memcmp(static_cast<uint8_t const*>(hidden.rawPointer()) + slot * rowBytes,
                        expected.data(), rowBytes) == 0,
            "checkpoint record {} ({} tokens): the boundary hidden row is not its prefix's",
            record.id, length);
  }
  // The partial page: rows [first, length) of logical page first / P.
  int32_t const first = prefix.mtp ? (length - 1) / kPage * kPage : length / kPage * kPage;
  if (!record.partialKvSnapshotSlot) {
    expectf(!prefix.mtp && length % kPage == 0,
            "checkpoint record {} ({} tokens) has no partial "
            "page",
            record.id, length);
    return;
  }
  auto const partial = static_cast<int64_t>(*record.partialKvSnapshotSlot);
  for (bool draft : {false, true}) {
    if (draft && !prefix.mtp) {
      break;
    }
    KVCachePool const& pool = draft ? *mRuntime->draftPool() : *mRuntime->fullPool();
    auto const tokenBytes = static_cast<std::size_t>(pool.tokenBytes());
    int32_t const end = draft ? length - 1 : length;  // the boundary draft row is recomputed
    expected.resize(tokenBytes);
    for (int32_t layer = 0; layer < pool.numLayers(); ++layer) {
      Tensor const& slab = slabs.partialKvSlab(layer, draft);
      int64_t const slots = slab.dim(1);
      for (int32_t half = 0; half < 2; ++half) {
        for (int32_t position = first; position < end; ++position) {
          uint64_t const digest = draft ? prefix.draft.at(position) : prefix.digests.at(position);
          testing::KvOracle::expectedRow(digest, layer, half, expected);
          std::size_t const offset =
              static_cast<std::size_t>((half * slots + partial) * kPage + (position - first)) *
              tokenBytes;
          expectf(std::memcmp(static_cast<uint8_t const*>(slab.rawPointer()) + offset,
                              expected.data(), tokenBytes) == 0,
                  "checkpoint record {} ({} tokens): {} partial page row {} of layer {} ({}) is "
                  "not its prefix's",
                  record.id, length, draft ? "draft" : "base", position, layer, half ? "V" : "K");
        }
      }
    }
  }
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
  // The public capacity query agrees with the page accounting counted here page by page.
  KVCacheCapacity const query = mRuntime->capacity();
  expect(query.base.has_value(), "capacity() reports no base pool");
  if (query.base) {
    expectf(query.base->totalPages == capacity && query.base->freePages == capacity - used &&
                query.base->reclaimablePages == reclaimable &&
                query.base->leasedPages == used - reclaimable,
            "capacity() says {} total, {} free, {} reclaimable, {} leased; the pages say {}, {}, "
            "{}, {}",
            query.base->totalPages, query.base->freePages, query.base->reclaimablePages,
            query.base->leasedPages, capacity, capacity - used, reclaimable, used - reclaimable);
  }
  ContextCacheMetrics const metrics = mCoordinator->metrics();
  expectf(metrics.leased(kBase) == used - reclaimable && metrics.baseUsage() == query.usage(),
          "metrics say {} leased pages (usage {}), the pages {} (usage {})", metrics.leased(kBase),
          metrics.baseUsage(), used - reclaimable, query.usage());
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
