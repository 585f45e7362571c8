// The KV oracle of the testing kit (docs/integration.md, "Checking your own wiring"): prefix
// digests, the expected bytes of a token row, and KvOracle's write / verify through the device
// mirror of a page table. Every other suite that trusts the oracle to catch a wrong page relies on
// what is pinned here: a wrong byte anywhere in a visible position is reported at that position,
// KV of another prefix never passes, and positions outside the verified range are never read.
#include "mkv/testing/kv_oracle.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/device.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv {
using test::tokenRun;
namespace {

using testing::KvOracle;
using testing::OracleReport;
using testing::PrefixDigests;

PrefixDigests digestsOf(std::vector<int32_t> const& tokens, uint64_t seed = 0) {
  PrefixDigests digests(seed);
  digests.extendTokens(tokens);
  return digests;
}

std::vector<uint8_t> expectedRow(uint64_t digest, int32_t layer, int32_t half, std::size_t bytes) {
  std::vector<uint8_t> row(bytes);
  KvOracle::expectedRow(digest, layer, half, row);
  return row;
}

// ---------------------------------------------------------------- PrefixDigests

TEST(PrefixDigestsTest, EqualPrefixesUnderEqualSeedsGiveEqualDigests) {
  auto const tokens = tokenRun(50, 7);
  PrefixDigests const whole = digestsOf(tokens, 3);
  PrefixDigests pieces(3);
  pieces.extendTokens(std::span<int32_t const>(tokens).first(20));
  pieces.extendTokens(std::span<int32_t const>(tokens).subspan(20));
  ASSERT_EQ(whole.size(), 50);
  EXPECT_TRUE(std::equal(whole.values().begin(), whole.values().end(), pieces.values().begin(),
                         pieces.values().end()));
  // Token ids are the position keys, as unsigned 32-bit values.
  PrefixDigests keyed(3);
  std::vector<uint64_t> keys(tokens.begin(), tokens.end());
  keyed.extend(keys);
  EXPECT_TRUE(std::equal(whole.values().begin(), whole.values().end(), keyed.values().begin(),
                         keyed.values().end()));
  // Every position of one chain has its own digest.
  std::set<uint64_t> const distinct(whole.values().begin(), whole.values().end());
  EXPECT_EQ(distinct.size(), 50u);
}

TEST(PrefixDigestsTest, AnEarlierDifferenceChangesEveryLaterDigestAndNoEarlierOne) {
  auto const tokens = tokenRun(40, 100);
  PrefixDigests const base = digestsOf(tokens);
  for (int32_t changed : {0, 17, 39}) {
    auto other = tokens;
    other[static_cast<std::size_t>(changed)] += 1;
    PrefixDigests const variant = digestsOf(other);
    for (int64_t p = 0; p < base.size(); ++p) {
      if (p < changed) {
        EXPECT_EQ(variant.at(p), base.at(p)) << "changed " << changed << ", position " << p;
      } else {
        EXPECT_NE(variant.at(p), base.at(p)) << "changed " << changed << ", position " << p;
      }
    }
  }
  // The seed (cache salt, LoRA) is part of every digest.
  PrefixDigests const salted = digestsOf(tokens, 1);
  for (int64_t p = 0; p < base.size(); ++p) {
    EXPECT_NE(salted.at(p), base.at(p)) << "position " << p;
  }
}

TEST(PrefixDigestsTest, TruncateThenExtendReproducesTheChain) {
  auto const tokens = tokenRun(30, 1);
  PrefixDigests const base = digestsOf(tokens);
  PrefixDigests digests = digestsOf(tokens);
  digests.truncate(12);
  ASSERT_EQ(digests.size(), 12);
  digests.extendTokens(std::span<int32_t const>(tokens).subspan(12));
  EXPECT_TRUE(std::equal(base.values().begin(), base.values().end(), digests.values().begin(),
                         digests.values().end()));
  digests.truncate(100);  // longer than the chain: nothing changes
  EXPECT_EQ(digests.size(), 30);
}

// ---------------------------------------------------------------- expected bytes

// A token row is [numKVHeads, headDim] fp16 here: 2 heads x 4 dims x 2 bytes.
constexpr int32_t kHeads = 2;
constexpr int32_t kHeadDim = 4;
constexpr std::size_t kElementBytes = 2;
constexpr std::size_t kTokenBytes = kHeads * kHeadDim * kElementBytes;

TEST(KvOracleExpectedRowTest, BytesDifferByLayerHalfHeadDimAndPrefix) {
  PrefixDigests const digests = digestsOf(tokenRun(64, 5));
  std::set<std::vector<uint8_t>> rows;
  for (int64_t p = 0; p < digests.size(); ++p) {
    for (int32_t layer = 0; layer < 3; ++layer) {
      for (int32_t half = 0; half < 2; ++half) {
        auto const row = expectedRow(digests.at(p), layer, half, kTokenBytes);
        // Deterministic: the same key gives the same bytes.
        EXPECT_EQ(row, expectedRow(digests.at(p), layer, half, kTokenBytes));
        rows.insert(row);
        // Heads differ, and within a head the dims do not repeat one value.
        std::size_t const headBytes = kHeadDim * kElementBytes;
        EXPECT_FALSE(std::equal(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(headBytes),
                                row.begin() + static_cast<std::ptrdiff_t>(headBytes)))
            << "position " << p << " layer " << layer << " half " << half;
        for (int32_t head = 0; head < kHeads; ++head) {
          std::set<uint16_t> values;
          for (int32_t dim = 0; dim < kHeadDim; ++dim) {
            uint16_t value = 0;
            auto const element = static_cast<std::size_t>(head * kHeadDim + dim);
            std::memcpy(&value, row.data() + element * kElementBytes, kElementBytes);
            values.insert(value);
          }
          EXPECT_GT(values.size(), 1u)
              << "position " << p << " layer " << layer << " half " << half << " head " << head;
        }
      }
    }
  }
  // Every (prefix, layer, half) has its own row: 64 positions x 3 layers x K/V.
  EXPECT_EQ(rows.size(), 64u * 3u * 2u);
}

TEST(KvOracleExpectedRowTest, ARowIsAPrefixOfALongerRow) {
  // The stream depends only on (digest, layer, half): a wider head layout extends it.
  auto const shortRow = expectedRow(42, 1, 1, 10);
  auto const longRow = expectedRow(42, 1, 1, 64);
  EXPECT_TRUE(std::equal(shortRow.begin(), shortRow.end(), longRow.begin()));
}

// ---------------------------------------------------------------- KvOracle through a table

constexpr int32_t kPageSize = 16;
constexpr int32_t kNumPages = 8;
constexpr int32_t kLayers = 2;
constexpr int32_t kMaxBatch = 2;
constexpr int32_t kMaxPagesPerSeq = 6;

class KvOracleTest : public test::DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (IsSkipped()) {
      return;
    }
    KVCachePoolConfig config;
    config.numLayers = kLayers;
    config.numKVHeads = kHeads;
    config.headDim = kHeadDim;
    config.tokensPerPage = kPageSize;
    config.numPages = kNumPages;
    config.maxBatchSize = kMaxBatch;
    config.dataType = DataType::kFloat16;
    config.deviceType = device();
    mPool = std::make_unique<KVCachePool>(config);
    ASSERT_EQ(mPool->tokenBytes(), static_cast<int64_t>(kTokenBytes));
    mTable = std::make_unique<KVPageTable>(kMaxBatch, kMaxPagesPerSeq, kNumPages,
                                           PageTableMode::kSparseWindow, device());
    mOracle = std::make_unique<KvOracle>(*mPool, *mTable);
  }

  /// Sets a row (-1 = empty entry) and uploads it to the device mirror the oracle reads.
  void mapRow(CacheSlot slot, std::vector<PageId> const& pages) {
    mTable->setRow(slot, pages);
    mTable->upload(nullptr);
    test::synchronize(device());
  }

  std::size_t offset(int32_t half, PageId page, int32_t row) const {
    auto const pageBytes = static_cast<std::size_t>(mPool->pageBytes());
    return static_cast<std::size_t>(half) * pageBytes * kNumPages +
           static_cast<std::size_t>(page) * pageBytes + static_cast<std::size_t>(row) * kTokenBytes;
  }

  std::vector<uint8_t> readToken(int32_t layer, int32_t half, PageId page, int32_t row) const {
    std::vector<uint8_t> bytes(kTokenBytes);
    auto const* base = static_cast<uint8_t const*>(mPool->layer(layer).rawPointer());
    detail::copyBytes(bytes.data(), DeviceType::kCPU, base + offset(half, page, row), device(),
                      kTokenBytes, nullptr);
    test::synchronize(device());
    return bytes;
  }

  void writeToken(int32_t layer, int32_t half, PageId page, int32_t row,
                  std::vector<uint8_t> const& bytes) {
    auto* base = static_cast<uint8_t*>(mPool->layer(layer).rawPointer());
    detail::copyBytes(base + offset(half, page, row), device(), bytes.data(), DeviceType::kCPU,
                      bytes.size(), nullptr);
    test::synchronize(device());
  }

  /// Flips bits of one byte of one token row; flipping again restores it.
  void flip(int32_t layer, int32_t half, PageId page, int32_t row, std::size_t byte, uint8_t mask) {
    auto bytes = readToken(layer, half, page, row);
    bytes[byte] ^= mask;
    writeToken(layer, half, page, row, bytes);
  }

  std::unique_ptr<KVCachePool> mPool;
  std::unique_ptr<KVPageTable> mTable;
  std::unique_ptr<KvOracle> mOracle;
};

