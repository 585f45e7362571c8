#pragma once
/// \file stream.h
/// Stream synchronisation hook and device queries.

#include <cstdint>
#include <functional>

#include "mkv/cuda_types.h"
#include "mkv/types.h"

namespace mkv {

/// Waits until all work enqueued on a stream has finished; returns its CUDA status.
/// Managers and coordinators take one at construction. Every call of it is a host-visible
/// completion point. Failures are injected through the fault seam instead
/// (FaultSite::kStreamSynchronize, mkv/fault_site.h; docs/errors.md, "Poison and quarantine").
using StreamSynchronizer = std::function<cudaError_t(cudaStream_t)>;

/// kGPU: calls cudaStreamSynchronize. kCPU: returns cudaSuccess (host work is synchronous).
StreamSynchronizer defaultStreamSynchronizer(DeviceType deviceType);

/// True when the library was built with CUDA and at least one device is visible.
bool cudaDeviceAvailable() noexcept;

/// CUDA devices visible to the process; 0 in a build without CUDA or when none is.
int32_t cudaDeviceCount() noexcept;

/// Makes `device` the calling thread's current CUDA device (cudaSetDevice): a tensor-parallel rank
/// creates its runtime, and makes every call of it, with its device current. Throws mkv::Error
/// naming this call for a device outside [0, cudaDeviceCount()) or a CUDA failure.
void setCurrentCudaDevice(int32_t device);

}  // namespace mkv
