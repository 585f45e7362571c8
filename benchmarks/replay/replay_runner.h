#pragma once
/// \file replay_runner.h
/// Replays a RequestSource through KVCacheRuntime + ManagedKVCacheRequest + the reference engine
/// and collects what docs/replay.md describes.

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/context_cache/context_cache_types.h"
#include "mkv/events/kv_event_publisher.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/tensor_parallel.h"
#include "mkv/testing/reference_engine.h"
#include "mkv/types.h"
#include "request_source.h"

namespace mkv::replay {

enum class ReplayMode : uint8_t {
  kReuse,  ///< context reuse on: full paged KV + ContextCacheCoordinator
  kSwa,    ///< reuse off, sliding-window layers: bounded SWA pages
  kFull,   ///< reuse off, full-attention layers only: full storage
};
std::string_view toString(ReplayMode mode) noexcept;

/// Speculative decoding of a reuse replay (docs/replay.md, "Speculative decoding").
enum class SpeculativeKind : uint8_t {
  kNone,   ///< vanilla decoding, one token per step
  kEagle,  ///< an EAGLE-style draft head with paged KV of its own: paired base + draft reuse
  /// An MTP draft: paged KV of its own, or none, on an attention-only model; with recurrent
  /// layers, Hybrid-MTP (paged draft KV, a boundary hidden row kept with each prompt endpoint).
  kMtp,
};
std::string_view toString(SpeculativeKind kind) noexcept;

/// A process's part when several share a remote tier.
enum class ReplayRole : uint8_t {
  kBoth,     ///< loads before admission and saves what it publishes
  kPrefill,  ///< a prefill instance: each request's output capped at its first token; saves
  kDecode,   ///< a decode instance: loads what a prefill instance saved, saves nothing
};
std::string_view toString(ReplayRole role) noexcept;

/// How the pool size was chosen.
enum class PoolSizing : uint8_t {
  kUnbounded,  ///< computed from the workload so that nothing is ever evicted
  kPages,      ///< --pool-pages
  kTokens,     ///< --pool-tokens, rounded down to whole pages
  /// --kv-budget-bytes: every device KV pool from one byte budget, split by the mode
  /// (docs/replay.md, "KV budget"); the host tier, recurrent state and snapshots are not in it.
  kBudgetBytes,
};

/// Replay settings; defaults are mkv-replay's (docs/replay.md).
struct ReplayConfig {
  ReplayMode mode = ReplayMode::kReuse;
  int32_t windowTokens = 4096;  ///< W of the sliding layers (kSwa, slidingReuse)
  int32_t fullLayers = 0;       ///< kSwa, slidingReuse: full-attention layers besides the sliding
  int32_t layers = 1;           ///< attention layers (sliding ones in kSwa and slidingReuse)
  /// kReuse: the `layers` are sliding (window windowTokens) beside `fullLayers` >= 1 full ones,
  /// served by the sliding-window reuse backend (mkv-replay --window in reuse mode).
  bool slidingReuse = false;
  /// slidingReuse with --kv-budget-bytes: the share of the budget that buys sliding pages (the
  /// rest buys full-pool pages); docs/replay.md, "KV budget".
  double slidingBudgetShare = 0.45;
  int32_t kvHeads = 1;
  int32_t headDim = 8;
  DataType dtype = DataType::kFloat16;
  int32_t pageSize = 128;
  PoolSizing poolSizing = PoolSizing::kUnbounded;
  int64_t poolAmount = 0;  ///< pages (kPages), tokens (kTokens) or bytes (kBudgetBytes)
  int32_t maxBatch = 1;    ///< sequences executing at once
  /// Per-step token budget of a serving engine (ReferenceEngineOptions::maxBatchedTokens): joiners
  /// prefill in chunks within it, after the decodes; 0 = a joiner prefills in the step it joins.
  int32_t maxBatchedTokens = 0;
  /// Preemption under pool pressure (ReferenceEngineOptions::preemption; needs in-flight joins):
  /// kRecompute preempts the newest running sequences before a decode step whose page growth
  /// the pool cannot give, and admits them again first, reusing what they published.
  testing::PreemptionMode preemption = testing::PreemptionMode::kNone;
  /// When a joiner takes its fresh pages (ContextCacheConfig::joinerPages): at admission, or per
  /// prefill chunk (needs in-flight joins; not swa mode, whose joiners hold 2M + 1 pages).
  JoinerPageAllocation joinerPages = JoinerPageAllocation::kWholePrompt;
  int32_t maxOutputTokens = 0;  ///< cap on sampled tokens per request; 0 = none
  std::size_t limit = 0;        ///< replay the first `limit` requests; 0 = all
  DeviceType device = DeviceType::kCPU;
  /// --device-writes: when the library's table and length writes reach the device
  /// (KVCacheRuntimeConfig::deviceWrites; the reference engine flushes once per step).
  DeviceWriteTiming deviceWrites = DeviceWriteTiming::kEachCall;
  testing::VerifyMode verify = testing::VerifyMode::kSample;
  uint64_t seed = 1;
  /// kReuse: reset the prefix cache (ContextCacheCoordinator::resetPrefixCache) each time another
  /// `resetCacheEvery` requests were handed to the engine, between two runs; 0 = never.
  int64_t resetCacheEvery = 0;
  /// kReuse: the context cache's victim order within a retention priority.
  EvictionPolicyKind eviction = EvictionPolicyKind::kS3Fifo;
  /// kReuse: tokens of the host tier (KVCacheRuntimeConfig::hostPoolTokens), rounded down to
  /// whole pages; 0 = none (docs/context_cache.md, "Host tier").
  int64_t hostPoolTokens = 0;
  /// kReuse with a host tier: a store shared with other engines (ContextCacheConfig::remoteTier;
  /// docs/context_cache.md, "Remote tier"), "redis://HOST:PORT" or "file:///DIR"; empty = none.
  /// Each request's blocks past what the GPU and the host tier hold are loaded before it is
  /// admitted; published blocks are saved unless the role is kDecode.
  std::string remoteTier;
  /// The deployment identity's model name (RemoteTierConfig::model).
  std::string remoteModel = "mkv-replay";
  /// Time to live of each value the remote tier writes, in seconds; 0 = none (the store's own
  /// eviction bounds it: RemoteKvStoreOptions::ttlSeconds).
  int64_t remoteTtlSeconds = 0;
  /// What this process does with the remote tier (docs/replay.md, "Remote tier").
  ReplayRole role = ReplayRole::kBoth;
  /// kReuse: each engine step's KV events go to this publisher as one batch (not owned).
  KvEventPublisher* kvEvents = nullptr;
  /// Tensor-parallel ranks (docs/replay.md, "Tensor parallelism"): runTensorParallelReplay
  /// replays on this many runtimes at once, each holding its share of the heads; 1 = one runtime.
  int32_t tensorParallel = 1;
  KvHeadLayout kvHeadLayout = KvHeadLayout::kSplitHeads;
  /// Set by runTensorParallelReplay for each rank's replay: its rank and the group's agreement.
  int32_t tensorParallelRank = 0;
  RankAgreement rankAgreement;
  // Speculative decoding (kReuse only).
  SpeculativeKind speculative = SpeculativeKind::kNone;
  /// Attention layers of the draft (same heads, head dim and dtype as the base); 0 = an MTP
  /// draft that reads the base KV and owns no pool (kMtp only).
  int32_t draftLayers = 1;
  int32_t specWidth = 3;  ///< K: draft tokens proposed per verification round

