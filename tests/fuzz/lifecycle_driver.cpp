/// \file lifecycle_driver.cpp
/// The lifecycle fuzzer (see lifecycle_driver.h). Structure:
///
/// * Input: the byte string, read front to back; past its end every byte reads 0 and the run ends.
/// * Model: what the driver knows about every request it holds (stage, rows, KV it wrote) and what
///   the headers promise for each call in each stage. Every operation asks the model whether the
///   call it is about to make is valid; valid calls must succeed with the documented outcome,
///   invalid ones must throw mkv::Error and leave the observable state (Snapshot) unchanged.
/// * Checks: after every operation, the invariants of checkAll().
///
/// The driver runs on host (CPU) tensors with a tiny geometry (16-token pages, 8-byte token rows),
/// so a lifecycle of a few hundred operations takes milliseconds.

#include "fuzz/lifecycle_driver.h"

#include <fmt/format.h>
#include <spdlog/sinks/null_sink.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "fuzz/allocation_faults.h"
#include "mkv/context_cache/block_hash.h"
#include "mkv/error.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/logging.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/kv_oracle.h"

namespace mkv::fuzz {

LifecycleStats& LifecycleStats::operator+=(LifecycleStats const& other) {
  operations += other.operations;
  libraryCalls += other.libraryCalls;
  rejectedCalls += other.rejectedCalls;
  refusals += other.refusals;
  requests += other.requests;
  prefills += other.prefills;
  decodeSteps += other.decodeSteps;
  compactions += other.compactions;
  joins += other.joins;
  retractions += other.retractions;
  drops += other.drops;
  failedSynchronizations += other.failedSynchronizations;
  quarantines += other.quarantines;
  shutdowns += other.shutdowns;
  badAllocs += other.badAllocs;
  oraclePositions += other.oraclePositions;
  return *this;
}

namespace {

constexpr int32_t kPage = 16;           // tokens per page
constexpr int32_t kMaxLiveRequests = 3;  // requests the driver keeps at once (plus spent ones)
constexpr cudaStream_t kStream = nullptr;
constexpr DecodingKvHeadroom kVanilla{1, 0};

cudaStream_t foreignStream() {
  return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(0x1000));
}

uint64_t mix(uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

int32_t ceilPages(int64_t tokens) { return static_cast<int32_t>((tokens + kPage - 1) / kPage); }

/// A violated property: ends the run with a report.
struct Violation {
  std::string what;
};

/// A library call threw std::bad_alloc (allocation fault injection).
struct AllocationFailed {};

[[noreturn]] void violate(std::string what) { throw Violation{std::move(what)}; }

void expect(bool condition, std::string_view what) {
  if (!condition) {
    violate(std::string(what));
  }
}

/// expect() with a message formatted only on failure (the checks run after every operation).
template <typename... Args>
void expectf(bool condition, fmt::format_string<Args...> format, Args&&... args) {
  if (!condition) {
    violate(fmt::format(format, std::forward<Args>(args)...));
  }
}

// ---------------------------------------------------------------- input

class Input {
 public:
  explicit Input(std::span<uint8_t const> data) : mData(data) {}
  bool exhausted() const noexcept { return mNext >= mData.size(); }
  uint8_t byte() noexcept { return mNext < mData.size() ? mData[mNext++] : uint8_t{0}; }
  /// A value in [0, n), n in [1, 256].
  int32_t below(int32_t n) noexcept { return n <= 1 ? 0 : byte() % n; }
  /// True with probability about 1 / n.
  bool oneIn(int32_t n) noexcept { return below(n) == 0; }

 private:
  std::span<uint8_t const> mData;
  std::size_t mNext = 0;
};

// ---------------------------------------------------------------- synchronisation faults

/// The runtime's StreamSynchronizer: counts calls and fails them as the input and the plan say.
struct SyncControl {
  SyncFaultPlan plan;
  int64_t calls = 0;
  int64_t failures = 0;
  int32_t failNext = 0;
  bool throwNext = false;
  bool quiet = false;  // teardown: nothing fails any more

  cudaError_t operator()() {
    ++calls;
    if (quiet) {
      return cudaSuccess;
    }
    bool fail = plan.failAt > 0 && (calls == plan.failAt || (plan.persistent && calls > plan.failAt));
    if (throwNext) {
      throwNext = false;
      ++failures;
      throw std::runtime_error("injected synchronizer exception");
    }
    if (failNext > 0) {
      --failNext;
      fail = true;
    }
    if (fail) {
      ++failures;
      return cudaErrorUnknown;
    }
    return cudaSuccess;
  }
};

// ---------------------------------------------------------------- the model

enum class Via : uint8_t { kFacade, kDirect };

/// Where a request is in its lifecycle, as the driver drove it.
enum class Stage : uint8_t {
  kAdmitted,    // begun; rows not bound yet
  kPrefill,     // preparePrefill done: prefill work pending
  kIdle,        // executing, nothing pending
  kDecode,      // prepareDecodeStep done: decode work pending
  kCompaction,  // beginBatchCompaction done
  kFinishing,   // a step was refused or every row compacted away: only finish remains
  kGone,        // finished, or quarantined by a failed compaction: the backend handle is invalid
};

char const* toString(Stage stage) {
  switch (stage) {
    case Stage::kAdmitted: return "admitted";
    case Stage::kPrefill: return "prefill";
    case Stage::kIdle: return "idle";
    case Stage::kDecode: return "decode";
    case Stage::kCompaction: return "compaction";
    case Stage::kFinishing: return "finishing";
    case Stage::kGone: return "gone";
  }
  return "?";
}

/// One sequence (execution row) as the engine sees it.
struct Row {
  ResidentRef resident;
  std::vector<int32_t> prompt;
  std::vector<int32_t> generated;  // sampled tokens (the digests cover prompt + generated)
  testing::PrefixDigests digests;
  int32_t start = 0;           // prefill start (reuse length)
  int32_t materialized = 0;    // positions whose KV the engine wrote
  int32_t endpoint = 0;        // SWA: endpoint of the window (staged one while a step is pending)
  int32_t windowFrom = 0;      // SWA: endpoint whose window pages are still mapped (committed)
  bool bound = false;          // the backend mapped the row
  bool joined = true;          // false: admitted in flight, not finalised
  bool decoded = false;        // produced a token in the pending decode step
  FinishReason reason = FinishReason::kNotFinished;
};

struct Req {
  uint64_t serial = 0;
  Via via = Via::kFacade;
  Stage stage = Stage::kAdmitted;
  std::optional<ManagedKVCacheRequest> facade;
  ContextCacheCoordinator::RequestHandle coordinator;
  BoundedSwaKVPageManager::RequestHandle swa;
  std::vector<Row> rows;
  DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead;
  std::string lora;
  std::string salt;
  uint64_t seed = 0;
  bool trimmed = false;          // SWA: completePrefill ran (M + 1 pages a row)
  std::vector<int32_t> mapping;  // pending compaction
  int32_t newBatchSize = 0;
};

/// Rows of a quarantined request: their pages must keep their KV until shutdown drains them.
struct Quarantined {
  std::vector<Row> rows;
  int32_t swaPages = 0;
};

/// Everything a contract violation must leave unchanged.
struct Snapshot {
  int64_t syncCalls = 0;
  bool poisoned = false;
  int32_t activeRequests = 0;
  int32_t quarantined = 0;
  int32_t freePages = 0;
  std::vector<int32_t> refs;      // coordinator: active and cache references per page
  std::vector<int32_t> freeList;  // coordinator: the free ring
  int32_t liveLeases = 0;
  std::vector<uint64_t> records;  // LRU order
  int32_t indexed = 0;
  std::vector<uint64_t> counters;  // coordinator counters and manager metrics
  std::vector<int32_t> tables;     // host rows, device mirrors and dirty flags of every table
  std::vector<int32_t> lengths;    // active batch and KV lengths of every pool
  uint64_t deviceBytes = 0;        // digest of every KV and recurrent byte
  std::vector<int64_t> views;      // what the backends report about the requests the driver holds
  friend bool operator==(Snapshot const&, Snapshot const&) = default;
};

std::string difference(Snapshot const& a, Snapshot const& b) {
  std::string fields;
  auto note = [&](bool same, char const* name) {
    if (!same) {
      fields += fields.empty() ? name : fmt::format(", {}", name);
    }
  };
  note(a.syncCalls == b.syncCalls, "synchronisations");
  note(a.poisoned == b.poisoned, "poison");
  note(a.activeRequests == b.activeRequests, "active requests");
  note(a.quarantined == b.quarantined, "quarantine");
  note(a.freePages == b.freePages, "free pages");
  note(a.refs == b.refs, "page references");
  note(a.freeList == b.freeList, "free ring");
  note(a.liveLeases == b.liveLeases, "leases");
  note(a.records == b.records, "records");
  note(a.indexed == b.indexed, "block index");
  note(a.counters == b.counters, "counters");
  note(a.tables == b.tables, "page tables");
  note(a.lengths == b.lengths, "KV lengths");
  note(a.deviceBytes == b.deviceBytes, "device bytes");
  note(a.views == b.views, "request views");
  return fields;
}

uint64_t digestBytes(uint64_t digest, void const* data, std::size_t bytes) {
  auto const* p = static_cast<uint8_t const*>(data);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, p + i, 8);
    digest = mix(digest ^ word);
  }
  for (; i < bytes; ++i) {
    digest = mix(digest ^ p[i]);
  }
  return digest;
}

uint64_t identitySeed(std::string const& lora, std::string const& salt) {
  Hash128 const a = digestIdentity(lora);
  Hash128 const s = digestIdentity(salt);
  return mix(a.hi ^ mix(a.lo ^ mix(s.hi ^ mix(s.lo))));
}

int32_t promptToken(int32_t family, int32_t position) {
  return 100 + static_cast<int32_t>(mix(static_cast<uint64_t>(family) * 1000003u +
                                        static_cast<uint64_t>(position)) %
                                    20000);
}

int32_t sampleToken(uint64_t digest) { return 30000 + static_cast<int32_t>(digest % 10000); }

bool stoppedWithoutPublishing(FinishReason reason) {
  return reason == FinishReason::kCancelled || reason == FinishReason::kError;
}

// ---------------------------------------------------------------- the driver

class Lifecycle {
 public:
  Lifecycle(std::span<uint8_t const> data, LifecycleOptions const& options)
      : mIn(data), mOptions(options), mSync(std::make_shared<SyncControl>()) {
    mSync->plan = options.syncFaults;
  }

  LifecycleResult run() {
    LifecycleResult result;
    try {
      if (!setUp()) {
        result.stats = mStats;
        return result;
      }
      while (!mIn.exhausted() && mStats.operations < mOptions.maxOperations) {
        ++mStats.operations;
        operation();
        checkAll();
      }
      tearDown();
    } catch (Violation const& violation) {
      result.ok = false;
      result.failure = violation.what;
    } catch (std::exception const& error) {
      result.ok = false;
      result.failure = std::string("the driver failed outside a library call: ") + error.what();
    }
    if (!result.ok) {
      result.failure += "\nlast operations:\n";
      for (std::string const& line : mTrace) {
        result.failure += "  " + line + "\n";
      }
      abandonEverything();
    }
    result.stats = mStats;
    return result;
  }

 private:
  // ------------------------------------------------------------ set-up and teardown

  /// False when the runtime could not be created (allocation fault).
  bool setUp() {
    KVCacheRuntimeConfig config;
    config.tokensPerPage = kPage;
    config.maxBatchSize = 1 + mIn.below(4);
    config.deviceType = DeviceType::kCPU;
    config.stream = kStream;
    config.model.numKVHeads = 1;
    config.model.headDim = 4;
    config.model.kvDataType = DataType::kFloat16;
    config.synchronizer = [sync = mSync](cudaStream_t) { return (*sync)(); };
    int32_t const mode = mIn.below(3);
    if (mode == 1) {  // bounded SWA
      config.model.numSlidingWindowLayers = 1;
      config.model.numFullAttentionLayers = mIn.below(2);
      config.model.slidingWindowTokens = 1 + mIn.below(3 * kPage);
      int32_t const admission = BoundedSwaKVPageManager::admissionPagesPerSequence(
          config.model.slidingWindowTokens, kPage);
      int32_t const width = admission + 1 + mIn.below(4);
      config.maxSequenceLength = width * kPage - mIn.below(kPage);
      if (mIn.oneIn(2)) {
        config.numSwaPages = config.maxBatchSize * admission + mIn.below(2 * admission);
      }
    } else {  // context reuse (0) or full storage (2)
      config.model.numFullAttentionLayers = 1 + mIn.below(2);
      int32_t const width = 2 + mIn.below(5);
      config.maxSequenceLength = width * kPage - mIn.below(kPage);
      config.numPages = 2 + mIn.below(config.maxBatchSize * width + 2);
      config.contextReuse = mode == 0;
      config.contextCache.maxRecords = mIn.below(6);
      config.contextCache.verifyTokens = mIn.below(4) != 0;
      config.contextCache.eventQueueCapacity = 4 * mIn.below(2);
    }
    if (mode != 0 && mIn.oneIn(3)) {
      config.model.numRecurrentLayers = 1;
      config.model.recurrentStateBytes = 16;
      config.model.recurrentConvBytes = 8;
    }
    try {
      LibraryCall scope;
      ++mStats.libraryCalls;
      mRuntime = KVCacheRuntime::create(config);
    } catch (std::bad_alloc const&) {
      ++mStats.badAllocs;  // create failed as a whole: nothing to check
      return false;
    }
    mCoordinator = mRuntime->contextCache();
    mSwa = mRuntime->swaPageManager();
    mWidth = mRuntime->maxPagesPerSequence();
    mMaxBatch = config.maxBatchSize;
    if (mSwa != nullptr) {
      mWindow = config.model.slidingWindowTokens;
      mWindowPages = BoundedSwaKVPageManager::windowPages(mWindow, kPage);
      mSwaOracle = std::make_unique<testing::KvOracle>(*mRuntime->swaPool(),
                                                       *mRuntime->swaPageTable());
      mLengthPools.push_back(mRuntime->swaPool());
    }
    if (mRuntime->fullPool() != nullptr) {
      mFullOracle = std::make_unique<testing::KvOracle>(*mRuntime->fullPool(),
                                                        *mRuntime->fullPageTable());
      mLengthPools.push_back(mRuntime->fullPool());
    }
    mMapping = Tensor({mMaxBatch}, DataType::kInt32, DeviceType::kCPU);
    mWrongTypeMapping = Tensor({mMaxBatch}, DataType::kFloat32, DeviceType::kCPU);
    trace(fmt::format("set-up: {} backend, batch {}, {} pages a row, pool {} pages{}",
                      toString(mRuntime->backend()), mMaxBatch, mWidth, poolPages(),
                      mSwa != nullptr ? fmt::format(", window {}", mWindow) : std::string()));
    checkAll();
    return true;
  }

