#pragma once
/// \file fault_site.h
/// The one fault seam of the library: the sites where a CUDA step can fail, and the injector that
/// tests (and an engine's own fault drills) consult before each of them (docs/reliability.md,
/// "Fault injection").

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

#include "mkv/cuda_types.h"

namespace mkv {

/// A step whose failure the library handles. Each is consulted, through the FaultInjector, right
/// before (a synchronisation: right after waiting) the real step; kFaultSites says what a failure
/// there means.
enum class FaultSite : uint8_t {
  kStreamSynchronize,  ///< a backend's completion point waits for its stream
  kDeviceWriteLaunch,  ///< the launch that applies queued page-table rows and KV lengths
  kHostTierOffload,    ///< the host tier's copies of GPU pages to host pages
  kHostTierOnboard,    ///< the host tier's copies of host pages to GPU pages
  kHostTierOrder,      ///< the host tier orders a consumer stream after its copies
  kSnapshotCapture,    ///< a checkpoint capture (recurrent rows, partial page, hidden row)
  kPublication,        ///< a block-reuse request publishes its full blocks (keep last)
};

/// One row of kFaultSites.
struct FaultSiteInfo {
  FaultSite site;
  std::string_view name;     ///< the name errors carry ("host tier offload: cudaErrorUnknown")
  std::string_view failure;  ///< what a failure there does
};

/// Every fault site, in enum order: the one declaration the coverage test
/// (FaultSiteTest.EverySiteOfTheTableIsConsulted) and the docs follow.
inline constexpr FaultSiteInfo kFaultSites[] = {
    {FaultSite::kStreamSynchronize, "stream synchronize",
     "the synchronisation returns the status: the backend poisons and quarantines the request "
     "(docs/errors.md, \"Poison and quarantine\")"},
    {FaultSite::kDeviceWriteLaunch, "device write launch",
     "the flush throws mkv::Error naming InlinePatchBatch::flush and keeps every queued write for "
     "the next flush"},
    {FaultSite::kHostTierOffload, "host tier offload",
     "the transfer throws mkv::Error before enqueueing the offloads; the coordinator forgets those "
     "blocks and poisons"},
    {FaultSite::kHostTierOnboard, "host tier onboard",
     "the transfer throws mkv::Error before enqueueing the onboards; the coordinator poisons"},
    {FaultSite::kHostTierOrder, "host tier order",
     "orderBefore throws mkv::Error; the coordinator poisons"},
    {FaultSite::kSnapshotCapture, "snapshot capture",
     "the capture throws mkv::Error before its launch and its reservation is retired; the call "
     "that captures throws it (publishHybridMtpEndpoint: nothing changed)"},
    {FaultSite::kPublication, "publication",
     "the publication throws mkv::Error before publishing anything; finish logs it and still ends "
     "the request"},
};

/// The number of fault sites.
inline constexpr std::size_t kFaultSiteCount = sizeof(kFaultSites) / sizeof(kFaultSites[0]);

static_assert(
    [] {
      for (std::size_t i = 0; i < kFaultSiteCount; ++i) {
        if (static_cast<std::size_t>(kFaultSites[i].site) != i) {
          return false;
        }
      }
      return true;
    }(),
    "kFaultSites lists every FaultSite once, in enum order");
static_assert(kFaultSiteCount == static_cast<std::size_t>(FaultSite::kPublication) + 1,
              "a FaultSite without a row in kFaultSites");

/// kFaultSites' name of `site`.
constexpr std::string_view toString(FaultSite site) noexcept {
  auto const index = static_cast<std::size_t>(site);
  return index < kFaultSiteCount ? kFaultSites[index].name : std::string_view("unknown");
}

/// Consulted before each fault site: cudaSuccess lets the step run; any other status makes it fail
/// as a real CUDA failure there would (kFaultSites). Empty = no faults. Called on kCPU builds and
/// deployments too, so the host twin takes the same failure paths. May throw: a throw at
/// kStreamSynchronize counts as a failed synchronisation, elsewhere it propagates as the step's
/// error.
using FaultInjector = std::function<cudaError_t(FaultSite)>;

}  // namespace mkv
