#pragma once
/// \file bounded_swa_kv_page_manager.h
/// Sliding-window layers keep only their last W tokens, in a bounded set of rotating pages per
/// sequence. Window arithmetic, page budget, state machine and a worked example:
/// docs/architecture.md, "Bounded SWA"; the cached mode (pages from a SwaPageSource, prefill
/// from a reused prefix): "Sliding windows with context reuse".

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/fault_site.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/request_handle.h"
#include "mkv/resident_slot_pool.h"
#include "mkv/stream.h"
#include "mkv/swa_page_source.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {
namespace detail {
class DeviceWriteQueue;
class Int32UploadRegions;
class SharedSynchronizer;
template <class Request>
class RequestRegistry;
}  // namespace detail

/// One mapped page of a sliding window: absolute logical page -> physical page of the SWA pool.
struct SwaPageBinding {
  int32_t logicalPage = 0;
  PageId page = kNoPage;
  friend bool operator==(SwaPageBinding const&, SwaPageBinding const&) = default;
};

/// Observable state of one sequence (execution row) of a request.
struct SwaSequenceState {
  ResidentRef resident;
  /// Tokens whose KV exists (committed endpoint e; in cached mode the reused start from
  /// admission to completePrefill). A staged transition is `pendingEndpoint`.
  int32_t endpoint = 0;
  std::optional<int32_t> pendingEndpoint;
  /// Retained logical pages [retainedBegin, retainedEnd) for the endpoint (pending one when a
  /// transition is staged): [floor(max(0, e - W) / P), ceil(e / P)).
  int32_t retainedBegin = 0;
  int32_t retainedEnd = 0;
  /// Mapped pages, ascending logical page. In cached mode they hold, from admission, the reused
  /// window pages (mapped by preparePrefill) and, from preparePrefill to completePrefill, every
  /// page the prefill writes as well: [floor(max(0, start - W) / P), ceil(L / P)), including
  /// the pages below retainedBegin that completePrefill retires (the complete prompt blocks a
  /// cache publishes before completePrefill).
  std::deque<SwaPageBinding> bindings;
  /// Pages held by the sequence but unmapped (its private reserve).
  std::vector<PageId> reservedPages;
  /// Bindings created by the staged transition (already in `bindings`).
  std::vector<SwaPageBinding> newBindings;
  /// Pages that left the window; still mapped and held until the completion call.
  std::vector<SwaPageBinding> pendingRetire;
  /// Admitted in flight (admitSequence), or a founder whose first chunk completed short of its
  /// prompt in the prefill (completeSequenceChunk), and not finalised yet; decode steps skip the
  /// sequence until finalizeSequenceAdmission commits its prefill.
  bool joining = false;
  /// An unfinalised joiner's prompt length L, and a founder's in the prefill once its first chunk
  /// was prepared (0 otherwise). Without a page source its prefill may run in chunks: `endpoint`
  /// is what the completed chunks wrote, `pendingEndpoint` the end of the chunk staged for the
  /// next step (the rest of the prompt unless prepareSequenceChunk staged a shorter one).
  int32_t joinerPromptTokens = 0;
  /// bindings + reserved + pendingRetire (pendingRetire pages are not in bindings).
  int32_t heldPages() const noexcept {
    return static_cast<int32_t>(bindings.size() + reservedPages.size() + pendingRetire.size());
  }
};

/// Construction parameters.
struct BoundedSwaConfig {
  int32_t windowTokens = 0;  ///< W: attention window of the sliding layers, in tokens
};

/// Where a sequence of a cached-mode manager starts (BoundedSwaKVPageManager::beginRequest with
/// starts): one per resident.
struct SwaReuseStart {
  /// L: the prompt length the prefill executes through (preparePrefill's length, exactly).
  int32_t promptTokens = 0;
  /// s: tokens reused from the cache, a multiple of P in [0, promptTokens).
  int32_t startTokens = 0;
  /// The page source's pages of logical pages [floor(max(0, s - W) / P), s / P), ascending
  /// (exactly that many, each cached or held in the source): the reused window before s.
  std::vector<PageId> windowPages;
};

