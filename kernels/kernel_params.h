#pragma once
/// \file kernel_params.h
/// Launch descriptors shared by the launchers (kernels/launchers.cpp), the host reference twins
/// (kernels/host_reference.cpp) and the CUDA implementations (kernels/*.cu). A descriptor is
/// passed by value as the kernel's `__grid_constant__` parameter, so a launch needs no
/// descriptor upload and stays graph-capturable. Plain C++ (compiles with g++ and nvcc).
/// Private to the library: not installed.

#include <cstddef>
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

/// compactBatch's work decomposition (the design: kernels/compact_batch.cu). A work unit is one
/// row tile (consecutive old rows) x one column chunk of one buffer, moved by one CTA of
/// kCompactThreads threads holding kCompactVectorsPerThread vectors each: a tile of
/// 2^kCompactTileVectorsLog2 vectors (32 KiB at 16-byte width). Plain constexpr functions, so
/// the launcher (unit bound, workspace size) and the kernel (decoding a unit) share them.
/// Chosen from the design's copy measurements (16-byte accesses, >= 4 loads in flight per thread,
/// ~16-32 KiB per CTA: docs/benchmarks.md, "The measurements behind the kernels"). Measured on the
/// H200 (2026-12-03, docs/benchmarks.md G5): 0.75 / 0.77 / 0.80 / 0.83 x memcpy at n = 32768 rows
/// of 2 / 8 / 16 / 64 KiB (the previous column-chunk kernel: 0.15 to 0.74, in
/// docs/benchmarks-history.md), 8.8-13.0 us at
/// n = 256; the release fence and the waits of the ordering keep it below copyRows (0.89-0.94).
/// Larger tiles and persistent CTAs were measured and lost (docs/benchmarks.md, "compactBatch:
/// what the ordering costs").
inline constexpr int32_t kCompactThreads = 256;
inline constexpr int32_t kCompactVectorsPerThread = 8;
inline constexpr int32_t kCompactTileVectorsLog2 = 11;
static_assert(kCompactThreads * kCompactVectorsPerThread == 1 << kCompactTileVectorsLog2);
/// Most units of one launch: grid.x and the 32-bit unit indices of the kernel.
inline constexpr int64_t kMaxCompactUnits = (int64_t{1} << 31) - 1;

/// A unit of a buffer covers 2^chunkVectorsLog2 vectors of each of 2^rowsLog2 rows; a row has
/// `chunks` chunks. The chunk is the row's vector count rounded up to a power of two, at most
/// the whole tile, so narrow rows share a tile (several rows per warp) and wide rows are split
/// into tile-sized chunks (one warp covers 512 contiguous bytes at 16-byte width).
struct CompactTileShape {
  int32_t chunkVectorsLog2;
  int32_t rowsLog2;
  int64_t chunks;
};

constexpr CompactTileShape compactTileShape(int64_t rowBytes, int32_t width) {
  int64_t const rowVectors = rowBytes / width;
  int32_t log2 = 0;
  while (log2 < kCompactTileVectorsLog2 && (int64_t{1} << log2) < rowVectors) {
    ++log2;
  }
  return CompactTileShape{log2, kCompactTileVectorsLog2 - log2,
                          (rowVectors + (int64_t{1} << log2) - 1) >> log2};
}

/// Units of one buffer of `rows` rows at access width `width`; kMaxCompactUnits + 1 when there
/// would be more than kMaxCompactUnits.
constexpr int64_t compactUnits(int64_t rowBytes, int32_t width, int64_t rows) {
  CompactTileShape const shape = compactTileShape(rowBytes, width);
  int64_t const tiles = (rows + (int64_t{1} << shape.rowsLog2) - 1) >> shape.rowsLog2;
  if (tiles != 0 && shape.chunks > kMaxCompactUnits / tiles) {
    return kMaxCompactUnits + 1;
  }
  return tiles * shape.chunks;
}

