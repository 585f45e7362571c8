// Random multi-request workloads through KVCacheRuntime (context reuse) + ManagedKVCacheRequest +
// the reference engine. Prompts share random prefixes from a small set, continue earlier turns,
// join running batches, get cancelled or stop at EOS. The KV oracle checks every position
// attention reads at every step (reused KV must equal freshly computed KV), page conservation is
// checked after every request, and on an unbounded pool every sequence's reuse must equal what an
// independent model of the publication rules predicts.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>

#include "context_cache_test_support.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/testing/reference_engine.h"

namespace mkv::test {
namespace {

using testing::EngineRequest;
using testing::EngineSequence;
using testing::ReferenceEngine;
using testing::RequestOutcome;
using testing::SequenceOutcome;

constexpr int32_t kPage = 16;
constexpr int32_t kMaxBatch = 4;
constexpr int32_t kMaxSequence = 256;

KVCacheRuntimeConfig fastConfig(int32_t numPages, int32_t maxRecords) {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 1;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.kvDataType = DataType::kFloat16;
  config.maxBatchSize = kMaxBatch;
  config.maxSequenceLength = kMaxSequence;
  config.tokensPerPage = kPage;
  config.numPages = numPages;
  config.contextReuse = true;
  config.contextCache.maxRecords = maxRecords;
  config.deviceType = DeviceType::kCPU;
  return config;
}

/// Random requests over a small set of shared prefixes and earlier turns.
class Workload {
 public:
  explicit Workload(uint64_t seed) : mRandom(seed) {
    for (int i = 0; i < 6; ++i) {
      mPrefixes.push_back(tokens(uniform(0, 70)));
    }
  }

  /// A request and the sequences that will try to join it.
  std::pair<EngineRequest, std::deque<EngineSequence>> next() {
    EngineRequest request;
    request.cacheSalt = uniform(0, 9) == 0 ? "tenant-b" : "";
    int32_t const founders = uniform(1, 3);
    for (int32_t i = 0; i < founders; ++i) {
      request.sequences.push_back(sequence());
      if (uniform(0, 19) == 0) {
        request.sequences.back().lookupPolicy = ContextCacheLookupPolicy::kBypass;
      }
    }
    std::deque<EngineSequence> joins;  // joiners inherit the request's policy
    int32_t const joiners = uniform(0, 9) < 3 ? uniform(1, 3) : 0;
    for (int32_t i = 0; i < joiners; ++i) {
      joins.push_back(sequence());
    }
    return {std::move(request), std::move(joins)};
  }

  /// Remembers a finished sequence as a conversation a later turn may continue.
  void remember(std::string const& salt, SequenceOutcome const& outcome) {
    std::vector<int32_t> history = outcome.prompt;
    history.insert(history.end(), outcome.generated.begin(), outcome.generated.end());
    if (history.size() < 200) {
      mHistories.push_back({salt, std::move(history)});
      if (mHistories.size() > 16) {
        mHistories.erase(mHistories.begin());
      }
    }
  }

 private:
  EngineSequence sequence() {
    EngineSequence sequence;
    std::vector<int32_t> prompt;
    int32_t const kind = uniform(0, 9);
    if (kind < 3 && !mHistories.empty()) {
      auto const& [historySalt, history] = mHistories[static_cast<std::size_t>(
          uniform(0, static_cast<int32_t>(mHistories.size()) - 1))];
      (void)historySalt;  // another tenant's history is simply a miss
      prompt = history;
    } else if (kind < 9) {
      prompt = mPrefixes[static_cast<std::size_t>(uniform(0, 5))];
    }
    std::vector<int32_t> const suffix = tokens(uniform(prompt.empty() ? 1 : 0, 50));
    prompt.insert(prompt.end(), suffix.begin(), suffix.end());
    prompt.resize(std::min<std::size_t>(prompt.size(), 200));
    sequence.prompt = std::move(prompt);
    sequence.maxNewTokens = uniform(1, 24);
    sequence.cancelAtStep = uniform(0, 9) == 0 ? uniform(0, 8) : -1;
    return sequence;
  }
  std::vector<int32_t> tokens(int32_t count) {
    std::vector<int32_t> result(static_cast<std::size_t>(count));
    for (int32_t& token : result) {
      token = uniform(100, 104);  // a tiny alphabet: suffixes collide, blocks get shared
    }
    return result;
  }
  int32_t uniform(int32_t lo, int32_t hi) {
    return std::uniform_int_distribution<int32_t>(lo, hi)(mRandom);
  }

