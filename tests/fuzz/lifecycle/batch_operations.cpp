/// \file batch_operations.cpp
/// Operations that change a request's batch: compaction (beginBatchCompaction then
/// completeBatchCompaction) and in-flight admission (admitSequence, then
/// finalizeSequenceAdmission or retractSequenceAdmission), valid and with corrupted arguments.
/// A bounded-SWA joiner prefills from 0 in chunks whose window the manager stages before each
/// step (preparePrefillChunk) and rotates after it (completePrefillChunk).

#include <algorithm>

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::fuzz::lifecycle {

// ---------------------------------------------------------------- compaction

void Lifecycle::beginCompaction(Req& req) {
  int32_t survivors = 0;
  CompactionCall call = planCompaction(req, survivors);
  issueBeginCompaction(req, call);
}

/// A mapping for another batch, a wrong new size, survivors out of order, a bad entry, or a
/// device mapping of the wrong type or size.
void Lifecycle::badBeginCompaction(Req& req) {
  int32_t survivors = 0;
  CompactionCall call = planCompaction(req, survivors);
  corruptCompaction(call, survivors);
  issueBeginCompaction(req, call);
}

/// Rows that stopped leave the batch, or (one time in four) rows the input picks.
Lifecycle::CompactionCall Lifecycle::planCompaction(Req const& req, int32_t& survivors) {
  CompactionCall call;
  call.mapping.assign(req.rows.size(), -1);
  survivors = 0;
  bool const randomDrop = mIn.oneIn(4);
  for (std::size_t i = 0; i < req.rows.size(); ++i) {
    bool const dropped =
        randomDrop ? mIn.oneIn(3) : req.rows[i].reason != FinishReason::kNotFinished;
    if (!dropped) {
      call.mapping[i] = survivors++;
    }
  }
  call.newSize = survivors;
  call.device = &mMapping;
  return call;
}

void Lifecycle::corruptCompaction(CompactionCall& call, int32_t survivors) {
  std::vector<int32_t>& mapping = call.mapping;
  call.badArguments = true;
  switch (mIn.below(6)) {
    case 0:
      mapping.push_back(-1);
      break;
    case 1:
      call.newSize += 1;
      break;
    case 2:
      if (survivors >= 2) {  // survivors out of order
        auto first = std::find(mapping.begin(), mapping.end(), 0);
        auto second = std::find(mapping.begin(), mapping.end(), 1);
        std::iter_swap(first, second);
      } else if (!mapping.empty()) {
        mapping[0] = static_cast<int32_t>(mapping.size());
      } else {
        call.newSize = -1;
      }
      break;
    case 3:
      if (!mapping.empty()) {
        mapping[0] = -2;
      } else {
        call.newSize = -1;
      }
      break;
    case 4:
      call.device = &mWrongTypeMapping;
      break;
    default:
      call.device = &mEmptyMapping;
      break;
  }
}

void Lifecycle::issueBeginCompaction(Req& req, CompactionCall& call) {
  std::string const what = "beginBatchCompaction on " + describe(req);
  bool const valid = req.stage == Stage::kIdle && !req.rows.empty();
  auto begin = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->beginBatchCompaction(call.mapping, call.newSize, *call.device);
    }
    if (coordinatorBackend()) {
      mCoordinator->beginBatchCompaction(req.coordinator, call.mapping, call.newSize, *call.device);
    } else {
      mSwa->beginBatchCompaction(req.swa, call.mapping, call.newSize, *call.device);
    }
    return true;
  };
  if (!valid || call.badArguments) {
    reject(what, begin);
    return;
  }
  expect(accept(what, begin), what + " returned false");
  req.mapping = call.mapping;
  req.newBatchSize = call.newSize;
  req.stage = Stage::kCompaction;
  trace(fmt::format("{}: keep {} of {}", what, call.newSize, call.mapping.size()));
}

void Lifecycle::completeCompaction(Req& req) { issueCompleteCompaction(req, req.mapping, false); }

/// The facade's keep mapping must be the one given to beginBatchCompaction; the backends take
/// none.
void Lifecycle::badCompleteCompaction(Req& req) {
  std::vector<int32_t> keep = req.mapping;
  if (req.via != Via::kFacade) {
    issueCompleteCompaction(req, keep, false);
    return;
  }
  if (keep.empty()) {
    keep.push_back(0);
  } else {
    keep.back() = keep.back() == -1 ? static_cast<int32_t>(keep.size()) : -1;
  }
  issueCompleteCompaction(req, keep, true);
}

void Lifecycle::issueCompleteCompaction(Req& req, std::vector<int32_t> const& keep,
                                        bool badArguments) {
  std::string const what = "completeBatchCompaction on " + describe(req);
  auto complete = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->completeBatchCompaction(keep);
    }
    if (coordinatorBackend()) {
      return mCoordinator->compactBatch(req.coordinator) == ContextCacheStatus::kOk;
    }
    return mSwa->compactBatch(req.swa) == SwaKVCacheStatus::kOk;
  };
  if (req.stage != Stage::kCompaction || badArguments) {
    reject(what, complete);
    return;
  }
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  bool const compacted = accept(what, complete);
  bool const failed = synchronised(what, calls, failures, 1);
  expectf(compacted == !failed, "{}: returned {} after a {} synchronisation", what, compacted,
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
  req.draftInitPending = false;  // the synchronisation covered it (prompt endpoints published)
  req.stage = req.rows.empty() ? Stage::kFinishing : Stage::kIdle;
  ++mStats.compactions;
  trace(what);
}

