// The reference engine's step kernels (src/testing/oracle_step.h): a corrupted KV or recurrent
// byte is reported with its exact coordinates at the step that reads it, and the same workload
// gives the same figures, the same outcomes and the same pool bytes (poison included) on CPU and
// GPU tensors, so the CUDA kernels and their host twins do bit-identical work.
#include "mkv/testing/reference_engine.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mkv/kv_cache_runtime.h"
#include "mkv/stream.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv {
using test::concatenated;
using test::tokenRun;
namespace {

using testing::EngineRequest;
using testing::EngineSequence;
using testing::EngineStats;
using testing::ReferenceEngine;
using testing::ReferenceEngineOptions;
using testing::RequestOutcome;
using testing::VerifyMode;

enum class Shape { kReuse, kSwa, kHybrid, kEagle, kHybridMtp };

std::string shapeName(Shape shape) {
  switch (shape) {
    case Shape::kReuse:
      return "reuse";
    case Shape::kSwa:
      return "swa";
    case Shape::kHybrid:
      return "hybrid";
    case Shape::kEagle:
      return "eagle";
    case Shape::kHybridMtp:
      return "hybrid_mtp";
  }
  return "?";
}

constexpr int32_t kPageTokens = 16;

/// Token rows of 12 bytes (1 head x 6 x fp16) and recurrent rows of 20 and 12 bytes: none a
/// multiple of 8, so every row ends in a partial word.
KVCacheRuntimeConfig configOf(Shape shape, DeviceType device) {
  KVCacheRuntimeConfig config;
  config.model.numKVHeads = 1;
  config.model.headDim = 6;
  config.model.kvDataType = DataType::kFloat16;
  config.maxBatchSize = 3;
  config.maxSequenceLength = 256;
  config.tokensPerPage = kPageTokens;
  config.deviceType = device;
  if (shape == Shape::kSwa) {
    config.model.numFullAttentionLayers = 1;
    config.model.numSlidingWindowLayers = 2;
    config.model.slidingWindowTokens = 40;
    return config;
  }
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  if (shape == Shape::kEagle || shape == Shape::kHybridMtp) {
    // A one-layer draft head of another row size (1 head x 5 x fp16 = 10 bytes).
    KVCacheSpeculativeConfig draft;
    draft.numDraftLayers = 1;
    draft.numDraftKVHeads = 1;
    draft.draftHeadDim = 5;
    config.speculative = draft;
  }
  if (shape == Shape::kHybrid) {
    config.model.numRecurrentLayers = 2;
    config.model.recurrentStateBytes = 20;
    config.model.recurrentConvBytes = 12;
    config.contextCache.recurrentSnapshotPoolBytes = 8 * 2 * (20 + 12);
    config.contextCache.partialKvSnapshotPoolBytes = 8 * 2 * 2 * kPageTokens * 12;
  }
  if (shape == Shape::kHybridMtp) {
    // The hybrid geometry with an MTP draft: boundary hidden rows of 7 fp16 (14 bytes); a
    // recurrent slot keeps one, a partial-KV slot a draft page (10-byte rows) too.
    config.model.numRecurrentLayers = 2;
    config.model.recurrentStateBytes = 20;
    config.model.recurrentConvBytes = 12;
    config.speculative->boundaryHiddenWidth = 7;
    config.contextCache.recurrentSnapshotPoolBytes = 8 * (2 * (20 + 12) + 7 * 2);
    config.contextCache.partialKvSnapshotPoolBytes =
        8 * (2 * 2 * kPageTokens * 12 + 2 * kPageTokens * 10);
  }
  return config;
}

EngineSequence sequence(std::vector<int32_t> prompt, int32_t maxNew, int32_t cancelAt = -1) {
  EngineSequence s;
  s.prompt = std::move(prompt);
  s.maxNewTokens = maxNew;
  s.cancelAtStep = cancelAt;
  return s;
}

/// Batches with a shared prefix (reuse hits on the second request in the reuse shape), a
/// cancellation, queued in-flight joiners (admitted or not, depending on the sampled tokens) and
/// end-of-sequence tokens (eosEvery).
struct Workload {
  std::vector<EngineRequest> requests;
  std::vector<std::deque<EngineSequence>> joins;
};

Workload workloadOf(Shape shape) {
  std::vector<int32_t> const system = tokenRun(70, 100);
  Workload w;
  if (shape == Shape::kHybridMtp) {
    // One sequence a request, prompt endpoints only: each prompt extends the previous one, so
    // the second and third requests resume at its endpoint (mid-page: 75 and 98 tokens).
    std::vector<int32_t> const one = concatenated(system, tokenRun(5, 900));
    std::vector<int32_t> const two = concatenated(one, tokenRun(23, 950));
    for (auto const& prompt : {one, two, concatenated(two, tokenRun(17, 3000))}) {
      EngineRequest request;
      request.commitPolicy = ContextCacheCommitPolicy::kPrefillStateOnly;
      request.sequences = {sequence(prompt, 9)};
      w.requests.push_back(request);
      w.joins.emplace_back();
    }
    return w;
  }
  EngineRequest first;
  first.sequences = {sequence(concatenated(system, tokenRun(5, 900)), 9),
                     sequence(concatenated(system, tokenRun(9, 950)), 6)};
  w.requests.push_back(first);
  w.joins.emplace_back();
  EngineRequest second;
  second.sequences = {sequence(concatenated(system, tokenRun(20, 3000)), 7),
                      sequence(concatenated(system, tokenRun(3, 3100)), 8, 3)};
  w.requests.push_back(second);
  w.joins.emplace_back();
  EngineRequest third;
  third.sequences = {sequence(concatenated(system, tokenRun(33, 5000)), 12)};
  w.requests.push_back(third);
  w.joins.emplace_back();
  if (shape != Shape::kSwa) {
    w.joins.back().push_back(sequence(concatenated(system, tokenRun(11, 7000)), 5));
    w.joins.back().push_back(sequence(tokenRun(50, 8000), 4));
  }
  return w;
}

std::vector<uint8_t> poisonFor(Tensor const& tensor, uint32_t seed) {
  std::vector<uint8_t> bytes(static_cast<std::size_t>(tensor.sizeBytes()));
  std::mt19937 random(seed);
  for (auto& b : bytes) {
    b = static_cast<uint8_t>(random());
  }
  return bytes;
}

/// Everything a run leaves: figures, outcomes and every KV and recurrent byte.
struct RunResult {
  EngineStats stats;
  std::vector<RequestOutcome> outcomes;
  std::vector<std::vector<uint8_t>> bytes;
};

using Corruption = std::function<void(KVCacheRuntime&, int64_t)>;

constexpr int32_t kSpecWidth = 3;

RunResult runWorkload(Shape shape, DeviceType device, Corruption const& corrupt = {}) {
  auto runtime = KVCacheRuntime::create(configOf(shape, device));
  // Poison every KV byte: the bytes the engine never writes must stay as they were.
  uint32_t seed = 1;
  for (KVCachePool* pool : {runtime->fullPool(), runtime->swaPool(), runtime->draftPool()}) {
    for (int32_t l = 0; pool != nullptr && l < pool->numLayers(); ++l) {
      test::writeBytes(pool->layer(l), poisonFor(pool->layer(l), seed++));
    }
  }
  ReferenceEngineOptions options;
  options.verify = VerifyMode::kAll;
  options.eosEvery = 7;
  options.throwOnMismatch = false;
  options.speculativeWidth = shape == Shape::kEagle || shape == Shape::kHybridMtp ? kSpecWidth : 0;
  KVCacheRuntime* raw = runtime.get();
  if (corrupt) {
    options.onStep = [raw, &corrupt](int64_t step) { corrupt(*raw, step); };
  }
  ReferenceEngine engine(*runtime, options);
  Workload workload = workloadOf(shape);
  RunResult result;
  for (std::size_t r = 0; r < workload.requests.size(); ++r) {
    result.outcomes.push_back(engine.run(workload.requests[r], &workload.joins[r]));
  }
  result.stats = engine.stats();
  for (KVCachePool* pool : {runtime->fullPool(), runtime->swaPool(), runtime->draftPool()}) {
    for (int32_t l = 0; pool != nullptr && l < pool->numLayers(); ++l) {
      result.bytes.push_back(test::readBytes(pool->layer(l)));
    }
  }
  if (RecurrentStatePool* state = runtime->recurrentState()) {
    for (int32_t l = 0; l < state->numLayers(); ++l) {
      result.bytes.push_back(test::readBytes(state->state(l)));
      result.bytes.push_back(test::readBytes(state->conv(l)));
    }
  }
  EXPECT_TRUE(runtime->shutdown());
  return result;
}

/// Flips byte `byte` of the token row of position `position` of resident slot 0 (layer, half).
void flipKvByte(KVCacheRuntime& runtime, int32_t layer, int32_t half, int32_t position,
                int64_t byte, uint8_t* was, uint8_t* now, int32_t* pageOut) {
  KVCachePool& pool = *runtime.fullPool();
  int32_t const page =
      runtime.fullPageTable()->hostRow(0)[static_cast<std::size_t>(position / kPageTokens)];
  ASSERT_GE(page, 0);
  std::vector<uint8_t> bytes = test::readBytes(pool.layer(layer));
  std::size_t const offset =
      static_cast<std::size_t>(half * pool.pageBytes() * pool.numPages() + page * pool.pageBytes() +
                               (position % kPageTokens) * pool.tokenBytes() + byte);
  *was = bytes[offset];
  bytes[offset] = static_cast<uint8_t>(bytes[offset] ^ 0x5A);
  *now = bytes[offset];
  *pageOut = page;
  test::writeBytes(pool.layer(layer), bytes);
}

class ReferenceEngineTest : public test::DeviceTest {};
INSTANTIATE_TEST_SUITE_P(Devices, ReferenceEngineTest, test::allDeviceTypes(), test::deviceName);

TEST_P(ReferenceEngineTest, ACorruptedKvByteIsReportedWithItsCoordinatesAtEveryStepThatReadsIt) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kReuse, device()));
  uint8_t was = 0;
  uint8_t now = 0;
  int32_t page = -1;
  ReferenceEngineOptions options;
  options.verify = VerifyMode::kAll;
  options.throwOnMismatch = false;
  KVCacheRuntime* raw = runtime.get();
  options.onStep = [&](int64_t step) {
    if (step == 2) {
      flipKvByte(*raw, 1, 1, 21, 9, &was, &now, &page);
    }
  };
  ReferenceEngine engine(*runtime, options);
  EngineRequest request;
  request.sequences = {sequence(tokenRun(30, 100), 6)};
  RequestOutcome const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  ASSERT_EQ(outcome.decodeSteps, 5);  // steps 3, 4 and 5 read the corrupted position
  EXPECT_EQ(engine.stats().oracleMismatches, 3);
  EXPECT_EQ(engine.stats().firstMismatch,
            fmt::format("slot 0 position 21 (page {}, row 5) layer 1 V: byte 9 is {:#04x}, "
                        "expected {:#04x}",
                        page, now, was));
  // Positions checked: the prompt after prefill, then every position at every step.
  EXPECT_EQ(engine.stats().oracleChecks, 30 + 31 + 32 + 33 + 34 + 35);
}

