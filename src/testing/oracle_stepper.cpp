#include "testing/oracle_stepper.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

#include "core/check.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_page_table.h"
#include "mkv/snapshot_storage.h"
#include "testing/oracle_bytes.h"
#include "testing/oracle_step_units.h"

namespace mkv::testing::oracle {
namespace {

constexpr char const* kCall = "ReferenceEngine";

std::size_t align8(std::size_t bytes) { return (bytes + 7) / 8 * 8; }

uint8_t expectedByte(uint64_t digest, int32_t layer, int32_t half, int64_t byte) {
  uint64_t const word = oracle::rowWord(oracle::rowSeed(digest, layer, half), byte / 8);
  return static_cast<uint8_t>(word >> (8 * (byte % 8)));
}

void fillPool(OraclePoolGeometry& geometry, KVCachePool& pool, KVPageTable const& table) {
  MKV_REQUIRE(pool.numLayers() <= kOracleMaxLayers, kCall,
              "a pool of {} layers exceeds the {} the oracle addresses", pool.numLayers(),
              kOracleMaxLayers);
  MKV_REQUIRE(pool.tokenBytes() <= kOracleMaxTokenBytes, kCall,
              "token rows of {} bytes exceed the {} the oracle addresses", pool.tokenBytes(),
              kOracleMaxTokenBytes);
  for (int32_t l = 0; l < pool.numLayers(); ++l) {
    geometry.layers[l] = static_cast<uint8_t*>(pool.layer(l).rawPointer());
  }
  geometry.table = table.deviceTable().dataPointer<int32_t>();
  geometry.kvLengths = pool.kvLengths().dataPointer<int32_t>();
  geometry.tokenBytes = pool.tokenBytes();
  geometry.pageBytes = pool.pageBytes();
  geometry.halfBytes = pool.pageBytes() * pool.numPages();
  geometry.numLayers = pool.numLayers();
  geometry.numPages = pool.numPages();
  geometry.tokensPerPage = pool.tokensPerPage();
  geometry.maxPagesPerSeq = table.maxPagesPerSeq();
  geometry.tableRows = table.maxBatch();
  geometry.present = 1;
}

/// The state and conv rows of `layers` recurrent layers the oracle reads and writes: the
/// resident rows of the recurrent pool, or the snapshot slabs' rows (same row layout).
template <typename StateOf, typename ConvOf>
void fillRecurrent(OracleRecurrentGeometry& g, int32_t layers, StateOf&& stateOf, ConvOf&& convOf) {
  MKV_REQUIRE(layers <= kOracleMaxRecurrentLayers, kCall,
              "{} recurrent layers exceed the {} the oracle addresses", layers,
              kOracleMaxRecurrentLayers);
  for (int32_t l = 0; l < layers; ++l) {
    g.state[l] = static_cast<uint8_t*>(stateOf(l).rawPointer());
    g.conv[l] = static_cast<uint8_t*>(convOf(l).rawPointer());
  }
  g.stateBytes = stateOf(0).dim(1);
  g.convBytes = convOf(0).dim(1);
  g.numLayers = layers;
  g.numSlots = static_cast<int32_t>(stateOf(0).dim(0));
}

/// Reuse points one step can capture: every interval of every row's sequence, at most one per
/// snapshot slot (0 without a checkpoint interval or snapshot slabs).
std::size_t reusePointsPerStep(KVCacheRuntime const& runtime, OracleRecurrentGeometry const& g) {
  int32_t const interval = runtime.config().contextCache.checkpointInterval;
  if (interval <= 0 || g.numLayers == 0) {
    return 0;
  }
  int64_t const perRow = runtime.config().maxSequenceLength / interval;
  return static_cast<std::size_t>(std::min<int64_t>(
      {int64_t{g.numSlots}, perRow * runtime.config().maxBatchSize, int64_t{kOracleMaxItems} / 2}));
}

/// The Hybrid-MTP boundary hidden rows the engine keeps (`[rows, width]` on `device`).
void fillHidden(OracleHiddenGeometry& g, Tensor& hidden, DeviceType device) {
  MKV_REQUIRE(hidden.rank() == 2 && hidden.deviceType() == device && hidden.dim(0) > 0 &&
                  hidden.sizeBytes() / hidden.dim(0) <= kOracleMaxTokenBytes,
              kCall, "boundary hidden rows of {} bytes on the wrong device or too wide",
              hidden.sizeBytes());
  g.rows = static_cast<uint8_t*>(hidden.rawPointer());
  g.rowBytes = hidden.sizeBytes() / hidden.dim(0);
  g.numRows = static_cast<int32_t>(hidden.dim(0));
}

}  // namespace

OracleStepper::OracleStepper(KVCacheRuntime& runtime, bool recurrent, Tensor* hidden)
    : mDevice(runtime.config().deviceType), mDone(runtime.config().deviceType) {
  int32_t const rows = runtime.config().maxBatchSize;
  int64_t pitch = 0;
  KVCachePool* pools[kOraclePools] = {runtime.fullPool(), runtime.swaPool(), runtime.draftPool()};
  KVPageTable const* tables[kOraclePools] = {runtime.fullPageTable(), runtime.swaPageTable(),
                                             runtime.draftPageTable()};
  for (int32_t p = 0; p < kOraclePools; ++p) {
    if (pools[p] == nullptr) {
      continue;
    }
    MKV_REQUIRE(tables[p]->maxBatch() == rows, kCall, "page table of {} rows for {} resident slots",
                tables[p]->maxBatch(), rows);
    fillPool(mGeometry.pools[p], *pools[p], *tables[p]);
    pitch = std::max(pitch, int64_t{tables[p]->maxPagesPerSeq()} * pools[p]->tokensPerPage());
  }
  if (recurrent && runtime.recurrentState() != nullptr) {
    RecurrentStatePool& state = *runtime.recurrentState();
    fillRecurrent(
        mGeometry.recurrent, state.numLayers(),
        [&](int32_t l) -> Tensor& { return state.state(l); },
        [&](int32_t l) -> Tensor& { return state.conv(l); });
    ContextCacheCoordinator* cache = runtime.contextCache();
    SnapshotStorage* snapshots = cache != nullptr ? cache->snapshots() : nullptr;
    if (snapshots != nullptr && snapshots->config().recurrentSlots > 0) {
      fillRecurrent(
          mGeometry.snapshots, state.numLayers(),
          [&](int32_t l) -> Tensor& { return snapshots->recurrentStateSlab(l); },
          [&](int32_t l) -> Tensor& { return snapshots->recurrentConvSlab(l); });
    }
  }
  std::size_t const points = reusePointsPerStep(runtime, mGeometry.snapshots);
  if (hidden != nullptr) {
    fillHidden(mGeometry.hidden, *hidden, mDevice);
  }
  // A step's recurrent items: per row an execution and a boundary hidden row, and at most
  // kOracleMaxItems / 2 reuse points.
  MKV_REQUIRE(int64_t{rows} <= kOracleMaxItems / 4, kCall,
              "{} resident slots exceed the {} the oracle addresses", rows, kOracleMaxItems / 4);
  pitch = std::max<int64_t>(pitch, 1);
  int32_t const planes = hasDraft() ? 2 : 1;
  mDigestStore = Tensor({int64_t{planes} * rows, pitch}, DataType::kInt64, mDevice);
  mGeometry.digestStore = mDigestStore.dataPointer<uint64_t>();
  mGeometry.storePitch = pitch;
  mGeometry.storeRows = rows;
  mGeometry.draftPlaneRow = hasDraft() ? rows : 0;

  // Capacities of one step: per row and plane one staged range; per row one write per pool;
  // per row and pool one reused-prefix check plus up to three checks; per row one recurrent
  // execution and one boundary hidden row, and the reuse points;
  // every position of every row and plane.
  auto const r = static_cast<std::size_t>(rows);
  auto const p = static_cast<std::size_t>(planes);
  mMaxRanges = 4 * r * kOraclePools;
  mMaxDigests = p * r * static_cast<std::size_t>(pitch);
  mResultBytes = align8(sizeof(OracleStepHeader) + kOraclePools * r * sizeof(int32_t));
  mStagingBytes = mResultBytes + (p * r + kOraclePools * r + mMaxRanges) * sizeof(OracleRange) +
                  (2 * r + points) * sizeof(OracleRecurrentItem) + mMaxDigests * sizeof(uint64_t);
  mStaging = ::mkv::detail::HostBuffer(mStagingBytes, mDevice);
  std::memset(mStaging.data(), 0, mStagingBytes);
  mStores.reserve(p * r);
  mWrites.reserve(kOraclePools * r);
  mVerifies.reserve(mMaxRanges);
  mRecurrent.reserve(2 * r + points);  // per row an execution and a boundary hidden row; points
  mDigests.reserve(mMaxDigests);
  for (auto& lengths : mLengths) {
    lengths.reserve(r);
  }
  if (mDevice == DeviceType::kGPU) {
    mPlanDevice = Tensor({static_cast<int64_t>(mStagingBytes)}, DataType::kUInt8, mDevice);
    mGeometryDevice =
        Tensor({static_cast<int64_t>(sizeof(OracleGeometry))}, DataType::kUInt8, mDevice);
    ::mkv::detail::copyBytes(mGeometryDevice.rawPointer(), mDevice, &mGeometry, DeviceType::kCPU,
                             sizeof(OracleGeometry), nullptr);
    ::mkv::detail::synchronizeDevice();  // construction-time initialisation
  }
}

OracleStepper::~OracleStepper() {
  if (mPending) {
    try {
      mDone.synchronize();
    } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor reports nothing
    }
  }
}

