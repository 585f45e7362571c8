#include "events/batch_queue.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace mkv::events {
namespace {

std::vector<KvEvent> removals(int32_t count) {
  std::vector<KvEvent> events;
  for (int32_t page = 0; page < count; ++page) {
    events.emplace_back(BlockRemoved{Hash128{0, static_cast<uint64_t>(page)}, page});
  }
  return events;
}

TEST(BatchQueueTest, NumbersBatchesFromZeroAndHandsThemOverInOrder) {
  BatchQueue queue(4);
  EXPECT_FALSE(queue.pop().has_value());
  EXPECT_TRUE(queue.push(1.0, removals(1)));
  EXPECT_TRUE(queue.push(2.0, removals(2)));
  std::optional<PendingBatch> const first = queue.pop();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->sequence, 0U);
  EXPECT_EQ(first->timestamp, 1.0);
  EXPECT_EQ(first->events.size(), 1U);
  EXPECT_EQ(queue.pop()->sequence, 1U);
  EXPECT_FALSE(queue.pop().has_value());
  EXPECT_EQ(queue.accepted(), 2U);
}

TEST(BatchQueueTest, AFullQueueDropsAndCountsAndLeavesASequenceGap) {
  BatchQueue queue(2);
  EXPECT_TRUE(queue.push(0.0, removals(1)));
  EXPECT_TRUE(queue.push(0.0, removals(1)));
  EXPECT_FALSE(queue.push(0.0, removals(3))) << "full: dropped, the caller is not blocked";
  EXPECT_EQ(queue.dropped(), 1U);
  EXPECT_EQ(queue.droppedEvents(), 3U);
  EXPECT_EQ(queue.accepted(), 2U);
  (void)queue.pop();
  EXPECT_TRUE(queue.push(0.0, removals(1)));
  EXPECT_EQ(queue.pop()->sequence, 1U);
  EXPECT_EQ(queue.pop()->sequence, 3U) << "sequence 2 went to the dropped batch";
}

TEST(BatchQueueTest, WaitUntilSentReturnsOnceTheWorkerMarkedEveryAcceptedBatch) {
  BatchQueue queue(8);
  queue.waitUntilSent();  // nothing accepted: returns at once
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(queue.push(0.0, removals(1)));
  }
  std::thread worker([&queue] {
    for (int sent = 0; sent < 5;) {
      if (queue.pop()) {
        queue.markSent();
        ++sent;
      } else {
        std::this_thread::yield();
      }
    }
  });
  queue.waitUntilSent();
  EXPECT_FALSE(queue.pop().has_value());
  worker.join();
}

}  // namespace
}  // namespace mkv::events
