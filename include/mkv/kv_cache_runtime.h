#pragma once
/// \file kv_cache_runtime.h
/// Owns the physical KV resources of one engine and exactly one KV backend (the support matrix:
/// docs/architecture.md, "Backend selection (KVCacheRuntime)").

#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "mkv/context_cache/context_cache_config.h"
#include "mkv/context_cache/context_cache_types.h"
#include "mkv/cuda_types.h"
#include "mkv/fault_site.h"
#include "mkv/kernels.h"
#include "mkv/resident_slot_pool.h"
#include "mkv/stream.h"
#include "mkv/tensor_parallel.h"
#include "mkv/types.h"

namespace mkv {

// The parts a runtime owns, held by pointer: an engine that calls into one includes its header
// (the entry header stays narrow: docs/architecture.md, "What is public").
class BoundedSwaKVPageManager;  // mkv/bounded_swa_kv_page_manager.h
class ContextCacheCoordinator;  // mkv/context_cache/context_cache_coordinator.h
class HostKvTier;               // mkv/host_kv_tier.h
class KVCachePool;              // mkv/kv_cache_pool.h
class KVPageTable;              // mkv/kv_page_table.h
class RecurrentStatePool;       // mkv/recurrent_state_pool.h
class WindowBlockCache;         // src/context_cache/window_block_cache.h (internal)
namespace detail {
class DeviceWriteQueue;    // src/resources/device_write_queue.h (internal)
class SharedSynchronizer;  // src/resources/shared_synchronizer.h (internal)
class RankAgreementPoint;  // src/runtime/rank_agreement.h (internal)
}  // namespace detail

/// The attention and recurrent geometry of the model the engine runs.
struct KVCacheModelConfig {
  int32_t numFullAttentionLayers = 0;  ///< layers attending to every position
  int32_t numSlidingWindowLayers = 0;  ///< layers attending to the last slidingWindowTokens
  int32_t slidingWindowTokens = 0;     ///< W; required when there are sliding layers
  int32_t numKVHeads = 8;
  int32_t headDim = 128;
  DataType kvDataType = DataType::kFloat16;
  int32_t numRecurrentLayers = 0;   ///< Mamba / linear-attention layers
  int64_t recurrentStateBytes = 0;  ///< per layer and slot; > 0 with recurrent layers
  int64_t recurrentConvBytes = 0;   ///< per layer and slot; > 0 with recurrent layers
};

/// The draft model of a speculative deployment (docs/context_cache.md, "Speculative paired reuse"
/// and "Hybrid-MTP endpoints"). On an attention-only model it gives EAGLE-style paired base + draft
/// reuse; on a model with recurrent layers it gives Hybrid-MTP (paged draft and a boundary hidden
/// row kept with each endpoint).
struct KVCacheSpeculativeConfig {
  /// The draft owns paged KV (EAGLE, MTP with its own KV, DFlash-like drafts): the runtime
  /// allocates a draft pool of the geometry below and a dense draft page table, paired page by page
  /// with the base. false: the draft reads the base KV (Gemma4-style MTP) and owns no pool, so
  /// numDraftLayers and numDraftPages must stay 0.
  bool pagedDraft = true;
  /// Draft KV at a position depends on this many later tokens (EAGLE, MTP: 1), so a reused path
  /// replays its last ceil(futureDependencyTokens / tokensPerPage) pages (the reuse contract).
  int32_t futureDependencyTokens = 1;
  int32_t numDraftLayers = 0;  ///< attention layers of the draft; > 0 with a paged draft
  int32_t numDraftKVHeads = 8;
  int32_t draftHeadDim = 128;
  DataType draftKvDataType = DataType::kFloat16;
  /// Pages of the draft pool; 0 = as many as the full pool (a paired path holds one draft page
  /// per base page). At most int32 max / 2, like the other pools.
  int32_t numDraftPages = 0;
  /// Hybrid-MTP only (the model has recurrent layers): elements of the base hidden row kept with
  /// each endpoint, > 0; must be 0 on an attention-only model. The coordinator charges one row per
  /// recurrent snapshot slot, and one base plus one draft page per partial-KV slot (budgets in
  /// KVCacheRuntimeConfig::contextCache).
  int64_t boundaryHiddenWidth = 0;
  DataType boundaryHiddenType = DataType::kFloat16;
};

struct KVCacheRuntimeConfig {
  KVCacheModelConfig model;
  int32_t maxBatchSize = 1;       ///< resident slots = page-table rows
  int32_t maxSequenceLength = 0;  ///< tokens of prompt + generation per sequence
  int32_t tokensPerPage = 128;    ///< power of two in [16, 1024]
  /// Pages of the full pool; 0 = maxBatchSize * ceil(maxSequenceLength / tokensPerPage).
  /// Either pool holds at most int32 max / 2 pages (V ids are K ids + numPages).
  int32_t numPages = 0;
  /// Pages of the sliding layers' pool. Bounded SWA: 0 = maxBatchSize * (2M + 1), the admission
  /// minimum (a smaller positive count is an error). Sliding-window reuse: 0 = as many as the full
  /// pool; at least one sequence's largest prefill, ceil(maxSequenceLength / P) + 1 + ceil(W / P)
  /// (a smaller positive count is an error); its pages beyond the running windows cache prompt
  /// blocks.
  int32_t numSwaPages = 0;
  /// Context (prefix) reuse on: full paged KV + ContextCacheCoordinator. For a model with
  /// recurrent layers this is hybrid checkpoint reuse, which needs the snapshot budgets of
  /// `contextCache` (at least one recurrent and one partial-KV slot).
  bool contextReuse = false;
  /// Settings of the coordinator (its `enabled` is set from contextReuse).
  ContextCacheConfig contextCache;
  /// Tokens of the host tier: a second KV pool in pinned host memory (plain host memory for
  /// kCPU) that keeps the blocks the GPU cache evicts, and from which lookups onboard them
  /// (docs/context_cache.md, "Host tier"). A multiple of tokensPerPage; 0 = none. Needs
  /// contextReuse on an attention-only model without `speculative`.
  int64_t hostPoolTokens = 0;
  /// Speculative decoding with a draft model (needs contextReuse: the bounded-SWA and
  /// full-storage backends decode vanilla only). nullopt: speculative requests are refused.
  std::optional<KVCacheSpeculativeConfig> speculative;
  DeviceType deviceType = DeviceType::kGPU;
  /// When the page-table rows and KV lengths the lifecycle calls write reach the device: at the
  /// end of each call (one launch per writing call), or kEngineStep: only at the engine's
  /// flushDeviceWrites(), once per step (one launch per step, none in a request's calls;
  /// docs/architecture.md, "Device writes at the engine step").
  DeviceWriteTiming deviceWrites = DeviceWriteTiming::kEachCall;
  /// The engine's stream, never owned. nullptr is the legacy default stream, which serialises
  /// with every blocking stream: pass a non-blocking one.
  cudaStream_t stream = nullptr;
  StreamSynchronizer synchronizer;  ///< empty = defaultStreamSynchronizer(deviceType)
  /// The fault seam (include/mkv/fault_site.h): consulted at every FaultSite of the runtime's
  /// parts (its synchronisations, device-write launches, host tier copies, checkpoint captures
  /// and publications); a non-success status fails that step as a real CUDA failure there would.
  /// Empty = no faults.
  FaultInjector faults;
  /// This runtime's rank of a tensor-parallel deployment (mkv/tensor_parallel.h; docs/
  /// architecture.md, "Tensor parallelism"): each rank creates its own runtime from the same
  /// config but for `rank`, on its own device and stream, and every rank's engine makes the same
  /// lifecycle calls in the same order. The rank's pools hold its share of the heads; its
  /// completion points (and, with `faults`, its fault sites) go through the group's agreement, so
  /// a step fails on every rank or on none. config() then holds the rank's share (heads divided)
  /// and the synchronizer and injector wrapped with the agreement.
  TensorParallelConfig tensorParallel;
};

enum class KVCacheBackend : uint8_t {
  kContextReuse,  ///< full paged KV, prefix reuse (ContextCacheCoordinator)
  kBoundedSwa,    ///< sliding layers in bounded rotating pages (BoundedSwaKVPageManager)
  kFullStorage,   ///< full paged KV without reuse (the coordinator with lookups off)
  /// full layers with prefix reuse (ContextCacheCoordinator), sliding layers in bounded windows
  /// whose prompt blocks stay cached (BoundedSwaKVPageManager over a WindowBlockCache)
  kSlidingWindowReuse,
};
std::string_view toString(KVCacheBackend backend) noexcept;

/// Occupancy of one pool of pages (KVCacheRuntime::capacity()).
struct PagePoolUsage {
  int32_t totalPages = 0;
  int32_t freePages = 0;         ///< allocatable without evicting anything
  int32_t reclaimablePages = 0;  ///< held only by cached blocks no request runs on: eviction frees
  int32_t leasedPages = 0;       ///< held by running or quarantined requests (the rest)
  /// leasedPages / totalPages in [0, 1]: the share eviction cannot give back (vLLM's
  /// kv_cache_usage_perc, where cached blocks nobody runs on count as free). 0 without pages.
  double usage() const noexcept {
    return totalPages > 0 ? static_cast<double>(leasedPages) / totalPages : 0.0;
  }
};

/// Page occupancy of every pool a runtime has; a pool the deployment lacks is nullopt.
struct KVCacheCapacity {
  /// The full-attention pool of context reuse, full storage and sliding-window reuse (bounded
  /// SWA's identity-mapped full pool belongs to its rows whole and is not reported).
  std::optional<PagePoolUsage> base;
  std::optional<PagePoolUsage> draft;     ///< a paged speculative draft's pool
  std::optional<PagePoolUsage> sliding;   ///< the sliding layers' pool (bounded SWA, sliding reuse)
  std::optional<PagePoolUsage> hostTier;  ///< host tier pages (the blocks it keeps: reclaimable)
  /// What a scheduler reads: the base pool's usage, else the sliding pool's.
  double usage() const noexcept { return base ? base->usage() : sliding ? sliding->usage() : 0.0; }
};

/// Creates and owns the pools, page tables, resident slots and exactly one backend, chosen by the
/// support matrix:
/// * contextReuse on, an attention-only model with full and sliding layers, no speculative
///   decoding, no host tier, and a decode window (M + 1 pages) shorter than a sequence's row ->
///   kSlidingWindowReuse: full layers in the full pool with prefix reuse, sliding layers in their
///   own pool (numSwaPages; 0 = as many pages as the full pool) whose complete prompt blocks stay
///   cached after they leave the window (docs/architecture.md, "Sliding windows with context
///   reuse");
/// * otherwise contextReuse on -> kContextReuse: every attention layer in the full pool (hybrid
/// models:
///   exact checkpoints of the recurrent rows and the partial last page); with `speculative`, the
///   draft pool and draft page table too (EAGLE-style paired reuse, or Hybrid-MTP);
/// * reuse off, sliding layers present and maxBatchSize * (2M + 1) strictly fewer than the full
///   pool's pages -> kBoundedSwa: sliding layers in a reduced pool with its own page ids, full
///   layers (Gemma-style mixed models) in the full pool with a static identity page table;
/// * otherwise -> kFullStorage.
/// Thread-safety: single writer (the engine thread).
class KVCacheRuntime {
 public:
  /// Validates the config (throws mkv::Error naming the field) and allocates everything. Before
  /// allocating, throws mkv::Error naming the bytes when the KV pools (kvBytesFor), the bulk of
  /// a runtime's memory, exceed what the device has available (availableMemoryBytes). The
  /// smaller allocations (tables, lengths, recurrent rows, snapshots, a host tier) are not in
  /// that check and can still fail in their own allocation. A tensor-parallel rank
  /// (`requested.tensorParallel`) allocates its share (docs/architecture.md, "Tensor parallelism").
  static std::unique_ptr<KVCacheRuntime> create(KVCacheRuntimeConfig const& requested);
  /// The bytes kvBytes() will report for a runtime created from `config` (every KV pool: full,
  /// SWA, draft; a tensor-parallel rank's share), without allocating; validates `config` as create
  /// does. For sizing numPages from a byte budget: bytes per page of a pool are
  /// KVCachePool::bytesPerPage.
  static int64_t kvBytesFor(KVCacheRuntimeConfig const& config);
  /// Bytes an allocation on `device` can take now: kGPU the current device's free memory
  /// (cudaMemGetInfo), kCPU the host's available memory (MemAvailable, capped by a cgroup v2
  /// memory limit); -1 when unknown.
  static int64_t availableMemoryBytes(DeviceType device);
  ~KVCacheRuntime();
  KVCacheRuntime(KVCacheRuntime const&) = delete;
  KVCacheRuntime& operator=(KVCacheRuntime const&) = delete;

