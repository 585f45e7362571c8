// Builds and runs docs/examples/integration_example.cpp (its happy path, the KV lengths it keeps,
// in-flight admission with finalisation or retraction, and its handling of failed lifecycle
// calls), and checks that docs/integration.md shows exactly that file, so the
// documented example cannot drift from compiling code. The example's engine loop runs on host
// tensors and, as its header promises, with deviceType = kGPU (skipped without a CUDA device).
#include "../../docs/examples/integration_example.cpp"  // NOLINT(bugprone-suspicious-include)

#include <gtest/gtest.h>

#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/error.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/stream.h"
#include "support/fault_arming.h"
#include "support/test_inputs.h"
#include "support/test_util.h"

namespace {

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
  example::Engine engine(*runtime);
  std::vector<int32_t> system(200);
  std::iota(system.begin(), system.end(), 1);
  auto first = system;
  first.push_back(900);
  auto const coldReuse = engine.serve({{first, 5}});
  EXPECT_EQ(coldReuse, std::vector<int32_t>{0});
  auto second = system;
  second.push_back(901);
  auto third = system;
  third.push_back(902);
  auto const warmReuse = engine.serve({{second, 3}, {third, 6}});
  // 200 shared tokens = 3 full pages of 64.
  EXPECT_EQ(warmReuse, (std::vector<int32_t>{192, 192}));
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(IntegrationExampleTest, ARowThatCannotGrowAbortsTheRequestAndReturnsItsResidents) {
  auto runtime = makeRuntime();
  example::Engine engine(*runtime);
  std::vector<int32_t> prompt(2046);
  std::iota(prompt.begin(), prompt.end(), 1);
  // A row holds 2048 tokens: the third decode step would need position 2048.
  try {
    (void)engine.serve({{prompt, 8}});
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
  EXPECT_EQ(engine.serve({{next, 3}}), std::vector<int32_t>{192});
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(IntegrationExampleTest, AFailedSynchronisationAbortsTheRequestUntilShutdown) {
  mkv::KVCacheRuntimeConfig config = exampleConfig(device());
  // The stream really is waited for; the first wait is then reported as failed.
  mkv::test::FaultArming faults;
  faults.failCall(1);
  config.faults = faults.injector();
  auto runtime = mkv::KVCacheRuntime::create(config);
  example::Engine engine(*runtime);
  std::vector<int32_t> prompt(100);
  std::iota(prompt.begin(), prompt.end(), 1);
  // The shorter sequence finishes first: its compaction synchronises, and that fails.
  try {
    (void)engine.serve({{prompt, 2}, {prompt, 5}});
    ADD_FAILURE() << "the request was served";
  } catch (mkv::Error const& error) {
    ADD_FAILURE() << "a contract violation: " << error.what();
  } catch (std::runtime_error const& error) {
    EXPECT_STREQ(error.what(),
                 "completeBatchCompaction failed, request aborted (backend poisoned)");
  }
  EXPECT_EQ(faults.calls(), 1);
  // Both rows are quarantined: the engine parks their residents until the drain.
  EXPECT_EQ(engine.parkedResidents(), 2u);
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity() - 2);
  EXPECT_TRUE(runtime->contextCache()->poisoned());
  EXPECT_THROW((void)engine.serve({{prompt, 2}}), std::runtime_error)
      << "no admission while poisoned";
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity() - 2);
  EXPECT_TRUE(engine.shutdown());
  EXPECT_EQ(faults.calls(), 2) << "the quarantine drained";
  EXPECT_EQ(engine.parkedResidents(), 0u);
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_EQ(engine.serve({{prompt, 2}, {prompt, 5}}), (std::vector<int32_t>{64, 64}));
  EXPECT_TRUE(engine.shutdown());
}

/// The active device KV lengths each time the backend synchronises (inside compactions and
/// finish), read after the stream was waited for.
struct LengthRecorder {
  mkv::KVCacheRuntime* runtime = nullptr;
  std::vector<std::vector<int32_t>> seen;
};

std::unique_ptr<mkv::KVCacheRuntime> recordingRuntime(
    mkv::DeviceType device, std::shared_ptr<LengthRecorder> const& recorder) {
  mkv::KVCacheRuntimeConfig config = exampleConfig(device);
  config.synchronizer = [recorder,
                         wait = mkv::defaultStreamSynchronizer(device)](cudaStream_t stream) {
    cudaError_t const status = wait(stream);
    recorder->seen.push_back(
        mkv::test::readAs<int32_t>(recorder->runtime->fullPool()->kvLengths()));
    return status;
  };
  auto runtime = mkv::KVCacheRuntime::create(config);
  recorder->runtime = runtime.get();
  return runtime;
}

// The engine's duty: the device KV lengths follow every step. At the first compaction (after one
// decode step; the 2-token row finishes) the survivor's KV length is its prompt plus the one
// decoded position, not the reuse length preparePrefill wrote.
TEST_P(IntegrationExampleTest, TheKvLengthsFollowEveryStep) {
  auto recorder = std::make_shared<LengthRecorder>();
  auto runtime = recordingRuntime(device(), recorder);
  example::Engine engine(*runtime);
  std::vector<int32_t> prompt(100);
  std::iota(prompt.begin(), prompt.end(), 1);
  EXPECT_EQ(engine.serve({{prompt, 2}, {prompt, 5}}), (std::vector<int32_t>{0, 0}));
  ASSERT_EQ(recorder->seen.size(), 2u) << "two compactions synchronise";
  EXPECT_EQ(recorder->seen[0], std::vector<int32_t>{100 + 1});
  EXPECT_EQ(recorder->seen[1], std::vector<int32_t>{}) << "the last row compacted away";
  EXPECT_TRUE(engine.shutdown());
}

// In-flight admission: a waiting sequence joins after the first decode step, reusing the prefix
// the founders published; the engine grows the KV-length tensor for it, and at the compaction
// that drops it (3 tokens: prefill + 2 steps) the founder's length is its prompt + 3 decoded.
TEST_P(IntegrationExampleTest, AWaitingSequenceJoinsInFlightWithItsKvLength) {
  auto recorder = std::make_shared<LengthRecorder>();
  auto runtime = recordingRuntime(device(), recorder);
  example::Engine engine(*runtime);
  std::vector<int32_t> prompt(100);
  std::iota(prompt.begin(), prompt.end(), 1);
  std::vector<int32_t> joiner = prompt;
  joiner.push_back(7);
  EXPECT_EQ(engine.serve({{prompt, 6}}, {{joiner, 3}}), (std::vector<int32_t>{0, 64}))
      << "the joiner reuses the founder's published page";
  EXPECT_EQ(runtime->contextCache()->counters().liveAdmissions, 1u);
  ASSERT_EQ(recorder->seen.size(), 2u);
  EXPECT_EQ(recorder->seen[0], std::vector<int32_t>{100 + 3});
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_TRUE(engine.shutdown());
}

// A joiner whose prefill does not fit the step's budget is admitted, then retracted (nothing ran
// for it) at every step; the request goes on without it and every resident comes back.
TEST_P(IntegrationExampleTest, AJoinerThatDoesNotFitIsRetractedAndTheRequestGoesOn) {
  auto runtime = makeRuntime();
  example::Engine engine(*runtime);
  engine.joinerPrefillBudget = 16;
  std::vector<int32_t> prompt(100);
  std::iota(prompt.begin(), prompt.end(), 1);
  std::vector<int32_t> joiner(80, 5);  // nothing to reuse: 80 prefill tokens
  EXPECT_EQ(engine.serve({{prompt, 4}}, {{joiner, 3}}), std::vector<int32_t>{0});
  // One attempt after each decode step the founder survives (2 of its 3: the last one ends it).
  EXPECT_EQ(runtime->contextCache()->counters().liveAdmissions, 2u);
  EXPECT_EQ(runtime->contextCache()->counters().retractedAdmissions, 2u);
  EXPECT_FALSE(runtime->contextCache()->poisoned());
  EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity());
  EXPECT_TRUE(engine.shutdown());
}

TEST(IntegrationExampleDocTest, TheDocumentShowsTheCompiledExample) {
  // Copies beside the binary (the GPU bundle carries them) or the source tree (test_inputs.h).
  MKV_TEST_INPUT_OR_SKIP(docPath, "docs/integration.md");
  MKV_TEST_INPUT_OR_SKIP(codePath, "docs/examples/integration_example.cpp");
  EXPECT_TRUE(mkv::test::pageShowsFile(docPath.string(), "example", codePath.string()));
}

}  // namespace