void OracleStepper::requireCapacity(std::size_t used, std::size_t capacity,
                                    char const* what) const {
  MKV_REQUIRE(used <= capacity, kCall, "a step needs {} {} but the oracle holds {}", used, what,
              capacity);
}

void OracleStepper::begin() {
  if (mPending) {
    mDone.synchronize();
    mPending = false;
  }
  mStores.clear();
  mWrites.clear();
  mVerifies.clear();
  mRecurrent.clear();
  mDigests.clear();
  mHeader = OracleStepHeader{};
  mSubmitted = false;
  mSnapshot = false;
  mFindings.positionsChecked = 0;
  mFindings.kvMismatches = 0;
  mFindings.kvFirst.clear();
  mFindings.recurrentChecks = 0;
  mFindings.recurrentMismatches = 0;
  mFindings.recurrentFirst.clear();
  mFindings.draftChecked = 0;
  mFindings.draftMismatches = 0;
  mFindings.hiddenChecks = 0;
  mFindings.hiddenMismatches = 0;
  mFindings.hiddenFirst.clear();
  for (auto& lengths : mFindings.lengths) {
    lengths = nullptr;
  }
}

int64_t OracleStepper::stage(int32_t slot, int32_t begin, std::span<uint64_t const> digests,
                             int32_t pool) {
  auto const count = static_cast<int64_t>(digests.size());
  MKV_REQUIRE(slot >= 0 && slot < mGeometry.storeRows && begin >= 0 &&
                  begin + count <= mGeometry.storePitch,
              kCall, "positions [{}, {}) of slot {} are outside the oracle's {} x {}", begin,
              begin + count, slot, mGeometry.storeRows, mGeometry.storePitch);
  MKV_REQUIRE(pool >= 0 && pool < kOraclePools && (pool != kDraft || hasDraft()), kCall,
              "digests staged for pool {}, which the runtime does not have", pool);
  requireCapacity(mStores.size() + 1, mStores.capacity(), "staged ranges");
  requireCapacity(mDigests.size() + digests.size(), mMaxDigests, "staged digests");
  auto const index = static_cast<int64_t>(mDigests.size());
  mStores.push_back(OracleRange{pool, slot, begin, static_cast<int32_t>(count), kOracleAttention, 0,
                                index, mHeader.storePositions});
  mHeader.storePositions += count;
  mDigests.insert(mDigests.end(), digests.begin(), digests.end());
  return index;
}