  KVCacheBackend backend() const noexcept { return mBackend; }
  /// Non-null for kContextReuse, kFullStorage and kSlidingWindowReuse (its full layers).
  ContextCacheCoordinator* contextCache() noexcept { return mCoordinator.get(); }
  /// Non-null for kBoundedSwa and kSlidingWindowReuse (its sliding layers).
  BoundedSwaKVPageManager* swaPageManager() noexcept { return mSwaManager.get(); }
  /// The sliding pool's free pages and cached window blocks (kSlidingWindowReuse), else null.
  WindowBlockCache* windowBlockCache() noexcept { return mWindowCache.get(); }
  /// Whether a running batch may admit sequences in flight: true for context reuse (hybrid
  /// checkpoint reuse, EAGLE-style speculative pairs and Hybrid-MTP included: a speculative joiner
  /// gets a draft row too, a Hybrid-MTP one restores its boundary hidden row and publishes its
  /// endpoint before its finalisation), sliding-window reuse and bounded SWA (a joiner prefills
  /// from 0, in chunks if the engine likes); false for a pure-recurrent model (no page table).
  bool supportsSeatedAdmission() const noexcept;

  KVCacheRuntimeConfig const& config() const noexcept { return mConfig; }
  /// Pool of the full-attention layers; on kContextReuse / kFullStorage also of the sliding
  /// layers, at layer indices [numFull, numFull + numSliding) (full KV, full page table). Null
  /// only on kBoundedSwa of a model without full-attention layers.
  KVCachePool* fullPool() noexcept { return mFullPool.get(); }
  KVPageTable* fullPageTable() noexcept { return mFullTable.get(); }
  /// Pool and sparse-window table of the sliding layers (kBoundedSwa, kSlidingWindowReuse).
  KVCachePool* swaPool() noexcept { return mSwaPool.get(); }
  KVPageTable* swaPageTable() noexcept { return mSwaTable.get(); }
  /// Draft KV pool and its dense page table (speculative deployments with a paged draft), else
  /// null.
  KVCachePool* draftPool() noexcept { return mDraftPool.get(); }
  KVPageTable* draftPageTable() noexcept { return mDraftTable.get(); }
  RecurrentStatePool* recurrentState() noexcept { return mRecurrent.get(); }
  /// The host tier of the full pool (hostPoolTokens > 0), else null.
  HostKvTier* hostTier() noexcept { return mHostTier.get(); }
  ResidentSlotPool& residentSlots() noexcept { return mResidentSlots; }
  /// The full pool when there is one, else the SWA pool. Where both exist (kBoundedSwa with full
  /// layers, kSlidingWindowReuse) the library writes both length tensors and the engine keeps
  /// both; this returns only the full pool.
  KVCachePool& lengthPool() noexcept;
  /// Page-table width: pages per sequence, ceil(maxSequenceLength / tokensPerPage).
  int32_t maxPagesPerSequence() const noexcept { return mMaxPagesPerSequence; }
  /// Device bytes of every KV pool (full, SWA and draft).
  int64_t kvBytes() const noexcept;

