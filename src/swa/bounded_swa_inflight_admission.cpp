/// BoundedSwaKVPageManager, cached mode: in-flight admission. A sequence joins an executing
/// request at the end of its batch with its own reuse start (admitSequence), is finalised after
/// its own prefill (finalizeSequenceAdmission) or undone before (retractSequenceAdmission).
/// docs/architecture.md, "Sliding windows with context reuse".

#include <cstdint>
#include <vector>

#include "core/check.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "resources/backend_requests.h"
#include "resources/device_write_queue.h"
#include "resources/request_registry.h"
#include "swa/bounded_swa_kv_page_manager_internal.h"

namespace mkv {

using swa_detail::dropAppendedBindings;
using swa_detail::retainedBeginFor;

int32_t BoundedSwaKVPageManager::validateJoiner(char const* call, Request const& req,
                                                ResidentRef resident,
                                                SwaReuseStart const& start) const {
  MKV_REQUIRE(req.stage == RequestStage::kSettled, call,
              "in-flight admission needs an executing request with no pending work");
  int32_t const maxBatch = mResources.swaPageTable->maxBatch();
  MKV_REQUIRE(req.sequences.size() < static_cast<std::size_t>(maxBatch), call,
              "the batch is full ({} sequences)", req.sequences.size());
  std::vector<uint8_t> seen(static_cast<std::size_t>(maxBatch), 0);
  detail::validateResident(call, req.sequences.size(), resident, maxBatch, mResources.residentSlots,
                           seen);
  return validateReuseStart(call, req.sequences.size(), start);
}

bool BoundedSwaKVPageManager::takeJoinerPages(SwaSequenceState& state, SwaReuseStart const& start,
                                              int32_t privatePages) {
  auto const capacity = static_cast<std::size_t>(privatePages) + start.windowPages.size();
  state.reservedPages.reserve(capacity);  // no later transition of the joiner allocates
  state.newBindings.reserve(capacity);
  state.pendingRetire.reserve(capacity);
  state.endpoint = start.startTokens;
  state.retainedBegin = retainedBeginFor(state.endpoint, mWindow, mPageShift);
  state.retainedEnd = state.endpoint >> mPageShift;
  int32_t logical = state.retainedBegin;
  for (PageId const windowPage : start.windowPages) {
    state.bindings.push_back({logical++, windowPage});
  }
  // As in beginRequest: the window pages are held before the private pages are allocated, so
  // that the allocation cannot drop them.
  std::size_t held = 0;
  try {
    for (PageId const windowPage : start.windowPages) {
      mResources.pageSource->hold(windowPage);
      ++held;
    }
  } catch (...) {
    for (std::size_t i = 0; i < held; ++i) {
      mResources.pageSource->release(start.windowPages[i]);
    }
    throw;
  }
  if (!mResources.pageSource->allocate(privatePages, state.reservedPages)) {
    for (PageId const windowPage : start.windowPages) {
      mResources.pageSource->release(windowPage);
    }
    return false;
  }
  return true;
}

int32_t BoundedSwaKVPageManager::checkAdmitSequence(RequestHandle const& handle,
                                                    ResidentRef resident,
                                                    SwaReuseStart const& start,
                                                    char const* call) const {
  MKV_REQUIRE(mResources.pageSource != nullptr, call,
              "in-flight admission needs a page source (cached mode)");
  Request const& req = request(handle, call);
  int32_t const privatePages = validateJoiner(call, req, resident, start);
  if (!mRequests->poisoned()) {  // poisoned before the busy check, as in beginRequest
    detail::requireResidentFree(call, resident.slot, mResidentBusy);
  }
  return privatePages;
}

SwaKVCacheStatus BoundedSwaKVPageManager::admitSequence(RequestHandle& handle, ResidentRef resident,
                                                        SwaReuseStart const& start) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::admitSequence";
  int32_t const privatePages = checkAdmitSequence(handle, resident, start, kCall);
  if (mRequests->poisoned()) {
    return SwaKVCacheStatus::kPoisoned;
  }
  Request& req = request(handle, kCall);
  if (privatePages > mResources.pageSource->totalPages()) {
    return SwaKVCacheStatus::kRequestFailed;  // never fits (and fits allocate's int32)
  }
  req.sequences.emplace_back();  // the joiner's row; popped again on every way out below
  SwaSequenceState& state = req.sequences.back();
  state.resident = resident;
  bool taken = false;
  try {
    taken = takeJoinerPages(state, start, privatePages);
    if (taken) {
      appendPromptBindings(state, start.promptTokens);
    }
  } catch (...) {
    if (taken) {  // the bindings threw: every page goes back
      dropAppendedBindings(state);
      releaseSequence(state);
    }
    req.sequences.pop_back();
    throw;
  }
  if (!taken) {
    req.sequences.pop_back();
    return SwaKVCacheStatus::kRequestFailed;
  }
  // Nothing below throws but the upload; the row is the joiner's from here on.
  mResources.swaPageTable->clearRow(resident.slot);
  stagePrompt(state, start.promptTokens);
  state.joining = true;
  mResidentBusy[static_cast<std::size_t>(resident.slot)] = 1;
  mWrites->settle(mStream);
  return SwaKVCacheStatus::kOk;
}

void BoundedSwaKVPageManager::checkFinalizeSequenceAdmission(RequestHandle const& handle,
                                                             int32_t row, char const* call) const {
  Request const& req = request(handle, call);
  MKV_REQUIRE(!hasPendingWork(req.stage), call,
              "work is pending: finalise the joiner between steps");
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < req.sequences.size(), call,
              "row {} outside the batch of {}", row, req.sequences.size());
  MKV_REQUIRE(req.sequences[static_cast<std::size_t>(row)].joining, call,
              "row {} is not an unfinalised in-flight admission", row);
}

void BoundedSwaKVPageManager::finalizeSequenceAdmission(RequestHandle& handle, int32_t row) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::finalizeSequenceAdmission";
  checkFinalizeSequenceAdmission(handle, row, kCall);
  SwaSequenceState& state = request(handle, kCall).sequences[static_cast<std::size_t>(row)];
  completeCachedPrefill(state);
  state.joining = false;
  MKV_ASSERT(state.heldPages() <= mDecodePages,
             "slot {} holds {} pages after its joining prefill, the decode budget is {}",
             state.resident.slot, state.heldPages(), mDecodePages);
}

bool BoundedSwaKVPageManager::hasRetractableAdmission(RequestHandle const& handle) const noexcept {
  Request const* const req = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  return req != nullptr && !hasPendingWork(req->stage) && !req->sequences.empty() &&
         req->sequences.back().joining;
}

bool BoundedSwaKVPageManager::retractSequenceAdmission(RequestHandle& handle) noexcept {
  Request* const live = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  if (live == nullptr || !hasRetractableAdmission(handle)) {
    return false;
  }
  Request& req = *live;
  SwaSequenceState& state = req.sequences.back();
  bool cleared = true;
  try {
    mResources.swaPageTable->clearRow(state.resident.slot);
    mWrites->settle(mStream);
  } catch (std::exception const& error) {
    // The clear stays queued and reaches the device with the next flush.
    logger()->error("BoundedSwaKVPageManager::retractSequenceAdmission: {}; poisoned",
                    error.what());
    mRequests->poison();
    cleared = false;
  }
  // Stream order: any later write into these pages is enqueued after the joiner's prefill.
  releaseSequence(state);
  req.sequences.pop_back();
  return cleared;
}

}  // namespace mkv
