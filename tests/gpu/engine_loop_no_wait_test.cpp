// A request's lifecycle on the GPU never waits for the engine's other streams (issue: the GPU
// engine loop at engine speed). While kernels spin for a second on two unrelated streams, one
// non-blocking and one blocking (which work on the legacy default stream would wait for),
// complete lifecycles run on the engine's stream through ManagedKVCacheRequest on every backend;
// afterwards cudaStreamQuery of both streams must still say cudaErrorNotReady (so must it after a
// step's AttentionViews::build at every launch capacity). A device-wide synchronisation
// (cudaDeviceSynchronize, or cudaFree, cudaFreeHost and the like, which synchronise implicitly),
// a context-wide lazy kernel load or any use of stream 0 inside a lifecycle call would have
// waited for a spinning kernel. Nothing here reads a clock: the verdict
// is the other streams' state. run_on_device.sh runs this suite in a process of its own with
// CUDA_MODULE_LOADING=LAZY, so no earlier test has loaded the library's kernels.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

#include "busy_stream.h"
#include "core/device.h"
#include "gpu_parity.h"
#include "mkv/attention_views.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/context_cache/context_cache_metrics.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/kv_page_table.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/snapshot_storage.h"
#include "mkv/tensor.h"
#include "mkv/tensor_parallel.h"
#include "support/token_runs.h"

namespace mkv::gputest {
using test::concatenated;
using test::tokenRun;
namespace {

constexpr DecodingKvHeadroom kVanilla{1, 0};
constexpr DecodingKvHeadroom kSpeculative{4, 4};
constexpr int32_t kPage = 128;
constexpr std::chrono::milliseconds kBusyFor{1000};

KVCacheRuntimeConfig baseConfig(cudaStream_t stream) {
  KVCacheRuntimeConfig config;
  config.model.numKVHeads = 2;
  config.model.headDim = 64;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 4096;
  config.tokensPerPage = kPage;
  config.deviceType = DeviceType::kGPU;
  config.stream = stream;
  return config;
}

/// The engine side of one request, without a model: residents, the context the facade reads,
/// KV lengths written to the device as an engine writes them, sampled tokens. `speculative`: an
/// EAGLE-style request on a runtime with a paged draft (the draft's lengths follow the base's).
class LoopEngine {
 public:
  LoopEngine(KVCacheRuntime& runtime, cudaStream_t stream, bool speculative = false)
      : mRuntime(runtime), mSpeculative(speculative) {
    mContext.stream = stream;
  }
  ~LoopEngine() {
    mManaged.reset();
    for (ResidentRef const& resident : mContext.residentRefs) {
      (void)mRuntime.residentSlots().release(resident);
    }
  }
  LoopEngine(LoopEngine const&) = delete;
  LoopEngine& operator=(LoopEngine const&) = delete;

  void add(std::vector<int32_t> prompt) { appendRow(std::move(prompt), acquire()); }

