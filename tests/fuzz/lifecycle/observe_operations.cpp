/// \file observe_operations.cpp
/// Observers (what the facade and the backends report about a request must agree with the
/// model, and change nothing) and calls on invalid handles.

#include <algorithm>

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::fuzz::lifecycle {

void Lifecycle::observe(Req& req) {
  std::string const what = "observe " + describe(req);
  int32_t const slot =
      static_cast<int32_t>(mIn.below(static_cast<int32_t>(req.rows.size()) + 2)) - 1;
  bool const inBatch = slot >= 0 && slot < static_cast<int32_t>(req.rows.size());
  if (req.via == Via::kFacade) {
    observeFacade(req, slot, inBatch, what);
  } else if (req.stage == Stage::kGone) {
    if (coordinatorBackend()) {
      reject(what + " batchSize", [&] { return mCoordinator->batchSize(req.coordinator); });
    } else {
      reject(what + " batchSize", [&] { return mSwa->batchSize(req.swa); });
    }
  } else if (coordinatorBackend()) {
    observeCoordinator(req, slot, inBatch, what);
  } else {
    observeSwa(req, slot, inBatch, what);
  }
}

/// The facade: its backend kind, Hybrid-MTP calls a non-hybrid deployment rejects, prefill
/// starts and reuse lengths.
void Lifecycle::observeFacade(Req& req, int32_t slot, bool inBatch, std::string const& what) {
  ManagedKVCacheRequest& facade = *req.facade;
  Tensor hidden({4, 4}, DataType::kFloat16, DeviceType::kCPU);
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
}

/// The coordinator's view of a live request: batch size, committed and reuse lengths, and the
/// lease pages the row maps.
void Lifecycle::observeCoordinator(Req& req, int32_t slot, bool inBatch, std::string const& what) {
  ContextCacheCoordinator::RequestHandle const& handle = req.coordinator;
  expect(unchanged(what, [&] { return mCoordinator->batchSize(handle); }) ==
             static_cast<int32_t>(req.rows.size()),
         what + ": batchSize");
  if (!inBatch) {
    reject(what + " committedLength", [&] { return mCoordinator->committedLength(handle, slot); });
    reject(what + " basePages", [&] { return mCoordinator->basePages(handle, slot); });
    return;
  }
  Row const& row = req.rows[static_cast<std::size_t>(slot)];
  // An unfinalised joiner or a founder holding its first chunk: what its completed prefill chunks
  // told the library (its start before).
  int32_t const committed = !row.joined || row.heldPrefill ? row.chunkCompleted
                            : req.stage == Stage::kAdmitted || req.stage == Stage::kPrefill
                                ? row.start
                                : row.materialized - (row.decoded ? std::max(1, row.accepted) : 0);
  expectf(unchanged(what, [&] { return mCoordinator->committedLength(handle, slot); }) == committed,
          "{}: committedLength of row {} is not {}", what, slot, committed);
  expect(mCoordinator->reuseTokenLength(handle, slot) == row.start, what + ": reuseTokenLength");
  if (!row.bound) {
    return;
  }
  std::span<PageId const> const pages = mCoordinator->basePages(handle, slot);
  KVPageTable const& table = *mRuntime->fullPageTable();
  expect(static_cast<int32_t>(pages.size()) == table.liveEntryCount(row.resident.slot),
         what + ": lease pages and row disagree");
  for (std::size_t p = 0; p < pages.size(); ++p) {
    expect(table.entry(row.resident.slot, static_cast<int32_t>(p)) == pages[p],
           what + ": lease page and row entry disagree");
  }
  std::span<PageId const> const draft = mCoordinator->draftPages(handle, slot);
  if (!row.paired) {
    expect(draft.empty(), what + ": a row without a paired draft holds draft pages");
    return;
  }
  KVPageTable const& draftTable = *mRuntime->draftPageTable();
  expect(static_cast<int32_t>(draft.size()) == draftTable.liveEntryCount(row.resident.slot),
         what + ": lease draft pages and draft row disagree");
  for (std::size_t p = 0; p < draft.size(); ++p) {
    expect(draftTable.entry(row.resident.slot, static_cast<int32_t>(p)) == draft[p],
           what + ": lease draft page and draft row entry disagree");
  }
}

/// The SWA manager's view of a live row: the retained window of its endpoint; whether the
/// request has a joiner to retract (its newest row, between steps, not the only one: a held
/// founder may be alone).
void Lifecycle::observeSwa(Req& req, int32_t slot, bool inBatch, std::string const& what) {
  BoundedSwaKVPageManager::RequestHandle const& handle = req.swa;
  bool const retractable =
      req.stage == Stage::kIdle && req.rows.size() > 1 && !req.rows.back().joined;
  expectf(unchanged(what, [&] { return mSwa->hasRetractableAdmission(handle); }) == retractable,
          "{}: hasRetractableAdmission is not {}", what, retractable);
  if (!inBatch) {
    reject(what + " state", [&] { return mSwa->state(handle, slot); });
    return;
  }
  SwaSequenceState const& state =
      unchanged(what, [&]() -> SwaSequenceState const& { return mSwa->state(handle, slot); });
  Row const& row = req.rows[static_cast<std::size_t>(slot)];
  if (row.bound) {
    int32_t const from = std::max(0, row.endpoint - mWindow) / kPage;
    expectf(state.retainedBegin == from && state.retainedEnd == ceilPages(row.endpoint),
            "{}: retained [{}, {}) for endpoint {}", what, state.retainedBegin, state.retainedEnd,
            row.endpoint);
  }
}

/// Calls with a default-constructed (invalid) handle.
void Lifecycle::staleHandle() {
  std::string const what = "invalid handle";
  if (coordinatorBackend()) {
    ContextCacheCoordinator::RequestHandle stale;
    reject(what + " preparePrefill", [&] { mCoordinator->preparePrefill(stale); });
    reject(what + " prepareDecodeStep",
           [&] { return mCoordinator->prepareDecodeStep(stale, kVanilla); });
    expect(!unchanged(what + " retract",
                      [&] { return mCoordinator->retractSequenceAdmission(stale); }),
           what + ": retract of an invalid handle returned true");
    ContextCacheStatus const status =
        unchanged(what + " finish", [&] { return mCoordinator->finish(stale); });
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

}  // namespace mkv::fuzz::lifecycle
