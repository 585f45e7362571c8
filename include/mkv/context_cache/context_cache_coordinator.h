#pragma once
/// \file context_cache_coordinator.h
/// Stream-aware lifecycle of context reuse over full paged KV. Drives the CUDA-free
/// ContextCacheManager and the physical resources (page tables, KV lengths, snapshots).
/// Call order, statuses and publication points: docs/lifecycle.md and docs/context_cache.md.

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/context_cache/context_cache_config.h"
#include "mkv/context_cache/context_cache_metrics.h"
#include "mkv/context_cache/context_cache_types.h"
#include "mkv/context_cache/kv_events.h"
#include "mkv/cuda_types.h"
#include "mkv/fault_site.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/request_handle.h"
#include "mkv/resident_slot_pool.h"
#include "mkv/snapshot_storage.h"
#include "mkv/stream.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {
// The manager and its value types are internal (src/context_cache/context_cache_manager.h); the
// coordinator holds the manager by pointer and names these only in private declarations.
class ContextCacheManager;
class HostKvTier;
class WindowBlockCache;
struct HostPageCopy;
struct AdmissionResult;
struct LookupRequest;
struct LookupResult;
struct PromptBlocks;
struct SnapshotReservation;
namespace detail {
class DeviceWriteQueue;
class HostTierMover;
class RemoteTierLink;
class Int32UploadRegions;
class RequestMode;
template <class Request>
class RequestRegistry;
struct AdmissionLimits;
struct CoordinatorParts;
struct CoordinatorRequest;
struct CoordinatorSequence;
struct RequestModes;
}  // namespace detail

// The settings the coordinator is built from (ContextCacheConfig, ContextCacheDeploymentProfile)
// are in context_cache_config.h, AdmissionEstimate in context_cache_types.h: value types the
// entry headers name without this one.

/// Borrowed physical resources; all must outlive the coordinator.
struct ContextCachePhysicalResources {
  KVCachePool* basePool = nullptr;       ///< full paged KV of the base model (null: pure recurrent)
  KVPageTable* basePageTable = nullptr;  ///< dense table over basePool ids
  KVCachePool* draftPool = nullptr;      ///< paged draft KV (speculative, paged contract)
  KVPageTable* draftPageTable = nullptr;
  RecurrentStatePool* recurrent = nullptr;  ///< hybrid / pure recurrent models
  /// The runtime's resident rows (KVCacheRuntime sets it). When set, beginRequest and
  /// admitSequence refuse a ResidentRef that is not held with its current epoch (a stale ref of
  /// a released and reused row): ResidentSlotPool::requireHeld.
  ResidentSlotPool const* residentSlots = nullptr;
  /// Host tier of the base pool (KVCacheRuntime creates it from `hostPoolTokens`), or null:
  /// evicted blocks are copied there and lookups continue into it (docs/context_cache.md, "Host
  /// tier"). Attention-only, non-speculative deployments with reuse on only.
  HostKvTier* hostTier = nullptr;
  /// The sliding pool of the composed backend (sliding layers with context reuse; the runtime
  /// owns it), or null. When set, every vanilla lookup applies the window rule
  /// (docs/context_cache.md, "Window rule"): a prefix is reused only as far as the sliding
  /// layers' window before it is cached there. Vanilla attention-only reuse only: refused with
  /// reuse disabled, a hybrid or speculative profile or a host tier, and unless its page size is
  /// the base pool's.
  WindowBlockCache* windowCache = nullptr;
  /// Where the table rows and KV lengths the coordinator writes wait for the device (not owned;
  /// KVCacheRuntime sets it, one for every backend of the runtime; the coordinator adds the base
  /// and draft tables to its tables). Null: the coordinator owns one that applies them at the end
  /// of each call.
  detail::DeviceWriteQueue* deviceWrites = nullptr;
};

/// One sequence of an admission.
struct ContextCacheSequenceAdmission {
  std::vector<int32_t> tokenIds;     ///< full logical prompt
  BlockKeyExtras keyExtras;          ///< adapter and salt digests
  std::vector<MediaPosition> media;  ///< empty (text only) or one entry per prompt token
  ResidentRef resident;
  /// Overrides the batch policy for this sequence when set.
  std::optional<ContextCacheLookupPolicy> lookupPolicy;
  /// Retention priorities of the records this sequence publishes (requireValidRetention).
  std::vector<RetentionRange> retention;
  /// Overrides the batch's commit policy for this sequence when set: what it publishes when it
  /// completes or is preempted (a joiner of another tenant keeps its own; docs/lifecycle.md,
  /// "In-flight admission"). A Hybrid-MTP sequence must still resolve to kPrefillStateOnly.
  std::optional<ContextCacheCommitPolicy> commitPolicy;
};

/// A batch admission (one runtime request).
struct ContextCacheBatchAdmission {
  std::vector<ContextCacheSequenceAdmission> sequences;
  bool speculativeRequest = false;
  DecodingTokenStateContract tokenStateContract =
      DecodingTokenStateContract::kCommittedPlusLookahead;
  ContextCacheLookupPolicy lookupPolicy = ContextCacheLookupPolicy::kUseCache;
  ContextCacheCommitPolicy commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
  /// Hybrid-MTP requests only (0 elsewhere): the last prompt tokens the next turn will not
  /// reproduce (a chat template's generation prompt); publishHybridMtpEndpoint refuses a length
  /// that reaches into them. In [0, prompt length).
  int32_t replayTailLength = 0;
};

/// `committedStateLength` of an advance that keeps a sequence where it is (cancelled slot,
/// joiner not yet finalised): zero tokens accepted, ledger unchanged.
inline constexpr int32_t kHoldCommittedStateLength = -1;

/// Progress of one sequence over one execution.
struct ContextCacheSequenceAdvance {
  int32_t const* acceptedTokenIds = nullptr;  ///< tokens appended to the ledger
  int32_t acceptedTokenCount = 0;
  /// Tokens whose KV is now materialised, or kHoldCommittedStateLength.
  int32_t committedStateLength = kHoldCommittedStateLength;
};

