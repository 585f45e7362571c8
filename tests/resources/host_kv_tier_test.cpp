#include "mkv/host_kv_tier.h"

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/device.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;
using Bytes = std::vector<uint8_t>;

constexpr int32_t kLayers = 3;
constexpr int32_t kTokens = 16;
constexpr int32_t kGpuPages = 8;
constexpr int32_t kHostPages = 6;
constexpr int64_t kPageBytes = kTokens * 2 * 8 * 2;  // 2 heads x 8 dims x fp16 per token row

KVCachePoolConfig poolConfig(int32_t pages, DeviceType device) {
  return KVCachePoolConfig{kLayers, 2, 8, kTokens, pages, 4, DataType::kFloat16, device};
}

/// Page `page`, half `half` of a layer's bytes (a pool of `pages` pages).
Bytes pageOf(Bytes const& layer, int32_t pages, int32_t half, int32_t page) {
  auto const begin = layer.begin() + (int64_t{half} * pages + page) * kPageBytes;
  return Bytes(begin, begin + kPageBytes);
}

class HostKvTierTest : public test::DeviceTest {
 protected:
  void SetUp() override {
    test::DeviceTest::SetUp();
    if (IsSkipped()) {
      return;
    }
    mGpu = std::make_unique<KVCachePool>(poolConfig(kGpuPages, device()));
  }

  std::unique_ptr<HostKvTier> makeTier(int32_t pages = kHostPages) {
    HostKvTierConfig config;
    config.numPages = pages;
    config.faults = [this](FaultSite site) {
      mSites.push_back(site);
      return site == mFailing ? cudaErrorUnknown : cudaSuccess;
    };
    return std::make_unique<HostKvTier>(std::move(config), *mGpu);
  }

  /// Random bytes in every GPU page; returns them per layer.
  std::vector<Bytes> fillGpu(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<Bytes> layers;
    for (int32_t l = 0; l < kLayers; ++l) {
      layers.push_back(test::fillRandom(mGpu->layer(l), rng));
    }
    return layers;
  }
  std::vector<Bytes> readGpu() const {
    std::vector<Bytes> layers;
    for (int32_t l = 0; l < kLayers; ++l) {
      layers.push_back(test::readBytes(mGpu->layer(l)));
    }
    return layers;
  }
  /// Every host page of every layer and half, in the layout of a pool layer.
  static std::vector<Bytes> readHost(HostKvTier const& tier) {
    std::vector<Bytes> layers;
    for (int32_t l = 0; l < kLayers; ++l) {
      Bytes layer;
      for (int32_t half = 0; half < 2; ++half) {
        for (PageId p = 0; p < tier.numPages(); ++p) {
          auto const* bytes = static_cast<uint8_t const*>(tier.hostPage(l, half, p));
          layer.insert(layer.end(), bytes, bytes + kPageBytes);
        }
      }
      layers.push_back(std::move(layer));
    }
    return layers;
  }

  std::unique_ptr<KVCachePool> mGpu;
  std::vector<FaultSite> mSites;      ///< the sites the tier consulted, in order
  std::optional<FaultSite> mFailing;  ///< the injector fails this site
};

