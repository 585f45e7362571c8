#include "core/check.h"

namespace mkv::detail {

void throwError(std::string const& message) { throw Error(message); }

}  // namespace mkv::detail
