#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

/// A `[rows, rowBytes]` uint8 buffer and its expected bytes.
struct Rows {
  Rows(int64_t rows, int64_t rowBytes, DeviceType device, std::mt19937_64& rng)
      : tensor({rows, rowBytes}, DataType::kUInt8, device), width(rowBytes) {
    expected = test::fillRandom(tensor, rng);
  }
  kernels::RowBuffer buffer() { return {tensor.rawPointer(), width, tensor.dim(0)}; }
  Tensor tensor;
  int64_t width;
  std::vector<uint8_t> expected;
};

void modelCopyRows(Rows const& src, Rows& dst, std::vector<int32_t> const& srcRows,
                   std::vector<int32_t> const& dstRows) {
  auto const width = static_cast<std::size_t>(src.width);
  for (std::size_t i = 0; i < srcRows.size(); ++i) {
    if (srcRows[i] < 0 || dstRows[i] < 0) {
      continue;
    }
    std::copy_n(
        src.expected.begin() + static_cast<long>(static_cast<std::size_t>(srcRows[i]) * width),
        width,
        dst.expected.begin() + static_cast<long>(static_cast<std::size_t>(dstRows[i]) * width));
  }
}

class CopyRowsTest : public test::DeviceTest {};

TEST_P(CopyRowsTest, CopiesChosenRowsOfEveryPairInOneCall) {
  std::mt19937_64 rng(1);
  // Two "layers": state rows of 48 bytes and conv rows of 24 bytes, pool -> slab.
  Rows stateSrc(4, 48, device(), rng), stateDst(3, 48, device(), rng);
  Rows convSrc(4, 24, device(), rng), convDst(3, 24, device(), rng);
  std::vector<kernels::RowBufferPair> const pairs{{stateSrc.buffer(), stateDst.buffer()},
                                                  {convSrc.buffer(), convDst.buffer()}};
  std::vector<int32_t> const srcRows{3, 0};
  std::vector<int32_t> const dstRows{0, 2};
  Tensor const src = test::int32Tensor(srcRows, device());
  Tensor const dst = test::int32Tensor(dstRows, device());
  kernels::copyRows(pairs, device(), src, dst, nullptr);
  modelCopyRows(stateSrc, stateDst, srcRows, dstRows);
  modelCopyRows(convSrc, convDst, srcRows, dstRows);
  EXPECT_EQ(test::readBytes(stateDst.tensor), stateDst.expected);
  EXPECT_EQ(test::readBytes(convDst.tensor), convDst.expected);
  EXPECT_EQ(test::readBytes(stateSrc.tensor), stateSrc.expected);
}

TEST_P(CopyRowsTest, MinusOneInEitherListSkipsTheItem) {
  std::mt19937_64 rng(2);
  Rows src(3, 16, device(), rng), dst(3, 16, device(), rng);
  std::vector<uint8_t> const before = dst.expected;
  std::vector<kernels::RowBufferPair> const pairs{{src.buffer(), dst.buffer()}};
  Tensor const srcRows = test::int32Tensor({-1, 1}, device());
  Tensor const dstRows = test::int32Tensor({0, -1}, device());
  kernels::copyRows(pairs, device(), srcRows, dstRows, nullptr);
  EXPECT_EQ(test::readBytes(dst.tensor), before);
}

