#pragma once
/// \file vector_copy.cuh
/// Private device helpers of the data-movement kernels: the widest access width a byte run
/// allows, and warp-cooperative copy / fill of one byte run with several independent loads in
/// flight per lane. Measurements behind the constants: docs/benchmarks.md, "The measurements
/// behind the kernels" and "Results (H200)".

#include <cstdint>
#include <type_traits>

namespace mkv::kernels::detail {

inline constexpr int32_t kWarpSize = 32;
/// Independent vector loads each lane issues before its first store. 16-byte accesses with >= 4
/// loads in flight per thread reached 0.95 x memcpy on an H200 (the design's tile kernel,
/// 2026-12-02; docs/benchmarks.md, "The measurements behind the kernels"). Measured with these
/// kernels on an H200 (docs/benchmarks.md, "Results (H200)", 2026-12-03): page gather 0.94-0.95 x
/// memcpy, scatter-gather 0.91-0.92, sequential 0.97, 2-64 KiB row gather 0.892-0.944 at
/// n = 32768 (40 registers at 16 B, no spills).
inline constexpr int32_t kLoadsInFlight = 4;
/// Bytes one warp moves per work unit at full width: 32 lanes x 4 loads x 16 B. Rows up to this
/// size get one warp each; larger rows and pages are split into units of this size.
inline constexpr int32_t kWarpChunkBytes = kWarpSize * kLoadsInFlight * 16;

/// Unsigned type of exactly `Width` bytes.
template <int Width>
struct VecOf;
template <>
struct VecOf<16> {
  using Type = uint4;
};
template <>
struct VecOf<8> {
  using Type = uint2;
};
template <>
struct VecOf<4> {
  using Type = unsigned int;
};
template <>
struct VecOf<2> {
  using Type = unsigned short;
};
template <>
struct VecOf<1> {
  using Type = unsigned char;
};
template <int Width>
using Vec = typename VecOf<Width>::Type;

/// Largest power of two <= 16 that divides `bits` (the OR of every address and size a copy
/// uses): the access width at which all its accesses are naturally aligned.
__host__ __device__ __forceinline__ int32_t accessWidth(uint64_t bits) {
  bits |= 16;
  return static_cast<int32_t>(bits & (~bits + 1));
}

__host__ __device__ __forceinline__ uint64_t addressBits(void const* pointer) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(pointer));
}

/// `Width` bytes each equal to `byte`.
template <int Width>
__device__ __forceinline__ Vec<Width> splat(uint8_t byte) {
  unsigned int const word = 0x01010101u * byte;
  if constexpr (Width == 16) {
    return make_uint4(word, word, word, word);
  } else if constexpr (Width == 8) {
    return make_uint2(word, word);
  } else {
    return static_cast<Vec<Width>>(word);
  }
}

template <int Width, bool ReadOnly>
__device__ __forceinline__ Vec<Width> loadVec(Vec<Width> const* address) {
  if constexpr (ReadOnly) {
    return __ldg(address);
  } else {
    return *address;
  }
}

/// The warp copies `bytes` (<= kWarpChunkBytes) bytes from `src` to `dst`; `lane` is the
/// caller's lane. Requires `Width` to divide both addresses and `bytes`, and the ranges not to
/// overlap. At 16 B a lane issues its kLoadsInFlight loads, then its stores, in one pass;
/// narrower widths take more passes over the chunk.
/// ReadOnly: nothing writes `src` while the kernel runs (allows the read-only data path).
template <int Width, bool ReadOnly>
__device__ __forceinline__ void warpCopy(uint8_t* dst, uint8_t const* src, uint32_t bytes,
                                         int32_t lane) {
  using V = Vec<Width>;
  constexpr uint32_t kPassVectors = kWarpSize * kLoadsInFlight;
  constexpr int32_t kPasses = kWarpChunkBytes / (kPassVectors * Width);
  auto const* from = reinterpret_cast<V const*>(src);
  auto* to = reinterpret_cast<V*>(dst);
  uint32_t const count = bytes / Width;
#pragma unroll 1
  for (int32_t pass = 0; pass < kPasses; ++pass) {
    uint32_t const first = pass * kPassVectors + static_cast<uint32_t>(lane);
    V values[kLoadsInFlight];
#pragma unroll
    for (int32_t k = 0; k < kLoadsInFlight; ++k) {
      uint32_t const i = first + k * kWarpSize;
      if (i < count) {
        values[k] = loadVec<Width, ReadOnly>(from + i);
      }
    }
#pragma unroll
    for (int32_t k = 0; k < kLoadsInFlight; ++k) {
      uint32_t const i = first + k * kWarpSize;
      if (i < count) {
        to[i] = values[k];
      }
    }
  }
}

/// The warp writes `bytes` (<= kWarpChunkBytes) bytes equal to `byte` at `dst`. Requires
/// `Width` to divide `dst` and `bytes`.
template <int Width>
__device__ __forceinline__ void warpFill(uint8_t* dst, uint8_t byte, uint32_t bytes, int32_t lane) {
  using V = Vec<Width>;
  auto* to = reinterpret_cast<V*>(dst);
  V const value = splat<Width>(byte);
  uint32_t const count = bytes / Width;
  for (auto i = static_cast<uint32_t>(lane); i < count; i += kWarpSize) {
    to[i] = value;
  }
}

/// Calls `body(std::integral_constant<int, W>{})` with W = `width` (a value of accessWidth), so
/// a launcher instantiates its kernel once per access width and picks one at run time.
template <typename Body>
decltype(auto) withAccessWidth(int32_t width, Body&& body) {
  switch (width) {
    case 16:
      return body(std::integral_constant<int, 16>{});
    case 8:
      return body(std::integral_constant<int, 8>{});
    case 4:
      return body(std::integral_constant<int, 4>{});
    case 2:
      return body(std::integral_constant<int, 2>{});
    default:
      return body(std::integral_constant<int, 1>{});
  }
}

/// Calls `body` once per access width, so a loader can reach every instantiation of a kernel.
template <typename Body>
void forEachAccessWidth(Body&& body) {
  for (int32_t width : {16, 8, 4, 2, 1}) {
    withAccessWidth(width, body);
  }
}

/// Loads `kernel` on the current device now (cudaFuncGetAttributes forces the load that CUDA's
/// lazy loading would otherwise do at the first launch, where it may synchronise the context).
template <typename Kernel>
cudaError_t loadKernel(Kernel kernel) {
  cudaFuncAttributes attributes{};
  return cudaFuncGetAttributes(&attributes, kernel);
}

/// Folds launch statuses: the first error wins.
inline cudaError_t firstError(cudaError_t current, cudaError_t next) {
  return current != cudaSuccess ? current : next;
}

}  // namespace mkv::kernels::detail