/// Borrowed physical resources the manager drives. All must outlive the manager.
struct BoundedSwaResources {
  /// Reduced pool of the sliding-window layers. Without a page source its page ids are this
  /// manager's to hand out.
  KVCachePool* swaPool = nullptr;
  /// Cached mode: the owner of swaPool's pages (free pages and cached window blocks; not owned,
  /// totalPages() == swaPool's pages). The manager then keeps no free list: it takes every page
  /// there (allocate, hold) and gives every one back there (release).
  SwaPageSource* pageSource = nullptr;
  /// Sparse-window page table over swaPool's ids, one row per resident slot.
  KVPageTable* swaPageTable = nullptr;
  /// Pools whose KV-length tensors follow the request: reset to 0 at preparePrefill and
  /// compacted at batch compaction (swaPool and, in mixed models, the full pool). A length
  /// tensor holds one batch, so it follows one request at a time: the last one to prefill,
  /// until it finishes. Leave empty when several requests execute concurrently.
  std::vector<KVCachePool*> lengthPools;
  /// Recurrent rows of hybrid models; rows of dropped residents are zeroed at compaction.
  RecurrentStatePool* recurrent = nullptr;
  /// Sliding-window reuse: the synchronisation this manager shares with the coordinator (not
  /// owned; KVCacheRuntime sets it and builds both backends with its view()). The composed
  /// request opens a scope on it around each completion point, so both halves wait once.
  detail::SharedSynchronizer* sharedSynchronizer = nullptr;
  /// Where the table rows and KV lengths this manager writes wait for the device (not owned;
  /// KVCacheRuntime sets it, one for every backend of the runtime; the manager adds swaPageTable
  /// to its tables). Null: the manager owns one that applies them at the end of each call.
  detail::DeviceWriteQueue* deviceWrites = nullptr;
  /// The runtime's resident rows (KVCacheRuntime sets it). When set, beginRequest refuses a
  /// ResidentRef that is not held with its current epoch (ResidentSlotPool::requireHeld).
  ResidentSlotPool const* residentSlots = nullptr;
};

/// Bounded rotating pages for sliding-window attention layers.
///
/// Budget: M = ceil(W / P) + 1 pages hold one window. Admission reserves 2M + 1 private pages
/// per sequence, atomically for the whole batch and independent of prompt length (two window
/// images let a multi-page transition build the new image while the old one stays live, plus
/// one page that keeps decode writable right after admission). After completePrefill a
/// sequence keeps at most M + 1 pages (enough for single-token decode with deferred
/// retirement) and returns the surplus to the free list. Several requests may be active at
/// once while the pool has pages; each holds its own residents' pages, so an active request
/// is never starved by another.
///
/// Deferred retirement: pages that leave the window stay held and mapped until
/// completePrefill / completeDecodeStep (called after the runtime's own completion point);
/// only then are their entries cleared and the pages returned to the sequence's own reserve.
///
/// Faults: a failed stream synchronisation (finish, compaction, abandonment) poisons the
/// manager and quarantines the request's pages (never reused while a kernel might touch
/// them); beginRequest then returns kPoisoned until shutdown() drains the quarantine.
///
/// Cached mode (resources.pageSource set; docs/architecture.md, "Sliding windows with context
/// reuse"): a sequence starts at a reused page-aligned prefix s with the held window pages
/// before it, and reserves ceil(L / P) - s / P + 1 private pages (its prompt's executed pages
/// plus one spare), so that its prefill writes the sliding KV of every executed prompt
/// position. completePrefill retires every page outside the window of L to the source
/// (pageSource->release: a published or shared page stays cached there) and keeps one spare:
/// a decoding sequence still holds at most M + 1 pages. Decode retires to the source and takes
/// its next spare there; finish, compaction, abandonment and shutdown's drain release every
/// held page to the source.
///
/// In-flight admission: a sequence joins an executing request at the end of its batch
/// (admitSequence maps its prefill at once; in cached mode from its own reuse start), is
/// finalised after the engine ran that prefill (finalizeSequenceAdmission: the same retirement
/// as completePrefill) or retracted before (retractSequenceAdmission). Decode steps skip it until
/// it is finalised. The manager never touches the length pools for a joiner: the engine seats
/// it (active batch, its length row), as with the context-reuse coordinator. Without a page
/// source a joiner starts at 0 with the 2M + 1 pages of any sequence and may prefill in chunks:
/// before the step that runs a chunk [e, c), prepareSequenceChunk maps what that chunk reads and
/// keeps (the window before e, the pages of [max(e, c - W), c)); completeSequenceChunk retires
/// what left the window of c, so the window rotates across chunks within the same 2M + 1 pages.
/// A founder's prefill chunks the same way: in the prefill (after preparePrefill), before the
/// step, prepareSequenceChunk stages its first chunk instead of the whole prompt, and after it
/// completeSequenceChunk commits that chunk; completePrefill then holds the founder as such a
/// joiner (decode steps skip it; its next chunks and finalizeSequenceAdmission are a joiner's).
/// A cached-mode joiner maps its whole prompt at admission and needs neither call.
///
/// Limits: vanilla one-token decode only (headroom {1,0}, kCommittedPlusLookahead, not
/// speculative). All calls use the construction stream.
/// Thread-safety: single writer (the engine thread); no call may run concurrently with another.
class BoundedSwaKVPageManager {
  struct Request;