TEST_P(HostKvTierTest, HasTheGpuPoolsGeometryAndStartsZeroed) {
  std::unique_ptr<HostKvTier> const tier = makeTier();
  EXPECT_EQ(tier->numPages(), kHostPages);
  EXPECT_EQ(tier->deviceType(), device());
  EXPECT_EQ(mGpu->pageBytes(), kPageBytes);
  EXPECT_EQ(tier->bytesPerPage(), kLayers * 2 * kPageBytes);
  EXPECT_EQ(tier->totalBytes(), kHostPages * kLayers * 2 * kPageBytes);
  kernels::PagedBuffers const buffers = tier->pagedBuffers();
  EXPECT_EQ(buffers.numLayers(), kLayers);
  EXPECT_EQ(buffers.deviceType, device());
  EXPECT_EQ(buffers.numPages, kHostPages);
  EXPECT_EQ(buffers.tokensPerPage, kTokens);
  EXPECT_EQ(buffers.tokenBytes, mGpu->tokenBytes());
  for (Bytes const& layer : readHost(*tier)) {
    EXPECT_EQ(layer, Bytes(static_cast<std::size_t>(2 * kHostPages * kPageBytes), 0));
  }
  // Host pages are consecutive per half, the halves consecutive per layer.
  auto const* k0 = static_cast<uint8_t const*>(tier->hostPage(1, 0, 0));
  EXPECT_EQ(static_cast<uint8_t const*>(tier->hostPage(1, 0, 2)), k0 + 2 * kPageBytes);
  EXPECT_EQ(static_cast<uint8_t const*>(tier->hostPage(1, 1, 0)), k0 + kHostPages * kPageBytes);
  EXPECT_EQ(tier->launches(), 0);
  EXPECT_TRUE(mSites.empty());
}

TEST_P(HostKvTierTest, RejectsABadSizeOrAPageOutsideThePool) {
  EXPECT_TRUE(throwsError([&] { makeTier(0); }, {"HostKvTier", "numPages", "0"}));
  EXPECT_TRUE(throwsError([&] { makeTier(-3); }, {"HostKvTier", "-3"}));
  std::unique_ptr<HostKvTier> const tier = makeTier();
  EXPECT_TRUE(throwsError([&] { (void)tier->hostPage(kLayers, 0, 0); },
                          {"HostKvTier::hostPage", "layer 3"}));
  EXPECT_TRUE(
      throwsError([&] { (void)tier->hostPage(0, 2, 0); }, {"HostKvTier::hostPage", "half 2"}));
  EXPECT_TRUE(throwsError([&] { (void)tier->hostPage(0, 0, kHostPages); },
                          {"HostKvTier::hostPage", "page 6"}));
}

TEST_P(HostKvTierTest, OffloadThenOnboardRoundTripsEveryByteToOtherPages) {
  std::unique_ptr<HostKvTier> const tier = makeTier();
  std::vector<Bytes> const original = fillGpu(7);
  std::vector<HostPageCopy> const offloads{{1, 2}, {4, 0}, {6, 5}};
  tier->transfer("offload test", offloads, {}, nullptr);
  ASSERT_EQ(tier->synchronize(), cudaSuccess);
  std::vector<Bytes> const host = readHost(*tier);
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (int32_t half = 0; half < 2; ++half) {
      for (PageId p = 0; p < kHostPages; ++p) {
        Bytes expected(static_cast<std::size_t>(kPageBytes), 0);
        for (HostPageCopy const& copy : offloads) {
          if (copy.to == p) {
            expected = pageOf(original[l], kGpuPages, half, copy.from);
          }
        }
        EXPECT_EQ(pageOf(host[l], kHostPages, half, p), expected)
            << "layer " << l << " half " << half << " host page " << p;
      }
    }
  }
  EXPECT_EQ(readGpu(), original);  // an offload only reads the GPU pool

  for (int32_t m = 0; m < kLayers; ++m) {
    test::fillConstant(mGpu->layer(m), 0xEE);
  }
  std::vector<HostPageCopy> const onboards{{2, 7}, {0, 3}, {5, 0}};
  tier->transfer("onboard test", {}, onboards, nullptr);
  tier->orderBefore("onboard test", nullptr);
  ASSERT_EQ(tier->synchronize(), cudaSuccess);
  test::synchronize(device());
  std::vector<Bytes> const gpu = readGpu();
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (int32_t half = 0; half < 2; ++half) {
      for (PageId p = 0; p < kGpuPages; ++p) {
        Bytes expected(static_cast<std::size_t>(kPageBytes), 0xEE);
        if (p == 7) {
          expected = pageOf(original[l], kGpuPages, half, 1);
        } else if (p == 3) {
          expected = pageOf(original[l], kGpuPages, half, 4);
        } else if (p == 0) {
          expected = pageOf(original[l], kGpuPages, half, 6);
        }
        EXPECT_EQ(pageOf(gpu[l], kGpuPages, half, p), expected)
            << "layer " << l << " half " << half << " GPU page " << p;
      }
    }
  }
  EXPECT_EQ(readHost(*tier), host);  // an onboard only reads the host pool
  EXPECT_EQ(tier->pagesOffloaded(), 3);
  EXPECT_EQ(tier->pagesOnboarded(), 3);
  EXPECT_EQ(tier->launches(), 4);  // per call one id patch and one copy
  EXPECT_EQ(mSites,
            (std::vector<FaultSite>{FaultSite::kHostTierOffload, FaultSite::kHostTierOnboard,
                                    FaultSite::kHostTierOrder}));
}