TEST_P(KvOracleTest, WriteLaysOutEachPositionAtItsPageRowLayerAndHalf) {
  std::vector<PageId> const pages = {5, 2, 7};
  mapRow(0, pages);
  PrefixDigests const digests = digestsOf(tokenRun(40, 11));
  mOracle->write(0, digests, 0, 40);
  std::vector<bool> written(static_cast<std::size_t>(kNumPages * kPageSize), false);
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    auto const bytes = test::readBytes(mPool->layer(layer));
    ASSERT_EQ(bytes.size(), std::size_t{2 * kNumPages * kPageSize} * kTokenBytes);
    for (int32_t p = 0; p < 40; ++p) {
      PageId const page = pages[static_cast<std::size_t>(p / kPageSize)];
      written[static_cast<std::size_t>(page * kPageSize + p % kPageSize)] = true;
      for (int32_t half = 0; half < 2; ++half) {
        auto const expected = expectedRow(digests.at(p), layer, half, kTokenBytes);
        auto const* at = bytes.data() + offset(half, page, p % kPageSize);
        EXPECT_TRUE(std::equal(expected.begin(), expected.end(), at))
            << "position " << p << " layer " << layer << " half " << half;
      }
    }
    // Nothing else was touched: the pool starts zeroed and every other row still is.
    for (PageId page = 0; page < kNumPages; ++page) {
      for (int32_t row = 0; row < kPageSize; ++row) {
        if (written[static_cast<std::size_t>(page * kPageSize + row)]) {
          continue;
        }
        for (int32_t half = 0; half < 2; ++half) {
          auto const* at = bytes.data() + offset(half, page, row);
          EXPECT_TRUE(std::all_of(at, at + kTokenBytes, [](uint8_t b) { return b == 0; }))
              << "layer " << layer << " half " << half << " page " << page << " row " << row;
        }
      }
    }
  }
}

