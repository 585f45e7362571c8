/// copyPages on the GPU: one launch for every layer, both halves and every item.
/// grid.y = layer * 2 + half; grid.x walks warp units (item, 2 KiB chunk of its page), so a
/// CTA moves 16 KiB of a large page and a page of <= 2 KiB gets one warp. The access width is
/// the widest that every layer base pointer and tokenBytes allow: 16 B for any real KV
/// geometry, narrower (down to single bytes) for odd shapes, which stay correct.
#include "kernel_params.h"
#include "warp_units.cuh"

namespace mkv::kernels::detail {
namespace {

template <int Width>
__global__ void __launch_bounds__(kUnitBlockThreads)
    copyPagesKernel(__grid_constant__ CopyPagesLaunch const launch, uint32_t unitsPerPage) {
  uint32_t const layer = blockIdx.y / 2;
  uint32_t const half = blockIdx.y % 2;
  auto const* srcLayer = static_cast<uint8_t const*>(launch.srcLayers[layer]);
  auto* dstLayer = static_cast<uint8_t*>(launch.dstLayers[layer]);
  int64_t const pageBytes = launch.tokensPerPage * launch.tokenBytes;
  uint32_t const units = unitsPerPage * static_cast<uint32_t>(launch.numItems);
  int32_t const lane = laneId();

  for (uint32_t unit = firstWarpUnit(); unit < units; unit += warpUnitStride()) {
    uint32_t const item = unit / unitsPerPage;
    int64_t const chunkStart = int64_t{unit - item * unitsPerPage} * kWarpChunkBytes;
    int32_t const srcId = launch.srcIds[item];
    int32_t const dstId = launch.dstIds[item];
    if (srcId < 0 || srcId >= launch.srcNumPages || dstId < 0 || dstId >= launch.dstNumPages) {
      continue;
    }
    int64_t bytes = pageBytes;
    if (launch.tokenCounts != nullptr) {
      int32_t const tokens = min(launch.tokenCounts[item], launch.tokensPerPage);
      bytes = tokens > 0 ? tokens * launch.tokenBytes : 0;
    }
    if (chunkStart >= bytes) {
      continue;
    }
    int64_t const srcOffset = (int64_t{half} * launch.srcNumPages + srcId) * pageBytes + chunkStart;
    int64_t const dstOffset = (int64_t{half} * launch.dstNumPages + dstId) * pageBytes + chunkStart;
    auto const chunkBytes =
        static_cast<uint32_t>(min(bytes - chunkStart, int64_t{kWarpChunkBytes}));
    warpCopy<Width, true>(dstLayer + dstOffset, srcLayer + srcOffset, chunkBytes, lane);
  }
}

}  // namespace

cudaError_t copyPagesCuda(CopyPagesLaunch const& launch, cudaStream_t stream) {
  int64_t const unitsPerPage = unitsPerRun(launch.tokensPerPage * launch.tokenBytes);
  int64_t const units = unitsPerPage * launch.numItems;
  if (units <= 0 || units > kMaxUnitsPerList) {
    return cudaErrorInvalidValue;
  }
  uint64_t bits = static_cast<uint64_t>(launch.tokenBytes);
  for (int32_t l = 0; l < launch.numLayers; ++l) {
    bits |= addressBits(launch.srcLayers[l]) | addressBits(launch.dstLayers[l]);
  }
  dim3 const grid = warpUnitGrid(units, int64_t{2} * launch.numLayers);
  withAccessWidth(accessWidth(bits), [&](auto width) {
    copyPagesKernel<decltype(width)::value>
        <<<grid, kUnitBlockThreads, 0, stream>>>(launch, static_cast<uint32_t>(unitsPerPage));
  });
  return cudaGetLastError();
}

cudaError_t loadCopyPagesKernels() {
  cudaError_t status = cudaSuccess;
  forEachAccessWidth([&](auto width) {
    status = firstError(status, loadKernel(copyPagesKernel<decltype(width)::value>));
  });
  return status;
}

}  // namespace mkv::kernels::detail
