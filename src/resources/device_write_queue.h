#pragma once
/// \file device_write_queue.h
/// The page-table and KV-length writes of the backends' lifecycle calls, and the moment they
/// reach the device (docs/architecture.md, "Device writes at the engine step"). Not installed.
///
/// Thread-safety: single writer (the engine thread).

#include <cstdint>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/kernels.h"
#include "mkv/kv_page_table.h"
#include "mkv/types.h"

namespace mkv {
class KVCachePool;
}  // namespace mkv

namespace mkv::detail {

/// Table rows are written on the host, where each KVPageTable keeps its changed entries dirty;
/// KV lengths are queued in one InlinePatchBatch. A flush uploads the dirty entries of every
/// watched table into that batch and applies it: one launch when the patch fits inline. When a
/// flush happens is the timing's: at the end of every call that wrote (settle, kEachCall) or only
/// when the engine asks once per step (kEngineStep; KVCacheRuntime::flushDeviceWrites).
///
/// Order: a table entry written twice before a flush reaches the device with its last value (the
/// host row is the truth); a length write inside one still queued replaces its values, and one
/// that overlaps a queued write otherwise flushes the queue first (InlinePatchBatch::add), so the
/// device sees the writes as if made one by one. Every backend of a runtime shares one queue, so
/// that an engine step's writes, both halves' of a sliding-window reuse request included, take
/// one launch.
class DeviceWriteQueue {
 public:
  /// `faults`: the injector every flush consults (FaultSite::kDeviceWriteLaunch; empty = none).
  DeviceWriteQueue(DeviceType device, DeviceWriteTiming timing, FaultInjector faults = {});
  /// Detaches the watched pools (KVCachePool::orderWritesAfter(nullptr)).
  ~DeviceWriteQueue();
  DeviceWriteQueue(DeviceWriteQueue const&) = delete;
  DeviceWriteQueue& operator=(DeviceWriteQueue const&) = delete;

  /// Adds `table` to the tables every flush uploads (borrowed: it must outlive the queue's
  /// flushes). Null and a table already watched are ignored.
  void watch(KVPageTable* table);
  /// Orders `pool`'s own length writes after the lengths this queue holds, until the queue is
  /// destroyed (KVCachePool::orderWritesAfter): an engine's KVCachePool::writeLengths before the
  /// step's flush lands after the lifecycle calls' resets. Borrowed: the pool must outlive the
  /// queue. Null and a pool already watched are ignored; a pool another queue orders throws
  /// mkv::Error (one queue per pool), changing nothing.
  void watch(KVCachePool* pool);
  /// Where KV-length writes queue (KVCachePool::resetForNewSequences).
  kernels::InlinePatchBatch& lengths() noexcept { return mBatch; }

  /// Ends a lifecycle call that wrote: flush(stream) with kEachCall; nothing with kEngineStep.
  void settle(cudaStream_t stream);
  /// Calls `write()`, then settle(stream); with kEachCall also when `write` throws half-way (then
  /// rethrows what it threw), so what it wrote reaches the device like the writes before it
  /// (InlinePatchBatch::flushAfter).
  template <typename Write>
  void settleAfter(cudaStream_t stream, Write&& write) {
    if (mTiming == DeviceWriteTiming::kEngineStep) {
      write();
      return;
    }
    mBatch.flushAfter(stream, [&] {
      queueTables(stream);
      write();
    });
    ++mFlushes;
  }
  /// Uploads the dirty entries of every watched table and applies every queued write on `stream`,
  /// in one launch when they fit inline (a table upload beyond the inline limit adds a staged
  /// copy, which first waits for the previous copy from that table's staging). Needed before any
  /// launch that reads or writes what the queue may hold (the KV-length compaction), and by the
  /// engine once per step with kEngineStep. Throws mkv::Error when a launch fails or a table's row
  /// is broken (after queueing the other tables); what was not applied stays queued.
  void flush(cudaStream_t stream);
  /// Whether writes wait for a flush: a watched table is dirty or lengths are queued.
  bool pending() const noexcept;

  /// The read rule of the engine step, checked at the completion points: a call that prepares
  /// device work (a prefill, a decode step) ends with `mark = awaitingFlush()`, and the call that
  /// completes that work calls requireReachedDevice(call, mark) before it changes anything.
  /// kNothingWaiting when nothing waits (always so with kEachCall after a prepare call, which
  /// flushes).
  static constexpr int64_t kNothingWaiting = -1;
  int64_t awaitingFlush() const noexcept { return pending() ? mFlushes : kNothingWaiting; }
  /// Throws mkv::Error naming `call` when writes waited at `mark` and no flush has returned since:
  /// the engine ran the prepared work's forward while the rows and lengths it reads were still on
  /// the host (DeviceWriteTiming::kEngineStep without KVCacheRuntime::flushDeviceWrites()).
  void requireReachedDevice(char const* call, int64_t mark) const;
  /// Launches of the queue's flushes so far: the length batch's (each flush that found writes
  /// makes one; a length write overlapping a queued one only partly makes one more) and one per
  /// table upload beyond the inline limit (its own launch, after a staged copy).
  int64_t launches() const noexcept { return mBatch.launches() + mStagedUploads; }
  /// From now on, keep decisionDigest() (a tensor-parallel runtime's; others hash nothing).
  void recordDecisions() noexcept;
  /// A digest of every table entry and KV length the queue has been given since
  /// recordDecisions() (a rank's decisions: equal on every rank of a tensor-parallel deployment
  /// driven alike); tables count when a flush queues them. 0 without recordDecisions().
  uint64_t decisionDigest() const noexcept;

 private:
  /// Queues the dirty entries of every watched table in mBatch; rethrows the first table's error
  /// after trying the others.
  void queueTables(cudaStream_t stream);

  DeviceWriteTiming mTiming;
  kernels::InlinePatchBatch mBatch;
  std::vector<KVPageTable*> mTables;
  std::vector<KVCachePool*> mPools;
  int64_t mStagedUploads = 0;  // table uploads of the flushes that went through staging
  int64_t mFlushes = 0;        // flushes (settle's included) that returned normally
  uint64_t mTableDigest = 0;   // sum of one word per table entry queued (order-free)
  bool mRecordsDecisions = false;
};

}  // namespace mkv::detail