/// Coordinator-level counters (the manager's ContextCacheMetrics cover admission, publication
/// and eviction).
struct ContextCacheCoordinatorCounters {
  uint64_t requests = 0;               ///< beginRequest calls that admitted a batch
  uint64_t refusedRequests = 0;        ///< beginRequest calls refused for capacity
  uint64_t prefillPublications = 0;    ///< publication attempts at prefill end
  uint64_t decodePublications = 0;     ///< publication attempts at decode end (completed slots)
  uint64_t liveAdmissions = 0;         ///< in-flight sequences admitted
  uint64_t liveAdmissionRefusals = 0;  ///< in-flight admissions refused for capacity
  uint64_t retractedAdmissions = 0;
  uint64_t pageGrowths = 0;       ///< decode steps that grew a sequence's pages
  uint64_t growthFailures = 0;    ///< growth refused (a decode step's or a chunk's): row failed
  uint64_t synchronizations = 0;  ///< stream synchronisations made by the coordinator
  uint64_t quarantinedRequests = 0;
  uint64_t checkpointRestores = 0;      ///< sequences that started from a restored checkpoint
  uint64_t checkpointCaptures = 0;      ///< checkpoint captures enqueued (prefill or decode end)
  uint64_t checkpointPublications = 0;  ///< captured checkpoints committed as records
  /// Captures skipped because no snapshot slot could be reserved (the request carries on).
  uint64_t snapshotPressureSkips = 0;
  uint64_t captureSynchronizations = 0;  ///< synchronisations made for decode-end captures
  /// Speculative requests: paired (base + draft) publication attempts at the common length.
  uint64_t specPairPublications = 0;
  uint64_t hybridMtpPublications = 0;   ///< Hybrid-MTP endpoints committed as records
  uint64_t boundaryHiddenRestores = 0;  ///< boundary hidden rows copied back (Hybrid-MTP hits)
  uint64_t planningNanoseconds = 0;     ///< host time spent in lookup + acquire
  /// Host tier: batches of page moves enqueued (offloads and onboardings of one manager call).
  uint64_t hostTierTransfers = 0;
  /// Reuse points (ContextCacheConfig::checkpointInterval): slots handed to the engine to capture
  /// into, new records committed from them (a point another row or request committed first is
  /// not counted), and sequences that restored one.
  uint64_t reusePointCaptures = 0;
  uint64_t reusePointPublications = 0;
  uint64_t reusePointRestores = 0;
  /// Reuse points the coordinator captured at the ends of in-flight admissions' prefill chunks
  /// (checkpoint deployments), committed with the row's other points when it finalises.
  uint64_t chunkEndCaptures = 0;
  uint64_t prefillChunks = 0;  ///< completePrefillChunk calls accepted (joiners' and founders')
  /// Founders whose prefill went on in chunks after the request's prefill completed (held at
  /// finalizePrefillPublication, finalised later as in-flight admissions).
  uint64_t heldPrefills = 0;
  /// preparePrefillChunk calls that allocated a chunk's pages (JoinerPageAllocation::kPerChunk).
  uint64_t chunkPageGrowths = 0;
  uint64_t preemptions = 0;  ///< rows preempted (preemptSequence)
};

/// One counter of ContextCacheCoordinatorCounters as every export names it: the Prometheus
/// series `<prefix><name>_total`, the JSON key `<name>`, and its help text.
struct CoordinatorCounterField {
  std::string_view name;
  std::string_view help;
  uint64_t ContextCacheCoordinatorCounters::*value;
  /// A duration (host nanoseconds) rather than a count of events: it differs from run to run of
  /// the same workload, so reports that compare runs keep it apart (mkv-replay's JSON:
  /// `coordinator_timings` beside `coordinator_counters`).
  bool timing = false;
};

/// Every counter of ContextCacheCoordinatorCounters, in declaration order: the one list the
/// exports (toPrometheus, mkv-replay's JSON) iterate. A test checks that it covers every field.
inline constexpr auto kCoordinatorCounterFields = std::to_array<CoordinatorCounterField>({
    {"coordinator_requests", "Requests admitted by beginRequest.",
     &ContextCacheCoordinatorCounters::requests},
    {"coordinator_refused_requests", "Requests refused for capacity.",
     &ContextCacheCoordinatorCounters::refusedRequests},
    {"coordinator_prefill_publications", "Publication attempts at prefill end.",
     &ContextCacheCoordinatorCounters::prefillPublications},
    {"coordinator_decode_publications", "Publication attempts at decode end.",
     &ContextCacheCoordinatorCounters::decodePublications},
    {"coordinator_live_admissions", "Sequences admitted into a running batch.",
     &ContextCacheCoordinatorCounters::liveAdmissions},
    {"coordinator_live_admission_refusals", "In-flight admissions refused for capacity.",
     &ContextCacheCoordinatorCounters::liveAdmissionRefusals},
    {"coordinator_retracted_admissions", "In-flight admissions retracted.",
     &ContextCacheCoordinatorCounters::retractedAdmissions},
    {"coordinator_page_growths", "Decode steps that grew a sequence's pages.",
     &ContextCacheCoordinatorCounters::pageGrowths},
    {"coordinator_growth_failures", "Page growths refused (request failed).",
     &ContextCacheCoordinatorCounters::growthFailures},
    {"coordinator_synchronizations", "Stream synchronisations made by the coordinator.",
     &ContextCacheCoordinatorCounters::synchronizations},
    {"coordinator_quarantined_requests", "Requests quarantined after a failed sync.",
     &ContextCacheCoordinatorCounters::quarantinedRequests},
    {"coordinator_checkpoint_restores", "Sequences started from a restored checkpoint.",
     &ContextCacheCoordinatorCounters::checkpointRestores},
    {"coordinator_checkpoint_captures", "Checkpoint captures enqueued.",
     &ContextCacheCoordinatorCounters::checkpointCaptures},
    {"coordinator_checkpoint_publications", "Captured checkpoints committed as records.",
     &ContextCacheCoordinatorCounters::checkpointPublications},
    {"coordinator_snapshot_pressure_skips", "Checkpoint captures skipped for want of a slot.",
     &ContextCacheCoordinatorCounters::snapshotPressureSkips},
    {"coordinator_capture_synchronizations",
     "Stream synchronisations made for decode-end captures.",
     &ContextCacheCoordinatorCounters::captureSynchronizations},
    {"coordinator_spec_pair_publications",
     "Speculative publication attempts at the common base and draft length.",
     &ContextCacheCoordinatorCounters::specPairPublications},
    {"coordinator_hybrid_mtp_publications", "Hybrid-MTP endpoints committed as records.",
     &ContextCacheCoordinatorCounters::hybridMtpPublications},
    {"coordinator_boundary_hidden_restores", "Boundary hidden rows restored (Hybrid-MTP).",
     &ContextCacheCoordinatorCounters::boundaryHiddenRestores},
    {"coordinator_planning_nanoseconds", "Host nanoseconds spent in lookup and acquire.",
     &ContextCacheCoordinatorCounters::planningNanoseconds, true},
    {"coordinator_host_tier_transfers",
     "Host tier batches of page moves enqueued (offloads and onboardings of one call).",
     &ContextCacheCoordinatorCounters::hostTierTransfers},
    {"coordinator_reuse_point_captures", "Reuse-point slots handed to the engine to capture.",
     &ContextCacheCoordinatorCounters::reusePointCaptures},
    {"coordinator_reuse_point_publications", "Reuse points committed as records.",
     &ContextCacheCoordinatorCounters::reusePointPublications},
    {"coordinator_reuse_point_restores", "Sequences started from a restored reuse point.",
     &ContextCacheCoordinatorCounters::reusePointRestores},
    {"coordinator_chunk_end_captures",
     "Reuse points captured at the ends of in-flight admissions' prefill chunks.",
     &ContextCacheCoordinatorCounters::chunkEndCaptures},
    {"coordinator_prefill_chunks", "Prefill chunks completed (in-flight admissions and founders).",
     &ContextCacheCoordinatorCounters::prefillChunks},
    {"coordinator_held_prefills",
     "Founders whose prefill went on in chunks after the request's prefill completed.",
     &ContextCacheCoordinatorCounters::heldPrefills},
    {"coordinator_chunk_page_growths", "Prefill chunks whose pages were allocated when prepared.",
     &ContextCacheCoordinatorCounters::chunkPageGrowths},
    {"coordinator_preemptions", "Rows preempted, their committed state published.",
     &ContextCacheCoordinatorCounters::preemptions},
});

