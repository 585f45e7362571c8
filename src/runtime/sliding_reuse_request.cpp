#include "mkv/sliding_reuse_request.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <new>
#include <utility>

#include "context_cache/block_hash.h"
#include "context_cache/context_cache_manager.h"
#include "context_cache/eviction_policy.h"
#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "mkv/logging.h"
#include "resources/backend_requests.h"
#include "resources/shared_synchronizer.h"

namespace mkv {
namespace {

constexpr DecodingKvHeadroom kVanillaHeadroom{1, 0};

void requireVanillaRequest(char const* call, bool speculativeRequest,
                           DecodingKvHeadroom const& headroom,
                           DecodingTokenStateContract tokenStateContract) {
  MKV_REQUIRE(!speculativeRequest, call,
              "the sliding-window reuse backend does not decode speculatively");
  MKV_REQUIRE(headroom == kVanillaHeadroom, call,
              "the sliding-window reuse backend needs headroom {{1, 0}}, got {{{}, {}}}",
              headroom.baseExtraTokens, headroom.draftExtraTokens);
  MKV_REQUIRE(tokenStateContract == DecodingTokenStateContract::kCommittedPlusLookahead, call,
              "the sliding-window reuse backend needs the committed-plus-lookahead contract");
}

/// The SWA half's admission of each row: its prompt, its reuse start and the cached window
/// pages before the start (held by the manager from now on).
std::vector<SwaReuseStart> swaStarts(ContextCacheCoordinator const& coordinator,
                                     ContextCacheRequest const& full,
                                     std::vector<int32_t> const& prompts) {
  std::vector<SwaReuseStart> starts(prompts.size());
  for (std::size_t row = 0; row < prompts.size(); ++row) {
    starts[row].promptTokens = prompts[row];
    starts[row].startTokens = full.prefillStarts()[row];
    starts[row].windowPages =
        coordinator.reusedWindowPages(full.handle(), static_cast<ExecutionRow>(row));
  }
  return starts;
}

// ---------------------------------------------------------------- the admission check
//
// Either half's admission changes what a refusal of the other could not undo: the coordinator
// evicts records, leases and reorders its free ring; the sliding pool drops cached window blocks
// for pages and promotes the window pages it holds. So a batch or a joiner is checked against
// both before either admits: the coordinator's side by its own admission, which refuses without
// a trace; the sliding side here, first, with the reuse starts the coordinator's lookup will give
// (estimateAdmission: the same lookup, nothing changed) and the cached window pages before them.
// The coordinator's admission touches nothing of the sliding pool, so a batch this check lets
// through is admitted by the sliding half.

/// Pages of `tokens` tokens.
int64_t pagesOf(std::size_t tokens, int32_t pageSize) {
  return (static_cast<int64_t>(tokens) + pageSize - 1) / pageSize;
}

/// Whatever the reuse, a sequence of `tokens` prompt tokens takes at most ceil(L / P) + 1 pages
/// from the sliding pool: its ceil(L / P) - s / P + 1 private pages plus at most its s / P window
/// pages before s. True when the pool surely holds `prompts` (no dry run needed).
template <typename Prompts>
bool slidingPoolHoldsCold(BoundedSwaKVPageManager const& manager, Prompts const& prompts) {
  int64_t cold = 0;
  for (auto const& prompt : prompts) {
    cold += pagesOf(prompt.size(), manager.tokensPerPage()) + 1;
  }
  return !manager.poisoned() && cold <= manager.freePageCount();
}

WindowBlockCache const& windowCacheOf(ContextCacheCoordinator const& coordinator) {
  WindowBlockCache const* window = coordinator.manager().options().windowCache;
  MKV_ASSERT(window != nullptr,
             "the sliding-window reuse backend's coordinator has no window cache");
  return *window;
}

/// Where `sequence` starts if the coordinator admits it now (its lookup, as estimateAdmission
/// makes it: nothing changes), with the cached window pages before the start
/// (ContextCacheCoordinator::reusedWindowPages of the admitted row).
SwaReuseStart plannedStart(ContextCacheCoordinator const& coordinator,
                           ContextCacheSequenceAdmission const& sequence, char const* call) {
  AdmissionEstimate const estimate = coordinator.estimateAdmission(sequence, kVanillaHeadroom);
  SwaReuseStart start;
  start.promptTokens = static_cast<int32_t>(sequence.tokenIds.size());
  start.startTokens = estimate.reusableTokens;
  if (start.startTokens > 0) {
    auto const length = static_cast<std::size_t>(start.startTokens);
    std::span<MediaPosition const> media;
    if (!sequence.media.empty()) {
      media = std::span<MediaPosition const>(sequence.media).first(length);
    }
    PromptView const prefix{std::span<int32_t const>(sequence.tokenIds).first(length), media,
                            sequence.keyExtras};
    WindowBlockCache const& window = windowCacheOf(coordinator);
    int32_t const page = window.index().pageSize();
    start.windowPages =
        window.windowPages(call, hashPromptBlocks(prefix, page), start.startTokens / page);
  }
  return start;
}

/// The cached window pages of `starts` that no request holds yet (each counted once).
std::vector<PageId> unheldWindowPages(WindowBlockCache const& window,
                                      std::span<SwaReuseStart const> starts) {
  std::vector<PageId> unheld;
  for (SwaReuseStart const& start : starts) {
    for (PageId const page : start.windowPages) {
      if (window.holders(page) == 0 &&
          std::find(unheld.begin(), unheld.end(), page) == unheld.end()) {
        unheld.push_back(page);
      }
    }
  }
  return unheld;
}

/// Whether the sliding pool gives `privatePages` pages once the window pages of `starts` are held
/// (BoundedSwaKVPageManager::checkBeginRequest): a window page nobody holds yet is cached and
/// allocatable until then; one already held costs nothing.
bool slidingPoolHolds(ContextCacheCoordinator const& coordinator,
                      std::span<SwaReuseStart const> starts, int64_t privatePages) {
  WindowBlockCache const& window = windowCacheOf(coordinator);
  return privatePages + static_cast<int64_t>(unheldWindowPages(window, starts).size()) <=
         window.availablePages();
}

bool sameStart(SwaReuseStart const& a, SwaReuseStart const& b) {
  return a.promptTokens == b.promptTokens && a.startTokens == b.startTokens &&
         a.windowPages == b.windowPages;
}

bool imagesHostReadable(std::vector<imageUtils::ImageData> const& images) {
  return std::all_of(images.begin(), images.end(),
                     [](auto const& image) { return image.data() != nullptr; });
}

// The admissions ContextCacheRequest builds (context_cache_request.cpp: begin's
// batchLookupPolicy and admissionSequences, admitSequence's joiner), for the dry run; the
// composed request checks after each admission that the coordinator started where the dry run
// said.

ContextCacheLookupPolicy batchLookupPolicy(LLMGenerationRequest const& request,
                                           std::vector<int32_t> const& mediaTokenIds) {
  ContextCacheLookupPolicy policy = request.contextCacheLookupPolicy;
  if (!mediaTokenIds.empty()) {
    for (auto const& sequence : request.requests) {
      if (!imagesHostReadable(sequence.imageBuffers)) {
        policy = ContextCacheLookupPolicy::kBypass;
      }
    }
  }
  return policy;
}

/// Row `row` of a batch admission, its lookup policy resolved (as beginRequest resolves it).
ContextCacheSequenceAdmission founderSequence(LLMGenerationRequest const& request,
                                              DecodingInferenceContext const& context,
                                              std::vector<int32_t> const& mediaTokenIds,
                                              ContextCacheLookupPolicy batchPolicy,
                                              std::size_t row) {
  ContextCacheSequenceAdmission sequence;
  sequence.tokenIds = context.rawBatchedInputIds[row];
  sequence.keyExtras =
      BlockKeyExtras{digestIdentity(context.loraWeightsName), digestIdentity(request.cacheSalt)};
  sequence.resident = context.residentRefs[row];
  sequence.retention = request.contextCacheRetention;
  ContextCacheLookupPolicy policy = batchPolicy;
  if (batchPolicy != ContextCacheLookupPolicy::kBypass && !request.requests.empty()) {
    policy = request.requests[row].contextCacheLookupPolicy.value_or(batchPolicy);
  }
  sequence.lookupPolicy = policy;
  if (policy == ContextCacheLookupPolicy::kUseCache && !request.requests.empty()) {
    sequence.media =
        buildMediaPositions(sequence.tokenIds, mediaTokenIds, request.requests[row].imageBuffers,
                            request.requests[row].audioBuffers);
  }
  return sequence;
}

/// What ContextCacheRequest::begin and beginRequest check before they admit that the dry run
/// does not (estimateAdmission checks each prompt, the SWA half the residents, the stream and
/// the batch size): a refusal must not come where they throw.
void checkFullHalfInputs(char const* call, LLMGenerationRequest const& request,
                         DecodingInferenceContext const& context,
                         ContextCacheCommitPolicy commitPolicy) {
  auto const batch = context.rawBatchedInputIds.size();
  MKV_REQUIRE(
      context.activeBatchSize > 0 && batch == static_cast<std::size_t>(context.activeBatchSize),
      call, "activeBatchSize {} but {} prompts", context.activeBatchSize, batch);
  MKV_REQUIRE(context.residentRefs.size() == batch, call, "{} residents for {} prompts",
              context.residentRefs.size(), batch);
  MKV_REQUIRE(request.requests.empty() || request.requests.size() == batch, call,
              "{} per-sequence inputs for {} prompts", request.requests.size(), batch);
  MKV_REQUIRE(request.loraWeightsName.empty() || request.loraWeightsName == context.loraWeightsName,
              call, "request LoRA '{}' differs from the context's '{}'", request.loraWeightsName,
              context.loraWeightsName);
  MKV_REQUIRE(static_cast<uint8_t>(commitPolicy) <= 1 &&
                  static_cast<uint8_t>(request.contextCacheLookupPolicy) <= 1,
              call, "commit policy {} / lookup policy {} out of range",
              static_cast<int>(commitPolicy), static_cast<int>(request.contextCacheLookupPolicy));
  MKV_REQUIRE(request.contextCacheReplayTailLength == 0, call,
              "a replay tail ({} tokens) applies to Hybrid-MTP requests only",
              request.contextCacheReplayTailLength);
  requireValidRetention(call, request.contextCacheRetention);
}

/// The dry run of a batch admission on both halves: the sliding half's reuse starts when both
/// halves are to admit it; nullopt (one log line) when the sliding pool cannot hold it or is
/// poisoned. Throws for what either half's admission throws for. Changes nothing.
std::optional<std::vector<SwaReuseStart>> planAdmission(ContextCacheCoordinator const& coordinator,
                                                        BoundedSwaKVPageManager const& manager,
                                                        LLMGenerationRequest const& request,
                                                        DecodingInferenceContext const& context,
                                                        std::vector<int32_t> const& mediaTokenIds,
                                                        ContextCacheCommitPolicy commitPolicy) {
  constexpr char const* kCall = "SlidingReuseRequest::begin";
  checkFullHalfInputs(kCall, request, context, commitPolicy);
  ContextCacheLookupPolicy const batchPolicy = batchLookupPolicy(request, mediaTokenIds);
  std::vector<SwaReuseStart> starts;
  starts.reserve(context.rawBatchedInputIds.size());
  for (std::size_t row = 0; row < context.rawBatchedInputIds.size(); ++row) {
    starts.push_back(plannedStart(
        coordinator, founderSequence(request, context, mediaTokenIds, batchPolicy, row), kCall));
  }
  int64_t const privatePages =
      manager.checkBeginRequest(context.residentRefs, context.stream, starts, kCall);
  if (manager.poisoned() || !slidingPoolHolds(coordinator, starts, privatePages)) {
    logger()->error(
        "ManagedKVCacheRequest::begin refused by the sliding pool of the sliding-window reuse "
        "backend before either half admitted: {}",
        manager.poisoned() ? "backend poisoned"
                           : fmt::format("no capacity ({} pages and the window pages, {} free)",
                                         privatePages, manager.freePageCount()));
    return std::nullopt;
  }
  return starts;
}

}  // namespace

SlidingReuseRequest::SlidingReuseRequest(ContextCacheRequest full, BoundedSwaKVPageManager& manager,
                                         BoundedSwaKVPageManager::RequestHandle handle,
                                         std::vector<int32_t> prompts, cudaStream_t stream)
    : mFull(std::move(full)),
      mManager(&manager),
      mHandle(std::move(handle)),
      mPromptTokens(std::move(prompts)),
      mStream(stream) {}

SlidingReuseRequest::~SlidingReuseRequest() {
  detail::SharedSynchronizer::Scope const once(mManager->sharedSynchronizer());
  // Abandoned inside the scope, in the members' order of destruction: the SWA half first.
  ContextCacheRequest const full = std::move(mFull);
  BoundedSwaKVPageManager::RequestHandle const sliding = std::move(mHandle);
}

SlidingReuseRequest::SlidingPoolEstimate SlidingReuseRequest::estimateSlidingPool(
    ContextCacheCoordinator const& coordinator, BoundedSwaKVPageManager const& manager,
    ContextCacheSequenceAdmission const& sequence) {
  SwaReuseStart const start =
      plannedStart(coordinator, sequence, "SlidingReuseRequest::estimateSlidingPool");
  int32_t const page = manager.tokensPerPage();
  SlidingPoolEstimate estimate;
  estimate.privatePages =
      static_cast<int32_t>(pagesOf(sequence.tokenIds.size(), page)) - start.startTokens / page + 1;
  estimate.unheldWindowPages = static_cast<int32_t>(
      unheldWindowPages(windowCacheOf(coordinator), std::span(&start, 1)).size());
  return estimate;
}

std::optional<SlidingReuseRequest> SlidingReuseRequest::begin(
    ContextCacheCoordinator& coordinator, BoundedSwaKVPageManager& manager,
    LLMGenerationRequest const& request, DecodingInferenceContext const& context,
    bool speculativeRequest, DecodingKvHeadroom const& headroom,
    std::vector<int32_t> const& mediaTokenIds, DecodingTokenStateContract tokenStateContract,
    ContextCacheCommitPolicy commitPolicy) {
  requireVanillaRequest("SlidingReuseRequest::begin", speculativeRequest, headroom,
                        tokenStateContract);
  // Both halves must admit before either does (see "the admission check" above). A poisoned
  // coordinator refuses without a trace; a batch the sliding pool surely holds needs no dry run.
  std::optional<std::vector<SwaReuseStart>> planned;
  if (!coordinator.poisoned() && !slidingPoolHoldsCold(manager, context.rawBatchedInputIds)) {
    planned = planAdmission(coordinator, manager, request, context, mediaTokenIds, commitPolicy);
    if (!planned) {
      return std::nullopt;
    }
  }
  std::optional<ContextCacheRequest> full =
      ContextCacheRequest::begin(coordinator, request, context, speculativeRequest, headroom,
                                 mediaTokenIds, tokenStateContract, commitPolicy);
  if (!full) {
    return std::nullopt;
  }
  std::vector<int32_t> prompts;
  prompts.reserve(context.rawBatchedInputIds.size());
  for (auto const& prompt : context.rawBatchedInputIds) {
    prompts.push_back(static_cast<int32_t>(prompt.size()));
  }
  std::vector<SwaReuseStart> const starts = swaStarts(coordinator, *full, prompts);
  for (std::size_t row = 0; planned && row < starts.size(); ++row) {
    MKV_ASSERT(sameStart(starts[row], (*planned)[row]),
               "row {} starts at {} with {} window pages, the admission check planned {} with {}",
               row, starts[row].startTokens, starts[row].windowPages.size(),
               (*planned)[row].startTokens, (*planned)[row].windowPages.size());
  }
  auto begun = manager.beginRequest(context.residentRefs, context.stream, starts);
  // The check (or the cold bound) said the sliding pool holds the batch, and the coordinator's
  // admission changed nothing there. (A throw, std::bad_alloc, abandons `full`: its leases go
  // back unpublished.)
  MKV_ASSERT(begun.status == SwaKVCacheStatus::kOk,
             "the sliding half refused ({}) a batch the admission check let through",
             toString(begun.status));
  return SlidingReuseRequest(std::move(*full), manager, std::move(*begun.request),
                             std::move(prompts), context.stream);
}

bool SlidingReuseRequest::swaStatus(SwaKVCacheStatus status, char const* operation) const {
  if (status == SwaKVCacheStatus::kOk) {
    return true;
  }
  logger()->error("ManagedKVCacheRequest::{} failed on the sliding pool: {}{}", operation,
                  toString(status),
                  mManager->poisoned() ? " (backend poisoned)" : " (request failed)");
  return false;
}

void SlidingReuseRequest::requireSlidingHalfExecuting(char const* call) const {
  MKV_REQUIRE(!mManager->finishing(mHandle), call,
              "the request is finishing (its sliding half refused a decode step or has no row "
              "left): finish it");
}

bool SlidingReuseRequest::poisoned() const noexcept {
  return mFull.poisoned() || mManager->poisoned();
}

bool SlidingReuseRequest::preparePrefill() {
  mManager->checkLengthPoolsFree(mHandle, "SlidingReuseRequest::preparePrefill");
  return mFull.preparePrefill();
}

bool SlidingReuseRequest::prepareSwaPrefill(std::vector<int32_t> const& effectiveInputLengths) {
  constexpr char const* kCall = "SlidingReuseRequest::prepareSwaPrefill";
  std::vector<int32_t> const& starts = mFull.prefillStarts();
  MKV_REQUIRE(effectiveInputLengths.size() == starts.size(), kCall, "{} lengths for a batch of {}",
              effectiveInputLengths.size(), starts.size());
  mSwaLengths.clear();
  for (std::size_t row = 0; row < starts.size(); ++row) {
    // The manager maps up to the endpoint the prefill reaches: start + executed tokens.
    mSwaLengths.push_back(starts[row] + effectiveInputLengths[row]);
  }
  mManager->preparePrefill(mHandle, mSwaLengths);
  return true;
}

int32_t SlidingReuseRequest::publishMappedBlocks(std::size_t row, int32_t firstBlock,
                                                 int32_t endBlock) {
  SwaSequenceState const& state = mManager->state(mHandle, static_cast<int32_t>(row));
  auto const inRange = [&](SwaPageBinding const& binding) {
    return binding.logicalPage >= firstBlock && binding.logicalPage < endBlock;
  };
  int32_t mappedFrom = endBlock;
  int32_t mapped = 0;
  auto const count = [&](SwaPageBinding const& binding) {
    if (inRange(binding)) {
      mappedFrom = std::min(mappedFrom, binding.logicalPage);
      ++mapped;
    }
  };
  std::for_each(state.pendingRetire.begin(), state.pendingRetire.end(), count);
  std::for_each(state.bindings.begin(), state.bindings.end(), count);
  MKV_ASSERT(mapped == endBlock - mappedFrom, "row {}: {} sliding pages mapped for blocks [{}, {})",
             row, mapped, mappedFrom, endBlock);
  if (mapped == 0) {
    return mappedFrom;
  }
  try {
    mBlockPages.clear();
    for (SwaPageBinding const& binding : state.pendingRetire) {  // leaving the window now
      if (inRange(binding)) {
        mBlockPages.push_back(binding.page);
      }
    }
    for (SwaPageBinding const& binding : state.bindings) {
      if (inRange(binding)) {
        mBlockPages.push_back(binding.page);
      }
    }
    mFull.coordinator().publishWindowBlocks(mFull.handle(), static_cast<ExecutionRow>(row),
                                            mappedFrom, mBlockPages);
  } catch (std::bad_alloc const&) {
    // As the coordinator's own publication at a completion point: the step is applied, and the
    // blocks it could not publish (each one is published whole or not at all) stay unpublished;
    // the sliding pool then drops or reuses their pages as any unpublished page.
    logger()->warn(
        "SlidingReuseRequest: publishing the sliding pages of row {}'s blocks [{}, {}) ran out "
        "of host memory; they stay unpublished",
        row, mappedFrom, endBlock);
  }
  return mappedFrom;
}

void SlidingReuseRequest::publishPromptBlocks(std::size_t row) {
  int32_t const pageSize = mManager->tokensPerPage();
  int32_t const startBlock = mFull.prefillStarts()[row] / pageSize;
  // Every complete prompt block the prefill executed is still mapped.
  int32_t const mappedFrom = publishMappedBlocks(row, startBlock, mPromptTokens[row] / pageSize);
  MKV_ASSERT(mappedFrom == startBlock, "row {}: prompt blocks from {} mapped, not from {}", row,
             mappedFrom, startBlock);
}

bool SlidingReuseRequest::publishesGeneratedTokens(std::size_t row) const {
  return mFull.coordinator().commitPolicy(mFull.handle(), static_cast<ExecutionRow>(row)) ==
         ContextCacheCommitPolicy::kIncludingGeneratedTokens;
}

void SlidingReuseRequest::publishGeneratedWindow(std::size_t row) {
  int32_t const pageSize = mManager->tokensPerPage();
  SwaSequenceState const& state = mManager->state(mHandle, static_cast<int32_t>(row));
  // Tokens whose sliding KV exists once the step completes: the coordinator's committed count.
  // The sliding window moves on every step, a row that produced no token (cancelled) included,
  // so its endpoint may be past that count: blocks beyond it are not the row's.
  int32_t const committed =
      mFull.coordinator().committedLength(mFull.handle(), static_cast<ExecutionRow>(row));
  int32_t const endBlock =
      std::min(state.pendingEndpoint.value_or(state.endpoint), committed) / pageSize;
  (void)publishMappedBlocks(row, mPromptTokens[row] / pageSize, endBlock);
}

bool SlidingReuseRequest::preparePrefillChunk(ExecutionRow row, int32_t chunkEnd) {
  requireSlidingHalfExecuting("SlidingReuseRequest::preparePrefillChunk");
  return mFull.preparePrefillChunk(row, chunkEnd);
}

DecodeStepDemand SlidingReuseRequest::prefillChunkDemand(ExecutionRow row, int32_t chunkEnd) const {
  requireSlidingHalfExecuting("SlidingReuseRequest::prefillChunkDemand");
  return mFull.prefillChunkDemand(row, chunkEnd);
}

bool SlidingReuseRequest::completePrefillChunk(ExecutionRow row, int32_t prefilledTokens) {
  // The full layers publish per chunk (a founder's in the prefill too); the sliding pages of the
  // row's whole prompt stay mapped until it finalises, which publishes them.
  requireSlidingHalfExecuting("SlidingReuseRequest::completePrefillChunk");
  return mFull.completePrefillChunk(row, prefilledTokens);
}

bool SlidingReuseRequest::preemptSequence(ExecutionRow row) {
  requireSlidingHalfExecuting("SlidingReuseRequest::preemptSequence");
  if (!mFull.preemptSequence(row)) {
    return false;
  }
  if (publishesGeneratedTokens(static_cast<std::size_t>(row))) {
    publishGeneratedWindow(static_cast<std::size_t>(row));
  }
  return true;
}

bool SlidingReuseRequest::preemptSequence(ExecutionRow row, PreemptionKind kind) {
  MKV_REQUIRE(kind == PreemptionKind::kRecompute, "SlidingReuseRequest::preemptSequence",
              "row {}: swap preemption needs a host tier, which the sliding-window reuse backend "
              "does not have",
              row);
  return preemptSequence(row);
}

bool SlidingReuseRequest::completePrefill(DecodingInferenceContext const& context,
                                          std::vector<int32_t> const& commonStateLengths) {
  // The coordinator publishes the full layers' blocks and marks the prefill complete; then the
  // sliding pages of the same blocks are published, before the SWA half retires the ones that
  // left the window (a published page stays cached). The SWA half's checks come first: neither
  // half changes unless both accept.
  // A founder whose prefill goes on in chunks (its chunks stopped short of its prompt) keeps its
  // staged prompt on the sliding half, as a joiner does, and publishes at finalisation.
  mManager->checkPreparedWritesOnDevice(mHandle, "SlidingReuseRequest::completePrefill");
  std::vector<uint8_t> held(mPromptTokens.size(), 0);
  for (std::size_t row = 0; row < held.size(); ++row) {
    held[row] = mFull.awaitsPrefill(static_cast<ExecutionRow>(row)) ? 1 : 0;
  }
  bool const fullOk = mFull.completePrefill(context, commonStateLengths);
  if (fullOk) {
    for (std::size_t row = 0; row < mPromptTokens.size(); ++row) {
      if (held[row] == 0) {
        publishPromptBlocks(row);
      }
    }
  }
  mManager->completePrefill(mHandle, held);
  return fullOk;
}

bool SlidingReuseRequest::prepareDecodeStep(DecodingInferenceContext const& context,
                                            DecodingKvHeadroom const& headroom) {
  constexpr char const* kCall = "SlidingReuseRequest::prepareDecodeStep";
  requireVanillaRequest(kCall, false, headroom,
                        DecodingTokenStateContract::kCommittedPlusLookahead);
  // A step either half refuses leaves both halves settled (the failing row named), so that the
  // engine can drop or preempt rows and prepare the step again, or finish: the other half must
  // not have prepared it. So the sliding half's outcome is known first (its checks and its row
  // failure, without effects); a step it refuses is refused there alone, and one it accepts is
  // prepared on the full half first (which refuses alone), then on the sliding half.
  MKV_REQUIRE(context.generatedTokenIds.size() == mPromptTokens.size(), kCall,
              "context has {} generated lists for a batch of {}", context.generatedTokenIds.size(),
              mPromptTokens.size());
  RowFailure const slidingFailure = mManager->checkPrepareDecodeStep(mHandle, kCall);
  if (slidingFailure.reason != RowFailureReason::kNone) {
    SwaKVCacheStatus const refused = mManager->prepareDecodeStep(mHandle);
    MKV_ASSERT(refused != SwaKVCacheStatus::kOk,
               "the sliding half staged a step its check refused (row {})", slidingFailure.row);
    return mManager->poisoned()
               ? swaStatus(refused, "prepareDecodeStep")
               : detail::refusedStep("ManagedKVCacheRequest::prepareDecodeStep", slidingFailure);
  }
  if (!mFull.prepareDecodeStep(context, headroom)) {
    return false;
  }
  SwaKVCacheStatus const staged = mManager->prepareDecodeStep(mHandle);
  MKV_ASSERT(staged == SwaKVCacheStatus::kOk,
             "the sliding half refused ({}) a step its check accepted", toString(staged));
  return true;
}

bool SlidingReuseRequest::completeDecodeStep(DecodingInferenceContext const& context,
                                             std::vector<int32_t> const& commonStateLengths) {
  mManager->checkPreparedWritesOnDevice(mHandle, "SlidingReuseRequest::completeDecodeStep");
  bool const fullOk = mFull.completeDecodeStep(context, commonStateLengths);
  if (fullOk) {
    // The rows the full half just published (ContextCacheRequest: a normal completion, under
    // the row's commit policy).
    for (std::size_t row = 0; row < context.finishReasons.size(); ++row) {
      FinishReason const reason = context.finishReasons[row];
      if (reason != FinishReason::kNotFinished && reason != FinishReason::kCancelled &&
          reason != FinishReason::kError &&
          !mManager->state(mHandle, static_cast<int32_t>(row)).joining &&
          publishesGeneratedTokens(row)) {
        publishGeneratedWindow(row);
      }
    }
  }
  mManager->completeDecodeStep(mHandle);
  return fullOk;
}

bool SlidingReuseRequest::beginBatchCompaction(std::vector<int32_t> const& oldToNew,
                                               int32_t newBatchSize, Tensor& deviceBatchMapping) {
  constexpr char const* kCall = "SlidingReuseRequest::beginBatchCompaction";
  std::vector<int32_t> pending = oldToNew;  // copied first: nothing fails after the calls
  // Each half compacts its own length tensor (the sliding pool's, the full pool's): both halves
  // check everything before either begins, then both copy the same mapping into
  // deviceBatchMapping.
  mManager->checkBeginBatchCompaction(mHandle, oldToNew, newBatchSize, deviceBatchMapping, kCall);
  mFull.coordinator().checkBeginBatchCompaction(mFull.handle(), oldToNew, newBatchSize,
                                                deviceBatchMapping, kCall);
  // The full half first: what it allocates comes before it changes anything; the sliding half
  // allocates nothing here (its mapping's capacity is reserved at admission), so it cannot fail
  // after the full half began.
  mFull.beginBatchCompaction(oldToNew, newBatchSize, deviceBatchMapping);
  mManager->beginBatchCompaction(mHandle, oldToNew, newBatchSize, deviceBatchMapping);
  mPendingMapping = std::move(pending);
  return true;
}

bool SlidingReuseRequest::completeBatchCompaction(std::vector<int32_t> const& keepMapping) {
  constexpr char const* kCall = "SlidingReuseRequest::completeBatchCompaction";
  detail::requireBegunMapping(kCall, mPendingMapping, keepMapping);
  // As at the begin: the engine may have resized either half's length tensor since.
  mManager->checkCompactBatch(mHandle, kCall);
  mFull.coordinator().checkCompactBatch(mFull.handle(), kCall);
  // What this request allocates comes first; the full half allocates before it compacts, and the
  // sliding half allocates nothing: neither can run out of host memory after the other compacted.
  std::vector<int32_t> kept;
  kept.reserve(mPendingMapping.size());
  for (std::size_t row = 0; row < mPendingMapping.size(); ++row) {
    if (mPendingMapping[row] >= 0) {
      kept.push_back(mPromptTokens[row]);  // order-preserving: the k-th survivor goes to k
    }
  }
  detail::SharedSynchronizer::Scope const once(mManager->sharedSynchronizer());
  bool const fullOk = mFull.completeBatchCompaction(keepMapping);
  bool const swaOk = swaStatus(mManager->compactBatch(mHandle), "completeBatchCompaction");
  mPromptTokens = std::move(kept);
  mPendingMapping.clear();
  return fullOk && swaOk;
}

bool SlidingReuseRequest::finish() {
  detail::SharedSynchronizer::Scope const once(mManager->sharedSynchronizer());
  bool const fullOk = mFull.finish();
  bool const swaOk = swaStatus(mManager->finish(mHandle), "finish");
  return fullOk && swaOk;
}

AdmitSequenceStatus SlidingReuseRequest::admitSequence(
    std::vector<int32_t> const& tokenIds, std::string const& loraWeightsName,
    DecodingKvHeadroom const& headroom, int32_t& prefillStart, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds,
    std::vector<imageUtils::ImageData> const& imageBuffers,
    std::vector<audioUtils::AudioData> const& audioBuffers) {
  return admitSequence(mFull.inheritedJoiner(loraWeightsName, imageBuffers, audioBuffers), tokenIds,
                       headroom, prefillStart, resident, stream, mediaTokenIds);
}

AdmitSequenceStatus SlidingReuseRequest::admitSequence(LLMGenerationRequest const& joiner,
                                                       std::vector<int32_t> const& tokenIds,
                                                       DecodingKvHeadroom const& headroom,
                                                       int32_t& prefillStart, ResidentRef resident,
                                                       cudaStream_t stream,
                                                       std::vector<int32_t> const& mediaTokenIds) {
  constexpr char const* kCall = "SlidingReuseRequest::admitSequence";
  requireVanillaRequest(kCall, false, headroom,
                        DecodingTokenStateContract::kCommittedPlusLookahead);
  requireSlidingHalfExecuting(kCall);
  // As begin: the joiner is checked against both halves before either admits it.
  std::optional<SwaReuseStart> planned;
  if (!mFull.poisoned() && !slidingPoolHoldsCold(*mManager, std::span(&tokenIds, 1))) {
    planned = planJoiner(joiner, tokenIds, resident, stream, mediaTokenIds);
    if (!planned) {
      return mManager->poisoned() ? AdmitSequenceStatus::kFailed : AdmitSequenceStatus::kNoCapacity;
    }
  }
  mPromptTokens.reserve(mPromptTokens.size() + 1);  // nothing after the admissions allocates
  int32_t start = 0;
  AdmitSequenceStatus const status =
      mFull.admitSequence(joiner, tokenIds, headroom, start, resident, stream, mediaTokenIds);
  if (status != AdmitSequenceStatus::kAdmitted) {
    return status;
  }
  auto const row = static_cast<ExecutionRow>(mFull.prefillStarts().size() - 1);
  SwaReuseStart swaStart;
  swaStart.promptTokens = static_cast<int32_t>(tokenIds.size());
  swaStart.startTokens = start;
  SwaKVCacheStatus swa = SwaKVCacheStatus::kRequestFailed;
  try {
    swaStart.windowPages = mFull.coordinator().reusedWindowPages(mFull.handle(), row);
    MKV_ASSERT(!planned || sameStart(swaStart, *planned),
               "the joiner starts at {} with {} window pages, the admission check planned {} "
               "with {}",
               swaStart.startTokens, swaStart.windowPages.size(), planned->startTokens,
               planned->windowPages.size());
    swa = mManager->admitSequence(mHandle, resident, swaStart);
    // The check (or the cold bound) said the sliding pool holds the joiner.
    MKV_ASSERT(swa == SwaKVCacheStatus::kOk,
               "the sliding half refused ({}) a joiner the admission check let through",
               toString(swa));
  } catch (...) {
    (void)mFull.retractSequenceAdmission();  // the halves stay in step; the error goes on
    throw;
  }
  mPromptTokens.push_back(swaStart.promptTokens);
  prefillStart = start;
  return AdmitSequenceStatus::kAdmitted;
}

std::optional<SwaReuseStart> SlidingReuseRequest::planJoiner(
    LLMGenerationRequest const& joiner, std::vector<int32_t> const& tokenIds, ResidentRef resident,
    cudaStream_t stream, std::vector<int32_t> const& mediaTokenIds) const {
  constexpr char const* kCall = "SlidingReuseRequest::admitSequence";
  // ContextCacheRequest::admitSequence's own checks and admission; the coordinator's checks are
  // made by estimateAdmission (the prompt) and the SWA half's (the request's state, the resident).
  MKV_REQUIRE(stream == mStream, kCall, "stream differs from the request's stream");
  ContextCacheSequenceAdmission const sequence =
      ContextCacheRequest::joinerAdmission(kCall, joiner, tokenIds, resident, mediaTokenIds);
  SwaReuseStart start = plannedStart(mFull.coordinator(), sequence, kCall);
  int32_t const privatePages = mManager->checkAdmitSequence(mHandle, resident, start, kCall);
  if (mManager->poisoned() ||
      !slidingPoolHolds(mFull.coordinator(), std::span(&start, 1), privatePages)) {
    logger()->error(
        "ManagedKVCacheRequest::admitSequence refused by the sliding pool before either half "
        "admitted: {}",
        mManager->poisoned() ? "backend poisoned"
                             : fmt::format("no capacity ({} pages and the window pages, {} free)",
                                           privatePages, mManager->freePageCount()));
    return std::nullopt;
  }
  return start;
}

bool SlidingReuseRequest::finalizeSequenceAdmission(ExecutionRow row, int32_t const& lookaheadToken,
                                                    int32_t fullInputLength) {
  constexpr char const* kCall = "SlidingReuseRequest::finalizeSequenceAdmission";
  MKV_REQUIRE(row >= 0 && static_cast<std::size_t>(row) < mPromptTokens.size() &&
                  mManager->state(mHandle, row).joining,
              kCall, "row {} is not an unfinalised in-flight admission", row);
  // Both halves check before either changes: the sliding half here (work pending there, such as
  // a prepared decode step, would otherwise throw after the full half had finalised), the full
  // half in its own call. Then, as completePrefill: the full half publishes its blocks, the
  // sliding pages of the same blocks are published, and the SWA half retires what left the
  // window.
  mManager->checkFinalizeSequenceAdmission(mHandle, row, kCall);
  requireSlidingHalfExecuting(kCall);
  if (!mFull.finalizeSequenceAdmission(row, lookaheadToken, fullInputLength)) {
    return false;  // poisoned; finish releases the SWA half's joiner
  }
  publishPromptBlocks(static_cast<std::size_t>(row));
  mManager->finalizeSequenceAdmission(mHandle, row);
  return true;
}

DecodeStepDemand SlidingReuseRequest::decodeStepDemand(DecodingKvHeadroom const& headroom) const {
  requireVanillaRequest("SlidingReuseRequest::decodeStepDemand", false, headroom,
                        DecodingTokenStateContract::kCommittedPlusLookahead);
  DecodeStepDemand demand = mFull.decodeStepDemand(headroom);
  DecodeStepDemand const sliding = mManager->decodeStepDemand(mHandle);
  demand.slidingPages = sliding.slidingPages;
  if (sliding.tableFull.reason != RowFailureReason::kNone &&
      (demand.tableFull.reason == RowFailureReason::kNone ||
       sliding.tableFull.row < demand.tableFull.row)) {
    demand.tableFull = sliding.tableFull;
  }
  return demand;
}

RowFailure SlidingReuseRequest::lastFailure() const noexcept {
  RowFailure const full = mFull.lastFailure();
  return full.reason != RowFailureReason::kNone ? full : mManager->lastFailure(mHandle);
}

bool SlidingReuseRequest::retractSequenceAdmission() noexcept {
  // Both halves must hold the same undoable joiner; they can disagree after a call that failed
  // on one half (a decode step the SWA half refused, a quarantined half): then nothing is
  // undone on either, and the engine finishes the request.
  if (!mManager->hasRetractableAdmission(mHandle) ||
      !mFull.coordinator().hasRetractableAdmission(mFull.handle())) {
    return false;
  }
  bool const full = mFull.retractSequenceAdmission();
  bool const swa = mManager->retractSequenceAdmission(mHandle);
  mPromptTokens.pop_back();
  return full && swa;
}

bool SlidingReuseRequest::publishHybridMtpEndpoint(ExecutionRow row,
                                                   int32_t /*residentStateLength*/,
                                                   Tensor const& /*baseHiddenStates*/,
                                                   int32_t /*boundaryHiddenRow*/) {
  detail::throwContract("SlidingReuseRequest::publishHybridMtpEndpoint",
                        "row {}: the sliding-window reuse backend has no recurrent layers", row);
}

bool SlidingReuseRequest::restoreHybridMtpBoundaryHidden(ExecutionRow row,
                                                         Tensor& /*baseHiddenStates*/,
                                                         int32_t /*destinationRow*/) {
  detail::throwContract("SlidingReuseRequest::restoreHybridMtpBoundaryHidden",
                        "row {}: the sliding-window reuse backend has no recurrent layers", row);
}

}  // namespace mkv
