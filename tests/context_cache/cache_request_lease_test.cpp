#include "context_cache/cache_request_lease.h"

#include <gtest/gtest.h>

#include <type_traits>

#include "context_cache/context_cache_manager.h"
#include "context_cache_test_support.h"
#include "mkv/error.h"

namespace mkv {
namespace {

using test::admit;
using test::requestOf;
using test::tokenRun;

constexpr int32_t kPage = 4;

std::vector<PageId> pagesOf(CacheRequestLease const& lease) {
  return {lease.basePages().begin(), lease.basePages().end()};
}

static_assert(std::is_nothrow_move_constructible_v<CacheRequestLease>);
static_assert(std::is_nothrow_move_assignable_v<CacheRequestLease>);
static_assert(std::is_nothrow_destructible_v<CacheRequestLease>);
static_assert(!std::is_copy_constructible_v<CacheRequestLease>);

TEST(CacheRequestLeaseTest, DefaultLeaseIsInvalidAndEmpty) {
  CacheRequestLease lease;
  EXPECT_FALSE(lease.valid());
  EXPECT_EQ(lease.manager(), nullptr);
  EXPECT_TRUE(lease.basePages().empty());
  EXPECT_TRUE(lease.draftPages().empty());
  EXPECT_FALSE(lease.recurrentSnapshotSlot().has_value());
  lease.release();
}

TEST(CacheRequestLeaseTest, MoveAndReleaseAreSafeAndIdempotent) {
  ContextCacheManager m(kPage, {4, 0, 0, 0}, 8);
  CacheRequestLease a = admit(m, requestOf(tokenRun(5, 0)));
  std::vector<PageId> const pages = pagesOf(a);
  CacheRequestLease b = std::move(a);
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is defined
  EXPECT_TRUE(a.basePages().empty());
  EXPECT_EQ(pagesOf(b), pages);
  CacheRequestLease c = admit(m, requestOf(tokenRun(3, 0)));
  c = std::move(b);  // releases c's page first
  EXPECT_EQ(m.pools().freeCount(ResourceType::kBaseKvPage), 2);
  c.release();
  c.release();
  EXPECT_FALSE(c.valid());
  EXPECT_EQ(m.pools().freeCount(ResourceType::kBaseKvPage), 4);
  EXPECT_EQ(m.liveLeaseCount(), 0);
  EXPECT_THROW(m.growBasePages(c, 1), Error) << "released lease";
  ContextCacheManager other(kPage, {4, 0, 0, 0}, 8);
  CacheRequestLease foreign = admit(other, requestOf(tokenRun(5, 0)));
  EXPECT_THROW(m.growBasePages(foreign, 1), Error) << "lease of another manager";
}

}  // namespace
}  // namespace mkv
