/// copyPages on the GPU against its host twin: whole and partial pages, skipped and duplicate
/// ids, in-pool copies, odd and misaligned geometries, up to kMaxLayers layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <ostream>
#include <random>
#include <vector>

#include "gpu/gpu_parity.h"
#include "kernel_params.h"
#include "mkv/kernels.h"

namespace mkv::gputest {
namespace {

using kernels::PagedBuffers;

struct PageGeometry {
  int32_t layers;
  int32_t numPages;
  int32_t tokensPerPage;
  int64_t tokenBytes;
  int64_t misalign;  // bytes added to every layer base pointer
};

void PrintTo(PageGeometry const& g, std::ostream* os) {
  *os << g.layers << " layers x " << g.numPages << " pages x " << g.tokensPerPage << " tokens x "
      << g.tokenBytes << " B, base +" << g.misalign;
}

/// `layers` paged buffers of one geometry, laid out in one mirrored allocation with a gap
/// between layers (so a stray write lands in bytes that are checked).
class PagePool {
 public:
  PagePool(PageGeometry const& g, int32_t numPages, uint8_t fill, std::mt19937_64* random)
      : mGeometry(g),
        mNumPages(numPages),
        mLayerStride(2 * numPages * g.tokensPerPage * g.tokenBytes + 64),
        mBytes(initialBytes(g, numPages, fill, random)) {
    for (int32_t l = 0; l < g.layers; ++l) {
      mCpuBases.push_back(mBytes.cpu() + layerOffset(l));
      mGpuBases.push_back(mBytes.gpu() + layerOffset(l));
    }
  }

  PagedBuffers buffers(DeviceType device) const {
    auto const& bases = device == DeviceType::kGPU ? mGpuBases : mCpuBases;
    return PagedBuffers{bases, device, mNumPages, mGeometry.tokensPerPage, mGeometry.tokenBytes};
  }
  int64_t pageBytes() const { return mGeometry.tokensPerPage * mGeometry.tokenBytes; }
  int64_t layerOffset(int32_t layer) const { return mGeometry.misalign + layer * mLayerStride; }
  /// Offset of (layer, half, page) in the allocation.
  int64_t pageOffset(int32_t layer, int32_t half, int32_t page) const {
    return layerOffset(layer) + (int64_t{half} * mNumPages + page) * pageBytes();
  }
  MirroredBytes& bytes() { return mBytes; }
  MirroredBytes const& bytes() const { return mBytes; }

 private:
  static std::vector<uint8_t> initialBytes(PageGeometry const& g, int32_t numPages, uint8_t fill,
                                           std::mt19937_64* random) {
    int64_t const stride = 2 * numPages * g.tokensPerPage * g.tokenBytes + 64;
    auto const size = static_cast<std::size_t>(g.misalign + g.layers * stride);
    std::vector<uint8_t> bytes(size, fill);
    if (random != nullptr) {
      std::uniform_int_distribution<int> byte(0, 255);
      for (uint8_t& b : bytes) {
        b = static_cast<uint8_t>(byte(*random));
      }
    }
    return bytes;
  }

