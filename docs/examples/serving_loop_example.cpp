// A serving engine's loop wired to managedkv, in the style of vLLM's scheduler. Sequences wait in
// a queue and run in one request at a time: the first waiting sequence founds it, the others join
// it in flight, and it ends when its batch is empty. Each step spends a token budget
// (maxBatchedTokens): one token per decoding row first, then prefill chunks of the joiners in
// join order (the founder's prefill step spends it too); a waiting sequence is admitted only while
// the budget has tokens left and its pages fit beside the step's growth. Before each step the
// capacity query decides whether the decoding rows' growth fits the pool; if not, the newest row is
// preempted (vLLM's recompute) and waits first in line with its prompt and generated tokens, to be
// admitted again reusing what it published. The "model" is left out: the engine advances the token
// lists and the KV lengths and samples a token that is a function of the whole sequence. Host
// tensors keep it runnable anywhere; set deviceType = kGPU and pass the engine's stream on a GPU.
#include <mkv/kv_cache_pool.h>
#include <mkv/kv_cache_runtime.h>
#include <mkv/kv_page_table.h>
#include <mkv/managed_kv_cache_request.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace serving_example {

struct Sequence {
  std::vector<int32_t> prompt;
  int32_t maxNewTokens = 4;
};

// What happened to one sequence, across its preemptions.
struct Outcome {
  std::vector<int32_t> generated;   // every token it sampled
  int32_t reusedTokens = 0;         // prompt tokens reused at its first admission
  int32_t resumedReusedTokens = 0;  // tokens reused when it was admitted again after preemptions
  int32_t prefillChunks = 0;        // steps that ran a chunk of its prefill (0: in one step)
  int32_t preemptions = 0;
};

struct Stats {
  int32_t requests = 0;       // requests begun: one per stretch of a non-empty batch
  int32_t steps = 0;          // decode steps
  int32_t joins = 0;          // in-flight admissions (re-admissions included)
  int32_t prefillChunks = 0;  // chunks of prefills run over more than one step
  int32_t preemptions = 0;
};

// The "model": the next token is a function of the whole sequence so far.
inline int32_t nextToken(std::vector<int32_t> const& tokens) {
  uint32_t hash = 2166136261U;
  for (int32_t const token : tokens) {
    hash = (hash ^ static_cast<uint32_t>(token)) * 16777619U;
  }
  return 1000 + static_cast<int32_t>(hash % 1000);
}

class Engine {
 public:
  // A step computes at most maxBatchedTokens tokens; at least maxBatchSize, so that a joiner
  // gets a prefill token in every step.
  Engine(mkv::KVCacheRuntime& runtime, int32_t maxBatchedTokens)
      : mRuntime(runtime),
        mMaxBatchedTokens(maxBatchedTokens),
        mDeviceMapping({runtime.config().maxBatchSize}, mkv::DataType::kInt32,
                       runtime.config().deviceType) {
    if (!runtime.supportsSeatedAdmission() || maxBatchedTokens < runtime.config().maxBatchSize) {
      throw std::invalid_argument("needs in-flight admission and a budget >= maxBatchSize");
    }
  }

  // Serves every sequence to its maxNewTokens. Throws std::runtime_error when a lifecycle call
  // fails: the request is then ended and its residents returned (see integration_example.cpp for
  // residents a failed synchronisation quarantined).
  std::vector<Outcome> serve(std::vector<Sequence> const& sequences);

  Stats const& stats() const { return mStats; }

 private:
  struct Row {
    std::size_t id = 0;       // index of the sequence
    int32_t kvLength = 0;     // the engine's copy of the row's device KV length
    bool prefilling = false;  // a joiner whose prefill is not done (unfinalised)
    int32_t chunk = 0;        // prefill tokens it ran in this step
  };

  void found();
  void preemptForGrowth();
  void admitWaiting();
  void step();
  void removeRows(std::vector<bool> const& drop);
  void require(bool ok, char const* call);