TEST_P(ReferenceEngineTest, AMismatchThrowsWhenTheStepCompletesWithThrowOnMismatch) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kReuse, device()));
  uint8_t was = 0;
  uint8_t now = 0;
  int32_t page = -1;
  ReferenceEngineOptions options;
  options.verify = VerifyMode::kAll;
  KVCacheRuntime* raw = runtime.get();
  options.onStep = [&](int64_t step) {
    if (step == 1) {
      flipKvByte(*raw, 0, 0, 30, 0, &was, &now, &page);
    }
  };
  ReferenceEngine engine(*runtime, options);
  EngineRequest request;
  request.sequences = {sequence(tokenRun(30, 100), 6)};
  // Position 30 (the first decoded token) was written at step 1: step 2 reads it.
  EXPECT_TRUE(test::throwsError(
      [&] { engine.run(request); },
      {"ReferenceEngine: oracle mismatch: slot 0 position 30", "layer 0 K: byte 0 is"}));
  EXPECT_EQ(engine.stats().decodeSteps, 2);
}

TEST_P(ReferenceEngineTest, ACorruptedRecurrentByteIsReportedWhenTheNextExecutionResumes) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kHybrid, device()));
  ReferenceEngineOptions options;
  options.verify = VerifyMode::kAll;
  options.throwOnMismatch = false;
  uint8_t was = 0;
  uint8_t now = 0;
  KVCacheRuntime* raw = runtime.get();
  options.onStep = [&](int64_t step) {
    if (step == 2) {
      Tensor& rows = raw->recurrentState()->state(1);
      std::vector<uint8_t> bytes = test::readBytes(rows);
      was = bytes[17];  // slot 0, byte 17
      bytes[17] = static_cast<uint8_t>(was ^ 0xFF);
      now = bytes[17];
      test::writeBytes(rows, bytes);
    }
  };
  ReferenceEngine engine(*runtime, options);
  EngineRequest request;
  request.sequences = {sequence(tokenRun(30, 100), 6)};
  ASSERT_TRUE(engine.run(request).admitted);
  // Step 3 resumes from the state after 30 + 2 tokens and rewrites it: one mismatch.
  EXPECT_EQ(engine.stats().oracleMismatches, 1);
  EXPECT_EQ(engine.stats().firstMismatch,
            fmt::format("recurrent state: slot 0 recurrent state after 32 tokens, layer 1 state "
                        "row: byte 17 is {:#04x}, expected {:#04x}",
                        now, was));
  EXPECT_EQ(engine.stats().recurrentChecks, 1 + 5);  // the prefill and every decode step
  EXPECT_EQ(engine.stats().recurrentMismatches, 1);
}