  std::mt19937_64 mRandom;
  std::vector<std::vector<int32_t>> mPrefixes;
  std::vector<std::pair<std::string, std::vector<int32_t>>> mHistories;
};

/// Page conservation of the runtime's coordinator after a request: no lease is live and every
/// page is free or cached and reclaimable (nothing pinned), so free + cached == capacity; every
/// page-table row is empty. `full` adds the O(capacity) bookkeeping check of the manager.
void expectQuiescent(KVCacheRuntime& runtime, bool full = true) {
  ContextCacheManager const& manager = runtime.contextCache()->manager();
  ResourcePools const& pools = manager.pools();
  constexpr ResourceType kBase = ResourceType::kBaseKvPage;
  ASSERT_EQ(manager.liveLeaseCount(), 0);
  ASSERT_EQ(pools.freeCount(kBase) + pools.reclaimableCount(kBase), pools.capacity(kBase));
  if (full) {
    expectManagerInvariants(manager);
  }
  KVPageTable const& table = *runtime.fullPageTable();
  for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
    ASSERT_EQ(table.liveEntryCount(slot), 0) << "row " << slot << " left bound";
  }
  ASSERT_EQ(runtime.contextCache()->activeRequestCount(), 0);
}

TEST(CoordinatorPropertyTest, RandomWorkloadsUnderPoolPressureNeverCorruptKv) {
  int64_t requests = 0;
  int64_t refusals = 0;
  int64_t failures = 0;
  int64_t joins = 0;
  int64_t cancellations = 0;
  int64_t endOfSequence = 0;
  int64_t reused = 0;
  ContextCacheMetrics totals;
  uint64_t capacityMisses = 0;  // lookups refused for capacity
  for (uint64_t seed : {11u, 12u, 13u}) {
    SCOPED_TRACE(seed);
    auto runtime = KVCacheRuntime::create(fastConfig(/*numPages=*/24, /*maxRecords=*/48));
    testing::ReferenceEngineOptions options;
    options.verify = testing::VerifyMode::kAll;
    options.throwOnMismatch = true;
    options.seed = seed;
    options.eosEvery = 12;
    ReferenceEngine engine(*runtime, options);
    Workload workload(seed);
    for (int i = 0; i < 500; ++i) {
      auto [request, queue] = workload.next();
      RequestOutcome const outcome = engine.run(request, &queue);
      ++requests;
      refusals += outcome.admitted ? 0 : 1;
      failures += outcome.failed ? 1 : 0;
      for (SequenceOutcome const& sequence : outcome.sequences) {
        joins += sequence.joinedInFlight ? 1 : 0;
        cancellations += sequence.reason == FinishReason::kCancelled ? 1 : 0;
        endOfSequence += sequence.reason == FinishReason::kEndOfSequence ? 1 : 0;
        if (outcome.admitted) {
          workload.remember(request.cacheSalt, sequence);
        }
      }
      ASSERT_NO_FATAL_FAILURE(expectQuiescent(*runtime)) << "after request " << i;
    }
    EXPECT_EQ(engine.stats().oracleMismatches, 0);
    EXPECT_GT(engine.stats().oracleChecks, 0);
    reused += engine.stats().reusedTokens;
    ContextCacheMetrics const metrics = runtime->contextCache()->metrics();
    totals.evictedRecords += metrics.evictedRecords;
    capacityMisses += metrics.missCount(MissReason::kCapacity);
    totals.failedAcquisitions += metrics.failedAcquisitions;
    totals.hits += metrics.hits;
    refusals += static_cast<int64_t>(runtime->contextCache()->counters().liveAdmissionRefusals);
    EXPECT_TRUE(runtime->shutdown());
  }
  // The pool was small enough for every pressure path to be exercised.
  EXPECT_GT(totals.evictedRecords, 0u);
  EXPECT_GT(capacityMisses, 0u);
  EXPECT_GT(totals.failedAcquisitions, 0u);
  EXPECT_GT(refusals, 0);
  EXPECT_GT(totals.hits, 0u);
  EXPECT_GT(reused, 0);
  EXPECT_GT(joins, 0);
  EXPECT_GT(cancellations, 0);
  EXPECT_GT(endOfSequence, 0);
  RecordProperty("requests", static_cast<int>(requests));
  RecordProperty("failed", static_cast<int>(failures));
  RecordProperty("refusals", static_cast<int>(refusals));
  RecordProperty("joins", static_cast<int>(joins));
  RecordProperty("cancellations", static_cast<int>(cancellations));
  RecordProperty("end_of_sequence", static_cast<int>(endOfSequence));
  RecordProperty("reused_tokens", static_cast<int>(reused));
  RecordProperty("evicted_records", static_cast<int>(totals.evictedRecords));
  RecordProperty("capacity_misses", static_cast<int>(capacityMisses));
}

TEST(CoordinatorPropertyTest, AJoinerFinishingOnItsLookaheadLeavesTheBatchBeforeTheNextStep) {
  // The reference engine once kept such a joiner in the batch for one more decode step, without a
  // new token and not cancelled: ContextCacheRequest rightly refused that step.
  auto runtime = KVCacheRuntime::create(fastConfig(/*numPages=*/64, /*maxRecords=*/64));
  ReferenceEngine engine(*runtime);
  EngineRequest request;
  EngineSequence founder;
  founder.prompt = std::vector<int32_t>(40, 7);
  founder.maxNewTokens = 6;
  request.sequences.push_back(founder);
  std::deque<EngineSequence> queue;
  EngineSequence joiner;
  joiner.prompt = std::vector<int32_t>(20, 9);
  joiner.maxNewTokens = 1;  // finishes with kLength on its lookahead token
  queue.push_back(joiner);
  RequestOutcome const outcome = engine.run(request, &queue);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  ASSERT_EQ(outcome.sequences.size(), 2u);
  EXPECT_TRUE(outcome.sequences[1].joinedInFlight);
  EXPECT_EQ(outcome.sequences[1].reason, FinishReason::kLength);
  EXPECT_EQ(outcome.sequences[1].generated.size(), 1u);
  EXPECT_EQ(outcome.sequences[0].reason, FinishReason::kLength);
  EXPECT_EQ(outcome.sequences[0].generated.size(), 6u);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  ASSERT_NO_FATAL_FAILURE(expectQuiescent(*runtime));
  EXPECT_TRUE(runtime->shutdown());
}

/// The publication rules, independently: a published block is a page-aligned prefix (per salt);
/// a prompt reuses its longest published page-aligned prefix, minus one page when that covers
/// the whole page-aligned prompt; prefill publishes the prompt's full pages, a sequence finished
/// by EOS or length also the full pages of its ledger (prompt + generated minus the lookahead);
/// bypass sequences neither look up nor publish. The engine's timeline (joins after compaction,
/// cancellation before a step, joiners that finish on their lookahead compacted before the next
/// step) decides what is published when a sequence looks up.
class PublicationModel {
 public:
  struct Row {
    EngineSequence const* spec = nullptr;
    SequenceOutcome const* outcome = nullptr;
    int32_t generated = 0;  ///< tokens sampled so far
    int32_t steps = 0;
    FinishReason reason = FinishReason::kNotFinished;
  };

