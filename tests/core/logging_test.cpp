#include "mkv/logging.h"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include <memory>
#include <sstream>

namespace mkv {
namespace {

/// Restores the default logger after every test.
class LoggingTest : public ::testing::Test {
 protected:
  void TearDown() override { setLogger(nullptr); }
};

TEST_F(LoggingTest, DefaultLoggerIsNamedAndLogsFromWarn) {
  std::shared_ptr<spdlog::logger> const current = logger();
  ASSERT_NE(current, nullptr);
  EXPECT_EQ(current->name(), kLoggerName);
  EXPECT_EQ(current->level(), spdlog::level::warn);
  EXPECT_EQ(logger(), current);  // created once, then shared
}

TEST_F(LoggingTest, ReplacementReceivesLibraryMessages) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  auto replacement = std::make_shared<spdlog::logger>("host-app", sink);
  replacement->set_pattern("%v");
  setLogger(replacement);
  EXPECT_EQ(logger(), replacement);
  logger()->warn("page table {} uploaded", 3);
  replacement->flush();
  EXPECT_EQ(out.str(), "page table 3 uploaded\n");
}

TEST_F(LoggingTest, NullReplacementRestoresTheDefault) {
  std::shared_ptr<spdlog::logger> const original = logger();
  setLogger(std::make_shared<spdlog::logger>("other"));
  EXPECT_NE(logger()->name(), kLoggerName);
  setLogger(nullptr);
  EXPECT_EQ(logger()->name(), kLoggerName);
  EXPECT_EQ(logger(), original);
}

}  // namespace
}  // namespace mkv
