#include "mkv/recurrent_state_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <random>
#include <vector>

#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

RecurrentStatePoolConfig smallConfig(DeviceType device) {
  RecurrentStatePoolConfig config;
  config.numLayers = 2;
  config.numSlots = 4;
  config.stateBytesPerSlot = 48;
  config.convBytesPerSlot = 24;
  config.deviceType = device;
  return config;
}

TEST(RecurrentStatePoolConfigTest, RejectsInvalidFields) {
  auto rejects = [](void (*change)(RecurrentStatePoolConfig&),
                    std::initializer_list<std::string_view> fragments) {
    RecurrentStatePoolConfig config = smallConfig(DeviceType::kCPU);
    change(config);
    return throwsError([&] { RecurrentStatePool{config}; }, fragments);
  };
  EXPECT_TRUE(rejects([](auto& c) { c.numLayers = 0; }, {"RecurrentStatePool", "numLayers 0"}));
  EXPECT_TRUE(rejects([](auto& c) { c.numLayers = 129; }, {"numLayers 129", "[1, 128]"}));
  EXPECT_TRUE(rejects([](auto& c) { c.numSlots = 0; }, {"numSlots", "0"}));
  EXPECT_TRUE(rejects([](auto& c) { c.stateBytesPerSlot = -1; }, {"stateBytesPerSlot", "-1"}));
  EXPECT_TRUE(rejects([](auto& c) { c.convBytesPerSlot = 0; }, {"convBytesPerSlot", "0"}));
  EXPECT_TRUE(
      rejects([](auto& c) { c.stateBytesPerSlot = std::numeric_limits<int64_t>::max() / 2; },
              {"overflow int64"}));
}

class RecurrentStatePoolTest : public test::DeviceTest {
 protected:
  RecurrentStatePool make() const { return RecurrentStatePool(smallConfig(device())); }
  /// Random bytes in every buffer; returns them in rowBuffers() order.
  static std::vector<std::vector<uint8_t>> fillAll(RecurrentStatePool& pool, std::mt19937_64& rng) {
    std::vector<std::vector<uint8_t>> bytes;
    for (int32_t l = 0; l < pool.numLayers(); ++l) {
      bytes.push_back(test::fillRandom(pool.state(l), rng));
      bytes.push_back(test::fillRandom(pool.conv(l), rng));
    }
    return bytes;
  }
  static std::vector<std::vector<uint8_t>> readAll(RecurrentStatePool const& pool) {
    std::vector<std::vector<uint8_t>> bytes;
    for (int32_t l = 0; l < pool.numLayers(); ++l) {
      bytes.push_back(test::readBytes(pool.state(l)));
      bytes.push_back(test::readBytes(pool.conv(l)));
    }
    return bytes;
  }
  static void zeroModel(std::vector<std::vector<uint8_t>>& model, int32_t slot) {
    for (std::size_t b = 0; b < model.size(); ++b) {
      std::size_t const width = b % 2 == 0 ? 48 : 24;
      std::fill_n(model[b].begin() + static_cast<long>(static_cast<std::size_t>(slot) * width),
                  width, uint8_t{0});
    }
  }
};

TEST_P(RecurrentStatePoolTest, BuffersHaveTheirShapesAndRowBuffersAlternateStateAndConv) {
  RecurrentStatePool pool = make();
  EXPECT_EQ(pool.bytesPerSlot(), 2 * (48 + 24));
  ASSERT_EQ(pool.rowBuffers().size(), 4u);
  for (int32_t l = 0; l < 2; ++l) {
    EXPECT_EQ(pool.state(l).shape(), (Coords{4, 48}));
    EXPECT_EQ(pool.conv(l).shape(), (Coords{4, 24}));
    EXPECT_EQ(pool.state(l).deviceType(), device());
    EXPECT_EQ(test::readBytes(pool.state(l)), std::vector<uint8_t>(4 * 48, 0));
    kernels::RowBuffer const& state = pool.rowBuffers()[static_cast<std::size_t>(2 * l)];
    kernels::RowBuffer const& conv = pool.rowBuffers()[static_cast<std::size_t>(2 * l + 1)];
    EXPECT_EQ(state.data, pool.state(l).rawPointer());
    EXPECT_EQ(state.rowBytes, 48);
    EXPECT_EQ(state.numRows, 4);
    EXPECT_EQ(conv.data, pool.conv(l).rawPointer());
    EXPECT_EQ(conv.rowBytes, 24);
  }
  EXPECT_TRUE(throwsError([&] { (void)pool.state(2); }, {"RecurrentStatePool::state", "layer 2"}));
  EXPECT_TRUE(throwsError([&] { (void)pool.conv(-1); }, {"RecurrentStatePool::conv", "-1"}));
}

TEST_P(RecurrentStatePoolTest, ClearResidentSlotZeroesOnlyThatSlotInEveryLayer) {
  std::mt19937_64 rng(1);
  RecurrentStatePool pool = make();
  std::vector<std::vector<uint8_t>> model = fillAll(pool, rng);
  pool.clearResidentSlot(2, nullptr);
  zeroModel(model, 2);
  EXPECT_EQ(readAll(pool), model);
}

TEST_P(RecurrentStatePoolTest, ClearResidentSlotsZeroesSeveralInOneCall) {
  std::mt19937_64 rng(2);
  RecurrentStatePool pool = make();
  std::vector<std::vector<uint8_t>> model = fillAll(pool, rng);
  std::vector<CacheSlot> const slots{3, 0};
  pool.clearResidentSlots(slots, nullptr);
  zeroModel(model, 3);
  zeroModel(model, 0);
  EXPECT_EQ(readAll(pool), model);
  pool.clearResidentSlots({}, nullptr);
  EXPECT_EQ(readAll(pool), model);
}

TEST_P(RecurrentStatePoolTest, RejectsInvalidSlotsWithoutZeroingAnything) {
  std::mt19937_64 rng(3);
  RecurrentStatePool pool = make();
  std::vector<std::vector<uint8_t>> const model = fillAll(pool, rng);
  EXPECT_TRUE(throwsError([&] { pool.clearResidentSlot(4, nullptr); },
                          {"RecurrentStatePool::clearResidentSlots", "slots[0] = 4", "[0, 4)"}));
  std::vector<CacheSlot> const mixed{1, -1};
  EXPECT_TRUE(throwsError([&] { pool.clearResidentSlots(mixed, nullptr); }, {"slots[1] = -1"}));
  std::vector<CacheSlot> const tooMany{0, 1, 2, 3, 0};
  EXPECT_TRUE(
      throwsError([&] { pool.clearResidentSlots(tooMany, nullptr); }, {"5 slots", "only 4"}));
  EXPECT_EQ(readAll(pool), model);
}

INSTANTIATE_TEST_SUITE_P(Devices, RecurrentStatePoolTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv
