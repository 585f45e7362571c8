#include "mkv/resident_slot_pool.h"

#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <vector>

#include "support/test_util.h"

namespace mkv {
namespace {

TEST(ResidentSlotPoolTest, DefaultPoolHasNoSlots) {
  ResidentSlotPool pool;
  EXPECT_EQ(pool.capacity(), 0);
  EXPECT_EQ(pool.available(), 0);
  EXPECT_EQ(pool.acquire(), std::nullopt);
}

TEST(ResidentSlotPoolTest, AcquireYieldsTheLowestSlotsWithEpochOne) {
  ResidentSlotPool pool(3);
  EXPECT_EQ(pool.capacity(), 3);
  EXPECT_EQ(pool.acquire(), (ResidentRef{0, 1}));
  EXPECT_EQ(pool.acquire(), (ResidentRef{1, 1}));
  EXPECT_EQ(pool.acquire(), (ResidentRef{2, 1}));
  EXPECT_EQ(pool.available(), 0);
  EXPECT_EQ(pool.acquire(), std::nullopt);
}

TEST(ResidentSlotPoolTest, MiddleReleaseReacquiresOnlyThatSlotWithTheNextEpoch) {
  ResidentSlotPool pool(3);
  ResidentRef const first = *pool.acquire();
  ResidentRef const middle = *pool.acquire();
  ResidentRef const last = *pool.acquire();
  ASSERT_TRUE(pool.release(middle));
  EXPECT_FALSE(pool.contains(middle));
  EXPECT_EQ(pool.available(), 1);
  std::optional<ResidentRef> const again = pool.acquire();
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->slot, 1);
  EXPECT_EQ(again->epoch, 2u);
  EXPECT_TRUE(pool.contains(first));
  EXPECT_TRUE(pool.contains(last));
  EXPECT_TRUE(pool.contains(*again));
}

TEST(ResidentSlotPoolTest, StaleRefCannotReleaseTheReusedSlot) {
  ResidentSlotPool pool(2);
  ResidentRef const stale = *pool.acquire();
  ASSERT_TRUE(pool.release(stale));
  ResidentRef const current = *pool.acquire();
  ASSERT_EQ(current.slot, stale.slot);
  EXPECT_FALSE(pool.release(stale));  // old epoch
  EXPECT_TRUE(pool.contains(current));
  EXPECT_EQ(pool.available(), 1);
  EXPECT_TRUE(pool.release(current));
  EXPECT_FALSE(pool.release(current));  // double release
}

TEST(ResidentSlotPoolTest, ForeignRefsAreRejectedWithoutChange) {
  ResidentSlotPool pool(2);
  ResidentRef const held = *pool.acquire();
  for (ResidentRef const foreign :
       {ResidentRef{-1, 1}, ResidentRef{2, 1}, ResidentRef{0, 0}, ResidentRef{0, 7},
        ResidentRef{1, 1} /* free slot */, ResidentRef{}}) {
    EXPECT_FALSE(pool.contains(foreign));
    EXPECT_FALSE(pool.release(foreign));
  }
  EXPECT_TRUE(pool.contains(held));
  EXPECT_EQ(pool.available(), 1);
  EXPECT_EQ(pool.acquire(), (ResidentRef{1, 1}));
}

TEST(ResidentSlotPoolTest, ResetFreesEverySlotAndRestartsEpochsAndOrder) {
  ResidentSlotPool pool(3);
  ResidentRef const a = *pool.acquire();
  ResidentRef const b = *pool.acquire();
  ASSERT_TRUE(pool.release(a));
  (void)pool.acquire();  // slot 0 at epoch 2
  pool.reset(2);
  EXPECT_EQ(pool.capacity(), 2);
  EXPECT_EQ(pool.available(), 2);
  EXPECT_FALSE(pool.contains(b));
  EXPECT_EQ(pool.acquire(), (ResidentRef{0, 1}));
  EXPECT_EQ(pool.acquire(), (ResidentRef{1, 1}));
  EXPECT_EQ(pool.acquire(), std::nullopt);
}

TEST(ResidentSlotPoolTest, ResetRejectsANegativeCapacityWithoutChange) {
  ResidentSlotPool pool(2);
  ResidentRef const held = *pool.acquire();
  EXPECT_TRUE(
      test::throwsError([&] { pool.reset(-1); }, {"ResidentSlotPool::reset", "capacity", "-1"}));
  EXPECT_EQ(pool.capacity(), 2);
  EXPECT_TRUE(pool.contains(held));
  EXPECT_EQ(pool.available(), 1);
  EXPECT_TRUE(test::throwsError([] { ResidentSlotPool(-3); }, {"-3"}));
  pool.reset(0);
  EXPECT_EQ(pool.acquire(), std::nullopt);
}

TEST(ResidentSlotPoolTest, RandomAcquireAndReleaseMatchAModel) {
  constexpr int32_t kCapacity = 7;
  ResidentSlotPool pool(kCapacity);
  std::vector<uint64_t> epochs(kCapacity, 1);
  std::vector<bool> held(kCapacity, false);
  std::vector<ResidentRef> everHanded;
  std::mt19937_64 rng(3);
  for (int op = 0; op < 5000; ++op) {
    if (rng() % 2 == 0) {
      std::optional<ResidentRef> const got = pool.acquire();
      auto const lowest = std::find(held.begin(), held.end(), false);
      if (lowest == held.end()) {
        ASSERT_EQ(got, std::nullopt) << "op " << op;
      } else {
        auto const slot = static_cast<CacheSlot>(lowest - held.begin());
        ASSERT_EQ(got, (ResidentRef{slot, epochs[static_cast<std::size_t>(slot)]})) << "op " << op;
        *lowest = true;
        everHanded.push_back(*got);
      }
    } else if (!everHanded.empty()) {
      ResidentRef const ref = everHanded[rng() % everHanded.size()];  // often stale
      auto const slot = static_cast<std::size_t>(ref.slot);
      bool const expected = held[slot] && epochs[slot] == ref.epoch;
      ASSERT_EQ(pool.release(ref), expected) << "op " << op;
      if (expected) {
        held[slot] = false;
        ++epochs[slot];
      }
    }
    ASSERT_EQ(pool.available(), std::count(held.begin(), held.end(), false));
  }
}

TEST(ResidentSlotPoolTest, RequireHeldNamesTheCallTheSlotAndBothEpochsOfAStaleRef) {
  ResidentSlotPool pool(2);
  ResidentRef const first = pool.acquire().value();
  EXPECT_NO_THROW(pool.requireHeld("Caller::call", first));
  EXPECT_EQ(pool.epoch(first.slot), first.epoch);
  ASSERT_TRUE(pool.release(first));
  EXPECT_TRUE(test::throwsError([&] { pool.requireHeld("Caller::call", first); },
                                {"Caller::call", "resident slot 0 has epoch 1",
                                 "current epoch is 2", "stale (the slot was released)"}));
  ResidentRef const second = pool.acquire().value();
  ASSERT_EQ(second.slot, first.slot);
  EXPECT_EQ(pool.epoch(second.slot), 2u);
  EXPECT_TRUE(test::throwsError(
      [&] { pool.requireHeld("Caller::call", first); },
      {"Caller::call", "has epoch 1", "current epoch is 2", "released and acquired again"}));
  EXPECT_NO_THROW(pool.requireHeld("Caller::call", second));
  EXPECT_TRUE(test::throwsError(
      [&] {
        pool.requireHeld("Caller::call", ResidentRef{1, 1});
      },
      {"Caller::call", "resident slot 1 (epoch 1) is not held"}));
  EXPECT_TRUE(test::throwsError(
      [&] {
        pool.requireHeld("Caller::call", ResidentRef{2, 1});
      },
      {"Caller::call", "slot 2 outside the resident pool's [0, 2)"}));
  EXPECT_EQ(pool.epoch(2), 0u);
  EXPECT_EQ(pool.available(), 1) << "the checks change nothing";
}

}  // namespace
}  // namespace mkv