// ---------------------------------------------------------------- in-flight admission

void Lifecycle::admit(Req& req) {
  if (std::optional<AdmitCall> call = planAdmit(req)) {
    issueAdmit(req, *call);
  }
}

void Lifecycle::badAdmit(Req& req) {
  if (std::optional<AdmitCall> call = planAdmit(req)) {
    corruptAdmit(req, *call);
    issueAdmit(req, *call);
  }
}

/// A joiner on a fresh resident (none free: nothing to do). A speculative request's joiner takes
/// the request's headroom and, with a paged draft, a draft row of its own (a Hybrid-MTP joiner's
/// one row short of its reuse).
std::optional<Lifecycle::AdmitCall> Lifecycle::planAdmit(Req& req) {
  AdmitCall call;
  call.valid = mRuntime->supportsSeatedAdmission() && req.stage == Stage::kIdle &&
               !req.rows.empty() && static_cast<int32_t>(req.rows.size()) < mMaxBatch &&
               req.contract == DecodingTokenStateContract::kCommittedPlusLookahead;
  std::optional<ResidentRef> const fresh = mRuntime->residentSlots().acquire();
  if (!fresh) {
    return std::nullopt;
  }
  Row& row = call.row;
  row.resident = *fresh;
  if (req.speculative) {  // the prompt and the request's headroom fit a row
    mPromptHeadroom = std::max(req.headroom.baseExtraTokens, req.headroom.draftExtraTokens);
  }
  row.prompt = makePrompt(promptLength());
  mPromptHeadroom = 1;
  row.digests = testing::PrefixDigests(req.seed);
  row.paired = req.paired;
  row.draft = testing::PrefixDigests(req.seed ^ kDraftSeed);
  appendTokens(row, row.prompt, mDraftLookahead);
  row.joined = false;
  if (req.speculative) {
    call.headroom = req.headroom;
  }
  call.admission.tokenIds = row.prompt;
  call.admission.keyExtras = BlockKeyExtras{digestIdentity(req.lora), digestIdentity(req.salt)};
  call.admission.resident = row.resident;
  call.tokens = row.prompt;
  call.resident = row.resident;
  call.swaStart.promptTokens = static_cast<int32_t>(row.prompt.size());
  return call;
}

/// An empty or too long prompt, a stale or out-of-range resident, a wrong headroom (the SWA
/// manager, which takes none: a reuse start, where nothing is cached), a foreign stream, or a
/// resident another row holds.
void Lifecycle::corruptAdmit(Req& req, AdmitCall& call) {
  call.badArguments = true;
  std::vector<ResidentRef> const busy = busyResidents();
  bool const directSwa = req.via == Via::kDirect && !coordinatorBackend();
  switch (mIn.below(6)) {
    case 0:
      call.tokens.clear();
      break;
    case 1: {  // bounded SWA takes a prompt as long as the row (it maps the window only)
      int32_t const tooLong = mWidth * kPage + (coordinatorBackend() ? 0 : 1);
      call.tokens.resize(static_cast<std::size_t>(tooLong), 9);
      break;
    }
    case 2:
      call.resident.epoch = 0;
      break;
    case 3:
      if (directSwa) {
        call.swaStart.startTokens = kPage;
      } else {
        call.headroom = DecodingKvHeadroom{0, 0};
      }
      break;
    case 4:
      if (req.via == Via::kFacade) {
        call.stream = foreignStream();
      } else {
        call.resident.slot = mMaxBatch;
      }
      break;
    default:
      if (busy.empty()) {
        call.resident.slot = -1;
      } else {
        call.resident = busy.front();
        call.busyResident = true;
      }
      break;
  }
  call.admission.tokenIds = call.tokens;
  call.admission.resident = call.resident;
  call.swaStart.promptTokens = static_cast<int32_t>(call.tokens.size());
}

/// admitSequence through the request's path, as the facade's status (`start`: the facade's
/// prefill start, the coordinator's, 0 on the SWA manager).
AdmitSequenceStatus Lifecycle::callAdmit(Req& req, AdmitCall const& call, int32_t& start) {
  if (req.via == Via::kFacade) {
    return req.facade->admitSequence(call.tokens, req.lora, call.headroom, start, call.resident,
                                     call.stream);
  }
  if (coordinatorBackend()) {
    auto const result = mCoordinator->admitSequence(req.coordinator, call.admission, call.headroom);
    start = result.prefillStart;
    return result.status == ContextCacheStatus::kOk ? AdmitSequenceStatus::kAdmitted
           : result.insufficientCapacity            ? AdmitSequenceStatus::kNoCapacity
                                                    : AdmitSequenceStatus::kFailed;
  }
  SwaKVCacheStatus const status = mSwa->admitSequence(req.swa, call.resident, call.swaStart);
  start = 0;
  return status == SwaKVCacheStatus::kOk              ? AdmitSequenceStatus::kAdmitted
         : status == SwaKVCacheStatus::kRequestFailed ? AdmitSequenceStatus::kNoCapacity
                                                      : AdmitSequenceStatus::kFailed;
}

void Lifecycle::issueAdmit(Req& req, AdmitCall& call) {
  std::string const what = "admitSequence on " + describe(req);
  auto release = [&]() { mRuntime->residentSlots().release(call.row.resident); };
  int32_t start = -1;
  try {
    // A busy resident is reported as poisoned on a poisoned backend (after the other checks).
    if (!call.valid || (call.badArguments && !(call.busyResident && mPoisoned))) {
      reject(what, [&] { return callAdmit(req, call, start); });
      release();
      return;
    }
    bool const admitted = coordinatorBackend() ? admitOutcome(req, call, start, what)
                                               : swaAdmitOutcome(req, call, start, what);
    if (!admitted) {
      release();
      return;
    }
  } catch (...) {
    release();
    throw;
  }
  if (coordinatorBackend()) {
    joined(req, std::move(call.row), start, what);
  } else {
    swaJoined(req, std::move(call.row), what);
  }
}

/// Makes the admission; true when admitted. A refusal must be documented (poison, capacity),
/// must not happen when the free pages hold the prompt, and changes nothing but counters.
bool Lifecycle::admitOutcome(Req& req, AdmitCall& call, int32_t& start, std::string const& what) {
  using AdmitStatus = AdmitSequenceStatus;
  BackendSnapshot const before = snapshot();
  auto const promptTokens = static_cast<int64_t>(call.row.prompt.size());
  int32_t const pages = ceilPages(promptTokens + call.headroom.baseExtraTokens);
  ResourcePools const& pools = mCoordinator->manager().pools();
  bool must = pages <= pools.freeCount(ResourceType::kBaseKvPage);
  if (call.row.paired) {  // and its draft row's pages
    must = must && ceilPages(promptTokens + call.headroom.draftExtraTokens) <=
                       pools.freeCount(ResourceType::kDraftKvPage);
  }
  if (slidingReuse()) {  // the sliding half: the prompt's pages and a spare, from free pages
    must = must && pages + 1 <= mRuntime->windowBlockCache()->freePages();
  }
  bool admitted = false;
  bool capacity = false;
  if (req.via == Via::kFacade) {
    auto const status = accept(what, [&] {
      return req.facade->admitSequence(call.tokens, req.lora, call.headroom, start, call.resident,
                                       call.stream);
    });
    admitted = status == AdmitStatus::kAdmitted;
    capacity = status == AdmitStatus::kNoCapacity;
    expect(!mPoisoned || status == AdmitStatus::kFailed,
           what + ": a poisoned coordinator did not fail the admission");
  } else {
    auto const result = accept(what, [&] {
      return mCoordinator->admitSequence(req.coordinator, call.admission, call.headroom);
    });
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
    trace(what + ": refused");
    return false;
  }
  expect(!call.busyResident && !call.badArguments, what + ": admitted an invalid sequence");
  return true;
}

bool Lifecycle::swaAdmitOutcome(Req& req, AdmitCall& call, int32_t& start,
                                std::string const& what) {
  BackendSnapshot const before = snapshot();
  bool const fits = mSwa->freePageCount() >= 2 * mWindowPages + 1;
  AdmitSequenceStatus const expected = mPoisoned ? AdmitSequenceStatus::kFailed
                                       : fits    ? AdmitSequenceStatus::kAdmitted
                                                 : AdmitSequenceStatus::kNoCapacity;
  AdmitSequenceStatus const status = accept(what, [&] { return callAdmit(req, call, start); });
  expectf(status == expected, "{}: status {} with {} pages free (a joiner takes {}){}", what,
          static_cast<int>(status), mSwa->freePageCount(), 2 * mWindowPages + 1,
          mPoisoned ? ", poisoned" : "");
  if (status != AdmitSequenceStatus::kAdmitted) {
    expectRefusalChangedNothing(what, before);
    ++mStats.refusals;
    trace(what + ": refused");
    return false;
  }
  expect(!call.busyResident && !call.badArguments, what + ": admitted an invalid sequence");
  expectf(start == 0, "{}: a bounded-SWA joiner starts at {}", what, start);
  return true;
}