TEST_P(ReferenceEngineTest, VerifyNoneWritesButChecksNothing) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kReuse, device()));
  ReferenceEngineOptions options;
  options.verify = VerifyMode::kNone;
  ReferenceEngine engine(*runtime, options);
  EngineRequest request;
  request.sequences = {sequence(tokenRun(30, 100), 4)};
  ASSERT_TRUE(engine.run(request).admitted);
  EXPECT_EQ(engine.stats().oracleChecks, 0);
  EXPECT_EQ(engine.stats().lengthChecks, 0);
  // What it wrote is still the oracle's bytes: a verifying engine reuses them without complaint.
  ReferenceEngine checker(*runtime);
  request.sequences[0].prompt = concatenated(tokenRun(30, 100), tokenRun(20, 600));
  RequestOutcome const outcome = checker.run(request);
  EXPECT_EQ(outcome.sequences.at(0).prefillStart, 16);
  EXPECT_EQ(checker.stats().oracleMismatches, 0) << checker.stats().firstMismatch;
  EXPECT_TRUE(runtime->shutdown());
}

// ---------------------------------------------------------------- speculative decoding

ReferenceEngineOptions speculativeOptions() {
  ReferenceEngineOptions options;
  options.verify = VerifyMode::kAll;
  options.throwOnMismatch = false;
  options.speculativeWidth = kSpecWidth;
  return options;
}

