#include "gpu/gpu_parity.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "mkv/stream.h"
#include "support/test_util.h"

namespace mkv::gputest {

void cudaOk(cudaError_t status, std::string_view what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(status) + ": " +
                             cudaGetErrorString(status));
  }
}

void GpuTest::SetUp() {
  if (!cudaDeviceAvailable()) {
    GTEST_SKIP() << "no CUDA device visible";
  }
  cudaOk(cudaStreamCreateWithFlags(&mStream, cudaStreamNonBlocking), "cudaStreamCreate");
}

void GpuTest::TearDown() {
  if (mStream != nullptr) {
    (void)cudaStreamSynchronize(mStream);
    (void)cudaStreamDestroy(mStream);
    mStream = nullptr;
  }
}

void GpuTest::synchronize() {
  cudaOk(cudaStreamSynchronize(mStream), "cudaStreamSynchronize");
  cudaOk(cudaGetLastError(), "cudaGetLastError");
}

MirroredBytes::MirroredBytes(std::span<uint8_t const> initial)
    : mCpu({static_cast<int64_t>(initial.size())}, DataType::kUInt8, DeviceType::kCPU),
      mGpu({static_cast<int64_t>(initial.size())}, DataType::kUInt8, DeviceType::kGPU) {
  reset(initial);
}

void MirroredBytes::reset(std::span<uint8_t const> bytes) {
  test::writeBytes(mCpu, bytes);
  test::writeBytes(mGpu, bytes);
}

void MirroredBytes::resetGpu(std::span<uint8_t const> bytes) { test::writeBytes(mGpu, bytes); }

std::span<uint8_t const> MirroredBytes::cpuBytes() const {
  return {mCpu.dataPointer<uint8_t>(), static_cast<std::size_t>(mCpu.sizeBytes())};
}

std::vector<uint8_t> MirroredBytes::gpuBytes() const { return test::readBytes(mGpu); }

MirroredInt32::MirroredInt32(std::span<int32_t const> values)
    : cpu(test::int32Tensor(values, DeviceType::kCPU)),
      gpu(test::int32Tensor(values, DeviceType::kGPU)) {}

::testing::AssertionResult sameBytes(MirroredBytes const& buffer) {
  std::vector<uint8_t> const gpu = buffer.gpuBytes();
  std::span<uint8_t const> const cpu = buffer.cpuBytes();
  auto const [cpuAt, gpuAt] = std::mismatch(cpu.begin(), cpu.end(), gpu.begin(), gpu.end());
  if (cpuAt == cpu.end() && gpuAt == gpu.end()) {
    return ::testing::AssertionSuccess();
  }
  auto const offset = std::distance(cpu.begin(), cpuAt);
  auto const mismatches = std::inner_product(cpu.begin(), cpu.end(), gpu.begin(), int64_t{0},
                                             std::plus<>(), std::not_equal_to<>());
  return ::testing::AssertionFailure()
         << mismatches << " of " << cpu.size() << " bytes differ; first at offset " << offset
         << ": host " << int{*cpuAt} << ", GPU " << int{*gpuAt};
}

::testing::AssertionResult untouchedOutside(std::span<uint8_t const> bytes,
                                            std::vector<ByteRange> written, uint8_t poison) {
  std::sort(written.begin(), written.end(),
            [](ByteRange const& a, ByteRange const& b) { return a.begin < b.begin; });
  int64_t cursor = 0;
  auto const size = static_cast<int64_t>(bytes.size());
  auto checkGap = [&](int64_t end) -> int64_t {
    for (int64_t i = cursor; i < end; ++i) {
      if (bytes[static_cast<std::size_t>(i)] != poison) {
        return i;
      }
    }
    return -1;
  };
  for (ByteRange const& range : written) {
    if (int64_t const bad = checkGap(std::min(range.begin, size)); bad >= 0) {
      return ::testing::AssertionFailure() << "byte " << bad << " outside every target was written";
    }
    cursor = std::max(cursor, range.end);
  }
  if (int64_t const bad = checkGap(size); bad >= 0) {
    return ::testing::AssertionFailure() << "byte " << bad << " outside every target was written";
  }
  return ::testing::AssertionSuccess();
}

std::vector<int32_t> distinctIds(int32_t count, int32_t limit, std::mt19937_64& rng) {
  std::vector<int32_t> ids(static_cast<std::size_t>(limit));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(static_cast<std::size_t>(count));
  return ids;
}

void dropSome(std::vector<int32_t>& ids, double fraction, std::mt19937_64& rng) {
  std::bernoulli_distribution drop(fraction);
  for (int32_t& id : ids) {
    if (drop(rng)) {
      id = -1;
    }
  }
}

int32_t orderPreservingMapping(std::vector<int32_t>& oldToNew, int32_t oldBatch, double keep,
                               std::mt19937_64& rng) {
  std::bernoulli_distribution survives(keep);
  oldToNew.assign(static_cast<std::size_t>(oldBatch), -1);
  int32_t next = 0;
  for (int32_t& target : oldToNew) {
    if (survives(rng)) {
      target = next++;
    }
  }
  return next;
}

}  // namespace mkv::gputest
