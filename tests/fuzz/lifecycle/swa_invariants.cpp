/// \file swa_invariants.cpp
/// The bounded-SWA manager's invariants after every operation: request count, what each
/// request's rows hold and where their windows end, quarantined pages, page conservation.

#include "fuzz/lifecycle/lifecycle.h"

namespace mkv::fuzz::lifecycle {

void Lifecycle::checkSwaManager() {
  BoundedSwaKVPageManager const& s = *mSwa;
  expectf(s.activeRequestCount() == liveRequests(),
          "SWA manager has {} active requests, the driver {}", s.activeRequestCount(),
          liveRequests());
  int32_t held = 0;
  for (auto const& req : mRequests) {
    if (req->stage == Stage::kGone) {
      continue;
    }
    int32_t const rowPages = static_cast<int32_t>(req->rows.size()) * swaRowPages(*req);
    held += rowPages;
    checkSwaRequest(*req, rowPages);
  }
  int32_t quarantined = 0;
  for (Quarantined const& q : mQuarantine) {
    quarantined += q.swaPages;
  }
  expectf(s.quarantinedPageCount() == quarantined, "{} pages quarantined, expected {}",
          s.quarantinedPageCount(), quarantined);
  expectf(s.freePageCount() + held + quarantined == s.totalPageCount(),
          "SWA page conservation: {} free + {} held + {} quarantined != {}", s.freePageCount(),
          held, quarantined, s.totalPageCount());
  // The public capacity query agrees: bounded SWA keeps no cache, so nothing is reclaimable.
  std::optional<PagePoolUsage> const sliding = mRuntime->capacity().sliding;
  expect(sliding.has_value(), "capacity() reports no sliding pool");
  if (sliding) {
    expectf(sliding->totalPages == s.totalPageCount() && sliding->freePages == s.freePageCount() &&
                sliding->reclaimablePages == 0 && sliding->leasedPages == held + quarantined,
            "capacity() says {} total, {} free, {} leased; the rows hold {} of {}",
            sliding->totalPages, sliding->freePages, sliding->leasedPages, held + quarantined,
            s.totalPageCount());
  }
}

/// The rows of a live request: their residents, endpoints and the pages they hold.
void Lifecycle::checkSwaRequest(Req const& req, int32_t rowPages) {
  if (!req.swa.valid()) {
    return;
  }
  int32_t reported = 0;
  for (int32_t i = 0; i < mSwa->batchSize(req.swa); ++i) {
    SwaSequenceState const& state = mSwa->state(req.swa, i);
    reported += state.heldPages();
    Row const& row = req.rows[static_cast<std::size_t>(i)];
    expectf(state.resident == row.resident, "{} row {} has resident slot {}", describe(req), i,
            state.resident.slot);
    expectf(state.pendingEndpoint.value_or(state.endpoint) == row.endpoint,
            "{} row {}: endpoint {} (pending {}), expected {}", describe(req), i, state.endpoint,
            state.pendingEndpoint.value_or(-1), row.endpoint);
  }
  expectf(reported == rowPages, "{} holds {} pages, expected {}", describe(req), reported,
          rowPages);
}

}  // namespace mkv::fuzz::lifecycle
