#include "mkv/context_cache/context_cache_metrics.h"

#include <gtest/gtest.h>

#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "mkv/error.h"

namespace mkv {
namespace {

struct Exposition {
  std::map<std::string, std::string> help;
  std::map<std::string, std::string> type;
  std::map<std::string, double> samples;  ///< "name{labels}" -> value
};

/// A strict reader of the text format subset toPrometheus emits: every line is HELP, TYPE or a
/// sample; each sample's metric has HELP and TYPE lines before it.
Exposition parse(std::string const& text) {
  static std::regex const helpLine(R"(^# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.+)$)");
  static std::regex const typeLine(R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge)$)");
  static std::regex const sampleLine(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-z_]+="[a-z_]+"\})? (-?[0-9]+)$)");
  Exposition out;
  std::istringstream lines(text);
  std::string line;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_match(line, m, helpLine)) {
      EXPECT_TRUE(out.help.emplace(m[1], m[2]).second) << "duplicate HELP " << line;
    } else if (std::regex_match(line, m, typeLine)) {
      EXPECT_TRUE(out.help.count(m[1])) << "TYPE before HELP: " << line;
      EXPECT_TRUE(out.type.emplace(m[1], m[2]).second) << "duplicate TYPE " << line;
    } else if (std::regex_match(line, m, sampleLine)) {
      EXPECT_TRUE(out.type.count(m[1])) << "sample without TYPE: " << line;
      EXPECT_TRUE(
          out.samples.emplace(std::string(m[1]) + std::string(m[2]), std::stod(m[3])).second)
          << "duplicate sample " << line;
    } else {
      ADD_FAILURE() << "unparsable line: '" << line << "'";
    }
  }
  return out;
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
  std::string const text = toPrometheus(m);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  Exposition const e = parse(text);

  EXPECT_EQ(e.samples.at("managedkv_admitted_sequences_total"), 7);
  EXPECT_EQ(e.samples.at("managedkv_reused_tokens_total"), 1024);
  EXPECT_EQ(e.samples.at("managedkv_misses_total{reason=\"salt_mismatch\"}"), 2);
  EXPECT_EQ(e.samples.at("managedkv_misses_total{reason=\"capacity\"}"), 0);
  EXPECT_EQ(e.samples.at("managedkv_reclaimed_resources_total{type=\"draft_kv_page\"}"), 5);
  EXPECT_EQ(e.samples.at("managedkv_pool_free{type=\"base_kv_page\"}"), 10);
  EXPECT_EQ(e.samples.at("managedkv_pool_capacity{type=\"partial_kv_snapshot\"}"), 2);
  EXPECT_EQ(e.samples.at("managedkv_records"), 9);
  EXPECT_EQ(e.samples.at("managedkv_dropped_events_total"), 4);

  int misses = 0;
  for (auto const& [name, value] : e.samples) {
    misses += name.rfind("managedkv_misses_total{", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(misses, kMissReasonCount) << "one sample per reason";
  for (auto const& [name, type] : e.type) {
    bool const total = name.size() > 6 && name.compare(name.size() - 6, 6, "_total") == 0;
    EXPECT_EQ(type == "counter", total) << name << " counters and only counters end in _total";
  }
  // Every counter of the struct appears: 17 scalar counters + misses + reclaimed.
  std::set<std::string> counters;
  for (auto const& [name, type] : e.type) {
    if (type == "counter") {
      counters.insert(name);
    }
  }
  EXPECT_EQ(counters.size(), 19U);
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
