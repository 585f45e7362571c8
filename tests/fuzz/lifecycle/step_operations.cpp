/// \file step_operations.cpp
/// The steps of a request on either backend: preparePrefill, the prefill captures,
/// completePrefill, prepareDecodeStep and completeDecodeStep, each valid (`preparePrefill`, ...)
/// and with corrupted arguments (`badPreparePrefill`, ...). Whether the stage allows the call is
/// the model's decision in both forms.

#include <algorithm>
#include <cstring>

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::fuzz::lifecycle {

// ---------------------------------------------------------------- prefill

/// The SWA prefill lengths: the prompts (bounded SWA), or the tokens each row executes from its
/// reuse start (sliding-window reuse: prepareSwaPrefill's effective input lengths).
std::vector<int32_t> Lifecycle::swaPrefillLengths(Req const& req) const {
  std::vector<int32_t> lengths;
  for (Row const& row : req.rows) {
    lengths.push_back(static_cast<int32_t>(row.prompt.size()) - (slidingReuse() ? row.start : 0));
  }
  return lengths;
}

/// Another request may not prefill now: the coordinator executes one request at a time, and
/// the SWA length pools follow their owner until it finishes (sliding-window reuse: both).
bool Lifecycle::prefillBlockedByAnother(Req const& req) {
  for (auto const& other : mRequests) {
    if (other.get() == &req) {
      continue;
    }
    bool const executes = coordinatorBackend() && executing(other->stage);
    bool const ownsLengths = windowRows() && other->serial == mLengthOwner;
    if (executes || ownsLengths) {
      return true;
    }
  }
  return false;
}

void Lifecycle::preparePrefill(Req& req) {
  issuePreparePrefill(req, swaPrefillLengths(req), false);
}

/// The SWA prefill lengths corrupted (more rows, an empty row, a row past the width); the
/// coordinator's facade ignores them.
void Lifecycle::badPreparePrefill(Req& req) {
  std::vector<int32_t> lengths = swaPrefillLengths(req);
  if (lengths.empty()) {
    issuePreparePrefill(req, lengths, false);
    return;
  }
  switch (mIn.below(3)) {
    case 0:
      lengths.push_back(1);
      break;
    case 1:
      lengths[0] = 0;
      break;
    default:
      lengths[0] = mWidth * kPage + 1;
      break;
  }
  issuePreparePrefill(req, lengths, true);
}

void Lifecycle::issuePreparePrefill(Req& req, std::vector<int32_t> const& lengths,
                                    bool badLengths) {
  std::string const what = "preparePrefill on " + describe(req);
  bool const valid = req.stage == Stage::kAdmitted && !prefillBlockedByAnother(req);
  if (req.via == Via::kFacade) {
    if (!issueFacadePreparePrefill(req, lengths, valid && !badLengths, what)) {
      return;
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
  for (Row& row : req.rows) {
    row.bound = true;
    row.endpoint = static_cast<int32_t>(row.prompt.size());
    // Sliding-window reuse maps the window before the start and every executed page.
    row.windowFrom = slidingReuse() ? row.start : row.endpoint;
  }
  // The last founder may run only a first chunk, prepared before the step (bounded SWA stages
  // its window) and completed in the prefill (it then holds at completePrefill and goes on as a
  // joiner), for requests that admit joiners.
  int32_t founderEnd = -1;
  if (!req.rows.empty() && foundersChunk(req)) {
    Row const& last = req.rows.back();
    auto const length = static_cast<int32_t>(last.prompt.size());
    if (length - last.start >= 2 && mIn.oneIn(3)) {
      founderEnd = last.start + 1 + mIn.below(length - last.start - 1);
      prepareFounderChunk(req, static_cast<int32_t>(req.rows.size()) - 1, founderEnd);
    }
  }
  // Engine-step writes: the engine flushes before the prefill's forward (having forgotten it, it
  // learns so from the completion, which must refuse and change nothing).
  if (forgetFlush()) {
    refusedPrefillCompletion(req);
  }
  flushForStep();
  for (std::size_t i = 0; i < req.rows.size(); ++i) {
    Row& row = req.rows[i];
    if (i + 1 == req.rows.size() && founderEnd >= 0) {
      executePrefill(req, row, static_cast<int32_t>(i), founderEnd);
      founderChunk(req, static_cast<int32_t>(i), founderEnd);
      continue;
    }
    executePrefill(req, row, static_cast<int32_t>(i));
  }
  if (req.mtp) {
    writeHiddenStates(req);
  }
  ++mStats.prefills;
  trace(fmt::format("{}: starts at {}", what, req.rows.empty() ? 0 : req.rows.front().start));
}

bool Lifecycle::foundersChunk(Req const& req) const {
  return mRuntime->supportsSeatedAdmission() &&
         req.contract == DecodingTokenStateContract::kCommittedPlusLookahead && !mPoisoned;
}

/// preparePrefillChunk of founder `slot` in the prefill, before the step that runs [start, end):
/// bounded SWA maps that chunk's window instead of the whole prompt's; the backends with the
/// coordinator only check (its whole prompt is bound).
void Lifecycle::prepareFounderChunk(Req& req, int32_t slot, int32_t end) {
  std::string const what =
      fmt::format("preparePrefillChunk(founder {}, to {}) on {}", slot, end, describe(req));
  expect(accept(what,
                [&] {
                  if (req.via == Via::kFacade) {
                    return req.facade->preparePrefillChunk(slot, end);
                  }
                  if (coordinatorBackend()) {
                    return mCoordinator->preparePrefillChunk(req.coordinator, slot, end) ==
                           ContextCacheStatus::kOk;
                  }
                  return mSwa->prepareSequenceChunk(req.swa, slot, end) == SwaKVCacheStatus::kOk;
                }),
         what + " returned false");
  if (!coordinatorBackend()) {
    req.rows[static_cast<std::size_t>(slot)].endpoint = end;  // the staged chunk
  }
  trace(what);
}

bool Lifecycle::callCompleteChunk(Req& req, int32_t slot, int32_t tokens) {
  if (req.via == Via::kFacade) {
    return req.facade->completePrefillChunk(slot, tokens);
  }
  if (coordinatorBackend()) {
    return mCoordinator->completePrefillChunk(req.coordinator, slot, tokens) ==
           ContextCacheStatus::kOk;
  }
  return mSwa->completeSequenceChunk(req.swa, slot, tokens) == SwaKVCacheStatus::kOk;
}

/// completePrefillChunk of founder `slot` in the prefill, after its first chunk [start, end) ran.
void Lifecycle::founderChunk(Req& req, int32_t slot, int32_t end) {
  std::string const what =
      fmt::format("completePrefillChunk(founder {}, to {}) on {}", slot, end, describe(req));
  Row& row = req.rows[static_cast<std::size_t>(slot)];
  expect(accept(what, [&] { return callCompleteChunk(req, slot, end); }), what + " returned false");
  row.heldPrefill = true;
  row.chunkCompleted = end;
  if (!coordinatorBackend()) {  // bounded SWA: the rest of the prompt is staged, as a joiner's
    row.windowFrom = end;
    row.endpoint = static_cast<int32_t>(row.prompt.size());
    ++mStats.swaHeldFounders;
  }
  ++mStats.prefillChunks;
  ++mStats.heldFounders;
  if (mRecurrentOracle) {  // a checkpoint runtime may keep the chunk's end as a reuse point
    noteCheckpoint(req, row, end, false);
  }
  trace(fmt::format("{}: held", what));
}

/// preparePrefill then prepareSwaPrefill through the facade; false when the call was rejected.
/// `validLengths`: the stage allows the prefill and the SWA lengths are right.
bool Lifecycle::issueFacadePreparePrefill(Req& req, std::vector<int32_t> const& lengths,
                                          bool validLengths, std::string const& what) {
  ManagedKVCacheRequest& facade = *req.facade;
  if (slidingReuse()) {
    // Both halves: the coordinator binds the full rows, prepareSwaPrefill maps the windows. An
    // engine whose lengths were wrong is told so and calls again with the right ones.
    if (!issueFacadeCoordinatorPrepare(req, what)) {
      return false;
    }
    // The full half's prefill is launched: device work is pending from here on, also when
    // prepareSwaPrefill runs out of host memory and the request is dropped.
    req.stage = Stage::kPrefill;
    std::vector<int32_t> const right = swaPrefillLengths(req);
    // prepareSwaPrefill changes nothing when it runs out of host memory: the engine calls it
    // again (dropping the request would leave the full half prepared without its sliding half).
    auto retried = [&](auto&& call) {
      try {
        return call();
      } catch (AllocationFailed const&) {
        trace(what + " (prepareSwaPrefill): std::bad_alloc, called again");
        return call();
      }
    };
    if (lengths != right) {
      retried([&] {
        reject(what + " (prepareSwaPrefill)", [&] { return facade.prepareSwaPrefill(lengths); });
        return true;
      });
    }
    expect(retried([&] {
             return accept(what + " (prepareSwaPrefill)",
                           [&] { return facade.prepareSwaPrefill(right); });
           }),
           what + " (prepareSwaPrefill) returned false");
    return true;
  }
  if (coordinatorBackend()) {
    if (!issueFacadeCoordinatorPrepare(req, what)) {
      return false;
    }
    expect(
        unchanged(what + " (prepareSwaPrefill)", [&] { return facade.prepareSwaPrefill(lengths); }),
        "prepareSwaPrefill on the coordinator returned false");
    return true;
  }
  expect(unchanged(what, [&] { return facade.preparePrefill(); }),
         "preparePrefill on SWA returned false");
  if (!validLengths) {
    reject(what + " (prepareSwaPrefill)", [&] { return facade.prepareSwaPrefill(lengths); });
    return false;
  }
  expect(accept(what, [&] { return facade.prepareSwaPrefill(lengths); }), what + " returned false");
  return true;
}

/// The coordinator half of issueFacadePreparePrefill: preparePrefill through the facade, valid
/// when the request is admitted and no other request's prefill blocks it; false when rejected.
bool Lifecycle::issueFacadeCoordinatorPrepare(Req& req, std::string const& what) {
  ManagedKVCacheRequest& facade = *req.facade;
  bool const valid = req.stage == Stage::kAdmitted && !prefillBlockedByAnother(req);
  if (!valid) {
    reject(what, [&] { return facade.preparePrefill(); });
    return false;
  }
  expect(accept(what, [&] { return facade.preparePrefill(); }), what + " returned false");
  return true;
}

/// enqueuePrefillCaptures: nothing to capture on attention-only runtimes and for a Hybrid-MTP
/// request (which publishes through its endpoint); checkpoint runtimes stage the captures of
/// the prompt ends (committed by completePrefill, no synchronisation). A Hybrid-MTP request
/// instead restores its boundary hidden row or publishes its endpoint.
void Lifecycle::captures(Req& req) {
  std::string const what = "enqueuePrefillCaptures on " + describe(req);
  bool const valid = req.stage == Stage::kPrefill;
  if (!coordinatorBackend()) {  // the SWA manager has no captures; its facade answers true
    if (req.via == Via::kFacade) {
      expect(unchanged(what, [&] { return req.facade->enqueuePrefillCaptures(); }),
             what + " returned false");
    }
    return;
  }
  if (req.mtp && valid && !mIn.oneIn(5)) {
    // A row whose endpoint is not published yet, if any: its boundary hidden row is restored
    // before its endpoint (which releases its hit's pins).
    int32_t slot = mIn.below(static_cast<int32_t>(req.rows.size()));
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      if (!req.rows[i].endpointPublished) {
        slot = static_cast<int32_t>(i);
        break;
      }
    }
    Row const& row = req.rows[static_cast<std::size_t>(slot)];
    if (restorable(req, slot) && (!row.hiddenRestored || mIn.oneIn(4)) && !mIn.oneIn(8)) {
      Tensor hidden({3, kHiddenWidth}, DataType::kFloat16, DeviceType::kCPU);
      restoreBoundaryHidden(req, slot, hidden, mIn.below(3), true);
      return;
    }
    auto const length = static_cast<int32_t>(row.prompt.size());
    publishEndpoint(req, slot, length, req.hidden.at(static_cast<std::size_t>(slot)),
                    length - 1 - row.start, true);
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
  if (!checkpointDeployment() || req.mtp) {
    expect(unchanged(what, call), what + " returned false");  // nothing to capture
    return;
  }
  uint64_t const staged = mCoordinator->counters().checkpointCaptures;
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  expect(accept(what, call), what + " returned false");
  (void)synchronised(what, calls, failures, 0);  // committed by completePrefill
  trace(fmt::format("{}: {} captures staged", what,
                    mCoordinator->counters().checkpointCaptures - staged));
}

/// A Hybrid-MTP call with one argument wrong (a length beyond the prompt, negative or below the
/// reuse, a slot outside the batch, a hidden tensor of another width, a row outside it, a
/// restore where the row has no restored checkpoint), or one the request or deployment does not
/// offer; on the runtimes of the first corpus, the valid captures (the input format of those
/// runtimes is unchanged).
void Lifecycle::badCaptures(Req& req) {
  if (!coordinatorBackend() || mKind < Runtime::kHybrid) {
    captures(req);
    return;
  }
  auto const rows = static_cast<int32_t>(req.rows.size());
  int32_t const slot = rows > 0 ? mIn.below(rows) : 0;
  Row const* row = rows > 0 ? &req.rows[static_cast<std::size_t>(slot)] : nullptr;
  int32_t const length = row != nullptr ? static_cast<int32_t>(row->prompt.size()) : 1;
  int32_t const start = row != nullptr ? row->start : 0;
  // Before the prefill there are no hidden rows: any tensor (the call is invalid for its stage).
  auto const index = static_cast<std::size_t>(slot);
  Tensor const& hidden = index < req.hidden.size() ? req.hidden[index] : mMapping;
  auto const hiddenRows = static_cast<int32_t>(hidden.rank() == 2 ? hidden.dim(0) : 1);
  int32_t const hiddenRow = std::max(0, length - 1 - start);
  if (!req.mtp) {  // a vanilla request, or a deployment that is not Hybrid-MTP
    Tensor scratch({1, kHiddenWidth}, DataType::kFloat16, DeviceType::kCPU);
    if (mIn.oneIn(2)) {
      publishEndpoint(req, 0, length, scratch, 0, false);
    } else {
      restoreBoundaryHidden(req, 0, scratch, 0, false);
    }
    return;
  }
  switch (mIn.below(7)) {
    case 0:
      publishEndpoint(req, slot, length + 1, hidden, hiddenRow, false);
      return;
    case 1:
      publishEndpoint(req, slot, -1, hidden, hiddenRow, false);
      return;
    case 2:
      if (start > 1) {
        publishEndpoint(req, slot, 1 + mIn.below(start - 1), hidden, hiddenRow, false);
      } else {
        publishEndpoint(req, slot, length + 2, hidden, hiddenRow, false);
      }
      return;
    case 3:
      publishEndpoint(req, rows, length, hidden, hiddenRow, false);  // a slot outside the batch
      return;
    case 4: {
      Tensor narrow({hiddenRows, kHiddenWidth / 2}, DataType::kFloat16, DeviceType::kCPU);
      publishEndpoint(req, slot, length, narrow, 0, false);
      return;
    }
    case 5:
      publishEndpoint(req, slot, length, hidden, hiddenRows, false);
      return;
    default: {
      Tensor scratch({3, kHiddenWidth}, DataType::kFloat16, DeviceType::kCPU);
      restoreBoundaryHidden(req, slot, scratch, restorable(req, slot) ? 3 : mIn.below(3), false);
      return;
    }
  }
}

/// Hybrid-MTP: the row restored a checkpoint whose pins it still holds (the endpoint's capture or
/// a reservation under pressure releases them; completePrefill does).
bool Lifecycle::restorable(Req const& req, int32_t slot) const {
  if (!req.mtp || slot < 0 || slot >= static_cast<int32_t>(req.rows.size())) {
    return false;
  }
  Row const& row = req.rows[static_cast<std::size_t>(slot)];
  bool const awaiting = req.stage == Stage::kPrefill || (req.stage == Stage::kIdle && !row.joined);
  return awaiting && row.start > 0 && !row.pinsReleased;
}

/// publishHybridMtpEndpoint: a valid call returns true and makes at most one synchronisation;
/// when that fails the request is quarantined (false). An endpoint already cached, a second one
/// of the row, a bypass row or snapshot pressure publish nothing.
void Lifecycle::publishEndpoint(Req& req, int32_t slot, int32_t length, Tensor const& hidden,
                                int32_t row, bool valid) {
  std::string const what = fmt::format("publishHybridMtpEndpoint({}, {}, row {}) on {}", slot,
                                       length, row, describe(req));
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->publishHybridMtpEndpoint(slot, length, hidden, row);
    }
    return mCoordinator->publishHybridMtpEndpoint(req.coordinator, slot, length, hidden, row) ==
           ContextCacheStatus::kOk;
  };
  // A founder's in the prefill; an unfinalised joiner's between steps, within its completed
  // chunks when it went in chunks.
  Row const* awaiting =
      slot >= 0 && slot < static_cast<int32_t>(req.rows.size()) &&
              (req.stage == Stage::kPrefill ||
               (req.stage == Stage::kIdle && !req.rows[static_cast<std::size_t>(slot)].joined))
          ? &req.rows[static_cast<std::size_t>(slot)]
          : nullptr;
  // A founder in the prefill computed its whole prompt (unless held after a first chunk); a
  // joiner or a held founder what its completed chunks did.
  bool const computed =
      awaiting != nullptr && ((req.stage == Stage::kPrefill && !awaiting->heldPrefill) ||
                              length <= awaiting->chunkCompleted);
  if (!valid || awaiting == nullptr || !computed) {
    reject(what, call);
    return;
  }
  Row& target = req.rows[static_cast<std::size_t>(slot)];
  noteCheckpoint(req, target, length, true);
  ContextCacheCoordinatorCounters const before = mCoordinator->counters();
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  bool const published = accept(what, call);
  ContextCacheCoordinatorCounters const& after = mCoordinator->counters();
  bool const captured = after.checkpointCaptures != before.checkpointCaptures;
  bool const failed = synchronised(what, calls, failures, captured ? 1 : 0);
  expectf(!(captured && target.endpointPublished), "{}: the row's endpoint was captured twice",
          what);
  if (failed) {
    expect(!published, what + ": returned true after a failed synchronisation");
    quarantine(req);
    req.stage = Stage::kGone;
    trace(what + ": synchronisation failed, request quarantined");
    return;
  }
  expect(published, what + " returned false");
  expect(!captured || !target.bypass, what + ": a bypass row captured an endpoint");
  if (captured || after.snapshotPressureSkips != before.snapshotPressureSkips) {
    target.pinsReleased = true;
  }
  // Published once committed: a commit that ran out of host memory skips the publication, and
  // the row may capture its endpoint again.
  target.endpointPublished =
      target.endpointPublished || after.hybridMtpPublications != before.hybridMtpPublications;
  auto const endpoints =
      static_cast<int64_t>(after.hybridMtpPublications - before.hybridMtpPublications);
  mStats.mtpEndpoints += endpoints;
  mStats.mtpBatchEndpoints += req.rows.size() > 1 ? endpoints : 0;
  trace(fmt::format("{}: {}", what, captured ? "captured" : "nothing to publish"));
}

/// restoreHybridMtpBoundaryHidden into row `row` of `hidden`: the restored row must be the base
/// hidden row of the boundary token (the last of the reused prefix), bit for bit, and the other
/// rows untouched.
void Lifecycle::restoreBoundaryHidden(Req& req, int32_t slot, Tensor& hidden, int32_t row,
                                      bool valid) {
  std::string const what =
      fmt::format("restoreHybridMtpBoundaryHidden({}, row {}) on {}", slot, row, describe(req));
  auto call = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->restoreHybridMtpBoundaryHidden(slot, hidden, row);
    }
    mCoordinator->restoreHybridMtpBoundaryHidden(req.coordinator, slot, hidden, row);
    return true;
  };
  if (!valid || !restorable(req, slot)) {
    reject(what, call);
    return;
  }
  std::size_t const rowBytes = static_cast<std::size_t>(kHiddenWidth) * 2;
  std::vector<uint8_t> expected(static_cast<std::size_t>(hidden.sizeBytes()), 0xa5);
  std::memcpy(hidden.rawPointer(), expected.data(), expected.size());
  expect(accept(what, call), what + " returned false");
  Row& restored = req.rows[static_cast<std::size_t>(slot)];
  testing::KvOracle::expectedRow(
      restored.digests.at(restored.start - 1), 7, 0,
      std::span<uint8_t>(expected.data() + static_cast<std::size_t>(row) * rowBytes, rowBytes));
  expectf(std::memcmp(hidden.rawPointer(), expected.data(), expected.size()) == 0,
          "{}: the restored boundary hidden row is not the one of the {}-token prefix", what,
          restored.start);
  ++mStats.boundaryHiddenRestores;
  restored.hiddenRestored = true;
  trace(what);
}

