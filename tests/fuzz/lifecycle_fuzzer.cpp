/// libFuzzer entry point of the lifecycle driver (target mkv_lifecycle_fuzzer, built with
/// -DMKV_BUILD_FUZZERS=ON and clang; how to run it: docs/reliability.md). A violated property
/// prints the report and aborts, so libFuzzer keeps the input as a crash.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "fuzz/lifecycle_driver.h"

extern "C" int LLVMFuzzerTestOneInput(uint8_t const* data, std::size_t size) {
  mkv::fuzz::LifecycleResult const result =
      mkv::fuzz::runLifecycle(std::span<uint8_t const>(data, size));
  if (!result.ok) {
    std::fprintf(stderr, "lifecycle property violated: %s\n", result.failure.c_str());
    std::abort();
  }
  return 0;
}
