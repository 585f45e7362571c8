#pragma once
/// \file swa_test_rig.h
/// Shared fixture pieces of the BoundedSwaKVPageManager suites: real pools and page tables on
/// the host or the GPU, a stream synchronizer with injectable failures, and observers that
/// read the device side back to the host.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/device.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/error.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/stream.h"
#include "mkv/tensor.h"
#include "mkv/testing/kv_oracle.h"
#include "mkv/types.h"
#include "support/fault_arming.h"

namespace mkv::swa_test {

using test::FaultArming;

struct RigConfig {
  DeviceType device = DeviceType::kCPU;
  int32_t window = 129;
  int32_t pageSize = 128;
  int32_t maxBatch = 3;
  /// 0: exactly maxBatch * (2M + 1) pages.
  int32_t numPages = 0;
  int32_t maxPagesPerSeq = 32;
  /// Tiny token rows keep every test fast: 1 layer, 1 head, headDim 4, fp16 = 8 bytes a row.
  int32_t numLayers = 1;
  int32_t numKVHeads = 1;
  int32_t headDim = 4;
  bool withRecurrent = true;
  /// The SWA pool and a second (full-attention) pool follow the request's KV lengths.
  bool withLengthPools = true;
  /// Cached mode (BoundedSwaResources::pageSource); it must outlive the rig.
  SwaPageSource* pageSource = nullptr;
};

/// Everything a BoundedSwaKVPageManager drives, owned in construction order.
class SwaRig {
 public:
  explicit SwaRig(RigConfig const& config) : mConfig(config) {
    int32_t const admission =
        BoundedSwaKVPageManager::admissionPagesPerSequence(config.window, config.pageSize);
    int32_t const numPages = config.numPages > 0 ? config.numPages : config.maxBatch * admission;
    KVCachePoolConfig poolConfig;
    poolConfig.numLayers = config.numLayers;
    poolConfig.numKVHeads = config.numKVHeads;
    poolConfig.headDim = config.headDim;
    poolConfig.tokensPerPage = config.pageSize;
    poolConfig.numPages = numPages;
    poolConfig.maxBatchSize = config.maxBatch;
    poolConfig.dataType = DataType::kFloat16;
    poolConfig.deviceType = config.device;
    mPool = std::make_unique<KVCachePool>(poolConfig);
    mTable = std::make_unique<KVPageTable>(config.maxBatch, config.maxPagesPerSeq, numPages,
                                           PageTableMode::kSparseWindow, config.device);
    BoundedSwaResources resources;
    resources.swaPool = mPool.get();
    resources.swaPageTable = mTable.get();
    resources.pageSource = config.pageSource;
    if (config.withLengthPools) {
      KVCachePoolConfig fullConfig = poolConfig;
      fullConfig.numPages = 1;
      mFullPool = std::make_unique<KVCachePool>(fullConfig);
      resources.lengthPools = {mPool.get(), mFullPool.get()};
    }
    if (config.withRecurrent) {
      RecurrentStatePoolConfig recurrentConfig;
      recurrentConfig.numLayers = 2;
      recurrentConfig.numSlots = config.maxBatch;
      recurrentConfig.stateBytesPerSlot = 24;
      recurrentConfig.convBytesPerSlot = 8;
      recurrentConfig.deviceType = config.device;
      mRecurrent = std::make_unique<RecurrentStatePool>(recurrentConfig);
      resources.recurrent = mRecurrent.get();
    }
    mManager = std::make_unique<BoundedSwaKVPageManager>(BoundedSwaConfig{config.window},
                                                         std::move(resources), stream(),
                                                         StreamSynchronizer{}, mFaults.injector());
    mOracle = std::make_unique<testing::KvOracle>(*mPool, *mTable);
    mMapping = Tensor({config.maxBatch}, DataType::kInt32, config.device);
  }

