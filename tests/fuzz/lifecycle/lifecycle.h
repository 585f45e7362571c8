#pragma once
/// \file lifecycle.h
/// The lifecycle driver behind runLifecycle (lifecycle_driver.h). Structure:
///
/// * Input: the byte string, read front to back (model.h).
/// * Model: what the driver knows about every request it holds (model.h) and what the headers
///   promise for each call in each stage. Every operation asks the model whether the call it is
///   about to make is valid; valid calls must succeed with the documented outcome, invalid ones
///   must throw mkv::Error and leave the observable state (snapshot()) unchanged.
/// * Operations: named, one member function each, in families (one file each): begin, the
///   prefill and decode steps, compaction and in-flight admission, the ends of a request
///   (finish, drop, shutdown, faults), observers and stale handles. An operation whose arguments
///   the input corrupts is an operation of its own (`bad...`); a valid-looking call can still
///   be invalid for the stage the request is in, which the model decides.
/// * Checks: after every operation, the invariants of checkAll() (invariants.cpp, with the
///   per-backend parts in coordinator_invariants.cpp and swa_invariants.cpp).
///
/// The driver runs on host (CPU) tensors with a tiny geometry (16-token pages, 8-byte token
/// rows), so a lifecycle of a few hundred operations takes milliseconds. Private to
/// tests/fuzz/lifecycle/.

#include <fmt/format.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "context_cache/window_block_cache.h"
#include "fuzz/allocation_faults.h"
#include "fuzz/lifecycle/model.h"
#include "fuzz/lifecycle_driver.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/error.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/kv_oracle.h"
#include "support/backend_snapshot.h"
#include "support/fault_arming.h"

namespace mkv::fuzz::lifecycle {

using test::BackendSnapshot;

/// The operation families the input chooses from, in the order of the input's choice (the
/// numbering is part of the input format: a corpus file replays only with the same order).
enum class Family : uint8_t {
  kBegin,
  kPreparePrefill,
  kCaptures,
  kCompletePrefill,
  kPrepareDecode,
  kCompleteDecode,
  kBeginCompaction,
  kCompleteCompaction,
  kAdmit,
  kFinalize,
  kRetract,
  kFinish,
  kDrop,
  kShutdown,
  kFailSync,
  kObserve,
  kStaleHandle,
  kCount,
};

/// The named operations: a family, and for the families with arguments to corrupt, the same
/// call with one argument corrupted (kBad...). The input picks the family, then (one byte in
/// eight) the corrupted form.
enum class Operation : uint8_t {
  kBegin,
  kBadBegin,
  kPreparePrefill,
  kBadPreparePrefill,
  kCaptures,
  kBadCaptures,
  kCompletePrefill,
  kBadCompletePrefill,
  kPrepareDecode,
  kBadPrepareDecode,
  kCompleteDecode,
  kBadCompleteDecode,
  kBeginCompaction,
  kBadBeginCompaction,
  kCompleteCompaction,
  kBadCompleteCompaction,
  kAdmit,
  kBadAdmit,
  kFinalize,
  kBadFinalize,
  kRetract,
  kFinish,
  kDrop,
  kShutdown,
  kFailSync,
  kObserve,
  kStaleHandle,
};

/// The operation of `family`, in its corrupted form when `corrupt` and the family has one.
Operation operationOf(Family family, bool corrupt);

/// The runtimes the set-up bytes choose from (configFromInput).
enum class Runtime : uint8_t {
  kContextReuse,
  kBoundedSwa,
  kFullStorage,
  kHybrid,       ///< context reuse + recurrent layers: exact checkpoints
  kSpeculative,  ///< context reuse + a draft model (paged or reading the base KV): paired reuse
  kHybridMtp,    ///< context reuse + recurrent layers + an MTP draft: Hybrid-MTP endpoints
  /// full + sliding layers with reuse (KVCacheBackend::kSlidingWindowReuse): the coordinator for
  /// the full layers, the SWA manager over a WindowBlockCache for the sliding ones
  kSlidingReuse,
};

class Lifecycle {
 public:
  Lifecycle(std::span<uint8_t const> data, LifecycleOptions const& options);
  /// Runs the whole lifecycle; never throws.
  LifecycleResult run();

