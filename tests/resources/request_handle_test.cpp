// The handle both KV backends hand out (mkv/request_handle.h): move-only, invalid once moved from
// or invalidated by its owner, and a live handle destroyed or replaced abandons its request
// through the owner exactly once. The backends' own tests pin what an abandonment does:
// BoundedSwaFaultTest, ContextCacheCoordinatorTest, ContextCacheRequestTest.
#include "mkv/request_handle.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace mkv {
namespace {

/// An owner that records the abandonments its handles make.
class FakeOwner {
 public:
  using Handle = RequestHandle<FakeOwner>;

  Handle admit(uint64_t id) { return Handle(this, id); }
  /// As a backend's finish: the handle becomes invalid without an abandonment.
  static void finish(Handle& handle) noexcept { handle.invalidate(); }
  std::vector<uint64_t> const& abandoned() const { return mAbandoned; }

 private:
  friend Handle;
  void abandon(uint64_t id) noexcept { mAbandoned.push_back(id); }

  std::vector<uint64_t> mAbandoned;
};

using Handle = FakeOwner::Handle;

static_assert(!std::is_copy_constructible_v<Handle> && !std::is_copy_assignable_v<Handle>);
static_assert(std::is_nothrow_move_constructible_v<Handle> &&
              std::is_nothrow_move_assignable_v<Handle>);
static_assert(std::is_nothrow_destructible_v<Handle>);

TEST(RequestHandleTest, ADefaultHandleIsInvalidAndAbandonsNothing) {
  Handle const handle;
  EXPECT_FALSE(handle.valid());
  EXPECT_EQ(handle.id(), 0u);
}

TEST(RequestHandleTest, DestroyingALiveHandleAbandonsItsRequestOnce) {
  FakeOwner owner;
  {
    Handle const handle = owner.admit(7);
    EXPECT_TRUE(handle.valid());
    EXPECT_EQ(handle.id(), 7u);
    EXPECT_TRUE(owner.abandoned().empty());
  }
  EXPECT_EQ(owner.abandoned(), std::vector<uint64_t>{7});
}

TEST(RequestHandleTest, MovingHandsTheRequestOverAndLeavesTheSourceInvalid) {
  FakeOwner owner;
  {
    Handle source = owner.admit(3);
    Handle const moved(std::move(source));
    EXPECT_FALSE(source.valid());  // NOLINT(bugprone-use-after-move): moved from, by contract
    EXPECT_EQ(source.id(), 0u);    // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(moved.id(), 3u);
  }
  EXPECT_EQ(owner.abandoned(), std::vector<uint64_t>{3});
}

TEST(RequestHandleTest, MoveAssigningOverALiveHandleAbandonsItsRequestFirst) {
  FakeOwner owner;
  Handle target = owner.admit(1);
  Handle source = owner.admit(2);
  target = std::move(source);
  EXPECT_EQ(owner.abandoned(), std::vector<uint64_t>{1});
  EXPECT_EQ(target.id(), 2u);
  EXPECT_FALSE(source.valid());  // NOLINT(bugprone-use-after-move): moved from, by contract
  target = Handle();
  EXPECT_EQ(owner.abandoned(), (std::vector<uint64_t>{1, 2}));
  EXPECT_FALSE(target.valid());
}

TEST(RequestHandleTest, AHandleItsOwnerInvalidatedAbandonsNothing) {
  FakeOwner owner;
  {
    Handle handle = owner.admit(5);
    FakeOwner::finish(handle);
    EXPECT_FALSE(handle.valid());
    EXPECT_EQ(handle.id(), 0u);
  }
  EXPECT_TRUE(owner.abandoned().empty());
}

}  // namespace
}  // namespace mkv
