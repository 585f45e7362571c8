#include "support/test_inputs.h"

#include <cstdlib>
#include <string>
#include <system_error>
#include <vector>

namespace mkv::test {
namespace {

namespace fs = std::filesystem;

/// The executable's folder and its parents, nearest first (at most five levels).
std::vector<fs::path> executableFolders() {
  std::vector<fs::path> folders;
  std::error_code error;
  fs::path const executable = fs::read_symlink("/proc/self/exe", error);
  if (error) {
    return folders;
  }
  fs::path folder = executable.parent_path();
  for (int level = 0; level < 5 && !folder.empty(); ++level) {
    folders.push_back(folder);
    if (folder == folder.root_path()) {
      break;
    }
    folder = folder.parent_path();
  }
  return folders;
}

bool present(fs::path const& path) {
  std::error_code error;
  return fs::exists(path, error);
}

}  // namespace

fs::path findTestInput(std::string_view relative) {
  std::vector<fs::path> roots;
  if (char const* env = std::getenv("MKV_TEST_INPUTS"); env != nullptr && *env != '\0') {
    roots.emplace_back(env);
  }
  for (fs::path const& folder : executableFolders()) {
    roots.push_back(folder / "test_inputs");
  }
#ifdef MKV_SOURCE_DIR
  roots.emplace_back(MKV_SOURCE_DIR);
#endif
  for (fs::path const& root : roots) {
    fs::path const candidate = root / fs::path(relative);
    if (present(candidate)) {
      return candidate;
    }
  }
  return {};
}

fs::path findBuildOutput(std::string_view relative) {
  for (fs::path const& folder : executableFolders()) {
    fs::path const candidate = folder / fs::path(relative);
    if (present(candidate)) {
      return candidate;
    }
  }
  return {};
}

std::string missingInput(std::string_view relative) {
  return "test input " + std::string(relative) +
         " not found (looked under $MKV_TEST_INPUTS, in test_inputs/ beside the executable and its "
         "parent folders, and in the source tree)";
}

}  // namespace mkv::test
