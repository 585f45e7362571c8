#include "context_cache/cache_request_lease.h"

#include <utility>

#include "context_cache/context_cache_manager.h"

namespace mkv {

CacheRequestLease::CacheRequestLease(CacheRequestLease&& other) noexcept { takeFrom(other); }

CacheRequestLease& CacheRequestLease::operator=(CacheRequestLease&& other) noexcept {
  if (this != &other) {
    release();
    takeFrom(other);
  }
  return *this;
}

void CacheRequestLease::takeFrom(CacheRequestLease& other) noexcept {
  // *this is in the released (default) state; `other` is left in it.
  mManager = std::exchange(other.mManager, nullptr);
  mMode = std::exchange(other.mMode, ReuseMode::kVanilla);
  mHasAttention = std::exchange(other.mHasAttention, true);
  mHitRecord = std::exchange(other.mHitRecord, kNoRecord);
  mBoundBasePages = std::exchange(other.mBoundBasePages, 0);
  mBoundDraftPages = std::exchange(other.mBoundDraftPages, 0);
  mBasePages = std::exchange(other.mBasePages, {});
  mDraftPages = std::exchange(other.mDraftPages, {});
  mBoundDigests = std::exchange(other.mBoundDigests, {});
  mReplayDependency = std::exchange(other.mReplayDependency, std::nullopt);
  mHitRecurrent = std::exchange(other.mHitRecurrent, std::nullopt);
  mHitPartial = std::exchange(other.mHitPartial, std::nullopt);
  mReservations = std::exchange(other.mReservations, {});
  mRetention = std::exchange(other.mRetention, {});
  mEvictedPrefix = std::exchange(other.mEvictedPrefix, false);
  mChunkRecord = std::exchange(other.mChunkRecord, kNoRecord);
  mHostPins = std::exchange(other.mHostPins, {});
}

void CacheRequestLease::release() noexcept {
  if (mManager == nullptr) {
    return;
  }
  mManager->releaseLease(*this);
  mManager = nullptr;
  mMode = ReuseMode::kVanilla;
  mHasAttention = true;
  mHitRecord = kNoRecord;
  mBoundBasePages = 0;
  mBoundDraftPages = 0;
  mBasePages = {};
  mDraftPages = {};
  mBoundDigests = {};
  mReplayDependency.reset();
  mHitRecurrent.reset();
  mHitPartial.reset();
  mReservations = {};
  mRetention = {};
  mEvictedPrefix = false;
  mChunkRecord = kNoRecord;
  mHostPins = {};
}

}  // namespace mkv
