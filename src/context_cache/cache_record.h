#pragma once
/// \file cache_record.h
/// A published, reusable prefix state: the endpoint of a chained prefix path
/// (docs/context_cache.md, "Eviction").
///
/// Thread-safety: plain value type.

#include <cstdint>
#include <optional>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/resource_pools.h"
#include "mkv/types.h"

namespace mkv {

/// Record ids are handed out by RecordStore from 1, monotonically; 0 is never a record.
using RecordId = uint64_t;
inline constexpr RecordId kNoRecord = 0;

/// Exact key of a record: the digest naming its whole path and its full-block count. For a plain
/// (block) record `terminal` is the last block key; for a hybrid checkpoint it is the checkpoint's
/// exact-prefix digest.
struct RecordKey {
  Hash128 terminal;
  int32_t fullBlockCount = 0;
  friend bool operator==(RecordKey const&, RecordKey const&) = default;
};

/// Key of a hybrid checkpoint: exact-prefix digest, exact token length and whether it is a
/// Hybrid-MTP checkpoint (paired draft state, boundary token private). A base-only checkpoint and
/// a Hybrid-MTP one of the same prefix and length are different records: a Hybrid-MTP plan never
/// uses a base-only one, and a plain plan only an unaligned Hybrid-MTP one (docs/context_cache.md,
/// "Hybrid-MTP endpoints"), so one must not block the other's publication.
struct HybridKey {
  Hash128 exactDigest;
  int32_t exactLength = 0;
  bool mtp = false;
  friend bool operator==(HybridKey const&, HybridKey const&) = default;
};

struct RecordKeyHasher {
  std::size_t operator()(RecordKey const& k) const noexcept {
    return Hash128Hasher{}(k.terminal) ^ static_cast<std::size_t>(k.fullBlockCount);
  }
  std::size_t operator()(HybridKey const& k) const noexcept {
    return Hash128Hasher{}(k.exactDigest) ^ static_cast<std::size_t>(k.exactLength) ^
           (k.mtp ? std::size_t{1} << 31 : 0);
  }
};

/// Speculative paired state: the draft KV pages of the record's blocks, produced together with
/// the base pages by one producer (never canonicalised across records).
struct SpecState {
  std::vector<PageId> draftPagePath;
  friend bool operator==(SpecState const&, SpecState const&) = default;
};

/// Speculations rank from kMinRetentionPriority to kMaxSpeculationRank (CacheRecord::speculative).
inline constexpr int32_t kMaxSpeculationRank = 16;

/// The retention priority of a speculation of `rank` whose retention gave it `heldPriority`: the
/// rank clamped to [kMinRetentionPriority, kMaxSpeculationRank], and below `heldPriority` (at
/// kMinRetentionPriority when that is already the lowest), so that a speculation never outranks
/// a proven record of its own priority. docs/context_cache.md, "Reuse points", says which rank a
/// point takes and why.
int32_t speculationPriority(int32_t rank, int32_t heldPriority) noexcept;

/// The rank of the reuse point `intervals` intervals into a prompt (intervals >= 1): r for
/// 2^r x odd, the points a budget keeps when it halves their density. Hybrid checkpoints and the
/// sliding windows before reuse points rank by it.
int32_t reusePointRank(int32_t intervals) noexcept;

/// One published record. It owns one cache reference on every resource it lists (resources()).
///
/// Kinds: a plain record (no exactCheckpointLength) reuses whole blocks; a hybrid checkpoint
/// (exactCheckpointLength set) reuses an exact length, possibly mid-page, and carries a recurrent
/// snapshot, a partial-KV snapshot iff its length does not end on a page boundary (attention
/// models; Hybrid+MTP always), and for pure-recurrent models no base pages at all.
struct CacheRecord {
  RecordId id = kNoRecord;
  RecordKey key;
  std::vector<Hash128> logicalBlockDigests;  ///< block keys of the path, key.fullBlockCount
  std::vector<PageId> basePagePath;    ///< canonical base page per block (or empty, see above)
  std::optional<SpecState> specState;  ///< paired draft path (speculative, Hybrid+MTP)
  std::optional<SnapshotSlot> recurrentSnapshotSlot;
  std::optional<SnapshotSlot> partialKvSnapshotSlot;
  std::optional<int32_t> exactCheckpointLength;
  /// A hybrid checkpoint kept at a reuse point inside a prompt (checkpointInterval), not at a
  /// prompt or decode end.
  bool reusePoint = false;
  /// A reuse point kept on speculation (an interval point or a chunk end, not a branch of cached
  /// content, or a superseded turn): it ranks at its speculationPriority(), below every record its
  /// retention would rank, until a hit or a second publication of it shows a prompt passing
  /// through it again; then it takes `heldPriority`, the priority its retention gave it.
  bool speculative = false;
  int32_t heldPriority = kDefaultRetentionPriority;
  /// A speculation's rank (speculationPriority); 0 for a superseded turn.
  int32_t speculationRank = 0;
  /// Times a prompt came through it since it was published (admissions that hit it, and
  /// publications of the same record): more than one proves a branch (RecordStore::demote).
  int32_t hits = 0;
  /// With token verification on, the checkpoint tokens its base pages do not cover (the partial
  /// tail; every token for pure-recurrent checkpoints), compared on every hybrid match.
  std::vector<int32_t> verificationTokens;
  /// Retention priority (kMinRetentionPriority..kMaxRetentionPriority; higher is evicted later)
  /// and, when it is not for the record's whole life, the retention clock's time at which it
  /// falls back to kDefaultRetentionPriority.
  int32_t retentionPriority = kDefaultRetentionPriority;
  std::optional<int64_t> retentionExpiry;

  bool isHybrid() const noexcept { return exactCheckpointLength.has_value(); }
  /// {key.terminal, *exactCheckpointLength, specState set} for hybrid records.
  std::optional<HybridKey> hybridKey() const noexcept;

  /// Every resource the record holds a cache reference on (base pages, draft pages, snapshots).
  template <typename Fn>
  void forEachResource(Fn&& fn) const {
    for (PageId page : basePagePath) {
      fn(ResourceId{ResourceType::kBaseKvPage, page});
    }
    if (specState) {
      for (PageId page : specState->draftPagePath) {
        fn(ResourceId{ResourceType::kDraftKvPage, page});
      }
    }
    if (recurrentSnapshotSlot) {
      fn(ResourceId{ResourceType::kRecurrentSnapshot, *recurrentSnapshotSlot});
    }
    if (partialKvSnapshotSlot) {
      fn(ResourceId{ResourceType::kPartialKvSnapshot, *partialKvSnapshotSlot});
    }
  }
  std::vector<ResourceId> resources() const;

  /// Throws mkv::Error naming the broken rule: a plain record needs >= 1 block and key.terminal ==
  /// the last logical digest; logical digests count == key.fullBlockCount; the base path has one
  /// page per block, or is empty for a hybrid checkpoint without attention; a spec path has one
  /// draft page per block; snapshot slots only on hybrid records, which need a recurrent slot and
  /// a positive exact length; ids non-negative; the retention priority in range.
  void validate() const;
};

}  // namespace mkv
