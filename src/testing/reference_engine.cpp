#include "mkv/testing/reference_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "core/check.h"
#include "core/device.h"
#include "mkv/context_cache/block_hash.h"
#include "mkv/context_cache/context_cache_request.h"
#include "mkv/managed_kv_cache_request.h"

namespace mkv::testing {
namespace {

uint64_t mix(uint64_t x) noexcept {
  x ^= x >> 31;
  x *= 0x7FB5D329728EA185ULL;
  x ^= x >> 27;
  x *= 0x81DADEF4BC2DD44DULL;
  x ^= x >> 33;
  return x;
}

int64_t nanosSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

}  // namespace

struct ReferenceEngine::Row {
  EngineSequence spec;
  std::size_t outcome = 0;
  ResidentRef resident;
  PrefixDigests digests;
  std::vector<uint64_t> promptKeys;
  int32_t prefillStart = 0;
  int32_t materialized = 0;  // positions with KV
  int32_t steps = 0;
  FinishReason reason = FinishReason::kNotFinished;
};

struct ReferenceEngine::Run {
  EngineRequest const* request = nullptr;
  LLMGenerationRequest generation;
  DecodingInferenceContext context;
  std::optional<ManagedKVCacheRequest> managed;
  std::vector<Row> rows;
  RequestOutcome outcome;
  uint64_t seed = 0;
};

ReferenceEngine::ReferenceEngine(KVCacheRuntime& runtime, ReferenceEngineOptions options)
    : mRuntime(runtime), mOptions(std::move(options)), mRandom(mix(mOptions.seed + 0x51ED)) {
  if (runtime.fullPool() != nullptr) {
    mFullOracle = std::make_unique<KvOracle>(*runtime.fullPool(), *runtime.fullPageTable());
  }
  if (runtime.swaPool() != nullptr) {
    mSwaOracle = std::make_unique<KvOracle>(*runtime.swaPool(), *runtime.swaPageTable());
  }
  // Only checkpoint deployments promise a zeroed or restored row at the start of a sequence.
  ContextCacheCoordinator const* coordinator = runtime.contextCache();
  if (runtime.recurrentState() != nullptr && coordinator != nullptr &&
      coordinator->profile().usesCheckpointReuse()) {
    mRecurrentOracle = std::make_unique<RecurrentOracle>(*runtime.recurrentState());
  }
  mDeviceMapping = Tensor({runtime.config().maxBatchSize}, DataType::kInt32,
                          runtime.config().deviceType);
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
  Hash128 const salt = digestIdentity(request.cacheSalt);
  Hash128 const lora = digestIdentity(request.loraWeightsName);
  return mix(salt.hi ^ mix(salt.lo ^ mix(lora.hi ^ mix(lora.lo))));
}

std::vector<uint64_t> ReferenceEngine::positionKeys(EngineSequence const& sequence,
                                                    std::vector<int32_t> const& mediaTokenIds) const {
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
      keys[i] = mix(keys[i] ^ mix(media[i].content.hi ^ mix(media[i].content.lo +
                                                            static_cast<uint64_t>(media[i].offset))));
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

void ReferenceEngine::notePages() { mStats.peakPagesInUse = std::max(mStats.peakPagesInUse, pagesInUse()); }

void ReferenceEngine::verifyRow(Run& run, Row& row, bool full) {
  (void)run;
  if (mOptions.verify == VerifyMode::kNone) {
    return;
  }
  int32_t const end = row.materialized;
  int32_t const window = mRuntime.config().model.slidingWindowTokens;
  auto check = [&](KvOracle const& oracle, int64_t begin, int64_t stop) {
    if (begin >= stop) {
      return;
    }
    OracleReport const result = oracle.verify(row.resident.slot, row.digests, begin, stop);
    mStats.oracleChecks += result.positionsChecked;
    if (!result.ok()) {
      mStats.oracleMismatches += result.mismatches;
      report(result.firstMismatch);
    }
  };
  auto sampled = [&](KvOracle const& oracle, int64_t begin, int64_t stop) {
    if (full || mOptions.verify == VerifyMode::kAll) {
      check(oracle, begin, stop);
      return;
    }
    if (begin >= stop) {
      return;
    }
    check(oracle, stop - 1, stop);  // the position just written
    for (int i = 0; i < 2; ++i) {
      mRandom = mix(mRandom + 0x9E37);
      int64_t const p = begin + static_cast<int64_t>(mRandom % static_cast<uint64_t>(stop - begin));
      check(oracle, p, p + 1);
    }
  };
  bool const bounded = mRuntime.backend() == KVCacheBackend::kBoundedSwa;
  if (mFullOracle) {
    sampled(*mFullOracle, 0, end);
  }
  if (bounded && mSwaOracle) {
    sampled(*mSwaOracle, std::max(0, end - window), end);
  }
}

void ReferenceEngine::checkLengths(Run& run) {
  auto checkPool = [&](KVCachePool const& pool) {
    auto const rows = run.rows.size();
    if (static_cast<std::size_t>(pool.activeBatchSize()) != rows) {
      report(fmt::format("KV-length tensor has {} active rows, expected {}", pool.activeBatchSize(),
                         rows));
      return;
    }
    std::vector<int32_t> lengths(rows);
    detail::copyBytes(lengths.data(), DeviceType::kCPU, pool.kvLengths().rawPointer(),
                      pool.deviceType(), rows * sizeof(int32_t), nullptr);
    if (pool.deviceType() == DeviceType::kGPU) {
      detail::synchronizeDevice();
    }
    for (std::size_t i = 0; i < rows; ++i) {
      ++mStats.lengthChecks;
      if (lengths[i] != run.rows[i].materialized) {
        report(fmt::format("KV length of row {} (slot {}) is {}, expected {}", i,
                           run.rows[i].resident.slot, lengths[i], run.rows[i].materialized));
      }
    }
  };
  if (mOptions.verify == VerifyMode::kNone) {
    return;
  }
  if (mRuntime.fullPool() != nullptr) {
    checkPool(*mRuntime.fullPool());
  }
  if (mRuntime.swaPool() != nullptr) {
    checkPool(*mRuntime.swaPool());
  }
}

void ReferenceEngine::executeRecurrent(Row& row, int32_t from, int32_t to) {
  if (!mRecurrentOracle) {
    return;
  }
  if (mOptions.verify != VerifyMode::kNone) {
    OracleReport const resumed = mRecurrentOracle->verify(row.resident.slot, row.digests, from);
    ++mStats.recurrentChecks;
    if (!resumed.ok()) {
      ++mStats.oracleMismatches;
      report("recurrent state: " + resumed.firstMismatch);
    }
  }
  mRecurrentOracle->write(row.resident.slot, row.digests, to);
}

namespace {
void writeLength(KVCacheRuntime& runtime, int32_t row, int32_t length, cudaStream_t stream) {
  int32_t const value[1] = {length};
  if (runtime.fullPool() != nullptr) {
    runtime.fullPool()->writeLengths(row, value, stream);
  }
  if (runtime.swaPool() != nullptr) {
    runtime.swaPool()->writeLengths(row, value, stream);
  }
}
}  // namespace

void ReferenceEngine::executePrefill(Run& run, Row& row, int32_t start) {
  auto const promptLength = static_cast<int32_t>(row.spec.prompt.size());
  row.digests = PrefixDigests(run.seed);
  row.digests.extend(row.promptKeys);
  row.prefillStart = start;
  bool const bounded = mRuntime.backend() == KVCacheBackend::kBoundedSwa;
  int32_t const window = mRuntime.config().model.slidingWindowTokens;
  // What the cache claims is already there must be exactly this prefix's KV.
  if (start > 0 && mOptions.verify != VerifyMode::kNone && mFullOracle) {
    OracleReport const reused = mFullOracle->verify(row.resident.slot, row.digests, 0, start);
    mStats.oracleChecks += reused.positionsChecked;
    if (!reused.ok()) {
      mStats.oracleMismatches += reused.mismatches;
      report("reused prefix: " + reused.firstMismatch);
    }
  }
  if (mFullOracle) {
    mFullOracle->write(row.resident.slot, row.digests, bounded ? 0 : start, promptLength);
  }
  if (bounded && mSwaOracle) {
    mSwaOracle->write(row.resident.slot, row.digests, std::max(0, promptLength - window),
                      promptLength);
  }
  executeRecurrent(row, start, promptLength);
  row.materialized = promptLength;
  mStats.promptTokens += promptLength;
  mStats.reusedTokens += start;
  mStats.prefillTokensComputed += promptLength - start;
  verifyRow(run, row, /*full=*/false);
}

RequestOutcome ReferenceEngine::run(EngineRequest const& request,
                                    std::deque<EngineSequence>* joinQueue) {
  constexpr char const* kCall = "ReferenceEngine::run";
  MKV_REQUIRE(!request.sequences.empty(), kCall, "a request needs at least one sequence");
  cudaStream_t const stream = mRuntime.config().stream;
  Run run;
  run.request = &request;
  run.seed = identitySeed(request);
  ++mStats.requests;

  // Residents for the founding batch.
  for (auto const& sequence : request.sequences) {
    MKV_REQUIRE(!sequence.prompt.empty(), kCall, "empty prompt");
    std::optional<ResidentRef> resident = mRuntime.residentSlots().acquire();
    if (!resident) {
      for (auto const& row : run.rows) {
        mRuntime.residentSlots().release(row.resident);
      }
      detail::throwContract(kCall, "batch of {} exceeds the runtime's {} resident slots",
                            request.sequences.size(), mRuntime.residentSlots().capacity());
    }
    Row row;
    row.spec = sequence;
    row.resident = *resident;
    row.promptKeys = positionKeys(sequence, request.mediaTokenIds);
    row.outcome = run.outcome.sequences.size();
    run.outcome.sequences.push_back(SequenceOutcome{sequence.tag, sequence.prompt, {},
                                                    FinishReason::kNotFinished, 0, false});
    run.rows.push_back(std::move(row));
  }
  auto releaseAll = [&]() {
    for (auto const& row : run.rows) {
      mRuntime.residentSlots().release(row.resident);
    }
    run.rows.clear();
  };

  // Context and generation request.
  run.generation.contextCacheLookupPolicy = request.lookupPolicy;
  run.generation.contextCacheCommitPolicy = request.commitPolicy;
  run.generation.loraWeightsName = request.loraWeightsName;
  run.generation.cacheSalt = request.cacheSalt;
  DecodingInferenceContext& context = run.context;
  context.stream = stream;
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

  DecodingKvHeadroom const headroom{1, 0};
  auto const beginStart = std::chrono::steady_clock::now();
  std::optional<ManagedKVCacheRequest> begun = ManagedKVCacheRequest::begin(
      mRuntime.contextCache(), mRuntime.swaPageManager(), run.generation, context, false, headroom,
      DecodingTokenStateContract::kCommittedPlusLookahead, request.commitPolicy,
      request.mediaTokenIds);
  int64_t libraryNanos = nanosSince(beginStart);
  if (!begun) {
    releaseAll();
    run.outcome.admitted = false;
    return run.outcome;
  }
  run.managed.emplace(std::move(*begun));
  run.outcome.admitted = true;
  mStats.sequences += static_cast<int64_t>(run.rows.size());
  ManagedKVCacheRequest& managed = *run.managed;
  notePages();

  // ---- prefill
  std::vector<int32_t> const* starts = managed.prefillStarts();
  for (std::size_t i = 0; i < run.rows.size(); ++i) {
    int32_t const start = starts != nullptr ? (*starts)[i] : 0;
    context.effectivePrefillLengths.push_back(
        static_cast<int32_t>(run.rows[i].spec.prompt.size()) - start);
    run.rows[i].prefillStart = start;
    run.outcome.sequences[run.rows[i].outcome].prefillStart = start;
  }
  auto t0 = std::chrono::steady_clock::now();
  bool ok = managed.preparePrefill() && managed.prepareSwaPrefill(context.effectivePrefillLengths);
  libraryNanos += nanosSince(t0);
  auto sampleAfter = [&](Row& row, std::size_t index) {
    int32_t const token = sampleToken(row.digests.at(row.materialized - 1));
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
  };
  if (ok) {
    for (std::size_t i = 0; i < run.rows.size(); ++i) {
      executePrefill(run, run.rows[i], run.rows[i].prefillStart);
      writeLength(mRuntime, static_cast<int32_t>(i), run.rows[i].materialized, stream);
    }
    t0 = std::chrono::steady_clock::now();
    ok = managed.enqueuePrefillCaptures();
    libraryNanos += nanosSince(t0);
    for (std::size_t i = 0; i < run.rows.size(); ++i) {
      sampleAfter(run.rows[i], i);
    }
    t0 = std::chrono::steady_clock::now();
    ok = ok && managed.completePrefill(context, {});
    libraryNanos += nanosSince(t0);
    checkLengths(run);
  }
  notePages();

  // ---- decode loop
  auto compactFinished = [&]() -> bool {
    std::vector<int32_t> mapping(run.rows.size(), -1);
    int32_t survivors = 0;
    for (std::size_t i = 0; i < run.rows.size(); ++i) {
      if (run.rows[i].reason == FinishReason::kNotFinished) {
        mapping[i] = survivors++;
      }
    }
    if (survivors == static_cast<int32_t>(run.rows.size())) {
      return true;
    }
    auto const start = std::chrono::steady_clock::now();
    bool const compacted = managed.beginBatchCompaction(mapping, survivors, mDeviceMapping) &&
                           managed.completeBatchCompaction(mapping);
    libraryNanos += nanosSince(start);
    if (!compacted) {
      return false;
    }
    std::vector<Row> kept;
    DecodingInferenceContext next;
    next.stream = context.stream;
    next.loraWeightsName = context.loraWeightsName;
    for (std::size_t i = 0; i < run.rows.size(); ++i) {
      if (mapping[i] < 0) {
        run.outcome.sequences[run.rows[i].outcome].reason = run.rows[i].reason;
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
    checkLengths(run);
    return true;
  };

  auto tryJoins = [&]() -> bool {
    if (joinQueue == nullptr || !mRuntime.supportsSeatedAdmission()) {
      return true;
    }
    while (!joinQueue->empty() &&
           run.rows.size() < static_cast<std::size_t>(mRuntime.config().maxBatchSize)) {
      std::optional<ResidentRef> resident = mRuntime.residentSlots().acquire();
      if (!resident) {
        return true;
      }
      EngineSequence const& spec = joinQueue->front();
      int32_t prefillStart = 0;
      auto const start = std::chrono::steady_clock::now();
      auto const status = managed.admitSequence(spec.prompt, request.loraWeightsName, headroom,
                                                prefillStart, *resident, stream,
                                                request.mediaTokenIds, spec.images, spec.audios);
      libraryNanos += nanosSince(start);
      if (status != ContextCacheRequest::AdmitSequenceStatus::kAdmitted) {
        mRuntime.residentSlots().release(*resident);
        ++mStats.joinRefusals;
        return status == ContextCacheRequest::AdmitSequenceStatus::kNoCapacity;
      }
      ++mStats.joins;
      ++mStats.sequences;
      Row row;
      row.spec = spec;
      row.resident = *resident;
      row.promptKeys = positionKeys(spec, request.mediaTokenIds);
      row.outcome = run.outcome.sequences.size();
      run.outcome.sequences.push_back(
          SequenceOutcome{spec.tag, spec.prompt, {}, FinishReason::kNotFinished, prefillStart, true});
      joinQueue->pop_front();
      auto const index = run.rows.size();
      run.rows.push_back(std::move(row));
      context.rawBatchedInputIds.push_back(run.rows[index].spec.prompt);
      context.effectivePrefillLengths.push_back(
          static_cast<int32_t>(run.rows[index].spec.prompt.size()) - prefillStart);
      context.generatedTokenIds.emplace_back();
      context.residentRefs.push_back(*resident);
      context.finishReasons.push_back(FinishReason::kNotFinished);
      context.activeBatchSize = static_cast<int32_t>(run.rows.size());
      // Seat the joiner: its KV-length row, its prefill, its lookahead token.
      for (KVCachePool* pool : {mRuntime.fullPool(), mRuntime.swaPool()}) {
        if (pool != nullptr) {
          pool->setActiveBatchSize(context.activeBatchSize);
        }
      }
      executePrefill(run, run.rows[index], prefillStart);
      writeLength(mRuntime, static_cast<int32_t>(index), run.rows[index].materialized, stream);
      sampleAfter(run.rows[index], index);
      int32_t const lookahead = context.generatedTokenIds[index].back();
      auto const finalizeStart = std::chrono::steady_clock::now();
      bool const finalized = managed.finalizeSequenceAdmission(
          static_cast<int32_t>(index), lookahead,
          static_cast<int32_t>(run.rows[index].spec.prompt.size()));
      libraryNanos += nanosSince(finalizeStart);
      if (!finalized) {
        return false;
      }
      checkLengths(run);
      notePages();
    }
    return true;
  };

  while (ok) {
    ok = compactFinished();
    if (!ok || run.rows.empty()) {
      break;
    }
    // A joiner can finish on its lookahead token: compact it away before the next step (a row
    // that finished without a new token may only be cancelled or errored).
    ok = tryJoins() && compactFinished();
    if (!ok || run.rows.empty()) {
      break;
    }
    bool anyRunning = false;
    for (std::size_t i = 0; i < run.rows.size(); ++i) {
      Row& row = run.rows[i];
      if (row.reason == FinishReason::kNotFinished && row.spec.cancelAtStep >= 0 &&
          row.steps >= row.spec.cancelAtStep) {
        row.reason = FinishReason::kCancelled;
        context.finishReasons[i] = row.reason;
      }
      anyRunning = anyRunning || row.reason == FinishReason::kNotFinished;
    }
    if (!anyRunning) {
      continue;  // compact the cancelled rows away
    }
    int64_t stepNanos = 0;
    auto start = std::chrono::steady_clock::now();
    ok = managed.prepareDecodeStep(context, headroom);
    stepNanos += nanosSince(start);
    if (!ok) {
      for (std::size_t i = 0; i < run.rows.size(); ++i) {
        if (run.rows[i].reason == FinishReason::kNotFinished) {
          run.rows[i].reason = FinishReason::kError;
        }
      }
      break;
    }
    notePages();
    for (std::size_t i = 0; i < run.rows.size(); ++i) {
      Row& row = run.rows[i];
      if (row.reason != FinishReason::kNotFinished) {
        continue;
      }
      int32_t const position = row.materialized;
      uint64_t const key = static_cast<uint32_t>(context.generatedTokenIds[i].back());
      row.digests.extend(std::span<uint64_t const>(&key, 1));
      if (mFullOracle) {
        mFullOracle->write(row.resident.slot, row.digests, position, position + 1);
      }
      if (mRuntime.backend() == KVCacheBackend::kBoundedSwa && mSwaOracle) {
        mSwaOracle->write(row.resident.slot, row.digests, position, position + 1);
      }
      executeRecurrent(row, position, position + 1);
      row.materialized = position + 1;
      writeLength(mRuntime, static_cast<int32_t>(i), row.materialized, stream);
      verifyRow(run, row, /*full=*/false);
      ++row.steps;
      sampleAfter(row, i);
    }
    start = std::chrono::steady_clock::now();
    ok = managed.completeDecodeStep(context, {});
    stepNanos += nanosSince(start);
    mStats.stepHostNanoseconds.push_back(stepNanos);
    libraryNanos += stepNanos;
    ++mStats.decodeSteps;
    ++run.outcome.decodeSteps;
    checkLengths(run);
    if (mOptions.onStep) {
      mOptions.onStep(mStats.decodeSteps);
    }
  }
  (void)libraryNanos;
  run.outcome.failed = !ok;
  for (auto const& row : run.rows) {
    run.outcome.sequences[row.outcome].reason =
        row.reason == FinishReason::kNotFinished ? FinishReason::kError : row.reason;
  }
  bool const finished = managed.finish();
  run.outcome.failed = run.outcome.failed || !finished;
  run.managed.reset();
  releaseAll();
  return run.outcome;
}

}  // namespace mkv::testing