TEST_P(ReferenceEngineTest, SpeculativeRoundsCommitTheBaseTokensAndReuseThePairedPath) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kEagle, device()));
  ReferenceEngine engine(*runtime, speculativeOptions());
  EngineRequest first;
  first.sequences = {sequence(tokenRun(70, 100), 12)};
  EngineRequest second;
  second.sequences = {sequence(concatenated(tokenRun(70, 100), tokenRun(20, 600)), 6)};
  RequestOutcome const a = engine.run(first);
  RequestOutcome const b = engine.run(second);
  ASSERT_TRUE(a.admitted && b.admitted);
  EngineStats const& stats = engine.stats();
  EXPECT_EQ(stats.oracleMismatches, 0) << stats.firstMismatch;
  // The second prompt shares 70 tokens = 4 full pages with the first; the reuse contract
  // replays the last page of every paired path (its last draft row depends on the next token),
  // so 3 pages of base and draft KV are reused.
  EXPECT_EQ(b.sequences.at(0).prefillStart, 3 * kPageTokens);
  EXPECT_EQ(stats.draftReusedTokens, 3 * kPageTokens);
  EXPECT_EQ(stats.proposedTokens, kSpecWidth * stats.speculativeRounds);
  EXPECT_EQ(stats.speculativeRounds, stats.decodeSteps);  // one row per run
  EXPECT_LT(stats.decodeSteps, 11 + 5);                   // fewer rounds than vanilla decode steps
  EXPECT_GT(stats.draftOracleChecks, 0);
  EXPECT_GT(stats.lengthChecks, 0);
  // The same tokens as vanilla decoding of the same prompts.
  auto vanillaRuntime = KVCacheRuntime::create(configOf(Shape::kReuse, device()));
  ReferenceEngine vanilla(*vanillaRuntime);
  EXPECT_EQ(vanilla.run(first).sequences.at(0).generated, a.sequences.at(0).generated);
  EXPECT_EQ(vanilla.run(second).sequences.at(0).generated, b.sequences.at(0).generated);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(ReferenceEngineTest, TheSpeculativeWorkloadWithCancellationsAndEndOfSequenceRunsClean) {
  // The parity workload on an EAGLE runtime: batches of two (one to be cancelled at round 3,
  // which commits its 8 tokens before), end-of-sequence tokens inside accepted spans, queued
  // joiners the runtime never admits.
  RunResult const run = runWorkload(Shape::kEagle, device());
  EngineStats const& stats = run.stats;
  EXPECT_EQ(stats.oracleMismatches, 0) << stats.firstMismatch;
  EXPECT_EQ(stats.joins, 0);
  EXPECT_GT(stats.draftReusedTokens, 0);
  EXPECT_EQ(stats.draftReusedTokens, stats.reusedTokens);
  EXPECT_GT(stats.draftOracleChecks, 0);
  EXPECT_GT(stats.acceptedTokens, 0);
}

