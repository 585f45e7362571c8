#include "support/backend_snapshot.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/snapshot_storage.h"

#include <cstring>
#include <optional>
#include <span>

#include "context_cache/window_block_cache.h"

namespace mkv::test {
namespace {

uint64_t mixWord(uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

uint64_t digestBytes(uint64_t digest, void const* data, std::size_t bytes) {
  auto const* p = static_cast<uint8_t const*>(data);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, p + i, 8);
    digest = mixWord(digest ^ word);
  }
  for (; i < bytes; ++i) {
    digest = mixWord(digest ^ p[i]);
  }
  return digest;
}

void captureTables(KVCacheRuntime& runtime, BackendSnapshot& s) {
  for (KVPageTable const* table :
       {runtime.fullPageTable(), runtime.swaPageTable(), runtime.draftPageTable()}) {
    if (table == nullptr) {
      continue;
    }
    for (CacheSlot slot = 0; slot < table->maxBatch(); ++slot) {
      std::span<int32_t const> const row = table->hostRow(slot);
      s.tables.insert(s.tables.end(), row.begin(), row.end());
    }
    auto const* device = table->deviceTable().dataPointer<int32_t>();
    s.tables.insert(s.tables.end(), device, device + table->deviceTable().numel());
    s.tables.push_back(table->dirty() ? 1 : 0);
  }
}

void capturePools(KVCacheRuntime& runtime, bool deviceBytes, BackendSnapshot& s) {
  uint64_t bytes = 0;
  for (KVCachePool const* pool : {runtime.fullPool(), runtime.swaPool(), runtime.draftPool()}) {
    if (pool == nullptr) {
      continue;
    }
    s.lengths.push_back(pool->activeBatchSize());
    auto const* lengths = static_cast<int32_t const*>(pool->kvLengths().rawPointer());
    s.lengths.insert(s.lengths.end(), lengths, lengths + pool->maxBatchSize());
    for (int32_t layer = 0; deviceBytes && layer < pool->numLayers(); ++layer) {
      Tensor const& buffer = pool->layer(layer);
      bytes = digestBytes(bytes, buffer.rawPointer(), static_cast<std::size_t>(buffer.sizeBytes()));
    }
  }
  RecurrentStatePool const* recurrent = runtime.recurrentState();
  for (int32_t layer = 0; deviceBytes && recurrent != nullptr && layer < recurrent->numLayers();
       ++layer) {
    for (Tensor const* buffer : {&recurrent->state(layer), &recurrent->conv(layer)}) {
      bytes =
          digestBytes(bytes, buffer->rawPointer(), static_cast<std::size_t>(buffer->sizeBytes()));
    }
  }
  // The checkpoint slabs of hybrid deployments: recurrent rows, partial pages, hidden rows.
  ContextCacheCoordinator const* coordinator = runtime.contextCache();
  SnapshotStorage const* snapshots = coordinator != nullptr ? coordinator->snapshots() : nullptr;
  if (deviceBytes && snapshots != nullptr) {
    auto digest = [&](Tensor const& slab) {
      bytes = digestBytes(bytes, slab.rawPointer(), static_cast<std::size_t>(slab.sizeBytes()));
    };
    SnapshotStorageConfig const& config = snapshots->config();
    for (int32_t layer = 0;
         recurrent != nullptr && config.recurrentSlots > 0 && layer < recurrent->numLayers();
         ++layer) {
      digest(snapshots->recurrentStateSlab(layer));
      digest(snapshots->recurrentConvSlab(layer));
    }
    KVCachePool const* base = runtime.fullPool();
    for (int32_t layer = 0;
         base != nullptr && config.partialKvSlots > 0 && layer < base->numLayers(); ++layer) {
      digest(snapshots->partialKvSlab(layer));
    }
    KVCachePool const* draft = runtime.draftPool();
    for (int32_t layer = 0;
         snapshots->hasDraft() && config.partialKvSlots > 0 && layer < draft->numLayers();
         ++layer) {
      digest(snapshots->partialKvSlab(layer, true));
    }
    if (snapshots->hasBoundaryHidden()) {
      digest(snapshots->boundaryHiddenSlab());
    }
  }
  s.deviceBytes = bytes;
}

void captureCoordinator(ContextCacheCoordinator const& c, BackendSnapshot& s) {
  s.poisoned = c.poisoned();
  s.activeRequests = c.activeRequestCount();
  s.quarantined = c.quarantinedRequestCount();
  s.freePages = c.manager().pools().freeCount(ResourceType::kBaseKvPage);
  s.liveLeases = c.manager().liveLeaseCount();
  s.manager = captureState(c.manager());
  ContextCacheCoordinatorCounters const& k = c.counters();
  ContextCacheMetrics const m = c.metrics();
  s.counters = {k.requests,
                k.refusedRequests,
                k.prefillPublications,
                k.decodePublications,
                k.liveAdmissions,
                k.liveAdmissionRefusals,
                k.retractedAdmissions,
                k.pageGrowths,
                k.growthFailures,
                k.synchronizations,
                k.quarantinedRequests,
                k.checkpointRestores,
                k.checkpointCaptures,
                k.checkpointPublications,
                k.snapshotPressureSkips,
                k.captureSynchronizations,
                k.specPairPublications,
                k.hybridMtpPublications,
                k.boundaryHiddenRestores,
                m.admittedSequences,
                m.lookups,
                m.hits,
                m.bypasses,
                m.failedAcquisitions,
                m.publishedRecords,
                m.existingRecordsTouched,
                m.evictedRecords};
}

void captureSlidingHalf(BoundedSwaKVPageManager const& swa, WindowBlockCache const& window,
                        BackendSnapshot& s) {
  s.sliding = {swa.poisoned() ? 1 : 0, swa.activeRequestCount(), swa.quarantinedPageCount()};
  for (PageId page = 0; page < window.totalPages(); ++page) {
    s.sliding.push_back(window.holders(page));
    std::optional<Hash128> const digest = window.index().digestOf(page);
    s.sliding.push_back(digest ? static_cast<int64_t>(digest->lo) : 0);
  }
  s.sliding.insert(s.sliding.end(),
                   {window.freePages(), window.cachedBlocks(), window.evictablePages(),
                    window.evictablePointPages(), window.evictableReadPages()});
}

}  // namespace