  // Hybrid checkpoint reuse (kReuse with recurrentLayers > 0; docs/replay.md, "Hybrid models").
  int32_t recurrentLayers = 0;       ///< Mamba / linear-attention layers besides `layers`
  int64_t recurrentStateBytes = 64;  ///< per recurrent layer and sequence
  int64_t recurrentConvBytes = 16;   ///< per recurrent layer and sequence
  /// Snapshot budget in checkpoints: recurrent slots and as many partial-KV slots; 0 = unbounded
  /// (sized from the workload: every capture finds a slot).
  int64_t snapshotSlots = 0;
  /// Tokens between the reuse points a prefill keeps (ContextCacheConfig::checkpointInterval); a
  /// multiple of pageSize; 0 = checkpoints at prompt and decode ends only.
  int32_t checkpointInterval = 0;
  /// Which reuse points a hybrid model keeps and how they rank (ContextCacheConfig::
  /// reusePointAdmission).
  mkv::ReusePointAdmission reusePointAdmission = mkv::ReusePointAdmission::kBranchFirst;
  /// Hybrid-MTP (kMtp with recurrent layers): fp16 elements of the base hidden row kept with
  /// each prompt endpoint (docs/replay.md, "Hybrid-MTP").
  int64_t boundaryHiddenWidth = 16;
  /// Tests: called after every run of the engine (between runs; fault injection).
  std::function<void(KVCacheRuntime&)> betweenRuns;
};

/// A configuration that cannot be replayed (an impossible pool, a bad geometry): mkv-replay
/// reports it as bad input.
class ReplayConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// The device KV pools a runtime may have.
enum class KvPoolKind : uint8_t {
  kFull,   ///< the full-attention layers (every attention layer outside bounded SWA)
  kSwa,    ///< the sliding layers' bounded pool
  kDraft,  ///< the paged draft's
};
std::string_view toString(KvPoolKind kind) noexcept;  ///< "full", "swa", "draft"

/// One device KV pool of the runtime (K and V of every layer it stores).
struct KvPoolUsage {
  KvPoolKind kind = KvPoolKind::kFull;
  int64_t pages = 0;
  int64_t bytesPerPage = 0;
  int64_t peakPagesInUse = 0;  ///< most pages not free at once (an identity-mapped pool: all)
};

/// The outcome of one request (its last attempt).
struct RequestRecord {
  std::size_t index = 0;
  std::string id;
  std::optional<double> timestampMs;
  int64_t promptTokens = 0;
  int32_t maxNewTokens = 0;  ///< after the --max-output cap
  int64_t reusedTokens = 0;
  int64_t prefillTokens = 0;                         ///< prompt - reused (executed by the prefill)
  int64_t generatedTokens = 0;                       ///< sampled tokens
  FinishReason reason = FinishReason::kNotFinished;  ///< kNotFinished when it was never admitted
  bool failed = false;  ///< never completed: refused with the pool otherwise idle, or failed alone
  bool joinedInFlight = false;
  int32_t attempts = 0;
  int64_t pagesInUseAfter = 0;  ///< pages not free (leased or cached) once it released its own
  /// Host time of the library calls of the decode steps it took part in; a step's time is shared
  /// evenly by the sequences it decoded (exact with --max-batch 1).
  int64_t decodeHostNanoseconds = 0;
};

/// One point of the replay's time line (one per completed request, in completion order).
struct TimelinePoint {
  int64_t completed = 0;
  int64_t pagesInUse = 0;
  double hitRate = 0.0;  ///< cumulative reused / prompt tokens so far
};

struct ReplayResult {
  ReplayConfig config;
  std::string workload;  ///< RequestSource::describe()
  KVCacheBackend backend = KVCacheBackend::kContextReuse;
  int32_t maxBatch = 1;            ///< effective (kSwa: limited by the pool)
  int64_t maxSequenceTokens = 0;   ///< page-table width in tokens
  int64_t poolPages = 0;           ///< pages of the managed pool (SWA pool in kSwa)
  int64_t bytesPerPage = 0;        ///< K and V of every layer of that pool
  std::vector<KvPoolUsage> pools;  ///< every device KV pool: full, swa, draft (those that exist)
  int64_t kvBytes = 0;             ///< KVCacheRuntime::kvBytes(): the pools' bytes in all
  /// The coordinator's counters at the end (absent on bounded SWA), exported whole to the JSON
  /// under kCoordinatorCounterFields' names.
  std::optional<ContextCacheCoordinatorCounters> coordinatorCounters;

