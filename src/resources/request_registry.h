#pragma once
/// \file request_registry.h
/// The request registry both KV backends (ContextCacheCoordinator, BoundedSwaKVPageManager) keep
/// (not installed): id allocation, the live requests, the quarantine, the poison flag, and the
/// one way a request leaves (finish, abandonment, shutdown's drain). One request's path through
/// the layers: docs/architecture.md.
///
/// `Request` needs `uint64_t id`, `bool needsSynchronization() const noexcept` (device work may
/// still read or write its rows) and `sequences`, each with `resident.slot`.

#include <spdlog/spdlog.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "mkv/logging.h"
#include "mkv/types.h"

namespace mkv::detail {

template <class Request>
class RequestRegistry {
 public:
  using Requests = std::span<std::unique_ptr<Request> const>;

  /// `owner` names the backend in log lines ("BoundedSwaKVPageManager"); a static string.
  explicit RequestRegistry(char const* owner) noexcept : mOwner(owner) {}
  /// Terminates the process when requests are still active or quarantined: their pages may
  /// still be read or written by kernels (a lifetime bug of the integrator).
  ~RequestRegistry() {
    if (!mActive.empty() || !mQuarantine.empty()) {
      logger()->critical("{} destroyed with {} active and {} quarantined requests", mOwner,
                         mActive.size(), mQuarantine.size());
      std::terminate();
    }
  }
  RequestRegistry(RequestRegistry const&) = delete;
  RequestRegistry& operator=(RequestRegistry const&) = delete;

  // ---------------------------------------------------------------- admission

  /// The id the next published request must carry (1, 2, ... in admission order).
  uint64_t nextId() const noexcept { return mNextId; }
  /// Reserves what publish() and any later quarantine() need, so neither allocates; call it
  /// before the admission's first change (throws std::bad_alloc only, changing nothing).
  void reserveAdmission() {
    mActive.reserve(mActive.size() + 1);
    mQuarantine.reserve(mQuarantine.size() + mActive.size() + 1);
  }
  /// Makes `request` (whose id is nextId()) live after reserveAdmission(); returns its id.
  uint64_t publish(std::unique_ptr<Request> request) noexcept {
    uint64_t const id = mNextId++;
    request->id = id;
    mActive.push_back(std::move(request));  // capacity reserved
    return id;
  }

  // ---------------------------------------------------------------- lookup

  /// The live request `id`, or nullptr (finished, abandoned, quarantined, never admitted).
  Request* find(uint64_t id) const noexcept {
    for (auto const& active : mActive) {
      if (active->id == id) {
        return active.get();
      }
    }
    return nullptr;
  }
  Requests active() const noexcept { return mActive; }
  Requests quarantined() const noexcept { return mQuarantine; }
  /// Whether a quarantined request holds resident row `slot`.
  bool quarantineHolds(CacheSlot slot) const noexcept {
    for (auto const& request : mQuarantine) {
      for (auto const& sequence : request->sequences) {
        if (sequence.resident.slot == slot) {
          return true;
        }
      }
    }
    return false;
  }
  /// Requests quarantined since construction (drained ones included).
  uint64_t quarantinedTotal() const noexcept { return mQuarantinedTotal; }

  // ---------------------------------------------------------------- poison

  bool poisoned() const noexcept { return mPoisoned; }
  /// A failed synchronisation, launch or row update: admissions are refused until shutdown().
  void poison() noexcept { mPoisoned = true; }

  // ---------------------------------------------------------------- leaving

  /// Removes live request `id` from the registry (nullptr when it is not live).
  std::unique_ptr<Request> detach(uint64_t id) noexcept {
    for (auto it = mActive.begin(); it != mActive.end(); ++it) {
      if ((*it)->id == id) {
        std::unique_ptr<Request> detached = std::move(*it);
        mActive.erase(it);
        return detached;
      }
    }
    return nullptr;
  }
  /// Keeps `request` (pages, rows, slots and all) until drainQuarantine(), and poisons: device
  /// work may still touch what it holds. Null: no-op.
  void quarantine(std::unique_ptr<Request> request) noexcept {
    if (request == nullptr) {
      return;
    }
    mPoisoned = true;
    ++mQuarantinedTotal;
    mQuarantine.push_back(std::move(request));  // capacity reserved at admission
  }
  /// The live request `id` goes to the quarantine (after its synchronisation failed).
  void quarantine(uint64_t id) noexcept { quarantine(detach(id)); }