  /// Ends every request, shuts the backend down without faults and checks that every page is
  /// back and every row is clear.
  void tearDown() {
    mSync->quiet = true;
    mSync->failNext = 0;
    mSync->throwNext = false;
    while (!mRequests.empty()) {
      drop(0);
      checkAll();
    }
    shutdown(false);
    checkAll();
    expect(mQuarantine.empty(), "teardown: the quarantine was not drained");
    expect(!backendPoisoned(), "teardown: the backend is still poisoned after shutdown");
    if (mCoordinator != nullptr) {
      ResourcePools const& pools = mCoordinator->manager().pools();
      expect(mCoordinator->manager().liveLeaseCount() == 0, "teardown: leases are still live");
      for (PageId page = 0; page < pools.capacity(ResourceType::kBaseKvPage); ++page) {
        expectf(pools.activeRefs({ResourceType::kBaseKvPage, page}) == 0,
               "teardown: page {} is still pinned", page);
      }
    } else {
      expectf(mSwa->freePageCount() == mSwa->totalPageCount(),
             "teardown: {} of {} SWA pages free", mSwa->freePageCount(),
                         mSwa->totalPageCount());
    }
    for (CacheSlot slot = 0; slot < mainTable()->maxBatch(); ++slot) {
      expectf(mainTable()->liveEntryCount(slot) == 0,
             "teardown: row {} still maps pages", slot);
    }
    expect(mRuntime->residentSlots().available() == mMaxBatch, "teardown: residents still held");
    mRuntime.reset();
  }

  /// After a violation: drops what can be dropped without checks so that nothing terminates.
  void abandonEverything() noexcept {
    try {
      mSync->quiet = true;
      mRequests.clear();
      if (mRuntime) {
        (void)mRuntime->shutdown();
      }
      mRuntime.reset();
    } catch (...) {
    }
  }

  // ------------------------------------------------------------ small helpers

  bool coordinatorBackend() const noexcept { return mCoordinator != nullptr; }
  int32_t poolPages() const {
    return coordinatorBackend() ? mRuntime->fullPool()->numPages() : mSwa->totalPageCount();
  }
  KVPageTable* mainTable() const {
    return coordinatorBackend() ? mRuntime->fullPageTable() : mRuntime->swaPageTable();
  }
  bool backendPoisoned() const {
    return coordinatorBackend() ? mCoordinator->poisoned() : mSwa->poisoned();
  }
  int32_t maxPromptTokens() const {
    // Context reuse needs the prompt plus one headroom token in a row; SWA maps the window only.
    return coordinatorBackend() ? mWidth * kPage - 1 : mWidth * kPage;
  }

  void trace(std::string line) {
    if (mOptions.trace) {
      fmt::print(stderr, "[{}] {}\n", mStats.operations, line);
    }
    mTrace.push_back(std::move(line));
    if (mTrace.size() > 24) {
      mTrace.pop_front();
    }
  }

