#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "mkv/kernels.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

/// Per-layer paged buffers `[2, numPages, tokensPerPage, tokenBytes]` (uint8) on one device,
/// with a host copy of what they should hold.
struct Paged {
  Paged(int32_t layers, int32_t pages, int32_t tokensPerPage, int64_t tokenBytes, DeviceType device)
      : numPages(pages), tokens(tokensPerPage), bytesPerToken(tokenBytes), deviceType(device) {
    for (int32_t l = 0; l < layers; ++l) {
      tensors.emplace_back(Coords{2, pages, tokensPerPage, tokenBytes}, DataType::kUInt8, device);
      bases.push_back(tensors.back().rawPointer());
    }
    expected.resize(static_cast<std::size_t>(layers));
  }

  kernels::PagedBuffers buffers() const {
    return kernels::PagedBuffers{bases, deviceType, numPages, tokens, bytesPerToken};
  }
  void fillRandom(std::mt19937_64& rng) {
    for (std::size_t l = 0; l < tensors.size(); ++l) {
      expected[l] = test::fillRandom(tensors[l], rng);
    }
  }
  /// Byte offset of (half, page, token) inside one layer.
  std::size_t offset(int32_t half, int32_t page, int32_t token) const {
    return static_cast<std::size_t>(((int64_t{half} * numPages + page) * tokens + token) *
                                    bytesPerToken);
  }
  void expectMatches() const {
    for (std::size_t l = 0; l < tensors.size(); ++l) {
      EXPECT_EQ(test::readBytes(tensors[l]), expected[l]) << "layer " << l;
    }
  }

  int32_t numPages;
  int32_t tokens;
  int64_t bytesPerToken;
  DeviceType deviceType;
  std::vector<Tensor> tensors;
  std::vector<void*> bases;
  std::vector<std::vector<uint8_t>> expected;
};

/// The naive model: item by item, layer by layer, half by half, the first n token rows of
/// `srcBytes` (laid out like `src`) into dst.expected.
void modelCopyPages(Paged const& src, std::vector<std::vector<uint8_t>> const& srcBytes, Paged& dst,
                    std::vector<int32_t> const& srcIds, std::vector<int32_t> const& dstIds,
                    std::vector<int32_t> const* counts) {
  for (std::size_t i = 0; i < srcIds.size(); ++i) {
    if (srcIds[i] < 0 || dstIds[i] < 0) {
      continue;
    }
    int32_t const tokens = counts != nullptr ? (*counts)[i] : src.tokens;
    for (std::size_t l = 0; l < dst.expected.size(); ++l) {
      for (int32_t half = 0; half < 2; ++half) {
        for (int32_t t = 0; t < tokens; ++t) {
          for (int64_t b = 0; b < src.bytesPerToken; ++b) {
            dst.expected[l][dst.offset(half, dstIds[i], t) + static_cast<std::size_t>(b)] =
                srcBytes[l][src.offset(half, srcIds[i], t) + static_cast<std::size_t>(b)];
          }
        }
      }
    }
  }
}

class CopyPagesTest : public test::DeviceTest {};

TEST_P(CopyPagesTest, GathersWholePagesOfEveryLayerAndBothHalves) {
  std::mt19937_64 rng(1);
  Paged pool(3, 8, 16, 32, device());
  Paged slab(3, 4, 16, 32, device());
  pool.fillRandom(rng);
  slab.fillRandom(rng);
  std::vector<int32_t> const srcIds{5, 0, 7};
  std::vector<int32_t> const dstIds{2, 0, 3};
  Tensor const src = test::int32Tensor(srcIds, device());
  Tensor const dst = test::int32Tensor(dstIds, device());
  kernels::copyPages(pool.buffers(), slab.buffers(), src, dst, nullptr, nullptr);
  modelCopyPages(pool, pool.expected, slab, srcIds, dstIds, nullptr);
  slab.expectMatches();
  pool.expectMatches();  // the source is untouched
}

TEST_P(CopyPagesTest, PartialCountsCopyOnlyTheLeadingTokenRows) {
  std::mt19937_64 rng(2);
  Paged pool(2, 6, 16, 24, device());
  Paged slab(2, 3, 16, 24, device());
  pool.fillRandom(rng);
  for (std::size_t l = 0; l < slab.tensors.size(); ++l) {
    slab.expected[l] = test::fillConstant(slab.tensors[l], 0xA5);  // poison
  }
  std::vector<int32_t> const srcIds{4, 1, 2};
  std::vector<int32_t> const dstIds{0, 1, 2};
  std::vector<int32_t> const counts{1, 16, 5};
  Tensor const src = test::int32Tensor(srcIds, device());
  Tensor const dst = test::int32Tensor(dstIds, device());
  Tensor const tokenCounts = test::int32Tensor(counts, device());
  kernels::copyPages(pool.buffers(), slab.buffers(), src, dst, &tokenCounts, nullptr);
  modelCopyPages(pool, pool.expected, slab, srcIds, dstIds, &counts);
  slab.expectMatches();
  // Spot check the model itself: token row 5 of slot 2 (V half) is still poison.
  EXPECT_EQ(slab.expected[1][slab.offset(1, 2, 5)], 0xA5);
  EXPECT_EQ(slab.expected[1][slab.offset(1, 2, 4)], pool.expected[1][pool.offset(1, 2, 4)]);
}

TEST_P(CopyPagesTest, MinusOneIdsAndZeroCountsAreSkipped) {
  std::mt19937_64 rng(3);
  Paged pool(1, 4, 16, 16, device());
  Paged slab(1, 4, 16, 16, device());
  pool.fillRandom(rng);
  slab.fillRandom(rng);
  std::vector<uint8_t> const before = slab.expected[0];
  std::vector<int32_t> const srcIds{-1, 2, 3};
  std::vector<int32_t> const dstIds{0, -1, 3};
  std::vector<int32_t> const counts{16, 16, 0};
  Tensor const src = test::int32Tensor(srcIds, device());
  Tensor const dst = test::int32Tensor(dstIds, device());
  Tensor const tokenCounts = test::int32Tensor(counts, device());
  kernels::copyPages(pool.buffers(), slab.buffers(), src, dst, &tokenCounts, nullptr);
  EXPECT_EQ(test::readBytes(slab.tensors[0]), before);
}

TEST_P(CopyPagesTest, CopiesBetweenPagesOfOnePool) {
  std::mt19937_64 rng(4);
  Paged pool(2, 8, 16, 32, device());
  pool.fillRandom(rng);
  std::vector<int32_t> const srcIds{0, 1};
  std::vector<int32_t> const dstIds{6, 7};
  Tensor const src = test::int32Tensor(srcIds, device());
  Tensor const dst = test::int32Tensor(dstIds, device());
  kernels::copyPages(pool.buffers(), pool.buffers(), src, dst, nullptr, nullptr);
  std::vector<std::vector<uint8_t>> const before = pool.expected;
  modelCopyPages(pool, before, pool, srcIds, dstIds, nullptr);
  pool.expectMatches();
}

TEST_P(CopyPagesTest, RandomIdsAndCountsMatchTheNaiveModel) {
  std::mt19937_64 rng(5);
  struct Geometry {
    int32_t layers, srcPages, dstPages, tokensPerPage;
    int64_t tokenBytes;
  };
  // Aligned and unaligned token rows, small and large pages.
  for (Geometry const g : {Geometry{3, 9, 7, 16, 64}, Geometry{2, 5, 11, 16, 6},
                           Geometry{1, 4, 4, 32, 256}, Geometry{4, 12, 6, 16, 2}}) {
    for (int round = 0; round < 12; ++round) {
      Paged src(g.layers, g.srcPages, g.tokensPerPage, g.tokenBytes, device());
      Paged dst(g.layers, g.dstPages, g.tokensPerPage, g.tokenBytes, device());
      src.fillRandom(rng);
      dst.fillRandom(rng);
      std::vector<int32_t> dstPool(static_cast<std::size_t>(g.dstPages));
      std::iota(dstPool.begin(), dstPool.end(), 0);
      std::shuffle(dstPool.begin(), dstPool.end(), rng);
      std::size_t const items = std::uniform_int_distribution<std::size_t>(1, dstPool.size())(rng);
      std::vector<int32_t> srcIds(items);
      std::vector<int32_t> dstIds(dstPool.begin(), dstPool.begin() + static_cast<long>(items));
      std::vector<int32_t> counts(items);
      for (std::size_t i = 0; i < items; ++i) {
        srcIds[i] = std::uniform_int_distribution<int32_t>(0, g.srcPages - 1)(rng);
        if (rng() % 6 == 0) {
          srcIds[i] = -1;
        }
        if (rng() % 8 == 0) {
          dstIds[i] = -1;
        }
        counts[i] = std::uniform_int_distribution<int32_t>(0, g.tokensPerPage)(rng);
      }
      bool const partial = round % 2 == 0;
      Tensor const srcTensor = test::int32Tensor(srcIds, device());
      Tensor const dstTensor = test::int32Tensor(dstIds, device());
      Tensor const countTensor = test::int32Tensor(counts, device());
      kernels::copyPages(src.buffers(), dst.buffers(), srcTensor, dstTensor,
                         partial ? &countTensor : nullptr, nullptr);
      modelCopyPages(src, src.expected, dst, srcIds, dstIds, partial ? &counts : nullptr);
      dst.expectMatches();
      if (HasFailure()) {
        return;
      }
    }
  }
}

TEST_P(CopyPagesTest, EmptyItemListDoesNothing) {
  std::mt19937_64 rng(6);
  Paged pool(1, 2, 16, 8, device());
  Paged slab(1, 2, 16, 8, device());
  slab.fillRandom(rng);
  Tensor const none({0}, DataType::kInt32, device());
  kernels::copyPages(pool.buffers(), slab.buffers(), none, none, nullptr, nullptr);
  slab.expectMatches();
}

TEST_P(CopyPagesTest, RejectsMismatchedGeometry) {
  Paged pool(2, 4, 16, 32, device());
  Paged fewerLayers(1, 4, 16, 32, device());
  Paged otherTokenBytes(2, 4, 16, 16, device());
  Paged otherPageSize(2, 4, 32, 16, device());
  Tensor const ids = test::int32Tensor({0}, device());
  EXPECT_TRUE(throwsError(
      [&] {
        kernels::copyPages(pool.buffers(), fewerLayers.buffers(), ids, ids, nullptr, nullptr);
      },
      {"copyPages", "2 layers", "1"}));
  EXPECT_TRUE(throwsError(
      [&] {
        kernels::copyPages(pool.buffers(), otherTokenBytes.buffers(), ids, ids, nullptr, nullptr);
      },
      {"copyPages", "tokenBytes", "32", "16"}));
  EXPECT_TRUE(throwsError(
      [&] {
        kernels::copyPages(pool.buffers(), otherPageSize.buffers(), ids, ids, nullptr, nullptr);
      },
      {"copyPages", "tokensPerPage", "16", "32"}));
}

TEST_P(CopyPagesTest, RejectsMalformedIdTensors) {
  Paged pool(1, 4, 16, 8, device());
  Tensor const two = test::int32Tensor({0, 1}, device());
  Tensor const three = test::int32Tensor({0, 1, 2}, device());
  Tensor const wide({2}, DataType::kInt64, device());
  Tensor const matrix({1, 2}, DataType::kInt32, device());
  auto const buffers = pool.buffers();
  EXPECT_TRUE(
      throwsError([&] { kernels::copyPages(buffers, buffers, two, three, nullptr, nullptr); },
                  {"copyPages", "dstIds has 3 entries, expected 2"}));
  EXPECT_TRUE(
      throwsError([&] { kernels::copyPages(buffers, buffers, wide, two, nullptr, nullptr); },
                  {"copyPages", "srcIds must be int32", "int64"}));
  EXPECT_TRUE(
      throwsError([&] { kernels::copyPages(buffers, buffers, matrix, two, nullptr, nullptr); },
                  {"copyPages", "srcIds must be 1-D", "[1, 2]"}));
  EXPECT_TRUE(throwsError([&] { kernels::copyPages(buffers, buffers, two, two, &three, nullptr); },
                          {"copyPages", "tokenCounts has 3 entries"}));
}

INSTANTIATE_TEST_SUITE_P(Devices, CopyPagesTest, test::allDeviceTypes(), test::deviceName);

// Host-readable ids and counts are range-checked (GPU launches skip bad ids instead).
TEST(CopyPagesHostTest, RejectsIdsAndCountsOutOfRangeWithoutCopying) {
  std::mt19937_64 rng(7);
  Paged pool(1, 4, 16, 8, DeviceType::kCPU);
  Paged slab(1, 2, 16, 8, DeviceType::kCPU);
  pool.fillRandom(rng);
  slab.fillRandom(rng);
  Tensor const src = test::int32Tensor({0, 4}, DeviceType::kCPU);
  Tensor const dst = test::int32Tensor({0, 1}, DeviceType::kCPU);
  Tensor const badDst = test::int32Tensor({-2, 1}, DeviceType::kCPU);
  Tensor const okSrc = test::int32Tensor({0, 3}, DeviceType::kCPU);
  Tensor const badCounts = test::int32Tensor({16, 17}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError(
      [&] { kernels::copyPages(pool.buffers(), slab.buffers(), src, dst, nullptr, nullptr); },
      {"copyPages", "srcIds[1] = 4", "[-1, 4)"}));
  EXPECT_TRUE(throwsError(
      [&] { kernels::copyPages(pool.buffers(), slab.buffers(), okSrc, badDst, nullptr, nullptr); },
      {"copyPages", "dstIds[0] = -2"}));
  EXPECT_TRUE(throwsError(
      [&] { kernels::copyPages(pool.buffers(), slab.buffers(), okSrc, dst, &badCounts, nullptr); },
      {"copyPages", "tokenCounts[1] = 17", "[0, 16]"}));
  slab.expectMatches();  // validation happens before any byte moves
}

TEST(CopyPagesHostTest, RejectsTooManyLayersNullBasesAndMixedDevices) {
  std::vector<uint8_t> storage(2 * 16 * 4);
  std::vector<void*> const many(static_cast<std::size_t>(kernels::kMaxLayers) + 1, storage.data());
  kernels::PagedBuffers const tooMany{many, DeviceType::kCPU, 1, 16, 4};
  Tensor const ids = test::int32Tensor({0}, DeviceType::kCPU);
  EXPECT_TRUE(throwsError([&] { kernels::copyPages(tooMany, tooMany, ids, ids, nullptr, nullptr); },
                          {"copyPages", "257 layers exceed the limit of 256"}));
  std::vector<void*> const withNull{storage.data(), nullptr};
  kernels::PagedBuffers const nullLayer{withNull, DeviceType::kCPU, 1, 16, 4};
  EXPECT_TRUE(
      throwsError([&] { kernels::copyPages(nullLayer, nullLayer, ids, ids, nullptr, nullptr); },
                  {"copyPages", "layer 1 has a null base pointer"}));
  std::vector<void*> const one{storage.data()};
  kernels::PagedBuffers const host{one, DeviceType::kCPU, 1, 16, 4};
  kernels::PagedBuffers const gpu{one, DeviceType::kGPU, 1, 16, 4};
  EXPECT_TRUE(throwsError([&] { kernels::copyPages(host, gpu, ids, ids, nullptr, nullptr); },
                          {"copyPages", "src is on cpu but dst on gpu"}));
}

}  // namespace
}  // namespace mkv
