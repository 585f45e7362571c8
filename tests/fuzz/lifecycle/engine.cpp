/// \file engine.cpp
/// The engine side of the lifecycle: prompts, the runtime's view of a request, KV written and
/// verified through the oracles, KV lengths, sampled tokens.

#include <algorithm>

#include "fuzz/lifecycle/lifecycle.h"

namespace mkv::fuzz::lifecycle {

std::vector<int32_t> Lifecycle::makePrompt(int32_t tokens) {
  // Fewer families on the runtimes with checkpoints, a draft or a window cache: more prompts
  // extend another's, so exact checkpoints, paired paths and cached windows are reused more often.
  int32_t const family = mIn.below(mKind >= Runtime::kHybrid ? 2 : 4);
  std::vector<int32_t> prompt(static_cast<std::size_t>(tokens));
  for (int32_t i = 0; i < tokens; ++i) {
    prompt[static_cast<std::size_t>(i)] = promptToken(family, i);
  }
  if (tokens > 1 && mIn.oneIn(6)) {
    prompt.back() = promptToken(family + 7, tokens);  // same prefix, another last token
  }
  return prompt;
}

int32_t Lifecycle::promptLength() {
  int32_t const limit = maxPromptTokens();
  switch (mIn.below(4)) {
    case 0:
      return 1 + mIn.below(std::min(limit, kPage));
    case 1:
      return std::min(limit, kPage * (1 + mIn.below(mWidth)));  // page aligned
    case 2:
      return limit - mIn.below(3);  // near the row width
    default:
      return 1 + mIn.below(std::min(limit, 255));
  }
}

/// The runtime's view of a request.
DecodingInferenceContext Lifecycle::contextOf(Req const& req) const {
  DecodingInferenceContext context;
  context.stream = kStream;
  context.activeBatchSize = static_cast<int32_t>(req.rows.size());
  context.loraWeightsName = req.lora;
  for (Row const& row : req.rows) {
    context.rawBatchedInputIds.push_back(row.prompt);
    context.effectivePrefillLengths.push_back(static_cast<int32_t>(row.prompt.size()) - row.start);
    context.generatedTokenIds.push_back(row.generated);
    context.residentRefs.push_back(row.resident);
    context.finishReasons.push_back(row.reason);
  }
  return context;
}

void Lifecycle::writeLength(int32_t rowIndex, int32_t length) {
  for (KVCachePool* pool : mLengthPools) {
    pool->writeLengths(rowIndex, std::span<int32_t const>(&length, 1), kStream);
  }
}

void Lifecycle::writeDraftLength(int32_t rowIndex, int32_t length) {
  mRuntime->draftPool()->writeLengths(rowIndex, std::span<int32_t const>(&length, 1), kStream);
}

void Lifecycle::setActiveBatch(int32_t batch) {
  for (KVCachePool* pool : mLengthPools) {
    pool->setActiveBatchSize(batch);
  }
  if (mRuntime->draftPool() != nullptr) {  // a paired request's draft rows follow its base rows
    mRuntime->draftPool()->setActiveBatchSize(batch);
  }
}

/// The engine's prefill of one bound row: the reused prefix must already hold this prefix's
/// KV (and on checkpoint runtimes the recurrent rows of exactly that prefix; on paired ones the
/// draft KV); the rest is written (SWA: only the retained window of the chunk's end, positions
/// before it coming from the forward's activations; full identity layers: all of it), and the
/// recurrent rows are advanced to the prompt's end.
void Lifecycle::executePrefill(Req& req, Row& row, int32_t rowIndex, int32_t end) {
  auto const length = end > 0 ? end : static_cast<int32_t>(row.prompt.size());
  if (coordinatorBackend()) {
    bool const first = row.materialized == 0;  // a later chunk of a joiner starts past its start
    int32_t const from = first ? row.start : row.materialized;
    if (first) {
      verifyResumed(req, row, rowIndex);
    } else if (mRecurrentOracle) {  // a later chunk resumes from the state the last one left
      testing::OracleReport const state =
          mRecurrentOracle->verify(row.resident.slot, row.digests, from);
      ++mStats.recurrentChecks;
      expectf(state.ok(), "recurrent rows of slot {} carried to the chunk start {}: {}",
              row.resident.slot, from, state.firstMismatch);
    }
    oracleWrite(*mFullOracle, row.resident.slot, row.digests, from, length);
    if (slidingReuse()) {  // every executed position: complete prompt blocks are published
      oracleWrite(*mSwaOracle, row.resident.slot, row.digests, from, length);
    }
    if (mRecurrentOracle) {
      mRecurrentOracle->write(row.resident.slot, row.digests, length);
      captureReusePoints(req, row, rowIndex, from, length);
    }
    if (row.paired && req.mtp) {
      executeDraft(row, rowIndex, length - 1);  // up to the boundary token's row
    }
  } else {
    int32_t const from = row.materialized;  // a joiner's later chunk starts where one ended
    mSwaOracle->write(row.resident.slot, row.digests, std::max(from, length - mWindow), length);
    if (mFullOracle) {
      mFullOracle->write(row.resident.slot, row.digests, from, length);
    }
  }
  row.materialized = length;
  writeLength(rowIndex, length);
}

void Lifecycle::executeSwaChunk(Req& req, Row& row, int32_t rowIndex) {
  int32_t const from = row.materialized;
  expectf(from == row.windowFrom && row.endpoint > from,
          "driver: slot {} runs a chunk [{}, {}) after {} completed", row.resident.slot, from,
          row.endpoint, row.windowFrom);
  testing::OracleReport const read =
      mSwaOracle->verify(row.resident.slot, row.digests, std::max(0, from - mWindow), from);
  mStats.oraclePositions += read.positionsChecked;
  expectf(read.ok(), "the window before slot {}'s prefill chunk [{}, {}): {}", row.resident.slot,
          from, row.endpoint, read.firstMismatch);
  executePrefill(req, row, rowIndex, row.endpoint);
  ++mStats.swaChunksRun;
  trace(fmt::format("engine: row {} (slot {}) runs its prefill chunk [{}, {}) of {}", rowIndex,
                    row.resident.slot, from, row.endpoint, row.prompt.size()));
  if (row.materialized == static_cast<int32_t>(row.prompt.size())) {
    sampleInto(row);  // the lookahead token after its prompt
  }
}

/// The scan's states at the reuse points the backend named for the row that the execution of
/// [`from`, `to`) passes, into their snapshot slots; each is filed for the checkpoint invariant
/// (finalisation commits them).
void Lifecycle::captureReusePoints(Req const& req, Row const& row, int32_t rowIndex, int32_t from,
                                   int32_t to) {
  std::span<ReusePointCapture const> const points =
      req.facade ? req.facade->reusePointCaptures(rowIndex)
                 : mCoordinator->reusePointCaptures(req.coordinator, rowIndex);
  for (ReusePointCapture const& point : points) {
    expectf(point.position > row.start && point.position < static_cast<int32_t>(row.prompt.size()),
            "reuse point at {} outside the prefill ({}, {})", point.position, row.start,
            row.prompt.size());
    if (point.position <= from || point.position > to) {
      continue;  // another chunk's
    }
    mRecurrentOracle->writeSnapshot(*mCoordinator->snapshots(), point.snapshotSlot, row.digests,
                                    point.position);
    noteCheckpoint(req, row, point.position, false);
    ++mStats.reusePointsWritten;
  }
}

/// What preparePrefill left for a row to resume from: the reused KV, the recurrent rows of the
/// reused prefix (zero for a row that reuses nothing), and for a paired row the reused draft KV
/// (Hybrid-MTP: all but the boundary token's row) and the draft KV length the backend set.
void Lifecycle::verifyResumed(Req const& req, Row& row, int32_t rowIndex) {
  if (row.start > 0) {
    testing::OracleReport const reused =
        mFullOracle->verify(row.resident.slot, row.digests, 0, row.start);
    mStats.oraclePositions += reused.positionsChecked;
    expectf(reused.ok(), "reused prefix of slot {} ({} tokens): {}", row.resident.slot, row.start,
            reused.firstMismatch);
  }
  if (slidingReuse() && row.start > 0) {  // the reused window before the start, mapped from the
                                          // window cache, must be this prefix's too
    testing::OracleReport const window = mSwaOracle->verify(
        row.resident.slot, row.digests, std::max(0, row.start - mWindow), row.start);
    mStats.oraclePositions += window.positionsChecked;
    expectf(window.ok(), "reused sliding window of slot {} (before {}): {}", row.resident.slot,
            row.start, window.firstMismatch);
    ++mStats.slidingWindowReuses;
  }
  if (mRecurrentOracle) {
    testing::OracleReport const state =
        mRecurrentOracle->verify(row.resident.slot, row.digests, row.start);
    ++mStats.recurrentChecks;
    expectf(state.ok(), "recurrent rows of slot {} restored for {} tokens: {}", row.resident.slot,
            row.start, state.firstMismatch);
    mStats.checkpointsRestored += row.start > 0 ? 1 : 0;
  }
  if (!row.paired) {
    return;
  }
  int32_t const draftStart = req.mtp ? std::max(0, row.start - 1) : row.start;
  row.drafted = draftStart;
  KVCachePool const& draftPool = *mRuntime->draftPool();
  auto const* lengths = static_cast<int32_t const*>(draftPool.kvLengths().rawPointer());
  expectf(draftPool.activeBatchSize() == static_cast<int32_t>(req.rows.size()) &&
              lengths[rowIndex] == draftStart,
          "draft KV length of row {} is {} (batch {}), expected {}", rowIndex, lengths[rowIndex],
          draftPool.activeBatchSize(), draftStart);
  if (draftStart > 0) {
    testing::OracleReport const reused =
        mDraftOracle->verify(row.resident.slot, row.draft, 0, draftStart);
    mStats.draftOraclePositions += reused.positionsChecked;
    expectf(reused.ok(), "reused draft prefix of slot {} ({} rows): {}", row.resident.slot,
            draftStart, reused.firstMismatch);
    ++mStats.pairedReuses;
  }
}

/// The draft model writes its rows [drafted, to) (each needs the token after it) and its KV length.
void Lifecycle::executeDraft(Row& row, int32_t rowIndex, int32_t to) {
  if (to > row.drafted) {
    oracleWrite(*mDraftOracle, row.resident.slot, row.draft, row.drafted, to);
    row.drafted = to;
  }
  writeDraftLength(rowIndex, row.drafted);
}

/// Hybrid-MTP: the base hidden rows of the prefill's positions [start, prompt), each a function
/// of its prefix, as the engine's base model leaves them for the draft.
void Lifecycle::writeHiddenStates(Req& req) {
  req.hidden.clear();
  for (Row const& row : req.rows) {
    req.hidden.push_back(hiddenStatesOf(row));
  }
}

Tensor Lifecycle::hiddenStatesOf(Row const& row) {
  auto const length = static_cast<int32_t>(row.prompt.size());
  Tensor hidden(Coords{length - row.start, kHiddenWidth}, DataType::kFloat16, DeviceType::kCPU);
  auto* bytes = static_cast<uint8_t*>(hidden.rawPointer());
  std::size_t const rowBytes = static_cast<std::size_t>(kHiddenWidth) * 2;
  for (int32_t p = row.start; p < length; ++p) {
    testing::KvOracle::expectedRow(
        row.digests.at(p), 7, 0,
        std::span<uint8_t>(bytes + static_cast<std::size_t>(p - row.start) * rowBytes, rowBytes));
  }
  return hidden;
}

void Lifecycle::sampleInto(Row& row) {
  int32_t const token = sampleToken(row.digests.at(row.digests.size() - 1));
  row.generated.push_back(token);
  appendTokens(row, std::span<int32_t const>(&token, 1), mDraftLookahead);
}

/// The engine's decode of one running row: writes the KV of the `accepted` positions from
/// `materialized` on (one for a vanilla step, the accepted span of a verification round) and
/// advances the recurrent rows.
void Lifecycle::executeDecode(Req& req, Row& row, int32_t rowIndex) {
  for (int32_t k = 0; k < std::max(1, row.accepted); ++k) {
    if (req.contract == DecodingTokenStateContract::kFullyCommitted) {
      sampleInto(row);  // every listed token has KV: the sampled token is written in the step
    }
    int32_t const position = row.materialized;
    if (mFullOracle) {
      oracleWrite(*mFullOracle, row.resident.slot, row.digests, position, position + 1);
    }
    if (mSwaOracle) {
      oracleWrite(*mSwaOracle, row.resident.slot, row.digests, position, position + 1);
    }
    row.materialized = position + 1;
    if (req.contract == DecodingTokenStateContract::kCommittedPlusLookahead) {
      sampleInto(row);
    }
  }
  if (mRecurrentOracle) {
    mRecurrentOracle->write(row.resident.slot, row.digests, row.materialized);
  }
  writeLength(rowIndex, row.materialized);
  row.decoded = true;
}

/// The engine's KV writes of one row through the device rows. When the step's flush was
/// forgotten (mStaleRows) a position whose device entry is still empty cannot be written (the
/// oracle throws mkv::Error); the step's writes are made again after the flush.
void Lifecycle::oracleWrite(testing::KvOracle& oracle, CacheSlot slot,
                            testing::PrefixDigests const& digests, int32_t begin, int32_t end) {
  if (!mStaleRows) {
    oracle.write(slot, digests, begin, end);
    return;
  }
  try {
    oracle.write(slot, digests, begin, end);
  } catch (Error const&) {
  }
}

void Lifecycle::verifyRow(Row const& row) {
  if (!row.bound) {
    return;
  }
  testing::OracleReport report;
  if (coordinatorBackend()) {
    report = mFullOracle->verify(row.resident.slot, row.digests, 0, row.materialized);
    if (report.ok() && slidingReuse()) {  // the sliding half: the window, as on bounded SWA
      int32_t const windowBegin = std::min(std::max(0, row.endpoint - mWindow), row.materialized);
      report = mSwaOracle->verify(row.resident.slot, row.digests, windowBegin, row.materialized);
    }
  } else {
    // The window of the endpoint the backend keeps, clipped to what is materialised: with a
    // window of 1 and a sampled token listed but not yet written, the window starts past the
    // last written position and nothing is checkable yet.
    int32_t const windowBegin = std::min(std::max(0, row.endpoint - mWindow), row.materialized);
    report = mSwaOracle->verify(row.resident.slot, row.digests, windowBegin, row.materialized);
    if (report.ok() && mFullOracle) {
      report = mFullOracle->verify(row.resident.slot, row.digests, 0, row.materialized);
    }
  }
  mStats.oraclePositions += report.positionsChecked;
  expectf(report.ok(), "KV oracle, slot {}: {}", row.resident.slot, report.firstMismatch);
  if (mRecurrentOracle) {
    testing::OracleReport const state =
        mRecurrentOracle->verify(row.resident.slot, row.digests, row.materialized);
    ++mStats.recurrentChecks;
    expectf(state.ok(), "recurrent oracle, slot {} after {} tokens: {}", row.resident.slot,
            row.materialized, state.firstMismatch);
  }
  if (row.paired && row.drafted > 0) {
    testing::OracleReport const draft =
        mDraftOracle->verify(row.resident.slot, row.draft, 0, row.drafted);
    mStats.draftOraclePositions += draft.positionsChecked;
    expectf(draft.ok(), "draft KV oracle, slot {}: {}", row.resident.slot, draft.firstMismatch);
  }
}

}  // namespace mkv::fuzz::lifecycle