  // The sequence's tokens so far: prompt, then everything it sampled (the last without KV).
  std::vector<int32_t> tokensOf(std::size_t id) const {
    std::vector<int32_t> tokens = (*mSequences)[id].prompt;
    tokens.insert(tokens.end(), mOutcomes[id].generated.begin(), mOutcomes[id].generated.end());
    return tokens;
  }
  int32_t promptLength(std::size_t row) const {
    return static_cast<int32_t>(mContext.rawBatchedInputIds[row].size());
  }
  void sample(std::size_t row) {
    Outcome& outcome = mOutcomes[mRows[row].id];
    outcome.generated.push_back(nextToken(tokensOf(mRows[row].id)));
    mContext.generatedTokenIds[row].push_back(outcome.generated.back());
    if (static_cast<int32_t>(outcome.generated.size()) >=
        (*mSequences)[mRows[row].id].maxNewTokens) {
      mContext.finishReasons[row] = mkv::FinishReason::kLength;
    }
  }
  void noteAdmission(std::size_t id, int32_t reused) {
    bool const first = mOutcomes[id].generated.empty() && mOutcomes[id].preemptions == 0;
    (first ? mOutcomes[id].reusedTokens : mOutcomes[id].resumedReusedTokens) += reused;
  }
  // Tokens the step's budget has left after the running rows: one per decoding row, the rest of
  // each prompt being prefilled.
  int32_t budgetLeft() const {
    int32_t left = mMaxBatchedTokens;
    for (std::size_t i = 0; i < mRows.size(); ++i) {
      left -= mRows[i].prefilling ? promptLength(i) - mRows[i].kvLength : 1;
    }
    return left;
  }
  // Pages the next step's prepareDecodeStep would allocate (a joiner's were bound at its
  // admission): the library answers without changing anything.
  int64_t pagesForNextStep() const { return mManaged->decodeStepDemand(kHeadroom).basePages; }
  // What the pool can give now: free pages, and cached ones nobody runs on (eviction frees them).
  int64_t pagesAvailable() const {
    mkv::PagePoolUsage const base = mRuntime.capacity().base.value();
    return int64_t{base.freePages} + base.reclaimablePages;
  }
  // The device KV lengths are per execution row: the library writes them at preparePrefill and
  // at compaction, the engine after each execution and when a joiner is seated.
  void writeLength(std::size_t row, int32_t length) {
    for (mkv::KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool()}) {
      if (pool != nullptr) {
        pool->writeLengths(static_cast<int32_t>(row), std::span<int32_t const>(&length, 1),
                           mContext.stream);
      }
    }
  }
  void setActiveRows(std::size_t rows) {
    for (mkv::KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool()}) {
      if (pool != nullptr) {
        pool->setActiveBatchSize(static_cast<int32_t>(rows));
      }
    }
  }

  static constexpr mkv::DecodingKvHeadroom kHeadroom{1, 0};  // one new position per step

  mkv::KVCacheRuntime& mRuntime;
  int32_t mMaxBatchedTokens;
  mkv::Tensor mDeviceMapping;  // the compaction mapping on the device
  std::vector<Sequence> const* mSequences = nullptr;
  std::vector<Outcome> mOutcomes;
  std::deque<std::size_t> mWaiting;  // sequences not running, first in line first
  std::optional<mkv::ManagedKVCacheRequest> mManaged;
  mkv::DecodingInferenceContext mContext;
  std::vector<Row> mRows;  // execution rows, in admission order (the context's order)
  Stats mStats;
};

std::vector<Outcome> Engine::serve(std::vector<Sequence> const& sequences) {
  mSequences = &sequences;
  mOutcomes.assign(sequences.size(), Outcome{});
  mWaiting.clear();
  for (std::size_t id = 0; id < sequences.size(); ++id) {
    mWaiting.push_back(id);
  }
  while (!mWaiting.empty()) {
    found();
    removeRows({mContext.finishReasons[0] != mkv::FinishReason::kNotFinished});
    while (!mRows.empty()) {
      preemptForGrowth();
      admitWaiting();
      step();
      std::vector<bool> finished;
      for (mkv::FinishReason const reason : mContext.finishReasons) {
        finished.push_back(reason != mkv::FinishReason::kNotFinished);
      }
      removeRows(finished);
    }
    // In-flight admission needs a running row: an empty batch ends the request.
    require(mManaged->finish(), "finish");
    mManaged.reset();
  }
  return mOutcomes;
}