/// Context reuse over full paged KV: lookups at admission, page rows for execution, growth per
/// decode step, publication at the runtime's existing completion points, compaction that never
/// moves resident rows, in-flight admission, poison and quarantine.
///
/// Hybrid and pure-recurrent deployments reuse exact checkpoints instead of blocks: recurrent
/// rows plus the valid rows of a partially filled last KV page, kept in a SnapshotStorage the
/// coordinator owns, its slots typed resources of the manager. A checkpoint is captured at the
/// prompt end (enqueuePrefillCaptures, committed after the runtime's prefill synchronisation) and
/// at the committed length of rows that finished normally (completeDecodeStep, committed after
/// one capture synchronisation); preparePrefill restores the longest one strictly shorter than
/// the prompt. When no snapshot slot can be had, the capture is skipped, never the request.
///
/// Several requests may be admitted at once (their leases overlap in lifetime), but only one may
/// be executing (between preparePrefill and finish) at a time: the pool's KV-length tensor is
/// per batch. All calls use the construction stream.
///
/// Errors: contract violations throw mkv::Error (call + value) and change nothing; expected
/// outcomes are ContextCacheStatus values. A failed synchronisation poisons the coordinator and
/// quarantines the request (its pages stay leased) until shutdown() drains it.
/// Thread-safety: single writer (the engine thread).
class ContextCacheCoordinator {
  using Request = detail::CoordinatorRequest;
  using Sequence = detail::CoordinatorSequence;

 public:
  /// Move-only handle of an admitted request (mkv/request_handle.h); destroying a live handle
  /// abandons the request (synchronises when work is pending; on failure poisons and quarantines).
  using RequestHandle = mkv::RequestHandle<ContextCacheCoordinator>;

  struct AdmissionResult {
    RequestHandle request;
    std::vector<int32_t> prefillStarts;  ///< reuse length per sequence (execution starts here)
  };
  struct BeginRequestResult {
    ContextCacheStatus status = ContextCacheStatus::kRequestFailed;
    std::optional<AdmissionResult> admission;
  };
  struct AdmitSequenceResult {
    ContextCacheStatus status = ContextCacheStatus::kRequestFailed;
    bool insufficientCapacity = false;  ///< kRequestFailed because of pool pressure (retry later)
    int32_t prefillStart = 0;
  };

  /// Validates the deployment and resources (throws mkv::Error) and builds the manager.
  /// `synchronizer`: empty = defaultStreamSynchronizer. `faults` is consulted at
  /// FaultSite::kStreamSynchronize (after each synchronisation), kSnapshotCapture (before each
  /// capture launch), kPublication (before each publication of full blocks) and, for the write
  /// queue the coordinator owns when resources.deviceWrites is null, kDeviceWriteLaunch; what each
  /// call leaves after such a failure is documented at the call (publishHybridMtpEndpoint,
  /// finish). Empty = no faults.
  ContextCacheCoordinator(ContextCacheConfig const& config,
                          ContextCacheDeploymentProfile const& profile,
                          ContextCachePhysicalResources resources, cudaStream_t stream,
                          StreamSynchronizer synchronizer = {}, FaultInjector faults = {});
  /// Terminates the process when requests are still active or quarantined.
  ~ContextCacheCoordinator();
  ContextCacheCoordinator(ContextCacheCoordinator const&) = delete;
  ContextCacheCoordinator& operator=(ContextCacheCoordinator const&) = delete;

