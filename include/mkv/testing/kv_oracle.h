#pragma once
/// \file kv_oracle.h
/// The KV oracle of the testing kit (docs/integration.md, "Checking your own wiring"):
/// deterministic KV contents that depend on the whole prefix, written and verified through the
/// page table.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/snapshot_storage.h"
#include "mkv/types.h"

namespace mkv::testing {

/// Chained 64-bit digest of every prefix of a sequence: digests[p] covers positions [0, p].
/// `positionKeys[p]` is whatever identifies position p (the token id, mixed with the digest
/// of the media item covering it); `seed` identifies everything else the KV depends on
/// (cache salt, LoRA adapter). Equal prefixes under equal seeds give equal digests; any
/// difference anywhere earlier changes every later digest.
class PrefixDigests {
 public:
  explicit PrefixDigests(uint64_t seed = 0) : mSeed(seed) {}
  /// Appends positions; O(keys.size()).
  void extend(std::span<uint64_t const> positionKeys);
  /// Appends token ids as position keys.
  void extendTokens(std::span<int32_t const> tokens);
  /// Drops positions beyond `length`.
  void truncate(int64_t length);

  int64_t size() const noexcept { return static_cast<int64_t>(mDigests.size()); }
  uint64_t at(int64_t position) const { return mDigests.at(static_cast<std::size_t>(position)); }
  std::span<uint64_t const> values() const noexcept { return mDigests; }
  uint64_t seed() const noexcept { return mSeed; }

 private:
  uint64_t mSeed;
  std::vector<uint64_t> mDigests;
};

/// The seed of PrefixDigests for one identity: the KV of a prefix depends on the LoRA adapter and
/// the cache salt as well as on its tokens. Equal names give equal seeds; different ones give
/// unrelated seeds, so a prefix reused across identities reads wrong bytes. The reference engine
/// and the test suites seed their sequences with it.
uint64_t identitySeed(std::string_view loraWeightsName, std::string_view cacheSalt) noexcept;

/// Result of a verification: positions compared, how many held wrong bytes, and a description
/// of the first mismatch (layer, half, position, page, expected vs found first differing byte).
struct OracleReport {
  int64_t positionsChecked = 0;
  int64_t mismatches = 0;
  std::string firstMismatch;
  bool ok() const noexcept { return mismatches == 0; }
};

/// Writes and verifies KV bytes of one pool through one page table.
///
/// The bytes of (layer l, half h, position p) are a pseudo-random stream seeded by
/// (digest of prefix [0, p], l, h): reused KV is correct only if it was produced for exactly
/// the same prefix. The oracle resolves position p of resident row `slot` through the
/// *device mirror* of the page table (so a missing upload is caught) at logical page
/// p / tokensPerPage, row p % tokensPerPage. Works for kCPU and kGPU pools (GPU pages are
/// staged through host memory with synchronous copies: a test tool, not a fast path).
class KvOracle {
 public:
  KvOracle(KVCachePool& pool, KVPageTable const& table);

  /// Writes positions [begin, end) of row `slot` as an engine execution would.
  /// Throws mkv::Error when a position's page-table entry is empty or digests are too short.
  void write(CacheSlot slot, PrefixDigests const& digests, int64_t begin, int64_t end);
  /// Verifies positions [begin, end) of row `slot`; an empty entry counts as a mismatch.
  OracleReport verify(CacheSlot slot, PrefixDigests const& digests, int64_t begin,
                      int64_t end) const;

  /// Expected bytes of one token row (tokenBytes of the pool) for (digest, layer, half).
  static void expectedRow(uint64_t digest, int32_t layer, int32_t half, std::span<uint8_t> out);

 private:
  PageId resolve(CacheSlot slot, int64_t position, std::vector<int32_t> const& row) const;
  std::vector<int32_t> deviceRow(CacheSlot slot) const;

  KVCachePool& mPool;
  KVPageTable const& mTable;
};

/// Writes and verifies the recurrent rows of one RecurrentStatePool, the recurrent counterpart of
/// KvOracle. The state of a resident after executing positions [0, length) is, in every layer's
/// state and conv row, a pseudo-random stream seeded by (digest of prefix [0, length - 1],
/// layer, row kind); before any position executed (length 0) both rows are zero. So a restored
/// checkpoint passes only if it holds the state of exactly the same prefix, and a sequence that
/// reuses nothing must start from zeroed rows. Works for kCPU and kGPU pools (synchronous host
/// staging; a test tool).
class RecurrentOracle {
 public:
  explicit RecurrentOracle(RecurrentStatePool& pool) : mPool(pool) {}

  /// Sets the rows of `slot` to the state after positions [0, length) (an execution's result).
  /// Throws mkv::Error for a slot out of range or a length beyond the digests.
  void write(CacheSlot slot, PrefixDigests const& digests, int64_t length);
  /// Sets row `snapshotSlot` of `snapshots`' recurrent slabs to the state after [0, length), as
  /// an engine's scan captures a reuse point (ReusePointCapture). Throws mkv::Error for a slot
  /// out of range, a length beyond the digests, or slabs of another layout than the pool's.
  void writeSnapshot(SnapshotStorage& snapshots, int32_t snapshotSlot, PrefixDigests const& digests,
                     int64_t length);
  /// Compares the rows of `slot` with the state after [0, length). The report counts one
  /// position (the state) and at most one mismatch, described by layer, row kind and byte.
  OracleReport verify(CacheSlot slot, PrefixDigests const& digests, int64_t length) const;

  /// Expected bytes of one layer's state (conv = false) or conv row after the prefix `digest`.
  static void expectedRow(uint64_t digest, int32_t layer, bool conv, std::span<uint8_t> out);

 private:
  /// Writes the state after [0, length) into row `row` of every layer's state and conv buffers.
  template <typename StateOf, typename ConvOf>
  void writeRows(char const* call, int64_t row, PrefixDigests const& digests, int64_t length,
                 StateOf&& stateOf, ConvOf&& convOf);
  void expected(PrefixDigests const& digests, int64_t length, int32_t layer, bool conv,
                std::span<uint8_t> out) const;

  RecurrentStatePool& mPool;
};

}  // namespace mkv::testing
