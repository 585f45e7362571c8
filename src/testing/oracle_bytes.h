#pragma once
/// \file oracle_bytes.h
/// The byte function of the KV and recurrent oracles, shared by the host code (kv_oracle.cpp,
/// the host twin of the engine's step kernels) and the CUDA kernels (oracle_step.cu), so the
/// bytes written and expected on either device are the same function. Plain C++ that nvcc also
/// compiles for the device. Private to the testing library: not installed.
///
/// The row (digest d, layer l, half h) is the little-endian byte stream of the 64-bit words
/// w_i = mix64(seed + (i + 1) * kGolden), i = 0, 1, ..., with seed = rowSeed(d, l, h). Halves 0
/// and 1 are K and V of a KV row; 2 and 3 are a recurrent layer's state and conv rows.

#include <cstdint>

#if defined(__CUDACC__)
#define MKV_ORACLE_FN __host__ __device__ __forceinline__
#else
#define MKV_ORACLE_FN inline
#endif

namespace mkv::testing::oracle {

inline constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
inline constexpr uint64_t kRowSalt = 0xD1B54A32D192ED03ULL;

MKV_ORACLE_FN uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

/// A second 64-bit finaliser, for seeds and sampling (the identity seed, the reference engine's
/// tokens): independent of mix64, so a seed never equals a row word.
MKV_ORACLE_FN uint64_t seedMix(uint64_t x) {
  x ^= x >> 31;
  x *= 0x7FB5D329728EA185ULL;
  x ^= x >> 27;
  x *= 0x81DADEF4BC2DD44DULL;
  x ^= x >> 33;
  return x;
}

/// Seed of the row (digest, layer, half).
MKV_ORACLE_FN uint64_t rowSeed(uint64_t digest, int32_t layer, int32_t half) {
  return mix64(digest ^ (static_cast<uint64_t>(static_cast<uint32_t>(layer)) << 32) ^
               (static_cast<uint64_t>(static_cast<uint32_t>(half)) << 1) ^ kRowSalt);
}

/// Word `index` (bytes [8 * index, 8 * index + 8)) of the row with this seed.
MKV_ORACLE_FN uint64_t rowWord(uint64_t seed, int64_t index) {
  return mix64(seed + static_cast<uint64_t>(index + 1) * kGolden);
}

}  // namespace mkv::testing::oracle
