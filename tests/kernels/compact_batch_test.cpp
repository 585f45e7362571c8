#include <gtest/gtest.h>

#include <fmt/format.h>

#include <random>
#include <string>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

/// One per-slot buffer `[rows, rowBytes]` (uint8) and the bytes it should hold.
struct Rows {
  Rows(int64_t rows, int64_t rowBytes, DeviceType device, std::mt19937_64& rng)
      : tensor({rows, rowBytes}, DataType::kUInt8, device), width(rowBytes) {
    expected = test::fillRandom(tensor, rng);
  }
  kernels::RowBuffer buffer() { return {tensor.rawPointer(), width, tensor.dim(0)}; }

  Tensor tensor;
  int64_t width;
  std::vector<uint8_t> expected;
};

/// Out-of-place model: row mapping[i] of the result = old row i for destinations in
/// [0, newBatch); every other row keeps its old bytes.
void modelCompact(Rows& rows, std::vector<int32_t> const& mapping, int32_t newBatch) {
  std::vector<uint8_t> const old = rows.expected;
  auto const width = static_cast<std::size_t>(rows.width);
  for (std::size_t i = 0; i < mapping.size(); ++i) {
    if (mapping[i] >= 0 && mapping[i] < newBatch) {
      std::copy_n(
          old.begin() + static_cast<long>(i * width), width,
          rows.expected.begin() + static_cast<long>(static_cast<std::size_t>(mapping[i]) * width));
    }
  }
}

/// compactBatch's workspace for `rows` rows of buffers of these widths on `device`: sized with
/// compactBatchWorkspaceBytes on the GPU, empty on the host (which ignores it).
Tensor workspaceFor(std::vector<int64_t> const& rowBytes, int64_t rows, DeviceType device) {
  if (device != DeviceType::kGPU) {
    return Tensor();
  }
  return Tensor(
      {kernels::compactBatchWorkspaceBytes(rows, rowBytes) / static_cast<int64_t>(sizeof(int32_t))},
      DataType::kInt32, device);
}

class CompactBatchTest : public test::DeviceTest {
 protected:
  /// Compacts every buffer with one call and checks each against the model.
  void compactAndCheck(std::vector<Rows>& buffers, std::vector<int32_t> const& mapping,
                       int32_t newBatch) {
    std::vector<kernels::RowBuffer> descriptors;
    std::vector<int64_t> widths;
    for (Rows& rows : buffers) {
      descriptors.push_back(rows.buffer());
      widths.push_back(rows.width);
      modelCompact(rows, mapping, newBatch);
    }
    Tensor const oldToNew = test::int32Tensor(mapping, device());
    Tensor workspace = workspaceFor(widths, static_cast<int64_t>(mapping.size()), device());
    kernels::compactBatch(descriptors, device(), oldToNew, newBatch, workspace, nullptr);
    for (std::size_t b = 0; b < buffers.size(); ++b) {
      EXPECT_EQ(test::readBytes(buffers[b].tensor), buffers[b].expected)
          << "buffer " << b << " of row width " << buffers[b].width;
    }
  }
};

TEST_P(CompactBatchTest, DropsTheFirstRowAndShiftsOverlappingSurvivors) {
  std::mt19937_64 rng(1);
  std::vector<Rows> buffers;
  buffers.emplace_back(4, 4, device(), rng);
  std::vector<uint8_t> const old = buffers[0].expected;
  compactAndCheck(buffers, {-1, 0, 1, 2}, 3);
  // Pin the semantics independently of the model: row k now holds old row k + 1.
  std::vector<uint8_t> const now = test::readBytes(buffers[0].tensor);
  EXPECT_TRUE(std::equal(now.begin(), now.begin() + 12, old.begin() + 4));
}

TEST_P(CompactBatchTest, DropsMiddleRows) {
  std::mt19937_64 rng(2);
  std::vector<Rows> buffers;
  buffers.emplace_back(4, 8, device(), rng);
  std::vector<uint8_t> const old = buffers[0].expected;
  compactAndCheck(buffers, {0, -1, -1, 1}, 2);
  std::vector<uint8_t> const now = test::readBytes(buffers[0].tensor);
  EXPECT_TRUE(std::equal(now.begin(), now.begin() + 8, old.begin()));
  EXPECT_TRUE(std::equal(now.begin() + 8, now.begin() + 16, old.begin() + 24));
}

