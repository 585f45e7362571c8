#pragma once
/// \file decode_step_rigs.h
/// Decode-step rigs of the host benchmarks: a KVCacheRuntime (CPU tensors unless a rig is given
/// kGPU) with one running batch, driven
/// either through its backend directly (BoundedSwaKVPageManager, ContextCacheCoordinator) or
/// through the ManagedKVCacheRequest facade exactly as ReferenceEngine drives it. step() is one
/// decode step of the whole batch, including the engine's minimal share (building the advances,
/// or appending the sampled tokens to the context the facade reads). When the rows approach the
/// table width, step() first finishes the request and admits the batch again; that restart is
/// inside the measurement but amortised over thousands of steps (one restart per table width of
/// steps).

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "host_bench_support.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/generation_request.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"

namespace mkv::bench {

inline constexpr DecodingKvHeadroom kDecodeHeadroom{1, 0};
inline constexpr int32_t kDecodeToken = 5;

/// `count` residents of the runtime, held for the rig's lifetime (every request reuses them).
inline std::vector<ResidentRef> acquireResidents(KVCacheRuntime& runtime, int32_t count) {
  std::vector<ResidentRef> residents;
  for (int32_t i = 0; i < count; ++i) {
    std::optional<ResidentRef> resident = runtime.residentSlots().acquire();
    if (!resident) {
      throw std::runtime_error("decode-step rig: no free resident slot");
    }
    residents.push_back(*resident);
  }
  return residents;
}

/// The engine-side state the facade reads: prompts, residents, generated tokens, finish reasons.
inline DecodingInferenceContext engineContext(std::vector<std::vector<int32_t>> const& prompts,
                                              std::vector<ResidentRef> const& residents) {
  DecodingInferenceContext context;
  context.activeBatchSize = static_cast<int32_t>(prompts.size());
  context.rawBatchedInputIds = prompts;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    context.residentRefs.push_back(residents[i]);
    context.finishReasons.push_back(FinishReason::kNotFinished);
    context.generatedTokenIds.emplace_back();
  }
  return context;
}

/// One decode step through the facade as ReferenceEngine drives it: prepare, the token sampled for
/// every row appended to the context, complete. False when either call reports a failure.
inline bool facadeDecodeStep(ManagedKVCacheRequest& managed, DecodingInferenceContext& context) {
  bool const prepared = managed.prepareDecodeStep(context, kDecodeHeadroom);
  for (auto& generated : context.generatedTokenIds) {
    generated.push_back(kDecodeToken);
  }
  return managed.completeDecodeStep(context, {}) && prepared;
}

/// Bounded SWA, Gemma-3-like window: W = 1024 tokens, page 16 (M = 65), sequences up to 32k
/// tokens (2048 logical pages per table row). Prompt lengths are spread over [2048, 4096) so that
/// in every step about 1/16 of the rows map a page and 1/16 retire one, as in a real batch.
class SwaDecodeRig {
 public:
  static constexpr int32_t kWindow = 1024;
  static constexpr int32_t kPage = 16;
  static constexpr int32_t kMaxSequence = 32768;

  SwaDecodeRig(int32_t batch, bool facade, DeviceType device = DeviceType::kCPU) : mFacade(facade) {
    KVCacheRuntimeConfig config = benchRuntimeConfig(batch, kMaxSequence, kPage, device);
    config.model.numSlidingWindowLayers = 1;
    config.model.slidingWindowTokens = kWindow;
    mRuntime = KVCacheRuntime::create(config);
    if (mRuntime->backend() != KVCacheBackend::kBoundedSwa) {
      throw std::runtime_error("SwaDecodeRig: the runtime did not select bounded SWA");
    }
    mResidents = acquireResidents(*mRuntime, batch);
    for (int32_t i = 0; i < batch; ++i) {
      mLengths.push_back(2048 + (i * 7919) % 2048);
      mPrompts.emplace_back(static_cast<std::size_t>(mLengths.back()), 1);
    }
    mLongest = *std::max_element(mLengths.begin(), mLengths.end());
    start();
  }
  ~SwaDecodeRig() { stop(); }
  SwaDecodeRig(SwaDecodeRig const&) = delete;
  SwaDecodeRig& operator=(SwaDecodeRig const&) = delete;

