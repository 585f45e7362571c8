#include "support/token_runs.h"

#include <numeric>

namespace mkv::test {

std::vector<int32_t> tokenRun(int32_t count, int32_t first) {
  std::vector<int32_t> tokens(static_cast<std::size_t>(count));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

std::vector<int32_t> concatenated(std::vector<int32_t> head, std::vector<int32_t> const& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

}  // namespace mkv::test