/// The runtime seats the joiner: its KV-length row, its prefill and its lookahead token.
void Lifecycle::joined(Req& req, Row row, int32_t start, std::string const& what) {
  auto const length = static_cast<int32_t>(row.prompt.size());
  // Block reuse starts at a page boundary; a checkpoint at any length it was captured at.
  expectf(start >= 0 && start < length && (start % kPage == 0 || checkpointDeployment()),
          "{}: joiner starts at {} for {} tokens", what, start, length);
  row.start = start;
  row.chunkCompleted = start;
  row.bound = true;
  row.endpoint = length;  // sliding-window reuse: the window before the start and every page
  row.windowFrom = start;
  req.rows.push_back(std::move(row));
  setActiveBatch(static_cast<int32_t>(req.rows.size()));
  if (req.rows.back().paired) {  // its draft KV-length row, at the reused draft prefix
    writeDraftLength(static_cast<int32_t>(req.rows.size()) - 1,
                     req.mtp ? std::max(0, start - 1) : start);
    ++mStats.pairedJoins;
  }
  ++mStats.joins;
  trace(fmt::format("{}: joined at row {} from {}", what, req.rows.size() - 1, start));
  // Chunked prefill: half the joiners of two or more tokens run only a first chunk now.
  int32_t const end =
      length - start >= 2 && mIn.oneIn(2) ? start + 1 + mIn.below(length - start - 1) : length;
  auto const slot = static_cast<int32_t>(req.rows.size()) - 1;
  // No pages for it now: its chunks run later, or it is retracted (on a poisoned backend, a
  // joiner that holds its pages runs on to the refusals of its completion calls).
  if (!prepareJoinerChunk(req, slot, end) && !(mPoisoned && chunkCovered(req.rows.back(), end))) {
    // The engine seats it at its prefill start (what it reused checked there); no chunk runs.
    flushForStep();
    if (start > 0) {
      executePrefill(req, req.rows.back(), slot, start);
    } else {
      writeLength(slot, 0);
    }
    return;
  }
  flushForStep();  // the joiner's rows and length, before its prefill's forward
  executePrefill(req, req.rows.back(), slot, end);
  if (end == length) {
    sampleInto(req.rows.back());
  }
}

bool Lifecycle::publishJoinerEndpoint(Req& req, int32_t slot) {
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  auto const length = static_cast<int32_t>(row.prompt.size());
  if (restorable(req, slot) && (!row.hiddenRestored || mIn.oneIn(4)) && !mIn.oneIn(4)) {
    Tensor restored({3, kHiddenWidth}, DataType::kFloat16, DeviceType::kCPU);
    restoreBoundaryHidden(req, slot, restored, mIn.below(3), true);
  }
  Tensor const hidden = hiddenStatesOf(row);
  int32_t const hiddenRow = length - 1 - row.start;
  if (row.chunkCompleted < length) {
    // Its endpoint reads what its completed chunks computed: the last one completes first.
    if (mIn.oneIn(4)) {
      publishEndpoint(req, slot, length, hidden, hiddenRow, false);  // before its last chunk
    }
    std::string const what =
        fmt::format("completePrefillChunk({}, {}) on {}", slot, length, describe(req));
    expect(accept(what, [&] { return callCompleteChunk(req, slot, length); }),
           what + " returned false");
    row.chunkCompleted = length;
    ++mStats.prefillChunks;
  }
  if (mIn.oneIn(5)) {
    return true;  // no endpoint: finalisation releases the hit's pins
  }
  uint64_t const before = mCoordinator->counters().hybridMtpPublications;
  publishEndpoint(req, slot, length, hidden, hiddenRow, true);
  mStats.mtpJoinerEndpoints +=
      static_cast<int64_t>(mCoordinator->counters().hybridMtpPublications - before);
  return req.stage != Stage::kGone;
}

bool Lifecycle::chunkCovered(Row const& row, int32_t end) const {
  return mappedPages(row) >= ceilPages(end) &&
         (!row.paired || mappedDraftPages(row) >= ceilPages(end));
}

bool Lifecycle::prepareJoinerChunk(Req& req, int32_t slot, int32_t end) {
  std::string const what =
      fmt::format("preparePrefillChunk(row {}, to {}) on {}", slot, end, describe(req));
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->preparePrefillChunk(slot, end);
    }
    return mCoordinator->preparePrefillChunk(req.coordinator, slot, end) == ContextCacheStatus::kOk;
  };
  Row const& row = req.rows[static_cast<std::size_t>(slot)];
  bool const valid = req.stage == Stage::kIdle && !row.joined && end > row.chunkCompleted &&
                     end <= static_cast<int32_t>(row.prompt.size());
  if (!valid) {
    reject(what, call);
    return false;
  }
  // The chunk's pages, as the library counts them: those the row's table does not map yet.
  int32_t const base = std::max(0, ceilPages(end) - mappedPages(row));
  int32_t const draft = row.paired ? std::max(0, ceilPages(end) - mappedDraftPages(row)) : 0;
  DecodeStepDemand const demand = accept("prefillChunkDemand", [&] {
    return req.via == Via::kFacade ? req.facade->prefillChunkDemand(slot, end)
                                   : mCoordinator->prefillChunkDemand(req.coordinator, slot, end);
  });
  expectf(demand.basePages == base && demand.draftPages == draft,
          "{}: prefillChunkDemand says {} / {} base / draft pages, the model {} / {}", what,
          demand.basePages, demand.draftPages, base, draft);
  if (mPoisoned) {  // checked, then refused: nothing allocated
    expect(!unchanged(what, call), what + ": prepared a chunk on a poisoned backend");
    ++mStats.refusals;
    return false;
  }
  ResourcePools const& pools = mCoordinator->manager().pools();
  bool const fits = base <= pools.freeCount(ResourceType::kBaseKvPage) +
                                pools.reclaimableCount(ResourceType::kBaseKvPage) &&
                    draft <= pools.freeCount(ResourceType::kDraftKvPage) +
                                 pools.reclaimableCount(ResourceType::kDraftKvPage);
  BackendSnapshot const before = snapshot();
  bool const prepared = accept(what, call);
  expectf(prepared == fits, "{}: prepared {}, the model says the pages fit: {}", what, prepared,
          fits);
  if (!prepared) {
    expectRefusalChangedNothing(what, before);
    RowFailure const failure = req.via == Via::kFacade ? req.facade->lastFailure()
                                                       : mCoordinator->lastFailure(req.coordinator);
    expectf(failure == RowFailure{RowFailureReason::kNoCapacity, slot},
            "{}: refused with {} on row {}", what, toString(failure.reason), failure.row);
    ++mStats.refusals;
    ++mStats.chunkPageRefusals;
    trace(what + ": refused (capacity)");
    return false;
  }
  expectf(mappedPages(row) >= ceilPages(end), "{}: the row maps {} pages for {} tokens", what,
          mappedPages(row), end);
  if (base + draft > 0) {
    ++mStats.chunkPagePrepares;
    trace(fmt::format("{}: {} + {} pages", what, base, draft));
  }
  return true;
}

