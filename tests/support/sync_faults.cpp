#include "support/sync_faults.h"

#include <stdexcept>
#include <utility>

namespace mkv::test {

StreamSynchronizer SyncFaults::synchronizer(StreamSynchronizer wait) const {
  return [state = mState, wait = std::move(wait)](cudaStream_t stream) {
    cudaError_t const status = wait ? wait(stream) : cudaSuccess;  // device work finishes first
    ++state->calls;
    bool fail = state->failAt > 0 && (state->calls == state->failAt ||
                                      (state->persistent && state->calls > state->failAt));
    if (state->throwsLeft > 0) {
      --state->throwsLeft;
      ++state->throws;
      throw std::runtime_error("injected synchronizer exception");
    }
    if (state->failuresLeft > 0) {
      --state->failuresLeft;
      fail = true;
    }
    if (fail) {
      ++state->failures;
      return cudaErrorUnknown;
    }
    return status;
  };
}

StreamSynchronizer SyncFaults::synchronizer(DeviceType device) const {
  return synchronizer(defaultStreamSynchronizer(device));
}

int32_t SyncFaults::disarm() {
  int32_t const left = mState->failuresLeft + mState->throwsLeft;
  mState->failuresLeft = 0;
  mState->throwsLeft = 0;
  mState->failAt = 0;
  mState->persistent = false;
  return left;
}

}  // namespace mkv::test
