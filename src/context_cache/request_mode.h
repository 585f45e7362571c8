#pragma once
/// \file request_mode.h
/// What differs between the kinds of request a ContextCacheCoordinator serves (not installed).
/// The deployment decides, once at construction, which modes the coordinator has
/// (makeRequestModes: one for plain requests, one for speculative requests when the deployment
/// is speculative); admission gives each request one of them, and every lifecycle call of the
/// coordinator dispatches to it instead of testing the deployment again:
///
/// | mode             | deployment            | state reused                 | unit |
/// |------------------|-----------------------|------------------------------|-----------------------|
/// | BlockReuseMode   | attention-only        | full KV blocks               | block_reuse_mode.cpp
/// | | PairedDraftMode  | attention, speculative| base + draft blocks, paired  |
/// paired_draft_mode.cpp | | CheckpointMode   | hybrid, pure recurrent| exact checkpoints, points
/// | checkpoint_mode.cpp   | | HybridMtpMode    | hybrid, speculative   | Hybrid-MTP endpoints |
/// hybrid_mtp_mode.cpp   |
///
/// Sliding windows (coordinator_window.cpp) and the host tier (coordinator_host_tier.h) are parts
/// of a block-reuse deployment, not modes of their own. docs/architecture.md, "The request core".

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "context_cache/coordinator_paged_rows.h"
#include "context_cache/coordinator_request.h"
#include "core/faults.h"
#include "mkv/context_cache/context_cache_coordinator.h"

namespace mkv::detail {

class HostTierMover;
class HybridMtpMode;

/// The parts of its coordinator a request mode works on (borrowed from the coordinator, which
/// outlives its modes).
struct CoordinatorParts {
  ContextCacheConfig const& config;
  ContextCacheManager& manager;
  SnapshotStorage* snapshots;  ///< checkpoint deployments; null otherwise
  RecurrentStatePool* recurrent;
  DeviceWriteQueue& writes;
  cudaStream_t stream;
  ContextCacheCoordinatorCounters& counters;
  HostTierMover& hostTier;
  FaultInjector const& faults;

  /// Throws mkv::Error before the step at `site` when the coordinator's injector fails it.
  void injectFault(FaultSite site) const {
    detail::injectFault(faults, site, "ContextCacheCoordinator", /*nameSite=*/true);
  }
};

/// Which common state lengths a completion of the mode's requests takes.
enum class CommonLengths : uint8_t {
  kNone,      ///< plain requests: none
  kOptional,  ///< speculative without a paged draft (and Hybrid-MTP): none, or one per row
  kRequired,  ///< speculative with a paged draft: one per row
};

/// One kind of request: its rows, its lookups and what it publishes when. Stateless beyond the
/// coordinator's parts: the request's state lives in CoordinatorRequest.
class RequestMode {
 public:
  RequestMode(CoordinatorParts const& parts, std::vector<RowLane> lanes, ReuseMode lookupMode,
              CommonLengths commonLengths);
  virtual ~RequestMode() = default;
  RequestMode(RequestMode const&) = delete;
  RequestMode& operator=(RequestMode const&) = delete;

  /// The manager's reuse mode of this kind's lookups and publications.
  ReuseMode lookupMode() const noexcept { return mLookupMode; }
  /// The page tables this kind's rows write (none on a pure-recurrent deployment).
  PagedRows rows() const noexcept { return PagedRows(mLanes, mParts.writes, mParts.stream); }
  /// A speculative request: decode rounds accept a run of tokens, a prompt with media bypasses
  /// the cache, common state lengths may follow each completion.
  bool speculativeRounds() const noexcept { return mCommonLengths != CommonLengths::kNone; }
  /// Throws naming `call` unless `lengths` suits a completion of `batch` rows of this kind.
  void validateCommonLengths(char const* call, std::size_t batch,
                             std::span<int32_t const> lengths) const;

  /// preparePrefill: binds the rows, restores what the lease hit (checkpoints), and plans the
  /// captures the prefill makes (reuse points).
  virtual void bindPrefill(CoordinatorRequest& req) const;
  /// enqueuePrefillCaptures: the prompt-end captures of the prefill (checkpoint modes).
  virtual void enqueuePrefillCaptures(CoordinatorRequest& /*req*/) const {}

