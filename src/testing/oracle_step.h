#pragma once
/// \file oracle_step.h
/// The step kernels of the reference engine (docs/integration.md, "Checking your own wiring"):
/// the KV (and recurrent) writes of a whole engine step in one launch, the oracle verification of
/// every position the step's attention reads in one launch, and a snapshot of the KV-length rows
/// in one launch, each with a host twin that does the same work on CPU tensors with bit-identical
/// results. Plain C++ (compiles with g++ and nvcc). Private to the testing library: not installed.
///
/// A step is described by a *plan*: one contiguous byte buffer (OracleStepHeader, the length
/// snapshot area, then the staged ranges, write ranges, verify ranges, recurrent items and the
/// staged prefix digests), built on the host in pinned memory and uploaded with one copy. The
/// header starts with the OracleResult the kernels fill in (zero counts, all-ones keys as
/// uploaded); it and the length snapshot are the only bytes copied back.
///
/// Every "key" is a 64-bit value whose minimum over all findings of a launch is the finding the
/// sequential host loop would report first, so the GPU and the twin agree on it:
///   KV mismatch   flat(30) | code(10) | byte(16) | found(8), code = 0 (no page) or 1 + 2*layer +
///   half KV page       flat(32) | page entry as uint32 (32) write fault   flat(32) | page entry as
///   uint32 (32) recurrent     item(16) | 2*layer + conv(8) | byte(32) | found(8) (a boundary
///   hidden item: the same with 0 for the layer byte)
/// where `flat` is the position's index in the step's verify (or write) list, in list order.

#include <cstdint>

#include "mkv/cuda_types.h"