  /// Calls into the library: counts the call, marks the allocation-fault scope, turns a
  /// std::bad_alloc into AllocationFailed and any exception other than mkv::Error into a violation.
  template <typename Call>
  decltype(auto) library(char const* what, Call&& call) {
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

  /// A valid call: must not throw.
  template <typename Call>
  decltype(auto) accept(std::string const& what, Call&& call) {
    try {
      return library(what.c_str(), std::forward<Call>(call));
    } catch (Error const& error) {
      violate(fmt::format("{}: valid call threw mkv::Error: {}", what, error.what()));
    }
  }

  /// An invalid call: must throw mkv::Error and change nothing.
  template <typename Call>
  void reject(std::string const& what, Call&& call) {
    Snapshot const before = snapshot();
    bool threw = false;
    try {
      (void)library(what.c_str(), std::forward<Call>(call));
    } catch (Error const&) {
      threw = true;
    }
    expectf(threw, "{}: invalid call was accepted", what);
    Snapshot const after = snapshot();
    expectf(before == after,
           "{}: threw but changed {}", what, difference(before, after));
    ++mStats.rejectedCalls;
  }

  /// A call that must succeed without changing anything (no-ops and observers).
  template <typename Call>
  decltype(auto) unchanged(std::string const& what, Call&& call) {
    Snapshot const before = snapshot();
    decltype(auto) result = accept(what, std::forward<Call>(call));
    Snapshot const after = snapshot();
    expectf(before == after,
           "{}: changed {}", what, difference(before, after));
    return result;
  }

  /// Checks that a refused call changed nothing but its counters.
  void expectRefusalChangedNothing(std::string const& what, Snapshot before) {
    Snapshot after = snapshot();
    before.counters.clear();
    after.counters.clear();
    expectf(before == after,
           "{}: refused but changed {}", what, difference(before, after));
  }

  int64_t syncCalls() const { return mSync->calls; }
  int64_t syncFailures() const { return mSync->failures; }

  /// The synchronisations a call made: must be `expected`; returns whether one failed.
  bool synchronised(std::string const& what, int64_t callsBefore, int64_t failuresBefore,
                    int64_t expected) {
    int64_t const made = syncCalls() - callsBefore;
    expectf(made == expected,
           "{}: made {} synchronisations, expected {}", what, made, expected);
    bool const failed = syncFailures() != failuresBefore;
    if (failed) {
      ++mStats.failedSynchronizations;
    }
    return failed;
  }

  Req* find(uint64_t serial) {
    for (auto& req : mRequests) {
      if (req->serial == serial) {
        return req.get();
      }
    }
    return nullptr;
  }

  std::string describe(Req const& req) const {
    return fmt::format("request {} ({} {}, {} rows, {})", req.serial,
                       req.via == Via::kFacade ? "facade" : "direct",
                       coordinatorBackend() ? "coordinator" : "SWA", req.rows.size(),
                       toString(req.stage));
  }

  /// A stage in which the coordinator considers the request executing.
  static bool executing(Stage stage) {
    return stage == Stage::kPrefill || stage == Stage::kIdle || stage == Stage::kDecode ||
           stage == Stage::kCompaction;
  }
  /// Device work is pending (a finish or an abandonment synchronises).
  static bool pendingWork(Stage stage) {
    return stage == Stage::kPrefill || stage == Stage::kDecode || stage == Stage::kCompaction;
  }

  /// Pages a live SWA row holds (2M + 1 until completePrefill trims it to M + 1).
  int32_t swaRowPages(Req const& req) const {
    return req.trimmed ? mWindowPages + 1 : 2 * mWindowPages + 1;
  }

  // ------------------------------------------------------------ the engine side

  /// The runtime's view of a request.
  DecodingInferenceContext contextOf(Req const& req) const {
    DecodingInferenceContext context;
    context.stream = kStream;
    context.activeBatchSize = static_cast<int32_t>(req.rows.size());
    context.loraWeightsName = req.lora;
    for (Row const& row : req.rows) {
      context.rawBatchedInputIds.push_back(row.prompt);
      context.effectivePrefillLengths.push_back(static_cast<int32_t>(row.prompt.size()) -
                                                row.start);
      context.generatedTokenIds.push_back(row.generated);
      context.residentRefs.push_back(row.resident);
      context.finishReasons.push_back(row.reason);
    }
    return context;
  }

  void writeLength(int32_t rowIndex, int32_t length) {
    for (KVCachePool* pool : mLengthPools) {
      pool->writeLengths(rowIndex, std::span<int32_t const>(&length, 1), kStream);
    }
  }

  void setActiveBatch(int32_t batch) {
    for (KVCachePool* pool : mLengthPools) {
      pool->setActiveBatchSize(batch);
    }
  }

  /// The engine's prefill of one bound row: the reused prefix must already hold this prefix's
  /// KV; the rest is written (SWA: only the retained window; full identity layers: all of it).
  void executePrefill(Row& row, int32_t rowIndex) {
    auto const length = static_cast<int32_t>(row.prompt.size());
    if (coordinatorBackend()) {
      if (row.start > 0) {
        testing::OracleReport const reused =
            mFullOracle->verify(row.resident.slot, row.digests, 0, row.start);
        mStats.oraclePositions += reused.positionsChecked;
        expectf(reused.ok(), "reused prefix of slot {} ({} tokens): {}",
                                        row.resident.slot, row.start, reused.firstMismatch);
      }
      mFullOracle->write(row.resident.slot, row.digests, row.start, length);
    } else {
      mSwaOracle->write(row.resident.slot, row.digests, std::max(0, length - mWindow), length);
      if (mFullOracle) {
        mFullOracle->write(row.resident.slot, row.digests, 0, length);
      }
    }
    row.materialized = length;
    writeLength(rowIndex, length);
  }

  void sampleInto(Row& row) {
    int32_t const token = sampleToken(row.digests.at(row.digests.size() - 1));
    row.generated.push_back(token);
    row.digests.extendTokens(std::span<int32_t const>(&token, 1));
  }

  /// The engine's decode of one running row: writes the KV of position `materialized`.
  void executeDecode(Req& req, Row& row, int32_t rowIndex) {
    if (req.contract == DecodingTokenStateContract::kFullyCommitted) {
      sampleInto(row);  // every listed token has KV: the sampled token is written in the step
    }
    int32_t const position = row.materialized;
    if (mFullOracle) {
      mFullOracle->write(row.resident.slot, row.digests, position, position + 1);
    }
    if (mSwaOracle) {
      mSwaOracle->write(row.resident.slot, row.digests, position, position + 1);
    }
    row.materialized = position + 1;
    writeLength(rowIndex, row.materialized);
    if (req.contract == DecodingTokenStateContract::kCommittedPlusLookahead) {
      sampleInto(row);
    }
    row.decoded = true;
  }

  void verifyRow(Row const& row) {
    if (!row.bound) {
      return;
    }
    testing::OracleReport report;
    if (coordinatorBackend()) {
      report = mFullOracle->verify(row.resident.slot, row.digests, 0, row.materialized);
    } else {
      // The window of the endpoint the backend keeps, clipped to what is materialised: with a
      // window of 1 and a sampled token listed but not yet written, the window starts past the
      // last written position and nothing is checkable yet.
      int32_t const windowBegin = std::min(std::max(0, row.endpoint - mWindow), row.materialized);
      report = mSwaOracle->verify(row.resident.slot, row.digests, windowBegin, row.materialized);
      if (report.ok() && mFullOracle) {
        report = mFullOracle->verify(row.resident.slot, row.digests, 0, row.materialized);
      }
    }
    mStats.oraclePositions += report.positionsChecked;
    expectf(report.ok(), "KV oracle, slot {}: {}", row.resident.slot,
                                    report.firstMismatch);
  }

  // ------------------------------------------------------------ snapshot

  Snapshot snapshot() const {
    Snapshot s;
    s.syncCalls = mSync->calls;
    s.poisoned = backendPoisoned();
    if (coordinatorBackend()) {
      ContextCacheCoordinator const& c = *mCoordinator;
      ContextCacheManager const& m = c.manager();
      ResourcePools const& pools = m.pools();
      s.activeRequests = c.activeRequestCount();
      s.quarantined = c.quarantinedRequestCount();
      s.freePages = pools.freeCount(ResourceType::kBaseKvPage);
      for (PageId page = 0; page < pools.capacity(ResourceType::kBaseKvPage); ++page) {
        s.refs.push_back(pools.activeRefs({ResourceType::kBaseKvPage, page}));
        s.refs.push_back(pools.cacheRefs({ResourceType::kBaseKvPage, page}));
      }
      s.freeList = pools.freeList(ResourceType::kBaseKvPage);
      s.liveLeases = m.liveLeaseCount();
      for (CacheRecord const& record : m.records().lruToMru()) {
        s.records.push_back(record.id);
      }
      s.indexed = m.index().size();
      ContextCacheCoordinatorCounters const& k = c.counters();
      s.counters = {k.requests,           k.refusedRequests,     k.prefillPublications,
                    k.decodePublications, k.liveAdmissions,      k.liveAdmissionRefusals,
                    k.retractedAdmissions, k.pageGrowths,        k.growthFailures,
                    k.synchronizations,   k.quarantinedRequests};
      ContextCacheMetrics const metrics = c.metrics();
      s.counters.insert(s.counters.end(),
                        {metrics.admittedSequences, metrics.lookups, metrics.hits,
                         metrics.bypasses, metrics.failedAcquisitions, metrics.publishedRecords,
                         metrics.existingRecordsTouched, metrics.evictedRecords});
    } else {
      s.activeRequests = mSwa->activeRequestCount();
      s.quarantined = mSwa->quarantinedPageCount();
      s.freePages = mSwa->freePageCount();
    }
    for (KVPageTable const* table : {mRuntime->fullPageTable(), mRuntime->swaPageTable()}) {
      if (table == nullptr) {
        continue;
      }
      for (CacheSlot slot = 0; slot < table->maxBatch(); ++slot) {
        std::span<int32_t const> const row = table->hostRow(slot);
        s.tables.insert(s.tables.end(), row.begin(), row.end());
      }
      auto const* device = table->deviceTable().dataPointer<int32_t>();
      s.tables.insert(s.tables.end(), device, device + table->deviceTable().numel());
      s.tables.push_back(table->dirty() ? 1 : 0);
    }
    uint64_t bytes = 0;
    for (KVCachePool const* pool : {mRuntime->fullPool(), mRuntime->swaPool()}) {
      if (pool == nullptr) {
        continue;
      }
      s.lengths.push_back(pool->activeBatchSize());
      auto const* lengths = static_cast<int32_t const*>(pool->kvLengths().rawPointer());
      s.lengths.insert(s.lengths.end(), lengths, lengths + pool->maxBatchSize());
      for (int32_t layer = 0; layer < pool->numLayers(); ++layer) {
        Tensor const& buffer = pool->layer(layer);
        bytes = digestBytes(bytes, buffer.rawPointer(), static_cast<std::size_t>(buffer.sizeBytes()));
      }
    }
    if (RecurrentStatePool const* recurrent = mRuntime->recurrentState()) {
      for (int32_t layer = 0; layer < recurrent->numLayers(); ++layer) {
        for (Tensor const* buffer : {&recurrent->state(layer), &recurrent->conv(layer)}) {
          bytes = digestBytes(bytes, buffer->rawPointer(),
                              static_cast<std::size_t>(buffer->sizeBytes()));
        }
      }
    }
    s.deviceBytes = bytes;
    for (auto const& req : mRequests) {
      s.views.push_back(static_cast<int64_t>(req->serial));
      if (req->facade) {
        std::vector<int32_t> const* starts = req->facade->prefillStarts();
        if (starts != nullptr) {
          s.views.insert(s.views.end(), starts->begin(), starts->end());
        }
      }
      if (req->coordinator.valid()) {
        int32_t const batch = mCoordinator->batchSize(req->coordinator);
        s.views.push_back(batch);
        for (int32_t i = 0; i < batch; ++i) {
          s.views.push_back(mCoordinator->committedLength(req->coordinator, i));
          s.views.push_back(mCoordinator->reuseTokenLength(req->coordinator, i));
          for (PageId page : mCoordinator->basePages(req->coordinator, i)) {
            s.views.push_back(page);
          }
        }
      }
      if (req->swa.valid()) {
        int32_t const batch = mSwa->batchSize(req->swa);
        s.views.push_back(batch);
        for (int32_t i = 0; i < batch; ++i) {
          SwaSequenceState const& state = mSwa->state(req->swa, i);
          s.views.push_back(state.endpoint);
          s.views.push_back(state.pendingEndpoint.value_or(-1));
          for (SwaPageBinding const& binding : state.bindings) {
            s.views.push_back(binding.logicalPage);
            s.views.push_back(binding.page);
          }
          s.views.push_back(-2);
          s.views.insert(s.views.end(), state.reservedPages.begin(), state.reservedPages.end());
          s.views.push_back(-3);
          for (SwaPageBinding const& binding : state.pendingRetire) {
            s.views.push_back(binding.page);
          }
        }
      }
    }
    return s;
  }

  // ------------------------------------------------------------ invariants

  void checkAll() {
    checkBackend();
    checkTables();
    checkLengths();
    for (auto const& req : mRequests) {
      for (Row const& row : req->rows) {
        verifyRow(row);
      }
    }
    for (Quarantined const& quarantined : mQuarantine) {
      for (Row const& row : quarantined.rows) {
        verifyRow(row);  // no quarantined page may have been reused
      }
    }
  }

  int32_t liveRequests() const {
    int32_t live = 0;
    for (auto const& req : mRequests) {
      live += req->stage != Stage::kGone ? 1 : 0;
    }
    return live;
  }

  void checkBackend() {
    expectf(backendPoisoned() == mPoisoned,
           "backend poison is {}, expected {}", backendPoisoned(), mPoisoned);
    if (coordinatorBackend()) {
      checkCoordinator();
    } else {
      checkSwaManager();
    }
  }

  void checkCoordinator() {
    ContextCacheCoordinator const& c = *mCoordinator;
    ContextCacheManager const& m = c.manager();
    ResourcePools const& pools = m.pools();
    constexpr ResourceType kBase = ResourceType::kBaseKvPage;
    expectf(c.activeRequestCount() == liveRequests(),
           "coordinator has {} active requests, the driver {}", c.activeRequestCount(),
                       liveRequests());
    expectf(c.quarantinedRequestCount() == static_cast<int32_t>(mQuarantine.size()),
           "coordinator quarantines {} requests, the driver {}",
                       c.quarantinedRequestCount(), mQuarantine.size());
    expectf(c.counters().synchronizations == static_cast<uint64_t>(mSync->calls),
           "coordinator counts {} synchronisations, the synchroniser saw {}",
                       c.counters().synchronizations, mSync->calls);
    int32_t const capacity = pools.capacity(kBase);
    std::vector<int32_t> recordRefs(static_cast<std::size_t>(capacity), 0);
    for (CacheRecord const& record : m.records().lruToMru()) {
      expectf(record.basePagePath.size() == record.logicalBlockDigests.size(),
             "record {} has {} pages for {} blocks", record.id,
                         record.basePagePath.size(), record.logicalBlockDigests.size());
      for (std::size_t b = 0; b < record.basePagePath.size(); ++b) {
        PageId const page = record.basePagePath[b];
        expectf(page >= 0 && page < capacity,
               "record {} lists page {}", record.id, page);
        ++recordRefs[static_cast<std::size_t>(page)];
        std::optional<Hash128> const digest = m.index().digestOf(page);
        expectf(digest.has_value() && *digest == record.logicalBlockDigests[b],
               "record {} block {} on page {} is not indexed under its digest",
                           record.id, b, page);
      }
    }
    int32_t used = 0;
    int32_t reclaimable = 0;
    int32_t indexed = 0;
    for (PageId page = 0; page < capacity; ++page) {
      int32_t const active = pools.activeRefs({kBase, page});
      int32_t const cache = pools.cacheRefs({kBase, page});
      used += active > 0 || cache > 0 ? 1 : 0;
      reclaimable += cache > 0 && active == 0 ? 1 : 0;
      expectf(cache == recordRefs[static_cast<std::size_t>(page)],
             "page {} has {} cache references but {} records list it", page, cache,
                         recordRefs[static_cast<std::size_t>(page)]);
      if (m.index().digestOf(page).has_value()) {
        ++indexed;
        expectf(cache > 0, "page {} is indexed without a cache reference", page);
      }
    }
    expectf(pools.freeCount(kBase) + used == capacity,
           "page conservation: {} free + {} pinned or cached != {}",
                       pools.freeCount(kBase), used, capacity);
    expectf(pools.reclaimableCount(kBase) == reclaimable,
           "{} pages reclaimable, the pool says {}", reclaimable,
                       pools.reclaimableCount(kBase));
    expectf(m.index().size() == indexed,
           "the index holds {} digests on {} pages", m.index().size(), indexed);
    std::vector<int32_t> const ring = pools.freeList(kBase);
    expect(static_cast<int32_t>(ring.size()) == pools.freeCount(kBase), "free ring size");
    std::vector<uint8_t> inRing(static_cast<std::size_t>(capacity), 0);
    for (int32_t page : ring) {
      expectf(page >= 0 && page < capacity && inRing[static_cast<std::size_t>(page)]++ == 0,
             "free ring holds page {} twice or out of range", page);
      expectf(pools.activeRefs({kBase, page}) == 0 && pools.cacheRefs({kBase, page}) == 0,
             "free page {} has references", page);
    }
    int32_t leases = 0;
    for (auto const& req : mRequests) {
      leases += req->stage != Stage::kGone ? static_cast<int32_t>(req->rows.size()) : 0;
    }
    for (Quarantined const& quarantined : mQuarantine) {
      leases += static_cast<int32_t>(quarantined.rows.size());
    }
    expectf(m.liveLeaseCount() == leases,
           "{} live leases for {} rows", m.liveLeaseCount(), leases);
  }

  void checkSwaManager() {
    BoundedSwaKVPageManager const& s = *mSwa;
    expectf(s.activeRequestCount() == liveRequests(),
           "SWA manager has {} active requests, the driver {}", s.activeRequestCount(),
                       liveRequests());
    int32_t held = 0;
    for (auto const& req : mRequests) {
      if (req->stage == Stage::kGone) {
        continue;
      }
      int32_t const rows = static_cast<int32_t>(req->rows.size()) * swaRowPages(*req);
      held += rows;
      if (req->swa.valid()) {
        int32_t reported = 0;
        for (int32_t i = 0; i < mSwa->batchSize(req->swa); ++i) {
          SwaSequenceState const& state = mSwa->state(req->swa, i);
          reported += state.heldPages();
          Row const& row = req->rows[static_cast<std::size_t>(i)];
          expectf(state.resident == row.resident,
                 "{} row {} has resident slot {}", describe(*req), i,
                             state.resident.slot);
          expectf(state.pendingEndpoint.value_or(state.endpoint) == row.endpoint,
                 "{} row {}: endpoint {} (pending {}), expected {}", describe(*req), i,
                             state.endpoint, state.pendingEndpoint.value_or(-1), row.endpoint);
        }
        expectf(reported == rows, "{} holds {} pages, expected {}", describe(*req),
                                             reported, rows);
      }
    }
    int32_t quarantined = 0;
    for (Quarantined const& q : mQuarantine) {
      quarantined += q.swaPages;
    }
    expectf(s.quarantinedPageCount() == quarantined,
           "{} pages quarantined, expected {}", s.quarantinedPageCount(), quarantined);
    expectf(s.freePageCount() + held + quarantined == s.totalPageCount(),
           "SWA page conservation: {} free + {} held + {} quarantined != {}",
                       s.freePageCount(), held, quarantined, s.totalPageCount());
  }

  /// The bound row of `slot` (live or quarantined), or null.
  Row const* rowOf(CacheSlot slot) const {
    for (auto const& req : mRequests) {
      for (Row const& row : req->rows) {
        if (row.bound && row.resident.slot == slot) {
          return &row;
        }
      }
    }
    for (Quarantined const& q : mQuarantine) {
      for (Row const& row : q.rows) {
        if (row.bound && row.resident.slot == slot) {
          return &row;
        }
      }
    }
    return nullptr;
  }

  void checkTables() {
    for (KVPageTable const* table : {mRuntime->fullPageTable(), mRuntime->swaPageTable()}) {
      if (table == nullptr) {
        continue;
      }
      std::string error;
      expect(table->checkInvariants(&error), "page-table invariants: " + error);
      // The SWA manager clears retired entries on the host at completion and uploads them with
      // the next patch (one upload per step): only such entries may lag on the device.
      bool const lagAllowed = table == mRuntime->swaPageTable();
      expect(lagAllowed || !table->dirty(),
             "a page table is dirty after a library call (mirror not uploaded)");
      auto const width = static_cast<std::size_t>(2 * table->maxPagesPerSeq());
      auto const* device = table->deviceTable().dataPointer<int32_t>();
      for (CacheSlot slot = 0; slot < table->maxBatch(); ++slot) {
        std::span<int32_t const> const host = table->hostRow(slot);
        int32_t const* mirror = device + width * static_cast<std::size_t>(slot);
        for (std::size_t i = 0; i < width; ++i) {
          expectf(host[i] == mirror[i] || (lagAllowed && host[i] == kNoPage),
                 "row {} entry {}: device mirror {} differs from the host row {}",
                             slot, i, mirror[i], host[i]);
        }
      }
    }
    KVPageTable const& table = *mainTable();
    std::vector<int32_t> seen(static_cast<std::size_t>(table.numPages()), 0);
    // Dense rows: the last row that mapped each page, so a page live twice within one row is
    // found in O(live entries) (pages shared by several rows are legitimate reuse).
    std::vector<CacheSlot> lastRow(static_cast<std::size_t>(table.numPages()), -1);
    for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
      Row const* row = rowOf(slot);
      if (row == nullptr) {
        expectf(table.liveEntryCount(slot) == 0,
               "row {} maps pages but no bound sequence holds it", slot);
        continue;
      }
      if (coordinatorBackend()) {
        expectf(table.liveEntryCount(slot) >= ceilPages(row->materialized),
               "row {} maps {} pages for {} written positions", slot,
                           table.liveEntryCount(slot), row->materialized);
        std::span<int32_t const> const live =
            table.hostRow(slot).first(static_cast<std::size_t>(table.liveEntryCount(slot)));
        for (std::size_t p = 0; p < live.size(); ++p) {
          auto const page = static_cast<std::size_t>(live[p]);
          expectf(lastRow[page] != slot, "dense row {} maps page {} twice (entry {})", slot,
                  live[p], p);
          lastRow[page] = slot;
          ++seen[page];
        }
        continue;
      }
      // SWA: exactly the window of the committed endpoint up to the staged one is mapped.
      int32_t const from = std::max(0, row->windowFrom - mWindow) / kPage;
      int32_t const to = ceilPages(row->endpoint);
      for (int32_t p = 0; p < table.maxPagesPerSeq(); ++p) {
        PageId const page = table.entry(slot, p);
        bool const inWindow = p >= from && p < to;
        expectf((page != kNoPage) == inWindow,
               "SWA row {} logical page {} is {} (window [{}, {}))", slot, p,
                           page == kNoPage ? "unmapped" : "mapped", from, to);
        if (page != kNoPage) {
          expectf(seen[static_cast<std::size_t>(page)]++ == 0,
                 "SWA page {} is mapped twice", page);
        }
      }
    }
    if (!coordinatorBackend()) {
      // What kernels read: the device mirror never maps a page twice either.
      std::vector<uint8_t> mapped(static_cast<std::size_t>(table.numPages()), 0);
      auto const* device = table.deviceTable().dataPointer<int32_t>();
      for (int64_t i = 0; i < table.deviceTable().numel(); ++i) {
        int32_t const entry = device[i];
        if (entry != kNoPage && entry < table.numPages()) {
          expectf(mapped[static_cast<std::size_t>(entry)]++ == 0,
                 "the SWA device mirror maps page {} twice", entry);
        }
      }
    }
    if (coordinatorBackend()) {
      // A page shared by several rows is pinned by each of their leases.
      ResourcePools const& pools = mCoordinator->manager().pools();
      for (PageId page = 0; page < table.numPages(); ++page) {
        expectf(pools.activeRefs({ResourceType::kBaseKvPage, page}) >=
                   seen[static_cast<std::size_t>(page)],
               "page {} is mapped by {} rows but pinned {} times", page,
                           seen[static_cast<std::size_t>(page)],
                           pools.activeRefs({ResourceType::kBaseKvPage, page}));
      }
    }
  }