  void begin() {
    std::optional<ManagedKVCacheRequest> begun = ManagedKVCacheRequest::begin(
        mRuntime.contextCache(), mRuntime.swaPageManager(), mRequest, mContext, mSpeculative,
        headroom(), DecodingTokenStateContract::kCommittedPlusLookahead,
        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
    ASSERT_TRUE(begun.has_value());
    mManaged.emplace(std::move(*begun));
  }

  /// preparePrefill, the SWA windows, captures, the prefill's KV lengths, one sampled token.
  /// `heldEnd` > 0: the last founder runs only [its start, heldEnd), completes it as a chunk
  /// before the captures, samples nothing and holds (continueChunked goes on with it).
  void prefill(int32_t heldEnd = 0) {
    std::vector<int32_t> const* starts = mManaged->prefillStarts();
    for (std::size_t row = 0; row < mPrompts.size(); ++row) {
      int32_t const start = starts != nullptr ? (*starts)[row] : 0;
      mContext.effectivePrefillLengths.push_back(promptLength(row) - start);
    }
    ASSERT_TRUE(mManaged->preparePrefill());
    ASSERT_TRUE(mManaged->prepareSwaPrefill(mContext.effectivePrefillLengths));
    writeReusePoints();
    std::size_t const whole = heldEnd > 0 ? mPrompts.size() - 1 : mPrompts.size();
    if (heldEnd > 0) {
      writeLength(whole, heldEnd);
      ASSERT_TRUE(mManaged->completePrefillChunk(static_cast<ExecutionRow>(whole), heldEnd));
    }
    ASSERT_TRUE(mManaged->enqueuePrefillCaptures());
    std::vector<int32_t> common;  // lengths both models hold (speculative requests only)
    for (std::size_t row = 0; row < whole; ++row) {
      writeLength(row, promptLength(row));
      mContext.generatedTokenIds[row].push_back(sampled(row));
      if (mSpeculative) {
        common.push_back(promptLength(row));
      }
    }
    ASSERT_TRUE(mManaged->completePrefill(mContext, common));
  }

  /// Speculative verification rounds: each accepts `accepted` tokens per row, the base and the
  /// draft execute them.
  void rounds(int32_t count, int32_t accepted) {
    for (int32_t round = 0; round < count; ++round) {
      ASSERT_TRUE(mManaged->prepareDecodeStep(mContext, kSpeculative));
      std::vector<int32_t> common;
      for (std::size_t row = 0; row < mPrompts.size(); ++row) {
        int32_t const executed = materialized(row) + accepted;
        writeLength(row, executed);
        for (int32_t k = 0; k < accepted; ++k) {
          mContext.generatedTokenIds[row].push_back(sampled(row));
        }
        common.push_back(executed);
      }
      ASSERT_TRUE(mManaged->completeDecodeStep(mContext, common));
    }
  }

  void decode(int32_t steps) {
    for (int32_t step = 0; step < steps; ++step) {
      ASSERT_TRUE(mManaged->prepareDecodeStep(mContext, kVanilla));
      for (std::size_t row = 0; row < mPrompts.size(); ++row) {
        writeLength(row, materialized(row) + 1);
        mContext.generatedTokenIds[row].push_back(sampled(row));
      }
      ASSERT_TRUE(mManaged->completeDecodeStep(mContext, {}));
    }
  }

  /// Row `row` stops; the batch is compacted and the row's resident released.
  void dropRow(std::size_t row) {
    std::vector<int32_t> oldToNew(mPrompts.size(), -1);
    int32_t survivors = 0;
    for (std::size_t i = 0; i < mPrompts.size(); ++i) {
      if (i != row) {
        oldToNew[i] = survivors++;
      }
    }
    ASSERT_TRUE(mManaged->beginBatchCompaction(oldToNew, survivors, mDeviceMapping));
    ASSERT_TRUE(mManaged->completeBatchCompaction(oldToNew));
    ASSERT_TRUE(mRuntime.residentSlots().release(mContext.residentRefs[row]));
    eraseRow(row);
  }

  /// An in-flight join: admission, the joiner's prefill and KV length, finalisation.
  void join(std::vector<int32_t> prompt) {
    std::size_t row = 0;
    ASSERT_NO_FATAL_FAILURE(admitJoiner(std::move(prompt), row));
    writeLength(row, promptLength(row));
    finalizeJoiner(row);
  }

  /// An in-flight join prefilled in chunks of `chunk` tokens, one per decode step of the other
  /// rows (the joiner holds), each completed with completePrefillChunk; then finalisation.
  void joinChunked(std::vector<int32_t> prompt, int32_t chunk) {
    std::size_t joiner = 0;
    ASSERT_NO_FATAL_FAILURE(admitJoiner(std::move(prompt), joiner));
    int32_t const start = promptLength(joiner) - mContext.effectivePrefillLengths[joiner];
    writeLength(joiner, start);
    continueChunked(joiner, start, chunk);
  }

  /// The chunks of unfinalised row `joiner` (the last row) from `done`, one per decode step of
  /// the rows before it, each completed with completePrefillChunk; then finalisation.
  void continueChunked(std::size_t joiner, int32_t done, int32_t chunk) {
    while (done < promptLength(joiner)) {
      done = std::min(promptLength(joiner), done + chunk);
      ASSERT_TRUE(mManaged->preparePrefillChunk(static_cast<ExecutionRow>(joiner), done));
      ASSERT_TRUE(mManaged->prepareDecodeStep(mContext, kVanilla));
      for (std::size_t row = 0; row < joiner; ++row) {
        writeLength(row, materialized(row) + 1);
        mContext.generatedTokenIds[row].push_back(sampled(row));
      }
      writeLength(joiner, done);  // the chunk's forward, beside the decodes
      ASSERT_TRUE(mManaged->completeDecodeStep(mContext, {}));
      if (done < promptLength(joiner)) {
        ASSERT_TRUE(mManaged->completePrefillChunk(static_cast<int32_t>(joiner), done));
      }
    }
    finalizeJoiner(joiner);
  }

  /// Preemption (vLLM's recompute): row `row` publishes its committed state and is compacted
  /// away; `resumed` receives what resuming it admits again, its prompt and sampled tokens.
  void preempt(std::size_t row, std::vector<int32_t>& resumed) {
    resumed = mPrompts[row];
    resumed.insert(resumed.end(), mContext.generatedTokenIds[row].begin(),
                   mContext.generatedTokenIds[row].end());
    ASSERT_TRUE(mManaged->preemptSequence(static_cast<ExecutionRow>(row)));
    dropRow(row);
  }

  /// What the next decode step would allocate (the scheduler's question before it).
  DecodeStepDemand decodeStepDemand() const { return mManaged->decodeStepDemand(headroom()); }

  /// An in-flight admission taken back before its prefill.
  void admitAndRetract(std::vector<int32_t> const& prompt) {
    ResidentRef const resident = acquire();
    int32_t start = -1;
    ASSERT_EQ(mManaged->admitSequence(prompt, "", kVanilla, start, resident, mContext.stream),
              AdmitSequenceStatus::kAdmitted);
    ASSERT_TRUE(mManaged->retractSequenceAdmission());
    ASSERT_TRUE(mRuntime.residentSlots().release(resident));
  }

  void finish() { ASSERT_TRUE(mManaged->finish()); }
  int32_t reusePointsWritten() const { return mReusePointsWritten; }
  int32_t prefillStart(std::size_t row) const { return (*mManaged->prefillStarts())[row]; }

 private:
  /// admitSequence of `prompt` on a fresh resident; the joiner becomes the last row, every
  /// KV-length tensor grows for it (sliding-window reuse: the SWA pool's too). `row` receives
  /// its row.
  void admitJoiner(std::vector<int32_t> prompt, std::size_t& row) {
    ResidentRef const resident = acquire();
    int32_t start = -1;
    ASSERT_EQ(mManaged->admitSequence(prompt, "", kVanilla, start, resident, mContext.stream),
              AdmitSequenceStatus::kAdmitted);
    appendRow(std::move(prompt), resident);
    row = mPrompts.size() - 1;
    mContext.effectivePrefillLengths.push_back(promptLength(row) - start);
    for (KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool()}) {
      if (pool != nullptr) {
        pool->setActiveBatchSize(static_cast<int32_t>(mPrompts.size()));
      }
    }
  }
  /// The joiner's lookahead token, then finalizeSequenceAdmission.
  void finalizeJoiner(std::size_t row) {
    mContext.generatedTokenIds[row].push_back(sampled(row));
    ASSERT_TRUE(mManaged->finalizeSequenceAdmission(
        static_cast<int32_t>(row), mContext.generatedTokenIds[row].back(), promptLength(row)));
  }

