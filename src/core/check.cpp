#include "core/check.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "mkv/logging.h"

namespace mkv::detail {

void throwError(std::string const& message) { throw Error(message); }

void throwCallError(std::string call, std::string detail) {
  throw Error(std::move(call), std::move(detail));
}

bool refusedStep(char const* call, RowFailure failure) {
  logger()->warn(
      "{}: row {} {}: the step was not prepared (drop or preempt rows and prepare it "
      "again, or finish)",
      call, failure.row, toString(failure.reason));
  return false;
}

}  // namespace mkv::detail