 public:
  /// Move-only handle of one admitted request (mkv/request_handle.h). Destroying a live handle
  /// abandons the request: synchronises when device work is pending, then releases its pages (a
  /// failed synchronisation poisons the manager and quarantines the pages instead).
  using RequestHandle = mkv::RequestHandle<BoundedSwaKVPageManager>;

  struct BeginRequestResult {
    SwaKVCacheStatus status = SwaKVCacheStatus::kRequestFailed;
    std::optional<RequestHandle> request;
  };

  /// Throws mkv::Error unless W > 0, the pool and table are consistent (table ids == pool
  /// pages, same device, sparse-window mode, pool >= one sequence's admission budget), every
  /// length pool's batch capacity covers the table's rows, and the recurrent pool (when given)
  /// has a row per table row. The table width (maxPagesPerSeq * P tokens, absolute positions)
  /// bounds how long a sequence may grow: prefill rejects longer prompts and a decode step past
  /// it returns kRequestFailed. `synchronizer`: empty = defaultStreamSynchronizer. `faults` is
  /// consulted at FaultSite::kStreamSynchronize (after each synchronisation) and, for the write
  /// queue the manager owns when resources.deviceWrites is null, kDeviceWriteLaunch. Empty = no
  /// faults.
  BoundedSwaKVPageManager(BoundedSwaConfig const& config, BoundedSwaResources resources,
                          cudaStream_t stream, StreamSynchronizer synchronizer = {},
                          FaultInjector faults = {});
  /// Terminates the process if a request is still active or quarantined (a lifetime bug that
  /// would otherwise free memory kernels may still touch).
  ~BoundedSwaKVPageManager();
  BoundedSwaKVPageManager(BoundedSwaKVPageManager const&) = delete;
  BoundedSwaKVPageManager& operator=(BoundedSwaKVPageManager const&) = delete;

  /// M = ceil(W / P) + 1.
  static int32_t windowPages(int32_t windowTokens, int32_t tokensPerPage);
  /// Pages reserved per sequence from admission to completePrefill: 2M + 1.
  static int32_t admissionPagesPerSequence(int32_t windowTokens, int32_t tokensPerPage);
  /// Pages a sequence keeps during single-token decode: M + 1.
  static int32_t decodePagesPerSequence(int32_t windowTokens, int32_t tokensPerPage);

  /// Admits a batch: reserves 2M + 1 pages per resident, all or nothing.
  /// kPoisoned when poisoned; kRequestFailed (nothing changed) when the free pages do not cover
  /// the batch. Throws for a foreign stream, an empty or oversized batch, residents out of
  /// range, with epoch 0, repeated, stale (resources.residentSlots does not hold them with that
  /// epoch), or already held by another active request, and in cached mode.
  BeginRequestResult beginRequest(std::span<ResidentRef const> residents, cudaStream_t stream);
  /// Cached mode: admits a batch whose sequence i starts at starts[i] (see SwaReuseStart). Each
  /// sequence holds its window pages (pageSource->hold) and reserves ceil(L / P) - s / P + 1
  /// private pages (pageSource->allocate), all or nothing for the batch: every window page is
  /// held first, then the private pages are allocated in one call; when that fails the holds are
  /// released and the result is kRequestFailed with nothing changed. kPoisoned as above. Throws
  /// (nothing changed) for what the other overload throws for, without a page source, for a
  /// start count other than the batch, L outside (0, maxPagesPerSeq * P], s not a multiple of P
  /// in [0, L), a window page count other than s / P - floor(max(0, s - W) / P), a window page
  /// outside the pool or repeated in one sequence, and for what pageSource->hold throws for.
  BeginRequestResult beginRequest(std::span<ResidentRef const> residents, cudaStream_t stream,
                                  std::span<SwaReuseStart const> starts);
  /// Every check of the cached-mode beginRequest, without its effects: throws (naming `call`)
  /// where it throws, the busy check included unless poisoned (as there). Returns the private
  /// pages the batch would allocate: beginRequest refuses for capacity exactly when they
  /// exceed freePageCount() less the window pages nobody holds yet (holding takes them out of
  /// what the source can allocate). For a composed request, whose other half must not admit
  /// what this half would refuse.
  int64_t checkBeginRequest(std::span<ResidentRef const> residents, cudaStream_t stream,
                            std::span<SwaReuseStart const> starts, char const* call) const;