 private:
  /// A batch about to be begun: rows on fresh residents and the request's policies.
  struct BeginPlan {
    std::vector<Row> rows;
    std::string lora;
    std::string salt;
    DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead;
    ContextCacheCommitPolicy commit = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
    ContextCacheLookupPolicy lookup = ContextCacheLookupPolicy::kUseCache;
    std::vector<std::optional<ContextCacheLookupPolicy>> rowPolicies;
    Via via = Via::kFacade;
    uint64_t seed = 0;
    bool speculative = false;
    DecodingKvHeadroom headroom = kVanilla;
  };
  /// The arguments of a decode step and whether they break the contract.
  struct DecodeCall {
    std::vector<FinishReason> reasons;  // before cancellations, to restore on rejection
    DecodingKvHeadroom headroom = kVanilla;
    DecodingInferenceContext context;
    bool badArguments = false;
  };
  /// The arguments of completeDecodeStep as the engine's sampling decided them.
  struct CompleteDecodeCall {
    std::vector<Row> rows;
    std::vector<int32_t> completed;
    DecodingInferenceContext context;
    std::vector<ContextCacheSequenceAdvance> advances;
    std::vector<int32_t> common;
    bool valid = false;
    bool badArguments = false;
  };
  /// The arguments of completePrefill (rows with their lookahead tokens sampled).
  struct CompletePrefillCall {
    std::vector<Row> sampled;
    DecodingInferenceContext context;
    std::vector<ContextCacheSequenceAdvance> advances;
    std::vector<int32_t> common;
    bool valid = false;
    bool badArguments = false;
  };
  /// The arguments of beginBatchCompaction.
  struct CompactionCall {
    std::vector<int32_t> mapping;
    int32_t newSize = 0;
    Tensor* device = nullptr;
    bool badArguments = false;
  };
  /// An in-flight admission on a fresh resident and its (possibly corrupted) arguments.
  struct AdmitCall {
    Row row;
    ContextCacheSequenceAdmission admission;
    SwaReuseStart swaStart;  ///< the SWA manager's (direct bounded-SWA requests)
    std::vector<int32_t> tokens;
    ResidentRef resident;
    DecodingKvHeadroom headroom = kVanilla;
    cudaStream_t stream = kStream;
    bool valid = false;
    bool badArguments = false;
    bool busyResident = false;
  };

  // lifecycle.cpp: set-up, teardown, the operation loop
  bool setUp();
  KVCacheRuntimeConfig configFromInput();
  void slidingReuseConfig(KVCacheRuntimeConfig& config, int32_t width);
  void bindRuntime(KVCacheRuntimeConfig const& config);
  void tearDown();
  void checkEverythingReturned();
  void abandonEverything() noexcept;
  void operation();
  Family naturalNext(Req const& req);
  std::size_t pickTarget();
  void dispatch(Operation op, std::size_t target);
  void dispatchOnRequest(Operation op, std::size_t target);
  void recoverFromAllocationFailure(uint64_t serial);

