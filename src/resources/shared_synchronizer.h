#pragma once
/// \file shared_synchronizer.h
/// One stream synchronisation for the backends that complete one composite operation together:
/// the two halves of a sliding-window reuse request (docs/architecture.md, "Sliding windows with
/// context reuse", "One synchronisation per completion point").
///
/// Thread-safety: single writer (the engine thread), like the backends' synchronisation.

#include <cstdint>

#include "mkv/cuda_types.h"
#include "mkv/stream.h"

namespace mkv::detail {

/// Wraps the runtime's StreamSynchronizer. Each backend is built with view(). Outside a scope a
/// view synchronises as the wrapped one does; inside an open Scope the first call for a stream
/// synchronises and every later call for the same stream returns that result without waiting
/// again, so a composite completion point waits once and a failure reaches every backend that
/// asks (each then poisons and quarantines, as after its own failed synchronisation).
class SharedSynchronizer {
 public:
  explicit SharedSynchronizer(StreamSynchronizer real);
  ~SharedSynchronizer() = default;
  SharedSynchronizer(SharedSynchronizer const&) = delete;
  SharedSynchronizer& operator=(SharedSynchronizer const&) = delete;

  /// The synchroniser to build each backend with (refers to this object: it must outlive them).
  StreamSynchronizer view();

  /// Opens a scope for its lifetime (nested scopes share the outermost); null does nothing.
  class Scope {
   public:
    explicit Scope(SharedSynchronizer* shared) noexcept;
    ~Scope();
    Scope(Scope const&) = delete;
    Scope& operator=(Scope const&) = delete;

   private:
    SharedSynchronizer* mShared;
  };

  /// Calls of the wrapped synchroniser so far.
  int64_t realSynchronizations() const noexcept { return mRealCalls; }

 private:
  cudaError_t synchronize(cudaStream_t stream);

  StreamSynchronizer mReal;
  int32_t mDepth = 0;
  bool mHasResult = false;  ///< a result of this scope is kept
  cudaStream_t mStream{};
  cudaError_t mResult = cudaSuccess;
  int64_t mRealCalls = 0;
};

}  // namespace mkv::detail
