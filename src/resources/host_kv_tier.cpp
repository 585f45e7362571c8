#include "mkv/host_kv_tier.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "core/check.h"
#include "core/device.h"

namespace mkv {

namespace {

constexpr char const* kCreate = "HostKvTier";
/// Ids per inline patch write: the patch limit less its 3 header entries.
constexpr std::size_t kIdsPerPatch = kernels::kMaxInlinePatchValues - 3;

int32_t checkedPages(int32_t pages) {
  MKV_REQUIRE(pages > 0 && pages <= std::numeric_limits<int32_t>::max() / 2, kCreate,
              "numPages must be in [1, {}], got {}", std::numeric_limits<int32_t>::max() / 2,
              pages);
  return pages;
}

}  // namespace

HostKvTier::HostKvTier(HostKvTierConfig config, KVCachePool& gpuPool)
    : mConfig(std::move(config)),
      mGpu(gpuPool),
      mDevice(gpuPool.deviceType()),
      mNumPages(checkedPages(mConfig.numPages)),
      mIds({2 * int64_t{gpuPool.numPages()}}, DataType::kInt32, gpuPool.deviceType()) {
  auto const bytes = static_cast<std::size_t>(totalBytes());
  if (mDevice == DeviceType::kGPU) {
    mHost = detail::allocateMappedHost(bytes, mDeviceView);
  } else {
    mHost = ::operator new(bytes);
    mDeviceView = mHost;
  }
  std::memset(mHost, 0, bytes);
  int64_t const layerBytes = 2 * int64_t{mNumPages} * gpuPool.pageBytes();
  for (int32_t l = 0; l < gpuPool.numLayers(); ++l) {
    mLayerBases.push_back(static_cast<std::byte*>(mDeviceView) + l * layerBytes);
  }
  mStream = std::make_unique<detail::OwnedStream>(mDevice);
  mDone = std::make_unique<detail::Event>(mDevice);
  auto const most = static_cast<std::size_t>(std::max(gpuPool.numPages(), mNumPages));
  mSourceIds.reserve(static_cast<std::size_t>(gpuPool.numPages()));
  mDestinationIds.reserve(static_cast<std::size_t>(gpuPool.numPages()));
  mSeen.assign(most, 0);
}

HostKvTier::~HostKvTier() {
  (void)synchronize();
  mStream.reset();
  if (mDevice == DeviceType::kGPU) {
    detail::freePinnedHost(mHost);
  } else {
    ::operator delete(mHost);
  }
}

int64_t HostKvTier::bytesPerPage() const noexcept {
  return 2 * int64_t{mGpu.numLayers()} * mGpu.pageBytes();
}

kernels::PagedBuffers HostKvTier::pagedBuffers() const noexcept {
  return kernels::PagedBuffers{mLayerBases, mDevice, mNumPages, mGpu.tokensPerPage(),
                               mGpu.tokenBytes()};
}

void const* HostKvTier::hostPage(int32_t layer, int32_t half, PageId page) const {
  constexpr char const* kCall = "HostKvTier::hostPage";
  MKV_REQUIRE(layer >= 0 && layer < mGpu.numLayers(), kCall, "layer {} outside [0, {})", layer,
              mGpu.numLayers());
  MKV_REQUIRE(half == 0 || half == 1, kCall, "half {} is neither 0 (K) nor 1 (V)", half);
  MKV_REQUIRE(page >= 0 && page < mNumPages, kCall, "page {} outside [0, {})", page, mNumPages);
  int64_t const index = (int64_t{layer} * 2 + half) * mNumPages + page;
  return static_cast<std::byte const*>(mHost) + index * mGpu.pageBytes();
}

void HostKvTier::fault(char const* call, std::string_view operation) const {
  if (mConfig.faults) {
    detail::checkCuda(mConfig.faults(operation), fmt::format("{}: {}", call, operation));
  }
}

void HostKvTier::checkCopies(char const* call, std::span<HostPageCopy const> copies, bool offload) {
  int32_t const sourcePages = offload ? mGpu.numPages() : mNumPages;
  int32_t const destinationPages = offload ? mNumPages : mGpu.numPages();
  char const* const what = offload ? "offload" : "onboarding";
  MKV_REQUIRE(copies.size() <= static_cast<std::size_t>(mGpu.numPages()), call,
              "{} {} copies exceed the GPU pool's {} pages", copies.size(), what, mGpu.numPages());
  std::fill(mSeen.begin(), mSeen.end(), uint8_t{0});
  for (std::size_t i = 0; i < copies.size(); ++i) {
    HostPageCopy const copy = copies[i];
    MKV_REQUIRE(
        copy.from >= 0 && copy.from < sourcePages && copy.to >= 0 && copy.to < destinationPages,
        call, "{} {}: page {} -> {} outside [0, {}) -> [0, {})", what, i, copy.from, copy.to,
        sourcePages, destinationPages);
    uint8_t& seen = mSeen[static_cast<std::size_t>(copy.to)];
    MKV_REQUIRE(seen == 0, call, "{} {}: destination page {} is written twice", what, i, copy.to);
    seen = 1;
  }
}

void HostKvTier::launch(std::span<HostPageCopy const> copies, bool offload) {
  if (copies.empty()) {
    return;
  }
  mSourceIds.clear();
  mDestinationIds.clear();
  for (HostPageCopy const copy : copies) {
    mSourceIds.push_back(copy.from);
    mDestinationIds.push_back(copy.to);
  }
  auto const n = static_cast<int64_t>(copies.size());
  cudaStream_t const stream = mStream->get();
  // Source ids at [0, n), destination ids at [n, 2n): written by kernel parameters.
  for (std::size_t first = 0; first < copies.size(); first += kIdsPerPatch) {
    std::size_t const count = std::min(kIdsPerPatch, copies.size() - first);
    auto const at = static_cast<int64_t>(first);
    mIdWrites.add("HostKvTier::transfer", mIds, at,
                  std::span<int32_t const>(mSourceIds).subspan(first, count), stream);
    mIdWrites.add("HostKvTier::transfer", mIds, n + at,
                  std::span<int32_t const>(mDestinationIds).subspan(first, count), stream);
  }
  mIdWrites.flush(stream);
  Tensor const sources = Tensor::view(mIds.rawPointer(), {n}, DataType::kInt32, mDevice);
  Tensor const destinations =
      Tensor::view(mIds.dataPointer<int32_t>() + n, {n}, DataType::kInt32, mDevice);
  kernels::PagedBuffers const gpu = mGpu.pagedBuffers();
  kernels::PagedBuffers const host = pagedBuffers();
  kernels::copyPages(offload ? gpu : host, offload ? host : gpu, sources, destinations, nullptr,
                     stream);
}

void HostKvTier::transfer(char const* call, std::span<HostPageCopy const> offloads,
                          std::span<HostPageCopy const> onboards) {
  checkCopies(call, offloads, true);
  checkCopies(call, onboards, false);
  if (offloads.empty() && onboards.empty()) {
    return;
  }
  if (!offloads.empty()) {
    fault(call, "offload");
  }
  if (!onboards.empty()) {
    fault(call, "onboard");
  }
  try {
    launch(offloads, true);
    launch(onboards, false);
  } catch (...) {
    mIdWrites.discard();  // a failed patch keeps its queue; the next transfer writes its own ids
    throw;
  }
  mDone->record(mStream->get());
}

void HostKvTier::orderBefore(char const* call, cudaStream_t stream) {
  fault(call, "order");
  if (!mDone->query()) {
    mDone->orderBefore(stream);
  }
}

cudaError_t HostKvTier::synchronize() noexcept {
  if (mConfig.faults) {
    cudaError_t const injected = mConfig.faults("synchronize");
    if (injected != cudaSuccess) {
      return injected;
    }
  }
  return mStream ? mStream->synchronize() : cudaSuccess;
}

}  // namespace mkv
