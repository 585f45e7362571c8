#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

/// A patch image: numRanges (offset, count, valueStart) triples, then the values.
struct Patch {
  std::vector<std::pair<int32_t, std::vector<int32_t>>> ranges;

  void add(int32_t offset, std::vector<int32_t> const& rangeValues) {
    ranges.emplace_back(offset, rangeValues);
  }
  std::vector<int32_t> image() const {
    std::vector<int32_t> out;
    auto const headerSize = static_cast<int32_t>(3 * ranges.size());
    int32_t cursor = headerSize;
    for (auto const& [offset, rangeValues] : ranges) {
      out.insert(out.end(), {offset, static_cast<int32_t>(rangeValues.size()), cursor});
      cursor += static_cast<int32_t>(rangeValues.size());
    }
    for (auto const& range : ranges) {
      out.insert(out.end(), range.second.begin(), range.second.end());
    }
    return out;
  }
  void applyTo(std::vector<int32_t>& model) const {
    for (auto const& [offset, rangeValues] : ranges) {
      std::copy(rangeValues.begin(), rangeValues.end(), model.begin() + offset);
    }
  }
};

class ApplyInt32PatchTest : public test::DeviceTest {};

TEST_P(ApplyInt32PatchTest, WritesEveryRangeAndNothingElse) {
  std::vector<int32_t> model(20, -1);
  Tensor dst = test::int32Tensor(model, device());
  Patch patch;
  patch.add(2, {7, 8, 9});
  patch.add(10, {42});
  patch.add(15, {1, 2, 3, 4, 5});
  patch.applyTo(model);
  Tensor const image = test::int32Tensor(patch.image(), device());
  kernels::applyInt32Patch(dst, image, 3, nullptr);
  EXPECT_EQ(test::readAs<int32_t>(dst), model);
}

TEST_P(ApplyInt32PatchTest, ZeroRangesChangeNothing) {
  std::vector<int32_t> const model{1, 2, 3};
  Tensor dst = test::int32Tensor(model, device());
  Tensor const image = test::int32Tensor({0, 3, 3}, device());
  kernels::applyInt32Patch(dst, image, 0, nullptr);
  EXPECT_EQ(test::readAs<int32_t>(dst), model);
}

TEST_P(ApplyInt32PatchTest, RandomDisjointPatchesMatchTheModel) {
  std::mt19937_64 rng(1);
  for (int round = 0; round < 50; ++round) {
    auto const size = std::uniform_int_distribution<int32_t>(1, 400)(rng);
    std::vector<int32_t> model(static_cast<std::size_t>(size));
    for (int32_t& v : model) {
      v = static_cast<int32_t>(rng() % 1000);
    }
    Tensor dst = test::int32Tensor(model, device());
    Patch patch;
    int32_t cursor = 0;
    while (cursor < size) {
      cursor += static_cast<int32_t>(rng() % 9);  // gap
      int32_t const count = std::min<int32_t>(size - cursor, static_cast<int32_t>(rng() % 12) + 1);
      if (count <= 0) {
        break;
      }
      std::vector<int32_t> values(static_cast<std::size_t>(count));
      for (int32_t& v : values) {
        v = -static_cast<int32_t>(rng() % 1000) - 2;
      }
      patch.add(cursor, values);
      cursor += count;
    }
    patch.applyTo(model);
    Tensor const image = test::int32Tensor(patch.image(), device());
    kernels::applyInt32Patch(dst, image, static_cast<int32_t>(patch.ranges.size()), nullptr);
    ASSERT_EQ(test::readAs<int32_t>(dst), model) << "round " << round;
  }
}

TEST_P(ApplyInt32PatchTest, RejectsWrongTypesAndShortHeaders) {
  Tensor dst({8}, DataType::kInt32, device());
  Tensor wide({8}, DataType::kInt64, device());
  Tensor const image = test::int32Tensor({0, 1, 3, 5}, device());
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32Patch(wide, image, 1, nullptr); },
                          {"applyInt32Patch", "dst must be int32", "int64"}));
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32Patch(dst, image, 2, nullptr); },
                          {"applyInt32Patch", "2 ranges need 6 header entries", "4"}));
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32Patch(dst, image, -1, nullptr); },
                          {"applyInt32Patch", "-1 ranges"}));
}

TEST_P(ApplyInt32PatchTest, InlinePatchWritesEveryRangeAndNothingElse) {
  std::vector<int32_t> model(20, -1);
  Tensor dst = test::int32Tensor(model, device());
  Patch patch;
  patch.add(0, {3});
  patch.add(4, {7, 8, 9, 10});
  patch.add(19, {6});
  patch.applyTo(model);
  kernels::applyInt32InlinePatch(dst, patch.image(), 3, nullptr);
  EXPECT_EQ(test::readAs<int32_t>(dst), model);
}

TEST_P(ApplyInt32PatchTest, InlinePatchRejectsBadRangesAndOversizedPatchesWithoutWriting) {
  std::vector<int32_t> const model(8, 5);
  Tensor dst = test::int32Tensor(model, device());
  std::vector<int32_t> const outsideDst{6, 3, 3, 1, 2, 3};
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32InlinePatch(dst, outsideDst, 1, nullptr); },
                          {"applyInt32InlinePatch", "range 0 [6, 9) is outside dst of 8"}));
  std::vector<int32_t> const outsidePatch{0, 4, 3, 1, 2, 3};
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32InlinePatch(dst, outsidePatch, 1, nullptr); },
                          {"applyInt32InlinePatch", "values [3, 7) are outside the patch of 6"}));
  std::vector<int32_t> const shortHeader{0, 1, 3, 5};
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32InlinePatch(dst, shortHeader, 2, nullptr); },
                          {"applyInt32InlinePatch", "2 ranges need 6 header entries", "4"}));
  std::vector<int32_t> oversized(kernels::kMaxInlinePatchValues + 1, 0);
  oversized[1] = 1;
  oversized[2] = 3;
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32InlinePatch(dst, oversized, 1, nullptr); },
                          {"applyInt32InlinePatch", "1001 entries exceeds the inline limit"}));
  EXPECT_EQ(test::readAs<int32_t>(dst), model);
}

INSTANTIATE_TEST_SUITE_P(Devices, ApplyInt32PatchTest, test::allDeviceTypes(), test::deviceName);

TEST(ApplyInt32PatchHostTest, RejectsRangesOutsideDstOrPatchWithoutWriting) {
  std::vector<int32_t> const model(8, 5);
  Tensor dst = test::int32Tensor(model, DeviceType::kCPU);
  Tensor const outsideDst = test::int32Tensor({6, 3, 3, 1, 2, 3}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32Patch(dst, outsideDst, 1, nullptr); },
                          {"applyInt32Patch", "range 0 [6, 9) is outside dst of 8 entries"}));
  Tensor const outsidePatch = test::int32Tensor({0, 4, 3, 1, 2, 3}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32Patch(dst, outsidePatch, 1, nullptr); },
                          {"applyInt32Patch", "values [3, 7) are outside the patch of 6"}));
  Tensor const intoHeader = test::int32Tensor({0, 2, 1, 9}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { kernels::applyInt32Patch(dst, intoHeader, 1, nullptr); },
                          {"applyInt32Patch", "values [1, 3)"}));
  EXPECT_EQ(test::readAs<int32_t>(dst), model);
}

}  // namespace
}  // namespace mkv
