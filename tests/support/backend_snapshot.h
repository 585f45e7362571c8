#pragma once
/// \file backend_snapshot.h
/// What a contract violation must leave unchanged on a KVCacheRuntime of host tensors (the
/// lifecycle driver and the allocation fault test): the backend's counts and poison, the
/// coordinator's manager state and counters, every page table (host rows, device mirror, dirty
/// flag; the draft table of speculative runtimes included), every KV-length tensor (the draft
/// pool's included), optionally a digest of every KV, recurrent and checkpoint-slab byte, and what
/// the backend reports about the requests the caller holds. Reads device memory through host
/// pointers: host (kCPU) runtimes only.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_runtime.h"
#include "support/manager_state.h"

namespace mkv::test {

struct BackendSnapshot {
  int64_t synchronizations = 0;  ///< set by the caller (FaultArming::calls()); 0 if not compared
  bool poisoned = false;
  int32_t activeRequests = 0;
  int32_t quarantined = 0;              ///< requests (coordinator) or pages (bounded SWA)
  int32_t freePages = 0;                ///< base KV pages (coordinator) or SWA pages
  int32_t liveLeases = 0;               ///< coordinator only
  std::optional<ManagerState> manager;  ///< coordinator only
  std::vector<uint64_t> counters;       ///< coordinator counters, then its cache metrics
  std::vector<int32_t> tables;          ///< host rows, device mirrors and dirty flags (+ draft)
  std::vector<int32_t> lengths;         ///< active batch and every KV length of every pool
  /// Digest of every KV byte (base, SWA, draft pools), recurrent row and checkpoint slab (recurrent
  /// rows, partial pages, boundary hidden rows), if asked.
  uint64_t deviceBytes = 0;
  std::vector<int64_t> requests;  ///< appendRequestView() of the caller's requests
  /// Sliding-window reuse: the SWA half's poison, active requests and quarantined pages, then
  /// the sliding pool (WindowBlockCache) page by page (holders, the cached digest's low bits or
  /// 0) and its free, cached, evictable, point-window and read-tier counts.
  std::vector<int64_t> sliding;
  friend bool operator==(BackendSnapshot const&, BackendSnapshot const&) = default;
};

/// The runtime's backend state; `deviceBytes` also digests every KV and recurrent byte (the
/// lifecycle driver; the fault test compares bytes through the oracle instead). Reads only.
BackendSnapshot captureBackend(KVCacheRuntime& runtime, bool deviceBytes = false);

/// Appends what the coordinator reports about `request`: batch size, then per row its committed
/// and reuse lengths and base pages, -1, its common length and draft pages, -2. Nothing for an
/// invalid handle.
void appendRequestView(ContextCacheCoordinator const& coordinator,
                       ContextCacheCoordinator::RequestHandle const& request,
                       std::vector<int64_t>& out);
/// Appends what the SWA manager reports about `request`: batch size, then per row its endpoints,
/// bindings, reserved, retiring and new pages, each list ended by a negative marker.
void appendRequestView(BoundedSwaKVPageManager const& swa,
                       BoundedSwaKVPageManager::RequestHandle const& request,
                       std::vector<int64_t>& out);

/// Comma-separated names of the fields that differ ("" when equal).
std::string differences(BackendSnapshot const& a, BackendSnapshot const& b);

}  // namespace mkv::test
