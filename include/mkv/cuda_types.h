#pragma once
/// \file cuda_types.h
/// The two CUDA runtime types the public API names: `cudaStream_t` and `cudaError_t`.
///
/// A build with CUDA (MKV_WITH_CUDA=1) takes them from `<cuda_runtime_api.h>`. A host-only
/// build (MKV_WITH_CUDA=0) declares layout-compatible stand-ins, so integrators and CI can
/// compile the whole library without a CUDA toolkit. Only the error values the library
/// itself produces are declared in the stand-in.

#if MKV_WITH_CUDA
#include <cuda_runtime_api.h>
#else
// NOLINTBEGIN(readability-identifier-naming): CUDA's own names, declared for host-only builds
struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorNotSupported = 801,
  cudaErrorUnknown = 999,
};
using cudaError_t = cudaError;
// NOLINTEND(readability-identifier-naming)
#endif
