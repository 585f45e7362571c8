// End-to-end scenarios through KVCacheRuntime + ManagedKVCacheRequest + the reference engine.
#include <gtest/gtest.h>

#include <deque>
#include <numeric>

#include "mkv/kv_cache_runtime.h"
#include "mkv/testing/reference_engine.h"

namespace mkv {
namespace {

using testing::EngineRequest;
using testing::EngineSequence;
using testing::ReferenceEngine;

KVCacheRuntimeConfig smallConfig(bool reuse) {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 2;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.kvDataType = DataType::kFloat16;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 1024;
  config.tokensPerPage = 16;
  config.contextReuse = reuse;
  config.deviceType = DeviceType::kCPU;
  return config;
}

std::vector<int32_t> tokens(int32_t count, int32_t first) {
  std::vector<int32_t> result(static_cast<std::size_t>(count));
  std::iota(result.begin(), result.end(), first);
  return result;
}

TEST(ScenarioTest, MultiTurnChatReusesThePreviousTurn) {
  auto runtime = KVCacheRuntime::create(smallConfig(true));
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kContextReuse);
  ReferenceEngine engine(*runtime);
  std::vector<int32_t> history = tokens(40, 100);
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
    auto const user = tokens(13, 500 + 20 * turn);
    history.insert(history.end(), user.begin(), user.end());
  }
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_GT(engine.stats().oracleChecks, 0);
  EXPECT_TRUE(runtime->shutdown());
}

TEST(ScenarioTest, JoinsReuseASharedSystemPrompt) {
  auto runtime = KVCacheRuntime::create(smallConfig(true));
  ReferenceEngine engine(*runtime);
  std::vector<int32_t> system = tokens(64, 7);
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

TEST(ScenarioTest, BoundedSwaDecodesFarBeyondTheWindowWithConstantPages) {
  KVCacheRuntimeConfig config = smallConfig(false);
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = 2;
  config.model.slidingWindowTokens = 40;
  config.maxSequenceLength = 2048;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kBoundedSwa);
  ReferenceEngine engine(*runtime);
  EngineRequest request;
  request.sequences.push_back(EngineSequence{tokens(100, 3), 200, {}, {}, {}, -1, 0});
  request.sequences.push_back(EngineSequence{tokens(33, 5), 170, {}, {}, {}, 50, 1});
  auto const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  EXPECT_EQ(outcome.sequences[1].reason, FinishReason::kCancelled);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  int32_t const m = BoundedSwaKVPageManager::windowPages(40, 16);
  EXPECT_LE(engine.stats().peakPagesInUse, 2 * (2 * m + 1));
  EXPECT_EQ(runtime->swaPageManager()->freePageCount(), runtime->swaPageManager()->totalPageCount());
}

}  // namespace
}  // namespace mkv
