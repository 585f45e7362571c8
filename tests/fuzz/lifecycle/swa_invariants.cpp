/// \file swa_invariants.cpp
/// The bounded-SWA manager's invariants after every operation: request count, what each
/// request's rows hold and where their windows end, quarantined pages, page conservation.

#include <algorithm>

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/bounded_swa_kv_page_manager.h"

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
    int32_t rowPages = 0;
    for (Row const& row : req->rows) {
      rowPages += swaRowPages(*req, row);
    }
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

/// The rows of a live request: their residents, endpoints and the pages they hold; a joiner's
/// completed chunks (its endpoint) and prompt.
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
    // Bounded SWA holds a founder from its first chunk's completion (sliding-window reuse's half
    // at completePrefill).
    bool const held = row.heldPrefill && !slidingReuse();
    expectf(state.joining == (!row.joined || held), "{} row {}: joining {}", describe(req), i,
            state.joining);
    if (!row.joined || held) {
      expectf(state.endpoint == row.windowFrom &&
                  state.joinerPromptTokens == static_cast<int32_t>(row.prompt.size()),
              "{} row {}: a joiner at {} of {} prompt tokens, expected {} of {}", describe(req), i,
              state.endpoint, state.joinerPromptTokens, row.windowFrom, row.prompt.size());
    }
  }
  expectf(reported == rowPages, "{} holds {} pages, expected {}", describe(req), reported,
          rowPages);
}

// ---------------------------------------------------------------- sliding-window reuse

/// The sliding half of the composed backend: one SWA request per live request, both halves
/// poisoned together, and the sliding pool's pages conserved: free + held by windows + cached
/// blocks nobody holds = total, as capacity() reports them.
void Lifecycle::checkWindowCache() {
  BoundedSwaKVPageManager const& s = *mSwa;
  expectf(s.activeRequestCount() == liveRequests(),
          "SWA half has {} active requests, the driver {}", s.activeRequestCount(), liveRequests());
  expectf(s.poisoned() == mCoordinator->poisoned(), "SWA half poisoned {}, coordinator {}",
          s.poisoned(), mCoordinator->poisoned());
  WindowBlockCache const& window = *mRuntime->windowBlockCache();
  expectf(window.freePages() + window.heldPages() + window.evictablePages() == window.totalPages(),
          "sliding page conservation: {} free + {} held + {} cached unheld != {}",
          window.freePages(), window.heldPages(), window.evictablePages(), window.totalPages());
  expectf(window.evictablePages() <= window.cachedBlocks(), "{} evictable pages but {} cached",
          window.evictablePages(), window.cachedBlocks());
  std::optional<PagePoolUsage> const sliding = mRuntime->capacity().sliding;
  expect(sliding.has_value(), "capacity() reports no sliding pool");
  if (sliding) {
    expectf(
        sliding->totalPages == window.totalPages() && sliding->freePages == window.freePages() &&
            sliding->reclaimablePages == window.evictablePages() &&
            sliding->leasedPages == window.heldPages(),
        "capacity() says {} total, {} free, {} reclaimable, {} leased; the window cache {}, "
        "{}, {}, {} held",
        sliding->totalPages, sliding->freePages, sliding->reclaimablePages, sliding->leasedPages,
        window.totalPages(), window.freePages(), window.evictablePages(), window.heldPages());
  }
}

/// The sliding rows of the composed backend: each bound row maps exactly its window (during the
/// prefill the window before the start and every executed page), no page twice within a row;
/// rows of unbound residents are empty; every mapped page is held by at least as many holders
/// as rows map it (reused window pages are shared), and a cached page is indexed once.
void Lifecycle::checkSlidingTable() {
  KVPageTable const& table = *mRuntime->swaPageTable();
  WindowBlockCache const& window = *mRuntime->windowBlockCache();
  std::vector<int32_t> mapped(static_cast<std::size_t>(table.numPages()), 0);
  std::vector<CacheSlot> lastRow(static_cast<std::size_t>(table.numPages()), -1);
  for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
    Row const* row = rowOf(slot);
    if (row == nullptr) {
      expectf(table.liveEntryCount(slot) == 0,
              "sliding row {} maps pages but no bound sequence holds it", slot);
      continue;
    }
    int32_t const from = std::max(0, row->windowFrom - mWindow) / kPage;
    int32_t const to = ceilPages(row->endpoint);
    for (int32_t p = 0; p < table.maxPagesPerSeq(); ++p) {
      PageId const page = table.entry(slot, p);
      bool const inWindow = p >= from && p < to;
      expectf((page != kNoPage) == inWindow,
              "sliding row {} logical page {} is {} (window [{}, {}))", slot, p,
              page == kNoPage ? "unmapped" : "mapped", from, to);
      if (page != kNoPage) {
        auto const index = static_cast<std::size_t>(page);
        expectf(lastRow[index] != slot, "sliding row {} maps page {} twice", slot, page);
        lastRow[index] = slot;
        ++mapped[index];
      }
    }
  }
  for (PageId page = 0; page < table.numPages(); ++page) {
    int32_t const rows = mapped[static_cast<std::size_t>(page)];
    expectf(window.holders(page) >= rows, "sliding page {} is mapped by {} rows, held by {}", page,
            rows, window.holders(page));
  }
}

}  // namespace mkv::fuzz::lifecycle
