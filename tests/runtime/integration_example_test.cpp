// Builds and runs docs/examples/integration_example.cpp (its happy path and its handling of
// failed lifecycle calls), and checks that docs/integration.md shows exactly that file, so the
// documented example cannot drift from compiling code. The example's engine loop runs on host
// tensors and, as its header promises, with deviceType = kGPU (skipped without a CUDA device).
#include "../../docs/examples/integration_example.cpp"

#include <gtest/gtest.h>

#include <fstream>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "mkv/error.h"
#include "mkv/stream.h"
#include "test_inputs.h"
#include "test_util.h"

namespace {

/// The file's text, or nullopt when it cannot be opened.
std::optional<std::string> readFile(std::string const& path) {
  std::ifstream in(path);
  if (!in) {
    return std::nullopt;
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

/// The example's configuration on `device`.
mkv::KVCacheRuntimeConfig exampleConfig(mkv::DeviceType device) {
  mkv::KVCacheRuntimeConfig config = example::makeRuntime()->config();
  config.deviceType = device;
  return config;
}

class IntegrationExampleTest : public mkv::test::DeviceTest {
 protected:
  std::unique_ptr<mkv::KVCacheRuntime> makeRuntime() const {
    return mkv::KVCacheRuntime::create(exampleConfig(device()));
  }
};

INSTANTIATE_TEST_SUITE_P(Devices, IntegrationExampleTest, mkv::test::allDeviceTypes(),
                         mkv::test::deviceName);

TEST_P(IntegrationExampleTest, SecondRequestReusesTheSharedPrefix) {
  auto runtime = makeRuntime();
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

TEST_P(IntegrationExampleTest, ARowThatCannotGrowAbortsTheRequestAndReturnsItsResidents) {
  auto runtime = makeRuntime();
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

TEST_P(IntegrationExampleTest, AFailedSynchronisationAbortsTheRequestUntilShutdown) {
  mkv::KVCacheRuntimeConfig config = exampleConfig(device());
  int calls = 0;
  // The stream really is waited for; the first wait is then reported as failed.
  config.synchronizer = [&calls, wait = mkv::defaultStreamSynchronizer(device())](
                            cudaStream_t stream) {
    cudaError_t const status = wait(stream);
    return ++calls == 1 ? cudaErrorUnknown : status;
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

TEST(IntegrationExampleDocTest, TheDocumentShowsTheCompiledExample) {
  // Copies beside the binary (the GPU bundle carries them) or the source tree (test_inputs.h).
  MKV_TEST_INPUT_OR_SKIP(docPath, "docs/integration.md");
  MKV_TEST_INPUT_OR_SKIP(codePath, "docs/examples/integration_example.cpp");
  std::optional<std::string> const doc = readFile(docPath.string());
  std::optional<std::string> const code = readFile(codePath.string());
  ASSERT_TRUE(doc && code) << "cannot read " << (doc ? codePath : docPath);
  ASSERT_FALSE(code->empty());
  std::string const begin = "<!-- example:begin -->\n```cpp\n";
  std::string const end = "```\n<!-- example:end -->";
  auto const from = doc->find(begin);
  auto const to = doc->find(end);
  ASSERT_NE(from, std::string::npos);
  ASSERT_NE(to, std::string::npos);
  EXPECT_EQ(doc->substr(from + begin.size(), to - from - begin.size()), *code);
}

}  // namespace
