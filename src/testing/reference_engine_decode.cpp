/// \file reference_engine_decode.cpp
/// The reference engine's decode loop (ReferenceEngine::run's last phase before finishRun): steps,
/// compaction of finished rows and in-flight joins.

#include <algorithm>
#include <chrono>
#include <optional>
#include <span>
#include <string_view>

#include "core/check.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/reference_engine.h"
#include "testing/oracle_stepper.h"
#include "testing/reference_engine_rows.h"

namespace mkv::testing {
namespace {

/// The request of a joiner with its own identity: its adapter, salt, media and lookup override,
/// under the running request's lookup and commit policies.
LLMGenerationRequest joinerRequest(EngineRequest const& request, EngineSequence const& spec) {
  LLMGenerationRequest joiner;
  joiner.requests.push_back({spec.images, spec.audios, spec.lookupPolicy});
  joiner.contextCacheLookupPolicy = request.lookupPolicy;
  joiner.contextCacheCommitPolicy = request.commitPolicy;
  joiner.loraWeightsName = spec.identity->loraWeightsName;
  joiner.cacheSalt = spec.identity->cacheSalt;
  return joiner;
}

}  // namespace

bool ReferenceEngine::decodeLoop(Run& run) {
  bool ok = true;
  while (ok) {
    ok = compactFinished(run);
    if (!ok || run.rows.empty()) {
      break;
    }
    // A joiner can finish on its lookahead token: compact it away before the next step (a row
    // that finished without a new token may only be cancelled or errored).
    ok = tryJoins(run) && compactFinished(run);
    if (!ok || run.rows.empty()) {
      break;
    }
    if (!cancelDue(run)) {
      continue;  // compact the cancelled rows away
    }
    ok = preemptForGrowth(run) && decodeStep(run);
  }
  return ok;
}

bool ReferenceEngine::compactFinished(Run& run) {
  std::vector<int32_t> mapping(run.rows.size(), -1);
  int32_t survivors = 0;
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    if (run.rows[i].reason == FinishReason::kNotFinished && !run.rows[i].preempted) {
      mapping[i] = survivors++;
    }
  }
  if (survivors == static_cast<int32_t>(run.rows.size())) {
    return true;
  }
  auto const start = std::chrono::steady_clock::now();
  bool const compacted = run.managed->beginBatchCompaction(mapping, survivors, mDeviceMapping) &&
                         run.managed->completeBatchCompaction(mapping);
  run.libraryNanos += nanosSince(start);
  if (!compacted) {
    return false;
  }
  DecodingInferenceContext& context = run.context;
  std::vector<Row> kept;
  DecodingInferenceContext next;
  next.stream = context.stream;
  next.loraWeightsName = context.loraWeightsName;
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    if (mapping[i] < 0) {
      SequenceOutcome& outcome = run.outcome.sequences[run.rows[i].outcome];
      outcome.reason = run.rows[i].reason;
      outcome.decodeSteps = run.rows[i].steps;
      if (run.rows[i].preempted) {  // waits first in line (preempted after any older one)
        outcome.preempted = true;
        run.preempted.push_front(resumeOf(run, i));
      }
      mRuntime.residentSlots().release(run.rows[i].resident);
      continue;
    }
    next.rawBatchedInputIds.push_back(std::move(context.rawBatchedInputIds[i]));
    next.effectivePrefillLengths.push_back(context.effectivePrefillLengths[i]);
    next.generatedTokenIds.push_back(std::move(context.generatedTokenIds[i]));
    next.residentRefs.push_back(context.residentRefs[i]);
    next.finishReasons.push_back(context.finishReasons[i]);
    kept.push_back(std::move(run.rows[i]));
  }
  next.activeBatchSize = static_cast<int32_t>(kept.size());
  context = std::move(next);
  run.rows = std::move(kept);
  lengthStep(run);
  return true;
}

