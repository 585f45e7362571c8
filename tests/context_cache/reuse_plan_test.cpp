#include "context_cache/reuse_plan.h"

#include <gtest/gtest.h>

#include "context_cache_test_support.h"
#include "mkv/error.h"

namespace mkv {
namespace {

using test::captureState;
using test::publishCheckpointOf;
using test::publishCold;
using test::tokenRun;
using test::viewOf;

constexpr int32_t kPage = 4;
constexpr ContextCacheLookupPolicy kUse = ContextCacheLookupPolicy::kUseCache;
constexpr SpecReuseContract kEagle{true, 1};

ContextCacheManagerOptions specOptions() {
  ContextCacheManagerOptions options;
  options.specContract = kEagle;
  return options;
}

class ReusePlanTest : public ::testing::Test {
 protected:
  ContextCacheManager mManager{kPage, ResourceDemand{32, 32, 4, 4}, 16, specOptions()};
  BlockIndex const& index() const { return mManager.index(); }
  RecordStore const& records() const { return mManager.records(); }
  PromptBlocks blocksOf(std::vector<int32_t> const& tokens) const {
    return hashPromptBlocks(viewOf(tokens), kPage);
  }
};

TEST_F(ReusePlanTest, MissAllocatesEveryInputPage) {
  std::vector<int32_t> const tokens = tokenRun(9, 0);
  ReusePlan const plan = makeVanillaReusePlan(index(), blocksOf(tokens), kUse);
  EXPECT_EQ(plan.kind, ReusePlanKind::kNoReusablePrefix);
  EXPECT_EQ(plan.reuseTokenLength, 0);
  EXPECT_EQ(plan.demand, (ResourceDemand{3, 0, 0, 0}));
  EXPECT_TRUE(plan.basePageBindings.empty());
  EXPECT_FALSE(plan.isCacheDerived());
}

TEST_F(ReusePlanTest, FullBlocksReuseAndPartialTailGetsPrivatePage) {
  std::vector<int32_t> const prompt = tokenRun(8, 0);
  publishCold(mManager, prompt);
  std::vector<int32_t> const longer = test::concatenated(prompt, {100, 101});
  ReusePlan const plan = makeVanillaReusePlan(index(), blocksOf(longer), kUse);
  EXPECT_EQ(plan.kind, ReusePlanKind::kStandard);
  EXPECT_EQ(plan.matchedTokenLength, 8);
  EXPECT_EQ(plan.reuseTokenLength, 8);
  EXPECT_EQ(plan.basePageBindings.size(), 2U);
  EXPECT_EQ(plan.matchedBlockDigests, blocksOf(prompt).keys);
  EXPECT_EQ(plan.demand.baseKvPages, 1);
  EXPECT_TRUE(plan.isCacheDerived());
  EXPECT_EQ(makeVanillaReusePlan(index(), blocksOf(longer), ContextCacheLookupPolicy::kBypass)
                .demand.baseKvPages,
            3)
      << "bypass plans are cold";
}

TEST_F(ReusePlanTest, MatchStopsBeforeAnIndexHole) {
  std::vector<int32_t> const prompt = tokenRun(12, 0);
  publishCold(mManager, prompt);
  std::vector<int32_t> holed = prompt;
  holed[5] = -1;  // block 1 differs; block 2 is identical text but chained on another parent
  ReusePlan const plan = makeVanillaReusePlan(index(), blocksOf(holed), kUse);
  EXPECT_EQ(plan.reuseTokenLength, 4);
  EXPECT_EQ(plan.indexedPrefixBlocks, 1);
  EXPECT_EQ(plan.demand.baseKvPages, 2);
}

TEST_F(ReusePlanTest, ExactBlockAlignedInputRewindsOneFullPage) {
  std::vector<int32_t> const prompt = tokenRun(8, 0);
  publishCold(mManager, prompt);
  ReusePlan const plan = makeVanillaReusePlan(index(), blocksOf(prompt), kUse);
  EXPECT_EQ(plan.kind, ReusePlanKind::kFullInputRewind);
  EXPECT_EQ(plan.matchedTokenLength, 8);
  EXPECT_EQ(plan.reuseTokenLength, 4) << "the last token must be recomputed for logits";
  EXPECT_EQ(plan.basePageBindings.size(), 1U);
  EXPECT_EQ(plan.demand.baseKvPages, 1);
  std::vector<int32_t> const onePage = tokenRun(4, 0);
  ReusePlan const single = makeVanillaReusePlan(index(), blocksOf(onePage), kUse);
  EXPECT_EQ(single.kind, ReusePlanKind::kFullInputRewind);
  EXPECT_EQ(single.reuseTokenLength, 0);
  EXPECT_TRUE(single.isCacheDerived());
}

TEST_F(ReusePlanTest, ABlockLimitCapsTheVanillaPlan) {
  std::vector<int32_t> const prompt = tokenRun(8, 0);
  publishCold(mManager, prompt);
  PromptBlocks const blocks = blocksOf(prompt);
  ReusePlan const capped = makeVanillaReusePlan(index(), blocks, kUse, nullptr, 1);
  EXPECT_EQ(capped.kind, ReusePlanKind::kStandard) << "the input is not fully matched any more";
  EXPECT_EQ(capped.reuseTokenLength, 4);
  EXPECT_EQ(capped.demand.baseKvPages, 1);
  ReusePlan const none = makeVanillaReusePlan(index(), blocks, kUse, nullptr, 0);
  EXPECT_EQ(none.kind, ReusePlanKind::kNoReusablePrefix);
  EXPECT_EQ(none.demand.baseKvPages, 2);
  EXPECT_THROW(makeVanillaReusePlan(index(), blocks, kUse, nullptr, -1), Error);
}

/// Caches blocks `cached` of `blocks` in `window` (each on a fresh page, released).
void cacheWindowBlocks(WindowBlockCache& window, PromptBlocks const& blocks,
                       std::vector<int32_t> const& cached) {
  for (int32_t block : cached) {
    std::vector<PageId> page;
    ASSERT_TRUE(window.allocate(1, page));
    ASSERT_TRUE(window.publish(page[0], blocks, block));
    window.release(page[0]);
  }
}

TEST_F(ReusePlanTest, TheWindowRuleCapsAtTheLongestPrefixWithItsWindowCached) {
  std::vector<int32_t> const prompt = tokenRun(5 * kPage + 1, 0);
  publishCold(mManager, prompt);
  PromptBlocks const blocks = blocksOf(prompt);
  WindowBlockCache window(8, kPage, /*windowTokens=*/2 * kPage, true);
  cacheWindowBlocks(window, blocks, {0, 1, 2, 4});
  // The full layers bind 5 blocks; k = 5 needs {3, 4}, k = 4 {2, 3}: k = 3 ({1, 2}).
  ReusePlan const plan = makeWindowedReusePlan(index(), window, blocks, kUse);
  EXPECT_EQ(plan.reuseTokenLength, 3 * kPage);
  EXPECT_EQ(plan.basePageBindings.size(), 3U);
  EXPECT_EQ(plan.matchedBlockDigests.size(), 3U);
  EXPECT_EQ(plan.demand.baseKvPages, 3);
  EXPECT_EQ(plan.windowLimitedTokens, 2 * kPage);
  EXPECT_EQ(plan.indexedPrefixBlocks, 5) << "the full layers' lookup";
  EXPECT_EQ(classifyMiss(index(), blocks, plan), MissReason::kWindowEvicted);
  cacheWindowBlocks(window, blocks, {3});
  ReusePlan const full = makeWindowedReusePlan(index(), window, blocks, kUse);
  EXPECT_EQ(full.reuseTokenLength, 5 * kPage);
  EXPECT_EQ(full.windowLimitedTokens, 0);
  EXPECT_EQ(classifyMiss(index(), blocks, full), std::nullopt);
  ReusePlan const bypass =
      makeWindowedReusePlan(index(), window, blocks, ContextCacheLookupPolicy::kBypass);
  EXPECT_EQ(bypass.kind, ReusePlanKind::kNoReusablePrefix);
  EXPECT_EQ(bypass.windowLimitedTokens, 0);
}

TEST_F(ReusePlanTest, TheWindowRuleCountsTheRewoundInputByItsBoundBlocks) {
  std::vector<int32_t> const prompt = tokenRun(3 * kPage, 0);
  publishCold(mManager, prompt);
  PromptBlocks const blocks = blocksOf(prompt);
  WindowBlockCache window(8, kPage, /*windowTokens=*/1, true);
  cacheWindowBlocks(window, blocks, {1});  // the window of the 2 bound blocks
  ReusePlan const plan = makeWindowedReusePlan(index(), window, blocks, kUse);
  EXPECT_EQ(plan.kind, ReusePlanKind::kFullInputRewind) << "block 2 is recomputed anyway";
  EXPECT_EQ(plan.reuseTokenLength, 2 * kPage);
  EXPECT_EQ(plan.windowLimitedTokens, 0);
  WindowBlockCache empty(8, kPage, 1, true);
  ReusePlan const cold = makeWindowedReusePlan(index(), empty, blocks, kUse);
  EXPECT_EQ(cold.kind, ReusePlanKind::kNoReusablePrefix);
  EXPECT_EQ(cold.windowLimitedTokens, 2 * kPage);
  EXPECT_EQ(cold.demand.baseKvPages, 3);
}

TEST_F(ReusePlanTest, HybridPlanningRequiresOneCompleteExactCheckpoint) {
  std::vector<int32_t> const prompt = tokenRun(10, 0);
  ASSERT_EQ(publishCheckpointOf(mManager, prompt, 6).status, PublishStatus::kPublished);
  ASSERT_EQ(publishCheckpointOf(mManager, prompt, 8).status, PublishStatus::kPublished);

  ReusePlan const longest = makeHybridReusePlan(index(), records(), blocksOf(prompt), true, kUse);
  EXPECT_EQ(longest.kind, ReusePlanKind::kStandard);
  EXPECT_EQ(longest.reuseTokenLength, 8) << "longest checkpoint strictly shorter than the input";
  EXPECT_EQ(longest.basePageBindings.size(), 2U);
  EXPECT_TRUE(longest.recurrentSnapshotBinding.has_value());
  EXPECT_FALSE(longest.partialKvSnapshotBinding.has_value()) << "page-aligned checkpoint";
  EXPECT_EQ(longest.demand.baseKvPages, 1);

  std::vector<int32_t> const seven = tokenRun(7, 0);
  ReusePlan const mid = makeHybridReusePlan(index(), records(), blocksOf(seven), true, kUse);
  EXPECT_EQ(mid.reuseTokenLength, 6);
  EXPECT_EQ(mid.matchedBlockDigests.size(), 1U);
  EXPECT_TRUE(mid.partialKvSnapshotBinding.has_value()) << "6 % 4 != 0: partial page";
  EXPECT_EQ(mid.hybridCheckpoint->exactLength, 6);
  EXPECT_EQ(mid.demand.baseKvPages, 1);

  std::vector<int32_t> const six = tokenRun(6, 0);
  EXPECT_EQ(makeHybridReusePlan(index(), records(), blocksOf(six), true, kUse).reuseTokenLength, 0)
      << "a checkpoint equal to the input is not reused";
  std::vector<int32_t> diverged = prompt;
  diverged[1] = 50;
  EXPECT_EQ(
      makeHybridReusePlan(index(), records(), blocksOf(diverged), true, kUse).reuseTokenLength, 0);
}

TEST_F(ReusePlanTest, HybridMtpPlanningBindsBaseAndDraftAtExactCheckpoint) {
  std::vector<int32_t> const prompt = tokenRun(11, 0);
  ASSERT_EQ(publishCheckpointOf(mManager, prompt, 9, ReuseMode::kHybridMtp).status,
            PublishStatus::kPublished);
  ReusePlan const plan = makeHybridMtpReusePlan(index(), records(), blocksOf(prompt), kUse);
  EXPECT_EQ(plan.mode, ReuseMode::kHybridMtp);
  EXPECT_EQ(plan.reuseTokenLength, 9);
  EXPECT_EQ(plan.basePageBindings.size(), 2U) << "(9 - 1) / 4 full blocks";
  EXPECT_EQ(plan.draftPageBindings.size(), 2U);
  EXPECT_EQ(plan.specRecord, plan.hybridRecord);
  EXPECT_TRUE(plan.recurrentSnapshotBinding && plan.partialKvSnapshotBinding);
  EXPECT_EQ(plan.demand, (ResourceDemand{1, 1, 0, 0}));
  // An aligned MTP checkpoint keeps its boundary token private too: 8 -> one full block.
  ASSERT_EQ(publishCheckpointOf(mManager, prompt, 8, ReuseMode::kHybridMtp).status,
            PublishStatus::kPublished);
  std::vector<int32_t> const nine = tokenRun(9, 0);
  ReusePlan const aligned = makeHybridMtpReusePlan(index(), records(), blocksOf(nine), kUse);
  EXPECT_EQ(aligned.reuseTokenLength, 8);
  EXPECT_EQ(aligned.basePageBindings.size(), 1U);
  EXPECT_EQ(aligned.demand, (ResourceDemand{2, 2, 0, 0}));
  ReusePlan const cold =
      makeHybridMtpReusePlan(index(), records(), blocksOf(nine), ContextCacheLookupPolicy::kBypass);
  EXPECT_EQ(cold.demand, (ResourceDemand{3, 3, 0, 0})) << "cold reserves both pools";
}

TEST_F(ReusePlanTest, HybridMtpPlanningSkipsRecordWithoutDraftPath) {
  std::vector<int32_t> const prompt = tokenRun(11, 0);
  ASSERT_EQ(publishCheckpointOf(mManager, prompt, 9, ReuseMode::kHybrid).status,
            PublishStatus::kPublished);
  ReusePlan const plan = makeHybridMtpReusePlan(index(), records(), blocksOf(prompt), kUse);
  EXPECT_EQ(plan.reuseTokenLength, 0) << "a plain hybrid checkpoint has no draft path";
  EXPECT_EQ(makeHybridReusePlan(index(), records(), blocksOf(prompt), true, kUse).reuseTokenLength,
            9);
}

TEST_F(ReusePlanTest, PureRecurrentPlanningNeedsNoPages) {
  ContextCacheManager recurrent(kPage, ResourceDemand{0, 0, 2, 0}, 4);
  std::vector<int32_t> const prompt = tokenRun(7, 0);
  ASSERT_EQ(publishCheckpointOf(recurrent, prompt, 5, ReuseMode::kHybrid, false).status,
            PublishStatus::kPublished);
  ReusePlan const plan = makeHybridReusePlan(recurrent.index(), recurrent.records(),
                                             hashPromptBlocks(viewOf(prompt), kPage), false, kUse);
  EXPECT_EQ(plan.reuseTokenLength, 5);
  EXPECT_TRUE(plan.basePageBindings.empty());
  EXPECT_FALSE(plan.partialKvSnapshotBinding.has_value());
  EXPECT_EQ(plan.demand, ResourceDemand{});
}

TEST_F(ReusePlanTest, PlanningDoesNotChangePoolRefsOrRecordRecency) {
  std::vector<int32_t> const prompt = tokenRun(12, 0);
  publishCold(mManager, prompt, ReuseMode::kSpec);
  publishCheckpointOf(mManager, prompt, 6);
  publishCold(mManager, tokenRun(8, 100));
  test::ManagerState const before = captureState(mManager);
  std::vector<int32_t> const longer = test::concatenated(prompt, {1});  // blocks view its tokens
  PromptBlocks const blocks = blocksOf(longer);
  (void)makeVanillaReusePlan(index(), blocks, kUse);
  (void)makeHybridReusePlan(index(), records(), blocks, true, kUse);
  (void)makeHybridMtpReusePlan(index(), records(), blocks, kUse);
  (void)makeSpecReusePlan(index(), records(), blocks, kEagle, kUse);
  (void)classifyMiss(index(), blocks, makeVanillaReusePlan(index(), blocks, kUse));
  (void)mManager.lookup(test::requestOf(prompt, ReuseMode::kSpec));
  EXPECT_EQ(captureState(mManager), before);
  EXPECT_EQ(mManager.metrics().lookups, 0U) << "lookup() counts nothing";
}

TEST_F(ReusePlanTest, SpecPlanningIgnoresBaseOnlyHits) {
  std::vector<int32_t> const prompt = tokenRun(12, 0);
  publishCold(mManager, prompt);  // vanilla producer: base-only record
  std::vector<int32_t> const longer = test::concatenated(prompt, {7});
  ReusePlan const plan = makeSpecReusePlan(index(), records(), blocksOf(longer), kEagle, kUse);
  EXPECT_EQ(plan.kind, ReusePlanKind::kNoReusablePrefix);
  EXPECT_EQ(plan.reuseTokenLength, 0);
  EXPECT_EQ(plan.demand, (ResourceDemand{4, 4, 0, 0}));
  // A non-paged contract (shared target KV) reuses the base side alone, without replay.
  ReusePlan const shared =
      makeSpecReusePlan(index(), records(), blocksOf(longer), {false, 0}, kUse);
  EXPECT_EQ(shared.reuseTokenLength, 12);
  EXPECT_EQ(shared.demand, (ResourceDemand{1, 0, 0, 0}));
  EXPECT_EQ(shared.specReplayMode, SpecReplayMode::kNone);
}

TEST_F(ReusePlanTest, SpecPlanningUsesOneCoherentPathAndOneFullPageReplay) {
  std::vector<int32_t> const prompt = tokenRun(12, 0);
  RecordId const producer = publishCold(mManager, prompt, ReuseMode::kSpec);
  std::vector<int32_t> const longer = test::concatenated(prompt, {7, 8});
  PromptBlocks const blocks = blocksOf(longer);
  ReusePlan const plan = makeSpecReusePlan(index(), records(), blocks, kEagle, kUse);
  CacheRecord const* record = records().get(producer);
  ASSERT_NE(record, nullptr);
  EXPECT_EQ(plan.kind, ReusePlanKind::kStandard);
  EXPECT_EQ(plan.matchedTokenLength, 12);
  EXPECT_EQ(plan.reuseTokenLength, 8) << "one full page replayed";
  EXPECT_EQ(plan.specReplayMode, SpecReplayMode::kFullPage);
  EXPECT_EQ(plan.specRecord, producer);
  EXPECT_EQ(plan.basePageBindings,
            std::vector<PageId>(record->basePagePath.begin(), record->basePagePath.begin() + 2));
  EXPECT_EQ(plan.draftPageBindings,
            std::vector<PageId>(record->specState->draftPagePath.begin(),
                                record->specState->draftPagePath.begin() + 2));
  ASSERT_TRUE(plan.specReplayDependency.has_value());
  EXPECT_EQ(plan.specReplayDependency->pathBlockCount, 3);
  EXPECT_EQ(plan.specReplayDependency->terminalDigest, blocks.keys[2]);
  EXPECT_EQ(plan.demand, (ResourceDemand{2, 2, 0, 0}));

  // A contract without future dependency binds the whole path.
  ReusePlan const noReplay = makeSpecReusePlan(index(), records(), blocks, {true, 0}, kUse);
  EXPECT_EQ(noReplay.reuseTokenLength, 12);
  EXPECT_FALSE(noReplay.specReplayDependency.has_value());
}

TEST_F(ReusePlanTest, SpecPlanningExactInputRewindsOneFullPage) {
  std::vector<int32_t> const prompt = tokenRun(8, 0);
  publishCold(mManager, prompt, ReuseMode::kSpec);
  ReusePlan const plan = makeSpecReusePlan(index(), records(), blocksOf(prompt), kEagle, kUse);
  EXPECT_EQ(plan.kind, ReusePlanKind::kFullInputRewind);
  EXPECT_EQ(plan.reuseTokenLength, 4);
  EXPECT_EQ(plan.demand, (ResourceDemand{1, 1, 0, 0}));
  ReusePlan const noReplay =
      makeSpecReusePlan(index(), records(), blocksOf(prompt), {true, 0}, kUse);
  EXPECT_EQ(noReplay.reuseTokenLength, 4) << "full-input rewind even without a future dependency";
  EXPECT_FALSE(noReplay.specReplayDependency.has_value());
}

TEST_F(ReusePlanTest, CoverageRaisesOnlyThePrivateDemand) {
  std::vector<int32_t> const prompt = tokenRun(8, 0);
  publishCold(mManager, prompt);
  ReusePlan plan = makeVanillaReusePlan(index(), blocksOf(test::concatenated(prompt, {1})), kUse);
  ASSERT_EQ(plan.demand.baseKvPages, 1);
  requireKvPageCoverage(plan, kPage, 9 + 1, 0);
  EXPECT_EQ(plan.demand.baseKvPages, 1) << "10 tokens still fit 3 pages";
  requireKvPageCoverage(plan, kPage, 9 + 5, 0);
  EXPECT_EQ(plan.demand.baseKvPages, 2);
  requireKvPageCoverage(plan, kPage, 1, 0);
  EXPECT_EQ(plan.demand.baseKvPages, 2) << "never lowered";
  EXPECT_THROW(requireKvPageCoverage(plan, kPage, -1, 0), Error);
}

TEST_F(ReusePlanTest, ClassifyingAPartialHitsMissTakesOneContentStepNotAWalk) {
  std::vector<int32_t> const published = tokenRun(6 * kPage, 0);
  publishCold(mManager, published);
  std::vector<int32_t> query = published;
  query[4 * kPage] = -7;  // blocks 0-3 hit, block 4 differs
  PromptBlocks const blocks = blocksOf(query);
  ReusePlan const plan = makeVanillaReusePlan(index(), blocks, kUse);
  ASSERT_EQ(plan.indexedPrefixBlocks, 4);
  EXPECT_EQ(blocks.contentKeysComputed(), 0) << "planning compares tokens, not content keys";
  EXPECT_EQ(classifyMiss(index(), blocks, plan), MissReason::kNoPrefix);
  EXPECT_EQ(blocks.contentKeysComputed(), 0) << "block 4's content key came from block 3's entry";
  // The same text under another salt: block 0's key differs, its content key is found indexed.
  PromptBlocks const salted = hashPromptBlocks(viewOf(published, {{}, Hash128{9, 9}}), kPage);
  ReusePlan const saltedPlan = makeVanillaReusePlan(index(), salted, kUse);
  EXPECT_EQ(classifyMiss(index(), salted, saltedPlan), MissReason::kSaltMismatch);
  // The same text with an image in block 4 (the first missed block, index > 0): its content key,
  // derived from block 3's entry by contentKeyAfter, is indexed, so the miss is the media's.
  std::vector<MediaPosition> media(published.size());
  for (std::size_t i = 0; i < 2; ++i) {
    media[4 * kPage + 1 + i] = MediaPosition{Hash128{7, 7}, static_cast<int32_t>(i)};
  }
  PromptBlocks const withMedia = hashPromptBlocks(viewOf(published, {}, &media), kPage);
  ReusePlan const mediaPlan = makeVanillaReusePlan(index(), withMedia, kUse);
  ASSERT_EQ(mediaPlan.indexedPrefixBlocks, 4);
  EXPECT_EQ(classifyMiss(index(), withMedia, mediaPlan), MissReason::kMediaMismatch);
  EXPECT_EQ(withMedia.contentKeysComputed(), 0) << "one content step from block 3's entry";
}

TEST_F(ReusePlanTest, RejectsBlocksOfAnotherPageSize) {
  std::vector<int32_t> const prompt = tokenRun(8, 0);
  PromptBlocks const other = hashPromptBlocks(viewOf(prompt), 2);
  EXPECT_THROW(makeVanillaReusePlan(index(), other, kUse), Error);
  EXPECT_THROW(makeSpecReusePlan(index(), records(), other, kEagle, kUse), Error);
  EXPECT_THROW(
      makeVanillaReusePlan(index(), blocksOf(prompt), static_cast<ContextCacheLookupPolicy>(9)),
      Error);
  EXPECT_EQ(toString(MissReason::kLoraMismatch), "lora_mismatch");
}

}  // namespace
}  // namespace mkv
