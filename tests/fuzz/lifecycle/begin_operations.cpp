/// \file begin_operations.cpp
/// Beginning a request: through ManagedKVCacheRequest or directly on the coordinator or the SWA
/// manager (`begin`), and the same calls with one contract violation (`badBegin`).

#include "fuzz/lifecycle/lifecycle.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::fuzz::lifecycle {

/// The batch the input asks for: how it is begun, its rows on fresh residents, its identity and
/// policies. Empty when no resident is free (the runtime keeps the request queued).
std::optional<Lifecycle::BeginPlan> Lifecycle::planBegin() {
  BeginPlan plan;
  // Sliding-window reuse has no direct form: one facade request drives both halves.
  plan.via = mIn.oneIn(3) && !slidingReuse() ? Via::kDirect : Via::kFacade;
  int32_t const available = mRuntime->residentSlots().available();
  if (available == 0) {
    return std::nullopt;
  }
  // Speculative runtimes: two requests in three are speculative.
  plan.speculative = speculativeDeployment() && !mIn.oneIn(3);
  bool const mtp = plan.speculative && mKind == Runtime::kHybridMtp;
  int32_t const batch = 1 + mIn.below(available);
  plan.lora = mIn.oneIn(4) ? "adapter" : "";
  plan.salt = mIn.oneIn(4) ? "tenant" : "";
  if (coordinatorBackend()) {
    if (mIn.oneIn(5) && !slidingReuse()) {  // sliding reuse: the lookahead contract only
      plan.contract = DecodingTokenStateContract::kFullyCommitted;
    }
    if (mIn.oneIn(5)) {
      plan.commit = ContextCacheCommitPolicy::kPrefillStateOnly;
    }
    if (mIn.oneIn(6)) {
      plan.lookup = ContextCacheLookupPolicy::kBypass;
    }
  }
  if (plan.speculative) {
    // The engine's verification rounds accept up to headroom.baseExtraTokens tokens; the draft
    // needs at least as much. Speculative engines sample a lookahead token after the prefill.
    plan.contract = DecodingTokenStateContract::kCommittedPlusLookahead;
    int32_t const base = 1 + mIn.below(3);
    plan.headroom = {base, pairs(plan) ? base + mIn.below(2) : 0};
    if (mtp) {
      plan.commit = ContextCacheCommitPolicy::kPrefillStateOnly;
    }
  }
  mPromptHeadroom = std::max(plan.headroom.baseExtraTokens, plan.headroom.draftExtraTokens);
  plan.seed = testing::identitySeed(plan.lora, plan.salt);
  for (int32_t i = 0; i < batch; ++i) {
    Row row;
    row.resident = *mRuntime->residentSlots().acquire();
    row.prompt = makePrompt(promptLength());
    row.digests = testing::PrefixDigests(plan.seed);
    row.paired = pairs(plan);
    row.draft = testing::PrefixDigests(plan.seed ^ kDraftSeed);
    appendTokens(row, row.prompt, mDraftLookahead);
    plan.rows.push_back(std::move(row));
    std::optional<ContextCacheLookupPolicy> policy;
    if (mIn.oneIn(6)) {
      policy =
          mIn.oneIn(2) ? ContextCacheLookupPolicy::kBypass : ContextCacheLookupPolicy::kUseCache;
    }
    plan.rowPolicies.push_back(policy);
  }
  mPromptHeadroom = 1;
  return plan;
}

/// Runs `body` on the planned batch; the residents of rows no request took return to the runtime.
template <typename Body>
void Lifecycle::withBeginPlan(Body&& body) {
  std::optional<BeginPlan> plan = planBegin();
  if (!plan) {
    return;
  }
  auto release = [&]() {
    for (Row const& row : plan->rows) {
      mRuntime->residentSlots().release(row.resident);
    }
  };
  try {
    body(*plan);
  } catch (...) {
    release();
    throw;
  }
  release();
}