TEST_P(ReferenceEngineTest, ARowCancelledBetweenRoundsHoldsWhileTheOtherRowCompletes) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kEagle, device()));
  ReferenceEngine engine(*runtime, speculativeOptions());
  EngineRequest request;
  request.sequences = {sequence(tokenRun(40, 100), 30, /*cancelAt=*/1),
                       sequence(tokenRun(35, 300), 20)};
  RequestOutcome const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  EXPECT_EQ(outcome.sequences.at(0).reason, FinishReason::kCancelled);
  EXPECT_EQ(outcome.sequences.at(0).decodeSteps, 1);
  EXPECT_EQ(outcome.sequences.at(1).reason, FinishReason::kLength);
  EXPECT_EQ(outcome.sequences.at(1).generated.size(), 20U);
  EXPECT_EQ(engine.stats().oracleMismatches, 0) << engine.stats().firstMismatch;
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(ReferenceEngineTest, ACorruptedDraftByteIsReportedAsADraftMismatchAtEveryLaterRound) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kEagle, device()));
  ReferenceEngineOptions options = speculativeOptions();
  KVCacheRuntime* raw = runtime.get();
  uint8_t was = 0;
  uint8_t now = 0;
  int32_t page = -1;
  options.onStep = [&](int64_t step) {
    if (step != 1) {
      return;
    }
    // Draft row 5 of slot 0, layer 0, V half, byte 7.
    KVCachePool& pool = *raw->draftPool();
    page = raw->draftPageTable()->hostRow(0)[0];
    ASSERT_GE(page, 0);
    std::vector<uint8_t> bytes = test::readBytes(pool.layer(0));
    auto const offset = static_cast<std::size_t>(
        pool.pageBytes() * pool.numPages() + page * pool.pageBytes() + 5 * pool.tokenBytes() + 7);
    was = bytes[offset];
    bytes[offset] = static_cast<uint8_t>(was ^ 0x24);
    now = bytes[offset];
    test::writeBytes(pool.layer(0), bytes);
  };
  ReferenceEngine engine(*runtime, options);
  EngineRequest request;
  request.sequences = {sequence(tokenRun(30, 100), 14)};
  RequestOutcome const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  ASSERT_GE(outcome.decodeSteps, 3);
  EngineStats const& stats = engine.stats();
  // Every round after the first reads draft row 5; the base is intact.
  EXPECT_EQ(stats.draftOracleMismatches, outcome.decodeSteps - 1);
  EXPECT_EQ(stats.oracleMismatches, stats.draftOracleMismatches);
  EXPECT_EQ(stats.firstMismatch,
            fmt::format("draft slot 0 position 5 (page {}, row 5) layer 0 V: byte 7 is {:#04x}, "
                        "expected {:#04x}",
                        page, now, was));
}

