/// The fault seam's helpers (core/faults.h).
#include "core/faults.h"

#include <fmt/format.h>

#include <string>
#include <utility>

#include "core/device.h"

namespace mkv::detail {

void injectFault(FaultInjector const& faults, FaultSite site, std::string_view call,
                 bool nameSite) {
  cudaError_t const status = consultFaults(faults, site);
  if (status != cudaSuccess) {
    checkCuda(status, nameSite ? fmt::format("{}: {}", call, toString(site)) : std::string(call));
  }
}

StreamSynchronizer withSyncFaults(StreamSynchronizer synchronizer, FaultInjector faults) {
  if (!faults) {
    return synchronizer;
  }
  return [synchronizer = std::move(synchronizer),
          faults = std::move(faults)](cudaStream_t stream) -> cudaError_t {
    cudaError_t const status = synchronizer(stream);
    cudaError_t const injected = faults(FaultSite::kStreamSynchronize);
    return status != cudaSuccess ? status : injected;
  };
}

FaultInjector withoutSite(FaultInjector faults, FaultSite site) {
  if (!faults) {
    return faults;
  }
  return [faults = std::move(faults), site](FaultSite asked) {
    return asked == site ? cudaSuccess : faults(asked);
  };
}

}  // namespace mkv::detail
