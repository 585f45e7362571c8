#include "core/device.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <utility>
#include <vector>

#include "mkv/stream.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

TEST(DeviceTest, CheckCudaPassesSuccessAndNamesFailures) {
  EXPECT_NO_THROW(detail::checkCuda(cudaSuccess, "anything"));
  EXPECT_TRUE(throwsError([] { detail::checkCuda(cudaErrorInvalidValue, "cudaMemcpyAsync"); },
                          {"cudaMemcpyAsync", "cudaErrorInvalidValue"}));
  EXPECT_EQ(detail::cudaErrorName(cudaErrorMemoryAllocation), "cudaErrorMemoryAllocation");
}

TEST(DeviceTest, HostCopiesAndFillsAreImmediate) {
  std::array<uint8_t, 8> src{1, 2, 3, 4, 5, 6, 7, 8};
  std::array<uint8_t, 8> dst{};
  detail::copyBytes(dst.data(), DeviceType::kCPU, src.data(), DeviceType::kCPU, 5, nullptr);
  EXPECT_EQ(dst, (std::array<uint8_t, 8>{1, 2, 3, 4, 5, 0, 0, 0}));
  detail::fillBytes(dst.data() + 2, DeviceType::kCPU, 0xAB, 3, nullptr);
  EXPECT_EQ(dst, (std::array<uint8_t, 8>{1, 2, 0xAB, 0xAB, 0xAB, 0, 0, 0}));
  detail::copyBytes(nullptr, DeviceType::kCPU, nullptr, DeviceType::kCPU, 0, nullptr);  // no-op
}

TEST(DeviceTest, HostOnlyBuildRefusesDeviceMemory) {
#if MKV_WITH_CUDA
  GTEST_SKIP() << "built with CUDA";
#else
  EXPECT_TRUE(throwsError([] { (void)detail::allocateDevice(64); }, {"without CUDA"}));
  EXPECT_TRUE(throwsError([] { (void)detail::allocatePinnedHost(64); }, {"without CUDA"}));
  void* mapped = nullptr;
  EXPECT_TRUE(throwsError([&] { (void)detail::allocateMappedHost(64, mapped); },
                          {"allocateMappedHost", "without CUDA"}));
  EXPECT_TRUE(throwsError([] { detail::OwnedStream stream(DeviceType::kGPU); },
                          {"OwnedStream", "without CUDA"}));
  std::array<uint8_t, 4> host{};
  EXPECT_TRUE(throwsError(
      [&] {
        detail::copyBytes(host.data(), DeviceType::kGPU, host.data(), DeviceType::kCPU, 4, nullptr);
      },
      {"copyBytes", "without CUDA"}));
  EXPECT_FALSE(cudaDeviceAvailable());
  EXPECT_EQ(defaultStreamSynchronizer(DeviceType::kGPU)(nullptr), cudaErrorNoDevice);
#endif
}

TEST(DeviceTest, DefaultHostSynchronizerSucceeds) {
  StreamSynchronizer const sync = defaultStreamSynchronizer(DeviceType::kCPU);
  EXPECT_EQ(sync(nullptr), cudaSuccess);
}

