/// kernels::InlinePatchBatch: int32 writes to a few tensors, applied by one inline patch launch.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "core/check.h"
#include "core/device.h"
#include "core/faults.h"
#include "kernel_params.h"
#include "mkv/kernels.h"
#include "patch_ring.h"

namespace mkv::kernels {
namespace {

/// One write folded into a batch's running digest (a splitmix64 finaliser per value).
uint64_t digestWrite(uint64_t digest, int64_t offset, std::span<int32_t const> values) {
  auto const mix = [](uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
  };
  digest = mix(digest ^ static_cast<uint64_t>(offset) ^ (values.size() << 40));
  for (int32_t const value : values) {
    digest = mix(digest + static_cast<uint32_t>(value) + 0x9E3779B97F4A7C15ULL);
  }
  return digest;
}

/// The header entries (offset, count, valueStart) each range adds to the launch's patch.
constexpr int32_t kHeaderPerRange = 3;

/// When the entries [first, first + values.size()) lie inside a queued range (of InlinePatchBatch's
/// `ranges` over `targets`), overwrites that range's queued values there and returns true; else
/// changes nothing. Compared as addresses, like overlapsQueued. Queued ranges never overlap each
/// other, so a range inside one of them meets no other: overwriting values not yet applied gives
/// what applying both writes in order would.
template <typename Ranges>
bool replaceInside(Ranges const& ranges, int32_t* const* targets, std::vector<int32_t>& queued,
                   int32_t const* first, std::span<int32_t const> values) {
  auto const begin = reinterpret_cast<std::uintptr_t>(first);
  auto const end = begin + values.size() * sizeof(int32_t);
  for (auto const& range : ranges) {
    auto const queuedBegin = reinterpret_cast<std::uintptr_t>(targets[range.target] + range.offset);
    auto const queuedEnd = queuedBegin + static_cast<std::size_t>(range.count) * sizeof(int32_t);
    if (queuedBegin <= begin && end <= queuedEnd && (begin - queuedBegin) % sizeof(int32_t) == 0) {
      auto const skip = static_cast<std::ptrdiff_t>((begin - queuedBegin) / sizeof(int32_t));
      std::copy(values.begin(), values.end(), queued.begin() + range.valueStart + skip);
      return true;
    }
  }
  return false;
}

}  // namespace

InlinePatchBatch::InlinePatchBatch() {
  mRanges.reserve(static_cast<std::size_t>(kMaxInlinePatchValues / (kHeaderPerRange + 1)));
  mValues.reserve(static_cast<std::size_t>(kMaxInlinePatchValues));
}

InlinePatchBatch::InlinePatchBatch(DeviceType deviceType) : InlinePatchBatch() {
  if (deviceType == DeviceType::kGPU) {
    mRing = std::make_unique<detail::PatchRing>();
  }
}

InlinePatchBatch::~InlinePatchBatch() = default;
InlinePatchBatch::InlinePatchBatch(InlinePatchBatch&& other) noexcept = default;
InlinePatchBatch& InlinePatchBatch::operator=(InlinePatchBatch&& other) noexcept = default;

int32_t InlinePatchBatch::findTarget(int32_t const* base) const {
  for (int32_t t = 0; t < mNumTargets; ++t) {
    if (mTargets[t] == base) {
      return t;
    }
  }
  return -1;
}

bool InlinePatchBatch::overlapsQueued(int32_t const* base, int64_t offset, int64_t count) const {
  // Compared as addresses: two tensors may view the same memory.
  auto const begin = reinterpret_cast<std::uintptr_t>(base + offset);
  auto const end = reinterpret_cast<std::uintptr_t>(base + offset + count);
  return std::any_of(mRanges.begin(), mRanges.end(), [&](Range const& range) {
    int32_t* const queuedBase = mTargets[range.target];
    auto const queuedBegin = reinterpret_cast<std::uintptr_t>(queuedBase + range.offset);
    auto const queuedEnd =
        reinterpret_cast<std::uintptr_t>(queuedBase + range.offset + range.count);
    return begin < queuedEnd && queuedBegin < end;
  });
}

void InlinePatchBatch::add(char const* call, Tensor& dst, int64_t offset,
                           std::span<int32_t const> values, cudaStream_t stream) {
  auto const count = static_cast<int64_t>(values.size());
  MKV_REQUIRE(dst.dataType() == DataType::kInt32, call, "the patched tensor must be int32, got {}",
              toString(dst.dataType()));
  MKV_REQUIRE(offset >= 0 && offset + count <= dst.numel(), call,
              "writes [{}, {}) are outside a tensor of {} entries", offset, offset + count,
              dst.numel());
  MKV_REQUIRE(offset + count <= std::numeric_limits<int32_t>::max(), call,
              "writes up to entry {} are beyond an int32 patch offset", offset + count);
  MKV_REQUIRE(count + kHeaderPerRange <= kMaxInlinePatchValues, call,
              "{} values in one range exceed the inline limit of {}", count,
              kMaxInlinePatchValues - kHeaderPerRange);
  MKV_REQUIRE(empty() || dst.deviceType() == mDeviceType, call,
              "a {} tensor joins writes queued for {} tensors", toString(dst.deviceType()),
              toString(mDeviceType));
  if (count == 0) {
    return;
  }
  if (mRecordsDigest) {
    mWrittenDigest = digestWrite(mWrittenDigest, offset, values);
  }
  int32_t* const base = dst.dataPointer<int32_t>();
  if (replaceInside(mRanges, mTargets, mValues, base + offset, values)) {
    return;
  }
  int64_t const queuedEntries =
      static_cast<int64_t>(mValues.size()) + kHeaderPerRange * static_cast<int64_t>(mRanges.size());
  bool const full = queuedEntries + kHeaderPerRange + count > kMaxInlinePatchValues ||
                    (findTarget(base) < 0 && mNumTargets == kMaxInlinePatchTargets);
  if (full || overlapsQueued(base, offset, count)) {
    flush(stream);
  }
  int32_t target = findTarget(base);
  if (target < 0) {
    target = mNumTargets++;
    mTargets[target] = base;
    mTargetNumel[target] = dst.numel();
  }
  mDeviceType = dst.deviceType();
  mRanges.push_back(
      {target, static_cast<int32_t>(mValues.size()), offset, static_cast<int32_t>(count)});
  mValues.insert(mValues.end(), values.begin(), values.end());
}

void InlinePatchBatch::fillLaunch(detail::Int32InlinePatchLaunch& launch) {
  // The launch groups ranges by target; within a batch no two ranges overlap, so the order in
  // which they are applied does not matter.
  std::sort(mRanges.begin(), mRanges.end(),
            [](Range const& a, Range const& b) { return a.target < b.target; });
  auto const numRanges = static_cast<int32_t>(mRanges.size());
  int32_t valueStart = kHeaderPerRange * numRanges;
  for (int32_t r = 0; r < numRanges; ++r) {
    Range const& range = mRanges[static_cast<std::size_t>(r)];
    int32_t* const header = launch.patch + int64_t{kHeaderPerRange} * r;
    header[0] = static_cast<int32_t>(range.offset);
    header[1] = range.count;
    header[2] = valueStart;
    std::copy_n(mValues.begin() + range.valueStart, range.count, launch.patch + valueStart);
    valueStart += range.count;
  }
  for (int32_t t = 0; t < mNumTargets; ++t) {
    launch.dst[t] = mTargets[t];
    launch.dstNumel[t] = mTargetNumel[t];
    launch.targetRangeEnd[t] = 0;
  }
  for (int32_t r = 0; r < numRanges; ++r) {
    launch.targetRangeEnd[mRanges[static_cast<std::size_t>(r)].target] = r + 1;
  }
  launch.numTargets = mNumTargets;
  launch.numRanges = numRanges;
  launch.patchNumel = valueStart;
}

void InlinePatchBatch::flush(cudaStream_t stream) {
  constexpr char const* kCall = "InlinePatchBatch::flush";
  if (empty()) {
    return;
  }
  // A launch that fails throws here and keeps the queue: the writes are retried by the next
  // flush, so a table that counts them as uploaded still reaches the device.
  mkv::detail::injectFault(mFaults, FaultSite::kDeviceWriteLaunch, kCall);
  detail::Int32InlinePatchLaunch* const slot =
      mRing != nullptr && mDeviceType == DeviceType::kGPU ? mRing->acquire(stream) : nullptr;
  if (slot != nullptr) {
    fillLaunch(*slot);
    mRing->launch(kCall, stream);
    ++mRingLaunches;
  } else {
    detail::Int32InlinePatchLaunch launch{};
    fillLaunch(launch);
    detail::runInt32InlinePatch(mDeviceType, kCall, launch, stream);
  }
  discard();
  ++mLaunches;
}

void InlinePatchBatch::discard() noexcept {
  mRanges.clear();
  mValues.clear();
  mNumTargets = 0;
}

}  // namespace mkv::kernels