  // lifecycle.cpp: small helpers
  bool coordinatorBackend() const noexcept { return mCoordinator != nullptr; }
  /// The composed backend: both mCoordinator and mSwa, one facade request over both halves.
  bool slidingReuse() const noexcept { return mKind == Runtime::kSlidingReuse; }
  /// The runtimes whose SWA rows move a window (bounded SWA, the sliding half of sliding reuse).
  bool windowRows() const noexcept { return mSwa != nullptr; }
  /// Hybrid checkpoint reuse (hybrid and Hybrid-MTP runtimes).
  bool checkpointDeployment() const noexcept { return mRecurrentOracle != nullptr; }
  bool speculativeDeployment() const noexcept {
    return mKind == Runtime::kSpeculative || mKind == Runtime::kHybridMtp;
  }
  /// Whether the request binds draft rows, and whether this row keeps draft digests.
  bool pairs(BeginPlan const& plan) const noexcept {
    return plan.speculative && mRuntime->draftPool() != nullptr;
  }
  /// Synchronisations an ending (finish, abandonment) of the request makes.
  static int64_t endingSyncs(Req const& req) {
    return req.stage != Stage::kGone && (pendingWork(req.stage) || req.draftInitPending) ? 1 : 0;
  }
  int32_t poolPages() const;
  KVPageTable* mainTable() const;
  bool backendPoisoned() const;
  int32_t maxPromptTokens() const;
  void trace(std::string line);
  int64_t syncCalls() const { return mSync.calls(); }
  int64_t syncFailures() const { return mSync.failures() + mSync.throws(); }
  bool synchronised(std::string const& what, int64_t callsBefore, int64_t failuresBefore,
                    int64_t expected);
  /// After a call that may capture checkpoints and synchronise once (completeDecodeStep,
  /// preemptSequence; `before`, `callsBefore`, `failuresBefore` taken before it, `returned` its
  /// result): checks the synchronisations it made and, when the capture's failed, that it
  /// returned false, and quarantines the request. Returns whether it did.
  bool quarantinedByCapture(Req& req, std::string const& what,
                            ContextCacheCoordinatorCounters const& before, int64_t callsBefore,
                            int64_t failuresBefore, bool returned);
  Req* find(uint64_t serial);
  std::string describe(Req const& req) const;
  int32_t swaRowPages(Req const& req, Row const& row) const;
  /// A bounded-SWA joiner that is not finalised (its prefill's window is staged chunk by chunk).
  bool swaJoiner(Row const& row) const noexcept { return !coordinatorBackend() && !row.joined; }
  int32_t liveRequests() const;
  std::vector<ResidentRef> busyResidents() const;

  /// Calls into the library: counts the call, marks the allocation-fault scope, turns a
  /// std::bad_alloc into AllocationFailed and any exception other than mkv::Error into a
  /// violation.
  template <typename Call>
  decltype(auto) library(char const* what, Call&& call);
  /// A valid call: must not throw.
  template <typename Call>
  decltype(auto) accept(std::string const& what, Call&& call);
  /// An invalid call: must throw mkv::Error and change nothing.
  template <typename Call>
  void reject(std::string const& what, Call&& call);
  /// A call that must succeed without changing anything (no-ops and observers).
  template <typename Call>
  decltype(auto) unchanged(std::string const& what, Call&& call);
  /// Checks that a refused call changed nothing but its counters.
  void expectRefusalChangedNothing(std::string const& what, BackendSnapshot before);

  // engine.cpp: the engine side (KV written through the oracles, KV lengths, sampling)
  DecodingInferenceContext contextOf(Req const& req) const;
  void writeLength(int32_t rowIndex, int32_t length);
  void writeDraftLength(int32_t rowIndex, int32_t length);
  void setActiveBatch(int32_t batch);
  /// The prefill of positions [start or materialized, end) of a row (end 0: its whole prompt);
  /// the first chunk checks what it resumes from.
  void executePrefill(Req& req, Row& row, int32_t rowIndex, int32_t end = 0);
  /// A bounded-SWA joiner's staged chunk [windowFrom, endpoint) in the engine's step: the window
  /// it reads, [from - W, from), must hold the row's own KV; then the chunk is executed.
  void executeSwaChunk(Req& req, Row& row, int32_t rowIndex);
  void captureReusePoints(Req const& req, Row const& row, int32_t rowIndex, int32_t from,
                          int32_t to);
  void verifyResumed(Req const& req, Row& row, int32_t rowIndex);
  void executeDraft(Row& row, int32_t rowIndex, int32_t to);
  void writeHiddenStates(Req& req);
  /// Hybrid-MTP: the base hidden rows of `row`'s prefill positions [start, prompt).
  static Tensor hiddenStatesOf(Row const& row);
  /// Hybrid-MTP: an unfinalised joiner's restore, last chunk and endpoint before its
  /// finalisation; false when the request is gone (a failed synchronisation quarantined it).
  bool publishJoinerEndpoint(Req& req, int32_t slot);
  void sampleInto(Row& row);
  void executeDecode(Req& req, Row& row, int32_t rowIndex);
  void verifyRow(Row const& row);
  void oracleWrite(testing::KvOracle& oracle, CacheSlot slot, testing::PrefixDigests const& digests,
                   int32_t begin, int32_t end);
  bool forgetFlush();
  void flushForStep();
  void checkFlushed();
  void refusedPrefillCompletion(Req& req);
  void refusedDecodeCompletion(Req& req);
  std::vector<int32_t> makePrompt(int32_t tokens);
  int32_t promptLength();