BackendSnapshot captureBackend(KVCacheRuntime& runtime, bool deviceBytes) {
  BackendSnapshot s;
  captureTables(runtime, s);
  capturePools(runtime, deviceBytes, s);
  if (ContextCacheCoordinator const* coordinator = runtime.contextCache()) {
    captureCoordinator(*coordinator, s);
    if (WindowBlockCache const* window = runtime.windowBlockCache()) {
      captureSlidingHalf(*runtime.swaPageManager(), *window, s);
    }
    return s;
  }
  BoundedSwaKVPageManager const& swa = *runtime.swaPageManager();
  s.poisoned = swa.poisoned();
  s.activeRequests = swa.activeRequestCount();
  s.quarantined = swa.quarantinedPageCount();
  s.freePages = swa.freePageCount();
  return s;
}

void appendRequestView(ContextCacheCoordinator const& coordinator,
                       ContextCacheCoordinator::RequestHandle const& request,
                       std::vector<int64_t>& out) {
  if (!request.valid()) {
    return;
  }
  int32_t const batch = coordinator.batchSize(request);
  out.push_back(batch);
  for (int32_t i = 0; i < batch; ++i) {
    out.push_back(coordinator.committedLength(request, i));
    out.push_back(coordinator.reuseTokenLength(request, i));
    for (PageId page : coordinator.basePages(request, i)) {
      out.push_back(page);
    }
    out.push_back(-1);
    out.push_back(coordinator.commonLength(request, i));
    for (PageId page : coordinator.draftPages(request, i)) {
      out.push_back(page);
    }
    out.push_back(-2);
  }
}

void appendRequestView(BoundedSwaKVPageManager const& swa,
                       BoundedSwaKVPageManager::RequestHandle const& request,
                       std::vector<int64_t>& out) {
  if (!request.valid()) {
    return;
  }
  int32_t const batch = swa.batchSize(request);
  out.push_back(batch);
  for (int32_t i = 0; i < batch; ++i) {
    SwaSequenceState const& state = swa.state(request, i);
    out.push_back(state.endpoint);
    out.push_back(state.pendingEndpoint.value_or(-1));
    for (SwaPageBinding const& binding : state.bindings) {
      out.push_back(binding.logicalPage);
      out.push_back(binding.page);
    }
    out.push_back(-1);
    out.insert(out.end(), state.reservedPages.begin(), state.reservedPages.end());
    out.push_back(-2);
    for (SwaPageBinding const& binding : state.pendingRetire) {
      out.push_back(binding.page);
    }
    out.push_back(-3);
    for (SwaPageBinding const& binding : state.newBindings) {
      out.push_back(binding.page);
    }
    out.push_back(-4);
  }
}

std::string differences(BackendSnapshot const& a, BackendSnapshot const& b) {
  std::string fields;
  auto note = [&](bool same, char const* name) {
    if (!same) {
      fields += fields.empty() ? name : std::string(", ") + name;
    }
  };
  note(a.synchronizations == b.synchronizations, "synchronisations");
  note(a.poisoned == b.poisoned, "poison");
  note(a.activeRequests == b.activeRequests, "active requests");
  note(a.quarantined == b.quarantined, "quarantine");
  note(a.freePages == b.freePages, "free pages");
  note(a.liveLeases == b.liveLeases, "leases");
  note(a.manager == b.manager, "manager state (refcounts, free rings, index, records)");
  note(a.counters == b.counters, "counters");
  note(a.tables == b.tables, "page tables");
  note(a.lengths == b.lengths, "KV lengths");
  note(a.deviceBytes == b.deviceBytes, "device bytes");
  note(a.requests == b.requests, "request views");
  note(a.sliding == b.sliding, "sliding half and pool");
  return fields;
}

}  // namespace mkv::test
