#include "mkv/context_cache/kv_event_queue.h"

#include <gtest/gtest.h>

#include "mkv/error.h"

namespace mkv {
namespace {

TEST(KvEventQueueTest, DrainsInOrderAndEmpties) {
  KvEventQueue queue(4);
  queue.push(BlockStored{Hash128{1, 1}, kBlockChainRoot, 3, 128});
  queue.push(BlockRemoved{Hash128{1, 1}, 3});
  EXPECT_EQ(queue.size(), 2);
  std::vector<KvEvent> const events = queue.drain();
  ASSERT_EQ(events.size(), 2U);
  EXPECT_EQ(std::get<BlockStored>(events[0]).page, 3);
  EXPECT_EQ(std::get<BlockRemoved>(events[1]).digest, (Hash128{1, 1}));
  EXPECT_EQ(queue.size(), 0);
  EXPECT_TRUE(queue.drain().empty());
}

TEST(KvEventQueueTest, OverflowDropsTheOldestAndCounts) {
  KvEventQueue queue(2);
  for (int32_t page = 0; page < 5; ++page) {
    queue.push(BlockRemoved{Hash128{0, static_cast<uint64_t>(page)}, page});
  }
  EXPECT_EQ(queue.droppedCount(), 3U);
  std::vector<KvEvent> const events = queue.drain();
  ASSERT_EQ(events.size(), 2U);
  EXPECT_EQ(std::get<BlockRemoved>(events[0]).page, 3);
  EXPECT_EQ(std::get<BlockRemoved>(events[1]).page, 4);
  queue.push(BlockRemoved{Hash128{}, 9});  // the ring restarts cleanly after a drain
  EXPECT_EQ(std::get<BlockRemoved>(queue.drain().at(0)).page, 9);
}

TEST(KvEventQueueTest, ZeroCapacityDisablesWithoutCountingDrops) {
  KvEventQueue queue(0);
  queue.push(BlockRemoved{});
  EXPECT_TRUE(queue.drain().empty());
  EXPECT_EQ(queue.droppedCount(), 0U);
  EXPECT_THROW(KvEventQueue(-1), Error);
}

}  // namespace
}  // namespace mkv
