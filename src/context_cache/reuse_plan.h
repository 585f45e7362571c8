#pragma once
/// \file reuse_plan.h
/// ReusePlan and the pure planner functions of context reuse (docs/context_cache.md, "Lookup and
/// acquire").
///
/// Every planner reads the block index and the record store through const references and changes
/// nothing (no refcount, no LRU order, no metric). A plan is consumed by
/// ContextCacheManager::acquire, which validates it against the current state.
///
/// Thread-safety: the functions are pure; they may run concurrently with other const readers of
/// the same index and store, never with a writer.

#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/block_index.h"
#include "context_cache/cache_record.h"
#include "context_cache/host_block_tier.h"
#include "context_cache/record_store.h"
#include "context_cache/resource_pools.h"
#include "context_cache/window_block_cache.h"
#include "mkv/types.h"

namespace mkv {

enum class ReusePlanKind : uint8_t {
  kStandard,          ///< reuses a prefix
  kNoReusablePrefix,  ///< cold: reuses nothing (miss or bypass)
  kFullInputRewind,   ///< the whole page-aligned input matched; its last page is recomputed
};
enum class SpecReplayMode : uint8_t { kNone, kFullPage };

/// A replayed spec plan bound a shorter path than it matched; the publication of the consumer must
/// cover at least pathBlockCount blocks and its block pathBlockCount - 1 must have this digest.
struct SpecReplayDependency {
  int32_t pathBlockCount = 0;
  Hash128 terminalDigest;
  friend bool operator==(SpecReplayDependency const&, SpecReplayDependency const&) = default;
};

/// Exact checkpoint a hybrid plan reuses.
struct HybridCheckpoint {
  Hash128 exactDigest;
  int32_t exactLength = 0;
  friend bool operator==(HybridCheckpoint const&, HybridCheckpoint const&) = default;
};

/// What a request reuses and what it must allocate. Lengths are tokens, bindings page ids / slots.
struct ReusePlan {
  ReuseMode mode = ReuseMode::kVanilla;
  ReusePlanKind kind = ReusePlanKind::kNoReusablePrefix;
  int32_t inputTokenLength = 0;
  /// Tokens whose cached state was found, before any rewind or replay.
  int32_t matchedTokenLength = 0;
  /// Tokens whose state is bound and need not be recomputed: execution starts here.
  int32_t reuseTokenLength = 0;
  /// Block keys of the reused blocks (the bound prefix); publication must agree with them.
  std::vector<Hash128> matchedBlockDigests;
  /// Shared base pages of the reused blocks (empty for pure-recurrent checkpoints).
  std::vector<PageId> basePageBindings;

  RecordId specRecord = kNoRecord;        ///< spec / Hybrid+MTP: producer of the draft path
  std::vector<PageId> draftPageBindings;  ///< its draft pages of the reused blocks
  std::optional<SpecReplayDependency> specReplayDependency;
  SpecReplayMode specReplayMode = SpecReplayMode::kNone;

  bool hybridHasAttention = true;  ///< false: pure recurrent (no KV pages at all)
  RecordId hybridRecord = kNoRecord;
  std::optional<HybridCheckpoint> hybridCheckpoint;
  std::optional<SnapshotSlot> recurrentSnapshotBinding;  ///< restore source
  std::optional<SnapshotSlot> partialKvSnapshotBinding;  ///< restore source (partial page)

  /// Host tier (vanilla plans only): host pages of the blocks right after the bound prefix, which
  /// the lease's first private base pages receive before the prefill (onboarding), and their
  /// keys. Their tokens count in matchedTokenLength and reuseTokenLength; their pages in demand.
  std::vector<PageId> hostOnboardPages;
  std::vector<Hash128> hostOnboardDigests;

  /// Private resources to allocate at acquire (snapshot reservations come later).
  ResourceDemand demand;

  /// Diagnostics of the lookup: leading blocks found in the block index or, after it, in the host
  /// tier (verified), and how many digest hits verification refused while planning.
  int32_t indexedPrefixBlocks = 0;
  int32_t verificationRejects = 0;
  /// Window rule (vanilla plans with a WindowBlockCache): tokens the full layers could reuse that
  /// the plan does not, because the sliding layers' window before them is not cached (0: not
  /// capped). Such a lookup's miss reason is MissReason::kWindowEvicted.
  int32_t windowLimitedTokens = 0;

  /// True when the plan reuses anything (binds cached pages or rewinds a full input).
  bool isCacheDerived() const noexcept {
    return reuseTokenLength > 0 || kind == ReusePlanKind::kFullInputRewind;
  }
};

/// Reuses nothing; demand = every input page: base ceil(n / page) unless pure recurrent
/// (!hasAttention), draft the same when `pairedDraft`.
ReusePlan makeColdReusePlan(ReuseMode mode, int32_t inputTokens, int32_t pageSize,
                            bool hasAttention, bool pairedDraft);

/// Page-aligned longest verified prefix: blocks in `index`, then (with a host tier, when the GPU
/// run ended at a plain miss) the blocks right after them that `hostTier` holds, to be onboarded;
/// at most `maxBlocks` blocks are looked at (>= 0; the window rule's cap). A fully matched
/// page-aligned input drops its last page (kFullInputRewind) so the last token is recomputed for
/// logits. Demand = pages - bound (onboarded blocks need fresh pages). kBypass gives the cold
/// plan.
ReusePlan makeVanillaReusePlan(BlockIndex const& index, PromptBlocks const& blocks,
                               ContextCacheLookupPolicy policy,
                               HostBlockTier const* hostTier = nullptr,
                               int32_t maxBlocks = std::numeric_limits<int32_t>::max());

/// The vanilla plan under the window rule of the composed backend (docs/context_cache.md,
/// "Window rule"): when the plan of `index` binds k blocks (a kFullInputRewind plan binds the
/// n - 1 it keeps), the reusable prefix is k' = window.longestWindowedPrefix(blocks, k); k' < k
/// re-plans with at most k' blocks (k' = 0: the cold plan) and records the tokens taken away in
/// windowLimitedTokens. No host tier (the coordinator refuses one beside a window cache).
ReusePlan makeWindowedReusePlan(BlockIndex const& index, WindowBlockCache const& window,
                                PromptBlocks const& blocks, ContextCacheLookupPolicy policy);

/// Longest stored exact checkpoint strictly shorter than the input whose logical blocks equal the
/// input's, with a recurrent snapshot, a partial-KV snapshot iff attention and length % page != 0,
/// and a complete base path (none for pure recurrent). Reuse = the checkpoint length (may be
/// mid-page). Demand = pages - full blocks (0 for pure recurrent).
ReusePlan makeHybridReusePlan(BlockIndex const& index, RecordStore const& records,
                              PromptBlocks const& blocks, bool hasAttention,
                              ContextCacheLookupPolicy policy);

/// As makeHybridReusePlan with the boundary token kept private: full blocks = (length - 1) / page,
/// both snapshots mandatory, base and draft paths of exactly that many pages. Demand base = draft
/// = pages - full blocks.
ReusePlan makeHybridMtpReusePlan(BlockIndex const& index, RecordStore const& records,
                                 PromptBlocks const& blocks, ContextCacheLookupPolicy policy);

/// EAGLE-style paired reuse: the longest coherent spec path (one producer) not longer than the
/// verified base match; base-only records are ignored (paged contracts). The last
/// max(ceil(futureDependencyTokens / page), 1 if the whole page-aligned input matched) pages are
/// replayed; a replayed path records the dependency its publication must cover.
ReusePlan makeSpecReusePlan(BlockIndex const& index, RecordStore const& records,
                            PromptBlocks const& blocks, SpecReuseContract const& contract,
                            ContextCacheLookupPolicy policy);

/// Raises the private demand so bound + private pages cover `baseTokens` base and `draftTokens`
/// draft positions (0 = no requirement), e.g. input + decoding headroom.
void requireKvPageCoverage(ReusePlan& plan, int32_t pageSize, int32_t baseTokens,
                           int32_t draftTokens);

/// Why a kUseCache lookup with this plan did not reuse all full blocks, or nullopt when it did:
/// kWindowEvicted when the window rule capped the plan (windowLimitedTokens > 0); else
/// kShorterThanOnePage when the input has no full block (and nothing was reused); else, looking at
/// the first block missing from the index: kEvicted when its key was evicted recently; salt / LoRA
/// / media mismatch when the same token content is indexed under another identity: of those
/// identities the nearest one (matching the most of salt, adapter, media) names the reason by its
/// first differing field in that order (ties: salt, then LoRA, then media); otherwise kNoPrefix.
std::optional<MissReason> classifyMiss(BlockIndex const& index, PromptBlocks const& blocks,
                                       ReusePlan const& plan);

}  // namespace mkv
