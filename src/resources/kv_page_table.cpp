#include "mkv/kv_page_table.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "core/check.h"
#include "core/device.h"
#include "mkv/kernels.h"

namespace mkv {
namespace {

/// Worst-case int32 count of one patch: every K entry dirty in alternating positions gives
/// ceil(W / 2) K runs per row, each with a V twin (3 header entries per range), plus all K and V
/// values. Row-granular uploads need fewer (ceil(B / 2) ranges, 2 * B * W values).
int64_t patchCapacity(int64_t maxBatch, int64_t maxPagesPerSeq) {
  int64_t const entryRuns = maxBatch * ((maxPagesPerSeq + 1) / 2);
  int64_t const entryPatch = 3 * (2 * entryRuns) + 2 * maxBatch * maxPagesPerSeq;
  int64_t const rowPatch = 3 * ((maxBatch + 1) / 2) + 2 * maxBatch * maxPagesPerSeq;
  return std::max(entryPatch, rowPatch);
}

/// Sorts `values`; when some value occurs twice, stores it in *duplicate and returns true.
bool findDuplicate(std::vector<int32_t>& values, int32_t* duplicate) {
  std::sort(values.begin(), values.end());
  auto const it = std::adjacent_find(values.begin(), values.end());
  if (it == values.end()) {
    return false;
  }
  *duplicate = *it;
  return true;
}

/// The dirty set of one upload and how it groups into ranges. `sorted` holds the flat indices of
/// the dirty K entries in ascending order; a row holds 2 * width entries (K, then V).
struct DirtyRuns {
  std::span<int64_t const> sorted;
  int64_t width;     // maxPagesPerSeq
  bool rowGranular;  // runs of adjacent rows (whole rows), else runs of adjacent K entries

  int64_t rowWidth() const { return 2 * width; }

  /// Calls visit(offset, count) once per run, in ascending order: adjacent dirty rows (row
  /// granular) or adjacent dirty K entries (entry granular).
  template <typename Visit>
  void forEachRun(Visit&& visit) const {
    std::size_t i = 0;
    while (i < sorted.size()) {
      if (rowGranular) {
        int64_t const first = sorted[i] / rowWidth();
        int64_t last = first;
        while (i < sorted.size() && sorted[i] / rowWidth() <= last + 1) {
          last = sorted[i] / rowWidth();
          ++i;
        }
        visit(first * rowWidth(), (last - first + 1) * rowWidth());
      } else {
        int64_t const first = sorted[i];
        int64_t count = 1;
        ++i;
        while (i < sorted.size() && sorted[i] == first + count) {
          ++count;
          ++i;
        }
        visit(first, count);
      }
    }
  }

