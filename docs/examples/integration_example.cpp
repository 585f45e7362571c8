// A minimal engine loop wired to managedkv: one runtime, requests with one or more sequences,
// prefill, decode steps, compaction of finished rows, finish. The "model" is left out: where an
// engine would launch its kernels, this example only advances the token lists. Host tensors keep
// it runnable anywhere; set deviceType = kGPU and pass the engine's stream on a GPU.
#include <mkv/kv_cache_runtime.h>
#include <mkv/managed_kv_cache_request.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace example {

struct Sequence {
  std::vector<int32_t> prompt;
  int32_t maxNewTokens = 4;
};

// Serves one request; returns the tokens each sequence reused from the cache. Throws
// std::runtime_error when the request had to be aborted; its residents are back in the pool.
std::vector<int32_t> serve(mkv::KVCacheRuntime& runtime, std::vector<Sequence> const& sequences) {
  mkv::LLMGenerationRequest request;
  request.requests.resize(sequences.size());
  mkv::DecodingInferenceContext context;
  context.stream = runtime.config().stream;
  context.activeBatchSize = static_cast<int32_t>(sequences.size());
  auto releaseResidents = [&] {
    for (mkv::ResidentRef const& resident : context.residentRefs) {
      runtime.residentSlots().release(resident);
    }
  };
  for (Sequence const& sequence : sequences) {
    context.rawBatchedInputIds.push_back(sequence.prompt);
    context.residentRefs.push_back(runtime.residentSlots().acquire().value());
    context.generatedTokenIds.emplace_back();
    context.finishReasons.push_back(mkv::FinishReason::kNotFinished);
  }

  mkv::DecodingKvHeadroom const headroom{1, 0};  // vanilla decoding: one new position per step
  std::optional<mkv::ManagedKVCacheRequest> managed = mkv::ManagedKVCacheRequest::begin(
      runtime.contextCache(), runtime.swaPageManager(), request, context,
      /*speculativeRequest=*/false, headroom,
      mkv::DecodingTokenStateContract::kCommittedPlusLookahead,
      request.contextCacheCommitPolicy);
  if (!managed) {
    releaseResidents();
    throw std::runtime_error("no capacity now: a real engine keeps the request queued");
  }
  // A lifecycle call returns false when the request cannot go on: a pool is exhausted, a stream
  // synchronisation failed, or the backend is poisoned (the library has logged which). The
  // engine then ends the request, returns its residents and reports the failure; after a
  // poisoning, runtime.shutdown() recovers the backend once no request is active.
  auto require = [&](bool ok, char const* operation) {
    if (ok) {
      return;
    }
    bool const poisoned = !managed->finish();
    managed.reset();
    releaseResidents();
    throw std::runtime_error(std::string(operation) + " failed, request aborted" +
                             (poisoned ? " (backend poisoned)" : ""));
  };
  std::vector<int32_t> reused(sequences.size(), 0);
  if (auto const* starts = managed->prefillStarts()) {
    reused = *starts;
  }
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    context.effectivePrefillLengths.push_back(
        static_cast<int32_t>(sequences[i].prompt.size()) - reused[i]);
  }

  // Prefill: bind pages, map windows, run the model from prefillStarts(), sample one token each.
  require(managed->preparePrefill(), "preparePrefill");
  require(managed->prepareSwaPrefill(context.effectivePrefillLengths), "prepareSwaPrefill");
  // ... engine: prefill kernels read and write KV through runtime.fullPageTable()->deviceTable()
  require(managed->enqueuePrefillCaptures(), "enqueuePrefillCaptures");
  // ... engine: synchronise the stream, sample
  for (auto& generated : context.generatedTokenIds) {
    generated.push_back(1000 + static_cast<int32_t>(generated.size()));
  }
  require(managed->completePrefill(context, {}), "completePrefill");

  mkv::Tensor deviceMapping({runtime.config().maxBatchSize}, mkv::DataType::kInt32,
                            runtime.config().deviceType);
  std::vector<Sequence> rows = sequences;
  while (context.activeBatchSize > 0) {
    // false: no page for the next position (pool exhausted, or a row is full).
    require(managed->prepareDecodeStep(context, headroom), "prepareDecodeStep");
    // ... engine: one decode step; synchronise; sample
    for (std::size_t i = 0; i < rows.size(); ++i) {
      auto& generated = context.generatedTokenIds[i];
      generated.push_back(1000 + static_cast<int32_t>(generated.size()));
      if (static_cast<int32_t>(generated.size()) >= rows[i].maxNewTokens) {
        context.finishReasons[i] = mkv::FinishReason::kLength;
      }
    }
    require(managed->completeDecodeStep(context, {}), "completeDecodeStep");

    // Compact finished rows away (order-preserving), then release their residents.
    std::vector<int32_t> oldToNew(rows.size(), -1);
    int32_t survivors = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (context.finishReasons[i] == mkv::FinishReason::kNotFinished) {
        oldToNew[i] = survivors++;
      }
    }
    if (survivors == context.activeBatchSize) {
      continue;
    }
    require(managed->beginBatchCompaction(oldToNew, survivors, deviceMapping),
            "beginBatchCompaction");
    require(managed->completeBatchCompaction(oldToNew), "completeBatchCompaction");
    mkv::DecodingInferenceContext next;
    next.stream = context.stream;
    std::vector<Sequence> kept;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (oldToNew[i] < 0) {
        runtime.residentSlots().release(context.residentRefs[i]);
        continue;
      }
      next.rawBatchedInputIds.push_back(context.rawBatchedInputIds[i]);
      next.effectivePrefillLengths.push_back(context.effectivePrefillLengths[i]);
      next.generatedTokenIds.push_back(context.generatedTokenIds[i]);
      next.residentRefs.push_back(context.residentRefs[i]);
      next.finishReasons.push_back(context.finishReasons[i]);
      kept.push_back(rows[i]);
    }
    next.activeBatchSize = survivors;
    context = std::move(next);
    rows = std::move(kept);
  }
  require(managed->finish(), "finish");
  releaseResidents();
  return reused;
}

std::unique_ptr<mkv::KVCacheRuntime> makeRuntime() {
  mkv::KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 2;
  config.model.numKVHeads = 2;
  config.model.headDim = 16;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 2048;
  config.tokensPerPage = 64;
  config.contextReuse = true;
  config.deviceType = mkv::DeviceType::kCPU;
  return mkv::KVCacheRuntime::create(config);
}

}  // namespace example