  // invariants.cpp, coordinator_invariants.cpp, swa_invariants.cpp
  BackendSnapshot snapshot() const;
  void checkAll();
  void checkBackend();
  void checkCoordinator();
  void checkCoordinatorPages();
  void checkFreeRing();
  void checkCoordinatorLeases();
  void checkSwaManager();
  void checkSwaRequest(Req const& req, int32_t rowPages);
  Row const* rowOf(CacheSlot slot) const;
  void checkTables();
  void checkMirrors();
  void checkMirrorRows(KVPageTable const& table, bool clearedMayLag, std::string_view when);
  void checkDenseRow(KVPageTable const& table, CacheSlot slot, Row const& row,
                     std::vector<CacheSlot>& lastRow, std::vector<int32_t>& seen);
  void checkSwaRow(KVPageTable const& table, CacheSlot slot, Row const& row,
                   std::vector<int32_t>& seen);
  void checkSwaMirror(KVPageTable const& table);
  void checkWindowCache();
  void checkSlidingTable();
  void checkPinnedPages(KVPageTable const& table, std::vector<int32_t> const& seen);
  void checkDraftTable();
  void checkSnapshotResources();
  void noteCheckpoint(Req const& req, Row const& row, int32_t length, bool mtp);
  void checkCheckpoints();
  void checkCheckpoint(CacheRecord const& record, CheckpointPrefix const& prefix);
  void checkResourceConservation(ResourceType type, std::vector<int32_t> const& recordRefs);
  void checkLengths();

  // begin_operations.cpp
  void begin();
  void badBegin();
  template <typename Body>
  void withBeginPlan(Body&& body);
  std::optional<BeginPlan> planBegin();
  LLMGenerationRequest generationOf(BeginPlan const& plan) const;
  DecodingInferenceContext contextOf(BeginPlan const& plan) const;
  ContextCacheBatchAdmission admissionOf(BeginPlan const& plan) const;
  std::vector<ResidentRef> residentsOf(BeginPlan const& plan) const;
  std::optional<bool> mustAdmit(std::vector<int32_t> const& promptLengths,
                                DecodingKvHeadroom const& headroom, bool paired) const;
  std::optional<std::vector<int32_t>> beginThroughFacade(BeginPlan const& plan, Req& req,
                                                         std::string const& what);
  std::optional<std::vector<int32_t>> beginOnCoordinator(BeginPlan const& plan, Req& req,
                                                         std::string const& what);
  std::optional<std::vector<int32_t>> beginOnSwa(BeginPlan const& plan, Req& req,
                                                 std::string const& what);
  void admitted(BeginPlan& plan, std::unique_ptr<Req> req, std::vector<int32_t> const& starts,
                std::optional<bool> must, std::string const& what);
  void beginOnBusyResident(BeginPlan const& plan, std::string const& what);
  void badFacadeBegin(BeginPlan const& plan, int32_t variant, std::string const& what);
  void badCoordinatorBegin(BeginPlan const& plan, int32_t variant, std::string const& what);
  void badSwaBegin(BeginPlan const& plan, int32_t variant, std::string const& what);