  /// The scan's states at the reuse points the library named, into their snapshot slots (a
  /// byte pattern: this engine computes no state), on the engine's stream.
  void writeReusePoints() {
    ContextCacheCoordinator* cache = mRuntime.contextCache();
    SnapshotStorage* slabs = cache != nullptr ? cache->snapshots() : nullptr;
    if (slabs == nullptr) {
      return;
    }
    for (std::size_t row = 0; row < mPrompts.size(); ++row) {
      for (ReusePointCapture const& point :
           mManaged->reusePointCaptures(static_cast<ExecutionRow>(row))) {
        for (int32_t layer = 0; layer < mRuntime.recurrentState()->numLayers(); ++layer) {
          for (Tensor* slab :
               {&slabs->recurrentStateSlab(layer), &slabs->recurrentConvSlab(layer)}) {
            auto const bytes = static_cast<std::size_t>(slab->dim(1));
            ASSERT_EQ(cudaMemsetAsync(static_cast<uint8_t*>(slab->rawPointer()) +
                                          bytes * static_cast<std::size_t>(point.snapshotSlot),
                                      point.position & 0xFF, bytes, mContext.stream),
                      cudaSuccess);
          }
        }
        ++mReusePointsWritten;
      }
    }
  }

  ResidentRef acquire() {
    std::optional<ResidentRef> resident = mRuntime.residentSlots().acquire();
    EXPECT_TRUE(resident.has_value());
    return resident.value_or(ResidentRef{});
  }
  void appendRow(std::vector<int32_t> prompt, ResidentRef resident) {
    mContext.rawBatchedInputIds.push_back(prompt);
    mContext.residentRefs.push_back(resident);
    mContext.generatedTokenIds.emplace_back();
    mContext.finishReasons.push_back(FinishReason::kNotFinished);
    mPrompts.push_back(std::move(prompt));
    mContext.activeBatchSize = static_cast<int32_t>(mPrompts.size());
  }
  void eraseRow(std::size_t row) {
    auto const at = static_cast<std::ptrdiff_t>(row);
    mContext.rawBatchedInputIds.erase(mContext.rawBatchedInputIds.begin() + at);
    mContext.residentRefs.erase(mContext.residentRefs.begin() + at);
    mContext.generatedTokenIds.erase(mContext.generatedTokenIds.begin() + at);
    mContext.finishReasons.erase(mContext.finishReasons.begin() + at);
    mContext.effectivePrefillLengths.erase(mContext.effectivePrefillLengths.begin() + at);
    mPrompts.erase(mPrompts.begin() + at);
    mContext.activeBatchSize = static_cast<int32_t>(mPrompts.size());
  }
  int32_t promptLength(std::size_t row) const { return static_cast<int32_t>(mPrompts[row].size()); }
  /// Positions with KV: the prompt and every sampled token but the last (the lookahead).
  int32_t materialized(std::size_t row) const {
    return promptLength(row) + static_cast<int32_t>(mContext.generatedTokenIds[row].size()) - 1;
  }
  int32_t sampled(std::size_t row) const {
    return 1000 + static_cast<int32_t>(mContext.generatedTokenIds[row].size());
  }
  DecodingKvHeadroom headroom() const { return mSpeculative ? kSpeculative : kVanilla; }
  /// The base's KV length of `row`, and the draft's on a speculative request.
  void writeLength(std::size_t row, int32_t length) {
    mRuntime.lengthPool().writeLengths(static_cast<int32_t>(row), std::span(&length, 1),
                                       mContext.stream);
    if (mSpeculative) {
      mRuntime.draftPool()->writeLengths(static_cast<int32_t>(row), std::span(&length, 1),
                                         mContext.stream);
    }
  }

