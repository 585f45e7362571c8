/// mkv_lifecycle_replay: runs the lifecycle driver on files (a libFuzzer crash, a corpus entry) or
/// on the seeded inputs of lifecycle_fuzz_test.cpp, optionally printing every operation.
///
///   mkv_lifecycle_replay [--trace] FILE...
///   mkv_lifecycle_replay [--trace] --seeds FIRST LAST [--bytes N] [--runtime K] [--engine-step]
///
/// Exit status 1 when a lifecycle violated a property (its report is printed), 2 for a bad
/// command line (CLI11's message on stderr).

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/lifecycle_driver.h"

namespace {

bool report(std::string const& name, mkv::fuzz::LifecycleResult const& result) {
  if (!result.ok) {
    std::printf("%s: FAILED\n%s\n", name.c_str(), result.failure.c_str());
  }
  return result.ok;
}

}  // namespace

int main(int argc, char** argv) {
  mkv::fuzz::LifecycleOptions options;
  std::vector<std::string> files;
  std::vector<uint64_t> seeds;  // FIRST LAST
  std::size_t bytes = 1500;
  CLI::App app(
      "Runs the lifecycle driver on files (a libFuzzer crash, a corpus entry) or on the "
      "seeded inputs of lifecycle_fuzz_test.cpp.",
      "mkv_lifecycle_replay");
  app.add_flag("--trace", options.trace, "print every operation");
  auto* seedOption = app.add_option("--seeds", seeds, "the seeded inputs FIRST to LAST")
                         ->type_name("FIRST LAST")
                         ->expected(2);
  app.add_option("--bytes", bytes, "bytes of each seeded input")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->needs(seedOption);
  int32_t runtime = -1;
  bool engineStep = false;
  app.add_option(
         "--runtime", runtime,
         "force runtime kind K of the seeded inputs (0 context reuse, 1 bounded SWA, 2 full "
         "storage, 3 hybrid, 4 speculative, 5 Hybrid-MTP, 6 sliding-window reuse)")
      ->check(CLI::Range(0, 6))
      ->needs(seedOption);
  app.add_flag("--engine-step", engineStep, "force engine-step device writes on the seeded inputs")
      ->needs(seedOption);
  app.add_option("files", files, "inputs to replay")->type_name("FILE")->check(CLI::ExistingFile);
  try {
    app.parse(argc, argv);
    if (files.empty() && seeds.empty()) {
      throw CLI::RequiredError("FILE... or --seeds FIRST LAST");
    }
    if (!seeds.empty() && seeds[1] < seeds[0]) {
      throw CLI::ValidationError("--seeds", "LAST is below FIRST");
    }
  } catch (CLI::ParseError const& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  bool ok = true;
  mkv::fuzz::LifecycleStats total;
  for (std::string const& file : files) {
    std::ifstream in(file, std::ios::binary);
    std::vector<uint8_t> const input{std::istreambuf_iterator<char>(in),
                                     std::istreambuf_iterator<char>()};
    mkv::fuzz::LifecycleResult const result = mkv::fuzz::runLifecycle(input, options);
    ok = report(file, result) && ok;
    total += result.stats;
  }
  for (uint64_t seed = seeds.empty() ? 1 : seeds[0]; !seeds.empty() && seed <= seeds[1]; ++seed) {
    std::vector<uint8_t> input = mkv::fuzz::seededInput(seed, bytes);
    if (runtime >= 0 && input.size() >= 3) {
      mkv::fuzz::forceRuntime(input, runtime);
    }
    if (engineStep) {
      mkv::fuzz::forceEngineStep(input, true);
    }
    mkv::fuzz::LifecycleResult const result = mkv::fuzz::runLifecycle(input, options);
    ok = report("seed " + std::to_string(seed), result) && ok;
    total += result.stats;
  }
  std::printf(
      "%lld operations, %lld library calls, %lld rejected, %lld refusals, %lld decode "
      "steps, %lld failed synchronisations, %s\n",
      static_cast<long long>(total.operations), static_cast<long long>(total.libraryCalls),
      static_cast<long long>(total.rejectedCalls), static_cast<long long>(total.refusals),
      static_cast<long long>(total.decodeSteps),
      static_cast<long long>(total.failedSynchronizations), ok ? "all passed" : "FAILED");
  std::printf("operations per runtime:");
  for (std::size_t k = 0; k < std::size(total.runtimeOperations); ++k) {
    std::printf("%s %s %lld", k == 0 ? "" : ",", mkv::fuzz::kRuntimeNames[k],
                static_cast<long long>(total.runtimeOperations[k]));
  }
  std::printf(
      "; engine-step operations %lld (%lld lifecycles, %lld flushes, %lld completions refused "
      "for a forgotten flush); sliding-window reuse: %lld lifecycles, %lld reused windows "
      "verified\n",
      static_cast<long long>(total.engineStepOperations),
      static_cast<long long>(total.engineStepLifecycles),
      static_cast<long long>(total.deviceFlushes), static_cast<long long>(total.forgottenFlushes),
      static_cast<long long>(total.slidingReuseLifecycles),
      static_cast<long long>(total.slidingWindowReuses));
  return ok ? 0 : 1;
}