  /// Page occupancy of every pool now (free, reclaimable by eviction, leased), O(1) per pool;
  /// changes nothing. Exported with the metrics: `pool_free`, `pool_reclaimable`, `pool_leased`,
  /// `kv_usage_ratio` and, under vLLM's name, `kv_cache_usage_perc` (context reuse backends).
  KVCacheCapacity capacity() const;
  /// What admitting the text prompt `promptTokens` with `loraWeightsName` and `cacheSalt` (as
  /// ManagedKVCacheRequest::begin keys it) and `headroom` would take now: reusable tokens, pages
  /// to allocate, and whether they fit with or without eviction. Changes nothing. Context reuse
  /// backends answer through ContextCacheCoordinator::estimateAdmission (sliding-window reuse adds
  /// its sliding pool's pages, `slidingPages`); bounded SWA reuses nothing and reports its
  /// per-sequence page budget (2M + 1 sliding pages) in `slidingPages`. Throws mkv::Error naming
  /// this call for an empty prompt, a headroom begin refuses (baseExtraTokens <= 0), or what
  /// ContextCacheCoordinator::estimateAdmission refuses (a prompt too long for a row).
  AdmissionEstimate estimateAdmission(std::vector<int32_t> const& promptTokens,
                                      std::string_view loraWeightsName = {},
                                      std::string_view cacheSalt = {},
                                      DecodingKvHeadroom const& headroom = {1, 0}) const;

