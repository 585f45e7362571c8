#include "mkv/context_cache/context_cache_metrics.h"

#include "core/prometheus_text.h"

namespace mkv {

namespace {

template <typename Fn>
void perType(detail::PrometheusWriter& w, std::string_view name, std::string_view type,
             std::string_view help, Fn&& value) {
  w.header(name, type, help);
  for (ResourceType t : kAllResourceTypes) {
    w.sample(name, "type", toString(t), value(t));
  }
}

/// The admission counters: lookups, hits, reused tokens, bypasses, rewinds, refusals.
void writeAdmissionCounters(detail::PrometheusWriter& w, ContextCacheMetrics const& m) {
  w.counter("prefix_cache_queries_total",
            "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
            m.queriedTokens);
  w.counter("prefix_cache_hits_total",
            "Prompt tokens the prefix cache supplied (vLLM's prefix_cache_hits).", m.reusedTokens);
  w.counter("admitted_sequences_total", "Sequences admitted with a context-cache lease.",
            m.admittedSequences);
  w.counter("lookups_total", "Context-cache lookups (admissions not on bypass).", m.lookups);
  w.counter("hits_total", "Admitted lookups that matched at least one cached token.", m.hits);
  w.counter("matched_tokens_total", "Prompt tokens found in the cache, before rewind or replay.",
            m.matchedTokens);
  w.counter("reused_tokens_total", "Prompt tokens whose computation the cache skipped.",
            m.reusedTokens);
  w.counter("bypasses_total", "Admissions on lookup bypass.", m.bypasses);
  w.counter("full_input_rewinds_total",
            "Admissions whose whole page-aligned input matched and whose last page is recomputed.",
            m.fullInputRewinds);
  w.counter("spec_full_page_replays_total", "Speculative admissions replaying a full page.",
            m.specFullPageReplays);
  w.counter("failed_acquisitions_total", "Admissions refused for insufficient capacity.",
            m.failedAcquisitions);
  w.counter("window_limited_tokens_total",
            "Prompt tokens the full layers could reuse that the window rule took away (the "
            "sliding layers' window was no longer cached).",
            m.windowLimitedTokens);
}

/// misses_total, one sample per MissReason in enum order.
void writeMisses(detail::PrometheusWriter& w, ContextCacheMetrics const& m) {
  w.header("misses_total", "counter", "Lookups that did not reuse all their full blocks.");
  for (int32_t r = 0; r < kMissReasonCount; ++r) {
    auto const reason = static_cast<MissReason>(r);
    w.sample("misses_total", "reason", toString(reason), m.missCount(reason));
  }
}

/// The record counters: publications, evictions, resets, reclaimed resources, rejects, events.
void writeRecordCounters(detail::PrometheusWriter& w, ContextCacheMetrics const& m) {
  w.counter("published_records_total", "New records published.", m.publishedRecords);
  w.counter("existing_records_touched_total",
            "Publications of an already published prefix (first producer kept).",
            m.existingRecordsTouched);
  w.counter("spec_upgrades_total", "Speculative state attached to an existing base-only record.",
            m.specUpgrades);
  w.counter("rejected_publications_total",
            "Publications refused because token verification rejected their first block.",
            m.rejectedPublications);
  w.counter("replaced_chunk_records_total",
            "Records of prefill chunks replaced by the same sequence's next publication.",
            m.replacedChunkRecords);
  w.counter("evicted_records_total", "Records evicted (capacity pressure or record limit).",
            m.evictedRecords);
  w.counter("evicted_reuse_points_total",
            "Of the evicted records, checkpoints kept at reuse points inside a prompt.",
            m.evictedReusePoints);
  w.counter("prefix_cache_resets_total", "Prefix cache resets (every record dropped at once).",
            m.prefixCacheResets);
  w.counter("reset_records_total", "Records dropped by prefix cache resets.", m.resetRecords);
  perType(w, "reclaimed_resources_total", "counter",
          "Resources returned to a free list by eviction or reset.",
          [&m](ResourceType t) { return m.reclaimed(t); });
  w.counter("verification_rejects_total",
            "Digest hits refused by token verification (digest collisions).",
            m.verificationRejects);
  w.counter("dropped_events_total", "KV events overwritten in the full event queue.",
            m.droppedEvents);
}

/// The host tier's counters: pages and bytes moved each way, hits, drops.
void writeHostTierCounters(detail::PrometheusWriter& w, ContextCacheMetrics const& m) {
  w.counter("host_tier_offloaded_pages_total", "Evicted GPU pages copied to the host tier.",
            m.offloadedPages);
  w.counter("host_tier_onboarded_pages_total", "Host tier pages copied back into GPU pages.",
            m.onboardedPages);
  w.counter("host_tier_offloaded_bytes_total", "Bytes copied from the GPU to the host tier.",
            m.offloadedBytes);
  w.counter("host_tier_onboarded_bytes_total", "Bytes copied from the host tier to the GPU.",
            m.onboardedBytes);
  w.counter("host_tier_hit_tokens_total",
            "Reused prompt tokens that came from the host tier (part of reused_tokens_total).",
            m.hostTierHitTokens);
  w.counter("host_tier_dropped_pages_total", "Blocks the full host tier dropped for good.",
            m.hostTierDroppedPages);
  w.counter("host_tier_offload_failures_total",
            "Evicted blocks the host tier could not keep (allocation failure).",
            m.hostTierOffloadFailures);
  w.counter("host_tier_reset_pages_total", "Host tier blocks dropped by prefix cache resets.",
            m.hostTierResetPages);
  w.counter(
      "host_tier_swapped_out_blocks_total",
      "Blocks of swap-preempted rows moved from the GPU to the host tier at their compaction.",
      m.swappedOutBlocks);
}

/// The gauges: per-pool free slots and capacity, records, indexed blocks, live leases.
void writeGauges(detail::PrometheusWriter& w, ContextCacheMetrics const& m) {
  perType(w, "pool_free", "gauge", "Free slots per resource pool.",
          [&m](ResourceType t) { return m.freeResources[t]; });
  perType(w, "pool_capacity", "gauge", "Capacity per resource pool.",
          [&m](ResourceType t) { return m.capacities[t]; });
  perType(w, "pool_reclaimable", "gauge",
          "Slots per resource pool held only by cached records: what eviction frees.",
          [&m](ResourceType t) { return m.reclaimableResources[t]; });
  perType(w, "pool_leased", "gauge",
          "Slots per resource pool held by leases (capacity - free - reclaimable).",
          [&m](ResourceType t) { return m.leased(t); });
  w.gauge("kv_usage_ratio",
          "Share of base KV pages held by running requests (leased / capacity, in [0, 1]).",
          m.baseUsage());
  w.gauge("kv_cache_usage_perc",
          "vLLM's name for kv_usage_ratio: the same fraction in [0, 1] (cached pages nobody runs "
          "on count as free).",
          m.baseUsage());
  w.gauge("records", "Published records currently stored.", m.records);
  w.gauge("indexed_blocks", "Blocks currently reusable through the block index.", m.indexedBlocks);
  w.gauge("live_leases", "Request leases currently held.", m.liveLeases);
  w.gauge("host_tier_capacity_pages", "Pages of the host tier (0: none).", m.hostTierCapacityPages);
  w.gauge("host_tier_blocks", "Blocks the host tier holds.", m.hostTierBlocks);
}

}  // namespace

std::string toPrometheus(ContextCacheMetrics const& m, std::string_view prefix) {
  detail::PrometheusWriter w("toPrometheus", prefix);
  writeAdmissionCounters(w, m);
  writeMisses(w, m);
  writeRecordCounters(w, m);
  writeHostTierCounters(w, m);
  writeGauges(w, m);
  return w.take();
}

}  // namespace mkv