TEST_P(CompactBatchTest, CompactsBuffersOfDifferentRowWidthsInOneCall) {
  std::mt19937_64 rng(3);
  std::vector<Rows> buffers;
  for (int64_t width : {4, 12, 1, 40, 4096, 7}) {
    buffers.emplace_back(6, width, device(), rng);
  }
  compactAndCheck(buffers, {-1, 0, -1, 1, 2, -1}, 3);
}

TEST_P(CompactBatchTest, BuffersMayHoldMoreRowsThanTheOldBatch) {
  std::mt19937_64 rng(4);
  std::vector<Rows> buffers;
  buffers.emplace_back(10, 16, device(), rng);  // capacity 10, batch 5
  compactAndCheck(buffers, {-1, -1, 0, 1, 2}, 3);
}

TEST_P(CompactBatchTest, IgnoresDestinationsOutsideTheNewBatch) {
  std::mt19937_64 rng(5);
  std::vector<Rows> buffers;
  buffers.emplace_back(4, 8, device(), rng);
  std::vector<uint8_t> const old = buffers[0].expected;
  compactAndCheck(buffers, {-1, 0, 1, 2}, 2);  // old row 3 would go to 2: ignored
  std::vector<uint8_t> const now = test::readBytes(buffers[0].tensor);
  EXPECT_TRUE(std::equal(now.begin() + 16, now.end(), old.begin() + 16));
}

TEST_P(CompactBatchTest, IdentityAndEmptyMappingsLeaveRowsAlone) {
  std::mt19937_64 rng(6);
  std::vector<Rows> buffers;
  buffers.emplace_back(3, 8, device(), rng);
  std::vector<uint8_t> const old = buffers[0].expected;
  compactAndCheck(buffers, {0, 1, 2}, 3);
  compactAndCheck(buffers, {}, 0);
  EXPECT_EQ(test::readBytes(buffers[0].tensor), old);
}

TEST_P(CompactBatchTest, RandomOrderPreservingMappingsMatchTheModel) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 150; ++round) {
    int32_t const oldBatch = std::uniform_int_distribution<int32_t>(1, 24)(rng);
    std::vector<int32_t> mapping(static_cast<std::size_t>(oldBatch), -1);
    int32_t survivors = 0;
    for (int32_t& destination : mapping) {
      if (rng() % 3 != 0) {
        destination = survivors++;
      }
    }
    // Usually the new batch is the survivor count; sometimes smaller (later survivors ignored).
    int32_t const newBatch =
        rng() % 4 == 0 ? std::uniform_int_distribution<int32_t>(0, survivors)(rng) : survivors;
    std::vector<Rows> buffers;
    int const count = static_cast<int>(rng() % 4) + 1;
    for (int b = 0; b < count; ++b) {
      int64_t const width = std::uniform_int_distribution<int64_t>(1, 300)(rng);
      buffers.emplace_back(oldBatch + static_cast<int64_t>(rng() % 3), width, device(), rng);
    }
    compactAndCheck(buffers, mapping, newBatch);
    if (HasFailure()) {
      return;
    }
  }
}

TEST_P(CompactBatchTest, RejectsInvalidBuffersAndSizes) {
  std::mt19937_64 rng(8);
  Rows rows(4, 8, device(), rng);
  Tensor const mapping = test::int32Tensor({0, 1, 2, 3}, device());
  Tensor workspace = workspaceFor({8}, 4, device());
  auto compact = [&](std::vector<kernels::RowBuffer> const& buffers, int32_t newBatch) {
    kernels::compactBatch(buffers, device(), mapping, newBatch, workspace, nullptr);
  };
  std::vector<kernels::RowBuffer> tooFew{{rows.tensor.rawPointer(), 8, 3}};
  EXPECT_TRUE(
      throwsError([&] { compact(tooFew, 4); }, {"compactBatch", "buffer 0 has 3 rows, needs 4"}));
  std::vector<kernels::RowBuffer> zeroWidth{{rows.tensor.rawPointer(), 0, 4}};
  EXPECT_TRUE(throwsError([&] { compact(zeroWidth, 4); }, {"compactBatch", "rowBytes 0"}));
  std::vector<kernels::RowBuffer> null{{nullptr, 8, 4}};
  EXPECT_TRUE(throwsError([&] { compact(null, 4); }, {"compactBatch", "buffer 0 has no data"}));
  std::vector<kernels::RowBuffer> tooMany(static_cast<std::size_t>(kernels::kMaxRowBuffers) + 1,
                                          rows.buffer());
  EXPECT_TRUE(throwsError([&] { compact(tooMany, 4); }, {"compactBatch", "257 buffers"}));
  std::vector<kernels::RowBuffer> ok{rows.buffer()};
  EXPECT_TRUE(
      throwsError([&] { compact(ok, 5); }, {"compactBatch", "newBatchSize 5 is outside [0, 4]"}));
  EXPECT_EQ(test::readBytes(rows.tensor), rows.expected);
}