void Lifecycle::completePrefill(Req& req) {
  CompletePrefillCall call = planCompletePrefill(req);
  issueCompletePrefill(req, call);
}

/// The engine forgot the prefill's flush: the completion (valid otherwise) must throw
/// mkv::Error and change nothing (docs/architecture.md, "Device writes at the engine step").
void Lifecycle::refusedPrefillCompletion(Req& req) {
  CompletePrefillCall call = planCompletePrefill(req);
  ++mStats.forgottenFlushes;
  reject("completePrefill without the step's flush on " + describe(req),
         [&] { return callCompletePrefill(req, call); });
}

/// completePrefill through the request's path: the facade, the coordinator or the SWA manager.
bool Lifecycle::callCompletePrefill(Req& req, CompletePrefillCall const& call) {
  if (req.via == Via::kFacade) {
    return req.facade->completePrefill(call.context, call.common);
  }
  if (coordinatorBackend()) {
    return mCoordinator->finalizePrefillPublication(req.coordinator, call.advances, call.common) ==
           ContextCacheStatus::kOk;
  }
  mSwa->completePrefill(req.swa);
  return true;
}

/// Common state lengths given, two tokens after a prefill, more rows than the batch, or (on the
/// coordinator directly) advances for another batch or with wrong lengths.
void Lifecycle::badCompletePrefill(Req& req) {
  CompletePrefillCall call = planCompletePrefill(req);
  corruptCompletePrefill(req, call, req.rows.empty() ? 0 : mIn.below(4));
  issueCompletePrefill(req, call);
}