  /// Applies every page-table row and KV length that the lifecycle calls left waiting, in call
  /// order and in one launch on config().stream. With DeviceWriteTiming::kEngineStep the engine
  /// calls it once per step: after the step's lifecycle calls, before the first launch that reads
  /// the tables or lengths, and before it gathers rows or writes a length tensor with kernels of
  /// its own (a KVCachePool write made before it still lands after the queued lengths:
  /// KVCachePool::orderWritesAfter). Does not wait, but for a table upload beyond the inline limit
  /// (over 1,000 entries), which adds a staged copy and first waits for the previous copy from that
  /// table's staging (docs/architecture.md).
  /// Throws mkv::Error naming this call when a launch fails; the writes stay queued. Such an error
  /// belongs to no request: the engine decides whether to retry or to shut the runtime down.
  void flushDeviceWrites();
  /// Whether writes wait for flushDeviceWrites(). With kEachCall: after a failed flush, or the
  /// entries a bounded-SWA completion cleared (pages that left a window, read by nothing), which
  /// the next writing call's flush carries.
  bool deviceWritesPending() const noexcept;
  /// Launches of the backends' table and length writes so far: flushes that found writes, a
  /// length write partly overlapping a waiting one, each table upload beyond the inline limit
  /// (one launch after its staged copy), and a KVCachePool write that first flushed the waiting
  /// lengths (KVCachePool::orderWritesAfter).
  int64_t deviceWriteLaunches() const noexcept;
  /// What the tensor-parallel agreement did on this rank (zeros with tensorParallel.size 1).
  TensorParallelStats tensorParallelStats() const noexcept;

