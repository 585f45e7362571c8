/// mkv-replay --tensor-parallel: every rank replays the trace in its own thread and runtime with
/// its share of the heads; the figures equal one rank's (bytes divided by the ranks), every rank's
/// oracle checks its own pools, and a rank that decides otherwise is named.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "multi_turn_workload.h"
#include "replay_report.h"
#include "replay_runner.h"
#include "support/test_inputs.h"
#include "support/test_util.h"
#include "trace.h"

namespace mkv::replay {
namespace {

/// `config` replayed on the first `limit` Mooncake requests by one rank and by `ranks` ranks.
struct OneAndMany {
  ReplayResult one;
  ReplayResult many;
};

OneAndMany replayBoth(std::string const& path, ReplayConfig config, int32_t ranks) {
  auto const load = [&] {
    return TraceSource(loadTrace(path, TraceFormat::kAuto, config.limit), path);
  };
  TraceSource single = load();
  OneAndMany both;
  both.one = runReplay(single, config);
  std::vector<TraceSource> copies;
  copies.reserve(static_cast<std::size_t>(ranks));
  std::vector<RequestSource*> sources;
  for (int32_t rank = 0; rank < ranks; ++rank) {
    copies.push_back(load());
    sources.push_back(&copies.back());
  }
  config.tensorParallel = ranks;
  both.many = runTensorParallelReplay(sources, config);
  return both;
}

void expectTheSameReplay(ReplayResult const& one, ReplayResult const& many, int32_t ranks) {
  ReplayResult::TensorParallel const& tp = many.tensorParallel;
  EXPECT_EQ(tp.size, ranks);
  EXPECT_TRUE(tp.ranksIdentical) << tp.firstDifference;
  EXPECT_GT(tp.agreements, 0);
  EXPECT_EQ(tp.divergences, 0);
  EXPECT_EQ(tp.oracleMismatchesAllRanks, 0);
  EXPECT_EQ(tp.oracleChecksAllRanks, ranks * one.oracleChecks);
  EXPECT_EQ(many.oracleMismatches, 0) << many.firstMismatch;
  EXPECT_EQ(one.oracleMismatches, 0) << one.firstMismatch;
  EXPECT_GT(one.oracleChecks, 0);
  EXPECT_EQ(many.reusedTokens, one.reusedTokens);
  EXPECT_EQ(many.prefillTokensComputed, one.prefillTokensComputed);
  EXPECT_EQ(many.generatedTokens, one.generatedTokens);
  EXPECT_EQ(many.evictedRecords, one.evictedRecords);
  EXPECT_EQ(many.preemptions, one.preemptions);
  EXPECT_EQ(many.chunkedPrefills, one.chunkedPrefills);
  EXPECT_EQ(many.oracleChecks, one.oracleChecks);
  EXPECT_EQ(many.poolPages, one.poolPages);
  EXPECT_EQ(many.kvBytes * ranks, one.kvBytes);
  // Everything else, but the bytes and the timings, through the report: a request's figures too.
  ReplayResult sameBytes = many;
  sameBytes.kvBytes = one.kvBytes;
  sameBytes.peakKvBytes = one.peakKvBytes;
  sameBytes.bytesPerPage = one.bytesPerPage;
  sameBytes.draftBytesPerPage = one.draftBytesPerPage;
  sameBytes.pools = one.pools;
  sameBytes.hybrid.snapshotBytes = one.hybrid.snapshotBytes;
  EXPECT_EQ(firstDifference(one, sameBytes), "");
}

TEST(TensorParallelReplayTest, RanksReplayMooncakeUnderPressureAsOneRankDoes) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  ReplayConfig config;
  config.kvHeads = 4;
  config.maxBatch = 16;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 150'000;
  config.maxBatchedTokens = 2048;
  config.preemption = testing::PreemptionMode::kRecompute;
  OneAndMany const both = replayBoth(kMooncake500.string(), config, 4);
  // Engagement: the pool evicts and preempts, prompts are chunked, prefixes are reused.
  EXPECT_GT(both.one.evictedRecords, 0);
  EXPECT_GT(both.one.preemptions, 0);
  EXPECT_GT(both.one.chunkedPrefills, 0);
  EXPECT_GT(both.one.reusedTokens, 0);
  expectTheSameReplay(both.one, both.many, 4);
}

TEST(TensorParallelReplayTest, HybridRanksKeepTheSameReusePointsAsOneRank) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  ReplayConfig config;
  config.kvHeads = 2;
  config.maxBatch = 8;
  config.recurrentLayers = 4;
  config.checkpointInterval = 512;
  config.snapshotSlots = 64;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 200'000;
  config.limit = 150;
  OneAndMany const both = replayBoth(kMooncake500.string(), config, 2);
  EXPECT_GT(both.one.hybrid.checkpointsRestored, 0);
  EXPECT_GT(both.one.hybrid.snapshotPressureSkips, 0) << "the snapshot budget never pressed";
  EXPECT_EQ(both.many.hybrid.recurrentSnapshotSlots, both.one.hybrid.recurrentSnapshotSlots);
  expectTheSameReplay(both.one, both.many, 2);
}

TEST(TensorParallelReplayTest, TheFirstDifferingFigureIsNamed) {
  ReplayResult reference;
  reference.requests = 2;
  reference.records.resize(2);
  reference.records[1].reusedTokens = 128;
  EXPECT_EQ(firstDifference(reference, reference), "");
  ReplayResult other = reference;
  other.reusedTokens = 5;
  EXPECT_NE(firstDifference(reference, other).find("reused_tokens"), std::string::npos);
  other = reference;
  other.records[1].reusedTokens = 256;
  EXPECT_NE(firstDifference(reference, other).find("request row 1"), std::string::npos)
      << firstDifference(reference, other);
  other = reference;
  other.wallSeconds = 3.0;  // timings are not decisions
  other.hostNsPerStepP50 = 7;
  EXPECT_EQ(firstDifference(reference, other), "");
}

TEST(TensorParallelReplayTest, ConfigurationsRanksCannotShareAreRefused) {
  MultiTurnWorkloadConfig workload;
  ReplayConfig config;
  config.tensorParallel = 2;  // one KV head cannot be split over two ranks
  auto refusal = [&](ReplayConfig const& c, std::size_t sources) {
    std::vector<MultiTurnWorkload> copies(sources, MultiTurnWorkload(workload));
    std::vector<RequestSource*> pointers;
    pointers.reserve(copies.size());
    for (MultiTurnWorkload& copy : copies) {
      pointers.push_back(&copy);
    }
    try {
      runTensorParallelReplay(pointers, c);
    } catch (ReplayConfigError const& error) {
      return std::string(error.what());
    }
    return std::string("not refused");
  };
  EXPECT_NE(refusal(config, 2).find("--kv-head-layout replicated"), std::string::npos);
  EXPECT_NE(refusal(config, 3).find("one workload per rank"), std::string::npos);
  config.kvHeadLayout = KvHeadLayout::kReplicated;
  config.remoteTier = "file:///nowhere";
  EXPECT_NE(refusal(config, 2).find("remote tier"), std::string::npos);
  config.remoteTier.clear();
  config.limit = 4;
  std::vector<MultiTurnWorkload> copies(2, MultiTurnWorkload(workload));
  ReplayResult const replicated = runTensorParallelReplay({copies.data(), &copies[1]}, config);
  EXPECT_TRUE(replicated.tensorParallel.ranksIdentical)
      << replicated.tensorParallel.firstDifference;
  EXPECT_EQ(replicated.oracleMismatches, 0);
}

}  // namespace
}  // namespace mkv::replay
