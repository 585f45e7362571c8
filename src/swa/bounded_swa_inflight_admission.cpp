/// BoundedSwaKVPageManager: in-flight admission. A sequence joins an executing request at the
/// end of its batch (admitSequence; in cached mode with its own reuse start), is finalised after
/// its own prefill (finalizeSequenceAdmission) or undone before (retractSequenceAdmission);
/// without a page source its prefill may run in chunks whose window rotates
/// (prepareSequenceChunk, completeSequenceChunk). docs/architecture.md, "Bounded SWA" and
/// "Sliding windows with context reuse".

#include <algorithm>
#include <cstdint>
#include <deque>
#include <limits>
#include <vector>

#include "core/check.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "resources/backend_requests.h"
#include "resources/device_write_queue.h"
#include "resources/request_registry.h"
#include "swa/bounded_swa_kv_page_manager_internal.h"

namespace mkv {

using swa_detail::dropAppendedBindings;
using swa_detail::pagesCovering;
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
  MKV_REQUIRE(mResources.pageSource != nullptr || start.startTokens == 0, call,
              "row {} starts at {}, but without a page source nothing is cached: a joiner starts "
              "at 0",
              req.sequences.size(), start.startTokens);
  int32_t const privatePages = validateReuseStart(call, req.sequences.size(), start);
  return mResources.pageSource != nullptr ? privatePages : mAdmissionPages;
}

SwaSequenceState& BoundedSwaKVPageManager::joinerAt(char const* call, Request& req,
                                                    int32_t row) const {
  MKV_REQUIRE(req.stage == RequestStage::kSettled, call,
              "row {}: a joiner's chunk is prepared and completed between steps (an executing "
              "request with no pending work)",
              row);
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < req.sequences.size(), call,
              "row {} outside the batch of {}", row, req.sequences.size());
  SwaSequenceState& state = req.sequences[static_cast<std::size_t>(row)];
  MKV_REQUIRE(state.joining, call, "row {} is not an unfinalised in-flight admission", row);
  return state;
}

bool BoundedSwaKVPageManager::takeUncachedJoinerPages(SwaSequenceState& state) {
  auto const pages = static_cast<std::size_t>(mAdmissionPages);
  if (pages > mFreePages.size()) {
    return false;
  }
  // A sequence never holds more than its admission pages: its lists never grow past these
  // capacities (the bindings deque may allocate; the chunk calls plan in copies first).
  state.reservedPages.reserve(pages);
  state.newBindings.reserve(pages);
  state.pendingRetire.reserve(pages);
  for (std::size_t p = 0; p < pages; ++p) {
    state.reservedPages.push_back(mFreePages.back());
    mFreePages.pop_back();
  }
  return true;
}

/// A joiner's state after a chunk call, built in copies (every allocation happens here, before
/// anything of the joiner changes; applyChunkPlan then only swaps it in).
struct BoundedSwaKVPageManager::ChunkPlan {
  std::deque<SwaPageBinding> bindings;   ///< the kept bindings, then the staged chunk's
  std::vector<SwaPageBinding> staged;    ///< the staged chunk's new bindings (newBindings)
  std::vector<PageId> reserve;           ///< the row's reserve afterwards
  std::vector<SwaPageBinding> unmapped;  ///< entries to clear: retired or unstaged
};

