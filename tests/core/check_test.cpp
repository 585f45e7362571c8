#include "core/check.h"

#include <gtest/gtest.h>

#include <string>

#include "support/test_util.h"

namespace mkv {
namespace {

TEST(CheckTest, RequireThrowsWithCallNameAndFormattedValues) {
  auto const failing = [](int slot) {
    MKV_REQUIRE(slot < 4, "Widget::bind", "slot {} is outside [0, {})", slot, 4);
  };
  EXPECT_NO_THROW(failing(3));
  try {
    failing(9);
    FAIL() << "did not throw";
  } catch (Error const& error) {
    EXPECT_STREQ(error.what(), "Widget::bind: slot 9 is outside [0, 4)");
  }
}

TEST(CheckTest, ARequireErrorCarriesItsCallAndDetailApart) {
  try {
    MKV_REQUIRE(false, "Widget::bind", "slot {} is taken", 2);
    FAIL() << "did not throw";
  } catch (Error const& error) {
    EXPECT_EQ(error.call(), "Widget::bind");
    EXPECT_EQ(error.detail(), "slot 2 is taken");
  }
  Error const internal("internal invariant violated at x.cpp:3: broken");
  EXPECT_EQ(internal.call(), "");
  EXPECT_STREQ(internal.what(), "internal invariant violated at x.cpp:3: broken");
}

TEST(CheckTest, RequireEvaluatesArgumentsOnlyOnFailure) {
  int evaluations = 0;
  auto count = [&] { return ++evaluations; };
  MKV_REQUIRE(true, "call", "{}", count());
  EXPECT_EQ(evaluations, 0);
  EXPECT_THROW(MKV_REQUIRE(false, "call", "{}", count()), Error);
  EXPECT_EQ(evaluations, 1);
}

TEST(CheckTest, AssertNamesFileAndLine) {
  EXPECT_TRUE(
      test::throwsError([] { MKV_ASSERT(1 + 1 == 3, "arithmetic is {}", "broken"); },
                        {"internal invariant violated", "check_test.cpp", "arithmetic is broken"}));
}

TEST(CheckTest, DebugAssertFollowsTheBuildMode) {
#ifdef NDEBUG
  EXPECT_NO_THROW(MKV_DASSERT(false, "compiled out"));
#else
  EXPECT_THROW(MKV_DASSERT(false, "active in debug builds"), Error);
#endif
}

}  // namespace
}  // namespace mkv