  void checkLengths() {
    Req* owner = find(mLengthOwner);
    if (owner == nullptr) {
      return;
    }
    for (KVCachePool const* pool : mLengthPools) {
      expectf(pool->activeBatchSize() == static_cast<int32_t>(owner->rows.size()),
             "KV-length tensor has {} rows, {} has {}", pool->activeBatchSize(),
                         describe(*owner), owner->rows.size());
      auto const* lengths = static_cast<int32_t const*>(pool->kvLengths().rawPointer());
      for (std::size_t i = 0; i < owner->rows.size(); ++i) {
        expectf(lengths[i] == owner->rows[i].materialized,
               "KV length of row {} is {}, expected {}", i, lengths[i],
                           owner->rows[i].materialized);
      }
    }
  }

  // ------------------------------------------------------------ operations

  enum class Op : uint8_t {
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

  /// The call that moves a request on.
  Op naturalNext(Req const& req) {
    switch (req.stage) {
      case Stage::kAdmitted: return Op::kPreparePrefill;
      case Stage::kPrefill: return mIn.oneIn(4) ? Op::kCaptures : Op::kCompletePrefill;
      case Stage::kIdle: {
        bool stopped = false;
        for (Row const& row : req.rows) {
          stopped = stopped || row.reason != FinishReason::kNotFinished;
        }
        if (!req.rows.empty() && !req.rows.back().joined) {
          return mIn.oneIn(4) ? Op::kRetract : Op::kFinalize;
        }
        if (stopped || mIn.oneIn(16)) {
          return Op::kBeginCompaction;
        }
        if (coordinatorBackend() && mIn.oneIn(6)) {
          return Op::kAdmit;
        }
        return mIn.oneIn(40) ? Op::kFinish : Op::kPrepareDecode;
      }
      case Stage::kDecode: return Op::kCompleteDecode;
      case Stage::kCompaction: return Op::kCompleteCompaction;
      case Stage::kFinishing: return Op::kFinish;
      case Stage::kGone: return mIn.oneIn(2) ? Op::kFinish : Op::kDrop;
    }
    return Op::kFinish;
  }

  /// The request an operation acts on: the input picks one; a request that cannot prefill while
  /// another executes usually yields to the executing one.
  std::size_t pickTarget() {
    auto target = static_cast<std::size_t>(mIn.below(static_cast<int32_t>(mRequests.size())));
    if (mRequests[target]->stage == Stage::kAdmitted && prefillBlockedByAnother(*mRequests[target]) &&
        !mIn.oneIn(4)) {
      for (std::size_t i = 0; i < mRequests.size(); ++i) {
        if (executing(mRequests[i]->stage)) {
          return i;
        }
      }
    }
    return target;
  }

  void operation() {
    uint8_t const selector = mIn.byte();
    Op op = Op::kBegin;
    std::size_t target = 0;
    if (!mRequests.empty() && selector >= 20) {
      if (selector < 210) {
        target = pickTarget();
        op = naturalNext(*mRequests[target]);
      } else {
        op = static_cast<Op>(mIn.below(static_cast<int32_t>(Op::kCount)));
        target = static_cast<std::size_t>(mIn.below(static_cast<int32_t>(mRequests.size())));
      }
    }
    if (op == Op::kBegin && static_cast<int32_t>(mRequests.size()) >= kMaxLiveRequests + 2) {
      op = Op::kDrop;  // keep the set of requests small
    } else if (op == Op::kBegin && !mQuarantine.empty() && mRequests.empty() && mIn.oneIn(2)) {
      op = Op::kShutdown;  // quarantined pages and residents return only at shutdown
    } else if (op == Op::kBegin && mRuntime->residentSlots().available() == 0) {
      // Every resident is busy: a quarantined request only lets go of its rows at shutdown.
      if (!mQuarantine.empty() && (mRequests.empty() || mIn.oneIn(2))) {
        op = Op::kShutdown;
      } else if (!mRequests.empty()) {
        target = pickTarget();
        op = naturalNext(*mRequests[target]);
      }
    }
    bool const bad = mIn.oneIn(8);  // corrupt the arguments of a call that would be valid
    bool const onRequest = op != Op::kBegin && op != Op::kShutdown && op != Op::kFailSync &&
                           op != Op::kStaleHandle;
    uint64_t const serial =
        onRequest && target < mRequests.size() ? mRequests[target]->serial : 0;
    try {
      dispatch(op, target, bad);
    } catch (AllocationFailed const&) {
      recoverFromAllocationFailure(serial);
    }
  }

  void dispatch(Op op, std::size_t target, bool bad) {
    switch (op) {
      case Op::kBegin: begin(bad); return;
      case Op::kShutdown: shutdown(true); return;
      case Op::kFailSync: armSyncFault(); return;
      case Op::kStaleHandle: staleHandle(); return;
      default: break;
    }
    if (target >= mRequests.size()) {
      return;
    }
    Req& req = *mRequests[target];
    switch (op) {
      case Op::kPreparePrefill: preparePrefill(req, bad); return;
      case Op::kCaptures: captures(req); return;
      case Op::kCompletePrefill: completePrefill(req, bad); return;
      case Op::kPrepareDecode: prepareDecode(req, bad); return;
      case Op::kCompleteDecode: completeDecode(req, bad); return;
      case Op::kBeginCompaction: beginCompaction(req, bad); return;
      case Op::kCompleteCompaction: completeCompaction(req, bad); return;
      case Op::kAdmit: admit(req, bad); return;
      case Op::kFinalize: finalize(req, bad); return;
      case Op::kRetract: retract(req); return;
      case Op::kFinish: finish(req); return;
      case Op::kDrop: drop(target); return;
      case Op::kObserve: observe(req); return;
      default: return;
    }
  }

  /// A library call threw std::bad_alloc: the request it was made on can no longer be trusted;
  /// drop it (abandon: release or quarantine) and let the invariants judge what is left.
  void recoverFromAllocationFailure(uint64_t serial) {
    trace("std::bad_alloc: dropping the request the call was made on");
    mPoisoned = backendPoisoned();
    for (std::size_t i = 0; i < mRequests.size(); ++i) {
      if (mRequests[i]->serial == serial) {
        drop(i);
        break;
      }
    }
    mPoisoned = backendPoisoned();
  }

  // ------------------------------------------------------------ begin

  struct BeginPlan {
    std::vector<Row> rows;
    std::string lora;
    std::string salt;
    DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead;
    ContextCacheCommitPolicy commit = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
    ContextCacheLookupPolicy lookup = ContextCacheLookupPolicy::kUseCache;
    std::vector<std::optional<ContextCacheLookupPolicy>> rowPolicies;
  };

  /// Residents currently held by the driver's rows (live or quarantined).
  std::vector<ResidentRef> busyResidents() const {
    std::vector<ResidentRef> busy;
    for (auto const& req : mRequests) {
      if (req->stage != Stage::kGone) {
        for (Row const& row : req->rows) {
          busy.push_back(row.resident);
        }
      }
    }
    for (Quarantined const& q : mQuarantine) {
      for (Row const& row : q.rows) {
        busy.push_back(row.resident);
      }
    }
    return busy;
  }

  std::vector<int32_t> makePrompt(int32_t tokens) {
    int32_t const family = mIn.below(4);
    std::vector<int32_t> prompt(static_cast<std::size_t>(tokens));
    for (int32_t i = 0; i < tokens; ++i) {
      prompt[static_cast<std::size_t>(i)] = promptToken(family, i);
    }
    if (tokens > 1 && mIn.oneIn(6)) {
      prompt.back() = promptToken(family + 7, tokens);  // same prefix, another last token
    }
    return prompt;
  }

  int32_t promptLength() {
    int32_t const limit = maxPromptTokens();
    switch (mIn.below(4)) {
      case 0: return 1 + mIn.below(std::min(limit, kPage));
      case 1: return std::min(limit, kPage * (1 + mIn.below(mWidth)));  // page aligned
      case 2: return limit - mIn.below(3);                                // near the row width
      default: return 1 + mIn.below(std::min(limit, 255));
    }
  }

  void begin(bool bad) {
    Via const via = mIn.oneIn(3) ? Via::kDirect : Via::kFacade;
    int32_t const available = mRuntime->residentSlots().available();
    if (available == 0) {
      return;  // the runtime keeps the request queued
    }
    int32_t const batch = 1 + mIn.below(available);
    BeginPlan plan;
    plan.lora = mIn.oneIn(4) ? "adapter" : "";
    plan.salt = mIn.oneIn(4) ? "tenant" : "";
    if (coordinatorBackend()) {
      if (mIn.oneIn(5)) {
        plan.contract = DecodingTokenStateContract::kFullyCommitted;
      }
      if (mIn.oneIn(5)) {
        plan.commit = ContextCacheCommitPolicy::kPrefillStateOnly;
      }
      if (mIn.oneIn(6)) {
        plan.lookup = ContextCacheLookupPolicy::kBypass;
      }
    }
    uint64_t const seed = identitySeed(plan.lora, plan.salt);
    for (int32_t i = 0; i < batch; ++i) {
      Row row;
      row.resident = *mRuntime->residentSlots().acquire();
      row.prompt = makePrompt(promptLength());
      row.digests = testing::PrefixDigests(seed);
      row.digests.extendTokens(row.prompt);
      plan.rows.push_back(std::move(row));
      std::optional<ContextCacheLookupPolicy> policy;
      if (mIn.oneIn(6)) {
        policy = mIn.oneIn(2) ? ContextCacheLookupPolicy::kBypass
                              : ContextCacheLookupPolicy::kUseCache;
      }
      plan.rowPolicies.push_back(policy);
    }
    auto release = [&]() {
      for (Row const& row : plan.rows) {
        mRuntime->residentSlots().release(row.resident);
      }
    };
    try {
      if (bad) {
        badBegin(plan, via);
      } else {
        goodBegin(plan, via, seed);
      }
    } catch (...) {
      release();
      throw;
    }
    if (!plan.rows.empty()) {  // not taken by a request
      release();
    }
  }

  LLMGenerationRequest generationOf(BeginPlan const& plan) const {
    LLMGenerationRequest generation;
    generation.loraWeightsName = plan.lora;
    generation.cacheSalt = plan.salt;
    generation.contextCacheLookupPolicy = plan.lookup;
    generation.contextCacheCommitPolicy = plan.commit;
    for (auto const& policy : plan.rowPolicies) {
      LLMGenerationRequest::Sequence sequence;
      sequence.contextCacheLookupPolicy = policy;
      generation.requests.push_back(sequence);
    }
    return generation;
  }

  DecodingInferenceContext contextOf(BeginPlan const& plan) const {
    DecodingInferenceContext context;
    context.stream = kStream;
    context.activeBatchSize = static_cast<int32_t>(plan.rows.size());
    context.loraWeightsName = plan.lora;
    for (Row const& row : plan.rows) {
      context.rawBatchedInputIds.push_back(row.prompt);
      context.residentRefs.push_back(row.resident);
      context.generatedTokenIds.emplace_back();
      context.finishReasons.push_back(FinishReason::kNotFinished);
      context.effectivePrefillLengths.push_back(static_cast<int32_t>(row.prompt.size()));
    }
    return context;
  }