/// The engine samples the lookahead tokens after its prefill synchronisation.
Lifecycle::CompletePrefillCall Lifecycle::planCompletePrefill(Req& req) {
  CompletePrefillCall call;
  call.valid = req.stage == Stage::kPrefill;
  call.sampled = req.rows;
  bool const lookahead = req.contract == DecodingTokenStateContract::kCommittedPlusLookahead;
  if (lookahead && (call.valid || mIn.oneIn(2))) {
    for (Row& row : call.sampled) {
      if (row.generated.empty() && !row.heldPrefill) {  // a held founder samples nothing yet
        sampleInto(row);
      }
    }
  }
  std::swap(call.sampled, req.rows);
  call.context = contextOf(req);
  std::swap(call.sampled, req.rows);
  for (Row const& row : call.sampled) {
    auto const length = static_cast<int32_t>(row.prompt.size());
    if (row.heldPrefill) {
      call.advances.push_back({nullptr, 0, kHoldCommittedStateLength});
    } else if (lookahead) {
      call.advances.push_back({row.generated.empty() ? nullptr : &row.generated.back(), 1, length});
    } else {
      call.advances.push_back({nullptr, 0, length});
    }
  }
  // A speculative request gives its common (base and draft) lengths, the prompts; required when
  // it pairs a paged draft outside Hybrid-MTP, optional otherwise.
  if (req.speculative && ((req.paired && !req.mtp) || mIn.oneIn(2))) {
    for (Row const& row : call.sampled) {
      call.common.push_back(static_cast<int32_t>(row.prompt.size()));
    }
  }
  return call;
}

