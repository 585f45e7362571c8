#include "context_cache/recent_digest_set.h"

#include <gtest/gtest.h>

#include <deque>
#include <random>

#include "mkv/error.h"

namespace mkv {
namespace {

TEST(RecentDigestSetTest, ForgetsTheOldestWhenFull) {
  RecentDigestSet set(2);
  set.insert({0, 1});
  set.insert({0, 2});
  EXPECT_TRUE(set.contains({0, 1}));
  set.insert({0, 3});
  EXPECT_FALSE(set.contains({0, 1}));
  EXPECT_TRUE(set.contains({0, 2}));
  EXPECT_TRUE(set.contains({0, 3}));
  EXPECT_EQ(set.size(), 2);
}

TEST(RecentDigestSetTest, ZeroCapacityIsDisabled) {
  RecentDigestSet set(0);
  set.insert({1, 1});
  EXPECT_FALSE(set.contains({1, 1}));
  EXPECT_THROW(RecentDigestSet(-1), Error);
}

TEST(RecentDigestSetTest, MatchesAReferenceFifoUnderCollidingDigests) {
  // Digests {0, k} and {k * c, 0}-style values collide heavily in a small table, exercising
  // probe runs, wrap-around and backward-shift deletion.
  std::mt19937 rng(7);
  for (int32_t capacity : {1, 3, 8, 50}) {
    RecentDigestSet set(capacity);
    std::deque<Hash128> reference;
    for (int step = 0; step < 4000; ++step) {
      Hash128 const digest{0, rng() % 40};
      set.insert(digest);
      reference.push_back(digest);
      if (static_cast<int32_t>(reference.size()) > capacity) {
        reference.pop_front();
      }
      for (uint64_t k = 0; k < 40; ++k) {
        bool const expected =
            std::find(reference.begin(), reference.end(), Hash128{0, k}) != reference.end();
        ASSERT_EQ(set.contains({0, k}), expected) << "capacity " << capacity << " step " << step;
      }
    }
  }
}

}  // namespace
}  // namespace mkv
