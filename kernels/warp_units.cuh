#pragma once
/// \file warp_units.cuh
/// Work decomposition shared by the copy kernels. A copy of many byte runs (pages, rows) is cut
/// into warp units: one unit is one warp copying at most kWarpChunkBytes of one run. Runs up to
/// that size get one warp each (the "warp per row" regime of docs/benchmarks.md, "The measurements
/// behind the kernels"); a larger page is split into consecutive units, so the 8 warps of a CTA
/// cover 16 KiB of it (the "tile per CTA" regime). grid.y selects the run list (layer and half, or
/// buffer); grid.x walks the units of that list, with a grid-stride loop so any size fits the
/// launch limits.

#include <algorithm>
#include <cstdint>

#include "vector_copy.cuh"

namespace mkv::kernels::detail {

/// Warps per CTA: 8 x 32 threads x 4 loads x 16 B = 16 KiB of a large page per CTA, the tile
/// that reached 0.95 x memcpy on an H200 in the design's measurements (docs/benchmarks.md, "The
/// measurements behind the kernels"). Re-measured with copyPages on an H200 (docs/benchmarks.md,
/// "Results (H200)", 2026-12-03): 0.943-0.952 for 32-256 KiB pages, and a 32-layer x 64-page
/// decode step in 39.8 us.
inline constexpr int32_t kWarpsPerBlock = 8;
inline constexpr int32_t kUnitBlockThreads = kWarpsPerBlock * kWarpSize;
/// grid.x never exceeds this; larger unit counts loop (grid stride).
inline constexpr int64_t kMaxBlocksX = int64_t{1} << 20;
/// Most warp units of one run list (2^31 units = 4 TiB, beyond any GPU memory). Unit indices
/// are 32-bit so the per-unit index arithmetic stays cheap; a launcher returns
/// cudaErrorInvalidValue beyond this.
inline constexpr int64_t kMaxUnitsPerList = (int64_t{1} << 31) - 1;

/// Warp units needed for a run of `bytes` bytes.
__host__ __device__ __forceinline__ int64_t unitsPerRun(int64_t bytes) {
  return (bytes + kWarpChunkBytes - 1) / kWarpChunkBytes;
}

/// Grid of `lists` run lists, each of at most `maxUnits` warp units.
inline dim3 warpUnitGrid(int64_t maxUnits, int64_t lists) {
  int64_t const blocks =
      std::clamp<int64_t>((maxUnits + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, kMaxBlocksX);
  return dim3(static_cast<unsigned int>(blocks), static_cast<unsigned int>(lists), 1);
}

__device__ __forceinline__ int32_t laneId() {
  return static_cast<int32_t>(threadIdx.x % kWarpSize);
}

/// First warp unit of the calling warp, and the distance to its next one (no overflow: units
/// < 2^31 and the stride < 2^23).
__device__ __forceinline__ uint32_t firstWarpUnit() {
  return blockIdx.x * kWarpsPerBlock + threadIdx.x / kWarpSize;
}
__device__ __forceinline__ uint32_t warpUnitStride() { return gridDim.x * kWarpsPerBlock; }

}  // namespace mkv::kernels::detail