  /// Looks up and leases every sequence (all or nothing). kRequestFailed when the pools cannot
  /// hold the batch (nothing changed), kPoisoned when poisoned (reported before residents still
  /// held by a quarantined request are rejected). Throws for a foreign stream, an empty or
  /// oversized batch, bad or busy residents, empty or oversized prompts, bad headroom (draft
  /// headroom > 0 exactly when the request pairs a paged draft), a speculative request on a
  /// non-speculative deployment, or a Hybrid-MTP request with a sequence without
  /// kPrefillStateOnly, and (with resources.residentSlots) for a resident the runtime's pool does
  /// not hold with that epoch (stale). A speculative batch with media in any sequence bypasses
  /// the cache as a whole (no lookup, no publication).
  BeginRequestResult beginRequest(ContextCacheBatchAdmission const& admission,
                                  DecodingKvHeadroom const& headroom, cudaStream_t stream);
  /// Binds page-table rows (one upload), resets the device KV lengths to the reuse lengths and,
  /// on checkpoint deployments, restores each hit's recurrent rows and the valid rows of its
  /// partial page (zeroes the recurrent rows of sequences that reuse nothing); stream-ordered.
  /// Throws outside (admitted, no pending work) or when another request executes.
  void preparePrefill(RequestHandle& handle);
  /// Checkpoint deployments: enqueues, after the runtime's prefill kernels, the capture of every
  /// (non-bypass) sequence's state at its prompt end; committed by finalizePrefillPublication.
  /// A sequence whose slots cannot be reserved is skipped (snapshotPressureSkips); a second call
  /// stages nothing more. No-op on attention-only deployments. Throws outside preparePrefill ->
  /// finalizePrefillPublication.
  void enqueuePrefillCaptures(RequestHandle& handle);
  /// The reuse points execution row `row` captures in the prepared prefill, ascending by position
  /// (ContextCacheConfig::checkpointInterval; empty without one, for a bypass row, a speculative
  /// Hybrid-MTP request, positions already cached, and once slots run out: snapshotPressureSkips).
  /// The engine writes the state after each `position` into its `snapshotSlot` before the
  /// prefill's synchronisation; finalizePrefillPublication commits them, before the prompt end.
  /// Valid between preparePrefill and finalizePrefillPublication, and for an in-flight admission
  /// until finalizeSequenceAdmission (which commits them; the engine writes each point in the
  /// chunk that passes it); throws otherwise and for a row outside the batch.
  std::span<ReusePointCapture const> reusePointCaptures(RequestHandle const& handle,
                                                        ExecutionRow row) const;
  /// After the runtime's prefill synchronisation: applies one advance per sequence (the prompt
  /// plus the lookahead under kCommittedPlusLookahead) and publishes the prompt's full blocks
  /// (checkpoint deployments: commits the reuse points of reusePointCaptures, then the captures
  /// of enqueuePrefillCaptures, instead).
  /// `commonStateLengths` (tokens whose base *and* draft state is materialised) is for
  /// speculative requests only: one per sequence, each equal to the prompt length; required when
  /// the request pairs a paged draft on a deployment other than Hybrid-MTP, derived from the
  /// advances when empty otherwise (Hybrid-MTP requests may omit them). A speculative request on an
  /// attention deployment publishes nothing here: its draft initialisation is still running, so
  /// the prompt endpoint is frozen and published after the first verification round, for the rows
  /// that round advances (a row it holds, cancelled or errored, publishes nothing), or, when no
  /// round follows, after the synchronisation of compactBatch / finish; never on abandonment.
  /// A founder whose prefill chunks stopped short of its prompt (awaitsPrefill) takes a hold
  /// advance (0 tokens, kHoldCommittedStateLength) and goes on as an unfinalised in-flight
  /// admission; the other rows' advances are as above.
  /// Throws unless a prefill is prepared (before preparePrefill, after finalisation, during a
  /// decode step), and with DeviceWriteTiming::kEngineStep when the rows and lengths preparePrefill
  /// wrote never reached the device (no flush returned since: docs/errors.md).
  ContextCacheStatus finalizePrefillPublication(
      RequestHandle& handle, std::span<ContextCacheSequenceAdvance const> advances,
      std::span<int32_t const> commonStateLengths = {});
  /// Grows each sequence's pages to cover committed + headroom and uploads the grown entries (an
  /// unfinalised joiner holds: its admission bound its prompt's pages, and it grows none).
  /// kRequestFailed when a sequence cannot grow: that row is named by lastFailure, the step is
  /// not prepared and the request stays settled (rows grown before it keep their pages), so the
  /// engine may drop or preempt rows and call again.
  ContextCacheStatus prepareDecodeStep(RequestHandle& handle, DecodingKvHeadroom const& headroom);
  /// The pages prepareDecodeStep(handle, headroom) would allocate now, per pool, and the first
  /// row it would find past its table width. Changes nothing. Throws where prepareDecodeStep
  /// throws (no settled request, a headroom of the wrong shape).
  DecodeStepDemand decodeStepDemand(RequestHandle const& handle,
                                    DecodingKvHeadroom const& headroom) const;
  /// After the runtime's decode synchronisation: applies advances and publishes the full blocks
  /// of `completedRows` (finished, not cancelled or errored) at decode end. Speculative
  /// requests accept any positive number of tokens per row (committed = previous + accepted) and
  /// publish paired base + draft paths at the common length (one per row; required when the
  /// request pairs a paged draft on a deployment other than Hybrid-MTP, derived from the
  /// advances when empty otherwise; monotonic, at most the committed length; entries of held
  /// rows are ignored). Checkpoint
  /// deployments capture the completed slots' state at their committed length instead, make one
  /// capture synchronisation and commit; when it fails: kPoisoned, the request is quarantined
  /// and the handle invalidated. Throws, changing nothing, when the step's grown rows never
  /// reached the device (as finalizePrefillPublication).
  ContextCacheStatus completeDecodeStep(RequestHandle& handle,
                                        std::span<ContextCacheSequenceAdvance const> advances,
                                        std::span<ExecutionRow const> completedRows,
                                        std::span<int32_t const> commonStateLengths = {});
  /// Validates an order-preserving mapping and copies it into `deviceMapping` (int32, reshaped
  /// to [oldBatch], on the pool's device). Throws, changing nothing, as well when a KV-length
  /// tensor to compact (base, and draft for a paired request) does not hold exactly the batch's
  /// rows (a seated joiner the engine did not grow it for): everything compactBatch needs is
  /// checked here.
  void beginBatchCompaction(RequestHandle& handle, std::span<int32_t const> oldToNew,
                            int32_t newBatchSize, Tensor& deviceMapping);
  /// Clears dropped residents' rows, compacts KV lengths, zeroes dropped recurrent rows,
  /// synchronises, then releases the dropped leases; the published blocks of dropped rows
  /// preempted with PreemptionKind::kSwap then move to the host tier (one batch of copies).
  /// kPoisoned on a failed synchronisation (request quarantined, handle invalidated), and when
  /// launching those copies failed (the compaction is done; the coordinator is poisoned and the
  /// moved blocks forgotten, as for any host-tier move).
  ContextCacheStatus compactBatch(RequestHandle& handle);
  /// Every check of beginBatchCompaction / compactBatch, without their effects (throws naming
  /// `call`): for a composed request, whose two halves must both accept before either changes.
  void checkBeginBatchCompaction(RequestHandle const& handle, std::span<int32_t const> oldToNew,
                                 int32_t newBatchSize, Tensor const& deviceMapping,
                                 char const* call) const;
  void checkCompactBatch(RequestHandle const& handle, char const* call) const;
  /// Synchronises pending work and releases every lease. kPoisoned when the synchronisation fails
  /// (request quarantined) or the coordinator is poisoned, else kOk. An invalid handle (finished,
  /// or quarantined by compactBatch) changes nothing and reports the same way.
  ContextCacheStatus finish(RequestHandle& handle);
  /// Drains quarantined requests; clears the poison when every drain succeeded. With a remote
  /// tier, first waits for its loads and saves (each bounded by the store's timeout), so no host
  /// page stays held. kRequestFailed when requests are still active.
  ContextCacheStatus shutdown() noexcept;
  /// Clears the prefix cache between requests (ContextCacheManager::resetPrefixCache): every
  /// record dropped, its pages and snapshot slots free, the composed backend's sliding pool
  /// emptied of cached windows (WindowBlockCache::clear), one AllBlocksCleared KV event. Host
  /// bookkeeping only: no device work, no synchronisation (no row references a cached page
  /// while no request lives). Returns false and changes nothing while a request is active or
  /// quarantined, or the coordinator is poisoned (shutdown() first).
  bool resetPrefixCache() noexcept;