void Lifecycle::corruptCompletePrefill(Req const& req, CompletePrefillCall& call, int32_t variant) {
  DecodingInferenceContext& context = call.context;
  if (variant == 0 && req.speculative) {
    call.common.resize(call.sampled.size() + 1, 1);  // common lengths for another batch
  } else if (variant == 0) {
    call.common.push_back(1);  // common state lengths are for speculative requests
  } else if (variant == 1 && !context.generatedTokenIds.empty()) {
    context.generatedTokenIds[0].push_back(5);  // two tokens after a prefill
  } else if (variant == 2) {
    context.generatedTokenIds.emplace_back();  // more rows than the batch
    context.rawBatchedInputIds.emplace_back(1, 1);
  }
  // The SWA facade reads the context's row count and the generated lists of held founders,
  // which must be empty (common lengths and the other tokens it ignores).
  if (req.via == Via::kFacade) {
    bool const heldSampled = variant == 1 && !req.rows.empty() && req.rows[0].heldPrefill;
    call.badArguments = coordinatorBackend() ? variant <= 2 : variant == 2 || heldSampled;
    return;
  }
  if (!coordinatorBackend()) {
    return;  // the SWA manager's completePrefill takes no arguments
  }
  call.badArguments = true;
  switch (variant) {
    case 0:
      break;  // common lengths given
    case 1:
      call.advances.pop_back();
      break;
    case 2:
      call.advances[0].committedStateLength -= 1;
      break;
    default:
      call.advances[0].acceptedTokenCount += 1;
      break;
  }
  if (variant != 0) {
    call.common.clear();
  }
}

