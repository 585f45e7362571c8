/// buildAttentionViews on the GPU: every view of a step in one launch. grid.y is the step's row
/// (one CTA row per row, so the row's inputs are warp-uniform reads of the parameters); grid.x
/// walks the row's block-table width in chunks of kViewChunkPages pages. A CTA writes its chunk of
/// the row's block-table entries and of its kvIndices, keeps the chunk's ids in shared memory and
/// writes the slot mapping of the row's new tokens whose pages lie in the chunk; the CTA of the
/// first chunk writes the row's lengths, prefix sums and last-page length, and (when asked) the
/// row's physical-to-logical page map. Page ids are read from the table on the device
/// (KVPageTable::deviceTable()), only below the row's page count.
#include <algorithm>
#include <iterator>

#include "kernel_params.h"
#include "vector_copy.cuh"

namespace mkv::kernels::detail {
namespace {

/// Not measured yet: a step writes n x W int32 block-table entries plus a few int32 per row and
/// an int64 per new token (a few KiB to a few MiB), far below what the copy kernels move. To be
/// measured on the H200 with a wide table (W = 8192) and 2,000 rows.
constexpr int32_t kViewThreads = 128;
constexpr int32_t kViewChunkPages = 4 * kViewThreads;
/// grid.x is at most this; wider rows loop (grid stride).
constexpr int64_t kMaxViewBlocksX = 1024;

template <int32_t MaxRows>
__global__ void __launch_bounds__(kViewThreads)
    attentionViewsKernel(__grid_constant__ AttentionViewsLaunch<MaxRows> const launch) {
  AttentionViewsParams const& params = launch.params;
  auto const i = static_cast<int32_t>(blockIdx.y);
  auto const thread = static_cast<int32_t>(threadIdx.x);
  if (i >= params.numRows) {  // an empty step (grid.y is 1): only the prefix sums' first 0
    if (blockIdx.x == 0 && thread == 0) {
      params.queryStartLoc[0] = 0;
      params.kvIndptr[0] = 0;
    }
    return;
  }
  AttentionViewRow const row = launch.rows[i];
  AttentionViewRow const next = launch.rows[i + 1];
  int64_t const pageSize = params.tokensPerPage;
  int64_t const width = params.width;
  int32_t const after = row.seqLen + (next.queryStart - row.queryStart);
  int64_t const pages = (after + pageSize - 1) / pageSize;
  // A slot outside the table reads as a row of empty entries.
  int32_t const* const kIds =
      row.slot >= 0 && row.slot < params.tableRows ? params.table + 2 * width * row.slot : nullptr;
  int32_t* const tableRow = params.blockTable + width * i;
  __shared__ int32_t chunkIds[kViewChunkPages];
  for (int64_t first = int64_t{blockIdx.x} * kViewChunkPages; first < width;
       first += int64_t{gridDim.x} * kViewChunkPages) {
    for (int32_t k = thread; k < kViewChunkPages && first + k < width; k += kViewThreads) {
      int64_t const j = first + k;
      int32_t id = params.nullPage;
      if (j < pages && kIds != nullptr) {
        int32_t const entry = kIds[j];
        if (entry >= 0 && entry < params.numPages) {
          id = entry;
        }
      }
      tableRow[j] = id;
      if (j < pages) {
        params.kvIndices[row.kvStart + j] = id;
      }
      chunkIds[k] = id;
    }
    __syncthreads();
    // The new tokens whose pages lie in this chunk.
    int64_t const begin = max(int64_t{row.seqLen}, first * pageSize);
    int64_t const end = min(int64_t{after}, (first + kViewChunkPages) * pageSize);
    for (int64_t position = begin + thread; position < end; position += kViewThreads) {
      params.slotMapping[row.queryStart + position - row.seqLen] =
          int64_t{chunkIds[position / pageSize - first]} * pageSize + position % pageSize;
    }
    __syncthreads();  // the next chunk rewrites chunkIds
  }
  if (blockIdx.x == 0 && thread == 0) {
    params.seqLensBefore[i] = row.seqLen;
    params.seqLensAfter[i] = after;
    params.queryStartLoc[i + 1] = next.queryStart;
    params.kvIndptr[i + 1] = next.kvStart;
    params.kvLastPageLen[i] = pages == 0 ? 0 : static_cast<int32_t>(after - (pages - 1) * pageSize);
    if (i == 0) {
      params.queryStartLoc[0] = 0;
      params.kvIndptr[0] = 0;
    }
  }
  // FlexAttention's physical-to-logical map of the row: the first CTA clears the row's numPages
  // entries, then writes the logical index of each of its live pages (block-uniform branch).
  if (params.physicalToLogical != nullptr && blockIdx.x == 0) {
    int32_t* const map = params.physicalToLogical + int64_t{params.numPages} * i;
    for (int64_t page = thread; page < params.numPages; page += kViewThreads) {
      map[page] = -1;
    }
    __syncthreads();
    for (int64_t j = thread; j < pages && kIds != nullptr; j += kViewThreads) {
      int32_t const entry = kIds[j];
      if (entry >= 0 && entry < params.numPages) {
        map[entry] = static_cast<int32_t>(j);
      }
    }
  }
}

}  // namespace

template <int32_t MaxRows>
cudaError_t attentionViewsCuda(AttentionViewsLaunch<MaxRows> const& launch, cudaStream_t stream) {
  int64_t const chunks = (int64_t{launch.params.width} + kViewChunkPages - 1) / kViewChunkPages;
  dim3 const grid(static_cast<unsigned int>(std::clamp<int64_t>(chunks, 1, kMaxViewBlocksX)),
                  static_cast<unsigned int>(std::max(launch.params.numRows, 1)), 1);
  attentionViewsKernel<MaxRows><<<grid, kViewThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

static_assert(std::size(kAttentionViewTiers) == 3, "one instantiation per tier below");
template cudaError_t attentionViewsCuda<kAttentionViewTiers[0]>(
    AttentionViewsLaunch<kAttentionViewTiers[0]> const& launch, cudaStream_t stream);
template cudaError_t attentionViewsCuda<kAttentionViewTiers[1]>(
    AttentionViewsLaunch<kAttentionViewTiers[1]> const& launch, cudaStream_t stream);
template cudaError_t attentionViewsCuda<kAttentionViewTiers[2]>(
    AttentionViewsLaunch<kAttentionViewTiers[2]> const& launch, cudaStream_t stream);

cudaError_t loadAttentionViewsKernels() {
  cudaError_t const status = firstError(loadKernel(attentionViewsKernel<kAttentionViewTiers[0]>),
                                        loadKernel(attentionViewsKernel<kAttentionViewTiers[1]>));
  return firstError(status, loadKernel(attentionViewsKernel<kAttentionViewTiers[2]>));
}

}  // namespace mkv::kernels::detail
