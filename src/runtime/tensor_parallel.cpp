/// Tensor-parallel deployments (mkv/tensor_parallel.h): the in-process rank group and a rank's
/// agreement (runtime/rank_agreement.h).
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/faults.h"
#include "mkv/logging.h"
#include "resources/device_write_queue.h"
#include "runtime/rank_agreement.h"

namespace mkv {

// ---- LocalRankGroup -------------------------------------------------------------------------

struct LocalRankGroup::State {
  explicit State(int32_t ranks, std::chrono::milliseconds wait)
      : size(ranks), timeout(wait), arrived(static_cast<std::size_t>(ranks)) {}

  /// One round: the last rank to arrive computes the outcome and wakes the others.
  AgreedOutcome agree(int32_t rank, RankOutcome const& outcome) {
    std::unique_lock lock(mutex);
    if (broken) {
      return {false, true};
    }
    int64_t const round = rounds;
    arrived[static_cast<std::size_t>(rank)] = outcome;
    if (++present < size) {
      bool const done = cv.wait_for(lock, timeout, [&] { return rounds != round || broken; });
      if (!done) {
        broken = true;  // a rank stopped calling: fail everyone from now on
        cv.notify_all();
        logger()->error(
            "LocalRankGroup: rank {} waited {} ms for the other ranks in round {}; "
            "the group is broken",
            rank, timeout.count(), round);
      }
      return broken && rounds == round ? AgreedOutcome{false, true} : last;
    }
    AgreedOutcome agreed;
    for (RankOutcome const& each : arrived) {
      agreed.allSucceeded = agreed.allSucceeded && each.succeeded;
      agreed.digestsAgree = agreed.digestsAgree && each.decisionDigest == arrived[0].decisionDigest;
    }
    last = agreed;
    present = 0;
    ++rounds;
    cv.notify_all();
    return agreed;
  }