  KVCacheRuntime& mRuntime;
  bool mSpeculative;
  int32_t mReusePointsWritten = 0;
  LLMGenerationRequest mRequest;
  DecodingInferenceContext mContext;
  std::vector<std::vector<int32_t>> mPrompts;
  Tensor mDeviceMapping{{4}, DataType::kInt32, DeviceType::kGPU};
  std::optional<ManagedKVCacheRequest> mManaged;
};

class EngineLoopNoWaitTest : public GpuTest {
 protected:
  /// Starts the unrelated work; everything allocated before this line may allocate freely.
  void occupyOtherStream() {
    mNonBlocking.emplace(false);
    mBlocking.emplace(true);
    mNonBlocking->occupy(kBusyFor);
    mBlocking->occupy(kBusyFor);
  }
  /// The verdict: the unrelated kernels still run, so no call above waited for them.
  void expectOtherStreamStillBusy() {
    EXPECT_EQ(mNonBlocking->query(), cudaErrorNotReady)
        << "a lifecycle call waited for a non-blocking stream (" << kBusyFor.count()
        << " ms kernel)";
    EXPECT_EQ(mBlocking->query(), cudaErrorNotReady)
        << "a lifecycle call waited for a blocking stream (" << kBusyFor.count()
        << " ms kernel): work on the legacy default stream?";
    mNonBlocking->drain();
    mBlocking->drain();
  }