TEST_P(HostKvTierTest, OneCallOffloadsFirstThenOnboards) {
  std::unique_ptr<HostKvTier> const tier = makeTier();
  std::vector<Bytes> const original = fillGpu(11);
  tier->transfer("setup", std::vector<HostPageCopy>{{2, 1}}, {}, nullptr);  // host 1 = GPU 2
  // Host page 0 is written by the offload and read by an onboard of the same call; GPU page 1 is
  // read by the offload and written by an onboard of the same call.
  std::vector<HostPageCopy> const offloads{{1, 0}};
  std::vector<HostPageCopy> const onboards{{0, 5}, {1, 1}};
  tier->transfer("ordered test", offloads, onboards, nullptr);
  tier->orderBefore("ordered test", nullptr);
  ASSERT_EQ(tier->synchronize(), cudaSuccess);
  test::synchronize(device());
  std::vector<Bytes> const gpu = readGpu();
  std::vector<Bytes> const host = readHost(*tier);
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (int32_t half = 0; half < 2; ++half) {
      Bytes const gpu1 = pageOf(original[l], kGpuPages, half, 1);
      Bytes const gpu2 = pageOf(original[l], kGpuPages, half, 2);
      EXPECT_EQ(pageOf(host[l], kHostPages, half, 0), gpu1) << "layer " << l;
      EXPECT_EQ(pageOf(gpu[l], kGpuPages, half, 5), gpu1) << "layer " << l;  // the new bytes
      EXPECT_EQ(pageOf(gpu[l], kGpuPages, half, 1), gpu2) << "layer " << l;  // after the read
    }
  }
}

TEST_P(HostKvTierTest, BatchesBeyondOnePatchRangeCarryEveryId) {
  // 700 pages per list: the ids need more than one inline patch (1,000 entries each).
  mGpu = std::make_unique<KVCachePool>(poolConfig(800, device()));
  std::unique_ptr<HostKvTier> const tier = makeTier(700);
  std::vector<Bytes> const original = fillGpu(13);
  std::vector<HostPageCopy> offloads;
  for (PageId p = 0; p < 700; ++p) {
    offloads.push_back({799 - p, p});  // GPU 799..100 -> host 0..699
  }
  std::vector<HostPageCopy> onboards;
  for (PageId p = 0; p < 100; ++p) {
    onboards.push_back({p + 600, p});  // host 600..699 -> GPU 0..99
  }
  tier->transfer("large test", offloads, onboards, nullptr);
  tier->orderBefore("large test", nullptr);
  ASSERT_EQ(tier->synchronize(), cudaSuccess);
  test::synchronize(device());
  EXPECT_GE(tier->launches(), 4);  // at least two id patches and the two copies
  std::vector<Bytes> const gpu = readGpu();
  std::vector<Bytes> const host = readHost(*tier);
  for (std::size_t l = 0; l < kLayers; ++l) {
    for (int32_t half = 0; half < 2; ++half) {
      for (PageId p = 0; p < 700; ++p) {
        ASSERT_EQ(pageOf(host[l], 700, half, p), pageOf(original[l], 800, half, 799 - p))
            << "layer " << l << " host page " << p;
      }
      for (PageId p = 0; p < 800; ++p) {
        // GPU p < 100 got host 600 + p = GPU 799 - (600 + p) = GPU 199 - p.
        PageId const source = p < 100 ? 199 - p : p;
        ASSERT_EQ(pageOf(gpu[l], 800, half, p), pageOf(original[l], 800, half, source))
            << "layer " << l << " GPU page " << p;
      }
    }
  }
}

