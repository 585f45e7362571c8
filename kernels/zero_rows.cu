/// zeroRows on the GPU: one launch for every buffer and item. grid.y = buffer; grid.x walks
/// warp units (item, 2 KiB chunk of the row). Stores only, at the widest width that every
/// buffer pointer and row size allows.
#include "kernel_params.h"
#include "warp_units.cuh"

namespace mkv::kernels::detail {
namespace {

template <int Width>
__global__ void __launch_bounds__(kUnitBlockThreads)
    zeroRowsKernel(__grid_constant__ ZeroRowsLaunch const launch) {
  RowBufferDesc const& buffer = launch.buffers[blockIdx.y];
  int64_t const numRows = launch.numRows[blockIdx.y];
  auto const unitsPerRow = static_cast<uint32_t>(unitsPerRun(buffer.rowBytes));
  uint32_t const units = unitsPerRow * static_cast<uint32_t>(launch.numItems);
  int32_t const lane = laneId();

  for (uint32_t unit = firstWarpUnit(); unit < units; unit += warpUnitStride()) {
    uint32_t const item = unit / unitsPerRow;
    int64_t const chunkStart = int64_t{unit - item * unitsPerRow} * kWarpChunkBytes;
    int64_t const row = launch.rows[item];
    if (row < 0 || row >= numRows) {
      continue;
    }
    auto const chunkBytes =
        static_cast<uint32_t>(min(buffer.rowBytes - chunkStart, int64_t{kWarpChunkBytes}));
    warpFill<Width>(buffer.data + row * buffer.rowBytes + chunkStart, 0, chunkBytes, lane);
  }
}

}  // namespace

cudaError_t zeroRowsCuda(ZeroRowsLaunch const& launch, cudaStream_t stream) {
  int64_t units = 0;
  uint64_t bits = 0;
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    RowBufferDesc const& buffer = launch.buffers[b];
    units = std::max(units, unitsPerRun(buffer.rowBytes) * launch.numItems);
    bits |= addressBits(buffer.data) | static_cast<uint64_t>(buffer.rowBytes);
  }
  if (units <= 0 || units > kMaxUnitsPerList) {
    return cudaErrorInvalidValue;
  }
  dim3 const grid = warpUnitGrid(units, launch.numBuffers);
  withAccessWidth(accessWidth(bits), [&](auto width) {
    zeroRowsKernel<decltype(width)::value><<<grid, kUnitBlockThreads, 0, stream>>>(launch);
  });
  return cudaGetLastError();
}

cudaError_t loadZeroRowsKernels() {
  cudaError_t status = cudaSuccess;
  forEachAccessWidth([&](auto width) {
    status = firstError(status, loadKernel(zeroRowsKernel<decltype(width)::value>));
  });
  return status;
}

}  // namespace mkv::kernels::detail
