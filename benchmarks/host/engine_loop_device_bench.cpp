// The engine loop's host cost with GPU tensors next to the CPU twin, in one run: per request
// (begin, the prefill calls, finish) and per decode step, on both backends. The library does the
// same bookkeeping on both devices; with GPU tensors it also stages uploads in pinned memory,
// enqueues copies and kernels and synchronises at its completion points. Target
// (docs/benchmarks.md, "The engine loop on the GPU"): GPU within 1.5x of CPU. The GPU rows skip
// without a CUDA device.
//
// BM_RequestLifecycle times the library calls only (manual time, one steady_clock read around each
// phase, ~85 ns each and the same on both devices), with the runtime's device writes at each call
// or at the engine step (DeviceWriteTiming); the decode-step rows time whole iterations
// (decode_step_rigs.h), as the other decode-step benchmarks do.

#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode_step_rigs.h"
#include "host_bench_support.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/stream.h"
#include "mkv/tensor.h"

namespace mkv::bench {
namespace {

using Clock = std::chrono::steady_clock;

DeviceType deviceArg(benchmark::State const& state, std::size_t index) {
  return state.range(index) != 0 ? DeviceType::kGPU : DeviceType::kCPU;
}

/// True (and the benchmark skipped) when `device` is kGPU and no CUDA device is visible.
bool skipWithoutDevice(benchmark::State& state, DeviceType device) {
  if (device == DeviceType::kGPU && !cudaDeviceAvailable()) {
    state.SkipWithError("no CUDA device (or a build without CUDA)");
    return true;
  }
  return false;
}

/// Library nanoseconds of one request, by phase.
struct PhaseNanoseconds {
  int64_t begin = 0;
  /// preparePrefill, prepareSwaPrefill, enqueuePrefillCaptures and completePrefill.
  int64_t prefill = 0;
  int64_t finish = 0;
  /// kEngineStep: the engine's flushDeviceWrites before its prefill forward, made by the last
  /// request of a step. A step's cost, paid once whatever the number of requests in it: reported
  /// beside the request (per request), not in its time.
  int64_t stepFlush = 0;
  int64_t total() const { return begin + prefill + finish; }
};

/// One sequence per request, a 2048-token prompt, pages of 128 tokens. Context reuse: every
/// prompt is new (a unique first token), so each request misses, publishes 16 blocks and, once
/// the pool is full, evicts old records. Bounded SWA: W = 1024 (M = 9). With kEngineStep the
/// engine flushes the step's writes after the prepare calls of the step's last request, before
/// its forward (with per_step 1, every request's); a finish's cleared row waits for the next
/// flush.
class LifecycleRig {
 public:
  static constexpr int32_t kPrompt = 2048;
  static constexpr int32_t kPage = 128;

  LifecycleRig(bool reuse, DeviceType device, DeviceWriteTiming timing)
      : mPrompt(randomTokens(kPrompt, 7)) {
    KVCacheRuntimeConfig config = benchRuntimeConfig(4, 4096, kPage, device);
    config.deviceWrites = timing;
    config.model.numFullAttentionLayers = 1;
    if (reuse) {
      config.contextReuse = true;
      config.numPages = 64 * (kPrompt / kPage);  // room for 64 cached prompts, then LRU
    } else {
      config.model.numSlidingWindowLayers = 1;
      config.model.slidingWindowTokens = 1024;
    }
    mRuntime = KVCacheRuntime::create(config);
    mContext.stream = config.stream;
    mContext.activeBatchSize = 1;
    mContext.finishReasons = {FinishReason::kNotFinished};
  }

