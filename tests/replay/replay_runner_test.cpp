// The replay runner end to end on CPU tensors: exact reuse figures computed independently of the
// library, the bounded-SWA budget, eviction under a bounded pool, failed and retried requests,
// in-flight joins, salts, and the report writers.
#include "replay_runner.h"

#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/host_kv_tier.h"
#include "multi_turn_workload.h"
#include "replay_report.h"
#include "support/test_inputs.h"
#include "support/test_util.h"
#include "trace.h"

namespace mkv::replay {
namespace {

/// Forwards to a source and remembers every request's prompt and sampled tokens.
class RecordingSource final : public RequestSource {
 public:
  explicit RecordingSource(RequestSource& inner)
      : prompts(inner.size()), generated(inner.size()), mInner(inner) {}
  std::size_t size() const override { return mInner.size(); }
  std::string describe() const override { return mInner.describe(); }
  bool ready(std::size_t index) const override { return mInner.ready(index); }
  ReplayRequest materialize(std::size_t index) override {
    ReplayRequest request = mInner.materialize(index);
    prompts[index] = request.prompt;
    return request;
  }
  void finished(std::size_t index, std::span<int32_t const> tokens) override {
    generated[index].assign(tokens.begin(), tokens.end());
    order.push_back(index);
    mInner.finished(index, tokens);
  }
  int64_t longestSequenceTokens(int32_t cap) const override {
    return mInner.longestSequenceTokens(cap);
  }
  int64_t cachedPagesBound(int32_t pageSize, int32_t cap) const override {
    return mInner.cachedPagesBound(pageSize, cap);
  }

  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> generated;
  std::vector<std::size_t> order;  ///< completion order

 private:
  RequestSource& mInner;
};

/// The set of published page-aligned prefixes, as a trie of exact page contents (no hashing):
/// the independent model of vanilla reuse.
class PrefixPages {
 public:
  explicit PrefixPages(int32_t pageSize) : mPage(static_cast<std::size_t>(pageSize)) {}

  /// Leading full pages of `tokens` that are published.
  std::size_t matchedPages(std::vector<int32_t> const& tokens) const {
    int64_t node = 0;
    std::size_t pages = 0;
    for (std::size_t begin = 0; begin + mPage <= tokens.size(); begin += mPage, ++pages) {
      auto const it = mNodes.find(key(node, tokens, begin));
      if (it == mNodes.end()) {
        break;
      }
      node = it->second;
    }
    return pages;
  }
  /// Publishes the first `pages` full pages of `tokens`.
  void publish(std::vector<int32_t> const& tokens, std::size_t pages) {
    int64_t node = 0;
    for (std::size_t p = 0; p < pages; ++p) {
      auto const [it, inserted] =
          mNodes.emplace(key(node, tokens, p * mPage), static_cast<int64_t>(mNodes.size()) + 1);
      node = it->second;
    }
  }
  /// Vanilla planner: the longest published page-aligned prefix, but never the whole prompt
  /// (a fully matched page-aligned prompt recomputes its last page for the logits).
  int64_t expectedReuse(std::vector<int32_t> const& prompt) const {
    std::size_t const cap = (prompt.size() - 1) / mPage;
    return static_cast<int64_t>(std::min(matchedPages(prompt), cap) * mPage);
  }
  /// What a request that ran to completion publishes: its prompt's full pages at prefill, then
  /// the full pages of prompt + sampled tokens that have KV (all but the last) at decode end.
  void publishRequest(std::vector<int32_t> const& prompt, std::vector<int32_t> const& generated) {
    publish(prompt, prompt.size() / mPage);
    std::vector<int32_t> sequence = prompt;
    sequence.insert(sequence.end(), generated.begin(), generated.end());
    std::size_t const withKv = generated.empty() ? prompt.size() : sequence.size() - 1;
    publish(sequence, withKv / mPage);
  }

 private:
  using Key = std::pair<int64_t, std::vector<int32_t>>;
  Key key(int64_t parent, std::vector<int32_t> const& tokens, std::size_t begin) const {
    auto const first = tokens.begin() + static_cast<std::ptrdiff_t>(begin);
    return {parent, std::vector<int32_t>(first, first + static_cast<std::ptrdiff_t>(mPage))};
  }
  std::size_t mPage;
  std::map<Key, int64_t> mNodes;
};

TraceSource traceSource(std::filesystem::path const& path, std::size_t limit = 0) {
  return TraceSource(loadTrace(path.string(), TraceFormat::kAuto, limit), path.string());
}

int64_t missCount(ReplayResult const& result, MissReason reason) {
  return result.missesByReason[static_cast<std::size_t>(reason)];
}

TEST(ReplayRunnerTest, TinyTraceReusesExactlyTheHandComputedTokens) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  // Blocks of 512 tokens, pages of 128: request 1 [1, 2] (1024) reuses nothing; request 2
  // [1, 2, 3] (1500) reuses blocks 1 and 2 = 1024; request 3 [1, 9] (700) reuses block 1 = 512;
  // request 4 repeats request 1 (page-aligned, fully matched) and recomputes its last page: 896.
  TraceSource source = traceSource(kTiny);
  ReplayResult const result = runReplay(source, ReplayConfig{});
  ASSERT_EQ(result.records.size(), 4u);
  std::vector<int64_t> const reused = {0, 1024, 512, 896};
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(result.records[i].reusedTokens, reused[i]) << i;
    EXPECT_FALSE(result.records[i].failed);
    EXPECT_EQ(result.records[i].reason, FinishReason::kLength);
  }
  EXPECT_EQ(result.backend, KVCacheBackend::kContextReuse);
  EXPECT_EQ(result.requests, 4);
  EXPECT_EQ(result.promptTokens, 1024 + 1500 + 700 + 1024);
  EXPECT_EQ(result.reusedTokens, 2432);
  EXPECT_EQ(result.prefillTokensComputed, 4248 - 2432);
  EXPECT_DOUBLE_EQ(result.hitRate, 2432.0 / 4248.0);
  EXPECT_EQ(result.generatedTokens, 4 + 3 + 2 + 1);
  EXPECT_EQ(result.decodeSteps, 3 + 2 + 1 + 0);
  EXPECT_EQ(result.evictedRecords, 0);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.joins, 0);
  EXPECT_EQ(missCount(result, MissReason::kNoPrefix), 3);  // 1: nothing; 2 and 3: a new block
  EXPECT_GT(result.oracleChecks, 2432);                    // every reused position, and more
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_EQ(result.swaPagesPerSequencePrefill, 0);
  EXPECT_EQ(result.peakKvBytes, result.peakPagesInUse * result.bytesPerPage);
  EXPECT_EQ(result.bytesPerPage, 2 * 128 * 1 * 8 * 2);  // K+V x tokens x heads x dim x fp16
  EXPECT_GE(result.hostNsPerStepP99, result.hostNsPerStepP50);
  ASSERT_EQ(result.timeline.size(), 4u);
  EXPECT_DOUBLE_EQ(result.timeline.back().hitRate, 2432.0 / 4248.0);
  for (std::size_t i = 1; i < 4; ++i) {  // nothing is evicted: cached pages only grow
    EXPECT_GE(result.records[i].pagesInUseAfter, result.records[i - 1].pagesInUseAfter);
  }
  EXPECT_LE(result.peakPagesInUse, result.poolPages);
}

TEST(ReplayRunnerTest, ResetCacheEveryClearsTheCacheBetweenRuns) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  // As above, with the cache cleared after requests 2 and 4: request 3 [1, 9] finds nothing
  // (block 1 was cleared: an `evicted` miss) and request 4 [1, 2] only request 3's block 1
  // (block 2 was cleared: another `evicted` miss).
  TraceSource source = traceSource(kTiny);
  ReplayConfig config;
  config.resetCacheEvery = 2;
  ReplayResult const result = runReplay(source, config);
  ASSERT_EQ(result.records.size(), 4u);
  std::vector<int64_t> const reused = {0, 1024, 0, 512};
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(result.records[i].reusedTokens, reused[i]) << i;
  }
  EXPECT_EQ(result.cacheResets, 2);
  EXPECT_EQ(result.evictedRecords, 0) << "a reset is not an eviction";
  EXPECT_EQ(missCount(result, MissReason::kEvicted), 2);
  EXPECT_EQ(result.oracleMismatches, 0);
}

TEST(ReplayRunnerTest, MooncakeFirst500ReuseMatchesAnIndependentLongestPrefixModel) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  TraceSource trace = traceSource(kMooncake500);
  ASSERT_EQ(trace.size(), 500u);
  RecordingSource source(trace);
  ReplayConfig config;
  config.maxBatch = 1;
  ReplayResult const result = runReplay(source, config);
  ASSERT_EQ(result.failedRequests, 0);
  ASSERT_EQ(source.order.size(), 500u);
  PrefixPages published(config.pageSize);
  int64_t expectedTotal = 0;
  int64_t promptTotal = 0;
  for (std::size_t i = 0; i < 500; ++i) {
    ASSERT_EQ(source.order[i], i);  // one at a time, in trace order
    int64_t const expected = published.expectedReuse(source.prompts[i]);
    EXPECT_EQ(result.records[i].reusedTokens, expected) << "request " << i;
    expectedTotal += expected;
    promptTotal += static_cast<int64_t>(source.prompts[i].size());
    published.publishRequest(source.prompts[i], source.generated[i]);
  }
  EXPECT_EQ(result.reusedTokens, expectedTotal);
  EXPECT_EQ(result.promptTokens, promptTotal);
  EXPECT_GT(expectedTotal, promptTotal / 20);  // the sample trace does share prefixes
  EXPECT_EQ(result.evictedRecords, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_GT(result.oracleChecks, expectedTotal);
}

TEST(ReplayRunnerTest, FullModeReusesNothing) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayConfig config;
  config.mode = ReplayMode::kFull;
  ReplayResult const result = runReplay(source, config);
  EXPECT_EQ(result.backend, KVCacheBackend::kFullStorage);
  EXPECT_EQ(result.reusedTokens, 0);
  EXPECT_EQ(result.prefillTokensComputed, result.promptTokens);
  EXPECT_EQ(result.publishedRecords, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
  // Nothing is cached: one request's pages at a time.
  EXPECT_LE(result.peakPagesInUse, (1500 + 3 + 2 + 127) / 128);
}

TEST(ReplayRunnerTest, BoundedSwaServesJoinersAndChunksUnderATokenBudget) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // A serving engine on bounded SWA: sequences join the running batch and prefill in chunks
  // under a 512-token budget, each chunk reading the window the one before it kept (the oracle
  // samples those reads and every window after). Nothing is cached, so every figure but the
  // steps matches the static batches of the seed's loop, token for token.
  ReplayConfig config;
  config.mode = ReplayMode::kSwa;
  config.windowTokens = 1024;
  config.fullLayers = 1;
  config.maxBatch = 8;
  config.limit = 30;
  config.verify = testing::VerifyMode::kSample;
  TraceSource batchTrace = traceSource(kMooncake500);
  RecordingSource batches(batchTrace);
  ReplayResult const batched = runReplay(batches, config);
  ASSERT_EQ(batched.joins, 0);
  config.maxBatchedTokens = 512;
  TraceSource servedTrace = traceSource(kMooncake500);
  RecordingSource served(servedTrace);
  ReplayResult const result = runReplay(served, config);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_GT(result.oracleChecks, 0);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.retriedRequests, 0);
  EXPECT_EQ(result.joins, 29);
  EXPECT_EQ(result.heldFounders, 1) << "the founder's prefill step ran its first 512 tokens";
  EXPECT_EQ(batched.heldFounders, 0);
  EXPECT_GT(result.chunkedPrefills, 15) << "most prompts are longer than the budget";
  EXPECT_GT(result.prefillChunks, 2 * result.chunkedPrefills);
  EXPECT_LT(result.decodeSteps, batched.decodeSteps) << "no row waits for a batch to drain";
  EXPECT_EQ(result.promptTokens, batched.promptTokens);
  EXPECT_EQ(result.generatedTokens, batched.generatedTokens);
  for (std::size_t i = 0; i < served.generated.size(); ++i) {
    EXPECT_EQ(served.generated[i], batches.generated[i]) << "request " << i;
  }
  int32_t const m = 1024 / 128 + 1;
  EXPECT_EQ(result.swaPeakPagesPerDecodingRow, m + 1);
  EXPECT_LE(result.peakPagesInUse, result.poolPages);
}