  int64_t requests = 0;
  int64_t failedRequests = 0;
  int64_t retriedRequests = 0;
  int64_t joins = 0;
  /// Chunked prefill (maxBatchedTokens > 0): sequences (joiners, and founders the prefill step's
  /// budget did not cover) prefilled in more than one chunk, chunks in all, and each such
  /// sequence's decode steps from admission to its first token (p50, p99).
  int64_t chunkedPrefills = 0;
  int64_t prefillChunks = 0;
  int64_t heldFounders =
      0;  ///< of chunkedPrefills, founders (their prefill step ran a first chunk)
  int64_t timeToFirstTokenStepsP50 = 0;
  int64_t timeToFirstTokenStepsP99 = 0;
  /// Decode steps between two consecutive tokens of a sequence (p50, p99): 1 while it decodes
  /// every step, more across a preemption.
  int64_t timeBetweenTokensStepsP50 = 0;
  int64_t timeBetweenTokensStepsP99 = 0;
  /// Preemption: sequences preempted, preempted sequences admitted again, and the prompt tokens of
  /// those admissions and of them those reused (not in promptTokens / reusedTokens, which count
  /// first admissions; recomputed = resumedPromptTokens - resumedReusedTokens).
  int64_t preemptions = 0;
  int64_t resumed = 0;
  int64_t resumedPromptTokens = 0;
  int64_t resumedReusedTokens = 0;
  /// Of resumedPromptTokens, those generated before the preemptions (EngineStats::
  /// resumedGeneratedTokens).
  int64_t resumedGeneratedTokens = 0;
  /// Of resumedReusedTokens, those onboarded from the host tier (EngineStats::
  /// resumedHostTierTokens).
  int64_t resumedHostTierTokens = 0;
  /// Token figures count every admitted attempt (they differ from the per-request records only
  /// when requests were retried).
  int64_t promptTokens = 0;
  int64_t reusedTokens = 0;
  int64_t prefillTokensComputed = 0;
  int64_t generatedTokens = 0;
  int64_t decodeSteps = 0;
  double hitRate = 0.0;  ///< reused / prompt tokens
  int64_t evictedRecords = 0;
  int64_t cacheResets = 0;  ///< prefix cache resets (--reset-cache-every)
  /// The host tier's figures (--host-pool-tokens; all zero without one).
  struct HostTier {
    int64_t pages = 0;           ///< capacity
    int64_t bytes = 0;           ///< capacity in bytes (pinned host memory on the GPU)
    int64_t offloadedPages = 0;  ///< evicted GPU pages copied to the host
    int64_t onboardedPages = 0;  ///< host pages copied back into GPU pages
    int64_t offloadedBytes = 0;
    int64_t onboardedBytes = 0;
    int64_t hitTokens = 0;     ///< reused tokens that came from the host tier
    int64_t droppedPages = 0;  ///< blocks the full host tier dropped for good
    int64_t transfers = 0;     ///< copy batches enqueued
    /// Blocks of swap-preempted rows moved to the host at their compaction (--preemption swap).
    int64_t swappedOutBlocks = 0;
  } hostTier;
  /// The remote tier (ReplayConfig::remoteTier): the coordinator's counters at the end, the
  /// store's address, and the time admissions waited for their loads.
  struct RemoteTier {
    bool enabled = false;
    std::string store;
    RemoteTierCounters counters;
    int64_t loadWaitNanoseconds = 0;
    /// kPrefill: time spent after each run waiting for its saves (the handoff).
    int64_t handoffWaitNanoseconds = 0;
  } remoteTier;
  int64_t publishedRecords = 0;
  int64_t replacedChunkRecords = 0;  ///< chunk records the next publication replaced
  std::array<int64_t, kMissReasonCount> missesByReason{};
  int64_t peakPagesInUse = 0;
  int64_t peakKvBytes = 0;  ///< each pool's peak pages x its bytes per page, summed
  int32_t swaPagesPerSequencePrefill = 0;
  int32_t swaPagesPerSequenceDecode = 0;
  /// Measured: the most SWA pages in use per running row at a decode step, rounded up
  /// (EngineStats::peakSwaPagesPerDecodingRow; exact per sequence with maxBatch 1).
  int64_t swaPeakPagesPerDecodingRow = 0;
  /// Sliding-window reuse: the sliding pool's window cache (WindowBlockCache) at the end.
  struct WindowCache {
    int64_t publishedBlocks = 0;  ///< blocks whose sliding KV was published
    int64_t droppedBlocks = 0;    ///< cached blocks dropped to free their page
    int64_t cachedBlocks = 0;     ///< blocks cached at the end
    int64_t readBlocks = 0;       ///< of them, read by a hit's window or kept (dropped last)
    int64_t keptBlocks = 0;       ///< blocks moved to the read tier for a capped lookup's point
  } windowCache;
  int64_t oracleChecks = 0;
  int64_t oracleMismatches = 0;
  std::string firstMismatch;
  int64_t hostNsPerStepP50 = 0;
  int64_t hostNsPerStepP99 = 0;
  int64_t hostNsPerStepMean = 0;
  /// GPU tensors: stream time of the library's own work per decode step (CUDA events around
  /// prepareDecodeStep and completeDecodeStep). CPU tensors: not measured (gpuTimed false, 0).
  bool gpuTimed = false;
  int64_t gpuNsPerStepP50 = 0;
  int64_t gpuNsPerStepP99 = 0;
  int64_t gpuNsPerStepMean = 0;
  double wallSeconds = 0.0;
  /// With ReplayConfig::kvEvents: the low 64 bits of every block the cache's index holds at the
  /// end of the replay (what a subscriber rebuilds from the events), ascending.
  std::vector<uint64_t> indexedBlockHashes;
  /// The same for the sliding pool's window cache (the composed backend's group 1), ascending.
  std::vector<uint64_t> indexedWindowBlockHashes;
  int64_t droppedEvents = 0;  ///< events the full in-process queue overwrote before publication

