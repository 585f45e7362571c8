#pragma once
/// \file kernel_params.h
/// Launch descriptors shared by the launchers (kernels/launchers.cpp), the host reference twins
/// (kernels/host_reference.cpp) and the CUDA implementations (kernels/*.cu). A descriptor is
/// passed by value as the kernel's `__grid_constant__` parameter, so a launch needs no
/// descriptor upload and stays graph-capturable. Plain C++ (compiles with g++ and nvcc).
/// Private to the library: not installed.

#include <cstdint>

#include "mkv/cuda_types.h"
#include "mkv/kernels.h"

namespace mkv::kernels::detail {

struct CopyPagesLaunch {
  void* srcLayers[kMaxLayers];
  void* dstLayers[kMaxLayers];
  int32_t const* srcIds;       // [numItems]
  int32_t const* dstIds;       // [numItems]
  int32_t const* tokenCounts;  // [numItems] or nullptr (whole pages)
  int64_t tokenBytes;          // bytes of one token row
  int32_t numLayers;
  int32_t numItems;
  int32_t srcNumPages;  // pages per half in src (V half starts srcNumPages pages after K)
  int32_t dstNumPages;
  int32_t tokensPerPage;
};

struct RowBufferDesc {
  uint8_t* data;
  int64_t rowBytes;
};

struct CompactBatchLaunch {
  RowBufferDesc buffers[kMaxRowBuffers];
  int32_t const* oldToNew;  // [oldBatch]
  int32_t numBuffers;
  int32_t oldBatch;
  int32_t newBatch;
};

struct RowCopyDesc {
  uint8_t const* src;
  uint8_t* dst;
  int64_t rowBytes;
  int64_t srcNumRows;
  int64_t dstNumRows;
};

/// For every buffer pair: dst row dstRows[i] (or i when dstRows is null) = src row srcRows[i]
/// (or i when null). A skipped item (an index outside its buffer, including -1) leaves its
/// destination alone, unless fillSkipped is set: then a valid destination row whose source
/// index is invalid is filled with 0xFF bytes (int32 -1; page-table gathers).
struct CopyRowsLaunch {
  RowCopyDesc buffers[kMaxRowBuffers];
  int32_t const* srcRows;
  int32_t const* dstRows;
  int32_t numBuffers;
  int32_t numItems;
  int32_t fillSkipped;
};

struct ZeroRowsLaunch {
  RowBufferDesc buffers[kMaxRowBuffers];
  int64_t numRows[kMaxRowBuffers];
  int32_t const* rows;  // [numItems]
  int32_t numBuffers;
  int32_t numItems;
};

/// A write outside dst or a value index outside the patch is skipped (GPU patches cannot be
/// validated on the host).
struct Int32PatchLaunch {
  int32_t* dst;
  int32_t const* patch;  // numRanges (offset, count, valueStart) triples, then the values
  int64_t dstNumel;
  int64_t patchNumel;
  int32_t numRanges;
};

// Host reference twins: synchronous, same semantics bit for bit.
void copyPagesHost(CopyPagesLaunch const& launch);
void compactBatchHost(CompactBatchLaunch const& launch);
void copyRowsHost(CopyRowsLaunch const& launch);
void zeroRowsHost(ZeroRowsLaunch const& launch);
void applyInt32PatchHost(Int32PatchLaunch const& launch);

// CUDA implementations (kernels/*.cu), present when MKV_WITH_CUDA. Each is one launch.
cudaError_t copyPagesCuda(CopyPagesLaunch const& launch, cudaStream_t stream);
cudaError_t compactBatchCuda(CompactBatchLaunch const& launch, cudaStream_t stream);
cudaError_t copyRowsCuda(CopyRowsLaunch const& launch, cudaStream_t stream);
cudaError_t zeroRowsCuda(ZeroRowsLaunch const& launch, cudaStream_t stream);
cudaError_t applyInt32PatchCuda(Int32PatchLaunch const& launch, cudaStream_t stream);

}  // namespace mkv::kernels::detail