  std::optional<BusyStream> mNonBlocking;
  std::optional<BusyStream> mBlocking;
};

// The check can fail: a GPU Tensor's construction (cudaMalloc, a memset on stream 0, a device
// synchronisation) made while the other streams run waits for both.
TEST_F(EngineLoopNoWaitTest, ADeviceWideWaitIsSeen) {
  BusyStream nonBlocking(false);
  BusyStream blocking(true);
  nonBlocking.occupy(std::chrono::milliseconds(300));
  blocking.occupy(std::chrono::milliseconds(300));
  Tensor allocated({1024}, DataType::kInt32, DeviceType::kGPU);
  EXPECT_EQ(nonBlocking.query(), cudaSuccess);
  EXPECT_EQ(blocking.query(), cudaSuccess);
}

// The legacy default stream waits for a blocking stream: the second busy stream sees it.
TEST_F(EngineLoopNoWaitTest, WorkOnTheLegacyDefaultStreamIsSeen) {
  Tensor buffer({1024}, DataType::kInt32, DeviceType::kGPU);
  BusyStream blocking(true);
  blocking.occupy(std::chrono::milliseconds(300));
  cudaOk(cudaMemsetAsync(buffer.rawPointer(), 0, 4096, nullptr), "cudaMemsetAsync on stream 0");
  cudaOk(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize(0)");
  EXPECT_EQ(blocking.query(), cudaSuccess);
}

// AttentionViews::build on a GPU table: one launch on the engine's stream at every capacity of
// the launch (a kernel each, loaded when the views were made), and never a wait.
TEST_F(EngineLoopNoWaitTest, AttentionViewsAtEveryLaunchCapacity) {
  int32_t const rows = kernels::kMaxAttentionViewRows;
  KVPageTable table(rows, 4, 64, PageTableMode::kDense, DeviceType::kGPU);
  std::vector<PageId> const pages{1, 2, 3};
  for (CacheSlot slot = 0; slot < rows; ++slot) {
    table.setRow(slot, pages);
  }
  ASSERT_TRUE(table.upload(stream()));
  AttentionViews views(table, kPage, rows, 1 << 16, stream());
  occupyOtherStream();
  for (int32_t const n : {1, 65, rows}) {
    std::vector<CacheSlot> slots(static_cast<std::size_t>(n));
    std::iota(slots.begin(), slots.end(), 0);
    std::vector<int32_t> const before(slots.size(), 2 * kPage);
    std::vector<int32_t> const fresh(slots.size(), 1);
    views.build(slots, before, fresh, 0);
  }
  expectOtherStreamStillBusy();
  synchronize();
  EXPECT_EQ(views.launches(), 3);
  EXPECT_EQ(views.newTokenCount(), rows);
}

TEST_F(EngineLoopNoWaitTest, ReuseWithPublicationAndHit) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  auto runtime = KVCacheRuntime::create(config);
  LoopEngine first(*runtime, stream());
  LoopEngine second(*runtime, stream());
  first.add(tokenRun(2048, 10));
  second.add(tokenRun(2048, 10));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(first.begin());
  ASSERT_NO_FATAL_FAILURE(first.prefill());
  ASSERT_NO_FATAL_FAILURE(first.decode(4));
  ASSERT_NO_FATAL_FAILURE(first.finish());
  ASSERT_NO_FATAL_FAILURE(second.begin());
  EXPECT_GE(second.prefillStart(0), 2048 - kPage);  // the published prompt is reused
  ASSERT_NO_FATAL_FAILURE(second.prefill());
  ASSERT_NO_FATAL_FAILURE(second.decode(2));
  ASSERT_NO_FATAL_FAILURE(second.finish());
  expectOtherStreamStillBusy();
}

// Tensor parallelism: a rank per GPU (two ranks on one GPU when there is only one), each rank's
// runtime on a stream of its own and driven by a thread of its own, run publication and a hit with
// the same decisions, and no call of any rank waits for the unrelated streams kept busy on every
// device (the ranks' agreement is a host-side rendezvous at the library's completion points, of
// which this lifecycle has none on the GPU).
TEST_F(EngineLoopNoWaitTest, TensorParallelRanksWithPublicationAndHit) {
  int32_t const devices = std::min(cudaDeviceCount(), 8);
  int32_t const ranks = std::max(devices, 2);
  auto const deviceOf = [devices](int32_t rank) { return rank % devices; };
  LocalRankGroup group(ranks);
  std::vector<detail::OwnedStream> streams;
  std::vector<std::unique_ptr<KVCacheRuntime>> runtimes;
  std::vector<std::unique_ptr<LoopEngine>> engines;  // two requests per rank
  for (int32_t rank = 0; rank < ranks; ++rank) {
    setCurrentCudaDevice(deviceOf(rank));
    streams.emplace_back(DeviceType::kGPU);
    KVCacheRuntimeConfig config = baseConfig(streams.back().get());
    config.model.numFullAttentionLayers = 2;
    config.model.numKVHeads = 8;
    config.contextReuse = true;
    config.tensorParallel = {ranks, rank, KvHeadLayout::kSplitHeads, group.agreement(rank)};
    runtimes.push_back(KVCacheRuntime::create(config));
    ASSERT_EQ(runtimes.back()->fullPool()->config().numKVHeads, 8 / ranks);
    for (int request = 0; request < 2; ++request) {
      engines.push_back(std::make_unique<LoopEngine>(*runtimes.back(), streams.back().get()));
      engines.back()->add(tokenRun(2048, 10));
    }
  }
  std::vector<std::unique_ptr<BusyStream>> busy;  // a non-blocking and a blocking one per device
  for (int32_t device = 0; device < devices; ++device) {
    setCurrentCudaDevice(device);
    for (bool const blocking : {false, true}) {
      busy.push_back(std::make_unique<BusyStream>(blocking));
      busy.back()->occupy(kBusyFor);
    }
  }
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  std::vector<int32_t> hits(static_cast<std::size_t>(ranks), -1);
  for (int32_t rank = 0; rank < ranks; ++rank) {
    threads.emplace_back([&, rank] {
      auto const r = static_cast<std::size_t>(rank);
      setCurrentCudaDevice(deviceOf(rank));
      LoopEngine& first = *engines[2 * r];
      LoopEngine& second = *engines[2 * r + 1];
      first.begin();
      first.prefill();
      first.decode(4);
      first.finish();
      second.begin();
      hits[r] = second.prefillStart(0);
      second.prefill();
      second.decode(2);
      second.finish();
    });
  }
  for (std::thread& thread : threads) {
    thread.join();
  }
  for (std::size_t b = 0; b < busy.size(); ++b) {
    setCurrentCudaDevice(static_cast<int32_t>(b / 2));
    EXPECT_EQ(busy[b]->query(), cudaErrorNotReady)
        << "a rank's lifecycle call waited for a " << (b % 2 == 1 ? "blocking" : "non-blocking")
        << " stream of device " << b / 2;
    busy[b]->drain();
  }
  // The same decisions: equal tables, and the same agreements (a lifecycle without a completion
  // point, as this one on the GPU, exchanges none: it waits for nothing).
  for (int32_t rank = 0; rank < ranks; ++rank) {
    auto const r = static_cast<std::size_t>(rank);
    EXPECT_GE(hits[r], 2048 - kPage) << "rank " << rank;
    auto const rows = runtimes[r]->fullPageTable()->hostRows();
    auto const first = runtimes[0]->fullPageTable()->hostRows();
    EXPECT_TRUE(std::equal(rows.begin(), rows.end(), first.begin(), first.end())) << rank;
    TensorParallelStats const stats = runtimes[r]->tensorParallelStats();
    EXPECT_EQ(stats.agreements, runtimes[0]->tensorParallelStats().agreements);
    EXPECT_EQ(stats.divergences + stats.failedElsewhere, 0);
  }
  for (int32_t rank = ranks - 1; rank >= 0; --rank) {  // each rank's objects on its device
    auto const r = static_cast<std::size_t>(rank);
    setCurrentCudaDevice(deviceOf(rank));
    engines[2 * r + 1].reset();
    engines[2 * r].reset();
    cudaOk(streams[r].synchronize(), "a rank's stream");
    runtimes[r].reset();
  }
  setCurrentCudaDevice(0);
}

// The host tier: the second request's admission evicts the first prompt, whose pages are copied
// to pinned host memory on the tier's stream; the third onboards them again. Neither waits on the
// host, and the engine's stream waits only for the tier's copies.
TEST_F(EngineLoopNoWaitTest, HostTierOffloadAndOnboarding) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  config.maxSequenceLength = 2304;  // 18 pages a row
  config.numPages = 20;             // one 2048-token prompt at a time
  config.hostPoolTokens = int64_t{40} * kPage;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_NE(runtime->hostTier(), nullptr);
  LoopEngine first(*runtime, stream());
  LoopEngine other(*runtime, stream());
  LoopEngine again(*runtime, stream());
  first.add(tokenRun(2048, 10));
  other.add(tokenRun(2048, 50000));
  again.add(tokenRun(2048, 10));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(first.begin());
  ASSERT_NO_FATAL_FAILURE(first.prefill());
  ASSERT_NO_FATAL_FAILURE(first.decode(2));
  ASSERT_NO_FATAL_FAILURE(first.finish());
  ASSERT_NO_FATAL_FAILURE(other.begin());  // evicts the first prompt: offload
  ASSERT_NO_FATAL_FAILURE(other.prefill());
  ASSERT_NO_FATAL_FAILURE(other.finish());
  ASSERT_NO_FATAL_FAILURE(again.begin());  // onboards it
  EXPECT_GE(again.prefillStart(0), 2048 - kPage);
  ASSERT_NO_FATAL_FAILURE(again.prefill());
  ASSERT_NO_FATAL_FAILURE(again.decode(2));
  ASSERT_NO_FATAL_FAILURE(again.finish());
  expectOtherStreamStillBusy();
  ContextCacheMetrics const metrics = runtime->contextCache()->metrics();
  EXPECT_GE(metrics.offloadedPages, 15U);
  EXPECT_GE(metrics.onboardedPages, 15U);
}

TEST_F(EngineLoopNoWaitTest, FullStorageWithCompaction) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kFullStorage);
  LoopEngine engine(*runtime, stream());
  engine.add(tokenRun(900, 10));
  engine.add(tokenRun(400, 3000));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(engine.begin());
  ASSERT_NO_FATAL_FAILURE(engine.prefill());
  ASSERT_NO_FATAL_FAILURE(engine.decode(130));
  ASSERT_NO_FATAL_FAILURE(engine.dropRow(0));
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.finish());
  expectOtherStreamStillBusy();
}

