#pragma once
/// \file context_cache_metrics.h
/// Counters of context reuse and their Prometheus rendering (docs/context_cache.md,
/// "Observability").
///
/// Thread-safety: plain value type; toPrometheus is pure.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "mkv/context_cache/context_cache_types.h"

namespace mkv {

/// Cumulative counters of one ContextCacheManager plus a snapshot of its occupancy (gauges),
/// returned by ContextCacheManager::metrics(). "Admission" counters are counted by
/// admit only (the coordinator's per-sequence entry point); acquire() on a
/// hand-made plan counts nothing but evictions.
struct ContextCacheMetrics {
  // Admission.
  uint64_t admittedSequences = 0;  ///< sequences that got a lease
  uint64_t lookups = 0;            ///< kUseCache admissions (bypasses are not lookups)
  uint64_t hits = 0;               ///< admitted lookups whose plan matched > 0 tokens
  uint64_t matchedTokens = 0;      ///< sum of matched tokens of admitted plans
  uint64_t reusedTokens = 0;       ///< sum of reused tokens (execution skipped)
  /// Prompt tokens of every lookup, admitted or not (vLLM's prefix_cache_queries: a lookup
  /// refused for capacity and retried later counts again).
  uint64_t queriedTokens = 0;
  uint64_t bypasses = 0;             ///< kBypass admissions
  uint64_t fullInputRewinds = 0;     ///< admitted plans of kind kFullInputRewind
  uint64_t specFullPageReplays = 0;  ///< admitted spec plans with SpecReplayMode::kFullPage
  uint64_t failedAcquisitions = 0;   ///< admissions that got no lease (insufficient capacity)
  /// Window rule (composed backend): prompt tokens of admitted lookups that the full layers could
  /// have reused but whose sliding-layer window was no longer cached (MissReason::kWindowEvicted).
  uint64_t windowLimitedTokens = 0;
  /// Lookups that did not reuse all their full blocks, by reason (one reason per lookup; kCapacity
  /// when the admission was refused for capacity).
  std::array<uint64_t, kMissReasonCount> misses{};

  // Publication.
  uint64_t publishedRecords = 0;        ///< new records inserted
  uint64_t existingRecordsTouched = 0;  ///< duplicate publications (first producer kept)
  uint64_t specUpgrades = 0;            ///< spec state attached to an existing base-only record
  uint64_t rejectedPublications = 0;    ///< verification refused the very first block
  /// Records of prefill chunks the same sequence's next, longer publication replaced (each held
  /// no resource the longer one does not; not evictions).
  uint64_t replacedChunkRecords = 0;

  // Eviction and verification.
  uint64_t evictedRecords = 0;
  uint64_t evictedReusePoints = 0;  ///< of evictedRecords, checkpoints kept at reuse points
  uint64_t prefixCacheResets = 0;   ///< successful ContextCacheManager::resetPrefixCache calls
  uint64_t resetRecords = 0;        ///< records those resets dropped (not counted as evictions)
  /// Resources returned to a free ring by an eviction or a reset (not by a lease release), per
  /// type.
  std::array<uint64_t, kResourceTypeCount> reclaimedResources{};
  uint64_t verificationRejects = 0;  ///< digest hits refused by token verification
  uint64_t droppedEvents = 0;        ///< KV events overwritten in the full event queue

  // Host tier (docs/context_cache.md, "Host tier"); all zero without one.
  uint64_t offloadedPages = 0;  ///< evicted GPU pages copied to the host tier
  uint64_t onboardedPages = 0;  ///< host pages copied into fresh GPU pages of admitted plans
  uint64_t offloadedBytes = 0;  ///< bytes of those offloads (all layers, K and V)
  uint64_t onboardedBytes = 0;  ///< bytes of those onboardings
  /// Reused tokens of admitted plans that came from the host tier (part of reusedTokens; the rest
  /// were hits on the GPU).
  uint64_t hostTierHitTokens = 0;
  uint64_t hostTierDroppedPages = 0;  ///< blocks the full host tier dropped for good (its LRU)
  uint64_t hostTierOffloadFailures =
      0;                            ///< evicted blocks not kept: a host-index allocation failed
  uint64_t hostTierResetPages = 0;  ///< host blocks dropped by prefix cache resets
  /// Blocks of rows preempted with PreemptionKind::kSwap that left the GPU index for the host tier
  /// when the compaction dropped their rows (demoteToHostTier; their copies count in
  /// offloadedPages unless the tier already held them).
  uint64_t swappedOutBlocks = 0;

  // Gauges: occupancy when metrics() was called.
  ResourceDemand freeResources;
  /// Slots held only by cached records (no lease): what evicting every record would free.
  ResourceDemand reclaimableResources;
  ResourceDemand capacities;
  int64_t records = 0;
  int64_t indexedBlocks = 0;
  int64_t liveLeases = 0;
  int64_t hostTierCapacityPages = 0;  ///< pages of the host tier (0: none)
  int64_t hostTierBlocks = 0;         ///< blocks it holds

  uint64_t& missCount(MissReason reason) noexcept {
    return misses[static_cast<std::size_t>(reason)];
  }
  uint64_t missCount(MissReason reason) const noexcept {
    return misses[static_cast<std::size_t>(reason)];
  }
  uint64_t& reclaimed(ResourceType type) noexcept {
    return reclaimedResources[static_cast<std::size_t>(type)];
  }
  uint64_t reclaimed(ResourceType type) const noexcept {
    return reclaimedResources[static_cast<std::size_t>(type)];
  }
  /// Slots of `type` held by leases (running or quarantined requests): capacity - free -
  /// reclaimable.
  int32_t leased(ResourceType type) const noexcept {
    return capacities[type] - freeResources[type] - reclaimableResources[type];
  }
  /// The base pool's leased share, leased / capacity in [0, 1]: what vLLM exports as
  /// kv_cache_usage_perc (cached pages nobody runs on count as free, as in vLLM). 0 without pages.
  double baseUsage() const noexcept {
    int32_t const total = capacities[ResourceType::kBaseKvPage];
    return total > 0 ? static_cast<double>(leased(ResourceType::kBaseKvPage)) / total : 0.0;
  }
};

/// Prometheus text exposition (format 0.0.4) of every counter and gauge: one `# HELP` and one
/// `# TYPE` line per metric, counters named `<prefix>..._total`, misses as one counter with a
/// `reason` label, reclaimed resources and pool occupancy with a `type` label. The token-counted
/// prefix-cache pair dashboards built for vLLM read comes first under vLLM's names:
/// `<prefix>prefix_cache_queries_total` (queriedTokens) and `<prefix>prefix_cache_hits_total`
/// (reusedTokens: bypasses reuse nothing); with prefix "vllm:" they are vLLM's own series. `prefix`
/// must be a valid metric-name prefix ([a-zA-Z_:][a-zA-Z0-9_:]*, may be empty); throws otherwise.
std::string toPrometheus(ContextCacheMetrics const& metrics,
                         std::string_view prefix = "managedkv_");

}  // namespace mkv
