#include "context_cache/context_cache_manager.h"

#include <gtest/gtest.h>

#include "context_cache_test_support.h"
#include "mkv/error.h"
#include "support/test_util.h"

namespace mkv {
namespace {

using test::admit;
using test::captureState;
using test::concatenated;
using test::expectManagerInvariants;
using test::publishCheckpointOf;
using test::publishCold;
using test::publishTokens;
using test::requestOf;
using test::tokenRun;
using test::viewOf;

constexpr int32_t kPage = 4;
constexpr ResourceId basePage(PageId p) { return {ResourceType::kBaseKvPage, p}; }
constexpr ResourceId draftPage(PageId p) { return {ResourceType::kDraftKvPage, p}; }

ContextCacheManagerOptions eagleOptions() {
  ContextCacheManagerOptions options;
  options.specContract = SpecReuseContract{true, 1};
  return options;
}

std::vector<PageId> pagesOf(CacheRequestLease const& lease) {
  return {lease.basePages().begin(), lease.basePages().end()};
}
std::vector<PageId> draftOf(CacheRequestLease const& lease) {
  return {lease.draftPages().begin(), lease.draftPages().end()};
}
std::vector<RecordId> lruIds(ContextCacheManager const& m) {
  std::vector<RecordId> ids;
  for (CacheRecord const& r : m.records().lruToMru()) {
    ids.push_back(r.id);
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Acquisition

TEST(ContextCacheManagerTest, AcquirePinsHitsBeforeEvictionAndAllocatesPrivatePages) {
  ContextCacheManager m(kPage, {3, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  RecordId const ra = publishCold(m, a);  // pages 0, 1
  publishCold(m, tokenRun(4, 100));       // page 2
  ASSERT_EQ(m.pools().freeCount(ResourceType::kBaseKvPage), 0);

  AdmissionResult admitted = m.admit(requestOf(concatenated(a, {1, 2})));
  ASSERT_TRUE(admitted.lease);
  EXPECT_EQ(admitted.outcome, AdmissionOutcome::kAcquired);
  EXPECT_EQ(admitted.plan.reuseTokenLength, 8);
  // The hit was pinned first, so eviction could not hand its pages out again.
  EXPECT_EQ(pagesOf(*admitted.lease), (std::vector<PageId>{0, 1, 2}));
  EXPECT_EQ(admitted.lease->boundBasePageCount(), 2);
  EXPECT_EQ(m.pools().activeRefs(basePage(0)), 1);
  EXPECT_NE(m.records().get(ra), nullptr)
      << "the LRU record's pages are all pinned by the hit: evicting it would free nothing";
  EXPECT_EQ(m.metrics().evictedRecords, 1U);
  EXPECT_EQ(m.metrics().reclaimed(ResourceType::kBaseKvPage), 1U) << "only page 2 was freed";
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, BypassAcquireBuildsAForcedColdPlan) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  AdmissionResult bypass =
      m.admit(requestOf(a, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  ASSERT_TRUE(bypass.lease);
  EXPECT_EQ(bypass.plan.kind, ReusePlanKind::kNoReusablePrefix);
  EXPECT_EQ(bypass.lease->boundBasePageCount(), 0);
  EXPECT_EQ(pagesOf(*bypass.lease).size(), 2U);
  EXPECT_FALSE(bypass.missReason.has_value());
  ContextCacheMetrics const metrics = m.metrics();
  EXPECT_EQ(metrics.bypasses, 2U) << "the producer was on bypass too";
  EXPECT_EQ(metrics.lookups, 0U);
  EXPECT_EQ(metrics.hits, 0U);
}

TEST(ContextCacheManagerTest, InfeasibleAcquireRollsBackPinsWithoutEviction) {
  ContextCacheManager m(kPage, {4, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  CacheRequestLease holder = admit(m, requestOf(tokenRun(8, 50)));  // pages 2, 3 held
  test::ManagerState const before = captureState(m);
  ContextCacheMetrics const metricsBefore = m.metrics();
  LookupResult const looked = m.lookup(requestOf(concatenated(a, tokenRun(8, 200))));
  ASSERT_EQ(looked.plan.demand.baseKvPages, 2);
  AcquireResult const refused = m.acquire(looked.plan);
  EXPECT_FALSE(refused.lease.has_value());
  EXPECT_EQ(refused.status, AcquireStatus::kInsufficientCapacity);
  EXPECT_EQ(captureState(m), before) << "pins undone, nothing evicted";
  EXPECT_EQ(m.metrics().evictedRecords, metricsBefore.evictedRecords);
  EXPECT_EQ(m.liveLeaseCount(), 1);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, CapacityFailureOfACacheDerivedPlanIsRefusedWithoutAColdRetry) {
  ContextCacheManager m(kPage, {4, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(12, 0);
  publishCold(m, a);  // pages 0..2, page 3 free
  std::vector<int32_t> const tokens = concatenated(a, tokenRun(2, 300));
  LookupRequest request = requestOf(tokens);
  request.baseExtraTokens = 3;  // 17 tokens -> 5 pages: 3 bound + 2 private > 4
  AdmissionResult const refused = m.admit(request);
  EXPECT_EQ(refused.outcome, AdmissionOutcome::kInsufficientCapacity);
  EXPECT_FALSE(refused.lease);
  EXPECT_TRUE(refused.plan.isCacheDerived()) << "the looked-up plan, not a cold retry's";
  EXPECT_EQ(refused.plan.matchedTokenLength, 12);
  EXPECT_EQ(refused.missReason, MissReason::kCapacity);
  ContextCacheMetrics metrics = m.metrics();
  EXPECT_EQ(metrics.failedAcquisitions, 1U);
  EXPECT_EQ(metrics.missCount(MissReason::kCapacity), 1U);
  EXPECT_EQ(metrics.evictedRecords, 0U) << "neither attempt evicted anything";
  EXPECT_EQ(m.records().size(), 1U);

  // A cold plan that fails is not retried.
  AdmissionResult const cold = m.admit(requestOf(tokenRun(20, 700)));
  EXPECT_EQ(cold.outcome, AdmissionOutcome::kInsufficientCapacity);
  metrics = m.metrics();
  EXPECT_EQ(metrics.failedAcquisitions, 2U);
  EXPECT_EQ(metrics.missCount(MissReason::kCapacity), 2U);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, LeaseDestructorReleasesEveryUnpublishedResource) {
  ContextCacheManager m(kPage, {6, 6, 2, 2}, 8);
  std::vector<int32_t> const a = tokenRun(9, 0);
  publishCheckpointOf(m, a, 6);  // hybrid record: 1 page, recurrent + partial
  {
    std::vector<int32_t> const tokens = concatenated(a, {5});
    LookupRequest const request = requestOf(tokens, ReuseMode::kHybrid);
    CacheRequestLease lease = admit(m, request);
    ASSERT_TRUE(lease.recurrentSnapshotSlot().has_value());
    ASSERT_TRUE(m.reserveHybridSnapshots(lease, true).has_value());
    ASSERT_TRUE(m.growBasePages(lease, 2));
    EXPECT_EQ(m.liveLeaseCount(), 1);
  }
  EXPECT_EQ(m.liveLeaseCount(), 0);
  EXPECT_EQ(m.pools().freeCounts(), (ResourceDemand{5, 6, 1, 1}))
      << "only the record's page and snapshots stay";
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerDeathTest, DestroyingTheManagerWithLiveLeasesTerminates) {
  EXPECT_DEATH(
      {
        std::optional<CacheRequestLease> lease;
        ContextCacheManager m(kPage, {4, 0, 0, 0}, 8);
        lease = admit(m, requestOf(tokenRun(5, 0)));
      },
      "live leases");
}

TEST(ContextCacheManagerTest, StalePlansAreRejected) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 1);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  LookupResult const looked = m.lookup(requestOf(concatenated(a, {1})));
  ASSERT_EQ(looked.plan.reuseTokenLength, 8);
  publishCold(m, tokenRun(4, 70));  // record limit 1 evicts a's record
  test::ManagerState const before = captureState(m);
  EXPECT_THROW(m.acquire(looked.plan), Error);
  EXPECT_EQ(captureState(m), before);
  EXPECT_EQ(m.liveLeaseCount(), 0);
}

TEST(ContextCacheManagerTest, RejectsMalformedRequests) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const empty;
  EXPECT_THROW(m.lookup(requestOf(empty)), Error);
  EXPECT_THROW(m.lookup(requestOf(tokenRun(4, 0), ReuseMode::kSpec)), Error) << "no contract";
  LookupRequest pure = requestOf(tokenRun(4, 0), ReuseMode::kVanilla);
  pure.hasAttention = false;
  EXPECT_THROW(m.lookup(pure), Error);
  LookupRequest draftHeadroom = requestOf(tokenRun(4, 0));
  draftHeadroom.draftExtraTokens = 2;
  EXPECT_THROW(m.lookup(draftHeadroom), Error);
  LookupRequest negative = requestOf(tokenRun(4, 0));
  negative.baseExtraTokens = -1;
  EXPECT_THROW(m.admit(negative), Error);
  EXPECT_EQ(m.metrics().lookups, 0U);
  EXPECT_THROW(ContextCacheManager(0, {1, 0, 0, 0}, 1), Error);
  EXPECT_THROW(ContextCacheManager(kPage, {-1, 0, 0, 0}, 1), Error);
  EXPECT_THROW(ContextCacheManager(kPage, {1, 0, 0, 0}, -1), Error);
}

// ---------------------------------------------------------------------------------------------
// Publication

TEST(ContextCacheManagerTest, PublishAddsCacheRefsBeforeDroppingActivity) {
  ContextCacheManager m(kPage, {4, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(10, 0);
  CacheRequestLease lease = admit(m, requestOf(a));
  PublishResult const published = publishTokens(m, lease, a);
  EXPECT_EQ(published.status, PublishStatus::kPublished);
  EXPECT_EQ(published.publishedFullBlockCount, 2);
  for (PageId p : published.canonicalBasePages) {
    EXPECT_EQ(m.pools().activeRefs(basePage(p)), 1);
    EXPECT_EQ(m.pools().cacheRefs(basePage(p)), 1);
  }
  PageId const tail = lease.basePages()[2];
  lease.release();
  EXPECT_EQ(m.pools().cacheRefs(basePage(published.canonicalBasePages[0])), 1);
  EXPECT_FALSE(m.pools().isFree(basePage(published.canonicalBasePages[0])));
  EXPECT_TRUE(m.pools().isFree(basePage(tail))) << "the unpublished tail page returned";
  expectManagerInvariants(m);
}

/// Publishes the first `tokens` tokens of `prompt` through `lease` as `kind`.
PublishResult publishPrefix(ContextCacheManager& m, CacheRequestLease& lease,
                            std::vector<int32_t> const& prompt, int32_t tokens, Publication kind) {
  PromptBlocks const blocks = hashPromptBlocks(viewOf(prompt), m.pageSize());
  return m.publish(lease, blocks, tokens, kind);
}

TEST(ContextCacheManagerTest, AChunkRecordIsReplacedByTheSequencesNextPublication) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const prompt = tokenRun(14, 0);
  CacheRequestLease lease = admit(m, requestOf(prompt));
  PublishResult const first = publishPrefix(m, lease, prompt, 5, Publication::kChunk);
  PublishResult const second = publishPrefix(m, lease, prompt, 9, Publication::kChunk);
  ASSERT_EQ(first.status, PublishStatus::kPublished);
  ASSERT_EQ(second.status, PublishStatus::kPublished);
  EXPECT_EQ(m.records().get(first.record), nullptr) << "replaced by the second chunk's record";
  PublishResult const last = publishPrefix(m, lease, prompt, 14, Publication::kLasting);
  EXPECT_EQ(m.records().get(second.record), nullptr);
  ASSERT_NE(m.records().get(last.record), nullptr);
  EXPECT_EQ(m.records().size(), 1U) << "the records a prefill in one step leaves";
  ContextCacheMetrics const metrics = m.metrics();
  EXPECT_EQ(metrics.publishedRecords, 3U);
  EXPECT_EQ(metrics.replacedChunkRecords, 2U);
  EXPECT_EQ(metrics.evictedRecords, 0U) << "a replacement is not an eviction";
  EXPECT_EQ(m.index().size(), 3) << "every block stays indexed through the last record";
  for (PageId page : last.canonicalBasePages) {
    EXPECT_EQ(m.pools().cacheRefs(basePage(page)), 1);
  }
  lease.release();
  EXPECT_EQ(m.lookup(requestOf(concatenated(prompt, {1}))).plan.reuseTokenLength, 12);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, AMovedLeaseKeepsItsPendingChunkRecord) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const prompt = tokenRun(12, 0);
  CacheRequestLease lease = admit(m, requestOf(prompt));
  PublishResult const chunk = publishPrefix(m, lease, prompt, 4, Publication::kChunk);
  std::vector<CacheRequestLease> rows;  // a batch's sequences move when their vector grows
  rows.push_back(std::move(lease));
  publishPrefix(m, rows.back(), prompt, 12, Publication::kLasting);
  EXPECT_EQ(m.records().get(chunk.record), nullptr);
  EXPECT_EQ(m.metrics().replacedChunkRecords, 1U);
}

TEST(ContextCacheManagerTest, AChunkRecordStaysWhenThePrefillEndsWhereItsLastChunkEnded) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const prompt = tokenRun(13, 0);
  CacheRequestLease lease = admit(m, requestOf(prompt));
  PublishResult const chunk = publishPrefix(m, lease, prompt, 12, Publication::kChunk);
  ASSERT_EQ(chunk.status, PublishStatus::kPublished);
  // The prompt's end adds no full block: RequestMode::publishBlocks settles the chunk's record.
  m.settlePublications(lease);
  PublishResult const decodeEnd =
      publishPrefix(m, lease, concatenated(prompt, tokenRun(4, 100)), 17, Publication::kLasting);
  ASSERT_EQ(decodeEnd.status, PublishStatus::kPublished);
  EXPECT_NE(m.records().get(chunk.record), nullptr) << "the prompt's record, as without chunks";
  EXPECT_EQ(m.records().size(), 2U);
  EXPECT_EQ(m.metrics().replacedChunkRecords, 0U);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, AChunkRecordThatIsNotAPrefixOfTheNextPublicationStays) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const prompt = tokenRun(12, 0);
  CacheRequestLease lease = admit(m, requestOf(prompt));
  std::vector<RetentionRange> const kept{{0, 4, kMaxRetentionPriority, std::nullopt}};
  std::vector<int32_t> const otherPrompt = tokenRun(12, 50);  // the request's view reads it
  LookupRequest retained = requestOf(otherPrompt);
  retained.retention = kept;
  CacheRequestLease other = admit(m, retained);
  // Another sequence's chunk record is not this lease's to replace; a chunk whose record has
  // another retention than the next publication's stays too.
  PublishResult const foreign = publishPrefix(m, other, otherPrompt, 4, Publication::kChunk);
  PublishResult const mine = publishPrefix(m, lease, prompt, 8, Publication::kChunk);
  publishPrefix(m, lease, prompt, 12, Publication::kLasting);
  EXPECT_NE(m.records().get(foreign.record), nullptr);
  EXPECT_EQ(m.records().get(mine.record), nullptr);
  PublishResult const longer = publishPrefix(m, other, otherPrompt, 12, Publication::kLasting);
  ASSERT_EQ(longer.status, PublishStatus::kPublished);
  EXPECT_NE(m.records().get(foreign.record), nullptr)
      << "priority " << kMaxRetentionPriority << " on the chunk, the default on the whole prompt";
  EXPECT_EQ(m.metrics().replacedChunkRecords, 1U);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, AChunkRecordIsReplacedWhenTheNextPublicationIsAlreadyCached) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const prompt = tokenRun(8, 0);
  CacheRequestLease producer =
      admit(m, requestOf(prompt, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  CacheRequestLease chunked =
      admit(m, requestOf(prompt, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  PublishResult const chunk = publishPrefix(m, chunked, prompt, 4, Publication::kChunk);
  PublishResult const whole = publishPrefix(m, producer, prompt, 8, Publication::kLasting);
  PublishResult const again = publishPrefix(m, chunked, prompt, 8, Publication::kLasting);
  EXPECT_EQ(again.status, PublishStatus::kExistingRecord);
  EXPECT_EQ(m.records().get(chunk.record), nullptr) << "its pages are the cached record's";
  EXPECT_NE(m.records().get(whole.record), nullptr);
  EXPECT_EQ(m.records().size(), 1U);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, PublicationProjectsCanonicalOverlapWithoutRebindingLease) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  CacheRequestLease first =
      admit(m, requestOf(a, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  CacheRequestLease second =
      admit(m, requestOf(concatenated(a, tokenRun(4, 40)), ReuseMode::kVanilla,
                         ContextCacheLookupPolicy::kBypass));
  publishTokens(m, first, a);
  std::vector<PageId> const secondPages = pagesOf(second);
  PublishResult const projected = publishTokens(m, second, concatenated(a, tokenRun(4, 40)));
  EXPECT_EQ(projected.status, PublishStatus::kPublished);
  EXPECT_EQ(projected.canonicalBasePages,
            (std::vector<PageId>{pagesOf(first)[0], pagesOf(first)[1], secondPages[2]}))
      << "first producer stays canonical for the overlap";
  EXPECT_EQ(pagesOf(second), secondPages) << "the lease keeps its private duplicates";
  EXPECT_EQ(m.pools().cacheRefs(basePage(secondPages[0])), 0);
  second.release();
  EXPECT_TRUE(m.pools().isFree(basePage(secondPages[0])));
  EXPECT_FALSE(m.pools().isFree(basePage(secondPages[2])));
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, LaterPublicationUsesCanonicalPageChosenByEarlierProducer) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(4, 0);
  publishCold(m, a);
  PageId const canonical = *m.index().find(hashFullBlocks(viewOf(a), kPage)[0]);
  CacheRequestLease late =
      admit(m, requestOf(a, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  ASSERT_NE(pagesOf(late)[0], canonical);
  PublishResult const dup = publishTokens(m, late, a);
  EXPECT_EQ(dup.status, PublishStatus::kExistingRecord);
  EXPECT_EQ(dup.canonicalBasePages, (std::vector<PageId>{canonical}));
  EXPECT_EQ(*m.index().find(hashFullBlocks(viewOf(a), kPage)[0]), canonical);
}

TEST(ContextCacheManagerTest, ExactDuplicatePublicationMovesExistingRecordToMru) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(4, 0);
  RecordId const ra = publishCold(m, a);
  RecordId const rb = publishCold(m, tokenRun(4, 10));
  EXPECT_EQ(lruIds(m), (std::vector<RecordId>{ra, rb}));
  EXPECT_EQ(publishCold(m, a), ra);
  EXPECT_EQ(lruIds(m), (std::vector<RecordId>{rb, ra}));
  EXPECT_EQ(m.metrics().existingRecordsTouched, 1U);
  EXPECT_EQ(m.metrics().publishedRecords, 2U);
}

TEST(ContextCacheManagerTest, ExistingRecordPublicationDoesNotRebindActiveLease) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  CacheRequestLease lease =
      admit(m, requestOf(a, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  std::vector<PageId> const before = pagesOf(lease);
  EXPECT_EQ(publishTokens(m, lease, a).status, PublishStatus::kExistingRecord);
  EXPECT_EQ(pagesOf(lease), before);
  for (PageId p : before) {
    EXPECT_EQ(m.pools().cacheRefs(basePage(p)), 0);
    EXPECT_EQ(m.pools().activeRefs(basePage(p)), 1);
  }
}

TEST(ContextCacheManagerTest, PublicationRejectsConflictingMappingWithoutChange) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(4, 0);
  std::vector<int32_t> const b = tokenRun(4, 60);
  CacheRequestLease lease =
      admit(m, requestOf(a, ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  publishTokens(m, lease, a);
  test::ManagerState const before = captureState(m);
  // The lease's page 0 is indexed under a's digest; it cannot hold b's block too.
  EXPECT_THROW(publishTokens(m, lease, b), Error);
  EXPECT_EQ(captureState(m), before);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, PublicationMustAgreeWithTheReusedPrefix) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  CacheRequestLease hit = admit(m, requestOf(concatenated(a, {1})));
  ASSERT_EQ(hit.boundBasePageCount(), 2);
  std::vector<int32_t> other = concatenated(a, {1});
  other[0] = 77;
  EXPECT_THROW(publishTokens(m, hit, other), Error);
  EXPECT_THROW(publishTokens(m, hit, a, {}, 3), Error) << "resident length below one page";
  std::vector<int32_t> const longer = concatenated(a, tokenRun(8, 500));
  EXPECT_THROW(publishTokens(m, hit, longer), Error) << "4 blocks but the lease holds 3 pages";
  EXPECT_EQ(publishTokens(m, hit, longer, {}, 12).publishedFullBlockCount, 3);
}

TEST(ContextCacheManagerTest, RecordLimitEvictsTheLruRecord) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 2);
  RecordId const r1 = publishCold(m, tokenRun(4, 0));
  RecordId const r2 = publishCold(m, tokenRun(4, 10));
  RecordId const r3 = publishCold(m, tokenRun(4, 20));
  EXPECT_EQ(lruIds(m), (std::vector<RecordId>{r2, r3}));
  EXPECT_EQ(m.records().get(r1), nullptr);
  EXPECT_EQ(m.pools().freeCount(ResourceType::kBaseKvPage), 6);
  EXPECT_EQ(m.metrics().evictedRecords, 1U);

  ContextCacheManager none(kPage, {8, 0, 0, 0}, 0);
  std::vector<int32_t> const a = tokenRun(8, 0);
  CacheRequestLease lease = admit(none, requestOf(a));
  PublishResult const result = publishTokens(none, lease, a);
  EXPECT_EQ(result.status, PublishStatus::kPublished);
  EXPECT_EQ(result.record, kNoRecord) << "maxRecords 0 keeps nothing";
  EXPECT_TRUE(none.records().empty());
  EXPECT_EQ(none.index().size(), 0);
  lease.release();
  EXPECT_EQ(none.pools().freeCount(ResourceType::kBaseKvPage), 8);
  EXPECT_EQ(none.lookup(requestOf(concatenated(a, {1}))).plan.reuseTokenLength, 0);
}

TEST(ContextCacheManagerTest, EvictingOneBranchPreservesSharedAncestorPages) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 1);  // the limit evicts the first branch
  std::vector<int32_t> const trunk = tokenRun(4, 0);
  RecordId const left = publishCold(m, concatenated(trunk, tokenRun(4, 100)));
  PageId const shared = m.records().get(left)->basePagePath[0];
  CacheRequestLease hit = admit(m, requestOf(concatenated(trunk, tokenRun(5, 200))));
  EXPECT_EQ(pagesOf(hit)[0], shared);
  publishTokens(m, hit, concatenated(trunk, tokenRun(5, 200)));
  hit.release();
  EXPECT_EQ(m.records().get(left), nullptr);
  EXPECT_EQ(m.pools().cacheRefs(basePage(shared)), 1) << "kept by the surviving branch";
  EXPECT_EQ(m.lookup(requestOf(concatenated(trunk, {9}))).plan.reuseTokenLength, 4);
  EXPECT_EQ(m.lookup(requestOf(concatenated(trunk, tokenRun(5, 100)))).plan.reuseTokenLength, 4)
      << "the evicted branch's own block is gone";
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, BlockHitDoesNotTouchOwningRecordRecency) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  RecordId const ra = publishCold(m, a);
  RecordId const rb = publishCold(m, tokenRun(4, 50));
  CacheRequestLease hit = admit(m, requestOf(concatenated(a, {1})));
  EXPECT_EQ(hit.boundBasePageCount(), 2);
  EXPECT_EQ(lruIds(m), (std::vector<RecordId>{ra, rb}));
}

TEST(ContextCacheManagerTest, EvictionMetricsCountOnlyResourcesReturnedToFreeLists) {
  ContextCacheManager m(kPage, {4, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);                                                  // pages 0, 1
  CacheRequestLease pin = admit(m, requestOf(concatenated(a, {1})));  // pins 0, 1; takes page 2
  publishCold(m, tokenRun(4, 40));                                    // page 3
  // One more page: a's record is the LRU one, but every page of it is pinned, so the walk passes
  // over it (evicting it would free nothing and drop blocks the pin never publishes again); the
  // other record goes and page 3 returns.
  AdmissionResult const big = m.admit(requestOf(tokenRun(4, 80)));
  ASSERT_TRUE(big.lease);
  ContextCacheMetrics const metrics = m.metrics();
  EXPECT_EQ(metrics.evictedRecords, 1U);
  EXPECT_EQ(metrics.reclaimed(ResourceType::kBaseKvPage), 1U);
  EXPECT_EQ(m.index().size(), 2) << "a's blocks stay findable while they are pinned";
  EXPECT_EQ(m.lookup(requestOf(concatenated(a, {2}))).plan.reuseTokenLength, 8);
  EXPECT_EQ(m.pools().activeRefs(basePage(0)), 1);
}

// ---------------------------------------------------------------------------------------------
// Growth

TEST(ContextCacheManagerTest, DynamicGrowthAtomicallyAddsRequestedPages) {
  ContextCacheManager m(kPage, {5, 0, 0, 0}, 8);
  CacheRequestLease lease = admit(m, requestOf(tokenRun(4, 0)));
  publishCold(m, tokenRun(4, 30));  // one evictable page
  test::ManagerState const before = captureState(m);
  EXPECT_FALSE(m.growBasePages(lease, 5));
  EXPECT_EQ(captureState(m), before) << "nothing evicted for an impossible growth";
  EXPECT_TRUE(m.growBasePages(lease, 0));
  EXPECT_TRUE(m.growBasePages(lease, 4));
  EXPECT_EQ(pagesOf(lease).size(), 5U);
  EXPECT_TRUE(m.records().empty()) << "growth evicted the record";
  EXPECT_THROW(m.growBasePages(lease, -1), Error);
  EXPECT_THROW(m.growSpecPages(lease, 1, 0), Error) << "vanilla lease";
  expectManagerInvariants(m);
}

// ---------------------------------------------------------------------------------------------
// Hybrid checkpoints

TEST(ContextCacheManagerTest, StandardPublicationRejectsHybridLease) {
  ContextCacheManager m(kPage, {8, 0, 2, 2}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  CacheRequestLease lease = admit(m, requestOf(a, ReuseMode::kHybrid));
  EXPECT_THROW(publishTokens(m, lease, a), Error);
  std::optional<SnapshotReservation> const r = m.reserveHybridSnapshots(lease, false);
  ASSERT_TRUE(r);
  EXPECT_THROW(m.publishHybridMtp(lease, hashPromptBlocks(viewOf(a), kPage), 8, *r), Error);
  CacheRequestLease vanilla = admit(m, requestOf(a));
  EXPECT_THROW(m.reserveHybridSnapshots(vanilla, false), Error);
  EXPECT_THROW(m.publishHybrid(vanilla, hashPromptBlocks(viewOf(a), kPage), 8, *r), Error);
}

TEST(ContextCacheManagerTest, HybridCheckpointPublishesAndAcquiresAllStateAtomically) {
  ContextCacheManager m(kPage, {8, 0, 2, 2}, 8);
  std::vector<int32_t> const a = tokenRun(9, 0);
  LookupRequest const request = requestOf(a, ReuseMode::kHybrid);
  CacheRequestLease producer = admit(m, request);
  std::optional<SnapshotReservation> const reservation = m.reserveHybridSnapshots(producer, true);
  ASSERT_TRUE(reservation && reservation->partialKvSlot);
  PromptBlocks const blocks = hashPromptBlocks(viewOf(a), kPage);
  EXPECT_THROW(m.publishHybrid(producer, blocks, 8, *reservation), Error)
      << "an aligned checkpoint must not carry a partial snapshot";
  PublishResult const published = m.publishHybrid(producer, blocks, 6, *reservation);
  ASSERT_EQ(published.status, PublishStatus::kPublished);
  m.retireHybridSnapshotReservation(producer, *reservation);
  EXPECT_EQ(m.pools().activeRefs({ResourceType::kRecurrentSnapshot, reservation->recurrentSlot}),
            0);
  EXPECT_EQ(m.pools().cacheRefs({ResourceType::kRecurrentSnapshot, reservation->recurrentSlot}), 1);
  EXPECT_THROW(m.retireHybridSnapshotReservation(producer, *reservation), Error);
  producer.release();

  AdmissionResult consumer =
      m.admit(requestOf(concatenated(tokenRun(6, 0), {1, 2}), ReuseMode::kHybrid));
  ASSERT_TRUE(consumer.lease);
  EXPECT_EQ(consumer.plan.reuseTokenLength, 6);
  EXPECT_EQ(consumer.lease->recurrentSnapshotSlot(), reservation->recurrentSlot);
  EXPECT_EQ(consumer.lease->partialKvSnapshotSlot(), reservation->partialKvSlot);
  EXPECT_EQ(pagesOf(*consumer.lease)[0], published.canonicalBasePages[0]);
  EXPECT_EQ(pagesOf(*consumer.lease).size(), 2U);
  EXPECT_EQ(m.pools().activeRefs({ResourceType::kRecurrentSnapshot, reservation->recurrentSlot}),
            1);
  m.releaseRestoredHybridSnapshots(*consumer.lease);
  m.releaseRestoredHybridSnapshots(*consumer.lease);  // idempotent
  EXPECT_EQ(m.pools().activeRefs({ResourceType::kRecurrentSnapshot, reservation->recurrentSlot}),
            0);
  EXPECT_FALSE(consumer.lease->recurrentSnapshotSlot().has_value());
  EXPECT_EQ(m.metrics().hits, 1U);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, HybridMtpCheckpointPublishesAndAcquiresPairedBaseAndDraftState) {
  ContextCacheManager m(kPage, {8, 8, 2, 2}, 8);
  std::vector<int32_t> const a = tokenRun(9, 0);
  CacheRequestLease producer = admit(m, requestOf(a, ReuseMode::kHybridMtp));
  EXPECT_EQ(pagesOf(producer).size(), 3U);
  EXPECT_EQ(draftOf(producer).size(), 3U);
  std::optional<SnapshotReservation> const reservation = m.reserveHybridSnapshots(producer, true);
  ASSERT_TRUE(reservation);
  PromptBlocks const blocks = hashPromptBlocks(viewOf(a), kPage);
  PublishResult const published = m.publishHybridMtp(producer, blocks, 8, *reservation);
  ASSERT_EQ(published.status, PublishStatus::kPublished);
  CacheRecord const* record = m.records().get(published.record);
  EXPECT_EQ(record->key.fullBlockCount, 1) << "(8 - 1) / 4: the boundary token stays private";
  EXPECT_EQ(record->specState->draftPagePath, (std::vector<PageId>{draftOf(producer)[0]}));
  m.retireHybridSnapshotReservation(producer, *reservation);
  producer.release();

  AdmissionResult consumer = m.admit(requestOf(a, ReuseMode::kHybridMtp));
  ASSERT_TRUE(consumer.lease);
  EXPECT_EQ(consumer.plan.reuseTokenLength, 8);
  EXPECT_EQ(consumer.lease->boundBasePageCount(), 1);
  EXPECT_EQ(consumer.lease->boundDraftPageCount(), 1);
  EXPECT_EQ(draftOf(*consumer.lease)[0], record->specState->draftPagePath[0]);
  EXPECT_EQ(pagesOf(*consumer.lease).size(), 3U);
  EXPECT_TRUE(m.growSpecPages(*consumer.lease, 1, 1));
  EXPECT_EQ(draftOf(*consumer.lease).size(), 4U);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, PureRecurrentCheckpointNeedsNoBaseOrPartialPage) {
  ContextCacheManager m(kPage, {0, 0, 1, 0}, 8);
  std::vector<int32_t> const a = tokenRun(3, 0);
  PublishResult const published = publishCheckpointOf(m, a, 3, ReuseMode::kHybrid, false);
  ASSERT_EQ(published.status, PublishStatus::kPublished);
  EXPECT_TRUE(published.canonicalBasePages.empty());
  std::vector<int32_t> const tokens = concatenated(a, {9});
  LookupRequest request = requestOf(tokens, ReuseMode::kHybrid);
  request.hasAttention = false;
  AdmissionResult consumer = m.admit(request);
  ASSERT_TRUE(consumer.lease);
  EXPECT_EQ(consumer.plan.reuseTokenLength, 3);
  EXPECT_TRUE(consumer.lease->basePages().empty());
  EXPECT_TRUE(consumer.lease->recurrentSnapshotSlot().has_value());
  EXPECT_THROW(m.reserveHybridSnapshots(*consumer.lease, true), Error) << "no attention";
  EXPECT_THROW(m.growBasePages(*consumer.lease, 1), Error);
  EXPECT_FALSE(m.reserveHybridSnapshots(*consumer.lease, false).has_value())
      << "the only slot is pinned by the restore";
}

TEST(ContextCacheManagerTest, HybridPublicationProjectsCanonicalOverlapAndRetainsDescendant) {
  ContextCacheManager m(kPage, {8, 0, 4, 4}, 1);
  std::vector<int32_t> const a = tokenRun(11, 0);
  PublishResult const first = publishCheckpointOf(m, a, 5);
  PublishResult const second = publishCheckpointOf(m, a, 10);  // limit 1 evicts the first
  ASSERT_EQ(second.status, PublishStatus::kPublished);
  EXPECT_EQ(second.canonicalBasePages[0], first.canonicalBasePages[0]);
  EXPECT_EQ(m.records().get(first.record), nullptr);
  EXPECT_EQ(m.pools().cacheRefs(basePage(first.canonicalBasePages[0])), 1);
  EXPECT_EQ(m.lookup(requestOf(a, ReuseMode::kHybrid)).plan.reuseTokenLength, 10);
  EXPECT_EQ(publishCheckpointOf(m, a, 10).status, PublishStatus::kExistingRecord);
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerTest, SnapshotPressureFailsTheReservationWithoutChange) {
  ContextCacheManager m(kPage, {8, 0, 1, 1}, 8);
  std::vector<int32_t> const a = tokenRun(9, 0);
  CacheRequestLease lease = admit(m, requestOf(a, ReuseMode::kHybrid));
  ASSERT_TRUE(m.reserveHybridSnapshots(lease, true));
  test::ManagerState const before = captureState(m);
  EXPECT_FALSE(m.reserveHybridSnapshots(lease, false).has_value());
  EXPECT_EQ(captureState(m), before);
  EXPECT_EQ(lease.snapshotReservations().size(), 1U);
}

// ---------------------------------------------------------------------------------------------
// Speculative paired state

class SpecManagerTest : public ::testing::Test {
 protected:
  ContextCacheManager mManager{kPage, ResourceDemand{8, 8, 0, 0}, 8, eagleOptions()};
  LookupRequest specRequest(std::vector<int32_t> const& tokens) const {
    return requestOf(tokens, ReuseMode::kSpec);
  }
};

TEST_F(SpecManagerTest, SpecAcquirePublishesPairedStateAndReplaysOneFullPage) {
  std::vector<int32_t> const a = tokenRun(12, 0);
  RecordId const producer = publishCold(mManager, a, ReuseMode::kSpec);
  CacheRecord const* record = mManager.records().get(producer);
  ASSERT_TRUE(record && record->specState);
  EXPECT_EQ(record->specState->draftPagePath.size(), 3U);

  AdmissionResult consumer = mManager.admit(specRequest(concatenated(a, {1})));
  ASSERT_TRUE(consumer.lease);
  EXPECT_EQ(consumer.plan.reuseTokenLength, 8);
  EXPECT_EQ(consumer.plan.specReplayMode, SpecReplayMode::kFullPage);
  EXPECT_EQ(consumer.lease->boundBasePageCount(), 2);
  EXPECT_EQ(consumer.lease->boundDraftPageCount(), 2);
  EXPECT_EQ(draftOf(*consumer.lease)[1], record->specState->draftPagePath[1]);
  EXPECT_EQ(pagesOf(*consumer.lease).size(), 4U);
  EXPECT_EQ(draftOf(*consumer.lease).size(), 4U);
  EXPECT_EQ(mManager.metrics().specFullPageReplays, 1U);
  EXPECT_EQ(consumer.lease->hitRecord(), producer);
}

TEST_F(SpecManagerTest, BaseOnlyHitAllocatesColdPairedState) {
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(mManager, a);  // vanilla on a spec deployment: base only
  AdmissionResult consumer = mManager.admit(specRequest(concatenated(a, {1})));
  ASSERT_TRUE(consumer.lease);
  EXPECT_EQ(consumer.plan.reuseTokenLength, 0);
  EXPECT_EQ(consumer.lease->boundBasePageCount(), 0);
  EXPECT_EQ(draftOf(*consumer.lease).size(), 3U);
  EXPECT_EQ(consumer.missReason, MissReason::kNoPrefix);
}

TEST_F(SpecManagerTest, VanillaPublicationPreservesPairedRecordForLaterSpecReuse) {
  std::vector<int32_t> const a = tokenRun(8, 0);
  RecordId const paired = publishCold(mManager, a, ReuseMode::kSpec);
  EXPECT_EQ(publishCold(mManager, a), paired) << "vanilla duplicate touches the paired record";
  ASSERT_TRUE(mManager.records().get(paired)->specState);
  AdmissionResult vanilla = mManager.admit(requestOf(concatenated(a, {1})));
  ASSERT_TRUE(vanilla.lease);
  EXPECT_EQ(vanilla.plan.reuseTokenLength, 8) << "vanilla uses the base side without replay";
  EXPECT_TRUE(vanilla.lease->draftPages().empty());
  EXPECT_EQ(mManager.lookup(specRequest(concatenated(a, {1}))).plan.reuseTokenLength, 4);
}

TEST_F(SpecManagerTest, SpecDraftUpgradeUsesCanonicalProjectedBasePath) {
  std::vector<int32_t> const a = tokenRun(8, 0);
  RecordId const base = publishCold(mManager, a);
  std::vector<PageId> const canonical = mManager.records().get(base)->basePagePath;
  CacheRequestLease spec =
      admit(mManager, requestOf(a, ReuseMode::kSpec, ContextCacheLookupPolicy::kBypass));
  PublishResult const upgraded = publishTokens(mManager, spec, a);
  EXPECT_EQ(upgraded.status, PublishStatus::kSpecStateAttached);
  EXPECT_EQ(upgraded.record, base);
  EXPECT_EQ(upgraded.canonicalBasePages, canonical);
  CacheRecord const* record = mManager.records().get(base);
  EXPECT_EQ(record->basePagePath, canonical);
  EXPECT_EQ(record->specState->draftPagePath, draftOf(spec));
  for (PageId p : draftOf(spec)) {
    EXPECT_EQ(mManager.pools().cacheRefs(draftPage(p)), 1);
  }
  EXPECT_EQ(mManager.metrics().specUpgrades, 1U);
  EXPECT_EQ(publishTokens(mManager, spec, a).status, PublishStatus::kExistingRecord);
  expectManagerInvariants(mManager);
}

TEST_F(SpecManagerTest, EvictingUpgradedSpecRecordReleasesDraftIndexAndReferences) {
  std::vector<int32_t> const a = tokenRun(8, 0);
  RecordId const base = publishCold(mManager, a);
  {
    CacheRequestLease spec =
        admit(mManager, requestOf(a, ReuseMode::kSpec, ContextCacheLookupPolicy::kBypass));
    publishTokens(mManager, spec, a);
  }
  ASSERT_EQ(mManager.pools().freeCount(ResourceType::kDraftKvPage), 6);
  // Need all 8 base pages: the record must go, with its draft pages and spec-path entries.
  AdmissionResult big = mManager.admit(requestOf(tokenRun(32, 100)));
  ASSERT_TRUE(big.lease);
  EXPECT_EQ(mManager.records().get(base), nullptr);
  EXPECT_EQ(mManager.pools().freeCount(ResourceType::kDraftKvPage), 8);
  EXPECT_EQ(mManager.metrics().reclaimed(ResourceType::kDraftKvPage), 2U);
  EXPECT_FALSE(
      mManager.records().findLongestSpecPath(hashFullBlocks(viewOf(a), kPage), 2).has_value());
  expectManagerInvariants(mManager);
}

TEST_F(SpecManagerTest, SpecPublicationUsesCommonMaterializedBoundary) {
  std::vector<int32_t> const a = tokenRun(12, 0);
  CacheRequestLease spec =
      admit(mManager, requestOf(a, ReuseMode::kSpec, ContextCacheLookupPolicy::kBypass));
  PublishResult const published = publishTokens(mManager, spec, a, {}, /*common length*/ 9);
  EXPECT_EQ(published.publishedFullBlockCount, 2);
  EXPECT_EQ(mManager.records().get(published.record)->specState->draftPagePath.size(), 2U);
}

TEST_F(SpecManagerTest, SpecFullPageReplayPublishesProjectedBaseWithoutRebinding) {
  std::vector<int32_t> const a = tokenRun(12, 0);
  RecordId const producer = publishCold(mManager, a, ReuseMode::kSpec);
  std::vector<PageId> const producerBase = mManager.records().get(producer)->basePagePath;
  std::vector<int32_t> const longer = concatenated(a, tokenRun(4, 90));
  CacheRequestLease consumer = admit(mManager, specRequest(longer));
  std::vector<PageId> const leased = pagesOf(consumer);
  ASSERT_NE(leased[2], producerBase[2]) << "the replayed page is private";
  PublishResult const published = publishTokens(mManager, consumer, longer);
  EXPECT_EQ(published.status, PublishStatus::kPublished);
  EXPECT_EQ(published.canonicalBasePages,
            (std::vector<PageId>{producerBase[0], producerBase[1], producerBase[2], leased[3]}));
  EXPECT_EQ(pagesOf(consumer), leased);
  CacheRecord const* record = mManager.records().get(published.record);
  EXPECT_EQ(record->specState->draftPagePath, draftOf(consumer))
      << "draft paths are never canonicalised: one coherent producer path";
  expectManagerInvariants(mManager);
}

TEST_F(SpecManagerTest, SpecFullPageReplayRejectsPublicationBeforeDependencyBoundary) {
  std::vector<int32_t> const a = tokenRun(12, 0);
  publishCold(mManager, a, ReuseMode::kSpec);
  std::vector<int32_t> const longer = concatenated(a, {1});
  CacheRequestLease consumer = admit(mManager, specRequest(longer));
  ASSERT_TRUE(consumer.replayDependency().has_value());
  test::ManagerState const before = captureState(mManager);
  EXPECT_THROW(publishTokens(mManager, consumer, longer, {}, 8), Error);
  EXPECT_EQ(captureState(mManager), before);
  EXPECT_EQ(publishTokens(mManager, consumer, longer, {}, 12).status,
            PublishStatus::kExistingRecord);
}

TEST_F(SpecManagerTest, SpecFullPageReplayRejectsChangedBoundaryHash) {
  std::vector<int32_t> const a = tokenRun(12, 0);
  publishCold(mManager, a, ReuseMode::kSpec);
  CacheRequestLease consumer = admit(mManager, specRequest(concatenated(a, {1})));
  std::vector<int32_t> changed = concatenated(a, {1});
  changed[10] = -9;  // inside the replayed page: the bound prefix still agrees
  EXPECT_THROW(publishTokens(mManager, consumer, changed), Error);
}

TEST_F(SpecManagerTest, SpecGrowthIsAtomicAcrossBaseAndDraftPools) {
  ContextCacheManager m(kPage, ResourceDemand{8, 3, 0, 0}, 8, eagleOptions());
  CacheRequestLease lease = admit(m, specRequest(tokenRun(8, 0)));
  test::ManagerState const before = captureState(m);
  EXPECT_FALSE(m.growSpecPages(lease, 1, 2)) << "draft pool short";
  EXPECT_EQ(captureState(m), before);
  EXPECT_TRUE(m.growSpecPages(lease, 3, 1));
  EXPECT_EQ(pagesOf(lease).size(), 5U);
  EXPECT_EQ(draftOf(lease).size(), 3U);
  EXPECT_THROW(m.growBasePages(lease, 1), Error) << "paired lease";
}

TEST_F(SpecManagerTest, SpecHitIsTreatedAsMruDuringPressureEviction) {
  ContextCacheManager m(kPage, ResourceDemand{6, 6, 0, 0}, 8, eagleOptions());
  std::vector<int32_t> const a = tokenRun(8, 0);
  RecordId const hit = publishCold(m, a, ReuseMode::kSpec);  // LRU
  RecordId const other = publishCold(m, tokenRun(8, 50), ReuseMode::kSpec);
  ASSERT_EQ(lruIds(m), (std::vector<RecordId>{hit, other}));
  std::vector<int32_t> const tokens = concatenated(a, tokenRun(4, 300));
  LookupRequest request = specRequest(tokens);
  request.baseExtraTokens = 4;  // 16 tokens: 4 pages, 1 bound + 3 private
  AdmissionResult admitted = m.admit(request);
  ASSERT_TRUE(admitted.lease);
  EXPECT_EQ(admitted.outcome, AdmissionOutcome::kAcquired);
  EXPECT_EQ(m.records().get(other), nullptr) << "the other record went first";
  EXPECT_NE(m.records().get(hit), nullptr) << "the hit record was protected";
  EXPECT_EQ(lruIds(m), (std::vector<RecordId>{hit})) << "and touched";
}

TEST_F(SpecManagerTest, InfeasibleSpecAcquirePreservesLruAndTypedReferences) {
  ContextCacheManager m(kPage, ResourceDemand{8, 3, 0, 0}, 8, eagleOptions());
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a, ReuseMode::kSpec);
  publishCold(m, tokenRun(4, 50));
  test::ManagerState const before = captureState(m);
  LookupResult const looked = m.lookup(specRequest(concatenated(a, tokenRun(8, 70))));
  ASSERT_GT(looked.plan.reuseTokenLength, 0);
  AcquireResult const refused = m.acquire(looked.plan);
  EXPECT_FALSE(refused.lease);
  EXPECT_EQ(captureState(m), before);
}

TEST_F(SpecManagerTest, SpecEvictionRemovesBothIndices) {
  ContextCacheManager m(kPage, ResourceDemand{8, 8, 0, 0}, 1, eagleOptions());
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a, ReuseMode::kSpec);
  publishCold(m, tokenRun(4, 60), ReuseMode::kSpec);  // limit evicts a
  PromptBlocks const blocks = hashPromptBlocks(viewOf(a), kPage);
  EXPECT_FALSE(m.index().find(blocks.keys[0]).has_value());
  EXPECT_FALSE(m.records().findLongestSpecPath(blocks.keys, 2).has_value());
  EXPECT_EQ(m.pools().freeCount(ResourceType::kDraftKvPage), 7);
  expectManagerInvariants(m);
}

// ---------------------------------------------------------------------------------------------
// Verification at manager level

TEST(ContextCacheManagerTest, ForgedCollisionIsNeverReused) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  std::vector<int32_t> const victim = tokenRun(8, 0);
  std::vector<int32_t> const attacker = tokenRun(8, 1000);
  PromptBlocks const real = hashPromptBlocks(viewOf(victim), kPage);
  // The attacker's blocks carry the victim's digests: what a digest collision would produce.
  PromptBlocks forged = hashPromptBlocks(viewOf(attacker), kPage);
  forged.keys = real.keys;
  CacheRequestLease producer = admit(m, requestOf(attacker));
  ASSERT_EQ(m.publish(producer, forged, 8).status, PublishStatus::kPublished);
  producer.release();

  AdmissionResult consumer = m.admit(requestOf(concatenated(victim, {1})));
  ASSERT_TRUE(consumer.lease);
  EXPECT_EQ(consumer.plan.reuseTokenLength, 0) << "another prompt's KV must never be handed out";
  EXPECT_EQ(m.metrics().verificationRejects, 1U);
  // The honest producer cannot take over the digest (first committer wins) and is refused too.
  EXPECT_EQ(m.publish(*consumer.lease, real, 8).status, PublishStatus::kVerificationRejected);
  EXPECT_EQ(m.metrics().rejectedPublications, 1U);

  ContextCacheManagerOptions trusting;
  trusting.verifyTokens = false;
  ContextCacheManager unverified(kPage, {8, 0, 0, 0}, 8, trusting);
  CacheRequestLease p2 = admit(unverified, requestOf(attacker));
  unverified.publish(p2, forged, 8);
  EXPECT_EQ(unverified.lookup(requestOf(concatenated(victim, {1}))).plan.reuseTokenLength, 8)
      << "without verification the collision would be trusted";
}

TEST(ContextCacheManagerTest, HybridCheckpointTailTokensAreVerified) {
  ContextCacheManager m(kPage, {8, 0, 2, 2}, 8);
  std::vector<int32_t> const real = tokenRun(7, 0);
  std::vector<int32_t> fake = real;
  fake[5] = 99;  // differs inside the partial tail of a 6-token checkpoint
  CacheRequestLease producer = admit(m, requestOf(fake, ReuseMode::kHybrid));
  std::optional<SnapshotReservation> const r = m.reserveHybridSnapshots(producer, true);
  PromptBlocks const honest = hashPromptBlocks(viewOf(real), kPage);
  ASSERT_EQ(m.publishHybrid(producer, hashPromptBlocks(viewOf(fake), kPage), 6, *r).status,
            PublishStatus::kPublished);
  // The record is keyed by fake's exact digest; a lookup of `real` finds nothing to verify.
  EXPECT_EQ(m.lookup(requestOf(real, ReuseMode::kHybrid)).plan.reuseTokenLength, 0);
  // Re-key the stored tail as if digests had collided: verification must still refuse it.
  CacheRecord const* record = m.records().get(m.records().lruToMru().back().id);
  ASSERT_EQ(record->verificationTokens, (std::vector<int32_t>{4, 99}));
  RecordStore copy;  // plan against a store where the record answers to real's exact digest
  CacheRecord collided = *record;
  collided.key.terminal = exactPrefixDigest(honest, 6);
  copy.insert(collided);
  ReusePlan const plan =
      makeHybridReusePlan(m.index(), copy, honest, true, ContextCacheLookupPolicy::kUseCache);
  EXPECT_EQ(plan.reuseTokenLength, 0);
  EXPECT_EQ(plan.verificationRejects, 1);
}

// ---------------------------------------------------------------------------------------------
// Metrics, misses and events

TEST(ContextCacheManagerTest, MetricsCountAdmissionsAndPublications) {
  ContextCacheManager m(kPage, {16, 0, 0, 0}, 8);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);                                  // bypass, new record
  CacheRequestLease rewind = admit(m, requestOf(a));  // full input rewind
  CacheRequestLease partial = admit(m, requestOf(concatenated(a, {1, 2})));
  publishTokens(m, partial, concatenated(a, {1, 2}));  // existing record touched
  CacheRequestLease miss = admit(m, requestOf(tokenRun(6, 70)));
  ContextCacheMetrics const metrics = m.metrics();
  EXPECT_EQ(metrics.admittedSequences, 4U);
  EXPECT_EQ(metrics.bypasses, 1U);
  EXPECT_EQ(metrics.lookups, 3U);
  EXPECT_EQ(metrics.hits, 2U);
  EXPECT_EQ(metrics.matchedTokens, 16U);
  EXPECT_EQ(metrics.reusedTokens, 4U + 8U);
  EXPECT_EQ(metrics.fullInputRewinds, 1U);
  EXPECT_EQ(metrics.publishedRecords, 1U);
  EXPECT_EQ(metrics.existingRecordsTouched, 1U);
  EXPECT_EQ(metrics.missCount(MissReason::kNoPrefix), 1U);
  EXPECT_EQ(metrics.records, 1);
  EXPECT_EQ(metrics.indexedBlocks, 2);
  EXPECT_EQ(metrics.liveLeases, 3);
  EXPECT_EQ(metrics.capacities.baseKvPages, 16);
  EXPECT_EQ(metrics.freeResources.baseKvPages, 16 - 2 - 1 - 1 - 2);
}

class MissReasonTest : public ::testing::Test {
 protected:
  ContextCacheManager mManager{kPage, ResourceDemand{16, 0, 0, 0}, 8};
  std::optional<MissReason> admitAndClassify(LookupRequest const& request) {
    AdmissionResult result = mManager.admit(request);
    EXPECT_TRUE(result.lease);
    return result.missReason;
  }
  std::vector<int32_t> mPrompt = tokenRun(8, 0);
};

TEST_F(MissReasonTest, NoPrefix) {
  EXPECT_EQ(admitAndClassify(requestOf(mPrompt)), MissReason::kNoPrefix);
}

TEST_F(MissReasonTest, ShorterThanOnePage) {
  EXPECT_EQ(admitAndClassify(requestOf(tokenRun(3, 0))), MissReason::kShorterThanOnePage);
}

TEST_F(MissReasonTest, FullMatchIsNoMiss) {
  publishCold(mManager, mPrompt);
  EXPECT_EQ(admitAndClassify(requestOf(concatenated(mPrompt, {3}))), std::nullopt);
  EXPECT_EQ(admitAndClassify(requestOf(mPrompt)), std::nullopt) << "rewind is no miss";
}

TEST_F(MissReasonTest, StoppedEarlyCountsTheFirstMissingBlock) {
  publishCold(mManager, tokenRun(4, 0));
  EXPECT_EQ(admitAndClassify(requestOf(mPrompt)), MissReason::kNoPrefix);
}

TEST_F(MissReasonTest, Evicted) {
  ContextCacheManager small(kPage, ResourceDemand{2, 0, 0, 0}, 1);
  publishCold(small, mPrompt);
  publishCold(small, tokenRun(4, 50));  // record limit evicts mPrompt's record
  AdmissionResult result = small.admit(requestOf(mPrompt));
  EXPECT_EQ(result.missReason, MissReason::kEvicted);
  EXPECT_EQ(small.metrics().missCount(MissReason::kEvicted), 1U);
}

TEST_F(MissReasonTest, SaltMismatch) {
  publishCold(mManager, mPrompt, ReuseMode::kVanilla, {{}, digestIdentity("tenant-a")});
  EXPECT_EQ(
      admitAndClassify(requestOf(mPrompt, ReuseMode::kVanilla, ContextCacheLookupPolicy::kUseCache,
                                 {{}, digestIdentity("tenant-b")})),
      MissReason::kSaltMismatch);
}

TEST_F(MissReasonTest, LoraMismatch) {
  publishCold(mManager, mPrompt, ReuseMode::kVanilla, {digestIdentity("lora-a"), {}});
  EXPECT_EQ(
      admitAndClassify(requestOf(mPrompt, ReuseMode::kVanilla, ContextCacheLookupPolicy::kUseCache,
                                 {digestIdentity("lora-b"), {}})),
      MissReason::kLoraMismatch);
}

// The case: the prompt is cached under (tenant-a, no LoRA), (tenant-b, no LoRA) and
// (no salt, no LoRA); a request with salt tenant-a and LoRA x is nearest to the first, which
// differs only in the adapter, so the miss is a LoRA mismatch, not the salt mismatch of the
// second provenance. Nearest with two differing fields: the first of them (salt).
TEST_F(MissReasonTest, TheNearestCachedIdentityNamesTheReason) {
  Hash128 const none = digestIdentity("");
  Hash128 const tenantA = digestIdentity("tenant-a");
  publishCold(mManager, mPrompt, ReuseMode::kVanilla, {none, tenantA});
  publishCold(mManager, mPrompt, ReuseMode::kVanilla, {none, digestIdentity("tenant-b")});
  publishCold(mManager, mPrompt, ReuseMode::kVanilla, {none, none});
  auto classify = [&](BlockKeyExtras extras) {
    return admitAndClassify(
        requestOf(mPrompt, ReuseMode::kVanilla, ContextCacheLookupPolicy::kUseCache, extras));
  };
  EXPECT_EQ(classify({digestIdentity("x"), tenantA}), MissReason::kLoraMismatch);
  EXPECT_EQ(classify({none, digestIdentity("tenant-c")}), MissReason::kSaltMismatch);
  EXPECT_EQ(classify({digestIdentity("x"), digestIdentity("tenant-c")}), MissReason::kSaltMismatch)
      << "every cached identity differs in salt and adapter: the first field";
  EXPECT_EQ(mManager.metrics().missCount(MissReason::kLoraMismatch), 1U);
  EXPECT_EQ(mManager.metrics().missCount(MissReason::kSaltMismatch), 2U);
}

TEST_F(MissReasonTest, MediaMismatch) {
  std::vector<int32_t> const tokens(8, 42);  // image placeholders in block 1
  std::vector<MediaPosition> imageA(tokens.size());
  std::vector<MediaPosition> imageB(tokens.size());
  for (std::size_t i = 4; i < 8; ++i) {
    imageA[i] = {Hash128{1, 1}, static_cast<int32_t>(i - 4)};
    imageB[i] = {Hash128{2, 2}, static_cast<int32_t>(i - 4)};
  }
  CacheRequestLease producer = admit(mManager, requestOf(tokens));
  mManager.publish(producer, hashPromptBlocks(viewOf(tokens, {}, &imageA), kPage), 8);
  std::vector<int32_t> const longer = concatenated(tokens, {1});
  std::vector<MediaPosition> imageBLonger = imageB;
  imageBLonger.emplace_back();
  LookupRequest request = requestOf(longer);
  request.prompt = viewOf(longer, {}, &imageBLonger);
  AdmissionResult result = mManager.admit(request);
  ASSERT_TRUE(result.lease);
  EXPECT_EQ(result.plan.reuseTokenLength, 4) << "the text block before the image is shared";
  EXPECT_EQ(result.missReason, MissReason::kMediaMismatch);
}

TEST_F(MissReasonTest, Capacity) {
  ContextCacheManager small(kPage, ResourceDemand{2, 0, 0, 0}, 8);
  CacheRequestLease holder = admit(
      small, requestOf(tokenRun(8, 0), ReuseMode::kVanilla, ContextCacheLookupPolicy::kBypass));
  AdmissionResult result = small.admit(requestOf(mPrompt));
  EXPECT_FALSE(result.lease);
  EXPECT_EQ(result.missReason, MissReason::kCapacity);
  EXPECT_EQ(small.metrics().missCount(MissReason::kCapacity), 1U);
  EXPECT_EQ(small.metrics().missCount(MissReason::kNoPrefix), 0U);
}

TEST(ContextCacheManagerTest, EventQueueReportsStoredAndRemovedBlocks) {
  ContextCacheManagerOptions options;
  options.eventQueueCapacity = 3;
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 1, options);
  std::vector<int32_t> const a = tokenRun(8, 0);
  RecordId const ra = publishCold(m, a);
  std::vector<PageId> const pages = m.records().get(ra)->basePagePath;
  PromptBlocks const blocks = hashPromptBlocks(viewOf(a), kPage);
  std::vector<KvEvent> const stored = m.drainEvents();
  ASSERT_EQ(stored.size(), 2U);
  // Each stored block carries its token ids (routers re-hash them); a plain text prompt has no
  // key inputs besides tokens and parent.
  auto const tokensOf = [&a](int32_t block) {
    return std::vector<int32_t>(a.begin() + std::ptrdiff_t{block} * kPage,
                                a.begin() + (std::ptrdiff_t{block} + 1) * kPage);
  };
  EXPECT_EQ(std::get<BlockStored>(stored[0]),
            (BlockStored{blocks.keys[0], kBlockChainRoot, pages[0], kPage, tokensOf(0), {}}));
  EXPECT_EQ(std::get<BlockStored>(stored[1]),
            (BlockStored{blocks.keys[1], blocks.keys[0], pages[1], kPage, tokensOf(1), {}}));
  EXPECT_TRUE(m.drainEvents().empty());

  std::vector<int32_t> const b = tokenRun(4, 40);
  publishCold(m, b);  // stores b's block, the limit removes a's two blocks
  std::vector<KvEvent> const next = m.drainEvents();
  ASSERT_EQ(next.size(), 3U);
  EXPECT_TRUE(std::holds_alternative<BlockStored>(next[0]));
  EXPECT_EQ(std::get<BlockRemoved>(next[1]), (BlockRemoved{blocks.keys[0], pages[0]}));
  EXPECT_EQ(std::get<BlockRemoved>(next[2]), (BlockRemoved{blocks.keys[1], pages[1]}));
  EXPECT_EQ(m.metrics().droppedEvents, 0U);

  publishCold(m, tokenRun(8, 90));  // 2 stored + 1 removed + ... overflow the ring of 3
  publishCold(m, tokenRun(4, 190));
  EXPECT_EQ(m.drainEvents().size(), 3U);
  EXPECT_EQ(m.metrics().droppedEvents, 3U) << "2 + 1 + 1 + 2 = 6 events, 3 kept";
}

TEST(ContextCacheManagerTest, ResetPrefixCacheDropsEveryRecordAtOnceAndAnnouncesOneClear) {
  ContextCacheManagerOptions options;
  options.eventQueueCapacity = 16;
  ContextCacheManager m(kPage, {8, 0, 2, 2}, 8, options);
  std::vector<int32_t> const a = tokenRun(8, 0);
  publishCold(m, a);
  publishCold(m, concatenated(a, tokenRun(4, 50)));            // shares a's two pages
  std::vector<int32_t> const checkpointed = tokenRun(6, 100);  // outlives the request's view
  LookupRequest const hybrid = requestOf(checkpointed, ReuseMode::kHybrid);
  CacheRequestLease producer = admit(m, hybrid);
  std::optional<SnapshotReservation> const reservation = m.reserveHybridSnapshots(producer, true);
  ASSERT_TRUE(reservation.has_value());
  ASSERT_EQ(
      m.publishHybrid(producer, hashPromptBlocks(viewOf(checkpointed), kPage), 6, *reservation)
          .status,
      PublishStatus::kPublished);
  m.retireHybridSnapshotReservation(producer, *reservation);

  // A live lease refuses the reset and nothing changes.
  m.drainEvents();
  test::ManagerState const before = captureState(m);
  uint64_t const evictedBefore = m.metrics().evictedRecords;
  EXPECT_FALSE(m.resetPrefixCache());
  EXPECT_EQ(captureState(m), before);
  EXPECT_TRUE(m.drainEvents().empty());
  EXPECT_EQ(m.metrics().prefixCacheResets, 0U);

  producer.release();
  ASSERT_TRUE(m.resetPrefixCache());
  EXPECT_TRUE(m.records().empty());
  EXPECT_EQ(m.index().size(), 0);
  for (ResourceType type : kAllResourceTypes) {
    EXPECT_EQ(m.pools().freeCount(type), m.pools().capacities()[type]) << toString(type);
  }
  std::vector<KvEvent> const events = m.drainEvents();
  ASSERT_EQ(events.size(), 1U) << "one clear instead of a BlockRemoved per block";
  EXPECT_TRUE(std::holds_alternative<AllBlocksCleared>(events[0]));
  ContextCacheMetrics const metrics = m.metrics();
  EXPECT_EQ(metrics.prefixCacheResets, 1U);
  EXPECT_EQ(metrics.resetRecords, 3U);
  EXPECT_EQ(metrics.evictedRecords, evictedBefore) << "a reset is not an eviction";
  expectManagerInvariants(m);

  // The cache works as before: a miss now, a hit after the next publication.
  EXPECT_EQ(m.lookup(requestOf(concatenated(a, {1}))).plan.reuseTokenLength, 0);
  publishCold(m, a);
  EXPECT_EQ(m.lookup(requestOf(concatenated(a, {1}))).plan.reuseTokenLength, 8);
  EXPECT_TRUE(m.resetPrefixCache());
  EXPECT_TRUE(m.resetPrefixCache()) << "an empty cache resets too (one more clear)";
  EXPECT_EQ(m.drainEvents().size(), 4U) << "2 stored blocks, 2 clears";
}

TEST(ContextCacheManagerTest, EventsAreOffByDefault) {
  ContextCacheManager m(kPage, {8, 0, 0, 0}, 8);
  publishCold(m, tokenRun(8, 0));
  EXPECT_TRUE(m.drainEvents().empty());
  EXPECT_EQ(m.metrics().droppedEvents, 0U);
}

}  // namespace
}  // namespace mkv

namespace mkv {
namespace {

// Pool of 8 pages: records A (pages of A's two blocks) and B cached, a live lease pinning A's
// pages (so eviction passes over A's record), 3 free pages.
struct BatchRig {
  ContextCacheManager manager{kPage, ResourceDemand{8, 0, 0, 0}, 16};
  std::vector<int32_t> a = tokenRun(8, 0);
  std::vector<int32_t> b = tokenRun(8, 100);
  std::vector<int32_t> aPlusOne = concatenated(a, {7000});
  std::vector<int32_t> aPlusThree = concatenated(a, {900, 901, 902});
  std::optional<CacheRequestLease> live;