void OracleStepper::write(int32_t pool, int32_t slot, int32_t begin, int32_t end, int64_t index) {
  MKV_REQUIRE(mGeometry.pools[pool].present != 0 && slot >= 0 && slot < mGeometry.storeRows &&
                  begin >= 0 && begin <= end && index >= 0 &&
                  index + (end - begin) <= static_cast<int64_t>(mDigests.size()),
              kCall, "write of positions [{}, {}) of slot {} from staged digest {} is invalid",
              begin, end, slot, index);
  if (begin == end) {
    return;
  }
  requireCapacity(mWrites.size() + 1, mWrites.capacity(), "write ranges");
  mWrites.push_back(OracleRange{pool, slot, begin, end - begin, kOracleAttention, 0, index,
                                mHeader.writePositions});
  mHeader.writePositions += end - begin;
}

void OracleStepper::verify(int32_t pool, int32_t slot, int32_t begin, int32_t end,
                           OracleRangeKind kind) {
  MKV_REQUIRE(mGeometry.pools[pool].present != 0 && slot >= 0 && slot < mGeometry.storeRows &&
                  begin >= 0 && begin <= end && end <= mGeometry.storePitch,
              kCall, "check of positions [{}, {}) of slot {} is invalid", begin, end, slot);
  if (begin == end) {
    return;
  }
  requireCapacity(mVerifies.size() + 1, mMaxRanges, "checked ranges");
  mVerifies.push_back(
      OracleRange{pool, slot, begin, end - begin, kind, 0, -1, mHeader.verifyPositions});
  mHeader.verifyPositions += end - begin;
  mFindings.draftChecked += pool == kDraft ? end - begin : 0;
  MKV_REQUIRE(mHeader.verifyPositions <= kOracleMaxFlat, kCall,
              "a step checks {} positions, more than the {} the oracle addresses",
              mHeader.verifyPositions, kOracleMaxFlat);
}

