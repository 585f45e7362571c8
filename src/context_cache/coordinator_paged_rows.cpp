#include "context_cache/coordinator_paged_rows.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "context_cache/coordinator_validation.h"
#include "core/check.h"
#include "resources/backend_requests.h"

namespace mkv::detail {

void PagedRows::bindPrefill(CoordinatorRequest const& req) const {
  std::vector<KVPageTable::RowUpdate> rows;
  std::vector<int32_t> lengths;
  rows.reserve(req.sequences.size());
  lengths.reserve(req.sequences.size());
  std::array<std::vector<int32_t>, kMaxRowLanes> laneLengths;
  for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
    RowLane const& target = mLanes[lane];
    rows.clear();
    for (auto const& sequence : req.sequences) {
      rows.push_back({sequence.resident.slot, lanePages(target, sequence.lease)});
      laneLengths[lane].push_back(std::max(0, sequence.reuseTokenLength - target.restoreLag));
    }
    target.table->setRows(rows);
  }
  mWrites.settleAfter(mStream, [&] {
    for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
      mLanes[lane].pool->resetForNewSequences(laneLengths[lane], mWrites.lengths(), mStream);
    }
  });
}

LaneCounts PagedRows::heldPages(CoordinatorRequest::Sequence const& sequence) const noexcept {
  LaneCounts held{};
  for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
    held[lane] = static_cast<int32_t>(lanePages(mLanes[lane], sequence.lease).size());
  }
  return held;
}

LaneCounts PagedRows::neededPages(int32_t committed, DecodingKvHeadroom const& headroom,
                                  int32_t pageSize) const noexcept {
  LaneCounts needed{};
  for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
    int64_t const tokens = int64_t{committed} + laneHeadroom(mLanes[lane], headroom);
    needed[lane] = static_cast<int32_t>(
        std::min<int64_t>((tokens + pageSize - 1) / pageSize, std::numeric_limits<int32_t>::max()));
  }
  return needed;
}

bool PagedRows::tableFull(LaneCounts const& needed) const noexcept {
  for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
    if (needed[lane] > mLanes[lane].table->maxPagesPerSeq()) {
      return true;
    }
  }
  return false;
}

void PagedRows::addGrowth(LaneCounts const& needed, LaneCounts const& held,
                          DecodeStepDemand& demand) const noexcept {
  for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
    int32_t const growth = std::max(0, needed[lane] - held[lane]);
    (mLanes[lane].pages == LanePages::kBase ? demand.basePages : demand.draftPages) += growth;
  }
}

void PagedRows::requireCovered(char const* call, ExecutionRow row,
                               CoordinatorRequest::Sequence const& sequence, int32_t tokens,
                               int32_t pageSize) const {
  LaneCounts const needed = neededPages(tokens, DecodingKvHeadroom{0, 0}, pageSize);
  LaneCounts const held = heldPages(sequence);
  for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
    MKV_REQUIRE(held[lane] >= needed[lane], call,
                "row {}: its first {} tokens need {} {} pages and it holds {}: call "
                "preparePrefillChunk before each chunk (JoinerPageAllocation::kPerChunk)",
                row, tokens, needed[lane], mLanes[lane].name, held[lane]);
  }
}

void PagedRows::mapGrown(CoordinatorRequest::Sequence const& sequence,
                         LaneCounts const& held) const {
  for (std::size_t lane = 0; lane < mLanes.size(); ++lane) {
    std::span<PageId const> const pages = lanePages(mLanes[lane], sequence.lease);
    for (auto logical = static_cast<std::size_t>(held[lane]); logical < pages.size(); ++logical) {
      mLanes[lane].table->setEntry(sequence.resident.slot, static_cast<int32_t>(logical),
                                   pages[logical]);
    }
  }
}

void PagedRows::bindJoiner(CacheSlot slot, CacheRequestLease const& lease) const {
  for (RowLane const& lane : mLanes) {
    lane.table->setRow(slot, lanePages(lane, lease));
  }
  upload();
}

void PagedRows::clearRow(CacheSlot slot) const {
  for (RowLane const& lane : mLanes) {
    lane.table->clearRow(slot);
  }
}

void PagedRows::upload() const {
  if (!mLanes.empty()) {
    mWrites.settle(mStream);
  }
}

void PagedRows::compactLengths(Tensor const& deviceMapping, int32_t newBatchSize) const {
  if (mLanes.empty()) {
    return;
  }
  mWrites.flush(mStream);
  for (RowLane const& lane : mLanes) {
    lane.pool->compactLengths(deviceMapping, newBatchSize, mStream);
  }
}

void PagedRows::requireLengthBatch(char const* call, int32_t rows) const {
  for (RowLane const& lane : mLanes) {
    MKV_REQUIRE(lane.pool->activeBatchSize() == rows, call,
                "the {} KV-length tensor's active batch is {} but the request has {} rows (the "
                "engine grows it with setActiveBatchSize + writeLengths when it seats a joiner)",
                lane.name, lane.pool->activeBatchSize(), rows);
  }
}

void PagedRows::validateHeadroom(char const* call, DecodingKvHeadroom const& headroom) const {
  detail::validateHeadroom(call, headroom, mLanes.size() == kMaxRowLanes);
}

int32_t PagedRows::draftHeadroom(DecodingKvHeadroom const& headroom) const noexcept {
  return mLanes.size() == kMaxRowLanes ? headroom.draftExtraTokens : 0;
}

void PagedRows::checkCompaction(char const* call, int32_t rows, Tensor const& deviceMapping,
                                DeviceType device, std::size_t mappingSize) const {
  requireLengthBatch(call, rows);
  if (!mLanes.empty()) {  // the device mapping is read only to compact the length tensors
    requireDeviceMappingUnchanged(call, deviceMapping, device, mappingSize);
  }
}

}  // namespace mkv::detail
