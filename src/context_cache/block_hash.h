#pragma once
/// \file block_hash.h
/// Chained XXH3-128 block keys for context reuse (docs/context_cache.md, "Keys").
///
/// A *block* is one full page of tokens. Block i of a prompt is keyed by
///   key_i = XXH3-128(parent key, XXH3-128(token ids of the block), digest of the block's media
///                    positions, adapter digest, salt digest on block 0 only, token count)
/// with parent key = key_{i-1} and key_{-1} = kBlockChainRoot. Chaining makes a key name the whole
/// prefix up to and including its block. A second, *content* chain over the token ids alone (no
/// extras, no media) is kept for diagnostics: it lets the cache tell "same text under another
/// salt / adapter / image" apart from "never seen" (see MissReason).
///
/// Digests hash the in-memory bytes of int32 token ids; the library assumes a little-endian host
/// (enforced at compile time), so digests are identical across supported machines.
///
/// Thread-safety: every function here is pure and may be called from any thread.

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/context_cache/context_cache_types.h"
#include "mkv/media.h"

namespace mkv {

/// A token sequence as the cache sees it. Nothing is owned. `media` is empty for text-only prompts
/// or holds exactly one entry per token.
struct PromptView {
  std::span<int32_t const> tokens;
  std::span<MediaPosition const> media;
  BlockKeyExtras extras;
};

/// The full blocks of a prompt: the key chain, each block's token and media digests, and (computed
/// on first use) the token-only content chain. Produced by hashPromptBlocks(); `prompt` still
/// refers to the caller's tokens and media, which must outlive this value.
///
/// Only publication (indexing a new block) and miss classification need content keys, and they
/// need them rarely compared with lookups; a lookup whose verification walks the path from block 0
/// compares the token ids themselves, which already implies equal content. So the content chain is
/// not computed with the keys: contentKey(b) extends a memo from the stored token digests, one
/// 48-byte XXH3 step per block, the first time a block at or past b is asked for. The memo makes
/// concurrent const use of one PromptBlocks unsafe; it is a per-request value.
struct PromptBlocks {
  PromptView prompt;
  int32_t pageSize = 0;               ///< tokens per block
  std::vector<Hash128> keys;          ///< key_i, one per full block (the partial tail has none)
  std::vector<Hash128> tokenDigests;  ///< per full block the XXH3-128 of its token ids
  std::vector<Hash128>
      mediaDigests;  ///< per full block its media digest; zero for text-only blocks

  int32_t fullBlockCount() const noexcept { return static_cast<int32_t>(keys.size()); }
  int32_t tokenCount() const noexcept { return static_cast<int32_t>(prompt.tokens.size()); }
  /// keys[block - 1], or kBlockChainRoot for block 0.
  Hash128 parentOf(int32_t block) const noexcept;
  /// Token ids of full block `block` (pageSize of them).
  std::span<int32_t const> blockTokens(int32_t block) const noexcept;
  /// Media positions of full block `block`; empty when the prompt is text-only.
  std::span<MediaPosition const> blockMedia(int32_t block) const noexcept;
  /// Identity of what enters key `block` besides its token ids and its parent (its media digest,
  /// the adapter, the salt on block 0): zero when none of them is set, so a consumer that hashes
  /// token ids alone (a KV-aware router) can tell which blocks it can match.
  Hash128 extrasDigest(int32_t block) const noexcept;
  /// Token-only chain digest of full block `block` (ignores media, adapter and salt): equal for
  /// two prompts exactly when their first block+1 blocks hold the same token ids (up to XXH3-128
  /// collisions). Throws mkv::Error when `block` is outside [0, fullBlockCount()).
  Hash128 contentKey(int32_t block) const;
  /// contentKey(block) from the content key of block - 1 taken elsewhere (an index entry the
  /// caller matched block by block): one chain step, no walk from block 0, the memo untouched.
  /// `parentContentKey` is ignored for block 0. Throws mkv::Error when `block` is out of range.
  Hash128 contentKeyAfter(Hash128 parentContentKey, int32_t block) const;
  /// How many content keys have been computed so far (observability for tests and benchmarks).
  int32_t contentKeysComputed() const noexcept { return static_cast<int32_t>(mContentKeys.size()); }

 private:
  mutable std::vector<Hash128> mContentKeys;  ///< content chain memo, a prefix of the blocks
};

/// Keys, token digests and media digests of every full block of `prompt` (partial tail excluded).
/// Throws mkv::Error when pageSize <= 0, the prompt exceeds INT32_MAX tokens, or `media` is neither
/// empty nor one entry per token.
PromptBlocks hashPromptBlocks(PromptView prompt, int32_t pageSize);

/// Keys only (the publication and benchmark path): keys of hashPromptBlocks(prompt, pageSize).
std::vector<Hash128> hashFullBlocks(PromptView prompt, int32_t pageSize);

/// Digest of the exact prefix prompt[0, length): kBlockChainRoot for length 0, the last full
/// block's key for a page-aligned length, otherwise a key over the partial final block chained on
/// the preceding full block (used by hybrid checkpoints). Throws for length outside [0, tokens].
Hash128 hashExactPrefix(PromptView prompt, int32_t length, int32_t pageSize);
/// The same digest, reusing the already computed full-block keys of `blocks`: O(page) work.
Hash128 exactPrefixDigest(PromptBlocks const& blocks, int32_t length);

/// Key of one block of `tokens.size()` tokens (a full page, or a partial final block) chained on
/// `parent`; `media` is empty or one entry per token; the salt enters only when `firstBlock`.
Hash128 hashBlock(Hash128 parent, std::span<int32_t const> tokens,
                  std::span<MediaPosition const> media, BlockKeyExtras const& extras,
                  bool firstBlock);

/// Digest of opaque bytes: image pixels, PCM samples, a mel path, an adapter name, a salt.
Hash128 digestBytes(std::span<std::byte const> bytes) noexcept;
/// The extras digest of a block (PromptBlocks::extrasDigest) from its parts: zero when all three
/// are zero, else one digest of them. `firstBlockSalt` is the salt for block 0, zero otherwise.
Hash128 extrasDigestOf(Hash128 media, Hash128 adapter, Hash128 firstBlockSalt) noexcept;
/// Identity digest of a name (LoRA adapter, cache salt): zero for the empty name ("none").
Hash128 digestIdentity(std::string_view name) noexcept;
/// Content digest of a host-readable packed RGB image, or nullopt when the host cannot read the
/// pixels (the request then goes on bypass rather than failing: docs/context_cache.md, "Keys").
std::optional<Hash128> digestImage(imageUtils::ImageData const& image) noexcept;
/// Content digest of an audio clip: over the PCM samples when present, else over the mel path.
Hash128 digestAudio(audioUtils::AudioData const& audio) noexcept;

}  // namespace mkv