namespace mkv::testing::oracle {

inline constexpr int32_t kOracleMaxLayers = 256;           ///< per KV pool
inline constexpr int32_t kOracleMaxRecurrentLayers = 128;  ///< state and conv rows each
inline constexpr int64_t kOracleMaxTokenBytes = int64_t{1} << 16;
inline constexpr int64_t kOracleMaxFlat = int64_t{1} << 30;  ///< positions per list and step
inline constexpr int32_t kOracleMaxItems = 1 << 16;          ///< recurrent items per step
inline constexpr uint64_t kNoKey = ~uint64_t{0};
/// KV pools the kernels address: 0 full attention, 1 sliding window, 2 the draft model's (a
/// speculative deployment with a paged draft). The draft pool keeps its digests in a plane of
/// the digest store of its own (OracleGeometry::draftPlaneRow), since a draft row's bytes are a
/// function of another prefix than the base row at the same position.
inline constexpr int32_t kOraclePools = 3;
inline constexpr int32_t kOracleDraftPool = 2;

/// One paged KV pool as the kernels address it (see kernels::PagedBuffers).
struct OraclePoolGeometry {
  uint8_t* layers[kOracleMaxLayers];
  int32_t const* table;  ///< the page table's device mirror [tableRows, 2, maxPagesPerSeq]
  int32_t* kvLengths;    ///< the pool's KV-length tensor (capacity maxBatch)
  int64_t tokenBytes;
  int64_t pageBytes;
  int64_t halfBytes;  ///< numPages * pageBytes: the V half starts this far after K
  int32_t numLayers;
  int32_t numPages;
  int32_t tokensPerPage;
  int32_t maxPagesPerSeq;
  int32_t tableRows;
  int32_t present;
};

struct OracleRecurrentGeometry {
  uint8_t* state[kOracleMaxRecurrentLayers];
  uint8_t* conv[kOracleMaxRecurrentLayers];
  int64_t stateBytes;
  int64_t convBytes;
  int32_t numLayers;  ///< 0: no recurrent pool
  int32_t numSlots;
};

/// Everything fixed for an engine's lifetime; lives on the pools' device.
/// Hybrid-MTP: the engine's boundary hidden rows ([numRows, rowBytes / element size] of the
/// boundary hidden type, allocated once by the engine). Row (digest) has the bytes of the row
/// (digest, layer 0, half kOracleHiddenHalf): a row-seed no KV or recurrent row uses.
struct OracleHiddenGeometry {
  uint8_t* rows;
  int64_t rowBytes;
  int32_t numRows;  ///< 0: no hidden rows
  int32_t reserved;
};

/// The oracle half of a boundary hidden row (0, 1: K and V; 2, 3: recurrent state and conv).
inline constexpr int32_t kOracleHiddenHalf = 4;

struct OracleGeometry {
  OraclePoolGeometry pools[kOraclePools];  ///< full, sliding window, draft (kOraclePools)
  OracleRecurrentGeometry recurrent;
  /// The coordinator's snapshot slabs (same layout, one row per snapshot slot): the reuse points
  /// the engine captures during a prefill (kOracleRecurrentSnapshot items).
  OracleRecurrentGeometry snapshots;
  OracleHiddenGeometry hidden;
  /// [storeRows (+ storeRows with a draft pool), storePitch]: the digest of every staged position
  /// per slot; the draft pool's plane starts at row draftPlaneRow.
  uint64_t* digestStore;
  int64_t storePitch;
  int32_t storeRows;
  int32_t draftPlaneRow;  ///< storeRows with a draft pool, else 0
};

/// What the kernels report; uploaded as {0, kNoKey, ...} with every plan.
struct OracleResult {
  unsigned long long kvMismatches;  ///< verified positions with a wrong byte or no page
  unsigned long long kvKey;
  unsigned long long kvPageKey;
  unsigned long long writeFaultKey;
  unsigned long long recurrentMismatches;  ///< verified recurrent items with a wrong byte
  unsigned long long recurrentKey;
  unsigned long long draftMismatches;   ///< of kvMismatches, those in the draft pool
  unsigned long long hiddenMismatches;  ///< verified boundary hidden rows with a wrong byte
  unsigned long long hiddenKey;         ///< as recurrentKey, of the hidden items
};

enum OracleRangeKind : int32_t { kOracleAttention = 0, kOracleReusedPrefix = 1 };

/// Positions [begin, begin + count) of resident row `slot`. Stores copy their digests from the
/// plan's digest area (digestIndex = index of position `begin` there) into the digest store (the
/// plane of `pool`: the draft pool's, or the base pools' shared one); writes take their digests
/// from the same area; verifies read the digest store's plane of their pool.
struct OracleRange {
  int32_t pool;
  int32_t slot;
  int32_t begin;
  int32_t count;
  int32_t kind;
  int32_t reserved;
  int64_t digestIndex;
  int64_t firstFlat;  ///< sum of the counts of the ranges before it in its list
};

enum OracleRecurrentFlags : int32_t {
  kOracleRecurrentVerify = 1,  ///< compare with the state after fromLength tokens first
  kOracleRecurrentFromZero = 2,
  kOracleRecurrentToZero = 4,
  /// A boundary hidden row (Hybrid-MTP): `slot` is the row of OracleGeometry::hidden; it is
  /// compared with the row of fromDigest (with kOracleRecurrentVerify), then written as the
  /// row of toDigest.
  kOracleRecurrentHidden = 8,
  /// A reuse point: `slot` is a row of OracleGeometry::snapshots, written (never verified) with
  /// the state after toLength tokens.
  kOracleRecurrentSnapshot = 16,
};

/// A recurrent execution of resident `slot` from fromLength to toLength tokens: verify the rows
/// hold the state after fromLength (optional), then write the state after toLength. With
/// kOracleRecurrentHidden, the same for one boundary hidden row.
struct OracleRecurrentItem {
  int32_t slot;
  int32_t flags;
  int32_t fromLength;
  int32_t toLength;
  uint64_t fromDigest;
  uint64_t toDigest;
};

struct OracleStepHeader {
  OracleResult result;
  int64_t numStores;
  int64_t numWrites;
  int64_t numVerifies;
  int64_t numRecurrent;
  int64_t storePositions;
  int64_t writePositions;
  int64_t verifyPositions;
  int64_t storesOffset;  ///< byte offsets from the start of the plan
  int64_t writesOffset;
  int64_t verifiesOffset;
  int64_t recurrentOffset;
  int64_t lengthsOffset;  ///< int32 [kOraclePools, storeRows]: the KV-length rows, snapshotted
  int64_t digestsOffset;
};

/// Digests one store work unit copies.
inline constexpr int64_t kOracleStoreChunk = 1024;

/// Work units of the write launch: write positions, then store chunks, then recurrent items.
inline int64_t oracleWriteUnits(OracleStepHeader const& header) {
  return header.writePositions +
         (header.storePositions + kOracleStoreChunk - 1) / kOracleStoreChunk + header.numRecurrent;
}

/// Host twins: the same work as the kernels, sequentially, on host pointers.
void oracleWriteHost(OracleGeometry const& geometry, uint8_t* plan);
void oracleVerifyHost(OracleGeometry const& geometry, uint8_t* plan);
/// Copies rows [0, rows[p]) of pool p's KV-length tensor into the plan's length snapshot.
void oracleLengthsHost(OracleGeometry const& geometry, uint8_t* plan,
                       int32_t const rows[kOraclePools]);

/// CUDA launches on `stream` (device pointers; `header` is the host copy of the plan's header,
/// for the grid size). Defined only in a build with CUDA.
cudaError_t oracleWriteCuda(OracleGeometry const* geometry, uint8_t* plan,
                            OracleStepHeader const& header, cudaStream_t stream);
cudaError_t oracleVerifyCuda(OracleGeometry const* geometry, uint8_t* plan,
                             OracleStepHeader const& header, cudaStream_t stream);
cudaError_t oracleLengthsCuda(OracleGeometry const* geometry, uint8_t* plan, int64_t lengthsOffset,
                              int32_t rowsFull, int32_t rowsSwa, int32_t rowsDraft,
                              cudaStream_t stream);

}  // namespace mkv::testing::oracle