// The first waiting sequence begins a request (the batch is empty: no decode waits for its
// prefill, but the step's budget holds all the same).
void Engine::found() {
  std::size_t const id = mWaiting.front();
  std::vector<int32_t> const tokens = tokensOf(id);
  mContext = mkv::DecodingInferenceContext{};
  mContext.stream = mRuntime.config().stream;
  mContext.activeBatchSize = 1;
  mContext.rawBatchedInputIds = {tokens};
  mContext.generatedTokenIds = {{}};
  mContext.residentRefs = {mRuntime.residentSlots().acquire().value()};
  mContext.finishReasons = {mkv::FinishReason::kNotFinished};
  mkv::LLMGenerationRequest request;
  request.requests.resize(1);
  std::optional<mkv::ManagedKVCacheRequest> begun = mkv::ManagedKVCacheRequest::begin(
      mRuntime.contextCache(), mRuntime.swaPageManager(), request, mContext,
      /*speculativeRequest=*/false, kHeadroom,
      mkv::DecodingTokenStateContract::kCommittedPlusLookahead, request.contextCacheCommitPolicy);
  if (!begun) {
    mRuntime.residentSlots().release(mContext.residentRefs[0]);
    throw std::runtime_error("the first waiting sequence does not fit the pool");
  }
  mManaged = std::move(begun);
  mWaiting.pop_front();
  ++mStats.requests;
  int32_t const reused = mManaged->prefillStarts()->front();
  noteAdmission(id, reused);
  mContext.effectivePrefillLengths = {static_cast<int32_t>(tokens.size()) - reused};
  // The prefill step takes what the budget allows. A longer prompt runs its first chunk,
  // prepared before the step (bounded SWA maps that chunk's window) and published by
  // completePrefillChunk before the captures; the founder samples nothing, holds at
  // completePrefill and goes on in chunks as a joiner does.
  int32_t const first = std::min(static_cast<int32_t>(tokens.size()) - reused, mMaxBatchedTokens);
  bool const chunked = reused + first < static_cast<int32_t>(tokens.size());
  mRows = {Row{id, reused + first, chunked, first}};
  require(mManaged->preparePrefill(), "preparePrefill");
  require(mManaged->prepareSwaPrefill(mContext.effectivePrefillLengths), "prepareSwaPrefill");
  if (chunked && first > 0) {
    require(mManaged->preparePrefillChunk(0, reused + first), "preparePrefillChunk");
  }
  // ... engine: the prefill of [reused, kvLength); synchronise
  writeLength(0, mRows[0].kvLength);
  if (chunked) {
    ++mStats.prefillChunks;
    ++mOutcomes[id].prefillChunks;
    require(mManaged->completePrefillChunk(0, mRows[0].kvLength), "completePrefillChunk");
  }
  require(mManaged->enqueuePrefillCaptures(), "enqueuePrefillCaptures");
  if (!chunked) {
    sample(0);  // ... the lookahead
  }
  require(mManaged->completePrefill(mContext, {}), "completePrefill");
}

// Before a step, vLLM's recompute: while the decoding rows' growth does not fit what the pool can
// give and another row runs, preempt the newest row. preemptSequence publishes its committed
// state (an unfinalised joiner published its chunks already), the compaction returns its pages,
// and it waits first in line with its tokens so far.
void Engine::preemptForGrowth() {
  while (mRows.size() > 1 && pagesForNextStep() > pagesAvailable()) {
    std::size_t const victim = mRows.size() - 1;
    std::size_t const id = mRows[victim].id;
    if (!mRows[victim].prefilling) {
      require(mManaged->preemptSequence(static_cast<mkv::ExecutionRow>(victim)), "preemptSequence");
    }
    std::vector<bool> drop(mRows.size(), false);
    drop[victim] = true;
    removeRows(drop);
    mWaiting.push_front(id);
    ++mOutcomes[id].preemptions;
    ++mStats.preemptions;
  }
}