void Lifecycle::begin() {
  withBeginPlan([&](BeginPlan& plan) {
    std::vector<int32_t> lengths;
    for (Row const& row : plan.rows) {
      lengths.push_back(static_cast<int32_t>(row.prompt.size()));
    }
    std::optional<bool> const must = mustAdmit(lengths, plan.headroom, pairs(plan));
    BackendSnapshot const before = snapshot();
    std::string const what = fmt::format(
        "begin ({}, {} rows)", plan.via == Via::kFacade ? "facade" : "direct", plan.rows.size());
    auto req = std::make_unique<Req>();
    req->serial = mNextSerial++;
    req->via = plan.via;
    req->contract = plan.contract;
    req->lora = plan.lora;
    req->salt = plan.salt;
    req->seed = plan.seed;
    req->speculative = plan.speculative;
    req->paired = pairs(plan);
    req->mtp = plan.speculative && mKind == Runtime::kHybridMtp;
    req->headroom = plan.headroom;
    std::optional<std::vector<int32_t>> const starts =
        plan.via == Via::kFacade ? beginThroughFacade(plan, *req, what)
        : coordinatorBackend()   ? beginOnCoordinator(plan, *req, what)
                                 : beginOnSwa(plan, *req, what);
    if (!starts) {
      ++mStats.refusals;
      expectf(mPoisoned || must != true, "{}: refused although the free pages hold the batch",
              what);
      expectRefusalChangedNothing(what, before);
      trace(what + ": refused");
      return;
    }
    admitted(plan, std::move(req), *starts, must, what);
  });
}

std::optional<std::vector<int32_t>> Lifecycle::beginThroughFacade(BeginPlan const& plan, Req& req,
                                                                  std::string const& what) {
  LLMGenerationRequest const generation = generationOf(plan);
  DecodingInferenceContext const context = contextOf(plan);
  std::optional<ManagedKVCacheRequest> begun = accept(what, [&] {
    return ManagedKVCacheRequest::begin(mCoordinator, mSwa, generation, context, plan.speculative,
                                        plan.headroom, plan.contract, plan.commit);
  });
  if (!begun) {
    return std::nullopt;
  }
  req.facade.emplace(std::move(*begun));
  std::vector<int32_t> const* reported = req.facade->prefillStarts();
  return reported != nullptr ? *reported : std::vector<int32_t>(plan.rows.size(), 0);
}

std::optional<std::vector<int32_t>> Lifecycle::beginOnCoordinator(BeginPlan const& plan, Req& req,
                                                                  std::string const& what) {
  ContextCacheBatchAdmission const admission = admissionOf(plan);
  auto result =
      accept(what, [&] { return mCoordinator->beginRequest(admission, plan.headroom, kStream); });
  expect((result.status == ContextCacheStatus::kOk) == result.admission.has_value(),
         what + ": status and admission disagree");
  if (!result.admission) {
    expectf(result.status ==
                (mPoisoned ? ContextCacheStatus::kPoisoned : ContextCacheStatus::kRequestFailed),
            "{}: refused with {}", what, toString(result.status));
    return std::nullopt;
  }
  req.coordinator = std::move(result.admission->request);
  return result.admission->prefillStarts;
}

std::optional<std::vector<int32_t>> Lifecycle::beginOnSwa(BeginPlan const& plan, Req& req,
                                                          std::string const& what) {
  std::vector<ResidentRef> const residents = residentsOf(plan);
  auto result = accept(what, [&] { return mSwa->beginRequest(residents, kStream); });
  expect((result.status == SwaKVCacheStatus::kOk) == result.request.has_value(),
         what + ": status and handle disagree");
  if (!result.request) {
    expectf(result.status ==
                (mPoisoned ? SwaKVCacheStatus::kPoisoned : SwaKVCacheStatus::kRequestFailed),
            "{}: refused with {}", what, toString(result.status));
    return std::nullopt;
  }
  req.swa = std::move(*result.request);
  return std::vector<int32_t>(plan.rows.size(), 0);
}

/// The backend admitted the batch: its prefill starts are page aligned, reuse only where the
/// lookup policy allows it, and the request joins the driver's set.
void Lifecycle::admitted(BeginPlan& plan, std::unique_ptr<Req> req,
                         std::vector<int32_t> const& starts, std::optional<bool> must,
                         std::string const& what) {
  expect(!mPoisoned, what + ": admitted by a poisoned backend");
  expect(must != false, what + ": admitted although the pool cannot hold it");
  expect(starts.size() == plan.rows.size(), what + ": prefill starts for another batch");
  for (std::size_t i = 0; i < plan.rows.size(); ++i) {
    Row& row = plan.rows[i];
    row.start = starts[i];
    row.bypass = plan.rowPolicies[i].value_or(plan.lookup) == ContextCacheLookupPolicy::kBypass;
    auto const length = static_cast<int32_t>(row.prompt.size());
    // Checkpoint runtimes resume from exact checkpoints, which may end mid-page.
    expectf(
        row.start >= 0 && row.start < length && (checkpointDeployment() || row.start % kPage == 0),
        "{}: row {} starts at {} for {} tokens", what, i, row.start, length);
    bool const reusable =
        (mRuntime->backend() == KVCacheBackend::kContextReuse ||
         mRuntime->backend() == KVCacheBackend::kSlidingWindowReuse) &&
        plan.rowPolicies[i].value_or(plan.lookup) == ContextCacheLookupPolicy::kUseCache;
    expectf(row.start == 0 || reusable, "{}: row {} reuses {} tokens on bypass", what, i,
            row.start);
  }
  req->rows = std::move(plan.rows);
  plan.rows.clear();
  ++mStats.requests;
  trace(fmt::format("{}: admitted as {}", what, describe(*req)));
  mRequests.push_back(std::move(req));
}

