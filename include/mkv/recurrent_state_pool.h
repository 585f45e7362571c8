#pragma once
/// \file recurrent_state_pool.h
/// Per-resident recurrent state rows of hybrid (Mamba / linear-attention) models.

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
class Int32Staging;
}

/// All fields must be positive; numLayers <= kernels::kMaxRowBuffers / 2.
struct RecurrentStatePoolConfig {
  int32_t numLayers = 0;          ///< recurrent layers (each has one state and one conv row)
  int32_t numSlots = 0;           ///< resident slots (== KV page-table rows)
  int64_t stateBytesPerSlot = 0;  ///< bytes of one layer's recurrent state row (e.g. H*Dh*S*2)
  int64_t convBytesPerSlot = 0;   ///< bytes of one layer's conv state row
  DeviceType deviceType = DeviceType::kGPU;
};

/// Per recurrent layer a state buffer `[numSlots, stateBytesPerSlot]` and a conv buffer
/// `[numSlots, convBytesPerSlot]` (uint8, zero-initialised). Row `slot` belongs to the resident
/// with that slot; rows never move. The engine's kernels read and write the rows through
/// `state(l)` / `conv(l)`. Thread-safety: one writer. Slot lists travel through one reused
/// staging buffer, so the clears of one pool must be ordered (one stream).
class RecurrentStatePool {
 public:
  explicit RecurrentStatePool(RecurrentStatePoolConfig const& config);
  ~RecurrentStatePool();
  RecurrentStatePool(RecurrentStatePool const&) = delete;
  RecurrentStatePool& operator=(RecurrentStatePool const&) = delete;

  RecurrentStatePoolConfig const& config() const noexcept { return mConfig; }
  int32_t numLayers() const noexcept { return mConfig.numLayers; }
  int32_t numSlots() const noexcept { return mConfig.numSlots; }
  DeviceType deviceType() const noexcept { return mConfig.deviceType; }
  /// All layers' state + conv bytes of one slot.
  int64_t bytesPerSlot() const noexcept;

  Tensor& state(int32_t layer);
  Tensor const& state(int32_t layer) const;
  Tensor& conv(int32_t layer);
  Tensor const& conv(int32_t layer) const;
  /// Every buffer as a row buffer, in the order state(0), conv(0), state(1), conv(1), ...
  std::span<kernels::RowBuffer const> rowBuffers() const noexcept { return mRowBuffers; }

  /// Zeroes one resident's rows in every layer (one launch). Stream-ordered.
  void clearResidentSlot(CacheSlot slot, cudaStream_t stream);
  /// Zeroes several residents' rows in one launch. Throws for a slot out of range or for more
  /// slots than the pool has (nothing enqueued).
  void clearResidentSlots(std::span<CacheSlot const> slots, cudaStream_t stream);

 private:
  RecurrentStatePoolConfig mConfig;
  std::vector<Tensor> mState;
  std::vector<Tensor> mConv;
  std::vector<kernels::RowBuffer> mRowBuffers;
  std::unique_ptr<detail::Int32Staging> mStaging;
};

}  // namespace mkv