  /// Maps each sequence's retained window for its executed prefill length and uploads the
  /// table patch; resets the length pools to 0 for the batch. Call after embeddings and token
  /// pruning fixed the lengths. Throws for a prefill prepared already, a length count that differs
  /// from the batch, a length outside (0, maxPagesPerSeq * P], or length pools that still follow
  /// another active request.
  /// Cached mode: each length must be the sequence's promptTokens (throws otherwise); maps
  /// logical pages [floor(max(0, s - W) / P), ceil(L / P)) (the held window pages, then private
  /// pages from the reserve) in one table upload and sets the length pools' rows to s.
  void preparePrefill(RequestHandle& handle, std::span<int32_t const> inputLengths);
  /// Commits the prefill transition, retires pages that left the window, and trims each
  /// sequence to M + 1 held pages. No synchronisation: call after the runtime's completion point.
  /// Cached mode: every mapped page outside [floor(max(0, L - W) / P), ceil(L / P)) goes to
  /// pageSource->release; the sequence keeps one spare and releases the rest of its reserve.
  /// `held` (cached mode; empty, or one flag per sequence): a sequence flagged goes on prefilling
  /// in chunks (a founder whose prefill is chunked): it keeps its staged prompt, as an in-flight
  /// admission does from admitSequence, and finalizeSequenceAdmission completes it. Without a
  /// page source a founder whose first chunk completed short of its prompt (completeSequenceChunk
  /// in the prefill) is held so, its chunk committed and the rest of its prompt staged.
  /// Throws, changing nothing, without a prepared prefill, for `held` flags outside cached mode or
  /// of another count, for a founder whose first chunk was prepared but not completed, or as
  /// checkPreparedWritesOnDevice.
  void completePrefill(RequestHandle& handle, std::span<uint8_t const> held = {});
  /// One sequence joins the executing request `handle` (no pending work) as its last row,
  /// starting at `start` (see SwaReuseStart). Cached mode: it holds the window pages, reserves
  /// ceil(L / P) - s / P + 1 private pages from the source, and its row maps logical pages
  /// [floor(max(0, s - W) / P), ceil(L / P)) in one table upload, ready for the engine's
  /// prefill of the row. Without a page source: s must be 0 (nothing is cached); it reserves
  /// 2M + 1 pages from the free list and its row maps the window of L (the whole prompt's
  /// prefill, as preparePrefill maps it; prepareSequenceChunk stages a chunk instead).
  /// kPoisoned when poisoned; kRequestFailed (nothing changed) when too few pages are free.
  /// Throws (nothing changed) for a request that is not executing or has pending work, a full
  /// batch, a resident that is invalid, stale or already held, and a start beginRequest would
  /// refuse (without a page source: a start other than 0).
  SwaKVCacheStatus admitSequence(RequestHandle& handle, ResidentRef resident,
                                 SwaReuseStart const& start);
  /// Every check of admitSequence, without its effects (throws naming `call` where it throws,
  /// the busy check included unless poisoned); returns the joiner's private pages, refused for
  /// capacity as checkBeginRequest's (without a page source: 2M + 1 against freePageCount()).
  int32_t checkAdmitSequence(RequestHandle const& handle, ResidentRef resident,
                             SwaReuseStart const& start, char const* call) const;
  /// Without a page source, before the step that runs the next chunk of joiner `row`'s prefill,
  /// positions [endpoint, chunkEnd): replaces the staged chunk (the rest of the prompt after
  /// admission or a completed chunk) with this one, mapping the pages of [max(endpoint,
  /// chunkEnd - W), chunkEnd) beside the window before `endpoint` (one table upload); the
  /// chunk's positions before chunkEnd - W are read from the engine's activations, not kept.
  /// In the prefill (after preparePrefill, before the step) it stages founder `row`'s first chunk
  /// [0, chunkEnd) the same way, in place of its whole prompt.
  /// kOk; kPoisoned (nothing changed) when poisoned, after the checks. Throws, changing nothing,
  /// with a page source (a cached-mode joiner's whole prompt is mapped from admission), with work
  /// pending (but the prefill), for a row that is not an unfinalised joiner (or, in the prefill,
  /// a founder that has not completed a chunk) and for chunkEnd outside (endpoint, L].
  SwaKVCacheStatus prepareSequenceChunk(RequestHandle& handle, int32_t row, int32_t chunkEnd);
  /// What prepareSequenceChunk(handle, row, chunkEnd) would allocate: nothing (the window rotates
  /// within the 2M + 1 pages the joiner's admission took). Throws as it does.
  DecodeStepDemand sequenceChunkDemand(RequestHandle const& handle, int32_t row,
                                       int32_t chunkEnd) const;
  /// Without a page source, after the step that ran joiner `row`'s chunk to `chunkEnd`: commits
  /// the chunk (endpoint = chunkEnd), unmaps the pages that left its window (back to the row's
  /// reserve) and stages the rest of the prompt. chunkEnd == endpoint is a no-op. kOk; kPoisoned
  /// (nothing changed) when poisoned, after the checks. Throws, changing nothing, with a page
  /// source, with work pending, for a row that is not an unfinalised joiner, and for a chunkEnd
  /// other than the staged chunk's end (prepare each chunk shorter than the rest of the prompt).
  /// In the prefill, after the step that ran founder `row`'s first chunk (possibly empty: chunkEnd
  /// 0): the same commit, and completePrefill will hold the founder (a chunk to its whole prompt
  /// changes nothing: completePrefill commits it); a founder completes one chunk in the prefill.
  SwaKVCacheStatus completeSequenceChunk(RequestHandle& handle, int32_t row, int32_t chunkEnd);
  /// After the engine's completion point for the joiner's prefill: commits row `row` at its
  /// prompt length as completePrefill does (pages outside the window go to the source, or the
  /// free list, one spare kept); decode steps include it from now on. Throws unless `row` is an
  /// unfinalised joiner, no work is pending and (without a page source) its prefill reached L:
  /// every chunk completed, or the staged one ends at L.
  void finalizeSequenceAdmission(RequestHandle& handle, int32_t row);
  /// Every check of finalizeSequenceAdmission, without its effects (throws naming `call`).
  void checkFinalizeSequenceAdmission(RequestHandle const& handle, int32_t row,
                                      char const* call) const;
  /// Every check of a preemption of row `row` (nothing is cached, so nothing to publish): an
  /// executing request with no pending work, a row inside the batch that is not an unfinalised
  /// joiner. Throws naming `call`.
  void checkPreemptSequence(RequestHandle const& handle, int32_t row, char const* call) const;
  /// What retractSequenceAdmission would undo: true when `handle`'s request is live, no work is
  /// pending and its newest row is an unfinalised joiner that is not its only row.
  bool hasRetractableAdmission(RequestHandle const& handle) const noexcept;
  /// Undoes the newest admission that was not finalised: clears its row (one table upload) and
  /// gives its pages back to the source; true when it did. Never throws: false, changing nothing,
  /// when hasRetractableAdmission is false; false and poisoned when the row clear failed on the
  /// device (the joiner is undone all the same, as the coordinator's retraction does).
  bool retractSequenceAdmission(RequestHandle& handle) noexcept;

