// End-to-end scenarios through KVCacheRuntime + ManagedKVCacheRequest, driven by the reference
// engine or call by call (runtime_test_rig.h), with the KV oracle checking every position read.
// Every scenario runs on host tensors and on GPU tensors (the kGPU instances skip without a CUDA
// device).
#include <gtest/gtest.h>

#include <cstring>
#include <deque>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>

#include "context_cache/context_cache_manager.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/testing/reference_engine.h"
#include "runtime_test_rig.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv {
using test::concatenated;
using test::tokenRun;
namespace {

using runtime_test::Backend;
using runtime_test::BackendState;
using runtime_test::configFor;
using runtime_test::FacadeDriver;
using runtime_test::RuntimeCase;
using runtime_test::RuntimeCaseTest;
using runtime_test::RuntimeRig;
using testing::EngineRequest;
using testing::EngineSequence;
using testing::EngineStats;
using testing::ReferenceEngine;
using AdmitStatus = AdmitSequenceStatus;

KVCacheRuntimeConfig smallConfig(bool reuse, DeviceType device) {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 2;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.kvDataType = DataType::kFloat16;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 1024;
  config.tokensPerPage = 16;
  config.contextReuse = reuse;
  config.deviceType = device;
  return config;
}

/// Runs one single-sequence request; returns its reused tokens.
int32_t runOnce(ReferenceEngine& engine, EngineRequest request) {
  auto const outcome = engine.run(request);
  EXPECT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  return outcome.sequences.at(0).prefillStart;
}

EngineRequest single(std::vector<int32_t> prompt, std::string lora = {}) {
  EngineRequest request;
  request.loraWeightsName = std::move(lora);
  request.sequences.push_back(EngineSequence{std::move(prompt), 3, {}, {}, {}, -1, 0});
  return request;
}

class ScenarioTest : public test::DeviceTest {};

INSTANTIATE_TEST_SUITE_P(Devices, ScenarioTest, test::allDeviceTypes(), test::deviceName);

TEST_P(ScenarioTest, MultiTurnChatReusesThePreviousTurn) {
  auto runtime = KVCacheRuntime::create(smallConfig(true, device()));
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kContextReuse);
  ReferenceEngine engine(*runtime);
  std::vector<int32_t> history = tokenRun(40, 100);
  int32_t previousLength = 0;
  for (int turn = 0; turn < 4; ++turn) {
    EngineRequest request;
    request.sequences.push_back(EngineSequence{history, 6, {}, {}, {}, -1, turn});
    auto const outcome = engine.run(request);
    ASSERT_TRUE(outcome.admitted);
    ASSERT_FALSE(outcome.failed);
    auto const& sequence = outcome.sequences.at(0);
    // The previous turn's prompt plus its generated tokens (all with KV) were published; reuse
    // is page-aligned.
    EXPECT_EQ(sequence.prefillStart, (previousLength / 16) * 16) << "turn " << turn;
    EXPECT_EQ(sequence.reason, FinishReason::kLength);
    previousLength = static_cast<int32_t>(history.size() + sequence.generated.size()) - 1;
    history.insert(history.end(), sequence.generated.begin(), sequence.generated.end());
    auto const user = tokenRun(13, 500 + 20 * turn);
    history.insert(history.end(), user.begin(), user.end());
  }
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_GT(engine.stats().oracleChecks, 0);
  EXPECT_TRUE(runtime->shutdown());
}

KVCacheRuntimeConfig hybridConfig(int32_t recurrentSlots, int32_t partialSlots, DeviceType device) {
  KVCacheRuntimeConfig config = smallConfig(true, device);
  config.maxBatchSize = 3;
  config.maxSequenceLength = 256;
  config.model.numRecurrentLayers = 2;
  config.model.recurrentStateBytes = 24;
  config.model.recurrentConvBytes = 8;
  config.contextCache.recurrentSnapshotPoolBytes = recurrentSlots * 2 * (24 + 8);
  // 2 layers x K and V x 16 tokens x 1 head x 4 x fp16 per partial page.
  config.contextCache.partialKvSnapshotPoolBytes = partialSlots * 2 * 2 * 16 * 4 * 2;
  return config;
}

