// KVCacheRuntime: configuration errors of create() (each names the field and leaves nothing
// allocated behind), the backend it chooses, and what shutdown() reports (docs/errors.md).
#include <gtest/gtest.h>

#include <functional>
#include <string_view>

#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "test_util.h"

namespace mkv {
namespace {

KVCacheRuntimeConfig validConfig() {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 1;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.maxBatchSize = 2;
  config.maxSequenceLength = 64;
  config.tokensPerPage = 16;
  config.deviceType = DeviceType::kCPU;
  return config;
}

TEST(KVCacheRuntimeTest, CreateRejectsEveryInvalidFieldByName) {
  struct Case {
    std::function<void(KVCacheRuntimeConfig&)> breakIt;
    std::initializer_list<std::string_view> fragments;
  };
  Case const cases[] = {
      {[](KVCacheRuntimeConfig& c) { c.model.numRecurrentLayers = -1; },
       {"KVCacheRuntime::create", "layer counts must be >= 0", "recurrent -1"}},
      {[](KVCacheRuntimeConfig& c) { c.model.numFullAttentionLayers = 0; },
       {"KVCacheRuntime::create", "at least one attention layer"}},
      {[](KVCacheRuntimeConfig& c) { c.model.numSlidingWindowLayers = 1; },
       {"KVCacheRuntime::create", "slidingWindowTokens > 0, got 0"}},
      {[](KVCacheRuntimeConfig& c) { c.model.numRecurrentLayers = 1; },
       {"KVCacheRuntime::create", "recurrentStateBytes > 0 (got 0)"}},
      {[](KVCacheRuntimeConfig& c) { c.maxBatchSize = 0; },
       {"KVCacheRuntime::create", "maxBatchSize must be > 0, got 0"}},
      {[](KVCacheRuntimeConfig& c) { c.maxSequenceLength = -5; },
       {"KVCacheRuntime::create", "maxSequenceLength must be > 0, got -5"}},
      {[](KVCacheRuntimeConfig& c) { c.numSwaPages = -1; },
       {"KVCacheRuntime::create", "page counts must be >= 0", "numSwaPages -1"}},
      {[](KVCacheRuntimeConfig& c) {
         c.contextReuse = true;
         c.model.numRecurrentLayers = 1;
         c.model.recurrentStateBytes = 16;
       },
       {"KVCacheRuntime::create", "context reuse for recurrent (hybrid) models"}},
      {[](KVCacheRuntimeConfig& c) {
         c.maxBatchSize = 1 << 20;
         c.maxSequenceLength = 1 << 30;
       },
       {"KVCacheRuntime::create", "overflows int32"}},
      {[](KVCacheRuntimeConfig& c) {  // Gemma-style: full layers stay identity-mapped
         c.model.numSlidingWindowLayers = 1;
         c.model.slidingWindowTokens = 16;
         c.maxSequenceLength = 1024;
         c.numPages = 100;
       },
       {"KVCacheRuntime::create", "identity-mapped", "numPages 100", "128"}},
      // Resources validate their own fields; the message names the resource.
      {[](KVCacheRuntimeConfig& c) { c.tokensPerPage = 24; },
       {"KVCachePool", "tokensPerPage must be a power of two in [16, 1024], got 24"}},
      {[](KVCacheRuntimeConfig& c) { c.contextCache.maxRecords = -1; },
       {"ContextCacheCoordinator", "maxRecords must be >= 0, got -1"}},
  };
  for (Case const& c : cases) {
    KVCacheRuntimeConfig config = validConfig();
    c.breakIt(config);
    EXPECT_TRUE(test::throwsError([&] { (void)KVCacheRuntime::create(config); }, c.fragments));
  }
}

TEST(KVCacheRuntimeTest, ShutdownReportsActiveRequestsAndSucceedsOnceTheyEnded) {
  for (bool reuse : {true, false}) {
    KVCacheRuntimeConfig config = validConfig();
    config.contextReuse = reuse;
    if (!reuse) {  // bounded SWA: sliding layers, far fewer window pages than full pages
      config.model.numFullAttentionLayers = 0;
      config.model.numSlidingWindowLayers = 1;
      config.model.slidingWindowTokens = 16;
      config.maxSequenceLength = 1024;
    }
    auto runtime = KVCacheRuntime::create(config);
    ASSERT_EQ(runtime->backend(), reuse ? KVCacheBackend::kContextReuse : KVCacheBackend::kBoundedSwa);
    DecodingInferenceContext context;
    context.activeBatchSize = 1;
    context.rawBatchedInputIds = {{1, 2, 3}};
    context.effectivePrefillLengths = {3};
    context.generatedTokenIds = {{}};
    context.residentRefs = {*runtime->residentSlots().acquire()};
    context.finishReasons = {FinishReason::kNotFinished};
    auto request = ManagedKVCacheRequest::begin(
        runtime->contextCache(), runtime->swaPageManager(), LLMGenerationRequest{}, context,
        false, DecodingKvHeadroom{1, 0}, DecodingTokenStateContract::kCommittedPlusLookahead,
        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
    ASSERT_TRUE(request.has_value());
    EXPECT_FALSE(runtime->shutdown()) << "a request is still active";
    EXPECT_TRUE(request->finish());
    EXPECT_TRUE(runtime->shutdown());
  }
}

}  // namespace
}  // namespace mkv
