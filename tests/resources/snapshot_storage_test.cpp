#include "mkv/snapshot_storage.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

constexpr int32_t kTokens = 16;           // tokens per page
constexpr int64_t kBaseTokenBytes = 32;   // 2 heads x 8 dims x fp16
constexpr int64_t kDraftTokenBytes = 32;  // 1 head x 16 dims x fp16
constexpr int64_t kStateBytes = 48;
constexpr int64_t kConvBytes = 24;
constexpr int64_t kHiddenWidth = 64;

/// Byte offset of (half, page, token row) inside one layer of a pool or partial slab.
std::size_t offset(int32_t pages, int64_t tokenBytes, int32_t half, int32_t page, int32_t token) {
  return static_cast<std::size_t>(((int64_t{half} * pages + page) * kTokens + token) * tokenBytes);
}

class SnapshotStorageTest : public test::DeviceTest {
 protected:
  void SetUp() override {
    test::DeviceTest::SetUp();
    if (IsSkipped()) {
      return;
    }
    mRecurrent = std::make_unique<RecurrentStatePool>(
        RecurrentStatePoolConfig{2, 4, kStateBytes, kConvBytes, device()});
    mBase = std::make_unique<KVCachePool>(
        KVCachePoolConfig{2, 2, 8, kTokens, 8, 4, DataType::kFloat16, device()});
    mDraft = std::make_unique<KVCachePool>(
        KVCachePoolConfig{1, 1, 16, kTokens, 6, 4, DataType::kFloat16, device()});
  }

  SnapshotStorageConfig config() const {
    return SnapshotStorageConfig{3, 2, kHiddenWidth, DataType::kFloat16};
  }
  SnapshotStorage makeFull() {
    return SnapshotStorage(config(), mRecurrent.get(), mBase.get(), mDraft.get());
  }

  std::unique_ptr<RecurrentStatePool> mRecurrent;
  std::unique_ptr<KVCachePool> mBase;
  std::unique_ptr<KVCachePool> mDraft;
};

TEST_P(SnapshotStorageTest, ReportsExactBytesPerSlot) {
  SnapshotStorage const storage = makeFull();
  EXPECT_EQ(SnapshotStorage::recurrentBytesPerSlot(*mRecurrent), 2 * (48 + 24));
  EXPECT_EQ(SnapshotStorage::partialKvBytesPerSlot(*mBase), 2 * 2 * kTokens * kBaseTokenBytes);
  EXPECT_EQ(SnapshotStorage::partialKvBytesPerSlot(*mBase), 2048);
  EXPECT_EQ(SnapshotStorage::partialKvBytesPerSlot(*mDraft), 1024);
  EXPECT_EQ(SnapshotStorage::boundaryHiddenBytesPerSlot(kHiddenWidth, DataType::kFloat16), 128);
  EXPECT_EQ(SnapshotStorage::boundaryHiddenBytesPerSlot(0, DataType::kFloat16), 0);
  // 3 recurrent slots x 144 + 2 partial slots x (2048 + 1024) + 3 hidden rows x 128.
  EXPECT_EQ(storage.totalBytes(), 3 * 144 + 2 * (2048 + 1024) + 3 * 128);
}