// Hybrid-MTP: each request resumes at the previous prompt's endpoint; the engine restores the
// boundary hidden row and the hidden-row oracle checks it, with the draft from one row earlier.
TEST_P(ReferenceEngineTest, HybridMtpRestoresAndChecksTheBoundaryHiddenRowOfEachEndpoint) {
  RunResult const run = runWorkload(Shape::kHybridMtp, device());
  EngineStats const& stats = run.stats;
  EXPECT_EQ(stats.oracleMismatches, 0) << stats.firstMismatch;
  ASSERT_EQ(run.outcomes.size(), 3u);
  EXPECT_EQ(run.outcomes[0].sequences.at(0).prefillStart, 0);
  EXPECT_EQ(run.outcomes[1].sequences.at(0).prefillStart, 75);
  EXPECT_EQ(run.outcomes[2].sequences.at(0).prefillStart, 98);
  EXPECT_EQ(stats.reusedTokens, 75 + 98);
  EXPECT_EQ(stats.draftReusedTokens, 74 + 97);
  EXPECT_EQ(stats.hiddenEndpoints, 3);
  EXPECT_EQ(stats.hiddenRestores, 2);
  EXPECT_EQ(stats.hiddenChecks, 2);
  EXPECT_EQ(stats.hiddenMismatches, 0);
  EXPECT_GT(stats.speculativeRounds, 0);
  EXPECT_GT(stats.draftOracleChecks, 0);
  // Every execution (three prefills, every round) verified the recurrent row it resumed from.
  EXPECT_EQ(stats.recurrentChecks, 3 + stats.decodeSteps);
}

TEST_P(ReferenceEngineTest, SpeculativeWidthNeedsASpeculativeRuntime) {
  auto runtime = KVCacheRuntime::create(configOf(Shape::kReuse, device()));
  EXPECT_TRUE(test::throwsError([&] { ReferenceEngine engine(*runtime, speculativeOptions()); },
                                {"speculativeWidth 3 needs a runtime built with "
                                 "KVCacheRuntimeConfig::speculative"}));
  auto speculative = KVCacheRuntime::create(configOf(Shape::kEagle, device()));
  ReferenceEngineOptions options = speculativeOptions();
  options.speculativeWidth = ReferenceEngine::kMaxSpeculativeWidth + 1;
  EXPECT_TRUE(test::throwsError([&] { ReferenceEngine engine(*speculative, options); },
                                {"speculativeWidth 65 outside [0, 64]"}));
}