TEST_F(EngineLoopNoWaitTest, BoundedSwaWithCompaction) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = 1;
  config.model.slidingWindowTokens = 256;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kBoundedSwa);
  LoopEngine engine(*runtime, stream());
  engine.add(tokenRun(1500, 10));
  engine.add(tokenRun(700, 5000));
  engine.add(tokenRun(300, 9000));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(engine.begin());
  ASSERT_NO_FATAL_FAILURE(engine.prefill());
  engine.decode(130);  // crosses page boundaries: windows map and retire pages
  ASSERT_NO_FATAL_FAILURE(engine.dropRow(1));
  ASSERT_NO_FATAL_FAILURE(engine.decode(3));
  ASSERT_NO_FATAL_FAILURE(engine.finish());
  expectOtherStreamStillBusy();
}

// Bounded SWA as a serving engine: a joiner prefilled in chunks beside the decodes (its window
// rotating from chunk to chunk), one taken back, and a compaction.
TEST_F(EngineLoopNoWaitTest, BoundedSwaChunkedJoinerRetractAndCompaction) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = 1;
  config.model.slidingWindowTokens = 256;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kBoundedSwa);
  ASSERT_TRUE(runtime->supportsSeatedAdmission());
  LoopEngine engine(*runtime, stream());
  engine.add(tokenRun(700, 10));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(engine.begin());
  ASSERT_NO_FATAL_FAILURE(engine.prefill());
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.joinChunked(tokenRun(1500, 4000), 300));
  ASSERT_NO_FATAL_FAILURE(engine.decode(130));  // crosses page boundaries: windows rotate
  ASSERT_NO_FATAL_FAILURE(engine.admitAndRetract(tokenRun(400, 7000)));
  ASSERT_NO_FATAL_FAILURE(engine.dropRow(0));
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.finish());
  expectOtherStreamStillBusy();
}

