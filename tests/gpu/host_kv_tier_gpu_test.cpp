/// HostKvTier on the GPU, ordered across streams: the tier's copies wait (on the device) for the
/// stream that wrote the KV they offload, and a consumer stream ordered by orderBefore reads what
/// they onboarded; no call waits on the host. The producer stream is held back by a spinning
/// kernel, so a missing device-side wait would copy or read stale bytes, and a host wait would
/// show as the producer having finished (checked by state, never by a clock).

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <random>
#include <vector>

#include "busy_stream.h"
#include "gpu_parity.h"
#include "mkv/host_kv_tier.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "support/test_util.h"

namespace mkv::gputest {
namespace {

using Bytes = std::vector<uint8_t>;

constexpr std::chrono::milliseconds kBusyFor{1000};
constexpr int32_t kLayers = 2;
constexpr int32_t kPages = 8;

Bytes pageOf(Bytes const& layer, int64_t pageBytes, int32_t half, int32_t page) {
  auto const begin = layer.begin() + (int64_t{half} * kPages + page) * pageBytes;
  return Bytes(begin, begin + pageBytes);
}

class HostKvTierGpuTest : public GpuTest {};

TEST_F(HostKvTierGpuTest, CopiesFollowTheProducerAndPrecedeOrderedConsumersWithoutHostWaits) {
  kernels::loadKernels();  // a lazy kernel load may synchronise the context
  KVCachePoolConfig const config{kLayers,         2, 8, 16, kPages, 4, DataType::kFloat16,
                                 DeviceType::kGPU};
  KVCachePool gpu(config);
  KVCachePool fresh(config);     // the bytes the producer writes
  KVCachePool readback(config);  // what the consumer's kernel read
  HostKvTier tier(HostKvTierConfig{4, {}}, gpu);
  std::mt19937_64 rng(29);
  std::vector<Bytes> next;
  for (int32_t l = 0; l < kLayers; ++l) {
    (void)test::fillRandom(gpu.layer(l), rng);
    next.push_back(test::fillRandom(fresh.layer(l), rng));
  }
  Tensor const seven = test::int32Tensor({7}, DeviceType::kGPU);
  Tensor const two = test::int32Tensor({2}, DeviceType::kGPU);
  Tensor const five = test::int32Tensor({5}, DeviceType::kGPU);
  Tensor const three = test::int32Tensor({3}, DeviceType::kGPU);
  std::vector<HostPageCopy> const offload{{2, 1}};
  std::vector<HostPageCopy> const onboard{{1, 5}};
  BusyStream producer;
  // Nothing below allocates: the producer's engine writes GPU page 2 after a long kernel, the
  // tier offloads page 2 to host page 1 and onboards it into GPU page 5, a consumer reads page 5.
  producer.occupy(kBusyFor);
  kernels::copyPages(fresh.pagedBuffers(), gpu.pagedBuffers(), seven, two, nullptr,
                     producer.stream());
  tier.transfer("offload", offload, {}, producer.stream());
  tier.transfer("onboard", {}, onboard, stream());
  tier.orderBefore("onboard", stream());
  kernels::copyPages(gpu.pagedBuffers(), readback.pagedBuffers(), five, three, nullptr, stream());
  EXPECT_EQ(producer.query(), cudaErrorNotReady)
      << "a tier call waited on the host for the producer (" << kBusyFor.count() << " ms kernel)";
  EXPECT_EQ(cudaStreamQuery(stream()), cudaErrorNotReady)
      << "the consumer is not ordered after the tier's copies";
  synchronize();
  ASSERT_EQ(tier.synchronize(), cudaSuccess);
  int64_t const pageBytes = gpu.pageBytes();
  for (int32_t l = 0; l < kLayers; ++l) {
    auto const layer = static_cast<std::size_t>(l);
    Bytes const read = test::readBytes(readback.layer(l));
    for (int32_t half = 0; half < 2; ++half) {
      Bytes const written = pageOf(next[layer], pageBytes, half, 7);
      auto const* host = static_cast<uint8_t const*>(tier.hostPage(l, half, 1));
      EXPECT_EQ(Bytes(host, host + pageBytes), written) << "host page 1, layer " << l;
      EXPECT_EQ(pageOf(read, pageBytes, half, 3), written) << "consumer's read, layer " << l;
    }
  }
}

}  // namespace
}  // namespace mkv::gputest
