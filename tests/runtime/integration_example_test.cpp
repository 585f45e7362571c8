// Builds and runs docs/examples/integration_example.cpp (its happy path and its handling of
// failed lifecycle calls), and checks that docs/integration.md shows exactly that file, so the
// documented example cannot drift from compiling code.
#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>

#include "../../docs/examples/integration_example.cpp"
#include "mkv/error.h"

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

TEST(IntegrationExampleTest, ARowThatCannotGrowAbortsTheRequestAndReturnsItsResidents) {
  auto runtime = example::makeRuntime();
  std::vector<int32_t> prompt(2046);
  std::iota(prompt.begin(), prompt.end(), 1);
  // A row holds 2048 tokens: the third decode step would need position 2048.
  try {
    (void)example::serve(*runtime, {{prompt, 8}});
    ADD_FAILURE() << "the request was served";
  } catch (mkv::Error const& error) {
    ADD_FAILURE() << "a contract violation: " << error.what();
  } catch (std::runtime_error const& error) {
    EXPECT_STREQ(error.what(), "prepareDecodeStep failed, request aborted");
  }
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_EQ(runtime->contextCache()->activeRequestCount(), 0);
  EXPECT_FALSE(runtime->contextCache()->poisoned());
  // The runtime serves on; the aborted request's prompt was published by its prefill.
  std::vector<int32_t> next(prompt.begin(), prompt.begin() + 200);
  next.push_back(5);
  EXPECT_EQ(example::serve(*runtime, {{next, 3}}), std::vector<int32_t>{192});
  EXPECT_TRUE(runtime->shutdown());
}

TEST(IntegrationExampleTest, AFailedSynchronisationAbortsTheRequestUntilShutdown) {
  mkv::KVCacheRuntimeConfig config = example::makeRuntime()->config();
  int calls = 0;
  config.synchronizer = [&calls](cudaStream_t) {
    return ++calls == 1 ? cudaErrorUnknown : cudaSuccess;
  };
  auto runtime = mkv::KVCacheRuntime::create(config);
  std::vector<int32_t> prompt(100);
  std::iota(prompt.begin(), prompt.end(), 1);
  // The shorter sequence finishes first: its compaction synchronises, and that fails.
  try {
    (void)example::serve(*runtime, {{prompt, 2}, {prompt, 5}});
    ADD_FAILURE() << "the request was served";
  } catch (mkv::Error const& error) {
    ADD_FAILURE() << "a contract violation: " << error.what();
  } catch (std::runtime_error const& error) {
    EXPECT_STREQ(error.what(), "completeBatchCompaction failed, request aborted (backend poisoned)");
  }
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_TRUE(runtime->contextCache()->poisoned());
  EXPECT_THROW((void)example::serve(*runtime, {{prompt, 2}}), std::runtime_error)
      << "no admission while poisoned";
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_TRUE(runtime->shutdown());
  EXPECT_EQ(calls, 2) << "the quarantine drained";
  EXPECT_EQ(example::serve(*runtime, {{prompt, 2}, {prompt, 5}}), (std::vector<int32_t>{64, 64}));
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
