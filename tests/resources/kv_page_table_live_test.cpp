/// KVPageTable::entriesLive, which AttentionViews::validate asks for every row of a step: the
/// O(1) answer from a row's live range and the answer by reading the entries agree, with and
/// without holes, on every range of the row.

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "mkv/error.h"
#include "mkv/kv_page_table.h"

namespace mkv {
namespace {

constexpr int32_t kBatch = 4;
constexpr int32_t kWidth = 6;
constexpr int32_t kPages = 32;

/// Whether entries [first, last) of `slot` are live, read one by one.
bool liveByEntries(KVPageTable const& table, CacheSlot slot, int32_t first, int32_t last) {
  for (int32_t page = first; page < last; ++page) {
    if (table.entry(slot, page) == kNoPage) {
      return false;
    }
  }
  return true;
}

void expectEveryRange(KVPageTable const& table, CacheSlot slot, std::string const& row) {
  for (int32_t first = 0; first <= kWidth; ++first) {
    for (int32_t last = first; last <= kWidth; ++last) {
      EXPECT_EQ(table.entriesLive(slot, first, last), liveByEntries(table, slot, first, last))
          << row << ": [" << first << ", " << last << ")";
    }
  }
}

TEST(KVPageTableEntriesLiveTest, AgreesWithTheEntriesWithAndWithoutHoles) {
  KVPageTable window(kBatch, kWidth, kPages, PageTableMode::kSparseWindow, DeviceType::kCPU);
  expectEveryRange(window, 3, "empty");
  window.setEntry(3, 1, 20);
  window.setEntry(3, 2, 21);
  window.setEntry(3, 3, 22);
  expectEveryRange(window, 3, "[1, 4) live");
  window.clearEntry(3, 2);
  expectEveryRange(window, 3, "a hole at 2");
  window.clearEntry(3, 1);
  expectEveryRange(window, 3, "only 3 live");
  window.setEntry(3, 5, 23);
  expectEveryRange(window, 3, "3 and 5 live");

  KVPageTable dense(kBatch, kWidth, kPages, PageTableMode::kDense, DeviceType::kCPU);
  dense.setRow(0, std::vector<PageId>{4, 5, 6});
  expectEveryRange(dense, 0, "dense [0, 3)");
  EXPECT_TRUE(dense.entriesLive(0, 0, 3));
  EXPECT_FALSE(dense.entriesLive(0, 0, 4));
  EXPECT_TRUE(dense.entriesLive(1, 2, 2));  // an empty range of an empty row
}

TEST(KVPageTableEntriesLiveTest, RangesOutsideTheTableAreRefusedByName) {
  KVPageTable dense(kBatch, kWidth, kPages, PageTableMode::kDense, DeviceType::kCPU);
  for (auto const& [slot, first, last] : std::vector<std::tuple<CacheSlot, int32_t, int32_t>>{
           {0, 2, 1}, {0, 0, kWidth + 1}, {0, -1, 2}, {kBatch, 0, 1}}) {
    try {
      (void)dense.entriesLive(slot, first, last);
      ADD_FAILURE() << "slot " << slot << " [" << first << ", " << last << ") accepted";
    } catch (Error const& error) {
      EXPECT_NE(std::string(error.what()).find("KVPageTable::entriesLive"), std::string::npos)
          << error.what();
    }
  }
}

}  // namespace
}  // namespace mkv
