/// InlinePatchBatch's ring on the GPU (kernels/patch_ring.h): flushes launched as a graph that
/// reads mapped host slots land in launch order across many wraps of the ring and of its 32-bit
/// count, mixed with inline launches when the host outruns the GPU; a ring the GPU has not read
/// yet hands over to inline launches without waiting; a second stream and a stream that
/// captures a graph get inline launches (the latter the patch by value).
#include <gtest/gtest.h>

#include <chrono>
#include <vector>

#include "gpu/busy_stream.h"
#include "gpu/gpu_parity.h"
#include "mkv/kernels.h"
#include "patch_ring.h"
#include "support/test_util.h"

#if MKV_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace mkv::gputest {
namespace {

constexpr char const* kCall = "PatchRingTest";
constexpr auto kSlots = static_cast<int32_t>(kernels::detail::PatchRing::kSlots);

constexpr int32_t kLogEntries = 8 * kSlots;

class PatchRingTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (!IsSkipped()) {
      mTable = test::int32Tensor(mTableModel, DeviceType::kGPU);
      mLengths = test::int32Tensor(mLengthModel, DeviceType::kGPU);
      mLog = test::int32Tensor(mLogModel, DeviceType::kGPU);
    }
  }

  /// Flush `step`: entry step % 8 of the table = step and a range of lengths that later flushes
  /// overwrite (a flush applied out of order leaves a wrong value behind), and log entry `step`
  /// = step (a flush lost, or read from a slot rewritten before the GPU read it, leaves a hole).
  void queueStep(kernels::InlinePatchBatch& batch, int32_t step, cudaStream_t stream) {
    batch.add(kCall, mTable, step % 8, std::vector<int32_t>{step}, stream);
    batch.add(kCall, mLengths, 0, std::vector<int32_t>(4, step), stream);
    batch.add(kCall, mLog, step, std::vector<int32_t>{step}, stream);
    mTableModel[static_cast<std::size_t>(step % 8)] = step;
    mLengthModel.assign(4, step);
    mLogModel[static_cast<std::size_t>(step)] = step;
  }

  std::vector<int32_t> mTableModel = std::vector<int32_t>(8, -1);
  std::vector<int32_t> mLengthModel = std::vector<int32_t>(4, 0);
  std::vector<int32_t> mLogModel = std::vector<int32_t>(kLogEntries, -1);
  // On the GPU, made in SetUp: a table of 8 entries, 4 lengths, a log of kLogEntries.
  Tensor mTable;
  Tensor mLengths;
  Tensor mLog;
};

TEST_F(PatchRingTest, FlushesLandInOrderOverManyWrapsOfTheRing) {
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  int32_t const steps = 5 * kSlots + 3;
  for (int32_t step = 0; step < steps; ++step) {
    queueStep(batch, step, stream());
    batch.flush(stream());
    if (step % (kSlots / 2) == 0) {
      synchronize();  // the GPU keeps up: every flush finds a free slot
    }
  }
  synchronize();
  EXPECT_EQ(batch.launches(), steps);
  EXPECT_EQ(batch.ringLaunches(), steps) << "every flush went through the ring";
  EXPECT_EQ(test::readAs<int32_t>(mTable), mTableModel);
  EXPECT_EQ(test::readAs<int32_t>(mLengths), mLengthModel);
  EXPECT_EQ(test::readAs<int32_t>(mLog), mLogModel);
}

TEST_F(PatchRingTest, FlushesAsFastAsTheHostCanLandInOrder) {
  // No synchronisation: the ring fills whenever the GPU lags, and those flushes launch inline.
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  for (int32_t step = 0; step < kLogEntries; ++step) {
    queueStep(batch, step, stream());
    batch.flush(stream());
  }
  synchronize();
  EXPECT_EQ(batch.launches(), kLogEntries);
  EXPECT_GT(batch.ringLaunches(), 0);
  EXPECT_EQ(test::readAs<int32_t>(mTable), mTableModel);
  EXPECT_EQ(test::readAs<int32_t>(mLengths), mLengthModel);
  EXPECT_EQ(test::readAs<int32_t>(mLog), mLogModel);
}