// vLLM's order: the running rows' tokens come first; a waiting sequence is admitted only while
// the step's budget has tokens left for it and its pages fit beside the step's growth
// (estimateAdmission: what admission would allocate, and the cached pages it would pin).
void Engine::admitWaiting() {
  while (!mWaiting.empty() && budgetLeft() > 0 &&
         mRows.size() < static_cast<std::size_t>(mRuntime.config().maxBatchSize)) {
    std::size_t const id = mWaiting.front();
    std::vector<int32_t> const tokens = tokensOf(id);
    mkv::AdmissionEstimate const estimate = mRuntime.estimateAdmission(tokens);
    if (estimate.demand.baseKvPages + estimate.pinnedReclaimable.baseKvPages >
        pagesAvailable() - pagesForNextStep()) {
      return;  // first in line waits for pages, and the others behind it
    }
    mkv::ResidentRef const resident = mRuntime.residentSlots().acquire().value();
    int32_t prefillStart = 0;
    mkv::AdmitSequenceStatus const admitted = mManaged->admitSequence(
        tokens, mContext.loraWeightsName, kHeadroom, prefillStart, resident, mContext.stream);
    if (admitted != mkv::AdmitSequenceStatus::kAdmitted) {
      mRuntime.residentSlots().release(resident);
      require(admitted == mkv::AdmitSequenceStatus::kNoCapacity, "admitSequence");
      return;
    }
    // The joiner is the last row, bound with prefillStart tokens of reused KV: the engine grows
    // the KV-length tensor for it at once. It holds in the decode steps of its chunks.
    mWaiting.pop_front();
    noteAdmission(id, prefillStart);
    ++mStats.joins;
    mContext.rawBatchedInputIds.push_back(tokens);
    mContext.effectivePrefillLengths.push_back(static_cast<int32_t>(tokens.size()) - prefillStart);
    mContext.generatedTokenIds.emplace_back();
    mContext.residentRefs.push_back(resident);
    mContext.finishReasons.push_back(mkv::FinishReason::kNotFinished);
    mContext.activeBatchSize = static_cast<int32_t>(mRows.size() + 1);
    mRows.push_back(Row{id, prefillStart, true, 0});
    setActiveRows(mRows.size());
    writeLength(mRows.size() - 1, prefillStart);
  }
}

// One decode step: a token per decoding row, then the budget's rest on the joiners' chunks in
// join order, each chunk's pages made ready before the step (on bounded SWA its window). After
// it, each chunk's blocks are published (a sequence admitted later reuses them); a joiner whose
// prompt is done samples its first token and is finalised.
void Engine::step() {
  int32_t budget = mMaxBatchedTokens;
  for (Row const& row : mRows) {
    budget -= row.prefilling ? 0 : 1;
  }
  for (std::size_t i = 0; i < mRows.size(); ++i) {
    Row& row = mRows[i];
    row.chunk = row.prefilling ? std::min(budget, promptLength(i) - row.kvLength) : 0;
    budget -= row.chunk;
    if (row.chunk > 0) {
      require(mManaged->preparePrefillChunk(static_cast<mkv::ExecutionRow>(i),
                                            row.kvLength + row.chunk),
              "preparePrefillChunk");
    }
  }
  require(mManaged->prepareDecodeStep(mContext, kHeadroom), "prepareDecodeStep");
  // ... engine: one forward over the step's tokens (each decoding row's lookahead, each chunk);
  // synchronise; sample
  for (std::size_t i = 0; i < mRows.size(); ++i) {
    Row& row = mRows[i];
    row.kvLength += row.prefilling ? row.chunk : 1;
    writeLength(i, row.kvLength);
    if (!row.prefilling) {
      sample(i);
    }
  }
  require(mManaged->completeDecodeStep(mContext, {}), "completeDecodeStep");
  ++mStats.steps;
  for (std::size_t i = 0; i < mRows.size(); ++i) {
    Row& row = mRows[i];
    if (!row.prefilling || row.chunk == 0) {
      continue;
    }
    ++mStats.prefillChunks;
    ++mOutcomes[row.id].prefillChunks;
    auto const executionRow = static_cast<mkv::ExecutionRow>(i);
    if (row.kvLength < promptLength(i)) {
      require(mManaged->completePrefillChunk(executionRow, row.kvLength), "completePrefillChunk");
      continue;
    }
    sample(i);
    require(mManaged->finalizeSequenceAdmission(executionRow, mContext.generatedTokenIds[i].back(),
                                                promptLength(i)),
            "finalizeSequenceAdmission");
    row.prefilling = false;
  }
}

