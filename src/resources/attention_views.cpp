#include "mkv/attention_views.h"

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "core/check.h"
#include "mkv/kernels.h"
#include "mkv/kv_page_table.h"

namespace mkv {
namespace {

constexpr char const* kConstruct = "AttentionViews";
constexpr char const* kBuild = "AttentionViews::build";
constexpr int64_t kMaxExtent = int64_t{1} << 30;

int64_t pagesFor(int64_t tokens, int64_t tokensPerPage) {
  return (tokens + tokensPerPage - 1) / tokensPerPage;
}

int32_t checkedExtent(int32_t value, char const* name, int64_t limit) {
  MKV_REQUIRE(value >= 1 && value <= limit, kConstruct, "{} is {}, expected [1, {}]", name, value,
              limit);
  return value;
}

void reshapeTo(Tensor& tensor, Coords const& shape) {
  bool const fits = tensor.reshape(shape);
  MKV_ASSERT(fits, "view of shape {} exceeds its capacity", shape.toString());
}

/// What the views' launch reads: the device copy of a kGPU table, the host rows of a kCPU one.
Tensor tableRowsOf(KVPageTable const& table) {
  if (table.deviceType() == DeviceType::kGPU) {
    return Tensor::viewOf(table.deviceTable());
  }
  std::span<int32_t const> const rows = table.hostRows();
  // The launch only reads the rows; a Tensor view has no const flavour.
  return Tensor::view(const_cast<int32_t*>(rows.data()),  // NOLINT(*-pro-type-const-cast)
                      {table.maxBatch(), 2, table.maxPagesPerSeq()}, DataType::kInt32,
                      DeviceType::kCPU);
}

}  // namespace

AttentionViews::AttentionViews(KVPageTable const& table, int32_t tokensPerPage, int32_t maxRows,
                               int32_t maxNewTokens, cudaStream_t stream, PhysicalPageMap pageMap)
    : mTable(table),
      mDeviceType(table.deviceType()),
      mStream(stream),
      mTokensPerPage(checkedExtent(tokensPerPage, "tokensPerPage", kMaxExtent)),
      mMaxRows(checkedExtent(maxRows, "maxRows", kernels::kMaxAttentionViewRows)),
      mMaxNewTokens(checkedExtent(maxNewTokens, "maxNewTokens", kMaxExtent)),
      mMaxPagesPerRow(table.maxPagesPerSeq()),
      mPageMap(pageMap) {
  MKV_REQUIRE(maxRows <= table.maxBatch(), kConstruct,
              "maxRows is {}, but the page table has {} rows", maxRows, table.maxBatch());
  MKV_REQUIRE(pageMap == PhysicalPageMap::kNone || pageMap == PhysicalPageMap::kPerRow, kConstruct,
              "pageMap is {}, expected kNone or kPerRow", static_cast<int>(pageMap));
  mTableRows = tableRowsOf(table);
  if (mDeviceType == DeviceType::kGPU) {
    kernels::loadKernels();  // a kernel's lazy load at its first launch may wait for the device
  }
  auto const rows = static_cast<int64_t>(mMaxRows);
  auto const width = static_cast<int64_t>(mMaxPagesPerRow);
  auto int32Tensor = [this](int64_t extent) {
    return Tensor({extent}, DataType::kInt32, mDeviceType);
  };
  mBlockTable = Tensor({rows, width}, DataType::kInt32, mDeviceType);
  mSeqLensBefore = int32Tensor(rows);
  mSeqLensAfter = int32Tensor(rows);
  mQueryStartLoc = int32Tensor(rows + 1);
  mKvIndptr = int32Tensor(rows + 1);
  mKvIndices = int32Tensor(rows * width);
  mKvLastPageLen = int32Tensor(rows);
  mSlotMapping = Tensor({mMaxNewTokens}, DataType::kInt64, mDeviceType);
  if (hasPhysicalPageMap()) {
    mPhysicalToLogical = Tensor({rows, int64_t{table.numPages()}}, DataType::kInt32, mDeviceType);
    reshapeTo(mPhysicalToLogical, {0, int64_t{table.numPages()}});
  }
  // The views of an empty step; the tensors are zero-filled, so queryStartLoc and kvIndptr hold
  // their one 0.
  reshapeTo(mBlockTable, {0, width});
  reshapeTo(mSeqLensBefore, {0});
  reshapeTo(mSeqLensAfter, {0});
  reshapeTo(mQueryStartLoc, {1});
  reshapeTo(mKvIndptr, {1});
  reshapeTo(mKvIndices, {0});
  reshapeTo(mKvLastPageLen, {0});
  reshapeTo(mSlotMapping, {0});
}

void AttentionViews::validate(std::span<CacheSlot const> residentSlots,
                              std::span<int32_t const> seqLens, std::span<int32_t const> newTokens,
                              PageId nullPage) const {
  // The launch reads the device copy, the checks below the host rows: they must agree.
  MKV_REQUIRE(mDeviceType != DeviceType::kGPU || !mTable.dirty(), kBuild,
              "the page table has entries not yet uploaded to its device copy, which the views "
              "are built from: flush the device writes first (KVCacheRuntime::flushDeviceWrites)");
  MKV_REQUIRE(seqLens.size() == residentSlots.size() && newTokens.size() == residentSlots.size(),
              kBuild, "{} resident slots, {} lengths and {} new-token counts: expected one each",
              residentSlots.size(), seqLens.size(), newTokens.size());
  MKV_REQUIRE(residentSlots.size() <= static_cast<std::size_t>(mMaxRows), kBuild,
              "{} rows, at most maxRows = {}", residentSlots.size(), mMaxRows);
  MKV_REQUIRE(nullPage >= 0 && nullPage < mTable.numPages(), kBuild,
              "nullPage is {}, expected a page of the pool in [0, {})", nullPage,
              mTable.numPages());
  int64_t const maxTokens = static_cast<int64_t>(mMaxPagesPerRow) * mTokensPerPage;
  int64_t totalNew = 0;
  std::vector<uint8_t> seen(static_cast<std::size_t>(mTable.maxBatch()), 0);
  bool const dense = mTable.mode() == PageTableMode::kDense;
  for (std::size_t i = 0; i < residentSlots.size(); ++i) {
    CacheSlot const slot = residentSlots[i];
    MKV_REQUIRE(slot >= 0 && slot < mTable.maxBatch(), kBuild,
                "row {}: resident slot {} outside [0, {})", i, slot, mTable.maxBatch());
    MKV_REQUIRE(seen[static_cast<std::size_t>(slot)] == 0, kBuild,
                "row {}: resident slot {} appears twice", i, slot);
    seen[static_cast<std::size_t>(slot)] = 1;
    MKV_REQUIRE(seqLens[i] >= 0 && newTokens[i] >= 0, kBuild,
                "row {} (slot {}): length {} and {} new tokens, expected both >= 0", i, slot,
                seqLens[i], newTokens[i]);
    int64_t const after = static_cast<int64_t>(seqLens[i]) + newTokens[i];
    MKV_REQUIRE(after <= maxTokens, kBuild,
                "row {} (slot {}): {} tokens after the step, beyond the {} of {} pages of {}", i,
                slot, after, maxTokens, mMaxPagesPerRow, mTokensPerPage);
    MKV_REQUIRE(after <= std::numeric_limits<int32_t>::max(), kBuild,
                "row {} (slot {}): {} tokens after the step, beyond int32", i, slot, after);
    totalNew += newTokens[i];
    // Dense tables: every page a kernel attends to; sparse windows: the pages the step writes.
    int64_t const firstNeeded =
        dense || newTokens[i] == 0 ? 0 : static_cast<int64_t>(seqLens[i]) / mTokensPerPage;
    int64_t const endNeeded = dense || newTokens[i] > 0 ? pagesFor(after, mTokensPerPage) : 0;
    if (mTable.entriesLive(slot, static_cast<int32_t>(firstNeeded),
                           static_cast<int32_t>(endNeeded))) {
      continue;  // O(1) for a row without holes; else the empty entry is named below
    }
    for (int64_t page = firstNeeded; page < endNeeded; ++page) {
      MKV_REQUIRE(mTable.entry(slot, static_cast<int32_t>(page)) != kNoPage, kBuild,
                  "row {} (slot {}): logical page {} is empty, but {} tokens after the step need "
                  "{} pages{}",
                  i, slot, page, after, pagesFor(after, mTokensPerPage),
                  dense ? "" : " (the pages this step writes must be live)");
    }
  }
  MKV_REQUIRE(totalNew <= mMaxNewTokens, kBuild, "{} new tokens, at most maxNewTokens = {}",
              totalNew, mMaxNewTokens);
}

void AttentionViews::build(std::span<CacheSlot const> residentSlots,
                           std::span<int32_t const> seqLens, std::span<int32_t const> newTokens,
                           PageId nullPage) {
  validate(residentSlots, seqLens, newTokens, nullPage);
  kernels::AttentionViewStep const step{residentSlots,  seqLens,           newTokens,
                                        mTokensPerPage, mTable.numPages(), nullPage};
  kernels::AttentionViewTensors const views{
      &mBlockTable,    &mSeqLensBefore, &mSeqLensAfter,
      &mQueryStartLoc, &mKvIndptr,      &mKvIndices,
      &mKvLastPageLen, &mSlotMapping,   hasPhysicalPageMap() ? &mPhysicalToLogical : nullptr};
  kernels::buildAttentionViews(mTableRows, step, views, mStream);
  mRows = static_cast<int32_t>(residentSlots.size());
  mNewTokenCount = static_cast<int32_t>(mSlotMapping.numel());
  ++mLaunches;
}

Tensor const& AttentionViews::physicalToLogical() const {
  MKV_REQUIRE(hasPhysicalPageMap(), "AttentionViews::physicalToLogical",
              "these views were made without PhysicalPageMap::kPerRow: construct them with it to "
              "build FlexAttention's physical-to-logical map");
  return mPhysicalToLogical;
}

}  // namespace mkv
