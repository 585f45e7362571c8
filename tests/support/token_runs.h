#pragma once
/// \file token_runs.h
/// Token sequences of the suites: runs of consecutive ids and their concatenation.

#include <cstdint>
#include <vector>

namespace mkv::test {

/// The `count` tokens first, first + 1, ..., first + count - 1 (count >= 0).
std::vector<int32_t> tokenRun(int32_t count, int32_t first);

/// `head` followed by `tail`.
std::vector<int32_t> concatenated(std::vector<int32_t> head, std::vector<int32_t> const& tail);

}  // namespace mkv::test
