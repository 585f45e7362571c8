#include "mkv/recurrent_state_pool.h"

#include <limits>

#include "core/check.h"
#include "core/device.h"

namespace mkv {

RecurrentStatePool::RecurrentStatePool(RecurrentStatePoolConfig const& config) : mConfig(config) {
  constexpr char const* kCall = "RecurrentStatePool";
  MKV_REQUIRE(config.numLayers >= 1 && config.numLayers <= kernels::kMaxRowBuffers / 2, kCall,
              "numLayers {} is outside [1, {}] (two row buffers per layer)", config.numLayers,
              kernels::kMaxRowBuffers / 2);
  MKV_REQUIRE(config.numSlots > 0, kCall, "numSlots must be positive, got {}", config.numSlots);
  MKV_REQUIRE(config.stateBytesPerSlot > 0, kCall, "stateBytesPerSlot must be positive, got {}",
              config.stateBytesPerSlot);
  MKV_REQUIRE(config.convBytesPerSlot > 0, kCall, "convBytesPerSlot must be positive, got {}",
              config.convBytesPerSlot);
  constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max();
  MKV_REQUIRE(config.stateBytesPerSlot <= kMaxBytes - config.convBytesPerSlot &&
                  config.stateBytesPerSlot + config.convBytesPerSlot <=
                      kMaxBytes / config.numSlots / config.numLayers,
              kCall, "{} layers x {} slots x ({} + {}) bytes overflow int64", config.numLayers,
              config.numSlots, config.stateBytesPerSlot, config.convBytesPerSlot);
  auto const layers = static_cast<std::size_t>(config.numLayers);
  mState.reserve(layers);
  mConv.reserve(layers);
  mRowBuffers.reserve(2 * layers);
  for (std::size_t l = 0; l < layers; ++l) {
    mState.emplace_back(Coords{config.numSlots, config.stateBytesPerSlot}, DataType::kUInt8,
                        config.deviceType);
    mConv.emplace_back(Coords{config.numSlots, config.convBytesPerSlot}, DataType::kUInt8,
                       config.deviceType);
    mRowBuffers.push_back({mState[l].rawPointer(), config.stateBytesPerSlot, config.numSlots});
    mRowBuffers.push_back({mConv[l].rawPointer(), config.convBytesPerSlot, config.numSlots});
  }
  mStaging = std::make_unique<detail::Int32Staging>(config.numSlots, config.deviceType);
}

RecurrentStatePool::~RecurrentStatePool() = default;

int64_t RecurrentStatePool::bytesPerSlot() const noexcept {
  return int64_t{mConfig.numLayers} * (mConfig.stateBytesPerSlot + mConfig.convBytesPerSlot);
}

Tensor& RecurrentStatePool::state(int32_t layer) {
  MKV_REQUIRE(layer >= 0 && layer < mConfig.numLayers, "RecurrentStatePool::state",
              "layer {} is outside [0, {})", layer, mConfig.numLayers);
  return mState[static_cast<std::size_t>(layer)];
}

Tensor const& RecurrentStatePool::state(int32_t layer) const {
  return const_cast<RecurrentStatePool*>(this)->state(layer);
}

Tensor& RecurrentStatePool::conv(int32_t layer) {
  MKV_REQUIRE(layer >= 0 && layer < mConfig.numLayers, "RecurrentStatePool::conv",
              "layer {} is outside [0, {})", layer, mConfig.numLayers);
  return mConv[static_cast<std::size_t>(layer)];
}

Tensor const& RecurrentStatePool::conv(int32_t layer) const {
  return const_cast<RecurrentStatePool*>(this)->conv(layer);
}

void RecurrentStatePool::clearResidentSlot(CacheSlot slot, cudaStream_t stream) {
  clearResidentSlots(std::span<CacheSlot const>(&slot, 1), stream);
}

void RecurrentStatePool::clearResidentSlots(std::span<CacheSlot const> slots, cudaStream_t stream) {
  constexpr char const* kCall = "RecurrentStatePool::clearResidentSlots";
  for (std::size_t i = 0; i < slots.size(); ++i) {
    MKV_REQUIRE(slots[i] >= 0 && slots[i] < mConfig.numSlots, kCall,
                "slots[{}] = {} is outside [0, {})", i, slots[i], mConfig.numSlots);
  }
  // Zeroing is idempotent, so a repeated slot would be harmless, but the staging holds one
  // entry per slot: more entries than slots can only be a caller error.
  MKV_REQUIRE(slots.size() <= static_cast<std::size_t>(mConfig.numSlots), kCall,
              "{} slots given but the pool has only {}", slots.size(), mConfig.numSlots);
  if (slots.empty()) {
    return;
  }
  detail::Int32Staging::Batch batch = mStaging->begin(stream);
  Tensor const rows = batch.add(slots);
  batch.submit();
  kernels::zeroRows(mRowBuffers, mConfig.deviceType, rows, stream);
}

}  // namespace mkv