// Sliding-window reuse: the second request reuses the first prompt's full layers and maps the
// cached window before its start; both prefills publish window blocks, decode rotates the window
// and a compaction drops a row.
TEST_F(EngineLoopNoWaitTest, SlidingWindowReuseWithHitJoinRetractAndCompaction) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 1;
  config.model.numSlidingWindowLayers = 2;
  config.model.slidingWindowTokens = 256;
  config.contextReuse = true;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kSlidingWindowReuse);
  LoopEngine first(*runtime, stream());
  LoopEngine second(*runtime, stream());
  first.add(tokenRun(2048, 10));
  second.add(tokenRun(2048, 10));
  second.add(tokenRun(900, 7000));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(first.begin());
  ASSERT_NO_FATAL_FAILURE(first.prefill());
  ASSERT_NO_FATAL_FAILURE(first.decode(4));
  ASSERT_NO_FATAL_FAILURE(first.finish());
  ASSERT_NO_FATAL_FAILURE(second.begin());
  EXPECT_GE(second.prefillStart(0), 2048 - kPage);  // full layers and window both cached
  ASSERT_NO_FATAL_FAILURE(second.prefill());
  ASSERT_NO_FATAL_FAILURE(second.decode(130));  // crosses page boundaries: windows rotate
  ASSERT_NO_FATAL_FAILURE(second.dropRow(1));
  // (4 residents: `first` keeps its own until it is destroyed.) A joiner hitting the shared
  // prompt with its window, one taken back before its prefill, then a compaction that moves the
  // joiner's rows of both halves.
  ASSERT_NO_FATAL_FAILURE(second.join(concatenated(tokenRun(2048, 10), tokenRun(300, 9000))));
  EXPECT_GE(second.prefillStart(1), 2048 - kPage);
  ASSERT_NO_FATAL_FAILURE(second.decode(2));
  ASSERT_NO_FATAL_FAILURE(second.admitAndRetract(tokenRun(400, 12000)));
  ASSERT_NO_FATAL_FAILURE(second.dropRow(0));
  ASSERT_NO_FATAL_FAILURE(second.decode(2));
  ASSERT_NO_FATAL_FAILURE(second.finish());
  expectOtherStreamStillBusy();
}

TEST_F(EngineLoopNoWaitTest, InFlightJoinAndRetract) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_TRUE(runtime->supportsSeatedAdmission());
  LoopEngine engine(*runtime, stream());
  engine.add(tokenRun(600, 10));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(engine.begin());
  ASSERT_NO_FATAL_FAILURE(engine.prefill());
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.join(tokenRun(900, 4000)));
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.admitAndRetract(tokenRun(400, 7000)));
  ASSERT_NO_FATAL_FAILURE(engine.dropRow(0));
  ASSERT_NO_FATAL_FAILURE(engine.decode(1));
  ASSERT_NO_FATAL_FAILURE(engine.finish());
  expectOtherStreamStillBusy();
}

TEST_F(EngineLoopNoWaitTest, ChunkedPrefillOfAJoinerBesideDecodes) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  auto runtime = KVCacheRuntime::create(config);
  LoopEngine engine(*runtime, stream());
  engine.add(tokenRun(600, 10));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(engine.begin());
  ASSERT_NO_FATAL_FAILURE(engine.prefill());
  ASSERT_NO_FATAL_FAILURE(engine.decode(1));
  // Shares the founder's 512-token prefix; its other 1,400 tokens in chunks of 300.
  ASSERT_NO_FATAL_FAILURE(
      engine.joinChunked(concatenated(tokenRun(512, 10), tokenRun(1400, 4000)), 300));
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.finish());
  expectOtherStreamStillBusy();
  EXPECT_EQ(runtime->contextCache()->counters().prefillChunks, 4U) << "5 chunks, the last final";
}

TEST_F(EngineLoopNoWaitTest, AFoundersChunkedPrefillBesideDecodes) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  auto runtime = KVCacheRuntime::create(config);
  LoopEngine engine(*runtime, stream());
  engine.add(tokenRun(600, 10));
  engine.add(tokenRun(1400, 4000));  // its first chunk in the prefill, then chunks of 300
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(engine.begin());
  ASSERT_NO_FATAL_FAILURE(engine.prefill(/*heldEnd=*/300));
  ASSERT_NO_FATAL_FAILURE(engine.continueChunked(1, 300, 300));
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.finish());
  expectOtherStreamStillBusy();
  EXPECT_EQ(runtime->contextCache()->counters().heldPrefills, 1U);
  EXPECT_EQ(runtime->contextCache()->counters().prefillChunks, 4U) << "300 in the prefill, 3 more";
}

TEST_F(EngineLoopNoWaitTest, PreemptionAndResumptionBesideDecodes) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  auto runtime = KVCacheRuntime::create(config);
  LoopEngine engine(*runtime, stream());
  engine.add(tokenRun(600, 10));
  engine.add(tokenRun(700, 5000));
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(engine.begin());
  ASSERT_NO_FATAL_FAILURE(engine.prefill());
  ASSERT_NO_FATAL_FAILURE(engine.decode(60));  // row 1: 760 tokens with KV, 5 full pages
  // The scheduler's questions before a step, then vLLM's recompute of the newest row.
  DecodeStepDemand const demand = engine.decodeStepDemand();
  KVCacheCapacity const capacity = runtime->capacity();
  std::vector<int32_t> resumed;
  ASSERT_NO_FATAL_FAILURE(engine.preempt(1, resumed));
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.join(resumed));  // resumes from what it published
  int32_t const resumedStart = engine.prefillStart(1);
  ASSERT_NO_FATAL_FAILURE(engine.decode(2));
  ASSERT_NO_FATAL_FAILURE(engine.finish());
  expectOtherStreamStillBusy();
  EXPECT_EQ(demand.tableFull, RowFailure{});
  EXPECT_LE(demand.basePages, capacity.base->freePages);
  EXPECT_EQ(runtime->contextCache()->counters().preemptions, 1U);
  EXPECT_EQ(resumedStart, 5 * kPage) << "the preempted row's 5 full pages, published";
}

