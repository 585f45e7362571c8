#pragma once
/// \file attention_views.h
/// Kernel-ready views of one engine step: what FlashAttention and vLLM (`block_table`,
/// `seq_lens`, `slot_mapping`) and FlashInfer (the paged CSR triple) take, built from the page
/// table's rows in execution order, with no -1 entry a kernel could read; for a GPU table, on the
/// device in one launch per step (docs/python.md, "Kernel-ready views").

#include <cstdint>
#include <span>

#include "mkv/cuda_types.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

class KVPageTable;

/// Whether AttentionViews also builds the physical-to-logical page map FlexAttention's paged
/// attention reads (kPerRow: one [numPages] row per step row, rebuilt by every build()).
enum class PhysicalPageMap : uint8_t { kNone, kPerRow };

/// The views of one step, rebuilt by each build() into buffers allocated once at construction, on
/// the table's device (int32 but for the int64 slot mapping). Every view is in execution order: row
/// i is residentSlots[i] of the last build. With P = tokensPerPage, before_i = seqLens[i],
/// after_i = before_i + newTokens[i] and pages_i = ceil(after_i / P):
///
/// - blockTable [n, maxPagesPerRow]: K page id of logical page j < pages_i, nullPage after
/// - seqLensBefore [n]: before_i, tokens with KV before the step (FA's `cache_seqlens`)
/// - seqLensAfter [n]: after_i (vLLM's and FA varlen's `seq_lens`, FlashInfer's lengths)
/// - queryStartLoc [n + 1]: prefix sums of newTokens (`cu_seqlens_q`, FlashInfer's `qo_indptr`)
/// - kvIndptr [n + 1]: prefix sums of pages_i (FlashInfer's `paged_kv_indptr`)
/// - kvIndices [kvIndptr[n]]: each row's first pages_i entries of blockTable, rows in order
/// - kvLastPageLen [n]: after_i - (pages_i - 1) * P, in [1, P]; 0 for an empty row
/// - slotMapping [sum newTokens] int64: blockTable[i][p / P] * P + p % P for each new position
///   p of row i, rows in order, positions ascending (vLLM's `slot_mapping`)
/// - physicalToLogical [n, numPages], only with PhysicalPageMap::kPerRow: entry [i, p] is the
///   logical page j < pages_i whose table entry is page p, -1 for every page row i does not hold
///   (FlexAttention's `PagedAttention.physical_to_logical`, whose `page_table` is blockTable;
///   n * numPages writes a step, so opt-in)
///
/// An entry of the table that holds no page (-1: before a sliding window, in a sparse-window
/// table) becomes nullPage in every view, so a kernel may read any entry; nullPage must be a
/// valid page of the pool (the engine's choice: it is only read, under a length mask). The pages
/// the step writes must be live, and on a dense table every page below after_i: build() throws
/// otherwise. V pages have the K page's id in the pool's V half (`layer(l)` viewed as K and V
/// caches of `[numPages, P, heads, headDim]` each).
///
/// The table's device, fixed at construction, chooses how build() fills the views (both give the
/// same values bit for bit: kernels::buildAttentionViews and its host twin):
/// - kCPU: the host twin reads the table's host rows (current when each lifecycle call returns)
///   and fills host tensors before build() returns.
/// - kGPU: one launch on `stream` fills device tensors from the table's device copy
///   (KVPageTable::deviceTable()); each row's slot, length and new tokens travel in the launch's
///   parameters. build() allocates nothing and waits for nothing. The device copy must hold the
///   host rows build() validates: build() refuses a table with entries not yet uploaded (with
///   DeviceWriteTiming::kEngineStep, call KVCacheRuntime::flushDeviceWrites() first), and `stream`
///   must be ordered after the upload (the runtime's stream is). The views are ready on `stream`
///   after the launch; the next build() rewrites them there, after what the stream ran before.
/// Thread-safety: one writer (the engine thread).
class AttentionViews {
 public:
  /// Views over `table` (kept by reference: it must outlive this object) for pages of
  /// `tokensPerPage` tokens, steps of at most `maxRows` rows and `maxNewTokens` new tokens over
  /// all rows; rows are maxPagesPerRow = table.maxPagesPerSeq() wide. `stream` (kGPU tables: the
  /// engine's stream, never owned; ignored for kCPU) carries every build's launch. Allocates the
  /// views and, for kGPU, loads the library's kernels (kernels::loadKernels). Throws mkv::Error
  /// naming "AttentionViews" for tokensPerPage or maxNewTokens outside [1, 2^30], or maxRows
  /// outside [1, kernels::kMaxAttentionViewRows] or beyond table.maxBatch(). `pageMap` kPerRow
  /// also allocates and builds physicalToLogical() ([maxRows, numPages] int32).
  AttentionViews(KVPageTable const& table, int32_t tokensPerPage, int32_t maxRows,
                 int32_t maxNewTokens, cudaStream_t stream = nullptr,
                 PhysicalPageMap pageMap = PhysicalPageMap::kNone);

