#pragma once
/// \file oracle_step_units.h
/// The work units of the step kernels, shared by the CUDA kernels (oracle_step.cu) and their
/// host twins (oracle_step.cpp). A unit is done by `threads` cooperating threads; thread `tid`
/// handles the words tid, tid + threads, ... of every row, so the twin (threads = 1) and the
/// kernel do exactly the same byte work. Each share returns the minimum key of what it found;
/// the caller reduces the shares of a unit and publishes the result. Private to the testing
/// library.

#include <cstdint>
#include <cstring>

#include "testing/oracle_bytes.h"
#include "testing/oracle_step.h"

namespace mkv::testing::oracle {

MKV_ORACLE_FN uint64_t minKey(uint64_t a, uint64_t b) { return a < b ? a : b; }

MKV_ORACLE_FN int32_t firstSetByte(uint64_t diff) {
#if defined(__CUDA_ARCH__)
  return (__ffsll(static_cast<long long>(diff)) - 1) / 8;
#else
  return __builtin_ctzll(diff) / 8;
#endif
}

/// Loads `n` (1..8) little-endian bytes.
MKV_ORACLE_FN uint64_t loadWord(uint8_t const* p, int64_t n) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
#if defined(__CUDA_ARCH__)
    return *reinterpret_cast<uint64_t const*>(p);
#else
    uint64_t v = 0;
    std::memcpy(&v, p, 8);
    return v;
#endif
  }
  uint64_t v = 0;
  for (int64_t i = 0; i < n; ++i) {
    v |= static_cast<uint64_t>(p[i]) << (8 * i);
  }
  return v;
}