  /// A test that failed half-way may leave a quarantine behind; drain it so that the
  /// manager's destructor does not terminate the whole test binary (the tests themselves
  /// assert every shutdown they rely on).
  ~SwaRig() {
    mFaults.disarm();
    if (mManager != nullptr && mManager->activeRequestCount() == 0) {
      (void)mManager->shutdown();
    }
  }
  SwaRig(SwaRig const&) = delete;
  SwaRig& operator=(SwaRig const&) = delete;

  /// All device work is ordered on the legacy default stream, which the oracle's synchronous
  /// copies also use.
  static cudaStream_t stream() { return nullptr; }

  RigConfig const& config() const { return mConfig; }
  BoundedSwaKVPageManager& manager() { return *mManager; }
  KVCachePool& pool() { return *mPool; }
  KVCachePool* fullPool() { return mFullPool.get(); }
  KVPageTable& table() { return *mTable; }
  RecurrentStatePool* recurrent() { return mRecurrent.get(); }
  FaultArming& faults() { return mFaults; }
  testing::KvOracle& oracle() { return *mOracle; }
  Tensor& mapping() { return mMapping; }
  int32_t M() const {
    return BoundedSwaKVPageManager::windowPages(mConfig.window, mConfig.pageSize);
  }

 private:
  RigConfig mConfig;
  FaultArming mFaults;
  std::unique_ptr<KVCachePool> mPool;
  std::unique_ptr<KVCachePool> mFullPool;
  std::unique_ptr<KVPageTable> mTable;
  std::unique_ptr<RecurrentStatePool> mRecurrent;
  std::unique_ptr<BoundedSwaKVPageManager> mManager;
  std::unique_ptr<testing::KvOracle> mOracle;
  Tensor mMapping;
};

using Handle = BoundedSwaKVPageManager::RequestHandle;

inline std::vector<ResidentRef> residentsFor(std::vector<int32_t> const& slots,
                                             uint64_t epoch = 1) {
  std::vector<ResidentRef> refs;
  refs.reserve(slots.size());
  for (int32_t slot : slots) {
    refs.push_back(ResidentRef{slot, epoch});
  }
  return refs;
}

/// Admits `slots`; fails the test (fatally, through the returned invalid handle check of the
/// caller) unless the status is kOk.
inline Handle admit(SwaRig& rig, std::vector<int32_t> const& slots) {
  auto const refs = residentsFor(slots);
  auto result = rig.manager().beginRequest(refs, SwaRig::stream());
  EXPECT_EQ(result.status, SwaKVCacheStatus::kOk) << toString(result.status);
  if (!result.request.has_value()) {
    return Handle();
  }
  return std::move(*result.request);
}

/// Bytes of a tensor's current shape, read back to the host.
inline std::vector<uint8_t> readBytes(void const* data, DeviceType device, std::size_t bytes) {
  std::vector<uint8_t> out(bytes);
  detail::copyBytes(out.data(), DeviceType::kCPU, data, device, bytes, SwaRig::stream());
  if (device == DeviceType::kGPU) {
    detail::synchronizeDevice();
  }
  return out;
}

inline std::vector<int32_t> readInt32(Tensor const& tensor) {
  auto const bytes = readBytes(tensor.rawPointer(), tensor.deviceType(),
                               static_cast<std::size_t>(tensor.sizeBytes()));
  std::vector<int32_t> out(bytes.size() / sizeof(int32_t));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

inline void writeBytes(void* data, DeviceType device, std::vector<uint8_t> const& bytes) {
  detail::copyBytes(data, device, bytes.data(), DeviceType::kCPU, bytes.size(), SwaRig::stream());
  if (device == DeviceType::kGPU) {
    detail::synchronizeDevice();
  }
}

inline void writeInt32(Tensor& tensor, std::vector<int32_t> const& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(int32_t));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  writeBytes(tensor.rawPointer(), tensor.deviceType(), bytes);
}

inline std::vector<int32_t> hostRow(KVPageTable const& table, CacheSlot slot) {
  auto const row = table.hostRow(slot);
  return {row.begin(), row.end()};
}

/// Row `slot` of the device mirror.
inline std::vector<int32_t> deviceRow(KVPageTable const& table, CacheSlot slot) {
  auto const width = static_cast<std::size_t>(2 * table.maxPagesPerSeq());
  auto const* base = static_cast<uint8_t const*>(table.deviceTable().rawPointer()) +
                     width * sizeof(int32_t) * static_cast<std::size_t>(slot);
  auto const bytes = readBytes(base, table.deviceType(), width * sizeof(int32_t));
  std::vector<int32_t> out(width);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

/// The row a sequence with these bindings must have: K ids at their logical pages, V = K +
/// numPages, -1 elsewhere.
inline std::vector<int32_t> expectedRow(KVPageTable const& table,
                                        std::deque<SwaPageBinding> const& bindings) {
  auto const width = static_cast<std::size_t>(table.maxPagesPerSeq());
  std::vector<int32_t> row(2 * width, kNoPage);
  for (SwaPageBinding const& binding : bindings) {
    auto const logical = static_cast<std::size_t>(binding.logicalPage);
    row[logical] = binding.page;
    row[width + logical] = binding.page + table.numPages();
  }
  return row;
}

inline std::vector<int32_t> emptyRow(KVPageTable const& table) {
  return std::vector<int32_t>(2 * static_cast<std::size_t>(table.maxPagesPerSeq()), kNoPage);
}

/// Retained logical pages of endpoint e: [floor(max(0, e - W) / P), ceil(e / P))
/// (docs/architecture.md, "Bounded SWA").
inline int32_t retainedBegin(int64_t endpoint, int32_t window, int32_t pageSize) {
  return static_cast<int32_t>(std::max<int64_t>(0, endpoint - window) / pageSize);
}
inline int32_t retainedEnd(int64_t endpoint, int32_t pageSize) {
  return static_cast<int32_t>((endpoint + pageSize - 1) / pageSize);
}

/// Pages held by every sequence of the given live requests.
inline int32_t heldPages(BoundedSwaKVPageManager const& manager,
                         std::vector<Handle const*> const& handles) {
  int32_t held = 0;
  for (Handle const* handle : handles) {
    if (handle == nullptr || !handle->valid()) {
      continue;
    }
    int32_t const batch = manager.batchSize(*handle);
    for (int32_t row = 0; row < batch; ++row) {
      held += manager.state(*handle, row).heldPages();
    }
  }
  return held;
}

/// Every page is either free, held by one of `handles`, or quarantined; and no page is held
/// twice (bindings, reserves and pending retirements of all live sequences are disjoint).
inline void expectPagesAccountedFor(BoundedSwaKVPageManager const& manager,
                                    std::vector<Handle const*> const& handles) {
  // Runs after every operation of the property test: a flat bitmap, one failure message.
  std::vector<uint8_t> seen(static_cast<std::size_t>(manager.totalPageCount()), 0);
  std::string problem;
  int32_t held = 0;
  auto note = [&](PageId page) {
    if (page < 0 || page >= manager.totalPageCount()) {
      problem = "page " + std::to_string(page) + " is outside the pool";
    } else if (seen[static_cast<std::size_t>(page)]++ != 0) {
      problem = "page " + std::to_string(page) + " is held twice";
    }
  };
  for (Handle const* handle : handles) {
    if (handle == nullptr || !handle->valid()) {
      continue;
    }
    int32_t const batch = manager.batchSize(*handle);
    for (int32_t row = 0; row < batch; ++row) {
      SwaSequenceState const& state = manager.state(*handle, row);
      held += state.heldPages();
      for (auto const& binding : state.bindings) note(binding.page);
      for (auto const& binding : state.pendingRetire) note(binding.page);
      for (PageId page : state.reservedPages) note(page);
    }
  }
  EXPECT_TRUE(problem.empty()) << problem;
  EXPECT_EQ(manager.freePageCount() + held + manager.quarantinedPageCount(),
            manager.totalPageCount())
      << "free " << manager.freePageCount() << ", held " << held << ", quarantined "
      << manager.quarantinedPageCount();
}

/// Runs `call`, expecting mkv::Error whose message contains every fragment.
template <typename Call>
void expectContractError(Call&& call, std::vector<std::string> const& fragments) {
  try {
    call();
    ADD_FAILURE() << "expected mkv::Error mentioning '" << fragments.front() << "'";
  } catch (Error const& error) {
    std::string const message = error.what();
    for (std::string const& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message '" << message << "' lacks '" << fragment << "'";
    }
  }
}

/// One sequence as an engine drives it through the SWA table: its prefix digests and the
/// positions whose KV it has written (the committed endpoint plus a staged decode position).
class EngineSequence {
 public:
  EngineSequence(CacheSlot slot, uint64_t seed) : mSlot(slot), mDigests(seed), mTokens(seed) {}

  CacheSlot slot() const { return mSlot; }
  int64_t written() const { return mWritten; }

  /// Prefill of `length` tokens: only the retained window [max(0, L - W), L) is persisted.
  void prefill(testing::KvOracle& oracle, int32_t length, int32_t window) {
    ensureTokens(length);
    oracle.write(mSlot, mDigests, std::max<int64_t>(0, length - window), length);
    mWritten = length;
  }
  /// A chunk [from, end) of a chunked prefill: only its last window [max(from, end - W), end)
  /// is persisted (the earlier positions are read from the engine's activations).
  void prefillChunk(testing::KvOracle& oracle, int32_t from, int32_t end, int32_t window) {
    ensureTokens(end);
    oracle.write(mSlot, mDigests, std::max<int64_t>(from, int64_t{end} - window), end);
    mWritten = end;
  }
  /// One decode step writes position e (the staged page must already be mapped on the device).
  void decode(testing::KvOracle& oracle) {
    ensureTokens(mWritten + 1);
    oracle.write(mSlot, mDigests, mWritten, mWritten + 1);
    ++mWritten;
  }
  /// Verifies the last min(W, written) positions, the ones the attention reads.
  testing::OracleReport verifyWindow(testing::KvOracle const& oracle, int32_t window) const {
    return oracle.verify(mSlot, mDigests, std::max<int64_t>(0, mWritten - window), mWritten);
  }

 private:
  /// The token stream is fixed by the seed, and a position's digest depends only on the
  /// positions before it, so digests may run ahead of what was written. They are extended in
  /// chunks: PrefixDigests::extend reserves exactly size + n, so one call per token would
  /// copy the whole vector every step.
  void ensureTokens(int64_t count) {
    if (mDigests.size() < count) {
      appendTokens(static_cast<int32_t>(std::max<int64_t>(count - mDigests.size(), 1024)));
    }
  }
  void appendTokens(int32_t count) {
    std::vector<int32_t> tokens(static_cast<std::size_t>(count));
    for (int32_t& token : tokens) {
      token = static_cast<int32_t>(mTokens() % 50000);
    }
    mDigests.extendTokens(tokens);
  }

  CacheSlot mSlot;
  testing::PrefixDigests mDigests;
  std::mt19937_64 mTokens;
  int64_t mWritten = 0;
};

inline std::string deviceName(::testing::TestParamInfo<DeviceType> const& info) {
  return info.param == DeviceType::kCPU ? "Cpu" : "Gpu";
}

/// Base of the device-parameterised suites: the GPU instantiation skips without a device.
class DeviceTest : public ::testing::TestWithParam<DeviceType> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceType::kGPU && !cudaDeviceAvailable()) {
      GTEST_SKIP() << "no CUDA device";
    }
  }
  RigConfig rigConfig() const {
    RigConfig config;
    config.device = GetParam();
    return config;
  }
};

}  // namespace mkv::swa_test