  void step() {
    if (mLongest + mSteps + 2 > kMaxSequence) {
      stop();
      start();
    }
    bool ok = true;
    if (mFacade) {
      ok = facadeDecodeStep(*mManaged, mContext);
    } else {
      BoundedSwaKVPageManager& manager = *mRuntime->swaPageManager();
      ok = manager.prepareDecodeStep(*mHandle) == SwaKVCacheStatus::kOk;
      manager.completeDecodeStep(*mHandle);
    }
    if (!ok) {
      throw std::runtime_error("SwaDecodeRig: a decode step failed");
    }
    ++mSteps;
  }

 private:
  void start() {
    mSteps = 0;
    BoundedSwaKVPageManager& manager = *mRuntime->swaPageManager();
    if (mFacade) {
      mContext = engineContext(mPrompts, mResidents);
      mContext.stream = mRuntime->config().stream;
      auto begun = ManagedKVCacheRequest::begin(
          nullptr, &manager, LLMGenerationRequest{}, mContext, false, kDecodeHeadroom,
          DecodingTokenStateContract::kCommittedPlusLookahead,
          ContextCacheCommitPolicy::kIncludingGeneratedTokens);
      if (!begun) {
        throw std::runtime_error("SwaDecodeRig: admission failed");
      }
      mManaged.emplace(std::move(*begun));
      mManaged->prepareSwaPrefill(mLengths);
      for (auto& generated : mContext.generatedTokenIds) {
        generated.push_back(kDecodeToken);  // the lookahead token sampled by prefill
      }
      mManaged->completePrefill(mContext, {});
      return;
    }
    auto begun = manager.beginRequest(mResidents, nullptr);
    if (begun.status != SwaKVCacheStatus::kOk) {
      throw std::runtime_error("SwaDecodeRig: admission failed");
    }
    mHandle = std::move(begun.request);
    manager.preparePrefill(*mHandle, mLengths);
    manager.completePrefill(*mHandle);
  }
  void stop() {
    if (mManaged) {
      mManaged->finish();
      mManaged.reset();
    }
    if (mHandle) {
      mRuntime->swaPageManager()->finish(*mHandle);
      mHandle.reset();
    }
  }

  bool mFacade;
  std::unique_ptr<KVCacheRuntime> mRuntime;
  std::vector<int32_t> mLengths;
  std::vector<std::vector<int32_t>> mPrompts;
  int32_t mLongest = 0;
  int64_t mSteps = 0;
  std::vector<ResidentRef> mResidents;
  std::optional<BoundedSwaKVPageManager::RequestHandle> mHandle;
  DecodingInferenceContext mContext;
  std::optional<ManagedKVCacheRequest> mManaged;
};

/// Context reuse over full paged KV, page 16, verification on, rows of 16k tokens; every row has
/// its own 512-token prompt (32 full pages).
///   * Growth::kNone: the admission's headroom covers the whole cycle, so no step grows a row;
///   * Growth::kEvery16th: decode headroom only; the rows are page-aligned alike, so every 16th
///     step grows every row by one page and the other 15 grow none, as a real batch averages.
/// step() checks the coordinator's growth counter against that schedule.
class ReuseDecodeRig {
 public:
  enum class Growth : uint8_t { kNone, kEvery16th };
  static constexpr int32_t kPage = 16;
  static constexpr int32_t kPrompt = 512;
  static constexpr int32_t kMaxSequence = 16384;

  ReuseDecodeRig(int32_t batch, bool facade, Growth growth, DeviceType device = DeviceType::kCPU)
      : mBatch(batch), mFacade(facade), mGrowth(growth) {
    KVCacheRuntimeConfig config = benchRuntimeConfig(batch, kMaxSequence, kPage, device);
    config.model.numFullAttentionLayers = 1;
    config.contextReuse = true;
    // Room for every row at full length next to the cached prompts: growth never evicts.
    config.numPages = batch * (kMaxSequence / kPage + 8);
    mRuntime = KVCacheRuntime::create(config);
    mResidents = acquireResidents(*mRuntime, batch);
    for (int32_t i = 0; i < batch; ++i) {
      mPrompts.push_back(randomTokens(kPrompt, 100 + static_cast<uint64_t>(i)));
    }
    mAdvances.resize(static_cast<std::size_t>(batch));
    start();
  }
  ~ReuseDecodeRig() { stop(); }
  ReuseDecodeRig(ReuseDecodeRig const&) = delete;
  ReuseDecodeRig& operator=(ReuseDecodeRig const&) = delete;

