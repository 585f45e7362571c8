/// compactBatch on the GPU against its host twin and against the intended result ("new row d
/// holds old row i"), in place with overlapping rows: random order-preserving mappings, a
/// shift of every row by one, survivors beyond newBatchSize, several buffers of different
/// widths in one launch, rows spanning several sweep windows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <ostream>
#include <random>
#include <vector>

#include "gpu/gpu_parity.h"
#include "mkv/kernels.h"
#include "test_util.h"

namespace mkv::gputest {
namespace {

using kernels::RowBuffer;

struct CompactCase {
  int32_t oldBatch;
  double keep;            // survival probability of each row
  int32_t cut;            // newBatchSize = survivors - cut (survivors beyond it are ignored)
  std::vector<int64_t> rowBytes;
};

void PrintTo(CompactCase const& c, std::ostream* os) {
  *os << c.oldBatch << " rows, keep " << c.keep << ", cut " << c.cut << ", widths";
  for (int64_t w : c.rowBytes) {
    *os << ' ' << w;
  }
}

class CompactBatchInPlaceTest : public GpuTest {
 protected:
  /// Compacts buffers of the given widths with `oldToNew` on both devices and checks parity
  /// and the intended result.
  void compactAndCheck(std::vector<int64_t> const& rowBytes, int32_t oldBatch,
                       std::vector<int32_t> const& oldToNew, int32_t newBatch) {
    std::vector<std::vector<uint8_t>> original;
    std::vector<MirroredBytes> buffers;
    for (int64_t width : rowBytes) {
      original.push_back(test::randomBytes(static_cast<std::size_t>(width * oldBatch), mRng));
      buffers.emplace_back(original.back());
    }
    MirroredInt32 const mapping(oldToNew);
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      std::vector<RowBuffer> rows;
      for (std::size_t b = 0; b < buffers.size(); ++b) {
        rows.push_back(RowBuffer{buffers[b].on(device), rowBytes[b], oldBatch});
      }
      kernels::compactBatch(rows, device, mapping.on(device), newBatch,
                            device == DeviceType::kGPU ? stream() : nullptr);
    }
    synchronize();
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      SCOPED_TRACE(::testing::Message() << "buffer " << b << " of " << rowBytes[b] << " B rows");
      EXPECT_TRUE(sameBytes(buffers[b]));
      std::vector<uint8_t> expected = original[b];
      auto const width = static_cast<std::size_t>(rowBytes[b]);
      for (int32_t i = 0; i < oldBatch; ++i) {
        int32_t const d = oldToNew[static_cast<std::size_t>(i)];
        if (d >= 0 && d < newBatch) {
          std::memcpy(expected.data() + static_cast<std::size_t>(d) * width,
                      original[b].data() + static_cast<std::size_t>(i) * width, width);
        }
      }
      EXPECT_TRUE(expected == buffers[b].gpuBytes()) << "new row d must hold old row i";
    }
  }

  std::mt19937_64 mRng{1202};
};

class CompactBatchGpuTest : public CompactBatchInPlaceTest,
                            public ::testing::WithParamInterface<CompactCase> {};

TEST_P(CompactBatchGpuTest, RandomOrderPreservingMappingsMatchHostTwin) {
  CompactCase const& c = GetParam();
  for (int trial = 0; trial < 3; ++trial) {
    SCOPED_TRACE(::testing::Message() << "trial " << trial);
    std::vector<int32_t> oldToNew;
    int32_t const survivors = orderPreservingMapping(oldToNew, c.oldBatch, c.keep, mRng);
    compactAndCheck(c.rowBytes, c.oldBatch, oldToNew, std::max(0, survivors - c.cut));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Mappings, CompactBatchGpuTest,
    ::testing::Values(CompactCase{1, 1.0, 0, {4, 2048}},
                      CompactCase{7, 0.5, 0, {4, 16, 2048}},
                      CompactCase{256, 0.5, 0, {4, 8, 2048, 8192}},           // KV lengths + state rows
                      CompactCase{256, 0.5, 0, {65536, 4}},                   // wide rows: many chunks
                      CompactCase{256, 0.0, 0, {4, 2048}},                    // everything dropped
                      CompactCase{256, 1.0, 0, {4, 2048}},                    // identity: nothing moves
                      CompactCase{300, 0.5, 0, {1, 4, 100, 2050, 17}},        // odd widths: byte path
                      CompactCase{2000, 0.6, 25, {4, 2048}},                  // survivors beyond newBatch
                      CompactCase{5000, 0.3, 0, {4, 2048}},                   // several sweep windows
                      CompactCase{10000, 0.9, 0, {4, 96}}));                  // many windows of small rows

TEST_F(CompactBatchInPlaceTest, DroppingTheFirstRowShiftsEveryRowByOne) {
  // Row i -> i - 1 for every i >= 1: each destination is the source of the next move, the
  // worst overlap for an in-place kernel (cf. vLLM #50729).
  for (int32_t const oldBatch : {2, 1025, 4097, 10000}) {
    SCOPED_TRACE(::testing::Message() << oldBatch << " rows");
    std::vector<int32_t> oldToNew(static_cast<std::size_t>(oldBatch));
    for (int32_t i = 0; i < oldBatch; ++i) {
      oldToNew[static_cast<std::size_t>(i)] = i - 1;
    }
    compactAndCheck({4, 64, 2048}, oldBatch, oldToNew, oldBatch - 1);
  }
}

TEST_F(CompactBatchInPlaceTest, EveryBufferSlotInOneLaunch) {
  std::vector<int64_t> widths;
  for (int32_t b = 0; b < kernels::kMaxRowBuffers; ++b) {
    widths.push_back(16 * (1 + b % 5));
  }
  std::vector<int32_t> oldToNew;
  int32_t const survivors = orderPreservingMapping(oldToNew, 64, 0.5, mRng);
  compactAndCheck(widths, 64, oldToNew, survivors);
}

}  // namespace
}  // namespace mkv::gputest