  PageGeometry mGeometry;
  int32_t mNumPages;
  int64_t mLayerStride;
  MirroredBytes mBytes;
  std::vector<void*> mCpuBases;
  std::vector<void*> mGpuBases;
};

class CopyPagesGpuTest : public GpuTest, public ::testing::WithParamInterface<PageGeometry> {
 protected:
  /// Runs copyPages on both devices and checks parity, and (for a poisoned destination pool)
  /// that exactly the target token rows were written, with the source bytes.
  void runBoth(PagePool& src, PagePool& dst, std::vector<int32_t> const& srcIds,
               std::vector<int32_t> const& dstIds, std::vector<int32_t> const* counts,
               bool dstPoisoned) {
    MirroredInt32 const srcIdTensor(srcIds);
    MirroredInt32 const dstIdTensor(dstIds);
    std::vector<int32_t> const noCounts;
    MirroredInt32 const countTensor(counts != nullptr ? *counts : noCounts);
    std::vector<uint8_t> const srcBefore(src.bytes().cpuBytes().begin(),
                                         src.bytes().cpuBytes().end());
    for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
      kernels::copyPages(src.buffers(device), dst.buffers(device), srcIdTensor.on(device),
                         dstIdTensor.on(device),
                         counts != nullptr ? &countTensor.on(device) : nullptr,
                         device == DeviceType::kGPU ? stream() : nullptr);
    }
    synchronize();
    EXPECT_TRUE(sameBytes(dst.bytes()));
    EXPECT_TRUE(sameBytes(src.bytes()));
    if (!dstPoisoned) {
      return;
    }
    std::vector<uint8_t> const result = dst.bytes().gpuBytes();
    std::vector<ByteRange> written;
    int32_t const layers = GetParam().layers;
    for (std::size_t i = 0; i < srcIds.size(); ++i) {
      if (srcIds[i] < 0 || dstIds[i] < 0) {
        continue;
      }
      int64_t const bytes =
          (counts != nullptr ? (*counts)[i] : GetParam().tokensPerPage) * GetParam().tokenBytes;
      for (int32_t l = 0; l < layers; ++l) {
        for (int32_t half = 0; half < 2; ++half) {
          int64_t const at = dst.pageOffset(l, half, dstIds[i]);
          int64_t const from = src.pageOffset(l, half, srcIds[i]);
          written.push_back({at, at + bytes});
          ASSERT_EQ(0, std::memcmp(result.data() + at, srcBefore.data() + from,
                                   static_cast<std::size_t>(bytes)))
              << "item " << i << " layer " << l << " half " << half;
        }
      }
    }
    EXPECT_TRUE(untouchedOutside(result, written, kPoison));
  }

