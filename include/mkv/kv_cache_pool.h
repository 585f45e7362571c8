#pragma once
/// \file kv_cache_pool.h
/// Physical paged KV storage for a group of attention layers of one geometry, plus the
/// execution-ordered KV-length tensor the attention kernels read.

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/kernels.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

namespace detail {
class Int32UploadRegions;
}

struct KVCachePoolConfig {
  int32_t numLayers = 0;  ///< attention layers stored in this pool (<= kernels::kMaxLayers)
  int32_t numKVHeads = 0;
  int32_t headDim = 0;
  int32_t tokensPerPage = 128;  ///< power of two in [16, 1024]
  int32_t numPages = 0;         ///< pages per half; a page id addresses that page in every layer
  int32_t maxBatchSize = 0;     ///< rows of the KV-length tensor
  DataType dataType = DataType::kFloat16;
  DeviceType deviceType = DeviceType::kGPU;
};

/// Per layer one zero-initialised buffer `[2, numPages, tokensPerPage, numKVHeads, headDim]`
/// (the K half, then the V half). Page id p addresses K page p and V page p of every layer.
/// A reduced pool for bounded-SWA layers is simply a second KVCachePool with its own id space.
///
/// The KV-length tensor `[activeBatchSize]` (int32, capacity maxBatchSize, on the pool's
/// device) holds, per execution row, the tokens whose KV is materialised. It is
/// execution-ordered: batch compaction compacts it, while page-table rows never move.
///
/// Thread-safety: one writer (the engine thread). All device writes are ordered on the stream
/// passed to each call; host-side state changes immediately. Length uploads share one staging
/// buffer, so the length writes of one pool must be ordered (one stream).
class KVCachePool {
 public:
  /// Validates the config (throws mkv::Error naming the bad field) and allocates.
  explicit KVCachePool(KVCachePoolConfig const& config);
  ~KVCachePool();
  KVCachePool(KVCachePool const&) = delete;
  KVCachePool& operator=(KVCachePool const&) = delete;

  KVCachePoolConfig const& config() const noexcept { return mConfig; }
  int32_t numLayers() const noexcept { return mConfig.numLayers; }
  int32_t numPages() const noexcept { return mConfig.numPages; }
  int32_t tokensPerPage() const noexcept { return mConfig.tokensPerPage; }
  int32_t maxBatchSize() const noexcept { return mConfig.maxBatchSize; }
  DeviceType deviceType() const noexcept { return mConfig.deviceType; }
  /// Bytes of one token row of one half of one layer: numKVHeads * headDim * dtype size.
  int64_t tokenBytes() const noexcept;
  /// Bytes of one page of one half of one layer.
  int64_t pageBytes() const noexcept { return tokenBytes() * mConfig.tokensPerPage; }
  /// Bytes of all layers' K and V storage: numPages x bytesPerPage(config()).
  int64_t totalBytes() const noexcept;
  /// Bytes one page id addresses in a pool of `config`'s geometry: K and V of every layer
  /// (numPages and the device are not read). For sizing a pool from a byte budget before it is
  /// built; the geometry is not validated (the constructor does that).
  static int64_t bytesPerPage(KVCachePoolConfig const& config) noexcept;

  /// Layer l's buffer `[2, numPages, tokensPerPage, numKVHeads, headDim]`.
  Tensor& layer(int32_t l);
  Tensor const& layer(int32_t l) const;
  /// Descriptor for the copy kernels (all layers, K and V halves).
  kernels::PagedBuffers pagedBuffers() const noexcept;

  /// KV-length tensor viewed as `[activeBatchSize]`.
  Tensor& kvLengths() noexcept { return mKvLengths; }
  Tensor const& kvLengths() const noexcept { return mKvLengths; }
  int32_t activeBatchSize() const noexcept { return mActiveBatchSize; }