  /// Hybrid-MTP (speculative request on a Hybrid-MTP deployment): publishes the exact checkpoint
  /// of row `row` at `residentStateLength` tokens with the boundary token (the last one) kept
  /// private. A founder's between preparePrefill and finalizePrefillPublication (within its
  /// whole prompt, or within its completed first chunk when it is held); an unfinalised joiner's
  /// (or a held founder's) between steps before finalizeSequenceAdmission, within its completed
  /// chunks (completePrefillChunk(row, L) first, also for a joiner prefilled whole). Captures
  /// the recurrent rows, the valid rows of the paired base and draft boundary pages (page
  /// (length - 1) / tokensPerPage) and row `boundaryHiddenRow` of `baseHiddenStates`
  /// ([rows, boundaryHiddenWidth] of boundaryHiddenType on the pools' device), synchronises the
  /// stream once and commits the record. Releases the pins on the row's restored checkpoint (so
  /// restoreHybridMtpBoundaryHidden must come first). kOk without publishing for a bypass row,
  /// a length of 0, a length already published, or when no snapshot slot can be had (pressure,
  /// counted in snapshotPressureSkips). kPoisoned when the synchronisation fails (request
  /// quarantined, handle invalidated). Throws, changing nothing, on another deployment, for a
  /// non-speculative request, for a row whose prefill is not under way as above, a slot outside
  /// the batch, a negative length or one beyond the prompt (the replay tail excluded) or the
  /// completed chunks, pages the row does not hold, rows that have not reached the device
  /// (DeviceWriteTiming::kEngineStep), or a hidden tensor / row that does not fit. The snapshot
  /// slots are reserved while the hit's pins are still held; only when none is free are the pins
  /// released and the reservation retried. A std::bad_alloc of the first reservation or a capture
  /// that throws (its reservation is retired first) leaves the request as it was, pins included,
  /// unless the pins had been released for the retry under pressure.
  ContextCacheStatus publishHybridMtpEndpoint(RequestHandle& handle, ExecutionRow row,
                                              int32_t residentStateLength,
                                              Tensor const& baseHiddenStates,
                                              int32_t boundaryHiddenRow);
  /// Hybrid-MTP, while row `row`'s prefill is under way (a founder's between preparePrefill and
  /// finalizePrefillPublication, an unfinalised joiner's between steps) and before its endpoint:
  /// enqueues the copy of the boundary hidden row of the row's restored checkpoint into row
  /// `destinationRow` of `baseHiddenStates` (stream-ordered, no synchronisation). Throws,
  /// changing nothing, on another deployment, outside those stages, when the row restored no
  /// Hybrid-MTP checkpoint (or its pins were released), or for a tensor / row that does not fit.
  void restoreHybridMtpBoundaryHidden(RequestHandle& handle, ExecutionRow row,
                                      Tensor& baseHiddenStates, int32_t destinationRow);

  /// Composed backend (resources.windowCache set): publishes blocks [firstBlock, firstBlock +
  /// pages.size()) of row `row`'s committed tokens, block firstBlock + i on the sliding page
  /// `pages[i]` (held by the caller, its sliding-layer KV complete), through
  /// WindowBlockCache::publish. Blocks past the prompt (generated tokens) only under
  /// ContextCacheCommitPolicy::kIncludingGeneratedTokens, as the full layers' own publication.
  /// Returns how many are now cached on the given pages (first committer wins: a block already
  /// cached on another page is not counted). A bypass row publishes nothing and returns 0.
  /// Throws, changing nothing, for an invalid handle, a row outside the batch or before its
  /// prefill completed (finalizePrefillPublication, or finalizeSequenceAdmission for a joiner),
  /// no window cache, blocks that are not full blocks of the committed tokens (of the prompt
  /// under kPrefillStateOnly), a page twice, or a page
  /// the cache refuses (out of range, not held, caching another block). Out of host memory, the
  /// blocks published before stay published.
  int32_t publishWindowBlocks(RequestHandle const& handle, ExecutionRow row, int32_t firstBlock,
                              std::span<PageId const> pages);
  /// Composed backend: the sliding pages of the window before row `row`'s prefill start
  /// (WindowBlockCache::windowPages of its prompt blocks before reuseTokenLength / page), in
  /// block order; empty when it reuses nothing. The caller holds them (hold) before the cache
  /// allocates again. Throws for an invalid handle or row, no window cache, or a window block no
  /// longer cached.
  std::vector<PageId> reusedWindowPages(RequestHandle const& handle, ExecutionRow row) const;
  /// The sliding pool of the composed backend, or null.
  WindowBlockCache* windowCache() const noexcept { return mResources.windowCache; }

