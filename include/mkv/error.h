#pragma once
/// \file error.h
/// The one exception type of the library.

#include <stdexcept>
#include <string>

namespace mkv {

/// Thrown for contract violations: wrong lifecycle order, sizes that disagree, slots or ids
/// out of range, non-order-preserving mappings, stream mismatch, CUDA failures outside a
/// noexcept path. The message names the call and the offending value. The object that threw
/// is left exactly as it was before the call. Expected runtime outcomes (no capacity, poisoned,
/// request failed) are never reported by exception; see the status enums in types.h.
class Error : public std::runtime_error {
 public:
  explicit Error(std::string const& message) : std::runtime_error(message) {}
};

}  // namespace mkv