  // In-flight admission (a joiner: the newest row, admitted while the request executes).
  /// admitSequence: binds the joiner's row; checkpoint modes also restore the checkpoint its
  /// lease hit (or clear its recurrent row) and plan its reuse points.
  virtual void bindJoiner(CoordinatorRequest& req) const;
  /// completePrefillChunk, once `row`'s committed length reached the chunk's end: block modes
  /// publish its full blocks (a chunk publication, replaced by the row's next one); checkpoint
  /// modes enqueue a capture of the state at the chunk's end, committed when the row finalises.
  virtual void publishChunk(CoordinatorRequest& req, std::size_t row) const;
  /// finalizeSequenceAdmission, before the advance: checkpoint modes enqueue the prompt-end
  /// capture. True when a synchronisation must make the row's restores and captures terminal
  /// before publishJoinerPrefill. A throw leaves the row as it was.
  virtual bool stageJoinerPrefill(CoordinatorRequest& /*req*/, std::size_t /*row*/) const {
    return false;
  }
  /// finalizeSequenceAdmission, after the advance (and the synchronisation stageJoinerPrefill
  /// asked for): publishes the joiner's prefill (or, for a speculative request, freezes it until
  /// the joiner's draft initialisation completed).
  virtual void publishJoinerPrefill(CoordinatorRequest& req, std::size_t row) const;
  /// finalizePrefillPublication, after the advances were applied: publishes the prefill (or, for
  /// a speculative request, freezes it until the draft initialisation completed).
  virtual void publishPrefill(CoordinatorRequest& req) const = 0;
  /// A speculative request's frozen prompt endpoints (the rows whose endpoint waits), once their
  /// draft state is written.
  virtual void publishFrozenPrefill(CoordinatorRequest& /*req*/) const {}
  /// completeDecodeStep, after the advances: the common lengths of the rows that advanced.
  virtual void updateCommonLengths(CoordinatorRequest& /*req*/,
                                   std::span<ContextCacheSequenceAdvance const> /*advances*/,
                                   std::span<int32_t const> /*lengths*/) const {}
  /// prepareDecodeStep: grows `lease` by `pages` per lane; false when the pools cannot.
  virtual bool growLease(CacheRequestLease& lease, LaneCounts const& pages) const = 0;
  /// Publishes what the rows `completed` committed. True when captures were staged that a
  /// synchronisation must make terminal before commitStaged publishes them.
  virtual bool stageCompleted(CoordinatorRequest& req,
                              std::span<uint8_t const> completed) const = 0;
  /// Publishes the captures stageCompleted staged (after the synchronisation).
  virtual void commitStaged(CoordinatorRequest& /*req*/) const {}

  /// Publishes the full blocks of `row`'s first `length` tokens that are not published yet (block
  /// modes; an in-flight admission's chunk or finalisation); `attempts`, when given, counts each
  /// publication attempted. Out of host memory the blocks stay unpublished (logged). A chunk's
  /// publication (Publication::kChunk) is replaced by the row's next one; a lasting one with no
  /// new block keeps the pending chunk's record.
  void publishBlocks(CoordinatorRequest& req, std::size_t row, int32_t length,
                     uint64_t* attempts = nullptr, Publication kind = Publication::kLasting) const;

 protected:
  CoordinatorParts const& mParts;

 private:
  std::vector<RowLane> mLanes;
  ReuseMode mLookupMode;
  CommonLengths mCommonLengths;
};

/// The modes of one deployment.
struct RequestModes {
  std::unique_ptr<RequestMode> plain;
  std::unique_ptr<RequestMode> speculative;  ///< null: the deployment is not speculative
  /// `speculative` on a Hybrid-MTP deployment (its endpoint calls), else null.
  HybridMtpMode const* hybridMtp = nullptr;
  /// Whether requests of each kind admit sequences in flight: plain requests on deployments with
  /// attention (attention-only and hybrid, speculative or not), speculative requests on
  /// attention-only deployments (paired draft rows) and Hybrid-MTP ones (the engine restores a
  /// joiner's boundary hidden row and publishes its endpoint); never pure-recurrent deployments
  /// (no page table).
  bool plainJoinable = false;
  bool speculativeJoinable = false;

  /// Whether requests of `mode` (one of the above) admit sequences in flight.
  bool joinable(RequestMode const* mode) const noexcept {
    return mode == plain.get() ? plainJoinable : speculativeJoinable;
  }
};

/// The modes `profile` serves over `resources` (validated by validateDeployment).
RequestModes makeRequestModes(ContextCacheDeploymentProfile const& profile,
                              ContextCachePhysicalResources const& resources,
                              CoordinatorParts const& parts);

}  // namespace mkv::detail
