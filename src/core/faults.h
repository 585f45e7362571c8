#pragma once
/// \file faults.h
/// How the library consults its one fault seam (mkv::FaultInjector, include/mkv/fault_site.h).
/// Not installed.

#include <string_view>

#include "mkv/cuda_types.h"
#include "mkv/fault_site.h"
#include "mkv/stream.h"

namespace mkv::detail {

/// What `faults` says about `site`: cudaSuccess when it is empty.
inline cudaError_t consultFaults(FaultInjector const& faults, FaultSite site) {
  return faults ? faults(site) : cudaSuccess;
}

/// Before the step at `site`: when `faults` fails it, throws what checkCuda(status, what) throws
/// for a real CUDA failure of the step; `what` is `call` (as the step's real check names it), or
/// "<call>: <site name>" with `nameSite`. Allocates only when it throws (the allocation-fault
/// tests count the allocations of every call).
void injectFault(FaultInjector const& faults, FaultSite site, std::string_view call,
                 bool nameSite = false);

/// `synchronizer`, then `faults` at kStreamSynchronize (after waiting, so that the stream's work
/// has finished even when the synchronisation is made to fail): a real failure is returned as it
/// is, otherwise what the injector returns. Empty `faults`: `synchronizer` itself.
StreamSynchronizer withSyncFaults(StreamSynchronizer synchronizer, FaultInjector faults);

/// `faults` with `site` left out (it always succeeds there): for a part whose synchronisation
/// the caller has already given the faults (withSyncFaults before a SharedSynchronizer), so that
/// one completion point consults the injector once. Empty stays empty.
FaultInjector withoutSite(FaultInjector faults, FaultSite site);

}  // namespace mkv::detail