  /// Predicted prefill starts of every sequence of the outcome (founders, then joiners).
  std::vector<int32_t> run(EngineRequest const& request, std::deque<EngineSequence> const& joins,
                           RequestOutcome const& outcome) {
    std::vector<int32_t> starts;
    std::vector<Row> rows;
    std::size_t next = 0;  // next outcome entry
    auto seat = [&](EngineSequence const& spec) {
      Row row{&spec, &outcome.sequences.at(next++), 0, 0, FinishReason::kNotFinished};
      bool const bypass = spec.lookupPolicy == ContextCacheLookupPolicy::kBypass;
      starts.push_back(bypass ? 0 : lookup(request.cacheSalt, spec.prompt));
      return row;
    };
    auto sample = [&](Row& row) {
      ++row.generated;
      int32_t const token = row.outcome->generated.at(static_cast<std::size_t>(row.generated - 1));
      if (token == ReferenceEngine::kEndOfSequence) {
        row.reason = FinishReason::kEndOfSequence;
      } else if (row.generated >= row.spec->maxNewTokens) {
        row.reason = FinishReason::kLength;
      }
    };
    auto prefill = [&](Row& row) {
      publish(request.cacheSalt, row, static_cast<int32_t>(row.spec->prompt.size()));
      sample(row);
    };
    auto compact = [&]() {
      std::erase_if(rows, [](Row const& row) { return row.reason != FinishReason::kNotFinished; });
    };
    for (EngineSequence const& spec : request.sequences) {
      rows.push_back(seat(spec));
    }
    for (Row& row : rows) {
      prefill(row);
    }
    std::size_t joined = 0;
    while (true) {
      compact();
      if (rows.empty()) {
        break;
      }
      while (joined < joins.size() && rows.size() < static_cast<std::size_t>(kMaxBatch)) {
        rows.push_back(seat(joins[joined++]));
        prefill(rows.back());
      }
      compact();
      if (rows.empty()) {
        break;
      }
      bool running = false;
      for (Row& row : rows) {
        if (row.reason == FinishReason::kNotFinished && row.spec->cancelAtStep >= 0 &&
            row.steps >= row.spec->cancelAtStep) {
          row.reason = FinishReason::kCancelled;
        }
        running = running || row.reason == FinishReason::kNotFinished;
      }
      if (!running) {
        continue;
      }
      for (Row& row : rows) {
        if (row.reason != FinishReason::kNotFinished) {
          continue;
        }
        ++row.steps;
        sample(row);
        if (row.reason != FinishReason::kNotFinished) {
          publish(request.cacheSalt, row,
                  static_cast<int32_t>(row.spec->prompt.size()) + row.generated - 1);
        }
      }
    }
    EXPECT_EQ(next, outcome.sequences.size()) << "the model's timeline admitted another set";
    return starts;
  }

