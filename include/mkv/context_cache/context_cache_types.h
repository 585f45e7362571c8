#pragma once
/// \file context_cache_types.h
/// The value types of context reuse that the public API names: digests and key inputs
/// (docs/context_cache.md, "Keys"), the reuse modes and miss reasons, the speculative reuse
/// contract, the eviction policy choice, the typed resource counts of ContextCacheMetrics and
/// what an admission would take (AdmissionEstimate).
/// The cache's machinery (hashing, index, records, planners, the manager) is internal (src/).
///
/// Thread-safety: plain value types.

#include <array>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace mkv {

/// A 128-bit digest. The all-zero value means "none" (no adapter, no salt, not a media position).
struct Hash128 {
  uint64_t hi = 0;
  uint64_t lo = 0;

  constexpr bool isZero() const noexcept { return hi == 0 && lo == 0; }
  friend constexpr bool operator==(Hash128, Hash128) noexcept = default;
  // NOLINTNEXTLINE(modernize-use-nullptr): clang-tidy 14 misreads the defaulted <=>'s 0
  friend constexpr auto operator<=>(Hash128, Hash128) noexcept = default;
};

/// Hasher for unordered containers. Digests are uniformly distributed already; folding both
/// halves keeps hand-made test digests (e.g. {0, k}) well spread too.
struct Hash128Hasher {
  std::size_t operator()(Hash128 h) const noexcept {
    return static_cast<std::size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ULL));
  }
};

/// 32 lowercase hex digits, `hi` first.
std::string toString(Hash128 h);

/// Parent of block 0 in both chains, and the exact-prefix digest of the empty prefix.
inline constexpr Hash128 kBlockChainRoot{0x9E3779B97F4A7C15ULL, 0xC2B2AE3D27D4EB4FULL};

/// Request-wide key inputs. Zero members mean "none". `salt` partitions tenants: it enters the
/// first block's key, and through the chain every later key, so different salts never share.
struct BlockKeyExtras {
  Hash128 adapter;  ///< LoRA adapter identity, e.g. digestIdentity(loraWeightsName)
  Hash128 salt;     ///< cache salt, e.g. digestIdentity(cacheSalt)
  friend bool operator==(BlockKeyExtras const&, BlockKeyExtras const&) = default;
};

/// The key extras of a request with LoRA adapter `loraWeightsName` and cache salt `cacheSalt`
/// (empty: none), as ManagedKVCacheRequest computes them; for the coordinator's calls that take a
/// ContextCacheSequenceAdmission directly (estimateAdmission, lookupRemoteTier, ...).
BlockKeyExtras blockKeyExtras(std::string_view loraWeightsName, std::string_view cacheSalt);

/// Media identity of one token position. `content` is the digest of the image / audio item the
/// position belongs to (zero: not a media position); `offset` is the position's index inside that
/// item's placeholder run (0 for the item's first placeholder token).
struct MediaPosition {
  Hash128 content;
  int32_t offset = 0;
  friend bool operator==(MediaPosition const&, MediaPosition const&) = default;
};

/// Which kind of state a request reuses and produces.
enum class ReuseMode : uint8_t {
  kVanilla,    ///< attention KV, whole blocks
  kHybrid,     ///< exact checkpoints: recurrent snapshot (+ partial KV page); pure recurrent too
  kHybridMtp,  ///< hybrid + MTP draft: paired base/draft paths, boundary token kept private
  kSpec,       ///< speculative (EAGLE-style): paired base + draft paths, replayed last page(s)
};

/// Why a lookup did not reuse all of its full blocks (see classifyMiss; kCapacity is assigned by
/// the manager when a cache-derived plan fails for capacity).
enum class MissReason : uint8_t {
  kNoPrefix,
  kShorterThanOnePage,
  kEvicted,
  kSaltMismatch,
  kLoraMismatch,
  kMediaMismatch,
  kCapacity,
  /// Composed backend (sliding layers with context reuse): the full layers had a longer prefix,
  /// but the sliding layers' window before it is no longer cached (docs/context_cache.md,
  /// "Window rule").
  kWindowEvicted,
};
inline constexpr int32_t kMissReasonCount = 8;
/// "no_prefix", "shorter_than_one_page", "evicted", "salt_mismatch", "lora_mismatch",
/// "media_mismatch", "capacity", "window_evicted".
std::string_view toString(MissReason reason) noexcept;
std::string_view toString(ReuseMode mode) noexcept;

/// Per-deployment speculative reuse contract. pagedSpecState: the draft model owns paged KV (so a
/// reusable state is a paired base+draft path). futureDependencyTokens: draft KV at a position
/// depends on that many later base tokens, so the last ceil(n / page) reused pages are replayed.
/// EAGLE and MTP: {true, 1}; DFlash / JetSpec / DSpark: {true, 0}; Gemma4 MTP: {false, 0}.
struct SpecReuseContract {
  bool pagedSpecState = true;
  int32_t futureDependencyTokens = 1;
  friend bool operator==(SpecReuseContract const&, SpecReuseContract const&) = default;
};

enum class EvictionPolicyKind : uint8_t {
  kLru,     ///< least recently published or hit first
  kS3Fifo,  ///< small FIFO for new records, main FIFO with a frequency counter, ghost of evictions
  /// S3-FIFO whose admission resists loops: while returns to evicted prefixes outnumber hits, a
  /// record returning to an evicted prefix enters the small queue, not the main one
  kLoopAware,
};
std::string_view toString(EvictionPolicyKind kind) noexcept;

/// Which reuse points a checkpoint deployment keeps, and how they rank under the snapshot budget
/// (ContextCacheConfig::reusePointAdmission, docs/context_cache.md, "Reuse points").
enum class ReusePointAdmission : uint8_t {
  /// Every multiple of the interval, ranked as any checkpoint.
  kEveryInterval,
  /// Also a point where the prompt branches from cached content (the end of its cached block
  /// prefix: other prompts went that far), ranked as any checkpoint; the interval points and
  /// chunk ends, kept on speculation, rank at retention priorities 0 to 16 (below the default
  /// priority and their own retention's) until a prompt passes through them again, and among
  /// themselves by the tokens a hit on them saves (a point at 2^r x odd intervals ranks r: a
  /// budget thins every prompt's points before it drops any prompt's coarse ones). Superseded
  /// conversation turns rank as speculations of rank 0. The default; it applies only with a
  /// checkpoint interval.
  kBranchFirst,
};
std::string_view toString(ReusePointAdmission admission) noexcept;

/// When an in-flight admission's fresh pages are allocated (ContextCacheConfig::joinerPages;
/// docs/lifecycle.md, "Chunked prefill").
enum class JoinerPageAllocation : uint8_t {
  /// At admission: the pages of the whole prompt and the headroom, so that a prefill in one step
  /// or in chunks needs nothing more (the seed's contract).
  kWholePrompt,
  /// Per chunk, as vLLM allocates slots for each scheduled chunk: admission binds only the reused
  /// prefix, and preparePrefillChunk allocates the pages up to each chunk's end (the last chunk's
  /// too), failing that row alone when the pools cannot.
  kPerChunk,
};
std::string_view toString(JoinerPageAllocation allocation) noexcept;

/// The kinds of resource a context-cache lease or record can hold. kBaseKvPage ids are PageIds of
/// the base KVCachePool, kDraftKvPage ids PageIds of the draft pool; snapshot ids are slots of
/// SnapshotStorage's recurrent and partial-KV slabs.
enum class ResourceType : uint8_t {
  kBaseKvPage,
  kDraftKvPage,
  kRecurrentSnapshot,
  kPartialKvSnapshot
};
inline constexpr int32_t kResourceTypeCount = 4;
inline constexpr std::array<ResourceType, kResourceTypeCount> kAllResourceTypes{
    ResourceType::kBaseKvPage, ResourceType::kDraftKvPage, ResourceType::kRecurrentSnapshot,
    ResourceType::kPartialKvSnapshot};

/// "base_kv_page", "draft_kv_page", "recurrent_snapshot", "partial_kv_snapshot".
std::string_view toString(ResourceType type) noexcept;

/// A slot of snapshot storage (recurrent or partial-KV). Distinct alias from PageId on purpose.
using SnapshotSlot = int32_t;

/// One slot of one pool.
struct ResourceId {
  ResourceType type = ResourceType::kBaseKvPage;
  int32_t index = -1;
  friend bool operator==(ResourceId const&, ResourceId const&) = default;
};

/// A count per resource type (a demand, a capacity, a free count).
struct ResourceDemand {
  int32_t baseKvPages = 0;
  int32_t draftKvPages = 0;
  int32_t recurrentSnapshotSlots = 0;
  int32_t partialKvSnapshotSlots = 0;

  int32_t& operator[](ResourceType type) noexcept;
  int32_t operator[](ResourceType type) const noexcept;
  /// Sum over the four types.
  int64_t total() const noexcept;
  /// True when every count of *this is >= the same count of `other`.
  bool covers(ResourceDemand const& other) const noexcept;
  bool isZero() const noexcept { return total() == 0 && !hasNegative(); }
  bool hasNegative() const noexcept;
  friend bool operator==(ResourceDemand const&, ResourceDemand const&) = default;
};

/// What admitting one sequence would take now (ContextCacheCoordinator::estimateAdmission): the
/// question a scheduler asks before it admits, as vLLM's scheduler and KV connectors do.
struct AdmissionEstimate {
  int32_t promptTokens = 0;
  /// Prompt tokens whose state admission would bind (GPU hits and host-tier onboarding):
  /// execution would start here.
  int32_t reusableTokens = 0;
  int32_t hostTierTokens = 0;  ///< of reusableTokens, those onboarded from the host tier
  /// Resources admission would allocate privately: base (and paired draft) pages for the prompt
  /// and the headroom beyond the reused prefix, onboarding targets included. Snapshot slots are
  /// reserved later, at a capture, and are not in it.
  ResourceDemand demand;
  /// Reused resources that are reclaimable now (cached, no lease): the pages, and a checkpoint
  /// restore's snapshot slots, that admission pins, so they no longer count towards what
  /// eviction can free.
  ResourceDemand pinnedReclaimable;
  /// Every pool has the demand free now: admission would evict nothing. Both fit flags are false
  /// while the coordinator is poisoned (begin would answer kPoisoned).
  bool fitsWithoutEviction = false;
  /// Every pool covers the demand with its free slots plus what evicting every unpinned cached
  /// record would free: admission would succeed (capacity-wise) at this moment.
  bool fitsAfterEviction = false;
  /// Why the lookup reused less than the whole prompt (no_prefix, evicted, ...), if it did.
  std::optional<MissReason> missReason;
  /// Sliding pages (KVCacheRuntime::estimateAdmission): on bounded SWA those a sequence reserves;
  /// on sliding-window reuse those admission takes from the sliding pool (the row's pages from
  /// its reuse start, plus the cached window pages before it that no request holds), the fit
  /// flags covering that pool too. 0 elsewhere.
  int32_t slidingPages = 0;
};

/// The remote tier's answer for one prompt (ContextCacheCoordinator::lookupRemoteTier).
struct RemoteTierLookup {
  int32_t localTokens = 0;     ///< tokens of full blocks the GPU index and the host tier hold
  int32_t remoteTokens = 0;    ///< tokens of the full blocks right after them the store holds
  bool storeAvailable = true;  ///< false: the store did not answer (remoteTokens is 0)
};

/// A load started by ContextCacheCoordinator::loadFromRemoteTier.
struct RemoteLoadStart {
  uint64_t ticket = 0;          ///< 0: nothing started (nothing to load, or too many in flight)
  int32_t requestedBlocks = 0;  ///< blocks asked of the store
};

/// A load that finished (ContextCacheCoordinator::pollRemoteTier): its blocks are in the host tier
/// from now on, so an admission of the prompt reuses them as host-tier hits.
struct RemoteLoadResult {
  uint64_t ticket = 0;
  int32_t requestedBlocks = 0;
  /// Blocks kept from the first requested one on: verified and in the host tier (or already
  /// held there or on the GPU). A missing, refused or unreadable block ends the run.
  int32_t loadedBlocks = 0;
  bool storeAvailable = true;  ///< false: the store failed the load (loadedBlocks is 0)
};

/// The remote tier's counters (ContextCacheCoordinator::remoteTierCounters).
struct RemoteTierCounters {
  uint64_t lookups = 0;         ///< lookupRemoteTier calls that asked the store
  uint64_t lookupFailures = 0;  ///< of them, the store did not answer
  uint64_t loadsStarted = 0;
  uint64_t loadsRefused = 0;    ///< loadFromRemoteTier calls beyond maxLoadsInFlight
  uint64_t loadFailures = 0;    ///< loads the store failed (unavailable)
  uint64_t loadedBlocks = 0;    ///< blocks put into the host tier from the store
  uint64_t loadedBytes = 0;     ///< their payload bytes
  uint64_t missingBlocks = 0;   ///< requested blocks the store did not hold
  uint64_t rejectedBlocks = 0;  ///< values refused: truncated, other deployment or block, checksum
  uint64_t installsDeferred = 0;  ///< polls that waited for the host tier's copies to complete
  uint64_t savedBlocks = 0;       ///< blocks the store accepted
  uint64_t savedBytes = 0;        ///< their value bytes
  uint64_t saveFailures = 0;      ///< writes the store refused or failed
  uint64_t savesSkipped = 0;      ///< published blocks not saved (maxPendingSaves reached)
};

}  // namespace mkv

template <>
struct std::hash<mkv::Hash128> : mkv::Hash128Hasher {};