TEST_F(EngineLoopNoWaitTest, SpeculativePairedReuse) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 2;
  config.contextReuse = true;
  KVCacheSpeculativeConfig draft;
  draft.numDraftLayers = 1;
  draft.numDraftKVHeads = 2;
  draft.draftHeadDim = 64;
  config.speculative = draft;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_NE(runtime->draftPool(), nullptr);
  LoopEngine producer(*runtime, stream(), /*speculative=*/true);
  LoopEngine consumer(*runtime, stream(), /*speculative=*/true);
  producer.add(tokenRun(1024, 10));
  consumer.add(tokenRun(1100, 10));  // extends the producer's prompt: a paired hit
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(producer.begin());
  ASSERT_NO_FATAL_FAILURE(producer.prefill());
  ASSERT_NO_FATAL_FAILURE(producer.rounds(3, 3));
  ASSERT_NO_FATAL_FAILURE(producer.finish());
  ASSERT_NO_FATAL_FAILURE(consumer.begin());
  // The paired endpoint's last page is replayed: its draft row 1023 depends on token 1024, where
  // the two requests differ.
  EXPECT_EQ(consumer.prefillStart(0), 1024 - kPage) << "the paired prompt endpoint is reused";
  ASSERT_NO_FATAL_FAILURE(consumer.prefill());
  ASSERT_NO_FATAL_FAILURE(consumer.rounds(2, 2));
  ASSERT_NO_FATAL_FAILURE(consumer.finish());
  expectOtherStreamStillBusy();
  EXPECT_GE(runtime->contextCache()->counters().specPairPublications, 1U);
}

TEST_F(EngineLoopNoWaitTest, HybridCheckpointCapture) {
  KVCacheRuntimeConfig config = baseConfig(stream());
  config.model.numFullAttentionLayers = 1;
  config.model.numRecurrentLayers = 2;
  config.model.recurrentStateBytes = 4096;
  config.model.recurrentConvBytes = 512;
  config.contextReuse = true;
  config.contextCache.recurrentSnapshotPoolBytes = int64_t{8} * 2 * (4096 + 512);
  // 1 layer x K and V x 128 tokens x 2 heads x 64 x fp16 per partial page.
  config.contextCache.partialKvSnapshotPoolBytes = int64_t{8} * 2 * kPage * 2 * 64 * 2;
  config.contextCache.checkpointInterval = 2 * kPage;  // reuse points at 256, 512, 768
  auto runtime = KVCacheRuntime::create(config);
  ContextCacheCoordinator& coordinator = *runtime->contextCache();
  LoopEngine first(*runtime, stream());
  LoopEngine second(*runtime, stream());
  LoopEngine third(*runtime, stream());  // (an engine allocates its device tensors up front)
  first.add(tokenRun(1000, 10));
  second.add(tokenRun(1100, 10));  // extends the first prompt: restores its checkpoint
  third.add(concatenated(tokenRun(600, 10), tokenRun(50, 9000)));  // diverges inside the first
  // This engine writes its reuse points with cudaMemsetAsync: the runtime's memset kernel is
  // loaded now, since a lazy module load waits for the whole context (the engine's own cost,
  // not the library's).
  Tensor& slab = runtime->contextCache()->snapshots()->recurrentStateSlab(0);
  ASSERT_EQ(cudaMemsetAsync(slab.rawPointer(), 0, 1, stream()), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream()), cudaSuccess);
  occupyOtherStream();
  ASSERT_NO_FATAL_FAILURE(first.begin());
  ASSERT_NO_FATAL_FAILURE(first.prefill());
  ASSERT_NO_FATAL_FAILURE(first.decode(3));
  ASSERT_NO_FATAL_FAILURE(first.finish());
  ASSERT_NO_FATAL_FAILURE(second.begin());
  ASSERT_NO_FATAL_FAILURE(second.prefill());
  ASSERT_NO_FATAL_FAILURE(second.finish());
  ASSERT_NO_FATAL_FAILURE(third.begin());
  EXPECT_EQ(third.prefillStart(0), 512) << "the reuse point before the divergence";
  ASSERT_NO_FATAL_FAILURE(third.prefill());
  ASSERT_NO_FATAL_FAILURE(third.finish());
  expectOtherStreamStillBusy();
  EXPECT_EQ(first.reusePointsWritten(), 3);
  EXPECT_GE(coordinator.counters().checkpointCaptures, 1U);
  EXPECT_GE(coordinator.counters().checkpointRestores, 2U);
  EXPECT_EQ(coordinator.counters().reusePointRestores, 1U);
}

}  // namespace
}  // namespace mkv::gputest
