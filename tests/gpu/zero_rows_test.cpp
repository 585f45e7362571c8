/// zeroRows on the GPU against its host twin: several buffers of different widths in one
/// launch, skipped and repeated rows, odd widths and out-of-range rows.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "gpu/gpu_parity.h"
#include "kernel_params.h"
#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv::gputest {
namespace {

using kernels::RowBuffer;

class ZeroRowsGpuTest : public GpuTest {
 protected:
  void zeroAndCheck(std::vector<int64_t> const& widths, std::vector<int64_t> const& numRows,
                    std::vector<int32_t> const& rows) {
    std::vector<MirroredBytes> buffers;
    for (std::size_t b = 0; b < widths.size(); ++b) {
      buffers.emplace_back(
          test::randomBytes(static_cast<std::size_t>(widths[b] * numRows[b]), mRng));
    }
    MirroredInt32 const r(rows);
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      std::vector<RowBuffer> list;
      for (std::size_t b = 0; b < buffers.size(); ++b) {
        list.push_back(RowBuffer{buffers[b].on(device), widths[b], numRows[b]});
      }
      kernels::zeroRows(list, device, r.on(device),
                        device == DeviceType::kGPU ? stream() : nullptr);
    }
    synchronize();
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      SCOPED_TRACE(::testing::Message() << "buffer " << b << " of " << widths[b] << " B rows");
      EXPECT_TRUE(sameBytes(buffers[b]));
      std::vector<uint8_t> const result = buffers[b].gpuBytes();
      for (int32_t row : rows) {
        if (row < 0) {
          continue;
        }
        for (int64_t i = row * widths[b]; i < (row + 1) * widths[b]; ++i) {
          ASSERT_EQ(result[static_cast<std::size_t>(i)], 0) << "row " << row;
        }
      }
    }
  }

  std::mt19937_64 mRng{99};
};

TEST_F(ZeroRowsGpuTest, AlignedBuffersMatchHostTwin) {
  std::vector<int32_t> rows = distinctIds(10, 16, mRng);
  rows[2] = -1;
  rows[5] = rows[4];  // zeroing a row twice is harmless
  zeroAndCheck({16, 2048, 8192, 65536 + 2048}, {16, 16, 20, 16}, rows);
}

TEST_F(ZeroRowsGpuTest, OddWidthsMatchHostTwin) {
  std::vector<int32_t> rows = distinctIds(7, 12, mRng);
  rows[0] = -1;
  zeroAndCheck({1, 3, 100, 2049}, {12, 12, 12, 12}, rows);
}

TEST_F(ZeroRowsGpuTest, OutOfRangeRowsAreSkippedLikeTheHostTwin) {
  MirroredBytes a(test::randomBytes(4 * 64, mRng));
  MirroredBytes b(test::randomBytes(2 * 64, mRng));
  MirroredInt32 const rows(std::vector<int32_t>{3, 1, -7, 4});
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    kernels::detail::ZeroRowsLaunch launch{};
    launch.buffers[0] = {a.on(device), 64};
    launch.buffers[1] = {b.on(device), 64};
    launch.numRows[0] = 4;
    launch.numRows[1] = 2;  // row 3 is outside the second buffer
    launch.rows = rows.on(device).dataPointer<int32_t>();
    launch.numBuffers = 2;
    launch.numItems = 4;
    if (device == DeviceType::kCPU) {
      kernels::detail::zeroRowsHost(launch);
    } else {
      cudaOk(kernels::detail::zeroRowsCuda(launch, stream()), "zeroRowsCuda");
    }
  }
  synchronize();
  EXPECT_TRUE(sameBytes(a));
  EXPECT_TRUE(sameBytes(b));
}

}  // namespace
}  // namespace mkv::gputest