// Order-preserving compaction of the rows `drop` marks (finished or preempted); their pages go
// back (what they published stays cached) and their residents are released. The library compacts
// the device KV lengths; the engine compacts its own rows the same way.
void Engine::removeRows(std::vector<bool> const& drop) {
  std::vector<int32_t> oldToNew(mRows.size(), -1);
  int32_t survivors = 0;
  for (std::size_t i = 0; i < mRows.size(); ++i) {
    oldToNew[i] = drop[i] ? -1 : survivors++;
  }
  if (survivors == static_cast<int32_t>(mRows.size())) {
    return;
  }
  require(mManaged->beginBatchCompaction(oldToNew, survivors, mDeviceMapping),
          "beginBatchCompaction");
  require(mManaged->completeBatchCompaction(oldToNew), "completeBatchCompaction");
  mkv::DecodingInferenceContext next;
  next.stream = mContext.stream;
  std::vector<Row> kept;
  for (std::size_t i = 0; i < mRows.size(); ++i) {
    if (drop[i]) {
      mRuntime.residentSlots().release(mContext.residentRefs[i]);
      continue;
    }
    next.rawBatchedInputIds.push_back(mContext.rawBatchedInputIds[i]);
    next.effectivePrefillLengths.push_back(mContext.effectivePrefillLengths[i]);
    next.generatedTokenIds.push_back(mContext.generatedTokenIds[i]);
    next.residentRefs.push_back(mContext.residentRefs[i]);
    next.finishReasons.push_back(mContext.finishReasons[i]);
    kept.push_back(mRows[i]);
  }
  next.activeBatchSize = survivors;
  mContext = std::move(next);
  mRows = std::move(kept);
}

// A lifecycle call returned false (a pool exhausted, a failed synchronisation, a poisoned
// backend): end the request, return the residents whose rows are free, and report.
void Engine::require(bool ok, char const* call) {
  if (ok) {
    return;
  }
  mkv::RowFailure const failure = mManaged->lastFailure();
  bool const poisoned = !mManaged->finish();
  mManaged.reset();
  for (mkv::ResidentRef const& resident : mContext.residentRefs) {
    if (mRuntime.residentRowState(resident.slot) == mkv::ResidentRowState::kFree) {
      mRuntime.residentSlots().release(resident);
    }
  }
  mRows.clear();
  throw std::runtime_error(
      std::string(call) + " failed (" + std::string(mkv::toString(failure.reason)) + ", row " +
      std::to_string(failure.row) + ")" + (poisoned ? ", backend poisoned" : ""));
}

// A context-reuse runtime of `numPages` pages of 16 tokens.
std::unique_ptr<mkv::KVCacheRuntime> makeRuntime(int32_t numPages,
                                                 mkv::DeviceType device = mkv::DeviceType::kCPU) {
  mkv::KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 2;
  config.model.numKVHeads = 2;
  config.model.headDim = 16;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 512;
  config.tokensPerPage = 16;
  config.numPages = numPages;
  config.contextReuse = true;
  config.deviceType = device;
  return mkv::KVCacheRuntime::create(config);
}

}  // namespace serving_example