TEST_P(SnapshotStorageTest, SlabsHaveTheirPoolsGeometry) {
  SnapshotStorage const storage = makeFull();
  EXPECT_TRUE(storage.hasDraft());
  EXPECT_TRUE(storage.hasBoundaryHidden());
  EXPECT_EQ(storage.deviceType(), device());
  for (int32_t l = 0; l < 2; ++l) {
    EXPECT_EQ(storage.recurrentStateSlab(l).shape(), (Coords{3, kStateBytes}));
    EXPECT_EQ(storage.recurrentConvSlab(l).shape(), (Coords{3, kConvBytes}));
    EXPECT_EQ(storage.partialKvSlab(l).shape(), (Coords{2, 2, kTokens, 2, 8}));
    EXPECT_EQ(storage.partialKvSlab(l).dataType(), DataType::kFloat16);
  }
  EXPECT_EQ(storage.partialKvSlab(0, /*draft=*/true).shape(), (Coords{2, 2, kTokens, 1, 16}));
  EXPECT_EQ(storage.boundaryHiddenSlab().shape(), (Coords{3, kHiddenWidth}));
  EXPECT_TRUE(throwsError([&] { (void)storage.partialKvSlab(1, true); },
                          {"SnapshotStorage::partialKvSlab", "draft layer 1"}));
  EXPECT_TRUE(throwsError([&] { (void)storage.recurrentStateSlab(2); },
                          {"SnapshotStorage::recurrentStateSlab", "layer 2"}));
}

TEST_P(SnapshotStorageTest, RejectsInconsistentConfigurations) {
  RecurrentStatePool* recurrent = mRecurrent.get();
  KVCachePool* base = mBase.get();
  EXPECT_TRUE(throwsError(
      [&] {
        SnapshotStorage({-1, 0, 0}, recurrent, base);
      },
      {"SnapshotStorage", "recurrentSlots", "-1"}));
  EXPECT_TRUE(throwsError(
      [&] {
        SnapshotStorage({0, -2, 0}, recurrent, base);
      },
      {"partialKvSlots", "-2"}));
  EXPECT_TRUE(throwsError(
      [&] {
        SnapshotStorage({1, 0, -3}, recurrent, base);
      },
      {"boundaryHiddenWidth", "-3"}));
  EXPECT_TRUE(throwsError(
      [&] {
        SnapshotStorage({0, 2, 0}, recurrent, nullptr);
      },
      {"partialKvSlots 2", "without a base KV pool"}));
  EXPECT_TRUE(throwsError(
      [&] {
        SnapshotStorage({0, 0, 0}, recurrent, nullptr, mDraft.get());
      },
      {"draft pool needs a base pool"}));
  EXPECT_TRUE(throwsError(
      [&] {
        SnapshotStorage({0, 0, 8}, recurrent, base);
      },
      {"boundaryHiddenWidth 8", "recurrentSlots > 0"}));
  EXPECT_TRUE(throwsError(
      [&] {
        SnapshotStorage({2, 0, 8}, nullptr, nullptr);
      },
      {"without any pool"}));
}