bool ReferenceEngine::tryJoins(Run& run) {
  std::deque<EngineSequence>* joinQueue = run.joinQueue;
  if (joinQueue == nullptr || !mRuntime.supportsSeatedAdmission()) {
    return true;
  }
  EngineRequest const& request = *run.request;
  // Under a token budget, vLLM's scheduler serves the running rows first (a token per decode,
  // then the ongoing prefills' chunks) and takes a waiting sequence only while the step's budget
  // has tokens left for it: a joiner seated without any would hold its whole prompt's pages
  // through steps that give it none.
  auto const budgetLeft = [&] {
    int64_t left = mOptions.maxBatchedTokens;
    for (Row const& row : run.rows) {
      if (row.reason == FinishReason::kNotFinished) {
        left -=
            row.prefilling ? static_cast<int64_t>(row.spec.prompt.size()) - row.materialized : 1;
      }
    }
    return left;
  };
  while (run.rows.size() < static_cast<std::size_t>(mRuntime.config().maxBatchSize)) {
    // Preempted sequences first, then the join queue.
    std::deque<EngineSequence>& queue = run.preempted.empty() ? *joinQueue : run.preempted;
    if (queue.empty() || (mOptions.maxBatchedTokens > 0 && budgetLeft() <= 0)) {
      return true;
    }
    EngineSequence const& spec = queue.front();
    if (mPagesPerChunk) {
      planChunks(run);  // the step's chunks so far, whose pages come first
      if (!firstChunkFits(run, spec, mOptions.maxBatchedTokens > 0 ? budgetLeft() : 0)) {
        return true;
      }
    }
    std::optional<ResidentRef> resident = mRuntime.residentSlots().acquire();
    if (!resident) {
      return true;
    }
    int32_t prefillStart = 0;
    int64_t const hostHits = spec.resume ? hostTierHitTokens() : 0;
    auto const start = std::chrono::steady_clock::now();
    auto const status =
        spec.identity
            ? run.managed->admitSequence(joinerRequest(request, spec), spec.prompt, run.headroom,
                                         prefillStart, *resident, mRuntime.config().stream,
                                         request.mediaTokenIds)
            : run.managed->admitSequence(spec.prompt, request.loraWeightsName, run.headroom,
                                         prefillStart, *resident, mRuntime.config().stream,
                                         request.mediaTokenIds, spec.images, spec.audios);
    run.libraryNanos += nanosSince(start);
    mStats.resumedHostTierTokens += spec.resume ? hostTierHitTokens() - hostHits : 0;
    if (status != AdmitSequenceStatus::kAdmitted) {
      mRuntime.residentSlots().release(*resident);
      ++mStats.joinRefusals;
      return status == AdmitSequenceStatus::kNoCapacity;
    }
    if (mOptions.maxBatchedTokens == 0 && !prepareWholePrefill(run, spec, prefillStart)) {
      mRuntime.residentSlots().release(*resident);
      ++mStats.joinRefusals;
      return run.managed->lastFailure().reason == RowFailureReason::kNoCapacity;
    }
    if (!seatJoiner(run, queue, *resident, prefillStart)) {
      return false;
    }
  }
  return true;
}

bool ReferenceEngine::prepareWholePrefill(Run& run, EngineSequence const& spec,
                                          int32_t prefillStart) {
  // The whole prompt in the joining step: its pages (allocated now under
  // JoinerPageAllocation::kPerChunk; a joiner admitted with them only checks). When the pools
  // cannot give them the joiner is retracted and waits, as vLLM leaves a request it cannot
  // allocate for in its queue.
  auto const promptLength = static_cast<int32_t>(spec.prompt.size());
  if (prefillStart >= promptLength) {
    return true;
  }
  auto const start = std::chrono::steady_clock::now();
  bool ready =
      run.managed->preparePrefillChunk(static_cast<ExecutionRow>(run.rows.size()), promptLength);
  if (!ready && !run.managed->retractSequenceAdmission()) {
    run.libraryNanos += nanosSince(start);
    return false;  // lastFailure() says kPoisoned
  }
  run.libraryNanos += nanosSince(start);
  return ready;
}

