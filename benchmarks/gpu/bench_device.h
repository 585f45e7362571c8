#pragma once
/// \file bench_device.h
/// Device helpers of mkv_gpu_bench (benchmarks/gpu/bench_device.cu): random fill and a bitwise
/// check of a destination against a reference, both on the GPU. Not part of the library.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mkv::bench {

/// Fills `bytes` bytes at `dst` with pseudo-random 64-bit patterns derived from `seed`
/// (bf16 views of them contain NaNs and infinities on purpose).
void fillRandom(void* dst, int64_t bytes, uint64_t seed, cudaStream_t stream);

/// Checks `rows` rows of `rowBytes` bytes at `dst`: row r must equal row map[r] of `ref`, or
/// consist of 0xFF bytes when map[r] < 0. `map` is a device array of `rows` int64 entries.
/// Returns the number of mismatching 8-byte words (or bytes, when rowBytes is not a multiple
/// of 8). Synchronises with the stream.
uint64_t countMismatches(void const* dst, void const* ref, int64_t rowBytes, int64_t rows,
                         int64_t const* map, cudaStream_t stream);

}  // namespace mkv::bench
