#pragma once
/// \file test_inputs.h
/// Where the suites find their input files (traces, fuzz corpus) and the executables they drive,
/// in the build tree, in the GPU bundle (build/cuda-release/device) and in a source checkout.

#include <filesystem>
#include <string>
#include <string_view>

namespace mkv::test {

/// The input at `relative` (a path relative to the project root, e.g.
/// "tests/data/mooncake_first500.jsonl"), looked up in order under
///   1. $MKV_TEST_INPUTS (benchmarks/gpu/run_on_device.sh sets it to the bundle's copy),
///   2. a `test_inputs/` folder beside the test executable or in one of its parent folders: the
///      build copies every input there (mkv_test_inputs in tests/CMakeLists.txt) and the GPU
///      bundle carries that folder,
///   3. the source tree the binary was built from.
/// Returns an empty path when none holds it.
std::filesystem::path findTestInput(std::string_view relative);

/// A build output at `relative` (e.g. "benchmarks/replay/mkv-replay"), looked up in the test
/// executable's parent folders (the build tree and the GPU bundle share their layout). Empty
/// when not found.
std::filesystem::path findBuildOutput(std::string_view relative);

/// The message of a test that skips because `relative` is missing.
std::string missingInput(std::string_view relative);

}  // namespace mkv::test

/// Sets `var` to the input at `relative` or skips the test with a message naming what is missing.
#define MKV_TEST_INPUT_OR_SKIP(var, relative)                             \
  std::filesystem::path const var = ::mkv::test::findTestInput(relative); \
  if (var.empty()) {                                                      \
    GTEST_SKIP() << ::mkv::test::missingInput(relative);                  \
  }
