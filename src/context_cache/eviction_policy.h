#pragma once
/// \file eviction_policy.h
/// The victim order of published records: retention priorities first, then a pluggable policy
/// (LRU, S3-FIFO) within a priority. docs/context_cache.md, "Eviction", has the design.
///
/// Thread-safety: single writer; walkVictims() only reads (no scratch), like the other const calls.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include "context_cache/block_hash.h"
#include "mkv/types.h"

namespace mkv {

/// Dense index of a record in its store (RecordStore hands them out and reuses them).
using RecordSlot = int32_t;
inline constexpr RecordSlot kNoRecordSlot = -1;

/// What a policy learns when a record enters the store.
struct PolicyInsert {
  RecordSlot slot = kNoRecordSlot;
  Hash128 key;         ///< the record key's terminal digest (what the S3-FIFO ghost remembers)
  int32_t weight = 1;  ///< resources the record references (pages and snapshot slots), >= 1
  int32_t priority = kDefaultRetentionPriority;
  /// The publishing request reused cached blocks: the record carries a prefix just referenced.
  bool reused = false;
  /// The publishing request's lookup stopped at a block evicted recently (a ghost hit on a block).
  bool evictedPrefix = false;
};

/// A non-owning reference to a `bool(RecordSlot)` callable (no allocation, unlike std::function).
class SlotVisitor {
 public:
  template <typename Fn>
  // NOLINTNEXTLINE(google-explicit-constructor,bugprone-forwarding-reference-overload): a callable
  requires(!std::is_same_v<std::remove_cvref_t<Fn>, SlotVisitor>) SlotVisitor(Fn&& fn)
  noexcept  // by reference; the constraint keeps copies away from it
      : mObject(const_cast<void*>(static_cast<void const*>(&fn))),
        mCall([](void* object, RecordSlot slot) {
          return (*static_cast<std::remove_reference_t<Fn>*>(object))(slot);
        }) {}
  bool operator()(RecordSlot slot) const { return mCall(mObject, slot); }

 private:
  void* mObject;
  bool (*mCall)(void*, RecordSlot);
};

/// Keeps the order in which records are evicted. The store reports every event (insert, hit,
/// eviction or removal, priority change); walkVictims() only reads. The victim order is: lower
/// retention priority first, then the policy's own order within one priority.
///
/// Events are O(1) amortised and allocate nothing once reserveSlots() covered the slots in use
/// (the store grows them geometrically); walkVictims() allocates nothing.
class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual EvictionPolicyKind kind() const noexcept = 0;
  /// Sizes the per-slot tables for slots [0, slots). Strong guarantee (may throw bad_alloc).
  virtual void reserveSlots(int32_t slots) = 0;
  /// A record entered the store in a free slot.
  virtual void onInsert(PolicyInsert const& insert) noexcept = 0;
  /// A record was used again (a hit that touches it, a duplicate publication).
  virtual void onHit(RecordSlot slot) noexcept = 0;
  /// A record left the store: `evicted` by the cache (S3-FIFO remembers it), otherwise removed
  /// by a publication's rollback (as if it had never been inserted).
  virtual void onErase(RecordSlot slot, bool evicted) noexcept = 0;
  /// The record now has `priority` (an expired retention falls back to the default); it joins
  /// that priority as its newest member.
  virtual void onPriorityChange(RecordSlot slot, int32_t priority) noexcept = 0;
  /// Calls visit(slot) for every record in victim order until it returns true; returns whether
  /// it did. Changes nothing observable.
  virtual bool walkVictims(SlotVisitor visit) const = 0;
};

/// A new, empty policy of `kind`. `ghostCapacity`: record keys S3-FIFO remembers after eviction
/// (ignored by LRU). Throws for an unknown kind or a negative capacity.
std::unique_ptr<EvictionPolicy> makeEvictionPolicy(EvictionPolicyKind kind, int32_t ghostCapacity);

/// The priority of a record whose last token is token `lastToken` (0-based) of its sequence: the
/// priority of the range holding it, else kDefaultRetentionPriority; `duration` is the range's.
struct RetentionChoice {
  int32_t priority = kDefaultRetentionPriority;
  std::optional<int64_t> duration;
};
RetentionChoice retentionOf(std::span<RetentionRange const> ranges, int64_t lastToken) noexcept;

/// Throws mkv::Error naming `call` for a priority outside [kMinRetentionPriority,
/// kMaxRetentionPriority], a negative start, an end not after its start, a duration <= 0, or
/// ranges that overlap or are not in ascending order (an open end must be the last range).
void requireValidRetention(char const* call, std::span<RetentionRange const> ranges);

}  // namespace mkv
