#include "context_cache/kv_event_queue.h"

#include <gtest/gtest.h>

#include <vector>

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

TEST(KvEventQueueTest, AllBlocksClearedKeepsItsPlaceAndCountsAsOneEvent) {
  KvEventQueue queue(3, 4);
  std::vector<int32_t> const tokens{1, 2, 3, 4};
  queue.pushStored(BlockStored{Hash128{0, 1}, kBlockChainRoot, 0, 4}, tokens);
  queue.push(AllBlocksCleared{});
  queue.push(BlockRemoved{Hash128{0, 2}, 5});
  queue.push(AllBlocksCleared{});  // overwrites the stored block
  EXPECT_EQ(queue.droppedCount(), 1U);
  std::vector<KvEvent> const events = queue.drain();
  ASSERT_EQ(events.size(), 3U);
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(events[0]));
  EXPECT_EQ(std::get<BlockRemoved>(events[1]), (BlockRemoved{Hash128{0, 2}, 5}));
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(events[2]));
  queue.pushStored(BlockStored{Hash128{0, 3}, kBlockChainRoot, 1, 4}, tokens);
  EXPECT_EQ(std::get<BlockStored>(queue.drain().at(0)).tokens, tokens)
      << "a slot a clear used keeps a stored block's tokens again";
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

TEST(KvEventQueueTest, KeepsEachStoredBlocksTokensInItsSlot) {
  KvEventQueue queue(2, 4);
  std::vector<int32_t> const first{1, 2, 3, 4};
  std::vector<int32_t> const second{5, 6, 7, 8};
  std::vector<int32_t> const third{9, 10, 11, 12};
  Hash128 const extras{7, 7};
  queue.pushStored(BlockStored{Hash128{0, 1}, kBlockChainRoot, 0, 4}, first);
  queue.push(BlockStored{Hash128{0, 2}, Hash128{0, 1}, 1, 4, second, extras});
  queue.pushStored(BlockStored{Hash128{0, 3}, Hash128{0, 2}, 2, 4}, third);  // overwrites `first`
  std::vector<KvEvent> const events = queue.drain();
  ASSERT_EQ(events.size(), 2U);
  EXPECT_EQ(std::get<BlockStored>(events[0]),
            (BlockStored{Hash128{0, 2}, Hash128{0, 1}, 1, 4, second, extras}));
  EXPECT_EQ(std::get<BlockStored>(events[1]).tokens, third);
  EXPECT_EQ(queue.droppedCount(), 1U);

  // Tokens that do not fit the slot, or disagree with the token count, are not kept.
  queue.pushStored(BlockStored{Hash128{0, 4}, kBlockChainRoot, 3, 5},
                   std::vector<int32_t>{1, 2, 3, 4, 5});
  queue.pushStored(BlockStored{Hash128{0, 5}, kBlockChainRoot, 4, 4},
                   std::vector<int32_t>{1, 2, 3});
  for (KvEvent const& event : queue.drain()) {
    EXPECT_TRUE(std::get<BlockStored>(event).tokens.empty());
  }
  KvEventQueue withoutTokens(2);
  withoutTokens.pushStored(BlockStored{Hash128{0, 6}, kBlockChainRoot, 5, 4}, first);
  EXPECT_TRUE(std::get<BlockStored>(withoutTokens.drain().at(0)).tokens.empty());
}

TEST(KvEventQueueTest, ZeroCapacityDisablesWithoutCountingDrops) {
  KvEventQueue queue(0);
  queue.push(BlockRemoved{});
  EXPECT_TRUE(queue.drain().empty());
  EXPECT_EQ(queue.droppedCount(), 0U);
  EXPECT_THROW(KvEventQueue(-1), Error);
  EXPECT_THROW(KvEventQueue(1, -1), Error);
}

}  // namespace
}  // namespace mkv

namespace mkv {
namespace {

TEST(KvEventQueueTest, TheMediumOfEveryEventSurvivesTheQueue) {
  KvEventQueue queue(4, 2);
  BlockStored stored{Hash128{1, 1}, kBlockChainRoot, 3, 2, {}, {}, KvMedium::kCpu};
  std::vector<int32_t> const tokens{5, 6};
  queue.pushStored(stored, tokens);
  queue.push(BlockRemoved{Hash128{1, 1}, 3, KvMedium::kCpu});
  queue.push(BlockRemoved{Hash128{2, 2}, 4});
  std::vector<KvEvent> const events = queue.drain();
  ASSERT_EQ(events.size(), 3U);
  stored.tokens = tokens;
  EXPECT_EQ(std::get<BlockStored>(events[0]), stored);
  EXPECT_EQ(std::get<BlockRemoved>(events[1]).medium, KvMedium::kCpu);
  EXPECT_EQ(std::get<BlockRemoved>(events[2]).medium, KvMedium::kGpu);
}

TEST(KvEventQueueTest, TheGroupOfEveryEventSurvivesTheQueue) {
  KvEventQueue queue(4, 2);
  KvCacheGroup const sliding{1, KvCacheSpecKind::kSlidingWindow, 1024};
  BlockStored stored{Hash128{1, 1}, kBlockChainRoot, 3, 2, {}, {}, KvMedium::kGpu, sliding};
  std::vector<int32_t> const tokens{5, 6};
  queue.pushStored(stored, tokens);
  queue.push(BlockRemoved{Hash128{1, 1}, 3, KvMedium::kGpu, sliding});
  queue.push(BlockRemoved{Hash128{2, 2}, 4});
  std::vector<KvEvent> const events = queue.drain();
  ASSERT_EQ(events.size(), 3U);
  stored.tokens = tokens;
  EXPECT_EQ(std::get<BlockStored>(events[0]), stored);
  EXPECT_EQ(std::get<BlockRemoved>(events[1]).group, sliding);
  EXPECT_FALSE(std::get<BlockRemoved>(events[2]).group.specified());
}

}  // namespace
}  // namespace mkv
