#include "core/check.h"

namespace mkv::detail {

void throwError(std::string message) { throw Error(message); }

}  // namespace mkv::detail