  /// Stages endpoint + 1 for every sequence (at most one new page mapped and one page staged
  /// for retirement each; an unfinalised joiner holds) and uploads the patch. kRequestFailed (the
  /// request is finishing) when a sequence would pass the table width, or (cached mode) needs a
  /// page, has no spare and the page source has no page for it.
  SwaKVCacheStatus prepareDecodeStep(RequestHandle& handle);
  /// What prepareDecodeStep would do now, without its effects: throws (naming `call`) where it
  /// throws; else the row failure it would end the request with (kTableFull, kNoCapacity: the
  /// rows that need a page and have no spare take them from the page source in row order), or
  /// kNone when it would stage the step. For a composed request, whose other half must not
  /// prepare a step this half refuses.
  RowFailure checkPrepareDecodeStep(RequestHandle const& handle, char const* call) const;
  /// What prepareDecodeStep would take now, changing nothing: `slidingPages`, the pages rows
  /// without a spare would take from the page source (cached mode; 0 otherwise), and the first
  /// row past its table width. Throws where prepareDecodeStep throws.
  DecodeStepDemand decodeStepDemand(RequestHandle const& handle) const;
  /// Why the request of `handle` failed: kPoisoned (row -1) while the manager is poisoned; else
  /// the row a decode step could not grow (kTableFull, kNoCapacity); kNone when nothing failed
  /// or the handle is not live.
  RowFailure lastFailure(RequestHandle const& handle) const noexcept;
  /// True when `handle`'s request is live and finishing: a decode step it could not take (or a
  /// compaction that dropped every row) ended it, and only finish or abandonment remain.
  bool finishing(RequestHandle const& handle) const noexcept;
  /// True when row `row` has more of its prompt to prefill before it may sample: an unfinalised
  /// in-flight admission, or, in the prefill, a founder whose first chunk completed short of its
  /// prompt (completeSequenceChunk; completePrefill then holds it as such an admission). Throws
  /// for an invalid handle or row.
  bool awaitsPrefill(RequestHandle const& handle, int32_t row) const;
  /// Commits the step and retires pages that left the window.
  /// Cached mode: a retired page goes to pageSource->release and the sequence takes its next
  /// spare with pageSource->allocate(1). That cannot fail when the release made the page
  /// available; it can when another window still holds the page (a shared reused block) and
  /// the source has nothing else: the sequence then has no spare, and the next
  /// prepareDecodeStep that needs a page for it tries again and returns kRequestFailed when
  /// the source still has none. Throws, changing nothing, without a prepared step or as
  /// checkPreparedWritesOnDevice.
  void completeDecodeStep(RequestHandle& handle);

