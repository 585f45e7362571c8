#pragma once
/// \file context_cache_test_support.h
/// Shared helpers of the context_cache tests: prompt builders and the invariant checker of a
/// ContextCacheManager (its state snapshot is support/manager_state.h).

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "support/manager_state.h"
#include "support/token_runs.h"

namespace mkv::test {

inline PromptView viewOf(std::vector<int32_t> const& tokens, BlockKeyExtras extras = {},
                         std::vector<MediaPosition> const* media = nullptr) {
  return PromptView{
      tokens, media ? std::span<MediaPosition const>(*media) : std::span<MediaPosition const>{},
      extras};
}

inline LookupRequest requestOf(
    std::vector<int32_t> const& tokens, ReuseMode mode = ReuseMode::kVanilla,
    ContextCacheLookupPolicy policy = ContextCacheLookupPolicy::kUseCache,
    BlockKeyExtras extras = {}) {
  LookupRequest request;
  request.prompt = viewOf(tokens, extras);
  request.mode = mode;
  request.policy = policy;
  return request;
}

/// No live lease, and every resource of every pool either free or cached by a record.
inline void expectQuiescent(ContextCacheManager const& manager) {
  EXPECT_EQ(manager.liveLeaseCount(), 0);
  ResourcePools const& pools = manager.pools();
  for (ResourceType type : kAllResourceTypes) {
    int32_t cached = 0;
    for (int32_t i = 0; i < pools.capacity(type); ++i) {
      EXPECT_EQ(pools.activeRefs({type, i}), 0);
      cached += pools.cacheRefs({type, i}) > 0 ? 1 : 0;
    }
    EXPECT_EQ(pools.freeCount(type) + cached, pools.capacity(type));
  }
}

/// Page conservation and reference bookkeeping of a manager:
/// * per pool: free + (pinned or cached) == capacity; a slot is in the free ring iff both counts
///   are 0; reclaimableCount == slots with cache > 0 and active == 0;
/// * every cache reference belongs to a record (counts equal the records' references);
/// * every index entry's page holds a cache reference, and every record base page is indexed
///   under the record's logical digest.
inline void expectManagerInvariants(ContextCacheManager const& manager) {
  ResourcePools const& pools = manager.pools();
  std::map<std::pair<int, int32_t>, int32_t> recordRefs;
  for (CacheRecord const& record : manager.records().lruToMru()) {
    record.forEachResource([&](ResourceId id) {
      ++recordRefs[{static_cast<int>(id.type), id.index}];
    });
    for (std::size_t b = 0; b < record.basePagePath.size(); ++b) {
      EXPECT_EQ(manager.index().digestOf(record.basePagePath[b]), record.logicalBlockDigests[b])
          << "record " << record.id << " block " << b;
    }
  }
  for (ResourceType type : kAllResourceTypes) {
    std::vector<int32_t> const freeList = pools.freeList(type);
    std::vector<char> inRing(static_cast<std::size_t>(pools.capacity(type)), 0);
    for (int32_t i : freeList) {
      ASSERT_GE(i, 0);
      ASSERT_LT(i, pools.capacity(type));
      EXPECT_EQ(inRing[static_cast<std::size_t>(i)], 0)
          << toString(type) << " " << i << " twice in the free ring";
      inRing[static_cast<std::size_t>(i)] = 1;
    }
    int32_t used = 0;
    int32_t reclaimable = 0;
    for (int32_t i = 0; i < pools.capacity(type); ++i) {
      int32_t const active = pools.activeRefs({type, i});
      int32_t const cache = pools.cacheRefs({type, i});
      EXPECT_GE(active, 0);
      EXPECT_GE(cache, 0);
      bool const free = active == 0 && cache == 0;
      EXPECT_EQ(free, inRing[static_cast<std::size_t>(i)] == 1) << toString(type) << " " << i;
      used += free ? 0 : 1;
      reclaimable += (cache > 0 && active == 0) ? 1 : 0;
      auto const it = recordRefs.find({static_cast<int>(type), i});
      EXPECT_EQ(cache, it == recordRefs.end() ? 0 : it->second) << toString(type) << " " << i;
    }
    EXPECT_EQ(pools.freeCount(type), static_cast<int32_t>(freeList.size()));
    EXPECT_EQ(pools.freeCount(type) + used, pools.capacity(type)) << toString(type);
    EXPECT_EQ(pools.reclaimableCount(type), reclaimable) << toString(type);
  }
  int32_t indexed = 0;
  for (int32_t page = 0; page < pools.capacity(ResourceType::kBaseKvPage); ++page) {
    if (std::optional<Hash128> const digest = manager.index().digestOf(page)) {
      ++indexed;
      EXPECT_GT(pools.cacheRefs({ResourceType::kBaseKvPage, page}), 0)
          << "indexed page " << page << " has no cache reference";
      EXPECT_EQ(manager.index().find(*digest), page);
    }
  }
  EXPECT_EQ(indexed, manager.index().size());
}

}  // namespace mkv::test

namespace mkv::test {

/// admit that must succeed.
inline CacheRequestLease admit(ContextCacheManager& manager, LookupRequest const& request) {
  AdmissionResult result = manager.admit(request);
  EXPECT_TRUE(result.lease.has_value()) << "admission refused";
  return result.lease ? std::move(*result.lease) : CacheRequestLease{};
}

/// Publishes the full blocks of `tokens` (resident length = all of them) through `lease`.
inline PublishResult publishTokens(ContextCacheManager& manager, CacheRequestLease& lease,
                                   std::vector<int32_t> const& tokens, BlockKeyExtras extras = {},
                                   int32_t residentLength = -1) {
  PromptBlocks const blocks = hashPromptBlocks(viewOf(tokens, extras), manager.pageSize());
  return manager.publish(lease, blocks,
                         residentLength < 0 ? static_cast<int32_t>(tokens.size()) : residentLength);
}

/// A cold producer: admit `tokens`, publish every full block, release. Returns the record.
inline RecordId publishCold(ContextCacheManager& manager, std::vector<int32_t> const& tokens,
                            ReuseMode mode = ReuseMode::kVanilla, BlockKeyExtras extras = {}) {
  LookupRequest request = requestOf(tokens, mode, ContextCacheLookupPolicy::kBypass, extras);
  CacheRequestLease lease = admit(manager, request);
  return publishTokens(manager, lease, tokens, extras).record;
}

/// A hybrid (or Hybrid+MTP) producer: admit `tokens`, capture a checkpoint at `length`, release.
inline PublishResult publishCheckpointOf(ContextCacheManager& manager,
                                         std::vector<int32_t> const& tokens, int32_t length,
                                         ReuseMode mode = ReuseMode::kHybrid,
                                         bool hasAttention = true) {
  LookupRequest request = requestOf(tokens, mode, ContextCacheLookupPolicy::kBypass);
  request.hasAttention = hasAttention;
  CacheRequestLease lease = admit(manager, request);
  int32_t const page = manager.pageSize();
  bool const partial = mode == ReuseMode::kHybridMtp || (hasAttention && length % page != 0);
  std::optional<SnapshotReservation> const reservation =
      manager.reserveHybridSnapshots(lease, partial);
  EXPECT_TRUE(reservation.has_value());
  PromptBlocks const blocks = hashPromptBlocks(viewOf(tokens), page);
  PublishResult result = mode == ReuseMode::kHybridMtp
                             ? manager.publishHybridMtp(lease, blocks, length, *reservation)
                             : manager.publishHybrid(lease, blocks, length, *reservation);
  manager.retireHybridSnapshotReservation(lease, *reservation);
  return result;
}

}  // namespace mkv::test
