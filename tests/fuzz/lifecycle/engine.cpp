/// \file engine.cpp
/// The engine side of the lifecycle: prompts, the runtime's view of a request, KV written and
/// verified through the oracles, KV lengths, sampled tokens.

#include <algorithm>

#include "fuzz/lifecycle/lifecycle.h"

namespace mkv::fuzz::lifecycle {

std::vector<int32_t> Lifecycle::makePrompt(int32_t tokens) {
  int32_t const family = mIn.below(4);
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

void Lifecycle::setActiveBatch(int32_t batch) {
  for (KVCachePool* pool : mLengthPools) {
    pool->setActiveBatchSize(batch);
  }
}

/// The engine's prefill of one bound row: the reused prefix must already hold this prefix's
/// KV; the rest is written (SWA: only the retained window; full identity layers: all of it).
void Lifecycle::executePrefill(Row& row, int32_t rowIndex) {
  auto const length = static_cast<int32_t>(row.prompt.size());
  if (coordinatorBackend()) {
    if (row.start > 0) {
      testing::OracleReport const reused =
          mFullOracle->verify(row.resident.slot, row.digests, 0, row.start);
      mStats.oraclePositions += reused.positionsChecked;
      expectf(reused.ok(), "reused prefix of slot {} ({} tokens): {}", row.resident.slot, row.start,
              reused.firstMismatch);
    }
    mFullOracle->write(row.resident.slot, row.digests, row.start, length);
  } else {
    mSwaOracle->write(row.resident.slot, row.digests, std::max(0, length - mWindow), length);
    if (mFullOracle) {
      mFullOracle->write(row.resident.slot, row.digests, 0, length);
    }
  }
  row.materialized = length;
  writeLength(rowIndex, length);
}

void Lifecycle::sampleInto(Row& row) {
  int32_t const token = sampleToken(row.digests.at(row.digests.size() - 1));
  row.generated.push_back(token);
  row.digests.extendTokens(std::span<int32_t const>(&token, 1));
}

/// The engine's decode of one running row: writes the KV of position `materialized`.
void Lifecycle::executeDecode(Req& req, Row& row, int32_t rowIndex) {
  if (req.contract == DecodingTokenStateContract::kFullyCommitted) {
    sampleInto(row);  // every listed token has KV: the sampled token is written in the step
  }
  int32_t const position = row.materialized;
  if (mFullOracle) {
    mFullOracle->write(row.resident.slot, row.digests, position, position + 1);
  }
  if (mSwaOracle) {
    mSwaOracle->write(row.resident.slot, row.digests, position, position + 1);
  }
  row.materialized = position + 1;
  writeLength(rowIndex, row.materialized);
  if (req.contract == DecodingTokenStateContract::kCommittedPlusLookahead) {
    sampleInto(row);
  }
  row.decoded = true;
}

void Lifecycle::verifyRow(Row const& row) {
  if (!row.bound) {
    return;
  }
  testing::OracleReport report;
  if (coordinatorBackend()) {
    report = mFullOracle->verify(row.resident.slot, row.digests, 0, row.materialized);
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
}

}  // namespace mkv::fuzz::lifecycle