TEST(ReplayRunnerTest, SwaKeepsTheBoundedBudget) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayConfig config;
  config.mode = ReplayMode::kSwa;
  config.windowTokens = 512;
  config.maxBatch = 2;
  config.verify = testing::VerifyMode::kAll;
  ReplayResult const result = runReplay(source, config);
  int32_t const m = 512 / 128 + 1;
  EXPECT_EQ(result.backend, KVCacheBackend::kBoundedSwa);
  EXPECT_EQ(result.swaPagesPerSequencePrefill, 2 * m + 1);
  EXPECT_EQ(result.swaPagesPerSequenceDecode, m + 1);
  EXPECT_EQ(result.maxBatch, 2);
  EXPECT_EQ(result.poolPages, 2 * (2 * m + 1));
  EXPECT_LE(result.peakPagesInUse, 2 * (2 * m + 1));
  EXPECT_GT(result.peakPagesInUse, 0);
  EXPECT_EQ(result.reusedTokens, 0);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_GT(result.oracleChecks, 0);
  // Without full layers the SWA pool is the only KV pool.
  ASSERT_EQ(result.pools.size(), 1u);
  EXPECT_EQ(result.pools[0].kind, KvPoolKind::kSwa);
  EXPECT_EQ(result.pools[0].pages, result.poolPages);
  EXPECT_EQ(result.pools[0].peakPagesInUse, result.peakPagesInUse);
  EXPECT_EQ(result.kvBytes, result.poolPages * result.bytesPerPage);
  EXPECT_EQ(result.peakKvBytes, result.peakPagesInUse * result.bytesPerPage);
  // Measured: every decoding sequence (prompts of 700 tokens and more) holds exactly M + 1.
  EXPECT_EQ(result.swaPeakPagesPerDecodingRow, m + 1);
}

TEST(ReplayRunnerTest, SwaWithFullLayersCountsTheIdentityMappedPool) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayConfig config;
  config.mode = ReplayMode::kSwa;
  config.windowTokens = 256;
  config.fullLayers = 1;
  ReplayResult const result = runReplay(source, config);
  EXPECT_EQ(result.backend, KVCacheBackend::kBoundedSwa);
  // The full layers' pool is identity-mapped (one row of 12 pages for the 1505-token sequence):
  // its rows own it whole, so it counts whole in the peak.
  ASSERT_EQ(result.pools.size(), 2u);
  KvPoolUsage const& full = result.pools[0];
  KvPoolUsage const& swa = result.pools[1];
  EXPECT_EQ(full.kind, KvPoolKind::kFull);
  EXPECT_EQ(full.pages, 12);
  EXPECT_EQ(full.peakPagesInUse, full.pages);
  EXPECT_EQ(swa.kind, KvPoolKind::kSwa);
  EXPECT_EQ(swa.pages, result.poolPages);
  EXPECT_EQ(result.kvBytes, full.pages * full.bytesPerPage + swa.pages * swa.bytesPerPage);
  EXPECT_EQ(result.peakKvBytes,
            full.pages * full.bytesPerPage + result.peakPagesInUse * result.bytesPerPage);
  EXPECT_EQ(result.oracleMismatches, 0);
}

/// --kv-budget-bytes on the tiny trace (the longest sequence: 1500 + 3 + 2 tokens = 12 pages).
ReplayConfig budgetConfig(ReplayMode mode, int64_t bytes) {
  ReplayConfig config;
  config.mode = mode;
  config.poolSizing = PoolSizing::kBudgetBytes;
  config.poolAmount = bytes;
  return config;
}

/// Runs `config` on `trace` and returns the ReplayConfigError's message ("" if none).
std::string budgetError(std::filesystem::path const& trace, ReplayConfig const& config) {
  TraceSource source = traceSource(trace);
  try {
    runReplay(source, config);
  } catch (ReplayConfigError const& error) {
    return error.what();
  }
  return "";
}

TEST(ReplayRunnerTest, AKvBudgetBuysWholeFullPagesInReuseAndFullMode) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  // 2 layers x 2 KV heads x head dim 16, fp32: 2 x 2 x 128 x 2 x 16 x 4 = 64 KiB a page.
  int64_t const page = int64_t{2} * 2 * 128 * 2 * 16 * 4;
  for (ReplayMode mode : {ReplayMode::kReuse, ReplayMode::kFull}) {
    ReplayConfig config = budgetConfig(mode, 20 * page + page - 1);
    config.layers = 2;
    config.kvHeads = 2;
    config.headDim = 16;
    config.dtype = DataType::kFloat32;
    TraceSource source = traceSource(kTiny);
    ReplayResult const result = runReplay(source, config);
    EXPECT_EQ(result.bytesPerPage, page);
    EXPECT_EQ(result.poolPages, 20);
    ASSERT_EQ(result.pools.size(), 1u);
    EXPECT_EQ(result.pools[0].kind, KvPoolKind::kFull);
    EXPECT_EQ(result.pools[0].pages, 20);
    EXPECT_EQ(result.pools[0].bytesPerPage, page);
    EXPECT_EQ(result.kvBytes, 20 * page);
    EXPECT_EQ(result.peakKvBytes, result.peakPagesInUse * page);
    EXPECT_EQ(result.failedRequests, 0);
    EXPECT_EQ(result.oracleMismatches, 0);
    if (mode == ReplayMode::kReuse) {
      EXPECT_EQ(result.reusedTokens, 2432);  // 20 pages hold the whole tiny trace
    }
    config.poolAmount = page - 1;
    EXPECT_EQ(budgetError(kTiny, config),
              "--kv-budget-bytes 65535 is below the minimum of 65536 bytes: one page of the full "
              "pool (65536 bytes)");
  }
}

TEST(ReplayRunnerTest, AKvBudgetPairsEveryFullPageWithItsDraftPage) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  // Base: 1 layer, 4 KiB a page; an EAGLE draft of 2 layers: 8 KiB a page; a pair 12 KiB.
  ReplayConfig config = budgetConfig(ReplayMode::kReuse, 30 * 12288 + 12287);
  config.speculative = SpeculativeKind::kEagle;
  config.draftLayers = 2;
  TraceSource source = traceSource(kTiny);
  ReplayResult const result = runReplay(source, config);
  ASSERT_EQ(result.pools.size(), 2u);
  EXPECT_EQ(result.pools[0].kind, KvPoolKind::kFull);
  EXPECT_EQ(result.pools[0].pages, 30);
  EXPECT_EQ(result.pools[0].bytesPerPage, 4096);
  EXPECT_EQ(result.pools[1].kind, KvPoolKind::kDraft);
  EXPECT_EQ(result.pools[1].pages, 30);
  EXPECT_EQ(result.pools[1].bytesPerPage, 8192);
  EXPECT_EQ(result.pools[1].peakPagesInUse, result.peakDraftPagesInUse);
  EXPECT_EQ(result.kvBytes, 30 * 12288);
  EXPECT_EQ(result.peakKvBytes, result.peakPagesInUse * 4096 + result.peakDraftPagesInUse * 8192);
  EXPECT_GT(result.peakDraftPagesInUse, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  config.poolAmount = 12287;
  EXPECT_EQ(budgetError(kTiny, config),
            "--kv-budget-bytes 12287 is below the minimum of 12288 bytes: one page of the full "
            "pool (4096 bytes) and its paired draft page (8192 bytes)");
  // An MTP draft reading the base KV owns no pool: the budget buys base pages only.
  config.speculative = SpeculativeKind::kMtp;
  config.draftLayers = 0;
  config.poolAmount = int64_t{30} * 4096;
  TraceSource again = traceSource(kTiny);
  ReplayResult const mtp = runReplay(again, config);
  ASSERT_EQ(mtp.pools.size(), 1u);
  EXPECT_EQ(mtp.pools[0].pages, 30);
}

TEST(ReplayRunnerTest, AKvBudgetLeavesTheHostTierRecurrentStateAndSnapshotsOut) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  ReplayConfig tiered = budgetConfig(ReplayMode::kReuse, int64_t{16} * 4096);
  tiered.hostPoolTokens = int64_t{64} * 128;
  TraceSource source = traceSource(kTiny);
  ReplayResult const host = runReplay(source, tiered);
  EXPECT_EQ(host.poolPages, 16);
  EXPECT_EQ(host.kvBytes, 16 * 4096);
  EXPECT_EQ(host.hostTier.bytes, 64 * 4096);  // beside the budget
  ReplayConfig hybrid = budgetConfig(ReplayMode::kReuse, int64_t{16} * 4096);
  hybrid.recurrentLayers = 2;
  TraceSource again = traceSource(kTiny);
  ReplayResult const recurrent = runReplay(again, hybrid);
  EXPECT_EQ(recurrent.poolPages, 16);
  EXPECT_EQ(recurrent.kvBytes, 16 * 4096);
  EXPECT_GT(recurrent.hybrid.snapshotBytes, 0);  // beside the budget
  EXPECT_EQ(recurrent.oracleMismatches, 0) << recurrent.firstMismatch;
}

TEST(ReplayRunnerTest, ASwaKvBudgetChargesTheIdentityMappedPoolFirstAndBuysSlidingPages) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  // W = 256: 2M + 1 = 7 sliding pages a sequence; the full layer's identity-mapped pool takes
  // 12 pages a row; every page is 4 KiB, so a row costs 19 pages. 41 pages' worth and a few
  // bytes: 2 rows (3 would need 57), 24 identity-mapped pages, the other 17 sliding.
  ReplayConfig config = budgetConfig(ReplayMode::kSwa, 41 * 4096 + 100);
  config.windowTokens = 256;
  config.fullLayers = 1;
  config.maxBatch = 4;
  TraceSource source = traceSource(kTiny);
  ReplayResult const result = runReplay(source, config);
  EXPECT_EQ(result.maxBatch, 2);
  ASSERT_EQ(result.pools.size(), 2u);
  EXPECT_EQ(result.pools[0].kind, KvPoolKind::kFull);
  EXPECT_EQ(result.pools[0].pages, 24);
  EXPECT_EQ(result.pools[1].kind, KvPoolKind::kSwa);
  EXPECT_EQ(result.pools[1].pages, 17);
  EXPECT_EQ(result.poolPages, 17);
  EXPECT_EQ(result.kvBytes, 41 * 4096);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
  config.poolAmount = 19 * 4096 - 1;
  EXPECT_EQ(budgetError(kTiny, config),
            "--kv-budget-bytes 77823 is below the minimum of 77824 bytes: one sequence's "
            "bounded-SWA budget (2M + 1 = 7 pages of 4096 bytes) and the full layers' "
            "identity-mapped pool of one row (12 pages of 4096 bytes)");
  // Without full layers the whole budget buys sliding pages, and they limit the batch.
  ReplayConfig sliding = budgetConfig(ReplayMode::kSwa, 20 * 4096 + 4095);
  sliding.windowTokens = 256;
  sliding.maxBatch = 4;
  TraceSource again = traceSource(kTiny);
  ReplayResult const bounded = runReplay(again, sliding);
  EXPECT_EQ(bounded.maxBatch, 2);  // 20 / 7
  ASSERT_EQ(bounded.pools.size(), 1u);
  EXPECT_EQ(bounded.pools[0].pages, 20);
  sliding.poolAmount = 7 * 4096 - 1;
  EXPECT_EQ(budgetError(kTiny, sliding),
            "--kv-budget-bytes 28671 is below the minimum of 28672 bytes: one sequence's "
            "bounded-SWA budget (2M + 1 = 7 pages of 4096 bytes)");
}

TEST(ReplayRunnerTest, SwaPoolBelowOneSequenceIsAConfigErrorAndASmallPoolLimitsTheBatch) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayConfig config;
  config.mode = ReplayMode::kSwa;
  config.windowTokens = 512;  // 2M + 1 = 11 pages
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 10;
  EXPECT_THROW(runReplay(source, config), ReplayConfigError);
  config.poolAmount = 21;
  config.maxBatch = 4;
  ReplayResult const result = runReplay(source, config);
  EXPECT_EQ(result.maxBatch, 1);
  EXPECT_EQ(result.failedRequests, 0);
}

TEST(ReplayRunnerTest, ImpossibleConfigurationsThrowConfigErrors) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  auto fails = [&](auto&& change) {
    ReplayConfig config;
    change(config);
    EXPECT_THROW(runReplay(source, config), ReplayConfigError);
  };
  fails([](ReplayConfig& c) { c.pageSize = 100; });
  fails([](ReplayConfig& c) { c.pageSize = 8; });
  fails([](ReplayConfig& c) {
    c.poolSizing = PoolSizing::kPages;
    c.poolAmount = 0;
  });
  fails([](ReplayConfig& c) {
    c.poolSizing = PoolSizing::kTokens;
    c.poolAmount = 127;
  });
  fails([](ReplayConfig& c) { c.fullLayers = 1; });  // not swa
  fails([](ReplayConfig& c) { c.maxBatch = 0; });
  // Hybrid checkpoint reuse exists in reuse mode only, with sensible recurrent geometry.
  fails([](ReplayConfig& c) {
    c.mode = ReplayMode::kSwa;
    c.recurrentLayers = 2;
  });
  fails([](ReplayConfig& c) {
    c.mode = ReplayMode::kFull;
    c.recurrentLayers = 2;
  });
  fails([](ReplayConfig& c) { c.recurrentLayers = 129; });
  fails([](ReplayConfig& c) { c.recurrentLayers = -1; });
  fails([](ReplayConfig& c) {
    c.recurrentLayers = 2;
    c.recurrentStateBytes = 0;
  });
  fails([](ReplayConfig& c) {
    c.recurrentLayers = 2;
    c.recurrentConvBytes = (int64_t{1} << 30) + 1;
  });
  fails([](ReplayConfig& c) { c.snapshotSlots = 4; });  // without recurrent layers
  fails([](ReplayConfig& c) {
    c.recurrentLayers = 2;
    c.snapshotSlots = -1;
  });
  if (!cudaDeviceAvailable()) {
    fails([](ReplayConfig& c) { c.device = DeviceType::kGPU; });
  }
}