  ContextCacheBatchAdmission admissionOf(BeginPlan const& plan) const {
    ContextCacheBatchAdmission admission;
    admission.tokenStateContract = plan.contract;
    admission.commitPolicy = plan.commit;
    admission.lookupPolicy = plan.lookup;
    BlockKeyExtras const extras{digestIdentity(plan.lora), digestIdentity(plan.salt)};
    for (std::size_t i = 0; i < plan.rows.size(); ++i) {
      ContextCacheSequenceAdmission sequence;
      sequence.tokenIds = plan.rows[i].prompt;
      sequence.keyExtras = extras;
      sequence.resident = plan.rows[i].resident;
      sequence.lookupPolicy = plan.rowPolicies[i];
      admission.sequences.push_back(std::move(sequence));
    }
    return admission;
  }

  std::vector<ResidentRef> residentsOf(BeginPlan const& plan) const {
    std::vector<ResidentRef> residents;
    for (Row const& row : plan.rows) {
      residents.push_back(row.resident);
    }
    return residents;
  }

  /// Whether the backend must admit the batch: the pools certainly hold it (coordinator: its cold
  /// demand fits the free pages; SWA: exactly when (2M + 1) pages a row are free).
  std::optional<bool> mustAdmit(std::vector<int32_t> const& promptLengths) const {
    if (coordinatorBackend()) {
      int64_t cold = 0;
      for (int32_t length : promptLengths) {
        cold += ceilPages(int64_t{length} + 1);
      }
      if (cold <= mCoordinator->manager().pools().freeCount(ResourceType::kBaseKvPage)) {
        return true;
      }
      return std::nullopt;  // depends on reuse and eviction
    }
    return int64_t{2 * mWindowPages + 1} * static_cast<int64_t>(promptLengths.size()) <=
           mSwa->freePageCount();
  }

  void goodBegin(BeginPlan& plan, Via via, uint64_t seed) {
    std::vector<int32_t> lengths;
    for (Row const& row : plan.rows) {
      lengths.push_back(static_cast<int32_t>(row.prompt.size()));
    }
    std::optional<bool> const must = mustAdmit(lengths);
    Snapshot const before = snapshot();
    std::string const what =
        fmt::format("begin ({}, {} rows)", via == Via::kFacade ? "facade" : "direct",
                    plan.rows.size());
    auto req = std::make_unique<Req>();
    req->serial = mNextSerial++;
    req->via = via;
    req->contract = plan.contract;
    req->lora = plan.lora;
    req->salt = plan.salt;
    req->seed = seed;
    std::optional<std::vector<int32_t>> starts;
    if (via == Via::kFacade) {
      LLMGenerationRequest const generation = generationOf(plan);
      DecodingInferenceContext const context = contextOf(plan);
      std::optional<ManagedKVCacheRequest> begun = accept(what, [&] {
        return ManagedKVCacheRequest::begin(mCoordinator, mSwa, generation, context, false,
                                            kVanilla, plan.contract, plan.commit);
      });
      if (begun) {
        req->facade.emplace(std::move(*begun));
        std::vector<int32_t> const* reported = req->facade->prefillStarts();
        starts = reported != nullptr ? *reported : std::vector<int32_t>(plan.rows.size(), 0);
      }
    } else if (coordinatorBackend()) {
      ContextCacheBatchAdmission const admission = admissionOf(plan);
      auto result = accept(what, [&] { return mCoordinator->beginRequest(admission, kVanilla, kStream); });
      expect((result.status == ContextCacheStatus::kOk) == result.admission.has_value(),
             what + ": status and admission disagree");
      if (result.admission) {
        req->coordinator = std::move(result.admission->request);
        starts = result.admission->prefillStarts;
      } else {
        expectf(result.status == (mPoisoned ? ContextCacheStatus::kPoisoned
                                           : ContextCacheStatus::kRequestFailed),
               "{}: refused with {}", what, toString(result.status));
      }
    } else {
      std::vector<ResidentRef> const residents = residentsOf(plan);
      auto result = accept(what, [&] { return mSwa->beginRequest(residents, kStream); });
      expect((result.status == SwaKVCacheStatus::kOk) == result.request.has_value(),
             what + ": status and handle disagree");
      if (result.request) {
        req->swa = std::move(*result.request);
        starts = std::vector<int32_t>(plan.rows.size(), 0);
      } else {
        expectf(result.status == (mPoisoned ? SwaKVCacheStatus::kPoisoned
                                           : SwaKVCacheStatus::kRequestFailed),
               "{}: refused with {}", what, toString(result.status));
      }
    }
    if (!starts) {
      ++mStats.refusals;
      expectf(mPoisoned || must != true,
             "{}: refused although the free pages hold the batch", what);
      expectRefusalChangedNothing(what, before);
      trace(what + ": refused");
      return;
    }
    expect(!mPoisoned, what + ": admitted by a poisoned backend");
    expect(must != false, what + ": admitted although the pool cannot hold it");
    expect(starts->size() == plan.rows.size(), what + ": prefill starts for another batch");
    for (std::size_t i = 0; i < plan.rows.size(); ++i) {
      Row& row = plan.rows[i];
      row.start = (*starts)[i];
      auto const length = static_cast<int32_t>(row.prompt.size());
      expectf(row.start >= 0 && row.start < length && row.start % kPage == 0,
             "{}: row {} starts at {} for {} tokens", what, i, row.start, length);
      bool const reusable = mRuntime->backend() == KVCacheBackend::kContextReuse &&
                            plan.rowPolicies[i].value_or(plan.lookup) ==
                                ContextCacheLookupPolicy::kUseCache;
      expectf(row.start == 0 || reusable,
             "{}: row {} reuses {} tokens on bypass", what, i, row.start);
    }
    req->rows = std::move(plan.rows);
    plan.rows.clear();
    ++mStats.requests;
    trace(fmt::format("{}: admitted as {}", what, describe(*req)));
    mRequests.push_back(std::move(req));
  }

  /// One contract violation in an otherwise valid begin.
  void badBegin(BeginPlan& plan, Via via) {
    int32_t const variant = mIn.below(12);
    std::vector<ResidentRef> const busy = busyResidents();
    auto const what = fmt::format("bad begin #{} ({})", variant,
                                  via == Via::kFacade ? "facade" : "direct");
    if (variant == 11) {
      // A resident still held by another request: kPoisoned when poisoned, else a contract error.
      if (busy.empty()) {
        return;
      }
      BeginPlan busyPlan = plan;
      busyPlan.rows[0].resident =
          busy[static_cast<std::size_t>(mIn.below(static_cast<int32_t>(busy.size())))];
      auto facadeCall = [&] {
        return ManagedKVCacheRequest::begin(mCoordinator, mSwa, generationOf(busyPlan),
                                            contextOf(busyPlan), false, kVanilla,
                                            busyPlan.contract, busyPlan.commit);
      };
      auto coordinatorCall = [&] {
        return mCoordinator->beginRequest(admissionOf(busyPlan), kVanilla, kStream);
      };
      auto swaCall = [&] { return mSwa->beginRequest(residentsOf(busyPlan), kStream); };
      if (!mPoisoned) {
        if (via == Via::kFacade) {
          reject(what, facadeCall);
        } else if (coordinatorBackend()) {
          reject(what, coordinatorCall);
        } else {
          reject(what, swaCall);
        }
        return;
      }
      Snapshot const before = snapshot();
      bool poisonedStatus = false;
      if (via == Via::kFacade) {
        poisonedStatus = !accept(what, facadeCall).has_value();
      } else if (coordinatorBackend()) {
        poisonedStatus = accept(what, coordinatorCall).status == ContextCacheStatus::kPoisoned;
      } else {
        poisonedStatus = accept(what, swaCall).status == SwaKVCacheStatus::kPoisoned;
      }
      expect(poisonedStatus, what + ": busy resident on a poisoned backend not reported as poisoned");
      expectRefusalChangedNothing(what, before);
      ++mStats.refusals;
      return;
    }
    bool const swaFacade = via == Via::kFacade && !coordinatorBackend();
    if (via == Via::kFacade) {
      LLMGenerationRequest generation = generationOf(plan);
      DecodingInferenceContext context = contextOf(plan);
      DecodingKvHeadroom headroom = kVanilla;
      bool speculative = false;
      DecodingTokenStateContract contract = plan.contract;
      ContextCacheCoordinator* coordinator = mCoordinator;
      BoundedSwaKVPageManager* swa = mSwa;
      switch (variant) {
        case 0: coordinator = nullptr; swa = nullptr; break;     // no backend
        case 1: context.activeBatchSize += 1; break;              // sizes disagree
        case 2: context.residentRefs.pop_back(); break;           // residents disagree
        case 3: speculative = true; break;                        // not a speculative deployment
        case 4: headroom = mIn.oneIn(2) ? DecodingKvHeadroom{0, 0} : DecodingKvHeadroom{1, 2}; break;
        case 5: context.stream = foreignStream(); break;
        case 6: context.residentRefs[0].epoch = 0; break;
        case 7: context.residentRefs[0].slot = mIn.oneIn(2) ? -1 : mMaxBatch; break;
        case 8:
          if (context.residentRefs.size() < 2) {
            context.residentRefs[0].slot = mMaxBatch + 3;
          } else {
            context.residentRefs[1] = context.residentRefs[0];
          }
          break;
        case 9:
          if (swaFacade) {
            contract = DecodingTokenStateContract::kFullyCommitted;  // SWA: lookahead contract only
          } else {
            context.rawBatchedInputIds[0].clear();  // empty prompt
          }
          break;
        case 10:
          if (swaFacade) {
            headroom = DecodingKvHeadroom{2, 0};  // SWA: one-token decode only
          } else if (mIn.oneIn(2)) {
            context.rawBatchedInputIds[0].resize(static_cast<std::size_t>(mWidth * kPage), 7);
          } else {
            generation.loraWeightsName = "another adapter";  // request and context disagree
          }
          break;
        default: break;
      }
      reject(what, [&] {
        return ManagedKVCacheRequest::begin(coordinator, swa, generation, context, speculative,
                                            headroom, contract, plan.commit);
      });
      return;
    }
    if (coordinatorBackend()) {
      ContextCacheBatchAdmission admission = admissionOf(plan);
      DecodingKvHeadroom headroom = kVanilla;
      cudaStream_t stream = kStream;
      switch (variant) {
        case 0: admission.sequences.clear(); break;
        case 1:
          while (static_cast<int32_t>(admission.sequences.size()) <= mMaxBatch) {
            admission.sequences.push_back(admission.sequences.back());
          }
          break;
        case 2: admission.commitPolicy = static_cast<ContextCacheCommitPolicy>(5); break;
        case 3: admission.speculativeRequest = true; break;
        case 4: headroom = mIn.oneIn(2) ? DecodingKvHeadroom{0, 0} : DecodingKvHeadroom{1, 2}; break;
        case 5: stream = foreignStream(); break;
        case 6: admission.sequences[0].resident.epoch = 0; break;
        case 7: admission.sequences[0].resident.slot = mIn.oneIn(2) ? -1 : mMaxBatch; break;
        case 8: admission.sequences[0].tokenIds.clear(); break;
        case 9: admission.sequences[0].tokenIds.resize(static_cast<std::size_t>(mWidth * kPage), 7); break;
        case 10:
          admission.sequences[0].media.resize(admission.sequences[0].tokenIds.size() + 1);
          break;
        default: break;
      }
      reject(what, [&] { return mCoordinator->beginRequest(admission, headroom, stream); });
      return;
    }
    std::vector<ResidentRef> residents = residentsOf(plan);
    if (residents.empty()) {
      return;  // a plan has at least one row (saying so spares GCC 12 -O3 a null-dereference
               // false positive on residents[0] below)
    }
    cudaStream_t stream = kStream;
    switch (variant % 6) {
      case 0: residents.clear(); break;
      case 1:
        while (static_cast<int32_t>(residents.size()) <= mMaxBatch) {
          residents.push_back(ResidentRef{static_cast<CacheSlot>(residents.size()), 1});
        }
        break;
      case 2: stream = foreignStream(); break;
      case 3: residents.at(0).epoch = 0; break;
      case 4: residents.at(0).slot = mIn.oneIn(2) ? -1 : mMaxBatch; break;
      default:
        if (residents.size() < 2) {
          residents.at(0).slot = -5;
        } else {
          residents[1] = residents[0];
        }
        break;
    }
    reject(what, [&] { return mSwa->beginRequest(residents, stream); });
  }

  // ------------------------------------------------------------ prefill

  std::vector<int32_t> swaPrefillLengths(Req const& req) const {
    std::vector<int32_t> lengths;
    for (Row const& row : req.rows) {
      lengths.push_back(static_cast<int32_t>(row.prompt.size()));
    }
    return lengths;
  }

  /// Another request may not prefill now: the coordinator executes one request at a time, and the
  /// SWA length pools follow their owner until it finishes.
  bool prefillBlockedByAnother(Req const& req) {
    for (auto const& other : mRequests) {
      if (other.get() == &req) {
        continue;
      }
      if (coordinatorBackend() ? executing(other->stage) : other->serial == mLengthOwner) {
        return true;
      }
    }
    return false;
  }

