#include "resources/backend_requests.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "core/check.h"
#include "core/device.h"
#include "mkv/logging.h"

namespace mkv::detail {

void validateCompactionMapping(char const* call, std::span<int32_t const> oldToNew,
                               std::size_t oldBatch, int32_t newBatchSize) {
  MKV_REQUIRE(oldToNew.size() == oldBatch, call, "mapping has {} entries for a batch of {}",
              oldToNew.size(), oldBatch);
  MKV_REQUIRE(newBatchSize >= 0 && static_cast<std::size_t>(newBatchSize) <= oldBatch, call,
              "new batch size {} outside [0, {}]", newBatchSize, oldBatch);
  int32_t nextSurvivor = 0;
  for (std::size_t i = 0; i < oldToNew.size(); ++i) {
    if (oldToNew[i] == -1) {
      continue;
    }
    MKV_REQUIRE(oldToNew[i] >= 0 && oldToNew[i] < newBatchSize, call,
                "oldToNew[{}] = {} outside [-1, {})", i, oldToNew[i], newBatchSize);
    MKV_REQUIRE(oldToNew[i] == nextSurvivor, call,
                "mapping is not order-preserving: oldToNew[{}] = {}, expected {}", i, oldToNew[i],
                nextSurvivor);
    ++nextSurvivor;
  }
  MKV_REQUIRE(nextSurvivor == newBatchSize, call, "{} survivors for a new batch of {}",
              nextSurvivor, newBatchSize);
}

void validateDeviceMapping(char const* call, Tensor const& deviceMapping, DeviceType device,
                           std::size_t entries) {
  MKV_REQUIRE(deviceMapping.dataType() == DataType::kInt32 && deviceMapping.deviceType() == device,
              call, "deviceMapping must be int32 on {}", toString(device));
  auto const bytes = static_cast<int64_t>(entries * sizeof(int32_t));
  MKV_REQUIRE(deviceMapping.capacityBytes() >= bytes, call,
              "deviceMapping holds {} bytes, needs {}", deviceMapping.capacityBytes(), bytes);
}

void requireDeviceMappingUnchanged(char const* call, Tensor const& deviceMapping, DeviceType device,
                                   std::size_t entries) {
  MKV_REQUIRE(deviceMapping.numel() == static_cast<int64_t>(entries) &&
                  deviceMapping.deviceType() == device,
              call,
              "deviceMapping was reshaped or replaced since beginBatchCompaction: {} entries on "
              "{}, expected {} on {}",
              deviceMapping.numel(), toString(deviceMapping.deviceType()), entries,
              toString(device));
}

void requireBegunMapping(char const* call, std::span<int32_t const> begun,
                         std::span<int32_t const> keepMapping) {
  MKV_REQUIRE(!begun.empty(), call,
              "no batch compaction was begun (keepMapping [{}]; call beginBatchCompaction first)",
              fmt::join(keepMapping, ", "));
  MKV_REQUIRE(std::ranges::equal(keepMapping, begun), call,
              "keepMapping [{}] differs from the mapping [{}] given to beginBatchCompaction",
              fmt::join(keepMapping, ", "), fmt::join(begun, ", "));
}

void validateResident(char const* call, std::size_t index, ResidentRef ref, int32_t rows,
                      ResidentSlotPool const* residentSlots, std::vector<uint8_t>& seen) {
  MKV_REQUIRE(ref.slot >= 0 && ref.slot < rows, call, "resident {} has slot {} outside [0, {})",
              index, ref.slot, rows);
  MKV_REQUIRE(ref.epoch != 0, call, "resident {} (slot {}) has epoch 0", index, ref.slot);
  if (residentSlots != nullptr) {
    residentSlots->requireHeld(call, ref);
  }
  auto const slot = static_cast<std::size_t>(ref.slot);
  MKV_REQUIRE(seen[slot] == 0, call, "resident slot {} appears twice in the batch", ref.slot);
  seen[slot] = 1;
}

void requireResidentFree(char const* call, CacheSlot slot, std::span<uint8_t const> busy) {
  MKV_REQUIRE(busy[static_cast<std::size_t>(slot)] == 0, call,
              "resident slot {} is held by another active request", slot);
}

bool synchronizeStream(StreamSynchronizer const& synchronizer, cudaStream_t stream,
                       char const* backend) noexcept {
  cudaError_t status = cudaErrorUnknown;
  try {
    status = synchronizer(stream);
  } catch (...) {
    status = cudaErrorUnknown;
  }
  if (status != cudaSuccess) {
    logger()->error("{}: stream synchronisation failed ({}); poisoned", backend,
                    cudaErrorName(status));
    return false;
  }
  return true;
}

}  // namespace mkv::detail