TEST_P(CopyRowsTest, RandomItemsMatchTheModel) {
  std::mt19937_64 rng(3);
  for (int round = 0; round < 60; ++round) {
    int64_t const srcCount = std::uniform_int_distribution<int64_t>(1, 12)(rng);
    int64_t const dstCount = std::uniform_int_distribution<int64_t>(1, 12)(rng);
    std::vector<Rows> sources, targets;
    int const pairCount = static_cast<int>(rng() % 5) + 1;
    std::vector<kernels::RowBufferPair> pairs;
    for (int p = 0; p < pairCount; ++p) {
      int64_t const width = std::uniform_int_distribution<int64_t>(1, 700)(rng);
      sources.emplace_back(srcCount, width, device(), rng);
      targets.emplace_back(dstCount, width, device(), rng);
    }
    for (int p = 0; p < pairCount; ++p) {
      pairs.push_back({sources[static_cast<std::size_t>(p)].buffer(),
                       targets[static_cast<std::size_t>(p)].buffer()});
    }
    std::vector<int32_t> dstRows(static_cast<std::size_t>(dstCount));
    std::iota(dstRows.begin(), dstRows.end(), 0);
    std::shuffle(dstRows.begin(), dstRows.end(), rng);
    dstRows.resize(std::uniform_int_distribution<std::size_t>(1, dstRows.size())(rng));
    std::vector<int32_t> srcRows(dstRows.size());
    for (std::size_t i = 0; i < srcRows.size(); ++i) {
      srcRows[i] =
          rng() % 7 == 0 ? -1 : static_cast<int32_t>(rng() % static_cast<uint64_t>(srcCount));
    }
    Tensor const src = test::int32Tensor(srcRows, device());
    Tensor const dst = test::int32Tensor(dstRows, device());
    kernels::copyRows(pairs, device(), src, dst, nullptr);
    for (int p = 0; p < pairCount; ++p) {
      auto const index = static_cast<std::size_t>(p);
      modelCopyRows(sources[index], targets[index], srcRows, dstRows);
      EXPECT_EQ(test::readBytes(targets[index].tensor), targets[index].expected) << "pair " << p;
    }
    if (HasFailure()) {
      return;
    }
  }
}

TEST_P(CopyRowsTest, RejectsMismatchedPairsAndIdLists) {
  std::mt19937_64 rng(4);
  Rows a(2, 16, device(), rng), b(2, 8, device(), rng);
  Tensor const one = test::int32Tensor({0}, device());
  Tensor const two = test::int32Tensor({0, 1}, device());
  std::vector<kernels::RowBufferPair> const mismatched{{a.buffer(), b.buffer()}};
  EXPECT_TRUE(throwsError([&] { kernels::copyRows(mismatched, device(), one, one, nullptr); },
                          {"copyRows", "pair 0", "16 vs 8"}));
  std::vector<kernels::RowBufferPair> const nullPair{{{nullptr, 16, 2}, a.buffer()}};
  EXPECT_TRUE(throwsError([&] { kernels::copyRows(nullPair, device(), one, one, nullptr); },
                          {"copyRows", "pair 0 has no data"}));
  std::vector<kernels::RowBufferPair> const ok{{a.buffer(), a.buffer()}};
  EXPECT_TRUE(throwsError([&] { kernels::copyRows(ok, device(), one, two, nullptr); },
                          {"copyRows", "dstRows has 2 entries, expected 1"}));
  std::vector<kernels::RowBufferPair> const tooMany(
      static_cast<std::size_t>(kernels::kMaxRowBuffers) + 1, {a.buffer(), a.buffer()});
  EXPECT_TRUE(throwsError([&] { kernels::copyRows(tooMany, device(), one, one, nullptr); },
                          {"copyRows", "257 buffer pairs"}));
  EXPECT_EQ(test::readBytes(a.tensor), a.expected);
}

INSTANTIATE_TEST_SUITE_P(Devices, CopyRowsTest, test::allDeviceTypes(), test::deviceName);

TEST(CopyRowsHostTest, RejectsRowsOutsideEitherBufferWithoutCopying) {
  std::mt19937_64 rng(5);
  Rows src(4, 8, DeviceType::kCPU, rng), dst(2, 8, DeviceType::kCPU, rng);
  std::vector<kernels::RowBufferPair> const pairs{{src.buffer(), dst.buffer()}};
  Tensor const srcRows = test::int32Tensor({0, 3}, DeviceType::kCPU);
  Tensor const dstBad = test::int32Tensor({0, 2}, DeviceType::kCPU);
  Tensor const srcBad = test::int32Tensor({4, 0}, DeviceType::kCPU);
  Tensor const dstRows = test::int32Tensor({0, 1}, DeviceType::kCPU);
  EXPECT_TRUE(
      throwsError([&] { kernels::copyRows(pairs, DeviceType::kCPU, srcRows, dstBad, nullptr); },
                  {"copyRows", "dstRows[1] = 2", "[-1, 2)"}));
  EXPECT_TRUE(
      throwsError([&] { kernels::copyRows(pairs, DeviceType::kCPU, srcBad, dstRows, nullptr); },
                  {"copyRows", "srcRows[0] = 4"}));
  EXPECT_EQ(test::readBytes(dst.tensor), dst.expected);
}

}  // namespace
}  // namespace mkv
