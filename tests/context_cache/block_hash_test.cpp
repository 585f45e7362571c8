#include "context_cache/block_hash.h"

#include <gtest/gtest.h>

#include <memory>
#include <set>

#include "context_cache_test_support.h"
#include "mkv/error.h"
#include "mkv/tensor.h"

namespace mkv {
namespace {

using test::tokenRun;
using test::viewOf;

constexpr int32_t kPage = 4;

std::vector<MediaPosition> imageAt(std::size_t tokens, std::size_t begin, std::size_t length,
                                   Hash128 content) {
  std::vector<MediaPosition> media(tokens);
  for (std::size_t i = 0; i < length; ++i) {
    media[begin + i] = MediaPosition{content, static_cast<int32_t>(i)};
  }
  return media;
}

TEST(BlockHashTest, EqualInputsProduceEqualDigests) {
  std::vector<int32_t> const a = tokenRun(13, 0);
  std::vector<int32_t> const b = tokenRun(13, 0);
  BlockKeyExtras const extras{digestIdentity("lora-a"), digestIdentity("tenant-1")};
  EXPECT_EQ(hashFullBlocks(viewOf(a, extras), kPage), hashFullBlocks(viewOf(b, extras), kPage));
  EXPECT_EQ(hashFullBlocks(viewOf(a), kPage).size(), 3U);
}

TEST(BlockHashTest, EveryKeyInputChangesTheBlockDigest) {
  std::vector<int32_t> const tokens = tokenRun(kPage, 100);
  Hash128 const parent{1, 2};
  BlockKeyExtras const extras{Hash128{3, 4}, Hash128{5, 6}};
  std::vector<MediaPosition> const media = imageAt(kPage, 1, 2, Hash128{7, 8});
  Hash128 const base = hashBlock(parent, tokens, media, extras, true);

  std::set<Hash128> digests{base};
  auto const expectNew = [&](Hash128 h, char const* what) {
    EXPECT_TRUE(digests.insert(h).second) << what << " did not change the digest";
  };
  std::vector<int32_t> otherToken = tokens;
  otherToken[3] += 1;
  expectNew(hashBlock(parent, otherToken, media, extras, true), "a token");
  expectNew(hashBlock(Hash128{1, 3}, tokens, media, extras, true), "the parent");
  expectNew(hashBlock(parent, tokens, media, {Hash128{3, 5}, extras.salt}, true), "the adapter");
  expectNew(hashBlock(parent, tokens, media, {extras.adapter, Hash128{5, 7}}, true), "the salt");
  std::vector<MediaPosition> otherContent = media;
  otherContent[1].content = otherContent[2].content = Hash128{7, 9};
  expectNew(hashBlock(parent, tokens, otherContent, extras, true), "media content");
  std::vector<MediaPosition> otherOffset = media;
  otherOffset[2].offset = 5;
  expectNew(hashBlock(parent, tokens, otherOffset, extras, true), "a media offset");
  expectNew(hashBlock(parent, tokens, {}, extras, true), "dropping the media");
  expectNew(hashBlock(parent, std::span(tokens).first(3), std::span(media).first(3), extras, true),
            "the token count");
}

TEST(BlockHashTest, SaltEntersTheFirstBlockAndPropagatesThroughTheChain) {
  std::vector<int32_t> const tokens = tokenRun(3 * kPage, 0);
  BlockKeyExtras const tenantA{{}, digestIdentity("a")};
  BlockKeyExtras const tenantB{{}, digestIdentity("b")};
  // Only the first block hashes the salt itself...
  EXPECT_EQ(hashBlock(Hash128{9, 9}, std::span(tokens).first(kPage), {}, tenantA, false),
            hashBlock(Hash128{9, 9}, std::span(tokens).first(kPage), {}, tenantB, false));
  // ...but every key of the chain depends on it.
  std::vector<Hash128> const a = hashFullBlocks(viewOf(tokens, tenantA), kPage);
  std::vector<Hash128> const b = hashFullBlocks(viewOf(tokens, tenantB), kPage);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_NE(a[i], b[i]) << "block " << i;
  }
}

TEST(BlockHashTest, ExtrasDigestIsZeroExactlyForBlocksKeyedByTokensAlone) {
  std::vector<int32_t> const tokens = tokenRun(3 * kPage, 0);
  PromptBlocks const plain = hashPromptBlocks(viewOf(tokens), kPage);
  for (int32_t b = 0; b < 3; ++b) {
    EXPECT_TRUE(plain.extrasDigest(b).isZero()) << b;
  }
  BlockKeyExtras salted;
  salted.salt = digestIdentity("tenant");
  PromptBlocks const withSalt = hashPromptBlocks(viewOf(tokens, salted), kPage);
  EXPECT_FALSE(withSalt.extrasDigest(0).isZero());
  EXPECT_TRUE(withSalt.extrasDigest(1).isZero()) << "the salt enters block 0 only";
  BlockKeyExtras adapted;
  adapted.adapter = digestIdentity("lora-a");
  PromptBlocks const withAdapter = hashPromptBlocks(viewOf(tokens, adapted), kPage);
  EXPECT_FALSE(withAdapter.extrasDigest(2).isZero()) << "the adapter enters every block";
  EXPECT_NE(withAdapter.extrasDigest(0), withSalt.extrasDigest(0));
  std::vector<MediaPosition> const media = imageAt(tokens.size(), kPage + 1, 2, Hash128{7, 8});
  PromptBlocks const withImage = hashPromptBlocks(viewOf(tokens, {}, &media), kPage);
  EXPECT_TRUE(withImage.extrasDigest(0).isZero());
  EXPECT_FALSE(withImage.extrasDigest(1).isZero()) << "the block holding the image";
  EXPECT_TRUE(withImage.extrasDigest(2).isZero());
}

TEST(BlockHashTest, ChainedKeysNameTheWholePrefix) {
  std::vector<int32_t> const a = tokenRun(2 * kPage, 0);
  std::vector<int32_t> b = a;
  b[0] = 999;  // differs only in block 0
  std::vector<Hash128> const ka = hashFullBlocks(viewOf(a), kPage);
  std::vector<Hash128> const kb = hashFullBlocks(viewOf(b), kPage);
  EXPECT_NE(ka[0], kb[0]);
  EXPECT_NE(ka[1], kb[1]);  // same tokens in block 1, different parent
  EXPECT_EQ(ka[1], hashBlock(ka[0], std::span(a).subspan(kPage, kPage), {}, {}, false));
  EXPECT_EQ(ka[0], hashBlock(kBlockChainRoot, std::span(a).first(kPage), {}, {}, true));
}

TEST(BlockHashTest, PartialTailIsExcluded) {
  std::vector<int32_t> const aligned = tokenRun(2 * kPage, 0);
  std::vector<int32_t> const withTail = test::concatenated(aligned, {77, 78, 79});
  EXPECT_EQ(hashFullBlocks(viewOf(aligned), kPage), hashFullBlocks(viewOf(withTail), kPage));
  EXPECT_TRUE(hashFullBlocks(viewOf(tokenRun(kPage - 1, 0)), kPage).empty());
}

TEST(BlockHashTest, SameImageAtAnotherPositionDiffers) {
  std::vector<int32_t> const tokens(2 * kPage, 42);  // all image placeholders
  Hash128 const image{11, 12};
  std::vector<MediaPosition> const at0 = imageAt(tokens.size(), 0, 3, image);
  std::vector<MediaPosition> const at1 = imageAt(tokens.size(), 1, 3, image);
  std::vector<MediaPosition> const at0Again = imageAt(tokens.size(), 0, 3, image);
  EXPECT_EQ(hashFullBlocks(viewOf(tokens, {}, &at0), kPage),
            hashFullBlocks(viewOf(tokens, {}, &at0Again), kPage));
  EXPECT_NE(hashFullBlocks(viewOf(tokens, {}, &at0), kPage)[0],
            hashFullBlocks(viewOf(tokens, {}, &at1), kPage)[0]);
}

TEST(BlockHashTest, MultiImageOrderMatters) {
  std::vector<int32_t> const tokens(2 * kPage, 42);
  Hash128 const first{1, 1};
  Hash128 const second{2, 2};
  std::vector<MediaPosition> ab(tokens.size());
  std::vector<MediaPosition> ba(tokens.size());
  for (std::size_t i = 0; i < kPage; ++i) {
    ab[i] = {first, static_cast<int32_t>(i)};
    ab[i + kPage] = {second, static_cast<int32_t>(i)};
    ba[i] = {second, static_cast<int32_t>(i)};
    ba[i + kPage] = {first, static_cast<int32_t>(i)};
  }
  std::vector<Hash128> const kab = hashFullBlocks(viewOf(tokens, {}, &ab), kPage);
  std::vector<Hash128> const kba = hashFullBlocks(viewOf(tokens, {}, &ba), kPage);
  EXPECT_NE(kab[0], kba[0]);
  EXPECT_NE(kab[1], kba[1]);
}

TEST(BlockHashTest, AllZeroMediaIsTextOnly) {
  std::vector<int32_t> const tokens = tokenRun(3 * kPage, 0);
  std::vector<MediaPosition> const none(tokens.size());
  EXPECT_EQ(hashFullBlocks(viewOf(tokens, {}, &none), kPage),
            hashFullBlocks(viewOf(tokens), kPage));
  PromptBlocks const blocks = hashPromptBlocks(viewOf(tokens, {}, &none), kPage);
  for (Hash128 const& m : blocks.mediaDigests) {
    EXPECT_TRUE(m.isZero());
  }
}

TEST(BlockHashTest, PromptBlocksCarryKeysContentKeysAndMedia) {
  std::vector<int32_t> const tokens = tokenRun(3 * kPage + 2, 0);
  std::vector<MediaPosition> const media = imageAt(tokens.size(), kPage + 1, 2, Hash128{5, 5});
  BlockKeyExtras const extras{digestIdentity("lora"), digestIdentity("salt")};
  PromptBlocks const blocks = hashPromptBlocks(viewOf(tokens, extras, &media), kPage);
  ASSERT_EQ(blocks.fullBlockCount(), 3);
  EXPECT_EQ(blocks.tokenCount(), 3 * kPage + 2);
  EXPECT_EQ(blocks.keys, hashFullBlocks(viewOf(tokens, extras, &media), kPage));
  EXPECT_TRUE(blocks.mediaDigests[0].isZero());
  EXPECT_FALSE(blocks.mediaDigests[1].isZero());
  EXPECT_TRUE(blocks.mediaDigests[2].isZero());
  EXPECT_EQ(blocks.parentOf(0), kBlockChainRoot);
  EXPECT_EQ(blocks.parentOf(2), blocks.keys[1]);
  EXPECT_EQ(blocks.blockTokens(1)[0], kPage);
  EXPECT_EQ(blocks.blockMedia(1)[1].content, (Hash128{5, 5}));

  // The content chain ignores extras and media; the key chain does not.
  PromptBlocks const plain = hashPromptBlocks(viewOf(tokens), kPage);
  for (int32_t b = 0; b < 3; ++b) {
    EXPECT_EQ(blocks.contentKey(b), plain.contentKey(b)) << "block " << b;
  }
  EXPECT_NE(blocks.keys, plain.keys);
  std::vector<int32_t> changed = tokens;
  changed[0] = -5;
  PromptBlocks const other = hashPromptBlocks(viewOf(changed), kPage);
  EXPECT_NE(other.contentKey(2), plain.contentKey(2));
  // Content keys and block keys live in different domains.
  EXPECT_NE(plain.contentKey(0), plain.keys[0]);
  EXPECT_TRUE(hashPromptBlocks(viewOf(tokens), kPage).blockMedia(0).empty());
}

TEST(BlockHashTest, ContentKeysAreComputedOnDemandAndDoNotDependOnTheOrderAsked) {
  std::vector<int32_t> const tokens = tokenRun(5 * kPage + 3, 0);
  PromptBlocks const lazy = hashPromptBlocks(viewOf(tokens), kPage);
  EXPECT_EQ(lazy.contentKeysComputed(), 0);
  Hash128 const third = lazy.contentKey(2);
  EXPECT_EQ(lazy.contentKeysComputed(), 3);
  EXPECT_EQ(lazy.contentKey(1), lazy.contentKey(1));
  EXPECT_EQ(lazy.contentKeysComputed(), 3) << "a key already computed is not recomputed";
  Hash128 const last = lazy.contentKey(4);
  EXPECT_EQ(lazy.contentKeysComputed(), 5);
  // A fresh object asked in the other order gives the same chain.
  PromptBlocks const fresh = hashPromptBlocks(viewOf(tokens), kPage);
  EXPECT_EQ(fresh.contentKey(4), last);
  EXPECT_EQ(fresh.contentKey(2), third);
  // Every key differs from its parent's: the chain moves with each block.
  EXPECT_NE(fresh.contentKey(3), fresh.contentKey(2));
  // contentKeyAfter takes one step of the same chain from a parent content key given from outside.
  for (int32_t b = 1; b < 5; ++b) {
    EXPECT_EQ(fresh.contentKeyAfter(fresh.contentKey(b - 1), b), fresh.contentKey(b))
        << "block " << b;
  }
  EXPECT_THROW(static_cast<void>(lazy.contentKey(5)), Error);
  EXPECT_THROW(static_cast<void>(lazy.contentKey(-1)), Error);
  EXPECT_EQ(lazy.contentKeysComputed(), 5);
}

TEST(BlockHashTest, ExactPrefixDigestRules) {
  std::vector<int32_t> const tokens = tokenRun(3 * kPage + 1, 0);
  BlockKeyExtras const extras{{}, digestIdentity("s")};
  PromptView const view = viewOf(tokens, extras);
  PromptBlocks const blocks = hashPromptBlocks(view, kPage);
  EXPECT_EQ(hashExactPrefix(view, 0, kPage), kBlockChainRoot);
  EXPECT_EQ(hashExactPrefix(view, kPage, kPage), blocks.keys[0]);
  EXPECT_EQ(hashExactPrefix(view, 3 * kPage, kPage), blocks.keys[2]);
  EXPECT_EQ(hashExactPrefix(view, kPage + 2, kPage),
            hashBlock(blocks.keys[0], std::span(tokens).subspan(kPage, 2), {}, extras, false));
  // A sub-page prefix is a first block: the salt enters.
  EXPECT_EQ(hashExactPrefix(view, 2, kPage),
            hashBlock(kBlockChainRoot, std::span(tokens).first(2), {}, extras, true));
  std::set<Hash128> distinct;
  for (int32_t length = 0; length <= blocks.tokenCount(); ++length) {
    Hash128 const digest = hashExactPrefix(view, length, kPage);
    EXPECT_EQ(exactPrefixDigest(blocks, length), digest) << length;
    EXPECT_TRUE(distinct.insert(digest).second) << "length " << length << " collides";
  }
}

TEST(BlockHashTest, RejectsMalformedInput) {
  std::vector<int32_t> const tokens = tokenRun(8, 0);
  std::vector<MediaPosition> const shortMedia(3);
  EXPECT_THROW(hashFullBlocks(viewOf(tokens), 0), Error);
  EXPECT_THROW(hashPromptBlocks(viewOf(tokens, {}, &shortMedia), kPage), Error);
  EXPECT_THROW(hashExactPrefix(viewOf(tokens), 9, kPage), Error);
  EXPECT_THROW(hashExactPrefix(viewOf(tokens), -1, kPage), Error);
  EXPECT_THROW(hashBlock(kBlockChainRoot, tokens, shortMedia, {}, true), Error);
  PromptBlocks const blocks = hashPromptBlocks(viewOf(tokens), kPage);
  EXPECT_THROW(exactPrefixDigest(blocks, 9), Error);
}

TEST(BlockHashTest, OpaqueDigests) {
  EXPECT_TRUE(digestIdentity("").isZero());
  EXPECT_FALSE(digestIdentity("lora").isZero());
  EXPECT_NE(digestIdentity("lora-a"), digestIdentity("lora-b"));
  EXPECT_EQ(digestIdentity("lora-a"), digestIdentity(std::string("lora-a")));
  std::vector<std::byte> bytes(100, std::byte{1});
  Hash128 const full = digestBytes(bytes);
  EXPECT_NE(full, digestBytes(std::span(bytes).first(99)));
  bytes[50] = std::byte{2};
  EXPECT_NE(full, digestBytes(bytes));
  EXPECT_EQ(toString(Hash128{0x1, 0xabc}),
            "0000000000000001"
            "0000000000000abc");
}

TEST(BlockHashTest, ImageAndAudioDigests) {
  auto pixels = std::make_shared<Tensor>(Coords{2, 2, 3}, DataType::kUInt8, DeviceType::kCPU);
  imageUtils::ImageData image{pixels, 2, 2, 3};
  std::optional<Hash128> const black = digestImage(image);
  ASSERT_TRUE(black.has_value());
  pixels->dataPointer<uint8_t>()[5] = 200;
  EXPECT_NE(digestImage(image), black);
  EXPECT_FALSE(digestImage(imageUtils::ImageData{}).has_value()) << "no pixels: bypass";
  imageUtils::ImageData wrongShape{pixels, 3, 2, 3};
  EXPECT_FALSE(digestImage(wrongShape).has_value());

  audioUtils::AudioData pcm{std::make_shared<std::vector<float>>(16, 0.5F), ""};
  audioUtils::AudioData otherPcm{std::make_shared<std::vector<float>>(16, 0.25F), ""};
  audioUtils::AudioData mel{nullptr, "/tmp/mel.npy"};
  EXPECT_NE(digestAudio(pcm), digestAudio(otherPcm));
  EXPECT_EQ(digestAudio(mel), digestIdentity("/tmp/mel.npy"));
  EXPECT_NE(digestAudio(pcm), digestAudio(mel));
}

TEST(BlockHashTest, DigestFormatIsStable) {
  // Pins the key format: routers and persisted event streams rely on digests not changing
  // between versions. Update deliberately (and say so in the changelog) if the format changes.
  std::vector<int32_t> const tokens = tokenRun(8, 0);
  std::vector<Hash128> const keys = hashFullBlocks(viewOf(tokens), kPage);
  EXPECT_EQ(toString(keys[0]), "22cbbe7aaff448a610bfcf947480ae62");
  EXPECT_EQ(toString(keys[1]), "f4ecc1a348eca18445c71339db7f3d78");
}

}  // namespace
}  // namespace mkv
