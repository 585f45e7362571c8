#pragma once
/// \file stream.h
/// Stream synchronisation hook and device queries.

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

}  // namespace mkv
