#pragma once
/// \file batch_queue.h
/// The bounded hand-over of KV event batches from the engine thread to the publisher's worker
/// (internal; see kv_event_publisher.h).

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <vector>

#include "context_cache/kv_event_queue.h"

namespace mkv::events {

struct PendingBatch {
  uint64_t sequence = 0;
  double timestamp = 0.0;
  std::vector<KvEvent> events;
};

/// A FIFO of at most `capacity` batches. Every push takes the next sequence number (from 0), so a
/// batch dropped because the queue was full leaves a gap subscribers can see. Thread-safety: push()
/// from one thread, pop() and markSent() from another; the observers from any thread.
class BatchQueue {
 public:
  explicit BatchQueue(std::size_t capacity) : mCapacity(capacity) {}

  /// Queues the batch and returns true, or drops it, counts it and returns false when full.
  bool push(double timestamp, std::vector<KvEvent> events);
  /// The oldest batch, or nothing when empty (never waits).
  std::optional<PendingBatch> pop();
  /// The worker has sent one more popped batch.
  void markSent();
  /// Blocks until every batch accepted before the call has been marked sent.
  void waitUntilSent();

  uint64_t accepted() const;
  uint64_t dropped() const;
  uint64_t droppedEvents() const;

 private:
  std::size_t const mCapacity;
  mutable std::mutex mMutex;
  std::condition_variable mSentChanged;
  std::deque<PendingBatch> mQueue;
  uint64_t mNextSequence = 0;
  uint64_t mAccepted = 0;
  uint64_t mSent = 0;
  uint64_t mDropped = 0;
  uint64_t mDroppedEvents = 0;
};

}  // namespace mkv::events
