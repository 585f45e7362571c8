// ReferenceEngine: speculative decoding (docs/replay.md, "Speculative decoding"): the draft's
// initialisation, verification rounds, common lengths and the draft's oracle.

#include <algorithm>

#include "core/check.h"
#include "mkv/testing/reference_engine.h"
#include "testing/oracle_bytes.h"
#include "testing/oracle_stepper.h"
#include "testing/reference_engine_rows.h"

namespace mkv::testing {

bool ReferenceEngine::pairsDraft() const noexcept { return mSpecWidth > 0 && mSteps->hasDraft(); }

uint64_t ReferenceEngine::draftRowDigest(uint64_t nextPrefixDigest) const noexcept {
  // A draft row is never the base row of any prefix: a salted digest of the prefix one longer.
  return oracle::seedMix(nextPrefixDigest ^ 0xD4AF7D4AF7D4AF70ULL);
}

void ReferenceEngine::commonLengths(Run& run, bool speculative) {
  mCommonLengths.clear();
  // Hybrid-MTP: the library derives the common lengths from the committed ones.
  for (std::size_t i = 0; speculative && !mHybridMtp && i < run.rows.size(); ++i) {
    mCommonLengths.push_back(run.rows[i].draftMaterialized);
  }
}

void ReferenceEngine::verifyDraft(Row& row, int32_t begin, int32_t end, bool full) {
  if (mOptions.verify == VerifyMode::kNone || begin >= end) {
    return;
  }
  int32_t const slot = row.resident.slot;
  if (full || mOptions.verify == VerifyMode::kAll) {
    mSteps->verify(oracle::OracleStepper::kDraft, slot, begin, end, oracle::kOracleAttention);
    return;
  }
  mSteps->verify(oracle::OracleStepper::kDraft, slot, end - 1, end, oracle::kOracleAttention);
  for (int i = 0; i < 2; ++i) {
    mRandom = oracle::seedMix(mRandom + 0x9E37);
    auto const p = begin + static_cast<int32_t>(mRandom % static_cast<uint64_t>(end - begin));
    mSteps->verify(oracle::OracleStepper::kDraft, slot, p, p + 1, oracle::kOracleAttention);
  }
}

void ReferenceEngine::executeDraftPrefill(Row& row, int32_t start) {
  // Draft row p depends on token p + 1: the last prompt row needs the lookahead token, which the
  // engine samples from the base's last prompt row (the same token sampleAfter appends).
  auto const promptLength = static_cast<int32_t>(row.spec.prompt.size());
  uint64_t const lookahead = static_cast<uint32_t>(sampleToken(row.digests.at(promptLength - 1)));
  row.digests.extend(std::span<uint64_t const>(&lookahead, 1));
  mDraftDigests.resize(static_cast<std::size_t>(promptLength));
  for (int32_t p = 0; p < promptLength; ++p) {
    mDraftDigests[static_cast<std::size_t>(p)] = draftRowDigest(row.digests.at(p + 1));
  }
  row.digests.truncate(promptLength);
  int32_t const slot = row.resident.slot;
  int64_t const staged = mSteps->stage(slot, 0, mDraftDigests, oracle::OracleStepper::kDraft);
  // Hybrid-MTP: the draft row of the boundary token (R - 1) depends on token R, which the
  // producer of the checkpoint may not share; the library resumes the draft one row earlier.
  int32_t const reused = mHybridMtp ? std::max(0, start - 1) : start;
  // The paired path's draft rows must be exactly this prefix's (the replayed last page of the
  // path is not among them: its last row depends on a token the producer may not share).
  if (reused > 0 && mOptions.verify != VerifyMode::kNone) {
    mSteps->verify(oracle::OracleStepper::kDraft, row.resident.slot, 0, reused,
                   oracle::kOracleReusedPrefix);
  }
  mSteps->write(oracle::OracleStepper::kDraft, slot, reused, promptLength, staged + reused);
  row.draftMaterialized = promptLength;
  mStats.draftReusedTokens += reused;
  verifyDraft(row, 0, promptLength, /*full=*/false);
}

int32_t ReferenceEngine::proposeRound(Row& row, std::vector<int32_t> const& generated) {
  int32_t const width = mSpecWidth;
  int32_t const m = row.materialized;  // base length; the lookahead token sits at m
  // The proposals: the first `accepted` are the base's own tokens, the next one differs from it,
  // the rest follow the (wrong) proposed prefix. The digests become the proposed prefix's.
  uint64_t const lookahead = static_cast<uint32_t>(generated.back());
  row.digests.extend(std::span<uint64_t const>(&lookahead, 1));
  auto const accepted = static_cast<int32_t>(
      oracle::seedMix(row.digests.at(m) ^ oracle::seedMix(mOptions.seed + 0xACCE)) %
      static_cast<uint64_t>(width + 1));
  row.pendingTokens.clear();
  // A running row has sampled fewer than maxNewTokens tokens.
  std::size_t const room = static_cast<std::size_t>(row.spec.maxNewTokens) - generated.size();
  bool done = false;
  auto take = [&](int32_t token) {
    if (!done && row.pendingTokens.size() < room) {
      row.pendingTokens.push_back(token);
      done = token == kEndOfSequence || row.pendingTokens.size() >= room;
    }
  };
  for (int32_t j = 1; j <= width; ++j) {
    int32_t const own = sampleToken(row.digests.at(m + j - 1));
    int32_t proposal = own;
    if (j == accepted + 1) {
      proposal = own == kEndOfSequence ? 1000 : 1000 + (own - 1000 + 1) % 30000;
    }
    if (j <= accepted) {
      take(proposal);
    }
    uint64_t const key = static_cast<uint32_t>(proposal);
    row.digests.extend(std::span<uint64_t const>(&key, 1));
  }
  take(sampleToken(row.digests.at(m + accepted)));  // the bonus token (the base's own)
  return accepted;
}

void ReferenceEngine::runDraftSteps(Row& row, int32_t accepted, int32_t committed) {
  int32_t const m = row.materialized;
  int32_t const draftFrom = row.draftMaterialized;
  if (!pairsDraft()) {
    row.draftMaterialized = m + committed;  // the draft reads the base's KV
    return;
  }
  int32_t const draftEnd = m + mSpecWidth - 1;
  mDraftDigests.resize(static_cast<std::size_t>(std::max(0, draftEnd - draftFrom)));
  for (int32_t p = draftFrom; p < draftEnd; ++p) {
    mDraftDigests[static_cast<std::size_t>(p - draftFrom)] = draftRowDigest(row.digests.at(p + 1));
  }
  int32_t const slot = row.resident.slot;
  int64_t const draftStaged =
      mSteps->stage(slot, draftFrom, mDraftDigests, oracle::OracleStepper::kDraft);
  mSteps->write(oracle::OracleStepper::kDraft, slot, draftFrom, draftEnd, draftStaged);
  row.draftMaterialized = std::min({draftEnd, m + accepted, m + committed});
}

void ReferenceEngine::executeRound(Row& row, std::vector<int32_t> const& generated) {
  int32_t const width = mSpecWidth;
  int32_t const m = row.materialized;
  int32_t const accepted = proposeRound(row, generated);
  auto const n = static_cast<int32_t>(row.pendingTokens.size());
  // The base verifies the lookahead and every proposal: positions [m, m + K].
  int32_t const slot = row.resident.slot;
  int64_t const staged =
      mSteps->stage(slot, m, row.digests.values().subspan(static_cast<std::size_t>(m)));
  mSteps->write(oracle::OracleStepper::kFull, slot, m, m + width + 1, staged);
  // The draft catches up from its length and runs its proposal steps: rows [D, m + K - 1).
  runDraftSteps(row, accepted, n);
  // Commit: the lookahead and the accepted proposals have KV; the last taken token is the new
  // lookahead.
  row.digests.truncate(m + n);
  executeRecurrent(row, m, m + n);  // the recurrent layers run over the committed tokens
  row.materialized = m + n;
  ++mStats.speculativeRounds;
  mStats.proposedTokens += width;
  mStats.acceptedTokens += std::min(accepted, n);
  if (pairsDraft()) {
    verifyDraft(row, 0, row.draftMaterialized, /*full=*/false);
  }
}

}  // namespace mkv::testing
