#include "events/batch_queue.h"

#include <utility>

namespace mkv::events {

bool BatchQueue::push(double timestamp, std::vector<KvEvent> events) {
  std::lock_guard lock(mMutex);
  uint64_t const sequence = mNextSequence++;
  if (mQueue.size() >= mCapacity) {
    ++mDropped;
    mDroppedEvents += events.size();
    return false;
  }
  mQueue.push_back({sequence, timestamp, std::move(events)});
  ++mAccepted;
  return true;
}

std::optional<PendingBatch> BatchQueue::pop() {
  std::lock_guard lock(mMutex);
  if (mQueue.empty()) {
    return std::nullopt;
  }
  PendingBatch batch = std::move(mQueue.front());
  mQueue.pop_front();
  return batch;
}

void BatchQueue::markSent() {
  {
    std::lock_guard lock(mMutex);
    ++mSent;
  }
  mSentChanged.notify_all();
}

void BatchQueue::waitUntilSent() {
  std::unique_lock lock(mMutex);
  uint64_t const target = mAccepted;
  mSentChanged.wait(lock, [this, target] { return mSent >= target; });
}

uint64_t BatchQueue::accepted() const {
  std::lock_guard lock(mMutex);
  return mAccepted;
}

uint64_t BatchQueue::dropped() const {
  std::lock_guard lock(mMutex);
  return mDropped;
}

uint64_t BatchQueue::droppedEvents() const {
  std::lock_guard lock(mMutex);
  return mDroppedEvents;
}

}  // namespace mkv::events
