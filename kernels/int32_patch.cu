/// applyInt32Patch on the GPU (page-table uploads): one launch for every range. grid.y walks
/// the ranges; the grid.x CTAs of a range split its values, each thread keeping
/// kLoadsInFlight loads in flight. Ranges are arbitrary int32 offsets on both sides, so the
/// accesses are 4-byte; the patch is small next to the page data it describes. Also the inline
/// patch (kernel parameters) and the ring patch (a graph reading mapped host slots) of
/// InlinePatchBatch.
#include <algorithm>

#include "kernel_params.h"
#include "vector_copy.cuh"

namespace mkv::kernels::detail {
namespace {

/// Threads per CTA. Not measured yet (page-table patches are small next to the pages they
/// describe); to be measured on the H200 with a whole-table upload.
constexpr int32_t kPatchThreads = 256;
constexpr int64_t kPatchValuesPerPass = int64_t{kPatchThreads} * kLoadsInFlight;
/// grid.x is sized so that the average range takes one pass of every CTA, within these bounds
/// (the range lengths themselves may live on the device). grid.y is the hardware limit.
constexpr int64_t kMaxPatchBlocksX = 1024;
constexpr int64_t kMaxPatchBlocksY = 65535;

__global__ void __launch_bounds__(kPatchThreads)
    int32PatchKernel(__grid_constant__ Int32PatchLaunch const launch) {
  for (int64_t r = blockIdx.y; r < launch.numRanges; r += gridDim.y) {
    int64_t const offset = launch.patch[3 * r];
    int64_t const count = launch.patch[3 * r + 1];
    int64_t const valueStart = launch.patch[3 * r + 2];
    int64_t const stride = int64_t{gridDim.x} * kPatchValuesPerPass;
    for (int64_t first = int64_t{blockIdx.x} * kPatchValuesPerPass + threadIdx.x; first < count;
         first += stride) {
      int32_t values[kLoadsInFlight];
      bool valid[kLoadsInFlight];
#pragma unroll
      for (int32_t k = 0; k < kLoadsInFlight; ++k) {
        int64_t const j = first + int64_t{k} * kPatchThreads;
        int64_t const target = offset + j;
        int64_t const source = valueStart + j;
        valid[k] = j < count && target >= 0 && target < launch.dstNumel && source >= 0 &&
                   source < launch.patchNumel;
        values[k] = valid[k] ? __ldg(launch.patch + source) : 0;
      }
#pragma unroll
      for (int32_t k = 0; k < kLoadsInFlight; ++k) {
        if (valid[k]) {
          launch.dst[offset + first + int64_t{k} * kPatchThreads] = values[k];
        }
      }
    }
  }
}

/// The target tensor of inline range `r`: the first whose range end lies beyond it.
__device__ int32_t inlineTarget(Int32InlinePatchLaunch const& launch, int32_t r) {
  int32_t target = 0;
  while (target + 1 < launch.numTargets && r >= launch.targetRangeEnd[target]) {
    ++target;
  }
  return target;
}

/// Applies inline range `r`, thread `first` of `stride` writing values first, first + stride, ...
__device__ void applyInlineRange(Int32InlinePatchLaunch const& launch, int32_t r, int32_t first,
                                 int32_t stride) {
  int32_t const target = inlineTarget(launch, r);
  int32_t* const dst = launch.dst[target];
  int64_t const dstNumel = launch.dstNumel[target];
  int64_t const offset = launch.patch[3 * r];
  int32_t const count = launch.patch[3 * r + 1];
  int32_t const valueStart = launch.patch[3 * r + 2];
  for (int32_t j = first; j < count; j += stride) {
    int64_t const index = offset + j;
    int32_t const source = valueStart + j;
    if (index >= 0 && index < dstNumel && source >= 0 && source < launch.patchNumel) {
      dst[index] = launch.patch[source];
    }
  }
}

/// The inline variant: the patch lives in the parameters. One CTA per range (grid.y), its
/// threads striding over the range's values; the patches are small (<= kMaxInlinePatchValues).
__global__ void __launch_bounds__(kPatchThreads)
    int32InlinePatchKernel(__grid_constant__ Int32InlinePatchLaunch const launch) {
  for (int32_t r = blockIdx.y; r < launch.numRanges; r += gridDim.y) {
    applyInlineRange(launch, r, static_cast<int32_t>(threadIdx.x), kPatchThreads);
  }
}

constexpr int32_t kSlotVectors = sizeof(Int32InlinePatchLaunch) / sizeof(int4);
constexpr int32_t kPatchWarps = kPatchThreads / 32;

/// The ring variant (one CTA, launched by a graph): copies this execution's slot from mapped
/// host memory into shared memory in one round trip over the bus, hands the slot back by
/// counting the execution, then applies the ranges, one warp per range.
__global__ void __launch_bounds__(kPatchThreads)
    int32RingPatchKernel(__grid_constant__ Int32RingPatchLaunch const ring) {
  __shared__ union {
    int4 vectors[kSlotVectors];
    Int32InlinePatchLaunch launch;
  } slot;
  __shared__ uint32_t execution;
  if (threadIdx.x == 0) {
    execution = *static_cast<uint32_t volatile*>(ring.executions);
  }
  __syncthreads();
  auto const* source =
      reinterpret_cast<int4 const*>(ring.slots + (execution & (ring.numSlots - 1)));
  for (int32_t i = threadIdx.x; i < kSlotVectors; i += kPatchThreads) {
    slot.vectors[i] = __ldcv(source + i);  // the host rewrites slots: never a cached copy
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Every load of the slot has completed (its values are in shared memory): free it.
    __threadfence_system();
    *static_cast<uint32_t volatile*>(ring.executions) = execution + 1;
  }
  int32_t const warp = static_cast<int32_t>(threadIdx.x) / 32;
  int32_t const lane = static_cast<int32_t>(threadIdx.x) % 32;
  for (int32_t r = warp; r < slot.launch.numRanges; r += kPatchWarps) {
    applyInlineRange(slot.launch, r, lane, 32);
  }
}

}  // namespace

cudaError_t applyInt32InlinePatchCuda(Int32InlinePatchLaunch const& launch, cudaStream_t stream) {
  auto const ranges =
      static_cast<unsigned int>(std::clamp<int64_t>(launch.numRanges, 1, kMaxPatchBlocksY));
  int32InlinePatchKernel<<<dim3(1, ranges, 1), kPatchThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

cudaError_t createInt32RingPatchGraph(Int32RingPatchLaunch const& ring, void** graphExec) {
  *graphExec = nullptr;
  cudaGraph_t graph = nullptr;
  cudaError_t status = cudaGraphCreate(&graph, 0);
  if (status != cudaSuccess) {
    return status;
  }
  Int32RingPatchLaunch parameters = ring;
  void* arguments[] = {&parameters};
  cudaKernelNodeParams node{};
  node.func = reinterpret_cast<void*>(&int32RingPatchKernel);
  node.gridDim = dim3(1, 1, 1);
  node.blockDim = dim3(kPatchThreads, 1, 1);
  node.kernelParams = arguments;
  cudaGraphNode_t kernelNode = nullptr;
  status = cudaGraphAddKernelNode(&kernelNode, graph, nullptr, 0, &node);
  cudaGraphExec_t exec = nullptr;
  if (status == cudaSuccess) {
    status = cudaGraphInstantiate(&exec, graph, 0);
  }
  (void)cudaGraphDestroy(graph);  // the executable graph keeps what it needs
  if (status == cudaSuccess) {
    *graphExec = exec;
  }
  return status;
}

void destroyInt32RingPatchGraph(void* graphExec) noexcept {
  if (graphExec != nullptr) {
    (void)cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graphExec));
  }
}

