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

uint64_t ResidentSlotPool::epoch(CacheSlot slot) const noexcept {
  return slot >= 0 && slot < capacity() ? mEpochs[static_cast<std::size_t>(slot)] : 0;
}

void ResidentSlotPool::requireHeld(char const* call, ResidentRef ref) const {
  MKV_REQUIRE(ref.slot >= 0 && ref.slot < capacity(), call,
              "resident slot {} outside the resident pool's [0, {})", ref.slot, capacity());
  auto const slot = static_cast<std::size_t>(ref.slot);
  MKV_REQUIRE(mEpochs[slot] == ref.epoch, call,
              "resident slot {} has epoch {} but the slot's current epoch is {}: the ref is "
              "stale (the slot was released{})",
              ref.slot, ref.epoch, mEpochs[slot], mHeld[slot] != 0 ? " and acquired again" : "");
  MKV_REQUIRE(mHeld[slot] != 0, call,
              "resident slot {} (epoch {}) is not held: acquire it from the resident pool first",
              ref.slot, ref.epoch);
}

int32_t ResidentSlotPool::available() const noexcept { return capacity() - mHeldCount; }

}  // namespace mkv