  /// In-flight admission is offered on deployments with attention layers: attention-only
  /// requests, vanilla or speculative (a speculative joiner gets base and draft rows; its prompt
  /// endpoint is frozen at finalisation until the first verification round after it), and plain
  /// hybrid requests (a hybrid joiner's hit checkpoint is restored into its resident row at
  /// admission, or the row is cleared), and Hybrid-MTP requests (the same restore; the engine
  /// restores the joiner's boundary hidden row and publishes its endpoint before its
  /// finalisation). Pure-recurrent deployments (no page table) admit no joiners.
  bool supportsLiveSequenceAdmission() const noexcept;
  /// Admits one more sequence into an executing request with no pending work; binds only the
  /// new resident's row. The sequence joins at the end of the batch. Unless the admission sets
  /// its own lookup or commit policy it inherits the request's (the batch policies of
  /// beginRequest). Salt and adapter come with the admission's key extras.
  /// Throws for a request under kFullyCommitted: a joiner is finalised with a lookahead token;
  /// for a Hybrid-MTP joiner not under kPrefillStateOnly or whose prompt the request's replay
  /// tail covers; and (with resources.residentSlots) for a stale resident, as beginRequest.
  AdmitSequenceResult admitSequence(RequestHandle& handle,
                                    ContextCacheSequenceAdmission const& admission,
                                    DecodingKvHeadroom const& headroom);
  /// Chunked prefill of an in-flight admission (docs/lifecycle.md, "Chunked prefill"): the engine
  /// ran the joiner's prompt up to `prefilledTokens` over one or more steps (the row holds in
  /// their decode steps) and the step that ran the last chunk completed; publishes the row's full
  /// blocks so far, so a sequence admitted meanwhile reuses them. On a hybrid deployment the
  /// engine carries the row's recurrent state from chunk to chunk, and this enqueues a capture of
  /// it at `prefilledTokens` (a reuse point, committed when the row finalises, skipped while no
  /// more than one snapshot slot is left: chunkEndCaptures).
  /// A founder's prefill is chunked the same way: between preparePrefill and
  /// finalizePrefillPublication, after the step that ran its first chunk (and before
  /// enqueuePrefillCaptures), this publishes the founder's chunk; a founder whose chunks stopped
  /// short of its prompt then holds at finalizePrefillPublication and goes on as an unfinalised
  /// in-flight admission (its next chunks and finalizeSequenceAdmission as a joiner's, while
  /// sequences admitted meanwhile reuse what it published). Founders of pure-recurrent
  /// deployments (no joiners) and of requests under kFullyCommitted prefill whole; a Hybrid-MTP
  /// row keeps no chunk ends, and a length below its published endpoint throws;
  /// an EAGLE / MTP founder's draft initialisation runs after its last chunk, as a joiner's.
  /// kPoisoned on a poisoned coordinator. Throws, changing nothing, outside an executing request
  /// with no pending work or a prepared prefill, for a row that is neither an unfinalised
  /// admission nor (in the prefill) a founder of a request that takes joiners, for a founder
  /// whose prompt-end capture was enqueued, for `prefilledTokens` below the row's committed
  /// length or beyond its prompt, and with DeviceWriteTiming::kEngineStep when the row
  /// admitSequence (or preparePrefill) bound never reached the device (no flush returned
  /// since), as finalizeSequenceAdmission does.
  ContextCacheStatus completePrefillChunk(RequestHandle& handle, ExecutionRow row,
                                          int32_t prefilledTokens);
  /// Before the step that runs joiner `row`'s next chunk, positions [committed, chunkEnd): the
  /// engine's per-step hook (vLLM's allocate_slots for a scheduled chunk). With
  /// JoinerPageAllocation::kPerChunk it allocates and maps the row's pages up to chunkEnd (every
  /// lane: base and paired draft); a joiner that holds its whole prompt's pages (kWholePrompt)
  /// grows nothing. A founder's first chunk is prepared in the prefill (between preparePrefill
  /// and finalizePrefillPublication, where completePrefillChunk takes it): preparePrefill bound
  /// its whole prompt, so the call only checks. kRequestFailed when the pools cannot give them
  /// even after eviction: lastFailure names the row (kNoCapacity) and nothing changed, so the
  /// engine may preempt and prepare again, or retract the joiner; kPoisoned on a poisoned
  /// coordinator. Throws, as completePrefillChunk does, outside an executing request with no
  /// pending work (or, for a founder, its prefill), for a row that is not an unfinalised
  /// admission or a founder whose prefill may chunk, and for chunkEnd outside (committed, prompt].
  ContextCacheStatus preparePrefillChunk(RequestHandle& handle, ExecutionRow row, int32_t chunkEnd);
  /// What preparePrefillChunk(handle, row, chunkEnd) would allocate, changing nothing: its base
  /// and draft pages (0 unless the joiner was admitted with kPerChunk). Throws as it does.
  DecodeStepDemand prefillChunkDemand(RequestHandle const& handle, ExecutionRow row,
                                      int32_t chunkEnd) const;
  /// Preemption, vLLM's recompute (docs/lifecycle.md, "Preemption"): between steps, publishes
  /// execution row `row`'s committed state as a normal completion publishes it (full blocks;
  /// on checkpoint deployments a checkpoint, one synchronisation; nothing more under
  /// kPrefillStateOnly or while a speculative prompt endpoint is frozen), so that once the engine
  /// has compacted the row away, admitting its prompt and tokens again reuses it. The row keeps
  /// its pages until that compaction; it may also go on (what it published stays valid).
  /// kPoisoned when poisoned
  /// (or when the checkpoint's synchronisation failed: the request is quarantined, as at decode
  /// end). Throws, changing nothing, outside an executing request with no pending work, for a row
  /// outside the batch, and for an unfinalised joiner (it has published nothing of its own yet:
  /// compact it away, or retract it if it is the newest).
  ContextCacheStatus preemptSequence(RequestHandle& handle, ExecutionRow row);
  /// Preemption of either kind: kRecompute is preemptSequence(handle, row); kSwap publishes as
  /// it does and marks the row, so that compactBatch, once the compaction that drops the row has
  /// released its pages, moves the row's published blocks that no other lease holds to the host
  /// tier in one batch of copies and frees their GPU pages (ContextCacheManager::demoteToHostTier;
  /// metrics().swappedOutBlocks). A row the compaction keeps stays marked; a row that leaves with
  /// finish() instead is released as under kRecompute. Throws, changing nothing, for kSwap
  /// without a host tier (resources.hostTier), and as preemptSequence(handle, row) does.
  ContextCacheStatus preemptSequence(RequestHandle& handle, ExecutionRow row, PreemptionKind kind);
  /// After the joiner's prefill: exactly one accepted token (the lookahead) with committed ==
  /// prompt length; publishes the joiner's prompt blocks (hybrid: captures its prompt-end
  /// checkpoint, and one synchronisation makes it, the reuse points the engine captured into the
  /// slots of reusePointCaptures and the chunk ends terminal before they are committed;
  /// kPoisoned, the request quarantined, when it fails).
  ContextCacheStatus finalizeSequenceAdmission(RequestHandle& handle, ExecutionRow row,
                                               ContextCacheSequenceAdvance const& advance);
  /// Undoes the newest admission that never joined (lease released, row cleared) while no work is
  /// pending; true when it did. Never throws (an engine calls it while unwinding a failed join):
  /// with nothing to undo (an invalid or finished handle, pending work, the newest sequence
  /// joined or the only one) it returns false and changes nothing. It also returns false, after
  /// undoing the admission, when clearing the row failed on the device: then poisoned() is true.
  bool retractSequenceAdmission(RequestHandle& handle) noexcept;
  /// What retractSequenceAdmission would undo: true when `handle`'s request is live, no work is
  /// pending and its newest sequence is an in-flight admission that never joined, beside others.
  bool hasRetractableAdmission(RequestHandle const& handle) const noexcept;
  /// Whether row `row` of `handle`'s request has prompt tokens left to prefill before it may
  /// sample: an unfinalised in-flight admission, or a founder whose prefill chunks stopped short
  /// of its prompt (completePrefillChunk in the prefill). Throws for a row outside the batch.
  bool awaitsPrefill(RequestHandle const& handle, ExecutionRow row) const;
  /// Why the request of `handle` failed: kPoisoned (row -1) while the coordinator is poisoned;
  /// else the row whose page growth failed a decode step (kTableFull: it would pass the table
  /// width; kNoCapacity: no page even after eviction); kNone when nothing failed or the handle
  /// is not live.
  RowFailure lastFailure(RequestHandle const& handle) const noexcept;
  /// Who holds resident row `row` in this coordinator: kFree (no request: the runtime may release
  /// and reuse it), kActive (a live request), kQuarantined (a request quarantined by a failed
  /// synchronisation: the row and its pages may still be read by device work; free after
  /// shutdown() drains the quarantine). Out-of-range slots are kFree.
  ResidentRowState residentRowState(CacheSlot slot) const noexcept;