  // step_operations.cpp: prefill and decode
  std::vector<int32_t> swaPrefillLengths(Req const& req) const;
  bool prefillBlockedByAnother(Req const& req);
  void preparePrefill(Req& req);
  void badPreparePrefill(Req& req);
  void issuePreparePrefill(Req& req, std::vector<int32_t> const& lengths, bool badLengths);
  bool issueFacadePreparePrefill(Req& req, std::vector<int32_t> const& lengths, bool valid,
                                 std::string const& what);
  bool issueFacadeCoordinatorPrepare(Req& req, std::string const& what);
  void captures(Req& req);
  void badCaptures(Req& req);
  void publishEndpoint(Req& req, int32_t slot, int32_t length, Tensor const& hidden, int32_t row,
                       bool valid);
  void restoreBoundaryHidden(Req& req, int32_t slot, Tensor& hidden, int32_t row, bool valid);
  /// Hybrid-MTP: row `slot` restored a checkpoint whose pins it still holds (in the prefill).
  bool restorable(Req const& req, int32_t slot) const;
  void completePrefill(Req& req);
  void badCompletePrefill(Req& req);
  CompletePrefillCall planCompletePrefill(Req& req);
  void corruptCompletePrefill(Req const& req, CompletePrefillCall& call, int32_t variant);
  void issueCompletePrefill(Req& req, CompletePrefillCall& call);
  bool callCompletePrefill(Req& req, CompletePrefillCall const& call);
  /// What the model expects the next decode step to allocate: base and draft page growth of the
  /// running rows, and whether a row would pass its table width (the step then fails).
  struct ModelDemand {
    int64_t base = 0;
    int64_t draft = 0;
    bool tableFull = false;
  };
  ModelDemand modelDecodeDemand(Req const& req, DecodingKvHeadroom const& headroom) const;
  bool decodeFits(Req const& req, DecodingKvHeadroom const& headroom) const;
  /// decodeStepDemand (facade, coordinator or SWA manager, as the request is driven) against
  /// modelDecodeDemand.
  void checkDecodeDemand(Req const& req, DecodingKvHeadroom const& headroom);
  /// Pages the row's base (draft) table maps.
  int32_t mappedPages(Row const& row) const;
  int32_t mappedDraftPages(Row const& row) const;
  void prepareDecode(Req& req);
  void badPrepareDecode(Req& req);
  DecodeCall planDecode(Req& req, bool valid);
  void issueDecode(Req& req, DecodeCall& call, bool valid);
  void completeDecode(Req& req);
  void badCompleteDecode(Req& req);
  CompleteDecodeCall planCompleteDecode(Req& req);
  bool callCompleteDecode(Req& req, CompleteDecodeCall const& call);
  void corruptCompleteDecode(Req const& req, CompleteDecodeCall& call);
  void issueCompleteDecode(Req& req, CompleteDecodeCall& call);

