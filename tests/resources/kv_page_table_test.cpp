#include "mkv/kv_page_table.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "support/test_util.h"

namespace mkv {

/// Breaks the host copy behind the mutators' back, to show that checkInvariants and the
/// uploads really check (the public API cannot produce a broken table).
class KVPageTableTestPeer {
 public:
  /// Writes one raw host value (half 0 = K, 1 = V) and marks the entry dirty.
  static void poke(KVPageTable& table, CacheSlot slot, int32_t half, int32_t logical,
                   int32_t value) {
    auto const width = static_cast<std::size_t>(table.mMaxPagesPerSeq);
    auto const s = static_cast<std::size_t>(slot);
    auto const l = static_cast<std::size_t>(logical);
    table.mHost[(2 * s + static_cast<std::size_t>(half)) * width + l] = value;
    if (table.mEntryDirtyFlag[s * width + l] == 0) {
      table.mEntryDirtyFlag[s * width + l] = 1;
      table.mDirtyEntries.push_back(static_cast<int64_t>(2 * s * width + l));
    }
  }
  static void setLiveCount(KVPageTable& table, CacheSlot slot, int32_t count) {
    table.mLiveCount[static_cast<std::size_t>(slot)] = count;
  }
};

namespace {

using test::throwsError;
using Mode = PageTableMode;

/// Everything observable on the host side of a table.
struct HostState {
  std::vector<int32_t> entries;
  std::vector<int32_t> live;
  bool dirty = false;
  bool operator==(HostState const&) const = default;
};

HostState hostState(KVPageTable const& table) {
  HostState state;
  for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
    std::span<int32_t const> const row = table.hostRow(slot);
    state.entries.insert(state.entries.end(), row.begin(), row.end());
    state.live.push_back(table.liveEntryCount(slot));
  }
  state.dirty = table.dirty();
  return state;
}

std::vector<int32_t> hostEntries(KVPageTable const& table) { return hostState(table).entries; }

std::vector<int32_t> mirror(KVPageTable const& table) {
  return test::readAs<int32_t>(table.deviceTable());
}

/// Expected host row for K ids (V derived), padded with -1 to the row width.
std::vector<int32_t> rowOf(std::vector<int32_t> kIds, int32_t width, int32_t numPages) {
  kIds.resize(static_cast<std::size_t>(width), kNoPage);
  std::vector<int32_t> row = kIds;
  for (int32_t k : kIds) {
    row.push_back(k == kNoPage ? kNoPage : k + numPages);
  }
  return row;
}

std::vector<int32_t> toVector(std::span<int32_t const> span) { return {span.begin(), span.end()}; }

class KVPageTableTest : public test::DeviceTest {
 protected:
  static constexpr int32_t kBatch = 4;
  static constexpr int32_t kWidth = 6;
  static constexpr int32_t kPages = 32;

