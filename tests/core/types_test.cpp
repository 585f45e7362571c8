#include "mkv/types.h"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <type_traits>

namespace mkv {
namespace {

TEST(TypesTest, DataTypeSizesAreTheElementBytes) {
  EXPECT_EQ(dataTypeSize(DataType::kFloat32), 4u);
  EXPECT_EQ(dataTypeSize(DataType::kFloat16), 2u);
  EXPECT_EQ(dataTypeSize(DataType::kBFloat16), 2u);
  EXPECT_EQ(dataTypeSize(DataType::kFp8E4M3), 1u);
  EXPECT_EQ(dataTypeSize(DataType::kInt8), 1u);
  EXPECT_EQ(dataTypeSize(DataType::kUInt8), 1u);
  EXPECT_EQ(dataTypeSize(DataType::kInt32), 4u);
  EXPECT_EQ(dataTypeSize(DataType::kInt64), 8u);
  static_assert(dataTypeSize(DataType::kInt64) == 8, "usable in constant expressions");
}

TEST(TypesTest, DataTypeNamesAreDistinct) {
  std::set<std::string> names;
  for (DataType type :
       {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16, DataType::kFp8E4M3,
        DataType::kInt8, DataType::kUInt8, DataType::kInt32, DataType::kInt64}) {
    std::string const name(toString(type));
    EXPECT_NE(name, "unknown");
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 8u);
  EXPECT_EQ(toString(DataType::kBFloat16), "bfloat16");
  EXPECT_EQ(toString(DataType::kInt32), "int32");
}

TEST(TypesTest, DeviceTypeNames) {
  EXPECT_EQ(toString(DeviceType::kCPU), "cpu");
  EXPECT_EQ(toString(DeviceType::kGPU), "gpu");
}

TEST(TypesTest, FinishReasonNames) {
  EXPECT_EQ(toString(FinishReason::kNotFinished), "not-finished");
  EXPECT_EQ(toString(FinishReason::kEndOfSequence), "end-of-sequence");
  EXPECT_EQ(toString(FinishReason::kStopString), "stop-string");
  EXPECT_EQ(toString(FinishReason::kLength), "length");
  EXPECT_EQ(toString(FinishReason::kCancelled), "cancelled");
  EXPECT_EQ(toString(FinishReason::kError), "error");
}

TEST(TypesTest, StatusNames) {
  static_assert(std::is_same_v<SwaKVCacheStatus, KvStatus>);
  static_assert(std::is_same_v<ContextCacheStatus, KvStatus>);
  EXPECT_EQ(toString(KvStatus::kOk), "ok");
  EXPECT_EQ(toString(KvStatus::kRequestFailed), "request-failed");
  EXPECT_EQ(toString(KvStatus::kPoisoned), "poisoned");
}

TEST(TypesTest, ResidentRefDefaultIsInvalidAndComparesSlotAndEpoch) {
  ResidentRef const none;
  EXPECT_EQ(none.slot, -1);
  EXPECT_EQ(none.epoch, 0u);
  EXPECT_EQ((ResidentRef{2, 5}), (ResidentRef{2, 5}));
  EXPECT_NE((ResidentRef{2, 5}), (ResidentRef{2, 6}));
  EXPECT_NE((ResidentRef{1, 5}), (ResidentRef{2, 5}));
}

TEST(TypesTest, HeadroomDefaultsToVanillaDecoding) {
  DecodingKvHeadroom const vanilla;
  EXPECT_EQ(vanilla.baseExtraTokens, 1);
  EXPECT_EQ(vanilla.draftExtraTokens, 0);
  EXPECT_EQ(vanilla, (DecodingKvHeadroom{1, 0}));
  EXPECT_NE(vanilla, (DecodingKvHeadroom{4, 3}));
}

TEST(TypesTest, EmptyPageSentinelIsMinusOne) { EXPECT_EQ(kNoPage, -1); }

}  // namespace
}  // namespace mkv
