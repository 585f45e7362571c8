#include "mkv/attention_views.h"

#include <cstdint>
#include <span>
#include <vector>

#include "core/check.h"
#include "mkv/kv_page_table.h"

namespace mkv {
namespace {

constexpr char const* kConstruct = "AttentionViews";
constexpr char const* kBuild = "AttentionViews::build";
constexpr int64_t kMaxExtent = int64_t{1} << 30;

int64_t pagesFor(int64_t tokens, int64_t tokensPerPage) {
  return (tokens + tokensPerPage - 1) / tokensPerPage;
}

int32_t checkedExtent(int32_t value, char const* name) {
  MKV_REQUIRE(value >= 1 && value <= kMaxExtent, kConstruct, "{} is {}, expected [1, 2^30]", name,
              value);
  return value;
}

Tensor hostInt32(int64_t extent) { return Tensor({extent}, DataType::kInt32, DeviceType::kCPU); }

void reshapeTo(Tensor& tensor, Coords const& shape) {
  bool const fits = tensor.reshape(shape);
  MKV_ASSERT(fits, "view of shape {} exceeds its capacity", shape.toString());
}

}  // namespace

AttentionViews::AttentionViews(KVPageTable const& table, int32_t tokensPerPage, int32_t maxRows,
                               int32_t maxNewTokens)
    : mTable(table),
      mTokensPerPage(checkedExtent(tokensPerPage, "tokensPerPage")),
      mMaxRows(checkedExtent(maxRows, "maxRows")),
      mMaxNewTokens(checkedExtent(maxNewTokens, "maxNewTokens")),
      mMaxPagesPerRow(table.maxPagesPerSeq()) {
  MKV_REQUIRE(maxRows <= table.maxBatch(), kConstruct,
              "maxRows is {}, but the page table has {} rows", maxRows, table.maxBatch());
  auto const rows = static_cast<int64_t>(mMaxRows);
  auto const width = static_cast<int64_t>(mMaxPagesPerRow);
  mBlockTable = Tensor({rows, width}, DataType::kInt32, DeviceType::kCPU);
  mSeqLensBefore = hostInt32(rows);
  mSeqLensAfter = hostInt32(rows);
  mQueryStartLoc = hostInt32(rows + 1);
  mKvIndptr = hostInt32(rows + 1);
  mKvIndices = hostInt32(rows * width);
  mKvLastPageLen = hostInt32(rows);
  mSlotMapping = Tensor({mMaxNewTokens}, DataType::kInt64, DeviceType::kCPU);
  build({}, {}, {}, 0);
}

void AttentionViews::validate(std::span<CacheSlot const> residentSlots,
                              std::span<int32_t const> seqLens, std::span<int32_t const> newTokens,
                              PageId nullPage) const {
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
    totalNew += newTokens[i];
    // Dense tables: every page a kernel attends to; sparse windows: the pages the step writes.
    int64_t const firstNeeded =
        dense || newTokens[i] == 0 ? 0 : static_cast<int64_t>(seqLens[i]) / mTokensPerPage;
    int64_t const endNeeded = dense || newTokens[i] > 0 ? pagesFor(after, mTokensPerPage) : 0;
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
  auto const n = static_cast<int64_t>(residentSlots.size());
  auto const width = static_cast<int64_t>(mMaxPagesPerRow);
  int64_t const pageSize = mTokensPerPage;
  reshapeTo(mBlockTable, {n, width});
  reshapeTo(mSeqLensBefore, {n});
  reshapeTo(mSeqLensAfter, {n});
  reshapeTo(mQueryStartLoc, {n + 1});
  reshapeTo(mKvIndptr, {n + 1});
  reshapeTo(mKvLastPageLen, {n});
  auto* table = mBlockTable.dataPointer<int32_t>();
  auto* before = mSeqLensBefore.dataPointer<int32_t>();
  auto* after = mSeqLensAfter.dataPointer<int32_t>();
  auto* queryStart = mQueryStartLoc.dataPointer<int32_t>();
  auto* indptr = mKvIndptr.dataPointer<int32_t>();
  auto* indices = mKvIndices.dataPointer<int32_t>();
  auto* lastPageLen = mKvLastPageLen.dataPointer<int32_t>();
  auto* slots = mSlotMapping.dataPointer<int64_t>();
  queryStart[0] = 0;
  indptr[0] = 0;
  int64_t slotCount = 0;
  for (int64_t i = 0; i < n; ++i) {
    auto const row = static_cast<std::size_t>(i);
    std::span<int32_t const> const kIds =
        mTable.hostRow(residentSlots[row]).first(static_cast<std::size_t>(width));
    int32_t* tableRow = table + i * width;
    int32_t const length = seqLens[row] + newTokens[row];
    int64_t const pages = pagesFor(length, pageSize);
    for (int64_t j = 0; j < width; ++j) {
      PageId const id = j < pages ? kIds[static_cast<std::size_t>(j)] : kNoPage;
      tableRow[j] = id == kNoPage ? nullPage : id;
    }
    before[i] = seqLens[row];
    after[i] = length;
    queryStart[i + 1] = queryStart[i] + newTokens[row];
    indptr[i + 1] = indptr[i] + static_cast<int32_t>(pages);
    for (int64_t j = 0; j < pages; ++j) {
      indices[indptr[i] + j] = tableRow[j];
    }
    lastPageLen[i] = pages == 0 ? 0 : static_cast<int32_t>(length - (pages - 1) * pageSize);
    for (int64_t position = seqLens[row]; position < length; ++position) {
      slots[slotCount++] =
          static_cast<int64_t>(tableRow[position / pageSize]) * pageSize + position % pageSize;
    }
  }
  reshapeTo(mKvIndices, {static_cast<int64_t>(indptr[n])});
  reshapeTo(mSlotMapping, {slotCount});
  mRows = static_cast<int32_t>(n);
  mNewTokenCount = static_cast<int32_t>(slotCount);
}

}  // namespace mkv