/// Row model of a joiner: windowFrom (= chunkCompleted) is the end of its completed chunks, the
/// manager's endpoint; endpoint the end of the staged chunk; materialized > windowFrom while the
/// chunk the last step ran waits for its completePrefillChunk.
void Lifecycle::swaJoined(Req& req, Row row, std::string const& what) {
  auto const length = static_cast<int32_t>(row.prompt.size());
  row.start = 0;
  row.chunkCompleted = 0;
  row.bound = true;
  row.endpoint = length;  // the rest of the prompt is staged
  row.windowFrom = 0;
  req.rows.push_back(std::move(row));
  auto const slot = static_cast<int32_t>(req.rows.size()) - 1;
  setActiveBatch(slot + 1);
  writeLength(slot, 0);  // the engine seats the joiner at its prefill start
  ++mStats.joins;
  ++mStats.swaJoins;
  trace(fmt::format("{}: joined at row {}", what, slot));
  switch (mIn.below(4)) {
    case 0:
      return;  // its chunks run in later steps
    case 1:
      break;  // the whole prompt, staged at admission, in the next step
    default:
      if (length >= 2) {  // a first chunk shorter than the prompt
        (void)prepareSwaChunk(req, slot, 1 + mIn.below(length - 1));
      }
      break;
  }
  flushForStep();  // the joiner's rows and length, before its chunk's forward
  executeSwaChunk(req, req.rows.back(), slot);
}

void Lifecycle::finalize(Req& req) {
  if (!finalizeModelled(req)) {
    return;
  }
  auto const rows = static_cast<int32_t>(req.rows.size());
  bool const unjoined = rows > 0 && !req.rows.back().joined;
  int32_t const slot = unjoined ? rows - 1 : (mIn.oneIn(2) ? rows : std::max(0, rows - 1));
  if (mIn.oneIn(3)) {
    preempt(req, static_cast<int32_t>(mIn.below(rows + 1)));
    return;
  }
  if (!coordinatorBackend() && unjoined) {
    Row const& joiner = req.rows.back();
    // Most operations on a bounded-SWA joiner move its chunks on; its finalisation needs the
    // last one to have run.
    if (joiner.windowFrom < static_cast<int32_t>(joiner.prompt.size()) && !mIn.oneIn(3)) {
      swaJoinerStep(req, slot);
      return;
    }
  } else if (unjoined &&
             req.rows.back().materialized < static_cast<int32_t>(req.rows.back().prompt.size()) &&
             mIn.oneIn(2)) {
    prefillChunk(req, slot);
    return;
  }
  issueFinalize(req, slot, false);
}

void Lifecycle::preempt(Req& req, int32_t slot) {
  if (req.via == Via::kDirect && !coordinatorBackend()) {
    return;  // the SWA manager keeps nothing to publish: the engine only compacts the row away
  }
  std::string const what = "preemptSequence on " + describe(req);
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->preemptSequence(slot);
    }
    return mCoordinator->preemptSequence(req.coordinator, slot) == ContextCacheStatus::kOk;
  };
  // Between steps on every backend (bounded SWA then publishes nothing).
  bool const valid = req.stage == Stage::kIdle && slot < static_cast<int32_t>(req.rows.size()) &&
                     req.rows[static_cast<std::size_t>(slot)].joined;
  if (!valid) {
    reject(what, call);
    return;
  }
  if (mPoisoned && coordinatorBackend()) {
    expect(!unchanged(what, call), what + ": preempted on a poisoned backend");
    ++mStats.refusals;
    return;
  }
  ContextCacheCoordinatorCounters const before =
      coordinatorBackend() ? mCoordinator->counters() : ContextCacheCoordinatorCounters{};
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  bool const accepted = accept(what, call);
  // On a checkpoint runtime the row's state may be captured where it stands (not when its commit
  // policy keeps the prompt only, that length is published or cached, the row bypasses the
  // cache or no snapshot slot is free); a capture synchronises once, and a failed
  // synchronisation quarantines the request.
  if (quarantinedByCapture(req, what, before, calls, failures, accepted)) {
    ++mStats.checkpointPreemptionQuarantines;
    return;
  }
  expect(accepted, what + " returned false");
  ++mStats.preemptions;
  if (coordinatorBackend() &&
      mCoordinator->counters().captureSynchronizations != before.captureSynchronizations) {
    // Defensive: the last completion filed this prefix already (the slabs are checked against
    // the ledger either way).
    Row const& row = req.rows[static_cast<std::size_t>(slot)];
    noteCheckpoint(req, row, row.materialized, false);
    ++mStats.checkpointPreemptions;
    mStats.checkpointsPublished += static_cast<int64_t>(
        mCoordinator->counters().checkpointPublications - before.checkpointPublications);
  }
  trace(fmt::format("{}: row {}", what, slot));
}

