#include "mkv/kv_cache_pool.h"

#include <bit>
#include <limits>

#include "core/check.h"
#include "core/device.h"

namespace mkv {
namespace {

constexpr char const* kCtor = "KVCachePool";

/// a * b, throwing when the product leaves [0, INT64_MAX].
int64_t checkedProduct(int64_t a, int64_t b, char const* what) {
  MKV_REQUIRE(a >= 0 && b >= 0 && (b == 0 || a <= std::numeric_limits<int64_t>::max() / b), kCtor,
              "{} overflows int64 ({} x {})", what, a, b);
  return a * b;
}

void validateConfig(KVCachePoolConfig const& c) {
  MKV_REQUIRE(c.numLayers >= 1 && c.numLayers <= kernels::kMaxLayers, kCtor,
              "numLayers {} is outside [1, {}]", c.numLayers, kernels::kMaxLayers);
  MKV_REQUIRE(c.numKVHeads > 0, kCtor, "numKVHeads must be positive, got {}", c.numKVHeads);
  MKV_REQUIRE(c.headDim > 0, kCtor, "headDim must be positive, got {}", c.headDim);
  MKV_REQUIRE(c.tokensPerPage >= 16 && c.tokensPerPage <= 1024 &&
                  std::has_single_bit(static_cast<uint32_t>(c.tokensPerPage)),
              kCtor, "tokensPerPage must be a power of two in [16, 1024], got {}", c.tokensPerPage);
  MKV_REQUIRE(c.numPages > 0, kCtor, "numPages must be positive, got {}", c.numPages);
  MKV_REQUIRE(c.maxBatchSize > 0, kCtor, "maxBatchSize must be positive, got {}", c.maxBatchSize);
  int64_t const tokenBytes =
      checkedProduct(checkedProduct(c.numKVHeads, c.headDim, "numKVHeads * headDim"),
                     static_cast<int64_t>(dataTypeSize(c.dataType)), "token bytes");
  int64_t const pageBytes = checkedProduct(tokenBytes, c.tokensPerPage, "page bytes");
  int64_t const layerBytes =
      checkedProduct(checkedProduct(pageBytes, c.numPages, "half bytes"), 2, "layer bytes");
  checkedProduct(layerBytes, c.numLayers, "total bytes");
}

}  // namespace

KVCachePool::KVCachePool(KVCachePoolConfig const& config) : mConfig(config) {
  validateConfig(config);
  mLayers.reserve(static_cast<std::size_t>(config.numLayers));
  mLayerBases.reserve(static_cast<std::size_t>(config.numLayers));
  for (int32_t l = 0; l < config.numLayers; ++l) {
    mLayers.emplace_back(
        Coords{2, config.numPages, config.tokensPerPage, config.numKVHeads, config.headDim},
        config.dataType, config.deviceType);
    mLayerBases.push_back(mLayers.back().rawPointer());
  }
  mKvLengths = Tensor({config.maxBatchSize}, DataType::kInt32, config.deviceType);
  bool const viewed = mKvLengths.reshape({0});
  MKV_ASSERT(viewed, "an empty view always fits");
  mLengthUploads =
      std::make_unique<detail::Int32UploadRegions>(1, config.maxBatchSize, config.deviceType);
  mLengthWrites = kernels::InlinePatchBatch(config.deviceType);
  if (config.deviceType == DeviceType::kGPU) {
    int64_t const lengthBytes = sizeof(int32_t);
    int64_t const workspaceBytes =
        kernels::compactBatchWorkspaceBytes(config.maxBatchSize, std::span(&lengthBytes, 1));
    mCompactWorkspace = Tensor({workspaceBytes / static_cast<int64_t>(sizeof(int32_t))},
                               DataType::kInt32, DeviceType::kGPU);
  }
}

KVCachePool::~KVCachePool() = default;

int64_t KVCachePool::tokenBytes() const noexcept {
  return int64_t{mConfig.numKVHeads} * mConfig.headDim *
         static_cast<int64_t>(dataTypeSize(mConfig.dataType));
}

int64_t KVCachePool::totalBytes() const noexcept {
  return mConfig.numPages * bytesPerPage(mConfig);
}

int64_t KVCachePool::bytesPerPage(KVCachePoolConfig const& config) noexcept {
  return int64_t{config.numLayers} * 2 * config.tokensPerPage * config.numKVHeads * config.headDim *
         static_cast<int64_t>(dataTypeSize(config.dataType));
}

Tensor& KVCachePool::layer(int32_t l) {
  MKV_REQUIRE(l >= 0 && l < mConfig.numLayers, "KVCachePool::layer", "layer {} is outside [0, {})",
              l, mConfig.numLayers);
  return mLayers[static_cast<std::size_t>(l)];
}

Tensor const& KVCachePool::layer(int32_t l) const {
  return const_cast<KVCachePool*>(this)->layer(l);
}

kernels::PagedBuffers KVCachePool::pagedBuffers() const noexcept {
  return kernels::PagedBuffers{mLayerBases, mConfig.deviceType, mConfig.numPages,
                               mConfig.tokensPerPage, tokenBytes()};
}

namespace {

void validateLengths(char const* call, std::span<int32_t const> lengths) {
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    MKV_REQUIRE(lengths[i] >= 0, call, "lengths[{}] = {} is negative", i, lengths[i]);
  }
}

}  // namespace

void KVCachePool::resetForNewSequences(std::span<int32_t const> lengths, cudaStream_t stream) {
  resetLengths(lengths, nullptr, stream);
}

