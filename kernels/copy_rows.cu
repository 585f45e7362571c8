/// copyRows on the GPU (recurrent snapshots, hidden-state capture / restore, page-table row
/// gathers): one launch for every buffer pair and item. grid.y = pair; grid.x walks warp units
/// (item, 2 KiB chunk of the row), so rows up to 2 KiB get one warp and wider rows several.
/// One access width for the launch: the widest every pointer and row size allows.
#include "kernel_params.h"
#include "warp_units.cuh"

namespace mkv::kernels::detail {
namespace {

/// Bytes a skipped item writes when fillSkipped is set (0xFF.. = int32 -1, an empty page entry).
constexpr uint8_t kSkippedFill = 0xFF;

template <int Width>
__global__ void __launch_bounds__(kUnitBlockThreads)
    copyRowsKernel(__grid_constant__ CopyRowsLaunch const launch) {
  RowCopyDesc const& buffer = launch.buffers[blockIdx.y];
  auto const unitsPerRow = static_cast<uint32_t>(unitsPerRun(buffer.rowBytes));
  uint32_t const units = unitsPerRow * static_cast<uint32_t>(launch.numItems);
  int32_t const lane = laneId();

  for (uint32_t unit = firstWarpUnit(); unit < units; unit += warpUnitStride()) {
    uint32_t const item = unit / unitsPerRow;
    int64_t const chunkStart = int64_t{unit - item * unitsPerRow} * kWarpChunkBytes;
    int64_t const srcRow = launch.srcRows != nullptr ? launch.srcRows[item] : item;
    int64_t const dstRow = launch.dstRows != nullptr ? launch.dstRows[item] : item;
    if (dstRow < 0 || dstRow >= buffer.dstNumRows) {
      continue;
    }
    auto const chunkBytes =
        static_cast<uint32_t>(min(buffer.rowBytes - chunkStart, int64_t{kWarpChunkBytes}));
    uint8_t* dst = buffer.dst + dstRow * buffer.rowBytes + chunkStart;
    if (srcRow >= 0 && srcRow < buffer.srcNumRows) {
      warpCopy<Width, true>(dst, buffer.src + srcRow * buffer.rowBytes + chunkStart, chunkBytes,
                            lane);
    } else if (launch.fillSkipped != 0) {
      warpFill<Width>(dst, kSkippedFill, chunkBytes, lane);
    }
  }
}

}  // namespace

cudaError_t copyRowsCuda(CopyRowsLaunch const& launch, cudaStream_t stream) {
  int64_t units = 0;
  uint64_t bits = 0;
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    RowCopyDesc const& buffer = launch.buffers[b];
    units = std::max(units, unitsPerRun(buffer.rowBytes) * launch.numItems);
    bits |=
        addressBits(buffer.src) | addressBits(buffer.dst) | static_cast<uint64_t>(buffer.rowBytes);
  }
  if (units <= 0 || units > kMaxUnitsPerList) {
    return cudaErrorInvalidValue;
  }
  dim3 const grid = warpUnitGrid(units, launch.numBuffers);
  withAccessWidth(accessWidth(bits), [&](auto width) {
    copyRowsKernel<decltype(width)::value><<<grid, kUnitBlockThreads, 0, stream>>>(launch);
  });
  return cudaGetLastError();
}

cudaError_t loadCopyRowsKernels() {
  cudaError_t status = cudaSuccess;
  forEachAccessWidth([&](auto width) {
    status = firstError(status, loadKernel(copyRowsKernel<decltype(width)::value>));
  });
  return status;
}

}  // namespace mkv::kernels::detail
