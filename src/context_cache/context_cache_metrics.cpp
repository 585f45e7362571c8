#include "mkv/context_cache/context_cache_metrics.h"

#include <algorithm>
#include <iterator>

#include "core/check.h"

namespace mkv {

namespace {

bool isNameChar(char c, bool first) noexcept {
  bool const alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
  return alpha || (!first && c >= '0' && c <= '9');
}

class Writer {
 public:
  explicit Writer(std::string_view prefix) : mPrefix(prefix) {}

  void header(std::string_view name, std::string_view type, std::string_view help) {
    fmt::format_to(std::back_inserter(mOut), "# HELP {}{} {}\n# TYPE {}{} {}\n", mPrefix, name,
                   help, mPrefix, name, type);
  }
  template <typename T>
  void sample(std::string_view name, T value) {
    fmt::format_to(std::back_inserter(mOut), "{}{} {}\n", mPrefix, name, value);
  }
  template <typename T>
  void sample(std::string_view name, std::string_view label, std::string_view labelValue, T value) {
    fmt::format_to(std::back_inserter(mOut), "{}{}{{{}=\"{}\"}} {}\n", mPrefix, name, label,
                   labelValue, value);
  }
  void counter(std::string_view name, std::string_view help, uint64_t value) {
    header(name, "counter", help);
    sample(name, value);
  }
  void gauge(std::string_view name, std::string_view help, int64_t value) {
    header(name, "gauge", help);
    sample(name, value);
  }
  template <typename Fn>
  void perType(std::string_view name, std::string_view type, std::string_view help, Fn&& value) {
    header(name, type, help);
    for (ResourceType t : kAllResourceTypes) {
      sample(name, "type", toString(t), value(t));
    }
  }
  std::string take() { return std::move(mOut); }

 private:
  std::string_view mPrefix;
  std::string mOut;
};

}  // namespace

std::string toPrometheus(ContextCacheMetrics const& m, std::string_view prefix) {
  bool valid = true;
  for (std::size_t i = 0; i < prefix.size(); ++i) {
    valid = valid && isNameChar(prefix[i], i == 0);
  }
  MKV_REQUIRE(valid, "toPrometheus", "invalid metric name prefix '{}'", prefix);

  Writer w(prefix);
  w.counter("admitted_sequences_total", "Sequences admitted with a context-cache lease.",
            m.admittedSequences);
  w.counter("lookups_total", "Context-cache lookups (admissions not on bypass).", m.lookups);
  w.counter("hits_total", "Admitted lookups that matched at least one cached token.", m.hits);
  w.counter("matched_tokens_total", "Prompt tokens found in the cache, before rewind or replay.",
            m.matchedTokens);
  w.counter("reused_tokens_total", "Prompt tokens whose computation the cache skipped.",
            m.reusedTokens);
  w.counter("bypasses_total", "Admissions on lookup bypass.", m.bypasses);
  w.counter("forced_cold_retries_total",
            "Cache-derived admissions that failed for capacity and were retried cold.",
            m.forcedColdRetries);
  w.counter("full_input_rewinds_total",
            "Admissions whose whole page-aligned input matched and whose last page is recomputed.",
            m.fullInputRewinds);
  w.counter("spec_full_page_replays_total", "Speculative admissions replaying a full page.",
            m.specFullPageReplays);
  w.counter("failed_acquisitions_total", "Admissions refused for insufficient capacity.",
            m.failedAcquisitions);
  w.header("misses_total", "counter", "Lookups that did not reuse all their full blocks.");
  for (int32_t r = 0; r < kMissReasonCount; ++r) {
    auto const reason = static_cast<MissReason>(r);
    w.sample("misses_total", "reason", toString(reason), m.missCount(reason));
  }
  w.counter("published_records_total", "New records published.", m.publishedRecords);
  w.counter("existing_records_touched_total",
            "Publications of an already published prefix (first producer kept).",
            m.existingRecordsTouched);
  w.counter("spec_upgrades_total", "Speculative state attached to an existing base-only record.",
            m.specUpgrades);
  w.counter("rejected_publications_total",
            "Publications refused because token verification rejected their first block.",
            m.rejectedPublications);
  w.counter("evicted_records_total", "Records evicted (capacity pressure or record limit).",
            m.evictedRecords);
  w.perType("reclaimed_resources_total", "counter",
            "Resources returned to a free list by eviction.",
            [&m](ResourceType t) { return m.reclaimed(t); });
  w.counter("verification_rejects_total",
            "Digest hits refused by token verification (digest collisions).",
            m.verificationRejects);
  w.counter("dropped_events_total", "KV events overwritten in the full event queue.",
            m.droppedEvents);
  w.perType("pool_free", "gauge", "Free slots per resource pool.",
            [&m](ResourceType t) { return m.freeResources[t]; });
  w.perType("pool_capacity", "gauge", "Capacity per resource pool.",
            [&m](ResourceType t) { return m.capacities[t]; });
  w.gauge("records", "Published records currently stored.", m.records);
  w.gauge("indexed_blocks", "Blocks currently reusable through the block index.", m.indexedBlocks);
  w.gauge("live_leases", "Request leases currently held.", m.liveLeases);
  return w.take();
}

}  // namespace mkv