  // batch_operations.cpp: compaction and in-flight admission
  void beginCompaction(Req& req);
  void badBeginCompaction(Req& req);
  CompactionCall planCompaction(Req const& req, int32_t& survivors);
  void corruptCompaction(CompactionCall& call, int32_t survivors);
  void issueBeginCompaction(Req& req, CompactionCall& call);
  void completeCompaction(Req& req);
  void badCompleteCompaction(Req& req);
  void issueCompleteCompaction(Req& req, std::vector<int32_t> const& keep, bool badArguments);
  void admit(Req& req);
  void badAdmit(Req& req);
  std::optional<AdmitCall> planAdmit(Req& req);
  void corruptAdmit(Req& req, AdmitCall& call);
  void issueAdmit(Req& req, AdmitCall& call);
  AdmitSequenceStatus callAdmit(Req& req, AdmitCall const& call, int32_t& start);
  bool admitOutcome(Req& req, AdmitCall& call, int32_t& start, std::string const& what);
  /// Bounded SWA: admitted exactly when 2M + 1 pages are free and the backend is not poisoned.
  bool swaAdmitOutcome(Req& req, AdmitCall& call, int32_t& start, std::string const& what);
  void joined(Req& req, Row row, int32_t start, std::string const& what);
  /// Bounded SWA: the joiner starts at 0 with the window of its whole prompt staged; it runs no
  /// chunk yet, its whole prompt, or a first chunk prepared shorter.
  void swaJoined(Req& req, Row row, std::string const& what);
  void finalize(Req& req);
  /// Bounded SWA's joiner operations (between steps; during one, each must throw): complete the
  /// chunk the last step ran, or prepare and run the next one (wrong calls among them), or undo
  /// the joiner by compaction.
  void swaJoinerStep(Req& req, int32_t slot);
  /// preparePrefillChunk / prepareSequenceChunk of joiner `slot` to `end`; false when it did not
  /// stage (rejected, or refused on a poisoned facade).
  bool prepareSwaChunk(Req& req, int32_t slot, int32_t end);
  /// completePrefillChunk / completeSequenceChunk of joiner `slot` at `end`; false as above.
  bool completeSwaChunk(Req& req, int32_t slot, int32_t end);
  /// Brings joiner `slot` to a staged chunk that ends at its prompt and ran (the engine's last
  /// chunk before finalisation).
  void swaPrefillRest(Req& req, int32_t slot);
  /// The engine compacts an unfinalised joiner away (preemption refuses one).
  void compactJoinerAway(Req& req);
  /// preemptSequence of row `slot` (any row: refused beyond the batch, for an unfinalised joiner
  /// and, on the coordinator, outside a settled batch); the row goes on (the library allows it;
  /// engines compact it away). Direct bounded-SWA requests have no such call.
  void preempt(Req& req, int32_t slot);
  void badFinalize(Req& req);
  bool finalizeModelled(Req& req);
  void issueFinalize(Req& req, int32_t slot, bool corruptLength);
  void issueSwaFinalize(Req& req, int32_t slot, bool corrupt);
  /// Chunked prefill of the unjoined row `slot` whose prompt is not done: one more chunk and its
  /// completePrefillChunk (refused during a step), its lookahead sampled after the last.
  void prefillChunk(Req& req, int32_t slot);
  /// Whether a founder of `req` may run only a first chunk in its prefill (the backends with the
  /// coordinator, requests that admit joiners).
  bool foundersChunk(Req const& req) const;
  void founderChunk(Req& req, int32_t slot, int32_t end);
  /// completePrefillChunk(slot, tokens) through the request's path (facade, coordinator or the
  /// SWA manager), as the facade's answer.
  bool callCompleteChunk(Req& req, int32_t slot, int32_t tokens);
  void prepareFounderChunk(Req& req, int32_t slot, int32_t end);
  /// The rest of a chunked joiner's prefill and its lookahead, before it is finalised; false
  /// when its pages could not be prepared (the finalisation is then not attempted).
  bool prefillRest(Req& req, int32_t slot);
  /// preparePrefillChunk of coordinator joiner `slot` to `end` (with its prefillChunkDemand
  /// checked against the row's mapped pages): allocates the chunk's pages under
  /// JoinerPageAllocation::kPerChunk, must succeed exactly when the pools can give them, and a
  /// refusal names the row and changes nothing. False when refused (capacity, poison).
  bool prepareJoinerChunk(Req& req, int32_t slot, int32_t end);
  /// Whether the row's tables already map the pages of its first `end` tokens.
  bool chunkCovered(Row const& row, int32_t end) const;
  void retract(Req& req);

  // ending_operations.cpp: finish, drop, shutdown, injected faults
  void quarantine(Req& req);
  void released(Req& req);
  void finish(Req& req);
  void drop(std::size_t index);
  void shutdown(bool fromInput);
  void resetPrefixCache();
  void checkCacheEmpty();
  void armSyncFault();

  // observe_operations.cpp: observers and calls on invalid handles
  void observe(Req& req);
  void observeFacade(Req& req, int32_t slot, bool inBatch, std::string const& what);
  void observeCoordinator(Req& req, int32_t slot, bool inBatch, std::string const& what);
  void observeSwa(Req& req, int32_t slot, bool inBatch, std::string const& what);
  void staleHandle();