// ---------------------------------------------------------------- the calls' arguments

LLMGenerationRequest Lifecycle::generationOf(BeginPlan const& plan) const {
  LLMGenerationRequest generation;
  generation.loraWeightsName = plan.lora;
  generation.cacheSalt = plan.salt;
  generation.contextCacheLookupPolicy = plan.lookup;
  generation.contextCacheCommitPolicy = plan.commit;
  for (auto const& policy : plan.rowPolicies) {
    LLMGenerationRequest::Sequence sequence;
    sequence.contextCacheLookupPolicy = policy;
    generation.requests.push_back(sequence);
  }
  return generation;
}

DecodingInferenceContext Lifecycle::contextOf(BeginPlan const& plan) const {
  DecodingInferenceContext context;
  context.stream = kStream;
  context.activeBatchSize = static_cast<int32_t>(plan.rows.size());
  context.loraWeightsName = plan.lora;
  for (Row const& row : plan.rows) {
    context.rawBatchedInputIds.push_back(row.prompt);
    context.residentRefs.push_back(row.resident);
    context.generatedTokenIds.emplace_back();
    context.finishReasons.push_back(FinishReason::kNotFinished);
    context.effectivePrefillLengths.push_back(static_cast<int32_t>(row.prompt.size()));
  }
  return context;
}

ContextCacheBatchAdmission Lifecycle::admissionOf(BeginPlan const& plan) const {
  ContextCacheBatchAdmission admission;
  admission.speculativeRequest = plan.speculative;
  admission.tokenStateContract = plan.contract;
  admission.commitPolicy = plan.commit;
  admission.lookupPolicy = plan.lookup;
  BlockKeyExtras const extras{digestIdentity(plan.lora), digestIdentity(plan.salt)};
  for (std::size_t i = 0; i < plan.rows.size(); ++i) {
    ContextCacheSequenceAdmission sequence;
    sequence.tokenIds = plan.rows[i].prompt;
    sequence.keyExtras = extras;
    sequence.resident = plan.rows[i].resident;
    sequence.lookupPolicy = plan.rowPolicies[i];
    admission.sequences.push_back(std::move(sequence));
  }
  return admission;
}

std::vector<ResidentRef> Lifecycle::residentsOf(BeginPlan const& plan) const {
  std::vector<ResidentRef> residents;
  for (Row const& row : plan.rows) {
    residents.push_back(row.resident);
  }
  return residents;
}

/// Whether the backend must admit the batch: the pools certainly hold it (coordinator: its cold
/// demand, base and paired draft, fits the free pages; SWA: exactly when (2M + 1) pages a row
/// are free).
std::optional<bool> Lifecycle::mustAdmit(std::vector<int32_t> const& promptLengths,
                                         DecodingKvHeadroom const& headroom, bool paired) const {
  if (coordinatorBackend()) {
    int64_t cold = 0;
    int64_t draft = 0;
    for (int32_t length : promptLengths) {
      cold += ceilPages(int64_t{length} + headroom.baseExtraTokens);
      draft += paired ? ceilPages(int64_t{length} + headroom.draftExtraTokens) : 0;
    }
    ResourcePools const& pools = mCoordinator->manager().pools();
    // Sliding-window reuse: each row's prompt pages and a spare from the free sliding pages.
    int64_t sliding = 0;
    for (int32_t length : promptLengths) {
      sliding += slidingReuse() ? ceilPages(length) + 1 : 0;
    }
    if (cold <= pools.freeCount(ResourceType::kBaseKvPage) &&
        draft <= pools.freeCount(ResourceType::kDraftKvPage) &&
        (!slidingReuse() || sliding <= mRuntime->windowBlockCache()->freePages())) {
      return true;
    }
    return std::nullopt;  // depends on reuse and eviction
  }
  return int64_t{2 * mWindowPages + 1} * static_cast<int64_t>(promptLengths.size()) <=
         mSwa->freePageCount();
}

