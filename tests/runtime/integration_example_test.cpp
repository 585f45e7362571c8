// Builds and runs docs/examples/integration_example.cpp, and checks that docs/integration.md
// shows exactly that file, so the documented example cannot drift from compiling code.
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <sstream>
#include <string>

#include "../../docs/examples/integration_example.cpp"

namespace {

std::string readFile(std::string const& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(IntegrationExampleTest, SecondRequestReusesTheSharedPrefix) {
  auto runtime = example::makeRuntime();
  std::vector<int32_t> system(200);
  std::iota(system.begin(), system.end(), 1);
  auto first = system;
  first.push_back(900);
  auto const coldReuse = example::serve(*runtime, {{first, 5}});
  EXPECT_EQ(coldReuse, std::vector<int32_t>{0});
  auto second = system;
  second.push_back(901);
  auto third = system;
  third.push_back(902);
  auto const warmReuse = example::serve(*runtime, {{second, 3}, {third, 6}});
  // 200 shared tokens = 3 full pages of 64.
  EXPECT_EQ(warmReuse, (std::vector<int32_t>{192, 192}));
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_TRUE(runtime->shutdown());
}

TEST(IntegrationExampleTest, TheDocumentShowsTheCompiledExample) {
  std::string const doc = readFile(MKV_SOURCE_DIR "/docs/integration.md");
  std::string const code = readFile(MKV_SOURCE_DIR "/docs/examples/integration_example.cpp");
  ASSERT_FALSE(code.empty());
  std::string const begin = "<!-- example:begin -->\n```cpp\n";
  std::string const end = "```\n<!-- example:end -->";
  auto const from = doc.find(begin);
  auto const to = doc.find(end);
  ASSERT_NE(from, std::string::npos);
  ASSERT_NE(to, std::string::npos);
  EXPECT_EQ(doc.substr(from + begin.size(), to - from - begin.size()), code);
}

}  // namespace
