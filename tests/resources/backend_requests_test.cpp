// The request mechanism both KV backends share (src/resources/backend_requests.h): the checks of
// a compaction's begun mapping and of its device mapping at the end.
#include "resources/backend_requests.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "support/test_util.h"

namespace mkv {
namespace {

TEST(BackendRequestsTest, ACompletedMappingMustBeTheBegunOneAndBothArePrinted) {
  std::vector<int32_t> const begun{0, -1, 1};
  EXPECT_NO_THROW(detail::requireBegunMapping("Adapter::completeBatchCompaction", begun,
                                              std::vector<int32_t>{0, -1, 1}));
  EXPECT_TRUE(test::throwsError(
      [&] {
        detail::requireBegunMapping("Adapter::completeBatchCompaction", begun,
                                    std::vector<int32_t>{-1, 0, 1});
      },
      {"Adapter::completeBatchCompaction",
       "keepMapping [-1, 0, 1] differs from the mapping "
       "[0, -1, 1] given to beginBatchCompaction"}));
  EXPECT_TRUE(test::throwsError(
      [&] {
        detail::requireBegunMapping("Adapter::completeBatchCompaction", begun,
                                    std::vector<int32_t>{0, -1});
      },
      {"keepMapping [0, -1] differs"}));
}

TEST(BackendRequestsTest, ACompletionWithoutABeginThrowsNamingTheGivenMapping) {
  EXPECT_TRUE(test::throwsError(
      [] {
        detail::requireBegunMapping("Adapter::completeBatchCompaction", {},
                                    std::vector<int32_t>{0, 1});
      },
      {"Adapter::completeBatchCompaction",
       "no batch compaction was begun (keepMapping [0, 1]; call beginBatchCompaction first)"}));
}

TEST(BackendRequestsTest, ADeviceMappingReshapedSinceTheBeginThrowsNamingBothShapes) {
  Tensor mapping = test::int32Tensor({0, 1, -1}, DeviceType::kCPU);
  EXPECT_NO_THROW(
      detail::requireDeviceMappingUnchanged("Backend::compactBatch", mapping, DeviceType::kCPU, 3));
  ASSERT_TRUE(mapping.reshape({2}));
  EXPECT_TRUE(test::throwsError(
      [&] {
        detail::requireDeviceMappingUnchanged("Backend::compactBatch", mapping, DeviceType::kCPU,
                                              3);
      },
      {"Backend::compactBatch",
       "deviceMapping was reshaped or replaced since "
       "beginBatchCompaction: 2 entries on cpu, expected 3 on cpu"}));
  ASSERT_TRUE(mapping.reshape({3}));
  EXPECT_TRUE(test::throwsError(
      [&] {
        detail::requireDeviceMappingUnchanged("Backend::compactBatch", mapping, DeviceType::kGPU,
                                              3);
      },
      {"3 entries on cpu, expected 3 on"}));
}

}  // namespace
}  // namespace mkv
