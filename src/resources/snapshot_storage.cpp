#include "mkv/snapshot_storage.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "core/check.h"
#include "core/device.h"

namespace mkv {
namespace {

constexpr char const* kCtor = "SnapshotStorage";
/// Ids one operation stages at most: page, slot, validTokens and draft page.
constexpr int64_t kStagingEntries = 4;

/// Partial-KV slab of one layer: a mini pool of `slots` pages with the pool's page geometry.
Tensor makePartialSlab(KVCachePool const& pool, int32_t slots) {
  KVCachePoolConfig const& c = pool.config();
  return Tensor({2, slots, c.tokensPerPage, c.numKVHeads, c.headDim}, c.dataType, c.deviceType);
}

kernels::PagedBuffers slabBuffers(KVCachePool const& pool, std::vector<void*> const& bases,
                                  int32_t slots) {
  return kernels::PagedBuffers{bases, pool.deviceType(), slots, pool.tokensPerPage(),
                               pool.tokenBytes()};
}

/// The constructor's contract checks, in order: non-negative sizes, the pools each part needs,
/// one device for every pool (`device`, the storage's), and byte totals that fit int64.
void validateStorageConfig(SnapshotStorageConfig const& config, RecurrentStatePool const* recurrent,
                           KVCachePool const* baseKv, KVCachePool const* draftKv,
                           DeviceType device) {
  MKV_REQUIRE(config.recurrentSlots >= 0, kCtor, "recurrentSlots must be >= 0, got {}",
              config.recurrentSlots);
  MKV_REQUIRE(config.partialKvSlots >= 0, kCtor, "partialKvSlots must be >= 0, got {}",
              config.partialKvSlots);
  MKV_REQUIRE(config.boundaryHiddenWidth >= 0, kCtor, "boundaryHiddenWidth must be >= 0, got {}",
              config.boundaryHiddenWidth);
  MKV_REQUIRE(draftKv == nullptr || baseKv != nullptr, kCtor,
              "a draft pool needs a base pool to pair with");
  MKV_REQUIRE(config.partialKvSlots == 0 || baseKv != nullptr, kCtor,
              "partialKvSlots {} given without a base KV pool", config.partialKvSlots);
  MKV_REQUIRE(config.boundaryHiddenWidth == 0 || config.recurrentSlots > 0, kCtor,
              "boundaryHiddenWidth {} needs recurrentSlots > 0 (one hidden row per slot)",
              config.boundaryHiddenWidth);
  MKV_REQUIRE(config.boundaryHiddenWidth == 0 || recurrent != nullptr || baseKv != nullptr, kCtor,
              "boundaryHiddenWidth {} given without any pool to take the device from",
              config.boundaryHiddenWidth);
  MKV_REQUIRE((recurrent == nullptr || recurrent->deviceType() == device) &&
                  (baseKv == nullptr || baseKv->deviceType() == device) &&
                  (draftKv == nullptr || draftKv->deviceType() == device),
              kCtor, "pools on different devices: recurrent {}, base {}, draft {}",
              recurrent != nullptr ? toString(recurrent->deviceType()) : "none",
              baseKv != nullptr ? toString(baseKv->deviceType()) : "none",
              draftKv != nullptr ? toString(draftKv->deviceType()) : "none");
  constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max();
  for (KVCachePool const* pool : {baseKv, draftKv}) {
    MKV_REQUIRE(
        pool == nullptr || config.partialKvSlots == 0 ||
            SnapshotStorage::partialKvBytesPerSlot(*pool) <= kMaxBytes / config.partialKvSlots,
        kCtor, "{} partial-KV slots overflow int64 bytes", config.partialKvSlots);
  }
  MKV_REQUIRE(
      recurrent == nullptr || config.recurrentSlots == 0 ||
          SnapshotStorage::recurrentBytesPerSlot(*recurrent) <= kMaxBytes / config.recurrentSlots,
      kCtor, "{} recurrent slots overflow int64 bytes", config.recurrentSlots);
  MKV_REQUIRE(config.boundaryHiddenWidth <=
                  kMaxBytes / static_cast<int64_t>(dataTypeSize(config.boundaryHiddenType)) /
                      std::max<int64_t>(config.recurrentSlots, 1),
              kCtor, "boundary hidden slab of {} x {} overflows int64 bytes", config.recurrentSlots,
              config.boundaryHiddenWidth);
}

/// One state slab and one conv slab per recurrent layer (`slots` rows of the layer's row bytes,
/// uint8 on `device`), allocated layer by layer, state before conv.
void allocateRecurrentSlabs(RecurrentStatePool const& recurrent, int32_t slots, DeviceType device,
                            std::vector<Tensor>& stateSlabs, std::vector<Tensor>& convSlabs) {
  auto const layers = static_cast<std::size_t>(recurrent.numLayers());
  stateSlabs.reserve(layers);
  convSlabs.reserve(layers);
  for (int32_t l = 0; l < recurrent.numLayers(); ++l) {
    Tensor const& state = recurrent.state(l);
    Tensor const& conv = recurrent.conv(l);
    stateSlabs.emplace_back(Coords{slots, state.dim(1)}, DataType::kUInt8, device);
    convSlabs.emplace_back(Coords{slots, conv.dim(1)}, DataType::kUInt8, device);
  }
}

/// Pairs each pool row buffer with its slab: `capture` copies pool -> slab, `restore` slab ->
/// pool, in the order of rowBuffers() (state(l), conv(l) alternating, as the slabs).
void pairRecurrentRows(RecurrentStatePool const& recurrent, int32_t slots,
                       std::vector<Tensor>& stateSlabs, std::vector<Tensor>& convSlabs,
                       std::vector<kernels::RowBufferPair>& capture,
                       std::vector<kernels::RowBufferPair>& restore) {
  for (kernels::RowBuffer const& pool : recurrent.rowBuffers()) {
    std::size_t const index = capture.size();
    Tensor& slab = index % 2 == 0 ? stateSlabs[index / 2] : convSlabs[index / 2];
    kernels::RowBuffer const slabRows{slab.rawPointer(), pool.rowBytes, slots};
    capture.push_back({pool, slabRows});
    restore.push_back({slabRows, pool});
  }
}

/// Appends one partial-KV slab of `slots` pages per layer of `pool` to `slabs`, and its base
/// pointer to `bases`.
void allocatePartialSlabs(KVCachePool const& pool, int32_t slots, std::vector<Tensor>& slabs,
                          std::vector<void*>& bases) {
  for (int32_t l = 0; l < pool.numLayers(); ++l) {
    slabs.push_back(makePartialSlab(pool, slots));
    bases.push_back(slabs.back().rawPointer());
  }
}

}  // namespace

SnapshotStorage::SnapshotStorage(SnapshotStorageConfig const& config, RecurrentStatePool* recurrent,
                                 KVCachePool* baseKv, KVCachePool* draftKv)
    : mConfig(config), mRecurrent(recurrent), mBaseKv(baseKv), mDraftKv(draftKv) {
  DeviceType const device = deviceType();
  validateStorageConfig(config, recurrent, baseKv, draftKv, device);
  if (recurrent != nullptr && config.recurrentSlots > 0) {
    allocateRecurrentSlabs(*recurrent, config.recurrentSlots, device, mStateSlabs, mConvSlabs);
    pairRecurrentRows(*recurrent, config.recurrentSlots, mStateSlabs, mConvSlabs, mCapturePairs,
                      mRestorePairs);
  }
  if (baseKv != nullptr && config.partialKvSlots > 0) {
    allocatePartialSlabs(*baseKv, config.partialKvSlots, mPartialBase, mPartialBaseBases);
    if (draftKv != nullptr) {
      allocatePartialSlabs(*draftKv, config.partialKvSlots, mPartialDraft, mPartialDraftBases);
    }
  }
  if (config.boundaryHiddenWidth > 0) {
    mBoundaryHidden = Tensor({config.recurrentSlots, config.boundaryHiddenWidth},
                             config.boundaryHiddenType, device);
  }
  mStaging = std::make_unique<detail::Int32Staging>(kStagingEntries, device);
}

SnapshotStorage::~SnapshotStorage() = default;

DeviceType SnapshotStorage::deviceType() const noexcept {
  if (mRecurrent != nullptr) {
    return mRecurrent->deviceType();
  }
  return mBaseKv != nullptr ? mBaseKv->deviceType() : DeviceType::kCPU;
}

int64_t SnapshotStorage::recurrentBytesPerSlot(RecurrentStatePool const& recurrent) noexcept {
  return recurrent.bytesPerSlot();
}

int64_t SnapshotStorage::partialKvBytesPerSlot(KVCachePool const& pool) noexcept {
  return int64_t{pool.numLayers()} * 2 * pool.pageBytes();
}

int64_t SnapshotStorage::boundaryHiddenBytesPerSlot(int64_t width, DataType type) noexcept {
  return width * static_cast<int64_t>(dataTypeSize(type));
}

int64_t SnapshotStorage::totalBytes() const noexcept {
  // capacityBytes, not sizeBytes: an unallocated (default) Tensor has rank 0 and so reports
  // one element of sizeBytes, but no capacity.
  int64_t total = mBoundaryHidden.capacityBytes();
  for (auto const* slabs : {&mStateSlabs, &mConvSlabs, &mPartialBase, &mPartialDraft}) {
    for (Tensor const& slab : *slabs) {
      total += slab.capacityBytes();
    }
  }
  return total;
}

namespace {

void requireRecurrentArgs(char const* call, bool configured, int32_t snapshotSlot,
                          int32_t snapshotSlots, CacheSlot resident, int32_t residents) {
  MKV_REQUIRE(configured, call,
              "no recurrent slab is configured (needs a recurrent pool and recurrentSlots > 0)");
  MKV_REQUIRE(snapshotSlot >= 0 && snapshotSlot < snapshotSlots, call,
              "snapshot slot {} is outside [0, {})", snapshotSlot, snapshotSlots);
  MKV_REQUIRE(resident >= 0 && resident < residents, call, "resident slot {} is outside [0, {})",
              resident, residents);
}

}  // namespace

void SnapshotStorage::captureRecurrent(int32_t snapshotSlot, CacheSlot resident,
                                       cudaStream_t stream) {
  constexpr char const* kCall = "SnapshotStorage::captureRecurrent";
  requireRecurrentArgs(kCall, !mCapturePairs.empty(), snapshotSlot, mConfig.recurrentSlots,
                       resident, mRecurrent != nullptr ? mRecurrent->numSlots() : 0);
  detail::Int32Staging::Batch batch = mStaging->begin(stream);
  Tensor const residentRows = batch.add(std::span<int32_t const>(&resident, 1));
  Tensor const slabRows = batch.add(std::span<int32_t const>(&snapshotSlot, 1));
  batch.submit();
  kernels::copyRows(mCapturePairs, deviceType(), residentRows, slabRows, stream);
}

void SnapshotStorage::restoreRecurrent(int32_t snapshotSlot, CacheSlot resident,
                                       cudaStream_t stream) {
  constexpr char const* kCall = "SnapshotStorage::restoreRecurrent";
  requireRecurrentArgs(kCall, !mRestorePairs.empty(), snapshotSlot, mConfig.recurrentSlots,
                       resident, mRecurrent != nullptr ? mRecurrent->numSlots() : 0);
  detail::Int32Staging::Batch batch = mStaging->begin(stream);
  Tensor const slabRows = batch.add(std::span<int32_t const>(&snapshotSlot, 1));
  Tensor const residentRows = batch.add(std::span<int32_t const>(&resident, 1));
  batch.submit();
  kernels::copyRows(mRestorePairs, deviceType(), slabRows, residentRows, stream);
}

void SnapshotStorage::capturePartialKv(int32_t snapshotSlot, PageId page, int32_t validTokens,
                                       PageId draftPage, cudaStream_t stream) {
  copyPartialKv("SnapshotStorage::capturePartialKv", /*capture=*/true, snapshotSlot, page,
                validTokens, draftPage, stream);
}

void SnapshotStorage::restorePartialKv(int32_t snapshotSlot, PageId page, int32_t validTokens,
                                       PageId draftPage, cudaStream_t stream) {
  copyPartialKv("SnapshotStorage::restorePartialKv", /*capture=*/false, snapshotSlot, page,
                validTokens, draftPage, stream);
}

void SnapshotStorage::copyPartialKv(char const* call, bool capture, int32_t snapshotSlot,
                                    PageId page, int32_t validTokens, PageId draftPage,
                                    cudaStream_t stream) {
  MKV_REQUIRE(!mPartialBase.empty(), call,
              "no partial-KV slab is configured (needs a base pool and partialKvSlots > 0)");
  MKV_REQUIRE(snapshotSlot >= 0 && snapshotSlot < mConfig.partialKvSlots, call,
              "snapshot slot {} is outside [0, {})", snapshotSlot, mConfig.partialKvSlots);
  MKV_REQUIRE(page >= 0 && page < mBaseKv->numPages(), call, "page {} is outside [0, {})", page,
              mBaseKv->numPages());
  MKV_REQUIRE(validTokens >= 1 && validTokens <= mBaseKv->tokensPerPage(), call,
              "validTokens {} is outside [1, {}]", validTokens, mBaseKv->tokensPerPage());
  if (draftPage != kNoPage) {
    MKV_REQUIRE(mDraftKv != nullptr, call, "draft page {} given, but no draft pool is configured",
                draftPage);
    MKV_REQUIRE(draftPage >= 0 && draftPage < mDraftKv->numPages(), call,
                "draft page {} is outside [0, {})", draftPage, mDraftKv->numPages());
    MKV_REQUIRE(validTokens <= mDraftKv->tokensPerPage(), call,
                "validTokens {} exceeds the draft pool's {} tokens per page", validTokens,
                mDraftKv->tokensPerPage());
  }
  detail::Int32Staging::Batch batch = mStaging->begin(stream);
  Tensor const pages = batch.add(std::span<int32_t const>(&page, 1));
  Tensor const slots = batch.add(std::span<int32_t const>(&snapshotSlot, 1));
  Tensor const tokens = batch.add(std::span<int32_t const>(&validTokens, 1));
  Tensor const draftPages = batch.add(draftPage != kNoPage ? std::span<int32_t const>(&draftPage, 1)
                                                           : std::span<int32_t const>());
  batch.submit();
  auto copy = [&](KVCachePool const& pool, std::vector<void*> const& slabBases,
                  Tensor const& poolPages) {
    kernels::PagedBuffers const poolSide = pool.pagedBuffers();
    kernels::PagedBuffers const slabSide = slabBuffers(pool, slabBases, mConfig.partialKvSlots);
    if (capture) {
      kernels::copyPages(poolSide, slabSide, poolPages, slots, &tokens, stream);
    } else {
      kernels::copyPages(slabSide, poolSide, slots, poolPages, &tokens, stream);
    }
  };
  copy(*mBaseKv, mPartialBaseBases, pages);
  if (draftPage != kNoPage) {
    copy(*mDraftKv, mPartialDraftBases, draftPages);
  }
}

void SnapshotStorage::validateBoundaryHidden(char const* call, int32_t snapshotSlot,
                                             Tensor const& hidden, int32_t row) const {
  MKV_REQUIRE(hasBoundaryHidden(), call,
              "no boundary hidden slab is configured (boundaryHiddenWidth is 0)");
  MKV_REQUIRE(snapshotSlot >= 0 && snapshotSlot < mConfig.recurrentSlots, call,
              "snapshot slot {} is outside [0, {})", snapshotSlot, mConfig.recurrentSlots);
  MKV_REQUIRE(hidden.rank() == 2 && hidden.dim(1) == mConfig.boundaryHiddenWidth, call,
              "hidden must be [tokens, {}], got {}", mConfig.boundaryHiddenWidth,
              hidden.shape().toString());
  MKV_REQUIRE(hidden.dataType() == mConfig.boundaryHiddenType, call,
              "hidden is {} but the slab holds {}", toString(hidden.dataType()),
              toString(mConfig.boundaryHiddenType));
  MKV_REQUIRE(hidden.deviceType() == deviceType(), call, "hidden is on {} but the slab on {}",
              toString(hidden.deviceType()), toString(deviceType()));
  MKV_REQUIRE(row >= 0 && row < hidden.dim(0), call, "row {} is outside [0, {})", row,
              hidden.dim(0));
}

void SnapshotStorage::captureBoundaryHidden(int32_t snapshotSlot, Tensor const& hidden, int32_t row,
                                            cudaStream_t stream) {
  validateBoundaryHidden("SnapshotStorage::captureBoundaryHidden", snapshotSlot, hidden, row);
  detail::Int32Staging::Batch batch = mStaging->begin(stream);
  Tensor const rows = batch.add(std::span<int32_t const>(&row, 1));
  Tensor const slots = batch.add(std::span<int32_t const>(&snapshotSlot, 1));
  batch.submit();
  kernels::captureHiddenRows(hidden, rows, mBoundaryHidden, slots, stream);
}

void SnapshotStorage::restoreBoundaryHidden(int32_t snapshotSlot, Tensor& hidden, int32_t row,
                                            cudaStream_t stream) {
  validateBoundaryHidden("SnapshotStorage::restoreBoundaryHidden", snapshotSlot, hidden, row);
  detail::Int32Staging::Batch batch = mStaging->begin(stream);
  Tensor const slots = batch.add(std::span<int32_t const>(&snapshotSlot, 1));
  Tensor const rows = batch.add(std::span<int32_t const>(&row, 1));
  batch.submit();
  kernels::restoreHiddenRows(mBoundaryHidden, slots, hidden, rows, stream);
}

Tensor const& SnapshotStorage::recurrentStateSlab(int32_t layer) const {
  MKV_REQUIRE(layer >= 0 && static_cast<std::size_t>(layer) < mStateSlabs.size(),
              "SnapshotStorage::recurrentStateSlab", "layer {} is outside [0, {})", layer,
              mStateSlabs.size());
  return mStateSlabs[static_cast<std::size_t>(layer)];
}

Tensor const& SnapshotStorage::recurrentConvSlab(int32_t layer) const {
  MKV_REQUIRE(layer >= 0 && static_cast<std::size_t>(layer) < mConvSlabs.size(),
              "SnapshotStorage::recurrentConvSlab", "layer {} is outside [0, {})", layer,
              mConvSlabs.size());
  return mConvSlabs[static_cast<std::size_t>(layer)];
}

Tensor& SnapshotStorage::recurrentStateSlab(int32_t layer) {
  return const_cast<Tensor&>(std::as_const(*this).recurrentStateSlab(layer));
}

Tensor& SnapshotStorage::recurrentConvSlab(int32_t layer) {
  return const_cast<Tensor&>(std::as_const(*this).recurrentConvSlab(layer));
}

Tensor const& SnapshotStorage::partialKvSlab(int32_t layer, bool draft) const {
  std::vector<Tensor> const& slabs = draft ? mPartialDraft : mPartialBase;
  MKV_REQUIRE(layer >= 0 && static_cast<std::size_t>(layer) < slabs.size(),
              "SnapshotStorage::partialKvSlab", "{} layer {} is outside [0, {})",
              draft ? "draft" : "base", layer, slabs.size());
  return slabs[static_cast<std::size_t>(layer)];
}

Tensor const& SnapshotStorage::boundaryHiddenSlab() const {
  MKV_REQUIRE(hasBoundaryHidden(), "SnapshotStorage::boundaryHiddenSlab",
              "no boundary hidden slab is configured (boundaryHiddenWidth is 0)");
  return mBoundaryHidden;
}

}  // namespace mkv
