#pragma once
/// \file bounded_swa_kv_page_manager.h
/// Sliding-window layers keep only their last W tokens, in a bounded set of rotating pages per
/// sequence. Window arithmetic, page budget, state machine and a worked example:
/// docs/architecture.md, "Bounded SWA".

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "mkv/cuda_types.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/resident_slot_pool.h"
#include "mkv/stream.h"
#include "mkv/tensor.h"
#include "mkv/types.h"

namespace mkv {
namespace detail {
class Int32UploadRegions;
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
  /// Tokens whose KV exists (committed endpoint e). A staged transition is `pendingEndpoint`.
  int32_t endpoint = 0;
  std::optional<int32_t> pendingEndpoint;
  /// Retained logical pages [retainedBegin, retainedEnd) for the endpoint (pending one when a
  /// transition is staged): [floor(max(0, e - W) / P), ceil(e / P)).
  int32_t retainedBegin = 0;
  int32_t retainedEnd = 0;
  /// Mapped pages, ascending logical page.
  std::deque<SwaPageBinding> bindings;
  /// Pages held by the sequence but unmapped (its private reserve).
  std::vector<PageId> reservedPages;
  /// Bindings created by the staged transition (already in `bindings`).
  std::vector<SwaPageBinding> newBindings;
  /// Pages that left the window; still mapped and held until the completion call.
  std::vector<SwaPageBinding> pendingRetire;
  /// bindings + reserved + pendingRetire (pendingRetire pages are not in bindings).
  int32_t heldPages() const noexcept {
    return static_cast<int32_t>(bindings.size() + reservedPages.size() + pendingRetire.size());
  }
};

/// Construction parameters.
struct BoundedSwaConfig {
  int32_t windowTokens = 0;  ///< W: attention window of the sliding layers, in tokens
};

/// Borrowed physical resources the manager drives. All must outlive the manager.
struct BoundedSwaResources {
  /// Reduced pool of the sliding-window layers; its page ids are this manager's to hand out.
  KVCachePool* swaPool = nullptr;
  /// Sparse-window page table over swaPool's ids, one row per resident slot.
  KVPageTable* swaPageTable = nullptr;
  /// Pools whose KV-length tensors follow the request: reset to 0 at preparePrefill and
  /// compacted at batch compaction (swaPool and, in mixed models, the full pool). A length
  /// tensor holds one batch, so it follows one request at a time: the last one to prefill,
  /// until it finishes. Leave empty when several requests execute concurrently.
  std::vector<KVCachePool*> lengthPools;
  /// Recurrent rows of hybrid models; rows of dropped residents are zeroed at compaction.
  RecurrentStatePool* recurrent = nullptr;
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
/// Limits: vanilla one-token decode only (headroom {1,0}, kCommittedPlusLookahead, not
/// speculative), no in-flight admission. All calls use the construction stream.
/// Thread-safety: single writer (the engine thread); no call may run concurrently with another.
class BoundedSwaKVPageManager {
  struct Request;

 public:
  /// Move-only handle of one admitted request. Destroying a live handle abandons the request:
  /// synchronises when device work is pending, then releases its pages (a failed
  /// synchronisation poisons the manager and quarantines the pages instead).
  class RequestHandle {
   public:
    RequestHandle() = default;
    RequestHandle(RequestHandle&& other) noexcept;
    RequestHandle& operator=(RequestHandle&& other) noexcept;
    RequestHandle(RequestHandle const&) = delete;
    RequestHandle& operator=(RequestHandle const&) = delete;
    ~RequestHandle();
    bool valid() const noexcept { return mManager != nullptr; }
    /// The request's id (1, 2, ... in admission order; named by error messages), 0 once the
    /// handle is invalid (finished, abandoned, moved from, or quarantined).
    uint64_t id() const noexcept { return mId; }

   private:
    friend class BoundedSwaKVPageManager;
    RequestHandle(BoundedSwaKVPageManager* manager, uint64_t id) : mManager(manager), mId(id) {}
    void abandon() noexcept;
    BoundedSwaKVPageManager* mManager = nullptr;
    uint64_t mId = 0;
  };

  struct BeginRequestResult {
    SwaKVCacheStatus status = SwaKVCacheStatus::kRequestFailed;
    std::optional<RequestHandle> request;
  };

  /// Throws mkv::Error unless W > 0, the pool and table are consistent (table ids == pool
  /// pages, same device, sparse-window mode, pool >= one sequence's admission budget), every
  /// length pool's batch capacity covers the table's rows, and the recurrent pool (when given)
  /// has a row per table row. The table width (maxPagesPerSeq * P tokens, absolute positions)
  /// bounds how long a sequence may grow: prefill rejects longer prompts and a decode step past
  /// it returns kRequestFailed.
  BoundedSwaKVPageManager(BoundedSwaConfig const& config, BoundedSwaResources resources,
                          cudaStream_t stream, StreamSynchronizer synchronizer = {});
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
  /// epoch), or already held by another active request.
  BeginRequestResult beginRequest(std::span<ResidentRef const> residents, cudaStream_t stream);