TEST_P(KvOracleTest, VerifyPassesOnCorrectData) {
  mapRow(0, {3, 0, 6});
  mapRow(1, {1, 4});
  PrefixDigests const first = digestsOf(tokenRun(48, 1));
  PrefixDigests const second = digestsOf(tokenRun(20, 900), 5);
  mOracle->write(0, first, 0, 48);
  mOracle->write(1, second, 0, 20);
  OracleReport const report = mOracle->verify(0, first, 0, 48);
  EXPECT_TRUE(report.ok()) << report.firstMismatch;
  EXPECT_EQ(report.positionsChecked, 48);
  EXPECT_EQ(report.mismatches, 0);
  EXPECT_TRUE(report.firstMismatch.empty());
  OracleReport const other = mOracle->verify(1, second, 0, 20);
  EXPECT_TRUE(other.ok()) << other.firstMismatch;
  EXPECT_EQ(other.positionsChecked, 20);
  OracleReport const middle = mOracle->verify(0, first, 13, 35);
  EXPECT_TRUE(middle.ok()) << middle.firstMismatch;
  EXPECT_EQ(middle.positionsChecked, 22);
  OracleReport const empty = mOracle->verify(0, first, 30, 30);
  EXPECT_TRUE(empty.ok());
  EXPECT_EQ(empty.positionsChecked, 0);
  // Another sequence's digests do not pass on this row.
  OracleReport const wrong = mOracle->verify(1, first, 0, 20);
  EXPECT_EQ(wrong.mismatches, 20);
}

