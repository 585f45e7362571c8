/// tokenRun and concatenated.

#include "support/token_runs.h"

#include <gtest/gtest.h>

namespace mkv::test {
namespace {

TEST(TokenRunsTest, RunsAndConcatenation) {
  EXPECT_EQ(tokenRun(3, 7), (std::vector<int32_t>{7, 8, 9}));
  EXPECT_TRUE(tokenRun(0, 7).empty());
  EXPECT_EQ(concatenated(tokenRun(2, 1), {5, 6}), (std::vector<int32_t>{1, 2, 5, 6}));
}

}  // namespace
}  // namespace mkv::test