BoundedSwaKVPageManager::ChunkPlan BoundedSwaKVPageManager::planJoinerChunk(
    SwaSequenceState const& state, int32_t retireBelow, bool dropStaged, int32_t chunkEnd) const {
  auto const capacity = static_cast<std::size_t>(mAdmissionPages);
  ChunkPlan plan;
  plan.staged.reserve(capacity);
  plan.reserve.reserve(capacity);
  plan.unmapped.reserve(capacity);
  plan.reserve.assign(state.reservedPages.begin(), state.reservedPages.end());
  std::size_t const kept = state.bindings.size() - (dropStaged ? state.newBindings.size() : 0);
  for (std::size_t i = 0; i < kept; ++i) {
    SwaPageBinding const& binding = state.bindings[i];
    if (binding.logicalPage < retireBelow) {  // left the window: back to the row's reserve
      plan.unmapped.push_back(binding);
      plan.reserve.push_back(binding.page);
    } else {
      plan.bindings.push_back(binding);
    }
  }
  for (std::size_t i = state.bindings.size(); i > kept; --i) {  // the staged chunk, undone
    plan.unmapped.push_back(state.bindings[i - 1]);
    plan.reserve.push_back(state.bindings[i - 1].page);
  }
  // The window before the chunk stays mapped (the chunk reads it); the chunk's pages from
  // max(endpoint, chunkEnd - W) on come from the reserve.
  int32_t const begin = retainedBeginFor(chunkEnd, mWindow, mPageShift);
  int32_t const end = pagesCovering(chunkEnd, mPageShift);
  int32_t const firstUnbound = plan.bindings.empty() ? begin : plan.bindings.back().logicalPage + 1;
  for (int32_t logical = std::max(begin, firstUnbound); logical < end; ++logical) {
    MKV_ASSERT(!plan.reserve.empty(), "slot {} needs a page for logical page {} and has none",
               state.resident.slot, logical);
    SwaPageBinding const binding{logical, plan.reserve.back()};
    plan.reserve.pop_back();
    plan.bindings.push_back(binding);
    plan.staged.push_back(binding);
  }
  return plan;
}

void BoundedSwaKVPageManager::applyJoinerChunk(SwaSequenceState& state, ChunkPlan& plan,
                                               int32_t committedEnd, int32_t stagedEnd) noexcept {
  for (SwaPageBinding const& binding : plan.unmapped) {
    mResources.swaPageTable->clearEntry(state.resident.slot, binding.logicalPage);
  }
  for (SwaPageBinding const& binding : plan.staged) {
    mResources.swaPageTable->setEntry(state.resident.slot, binding.logicalPage, binding.page);
  }
  state.bindings.swap(plan.bindings);
  state.newBindings.swap(plan.staged);
  state.reservedPages.swap(plan.reserve);
  state.endpoint = committedEnd;
  state.pendingEndpoint = stagedEnd;
  state.retainedBegin = retainedBeginFor(stagedEnd, mWindow, mPageShift);
  state.retainedEnd = pagesCovering(stagedEnd, mPageShift);
}

void BoundedSwaKVPageManager::commitJoinerChunk(SwaSequenceState& state) noexcept {
  // After the step that ran the chunk: what left its window goes back to the row's reserve
  // (the next chunk's kernels run after this one's on the same stream).
  while (!state.bindings.empty() && state.bindings.front().logicalPage < state.retainedBegin) {
    mResources.swaPageTable->clearEntry(state.resident.slot, state.bindings.front().logicalPage);
    state.reservedPages.push_back(state.bindings.front().page);  // within the admission capacity
    state.bindings.pop_front();
  }
  state.newBindings.clear();
  state.endpoint = *state.pendingEndpoint;
  state.pendingEndpoint.reset();
}

int32_t BoundedSwaKVPageManager::promptInChunks(SwaSequenceState const& state) noexcept {
  // A founder in the prefill whose first chunk was never prepared has its whole prompt staged.
  return state.joinerPromptTokens > 0 ? state.joinerPromptTokens
                                      : state.pendingEndpoint.value_or(state.endpoint);
}

bool BoundedSwaKVPageManager::awaitsPrefill(RequestHandle const& handle, int32_t row) const {
  return state(handle, row).joining;
}

SwaSequenceState& BoundedSwaKVPageManager::chunkJoiner(char const* call,
                                                       RequestHandle const& handle, int32_t row,
                                                       int32_t chunkEnd) const {
  MKV_REQUIRE(mResources.pageSource == nullptr, call,
              "row {}: with a page source a joiner's whole prompt is mapped from admission, "
              "there is no chunk to prepare",
              row);
  Request& req = request(handle, call);
  SwaSequenceState& chunked = req.stage == RequestStage::kPrefilling
                                  ? founderBeforeItsChunk(call, req, row, chunkEnd)
                                  : joinerAt(call, req, row);
  int32_t const prompt = promptInChunks(chunked);
  MKV_REQUIRE(chunkEnd > chunked.endpoint && chunkEnd <= prompt, call,
              "row {}: chunk end {} outside ({} (done so far), {} (the prompt)]", row, chunkEnd,
              chunked.endpoint, prompt);
  return chunked;
}