TEST_P(SnapshotStorageTest, PartialKvRoundTripCopiesOnlyTheValidTokenRows) {
  std::mt19937_64 rng(1);
  SnapshotStorage storage = makeFull();
  std::vector<std::vector<uint8_t>> pool;
  for (int32_t l = 0; l < 2; ++l) {
    pool.push_back(test::fillRandom(mBase->layer(l), rng));
  }
  // Poison the whole slab; after the capture only slot 1's first 5 token rows may differ.
  std::vector<std::vector<uint8_t>> slab;
  for (int32_t l = 0; l < 2; ++l) {
    Tensor view = Tensor::viewOf(storage.partialKvSlab(l));
    slab.push_back(test::fillConstant(view, 0x5A));
  }
  constexpr int32_t kValid = 5;
  storage.capturePartialKv(1, 6, kValid, kNoPage, nullptr);
  for (int32_t l = 0; l < 2; ++l) {
    auto& expected = slab[static_cast<std::size_t>(l)];
    auto const& source = pool[static_cast<std::size_t>(l)];
    for (int32_t half = 0; half < 2; ++half) {
      std::copy_n(source.begin() + static_cast<long>(offset(8, kBaseTokenBytes, half, 6, 0)),
                  kValid * kBaseTokenBytes,
                  expected.begin() + static_cast<long>(offset(2, kBaseTokenBytes, half, 1, 0)));
    }
    EXPECT_EQ(test::readBytes(storage.partialKvSlab(l)), expected) << "layer " << l;
  }
  // Restore into another, poisoned page: only its first 5 rows change.
  for (int32_t l = 0; l < 2; ++l) {
    auto& expected = pool[static_cast<std::size_t>(l)];
    std::fill_n(expected.begin() + static_cast<long>(offset(8, kBaseTokenBytes, 0, 2, 0)),
                kTokens * kBaseTokenBytes, uint8_t{0xC3});
    std::fill_n(expected.begin() + static_cast<long>(offset(8, kBaseTokenBytes, 1, 2, 0)),
                kTokens * kBaseTokenBytes, uint8_t{0xC3});
    test::writeBytes(mBase->layer(l), expected);
  }
  storage.restorePartialKv(1, 2, kValid, kNoPage, nullptr);
  for (int32_t l = 0; l < 2; ++l) {
    auto& expected = pool[static_cast<std::size_t>(l)];
    for (int32_t half = 0; half < 2; ++half) {
      std::copy_n(expected.begin() + static_cast<long>(offset(8, kBaseTokenBytes, half, 6, 0)),
                  kValid * kBaseTokenBytes,
                  expected.begin() + static_cast<long>(offset(8, kBaseTokenBytes, half, 2, 0)));
    }
    std::vector<uint8_t> const now = test::readBytes(mBase->layer(l));
    EXPECT_EQ(now, expected) << "layer " << l;
    EXPECT_EQ(now[offset(8, kBaseTokenBytes, 1, 2, kValid)], 0xC3);  // row 5 untouched
  }
}

TEST_P(SnapshotStorageTest, PairedBaseAndDraftPartialKvRoundTrip) {
  std::mt19937_64 rng(2);
  SnapshotStorage storage = makeFull();
  std::vector<uint8_t> const base0 = test::fillRandom(mBase->layer(0), rng);
  std::vector<uint8_t> const draft0 = test::fillRandom(mDraft->layer(0), rng);
  storage.capturePartialKv(0, 3, kTokens, 5, nullptr);  // a full page, base 3 / draft 5
  test::fillConstant(mBase->layer(0), 0);
  test::fillConstant(mDraft->layer(0), 0);
  storage.restorePartialKv(0, 1, kTokens, 4, nullptr);
  std::vector<uint8_t> const base = test::readBytes(mBase->layer(0));
  std::vector<uint8_t> const draft = test::readBytes(mDraft->layer(0));
  auto const pageBytes = static_cast<std::size_t>(kTokens * kBaseTokenBytes);
  for (int32_t half = 0; half < 2; ++half) {
    EXPECT_TRUE(std::equal(
        base.begin() + static_cast<long>(offset(8, kBaseTokenBytes, half, 1, 0)),
        base.begin() + static_cast<long>(offset(8, kBaseTokenBytes, half, 1, 0) + pageBytes),
        base0.begin() + static_cast<long>(offset(8, kBaseTokenBytes, half, 3, 0))))
        << "base half " << half;
    EXPECT_TRUE(std::equal(
        draft.begin() + static_cast<long>(offset(6, kDraftTokenBytes, half, 4, 0)),
        draft.begin() + static_cast<long>(offset(6, kDraftTokenBytes, half, 4, 0) + pageBytes),
        draft0.begin() + static_cast<long>(offset(6, kDraftTokenBytes, half, 5, 0))))
        << "draft half " << half;
  }
  // Nothing else was written.
  std::size_t const nonZeroBase = static_cast<std::size_t>(
      std::count_if(base.begin(), base.end(), [](uint8_t b) { return b != 0; }));
  EXPECT_LE(nonZeroBase, 2 * 2 * pageBytes);  // page 1 of both halves (of this layer)
}