// The GPU path orders its CTAs through the workspace, so it checks it before launching.
TEST_P(CompactBatchTest, RejectsAWorkspaceTooSmallOrOfTheWrongKindOnTheGpu) {
  if (device() == DeviceType::kCPU) {
    GTEST_SKIP() << "the host path ignores the workspace (CompactBatchHostTest)";
  }
  std::mt19937_64 rng(11);
  Rows rows(4, 8, device(), rng);
  Tensor const mapping = test::int32Tensor({-1, 0, 1, 2}, device());
  std::vector<kernels::RowBuffer> const buffers{rows.buffer()};
  int64_t const needed = kernels::compactBatchWorkspaceBytes(4, std::vector<int64_t>{8});
  auto compact = [&](Tensor& workspace) {
    kernels::compactBatch(buffers, device(), mapping, 3, workspace, nullptr);
  };
  Tensor small({needed / 4 - 1}, DataType::kInt32, DeviceType::kGPU);
  std::string const tooSmall =
      fmt::format("workspace has {} bytes, needs {} for 4 rows of 1 buffers", needed - 4, needed);
  EXPECT_TRUE(throwsError([&] { compact(small); }, {"compactBatch", tooSmall}));
  Tensor bytes({needed}, DataType::kUInt8, DeviceType::kGPU);
  EXPECT_TRUE(throwsError([&] { compact(bytes); },
                          {"compactBatch", "workspace must be int32 on gpu, got uint8 on gpu"}));
  Tensor host({needed / 4}, DataType::kInt32, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { compact(host); },
                          {"compactBatch", "workspace must be int32 on gpu, got int32 on cpu"}));
  Tensor none;
  EXPECT_TRUE(throwsError([&] { compact(none); }, {"compactBatch", "workspace must be int32"}));
  EXPECT_EQ(test::readBytes(rows.tensor), rows.expected);
}

INSTANTIATE_TEST_SUITE_P(Devices, CompactBatchTest, test::allDeviceTypes(), test::deviceName);

// The order-preservation check reads the mapping, so it exists for host mappings only.
TEST(CompactBatchHostTest, RejectsMappingsThatAreNotOrderPreservingWithoutMoving) {
  std::mt19937_64 rng(9);
  Rows rows(4, 8, DeviceType::kCPU, rng);
  std::vector<kernels::RowBuffer> const buffers{rows.buffer()};
  struct Case {
    std::vector<int32_t> mapping;
    int32_t newBatch;
    char const* fragment;
  };
  for (Case const& c : {Case{{1, 0, -1, -1}, 2, "oldToNew[0] = 1, expected 0"},
                        Case{{0, 0, -1, -1}, 2, "oldToNew[1] = 0, expected 1"},
                        Case{{-1, 1, 0, -1}, 2, "oldToNew[1] = 1, expected 0"},
                        Case{{0, 2, -1, -1}, 3, "oldToNew[1] = 2, expected 1"},
                        Case{{0, -2, 1, -1}, 2, "oldToNew[1] = -2 is below -1"}}) {
    Tensor const mapping = test::int32Tensor(c.mapping, DeviceType::kCPU);
    Tensor none;
    EXPECT_TRUE(throwsError(
        [&] {
          kernels::compactBatch(buffers, DeviceType::kCPU, mapping, c.newBatch, none, nullptr);
        },
        {"compactBatch", c.fragment}));
    EXPECT_EQ(test::readBytes(rows.tensor), rows.expected);
  }
}

