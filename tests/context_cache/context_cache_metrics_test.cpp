#include "mkv/context_cache/context_cache_metrics.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/error.h"
#include "support/prometheus_text_parser.h"

namespace mkv {
namespace {

using test::parsePrometheusText;
using test::PrometheusParse;
using test::PrometheusText;

/// The exposition parsed by the strict grammar parser; fails the test on any violation.
PrometheusText parse(std::string const& text) {
  PrometheusParse parsed = parsePrometheusText(text);
  EXPECT_TRUE(parsed.text.has_value()) << parsed.error << "\n" << text;
  return parsed.text.value_or(PrometheusText{});
}

bool rejects(std::string_view text, std::string_view reason) {
  PrometheusParse const parsed = parsePrometheusText(text);
  return !parsed.text && parsed.error.find(reason) != std::string::npos;
}

TEST(PrometheusTextParserTest, AcceptsTheGrammarAndRejectsEachViolation) {
  // What the format allows beyond what the library emits: plain comments, untyped families,
  // several labels with a trailing comma, escapes, special values, timestamps, histograms.
  PrometheusParse const ok = parsePrometheusText(
      "# a comment\n"
      "# HELP a_total Help with \\\\ and \\n escapes.\n"
      "# TYPE a_total counter\n"
      "a_total{x=\"1\",y=\"q\\\"\\\\\\n\",} 1.5e3 1700000000000\n"
      "b NaN\n"
      "# TYPE h histogram\n"
      "h_bucket{le=\"+Inf\"} 2\n"
      "h_sum -Inf\n"
      "h_count 2\n");
  ASSERT_TRUE(ok.text.has_value()) << ok.error;
  EXPECT_EQ(ok.text->families.at("a_total").help, "Help with \\ and \n escapes.");
  EXPECT_EQ(ok.text->families.at("b").type, "untyped");
  EXPECT_EQ(ok.text->samples.at("a_total{x=\"1\",y=\"q\"\\\n\"}"), 1500.0);
  EXPECT_EQ(ok.text->samples.count("h_sum"), 1U);
  EXPECT_EQ(ok.text->familyOrder, (std::vector<std::string>{"a_total", "b", "h"}));

  EXPECT_TRUE(rejects("a 1", "newline"));
  EXPECT_TRUE(rejects("a 1\n\nb 2\n", "line 2: empty line"));
  EXPECT_TRUE(rejects("9a 1\n", "metric name"));
  EXPECT_TRUE(rejects("a-b 1\n", "blank must separate"));
  EXPECT_TRUE(rejects("a one\n", "invalid value"));
  EXPECT_TRUE(rejects("a 1.2.3\n", "invalid value"));
  EXPECT_TRUE(rejects("a 1 12x\n", "invalid timestamp"));
  EXPECT_TRUE(rejects("a 1 2 3\n", "trailing"));
  EXPECT_TRUE(rejects("a{x=1} 1\n", "=\"value\""));
  EXPECT_TRUE(rejects("a{__x=\"1\"} 1\n", "invalid label name"));
  EXPECT_TRUE(rejects("a{x=\"1\",x=\"2\"} 1\n", "repeated"));
  EXPECT_TRUE(rejects("a{x=\"\\t\"} 1\n", "invalid escape"));
  EXPECT_TRUE(rejects("a{x=\"1\" y=\"2\"} 1\n", "separated"));
  EXPECT_TRUE(rejects("a{x=\"1} 1\n", "unterminated"));
  EXPECT_TRUE(rejects("# HELP a x\n# HELP a y\n", "second HELP"));
  EXPECT_TRUE(rejects("# TYPE a counter\n# TYPE a gauge\n", "second TYPE"));
  EXPECT_TRUE(rejects("# TYPE a kounter\n", "invalid TYPE"));
  EXPECT_TRUE(rejects("a 1\n# TYPE a gauge\n", "after its samples"));
  EXPECT_TRUE(rejects("# HELP a bad \\q escape\n", "invalid escape"));
  EXPECT_TRUE(rejects("a 1\nb 1\na{x=\"y\"} 2\n", "continues after other families"));
  EXPECT_TRUE(rejects("a 1\na 2\n", "repeated"));
}

TEST(ContextCacheMetricsTest, PrometheusExpositionParsesAndCarriesEveryCounter) {
  ContextCacheMetrics m;
  m.admittedSequences = 7;
  m.reusedTokens = 1024;
  m.missCount(MissReason::kSaltMismatch) = 2;
  m.reclaimed(ResourceType::kDraftKvPage) = 5;
  m.freeResources = {10, 3, 0, 1};
  m.capacities = {16, 4, 2, 2};
  m.records = 9;
  m.droppedEvents = 4;
  m.queriedTokens = 2048;
  m.prefixCacheResets = 3;
  m.resetRecords = 11;
  m.replacedChunkRecords = 5;
  m.swappedOutBlocks = 7;
  m.offloadedPages = 12;
  m.onboardedBytes = 4096;
  m.hostTierHitTokens = 256;
  m.hostTierCapacityPages = 64;
  m.windowLimitedTokens = 48;
  m.missCount(MissReason::kWindowEvicted) = 6;
  std::string const text = toPrometheus(m);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  PrometheusText const e = parse(text);

  EXPECT_EQ(e.samples.at("managedkv_admitted_sequences_total"), 7);
  EXPECT_EQ(e.samples.at("managedkv_reused_tokens_total"), 1024);
  EXPECT_EQ(e.samples.at("managedkv_misses_total{reason=\"salt_mismatch\"}"), 2);
  EXPECT_EQ(e.samples.at("managedkv_misses_total{reason=\"capacity\"}"), 0);
  EXPECT_EQ(e.samples.at("managedkv_reclaimed_resources_total{type=\"draft_kv_page\"}"), 5);
  EXPECT_EQ(e.samples.at("managedkv_pool_free{type=\"base_kv_page\"}"), 10);
  EXPECT_EQ(e.samples.at("managedkv_pool_capacity{type=\"partial_kv_snapshot\"}"), 2);
  EXPECT_EQ(e.samples.at("managedkv_records"), 9);
  EXPECT_EQ(e.samples.at("managedkv_dropped_events_total"), 4);
  EXPECT_EQ(e.samples.at("managedkv_prefix_cache_queries_total"), 2048);
  EXPECT_EQ(e.samples.at("managedkv_prefix_cache_hits_total"), 1024);
  EXPECT_EQ(e.samples.at("managedkv_prefix_cache_resets_total"), 3);
  EXPECT_EQ(e.samples.at("managedkv_reset_records_total"), 11);
  EXPECT_EQ(e.samples.at("managedkv_replaced_chunk_records_total"), 5);
  EXPECT_EQ(e.samples.at("managedkv_host_tier_offloaded_pages_total"), 12);
  EXPECT_EQ(e.samples.at("managedkv_host_tier_swapped_out_blocks_total"), 7);
  EXPECT_EQ(e.samples.at("managedkv_host_tier_onboarded_bytes_total"), 4096);
  EXPECT_EQ(e.samples.at("managedkv_host_tier_hit_tokens_total"), 256);
  EXPECT_EQ(e.samples.at("managedkv_host_tier_capacity_pages"), 64);
  EXPECT_EQ(e.samples.at("managedkv_host_tier_blocks"), 0);
  EXPECT_EQ(e.samples.at("managedkv_window_limited_tokens_total"), 48);
  EXPECT_EQ(e.samples.at("managedkv_misses_total{reason=\"window_evicted\"}"), 6);

  int misses = 0;
  for (auto const& [name, value] : e.samples) {
    misses += name.rfind("managedkv_misses_total{", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(misses, kMissReasonCount) << "one sample per reason";
  for (auto const& [name, family] : e.families) {
    EXPECT_FALSE(family.help.empty()) << name << " has a HELP line";
    EXPECT_NE(family.type, "untyped") << name << " has a TYPE line";
    bool const total = name.size() > 6 && name.compare(name.size() - 6, 6, "_total") == 0;
    EXPECT_EQ(family.type == "counter", total) << name << ": counters and only they end in _total";
  }
  // Every counter of the struct appears: 22 scalar counters (windowLimitedTokens,
  // evictedReusePoints and replacedChunkRecords among them) + misses + reclaimed, vLLM's
  // token-counted pair (queriedTokens, reusedTokens) under vLLM's names, and the host tier's 9.
  std::set<std::string> counters;
  for (auto const& [name, family] : e.families) {
    if (family.type == "counter") {
      counters.insert(name);
    }
  }
  EXPECT_EQ(counters.size(), 34U);
}

TEST(ContextCacheMetricsTest, PrefixCacheQueriesAndHitsAreCountedInTokens) {
  ContextCacheMetrics m;
  m.lookups = 3;
  m.hits = 1;
  m.queriedTokens = 4096;
  m.reusedTokens = 1024;
  PrometheusText const e = parse(toPrometheus(m, "vllm:"));
  EXPECT_EQ(e.samples.at("vllm:prefix_cache_queries_total"), 4096);
  EXPECT_EQ(e.samples.at("vllm:prefix_cache_hits_total"), 1024);
  EXPECT_EQ(e.families.at("vllm:prefix_cache_queries_total").type, "counter");
  EXPECT_EQ(e.samples.at("vllm:lookups_total"), 3) << "our own lookup count stays beside them";
}

TEST(ContextCacheMetricsTest, PrefixIsAppliedAndValidated) {
  std::string const text = toPrometheus(ContextCacheMetrics{}, "engine_kv_");
  EXPECT_NE(text.find("# TYPE engine_kv_hits_total counter\n"), std::string::npos);
  EXPECT_EQ(text.find("managedkv_"), std::string::npos);
  EXPECT_NO_THROW(toPrometheus(ContextCacheMetrics{}, ""));
  EXPECT_THROW(toPrometheus(ContextCacheMetrics{}, "9bad"), Error);
  EXPECT_THROW(toPrometheus(ContextCacheMetrics{}, "bad-prefix"), Error);
}

}  // namespace
}  // namespace mkv
