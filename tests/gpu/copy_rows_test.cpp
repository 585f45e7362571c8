/// copyRows and the launchers built on it (captureHiddenRows, restoreHiddenRows,
/// gatherPageTableRows) on the GPU against their host twins: several pairs of different widths
/// in one launch, skipped and duplicate ids, odd widths, page-table rows for empty slots.
#include <gtest/gtest.h>

#include <ostream>
#include <random>
#include <vector>

#include "gpu/gpu_parity.h"
#include "kernel_params.h"
#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv::gputest {
namespace {

using kernels::RowBuffer;
using kernels::RowBufferPair;

class CopyRowsGpuTest : public GpuTest, public ::testing::WithParamInterface<std::vector<int64_t>> {
 protected:
  std::mt19937_64 mRng{31};
};

TEST_P(CopyRowsGpuTest, PairsOfDifferentWidthsMatchHostTwin) {
  std::vector<int64_t> const& widths = GetParam();
  int32_t const srcRows = 40;
  int32_t const dstRows = 24;
  int32_t const n = 20;
  std::vector<MirroredBytes> src;
  std::vector<MirroredBytes> dst;
  for (int64_t width : widths) {
    src.emplace_back(test::randomBytes(static_cast<std::size_t>(width * srcRows), mRng));
    dst.emplace_back(std::vector<uint8_t>(static_cast<std::size_t>(width * dstRows), kPoison));
  }
  std::vector<int32_t> srcIds(static_cast<std::size_t>(n));
  std::uniform_int_distribution<int32_t> anyRow(0, srcRows - 1);
  for (int32_t& id : srcIds) {
    id = anyRow(mRng);  // duplicates allowed
  }
  srcIds[1] = srcIds[0];
  std::vector<int32_t> dstIds = distinctIds(n, dstRows, mRng);
  dropSome(srcIds, 0.2, mRng);
  dropSome(dstIds, 0.2, mRng);
  MirroredInt32 const s(srcIds);
  MirroredInt32 const d(dstIds);
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    std::vector<RowBufferPair> pairs;
    for (std::size_t b = 0; b < widths.size(); ++b) {
      pairs.push_back({RowBuffer{src[b].on(device), widths[b], srcRows},
                       RowBuffer{dst[b].on(device), widths[b], dstRows}});
    }
    kernels::copyRows(pairs, device, s.on(device), d.on(device),
                      device == DeviceType::kGPU ? stream() : nullptr);
  }
  synchronize();
  for (std::size_t b = 0; b < widths.size(); ++b) {
    SCOPED_TRACE(::testing::Message() << "pair " << b << " of " << widths[b] << " B rows");
    EXPECT_TRUE(sameBytes(dst[b]));
    EXPECT_TRUE(sameBytes(src[b]));
    std::vector<ByteRange> written;
    for (std::size_t i = 0; i < srcIds.size(); ++i) {
      if (srcIds[i] >= 0 && dstIds[i] >= 0) {
        written.push_back({dstIds[i] * widths[b], (dstIds[i] + 1) * widths[b]});
      }
    }
    EXPECT_TRUE(untouchedOutside(dst[b].gpuBytes(), written, kPoison));
  }
}

INSTANTIATE_TEST_SUITE_P(Widths, CopyRowsGpuTest,
                         ::testing::Values(std::vector<int64_t>{16, 2048, 8192, 65536},
                                           std::vector<int64_t>{2048 + 8, 4096 + 4},
                                           std::vector<int64_t>{8192, 4, 2048 + 16, 100, 1},
                                           std::vector<int64_t>{6146}));

class RowLaunchersGpuTest : public GpuTest {
 protected:
  std::mt19937_64 mRng{57};
};

TEST_F(RowLaunchersGpuTest, OutOfRangeRowsAreSkippedOrFilledLikeTheHostTwin) {
  for (int32_t const fill : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << "fillSkipped " << fill);
    MirroredBytes src(test::randomBytes(8 * 96, mRng));
    MirroredBytes dst(std::vector<uint8_t>(6 * 96, 0x5A));
    MirroredInt32 const s(std::vector<int32_t>{0, 8, -4, 3, 5, 7});
    MirroredInt32 const d(std::vector<int32_t>{0, 1, 2, 6, -9, 5});
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      kernels::detail::CopyRowsLaunch launch{};
      launch.buffers[0] = {src.on(device), dst.on(device), 96, 8, 6};
      launch.srcRows = s.on(device).dataPointer<int32_t>();
      launch.dstRows = d.on(device).dataPointer<int32_t>();
      launch.numBuffers = 1;
      launch.numItems = 6;
      launch.fillSkipped = fill;
      if (device == DeviceType::kCPU) {
        kernels::detail::copyRowsHost(launch);
      } else {
        cudaOk(kernels::detail::copyRowsCuda(launch, stream()), "copyRowsCuda");
      }
    }
    synchronize();
    EXPECT_TRUE(sameBytes(dst));
  }
}