  void step() {
    if (kPrompt + mSteps + kPage + 2 > kMaxSequence) {
      stop();
      start();
    }
    ContextCacheCoordinator& coordinator = *mRuntime->contextCache();
    uint64_t const growthsBefore = coordinator.counters().pageGrowths;
    bool ok = true;
    if (mFacade) {
      ok = facadeDecodeStep(*mManaged, mContext);
    } else {
      int32_t const committed = kPrompt + static_cast<int32_t>(mSteps) + 1;
      for (ContextCacheSequenceAdvance& advance : mAdvances) {
        advance = {&kDecodeToken, 1, committed};
      }
      ok = coordinator.prepareDecodeStep(*mHandle, kDecodeHeadroom) == ContextCacheStatus::kOk;
      ok = coordinator.completeDecodeStep(*mHandle, mAdvances, {}) == ContextCacheStatus::kOk && ok;
    }
    bool const grows = mGrowth == Growth::kEvery16th && mSteps > 0 && mSteps % kPage == 0;
    uint64_t const grown = coordinator.counters().pageGrowths - growthsBefore;
    if (!ok || grown != (grows ? static_cast<uint64_t>(mBatch) : 0)) {
      throw std::runtime_error("ReuseDecodeRig: a decode step failed or grew unexpectedly");
    }
    ++mSteps;
  }

 private:
  DecodingKvHeadroom admissionHeadroom() const {
    // kNone: cover every token the cycle will commit (kPrompt + steps + 1 < kMaxSequence - kPage).
    return mGrowth == Growth::kNone ? DecodingKvHeadroom{kMaxSequence - kPage - kPrompt, 0}
                                    : kDecodeHeadroom;
  }
  void start() {
    mSteps = 0;
    ContextCacheCoordinator& coordinator = *mRuntime->contextCache();
    if (mFacade) {
      mContext = engineContext(mPrompts, mResidents);
      mContext.stream = mRuntime->config().stream;
      auto begun = ManagedKVCacheRequest::begin(
          &coordinator, nullptr, LLMGenerationRequest{}, mContext, false, admissionHeadroom(),
          DecodingTokenStateContract::kCommittedPlusLookahead,
          ContextCacheCommitPolicy::kIncludingGeneratedTokens);
      if (!begun) {
        throw std::runtime_error("ReuseDecodeRig: admission failed");
      }
      mManaged.emplace(std::move(*begun));
      mManaged->preparePrefill();
      for (auto& generated : mContext.generatedTokenIds) {
        generated.push_back(kDecodeToken);  // the lookahead token sampled by prefill
      }
      mManaged->completePrefill(mContext, {});
      return;
    }
    ContextCacheBatchAdmission admission;
    for (std::size_t i = 0; i < mPrompts.size(); ++i) {
      ContextCacheSequenceAdmission sequence;
      sequence.tokenIds = mPrompts[i];
      sequence.resident = mResidents[i];
      admission.sequences.push_back(std::move(sequence));
    }
    auto begun = coordinator.beginRequest(admission, admissionHeadroom(), nullptr);
    if (begun.status != ContextCacheStatus::kOk) {
      throw std::runtime_error("ReuseDecodeRig: admission failed");
    }
    mHandle = std::move(begun.admission->request);
    coordinator.preparePrefill(*mHandle);
    std::vector<ContextCacheSequenceAdvance> const prefill(
        mPrompts.size(), ContextCacheSequenceAdvance{&kDecodeToken, 1, kPrompt});
    coordinator.finalizePrefillPublication(*mHandle, prefill);
  }
  void stop() {
    if (mManaged) {
      mManaged->finish();
      mManaged.reset();
    }
    if (mHandle) {
      mRuntime->contextCache()->finish(*mHandle);
      mHandle.reset();
    }
  }

  int32_t mBatch;
  bool mFacade;
  Growth mGrowth;
  std::unique_ptr<KVCacheRuntime> mRuntime;
  std::vector<std::vector<int32_t>> mPrompts;
  std::vector<ContextCacheSequenceAdvance> mAdvances;
  int64_t mSteps = 0;
  std::vector<ResidentRef> mResidents;
  std::optional<ContextCacheCoordinator::RequestHandle> mHandle;
  DecodingInferenceContext mContext;
  std::optional<ManagedKVCacheRequest> mManaged;
};

/// Sliding-window reuse (the composed backend) through the facade, with ReuseDecodeRig's full
/// half exactly (page 16, verification on, rows of 16k tokens, a 512-token prompt per row,
/// decode headroom only: every 16th step grows every row by one full page) plus one sliding layer
/// of W = 1024 tokens (M = 65): the same steps map a sliding page and, once the window is full,
/// retire one. The full pool holds every row at full length, the sliding pool every row's window
/// and prompt blocks, so no step drops a cached block. Against
/// BM_FacadeReuseDecodeStep with growth the ratio is what the sliding half adds to a step.
class SlidingReuseDecodeRig {
 public:
  static constexpr int32_t kPage = 16;
  static constexpr int32_t kWindow = 1024;
  static constexpr int32_t kPrompt = 512;
  static constexpr int32_t kMaxSequence = 16384;