TEST_P(KvOracleTest, AFlippedByteAnywhereIsReportedAtItsPosition) {
  std::vector<PageId> const pages = {6, 1, 3};
  mapRow(0, pages);
  int32_t const length = 2 * kPageSize + 9;
  PrefixDigests const digests = digestsOf(tokenRun(length, 300));
  mOracle->write(0, digests, 0, length);
  std::mt19937_64 random(7);
  int64_t cases = 0;
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    for (int32_t half = 0; half < 2; ++half) {
      for (int32_t p = 0; p < length; ++p) {
        // Every position, a random byte and bit; the first and last byte of a row included.
        std::size_t byte = random() % kTokenBytes;
        if (p == 0 || p == length - 1) {
          byte = p == 0 ? 0 : kTokenBytes - 1;
        }
        auto const mask = static_cast<uint8_t>(1u << (random() % 8));
        PageId const page = pages[static_cast<std::size_t>(p / kPageSize)];
        int32_t const row = p % kPageSize;
        flip(layer, half, page, row, byte, mask);
        OracleReport const report = mOracle->verify(0, digests, 0, length);
        EXPECT_EQ(report.positionsChecked, length);
        EXPECT_EQ(report.mismatches, 1) << "position " << p << " layer " << layer;
        std::string const where =
            fmt::format("slot 0 position {} (page {}, row {}) layer {} {}: byte {} ", p, page, row,
                        layer, half == 0 ? "K" : "V", byte);
        EXPECT_NE(report.firstMismatch.find(where), std::string::npos)
            << "report '" << report.firstMismatch << "' lacks '" << where << "'";
        flip(layer, half, page, row, byte, mask);
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, kLayers * 2 * length);
  EXPECT_TRUE(mOracle->verify(0, digests, 0, length).ok());
  // Two wrong positions: both counted, the first one described.
  flip(1, 1, pages[2], 3, 5, 0x80);
  flip(0, 0, pages[1], 4, 0, 0x01);
  OracleReport const two = mOracle->verify(0, digests, 0, length);
  EXPECT_EQ(two.mismatches, 2);
  EXPECT_NE(two.firstMismatch.find(fmt::format("position {} ", kPageSize + 4)), std::string::npos)
      << two.firstMismatch;
}

TEST_P(KvOracleTest, APageRecycledToAnotherPrefixIsDetected) {
  auto const tokens = tokenRun(3 * kPageSize, 40);
  PrefixDigests const owner = digestsOf(tokens);
  // Other prefixes whose KV could land in the recycled page: one differing token at position 0
  // only (the page's own positions carry the same tokens), and the same tokens under another seed.
  auto changedFirst = tokens;
  changedFirst[0] = 7;
  PrefixDigests const others[] = {digestsOf(changedFirst), digestsOf(tokens, 99)};
  for (PrefixDigests const& other : others) {
    mapRow(0, {0, 1, 2});
    mOracle->write(0, owner, 0, 3 * kPageSize);
    ASSERT_TRUE(mOracle->verify(0, owner, 0, 3 * kPageSize).ok());
    // Page 1 goes to slot 1 at the same logical page while slot 0 still maps it.
    mapRow(1, {3, 1});
    mOracle->write(1, other, 0, 2 * kPageSize);
    EXPECT_TRUE(mOracle->verify(1, other, 0, 2 * kPageSize).ok());
    OracleReport const report = mOracle->verify(0, owner, 0, 3 * kPageSize);
    EXPECT_EQ(report.positionsChecked, 3 * kPageSize);
    EXPECT_EQ(report.mismatches, kPageSize);
    EXPECT_NE(
        report.firstMismatch.find(fmt::format("position {} (page 1, row 0) layer 0 K", kPageSize)),
        std::string::npos)
        << report.firstMismatch;
    mTable->clearRow(1);
  }
  // Control: a page shared by an identical prefix (context reuse) holds the right KV.
  mapRow(0, {0, 1, 2});
  mOracle->write(0, owner, 0, 3 * kPageSize);
  mapRow(1, {3, 1});
  mOracle->write(1, owner, 0, 2 * kPageSize);
  EXPECT_TRUE(mOracle->verify(0, owner, 0, 3 * kPageSize).ok());
}

TEST_P(KvOracleTest, PositionsOutsideTheVisibleRangeAreNotRead) {
  // A sliding window: logical pages 2..4 mapped (positions 32..79), the rest empty; the visible
  // range [40, 70) starts and ends inside mapped pages.
  mapRow(0, {kNoPage, kNoPage, 4, 6, 1});
  int32_t const begin = 40;
  int32_t const end = 70;
  PrefixDigests const digests = digestsOf(tokenRun(end + 20, 1000));
  mOracle->write(0, digests, begin, end);
  // Garbage in every row of the mapped pages outside [begin, end), every layer and half.
  std::vector<uint8_t> const garbage(kTokenBytes, 0xA5);
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    for (int32_t half = 0; half < 2; ++half) {
      for (int32_t p = 2 * kPageSize; p < begin; ++p) {
        writeToken(layer, half, 4, p % kPageSize, garbage);
      }
      for (int32_t p = end; p < 5 * kPageSize; ++p) {
        writeToken(layer, half, 1, p % kPageSize, garbage);
      }
    }
  }
  OracleReport const visible = mOracle->verify(0, digests, begin, end);
  EXPECT_TRUE(visible.ok()) << visible.firstMismatch;
  EXPECT_EQ(visible.positionsChecked, end - begin);
  // One position more on either side is read, and is wrong.
  OracleReport const before = mOracle->verify(0, digests, begin - 1, end);
  EXPECT_EQ(before.mismatches, 1);
  EXPECT_NE(before.firstMismatch.find(fmt::format("position {} ", begin - 1)), std::string::npos)
      << before.firstMismatch;
  EXPECT_EQ(mOracle->verify(0, digests, begin, end + 1).mismatches, 1);
  // Positions of empty entries are mismatches when asked for, never read as page -1.
  OracleReport const all = mOracle->verify(0, digests, 0, end);
  EXPECT_EQ(all.mismatches, begin);  // 32 unmapped + 8 garbage
  EXPECT_NE(all.firstMismatch.find("slot 0 position 0: no page mapped"), std::string::npos)
      << all.firstMismatch;
  // Past the table width there is no entry at all.
  PrefixDigests const longer = digestsOf(tokenRun(kMaxPagesPerSeq * kPageSize + 1, 1));
  EXPECT_EQ(mOracle->verify(0, longer, kMaxPagesPerSeq * kPageSize, kMaxPagesPerSeq * kPageSize + 1)
                .mismatches,
            1);
}