void Lifecycle::issueCompletePrefill(Req& req, CompletePrefillCall& call) {
  std::string const what = "completePrefill on " + describe(req);
  auto complete = [&] { return callCompletePrefill(req, call); };
  if (!call.valid || call.badArguments) {
    reject(what, complete);
    return;
  }
  uint64_t const published =
      coordinatorBackend() ? mCoordinator->counters().checkpointPublications : 0;
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  expect(accept(what, complete), what + " returned false");
  if (coordinatorBackend()) {
    (void)synchronised(what, calls, failures, 0);  // the runtime synchronised before the call
  }
  req.rows = std::move(call.sampled);
  req.stage = Stage::kIdle;
  req.trimmed = true;
  for (Row& row : req.rows) {
    if (row.heldPrefill) {  // an unfinalised joiner from here on; its prompt stays mapped
      row.heldPrefill = false;
      row.joined = false;
      continue;
    }
    row.windowFrom = row.endpoint;  // the SWA rows keep the prompt end's window
  }
  if (coordinatorBackend()) {
    mStats.checkpointsPublished +=
        static_cast<int64_t>(mCoordinator->counters().checkpointPublications - published);
  }
  // An EAGLE-style speculative request: the draft initialises after the call, and its prompt
  // endpoint waits for it (the first round, a compaction or finish synchronises it).
  // A held founder initialises its draft after its last chunk (its finalisation freezes it).
  req.draftInitPending = req.speculative && !req.mtp &&
                         std::ranges::any_of(req.rows, [](Row const& row) { return row.joined; });
  for (std::size_t i = 0; i < req.rows.size(); ++i) {
    Row& row = req.rows[i];
    if (!row.joined) {
      continue;  // a held founder: its checkpoints and draft come with its finalisation
    }
    row.common = static_cast<int32_t>(row.prompt.size());
    if (checkpointDeployment() && !req.mtp) {  // the prompt-end captures were committed
      noteCheckpoint(req, row, row.common, false);
    }
    if (row.paired && !req.mtp) {
      executeDraft(row, static_cast<int32_t>(i), static_cast<int32_t>(row.prompt.size()));
    }
  }
  trace(what);
}

// ---------------------------------------------------------------- decode