TEST_P(ScenarioTest, HybridMultiTurnChatResumesFromTheExactEndOfThePreviousTurn) {
  auto runtime = KVCacheRuntime::create(hybridConfig(8, 8, device()));
  ASSERT_EQ(runtime->contextCache()->profile().baseStateKind, BaseStateKind::kHybrid);
  ReferenceEngine engine(*runtime);
  std::vector<int32_t> history = tokenRun(40, 100);
  int32_t previousLength = 0;
  for (int turn = 0; turn < 4; ++turn) {
    EngineRequest request;
    request.sequences.push_back(EngineSequence{history, 6, {}, {}, {}, -1, turn});
    auto const outcome = engine.run(request);
    ASSERT_TRUE(outcome.admitted);
    ASSERT_FALSE(outcome.failed);
    auto const& sequence = outcome.sequences.at(0);
    // The decode-end checkpoint of the previous turn: prompt + generated tokens with KV, not
    // rounded down to a page.
    EXPECT_EQ(sequence.prefillStart, previousLength) << "turn " << turn;
    previousLength = static_cast<int32_t>(history.size() + sequence.generated.size()) - 1;
    history.insert(history.end(), sequence.generated.begin(), sequence.generated.end());
    auto const user = tokenRun(13, 500 + 20 * turn);
    history.insert(history.end(), user.begin(), user.end());
  }
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_GE(engine.stats().recurrentChecks, 4 * 6) << "every execution resumed a checked state";
  EXPECT_EQ(runtime->contextCache()->counters().checkpointRestores, 3u);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(ScenarioTest, RandomHybridWorkloadsNeverCorruptKvOrRecurrentState) {
  // Tight pools: 40 pages of 16 tokens, 5 recurrent and 3 partial snapshot slots, 10 records, so
  // admissions evict, captures are skipped under snapshot pressure and checkpoints end mid-page.
  KVCacheRuntimeConfig config = hybridConfig(5, 3, device());
  config.numPages = 40;
  config.contextCache.maxRecords = 10;
  auto runtime = KVCacheRuntime::create(config);
  testing::ReferenceEngineOptions options;
  options.seed = 7;
  options.eosEvery = 9;
  ReferenceEngine engine(*runtime, options);
  std::mt19937 rng(2024);
  auto below = [&rng](int32_t n) { return static_cast<int32_t>(rng() % static_cast<uint32_t>(n)); };
  std::vector<std::vector<int32_t>> histories{tokenRun(20, 1), tokenRun(45, 300), tokenRun(9, 900)};
  int64_t admitted = 0;
  for (int request = 0; request < 60; ++request) {
    EngineRequest engineRequest;
    int32_t const rows = 1 + below(3);
    for (int32_t row = 0; row < rows; ++row) {
      auto& history = histories[static_cast<std::size_t>(below(3))];
      // Continue a conversation, or branch off one of its prefixes.
      auto const size = static_cast<int32_t>(history.size());
      int32_t const kept = below(2) == 0 ? size : 1 + below(size);
      std::vector<int32_t> prompt(history.begin(), history.begin() + kept);
      std::vector<int32_t> const more = tokenRun(1 + below(20), 2000 + 37 * request + row);
      prompt.insert(prompt.end(), more.begin(), more.end());
      prompt.resize(std::min<std::size_t>(prompt.size(), 200));
      EngineSequence sequence{prompt, 1 + below(8), {}, {}, {}, -1, request};
      if (below(6) == 0) {
        sequence.cancelAtStep = below(3);
      }
      if (below(8) == 0) {
        sequence.lookupPolicy = ContextCacheLookupPolicy::kBypass;
      }
      engineRequest.sequences.push_back(std::move(sequence));
    }
    auto const outcome = engine.run(engineRequest);
    if (!outcome.admitted) {
      continue;  // the pools cannot hold the batch now
    }
    ++admitted;
    for (auto const& sequence : outcome.sequences) {
      if (sequence.prompt.size() + sequence.generated.size() < 200 && below(2) == 0) {
        auto& history = histories[static_cast<std::size_t>(below(3))];
        history = sequence.prompt;
        history.insert(history.end(), sequence.generated.begin(), sequence.generated.end());
      }
    }
  }
  EngineStats const& stats = engine.stats();
  EXPECT_GT(admitted, 40);
  EXPECT_EQ(stats.oracleMismatches, 0) << stats.firstMismatch;
  EXPECT_GT(stats.recurrentChecks, 0);
  EXPECT_GT(stats.reusedTokens, 0);
  ContextCacheCoordinatorCounters const& counters = runtime->contextCache()->counters();
  EXPECT_GE(counters.checkpointRestores, 10u);
  EXPECT_GT(counters.snapshotPressureSkips, 0u) << "pinned restore sources left no slot";
  EXPECT_GT(runtime->contextCache()->metrics().evictedRecords, 0u);
  EXPECT_TRUE(runtime->shutdown());
  ContextCacheManager const& manager = runtime->contextCache()->manager();
  EXPECT_EQ(manager.liveLeaseCount(), 0);
  for (ResourceType type : kAllResourceTypes) {
    for (int32_t i = 0; i < manager.pools().capacity(type); ++i) {
      EXPECT_EQ(manager.pools().activeRefs({type, i}), 0);
    }
  }
}

TEST_P(ScenarioTest, JoinsReuseASharedSystemPrompt) {
  auto runtime = KVCacheRuntime::create(smallConfig(true, device()));
  ReferenceEngine engine(*runtime);
  std::vector<int32_t> system = tokenRun(64, 7);
  EngineRequest request;
  auto first = system;
  first.push_back(9000);
  request.sequences.push_back(EngineSequence{first, 20, {}, {}, {}, -1, 0});
  std::deque<EngineSequence> queue;
  for (int i = 1; i <= 6; ++i) {
    auto prompt = system;
    prompt.push_back(9000 + i);
    prompt.push_back(9100 + i);
    queue.push_back(EngineSequence{prompt, 3 + i, {}, {}, {}, -1, i});
  }
  auto const outcome = engine.run(request, &queue);
  EXPECT_TRUE(queue.empty());
  ASSERT_EQ(outcome.sequences.size(), 7u);
  for (std::size_t i = 1; i < outcome.sequences.size(); ++i) {
    EXPECT_TRUE(outcome.sequences[i].joinedInFlight);
    EXPECT_EQ(outcome.sequences[i].prefillStart, 64) << i;
  }
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(ScenarioTest, BoundedSwaDecodesFarBeyondTheWindowWithConstantPages) {
  KVCacheRuntimeConfig config = smallConfig(false, device());
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = 2;
  config.model.slidingWindowTokens = 40;
  config.maxSequenceLength = 2048;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kBoundedSwa);
  ReferenceEngine engine(*runtime);
  EngineRequest request;
  request.sequences.push_back(EngineSequence{tokenRun(100, 3), 200, {}, {}, {}, -1, 0});
  request.sequences.push_back(EngineSequence{tokenRun(33, 5), 170, {}, {}, {}, 50, 1});
  auto const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  EXPECT_EQ(outcome.sequences[1].reason, FinishReason::kCancelled);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  int32_t const m = BoundedSwaKVPageManager::windowPages(40, 16);
  EXPECT_LE(engine.stats().peakPagesInUse, 2 * (2 * m + 1));
  EXPECT_EQ(runtime->swaPageManager()->freePageCount(),
            runtime->swaPageManager()->totalPageCount());
}

TEST_P(ScenarioTest, TheLoraAdapterIsPartOfTheReuseIdentity) {
  auto runtime = KVCacheRuntime::create(smallConfig(true, device()));
  ReferenceEngine engine(*runtime);                      // its oracle keys KV on the adapter too
  std::vector<int32_t> const system = tokenRun(64, 10);  // 4 pages
  EXPECT_EQ(runOnce(engine, single(concatenated(system, {1}), "adapter-a")), 0);
  EXPECT_EQ(runOnce(engine, single(concatenated(system, {2}), "adapter-b")), 0)
      << "another adapter";
  EXPECT_EQ(runOnce(engine, single(concatenated(system, {3}))), 0)
      << "the base model is another one";
  EXPECT_EQ(runOnce(engine, single(concatenated(system, {4}), "adapter-a")), 64);
  EXPECT_EQ(runOnce(engine, single(concatenated(system, {5}), "adapter-b")), 64);
  EXPECT_EQ(runOnce(engine, single(concatenated(system, {6}))), 64);
  ContextCacheMetrics const metrics = runtime->contextCache()->metrics();
  EXPECT_EQ(metrics.missCount(MissReason::kLoraMismatch), 2u);
  EXPECT_EQ(engine.stats().reusedTokens, 3 * 64);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(ScenarioTest, HostImagePixelsArePartOfTheReuseIdentity) {
  constexpr int32_t kImageToken = 32000;
  // Host pixels, whatever the runtime's device: only host RGB is hashed into the identity.
  auto image = [](uint8_t seed) {
    auto pixels = std::make_shared<Tensor>(Coords{4, 4, 3}, DataType::kUInt8, DeviceType::kCPU);
    auto* bytes = static_cast<uint8_t*>(pixels->rawPointer());
    for (int i = 0; i < 48; ++i) {
      bytes[i] = static_cast<uint8_t>(seed + 7 * i);
    }
    return imageUtils::ImageData{pixels, 4, 4, 3};
  };
  // 40 text tokens, an image run at [40, 60), 40 text tokens: pages 0 and 1 are text only.
  std::vector<int32_t> const prompt = concatenated(
      concatenated(tokenRun(40, 10), std::vector<int32_t>(20, kImageToken)), tokenRun(40, 200));
  auto withImage = [&](imageUtils::ImageData const& pixels) {
    EngineRequest request = single(prompt);
    request.mediaTokenIds = {kImageToken};
    request.sequences[0].images = {pixels};
    return request;
  };
  auto runtime = KVCacheRuntime::create(smallConfig(true, device()));
  ReferenceEngine engine(*runtime);  // its oracle keys image positions on the pixels
  EXPECT_EQ(runOnce(engine, withImage(image(1))), 0);
  EXPECT_EQ(runOnce(engine, withImage(image(1))), 96) << "same image: every full page";
  EXPECT_EQ(runOnce(engine, withImage(image(2))), 32) << "other pixels: only the text before";
  EXPECT_EQ(runOnce(engine, withImage(image(1))), 96) << "the first image is still cached";
  // An equal copy of the pixels is the same image.
  imageUtils::ImageData copy = image(9);
  std::memcpy(copy.buffer->rawPointer(), image(1).buffer->rawPointer(), 48);
  EXPECT_EQ(runOnce(engine, withImage(copy)), 96);
  EXPECT_EQ(runtime->contextCache()->metrics().bypasses, 0u) << "host RGB images are media-aware";
  if (device() == DeviceType::kGPU) {
    // The same pixels in GPU memory cannot be hashed on the host: the request runs on
    // context-cache bypass (no reuse) rather than failing.
    imageUtils::ImageData onDevice = image(1);
    onDevice.buffer = std::make_shared<Tensor>(Coords{4, 4, 3}, DataType::kUInt8, device());
    test::writeBytes(*onDevice.buffer, test::readBytes(*image(1).buffer));
    ASSERT_EQ(onDevice.data(), nullptr);
    EXPECT_EQ(runOnce(engine, withImage(onDevice)), 0);
    EXPECT_EQ(runtime->contextCache()->metrics().bypasses, 1u);
    EXPECT_EQ(runOnce(engine, withImage(image(1))), 96) << "the host image is still cached";
  }
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(ScenarioTest, ARetractedJoinLeavesNoTraceAndTheRowJoinsAgain) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  FacadeDriver driver(rig);
  std::vector<int32_t> const system = tokenRun(32, 10);  // 2 pages, published by the prefill
  driver.add(concatenated(system, tokenRun(9, 100)));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.decode());
  KVPageTable const& table = *rig.runtime().fullPageTable();
  CacheSlot const founder = driver.rows[0].resident.slot;
  std::vector<int32_t> const joiner = concatenated(system, tokenRun(5, 400));  // 37 tokens

  BackendState const before = rig.observe();
  ASSERT_EQ(driver.admit(joiner), AdmitStatus::kAdmitted);
  CacheSlot const slot = driver.rows[1].resident.slot;
  EXPECT_EQ(*driver.facade().prefillStarts(), (std::vector<int32_t>{0, 32}));
  EXPECT_EQ(table.liveEntryCount(slot), 3) << "37 tokens + 1 headroom";
  EXPECT_EQ(table.entry(slot, 0), table.entry(founder, 0)) << "the shared prefix is reused";
  EXPECT_EQ(table.entry(slot, 1), table.entry(founder, 1));
  EXPECT_EQ(rig.freePages(), before.freePages - 1) << "one private page";
  // Retracting the never-finalised admission restores everything it touched.
  ASSERT_TRUE(driver.retractNewest());
  rig.expectUnchanged(before, /*ringOrder=*/false);
  EXPECT_EQ(*driver.facade().prefillStarts(), std::vector<int32_t>{0});
  EXPECT_EQ(rig.runtime().contextCache()->counters().retractedAdmissions, 1u);
  driver.verify();

  // The same sequence is admitted again and joins: its reused prefix and its own KV verified.
  ASSERT_EQ(driver.admit(joiner), AdmitStatus::kAdmitted);
  EXPECT_EQ(driver.rows[1].prefillStart, 32);
  ASSERT_TRUE(driver.seatNewest());
  driver.verify();
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(driver.decode());
    driver.verify();
  }
  EXPECT_EQ(driver.generated(1).size(), 5u);
  EXPECT_TRUE(driver.finish());
  EXPECT_FALSE(rig.poisoned());
}

