#include "mkv/testing/reference_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <limits>

#include "context_cache/block_hash.h"
#include "context_cache/context_cache_manager.h"
#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "core/device.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_request.h"
#include "mkv/managed_kv_cache_request.h"
#include "testing/oracle_bytes.h"
#include "testing/oracle_stepper.h"
#include "testing/reference_engine_rows.h"

namespace mkv::testing {
namespace {

uint64_t mix(uint64_t x) noexcept { return oracle::seedMix(x); }

constexpr char const* kRunCall = "ReferenceEngine::run";

}  // namespace

ReferenceEngine::ReferenceEngine(KVCacheRuntime& runtime, ReferenceEngineOptions options)
    : mRuntime(runtime),
      mOptions(std::move(options)),
      mHasFull(runtime.fullPool() != nullptr),
      mHasSwa(runtime.swaPool() != nullptr),
      mSpecWidth(mOptions.speculativeWidth),
      mPreemptionKind(mOptions.preemption == PreemptionMode::kSwap ? PreemptionKind::kSwap
                                                                   : PreemptionKind::kRecompute),
      mPagesPerChunk(runtime.contextCache() != nullptr &&
                     runtime.config().contextCache.joinerPages == JoinerPageAllocation::kPerChunk),
      mRandom(mix(mOptions.seed + 0x51ED)) {
  // Only checkpoint deployments promise a zeroed or restored row at the start of a sequence.
  ContextCacheCoordinator const* coordinator = runtime.contextCache();
  mRecurrent = runtime.recurrentState() != nullptr && coordinator != nullptr &&
               coordinator->profile().usesCheckpointReuse();
  MKV_REQUIRE(mSpecWidth >= 0 && mSpecWidth <= kMaxSpeculativeWidth, "ReferenceEngine",
              "speculativeWidth {} outside [0, {}]", mSpecWidth, kMaxSpeculativeWidth);
  MKV_REQUIRE(mSpecWidth == 0 || runtime.config().speculative.has_value(), "ReferenceEngine",
              "speculativeWidth {} needs a runtime built with KVCacheRuntimeConfig::speculative",
              mSpecWidth);
  MKV_REQUIRE(mOptions.preemption != PreemptionMode::kSwap || runtime.hostTier() != nullptr,
              "ReferenceEngine",
              "swap preemption needs a runtime with a host tier (KVCacheRuntimeConfig::"
              "hostPoolTokens)");
  // On a model with recurrent layers a speculative runtime is a Hybrid-MTP deployment (the
  // runtime builds no other), with the boundary hidden row the engine keeps.
  mHybridMtp = mSpecWidth > 0 && coordinator != nullptr && coordinator->profile().isHybridMtp();
  if (mHybridMtp) {
    KVCacheSpeculativeConfig const& draft = *runtime.config().speculative;
    mHidden = Tensor({runtime.config().maxBatchSize, draft.boundaryHiddenWidth},
                     draft.boundaryHiddenType, runtime.config().deviceType);
  }
  mSteps =
      std::make_unique<oracle::OracleStepper>(runtime, mRecurrent, mHybridMtp ? &mHidden : nullptr);
  mMarks = std::make_unique<oracle::StreamMarks>(runtime.config().deviceType);
  mLengthValues.resize(static_cast<std::size_t>(runtime.config().maxBatchSize));
  mDraftLengthValues.resize(static_cast<std::size_t>(runtime.config().maxBatchSize));
  mCommonLengths.reserve(static_cast<std::size_t>(runtime.config().maxBatchSize));
  mDeviceMapping =
      Tensor({runtime.config().maxBatchSize}, DataType::kInt32, runtime.config().deviceType);
}

ReferenceEngine::~ReferenceEngine() = default;

int32_t ReferenceEngine::sampleToken(uint64_t prefixDigest) const {
  uint64_t const h = mix(prefixDigest ^ mix(mOptions.seed));
  if (mOptions.eosEvery > 0 && (h >> 40) % static_cast<uint64_t>(mOptions.eosEvery) == 0) {
    return kEndOfSequence;
  }
  return 1000 + static_cast<int32_t>(h % 30000);
}

uint64_t ReferenceEngine::identitySeed(EngineRequest const& request) const {
  return testing::identitySeed(request.loraWeightsName, request.cacheSalt);
}

std::vector<uint64_t> ReferenceEngine::positionKeys(
    EngineSequence const& sequence, std::vector<int32_t> const& mediaTokenIds) const {
  std::vector<uint64_t> keys(sequence.prompt.size());
  std::vector<MediaPosition> media;
  bool readable = true;
  for (auto const& image : sequence.images) {
    readable = readable && image.data() != nullptr;
  }
  if (!mediaTokenIds.empty() && readable) {
    media = buildMediaPositions(sequence.prompt, mediaTokenIds, sequence.images, sequence.audios);
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    keys[i] = static_cast<uint32_t>(sequence.prompt[i]);
    if (!media.empty() && !media[i].content.isZero()) {
      keys[i] =
          mix(keys[i] ^ mix(media[i].content.hi ^
                            mix(media[i].content.lo + static_cast<uint64_t>(media[i].offset))));
    }
  }
  return keys;
}

void ReferenceEngine::report(std::string const& what) {
  if (mStats.firstMismatch.empty()) {
    mStats.firstMismatch = what;
  }
  if (mOptions.throwOnMismatch) {
    detail::throwError(fmt::format("ReferenceEngine: oracle mismatch: {}", what));
  }
}

int64_t ReferenceEngine::pagesInUse() const {
  auto& runtime = const_cast<KVCacheRuntime&>(mRuntime);
  if (ContextCacheCoordinator* coordinator = runtime.contextCache()) {
    ResourcePools const& pools = coordinator->manager().pools();
    return pools.capacity(ResourceType::kBaseKvPage) - pools.freeCount(ResourceType::kBaseKvPage);
  }
  BoundedSwaKVPageManager* swa = runtime.swaPageManager();
  return swa->totalPageCount() - swa->freePageCount();
}

void ReferenceEngine::notePages() {
  mStats.peakPagesInUse = std::max(mStats.peakPagesInUse, pagesInUse());
  if (WindowBlockCache const* window = const_cast<KVCacheRuntime&>(mRuntime).windowBlockCache()) {
    mStats.peakSwaPagesInUse =
        std::max<int64_t>(mStats.peakSwaPagesInUse, window->totalPages() - window->freePages());
  }
  if (mRuntime.draftPool() != nullptr) {
    ResourcePools const& pools = mRuntime.contextCache()->manager().pools();
    mStats.peakDraftPagesInUse = std::max<int64_t>(
        mStats.peakDraftPagesInUse,
        pools.capacity(ResourceType::kDraftKvPage) - pools.freeCount(ResourceType::kDraftKvPage));
  }
}

void ReferenceEngine::noteDecodePages(Run const& run) {
  notePages();
  int64_t prefilling = 0;
  if (mRuntime.backend() == KVCacheBackend::kBoundedSwa) {
    for (Row const& row : run.rows) {
      prefilling += row.prefilling ? 1 : 0;
    }
  }
  mStats.peakSwaPagesPerDecodingRow =
      std::max(mStats.peakSwaPagesPerDecodingRow, swaPagesPerRow(prefilling));
}

int64_t ReferenceEngine::swaPagesPerRow(int64_t prefillingJoiners) const {
  auto& runtime = const_cast<KVCacheRuntime&>(mRuntime);
  BoundedSwaKVPageManager const* swa = runtime.swaPageManager();
  int64_t const rows =
      swa != nullptr ? runtime.swaPool()->activeBatchSize() - prefillingJoiners : 0;
  if (rows <= 0) {
    return 0;
  }
  // Pages the running windows hold (with a page source, free counts its evictable pages too).
  int64_t const held = swa->totalPageCount() - swa->freePageCount() -
                       prefillingJoiners * swa->privatePagesPerSequence();
  return (held + rows - 1) / rows;
}

void ReferenceEngine::verifyRange(int32_t pool, int32_t slot, int32_t begin, int32_t stop,
                                  bool full) {
  auto check = [&](int32_t from, int32_t to) {
    mSteps->verify(pool, slot, from, to, oracle::kOracleAttention);
  };
  if (full || mOptions.verify == VerifyMode::kAll) {
    check(begin, stop);
    return;
  }
  if (begin >= stop) {
    return;
  }
  check(stop - 1, stop);  // the position just written
  for (int i = 0; i < 2; ++i) {
    mRandom = mix(mRandom + 0x9E37);
    auto const p = begin + static_cast<int32_t>(mRandom % static_cast<uint64_t>(stop - begin));
    check(p, p + 1);
  }
}

void ReferenceEngine::verifyRow(Run& run, Row& row, bool full) {
  (void)run;
  if (mOptions.verify == VerifyMode::kNone) {
    return;
  }
  int32_t const end = row.materialized;
  int32_t const window = mRuntime.config().model.slidingWindowTokens;
  if (mHasFull) {
    verifyRange(oracle::OracleStepper::kFull, row.resident.slot, 0, end, full);
  }
  if (mHasSwa) {  // bounded SWA or sliding-window reuse: the sliding layers read their window
    verifyRange(oracle::OracleStepper::kSwa, row.resident.slot, std::max(0, end - window), end,
                full);
  }
}

void ReferenceEngine::flushWrites(Run& run) {
  auto const start = std::chrono::steady_clock::now();
  mRuntime.flushDeviceWrites();
  run.libraryNanos += nanosSince(start);
}

void ReferenceEngine::checkLengths(Run& run) {
  if (mOptions.verify == VerifyMode::kNone) {
    return;
  }
  flushWrites(run);
  auto const rows = static_cast<int32_t>(run.rows.size());
  mSteps->snapshotLengths(rows, rows, pairsDraft() ? rows : 0, mRuntime.config().stream);
}

void ReferenceEngine::finishStep(Run& run) {
  oracle::StepFindings const& found =
      mSteps->complete(mRuntime.config().stream, "ReferenceEngine::run");
  mStats.oracleChecks += found.positionsChecked;
  mStats.recurrentChecks += found.recurrentChecks;
  if (found.recurrentMismatches > 0) {
    mStats.oracleMismatches += found.recurrentMismatches;
    mStats.recurrentMismatches += found.recurrentMismatches;
    report("recurrent state: " + found.recurrentFirst);
  }
  mStats.hiddenChecks += found.hiddenChecks;
  if (found.hiddenMismatches > 0) {
    mStats.oracleMismatches += found.hiddenMismatches;
    mStats.hiddenMismatches += found.hiddenMismatches;
    report("boundary hidden " + found.hiddenFirst);
  }
  mStats.draftOracleChecks += found.draftChecked;
  mStats.draftOracleMismatches += found.draftMismatches;
  if (found.kvMismatches > 0) {
    mStats.oracleMismatches += found.kvMismatches;
    report(found.kvFirst);
  }
  KVCachePool const* pools[oracle::kOraclePools] = {mRuntime.fullPool(), mRuntime.swaPool(),
                                                    mRuntime.draftPool()};
  for (int32_t p = 0; p < oracle::kOraclePools; ++p) {
    if (pools[p] == nullptr || found.lengths[p] == nullptr) {
      continue;
    }
    auto const rows = run.rows.size();
    if (static_cast<std::size_t>(pools[p]->activeBatchSize()) != rows) {
      report(fmt::format("KV-length tensor has {} active rows, expected {}",
                         pools[p]->activeBatchSize(), rows));
      continue;
    }
    std::vector<int32_t> const& lengths = *found.lengths[p];
    bool const draft = p == oracle::OracleStepper::kDraft;
    for (std::size_t i = 0; i < rows; ++i) {
      ++mStats.lengthChecks;
      int32_t const expected = draft ? run.rows[i].draftMaterialized : run.rows[i].materialized;
      if (lengths[i] != expected) {
        report(fmt::format("{}KV length of row {} (slot {}) is {}, expected {}",
                           draft ? "draft " : "", i, run.rows[i].resident.slot, lengths[i],
                           expected));
      }
    }
  }
}

void ReferenceEngine::lengthStep(Run& run) {
  if (mOptions.verify == VerifyMode::kNone) {
    return;
  }
  mSteps->begin();
  checkLengths(run);
  finishStep(run);
}

void ReferenceEngine::executeRecurrent(Row& row, int32_t from, int32_t to) {
  if (!mRecurrent) {
    return;
  }
  MKV_REQUIRE(from >= 0 && from <= to && to <= row.digests.size(), "ReferenceEngine::run",
              "recurrent execution [{}, {}) outside the {} known positions", from, to,
              row.digests.size());
  mSteps->recurrent(row.resident.slot, mOptions.verify != VerifyMode::kNone, from,
                    from > 0 ? row.digests.at(from - 1) : 0, to,
                    to > 0 ? row.digests.at(to - 1) : 0);
}

void ReferenceEngine::captureReusePoints(Run const& run, ExecutionRow index, int32_t from,
                                         int32_t to) {
  if (!mRecurrent) {
    return;
  }
  Row const& row = run.rows[static_cast<std::size_t>(index)];
  for (ReusePointCapture const& point : run.managed->reusePointCaptures(index)) {
    if (point.position <= from || point.position > to) {
      continue;
    }
    mSteps->reusePoint(point.snapshotSlot, point.position, row.digests.at(point.position - 1));
    ++mStats.reusePointsWritten;
  }
}

void ReferenceEngine::executePrefill(Run& run, std::size_t index, int32_t start) {
  Row& row = run.rows[index];
  startPrefill(run, row, start);
  executePrefillChunk(row, static_cast<int32_t>(row.spec.prompt.size()));
  finishPrefill(run, index);
}

void ReferenceEngine::startPrefill(Run& run, Row& row, int32_t start) {
  row.digests =
      PrefixDigests(row.spec.identity ? testing::identitySeed(row.spec.identity->loraWeightsName,
                                                              row.spec.identity->cacheSalt)
                                      : run.seed);
  row.digests.extend(row.promptKeys);
  row.prefillStart = start;
  row.materialized = start;
  if (mHybridMtp) {  // the draft resumes one row short (its boundary row is recomputed)
    row.draftMaterialized = std::max(0, start - 1);
  }
}

void ReferenceEngine::executePrefillChunk(Row& row, int32_t end) {
  int32_t const from = row.materialized;
  bool const bounded = mRuntime.backend() == KVCacheBackend::kBoundedSwa;
  int32_t const window = mRuntime.config().model.slidingWindowTokens;
  int32_t const slot = row.resident.slot;
  bool const verify = mOptions.verify != VerifyMode::kNone;
  // The first chunk stages the reused prefix too: its checks read those digests. A later chunk
  // on bounded SWA stages the window before it, which it reads from the rotated pages.
  bool const first = from == row.prefillStart;
  bool const readsWindow = !first && bounded && mHasSwa && verify;
  int32_t const stagedFrom = first ? 0 : readsWindow ? std::max(0, from - window) : from;
  auto const stagedSpan = row.digests.values().subspan(static_cast<std::size_t>(stagedFrom),
                                                       static_cast<std::size_t>(end - stagedFrom));
  int64_t const positionZero = mSteps->stage(slot, stagedFrom, stagedSpan) - stagedFrom;
  // What the cache claims is already there must be exactly this prefix's KV.
  if (first && from > 0 && verify && mHasFull) {
    mSteps->verify(oracle::OracleStepper::kFull, slot, 0, from, oracle::kOracleReusedPrefix);
  }
  // Sliding-window reuse: the reused window before the start must be this prefix's too.
  if (first && from > 0 && verify && mHasSwa) {
    mSteps->verify(oracle::OracleStepper::kSwa, slot, std::max(0, from - window), from,
                   oracle::kOracleReusedPrefix);
  }
  if (readsWindow) {
    verifyRange(oracle::OracleStepper::kSwa, slot, std::max(0, from - window), from, false);
  }
  if (mHasFull) {  // bounded SWA's identity-mapped full layers as well: a joiner starts at 0
    mSteps->write(oracle::OracleStepper::kFull, slot, from, end, positionZero + from);
  }
  if (mHasSwa) {
    // Bounded SWA keeps only the chunk's last window (its earlier positions are read from the
    // engine's activations); sliding-window reuse writes every executed position (its complete
    // prompt blocks are published for later hits).
    int32_t const begin = bounded ? std::max(from, end - window) : from;
    mSteps->write(oracle::OracleStepper::kSwa, slot, begin, end, positionZero + begin);
  }
  executeRecurrent(row, from, end);
  row.materialized = end;
}

void ReferenceEngine::finishPrefill(Run& run, std::size_t index) {
  Row& row = run.rows[index];
  auto const promptLength = static_cast<int32_t>(row.spec.prompt.size());
  int32_t const start = row.prefillStart;
  if (mHybridMtp) {
    // The restored boundary hidden row (prefill from a hit) is the R-token prefix's; the
    // endpoint publishes the whole prompt's.
    mSteps->hidden(row.resident.slot, start > 0 && mOptions.verify != VerifyMode::kNone, start,
                   start > 0 ? row.digests.at(start - 1) : 0, promptLength,
                   row.digests.at(promptLength - 1));
  }
  if (firstPrefill(row.spec)) {
    mStats.promptTokens += promptLength;
    mStats.reusedTokens += start;
    mStats.prefillTokensComputed += promptLength - start;
  } else {  // a resumption after a preemption
    mStats.resumedPromptTokens += promptLength;
    mStats.resumedReusedTokens += start;
    mStats.resumedGeneratedTokens += row.spec.resume->generatedTokens;
  }
  verifyRow(run, row, /*full=*/false);
  if (pairsDraft()) {
    executeDraftPrefill(row, start);
  } else {
    row.draftMaterialized = promptLength;  // no draft KV: the draft reads the base's
  }
}

RequestOutcome ReferenceEngine::run(EngineRequest const& request,
                                    std::deque<EngineSequence>* joinQueue) {
  MKV_REQUIRE(!request.sequences.empty(), kRunCall, "a request needs at least one sequence");
  Run run;
  run.request = &request;
  run.joinQueue = joinQueue;
  run.seed = identitySeed(request);
  ++mStats.requests;
  acquireResidents(run);
  buildContext(run);
  if (!beginRequest(run)) {
    return run.outcome;
  }
  bool const ok = prefill(run) && decodeLoop(run);
  return finishRun(run, ok);
}

void ReferenceEngine::acquireResidents(Run& run) {
  EngineRequest const& request = *run.request;
  for (auto const& sequence : request.sequences) {
    MKV_REQUIRE(!sequence.prompt.empty(), kRunCall, "empty prompt");
    std::optional<ResidentRef> resident = mRuntime.residentSlots().acquire();
    if (!resident) {
      releaseAll(run);
      detail::throwContract(kRunCall, "batch of {} exceeds the runtime's {} resident slots",
                            request.sequences.size(), mRuntime.residentSlots().capacity());
    }
    Row row;
    row.spec = sequence;
    row.resident = *resident;
    row.promptKeys = positionKeys(sequence, request.mediaTokenIds);
    row.outcome = run.outcome.sequences.size();
    run.outcome.sequences.push_back(outcomeOf(sequence, 0, false, 0));
    resumeRow(row);
    run.rows.push_back(std::move(row));
  }
}

void ReferenceEngine::releaseAll(Run& run) {
  for (auto const& row : run.rows) {
    mRuntime.residentSlots().release(row.resident);
  }
  run.rows.clear();
}

void ReferenceEngine::buildContext(Run& run) {
  EngineRequest const& request = *run.request;
  run.generation.contextCacheLookupPolicy = request.lookupPolicy;
  run.generation.contextCacheCommitPolicy = request.commitPolicy;
  run.generation.loraWeightsName = request.loraWeightsName;
  run.generation.cacheSalt = request.cacheSalt;
  DecodingInferenceContext& context = run.context;
  context.stream = mRuntime.config().stream;
  context.loraWeightsName = request.loraWeightsName;
  for (auto const& row : run.rows) {
    LLMGenerationRequest::Sequence sequence;
    sequence.imageBuffers = row.spec.images;
    sequence.audioBuffers = row.spec.audios;
    sequence.contextCacheLookupPolicy = row.spec.lookupPolicy;
    run.generation.requests.push_back(std::move(sequence));
    context.rawBatchedInputIds.push_back(row.spec.prompt);
    context.residentRefs.push_back(row.resident);
    context.finishReasons.push_back(FinishReason::kNotFinished);
    context.generatedTokenIds.emplace_back();
  }
  context.activeBatchSize = static_cast<int32_t>(run.rows.size());
}

bool ReferenceEngine::beginRequest(Run& run) {
  EngineRequest const& request = *run.request;
  run.speculative = mSpecWidth > 0;
  run.headroom = run.speculative ? DecodingKvHeadroom{mSpecWidth + 1, pairsDraft() ? mSpecWidth : 0}
                                 : DecodingKvHeadroom{1, 0};
  bool const resumptions = std::all_of(run.rows.begin(), run.rows.end(),
                                       [](Row const& row) { return row.spec.resume.has_value(); });
  int64_t const hostHits = resumptions ? hostTierHitTokens() : 0;
  auto const beginStart = std::chrono::steady_clock::now();
  std::optional<ManagedKVCacheRequest> begun = ManagedKVCacheRequest::begin(
      mRuntime.contextCache(), mRuntime.swaPageManager(), run.generation, run.context,
      run.speculative, run.headroom, DecodingTokenStateContract::kCommittedPlusLookahead,
      request.commitPolicy, request.mediaTokenIds);
  run.libraryNanos = nanosSince(beginStart);
  if (!begun) {
    releaseAll(run);
    run.outcome.admitted = false;
    return false;
  }
  run.managed.emplace(std::move(*begun));
  run.outcome.admitted = true;
  mStats.resumedHostTierTokens += resumptions ? hostTierHitTokens() - hostHits : 0;
  for (Row const& row : run.rows) {
    // A resumed sequence was counted at its first admission.
    ++(row.spec.resume ? mStats.resumed : mStats.sequences);
  }
  notePages();
  return true;
}

int64_t ReferenceEngine::hostTierHitTokens() const {
  ContextCacheCoordinator const* coordinator = mRuntime.contextCache();
  return coordinator != nullptr ? static_cast<int64_t>(coordinator->metrics().hostTierHitTokens)
                                : 0;
}

bool ReferenceEngine::prefill(Run& run) {
  ManagedKVCacheRequest& managed = *run.managed;
  DecodingInferenceContext& context = run.context;
  std::vector<int32_t> const* starts = managed.prefillStarts();
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    int32_t const start = starts != nullptr ? (*starts)[i] : 0;
    context.effectivePrefillLengths.push_back(static_cast<int32_t>(run.rows[i].spec.prompt.size()) -
                                              start);
    run.rows[i].prefillStart = start;
    if (firstPrefill(run.rows[i].spec)) {
      run.outcome.sequences[run.rows[i].outcome].prefillStart = start;
    }
  }
  auto t0 = std::chrono::steady_clock::now();
  bool ok = managed.preparePrefill() && managed.prepareSwaPrefill(context.effectivePrefillLengths);
  run.libraryNanos += nanosSince(t0);
  mStats.peakSwaPagesPerPrefillRow =
      std::max(mStats.peakSwaPagesPerPrefillRow, ok ? swaPagesPerRow() : 0);
  for (std::size_t i = 0; ok && i < run.rows.size(); ++i) {
    ok = restoreBoundaryHidden(run, i);
  }
  if (ok) {
    ok = prefillStep(run);
  }
  notePages();
  return ok;
}