/// compactBatch's device workspace, in 32-bit words. Words 0-1 are one 64-bit word: the ticket
/// counter (low half) and the launch generation (high half), so one atomic add hands a CTA its
/// unit and the generation together. Word 2 counts finished units in the one launch of every
/// 2^32 - 1 whose generation is kCompactWrapGeneration. Word 3 is padding; then one "loaded"
/// flag per unit: a flag equal to generation + 1 means "loaded in this launch". All zero is the
/// valid initial state.
inline constexpr int64_t kCompactTicketWord = 0;
inline constexpr int64_t kCompactFinishedWord = 2;
inline constexpr int64_t kCompactHeaderWords = 4;
/// The last generation of a cycle: its launch clears every flag and the next starts again at 0,
/// so generation + 1 never wraps to 0 (the value of never-written flags) and no flag written
/// 2^32 launches ago can pass for a fresh one.
inline constexpr uint32_t kCompactWrapGeneration = 0xFFFFFFFEu;

struct CompactBatchLaunch {
  RowBufferDesc buffers[kMaxRowBuffers];
  int32_t const* oldToNew;  // [oldBatch]
  uint32_t* workspace;      // GPU only (the host twin ignores it): kCompactHeaderWords + flags
  int64_t workspaceWords;
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

/// A patch small enough to travel in the kernel's parameters (the classic 4 KiB limit): no
/// upload, no staging, one launch. Same layout and semantics as Int32PatchLaunch's patch, for up
/// to kMaxInlinePatchTargets tensors: ranges [targetRangeEnd[t - 1], targetRangeEnd[t]) write
/// dst[t] (targetRangeEnd[-1] = 0; the last end is numRanges).
struct Int32InlinePatchLaunch {
  int32_t* dst[kMaxInlinePatchTargets];
  int64_t dstNumel[kMaxInlinePatchTargets];
  int32_t targetRangeEnd[kMaxInlinePatchTargets];
  int32_t numTargets;
  int32_t patchNumel;
  int32_t numRanges;
  int32_t patch[kMaxInlinePatchValues];
};
static_assert(sizeof(Int32InlinePatchLaunch) <= 4096, "kernel parameters are limited to 4 KiB");
static_assert(sizeof(Int32InlinePatchLaunch) % 16 == 0, "ring slots are read as 16-byte vectors");

/// The parameters of the graph that applies inline patches from a ring (kernels/patch_ring.h):
/// `slots` are numSlots Int32InlinePatchLaunch in mapped pinned host memory, `executions` a
/// mapped host word counting the graph's executions so far. Execution e reads slot
/// e % numSlots into shared memory, then stores e + 1 into `executions` (the host reuses a slot
/// once the count has passed it) and applies the patch. numSlots is a power of two, so the
/// slot sequence survives the 32-bit counter wrapping.
struct Int32RingPatchLaunch {
  Int32InlinePatchLaunch const* slots;
  uint32_t* executions;
  uint32_t numSlots;
};

/// Row i of an attention-views launch (buildAttentionViews). The prefix sums are the host's: it
/// walks the rows to validate them anyway, while a scan of the parameters in every CTA would read
/// the constant bank at divergent addresses, one address at a time.
struct AttentionViewRow {
  int32_t slot;        // the table row it reads
  int32_t seqLen;      // tokens with KV before the step
  int32_t queryStart;  // new tokens of the rows before it: queryStartLoc[i]
  int32_t kvStart;     // pages of the rows before it: kvIndptr[i]
};

struct AttentionViewsParams {
  int32_t const* table;  // [tableRows, 2, width]: K ids, then V ids
  int32_t* blockTable;   // [numRows, width]
  int32_t* seqLensBefore;
  int32_t* seqLensAfter;
  int32_t* queryStartLoc;  // [numRows + 1]
  int32_t* kvIndptr;       // [numRows + 1]
  int32_t* kvIndices;
  int32_t* kvLastPageLen;
  int64_t* slotMapping;
  int32_t* physicalToLogical;  // [numRows, numPages], or null: not built
  int32_t numRows;
  int32_t width;
  int32_t tokensPerPage;
  int32_t numPages;  // an entry outside [0, numPages) reads as empty
  int32_t nullPage;
  int32_t tableRows;
};

/// The whole launch in the kernel's parameters: rows[0, numRows) and rows[numRows], whose
/// queryStart and kvStart are the totals. One instantiation per capacity (kAttentionViewTiers),
/// so a small step does not pass 32 KiB of parameters.
template <int32_t MaxRows>
struct AttentionViewsLaunch {
  AttentionViewsParams params;
  AttentionViewRow rows[static_cast<std::size_t>(MaxRows) + 1];
};
inline constexpr int32_t kAttentionViewTiers[] = {64, 512, kMaxAttentionViewRows};
static_assert(sizeof(AttentionViewsLaunch<kMaxAttentionViewRows>) <= 32764,
              "kernel parameters are limited to 32,764 bytes");

// Host reference twins: synchronous, same semantics bit for bit.
void copyPagesHost(CopyPagesLaunch const& launch);
void compactBatchHost(CompactBatchLaunch const& launch);
void copyRowsHost(CopyRowsLaunch const& launch);
void zeroRowsHost(ZeroRowsLaunch const& launch);
void applyInt32PatchHost(Int32PatchLaunch const& launch);
void applyInt32InlinePatchHost(Int32InlinePatchLaunch const& launch);
/// `rows` holds params.numRows + 1 entries (AttentionViewsLaunch).
void attentionViewsHost(AttentionViewsParams const& params, AttentionViewRow const* rows);
template <int32_t MaxRows>
void attentionViewsHost(AttentionViewsLaunch<MaxRows> const& launch) {
  attentionViewsHost(launch.params, launch.rows);
}

/// Runs an inline patch launch on `device` (the host twin for kCPU); throws mkv::Error naming
/// `call` when the CUDA launch fails.
void runInt32InlinePatch(DeviceType device, char const* call, Int32InlinePatchLaunch const& launch,
                         cudaStream_t stream);

// CUDA implementations (kernels/*.cu), present when MKV_WITH_CUDA. Each is one launch.
cudaError_t copyPagesCuda(CopyPagesLaunch const& launch, cudaStream_t stream);
cudaError_t compactBatchCuda(CompactBatchLaunch const& launch, cudaStream_t stream);
cudaError_t copyRowsCuda(CopyRowsLaunch const& launch, cudaStream_t stream);
cudaError_t zeroRowsCuda(ZeroRowsLaunch const& launch, cudaStream_t stream);
cudaError_t applyInt32PatchCuda(Int32PatchLaunch const& launch, cudaStream_t stream);
cudaError_t applyInt32InlinePatchCuda(Int32InlinePatchLaunch const& launch, cudaStream_t stream);
/// Instantiated for each of kAttentionViewTiers.
template <int32_t MaxRows>
cudaError_t attentionViewsCuda(AttentionViewsLaunch<MaxRows> const& launch, cudaStream_t stream);
/// Builds and instantiates the one-kernel graph of `ring` on the current device; `*graphExec`
/// receives the cudaGraphExec_t. destroyInt32RingPatchGraph releases it (null: nothing).
cudaError_t createInt32RingPatchGraph(Int32RingPatchLaunch const& ring, void** graphExec);
void destroyInt32RingPatchGraph(void* graphExec) noexcept;
/// One cudaGraphLaunch of a graph made by createInt32RingPatchGraph. Launches of one graph run
/// in launch order, whatever their streams (CUDA's rule for one executable graph).
cudaError_t launchInt32RingPatchGraph(void* graphExec, cudaStream_t stream);
/// Whether `stream` is capturing a graph now (cudaStreamIsCapturing).
cudaError_t streamIsCapturing(cudaStream_t stream, bool* capturing);
/// cudaDeviceSynchronize (a PatchRing's destruction with launches still pending).
cudaError_t synchronizeRingDevice();
// Each loads every instantiation of its file's kernels on the current device (loadKernels()).
cudaError_t loadCopyPagesKernels();
cudaError_t loadCompactBatchKernels();
cudaError_t loadCopyRowsKernels();
cudaError_t loadZeroRowsKernels();
cudaError_t loadInt32PatchKernels();
cudaError_t loadAttentionViewsKernels();

}  // namespace mkv::kernels::detail