  /// Detaches live request `id` for a finish or an abandonment: when it needsSynchronization(),
  /// `synchronize()` (a noexcept bool() of the backend, which poisons on failure) runs first, and
  /// a failure quarantines the request and returns nullptr; so does an id that is not live.
  template <class Synchronize>
  std::unique_ptr<Request> detachSettled(uint64_t id, Synchronize&& synchronize) noexcept {
    std::unique_ptr<Request> detached = detach(id);
    if (detached != nullptr && detached->needsSynchronization() && !synchronize()) {
      quarantine(std::move(detached));
      return nullptr;
    }
    return detached;
  }

  /// Gives a detached, settled request's resources back: `clearRows(Requests)` (here the one
  /// request) clears and uploads its page-table rows (may throw), then `freeResources(Request&)`
  /// (noexcept) returns its pages and resident rows. When clearing throws, the request is logged
  /// (naming `call`) and quarantined instead; returns false then.
  template <class ClearRows, class FreeResources>
  bool release(std::unique_ptr<Request> request, char const* call, ClearRows&& clearRows,
               FreeResources&& freeResources) noexcept {
    if (!clearRowsOrLog(call, [&] { clearRows(Requests(&request, 1)); })) {
      quarantine(std::move(request));
      return false;
    }
    freeResources(*request);
    return true;
  }

  /// Abandonment (a live handle destroyed or replaced): detachSettled(), then release(); a
  /// request that cannot be settled or cleared is quarantined. Publishes nothing.
  template <class Synchronize, class ClearRows, class FreeResources>
  void abandon(uint64_t id, Synchronize&& synchronize, ClearRows&& clearRows,
               FreeResources&& freeResources) noexcept {
    std::unique_ptr<Request> abandoned = detachSettled(id, synchronize);
    if (abandoned != nullptr) {
      release(std::move(abandoned), "RequestHandle (abandonment)", clearRows, freeResources);
    }
  }

  /// shutdown()'s drain: when requests are quarantined, `synchronize()`, then
  /// `clearRows(Requests)` clears and uploads every quarantined request's rows at once (may
  /// throw), then `freeResources(Request&)` for each, and the quarantine is emptied. False
  /// (quarantine kept, still poisoned) when the synchronisation fails or clearing throws; else
  /// the poison is cleared and true.
  template <class Synchronize, class ClearRows, class FreeResources>
  bool drainQuarantine(char const* call, Synchronize&& synchronize, ClearRows&& clearRows,
                       FreeResources&& freeResources) noexcept {
    if (!mQuarantine.empty()) {
      if (!synchronize() || !clearRowsOrLog(call, [&] { clearRows(Requests(mQuarantine)); })) {
        return false;
      }
      for (auto& request : mQuarantine) {
        freeResources(*request);
      }
      mQuarantine.clear();
    }
    mPoisoned = false;
    return true;
  }

 private:
  template <class Clear>
  bool clearRowsOrLog(char const* call, Clear&& clear) const noexcept {
    try {
      clear();
      return true;
    } catch (std::exception const& error) {
      logger()->error("{}::{}: clearing rows failed: {}", mOwner, call, error.what());
    } catch (...) {
      logger()->error("{}::{}: clearing rows failed (unknown exception)", mOwner, call);
    }
    return false;
  }

  char const* mOwner;
  std::vector<std::unique_ptr<Request>> mActive;
  std::vector<std::unique_ptr<Request>> mQuarantine;
  uint64_t mNextId = 1;
  uint64_t mQuarantinedTotal = 0;
  bool mPoisoned = false;
};

}  // namespace mkv::detail