void OracleStepper::recurrent(int32_t slot, bool verify, int32_t from, uint64_t fromDigest,
                              int32_t to, uint64_t toDigest) {
  MKV_REQUIRE(mGeometry.recurrent.numLayers > 0 && slot >= 0 && slot < mGeometry.recurrent.numSlots,
              kCall, "recurrent execution of slot {} without a recurrent pool row", slot);
  requireCapacity(mRecurrent.size() + 1, mRecurrent.capacity(), "recurrent executions");
  int32_t flags = verify ? kOracleRecurrentVerify : 0;
  flags |= from == 0 ? kOracleRecurrentFromZero : 0;
  flags |= to == 0 ? kOracleRecurrentToZero : 0;
  mRecurrent.push_back(OracleRecurrentItem{slot, flags, from, to, fromDigest, toDigest});
}

void OracleStepper::reusePoint(int32_t snapshotSlot, int32_t to, uint64_t toDigest) {
  MKV_REQUIRE(to > 0 && snapshotSlot >= 0 && snapshotSlot < mGeometry.snapshots.numSlots, kCall,
              "reuse point of {} tokens into snapshot slot {} outside the {} slots", to,
              snapshotSlot, mGeometry.snapshots.numSlots);
  requireCapacity(mRecurrent.size() + 1, mRecurrent.capacity(), "recurrent executions");
  mRecurrent.push_back(
      OracleRecurrentItem{snapshotSlot, kOracleRecurrentSnapshot, 0, to, 0, toDigest});
}

void OracleStepper::hidden(int32_t row, bool verify, int32_t from, uint64_t fromDigest, int32_t to,
                           uint64_t toDigest) {
  MKV_REQUIRE(row >= 0 && row < mGeometry.hidden.numRows, kCall,
              "boundary hidden row {} outside the engine's {}", row, mGeometry.hidden.numRows);
  requireCapacity(mRecurrent.size() + 1, mRecurrent.capacity(), "recurrent executions");
  int32_t const flags = kOracleRecurrentHidden | (verify ? kOracleRecurrentVerify : 0);
  mRecurrent.push_back(OracleRecurrentItem{row, flags, from, to, fromDigest, toDigest});
}