  SlidingReuseDecodeRig(int32_t batch, DeviceType device = DeviceType::kCPU) {
    KVCacheRuntimeConfig config = benchRuntimeConfig(batch, kMaxSequence, kPage, device);
    config.model.numFullAttentionLayers = 1;
    config.model.numSlidingWindowLayers = 1;
    config.model.slidingWindowTokens = kWindow;
    config.contextReuse = true;
    config.numPages = batch * (kMaxSequence / kPage + 8);
    // The sliding pool a deployment would size: each row's decode window (M + 1) and its cached
    // prompt blocks, with a margin, but at least the one-sequence minimum the runtime requires.
    int32_t const perRow = kWindow / kPage + 2 + kPrompt / kPage + 8;
    config.numSwaPages = std::max(batch * perRow, kMaxSequence / kPage + 1 + kWindow / kPage);
    mRuntime = KVCacheRuntime::create(config);
    if (mRuntime->backend() != KVCacheBackend::kSlidingWindowReuse) {
      throw std::runtime_error("SlidingReuseDecodeRig: the runtime did not select sliding reuse");
    }
    mResidents = acquireResidents(*mRuntime, batch);
    for (int32_t i = 0; i < batch; ++i) {
      mPrompts.push_back(randomTokens(kPrompt, 100 + static_cast<uint64_t>(i)));
    }
    start();
  }
  ~SlidingReuseDecodeRig() { stop(); }
  SlidingReuseDecodeRig(SlidingReuseDecodeRig const&) = delete;
  SlidingReuseDecodeRig& operator=(SlidingReuseDecodeRig const&) = delete;

  void step() {
    if (kPrompt + mSteps + kPage + 2 > kMaxSequence) {
      stop();
      start();
    }
    if (!facadeDecodeStep(*mManaged, mContext)) {
      throw std::runtime_error("SlidingReuseDecodeRig: a decode step failed");
    }
    ++mSteps;
  }

 private:
  void start() {
    mSteps = 0;
    mContext = engineContext(mPrompts, mResidents);
    mContext.stream = mRuntime->config().stream;
    auto begun = ManagedKVCacheRequest::begin(
        mRuntime->contextCache(), mRuntime->swaPageManager(), LLMGenerationRequest{}, mContext,
        false, kDecodeHeadroom, DecodingTokenStateContract::kCommittedPlusLookahead,
        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
    if (!begun) {
      throw std::runtime_error("SlidingReuseDecodeRig: admission failed");
    }
    mManaged = std::make_unique<ManagedKVCacheRequest>(std::move(*begun));
    std::vector<int32_t> executed;
    for (int32_t start : *mManaged->prefillStarts()) {
      executed.push_back(kPrompt - start);  // a later cycle reuses its prompts' blocks
    }
    if (!mManaged->preparePrefill() || !mManaged->prepareSwaPrefill(executed)) {
      throw std::runtime_error("SlidingReuseDecodeRig: prefill preparation failed");
    }
    for (auto& generated : mContext.generatedTokenIds) {
      generated.push_back(kDecodeToken);  // the lookahead token sampled by prefill
    }
    mManaged->completePrefill(mContext, {});
  }
  void stop() {
    if (mManaged) {
      mManaged->finish();
      mManaged.reset();
    }
  }

  std::unique_ptr<KVCacheRuntime> mRuntime;
  std::vector<std::vector<int32_t>> mPrompts;
  int64_t mSteps = 0;
  std::vector<ResidentRef> mResidents;
  DecodingInferenceContext mContext;
  // A pointer, not std::optional: g++ 12 -O3 warns (maybe-uninitialized) inside the optional's
  // variant when this rig is inlined into the benchmark loop.
  std::unique_ptr<ManagedKVCacheRequest> mManaged;
};

/// Runs one rig step per iteration; a failure (exception) skips the benchmark with its message.
template <typename Rig, typename... Args>
void runDecodeSteps(benchmark::State& state, int32_t batch, Args&&... args) {
  try {
    Rig rig(batch, std::forward<Args>(args)...);
    for (auto _ : state) {
      rig.step();
    }
  } catch (std::exception const& error) {
    state.SkipWithError(error.what());
  }
  setSequenceStepCounters(state, batch);
}

}  // namespace mkv::bench