/// Whether prepareDecodeStep must succeed: no row passes the row width and (coordinator) the
/// growth of base and paired draft rows fits the free plus reclaimable pages of each pool.
Lifecycle::ModelDemand Lifecycle::modelDecodeDemand(Req const& req,
                                                    DecodingKvHeadroom const& headroom) const {
  ModelDemand demand;
  for (Row const& row : req.rows) {
    if (!row.joined) {
      continue;  // an unfinalised joiner holds: no growth
    }
    if (coordinatorBackend()) {
      int32_t const committed = row.materialized;
      int32_t const required = ceilPages(int64_t{committed} + headroom.baseExtraTokens);
      int32_t const draft = ceilPages(int64_t{committed} + headroom.draftExtraTokens);
      // The sliding half's window would pass the row too (a stopped row moves as well).
      if (required > mWidth || (row.paired && draft > mWidth) ||
          (slidingReuse() && ceilPages(int64_t{row.endpoint} + 1) > mWidth)) {
        demand.tableFull = true;
        continue;  // the library does not count a full row's pages either
      }
      demand.base += std::max(0, required - mappedPages(row));
      if (row.paired) {
        demand.draft += std::max(0, draft - mappedDraftPages(row));
      }
    } else if (ceilPages(int64_t{row.endpoint} + 1) > mWidth) {
      demand.tableFull = true;
    }
  }
  return demand;
}

bool Lifecycle::decodeFits(Req const& req, DecodingKvHeadroom const& headroom) const {
  ModelDemand const demand = modelDecodeDemand(req, headroom);
  if (demand.tableFull || !coordinatorBackend()) {
    return !demand.tableFull;
  }
  ResourcePools const& pools = mCoordinator->manager().pools();
  return demand.base <= pools.freeCount(ResourceType::kBaseKvPage) +
                            pools.reclaimableCount(ResourceType::kBaseKvPage) &&
         demand.draft <= pools.freeCount(ResourceType::kDraftKvPage) +
                             pools.reclaimableCount(ResourceType::kDraftKvPage);
}

void Lifecycle::checkDecodeDemand(Req const& req, DecodingKvHeadroom const& headroom) {
  DecodeStepDemand demand;
  if (req.via == Via::kFacade) {
    demand = req.facade->decodeStepDemand(headroom);
  } else if (coordinatorBackend()) {
    demand = mCoordinator->decodeStepDemand(req.coordinator, headroom);
  } else {
    demand = mSwa->decodeStepDemand(req.swa);
  }
  ModelDemand const model = modelDecodeDemand(req, headroom);
  std::string const what = "decodeStepDemand on " + describe(req);
  expectf((demand.tableFull.reason == RowFailureReason::kTableFull) == model.tableFull,
          "{}: a row past its table width: {}, the model says {}", what,
          toString(demand.tableFull.reason), model.tableFull);
  expectf(demand.basePages == model.base && demand.draftPages == model.draft,
          "{}: base / draft pages {} / {}, the model says {} / {}", what, demand.basePages,
          demand.draftPages, model.base, model.draft);
  if (!slidingReuse()) {  // bounded SWA's rows keep their pages; only the page source lends
    expectf(demand.slidingPages == 0, "{}: {} sliding pages without a page source", what,
            demand.slidingPages);
  }
}

int32_t Lifecycle::mappedPages(Row const& row) const {
  return mRuntime->fullPageTable()->liveEntryCount(row.resident.slot);
}

int32_t Lifecycle::mappedDraftPages(Row const& row) const {
  return mRuntime->draftPageTable()->liveEntryCount(row.resident.slot);
}

void Lifecycle::prepareDecode(Req& req) {
  bool const valid = req.stage == Stage::kIdle;
  DecodeCall call = planDecode(req, valid);
  issueDecode(req, call, valid);
}

/// A headroom the deployment does not have, or (coordinator facade) more token lists than rows.
void Lifecycle::badPrepareDecode(Req& req) {
  bool const valid = req.stage == Stage::kIdle;
  DecodeCall call = planDecode(req, valid);
  call.badArguments = true;
  if (mIn.oneIn(2)) {
    // No base headroom, or a draft headroom that disagrees with the request's pairing.
    call.headroom = mIn.oneIn(2) ? DecodingKvHeadroom{0, req.headroom.draftExtraTokens}
                                 : DecodingKvHeadroom{1, req.paired ? 0 : 3};
  } else if (req.via == Via::kFacade && coordinatorBackend()) {
    call.context.generatedTokenIds.emplace_back();
  } else {
    call.headroom = DecodingKvHeadroom{-1, 0};
  }
  issueDecode(req, call, valid);
}

/// Cancellations reach the backend with the step (no token for those rows); the coordinator
/// may be asked for more headroom.
Lifecycle::DecodeCall Lifecycle::planDecode(Req& req, bool valid) {
  DecodeCall call;
  for (Row& row : req.rows) {
    call.reasons.push_back(row.reason);
    if (valid && row.reason == FinishReason::kNotFinished && row.joined && mIn.oneIn(12)) {
      row.reason = FinishReason::kCancelled;
    }
  }
  if (coordinatorBackend() && mIn.oneIn(4) && !slidingReuse()) {  // sliding reuse: {1, 0} only
    call.headroom.baseExtraTokens = 2;
  }
  if (req.speculative) {
    // A verification round: each running row accepts 1 to baseExtraTokens tokens.
    call.headroom = req.headroom;
    for (Row& row : req.rows) {
      if (valid) {  // an invalid call leaves the pending step's counts alone
        row.accepted = 1 + mIn.below(req.headroom.baseExtraTokens);
      }
    }
  }
  call.context = contextOf(req);
  return call;
}

