// Random operation sequences against ContextCacheManager, checked after every operation against
// the manager's own invariants and an independent naive model of what has been published.

#include <gtest/gtest.h>

#include <algorithm>
#include <list>
#include <map>
#include <random>

#include "context_cache/context_cache_manager.h"
#include "context_cache_test_support.h"

namespace mkv {
namespace {

using test::expectManagerInvariants;
using test::viewOf;

constexpr int32_t kPage = 4;

/// Published prefixes as plain token vectors: what should be reusable, with no digests, pages or
/// refcounts involved.
class NaiveModel {
 public:
  struct Record {
    RecordId id;
    std::vector<int32_t> tokens;  ///< count * page tokens
    Hash128 salt;
  };

  /// Longest k such that the first k blocks of `tokens` (under `salt`) are a block prefix of a
  /// stored record.
  int32_t matchedBlocks(std::vector<int32_t> const& tokens, Hash128 salt) const {
    int32_t best = 0;
    for (Record const& r : mLru) {
      if (r.salt != salt) {
        continue;
      }
      std::size_t const n = std::min(r.tokens.size(), tokens.size()) / kPage * kPage;
      auto const mismatch = std::mismatch(
          r.tokens.begin(), r.tokens.begin() + static_cast<std::ptrdiff_t>(n), tokens.begin());
      auto const common = static_cast<int32_t>(mismatch.first - r.tokens.begin()) / kPage;
      best = std::max(best, common);
    }
    return best;
  }
  Record* find(std::vector<int32_t> const& tokens, Hash128 salt) {
    for (Record& r : mLru) {
      if (r.tokens == tokens && r.salt == salt) {
        return &r;
      }
    }
    return nullptr;
  }
  void touch(RecordId id) {
    auto const it =
        std::find_if(mLru.begin(), mLru.end(), [id](Record const& r) { return r.id == id; });
    ASSERT_NE(it, mLru.end());
    mLru.splice(mLru.end(), mLru, it);
  }
  void insert(Record record, std::size_t maxRecords) {
    mLru.push_back(std::move(record));
    while (mLru.size() > maxRecords) {
      mLru.pop_front();
    }
  }
  /// The manager evicted records on its own (capacity pressure): they must be an LRU prefix of
  /// the model's order, leaving out the records whose every page a lease pins (the walk passes
  /// over those: evicting one would free nothing). Drops them from the model.
  void syncEvictions(RecordStore const& records, ResourcePools const& pools) {
    bool survivorSeen = false;
    for (auto it = mLru.begin(); it != mLru.end();) {
      CacheRecord const* survivor = records.get(it->id);
      if (survivor == nullptr) {
        EXPECT_FALSE(survivorSeen) << "record " << it->id << " evicted out of LRU order";
        it = mLru.erase(it);
        continue;
      }
      bool fullyPinned = true;
      survivor->forEachResource(
          [&](ResourceId id) { fullyPinned = fullyPinned && pools.activeRefs(id) > 0; });
      survivorSeen = survivorSeen || !fullyPinned;
      ++it;
    }
  }
  std::vector<RecordId> order() const {
    std::vector<RecordId> ids;
    for (Record const& r : mLru) {
      ids.push_back(r.id);
    }
    return ids;
  }

