#pragma once
/// \file context_cache_config.h
/// The settings of context reuse: the coordinator's ContextCacheConfig (also a member of
/// KVCacheRuntimeConfig) and the deployment profile it serves. Plain value types, apart from the
/// coordinator (context_cache_coordinator.h) so that the entry headers name them without it.
///
/// Thread-safety: plain value types.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "mkv/context_cache/context_cache_types.h"
#include "mkv/types.h"

namespace mkv {

/// Context-cache settings of a runtime.
class RemoteKvStore;  // mkv/remote_kv_store.h

/// The remote tier (docs/context_cache.md, "Remote tier"): KV blocks in a store other engines
/// share (Redis, a shared directory: managedkv::remote's openRemoteKvStore), behind the GPU and
/// host tiers. Loads go into the host tier and reach the GPU as host-tier hits; saves read the
/// host tier's copy of each published block. Store calls run on a thread of the tier's own.
struct RemoteTierConfig {
  /// Opens one connection to the store; called twice at construction (the worker thread's and
  /// the engine thread's lookups), e.g. `[] { return openRemoteKvStore("redis://127.0.0.1:6379");
  /// }`. Required.
  std::function<std::unique_ptr<RemoteKvStore>()> openStore;
  /// The model the blocks belong to (name, revision, quantisation): with the pool geometry it is
  /// the deployment identity every key and value carries; blocks of another identity never load.
  std::string model;
  /// Save every block a publication indexes (a copy to the host tier, then to the store).
  bool saveBlocks = true;
  /// Host pages held by saves not finished yet, at most; a block published beyond it is not
  /// saved (RemoteTierCounters::savesSkipped). > 0.
  int32_t maxPendingSaves = 1024;
  /// Loads started and not yet taken by pollRemoteTier, at most (> 0); a load beyond it is
  /// refused (RemoteLoadStart::ticket 0). Each holds at most maxBlocksPerLoad values in memory.
  int32_t maxLoadsInFlight = 16;
  /// Blocks one load fetches at most (> 0).
  int32_t maxBlocksPerLoad = 1024;
};

struct ContextCacheConfig {
  /// false: lookups and publication are off and the coordinator is a plain paged allocator over
  /// the full pool (the runtime's full-storage mode). Every sequence is treated as kBypass.
  bool enabled = true;
  int32_t maxRecords = 1024;  ///< published records kept (evicted beyond); 0 keeps none
  bool verifyTokens = true;  ///< verify tokens on every index match (docs/context_cache.md, "Keys")
  int32_t eventQueueCapacity = 0;  ///< BlockStored / BlockRemoved events kept; 0 = off
  /// Hybrid / pure-recurrent deployments: device bytes of recurrent snapshot slots. Slots =
  /// budget / SnapshotStorage::recurrentBytesPerSlot (plus the boundary hidden row for
  /// Hybrid-MTP); an enabled checkpoint deployment needs at least one. Ignored otherwise.
  int64_t recurrentSnapshotPoolBytes = 0;
  /// Hybrid deployments: device bytes of partial-KV snapshot slots (the valid rows of a partially
  /// filled last page, every layer, K and V). Slots = budget / partialKvBytesPerSlot; an enabled
  /// hybrid deployment needs at least one. Ignored without attention.
  int64_t partialKvSnapshotPoolBytes = 0;
  /// Tokens between reuse points, 0 = none (docs/context_cache.md, "Reuse points"). Hybrid and
  /// pure-recurrent deployments: a prefill also keeps a checkpoint at every multiple of the
  /// interval past its reuse length and short of its prompt end, captured by the engine into the
  /// slots reusePointCaptures names, so a later prompt that diverges inside the prompt still lands
  /// on the last point before the divergence (checkpoints otherwise exist only at prompt and
  /// decode ends); speculative requests of Hybrid-MTP keep their endpoints only. Sliding-window
  /// reuse (a window cache): the sliding blocks of the window before every multiple of the
  /// interval are kept in a tier of their own, dropped after the blocks between those windows and
  /// before the windows hits have read, the windows of the points at odd intervals first
  /// (WindowBlockCache::keepPointWindow). A
  /// multiple of the page size with attention. Must be 0 on other attention-only deployments.
  int32_t checkpointInterval = 0;
  /// Hybrid and pure-recurrent deployments with a checkpoint interval (without one, nothing):
  /// which reuse points are kept and how they rank (ReusePointAdmission; kBranchFirst, the default,
  /// reuses at least what kEveryInterval does in every replay measured and keeps dense intervals
  /// useful under a tight snapshot budget, docs/benchmarks.md, "Hybrid models").
  ReusePointAdmission reusePointAdmission = ReusePointAdmission::kBranchFirst;
  /// Victim order of published records within a retention priority: kS3Fifo (default: it reuses
  /// more than kLru in every replay measured, docs/benchmarks.md) or kLru (docs/context_cache.md,
  /// "Eviction").
  EvictionPolicyKind evictionPolicy = EvictionPolicyKind::kS3Fifo;
  /// When an in-flight admission takes its fresh pages: all at admission (kWholePrompt), or per
  /// prefill chunk (kPerChunk: the engine calls preparePrefillChunk before every chunk, the last
  /// one and a whole-prompt prefill included, and a joiner waiting for its next chunk holds only
  /// the pages it has written). Founding rows always take their prompt's pages at admission.
  JoinerPageAllocation joinerPages = JoinerPageAllocation::kWholePrompt;
  /// Clock of retention durations (RetentionRange::duration units); empty = steady-clock
  /// milliseconds. Called on the engine thread; must not throw.
  std::function<int64_t()> retentionClock;
  /// A store shared with other engines behind the host tier, or none (docs/context_cache.md,
  /// "Remote tier"). Attention-only deployments with a host tier only.
  std::optional<RemoteTierConfig> remoteTier;
};

/// What kind of model state the base model carries.
enum class BaseStateKind : uint8_t { kAttentionOnly, kPureRecurrent, kHybrid };

/// The deployment the coordinator serves, validated against the resources at construction:
/// * attention-only: basePool + basePageTable; block reuse (a recurrent pool, if given, only has
///   its dropped rows zeroed at compaction);
/// * hybrid (attention + recurrent layers): basePool + basePageTable + recurrent; exact
///   checkpoints (recurrent rows + the partial last KV page) instead of blocks;
/// * pure recurrent: recurrent only (no KV pool, no page table); recurrent checkpoints.
///
/// `speculative` adds a draft model (docs/context_cache.md, "Speculative paired reuse"):
/// * attention-only base: EAGLE-style paired reuse. A paged contract (the draft owns KV: EAGLE,
///   MTP {paged, 1}; DFlash-like {paged, 0}) needs draftPool + draftPageTable; a shared-KV
///   contract ({not paged, 0}) must have none;
/// * hybrid base: Hybrid-MTP. The contract must be paged (an own-KV draft) and
///   boundaryHiddenWidth > 0 (the base hidden row kept with each endpoint);
/// * pure recurrent: never speculative.
struct ContextCacheDeploymentProfile {
  BaseStateKind baseStateKind = BaseStateKind::kAttentionOnly;
  /// Set for speculative deployments (EAGLE {paged, 1}, MTP {paged, 1}, ...).
  std::optional<SpecReuseContract> speculative;
  /// Hybrid-MTP: width (elements) and type of the boundary hidden row kept with checkpoints.
  int64_t boundaryHiddenWidth = 0;
  DataType boundaryHiddenType = DataType::kFloat16;

  bool hasAttention() const noexcept { return baseStateKind != BaseStateKind::kPureRecurrent; }
  bool usesCheckpointReuse() const noexcept {
    return baseStateKind != BaseStateKind::kAttentionOnly;
  }
  bool isSpeculative() const noexcept { return speculative.has_value(); }
  bool ownsPagedSpecState() const noexcept { return speculative && speculative->pagedSpecState; }
  bool isHybridMtp() const noexcept {
    return isSpeculative() && baseStateKind == BaseStateKind::kHybrid;
  }
};

}  // namespace mkv
