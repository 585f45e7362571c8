// ContextCacheCoordinator: batch admission (beginRequest). Validates the whole batch, looks every
// sequence up, leases all of them or none, then registers the request.

#include <algorithm>
#include <chrono>

#include "context_cache/coordinator_paged_rows.h"
#include "context_cache/coordinator_request.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/request_mode.h"
#include "core/check.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "resources/backend_requests.h"
#include "resources/request_registry.h"

namespace mkv {

detail::RequestMode const& ContextCacheCoordinator::modeFor(bool speculativeRequest,
                                                            char const* call) const {
  detail::RequestMode const* mode =
      speculativeRequest ? mModes->speculative.get() : mModes->plain.get();
  MKV_REQUIRE(mode != nullptr, call,
              "a speculative request on a deployment without speculative decoding");
  return *mode;
}

/// The manager's view of one sequence admission (it refers to `sequence`'s tokens and media).
LookupRequest ContextCacheCoordinator::lookupOf(ContextCacheSequenceAdmission const& sequence,
                                                ContextCacheLookupPolicy policy,
                                                DecodingKvHeadroom const& headroom,
                                                detail::RequestMode const& mode) const {
  LookupRequest lookup;
  lookup.prompt = PromptView{sequence.tokenIds, sequence.media, sequence.keyExtras};
  // A vanilla request on a speculative deployment reuses and publishes the base side only.
  lookup.mode = mode.lookupMode();
  lookup.draftExtraTokens = mode.rows().draftHeadroom(headroom);
  lookup.hasAttention = mLimits->hasKv;
  lookup.policy = mConfig.enabled ? policy : ContextCacheLookupPolicy::kBypass;
  lookup.baseExtraTokens = headroom.baseExtraTokens;
  lookup.retention = sequence.retention;
  return lookup;
}

AdmissionEstimate ContextCacheCoordinator::estimateAdmission(
    ContextCacheSequenceAdmission const& sequence, DecodingKvHeadroom const& headroom,
    bool speculativeRequest) const {
  constexpr char const* kCall = "ContextCacheCoordinator::estimateAdmission";
  detail::RequestMode const& mode = modeFor(speculativeRequest, kCall);
  mode.rows().validateHeadroom(kCall, headroom);
  detail::validateSequence(kCall, 0, sequence, headroom, *mLimits,
                           mode.rows().laneCount() == detail::kMaxRowLanes);
  LookupRequest const lookup =
      lookupOf(sequence, sequence.lookupPolicy.value_or(ContextCacheLookupPolicy::kUseCache),
               headroom, mode);
  LookupResult looked;
  try {
    looked = mManager->lookup(lookup);
  } catch (Error const& error) {
    detail::throwContract(kCall, "{}", error.what());
  }
  ReusePlan const& plan = looked.plan;
  AdmissionEstimate estimate;
  estimate.promptTokens = static_cast<int32_t>(sequence.tokenIds.size());
  estimate.reusableTokens = plan.reuseTokenLength;
  estimate.hostTierTokens =
      static_cast<int32_t>(plan.hostOnboardPages.size()) * mManager->pageSize();
  estimate.demand = plan.demand;
  estimate.missReason = looked.missReason;
  ResourcePools const& pools = mManager->pools();
  auto countPinned = [&](ResourceType type, std::span<int32_t const> ids) {
    for (int32_t id : ids) {
      ResourceId const resource{type, id};
      if (pools.activeRefs(resource) == 0 && pools.cacheRefs(resource) > 0) {
        ++estimate.pinnedReclaimable[type];
      }
    }
  };
  countPinned(ResourceType::kBaseKvPage, plan.basePageBindings);
  countPinned(ResourceType::kDraftKvPage, plan.draftPageBindings);
  if (plan.recurrentSnapshotBinding) {  // a checkpoint restore pins its snapshot slots too
    countPinned(ResourceType::kRecurrentSnapshot, std::span(&*plan.recurrentSnapshotBinding, 1));
  }
  if (plan.partialKvSnapshotBinding) {
    countPinned(ResourceType::kPartialKvSnapshot, std::span(&*plan.partialKvSnapshotBinding, 1));
  }
  if (poisoned()) {  // begin would answer kPoisoned: nothing fits
    return estimate;
  }
  ResourceDemand const free = pools.freeCounts();
  estimate.fitsWithoutEviction = free.covers(plan.demand);
  estimate.fitsAfterEviction = true;
  for (ResourceType type : kAllResourceTypes) {
    int32_t const evictable = pools.reclaimableCount(type) - estimate.pinnedReclaimable[type];
    estimate.fitsAfterEviction =
        estimate.fitsAfterEviction && plan.demand[type] <= free[type] + evictable;
  }
  return estimate;
}

// A refused request changes nothing: one sequence's acquire is all-or-nothing itself; several
// are admitted together (pins first, one eviction for the whole batch, then allocation),
// because an earlier sequence's eviction could otherwise cost a later one its hits after
// records are already gone.
std::vector<mkv::AdmissionResult> ContextCacheCoordinator::acquireAll(
    std::span<LookupRequest const> lookups) {
  std::vector<mkv::AdmissionResult> acquired;
  if (lookups.size() == 1) {
    acquired.push_back(mManager->admit(lookups[0]));
    if (!acquired[0].lease) {
      acquired.clear();
    }
    return acquired;
  }
  std::vector<LookupResult> looked;
  looked.reserve(lookups.size());
  for (LookupRequest const& lookup : lookups) {
    looked.push_back(mManager->lookup(lookup));
  }
  return mManager->acquireBatch(lookups, std::move(looked));
}

std::unique_ptr<ContextCacheCoordinator::Request> ContextCacheCoordinator::newRequest(
    ContextCacheBatchAdmission const& admission, detail::RequestMode const& mode) const {
  auto created = std::make_unique<Request>();
  created->id = mRequests->nextId();
  created->contract = admission.tokenStateContract;
  created->commitPolicy = admission.commitPolicy;
  created->replayTailLength = admission.replayTailLength;
  created->batchPolicy = admission.lookupPolicy;
  created->mode = &mode;
  created->sequences.reserve(static_cast<std::size_t>(mMaxBatch));
  return created;
}

void ContextCacheCoordinator::addSequences(Request& created,
                                           ContextCacheBatchAdmission const& admission,
                                           std::span<LookupRequest const> lookups,
                                           std::vector<mkv::AdmissionResult>& acquired) const {
  for (std::size_t i = 0; i < admission.sequences.size(); ++i) {
    Sequence state = detail::admittedSequence(admission.sequences[i], lookups[i].policy,
                                              admission.commitPolicy, acquired[i]);
    state.common = state.reuseTokenLength;
    created.sequences.push_back(std::move(state));
  }
}

ContextCacheCoordinator::BeginRequestResult ContextCacheCoordinator::beginRequest(
    ContextCacheBatchAdmission const& admission, DecodingKvHeadroom const& headroom,
    cudaStream_t stream) {
  constexpr char const* kCall = "ContextCacheCoordinator::beginRequest";
  MKV_REQUIRE(stream == mStream, kCall,
              "stream differs from the coordinator's construction stream");
  detail::validateBatchAdmission(kCall, admission, headroom, *mLimits);
  BeginRequestResult result;
  // Poisoned first: a quarantined request still holds its residents, and the runtime may have
  // handed one of those slots out again; that is the poisoned outcome, not a contract error.
  if (poisoned()) {
    result.status = ContextCacheStatus::kPoisoned;
    return result;
  }
  for (auto const& sequence : admission.sequences) {
    detail::requireResidentFree(kCall, sequence.resident.slot, mResidentBusy);
  }
  detail::RequestMode const& mode = modeFor(admission.speculativeRequest, kCall);
  std::unique_ptr<Request> created = newRequest(admission, mode);
  bool const mediaBypass =
      mode.speculativeRounds() &&
      std::any_of(admission.sequences.begin(), admission.sequences.end(),
                  [](auto const& sequence) { return !sequence.media.empty(); });
  std::vector<LookupRequest> lookups;
  lookups.reserve(admission.sequences.size());
  for (auto const& sequence : admission.sequences) {
    ContextCacheLookupPolicy const policy =
        mediaBypass ? ContextCacheLookupPolicy::kBypass
                    : sequence.lookupPolicy.value_or(admission.lookupPolicy);
    lookups.push_back(lookupOf(sequence, policy, headroom, mode));
  }
  auto const start = std::chrono::steady_clock::now();
  std::vector<mkv::AdmissionResult> acquired = acquireAll(lookups);
  if (acquired.empty()) {
    countPlanning(start);
    ++mCounters.refusedRequests;
    result.status = ContextCacheStatus::kRequestFailed;
    return result;
  }
  if (!moveHostTierPages(kCall)) {  // poisoned; the leases (onboarding destinations) are released
    countPlanning(start);
    result.status = ContextCacheStatus::kPoisoned;
    return result;
  }
  addSequences(*created, admission, lookups, acquired);
  countPlanning(start);
  AdmissionResult admitted;
  admitted.prefillStarts.reserve(created->sequences.size());
  mRequests->reserveAdmission();
  // Nothing below throws: publish the request.
  ++mCounters.requests;
  for (auto const& sequence : created->sequences) {
    admitted.prefillStarts.push_back(sequence.reuseTokenLength);
    mResidentBusy[static_cast<std::size_t>(sequence.resident.slot)] = 1;
  }
  admitted.request = RequestHandle(this, mRequests->publish(std::move(created)));
  result.status = ContextCacheStatus::kOk;
  result.admission = std::move(admitted);
  return result;
}

}  // namespace mkv