 private:
  std::list<Record> mLru;
};

struct LiveSequence {
  CacheRequestLease lease;
  std::vector<int32_t> ledger;  ///< prompt + decoded tokens; never longer than its pages cover
  Hash128 salt;
};

struct PropertyConfig {
  uint32_t seed;
  int32_t basePages;
  int32_t maxRecords;
  bool verifyTokens;
  int32_t operations;
};

class ContextCacheManagerPropertyTest : public ::testing::TestWithParam<PropertyConfig> {};

TEST_P(ContextCacheManagerPropertyTest, RandomOperationsKeepInvariantsAndMatchTheModel) {
  PropertyConfig const config = GetParam();
  ContextCacheManagerOptions options;
  options.verifyTokens = config.verifyTokens;
  options.eventQueueCapacity = 16;
  // The model keeps an LRU list; S3-FIFO's random operations are the lifecycle fuzzer's and the
  // coordinator property test's (the default policy), against invariants.
  options.evictionPolicy = EvictionPolicyKind::kLru;
  ContextCacheManager manager(kPage, ResourceDemand{config.basePages, 0, 0, 0}, config.maxRecords,
                              options);
  NaiveModel model;
  std::vector<LiveSequence> live;
  std::mt19937 rng(config.seed);
  auto const uniform = [&rng](int32_t lo, int32_t hi) {
    return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
  };
  // Prompts share prefixes heavily: one of a few "system prompts", then a tail over a tiny
  // alphabet; a fifth of them carry another salt.
  std::vector<std::vector<int32_t>> systems;
  systems.reserve(4);
  for (int32_t s = 0; s < 4; ++s) {
    systems.push_back(test::tokenRun(uniform(0, 12), 1000 * (s + 1)));
  }
  Hash128 const salts[2] = {Hash128{}, digestIdentity("tenant")};
  auto const randomPrompt = [&]() {
    std::vector<int32_t> prompt = systems[static_cast<std::size_t>(uniform(0, 3))];
    int32_t const tail = uniform(prompt.empty() ? 1 : 0, 10);
    for (int32_t i = 0; i < tail; ++i) {
      prompt.push_back(uniform(0, 2));
    }
    return prompt;
  };

  int32_t admitted = 0;
  int32_t hits = 0;
  int32_t published = 0;
  for (int32_t step = 0; step < config.operations && !HasFailure(); ++step) {
    int32_t const op = uniform(0, 9);
    if (op <= 3 || live.empty()) {
      // Admit.
      std::vector<int32_t> prompt = randomPrompt();
      Hash128 const salt = salts[uniform(0, 4) == 0 ? 1 : 0];
      bool const bypass = uniform(0, 9) == 0;
      LookupRequest request;
      request.prompt = viewOf(prompt, {{}, salt});
      request.policy =
          bypass ? ContextCacheLookupPolicy::kBypass : ContextCacheLookupPolicy::kUseCache;
      int32_t const expected = bypass ? 0 : model.matchedBlocks(prompt, salt);
      AdmissionResult result = manager.admit(request);
      model.syncEvictions(manager.records(), manager.pools());
      if (result.outcome == AdmissionOutcome::kAcquired) {
        auto const n = static_cast<int32_t>(prompt.size());
        int32_t const matched = expected * kPage;
        int32_t const reuse = matched == n ? matched - kPage : matched;
        EXPECT_EQ(result.plan.matchedTokenLength, matched) << "step " << step;
        EXPECT_EQ(result.plan.reuseTokenLength, reuse) << "step " << step;
        EXPECT_EQ(result.lease->boundBasePageCount(), reuse / kPage);
        EXPECT_EQ(static_cast<int32_t>(result.lease->basePages().size()), (n + kPage - 1) / kPage);
        ++admitted;
        hits += matched > 0 ? 1 : 0;
        live.push_back({std::move(*result.lease), std::move(prompt), salt});
      }
    } else if (op <= 5) {
      // Decode: grow by a few tokens when the pool allows.
      LiveSequence& seq =
          live[static_cast<std::size_t>(uniform(0, static_cast<int32_t>(live.size()) - 1))];
      int32_t const extra = uniform(1, 6);
      auto const length = static_cast<int32_t>(seq.ledger.size()) + extra;
      int32_t const needed =
          (length + kPage - 1) / kPage - static_cast<int32_t>(seq.lease.basePages().size());
      if (manager.growBasePages(seq.lease, std::max(0, needed))) {
        for (int32_t i = 0; i < extra; ++i) {
          seq.ledger.push_back(uniform(0, 2));
        }
      }
      model.syncEvictions(manager.records(), manager.pools());
    } else if (op <= 8) {
      // Publish a random ready prefix.
      LiveSequence& seq =
          live[static_cast<std::size_t>(uniform(0, static_cast<int32_t>(live.size()) - 1))];
      auto const resident = uniform(0, static_cast<int32_t>(seq.ledger.size()));
      int32_t const count = resident / kPage;
      if (count == 0) {
        continue;
      }
      std::vector<int32_t> const prefix(seq.ledger.begin(),
                                        seq.ledger.begin() + std::ptrdiff_t{count} * kPage);
      PromptBlocks const blocks = hashPromptBlocks(viewOf(seq.ledger, {{}, seq.salt}), kPage);
      NaiveModel::Record* existing = model.find(prefix, seq.salt);
      PublishResult const result = manager.publish(seq.lease, blocks, resident);
      EXPECT_EQ(result.publishedFullBlockCount, count);
      if (existing != nullptr) {
        EXPECT_EQ(result.status, PublishStatus::kExistingRecord) << "step " << step;
        EXPECT_EQ(result.record, existing->id);
        model.touch(existing->id);
      } else {
        EXPECT_EQ(result.status, PublishStatus::kPublished) << "step " << step;
        if (config.maxRecords > 0) {
          EXPECT_NE(result.record, kNoRecord);
        }
        model.insert({result.record, prefix, seq.salt},
                     static_cast<std::size_t>(config.maxRecords));
        ++published;
      }
    } else {
      // Release.
      std::size_t const victim =
          static_cast<std::size_t>(uniform(0, static_cast<int32_t>(live.size()) - 1));
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(victim));
    }
    expectManagerInvariants(manager);
    std::vector<RecordId> actual;
    for (CacheRecord const& r : manager.records().lruToMru()) {
      actual.push_back(r.id);
    }
    EXPECT_EQ(actual, model.order()) << "LRU order diverged at step " << step;
    EXPECT_EQ(manager.liveLeaseCount(), static_cast<int32_t>(live.size()));
    (void)manager.drainEvents();
  }
  live.clear();
  expectManagerInvariants(manager);
  // Everything not cached is free once every lease is gone.
  int32_t cached = 0;
  for (int32_t p = 0; p < config.basePages; ++p) {
    cached += manager.pools().cacheRefs({ResourceType::kBaseKvPage, p}) > 0 ? 1 : 0;
  }
  EXPECT_EQ(manager.pools().freeCount(ResourceType::kBaseKvPage) + cached, config.basePages);
  // The run exercised what it claims to.
  EXPECT_GT(admitted, config.operations / 20);
  EXPECT_GT(published, 0);
  if (config.maxRecords > 0) {
    EXPECT_GT(hits, admitted / 10);
    EXPECT_GT(manager.metrics().evictedRecords, 0U);
  } else {
    EXPECT_EQ(hits, 0) << "maxRecords 0 keeps nothing to hit";
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, ContextCacheManagerPropertyTest,
                         ::testing::Values(PropertyConfig{1, 24, 6, true, 3000},
                                           PropertyConfig{2, 16, 12, true, 3000},
                                           PropertyConfig{3, 40, 3, false, 3000},
                                           PropertyConfig{4, 12, 64, true, 3000},
                                           PropertyConfig{5, 24, 0, true, 1500}));

}  // namespace
}  // namespace mkv