void Lifecycle::issueDecode(Req& req, DecodeCall& call, bool valid) {
  std::string const what = "prepareDecodeStep on " + describe(req);
  if ((!coordinatorBackend() || slidingReuse()) && call.headroom != kVanilla &&
      req.via == Via::kFacade) {
    call.badArguments = true;  // the SWA and sliding-reuse facades need {1, 0}
  }
  auto prepare = [&]() -> bool {
    if (req.via == Via::kFacade) {
      return req.facade->prepareDecodeStep(call.context, call.headroom);
    }
    if (coordinatorBackend()) {
      return mCoordinator->prepareDecodeStep(req.coordinator, call.headroom) ==
             ContextCacheStatus::kOk;
    }
    return mSwa->prepareDecodeStep(req.swa) == SwaKVCacheStatus::kOk;  // takes no headroom
  };
  bool const directSwa = req.via == Via::kDirect && !coordinatorBackend();
  if (!valid || (call.badArguments && !directSwa)) {
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      req.rows[i].reason = call.reasons[i];
    }
    reject(what, prepare);
    return;
  }
  if (valid && !call.badArguments) {
    checkDecodeDemand(req, call.headroom);
  }
  bool const fits = decodeFits(req, call.headroom);
  // Sliding-window reuse: a row whose retired page stayed held elsewhere went on without a spare
  // and may find no page now (pool pressure: the step is refused).
  bool slidingPressure = false;
  if (slidingReuse()) {
    WindowBlockCache const& window = *mRuntime->windowBlockCache();
    slidingPressure =
        window.freePages() + window.evictablePages() < static_cast<int32_t>(req.rows.size());
  }
  bool prepared = false;
  try {
    prepared = accept(what, prepare);
  } catch (AllocationFailed const&) {
    req.stepMaybePrepared = slidingReuse();
    throw;
  }
  expectf(prepared == fits || (!prepared && slidingPressure), "{}: returned {}, expected {}", what,
          prepared, fits);
  if (!prepared) {
    // The failing row fails alone: the request stays between steps, so the next operations may
    // preempt or compact rows away and prepare the step again, or finish.
    ++mStats.refusals;
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      req.rows[i].reason = call.reasons[i];  // cancellations reach the backend with a step
    }
    trace(what + ": refused, the request goes on");
    return;
  }
  req.stage = Stage::kDecode;
  for (Row& row : req.rows) {
    row.decoded = false;
    if (windowRows() && row.joined) {  // the manager moves every sequence's window but a
      row.windowFrom = row.endpoint;   // joiner's that is not finalised
      ++row.endpoint;
    }
  }
  // Engine-step writes: the flush before the step's forward. A forgotten one: the forward's
  // writes miss where a device row is still empty, the completion must refuse, then the engine
  // flushes and makes the step's writes again.
  bool const forgot = forgetFlush();
  if (!forgot) {
    flushForStep();
  }
  std::vector<std::pair<int32_t, int32_t>> written;  // per row: materialised and drafted before
  mStaleRows = forgot;
  for (std::size_t i = 0; i < req.rows.size(); ++i) {
    Row& row = req.rows[i];
    written.emplace_back(row.materialized, row.drafted);
    if (row.reason == FinishReason::kNotFinished && row.joined) {
      executeDecode(req, row, static_cast<int32_t>(i));
      if (row.paired) {  // the draft catches up, possibly lagging a token or two
        executeDraft(row, static_cast<int32_t>(i),
                     std::max(row.drafted, row.materialized - mIn.below(3)));
      }
    } else if (swaJoiner(row) && !forgot && row.materialized == row.windowFrom &&
               row.endpoint > row.materialized && !mIn.oneIn(4)) {
      executeSwaChunk(req, row, static_cast<int32_t>(i));  // its staged chunk runs in the step
      ++mStats.swaStepChunks;
    }
  }
  mStaleRows = false;
  if (forgot) {
    if (mRuntime->deviceWritesPending()) {
      refusedDecodeCompletion(req);
    }
    flushForStep();
    for (std::size_t i = 0; i < req.rows.size(); ++i) {
      Row const& row = req.rows[i];
      auto const [materialized, drafted] = written[i];
      for (testing::KvOracle* oracle : {mFullOracle.get(), mSwaOracle.get()}) {
        if (oracle != nullptr && row.materialized > materialized) {
          oracle->write(row.resident.slot, row.digests, materialized, row.materialized);
        }
      }
      if (row.paired && row.drafted > drafted) {
        mDraftOracle->write(row.resident.slot, row.draft, drafted, row.drafted);
      }
    }
  }
  ++mStats.decodeSteps;
  trace(what);
}

void Lifecycle::completeDecode(Req& req) {
  CompleteDecodeCall call = planCompleteDecode(req);
  issueCompleteDecode(req, call);
}

/// The engine forgot the decode step's flush: the completion must throw and change nothing.
void Lifecycle::refusedDecodeCompletion(Req& req) {
  CompleteDecodeCall call = planCompleteDecode(req);
  ++mStats.forgottenFlushes;
  reject("completeDecodeStep without the step's flush on " + describe(req),
         [&] { return callCompleteDecode(req, call); });
}

/// completeDecodeStep through the request's path: the facade, the coordinator or the SWA manager.
bool Lifecycle::callCompleteDecode(Req& req, CompleteDecodeCall const& call) {
  if (req.via == Via::kFacade) {
    return req.facade->completeDecodeStep(call.context, call.common);
  }
  if (coordinatorBackend()) {
    return mCoordinator->completeDecodeStep(req.coordinator, call.advances, call.completed,
                                            call.common) == ContextCacheStatus::kOk;
  }
  mSwa->completeDecodeStep(req.swa);
  return true;
}

void Lifecycle::badCompleteDecode(Req& req) {
  CompleteDecodeCall call = planCompleteDecode(req);
  corruptCompleteDecode(req, call);
  issueCompleteDecode(req, call);
}