  /// One request; `flush`: the step's last, after whose prepare calls the engine flushes.
  PhaseNanoseconds serve(int64_t serial, bool flush) {
    mPrompt[0] = uniqueToken(serial);
    mContext.rawBatchedInputIds = {mPrompt};
    mContext.generatedTokenIds = {{}};
    mContext.residentRefs = {mRuntime->residentSlots().acquire().value()};
    PhaseNanoseconds phases;
    auto start = Clock::now();
    std::optional<ManagedKVCacheRequest> managed = ManagedKVCacheRequest::begin(
        mRuntime->contextCache(), mRuntime->swaPageManager(), LLMGenerationRequest{}, mContext,
        false, kDecodeHeadroom, DecodingTokenStateContract::kCommittedPlusLookahead,
        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
    phases.begin = elapsed(start);
    require(managed.has_value(), "begin");
    std::vector<int32_t> const* starts = managed->prefillStarts();
    int32_t const reused = starts != nullptr ? starts->at(0) : 0;
    mContext.effectivePrefillLengths = {kPrompt - reused};
    start = Clock::now();
    bool ok = managed->preparePrefill();
    ok = ok && managed->prepareSwaPrefill(mContext.effectivePrefillLengths);
    ok = ok && managed->enqueuePrefillCaptures();
    phases.prefill = elapsed(start);
    if (flush) {
      start = Clock::now();
      mRuntime->flushDeviceWrites();  // the engine's, before its forward (nothing with kEachCall)
      phases.stepFlush = elapsed(start);
    }
    mContext.generatedTokenIds[0].push_back(kDecodeToken);  // the engine samples
    start = Clock::now();
    ok = ok && managed->completePrefill(mContext, {});
    phases.prefill += elapsed(start);
    require(ok, "the prefill calls");
    start = Clock::now();
    ok = managed->finish();
    phases.finish = elapsed(start);
    require(ok, "finish");
    managed.reset();
    (void)mRuntime->residentSlots().release(mContext.residentRefs[0]);
    return phases;
  }

 private:
  static int64_t elapsed(Clock::time_point start) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  }
  static void require(bool ok, char const* what) {
    if (!ok) {
      throw std::runtime_error(std::string("LifecycleRig: ") + what + " failed");
    }
  }

