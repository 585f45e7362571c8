/// Every launcher inside stream capture (global mode, so any unsafe call would break it):
/// the capture holds exactly one kernel node, and replaying the instantiated graph gives the
/// host twin's result bit for bit (twice on the same data; compactBatch three times on fresh
/// data, since its workspace carries state from one launch to the next).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <span>
#include <vector>

#include "gpu/gpu_parity.h"
#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv::gputest {
namespace {

using kernels::PagedBuffers;
using kernels::RowBuffer;
using kernels::RowBufferPair;

using Launcher = std::function<void(DeviceType, cudaStream_t)>;

class GraphCaptureGpuTest : public GpuTest {
 protected:
  /// Captures `run(kGPU, stream)` and checks that the capture holds exactly one kernel node;
  /// returns the instantiated graph (nullptr after a failed check).
  cudaGraphExec_t captureOneKernel(Launcher const& run) {
    cudaGraph_t graph = nullptr;
    cudaOk(cudaStreamBeginCapture(stream(), cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    run(DeviceType::kGPU, stream());
    cudaOk(cudaStreamEndCapture(stream(), &graph), "cudaStreamEndCapture");
    std::size_t nodes = 0;
    cudaOk(cudaGraphGetNodes(graph, nullptr, &nodes), "cudaGraphGetNodes");
    cudaGraphExec_t exec = nullptr;
    EXPECT_EQ(nodes, 1u) << "one launch per call";
    if (nodes == 1) {
      cudaGraphNode_t node = nullptr;
      cudaOk(cudaGraphGetNodes(graph, &node, &nodes), "cudaGraphGetNodes");
      cudaGraphNodeType type{};
      cudaOk(cudaGraphNodeGetType(node, &type), "cudaGraphNodeGetType");
      EXPECT_EQ(type, cudaGraphNodeTypeKernel);
      cudaOk(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    }
    cudaOk(cudaGraphDestroy(graph), "cudaGraphDestroy");
    return exec;
  }

  /// `run(device, stream)` issues one launcher call. `outputs` are the buffers it writes,
  /// whose GPU copies are reset to their initial bytes before each replay.
  void captureAndReplay(Launcher const& run, std::vector<MirroredBytes*> const& outputs) {
    std::vector<std::vector<uint8_t>> initial;
    for (MirroredBytes* output : outputs) {
      initial.push_back(output->gpuBytes());
    }
    run(DeviceType::kCPU, nullptr);
    cudaGraphExec_t const exec = captureOneKernel(run);
    ASSERT_NE(exec, nullptr);
    for (int replay = 0; replay < 2; ++replay) {
      SCOPED_TRACE(::testing::Message() << "replay " << replay);
      for (std::size_t o = 0; o < outputs.size(); ++o) {
        outputs[o]->resetGpu(initial[o]);
      }
      cudaOk(cudaGraphLaunch(exec, stream()), "cudaGraphLaunch");
      synchronize();
      for (MirroredBytes const* output : outputs) {
        EXPECT_TRUE(sameBytes(*output));
      }
    }
    cudaOk(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  }

  static cudaStream_t onDevice(DeviceType device, cudaStream_t stream) {
    return device == DeviceType::kGPU ? stream : nullptr;
  }

  std::mt19937_64 mRng{2718};
};

TEST_F(GraphCaptureGpuTest, CopyPagesWithTokenCounts) {
  int32_t const layers = 4;
  int64_t const tokenBytes = 2048;
  int32_t const tokensPerPage = 16;
  int32_t const pages = 8;
  int64_t const layerBytes = 2 * pages * tokensPerPage * tokenBytes;
  MirroredBytes src(test::randomBytes(static_cast<std::size_t>(layers * layerBytes), mRng));
  MirroredBytes dst(std::vector<uint8_t>(static_cast<std::size_t>(layers * layerBytes), kPoison));
  MirroredInt32 const srcIds(std::vector<int32_t>{3, 0, -1, 7, 5});
  MirroredInt32 const dstIds(std::vector<int32_t>{0, 1, 2, 3, -1});
  MirroredInt32 const counts(std::vector<int32_t>{16, 5, 3, 1, 2});
  captureAndReplay(
      [&](DeviceType device, cudaStream_t s) {
        std::vector<void*> srcBases;
        std::vector<void*> dstBases;
        for (int32_t l = 0; l < layers; ++l) {
          srcBases.push_back(src.on(device) + l * layerBytes);
          dstBases.push_back(dst.on(device) + l * layerBytes);
        }
        PagedBuffers const from{srcBases, device, pages, tokensPerPage, tokenBytes};
        PagedBuffers const to{dstBases, device, pages, tokensPerPage, tokenBytes};
        kernels::copyPages(from, to, srcIds.on(device), dstIds.on(device), &counts.on(device),
                           onDevice(device, s));
      },
      {&dst});
}

// compactBatch's CTAs order themselves through a workspace whose ticket counter and generation
// each launch must leave ready for the next: one graph replayed three times, each time on new
// rows and a new mapping (newBatchSize is baked into the graph; survivors past it are ignored).
TEST_F(GraphCaptureGpuTest, CompactBatchReplaysOnFreshData) {
  int32_t const oldBatch = 3000;
  std::vector<int64_t> const widths{4, 2048};
  MirroredBytes lengths(test::randomBytes(oldBatch * 4, mRng));
  MirroredBytes state(test::randomBytes(oldBatch * 2048, mRng));
  std::vector<int32_t> shiftByOne(static_cast<std::size_t>(oldBatch));
  for (int32_t i = 0; i < oldBatch; ++i) {
    shiftByOne[static_cast<std::size_t>(i)] = i - 1;
  }
  MirroredInt32 oldToNew(shiftByOne);
  int32_t const newBatch = oldBatch - 1;
  Tensor workspace({kernels::compactBatchWorkspaceBytes(oldBatch, widths) /
                    static_cast<int64_t>(sizeof(int32_t))},
                   DataType::kInt32, DeviceType::kGPU);
  Tensor none;
  Launcher const run = [&](DeviceType device, cudaStream_t s) {
    std::vector<RowBuffer> const buffers{RowBuffer{lengths.on(device), 4, oldBatch},
                                         RowBuffer{state.on(device), 2048, oldBatch}};
    kernels::compactBatch(buffers, device, oldToNew.on(device), newBatch,
                          device == DeviceType::kGPU ? workspace : none, onDevice(device, s));
  };
  cudaGraphExec_t const exec = captureOneKernel(run);
  ASSERT_NE(exec, nullptr);
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(::testing::Message() << "replay " << replay);
    lengths.reset(test::randomBytes(oldBatch * 4, mRng));
    state.reset(test::randomBytes(oldBatch * 2048, mRng));
    if (replay > 0) {
      std::vector<int32_t> mapping;
      (void)orderPreservingMapping(mapping, oldBatch, replay == 1 ? 0.5 : 0.95, mRng);
      std::span<uint8_t const> const raw(reinterpret_cast<uint8_t const*>(mapping.data()),
                                         mapping.size() * sizeof(int32_t));
      test::writeBytes(oldToNew.cpu, raw);
      test::writeBytes(oldToNew.gpu, raw);
    }
    run(DeviceType::kCPU, nullptr);
    cudaOk(cudaGraphLaunch(exec, stream()), "cudaGraphLaunch");
    synchronize();
    EXPECT_TRUE(sameBytes(lengths));
    EXPECT_TRUE(sameBytes(state));
  }
  cudaOk(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
}

TEST_F(GraphCaptureGpuTest, CopyRowsAndHiddenCapture) {
  MirroredBytes src(test::randomBytes(32 * 8192, mRng));
  MirroredBytes dst(std::vector<uint8_t>(16 * 8192, kPoison));
  MirroredInt32 const from(std::vector<int32_t>{31, 0, 7, -1, 9});
  MirroredInt32 const to(std::vector<int32_t>{15, 2, -1, 3, 0});
  captureAndReplay(
      [&](DeviceType device, cudaStream_t s) {
        std::vector<RowBufferPair> const pairs{
            {RowBuffer{src.on(device), 8192, 32}, RowBuffer{dst.on(device), 8192, 16}}};
        kernels::copyRows(pairs, device, from.on(device), to.on(device), onDevice(device, s));
      },
      {&dst});
  MirroredBytes slab(std::vector<uint8_t>(16 * 8192, kPoison));
  captureAndReplay(
      [&](DeviceType device, cudaStream_t s) {
        Tensor const hidden = Tensor::view(src.on(device), {32, 4096}, DataType::kBFloat16, device);
        Tensor slots = Tensor::view(slab.on(device), {16, 4096}, DataType::kBFloat16, device);
        kernels::captureHiddenRows(hidden, from.on(device), slots, to.on(device),
                                   onDevice(device, s));
      },
      {&slab});
}

TEST_F(GraphCaptureGpuTest, PageTableGatherZeroRowsAndPatch) {
  MirroredBytes table(test::randomBytes(8 * 2 * 64 * 4, mRng));
  MirroredBytes out(std::vector<uint8_t>(8 * 2 * 64 * 4, 0x11));
  MirroredInt32 const slots(std::vector<int32_t>{5, -1, 0, 7});
  captureAndReplay(
      [&](DeviceType device, cudaStream_t s) {
        Tensor const t = Tensor::view(table.on(device), {8, 2, 64}, DataType::kInt32, device);
        Tensor d = Tensor::view(out.on(device), {8, 2, 64}, DataType::kInt32, device);
        kernels::gatherPageTableRows(t, slots.on(device), d, onDevice(device, s));
      },
      {&out});
  MirroredInt32 const rows(std::vector<int32_t>{6, -1, 1});
  captureAndReplay(
      [&](DeviceType device, cudaStream_t s) {
        std::vector<RowBuffer> const buffers{RowBuffer{table.on(device), 512, 8},
                                             RowBuffer{out.on(device), 100, 16}};
        kernels::zeroRows(buffers, device, rows.on(device), onDevice(device, s));
      },
      {&table, &out});
  MirroredInt32 const patch(std::vector<int32_t>{4, 3, 6, 100, 2, 9, 7, 8, 9, 10, 11});
  captureAndReplay(
      [&](DeviceType device, cudaStream_t s) {
        Tensor d = Tensor::view(out.on(device), {8 * 2 * 64}, DataType::kInt32, device);
        kernels::applyInt32Patch(d, patch.on(device), 2, onDevice(device, s));
      },
      {&out});
}

}  // namespace
}  // namespace mkv::gputest