  std::mt19937_64 mRng{20261202};
};

TEST_P(CopyPagesGpuTest, GatherWithSkippedIdsMatchesHostTwin) {
  PageGeometry const g = GetParam();
  PagePool src(g, g.numPages * 2, 0, &mRng);
  PagePool dst(g, g.numPages, kPoison, nullptr);
  int32_t const n = g.numPages;
  std::vector<int32_t> srcIds = distinctIds(n, 2 * g.numPages, mRng);
  std::vector<int32_t> dstIds = distinctIds(n, g.numPages, mRng);
  dropSome(srcIds, 0.2, mRng);
  dropSome(dstIds, 0.2, mRng);
  runBoth(src, dst, srcIds, dstIds, nullptr, true);
}

TEST_P(CopyPagesGpuTest, PartialTokenCountsMatchHostTwin) {
  PageGeometry const g = GetParam();
  PagePool src(g, g.numPages, 0, &mRng);
  PagePool dst(g, g.numPages, kPoison, nullptr);
  int32_t const n = g.numPages;
  std::vector<int32_t> const srcIds = distinctIds(n, g.numPages, mRng);
  std::vector<int32_t> dstIds = distinctIds(n, g.numPages, mRng);
  dropSome(dstIds, 0.1, mRng);
  std::uniform_int_distribution<int32_t> tokens(0, g.tokensPerPage);
  std::vector<int32_t> counts(static_cast<std::size_t>(n));
  for (int32_t& c : counts) {
    c = tokens(mRng);
  }
  counts.front() = g.tokensPerPage;
  counts.back() = 0;
  runBoth(src, dst, srcIds, dstIds, &counts, true);
}

TEST_P(CopyPagesGpuTest, DuplicateSourceIdsMatchHostTwin) {
  PageGeometry const g = GetParam();
  PagePool src(g, 3, 0, &mRng);
  PagePool dst(g, g.numPages, kPoison, nullptr);
  std::vector<int32_t> const srcIds(static_cast<std::size_t>(g.numPages), 2);
  std::vector<int32_t> const dstIds = distinctIds(g.numPages, g.numPages, mRng);
  runBoth(src, dst, srcIds, dstIds, nullptr, true);
}

TEST_P(CopyPagesGpuTest, CopyInsideOnePoolMatchesHostTwin) {
  PageGeometry const g = GetParam();
  PagePool pool(g, 2 * g.numPages, 0, &mRng);
  std::vector<int32_t> const pages = distinctIds(2 * g.numPages, 2 * g.numPages, mRng);
  std::vector<int32_t> const dstIds(pages.begin(), pages.begin() + g.numPages);
  std::vector<int32_t> const srcIds(pages.begin() + g.numPages, pages.end());
  runBoth(pool, pool, srcIds, dstIds, nullptr, false);
}

INSTANTIATE_TEST_SUITE_P(
    Geometries, CopyPagesGpuTest,
    ::testing::Values(PageGeometry{1, 8, 16, 2048, 0},  // 32 KiB K/V pages (8 heads x 128 x bf16)
                      PageGeometry{2, 4, 64, 4096, 4},  // 256 KiB pages, 4-byte aligned bases
                      PageGeometry{3, 16, 4, 96, 0},    // 384 B pages: one warp per page
                      PageGeometry{4, 5, 8, 2056, 0},   // tokenBytes 8-byte aligned only
                      PageGeometry{2, 3, 5, 6146, 2},   // 30 KiB pages, ragged last chunk
                      PageGeometry{2, 6, 3, 17, 0},     // odd token rows: byte accesses
                      PageGeometry{2, 5, 1, 1, 1},      // 1-byte pages at odd addresses
                      PageGeometry{kernels::kMaxLayers, 3, 2, 64, 0}));  // every layer slot

class CopyPagesKernelTest : public GpuTest {
 protected:
  std::mt19937_64 mRng{7};
};

TEST_F(CopyPagesKernelTest, OutOfRangeIdsAndCountsAreSkippedOrClampedLikeTheHostTwin) {
  // The launcher rejects these on the host; the kernel must still treat them like the twin.
  PageGeometry const g{2, 4, 4, 48, 0};
  PagePool src(g, 4, 0, &mRng);
  PagePool dst(g, 4, kPoison, nullptr);
  std::vector<int32_t> const srcIds{0, 7, -5, 1, 2, 3};
  std::vector<int32_t> const dstIds{0, 1, 2, 4, 2, 3};
  std::vector<int32_t> const counts{9, 2, 2, 2, -3, 1};
  MirroredInt32 const s(srcIds);
  MirroredInt32 const d(dstIds);
  MirroredInt32 const c(counts);
  for (DeviceType device : {DeviceType::kCPU, DeviceType::kGPU}) {
    kernels::detail::CopyPagesLaunch launch{};
    for (int32_t l = 0; l < g.layers; ++l) {
      launch.srcLayers[l] = src.buffers(device).layerBases[static_cast<std::size_t>(l)];
      launch.dstLayers[l] = dst.buffers(device).layerBases[static_cast<std::size_t>(l)];
    }
    launch.srcIds = s.on(device).dataPointer<int32_t>();
    launch.dstIds = d.on(device).dataPointer<int32_t>();
    launch.tokenCounts = c.on(device).dataPointer<int32_t>();
    launch.tokenBytes = g.tokenBytes;
    launch.numLayers = g.layers;
    launch.numItems = static_cast<int32_t>(srcIds.size());
    launch.srcNumPages = 4;
    launch.dstNumPages = 4;
    launch.tokensPerPage = g.tokensPerPage;
    if (device == DeviceType::kCPU) {
      kernels::detail::copyPagesHost(launch);
    } else {
      cudaOk(kernels::detail::copyPagesCuda(launch, stream()), "copyPagesCuda");
    }
  }
  synchronize();
  EXPECT_TRUE(sameBytes(dst.bytes()));
  // Only item 0 (clamped to the whole page) and item 5 (one token) were copied.
  std::vector<uint8_t> const result = dst.bytes().gpuBytes();
  std::vector<ByteRange> written;
  for (int32_t l = 0; l < g.layers; ++l) {
    for (int32_t half = 0; half < 2; ++half) {
      written.push_back({dst.pageOffset(l, half, 0), dst.pageOffset(l, half, 0) + 4 * 48});
      written.push_back({dst.pageOffset(l, half, 3), dst.pageOffset(l, half, 3) + 48});
    }
  }
  EXPECT_TRUE(untouchedOutside(result, written, kPoison));
}

}  // namespace
}  // namespace mkv::gputest