  std::vector<int32_t> mPrompt;
  std::unique_ptr<KVCacheRuntime> mRuntime;
  DecodingInferenceContext mContext;
};

void BM_RequestLifecycle(benchmark::State& state) {
  DeviceType const device = deviceArg(state, 3);
  if (skipWithoutDevice(state, device)) {
    return;
  }
  DeviceWriteTiming const timing =
      state.range(1) != 0 ? DeviceWriteTiming::kEngineStep : DeviceWriteTiming::kEachCall;
  int64_t const perStep = state.range(2);
  PhaseNanoseconds sum;
  try {
    LifecycleRig rig(state.range(0) == 0, device, timing);
    int64_t serial = 0;
    for (auto _ : state) {
      bool const lastOfStep = (serial + 1) % perStep == 0;
      PhaseNanoseconds const phases = rig.serve(serial++, lastOfStep);
      sum.begin += phases.begin;
      sum.prefill += phases.prefill;
      sum.finish += phases.finish;
      sum.stepFlush += phases.stepFlush;
      state.SetIterationTime(static_cast<double>(phases.total()) * 1e-9);
    }
  } catch (std::exception const& error) {
    state.SkipWithError(error.what());
    return;
  }
  auto const perRequestMicroseconds = [&](int64_t nanoseconds) {
    return benchmark::Counter(static_cast<double>(nanoseconds) * 1e-3 /
                              static_cast<double>(state.iterations()));
  };
  state.counters["begin_us"] = perRequestMicroseconds(sum.begin);
  state.counters["prefill_us"] = perRequestMicroseconds(sum.prefill);
  state.counters["finish_us"] = perRequestMicroseconds(sum.finish);
  state.counters["step_flush_us"] = perRequestMicroseconds(sum.stepFlush);
}
// step: device writes at the engine step; per_step: requests whose prefills share the engine's
// flush. Only 1: a prefill's forward needs its own rows on the device, so each request's
// prefill is flushed before it completes (completePrefill refuses it otherwise); 8 ran until
// 2026-12-04 and completed seven of eight prefills unflushed (docs/benchmarks.md).
BENCHMARK(BM_RequestLifecycle)
    ->ArgNames({"swa", "step", "per_step", "gpu"})
    ->ArgsProduct({{0, 1}, {0, 1}, {1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

/// Waits for `stream` (nothing to wait for on the CPU twin).
void drain(cudaStream_t stream) {
#if MKV_WITH_CUDA
  if (stream != nullptr) {
    (void)cudaStreamSynchronize(stream);
  }
#else
  (void)stream;
#endif
}

/// The engine thread's cost of one inline patch (kernels::applyInt32InlinePatch) of `values`
/// entries in one range: the unit every page-table and KV-length write of a request pays on the
/// GPU, and its host twin on the CPU. The launch's parameter block is 4 KiB whatever the patch
/// holds (mkv_launch_probe shows the size does not change the cost). The stream is drained
/// outside the timing every 256 launches, so the launch queue never fills and the time is the
/// host's, not the GPU's.
void BM_InlinePatchLaunch(benchmark::State& state) {
  DeviceType const device = deviceArg(state, 1);
  if (skipWithoutDevice(state, device)) {
    return;
  }
  auto const values = static_cast<int32_t>(state.range(0));
  cudaStream_t const stream = benchStream(device);
  Tensor table({4096}, DataType::kInt32, device);
  std::vector<int32_t> patch = {0, values - 3, 3};
  patch.resize(static_cast<std::size_t>(values), 7);
  int64_t launches = 0;
  for (auto _ : state) {
    kernels::applyInt32InlinePatch(table, patch, 1, stream);
    if (++launches % 256 == 0) {
      state.PauseTiming();
      drain(stream);
      state.ResumeTiming();
    }
  }
  drain(stream);
}
BENCHMARK(BM_InlinePatchLaunch)
    ->ArgNames({"values", "gpu"})
    ->ArgsProduct({{4, 64, 384, 1000}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

/// The engine thread's cost of one InlinePatchBatch flush of `values` entries (add, then flush),
/// with the batch's ring (a graph launch reading a mapped host slot, as the backends' batches
/// do on the GPU) or without (the inline kernel launch of BM_InlinePatchLaunch), side by side in
/// one run. The stream is drained outside the timing every 32 flushes, so a slot is always free
/// (counter ring_share: the flushes that went through the ring).
void BM_InlinePatchBatchFlush(benchmark::State& state) {
  DeviceType const device = deviceArg(state, 2);
  if (skipWithoutDevice(state, device)) {
    return;
  }
  auto const values = static_cast<std::size_t>(state.range(0));
  bool const withRing = state.range(1) != 0;
  cudaStream_t const stream = benchStream(device);
  Tensor table({4096}, DataType::kInt32, device);
  std::vector<int32_t> const row(values, 7);
  kernels::InlinePatchBatch batch =
      withRing ? kernels::InlinePatchBatch(device) : kernels::InlinePatchBatch();
  for (auto _ : state) {
    batch.add("BM_InlinePatchBatchFlush", table, 0, row, stream);
    batch.flush(stream);
    if (batch.launches() % 32 == 0) {
      state.PauseTiming();
      drain(stream);
      state.ResumeTiming();
    }
  }
  drain(stream);
  state.counters["ring_share"] =
      static_cast<double>(batch.ringLaunches()) / static_cast<double>(batch.launches());
}
BENCHMARK(BM_InlinePatchBatchFlush)
    ->ArgNames({"values", "ring", "gpu"})
    ->ArgsProduct({{4, 384}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

/// A serving engine's mixed step (docs/lifecycle.md, "Chunked prefill"): `batch` rows decoding
/// (ReuseDecodeRig's geometry: page 16, 512-token prompts, a page grown every 16th step) beside one
/// joiner of 8,192 new tokens prefilled in chunks of 512, one per step: admitSequence, 15 steps
/// each completed with completePrefillChunk, then finalizeSequenceAdmission, and on the next step a
/// compaction drops it (the rows and their lengths compacted, one synchronisation) before the
/// next joiner is admitted. One iteration is one step with the engine's minimal share; the join,
/// finalisation and compaction are amortised over the 17 steps of a joiner's cycle.
class ChunkedStepRig {
 public:
  static constexpr int32_t kPage = 16;
  static constexpr int32_t kPrompt = 512;
  static constexpr int32_t kJoiner = 8192;
  static constexpr int32_t kChunk = 512;
  static constexpr int32_t kMaxSequence = 16384;

  ChunkedStepRig(int32_t batch, DeviceType device) : mBatch(batch) {
    KVCacheRuntimeConfig config = benchRuntimeConfig(batch + 1, kMaxSequence, kPage, device);
    config.model.numFullAttentionLayers = 1;
    config.contextReuse = true;
    config.numPages = (batch + 1) * (kMaxSequence / kPage + 8);  // growth and joins never evict
    mRuntime = KVCacheRuntime::create(config);
    mResidents = acquireResidents(*mRuntime, batch + 1);
    for (int32_t i = 0; i < batch; ++i) {
      mPrompts.push_back(randomTokens(kPrompt, 100 + static_cast<uint64_t>(i)));
    }
    mMapping.emplace(Coords{batch + 1}, DataType::kInt32, device);
    start();
  }
  ~ChunkedStepRig() { stop(); }
  ChunkedStepRig(ChunkedStepRig const&) = delete;
  ChunkedStepRig& operator=(ChunkedStepRig const&) = delete;

  void step() {
    if (kPrompt + mSteps + kPage + 2 > kMaxSequence) {
      stop();
      start();
    }
    auto const joiner = static_cast<std::size_t>(mBatch);
    bool ok = true;
    if (mJoinerDone == kJoiner + 1) {  // finalised last step: the engine drops it
      std::vector<int32_t> keep(joiner + 1, -1);
      for (int32_t i = 0; i < mBatch; ++i) {
        keep[static_cast<std::size_t>(i)] = i;
      }
      ok = mManaged->beginBatchCompaction(keep, mBatch, *mMapping) &&
           mManaged->completeBatchCompaction(keep);
      popJoiner();
    }
    if (mJoinerDone == 0) {
      ok = ok && admitJoiner();
    }
    ok = ok && mManaged->prepareDecodeStep(mContext, kDecodeHeadroom);
    for (std::size_t i = 0; i < joiner; ++i) {
      mContext.generatedTokenIds[i].push_back(kDecodeToken);
    }
    ok = ok && mManaged->completeDecodeStep(mContext, {});
    mJoinerDone = std::min(kJoiner, mJoinerDone + kChunk);
    if (mJoinerDone < kJoiner) {
      ok = ok && mManaged->completePrefillChunk(static_cast<ExecutionRow>(joiner), mJoinerDone);
    } else {
      mContext.generatedTokenIds[joiner].push_back(kDecodeToken);  // its lookahead
      ok = ok && mManaged->finalizeSequenceAdmission(static_cast<ExecutionRow>(joiner),
                                                     kDecodeToken, kJoiner);
      mContext.finishReasons[joiner] = FinishReason::kLength;  // done after its first token
      mJoinerDone = kJoiner + 1;
    }
    if (!ok) {
      throw std::runtime_error("ChunkedStepRig: a step failed");
    }
    ++mSteps;
  }

 private:
  bool admitJoiner() {
    std::vector<int32_t> prompt = randomTokens(kJoiner, 9000 + static_cast<uint64_t>(mJoins++));
    int32_t start = -1;
    auto const status = mManaged->admitSequence(prompt, "", kDecodeHeadroom, start,
                                                mResidents.back(), mContext.stream);
    mContext.rawBatchedInputIds.push_back(std::move(prompt));
    mContext.residentRefs.push_back(mResidents.back());
    mContext.generatedTokenIds.emplace_back();
    mContext.finishReasons.push_back(FinishReason::kNotFinished);
    mContext.activeBatchSize = mBatch + 1;
    mRuntime->fullPool()->setActiveBatchSize(mBatch + 1);  // the engine seats it
    mJoinerDone = start;
    return status == AdmitSequenceStatus::kAdmitted;
  }
  void popJoiner() {
    mContext.rawBatchedInputIds.pop_back();
    mContext.residentRefs.pop_back();
    mContext.generatedTokenIds.pop_back();
    mContext.finishReasons.pop_back();
    mContext.activeBatchSize = mBatch;
    mJoinerDone = 0;
  }
  void start() {
    mSteps = 0;
    mJoinerDone = 0;
    std::vector<ResidentRef> const founders(mResidents.begin(), mResidents.end() - 1);
    mContext = engineContext(mPrompts, founders);
    mContext.stream = mRuntime->config().stream;
    auto begun = ManagedKVCacheRequest::begin(
        mRuntime->contextCache(), nullptr, LLMGenerationRequest{}, mContext, false, kDecodeHeadroom,
        DecodingTokenStateContract::kCommittedPlusLookahead,
        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
    if (!begun) {
      throw std::runtime_error("ChunkedStepRig: admission failed");
    }
    mManaged = std::make_unique<ManagedKVCacheRequest>(std::move(*begun));
    bool ok = mManaged->preparePrefill();
    for (auto& generated : mContext.generatedTokenIds) {
      generated.push_back(kDecodeToken);
    }
    if (!(ok && mManaged->completePrefill(mContext, {}))) {
      throw std::runtime_error("ChunkedStepRig: the prefill failed");
    }
  }
  void stop() {
    if (mManaged) {
      mManaged->finish();
      mManaged.reset();
    }
  }

  int32_t mBatch;
  std::unique_ptr<KVCacheRuntime> mRuntime;
  std::vector<ResidentRef> mResidents;  ///< the founders', then the joiner's
  std::vector<std::vector<int32_t>> mPrompts;
  std::optional<Tensor> mMapping;
  DecodingInferenceContext mContext;
  std::unique_ptr<ManagedKVCacheRequest> mManaged;  // (an optional trips GCC 12's
                                                    // maybe-uninitialized here)
  int64_t mSteps = 0;
  int64_t mJoins = 0;
  int32_t mJoinerDone = 0;  ///< the joiner's prefilled tokens; 0: none seated; kJoiner + 1: done
};

void BM_EngineChunkedStep(benchmark::State& state) {
  DeviceType const device = deviceArg(state, 1);
  if (skipWithoutDevice(state, device)) {
    return;
  }
  runDecodeSteps<ChunkedStepRig>(state, static_cast<int32_t>(state.range(0)), device);
}
BENCHMARK(BM_EngineChunkedStep)
    ->ArgNames({"batch", "gpu"})
    ->ArgsProduct({{64, 256}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

void BM_EngineReuseDecodeStep(benchmark::State& state) {
  DeviceType const device = deviceArg(state, 1);
  if (skipWithoutDevice(state, device)) {
    return;
  }
  runDecodeSteps<ReuseDecodeRig>(state, static_cast<int32_t>(state.range(0)), /*facade=*/true,
                                 ReuseDecodeRig::Growth::kEvery16th, device);
}
BENCHMARK(BM_EngineReuseDecodeStep)
    ->ArgNames({"batch", "gpu"})
    ->ArgsProduct({{64, 256}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

void BM_EngineSwaDecodeStep(benchmark::State& state) {
  DeviceType const device = deviceArg(state, 1);
  if (skipWithoutDevice(state, device)) {
    return;
  }
  runDecodeSteps<SwaDecodeRig>(state, static_cast<int32_t>(state.range(0)), /*facade=*/true,
                               device);
}
BENCHMARK(BM_EngineSwaDecodeStep)
    ->ArgNames({"batch", "gpu"})
    ->ArgsProduct({{64, 256}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace mkv::bench
