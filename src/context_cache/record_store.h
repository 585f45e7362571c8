#pragma once
/// \file record_store.h
/// Published records with exact-key, hybrid-key and speculative-path indices, a recency list and
/// the eviction policy that orders them as victims.
///
/// Thread-safety: single writer; const members may run concurrently with each other only.

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "context_cache/cache_record.h"
#include "context_cache/eviction_policy.h"

namespace mkv {

/// What the eviction policy learns about a new record besides the record itself.
struct RecordInsertHint {
  bool reused = false;         ///< the publishing request reused cached blocks
  bool evictedPrefix = false;  ///< its lookup stopped at a recently evicted block
};

/// Owns CacheRecord values (not their resources: reference counts are the manager's job). Block
/// records are found by RecordKey, hybrid checkpoints by HybridKey (the two kinds live in separate
/// indices, so they may coexist for the same prefix), and block records with a spec state by every
/// prefix of their path (findLongestSpecPath). Records sit in one recency list (lruToMru) and in
/// the eviction policy, which orders them as victims by retention priority, then by its own rule
/// (victimOrder: LRU or S3-FIFO); insert, touch and erase are O(1) amortised (plus O(blocks) for
/// the spec-path index, O(log records) for a record whose retention expires). The store does not
/// enforce a record limit: the manager does. Pointers to records stay valid until the record is
/// erased.
class RecordStore {
 public:
  using LruList = std::list<CacheRecord>;

  /// `policy` orders the victims; `ghostCapacity`: keys S3-FIFO remembers after eviction.
  explicit RecordStore(EvictionPolicyKind policy = EvictionPolicyKind::kS3Fifo,
                       int32_t ghostCapacity = 1024);

  struct InsertResult {
    CacheRecord const* record = nullptr;  ///< the new record, or the existing duplicate
    bool inserted = false;
  };
  struct SpecPathMatch {
    CacheRecord const* record = nullptr;
    int32_t blockCount = 0;  ///< length of the matched prefix of the record's path
  };

  /// Validates `record` (CacheRecord::validate), assigns the next id and inserts it as MRU and
  /// into the policy. A record whose exact key (block record) or hybrid key (checkpoint) is
  /// already present is not inserted: the existing one is touched and returned with inserted =
  /// false. Strong exception guarantee.
  InsertResult insert(CacheRecord record, RecordInsertHint hint = {});

  CacheRecord const* get(RecordId id) const noexcept;
  /// Block record with exactly this key (hybrid checkpoints are not found here).
  CacheRecord const* find(RecordKey const& key) const noexcept;
  CacheRecord const* findHybrid(HybridKey const& key) const noexcept;
  /// The longest k <= maxBlocks such that a block record with a spec state has logical digests
  /// equal to keys[0, k); among several, the newest (highest id). O(maxBlocks) probes.
  std::optional<SpecPathMatch> findLongestSpecPath(std::span<Hash128 const> keys,
                                                   int32_t maxBlocks) const;
  /// Distinct exact lengths of stored hybrid checkpoints that are < `below`, longest first.
  std::vector<int32_t> hybridCheckpointLengths(int32_t below) const;

  /// Attaches a spec state to a block record without one (an upgrade) and touches it; the same
  /// state again only touches. Throws for an unknown id, a hybrid record, a draft path of the wrong
  /// length, or a different existing spec state. Strong exception guarantee.
  void setSpecState(RecordId id, SpecState state);
  /// Moves a record to the MRU end; a hit for the policy. A speculative record (a reuse point no
  /// prompt had come through again) takes its held priority: a prompt just did. Throws for an
  /// unknown id.
  void touch(RecordId id);
  /// A checkpoint superseded by a longer one of the prompt that restored it: unless a second
  /// prompt came through it (hits > 1), retention raised it above the default, or it is one
  /// already, it ranks as a speculation again (kMinRetentionPriority until a hit promotes it).
  /// Unknown ids are ignored.
  void demote(RecordId id) noexcept;
  /// Removes a record from every index, as if never inserted (a publication's rollback). Unknown
  /// ids are ignored.
  void erase(RecordId id) noexcept;
  /// Removes a record the cache evicts (the policy remembers it). Unknown ids are ignored.
  void evict(RecordId id) noexcept;
  /// Records whose retention expiry is <= now fall back to kDefaultRetentionPriority (and lose
  /// their expiry). Returns how many did.
  int32_t expireRetention(int64_t now) noexcept;
  /// The earliest retention expiry of a stored record, if any has one.
  std::optional<int64_t> nextRetentionExpiry() const noexcept;

  /// Calls fn(record) in victim order (lower priority first, then the policy's order) until it
  /// returns true; returns whether it did. Reads only.
  template <typename Fn>
  bool forEachVictim(Fn&& fn) const {
    return mPolicy->walkVictims([&](RecordSlot slot) -> bool {
      return fn(static_cast<CacheRecord const&>(*mBySlot[static_cast<std::size_t>(slot)]));
    });
  }
  /// The first record of the victim order; kNoRecord when empty.
  RecordId firstVictim() const;
  /// Every record id in victim order.
  std::vector<RecordId> victimOrder() const;
  EvictionPolicyKind policy() const noexcept { return mPolicy->kind(); }

  /// Records from least to most recently published or touched (the LRU policy's order within
  /// one priority; the victim order is forEachVictim's).
  LruList const& lruToMru() const noexcept { return mLru; }
  std::size_t size() const noexcept { return mLru.size(); }
  bool empty() const noexcept { return mLru.empty(); }

 private:
  struct SpecPathEntry {
    RecordId record;
    int32_t blockCount;
  };

  struct Entry {
    LruList::iterator record;
    RecordSlot slot = kNoRecordSlot;
  };

  void indexSpecPath(CacheRecord const& record);
  /// insert's first step: room for one more policy slot (tables grown geometrically); throws
  /// with nothing changed.
  void reserveSlot();
  /// insert's second step: the record at `nodeIt` (its id set, in a detached node) in the id,
  /// expiry and key (hybrid or spec path) indexes; each step is undone if a later one throws.
  void indexRecord(LruList::iterator nodeIt, std::optional<HybridKey> const& hybridKey);
  /// insert's last step (cannot fail: the tables were reserved): a slot for `stored` and its
  /// announcement to the eviction policy.
  void assignSlot(CacheRecord& stored, RecordInsertHint hint);
  void unindexSpecPath(RecordId id, std::span<Hash128 const> digests) noexcept;
  void remove(RecordId id, bool evicted) noexcept;

  RecordId mNextId = 1;
  LruList mLru;  ///< front = LRU
  std::unordered_map<RecordId, Entry> mById;
  std::unique_ptr<EvictionPolicy> mPolicy;
  std::vector<CacheRecord*> mBySlot;                 ///< null = free slot
  std::vector<RecordSlot> mFreeSlots;                ///< reused last-in first-out
  std::set<std::pair<int64_t, RecordId>> mExpiries;  ///< (retention expiry, record)
  std::unordered_map<RecordKey, RecordId, RecordKeyHasher> mByKey;
  std::unordered_map<HybridKey, RecordId, RecordKeyHasher> mByHybridKey;
  std::map<int32_t, int32_t> mHybridLengths;  ///< exact length -> number of checkpoints
  std::unordered_multimap<Hash128, SpecPathEntry, Hash128Hasher> mSpecPaths;
};

}  // namespace mkv