MKV_ORACLE_FN void storeWord(uint8_t* p, int64_t n, uint64_t v) {
  if (n == 8 && (reinterpret_cast<uintptr_t>(p) & 7) == 0) {
#if defined(__CUDA_ARCH__)
    *reinterpret_cast<uint64_t*>(p) = v;
#else
    std::memcpy(p, &v, 8);
#endif
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    p[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

MKV_ORACLE_FN uint64_t byteMask(int64_t n) {
  return n >= 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * n)) - 1;
}

/// Index of the range of `ranges[0, count)` holding flat position `flat` (ranges are in flat
/// order).
MKV_ORACLE_FN int64_t findRange(OracleRange const* ranges, int64_t count, int64_t flat) {
  int64_t lo = 0;
  int64_t hi = count - 1;
  while (lo < hi) {
    int64_t const mid = (lo + hi + 1) / 2;
    if (ranges[mid].firstFlat <= flat) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

template <typename T>
MKV_ORACLE_FN T const* planArray(uint8_t const* plan, int64_t offset) {
  return reinterpret_cast<T const*>(plan + offset);
}

/// Row of the digest store holding the digests `pool` reads for resident `slot`.
MKV_ORACLE_FN int64_t digestRow(OracleGeometry const& geometry, int32_t pool, int32_t slot) {
  return static_cast<int64_t>(slot) + (pool == kOracleDraftPool ? geometry.draftPlaneRow : 0);
}

/// Whether verify-list position `flat` lies in the draft pool.
MKV_ORACLE_FN bool isDraftPosition(uint8_t const* plan, OracleStepHeader const& header,
                                   int64_t flat) {
  OracleRange const* ranges = planArray<OracleRange>(plan, header.verifiesOffset);
  return ranges[findRange(ranges, header.numVerifies, flat)].pool == kOracleDraftPool;
}

/// Page-table entry of `position` of row `slot` (-1 past the table's width).
MKV_ORACLE_FN int32_t pageEntry(OraclePoolGeometry const& pool, int32_t slot, int64_t position) {
  int64_t const logical = position / pool.tokensPerPage;
  if (logical >= pool.maxPagesPerSeq) {
    return -1;
  }
  return pool.table[static_cast<int64_t>(slot) * 2 * pool.maxPagesPerSeq + logical];
}

MKV_ORACLE_FN uint8_t* tokenRow(OraclePoolGeometry const& pool, int32_t layer, int32_t half,
                                int32_t page, int64_t position) {
  return pool.layers[layer] + half * pool.halfBytes + static_cast<int64_t>(page) * pool.pageBytes +
         (position % pool.tokensPerPage) * pool.tokenBytes;
}

/// Writes write-list position `flat` (every layer, both halves). Returns the write-fault key
/// when the position has no page (only thread 0 reports), kNoKey otherwise.
MKV_ORACLE_FN uint64_t writeUnitShare(OracleGeometry const& geometry, uint8_t const* plan,
                                      OracleStepHeader const& header, int64_t flat, int32_t tid,
                                      int32_t threads) {
  OracleRange const* ranges = planArray<OracleRange>(plan, header.writesOffset);
  OracleRange const& range = ranges[findRange(ranges, header.numWrites, flat)];
  int64_t const position = range.begin + (flat - range.firstFlat);
  OraclePoolGeometry const& pool = geometry.pools[range.pool];
  int32_t const page = pageEntry(pool, range.slot, position);
  if (page < 0 || page >= pool.numPages) {
    return tid == 0 ? (static_cast<uint64_t>(flat) << 32) | static_cast<uint32_t>(page) : kNoKey;
  }
  uint64_t const digest =
      planArray<uint64_t>(plan, header.digestsOffset)[range.digestIndex + (flat - range.firstFlat)];
  int64_t const words = (pool.tokenBytes + 7) / 8;
  for (int32_t lh = 0; lh < 2 * pool.numLayers; ++lh) {
    uint64_t const seed = oracle::rowSeed(digest, lh / 2, lh % 2);
    uint8_t* row = tokenRow(pool, lh / 2, lh % 2, page, position);
    for (int64_t w = tid; w < words; w += threads) {
      int64_t const n = pool.tokenBytes - 8 * w < 8 ? pool.tokenBytes - 8 * w : 8;
      storeWord(row + 8 * w, n, oracle::rowWord(seed, w));
    }
  }
  return kNoKey;
}

/// Copies store chunk `chunk` of the staged digests into the digest store.
MKV_ORACLE_FN void storeUnitShare(OracleGeometry const& geometry, uint8_t const* plan,
                                  OracleStepHeader const& header, int64_t chunk, int32_t tid,
                                  int32_t threads) {
  OracleRange const* ranges = planArray<OracleRange>(plan, header.storesOffset);
  uint64_t const* digests = planArray<uint64_t>(plan, header.digestsOffset);
  int64_t const first = chunk * kOracleStoreChunk;
  int64_t const last = first + kOracleStoreChunk < header.storePositions ? first + kOracleStoreChunk
                                                                         : header.storePositions;
  for (int64_t flat = first + tid; flat < last; flat += threads) {
    OracleRange const& range = ranges[findRange(ranges, header.numStores, flat)];
    int64_t const offset = flat - range.firstFlat;
    geometry.digestStore[digestRow(geometry, range.pool, range.slot) * geometry.storePitch +
                         range.begin + offset] = digests[range.digestIndex + offset];
  }
}

/// Whether recurrent-list item `item` is a boundary hidden row.
MKV_ORACLE_FN bool isHiddenItem(uint8_t const* plan, OracleStepHeader const& header, int64_t item) {
  return (planArray<OracleRecurrentItem>(plan, header.recurrentOffset)[item].flags &
          kOracleRecurrentHidden) != 0;
}

/// A boundary hidden item: compares the row with the row of fromDigest (when verified), then
/// writes the row of toDigest, word by word. Returns the minimum mismatch key of this thread's
/// words.
MKV_ORACLE_FN uint64_t hiddenUnitShare(OracleGeometry const& geometry,
                                       OracleRecurrentItem const& it, int64_t item, int32_t tid,
                                       int32_t threads) {
  OracleHiddenGeometry const& hidden = geometry.hidden;
  int64_t const bytes = hidden.rowBytes;
  uint8_t* row = hidden.rows + bytes * it.slot;
  uint64_t const fromSeed = oracle::rowSeed(it.fromDigest, 0, kOracleHiddenHalf);
  uint64_t const toSeed = oracle::rowSeed(it.toDigest, 0, kOracleHiddenHalf);
  uint64_t key = kNoKey;
  int64_t const words = (bytes + 7) / 8;
  for (int64_t w = tid; w < words; w += threads) {
    int64_t const n = bytes - 8 * w < 8 ? bytes - 8 * w : 8;
    uint8_t* p = row + 8 * w;
    if ((it.flags & kOracleRecurrentVerify) != 0) {
      uint64_t const want = oracle::rowWord(fromSeed, w) & byteMask(n);
      uint64_t const found = loadWord(p, n);
      if (found != want) {
        int32_t const b = firstSetByte(found ^ want);
        key =
            minKey(key, (static_cast<uint64_t>(item) << 48) |
                            (static_cast<uint64_t>(8 * w + b) << 8) | ((found >> (8 * b)) & 0xFF));
      }
    }
    storeWord(p, n, oracle::rowWord(toSeed, w));
  }
  return key;
}

/// Recurrent item `item`: compares every state and conv row with the state after fromLength
/// (when verified), then writes the state after toLength, word by word. Returns the minimum
/// mismatch key of this thread's words.
MKV_ORACLE_FN uint64_t recurrentUnitShare(OracleGeometry const& geometry, uint8_t const* plan,
                                          OracleStepHeader const& header, int64_t item, int32_t tid,
                                          int32_t threads) {
  OracleRecurrentItem const& it =
      planArray<OracleRecurrentItem>(plan, header.recurrentOffset)[item];
  if ((it.flags & kOracleRecurrentHidden) != 0) {
    return hiddenUnitShare(geometry, it, item, tid, threads);
  }
  OracleRecurrentGeometry const& rec =
      (it.flags & kOracleRecurrentSnapshot) != 0 ? geometry.snapshots : geometry.recurrent;
  uint64_t key = kNoKey;
  for (int32_t lk = 0; lk < 2 * rec.numLayers; ++lk) {
    int32_t const layer = lk / 2;
    bool const conv = (lk % 2) == 1;
    int64_t const bytes = conv ? rec.convBytes : rec.stateBytes;
    uint8_t* row = (conv ? rec.conv[layer] : rec.state[layer]) + bytes * it.slot;
    uint64_t const fromSeed = oracle::rowSeed(it.fromDigest, layer, conv ? 3 : 2);
    uint64_t const toSeed = oracle::rowSeed(it.toDigest, layer, conv ? 3 : 2);
    int64_t const words = (bytes + 7) / 8;
    for (int64_t w = tid; w < words; w += threads) {
      int64_t const n = bytes - 8 * w < 8 ? bytes - 8 * w : 8;
      uint8_t* p = row + 8 * w;
      if ((it.flags & kOracleRecurrentVerify) != 0) {
        uint64_t const want = (it.flags & kOracleRecurrentFromZero) != 0
                                  ? 0
                                  : oracle::rowWord(fromSeed, w) & byteMask(n);
        uint64_t const found = loadWord(p, n);
        if (found != want) {
          int32_t const b = firstSetByte(found ^ want);
          key = minKey(key,
                       (static_cast<uint64_t>(item) << 48) | (static_cast<uint64_t>(lk) << 40) |
                           (static_cast<uint64_t>(8 * w + b) << 8) | ((found >> (8 * b)) & 0xFF));
        }
      }
      storeWord(p, n, (it.flags & kOracleRecurrentToZero) != 0 ? 0 : oracle::rowWord(toSeed, w));
    }
  }
  return key;
}

/// Verifies verify-list position `flat` (every layer, both halves). Returns this thread's
/// minimum mismatch key; `pageKey` receives flat(32) | page entry.
MKV_ORACLE_FN uint64_t verifyUnitShare(OracleGeometry const& geometry, uint8_t const* plan,
                                       OracleStepHeader const& header, int64_t flat, int32_t tid,
                                       int32_t threads, uint64_t* pageKey) {
  OracleRange const* ranges = planArray<OracleRange>(plan, header.verifiesOffset);
  OracleRange const& range = ranges[findRange(ranges, header.numVerifies, flat)];
  int64_t const position = range.begin + (flat - range.firstFlat);
  OraclePoolGeometry const& pool = geometry.pools[range.pool];
  int32_t const page = pageEntry(pool, range.slot, position);
  *pageKey = (static_cast<uint64_t>(flat) << 32) | static_cast<uint32_t>(page);
  uint64_t const flatKey = static_cast<uint64_t>(flat) << 34;
  if (page < 0 || page >= pool.numPages) {
    return tid == 0 ? flatKey : kNoKey;
  }
  uint64_t const digest =
      geometry.digestStore[digestRow(geometry, range.pool, range.slot) * geometry.storePitch +
                           position];
  int64_t const words = (pool.tokenBytes + 7) / 8;
  uint64_t key = kNoKey;
  for (int32_t lh = 0; lh < 2 * pool.numLayers; ++lh) {
    uint64_t const seed = oracle::rowSeed(digest, lh / 2, lh % 2);
    uint8_t const* row = tokenRow(pool, lh / 2, lh % 2, page, position);
    for (int64_t w = tid; w < words; w += threads) {
      int64_t const n = pool.tokenBytes - 8 * w < 8 ? pool.tokenBytes - 8 * w : 8;
      uint64_t const want = oracle::rowWord(seed, w) & byteMask(n);
      uint64_t const found = loadWord(row + 8 * w, n);
      if (found != want) {
        int32_t const b = firstSetByte(found ^ want);
        key =
            minKey(key, flatKey | (static_cast<uint64_t>(1 + lh) << 24) |
                            (static_cast<uint64_t>(8 * w + b) << 8) | ((found >> (8 * b)) & 0xFF));
      }
    }
    if (key != kNoKey) {
      break;  // the first wrong (layer, half) of this thread's words is its minimum
    }
  }
  return key;
}

}  // namespace mkv::testing::oracle
