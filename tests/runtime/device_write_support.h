#pragma once
/// \file device_write_support.h
/// Pieces of the device-write suites (device_write_timing_test.cpp, device_write_fault_test.cpp):
/// the table rows of a runtime on the host and on the device, the lengths the prefill resets, and
/// one single-sequence request driven call by call as an engine's scheduler would.

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "runtime_test_rig.h"
#include "support/test_util.h"

namespace mkv::runtime_test {

/// Every table row of the runtime (K and V ids) on the host, and the device copies read back.
struct Rows {
  std::vector<int32_t> host;
  std::vector<int32_t> device;
};

inline Rows tableRows(KVCacheRuntime& runtime) {
  Rows rows;
  for (KVPageTable const* table :
       {runtime.fullPageTable(), runtime.swaPageTable(), runtime.draftPageTable()}) {
    if (table == nullptr) {
      continue;
    }
    std::vector<int32_t> const device = test::readAs<int32_t>(table->deviceTable());
    rows.device.insert(rows.device.end(), device.begin(), device.end());
    for (CacheSlot slot = 0; slot < table->maxBatch(); ++slot) {
      std::span<int32_t const> const host = table->hostRow(slot);
      rows.host.insert(rows.host.end(), host.begin(), host.end());
    }
  }
  return rows;
}

/// The active rows of the length tensor the backend resets at a prefill.
inline std::vector<int32_t> deviceLengths(KVCacheRuntime& runtime) {
  return test::readAs<int32_t>(runtime.lengthPool().kvLengths());
}

/// One single-sequence request driven call by call, as an engine's scheduler would.
class CallByCall {
 public:
  CallByCall(KVCacheRuntime& runtime, std::vector<int32_t> prompt) : mRuntime(runtime) {
    mContext.stream = runtime.config().stream;
    mContext.activeBatchSize = 1;
    mContext.finishReasons = {FinishReason::kNotFinished};
    mContext.rawBatchedInputIds = {std::move(prompt)};
    mContext.generatedTokenIds = {{}};
    mContext.residentRefs = {runtime.residentSlots().acquire().value()};
  }
  ~CallByCall() {
    mManaged.reset();
    (void)mRuntime.residentSlots().release(mContext.residentRefs[0]);
  }
  CallByCall(CallByCall const&) = delete;
  CallByCall& operator=(CallByCall const&) = delete;

  CacheSlot slot() const { return mContext.residentRefs[0].slot; }

  /// begin, then the prefill's prepare calls (the engine would launch its forward next).
  void beginAndPreparePrefill() {
    std::optional<ManagedKVCacheRequest> begun = ManagedKVCacheRequest::begin(
        mRuntime.contextCache(), mRuntime.swaPageManager(), LLMGenerationRequest{}, mContext, false,
        kVanilla, DecodingTokenStateContract::kCommittedPlusLookahead,
        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
    ASSERT_TRUE(begun.has_value());
    mManaged.emplace(std::move(*begun));
    std::vector<int32_t> const* starts = mManaged->prefillStarts();
    int32_t const reused = starts != nullptr ? starts->at(0) : 0;
    mContext.effectivePrefillLengths = {
        static_cast<int32_t>(mContext.rawBatchedInputIds[0].size()) - reused};
    ASSERT_TRUE(mManaged->preparePrefill());
    ASSERT_TRUE(mManaged->prepareSwaPrefill(mContext.effectivePrefillLengths));
    ASSERT_TRUE(mManaged->enqueuePrefillCaptures());
  }
  void completePrefillAndFinish() {
    mContext.generatedTokenIds[0].push_back(7);  // the engine samples
    ASSERT_TRUE(mManaged->completePrefill(mContext, {}));
    ASSERT_TRUE(mManaged->finish());
  }

 private:
  KVCacheRuntime& mRuntime;
  DecodingInferenceContext mContext;
  std::optional<ManagedKVCacheRequest> mManaged;
};

inline KVCacheRuntimeConfig engineStepConfig(Backend backend, DeviceType device) {
  KVCacheRuntimeConfig config = configFor(backend, device);
  config.deviceWrites = DeviceWriteTiming::kEngineStep;
  return config;
}

/// The KV length the suites' engine writes to row 0 before a request's prefill resets it.
inline constexpr int32_t kEngineLength = 77;

/// Sets the length tensor's active batch to one row holding kEngineLength, as an engine would.
inline void writeEngineLength(KVCacheRuntime& runtime) {
  KVCachePool& lengths = runtime.lengthPool();
  lengths.setActiveBatchSize(1);
  lengths.writeLengths(0, std::vector<int32_t>{kEngineLength}, runtime.config().stream);
}

/// A runtime with writes at the engine step, as a prefill finds it: kEngineLength in length row 0,
/// the table rows before any request (`idle`) and the launches made so far.
struct EngineStepStart {
  std::unique_ptr<KVCacheRuntime> runtime;
  Rows idle;
  int64_t launches = 0;
};

inline EngineStepStart startEngineStep(Backend backend, DeviceType device) {
  EngineStepStart start;
  start.runtime = KVCacheRuntime::create(engineStepConfig(backend, device));
  start.idle = tableRows(*start.runtime);
  writeEngineLength(*start.runtime);
  start.launches = start.runtime->deviceWriteLaunches();
  return start;
}

/// A prefill's writes still waiting: `launches` launches so far, the device rows as `idle` left
/// them, the engine's length not reset yet.
inline void expectPrefillWaiting(KVCacheRuntime& runtime, Rows const& idle, int64_t launches) {
  EXPECT_EQ(runtime.deviceWriteLaunches(), launches) << "a launch was made or counted";
  EXPECT_TRUE(runtime.deviceWritesPending());
  Rows const waiting = tableRows(runtime);
  EXPECT_EQ(waiting.device, idle.device) << "the device rows changed before a flush";
  EXPECT_NE(waiting.host, idle.host) << "the prefill bound no page";
  EXPECT_EQ(deviceLengths(runtime), std::vector<int32_t>{kEngineLength}) << "a length arrived";
}

/// A prefill's writes flushed in one launch after `launches`: the device rows equal the host's
/// and the prefill's reset length arrived.
inline void expectPrefillFlushed(KVCacheRuntime& runtime, int64_t launches) {
  EXPECT_EQ(runtime.deviceWriteLaunches(), launches + 1) << "not one launch for the step";
  EXPECT_FALSE(runtime.deviceWritesPending());
  Rows const flushed = tableRows(runtime);
  EXPECT_EQ(flushed.device, flushed.host);
  EXPECT_EQ(deviceLengths(runtime), std::vector<int32_t>{0}) << "the prefill's reset length";
}

}  // namespace mkv::runtime_test