TEST(ReplayRunnerTest, BoundedPoolEvictsAndStaysCorrect) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  TraceSource unbounded = traceSource(kMooncake500, 60);
  ReplayResult const reference = runReplay(unbounded, ReplayConfig{});
  TraceSource bounded = traceSource(kMooncake500, 60);
  ReplayConfig config;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 300000;
  ReplayResult const result = runReplay(bounded, config);
  EXPECT_EQ(result.poolPages, 300000 / 128);
  EXPECT_GT(result.evictedRecords, 0);
  EXPECT_LE(result.peakPagesInUse, result.poolPages);
  EXPECT_LT(result.reusedTokens, reference.reusedTokens);
  EXPECT_EQ(result.promptTokens, reference.promptTokens);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
}

/// Sliding-window reuse on the first 60 Mooncake requests: 2 sliding layers (W = 512) beside 1
/// full layer, page 128.
ReplayConfig slidingReuseConfig() {
  ReplayConfig config;
  config.slidingReuse = true;
  config.layers = 2;
  config.fullLayers = 1;
  config.windowTokens = 512;
  config.verify = testing::VerifyMode::kAll;
  return config;
}

TEST(ReplayRunnerTest, SlidingWindowReuseReusesWhatFullLayersDoWhenNothingIsEvicted) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  TraceSource plain = traceSource(kMooncake500, 60);
  ReplayConfig reuse;
  reuse.layers = 3;
  ReplayResult const reference = runReplay(plain, reuse);
  TraceSource composed = traceSource(kMooncake500, 60);
  ReplayResult const result = runReplay(composed, slidingReuseConfig());
  EXPECT_EQ(result.backend, KVCacheBackend::kSlidingWindowReuse);
  ASSERT_EQ(result.records.size(), reference.records.size());
  for (std::size_t i = 0; i < result.records.size(); ++i) {
    EXPECT_EQ(result.records[i].reusedTokens, reference.records[i].reusedTokens) << "request " << i;
  }
  EXPECT_GT(result.reusedTokens, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_GT(result.oracleChecks, reference.oracleChecks);  // the sliding layers' windows too
  EXPECT_EQ(result.missesByReason[static_cast<std::size_t>(MissReason::kWindowEvicted)], 0);
  // A decoding sequence holds at most M + 1 = ceil(512 / 128) + 2 = 6 sliding pages.
  EXPECT_EQ(result.swaPagesPerSequenceDecode, 6);
  EXPECT_LE(result.swaPeakPagesPerDecodingRow, 6);
  EXPECT_GT(result.swaPagesPerSequencePrefill, 6);  // every executed prompt page
  ASSERT_EQ(result.pools.size(), 2u);
  EXPECT_EQ(result.pools[1].kind, KvPoolKind::kSwa);
}

TEST(ReplayRunnerTest, SlidingWindowReuseSplitsAKvBudgetAndStaysCorrectWhenWindowsAreDropped) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  ReplayConfig config = slidingReuseConfig();
  config.poolSizing = PoolSizing::kBudgetBytes;
  config.poolAmount = int64_t{48} << 20;
  config.slidingBudgetShare = 0.25;
  TraceSource trace = traceSource(kMooncake500, 60);
  ReplayResult const result = runReplay(trace, config);
  ASSERT_EQ(result.pools.size(), 2u);
  KvPoolUsage const& full = result.pools[0];
  KvPoolUsage const& sliding = result.pools[1];
  // A quarter of the budget buys sliding pages (2 layers), the rest full pages (1 layer).
  EXPECT_EQ(sliding.pages, (config.poolAmount / 4) / sliding.bytesPerPage);
  EXPECT_EQ(full.pages, (config.poolAmount - config.poolAmount / 4) / full.bytesPerPage);
  EXPECT_LE(result.kvBytes, config.poolAmount);
  EXPECT_GT(result.missesByReason[static_cast<std::size_t>(MissReason::kWindowEvicted)], 0);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  // The window cache dropped blocks to make room; what is cached at the end fits its pool.
  ReplayResult::WindowCache const& window = result.windowCache;
  EXPECT_GT(window.droppedBlocks, 0);
  EXPECT_EQ(window.publishedBlocks - window.droppedBlocks, window.cachedBlocks);
  EXPECT_LE(window.cachedBlocks, sliding.pages);
  EXPECT_LE(window.readBlocks, window.cachedBlocks);
  EXPECT_GT(window.keptBlocks, 0) << "capped hits recomputed windows that are kept";
  EXPECT_LE(window.keptBlocks, window.publishedBlocks);
  nlohmann::json const json = nlohmann::json::parse(formatJson(result));
  EXPECT_EQ(json.at("sliding_window_cache"),
            nlohmann::json({{"published_blocks", window.publishedBlocks},
                            {"dropped_blocks", window.droppedBlocks},
                            {"cached_blocks", window.cachedBlocks},
                            {"read_blocks", window.readBlocks},
                            {"kept_blocks", window.keptBlocks}}));
  EXPECT_NE(formatSummary(result).find("  sliding window cache      "), std::string::npos);
  config.slidingBudgetShare = 0.001;  // not even one sequence's prefill of sliding pages
  TraceSource again = traceSource(kMooncake500, 60);
  EXPECT_THROW(runReplay(again, config), ReplayConfigError);
}

TEST(ReplayRunnerTest, SlidingWindowReuseRefusesAWindowThatCoversWholeSequences) {
  // The embedded workload's longest sequence fits in 10 pages of 128 tokens; a window of 1024
  // tokens needs M + 1 = 10 decode pages, so it bounds nothing and the runtime would serve
  // plain reuse.
  ReplayConfig config = slidingReuseConfig();
  config.windowTokens = 1024;
  MultiTurnWorkload workload;
  RecordingSource source(workload);
  try {
    runReplay(source, config);
    ADD_FAILURE() << "no ReplayConfigError for --window 1024";
  } catch (ReplayConfigError const& error) {
    EXPECT_NE(std::string(error.what()).find("--window 1024"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("plain reuse"), std::string::npos) << error.what();
  }
  config.windowTokens = 512;  // M + 1 = 6 pages: bounded, the composed backend
  MultiTurnWorkload again;
  RecordingSource bounded(again);
  ReplayResult const result = runReplay(bounded, config);
  EXPECT_EQ(result.backend, KVCacheBackend::kSlidingWindowReuse);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
}

TEST(ReplayRunnerTest, ARequestLargerThanTheEmptyPoolFailsAndIsSkipped) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayConfig config;
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 9;  // request 2 needs 12 pages; the others fit (evicting the cache)
  ReplayResult const result = runReplay(source, config);
  EXPECT_EQ(result.failedRequests, 1);
  EXPECT_TRUE(result.records[1].failed);
  EXPECT_EQ(result.records[1].reason, FinishReason::kNotFinished);
  for (std::size_t i : {0u, 2u, 3u}) {
    EXPECT_FALSE(result.records[i].failed) << i;
    EXPECT_EQ(result.records[i].reason, FinishReason::kLength);
  }
  EXPECT_EQ(result.promptTokens, 1024 + 700 + 1024);
  EXPECT_LE(result.peakPagesInUse, 9);
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_NE(formatCsv(result).find("\n1,,10,1500,3,0,0,0,refused,0,1,"), std::string::npos)
      << formatCsv(result);
}

TEST(ReplayRunnerTest, EmbeddedWorkloadReusesEachPreviousTurnIncludingItsReply) {
  MultiTurnWorkload workload;
  RecordingSource source(workload);
  ReplayResult const result = runReplay(source, ReplayConfig{});
  ASSERT_EQ(result.requests, 120);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_EQ(result.evictedRecords, 0);
  constexpr std::size_t kConversations = 24;
  for (std::size_t i = 0; i < 120; ++i) {
    std::vector<int32_t> const& prompt = source.prompts[i];
    if (i < kConversations) {
      // Only the shared system prompt (320 tokens = 2 pages) of the even conversations, once
      // the first of them published it.
      EXPECT_EQ(result.records[i].reusedTokens, i % 2 == 0 && i > 0 ? 256 : 0) << i;
      continue;
    }
    // The previous turn's prompt and reply are a prefix of this prompt; everything of it that
    // had KV was published in whole pages.
    std::size_t const previous = i - kConversations;
    std::size_t const withKv =
        source.prompts[previous].size() + source.generated[previous].size() - 1;
    ASSERT_TRUE(std::equal(source.prompts[previous].begin(), source.prompts[previous].end(),
                           prompt.begin()));
    ASSERT_TRUE(
        std::equal(source.generated[previous].begin(), source.generated[previous].end(),
                   prompt.begin() + static_cast<std::ptrdiff_t>(source.prompts[previous].size())));
    EXPECT_EQ(result.records[i].reusedTokens, static_cast<int64_t>(withKv / 128 * 128)) << i;
  }
  EXPECT_GT(result.hitRate, 0.5);
  // Deterministic: the same figures again.
  MultiTurnWorkload again;
  ReplayResult const second = runReplay(again, ReplayConfig{});
  EXPECT_EQ(second.reusedTokens, result.reusedTokens);
  EXPECT_EQ(second.promptTokens, result.promptTokens);
  EXPECT_EQ(second.generatedTokens, result.generatedTokens);
}

/// The hybrid replays of the embedded workload: every device (the GPU instance skips without one).
class HybridReplayTest : public test::DeviceTest {};
INSTANTIATE_TEST_SUITE_P(Devices, HybridReplayTest, test::allDeviceTypes(), test::deviceName);

ReplayConfig hybridConfig(DeviceType device) {
  ReplayConfig config;
  config.layers = 3;
  config.recurrentLayers = 9;
  config.recurrentStateBytes = 40;  // not a multiple of the oracle's 8-byte words
  config.recurrentConvBytes = 12;
  config.device = device;
  return config;
}

TEST_P(HybridReplayTest, EachTurnRestoresThePreviousTurnsExactCheckpointAndTheOraclesAgree) {
  MultiTurnWorkload workload;
  RecordingSource source(workload);
  MultiTurnWorkload shadowWorkload;
  RecordingSource shadow(shadowWorkload);
  ReplayResult const result = runReplay(source, hybridConfig(device()), {}, &shadow);
  ASSERT_EQ(result.requests, 120);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  ReplayResult::Hybrid const& h = result.hybrid;
  EXPECT_EQ(h.recurrentMismatches, 0);
  constexpr std::size_t kConversations = 24;
  int64_t expectedReuse = 0;
  int64_t expectedAttentionOnly = 0;
  for (std::size_t i = 0; i < 120; ++i) {
    if (i < kConversations) {
      // No checkpoint ends inside a first turn (the shared system prompt is never a prompt of
      // its own), where attention-only reuse binds its 2 whole pages.
      EXPECT_EQ(result.records[i].reusedTokens, 0) << i;
      expectedAttentionOnly += i % 2 == 0 && i > 0 ? 256 : 0;
      continue;
    }
    // The previous turn's decode-end checkpoint: every token of it with KV, mid-page.
    std::size_t const previous = i - kConversations;
    auto const withKv = static_cast<int64_t>(source.prompts[previous].size() +
                                             source.generated[previous].size() - 1);
    EXPECT_EQ(result.records[i].reusedTokens, withKv) << i;
    expectedReuse += withKv;
    expectedAttentionOnly += withKv / 128 * 128;
  }
  EXPECT_EQ(result.reusedTokens, expectedReuse);
  // The shadow replayed the same requests (same prompts and replies) attention-only.
  EXPECT_EQ(shadow.prompts, source.prompts);
  EXPECT_TRUE(h.attentionOnlyRun);
  EXPECT_EQ(h.attentionOnlyReusedTokens, expectedAttentionOnly);
  EXPECT_GT(result.reusedTokens, h.attentionOnlyReusedTokens);
  // 96 turns restored a checkpoint; the prompt end and the decode end of every request were
  // captured and published; the unbounded budget never refused a capture.
  EXPECT_EQ(h.checkpointsRestored, 96);
  EXPECT_EQ(h.checkpointCaptures, 240);
  EXPECT_EQ(h.checkpointsPublished, 240);
  EXPECT_EQ(h.snapshotPressureSkips, 0);
  EXPECT_EQ(h.recurrentSnapshotSlots, 2 * 120 + 2);
  EXPECT_EQ(h.partialKvSnapshotSlots, 2 * 120 + 2);
  EXPECT_EQ(h.snapshotBytes, 242 * (9 * (40 + 12) + 3 * 2 * 128 * 8 * 2));
  // Every execution (each prefill, each decode step) verified the row it resumed from.
  EXPECT_EQ(h.recurrentChecks, 120 + result.decodeSteps);
}