void KVCachePool::resetForNewSequences(std::span<int32_t const> lengths,
                                       kernels::InlinePatchBatch& batch, cudaStream_t stream) {
  resetLengths(lengths, &batch, stream);
}

void KVCachePool::resetLengths(std::span<int32_t const> lengths, kernels::InlinePatchBatch* batch,
                               cudaStream_t stream) {
  constexpr char const* kCall = "KVCachePool::resetForNewSequences";
  MKV_REQUIRE(lengths.size() <= static_cast<std::size_t>(mConfig.maxBatchSize), kCall,
              "{} sequences exceed maxBatchSize {}", lengths.size(), mConfig.maxBatchSize);
  validateLengths(kCall, lengths);
  if (batch != mQueuedWrites) {
    flushQueuedWrites(kCall, stream);
  }
  uploadLengths(0, lengths, batch, stream);
  setActiveBatchSize(static_cast<int32_t>(lengths.size()));
}

void KVCachePool::writeLengths(int32_t firstRow, std::span<int32_t const> lengths,
                               cudaStream_t stream) {
  constexpr char const* kCall = "KVCachePool::writeLengths";
  MKV_REQUIRE(
      firstRow >= 0 && int64_t{firstRow} + static_cast<int64_t>(lengths.size()) <= mActiveBatchSize,
      kCall, "rows [{}, {}) are outside the active batch of {}", firstRow,
      int64_t{firstRow} + static_cast<int64_t>(lengths.size()), mActiveBatchSize);
  validateLengths(kCall, lengths);
  if (lengths.empty()) {
    return;
  }
  flushQueuedWrites(kCall, stream);
  uploadLengths(firstRow, lengths, nullptr, stream);
}

void KVCachePool::flushQueuedWrites(char const* call, cudaStream_t stream) {
  if (mQueuedWrites == nullptr || mQueuedWrites->empty()) {
    return;
  }
  try {
    mQueuedWrites->flush(stream);
  } catch (Error const& error) {
    detail::throwContract(call, "the queued writes it must follow: {}", error.what());
  }
}

void KVCachePool::uploadLengths(int32_t firstRow, std::span<int32_t const> lengths,
                                kernels::InlinePatchBatch* batch, cudaStream_t stream) {
  if (lengths.empty()) {
    return;
  }
  constexpr std::size_t kHeader = 3;
  if (kHeader + lengths.size() <= static_cast<std::size_t>(kernels::kMaxInlinePatchValues)) {
    // The values travel in the parameters of one launch: no staging copy, no event.
    Tensor every = Tensor::view(mKvLengths.rawPointer(), {mConfig.maxBatchSize}, DataType::kInt32,
                                mConfig.deviceType);
    kernels::InlinePatchBatch& writes = batch != nullptr ? *batch : mLengthWrites;
    writes.add("KVCachePool::uploadLengths", every, firstRow, lengths, stream);
    if (batch == nullptr) {
      mLengthWrites.flush(stream);
    }
    return;
  }
  if (batch != nullptr) {
    batch->flush(stream);  // what the caller queued before stays ahead of this write
  }
  mLengthUploads->upload(0, lengths, mKvLengths.dataPointer<int32_t>() + firstRow, stream);
}

void KVCachePool::setActiveBatchSize(int32_t batchSize) {
  MKV_REQUIRE(batchSize >= 0 && batchSize <= mConfig.maxBatchSize,
              "KVCachePool::setActiveBatchSize", "batch size {} is outside [0, {}]", batchSize,
              mConfig.maxBatchSize);
  bool const viewed = mKvLengths.reshape({batchSize});
  MKV_ASSERT(viewed, "a batch within maxBatchSize fits the length tensor");
  mActiveBatchSize = batchSize;
}

void KVCachePool::compactLengths(Tensor const& oldToNew, int32_t newBatchSize,
                                 cudaStream_t stream) {
  constexpr char const* kCall = "KVCachePool::compactLengths";
  MKV_REQUIRE(oldToNew.numel() == mActiveBatchSize, kCall,
              "mapping has {} entries but the active batch is {}", oldToNew.numel(),
              mActiveBatchSize);
  MKV_REQUIRE(newBatchSize >= 0 && newBatchSize <= mActiveBatchSize, kCall,
              "newBatchSize {} is outside [0, {}]", newBatchSize, mActiveBatchSize);
  MKV_REQUIRE(oldToNew.deviceType() == mConfig.deviceType, kCall,
              "mapping is on {} but the pool is on {}", toString(oldToNew.deviceType()),
              toString(mConfig.deviceType));
  kernels::RowBuffer const lengths{mKvLengths.rawPointer(), sizeof(int32_t), mConfig.maxBatchSize};
  std::span<kernels::RowBuffer const> const rows(&lengths, 1);
  try {  // every check first: the flush below changes the queue
    kernels::checkCompactBatch(rows, mConfig.deviceType, oldToNew, newBatchSize, mCompactWorkspace);
  } catch (Error const& error) {
    detail::throwContract(kCall, "{}", error.what());
  }
  flushQueuedWrites(kCall, stream);
  try {
    kernels::compactBatch(rows, mConfig.deviceType, oldToNew, newBatchSize, mCompactWorkspace,
                          stream);
  } catch (Error const& error) {
    detail::throwContract(kCall, "{}", error.what());
  }
  setActiveBatchSize(newBatchSize);
}

}  // namespace mkv
