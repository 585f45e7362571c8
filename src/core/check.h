#pragma once
/// \file check.h
/// Internal checking helpers (not installed).
///
/// * MKV_REQUIRE(cond, "call", "fmt", args...) - a contract check on caller input; throws
///   mkv::Error("call", "<message>"): what() is "call: <message>", naming the call and the
///   offending value.
/// * MKV_ASSERT(cond, "fmt", args...) - an internal invariant, always on; throws
///   mkv::Error("internal invariant violated at file:line: ...").
/// * MKV_DASSERT - the same, compiled out in NDEBUG builds; for hot paths only.

#include <fmt/format.h>

#include "mkv/error.h"
#include "mkv/types.h"

namespace mkv::detail {

/// Throws mkv::Error(message) (no call of its own: an invariant, a wrapped message).
[[noreturn]] void throwError(std::string const& message);
/// Throws mkv::Error(call, detail).
[[noreturn]] void throwCallError(std::string call, std::string detail);

template <typename... Args>
[[noreturn]] void throwContract(char const* call, fmt::format_string<Args...> format,
                                Args&&... args) {
  throwCallError(call, fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
[[noreturn]] void throwInvariant(char const* file, int line, fmt::format_string<Args...> format,
                                 Args&&... args) {
  throwError(fmt::format("internal invariant violated at {}:{}: {}", file, line,
                         fmt::format(format, std::forward<Args>(args)...)));
}

/// Logs (warn) that `call` did not prepare a decode step because of `failure`, a row that fails
/// alone (the request goes on); every adapter's prepareDecodeStep reports a refusal so. False.
bool refusedStep(char const* call, RowFailure failure);

}  // namespace mkv::detail

#define MKV_REQUIRE(cond, call, ...)                   \
  do {                                                 \
    if (!(cond)) [[unlikely]] {                        \
      ::mkv::detail::throwContract(call, __VA_ARGS__); \
    }                                                  \
  } while (false)

#define MKV_ASSERT(cond, ...)                                         \
  do {                                                                \
    if (!(cond)) [[unlikely]] {                                       \
      ::mkv::detail::throwInvariant(__FILE__, __LINE__, __VA_ARGS__); \
    }                                                                 \
  } while (false)

#ifdef NDEBUG
#define MKV_DASSERT(cond, ...) \
  do {                         \
  } while (false)
#else
#define MKV_DASSERT(cond, ...) MKV_ASSERT(cond, __VA_ARGS__)
#endif