TEST_P(SnapshotStorageTest, PartialKvRejectsInvalidArgumentsWithoutCopying) {
  std::mt19937_64 rng(3);
  SnapshotStorage storage = makeFull();
  test::fillRandom(mBase->layer(0), rng);
  std::vector<uint8_t> const slab = test::readBytes(storage.partialKvSlab(0));
  std::vector<uint8_t> const draftSlab = test::readBytes(storage.partialKvSlab(0, true));
  EXPECT_TRUE(throwsError([&] { storage.capturePartialKv(2, 0, 4, kNoPage, nullptr); },
                          {"SnapshotStorage::capturePartialKv", "snapshot slot 2", "[0, 2)"}));
  EXPECT_TRUE(throwsError([&] { storage.capturePartialKv(0, 8, 4, kNoPage, nullptr); },
                          {"SnapshotStorage::capturePartialKv", "page 8", "[0, 8)"}));
  EXPECT_TRUE(
      throwsError([&] { storage.capturePartialKv(0, -1, 4, kNoPage, nullptr); }, {"page -1"}));
  EXPECT_TRUE(throwsError([&] { storage.capturePartialKv(0, 1, 0, kNoPage, nullptr); },
                          {"validTokens 0", "[1, 16]"}));
  EXPECT_TRUE(throwsError([&] { storage.restorePartialKv(0, 1, 17, kNoPage, nullptr); },
                          {"SnapshotStorage::restorePartialKv", "validTokens 17"}));
  EXPECT_TRUE(throwsError([&] { storage.capturePartialKv(0, 1, 4, 6, nullptr); },
                          {"draft page 6", "[0, 6)"}));
  EXPECT_TRUE(
      throwsError([&] { storage.capturePartialKv(0, 1, 4, -3, nullptr); }, {"draft page -3"}));
  EXPECT_EQ(test::readBytes(storage.partialKvSlab(0)), slab);
  EXPECT_EQ(test::readBytes(storage.partialKvSlab(0, true)), draftSlab);
}

TEST_P(SnapshotStorageTest, UnconfiguredSlabsThrow) {
  SnapshotStorage attentionOnly({0, 2, 0}, nullptr, mBase.get());
  EXPECT_FALSE(attentionOnly.hasDraft());
  EXPECT_FALSE(attentionOnly.hasBoundaryHidden());
  EXPECT_TRUE(throwsError([&] { attentionOnly.capturePartialKv(0, 1, 4, 2, nullptr); },
                          {"SnapshotStorage::capturePartialKv", "draft page 2", "no draft pool"}));
  EXPECT_TRUE(throwsError([&] { attentionOnly.captureRecurrent(0, 0, nullptr); },
                          {"SnapshotStorage::captureRecurrent", "no recurrent slab"}));
  Tensor hidden({4, kHiddenWidth}, DataType::kFloat16, device());
  EXPECT_TRUE(throwsError([&] { attentionOnly.captureBoundaryHidden(0, hidden, 0, nullptr); },
                          {"SnapshotStorage::captureBoundaryHidden", "boundaryHiddenWidth is 0"}));
  EXPECT_TRUE(throwsError([&] { attentionOnly.restoreBoundaryHidden(0, hidden, 0, nullptr); },
                          {"SnapshotStorage::restoreBoundaryHidden", "no boundary hidden slab"}));
  EXPECT_TRUE(throwsError([&] { (void)attentionOnly.boundaryHiddenSlab(); },
                          {"SnapshotStorage::boundaryHiddenSlab"}));
  SnapshotStorage recurrentOnly({2, 0, 0}, mRecurrent.get(), nullptr);
  EXPECT_TRUE(throwsError([&] { recurrentOnly.capturePartialKv(0, 1, 4, kNoPage, nullptr); },
                          {"SnapshotStorage::capturePartialKv", "no partial-KV slab"}));
  EXPECT_TRUE(throwsError([&] { recurrentOnly.restorePartialKv(0, 1, 4, kNoPage, nullptr); },
                          {"SnapshotStorage::restorePartialKv", "no partial-KV slab"}));
  EXPECT_EQ(recurrentOnly.totalBytes(), 2 * 144);
}

