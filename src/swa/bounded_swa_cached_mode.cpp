/// BoundedSwaKVPageManager's cached mode: pages from a SwaPageSource, admission at a reused
/// prefix, prefill that writes every executed prompt position, retirement to the source
/// (docs/architecture.md, "Sliding windows with context reuse"). The rest of the manager:
/// bounded_swa_kv_page_manager.cpp.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "core/check.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "swa/bounded_swa_kv_page_manager_internal.h"

namespace mkv {

using swa_detail::pagesCovering;
using swa_detail::retainedBeginFor;

// ---------------------------------------------------------------- admission

int32_t BoundedSwaKVPageManager::validateReuseStart(char const* call, std::size_t row,
                                                    SwaReuseStart const& start) const {
  int64_t const maxTokens = int64_t{mResources.swaPageTable->maxPagesPerSeq()} * mPageSize;
  int32_t const prompt = start.promptTokens;
  int32_t const reused = start.startTokens;
  MKV_REQUIRE(prompt > 0 && prompt <= maxTokens, call, "promptTokens {} of row {} outside (0, {}]",
              prompt, row, maxTokens);
  MKV_REQUIRE(reused >= 0 && reused < prompt && reused % mPageSize == 0, call,
              "startTokens {} of row {} is not a multiple of {} in [0, {})", reused, row, mPageSize,
              prompt);
  int32_t const first = retainedBeginFor(reused, mWindow, mPageShift);
  int32_t const end = reused >> mPageShift;
  MKV_REQUIRE(start.windowPages.size() == static_cast<std::size_t>(end - first), call,
              "row {} starts at {} with {} window pages; logical pages [{}, {}) need {}", row,
              reused, start.windowPages.size(), first, end, end - first);
  int32_t const numPages = mResources.swaPool->numPages();
  for (auto page = start.windowPages.begin(); page != start.windowPages.end(); ++page) {
    MKV_REQUIRE(*page >= 0 && *page < numPages, call, "window page {} of row {} outside [0, {})",
                *page, row, numPages);
    MKV_REQUIRE(std::find(start.windowPages.begin(), page, *page) == page, call,
                "window page {} of row {} is given twice", *page, row);
  }
  return pagesCovering(prompt, mPageShift) - end + 1;
}

int64_t BoundedSwaKVPageManager::checkBeginRequest(std::span<ResidentRef const> residents,
                                                   cudaStream_t stream,
                                                   std::span<SwaReuseStart const> starts,
                                                   char const* call) const {
  MKV_REQUIRE(mResources.pageSource != nullptr, call,
              "{} reuse starts for a manager without a page source: admit without starts",
              starts.size());
  validateResidents(call, residents, stream);
  MKV_REQUIRE(starts.size() == residents.size(), call, "{} reuse starts for a batch of {}",
              starts.size(), residents.size());
  int64_t privateTotal = 0;
  for (std::size_t i = 0; i < starts.size(); ++i) {
    privateTotal += validateReuseStart(call, i, starts[i]);
  }
  (void)residentsAvailable(call, residents);  // the busy check, unless poisoned
  return privateTotal;
}

BoundedSwaKVPageManager::BeginRequestResult BoundedSwaKVPageManager::beginRequest(
    std::span<ResidentRef const> residents, cudaStream_t stream,
    std::span<SwaReuseStart const> starts) {
  constexpr char const* kCall = "BoundedSwaKVPageManager::beginRequest";
  int64_t const privateTotal = checkBeginRequest(residents, stream, starts, kCall);
  std::vector<int32_t> privatePages(starts.size());
  std::vector<int32_t> capacities(starts.size());
  for (std::size_t i = 0; i < starts.size(); ++i) {
    privatePages[i] = validateReuseStart(kCall, i, starts[i]);  // checked: does not throw
    capacities[i] = privatePages[i] + static_cast<int32_t>(starts[i].windowPages.size());
  }
  BeginRequestResult result;
  if (poisoned()) {
    result.status = SwaKVCacheStatus::kPoisoned;
    return result;
  }
  if (privateTotal > mResources.pageSource->totalPages()) {
    result.status = SwaKVCacheStatus::kRequestFailed;  // never fits (and fits allocate's int32)
    return result;
  }
  std::unique_ptr<Request> created = newRequest(residents, capacities);
  std::vector<PageId> taken;
  taken.reserve(static_cast<std::size_t>(privateTotal));
  created->promptTokens.reserve(starts.size());
  for (std::size_t i = 0; i < starts.size(); ++i) {
    SwaSequenceState& state = created->sequences[i];
    state.endpoint = starts[i].startTokens;
    state.retainedBegin = retainedBeginFor(state.endpoint, mWindow, mPageShift);
    state.retainedEnd = state.endpoint >> mPageShift;
    int32_t logical = state.retainedBegin;
    for (PageId const windowPage : starts[i].windowPages) {
      state.bindings.push_back({logical++, windowPage});
    }
    created->promptTokens.push_back(starts[i].promptTokens);
  }
  // The window pages are held first, so that allocate() cannot hand them out (it drops cached
  // blocks nobody holds); then the private pages, all or nothing.
  holdWindowPages(*created);
  if (!mResources.pageSource->allocate(static_cast<int32_t>(privateTotal), taken)) {
    releaseWindowPages(*created, std::numeric_limits<std::size_t>::max());
    result.status = SwaKVCacheStatus::kRequestFailed;
    return result;
  }
  auto page = taken.begin();
  for (std::size_t i = 0; i < starts.size(); ++i) {
    auto const count = static_cast<std::ptrdiff_t>(privatePages[i]);
    created->sequences[i].reservedPages.assign(page, page + count);  // within capacity
    page += count;
  }
  return publishRequest(std::move(created));
}

void BoundedSwaKVPageManager::holdWindowPages(Request const& created) {
  std::size_t held = 0;
  try {
    for (SwaSequenceState const& state : created.sequences) {
      for (SwaPageBinding const& binding : state.bindings) {
        mResources.pageSource->hold(binding.page);
        ++held;
      }
    }
  } catch (...) {
    releaseWindowPages(created, held);
    throw;
  }
}

void BoundedSwaKVPageManager::releaseWindowPages(Request const& created,
                                                 std::size_t count) noexcept {
  for (SwaSequenceState const& state : created.sequences) {
    for (SwaPageBinding const& binding : state.bindings) {
      if (count-- == 0) {
        return;
      }
      mResources.pageSource->release(binding.page);
    }
  }
}

// ---------------------------------------------------------------- prefill

void BoundedSwaKVPageManager::appendPromptBindings(SwaSequenceState& state, int32_t promptTokens) {
  MKV_ASSERT(state.newBindings.empty() && !state.pendingEndpoint.has_value(),
             "slot {} has a staged transition before its prefill", state.resident.slot);
  int32_t const end = pagesCovering(promptTokens, mPageShift);
  MKV_ASSERT(end - state.retainedEnd <= static_cast<int32_t>(state.reservedPages.size()),
             "slot {} needs {} prompt pages but holds {} in reserve", state.resident.slot,
             end - state.retainedEnd, state.reservedPages.size());
  for (int32_t logical = state.retainedEnd; logical < end; ++logical) {
    SwaPageBinding const binding{logical, state.reservedPages.back()};
    state.bindings.push_back(binding);     // may allocate; the lists below keep in step with it
    state.newBindings.push_back(binding);  // capacity reserved at admission
    state.reservedPages.pop_back();
  }
}

void BoundedSwaKVPageManager::stagePrompt(SwaSequenceState& state, int32_t promptTokens) {
  // Every page stays mapped through the prefill: it reads the reused window before the start
  // and writes every prompt position from the start on.
  for (SwaPageBinding const& binding : state.bindings) {
    mResources.swaPageTable->setEntry(state.resident.slot, binding.logicalPage, binding.page);
  }
  state.pendingEndpoint = promptTokens;
  state.retainedBegin = retainedBeginFor(promptTokens, mWindow, mPageShift);
  state.retainedEnd = pagesCovering(promptTokens, mPageShift);
}

void BoundedSwaKVPageManager::completeCachedPrefill(SwaSequenceState& state) {
  MKV_ASSERT(state.pendingEndpoint.has_value() && state.pendingRetire.empty(),
             "slot {} completes a prefill it did not stage", state.resident.slot);
  // The completion point passed: pages outside the window of L go to the source, where a
  // published or shared one stays cached.
  while (!state.bindings.empty() && state.bindings.front().logicalPage < state.retainedBegin) {
    mResources.swaPageTable->clearEntry(state.resident.slot, state.bindings.front().logicalPage);
    mResources.pageSource->release(state.bindings.front().page);
    state.bindings.pop_front();
  }
  while (state.reservedPages.size() > 1) {  // one spare keeps the next decode step writable
    mResources.pageSource->release(state.reservedPages.back());
    state.reservedPages.pop_back();
  }
  state.newBindings.clear();
  state.endpoint = *state.pendingEndpoint;
  state.pendingEndpoint.reset();
}

// ---------------------------------------------------------------- decode

bool BoundedSwaKVPageManager::takeSpare(SwaSequenceState& state) {
  // The reserve's capacity (admission) covers the one page appended here.
  return mResources.pageSource != nullptr &&
         mResources.pageSource->allocate(1, state.reservedPages);
}

}  // namespace mkv
