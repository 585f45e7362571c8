#pragma once
/// \file backend_requests.h
/// What the two KV backends (ContextCacheCoordinator, BoundedSwaKVPageManager) share of their
/// request mechanism (not installed): the checks of a batch's residents and of a compaction's
/// mapping, and the synchronisation that poisons on failure. One request's path through the
/// layers: docs/architecture.md.

#include <cstdint>
#include <span>
#include <vector>

#include "mkv/resident_slot_pool.h"
#include "mkv/stream.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv::detail {

/// An order-preserving compaction mapping of `oldBatch` rows onto `newBatchSize`: one entry per
/// row, -1 (dropped) or the survivor's new row, survivors in order, every new row covered.
void validateCompactionMapping(char const* call, std::span<int32_t const> oldToNew,
                               std::size_t oldBatch, int32_t newBatchSize);

/// The engine's mapping tensor: int32 on `device`, room for `entries` values.
void validateDeviceMapping(char const* call, Tensor const& deviceMapping, DeviceType device,
                           std::size_t entries);

/// At a compaction's end: `deviceMapping`, shaped by the begin, still holds `entries` values on
/// `device` (the engine neither reshaped nor replaced it since the begin).
void requireDeviceMappingUnchanged(char const* call, Tensor const& deviceMapping, DeviceType device,
                                   std::size_t entries);

/// A request adapter's completeBatchCompaction: a compaction was begun (`begun`, the mapping
/// given to beginBatchCompaction, is not empty) and `keepMapping` is that same mapping.
void requireBegunMapping(char const* call, std::span<int32_t const> begun,
                         std::span<int32_t const> keepMapping);

/// Resident `index` of a batch admission: slot in [0, `rows`), epoch not 0, held by
/// `residentSlots` with that epoch (when set), and not listed before (`seen`, one flag per row).
void validateResident(char const* call, std::size_t index, ResidentRef ref, int32_t rows,
                      ResidentSlotPool const* residentSlots, std::vector<uint8_t>& seen);

/// Admission of a new request: throws (naming `call`) when resident row `slot` is held by
/// another request (`busy`: one flag per row, set while an active or quarantined request holds
/// it).
void requireResidentFree(char const* call, CacheSlot slot, std::span<uint8_t const> busy);

/// Calls `synchronizer` on `stream`; false when it fails or throws (logged as `backend`'s).
bool synchronizeStream(StreamSynchronizer const& synchronizer, cudaStream_t stream,
                       char const* backend) noexcept;

}  // namespace mkv::detail