  int32_t const size;
  std::chrono::milliseconds const timeout;
  mutable std::mutex mutex;
  std::condition_variable cv;
  std::vector<RankOutcome> arrived;
  int32_t present = 0;
  int64_t rounds = 0;
  AgreedOutcome last;
  bool broken = false;
};

LocalRankGroup::LocalRankGroup(int32_t size, std::chrono::milliseconds timeout) {
  MKV_REQUIRE(size >= 1, "LocalRankGroup", "size must be >= 1, got {}", size);
  MKV_REQUIRE(timeout.count() > 0, "LocalRankGroup", "timeout must be > 0 ms, got {}",
              timeout.count());
  mState = std::make_shared<State>(size, timeout);
}

LocalRankGroup::~LocalRankGroup() = default;

RankAgreement LocalRankGroup::agreement(int32_t rank) const {
  MKV_REQUIRE(rank >= 0 && rank < mState->size, "LocalRankGroup::agreement",
              "rank must be in [0, {}), got {}", mState->size, rank);
  return [state = mState, rank](RankOutcome const& outcome) { return state->agree(rank, outcome); };
}

int32_t LocalRankGroup::size() const noexcept { return mState->size; }

int64_t LocalRankGroup::rounds() const {
  std::lock_guard lock(mState->mutex);
  return mState->rounds;
}

bool LocalRankGroup::broken() const {
  std::lock_guard lock(mState->mutex);
  return mState->broken;
}

namespace detail {

// ---- a rank's share of the config -----------------------------------------------------------

void validateTensorParallel(KVCacheRuntimeConfig const& config, char const* call) {
  TensorParallelConfig const& tp = config.tensorParallel;
  MKV_REQUIRE(tp.size >= 1, call, "tensorParallel.size must be >= 1, got {}", tp.size);
  MKV_REQUIRE(tp.rank >= 0 && tp.rank < tp.size, call,
              "tensorParallel.rank must be in [0, {}), got {}", tp.size, tp.rank);
  MKV_REQUIRE(tp.kvHeads == KvHeadLayout::kSplitHeads || tp.kvHeads == KvHeadLayout::kReplicated,
              call, "tensorParallel.kvHeads {} out of range", static_cast<int>(tp.kvHeads));
  if (tp.size == 1) {
    return;
  }
  MKV_REQUIRE(static_cast<bool>(tp.agreement), call,
              "tensorParallel.size {} needs tensorParallel.agreement (the group's collective)",
              tp.size);
  MKV_REQUIRE(!config.contextCache.remoteTier, call,
              "tensorParallel.size {}: a remote tier is not supported (its lookups find what "
              "other processes saved meanwhile, which differs per rank)",
              tp.size);
  if (tp.kvHeads == KvHeadLayout::kReplicated) {
    return;
  }
  KVCacheModelConfig const& model = config.model;
  MKV_REQUIRE(model.numKVHeads % tp.size == 0, call,
              "kSplitHeads needs model.numKVHeads divisible by tensorParallel.size {}, got {}",
              tp.size, model.numKVHeads);
  MKV_REQUIRE(!config.speculative || !config.speculative->pagedDraft ||
                  config.speculative->numDraftKVHeads % tp.size == 0,
              call,
              "kSplitHeads needs speculative.numDraftKVHeads divisible by tensorParallel.size {}, "
              "got {}",
              tp.size, config.speculative ? config.speculative->numDraftKVHeads : 0);
  MKV_REQUIRE(model.recurrentStateBytes % tp.size == 0 && model.recurrentConvBytes % tp.size == 0,
              call,
              "kSplitHeads needs model.recurrentStateBytes and recurrentConvBytes divisible by "
              "tensorParallel.size {}, got {} and {}",
              tp.size, model.recurrentStateBytes, model.recurrentConvBytes);
}

KVCacheRuntimeConfig rankShare(KVCacheRuntimeConfig const& config) {
  TensorParallelConfig const& tp = config.tensorParallel;
  KVCacheRuntimeConfig share = config;
  if (tp.size == 1) {
    return share;
  }
  if (tp.kvHeads == KvHeadLayout::kSplitHeads) {
    KVCacheModelConfig const& model = config.model;
    share.model.numKVHeads /= tp.size;
    share.model.recurrentStateBytes /= tp.size;
    share.model.recurrentConvBytes /= tp.size;
    if (share.speculative && share.speculative->pagedDraft) {
      share.speculative->numDraftKVHeads /= tp.size;
    }
    // The snapshot budgets keep the whole deployment's slot counts (the same decisions as one
    // rank): a partial-KV slot splits like the pages (floor(floor(B / N) / (s / N)) =
    // floor(B / s)); a recurrent slot splits its state and conv rows, but a Hybrid-MTP slot's
    // boundary hidden row stays whole.
    ContextCacheConfig& cache = share.contextCache;
    cache.partialKvSnapshotPoolBytes /= tp.size;
    int64_t const recurrentBytes =
        int64_t{model.numRecurrentLayers} * (model.recurrentStateBytes + model.recurrentConvBytes);
    int64_t const hiddenBytes =
        model.numRecurrentLayers > 0 && config.speculative
            ? config.speculative->boundaryHiddenWidth *
                  static_cast<int64_t>(dataTypeSize(config.speculative->boundaryHiddenType))
            : 0;
    if (recurrentBytes + hiddenBytes > 0) {
      int64_t const slots = cache.recurrentSnapshotPoolBytes / (recurrentBytes + hiddenBytes);
      cache.recurrentSnapshotPoolBytes = slots * (recurrentBytes / tp.size + hiddenBytes);
    }
  }
  if (tp.rank != 0) {
    share.contextCache.eventQueueCapacity = 0;  // the deployment's events come from rank 0
  }
  return share;
}

// ---- a rank's agreement ---------------------------------------------------------------------

bool RankAgreementPoint::agree(bool succeeded) noexcept {
  RankOutcome local;
  local.succeeded = succeeded;
  local.decisionDigest = mDecisions != nullptr && !mDiverged ? mDecisions->decisionDigest() : 0;
  AgreedOutcome agreed{false, true};
  try {
    agreed = mAgreement(local);
  } catch (std::exception const& error) {
    logger()->error("tensor parallelism: the rank agreement threw: {}", error.what());
  } catch (...) {
    logger()->error("tensor parallelism: the rank agreement threw");
  }
  ++mStats.agreements;
  if (!agreed.digestsAgree) {
    ++mStats.divergences;
    mDiverged = true;  // every rank saw it: from now on all send 0 and agree on success only
    logger()->error(
        "tensor parallelism: the ranks' decisions diverged (this rank's digest {:#x}); "
        "the step fails on every rank",
        local.decisionDigest);
  }
  bool const all = agreed.allSucceeded && agreed.digestsAgree;
  if (succeeded && !all) {
    ++mStats.failedElsewhere;
  }
  return succeeded && all;
}

namespace {

/// Runs `step` (a synchronisation, a fault consult) and agrees on its status: a step that
/// succeeded here fails with cudaErrorUnknown when it failed on another rank (or the decisions
/// diverged); one that threw here is agreed as failed before its exception goes on.
template <typename Step>
cudaError_t agreedStatus(RankAgreementPoint& point, Step const& step) {
  cudaError_t status = cudaErrorUnknown;
  try {
    status = step();
  } catch (...) {
    point.agree(false);
    throw;
  }
  bool const everywhere = point.agree(status == cudaSuccess);
  return status != cudaSuccess ? status : everywhere ? cudaSuccess : cudaErrorUnknown;
}

}  // namespace

StreamSynchronizer withRankAgreement(StreamSynchronizer synchronizer,
                                     std::shared_ptr<RankAgreementPoint> point) {
  return [synchronizer = std::move(synchronizer),
          point = std::move(point)](cudaStream_t stream) -> cudaError_t {
    return agreedStatus(*point, [&] { return synchronizer(stream); });
  };
}

FaultInjector withRankAgreement(FaultInjector faults, std::shared_ptr<RankAgreementPoint> point) {
  if (!faults) {
    return faults;
  }
  return [faults = std::move(faults), point = std::move(point)](FaultSite site) -> cudaError_t {
    return agreedStatus(*point, [&] { return faults(site); });
  };
}

}  // namespace detail
}  // namespace mkv