  /// Validates an order-preserving oldToNew mapping (size == batch; entries -1 or in
  /// [0, newBatchSize); the k-th survivor goes to k; every destination covered), stores it and
  /// copies it into `deviceMapping` (reshaped to [oldBatch], on the pool's device). Throws,
  /// changing nothing, as well when a length pool's active batch is not the batch: everything
  /// compactBatch needs is checked here.
  void beginBatchCompaction(RequestHandle& handle, std::span<int32_t const> oldToNew,
                            int32_t newBatchSize, Tensor& deviceMapping);
  /// Clears dropped residents' rows, zeroes their recurrent rows, compacts the KV lengths with
  /// one kernel, synchronises, then returns the dropped pages to the free list (cached mode:
  /// releases them to the page source). A failed
  /// synchronisation: kPoisoned, the request is quarantined and the handle becomes invalid.
  SwaKVCacheStatus compactBatch(RequestHandle& handle);
  /// Every check of beginBatchCompaction / compactBatch, without their effects (throws naming
  /// `call`): for a composed request, whose two halves must both accept before either changes.
  void checkBeginBatchCompaction(RequestHandle const& handle, std::span<int32_t const> oldToNew,
                                 int32_t newBatchSize, Tensor const& deviceMapping,
                                 char const* call) const;
  void checkCompactBatch(RequestHandle const& handle, char const* call) const;
  /// With DeviceWriteTiming::kEngineStep: throws mkv::Error naming `call` when the rows and
  /// lengths of the prepared prefill or decode step never reached the device (no flush returned
  /// since its prepare call); nothing without such work. completePrefill / completeDecodeStep
  /// check it; a composed request checks it before its other half changes anything.
  void checkPreparedWritesOnDevice(RequestHandle const& handle, char const* call) const;
  /// Throws mkv::Error naming `call` when another active request owns the KV-length pools (its
  /// preparePrefill reset them and it is not finished): this request's preparePrefill would
  /// throw. A composed request checks it before its other half prepares anything.
  void checkLengthPoolsFree(RequestHandle const& handle, char const* call) const;
  /// Synchronises pending work, clears every row and releases all pages (cached mode: to the
  /// page source; quarantined requests keep theirs until shutdown). An invalid handle
  /// (already finished, or quarantined by a failed compaction) is a no-op. kPoisoned when the
  /// synchronisation fails (request quarantined) or the manager is poisoned, else kOk.
  SwaKVCacheStatus finish(RequestHandle& handle);
  /// Drains the quarantine: synchronises, releases every quarantined page and clears the poison
  /// when that succeeds. kRequestFailed when requests are still active; kPoisoned when the
  /// drain's synchronisation failed (the quarantine is kept).
  SwaKVCacheStatus shutdown() noexcept;

  bool poisoned() const noexcept;
  /// resources.sharedSynchronizer (null but on the sliding-window reuse backend).
  detail::SharedSynchronizer* sharedSynchronizer() const noexcept {
    return mResources.sharedSynchronizer;
  }
  /// Pages an admission can take now: the free list, or (cached mode) the page source's
  /// availablePages().
  int32_t freePageCount() const noexcept {
    return mResources.pageSource != nullptr ? mResources.pageSource->availablePages()
                                            : static_cast<int32_t>(mFreePages.size());
  }
  int32_t totalPageCount() const noexcept;
  int32_t quarantinedPageCount() const noexcept;
  /// Requests quarantined by failed synchronisations, until shutdown() drains them.
  int32_t quarantinedRequestCount() const noexcept;
  int32_t activeRequestCount() const noexcept;
  int32_t windowTokens() const noexcept { return mWindow; }
  /// The construction stream, which every call uses.
  cudaStream_t stream() const noexcept { return mStream; }
  int32_t tokensPerPage() const noexcept { return mPageSize; }
  /// 2M + 1 (admission / prefill budget per sequence; a cached-mode sequence reserves
  /// ceil(L / P) - s / P + 1 private pages instead, besides its held window pages).
  int32_t privatePagesPerSequence() const noexcept { return mAdmissionPages; }
  /// M + 1 (decode budget per sequence).
  int32_t decodePagesPerSequence() const noexcept { return mDecodePages; }
  /// Who holds resident row `slot`: kFree, kActive (a live request) or kQuarantined (a request
  /// quarantined by a failed synchronisation, until shutdown() drains it). Out of range: kFree.
  ResidentRowState residentRowState(CacheSlot slot) const noexcept;
  /// Current batch size of a request.
  int32_t batchSize(RequestHandle const& handle) const;
  /// State of execution row `row`. Throws for an invalid handle or row.
  SwaSequenceState const& state(RequestHandle const& handle, int32_t row) const;