TEST(HostBufferTest, IsZeroedAndMovable) {
  detail::HostBuffer buffer(16, DeviceType::kCPU);
  ASSERT_NE(buffer.data(), nullptr);
  EXPECT_EQ(buffer.size(), 16u);
  auto const* bytes = static_cast<uint8_t const*>(buffer.data());
  for (std::size_t i = 0; i < 16; ++i) {
    EXPECT_EQ(bytes[i], 0);
  }
  void* const data = buffer.data();
  detail::HostBuffer moved(std::move(buffer));
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(buffer.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(buffer.size(), 0u);
}

TEST(Int32StagingTest, RejectsNonPositiveCapacity) {
  EXPECT_TRUE(
      throwsError([] { detail::Int32Staging(0, DeviceType::kCPU); }, {"Int32Staging", "0"}));
}

class Int32StagingDeviceTest : public test::DeviceTest {};

TEST_P(Int32StagingDeviceTest, BatchViewsHoldTheAddedValuesOnTheTargetDevice) {
  detail::Int32Staging staging(8, device());
  std::vector<int32_t> const first{4, -1, 7};
  std::vector<int32_t> const second{9, 10};
  detail::Int32Staging::Batch batch = staging.begin(nullptr);
  Tensor const a = batch.add(first);
  Tensor const b = batch.add(second);
  batch.submit();
  EXPECT_EQ(a.deviceType(), device());
  EXPECT_EQ(a.shape(), (Coords{3}));
  EXPECT_EQ(b.shape(), (Coords{2}));
  EXPECT_EQ(b.dataPointer<int32_t>(), a.dataPointer<int32_t>() + 3);  // packed, one copy
  EXPECT_EQ(test::readAs<int32_t>(a), first);
  EXPECT_EQ(test::readAs<int32_t>(b), second);
}

TEST_P(Int32StagingDeviceTest, EveryBatchStartsAtTheBeginningAgain) {
  detail::Int32Staging staging(4, device());
  std::vector<int32_t> const values{1, 2, 3, 4};
  detail::Int32Staging::Batch first = staging.begin(nullptr);
  Tensor const a = first.add(values);
  first.submit();
  detail::Int32Staging::Batch second = staging.begin(nullptr);
  std::vector<int32_t> const next{5, 6, 7, 8};
  Tensor const b = second.add(next);
  second.submit();
  EXPECT_EQ(b.rawPointer(), a.rawPointer());
  EXPECT_EQ(test::readAs<int32_t>(b), next);
}

TEST_P(Int32StagingDeviceTest, RejectsValuesBeyondTheCapacity) {
  detail::Int32Staging staging(4, device());
  detail::Int32Staging::Batch batch = staging.begin(nullptr);
  std::vector<int32_t> const three{1, 2, 3};
  (void)batch.add(three);
  EXPECT_TRUE(throwsError([&] { (void)batch.add(three); }, {"Int32Staging::add", "3", "4"}));
  std::vector<int32_t> const one{4};
  Tensor const last = batch.add(one);  // the failed add consumed nothing
  batch.submit();
  EXPECT_EQ(test::readAs<int32_t>(last), one);
}

INSTANTIATE_TEST_SUITE_P(Devices, Int32StagingDeviceTest, test::allDeviceTypes(), test::deviceName);

TEST(Int32UploadRegionsTest, RejectsNonPositiveSizes) {
  EXPECT_TRUE(throwsError([] { detail::Int32UploadRegions(0, 4, DeviceType::kCPU); },
                          {"Int32UploadRegions", "0"}));
  EXPECT_TRUE(throwsError([] { detail::Int32UploadRegions(2, -1, DeviceType::kCPU); },
                          {"Int32UploadRegions", "-1"}));
}

class Int32UploadRegionsDeviceTest : public test::DeviceTest {};

TEST_P(Int32UploadRegionsDeviceTest, EachRegionUploadsIntoItsDestination) {
  detail::Int32UploadRegions uploads(3, 4, device());
  Tensor first({4}, DataType::kInt32, device());
  Tensor second({4}, DataType::kInt32, device());
  std::vector<int32_t> const a{0, -1, 1, 2};
  std::vector<int32_t> const b{-1, 0};
  uploads.upload(0, a, first.rawPointer(), nullptr);
  uploads.upload(2, b, second.rawPointer(), nullptr);
  EXPECT_EQ(test::readAs<int32_t>(first), a);
  EXPECT_EQ(test::readAs<int32_t>(second), (std::vector<int32_t>{-1, 0, 0, 0}));
  std::vector<int32_t> const again{5, 6, 7, 8};
  uploads.upload(0, again, first.rawPointer(), nullptr);  // a region is reused
  EXPECT_EQ(test::readAs<int32_t>(first), again);
}

TEST_P(Int32UploadRegionsDeviceTest, RejectsABadRegionOrTooManyValuesWithoutWriting) {
  detail::Int32UploadRegions uploads(2, 2, device());
  Tensor target({4}, DataType::kInt32, device());
  std::vector<int32_t> const three{1, 2, 3};
  std::vector<int32_t> const one{9};
  EXPECT_TRUE(throwsError([&] { uploads.upload(0, three, target.rawPointer(), nullptr); },
                          {"Int32UploadRegions::upload", "3", "2"}));
  EXPECT_TRUE(throwsError([&] { uploads.upload(2, one, target.rawPointer(), nullptr); },
                          {"Int32UploadRegions::upload", "region 2"}));
  EXPECT_TRUE(throwsError([&] { uploads.upload(-1, one, target.rawPointer(), nullptr); },
                          {"Int32UploadRegions::upload", "region -1"}));
  EXPECT_EQ(test::readAs<int32_t>(target), (std::vector<int32_t>{0, 0, 0, 0}));
}

INSTANTIATE_TEST_SUITE_P(Devices, Int32UploadRegionsDeviceTest, test::allDeviceTypes(),
                         test::deviceName);

class StreamAndEventDeviceTest : public test::DeviceTest {};

TEST_P(StreamAndEventDeviceTest, AnEventOnAnOwnedStreamCompletesAndOrdersAnotherStream) {
  detail::OwnedStream first(device());
  detail::OwnedStream second(device());
  EXPECT_EQ(first.get() == nullptr, device() == DeviceType::kCPU);
  detail::Event event(device());
  EXPECT_TRUE(event.query());       // never recorded
  event.orderBefore(second.get());  // never recorded: nothing to wait for
  Tensor source({8}, DataType::kInt32, device());
  Tensor target({8}, DataType::kInt32, device());
  std::vector<int32_t> const values{1, 2, 3, 4, 5, 6, 7, 8};
  test::writeBytes(source, std::vector<uint8_t>(reinterpret_cast<uint8_t const*>(values.data()),
                                                reinterpret_cast<uint8_t const*>(values.data()) +
                                                    values.size() * sizeof(int32_t)));
  detail::fillBytes(target.rawPointer(), device(), 0, 32, first.get());
  event.record(first.get());
  event.orderBefore(second.get());
  detail::copyBytes(target.rawPointer(), device(), source.rawPointer(), device(), 32, second.get());
  EXPECT_EQ(second.synchronize(), cudaSuccess);
  EXPECT_TRUE(event.query());  // `second` waited for it, so it has completed
  EXPECT_EQ(first.synchronize(), cudaSuccess);
  EXPECT_EQ(test::readAs<int32_t>(target), values);
  detail::OwnedStream moved(std::move(first));
  EXPECT_EQ(first.get(), nullptr);  // NOLINT(bugprone-use-after-move): the moved-from state
  EXPECT_EQ(moved.synchronize(), cudaSuccess);
}

TEST_P(StreamAndEventDeviceTest, MappedHostMemoryIsReachableThroughItsDevicePointer) {
  if (device() == DeviceType::kCPU) {
    GTEST_SKIP() << "mapped host memory is a GPU allocation";
  }
  void* mapped = nullptr;
  void* host = detail::allocateMappedHost(64, mapped);
  ASSERT_NE(host, nullptr);
  ASSERT_NE(mapped, nullptr);
  std::memset(host, 0x3C, 64);
  Tensor target({64}, DataType::kUInt8, device());
  detail::copyBytes(target.rawPointer(), device(), mapped, device(), 64, nullptr);
  EXPECT_EQ(test::readBytes(target), std::vector<uint8_t>(64, 0x3C));
  detail::freePinnedHost(host);
  void* none = &target;
  EXPECT_EQ(detail::allocateMappedHost(0, none), nullptr);
  EXPECT_EQ(none, nullptr);
}

INSTANTIATE_TEST_SUITE_P(Devices, StreamAndEventDeviceTest, test::allDeviceTypes(),
                         test::deviceName);

}  // namespace
}  // namespace mkv
