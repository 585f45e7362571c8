#include "context_cache/block_index.h"

#include <gtest/gtest.h>

#include "context_cache_test_support.h"
#include "mkv/error.h"

namespace mkv {
namespace {

using test::tokenRun;
using test::viewOf;

constexpr int32_t kPage = 4;

class BlockIndexTest : public ::testing::Test {
 protected:
  BlockIndex mIndex{8, kPage, /*verifyTokens=*/true, /*evictedHistory=*/8};
  std::vector<int32_t> mTokensA = tokenRun(3 * kPage, 0);
  std::vector<int32_t> mTokensB = tokenRun(3 * kPage, 500);
  PromptBlocks mA = hashPromptBlocks(viewOf(mTokensA), kPage);
  PromptBlocks mB = hashPromptBlocks(viewOf(mTokensB), kPage);

  void indexAll(PromptBlocks const& blocks, PageId firstPage) {
    for (int32_t b = 0; b < blocks.fullBlockCount(); ++b) {
      ASSERT_EQ(mIndex.insert(blocks.keys[static_cast<std::size_t>(b)], firstPage + b, blocks, b),
                firstPage + b);
    }
  }
};

TEST_F(BlockIndexTest, FirstCommitterWinsAndLookupReturnsCanonicalPages) {
  indexAll(mA, 0);
  EXPECT_EQ(mIndex.insert(mA.keys[0], 5, mA, 0), 0) << "second producer gets the first page";
  EXPECT_FALSE(mIndex.digestOf(5).has_value());
  EXPECT_EQ(mIndex.size(), 3);
  BlockIndex::PrefixMatch const match = mIndex.longestPrefix(mA, mA.fullBlockCount());
  EXPECT_EQ(match.pages, (std::vector<PageId>{0, 1, 2}));
  EXPECT_FALSE(match.verificationRejected);
  EXPECT_EQ(mIndex.longestPrefix(mA, 2).pages.size(), 2U);
  EXPECT_EQ(mIndex.parentOf(1), mA.keys[0]);
  EXPECT_EQ(mIndex.parentOf(0), kBlockChainRoot);
}

TEST_F(BlockIndexTest, APageIsIndexedUnderAtMostOneDigest) {
  indexAll(mA, 0);
  EXPECT_THROW(mIndex.insert(mB.keys[0], 0, mB, 0), Error);
  EXPECT_EQ(mIndex.digestOf(0), mA.keys[0]);
  EXPECT_FALSE(mIndex.find(mB.keys[0]).has_value());
  EXPECT_EQ(mIndex.size(), 3);
  EXPECT_THROW(mIndex.insert(mB.keys[0], 8, mB, 0), Error) << "page out of range";
  EXPECT_THROW(mIndex.insert(mB.keys[0], 4, mB, 3), Error) << "block out of range";
}

TEST_F(BlockIndexTest, LongestPrefixStopsAtTheFirstHole) {
  ASSERT_EQ(mIndex.insert(mA.keys[0], 0, mA, 0), 0);
  ASSERT_EQ(mIndex.insert(mA.keys[2], 2, mA, 2), 2);  // block 1 missing
  BlockIndex::PrefixMatch const match = mIndex.longestPrefix(mA, mA.fullBlockCount());
  EXPECT_EQ(match.pages, (std::vector<PageId>{0}));
  EXPECT_FALSE(match.verificationRejected);
  EXPECT_TRUE(mIndex.longestPrefix(mB, mB.fullBlockCount()).pages.empty());
}

TEST_F(BlockIndexTest, VerificationRefusesAForcedDigestCollision) {
  // An entry under A's first digest that holds B's tokens: what a 128-bit collision would do.
  ASSERT_EQ(mIndex.insert(mA.keys[0], 3, mB, 0), 3);
  BlockIndex::PrefixMatch const match = mIndex.longestPrefix(mA, mA.fullBlockCount());
  EXPECT_TRUE(match.pages.empty()) << "a colliding digest must never hand out another prompt's KV";
  EXPECT_TRUE(match.verificationRejected);
  EXPECT_FALSE(mIndex.holds(3, mA, 0));

  // Without verification the same entry would be trusted.
  BlockIndex trusting(8, kPage, /*verifyTokens=*/false, 0);
  ASSERT_EQ(trusting.insert(mA.keys[0], 3, mB, 0), 3);
  EXPECT_EQ(trusting.longestPrefix(mA, 1).pages, (std::vector<PageId>{3}));
}

TEST_F(BlockIndexTest, VerificationComparesTokensEvenWhenEveryDigestCollides) {
  // Forge B's block so that its key, content key and media digest all equal A's: only the stored
  // token ids can tell them apart. (Content keys are chained from the token digests.)
  PromptBlocks forged = mB;
  forged.keys = mA.keys;
  forged.tokenDigests = mA.tokenDigests;
  forged.mediaDigests = mA.mediaDigests;
  ASSERT_EQ(mIndex.insert(mA.keys[0], 2, forged, 0), 2);
  EXPECT_FALSE(mIndex.holds(2, mA, 0));
  EXPECT_TRUE(mIndex.longestPrefix(mA, 1).verificationRejected);
  EXPECT_TRUE(mIndex.holds(2, forged, 0));
}

TEST_F(BlockIndexTest, VerificationComparesMediaPositionsEvenWhenTheMediaDigestCollides) {
  std::vector<MediaPosition> imageA(mTokensA.size());
  std::vector<MediaPosition> imageB(mTokensA.size());
  for (std::size_t i = 0; i < 4; ++i) {
    imageA[i] = {Hash128{1, 1}, static_cast<int32_t>(i)};
    imageB[i] = {Hash128{2, 2}, static_cast<int32_t>(i)};
  }
  PromptBlocks const a = hashPromptBlocks(viewOf(mTokensA, {}, &imageA), kPage);
  PromptBlocks forged = hashPromptBlocks(viewOf(mTokensA, {}, &imageB), kPage);
  forged.keys = a.keys;
  forged.mediaDigests = a.mediaDigests;
  ASSERT_EQ(mIndex.insert(a.keys[0], 1, forged, 0), 1);
  EXPECT_FALSE(mIndex.holds(1, a, 0));
  EXPECT_TRUE(mIndex.holds(1, forged, 0));
}

TEST_F(BlockIndexTest, VerificationComparesParentSaltAdapterAndMedia) {
  std::vector<MediaPosition> media(mTokensA.size());
  media.at(1) = {Hash128{9, 9}, 0};
  struct Variant {
    char const* what;
    PromptBlocks blocks;
    int32_t block;
  };
  std::vector<int32_t> otherFirstBlock = mTokensA;
  otherFirstBlock[0] = 1000;  // same block-1 tokens, other parent
  std::vector<Variant> const variants{
      {"salt", hashPromptBlocks(viewOf(mTokensA, {{}, Hash128{1, 1}}), kPage), 0},
      {"adapter", hashPromptBlocks(viewOf(mTokensA, {Hash128{2, 2}, {}}), kPage), 0},
      {"media", hashPromptBlocks(viewOf(mTokensA, {}, &media), kPage), 0},
      {"parent", hashPromptBlocks(viewOf(otherFirstBlock), kPage), 1},
  };
  for (Variant const& v : variants) {
    BlockIndex index(8, kPage, true, 0);
    if (v.block == 1) {
      ASSERT_EQ(index.insert(mA.keys[0], 0, mA, 0), 0);
    }
    // Same tokens, forged under A's digest, but recorded with another salt / adapter / media /
    // parent.
    ASSERT_EQ(index.insert(mA.keys[static_cast<std::size_t>(v.block)], 5, v.blocks, v.block), 5);
    EXPECT_FALSE(index.holds(5, mA, v.block)) << v.what;
    EXPECT_EQ(index.longestPrefix(mA, 3).pages.size(), static_cast<std::size_t>(v.block)) << v.what;
  }
}

TEST_F(BlockIndexTest, MediaBlocksAreVerifiedPositionByPosition) {
  std::vector<MediaPosition> media(mTokensA.size());
  for (std::size_t i = 0; i < 4; ++i) {
    media[i] = {Hash128{3, 3}, static_cast<int32_t>(i)};
  }
  PromptBlocks const withImage = hashPromptBlocks(viewOf(mTokensA, {}, &media), kPage);
  ASSERT_EQ(mIndex.insert(withImage.keys[0], 0, withImage, 0), 0);
  EXPECT_TRUE(mIndex.holds(0, withImage, 0));
  EXPECT_EQ(mIndex.longestPrefix(withImage, 3).pages.size(), 1U);
  EXPECT_TRUE(mIndex.longestPrefix(mA, 3).pages.empty()) << "text-only prompt, other key";
}

TEST_F(BlockIndexTest, EraseForgetsTheEntryAndRemembersEvictions) {
  indexAll(mA, 0);
  EXPECT_TRUE(mIndex.erasePage(1));
  EXPECT_FALSE(mIndex.erasePage(1));
  EXPECT_FALSE(mIndex.erasePage(-3));
  EXPECT_FALSE(mIndex.find(mA.keys[1]).has_value());
  EXPECT_TRUE(mIndex.wasRecentlyEvicted(mA.keys[1]));
  EXPECT_EQ(mIndex.longestPrefix(mA, 3).pages.size(), 1U);
  EXPECT_TRUE(mIndex.erasePage(2, /*rememberEviction=*/false));
  EXPECT_FALSE(mIndex.wasRecentlyEvicted(mA.keys[2]));
  // The page can be indexed again, under any digest.
  EXPECT_EQ(mIndex.insert(mB.keys[0], 1, mB, 0), 1);
  EXPECT_THROW(mIndex.parentOf(2), Error);
}

TEST_F(BlockIndexTest, ContentChainFindsTheSameTextUnderOtherExtras) {
  PromptBlocks const salted = hashPromptBlocks(viewOf(mTokensA, {{}, Hash128{4, 4}}), kPage);
  ASSERT_EQ(mIndex.insert(salted.keys[0], 0, salted, 0), 0);
  std::vector<BlockProvenance> const found = mIndex.provenanceByContent(mA.contentKey(0));
  ASSERT_EQ(found.size(), 1U);
  EXPECT_EQ(found[0].salt, (Hash128{4, 4}));
  EXPECT_EQ(mIndex.provenanceOf(0).contentKey, mA.contentKey(0));
  EXPECT_TRUE(mIndex.provenanceByContent(mB.contentKey(0)).empty());
  mIndex.erasePage(0);
  EXPECT_TRUE(mIndex.provenanceByContent(mA.contentKey(0)).empty());
}

TEST_F(BlockIndexTest, AVerifiedWalkFromBlockZeroComputesNoContentKeys) {
  indexAll(mA, 0);
  PromptBlocks const again = hashPromptBlocks(viewOf(mTokensA), kPage);
  ASSERT_EQ(again.contentKeysComputed(), 0);
  EXPECT_EQ(mIndex.longestPrefix(again, again.fullBlockCount()).pages,
            (std::vector<PageId>{0, 1, 2}));
  EXPECT_EQ(again.contentKeysComputed(), 0) << "token comparisons imply equal content";
  // A lone check of a later block (ancestors not verified by the caller) compares the chain.
  EXPECT_TRUE(mIndex.holds(2, again, 2));
  EXPECT_EQ(again.contentKeysComputed(), 3);
}

TEST_F(BlockIndexTest, ALoneCheckCatchesAnAncestorThatDiffersBehindForgedKeys) {
  // C differs from A in block 0 only. A's block 1 is indexed; C's keys are forged to collide with
  // A's, so parent, salt, adapter, media and block 1's tokens all agree: only the content chain
  // (over block 0's tokens too) tells the prompts apart.
  std::vector<int32_t> tokensC = mTokensA;
  tokensC[0] = -1;
  PromptBlocks forged = hashPromptBlocks(viewOf(tokensC), kPage);
  forged.keys = mA.keys;
  ASSERT_EQ(mIndex.insert(mA.keys[1], 5, mA, 1), 5);
  EXPECT_FALSE(mIndex.holds(5, forged, 1));
  EXPECT_TRUE(mIndex.holds(5, mA, 1));
  // A caller that verified block 0 itself would have rejected C there; it may skip the chain.
  EXPECT_TRUE(mIndex.holds(5, forged, 1, /*ancestorsVerified=*/true));
}

TEST_F(BlockIndexTest, RejectsBlocksOfAnotherPageSize) {
  PromptBlocks const other = hashPromptBlocks(viewOf(mTokensA), 2);
  EXPECT_THROW(mIndex.longestPrefix(other, 1), Error);
  EXPECT_THROW(mIndex.insert(other.keys[0], 0, other, 0), Error);
  EXPECT_THROW(BlockIndex(-1, kPage, true, 0), Error);
  EXPECT_THROW(BlockIndex(4, 0, true, 0), Error);
  EXPECT_THROW(BlockIndex(4, kPage, true, -1), Error);
}

}  // namespace
}  // namespace mkv