 private:
  Request& request(RequestHandle const& handle, char const* call) const;
  // Admission, in the order beginRequest calls them: the checks that throw, the poisoned
  // outcome (false) and the busy check, the request with its capacities (the last allocation;
  // pagesPerSequence bounds what each sequence ever holds), then publication (never throws).
  void validateResidents(char const* call, std::span<ResidentRef const> residents,
                         cudaStream_t stream) const;
  bool residentsAvailable(char const* call, std::span<ResidentRef const> residents) const;
  std::unique_ptr<Request> newRequest(std::span<ResidentRef const> residents,
                                      std::span<int32_t const> pagesPerSequence);
  BeginRequestResult publishRequest(std::unique_ptr<Request> created) noexcept;
  /// Throws (naming `call`) unless preparePrefill may run with these lengths.
  void requirePrefillInputs(char const* call, Request const& req,
                            std::span<int32_t const> inputLengths) const;
  // Cached mode (bounded_swa_cached_mode.cpp).
  /// Throws unless `start` is valid for row `row`; returns its private pages ceil(L/P) - s/P + 1.
  int32_t validateReuseStart(char const* call, std::size_t row, SwaReuseStart const& start) const;
  /// Holds every window page of `created` in the source; on a throw releases those it held.
  void holdWindowPages(Request const& created);
  /// Releases the first `count` window pages of `created`, in holdWindowPages' order.
  void releaseWindowPages(Request const& created, std::size_t count) noexcept;
  /// preparePrefill's halves for one sequence: the private pages of logical pages
  /// [s / P, ceil(L / P)) (may throw: a deque block), then the staging (maps every binding).
  void appendPromptBindings(SwaSequenceState& state, int32_t promptTokens);
  void stagePrompt(SwaSequenceState& state, int32_t promptTokens);
  /// completePrefill of one sequence: retires to the source, keeps one spare.
  void completeCachedPrefill(SwaSequenceState& state);
  /// In-flight admission (bounded_swa_inflight_admission.cpp): the checks that throw, then the
  /// joiner's pages (false: the source has too few, nothing taken). validateJoiner returns the
  /// joiner's private pages, ceil(L / P) - s / P + 1 (2M + 1 without a page source).
  int32_t validateJoiner(char const* call, Request const& req, ResidentRef resident,
                         SwaReuseStart const& start) const;
  /// The unfinalised joiner at `row` of an executing request with no pending work, or throws
  /// naming `call`.
  SwaSequenceState& joinerAt(char const* call, Request& req, int32_t row) const;
  /// The checks of prepareSequenceChunk: the joiner (or, in the prefill, the founder) whose chunk
  /// to `chunkEnd` is prepared.
  SwaSequenceState& chunkJoiner(char const* call, RequestHandle const& handle, int32_t row,
                                int32_t chunkEnd) const;
  /// In the prefill: founder `row`, which has not completed a chunk yet (a founder runs one chunk
  /// in the prefill step, possibly empty; chunkEnd equal to a completed chunk's end is the no-op
  /// call).
  SwaSequenceState& founderBeforeItsChunk(char const* call, Request& req, int32_t row,
                                          int32_t chunkEnd) const;
  /// The prompt length a row's chunks run to: an unfinalised joiner's, or a founder's in the
  /// prefill (the whole prompt preparePrefill staged, until its first chunk is prepared).
  static int32_t promptInChunks(SwaSequenceState const& state) noexcept;
  /// Without a page source: a joiner's 2M + 1 pages from the free list (false: too few, nothing
  /// taken; its capacities are reserved first), and its admission.
  bool takeUncachedJoinerPages(SwaSequenceState& state);
  SwaKVCacheStatus admitUncached(Request& req, ResidentRef resident, int32_t promptTokens);
  /// A chunk call in two halves, so that an allocation failure changes nothing: the plan builds
  /// the joiner's next bindings and reserve in copies (the bindings below `retireBelow` retired,
  /// the staged chunk dropped when `dropStaged`, the chunk to `chunkEnd` staged from the
  /// reserve); applying it only rewrites the row's entries and swaps the copies in.
  struct ChunkPlan;
  ChunkPlan planJoinerChunk(SwaSequenceState const& state, int32_t retireBelow, bool dropStaged,
                            int32_t chunkEnd) const;
  /// Swaps the plan in: the row's committed endpoint `committedEnd`, the chunk to `stagedEnd`
  /// staged.
  void applyJoinerChunk(SwaSequenceState& state, ChunkPlan& plan, int32_t committedEnd,
                        int32_t stagedEnd) noexcept;
  /// Commits the staged chunk: what left its window goes back to the row's reserve.
  void commitJoinerChunk(SwaSequenceState& state) noexcept;
  bool takeJoinerPages(SwaSequenceState& state, SwaReuseStart const& start, int32_t privatePages);
  /// Cached mode: appends one page from the source to the reserve; false when it has none
  /// (and always without a source).
  bool takeSpare(SwaSequenceState& state);
  /// To the page source, or (uncached) to the free list.
  void releasePage(PageId page) noexcept;
  // A transition to a new endpoint in two halves, so that a batch stages all or nothing: the
  // first appends the bindings to map (pages from the sequence's reserve) and is the only one that
  // can throw (a deque block); the second never throws and stages the pages leaving the window.
  void appendBindings(SwaSequenceState& state, int32_t newEndpoint, char const* call) const;
  /// Throws (naming `call`) unless every length pool's active batch is the request's row count.
  void requireLengthBatch(char const* call, Request const& req) const;
  void commitWindow(SwaSequenceState& state, int32_t newEndpoint) const noexcept;
  /// Makes room for one more token of `state`: kNone, or why it cannot (kTableFull past the
  /// table width, kNoCapacity when cached mode finds no spare page).
  RowFailureReason stageDecode(SwaSequenceState& state);
  /// A decode step walked as stageDecode would walk it, without effects: the first row that
  /// would fail it (in row order), the first row past its table width, and the pages rows
  /// without a spare would take from the page source.
  struct DecodeWalk {
    RowFailure failure;
    RowFailure tableFull;
    int32_t sourcePages = 0;
  };
  DecodeWalk walkDecodeStep(RequestHandle const& handle, char const* call) const;
  void mapNewBindings(SwaSequenceState const& state);
  void retire(SwaSequenceState& state);
  void releaseSequence(SwaSequenceState& state) noexcept;
  using Requests = std::span<std::unique_ptr<Request> const>;
  /// Clears the rows of `requests` and uploads them (throws what the page table throws).
  void clearRows(Requests requests);
  /// Gives a request's pages and resident rows back (after its rows were cleared).
  void releaseRequest(Request& request) noexcept;
  /// After a failed synchronisation: invalidates `handle` and quarantines its request.
  SwaKVCacheStatus quarantineHandle(RequestHandle& handle, uint64_t id) noexcept;
  /// A live handle destroyed or replaced (RequestHandle calls it): the registry's abandon.
  void abandon(uint64_t id) noexcept;
  friend RequestHandle;
  bool synchronize() noexcept;