TEST_P(HostKvTierTest, InvalidCopiesNameTheCallAndChangeNothing) {
  std::unique_ptr<HostKvTier> const tier = makeTier();
  std::vector<Bytes> const gpu = fillGpu(17);
  std::vector<Bytes> const host = readHost(*tier);
  std::vector<HostPageCopy> const good{{0, 0}};
  auto expectRejected = [&](std::vector<HostPageCopy> const& offloads,
                            std::vector<HostPageCopy> const& onboards,
                            std::initializer_list<std::string_view> fragments) {
    EXPECT_TRUE(throwsError(
        [&] { tier->transfer("ContextCacheCoordinator::evict", offloads, onboards, nullptr); },
        fragments));
  };
  expectRejected({{8, 0}}, {}, {"ContextCacheCoordinator::evict", "offload 0", "GPU page 8"});
  expectRejected({{0, 0}, {1, 6}}, {}, {"offload 1", "host page 6", "[0, 6)"});
  expectRejected({{-1, 0}}, {}, {"offload 0", "GPU page -1"});
  expectRejected(good, {{6, 0}}, {"onboard 0", "host page 6"});
  expectRejected(good, {{0, kNoPage}}, {"onboard 0", "GPU page -1"});
  expectRejected({{0, 3}, {1, 3}}, {}, {"offload 1", "host page 3", "earlier offload"});
  expectRejected(good, {{1, 4}, {2, 5}, {3, 4}}, {"onboard 2", "GPU page 4", "earlier onboard"});
  EXPECT_EQ(tier->synchronize(), cudaSuccess);
  EXPECT_EQ(readGpu(), gpu);
  EXPECT_EQ(readHost(*tier), host);
  EXPECT_EQ(tier->launches(), 0);
  EXPECT_EQ(tier->pagesOffloaded(), 0);
  EXPECT_TRUE(mSites.empty());  // validation comes before any CUDA step
  // Distinct destinations are all that is required: one source may feed several pages, and a
  // list that repeated a destination in an earlier call is fine again.
  tier->transfer("valid", std::vector<HostPageCopy>{{0, 3}, {0, 4}},
                 std::vector<HostPageCopy>{{1, 4}}, nullptr);
  tier->transfer("valid", std::vector<HostPageCopy>{{1, 3}}, {}, nullptr);
  EXPECT_EQ(tier->pagesOffloaded(), 3);
}