// Hybrid sequences joined in flight and prefilled in chunks under a token budget: each joiner
// restores its hit checkpoint into its resident row, the engine carries its recurrent state from
// chunk to chunk (the oracle checks it at every chunk start), the library keeps chunk ends as
// reuse points, and the reuse stays what one sequence at a time gets.
TEST_P(HybridReplayTest, JoinedAndChunkedSequencesRestoreAndPublishCheckpointsAsWholeOnesDo) {
  ReplayConfig config = hybridConfig(device());
  config.verify = testing::VerifyMode::kAll;
  config.checkpointInterval = 256;
  MultiTurnWorkload serialWorkload;
  ReplayResult const serial = runReplay(serialWorkload, config);
  config.maxBatch = 4;
  config.maxBatchedTokens = 64;
  MultiTurnWorkload workload;
  ReplayResult const result = runReplay(workload, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  ReplayResult::Hybrid const& h = result.hybrid;
  EXPECT_EQ(h.recurrentMismatches, 0);
  // Engagement: joiners, chunked prefills, chunk ends kept, checkpoints restored by joiners.
  EXPECT_GT(result.joins, 50);
  EXPECT_GT(result.chunkedPrefills, 50);
  EXPECT_GT(h.chunkEndCaptures, 50);
  EXPECT_GT(h.checkpointsRestored, 50);
  EXPECT_GT(h.recurrentChecks, serial.hybrid.recurrentChecks) << "every chunk start is checked";
  EXPECT_GE(static_cast<double>(result.reusedTokens),
            0.98 * static_cast<double>(serial.reusedTokens));
}

// An unbounded run sizes the snapshot budget and the record limit for every capture, the chunk
// ends of a token budget included: nothing is skipped or evicted, even without interval points.
TEST_P(HybridReplayTest, UnboundedSizingHasASlotForEveryChunkEnd) {
  ReplayConfig config = hybridConfig(device());
  config.maxBatch = 4;
  config.maxBatchedTokens = 64;
  MultiTurnWorkload workload;
  ReplayResult const result = runReplay(workload, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_GT(result.hybrid.chunkEndCaptures, 50) << "engagement: chunk ends are captured";
  EXPECT_EQ(result.hybrid.snapshotPressureSkips, 0);
  EXPECT_EQ(result.hybrid.reusePointsEvicted, 0);
  EXPECT_EQ(result.evictedRecords, 0);
}

// Dense reuse points under a tight snapshot budget: ranked as any checkpoint they evict each
// other and the prompt and decode ends before a follow-up comes back; kept on speculation (below
// every other record until a prompt passes through them again) they only use slots nothing
// proven needs, and the branch points keep what several prompts share.
TEST_P(HybridReplayTest, BranchFirstKeepsDenseReusePointsUsefulUnderATightBudget) {
  ReplayConfig config = hybridConfig(device());
  config.checkpointInterval = 128;
  config.snapshotSlots = 64;
  config.reusePointAdmission = ReusePointAdmission::kEveryInterval;
  MultiTurnWorkload everyWorkload;
  ReplayResult const every = runReplay(everyWorkload, config);
  config.reusePointAdmission = ReusePointAdmission::kBranchFirst;
  MultiTurnWorkload branchWorkload;
  ReplayResult const branchFirst = runReplay(branchWorkload, config);
  for (ReplayResult const* result : {&every, &branchFirst}) {
    EXPECT_EQ(result->failedRequests, 0);
    EXPECT_EQ(result->oracleMismatches, 0) << result->firstMismatch;
    EXPECT_EQ(result->hybrid.recurrentMismatches, 0);
    EXPECT_GT(result->hybrid.snapshotPressureSkips + result->hybrid.reusePointsEvicted, 0)
        << "the budget must bind";
  }
  EXPECT_GT(static_cast<double>(branchFirst.reusedTokens),
            1.5 * static_cast<double>(every.reusedTokens));
}

/// Six requests, each prompt the previous one plus 37 tokens (100, 137, ... 285), one token each.
TraceSource chainedPrompts() {
  std::vector<TraceRecord> records;
  std::string prompt;
  int32_t length = 0;
  for (int request = 0; request < 6; ++request) {
    for (int32_t end = 100 + 37 * request; length < end; ++length) {
      prompt.append(length > 0 ? ", " : "").append(std::to_string(1000 + (length * 7919) % 30000));
    }
    records.push_back(parseTraceLine("{\"prompt\": [" + prompt + "], \"max_new_tokens\": 1}",
                                     TraceFormat::kAuto));
  }
  return TraceSource(std::move(records), "chained prompts");
}

TEST_P(HybridReplayTest, ASnapshotBudgetOfOneSkipsCapturesWhileItsCheckpointIsRestored) {
  ReplayConfig config = hybridConfig(device());
  config.verify = testing::VerifyMode::kAll;
  // Unbounded: each request restores the previous prompt's checkpoint.
  TraceSource unbounded = chainedPrompts();
  ReplayResult const all = runReplay(unbounded, config);
  EXPECT_EQ(all.oracleMismatches, 0) << all.firstMismatch;
  EXPECT_EQ(all.reusedTokens, 100 + 137 + 174 + 211 + 248);
  EXPECT_EQ(all.hybrid.checkpointsRestored, 5);
  EXPECT_EQ(all.hybrid.snapshotPressureSkips, 0);
  // One slot: request 1 restores the 100-token checkpoint, which stays pinned while the request
  // runs, so its own capture finds no slot; every later request restores the same checkpoint.
  config.snapshotSlots = 1;
  TraceSource one = chainedPrompts();
  ReplayResult const result = runReplay(one, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  ReplayResult::Hybrid const& h = result.hybrid;
  EXPECT_EQ(h.recurrentSnapshotSlots, 1);
  EXPECT_EQ(h.partialKvSnapshotSlots, 1);
  EXPECT_EQ(result.reusedTokens, 5 * 100);
  EXPECT_EQ(h.checkpointsRestored, 5);
  EXPECT_EQ(h.snapshotPressureSkips, 5);
  EXPECT_EQ(h.checkpointsPublished, 1);
  EXPECT_EQ(h.recurrentMismatches, 0);
  EXPECT_FALSE(h.attentionOnlyRun);  // no attention-only source given
}

TEST(ReplayRunnerTest, ATokenBudgetPrefillsJoinersInChunksAndKeepsTheReuse) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  ReplayConfig config;
  config.maxBatch = 16;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 1'000'000;  // small enough to evict
  TraceSource whole = traceSource(kMooncake500);
  ReplayResult const unchunked = runReplay(whole, config);
  config.maxBatchedTokens = 2048;
  TraceSource chunked = traceSource(kMooncake500);
  ReplayResult const result = runReplay(chunked, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_GT(result.evictedRecords, 0);
  EXPECT_GE(result.joins, 100);  // four founders a request, the rest join
  // Engagement: joiners longer than the budget took several chunks, each completed by the
  // library, and waited steps for their first token.
  EXPECT_GT(result.chunkedPrefills, 50);
  EXPECT_GE(result.prefillChunks, 2 * result.chunkedPrefills);
  EXPECT_GT(result.timeToFirstTokenStepsP99, 1);
  EXPECT_EQ(unchunked.chunkedPrefills, 0);
  EXPECT_EQ(unchunked.prefillChunks, 0);
  EXPECT_GE(static_cast<double>(result.reusedTokens),
            0.98 * static_cast<double>(unchunked.reusedTokens));
  EXPECT_EQ(result.promptTokens, unchunked.promptTokens);
}

TEST(ReplayRunnerTest, AChunkedPrefillLeavesTheRecordsAWholePrefillLeaves) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // An unbounded pool: nothing is evicted, so the records left are what publication made. Each
  // chunk publishes a record (a request arriving meanwhile reuses its blocks); the next
  // publication of the same sequence replaces it, so chunking adds nothing to the victim order
  // (before, 3,397 records against 656: S3-FIFO's queues filled with prefixes of one prompt).
  ReplayConfig config;
  config.maxBatch = 16;
  TraceSource whole = traceSource(kMooncake500);
  ReplayResult const unchunked = runReplay(whole, config);
  config.maxBatchedTokens = 2048;
  TraceSource chunked = traceSource(kMooncake500);
  ReplayResult const result = runReplay(chunked, config);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  ASSERT_GT(result.chunkedPrefills, 50);
  EXPECT_EQ(result.evictedRecords, 0);
  EXPECT_EQ(unchunked.evictedRecords, 0);
  EXPECT_EQ(unchunked.replacedChunkRecords, 0);
  EXPECT_GT(result.replacedChunkRecords, result.chunkedPrefills);
  EXPECT_EQ(result.publishedRecords - result.replacedChunkRecords, unchunked.publishedRecords);
  EXPECT_EQ(result.reusedTokens, unchunked.reusedTokens);
}

/// Two requests of 64 distinct tokens, page 16, sampling 30 and 40 tokens: the founder and the
/// joiner take 5 pages each (64 tokens plus the lookahead); the founder ends on 6 pages (93
/// tokens with KV plus the lookahead), the joiner on 7.
TraceSource twoGrowingRequests() {
  std::vector<TraceRecord> records;
  for (int request = 0; request < 2; ++request) {
    std::string prompt;
    for (int i = 0; i < 64; ++i) {
      prompt.append(i > 0 ? ", " : "").append(std::to_string(1000 + 100 * request + i));
    }
    records.push_back(parseTraceLine("{\"prompt\": [" + prompt + "], \"max_new_tokens\": " +
                                         std::to_string(30 + 10 * request) + "}",
                                     TraceFormat::kAuto));
  }
  return TraceSource(std::move(records), "two growing requests");
}

TEST(ReplayRunnerTest, APreemptedSequenceResumesFromTheBlocksItPublished) {
  ReplayConfig config;
  config.pageSize = 16;
  config.maxBatch = 2;
  config.verify = testing::VerifyMode::kAll;
  TraceSource plainTrace = twoGrowingRequests();
  RecordingSource plain(plainTrace);
  ReplayResult const unbounded = runReplay(plain, config);
  ASSERT_EQ(unbounded.joins, 1);
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 11;
  // Without preemption the first step that grows both rows fails the batch: both are retried.
  TraceSource failingTrace = twoGrowingRequests();
  ReplayResult const failing = runReplay(failingTrace, config);
  EXPECT_EQ(failing.retriedRequests, 2);
  EXPECT_EQ(failing.preemptions, 0);
  config.preemption = testing::PreemptionMode::kRecompute;
  for (int32_t budget : {0, 2048}) {
    config.maxBatchedTokens = budget;
    TraceSource trace = twoGrowingRequests();
    RecordingSource recorded(trace);
    ReplayResult const result = runReplay(recorded, config);
    // A pool of 11 pages leaves one free. Both rows reach 80 committed tokens and need a sixth
    // page (with a token budget the joiner, seated a step later, one step after the founder):
    // the joiner, the newest, is preempted and publishes its 5 full blocks. The founder takes the
    // free page and runs to its end; the joiner comes back as the next run with its 64 + 17
    // tokens, reuses the 80 it published and samples its other 23.
    EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
    EXPECT_EQ(result.preemptions, 1) << budget;
    EXPECT_EQ(result.resumed, 1);
    EXPECT_EQ(result.resumedPromptTokens, 64 + 17);
    EXPECT_EQ(result.resumedGeneratedTokens, 17);
    EXPECT_EQ(result.resumedReusedTokens, 80);
    EXPECT_EQ(result.retriedRequests, 0);
    EXPECT_EQ(result.failedRequests, 0);
    EXPECT_EQ(result.promptTokens, 128);
    EXPECT_EQ(result.generatedTokens, 70);
    EXPECT_EQ(result.timeBetweenTokensStepsP50, 1);
    for (std::size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(result.records[i].reason, FinishReason::kLength);
      EXPECT_EQ(result.records[i].reusedTokens, 0);
      EXPECT_EQ(recorded.generated[i], plain.generated[i]) << i;
    }
  }
}

TEST(ReplayRunnerTest, APreemptedSequenceUnderPoolPressureResumesFromItsCachedBlocks) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // 160,000 tokens, 16 rows, no token budget: the engine preempts while other rows still read
  // cached records. Eviction once took records whose every page a running row pinned (freeing
  // nothing): their blocks left the index, the running rows never published them again, and
  // every resumption recomputed its whole prompt (0 of 58,806 tokens reused).
  ReplayConfig config;
  config.maxBatch = 16;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 160'000;
  config.preemption = testing::PreemptionMode::kRecompute;
  TraceSource trace = traceSource(kMooncake500);
  ReplayResult const result = runReplay(trace, config);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_EQ(result.failedRequests, 0);
  ASSERT_GT(result.preemptions, 0);
  EXPECT_EQ(result.resumed, result.preemptions);
  ASSERT_GT(result.resumedPromptTokens, 0);
  EXPECT_GT(result.evictedRecords, 0);
  EXPECT_GT(result.resumedReusedTokens, result.resumedPromptTokens / 4);
}

TEST(ReplayRunnerTest, PerChunkJoinerPagesServeTheSameTokensUnderPressure) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // A pool that preempts: with pages per chunk a joiner waiting for its next chunk holds only
  // what it has written, and the engine counts the planned chunks' pages before each step.
  ReplayConfig config;
  config.maxBatch = 16;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 160'000;
  config.maxBatchedTokens = 2048;
  config.preemption = testing::PreemptionMode::kRecompute;
  TraceSource wholeTrace = traceSource(kMooncake500);
  RecordingSource whole(wholeTrace);
  ReplayResult const wholePrompt = runReplay(whole, config);
  config.joinerPages = JoinerPageAllocation::kPerChunk;
  TraceSource perChunkTrace = traceSource(kMooncake500);
  RecordingSource perChunk(perChunkTrace);
  ReplayResult const result = runReplay(perChunk, config);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.retriedRequests, 0);
  EXPECT_EQ(wholePrompt.failedRequests, 0);
  // Engagement: chunks took their pages when prepared, and the whole-prompt run took none so.
  ASSERT_TRUE(result.coordinatorCounters.has_value());
  ASSERT_TRUE(wholePrompt.coordinatorCounters.has_value());
  EXPECT_GT(result.coordinatorCounters->chunkPageGrowths, 100U);
  EXPECT_EQ(wholePrompt.coordinatorCounters->chunkPageGrowths, 0U);
  EXPECT_GT(result.chunkedPrefills, 50);
  EXPECT_GT(result.preemptions, 0);
  // The schedule differs; what each request is served does not.
  EXPECT_EQ(result.promptTokens, wholePrompt.promptTokens);
  EXPECT_EQ(result.generatedTokens, wholePrompt.generatedTokens);
  ASSERT_EQ(perChunk.generated.size(), whole.generated.size());
  for (std::size_t i = 0; i < whole.generated.size(); ++i) {
    EXPECT_EQ(perChunk.generated[i], whole.generated[i]) << i;
  }
}

