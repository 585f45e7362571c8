// A program built outside the managedkv tree against the installed package only. It drives one
// request by hand through ManagedKVCacheRequest (what every consumer links), then, when the
// package exports managedkv::testing, runs the reference engine with the KV oracle on both
// backends. Exits non-zero on the first wrong result.
#include <mkv/events/kv_event_publisher.h>
#include <mkv/kv_cache_runtime.h>
#include <mkv/managed_kv_cache_request.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <numeric>
#include <optional>
#include <vector>

#if MKV_CONSUMER_HAS_TESTING
#include <mkv/context_cache/context_cache_coordinator.h>
#include <mkv/context_cache/context_cache_metrics.h>
#include <mkv/testing/reference_engine.h>
#endif

namespace {

int failures = 0;

void expect(bool condition, char const* what) {
  if (!condition) {
    std::fprintf(stderr, "consumer: FAILED: %s\n", what);
    ++failures;
  }
}

constexpr int32_t kPageSize = 16;

mkv::KVCacheRuntimeConfig runtimeConfig(bool reuse) {
  mkv::KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = reuse ? 0 : 1;
  config.model.slidingWindowTokens = reuse ? 0 : 20;
  config.model.numKVHeads = 1;
  config.model.headDim = 8;
  config.maxBatchSize = 2;
  config.maxSequenceLength = 256;
  config.tokensPerPage = kPageSize;
  config.contextReuse = reuse;
  config.deviceType = mkv::DeviceType::kCPU;
  return config;
}

std::vector<int32_t> prompt(int32_t length, int32_t last) {
  std::vector<int32_t> tokens(static_cast<std::size_t>(length));
  std::iota(tokens.begin(), tokens.end(), 10);
  tokens.back() = last;
  return tokens;
}

/// One sequence through prefill and `steps` decode steps; returns its reuse length, or -1.
int32_t serveOne(mkv::KVCacheRuntime& runtime, std::vector<int32_t> const& tokens, int32_t steps) {
  mkv::LLMGenerationRequest request;
  request.requests.resize(1);
  mkv::DecodingInferenceContext context;
  context.activeBatchSize = 1;
  context.rawBatchedInputIds = {tokens};
  context.residentRefs = {runtime.residentSlots().acquire().value()};
  context.generatedTokenIds.resize(1);
  context.finishReasons = {mkv::FinishReason::kNotFinished};
  mkv::DecodingKvHeadroom const headroom{1, 0};
  std::optional<mkv::ManagedKVCacheRequest> managed = mkv::ManagedKVCacheRequest::begin(
      runtime.contextCache(), runtime.swaPageManager(), request, context, false, headroom,
      mkv::DecodingTokenStateContract::kCommittedPlusLookahead, request.contextCacheCommitPolicy);
  expect(managed.has_value(), "ManagedKVCacheRequest::begin admits one sequence");
  if (!managed) {
    return -1;
  }
  int32_t const reused = managed->prefillStarts() != nullptr ? managed->prefillStarts()->at(0) : 0;
  context.effectivePrefillLengths = {static_cast<int32_t>(tokens.size()) - reused};
  expect(managed->preparePrefill(), "preparePrefill");
  expect(managed->prepareSwaPrefill(context.effectivePrefillLengths), "prepareSwaPrefill");
  expect(managed->enqueuePrefillCaptures(), "enqueuePrefillCaptures");
  context.generatedTokenIds[0].push_back(500);
  expect(managed->completePrefill(context, {}), "completePrefill");
  for (int32_t step = 0; step < steps; ++step) {
    expect(managed->prepareDecodeStep(context, headroom), "prepareDecodeStep");
    context.generatedTokenIds[0].push_back(501 + step);
    expect(managed->completeDecodeStep(context, {}), "completeDecodeStep");
  }
  context.finishReasons[0] = mkv::FinishReason::kLength;
  expect(managed->finish(), "finish");
  runtime.residentSlots().release(context.residentRefs[0]);
  return reused;
}

void byHand() {
  mkv::KVCacheRuntimeConfig config = runtimeConfig(true);
  config.contextCache.eventQueueCapacity = 64;
  auto runtime = mkv::KVCacheRuntime::create(config);
  expect(runtime->backend() == mkv::KVCacheBackend::kContextReuse, "backend is context reuse");
  expect(serveOne(*runtime, prompt(40, 1), 3) == 0, "a cold prompt reuses nothing");
  // The KV event publisher links libzmq through the package: the first request's two published
  // blocks go out as one batch (an inproc endpoint: bound, nothing leaves the process).
  mkv::KvEventPublisherConfig events;
  events.endpoint = "inproc://managedkv-consumer";
  auto publisher = mkv::KvEventPublisher::create(events);
  expect(publisher->publish(runtime->contextCache()->drainEvents()), "publish one step's events");
  publisher->flush();
  expect(publisher->batchesPublished() == 1, "one batch published");
  // The first 32 tokens (two pages) are shared and were published at prefill.
  expect(serveOne(*runtime, prompt(40, 2), 3) == 2 * kPageSize, "a warm prompt reuses two pages");
  // The cache's metrics are public value types (the manager behind them is not installed).
  mkv::ContextCacheMetrics const metrics = runtime->contextCache()->metrics();
  expect(metrics.admittedSequences == 2 && metrics.hits == 1, "metrics: two admitted, one hit");
  expect(metrics.missCount(mkv::MissReason::kNoPrefix) == 1, "metrics: the cold prompt's miss");
  expect(runtime->residentSlots().available() == runtime->residentSlots().capacity(),
         "every resident slot is released");
  expect(runtime->shutdown(), "KVCacheRuntime::shutdown");
}

#if MKV_CONSUMER_HAS_TESTING
void withOracle(bool reuse) {
  auto runtime = mkv::KVCacheRuntime::create(runtimeConfig(reuse));
  expect(runtime->backend() ==
             (reuse ? mkv::KVCacheBackend::kContextReuse : mkv::KVCacheBackend::kBoundedSwa),
         "backend chosen by the support matrix");
  mkv::testing::ReferenceEngine engine(*runtime);
  mkv::testing::EngineRequest request;
  request.sequences.push_back(mkv::testing::EngineSequence{prompt(50, 3), 30, {}, {}, {}, -1, 1});
  request.sequences.push_back(mkv::testing::EngineSequence{prompt(37, 4), 12, {}, {}, {}, -1, 2});
  mkv::testing::RequestOutcome const outcome = engine.run(request);
  expect(outcome.admitted && !outcome.failed, "the reference engine runs the request");
  expect(outcome.sequences.size() == 2, "two sequences come back");
  for (auto const& sequence : outcome.sequences) {
    expect(sequence.reason == mkv::FinishReason::kLength, "each sequence stops at its length");
  }
  expect(engine.stats().oracleChecks > 0, "the oracle verified positions");
  expect(engine.stats().oracleMismatches == 0, "the oracle found no wrong KV byte");
  expect(runtime->shutdown(), "KVCacheRuntime::shutdown");
}
#endif

}  // namespace

int main() {
  try {
    byHand();
#if MKV_CONSUMER_HAS_TESTING
    withOracle(true);
    withOracle(false);
#endif
  } catch (std::exception const& error) {
    std::fprintf(stderr, "consumer: exception: %s\n", error.what());
    return 2;
  }
  if (failures != 0) {
    return 1;
  }
  std::printf("consumer: ok (managedkv::testing %s)\n",
              MKV_CONSUMER_HAS_TESTING ? "used" : "not exported");
  return 0;
}
