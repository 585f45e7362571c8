#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

class GatherPageTableRowsTest : public test::DeviceTest {
 protected:
  static constexpr int32_t kBatch = 5;
  static constexpr int32_t kWidth = 3;  // maxPagesPerSeq

  void SetUp() override {
    test::DeviceTest::SetUp();
    if (IsSkipped()) {
      return;
    }
    mHostTable.resize(kBatch * 2 * kWidth);
    for (std::size_t i = 0; i < mHostTable.size(); ++i) {
      mHostTable[i] = static_cast<int32_t>(100 + i);
    }
    mTable = Tensor({kBatch, 2, kWidth}, DataType::kInt32, device());
    test::writeBytes(mTable,
                     std::span<uint8_t const>(reinterpret_cast<uint8_t const*>(mHostTable.data()),
                                              mHostTable.size() * sizeof(int32_t)));
  }

  std::vector<int32_t> hostRow(int32_t slot) const {
    auto const begin = mHostTable.begin() + slot * 2 * kWidth;
    return {begin, begin + 2 * kWidth};
  }

  std::vector<int32_t> mHostTable;
  Tensor mTable;
};

TEST_P(GatherPageTableRowsTest, BuildsTheActiveTableInResidentOrder) {
  Tensor dst({kBatch, 2, kWidth}, DataType::kInt32, device());
  test::fillConstant(dst, 0x33);
  Tensor const slots = test::int32Tensor({3, 0, -1, 4}, device());
  kernels::gatherPageTableRows(mTable, slots, dst, nullptr);
  EXPECT_EQ(dst.shape(), (Coords{4, 2, kWidth}));
  std::vector<int32_t> const rows = test::readAs<int32_t>(dst);
  std::vector<int32_t> expected;
  for (std::vector<int32_t> const& row :
       {hostRow(3), hostRow(0), std::vector<int32_t>(2 * kWidth, -1), hostRow(4)}) {
    expected.insert(expected.end(), row.begin(), row.end());
  }
  EXPECT_EQ(rows, expected);
}

TEST_P(GatherPageTableRowsTest, KeepsTheDestinationAddressAcrossBatchSizes) {
  Tensor dst({kBatch * 2 * kWidth}, DataType::kInt32, device());
  void* const address = dst.rawPointer();
  Tensor const three = test::int32Tensor({1, 2, 3}, device());
  kernels::gatherPageTableRows(mTable, three, dst, nullptr);
  EXPECT_EQ(dst.shape(), (Coords{3, 2, kWidth}));
  Tensor const one = test::int32Tensor({2}, device());
  kernels::gatherPageTableRows(mTable, one, dst, nullptr);
  EXPECT_EQ(dst.shape(), (Coords{1, 2, kWidth}));
  EXPECT_EQ(dst.rawPointer(), address);
  EXPECT_EQ(test::readAs<int32_t>(dst), hostRow(2));
}

TEST_P(GatherPageTableRowsTest, RejectsSmallDestinationsAndMalformedTables) {
  Tensor small({2, 2, kWidth}, DataType::kInt32, device());
  Tensor const three = test::int32Tensor({0, 1, 2}, device());
  EXPECT_TRUE(throwsError([&] { kernels::gatherPageTableRows(mTable, three, small, nullptr); },
                          {"gatherPageTableRows", "capacity 48 bytes", "[3, 2, 3]"}));
  EXPECT_EQ(small.shape(), (Coords{2, 2, kWidth}));
  Tensor const flat({kBatch * 2 * kWidth}, DataType::kInt32, device());
  EXPECT_TRUE(throwsError([&] { kernels::gatherPageTableRows(flat, three, small, nullptr); },
                          {"gatherPageTableRows", "[maxBatch, 2, maxPagesPerSeq]", "[30]"}));
  Tensor wide({kBatch, 2, kWidth}, DataType::kInt64, device());
  EXPECT_TRUE(throwsError([&] { kernels::gatherPageTableRows(mTable, three, wide, nullptr); },
                          {"gatherPageTableRows", "int32"}));
}

INSTANTIATE_TEST_SUITE_P(Devices, GatherPageTableRowsTest, test::allDeviceTypes(),
                         test::deviceName);

TEST(GatherPageTableRowsHostTest, RejectsSlotsOutsideTheTable) {
  Tensor const table({2, 2, 4}, DataType::kInt32, DeviceType::kCPU);
  Tensor dst({2, 2, 4}, DataType::kInt32, DeviceType::kCPU);
  Tensor const slots = test::int32Tensor({0, 2}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { kernels::gatherPageTableRows(table, slots, dst, nullptr); },
                          {"gatherPageTableRows", "residentSlots[1] = 2", "[-1, 2)"}));
}

}  // namespace
}  // namespace mkv