TEST(ReplayRunnerTest, SwapPreemptionMovesThePreemptedBlocksToTheHostAndResumesFromThere) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // The recompute case above with a host tier of 160,000 tokens, once per kind: swap moves the
  // preempted rows' blocks to the host at their compaction, and their resumptions onboard them.
  ReplayConfig config;
  config.maxBatch = 16;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 160'000;
  config.hostPoolTokens = 160'000;
  config.preemption = testing::PreemptionMode::kRecompute;
  TraceSource recomputeTrace = traceSource(kMooncake500);
  RecordingSource recomputed(recomputeTrace);
  ReplayResult const recompute = runReplay(recomputed, config);
  config.preemption = testing::PreemptionMode::kSwap;
  TraceSource swapTrace = traceSource(kMooncake500);
  RecordingSource swapped(swapTrace);
  ReplayResult const swap = runReplay(swapped, config);
  EXPECT_EQ(recompute.oracleMismatches, 0) << recompute.firstMismatch;
  EXPECT_EQ(swap.oracleMismatches, 0) << swap.firstMismatch;
  EXPECT_EQ(swap.failedRequests, 0);
  ASSERT_GT(swap.preemptions, 0);
  EXPECT_EQ(swap.resumed, swap.preemptions);
  EXPECT_EQ(recompute.hostTier.swappedOutBlocks, 0);
  EXPECT_GT(swap.hostTier.swappedOutBlocks, 0);
  EXPECT_GT(swap.resumedHostTierTokens, 0);
  EXPECT_LE(swap.resumedHostTierTokens, swap.resumedReusedTokens);
  EXPECT_GT(swap.resumedReusedTokens, swap.resumedPromptTokens / 4);
  // Every sampled token depends on its prefix alone: both runs sample the same outputs.
  ASSERT_EQ(swapped.generated.size(), recomputed.generated.size());
  for (std::size_t i = 0; i < swapped.generated.size(); ++i) {
    EXPECT_EQ(swapped.generated[i], recomputed.generated[i]) << i;
  }
}

TEST(ReplayRunnerTest, SwapPreemptionNeedsAHostTier) {
  ReplayConfig config;
  config.pageSize = 16;
  config.maxBatch = 2;
  config.preemption = testing::PreemptionMode::kSwap;
  TraceSource trace = twoGrowingRequests();
  EXPECT_THROW(
      {
        try {
          runReplay(trace, config);
        } catch (ReplayConfigError const& error) {
          EXPECT_NE(std::string_view(error.what()).find("--host-pool-tokens"),
                    std::string_view::npos)
              << error.what();
          throw;
        }
      },
      ReplayConfigError);
}

TEST(ReplayRunnerTest,
     RecomputePreemptionUnderPoolPressureFinishesEverySequenceAsIfNeverPreempted) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // Every sampled token depends on its prefix alone, so a run that never preempts (an unbounded
  // pool) samples what the preempted and resumed sequences must.
  TraceSource plainTrace = traceSource(kMooncake500);
  RecordingSource plain(plainTrace);
  ReplayConfig config;
  config.maxBatch = 16;
  ReplayResult const unbounded = runReplay(plain, config);
  ASSERT_EQ(unbounded.failedRequests, 0);
  // 140,000 tokens: the longest prompt (134,773) fits alone; 16 rows of Mooncake prompts do not.
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 140'000;
  config.preemption = testing::PreemptionMode::kRecompute;
  TraceSource wholeTrace = traceSource(kMooncake500);
  ReplayResult const whole = runReplay(wholeTrace, config);  // no token budget
  config.maxBatchedTokens = 2048;
  TraceSource chunkedTrace = traceSource(kMooncake500);
  RecordingSource chunked(chunkedTrace);
  ReplayResult const result = runReplay(chunked, config);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  // Engagement: sequences were preempted while decoding (their resumptions had prompts) and came
  // back reusing what they published; no batch failed for lack of pages (no retry alone).
  EXPECT_GT(result.preemptions, 0);
  EXPECT_EQ(result.resumed, result.preemptions);
  EXPECT_GT(result.resumedPromptTokens, 0);
  EXPECT_GT(result.resumedReusedTokens, 0);
  EXPECT_GT(result.chunkedPrefills, 50);
  EXPECT_GT(result.evictedRecords, 0);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.retriedRequests, 0);
  EXPECT_EQ(result.timeBetweenTokensStepsP50, 1);
  EXPECT_EQ(result.promptTokens, unbounded.promptTokens);  // first admissions only
  EXPECT_EQ(result.generatedTokens, unbounded.generatedTokens);
  EXPECT_GE(static_cast<double>(result.reusedTokens),
            0.98 * static_cast<double>(whole.reusedTokens));
  EXPECT_EQ(whole.oracleMismatches, 0) << whole.firstMismatch;
  // Every request finished with its whole output: the tokens the run without preemption sampled.
  ASSERT_EQ(result.records.size(), plain.generated.size());
  for (std::size_t i = 0; i < result.records.size(); ++i) {
    EXPECT_EQ(result.records[i].reason, FinishReason::kLength) << i;
    EXPECT_EQ(result.records[i].generatedTokens, result.records[i].maxNewTokens) << i;
    EXPECT_EQ(chunked.generated[i], plain.generated[i]) << i;
  }
}

/// The independent model of hybrid reuse with reuse points: the exact prefixes a checkpoint
/// holds, as (length, FNV-1a of the tokens), and the plan's rule: the longest strictly shorter
/// than the prompt.
class ExactCheckpoints {
 public:
  explicit ExactCheckpoints(int32_t interval) : mInterval(interval) {}

  int64_t expectedReuse(std::vector<int32_t> const& prompt) const {
    std::vector<uint64_t> const hashes = prefixHashes(prompt);
    // Longest first (std::views::reverse does not parse under clang-tidy 14 with libstdc++ 12).
    // NOLINTNEXTLINE(modernize-loop-convert)
    for (auto it = mLengths.rbegin(); it != mLengths.rend(); ++it) {
      if (*it < static_cast<int64_t>(prompt.size()) &&
          mPrefixes.contains({*it, hashes[static_cast<std::size_t>(*it)]})) {
        return *it;
      }
    }
    return 0;
  }
  /// A request that reused `reuse` tokens and ran to completion: its reuse points past the
  /// reuse length and short of the prompt end, the prompt end, and the decode end (every
  /// sequence token with KV).
  void publishRequest(std::vector<int32_t> const& prompt, std::vector<int32_t> const& generated,
                      int64_t reuse) {
    std::vector<int32_t> sequence = prompt;
    sequence.insert(sequence.end(), generated.begin(), generated.end());
    std::vector<uint64_t> const hashes = prefixHashes(sequence);
    auto const length = static_cast<int64_t>(prompt.size());
    for (int64_t point = (reuse / mInterval + 1) * mInterval; point < length; point += mInterval) {
      add(point, hashes);
    }
    add(length, hashes);
    add(generated.empty() ? length : static_cast<int64_t>(sequence.size()) - 1, hashes);
  }

 private:
  static std::vector<uint64_t> prefixHashes(std::vector<int32_t> const& tokens) {
    std::vector<uint64_t> hashes(tokens.size() + 1, 0xcbf29ce484222325ULL);
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      hashes[i + 1] = (hashes[i] ^ static_cast<uint32_t>(tokens[i])) * 0x100000001b3ULL;
    }
    return hashes;
  }
  void add(int64_t length, std::vector<uint64_t> const& hashes) {
    mLengths.insert(length);
    mPrefixes.insert({length, hashes[static_cast<std::size_t>(length)]});
  }
  int64_t mInterval;
  std::set<int64_t> mLengths;
  std::set<std::pair<int64_t, uint64_t>> mPrefixes;
};

TEST_P(HybridReplayTest, ReusePointsLetAHybridModelReuseOnMooncakeWhatTheModelPredicts) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // Mooncake prompts never extend one another: without reuse points every checkpoint lies in
  // request-unique tokens. With them, a prompt lands on the last point its shared prefix passes.
  ReplayConfig config = hybridConfig(device());
  config.maxBatch = 1;
  config.limit = 300;  // the sanitizer run of CI stays short
  config.checkpointInterval = 1024;
  config.reusePointAdmission = ReusePointAdmission::kEveryInterval;  // the model's points only
  TraceSource trace = traceSource(kMooncake500);
  RecordingSource source(trace);
  TraceSource shadowTrace = traceSource(kMooncake500);
  ReplayResult const result = runReplay(source, config, {}, &shadowTrace);
  ASSERT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  ExactCheckpoints model(config.checkpointInterval);
  int64_t expectedTotal = 0;
  for (std::size_t i = 0; i < source.order.size(); ++i) {
    ASSERT_EQ(source.order[i], i);
    int64_t const expected = model.expectedReuse(source.prompts[i]);
    EXPECT_EQ(result.records[i].reusedTokens, expected) << "request " << i;
    expectedTotal += expected;
    model.publishRequest(source.prompts[i], source.generated[i], expected);
  }
  EXPECT_EQ(result.reusedTokens, expectedTotal);
  ReplayResult::Hybrid const& h = result.hybrid;
  // Engagement: points were captured by the engine, committed and restored, each restore
  // verified by the recurrent oracle.
  EXPECT_GT(h.reusePointsRestored, 0);
  EXPECT_EQ(h.reusePointsWritten, h.reusePointCaptures);
  EXPECT_EQ(h.reusePointsPublished, h.reusePointCaptures);
  EXPECT_GE(h.recurrentChecks, h.checkpointsRestored);
  EXPECT_EQ(h.recurrentMismatches, 0);
  ASSERT_TRUE(h.attentionOnlyRun);
  EXPECT_GE(static_cast<double>(result.reusedTokens),
            0.9 * static_cast<double>(h.attentionOnlyReusedTokens));
}

/// Overwrites every byte of a snapshot slab (all slots) with 0xA5 after every run.
void scribble(Tensor const& slab) {
  Tensor& writable = const_cast<Tensor&>(slab);  // fault injection
  std::vector<uint8_t> const bytes(test::readBytes(writable).size(), 0xA5);
  test::writeBytes(writable, bytes);
}

TEST_P(HybridReplayTest, ACorruptedCheckpointIsCaughtAtEveryRestore) {
  // Recurrent state: every restored row is wrong, and each restore is one recurrent mismatch.
  ReplayConfig config = hybridConfig(device());
  config.limit = 60;
  config.betweenRuns = [](KVCacheRuntime& runtime) {
    scribble(runtime.contextCache()->snapshots()->recurrentStateSlab(4));
  };
  MultiTurnWorkload workload;
  ReplayResult const result = runReplay(workload, config);
  ReplayResult::Hybrid const& h = result.hybrid;
  EXPECT_EQ(h.checkpointsRestored, 36);
  EXPECT_EQ(h.recurrentMismatches, h.checkpointsRestored);
  EXPECT_EQ(result.oracleMismatches, h.recurrentMismatches);
  EXPECT_TRUE(result.firstMismatch.starts_with("recurrent state: slot 0 recurrent state after "))
      << result.firstMismatch;
  EXPECT_NE(result.firstMismatch.find("layer 4 state row: byte "), std::string::npos)
      << result.firstMismatch;
  EXPECT_NE(result.firstMismatch.find(" is 0xa5, expected "), std::string::npos)
      << result.firstMismatch;

  // The partial last page: the KV oracle finds the restored rows wrong, the recurrent one not.
  config.betweenRuns = [](KVCacheRuntime& runtime) {
    scribble(runtime.contextCache()->snapshots()->partialKvSlab(1));
  };
  MultiTurnWorkload again;
  ReplayResult const kv = runReplay(again, config);
  EXPECT_EQ(kv.hybrid.checkpointsRestored, 36);
  EXPECT_EQ(kv.hybrid.recurrentMismatches, 0);
  EXPECT_GT(kv.oracleMismatches, 0);
  EXPECT_NE(kv.firstMismatch.find("layer 1"), std::string::npos) << kv.firstMismatch;
}