TEST_P(ScenarioTest, RetractingAFinalisedJoinReturnsFalseAndChangesNothing) {
  RuntimeRig rig(configFor(Backend::kContextReuse, device()));
  {
    FacadeDriver driver(rig);
    driver.add(tokenRun(20, 10));
    ASSERT_TRUE(driver.begin());
    ASSERT_TRUE(driver.prefill());
    ASSERT_EQ(driver.admit(tokenRun(20, 500)), AdmitStatus::kAdmitted);
    ASSERT_TRUE(driver.seatNewest());
    // Only a never-finalised admission can be undone: with a seated newest row there is
    // nothing to undo, so the noexcept retraction returns false and changes nothing (no poison).
    BackendState const before = rig.observe();
    EXPECT_FALSE(driver.facade().retractSequenceAdmission());
    rig.expectUnchanged(before);
    EXPECT_FALSE(rig.poisoned());
    EXPECT_EQ(driver.rows.size(), 2u);
    ASSERT_TRUE(driver.decode());
    driver.verify();
    EXPECT_TRUE(driver.finish());
  }
  EXPECT_TRUE(rig.runtime().shutdown());
  rig.expectIdle();
}

TEST_P(ScenarioTest, CancelledRowsAreCompactedAwayAndOnlyFinishedOnesPublish) {
  auto runtime = KVCacheRuntime::create(smallConfig(true, device()));
  ReferenceEngine engine(*runtime);
  // 30-token prompts: the prefill publishes one full page, decode fills a second one.
  EngineRequest request;
  request.sequences.push_back(EngineSequence{tokenRun(30, 100), 12, {}, {}, {}, -1, 0});
  request.sequences.push_back(EngineSequence{tokenRun(30, 200), 12, {}, {}, {}, 2, 1});
  request.sequences.push_back(EngineSequence{tokenRun(30, 300), 5, {}, {}, {}, -1, 2});
  request.sequences.push_back(EngineSequence{tokenRun(30, 400), 12, {}, {}, {}, 6, 3});
  auto const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  ASSERT_EQ(outcome.sequences.size(), 4u);
  FinishReason const reasons[] = {FinishReason::kLength, FinishReason::kCancelled,
                                  FinishReason::kLength, FinishReason::kCancelled};
  std::size_t const generated[] = {12, 3, 5, 7};  // cancelled before step k: 1 + k tokens
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(outcome.sequences[i].reason, reasons[i]) << i;
    EXPECT_EQ(outcome.sequences[i].generated.size(), generated[i]) << i;
  }
  EXPECT_EQ(outcome.decodeSteps, 11) << "the survivor decodes on after each compaction";
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  // Device KV lengths checked per row: 4 after the prefill, the rows in the batch at each step
  // (4 4 4 3 2 2 2 1 1 1 1: a cancelled row leaves at the next compaction), and the survivors
  // after each compaction (3 2 1 0).
  EXPECT_EQ(engine.stats().lengthChecks, 4 + 25 + 6);
  // Replaying prompt + generated tokens: finished rows published the blocks their decode filled,
  // cancelled rows only their prompt's full page (the reused KV is verified by the oracle).
  int32_t const reused[] = {32, 16, 32, 16};
  for (std::size_t i = 0; i < 4; ++i) {
    auto const& sequence = outcome.sequences[i];
    EXPECT_EQ(runOnce(engine, single(concatenated(sequence.prompt, sequence.generated))), reused[i])
        << i;
  }
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_TRUE(runtime->shutdown());
}

