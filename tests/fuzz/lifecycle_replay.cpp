/// mkv_lifecycle_replay: runs the lifecycle driver on files (a libFuzzer crash, a corpus entry) or
/// on the seeded inputs of lifecycle_fuzz_test.cpp, optionally printing every operation.
///
///   mkv_lifecycle_replay [--trace] FILE...
///   mkv_lifecycle_replay [--trace] --seeds FIRST LAST [--bytes N]
///
/// Exit status 1 when a lifecycle violated a property (its report is printed).

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
  uint64_t first = 0;
  uint64_t last = 0;
  std::size_t bytes = 1500;
  for (int i = 1; i < argc; ++i) {
    std::string const arg = argv[i];
    if (arg == "--trace") {
      options.trace = true;
    } else if (arg == "--seeds" && i + 2 < argc) {
      first = std::strtoull(argv[i + 1], nullptr, 10);
      last = std::strtoull(argv[i + 2], nullptr, 10);
      i += 2;
    } else if (arg == "--bytes" && i + 1 < argc) {
      bytes = std::strtoull(argv[++i], nullptr, 10);
    } else {
      files.push_back(arg);
    }
  }
  if (files.empty() && first == 0) {
    std::fprintf(stderr, "usage: %s [--trace] FILE... | [--trace] --seeds FIRST LAST [--bytes N]\n",
                 argv[0]);
    return 2;
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
  for (uint64_t seed = first; first != 0 && seed <= last; ++seed) {
    mkv::fuzz::LifecycleResult const result =
        mkv::fuzz::runLifecycle(mkv::fuzz::seededInput(seed, bytes), options);
    ok = report("seed " + std::to_string(seed), result) && ok;
    total += result.stats;
  }
  std::printf("%lld operations, %lld library calls, %lld rejected, %lld refusals, %lld decode "
              "steps, %lld failed synchronisations, %s\n",
              static_cast<long long>(total.operations), static_cast<long long>(total.libraryCalls),
              static_cast<long long>(total.rejectedCalls), static_cast<long long>(total.refusals),
              static_cast<long long>(total.decodeSteps),
              static_cast<long long>(total.failedSynchronizations), ok ? "all passed" : "FAILED");
  return ok ? 0 : 1;
}
