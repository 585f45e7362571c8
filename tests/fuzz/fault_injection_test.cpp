/// Allocation fault injection (docs/reliability.md). This binary replaces the global operator new
/// with a malloc-based one that asks allocation_faults.h whether the current allocation must throw
/// std::bad_alloc; only allocations inside a LibraryCall scope are counted and failed.
///
/// A script drives one runtime (host tensors) through a lifecycle of ContextCacheCoordinator,
/// BoundedSwaKVPageManager or ManagedKVCacheRequest calls, interleaved with engine-side steps
/// (sampling, choosing rows to drop, the next prompts) that make no library call. For every
/// library step s and every n = 1 .. N_s (N_s = the allocations step s makes in a clean run), a
/// fresh runtime replays the steps before s, step s runs with its n-th allocation failing, and:
///
/// * the state is consistent (manager refcounts, records and index; page-table invariants; rows
///   against leases; SWA page conservation);
/// * a call that threw (std::bad_alloc or mkv::Error) left unchanged what its guarantee covers
///   (docs/errors.md, "Out of host memory": everything for most calls), and the rest of the
///   script, starting with the retried call, gives the clean run's outcomes;
/// * a call that returned anyway returned the clean run's outcome (the fault was absorbed: a
///   skipped publication) and the script goes on to the clean run's outcomes;
/// * then every request is ended, shutdown drains, every page and resident is back, a clean
///   lifecycle of the reference engine passes the KV oracle on the same runtime, and once the
///   runtime is destroyed every heap block allocated since the run began has been freed.
///
/// Under the sanitizers (which own operator new) these tests skip; the non-sanitised CI build
/// runs them, and their own block count stands in for LeakSanitizer on these paths.

#include <gtest/gtest.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <memory>
#include <new>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "context_cache/context_cache_test_support.h"
#include "fuzz/allocation_faults.h"
#include "fuzz/lifecycle_driver.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/error.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/logging.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/reference_engine.h"
#include "support/backend_snapshot.h"
#include "support/fault_arming.h"
#include "support/token_runs.h"

// AddressSanitizer replaces operator new itself (GCC defines __SANITIZE_ADDRESS__, clang reports
// it through __has_feature).
#if defined(__SANITIZE_ADDRESS__)
#define MKV_ALLOCATION_FAULTS 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MKV_ALLOCATION_FAULTS 0
#endif
#endif
#ifndef MKV_ALLOCATION_FAULTS
#define MKV_ALLOCATION_FAULTS 1
#endif

namespace mkv::fuzz {
namespace {
/// Blocks from operator new not yet given to operator delete (the tests are single-threaded).
int64_t gLiveAllocations = 0;
}  // namespace
}  // namespace mkv::fuzz