std::size_t OracleStepper::pack() {
  auto* base = static_cast<uint8_t*>(mStaging.data());
  std::size_t offset = mResultBytes;
  auto place = [&](auto const& values, int64_t& field) {
    field = static_cast<int64_t>(offset);
    std::size_t const bytes = values.size() * sizeof(values[0]);
    if (bytes > 0) {
      std::memcpy(base + offset, values.data(), bytes);
    }
    offset += align8(bytes);
  };
  mHeader.result = OracleResult{0, kNoKey, kNoKey, kNoKey, 0, kNoKey, 0, 0, kNoKey};
  mHeader.numStores = static_cast<int64_t>(mStores.size());
  mHeader.numWrites = static_cast<int64_t>(mWrites.size());
  mHeader.numVerifies = static_cast<int64_t>(mVerifies.size());
  mHeader.numRecurrent = static_cast<int64_t>(mRecurrent.size());
  mHeader.lengthsOffset = static_cast<int64_t>(sizeof(OracleStepHeader));
  place(mStores, mHeader.storesOffset);
  place(mWrites, mHeader.writesOffset);
  place(mVerifies, mHeader.verifiesOffset);
  place(mRecurrent, mHeader.recurrentOffset);
  place(mDigests, mHeader.digestsOffset);
  std::memcpy(base, &mHeader, sizeof(mHeader));
  return offset;
}

void OracleStepper::submit(cudaStream_t stream) {
  MKV_ASSERT(!mSubmitted, "one submission per step");
  std::size_t const used = pack();
  auto* plan = static_cast<uint8_t*>(mStaging.data());
  mSubmitted = true;
  if (mDevice == DeviceType::kCPU) {
    oracleWriteHost(mGeometry, plan);
    oracleVerifyHost(mGeometry, plan);
    return;
  }
#if MKV_WITH_CUDA
  OracleStepHeader const& header = *reinterpret_cast<OracleStepHeader const*>(plan);
  auto* device = mPlanDevice.dataPointer<uint8_t>();
  auto const* geometry = static_cast<OracleGeometry const*>(mGeometryDevice.rawPointer());
  ::mkv::detail::copyBytes(device, DeviceType::kGPU, plan, DeviceType::kCPU, used, stream);
  mPending = true;
  ::mkv::detail::checkCuda(oracleWriteCuda(geometry, device, header, stream),
                           "ReferenceEngine write launch");
  ::mkv::detail::checkCuda(oracleVerifyCuda(geometry, device, header, stream),
                           "ReferenceEngine verify launch");
#else
  (void)used;
  (void)stream;
  ::mkv::detail::throwContract(kCall, "GPU pools given, but managedkv was built without CUDA");
#endif
}

void OracleStepper::snapshotLengths(int32_t rowsFull, int32_t rowsSwa, int32_t rowsDraft,
                                    cudaStream_t stream) {
  int32_t const rows[kOraclePools] = {mGeometry.pools[0].present != 0 ? rowsFull : 0,
                                      mGeometry.pools[1].present != 0 ? rowsSwa : 0,
                                      mGeometry.pools[kDraft].present != 0 ? rowsDraft : 0};
  for (int32_t p = 0; p < kOraclePools; ++p) {
    MKV_REQUIRE(rows[p] >= 0 && rows[p] <= mGeometry.storeRows, kCall,
                "length rows {} of pool {} outside [0, {}]", rows[p], p, mGeometry.storeRows);
    mSnapshotRows[p] = rows[p];
  }
  mSnapshot = true;
  auto* plan = static_cast<uint8_t*>(mStaging.data());
  if (mDevice == DeviceType::kCPU) {
    reinterpret_cast<OracleStepHeader*>(plan)->lengthsOffset = sizeof(OracleStepHeader);
    oracleLengthsHost(mGeometry, plan, rows);
    return;
  }
#if MKV_WITH_CUDA
  mPending = true;
  ::mkv::detail::checkCuda(
      oracleLengthsCuda(static_cast<OracleGeometry const*>(mGeometryDevice.rawPointer()),
                        mPlanDevice.dataPointer<uint8_t>(), sizeof(OracleStepHeader), rows[0],
                        rows[1], rows[kDraft], stream),
      "ReferenceEngine length snapshot launch");
#else
  (void)stream;
#endif
}

