#include "resources/device_write_queue.h"

#include <algorithm>
#include <cstdint>
#include <exception>
#include <span>
#include <utility>

#include "core/check.h"
#include "mkv/kv_cache_pool.h"

namespace mkv::detail {
namespace {

/// One table entry's word of DeviceWriteQueue's digest (a splitmix64 finaliser).
uint64_t entryWord(int64_t entry, int32_t value) {
  uint64_t x = (static_cast<uint64_t>(entry) << 32) ^ static_cast<uint32_t>(value);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace

DeviceWriteQueue::DeviceWriteQueue(DeviceType device, DeviceWriteTiming timing,
                                   FaultInjector faults)
    : mTiming(timing), mBatch(device) {
  mBatch.setFaults(std::move(faults));
}

DeviceWriteQueue::~DeviceWriteQueue() {
  for (KVCachePool* pool : mPools) {
    if (pool->writesOrderedAfter() == &mBatch) {
      pool->orderWritesAfter(nullptr);
    }
  }
}

void DeviceWriteQueue::watch(KVCachePool* pool) {
  if (pool == nullptr || std::find(mPools.begin(), mPools.end(), pool) != mPools.end()) {
    return;
  }
  MKV_REQUIRE(pool->writesOrderedAfter() == nullptr, "DeviceWriteQueue::watch",
              "the pool's length writes already follow another write queue");
  mPools.push_back(pool);
  pool->orderWritesAfter(&mBatch);
}

void DeviceWriteQueue::watch(KVPageTable* table) {
  if (table != nullptr && std::find(mTables.begin(), mTables.end(), table) == mTables.end()) {
    mTables.push_back(table);
  }
}

void DeviceWriteQueue::settle(cudaStream_t stream) {
  if (mTiming == DeviceWriteTiming::kEachCall) {
    flush(stream);
  }
}

void DeviceWriteQueue::flush(cudaStream_t stream) {
  mBatch.flushAfter(stream, [&] { queueTables(stream); });
  ++mFlushes;
}

void DeviceWriteQueue::queueTables(cudaStream_t stream) {
  // One table's broken row (an internal invariant) must not hold back the others' rows.
  std::exception_ptr first;
  for (KVPageTable* table : mTables) {
    if (!table->dirty()) {
      continue;  // a clean table's upload would still reset its lastUpload()
    }
    if (mRecordsDecisions) {
      std::span<int32_t const> const values = table->hostRows();
      for (int64_t const entry : table->dirtyEntries()) {
        mTableDigest += entryWord(entry, values[static_cast<std::size_t>(entry)]);
      }
    }
    try {
      table->uploadDirty(mBatch, stream);
      mStagedUploads += table->lastUploadStats().staged;
    } catch (...) {
      if (!first) {
        first = std::current_exception();
      }
    }
  }
  if (first) {
    std::rethrow_exception(first);
  }
}

void DeviceWriteQueue::requireReachedDevice(char const* call, int64_t mark) const {
  // Nothing leaves the queue unapplied: an empty queue means the writes of `mark` reached the
  // device, also through a partial flush that is not counted (a pool's own length write).
  MKV_REQUIRE(mark == kNothingWaiting || mFlushes != mark || !pending(), call,
              "the table rows and KV lengths its prepare call wrote never reached the device: "
              "with DeviceWriteTiming::kEngineStep call KVCacheRuntime::flushDeviceWrites() after "
              "the step's lifecycle calls and before the forward");
}

void DeviceWriteQueue::recordDecisions() noexcept {
  mRecordsDecisions = true;
  mBatch.recordWrittenDigest();
}

uint64_t DeviceWriteQueue::decisionDigest() const noexcept {
  return mTableDigest * 0x9E3779B97F4A7C15ULL ^ mBatch.writtenDigest();
}

bool DeviceWriteQueue::pending() const noexcept {
  return !mBatch.empty() || std::any_of(mTables.begin(), mTables.end(),
                                        [](KVPageTable const* table) { return table->dirty(); });
}

}  // namespace mkv::detail