bool ReferenceEngine::restoreBoundaryHidden(Run& run, std::size_t index) {
  Row const& row = run.rows[index];
  if (!mHybridMtp || row.prefillStart == 0) {
    return true;
  }
  // The hit's boundary hidden row into the row's own (its resident slot's: compaction does not
  // move it), stream-ordered before the check of it in the step that finishes the prefill (and
  // before the endpoint, which releases the hit's pins).
  auto const start = std::chrono::steady_clock::now();
  bool const ok = run.managed->restoreHybridMtpBoundaryHidden(static_cast<ExecutionRow>(index),
                                                              mHidden, row.resident.slot);
  run.libraryNanos += nanosSince(start);
  ++mStats.hiddenRestores;
  return ok;
}

bool ReferenceEngine::publishEndpoint(Run& run, std::size_t index) {
  if (!mHybridMtp) {
    return true;
  }
  // The whole prompt's endpoint with its boundary hidden row (written by the step that finished
  // the prefill): the base and draft rows it captures are in the submitted plan, stream-ordered
  // before it.
  Row const& row = run.rows[index];
  auto const start = std::chrono::steady_clock::now();
  bool const ok = run.managed->publishHybridMtpEndpoint(
      static_cast<ExecutionRow>(index), static_cast<int32_t>(row.spec.prompt.size()), mHidden,
      row.resident.slot);
  run.libraryNanos += nanosSince(start);
  ++mStats.hiddenEndpoints;
  return ok;
}