TEST_P(SnapshotStorageTest, RecurrentRoundTripIsByteExactForEveryLayer) {
  std::mt19937_64 rng(4);
  SnapshotStorage storage = makeFull();
  std::vector<std::vector<uint8_t>> pool;
  for (int32_t l = 0; l < 2; ++l) {
    pool.push_back(test::fillRandom(mRecurrent->state(l), rng));
    pool.push_back(test::fillRandom(mRecurrent->conv(l), rng));
  }
  storage.captureRecurrent(2, 3, nullptr);  // slot 2 <- resident 3
  auto rowOf = [](std::vector<uint8_t> const& image, int64_t width, int64_t row) {
    return std::vector<uint8_t>(image.begin() + static_cast<long>(row * width),
                                image.begin() + static_cast<long>((row + 1) * width));
  };
  for (int32_t l = 0; l < 2; ++l) {
    std::vector<uint8_t> const state = test::readBytes(storage.recurrentStateSlab(l));
    std::vector<uint8_t> const conv = test::readBytes(storage.recurrentConvSlab(l));
    EXPECT_EQ(rowOf(state, kStateBytes, 2),
              rowOf(pool[static_cast<std::size_t>(2 * l)], kStateBytes, 3));
    EXPECT_EQ(rowOf(conv, kConvBytes, 2),
              rowOf(pool[static_cast<std::size_t>(2 * l + 1)], kConvBytes, 3));
    EXPECT_EQ(rowOf(state, kStateBytes, 0), std::vector<uint8_t>(kStateBytes, 0));  // untouched
  }
  mRecurrent->clearResidentSlot(3, nullptr);
  storage.restoreRecurrent(2, 0, nullptr);  // resident 0 <- slot 2
  for (int32_t l = 0; l < 2; ++l) {
    std::vector<uint8_t> const state = test::readBytes(mRecurrent->state(l));
    std::vector<uint8_t> const conv = test::readBytes(mRecurrent->conv(l));
    auto const& stateBefore = pool[static_cast<std::size_t>(2 * l)];
    auto const& convBefore = pool[static_cast<std::size_t>(2 * l + 1)];
    EXPECT_EQ(rowOf(state, kStateBytes, 0), rowOf(stateBefore, kStateBytes, 3));
    EXPECT_EQ(rowOf(conv, kConvBytes, 0), rowOf(convBefore, kConvBytes, 3));
    EXPECT_EQ(rowOf(state, kStateBytes, 1), rowOf(stateBefore, kStateBytes, 1));
    EXPECT_EQ(rowOf(state, kStateBytes, 3), std::vector<uint8_t>(kStateBytes, 0));
  }
}

TEST_P(SnapshotStorageTest, RecurrentRejectsSlotsOutOfRangeWithoutCopying) {
  std::mt19937_64 rng(5);
  SnapshotStorage storage = makeFull();
  std::vector<uint8_t> const state = test::fillRandom(mRecurrent->state(0), rng);
  EXPECT_TRUE(throwsError([&] { storage.captureRecurrent(3, 0, nullptr); },
                          {"SnapshotStorage::captureRecurrent", "snapshot slot 3", "[0, 3)"}));
  EXPECT_TRUE(throwsError([&] { storage.captureRecurrent(0, 4, nullptr); },
                          {"SnapshotStorage::captureRecurrent", "resident slot 4", "[0, 4)"}));
  EXPECT_TRUE(throwsError([&] { storage.restoreRecurrent(-1, 0, nullptr); },
                          {"SnapshotStorage::restoreRecurrent", "snapshot slot -1"}));
  EXPECT_TRUE(throwsError([&] { storage.restoreRecurrent(0, -1, nullptr); },
                          {"SnapshotStorage::restoreRecurrent", "resident slot -1"}));
  EXPECT_EQ(test::readBytes(storage.recurrentStateSlab(0)),
            std::vector<uint8_t>(3 * kStateBytes, 0));
  EXPECT_EQ(test::readBytes(mRecurrent->state(0)), state);
}