  /// Drains the backend's quarantine (see the backends' shutdown()).
  bool shutdown() noexcept;
  /// Whether the engine may release resident row `slot` to residentSlots() and reuse it: kFree
  /// (yes), kActive (a live request holds it), kQuarantined (a failed synchronisation left device
  /// work that may still read the row and its pages: release it only after shutdown() returned
  /// true). Ask after a lifecycle call returned false, typically `finish()`
  /// (docs/lifecycle.md, "Failures").
  ResidentRowState residentRowState(CacheSlot slot) const noexcept;

 private:
  explicit KVCacheRuntime(KVCacheRuntimeConfig const& config);
  /// create's parts: the draft pool and table of a paged draft (`fullPages` pages by default, rows
  /// of `width` pages), and the host tier of the full pool (hostPoolTokens > 0).
  void createDraft(int32_t fullPages, int32_t width);
  void createHostTier();
  /// create's kSlidingWindowReuse: both pools and tables, the window cache, both backends.
  void createSlidingReuse(int32_t fullPages, int32_t width, int32_t swaPages,
                          StreamSynchronizer const& synchronizer);

  KVCacheRuntimeConfig mConfig;
  KVCacheBackend mBackend = KVCacheBackend::kFullStorage;
  int32_t mMaxPagesPerSequence = 0;
  std::unique_ptr<KVCachePool> mFullPool;
  std::unique_ptr<KVPageTable> mFullTable;
  std::unique_ptr<KVCachePool> mSwaPool;
  std::unique_ptr<KVPageTable> mSwaTable;
  std::unique_ptr<KVCachePool> mDraftPool;
  std::unique_ptr<KVPageTable> mDraftTable;
  std::unique_ptr<HostKvTier> mHostTier;
  std::unique_ptr<RecurrentStatePool> mRecurrent;
  ResidentSlotPool mResidentSlots;
  std::unique_ptr<WindowBlockCache> mWindowCache;  // kSlidingWindowReuse: the sliding pool's pages
  // kSlidingWindowReuse: the one synchronisation of both halves per completion point.
  std::unique_ptr<detail::SharedSynchronizer> mSharedSync;
  // The backends' table and length writes until they reach the device (one queue for both).
  std::unique_ptr<detail::DeviceWriteQueue> mDeviceWrites;
  // tensorParallel.size > 1: this rank's side of the agreement (shared with the wrapped
  // synchronizer and injector), else null.
  std::shared_ptr<detail::RankAgreementPoint> mRankAgreement;
  // Backends last: they are destroyed before the resources they borrow.
  std::unique_ptr<ContextCacheCoordinator> mCoordinator;
  std::unique_ptr<BoundedSwaKVPageManager> mSwaManager;
};

}  // namespace mkv