  // Observers.
  bool poisoned() const noexcept;
  int32_t activeRequestCount() const noexcept;
  int32_t quarantinedRequestCount() const noexcept;
  int32_t batchSize(RequestHandle const& handle) const;
  /// Reuse length of execution row `row`.
  int32_t reuseTokenLength(RequestHandle const& handle, ExecutionRow row) const;
  /// Tokens with materialised KV of execution row `row`.
  int32_t committedLength(RequestHandle const& handle, ExecutionRow row) const;
  /// The commit policy execution row `row` publishes under: its admission's, else the batch's.
  ContextCacheCommitPolicy commitPolicy(RequestHandle const& handle, ExecutionRow row) const;
  /// Base pages held by execution row `row`, in logical order.
  std::span<PageId const> basePages(RequestHandle const& handle, ExecutionRow row) const;
  /// Draft pages held by execution row `row` (empty unless the request pairs a paged draft).
  std::span<PageId const> draftPages(RequestHandle const& handle, ExecutionRow row) const;
  /// Common (base and draft) materialised length of row `row`; speculative requests.
  int32_t commonLength(RequestHandle const& handle, ExecutionRow row) const;
  /// The manager (an internal class: src/context_cache/context_cache_manager.h, which tests and
  /// tools inside the tree include to inspect it).
  ContextCacheManager const& manager() const noexcept { return *mManager; }
  ContextCacheMetrics metrics() const;
  ContextCacheCoordinatorCounters const& counters() const noexcept { return mCounters; }
  /// What admitting `sequence` (its tokens, key extras, media and lookup policy; the resident
  /// and retention are not read) with `headroom` would take now, as a vanilla request or, with
  /// `speculativeRequest`, a speculative one. Changes nothing: no lease, no pin, no recency, no
  /// metric. Throws mkv::Error naming this call for what admission would refuse: an empty prompt
  /// or one whose pages with headroom pass the row width, media of another length, a headroom
  /// beginRequest refuses, a speculative estimate on a deployment without speculative decoding.
  AdmissionEstimate estimateAdmission(ContextCacheSequenceAdmission const& sequence,
                                      DecodingKvHeadroom const& headroom,
                                      bool speculativeRequest = false) const;

  // --- Remote tier (config.remoteTier; docs/context_cache.md, "Remote tier") -----------------

  /// How many more tokens of `sequence`'s prompt the store holds, in full blocks right after
  /// those the GPU and the host tier hold (what vLLM's KV connector answers in
  /// get_num_new_matched_tokens). Nothing in the cache changes; one round trip to the store on
  /// the engine thread, bounded by the store's timeout (a store that does not answer reports
  /// storeAvailable false). Throws mkv::Error naming this call without a remote tier, and for a
  /// sequence estimateAdmission refuses.
  RemoteTierLookup lookupRemoteTier(ContextCacheSequenceAdmission const& sequence);
  /// Starts loading, off the engine thread, the blocks of `sequence`'s prompt after those the GPU
  /// and the host tier hold (the sequence is copied); pollRemoteTier reports the load when its
  /// verified blocks are in the host tier, and an admission then reuses them as host-tier hits.
  /// Ticket 0: nothing to load, or maxLoadsInFlight loads not yet reported. Throws as
  /// lookupRemoteTier.
  RemoteLoadStart loadFromRemoteTier(ContextCacheSequenceAdmission const& sequence);
  /// The engine's poll, once per step (never waits): the loads finished since the last poll,
  /// their blocks now in the host tier. A fetched load takes two polls: the first reserves its
  /// host pages and the worker copies the bytes there, the next indexes them (the first waits
  /// while host-tier copies are in flight). Saves whose host copies completed are handed to the
  /// worker and the host pages of finished saves released. Empty without a remote tier. Throws
  /// mkv::Error naming this call on a CUDA failure of the host tier.
  std::vector<RemoteLoadResult> pollRemoteTier();
  /// Waits for every load and save in flight, then polls (shutdown, a handoff, tests).
  std::vector<RemoteLoadResult> drainRemoteTier();
  /// The remote tier's counters (zeros without one).
  RemoteTierCounters remoteTierCounters() const noexcept;
  bool hasRemoteTier() const noexcept { return mRemoteTier != nullptr; }
  /// Host pages held by saves not finished (the remote tier's part of the host tier's pins).
  int32_t pendingRemoteSaves() const noexcept;

  /// The queued KV events, oldest first (config.eventQueueCapacity > 0). On the composed
  /// backend they hold both pools in one order: the full layers' blocks as group 0
  /// (full attention), the sliding pool's window blocks as group 1 (sliding window W).
  std::vector<KvEvent> drainEvents();
  /// Manager metrics and coordinator counters in the Prometheus text format.
  std::string toPrometheus(std::string_view prefix = "managedkv_") const;
  ContextCacheConfig const& config() const noexcept { return mConfig; }
  ContextCacheDeploymentProfile const& profile() const noexcept { return mProfile; }
  /// Checkpoint slabs (hybrid and pure-recurrent deployments), else null. The engine writes the
  /// reuse points of reusePointCaptures into them.
  SnapshotStorage const* snapshots() const noexcept { return mSnapshots.get(); }
  SnapshotStorage* snapshots() noexcept { return mSnapshots.get(); }

 private:
  // The request core (context_cache_coordinator.cpp: registry, prefill, decode, compaction,
  // finish; coordinator_admission.cpp; coordinator_inflight_admission.cpp) is the same for every
  // deployment. What differs between kinds of request is in one unit per mode (request_mode.h:
  // block reuse, paired draft, checkpoints, Hybrid-MTP), chosen once per request at admission;
  // beside them the request state (coordinator_request.h), the paged rows
  // (coordinator_paged_rows.h), the host tier's moves (coordinator_host_tier.h), the pure
  // contract checks (coordinator_validation.h), the deployment validation
  // (coordinator_deployment.h) and the composed backend's sliding pages (coordinator_window.cpp).
  // docs/architecture.md, "The request core".