#if MKV_ALLOCATION_FAULTS
void* operator new(std::size_t size) {
  if (mkv::fuzz::failThisAllocation()) {
    throw std::bad_alloc();
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) {
    ++mkv::fuzz::gLiveAllocations;
    return p;
  }
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void operator delete(void* p) noexcept {
  if (p != nullptr) {
    --mkv::fuzz::gLiveAllocations;
  }
  std::free(p);
}
void operator delete[](void* p) noexcept { ::operator delete(p); }
void operator delete(void* p, std::size_t) noexcept { ::operator delete(p); }
void operator delete[](void* p, std::size_t) noexcept { ::operator delete(p); }
#endif

namespace mkv::fuzz {
namespace {

using test::concatenated;
using test::tokenRun;

constexpr int32_t kPage = 16;
constexpr cudaStream_t kStream = nullptr;
constexpr DecodingKvHeadroom kVanilla{1, 0};

/// Runs `call` as a call into the library under test: the armed allocation may fail inside.
template <typename Call>
decltype(auto) library(Call&& call) {
  LibraryCall const scope;
  return call();
}

// ---------------------------------------------------------------- the rig

using State = test::BackendSnapshot;

/// `config` on host tensors and kStream, its faults reported to `faults`.
KVCacheRuntimeConfig onHost(KVCacheRuntimeConfig config, FaultInjector faults) {
  config.deviceType = DeviceType::kCPU;
  config.stream = kStream;
  config.faults = std::move(faults);
  return config;
}

/// One runtime on host tensors and what an engine keeps about the request a script drives:
/// its rows (execution order) in `context`, the backend request, a joiner being admitted.
struct Rig {
  explicit Rig(KVCacheRuntimeConfig const& config)
      : runtime(KVCacheRuntime::create(onHost(config, syncs.injector()))),
        coordinator(runtime->contextCache()),
        swa(runtime->swaPageManager()) {
    deviceMapping = Tensor({config.maxBatchSize}, DataType::kInt32, DeviceType::kCPU);
    context.stream = kStream;
  }

  /// Abandons what is left and drains (best effort; finishAndCheck() is the checked path).
  ~Rig() {
    syncs.disarm();
    facade.reset();
    coordinatorRequest = ContextCacheCoordinator::RequestHandle();
    swaRequest = BoundedSwaKVPageManager::RequestHandle();
    (void)runtime->shutdown();
  }

  Rig(Rig const&) = delete;
  Rig& operator=(Rig const&) = delete;

  // ------------------------------------------------------------ engine side (no library calls)

  /// Acquires one resident per prompt and makes them the rows of the next request.
  void newRows(std::vector<std::vector<int32_t>> const& prompts) {
    context = DecodingInferenceContext();
    context.stream = kStream;
    joined.clear();
    for (auto const& prompt : prompts) {
      appendRow(prompt, *runtime->residentSlots().acquire());
    }
  }

  void appendRow(std::vector<int32_t> const& prompt, ResidentRef resident) {
    context.rawBatchedInputIds.push_back(prompt);
    context.effectivePrefillLengths.push_back(static_cast<int32_t>(prompt.size()));
    context.generatedTokenIds.emplace_back();
    context.residentRefs.push_back(resident);
    context.finishReasons.push_back(FinishReason::kNotFinished);
    context.activeBatchSize = static_cast<int32_t>(context.residentRefs.size());
    joined.push_back(true);
  }

  void dropLastRow() {
    context.rawBatchedInputIds.pop_back();
    context.effectivePrefillLengths.pop_back();
    context.generatedTokenIds.pop_back();
    context.residentRefs.pop_back();
    context.finishReasons.pop_back();
    context.activeBatchSize = static_cast<int32_t>(context.residentRefs.size());
    joined.pop_back();
  }

  /// Every running row samples one token (a prefill's lookahead or a decode step's token).
  void sample() {
    for (std::size_t i = 0; i < context.generatedTokenIds.size(); ++i) {
      if (context.finishReasons[i] == FinishReason::kNotFinished && joined[i]) {
        context.generatedTokenIds[i].push_back(30000 + static_cast<int32_t>(i) + 7 * stepTokens++);
      }
    }
  }

  void releaseRows() {
    for (ResidentRef const ref : context.residentRefs) {
      (void)runtime->residentSlots().release(ref);
    }
    context = DecodingInferenceContext();
    joined.clear();
  }

  /// The rows of a request whose synchronisation failed stay held until shutdown drains it.
  void quarantineRows() {
    quarantinedResidents.insert(quarantinedResidents.end(), context.residentRefs.begin(),
                                context.residentRefs.end());
    context = DecodingInferenceContext();
    joined.clear();
  }

  void setMapping(std::vector<int32_t> oldToNew) {
    mapping = std::move(oldToNew);
    newBatchSize = 0;
    for (int32_t destination : mapping) {
      newBatchSize += destination >= 0 ? 1 : 0;
    }
  }

  /// The engine's side of a completed compaction: dropped residents go back, rows compact.
  void applyMapping() {
    DecodingInferenceContext const old = context;
    std::vector<bool> const oldJoined = joined;
    context = DecodingInferenceContext();
    context.stream = kStream;
    joined.clear();
    for (std::size_t i = 0; i < mapping.size(); ++i) {
      if (mapping[i] < 0) {
        (void)runtime->residentSlots().release(old.residentRefs[i]);
        continue;
      }
      appendRow(old.rawBatchedInputIds[i], old.residentRefs[i]);
      context.generatedTokenIds.back() = old.generatedTokenIds[i];
      context.finishReasons.back() = old.finishReasons[i];
      joined.back() = oldJoined[i];
    }
  }

  /// A joiner was admitted: it becomes the last row, and the KV-length tensor grows with it.
  void joinerAdmitted() {
    appendRow(joinerPrompt, *joinerResident);
    joined.back() = false;
    joinerResident.reset();
    KVCachePool& lengths = runtime->lengthPool();
    lengths.setActiveBatchSize(context.activeBatchSize);
    lengths.writeLengths(context.activeBatchSize - 1, std::span<int32_t const>(&prefillStart, 1),
                         kStream);
  }

  void joinerRetracted() {
    (void)runtime->residentSlots().release(context.residentRefs.back());
    dropLastRow();
    runtime->lengthPool().setActiveBatchSize(context.activeBatchSize);
  }

  /// After finish: drained (the residents go back) or quarantined (held until shutdown).
  void requestEnded(bool drained) {
    if (drained) {
      releaseRows();
    } else {
      quarantineRows();
    }
  }

  void newJoiner(std::vector<int32_t> prompt) {
    joinerPrompt = std::move(prompt);
    joinerResident = runtime->residentSlots().acquire();
  }

  // ------------------------------------------------------------ coordinator advances

  /// Prefill: the whole prompt plus the sampled lookahead.
  std::vector<ContextCacheSequenceAdvance> prefillAdvances() const {
    std::vector<ContextCacheSequenceAdvance> advances;
    for (std::size_t i = 0; i < context.rawBatchedInputIds.size(); ++i) {
      advances.push_back({&context.generatedTokenIds[i].back(), 1,
                          static_cast<int32_t>(context.rawBatchedInputIds[i].size())});
    }
    return advances;
  }

  /// Decode: one token for every row that sampled one in this step, a hold for the others.
  std::vector<ContextCacheSequenceAdvance> decodeAdvances() const {
    std::vector<ContextCacheSequenceAdvance> advances;
    for (std::size_t i = 0; i < context.rawBatchedInputIds.size(); ++i) {
      FinishReason const reason = context.finishReasons[i];
      if (!joined[i] || reason == FinishReason::kCancelled || reason == FinishReason::kError) {
        advances.push_back({nullptr, 0, kHoldCommittedStateLength});
        continue;
      }
      auto const& generated = context.generatedTokenIds[i];
      advances.push_back(
          {&generated.back(), 1,
           static_cast<int32_t>(context.rawBatchedInputIds[i].size() + generated.size()) - 1});
    }
    return advances;
  }

  std::vector<int32_t> completedRows() const {
    std::vector<int32_t> completed;
    for (std::size_t i = 0; i < context.finishReasons.size(); ++i) {
      FinishReason const reason = context.finishReasons[i];
      if (reason != FinishReason::kNotFinished && reason != FinishReason::kCancelled &&
          reason != FinishReason::kError) {
        completed.push_back(static_cast<int32_t>(i));
      }
    }
    return completed;
  }

  std::vector<int32_t> inputLengths() const { return context.effectivePrefillLengths; }

  // ------------------------------------------------------------ observation

  State capture() const {
    State s = test::captureBackend(*runtime);
    if (facade) {
      if (std::vector<int32_t> const* starts = facade->prefillStarts()) {
        s.requests.insert(s.requests.end(), starts->begin(), starts->end());
      }
    }
    if (coordinator != nullptr) {
      test::appendRequestView(*coordinator, coordinatorRequest, s.requests);
    } else {
      test::appendRequestView(*swa, swaRequest, s.requests);
    }
    return s;
  }

  /// Invariants that hold after every call, failed or not.
  void expectConsistent(std::string const& where) const {
    for (KVPageTable const* table : {runtime->fullPageTable(), runtime->swaPageTable()}) {
      std::string error;
      EXPECT_TRUE(table == nullptr || table->checkInvariants(&error)) << where << ": " << error;
    }
    if (coordinator != nullptr) {
      SCOPED_TRACE(where);
      test::expectManagerInvariants(coordinator->manager());
      if (coordinatorRequest.valid()) {
        KVPageTable const& table = *runtime->fullPageTable();
        for (int32_t i = 0; i < coordinator->batchSize(coordinatorRequest); ++i) {
          CacheSlot const slot = context.residentRefs.at(static_cast<std::size_t>(i)).slot;
          std::span<PageId const> const pages = coordinator->basePages(coordinatorRequest, i);
          auto const live = static_cast<std::size_t>(table.liveEntryCount(slot));
          EXPECT_TRUE(live == 0 ||
                      (live == pages.size() &&
                       std::equal(pages.begin(), pages.end(), table.hostRow(slot).begin())))
              << where << ": row " << slot << " maps other pages than its lease";
        }
      }
      return;
    }
    int32_t held = 0;
    if (swaRequest.valid()) {
      for (int32_t i = 0; i < swa->batchSize(swaRequest); ++i) {
        held += swa->state(swaRequest, i).heldPages();
      }
      EXPECT_EQ(swa->freePageCount() + held + swa->quarantinedPageCount(), swa->totalPageCount())
          << where << ": SWA page conservation";
    }
  }

  /// Ends everything a script left (abandon, drain), then checks that every page, row and
  /// resident is back.
  void finishAndCheck(std::string const& where) {
    syncs.disarm();
    {
      LibraryCall const scope;  // allocation faults are disarmed here; counted only
      facade.reset();
      coordinatorRequest = ContextCacheCoordinator::RequestHandle();
      swaRequest = BoundedSwaKVPageManager::RequestHandle();
      EXPECT_TRUE(runtime->shutdown()) << where << ": shutdown did not drain";
    }
    releaseRows();
    for (ResidentRef const ref : quarantinedResidents) {
      (void)runtime->residentSlots().release(ref);
    }
    quarantinedResidents.clear();
    if (joinerResident) {
      (void)runtime->residentSlots().release(*joinerResident);
      joinerResident.reset();
    }
    EXPECT_EQ(runtime->residentSlots().available(), runtime->residentSlots().capacity()) << where;
    KVPageTable const& table =
        coordinator != nullptr ? *runtime->fullPageTable() : *runtime->swaPageTable();
    for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
      EXPECT_EQ(table.liveEntryCount(slot), 0) << where << ": row " << slot << " still maps pages";
    }
    EXPECT_FALSE(table.dirty()) << where;
    if (coordinator != nullptr) {
      ContextCacheManager const& manager = coordinator->manager();
      EXPECT_EQ(manager.liveLeaseCount(), 0) << where;
      for (PageId page = 0; page < manager.pools().capacity(ResourceType::kBaseKvPage); ++page) {
        EXPECT_EQ(manager.pools().activeRefs({ResourceType::kBaseKvPage, page}), 0)
            << where << ": page " << page << " still pinned";
      }
      SCOPED_TRACE(where);
      test::expectManagerInvariants(manager);
    } else {
      EXPECT_EQ(swa->freePageCount(), swa->totalPageCount()) << where << ": SWA pages missing";
    }
  }

  /// A clean lifecycle of the reference engine on the same runtime: every byte attention would
  /// read is checked by the KV oracle; with context reuse a second request reuses the first.
  void expectCleanLifecycle(std::string const& where) {
    testing::ReferenceEngine engine(*runtime);
    std::vector<int32_t> const shared = tokenRun(40, 20000);
    testing::EngineRequest first;
    first.sequences.push_back({concatenated(shared, tokenRun(3, 21000)), 20, {}, {}, {}, -1, 0});
    first.sequences.push_back({tokenRun(23, 22000), 6, {}, {}, {}, -1, 1});
    std::deque<testing::EngineSequence> joiners;
    joiners.push_back({concatenated(shared, tokenRun(5, 23000)), 4, {}, {}, {}, -1, 2});
    bool const reuse = runtime->backend() == KVCacheBackend::kContextReuse;
    try {
      testing::RequestOutcome const outcome =
          engine.run(first, runtime->supportsSeatedAdmission() ? &joiners : nullptr);
      EXPECT_TRUE(outcome.admitted && !outcome.failed) << where << ": clean lifecycle refused";
      if (reuse) {
        testing::EngineRequest second;
        second.sequences.push_back(
            {concatenated(shared, tokenRun(9, 24000)), 3, {}, {}, {}, -1, 3});
        testing::RequestOutcome const again = engine.run(second);
        EXPECT_TRUE(again.admitted && !again.failed) << where << ": second request refused";
        EXPECT_EQ(again.sequences.at(0).prefillStart, 32) << where << ": no reuse afterwards";
      }
    } catch (Error const& error) {
      ADD_FAILURE() << where << ": clean lifecycle failed: " << error.what();
    }
    EXPECT_EQ(engine.stats().oracleMismatches, 0) << where << ": " << engine.stats().firstMismatch;
    EXPECT_GT(engine.stats().oracleChecks, 0) << where;
    EXPECT_TRUE(runtime->shutdown()) << where;
  }

  test::FaultArming syncs;
  std::unique_ptr<KVCacheRuntime> runtime;
  ContextCacheCoordinator* coordinator = nullptr;
  BoundedSwaKVPageManager* swa = nullptr;

  DecodingInferenceContext context;
  std::vector<bool> joined;  // per row: false while an in-flight admission is not finalised
  std::vector<ResidentRef> quarantinedResidents;
  std::vector<int32_t> mapping;
  int32_t newBatchSize = 0;
  Tensor deviceMapping;
  std::vector<int32_t> joinerPrompt;
  std::optional<ResidentRef> joinerResident;
  int32_t prefillStart = 0;
  int32_t stepTokens = 0;

  // The request a script drives: one of these (destroyed before the runtime).
  std::optional<ManagedKVCacheRequest> facade;
  ContextCacheCoordinator::RequestHandle coordinatorRequest;
  BoundedSwaKVPageManager::RequestHandle swaRequest;
};

// ---------------------------------------------------------------- scripts

/// What a call that threw leaves unchanged (docs/errors.md, "Out of host memory").
enum class Guarantee : uint8_t {
  /// Everything.
  kStrong,
  /// An admission may have evicted records and taken and returned pages (the free ring's order
  /// and the admission counters show the attempt); nothing stays leased, no row is bound.
  kAdmission,
  /// A decode step may have grown rows before the one whose growth failed (their pages stay
  /// leased and mapped, and the retried step does not grow them again).
  kGrowth,
};

/// One step of a script. A library step makes its calls through library(); an engine step makes
/// none (its allocations are not counted, so it is never failed). `run` returns the outcome:
/// a status, a bool or whether a request was admitted, as an integer (0 for void calls).
struct Step {
  std::string name;
  std::function<int64_t(Rig&)> run;
  Guarantee guarantee = Guarantee::kStrong;
};

/// The part of `state` a call with `guarantee` must leave unchanged when it throws.
State guaranteed(State state, Guarantee guarantee) {
  if (guarantee == Guarantee::kStrong) {
    return state;
  }
  State kept;
  kept.poisoned = state.poisoned;
  kept.activeRequests = state.activeRequests;
  kept.quarantined = state.quarantined;
  kept.liveLeases = state.liveLeases;
  if (guarantee == Guarantee::kAdmission) {
    kept.tables = std::move(state.tables);
    kept.lengths = std::move(state.lengths);
    kept.requests = std::move(state.requests);
    if (state.manager) {
      kept.manager = test::ManagerState{};
      kept.manager->active = std::move(state.manager->active);
    }
  }
  return kept;
}

int64_t done() { return 0; }
template <typename Enum>
int64_t code(Enum value) {
  return static_cast<int64_t>(value);
}

/// Failures reported so far in the running test.
int32_t failedParts() {
  return ::testing::UnitTest::GetInstance()->current_test_info()->result()->total_part_count();
}

/// What a fault run saw, summed over every step and allocation.
struct FaultSummary {
  int64_t faults = 0;     ///< runs in which the armed allocation failed
  int64_t badAllocs = 0;  ///< the call threw std::bad_alloc
  int64_t errors = 0;     ///< the call threw mkv::Error
  int64_t absorbed = 0;   ///< the call returned its clean outcome anyway
};

/// Fails every allocation of every library step of `steps`, one run per allocation (see the
/// file comment). Stops at the first run that broke a property.
FaultSummary failEveryAllocation(KVCacheRuntimeConfig const& config,
                                 std::vector<Step> const& steps) {
  FaultSummary summary;
  std::vector<int64_t> expected;
  std::vector<int64_t> allocations;
  {
    Rig clean(config);
    for (Step const& step : steps) {
      armAllocationFault(0);
      expected.push_back(step.run(clean));
      allocations.push_back(countedAllocations());
      clean.expectConsistent("clean run, " + step.name);
    }
    clean.finishAndCheck("clean run");
    clean.expectCleanLifecycle("clean run");
  }
  for (std::size_t s = 0; s < steps.size(); ++s) {
    for (int64_t n = 1; n <= allocations[s]; ++n) {
      std::string const where = steps[s].name + ", allocation " + std::to_string(n) + " of " +
                                std::to_string(allocations[s]);
      int32_t const partsBefore = failedParts();
      int64_t const liveBefore = gLiveAllocations;
      bool fired = false;
      {
        Rig rig(config);
        for (std::size_t i = 0; i < s; ++i) {
          EXPECT_EQ(steps[i].run(rig), expected[i]) << where << ": replay of " << steps[i].name;
        }
        State const before = rig.capture();
        std::optional<int64_t> outcome;
        std::string error;
        armAllocationFault(n);
        try {
          outcome = steps[s].run(rig);
        } catch (std::bad_alloc const&) {
          ++summary.badAllocs;
        } catch (Error const& thrown) {
          error = thrown.what();
          ++summary.errors;
        }
        fired = !allocationFaultPending();
        armAllocationFault(0);
        if (!fired) {
          break;  // the call allocated less than in the clean run: nothing left to fail
        }
        ++summary.faults;
        rig.expectConsistent(where);
        std::size_t resume = s + 1;
        if (!outcome) {
          State const after = guaranteed(rig.capture(), steps[s].guarantee);
          State const expectedState = guaranteed(before, steps[s].guarantee);
          EXPECT_TRUE(after == expectedState)
              << where << ": threw " << (error.empty() ? "std::bad_alloc" : error)
              << " but changed " << differences(expectedState, after);
          resume = s;  // the retry must succeed as in the clean run
        } else {
          EXPECT_EQ(*outcome, expected[s]) << where << ": the fault changed the outcome";
          ++summary.absorbed;
        }
        for (std::size_t i = resume; i < steps.size() && failedParts() == partsBefore; ++i) {
          try {
            EXPECT_EQ(steps[i].run(rig), expected[i]) << where << ", then " << steps[i].name;
          } catch (std::exception const& thrown) {
            ADD_FAILURE() << where << ", then " << steps[i].name << " threw: " << thrown.what();
          }
        }
        rig.finishAndCheck(where);
        rig.expectCleanLifecycle(where);
      }
      if (failedParts() != partsBefore) {
        break;  // one report per step
      }
      // Everything the run allocated was freed with the runtime (a failure report above would
      // itself hold allocations).
      EXPECT_EQ(gLiveAllocations, liveBefore) << where << ": heap blocks leaked";
    }
  }
  return summary;
}

KVCacheRuntimeConfig reuseConfig() {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 1;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 8 * kPage;
  config.tokensPerPage = kPage;
  config.numPages = 14;
  config.contextReuse = true;
  config.contextCache.maxRecords = 8;
  config.contextCache.eventQueueCapacity = 8;
  return config;
}

/// Bounded SWA: W = 20 tokens, M = 3 pages a window, 7 pages a row at admission.
KVCacheRuntimeConfig swaConfig() {
  KVCacheRuntimeConfig config;
  config.model.numSlidingWindowLayers = 1;
  config.model.slidingWindowTokens = 20;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.maxBatchSize = 3;
  config.maxSequenceLength = 8 * kPage;
  config.tokensPerPage = kPage;
  return config;
}

// Prompts of the context-reuse scripts (14 pages in the pool): P1 shares P0's first two blocks,
// both grow a page at the second decode step, the joiner J reuses two blocks, and the batch
// Q0 + Q1 only fits after an eviction.
std::vector<int32_t> const kP0 = tokenRun(47, 1000);
std::vector<int32_t> const kP1 = concatenated(tokenRun(32, 1000), tokenRun(15, 5000));
std::vector<int32_t> const kJ = concatenated(tokenRun(40, 1000), tokenRun(2, 6000));
std::vector<int32_t> const kK = tokenRun(20, 7000);
std::vector<int32_t> const kQ0 = tokenRun(110, 9000);
std::vector<int32_t> const kQ1 = tokenRun(70, 9500);
constexpr int32_t kJoinerLookahead = 31000;

/// The decode step in which row 1 was cancelled before it (no token) and row 0 ends with its
/// token (end of sequence).
void endRows(Rig& rig) {
  rig.context.finishReasons[1] = FinishReason::kCancelled;
  rig.sample();
  rig.context.finishReasons[0] = FinishReason::kEndOfSequence;
}

/// Engine steps shared by the scripts.
Step engineStep(std::string name, std::function<void(Rig&)> action) {
  return {"engine: " + std::move(name), [action = std::move(action)](Rig& rig) {
            action(rig);
            return done();
          }};
}

Step newRows(std::vector<std::vector<int32_t>> prompts) {
  return engineStep("new rows", [prompts = std::move(prompts)](Rig& rig) {
    rig.releaseRows();
    rig.newRows(prompts);
  });
}

Step failNextSync() {
  return engineStep("the next synchronisation fails", [](Rig& rig) { rig.syncs.failNext(); });
}

// ---------------------------------------------------------------- ContextCacheCoordinator

std::vector<Step> coordinatorScript() {
  auto begin = [](Rig& rig) {
    ContextCacheBatchAdmission admission;
    for (std::size_t i = 0; i < rig.context.residentRefs.size(); ++i) {
      ContextCacheSequenceAdmission sequence;
      sequence.tokenIds = rig.context.rawBatchedInputIds[i];
      sequence.resident = rig.context.residentRefs[i];
      admission.sequences.push_back(std::move(sequence));
    }
    auto result =
        library([&] { return rig.coordinator->beginRequest(admission, kVanilla, kStream); });
    if (result.admission) {
      rig.coordinatorRequest = std::move(result.admission->request);
    }
    return code(result.status);
  };
  auto preparePrefill = [](Rig& rig) {
    library([&] { rig.coordinator->preparePrefill(rig.coordinatorRequest); });
    return done();
  };
  auto admit = [](Rig& rig) {
    ContextCacheSequenceAdmission admission;
    admission.tokenIds = rig.joinerPrompt;
    admission.resident = *rig.joinerResident;
    auto const result = library([&] {
      return rig.coordinator->admitSequence(rig.coordinatorRequest, admission, kVanilla);
    });
    if (result.status == ContextCacheStatus::kOk) {
      rig.prefillStart = result.prefillStart;
      rig.joinerAdmitted();
    }
    return code(result.status);
  };
  auto prepareDecode = [](Rig& rig) {
    return code(library(
        [&] { return rig.coordinator->prepareDecodeStep(rig.coordinatorRequest, kVanilla); }));
  };
  auto completeDecode = [](Rig& rig) {
    auto const advances = rig.decodeAdvances();
    auto const completed = rig.completedRows();
    return code(library([&] {
      return rig.coordinator->completeDecodeStep(rig.coordinatorRequest, advances, completed);
    }));
  };
  auto finish = [](Rig& rig) {
    auto const status = library([&] { return rig.coordinator->finish(rig.coordinatorRequest); });
    rig.requestEnded(status == ContextCacheStatus::kOk);
    return code(status);
  };
  return {
      newRows({kP0, kP1}),
      {"beginRequest", begin, Guarantee::kAdmission},
      {"preparePrefill", preparePrefill},
      {"enqueuePrefillCaptures",
       [](Rig& rig) {
         library([&] { rig.coordinator->enqueuePrefillCaptures(rig.coordinatorRequest); });
         return done();
       }},
      engineStep("prefill, lookahead tokens", [](Rig& rig) { rig.sample(); }),
      {"finalizePrefillPublication",
       [](Rig& rig) {
         auto const advances = rig.prefillAdvances();
         return code(library([&] {
           return rig.coordinator->finalizePrefillPublication(rig.coordinatorRequest, advances);
         }));
       }},
      {"prepareDecodeStep", prepareDecode},
      engineStep("decode", [](Rig& rig) { rig.sample(); }),
      {"completeDecodeStep", completeDecode},
      {"prepareDecodeStep (page growth)", prepareDecode, Guarantee::kGrowth},
      engineStep("row 0 ends, row 1 cancelled", endRows),
      {"completeDecodeStep (decode-end publication)", completeDecode},
      engineStep("joiner J", [](Rig& rig) { rig.newJoiner(kJ); }),
      {"admitSequence", admit, Guarantee::kAdmission},
      {"finalizeSequenceAdmission",
       [](Rig& rig) {
         int32_t const lookahead = kJoinerLookahead;
         ContextCacheSequenceAdvance const advance{&lookahead, 1, static_cast<int32_t>(kJ.size())};
         auto const status = library([&] {
           return rig.coordinator->finalizeSequenceAdmission(rig.coordinatorRequest, 2, advance);
         });
         if (status == ContextCacheStatus::kOk) {
           rig.joined[2] = true;
           rig.context.generatedTokenIds[2] = {lookahead};
         }
         return code(status);
       }},
      engineStep("drop rows 0 and 1",
                 [](Rig& rig) {
                   rig.setMapping({-1, -1, 0});
                 }),
      {"beginBatchCompaction",
       [](Rig& rig) {
         library([&] {
           rig.coordinator->beginBatchCompaction(rig.coordinatorRequest, rig.mapping,
                                                 rig.newBatchSize, rig.deviceMapping);
         });
         return done();
       }},
      {"compactBatch",
       [](Rig& rig) {
         auto const status =
             library([&] { return rig.coordinator->compactBatch(rig.coordinatorRequest); });
         if (status == ContextCacheStatus::kOk) {
           rig.applyMapping();
         }
         return code(status);
       }},
      engineStep("joiner K", [](Rig& rig) { rig.newJoiner(kK); }),
      {"admitSequence (to retract)", admit, Guarantee::kAdmission},
      {"retractSequenceAdmission",
       [](Rig& rig) {
         bool const retracted = library(
             [&] { return rig.coordinator->retractSequenceAdmission(rig.coordinatorRequest); });
         if (retracted) {
           rig.joinerRetracted();
         }
         return static_cast<int64_t>(retracted);
       }},
      {"finish", finish},
      newRows({kQ0, kQ1}),
      {"beginRequest (evicts)", begin, Guarantee::kAdmission},
      {"preparePrefill (to abandon)", preparePrefill},
      {"abandon: the handle is destroyed",
       [](Rig& rig) {
         library([&] { rig.coordinatorRequest = ContextCacheCoordinator::RequestHandle(); });
         rig.releaseRows();
         return done();
       }},
      newRows({kP0}),
      {"beginRequest (reuse)", begin, Guarantee::kAdmission},
      {"preparePrefill (to quarantine)", preparePrefill},
      failNextSync(),
      {"finish (synchronisation fails: quarantined)", finish},
      newRows({kK}),
      {"beginRequest (poisoned)", begin},
      {"shutdown (drains)",
       [](Rig& rig) { return code(library([&] { return rig.coordinator->shutdown(); })); }},
  };
}

// ---------------------------------------------------------------- BoundedSwaKVPageManager

// The SWA manager's calls on the rig's request (shared by the two SWA scripts).
int64_t swaBegin(Rig& rig) {
  auto result = library([&] { return rig.swa->beginRequest(rig.context.residentRefs, kStream); });
  if (result.request) {
    rig.swaRequest = std::move(*result.request);
  }
  return code(result.status);
}
int64_t swaPreparePrefill(Rig& rig) {
  std::vector<int32_t> const lengths = rig.inputLengths();
  library([&] { rig.swa->preparePrefill(rig.swaRequest, lengths); });
  return done();
}
int64_t swaCompletePrefill(Rig& rig) {
  library([&] { rig.swa->completePrefill(rig.swaRequest); });
  return done();
}
int64_t swaPrepareDecode(Rig& rig) {
  return code(library([&] { return rig.swa->prepareDecodeStep(rig.swaRequest); }));
}
int64_t swaCompleteDecode(Rig& rig) {
  library([&] { rig.swa->completeDecodeStep(rig.swaRequest); });
  return done();
}
int64_t swaFinish(Rig& rig) {
  auto const status = library([&] { return rig.swa->finish(rig.swaRequest); });
  rig.requestEnded(status == SwaKVCacheStatus::kOk);
  return code(status);
}

std::vector<Step> swaScript() {
  // Row 0 maps a new page at its first decode step (32 -> 33), row 1 retires one (51 -> 52).
  return {
      newRows({tokenRun(32, 1), tokenRun(51, 1)}),
      {"beginRequest", swaBegin},
      {"preparePrefill", swaPreparePrefill},
      {"completePrefill", swaCompletePrefill},
      {"prepareDecodeStep (maps and stages a retirement)", swaPrepareDecode},
      {"completeDecodeStep (retires)", swaCompleteDecode},
      engineStep("drop row 0",
                 [](Rig& rig) {
                   rig.setMapping({-1, 0});
                 }),
      {"beginBatchCompaction",
       [](Rig& rig) {
         library([&] {
           rig.swa->beginBatchCompaction(rig.swaRequest, rig.mapping, rig.newBatchSize,
                                         rig.deviceMapping);
         });
         return done();
       }},
      {"compactBatch",
       [](Rig& rig) {
         auto const status = library([&] { return rig.swa->compactBatch(rig.swaRequest); });
         if (status == SwaKVCacheStatus::kOk) {
           rig.applyMapping();
         }
         return code(status);
       }},
      {"prepareDecodeStep", swaPrepareDecode},
      {"completeDecodeStep", swaCompleteDecode},
      {"finish", swaFinish},
      newRows({tokenRun(10, 1), tokenRun(40, 1)}),
      {"beginRequest (to abandon)", swaBegin},
      {"preparePrefill (to abandon)", swaPreparePrefill},
      {"abandon: the handle is destroyed",
       [](Rig& rig) {
         library([&] { rig.swaRequest = BoundedSwaKVPageManager::RequestHandle(); });
         rig.releaseRows();
         return done();
       }},
      newRows({tokenRun(10, 1)}),
      {"beginRequest (to quarantine)", swaBegin},
      {"preparePrefill (to quarantine)", swaPreparePrefill},
      failNextSync(),
      {"finish (synchronisation fails: quarantined)", swaFinish},
      newRows({tokenRun(5, 1)}),
      {"beginRequest (poisoned)", swaBegin},
      {"shutdown (drains)",
       [](Rig& rig) { return code(library([&] { return rig.swa->shutdown(); })); }},
  };
}

/// A long decode: the window's bindings (a std::deque) move through their first block (64 of
/// them in libstdc++'s 512-byte blocks), so one step allocates in both rows at once.
KVCacheRuntimeConfig longSwaConfig() {
  KVCacheRuntimeConfig config = swaConfig();
  config.maxBatchSize = 2;
  config.maxSequenceLength = 72 * kPage;
  return config;
}

std::vector<Step> longSwaScript() {
  std::vector<Step> steps = {
      newRows({tokenRun(32, 1), tokenRun(32, 1)}),
      {"beginRequest", swaBegin},
      {"preparePrefill", swaPreparePrefill},
      {"completePrefill", swaCompletePrefill},
  };
  for (int32_t step = 0; step < 1000; ++step) {
    steps.push_back({"prepareDecodeStep " + std::to_string(step), swaPrepareDecode});
    steps.push_back({"completeDecodeStep " + std::to_string(step), swaCompleteDecode});
  }
  steps.push_back({"finish", swaFinish});
  return steps;
}

// ---------------------------------------------------------------- ManagedKVCacheRequest

/// The facade's calls shared by its scripts: begin (the rig's rows, a vanilla request), a call
/// on the begun request, admitSequence of the rig's joiner, finish.
int64_t facadeBegin(Rig& rig) {
  LLMGenerationRequest const request;
  auto begun = library([&] {
    return ManagedKVCacheRequest::begin(rig.coordinator, rig.swa, request, rig.context, false,
                                        kVanilla,
                                        DecodingTokenStateContract::kCommittedPlusLookahead,
                                        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
  });
  if (begun) {
    rig.facade.emplace(std::move(*begun));
  }
  return static_cast<int64_t>(begun.has_value());
}

template <typename Method>
Step facadeCall(std::string name, Method method) {
  return Step{std::move(name), [method](Rig& rig) {
                return static_cast<int64_t>(library([&] { return method(*rig.facade, rig); }));
              }};
}

int64_t facadeAdmit(Rig& rig) {
  int32_t start = -1;
  ResidentRef const resident = rig.joinerResident.value_or(ResidentRef{});
  auto const status = library([&] {
    return rig.facade->admitSequence(rig.joinerPrompt, "", kVanilla, start, resident, kStream);
  });
  if (status == AdmitSequenceStatus::kAdmitted) {
    rig.prefillStart = start;
    rig.joinerAdmitted();
  }
  return code(status);
}

int64_t facadeFinish(Rig& rig) {
  bool const finished = library([&] { return rig.facade->finish(); });
  rig.requestEnded(finished);
  return static_cast<int64_t>(finished);
}

/// The facade over the backend `config` selects: the same engine loop for both. On bounded SWA
/// the joiner J prefills from 0 in two chunks (the first prepared, the rest staged by the first's
/// completion) in its 2M + 1 pages.
std::vector<Step> facadeScript(bool reuse) {
  // Only context reuse can evict for an admission (the SWA manager's is all or nothing).
  Guarantee const admission = reuse ? Guarantee::kAdmission : Guarantee::kStrong;
  auto const begin = facadeBegin;
  auto const call = [](std::string name, auto method) {
    return facadeCall(std::move(name), method);
  };
  auto preparePrefill =
      call("preparePrefill", [](ManagedKVCacheRequest& f, Rig&) { return f.preparePrefill(); });
  auto prepareDecode = call("prepareDecodeStep", [](ManagedKVCacheRequest& f, Rig& rig) {
    return f.prepareDecodeStep(rig.context, kVanilla);
  });
  auto completeDecode = call("completeDecodeStep", [](ManagedKVCacheRequest& f, Rig& rig) {
    return f.completeDecodeStep(rig.context, {});
  });
  auto const admit = facadeAdmit;
  auto const finish = facadeFinish;
  std::vector<Step> steps = {
      reuse ? newRows({kP0, kP1}) : newRows({tokenRun(32, 1), tokenRun(51, 1)}),
      {"begin", begin, admission},
      preparePrefill,
      call("prepareSwaPrefill",
           [](ManagedKVCacheRequest& f, Rig& rig) {
             return f.prepareSwaPrefill(rig.context.effectivePrefillLengths);
           }),
      call("enqueuePrefillCaptures",
           [](ManagedKVCacheRequest& f, Rig&) { return f.enqueuePrefillCaptures(); }),
      engineStep("prefill, lookahead tokens", [](Rig& rig) { rig.sample(); }),
      call("completePrefill",
           [](ManagedKVCacheRequest& f, Rig& rig) { return f.completePrefill(rig.context, {}); }),
      prepareDecode,
      engineStep("decode", [](Rig& rig) { rig.sample(); }),
      completeDecode,
      {"prepareDecodeStep (page growth)", prepareDecode.run, Guarantee::kGrowth},
      engineStep("row 0 ends, row 1 cancelled", endRows),
      completeDecode,
      engineStep("joiner J", [](Rig& rig) { rig.newJoiner(kJ); }),
      {"admitSequence", admit, admission},
      {"finalizeSequenceAdmission",
       [](Rig& rig) {
         int32_t const lookahead = kJoinerLookahead;
         bool const finalized = library([&] {
           return rig.facade->finalizeSequenceAdmission(2, lookahead,
                                                        static_cast<int32_t>(kJ.size()));
         });
         if (finalized) {
           rig.joined[2] = true;
           rig.context.generatedTokenIds[2] = {lookahead};
         }
         return static_cast<int64_t>(finalized);
       }},
      engineStep("drop the ended rows",
                 [](Rig& rig) {
                   rig.setMapping({-1, -1, 0});
                 }),
      call("beginBatchCompaction",
           [](ManagedKVCacheRequest& f, Rig& rig) {
             return f.beginBatchCompaction(rig.mapping, rig.newBatchSize, rig.deviceMapping);
           }),
      {"completeBatchCompaction",
       [](Rig& rig) {
         bool const compacted =
             library([&] { return rig.facade->completeBatchCompaction(rig.mapping); });
         if (compacted) {
           rig.applyMapping();
         }
         return static_cast<int64_t>(compacted);
       }},
      engineStep("joiner K", [](Rig& rig) { rig.newJoiner(kK); }),
      {"admitSequence (to retract)", admit, admission},
      {"retractSequenceAdmission",
       [](Rig& rig) {
         bool const retracted = library([&] { return rig.facade->retractSequenceAdmission(); });
         if (retracted) {
           rig.joinerRetracted();
         }
         return static_cast<int64_t>(retracted);
       }},
      prepareDecode,
      engineStep("decode", [](Rig& rig) { rig.sample(); }),
      completeDecode,
      {"finish", finish},
      reuse ? newRows({kQ0, kQ1}) : newRows({tokenRun(10, 1), tokenRun(40, 1)}),
      {"begin (to abandon)", begin, admission},
      preparePrefill,
      call("prepareSwaPrefill",
           [](ManagedKVCacheRequest& f, Rig& rig) {
             return f.prepareSwaPrefill(rig.context.effectivePrefillLengths);
           }),
      {"abandon: the facade is destroyed",
       [](Rig& rig) {
         library([&] { rig.facade.reset(); });
         rig.releaseRows();
         return done();
       }},
      reuse ? newRows({kP0}) : newRows({tokenRun(10, 1)}),
      {"begin (to quarantine)", begin, admission},
      preparePrefill,
      call("prepareSwaPrefill",
           [](ManagedKVCacheRequest& f, Rig& rig) {
             return f.prepareSwaPrefill(rig.context.effectivePrefillLengths);
           }),
      failNextSync(),
      {"finish (synchronisation fails: quarantined)", finish},
      newRows({tokenRun(5, 1)}),
      {"begin (poisoned)", begin},
      {"KVCacheRuntime::shutdown (drains)",
       [](Rig& rig) {
         return static_cast<int64_t>(library([&] { return rig.runtime->shutdown(); }));
       }},
  };
  if (!reuse) {
    // J's prefill in two chunks: [0, 20) prepared before its step, [20, 42) staged by the
    // first's completion (finalizeSequenceAdmission follows the step that ran it).
    auto const at = std::find_if(steps.begin(), steps.end(), [](Step const& step) {
      return step.name == "finalizeSequenceAdmission";
    });
    steps.insert(
        at, {call("preparePrefillChunk (J to 20)",
                  [](ManagedKVCacheRequest& f, Rig&) { return f.preparePrefillChunk(2, 20); }),
             prepareDecode, engineStep("decode, J's first chunk", [](Rig& rig) { rig.sample(); }),
             completeDecode,
             call("completePrefillChunk (J to 20)",
                  [](ManagedKVCacheRequest& f, Rig&) { return f.completePrefillChunk(2, 20); })});
  }
  return steps;
}

/// Bounded SWA: a joiner of 1400 tokens prefilled in 20-token chunks. Each chunk maps the pages of
/// its last window and unmaps what left it, so the row's bindings rotate through far more pages
/// than it holds (its binding list grows at the back and shrinks at the front, allocating now and
/// then); every prepare and complete call that runs out of host memory must change nothing.
std::vector<Step> longSwaJoinerScript() {
  std::vector<Step> steps = {
      newRows({tokenRun(30, 1)}),
      {"begin", facadeBegin},
      facadeCall("preparePrefill",
                 [](ManagedKVCacheRequest& f, Rig&) { return f.preparePrefill(); }),
      facadeCall("prepareSwaPrefill",
                 [](ManagedKVCacheRequest& f, Rig& rig) {
                   return f.prepareSwaPrefill(rig.context.effectivePrefillLengths);
                 }),
      engineStep("prefill, lookahead token", [](Rig& rig) { rig.sample(); }),
      facadeCall("completePrefill", [](ManagedKVCacheRequest& f,
                                       Rig& rig) { return f.completePrefill(rig.context, {}); }),
      engineStep("joiner", [](Rig& rig) { rig.newJoiner(tokenRun(1400, 1)); }),
      {"admitSequence", facadeAdmit},
  };
  for (int32_t end = 20; end < 1400; end += 20) {
    steps.push_back(facadeCall(
        "preparePrefillChunk to " + std::to_string(end),
        [end](ManagedKVCacheRequest& f, Rig&) { return f.preparePrefillChunk(1, end); }));
    steps.push_back(facadeCall(
        "completePrefillChunk to " + std::to_string(end),
        [end](ManagedKVCacheRequest& f, Rig&) { return f.completePrefillChunk(1, end); }));
  }
  steps.push_back(facadeCall("finalizeSequenceAdmission", [](ManagedKVCacheRequest& f, Rig&) {
    int32_t const lookahead = kJoinerLookahead;
    return f.finalizeSequenceAdmission(1, lookahead, 1400);
  }));
  steps.push_back({"finish", facadeFinish});
  return steps;
}

// ---------------------------------------------------------------- tests

/// Prints the summary; a script that failed fewer allocations than it is known to make proves
/// less than it claims.
void report(char const* what, FaultSummary const& summary, int64_t minimumFaults) {
  std::printf("%s: %lld allocation faults: %lld std::bad_alloc, %lld mkv::Error, %lld absorbed\n",
              what, static_cast<long long>(summary.faults),
              static_cast<long long>(summary.badAllocs), static_cast<long long>(summary.errors),
              static_cast<long long>(summary.absorbed));
  EXPECT_GE(summary.faults, minimumFaults) << what;
}

class AllocationFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
#if !MKV_ALLOCATION_FAULTS
    GTEST_SKIP() << "allocation faults need this binary's operator new; the sanitizers own it";
#endif
    auto sink = std::make_shared<spdlog::sinks::null_sink_st>();
    auto quiet = std::make_shared<spdlog::logger>("managedkv-faults", sink);
    quiet->set_level(spdlog::level::warn);  // format what the library would log
    setLogger(std::move(quiet));
  }
  void TearDown() override {
    armAllocationFault(0);
    setLogger(nullptr);
  }

  /// Runs the lifecycle of `input` once clean, counting its allocations, then once with one
  /// allocation failing at each of `points` points spread evenly over them; every run must hold.
  /// Adds the stats of the runs with a fault to `total`.
  static void runWithAllocationFaults(std::vector<uint8_t> const& input, uint64_t seed,
                                      int32_t points, LifecycleStats& total) {
    armAllocationFault(0);
    LifecycleResult const clean = runLifecycle(input);
    ASSERT_TRUE(clean.ok) << "seed " << seed << ": " << clean.failure;
    int64_t const allocations = countedAllocations();
    for (int32_t point = 1; point <= points; ++point) {
      int64_t const k = 1 + allocations * point / (points + 1);
      armAllocationFault(k);
      LifecycleResult const result = runLifecycle(input);
      armAllocationFault(0);
      ASSERT_TRUE(result.ok) << "seed " << seed << ", allocation " << k << ": " << result.failure;
      total += result.stats;
    }
  }
};

TEST_F(AllocationFaultTest, ContextCacheCoordinatorCallsFailWithoutATrace) {
  report("ContextCacheCoordinator", failEveryAllocation(reuseConfig(), coordinatorScript()), 100);
}

TEST_F(AllocationFaultTest, BoundedSwaKVPageManagerCallsFailWithoutATrace) {
  report("BoundedSwaKVPageManager", failEveryAllocation(swaConfig(), swaScript()), 10);
}

TEST_F(AllocationFaultTest, BoundedSwaDecodeStepGrowingItsBindingsFailsWithoutATrace) {
  report("BoundedSwaKVPageManager, long decode",
         failEveryAllocation(longSwaConfig(), longSwaScript()), 2);
}

TEST_F(AllocationFaultTest, FacadeOverContextReuseFailsWithoutATrace) {
  report("ManagedKVCacheRequest, context reuse",
         failEveryAllocation(reuseConfig(), facadeScript(true)), 100);
}

TEST_F(AllocationFaultTest, FacadeOverBoundedSwaFailsWithoutATrace) {
  report("ManagedKVCacheRequest, bounded SWA",
         failEveryAllocation(swaConfig(), facadeScript(false)), 10);
}

TEST_F(AllocationFaultTest, BoundedSwaJoinerChunksRotatingTheirBindingsFailWithoutATrace) {
  KVCacheRuntimeConfig config = swaConfig();
  config.maxSequenceLength = 96 * kPage;
  report("ManagedKVCacheRequest, bounded SWA, a joiner's 70 chunks",
         failEveryAllocation(config, longSwaJoinerScript()), 10);
}

/// publishHybridMtpEndpoint reserves its snapshot slots before it releases the pins of the
/// checkpoint the row restored: an allocation that fails anywhere before the endpoint's copies
/// leaves the pins (and every snapshot slot) as they were, so the boundary hidden row can still be
/// restored and the endpoint published by a retry.
TEST_F(AllocationFaultTest, AHybridMtpEndpointThatRunsOutOfHostMemoryKeepsTheHitsPins) {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 2;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.numRecurrentLayers = 2;
  config.model.recurrentStateBytes = 24;
  config.model.recurrentConvBytes = 8;
  config.maxBatchSize = 2;
  config.maxSequenceLength = 128;
  config.tokensPerPage = 16;
  config.contextReuse = true;
  config.deviceType = DeviceType::kCPU;
  KVCacheSpeculativeConfig spec;
  spec.numDraftLayers = 1;
  spec.numDraftKVHeads = 1;
  spec.draftHeadDim = 4;
  spec.boundaryHiddenWidth = 8;
  config.speculative = spec;
  config.contextCache.recurrentSnapshotPoolBytes = int64_t{4} * (2 * (24 + 8) + 8 * 2);
  config.contextCache.partialKvSnapshotPoolBytes = int64_t{4} * 3 * 2 * 16 * 4 * 2;
  std::unique_ptr<KVCacheRuntime> runtime = KVCacheRuntime::create(config);
  ContextCacheCoordinator& coordinator = *runtime->contextCache();
  constexpr DecodingKvHeadroom kHeadroom{4, 4};
  std::vector<int32_t> prompt(60);
  std::iota(prompt.begin(), prompt.end(), 100);
  auto contextOf = [&](std::vector<int32_t> tokens, ResidentRef resident) {
    DecodingInferenceContext context;
    context.activeBatchSize = 1;
    context.rawBatchedInputIds = {std::move(tokens)};
    context.generatedTokenIds = {{}};
    context.residentRefs = {resident};
    context.finishReasons = {FinishReason::kNotFinished};
    return context;
  };
  LLMGenerationRequest request;
  request.requests.resize(1);
  ResidentRef const resident = runtime->residentSlots().acquire().value();
  {  // The producer publishes the endpoint at 40.
    DecodingInferenceContext context =
        contextOf(std::vector<int32_t>(prompt.begin(), prompt.begin() + 40), resident);
    auto producer =
        ManagedKVCacheRequest::begin(&coordinator, nullptr, request, context, true, kHeadroom,
                                     DecodingTokenStateContract::kCommittedPlusLookahead,
                                     ContextCacheCommitPolicy::kPrefillStateOnly);
    ASSERT_TRUE(producer.has_value());
    ASSERT_TRUE(producer->preparePrefill());
    Tensor hidden({40, 8}, DataType::kFloat16, DeviceType::kCPU);
    ASSERT_TRUE(producer->publishHybridMtpEndpoint(0, 40, hidden, 39));
    context.generatedTokenIds[0].push_back(7);
    ASSERT_TRUE(producer->completePrefill(context, {}));
    ASSERT_TRUE(producer->finish());
  }
  DecodingInferenceContext context = contextOf(prompt, resident);
  auto consumer =
      ManagedKVCacheRequest::begin(&coordinator, nullptr, request, context, true, kHeadroom,
                                   DecodingTokenStateContract::kCommittedPlusLookahead,
                                   ContextCacheCommitPolicy::kPrefillStateOnly);
  ASSERT_TRUE(consumer.has_value());
  ASSERT_EQ(consumer->reuseTokenLength(0), 40);
  ASSERT_TRUE(consumer->preparePrefill());
  ResourcePools const& pools = coordinator.manager().pools();
  auto slotRefs = [&] {
    std::vector<int32_t> refs;
    for (ResourceType type : {ResourceType::kRecurrentSnapshot, ResourceType::kPartialKvSnapshot}) {
      for (int32_t id = 0; id < pools.capacity(type); ++id) {
        refs.push_back(pools.activeRefs({type, id}));
        refs.push_back(pools.cacheRefs({type, id}));
      }
      refs.push_back(pools.freeCount(type));
    }
    return refs;
  };
  Tensor hidden({20, 8}, DataType::kFloat16, DeviceType::kCPU);
  Tensor restored({1, 8}, DataType::kFloat16, DeviceType::kCPU);
  int64_t failures = 0;
  for (int64_t k = 1;; ++k) {
    std::vector<int32_t> const before = slotRefs();
    uint64_t const publications = coordinator.counters().hybridMtpPublications;
    armAllocationFault(k);
    bool threw = false;
    try {
      LibraryCall call;
      (void)consumer->publishHybridMtpEndpoint(0, 60, hidden, 19);
    } catch (std::bad_alloc const&) {
      threw = true;
    }
    bool const fired = !allocationFaultPending();
    armAllocationFault(0);
    if (!threw) {
      // The k-th allocation came after the copies (an absorbed publication) or never came.
      EXPECT_TRUE(!fired || coordinator.counters().hybridMtpPublications == publications);
      break;
    }
    ++failures;
    EXPECT_EQ(slotRefs(), before) << "allocation " << k;
    EXPECT_EQ(coordinator.counters().hybridMtpPublications, publications);
    EXPECT_TRUE(consumer->restoreHybridMtpBoundaryHidden(0, restored, 0))
        << "allocation " << k << ": the hit's pins are held";
  }
  EXPECT_GE(failures, 2) << "the hashing and the reservation allocate";
  context.generatedTokenIds[0].push_back(7);
  ASSERT_TRUE(consumer->completePrefill(context, {}));
  ASSERT_TRUE(consumer->finish());
  consumer.reset();
  ASSERT_TRUE(runtime->residentSlots().release(resident));
  EXPECT_TRUE(runtime->shutdown());
}

/// A hybrid joiner's admission restores the checkpoint its prompt hits and then plans its reuse
/// points, which allocates: an allocation that fails anywhere in it leaves the batch, the snapshot
/// slots and the restore counters as they were (the restore was counted before the planning once).
TEST_F(AllocationFaultTest, AHybridJoinerThatRunsOutOfHostMemoryCountsNoRestore) {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 1;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.numRecurrentLayers = 2;
  config.model.recurrentStateBytes = 24;
  config.model.recurrentConvBytes = 8;
  config.maxBatchSize = 2;
  config.maxSequenceLength = 128;
  config.tokensPerPage = 16;
  config.contextReuse = true;
  config.deviceType = DeviceType::kCPU;
  config.contextCache.checkpointInterval = 16;
  config.contextCache.recurrentSnapshotPoolBytes = int64_t{16} * 2 * (24 + 8);
  config.contextCache.partialKvSnapshotPoolBytes = int64_t{16} * 2 * 16 * 4 * 2;
  std::unique_ptr<KVCacheRuntime> runtime = KVCacheRuntime::create(config);
  ContextCacheCoordinator& coordinator = *runtime->contextCache();
  std::vector<int32_t> prompt(100);
  std::iota(prompt.begin(), prompt.end(), 100);
  std::vector<int32_t> const founderPrompt(prompt.begin(), prompt.begin() + 40);
  ResidentRef const founderSlot = runtime->residentSlots().acquire().value();
  DecodingInferenceContext context;
  context.activeBatchSize = 1;
  context.rawBatchedInputIds = {founderPrompt};
  context.generatedTokenIds = {{}};
  context.residentRefs = {founderSlot};
  context.finishReasons = {FinishReason::kNotFinished};
  LLMGenerationRequest request;
  request.requests.resize(1);
  auto founder = ManagedKVCacheRequest::begin(&coordinator, nullptr, request, context, false,
                                              DecodingKvHeadroom{1, 0},
                                              DecodingTokenStateContract::kCommittedPlusLookahead,
                                              ContextCacheCommitPolicy::kIncludingGeneratedTokens);
  ASSERT_TRUE(founder.has_value());
  ASSERT_TRUE(founder->preparePrefill());
  context.generatedTokenIds[0].push_back(7);
  ASSERT_TRUE(founder->completePrefill(context, {}));  // its prompt end, a checkpoint at 40
  ResidentRef const joinerSlot = runtime->residentSlots().acquire().value();
  ResourcePools const& pools = coordinator.manager().pools();
  auto slotRefs = [&] {
    std::vector<int32_t> refs;
    for (ResourceType type : {ResourceType::kRecurrentSnapshot, ResourceType::kPartialKvSnapshot,
                              ResourceType::kBaseKvPage}) {
      for (int32_t id = 0; id < pools.capacity(type); ++id) {
        refs.push_back(pools.activeRefs({type, id}));
        refs.push_back(pools.cacheRefs({type, id}));
      }
    }
    return refs;
  };
  int64_t failures = 0;
  for (int64_t k = 1;; ++k) {
    std::vector<int32_t> const before = slotRefs();
    ContextCacheCoordinatorCounters const counters = coordinator.counters();
    armAllocationFault(k);
    bool threw = false;
    int32_t start = -1;
    AdmitSequenceStatus status = AdmitSequenceStatus::kFailed;
    try {
      LibraryCall call;
      status = founder->admitSequence(prompt, "", DecodingKvHeadroom{1, 0}, start, joinerSlot,
                                      runtime->config().stream);
    } catch (std::bad_alloc const&) {
      threw = true;
    }
    armAllocationFault(0);
    if (!threw) {
      ASSERT_EQ(status, AdmitSequenceStatus::kAdmitted);
      EXPECT_GT(start, 0);  // a checkpoint of the founder's prompt
      EXPECT_EQ(coordinator.counters().checkpointRestores, counters.checkpointRestores + 1);
      break;
    }
    ++failures;
    EXPECT_EQ(slotRefs(), before) << "allocation " << k;
    EXPECT_EQ(coordinator.counters().checkpointRestores, counters.checkpointRestores)
        << "allocation " << k;
    EXPECT_EQ(coordinator.counters().reusePointRestores, counters.reusePointRestores);
    EXPECT_EQ(coordinator.counters().liveAdmissions, counters.liveAdmissions);
    EXPECT_EQ(founder->prefillStarts()->size(), 1U) << "allocation " << k;
  }
  EXPECT_GE(failures, 3) << "the lookup, the lease and the reuse points allocate";
  EXPECT_TRUE(founder->retractSequenceAdmission());
  ASSERT_TRUE(founder->finish());
  founder.reset();
  ASSERT_TRUE(runtime->residentSlots().release(joinerSlot));
  ASSERT_TRUE(runtime->residentSlots().release(founderSlot));
  EXPECT_TRUE(runtime->shutdown());
}

/// The lifecycle fuzzer with one allocation failing at a point spread over each lifecycle: the
/// driver drops the request whose call threw std::bad_alloc and every invariant and the KV
/// oracle must still hold, through to a teardown that finds every page back.
TEST_F(AllocationFaultTest, LifecycleFuzzerSurvivesAllocationFaults) {
  constexpr int32_t kSeeds = 30;
  constexpr int32_t kPoints = 5;
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::vector<uint8_t> const input = seededInput(seed, 600);
    ASSERT_NO_FATAL_FAILURE(runWithAllocationFaults(input, seed, kPoints, total));
  }
  std::printf("lifecycles with an allocation fault: %lld operations, %lld std::bad_alloc\n",
              static_cast<long long>(total.operations), static_cast<long long>(total.badAllocs));
  // Most armed faults fire inside a library call that lets std::bad_alloc through.
  EXPECT_GT(total.badAllocs, kSeeds * kPoints / 2);
}

