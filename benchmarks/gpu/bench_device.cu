/// Device helpers of mkv_gpu_bench: random fill and bitwise verification.
#include "bench_device.h"

#include <cstdio>
#include <cstdlib>

namespace mkv::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocks = 132 * 8;  // a few waves on an H200; grid-stride covers any size

__device__ uint64_t splitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fillKernel(uint8_t* dst, int64_t bytes, uint64_t seed) {
  int64_t const words = bytes / 8;
  int64_t const stride = int64_t{gridDim.x} * blockDim.x;
  auto* out = reinterpret_cast<uint64_t*>(dst);
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < words; i += stride) {
    out[i] = splitMix(seed ^ static_cast<uint64_t>(i));
  }
  for (int64_t i = words * 8 + int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    dst[i] = static_cast<uint8_t>(splitMix(seed + static_cast<uint64_t>(i)));
  }
}

template <typename Word>
__global__ void compareKernel(Word const* dst, Word const* ref, int64_t rowWords, int64_t rows,
                              int64_t const* map, unsigned long long* mismatches) {
  Word poison;
  memset(&poison, 0xFF, sizeof(Word));
  unsigned long long local = 0;
  int64_t const total = rowWords * rows;
  int64_t const stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t const row = i / rowWords;
    int64_t const source = map[row];
    Word const expected = source < 0 ? poison : ref[source * rowWords + (i - row * rowWords)];
    local += dst[i] != expected ? 1 : 0;
  }
  if (local != 0) {
    atomicAdd(mismatches, local);
  }
}

void check(cudaError_t status, char const* what) {
  if (status != cudaSuccess) {
    std::fprintf(stderr, "mkv_gpu_bench: %s: %s\n", what, cudaGetErrorString(status));
    std::exit(1);
  }
}

}  // namespace

void fillRandom(void* dst, int64_t bytes, uint64_t seed, cudaStream_t stream) {
  fillKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<uint8_t*>(dst), bytes, seed);
  check(cudaGetLastError(), "fillKernel");
}

uint64_t countMismatches(void const* dst, void const* ref, int64_t rowBytes, int64_t rows,
                         int64_t const* map, cudaStream_t stream) {
  static unsigned long long* counter = nullptr;
  if (counter == nullptr) {
    check(cudaMalloc(&counter, sizeof(*counter)), "cudaMalloc(counter)");
  }
  check(cudaMemsetAsync(counter, 0, sizeof(*counter), stream), "cudaMemsetAsync(counter)");
  if (rowBytes % 8 == 0) {
    compareKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<uint64_t const*>(dst),
                                                    static_cast<uint64_t const*>(ref), rowBytes / 8,
                                                    rows, map, counter);
  } else {
    compareKernel<<<kBlocks, kThreads, 0, stream>>>(static_cast<uint8_t const*>(dst),
                                                    static_cast<uint8_t const*>(ref), rowBytes,
                                                    rows, map, counter);
  }
  check(cudaGetLastError(), "compareKernel");
  unsigned long long result = 0;
  check(cudaMemcpyAsync(&result, counter, sizeof(result), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync(counter)");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(verify)");
  return result;
}

}  // namespace mkv::bench