  /// Starts a new batch: active batch = lengths.size() and the device lengths are set to
  /// `lengths` (the reuse lengths: tokens already materialised per row). Stream-ordered.
  void resetForNewSequences(std::span<int32_t const> lengths, cudaStream_t stream);
  /// resetForNewSequences, but the length write joins `batch` (flushed by the caller on
  /// `stream` before anything reads the lengths there) when it fits the inline limit; a larger
  /// one flushes `batch` and is copied at once.
  void resetForNewSequences(std::span<int32_t const> lengths, kernels::InlinePatchBatch& batch,
                            cudaStream_t stream);
  /// Overwrites the lengths of rows [firstRow, firstRow + lengths.size()) of the active batch
  /// (engine commits after an execution; seating an in-flight joiner). Stream-ordered, after the
  /// writes of orderWritesAfter's batch (a failed flush of those throws, nothing written).
  void writeLengths(int32_t firstRow, std::span<int32_t const> lengths, cudaStream_t stream);
  /// Changes the active batch size without touching lengths (rows beyond the old size keep
  /// whatever they held). Throws outside [0, maxBatchSize].
  void setActiveBatchSize(int32_t batchSize);
  /// Compacts the lengths with the order-preserving mapping (one kernel; mapping is int32
  /// `[activeBatchSize]` on the pool's device), then sets the active batch to newBatchSize.
  /// The kernel orders itself through a workspace the pool allocated at construction, so the
  /// compactions of one pool must be ordered (one stream), like its other length writes.
  void compactLengths(Tensor const& oldToNew, int32_t newBatchSize, cudaStream_t stream);

  /// Orders the pool's own length writes (writeLengths, resetForNewSequences without a batch,
  /// compactLengths) after the writes `queued` holds: each, once its arguments are valid, first
  /// flushes `queued` on its stream when it is not empty (one more launch), so the device sees the
  /// lengths in call order even while lifecycle calls leave theirs for the engine step
  /// (DeviceWriteTiming::kEngineStep). When that flush fails the call throws mkv::Error naming
  /// itself and the CUDA error, changes nothing and leaves `queued` as it was. Null: nothing to
  /// order after. Set by the write queue of the runtime or of a backend (DeviceWriteQueue::watch),
  /// which resets it when it is destroyed.
  void orderWritesAfter(kernels::InlinePatchBatch* queued) noexcept { mQueuedWrites = queued; }
  kernels::InlinePatchBatch const* writesOrderedAfter() const noexcept { return mQueuedWrites; }

 private:
  KVCachePoolConfig mConfig;
  std::vector<Tensor> mLayers;
  std::vector<void*> mLayerBases;
  Tensor mKvLengths;
  int32_t mActiveBatchSize = 0;
  /// Both resetForNewSequences: validates, writes the lengths (into `batch` when given), sets
  /// the active batch size.
  void resetLengths(std::span<int32_t const> lengths, kernels::InlinePatchBatch* batch,
                    cudaStream_t stream);
  /// Writes lengths[i] to row firstRow + i of the length tensor: queued in `batch` (nullptr: the
  /// pool's own, flushed here: one inline patch launch), or for batches beyond the inline limit
  /// one copy from pinned staging.
  void uploadLengths(int32_t firstRow, std::span<int32_t const> lengths,
                     kernels::InlinePatchBatch* batch, cudaStream_t stream);
  /// Flushes mQueuedWrites when it holds writes. A failed launch throws mkv::Error naming `call`;
  /// the queued writes stay queued and the pool is unchanged.
  void flushQueuedWrites(char const* call, cudaStream_t stream);

  /// Staging of length writes beyond the inline limit: one pinned region, copied into mKvLengths.
  std::unique_ptr<detail::Int32UploadRegions> mLengthUploads;
  kernels::InlinePatchBatch mLengthWrites;  ///< inline length writes of the pool's own calls
  kernels::InlinePatchBatch* mQueuedWrites = nullptr;  ///< orderWritesAfter's batch (borrowed)
  Tensor mCompactWorkspace;  ///< kernels::compactBatch's workspace (GPU pools; empty on kCPU)
};

}  // namespace mkv