uint64_t OracleStepper::storedDigest(int32_t pool, int32_t slot, int64_t position) const {
  uint64_t value = 0;
  auto const* source = mDigestStore.dataPointer<uint64_t>() +
                       digestRow(mGeometry, pool, slot) * mGeometry.storePitch + position;
  ::mkv::detail::copyBytes(&value, DeviceType::kCPU, source, mDevice, sizeof(value), nullptr);
  if (mDevice == DeviceType::kGPU) {
    ::mkv::detail::synchronizeDevice();  // mismatch reporting only, never on the step path
  }
  return value;
}

std::string OracleStepper::describeKv(OracleResult const& result) const {
  uint64_t const key = result.kvKey;
  auto const flat = static_cast<int64_t>(key >> 34);
  auto const code = static_cast<int32_t>((key >> 24) & 0x3FF);
  auto const byte = static_cast<int64_t>((key >> 8) & 0xFFFF);
  auto const found = static_cast<uint8_t>(key & 0xFF);
  auto const entry = static_cast<int32_t>(static_cast<uint32_t>(result.kvPageKey & 0xFFFFFFFFULL));
  OracleRange const& range =
      mVerifies[static_cast<std::size_t>(findRange(mVerifies.data(), mHeader.numVerifies, flat))];
  int64_t const position = range.begin + (flat - range.firstFlat);
  std::string prefix = range.kind == kOracleReusedPrefix ? "reused prefix: " : "";
  if (range.pool == kDraft) {
    prefix = "draft " + prefix;
  }
  if (code == 0) {
    return fmt::format("{}slot {} position {}: no page mapped (entry {})", prefix, range.slot,
                       position, entry);
  }
  int32_t const layer = (code - 1) / 2;
  int32_t const half = (code - 1) % 2;
  uint64_t const digest = storedDigest(range.pool, range.slot, position);
  return fmt::format(
      "{}slot {} position {} (page {}, row {}) layer {} {}: byte {} is {:#04x}, expected {:#04x}",
      prefix, range.slot, position, entry, position % mGeometry.pools[range.pool].tokensPerPage,
      layer, half == 0 ? "K" : "V", byte, found, expectedByte(digest, layer, half, byte));
}

std::string OracleStepper::describeRecurrent(OracleResult const& result) const {
  uint64_t const key = result.recurrentKey;
  auto const item = static_cast<std::size_t>(key >> 48);
  auto const kind = static_cast<int32_t>((key >> 40) & 0xFF);
  auto const byte = static_cast<int64_t>((key >> 8) & 0xFFFFFFFFULL);
  auto const found = static_cast<uint8_t>(key & 0xFF);
  OracleRecurrentItem const& it = mRecurrent[item];
  int32_t const layer = kind / 2;
  bool const conv = kind % 2 == 1;
  uint8_t const expected = (it.flags & kOracleRecurrentFromZero) != 0
                               ? uint8_t{0}
                               : expectedByte(it.fromDigest, layer, conv ? 3 : 2, byte);
  return fmt::format(
      "slot {} recurrent state after {} tokens, layer {} {} row: byte {} is {:#04x}, expected "
      "{:#04x}",
      it.slot, it.fromLength, layer, conv ? "conv" : "state", byte, found, expected);
}

std::string OracleStepper::describeHidden(OracleResult const& result) const {
  uint64_t const key = result.hiddenKey;
  auto const item = static_cast<std::size_t>(key >> 48);
  auto const byte = static_cast<int64_t>((key >> 8) & 0xFFFFFFFFULL);
  auto const found = static_cast<uint8_t>(key & 0xFF);
  OracleRecurrentItem const& it = mRecurrent[item];
  return fmt::format(
      "row {} should hold the base hidden row of the {}-token prefix: byte {} is {:#04x}, "
      "expected {:#04x}",
      it.slot, it.fromLength, byte, found, expectedByte(it.fromDigest, 0, kOracleHiddenHalf, byte));
}

