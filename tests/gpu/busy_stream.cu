#include "busy_stream.h"

#include <cuda_runtime.h>

#include <cstdint>

#include "gpu_parity.h"

namespace mkv::gputest {
namespace {

__device__ uint64_t globalTimerNanoseconds() {
  uint64_t now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

/// One thread spins until `nanoseconds` have passed on the GPU's global timer.
__global__ void spinKernel(uint64_t nanoseconds) {
  uint64_t const start = globalTimerNanoseconds();
  while (globalTimerNanoseconds() - start < nanoseconds) {
  }
}

}  // namespace

BusyStream::BusyStream(bool blocking) {
  cudaOk(cudaStreamCreateWithFlags(&mStream, blocking ? cudaStreamDefault : cudaStreamNonBlocking),
         "cudaStreamCreate");
  cudaFuncAttributes attributes{};
  cudaOk(cudaFuncGetAttributes(&attributes, spinKernel), "load spinKernel");
}

BusyStream::~BusyStream() {
  (void)cudaStreamSynchronize(mStream);
  (void)cudaStreamDestroy(mStream);
}

void BusyStream::occupy(std::chrono::milliseconds duration) {
  auto const nanoseconds = static_cast<uint64_t>(duration.count()) * 1000000ULL;
  spinKernel<<<1, 1, 0, mStream>>>(nanoseconds);
  cudaOk(cudaGetLastError(), "spinKernel launch");
}

cudaError_t BusyStream::query() const { return cudaStreamQuery(mStream); }

void BusyStream::drain() { cudaOk(cudaStreamSynchronize(mStream), "cudaStreamSynchronize"); }

}  // namespace mkv::gputest