/// Host tier replays of the embedded workload on a GPU pool too small to keep it: every device.
class HostTierReplayTest : public test::DeviceTest {};
INSTANTIATE_TEST_SUITE_P(Devices, HostTierReplayTest, test::allDeviceTypes(), test::deviceName);

ReplayConfig smallPoolConfig(DeviceType device) {
  ReplayConfig config;
  config.layers = 2;
  config.device = device;
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 40;  // the workload publishes about 280 pages
  config.eviction = EvictionPolicyKind::kLru;
  return config;
}

TEST_P(HostTierReplayTest, ASmallPoolWithAHostTierReusesWhatAnUnboundedPoolDoes) {
  ReplayConfig unbounded = smallPoolConfig(device());
  unbounded.poolSizing = PoolSizing::kUnbounded;
  MultiTurnWorkload unboundedWorkload;
  ReplayResult const reference = runReplay(unboundedWorkload, unbounded);
  ASSERT_EQ(reference.evictedRecords, 0);

  MultiTurnWorkload gpuOnlyWorkload;
  ReplayResult const gpuOnly = runReplay(gpuOnlyWorkload, smallPoolConfig(device()));
  ASSERT_GT(gpuOnly.evictedRecords, 0);
  ASSERT_LT(gpuOnly.reusedTokens, reference.reusedTokens) << "the small pool must lose reuse";

  ReplayConfig tiered = smallPoolConfig(device());
  tiered.hostPoolTokens = int64_t{400} * 128;  // never full: nothing is dropped
  MultiTurnWorkload tieredWorkload;
  ReplayResult const result = runReplay(tieredWorkload, tiered);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_GT(result.evictedRecords, 0);
  ASSERT_EQ(result.records.size(), reference.records.size());
  for (std::size_t i = 0; i < result.records.size(); ++i) {
    EXPECT_EQ(result.records[i].reusedTokens, reference.records[i].reusedTokens) << "request " << i;
  }
  ReplayResult::HostTier const& h = result.hostTier;
  EXPECT_EQ(h.pages, 400);
  EXPECT_GT(h.onboardedPages, 0);
  EXPECT_GT(h.offloadedPages, 0);
  EXPECT_EQ(h.droppedPages, 0);
  EXPECT_EQ(h.hitTokens, h.onboardedPages * 128);
  EXPECT_EQ(h.offloadedBytes, h.offloadedPages * result.bytesPerPage);
  EXPECT_EQ(result.reusedTokens, reference.reusedTokens);
}

TEST_P(HostTierReplayTest, ACorruptedHostTierIsCaughtByTheKvOracle) {
  ReplayConfig config = smallPoolConfig(device());
  config.hostPoolTokens = int64_t{400} * 128;
  config.betweenRuns = [](KVCacheRuntime& runtime) {
    HostKvTier const& tier = *runtime.hostTier();
    for (PageId page = 0; page < tier.numPages(); ++page) {
      auto* bytes = static_cast<unsigned char*>(const_cast<void*>(tier.hostPage(1, 0, page)));
      bytes[0] ^= 0x5A;  // fault injection: K of layer 1, first token, first byte
    }
  };
  MultiTurnWorkload workload;
  ReplayResult const result = runReplay(workload, config);
  EXPECT_GT(result.hostTier.onboardedPages, 0);
  EXPECT_GT(result.oracleMismatches, 0);
  EXPECT_NE(result.firstMismatch.find("layer 1"), std::string::npos) << result.firstMismatch;
}

/// Hybrid-MTP replays (an MTP draft with paged KV on the hybrid model): every device.
class HybridMtpReplayTest : public test::DeviceTest {};
INSTANTIATE_TEST_SUITE_P(Devices, HybridMtpReplayTest, test::allDeviceTypes(), test::deviceName);

ReplayConfig hybridMtpConfig(DeviceType device) {
  ReplayConfig config = hybridConfig(device);
  config.speculative = SpeculativeKind::kMtp;
  config.specWidth = 3;
  config.boundaryHiddenWidth = 13;  // 26 bytes: not a multiple of the oracle's 8-byte words
  config.verify = testing::VerifyMode::kAll;
  return config;
}

TEST_P(HybridMtpReplayTest, EachTurnRestoresThePreviousPromptsEndpointAndEveryOracleAgrees) {
  MultiTurnWorkload workload;
  RecordingSource source(workload);
  ReplayConfig config = hybridMtpConfig(device());
  config.maxBatch = 4;  // four founders, then joiners in flight
  ReplayResult const result = runReplay(source, config);
  ASSERT_EQ(result.requests, 120);
  EXPECT_GE(result.joins, 100);  // four founders a request, the rest join
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_EQ(result.draftOracleMismatches, 0);
  EXPECT_GT(result.draftOracleChecks, 0);
  ReplayResult::Hybrid const& h = result.hybrid;
  EXPECT_TRUE(h.hybridMtp);
  EXPECT_EQ(h.recurrentMismatches, 0);
  EXPECT_EQ(h.boundaryHiddenMismatches, 0);
  constexpr std::size_t kConversations = 24;
  int64_t expectedReuse = 0;
  for (std::size_t i = 0; i < 120; ++i) {
    // Only prompt endpoints are published (kPrefillStateOnly): a later turn resumes exactly at
    // the end of the previous turn's prompt, never inside its reply; a first turn reuses nothing.
    int64_t const expected =
        i < kConversations ? 0 : static_cast<int64_t>(source.prompts[i - kConversations].size());
    EXPECT_EQ(result.records[i].reusedTokens, expected) << i;
    expectedReuse += expected;
  }
  EXPECT_EQ(result.reusedTokens, expectedReuse);
  // The draft resumes one row before the boundary token at every hit.
  EXPECT_EQ(result.draftReusedTokens, expectedReuse - 96);
  EXPECT_EQ(h.checkpointsRestored, 96);
  EXPECT_EQ(h.mtpEndpointsPublished, 120);
  EXPECT_EQ(h.boundaryHiddenRestores, 96);
  EXPECT_EQ(h.boundaryHiddenChecks, 96);
  EXPECT_EQ(h.snapshotPressureSkips, 0);
  // A recurrent slot keeps the rows and the hidden row; a partial-KV slot a base and a draft page.
  EXPECT_EQ(h.snapshotBytes, 242 * (9 * (40 + 12) + 13 * 2 + (3 + 1) * 2 * 128 * 8 * 2));
  // Every execution (each prefill, each row's verification round) verified the row it resumed
  // from.
  EXPECT_EQ(h.recurrentChecks, 120 + result.specRounds);
  // Four rows a step: each with its own endpoint, boundary hidden row and draft lag.
  EXPECT_LT(result.decodeSteps, result.specRounds / 2);
}

TEST_P(HybridMtpReplayTest, JoinersInChunksPublishTheirEndpointsAfterTheirLastChunk) {
  MultiTurnWorkload workload;
  ReplayConfig config = hybridMtpConfig(device());
  config.maxBatch = 4;
  ReplayResult const whole = runReplay(workload, config);
  config.maxBatchedTokens = 200;  // founders and joiners in chunks
  MultiTurnWorkload again;        // the same requests from the start
  ReplayResult const chunked = runReplay(again, config);
  EXPECT_EQ(chunked.failedRequests, 0);
  EXPECT_EQ(chunked.oracleMismatches, 0) << chunked.firstMismatch;
  EXPECT_EQ(chunked.draftOracleMismatches, 0);
  EXPECT_GT(chunked.chunkedPrefills, 40);
  EXPECT_GT(chunked.heldFounders, 0);
  ReplayResult::Hybrid const& h = chunked.hybrid;
  EXPECT_EQ(h.recurrentMismatches, 0);
  EXPECT_EQ(h.boundaryHiddenMismatches, 0);
  // Every prompt's endpoint, after its last chunk: each later turn restores it exactly as
  // without a budget (boundary hidden row included).
  EXPECT_EQ(h.mtpEndpointsPublished, 120);
  EXPECT_EQ(chunked.reusedTokens, whole.reusedTokens);
  EXPECT_EQ(h.checkpointsRestored, 96);
  EXPECT_EQ(h.boundaryHiddenRestores, 96);
  EXPECT_EQ(h.boundaryHiddenChecks, 96);
}