TEST_P(KvOracleTest, TheDeviceMirrorIsWhatIsResolved) {
  PrefixDigests const digests = digestsOf(tokenRun(2 * kPageSize, 3));
  mTable->setRow(1, std::vector<PageId>{2, 5});  // host row only: no upload
  EXPECT_TRUE(test::throwsError([&] { mOracle->write(1, digests, 0, 1); },
                                {"KvOracle::write", "position 0 of slot 1 maps to no page"}));
  OracleReport const missing = mOracle->verify(1, digests, 0, 2 * kPageSize);
  EXPECT_EQ(missing.mismatches, 2 * kPageSize);
  EXPECT_NE(missing.firstMismatch.find("no page mapped"), std::string::npos);
  mTable->upload(nullptr);
  test::synchronize(device());
  mOracle->write(1, digests, 0, 2 * kPageSize);
  EXPECT_TRUE(mOracle->verify(1, digests, 0, 2 * kPageSize).ok());
}

TEST_P(KvOracleTest, RejectsRangesBeyondTheDigestsAndMismatchedResources) {
  mapRow(0, {0});
  PrefixDigests const digests = digestsOf(tokenRun(10, 1));
  EXPECT_TRUE(test::throwsError([&] { mOracle->write(0, digests, 0, 11); },
                                {"KvOracle::write", "[0, 11)", "10 known positions"}));
  EXPECT_TRUE(test::throwsError([&] { (void)mOracle->verify(0, digests, 5, 4); },
                                {"KvOracle::verify", "[5, 4)"}));
  EXPECT_TRUE(test::throwsError([&] { (void)mOracle->verify(kMaxBatch, digests, 0, 1); },
                                {"KvOracle", "slot 2 outside [0, 2)"}));
  KVPageTable other(kMaxBatch, kMaxPagesPerSeq, kNumPages + 1, PageTableMode::kDense, device());
  EXPECT_TRUE(test::throwsError([&] { KvOracle oracle(*mPool, other); },
                                {"KvOracle", "pool has 8 pages but the page table addresses 9"}));
}