  Input mIn;
  LifecycleOptions mOptions;
  test::FaultArming mSync;
  LifecycleStats mStats;
  std::deque<std::string> mTrace;

  std::unique_ptr<KVCacheRuntime> mRuntime;
  ContextCacheCoordinator* mCoordinator = nullptr;
  BoundedSwaKVPageManager* mSwa = nullptr;
  std::unique_ptr<testing::KvOracle> mFullOracle;
  std::unique_ptr<testing::KvOracle> mSwaOracle;
  std::unique_ptr<testing::KvOracle> mDraftOracle;             ///< paged draft runtimes
  std::unique_ptr<testing::RecurrentOracle> mRecurrentOracle;  ///< checkpoint runtimes
  Runtime mKind = Runtime::kContextReuse;
  int32_t mDraftLookahead = 0;  ///< tokens a draft row depends on past its position (0 or 1)
  std::vector<KVCachePool*> mLengthPools;
  Tensor mMapping;
  Tensor mWrongTypeMapping;
  Tensor mEmptyMapping{{0}, DataType::kInt32, DeviceType::kCPU};
  int32_t mWidth = 0;
  int32_t mMaxBatch = 0;
  int32_t mWindow = 0;
  int32_t mWindowPages = 0;
  int32_t mPromptHeadroom = 1;  ///< base headroom the planned batch needs in its row
  /// DeviceWriteTiming::kEngineStep: table rows and KV lengths reach the device only at the
  /// engine's flushDeviceWrites() (flushForStep), once per step before its forward.
  bool mEngineStep = false;
  /// A step's flush was forgotten: the engine's KV writes go through stale device rows and may
  /// miss (an empty entry); they are made again after the flush.
  bool mStaleRows = false;

  std::vector<std::unique_ptr<Req>> mRequests;
  std::vector<Quarantined> mQuarantine;
  std::vector<CheckpointPrefix> mCheckpointLedger;  ///< every prefix a capture may have been for
  uint64_t mNextSerial = 1;
  uint64_t mLengthOwner = 0;  // serial of the request whose batch the KV-length tensors hold
  bool mPoisoned = false;
};

// ---------------------------------------------------------------- call wrappers

template <typename Call>
decltype(auto) Lifecycle::library(char const* what, Call&& call) {
  ++mStats.libraryCalls;
  try {
    LibraryCall scope;
    return call();
  } catch (Error const&) {
    throw;
  } catch (std::bad_alloc const&) {
    ++mStats.badAllocs;
    throw AllocationFailed{};
  } catch (std::exception const& other) {
    violate(fmt::format("{} threw a non-mkv exception: {}", what, other.what()));
  }
}

template <typename Call>
decltype(auto) Lifecycle::accept(std::string const& what, Call&& call) {
  try {
    return library(what.c_str(), std::forward<Call>(call));
  } catch (Error const& error) {
    violate(fmt::format("{}: valid call threw mkv::Error: {}", what, error.what()));
  }
}

template <typename Call>
void Lifecycle::reject(std::string const& what, Call&& call) {
  BackendSnapshot const before = snapshot();
  bool threw = false;
  try {
    (void)library(what.c_str(), std::forward<Call>(call));
  } catch (Error const&) {
    threw = true;
  }
  expectf(threw, "{}: invalid call was accepted", what);
  BackendSnapshot const after = snapshot();
  expectf(before == after, "{}: threw but changed {}", what, differences(before, after));
  ++mStats.rejectedCalls;
}

template <typename Call>
decltype(auto) Lifecycle::unchanged(std::string const& what, Call&& call) {
  BackendSnapshot const before = snapshot();
  decltype(auto) result = accept(what, std::forward<Call>(call));
  BackendSnapshot const after = snapshot();
  expectf(before == after, "{}: changed {}", what, differences(before, after));
  return result;
}

}  // namespace mkv::fuzz::lifecycle