// A founding batch the pools cannot hold (sixteen founders in a 60-page pool) is not failed: its
// sequences run again alone once the batch drained, as a sequence that failed inside a batch.
TEST_P(HybridMtpReplayTest, AFoundingBatchThePoolCannotHoldIsRetriedAlone) {
  MultiTurnWorkload workload;
  ReplayConfig config = hybridMtpConfig(device());
  config.maxBatch = 16;
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 60;
  ReplayResult const result = runReplay(workload, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_GT(result.retriedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_EQ(result.hybrid.boundaryHiddenMismatches, 0);
  EXPECT_GT(result.reusedTokens, 0);
}

// A row preempted under pool pressure publishes nothing more (kPrefillStateOnly): it comes back
// with its prompt and the tokens it generated, restores at most its own prompt endpoint
// (recurrent rows, boundary page, boundary hidden row) and recomputes the rest, and every
// request is served the tokens it is served without pressure. Sixteen rows in 44 to 50 pages
// preempt (45: three rows, two of which restore their endpoints); fewer pages run the founders
// alone, more never run short.
TEST_P(HybridMtpReplayTest, APreemptedRowResumesFromItsPromptEndpoint) {
  ReplayConfig config = hybridMtpConfig(device());
  config.maxBatch = 16;
  MultiTurnWorkload plainWorkload;
  RecordingSource plain(plainWorkload);
  ReplayResult const unbounded = runReplay(plain, config);
  ASSERT_EQ(unbounded.preemptions, 0);
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 45;
  config.preemption = testing::PreemptionMode::kRecompute;
  MultiTurnWorkload workload;
  RecordingSource recorded(workload);
  ReplayResult const result = runReplay(recorded, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_EQ(result.draftOracleMismatches, 0);
  ReplayResult::Hybrid const& h = result.hybrid;
  EXPECT_EQ(h.recurrentMismatches, 0);
  EXPECT_EQ(h.boundaryHiddenMismatches, 0);
  EXPECT_EQ(h.boundaryHiddenChecks, h.boundaryHiddenRestores);
  ASSERT_GT(result.preemptions, 0);
  EXPECT_EQ(result.resumed, result.preemptions);
  // Reused: the prompt endpoints only; the tokens generated before the preemption are recomputed.
  ASSERT_GT(result.resumedGeneratedTokens, 0);
  EXPECT_GT(result.resumedReusedTokens, 0);
  EXPECT_LE(result.resumedReusedTokens, result.resumedPromptTokens - result.resumedGeneratedTokens);
  ASSERT_EQ(plain.generated.size(), 120U);
  ASSERT_EQ(recorded.generated.size(), plain.generated.size());
  for (std::size_t i = 0; i < plain.generated.size(); ++i) {
    EXPECT_EQ(recorded.generated[i], plain.generated[i]) << i;
  }
}

TEST_P(HybridMtpReplayTest, ACorruptedBoundaryHiddenRowIsCaughtAtEveryRestore) {
  ReplayConfig config = hybridMtpConfig(device());
  config.limit = 60;
  config.betweenRuns = [](KVCacheRuntime& runtime) {
    scribble(runtime.contextCache()->snapshots()->boundaryHiddenSlab());
  };
  MultiTurnWorkload workload;
  ReplayResult const result = runReplay(workload, config);
  ReplayResult::Hybrid const& h = result.hybrid;
  EXPECT_EQ(h.boundaryHiddenRestores, 36);
  EXPECT_EQ(h.boundaryHiddenChecks, 36);
  EXPECT_EQ(h.boundaryHiddenMismatches, 36);
  EXPECT_EQ(h.recurrentMismatches, 0);
  EXPECT_EQ(result.oracleMismatches, h.boundaryHiddenMismatches);
  EXPECT_TRUE(result.firstMismatch.starts_with(
      "boundary hidden row 0 should hold the base hidden row of the "))
      << result.firstMismatch;
  EXPECT_NE(result.firstMismatch.find("-token prefix: byte 0 is 0xa5, expected "),
            std::string::npos)
      << result.firstMismatch;
}

TEST(ReplayRunnerTest, InFlightJoinsKeepKvCorrect) {
  MultiTurnWorkload workload;
  ReplayConfig config;
  config.maxBatch = 4;
  ReplayResult const result = runReplay(workload, config);
  EXPECT_GT(result.joins, 0);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_GT(result.reusedTokens, 0);
  int64_t const joined = std::count_if(result.records.begin(), result.records.end(),
                                       [](RequestRecord const& r) { return r.joinedInFlight; });
  EXPECT_EQ(joined, result.joins);
  int64_t const decodeNanos = std::accumulate(
      result.records.begin(), result.records.end(), int64_t{0},
      [](int64_t sum, RequestRecord const& r) { return sum + r.decodeHostNanoseconds; });
  EXPECT_GT(decodeNanos, 0);
}

TEST(ReplayRunnerTest, BatchFailuresUnderPressureAreRetriedAlone) {
  MultiTurnWorkload workload;
  ReplayConfig config;
  config.maxBatch = 8;
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 40;
  ReplayResult const result = runReplay(workload, config);
  EXPECT_EQ(result.failedRequests, 0);  // every request fits alone
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_LE(result.peakPagesInUse, 40);
  for (RequestRecord const& record : result.records) {
    EXPECT_LE(record.attempts, 2);
  }
}

TEST(ReplayRunnerTest, SaltsIsolateTenants) {
  std::vector<TraceRecord> records;
  std::string prompt;
  for (int i = 0; i < 300; ++i) {
    prompt.append(i > 0 ? ", " : "").append(std::to_string(1000 + i));
  }
  for (char const* salt : {"a", "b", "a"}) {
    records.push_back(parseTraceLine(
        R"({"prompt": [)" + prompt + R"(], "max_new_tokens": 2, "salt": ")" + salt + R"("})",
        TraceFormat::kAuto));
  }
  TraceSource source(std::move(records), "salts");
  ReplayResult const result = runReplay(source, ReplayConfig{});
  EXPECT_EQ(result.records[0].reusedTokens, 0);
  EXPECT_EQ(result.records[1].reusedTokens, 0);
  EXPECT_EQ(result.records[2].reusedTokens, 256);
  EXPECT_EQ(missCount(result, MissReason::kSaltMismatch), 1);
  EXPECT_EQ(result.oracleMismatches, 0);
}

TEST(ReplayRunnerTest, SequencesOfTwoSaltsJoinOneRunningRequest) {
  // A founder of salt "a" decodes 40 steps; four requests of one prompt arrive behind it with
  // salt "b", "a", "b", and "b" under LoRA "x", and join its batch one after the other in its
  // first step, each with its own salt and adapter: only the second "b" reuses the first's
  // prompt (256 tokens, two pages of 128), and every position stays what its own identity wrote.
  auto const run = [](int32_t first) {
    std::string tokens;
    for (int i = 0; i < 300; ++i) {
      tokens.append(i > 0 ? ", " : "").append(std::to_string(first + i));
    }
    return tokens;
  };
  std::vector<TraceRecord> records;
  records.push_back(
      parseTraceLine(R"({"prompt": [)" + run(1000) + R"(], "max_new_tokens": 40, "salt": "a"})",
                     TraceFormat::kAuto));
  for (char const* identity :
       {R"("salt": "b")", R"("salt": "a")", R"("salt": "b")", R"("salt": "b", "lora": "x")"}) {
    records.push_back(parseTraceLine(
        R"({"prompt": [)" + run(5000) + R"(], "max_new_tokens": 2, )" + identity + "}",
        TraceFormat::kAuto));
  }
  TraceSource source(std::move(records), "two salts");
  ReplayConfig config;
  config.maxBatch = 5;
  ReplayResult const result = runReplay(source, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0);
  EXPECT_EQ(result.joins, 4);
  ASSERT_TRUE(result.coordinatorCounters.has_value());
  EXPECT_EQ(result.coordinatorCounters->requests, 1U);  // one batch served both tenants
  for (std::size_t i = 1; i < 5; ++i) {
    EXPECT_TRUE(result.records[i].joinedInFlight) << "request " << i;
  }
  EXPECT_EQ(result.records[1].reusedTokens, 0);
  EXPECT_EQ(result.records[2].reusedTokens, 0);    // salt "a": not "b"'s blocks
  EXPECT_EQ(result.records[3].reusedTokens, 256);  // salt "b": the first "b"'s
  EXPECT_EQ(result.records[4].reusedTokens, 0);    // salt "b" under another adapter
}

TEST(ReplayRunnerTest, OutputCapAndLimit) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayConfig config;
  config.maxOutputTokens = 1;
  config.limit = 3;
  ReplayResult const result = runReplay(source, config);
  EXPECT_EQ(result.requests, 3);
  EXPECT_EQ(result.generatedTokens, 3);
  EXPECT_EQ(result.decodeSteps, 0);
  EXPECT_EQ(result.records[1].maxNewTokens, 1);
}

// ---------------------------------------------------------------- speculative decoding

ReplayConfig eagle(int32_t width = 3) {
  ReplayConfig config;
  config.speculative = SpeculativeKind::kEagle;
  config.specWidth = width;
  config.verify = testing::VerifyMode::kAll;
  return config;
}

TEST(ReplayRunnerTest, EagleTinyTraceReusesPairedPathsLessTheirReplayedLastPage) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  // As in the vanilla test, but a paired path's last page is recomputed (its last draft row
  // depends on the token after it): request 2 matches 8 pages and reuses 7 (896), request 3
  // matches 4 and reuses 3 (384), request 4 matches all 8 of its page-aligned prompt and
  // recomputes the last one, as vanilla does (896).
  TraceSource source = traceSource(kTiny);
  ReplayResult const result = runReplay(source, eagle());
  std::vector<int64_t> const reused = {0, 896, 384, 896};
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(result.records[i].reusedTokens, reused[i]) << i;
    EXPECT_EQ(result.records[i].reason, FinishReason::kLength) << i;
  }
  EXPECT_EQ(result.reusedTokens, 2176);
  EXPECT_EQ(result.draftReusedTokens, 2176);
  EXPECT_EQ(result.draftReusedPages, 17);
  EXPECT_EQ(result.specFullPageReplays, 3);
  EXPECT_EQ(result.generatedTokens, 4 + 3 + 2 + 1);  // the tokens vanilla decoding samples
  EXPECT_EQ(result.proposedTokens, 3 * result.specRounds);
  EXPECT_LE(result.acceptedTokens, result.proposedTokens);
  EXPECT_LE(result.decodeSteps, 3 + 2 + 1);  // a round commits at least one token
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_GT(result.draftOracleChecks, 2176);  // every reused draft position, and more
  EXPECT_GT(result.oracleChecks, result.draftOracleChecks);
  EXPECT_EQ(result.draftBytesPerPage, result.bytesPerPage);  // one draft layer like the base's
  EXPECT_EQ(result.peakKvBytes, result.peakPagesInUse * result.bytesPerPage +
                                    result.peakDraftPagesInUse * result.draftBytesPerPage);
  EXPECT_GT(result.specPairPublications, 0);
}

TEST(ReplayRunnerTest, EagleBatchesUnderPressureSampleWhatVanillaSamplesWithoutMismatches) {
  // The embedded workload (prompts include earlier replies) in batches of 4 with a pool small
  // enough to evict: a speculative engine commits exactly the base model's tokens, so every
  // prompt and reply equals the vanilla run's, in fewer decode steps.
  MultiTurnWorkload vanillaWorkload;
  RecordingSource vanilla(vanillaWorkload);
  ReplayConfig config = eagle(4);
  config.maxBatch = 4;
  config.poolSizing = PoolSizing::kPages;
  config.poolAmount = 150;
  ReplayConfig plain = config;
  plain.speculative = SpeculativeKind::kNone;
  ReplayResult const base = runReplay(vanilla, plain);
  MultiTurnWorkload speculativeWorkload;
  RecordingSource speculative(speculativeWorkload);
  ReplayResult const result = runReplay(speculative, config);
  EXPECT_EQ(result.failedRequests, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_GT(result.joins, 0);  // paired joiners: base and draft rows, their own draft prefill
  EXPECT_GT(result.evictedRecords, 0);
  EXPECT_GT(result.draftReusedTokens, 0);
  EXPECT_EQ(result.draftReusedTokens, result.reusedTokens);
  EXPECT_GT(result.acceptedTokens, 0);
  EXPECT_LT(result.decodeSteps, base.decodeSteps);
  EXPECT_EQ(speculative.prompts, vanilla.prompts);
  EXPECT_EQ(speculative.generated, vanilla.generated);
  EXPECT_LE(result.peakPagesInUse, 150);
  EXPECT_LE(result.peakDraftPagesInUse, 150);
}

TEST(ReplayRunnerTest, FoundersTakeTheTokenBudgetAndFinishTheirPrefillAsJoiners) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  // Under a budget of 2,048 tokens a step, a founding prompt longer than it publishes its first
  // chunk in the prefill step and goes on in chunks, while the requests arriving meanwhile join:
  // on attention-only, hybrid and EAGLE deployments, every token as without a budget.
  enum class Deployment : uint8_t { kAttention, kHybrid, kEagle };
  for (Deployment const deployment :
       {Deployment::kAttention, Deployment::kHybrid, Deployment::kEagle}) {
    SCOPED_TRACE(static_cast<int>(deployment));
    ReplayConfig config = deployment == Deployment::kEagle ? eagle() : ReplayConfig{};
    config.verify = testing::VerifyMode::kSample;
    config.maxBatch = 16;
    config.recurrentLayers = deployment == Deployment::kHybrid ? 2 : 0;
    TraceSource plainTrace = traceSource(kMooncake500);
    RecordingSource plain(plainTrace);
    ReplayResult const unbudgeted = runReplay(plain, config);
    config.maxBatchedTokens = 2048;
    TraceSource budgetTrace = traceSource(kMooncake500);
    RecordingSource budgeted(budgetTrace);
    ReplayResult const result = runReplay(budgeted, config);
    EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
    EXPECT_EQ(unbudgeted.oracleMismatches, 0) << unbudgeted.firstMismatch;
    EXPECT_EQ(result.failedRequests, 0);
    ASSERT_TRUE(result.coordinatorCounters.has_value());
    EXPECT_GT(result.coordinatorCounters->heldPrefills, 0U);
    EXPECT_EQ(result.heldFounders, static_cast<int64_t>(result.coordinatorCounters->heldPrefills));
    EXPECT_EQ(unbudgeted.coordinatorCounters->heldPrefills, 0U);
    EXPECT_GT(result.chunkedPrefills, 0);
    EXPECT_EQ(result.promptTokens, unbudgeted.promptTokens);
    ASSERT_EQ(budgeted.generated.size(), plain.generated.size());
    for (std::size_t i = 0; i < plain.generated.size(); ++i) {
      EXPECT_EQ(budgeted.generated[i], plain.generated[i]) << i;
    }
  }
}

TEST(ReplayRunnerTest, MtpWithoutDraftKvChecksTheBaseOnly) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayConfig config = eagle(2);
  config.speculative = SpeculativeKind::kMtp;
  config.draftLayers = 0;
  ReplayResult const result = runReplay(source, config);
  // No draft state to pair: base paths reused as vanilla reuses them.
  EXPECT_EQ(result.reusedTokens, 2432);
  EXPECT_EQ(result.draftBytesPerPage, 0);
  EXPECT_EQ(result.draftReusedTokens, 0);
  EXPECT_EQ(result.draftOracleChecks, 0);
  EXPECT_EQ(result.oracleMismatches, 0) << result.firstMismatch;
  EXPECT_EQ(result.proposedTokens, 2 * result.specRounds);
}

TEST(ReplayRunnerTest, SpeculativeConfigurationsThatCannotRunThrowConfigErrors) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  auto fails = [&](auto mutate, std::string const& message) {
    TraceSource source = traceSource(kTiny);
    ReplayConfig config = eagle();
    mutate(config);
    try {
      runReplay(source, config);
      ADD_FAILURE() << "no ReplayConfigError: " << message;
    } catch (ReplayConfigError const& error) {
      EXPECT_EQ(std::string(error.what()), message);
    }
  };
  fails([](ReplayConfig& c) { c.mode = ReplayMode::kFull; },
        "speculative decoding needs context reuse (--mode reuse), not full mode");
  fails([](ReplayConfig& c) { c.specWidth = 0; }, "speculative width 0 must be in [1, 64]");
  fails([](ReplayConfig& c) { c.draftLayers = 0; },
        "an EAGLE draft owns paged KV: draft layers must be >= 1 (0 is an MTP draft reading the "
        "base KV)");
  fails([](ReplayConfig& c) { c.recurrentLayers = 2; },
        "an EAGLE draft on a model with recurrent layers is not offered: the speculative hybrid "
        "deployment is Hybrid-MTP (speculative mtp)");
  fails(
      [](ReplayConfig& c) {
        c.speculative = SpeculativeKind::kMtp;
        c.recurrentLayers = 2;
        c.draftLayers = 0;
      },
      "Hybrid-MTP needs an MTP draft with paged KV: draft layers must be >= 1, got 0");
  fails(
      [](ReplayConfig& c) {
        c.speculative = SpeculativeKind::kMtp;
        c.recurrentLayers = 2;
        c.boundaryHiddenWidth = 0;
      },
      "boundary hidden width 0 must be in [1, 32768]");
}