bool ReferenceEngine::seatJoiner(Run& run, std::deque<EngineSequence>& queue, ResidentRef resident,
                                 int32_t prefillStart) {
  DecodingInferenceContext& context = run.context;
  EngineSequence const& spec = queue.front();
  if (spec.resume) {
    ++mStats.resumed;  // joined (and counted) at its first admission
  } else {
    ++mStats.joins;
    ++mStats.sequences;
  }
  Row row;
  row.spec = spec;
  row.resident = resident;
  row.promptKeys = positionKeys(spec, run.request->mediaTokenIds);
  row.outcome = run.outcome.sequences.size();
  run.outcome.sequences.push_back(outcomeOf(spec, prefillStart, true, run.outcome.decodeSteps));
  resumeRow(row);
  queue.pop_front();
  auto const index = run.rows.size();
  run.rows.push_back(std::move(row));
  context.rawBatchedInputIds.push_back(run.rows[index].spec.prompt);
  context.effectivePrefillLengths.push_back(
      static_cast<int32_t>(run.rows[index].spec.prompt.size()) - prefillStart);
  context.generatedTokenIds.emplace_back();
  context.residentRefs.push_back(resident);
  context.finishReasons.push_back(FinishReason::kNotFinished);
  context.activeBatchSize = static_cast<int32_t>(run.rows.size());
  // Seat the joiner: its KV-length row, its prefill, its lookahead token.
  for (KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool(), mRuntime.draftPool()}) {
    if (pool != nullptr) {
      pool->setActiveBatchSize(context.activeBatchSize);
    }
  }
  run.rows[index].prefillStart = prefillStart;
  if (!restoreBoundaryHidden(run, index)) {
    return false;
  }
  if (mOptions.maxBatchedTokens > 0) {
    // Chunked: the decode steps run its prefill under their token budget (stagePrefillChunks).
    Row& seated = run.rows[index];
    startPrefill(run, seated, prefillStart);
    seated.prefilling = true;
    seated.seatedAtStep = mStats.decodeSteps;
    writeLengths(run, index, index + 1, [](std::size_t) { return true; });  // its reuse length
    notePages();
    return true;
  }
  mSteps->begin();
  executePrefill(run, index, prefillStart);
  captureReusePoints(run, static_cast<ExecutionRow>(index), prefillStart,
                     run.rows[index].materialized);
  flushWrites(run);
  mSteps->submit(mRuntime.config().stream);
  writeLengths(run, index, index + 1, [](std::size_t) { return true; });
  // Hybrid-MTP: its endpoint reads the state its prefill computed, which the library learns
  // from the completed chunk (here the whole prompt).
  bool const published =
      !mHybridMtp || (run.managed->completePrefillChunk(
                          static_cast<ExecutionRow>(index),
                          static_cast<int32_t>(run.rows[index].spec.prompt.size())) &&
                      publishEndpoint(run, index));
  if (!published) {
    finishStep(run);
    return false;
  }
  sampleAfter(run, run.rows[index], index);
  int32_t const lookahead = context.generatedTokenIds[index].back();
  auto const finalizeStart = std::chrono::steady_clock::now();
  bool const finalized = run.managed->finalizeSequenceAdmission(
      static_cast<int32_t>(index), lookahead,
      static_cast<int32_t>(run.rows[index].spec.prompt.size()));
  run.libraryNanos += nanosSince(finalizeStart);
  if (!finalized) {
    finishStep(run);
    return false;
  }
  checkLengths(run);
  finishStep(run);
  notePages();
  return true;
}

bool ReferenceEngine::cancelDue(Run& run) {
  bool anyRunning = false;
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    Row& row = run.rows[i];
    if (row.reason == FinishReason::kNotFinished && row.spec.cancelAtStep >= 0 &&
        row.steps >= row.spec.cancelAtStep) {
      row.reason = FinishReason::kCancelled;
      run.context.finishReasons[i] = row.reason;
    }
    anyRunning = anyRunning || row.reason == FinishReason::kNotFinished;
  }
  return anyRunning;
}

bool ReferenceEngine::decodeStep(Run& run) {
  cudaStream_t const stream = mRuntime.config().stream;
  int64_t stepNanos = 0;
  mMarks->mark(0, stream);
  auto start = std::chrono::steady_clock::now();
  bool ok = prepareChunks(run) && run.managed->prepareDecodeStep(run.context, run.headroom);
  mRuntime.flushDeviceWrites();  // the step's rows and lengths (kEngineStep), before its launches
  stepNanos += nanosSince(start);
  mMarks->mark(1, stream);
  if (!ok) {
    for (Row& row : run.rows) {
      if (row.reason == FinishReason::kNotFinished) {
        row.reason = FinishReason::kError;
      }
    }
    return false;
  }
  noteDecodePages(run);
  std::size_t const batch = run.rows.size();
  auto running = [&](std::size_t i) { return run.rows[i].reason == FinishReason::kNotFinished; };
  mSteps->begin();
  for (std::size_t i = 0; i < batch; ++i) {
    if (running(i) && !run.rows[i].prefilling) {
      stageDecodeRow(run, i);
    }
  }
  stagePrefillChunks(run);
  mSteps->submit(stream);
  writeLengths(run, 0, batch, running);
  collectTokens(run, batch);
  commonLengths(run, run.speculative);
  mMarks->mark(2, stream);
  start = std::chrono::steady_clock::now();
  ok = run.managed->completeDecodeStep(run.context, mCommonLengths);
  stepNanos += nanosSince(start);
  mMarks->mark(3, stream);
  mStats.stepHostNanoseconds.push_back(stepNanos);
  run.libraryNanos += stepNanos;
  ++mStats.decodeSteps;
  ++run.outcome.decodeSteps;
  checkLengths(run);
  finishStep(run);
  if (mMarks->enabled()) {
    mStats.stepGpuNanoseconds.push_back(mMarks->elapsedNanos(0, 1) + mMarks->elapsedNanos(2, 3));
  }
  if (mOptions.onStep) {
    mOptions.onStep(mStats.decodeSteps);
  }
  return ok && completeChunks(run);
}

void ReferenceEngine::planChunks(Run& run) const {
  for (Row& row : run.rows) {
    row.chunkEnd = 0;
  }
  if (mOptions.maxBatchedTokens == 0) {
    return;
  }
  // vLLM's order: the decodes take one token each; the rest goes to prefill chunks in join
  // order, at least one token a step.
  int32_t decoding = 0;
  for (Row const& row : run.rows) {
    decoding += row.reason == FinishReason::kNotFinished && !row.prefilling ? 1 : 0;
  }
  int32_t budget = std::max(1, mOptions.maxBatchedTokens - decoding);
  for (Row& row : run.rows) {
    if (budget <= 0) {
      break;
    }
    if (!row.prefilling || row.reason != FinishReason::kNotFinished) {
      continue;
    }
    auto const promptLength = static_cast<int32_t>(row.spec.prompt.size());
    row.chunkEnd = std::min(promptLength, row.materialized + budget);
    budget -= row.chunkEnd - row.materialized;
  }
}

bool ReferenceEngine::prepareChunks(Run& run) {
  planChunks(run);  // again: a preemption since the last plan may have freed budget
  // Each chunk's pages are made ready before the step.
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    if (run.rows[i].chunkEnd > 0 &&
        !run.managed->preparePrefillChunk(static_cast<ExecutionRow>(i), run.rows[i].chunkEnd)) {
      return false;
    }
  }
  return true;
}

void ReferenceEngine::stagePrefillChunks(Run& run) {
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    Row& row = run.rows[i];
    if (row.chunkEnd == 0) {
      continue;
    }
    int32_t const from = row.materialized;
    int32_t const end = row.chunkEnd;
    executePrefillChunk(row, end);
    captureReusePoints(run, static_cast<ExecutionRow>(i), from, end);
    if (end == static_cast<int32_t>(row.spec.prompt.size())) {
      finishPrefill(run, i);
    } else {
      verifyRow(run, row, /*full=*/false);
    }
  }
}