TEST_P(HostKvTierTest, FaultsThrowBeforeTheirStepAndNameTheCall) {
  std::unique_ptr<HostKvTier> const tier = makeTier();
  std::vector<Bytes> const gpu = fillGpu(19);
  std::vector<Bytes> const host = readHost(*tier);
  std::vector<HostPageCopy> const offloads{{3, 1}};
  std::vector<HostPageCopy> const onboards{{2, 6}};

  mFailing = FaultSite::kHostTierOffload;
  EXPECT_TRUE(throwsError([&] { tier->transfer("evict", offloads, onboards, nullptr); },
                          {"evict", "host tier offload", "cudaErrorUnknown"}));
  mFailing = FaultSite::kHostTierOnboard;
  EXPECT_TRUE(throwsError([&] { tier->transfer("prefill", {}, onboards, nullptr); },
                          {"prefill", "host tier onboard"}));
  EXPECT_EQ(tier->synchronize(), cudaSuccess);
  EXPECT_EQ(readGpu(), gpu);
  EXPECT_EQ(readHost(*tier), host);
  EXPECT_EQ(tier->launches(), 0);  // nothing enqueued: not even the ids

  // A failure at the onboard step of a call with both lists leaves the offloads enqueued (and
  // ordered by orderBefore), the onboards not.
  EXPECT_TRUE(throwsError([&] { tier->transfer("both", offloads, onboards, nullptr); },
                          {"both", "host tier onboard"}));
  mFailing.reset();
  tier->orderBefore("after", nullptr);
  EXPECT_EQ(tier->synchronize(), cudaSuccess);
  test::synchronize(device());
  EXPECT_EQ(readGpu(), gpu);
  EXPECT_EQ(pageOf(readHost(*tier)[0], kHostPages, 0, 1), pageOf(gpu[0], kGpuPages, 0, 3));
  EXPECT_EQ(tier->pagesOffloaded(), 1);
  EXPECT_EQ(tier->pagesOnboarded(), 0);

  mFailing = FaultSite::kHostTierOrder;
  EXPECT_TRUE(throwsError([&] { tier->orderBefore("ContextCacheCoordinator::prefill", nullptr); },
                          {"ContextCacheCoordinator::prefill", "host tier order"}));
  // The onboard of the failed call is not carried out by a later one.
  mFailing.reset();
  tier->transfer("next", {}, std::vector<HostPageCopy>{{1, 0}}, nullptr);
  tier->orderBefore("next", nullptr);
  EXPECT_EQ(tier->synchronize(), cudaSuccess);
  test::synchronize(device());
  EXPECT_EQ(pageOf(readGpu()[2], kGpuPages, 1, 0), pageOf(gpu[2], kGpuPages, 1, 3));
  EXPECT_EQ(pageOf(readGpu()[2], kGpuPages, 1, 6), pageOf(gpu[2], kGpuPages, 1, 6));
}

TEST_P(HostKvTierTest, AKernelOnAnOrderedStreamReadsTheOnboardedBytes) {
  // The consumer runs on a stream of its own, never synchronised with the tier stream by the
  // host: only orderBefore puts the copy before it (tests/gpu/host_kv_tier_gpu_test.cpp holds
  // the copies back behind a long kernel, so there a missing order shows).
  std::unique_ptr<HostKvTier> const tier = makeTier();
  KVCachePool readback(poolConfig(kGpuPages, device()));
  std::vector<Bytes> const original = fillGpu(23);
  detail::OwnedStream consumer(device());
  Tensor const from = test::int32Tensor({0, 1}, device());  // allocated before the copies
  Tensor const to = test::int32Tensor({3, 7}, device());
  tier->transfer("offload", std::vector<HostPageCopy>{{5, 4}, {6, 2}}, {}, nullptr);
  tier->transfer("onboard", {}, std::vector<HostPageCopy>{{4, 0}, {2, 1}}, nullptr);
  tier->orderBefore("onboard", consumer.get());
  kernels::copyPages(mGpu->pagedBuffers(), readback.pagedBuffers(), from, to, nullptr,
                     consumer.get());
  ASSERT_EQ(consumer.synchronize(), cudaSuccess);
  for (std::size_t l = 0; l < kLayers; ++l) {
    Bytes const read = test::readBytes(readback.layer(static_cast<int32_t>(l)));
    for (int32_t half = 0; half < 2; ++half) {
      EXPECT_EQ(pageOf(read, kGpuPages, half, 3), pageOf(original[l], kGpuPages, half, 5))
          << "layer " << l;
      EXPECT_EQ(pageOf(read, kGpuPages, half, 7), pageOf(original[l], kGpuPages, half, 6))
          << "layer " << l;
    }
  }
  ASSERT_EQ(tier->synchronize(), cudaSuccess);
}

INSTANTIATE_TEST_SUITE_P(Devices, HostKvTierTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv
