#pragma once
/// \file record_store.h
/// Published records with exact-key, hybrid-key and speculative-path indices and an O(1) LRU.
///
/// Thread-safety: single writer; const members may run concurrently with each other only.

#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "mkv/context_cache/cache_record.h"

namespace mkv {

/// Owns CacheRecord values (not their resources: reference counts are the manager's job). Block
/// records are found by RecordKey, hybrid checkpoints by HybridKey (the two kinds live in separate
/// indices, so they may coexist for the same prefix), and block records with a spec state by every
/// prefix of their path (findLongestSpecPath). Records sit in one LRU list; insert, touch and
/// erase are O(1) (plus O(blocks) for the spec-path index). The store does not enforce a record
/// limit: the manager does. Pointers to records stay valid until the record is erased.
class RecordStore {
 public:
  using LruList = std::list<CacheRecord>;

  struct InsertResult {
    CacheRecord const* record = nullptr;  ///< the new record, or the existing duplicate
    bool inserted = false;
  };
  struct SpecPathMatch {
    CacheRecord const* record = nullptr;
    int32_t blockCount = 0;  ///< length of the matched prefix of the record's path
  };

  /// Validates `record` (CacheRecord::validate), assigns the next id and inserts it as MRU. A
  /// record whose exact key (block record) or hybrid key (checkpoint) is already present is not
  /// inserted: the existing one is touched and returned with inserted = false. Strong exception
  /// guarantee.
  InsertResult insert(CacheRecord record);

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
  /// Moves a record to the MRU end. Throws for an unknown id.
  void touch(RecordId id);
  /// Removes a record from every index. Unknown ids are ignored.
  void erase(RecordId id) noexcept;

  /// Records from least to most recently used.
  LruList const& lruToMru() const noexcept { return mLru; }
  std::size_t size() const noexcept { return mLru.size(); }
  bool empty() const noexcept { return mLru.empty(); }

 private:
  struct SpecPathEntry {
    RecordId record;
    int32_t blockCount;
  };

  void indexSpecPath(CacheRecord const& record);
  void unindexSpecPath(RecordId id, std::span<Hash128 const> digests) noexcept;

  RecordId mNextId = 1;
  LruList mLru;  ///< front = LRU
  std::unordered_map<RecordId, LruList::iterator> mById;
  std::unordered_map<RecordKey, RecordId, RecordKeyHasher> mByKey;
  std::unordered_map<HybridKey, RecordId, RecordKeyHasher> mByHybridKey;
  std::map<int32_t, int32_t> mHybridLengths;  ///< exact length -> number of checkpoints
  std::unordered_multimap<Hash128, SpecPathEntry, Hash128Hasher> mSpecPaths;
};

}  // namespace mkv