  /// Maps each sequence's retained window for its executed prefill length and uploads the
  /// table patch; resets the length pools to 0 for the batch. Call after embeddings and token
  /// pruning fixed the lengths. Throws for a wrong phase, a length count that differs from the
  /// batch, a length outside (0, maxPagesPerSeq * P], or length pools that still follow
  /// another active request.
  void preparePrefill(RequestHandle& handle, std::span<int32_t const> inputLengths);
  /// Commits the prefill transition, retires pages that left the window, and trims each
  /// sequence to M + 1 held pages. No synchronisation: call after the runtime's completion point.
  void completePrefill(RequestHandle& handle);
  /// Stages endpoint + 1 for every sequence (at most one new page mapped and one page staged
  /// for retirement each) and uploads the patch. kRequestFailed (the request is finishing)
  /// when a sequence would pass the table width.
  SwaKVCacheStatus prepareDecodeStep(RequestHandle& handle);
  /// Commits the step and retires pages that left the window.
  void completeDecodeStep(RequestHandle& handle);

  /// Validates an order-preserving oldToNew mapping (size == batch; entries -1 or in
  /// [0, newBatchSize); the k-th survivor goes to k; every destination covered), stores it and
  /// copies it into `deviceMapping` (reshaped to [oldBatch], on the pool's device). Throws,
  /// changing nothing, as well when a length pool's active batch is not the batch: everything
  /// compactBatch needs is checked here.
  void beginBatchCompaction(RequestHandle& handle, std::span<int32_t const> oldToNew,
                            int32_t newBatchSize, Tensor& deviceMapping);
  /// Clears dropped residents' rows, zeroes their recurrent rows, compacts the KV lengths with
  /// one kernel, synchronises, then returns the dropped pages to the free list. A failed
  /// synchronisation: kPoisoned, the request is quarantined and the handle becomes invalid.
  SwaKVCacheStatus compactBatch(RequestHandle& handle);
  /// Synchronises pending work, clears every row and releases all pages. An invalid handle
  /// (already finished, or quarantined by a failed compaction) is a no-op. kPoisoned when the
  /// synchronisation fails (request quarantined) or the manager is poisoned, else kOk.
  SwaKVCacheStatus finish(RequestHandle& handle);
  /// Drains the quarantine: synchronises, releases every quarantined page and clears the poison
  /// when that succeeds. kRequestFailed when requests are still active; kPoisoned when the
  /// drain's synchronisation failed (the quarantine is kept).
  SwaKVCacheStatus shutdown() noexcept;

  bool poisoned() const noexcept;
  int32_t freePageCount() const noexcept { return static_cast<int32_t>(mFreePages.size()); }
  int32_t totalPageCount() const noexcept;
  int32_t quarantinedPageCount() const noexcept;
  /// Requests quarantined by failed synchronisations, until shutdown() drains them.
  int32_t quarantinedRequestCount() const noexcept;
  int32_t activeRequestCount() const noexcept;
  int32_t windowTokens() const noexcept { return mWindow; }
  int32_t tokensPerPage() const noexcept { return mPageSize; }
  /// 2M + 1 (admission / prefill budget per sequence).
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
  enum class Phase : uint8_t { kAdmitted, kExecuting, kFinishing };
  enum class Pending : uint8_t;
  Request& request(RequestHandle const& handle, char const* call) const;
  // A transition to a new endpoint in two halves, so that a batch stages all or nothing: the
  // first appends the bindings to map (pages from the sequence's reserve) and is the only one that
  // can throw (a deque block); the second never throws and stages the pages leaving the window.
  void appendBindings(SwaSequenceState& state, int32_t newEndpoint, char const* call) const;
  /// Throws (naming `call`) unless every length pool's active batch is the request's row count.
  void requireLengthBatch(char const* call, Request const& req) const;
  void commitWindow(SwaSequenceState& state, int32_t newEndpoint) const noexcept;
  bool stageDecode(SwaSequenceState& state);
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
  void abandon(uint64_t id) noexcept;
  bool synchronize() noexcept;

  int32_t mWindow;
  int32_t mPageSize;
  int32_t mPageShift = 0;  // log2(mPageSize): pool page sizes are powers of two
  int32_t mWindowPages;
  int32_t mAdmissionPages;
  int32_t mDecodePages;
  BoundedSwaResources mResources;
  cudaStream_t mStream;
  StreamSynchronizer mSynchronizer;
  std::vector<PageId> mFreePages;
  std::vector<uint8_t> mResidentBusy;
  /// Compaction-mapping staging, one region per resident slot (created once, see device.h).
  std::unique_ptr<detail::Int32UploadRegions> mMappingUploads;
  /// Table rows and KV lengths a call writes, applied by one launch at the call's end.
  kernels::InlinePatchBatch mDeviceWrites;
  /// Live and quarantined requests, ids, poison (src/resources/request_registry.h; held by
  /// pointer so that this public header names no internal one).
  std::unique_ptr<detail::RequestRegistry<Request>> mRequests;
  uint64_t mLengthOwner = 0;  // last request to reset the length pools; owns them while live
};

}  // namespace mkv
