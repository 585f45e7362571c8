#pragma once
/// \file coordinator_paged_rows.h
/// The paged rows of ContextCacheCoordinator's requests (not installed). A request's rows live in
/// one lane per page table it writes: the base table (with the base pool's KV lengths) and, for
/// a request that pairs a paged draft, the draft table beside it. A pure-recurrent deployment
/// has no lane, and every method below is then a no-op: the lanes are chosen once, with the
/// request's mode (request_mode.h), never re-tested per call.

#include <array>
#include <cstdint>
#include <span>

#include "context_cache/coordinator_request.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "resources/device_write_queue.h"

namespace mkv::detail {

/// Which of a lease's page lists a lane maps.
enum class LanePages : uint8_t { kBase, kDraft };

/// One page table a request's rows are mapped in, and the KV pool whose lengths follow it.
struct RowLane {
  KVPageTable* table = nullptr;
  KVCachePool* pool = nullptr;
  /// The lease pages this lane maps, and the decode headroom they follow (base or draft).
  LanePages pages = LanePages::kBase;
  /// A restored row's KV length is its reuse length minus this (Hybrid-MTP's draft: 1, the hit's
  /// boundary token is recomputed), never below 0.
  int32_t restoreLag = 0;
  char const* name = "base";  ///< in error messages
};

inline constexpr std::size_t kMaxRowLanes = 2;  ///< base, draft

/// Pages per lane (lane order; 0 past the last lane).
using LaneCounts = std::array<int32_t, kMaxRowLanes>;

/// The pages of `lease` that `lane` maps (inlined: the decode step asks per row).
inline std::span<PageId const> lanePages(RowLane const& lane,
                                         CacheRequestLease const& lease) noexcept {
  return lane.pages == LanePages::kBase ? lease.basePages() : lease.draftPages();
}

/// The headroom of `lane`'s pages.
inline int32_t laneHeadroom(RowLane const& lane, DecodingKvHeadroom const& headroom) noexcept {
  return lane.pages == LanePages::kBase ? headroom.baseExtraTokens : headroom.draftExtraTokens;
}

/// A view of one request's lanes (borrowed; cheap to copy). Every method that writes a table marks
/// rows dirty; upload() settles them with the KV lengths queued beside them, on the coordinator's
/// stream: now, or at the engine's step (DeviceWriteQueue).
class PagedRows {
 public:
  /// `writes` holds the table rows and KV lengths until they reach the device (the runtime's
  /// queue, or the coordinator's own; it watches every lane's table).
  PagedRows(std::span<RowLane const> lanes, DeviceWriteQueue& writes, cudaStream_t stream) noexcept
      : mLanes(lanes), mWrites(writes), mStream(stream) {}

  /// The tables a request writes: 0 (pure recurrent), 1 (base) or 2 (base and draft).
  std::size_t laneCount() const noexcept { return mLanes.size(); }
  /// Whose pages lane `lane` maps (base or draft pool).
  LanePages laneKind(std::size_t lane) const noexcept { return mLanes[lane].pages; }

  /// preparePrefill: binds each sequence's lease pages to its resident row in every lane and
  /// resets the batch's KV lengths to the reuse lengths (less the lane's restore lag), then
  /// settles them: one launch now, or none until the engine's step (a launch costs the engine
  /// thread 1-5 µs: docs/benchmarks.md).
  void bindPrefill(CoordinatorRequest const& req) const;
  /// The pages `sequence`'s lease holds per lane (before a growth: what mapGrown maps past).
  LaneCounts heldPages(CoordinatorRequest::Sequence const& sequence) const noexcept;
  /// Pages per lane a row of `committed` tokens needs with `headroom`; a lane whose row cannot
  /// hold them is named by tableFull.
  LaneCounts neededPages(int32_t committed, DecodingKvHeadroom const& headroom,
                         int32_t pageSize) const noexcept;
  bool tableFull(LaneCounts const& needed) const noexcept;
  /// Adds the pages a growth from `held` to `needed` takes to `demand`'s base and draft counts.
  void addGrowth(LaneCounts const& needed, LaneCounts const& held,
                 DecodeStepDemand& demand) const noexcept;
  /// Throws naming `call` unless `sequence` (execution row `row`) holds the pages of its first
  /// `tokens` tokens in every lane: what a prefill chunk wrote through its row (a joiner admitted
  /// with JoinerPageAllocation::kPerChunk has them once preparePrefillChunk made them ready).
  void requireCovered(char const* call, ExecutionRow row,
                      CoordinatorRequest::Sequence const& sequence, int32_t tokens,
                      int32_t pageSize) const;
  /// Maps the pages `sequence`'s lease holds beyond `held` into its rows; no upload.
  void mapGrown(CoordinatorRequest::Sequence const& sequence, LaneCounts const& held) const;
  /// Binds a joiner's lease pages to row `slot` of every lane and settles them.
  void bindJoiner(CacheSlot slot, CacheRequestLease const& lease) const;
  /// Clears row `slot` of every lane; no upload.
  void clearRow(CacheSlot slot) const;
  /// Settles the dirty rows (and the lengths queued beside them).
  void upload() const;
  /// Flushes the queued writes, then compacts every lane's KV lengths through `deviceMapping`.
  void compactLengths(Tensor const& deviceMapping, int32_t newBatchSize) const;
  /// Throws naming `call` unless every lane's KV-length tensor has `rows` active rows.
  void requireLengthBatch(char const* call, int32_t rows) const;
  /// The headroom rule of these lanes: base tokens > 0; draft tokens > 0 with a draft lane, 0
  /// without one.
  void validateHeadroom(char const* call, DecodingKvHeadroom const& headroom) const;
  /// The draft headroom a lookup reserves: the headroom's draft tokens with a draft lane, else 0.
  int32_t draftHeadroom(DecodingKvHeadroom const& headroom) const noexcept;
  /// The checks of compactBatch on these lanes: the length batch and the device mapping the
  /// length compaction reads (nothing without lanes).
  void checkCompaction(char const* call, int32_t rows, Tensor const& deviceMapping,
                       DeviceType device, std::size_t mappingSize) const;

 private:
  std::span<RowLane const> mLanes;
  DeviceWriteQueue& mWrites;
  cudaStream_t mStream;
};

}  // namespace mkv::detail
