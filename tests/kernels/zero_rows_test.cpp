#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

struct Rows {
  Rows(int64_t rows, int64_t rowBytes, DeviceType device, std::mt19937_64& rng)
      : tensor({rows, rowBytes}, DataType::kUInt8, device), width(rowBytes) {
    expected = test::fillRandom(tensor, rng);
  }
  kernels::RowBuffer buffer() { return {tensor.rawPointer(), width, tensor.dim(0)}; }
  void zeroModelRow(int32_t row) {
    std::fill_n(expected.begin() + static_cast<long>(row * width), width, uint8_t{0});
  }
  Tensor tensor;
  int64_t width;
  std::vector<uint8_t> expected;
};

class ZeroRowsTest : public test::DeviceTest {};

TEST_P(ZeroRowsTest, ZeroesTheChosenRowsOfEveryBufferAndNothingElse) {
  std::mt19937_64 rng(1);
  std::vector<Rows> buffers;
  for (int64_t width : {48, 24, 5, 2048}) {
    buffers.emplace_back(4, width, device(), rng);
  }
  std::vector<kernels::RowBuffer> descriptors;
  for (Rows& rows : buffers) {
    descriptors.push_back(rows.buffer());
    rows.zeroModelRow(1);
    rows.zeroModelRow(3);
  }
  Tensor const rowIds = test::int32Tensor({3, -1, 1}, device());
  kernels::zeroRows(descriptors, device(), rowIds, nullptr);
  for (Rows const& rows : buffers) {
    EXPECT_EQ(test::readBytes(rows.tensor), rows.expected) << "width " << rows.width;
  }
}

TEST_P(ZeroRowsTest, RandomRowSetsMatchTheModel) {
  std::mt19937_64 rng(2);
  for (int round = 0; round < 40; ++round) {
    int64_t const rowCount = std::uniform_int_distribution<int64_t>(1, 16)(rng);
    std::vector<Rows> buffers;
    std::vector<kernels::RowBuffer> descriptors;
    int const count = static_cast<int>(rng() % 4) + 1;
    for (int b = 0; b < count; ++b) {
      buffers.emplace_back(rowCount, std::uniform_int_distribution<int64_t>(1, 500)(rng), device(),
                           rng);
    }
    std::vector<int32_t> ids;
    for (int i = 0; i < static_cast<int>(rng() % 6); ++i) {
      ids.push_back(rng() % 5 == 0 ? -1
                                   : static_cast<int32_t>(rng() % static_cast<uint64_t>(rowCount)));
    }
    for (Rows& rows : buffers) {
      descriptors.push_back(rows.buffer());
      for (int32_t id : ids) {
        if (id >= 0) {
          rows.zeroModelRow(id);
        }
      }
    }
    Tensor const rowIds = test::int32Tensor(ids, device());
    kernels::zeroRows(descriptors, device(), rowIds, nullptr);
    for (Rows const& rows : buffers) {
      EXPECT_EQ(test::readBytes(rows.tensor), rows.expected);
    }
    if (HasFailure()) {
      return;
    }
  }
}

TEST_P(ZeroRowsTest, RejectsInvalidBuffers) {
  std::mt19937_64 rng(3);
  Rows rows(2, 8, device(), rng);
  Tensor const ids = test::int32Tensor({0}, device());
  std::vector<kernels::RowBuffer> const zeroWidth{{rows.tensor.rawPointer(), 0, 2}};
  EXPECT_TRUE(throwsError([&] { kernels::zeroRows(zeroWidth, device(), ids, nullptr); },
                          {"zeroRows", "rowBytes 0"}));
  std::vector<kernels::RowBuffer> const null{{nullptr, 8, 2}};
  EXPECT_TRUE(throwsError([&] { kernels::zeroRows(null, device(), ids, nullptr); },
                          {"zeroRows", "no data"}));
  EXPECT_EQ(test::readBytes(rows.tensor), rows.expected);
}

INSTANTIATE_TEST_SUITE_P(Devices, ZeroRowsTest, test::allDeviceTypes(), test::deviceName);

TEST(ZeroRowsHostTest, RejectsARowOutsideAnyBufferWithoutZeroing) {
  std::mt19937_64 rng(4);
  Rows big(6, 8, DeviceType::kCPU, rng), small(3, 8, DeviceType::kCPU, rng);
  std::vector<kernels::RowBuffer> const buffers{big.buffer(), small.buffer()};
  Tensor const ids = test::int32Tensor({1, 3}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { kernels::zeroRows(buffers, DeviceType::kCPU, ids, nullptr); },
                          {"zeroRows", "rows[1] = 3", "[-1, 3)"}));
  EXPECT_EQ(test::readBytes(big.tensor), big.expected);
  EXPECT_EQ(test::readBytes(small.tensor), small.expected);
}

}  // namespace
}  // namespace mkv
