/// \file ending_operations.cpp
/// How requests end: finish (the documented call), drop (destroying the handle: the backend
/// abandons the request), shutdown of the runtime or the backend (draining the quarantine), and
/// the injected synchronisation faults that decide whether an ending quarantines.

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::fuzz::lifecycle {

/// Moves the rows of a request whose synchronisation failed into the quarantine.
void Lifecycle::quarantine(Req& req) {
  Quarantined q;
  if (!coordinatorBackend()) {
    for (Row const& row : req.rows) {
      q.swaPages += swaRowPages(req, row);
    }
  }
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
void Lifecycle::released(Req& req) {
  for (Row const& row : req.rows) {
    mRuntime->residentSlots().release(row.resident);
  }
  req.rows.clear();
  if (mLengthOwner == req.serial) {
    mLengthOwner = 0;
  }
}

void Lifecycle::finish(Req& req) {
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
    expectf(finished == !mPoisoned, "{}: finish of an ended request returned {}", what, finished);
    return;
  }
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  bool const finished = accept(what, call);
  bool const failed = synchronised(what, calls, failures, endingSyncs(req));
  if (failed) {
    quarantine(req);
  } else {
    released(req);
  }
  expectf(finished == !mPoisoned, "{}: returned {} with the backend {}", what, finished,
          mPoisoned ? "poisoned" : "healthy");
  req.stage = Stage::kGone;
  trace(what + (failed ? ": synchronisation failed, quarantined" : ""));
}

/// Destroys the request's handle: the backend abandons it.
void Lifecycle::drop(std::size_t index) {
  Req& req = *mRequests[index];
  std::string const what = "drop " + describe(req);
  int64_t const calls = syncCalls();
  int64_t const failures = syncFailures();
  int64_t syncs = endingSyncs(req);  // pending work, or an EAGLE draft initialisation
  {
    LibraryCall scope;  // destructors are noexcept: a std::bad_alloc here terminates
    ++mStats.libraryCalls;
    req.facade.reset();
    req.coordinator = ContextCacheCoordinator::RequestHandle();
    req.swa = BoundedSwaKVPageManager::RequestHandle();
  }
  if (req.stepMaybePrepared && syncCalls() - calls == 1) {
    syncs = 1;  // the full half's step had been prepared
  }
  if (req.stage != Stage::kGone) {
    if (synchronised(what, calls, failures, syncs)) {
      quarantine(req);
    } else {
      released(req);
    }
  }
  ++mStats.drops;
  trace(what);
  mRequests.erase(mRequests.begin() + static_cast<std::ptrdiff_t>(index));
}

/// `fromInput`: the input picks the runtime's or the backend's shutdown (teardown: runtime) or,
/// on a context-reuse backend, clearing the prefix cache instead. One input byte either way: its
/// parity picks the shutdown as before, so a byte of 3 mod 4 is the only one whose meaning
/// changed when the reset joined.
void Lifecycle::shutdown(bool fromInput) {
  int32_t const choice = fromInput ? mIn.below(4) : 1;
  if (choice == 3 && coordinatorBackend()) {
    resetPrefixCache();
    return;
  }
  // Sliding-window reuse: the runtime's shutdown drains both halves under one synchronisation.
  bool const direct = choice % 2 == 0 && !slidingReuse();
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
  expectf(ok == idle, "{}: returned {} with {} live requests", what, ok, liveRequests());
  expect(!direct || ok || requestFailed, what + ": neither kOk nor kRequestFailed");
  trace(what);
}

/// ContextCacheCoordinator::resetPrefixCache: refused, changing nothing, while a request is
/// active or quarantined or the coordinator is poisoned; otherwise every record goes, the index
/// empties and the counters say so. Host bookkeeping only: never synchronises.
void Lifecycle::resetPrefixCache() {
  std::string const what = "reset prefix cache";
  ContextCacheMetrics const before = mCoordinator->metrics();
  int64_t const calls = syncCalls();
  bool cleared = false;
  {
    LibraryCall scope;
    ++mStats.libraryCalls;
    cleared = mCoordinator->resetPrefixCache();
  }
  expectf(syncCalls() == calls, "{}: synchronised {} times", what, syncCalls() - calls);
  bool const allowed = liveRequests() == 0 && mQuarantine.empty() && !mPoisoned;
  expectf(cleared == allowed, "{}: returned {} with {} live and {} quarantined requests{}", what,
          cleared, liveRequests(), mQuarantine.size(), mPoisoned ? ", poisoned" : "");
  ContextCacheMetrics const after = mCoordinator->metrics();
  if (!cleared) {
    expect(after.records == before.records && after.indexedBlocks == before.indexedBlocks &&
               after.prefixCacheResets == before.prefixCacheResets,
           what + ": a refused reset changed the cache");
    trace(what + ": refused");
    return;
  }
  expectf(after.records == 0 && after.indexedBlocks == 0,
          "{}: {} records and {} indexed blocks remain", what, after.records, after.indexedBlocks);
  expect(after.prefixCacheResets == before.prefixCacheResets + 1 &&
             after.resetRecords == before.resetRecords + static_cast<uint64_t>(before.records) &&
             after.evictedRecords == before.evictedRecords,
         what + ": the reset counters disagree with the records dropped");
  ++mStats.cacheResets;
  mStats.cacheResetRecords += before.records;
  trace(fmt::format("{}: {} records dropped", what, before.records));
}

void Lifecycle::armSyncFault() {
  if (!mOptions.inputFaults) {
    return;
  }
  if (mIn.oneIn(4)) {
    mSync.throwNext();
    trace("the next synchronisation throws");
  } else {
    mSync.failNext(1 + mIn.below(2));
    trace(fmt::format("the next {} synchronisations fail", mSync.pendingFailures()));
  }
}

}  // namespace mkv::fuzz::lifecycle