SwaSequenceState& BoundedSwaKVPageManager::founderBeforeItsChunk(char const* call, Request& req,
                                                                 int32_t row,
                                                                 int32_t chunkEnd) const {
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < req.sequences.size(), call,
              "row {} outside the batch of {}", row, req.sequences.size());
  SwaSequenceState& founder = req.sequences[static_cast<std::size_t>(row)];
  MKV_REQUIRE(!founder.joining || chunkEnd == founder.endpoint, call,
              "row {}: its first chunk (to {}) completed in this prefill; a founder's next chunks "
              "come after completePrefill, as a joiner's",
              row, founder.endpoint);
  return founder;
}

DecodeStepDemand BoundedSwaKVPageManager::sequenceChunkDemand(RequestHandle const& handle,
                                                              int32_t row, int32_t chunkEnd) const {
  (void)chunkJoiner("BoundedSwaKVPageManager::sequenceChunkDemand", handle, row, chunkEnd);
  return DecodeStepDemand{};
}

SwaKVCacheStatus BoundedSwaKVPageManager::prepareSequenceChunk(RequestHandle& handle, int32_t row,
                                                               int32_t chunkEnd) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::prepareSequenceChunk";
  SwaSequenceState& state = chunkJoiner(kCall, handle, row, chunkEnd);
  if (mRequests->poisoned()) {
    return SwaKVCacheStatus::kPoisoned;
  }
  if (state.pendingEndpoint == chunkEnd) {
    return SwaKVCacheStatus::kOk;  // staged already (the rest of the prompt)
  }
  int32_t const prompt = promptInChunks(state);
  ChunkPlan plan = planJoinerChunk(state, std::numeric_limits<int32_t>::min(), true, chunkEnd);
  applyJoinerChunk(state, plan, state.endpoint, chunkEnd);
  state.joinerPromptTokens = prompt;  // a founder's from its first chunk on
  mWrites->settle(mStream);
  Request& req = request(handle, kCall);
  if (req.stage == RequestStage::kPrefilling) {
    req.writesMark = mWrites->awaitingFlush();  // the prefill step runs through the new entries
  }
  return SwaKVCacheStatus::kOk;
}

SwaKVCacheStatus BoundedSwaKVPageManager::completeSequenceChunk(RequestHandle& handle, int32_t row,
                                                                int32_t chunkEnd) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::completeSequenceChunk";
  MKV_REQUIRE(mResources.pageSource == nullptr, kCall,
              "row {}: with a page source a joiner's pages are retired when it is finalised", row);
  Request& req = request(handle, kCall);
  bool const founder = req.stage == RequestStage::kPrefilling;
  SwaSequenceState& state =
      founder ? founderBeforeItsChunk(kCall, req, row, chunkEnd) : joinerAt(kCall, req, row);
  MKV_REQUIRE(chunkEnd == state.endpoint || state.pendingEndpoint == chunkEnd, kCall,
              "row {}: a chunk to {}, but the chunk staged for the step ends at {} (prepare each "
              "chunk shorter than the rest of the prompt before its step)",
              row, chunkEnd, state.pendingEndpoint.value_or(state.endpoint));
  if (founder) {
    checkPreparedWritesOnDevice(handle, kCall);  // the prefill step ran through those rows
  }
  if (mRequests->poisoned()) {
    return SwaKVCacheStatus::kPoisoned;
  }
  int32_t const promptTokens = promptInChunks(state);
  bool const progress = chunkEnd != state.endpoint && !(founder && chunkEnd == promptTokens);
  if (progress && chunkEnd == promptTokens) {
    commitJoinerChunk(state);  // the whole prompt done: finalisation trims the row
  } else if (progress) {
    // The chunk committed (what left its window unmapped), the rest of the prompt staged.
    ChunkPlan plan = planJoinerChunk(state, retainedBeginFor(chunkEnd, mWindow, mPageShift), false,
                                     promptTokens);
    applyJoinerChunk(state, plan, chunkEnd, promptTokens);
  }
  if (founder && chunkEnd < promptTokens) {
    // completePrefill holds it (after an empty first chunk too); its next chunks are a joiner's.
    state.joining = true;
    state.joinerPromptTokens = promptTokens;
  }
  if (progress) {
    mWrites->settle(mStream);
  }
  return SwaKVCacheStatus::kOk;
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
  if (mResources.pageSource == nullptr) {
    return admitUncached(req, resident, start.promptTokens);
  }
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
  state.joinerPromptTokens = start.promptTokens;
  mResidentBusy[static_cast<std::size_t>(resident.slot)] = 1;
  mWrites->settle(mStream);
  return SwaKVCacheStatus::kOk;
}

