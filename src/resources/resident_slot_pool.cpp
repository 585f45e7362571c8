#include "mkv/resident_slot_pool.h"

#include <algorithm>

#include "core/check.h"

namespace mkv {

void ResidentSlotPool::reset(int32_t capacity) {
  MKV_REQUIRE(capacity >= 0, "ResidentSlotPool::reset", "capacity must be >= 0, got {}", capacity);
  mEpochs.assign(static_cast<std::size_t>(capacity), 1);
  mHeld.assign(static_cast<std::size_t>(capacity), 0);
  mHeldCount = 0;
}

std::optional<ResidentRef> ResidentSlotPool::acquire() {
  auto const it = std::find(mHeld.begin(), mHeld.end(), uint8_t{0});
  if (it == mHeld.end()) {
    return std::nullopt;
  }
  *it = 1;
  ++mHeldCount;
  auto const slot = static_cast<std::size_t>(it - mHeld.begin());
  return ResidentRef{static_cast<CacheSlot>(slot), mEpochs[slot]};
}

bool ResidentSlotPool::release(ResidentRef ref) {
  if (!contains(ref)) {
    return false;
  }
  auto const slot = static_cast<std::size_t>(ref.slot);
  mHeld[slot] = 0;
  ++mEpochs[slot];
  --mHeldCount;
  return true;
}

bool ResidentSlotPool::contains(ResidentRef ref) const noexcept {
  if (ref.slot < 0 || ref.slot >= capacity()) {
    return false;
  }
  auto const slot = static_cast<std::size_t>(ref.slot);
  return mHeld[slot] != 0 && mEpochs[slot] == ref.epoch;
}

int32_t ResidentSlotPool::available() const noexcept { return capacity() - mHeldCount; }

}  // namespace mkv
