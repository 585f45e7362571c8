#pragma once
/// \file resident_slot_pool.h
/// Hands out resident rows (stable physical state rows) with epochs.

#include <cstdint>
#include <optional>
#include <vector>

#include "mkv/types.h"

namespace mkv {

/// Slots [0, capacity) with an epoch each. acquire() returns the lowest free slot; release()
/// frees it and bumps its epoch, so a stale ResidentRef (old epoch) is recognisably stale.
/// Epochs start at 1 (0 is never valid). The caller must not release a slot until all GPU
/// work touching its rows has completed. Thread-safety: one writer.
class ResidentSlotPool {
 public:
  ResidentSlotPool() = default;
  explicit ResidentSlotPool(int32_t capacity) { reset(capacity); }

  /// Frees every slot and restarts all epochs at 1. Throws for a negative capacity.
  void reset(int32_t capacity);
  /// Lowest free slot, or nullopt when all are held.
  std::optional<ResidentRef> acquire();
  /// Frees a held slot. Returns false (nothing changed) for a slot out of range, a free slot,
  /// or an epoch that is not the slot's current one.
  bool release(ResidentRef ref);
  /// True when `ref` is currently held with exactly that epoch.
  bool contains(ResidentRef ref) const noexcept;
  /// The current epoch of `slot` (the one its next or current holder carries); 0 for a slot out
  /// of range.
  uint64_t epoch(CacheSlot slot) const noexcept;
  /// Throws mkv::Error naming `call` unless `ref` is held with its current epoch: a slot out of
  /// range, a slot not held, or a stale ref (the slot was released, its epoch bumped, and maybe
  /// acquired again) — the message names the slot and both epochs. The backends check every ref
  /// an integrator hands in with this (KVCacheRuntime wires the pool to them).
  void requireHeld(char const* call, ResidentRef ref) const;

  int32_t capacity() const noexcept { return static_cast<int32_t>(mEpochs.size()); }
  int32_t available() const noexcept;

 private:
  std::vector<uint64_t> mEpochs;
  std::vector<uint8_t> mHeld;
  int32_t mHeldCount = 0;
};

}  // namespace mkv
