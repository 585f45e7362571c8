#include "mkv/host_kv_tier.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <utility>

#include "core/check.h"
#include "core/device.h"
#include "core/faults.h"

namespace mkv {

namespace {

/// Ids per inline patch range: the most one range of an InlinePatchBatch carries.
constexpr int64_t kIdsPerRange = kernels::kMaxInlinePatchValues - 3;

/// Bytes of one host page over every layer and both halves, or -1 past int64.
int64_t checkedPoolBytes(int64_t layers, int64_t pageBytes, int64_t pages) {
  int64_t const perPage = layers * 2 * pageBytes;  // <= 256 * 2 * (1024 * row bytes): no overflow
  if (perPage <= 0 || pages > std::numeric_limits<int64_t>::max() / perPage) {
    return -1;
  }
  return perPage * pages;
}

}  // namespace

HostKvTier::HostKvTier(HostKvTierConfig config, KVCachePool& gpuPool)
    : mNumPages(config.numPages), mFaults(std::move(config.faults)), mGpu(gpuPool) {
  MKV_REQUIRE(mNumPages > 0, "HostKvTier", "numPages must be positive, got {}", mNumPages);
  int64_t const total = checkedPoolBytes(gpuPool.numLayers(), gpuPool.pageBytes(), mNumPages);
  MKV_REQUIRE(total > 0 && static_cast<uint64_t>(total) <= std::numeric_limits<std::size_t>::max(),
              "HostKvTier", "{} pages of {} layers x 2 x {} bytes exceed the addressable size",
              mNumPages, gpuPool.numLayers(), gpuPool.pageBytes());
  DeviceType const device = gpuPool.deviceType();
  mLayerBytes = 2 * int64_t{mNumPages} * gpuPool.pageBytes();
  int64_t const ids = 2 * (int64_t{mNumPages} + gpuPool.numPages());
  mIds = Tensor({ids}, DataType::kInt32, device);
  mScratch.reserve(static_cast<std::size_t>(kIdsPerRange));
  mHostMarks.assign(static_cast<std::size_t>(mNumPages), 0);
  mGpuMarks.assign(static_cast<std::size_t>(gpuPool.numPages()), 0);
  mStream = std::make_unique<detail::OwnedStream>(device);
  mProducerDone = std::make_unique<detail::Event>(device);
  mTierDone = std::make_unique<detail::Event>(device);
  mIdWrites = kernels::InlinePatchBatch(device);  // flushes on the tier stream only
  // The host memory last: nothing after it throws, so the destructor always frees it.
  auto const bytes = static_cast<std::size_t>(total);
  if (device == DeviceType::kGPU) {
    mHost = detail::allocateMappedHost(bytes, mMapped);
  } else {
    try {
      mHost = ::operator new(bytes);
    } catch (std::bad_alloc const&) {
      detail::throwContract("HostKvTier", "cannot allocate {} bytes of host memory", bytes);
    }
    mMapped = mHost;
  }
  std::memset(mHost, 0, bytes);
  mLayerBases.reserve(static_cast<std::size_t>(gpuPool.numLayers()));
  for (int32_t l = 0; l < gpuPool.numLayers(); ++l) {
    mLayerBases.push_back(static_cast<uint8_t*>(mMapped) + l * mLayerBytes);
  }
}

HostKvTier::~HostKvTier() {
  (void)mStream->synchronize();  // a copy may still read or write the host pool
  if (mHost != nullptr) {
    if (deviceType() == DeviceType::kGPU) {
      detail::freePinnedHost(mHost);
    } else {
      ::operator delete(mHost);
    }
  }
}

DeviceType HostKvTier::deviceType() const noexcept { return mGpu.deviceType(); }

int64_t HostKvTier::bytesPerPage() const noexcept {
  return int64_t{mGpu.numLayers()} * 2 * mGpu.pageBytes();
}

int64_t HostKvTier::totalBytes() const noexcept { return bytesPerPage() * mNumPages; }

int64_t HostKvTier::launches() const noexcept { return mCopyLaunches + mIdWrites.launches(); }

kernels::PagedBuffers HostKvTier::pagedBuffers() const noexcept {
  return kernels::PagedBuffers{mLayerBases, deviceType(), mNumPages, mGpu.tokensPerPage(),
                               mGpu.tokenBytes()};
}

void const* HostKvTier::hostPage(int32_t layer, int32_t half, PageId page) const {
  return pageAddress(layer, half, page);
}

void* HostKvTier::hostPage(int32_t layer, int32_t half, PageId page) {
  return pageAddress(layer, half, page);
}

uint8_t* HostKvTier::pageAddress(int32_t layer, int32_t half, PageId page) const {
  MKV_REQUIRE(layer >= 0 && layer < mGpu.numLayers(), "HostKvTier::hostPage",
              "layer {} outside [0, {})", layer, mGpu.numLayers());
  MKV_REQUIRE(half == 0 || half == 1, "HostKvTier::hostPage", "half {} is neither 0 (K) nor 1 (V)",
              half);
  MKV_REQUIRE(page >= 0 && page < mNumPages, "HostKvTier::hostPage", "page {} outside [0, {})",
              page, mNumPages);
  return static_cast<uint8_t*>(mHost) + layer * mLayerBytes +
         (int64_t{half} * mNumPages + page) * mGpu.pageBytes();
}

void HostKvTier::validate(char const* call, std::span<HostPageCopy const> copies, bool offload) {
  char const* const what = offload ? "offload" : "onboard";
  int32_t const fromPages = offload ? mGpu.numPages() : mNumPages;
  int32_t const toPages = offload ? mNumPages : mGpu.numPages();
  char const* const fromPool = offload ? "GPU" : "host";
  char const* const toPool = offload ? "host" : "GPU";
  std::vector<uint32_t>& marks = offload ? mHostMarks : mGpuMarks;
  if (++mGeneration == 0) {  // wrapped: forget every old mark
    std::fill(mHostMarks.begin(), mHostMarks.end(), 0);
    std::fill(mGpuMarks.begin(), mGpuMarks.end(), 0);
    mGeneration = 1;
  }
  for (std::size_t i = 0; i < copies.size(); ++i) {
    HostPageCopy const& copy = copies[i];
    MKV_REQUIRE(copy.from >= 0 && copy.from < fromPages, call,
                "{} {} reads {} page {}, outside [0, {})", what, i, fromPool, copy.from, fromPages);
    MKV_REQUIRE(copy.to >= 0 && copy.to < toPages, call, "{} {} writes {} page {}, outside [0, {})",
                what, i, toPool, copy.to, toPages);
    uint32_t& mark = marks[static_cast<std::size_t>(copy.to)];
    MKV_REQUIRE(mark != mGeneration, call,
                "{} {} writes {} page {}, which an earlier {} of the call writes too", what, i,
                toPool, copy.to, what);
    mark = mGeneration;
  }
}

void HostKvTier::fault(char const* call, FaultSite site) const {
  detail::injectFault(mFaults, site, call, /*nameSite=*/true);
}

void HostKvTier::launch(std::span<HostPageCopy const> copies, bool offload) {
  if (copies.empty()) {
    return;
  }
  auto const n = static_cast<int64_t>(copies.size());
  int64_t const base = offload ? 0 : 2 * int64_t{mNumPages};
  int64_t const stride = offload ? mNumPages : mGpu.numPages();
  int32_t* const ids = mIds.dataPointer<int32_t>();
  Tensor const fromIds = Tensor::view(ids + base, {n}, DataType::kInt32, deviceType());
  Tensor const toIds = Tensor::view(ids + base + stride, {n}, DataType::kInt32, deviceType());
  kernels::PagedBuffers const host = pagedBuffers();
  kernels::PagedBuffers const gpu = mGpu.pagedBuffers();
  kernels::copyPages(offload ? gpu : host, offload ? host : gpu, fromIds, toIds, nullptr,
                     mStream->get());
  ++mCopyLaunches;
  (offload ? mPagesOffloaded : mPagesOnboarded) += n;
}

void HostKvTier::transfer(char const* call, std::span<HostPageCopy const> offloads,
                          std::span<HostPageCopy const> onboards, cudaStream_t producer) {
  validate(call, offloads, /*offload=*/true);
  validate(call, onboards, /*offload=*/false);
  if (offloads.empty() && onboards.empty()) {
    return;
  }
  cudaStream_t const tier = mStream->get();
  bool offloadsEnqueued = false;
  try {
    fault(call, offloads.empty() ? FaultSite::kHostTierOnboard : FaultSite::kHostTierOffload);
    mProducerDone->record(producer);
    mProducerDone->orderBefore(tier);
    // The ids of both lists, in as few inline patch launches as their count allows (one up to
    // ~330 pages per list). Earlier copies on the tier stream read the id buffer before these
    // writes, by stream order.
    auto queue = [&](std::span<HostPageCopy const> copies, int64_t base, int64_t stride) {
      for (std::size_t start = 0; start < copies.size();
           start += static_cast<std::size_t>(kIdsPerRange)) {
        std::size_t const end =
            std::min(copies.size(), start + static_cast<std::size_t>(kIdsPerRange));
        for (int64_t side = 0; side < 2; ++side) {
          mScratch.clear();
          for (std::size_t i = start; i < end; ++i) {
            mScratch.push_back(side == 0 ? copies[i].from : copies[i].to);
          }
          mIdWrites.add(call, mIds, base + side * stride + static_cast<int64_t>(start), mScratch,
                        tier);
        }
      }
    };
    queue(offloads, 0, mNumPages);
    queue(onboards, 2 * int64_t{mNumPages}, mGpu.numPages());
    mIdWrites.flush(tier);
    launch(offloads, /*offload=*/true);
    offloadsEnqueued = !offloads.empty();
    if (offloadsEnqueued && !onboards.empty()) {
      fault(call, FaultSite::kHostTierOnboard);
    }
    launch(onboards, /*offload=*/false);
    mTierDone->record(tier);
  } catch (Error const& error) {
    mIdWrites.discard();  // ids of a failed call must not reach a later one
    if (offloadsEnqueued) {
      try {
        mTierDone->record(tier);  // orderBefore still covers the offloads that were enqueued
      } catch (Error const&) {    // the first failure is the one to report
      }
    }
    std::string_view const message = error.what();
    if (message.starts_with(call)) {
      throw;
    }
    detail::throwCallError(call, std::string(message));
  }
}

void HostKvTier::orderBefore(char const* call, cudaStream_t stream) {
  fault(call, FaultSite::kHostTierOrder);
  try {
    if (!mTierDone->query()) {
      mTierDone->orderBefore(stream);
    }
  } catch (Error const& error) {
    detail::throwCallError(call, error.what());
  }
}

cudaError_t HostKvTier::synchronize() noexcept { return mStream->synchronize(); }

bool HostKvTier::transfersComplete(char const* call) {
  try {
    return mTierDone->query();
  } catch (Error const& error) {
    detail::throwCallError(call, error.what());
  }
}

}  // namespace mkv