void Lifecycle::prefillChunk(Req& req, int32_t slot) {
  std::string const what = "completePrefillChunk on " + describe(req);
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  auto const length = static_cast<int32_t>(row.prompt.size());
  int32_t const end = row.materialized + 1 + mIn.below(length - row.materialized);
  auto call = [&](int32_t tokens) { return callCompleteChunk(req, slot, tokens); };
  if (req.stage != Stage::kIdle) {  // during a step (or finishing): refused, nothing changed
    reject(what + " during a step", [&] { return call(end); });
    return;
  }
  if (mIn.oneIn(4)) {  // beyond the prompt, or below what is done
    int32_t const bad =
        mIn.oneIn(2) || row.chunkCompleted == 0 ? length + 1 : row.chunkCompleted - 1;
    reject(what + " (bad length)", [&] { return call(bad); });
    return;
  }
  if (!prepareJoinerChunk(req, slot, end) && !(mPoisoned && chunkCovered(row, end))) {
    return;
  }
  flushForStep();                       // the chunk's rows, before its forward
  executePrefill(req, row, slot, end);  // the chunk's forward, in the engine's step
  if (mPoisoned) {
    expect(!unchanged(what, [&] { return call(end); }), what + ": completed on a poisoned backend");
    ++mStats.refusals;
  } else {
    expect(accept(what, [&] { return call(end); }), what + " returned false");
    row.chunkCompleted = end;
    ++mStats.prefillChunks;
    if (mRecurrentOracle && !req.mtp) {  // a hybrid chunk's end may be kept as a reuse point
      noteCheckpoint(req, row, end, false);
    }
  }
  if (end == length) {
    sampleInto(row);
  }
  trace(fmt::format("{}: row {} to {} of {}", what, slot, end, length));
}

bool Lifecycle::prefillRest(Req& req, int32_t slot) {
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  auto const length = static_cast<int32_t>(row.prompt.size());
  if (row.joined || row.materialized == length) {
    return true;
  }
  if (!prepareJoinerChunk(req, slot, length) && !(mPoisoned && chunkCovered(row, length))) {
    return false;
  }
  flushForStep();
  executePrefill(req, row, slot);
  sampleInto(row);
  return true;
}

// ---------------------------------------------------------------- bounded-SWA joiners

void Lifecycle::swaJoinerStep(Req& req, int32_t slot) {
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  auto const length = static_cast<int32_t>(row.prompt.size());
  int32_t const done = row.windowFrom;
  bool const ran = row.materialized > done;  // the last step ran the staged chunk
  if (req.stage != Stage::kIdle) {           // during a step (or compaction): each call throws
    if (ran) {
      (void)completeSwaChunk(req, slot, row.endpoint);
    } else {
      (void)prepareSwaChunk(req, slot, done + 1 + mIn.below(length - done));
    }
    return;
  }
  if (mIn.oneIn(10)) {  // preempted mid-prefill: refused for a joiner, so it is compacted away
    preempt(req, slot);
    compactJoinerAway(req);
    return;
  }
  if (ran) {
    if (mIn.oneIn(4)) {  // a chunk end other than the staged one: unprepared, or outside
      int32_t const other = done + 1 + mIn.below(length - done);
      (void)completeSwaChunk(req, slot, other != row.endpoint ? other : length + 1);
      return;
    }
    (void)completeSwaChunk(req, slot, row.endpoint);
    return;
  }
  switch (mIn.below(8)) {
    case 0:  // a chunk end outside (done, prompt]
      (void)prepareSwaChunk(req, slot, mIn.oneIn(2) ? done : length + 1);
      return;
    case 1: {  // completing a chunk that was not staged
      int32_t const other = done + 1 + mIn.below(length - done);
      (void)completeSwaChunk(req, slot, other != row.endpoint ? other : length + 1);
      return;
    }
    case 2:  // completing what is done: a no-op
      (void)completeSwaChunk(req, slot, done);
      return;
    default:
      break;
  }
  // The next chunk [done, end): the rest of the prompt is staged already (a prepare call for it
  // is a no-op), a shorter one is prepared.
  int32_t const end = done + 1 + mIn.below(length - done);
  if ((end != row.endpoint || mIn.oneIn(4)) && !prepareSwaChunk(req, slot, end)) {
    return;
  }
  if (mIn.oneIn(3)) {
    return;  // it runs in a later step (a decode step's, perhaps)
  }
  flushForStep();  // the chunk's rows, before its forward
  executeSwaChunk(req, row, slot);
  if (mIn.oneIn(2)) {
    (void)completeSwaChunk(req, slot, end);
  }
}