// ---------------------------------------------------------------- CPU vs GPU

class ReferenceEngineParityTest : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override {
    if (!cudaDeviceAvailable()) {
      GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
    }
  }
};

INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceEngineParityTest,
                         ::testing::Values(Shape::kReuse, Shape::kSwa, Shape::kHybrid,
                                           Shape::kEagle, Shape::kHybridMtp),
                         [](::testing::TestParamInfo<Shape> const& shape) {
                           return shapeName(shape.param) + "_gpu";
                         });

void expectSameRun(RunResult const& cpu, RunResult const& gpu) {
  EngineStats const& a = cpu.stats;
  EngineStats const& b = gpu.stats;
  EXPECT_EQ(a.requests, b.requests);
  EXPECT_EQ(a.sequences, b.sequences);
  EXPECT_EQ(a.promptTokens, b.promptTokens);
  EXPECT_EQ(a.reusedTokens, b.reusedTokens);
  EXPECT_EQ(a.prefillTokensComputed, b.prefillTokensComputed);
  EXPECT_EQ(a.decodeSteps, b.decodeSteps);
  EXPECT_EQ(a.generatedTokens, b.generatedTokens);
  EXPECT_EQ(a.joins, b.joins);
  EXPECT_EQ(a.joinRefusals, b.joinRefusals);
  EXPECT_EQ(a.oracleChecks, b.oracleChecks);
  EXPECT_EQ(a.oracleMismatches, b.oracleMismatches);
  EXPECT_EQ(a.firstMismatch, b.firstMismatch);
  EXPECT_EQ(a.lengthChecks, b.lengthChecks);
  EXPECT_EQ(a.recurrentChecks, b.recurrentChecks);
  EXPECT_EQ(a.peakPagesInUse, b.peakPagesInUse);
  EXPECT_EQ(a.peakSwaPagesPerDecodingRow, b.peakSwaPagesPerDecodingRow);
  EXPECT_EQ(a.speculativeRounds, b.speculativeRounds);
  EXPECT_EQ(a.proposedTokens, b.proposedTokens);
  EXPECT_EQ(a.acceptedTokens, b.acceptedTokens);
  EXPECT_EQ(a.draftReusedTokens, b.draftReusedTokens);
  EXPECT_EQ(a.draftOracleChecks, b.draftOracleChecks);
  EXPECT_EQ(a.draftOracleMismatches, b.draftOracleMismatches);
  EXPECT_EQ(a.peakDraftPagesInUse, b.peakDraftPagesInUse);
  EXPECT_EQ(a.hiddenRestores, b.hiddenRestores);
  EXPECT_EQ(a.hiddenEndpoints, b.hiddenEndpoints);
  EXPECT_EQ(a.hiddenChecks, b.hiddenChecks);
  EXPECT_EQ(a.hiddenMismatches, b.hiddenMismatches);
  EXPECT_TRUE(a.stepGpuNanoseconds.empty());
  EXPECT_EQ(b.stepGpuNanoseconds.size(), static_cast<std::size_t>(b.decodeSteps));
  ASSERT_EQ(cpu.outcomes.size(), gpu.outcomes.size());
  for (std::size_t r = 0; r < cpu.outcomes.size(); ++r) {
    ASSERT_EQ(cpu.outcomes[r].sequences.size(), gpu.outcomes[r].sequences.size());
    for (std::size_t s = 0; s < cpu.outcomes[r].sequences.size(); ++s) {
      EXPECT_EQ(cpu.outcomes[r].sequences[s].generated, gpu.outcomes[r].sequences[s].generated);
      EXPECT_EQ(cpu.outcomes[r].sequences[s].reason, gpu.outcomes[r].sequences[s].reason);
      EXPECT_EQ(cpu.outcomes[r].sequences[s].prefillStart,
                gpu.outcomes[r].sequences[s].prefillStart);
    }
  }
  ASSERT_EQ(cpu.bytes.size(), gpu.bytes.size());
  for (std::size_t i = 0; i < cpu.bytes.size(); ++i) {
    ASSERT_EQ(cpu.bytes[i].size(), gpu.bytes[i].size()) << "buffer " << i;
    auto const differs =
        std::mismatch(cpu.bytes[i].begin(), cpu.bytes[i].end(), gpu.bytes[i].begin());
    EXPECT_TRUE(differs.first == cpu.bytes[i].end())
        << "buffer " << i << " (KV layers of the full pool, then of the SWA and draft pools, then "
        << "recurrent state and conv rows) differs first at byte "
        << (differs.first - cpu.bytes[i].begin()) << ": cpu " << int{*differs.first} << ", gpu "
        << int{*differs.second};
  }
}