  void preparePrefill(Req& req, bool bad) {
    std::string const what = "preparePrefill on " + describe(req);
    bool const valid = req.stage == Stage::kAdmitted && !prefillBlockedByAnother(req);
    std::vector<int32_t> lengths = swaPrefillLengths(req);
    bool badLengths = false;
    if (bad && !lengths.empty()) {
      badLengths = true;
      switch (mIn.below(3)) {
        case 0: lengths.push_back(1); break;
        case 1: lengths[0] = 0; break;
        default: lengths[0] = mWidth * kPage + 1; break;
      }
    }
    if (req.via == Via::kFacade) {
      ManagedKVCacheRequest& facade = *req.facade;
      if (coordinatorBackend()) {
        if (!valid) {
          reject(what, [&] { return facade.preparePrefill(); });
          return;
        }
        expect(accept(what, [&] { return facade.preparePrefill(); }), what + " returned false");
        expect(unchanged(what + " (prepareSwaPrefill)",
                         [&] { return facade.prepareSwaPrefill(lengths); }),
               "prepareSwaPrefill on the coordinator returned false");
      } else {
        expect(unchanged(what, [&] { return facade.preparePrefill(); }),
               "preparePrefill on SWA returned false");
        if (!valid || badLengths) {
          reject(what + " (prepareSwaPrefill)", [&] { return facade.prepareSwaPrefill(lengths); });
          return;
        }
        expect(accept(what, [&] { return facade.prepareSwaPrefill(lengths); }),
               what + " returned false");
      }
    } else if (coordinatorBackend()) {
      if (!valid) {
        reject(what, [&] { mCoordinator->preparePrefill(req.coordinator); });
        return;
      }
      accept(what, [&] { mCoordinator->preparePrefill(req.coordinator); });
    } else {
      if (!valid || badLengths) {
        reject(what, [&] { mSwa->preparePrefill(req.swa, lengths); });
        return;
      }
      accept(what, [&] { mSwa->preparePrefill(req.swa, lengths); });
    }
    req.stage = Stage::kPrefill;
    mLengthOwner = req.serial;
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      Row& row = req.rows[i];
      row.bound = true;
      row.endpoint = static_cast<int32_t>(row.prompt.size());
      row.windowFrom = row.endpoint;
      executePrefill(row, static_cast<int32_t>(i));
    }
    ++mStats.prefills;
    trace(what);
  }

