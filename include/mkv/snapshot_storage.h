#pragma once
/// \file snapshot_storage.h
/// Device slabs for hybrid checkpoints: recurrent rows, partial KV pages and boundary hidden
/// rows, with stream-ordered capture and restore (docs/context_cache.md, "Hybrid and
/// pure-recurrent checkpoints").

#include <cstdint>
#include <memory>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {

namespace detail {
class Int32Staging;
}

struct SnapshotStorageConfig {
  int32_t recurrentSlots = 0;  ///< checkpoint slots for recurrent rows (and boundary hidden rows)
  int32_t partialKvSlots = 0;  ///< checkpoint slots for partially filled last KV pages
  int64_t boundaryHiddenWidth = 0;  ///< elements per boundary hidden row; 0 = no hidden slab
  DataType boundaryHiddenType = DataType::kFloat16;
};

/// Owns the snapshot slabs; the typed pools of the context cache own only their slot ids.
/// * recurrent slab: per recurrent layer a state and a conv slab `[recurrentSlots, bytes]`;
/// * partial-KV slab: per attention layer `[2, partialKvSlots, tokensPerPage, heads, headDim]`
///   of the base pool (and the same for the draft pool when given);
/// * boundary hidden slab `[recurrentSlots, boundaryHiddenWidth]`.
/// Every capture and restore is one kernel launch on `stream`, covering all layers. Partial
/// copies move exactly the first `validTokens` token rows of the K and V halves. Slots and
/// page ids are validated on the host (mkv::Error, nothing enqueued). Thread-safety: one writer.
/// Ids travel through one reused staging buffer, so the operations of one storage must be
/// ordered (one stream).
class SnapshotStorage {
 public:
  /// `recurrent` may be null (attention-only) and `baseKv` may be null (pure recurrent);
  /// `draftKv` is the paired draft pool for Hybrid-MTP, or null. Borrowed, must outlive this.
  /// A slab exists only when its pool and slot count are given: recurrent slabs need
  /// `recurrent` and recurrentSlots > 0; partial-KV slabs need `baseKv` (and `draftKv` for the
  /// draft slab) and partialKvSlots > 0; the hidden slab needs boundaryHiddenWidth > 0 and
  /// recurrentSlots > 0. Throws for negative counts, partialKvSlots > 0 without `baseKv`, a
  /// draft pool without a base pool, a hidden width without slots or without any pool to take
  /// the device from, and pools on different devices.
  SnapshotStorage(SnapshotStorageConfig const& config, RecurrentStatePool* recurrent,
                  KVCachePool* baseKv, KVCachePool* draftKv = nullptr);
  ~SnapshotStorage();
  SnapshotStorage(SnapshotStorage const&) = delete;
  SnapshotStorage& operator=(SnapshotStorage const&) = delete;

  /// Exact bytes one recurrent checkpoint slot costs: sum over layers of state + conv bytes.
  static int64_t recurrentBytesPerSlot(RecurrentStatePool const& recurrent) noexcept;
  /// Exact bytes one partial-KV slot costs for `pool`: layers * 2 * tokensPerPage * tokenBytes.
  static int64_t partialKvBytesPerSlot(KVCachePool const& pool) noexcept;
  /// Exact bytes of one boundary hidden row.
  static int64_t boundaryHiddenBytesPerSlot(int64_t width, DataType type) noexcept;
  /// Bytes of every slab this storage allocated.
  int64_t totalBytes() const noexcept;

  SnapshotStorageConfig const& config() const noexcept { return mConfig; }
  /// Device of the slabs: that of the given pools (kCPU when none is given).
  DeviceType deviceType() const noexcept;
  bool hasDraft() const noexcept { return mDraftKv != nullptr; }
  bool hasBoundaryHidden() const noexcept { return mConfig.boundaryHiddenWidth > 0; }

  void captureRecurrent(int32_t snapshotSlot, CacheSlot resident, cudaStream_t stream);
  void restoreRecurrent(int32_t snapshotSlot, CacheSlot resident, cudaStream_t stream);

  /// Copies the first validTokens (1..tokensPerPage) token rows of K and V page `page` of
  /// every base layer (and of `draftPage` of the draft pool when it is >= 0) into the slot.
  /// Base and draft are two launches (their page ids differ, and one copyPages item applies the
  /// same ids to every layer of one call); the staged ids are shared by both.
  void capturePartialKv(int32_t snapshotSlot, PageId page, int32_t validTokens, PageId draftPage,
                        cudaStream_t stream);
  void restorePartialKv(int32_t snapshotSlot, PageId page, int32_t validTokens, PageId draftPage,
                        cudaStream_t stream);

  /// slab[slot] = hidden[row]; hidden `[tokens, boundaryHiddenWidth]` of boundaryHiddenType.
  void captureBoundaryHidden(int32_t snapshotSlot, Tensor const& hidden, int32_t row,
                             cudaStream_t stream);
  /// hidden[row] = slab[slot].
  void restoreBoundaryHidden(int32_t snapshotSlot, Tensor& hidden, int32_t row,
                             cudaStream_t stream);

  /// Recurrent layer `layer`'s state and conv slabs `[recurrentSlots, bytes]` (uint8): the
  /// engine writes the reuse points it is handed (ReusePointCapture::snapshotSlot) into them;
  /// every other row belongs to the cache. Throws for a layer outside the slabs.
  Tensor& recurrentStateSlab(int32_t layer);
  Tensor& recurrentConvSlab(int32_t layer);
  /// Raw slabs, for tests and diagnostics.
  Tensor const& recurrentStateSlab(int32_t layer) const;
  Tensor const& recurrentConvSlab(int32_t layer) const;
  Tensor const& partialKvSlab(int32_t layer, bool draft = false) const;
  Tensor const& boundaryHiddenSlab() const;

 private:
  void copyPartialKv(char const* call, bool capture, int32_t snapshotSlot, PageId page,
                     int32_t validTokens, PageId draftPage, cudaStream_t stream);
  void validateBoundaryHidden(char const* call, int32_t snapshotSlot, Tensor const& hidden,
                              int32_t row) const;

  SnapshotStorageConfig mConfig;
  RecurrentStatePool* mRecurrent;
  KVCachePool* mBaseKv;
  KVCachePool* mDraftKv;
  std::vector<Tensor> mStateSlabs;
  std::vector<Tensor> mConvSlabs;
  std::vector<Tensor> mPartialBase;
  std::vector<Tensor> mPartialDraft;
  std::vector<void*> mPartialBaseBases;
  std::vector<void*> mPartialDraftBases;
  std::vector<kernels::RowBufferPair> mCapturePairs;  // pool rows -> slab rows, every layer
  std::vector<kernels::RowBufferPair> mRestorePairs;  // slab rows -> pool rows, every layer
  Tensor mBoundaryHidden;
  std::unique_ptr<detail::Int32Staging> mStaging;
};

}  // namespace mkv