  // Request registry (src/resources/request_registry.h, shared with the bounded-SWA backend).
  using Requests = std::span<std::unique_ptr<Request> const>;
  Request& request(RequestHandle const& handle, char const* call) const;
  /// After a failed synchronisation: invalidates `handle` and quarantines its request.
  ContextCacheStatus quarantineHandle(RequestHandle& handle, uint64_t id) noexcept;
  /// Copies the registry's quarantine count into the counters (after a call that may quarantine).
  void countQuarantines() noexcept;
  /// Refuses admissions until shutdown() (a failed launch, copy or row update).
  void poison() noexcept;
  bool synchronize() noexcept;
  /// A live handle destroyed or replaced (RequestHandle calls it): the registry's abandon.
  void abandon(uint64_t id) noexcept;
  friend RequestHandle;
  /// Clears the rows of `requests` (and uploads once); throws what the page tables throw.
  void clearRows(Requests requests);
  /// Marks the request's resident rows free.
  void releaseResidents(Request const& request) noexcept;
  void countPlanning(std::chrono::steady_clock::time_point start) noexcept;
  /// Host tier: enqueues the page moves of the manager's last call (coordinator_host_tier.h).
  bool moveHostTierPages(char const* call) noexcept;

  // Batch admission.
  /// The mode of a plain or a speculative request (throws naming `call` when the deployment has
  /// none for it).
  detail::RequestMode const& modeFor(bool speculativeRequest, char const* call) const;
  /// The manager's lookup of one sequence under `policy` (kBypass when reuse is disabled).
  /// The remote tier, or mkv::Error naming `call` without one.
  detail::RemoteTierLink& remoteTier(char const* call) const;
  /// estimateAdmission's checks and lookup of `sequence` (vanilla, kUseCache, default headroom).
  mkv::LookupResult lookupForRemoteTier(char const* call,
                                        ContextCacheSequenceAdmission const& sequence) const;
  LookupRequest lookupOf(ContextCacheSequenceAdmission const& sequence,
                         ContextCacheLookupPolicy policy, DecodingKvHeadroom const& headroom,
                         detail::RequestMode const& mode) const;
  /// One lease per lookup, all or nothing (empty: refused for capacity, nothing changed).
  std::vector<mkv::AdmissionResult> acquireAll(std::span<LookupRequest const> lookups);
  /// An empty request of the admission (made before anything is acquired).
  std::unique_ptr<Request> newRequest(ContextCacheBatchAdmission const& admission,
                                      detail::RequestMode const& mode) const;
  /// Moves the acquired leases into the request's sequences.
  void addSequences(Request& created, ContextCacheBatchAdmission const& admission,
                    std::span<LookupRequest const> lookups,
                    std::vector<mkv::AdmissionResult>& acquired) const;

  // Decode and compaction.
  /// completeDecodeStep's publication of the completed rows (the mode's; a capture's
  /// synchronisation: kPoisoned, handle invalidated, when it fails).
  ContextCacheStatus publishCompleted(RequestHandle& handle, Request& request,
                                      std::span<uint8_t const> completed);
  /// Grows each sequence's pages to cover committed + headroom and maps them (prepareDecodeStep).
  ContextCacheStatus growPages(Request& request, DecodingKvHeadroom const& headroom);
  /// What growRow did to one row.
  enum class RowGrowth : uint8_t { kUnchanged, kGrown, kTableFull, kNoCapacity, kPoisoned };
  /// Grows `sequence`'s lease to `needed` pages per lane of `request`'s rows and maps the new
  /// ones (no upload). kTableFull and kNoCapacity change nothing (a throw neither); kPoisoned:
  /// grown and mapped, but moving evicted blocks to the host tier failed.
  RowGrowth growRow(Request& request, Sequence& sequence, std::array<int32_t, 2> const& needed,
                    char const* call);
  /// A founder's chunk in the prefill: the request takes joiners (the founder goes on as one)
  /// under kCommittedPlusLookahead, and the row's prompt-end capture is not enqueued yet.
  void requireChunkableFounder(char const* call, Request const& request, Sequence const& sequence,
                               ExecutionRow row) const;
  /// The checks of preparePrefillChunk and prefillChunkDemand; the joiner's (or founder's)
  /// sequence.
  Sequence const& prefillChunkRow(char const* call, Request const& request, ExecutionRow row,
                                  int32_t chunkEnd) const;
  /// compactBatch's device work: clears dropped rows, compacts lengths, zeroes recurrent rows.
  void enqueueCompaction(Request& request, std::span<CacheSlot const> dropped);
  /// compactBatch after its synchronisation: releases the dropped rows, keeps the survivors.
  void settleCompaction(Request& request, std::vector<Sequence>& survivors) noexcept;
  ContextCacheConfig mConfig;
  ContextCacheDeploymentProfile mProfile;
  ContextCachePhysicalResources mResources;
  cudaStream_t mStream;
  StreamSynchronizer mSynchronizer;  ///< with mFaults at kStreamSynchronize
  FaultInjector mFaults;
  std::unique_ptr<ContextCacheManager> mManager;
  std::unique_ptr<SnapshotStorage> mSnapshots;
  int32_t mMaxBatch = 0;
  DeviceType mDevice = DeviceType::kCPU;
  /// Live and quarantined requests, ids, poison (held by pointer: an internal header's type).
  std::unique_ptr<detail::RequestRegistry<Request>> mRequests;
  std::vector<uint8_t> mResidentBusy;
  /// Compaction-mapping staging, one region per resident slot (created once, see device.h).
  std::unique_ptr<detail::Int32UploadRegions> mMappingUploads;
  /// resources.deviceWrites, or mOwnedWrites (kEachCall) when that was null.
  std::unique_ptr<detail::DeviceWriteQueue> mOwnedWrites;
  detail::DeviceWriteQueue* mWrites = nullptr;
  ContextCacheCoordinatorCounters mCounters;
  /// What admission checks a batch against (the deployment's shape, computed once).
  std::unique_ptr<detail::AdmissionLimits> mLimits;
  std::unique_ptr<detail::HostTierMover> mHostTier;
  std::unique_ptr<detail::RemoteTierLink> mRemoteTier;  ///< null without config.remoteTier
  /// What the modes work on, and the modes (made last: they borrow the members above).
  std::unique_ptr<detail::CoordinatorParts> mParts;
  std::unique_ptr<detail::RequestModes> mModes;
};

}  // namespace mkv
