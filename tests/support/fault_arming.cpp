#include "support/fault_arming.h"

#include <stdexcept>
#include <string>

namespace mkv::test {

FaultInjector FaultArming::injector() const {
  return [state = mState](FaultSite site) {
    Site& at = (*state)[static_cast<std::size_t>(site)];
    ++at.calls;
    bool fail = at.failAt > 0 && (at.calls == at.failAt || (at.persistent && at.calls > at.failAt));
    if (at.throwsLeft > 0) {
      --at.throwsLeft;
      ++at.throws;
      throw std::runtime_error("injected " + std::string(toString(site)) + " exception");
    }
    if (at.failuresLeft > 0) {
      --at.failuresLeft;
      fail = true;
    }
    if (fail) {
      ++at.failures;
      return cudaErrorUnknown;
    }
    return cudaSuccess;
  };
}

int32_t FaultArming::disarm() {
  int32_t left = 0;
  for (Site& site : *mState) {
    left += site.failuresLeft + site.throwsLeft;
    site.failuresLeft = 0;
    site.throwsLeft = 0;
    site.failAt = 0;
    site.persistent = false;
  }
  return left;
}

}  // namespace mkv::test