  // Speculative decoding (ReplayConfig::speculative); 0 otherwise.
  int64_t draftBytesPerPage = 0;      ///< K and V of every draft layer (0: no draft pool)
  int64_t peakDraftPagesInUse = 0;    ///< most draft pages not free at once
  int64_t specRounds = 0;             ///< verification rounds, counted per running sequence
  int64_t proposedTokens = 0;         ///< draft tokens proposed: specWidth per round
  int64_t acceptedTokens = 0;         ///< of them accepted by the base and committed
  int64_t draftReusedTokens = 0;      ///< draft KV positions taken from the cache (paired paths)
  int64_t draftReusedPages = 0;       ///< the same in pages (paired paths are whole pages)
  int64_t specFullPageReplays = 0;    ///< admissions whose paired path's last page was replayed
  int64_t specPairPublications = 0;   ///< paired base + draft publication attempts
  int64_t draftOracleChecks = 0;      ///< of oracleChecks, draft KV positions
  int64_t draftOracleMismatches = 0;  ///< of oracleMismatches, draft KV positions
  /// Hybrid checkpoint reuse (recurrentLayers > 0); zero otherwise.
  struct Hybrid {
    int64_t recurrentSnapshotSlots = 0;
    int64_t partialKvSnapshotSlots = 0;
    int64_t snapshotBytes = 0;          ///< every slab of the coordinator's snapshot storage
    int64_t checkpointCaptures = 0;     ///< captures enqueued (prefill end, decode end)
    int64_t checkpointsPublished = 0;   ///< captured checkpoints committed as records
    int64_t checkpointsRestored = 0;    ///< sequences that started from a restored checkpoint
    int64_t snapshotPressureSkips = 0;  ///< captures skipped: no snapshot slot could be had
    /// Reuse points (checkpointInterval > 0): slots handed to the engine, the ends of joiners'
    /// prefill chunks the library captured (under a token budget), points committed as records,
    /// sequences that restored one, points evicted, and the points the engine wrote.
    int64_t reusePointCaptures = 0;
    int64_t chunkEndCaptures = 0;
    int64_t reusePointsPublished = 0;
    int64_t reusePointsRestored = 0;
    int64_t reusePointsEvicted = 0;
    int64_t reusePointsWritten = 0;
    int64_t recurrentChecks = 0;      ///< recurrent states the oracle verified
    int64_t recurrentMismatches = 0;  ///< of those, with a wrong byte (in oracleMismatches too)
    /// Hybrid-MTP (speculative kMtp): prompt endpoints committed with their boundary hidden row,
    /// boundary hidden rows copied back at a hit, and those the hidden-row oracle verified.
    bool hybridMtp = false;
    int64_t mtpEndpointsPublished = 0;
    int64_t boundaryHiddenRestores = 0;
    int64_t boundaryHiddenChecks = 0;
    int64_t boundaryHiddenMismatches = 0;  ///< in oracleMismatches too
    /// The same trace replayed by the attention layers alone (block reuse), when runReplay got an
    /// attention-only source.
    bool attentionOnlyRun = false;
    int64_t attentionOnlyReusedTokens = 0;
    double attentionOnlyHitRate = 0.0;
  } hybrid;

