#pragma once
/// \file tensor_parallel.h
/// Tensor-parallel deployments: one KVCacheRuntime per rank, every rank driven with the same
/// calls, so that every rank makes the same decisions over its own share of the KV
/// (docs/architecture.md, "Tensor parallelism").

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

namespace mkv {

/// How a rank's pools hold the model's KV heads.
enum class KvHeadLayout : uint8_t {
  /// Each rank holds numKVHeads / size heads of every layer (GQA split by tensor parallelism; the
  /// paged draft's heads and the recurrent state and conv rows are split the same way).
  kSplitHeads,
  /// Every rank holds the same bytes, whole (MLA-style latent KV, replicated on each rank).
  kReplicated,
};

/// One rank's outcome at an agreement point: whether its step succeeded, and the digest of every
/// page-table entry and KV length its runtime has written so far (its decisions).
struct RankOutcome {
  bool succeeded = true;
  uint64_t decisionDigest = 0;
};

/// What the ranks agreed on.
struct AgreedOutcome {
  bool allSucceeded = true;  ///< every rank's step succeeded
  bool digestsAgree = true;  ///< every rank's decision digest is the same
};

/// The collective an engine provides over its tensor-parallel group (a gloo or NCCL all-reduce,
/// MPI): every rank calls it at the same points, in the same order, with its own outcome, and it
/// returns to every rank the same AgreedOutcome once every rank has called it (allSucceeded: the
/// minimum of the succeeded flags; digestsAgree: the minimum and the maximum of the digests are
/// equal). It may throw, or return allSucceeded = false, when the group is broken; the runtime
/// then fails the step on this rank as a failed synchronisation.
using RankAgreement = std::function<AgreedOutcome(RankOutcome const&)>;

/// KVCacheRuntimeConfig::tensorParallel. With size 1 (the default) a runtime is what it always
/// was; nothing below is consulted.
struct TensorParallelConfig {
  int32_t size = 1;  ///< ranks of the deployment, >= 1
  int32_t rank = 0;  ///< this runtime's rank, in [0, size)
  KvHeadLayout kvHeads = KvHeadLayout::kSplitHeads;
  /// Required when size > 1. Called at every completion point (after the runtime's stream
  /// synchronisation) and, when KVCacheRuntimeConfig::faults is set, at every fault site.
  RankAgreement agreement;
};

/// What a runtime's agreement did (KVCacheRuntime::tensorParallelStats()).
struct TensorParallelStats {
  int64_t agreements = 0;       ///< calls of the agreement
  int64_t failedElsewhere = 0;  ///< steps that succeeded here and failed because a rank failed
  int64_t divergences = 0;      ///< agreements whose digests differed (each failed the step)
};

/// An in-process RankAgreement for `size` ranks driven by as many threads: the tests', the
/// reference engine's and mkv-replay --tensor-parallel's. A rank that waits longer than `timeout`
/// for the others breaks the group: that call and every later one of every rank returns
/// allSucceeded = false (so a rank that stopped calling poisons the others instead of hanging
/// them). Thread-safe.
class LocalRankGroup {
 public:
  explicit LocalRankGroup(int32_t size,
                          std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~LocalRankGroup();
  LocalRankGroup(LocalRankGroup const&) = delete;
  LocalRankGroup& operator=(LocalRankGroup const&) = delete;

  /// The agreement of rank `rank` (throws mkv::Error naming this call outside [0, size)). The
  /// function keeps the group alive.
  RankAgreement agreement(int32_t rank) const;
  int32_t size() const noexcept;
  /// Agreements completed by every rank.
  int64_t rounds() const;
  /// Whether a rank timed out (every later agreement fails).
  bool broken() const;

 private:
  struct State;
  std::shared_ptr<State> mState;
};

}  // namespace mkv