// ---------------------------------------------------------------- invalid begins

/// One contract violation in an otherwise valid begin (variant 11: a busy resident).
void Lifecycle::badBegin() {
  withBeginPlan([&](BeginPlan& plan) {
    int32_t const variant = mIn.below(12);
    auto const what =
        fmt::format("bad begin #{} ({})", variant, plan.via == Via::kFacade ? "facade" : "direct");
    if (variant == 11) {
      beginOnBusyResident(plan, what);
    } else if (plan.via == Via::kFacade) {
      badFacadeBegin(plan, variant, what);
    } else if (coordinatorBackend()) {
      badCoordinatorBegin(plan, variant, what);
    } else {
      badSwaBegin(plan, variant, what);
    }
  });
}

/// A resident still held by another request: kPoisoned when poisoned, else a contract error.
void Lifecycle::beginOnBusyResident(BeginPlan const& plan, std::string const& what) {
  std::vector<ResidentRef> const busy = busyResidents();
  if (busy.empty()) {
    return;
  }
  BeginPlan busyPlan = plan;
  busyPlan.speculative = false;  // a vanilla request, valid but for the resident
  busyPlan.headroom = kVanilla;
  busyPlan.rows[0].resident =
      busy[static_cast<std::size_t>(mIn.below(static_cast<int32_t>(busy.size())))];
  auto facadeCall = [&] {
    return ManagedKVCacheRequest::begin(mCoordinator, mSwa, generationOf(busyPlan),
                                        contextOf(busyPlan), false, kVanilla, busyPlan.contract,
                                        busyPlan.commit);
  };
  auto coordinatorCall = [&] {
    return mCoordinator->beginRequest(admissionOf(busyPlan), kVanilla, kStream);
  };
  auto swaCall = [&] { return mSwa->beginRequest(residentsOf(busyPlan), kStream); };
  bool const facade = plan.via == Via::kFacade;
  if (!mPoisoned) {
    if (facade) {
      reject(what, facadeCall);
    } else if (coordinatorBackend()) {
      reject(what, coordinatorCall);
    } else {
      reject(what, swaCall);
    }
    return;
  }
  BackendSnapshot const before = snapshot();
  bool const poisonedStatus =
      facade                 ? !accept(what, facadeCall).has_value()
      : coordinatorBackend() ? accept(what, coordinatorCall).status == ContextCacheStatus::kPoisoned
                             : accept(what, swaCall).status == SwaKVCacheStatus::kPoisoned;
  expect(poisonedStatus, what + ": busy resident on a poisoned backend not reported as poisoned");
  expectRefusalChangedNothing(what, before);
  ++mStats.refusals;
}

void Lifecycle::badFacadeBegin(BeginPlan const& plan, int32_t variant, std::string const& what) {
  bool const swaFacade = !coordinatorBackend();
  LLMGenerationRequest generation = generationOf(plan);
  DecodingInferenceContext context = contextOf(plan);
  DecodingKvHeadroom headroom = plan.headroom;
  bool speculative = plan.speculative;
  ContextCacheCommitPolicy commit = plan.commit;
  DecodingTokenStateContract contract = plan.contract;
  ContextCacheCoordinator* coordinator = mCoordinator;
  BoundedSwaKVPageManager* swa = mSwa;
  switch (variant) {
    case 0:
      coordinator = nullptr;
      swa = nullptr;
      break;  // no backend
    case 1:
      context.activeBatchSize += 1;
      break;  // sizes disagree
    case 2:
      context.residentRefs.pop_back();
      break;  // residents disagree
    case 3:
      if (!speculativeDeployment()) {
        speculative = true;  // not a speculative deployment
      } else if (plan.speculative && mKind == Runtime::kHybridMtp && mIn.oneIn(2)) {
        commit = ContextCacheCommitPolicy::kIncludingGeneratedTokens;  // Hybrid-MTP: prefill only
      } else {
        headroom.draftExtraTokens = pairs(plan) ? 0 : 1;  // draft headroom iff paired
      }
      break;
    case 4:
      headroom = mIn.oneIn(2) ? DecodingKvHeadroom{0, plan.headroom.draftExtraTokens}
                              : DecodingKvHeadroom{1, pairs(plan) ? 0 : 2};
      break;
    case 5:
      context.stream = foreignStream();
      break;
    case 6:
      context.residentRefs[0].epoch = 0;
      break;
    case 7:
      context.residentRefs[0].slot = mIn.oneIn(2) ? -1 : mMaxBatch;
      break;
    case 8:
      if (context.residentRefs.size() < 2) {
        context.residentRefs[0].slot = mMaxBatch + 3;
      } else {
        context.residentRefs[1] = context.residentRefs[0];
      }
      break;
    case 9:
      if (swaFacade || slidingReuse()) {
        contract = DecodingTokenStateContract::kFullyCommitted;  // SWA: lookahead contract only
      } else {
        context.rawBatchedInputIds[0].clear();  // empty prompt
      }
      break;
    default:
      if (swaFacade) {
        headroom = DecodingKvHeadroom{2, 0};  // SWA: one-token decode only
      } else if (mIn.oneIn(2)) {
        context.rawBatchedInputIds[0].resize(static_cast<std::size_t>(mWidth * kPage), 7);
      } else {
        generation.loraWeightsName = "another adapter";  // request and context disagree
      }
      break;
  }
  reject(what, [&] {
    return ManagedKVCacheRequest::begin(coordinator, swa, generation, context, speculative,
                                        headroom, contract, commit);
  });
}