bool ReferenceEngine::chunksFounders() const {
  // Requests that take joiners (a held founder goes on as one), on every backend.
  return mOptions.maxBatchedTokens > 0 && mRuntime.supportsSeatedAdmission();
}

bool ReferenceEngine::prefillStep(Run& run) {
  ManagedKVCacheRequest& managed = *run.managed;
  // Under a token budget the founders take it in order, as joiners' chunks do; a founder it
  // does not cover goes on in chunks (its first chunk may be empty) as a joiner would. Each
  // shorter first chunk is prepared before the step (bounded SWA stages its window).
  int32_t budget =
      chunksFounders() ? mOptions.maxBatchedTokens : std::numeric_limits<int32_t>::max();
  std::vector<int32_t> ends(run.rows.size());
  auto t0 = std::chrono::steady_clock::now();
  bool ok = true;
  for (std::size_t i = 0; i < run.rows.size() && ok; ++i) {
    Row const& row = run.rows[i];
    auto const promptLength = static_cast<int32_t>(row.spec.prompt.size());
    ends[i] = row.prefillStart + std::min(promptLength - row.prefillStart, budget);
    budget -= ends[i] - row.prefillStart;
    if (ends[i] > row.prefillStart && ends[i] < promptLength) {
      ok = managed.preparePrefillChunk(static_cast<ExecutionRow>(i), ends[i]);
    }
  }
  run.libraryNanos += nanosSince(t0);
  if (!ok) {
    return false;
  }
  mSteps->begin();
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    Row& row = run.rows[i];
    auto const promptLength = static_cast<int32_t>(row.spec.prompt.size());
    int32_t const end = ends[i];
    startPrefill(run, row, row.prefillStart);
    executePrefillChunk(row, end);
    captureReusePoints(run, static_cast<ExecutionRow>(i), row.prefillStart, end);
    if (end == promptLength) {
      finishPrefill(run, i);
    } else {
      verifyRow(run, row, /*full=*/false);
      row.prefilling = true;
      row.chunks = 1;
      ++mStats.heldFounders;
      row.seatedAtStep = mStats.decodeSteps;
      ++mStats.prefillChunks;
    }
  }
  flushWrites(run);
  mSteps->submit(mRuntime.config().stream);
  writeLengths(run, 0, run.rows.size(), [](std::size_t) { return true; });
  t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < run.rows.size() && ok; ++i) {
    if (run.rows[i].prefilling) {  // publishes the founder's first chunk
      ok = managed.completePrefillChunk(static_cast<ExecutionRow>(i), run.rows[i].materialized);
    }
  }
  ok = ok && managed.enqueuePrefillCaptures();
  for (std::size_t i = 0; ok && i < run.rows.size(); ++i) {
    if (!run.rows[i].prefilling) {  // a held founder publishes after its last chunk
      ok = publishEndpoint(run, i);
    }
  }
  run.libraryNanos += nanosSince(t0);
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    if (!run.rows[i].prefilling) {  // a held founder samples after its last chunk
      sampleAfter(run, run.rows[i], i);
    }
  }
  // Speculative rows: base and draft both hold the prompt (the draft initialisation ran).
  commonLengths(run, run.speculative);
  t0 = std::chrono::steady_clock::now();
  ok = ok && managed.completePrefill(run.context, mCommonLengths);
  run.libraryNanos += nanosSince(t0);
  checkLengths(run);
  finishStep(run);
  return ok;
}