bool ReferenceEngine::completeChunks(Run& run) {
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    Row& row = run.rows[i];
    if (row.chunkEnd == 0) {
      continue;
    }
    row.chunkEnd = 0;
    ++row.chunks;
    ++mStats.prefillChunks;
    auto const row32 = static_cast<ExecutionRow>(i);
    auto const promptLength = static_cast<int32_t>(row.spec.prompt.size());
    auto const start = std::chrono::steady_clock::now();
    bool ok = true;
    if (row.materialized < promptLength) {
      ok = run.managed->completePrefillChunk(row32, row.materialized);
    } else {
      if (mHybridMtp) {
        // Its endpoint reads the state its chunks computed: the last chunk completes first.
        ok = run.managed->completePrefillChunk(row32, promptLength) && publishEndpoint(run, i);
      }
      if (!ok) {
        run.libraryNanos += nanosSince(start);
        return false;
      }
      sampleAfter(run, row, i);
      ok = run.managed->finalizeSequenceAdmission(row32, run.context.generatedTokenIds[i].back(),
                                                  promptLength);
      row.prefilling = false;
      if (firstPrefill(row.spec)) {
        // A sequence preempted while it prefilled counts from its first admission.
        EngineResume const before = row.spec.resume.value_or(EngineResume{});
        int64_t const seated = row.spec.resume ? before.seatedAtStep : row.seatedAtStep;
        mStats.chunkedPrefills += row.chunks + before.prefillChunks > 1 ? 1 : 0;
        mStats.timeToFirstTokenSteps.push_back(static_cast<int32_t>(mStats.decodeSteps - seated));
      }
    }
    run.libraryNanos += nanosSince(start);
    if (!ok) {
      return false;
    }
  }
  return true;
}

void ReferenceEngine::stageDecodeRow(Run& run, std::size_t i) {
  Row& row = run.rows[i];
  if (run.speculative) {
    executeRound(row, run.context.generatedTokenIds[i]);
    verifyRow(run, row, /*full=*/false);
    return;
  }
  int32_t const position = row.materialized;
  uint64_t const key = static_cast<uint32_t>(run.context.generatedTokenIds[i].back());
  row.digests.extend(std::span<uint64_t const>(&key, 1));
  int64_t const staged =
      mSteps->stage(row.resident.slot, position,
                    row.digests.values().subspan(static_cast<std::size_t>(position), 1));
  if (mHasFull) {
    mSteps->write(oracle::OracleStepper::kFull, row.resident.slot, position, position + 1, staged);
  }
  if (mHasSwa) {
    mSteps->write(oracle::OracleStepper::kSwa, row.resident.slot, position, position + 1, staged);
  }
  executeRecurrent(row, position, position + 1);
  row.materialized = position + 1;
  verifyRow(run, row, /*full=*/false);
}

void ReferenceEngine::collectTokens(Run& run, std::size_t batch) {
  for (std::size_t i = 0; i < batch; ++i) {
    Row& row = run.rows[i];
    if (row.reason != FinishReason::kNotFinished || row.prefilling) {
      continue;  // a prefilling joiner samples after its last chunk (completeChunks)
    }
    ++row.steps;
    int64_t const step = mStats.decodeSteps + 1;  // the step in progress
    if (!run.speculative) {
      appendToken(run, row, i, sampleToken(row.digests.at(row.materialized - 1)), step);
      continue;
    }
    for (int32_t token : row.pendingTokens) {
      appendToken(run, row, i, token, step);
    }
  }
}

bool ReferenceEngine::growthFits(Run const& run) const {
  // What the step's prepareDecodeStep would allocate, against what each pool can give now: free
  // pages and cached ones no request runs on. A row past its table width fails the step
  // whatever the pools hold: preempting others would not help it.
  DecodeStepDemand const demand = stepDemand(run);
  KVCacheCapacity const capacity = mRuntime.capacity();
  auto fits = [](int32_t pages, std::optional<PagePoolUsage> const& pool) {
    return pages == 0 || (pool && pages <= int64_t{pool->freePages} + pool->reclaimablePages);
  };
  return fits(demand.basePages, capacity.base) && fits(demand.draftPages, capacity.draft) &&
         fits(demand.slidingPages, capacity.sliding);
}

DecodeStepDemand ReferenceEngine::stepDemand(Run const& run) const {
  DecodeStepDemand demand = run.managed->decodeStepDemand(run.headroom);
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    if (run.rows[i].chunkEnd > 0) {
      DecodeStepDemand const chunk =
          run.managed->prefillChunkDemand(static_cast<ExecutionRow>(i), run.rows[i].chunkEnd);
      demand.basePages += chunk.basePages;
      demand.draftPages += chunk.draftPages;
    }
  }
  return demand;
}