bool Lifecycle::prepareSwaChunk(Req& req, int32_t slot, int32_t end) {
  std::string const what =
      fmt::format("preparePrefillChunk(row {}, to {}) on {}", slot, end, describe(req));
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->preparePrefillChunk(slot, end);
    }
    return mSwa->prepareSequenceChunk(req.swa, slot, end) == SwaKVCacheStatus::kOk;
  };
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  bool const valid = req.stage == Stage::kIdle && !row.joined && end > row.windowFrom &&
                     end <= static_cast<int32_t>(row.prompt.size());
  if (!valid) {
    reject(what, call);
    return false;
  }
  if (mPoisoned) {  // checked, then refused: nothing staged
    expect(!unchanged(what, call), what + ": staged a chunk on a poisoned backend");
    ++mStats.refusals;
    return false;
  }
  if (end == row.endpoint) {  // staged already (the rest of the prompt): a no-op
    expect(unchanged(what, call), what + " returned false");
    return true;
  }
  expect(accept(what, call), what + " returned false");
  row.endpoint = end;
  trace(what);
  return true;
}

bool Lifecycle::completeSwaChunk(Req& req, int32_t slot, int32_t end) {
  std::string const what =
      fmt::format("completePrefillChunk(row {}, to {}) on {}", slot, end, describe(req));
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->completePrefillChunk(slot, end);
    }
    return mSwa->completeSequenceChunk(req.swa, slot, end) == SwaKVCacheStatus::kOk;
  };
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  bool const ran = row.materialized > row.windowFrom;
  bool const valid = req.stage == Stage::kIdle && !row.joined &&
                     (end == row.windowFrom || (ran && end == row.endpoint));
  if (!valid) {
    reject(what, call);
    return false;
  }
  if (mPoisoned) {  // checked, then refused: nothing committed
    expect(!unchanged(what, call), what + ": completed a chunk on a poisoned backend");
    ++mStats.refusals;
    return false;
  }
  if (end == row.windowFrom) {
    expect(unchanged(what, call), what + " returned false");
    return true;
  }
  expect(accept(what, call), what + " returned false");
  // What left the chunk's window is unmapped; the rest of the prompt is staged.
  row.windowFrom = end;
  row.chunkCompleted = end;
  row.endpoint = static_cast<int32_t>(row.prompt.size());
  ++mStats.prefillChunks;
  ++mStats.swaPrefillChunks;
  trace(what);
  return true;
}

void Lifecycle::swaPrefillRest(Req& req, int32_t slot) {
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  auto const length = static_cast<int32_t>(row.prompt.size());
  if (req.via == Via::kFacade && mPoisoned) {
    return;  // the facade refuses every chunk call
  }
  if (row.materialized > row.windowFrom && row.endpoint < length) {
    (void)completeSwaChunk(req, slot, row.endpoint);  // the last step's chunk
  }
  if (row.endpoint < length) {  // a shorter chunk staged that did not run: the rest instead
    (void)prepareSwaChunk(req, slot, length);
  }
  if (row.materialized < length) {
    flushForStep();
    executeSwaChunk(req, row, slot);
  }
}

void Lifecycle::compactJoinerAway(Req& req) {
  CompactionCall call;
  auto const rows = static_cast<int32_t>(req.rows.size());
  for (int32_t i = 0; i < rows; ++i) {
    call.mapping.push_back(i + 1 < rows ? i : -1);
  }
  call.newSize = rows - 1;
  call.device = &mMapping;
  issueBeginCompaction(req, call);
}

/// A row past the batch or one already joined, or the joiner's length off by one.
void Lifecycle::badFinalize(Req& req) {
  if (!finalizeModelled(req)) {
    return;
  }
  auto const rows = static_cast<int32_t>(req.rows.size());
  int32_t const slot = mIn.oneIn(2) ? rows : std::max(0, rows - 1);
  issueFinalize(req, slot, true);
}

/// False when the call is not modelled here: finalisation during a decode step or compaction
/// (allowed by the coordinator; bounded SWA rejects it).
bool Lifecycle::finalizeModelled(Req& req) {
  return !coordinatorBackend() || (req.stage != Stage::kDecode && req.stage != Stage::kCompaction);
}