  /// Calls visit(offset, count) once per uploaded range, in upload order: each run, followed by
  /// its V twin when entry granular.
  template <typename Visit>
  void forEachRange(Visit&& visit) const {
    forEachRun([&](int64_t offset, int64_t count) {
      visit(offset, count);
      if (!rowGranular) {
        visit(offset + width, count);
      }
    });
  }
};

/// Calls visit(row, firstDirty, lastDirty) once per row with dirty entries, rows ascending:
/// the row's first and last dirty K entry (the row's entries are adjacent in the sorted set).
template <typename Visit>
void forEachDirtyRow(DirtyRuns const& runs, Visit&& visit) {
  std::span<int64_t const> const sorted = runs.sorted;
  int64_t const rowWidth = runs.rowWidth();
  for (std::size_t i = 0; i < sorted.size();) {
    int64_t const row = sorted[i] / rowWidth;
    auto const firstDirty = static_cast<int32_t>(sorted[i] % rowWidth);
    while (i + 1 < sorted.size() && sorted[i + 1] / rowWidth == row) {
      ++i;
    }
    auto const lastDirty = static_cast<int32_t>(sorted[i] % rowWidth);
    ++i;
    visit(row, firstDirty, lastDirty);
  }
}

/// host[offset, offset + count) as a span.
std::span<int32_t const> hostValues(std::vector<int32_t> const& host, int64_t offset,
                                    int64_t count) {
  return std::span<int32_t const>(host).subspan(static_cast<std::size_t>(offset),
                                                static_cast<std::size_t>(count));
}

/// Replaces `patch` with the staged image of the upload: one (offset, count, value offset)
/// header triple per range, in upload order, then the ranges' values copied from `host`.
void buildStagedPatch(std::vector<int32_t>& patch, std::vector<int32_t> const& host,
                      DirtyRuns const& runs, int64_t numRanges) {
  patch.assign(static_cast<std::size_t>(3 * numRanges), 0);
  std::size_t header = 0;
  runs.forEachRange([&](int64_t offset, int64_t count) {
    patch[header++] = static_cast<int32_t>(offset);
    patch[header++] = static_cast<int32_t>(count);
    patch[header++] = static_cast<int32_t>(patch.size());
    auto const begin = host.begin() + offset;
    patch.insert(patch.end(), begin, begin + count);
  });
}

/// Clears the per-K-entry dirty flag ([maxBatch, width]) of every entry in the dirty set.
void clearDirtyFlags(std::vector<uint8_t>& flags, DirtyRuns const& runs) {
  for (int64_t flat : runs.sorted) {
    int64_t const slot = flat / runs.rowWidth();
    flags[static_cast<std::size_t>(slot * runs.width + flat % runs.rowWidth())] = 0;
  }
}

}  // namespace

KVPageTable::KVPageTable(int32_t maxBatch, int32_t maxPagesPerSeq, int32_t numPages,
                         PageTableMode mode, DeviceType deviceType)
    : mMaxBatch(maxBatch),
      mMaxPagesPerSeq(maxPagesPerSeq),
      mNumPages(numPages),
      mMode(mode),
      mDeviceType(deviceType) {
  constexpr char const* kCall = "KVPageTable";
  MKV_REQUIRE(maxBatch > 0, kCall, "maxBatch must be positive, got {}", maxBatch);
  MKV_REQUIRE(maxPagesPerSeq > 0, kCall, "maxPagesPerSeq must be positive, got {}", maxPagesPerSeq);
  MKV_REQUIRE(numPages > 0 && numPages <= std::numeric_limits<int32_t>::max() / 2, kCall,
              "numPages must be in [1, {}] so that V ids fit int32, got {}",
              std::numeric_limits<int32_t>::max() / 2, numPages);
  int64_t const capacity = patchCapacity(maxBatch, maxPagesPerSeq);
  MKV_REQUIRE(capacity <= std::numeric_limits<int32_t>::max(), kCall,
              "a {} x {} table is too large: patch offsets must fit int32", maxBatch,
              maxPagesPerSeq);
  auto const kEntries =
      static_cast<std::size_t>(maxBatch) * static_cast<std::size_t>(maxPagesPerSeq);
  mHost.assign(2 * kEntries, kNoPage);
  mLiveCount.assign(static_cast<std::size_t>(maxBatch), 0);
  mLiveBegin.assign(static_cast<std::size_t>(maxBatch), 0);
  mLiveEnd.assign(static_cast<std::size_t>(maxBatch), 0);
  mDirtyEntries.reserve(kEntries);
  mEntryDirtyFlag.assign(kEntries, 0);
  mScratch.reserve(static_cast<std::size_t>(std::max(maxBatch, maxPagesPerSeq)));
  if (mode == PageTableMode::kSparseWindow) {
    mPageSeen.assign(static_cast<std::size_t>(numPages), 0);
  }
  mPatch.reserve(static_cast<std::size_t>(capacity));
  mDevice = Tensor({maxBatch, 2, maxPagesPerSeq}, DataType::kInt32, deviceType);
  detail::fillBytes(mDevice.rawPointer(), deviceType, 0xFF,
                    static_cast<std::size_t>(mDevice.sizeBytes()), nullptr);
  if (deviceType == DeviceType::kGPU) {
    detail::synchronizeDevice();
  }
  mStaging = std::make_unique<detail::Int32Staging>(capacity, deviceType);
  mOwnWrites = kernels::InlinePatchBatch(deviceType);
}

KVPageTable::~KVPageTable() = default;

void KVPageTable::validateSlot(char const* call, CacheSlot slot) const {
  MKV_REQUIRE(slot >= 0 && slot < mMaxBatch, call, "slot {} is outside [0, {})", slot, mMaxBatch);
}

void KVPageTable::validateLogical(char const* call, int32_t logicalPage) const {
  MKV_REQUIRE(logicalPage >= 0 && logicalPage < mMaxPagesPerSeq, call,
              "logical page {} is outside [0, {})", logicalPage, mMaxPagesPerSeq);
}

void KVPageTable::validateRowPages(char const* call, CacheSlot slot,
                                   std::span<PageId const> kPages) const {
  MKV_REQUIRE(kPages.size() <= static_cast<std::size_t>(mMaxPagesPerSeq), call,
              "slot {}: {} pages given but a row holds at most {}", slot, kPages.size(),
              mMaxPagesPerSeq);
  for (std::size_t i = 0; i < kPages.size(); ++i) {
    PageId const page = kPages[i];
    if (page == kNoPage) {
      MKV_REQUIRE(mMode == PageTableMode::kSparseWindow, call,
                  "slot {}: page[{}] = -1, but empty entries inside a row are only allowed in "
                  "sparse-window mode",
                  slot, i);
      continue;
    }
    MKV_REQUIRE(page >= 0 && page < mNumPages, call, "slot {}: page[{}] = {} is outside [0, {})",
                slot, i, page, mNumPages);
  }
  if (mMode == PageTableMode::kSparseWindow) {
    mScratch.clear();
    for (PageId page : kPages) {
      if (page != kNoPage) {
        mScratch.push_back(page);
      }
    }
    int32_t duplicate = 0;
    MKV_REQUIRE(!findDuplicate(mScratch, &duplicate), call,
                "slot {}: page {} appears more than once among the live entries", slot, duplicate);
  }
}

bool KVPageTable::rowLooksValid(CacheSlot slot, int32_t first, int32_t last) const {
  auto const width = static_cast<std::size_t>(mMaxPagesPerSeq);
  int32_t const* const k = mHost.data() + static_cast<std::size_t>(slot) * 2 * width;
  int32_t const* const v = k + width;
  int32_t const recorded = mLiveCount[static_cast<std::size_t>(slot)];
  bool bad = false;
  if (mMode == PageTableMode::kDense) {
    // Live entries are exactly [0, recorded): with entries before `first` empty, only an empty
    // row can pass, and the recorded prefix must lie inside the range.
    if ((first > 0 && recorded > 0) || recorded > last) {
      return false;
    }
    for (int32_t i = first; i < last; ++i) {
      int32_t const kPage = k[i];
      int32_t const vPage = v[i];
      bad |= i < recorded ? (kPage < 0 || kPage >= mNumPages || vPage != kPage + mNumPages)
                          : (kPage != kNoPage || vPage != kNoPage);
    }
    return !bad;
  }
  if (++mSeenGeneration == 0) {  // wrapped: forget every earlier pass
    std::fill(mPageSeen.begin(), mPageSeen.end(), 0U);
    mSeenGeneration = 1;
  }
  int32_t live = 0;
  for (int32_t i = first; i < last; ++i) {
    int32_t const kPage = k[i];
    int32_t const vPage = v[i];
    if (kPage == kNoPage) {
      bad |= vPage != kNoPage;
      continue;
    }
    if (kPage < 0 || kPage >= mNumPages || vPage != kPage + mNumPages) {
      return false;
    }
    uint32_t& seen = mPageSeen[static_cast<std::size_t>(kPage)];
    if (seen == mSeenGeneration) {
      return false;  // live twice in this row
    }
    seen = mSeenGeneration;
    ++live;
  }
  return !bad && live == recorded;
}

namespace {

/// Why entry `i` of row `slot` (K page `k`, V page `v`) breaks the table's rules, or nullopt: an
/// empty entry has both halves empty; a live one a K page in [0, numPages) and V = K + numPages,
/// and it may not come after an empty entry of a dense row (`afterEmptyInDenseRow`).
std::optional<std::string> entryError(CacheSlot slot, std::size_t i, int32_t k, int32_t v,
                                      int32_t numPages, bool afterEmptyInDenseRow) {
  if (k == kNoPage) {
    if (v != kNoPage) {
      return fmt::format("row {} entry {}: K is empty but V is {}", slot, i, v);
    }
    return std::nullopt;
  }
  if (k < 0 || k >= numPages) {
    return fmt::format("row {} entry {}: K page {} is outside [0, {})", slot, i, k, numPages);
  }
  if (v != k + numPages) {
    return fmt::format("row {} entry {}: V page is {}, expected {} (K {} + numPages {})", slot, i,
                       v, k + numPages, k, numPages);
  }
  if (afterEmptyInDenseRow) {
    return fmt::format("row {} entry {}: live entry after an empty one in a dense table", slot, i);
  }
  return std::nullopt;
}

}  // namespace

bool KVPageTable::checkRow(CacheSlot slot, std::string* error, int32_t first, int32_t last) const {
  if (rowLooksValid(slot, first, last)) {
    return true;
  }
  auto fail = [&](std::string message) {
    if (error != nullptr) {
      *error = std::move(message);
    }
    return false;
  };
  std::span<int32_t const> const row = hostRow(slot);
  auto const width = static_cast<std::size_t>(mMaxPagesPerSeq);
  int32_t live = 0;
  // Entries before `first` are empty: a dense row's first live entry after them breaks the rule
  // exactly as a scan from entry 0 would report it.
  bool seenEmpty = first > 0;
  mScratch.clear();
  for (auto i = static_cast<std::size_t>(first); i < static_cast<std::size_t>(last); ++i) {
    int32_t const k = row[i];
    std::optional<std::string> message = entryError(slot, i, k, row[width + i], mNumPages,
                                                    mMode == PageTableMode::kDense && seenEmpty);
    if (message) {
      return fail(std::move(*message));
    }
    if (k == kNoPage) {
      seenEmpty = true;
      continue;
    }
    ++live;
    if (mMode == PageTableMode::kSparseWindow) {
      mScratch.push_back(k);
    }
  }
  if (live != mLiveCount[static_cast<std::size_t>(slot)]) {
    return fail(fmt::format("row {}: {} live entries, but {} are recorded", slot, live,
                            mLiveCount[static_cast<std::size_t>(slot)]));
  }
  int32_t duplicate = 0;
  if (mMode == PageTableMode::kSparseWindow && findDuplicate(mScratch, &duplicate)) {
    return fail(fmt::format("row {}: page {} is live more than once", slot, duplicate));
  }
  return true;
}

bool KVPageTable::checkInvariants(std::string* error) const {
  for (CacheSlot slot = 0; slot < mMaxBatch; ++slot) {
    if (!checkRow(slot, error, 0, mMaxPagesPerSeq)) {
      return false;
    }
  }
  return true;
}

void KVPageTable::writeEntry(CacheSlot slot, int32_t logicalPage, PageId kPage) {
  auto const width = static_cast<std::size_t>(mMaxPagesPerSeq);
  std::size_t const flat =
      static_cast<std::size_t>(slot) * 2 * width + static_cast<std::size_t>(logicalPage);
  PageId const old = mHost[flat];
  if (old == kPage) {
    return;
  }
  mHost[flat] = kPage;
  mHost[flat + width] = kPage == kNoPage ? kNoPage : kPage + mNumPages;
  int32_t& live = mLiveCount[static_cast<std::size_t>(slot)];
  live += (old == kNoPage ? 1 : 0) - (kPage == kNoPage ? 1 : 0);
  int32_t& begin = mLiveBegin[static_cast<std::size_t>(slot)];
  int32_t& end = mLiveEnd[static_cast<std::size_t>(slot)];
  if (kPage != kNoPage) {
    begin = begin == end ? logicalPage : std::min(begin, logicalPage);
    end = std::max(end, logicalPage + 1);
  } else {
    // Keep the range tight at its edges: a window retiring its oldest page moves `begin` by one.
    int32_t const* const k = mHost.data() + static_cast<std::size_t>(slot) * 2 * width;
    while (begin < end && k[begin] == kNoPage) {
      ++begin;
    }
    while (begin < end && k[end - 1] == kNoPage) {
      --end;
    }
  }
  uint8_t& flag = mEntryDirtyFlag[static_cast<std::size_t>(slot) * width +
                                  static_cast<std::size_t>(logicalPage)];
  if (flag == 0) {
    flag = 1;
    mDirtyEntries.push_back(static_cast<int64_t>(flat));
  }
}

void KVPageTable::setRow(CacheSlot slot, std::span<PageId const> kPages) {
  constexpr char const* kCall = "KVPageTable::setRow";
  validateSlot(kCall, slot);
  validateRowPages(kCall, slot, kPages);
  for (int32_t i = 0; i < mMaxPagesPerSeq; ++i) {
    auto const index = static_cast<std::size_t>(i);
    writeEntry(slot, i, index < kPages.size() ? kPages[index] : kNoPage);
  }
}

void KVPageTable::setRows(std::span<RowUpdate const> updates) {
  constexpr char const* kCall = "KVPageTable::setRows";
  for (RowUpdate const& update : updates) {
    validateSlot(kCall, update.slot);
    validateRowPages(kCall, update.slot, update.kPages);
  }
  mScratch.clear();
  for (RowUpdate const& update : updates) {
    mScratch.push_back(update.slot);
  }
  int32_t repeated = 0;
  MKV_REQUIRE(!findDuplicate(mScratch, &repeated), kCall, "slot {} is updated more than once",
              repeated);
  for (RowUpdate const& update : updates) {
    for (int32_t i = 0; i < mMaxPagesPerSeq; ++i) {
      auto const index = static_cast<std::size_t>(i);
      writeEntry(update.slot, i, index < update.kPages.size() ? update.kPages[index] : kNoPage);
    }
  }
}

void KVPageTable::setEntry(CacheSlot slot, int32_t logicalPage, PageId kPage) {
  constexpr char const* kCall = "KVPageTable::setEntry";
  validateSlot(kCall, slot);
  validateLogical(kCall, logicalPage);
  MKV_REQUIRE(kPage >= 0 && kPage < mNumPages, kCall,
              "slot {} entry {}: page {} is outside [0, {}) (clearEntry empties an entry)", slot,
              logicalPage, kPage, mNumPages);
  if (mMode == PageTableMode::kDense) {
    int32_t const live = mLiveCount[static_cast<std::size_t>(slot)];
    MKV_REQUIRE(logicalPage <= live, kCall,
                "slot {} entry {}: a dense row with {} live entries can only be replaced below "
                "{} or appended at {}",
                slot, logicalPage, live, live, live);
  } else {
    std::span<int32_t const> const row = hostRow(slot);
    for (int32_t i = mLiveBegin[static_cast<std::size_t>(slot)];
         i < mLiveEnd[static_cast<std::size_t>(slot)]; ++i) {
      MKV_REQUIRE(i == logicalPage || row[static_cast<std::size_t>(i)] != kPage, kCall,
                  "slot {} entry {}: page {} is already live at entry {}", slot, logicalPage, kPage,
                  i);
    }
  }
  writeEntry(slot, logicalPage, kPage);
}

void KVPageTable::clearEntry(CacheSlot slot, int32_t logicalPage) {
  constexpr char const* kCall = "KVPageTable::clearEntry";
  validateSlot(kCall, slot);
  validateLogical(kCall, logicalPage);
  if (entry(slot, logicalPage) == kNoPage) {
    return;
  }
  if (mMode == PageTableMode::kDense) {
    int32_t const live = mLiveCount[static_cast<std::size_t>(slot)];
    MKV_REQUIRE(logicalPage == live - 1, kCall,
                "slot {} entry {}: only the last live entry ({}) of a dense row can be cleared",
                slot, logicalPage, live - 1);
  }
  writeEntry(slot, logicalPage, kNoPage);
}

void KVPageTable::clearRow(CacheSlot slot) {
  validateSlot("KVPageTable::clearRow", slot);
  for (int32_t i = 0; i < mMaxPagesPerSeq && mLiveCount[static_cast<std::size_t>(slot)] > 0; ++i) {
    writeEntry(slot, i, kNoPage);
  }
}

PageId KVPageTable::entry(CacheSlot slot, int32_t logicalPage) const {
  validateSlot("KVPageTable::entry", slot);
  validateLogical("KVPageTable::entry", logicalPage);
  return mHost[static_cast<std::size_t>(slot) * 2 * static_cast<std::size_t>(mMaxPagesPerSeq) +
               static_cast<std::size_t>(logicalPage)];
}

std::span<int32_t const> KVPageTable::hostRow(CacheSlot slot) const {
  validateSlot("KVPageTable::hostRow", slot);
  auto const width = 2 * static_cast<std::size_t>(mMaxPagesPerSeq);
  return std::span<int32_t const>(mHost).subspan(static_cast<std::size_t>(slot) * width, width);
}

int32_t KVPageTable::liveEntryCount(CacheSlot slot) const {
  validateSlot("KVPageTable::liveEntryCount", slot);
  return mLiveCount[static_cast<std::size_t>(slot)];
}

bool KVPageTable::entriesLive(CacheSlot slot, int32_t first, int32_t last) const {
  constexpr char const* kCall = "KVPageTable::entriesLive";
  validateSlot(kCall, slot);
  MKV_REQUIRE(first >= 0 && first <= last && last <= mMaxPagesPerSeq, kCall,
              "entries [{}, {}) outside a row of {}", first, last, mMaxPagesPerSeq);
  if (first == last) {
    return true;
  }
  auto const s = static_cast<std::size_t>(slot);
  // The live range is tight (writeEntry keeps a live entry at each end), so a range holding as
  // many entries as the row has live ones has no hole.
  if (mLiveEnd[s] - mLiveBegin[s] == mLiveCount[s]) {
    return mLiveBegin[s] <= first && last <= mLiveEnd[s];
  }
  std::span<int32_t const> const k = hostRow(slot);
  return std::all_of(k.begin() + first, k.begin() + last,
                     [](int32_t page) { return page != kNoPage; });
}

bool KVPageTable::upload(cudaStream_t stream) {
  return uploadRanges(/*rowGranular=*/true, nullptr, stream);
}

bool KVPageTable::uploadDirty(cudaStream_t stream) {
  return uploadRanges(/*rowGranular=*/false, nullptr, stream);
}

bool KVPageTable::uploadDirty(kernels::InlinePatchBatch& batch, cudaStream_t stream) {
  return uploadRanges(/*rowGranular=*/false, &batch, stream);
}

bool KVPageTable::uploadRanges(bool rowGranular, kernels::InlinePatchBatch* batch,
                               cudaStream_t stream) {
  char const* const call = rowGranular ? "KVPageTable::upload" : "KVPageTable::uploadDirty";
  if (mDirtyEntries.empty()) {
    mLastUpload = {};
    return false;
  }
  // Sorting reorders the dirty set but does not change it, so a throw below leaves the table
  // and its dirty state as they were. Entries are mostly appended in order (rows in batch order,
  // entries ascending), so the O(n) test usually saves the sort.
  if (!std::is_sorted(mDirtyEntries.begin(), mDirtyEntries.end())) {
    std::sort(mDirtyEntries.begin(), mDirtyEntries.end());
  }
  DirtyRuns const runs{mDirtyEntries, mMaxPagesPerSeq, rowGranular};
  forEachDirtyRow(runs, [&](int64_t row, int32_t firstDirty, int32_t lastDirty) {
    auto const r = static_cast<std::size_t>(row);
    bool const anyLive = mLiveBegin[r] < mLiveEnd[r];
    int32_t const first = anyLive ? std::min(mLiveBegin[r], firstDirty) : firstDirty;
    int32_t const last = anyLive ? std::max(mLiveEnd[r], lastDirty + 1) : lastDirty + 1;
    std::string error;
    if (!checkRow(static_cast<CacheSlot>(row), &error, first, last)) {
      detail::throwContract(call, "broken table, nothing uploaded: {}", error);
    }
  });

  int64_t numRanges = 0;
  int64_t values = 0;
  runs.forEachRange([&](int64_t, int64_t count) {
    ++numRanges;
    values += count;
  });
  bool const inlinePatch = values + 3 * numRanges <= kernels::kMaxInlinePatchValues;
  if (inlinePatch) {
    // The common case (a request's rows, a decode step's growth): the values ride in the
    // parameters of one launch, the caller's batch or the table's own.
    kernels::InlinePatchBatch& writes = batch != nullptr ? *batch : mOwnWrites;
    runs.forEachRange([&](int64_t offset, int64_t count) {
      writes.add(call, mDevice, offset, hostValues(mHost, offset, count), stream);
    });
    if (batch == nullptr) {
      mOwnWrites.flush(stream);
    }
  } else {
    if (batch != nullptr) {
      batch->flush(stream);  // what the caller queued before stays ahead of this upload
    }
    // A large upload (a whole table, a big batch): the patch goes through pinned staging.
    buildStagedPatch(mPatch, mHost, runs, numRanges);
    detail::Int32Staging::Batch staged = mStaging->begin(stream);
    Tensor const patch = staged.add(mPatch);
    staged.submit();
    kernels::applyInt32Patch(mDevice, patch, static_cast<int32_t>(numRanges), stream);
  }

  clearDirtyFlags(mEntryDirtyFlag, runs);
  mDirtyEntries.clear();
  mLastUpload.entries = values;
  mLastUpload.ranges = numRanges;
  mLastUpload.staged = inlinePatch ? 0 : 1;
  mTotalUpload.entries += mLastUpload.entries;
  mTotalUpload.ranges += mLastUpload.ranges;
  mTotalUpload.staged += mLastUpload.staged;
  return true;
}

void KVPageTable::gatherRows(Tensor& dst, Tensor const& residentSlots, cudaStream_t stream) const {
  constexpr char const* kCall = "KVPageTable::gatherRows";
  MKV_REQUIRE(residentSlots.deviceType() == mDeviceType && dst.deviceType() == mDeviceType, kCall,
              "residentSlots on {} and dst on {}, but the table is on {}",
              toString(residentSlots.deviceType()), toString(dst.deviceType()),
              toString(mDeviceType));
  kernels::gatherPageTableRows(mDevice, residentSlots, dst, stream);
}

}  // namespace mkv
