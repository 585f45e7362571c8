#pragma once
/// \file gpu_parity.h
/// Helpers of the GPU kernel suites: every buffer exists twice, on the host and on the GPU,
/// with the same initial bytes; a launcher runs once on each (host twin vs CUDA kernel) and
/// the two results must be equal bit for bit.

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv::gputest {

/// Fixture of every GPU suite: skips without a CUDA device, owns one non-blocking stream.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  cudaStream_t stream() const { return mStream; }
  /// Waits for the stream and fails the test on an asynchronous CUDA error.
  void synchronize();

 private:
  cudaStream_t mStream = nullptr;
};

/// Throws (failing the test) unless `status` is cudaSuccess.
void cudaOk(cudaError_t status, std::string_view what);

/// A byte buffer on the host and its twin on the GPU, equal at construction.
class MirroredBytes {
 public:
  explicit MirroredBytes(std::span<uint8_t const> initial);
  uint8_t* cpu() { return mCpu.dataPointer<uint8_t>(); }
  uint8_t* gpu() { return mGpu.dataPointer<uint8_t>(); }
  uint8_t* on(DeviceType device) { return device == DeviceType::kGPU ? gpu() : cpu(); }
  std::span<uint8_t const> cpuBytes() const;
  std::vector<uint8_t> gpuBytes() const;
  /// Overwrites both copies with `bytes`.
  void reset(std::span<uint8_t const> bytes);
  /// Overwrites the GPU copy with `bytes`.
  void resetGpu(std::span<uint8_t const> bytes);

 private:
  Tensor mCpu;
  Tensor mGpu;
};

/// An int32 index tensor on the host and on the GPU.
struct MirroredInt32 {
  explicit MirroredInt32(std::span<int32_t const> values);
  Tensor const& on(DeviceType device) const { return device == DeviceType::kGPU ? gpu : cpu; }
  Tensor cpu;
  Tensor gpu;
};

/// Passes when the GPU copy equals the host copy; otherwise names the first differing byte.
::testing::AssertionResult sameBytes(MirroredBytes const& buffer);

/// Passes when every byte of `bytes` outside the half-open `written` ranges equals `poison`.
struct ByteRange {
  int64_t begin;
  int64_t end;
};
::testing::AssertionResult untouchedOutside(std::span<uint8_t const> bytes,
                                            std::vector<ByteRange> written, uint8_t poison);

inline constexpr uint8_t kPoison = 0xFF;

/// `count` distinct values from [0, limit) in random order (requires count <= limit).
std::vector<int32_t> distinctIds(int32_t count, int32_t limit, std::mt19937_64& rng);
/// Replaces each entry by -1 with probability `fraction`.
void dropSome(std::vector<int32_t>& ids, double fraction, std::mt19937_64& rng);
/// An order-preserving compaction mapping of `oldBatch` rows: each row survives with
/// probability `keep`; the k-th survivor maps to k, the others to -1. Returns the survivors.
int32_t orderPreservingMapping(std::vector<int32_t>& oldToNew, int32_t oldBatch, double keep,
                               std::mt19937_64& rng);

}  // namespace mkv::gputest