class CompactionScenarioTest : public RuntimeCaseTest {};

INSTANTIATE_TEST_SUITE_P(Backends, CompactionScenarioTest,
                         ::testing::ValuesIn(runtime_test::everyBackendCase()),
                         runtime_test::runtimeCaseName);

TEST_P(CompactionScenarioTest, ACancelledRowLeavesAndTheSurvivorsKeepTheirRows) {
  RuntimeRig rig(configFor(backend(), device()));
  bool const bounded = backend() == Backend::kBoundedSwa;
  KVPageTable const& table =
      bounded ? *rig.runtime().swaPageTable() : *rig.runtime().fullPageTable();
  FacadeDriver driver(rig);
  driver.add(tokenRun(40, 100));
  driver.add(tokenRun(23, 300));
  driver.add(tokenRun(37, 500));
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  driver.cancel(1);
  ASSERT_TRUE(driver.decode());  // rows 0 and 2 only
  driver.verify();
  EXPECT_EQ(driver.generated(1).size(), 3u);
  auto rowOf = [&](CacheSlot slot) {
    std::span<int32_t const> const row = table.hostRow(slot);
    return std::vector<int32_t>(row.begin(), row.end());
  };
  CacheSlot const dropped = driver.rows[1].resident.slot;
  CacheSlot const survivors[] = {driver.rows[0].resident.slot, driver.rows[2].resident.slot};
  std::vector<int32_t> const rowsBefore[] = {rowOf(survivors[0]), rowOf(survivors[1])};
  int32_t const droppedPages = table.liveEntryCount(dropped);
  // Sliding-window reuse: the dropped row's window pages in the sliding pool (no other row
  // shares them: the prompts differ).
  KVPageTable const* slidingTable = rig.slidingReuse() ? rig.runtime().swaPageTable() : nullptr;
  int32_t const droppedWindow = slidingTable ? slidingTable->liveEntryCount(dropped) : 0;
  int32_t const held = rig.heldPages();
  ASSERT_GT(droppedPages, 0);
  ASSERT_EQ(droppedWindow > 0, rig.slidingReuse());

  ASSERT_TRUE(driver.compact({0, -1, 1}));
  EXPECT_EQ(table.liveEntryCount(dropped), 0) << "the dropped row is cleared";
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(rowOf(survivors[i]), rowsBefore[i]) << "rows never move";
  }
  if (bounded) {
    // Every sequence decodes in M + 1 pages: the mapped window plus its reserve.
    EXPECT_EQ(held - rig.heldPages(), rig.runtime().swaPageManager()->decodePagesPerSequence());
  } else {
    // Sliding-window reuse also gives back the dropped row's mapped window pages and its spare.
    int32_t const droppedSliding = rig.slidingReuse() ? droppedWindow + 1 : 0;
    EXPECT_EQ(held - rig.heldPages(), droppedPages + droppedSliding);
    EXPECT_EQ(*driver.facade().prefillStarts(), (std::vector<int32_t>{0, 0}));
  }
  if (slidingTable != nullptr) {
    EXPECT_EQ(slidingTable->liveEntryCount(dropped), 0) << "the dropped row's window is cleared";
  }
  EXPECT_EQ(driver.context.activeBatchSize, 2);
  driver.verify();                         // KV and the compacted KV lengths
  for (int step = 0; step < 30; ++step) {  // the survivors decode on, past the window
    ASSERT_TRUE(driver.decode());
    driver.verify();
  }
  EXPECT_EQ(driver.generated(0).size(), 34u);
  EXPECT_TRUE(driver.finish());
  EXPECT_EQ(rig.heldPages(), 0);
}

}  // namespace
}  // namespace mkv