bool ReferenceEngine::firstChunkFits(Run const& run, EngineSequence const& spec,
                                     int64_t budget) const {
  EngineRequest const& request = *run.request;
  std::string_view const lora =
      spec.identity ? spec.identity->loraWeightsName : request.loraWeightsName;
  std::string_view const salt = spec.identity ? spec.identity->cacheSalt : request.cacheSalt;
  // The estimate is a vanilla text lookup (media keys aside): close enough for a schedule.
  AdmissionEstimate const estimate = mRuntime.estimateAdmission(
      spec.prompt, lora, salt, DecodingKvHeadroom{run.headroom.baseExtraTokens, 0});
  int64_t const page = mRuntime.config().tokensPerPage;
  auto const prompt = static_cast<int64_t>(spec.prompt.size());
  int64_t const end = budget > 0 ? std::min(prompt, estimate.reusableTokens + budget) : prompt;
  // Pages past those the lookup binds from the GPU cache (host-tier blocks onboard into new ones).
  int64_t const chunk =
      (end + page - 1) / page - (estimate.reusableTokens - estimate.hostTierTokens) / page;
  DecodeStepDemand const demand = stepDemand(run);
  KVCacheCapacity const capacity = mRuntime.capacity();
  auto fits = [chunk](int64_t step, int32_t pinned, std::optional<PagePoolUsage> const& pool) {
    return !pool || step + chunk + pinned <= int64_t{pool->freePages} + pool->reclaimablePages;
  };
  return fits(demand.basePages, estimate.pinnedReclaimable.baseKvPages, capacity.base) &&
         (!run.speculative ||
          fits(demand.draftPages, estimate.pinnedReclaimable.draftKvPages, capacity.draft));
}

bool ReferenceEngine::preemptForGrowth(Run& run) {
  if (mOptions.preemption == PreemptionMode::kNone || run.joinQueue == nullptr ||
      !mRuntime.supportsSeatedAdmission()) {
    return true;  // the preempted could not be admitted again
  }
  for (planChunks(run); !growthFits(run); planChunks(run)) {
    // vLLM's victim: the newest running sequence (rows are in admission order), while another
    // row runs; a step that still cannot grow fails as without preemption.
    std::size_t victim = run.rows.size();
    int32_t running = 0;
    for (std::size_t i = 0; i < run.rows.size(); ++i) {
      if (run.rows[i].reason == FinishReason::kNotFinished) {
        ++running;
        victim = i;
      }
    }
    if (running < 2) {
      return true;
    }
    if (!preemptRow(run, victim)) {
      return false;
    }
  }
  return true;
}

bool ReferenceEngine::preemptRow(Run& run, std::size_t index) {
  Row& row = run.rows[index];
  if (!row.prefilling) {
    // Publish the committed state; an unfinalised joiner published its chunks already.
    auto const start = std::chrono::steady_clock::now();
    bool const published =
        run.managed->preemptSequence(static_cast<ExecutionRow>(index), mPreemptionKind);
    run.libraryNanos += nanosSince(start);
    if (!published) {
      return false;
    }
  }
  row.preempted = true;
  ++mStats.preemptions;
  return compactFinished(run);  // drops the preempted row (and any cancelled one)
}

EngineSequence ReferenceEngine::resumeOf(Run const& run, std::size_t index) const {
  Row const& row = run.rows[index];
  SequenceOutcome const& outcome = run.outcome.sequences[row.outcome];
  EngineSequence next = row.spec;
  EngineResume resume = row.spec.resume.value_or(EngineResume{});
  if (!row.spec.resume) {
    resume.joinedInFlight = outcome.joinedInFlight;
    resume.seatedAtStep = row.seatedAtStep;
  }
  if (row.prefilling) {
    // Nothing sampled: it starts its prefill again, reusing the chunks it published.
    resume.prefillChunks += row.chunks;
  } else {
    std::vector<int32_t> const& generated = run.context.generatedTokenIds[index];
    if (resume.generatedTokens == 0) {
      resume.prefillStart = outcome.prefillStart;
    }
    next.prompt.insert(next.prompt.end(), generated.begin(), generated.end());
    next.maxNewTokens -= static_cast<int32_t>(generated.size());
    resume.generatedTokens += static_cast<int32_t>(generated.size());
    resume.decodeSteps = row.steps;
    resume.lastTokenStep = row.lastTokenStep;
  }
  next.resume = resume;
  return next;
}

}  // namespace mkv::testing
