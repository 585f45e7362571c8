#include "core/check.h"

#include <utility>

namespace mkv::detail {

void throwError(std::string const& message) { throw Error(message); }

void throwCallError(std::string call, std::string detail) {
  throw Error(std::move(call), std::move(detail));
}

}  // namespace mkv::detail