/// The engine's sampling decided which rows finished with their token.
Lifecycle::CompleteDecodeCall Lifecycle::planCompleteDecode(Req& req) {
  CompleteDecodeCall call;
  call.valid = req.stage == Stage::kDecode;
  call.rows = req.rows;
  for (std::size_t i = 0; i < call.rows.size(); ++i) {
    Row& row = call.rows[i];
    if (row.decoded && mIn.oneIn(6)) {
      row.reason = mIn.oneIn(2) ? FinishReason::kEndOfSequence : FinishReason::kLength;
    }
    if (row.decoded && row.reason != FinishReason::kNotFinished &&
        !stoppedWithoutPublishing(row.reason)) {
      call.completed.push_back(static_cast<int32_t>(i));
    }
    // A row that stopped earlier and was not compacted away produced no token: the runtime
    // must report it cancelled or errored (facade on the coordinator).
    if (!row.decoded && row.joined && !stoppedWithoutPublishing(row.reason) &&
        row.reason != FinishReason::kNotFinished && !mIn.oneIn(8)) {
      row.reason = FinishReason::kError;
    }
  }
  if (req.via == Via::kFacade && coordinatorBackend() && call.valid) {
    for (Row const& row : call.rows) {
      if (row.joined && !row.decoded && !stoppedWithoutPublishing(row.reason)) {
        call.valid = false;  // "row produced no token but is not cancelled or errored"
      }
    }
  }
  std::swap(call.rows, req.rows);
  call.context = contextOf(req);
  std::swap(call.rows, req.rows);
  for (Row const& row : call.rows) {
    if (row.decoded) {
      int32_t const accepted = std::max(1, row.accepted);
      call.advances.push_back(
          {&row.generated[row.generated.size() - static_cast<std::size_t>(accepted)], accepted,
           row.materialized});
    } else {
      call.advances.push_back({nullptr, 0, kHoldCommittedStateLength});
    }
  }
  // Common lengths: the draft's on an EAGLE-style paired request (required); optional otherwise,
  // where the draft reads the base KV or (Hybrid-MTP) they are derived from the committed ones.
  if (req.speculative && ((req.paired && !req.mtp) || mIn.oneIn(2))) {
    for (Row const& row : call.rows) {
      int32_t const common = req.paired && !req.mtp ? row.drafted : row.materialized;
      call.common.push_back(row.decoded ? common : row.common);
    }
  }
  return call;
}

/// Common lengths or a missing finish reason (facade on the coordinator); advances or
/// completions for another batch (the coordinator directly). The SWA calls take no arguments.
void Lifecycle::corruptCompleteDecode(Req const& req, CompleteDecodeCall& call) {
  // Without rows only the common lengths can be wrong.
  int32_t const variant = call.rows.empty() ? 2 : mIn.below(5);
  if (!coordinatorBackend()) {
    return;
  }
  call.badArguments = true;
  if (req.via == Via::kFacade) {
    if (variant <= 2 && req.speculative) {
      call.common.resize(call.rows.size() + 1, 1);  // common lengths for another batch
    } else if (variant <= 2) {
      call.common.push_back(1);
    } else {
      call.context.finishReasons.pop_back();
    }
    return;
  }
  std::vector<ContextCacheSequenceAdvance>& advances = call.advances;
  switch (variant) {
    case 0:
      advances.pop_back();
      break;
    case 1:
      call.completed.push_back(static_cast<int32_t>(call.rows.size()));
      break;
    case 2:
      if (req.speculative) {
        call.common.resize(call.rows.size() + 1, 1);
      } else {
        call.common.push_back(1);
      }
      break;
    case 3:
      if (!call.completed.empty()) {
        call.completed.push_back(call.completed.front());
      } else {
        advances[0] = {nullptr, 0, 0};  // a zero advance without the hold sentinel
      }
      break;
    default:
      if (call.rows[0].decoded) {
        advances[0].committedStateLength += 1;
      } else {
        advances[0] = {nullptr, 0, 0};
      }
      break;
  }
}

void Lifecycle::issueCompleteDecode(Req& req, CompleteDecodeCall& call) {
  std::string const what = "completeDecodeStep on " + describe(req);
  auto complete = [&] { return callCompleteDecode(req, call); };
  if (!call.valid || call.badArguments) {
    reject(what, complete);
    return;
  }
  ContextCacheCoordinatorCounters const before =
      coordinatorBackend() ? mCoordinator->counters() : ContextCacheCoordinatorCounters{};
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  bool const completed = accept(what, complete);
  req.rows = std::move(call.rows);
  // Checkpoint runtimes capture the rows that finished normally and synchronise once.
  if (quarantinedByCapture(req, what, before, calls, failures, completed)) {
    return;
  }
  expect(completed, what + " returned false");
  if (coordinatorBackend()) {
    mStats.checkpointsPublished += static_cast<int64_t>(
        mCoordinator->counters().checkpointPublications - before.checkpointPublications);
  }
  for (std::size_t i = 0; i < req.rows.size(); ++i) {
    Row& row = req.rows[i];
    if (checkpointDeployment() && row.decoded && !req.mtp) {  // decode-end captures
      noteCheckpoint(req, row, row.materialized, false);
    }
    if (req.speculative && row.decoded) {
      row.common = call.common.empty() ? row.materialized : call.common[i];
      mStats.acceptedTokens += std::max(1, row.accepted);
    }
    row.decoded = false;
    row.accepted = 0;
    if (row.joined) {  // an unfinalised joiner keeps its prefill's mapping until finalised
      row.windowFrom = row.endpoint;
    }
  }
  if (req.speculative) {
    ++mStats.verificationRounds;
    req.draftInitPending = false;  // the round's synchronisation covered the initialisation
  }
  req.stage = Stage::kIdle;
  trace(what);
}

}  // namespace mkv::fuzz::lifecycle
