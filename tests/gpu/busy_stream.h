#pragma once
/// \file busy_stream.h
/// Unrelated GPU work of an engine: a non-blocking stream of its own kept busy by a kernel that
/// spins for a given time. The no-wait tests check by state (cudaStreamQuery), never by a clock,
/// that the library's calls did not wait for it.

#include <chrono>

#include "mkv/cuda_types.h"

namespace mkv::gputest {

class BusyStream {
 public:
  /// `blocking`: a stream created with cudaStreamDefault, which the legacy default stream
  /// (stream 0) waits for; otherwise cudaStreamNonBlocking.
  explicit BusyStream(bool blocking = false);
  /// Waits for the spinning kernel, then destroys the stream.
  ~BusyStream();
  BusyStream(BusyStream const&) = delete;
  BusyStream& operator=(BusyStream const&) = delete;

  /// Launches one kernel that spins on the GPU's global timer for `duration`; returns at once.
  void occupy(std::chrono::milliseconds duration);
  /// cudaStreamQuery of the stream: cudaErrorNotReady while the kernel still runs.
  cudaError_t query() const;
  /// Blocks until the stream is idle.
  void drain();
  cudaStream_t stream() const { return mStream; }

 private:
  cudaStream_t mStream = nullptr;
};

}  // namespace mkv::gputest