TEST(ReplayReportTest, SpeculativeFiguresInTheSummaryAndJson) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayResult const result = runReplay(source, eagle());
  nlohmann::json const json = nlohmann::json::parse(formatJson(result));
  nlohmann::json const& spec = json.at("speculative");
  EXPECT_EQ(spec.at("kind"), "eagle");
  EXPECT_EQ(spec.at("width"), 3);
  EXPECT_EQ(spec.at("paged_draft"), true);
  EXPECT_EQ(spec.at("draft_reused_tokens"), 2176);
  EXPECT_EQ(spec.at("draft_reused_pages"), 17);
  EXPECT_EQ(spec.at("rounds"), result.specRounds);
  EXPECT_EQ(spec.at("proposed_tokens"), result.proposedTokens);
  EXPECT_EQ(spec.at("accepted_tokens"), result.acceptedTokens);
  EXPECT_EQ(spec.at("draft_oracle_checks"), result.draftOracleChecks);
  EXPECT_EQ(spec.at("base_oracle_checks"), result.oracleChecks - result.draftOracleChecks);
  EXPECT_EQ(spec.at("draft_oracle_mismatches"), 0);
  EXPECT_EQ(spec.at("base_oracle_mismatches"), 0);
  std::string const summary = formatSummary(result);
  EXPECT_NE(summary.find("  speculative               eagle, 3 draft tokens per round; draft 1 "
                         "layer with paged KV, 4.0 KiB per page\n"),
            std::string::npos)
      << summary;
  EXPECT_NE(summary.find("  draft reuse               2,176 tokens = 17 pages  (last-page "
                         "replays 3,"),
            std::string::npos)
      << summary;
  // A vanilla replay has no speculative figures.
  TraceSource again = traceSource(kTiny);
  ReplayResult const vanilla = runReplay(again, ReplayConfig{});
  EXPECT_FALSE(nlohmann::json::parse(formatJson(vanilla)).contains("speculative"));
  EXPECT_EQ(formatSummary(vanilla).find("speculative"), std::string::npos);
}

TEST(ReplayReportTest, JsonHasEveryFigureAndCsvOneRowPerRequest) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  TraceSource source = traceSource(kTiny);
  ReplayResult const result = runReplay(source, ReplayConfig{});
  nlohmann::json const json = nlohmann::json::parse(formatJson(result));
  for (char const* key : {"requests",
                          "prompt_tokens",
                          "reused_tokens",
                          "hit_rate",
                          "prefill_tokens_computed",
                          "decode_steps",
                          "evicted_records",
                          "misses_by_reason",
                          "pool_pages",
                          "peak_pages_in_use",
                          "peak_kv_bytes",
                          "swa_pages_per_sequence",
                          "sliding_window_cache",
                          "kv_budget_bytes",
                          "pools",
                          "kv_bytes",
                          "oracle_checks",
                          "oracle_mismatches",
                          "host_ns_per_step_p50",
                          "host_ns_per_step_p99",
                          "host_ns_per_step_mean",
                          "gpu_timed",
                          "gpu_ns_per_step_p50",
                          "gpu_ns_per_step_p99",
                          "gpu_ns_per_step_mean",
                          "requests_per_s",
                          "wall_s",
                          "mode",
                          "backend",
                          "device",
                          "device_writes",
                          "page_size",
                          "pool_tokens",
                          "failed_requests",
                          "joins"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  EXPECT_EQ(json.at("reused_tokens"), 2432);
  // CPU tensors: no GPU time is measured, and the report says so instead of inventing a figure.
  EXPECT_FALSE(result.gpuTimed);
  EXPECT_EQ(json.at("gpu_timed"), false);
  EXPECT_NE(formatJson(result).find("\n  \"gpu_timed\": false,\n"), std::string::npos);
  EXPECT_EQ(json.at("gpu_ns_per_step_p50"), 0);
  EXPECT_NE(formatSummary(result).find("n/a (CPU tensors)"), std::string::npos);
  EXPECT_EQ(json.at("mode"), "reuse");
  EXPECT_EQ(json.at("backend"), "context-reuse");
  EXPECT_EQ(json.at("pool_tokens"), result.poolPages * 128);
  EXPECT_EQ(json.at("misses_by_reason").at("no_prefix"), 3);
  EXPECT_EQ(json.at("misses_by_reason").size(), result.missesByReason.size());
  EXPECT_FALSE(json.contains("kv_events"));  // no publisher
  EXPECT_TRUE(json.at("kv_budget_bytes").is_null());
  EXPECT_TRUE(json.at("swa_pages_per_sequence").is_null());  // not bounded SWA
  EXPECT_TRUE(json.at("sliding_window_cache").is_null());
  ASSERT_EQ(json.at("pools").size(), 1u);
  EXPECT_EQ(json.at("pools")[0].at("name"), "full");
  EXPECT_EQ(json.at("pools")[0].at("pages"), result.poolPages);
  EXPECT_EQ(json.at("pools")[0].at("bytes"), result.poolPages * 4096);
  EXPECT_EQ(json.at("kv_bytes"), result.poolPages * 4096);

  std::string const csv = formatCsv(result);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 5);
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "index,id,timestamp_ms,prompt_tokens,max_new_tokens,reused_tokens,prefill_tokens,"
            "generated_tokens,finish_reason,joined,attempts,pages_in_use_after,decode_host_ns");
  EXPECT_NE(csv.find("\n1,,10,1500,3,1024,476,3,length,0,1,"), std::string::npos) << csv;

  std::string const summary = formatSummary(result);
  EXPECT_NE(summary.find("reused tokens             2,432  (hit rate 57.25%)"), std::string::npos)
      << summary;
}

TEST(ReplayReportTest, AKvBudgetReportsEveryPoolItsBytesAndThePeak) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  ReplayConfig config;
  config.mode = ReplayMode::kSwa;
  config.windowTokens = 256;
  config.fullLayers = 1;
  config.maxBatch = 4;
  config.poolSizing = PoolSizing::kBudgetBytes;
  config.poolAmount = 41 * 4096 + 100;  // 2 rows: 24 identity-mapped pages, 17 sliding ones
  TraceSource source = traceSource(kTiny);
  ReplayResult const result = runReplay(source, config);
  nlohmann::json const json = nlohmann::json::parse(formatJson(result));
  EXPECT_EQ(json.at("pool_sizing"), "budget");
  EXPECT_EQ(json.at("kv_budget_bytes"), 41 * 4096 + 100);
  EXPECT_EQ(json.at("backend"), "bounded-swa");
  EXPECT_EQ(json.at("kv_bytes"), 41 * 4096);
  nlohmann::json const& pools = json.at("pools");
  ASSERT_EQ(pools.size(), 2u);
  EXPECT_EQ(pools[0], nlohmann::json({{"name", "full"},
                                      {"pages", 24},
                                      {"bytes_per_page", 4096},
                                      {"bytes", 24 * 4096},
                                      {"peak_pages_in_use", 24}}));
  EXPECT_EQ(pools[1].at("name"), "swa");
  EXPECT_EQ(pools[1].at("pages"), 17);
  EXPECT_EQ(pools[1].at("bytes"), 17 * 4096);
  int64_t const swaPeak = pools[1].at("peak_pages_in_use").get<int64_t>();
  EXPECT_GT(swaPeak, 0);
  EXPECT_LE(swaPeak, 2 * 7);
  EXPECT_EQ(json.at("peak_kv_bytes"), (24 + swaPeak) * 4096);
  EXPECT_EQ(json.at("swa_pages_per_sequence"),
            nlohmann::json({{"prefill", 7}, {"decode", 4}, {"decode_peak_per_row", 4}}));
  std::string const summary = formatSummary(result);
  EXPECT_NE(summary.find("  KV pools                  full 24 pages x 4.0 KiB, swa 17 pages x 4.0 "
                         "KiB = 164.0 KiB of a 164.1 KiB budget\n"),
            std::string::npos)
      << summary;
  EXPECT_NE(summary.find("(--kv-budget-bytes 168036, split between the KV pools)"),
            std::string::npos)
      << summary;
  EXPECT_NE(summary.find("  SWA pages per sequence    7 at prefill (2M + 1), 4 in decode (M + 1); "
                         "measured in decode: at most 4 per running row\n"),
            std::string::npos)
      << summary;
}

TEST(ReplayReportTest, JsonKeepsStringsExactlyAndNonFiniteFiguresAsNull) {
  ReplayResult result;
  result.workload = "a\"b\\c\n\x01 \xC3\xA9";
  result.hitRate = std::numeric_limits<double>::quiet_NaN();
  std::string const text = formatJson(result);
  nlohmann::json const json = nlohmann::json::parse(text);
  EXPECT_EQ(json.at("workload"), result.workload);
  EXPECT_TRUE(json.at("hit_rate").is_null());
  // One top-level key per line.
  EXPECT_EQ(static_cast<std::size_t>(std::count(text.begin(), text.end(), '\n')), json.size() + 2);
}

}  // namespace
}  // namespace mkv::replay

namespace mkv::replay {
namespace {

/// A directory store of the test's own, removed with it.
struct StoreFolder {
  StoreFolder()
      : path(std::filesystem::temp_directory_path() /
             ("mkv_replay_remote_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
  }
  ~StoreFolder() { std::filesystem::remove_all(path); }
  StoreFolder(StoreFolder const&) = delete;
  StoreFolder& operator=(StoreFolder const&) = delete;
  std::string url() const { return "file://" + path.string(); }
  std::filesystem::path path;
};

ReplayConfig remoteConfig(std::string url, ReplayRole role) {
  ReplayConfig config;
  config.poolSizing = PoolSizing::kTokens;
  config.poolAmount = 200'000;  // evicts on the first 120 requests
  config.hostPoolTokens = 400'000;
  config.remoteTier = std::move(url);
  config.role = role;
  return config;
}

TEST(ReplayRemoteTierTest,
     ASecondProcessReusesWhatTheFirstComputedAndADecodeOneWhatAPrefillOneSaved) {
  MKV_TEST_INPUT_OR_SKIP(kMooncake500, "tests/data/mooncake_first500.jsonl");
  StoreFolder store;
  TraceSource firstTrace = traceSource(kMooncake500, 120);
  ReplayResult const first = runReplay(firstTrace, remoteConfig(store.url(), ReplayRole::kBoth));
  ASSERT_TRUE(first.remoteTier.enabled);
  EXPECT_GT(first.remoteTier.counters.savedBlocks, 0U);
  EXPECT_EQ(first.remoteTier.counters.saveFailures, 0U);
  EXPECT_EQ(first.oracleMismatches, 0) << first.firstMismatch;
  TraceSource secondTrace = traceSource(kMooncake500, 120);
  ReplayResult const second = runReplay(secondTrace, remoteConfig(store.url(), ReplayRole::kBoth));
  EXPECT_GT(second.remoteTier.counters.loadedBlocks, first.remoteTier.counters.loadedBlocks);
  EXPECT_GT(second.reusedTokens, 2 * first.reusedTokens) << "the store holds what evicted";
  EXPECT_EQ(second.remoteTier.counters.rejectedBlocks, 0U);
  EXPECT_EQ(second.oracleMismatches, 0) << second.firstMismatch;
  EXPECT_GT(second.oracleChecks, second.reusedTokens / 2);

  StoreFolder handoff;
  TraceSource prefillTrace = traceSource(kMooncake500, 120);
  ReplayResult const prefill =
      runReplay(prefillTrace, remoteConfig(handoff.url(), ReplayRole::kPrefill));
  EXPECT_EQ(prefill.remoteTier.counters.savesSkipped, 0U) << "every block handed over";
  EXPECT_EQ(prefill.generatedTokens, prefill.requests - prefill.failedRequests);
  TraceSource decodeTrace = traceSource(kMooncake500, 120);
  ReplayResult const decode =
      runReplay(decodeTrace, remoteConfig(handoff.url(), ReplayRole::kDecode));
  EXPECT_EQ(decode.remoteTier.counters.savedBlocks, 0U);
  EXPECT_EQ(decode.remoteTier.counters.missingBlocks, 0U);
  int64_t fullBlockTokens = 0;
  for (RequestRecord const& record : decode.records) {
    fullBlockTokens += (record.promptTokens - 1) / 128 * 128;  // the last token is computed
  }
  EXPECT_GE(decode.reusedTokens, fullBlockTokens) << "every full block came from the prefill side";
  EXPECT_EQ(decode.oracleMismatches, 0) << decode.firstMismatch;
}

TEST(ReplayRemoteTierTest, ARemoteTierOutsideItsDeploymentIsBadInput) {
  MKV_TEST_INPUT_OR_SKIP(kTiny, "tests/replay/tiny_mooncake.jsonl");
  ReplayConfig noHostTier;
  noHostTier.remoteTier = "file:///nonexistent/never-opened";
  EXPECT_NE(budgetError(kTiny, noHostTier).find("--remote-tier"), std::string::npos);
  ReplayConfig noStore;
  noStore.role = ReplayRole::kDecode;
  EXPECT_NE(budgetError(kTiny, noStore).find("--role decode"), std::string::npos);
}

}  // namespace
}  // namespace mkv::replay
