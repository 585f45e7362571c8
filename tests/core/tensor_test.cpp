#include "mkv/tensor.h"

#include <gtest/gtest.h>

#include <array>
#include <random>
#include <utility>

#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

TEST(CoordsTest, DefaultIsRankZeroWithOneElement) {
  Coords const scalar;
  EXPECT_EQ(scalar.rank(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.toString(), "[]");
}

TEST(CoordsTest, NumelAndToStringFollowTheExtents) {
  Coords const shape{2, 3, 4};
  EXPECT_EQ(shape.rank(), 3);
  EXPECT_EQ(shape[0], 2);
  EXPECT_EQ(shape[2], 4);
  EXPECT_EQ(shape.numel(), 24);
  EXPECT_EQ(shape.toString(), "[2, 3, 4]");
  EXPECT_EQ((Coords{5, 0, 7}).numel(), 0);
}

TEST(CoordsTest, RejectsMoreThanEightDimensions) {
  EXPECT_NO_THROW((Coords{1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_TRUE(throwsError([] { Coords{1, 1, 1, 1, 1, 1, 1, 1, 1}; }, {"Coords", "8", "9"}));
}

TEST(CoordsTest, RejectsNegativeExtent) {
  EXPECT_TRUE(throwsError([] { Coords{4, -3}; }, {"Coords", "-3"}));
}

TEST(CoordsTest, IndexOutsideRankThrows) {
  Coords const shape{2, 3};
  EXPECT_TRUE(throwsError([&] { (void)shape[2]; }, {"Coords::operator[]", "2"}));
  EXPECT_TRUE(throwsError([&] { (void)shape[-1]; }, {"Coords::operator[]", "-1"}));
}

TEST(CoordsTest, EqualityComparesRankAndExtents) {
  EXPECT_EQ((Coords{2, 3}), (Coords{2, 3}));
  EXPECT_FALSE((Coords{2, 3}) == (Coords{3, 2}));
  EXPECT_FALSE((Coords{2, 3}) == (Coords{2, 3, 1}));
  EXPECT_EQ(Coords(), Coords());
}

TEST(TensorTest, DefaultIsEmptyAndNonOwning) {
  Tensor const tensor;
  EXPECT_TRUE(tensor.empty());
  EXPECT_FALSE(tensor.isOwning());
  EXPECT_EQ(tensor.rawPointer(), nullptr);
  EXPECT_EQ(tensor.capacityBytes(), 0);
}

TEST(TensorTest, OwningHostTensorIsZeroFilledWithShapeAndType) {
  Tensor const tensor({3, 5}, DataType::kFloat16, DeviceType::kCPU);
  EXPECT_TRUE(tensor.isOwning());
  EXPECT_EQ(tensor.shape(), (Coords{3, 5}));
  EXPECT_EQ(tensor.dataType(), DataType::kFloat16);
  EXPECT_EQ(tensor.deviceType(), DeviceType::kCPU);
  EXPECT_EQ(tensor.sizeBytes(), 30);
  EXPECT_EQ(tensor.capacityBytes(), 30);
  auto const* bytes = tensor.dataPointer<uint8_t>();
  for (int i = 0; i < 30; ++i) {
    EXPECT_EQ(bytes[i], 0) << i;
  }
}

TEST(TensorTest, ZeroSizedOwningTensorHasNoData) {
  Tensor const tensor({0, 4}, DataType::kInt32, DeviceType::kCPU);
  EXPECT_TRUE(tensor.empty());
  EXPECT_EQ(tensor.rawPointer(), nullptr);
  EXPECT_EQ(tensor.sizeBytes(), 0);
}

TEST(TensorTest, MoveConstructionTransfersOwnership) {
  Tensor source({4}, DataType::kInt32, DeviceType::kCPU);
  void* const data = source.rawPointer();
  Tensor target(std::move(source));
  EXPECT_EQ(target.rawPointer(), data);
  EXPECT_TRUE(target.isOwning());
  EXPECT_EQ(target.shape(), (Coords{4}));
  EXPECT_EQ(source.rawPointer(), nullptr);  // NOLINT(bugprone-use-after-move): pinned state
  EXPECT_FALSE(source.isOwning());
  EXPECT_EQ(source.capacityBytes(), 0);
}

TEST(TensorTest, MoveAssignmentTakesTheOtherBuffer) {
  Tensor target({2}, DataType::kInt32, DeviceType::kCPU);
  Tensor source({8}, DataType::kInt64, DeviceType::kCPU);
  void* const data = source.rawPointer();
  target = std::move(source);
  EXPECT_EQ(target.rawPointer(), data);
  EXPECT_EQ(target.dataType(), DataType::kInt64);
  EXPECT_EQ(target.capacityBytes(), 64);
  EXPECT_EQ(source.rawPointer(), nullptr);  // NOLINT(bugprone-use-after-move)
}

TEST(TensorTest, ViewWrapsCallerMemoryWithoutOwningIt) {
  std::array<int32_t, 6> storage{1, 2, 3, 4, 5, 6};
  Tensor view = Tensor::view(storage.data(), {2, 3}, DataType::kInt32, DeviceType::kCPU);
  EXPECT_FALSE(view.isOwning());
  EXPECT_EQ(view.rawPointer(), storage.data());
  EXPECT_EQ(view.capacityBytes(), 24);
  view.dataPointer<int32_t>()[4] = 42;
  EXPECT_EQ(storage[4], 42);
}

TEST(TensorTest, ViewRejectsNullDataAndTooSmallCapacity) {
  std::array<int32_t, 4> storage{};
  EXPECT_TRUE(
      throwsError([] { (void)Tensor::view(nullptr, {4}, DataType::kInt32, DeviceType::kCPU); },
                  {"Tensor::view", "null"}));
  EXPECT_TRUE(throwsError(
      [&] { (void)Tensor::view(storage.data(), {4}, DataType::kInt32, DeviceType::kCPU, 12); },
      {"Tensor::view", "12", "16"}));
  EXPECT_NO_THROW((void)Tensor::view(nullptr, {0}, DataType::kInt32, DeviceType::kCPU));
}

TEST(TensorTest, ViewOfSharesPointerShapeAndCapacity) {
  Tensor owner({10}, DataType::kInt32, DeviceType::kCPU);
  ASSERT_TRUE(owner.reshape({4}));
  Tensor const view = Tensor::viewOf(owner);
  EXPECT_EQ(view.rawPointer(), owner.rawPointer());
  EXPECT_EQ(view.shape(), (Coords{4}));
  EXPECT_EQ(view.capacityBytes(), 40);
  EXPECT_FALSE(view.isOwning());
}

TEST(TensorTest, ReshapeWithinCapacityKeepsThePointer) {
  Tensor tensor({4, 8}, DataType::kFloat32, DeviceType::kCPU);
  void* const data = tensor.rawPointer();
  ASSERT_TRUE(tensor.reshape({2, 2, 8}));
  EXPECT_EQ(tensor.shape(), (Coords{2, 2, 8}));
  EXPECT_EQ(tensor.rawPointer(), data);
  ASSERT_TRUE(tensor.reshape({3}));
  EXPECT_EQ(tensor.sizeBytes(), 12);
  EXPECT_EQ(tensor.capacityBytes(), 128);
  ASSERT_TRUE(tensor.reshape({32}));
}

TEST(TensorTest, ReshapeBeyondCapacityFailsAndKeepsTheShape) {
  Tensor tensor({4, 8}, DataType::kFloat32, DeviceType::kCPU);
  EXPECT_FALSE(tensor.reshape({33}));
  EXPECT_FALSE(tensor.reshape({5, 8}));
  EXPECT_EQ(tensor.shape(), (Coords{4, 8}));
}

TEST(TensorTest, StridesAreRowMajor) {
  Tensor const tensor({2, 3, 4}, DataType::kInt8, DeviceType::kCPU);
  EXPECT_EQ(tensor.stride(0), 12);
  EXPECT_EQ(tensor.stride(1), 4);
  EXPECT_EQ(tensor.stride(2), 1);
  EXPECT_TRUE(throwsError([&] { (void)tensor.stride(3); }, {"Tensor::stride", "3"}));
}

TEST(TensorTest, GpuTensorInAHostOnlyBuildThrows) {
#if MKV_WITH_CUDA
  GTEST_SKIP() << "built with CUDA";
#else
  EXPECT_TRUE(
      throwsError([] { Tensor({4}, DataType::kInt32, DeviceType::kGPU); }, {"without CUDA"}));
#endif
}

class TensorDeviceTest : public test::DeviceTest {};

TEST_P(TensorDeviceTest, OwningTensorIsZeroFilledOnItsDevice) {
  Tensor const tensor({7, 9}, DataType::kInt32, device());
  EXPECT_EQ(tensor.deviceType(), device());
  std::vector<uint8_t> const bytes = test::readBytes(tensor);
  EXPECT_EQ(bytes, std::vector<uint8_t>(7 * 9 * 4, 0));
}

TEST_P(TensorDeviceTest, BytesSurviveAReshapeRoundTrip) {
  std::mt19937_64 rng(7);
  Tensor tensor({16, 4}, DataType::kUInt8, device());
  std::vector<uint8_t> const written = test::fillRandom(tensor, rng);
  ASSERT_TRUE(tensor.reshape({8}));
  std::vector<uint8_t> const prefix = test::readBytes(tensor);
  EXPECT_EQ(prefix, std::vector<uint8_t>(written.begin(), written.begin() + 8));
  ASSERT_TRUE(tensor.reshape({64}));
  EXPECT_EQ(test::readBytes(tensor), written);
}

INSTANTIATE_TEST_SUITE_P(Devices, TensorDeviceTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv
