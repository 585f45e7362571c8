// ContextCacheManager: retention priorities and the eviction policy (docs/context_cache.md,
// "Eviction" and "Retention priorities"). Every parameterised test runs with each policy.

#include <gtest/gtest.h>

#include <string>
#include <variant>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "context_cache_test_support.h"
#include "mkv/error.h"

namespace mkv {
namespace {

using test::admit;
using test::captureState;
using test::expectManagerInvariants;
using test::publishCold;
using test::publishTokens;
using test::requestOf;
using test::tokenRun;

constexpr int32_t kPage = 4;
constexpr ResourceType kBase = ResourceType::kBaseKvPage;

RetentionRange rangeOf(int32_t start, std::optional<int32_t> end, int32_t priority,
                       std::optional<int64_t> duration = std::nullopt) {
  return RetentionRange{start, end, priority, duration};
}

/// A request of `tokens` on bypass (needs every page) that carries `retention`.
LookupRequest coldRequestOf(std::vector<int32_t> const& tokens,
                            std::vector<RetentionRange> const& retention = {}) {
  LookupRequest request = requestOf(tokens, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass);
  request.retention = retention;
  return request;
}

/// A producer whose request carries `retention`: admitted, every full block published, released.
RecordId publishWith(ContextCacheManager& manager, std::vector<int32_t> const& tokens,
                     std::vector<RetentionRange> const& retention) {
  CacheRequestLease lease = admit(manager, coldRequestOf(tokens, retention));
  return publishTokens(manager, lease, tokens).record;
}

std::string policyName(::testing::TestParamInfo<EvictionPolicyKind> const& param) {
  return std::string(toString(param.param));
}

class ManagerRetentionTest : public ::testing::TestWithParam<EvictionPolicyKind> {
 protected:
  ContextCacheManagerOptions options() {
    ContextCacheManagerOptions options;
    options.evictionPolicy = GetParam();
    options.retentionClock = [this] { return mNow; };
    return options;
  }
  int64_t mNow = 0;
};

TEST_P(ManagerRetentionTest, AHighPriorityRecordSurvivesADemandThatEvictsLowerOnes) {
  for (bool const retained : {false, true}) {
    SCOPED_TRACE(retained ? "with retention" : "without retention");
    ContextCacheManager m(kPage, {4, 0, 0, 0}, 8, options());
    std::vector<RetentionRange> retention;
    if (retained) {
      retention.push_back(rangeOf(0, std::nullopt, 80));
    }
    RecordId const oldest = publishWith(m, tokenRun(8, 0), retention);  // pages 0, 1
    RecordId const b = publishCold(m, tokenRun(4, 100));
    RecordId const c = publishCold(m, tokenRun(4, 200));
    ASSERT_EQ(m.pools().freeCount(kBase), 0);
    EXPECT_EQ(m.records().get(oldest)->retentionPriority,
              retained ? 80 : kDefaultRetentionPriority);

    CacheRequestLease lease = admit(m, coldRequestOf(tokenRun(8, 300)));  // two pages
    if (retained) {
      EXPECT_NE(m.records().get(oldest), nullptr);
      EXPECT_EQ(m.records().get(b), nullptr);
      EXPECT_EQ(m.records().get(c), nullptr);
    } else {
      EXPECT_EQ(m.records().get(oldest), nullptr) << "the oldest record is the first victim";
      EXPECT_NE(m.records().get(b), nullptr);
    }
    expectManagerInvariants(m);
  }
}

TEST_P(ManagerRetentionTest, ARecordTakesThePriorityOfTheRangeItsLastTokenIsIn) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8, options());
  std::vector<int32_t> const tokens = tokenRun(12, 0);
  std::vector<RetentionRange> const retention{rangeOf(0, 4, 90), rangeOf(8, std::nullopt, 10)};
  CacheRequestLease lease = admit(m, coldRequestOf(tokens, retention));
  std::vector<int32_t> priorities;
  for (int32_t resident : {4, 8, 12}) {
    RecordId const id = publishTokens(m, lease, tokens, {}, resident).record;
    priorities.push_back(m.records().get(id)->retentionPriority);
    EXPECT_FALSE(m.records().get(id)->retentionExpiry.has_value());
  }
  EXPECT_EQ(priorities, (std::vector<int32_t>{90, kDefaultRetentionPriority, 10}))
      << "last tokens 3, 7 (in no range) and 11";
}

TEST_P(ManagerRetentionTest, AnExpiredPriorityFallsBackToTheDefault) {
  // A record kept at priority 0 (evicted first) for 10 ticks of the injected clock.
  std::vector<RetentionRange> const briefly{rangeOf(0, std::nullopt, 0, 10)};
  for (int64_t const now : {9, 10}) {
    SCOPED_TRACE(now);
    mNow = 0;
    ContextCacheManager m(kPage, {3, 0, 0, 0}, 8, options());
    RecordId const a = publishWith(m, tokenRun(4, 0), briefly);
    RecordId const b = publishCold(m, tokenRun(4, 100));
    publishCold(m, tokenRun(4, 200));
    EXPECT_EQ(m.records().get(a)->retentionExpiry, 10);
    EXPECT_EQ(m.records().victimOrder().front(), a);

    mNow = now;
    CacheRequestLease lease = admit(m, coldRequestOf(tokenRun(4, 300)));
    if (now < 10) {
      EXPECT_EQ(m.records().get(a), nullptr) << "still at priority 0";
      EXPECT_NE(m.records().get(b), nullptr);
    } else {
      ASSERT_NE(m.records().get(a), nullptr) << "back at the default, as its newest record";
      EXPECT_EQ(m.records().get(a)->retentionPriority, kDefaultRetentionPriority);
      EXPECT_FALSE(m.records().get(a)->retentionExpiry.has_value());
      EXPECT_EQ(m.records().get(b), nullptr);
    }
    expectManagerInvariants(m);
  }
}

TEST_P(ManagerRetentionTest, EvictionMetricsAndEventsDoNotDependOnThePolicy) {
  ContextCacheManagerOptions withEvents = options();
  withEvents.eventQueueCapacity = 16;
  ContextCacheManager m(kPage, {2, 0, 0, 0}, 8, withEvents);
  publishCold(m, tokenRun(4, 0));
  publishCold(m, tokenRun(4, 100));
  EXPECT_EQ(m.drainEvents().size(), 2U);
  CacheRequestLease lease = admit(m, coldRequestOf(tokenRun(8, 200)));
  ContextCacheMetrics const metrics = m.metrics();
  EXPECT_EQ(metrics.publishedRecords, 2U);
  EXPECT_EQ(metrics.evictedRecords, 2U);
  EXPECT_EQ(metrics.reclaimed(kBase), 2U);
  std::vector<PageId> removed;
  for (KvEvent const& event : m.drainEvents()) {
    ASSERT_TRUE(std::holds_alternative<BlockRemoved>(event));
    removed.push_back(std::get<BlockRemoved>(event).page);
  }
  EXPECT_EQ(removed, (std::vector<PageId>{0, 1}));
}

INSTANTIATE_TEST_SUITE_P(EveryPolicy, ManagerRetentionTest,
                         ::testing::Values(EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo,
                                           EvictionPolicyKind::kLoopAware),
                         policyName);

TEST(ManagerRetentionErrorsTest, InvalidRetentionThrowsNamingTheCallAndTheValueAndChangesNothing) {
  ContextCacheManager m(kPage, {4, 0, 0, 0}, 8);
  std::vector<int32_t> const tokens = tokenRun(8, 0);
  publishCold(m, tokens);
  test::ManagerState const before = captureState(m);
  struct Case {
    std::vector<RetentionRange> ranges;
    std::string what;
  };
  std::vector<Case> const cases{
      {{rangeOf(0, std::nullopt, 101)}, "priority 101 outside [0, 100]"},
      {{rangeOf(0, std::nullopt, -1)}, "priority -1 outside [0, 100]"},
      {{rangeOf(-4, 8, 50)}, "negative token start -4"},
      {{rangeOf(8, 8, 50)}, "token end 8 not after its start 8"},
      {{rangeOf(0, 8, 50, 0)}, "duration 0 must be positive"},
      {{rangeOf(0, 8, 50), rangeOf(4, 12, 60)}, "retention range 1 starts at token 4"},
      {{rangeOf(0, std::nullopt, 50), rangeOf(16, 20, 60)}, "retention range 1 starts at token 16"},
  };
  for (Case const& c : cases) {
    LookupRequest request = requestOf(tokens);
    request.retention = c.ranges;
    try {
      m.admit(request);
      ADD_FAILURE() << "no error for " << c.what;
    } catch (Error const& error) {
      std::string const message = error.what();
      EXPECT_NE(message.find("ContextCacheManager::admit"), std::string::npos) << message;
      EXPECT_NE(message.find(c.what), std::string::npos) << message;
    }
    EXPECT_THROW(m.lookup(request), Error);
    std::vector<LookupRequest> const batch{requestOf(tokens), request};
    std::vector<LookupResult> looked;
    looked.push_back(m.lookup(batch[0]));
    looked.push_back(m.lookup(batch[0]));
    EXPECT_THROW(m.acquireBatch(batch, std::move(looked)), Error);
  }
  EXPECT_EQ(captureState(m), before);
  test::expectQuiescent(m);
}

TEST(ManagerRetentionErrorsTest, AnEvictionPolicyOutOfRangeIsRefusedAtConstruction) {
  ContextCacheManagerOptions options;
  options.evictionPolicy = static_cast<EvictionPolicyKind>(7);
  try {
    ContextCacheManager m(kPage, {4, 0, 0, 0}, 8, options);
    ADD_FAILURE() << "constructed";
  } catch (Error const& error) {
    EXPECT_NE(std::string(error.what()).find("ContextCacheManager: eviction policy 7 out of range"),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace mkv
