#pragma once
/// \file cache_request_lease.h
/// One request sequence's hold on context-cache resources (docs/context_cache.md, "Refcounts and
/// pools").
///
/// Thread-safety: a lease is used on its manager's single writer thread. A lease must not outlive
/// its manager (the manager terminates the process if destroyed while leases are live).

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/cache_record.h"
#include "context_cache/resource_pools.h"
#include "context_cache/reuse_plan.h"
#include "mkv/types.h"

namespace mkv {

class ContextCacheManager;

/// Snapshot slots reserved by a producer for capturing a hybrid checkpoint. They are the lease's
/// (active references) until retired with ContextCacheManager::retireHybridSnapshotReservation.
struct SnapshotReservation {
  SnapshotSlot recurrentSlot = -1;
  std::optional<SnapshotSlot> partialKvSlot;
  friend bool operator==(SnapshotReservation const&, SnapshotReservation const&) = default;
};

/// Holds one *active* reference on every resource a sequence uses: the shared pages it reuses
/// (pins), its private pages, the snapshot slots it restores from and the ones it reserved for
/// capture. Published resources survive through the records' *cache* references; release()
/// (or destruction) drops the active references, and every resource left without any reference
/// returns to its free ring. Publication never rebinds a lease: its page lists never change
/// except by growth.
///
/// Move-only; moving and destroying never throw. A default-constructed or released lease is
/// invalid (every accessor returns empty values).
class CacheRequestLease {
 public:
  CacheRequestLease() noexcept = default;
  CacheRequestLease(CacheRequestLease&& other) noexcept;
  /// Releases what *this holds, then takes over `other`.
  CacheRequestLease& operator=(CacheRequestLease&& other) noexcept;
  CacheRequestLease(CacheRequestLease const&) = delete;
  CacheRequestLease& operator=(CacheRequestLease const&) = delete;
  ~CacheRequestLease() { release(); }

  /// Drops every active reference; idempotent.
  void release() noexcept;
  bool valid() const noexcept { return mManager != nullptr; }
  /// The manager this lease belongs to (nullptr when invalid).
  ContextCacheManager const* manager() const noexcept { return mManager; }

  ReuseMode mode() const noexcept { return mMode; }
  /// False for pure-recurrent hybrid leases (no KV pages at all).
  bool hasAttention() const noexcept { return mHasAttention; }
  /// Base KV pages in logical order: the reused (shared) prefix, then private pages, then grown
  /// pages. Page-table row of the sequence.
  std::span<PageId const> basePages() const noexcept { return mBasePages; }
  /// Draft KV pages in logical order (spec / Hybrid+MTP leases).
  std::span<PageId const> draftPages() const noexcept { return mDraftPages; }
  int32_t boundBasePageCount() const noexcept { return mBoundBasePages; }
  int32_t boundDraftPageCount() const noexcept { return mBoundDraftPages; }
  /// Block keys of the reused prefix; publications must agree with them.
  std::span<Hash128 const> boundDigests() const noexcept { return mBoundDigests; }
  /// The spec or hybrid record the plan reused (kNoRecord for block hits and cold plans).
  RecordId hitRecord() const noexcept { return mHitRecord; }
  std::optional<SpecReplayDependency> const& replayDependency() const noexcept {
    return mReplayDependency;
  }
  /// Restore sources of a hybrid hit, pinned until releaseRestoredHybridSnapshots.
  std::optional<SnapshotSlot> recurrentSnapshotSlot() const noexcept { return mHitRecurrent; }
  std::optional<SnapshotSlot> partialKvSnapshotSlot() const noexcept { return mHitPartial; }
  /// Capture reservations not yet retired.
  std::span<SnapshotReservation const> snapshotReservations() const noexcept {
    return mReservations;
  }

 private:
  friend class ContextCacheManager;

  void takeFrom(CacheRequestLease& other) noexcept;

  ContextCacheManager* mManager = nullptr;
  ReuseMode mMode = ReuseMode::kVanilla;
  bool mHasAttention = true;
  RecordId mHitRecord = kNoRecord;
  int32_t mBoundBasePages = 0;
  int32_t mBoundDraftPages = 0;
  std::vector<PageId> mBasePages;
  std::vector<PageId> mDraftPages;
  std::vector<Hash128> mBoundDigests;
  std::optional<SpecReplayDependency> mReplayDependency;
  std::optional<SnapshotSlot> mHitRecurrent;
  std::optional<SnapshotSlot> mHitPartial;
  std::vector<SnapshotReservation> mReservations;
  std::vector<RetentionRange> mRetention;  ///< the admitted request's, for its publications
  bool mEvictedPrefix = false;             ///< its lookup stopped at a recently evicted block
  /// The block record this lease's last chunk publication inserted (Publication::kChunk), which
  /// its next, longer publication replaces; kNoRecord when none is pending.
  RecordId mChunkRecord = kNoRecord;
  /// Host tier pages of the plan pinned between the pins and the onboarding (inside one acquire).
  std::vector<PageId> mHostPins;
};

}  // namespace mkv
