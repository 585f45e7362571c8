#pragma once
/// \file request_handle.h
/// The handle of one admitted request of a KV backend (ContextCacheCoordinator,
/// BoundedSwaKVPageManager: each names it `Backend::RequestHandle`).

#include <cstdint>
#include <utility>

namespace mkv {

/// Move-only handle of one request admitted by `Owner`, which alone creates live ones (its
/// beginRequest). Destroying or move-assigning over a live handle abandons the request through
/// `Owner::abandon(id)`, which must be noexcept: it synchronises when device work is pending,
/// then releases what the request holds; a failed synchronisation poisons the backend and
/// quarantines the request instead. A handle is invalid (`valid()` false, `id()` 0) when
/// default-constructed, moved from, finished, abandoned or quarantined. Not thread-safe, like
/// its backend.
template <class Owner>
class RequestHandle {
 public:
  RequestHandle() = default;
  RequestHandle(RequestHandle&& other) noexcept
      : mOwner(std::exchange(other.mOwner, nullptr)), mId(std::exchange(other.mId, 0)) {}
  RequestHandle& operator=(RequestHandle&& other) noexcept {
    if (this != &other) {
      abandon();
      mOwner = std::exchange(other.mOwner, nullptr);
      mId = std::exchange(other.mId, 0);
    }
    return *this;
  }
  RequestHandle(RequestHandle const&) = delete;
  RequestHandle& operator=(RequestHandle const&) = delete;
  ~RequestHandle() { abandon(); }

  bool valid() const noexcept { return mOwner != nullptr; }
  /// The request's id (1, 2, ... in admission order; named by error messages), 0 once the
  /// handle is invalid.
  uint64_t id() const noexcept { return mId; }

 private:
  friend Owner;
  RequestHandle(Owner* owner, uint64_t id) noexcept : mOwner(owner), mId(id) {}
  /// Makes the handle invalid without abandoning (the owner finished or quarantined it).
  void invalidate() noexcept {
    mOwner = nullptr;
    mId = 0;
  }
  void abandon() noexcept {
    if (mOwner != nullptr) {
      static_assert(noexcept(mOwner->abandon(mId)), "Owner::abandon(id) must be noexcept");
      mOwner->abandon(mId);
      invalidate();
    }
  }

  Owner* mOwner = nullptr;
  uint64_t mId = 0;
};

}  // namespace mkv