TEST_P(SnapshotStorageTest, BoundaryHiddenRoundTripIsByteExact) {
  std::mt19937_64 rng(6);
  SnapshotStorage storage = makeFull();
  Tensor hidden({7, kHiddenWidth}, DataType::kFloat16, device());
  std::vector<uint8_t> const tokens = test::fillRandom(hidden, rng);
  int64_t const rowBytes = kHiddenWidth * 2;
  storage.captureBoundaryHidden(1, hidden, 6, nullptr);
  std::vector<uint8_t> const slab = test::readBytes(storage.boundaryHiddenSlab());
  EXPECT_TRUE(std::equal(slab.begin() + rowBytes, slab.begin() + 2 * rowBytes,
                         tokens.begin() + 6 * rowBytes));
  EXPECT_TRUE(std::all_of(slab.begin(), slab.begin() + rowBytes, [](uint8_t b) { return b == 0; }));
  Tensor target({3, kHiddenWidth}, DataType::kFloat16, device());
  std::vector<uint8_t> const poison = test::fillConstant(target, 0x77);
  storage.restoreBoundaryHidden(1, target, 0, nullptr);
  std::vector<uint8_t> const restored = test::readBytes(target);
  EXPECT_TRUE(
      std::equal(restored.begin(), restored.begin() + rowBytes, tokens.begin() + 6 * rowBytes));
  EXPECT_TRUE(std::equal(restored.begin() + rowBytes, restored.end(), poison.begin() + rowBytes));
}

TEST_P(SnapshotStorageTest, BoundaryHiddenRejectsMismatchedInputsWithoutCopying) {
  SnapshotStorage storage = makeFull();
  Tensor hidden({4, kHiddenWidth}, DataType::kFloat16, device());
  Tensor narrow({4, 32}, DataType::kFloat16, device());
  Tensor wrongType({4, kHiddenWidth}, DataType::kBFloat16, device());
  test::fillConstant(hidden, 0x42);
  EXPECT_TRUE(throwsError([&] { storage.captureBoundaryHidden(0, narrow, 0, nullptr); },
                          {"SnapshotStorage::captureBoundaryHidden", "[tokens, 64]", "[4, 32]"}));
  EXPECT_TRUE(throwsError([&] { storage.captureBoundaryHidden(0, wrongType, 0, nullptr); },
                          {"hidden is bfloat16", "float16"}));
  EXPECT_TRUE(throwsError([&] { storage.captureBoundaryHidden(0, hidden, 4, nullptr); },
                          {"row 4 is outside [0, 4)"}));
  EXPECT_TRUE(throwsError([&] { storage.captureBoundaryHidden(3, hidden, 0, nullptr); },
                          {"snapshot slot 3", "[0, 3)"}));
  EXPECT_TRUE(throwsError([&] { storage.restoreBoundaryHidden(0, hidden, -1, nullptr); },
                          {"SnapshotStorage::restoreBoundaryHidden", "row -1"}));
  DeviceType const other = device() == DeviceType::kCPU ? DeviceType::kGPU : DeviceType::kCPU;
  uint16_t fake[kHiddenWidth] = {};
  Tensor const foreign = Tensor::view(fake, {1, kHiddenWidth}, DataType::kFloat16, other);
  EXPECT_TRUE(throwsError([&] { storage.captureBoundaryHidden(0, foreign, 0, nullptr); },
                          {"hidden is on", std::string(toString(other))}));
  EXPECT_EQ(test::readBytes(storage.boundaryHiddenSlab()),
            std::vector<uint8_t>(3 * kHiddenWidth * 2, 0));
}

INSTANTIATE_TEST_SUITE_P(Devices, SnapshotStorageTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv
