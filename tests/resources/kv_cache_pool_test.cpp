#include "mkv/kv_cache_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "resources/device_write_queue.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::throwsError;

KVCachePoolConfig smallConfig(DeviceType device) {
  KVCachePoolConfig config;
  config.numLayers = 3;
  config.numKVHeads = 2;
  config.headDim = 8;
  config.tokensPerPage = 16;
  config.numPages = 5;
  config.maxBatchSize = 4;
  config.dataType = DataType::kFloat16;
  config.deviceType = device;
  return config;
}

TEST(KVCachePoolConfigTest, RejectsEveryInvalidFieldByName) {
  struct Case {
    void (*change)(KVCachePoolConfig&);
    std::vector<std::string> fragments;
  };
  std::vector<Case> const cases{
      {[](KVCachePoolConfig& c) { c.numLayers = 0; }, {"numLayers 0", "[1, 256]"}},
      {[](KVCachePoolConfig& c) { c.numLayers = 257; }, {"numLayers 257"}},
      {[](KVCachePoolConfig& c) { c.numKVHeads = 0; }, {"numKVHeads", "0"}},
      {[](KVCachePoolConfig& c) { c.headDim = -4; }, {"headDim", "-4"}},
      {[](KVCachePoolConfig& c) { c.tokensPerPage = 8; }, {"tokensPerPage", "8"}},
      {[](KVCachePoolConfig& c) { c.tokensPerPage = 2048; }, {"tokensPerPage", "2048"}},
      {[](KVCachePoolConfig& c) { c.tokensPerPage = 48; }, {"power of two", "48"}},
      {[](KVCachePoolConfig& c) { c.numPages = 0; }, {"numPages", "0"}},
      {[](KVCachePoolConfig& c) { c.maxBatchSize = 0; }, {"maxBatchSize", "0"}},
      {[](KVCachePoolConfig& c) {
         c.numKVHeads = std::numeric_limits<int32_t>::max();
         c.headDim = std::numeric_limits<int32_t>::max();
         c.numPages = std::numeric_limits<int32_t>::max();
       },
       {"overflows int64"}},
  };
  for (Case const& c : cases) {
    KVCachePoolConfig config = smallConfig(DeviceType::kCPU);
    c.change(config);
    try {
      KVCachePool const pool(config);
      ADD_FAILURE() << "accepted: " << c.fragments.front();
    } catch (Error const& error) {
      std::string const message = error.what();
      EXPECT_NE(message.find("KVCachePool"), std::string::npos) << message;
      for (std::string const& fragment : c.fragments) {
        EXPECT_NE(message.find(fragment), std::string::npos) << message;
      }
    }
  }
  KVCachePoolConfig largestPage = smallConfig(DeviceType::kCPU);
  largestPage.tokensPerPage = 1024;
  largestPage.numLayers = 1;
  EXPECT_NO_THROW(KVCachePool{largestPage});
}

TEST(KVCachePoolConfigTest, BytesPerPageIsEveryLayersKAndVOfOnePageId) {
  KVCachePoolConfig config;
  config.numLayers = 5;
  config.numKVHeads = 8;
  config.headDim = 128;
  config.tokensPerPage = 128;
  config.dataType = DataType::kBFloat16;
  EXPECT_EQ(KVCachePool::bytesPerPage(config), int64_t{5} * 2 * 128 * 8 * 128 * 2);  // 2.5 MiB
  config.dataType = DataType::kFp8E4M3;
  config.numPages = 7;  // not read
  EXPECT_EQ(KVCachePool::bytesPerPage(config), int64_t{5} * 2 * 128 * 8 * 128);
}

class KVCachePoolTest : public test::DeviceTest {
 protected:
  KVCachePool make() const { return KVCachePool(smallConfig(device())); }
  static std::vector<int32_t> lengths(KVCachePool const& pool) {
    return test::readAs<int32_t>(pool.kvLengths());
  }
  /// All lengths of the tensor's capacity, not only the active view.
  static std::vector<int32_t> allLengths(KVCachePool const& pool) {
    Tensor full = Tensor::viewOf(pool.kvLengths());
    EXPECT_TRUE(full.reshape({pool.maxBatchSize()}));
    return test::readAs<int32_t>(full);
  }
};

TEST_P(KVCachePoolTest, ReportsExactSizes) {
  KVCachePool const pool = make();
  EXPECT_EQ(pool.tokenBytes(), 2 * 8 * 2);
  EXPECT_EQ(pool.pageBytes(), 32 * 16);
  EXPECT_EQ(pool.totalBytes(), 3 * 2 * 5 * 512);
  // One page id: K and V of every layer, known from the config before a pool is built.
  EXPECT_EQ(KVCachePool::bytesPerPage(pool.config()), 3 * 2 * 512);
  EXPECT_EQ(KVCachePool::bytesPerPage(pool.config()) * pool.numPages(), pool.totalBytes());
  EXPECT_EQ(pool.numLayers(), 3);
  EXPECT_EQ(pool.numPages(), 5);
  EXPECT_EQ(pool.tokensPerPage(), 16);
  EXPECT_EQ(pool.deviceType(), device());
}

TEST_P(KVCachePoolTest, LayersAreSeparateZeroedBuffersOfThePoolShape) {
  KVCachePool pool = make();
  for (int32_t l = 0; l < pool.numLayers(); ++l) {
    Tensor const& layer = pool.layer(l);
    EXPECT_EQ(layer.shape(), (Coords{2, 5, 16, 2, 8}));
    EXPECT_EQ(layer.dataType(), DataType::kFloat16);
    EXPECT_EQ(layer.deviceType(), device());
    EXPECT_EQ(test::readBytes(layer), std::vector<uint8_t>(2 * 5 * 512, 0));
  }
  EXPECT_NE(pool.layer(0).rawPointer(), pool.layer(1).rawPointer());
  EXPECT_TRUE(throwsError([&] { (void)pool.layer(3); }, {"KVCachePool::layer", "layer 3"}));
  EXPECT_TRUE(throwsError([&] { (void)pool.layer(-1); }, {"KVCachePool::layer", "-1"}));
}

TEST_P(KVCachePoolTest, PagedBuffersDescribeEveryLayer) {
  KVCachePool pool = make();
  kernels::PagedBuffers const buffers = pool.pagedBuffers();
  ASSERT_EQ(buffers.numLayers(), 3);
  for (int32_t l = 0; l < 3; ++l) {
    EXPECT_EQ(buffers.layerBases[static_cast<std::size_t>(l)], pool.layer(l).rawPointer());
  }
  EXPECT_EQ(buffers.deviceType, device());
  EXPECT_EQ(buffers.numPages, 5);
  EXPECT_EQ(buffers.tokensPerPage, 16);
  EXPECT_EQ(buffers.tokenBytes, 32);
  EXPECT_EQ(buffers.pageBytes(), pool.pageBytes());
}

TEST_P(KVCachePoolTest, StartsWithAnEmptyActiveBatch) {
  KVCachePool const pool = make();
  EXPECT_EQ(pool.activeBatchSize(), 0);
  EXPECT_EQ(pool.kvLengths().shape(), (Coords{0}));
  EXPECT_EQ(pool.kvLengths().deviceType(), device());
  EXPECT_EQ(pool.kvLengths().dataType(), DataType::kInt32);
}

TEST_P(KVCachePoolTest, ResetForNewSequencesSetsTheBatchAndTheDeviceLengths) {
  KVCachePool pool = make();
  void const* const address = pool.kvLengths().rawPointer();
  std::vector<int32_t> const reuse{0, 128, 17};
  pool.resetForNewSequences(reuse, nullptr);
  EXPECT_EQ(pool.activeBatchSize(), 3);
  EXPECT_EQ(pool.kvLengths().shape(), (Coords{3}));
  EXPECT_EQ(lengths(pool), reuse);
  std::vector<int32_t> const next{5};
  pool.resetForNewSequences(next, nullptr);
  EXPECT_EQ(lengths(pool), next);
  EXPECT_EQ(pool.kvLengths().rawPointer(), address);
  pool.resetForNewSequences({}, nullptr);
  EXPECT_EQ(pool.activeBatchSize(), 0);
}

TEST_P(KVCachePoolTest, ResetIntoABatchSetsTheBatchNowAndTheLengthsAtTheFlush) {
  KVCachePool pool = make();
  pool.resetForNewSequences(std::vector<int32_t>{4, 4}, nullptr);
  kernels::InlinePatchBatch batch;
  std::vector<int32_t> const reuse{0, 128, 17};
  pool.resetForNewSequences(reuse, batch, nullptr);
  EXPECT_EQ(pool.activeBatchSize(), 3);
  EXPECT_EQ(allLengths(pool)[1], 4) << "queued, not launched";
  batch.flush(nullptr);
  EXPECT_EQ(lengths(pool), reuse);
  EXPECT_TRUE(
      throwsError([&] { pool.resetForNewSequences(std::vector<int32_t>{-1}, batch, nullptr); },
                  {"KVCachePool::resetForNewSequences", "-1"}));
  EXPECT_TRUE(batch.empty());
  EXPECT_EQ(pool.activeBatchSize(), 3);
}

TEST_P(KVCachePoolTest, ResetRejectsTooManyOrNegativeLengthsWithoutChange) {
  KVCachePool pool = make();
  std::vector<int32_t> const reuse{1, 2};
  pool.resetForNewSequences(reuse, nullptr);
  std::vector<int32_t> const tooMany(5, 0);
  std::vector<int32_t> const negative{3, -1, 4};
  EXPECT_TRUE(throwsError([&] { pool.resetForNewSequences(tooMany, nullptr); },
                          {"KVCachePool::resetForNewSequences", "5 sequences", "4"}));
  EXPECT_TRUE(throwsError([&] { pool.resetForNewSequences(negative, nullptr); },
                          {"KVCachePool::resetForNewSequences", "lengths[1] = -1"}));
  EXPECT_EQ(pool.activeBatchSize(), 2);
  EXPECT_EQ(lengths(pool), reuse);
}

TEST_P(KVCachePoolTest, WriteLengthsOverwritesARangeOfTheActiveBatch) {
  KVCachePool pool = make();
  std::vector<int32_t> const reuse{1, 2, 3, 4};
  pool.resetForNewSequences(reuse, nullptr);
  std::vector<int32_t> const update{20, 30};
  pool.writeLengths(1, update, nullptr);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{1, 20, 30, 4}));
  pool.writeLengths(4, {}, nullptr);  // empty range at the end is fine
  EXPECT_TRUE(throwsError([&] { pool.writeLengths(3, update, nullptr); },
                          {"KVCachePool::writeLengths", "rows [3, 5)", "active batch of 4"}));
  EXPECT_TRUE(throwsError([&] { pool.writeLengths(-1, update, nullptr); },
                          {"KVCachePool::writeLengths", "[-1, 1)"}));
  std::vector<int32_t> const negative{-5};
  EXPECT_TRUE(throwsError([&] { pool.writeLengths(0, negative, nullptr); },
                          {"KVCachePool::writeLengths", "lengths[0] = -5"}));
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{1, 20, 30, 4}));
}

/// Queues `value` for row `row` of the pool's length tensor in `batch`, as a lifecycle call of the
/// engine step does.
void queueLength(kernels::InlinePatchBatch& batch, KVCachePool& pool, int64_t row, int32_t value) {
  Tensor every = Tensor::viewOf(pool.kvLengths());
  ASSERT_TRUE(every.reshape({pool.maxBatchSize()}));
  batch.add("test", every, row, std::vector<int32_t>{value}, nullptr);
}

TEST_P(KVCachePoolTest, WritesOrderedAfterABatchFlushItFirst) {
  KVCachePool pool = make();
  pool.resetForNewSequences(std::vector<int32_t>{1, 2, 3, 4}, nullptr);
  kernels::InlinePatchBatch queued(device());
  pool.orderWritesAfter(&queued);
  queueLength(queued, pool, 1, 50);
  queueLength(queued, pool, 2, 60);
  pool.writeLengths(1, std::vector<int32_t>{21}, nullptr);
  EXPECT_TRUE(queued.empty());
  EXPECT_EQ(queued.launches(), 1);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{1, 21, 60, 4})) << "the later write wins";
  queueLength(queued, pool, 3, 70);
  pool.resetForNewSequences(std::vector<int32_t>{5, 6}, nullptr);
  EXPECT_EQ(allLengths(pool), (std::vector<int32_t>{5, 6, 60, 70}));
  queueLength(queued, pool, 0, 80);
  pool.resetForNewSequences(std::vector<int32_t>{9}, queued, nullptr);  // joins it: no flush
  EXPECT_EQ(queued.launches(), 2);
  queued.flush(nullptr);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{9}));
  pool.setActiveBatchSize(2);
  queueLength(queued, pool, 1, 11);
  pool.compactLengths(test::int32Tensor({-1, 0}, device()), 1, nullptr);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{11})) << "compacted after the queued write";
  pool.orderWritesAfter(nullptr);
  queueLength(queued, pool, 0, 90);
  pool.writeLengths(0, std::vector<int32_t>{10}, nullptr);
  EXPECT_FALSE(queued.empty()) << "no longer ordered after it";
  queued.discard();
}

TEST_P(KVCachePoolTest, AFailedFlushOfTheWritesItFollowsThrowsNamingTheCallAndWritesNothing) {
  KVCachePool pool = make();
  pool.resetForNewSequences(std::vector<int32_t>{1, 2}, nullptr);
  kernels::InlinePatchBatch queued(device());
  queued.setFaults([](FaultSite) { return cudaErrorUnknown; });
  pool.orderWritesAfter(&queued);
  queueLength(queued, pool, 0, 50);
  EXPECT_TRUE(throwsError([&] { pool.writeLengths(1, std::vector<int32_t>{7}, nullptr); },
                          {"KVCachePool::writeLengths", "cudaErrorUnknown"}));
  EXPECT_TRUE(throwsError([&] { pool.resetForNewSequences(std::vector<int32_t>{7}, nullptr); },
                          {"KVCachePool::resetForNewSequences", "cudaErrorUnknown"}));
  Tensor const keepBoth = test::int32Tensor({0, 1}, device());
  EXPECT_TRUE(throwsError([&] { pool.compactLengths(keepBoth, 2, nullptr); },
                          {"KVCachePool::compactLengths", "cudaErrorUnknown"}));
  Tensor const wrongType({2}, DataType::kInt64, device());  // rejected before any flush
  EXPECT_TRUE(throwsError([&] { pool.compactLengths(wrongType, 2, nullptr); },
                          {"KVCachePool::compactLengths", "oldToNew"}));
  EXPECT_EQ(queued.launches(), 0);
  EXPECT_EQ(pool.activeBatchSize(), 2);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{1, 2}));
  EXPECT_FALSE(queued.empty()) << "the queued write is kept for the next flush";
  queued.setFaults({});
  pool.writeLengths(1, std::vector<int32_t>{7}, nullptr);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{50, 7}));
}

TEST_P(KVCachePoolTest, AWriteQueueOrdersThePoolUntilItIsDestroyed) {
  KVCachePool pool = make();
  {
    detail::DeviceWriteQueue queue(device(), DeviceWriteTiming::kEngineStep);
    queue.watch(&pool);
    queue.watch(&pool);  // ignored
    EXPECT_EQ(pool.writesOrderedAfter(), &queue.lengths());
    {
      detail::DeviceWriteQueue other(device(), DeviceWriteTiming::kEngineStep);
      EXPECT_TRUE(throwsError([&] { other.watch(&pool); },
                              {"DeviceWriteQueue::watch", "another write queue"}));
    }
    EXPECT_EQ(pool.writesOrderedAfter(), &queue.lengths()) << "the refused queue detached it";
    pool.resetForNewSequences(std::vector<int32_t>{2, 2}, queue.lengths(), nullptr);
    pool.writeLengths(1, std::vector<int32_t>{5}, nullptr);
    EXPECT_FALSE(queue.pending());
    EXPECT_EQ(queue.launches(), 1);
  }
  EXPECT_EQ(pool.writesOrderedAfter(), nullptr) << "a dangling batch";
  pool.writeLengths(0, std::vector<int32_t>{3}, nullptr);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{3, 5}));
}

TEST_P(KVCachePoolTest, SetActiveBatchSizeChangesTheViewButNotTheLengths) {
  KVCachePool pool = make();
  std::vector<int32_t> const reuse{7, 8, 9};
  pool.resetForNewSequences(reuse, nullptr);
  pool.setActiveBatchSize(1);
  EXPECT_EQ(lengths(pool), (std::vector<int32_t>{7}));
  pool.setActiveBatchSize(3);
  EXPECT_EQ(lengths(pool), reuse);
  EXPECT_TRUE(throwsError([&] { pool.setActiveBatchSize(5); },
                          {"KVCachePool::setActiveBatchSize", "5", "[0, 4]"}));
  EXPECT_TRUE(throwsError([&] { pool.setActiveBatchSize(-1); }, {"-1"}));
  EXPECT_EQ(pool.activeBatchSize(), 3);
}

TEST_P(KVCachePoolTest, CompactLengthsHandlesOverlappingRows) {
  struct Case {
    std::vector<int32_t> mapping;
    int32_t newBatch;
    std::vector<int32_t> expected;
  };
  for (Case const& c : {Case{{-1, 0, 1, 2}, 3, {20, 30, 40}}, Case{{0, -1, -1, 1}, 2, {10, 40}},
                        Case{{-1, -1, -1, -1}, 0, {}}, Case{{0, 1, 2, 3}, 4, {10, 20, 30, 40}}}) {
    KVCachePool pool = make();
    std::vector<int32_t> const reuse{10, 20, 30, 40};
    pool.resetForNewSequences(reuse, nullptr);
    Tensor const mapping = test::int32Tensor(c.mapping, device());
    pool.compactLengths(mapping, c.newBatch, nullptr);
    EXPECT_EQ(pool.activeBatchSize(), c.newBatch);
    EXPECT_EQ(lengths(pool), c.expected);
  }
}

TEST_P(KVCachePoolTest, CompactLengthsRejectsMismatchesWithoutChange) {
  KVCachePool pool = make();
  std::vector<int32_t> const reuse{10, 20, 30};
  pool.resetForNewSequences(reuse, nullptr);
  std::vector<int32_t> const before = allLengths(pool);
  Tensor const shortMapping = test::int32Tensor({0, 1}, device());
  EXPECT_TRUE(throwsError([&] { pool.compactLengths(shortMapping, 2, nullptr); },
                          {"KVCachePool::compactLengths", "2 entries", "active batch is 3"}));
  Tensor const mapping = test::int32Tensor({0, 1, 2}, device());
  EXPECT_TRUE(throwsError([&] { pool.compactLengths(mapping, 4, nullptr); },
                          {"KVCachePool::compactLengths", "newBatchSize 4", "[0, 3]"}));
  DeviceType const other = device() == DeviceType::kCPU ? DeviceType::kGPU : DeviceType::kCPU;
  int32_t fake[3] = {0, 1, 2};
  Tensor const foreign = Tensor::view(fake, {3}, DataType::kInt32, other);
  EXPECT_TRUE(throwsError([&] { pool.compactLengths(foreign, 3, nullptr); },
                          {"KVCachePool::compactLengths", "mapping is on"}));
  EXPECT_EQ(pool.activeBatchSize(), 3);
  EXPECT_EQ(allLengths(pool), before);
}

// Batches beyond the inline patch limit take the staged path (one copy from pinned staging).
TEST_P(KVCachePoolTest, LengthWritesBeyondTheInlineLimitAreStaged) {
  KVCachePoolConfig config = smallConfig(device());
  config.maxBatchSize = kernels::kMaxInlinePatchValues + 200;
  KVCachePool pool(config);
  std::vector<int32_t> lengths(static_cast<std::size_t>(config.maxBatchSize));
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    lengths[i] = static_cast<int32_t>(3 * i + 1);
  }
  pool.resetForNewSequences(lengths, nullptr);
  EXPECT_EQ(test::readAs<int32_t>(pool.kvLengths()), lengths);
  std::vector<int32_t> update(static_cast<std::size_t>(kernels::kMaxInlinePatchValues), 7);
  pool.writeLengths(100, update, nullptr);
  std::copy(update.begin(), update.end(), lengths.begin() + 100);
  EXPECT_EQ(test::readAs<int32_t>(pool.kvLengths()), lengths);
}

INSTANTIATE_TEST_SUITE_P(Devices, KVCachePoolTest, test::allDeviceTypes(), test::deviceName);

TEST(KVCachePoolHostTest, CompactLengthsRejectsANonOrderPreservingMappingWithoutChange) {
  KVCachePool pool(smallConfig(DeviceType::kCPU));
  std::vector<int32_t> const reuse{10, 20, 30};
  pool.resetForNewSequences(reuse, nullptr);
  Tensor const swapped = test::int32Tensor({1, 0, -1}, DeviceType::kCPU);
  EXPECT_TRUE(test::throwsError(
      [&] { pool.compactLengths(swapped, 2, nullptr); },
      {"KVCachePool::compactLengths", "not order-preserving", "oldToNew[0] = 1"}));
  EXPECT_EQ(pool.activeBatchSize(), 3);
  EXPECT_EQ(test::readAs<int32_t>(pool.kvLengths()), reuse);
}

}  // namespace
}  // namespace mkv