  int32_t mWindow;
  int32_t mPageSize = 0;
  int32_t mPageShift = 0;  // log2(mPageSize): pool page sizes are powers of two
  int32_t mWindowPages = 0;
  int32_t mAdmissionPages = 0;
  int32_t mDecodePages = 0;
  BoundedSwaResources mResources;
  cudaStream_t mStream;
  StreamSynchronizer mSynchronizer;  ///< with the constructor's faults at kStreamSynchronize
  std::vector<PageId> mFreePages;
  std::vector<uint8_t> mResidentBusy;
  /// compactBatch's dropped slots, reserved for every row at construction: a compaction
  /// allocates nothing (a composed request compacts this half after the other one).
  std::vector<CacheSlot> mDroppedSlots;
  /// Compaction-mapping staging, one region per resident slot (created once, see device.h).
  std::unique_ptr<detail::Int32UploadRegions> mMappingUploads;
  /// resources.deviceWrites, or mOwnedWrites (kEachCall) when that was null.
  std::unique_ptr<detail::DeviceWriteQueue> mOwnedWrites;
  detail::DeviceWriteQueue* mWrites = nullptr;
  /// Live and quarantined requests, ids, poison (src/resources/request_registry.h; held by
  /// pointer so that this public header names no internal one).
  std::unique_ptr<detail::RequestRegistry<Request>> mRequests;
  uint64_t mLengthOwner = 0;  // last request to reset the length pools; owns them while live
};

}  // namespace mkv
