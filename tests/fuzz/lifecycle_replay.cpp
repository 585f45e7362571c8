/// mkv_lifecycle_replay: runs the lifecycle driver on files (a libFuzzer crash, a corpus entry) or
/// on the seeded inputs of lifecycle_fuzz_test.cpp, optionally printing every operation.
///
///   mkv_lifecycle_replay [--trace] FILE...
///   mkv_lifecycle_replay [--trace] --seeds FIRST LAST [--bytes N]
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
    mkv::fuzz::LifecycleResult const result =
        mkv::fuzz::runLifecycle(mkv::fuzz::seededInput(seed, bytes), options);
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
  return ok ? 0 : 1;
}
