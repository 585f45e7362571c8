// BlockReuseMode and PairedDraftMode: requests that reuse full KV blocks (block_reuse_mode.h).

#include "context_cache/block_reuse_mode.h"

#include <algorithm>

namespace mkv::detail {

// ---------------------------------------------------------------- BlockReuseMode

BlockReuseMode::BlockReuseMode(CoordinatorParts const& parts, RowLane base)
    : RequestMode(parts, {base}, ReuseMode::kVanilla, CommonLengths::kNone) {}

void BlockReuseMode::publishPrefill(CoordinatorRequest& req) const {
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    if (!req.sequences[row].joined) {
      continue;  // a founder whose prefill goes on in chunks: published when it finalises
    }
    ++mParts.counters.prefillPublications;
    publishBlocks(req, row, req.sequences[row].committed);
  }
}

bool BlockReuseMode::growLease(CacheRequestLease& lease, LaneCounts const& pages) const {
  return mParts.manager.growBasePages(lease, pages[0]);
}

bool BlockReuseMode::stageCompleted(CoordinatorRequest& req,
                                    std::span<uint8_t const> completed) const {
  for (std::size_t row = 0; row < completed.size(); ++row) {
    if (completed[row] != 0) {
      ++mParts.counters.decodePublications;
      publishBlocks(req, row, req.sequences[row].committed);
    }
  }
  return false;
}

// ---------------------------------------------------------------- PairedDraftMode

PairedDraftMode::PairedDraftMode(CoordinatorParts const& parts, std::vector<RowLane> lanes,
                                 CommonLengths commonLengths)
    : RequestMode(parts, std::move(lanes), ReuseMode::kSpec, commonLengths) {}

namespace {

/// The row's prompt endpoint waits for its draft initialisation, which the runtime enqueues after
/// the call that froze it.
void freezePrefill(CoordinatorRequest& req, CoordinatorSequence& sequence) {
  sequence.frozenPrefill = sequence.committed;
  sequence.endpointFrozen = true;
  req.draftInitPending = true;
}

}  // namespace

void PairedDraftMode::publishJoinerPrefill(CoordinatorRequest& req, std::size_t row) const {
  CoordinatorSequence& joiner = req.sequences[row];
  joiner.common = joiner.committed;  // the draft initialisation writes the whole prompt
  freezePrefill(req, joiner);
}

void PairedDraftMode::publishPrefill(CoordinatorRequest& req) const {
  for (auto& sequence : req.sequences) {
    if (sequence.joined) {  // a founder whose prefill goes on in chunks freezes when it finalises
      freezePrefill(req, sequence);
    }
  }
}

void PairedDraftMode::publishFrozenPrefill(CoordinatorRequest& req) const {
  req.draftInitPending = false;
  for (std::size_t row = 0; row < req.sequences.size(); ++row) {
    CoordinatorSequence& sequence = req.sequences[row];
    if (!sequence.endpointFrozen) {
      continue;  // published already (a row of an earlier freeze)
    }
    sequence.endpointFrozen = false;
    ++mParts.counters.prefillPublications;
    publishBlocks(req, row, std::min(sequence.frozenPrefill, sequence.common),
                  &mParts.counters.specPairPublications);
  }
}

void PairedDraftMode::updateCommonLengths(CoordinatorRequest& req,
                                          std::span<ContextCacheSequenceAdvance const> advances,
                                          std::span<int32_t const> lengths) const {
  advanceCommonLengths(req, advances, lengths);
}

bool PairedDraftMode::growLease(CacheRequestLease& lease, LaneCounts const& pages) const {
  return mParts.manager.growSpecPages(lease, pages[0], pages[1]);
}

bool PairedDraftMode::stageCompleted(CoordinatorRequest& req,
                                     std::span<uint8_t const> completed) const {
  for (std::size_t row = 0; row < completed.size(); ++row) {
    if (completed[row] != 0) {
      ++mParts.counters.decodePublications;
      publishBlocks(req, row, req.sequences[row].common, &mParts.counters.specPairPublications);
    }
  }
  return false;
}

void advanceCommonLengths(CoordinatorRequest& req,
                          std::span<ContextCacheSequenceAdvance const> advances,
                          std::span<int32_t const> lengths) {
  for (std::size_t row = 0; row < advances.size(); ++row) {
    if (!isHold(advances[row])) {
      CoordinatorSequence& sequence = req.sequences[row];
      sequence.common = lengths.empty() ? sequence.committed : lengths[row];
    }
  }
}

}  // namespace mkv::detail
