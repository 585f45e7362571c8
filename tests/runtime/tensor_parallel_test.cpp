/// Tensor-parallel deployments (mkv/tensor_parallel.h): every rank's runtime holds its share of
/// the heads, ranks driven alike decide alike (and alike to one rank), a failure on one rank fails
/// the step on every rank, diverged decisions are caught at the next completion point, and the
/// deployment's KV events come from rank 0 only. Each rank runs in a thread of its own with its
/// own runtime and stream (on kGPU: N pools on the one device), joined through a LocalRankGroup.

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/device.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/error.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/snapshot_storage.h"
#include "mkv/tensor_parallel.h"
#include "mkv/testing/reference_engine.h"
#include "runtime_test_rig.h"

namespace mkv::runtime_test {
namespace {

using testing::EngineRequest;
using testing::EngineSequence;
using testing::EngineStats;
using testing::ReferenceEngine;
using testing::ReferenceEngineOptions;

/// What one rank's run left: the engine's figures, the tables' host rows, the agreement's
/// counters, which requests failed, the events it recorded and whether its shutdown drained.
struct RankRun {
  EngineStats stats;
  std::vector<bool> failedRequests;
  std::vector<int32_t> fullTable;
  std::vector<int32_t> swaTable;
  TensorParallelStats agreement;
  int64_t events = 0;
  bool shutdown = false;
  int64_t evictedRecords = 0;
};

using Drive = std::function<void(int32_t rank, KVCacheRuntime&, RankRun&)>;

/// Runs `drive` on `size` ranks of `config` at once (size 1: one runtime without agreement), each
/// in its own thread with its own runtime and stream (on kGPU, rank r on device r % visible);
/// `faultsOf(rank)` gives a rank's injector.
std::vector<RankRun> runRanks(KVCacheRuntimeConfig const& config, int32_t size, Drive const& drive,
                              std::chrono::milliseconds timeout = std::chrono::seconds(60),
                              std::function<FaultInjector(int32_t)> const& faultsOf = {}) {
  LocalRankGroup group(size, timeout);
  std::vector<RankRun> runs(static_cast<std::size_t>(size));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(size));
  for (int32_t rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      auto const r = static_cast<std::size_t>(rank);
      try {
        if (config.deviceType == DeviceType::kGPU) {
          setCurrentCudaDevice(rank % cudaDeviceCount());  // a GPU per rank where there are enough
        }
        detail::OwnedStream const stream(config.deviceType);
        KVCacheRuntimeConfig rankConfig = config;
        rankConfig.stream = stream.get();
        if (size > 1) {
          rankConfig.tensorParallel = {size, rank, config.tensorParallel.kvHeads,
                                       group.agreement(rank)};
        }
        if (faultsOf) {
          rankConfig.faults = faultsOf(rank);
        }
        auto runtime = KVCacheRuntime::create(rankConfig);
        drive(rank, *runtime, runs[r]);
        if (runtime->contextCache() != nullptr) {
          runs[r].events = static_cast<int64_t>(runtime->contextCache()->drainEvents().size());
          runs[r].evictedRecords =
              static_cast<int64_t>(runtime->contextCache()->metrics().evictedRecords);
        }
        runs[r].shutdown = runtime->shutdown();
        if (runtime->fullPageTable() != nullptr) {
          auto const rows = runtime->fullPageTable()->hostRows();
          runs[r].fullTable.assign(rows.begin(), rows.end());
        }
        if (runtime->swaPageTable() != nullptr) {
          auto const rows = runtime->swaPageTable()->hostRows();
          runs[r].swaTable.assign(rows.begin(), rows.end());
        }
        runs[r].agreement = runtime->tensorParallelStats();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) {
    thread.join();
  }
  for (std::exception_ptr const& error : errors) {
    if (error) {
      std::rethrow_exception(error);
    }
  }
  return runs;
}

/// Multi-turn chats with in-flight joins on a pool that evicts: 24 requests of 1-2 founders and
/// up to 2 joiners continuing or branching earlier turns. The same on every rank.
void chats(KVCacheRuntime& runtime, RankRun& out) {
  ReferenceEngineOptions options;
  options.seed = 5;
  options.eosEvery = 7;
  ReferenceEngine engine(runtime, options);
  std::mt19937 rng(99);
  auto below = [&rng](int32_t n) { return static_cast<int32_t>(rng() % static_cast<uint32_t>(n)); };
  std::vector<std::vector<int32_t>> histories{tokenRun(30, 1), tokenRun(50, 400),
                                              tokenRun(18, 900)};
  auto sequence = [&](int32_t tag) {
    auto& history = histories[static_cast<std::size_t>(below(3))];
    auto const size = static_cast<int32_t>(history.size());
    std::vector<int32_t> prompt(history.begin(), history.begin() + 1 + below(size));
    std::vector<int32_t> const more = tokenRun(1 + below(24), 3000 + 41 * tag);
    prompt.insert(prompt.end(), more.begin(), more.end());
    prompt.resize(std::min<std::size_t>(prompt.size(), 150));
    return EngineSequence{prompt, 2 + below(10), {}, {}, {}, -1, tag};
  };
  for (int32_t request = 0; request < 24; ++request) {
    EngineRequest engineRequest;
    int32_t const founders = 1 + below(2);
    for (int32_t f = 0; f < founders; ++f) {
      engineRequest.sequences.push_back(sequence(request * 8 + f));
    }
    std::deque<EngineSequence> joiners;
    for (int32_t j = below(3); j > 0; --j) {
      joiners.push_back(sequence(request * 8 + 4 + j));
    }
    auto const outcome = engine.run(engineRequest, &joiners);
    out.failedRequests.push_back(outcome.failed);
    for (auto const& done : outcome.sequences) {
      if (done.prompt.size() + done.generated.size() < 140) {
        auto& history = histories[static_cast<std::size_t>(below(3))];
        history = done.prompt;
        history.insert(history.end(), done.generated.begin(), done.generated.end());
      }
    }
  }
  out.stats = engine.stats();
}

/// Two KV heads (one per rank of two), an evicting pool for the reuse backends.
KVCacheRuntimeConfig rankConfig(Backend backend, DeviceType device) {
  KVCacheRuntimeConfig config = configFor(backend, device);
  config.model.numKVHeads = 2;
  config.maxSequenceLength = 160;
  if (backend != Backend::kBoundedSwa) {
    config.numPages = 30;
  }
  return config;
}

void expectSameDecisions(RankRun const& a, RankRun const& b, std::string const& what) {
  EXPECT_EQ(a.failedRequests, b.failedRequests) << what;
  EXPECT_EQ(a.stats.reusedTokens, b.stats.reusedTokens) << what;
  EXPECT_EQ(a.stats.prefillTokensComputed, b.stats.prefillTokensComputed) << what;
  EXPECT_EQ(a.stats.generatedTokens, b.stats.generatedTokens) << what;
  EXPECT_EQ(a.stats.decodeSteps, b.stats.decodeSteps) << what;
  EXPECT_EQ(a.stats.joins, b.stats.joins) << what;
  EXPECT_EQ(a.stats.oracleChecks, b.stats.oracleChecks) << what;
  EXPECT_EQ(a.evictedRecords, b.evictedRecords) << what;
  EXPECT_EQ(a.fullTable, b.fullTable) << what;
  EXPECT_EQ(a.swaTable, b.swaTable) << what;
}

// ---- geometry and contract ------------------------------------------------------------------

TEST(TensorParallelConfigTest, EachRankHoldsItsShareOfTheHeads) {
  KVCacheRuntimeConfig config = configFor(Backend::kContextReuse, DeviceType::kCPU);
  config.model.numKVHeads = 8;
  config.model.numRecurrentLayers = 1;
  config.model.recurrentStateBytes = 64;
  config.model.recurrentConvBytes = 16;
  config.contextCache.recurrentSnapshotPoolBytes = int64_t{4} * 80;
  config.contextCache.partialKvSnapshotPoolBytes = int64_t{4} * 2 * 2 * 16 * 8 * 4 * 2;
  int64_t const whole = KVCacheRuntime::kvBytesFor(config);
  LocalRankGroup group(4);
  config.tensorParallel = {4, 2, KvHeadLayout::kSplitHeads, group.agreement(2)};
  EXPECT_EQ(KVCacheRuntime::kvBytesFor(config) * 4, whole);
  auto runtime = KVCacheRuntime::create(config);
  EXPECT_EQ(runtime->fullPool()->config().numKVHeads, 2);
  EXPECT_EQ(runtime->kvBytes() * 4, whole);
  EXPECT_EQ(runtime->recurrentState()->config().stateBytesPerSlot, 16);
  EXPECT_EQ(runtime->recurrentState()->config().convBytesPerSlot, 4);
  EXPECT_EQ(runtime->config().tensorParallel.rank, 2);

  config.tensorParallel.kvHeads = KvHeadLayout::kReplicated;  // latent KV: every rank whole
  EXPECT_EQ(KVCacheRuntime::kvBytesFor(config), whole);
  EXPECT_EQ(KVCacheRuntime::create(config)->fullPool()->config().numKVHeads, 8);
}

/// The snapshot slots of a runtime created from `config`: {recurrent, partial KV}.
std::pair<int32_t, int32_t> snapshotSlots(KVCacheRuntimeConfig const& config) {
  auto runtime = KVCacheRuntime::create(config);
  SnapshotStorageConfig const& slots = runtime->contextCache()->snapshots()->config();
  return {slots.recurrentSlots, slots.partialKvSlots};
}

TEST(TensorParallelConfigTest, EveryRankKeepsTheDeploymentsSnapshotSlots) {
  // Budgets that are no multiple of a slot: a rank's share must still give the same counts, on a
  // hybrid model and on Hybrid-MTP (whose recurrent slot keeps a whole boundary hidden row).
  KVCacheRuntimeConfig config = configFor(Backend::kContextReuse, DeviceType::kCPU);
  config.model.numKVHeads = 4;
  config.model.numRecurrentLayers = 2;
  config.model.recurrentStateBytes = 64;
  config.model.recurrentConvBytes = 16;
  config.contextCache.recurrentSnapshotPoolBytes = 7 * 160 + 150;
  config.contextCache.partialKvSnapshotPoolBytes = 5 * 2 * 2 * 16 * 4 * 4 * 2 + 1000;
  KVCacheRuntimeConfig mtp = config;
  mtp.speculative = KVCacheSpeculativeConfig{};
  mtp.speculative->numDraftLayers = 1;
  mtp.speculative->numDraftKVHeads = 4;
  mtp.speculative->draftHeadDim = 4;
  mtp.speculative->boundaryHiddenWidth = 40;  // 80 bytes a slot, whole on every rank
  mtp.contextCache.recurrentSnapshotPoolBytes = 6 * (160 + 80) + 200;
  LocalRankGroup group(4);
  for (KVCacheRuntimeConfig whole : {config, mtp}) {
    std::pair<int32_t, int32_t> const expected = snapshotSlots(whole);
    EXPECT_GE(expected.first, 6);
    EXPECT_GE(expected.second, 3);
    whole.tensorParallel = {4, 3, KvHeadLayout::kSplitHeads, group.agreement(3)};
    EXPECT_EQ(snapshotSlots(whole), expected) << (whole.speculative ? "Hybrid-MTP" : "hybrid");
  }
}

TEST(TensorParallelConfigTest, ContractViolationsNameTheFieldAndCreateNothing) {
  KVCacheRuntimeConfig const base = rankConfig(Backend::kContextReuse, DeviceType::kCPU);
  LocalRankGroup group(4);
  auto refused = [&](std::function<void(KVCacheRuntimeConfig&)> const& edit,
                     std::string const& field) {
    KVCacheRuntimeConfig config = base;
    config.tensorParallel = {4, 1, KvHeadLayout::kSplitHeads, group.agreement(1)};
    config.model.numKVHeads = 4;
    edit(config);
    try {
      KVCacheRuntime::create(config);
      ADD_FAILURE() << "created with " << field;
    } catch (Error const& error) {
      EXPECT_NE(std::string(error.what()).find("KVCacheRuntime::create"), std::string::npos);
      EXPECT_NE(std::string(error.what()).find(field), std::string::npos) << error.what();
    }
    EXPECT_THROW(KVCacheRuntime::kvBytesFor(config), Error);
  };
  refused([](auto& c) { c.tensorParallel.size = 0; }, "tensorParallel.size must be >= 1");
  refused([](auto& c) { c.tensorParallel.rank = 4; }, "tensorParallel.rank must be in [0, 4)");
  refused([](auto& c) { c.tensorParallel.agreement = {}; }, "needs tensorParallel.agreement");
  refused([](auto& c) { c.model.numKVHeads = 6; }, "numKVHeads divisible");
  refused([](auto& c) { c.contextCache.remoteTier = RemoteTierConfig{}; }, "remote tier");
  EXPECT_EQ(group.rounds(), 0);
}

TEST(TensorParallelConfigTest, ABrokenGroupFailsItsRanksInsteadOfHangingThem) {
  LocalRankGroup group(2, std::chrono::milliseconds(50));
  RankAgreement const lonely = group.agreement(0);
  EXPECT_FALSE(lonely({true, 1}).allSucceeded);  // rank 1 never comes
  EXPECT_TRUE(group.broken());
  EXPECT_FALSE(group.agreement(1)({true, 1}).allSucceeded);  // and every later call fails
  EXPECT_THROW(group.agreement(2), Error);
}

// ---- decisions --------------------------------------------------------------------------------

class TensorParallelTest : public RuntimeCaseTest {
 protected:
  KVCacheRuntimeConfig config() const { return rankConfig(backend(), device()); }
};

INSTANTIATE_TEST_SUITE_P(Backends, TensorParallelTest, ::testing::ValuesIn(everyBackendCase()),
                         runtimeCaseName);

TEST_P(TensorParallelTest, RanksDrivenAlikeDecideAsOneRankDoes) {
  Drive const drive = [](int32_t, KVCacheRuntime& runtime, RankRun& out) { chats(runtime, out); };
  std::vector<RankRun> const one = runRanks(config(), 1, drive);
  std::vector<RankRun> const two = runRanks(config(), 2, drive);
  RankRun const& reference = one[0];
  EXPECT_EQ(reference.stats.oracleMismatches, 0) << reference.stats.firstMismatch;
  EXPECT_GT(reference.stats.oracleChecks, 0);
  EXPECT_GT(reference.stats.joins, 0);
  if (backend() != Backend::kBoundedSwa) {
    EXPECT_GT(reference.stats.reusedTokens, 0);
    EXPECT_GT(reference.evictedRecords, 0) << "the pool never evicted";
  }
  for (std::size_t rank = 0; rank < two.size(); ++rank) {
    std::string const what = "rank " + std::to_string(rank);
    RankRun const& run = two[rank];
    EXPECT_EQ(run.stats.oracleMismatches, 0) << what << ": " << run.stats.firstMismatch;
    expectSameDecisions(reference, run, what);
    EXPECT_TRUE(run.shutdown) << what;
    EXPECT_GT(run.agreement.agreements, 0) << what;
    EXPECT_EQ(run.agreement.agreements, two[0].agreement.agreements) << what;
    EXPECT_EQ(run.agreement.divergences, 0) << what;
    EXPECT_EQ(run.agreement.failedElsewhere, 0) << what;
  }
  EXPECT_EQ(reference.agreement.agreements, 0);  // one rank agrees with nobody
}

TEST_P(TensorParallelTest, AFailedSynchronisationOnOneRankFailsTheStepOnEveryRank) {
  // Rank 1's 12th synchronisation fails; rank 0's never does (but it has an injector too: the
  // ranks' fault sites agree only when every rank consults one).
  FaultArming rank0;
  FaultArming rank1;
  rank1.failCall(12);
  std::vector<RankRun> const runs = runRanks(
      config(), 2, [](int32_t, KVCacheRuntime& runtime, RankRun& out) { chats(runtime, out); },
      std::chrono::seconds(60),
      [&](int32_t rank) { return rank == 0 ? rank0.injector() : rank1.injector(); });
  EXPECT_EQ(rank1.failures(), 1);
  EXPECT_EQ(rank0.failures(), 0);
  int64_t const failed =
      std::count(runs[0].failedRequests.begin(), runs[0].failedRequests.end(), true);
  EXPECT_GE(failed, 1) << "rank 0 never heard of rank 1's failure";
  expectSameDecisions(runs[0], runs[1], "rank 1 against rank 0");
  EXPECT_GE(runs[0].agreement.failedElsewhere, 1);
  EXPECT_EQ(runs[1].agreement.failedElsewhere, 0);
  for (RankRun const& run : runs) {
    EXPECT_EQ(run.stats.oracleMismatches, 0) << run.stats.firstMismatch;
    EXPECT_TRUE(run.shutdown);
    EXPECT_EQ(run.agreement.divergences, 0);
  }
}

TEST_P(TensorParallelTest, ARankFedOtherCallsIsCaughtAtTheNextCompletionPoint) {
  // Rank 1's engine is given a prompt a page longer: its tables differ from rank 0's at the
  // first completion point, where both ranks fail the step.
  Drive const drive = [](int32_t rank, KVCacheRuntime& runtime, RankRun& out) {
    ReferenceEngine engine(runtime);
    EngineRequest request;
    request.sequences.push_back(
        EngineSequence{tokenRun(rank == 0 ? 40 : 56, 10), 4, {}, {}, {}, -1, 0});
    out.failedRequests.push_back(engine.run(request).failed);
  };
  std::vector<RankRun> const runs = runRanks(config(), 2, drive, std::chrono::seconds(5));
  for (RankRun const& run : runs) {
    EXPECT_EQ(run.failedRequests, std::vector<bool>{true});
    EXPECT_GE(run.agreement.divergences, 1);
  }
}

TEST_P(TensorParallelTest, OnlyRankZeroRecordsTheDeploymentsKvEvents) {
  KVCacheRuntimeConfig events = config();
  events.contextCache.eventQueueCapacity = 4096;
  std::vector<RankRun> const runs = runRanks(
      events, 2, [](int32_t, KVCacheRuntime& runtime, RankRun& out) { chats(runtime, out); });
  if (backend() != Backend::kBoundedSwa) {  // bounded SWA publishes no blocks: no events
    EXPECT_GT(runs[0].events, 0);
  }
  EXPECT_EQ(runs[1].events, 0);
  expectSameDecisions(runs[0], runs[1], "rank 1 against rank 0");
}

}  // namespace
}  // namespace mkv::runtime_test