  /// runTensorParallelReplay's figures (size 1 for runReplay).
  struct TensorParallel {
    int32_t size = 1;
    int32_t devices = 0;      ///< CUDA devices the ranks ran on (rank r on r % visible); 0 on CPU
    int64_t agreements = 0;   ///< of rank 0's runtime (TensorParallelStats)
    int64_t divergences = 0;  ///< of rank 0's runtime
    /// Every rank's figures, timings aside, equal rank 0's; else the first that differs.
    bool ranksIdentical = true;
    std::string firstDifference;
    int64_t oracleChecksAllRanks = 0;      ///< positions verified in every rank's pools
    int64_t oracleMismatchesAllRanks = 0;  ///< of them wrong
  } tensorParallel;

  std::vector<RequestRecord> records;   ///< by request index
  std::vector<TimelinePoint> timeline;  ///< by completion
};

/// Called now and then with (requests handed to the engine, requests to replay).
using ProgressCallback = std::function<void(std::size_t, std::size_t)>;

/// Runs the replay. Throws ReplayConfigError for a configuration that cannot run, mkv::Error for
/// library contract violations (a bug), and std::exception from the source.
/// With recurrent layers and `attentionOnly` (a second, fresh copy of `source`), the same trace
/// is then replayed once more with the attention layers alone and no oracle (the figures of
/// ReplayResult::Hybrid::attentionOnly*); it is ignored without recurrent layers.
ReplayResult runReplay(RequestSource& source, ReplayConfig const& config,
                       ProgressCallback const& progress = {},
                       RequestSource* attentionOnly = nullptr);

/// Replays on config.tensorParallel ranks at once, each in a thread of its own with its own
/// runtime (and stream) holding its share of the heads (config.kvHeadLayout), joined by a
/// LocalRankGroup: `sources` holds one fresh copy of the workload per rank. On kGPU rank r runs on
/// CUDA device r % (visible devices), so N ranks use N GPUs where there are as many. Rank 0 reports
/// progress and publishes KV events. Returns rank 0's result, its tensorParallel figures filled
/// in (whether every rank's figures equal rank 0's, every rank's oracle counts). Throws as
/// runReplay does (the lowest rank's error), and ReplayConfigError for a size below 2 or a number
/// of sources other than the size.
ReplayResult runTensorParallelReplay(std::vector<RequestSource*> const& sources,
                                     ReplayConfig const& config,
                                     ProgressCallback const& progress = {});

}  // namespace mkv::replay