TEST_F(PatchRingTest, TheExecutionCountWrapsAt32Bits) {
  // The ring alone, its count starting 100 executions before 2^32.
  kernels::detail::PatchRing ring(0xFFFFFFFFu - 100u);
  for (int32_t step = 0; step < 3 * kSlots; ++step) {
    kernels::detail::Int32InlinePatchLaunch* slot = ring.acquire(stream());
    if (slot == nullptr) {
      synchronize();  // the GPU has read every slot once the stream is idle
      slot = ring.acquire(stream());
    }
    ASSERT_NE(slot, nullptr) << "step " << step;
    slot->dst[0] = mLog.dataPointer<int32_t>();
    slot->dstNumel[0] = kLogEntries;
    slot->targetRangeEnd[0] = 1;
    slot->numTargets = 1;
    slot->numRanges = 1;
    slot->patch[0] = step;  // offset
    slot->patch[1] = 1;     // count
    slot->patch[2] = 3;     // valueStart
    slot->patch[3] = step;
    slot->patchNumel = 4;
    ring.launch(kCall, stream());
    mLogModel[static_cast<std::size_t>(step)] = step;
  }
  synchronize();
  EXPECT_EQ(ring.launches(), 0xFFFFFFFFu - 100u + 3u * kernels::detail::PatchRing::kSlots);
  EXPECT_EQ(test::readAs<int32_t>(mLog), mLogModel);
}

TEST_F(PatchRingTest, AFlushOnASecondStreamLaunchesInline) {
  BusyStream other;
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  queueStep(batch, 0, stream());
  batch.flush(stream());
  EXPECT_EQ(batch.ringLaunches(), 1);
  synchronize();
  // A graph launch on `other` would be ordered behind the one on stream(): the ring is bound.
  queueStep(batch, 1, other.stream());
  batch.flush(other.stream());
  EXPECT_EQ(batch.ringLaunches(), 1);
  EXPECT_EQ(batch.launches(), 2);
  other.drain();
  EXPECT_EQ(test::readAs<int32_t>(mTable), mTableModel);
  EXPECT_EQ(test::readAs<int32_t>(mLog), mLogModel);
}

TEST_F(PatchRingTest, AFullRingHandsOverToInlineLaunchesWithoutWaiting) {
  BusyStream busy;
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  busy.occupy(std::chrono::milliseconds(500));
  // The flushes queue behind the spinning kernel on its own stream: no slot is read before it
  // ends, so the ring fills and the rest launch inline, in order.
  int32_t const steps = kSlots + 40;
  for (int32_t step = 0; step < steps; ++step) {
    queueStep(batch, step, busy.stream());
    batch.flush(busy.stream());
  }
  EXPECT_EQ(busy.query(), cudaErrorNotReady) << "a flush waited for the GPU";
  EXPECT_EQ(batch.ringLaunches(), kSlots);
  EXPECT_EQ(batch.launches(), steps);
  busy.drain();
  EXPECT_EQ(test::readAs<int32_t>(mTable), mTableModel);
  EXPECT_EQ(test::readAs<int32_t>(mLengths), mLengthModel);
  EXPECT_EQ(test::readAs<int32_t>(mLog), mLogModel);
  // Once the GPU has read them, the slots serve flushes again (on the ring's stream).
  queueStep(batch, steps, busy.stream());
  batch.flush(busy.stream());
  busy.drain();
  EXPECT_EQ(batch.ringLaunches(), kSlots + 1);
  EXPECT_EQ(test::readAs<int32_t>(mTable), mTableModel);
  EXPECT_EQ(test::readAs<int32_t>(mLog), mLogModel);
}

#if MKV_WITH_CUDA
TEST_F(PatchRingTest, ACapturedFlushCarriesItsPatchByValue) {
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  cudaOk(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal), "begin capture");
  queueStep(batch, 5, stream());
  batch.flush(stream());
  cudaGraph_t graph = nullptr;
  cudaOk(cudaStreamEndCapture(stream(), &graph), "end capture");
  EXPECT_EQ(batch.ringLaunches(), 0) << "a replay must not read a slot rewritten since";
  // Later flushes through the ring rewrite the slots; the graph still writes what it captured.
  for (int32_t step = 8; step < 8 + kSlots; ++step) {
    queueStep(batch, step, stream());
    batch.flush(stream());
  }
  synchronize();
  EXPECT_EQ(batch.ringLaunches(), kSlots) << "the flushes after the capture used the ring";
  cudaGraphExec_t exec = nullptr;
  cudaOk(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cudaOk(cudaGraphLaunch(exec, stream()), "replay");
  synchronize();
  std::vector<int32_t> expected = mTableModel;
  expected[5] = 5;
  EXPECT_EQ(test::readAs<int32_t>(mTable), expected);
  EXPECT_EQ(test::readAs<int32_t>(mLengths), std::vector<int32_t>(4, 5));
  cudaOk(cudaGraphExecDestroy(exec), "destroy exec");
  cudaOk(cudaGraphDestroy(graph), "destroy graph");
}
#endif

}  // namespace
}  // namespace mkv::gputest