 private:
  int32_t lookup(std::string const& salt, std::vector<int32_t> const& prompt) const {
    auto const pages = static_cast<int32_t>(prompt.size()) / kPage;
    int32_t matched = 0;
    while (
        matched < pages &&
        mPublished.contains(
            {salt, std::vector<int32_t>(prompt.begin(), prompt.begin() + (matched + 1) * kPage)})) {
      ++matched;
    }
    if (matched == pages && pages > 0 && static_cast<int32_t>(prompt.size()) % kPage == 0) {
      --matched;
    }
    return matched * kPage;
  }
  void publish(std::string const& salt, Row const& row, int32_t committed) {
    if (row.spec->lookupPolicy == ContextCacheLookupPolicy::kBypass) {
      return;
    }
    std::vector<int32_t> ledger = row.spec->prompt;
    ledger.insert(ledger.end(), row.outcome->generated.begin(), row.outcome->generated.end());
    for (int32_t page = 1; page <= committed / kPage; ++page) {
      mPublished.insert(
          {salt, std::vector<int32_t>(ledger.begin(), ledger.begin() + page * kPage)});
    }
  }

  std::set<std::pair<std::string, std::vector<int32_t>>> mPublished;
};

TEST(CoordinatorPropertyTest, ReuseOnAnUnboundedPoolMatchesAnIndependentModel) {
  int64_t requests = 0;
  for (uint64_t seed : {21u, 22u}) {
    SCOPED_TRACE(seed);
    auto runtime = KVCacheRuntime::create(fastConfig(/*numPages=*/8192, /*maxRecords=*/1 << 20));
    testing::ReferenceEngineOptions options;
    options.verify = testing::VerifyMode::kAll;
    options.seed = seed;
    options.eosEvery = 12;
    ReferenceEngine engine(*runtime, options);
    Workload workload(seed);
    PublicationModel model;
    int64_t predicted = 0;
    int64_t joins = 0;
    for (int i = 0; i < 300; ++i) {
      auto [request, queue] = workload.next();
      std::deque<EngineSequence> const joinSpecs = queue;
      RequestOutcome const outcome = engine.run(request, &queue);
      ++requests;
      ASSERT_TRUE(outcome.admitted) << "request " << i;
      ASSERT_FALSE(outcome.failed) << "request " << i;
      std::deque<EngineSequence> const joined(
          joinSpecs.begin(),
          joinSpecs.begin() + static_cast<std::ptrdiff_t>(joinSpecs.size() - queue.size()));
      std::vector<int32_t> const starts = model.run(request, joined, outcome);
      ASSERT_EQ(starts.size(), outcome.sequences.size());
      for (std::size_t s = 0; s < starts.size(); ++s) {
        EXPECT_EQ(outcome.sequences[s].prefillStart, starts[s])
            << "request " << i << " sequence " << s;
        predicted += starts[s];
        joins += outcome.sequences[s].joinedInFlight ? 1 : 0;
        workload.remember(request.cacheSalt, outcome.sequences[s]);
      }
      ASSERT_NO_FATAL_FAILURE(expectQuiescent(*runtime, i % 50 == 49)) << "after request " << i;
    }
    EXPECT_EQ(engine.stats().reusedTokens, predicted);
    EXPECT_EQ(static_cast<int64_t>(runtime->contextCache()->metrics().reusedTokens), predicted);
    EXPECT_GT(predicted, 0);
    EXPECT_GT(joins, 0);
    EXPECT_EQ(runtime->contextCache()->metrics().evictedRecords, 0u);
    EXPECT_EQ(engine.stats().oracleMismatches, 0);
    EXPECT_TRUE(runtime->shutdown());
  }
  EXPECT_GE(requests, 600);
}

}  // namespace
}  // namespace mkv::test