  BatchRig() {
    publishCold(manager, a);
    publishCold(manager, b);
    live = admit(manager, requestOf(aPlusOne));
    EXPECT_EQ(manager.pools().freeCount(ResourceType::kBaseKvPage), 3);
  }

  std::vector<AdmissionResult> admitBatch(std::vector<LookupRequest> const& requests) {
    std::vector<LookupResult> looked;
    looked.reserve(requests.size());
    for (LookupRequest const& request : requests) {
      looked.push_back(manager.lookup(request));
    }
    return manager.acquireBatch(requests, std::move(looked));
  }
};

TEST(ContextCacheManagerBatchTest, ABatchThatFitsOnlyWhenAdmittedTogetherIsAdmitted) {
  // A cold sequence of 16 tokens (4 private pages) and A + 3 tokens (A's 2 pinned pages + 1):
  // 5 private pages against 3 free + 2 reclaimable (B's).
  std::vector<int32_t> const cold = tokenRun(16, 500);
  {
    // One by one, the cold sequence evicts B's record for its 4 pages; A's record is passed over
    // (its pages are pinned by the live lease), so the second sequence still hits A and needs
    // 1 page, the last one.
    BatchRig sequential;
    AdmissionResult first = sequential.manager.admit(requestOf(cold));
    ASSERT_TRUE(first.lease);
    AdmissionResult second = sequential.manager.admit(requestOf(sequential.aPlusThree));
    ASSERT_TRUE(second.lease);
    EXPECT_EQ(second.plan.reuseTokenLength, 8);
    EXPECT_EQ(sequential.manager.records().size(), 1U);
  }
  BatchRig rig;
  std::vector<AdmissionResult> admitted =
      rig.admitBatch({requestOf(cold), requestOf(rig.aPlusThree)});
  ASSERT_EQ(admitted.size(), 2U);
  ASSERT_TRUE(admitted[0].lease && admitted[1].lease);
  EXPECT_EQ(admitted[0].lease->basePages().size(), 4U);
  EXPECT_EQ(admitted[1].plan.reuseTokenLength, 8) << "A's pages were pinned before any eviction";
  EXPECT_EQ(admitted[1].lease->basePages().size(), 3U);
  EXPECT_EQ(rig.manager.pools().freeCount(ResourceType::kBaseKvPage), 0);
  EXPECT_EQ(rig.manager.metrics().admittedSequences, 5U);  // A, B, the live lease, the batch
  expectManagerInvariants(rig.manager);
}

TEST(ContextCacheManagerBatchTest, ARefusedBatchChangesNothingAndCountsCapacityMisses) {
  BatchRig rig;
  std::vector<int32_t> const cold = tokenRun(20, 500);  // 5 private pages: 6 > 3 + 2
  test::ManagerState const before = captureState(rig.manager);
  uint64_t const capacityMisses = rig.manager.metrics().missCount(MissReason::kCapacity);
  EXPECT_TRUE(rig.admitBatch({requestOf(cold), requestOf(rig.aPlusThree)}).empty());
  EXPECT_EQ(captureState(rig.manager), before) << "no pin, eviction or allocation stays";
  EXPECT_EQ(rig.manager.metrics().missCount(MissReason::kCapacity), capacityMisses + 2);
  EXPECT_EQ(rig.manager.liveLeaseCount(), 1);
  // The same batch fits once the live lease is gone (A's pages become reclaimable too).
  rig.live.reset();
  std::vector<AdmissionResult> admitted =
      rig.admitBatch({requestOf(cold), requestOf(rig.aPlusThree)});
  ASSERT_EQ(admitted.size(), 2U);
  EXPECT_EQ(admitted[1].plan.reuseTokenLength, 8);
  expectManagerInvariants(rig.manager);
}

TEST(ContextCacheManagerBatchTest, TheBatchsOwnHitRecordsAreEvictedLast) {
  // H (LRU): a hybrid checkpoint at 6 (1 page); P: one at 8 (2 pages); 3 pages free. The batch
  // needs 1 private page for H's consumer and 3 for a cold sequence: one page short, which P
  // alone frees. H, the batch's own hit, must survive (acquirePlan protects its hit the same way).
  ContextCacheManager m(kPage, {6, 0, 2, 2}, 8);
  std::vector<int32_t> const h = tokenRun(6, 0);
  ASSERT_EQ(publishCheckpointOf(m, h, 6).status, PublishStatus::kPublished);
  ASSERT_EQ(publishCheckpointOf(m, tokenRun(8, 100), 8).status, PublishStatus::kPublished);
  ASSERT_EQ(m.records().size(), 2U);
  RecordId const hit = m.records().lruToMru().front().id;
  ASSERT_EQ(m.pools().freeCount(ResourceType::kBaseKvPage), 3);
  std::vector<int32_t> const consumer = concatenated(h, {1, 2});
  std::vector<int32_t> const cold = tokenRun(12, 500);
  std::vector<LookupRequest> const requests{requestOf(consumer, ReuseMode::kHybrid),
                                            requestOf(cold, ReuseMode::kHybrid)};
  std::vector<LookupResult> looked;
  looked.reserve(requests.size());
  for (LookupRequest const& request : requests) {
    looked.push_back(m.lookup(request));
  }
  ASSERT_EQ(looked[0].plan.hybridRecord, hit);
  std::vector<AdmissionResult> admitted = m.acquireBatch(requests, std::move(looked));
  ASSERT_EQ(admitted.size(), 2U);
  ASSERT_TRUE(admitted[0].lease && admitted[1].lease);
  EXPECT_EQ(admitted[0].plan.reuseTokenLength, 6);
  EXPECT_NE(m.records().get(hit), nullptr) << "the batch's own hit record was evicted";
  EXPECT_EQ(m.records().size(), 1U);
  admitted.clear();
  expectManagerInvariants(m);
}

TEST(ContextCacheManagerBatchTest, RejectsMismatchedLookupsWithoutChangingAnything) {
  BatchRig rig;
  std::vector<int32_t> const cold = tokenRun(8, 500);
  std::vector<LookupRequest> const requests{requestOf(cold), requestOf(rig.aPlusThree)};
  test::ManagerState const before = captureState(rig.manager);
  std::vector<LookupResult> one;
  one.push_back(rig.manager.lookup(requests[0]));
  EXPECT_THROW(rig.manager.acquireBatch(requests, std::move(one)), Error);
  std::vector<LookupResult> swapped;
  swapped.push_back(rig.manager.lookup(requests[1]));
  swapped.push_back(rig.manager.lookup(requests[0]));
  EXPECT_THROW(rig.manager.acquireBatch(requests, std::move(swapped)), Error);
  EXPECT_EQ(captureState(rig.manager), before);
}

TEST(ContextCacheManagerTest, AWindowCacheNeedsThePageSizeAndNoHostTier) {
  WindowBlockCache const window(4, kPage, 6, true);
  WindowBlockCache const wide(4, 2 * kPage, 6, true);
  ContextCacheManagerOptions options;
  options.windowCache = &window;
  EXPECT_NO_THROW(ContextCacheManager(kPage, ResourceDemand{8, 0, 0, 0}, 4, options));
  options.hostTierPages = 2;
  EXPECT_TRUE(test::throwsError(
      [&] {
        ContextCacheManager(kPage, ResourceDemand{8, 0, 0, 0}, 4, options);
      },
      {"ContextCacheManager", "window cache", "2 host tier pages"}));
  options.hostTierPages = 0;
  options.windowCache = &wide;
  EXPECT_TRUE(test::throwsError(
      [&] {
        ContextCacheManager(kPage, ResourceDemand{8, 0, 0, 0}, 4, options);
      },
      {"ContextCacheManager", "window cache of page size 8 beside page size 4"}));
}

}  // namespace
}  // namespace mkv