TEST_F(RowLaunchersGpuTest, HiddenRowCaptureAndRestoreMatchHostTwin) {
  for (int64_t const width : {int64_t{4096}, int64_t{3}}) {  // 8 KiB bf16 rows, and 6-byte rows
    SCOPED_TRACE(::testing::Message() << "width " << width);
    int64_t const tokens = 50;
    int64_t const slots = 16;
    MirroredBytes hidden(test::randomBytes(static_cast<std::size_t>(tokens * width * 2), mRng));
    MirroredBytes slab(std::vector<uint8_t>(static_cast<std::size_t>(slots * width * 2), kPoison));
    std::vector<int32_t> rows = distinctIds(12, static_cast<int32_t>(tokens), mRng);
    std::vector<int32_t> slotIds = distinctIds(12, static_cast<int32_t>(slots), mRng);
    dropSome(rows, 0.2, mRng);
    MirroredInt32 const r(rows);
    MirroredInt32 const sl(slotIds);
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      Tensor const h =
          Tensor::view(hidden.on(device), {tokens, width}, DataType::kBFloat16, device);
      Tensor s = Tensor::view(slab.on(device), {slots, width}, DataType::kBFloat16, device);
      kernels::captureHiddenRows(h, r.on(device), s, sl.on(device),
                                 device == DeviceType::kGPU ? stream() : nullptr);
    }
    synchronize();
    EXPECT_TRUE(sameBytes(slab));

    // Restore into a poisoned hidden tensor, with the roles of the id lists swapped.
    hidden.reset(std::vector<uint8_t>(static_cast<std::size_t>(tokens * width * 2), kPoison));
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      Tensor const s = Tensor::view(slab.on(device), {slots, width}, DataType::kBFloat16, device);
      Tensor h = Tensor::view(hidden.on(device), {tokens, width}, DataType::kBFloat16, device);
      kernels::restoreHiddenRows(s, sl.on(device), h, r.on(device),
                                 device == DeviceType::kGPU ? stream() : nullptr);
    }
    synchronize();
    EXPECT_TRUE(sameBytes(hidden));
  }
}

TEST_F(RowLaunchersGpuTest, PageTableGatherFillsEmptySlotsWithMinusOne) {
  int64_t const maxBatch = 24;
  int64_t const maxPages = 300;  // 2400-byte rows: two warp units, a ragged second one
  int64_t const rowInts = 2 * maxPages;
  int64_t const capacityRows = 32;
  MirroredBytes table(test::randomBytes(static_cast<std::size_t>(maxBatch * rowInts * 4), mRng));
  MirroredBytes out(
      std::vector<uint8_t>(static_cast<std::size_t>(capacityRows * rowInts * 4), 0x33));
  std::vector<int32_t> slots = distinctIds(20, static_cast<int32_t>(maxBatch), mRng);
  slots[3] = -1;
  slots[19] = -1;
  slots[7] = slots[6];  // one resident may appear twice
  MirroredInt32 const s(slots);
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    Tensor const t =
        Tensor::view(table.on(device), {maxBatch, 2, maxPages}, DataType::kInt32, device);
    Tensor dst =
        Tensor::view(out.on(device), {capacityRows, 2, maxPages}, DataType::kInt32, device);
    kernels::gatherPageTableRows(t, s.on(device), dst,
                                 device == DeviceType::kGPU ? stream() : nullptr);
    EXPECT_EQ(dst.dim(0), 20);
  }
  synchronize();
  EXPECT_TRUE(sameBytes(out));
  std::vector<uint8_t> const result = out.gpuBytes();
  auto const rowBytes = static_cast<std::size_t>(rowInts * 4);
  for (std::size_t b = 3 * rowBytes; b < 4 * rowBytes; ++b) {
    ASSERT_EQ(result[b], 0xFF) << "an empty slot yields a row of -1";
  }
  for (std::size_t b = 20 * rowBytes; b < result.size(); ++b) {
    ASSERT_EQ(result[b], 0x33) << "rows beyond n stay untouched";
  }
}

}  // namespace
}  // namespace mkv::gputest