SwaKVCacheStatus BoundedSwaKVPageManager::admitUncached(Request& req, ResidentRef resident,
                                                        int32_t promptTokens) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::admitSequence";
  req.sequences.emplace_back();  // the joiner's row (capacity reserved at beginRequest)
  SwaSequenceState& state = req.sequences.back();
  state.resident = resident;
  bool taken = false;
  try {
    taken = takeUncachedJoinerPages(state);  // its capacities first: a throw takes no page
    if (taken) {
      appendBindings(state, promptTokens, kCall);  // the whole prompt's window, as preparePrefill
    }
  } catch (...) {
    if (taken) {
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
  mapNewBindings(state);
  state.pendingEndpoint = promptTokens;
  state.retainedBegin = retainedBeginFor(promptTokens, mWindow, mPageShift);
  state.retainedEnd = pagesCovering(promptTokens, mPageShift);
  state.joining = true;
  state.joinerPromptTokens = promptTokens;
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
  SwaSequenceState const& state = req.sequences[static_cast<std::size_t>(row)];
  MKV_REQUIRE(state.joining, call, "row {} is not an unfinalised in-flight admission", row);
  if (mResources.pageSource == nullptr) {
    int32_t const reached = state.pendingEndpoint.value_or(state.endpoint);
    MKV_REQUIRE(reached == state.joinerPromptTokens, call,
                "row {}: its prefill reached {} of its {} prompt tokens (the chunk prepared to {} "
                "was not completed)",
                row, state.endpoint, state.joinerPromptTokens, reached);
  }
}

void BoundedSwaKVPageManager::finalizeSequenceAdmission(RequestHandle& handle, int32_t row) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::finalizeSequenceAdmission";
  checkFinalizeSequenceAdmission(handle, row, kCall);
  SwaSequenceState& state = request(handle, kCall).sequences[static_cast<std::size_t>(row)];
  if (mResources.pageSource != nullptr) {
    completeCachedPrefill(state);
  } else {
    if (state.pendingEndpoint.has_value()) {
      commitJoinerChunk(state);  // the rest of the prompt, staged and run in one go
    }
    // As completePrefill: decode needs at most M + 1 held pages; the surplus goes back.
    while (state.heldPages() > mDecodePages && !state.reservedPages.empty()) {
      mFreePages.push_back(state.reservedPages.back());
      state.reservedPages.pop_back();
    }
    mWrites->settle(mStream);
  }
  state.joining = false;
  state.joinerPromptTokens = 0;
  MKV_ASSERT(state.heldPages() <= mDecodePages,
             "slot {} holds {} pages after its joining prefill, the decode budget is {}",
             state.resident.slot, state.heldPages(), mDecodePages);
}

void BoundedSwaKVPageManager::checkPreemptSequence(RequestHandle const& handle, int32_t row,
                                                   char const* call) const {
  Request const& req = request(handle, call);
  MKV_REQUIRE(req.stage == RequestStage::kSettled, call,
              "row {}: a sequence is preempted between steps (an executing request with no "
              "pending work)",
              row);
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < req.sequences.size(), call,
              "row {} outside the batch of {}", row, req.sequences.size());
  MKV_REQUIRE(!req.sequences[static_cast<std::size_t>(row)].joining, call,
              "row {} is an unfinalised in-flight admission: retract it, or finish its prefill",
              row);
}

bool BoundedSwaKVPageManager::hasRetractableAdmission(RequestHandle const& handle) const noexcept {
  Request const* const req = handle.mOwner == this ? mRequests->find(handle.mId) : nullptr;
  return req != nullptr && !hasPendingWork(req->stage) && req->sequences.size() > 1 &&
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
