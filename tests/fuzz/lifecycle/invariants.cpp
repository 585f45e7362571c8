/// \file invariants.cpp
/// What the driver checks after every operation, on either backend: the snapshot a rejected
/// call must leave unchanged, page tables and their device mirrors, KV lengths and the KV oracle
/// on every live and quarantined row. The per-backend checks are coordinator_invariants.cpp and
/// swa_invariants.cpp.

#include <algorithm>

#include "fuzz/lifecycle/lifecycle.h"

namespace mkv::fuzz::lifecycle {

BackendSnapshot Lifecycle::snapshot() const {
  BackendSnapshot s = test::captureBackend(*mRuntime, /*deviceBytes=*/true);
  s.synchronizations = mSync.calls();
  for (auto const& req : mRequests) {
    s.requests.push_back(static_cast<int64_t>(req->serial));
    if (req->facade) {
      if (std::vector<int32_t> const* starts = req->facade->prefillStarts()) {
        s.requests.insert(s.requests.end(), starts->begin(), starts->end());
      }
    }
    if (mCoordinator != nullptr) {
      test::appendRequestView(*mCoordinator, req->coordinator, s.requests);
    } else {
      test::appendRequestView(*mSwa, req->swa, s.requests);
    }
  }
  return s;
}

void Lifecycle::checkAll() {
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

void Lifecycle::checkBackend() {
  expectf(backendPoisoned() == mPoisoned, "backend poison is {}, expected {}", backendPoisoned(),
          mPoisoned);
  if (coordinatorBackend()) {
    checkCoordinator();
  } else {
    checkSwaManager();
  }
  if (slidingReuse()) {
    checkWindowCache();
  }
}

/// The bound row of `slot` (live or quarantined), or null.
Row const* Lifecycle::rowOf(CacheSlot slot) const {
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

void Lifecycle::checkTables() {
  checkMirrors();
  KVPageTable const& table = *mainTable();
  std::vector<int32_t> seen(static_cast<std::size_t>(table.numPages()), 0);
  // Dense rows: the last row that mapped each page, so a page live twice within one row is
  // found in O(live entries) (pages shared by several rows are legitimate reuse).
  std::vector<CacheSlot> lastRow(static_cast<std::size_t>(table.numPages()), -1);
  for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
    Row const* row = rowOf(slot);
    if (row == nullptr) {
      expectf(table.liveEntryCount(slot) == 0, "row {} maps pages but no bound sequence holds it",
              slot);
    } else if (coordinatorBackend()) {
      checkDenseRow(table, slot, *row, lastRow, seen);
    } else {
      checkSwaRow(table, slot, *row, seen);
    }
  }
  if (coordinatorBackend()) {
    checkPinnedPages(table, seen);
    checkDraftTable();
  } else {
    checkSwaMirror(table);
  }
  if (slidingReuse()) {
    checkSlidingTable();
  }
}

/// Draft rows obey the base rows' rules: a paired row maps at least the pages of its written
/// draft positions, none twice, each pinned by the row's lease; every other row is empty.
void Lifecycle::checkDraftTable() {
  KVPageTable const* table = mRuntime->draftPageTable();
  if (table == nullptr) {
    return;
  }
  std::vector<int32_t> seen(static_cast<std::size_t>(table->numPages()), 0);
  std::vector<CacheSlot> lastRow(static_cast<std::size_t>(table->numPages()), -1);
  for (CacheSlot slot = 0; slot < table->maxBatch(); ++slot) {
    Row const* row = rowOf(slot);
    if (row == nullptr || !row->paired) {
      expectf(table->liveEntryCount(slot) == 0,
              "draft row {} maps pages but no paired row holds it", slot);
      continue;
    }
    expectf(table->liveEntryCount(slot) >= ceilPages(row->drafted),
            "draft row {} maps {} pages for {} written draft positions", slot,
            table->liveEntryCount(slot), row->drafted);
    std::span<int32_t const> const live =
        table->hostRow(slot).first(static_cast<std::size_t>(table->liveEntryCount(slot)));
    for (std::size_t p = 0; p < live.size(); ++p) {
      auto const page = static_cast<std::size_t>(live[p]);
      expectf(lastRow[page] != slot, "draft row {} maps page {} twice (entry {})", slot, live[p],
              p);
      lastRow[page] = slot;
      ++seen[page];
    }
  }
  ResourcePools const& pools = mCoordinator->manager().pools();
  for (PageId page = 0; page < table->numPages(); ++page) {
    int32_t const pins = pools.activeRefs({ResourceType::kDraftKvPage, page});
    expectf(pins >= seen[static_cast<std::size_t>(page)],
            "draft page {} is mapped by {} rows but pinned {} times", page,
            seen[static_cast<std::size_t>(page)], pins);
  }
}

/// Page-table invariants, and device mirrors equal to the host rows after every library call
/// (engine-step writes: while writes wait for the engine's flush, the device keeps the rows of
/// the last flush; flushForStep checks them right after each flush).
void Lifecycle::checkMirrors() {
  bool const waiting = mEngineStep && mRuntime->deviceWritesPending();
  for (KVPageTable const* table :
       {mRuntime->fullPageTable(), mRuntime->swaPageTable(), mRuntime->draftPageTable()}) {
    if (table == nullptr) {
      continue;
    }
    std::string error;
    expect(table->checkInvariants(&error), "page-table invariants: " + error);
    if (waiting) {
      continue;
    }
    // The SWA manager clears retired entries on the host at completion and uploads them with
    // the next patch (one upload per step): only such entries may lag on the device.
    bool const lagAllowed = table == mRuntime->swaPageTable();
    expect(lagAllowed || !table->dirty(),
           "a page table is dirty after a library call (mirror not uploaded)");
    checkMirrorRows(*table, lagAllowed, "");
  }
}

/// Every entry of `table`'s device mirror equals its host row; with `clearedMayLag`, an entry the
/// host has cleared (kNoPage) may still hold its old page on the device. `when` ends the message.
void Lifecycle::checkMirrorRows(KVPageTable const& table, bool clearedMayLag,
                                std::string_view when) {
  auto const width = static_cast<std::size_t>(2 * table.maxPagesPerSeq());
  auto const* device = table.deviceTable().dataPointer<int32_t>();
  for (CacheSlot slot = 0; slot < table.maxBatch(); ++slot) {
    std::span<int32_t const> const host = table.hostRow(slot);
    int32_t const* mirror = device + width * static_cast<std::size_t>(slot);
    for (std::size_t i = 0; i < width; ++i) {
      expectf(host[i] == mirror[i] || (clearedMayLag && host[i] == kNoPage),
              "row {} entry {}: device mirror {} differs from the host row {}{}", slot, i,
              mirror[i], host[i], when);
    }
  }
}

/// A coordinator row maps at least the pages of its written positions, none twice.
void Lifecycle::checkDenseRow(KVPageTable const& table, CacheSlot slot, Row const& row,
                              std::vector<CacheSlot>& lastRow, std::vector<int32_t>& seen) {
  expectf(table.liveEntryCount(slot) >= ceilPages(row.materialized),
          "row {} maps {} pages for {} written positions", slot, table.liveEntryCount(slot),
          row.materialized);
  std::span<int32_t const> const live =
      table.hostRow(slot).first(static_cast<std::size_t>(table.liveEntryCount(slot)));
  for (std::size_t p = 0; p < live.size(); ++p) {
    auto const page = static_cast<std::size_t>(live[p]);
    expectf(lastRow[page] != slot, "dense row {} maps page {} twice (entry {})", slot, live[p], p);
    lastRow[page] = slot;
    ++seen[page];
  }
}

/// SWA: exactly the window of the committed endpoint and the staged pages past it are mapped,
/// the staged ones those of [endpoint - W, endpoint) (a decode step's next position; a joiner's
/// prefill chunk, which keeps only its last window); no page is mapped by two rows.
void Lifecycle::checkSwaRow(KVPageTable const& table, CacheSlot slot, Row const& row,
                            std::vector<int32_t>& seen) {
  int32_t const from = std::max(0, row.windowFrom - mWindow) / kPage;
  int32_t const to = ceilPages(row.windowFrom);
  int32_t const stagedFrom = std::max(to, std::max(0, row.endpoint - mWindow) / kPage);
  int32_t const stagedTo = ceilPages(row.endpoint);
  for (int32_t p = 0; p < table.maxPagesPerSeq(); ++p) {
    PageId const page = table.entry(slot, p);
    bool const inWindow = (p >= from && p < to) || (p >= stagedFrom && p < stagedTo);
    expectf((page != kNoPage) == inWindow,
            "SWA row {} logical page {} is {} (window [{}, {}), staged [{}, {}))", slot, p,
            page == kNoPage ? "unmapped" : "mapped", from, to, stagedFrom, stagedTo);
    if (page != kNoPage) {
      expectf(seen[static_cast<std::size_t>(page)]++ == 0, "SWA page {} is mapped twice", page);
    }
  }
}

/// What kernels read: the SWA device mirror never maps a page twice either.
void Lifecycle::checkSwaMirror(KVPageTable const& table) {
  if (mEngineStep && mRuntime->deviceWritesPending()) {
    return;  // a finished row's old entries stay on the device until the next flush
  }
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

/// A page shared by several coordinator rows is pinned by each of their leases.
void Lifecycle::checkPinnedPages(KVPageTable const& table, std::vector<int32_t> const& seen) {
  ResourcePools const& pools = mCoordinator->manager().pools();
  for (PageId page = 0; page < table.numPages(); ++page) {
    int32_t const pins = pools.activeRefs({ResourceType::kBaseKvPage, page});
    expectf(pins >= seen[static_cast<std::size_t>(page)],
            "page {} is mapped by {} rows but pinned {} times", page,
            seen[static_cast<std::size_t>(page)], pins);
  }
}

/// The KV-length tensors hold the batch of the request that last prefilled.
void Lifecycle::checkLengths() {
  Req* owner = find(mLengthOwner);
  if (owner == nullptr) {
    return;
  }
  for (KVCachePool const* pool : mLengthPools) {
    expectf(pool->activeBatchSize() == static_cast<int32_t>(owner->rows.size()),
            "KV-length tensor has {} rows, {} has {}", pool->activeBatchSize(), describe(*owner),
            owner->rows.size());
    auto const* lengths = static_cast<int32_t const*>(pool->kvLengths().rawPointer());
    for (std::size_t i = 0; i < owner->rows.size(); ++i) {
      expectf(lengths[i] == owner->rows[i].materialized, "KV length of row {} is {}, expected {}",
              i, lengths[i], owner->rows[i].materialized);
    }
  }
  if (owner->paired) {  // the draft pool's lengths: the draft positions each row wrote
    KVCachePool const& pool = *mRuntime->draftPool();
    expectf(pool.activeBatchSize() == static_cast<int32_t>(owner->rows.size()),
            "draft KV-length tensor has {} rows, {} has {}", pool.activeBatchSize(),
            describe(*owner), owner->rows.size());
    auto const* lengths = static_cast<int32_t const*>(pool.kvLengths().rawPointer());
    for (std::size_t i = 0; i < owner->rows.size(); ++i) {
      expectf(lengths[i] == owner->rows[i].drafted, "draft KV length of row {} is {}, expected {}",
              i, lengths[i], owner->rows[i].drafted);
    }
  }
}

}  // namespace mkv::fuzz::lifecycle