TEST(CompactBatchHostTest, RejectsAMappingOnTheWrongDevice) {
  std::mt19937_64 rng(10);
  Rows rows(2, 8, DeviceType::kCPU, rng);
  std::vector<kernels::RowBuffer> const buffers{rows.buffer()};
  Tensor const mapping = test::int32Tensor({0, 1}, DeviceType::kCPU);
  Tensor none;
  EXPECT_TRUE(throwsError(
      [&] { kernels::compactBatch(buffers, DeviceType::kGPU, mapping, 2, none, nullptr); },
      {"compactBatch", "oldToNew is on cpu but the data is on gpu"}));
}

TEST(CompactBatchHostTest, IgnoresTheWorkspace) {
  std::mt19937_64 rng(12);
  Rows rows(3, 8, DeviceType::kCPU, rng);
  std::vector<uint8_t> const old = rows.expected;
  std::vector<kernels::RowBuffer> const buffers{rows.buffer()};
  Tensor const mapping = test::int32Tensor({-1, 0, 1}, DeviceType::kCPU);
  Tensor none;
  kernels::compactBatch(buffers, DeviceType::kCPU, mapping, 2, none, nullptr);
  std::vector<uint8_t> const now = test::readBytes(rows.tensor);
  EXPECT_TRUE(std::equal(now.begin(), now.begin() + 16, old.begin() + 8));
}

TEST(CompactBatchWorkspaceTest, HasAHeaderAndAShareOfEveryBuffersRows) {
  using kernels::compactBatchWorkspaceBytes;
  std::vector<int64_t> const lengths{4};
  EXPECT_EQ(compactBatchWorkspaceBytes(0, lengths), 16) << "the header alone";
  EXPECT_EQ(compactBatchWorkspaceBytes(1000, std::vector<int64_t>{}), 16);
  // Wide rows: one flag per 2 KiB of a row (the tile at byte width), i.e. 1/512 of the rows.
  for (int64_t const rows : {1, 7, 32768}) {
    for (int64_t const width : {2048, 65536}) {
      EXPECT_EQ(compactBatchWorkspaceBytes(rows, std::vector<int64_t>{width}),
                16 + rows * width / 512)
          << rows << " rows of " << width << " B";
    }
  }
  // Shares of several buffers add up, and never shrink as rows grow.
  std::vector<int64_t> const widths{4, 100, 2050, 65536};
  int64_t previous = 0;
  for (int64_t rows = 0; rows <= 5000; rows += 250) {
    int64_t sum = 16;
    for (int64_t width : widths) {
      sum += compactBatchWorkspaceBytes(rows, std::vector<int64_t>{width}) - 16;
    }
    int64_t const bytes = compactBatchWorkspaceBytes(rows, widths);
    EXPECT_EQ(bytes, sum) << rows << " rows";
    EXPECT_GE(bytes, previous) << rows << " rows";
    // At most 1/512 of the rows at their width rounded up to a power of two (4, 128, 4096,
    // 65536), plus one flag per buffer for a partial tile.
    int64_t const bound = 16 + 4 * 4 + rows * (4 + 128 + 4096 + 65536) / 512;
    EXPECT_LE(bytes, bound) << rows << " rows";
    previous = bytes;
  }
}

TEST(CompactBatchWorkspaceTest, RejectsBadSizesAndMoreThanTheUnitLimit) {
  using kernels::compactBatchWorkspaceBytes;
  EXPECT_TRUE(throwsError([] { (void)compactBatchWorkspaceBytes(-1, std::vector<int64_t>{4}); },
                          {"compactBatchWorkspaceBytes", "maxOldBatch -1 is negative"}));
  EXPECT_TRUE(throwsError(
      [] {
        (void)compactBatchWorkspaceBytes(4, std::vector<int64_t>{8, 0});
      },
      {"compactBatchWorkspaceBytes", "buffer 1 has rowBytes 0"}));
  std::vector<int64_t> const tooMany(static_cast<std::size_t>(kernels::kMaxRowBuffers) + 1, 4);
  EXPECT_TRUE(throwsError([&] { (void)compactBatchWorkspaceBytes(4, tooMany); },
                          {"compactBatchWorkspaceBytes", "257 buffers"}));
  // 2^31 rows of 1 MiB: 2^40 work units.
  EXPECT_TRUE(throwsError(
      [] { (void)compactBatchWorkspaceBytes(int64_t{1} << 31, std::vector<int64_t>{1 << 20}); },
      {"compactBatchWorkspaceBytes", "work units, more than the limit of 2147483647"}));
}

}  // namespace
}  // namespace mkv