cudaError_t launchInt32RingPatchGraph(void* graphExec, cudaStream_t stream) {
  return cudaGraphLaunch(static_cast<cudaGraphExec_t>(graphExec), stream);
}

cudaError_t streamIsCapturing(cudaStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t const result = cudaStreamIsCapturing(stream, &status);
  *capturing = status != cudaStreamCaptureStatusNone;
  return result;
}

cudaError_t synchronizeRingDevice() { return cudaDeviceSynchronize(); }

cudaError_t applyInt32PatchCuda(Int32PatchLaunch const& launch, cudaStream_t stream) {
  int64_t const ranges = std::max<int64_t>(launch.numRanges, 1);
  int64_t const averageValues = (launch.dstNumel + ranges - 1) / ranges;
  int64_t const blocksX = std::clamp<int64_t>(
      (averageValues + kPatchValuesPerPass - 1) / kPatchValuesPerPass, 1, kMaxPatchBlocksX);
  dim3 const grid(static_cast<unsigned int>(blocksX),
                  static_cast<unsigned int>(std::min(ranges, kMaxPatchBlocksY)), 1);
  int32PatchKernel<<<grid, kPatchThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

cudaError_t loadInt32PatchKernels() {
  cudaError_t const status =
      firstError(loadKernel(int32PatchKernel), loadKernel(int32InlinePatchKernel));
  return firstError(status, loadKernel(int32RingPatchKernel));
}

}  // namespace mkv::kernels::detail
