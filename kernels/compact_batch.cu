/// compactBatch on the GPU: order-preserving in-place compaction of every buffer in one launch.
///
/// Why it is safe in place (cf. vLLM PR #50729): an order-preserving mapping sends old row i to
/// d_i <= i. A CTA owns one column chunk of one buffer and sweeps the old rows upward in
/// windows: it loads the chunk of every moving row of the window into registers, waits at a
/// barrier, then stores them. A store of window w writes a row d_i <= i < end of w, whose old
/// contents were loaded in window w or earlier; loads of later windows read rows >= end of w,
/// which nothing writes any more. No other CTA touches the chunk, so no row is overwritten
/// before it was read, for any order-preserving mapping.
///
/// Parallelism therefore comes from column chunks (and buffers), and from the rows of one
/// window: grid.y = buffer, grid.x = column chunk.
#include <algorithm>

#include "kernel_params.h"
#include "vector_copy.cuh"

namespace mkv::kernels::detail {
namespace {

/// Threads per CTA and rows each thread has in flight per window: 512 x 8 x 16 B = 64 KiB per
/// window (64 registers at 16 B, two CTAs per SM).
constexpr int32_t kCompactThreads = 512;
constexpr int32_t kCompactRowsInFlight = 8;
/// Column chunks a buffer is cut into when its rows are wide enough (256: about two CTAs per SM
/// of an H200 for one buffer), and the narrowest chunk (64 B, two 32-byte sectors per row).
/// Measured on an H200 (docs/benchmarks.md, 2026-12-02), half the rows dropped: at n = 256 rows
/// (real batches) 7.6-11.8 us, 0.66-0.75 x a memcpy of the moved bytes, launch bound like the
/// memcpy itself; at n = 32768 the serial window sweep of one CTA per column chunk reaches only
/// 0.15 (2 KiB rows: 32 CTAs), 0.38 (8 KiB), 0.57 (16 KiB) and 0.73 (64 KiB). Row-parallel
/// in-place compaction needs ordering between CTAs (a window may overwrite rows an earlier
/// window still has to read); docs/benchmarks.md describes the redesign.
constexpr int64_t kCompactTargetChunks = 256;
constexpr int64_t kCompactMinChunkBytes = 64;
/// grid.x limit (a row of 2^31 x 512 x 16 B is far beyond any memory).
constexpr int64_t kMaxCompactChunks = (int64_t{1} << 31) - 1;

/// How one buffer is cut into column chunks: `lanes` consecutive threads (a power of two)
/// cover one chunk of a row with `Width`-byte accesses.
struct CompactGeometry {
  int32_t lanes;
  int64_t chunks;
};

__host__ __device__ constexpr int64_t nextPowerOfTwo(int64_t value) {
  int64_t result = 1;
  while (result < value) {
    result *= 2;
  }
  return result;
}

__host__ __device__ constexpr CompactGeometry compactGeometry(int64_t rowBytes, int32_t width) {
  int64_t const vectorsPerRow = rowBytes / width;
  int64_t lanes = nextPowerOfTwo((vectorsPerRow + kCompactTargetChunks - 1) / kCompactTargetChunks);
  int64_t const minLanes = kCompactMinChunkBytes / width;
  lanes = lanes < minLanes ? minLanes : lanes;
  lanes = lanes > kCompactThreads ? kCompactThreads : lanes;
  int64_t const rowLanes = nextPowerOfTwo(vectorsPerRow);
  lanes = lanes > rowLanes ? rowLanes : lanes;
  return CompactGeometry{static_cast<int32_t>(lanes), (vectorsPerRow + lanes - 1) / lanes};
}

template <int Width>
__global__ void __launch_bounds__(kCompactThreads)
    compactBatchKernel(__grid_constant__ CompactBatchLaunch const launch) {
  using V = Vec<Width>;
  RowBufferDesc const& buffer = launch.buffers[blockIdx.y];
  uint8_t* const data = buffer.data;
  int64_t const rowBytes = buffer.rowBytes;
  CompactGeometry const geometry = compactGeometry(rowBytes, Width);
  if (blockIdx.x >= geometry.chunks) {
    return;  // the whole CTA leaves: no barrier is skipped by part of it
  }
  int32_t const lanes = geometry.lanes;
  int32_t const lane = static_cast<int32_t>(threadIdx.x) % lanes;
  int32_t const rowsPerPass = kCompactThreads / lanes;
  int32_t const rowInPass = static_cast<int32_t>(threadIdx.x) / lanes;
  int64_t const column = (int64_t{blockIdx.x} * lanes + lane) * Width;
  bool const columnInRow = column < rowBytes;
  int32_t const rowsPerWindow = rowsPerPass * kCompactRowsInFlight;

  for (int32_t windowStart = 0; windowStart < launch.oldBatch; windowStart += rowsPerWindow) {
    V values[kCompactRowsInFlight];
    int32_t targets[kCompactRowsInFlight];
#pragma unroll
    for (int32_t k = 0; k < kCompactRowsInFlight; ++k) {
      int32_t const oldRow = windowStart + rowInPass + k * rowsPerPass;
      targets[k] = -1;
      if (columnInRow && oldRow < launch.oldBatch) {
        int32_t const newRow = launch.oldToNew[oldRow];
        if (newRow >= 0 && newRow < launch.newBatch && newRow != oldRow) {
          targets[k] = newRow;
          values[k] = *reinterpret_cast<V const*>(data + oldRow * rowBytes + column);
        }
      }
    }
    __syncthreads();  // every load of the window precedes every store of it
#pragma unroll
    for (int32_t k = 0; k < kCompactRowsInFlight; ++k) {
      if (targets[k] >= 0) {
        *reinterpret_cast<V*>(data + targets[k] * rowBytes + column) = values[k];
      }
    }
  }
}

}  // namespace

cudaError_t compactBatchCuda(CompactBatchLaunch const& launch, cudaStream_t stream) {
  uint64_t bits = 0;
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    bits |= addressBits(launch.buffers[b].data) | static_cast<uint64_t>(launch.buffers[b].rowBytes);
  }
  int32_t const width = accessWidth(bits);
  int64_t chunks = 1;
  for (int32_t b = 0; b < launch.numBuffers; ++b) {
    chunks = std::max(chunks, compactGeometry(launch.buffers[b].rowBytes, width).chunks);
  }
  if (chunks > kMaxCompactChunks) {
    return cudaErrorInvalidValue;
  }
  dim3 const grid(static_cast<unsigned int>(chunks), static_cast<unsigned int>(launch.numBuffers), 1);
  withAccessWidth(width, [&](auto w) {
    compactBatchKernel<decltype(w)::value><<<grid, kCompactThreads, 0, stream>>>(launch);
  });
  return cudaGetLastError();
}

}  // namespace mkv::kernels::detail
