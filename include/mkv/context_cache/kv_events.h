#pragma once
/// \file kv_events.h
/// The block-index events a KV-aware router consumes (docs/context_cache.md, "Observability"):
/// ContextCacheCoordinator::drainEvents returns them, KvEventPublisher sends them.
///
/// Thread-safety: plain value types.

#include <cstdint>
#include <variant>
#include <vector>

#include "mkv/context_cache/context_cache_types.h"
#include "mkv/types.h"

namespace mkv {

/// Where a block's KV lives: the GPU cache (the base KV pool), the host tier (pinned host
/// memory; docs/context_cache.md, "Host tier") or the remote tier's store (shared with other
/// engines; "Remote tier": a BlockStored when the store accepted a save, page kNoPage; the store
/// evicts on its own, so no BlockRemoved). vLLM's events name it `medium`.
enum class KvMedium : uint8_t { kGpu, kCpu, kRemote };

/// What the layers of a KV cache group attend to (vLLM's `kv_cache_spec_kind`).
enum class KvCacheSpecKind : uint8_t {
  kUnspecified,    ///< a deployment with one group: the events carry no group fields
  kFullAttention,  ///< "full_attention": every earlier token
  kSlidingWindow,  ///< "sliding_window": the last `slidingWindowTokens` tokens
};

/// The KV cache group a block event belongs to (vLLM's `group_idx` with its spec). Set on the
/// events of the composed backend (sliding layers with context reuse), whose blocks live in two
/// pools: group 0 the full-attention layers' pages, group 1 the sliding layers' window cache.
/// Left unspecified elsewhere (one pool: the wire carries no group fields).
struct KvCacheGroup {
  int32_t index = 0;
  KvCacheSpecKind kind = KvCacheSpecKind::kUnspecified;
  int32_t slidingWindowTokens = 0;  ///< kSlidingWindow: the window W; else 0
  bool specified() const noexcept { return kind != KvCacheSpecKind::kUnspecified; }
  friend bool operator==(KvCacheGroup const&, KvCacheGroup const&) = default;
};

/// The composed backend's two groups: its full-attention layers' blocks, and the windows of its
/// sliding layers (W = `windowTokens`).
inline constexpr KvCacheGroup kFullAttentionGroup{0, KvCacheSpecKind::kFullAttention, 0};
constexpr KvCacheGroup slidingWindowGroup(int32_t windowTokens) noexcept {
  return {1, KvCacheSpecKind::kSlidingWindow, windowTokens};
}

/// A block became reusable: `digest` is now indexed on `page` (a page of `medium`: a base KV pool
/// id, or a host tier page; of the sliding pool for group 1 of the composed backend).
struct BlockStored {
  Hash128 digest;
  Hash128 parent;  ///< previous block's digest, kBlockChainRoot for a first block
  PageId page = kNoPage;
  int32_t tokenCount = 0;
  /// The block's token ids (`tokenCount` of them) when the queue keeps tokens, else empty. Routers
  /// re-hash them to match prompts against the block.
  std::vector<int32_t> tokens{};
  /// PromptBlocks::extrasDigest of the block: zero when its key depends on its token ids and its
  /// parent alone; otherwise an identity of its media, adapter and (block 0) salt.
  Hash128 extras{};
  KvMedium medium = KvMedium::kGpu;
  KvCacheGroup group{};
  friend bool operator==(BlockStored const&, BlockStored const&) = default;
};

/// A block stopped being reusable in `medium`: on the GPU, its page lost its last cache reference
/// (an offloaded block is then stored in the host tier); in the host tier, it was evicted for good;
/// in the composed backend's sliding pool (group 1), its window page was taken for another window.
struct BlockRemoved {
  Hash128 digest;
  PageId page = kNoPage;
  KvMedium medium = KvMedium::kGpu;
  KvCacheGroup group{};
  friend bool operator==(BlockRemoved const&, BlockRemoved const&) = default;
};

/// Every block stopped being reusable at once: the cache dropped all its records
/// (ContextCacheManager::resetPrefixCache), in every group and medium. Replaces the per-block
/// BlockRemoved events.
struct AllBlocksCleared {
  friend bool operator==(AllBlocksCleared const&, AllBlocksCleared const&) = default;
};

using KvEvent = std::variant<BlockStored, BlockRemoved, AllBlocksCleared>;

}  // namespace mkv