INSTANTIATE_TEST_SUITE_P(Devices, KvOracleTest, test::allDeviceTypes(), test::deviceName);

// ---------------------------------------------------------------- RecurrentOracle

using testing::RecurrentOracle;

class RecurrentOracleTest : public test::DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (IsSkipped()) {
      return;
    }
    RecurrentStatePoolConfig config;
    config.numLayers = 2;
    config.numSlots = 3;
    config.stateBytesPerSlot = 20;
    config.convBytesPerSlot = 6;
    config.deviceType = device();
    mPool = std::make_unique<RecurrentStatePool>(config);
    mOracle = std::make_unique<RecurrentOracle>(*mPool);
  }

  std::unique_ptr<RecurrentStatePool> mPool;
  std::unique_ptr<RecurrentOracle> mOracle;
};

TEST_P(RecurrentOracleTest, TheStateIsAFunctionOfTheWholePrefixAndZeroBeforeAnyToken) {
  PrefixDigests const digests = digestsOf(tokenRun(30, 5));
  EXPECT_TRUE(mOracle->verify(1, digests, 0).ok()) << "a fresh pool holds the empty state";
  mOracle->write(1, digests, 17);
  OracleReport const report = mOracle->verify(1, digests, 17);
  EXPECT_TRUE(report.ok()) << report.firstMismatch;
  EXPECT_EQ(report.positionsChecked, 1);
  EXPECT_FALSE(mOracle->verify(1, digests, 16).ok()) << "one token short";
  EXPECT_FALSE(mOracle->verify(1, digests, 0).ok());
  std::vector<int32_t> branch = tokenRun(16, 5);
  branch.push_back(999);
  PrefixDigests const other = digestsOf(branch);
  EXPECT_FALSE(mOracle->verify(1, other, 17).ok()) << "another last token";
  EXPECT_TRUE(mOracle->verify(0, digests, 0).ok()) << "other rows are untouched";
  EXPECT_TRUE(mOracle->verify(2, digests, 0).ok());
  // The row's bytes are exactly the expected streams of each layer and kind.
  for (int32_t layer = 0; layer < 2; ++layer) {
    for (bool conv : {false, true}) {
      Tensor const& rows = conv ? mPool->conv(layer) : mPool->state(layer);
      std::vector<uint8_t> const bytes = test::readBytes(rows);
      auto const width = static_cast<std::size_t>(rows.dim(1));
      std::vector<uint8_t> expected(width);
      RecurrentOracle::expectedRow(digests.at(16), layer, conv, expected);
      EXPECT_TRUE(std::equal(expected.begin(), expected.end(), bytes.data() + width))
          << "layer " << layer << (conv ? " conv" : " state");
    }
  }
  mOracle->write(1, digests, 0);
  EXPECT_TRUE(mOracle->verify(1, digests, 0).ok()) << "length 0 writes the empty state";
}

TEST_P(RecurrentOracleTest, AFlippedByteInAnyLayerOrKindIsReported) {
  PrefixDigests const digests = digestsOf(tokenRun(9, 40));
  for (int32_t layer = 0; layer < 2; ++layer) {
    for (bool conv : {false, true}) {
      mOracle->write(2, digests, 9);
      Tensor& rows = conv ? mPool->conv(layer) : mPool->state(layer);
      std::vector<uint8_t> bytes = test::readBytes(rows);
      bytes[2 * static_cast<std::size_t>(rows.dim(1)) + 3] ^= 0x10;
      test::writeBytes(rows, bytes);
      OracleReport const report = mOracle->verify(2, digests, 9);
      EXPECT_EQ(report.mismatches, 1);
      EXPECT_NE(report.firstMismatch.find(
                    fmt::format("layer {} {} row: byte 3", layer, conv ? "conv" : "state")),
                std::string::npos)
          << report.firstMismatch;
    }
  }
  EXPECT_TRUE(test::throwsError([&] { mOracle->write(3, digests, 1); },
                                {"RecurrentOracle::write", "slot 3 outside [0, 3)"}));
  EXPECT_TRUE(test::throwsError([&] { (void)mOracle->verify(0, digests, 10); },
                                {"RecurrentOracle::verify", "length 10", "9 known positions"}));
}

INSTANTIATE_TEST_SUITE_P(Devices, RecurrentOracleTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv
