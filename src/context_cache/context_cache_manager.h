#pragma once
/// \file context_cache_manager.h
/// CUDA-free bookkeeping of context reuse: pools, block index, records, leases, eviction and
/// transactional publication, metrics and events (docs/context_cache.md, "Refcounts and pools" to
/// "Publication points", and "Observability"). ContextCacheCoordinator drives it.
///
/// Thread-safety: single writer. Every call, including lease release and destruction, must come
/// from the one thread that owns the manager (the engine thread); there is no internal locking.
/// Leases must not outlive the manager.

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/block_index.h"
#include "context_cache/cache_request_lease.h"
#include "context_cache/eviction_planner.h"
#include "context_cache/eviction_policy.h"
#include "context_cache/host_block_tier.h"
#include "context_cache/kv_event_queue.h"
#include "context_cache/record_store.h"
#include "context_cache/resource_pools.h"
#include "context_cache/reuse_plan.h"
#include "context_cache/window_block_cache.h"
#include "mkv/context_cache/context_cache_metrics.h"
#include "mkv/types.h"

namespace mkv {

struct ContextCacheManagerOptions {
  /// Verify tokens, parent, media and extras on every index hit (docs/context_cache.md, "Keys").
  /// Costs one flat int32 array of base capacity x page size and a memcmp per matched block.
  bool verifyTokens = true;
  /// Capacity of the KV event queue; 0 disables events.
  int32_t eventQueueCapacity = 0;
  /// Speculative reuse contract of the deployment; required for ReuseMode::kSpec.
  std::optional<SpecReuseContract> specContract;
  /// Digests remembered after eviction for MissReason::kEvicted; -1 = the base page capacity.
  int32_t evictedDigestHistory = -1;
  /// The victim order within a retention priority (docs/context_cache.md, "Eviction").
  EvictionPolicyKind evictionPolicy = EvictionPolicyKind::kS3Fifo;
  /// Time of retention durations (RetentionRange::duration), read when a record with a duration
  /// is published and before evicting while such a record is stored; must not go backwards (a
  /// smaller value counts as the largest seen). Empty: std::chrono::steady_clock milliseconds.
  std::function<int64_t()> retentionClock;
  /// Pages of the host tier (docs/context_cache.md, "Host tier"); 0 = none. Evicted blocks are
  /// kept there and vanilla lookups continue into it; the coordinator moves the bytes
  /// (takeHostTransfers).
  int32_t hostTierPages = 0;
  /// Bytes one page moves between the tiers (all layers, K and V), for the byte counters only.
  int64_t hostTierBytesPerPage = 0;
  /// Remote tier (docs/context_cache.md, "Remote tier"): every block a publication indexes on the
  /// GPU is also copied to the host tier (needs one), and its host page listed for the remote
  /// tier to save (takeMirroredBlocks).
  bool mirrorPublishedBlocks = false;
  /// The sliding pool of the composed backend (not owned; must outlive the manager), or null.
  /// When set, vanilla lookups apply the window rule (makeWindowedReusePlan); needs the same page
  /// size and no host tier.
  WindowBlockCache const* windowCache = nullptr;
};

/// What the coordinator knows about one sequence at admission.
struct LookupRequest {
  PromptView prompt;  ///< full logical prompt (not owned), its media and key extras
  ReuseMode mode = ReuseMode::kVanilla;
  ContextCacheLookupPolicy policy = ContextCacheLookupPolicy::kUseCache;
  bool hasAttention = true;      ///< kHybrid only: false for pure-recurrent models
  int32_t baseExtraTokens = 0;   ///< decoding headroom: base pages must cover input + this
  int32_t draftExtraTokens = 0;  ///< paired draft pages must cover input + this
  /// The pages cover only the reused prefix (the reuse length; the extra tokens ignored): an
  /// in-flight admission under JoinerPageAllocation::kPerChunk, whose chunks grow the lease.
  bool coverReusedPrefixOnly = false;
  /// Retention priorities of the records the sequence publishes (not owned; copied into the
  /// lease at admission): requireValidRetention's rules.
  std::span<RetentionRange const> retention;
};

/// Result of ContextCacheManager::lookup (pure).
struct LookupResult {
  PromptBlocks blocks;  ///< digests of the prompt (refers to the request's tokens)
  ReusePlan plan;
  std::optional<MissReason> missReason;  ///< block-based reason; never kCapacity
  /// The manager state the plan was made against (opaque; see admit).
  uint64_t stateVersion = 0;
};

enum class AcquireStatus : uint8_t { kAcquired, kInsufficientCapacity };
struct AcquireResult {
  std::optional<CacheRequestLease> lease;  ///< engaged iff kAcquired
  AcquireStatus status = AcquireStatus::kInsufficientCapacity;
};

enum class AdmissionOutcome : uint8_t {
  kAcquired,              ///< the looked-up plan was acquired
  kInsufficientCapacity,  ///< no lease: the plan did not fit even after eviction
};
struct AdmissionResult {
  std::optional<CacheRequestLease> lease;
  AdmissionOutcome outcome = AdmissionOutcome::kInsufficientCapacity;
  ReusePlan plan;                        ///< the looked-up plan, acquired or refused
  std::optional<MissReason> missReason;  ///< as counted in the metrics
};

enum class PublishStatus : uint8_t {
  kPublished,             ///< a new record
  kExistingRecord,        ///< already published: the first record was touched and kept
  kSpecStateAttached,     ///< an existing base-only record gained this lease's draft path
  kVerificationRejected,  ///< the first block's digest is indexed with other content; nothing done
};
struct PublishResult {
  PublishStatus status = PublishStatus::kVerificationRejected;
  /// The new or existing record; kNoRecord when rejected or evicted at once (maxRecords == 0).
  RecordId record = kNoRecord;
  /// The record's canonical base pages (may differ from the lease's pages: the lease keeps its
  /// own).
  std::vector<PageId> canonicalBasePages;
  /// Full blocks the record covers (0 when rejected).
  int32_t publishedFullBlockCount = 0;
};

/// Whether a publication is a prefill chunk's, which the same sequence's next publication
/// replaces (ContextCacheManager::publish), or one that lasts.
enum class Publication : uint8_t { kLasting, kChunk };

/// Owns the four typed pools, the block index, the record store, the eviction planner, metrics and
/// the event queue. Requests hold CacheRequestLeases; published state lives in records.
///
/// Contract violations (bad arguments, a lease of another manager or of the wrong mode, a stale
/// plan, publications that disagree with the lease) throw mkv::Error naming the call and leave the
/// manager unchanged. Capacity shortage is a value (nullopt / false / kInsufficientCapacity), and
/// a refused request changes nothing: no pin stays, no record is evicted.
class ContextCacheManager {
 public:
  /// pageSize: tokens per block/page (> 0). capacities: slots per pool (base capacity = the base
  /// KV pool's page count). maxRecords >= 0 (0 keeps nothing). Throws on invalid arguments.
  ContextCacheManager(int32_t pageSize, ResourceDemand capacities, int32_t maxRecords,
                      ContextCacheManagerOptions options = {});
  /// Terminates the process if leases are still live (they would dangle).
  ~ContextCacheManager();
  ContextCacheManager(ContextCacheManager const&) = delete;
  ContextCacheManager& operator=(ContextCacheManager const&) = delete;

  // --- Planning and admission -------------------------------------------------------------

  /// Hashes the prompt and builds the plan of the request's mode, with its coverage raised to
  /// input + extra tokens and the miss reason of a kUseCache lookup. Pure: changes nothing,
  /// counts nothing. Throws for an empty prompt, a spec request without a contract, a
  /// pure-recurrent Hybrid+MTP request, or negative / misplaced extra tokens.
  LookupResult lookup(LookupRequest const& request) const;
  /// The cold (bypass) plan of the request with the same coverage rules.
  ReusePlan coldPlanOf(LookupRequest const& request) const;
  /// Pins the plan's hits, evicts what the private demand needs (LRU first, the hit record last),
  /// allocates the demand all-or-nothing and touches the hit spec/hybrid record (pure block hits
  /// leave record recency alone). Infeasible: no lease and nothing changed. Throws for a plan
  /// whose bindings no longer match the index or records (plans are consumed right after lookup).
  AcquireResult acquire(ReusePlan const& plan);
  /// The coordinator's one call per sequence: lookup, then acquire the plan, counting every
  /// admission metric (a refusal counts one failed acquisition and, for a kUseCache lookup, one
  /// kCapacity miss). A cache-derived plan that does not fit is not retried cold: acquire pins the
  /// hit before planning eviction and the planner's feasibility test is exact, so the cold plan
  /// needs the pinned pages on top of the same private demand and cannot fit either
  /// (ContextCacheManagerPropertyTest checks the admissions against a model).
  AdmissionResult admit(LookupRequest const& request);
  /// The same admission for a request this manager already looked up: `looked` must be
  /// lookup(request)'s result (same tokens, same page size). Its digests are reused, never
  /// recomputed; its plan is used as is while the index and records are unchanged since the
  /// lookup, and rebuilt from the digests when an eviction or publication changed them in
  /// between (e.g. an earlier sequence of the same batch evicted records). Same outcome and
  /// metrics as admit(request) at this moment.
  AdmissionResult admit(LookupRequest const& request, LookupResult looked);
  /// All-or-nothing admission of several sequences (one coordinator request): `looked[i]` must be
  /// lookup(requests[i])'s result, as for admit. Every plan's hits are pinned
  /// first, then records are evicted once for the batch's whole private demand (exact: the
  /// planner sees every pin), then each plan's demand is allocated. Sequence by sequence
  /// admission is not all-or-nothing: an earlier sequence's eviction can drop a later sequence's
  /// hit from the index (a page without cache references is not reusable even while pinned) and
  /// then the later one needs more pages than planned, after records are already gone. Returns
  /// one acquired result per request, or an empty vector when the batch does not fit: then no pin
  /// stays, nothing is evicted or allocated, and each kUseCache sequence counts a kCapacity miss.
  std::vector<AdmissionResult> acquireBatch(std::span<LookupRequest const> requests,
                                            std::vector<LookupResult> looked);

  // --- Lease growth and snapshots -----------------------------------------------------------

  /// Appends `count` private base pages to a vanilla or (attention) hybrid lease. All-or-nothing;
  /// may evict; false leaves everything unchanged.
  bool growBasePages(CacheRequestLease& lease, int32_t count);
  /// Appends base and draft pages to a spec or Hybrid+MTP lease, atomically across both pools.
  bool growSpecPages(CacheRequestLease& lease, int32_t basePages, int32_t draftPages);
  /// Reserves a recurrent slot and, when `needsPartial` (attention only), a partial-KV slot for a
  /// checkpoint capture; they belong to the lease until retired. May evict; nullopt on pressure.
  std::optional<SnapshotReservation> reserveHybridSnapshots(CacheRequestLease& lease,
                                                            bool needsPartial);
  /// Drops the pins on the hit's restore sources (call once the restore copies completed).
  void releaseRestoredHybridSnapshots(CacheRequestLease& lease);
  /// Drops the lease's references on a reservation (after its publication committed, the record
  /// keeps the slots; otherwise they return to the free ring).
  void retireHybridSnapshotReservation(CacheRequestLease& lease,
                                       SnapshotReservation const& reservation);

  // --- Publication (transactional) --------------------------------------------------------

  /// Publishes the first count = min(blocks, residentStateLength / page) full blocks of a vanilla
  /// or spec lease (count must be > 0, <= its base pages, and <= its draft pages for paged spec).
  /// blocks.keys must agree with the lease's reused prefix, and cover a spec replay dependency.
  /// Canonical projection: each block uses its already indexed page, else the lease's page (first
  /// producer stays canonical; the lease is never rebound). A duplicate key touches the existing
  /// record (a base-only one gains a paged spec lease's draft path). With verification, a block
  /// whose digest is indexed with other content truncates the publication before it. When the
  /// record limit is exceeded the LRU record is evicted (maxRecords == 0: the new record itself).
  /// Any exception leaves the manager exactly as before (rollback of refs, index, record).
  ///
  /// Publication::kChunk: the blocks of a prefill chunk, which the sequence's next publication
  /// extends; that publication replaces the chunk's record when it is a prefix of its own
  /// (replaceChunkRecord), so chunking does not add records to the victim order.
  PublishResult publish(CacheRequestLease& lease, PromptBlocks const& blocks,
                        int32_t residentStateLength, Publication kind = Publication::kLasting);
  /// The lease's pending chunk record stays as a record of its own (its prefill ended exactly
  /// where its last chunk did, so no longer publication replaces it).
  void settlePublications(CacheRequestLease& lease) noexcept;
  /// Publishes an exact checkpoint of a hybrid lease at `exactLength` (<= blocks' tokens): full
  /// blocks = exactLength / page, `reservation` (owned by the lease) must hold exactly a recurrent
  /// slot plus a partial slot iff attention and exactLength % page != 0. Duplicate -> touch.
  /// `reusePoint`: a checkpoint inside a prompt (CacheRecord::reusePoint); `speculationRank`:
  /// set for one no evidence says a later prompt will branch there (CacheRecord::speculative),
  /// the rank it takes among speculations (speculationPriority).
  PublishResult publishHybrid(CacheRequestLease& lease, PromptBlocks const& blocks,
                              int32_t exactLength, SnapshotReservation const& reservation,
                              bool reusePoint = false,
                              std::optional<int32_t> speculationRank = std::nullopt);
  /// A speculation is a rank, not a flag (a bool would convert to rank 0 or 1).
  PublishResult publishHybrid(CacheRequestLease& lease, PromptBlocks const& blocks,
                              int32_t exactLength, SnapshotReservation const& reservation,
                              bool reusePoint, bool speculative) = delete;
  /// Branch-first ranking, after `lease`'s sequence published a checkpoint of `exactLength`
  /// tokens: when what it restored was a shorter prompt or decode end (an earlier turn of its
  /// conversation, not a point inside a prompt), that checkpoint is superseded: the
  /// conversation's next turn lands on the longer one, and the shorter serves only a prompt that
  /// branches inside it, so it ranks as a speculation again unless a second prompt came through
  /// it (RecordStore::demote).
  void supersedeHit(CacheRequestLease const& lease, int32_t exactLength) noexcept;
  /// Hybrid+MTP endpoint: full blocks = (exactLength - 1) / page (the boundary token stays
  /// private), both snapshot slots mandatory, base and draft paths of those blocks.
  PublishResult publishHybridMtp(CacheRequestLease& lease, PromptBlocks const& blocks,
                                 int32_t exactLength, SnapshotReservation const& reservation);

  // --- Reset ------------------------------------------------------------------------------------

  /// Drops every record at once, the operator's "clear the prefix cache" (vLLM's
  /// reset_prefix_cache): every cached page and snapshot slot returns to its free ring, the index
  /// empties, and one AllBlocksCleared event is queued instead of a BlockRemoved per block.
  /// Records dropped here count in `resetRecords`, not as evictions; the eviction history of
  /// MissReason::kEvicted is kept. Returns false and changes nothing while any lease is live (a
  /// running request's pins and hits would outlive their records).
  bool resetPrefixCache() noexcept;

  // --- Host tier -----------------------------------------------------------------------------

  /// The page moves decided since the last call (offloads of evicted blocks, onboardings of
  /// admitted plans), in the order they must run; empty without a host tier. Take them after every
  /// call that may evict or allocate (acquire, admit, acquireBatch, the grow calls, publish) and
  /// enqueue them before any work that writes a page allocated since, as the coordinator does:
  /// within one call the offloads must run before the onboardings, and the moves of two calls are
  /// ordered only by the order in which they were taken (a host page an onboarding of one call
  /// reads may be the destination of an offload of a later call).
  HostTransfers takeHostTransfers() noexcept { return std::exchange(mHostTransfers, {}); }
  /// After a failed launch of `offloads` (taken from takeHostTransfers): the host tier forgets
  /// those blocks (their bytes may never have arrived) and announces their removal.
  void forgetHostBlocks(std::span<HostTransfer const> offloads) noexcept;
  /// Swap preemption (docs/lifecycle.md, "Preemption"): moves the cached blocks of `path` (the
  /// block keys of a preempted sequence's published full blocks, from block 0, its lease already
  /// released) to the host tier, as evicting them would: every block record ending on the path
  /// past its kept prefix is dropped, and each of their blocks that no other record holds leaves
  /// the GPU index for the host tier (an offload queued unless the tier holds it already, events
  /// as for an eviction) and frees its page. The kept prefix stays a GPU-cached record: it ends at
  /// the path's last block whose page a lease still holds (another running row shares it), and
  /// is long enough that the moved blocks fit the host tier's unpinned pages (the blocks before
  /// stay on the GPU; the tier's own LRU rule drops its oldest blocks to make room). A record of
  /// the kept prefix is added when none exists. Returns the blocks moved (swappedOutBlocks); 0
  /// and nothing changed without a host tier, for a path the GPU index does not hold, or when an
  /// allocation failed (logged). Take the moves with takeHostTransfers.
  int32_t demoteToHostTier(std::span<Hash128 const> path) noexcept;
  /// The host tier's bookkeeping, or null without one.
  HostBlockTier const* hostTier() const noexcept { return mHostTier.get(); }

  // --- Remote tier (docs/context_cache.md, "Remote tier") ---------------------------------------

  /// Host pages of the blocks mirrored since the last call (options.mirrorPublishedBlocks), whose
  /// offload copies were taken with the last takeHostTransfers(): the remote tier saves them once
  /// those copies completed. A page whose block the tier dropped since is not listed.
  std::vector<PageId> takeMirroredBlocks() noexcept { return std::exchange(mMirroredBlocks, {}); }
  /// A host page into which the remote tier's worker copies block `block` of `blocks`, loaded
  /// from the store and verified against the prompt (HostBlockTier::reserve: the tier's LRU rule
  /// makes room, drops announced as evictions). nullopt when the GPU index or the host tier holds
  /// the block already, or every host page is pinned. Call only while no host transfer is pending
  /// (takeHostTransfers empty) and the tier's copies completed: the page may be one a dropped
  /// block held. Throws mkv::Error without a host tier.
  std::optional<PageId> reserveHostPageForLoad(PromptBlocks const& blocks, int32_t block);
  /// Indexes the reserved `page`, now holding the bytes of block `block` of `blocks`, in the host
  /// tier (events as an offload): returns true; false (the page released) when the GPU index or
  /// the host tier came to hold the block meanwhile. Throws (the page released) for a block out
  /// of range or an allocation failure.
  bool adoptLoadedHostPage(PromptBlocks const& blocks, int32_t block, PageId page);
  /// Gives back a reserved page that will not be filled.
  void releaseLoadedHostPage(PageId page) noexcept { mHostTier->releaseReserved(page); }
  /// Keeps the block on host `page` from being dropped while the remote tier reads it (a pin,
  /// HostBlockTier::pin; throws for a page that holds no block); releaseHostPage ends it.
  void holdHostPage(PageId page);
  void releaseHostPage(PageId page) noexcept;
  /// Whether page moves are decided and not yet taken.
  bool hasPendingHostTransfers() const noexcept { return !mHostTransfers.empty(); }

  // --- Observers ------------------------------------------------------------------------------

  /// All queued KV events, oldest first (see KvEventQueue).
  std::vector<KvEvent> drainEvents() { return mEvents.drain(); }
  /// The queue drainEvents() empties, for the composed backend's sliding pool to announce its
  /// blocks into (WindowBlockCache::announceTo), so both groups' events keep one order.
  KvEventQueue& eventQueue() noexcept { return mEvents; }
  /// The group this manager's block events carry: full attention (group 0) when it serves the
  /// composed backend (options.windowCache set), otherwise unspecified.
  KvCacheGroup eventGroup() const noexcept;
  /// Counters plus current occupancy.
  ContextCacheMetrics metrics() const;
  ResourcePools const& pools() const noexcept { return mPools; }
  BlockIndex const& index() const noexcept { return mIndex; }
  RecordStore const& records() const noexcept { return mRecords; }
  int32_t pageSize() const noexcept { return mPageSize; }
  int32_t maxRecords() const noexcept { return mMaxRecords; }
  ContextCacheManagerOptions const& options() const noexcept { return mOptions; }
  int32_t liveLeaseCount() const noexcept { return mLiveLeases; }

 private:
  friend class CacheRequestLease;
  struct Projection;
  class PublicationTransaction;

  void checkLease(char const* call, CacheRequestLease const& lease) const;
  void checkRequest(char const* call, LookupRequest const& request) const;
  /// `fresh`: the plan was just made against the current state, so its bindings need no
  /// re-validation against the index (the O(blocks) part of the check).
  void checkPlan(ReusePlan const& plan, bool fresh) const;
  /// The plan of an already hashed lookup (lookup's second half).
  void planLookup(LookupRequest const& request, LookupResult& result) const;
  /// acquireBatch's checks: every request and its lookup result, re-planned when the state
  /// changed since the lookup, and every plan.
  void checkBatch(char const* call, std::span<LookupRequest const> requests,
                  std::vector<LookupResult>& looked) const;
  AcquireResult acquirePlan(ReusePlan const& plan, bool fresh);
  /// acquireBatch's pins: one lease per plan holding its pins (pinPlan, in batch order), the
  /// batch's own hit records (evicted last) and the plans' summed private demand.
  struct BatchPins {
    std::vector<CacheRequestLease> leases;
    std::vector<RecordId> hits;
    ResourceDemand total;
  };
  BatchPins pinBatch(std::vector<LookupResult> const& looked);
  /// acquireBatch's refusal (its pins already dropped): counts each request's admission as
  /// refused for capacity, moving the plans out of `looked`.
  void countRefusedBatch(std::span<LookupRequest const> requests,
                         std::vector<LookupResult>& looked);
  /// acquireBatch's grant: evicts `victims`, allocates each plan's demand into its lease (cannot
  /// fail: the eviction plan was feasible), then hands each request its lease and retention
  /// ranges and counts the admission. Moves out of `looked`, `leases` and `retention`.
  std::vector<AdmissionResult> grantBatch(std::span<LookupRequest const> requests,
                                          std::vector<LookupResult>& looked,
                                          std::vector<CacheRequestLease>& leases,
                                          std::vector<RecordId> const& victims,
                                          std::vector<std::vector<RetentionRange>>& retention);
  /// acquirePlan's first half: a live lease holding the plan's pins (checked plan), no allocation.
  CacheRequestLease pinPlan(ReusePlan const& plan);
  /// admit's second half: acquires the (current) looked-up plan and counts the admission.
  AdmissionResult acquireLooked(LookupRequest const& request, LookupResult looked);
  /// admit's metrics of one finished admission attempt.
  void countAdmission(LookupRequest const& request, int32_t verificationRejects,
                      std::optional<MissReason> blockMiss, AdmissionResult& result);
  bool pairedDraft(ReuseMode mode) const noexcept;
  void applyCoverage(ReusePlan& plan, LookupRequest const& request) const;
  /// Evicts (only if feasible) and allocates `demand` into `targets`; false = nothing changed.
  bool allocateWithEviction(ResourceDemand const& demand, RecordId protectedRecord,
                            std::array<std::vector<int32_t>*, kResourceTypeCount> const& targets);
  void evictRecord(RecordId id) noexcept;
  /// Drops record `id`'s cache references and erases it; `announce`: queue a BlockRemoved for
  /// each page that lost its last cache reference. Returns the number of records dropped (0, 1).
  int32_t dropRecord(RecordId id, bool announce) noexcept;
  /// Host tier: keeps the evicted block on `gpuPage` (still indexed) in the host tier, queueing
  /// its offload and its events; an allocation failure drops it (logged and counted).
  void offloadEvicted(PageId gpuPage, Hash128 digest) noexcept;
  /// mirrorPublishedBlocks: copies the just published block on `gpuPage` to the host tier (as
  /// offloadEvicted) and lists its host page in takeMirroredBlocks.
  void mirrorPublished(PageId gpuPage, Hash128 digest) noexcept;
  /// offloadEvicted's and mirrorPublished's copy: the host page now holding the block, or nullopt
  /// when nothing is copied (already there, every page pinned, an allocation failed).
  std::optional<PageId> copyToHostTier(PageId gpuPage, Hash128 digest) noexcept;
  /// Events and bookkeeping of blocks the host tier dropped to make room.
  void announceHostDrops(std::span<HostBlockDropped const> dropped) noexcept;
  /// The BlockStored event (medium kCpu) of the block now on `hostPage`.
  void announceHostStore(PageId hostPage, Hash128 digest) noexcept;
  /// Host tier: pins the plan's host pages in the lease (released at onboarding or with it).
  void pinHostPages(CacheRequestLease& lease, ReusePlan const& plan);
  /// Host tier: queues the onboarding of the plan's host pages into the lease's first private base
  /// pages (just allocated) and drops the lease's host pins.
  void queueOnboarding(CacheRequestLease& lease, ReusePlan const& plan);
  /// checkPlan's host-tier part.
  void checkHostPlan(char const* call, ReusePlan const& plan, bool fresh) const;
  /// checkPlan's parts: the plan's mode, demand and binding counts; the records it binds (spec
  /// draft path, hybrid snapshots) still hold what it bound.
  void checkPlanShape(char const* call, ReusePlan const& plan) const;
  void checkPlanRecords(char const* call, ReusePlan const& plan) const;
  void enforceRecordLimit() noexcept;
  /// Records whose retention duration ran out fall back to the default priority (before a
  /// victim order is read).
  void expireRetention() noexcept;
  int64_t retentionNow() noexcept;
  /// The record's retention priority and expiry, by the lease's ranges and its last token.
  void applyRetention(CacheRecord& record, CacheRequestLease const& lease, int64_t lastToken);
  /// Hands the admitted lease the request's retention ranges and its ghost hint.
  static void adoptRequest(CacheRequestLease& lease, std::vector<RetentionRange> retention,
                           std::optional<MissReason> blockMiss) noexcept;
  void releaseLease(CacheRequestLease& lease) noexcept;
  void checkBoundPrefix(char const* call, CacheRequestLease const& lease,
                        PromptBlocks const& blocks, int32_t count) const;
  Projection project(char const* call, std::span<PageId const> producerPages,
                     PromptBlocks const& blocks, int32_t count) const;
  PublishResult commitNewRecord(CacheRecord record, CacheRequestLease const& lease,
                                PromptBlocks const& blocks, Projection const& projection);
  /// After `lease` published the block record `latest`: drops the record of its pending chunk
  /// publication when that one is a prefix of `latest` (its pages, and draft pages, the first of
  /// latest's; the same retention), so a prompt prefilled in chunks leaves the records a prefill
  /// in one step leaves. Not an eviction: nothing is freed or unindexed, and S3-FIFO's ghost does
  /// not learn of it.
  void replaceChunkRecord(CacheRequestLease& lease, RecordId latest) noexcept;
  /// publish's checks of the lease against the first `count` blocks.
  void checkPublication(char const* call, CacheRequestLease const& lease,
                        PromptBlocks const& blocks, int32_t count) const;
  /// publish of a key already recorded: a paged spec lease attaches its draft path to a
  /// base-only record, anything else touches the record.
  PublishResult publishExisting(CacheRequestLease const& lease, CacheRecord const& existing,
                                int32_t published);
  /// publishCheckpoint's checks; returns the checkpoint's full blocks.
  int32_t checkCheckpoint(char const* call, CacheRequestLease const& lease,
                          PromptBlocks const& blocks, int32_t exactLength,
                          SnapshotReservation const& reservation, bool mtp) const;
  PublishResult publishCheckpoint(char const* call, CacheRequestLease& lease,
                                  PromptBlocks const& blocks, int32_t exactLength,
                                  SnapshotReservation const& reservation, bool mtp, bool reusePoint,
                                  std::optional<int32_t> speculationRank);

  int32_t mPageSize;
  int32_t mMaxRecords;
  ContextCacheManagerOptions mOptions;
  ResourcePools mPools;
  BlockIndex mIndex;
  RecordStore mRecords;
  EvictionPlanner mEvictionPlanner;
  KvEventQueue mEvents;
  std::unique_ptr<HostBlockTier> mHostTier;  ///< null without a host tier
  HostTransfers mHostTransfers;              ///< decided, not yet taken by the coordinator
  std::vector<PageId> mMirroredBlocks;       ///< host pages to save (takeMirroredBlocks)
  ContextCacheMetrics mMetrics;
  int32_t mLiveLeases = 0;
  /// Bumped by every change of the index or the records (what plans are made of).
  uint64_t mStateVersion = 0;
  int64_t mRetentionNow = std::numeric_limits<int64_t>::min();  ///< the clock's largest value
};

}  // namespace mkv