void Lifecycle::issueFinalize(Req& req, int32_t slot, bool corruptLength) {
  if (!coordinatorBackend()) {
    issueSwaFinalize(req, slot, corruptLength);
    return;
  }
  std::string const what = "finalizeSequenceAdmission on " + describe(req);
  auto const rows = static_cast<int32_t>(req.rows.size());
  bool const unjoined = slot < rows && !req.rows[static_cast<std::size_t>(slot)].joined;
  bool const valid = req.stage == Stage::kIdle && unjoined;
  if (valid && !prefillRest(req, slot)) {  // a chunked joiner's last chunk runs before
    return;                                // its finalisation, once its pages are ready
  }
  if (valid && req.mtp && !corruptLength && !mPoisoned && !publishJoinerEndpoint(req, slot)) {
    return;
  }
  Row const* row = valid ? &req.rows[static_cast<std::size_t>(slot)] : nullptr;
  int32_t const lookahead = row != nullptr ? row->generated.back() : 1;
  int32_t length = row != nullptr ? static_cast<int32_t>(row->prompt.size()) : 1;
  bool badLength = false;
  if (valid && corruptLength && mIn.oneIn(2)) {
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
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  bool const finalized = accept(what, call);
  // A hybrid joiner's restore and captures are made terminal by one synchronisation (none when
  // it restored and captured nothing), which may fail and quarantine the request.
  int64_t const made = syncCalls() - calls;
  expectf(made <= (checkpointDeployment() ? 1 : 0), "{}: made {} synchronisations", what, made);
  if (syncFailures() != failures) {
    ++mStats.failedSynchronizations;
    expectf(!finalized, "{}: returned true after a failed synchronisation", what);
    quarantine(req);
    req.stage = Stage::kGone;
    trace(what + ": synchronisation failed, request quarantined");
    return;
  }
  expect(finalized, what + " returned false");
  Row& joiner = req.rows[static_cast<std::size_t>(slot)];
  joiner.joined = true;
  if (req.speculative) {
    // EAGLE: its draft initialises after the call; its prompt endpoint waits for the next round,
    // a compaction or finish (the facade's speculative contract, per row). Hybrid-MTP: its
    // endpoint was published before the call, its draft stops at the boundary token's row.
    joiner.common = static_cast<int32_t>(joiner.prompt.size());
    req.draftInitPending = req.draftInitPending || !req.mtp;
    if (joiner.paired && !req.mtp) {
      executeDraft(joiner, slot, joiner.common);
    }
  }
  if (checkpointDeployment() && !req.mtp) {  // a hybrid joiner's prompt-end capture
    noteCheckpoint(req, joiner, static_cast<int32_t>(joiner.prompt.size()), false);
  }
  joiner.windowFrom = joiner.endpoint;  // sliding-window reuse: the joiner's window is retired
  trace(fmt::format("{}: row {}", what, slot));
}

/// Bounded SWA: valid between steps for an unfinalised joiner whose staged chunk ends at its
/// prompt (the facade: and the prompt's length); the facade answers false when poisoned, after
/// its checks. The corrupted form may also skip the last chunk (the prefill did not reach L).
void Lifecycle::issueSwaFinalize(Req& req, int32_t slot, bool corrupt) {
  std::string const what = "finalizeSequenceAdmission on " + describe(req);
  auto const rows = static_cast<int32_t>(req.rows.size());
  Row* row = slot < rows ? &req.rows[static_cast<std::size_t>(slot)] : nullptr;
  bool const unjoined = row != nullptr && !row->joined;
  auto const prompt = row != nullptr ? static_cast<int32_t>(row->prompt.size()) : 1;
  if (req.stage == Stage::kIdle && unjoined &&
      !(corrupt && mIn.oneIn(2) && row->endpoint != prompt)) {
    swaPrefillRest(req, slot);  // the last chunk runs before the finalisation
  }
  int32_t const lookahead = row != nullptr && !row->generated.empty() ? row->generated.back() : 1;
  int32_t length = prompt;
  bool badLength = false;
  if (corrupt && req.via == Via::kFacade && mIn.oneIn(2)) {
    length += 1;
    badLength = true;
  }
  bool const valid = req.stage == Stage::kIdle && unjoined && row->endpoint == prompt && !badLength;
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->finalizeSequenceAdmission(slot, lookahead, length);
    }
    mSwa->finalizeSequenceAdmission(req.swa, slot);
    return true;
  };
  if (!valid) {
    reject(what, call);
    return;
  }
  if (req.via == Via::kFacade && mPoisoned) {
    expect(!unchanged(what, call), what + ": finalised on a poisoned backend");
    ++mStats.refusals;
    return;
  }
  expectf(row->materialized == prompt, "{}: the driver finalises row {} before its prompt ran",
          what, slot);
  expect(accept(what, call), what + " returned false");
  // Trimmed to M + 1 pages (the surplus back to the free list); it decodes from the next step.
  row->joined = true;
  row->windowFrom = prompt;
  row->endpoint = prompt;
  row->chunkCompleted = prompt;
  ++mStats.swaFinalizations;
  trace(fmt::format("{}: row {}", what, slot));
}

void Lifecycle::retract(Req& req) {
  std::string const what = "retractSequenceAdmission on " + describe(req);
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->retractSequenceAdmission();
    }
    if (coordinatorBackend()) {
      return mCoordinator->retractSequenceAdmission(req.coordinator);
    }
    return mSwa->retractSequenceAdmission(req.swa);
  };
  bool const possible = req.stage != Stage::kGone && req.rows.size() > 1 &&
                        !req.rows.back().joined &&
                        (req.stage == Stage::kIdle || req.stage == Stage::kFinishing);
  if (!possible) {
    // Nothing to undo: the noexcept retraction returns false and changes nothing (no poison).
    expect(!unchanged(what, call), what + " returned true with nothing to undo");
    trace(what + ": nothing to undo");
    return;
  }
  expect(accept(what, call), what + " returned false");
  mRuntime->residentSlots().release(req.rows.back().resident);
  req.rows.pop_back();
  if (mLengthOwner == req.serial) {
    setActiveBatch(static_cast<int32_t>(req.rows.size()));  // the runtime un-seats the joiner
  }
  ++mStats.retractions;
  mStats.swaRetractions += coordinatorBackend() ? 0 : 1;
  trace(what);
}

}  // namespace mkv::fuzz::lifecycle