  void captures(Req& req) {
    std::string const what = "enqueuePrefillCaptures on " + describe(req);
    bool const valid = req.stage == Stage::kPrefill;
    if (!coordinatorBackend()) {  // the SWA manager has no captures; its facade answers true
      if (req.via == Via::kFacade) {
        expect(unchanged(what, [&] { return req.facade->enqueuePrefillCaptures(); }),
               what + " returned false");
      }
      return;
    }
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->enqueuePrefillCaptures();
      }
      mCoordinator->enqueuePrefillCaptures(req.coordinator);
      return true;
    };
    if (!valid) {
      reject(what, call);
      return;
    }
    expect(unchanged(what, call), what + " returned false");  // attention only: nothing to capture
  }

  void completePrefill(Req& req, bool bad) {
    std::string const what = "completePrefill on " + describe(req);
    bool const valid = req.stage == Stage::kPrefill;
    // The engine samples the lookahead tokens after its prefill synchronisation.
    std::vector<Row> sampled = req.rows;
    if (req.contract == DecodingTokenStateContract::kCommittedPlusLookahead &&
        (valid || mIn.oneIn(2))) {
      for (Row& row : sampled) {
        if (row.generated.empty()) {
          sampleInto(row);
        }
      }
    }
    std::swap(sampled, req.rows);
    DecodingInferenceContext context = contextOf(req);
    std::swap(sampled, req.rows);
    std::vector<int32_t> common;
    int32_t const variant = !bad ? -1 : req.rows.empty() ? 0 : mIn.below(4);
    if (variant == 0) {
      common.push_back(1);  // common state lengths are for speculative requests
    } else if (variant == 1 && !context.generatedTokenIds.empty()) {
      context.generatedTokenIds[0].push_back(5);  // two tokens after a prefill
    } else if (variant == 2) {
      context.generatedTokenIds.emplace_back();  // more rows than the batch
      context.rawBatchedInputIds.emplace_back(1, 1);
    }
    bool const swaFacade = req.via == Via::kFacade && !coordinatorBackend();
    // The SWA facade reads only the context's row count (common lengths and tokens it ignores).
    bool const badArguments =
        req.via == Via::kFacade && (swaFacade ? variant == 2 : variant >= 0 && variant <= 2);
    std::vector<ContextCacheSequenceAdvance> advances;
    for (Row const& row : sampled) {
      if (req.contract == DecodingTokenStateContract::kCommittedPlusLookahead) {
        advances.push_back({row.generated.empty() ? nullptr : &row.generated.back(), 1,
                            static_cast<int32_t>(row.prompt.size())});
      } else {
        advances.push_back({nullptr, 0, static_cast<int32_t>(row.prompt.size())});
      }
    }
    bool badAdvances = false;
    if (req.via == Via::kDirect && coordinatorBackend() && variant >= 0) {
      badAdvances = true;
      switch (variant) {
        case 0: break;  // common lengths given
        case 1: advances.pop_back(); break;
        case 2: advances[0].committedStateLength -= 1; break;
        default: advances[0].acceptedTokenCount += 1; break;
      }
      if (variant != 0) {
        common.clear();
      }
    }
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->completePrefill(context, common);
      }
      if (coordinatorBackend()) {
        return mCoordinator->finalizePrefillPublication(req.coordinator, advances, common) ==
               ContextCacheStatus::kOk;
      }
      mSwa->completePrefill(req.swa);
      return true;
    };
    if (!valid || badArguments || badAdvances) {
      reject(what, call);
      return;
    }
    expect(accept(what, call), what + " returned false");
    req.rows = std::move(sampled);
    req.stage = Stage::kIdle;
    req.trimmed = true;
    trace(what);
  }

  // ------------------------------------------------------------ decode

  /// Whether prepareDecodeStep must succeed: no row passes the row width and (coordinator) the
  /// growth fits the free plus reclaimable pages.
  bool decodeFits(Req const& req, int32_t baseExtra) const {
    int64_t growth = 0;
    for (Row const& row : req.rows) {
      if (coordinatorBackend()) {
        int32_t const committed = row.joined ? row.materialized : row.start;
        int32_t const required = ceilPages(int64_t{committed} + baseExtra);
        if (required > mWidth) {
          return false;
        }
        growth += std::max(0, required - mappedPages(row));
      } else if (ceilPages(int64_t{row.endpoint} + 1) > mWidth) {
        return false;
      }
    }
    if (!coordinatorBackend()) {
      return true;
    }
    ResourcePools const& pools = mCoordinator->manager().pools();
    return growth <= pools.freeCount(ResourceType::kBaseKvPage) +
                         pools.reclaimableCount(ResourceType::kBaseKvPage);
  }

  int32_t mappedPages(Row const& row) const {
    return mRuntime->fullPageTable()->liveEntryCount(row.resident.slot);
  }

  void prepareDecode(Req& req, bool bad) {
    std::string const what = "prepareDecodeStep on " + describe(req);
    bool const valid = req.stage == Stage::kIdle;
    // Cancellations reach the backend with the step (no token for those rows).
    std::vector<FinishReason> reasons;
    for (Row& row : req.rows) {
      reasons.push_back(row.reason);
      if (valid && row.reason == FinishReason::kNotFinished && row.joined && mIn.oneIn(12)) {
        row.reason = FinishReason::kCancelled;
      }
    }
    auto restore = [&]() {
      for (std::size_t i = 0; i < req.rows.size(); ++i) {
        req.rows[i].reason = reasons[i];
      }
    };
    DecodingKvHeadroom headroom = kVanilla;
    if (coordinatorBackend() && mIn.oneIn(4)) {
      headroom.baseExtraTokens = 2;
    }
    DecodingInferenceContext context = contextOf(req);
    bool badArguments = false;
    if (bad) {
      badArguments = true;
      if (mIn.oneIn(2)) {
        headroom = mIn.oneIn(2) ? DecodingKvHeadroom{0, 0} : DecodingKvHeadroom{1, 3};
      } else if (req.via == Via::kFacade && coordinatorBackend()) {
        context.generatedTokenIds.emplace_back();
      } else {
        headroom = DecodingKvHeadroom{-1, 0};
      }
    }
    if (!coordinatorBackend() && headroom != kVanilla && req.via == Via::kFacade) {
      badArguments = true;  // the SWA facade needs {1, 0}
    }
    auto call = [&]() -> bool {
      if (req.via == Via::kFacade) {
        return req.facade->prepareDecodeStep(context, headroom);
      }
      if (coordinatorBackend()) {
        return mCoordinator->prepareDecodeStep(req.coordinator, headroom) ==
               ContextCacheStatus::kOk;
      }
      return mSwa->prepareDecodeStep(req.swa) == SwaKVCacheStatus::kOk;  // takes no headroom
    };
    bool const directSwa = req.via == Via::kDirect && !coordinatorBackend();
    if (!valid || (badArguments && !directSwa)) {
      restore();
      reject(what, call);
      return;
    }
    bool const fits = decodeFits(req, headroom.baseExtraTokens);
    bool const prepared = accept(what, call);
    expectf(prepared == fits, "{}: returned {}, expected {}", what, prepared, fits);
    if (!prepared) {
      ++mStats.refusals;
      req.stage = Stage::kFinishing;
      trace(what + ": refused, request finishing");
      return;
    }
    req.stage = Stage::kDecode;
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      Row& row = req.rows[i];
      row.decoded = false;
      if (!coordinatorBackend()) {
        row.windowFrom = row.endpoint;
        ++row.endpoint;  // the manager moves every sequence's window
      }
      if (row.reason == FinishReason::kNotFinished && row.joined) {
        executeDecode(req, row, static_cast<int32_t>(i));
      }
    }
    ++mStats.decodeSteps;
    trace(what);
  }

  void completeDecode(Req& req, bool bad) {
    std::string const what = "completeDecodeStep on " + describe(req);
    bool valid = req.stage == Stage::kDecode;
    // The engine's sampling decided which rows finished with their token.
    std::vector<Row> rows = req.rows;
    std::vector<int32_t> completed;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      Row& row = rows[i];
      if (row.decoded && mIn.oneIn(6)) {
        row.reason = mIn.oneIn(2) ? FinishReason::kEndOfSequence : FinishReason::kLength;
      }
      if (row.decoded && row.reason != FinishReason::kNotFinished &&
          !stoppedWithoutPublishing(row.reason)) {
        completed.push_back(static_cast<int32_t>(i));
      }
      // A row that stopped earlier and was not compacted away produced no token: the runtime must
      // report it cancelled or errored (facade on the coordinator).
      if (!row.decoded && row.joined && !stoppedWithoutPublishing(row.reason) &&
          row.reason != FinishReason::kNotFinished && !mIn.oneIn(8)) {
        row.reason = FinishReason::kError;
      }
    }
    bool const facadeCoordinator = req.via == Via::kFacade && coordinatorBackend();
    if (facadeCoordinator && valid) {
      for (Row const& row : rows) {
        if (row.joined && !row.decoded && !stoppedWithoutPublishing(row.reason)) {
          valid = false;  // "row produced no token but is not cancelled or errored"
        }
      }
    }
    std::swap(rows, req.rows);
    DecodingInferenceContext context = contextOf(req);
    std::swap(rows, req.rows);
    std::vector<ContextCacheSequenceAdvance> advances;
    for (Row const& row : rows) {
      if (row.decoded) {
        advances.push_back({&row.generated.back(), 1, row.materialized});
      } else {
        advances.push_back({nullptr, 0, kHoldCommittedStateLength});
      }
    }
    std::vector<int32_t> common;
    bool badArguments = false;
    if (bad) {
      // Without rows only the common lengths can be wrong.
      int32_t const variant = rows.empty() ? 2 : mIn.below(5);
      if (facadeCoordinator) {
        badArguments = true;
        if (variant <= 2) {
          common.push_back(1);
        } else {
          context.finishReasons.pop_back();
        }
      } else if (req.via == Via::kDirect && coordinatorBackend()) {
        badArguments = true;
        switch (variant) {
          case 0: advances.pop_back(); break;
          case 1: completed.push_back(static_cast<int32_t>(rows.size())); break;
          case 2: common.push_back(1); break;
          case 3:
            if (!completed.empty()) {
              completed.push_back(completed.front());
            } else {
              advances[0] = {nullptr, 0, 0};  // a zero advance without the hold sentinel
            }
            break;
          default:
            if (rows[0].decoded) {
              advances[0].committedStateLength += 1;
            } else {
              advances[0] = {nullptr, 0, 0};
            }
            break;
        }
      }
    }
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->completeDecodeStep(context, common);
      }
      if (coordinatorBackend()) {
        return mCoordinator->completeDecodeStep(req.coordinator, advances, completed, common) ==
               ContextCacheStatus::kOk;
      }
      mSwa->completeDecodeStep(req.swa);
      return true;
    };
    if (!valid || badArguments) {
      reject(what, call);
      return;
    }
    expect(accept(what, call), what + " returned false");
    req.rows = std::move(rows);
    for (Row& row : req.rows) {
      row.decoded = false;
      row.windowFrom = row.endpoint;
    }
    req.stage = Stage::kIdle;
    trace(what);
  }

  // ------------------------------------------------------------ compaction

  void beginCompaction(Req& req, bool bad) {
    std::string const what = "beginBatchCompaction on " + describe(req);
    bool const valid = req.stage == Stage::kIdle && !req.rows.empty();
    std::vector<int32_t> mapping(req.rows.size(), -1);
    int32_t survivors = 0;
    bool const randomDrop = mIn.oneIn(4);
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      bool const dropped = randomDrop ? mIn.oneIn(3) : req.rows[i].reason != FinishReason::kNotFinished;
      if (!dropped) {
        mapping[i] = survivors++;
      }
    }
    int32_t newSize = survivors;
    Tensor* device = &mMapping;
    bool badArguments = false;
    if (bad) {
      badArguments = true;
      switch (mIn.below(6)) {
        case 0: mapping.push_back(-1); break;
        case 1: newSize += 1; break;
        case 2:
          if (survivors >= 2) {  // survivors out of order
            auto first = std::find(mapping.begin(), mapping.end(), 0);
            auto second = std::find(mapping.begin(), mapping.end(), 1);
            std::iter_swap(first, second);
          } else if (!mapping.empty()) {
            mapping[0] = static_cast<int32_t>(mapping.size());
          } else {
            newSize = -1;
          }
          break;
        case 3:
          if (!mapping.empty()) {
            mapping[0] = -2;
          } else {
            newSize = -1;
          }
          break;
        case 4: device = &mWrongTypeMapping; break;
        default: device = &mEmptyMapping; break;
      }
    }
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->beginBatchCompaction(mapping, newSize, *device);
      }
      if (coordinatorBackend()) {
        mCoordinator->beginBatchCompaction(req.coordinator, mapping, newSize, *device);
      } else {
        mSwa->beginBatchCompaction(req.swa, mapping, newSize, *device);
      }
      return true;
    };
    if (!valid || badArguments) {
      reject(what, call);
      return;
    }
    expect(accept(what, call), what + " returned false");
    req.mapping = mapping;
    req.newBatchSize = newSize;
    req.stage = Stage::kCompaction;
    trace(fmt::format("{}: keep {} of {}", what, newSize, mapping.size()));
  }

  void completeCompaction(Req& req, bool bad) {
    std::string const what = "completeBatchCompaction on " + describe(req);
    bool const valid = req.stage == Stage::kCompaction;
    std::vector<int32_t> keep = req.mapping;
    bool badArguments = false;
    if (bad && req.via == Via::kFacade) {
      badArguments = true;  // the keep mapping must be the one given to beginBatchCompaction
      if (keep.empty()) {
        keep.push_back(0);
      } else {
        keep.back() = keep.back() == -1 ? static_cast<int32_t>(keep.size()) : -1;
      }
    }
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->completeBatchCompaction(keep);
      }
      if (coordinatorBackend()) {
        return mCoordinator->compactBatch(req.coordinator) == ContextCacheStatus::kOk;
      }
      return mSwa->compactBatch(req.swa) == SwaKVCacheStatus::kOk;
    };
    if (!valid || badArguments) {
      reject(what, call);
      return;
    }
    int64_t const calls = syncCalls();
    int64_t const failures = syncFailures();
    bool const compacted = accept(what, call);
    bool const failed = synchronised(what, calls, failures, 1);
    expectf(compacted == !failed,
           "{}: returned {} after a {} synchronisation", what, compacted,
                       failed ? "failed" : "successful");
    if (failed) {
      // Dropped rows were cleared before the synchronisation; their pages stay quarantined.
      for (std::size_t i = 0; i < req.rows.size(); ++i) {
        req.rows[i].bound = req.rows[i].bound && req.mapping[i] >= 0;
      }
      quarantine(req);
      req.stage = Stage::kGone;
      trace(what + ": synchronisation failed, request quarantined");
      return;
    }
    std::vector<Row> survivors;
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      if (req.mapping[i] >= 0) {
        survivors.push_back(std::move(req.rows[i]));
      } else {
        mRuntime->residentSlots().release(req.rows[i].resident);
      }
    }
    req.rows = std::move(survivors);
    req.mapping.clear();
    req.stage = req.rows.empty() ? Stage::kFinishing : Stage::kIdle;
    ++mStats.compactions;
    trace(what);
  }

  // ------------------------------------------------------------ in-flight admission

  void admit(Req& req, bool bad) {
    std::string const what = "admitSequence on " + describe(req);
    if (!coordinatorBackend()) {
      if (req.via == Via::kFacade) {
        int32_t start = -7;
        ResidentRef const resident{0, 1};
        auto const status = unchanged(what, [&] {
          return req.facade->admitSequence({1, 2, 3}, req.lora, kVanilla, start, resident, kStream);
        });
        expect(status == ContextCacheRequest::AdmitSequenceStatus::kFailed && start == -7,
               what + ": the SWA backend admitted in flight");
      }
      return;
    }
    bool const valid = req.stage == Stage::kIdle && !req.rows.empty() &&
                       static_cast<int32_t>(req.rows.size()) < mMaxBatch &&
                       req.contract == DecodingTokenStateContract::kCommittedPlusLookahead;
    std::optional<ResidentRef> fresh = mRuntime->residentSlots().acquire();
    if (!fresh) {
      return;
    }
    Row row;
    row.resident = *fresh;
    row.prompt = makePrompt(promptLength());
    row.digests = testing::PrefixDigests(req.seed);
    row.digests.extendTokens(row.prompt);
    row.joined = false;
    ContextCacheSequenceAdmission admission;
    admission.tokenIds = row.prompt;
    admission.keyExtras = BlockKeyExtras{digestIdentity(req.lora), digestIdentity(req.salt)};
    admission.resident = row.resident;
    std::vector<int32_t> tokens = row.prompt;
    ResidentRef resident = row.resident;
    DecodingKvHeadroom headroom = kVanilla;
    cudaStream_t stream = kStream;
    bool badArguments = false;
    bool busyResident = false;
    if (bad) {
      badArguments = true;
      std::vector<ResidentRef> const busy = busyResidents();
      switch (mIn.below(6)) {
        case 0: tokens.clear(); break;
        case 1: tokens.resize(static_cast<std::size_t>(mWidth * kPage), 9); break;
        case 2: resident.epoch = 0; break;
        case 3: headroom = DecodingKvHeadroom{0, 0}; break;
        case 4:
          if (req.via == Via::kFacade) {
            stream = foreignStream();
          } else {
            resident.slot = mMaxBatch;
          }
          break;
        default:
          if (busy.empty()) {
            resident.slot = -1;
          } else {
            resident = busy.front();
            busyResident = true;
          }
          break;
      }
      admission.tokenIds = tokens;
      admission.resident = resident;
    }
    auto release = [&]() { mRuntime->residentSlots().release(*fresh); };
    int32_t start = -1;
    auto facadeCall = [&] {
      return req.facade->admitSequence(tokens, req.lora, headroom, start, resident, stream);
    };
    auto directCall = [&] {
      return mCoordinator->admitSequence(req.coordinator, admission, headroom);
    };
    try {
      // A busy resident is reported as poisoned on a poisoned coordinator (after the other checks).
      if (!valid || (badArguments && !(busyResident && mPoisoned))) {
        if (req.via == Via::kFacade) {
          reject(what, facadeCall);
        } else {
          reject(what, directCall);
        }
        release();
        return;
      }
      Snapshot const before = snapshot();
      bool const must =
          ceilPages(int64_t{static_cast<int32_t>(row.prompt.size())} + 1) <=
          mCoordinator->manager().pools().freeCount(ResourceType::kBaseKvPage);
      bool admitted = false;
      bool capacity = false;
      if (req.via == Via::kFacade) {
        auto const status = accept(what, facadeCall);
        admitted = status == ContextCacheRequest::AdmitSequenceStatus::kAdmitted;
        capacity = status == ContextCacheRequest::AdmitSequenceStatus::kNoCapacity;
        expect(!mPoisoned || status == ContextCacheRequest::AdmitSequenceStatus::kFailed,
               what + ": a poisoned coordinator did not fail the admission");
      } else {
        auto const result = accept(what, directCall);
        admitted = result.status == ContextCacheStatus::kOk;
        capacity = result.insufficientCapacity;
        start = result.prefillStart;
        expect(!mPoisoned || result.status == ContextCacheStatus::kPoisoned,
               what + ": a poisoned coordinator did not report kPoisoned");
        expect(!capacity || result.status == ContextCacheStatus::kRequestFailed,
               what + ": insufficient capacity with another status");
      }
      if (!admitted) {
        expect(mPoisoned || capacity, what + ": failed for no documented reason");
        expect(mPoisoned || !must, what + ": refused although the free pages hold the prompt");
        expectRefusalChangedNothing(what, before);
        ++mStats.refusals;
        release();
        trace(what + ": refused");
        return;
      }
      expect(!busyResident && !badArguments, what + ": admitted an invalid sequence");
    } catch (...) {
      release();
      throw;
    }
    auto const length = static_cast<int32_t>(row.prompt.size());
    expectf(start >= 0 && start < length && start % kPage == 0,
           "{}: joiner starts at {} for {} tokens", what, start, length);
    row.start = start;
    row.bound = true;
    req.rows.push_back(std::move(row));
    // The runtime seats the joiner: its KV-length row, its prefill and its lookahead token.
    setActiveBatch(static_cast<int32_t>(req.rows.size()));
    executePrefill(req.rows.back(), static_cast<int32_t>(req.rows.size()) - 1);
    sampleInto(req.rows.back());
    ++mStats.joins;
    trace(fmt::format("{}: joined at row {} from {}", what, req.rows.size() - 1, start));
  }

  void finalize(Req& req, bool bad) {
    std::string const what = "finalizeSequenceAdmission on " + describe(req);
    if (!coordinatorBackend()) {
      if (req.via == Via::kFacade) {
        int32_t const token = 1;
        expect(!unchanged(what, [&] { return req.facade->finalizeSequenceAdmission(0, token, 1); }),
               what + ": the SWA backend finalised an admission");
      }
      return;
    }
    if (req.stage == Stage::kDecode || req.stage == Stage::kCompaction) {
      return;  // allowed by the coordinator, not modelled here
    }
    auto const rows = static_cast<int32_t>(req.rows.size());
    int32_t slot = rows - 1;
    bool unjoined = rows > 0 && !req.rows.back().joined;
    if (bad || !unjoined) {
      slot = mIn.oneIn(2) ? rows : std::max(0, rows - 1);
      unjoined = slot < rows && !req.rows[static_cast<std::size_t>(slot)].joined;
    }
    bool const valid = req.stage == Stage::kIdle && unjoined;
    Row const* row = valid ? &req.rows[static_cast<std::size_t>(slot)] : nullptr;
    int32_t const lookahead = row != nullptr ? row->generated.back() : 1;
    int32_t length = row != nullptr ? static_cast<int32_t>(row->prompt.size()) : 1;
    bool badLength = false;
    if (valid && bad && mIn.oneIn(2)) {
      length += 1;
      badLength = true;
    }
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->finalizeSequenceAdmission(slot, lookahead, length);
      }
      ContextCacheSequenceAdvance const advance{&lookahead, 1, length};
      return mCoordinator->finalizeSequenceAdmission(req.coordinator, slot, advance) ==
             ContextCacheStatus::kOk;
    };
    if (!valid || (badLength && !mPoisoned)) {
      reject(what, call);
      return;
    }
    if (mPoisoned) {
      expect(!unchanged(what, call), what + ": finalised on a poisoned coordinator");
      ++mStats.refusals;
      return;
    }
    expect(accept(what, call), what + " returned false");
    req.rows[static_cast<std::size_t>(slot)].joined = true;
    trace(fmt::format("{}: row {}", what, slot));
  }

  void retract(Req& req) {
    std::string const what = "retractSequenceAdmission on " + describe(req);
    if (!coordinatorBackend()) {
      if (req.via == Via::kFacade) {
        expect(unchanged(what, [&] { return req.facade->retractSequenceAdmission(); }),
               what + ": the SWA backstop returned false");
      }
      return;
    }
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->retractSequenceAdmission();
      }
      return mCoordinator->retractSequenceAdmission(req.coordinator);
    };
    bool const possible = req.stage != Stage::kGone && req.rows.size() > 1 &&
                          !req.rows.back().joined &&
                          (req.stage == Stage::kIdle || req.stage == Stage::kFinishing);
    if (!possible) {
      // Misuse detectable before any side effect: it throws and changes nothing (no poison).
      reject(what, call);
      trace(what + ": refused");
      return;
    }
    expect(accept(what, call), what + " returned false");
    mRuntime->residentSlots().release(req.rows.back().resident);
    req.rows.pop_back();
    if (mLengthOwner == req.serial) {
      setActiveBatch(static_cast<int32_t>(req.rows.size()));  // the runtime un-seats the joiner
    }
    ++mStats.retractions;
    trace(what);
  }

  // ------------------------------------------------------------ finish, drop, shutdown

  /// Moves the rows of a request whose synchronisation failed into the quarantine.
  void quarantine(Req& req) {
    Quarantined q;
    q.swaPages = coordinatorBackend() ? 0 : static_cast<int32_t>(req.rows.size()) * swaRowPages(req);
    q.rows = std::move(req.rows);
    req.rows.clear();
    mQuarantine.push_back(std::move(q));
    mPoisoned = true;
    if (mLengthOwner == req.serial) {
      mLengthOwner = 0;
    }
    ++mStats.quarantines;
  }

  /// The request ended without quarantine: its residents return to the runtime.
  void released(Req& req) {
    for (Row const& row : req.rows) {
      mRuntime->residentSlots().release(row.resident);
    }
    req.rows.clear();
    if (mLengthOwner == req.serial) {
      mLengthOwner = 0;
    }
  }

  void finish(Req& req) {
    std::string const what = "finish on " + describe(req);
    auto call = [&] {
      if (req.via == Via::kFacade) {
        return req.facade->finish();
      }
      if (coordinatorBackend()) {
        return mCoordinator->finish(req.coordinator) == ContextCacheStatus::kOk;
      }
      return mSwa->finish(req.swa) == SwaKVCacheStatus::kOk;
    };
    if (req.via == Via::kFacade && coordinatorBackend() && req.stage == Stage::kDecode) {
      reject(what, call);  // "a decode step is still prepared"
      return;
    }
    if (req.stage == Stage::kGone) {
      bool const finished = unchanged(what, call);
      expectf(finished == !mPoisoned,
             "{}: finish of an ended request returned {}", what, finished);
      return;
    }
    int64_t const calls = syncCalls();
    int64_t const failures = syncFailures();
    bool const finished = accept(what, call);
    bool const failed = synchronised(what, calls, failures, pendingWork(req.stage) ? 1 : 0);
    if (failed) {
      quarantine(req);
    } else {
      released(req);
    }
    expectf(finished == !mPoisoned,
           "{}: returned {} with the backend {}", what, finished,
                       mPoisoned ? "poisoned" : "healthy");
    req.stage = Stage::kGone;
    trace(what + (failed ? ": synchronisation failed, quarantined" : ""));
  }

  /// Destroys the request's handle: the backend abandons it.
  void drop(std::size_t index) {
    Req& req = *mRequests[index];
    std::string const what = "drop " + describe(req);
    int64_t const calls = syncCalls();
    int64_t const failures = syncFailures();
    bool const pending = req.stage != Stage::kGone && pendingWork(req.stage);
    {
      LibraryCall scope;  // destructors are noexcept: a std::bad_alloc here terminates
      ++mStats.libraryCalls;
      req.facade.reset();
      req.coordinator = ContextCacheCoordinator::RequestHandle();
      req.swa = BoundedSwaKVPageManager::RequestHandle();
    }
    if (req.stage != Stage::kGone) {
      if (synchronised(what, calls, failures, pending ? 1 : 0)) {
        quarantine(req);
      } else {
        released(req);
      }
    }
    ++mStats.drops;
    trace(what);
    mRequests.erase(mRequests.begin() + static_cast<std::ptrdiff_t>(index));
  }

  /// `fromInput`: the input picks the runtime's or the backend's shutdown (teardown: runtime).
  void shutdown(bool fromInput) {
    bool const direct = fromInput && mIn.oneIn(2);
    std::string const what = direct ? "backend shutdown" : "runtime shutdown";
    int64_t const calls = syncCalls();
    int64_t const failures = syncFailures();
    bool ok = false;
    bool requestFailed = false;
    {
      LibraryCall scope;
      ++mStats.libraryCalls;
      if (!direct) {
        ok = mRuntime->shutdown();
      } else if (coordinatorBackend()) {
        ContextCacheStatus const status = mCoordinator->shutdown();
        ok = status == ContextCacheStatus::kOk;
        requestFailed = status == ContextCacheStatus::kRequestFailed;
      } else {
        SwaKVCacheStatus const status = mSwa->shutdown();
        ok = status == SwaKVCacheStatus::kOk;
        requestFailed = status == SwaKVCacheStatus::kRequestFailed;
      }
    }
    bool const failed = synchronised(what, calls, failures, mQuarantine.empty() ? 0 : 1);
    ++mStats.shutdowns;
    if (failed) {
      expect(!ok && !requestFailed, what + ": a failed drain was not reported as poisoned");
      trace(what + ": drain failed");
      return;
    }
    for (Quarantined const& q : mQuarantine) {
      for (Row const& row : q.rows) {
        mRuntime->residentSlots().release(row.resident);
      }
    }
    mQuarantine.clear();
    mPoisoned = false;
    bool const idle = liveRequests() == 0;
    expectf(ok == idle, "{}: returned {} with {} live requests", what, ok,
                                   liveRequests());
    expect(!direct || ok || requestFailed, what + ": neither kOk nor kRequestFailed");
    trace(what);
  }

  void armSyncFault() {
    if (!mOptions.inputFaults) {
      return;
    }
    if (mIn.oneIn(4)) {
      mSync->throwNext = true;
      trace("the next synchronisation throws");
    } else {
      mSync->failNext = 1 + mIn.below(2);
      trace(fmt::format("the next {} synchronisations fail", mSync->failNext));
    }
  }

  // ------------------------------------------------------------ observers and odd calls

  void observe(Req& req) {
    std::string const what = "observe " + describe(req);
    int32_t const slot = static_cast<int32_t>(mIn.below(static_cast<int32_t>(req.rows.size()) + 2)) - 1;
    bool const inBatch = slot >= 0 && slot < static_cast<int32_t>(req.rows.size());
    Tensor hidden({4, 4}, DataType::kFloat16, DeviceType::kCPU);
    if (req.via == Via::kFacade) {
      ManagedKVCacheRequest& facade = *req.facade;
      expect(unchanged(what, [&] { return facade.hasContextReuse(); }) == coordinatorBackend(),
             what + ": hasContextReuse");
      reject(what + " publishHybridMtpEndpoint",
             [&] { return facade.publishHybridMtpEndpoint(0, 1, hidden, 0); });
      reject(what + " restoreHybridMtpBoundaryHidden",
             [&] { return facade.restoreHybridMtpBoundaryHidden(0, hidden, 0); });
      if (!coordinatorBackend()) {
        expect(facade.prefillStarts() == nullptr, what + ": SWA prefill starts");
        reject(what + " reuseTokenLength", [&] { return facade.reuseTokenLength(0); });
        return;
      }
      if (req.stage == Stage::kGone) {
        return;  // the facade keeps the starts of its last batch
      }
      std::vector<int32_t> const* starts = facade.prefillStarts();
      expect(starts != nullptr && starts->size() == req.rows.size(),
             what + ": prefill starts for another batch");
      for (std::size_t i = 0; i < req.rows.size(); ++i) {
        expect((*starts)[i] == req.rows[i].start, what + ": prefill start");
      }
      if (inBatch) {
        expect(unchanged(what, [&] { return facade.reuseTokenLength(slot); }) ==
                   req.rows[static_cast<std::size_t>(slot)].start,
               what + ": reuseTokenLength");
      } else {
        reject(what + " reuseTokenLength", [&] { return facade.reuseTokenLength(slot); });
      }
      return;
    }
    bool const valid = req.stage != Stage::kGone;
    if (coordinatorBackend()) {
      ContextCacheCoordinator::RequestHandle const& handle = req.coordinator;
      if (!valid) {
        reject(what + " batchSize", [&] { return mCoordinator->batchSize(handle); });
        return;
      }
      expect(unchanged(what, [&] { return mCoordinator->batchSize(handle); }) ==
                 static_cast<int32_t>(req.rows.size()),
             what + ": batchSize");
      if (!inBatch) {
        reject(what + " committedLength", [&] { return mCoordinator->committedLength(handle, slot); });
        reject(what + " basePages", [&] { return mCoordinator->basePages(handle, slot); });
        return;
      }
      Row const& row = req.rows[static_cast<std::size_t>(slot)];
      int32_t const committed =
          !row.joined || req.stage == Stage::kAdmitted || req.stage == Stage::kPrefill
              ? row.start
              : row.materialized - (row.decoded ? 1 : 0);
      expectf(unchanged(what, [&] { return mCoordinator->committedLength(handle, slot); }) == committed,
             "{}: committedLength of row {} is not {}", what, slot, committed);
      expect(mCoordinator->reuseTokenLength(handle, slot) == row.start, what + ": reuseTokenLength");
      if (row.bound) {
        std::span<PageId const> const pages = mCoordinator->basePages(handle, slot);
        KVPageTable const& table = *mRuntime->fullPageTable();
        expect(static_cast<int32_t>(pages.size()) == table.liveEntryCount(row.resident.slot),
               what + ": lease pages and row disagree");
        for (std::size_t p = 0; p < pages.size(); ++p) {
          expect(table.entry(row.resident.slot, static_cast<int32_t>(p)) == pages[p],
                 what + ": lease page and row entry disagree");
        }
      }
      return;
    }
    BoundedSwaKVPageManager::RequestHandle const& handle = req.swa;
    if (!valid) {
      reject(what + " batchSize", [&] { return mSwa->batchSize(handle); });
      return;
    }
    if (!inBatch) {
      reject(what + " state", [&] { return mSwa->state(handle, slot); });
      return;
    }
    SwaSequenceState const& state = unchanged(what, [&]() -> SwaSequenceState const& {
      return mSwa->state(handle, slot);
    });
    Row const& row = req.rows[static_cast<std::size_t>(slot)];
    if (row.bound) {
      int32_t const from = std::max(0, row.endpoint - mWindow) / kPage;
      expectf(state.retainedBegin == from && state.retainedEnd == ceilPages(row.endpoint),
             "{}: retained [{}, {}) for endpoint {}", what, state.retainedBegin,
                         state.retainedEnd, row.endpoint);
    }
  }

  /// Calls with a default-constructed (invalid) handle.
  void staleHandle() {
    std::string const what = "invalid handle";
    if (coordinatorBackend()) {
      ContextCacheCoordinator::RequestHandle stale;
      reject(what + " preparePrefill", [&] { mCoordinator->preparePrefill(stale); });
      reject(what + " prepareDecodeStep",
             [&] { return mCoordinator->prepareDecodeStep(stale, kVanilla); });
      reject(what + " retract", [&] { return mCoordinator->retractSequenceAdmission(stale); });
      ContextCacheStatus const status = unchanged(what + " finish",
                                                  [&] { return mCoordinator->finish(stale); });
      expect(status == (mPoisoned ? ContextCacheStatus::kPoisoned : ContextCacheStatus::kOk),
             what + ": finish of an invalid handle");
      return;
    }
    BoundedSwaKVPageManager::RequestHandle stale;
    std::vector<int32_t> const lengths{1};
    reject(what + " preparePrefill", [&] { mSwa->preparePrefill(stale, lengths); });
    reject(what + " completeDecodeStep", [&] { mSwa->completeDecodeStep(stale); });
    SwaKVCacheStatus const status = unchanged(what + " finish", [&] { return mSwa->finish(stale); });
    expect(status == (mPoisoned ? SwaKVCacheStatus::kPoisoned : SwaKVCacheStatus::kOk),
           what + ": finish of an invalid handle");
  }

  // ------------------------------------------------------------ state

  Input mIn;
  LifecycleOptions mOptions;
  std::shared_ptr<SyncControl> mSync;
  LifecycleStats mStats;
  std::deque<std::string> mTrace;

  std::unique_ptr<KVCacheRuntime> mRuntime;
  ContextCacheCoordinator* mCoordinator = nullptr;
  BoundedSwaKVPageManager* mSwa = nullptr;
  std::unique_ptr<testing::KvOracle> mFullOracle;
  std::unique_ptr<testing::KvOracle> mSwaOracle;
  std::vector<KVCachePool*> mLengthPools;
  Tensor mMapping;
  Tensor mWrongTypeMapping;
  Tensor mEmptyMapping{{0}, DataType::kInt32, DeviceType::kCPU};
  int32_t mWidth = 0;
  int32_t mMaxBatch = 0;
  int32_t mWindow = 0;
  int32_t mWindowPages = 0;

  std::vector<std::unique_ptr<Req>> mRequests;
  std::vector<Quarantined> mQuarantine;
  uint64_t mNextSerial = 1;
  uint64_t mLengthOwner = 0;  // serial of the request whose batch the KV-length tensors hold
  bool mPoisoned = false;
};

/// Library log lines go nowhere while a lifecycle runs (refusals are logged by design).
class QuietLogger {
 public:
  QuietLogger() {
    auto sink = std::make_shared<spdlog::sinks::null_sink_st>();
    auto quiet = std::make_shared<spdlog::logger>("managedkv-fuzz", sink);
    quiet->set_level(spdlog::level::warn);  // format what the library would log
    setLogger(std::move(quiet));
  }
  ~QuietLogger() { setLogger(nullptr); }
  QuietLogger(QuietLogger const&) = delete;
  QuietLogger& operator=(QuietLogger const&) = delete;
};

}  // namespace

std::vector<uint8_t> seededInput(uint64_t seed, std::size_t bytes) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> input(bytes);
  for (uint8_t& byte : input) {
    byte = static_cast<uint8_t>(rng());
  }
  return input;
}

LifecycleResult runLifecycle(std::span<uint8_t const> data, LifecycleOptions const& options) {
  QuietLogger const quiet;
  Lifecycle lifecycle(data, options);
  return lifecycle.run();
}

}  // namespace mkv::fuzz
