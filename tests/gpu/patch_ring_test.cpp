/// InlinePatchBatch's ring on the GPU (kernels/patch_ring.h): flushes launched as a graph that
/// reads mapped host slots land in launch order across many wraps of the ring; a ring the GPU has
/// not read yet hands over to inline launches without waiting; a stream that captures a graph
/// gets the patch by value.
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

class PatchRingTest : public GpuTest {
 protected:
  /// Flush `step`: entry step % 8 of `table` = step, and a range of lengths that later flushes
  /// overwrite, so a flush applied out of order leaves a wrong value behind.
  void queueStep(kernels::InlinePatchBatch& batch, Tensor& table, Tensor& lengths, int32_t step,
                 cudaStream_t stream) {
    batch.add(kCall, table, step % 8, std::vector<int32_t>{step}, stream);
    batch.add(kCall, lengths, 0, std::vector<int32_t>(4, step), stream);
    mTableModel[static_cast<std::size_t>(step % 8)] = step;
    mLengthModel.assign(4, step);
  }

  std::vector<int32_t> mTableModel = std::vector<int32_t>(8, -1);
  std::vector<int32_t> mLengthModel = std::vector<int32_t>(4, 0);
};

TEST_F(PatchRingTest, FlushesLandInOrderOverManyWrapsOfTheRing) {
  Tensor table = test::int32Tensor(mTableModel, DeviceType::kGPU);
  Tensor lengths = test::int32Tensor(mLengthModel, DeviceType::kGPU);
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  int32_t const steps = 5 * kSlots + 3;
  for (int32_t step = 0; step < steps; ++step) {
    queueStep(batch, table, lengths, step, stream());
    batch.flush(stream());
    if (step % (kSlots / 2) == 0) {
      synchronize();  // the GPU keeps up: every flush finds a free slot
    }
  }
  synchronize();
  EXPECT_EQ(batch.launches(), steps);
  EXPECT_EQ(batch.ringLaunches(), steps) << "every flush went through the ring";
  EXPECT_EQ(test::readAs<int32_t>(table), mTableModel);
  EXPECT_EQ(test::readAs<int32_t>(lengths), mLengthModel);
}

TEST_F(PatchRingTest, AFullRingHandsOverToInlineLaunchesWithoutWaiting) {
  BusyStream busy;
  Tensor table = test::int32Tensor(mTableModel, DeviceType::kGPU);
  Tensor lengths = test::int32Tensor(mLengthModel, DeviceType::kGPU);
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  busy.occupy(std::chrono::milliseconds(500));
  // The flushes queue behind the spinning kernel on its own stream: no slot is read before it
  // ends, so the ring fills and the rest launch inline, in order.
  int32_t const steps = kSlots + 40;
  for (int32_t step = 0; step < steps; ++step) {
    queueStep(batch, table, lengths, step, busy.stream());
    batch.flush(busy.stream());
  }
  EXPECT_EQ(busy.query(), cudaErrorNotReady) << "a flush waited for the GPU";
  EXPECT_EQ(batch.ringLaunches(), kSlots);
  EXPECT_EQ(batch.launches(), steps);
  busy.drain();
  EXPECT_EQ(test::readAs<int32_t>(table), mTableModel);
  EXPECT_EQ(test::readAs<int32_t>(lengths), mLengthModel);
  // Once the GPU has read them, the slots serve flushes again.
  queueStep(batch, table, lengths, steps, stream());
  batch.flush(stream());
  synchronize();
  EXPECT_EQ(batch.ringLaunches(), kSlots + 1);
  EXPECT_EQ(test::readAs<int32_t>(table), mTableModel);
}

#if MKV_WITH_CUDA
TEST_F(PatchRingTest, ACapturedFlushCarriesItsPatchByValue) {
  Tensor table = test::int32Tensor(mTableModel, DeviceType::kGPU);
  Tensor lengths = test::int32Tensor(mLengthModel, DeviceType::kGPU);
  kernels::InlinePatchBatch batch(DeviceType::kGPU);
  cudaOk(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeThreadLocal), "begin capture");
  queueStep(batch, table, lengths, 5, stream());
  batch.flush(stream());
  cudaGraph_t graph = nullptr;
  cudaOk(cudaStreamEndCapture(stream(), &graph), "end capture");
  EXPECT_EQ(batch.ringLaunches(), 0) << "a replay must not read a slot rewritten since";
  // Later flushes through the ring rewrite the slots; the graph still writes what it captured.
  for (int32_t step = 8; step < 8 + kSlots; ++step) {
    queueStep(batch, table, lengths, step, stream());
    batch.flush(stream());
  }
  synchronize();
  cudaGraphExec_t exec = nullptr;
  cudaOk(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cudaOk(cudaGraphLaunch(exec, stream()), "replay");
  synchronize();
  std::vector<int32_t> expected = mTableModel;
  expected[5] = 5;
  EXPECT_EQ(test::readAs<int32_t>(table), expected);
  EXPECT_EQ(test::readAs<int32_t>(lengths), std::vector<int32_t>(4, 5));
  cudaOk(cudaGraphExecDestroy(exec), "destroy exec");
  cudaOk(cudaGraphDestroy(graph), "destroy graph");
}
#endif

}  // namespace
}  // namespace mkv::gputest
