/// \file step_operations.cpp
/// The steps of a request on either backend: preparePrefill, the prefill captures,
/// completePrefill, prepareDecodeStep and completeDecodeStep, each valid (`preparePrefill`, ...)
/// and with corrupted arguments (`badPreparePrefill`, ...). Whether the stage allows the call is
/// the model's decision in both forms.

#include <algorithm>

#include "fuzz/lifecycle/lifecycle.h"

namespace mkv::fuzz::lifecycle {

// ---------------------------------------------------------------- prefill

std::vector<int32_t> Lifecycle::swaPrefillLengths(Req const& req) const {
  std::vector<int32_t> lengths;
  for (Row const& row : req.rows) {
    lengths.push_back(static_cast<int32_t>(row.prompt.size()));
  }
  return lengths;
}

/// Another request may not prefill now: the coordinator executes one request at a time, and
/// the SWA length pools follow their owner until it finishes.
bool Lifecycle::prefillBlockedByAnother(Req const& req) {
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

/// preparePrefill then prepareSwaPrefill through the facade; false when the call was rejected.
/// `validLengths`: the stage allows the prefill and the SWA lengths are right.
bool Lifecycle::issueFacadePreparePrefill(Req& req, std::vector<int32_t> const& lengths,
                                          bool validLengths, std::string const& what) {
  ManagedKVCacheRequest& facade = *req.facade;
  if (coordinatorBackend()) {
    bool const valid = req.stage == Stage::kAdmitted && !prefillBlockedByAnother(req);
    if (!valid) {
      reject(what, [&] { return facade.preparePrefill(); });
      return false;
    }
    expect(accept(what, [&] { return facade.preparePrefill(); }), what + " returned false");
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

void Lifecycle::completePrefill(Req& req) {
  CompletePrefillCall call = planCompletePrefill(req);
  issueCompletePrefill(req, call);
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
      if (row.generated.empty()) {
        sampleInto(row);
      }
    }
  }
  std::swap(call.sampled, req.rows);
  call.context = contextOf(req);
  std::swap(call.sampled, req.rows);
  for (Row const& row : call.sampled) {
    auto const length = static_cast<int32_t>(row.prompt.size());
    if (lookahead) {
      call.advances.push_back({row.generated.empty() ? nullptr : &row.generated.back(), 1, length});
    } else {
      call.advances.push_back({nullptr, 0, length});
    }
  }
  return call;
}

void Lifecycle::corruptCompletePrefill(Req const& req, CompletePrefillCall& call, int32_t variant) {
  DecodingInferenceContext& context = call.context;
  if (variant == 0) {
    call.common.push_back(1);  // common state lengths are for speculative requests
  } else if (variant == 1 && !context.generatedTokenIds.empty()) {
    context.generatedTokenIds[0].push_back(5);  // two tokens after a prefill
  } else if (variant == 2) {
    context.generatedTokenIds.emplace_back();  // more rows than the batch
    context.rawBatchedInputIds.emplace_back(1, 1);
  }
  // The SWA facade reads only the context's row count (common lengths and tokens it ignores).
  if (req.via == Via::kFacade) {
    call.badArguments = coordinatorBackend() ? variant <= 2 : variant == 2;
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
  auto complete = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->completePrefill(call.context, call.common);
    }
    if (coordinatorBackend()) {
      return mCoordinator->finalizePrefillPublication(req.coordinator, call.advances,
                                                      call.common) == ContextCacheStatus::kOk;
    }
    mSwa->completePrefill(req.swa);
    return true;
  };
  if (!call.valid || call.badArguments) {
    reject(what, complete);
    return;
  }
  expect(accept(what, complete), what + " returned false");
  req.rows = std::move(call.sampled);
  req.stage = Stage::kIdle;
  req.trimmed = true;
  trace(what);
}

// ---------------------------------------------------------------- decode

/// Whether prepareDecodeStep must succeed: no row passes the row width and (coordinator) the
/// growth fits the free plus reclaimable pages.
bool Lifecycle::decodeFits(Req const& req, int32_t baseExtra) const {
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

int32_t Lifecycle::mappedPages(Row const& row) const {
  return mRuntime->fullPageTable()->liveEntryCount(row.resident.slot);
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
    call.headroom = mIn.oneIn(2) ? DecodingKvHeadroom{0, 0} : DecodingKvHeadroom{1, 3};
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
  if (coordinatorBackend() && mIn.oneIn(4)) {
    call.headroom.baseExtraTokens = 2;
  }
  call.context = contextOf(req);
  return call;
}

void Lifecycle::issueDecode(Req& req, DecodeCall& call, bool valid) {
  std::string const what = "prepareDecodeStep on " + describe(req);
  if (!coordinatorBackend() && call.headroom != kVanilla && req.via == Via::kFacade) {
    call.badArguments = true;  // the SWA facade needs {1, 0}
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
  bool const fits = decodeFits(req, call.headroom.baseExtraTokens);
  bool const prepared = accept(what, prepare);
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

void Lifecycle::completeDecode(Req& req) {
  CompleteDecodeCall call = planCompleteDecode(req);
  issueCompleteDecode(req, call);
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
      call.advances.push_back({&row.generated.back(), 1, row.materialized});
    } else {
      call.advances.push_back({nullptr, 0, kHoldCommittedStateLength});
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
    if (variant <= 2) {
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
      call.common.push_back(1);
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
  auto complete = [&] {
    if (req.via == Via::kFacade) {
      return req.facade->completeDecodeStep(call.context, call.common);
    }
    if (coordinatorBackend()) {
      return mCoordinator->completeDecodeStep(req.coordinator, call.advances, call.completed,
                                              call.common) == ContextCacheStatus::kOk;
    }
    mSwa->completeDecodeStep(req.swa);
    return true;
  };
  if (!call.valid || call.badArguments) {
    reject(what, complete);
    return;
  }
  expect(accept(what, complete), what + " returned false");
  req.rows = std::move(call.rows);
  for (Row& row : req.rows) {
    row.decoded = false;
    row.windowFrom = row.endpoint;
  }
  req.stage = Stage::kIdle;
  trace(what);
}

}  // namespace mkv::fuzz::lifecycle
