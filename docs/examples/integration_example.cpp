// A minimal engine loop wired to managedkv: one runtime, requests with one or more sequences,
// prefill, decode steps with the KV lengths the engine keeps, compaction of finished rows,
// in-flight admission of waiting sequences (admit, the joiner's prefill, finalize, or retract),
// finish. The "model" is left out: where an engine would launch its kernels, this example only
// advances the token lists and the KV lengths. Host tensors keep it runnable anywhere; set
// deviceType = kGPU and pass the engine's stream on a GPU.
#include <mkv/kv_cache_pool.h>
#include <mkv/kv_cache_runtime.h>
#include <mkv/managed_kv_cache_request.h>

#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace example {

struct Sequence {
  std::vector<int32_t> prompt;
  int32_t maxNewTokens = 4;
};

class Engine {
 public:
  explicit Engine(mkv::KVCacheRuntime& runtime) : mRuntime(runtime) {}

  // Serves one request: `sequences` start together; `waiting` join it in flight, one per decode
  // step, while the runtime supports seated admission (else they are left out). Returns the
  // tokens each sequence reused from the cache, founders first, then joiners in admission order.
  // Throws std::runtime_error when the request had to be aborted; its residents are back in the
  // pool, or parked until shutdown() when their rows are quarantined.
  std::vector<int32_t> serve(std::vector<Sequence> const& sequences,
                             std::vector<Sequence> waiting = {});

  // Drains the backend's quarantine, then returns the parked residents to the pool.
  bool shutdown() {
    if (!mRuntime.shutdown()) {
      return false;
    }
    for (mkv::ResidentRef const& resident : mParked) {
      mRuntime.residentSlots().release(resident);
    }
    mParked.clear();
    return true;
  }

  // Residents whose rows a failed synchronisation quarantined (released by shutdown()).
  std::size_t parkedResidents() const { return mParked.size(); }

  // Prefill tokens the engine computes per step for joiners; a joiner whose prefill would exceed
  // what is left is retracted and tried again at the next step.
  int32_t joinerPrefillBudget = 1 << 20;

 private:
  // The device KV lengths are per execution row. The library writes them at preparePrefill (the
  // reuse lengths) and at batch compaction (compacted); the engine writes them after each
  // execution and grows or shrinks the tensor when a joiner is seated or retracted.
  void writeLength(int32_t row, int32_t length, cudaStream_t stream) {
    for (mkv::KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool()}) {
      if (pool != nullptr) {
        pool->writeLengths(row, std::span<int32_t const>(&length, 1), stream);
      }
    }
  }
  void setActiveRows(int32_t rows) {
    for (mkv::KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool()}) {
      if (pool != nullptr) {
        pool->setActiveBatchSize(rows);
      }
    }
  }
  // After finish(): a resident whose row is quarantined must not be reused before shutdown().
  void releaseResidents(std::vector<mkv::ResidentRef> const& residents) {
    for (mkv::ResidentRef const& resident : residents) {
      if (mRuntime.residentRowState(resident.slot) == mkv::ResidentRowState::kQuarantined) {
        mParked.push_back(resident);
      } else {
        mRuntime.residentSlots().release(resident);
      }
    }
  }

  mkv::KVCacheRuntime& mRuntime;
  std::vector<mkv::ResidentRef> mParked;
};

