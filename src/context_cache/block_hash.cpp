#include "context_cache/block_hash.h"

#include <algorithm>
#include <array>
#include <bit>
#include <limits>

#include "core/check.h"

// The only translation unit that instantiates xxHash (header-only, everything static inline).
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace mkv {

static_assert(std::endian::native == std::endian::little,
              "block digests hash int32 token ids in little-endian byte order");

namespace {

// Domain tags keep the kinds of digests disjoint: a block key can never equal a content key or
// an opaque-bytes digest over the same bytes.
constexpr uint64_t kKeyDomain = 0x6d6b762e626c6b31ULL;      // "mkv.blk1"
constexpr uint64_t kContentDomain = 0x6d6b762e74786b31ULL;  // "mkv.txk1"
constexpr uint64_t kMediaDomain = 0x6d6b762e6d656431ULL;    // "mkv.med1"
constexpr uint64_t kOpaqueDomain = 0x6d6b762e6f706131ULL;   // "mkv.opa1"

Hash128 fromXxh(XXH128_hash_t h) noexcept { return {h.high64, h.low64}; }

// Fixed-layout inputs of the chaining steps. Hashing a packed struct in one XXH3 call is cheaper
// than the streaming API (no state setup) and allocates nothing.
struct KeyStep {
  uint64_t domain = 0;
  uint64_t tokenCount = 0;
  Hash128 parent{};
  Hash128 tokens{};
  Hash128 media{};
  Hash128 adapter{};
  Hash128 salt{};
};
static_assert(sizeof(KeyStep) == 96, "KeyStep must have no padding");

struct ContentStep {
  uint64_t domain = 0;
  uint64_t tokenCount = 0;
  Hash128 parent{};
  Hash128 tokens{};
};
static_assert(sizeof(ContentStep) == 48, "ContentStep must have no padding");

struct MediaEntry {
  int32_t positionInBlock;
  int32_t offset;
  uint64_t contentHi;
  uint64_t contentLo;
};
static_assert(sizeof(MediaEntry) == 24, "MediaEntry must have no padding");

Hash128 tokenDigest(std::span<int32_t const> tokens) noexcept {
  return fromXxh(XXH3_128bits(tokens.data(), tokens.size_bytes()));
}

// Digest of the media positions of one block: zero when none of its positions is media.
// Entries are batched on the stack so a long image run costs one streaming update per 64.
Hash128 mediaDigest(std::span<MediaPosition const> media) noexcept {
  auto const isMedia = [](MediaPosition const& m) { return !m.content.isZero(); };
  if (std::none_of(media.begin(), media.end(), isMedia)) {
    return {};
  }
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset_withSeed(&state, kMediaDomain);
  std::array<MediaEntry, 64> batch{};
  std::size_t used = 0;
  for (std::size_t i = 0; i < media.size(); ++i) {
    if (!isMedia(media[i])) {
      continue;
    }
    batch[used++] = MediaEntry{static_cast<int32_t>(i), media[i].offset, media[i].content.hi,
                               media[i].content.lo};
    if (used == batch.size()) {
      XXH3_128bits_update(&state, batch.data(), used * sizeof(MediaEntry));
      used = 0;
    }
  }
  if (used > 0) {
    XXH3_128bits_update(&state, batch.data(), used * sizeof(MediaEntry));
  }
  return fromXxh(XXH3_128bits_digest(&state));
}

Hash128 keyStep(Hash128 parent, Hash128 tokens, std::size_t tokenCount, Hash128 media,
                BlockKeyExtras const& extras, bool firstBlock) noexcept {
  KeyStep const step{kKeyDomain,
                     tokenCount,
                     parent,
                     tokens,
                     media,
                     extras.adapter,
                     firstBlock ? extras.salt : Hash128{}};
  return fromXxh(XXH3_128bits(&step, sizeof(step)));
}

Hash128 contentStep(Hash128 parent, Hash128 tokens, std::size_t tokenCount) noexcept {
  ContentStep const step{kContentDomain, tokenCount, parent, tokens};
  return fromXxh(XXH3_128bits(&step, sizeof(step)));
}

void validatePrompt(char const* call, PromptView const& prompt, int32_t pageSize) {
  MKV_REQUIRE(pageSize > 0, call, "page size must be positive, got {}", pageSize);
  MKV_REQUIRE(prompt.tokens.size() <= static_cast<std::size_t>(std::numeric_limits<int32_t>::max()),
              call, "prompt of {} tokens exceeds INT32_MAX", prompt.tokens.size());
  MKV_REQUIRE(prompt.media.empty() || prompt.media.size() == prompt.tokens.size(), call,
              "media must be empty or one entry per token: {} entries for {} tokens",
              prompt.media.size(), prompt.tokens.size());
}

std::span<MediaPosition const> mediaSlice(PromptView const& prompt, std::size_t begin,
                                          std::size_t count) noexcept {
  return prompt.media.empty() ? std::span<MediaPosition const>{}
                              : prompt.media.subspan(begin, count);
}

}  // namespace

std::string toString(Hash128 h) { return fmt::format("{:016x}{:016x}", h.hi, h.lo); }

Hash128 PromptBlocks::parentOf(int32_t block) const noexcept {
  return block == 0 ? kBlockChainRoot : keys[static_cast<std::size_t>(block - 1)];
}

std::span<int32_t const> PromptBlocks::blockTokens(int32_t block) const noexcept {
  return prompt.tokens.subspan(static_cast<std::size_t>(block) * static_cast<std::size_t>(pageSize),
                               static_cast<std::size_t>(pageSize));
}

std::span<MediaPosition const> PromptBlocks::blockMedia(int32_t block) const noexcept {
  return mediaSlice(prompt, static_cast<std::size_t>(block) * static_cast<std::size_t>(pageSize),
                    static_cast<std::size_t>(pageSize));
}

Hash128 PromptBlocks::extrasDigest(int32_t block) const noexcept {
  return extrasDigestOf(mediaDigests[static_cast<std::size_t>(block)], prompt.extras.adapter,
                        block == 0 ? prompt.extras.salt : Hash128{});
}

Hash128 extrasDigestOf(Hash128 media, Hash128 adapter, Hash128 firstBlockSalt) noexcept {
  std::array<Hash128, 3> const parts{media, adapter, firstBlockSalt};
  if (std::all_of(parts.begin(), parts.end(), [](Hash128 h) { return h.isZero(); })) {
    return {};
  }
  return digestBytes(std::as_bytes(std::span(parts)));
}

Hash128 hashBlock(Hash128 parent, std::span<int32_t const> tokens,
                  std::span<MediaPosition const> media, BlockKeyExtras const& extras,
                  bool firstBlock) {
  MKV_REQUIRE(media.empty() || media.size() == tokens.size(), "hashBlock",
              "media must be empty or one entry per token: {} entries for {} tokens", media.size(),
              tokens.size());
  return keyStep(parent, tokenDigest(tokens), tokens.size(), mediaDigest(media), extras,
                 firstBlock);
}

Hash128 PromptBlocks::contentKey(int32_t block) const {
  MKV_REQUIRE(block >= 0 && block < fullBlockCount(), "PromptBlocks::contentKey",
              "block {} outside [0, {})", block, fullBlockCount());
  auto const wanted = static_cast<std::size_t>(block);
  if (wanted >= mContentKeys.size()) {
    mContentKeys.reserve(keys.size());
    Hash128 parent = mContentKeys.empty() ? kBlockChainRoot : mContentKeys.back();
    auto const page = static_cast<std::size_t>(pageSize);
    for (std::size_t b = mContentKeys.size(); b <= wanted; ++b) {
      parent = contentStep(parent, tokenDigests[b], page);
      mContentKeys.push_back(parent);
    }
  }
  return mContentKeys[wanted];
}

Hash128 PromptBlocks::contentKeyAfter(Hash128 parentContentKey, int32_t block) const {
  MKV_REQUIRE(block >= 0 && block < fullBlockCount(), "PromptBlocks::contentKeyAfter",
              "block {} outside [0, {})", block, fullBlockCount());
  return contentStep(block == 0 ? kBlockChainRoot : parentContentKey,
                     tokenDigests[static_cast<std::size_t>(block)],
                     static_cast<std::size_t>(pageSize));
}

PromptBlocks hashPromptBlocks(PromptView prompt, int32_t pageSize) {
  validatePrompt("hashPromptBlocks", prompt, pageSize);
  PromptBlocks blocks;
  blocks.prompt = prompt;
  blocks.pageSize = pageSize;
  auto const page = static_cast<std::size_t>(pageSize);
  std::size_t const count = prompt.tokens.size() / page;
  blocks.keys.resize(count);
  blocks.tokenDigests.resize(count);
  blocks.mediaDigests.resize(count);
  Hash128 parent = kBlockChainRoot;
  for (std::size_t b = 0; b < count; ++b) {
    Hash128 const tokens = tokenDigest(prompt.tokens.subspan(b * page, page));
    Hash128 const media =
        prompt.media.empty() ? Hash128{} : mediaDigest(prompt.media.subspan(b * page, page));
    parent = keyStep(parent, tokens, page, media, prompt.extras, b == 0);
    blocks.keys[b] = parent;
    blocks.tokenDigests[b] = tokens;
    blocks.mediaDigests[b] = media;
  }
  return blocks;
}

std::vector<Hash128> hashFullBlocks(PromptView prompt, int32_t pageSize) {
  validatePrompt("hashFullBlocks", prompt, pageSize);
  auto const page = static_cast<std::size_t>(pageSize);
  std::size_t const count = prompt.tokens.size() / page;
  std::vector<Hash128> keys(count);
  Hash128 parent = kBlockChainRoot;
  if (prompt.media.empty()) {
    for (std::size_t b = 0; b < count; ++b) {
      parent = keyStep(parent, tokenDigest(prompt.tokens.subspan(b * page, page)), page, {},
                       prompt.extras, b == 0);
      keys[b] = parent;
    }
    return keys;
  }
  for (std::size_t b = 0; b < count; ++b) {
    parent = keyStep(parent, tokenDigest(prompt.tokens.subspan(b * page, page)), page,
                     mediaDigest(prompt.media.subspan(b * page, page)), prompt.extras, b == 0);
    keys[b] = parent;
  }
  return keys;
}

Hash128 hashExactPrefix(PromptView prompt, int32_t length, int32_t pageSize) {
  validatePrompt("hashExactPrefix", prompt, pageSize);
  MKV_REQUIRE(length >= 0 && static_cast<std::size_t>(length) <= prompt.tokens.size(),
              "hashExactPrefix", "length {} outside [0, {}]", length, prompt.tokens.size());
  PromptView head = prompt;
  head.tokens = prompt.tokens.first(static_cast<std::size_t>(length));
  head.media = mediaSlice(prompt, 0, static_cast<std::size_t>(length));
  std::vector<Hash128> const keys = hashFullBlocks(head, pageSize);
  int32_t const full = length / pageSize;
  Hash128 const parent = keys.empty() ? kBlockChainRoot : keys.back();
  if (length == full * pageSize) {
    return parent;
  }
  auto const begin = static_cast<std::size_t>(full) * static_cast<std::size_t>(pageSize);
  auto const tail = static_cast<std::size_t>(length) - begin;
  return hashBlock(parent, prompt.tokens.subspan(begin, tail), mediaSlice(prompt, begin, tail),
                   prompt.extras, full == 0);
}

Hash128 exactPrefixDigest(PromptBlocks const& blocks, int32_t length) {
  MKV_REQUIRE(length >= 0 && length <= blocks.tokenCount(), "exactPrefixDigest",
              "length {} outside [0, {}]", length, blocks.tokenCount());
  int32_t const full = length / blocks.pageSize;
  if (length == full * blocks.pageSize) {
    return blocks.parentOf(full);
  }
  auto const begin = static_cast<std::size_t>(full) * static_cast<std::size_t>(blocks.pageSize);
  auto const tail = static_cast<std::size_t>(length) - begin;
  return hashBlock(blocks.parentOf(full), blocks.prompt.tokens.subspan(begin, tail),
                   mediaSlice(blocks.prompt, begin, tail), blocks.prompt.extras, full == 0);
}

Hash128 digestBytes(std::span<std::byte const> bytes) noexcept {
  return fromXxh(XXH3_128bits_withSeed(bytes.data(), bytes.size(), kOpaqueDomain));
}

BlockKeyExtras blockKeyExtras(std::string_view loraWeightsName, std::string_view cacheSalt) {
  return BlockKeyExtras{digestIdentity(loraWeightsName), digestIdentity(cacheSalt)};
}

Hash128 digestIdentity(std::string_view name) noexcept {
  if (name.empty()) {
    return {};
  }
  return digestBytes(std::as_bytes(std::span<char const>(name.data(), name.size())));
}

std::optional<Hash128> digestImage(imageUtils::ImageData const& image) noexcept {
  uint8_t const* pixels = image.data();
  if (pixels == nullptr) {
    return std::nullopt;
  }
  return digestBytes(std::as_bytes(
      std::span<uint8_t const>(pixels, static_cast<std::size_t>(image.packedBytes()))));
}

Hash128 digestAudio(audioUtils::AudioData const& audio) noexcept {
  if (audio.pcm && !audio.pcm->empty()) {
    return digestBytes(std::as_bytes(std::span<float const>(*audio.pcm)));
  }
  return digestIdentity(audio.melSpectrogramPath);
}

}  // namespace mkv