  /// Builds every view for the rows `residentSlots` (execution order), whose KV lengths before
  /// the step are `seqLens` and which append `newTokens` tokens each (0: a held row). Validates
  /// everything first and changes nothing when it throws mkv::Error naming "AttentionViews::build"
  /// and the offending value: sizes that disagree or exceed maxRows, a slot out of range or
  /// repeated, a negative length, after_i beyond maxPagesPerRow * P, more than maxNewTokens new
  /// tokens, nullPage outside [0, numPages), a needed page that is empty, or (kGPU) a table
  /// with entries not yet uploaded. kGPU: throws mkv::Error when the launch fails, views unchanged.
  void build(std::span<CacheSlot const> residentSlots, std::span<int32_t const> seqLens,
             std::span<int32_t const> newTokens, PageId nullPage = 0);

  int32_t rows() const noexcept { return mRows; }                    ///< n of the last build
  int32_t newTokenCount() const noexcept { return mNewTokenCount; }  ///< sum of newTokens
  int32_t maxPagesPerRow() const noexcept { return mMaxPagesPerRow; }
  int32_t tokensPerPage() const noexcept { return mTokensPerPage; }
  /// The views' device: the table's.
  DeviceType deviceType() const noexcept { return mDeviceType; }
  /// Launches made by build() so far (host-twin runs for kCPU): one per successful build().
  int64_t launches() const noexcept { return mLaunches; }

  Tensor const& blockTable() const noexcept { return mBlockTable; }
  Tensor const& seqLensBefore() const noexcept { return mSeqLensBefore; }
  Tensor const& seqLensAfter() const noexcept { return mSeqLensAfter; }
  Tensor const& queryStartLoc() const noexcept { return mQueryStartLoc; }
  Tensor const& kvIndptr() const noexcept { return mKvIndptr; }
  Tensor const& kvIndices() const noexcept { return mKvIndices; }
  Tensor const& kvLastPageLen() const noexcept { return mKvLastPageLen; }
  Tensor const& slotMapping() const noexcept { return mSlotMapping; }
  /// Whether build() writes physicalToLogical().
  bool hasPhysicalPageMap() const noexcept { return mPageMap == PhysicalPageMap::kPerRow; }
  /// [n, numPages] (see the class comment). Throws mkv::Error naming
  /// "AttentionViews::physicalToLogical" on views made without PhysicalPageMap::kPerRow.
  Tensor const& physicalToLogical() const;

 private:
  void validate(std::span<CacheSlot const> residentSlots, std::span<int32_t const> seqLens,
                std::span<int32_t const> newTokens, PageId nullPage) const;

  KVPageTable const& mTable;
  DeviceType mDeviceType;
  cudaStream_t mStream;
  /// What the launch reads: the host rows (kCPU) or the device copy (kGPU) of the table.
  Tensor mTableRows;
  int32_t mTokensPerPage;
  int32_t mMaxRows;
  int32_t mMaxNewTokens;
  int32_t mMaxPagesPerRow;
  PhysicalPageMap mPageMap;
  int32_t mRows = 0;
  int32_t mNewTokenCount = 0;
  int64_t mLaunches = 0;
  Tensor mBlockTable;
  Tensor mSeqLensBefore;
  Tensor mSeqLensAfter;
  Tensor mQueryStartLoc;
  Tensor mKvIndptr;
  Tensor mKvIndices;
  Tensor mKvLastPageLen;
  Tensor mSlotMapping;
  Tensor mPhysicalToLogical;  ///< empty unless mPageMap is kPerRow
};

}  // namespace mkv
