#pragma once
/// \file rank_agreement.h
/// A runtime's side of a tensor-parallel deployment (mkv/tensor_parallel.h): the rank's share of
/// the config, and the agreement its completion points and fault sites go through. Not installed.

#include <cstdint>
#include <memory>

#include "mkv/fault_site.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/stream.h"
#include "mkv/tensor_parallel.h"

namespace mkv::detail {

class DeviceWriteQueue;

/// Throws mkv::Error naming `call` and the field for a tensor-parallel config the runtime cannot
/// build: size < 1, a rank outside [0, size), no agreement with size > 1, heads, draft heads or
/// recurrent bytes that kSplitHeads cannot divide by size, or a remote tier (whose lookups find
/// what another process saved meanwhile, which differs per rank) with size > 1.
void validateTensorParallel(KVCacheRuntimeConfig const& config, char const* call);

/// The config rank `config.tensorParallel.rank` builds its runtime from: with kSplitHeads the
/// model's heads (and the draft's) and recurrent bytes divided by size, and the snapshot budgets
/// cut to the same slot counts as the whole deployment's; KV events recorded on rank 0 only (the
/// deployment publishes them once). Size 1: `config` unchanged.
KVCacheRuntimeConfig rankShare(KVCacheRuntimeConfig const& config);

/// The agreement of one rank: each call of agree() is one call of the engine's RankAgreement with
/// this rank's outcome and decision digest (the digest of everything the rank's DeviceWriteQueue
/// was given).
class RankAgreementPoint {
 public:
  explicit RankAgreementPoint(RankAgreement agreement) : mAgreement(std::move(agreement)) {}
  /// The queue whose decisionDigest() each agreement sends (borrowed; set once it exists).
  void setDecisions(DeviceWriteQueue const* queue) noexcept { mDecisions = queue; }
  /// Whether the step succeeds on every rank: `succeeded` here, every other rank's too, and every
  /// digest equal. Never throws: an agreement that throws counts as a failed one (logged). Once
  /// the digests differed (every rank saw it in the same agreement, which failed the step and
  /// poisoned the backend) the rank sends digest 0: the ranks then agree on success only, so that
  /// their shutdown can drain what the failure quarantined.
  bool agree(bool succeeded) noexcept;
  TensorParallelStats stats() const noexcept { return mStats; }

 private:
  RankAgreement mAgreement;
  DeviceWriteQueue const* mDecisions = nullptr;
  TensorParallelStats mStats;
  bool mDiverged = false;
};

/// `synchronizer`, then the agreement: a synchronisation that succeeded here returns
/// cudaErrorUnknown when another rank's failed or the decisions diverged, so every rank poisons
/// the same request at the same completion point.
StreamSynchronizer withRankAgreement(StreamSynchronizer synchronizer,
                                     std::shared_ptr<RankAgreementPoint> point);
/// `faults`, then the agreement at every site: a fault injected on one rank fails the step on
/// every rank (the others with cudaErrorUnknown). Empty `faults` stays empty (no agreement at the
/// fault sites: a real launch failure is a lost context, which ends the deployment).
FaultInjector withRankAgreement(FaultInjector faults, std::shared_ptr<RankAgreementPoint> point);

}  // namespace mkv::detail
