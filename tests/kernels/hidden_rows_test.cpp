#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

class HiddenRowsTest : public test::DeviceTest {};

/// Bytes of row r of a 2-D tensor's host image.
std::vector<uint8_t> rowOf(std::vector<uint8_t> const& image, int64_t rowBytes, int64_t r) {
  auto const begin = image.begin() + static_cast<long>(r * rowBytes);
  return {begin, begin + static_cast<long>(rowBytes)};
}

TEST_P(HiddenRowsTest, CaptureCopiesChosenRowsIntoSlotsAndRestoreCopiesThemBack) {
  std::mt19937_64 rng(1);
  int64_t const width = 40;  // float16 elements -> 80-byte rows
  int64_t const rowBytes = width * 2;
  Tensor hidden({6, width}, DataType::kFloat16, device());
  Tensor slab({3, width}, DataType::kFloat16, device());
  std::vector<uint8_t> const hiddenBytes = test::fillRandom(hidden, rng);
  std::vector<uint8_t> const slabBefore = test::fillConstant(slab, 0xEE);
  Tensor const rows = test::int32Tensor({5, 1, -1}, device());
  Tensor const slots = test::int32Tensor({0, 2, 1}, device());
  kernels::captureHiddenRows(hidden, rows, slab, slots, nullptr);
  std::vector<uint8_t> const slabBytes = test::readBytes(slab);
  EXPECT_EQ(rowOf(slabBytes, rowBytes, 0), rowOf(hiddenBytes, rowBytes, 5));
  EXPECT_EQ(rowOf(slabBytes, rowBytes, 2), rowOf(hiddenBytes, rowBytes, 1));
  EXPECT_EQ(rowOf(slabBytes, rowBytes, 1), rowOf(slabBefore, rowBytes, 1));  // skipped item

  Tensor target({4, width}, DataType::kFloat16, device());
  std::vector<uint8_t> const targetBefore = test::fillConstant(target, 0x11);
  Tensor const restoreSlots = test::int32Tensor({2, 0}, device());
  Tensor const restoreRows = test::int32Tensor({0, 3}, device());
  kernels::restoreHiddenRows(slab, restoreSlots, target, restoreRows, nullptr);
  std::vector<uint8_t> const targetBytes = test::readBytes(target);
  EXPECT_EQ(rowOf(targetBytes, rowBytes, 0), rowOf(hiddenBytes, rowBytes, 1));
  EXPECT_EQ(rowOf(targetBytes, rowBytes, 3), rowOf(hiddenBytes, rowBytes, 5));
  EXPECT_EQ(rowOf(targetBytes, rowBytes, 1), rowOf(targetBefore, rowBytes, 1));
  EXPECT_EQ(rowOf(targetBytes, rowBytes, 2), rowOf(targetBefore, rowBytes, 2));
}

TEST_P(HiddenRowsTest, RejectsShapeTypeAndDeviceMismatches) {
  Tensor const hidden({4, 16}, DataType::kFloat16, device());
  Tensor slab({2, 16}, DataType::kFloat16, device());
  Tensor narrow({2, 8}, DataType::kFloat16, device());
  Tensor wrongType({2, 16}, DataType::kBFloat16, device());
  Tensor flat({32}, DataType::kFloat16, device());
  Tensor host({2, 16}, DataType::kFloat16, DeviceType::kCPU);
  Tensor const ids = test::int32Tensor({0}, device());
  EXPECT_TRUE(throwsError([&] { kernels::captureHiddenRows(hidden, ids, narrow, ids, nullptr); },
                          {"captureHiddenRows", "16 vs 8"}));
  EXPECT_TRUE(throwsError([&] { kernels::captureHiddenRows(hidden, ids, wrongType, ids, nullptr); },
                          {"captureHiddenRows", "float16 vs bfloat16"}));
  EXPECT_TRUE(throwsError([&] { kernels::captureHiddenRows(hidden, ids, flat, ids, nullptr); },
                          {"captureHiddenRows", "2-D", "[32]"}));
  EXPECT_TRUE(throwsError([&] { kernels::restoreHiddenRows(slab, ids, flat, ids, nullptr); },
                          {"restoreHiddenRows", "2-D"}));
  if (device() == DeviceType::kGPU) {
    EXPECT_TRUE(throwsError([&] { kernels::captureHiddenRows(hidden, ids, host, ids, nullptr); },
                            {"captureHiddenRows", "src on gpu but dst on cpu"}));
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, HiddenRowsTest, test::allDeviceTypes(), test::deviceName);

TEST(HiddenRowsHostTest, RejectsRowsAndSlotsOutOfRangeNamingTheLauncher) {
  Tensor const hidden({4, 16}, DataType::kFloat16, DeviceType::kCPU);
  Tensor slab({2, 16}, DataType::kFloat16, DeviceType::kCPU);
  Tensor const row = test::int32Tensor({4}, DeviceType::kCPU);
  Tensor const slot = test::int32Tensor({0}, DeviceType::kCPU);
  Tensor const badSlot = test::int32Tensor({2}, DeviceType::kCPU);
  Tensor const okRow = test::int32Tensor({3}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { kernels::captureHiddenRows(hidden, row, slab, slot, nullptr); },
                          {"captureHiddenRows", "srcRows[0] = 4"}));
  EXPECT_TRUE(
      throwsError([&] { kernels::captureHiddenRows(hidden, okRow, slab, badSlot, nullptr); },
                  {"captureHiddenRows", "dstRows[0] = 2"}));
}

}  // namespace
}  // namespace mkv
