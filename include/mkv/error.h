#pragma once
/// \file error.h
/// The one exception type of the library.

#include <stdexcept>
#include <string>

namespace mkv {

/// Thrown for contract violations: wrong lifecycle order, sizes that disagree, slots or ids
/// out of range, non-order-preserving mappings, stream mismatch; and for CUDA failures outside a
/// noexcept path. what() is "call: detail": call() names the integrator's call (the facade call
/// when the facade made it, never an internal one), detail() the offending value and what was
/// expected. A contract violation leaves the object that threw exactly as it was before the
/// call; a device write that failed keeps the call's host changes (docs/errors.md, "Device
/// writes that fail"). Expected runtime outcomes (no capacity, poisoned, request failed) are
/// never reported by exception; see the status enums in types.h.
class Error : public std::runtime_error {
 public:
  /// An error of the call `call` (empty: an internal invariant, whose detail says where).
  Error(std::string call, std::string detail)
      : std::runtime_error(call.empty() ? detail : call + ": " + detail),
        mCall(std::move(call)),
        mDetail(std::move(detail)) {}
  /// An error whose message names no call of its own.
  explicit Error(std::string const& message) : Error(std::string{}, message) {}

  std::string const& call() const noexcept { return mCall; }
  std::string const& detail() const noexcept { return mDetail; }

 private:
  std::string mCall;
  std::string mDetail;
};

}  // namespace mkv