TEST_P(ReferenceEngineParityTest, TheSameWorkloadGivesTheSameFiguresAndBytesOnBothDevices) {
  RunResult const cpu = runWorkload(GetParam(), DeviceType::kCPU);
  RunResult const gpu = runWorkload(GetParam(), DeviceType::kGPU);
  EXPECT_EQ(cpu.stats.oracleMismatches, 0) << cpu.stats.firstMismatch;
  EXPECT_GT(cpu.stats.oracleChecks, 0);
  if (GetParam() == Shape::kReuse) {
    EXPECT_GT(cpu.stats.reusedTokens, 0);  // the second request reuses the shared prefix
  }
  if (GetParam() == Shape::kEagle) {  // a paired hit, rounds and draft checks
    EXPECT_GT(cpu.stats.draftReusedTokens, 0);
    EXPECT_GT(cpu.stats.speculativeRounds, 0);
    EXPECT_GT(cpu.stats.draftOracleChecks, 0);
  }
  if (GetParam() == Shape::kHybridMtp) {  // two restored boundary hidden rows, both checked
    EXPECT_EQ(cpu.stats.hiddenChecks, 2);
    EXPECT_EQ(cpu.stats.hiddenMismatches, 0);
  }
  expectSameRun(cpu, gpu);
}

TEST_P(ReferenceEngineParityTest, CorruptionIsFoundAndDescribedIdenticallyOnBothDevices) {
  // Flip one byte of the last layer of the first pool, in a page of slot 0, after step 4.
  Corruption const corrupt = [](KVCacheRuntime& runtime, int64_t step) {
    if (step != 4) {
      return;
    }
    KVCachePool& pool = runtime.fullPool() != nullptr ? *runtime.fullPool() : *runtime.swaPool();
    KVPageTable const& table =
        runtime.fullPool() != nullptr ? *runtime.fullPageTable() : *runtime.swaPageTable();
    int32_t const page = table.hostRow(0)[0];
    ASSERT_GE(page, 0);
    Tensor& layer = pool.layer(pool.numLayers() - 1);
    std::vector<uint8_t> bytes = test::readBytes(layer);
    auto const offset =
        static_cast<std::size_t>(page * pool.pageBytes() + 3 * pool.tokenBytes() + 11);
    bytes[offset] = static_cast<uint8_t>(bytes[offset] ^ 0x81);
    test::writeBytes(layer, bytes);
  };
  RunResult const cpu = runWorkload(GetParam(), DeviceType::kCPU, corrupt);
  RunResult const gpu = runWorkload(GetParam(), DeviceType::kGPU, corrupt);
  if (GetParam() == Shape::kReuse) {  // later steps read the page (the others: parity only)
    EXPECT_GT(cpu.stats.oracleMismatches, 0);
    EXPECT_NE(cpu.stats.firstMismatch.find("position 3 "), std::string::npos)
        << cpu.stats.firstMismatch;
  }
  expectSameRun(cpu, gpu);
}

}  // namespace
}  // namespace mkv
