// RequestMode: what the modes share (request_mode.h), and the choice of a deployment's modes.

#include "context_cache/request_mode.h"

#include <spdlog/spdlog.h>

#include <new>
#include <optional>

#include "context_cache/block_reuse_mode.h"
#include "context_cache/coordinator_host_tier.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/hybrid_mtp_mode.h"
#include "core/check.h"
#include "mkv/logging.h"

namespace mkv::detail {

RequestMode::RequestMode(CoordinatorParts const& parts, std::vector<RowLane> lanes,
                         ReuseMode lookupMode, CommonLengths commonLengths)
    : mParts(parts),
      mLanes(std::move(lanes)),
      mLookupMode(lookupMode),
      mCommonLengths(commonLengths) {
  MKV_ASSERT(mLanes.size() <= kMaxRowLanes, "{} row lanes", mLanes.size());
}

void RequestMode::validateCommonLengths(char const* call, std::size_t batch,
                                        std::span<int32_t const> lengths) const {
  detail::validateCommonLengths(call, speculativeRounds(), batch, lengths,
                                mCommonLengths == CommonLengths::kRequired);
}

void RequestMode::bindPrefill(CoordinatorRequest& req) const { rows().bindPrefill(req); }

void RequestMode::bindJoiner(CoordinatorRequest& req) const {
  CoordinatorSequence const& joiner = req.sequences.back();
  rows().bindJoiner(joiner.resident.slot, joiner.lease);
}

void RequestMode::publishChunk(CoordinatorRequest& req, std::size_t row) const {
  publishBlocks(req, row, req.sequences[row].committed, nullptr, Publication::kChunk);
}

void RequestMode::publishJoinerPrefill(CoordinatorRequest& req, std::size_t row) const {
  ++mParts.counters.prefillPublications;
  publishBlocks(req, row, req.sequences[row].committed);
}

void RequestMode::publishBlocks(CoordinatorRequest& req, std::size_t row, int32_t length,
                                uint64_t* attempts, Publication kind) const {
  CoordinatorSequence& sequence = req.sequences[row];
  if (sequence.policy == ContextCacheLookupPolicy::kBypass) {
    return;
  }
  int32_t const pageSize = mParts.manager.pageSize();
  int32_t const blocks = length / pageSize;
  if (blocks <= sequence.publishedBlocks) {
    if (kind == Publication::kLasting) {
      mParts.manager.settlePublications(sequence.lease);
    }
    return;
  }
  // A replayed spec hit publishes once its state covers the path it replayed into again.
  std::optional<SpecReplayDependency> const& dependency = sequence.lease.replayDependency();
  if (dependency && blocks < dependency->pathBlockCount) {
    return;
  }
  if (attempts != nullptr) {
    ++*attempts;
  }
  mParts.injectFault(FaultSite::kPublication);
  PromptView const prefix = prefixOf(sequence, blocks * pageSize);
  // Publication records what the sequence already computed; the completion it belongs to has
  // been applied. Out of host memory, the blocks stay unpublished (the manager rolls the attempt
  // back) and a later completion point of the sequence may publish them.
  try {
    PromptBlocks const digests = hashPromptBlocks(prefix, pageSize);
    PublishResult const published = mParts.manager.publish(sequence.lease, digests, length, kind);
    sequence.publishedBlocks =
        std::max(sequence.publishedBlocks, published.publishedFullBlockCount);
    mParts.hostTier.move("ContextCacheCoordinator: publication");  // the record limit may evict
  } catch (std::bad_alloc const&) {
    logger()->warn(
        "ContextCacheCoordinator: out of host memory; {} blocks of request {} row {} "
        "were not published",
        blocks - sequence.publishedBlocks, req.id, row);
  }
}

namespace {

RowLane baseLane(ContextCachePhysicalResources const& resources) {
  return RowLane{resources.basePageTable, resources.basePool, LanePages::kBase, 0, "base"};
}

RowLane draftLane(ContextCachePhysicalResources const& resources, int32_t restoreLag) {
  return RowLane{resources.draftPageTable, resources.draftPool, LanePages::kDraft, restoreLag,
                 "draft"};
}

}  // namespace

RequestModes makeRequestModes(ContextCacheDeploymentProfile const& profile,
                              ContextCachePhysicalResources const& resources,
                              CoordinatorParts const& parts) {
  RequestModes modes;
  switch (profile.baseStateKind) {
    case BaseStateKind::kAttentionOnly:
      modes.plain = std::make_unique<BlockReuseMode>(parts, baseLane(resources));
      modes.plainJoinable = true;  // a vanilla row on a speculative deployment has no draft row
      if (!profile.speculative) {
        break;
      }
      modes.speculativeJoinable = true;
      if (profile.speculative->pagedSpecState) {
        modes.speculative = std::make_unique<PairedDraftMode>(
            parts, std::vector<RowLane>{baseLane(resources), draftLane(resources, 0)},
            CommonLengths::kRequired);
      } else {
        modes.speculative = std::make_unique<PairedDraftMode>(
            parts, std::vector<RowLane>{baseLane(resources)}, CommonLengths::kOptional);
      }
      break;
    case BaseStateKind::kHybrid:
      modes.plain = std::make_unique<CheckpointMode>(
          parts, std::vector<RowLane>{baseLane(resources)}, ReuseMode::kHybrid);
      modes.plainJoinable = true;
      if (profile.speculative) {  // Hybrid-MTP (validateDeployment: a paged draft)
        auto mtp = std::make_unique<HybridMtpMode>(
            parts, std::vector<RowLane>{baseLane(resources), draftLane(resources, 1)});
        modes.hybridMtp = mtp.get();
        modes.speculative = std::move(mtp);
        modes.speculativeJoinable = true;  // a joiner restores and publishes as a founder does
      }
      break;
    case BaseStateKind::kPureRecurrent:
      modes.plain =
          std::make_unique<CheckpointMode>(parts, std::vector<RowLane>{}, ReuseMode::kHybrid);
      break;
  }
  return modes;
}

}  // namespace mkv::detail