void Lifecycle::badCoordinatorBegin(BeginPlan const& plan, int32_t variant,
                                    std::string const& what) {
  ContextCacheBatchAdmission admission = admissionOf(plan);
  DecodingKvHeadroom headroom = plan.headroom;
  cudaStream_t stream = kStream;
  ContextCacheSequenceAdmission& first = admission.sequences[0];
  switch (variant) {
    case 0:
      admission.sequences.clear();
      break;
    case 1:
      while (static_cast<int32_t>(admission.sequences.size()) <= mMaxBatch) {
        admission.sequences.push_back(admission.sequences.back());
      }
      break;
    case 2:
      admission.commitPolicy = static_cast<ContextCacheCommitPolicy>(5);
      break;
    case 3:
      if (!speculativeDeployment()) {
        admission.speculativeRequest = true;  // not a speculative deployment
      } else if (plan.speculative && mKind == Runtime::kHybridMtp && mIn.oneIn(2)) {
        admission.commitPolicy = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
      } else {
        headroom.draftExtraTokens = pairs(plan) ? 0 : 1;  // draft headroom iff paired
      }
      break;
    case 4:
      headroom = mIn.oneIn(2) ? DecodingKvHeadroom{0, plan.headroom.draftExtraTokens}
                              : DecodingKvHeadroom{1, pairs(plan) ? 0 : 2};
      break;
    case 5:
      stream = foreignStream();
      break;
    case 6:
      first.resident.epoch = 0;
      break;
    case 7:
      first.resident.slot = mIn.oneIn(2) ? -1 : mMaxBatch;
      break;
    case 8:
      first.tokenIds.clear();
      break;
    case 9:
      first.tokenIds.resize(static_cast<std::size_t>(mWidth * kPage), 7);
      break;
    default:
      first.media.resize(first.tokenIds.size() + 1);
      break;
  }
  reject(what, [&] { return mCoordinator->beginRequest(admission, headroom, stream); });
}

void Lifecycle::badSwaBegin(BeginPlan const& plan, int32_t variant, std::string const& what) {
  std::vector<ResidentRef> residents = residentsOf(plan);
  if (residents.empty()) {
    return;  // a plan has at least one row (saying so spares GCC 12 -O3 a null-dereference
             // false positive on residents[0] below)
  }
  cudaStream_t stream = kStream;
  switch (variant % 6) {
    case 0:
      residents.clear();
      break;
    case 1:
      while (static_cast<int32_t>(residents.size()) <= mMaxBatch) {
        residents.push_back(ResidentRef{static_cast<CacheSlot>(residents.size()), 1});
      }
      break;
    case 2:
      stream = foreignStream();
      break;
    case 3:
      residents.at(0).epoch = 0;
      break;
    case 4:
      residents.at(0).slot = mIn.oneIn(2) ? -1 : mMaxBatch;
      break;
    default:
      if (residents.size() < 2) {
        residents.at(0).slot = -5;
      } else {
        residents[1] = residents[0];
      }
      break;
  }
  reject(what, [&] { return mSwa->beginRequest(residents, stream); });
}

}  // namespace mkv::fuzz::lifecycle