void ReferenceEngine::appendToken(Run& run, Row& row, std::size_t index, int32_t token,
                                  int64_t step) {
  DecodingInferenceContext& context = run.context;
  if (row.sampled) {
    mStats.timeBetweenTokensSteps.push_back(static_cast<int32_t>(step - row.lastTokenStep));
  }
  row.sampled = true;
  row.lastTokenStep = step;
  context.generatedTokenIds[index].push_back(token);
  run.outcome.sequences[row.outcome].generated.push_back(token);
  ++mStats.generatedTokens;
  auto const generated = static_cast<int32_t>(context.generatedTokenIds[index].size());
  if (token == kEndOfSequence) {
    row.reason = FinishReason::kEndOfSequence;
  } else if (generated >= row.spec.maxNewTokens) {
    row.reason = FinishReason::kLength;
  }
  context.finishReasons[index] = row.reason;
}

void ReferenceEngine::sampleAfter(Run& run, Row& row, std::size_t index) {
  appendToken(run, row, index, sampleToken(row.digests.at(row.materialized - 1)),
              mStats.decodeSteps);
}

RequestOutcome ReferenceEngine::finishRun(Run& run, bool ok) {
  run.outcome.failed = !ok;
  for (auto const& row : run.rows) {
    run.outcome.sequences[row.outcome].decodeSteps = row.steps;
    run.outcome.sequences[row.outcome].reason =
        row.reason == FinishReason::kNotFinished ? FinishReason::kError : row.reason;
  }
  run.outcome.preempted.assign(std::make_move_iterator(run.preempted.begin()),
                               std::make_move_iterator(run.preempted.end()));
  bool const finished = run.managed->finish();
  run.outcome.failed = run.outcome.failed || !finished;
  run.managed.reset();
  releaseAll(run);
  return run.outcome;
}

}  // namespace mkv::testing