std::vector<int32_t> Engine::serve(std::vector<Sequence> const& sequences,
                                   std::vector<Sequence> waiting) {
  mkv::LLMGenerationRequest request;
  request.requests.resize(sequences.size());
  mkv::DecodingInferenceContext context;
  context.stream = mRuntime.config().stream;
  context.activeBatchSize = static_cast<int32_t>(sequences.size());
  for (Sequence const& sequence : sequences) {
    context.rawBatchedInputIds.push_back(sequence.prompt);
    context.residentRefs.push_back(mRuntime.residentSlots().acquire().value());
    context.generatedTokenIds.emplace_back();
    context.finishReasons.push_back(mkv::FinishReason::kNotFinished);
  }

  mkv::DecodingKvHeadroom const headroom{1, 0};  // vanilla decoding: one new position per step
  std::optional<mkv::ManagedKVCacheRequest> managed = mkv::ManagedKVCacheRequest::begin(
      mRuntime.contextCache(), mRuntime.swaPageManager(), request, context,
      /*speculativeRequest=*/false, headroom,
      mkv::DecodingTokenStateContract::kCommittedPlusLookahead, request.contextCacheCommitPolicy);
  if (!managed) {
    releaseResidents(context.residentRefs);
    throw std::runtime_error("no capacity now: a real engine keeps the request queued");
  }
  // A lifecycle call returns false when the request cannot go on: a pool is exhausted, a stream
  // synchronisation failed, or the backend is poisoned (the library has logged which). The
  // engine then ends the request, returns its residents (parking quarantined ones until
  // shutdown) and reports the failure; after a poisoning, shutdown() recovers the backend once
  // no request is active.
  auto require = [&](bool ok, char const* operation) {
    if (ok) {
      return;
    }
    bool const poisoned = !managed->finish();
    managed.reset();
    releaseResidents(context.residentRefs);
    throw std::runtime_error(std::string(operation) + " failed, request aborted" +
                             (poisoned ? " (backend poisoned)" : ""));
  };
  std::vector<int32_t> reused(sequences.size(), 0);
  if (auto const* starts = managed->prefillStarts()) {
    reused = *starts;
  }
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    context.effectivePrefillLengths.push_back(static_cast<int32_t>(sequences[i].prompt.size()) -
                                              reused[i]);
  }

  // Prefill: bind pages, map windows, run the model from prefillStarts(), sample one token each.
  // preparePrefill set the device KV lengths to the reuse lengths; the engine's prefill
  // materialises the rest of each prompt, so it writes the prompt lengths.
  require(managed->preparePrefill(), "preparePrefill");
  require(managed->prepareSwaPrefill(context.effectivePrefillLengths), "prepareSwaPrefill");
  // ... engine: prefill kernels read and write KV through runtime.fullPageTable()->deviceTable()
  std::vector<int32_t> kvLengths;  // the engine's copy of the device KV lengths, per row
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    kvLengths.push_back(static_cast<int32_t>(sequences[i].prompt.size()));
    writeLength(static_cast<int32_t>(i), kvLengths[i], context.stream);
  }
  require(managed->enqueuePrefillCaptures(), "enqueuePrefillCaptures");
  // ... engine: synchronise the stream, sample
  for (auto& generated : context.generatedTokenIds) {
    generated.push_back(1000 + static_cast<int32_t>(generated.size()));
  }
  require(managed->completePrefill(context, {}), "completePrefill");

  mkv::Tensor deviceMapping({mRuntime.config().maxBatchSize}, mkv::DataType::kInt32,
                            mRuntime.config().deviceType);
  std::vector<Sequence> rows = sequences;
  if (!mRuntime.supportsSeatedAdmission()) {
    waiting.clear();
  }
  while (context.activeBatchSize > 0) {
    // false: no page for the next position (pool exhausted, or a row is full).
    require(managed->prepareDecodeStep(context, headroom), "prepareDecodeStep");
    // ... engine: one decode step writes the KV of each row's lookahead token; synchronise; sample
    for (std::size_t i = 0; i < rows.size(); ++i) {
      auto& generated = context.generatedTokenIds[i];
      writeLength(static_cast<int32_t>(i), ++kvLengths[i], context.stream);
      generated.push_back(1000 + static_cast<int32_t>(generated.size()));
      if (static_cast<int32_t>(generated.size()) >= rows[i].maxNewTokens) {
        context.finishReasons[i] = mkv::FinishReason::kLength;
      }
    }
    require(managed->completeDecodeStep(context, {}), "completeDecodeStep");

    // Compact finished rows away (order-preserving), then release their residents. The library
    // compacts the device KV lengths; the engine compacts its own per-row vectors the same way.
    std::vector<int32_t> oldToNew(rows.size(), -1);
    int32_t survivors = 0;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      if (context.finishReasons[i] == mkv::FinishReason::kNotFinished) {
        oldToNew[i] = survivors++;
      }
    }
    if (survivors < context.activeBatchSize) {
      require(managed->beginBatchCompaction(oldToNew, survivors, deviceMapping),
              "beginBatchCompaction");
      require(managed->completeBatchCompaction(oldToNew), "completeBatchCompaction");
      mkv::DecodingInferenceContext next;
      next.stream = context.stream;
      std::vector<Sequence> kept;
      std::vector<int32_t> keptLengths;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        if (oldToNew[i] < 0) {
          mRuntime.residentSlots().release(context.residentRefs[i]);
          continue;
        }
        next.rawBatchedInputIds.push_back(context.rawBatchedInputIds[i]);
        next.effectivePrefillLengths.push_back(context.effectivePrefillLengths[i]);
        next.generatedTokenIds.push_back(context.generatedTokenIds[i]);
        next.residentRefs.push_back(context.residentRefs[i]);
        next.finishReasons.push_back(context.finishReasons[i]);
        kept.push_back(rows[i]);
        keptLengths.push_back(kvLengths[i]);
      }
      next.activeBatchSize = survivors;
      context = std::move(next);
      rows = std::move(kept);
      kvLengths = std::move(keptLengths);
    }

    // In-flight admission of the next waiting sequence, between steps (nothing pending).
    std::optional<mkv::ResidentRef> resident;
    if (!waiting.empty() && context.activeBatchSize > 0 &&
        context.activeBatchSize < mRuntime.config().maxBatchSize) {
      resident = mRuntime.residentSlots().acquire();
    }
    if (!resident) {
      continue;
    }
    Sequence const joiner = waiting.front();
    int32_t prefillStart = 0;
    mkv::AdmitSequenceStatus const admitted = managed->admitSequence(
        joiner.prompt, context.loraWeightsName, headroom, prefillStart, *resident, context.stream);
    if (admitted != mkv::AdmitSequenceStatus::kAdmitted) {
      mRuntime.residentSlots().release(*resident);
      // kNoCapacity: transient pool pressure, the joiner waits for a later step.
      require(admitted == mkv::AdmitSequenceStatus::kNoCapacity, "admitSequence");
      continue;
    }
    // The joiner is the last row. Its pages are bound with prefillStart tokens of reused KV: the
    // engine grows the KV-length tensor for it at once (a compaction needs every row in it).
    auto const row = static_cast<int32_t>(rows.size());
    setActiveRows(row + 1);
    writeLength(row, prefillStart, context.stream);
    auto const promptLength = static_cast<int32_t>(joiner.prompt.size());
    if (promptLength - prefillStart > joinerPrefillBudget) {
      // Its prefill does not fit this step: undo the admission (nothing ran for it yet) and
      // shrink the tensor again; the joiner stays waiting.
      bool const retracted = managed->retractSequenceAdmission();
      setActiveRows(row);
      releaseResidents({*resident});
      require(retracted, "retractSequenceAdmission");
      continue;
    }
    waiting.erase(waiting.begin());
    context.rawBatchedInputIds.push_back(joiner.prompt);
    context.effectivePrefillLengths.push_back(promptLength - prefillStart);
    context.generatedTokenIds.emplace_back();
    context.residentRefs.push_back(*resident);
    context.finishReasons.push_back(mkv::FinishReason::kNotFinished);
    context.activeBatchSize = row + 1;
    rows.push_back(joiner);
    kvLengths.push_back(promptLength);
    reused.push_back(prefillStart);
    // ... engine: the joiner's prefill from prefillStart; synchronise; sample its lookahead
    writeLength(row, promptLength, context.stream);
    context.generatedTokenIds.back().push_back(1000);
    require(managed->finalizeSequenceAdmission(row, context.generatedTokenIds.back().back(),
                                               promptLength),
            "finalizeSequenceAdmission");
  }
  require(managed->finish(), "finish");
  releaseResidents(context.residentRefs);
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