StepFindings const& OracleStepper::complete(cudaStream_t stream, char const* call) {
  auto* plan = static_cast<uint8_t*>(mStaging.data());
  if (mDevice == DeviceType::kGPU && (mSubmitted || mSnapshot)) {
    ::mkv::detail::copyBytes(plan, DeviceType::kCPU, mPlanDevice.rawPointer(), DeviceType::kGPU,
                             mResultBytes, stream);
    mDone.record(stream);
    mDone.synchronize();
  }
  mPending = false;
  auto const& header = *reinterpret_cast<OracleStepHeader const*>(plan);
  if (mSubmitted) {
    OracleResult const& result = header.result;
    if (result.writeFaultKey != kNoKey) {
      auto const flat = static_cast<int64_t>(result.writeFaultKey >> 32);
      auto const entry =
          static_cast<int32_t>(static_cast<uint32_t>(result.writeFaultKey & 0xFFFFFFFFULL));
      OracleRange const& range =
          mWrites[static_cast<std::size_t>(findRange(mWrites.data(), mHeader.numWrites, flat))];
      ::mkv::detail::throwContract(call, "position {} of slot {} maps to no page (entry {})",
                                   range.begin + (flat - range.firstFlat), range.slot, entry);
    }
    mFindings.positionsChecked = mHeader.verifyPositions;
    mFindings.kvMismatches = static_cast<int64_t>(result.kvMismatches);
    mFindings.draftMismatches = static_cast<int64_t>(result.draftMismatches);
    if (result.kvMismatches > 0) {
      mFindings.kvFirst = describeKv(result);
    }
    for (OracleRecurrentItem const& it : mRecurrent) {
      if ((it.flags & kOracleRecurrentVerify) != 0) {
        ++((it.flags & kOracleRecurrentHidden) != 0 ? mFindings.hiddenChecks
                                                    : mFindings.recurrentChecks);
      }
    }
    mFindings.hiddenMismatches = static_cast<int64_t>(result.hiddenMismatches);
    if (result.hiddenMismatches > 0) {
      mFindings.hiddenFirst = describeHidden(result);
    }
    mFindings.recurrentMismatches = static_cast<int64_t>(result.recurrentMismatches);
    if (result.recurrentMismatches > 0) {
      mFindings.recurrentFirst = describeRecurrent(result);
    }
  }
  if (mSnapshot) {
    auto const* snapshot = reinterpret_cast<int32_t const*>(plan + sizeof(OracleStepHeader));
    for (int32_t p = 0; p < kOraclePools; ++p) {
      int32_t const* const rows = snapshot + std::ptrdiff_t{p} * mGeometry.storeRows;
      mLengths[p].assign(rows, rows + mSnapshotRows[p]);
      mFindings.lengths[p] = &mLengths[p];
    }
  }
  return mFindings;
}

StreamMarks::StreamMarks(DeviceType deviceType) {
#if MKV_WITH_CUDA
  if (deviceType == DeviceType::kGPU) {
    for (void*& event : mEvents) {
      cudaEvent_t created = nullptr;
      ::mkv::detail::checkCuda(cudaEventCreate(&created), "ReferenceEngine timing event");
      event = created;
    }
    mEnabled = true;
  }
#else
  (void)deviceType;
#endif
}

StreamMarks::~StreamMarks() {
#if MKV_WITH_CUDA
  for (void* event : mEvents) {
    if (event != nullptr) {
      cudaEventDestroy(static_cast<cudaEvent_t>(event));
    }
  }
#endif
}

void StreamMarks::mark(int32_t index, cudaStream_t stream) {
#if MKV_WITH_CUDA
  if (mEnabled) {
    ::mkv::detail::checkCuda(cudaEventRecord(static_cast<cudaEvent_t>(mEvents[index]), stream),
                             "ReferenceEngine timing event");
  }
#else
  (void)index;
  (void)stream;
#endif
}

int64_t StreamMarks::elapsedNanos(int32_t from, int32_t to) const {
#if MKV_WITH_CUDA
  if (mEnabled) {
    float ms = 0.0F;
    ::mkv::detail::checkCuda(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(mEvents[from]),
                                                  static_cast<cudaEvent_t>(mEvents[to])),
                             "ReferenceEngine timing event");
    return static_cast<int64_t>(std::llround(static_cast<double>(ms) * 1.0e6));
  }
#else
  (void)from;
  (void)to;
#endif
  return 0;
}

}  // namespace mkv::testing::oracle
