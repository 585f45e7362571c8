#pragma once
/// \file sync_faults.h
/// The fault-injecting stream synchroniser of every suite: a backend created with
/// `synchronizer()` reports its synchronisations here, and the test makes chosen ones fail
/// (cudaErrorUnknown) or throw. Copies share one state, so a test keeps its SyncFaults while the
/// backend owns the std::function. Single-threaded, like the backends' synchronisation.

#include <cstdint>
#include <memory>

#include "mkv/stream.h"
#include "mkv/types.h"

namespace mkv::test {

class SyncFaults {
 public:
  /// A synchroniser that first waits with `wait` (empty: nothing to wait for, host tensors),
  /// then counts the call and fails it when armed; otherwise returns what `wait` returned.
  StreamSynchronizer synchronizer(StreamSynchronizer wait = {}) const;
  /// The device's real synchroniser (defaultStreamSynchronizer) with faults.
  StreamSynchronizer synchronizer(DeviceType device) const;

  /// The next `count` calls return cudaErrorUnknown (replaces what was still armed this way).
  void failNext(int32_t count = 1) { mState->failuresLeft = count; }
  /// The `call`-th call since construction (1-based) fails; with `fromThenOn` every later call
  /// fails too, until disarm(). 0 cancels.
  void failCall(int64_t call, bool fromThenOn = false) {
    mState->failAt = call;
    mState->persistent = fromThenOn;
  }
  /// The next call throws std::runtime_error instead of returning.
  void throwNext() { mState->throwsLeft = 1; }
  /// Nothing fails or throws any more; returns how many failNext / throwNext were still armed.
  int32_t disarm();

  /// Calls made so far, failed or not.
  int64_t calls() const { return mState->calls; }
  /// Calls that returned cudaErrorUnknown.
  int64_t failures() const { return mState->failures; }
  /// Calls that threw.
  int64_t throws() const { return mState->throws; }
  /// failNext() failures not consumed yet.
  int32_t pendingFailures() const { return mState->failuresLeft; }

 private:
  struct State {
    int64_t calls = 0;
    int64_t failures = 0;
    int64_t throws = 0;
    int64_t failAt = 0;
    bool persistent = false;
    int32_t failuresLeft = 0;
    int32_t throwsLeft = 0;
  };
  std::shared_ptr<State> mState = std::make_shared<State>();
};

}  // namespace mkv::test