  KVPageTable make(Mode mode) const { return KVPageTable(kBatch, kWidth, kPages, mode, device()); }
  static std::vector<int32_t> row(std::vector<int32_t> kIds) {
    return rowOf(std::move(kIds), kWidth, kPages);
  }
};

TEST(KVPageTableConstructionTest, RejectsInvalidSizes) {
  int32_t const tooManyPages = std::numeric_limits<int32_t>::max() / 2 + 1;
  EXPECT_TRUE(throwsError([] { KVPageTable(0, 4, 8, Mode::kDense, DeviceType::kCPU); },
                          {"KVPageTable", "maxBatch", "0"}));
  EXPECT_TRUE(throwsError([] { KVPageTable(2, -1, 8, Mode::kDense, DeviceType::kCPU); },
                          {"KVPageTable", "maxPagesPerSeq", "-1"}));
  EXPECT_TRUE(throwsError([] { KVPageTable(2, 4, 0, Mode::kDense, DeviceType::kCPU); },
                          {"KVPageTable", "numPages", "0"}));
  EXPECT_TRUE(throwsError([&] { KVPageTable(2, 4, tooManyPages, Mode::kDense, DeviceType::kCPU); },
                          {"KVPageTable", "numPages", std::to_string(tooManyPages)}));
  EXPECT_TRUE(throwsError([] { KVPageTable(1 << 16, 1 << 14, 8, Mode::kDense, DeviceType::kCPU); },
                          {"KVPageTable", "too large"}));
  EXPECT_NO_THROW(
      KVPageTable(2, 4, std::numeric_limits<int32_t>::max() / 2, Mode::kDense, DeviceType::kCPU));
}

template <typename Table>
concept CanCompactRows = requires(Table& table) {
  table.compactRows();
};
template <typename Table>
concept CanMoveRow = requires(Table& table) {
  table.moveRow(0, 1);
};

TEST(KVPageTableConstructionTest, HasNoApiThatMovesRowsBetweenSlots) {
  EXPECT_FALSE(CanCompactRows<KVPageTable>);
  EXPECT_FALSE(CanMoveRow<KVPageTable>);
}

TEST_P(KVPageTableTest, NewTableIsEmptyCleanAndItsMirrorHoldsMinusOne) {
  KVPageTable const table = make(Mode::kDense);
  EXPECT_EQ(table.maxBatch(), kBatch);
  EXPECT_EQ(table.maxPagesPerSeq(), kWidth);
  EXPECT_EQ(table.numPages(), kPages);
  EXPECT_EQ(table.deviceType(), device());
  EXPECT_FALSE(table.dirty());
  EXPECT_TRUE(table.checkInvariants());
  EXPECT_EQ(table.deviceTable().shape(), (Coords{kBatch, 2, kWidth}));
  EXPECT_EQ(table.deviceTable().deviceType(), device());
  std::vector<int32_t> const empty(kBatch * 2 * kWidth, kNoPage);
  EXPECT_EQ(hostEntries(table), empty);
  EXPECT_EQ(mirror(table), empty);
  EXPECT_EQ(table.liveEntryCount(2), 0);
}

TEST_P(KVPageTableTest, UploadDirtyIntoABatchLandsWithTheBatchsOneLaunch) {
  KVPageTable table = make(Mode::kDense);
  Tensor lengths = test::int32Tensor({0, 0, 0, 0}, device());
  kernels::InlinePatchBatch batch;
  batch.add("test", lengths, 1, std::vector<int32_t>{64}, nullptr);
  table.setRow(1, std::vector<int32_t>{3, 4, 5});
  table.setRow(3, std::vector<int32_t>{9});
  std::vector<int32_t> const before = mirror(table);
  EXPECT_TRUE(table.uploadDirty(batch, nullptr));
  EXPECT_FALSE(table.dirty());
  EXPECT_EQ(table.lastUploadStats().entries, 8);  // K and V of four entries
  EXPECT_EQ(table.lastUploadStats().staged, 0);
  EXPECT_EQ(mirror(table), before) << "queued, not launched";
  batch.flush(nullptr);
  EXPECT_EQ(batch.launches(), 1);
  EXPECT_EQ(mirror(table), hostEntries(table));
  EXPECT_EQ(test::readAs<int32_t>(lengths), (std::vector<int32_t>{0, 64, 0, 0}));
  EXPECT_FALSE(table.uploadDirty(batch, nullptr)) << "a clean table queues nothing";
  EXPECT_TRUE(batch.empty());
}

TEST_P(KVPageTableTest, AnUploadBeyondTheInlineLimitFlushesTheBatchFirst) {
  KVPageTable table(64, 16, 4096, Mode::kDense, device());
  Tensor marker = test::int32Tensor({0}, device());
  kernels::InlinePatchBatch batch;
  batch.add("test", marker, 0, std::vector<int32_t>{1}, nullptr);
  for (CacheSlot slot = 0; slot < 64; ++slot) {
    std::vector<int32_t> pages(16);
    std::iota(pages.begin(), pages.end(), 16 * slot);
    table.setRow(slot, pages);
  }
  EXPECT_TRUE(table.uploadDirty(batch, nullptr));  // 2,048 entries: staged
  EXPECT_EQ(table.lastUploadStats().staged, 1) << "its own copy and launch";
  EXPECT_EQ(table.totalUploadStats().staged, 1);
  EXPECT_EQ(batch.launches(), 1);
  EXPECT_TRUE(batch.empty());
  EXPECT_EQ(test::readAs<int32_t>(marker), (std::vector<int32_t>{1}));
  EXPECT_EQ(mirror(table), hostEntries(table));
}

TEST_P(KVPageTableTest, SetRowWritesKPagesDerivesVPagesAndClearsTheTail) {
  KVPageTable table = make(Mode::kDense);
  std::vector<int32_t> const pages{3, 4, 5};
  table.setRow(1, pages);
  EXPECT_EQ(toVector(table.hostRow(1)), row({3, 4, 5}));
  EXPECT_EQ(table.liveEntryCount(1), 3);
  EXPECT_EQ(table.entry(1, 2), 5);
  EXPECT_EQ(table.entry(1, 3), kNoPage);
  std::vector<int32_t> const shorter{7};
  table.setRow(1, shorter);
  EXPECT_EQ(toVector(table.hostRow(1)), row({7}));
  EXPECT_EQ(table.liveEntryCount(1), 1);
  EXPECT_EQ(toVector(table.hostRow(0)), row({}));  // other rows untouched
  EXPECT_TRUE(table.checkInvariants());
}

TEST_P(KVPageTableTest, SetRowRejectsInvalidPagesWithoutMutation) {
  for (Mode mode : {Mode::kDense, Mode::kSparseWindow}) {
    KVPageTable table = make(mode);
    std::vector<int32_t> const initial{1, 2, 3};
    table.setRow(2, initial);
    ASSERT_TRUE(table.uploadDirty(nullptr));
    table.setEntry(0, 0, 9);  // one pending dirty entry
    HostState const before = hostState(table);
    std::vector<int32_t> const outOfRange{4, 32};
    std::vector<int32_t> const negative{4, -7};
    std::vector<int32_t> const tooLong(kWidth + 1, 0);
    EXPECT_TRUE(throwsError([&] { table.setRow(2, outOfRange); },
                            {"KVPageTable::setRow", "slot 2", "page[1] = 32", "[0, 32)"}));
    EXPECT_TRUE(
        throwsError([&] { table.setRow(2, negative); }, {"KVPageTable::setRow", "page[1] = -7"}));
    EXPECT_TRUE(throwsError([&] { table.setRow(2, tooLong); },
                            {"KVPageTable::setRow", "7 pages", "at most 6"}));
    EXPECT_TRUE(throwsError([&] { table.setRow(4, initial); },
                            {"KVPageTable::setRow", "slot 4 is outside [0, 4)"}));
    EXPECT_TRUE(
        throwsError([&] { table.setRow(-1, initial); }, {"KVPageTable::setRow", "slot -1"}));
    EXPECT_EQ(hostState(table), before);
    ASSERT_TRUE(table.uploadDirty(nullptr));  // only the entry set before the failures
    EXPECT_EQ(table.lastUploadStats().entries, 2);
    EXPECT_EQ(mirror(table), hostEntries(table));
  }
}

TEST_P(KVPageTableTest, DenseRowsRejectEmptyEntriesInsideTheRow) {
  KVPageTable table = make(Mode::kDense);
  HostState const before = hostState(table);
  std::vector<int32_t> const withHole{1, -1, 2};
  EXPECT_TRUE(throwsError([&] { table.setRow(0, withHole); },
                          {"KVPageTable::setRow", "page[1] = -1", "sparse-window"}));
  EXPECT_EQ(hostState(table), before);
}

TEST_P(KVPageTableTest, SetRowsAppliesMixedRowsAndClearsEmptyRows) {
  KVPageTable table = make(Mode::kDense);
  std::vector<int32_t> const old{8, 9};
  table.setRow(3, old);
  std::vector<int32_t> const a{1, 2, 3, 4, 5, 6};
  std::vector<int32_t> const b{10};
  std::vector<KVPageTable::RowUpdate> const updates{{0, a}, {3, {}}, {1, b}};
  table.setRows(updates);
  EXPECT_EQ(toVector(table.hostRow(0)), row({1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(toVector(table.hostRow(1)), row({10}));
  EXPECT_EQ(toVector(table.hostRow(2)), row({}));
  EXPECT_EQ(toVector(table.hostRow(3)), row({}));
  EXPECT_EQ(table.liveEntryCount(3), 0);
  EXPECT_TRUE(table.checkInvariants());
}

TEST_P(KVPageTableTest, SetRowsRejectsAnInvalidUpdateWithoutPartialMutation) {
  KVPageTable table = make(Mode::kSparseWindow);
  std::vector<int32_t> const old{5, -1, 6};
  table.setRow(1, old);
  HostState const before = hostState(table);
  std::vector<int32_t> const valid{1, 2};
  std::vector<int32_t> const duplicate{3, -1, 3};
  std::vector<int32_t> const outOfRange{40};
  std::vector<KVPageTable::RowUpdate> const withDuplicate{{0, valid}, {1, duplicate}};
  EXPECT_TRUE(throwsError([&] { table.setRows(withDuplicate); },
                          {"KVPageTable::setRows", "slot 1", "page 3 appears more than once"}));
  std::vector<KVPageTable::RowUpdate> const withBadPage{{0, valid}, {2, outOfRange}};
  EXPECT_TRUE(throwsError([&] { table.setRows(withBadPage); },
                          {"KVPageTable::setRows", "slot 2", "page[0] = 40"}));
  std::vector<KVPageTable::RowUpdate> const withBadSlot{{0, valid}, {9, valid}};
  EXPECT_TRUE(throwsError([&] { table.setRows(withBadSlot); },
                          {"KVPageTable::setRows", "slot 9 is outside"}));
  EXPECT_EQ(hostState(table), before);
}

TEST_P(KVPageTableTest, SetRowsRejectsRepeatedSlotsWithoutMutation) {
  KVPageTable table = make(Mode::kDense);
  HostState const before = hostState(table);
  std::vector<int32_t> const a{1};
  std::vector<int32_t> const b{2};
  std::vector<KVPageTable::RowUpdate> const updates{{2, a}, {0, a}, {2, b}};
  EXPECT_TRUE(throwsError([&] { table.setRows(updates); },
                          {"KVPageTable::setRows", "slot 2 is updated more than once"}));
  EXPECT_EQ(hostState(table), before);
  EXPECT_FALSE(table.uploadDirty(nullptr));
}

TEST_P(KVPageTableTest, SparseWindowAllowsDisjointRangesAndDerivesVIds) {
  KVPageTable table = make(Mode::kSparseWindow);
  std::vector<int32_t> const window{-1, -1, 4, 5, -1, 9};
  table.setRow(0, window);
  EXPECT_EQ(toVector(table.hostRow(0)), row({-1, -1, 4, 5, -1, 9}));
  EXPECT_EQ(table.liveEntryCount(0), 3);
  EXPECT_TRUE(table.checkInvariants());
  ASSERT_TRUE(table.uploadDirty(nullptr));
  EXPECT_EQ(mirror(table), hostEntries(table));
}

TEST_P(KVPageTableTest, SparseWindowRejectsADuplicateLivePageWithinARow) {
  KVPageTable table = make(Mode::kSparseWindow);
  std::vector<int32_t> const window{-1, 4, 5};
  table.setRow(0, window);
  HostState const before = hostState(table);
  std::vector<int32_t> const duplicate{7, -1, 7};
  EXPECT_TRUE(throwsError([&] { table.setRow(1, duplicate); },
                          {"KVPageTable::setRow", "slot 1", "page 7 appears more than once"}));
  EXPECT_TRUE(throwsError(
      [&] { table.setEntry(0, 4, 5); },
      {"KVPageTable::setEntry", "slot 0 entry 4", "page 5 is already live at entry 2"}));
  EXPECT_EQ(hostState(table), before);
  table.setEntry(0, 2, 5);  // rewriting an entry with its own page is no duplicate
  EXPECT_EQ(hostState(table), before);
}

TEST_P(KVPageTableTest, SparseWindowAllowsTheSamePageInDifferentRows) {
  KVPageTable table = make(Mode::kSparseWindow);
  std::vector<int32_t> const shared{-1, 11, 12};
  table.setRow(0, shared);
  table.setRow(1, shared);
  table.setEntry(2, 5, 11);
  EXPECT_TRUE(table.checkInvariants());
  EXPECT_EQ(table.entry(1, 1), 11);
  EXPECT_EQ(table.entry(2, 5), 11);
}

TEST_P(KVPageTableTest, SparseEntryMutatorsWorkAnywhereInTheRow) {
  KVPageTable table = make(Mode::kSparseWindow);
  table.setEntry(3, 5, 20);
  table.setEntry(3, 2, 21);
  table.setEntry(3, 3, 22);
  table.clearEntry(3, 3);
  table.setEntry(3, 2, 23);  // replace
  EXPECT_EQ(toVector(table.hostRow(3)), row({-1, -1, 23, -1, -1, 20}));
  EXPECT_EQ(table.liveEntryCount(3), 2);
  EXPECT_TRUE(table.checkInvariants());
}

TEST_P(KVPageTableTest, DenseSetEntryAppendsOrReplacesButNeverLeavesAHole) {
  KVPageTable table = make(Mode::kDense);
  table.setEntry(0, 0, 1);
  table.setEntry(0, 1, 2);
  table.setEntry(0, 2, 3);
  HostState const before = hostState(table);
  EXPECT_TRUE(
      throwsError([&] { table.setEntry(0, 4, 9); },
                  {"KVPageTable::setEntry", "slot 0 entry 4", "3 live entries", "appended at 3"}));
  EXPECT_EQ(hostState(table), before);
  table.setEntry(0, 1, 7);  // replace below the end
  table.setEntry(0, 3, 8);  // append
  EXPECT_EQ(toVector(table.hostRow(0)), row({1, 7, 3, 8}));
  EXPECT_TRUE(table.checkInvariants());
}

TEST_P(KVPageTableTest, DenseClearEntryOnlyRemovesTheLastLiveEntry) {
  KVPageTable table = make(Mode::kDense);
  std::vector<int32_t> const pages{1, 2, 3};
  table.setRow(0, pages);
  HostState const before = hostState(table);
  EXPECT_TRUE(throwsError([&] { table.clearEntry(0, 0); },
                          {"KVPageTable::clearEntry", "slot 0 entry 0", "last live entry (2)"}));
  EXPECT_TRUE(throwsError([&] { table.clearEntry(0, 1); }, {"KVPageTable::clearEntry", "entry 1"}));
  EXPECT_EQ(hostState(table), before);
  table.clearEntry(0, 5);  // already empty: nothing to do
  EXPECT_EQ(hostState(table), before);
  table.clearEntry(0, 2);
  table.clearEntry(0, 1);
  EXPECT_EQ(toVector(table.hostRow(0)), row({1}));
  EXPECT_TRUE(table.checkInvariants());
}

TEST_P(KVPageTableTest, EntryMutatorsAndObserversRejectInvalidArguments) {
  KVPageTable table = make(Mode::kSparseWindow);
  table.setEntry(1, 1, 1);
  ASSERT_TRUE(table.uploadDirty(nullptr));
  HostState const before = hostState(table);
  EXPECT_TRUE(throwsError([&] { table.setEntry(4, 0, 1); }, {"KVPageTable::setEntry", "slot 4"}));
  EXPECT_TRUE(throwsError([&] { table.setEntry(0, 6, 1); },
                          {"KVPageTable::setEntry", "logical page 6 is outside [0, 6)"}));
  EXPECT_TRUE(
      throwsError([&] { table.setEntry(0, -1, 1); }, {"KVPageTable::setEntry", "logical page -1"}));
  EXPECT_TRUE(throwsError([&] { table.setEntry(0, 0, -1); },
                          {"KVPageTable::setEntry", "page -1 is outside [0, 32)", "clearEntry"}));
  EXPECT_TRUE(throwsError([&] { table.setEntry(0, 0, 32); }, {"KVPageTable::setEntry", "page 32"}));
  EXPECT_TRUE(
      throwsError([&] { table.clearEntry(-2, 0); }, {"KVPageTable::clearEntry", "slot -2"}));
  EXPECT_TRUE(
      throwsError([&] { table.clearEntry(0, 7); }, {"KVPageTable::clearEntry", "logical page 7"}));
  EXPECT_TRUE(throwsError([&] { table.clearRow(4); }, {"KVPageTable::clearRow", "slot 4"}));
  EXPECT_TRUE(throwsError([&] { (void)table.entry(0, 6); }, {"KVPageTable::entry", "6"}));
  EXPECT_TRUE(throwsError([&] { (void)table.hostRow(5); }, {"KVPageTable::hostRow", "slot 5"}));
  EXPECT_TRUE(throwsError([&] { (void)table.liveEntryCount(-1); },
                          {"KVPageTable::liveEntryCount", "slot -1"}));
  EXPECT_EQ(hostState(table), before);
  EXPECT_FALSE(table.dirty());
}

TEST_P(KVPageTableTest, ClearingARetiredRowDoesNotMoveSurvivorBindings) {
  KVPageTable table = make(Mode::kDense);
  std::vector<int32_t> const r0{1, 2}, r1{3, 4, 5}, r2{6};
  std::vector<KVPageTable::RowUpdate> const updates{{0, r0}, {1, r1}, {2, r2}};
  table.setRows(updates);
  ASSERT_TRUE(table.upload(nullptr));
  table.clearRow(1);
  EXPECT_EQ(toVector(table.hostRow(0)), row({1, 2}));
  EXPECT_EQ(toVector(table.hostRow(1)), row({}));
  EXPECT_EQ(toVector(table.hostRow(2)), row({6}));
  ASSERT_TRUE(table.uploadDirty(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 6);  // 3 K entries + their V twins
  EXPECT_EQ(table.lastUploadStats().ranges, 2);
  EXPECT_EQ(mirror(table), hostEntries(table));
}

TEST_P(KVPageTableTest, ClearingEmptyEntriesAndRowsRecordsNothing) {
  KVPageTable table = make(Mode::kSparseWindow);
  table.clearEntry(0, 3);
  table.clearRow(2);
  EXPECT_FALSE(table.dirty());
  EXPECT_FALSE(table.uploadDirty(nullptr));
  EXPECT_FALSE(table.upload(nullptr));
}

TEST_P(KVPageTableTest, UploadDirtyOfOneEntryCopiesTwoEntriesInTwoRanges) {
  KVPageTable table = make(Mode::kDense);
  table.setEntry(2, 0, 17);
  EXPECT_TRUE(table.dirty());
  ASSERT_TRUE(table.uploadDirty(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 2);
  EXPECT_EQ(table.lastUploadStats().ranges, 2);
  EXPECT_FALSE(table.dirty());
  EXPECT_EQ(mirror(table), hostEntries(table));
}

TEST_P(KVPageTableTest, UploadDirtyCoalescesAdjacentEntriesOnly) {
  KVPageTable table = make(Mode::kSparseWindow);
  table.setEntry(1, 3, 10);
  table.setEntry(1, 2, 11);  // adjacent to the first, recorded out of order
  ASSERT_TRUE(table.uploadDirty(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 4);
  EXPECT_EQ(table.lastUploadStats().ranges, 2);

  table.setEntry(1, 0, 12);
  table.setEntry(1, 5, 13);  // same row, not adjacent
  ASSERT_TRUE(table.uploadDirty(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 4);
  EXPECT_EQ(table.lastUploadStats().ranges, 4);

  table.setEntry(0, 5, 14);
  table.setEntry(1, 1, 15);  // last K entry of row 0 and an entry of row 1 never merge
  table.setEntry(1, 4, 16);
  table.setEntry(1, 3, 17);  // replaces 10: adjacent to 4
  ASSERT_TRUE(table.uploadDirty(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 8);
  EXPECT_EQ(table.lastUploadStats().ranges, 6);
  EXPECT_EQ(mirror(table), hostEntries(table));
}

TEST_P(KVPageTableTest, IdenticalRewritesDoNotUpload) {
  KVPageTable table = make(Mode::kDense);
  std::vector<int32_t> const pages{4, 5, 6};
  table.setRow(0, pages);
  ASSERT_TRUE(table.uploadDirty(nullptr));
  PageTableUploadStats const total = table.totalUploadStats();
  table.setRow(0, pages);
  table.setEntry(0, 1, 5);
  std::vector<KVPageTable::RowUpdate> const same{{0, pages}};
  table.setRows(same);
  EXPECT_FALSE(table.dirty());
  EXPECT_FALSE(table.uploadDirty(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 0);
  EXPECT_EQ(table.lastUploadStats().ranges, 0);
  EXPECT_FALSE(table.upload(nullptr));
  EXPECT_EQ(table.totalUploadStats().entries, total.entries);
  EXPECT_EQ(table.totalUploadStats().ranges, total.ranges);
}

TEST_P(KVPageTableTest, MirrorDiffersBeforeTheUploadAndEqualsTheHostAfterIt) {
  for (bool entryGranular : {true, false}) {
    KVPageTable table = make(Mode::kSparseWindow);
    std::vector<int32_t> const pages{-1, 3, 4};
    table.setRow(1, pages);
    std::vector<int32_t> const stale = mirror(table);
    EXPECT_NE(stale, hostEntries(table));
    EXPECT_EQ(stale, std::vector<int32_t>(kBatch * 2 * kWidth, kNoPage));
    ASSERT_TRUE(entryGranular ? table.uploadDirty(nullptr) : table.upload(nullptr));
    EXPECT_EQ(mirror(table), hostEntries(table));
  }
}

TEST_P(KVPageTableTest, UploadCopiesWholeDirtyRowsAndCoalescesAdjacentRows) {
  KVPageTable table = make(Mode::kDense);
  table.setEntry(0, 0, 1);
  table.setEntry(1, 0, 2);
  table.setEntry(1, 1, 3);
  table.setEntry(3, 0, 4);
  ASSERT_TRUE(table.upload(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 3 * 2 * kWidth);  // rows 0, 1 and 3
  EXPECT_EQ(table.lastUploadStats().ranges, 2);                // [0, 2) and [3, 4)
  EXPECT_EQ(mirror(table), hostEntries(table));
  EXPECT_FALSE(table.dirty());
  EXPECT_FALSE(table.upload(nullptr));
  EXPECT_EQ(table.lastUploadStats().entries, 0);
}

TEST_P(KVPageTableTest, AChangedThenRevertedEntryStillUploadsCorrectly) {
  KVPageTable table = make(Mode::kDense);
  table.setEntry(0, 0, 1);
  ASSERT_TRUE(table.uploadDirty(nullptr));
  table.setEntry(0, 0, 2);
  table.setEntry(0, 0, 1);
  ASSERT_TRUE(table.uploadDirty(nullptr));  // the entry may differ: it is uploaded once
  EXPECT_EQ(table.lastUploadStats().entries, 2);
  EXPECT_EQ(mirror(table), hostEntries(table));
}

TEST_P(KVPageTableTest, BackToBackUploadsReuseStagingSafely) {
  KVPageTable table = make(Mode::kSparseWindow);
  std::mt19937_64 rng(11);
  for (int step = 0; step < 60; ++step) {
    CacheSlot const slot = static_cast<CacheSlot>(rng() % kBatch);
    int32_t const logical = static_cast<int32_t>(rng() % kWidth);
    table.clearRow(slot);
    table.setEntry(slot, logical, static_cast<PageId>(rng() % kPages));
    bool const uploaded = step % 2 == 0 ? table.uploadDirty(nullptr) : table.upload(nullptr);
    ASSERT_TRUE(uploaded);
    ASSERT_EQ(mirror(table), hostEntries(table)) << "step " << step;
  }
}

TEST_P(KVPageTableTest, TotalStatsAccumulateOverUploads) {
  KVPageTable table = make(Mode::kDense);
  table.setEntry(0, 0, 1);
  ASSERT_TRUE(table.uploadDirty(nullptr));
  table.setEntry(2, 0, 1);
  ASSERT_TRUE(table.upload(nullptr));
  EXPECT_EQ(table.totalUploadStats().entries, 2 + 2 * kWidth);
  EXPECT_EQ(table.totalUploadStats().ranges, 3);
}

TEST_P(KVPageTableTest, DeviceMirrorKeepsAStableAddress) {
  KVPageTable table = make(Mode::kDense);
  void const* const address = table.deviceTable().rawPointer();
  for (int i = 0; i < 3; ++i) {
    table.setEntry(0, i, i);
    ASSERT_TRUE(table.uploadDirty(nullptr));
  }
  EXPECT_EQ(table.deviceTable().rawPointer(), address);
}

TEST_P(KVPageTableTest, GatherRowsUsesResidentOrderAndMinusOneRows) {
  KVPageTable table = make(Mode::kDense);
  std::vector<int32_t> const r0{1}, r2{2, 3}, r3{4, 5, 6};
  std::vector<KVPageTable::RowUpdate> const updates{{0, r0}, {2, r2}, {3, r3}};
  table.setRows(updates);
  ASSERT_TRUE(table.uploadDirty(nullptr));
  Tensor dst({kBatch, 2, kWidth}, DataType::kInt32, device());
  void* const address = dst.rawPointer();
  Tensor const slots = test::int32Tensor({3, -1, 0}, device());
  table.gatherRows(dst, slots, nullptr);
  EXPECT_EQ(dst.shape(), (Coords{3, 2, kWidth}));
  EXPECT_EQ(dst.rawPointer(), address);
  std::vector<int32_t> expected = row({4, 5, 6});
  std::vector<int32_t> const empty = row({});
  std::vector<int32_t> const first = row({1});
  expected.insert(expected.end(), empty.begin(), empty.end());
  expected.insert(expected.end(), first.begin(), first.end());
  EXPECT_EQ(test::readAs<int32_t>(dst), expected);
}

TEST_P(KVPageTableTest, GatherRowsReadsTheMirrorNotTheHostCopy) {
  KVPageTable table = make(Mode::kDense);
  table.setEntry(1, 0, 9);  // not uploaded yet
  Tensor dst({1, 2, kWidth}, DataType::kInt32, device());
  Tensor const slots = test::int32Tensor({1}, device());
  table.gatherRows(dst, slots, nullptr);
  EXPECT_EQ(test::readAs<int32_t>(dst), row({}));
  ASSERT_TRUE(table.uploadDirty(nullptr));
  table.gatherRows(dst, slots, nullptr);
  EXPECT_EQ(test::readAs<int32_t>(dst), row({9}));
}

TEST_P(KVPageTableTest, GatherRowsRejectsForeignDevicesAndSmallDestinations) {
  KVPageTable const table = make(Mode::kDense);
  DeviceType const other = device() == DeviceType::kCPU ? DeviceType::kGPU : DeviceType::kCPU;
  int32_t dummy[16] = {};
  Tensor foreign = Tensor::view(dummy, {16}, DataType::kInt32, other);  // never dereferenced
  Tensor const slots = test::int32Tensor({0, 1}, device());
  EXPECT_TRUE(throwsError([&] { table.gatherRows(foreign, slots, nullptr); },
                          {"KVPageTable::gatherRows", std::string(toString(other))}));
  Tensor small({1, 2, kWidth}, DataType::kInt32, device());
  EXPECT_TRUE(throwsError([&] { table.gatherRows(small, slots, nullptr); },
                          {"gatherPageTableRows", "capacity"}));
}

TEST_P(KVPageTableTest, ReusingASparseRowLeavesNoStaleMappings) {
  KVPageTable table = make(Mode::kSparseWindow);
  std::vector<int32_t> const window{-1, -1, 3, 4, 5};
  table.setRow(0, window);
  ASSERT_TRUE(table.upload(nullptr));
  table.clearRow(0);
  std::vector<int32_t> const next{6};
  table.setRow(0, next);
  ASSERT_TRUE(table.uploadDirty(nullptr));
  EXPECT_EQ(toVector(table.hostRow(0)), row({6}));
  EXPECT_EQ(mirror(table), hostEntries(table));
  EXPECT_EQ(table.liveEntryCount(0), 1);
}

// Uploads check every row they are about to copy (not the whole table: that would make a
// decode-step upload O(table)); each corruption below therefore also dirties its row.
TEST_P(KVPageTableTest, ChecksDetectBrokenRowsAndUploadsRefuseThem) {
  struct Case {
    Mode mode;
    std::vector<int32_t> pages;
    void (*breakIt)(KVPageTable&);
    char const* fragment;
  };
  std::vector<Case> const cases{
      {Mode::kDense,
       {1, 2},
       [](KVPageTable& t) { KVPageTableTestPeer::poke(t, 0, 1, 1, 99); },
       "row 0 entry 1: V page is 99, expected 34"},
      {Mode::kDense,
       {1, 2},
       [](KVPageTable& t) {
         KVPageTableTestPeer::poke(t, 0, 0, 0, 40);
         KVPageTableTestPeer::poke(t, 0, 1, 0, 72);
       },
       "row 0 entry 0: K page 40 is outside [0, 32)"},
      {Mode::kDense,
       {1, 2, 3},
       [](KVPageTable& t) {
         KVPageTableTestPeer::poke(t, 0, 0, 1, -1);
         KVPageTableTestPeer::poke(t, 0, 1, 1, -1);
         KVPageTableTestPeer::setLiveCount(t, 0, 2);
       },
       "row 0 entry 2: live entry after an empty one in a dense table"},
      {Mode::kSparseWindow,
       {1, -1, 2},
       [](KVPageTable& t) {
         KVPageTableTestPeer::poke(t, 0, 0, 1, 1);
         KVPageTableTestPeer::poke(t, 0, 1, 1, 33);
         KVPageTableTestPeer::setLiveCount(t, 0, 3);
       },
       "row 0: page 1 is live more than once"},
      {Mode::kSparseWindow,
       {1, -1, 2},
       [](KVPageTable& t) { KVPageTableTestPeer::poke(t, 0, 1, 1, 5); },
       "row 0 entry 1: K is empty but V is 5"},
      {Mode::kDense,
       {1, 2},
       [](KVPageTable& t) {
         KVPageTableTestPeer::setLiveCount(t, 0, 1);
         KVPageTableTestPeer::poke(t, 0, 0, 0, 1);  // unchanged value; marks row 0 dirty
       },
       "row 0: 2 live entries, but 1 are recorded"},
  };
  for (Case const& c : cases) {
    KVPageTable table = make(c.mode);
    table.setRow(0, c.pages);
    ASSERT_TRUE(table.upload(nullptr));
    ASSERT_TRUE(table.checkInvariants());
    c.breakIt(table);
    table.setEntry(2, 0, 7);  // a valid pending change elsewhere
    std::string error;
    EXPECT_FALSE(table.checkInvariants(&error));
    EXPECT_NE(error.find(c.fragment), std::string::npos) << error;
    std::vector<int32_t> const mirrorBefore = mirror(table);
    EXPECT_TRUE(throwsError([&] { table.uploadDirty(nullptr); },
                            {"KVPageTable::uploadDirty", "broken table", c.fragment}));
    EXPECT_TRUE(throwsError([&] { table.upload(nullptr); },
                            {"KVPageTable::upload", "broken table", c.fragment}));
    EXPECT_TRUE(table.dirty());
    EXPECT_EQ(mirror(table), mirrorBefore);
  }
}

// A sparse row's upload check finds a repeated page in rows of 2 to 300 live entries, with page
// ids spread out or sharing their low byte, the repeat at either end of the row.
TEST_P(KVPageTableTest, SparseUploadsFindARepeatedPageInShortAndLongRows) {
  constexpr int32_t kWide = 320;
  constexpr int32_t kManyPages = 128 * 256 + 1;
  for (int32_t const length : {2, 127, 128, 129, 300}) {
    for (int32_t const stride : {1, 256}) {  // 256: ids that all share their low byte
      SCOPED_TRACE(::testing::Message() << "length " << length << " stride " << stride);
      KVPageTable table(1, kWide, kManyPages, Mode::kSparseWindow, device());
      std::vector<int32_t> pages;
      for (int32_t i = 0; i < length; ++i) {
        pages.push_back((i * stride) % kManyPages);
      }
      table.setRow(0, pages);
      ASSERT_TRUE(table.upload(nullptr)) << "distinct pages are a valid row";
      for (int32_t const at : {length - 1, 0}) {
        int32_t const other = at == 0 ? length - 1 : 0;
        KVPageTable broken(1, kWide, kManyPages, Mode::kSparseWindow, device());
        broken.setRow(0, pages);
        ASSERT_TRUE(broken.upload(nullptr));
        int32_t const repeated = pages[static_cast<std::size_t>(other)];
        KVPageTableTestPeer::poke(broken, 0, 0, at, repeated);
        KVPageTableTestPeer::poke(broken, 0, 1, at, repeated + kManyPages);
        std::string const fragment = fmt::format("page {} is live more than once", repeated);
        EXPECT_TRUE(throwsError([&] { broken.uploadDirty(nullptr); },
                                {"KVPageTable::uploadDirty", "broken table", fragment}));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, KVPageTableTest, test::allDeviceTypes(), test::deviceName);

// ---------------------------------------------------------------- property test

/// The naive model: a plain vector of K ids per row, the rules written out directly, and the
/// set of K entries whose value changed since the last upload.
class TableModel {
 public:
  TableModel(int32_t batch, int32_t width, int32_t pages, Mode mode)
      : mBatch(batch),
        mWidth(width),
        mPages(pages),
        mMode(mode),
        mK(static_cast<std::size_t>(batch * width), kNoPage) {}

  int32_t k(int32_t slot, int32_t logical) const { return mK[index(slot, logical)]; }
  int32_t live(int32_t slot) const {
    int32_t count = 0;
    for (int32_t l = 0; l < mWidth; ++l) {
      count += k(slot, l) != kNoPage ? 1 : 0;
    }
    return count;
  }
  bool slotOk(int32_t slot) const { return slot >= 0 && slot < mBatch; }
  bool logicalOk(int32_t logical) const { return logical >= 0 && logical < mWidth; }

  bool canSetEntry(int32_t slot, int32_t logical, int32_t page) const {
    if (!slotOk(slot) || !logicalOk(logical) || page < 0 || page >= mPages) {
      return false;
    }
    if (mMode == Mode::kDense) {
      return logical <= live(slot);
    }
    for (int32_t l = 0; l < mWidth; ++l) {
      if (l != logical && k(slot, l) == page) {
        return false;
      }
    }
    return true;
  }
  bool canClearEntry(int32_t slot, int32_t logical) const {
    if (!slotOk(slot) || !logicalOk(logical)) {
      return false;
    }
    return k(slot, logical) == kNoPage || mMode == Mode::kSparseWindow || logical == live(slot) - 1;
  }
  bool canSetRow(int32_t slot, std::vector<int32_t> const& pages) const {
    if (!slotOk(slot) || pages.size() > static_cast<std::size_t>(mWidth)) {
      return false;
    }
    std::set<int32_t> seen;
    for (int32_t page : pages) {
      if (page == kNoPage) {
        if (mMode == Mode::kDense) {
          return false;
        }
        continue;
      }
      if (page < 0 || page >= mPages) {
        return false;
      }
      if (mMode == Mode::kSparseWindow && !seen.insert(page).second) {
        return false;
      }
    }
    return true;
  }

  void write(int32_t slot, int32_t logical, int32_t page) {
    int32_t& value = mK[index(slot, logical)];
    if (value != page) {
      value = page;
      mDirty.insert(int64_t{slot} * 2 * mWidth + logical);
    }
  }
  void setRow(int32_t slot, std::vector<int32_t> const& pages) {
    for (int32_t l = 0; l < mWidth; ++l) {
      auto const i = static_cast<std::size_t>(l);
      write(slot, l, i < pages.size() ? pages[i] : kNoPage);
    }
  }

  std::vector<int32_t> entries() const {
    std::vector<int32_t> out;
    for (int32_t slot = 0; slot < mBatch; ++slot) {
      std::vector<int32_t> kIds(mK.begin() + slot * mWidth, mK.begin() + (slot + 1) * mWidth);
      std::vector<int32_t> const row = rowOf(kIds, mWidth, mPages);
      out.insert(out.end(), row.begin(), row.end());
    }
    return out;
  }
  bool dirty() const { return !mDirty.empty(); }
  /// Expected stats of the next upload (rows) or uploadDirty (entries); clears the dirty set.
  PageTableUploadStats upload(bool rowGranular) {
    PageTableUploadStats stats;
    int64_t previous = -2;
    std::set<int64_t> rows;
    for (int64_t flat : mDirty) {
      rows.insert(flat / (2 * mWidth));
      if (!rowGranular) {
        stats.entries += 2;
        stats.ranges += flat == previous + 1 ? 0 : 2;
        previous = flat;
      }
    }
    if (rowGranular) {
      int64_t previousRow = -2;
      for (int64_t r : rows) {
        stats.entries += 2 * mWidth;
        stats.ranges += r == previousRow + 1 ? 0 : 1;
        previousRow = r;
      }
    }
    mDirty.clear();
    return stats;
  }

  int32_t batch() const { return mBatch; }
  int32_t width() const { return mWidth; }
  int32_t pages() const { return mPages; }
  Mode mode() const { return mMode; }

 private:
  std::size_t index(int32_t slot, int32_t logical) const {
    return static_cast<std::size_t>(slot * mWidth + logical);
  }
  int32_t mBatch, mWidth, mPages;
  Mode mMode;
  std::vector<int32_t> mK;
  std::set<int64_t> mDirty;
};

class KVPageTablePropertyTest
    : public ::testing::TestWithParam<std::tuple<DeviceType, PageTableMode>> {
 protected:
  void SetUp() override {
    if (std::get<0>(GetParam()) == DeviceType::kGPU && !cudaDeviceAvailable()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
};

TEST_P(KVPageTablePropertyTest, RandomOperationsMatchAVectorModel) {
  auto const [device, mode] = GetParam();
  constexpr int32_t kBatch = 5, kWidth = 8, kPages = 12;
  KVPageTable table(kBatch, kWidth, kPages, mode, device);
  TableModel model(kBatch, kWidth, kPages, mode);
  std::mt19937_64 rng(mode == Mode::kDense ? 101 : 202);
  auto pick = [&](int32_t lo, int32_t hi) {
    return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
  };
  // Mostly valid arguments, sometimes one step outside the valid range.
  auto slotArg = [&] {
    return rng() % 20 == 0 ? pick(0, 1) * (kBatch + 1) - 1 : pick(0, kBatch - 1);
  };
  auto logicalArg = [&](int32_t slot) {
    if (rng() % 20 == 0) {
      return pick(0, 1) * (kWidth + 1) - 1;
    }
    if (mode == Mode::kDense && model.slotOk(slot) && rng() % 2 == 0) {
      return std::min(kWidth - 1, model.live(slot) - pick(0, 1));  // near the end
    }
    return pick(0, kWidth - 1);
  };
  auto pageArg = [&] {
    return rng() % 25 == 0 ? pick(0, 1) * (kPages + 2) - 2 : pick(0, kPages - 1);
  };
  auto rowArg = [&] {
    std::vector<int32_t> pages(static_cast<std::size_t>(kPages));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    pages.resize(static_cast<std::size_t>(pick(0, kWidth + (rng() % 15 == 0 ? 1 : 0))));
    for (int32_t& page : pages) {
      if (mode == Mode::kSparseWindow ? rng() % 3 == 0 : rng() % 30 == 0) {
        page = kNoPage;
      }
    }
    if (!pages.empty() && rng() % 10 == 0) {
      pages.back() = pages.front();  // duplicate (or a -1 copy)
    }
    if (!pages.empty() && rng() % 25 == 0) {
      pages.front() = kPages;  // out of range
    }
    return pages;
  };

  int validOps = 0, rejectedOps = 0, uploads = 0;
  for (int op = 0; op < 4000; ++op) {
    HostState const before = hostState(table);
    std::string what;
    bool valid = true;
    bool threw = false;
    auto attempt = [&](auto&& call) {
      try {
        call();
      } catch (Error const&) {
        threw = true;
      }
    };
    int const kind = static_cast<int>(rng() % 100);
    if (kind < 35) {
      int32_t const slot = slotArg(), logical = logicalArg(slot), page = pageArg();
      what = fmt::format("setEntry({}, {}, {})", slot, logical, page);
      valid = model.canSetEntry(slot, logical, page);
      attempt([&] { table.setEntry(slot, logical, page); });
      if (valid && !threw) {
        model.write(slot, logical, page);
      }
    } else if (kind < 60) {
      int32_t const slot = slotArg(), logical = logicalArg(slot);
      what = fmt::format("clearEntry({}, {})", slot, logical);
      valid = model.canClearEntry(slot, logical);
      attempt([&] { table.clearEntry(slot, logical); });
      if (valid && !threw) {
        model.write(slot, logical, kNoPage);
      }
    } else if (kind < 75) {
      int32_t const slot = slotArg();
      std::vector<int32_t> const pages = rowArg();
      what = fmt::format("setRow({}, [{}])", slot, fmt::join(pages, ", "));
      valid = model.canSetRow(slot, pages);
      attempt([&] { table.setRow(slot, pages); });
      if (valid && !threw) {
        model.setRow(slot, pages);
      }
    } else if (kind < 85) {
      std::vector<std::vector<int32_t>> rows;
      std::vector<KVPageTable::RowUpdate> updates;
      std::set<int32_t> slots;
      int const count = pick(0, 3);
      for (int i = 0; i < count; ++i) {
        rows.push_back(rowArg());
      }
      for (int i = 0; i < count; ++i) {
        int32_t const slot = slotArg();
        valid = valid && model.canSetRow(slot, rows[static_cast<std::size_t>(i)]) &&
                slots.insert(slot).second;
        updates.push_back({slot, rows[static_cast<std::size_t>(i)]});
        what += fmt::format("{}:[{}] ", slot, fmt::join(rows[static_cast<std::size_t>(i)], ","));
      }
      what = "setRows(" + what + ")";
      attempt([&] { table.setRows(updates); });
      if (valid && !threw) {
        for (KVPageTable::RowUpdate const& update : updates) {
          model.setRow(update.slot, {update.kPages.begin(), update.kPages.end()});
        }
      }
    } else if (kind < 90) {
      int32_t const slot = slotArg();
      what = fmt::format("clearRow({})", slot);
      valid = model.slotOk(slot);
      attempt([&] { table.clearRow(slot); });
      if (valid && !threw) {
        model.setRow(slot, {});
      }
    } else {
      bool const rowGranular = rng() % 2 == 0;
      what = rowGranular ? "upload" : "uploadDirty";
      bool const expectUpload = model.dirty();
      PageTableUploadStats const expected = model.upload(rowGranular);
      bool uploaded = false;
      attempt([&] { uploaded = rowGranular ? table.upload(nullptr) : table.uploadDirty(nullptr); });
      ASSERT_FALSE(threw) << "op " << op << " " << what;
      ASSERT_EQ(uploaded, expectUpload) << "op " << op << " " << what;
      ASSERT_EQ(table.lastUploadStats().entries, expected.entries) << "op " << op << " " << what;
      ASSERT_EQ(table.lastUploadStats().ranges, expected.ranges) << "op " << op << " " << what;
      ASSERT_EQ(mirror(table), model.entries()) << "op " << op << " " << what;
      ++uploads;
    }
    ASSERT_EQ(threw, !valid) << "op " << op << " " << what;
    if (threw) {
      ++rejectedOps;
      ASSERT_EQ(hostState(table), before) << "op " << op << " " << what << " changed the table";
    } else {
      ++validOps;
    }
    ASSERT_EQ(hostEntries(table), model.entries()) << "op " << op << " " << what;
    ASSERT_EQ(table.dirty(), model.dirty()) << "op " << op << " " << what;
    for (CacheSlot slot = 0; slot < kBatch; ++slot) {
      ASSERT_EQ(table.liveEntryCount(slot), model.live(slot));
    }
    std::string error;
    ASSERT_TRUE(table.checkInvariants(&error)) << "op " << op << " " << what << ": " << error;
  }
  // The generator must exercise both outcomes substantially.
  EXPECT_GT(validOps, 2000);
  EXPECT_GT(rejectedOps, 200);
  EXPECT_GT(uploads, 300);
}

INSTANTIATE_TEST_SUITE_P(
    DevicesAndModes, KVPageTablePropertyTest,
    ::testing::Combine(test::allDeviceTypes(),
                       ::testing::Values(Mode::kDense, Mode::kSparseWindow)),
    [](::testing::TestParamInfo<std::tuple<DeviceType, PageTableMode>> const& param) {
      return std::string(toString(std::get<0>(param.param))) +
             (std::get<1>(param.param) == Mode::kDense ? "_dense" : "_sparse");
    });

}  // namespace
}  // namespace mkv
