/// applyInt32Patch on the GPU against its host twin: thousands of small ranges, one large
/// range, empty ranges, and ranges reaching outside dst or the patch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "gpu/gpu_parity.h"
#include "kernel_params.h"
#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv::gputest {
namespace {

class Int32PatchGpuTest : public GpuTest {
 protected:
  /// Builds a patch of non-overlapping ranges with the given lengths, spread over `dstNumel`.
  std::vector<int32_t> makePatch(std::vector<int32_t> const& counts, int32_t dstNumel) {
    auto const ranges = static_cast<int32_t>(counts.size());
    int64_t total = 0;
    for (int32_t c : counts) {
      total += c;
    }
    // Random gaps between consecutive ranges, in random order of the ranges in the patch.
    std::vector<int32_t> offsets;
    int64_t const slack = dstNumel - total;
    std::vector<int64_t> gaps(counts.size());
    std::uniform_int_distribution<int64_t> gap(0, slack / std::max<int64_t>(1, ranges));
    int64_t at = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      at += gap(mRng);
      offsets.push_back(static_cast<int32_t>(at));
      at += counts[r];
    }
    std::vector<int32_t> order(counts.size());
    for (std::size_t r = 0; r < order.size(); ++r) {
      order[r] = static_cast<int32_t>(r);
    }
    std::shuffle(order.begin(), order.end(), mRng);
    std::vector<int32_t> patch(static_cast<std::size_t>(3 * ranges));
    int32_t valueStart = 3 * ranges;
    std::uniform_int_distribution<int32_t> value(-1, 1 << 20);
    for (int32_t slot = 0; slot < ranges; ++slot) {
      auto const r = static_cast<std::size_t>(order[static_cast<std::size_t>(slot)]);
      patch[static_cast<std::size_t>(3 * slot)] = offsets[r];
      patch[static_cast<std::size_t>(3 * slot + 1)] = counts[r];
      patch[static_cast<std::size_t>(3 * slot + 2)] = valueStart;
      valueStart += counts[r];
    }
    for (int64_t v = 0; v < total; ++v) {
      patch.push_back(value(mRng));
    }
    return patch;
  }

  void patchAndCheck(std::vector<int32_t> const& patch, int32_t numRanges, int32_t dstNumel) {
    std::vector<uint8_t> const initial =
        test::randomBytes(static_cast<std::size_t>(dstNumel) * 4, mRng);
    MirroredBytes dst(initial);
    MirroredInt32 const p(patch);
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      Tensor d = Tensor::view(dst.on(device), {dstNumel}, DataType::kInt32, device);
      kernels::applyInt32Patch(d, p.on(device), numRanges,
                               device == DeviceType::kGPU ? stream() : nullptr);
    }
    synchronize();
    EXPECT_TRUE(sameBytes(dst));
  }

  std::mt19937_64 mRng{4242};
};

TEST_F(Int32PatchGpuTest, ThousandsOfSmallRangesMatchHostTwin) {
  std::uniform_int_distribution<int32_t> length(0, 40);
  std::vector<int32_t> counts(5000);
  for (int32_t& c : counts) {
    c = length(mRng);
  }
  int32_t const dstNumel = 300000;
  patchAndCheck(makePatch(counts, dstNumel), static_cast<int32_t>(counts.size()), dstNumel);
}

TEST_F(Int32PatchGpuTest, OneLargeRangeAndEmptyRangesMatchHostTwin) {
  int32_t const dstNumel = 400000;
  std::vector<int32_t> const counts{0, 350000, 0, 3};
  patchAndCheck(makePatch(counts, dstNumel), 4, dstNumel);
}

TEST_F(Int32PatchGpuTest, RangesOutsideDstOrPatchAreSkippedLikeTheHostTwin) {
  // The launcher rejects these for host patches; the kernel must skip them like the twin.
  std::vector<int32_t> patch{
      -2, 4,  12,  // starts before dst: the first two writes are skipped
      30, 5,  16,  // runs past the end of dst (32 entries)
      10, 3,  40,  // values beyond the patch: skipped
      20, -1, 12,  // negative count: nothing
  };
  for (int32_t v = 0; v < 9; ++v) {
    patch.push_back(1000 + v);
  }
  MirroredBytes dst(std::vector<uint8_t>(32 * 4, 0));
  MirroredInt32 const p(patch);
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    kernels::detail::Int32PatchLaunch launch{};
    launch.dst = reinterpret_cast<int32_t*>(dst.on(device));
    launch.patch = p.on(device).dataPointer<int32_t>();
    launch.dstNumel = 32;
    launch.patchNumel = static_cast<int64_t>(patch.size());
    launch.numRanges = 4;
    if (device == DeviceType::kCPU) {
      kernels::detail::applyInt32PatchHost(launch);
    } else {
      cudaOk(kernels::detail::applyInt32PatchCuda(launch, stream()), "applyInt32PatchCuda");
    }
  }
  synchronize();
  EXPECT_TRUE(sameBytes(dst));
  std::vector<uint8_t> const bytes = dst.gpuBytes();
  std::vector<int32_t> values(32);
  std::memcpy(values.data(), bytes.data(), bytes.size());
  EXPECT_EQ(values[0], 1002);
  EXPECT_EQ(values[1], 1003);
  EXPECT_EQ(values[30], 1004);
  EXPECT_EQ(values[31], 1005);
  EXPECT_EQ(values[10], 0);
}

TEST_F(Int32PatchGpuTest, InlinePatchesMatchHostTwin) {
  // Patches up to the inline limit: many one-entry ranges, a few longer ones, a full one.
  for (std::vector<int32_t> const& counts :
       {std::vector<int32_t>(200, 1), std::vector<int32_t>{0, 17, 300, 2, 0, 41},
        std::vector<int32_t>{kernels::kMaxInlinePatchValues - 3}}) {
    int32_t const dstNumel = 4096;
    std::vector<int32_t> const patch = makePatch(counts, dstNumel);
    ASSERT_LE(patch.size(), static_cast<std::size_t>(kernels::kMaxInlinePatchValues));
    std::vector<uint8_t> const initial = test::randomBytes(dstNumel * 4, mRng);
    MirroredBytes dst(initial);
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      Tensor d = Tensor::view(dst.on(device), {dstNumel}, DataType::kInt32, device);
      kernels::applyInt32InlinePatch(d, patch, static_cast<int32_t>(counts.size()),
                                     device == DeviceType::kGPU ? stream() : nullptr);
    }
    synchronize();
    EXPECT_TRUE(sameBytes(dst));
    EXPECT_NE(dst.gpuBytes(), initial);
  }
}

}  // namespace
}  // namespace mkv::gputest
