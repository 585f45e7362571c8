#pragma once
/// \file fault_arming.h
/// The fault injector of every suite (mkv::FaultInjector, mkv/fault_site.h): a runtime or part
/// given `injector()` reports every fault site it reaches here, and the test makes chosen calls
/// of a site fail (cudaErrorUnknown) or throw. The arming and counts name a site; without one they
/// are the synchronisations' (FaultSite::kStreamSynchronize), the site most suites drive. Copies
/// share one state, so a test keeps its FaultArming while the backend owns the std::function.
/// Single-threaded, like the backends' synchronisation.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "mkv/fault_site.h"

namespace mkv::test {

class FaultArming {
 public:
  /// The injector to give a runtime (KVCacheRuntimeConfig::faults) or a part: counts each call of
  /// a site and fails it when armed for that site; otherwise cudaSuccess.
  FaultInjector injector() const;

  /// The next `count` calls of `site` return cudaErrorUnknown (replaces what was still armed
  /// this way for it).
  void failNext(int32_t count = 1, FaultSite site = FaultSite::kStreamSynchronize) {
    at(site).failuresLeft = count;
  }
  /// The `call`-th call of `site` since construction (1-based) fails; with `fromThenOn` every
  /// later call fails too, until disarm(). 0 cancels.
  void failCall(int64_t call, bool fromThenOn = false,
                FaultSite site = FaultSite::kStreamSynchronize) {
    at(site).failAt = call;
    at(site).persistent = fromThenOn;
  }
  /// Every call of `site` from the next one on fails, until disarm().
  void failFromNow(FaultSite site) { failCall(calls(site) + 1, /*fromThenOn=*/true, site); }
  /// The next call of `site` throws std::runtime_error instead of returning.
  void throwNext(FaultSite site = FaultSite::kStreamSynchronize) { at(site).throwsLeft = 1; }
  /// Nothing fails or throws any more, at any site; returns how many failNext / throwNext were
  /// still armed.
  int32_t disarm();

  /// Calls of `site` so far, failed or not.
  int64_t calls(FaultSite site = FaultSite::kStreamSynchronize) const { return at(site).calls; }
  /// Calls of `site` that returned cudaErrorUnknown.
  int64_t failures(FaultSite site = FaultSite::kStreamSynchronize) const {
    return at(site).failures;
  }
  /// Calls of `site` that threw.
  int64_t throws(FaultSite site = FaultSite::kStreamSynchronize) const { return at(site).throws; }
  /// failNext() failures of `site` not consumed yet.
  int32_t pendingFailures(FaultSite site = FaultSite::kStreamSynchronize) const {
    return at(site).failuresLeft;
  }

 private:
  struct Site {
    int64_t calls = 0;
    int64_t failures = 0;
    int64_t throws = 0;
    int64_t failAt = 0;
    bool persistent = false;
    int32_t failuresLeft = 0;
    int32_t throwsLeft = 0;
  };
  using State = std::array<Site, kFaultSiteCount>;

  Site& at(FaultSite site) { return (*mState)[static_cast<std::size_t>(site)]; }
  Site const& at(FaultSite site) const { return (*mState)[static_cast<std::size_t>(site)]; }

  std::shared_ptr<State> mState = std::make_shared<State>();
};

}  // namespace mkv::test