// The same on the runtimes of a recurrent or draft model (the runtime byte 0xC0 + k picks hybrid
// checkpoints, speculative reuse and Hybrid-MTP in turn): captures, restores, paired growth,
// verification rounds and endpoint publications each fail somewhere without a trace.
TEST_F(AllocationFaultTest,
       LifecycleFuzzerOnHybridSpeculativeAndMtpRuntimesSurvivesAllocationFaults) {
  constexpr int32_t kSeeds = 24;
  constexpr int32_t kPoints = 5;
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::vector<uint8_t> input = seededInput(seed + 2'000'000, 600);
    input[1] = static_cast<uint8_t>(0xC0 + seed % 3);
    ASSERT_NO_FATAL_FAILURE(runWithAllocationFaults(input, seed, kPoints, total));
  }
  // (A fault inside KVCacheRuntime::create ends a lifecycle before its runtime counts.)
  EXPECT_GT(total.hybridLifecycles, kSeeds / 3 * kPoints / 2);
  EXPECT_GT(total.speculativeLifecycles, kSeeds / 3 * kPoints / 2);
  EXPECT_GT(total.mtpLifecycles, kSeeds / 3 * kPoints / 2);
  EXPECT_GT(total.badAllocs, kSeeds * kPoints / 2);
}

// The same with engine-step device writes on each of the seven runtime kinds in turn (the engine's
// flushes and the refused completions of a forgotten flush fail somewhere too).
TEST_F(AllocationFaultTest, LifecycleFuzzerWithEngineStepWritesSurvivesAllocationFaults) {
  constexpr int32_t kSeeds = 21;
  constexpr int32_t kPoints = 5;
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::vector<uint8_t> input = seededInput(seed + 4'000'000, 600);
    forceRuntime(input, static_cast<int32_t>(seed % 7));
    forceEngineStep(input, true);
    ASSERT_NO_FATAL_FAILURE(runWithAllocationFaults(input, seed, kPoints, total));
  }
  EXPECT_GT(total.engineStepLifecycles, kSeeds * kPoints / 2);
  EXPECT_GT(total.badAllocs, kSeeds * kPoints / 2);
}

// The same on the sliding-window reuse runtime: the composed request's calls fail in either half
// (the dry run of an admission, the coordinator's half, the sliding half, the window blocks'
// publication) and the request dropped after it leaves both halves and the sliding pool
// consistent.
TEST_F(AllocationFaultTest, LifecycleFuzzerOnSlidingWindowReuseSurvivesAllocationFaults) {
  constexpr int32_t kSeeds = 24;
  constexpr int32_t kPoints = 5;
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::vector<uint8_t> input = seededInput(seed + 6'000'000, 600);
    forceRuntime(input, 6);
    forceEngineStep(input, seed % 4 == 0);
    ASSERT_NO_FATAL_FAILURE(runWithAllocationFaults(input, seed, kPoints, total));
  }
  EXPECT_GT(total.slidingReuseLifecycles, kSeeds * kPoints / 2);
  EXPECT_GT(total.badAllocs, kSeeds * kPoints / 2);
}

}  // namespace
}  // namespace mkv::fuzz
