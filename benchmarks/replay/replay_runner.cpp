#include "replay_runner.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <thread>
#include <unordered_map>

#include "context_cache/context_cache_manager.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/host_kv_tier.h"
#include "mkv/kernels.h"
#include "mkv/remote/open_remote_kv_store.h"
#include "mkv/stream.h"
#include "replay_report.h"

namespace mkv::replay {
namespace {

using testing::EngineIdentity;
using testing::EngineRequest;
using testing::EngineSequence;
using testing::ReferenceEngine;
using testing::RequestOutcome;
using testing::SequenceOutcome;

constexpr int32_t kMaxBatch = 4096;
constexpr int32_t kMaxTensorParallel = 64;
constexpr int32_t kMaxGeometry = 4096;           // KV heads, head dim
constexpr int32_t kMaxRecurrentLayers = 128;     // the recurrent oracle addresses this many
constexpr int64_t kMaxRecurrentBytes = 1 << 30;  // state or conv bytes per layer and sequence
constexpr int64_t kMaxHiddenWidth = 1 << 15;     // fp16 elements: the oracle's 64 KiB rows

int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

[[noreturn]] void configError(std::string const& message) { throw ReplayConfigError(message); }

void validateSpeculative(ReplayConfig const& c) {
  if (c.speculative == SpeculativeKind::kNone) {
    return;
  }
  if (c.mode != ReplayMode::kReuse) {
    configError(fmt::format("speculative decoding needs context reuse (--mode reuse), not {} mode",
                            toString(c.mode)));
  }
  if (c.specWidth < 1 || c.specWidth > ReferenceEngine::kMaxSpeculativeWidth) {
    configError(fmt::format("speculative width {} must be in [1, {}]", c.specWidth,
                            ReferenceEngine::kMaxSpeculativeWidth));
  }
  if (c.draftLayers < 0 || c.draftLayers > kernels::kMaxLayers) {
    configError(
        fmt::format("draft layers {} must be in [0, {}]", c.draftLayers, kernels::kMaxLayers));
  }
  if (c.speculative == SpeculativeKind::kEagle && c.draftLayers < 1) {
    configError(
        "an EAGLE draft owns paged KV: draft layers must be >= 1 (0 is an MTP draft "
        "reading the base KV)");
  }
}

void validateHybrid(ReplayConfig const& c) {
  if (c.recurrentLayers < 0 || c.recurrentLayers > kMaxRecurrentLayers) {
    configError(fmt::format("recurrent layers {} must be in [0, {}]", c.recurrentLayers,
                            kMaxRecurrentLayers));
  }
  if (c.recurrentLayers > 0 && c.mode != ReplayMode::kReuse) {
    configError(fmt::format(
        "recurrent layers exist in reuse mode only (hybrid checkpoint reuse), not in {} mode",
        toString(c.mode)));
  }
  if (c.recurrentStateBytes < 1 || c.recurrentStateBytes > kMaxRecurrentBytes ||
      c.recurrentConvBytes < 1 || c.recurrentConvBytes > kMaxRecurrentBytes) {
    configError(fmt::format("recurrent state bytes {} and conv bytes {} must be in [1, {}]",
                            c.recurrentStateBytes, c.recurrentConvBytes, kMaxRecurrentBytes));
  }
  if (c.snapshotSlots < 0) {
    configError(fmt::format("snapshot slots {} must be >= 1 (0 = unbounded)", c.snapshotSlots));
  }
  if (c.snapshotSlots > 0 && c.recurrentLayers == 0) {
    configError("snapshot slots exist with recurrent layers only");
  }
  if (c.checkpointInterval < 0 ||
      (c.checkpointInterval > 0 && c.recurrentLayers == 0 && !c.slidingReuse)) {
    configError(fmt::format(
        "checkpoint interval {}: reuse points exist with recurrent layers or sliding-window reuse "
        "only (and must be >= 0)",
        c.checkpointInterval));
  }
  if (c.checkpointInterval % c.pageSize != 0) {
    configError(fmt::format("checkpoint interval {} is not a multiple of the page size {}",
                            c.checkpointInterval, c.pageSize));
  }
}

/// Speculative decoding on a model with recurrent layers is Hybrid-MTP, the coordinator's only
/// speculative hybrid deployment: an MTP draft with paged KV and a boundary hidden row.
void validateHybridMtp(ReplayConfig const& c) {
  if (c.speculative == SpeculativeKind::kNone || c.recurrentLayers == 0) {
    return;
  }
  if (c.speculative == SpeculativeKind::kEagle) {
    configError(
        "an EAGLE draft on a model with recurrent layers is not offered: the speculative hybrid "
        "deployment is Hybrid-MTP (speculative mtp)");
  }
  if (c.draftLayers < 1) {
    configError("Hybrid-MTP needs an MTP draft with paged KV: draft layers must be >= 1, got 0");
  }
  if (c.boundaryHiddenWidth < 1 || c.boundaryHiddenWidth > kMaxHiddenWidth) {
    configError(fmt::format("boundary hidden width {} must be in [1, {}]", c.boundaryHiddenWidth,
                            kMaxHiddenWidth));
  }
}

bool isHybridMtp(ReplayConfig const& c) {
  return c.speculative == SpeculativeKind::kMtp && c.recurrentLayers > 0;
}

/// a x b + c, or int64 max when that overflows (a budget's cost only has to compare right).
int64_t saturatingMulAdd(int64_t a, int64_t b, int64_t c) {
  int64_t product = 0;
  int64_t sum = 0;
  if (__builtin_mul_overflow(a, b, &product) || __builtin_add_overflow(product, c, &sum)) {
    return std::numeric_limits<int64_t>::max();
  }
  return sum;
}

/// Bytes of one page of a pool of `layers` attention layers in the replay's geometry (K and V of
/// each; a draft has the base's heads, head dim and dtype), by KVCachePool's own arithmetic.
int64_t poolPageBytes(ReplayConfig const& c, int32_t layers) {
  if (layers == 0) {
    return 0;
  }
  KVCachePoolConfig pool;
  pool.numLayers = layers;
  pool.numKVHeads = c.kvHeads;
  pool.headDim = c.headDim;
  pool.tokensPerPage = c.pageSize;
  pool.dataType = c.dtype;
  return KVCachePool::bytesPerPage(pool);
}

/// Bounded SWA keeps the full layers in an identity-mapped pool of `batch` rows of `width` pages,
/// never smaller than the batch's bounded-SWA admission budget (so that the runtime picks bounded
/// SWA; no pool is allocated without full layers).
int64_t identityPoolPages(int64_t batch, int64_t width, int32_t perSequence) {
  return std::max(batch * width, batch * perSequence + 1);
}

/// --kv-budget-bytes in reuse and full mode: the full pool's pages, each paired with a draft page
/// when the draft owns paged KV (the draft pool has as many pages as the full pool).
int64_t budgetFullPages(ReplayConfig const& c) {
  int64_t const base = poolPageBytes(c, c.layers);
  int64_t const draft =
      c.speculative != SpeculativeKind::kNone ? poolPageBytes(c, c.draftLayers) : 0;
  if (c.poolAmount < base + draft) {
    configError(fmt::format(
        "--kv-budget-bytes {} is below the minimum of {} bytes: one page of the full pool ({} "
        "bytes){}",
        c.poolAmount, base + draft, base,
        draft > 0 ? fmt::format(" and its paired draft page ({} bytes)", draft) : ""));
  }
  return c.poolAmount / (base + draft);
}

/// --kv-budget-bytes with sliding-window reuse: slidingBudgetShare of the budget buys sliding
/// pages, the rest full-pool pages (each pool at least one sequence's row, the sliding pool one
/// sequence's largest prefill: a row, a spare and the window before it).
struct SlidingReuseBudget {
  int64_t fullPages = 0;
  int64_t swaPages = 0;
};

SlidingReuseBudget budgetSlidingReuse(ReplayConfig const& c, int64_t width) {
  int64_t const fullPage = poolPageBytes(c, c.fullLayers);
  int64_t const swaPage = poolPageBytes(c, c.layers);
  int64_t const swaMinimum = width + 1 + ceilDiv(c.windowTokens, c.pageSize);
  auto const swaBytes =
      static_cast<int64_t>(static_cast<double>(c.poolAmount) * c.slidingBudgetShare);
  SlidingReuseBudget budget{(c.poolAmount - swaBytes) / fullPage, swaBytes / swaPage};
  if (budget.fullPages < width || budget.swaPages < swaMinimum) {
    configError(fmt::format(
        "--kv-budget-bytes {} buys {} full pages and {} sliding pages (sliding share {}); one "
        "sequence needs {} full pages ({} bytes each) and {} sliding pages ({} bytes each)",
        c.poolAmount, budget.fullPages, budget.swaPages, c.slidingBudgetShare, width, fullPage,
        swaMinimum, swaPage));
  }
  return budget;
}

/// --kv-budget-bytes in swa mode: the largest batch (up to maxBatch) whose identity-mapped full
/// pool and bounded-SWA admission budgets fit, and the sliding pages the rest buys.
struct SwaBudget {
  int32_t batch = 0;
  int64_t swaPages = 0;
};

SwaBudget budgetSwa(ReplayConfig const& c, int64_t width, int32_t perSequence) {
  int64_t const swaPage = poolPageBytes(c, c.layers);
  int64_t const fullPage = poolPageBytes(c, c.fullLayers);
  auto fixed = [&](int64_t batch) {
    return saturatingMulAdd(fullPage, identityPoolPages(batch, width, perSequence), 0);
  };
  auto cost = [&](int64_t batch) {
    return saturatingMulAdd(batch * perSequence, swaPage, fixed(batch));
  };
  if (c.poolAmount < cost(1)) {
    configError(fmt::format(
        "--kv-budget-bytes {} is below the minimum of {} bytes: one sequence's bounded-SWA budget "
        "(2M + 1 = {} pages of {} bytes){}",
        c.poolAmount, cost(1), perSequence, swaPage,
        fullPage > 0 ? fmt::format(" and the full layers' identity-mapped pool of one row ({} "
                                   "pages of {} bytes)",
                                   identityPoolPages(1, width, perSequence), fullPage)
                     : ""));
  }
  SwaBudget budget{1, 0};
  while (budget.batch < c.maxBatch && cost(budget.batch + 1) <= c.poolAmount) {
    ++budget.batch;
  }
  budget.swaPages = (c.poolAmount - fixed(budget.batch)) / swaPage;
  return budget;
}

/// Sliding-window reuse serves attention-only vanilla reuse with at least one full layer.
void validateSlidingReuse(ReplayConfig const& c) {
  if (!c.slidingReuse) {
    return;
  }
  if (c.mode != ReplayMode::kReuse) {
    configError(fmt::format("sliding-window reuse is reuse mode, not {} mode", toString(c.mode)));
  }
  if (c.fullLayers < 1) {
    configError("sliding-window reuse needs --full-layers >= 1 beside the sliding layers");
  }
  if (c.windowTokens < 1) {
    configError(fmt::format("window {} must be >= 1 token", c.windowTokens));
  }
  if (c.recurrentLayers > 0 || c.speculative != SpeculativeKind::kNone || c.hostPoolTokens > 0) {
    configError(
        "sliding-window reuse serves attention-only vanilla reuse: no --recurrent-layers, "
        "--speculative or --host-pool-tokens");
  }
  if (!(c.slidingBudgetShare > 0.0 && c.slidingBudgetShare < 1.0)) {
    configError(fmt::format("sliding budget share {} must be in (0, 1)", c.slidingBudgetShare));
  }
}

int64_t nanosecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              start)
      .count();
}

void validateRemoteTier(ReplayConfig const& c) {
  if (c.remoteTier.empty()) {
    if (c.remoteTtlSeconds != 0) {
      configError(
          "--remote-ttl applies to the values --remote-tier writes: it needs --remote-tier");
    }
    if (c.role != ReplayRole::kBoth) {
      configError(fmt::format("--role {} shares blocks through a store: it needs --remote-tier",
                              toString(c.role)));
    }
    return;
  }
  if (c.mode != ReplayMode::kReuse || c.hostPoolTokens <= 0 || c.recurrentLayers > 0 ||
      c.speculative != SpeculativeKind::kNone || c.slidingReuse) {
    configError(
        "--remote-tier loads into and saves from the host tier: it needs --mode reuse with "
        "--host-pool-tokens on an attention-only model without --speculative or sliding reuse");
  }
}

void validateTensorParallel(ReplayConfig const& c) {
  if (c.tensorParallel < 1 || c.tensorParallel > kMaxTensorParallel) {
    configError(fmt::format("tensor-parallel size {} must be in [1, {}]", c.tensorParallel,
                            kMaxTensorParallel));
  }
  if (c.tensorParallel == 1) {
    return;
  }
  if (!c.remoteTier.empty()) {
    configError("--tensor-parallel does not serve a remote tier (its lookups differ per rank)");
  }
  int32_t const n = c.tensorParallel;
  if (c.kvHeadLayout == KvHeadLayout::kSplitHeads &&
      (c.kvHeads % n != 0 || c.recurrentStateBytes % n != 0 || c.recurrentConvBytes % n != 0)) {
    configError(fmt::format(
        "--tensor-parallel {} splits the KV heads ({}) and the recurrent state and conv bytes ({} "
        "and {}) over the ranks: give multiples of {}, or --kv-head-layout replicated",
        n, c.kvHeads, c.recurrentStateBytes, c.recurrentConvBytes, n));
  }
}

void validate(ReplayConfig const& c) {
  validateTensorParallel(c);
  validateRemoteTier(c);
  if (c.pageSize < 16 || c.pageSize > 1024 || (c.pageSize & (c.pageSize - 1)) != 0) {
    configError(fmt::format("page size {} is not a power of two in [16, 1024]", c.pageSize));
  }
  if (c.layers < 1 || c.fullLayers < 0 || c.layers + c.fullLayers > kernels::kMaxLayers) {
    configError(fmt::format("layers {} (+ {} full layers) must be >= 1 and at most {} in all",
                            c.layers, c.fullLayers, kernels::kMaxLayers));
  }
  if (c.fullLayers > 0 && c.mode != ReplayMode::kSwa && !c.slidingReuse) {
    configError(
        "full layers besides sliding ones exist only with sliding layers (swa mode, or "
        "--window in reuse mode)");
  }
  validateSlidingReuse(c);
  if (c.kvHeads < 1 || c.kvHeads > kMaxGeometry || c.headDim < 1 || c.headDim > kMaxGeometry) {
    configError(fmt::format("KV heads {} and head dim {} must be in [1, {}]", c.kvHeads, c.headDim,
                            kMaxGeometry));
  }
  if (c.mode == ReplayMode::kSwa && c.windowTokens < 1) {
    configError(fmt::format("window {} must be >= 1 token", c.windowTokens));
  }
  if (c.maxBatch < 1 || c.maxBatch > kMaxBatch) {
    configError(fmt::format("max batch {} must be in [1, {}]", c.maxBatch, kMaxBatch));
  }
  if (c.maxOutputTokens < 0) {
    configError(fmt::format("max output {} must be >= 1 (0 = no cap)", c.maxOutputTokens));
  }
  if (c.poolSizing == PoolSizing::kPages && c.poolAmount < 1) {
    configError(fmt::format("a pool of {} pages is smaller than 1 page", c.poolAmount));
  }
  if (c.poolSizing == PoolSizing::kTokens && c.poolAmount < c.pageSize) {
    configError(fmt::format("a pool of {} tokens is smaller than 1 page of {} tokens", c.poolAmount,
                            c.pageSize));
  }
  if (c.kvEvents != nullptr && c.mode != ReplayMode::kReuse) {
    configError(
        fmt::format("KV events exist in reuse mode only, not in {} mode", toString(c.mode)));
  }
  validateSpeculative(c);
  validateHybrid(c);
  validateHybridMtp(c);
  if (c.device == DeviceType::kGPU && !cudaDeviceAvailable()) {
    configError(MKV_WITH_CUDA ? "--device cuda: no CUDA device is visible"
                              : "--device cuda: this build has no CUDA (configure with "
                                "-DMKV_ENABLE_CUDA=ON)");
  }
}

int64_t mean(std::vector<int64_t> const& values) {
  if (values.empty()) {
    return 0;
  }
  double sum = 0.0;
  for (int64_t v : values) {
    sum += static_cast<double>(v);
  }
  return std::llround(sum / static_cast<double>(values.size()));
}

int64_t percentile(std::vector<int64_t> values, double q) {
  if (values.empty()) {
    return 0;
  }
  auto const rank =
      static_cast<std::size_t>(std::llround(q * static_cast<double>(values.size() - 1)));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(rank),
                   values.end());
  return values[rank];
}

bool completedNormally(FinishReason reason) noexcept {
  return reason == FinishReason::kLength || reason == FinishReason::kEndOfSequence ||
         reason == FinishReason::kStopString;
}

/// A materialised request waiting for the engine.
struct Pending {
  std::size_t index = 0;
  EngineSequence sequence;
  std::string salt;
  std::string lora;
  bool alone = false;  ///< a retry: runs without joiners
  /// A preempted sequence queued again (sequence.resume): handed to the engine before.
  bool resumed = false;
};

/// A request queued for in-flight admission: its index, and whether it is a resumption.
struct QueuedJoin {
  std::size_t index = 0;
  bool resumed = false;
};

class Runner {
 public:
  Runner(RequestSource& source, ReplayConfig const& config, ProgressCallback const& progress)
      : mSource(source), mConfig(config), mProgress(progress) {}

  ReplayResult run() {
    auto const start = std::chrono::steady_clock::now();
    validate(mConfig);
    mCount = mSource.size();
    if (mConfig.limit > 0) {
      mCount = std::min(mCount, mConfig.limit);
    }
    if (mCount == 0) {
      configError("the workload has no requests");
    }
    mResult.config = mConfig;
    mResult.workload = mSource.describe();
    mResult.requests = static_cast<int64_t>(mCount);
    mResult.records.resize(mCount);
    mIdentities.resize(mCount);
    createRuntime();
    replayAll();
    summarize();
    mResult.wallSeconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::move(mResult);
  }

 private:
  /// The runtime serves sliding layers from a bounded pool only when the decode window, M + 1
  /// pages, is shorter than a sequence's row; otherwise it keeps them in the full pool, which
  /// is plain reuse, not what --window asked for.
  void requireWindowBelowRow(int64_t width) const {
    ReplayConfig const& c = mConfig;
    if (!c.slidingReuse) {
      return;
    }
    int32_t const windowPages =
        BoundedSwaKVPageManager::decodePagesPerSequence(c.windowTokens, c.pageSize);
    if (windowPages >= width) {
      configError(fmt::format(
          "--window {}: its {} decode pages (M + 1) cover a whole sequence of this workload "
          "({} pages of {} tokens), so sliding layers would keep every page; the runtime serves "
          "that as plain reuse. Choose a window whose M + 1 pages are fewer than {}",
          c.windowTokens, windowPages, width, c.pageSize, width));
    }
  }

  void createRuntime() {
    ReplayConfig const& c = mConfig;
    // A verification round writes K positions past the lookahead.
    int64_t const longest = mSource.longestSequenceTokens(c.maxOutputTokens) + 2 +
                            (c.speculative != SpeculativeKind::kNone ? c.specWidth : 0);
    if (longest > std::numeric_limits<int32_t>::max() / 2) {
      configError(fmt::format("a sequence of {} tokens is too long", longest));
    }
    int64_t const width = ceilDiv(longest, c.pageSize);
    requireWindowBelowRow(width);
    KVCacheRuntimeConfig rc;
    rc.model.numKVHeads = c.kvHeads;
    rc.model.headDim = c.headDim;
    rc.model.kvDataType = c.dtype;
    rc.tokensPerPage = c.pageSize;
    rc.maxSequenceLength = static_cast<int32_t>(longest);
    rc.deviceType = c.device;
    rc.deviceWrites = c.deviceWrites;
    rc.tensorParallel = {c.tensorParallel, c.tensorParallelRank, c.kvHeadLayout, c.rankAgreement};
    rc.contextCache.verifyTokens = true;
    rc.contextCache.evictionPolicy = c.eviction;
    rc.contextCache.joinerPages = c.joinerPages;
    // Records are limited by pages, never by count: a request publishes at most twice, or (with
    // a token budget) once more per prefill chunk, each ending on a distinct cached page.
    int64_t const chunkRecords =
        c.maxBatchedTokens > 0 ? mSource.cachedPagesBound(c.pageSize, c.maxOutputTokens) : 0;
    rc.contextCache.maxRecords = static_cast<int32_t>(
        std::min<int64_t>(std::numeric_limits<int32_t>::max(),
                          std::max<int64_t>(1024, 2 * mResult.requests + 16 + chunkRecords)));
    int64_t explicitPages = 0;
    if (c.poolSizing == PoolSizing::kPages) {
      explicitPages = c.poolAmount;
    } else if (c.poolSizing == PoolSizing::kTokens) {
      explicitPages = c.poolAmount / c.pageSize;
    } else if (c.poolSizing == PoolSizing::kBudgetBytes && c.slidingReuse) {
      SlidingReuseBudget const budget = budgetSlidingReuse(c, width);
      explicitPages = budget.fullPages;
      rc.numSwaPages = static_cast<int32_t>(
          std::min<int64_t>(budget.swaPages, std::numeric_limits<int32_t>::max() / 2));
    } else if (c.poolSizing == PoolSizing::kBudgetBytes && c.mode != ReplayMode::kSwa) {
      explicitPages = budgetFullPages(c);
    }
    int64_t pages = 0;
    int32_t batch = c.maxBatch;
    switch (c.mode) {
      case ReplayMode::kReuse:
        if (c.slidingReuse) {
          rc.model.numSlidingWindowLayers = c.layers;
          rc.model.numFullAttentionLayers = c.fullLayers;
          rc.model.slidingWindowTokens = c.windowTokens;
        } else {
          rc.model.numFullAttentionLayers = c.layers;
        }
        rc.contextReuse = true;
        rc.contextCache.checkpointInterval = c.checkpointInterval;
        configureHybrid(rc);
        pages = explicitPages > 0
                    ? explicitPages
                    : mSource.cachedPagesBound(c.pageSize, c.maxOutputTokens) + batch * width;
        break;
      case ReplayMode::kFull:
        rc.model.numFullAttentionLayers = c.layers;
        pages = explicitPages > 0 ? explicitPages : batch * width;
        break;
      case ReplayMode::kSwa: {
        rc.model.numSlidingWindowLayers = c.layers;
        rc.model.numFullAttentionLayers = c.fullLayers;
        rc.model.slidingWindowTokens = c.windowTokens;
        int32_t const perSequence =
            BoundedSwaKVPageManager::admissionPagesPerSequence(c.windowTokens, c.pageSize);
        if (c.poolSizing == PoolSizing::kBudgetBytes) {
          SwaBudget const budget = budgetSwa(c, width, perSequence);
          explicitPages = budget.swaPages;
          batch = budget.batch;
        }
        pages = explicitPages > 0 ? explicitPages : int64_t{batch} * perSequence;
        if (pages < perSequence) {
          configError(fmt::format(
              "a pool of {} pages is smaller than one sequence's bounded-SWA budget: 2M + 1 = {} "
              "pages (M = ceil({} / {}) + 1)",
              pages, perSequence, c.windowTokens, c.pageSize));
        }
        batch = static_cast<int32_t>(std::min<int64_t>(batch, pages / perSequence));
        rc.numSwaPages =
            static_cast<int32_t>(std::min<int64_t>(pages, std::numeric_limits<int32_t>::max()));
        // The full layers' identity-mapped pool; never fewer pages than bounded SWA holds, so
        // the runtime always picks bounded SWA in this mode.
        rc.numPages = static_cast<int32_t>(identityPoolPages(batch, width, perSequence));
        break;
      }
    }
    if (pages > std::numeric_limits<int32_t>::max() / 2 ||
        (c.mode == ReplayMode::kSwa && rc.numPages > std::numeric_limits<int32_t>::max() / 2)) {
      configError(fmt::format("a pool of {} pages is too large", pages));
    }
    if (c.mode != ReplayMode::kSwa) {
      rc.numPages = static_cast<int32_t>(pages);
    }
    if (c.speculative != SpeculativeKind::kNone) {
      // EAGLE and MTP drafts: a draft row depends on the token after it (one-token future
      // dependency); the draft pool has as many pages as the base pool.
      KVCacheSpeculativeConfig draft;
      draft.pagedDraft = c.draftLayers > 0;
      draft.futureDependencyTokens = draft.pagedDraft ? 1 : 0;
      draft.numDraftLayers = c.draftLayers;
      draft.numDraftKVHeads = c.kvHeads;
      draft.draftHeadDim = c.headDim;
      draft.draftKvDataType = c.dtype;
      if (isHybridMtp(c)) {
        draft.boundaryHiddenWidth = c.boundaryHiddenWidth;
        draft.boundaryHiddenType = DataType::kFloat16;
      }
      rc.speculative = draft;
    }
    if (c.kvEvents != nullptr) {
      // Events of one step: each running sequence stores at most its `width` blocks; evictions
      // remove the blocks of pages freed for the step's admissions (at most a batch of
      // sequences, plus the rest of the last record evicted) and of pages still leased.
      // A host tier adds a store on the host for each removal, and the host tier's own drops;
      // sliding-window reuse the same stores and drops again in its sliding pool (group 1).
      int64_t const perPage = c.hostPoolTokens > 0 ? 3 : (c.slidingReuse ? 2 : 1);
      rc.contextCache.eventQueueCapacity = static_cast<int32_t>(
          std::min<int64_t>({std::numeric_limits<int32_t>::max() / 4, 2 * perPage * pages,
                             4 * perPage * int64_t{batch} * width}) +
          1024);
    }
    if (!c.remoteTier.empty()) {
      RemoteTierConfig remote;
      RemoteKvStoreOptions store;
      store.ttlSeconds = c.remoteTtlSeconds;
      remote.openStore = [url = c.remoteTier, store] { return openRemoteKvStore(url, store); };
      remote.model = c.remoteModel;
      remote.saveBlocks = c.role != ReplayRole::kDecode;
      // Saves in flight hold host pages: at most half the tier.
      remote.maxPendingSaves =
          static_cast<int32_t>(std::max<int64_t>(1, c.hostPoolTokens / c.pageSize / 2));
      rc.contextCache.remoteTier = std::move(remote);
      mResult.remoteTier.enabled = true;
      mResult.remoteTier.store = c.remoteTier;
    }
    if (c.hostPoolTokens > 0) {
      rc.hostPoolTokens = c.hostPoolTokens / c.pageSize * c.pageSize;
      if (rc.hostPoolTokens == 0) {
        configError(fmt::format("a host tier of {} tokens holds no page of {} tokens",
                                c.hostPoolTokens, c.pageSize));
      }
    }
    rc.maxBatchSize = batch;
    mResult.maxBatch = batch;
    mResult.maxSequenceTokens = width * c.pageSize;
    requireMemoryFor(rc);
    mRuntime = KVCacheRuntime::create(rc);
    KVCacheBackend const expected = c.slidingReuse ? KVCacheBackend::kSlidingWindowReuse
                                    : c.mode == ReplayMode::kReuse ? KVCacheBackend::kContextReuse
                                    : c.mode == ReplayMode::kSwa   ? KVCacheBackend::kBoundedSwa
                                                                   : KVCacheBackend::kFullStorage;
    if (mRuntime->backend() != expected) {
      throw std::logic_error(fmt::format("the runtime chose the {} backend for {} mode",
                                         mkv::toString(mRuntime->backend()), toString(c.mode)));
    }
    mResult.backend = mRuntime->backend();
    KVCachePool const& pool =
        c.mode == ReplayMode::kSwa ? *mRuntime->swaPool() : *mRuntime->fullPool();
    mResult.poolPages = pool.numPages();
    mResult.bytesPerPage = KVCachePool::bytesPerPage(pool.config());
    if (KVCachePool const* draft = mRuntime->draftPool()) {
      mResult.draftBytesPerPage = KVCachePool::bytesPerPage(draft->config());
    }
    describePools();
    if (c.poolSizing == PoolSizing::kBudgetBytes && mResult.kvBytes > c.poolAmount) {
      throw std::logic_error(fmt::format("the KV pools take {} bytes of a budget of {}",
                                         mResult.kvBytes, c.poolAmount));
    }

    testing::ReferenceEngineOptions options;
    options.verify = c.verify;
    options.seed = c.seed;
    options.throwOnMismatch = false;
    options.onStep = [this](int64_t) { onStep(); };
    options.speculativeWidth = c.speculative != SpeculativeKind::kNone ? c.specWidth : 0;
    options.maxBatchedTokens = c.maxBatchedTokens;
    if (c.preemption == testing::PreemptionMode::kSwap && mRuntime->hostTier() == nullptr) {
      configError(
          "swap preemption moves the preempted sequences' blocks to the host tier: it needs "
          "--mode reuse with --host-pool-tokens");
    }
    options.preemption = c.preemption;
    mEngine = std::make_unique<ReferenceEngine>(*mRuntime, std::move(options));
    // Bounded SWA joins in flight under a token budget (a serving engine); without one it runs
    // batches of consecutive requests, as the seed's batch loop does.
    mJoins = (c.mode != ReplayMode::kSwa || c.maxBatchedTokens > 0) && batch > 1 &&
             mRuntime->supportsSeatedAdmission();
    if (c.maxBatchedTokens < 0 || (c.maxBatchedTokens > 0 && !mJoins)) {
      configError(fmt::format(
          "a token budget of {} per step needs in-flight joins (--max-batch > 1, a model with "
          "attention layers): its chunks are joiners' prefills",
          c.maxBatchedTokens));
    }
    if (c.preemption != testing::PreemptionMode::kNone && !mJoins) {
      configError(
          "preemption needs in-flight joins (--max-batch > 1, a model with attention layers; "
          "in swa mode with --max-batched-tokens): the preempted are admitted again in flight");
    }
    if (c.joinerPages == JoinerPageAllocation::kPerChunk &&
        (!mJoins || c.mode == ReplayMode::kSwa)) {
      configError(
          "--joiner-pages per-chunk needs in-flight joins (--max-batch > 1, a model with attention "
          "layers) on a context-reuse mode: bounded SWA's joiners rotate within their 2M + 1 "
          "pages");
    }
    if (c.preemption != testing::PreemptionMode::kNone && c.mode == ReplayMode::kSwa) {
      configError(
          "preemption in swa mode: bounded SWA caches nothing a resumed sequence could reuse, and "
          "each sequence holds its own 2M + 1 pages (no row's growth waits for another's)");
    }
    // Without in-flight admission, bounded SWA and speculative runs (Hybrid-MTP included: each
    // row publishes its own endpoint) start with a batch of up to maxBatch consecutive
    // requests; hybrid checkpoint runs take one request at a time (docs/replay.md, "Hybrid
    // models").
    bool const batches =
        (c.mode == ReplayMode::kSwa && !mJoins) || c.speculative != SpeculativeKind::kNone;
    mFoundersPerRun = batches ? static_cast<std::size_t>(batch) : 1;
  }

  /// Refuses the run (bad input, exit 2) before anything is allocated when its KV pools exceed
  /// the memory the device has available: the message names the bytes and the flags that size
  /// the pools, with the pool that would fit.
  void requireMemoryFor(KVCacheRuntimeConfig const& rc) const {
    ReplayConfig const& c = mConfig;
    int64_t const needed = KVCacheRuntime::kvBytesFor(rc);
    int64_t const available = KVCacheRuntime::availableMemoryBytes(rc.deviceType);
    if (available < 0 || needed <= available) {
      return;
    }
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    std::string const sizing =
        c.poolSizing == PoolSizing::kUnbounded ? "; the default pool: nothing is ever evicted" : "";
    std::string advice = "pass --kv-budget-bytes B (or a smaller --max-batch)";
    if (c.mode != ReplayMode::kSwa) {
      // Nine tenths of what is available, in whole pages of the pools' proportions.
      auto const fitting = static_cast<int64_t>(0.9 * static_cast<double>(available) /
                                                static_cast<double>(needed) * rc.numPages);
      advice = fmt::format("pass --pool-tokens N (about {} fit) or --kv-budget-bytes B",
                           fitting * c.pageSize);
    }
    configError(fmt::format(
        "the KV pools of this run need {} bytes ({:.1f} GiB{}) and the {} has {} bytes "
        "({:.1f} GiB) available: {}",
        needed, static_cast<double>(needed) / kGiB, sizing, mkv::toString(rc.deviceType), available,
        static_cast<double>(available) / kGiB, advice));
  }

  /// Every device KV pool of the runtime, in the order full, swa, draft, and their bytes in all.
  void describePools() {
    auto add = [this](KvPoolKind kind, KVCachePool const* pool) {
      if (pool != nullptr) {
        mResult.pools.push_back(
            KvPoolUsage{kind, pool->numPages(), KVCachePool::bytesPerPage(pool->config())});
      }
    };
    add(KvPoolKind::kFull, mRuntime->fullPool());
    add(KvPoolKind::kSwa, mRuntime->swaPool());
    add(KvPoolKind::kDraft, mRuntime->draftPool());
    mResult.kvBytes = mRuntime->kvBytes();
  }

  /// The peak pages of each pool: the managed pool's (the full pool, or the SWA pool of bounded
  /// SWA) and the draft pool's from the engine; bounded SWA's identity-mapped full pool belongs to
  /// its rows whole.
  void summarizePools(testing::EngineStats const& stats) {
    ReplayResult& r = mResult;
    bool const bounded = r.backend == KVCacheBackend::kBoundedSwa;
    r.peakKvBytes = 0;
    for (KvPoolUsage& pool : r.pools) {
      if (pool.kind == KvPoolKind::kDraft) {
        pool.peakPagesInUse = stats.peakDraftPagesInUse;
      } else if (pool.kind == KvPoolKind::kFull && bounded) {
        pool.peakPagesInUse = pool.pages;
      } else if (pool.kind == KvPoolKind::kSwa && !bounded) {
        pool.peakPagesInUse = stats.peakSwaPagesInUse;  // sliding-window reuse
      } else {
        pool.peakPagesInUse = stats.peakPagesInUse;
      }
      r.peakKvBytes += pool.peakPagesInUse * pool.bytesPerPage;
    }
  }

  /// Hybrid checkpoint reuse: the recurrent layers and the snapshot budget, in checkpoints (one
  /// recurrent and one partial-KV slot each).
  void configureHybrid(KVCacheRuntimeConfig& rc) const {
    ReplayConfig const& c = mConfig;
    if (c.recurrentLayers == 0) {
      return;
    }
    rc.model.numRecurrentLayers = c.recurrentLayers;
    rc.model.recurrentStateBytes = c.recurrentStateBytes;
    rc.model.recurrentConvBytes = c.recurrentConvBytes;
    // Unbounded: a request captures at most twice (prompt end, decode end) plus its reuse points,
    // at most one per interval of the tokens the trace can cache, so every capture of the replay
    // finds a slot (and every checkpoint a record) even if nothing is ever evicted.
    rc.contextCache.checkpointInterval = c.checkpointInterval;
    rc.contextCache.reusePointAdmission = c.reusePointAdmission;
    // Branch points: at most one more per request. Chunk ends (a token budget B): a step ends
    // at most one chunk short of its prompt (rows take the budget in order), and that step
    // prefills at least max(1, B - maxBatch) tokens (decodes take at most maxBatch of B).
    int64_t const cachedTokens =
        mSource.cachedPagesBound(c.pageSize, c.maxOutputTokens) * c.pageSize;
    int64_t const intervalPoints =
        c.checkpointInterval > 0 ? cachedTokens / c.checkpointInterval + mResult.requests : 0;
    int64_t const chunkEnds =
        c.maxBatchedTokens > 0
            ? cachedTokens / std::max(1, c.maxBatchedTokens - c.maxBatch) + mResult.requests
            : 0;
    int64_t const points = intervalPoints + chunkEnds;
    int64_t const slots = c.snapshotSlots > 0 ? c.snapshotSlots : 2 * mResult.requests + 2 + points;
    rc.contextCache.maxRecords = static_cast<int32_t>(std::min<int64_t>(
        std::numeric_limits<int32_t>::max(), int64_t{rc.contextCache.maxRecords} + points));
    // Hybrid-MTP: a recurrent slot also keeps the boundary hidden row (fp16), a partial-KV slot
    // the draft's boundary page besides the base's.
    bool const mtp = isHybridMtp(c);
    int64_t const recurrentBytes =
        int64_t{c.recurrentLayers} * (c.recurrentStateBytes + c.recurrentConvBytes) +
        (mtp ? c.boundaryHiddenWidth * 2 : 0);
    int64_t const partialBytes = int64_t{c.layers + (mtp ? c.draftLayers : 0)} * 2 * c.pageSize *
                                 c.kvHeads * c.headDim *
                                 static_cast<int64_t>(dataTypeSize(c.dtype));
    int64_t const limit = std::numeric_limits<int64_t>::max() / 4;
    if (slots > std::numeric_limits<int32_t>::max() / 2 || slots > limit / recurrentBytes ||
        slots > limit / partialBytes) {
      configError(fmt::format("{} snapshot slots of {} + {} bytes are too many", slots,
                              recurrentBytes, partialBytes));
    }
    rc.contextCache.recurrentSnapshotPoolBytes = slots * recurrentBytes;
    rc.contextCache.partialKvSnapshotPoolBytes = slots * partialBytes;
  }

  /// Materialises the next request when the source has it ready.
  bool stageNext() {
    if (mNextIndex >= mCount || !mSource.ready(mNextIndex)) {
      return false;
    }
    ReplayRequest request = mSource.materialize(mNextIndex);
    if (request.prompt.empty()) {
      throw std::runtime_error(fmt::format("request {} has an empty prompt", mNextIndex));
    }
    RequestRecord& record = mResult.records[mNextIndex];
    record.index = mNextIndex;
    record.id = request.id;
    record.timestampMs = request.timestampMs;
    record.promptTokens = static_cast<int64_t>(request.prompt.size());
    record.maxNewTokens = cappedOutput(request.maxNewTokens, mConfig.maxOutputTokens);
    if (mConfig.role == ReplayRole::kPrefill) {
      record.maxNewTokens = std::min(record.maxNewTokens, 1);  // the first token, then handoff
    }
    Pending pending;
    pending.index = mNextIndex;
    pending.sequence.prompt = std::move(request.prompt);
    pending.sequence.maxNewTokens = record.maxNewTokens;
    pending.sequence.tag = static_cast<int64_t>(mNextIndex);
    pending.salt = std::move(request.salt);
    pending.lora = std::move(request.lora);
    mIdentities[mNextIndex] = EngineIdentity{pending.lora, pending.salt};
    loadFromRemoteTier(pending);
    mStaged.push_back(std::move(pending));
    ++mNextIndex;
    return true;
  }

  /// Remote tier: loads the blocks of `pending`'s prompt the store holds past the local hit into
  /// the host tier before the request can be admitted. The library's load runs on its worker; a
  /// serving engine would admit other requests meanwhile, the replay waits (timed).
  void loadFromRemoteTier(Pending const& pending) {
    ContextCacheCoordinator* coordinator = mRuntime->contextCache();
    if (coordinator == nullptr || !coordinator->hasRemoteTier()) {
      return;
    }
    auto const start = std::chrono::steady_clock::now();
    ContextCacheSequenceAdmission admission;
    admission.tokenIds = pending.sequence.prompt;
    admission.keyExtras = blockKeyExtras(pending.lora, pending.salt);
    RemoteLoadStart const started = coordinator->loadFromRemoteTier(admission);
    if (started.ticket != 0) {
      auto const finished = [&](std::vector<RemoteLoadResult> const& results) {
        return std::any_of(results.begin(), results.end(), [&](RemoteLoadResult const& result) {
          return result.ticket == started.ticket;
        });
      };
      while (!finished(coordinator->pollRemoteTier())) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    mResult.remoteTier.loadWaitNanoseconds += nanosecondsSince(start);
  }

  Pending* peekStaged() {
    if (mStaged.empty() && !stageNext()) {
      return nullptr;
    }
    return &mStaged.front();
  }

  bool sameIdentity(Pending const& pending) const {
    return pending.salt == mRunSalt && pending.lora == mRunLora;
  }

  /// Request `index` queued again after a run, with its own salt and adapter.
  Pending requeued(std::size_t index, EngineSequence sequence) const {
    Pending pending;
    pending.index = index;
    pending.salt = mIdentities[index].cacheSalt;
    pending.lora = mIdentities[index].loraWeightsName;
    pending.sequence = std::move(sequence);
    return pending;
  }

  /// Keeps up to maxBatch requests queued for in-flight admission, in FIFO order up to the first
  /// one that is not ready (or a retry, which runs alone); one of another salt or adapter than
  /// the run's joins with its own (ManagedKVCacheRequest::admitSequence's overload for a joiner).
  void fillJoinQueue() {
    while (mJoinQueue.size() < static_cast<std::size_t>(mResult.maxBatch)) {
      Pending* next = peekStaged();
      if (next == nullptr || next->alone) {
        return;
      }
      if (!sameIdentity(*next)) {
        next->sequence.identity = EngineIdentity{next->lora, next->salt};
      }
      mQueuedTags.push_back(QueuedJoin{next->index, next->resumed});
      mJoinQueue.push_back(std::move(next->sequence));
      mStaged.pop_front();
    }
  }

  void reportProgress() {
    if (mProgress) {
      mProgress(mHanded, mCount);
    }
  }

  /// After every decode step: the step's figures, joins since the last step, queue refill.
  /// Hands the events since the last call to the publisher: one batch per engine step.
  void publishEvents() {
    if (mConfig.kvEvents != nullptr) {
      mConfig.kvEvents->publish(mRuntime->contextCache()->drainEvents());
    }
  }

  void onStep() {
    publishEvents();
    if (mResult.remoteTier.enabled) {
      (void)mRuntime->contextCache()->pollRemoteTier();  // saves move on; loads are waited for
    }
    std::size_t const step = mStepNanos.size();
    mStepNanos.push_back(mEngine->stats().stepHostNanoseconds.back());
    mStepPages.push_back(mEngine->pagesInUse());
    std::size_t const joined = mQueuedTags.size() - mJoinQueue.size();
    for (std::size_t i = 0; i < joined; ++i) {
      mJoinStep[mQueuedTags.front().index] = step;
      mHanded += mQueuedTags.front().resumed ? 0U : 1U;
      mQueuedTags.pop_front();
    }
    if (mRunJoins) {
      fillJoinQueue();
    }
    reportProgress();
  }

  void replayAll() {
    while (true) {
      Pending* first = peekStaged();
      if (first == nullptr) {
        if (mNextIndex < mCount) {
          throw std::logic_error(
              fmt::format("request {} is not ready although nothing runs", mNextIndex));
        }
        return;
      }
      mRunSalt = first->salt;
      mRunLora = first->lora;
      bool const alone = first->alone;
      EngineRequest request;
      request.cacheSalt = mRunSalt;
      request.loraWeightsName = mRunLora;
      if (isHybridMtp(mConfig)) {
        // Hybrid-MTP publishes prompt endpoints only: reuse comes from them alone.
        request.commitPolicy = ContextCacheCommitPolicy::kPrefillStateOnly;
      }
      while (request.sequences.size() < (alone ? 1 : mFoundersPerRun)) {
        Pending* next = peekStaged();
        if (next == nullptr || !sameIdentity(*next)) {
          break;
        }
        next->sequence.identity.reset();  // a founder has the request's
        request.sequences.push_back(std::move(next->sequence));
        mStaged.pop_front();
      }
      mHanded += static_cast<std::size_t>(
          std::count_if(request.sequences.begin(), request.sequences.end(),
                        [](EngineSequence const& sequence) { return !sequence.resume; }));
      mStepNanos.clear();
      mStepPages.clear();
      mJoinStep.clear();
      mJoinQueue.clear();
      mQueuedTags.clear();
      mRunJoins = mJoins && !alone;
      if (mRunJoins) {
        fillJoinQueue();
      }
      reportProgress();
      RequestOutcome const outcome = mEngine->run(request, mRunJoins ? &mJoinQueue : nullptr);
      publishEvents();  // the run's last step: its prefill-only or finishing events
      if (mConfig.role == ReplayRole::kPrefill) {
        // A prefill instance hands its requests' KV over: their saves finish before it goes on.
        auto const start = std::chrono::steady_clock::now();
        (void)mRuntime->contextCache()->drainRemoteTier();
        mResult.remoteTier.handoffWaitNanoseconds += nanosecondsSince(start);
      } else if (mResult.remoteTier.enabled) {
        (void)mRuntime->contextCache()->pollRemoteTier();  // a prefill-only run has no step
      }
      // Joins after the last step; then what never joined goes back, in order.
      std::size_t const lateJoins = mQueuedTags.size() - mJoinQueue.size();
      for (std::size_t i = 0; i < lateJoins; ++i) {
        mHanded += mQueuedTags.front().resumed ? 0U : 1U;
        mQueuedTags.pop_front();
      }
      while (!mJoinQueue.empty()) {
        Pending pending = requeued(mQueuedTags.back().index, std::move(mJoinQueue.back()));
        pending.resumed = mQueuedTags.back().resumed;
        mStaged.push_front(std::move(pending));
        mJoinQueue.pop_back();
        mQueuedTags.pop_back();
      }
      // Preempted sequences still waiting go first (--preemption); std::views::reverse does not
      // parse under clang-tidy 14 with libstdc++ 12.
      // NOLINTNEXTLINE(modernize-loop-convert)
      for (auto it = outcome.preempted.rbegin(); it != outcome.preempted.rend(); ++it) {
        Pending pending = requeued(static_cast<std::size_t>(it->tag), *it);
        pending.resumed = true;
        mStaged.push_front(std::move(pending));
      }
      processOutcome(outcome);
      reportProgress();
      if (mConfig.betweenRuns) {
        mConfig.betweenRuns(*mRuntime);
      }
      resetCacheWhenDue();
    }
  }

  /// --reset-cache-every: between runs nothing is active, so the reset cannot be refused; its
  /// AllBlocksCleared event goes out as a batch of its own.
  void resetCacheWhenDue() {
    int64_t const every = mConfig.resetCacheEvery;
    if (every <= 0 || static_cast<int64_t>(mHanded) / every <= mResets) {
      return;
    }
    if (!mRuntime->contextCache()->resetPrefixCache()) {
      throw std::logic_error("the prefix cache refused a reset between two runs");
    }
    mResets = static_cast<int64_t>(mHanded) / every;
    publishEvents();
  }

  void processOutcome(RequestOutcome const& outcome) {
    std::size_t const steps = mStepNanos.size();
    struct Finished {
      SequenceOutcome const* sequence;
      std::size_t start;
      std::size_t count;
      std::size_t end;
    };
    std::vector<Finished> finished;
    std::vector<int64_t> active(steps + 1, 0);
    for (SequenceOutcome const& sequence : outcome.sequences) {
      std::size_t start = 0;
      // A resumed sequence's entry covers the steps since its resumption (--preemption).
      std::size_t const before =
          sequence.resumedAtToken >= 0 ? static_cast<std::size_t>(sequence.resumedAtToken) : 0;
      if (sequence.resumedAtToken >= 0) {
        start = std::min(static_cast<std::size_t>(sequence.seatedAtRunStep), steps);
      } else if (sequence.joinedInFlight) {
        auto const it = mJoinStep.find(static_cast<std::size_t>(sequence.tag));
        start = it != mJoinStep.end() ? it->second : steps;
      }
      std::size_t const sampled = sequence.generated.size() - before;
      // A verification round commits several tokens: count the steps themselves.
      std::size_t const taken = mConfig.speculative != SpeculativeKind::kNone
                                    ? static_cast<std::size_t>(sequence.decodeSteps)
                                    : (sampled > 0 ? sampled - 1 : 0);
      std::size_t const count = std::min(taken, steps - start);
      // Released by the compaction after its last step (before the next one).
      std::size_t const end = start + count;
      active[start] += 1;
      active[start + count] -= 1;
      finished.push_back(Finished{&sequence, start, count, end});
    }
    for (std::size_t i = 1; i < active.size(); ++i) {
      active[i] += active[i - 1];
    }
    std::stable_sort(finished.begin(), finished.end(),
                     [](Finished const& a, Finished const& b) { return a.end < b.end; });
    int64_t const pagesAtEnd = mEngine->pagesInUse();
    std::vector<Pending> retries;
    auto stepNanos = [&](Finished const& f) {
      double nanos = 0.0;
      for (std::size_t step = f.start; step < f.start + f.count; ++step) {
        nanos += static_cast<double>(mStepNanos[step]) / static_cast<double>(active[step]);
      }
      return std::llround(nanos);
    };
    for (Finished const& f : finished) {
      SequenceOutcome const& sequence = *f.sequence;
      auto const index = static_cast<std::size_t>(sequence.tag);
      RequestRecord& record = mResult.records[index];
      if (sequence.preempted) {  // reported by the entry that finishes it
        record.decodeHostNanoseconds += stepNanos(f);
        continue;
      }
      ++record.attempts;
      bool const ok = outcome.admitted && completedNormally(sequence.reason);
      if (!ok && outcome.sequences.size() > 1 && record.attempts < 2) {
        // Failed in a batch, or a founding batch the pools could not hold: once more, alone,
        // after the batch drained.
        Pending pending = requeued(index, EngineSequence{});
        pending.sequence.prompt = sequence.prompt;
        pending.sequence.maxNewTokens = record.maxNewTokens;
        pending.sequence.tag = sequence.tag;
        pending.alone = true;
        retries.push_back(std::move(pending));
        ++mResult.retriedRequests;
        continue;
      }
      record.decodeHostNanoseconds += stepNanos(f);
      record.pagesInUseAfter = f.end < steps ? mStepPages[f.end] : pagesAtEnd;
      record.reason = outcome.admitted ? sequence.reason : FinishReason::kNotFinished;
      record.joinedInFlight = sequence.joinedInFlight;
      record.failed = !ok;
      if (ok) {
        record.reusedTokens = sequence.prefillStart;
        record.prefillTokens = record.promptTokens - record.reusedTokens;
        record.generatedTokens = static_cast<int64_t>(sequence.generated.size());
        mCompletedPrompt += record.promptTokens;
        mCompletedReused += record.reusedTokens;
      } else {
        ++mResult.failedRequests;
      }
      ++mCompleted;
      mResult.timeline.push_back(TimelinePoint{
          mCompleted, record.pagesInUseAfter,
          mCompletedPrompt > 0
              ? static_cast<double>(mCompletedReused) / static_cast<double>(mCompletedPrompt)
              : 0.0});
      mSource.finished(
          index, ok ? std::span<int32_t const>(sequence.generated) : std::span<int32_t const>());
    }
    // In reverse (std::views::reverse does not parse under clang-tidy 14 with libstdc++ 12).
    // NOLINTNEXTLINE(modernize-loop-convert)
    for (auto it = retries.rbegin(); it != retries.rend(); ++it) {
      mStaged.push_front(std::move(*it));
      --mHanded;
    }
  }

  void summarize() {
    testing::EngineStats const& stats = mEngine->stats();
    ReplayResult& r = mResult;
    r.tensorParallel.size = mConfig.tensorParallel;
    r.tensorParallel.agreements = mRuntime->tensorParallelStats().agreements;
    r.tensorParallel.divergences = mRuntime->tensorParallelStats().divergences;
    if (r.remoteTier.enabled) {
      ContextCacheCoordinator* coordinator = mRuntime->contextCache();
      (void)coordinator->drainRemoteTier();  // every save in the store before the process ends
      r.remoteTier.counters = coordinator->remoteTierCounters();
    }
    r.joins = stats.joins;
    r.chunkedPrefills = stats.chunkedPrefills;
    r.prefillChunks = stats.prefillChunks;
    r.heldFounders = stats.heldFounders;
    r.preemptions = stats.preemptions;
    r.resumed = stats.resumed;
    r.resumedHostTierTokens = stats.resumedHostTierTokens;
    r.resumedPromptTokens = stats.resumedPromptTokens;
    r.resumedReusedTokens = stats.resumedReusedTokens;
    r.resumedGeneratedTokens = stats.resumedGeneratedTokens;
    std::vector<int64_t> const tbt(stats.timeBetweenTokensSteps.begin(),
                                   stats.timeBetweenTokensSteps.end());
    r.timeBetweenTokensStepsP50 = percentile(tbt, 0.50);
    r.timeBetweenTokensStepsP99 = percentile(tbt, 0.99);
    std::vector<int64_t> const ttft(stats.timeToFirstTokenSteps.begin(),
                                    stats.timeToFirstTokenSteps.end());
    r.timeToFirstTokenStepsP50 = percentile(ttft, 0.50);
    r.timeToFirstTokenStepsP99 = percentile(ttft, 0.99);
    r.promptTokens = stats.promptTokens;
    r.reusedTokens = stats.reusedTokens;
    r.prefillTokensComputed = stats.prefillTokensComputed;
    r.generatedTokens = stats.generatedTokens;
    r.decodeSteps = stats.decodeSteps;
    r.hitRate = r.promptTokens > 0
                    ? static_cast<double>(r.reusedTokens) / static_cast<double>(r.promptTokens)
                    : 0.0;
    r.oracleChecks = stats.oracleChecks;
    r.oracleMismatches = stats.oracleMismatches;
    r.firstMismatch = stats.firstMismatch;
    r.peakPagesInUse = stats.peakPagesInUse;
    r.peakDraftPagesInUse = stats.peakDraftPagesInUse;
    summarizePools(stats);
    r.specRounds = stats.speculativeRounds;
    r.proposedTokens = stats.proposedTokens;
    r.acceptedTokens = stats.acceptedTokens;
    r.draftReusedTokens = stats.draftReusedTokens;
    r.draftReusedPages = stats.draftReusedTokens / mConfig.pageSize;
    r.draftOracleChecks = stats.draftOracleChecks;
    r.draftOracleMismatches = stats.draftOracleMismatches;
    r.hostNsPerStepP50 = percentile(stats.stepHostNanoseconds, 0.50);
    r.hostNsPerStepP99 = percentile(stats.stepHostNanoseconds, 0.99);
    r.hostNsPerStepMean = mean(stats.stepHostNanoseconds);
    r.gpuTimed = mConfig.device == DeviceType::kGPU;
    r.gpuNsPerStepP50 = percentile(stats.stepGpuNanoseconds, 0.50);
    r.gpuNsPerStepP99 = percentile(stats.stepGpuNanoseconds, 0.99);
    r.gpuNsPerStepMean = mean(stats.stepGpuNanoseconds);
    if (ContextCacheCoordinator const* coordinator = mRuntime->contextCache()) {
      ContextCacheMetrics const metrics = coordinator->metrics();
      r.evictedRecords = static_cast<int64_t>(metrics.evictedRecords);
      r.cacheResets = static_cast<int64_t>(metrics.prefixCacheResets);
      summarizeHostTier(metrics, coordinator->counters());
      r.coordinatorCounters = coordinator->counters();
      r.publishedRecords = static_cast<int64_t>(metrics.publishedRecords);
      r.replacedChunkRecords = static_cast<int64_t>(metrics.replacedChunkRecords);
      for (std::size_t i = 0; i < r.missesByReason.size(); ++i) {
        r.missesByReason[i] = static_cast<int64_t>(metrics.misses[i]);
      }
      r.droppedEvents = static_cast<int64_t>(metrics.droppedEvents);
      r.specFullPageReplays = static_cast<int64_t>(metrics.specFullPageReplays);
      r.specPairPublications = static_cast<int64_t>(coordinator->counters().specPairPublications);
      summarizeHybrid(*coordinator);
      if (mConfig.kvEvents != nullptr) {
        BlockIndex const& index = coordinator->manager().index();
        for (PageId page = 0; page < index.pageCapacity(); ++page) {
          if (std::optional<Hash128> const digest = index.digestOf(page)) {
            r.indexedBlockHashes.push_back(digest->lo);
          }
        }
        std::sort(r.indexedBlockHashes.begin(), r.indexedBlockHashes.end());
        if (WindowBlockCache const* window = coordinator->windowCache()) {
          BlockIndex const& windows = window->index();
          for (PageId page = 0; page < windows.pageCapacity(); ++page) {
            if (std::optional<Hash128> const digest = windows.digestOf(page)) {
              r.indexedWindowBlockHashes.push_back(digest->lo);
            }
          }
          std::sort(r.indexedWindowBlockHashes.begin(), r.indexedWindowBlockHashes.end());
        }
      }
    }
    if (BoundedSwaKVPageManager const* swa = mRuntime->swaPageManager()) {
      // Sliding-window reuse: the prefill holds the reused window and every executed prompt page
      // (measured); bounded SWA reserves 2M + 1. Both keep M + 1 in decode.
      r.swaPagesPerSequencePrefill = r.backend == KVCacheBackend::kBoundedSwa
                                         ? swa->privatePagesPerSequence()
                                         : static_cast<int32_t>(stats.peakSwaPagesPerPrefillRow);
      r.swaPagesPerSequenceDecode = swa->decodePagesPerSequence();
      r.swaPeakPagesPerDecodingRow = stats.peakSwaPagesPerDecodingRow;
      if (WindowBlockCache const* window = mRuntime->windowBlockCache()) {
        r.windowCache = {window->publishedBlocks(), window->droppedBlocks(), window->cachedBlocks(),
                         window->evictableReadPages(), window->keptBlocks()};
      }
    }
    if (!mRuntime->shutdown()) {
      throw std::runtime_error("the runtime's shutdown did not drain its quarantine");
    }
  }

  void summarizeHostTier(ContextCacheMetrics const& metrics,
                         ContextCacheCoordinatorCounters const& counters) {
    ReplayResult::HostTier& h = mResult.hostTier;
    h.pages = metrics.hostTierCapacityPages;
    h.bytes = mRuntime->hostTier() != nullptr ? h.pages * mRuntime->hostTier()->bytesPerPage() : 0;
    h.offloadedPages = static_cast<int64_t>(metrics.offloadedPages);
    h.onboardedPages = static_cast<int64_t>(metrics.onboardedPages);
    h.offloadedBytes = static_cast<int64_t>(metrics.offloadedBytes);
    h.onboardedBytes = static_cast<int64_t>(metrics.onboardedBytes);
    h.hitTokens = static_cast<int64_t>(metrics.hostTierHitTokens);
    h.droppedPages = static_cast<int64_t>(metrics.hostTierDroppedPages);
    h.transfers = static_cast<int64_t>(counters.hostTierTransfers);
    h.swappedOutBlocks = static_cast<int64_t>(metrics.swappedOutBlocks);
  }

  void summarizeHybrid(ContextCacheCoordinator const& coordinator) {
    if (mConfig.recurrentLayers == 0) {
      return;
    }
    testing::EngineStats const& stats = mEngine->stats();
    ContextCacheCoordinatorCounters const& counters = coordinator.counters();
    ReplayResult::Hybrid& h = mResult.hybrid;
    if (SnapshotStorage const* snapshots = coordinator.snapshots()) {
      h.recurrentSnapshotSlots = snapshots->config().recurrentSlots;
      h.partialKvSnapshotSlots = snapshots->config().partialKvSlots;
      h.snapshotBytes = snapshots->totalBytes();
    }
    h.checkpointCaptures = static_cast<int64_t>(counters.checkpointCaptures);
    h.checkpointsPublished = static_cast<int64_t>(counters.checkpointPublications);
    h.checkpointsRestored = static_cast<int64_t>(counters.checkpointRestores);
    h.snapshotPressureSkips = static_cast<int64_t>(counters.snapshotPressureSkips);
    h.reusePointCaptures = static_cast<int64_t>(counters.reusePointCaptures);
    h.chunkEndCaptures = static_cast<int64_t>(counters.chunkEndCaptures);
    h.reusePointsPublished = static_cast<int64_t>(counters.reusePointPublications);
    h.reusePointsRestored = static_cast<int64_t>(counters.reusePointRestores);
    h.reusePointsEvicted = static_cast<int64_t>(coordinator.metrics().evictedReusePoints);
    h.reusePointsWritten = stats.reusePointsWritten;
    h.recurrentChecks = stats.recurrentChecks;
    h.recurrentMismatches = stats.recurrentMismatches;
    h.hybridMtp = isHybridMtp(mConfig);
    h.mtpEndpointsPublished = static_cast<int64_t>(counters.hybridMtpPublications);
    h.boundaryHiddenRestores = static_cast<int64_t>(counters.boundaryHiddenRestores);
    h.boundaryHiddenChecks = stats.hiddenChecks;
    h.boundaryHiddenMismatches = stats.hiddenMismatches;
  }

  RequestSource& mSource;
  ReplayConfig mConfig;
  ProgressCallback const& mProgress;
  std::size_t mCount = 0;
  ReplayResult mResult;
  std::unique_ptr<KVCacheRuntime> mRuntime;
  std::unique_ptr<ReferenceEngine> mEngine;  // after mRuntime: destroyed first
  bool mJoins = false;
  std::size_t mFoundersPerRun = 1;

  std::deque<Pending> mStaged;  // materialised, in replay order (retries first)
  std::size_t mNextIndex = 0;   // next request to materialise
  std::size_t mHanded = 0;      // requests handed to the engine
  int64_t mResets = 0;          // prefix cache resets so far (--reset-cache-every)
  int64_t mCompleted = 0;
  int64_t mCompletedPrompt = 0;
  int64_t mCompletedReused = 0;

  // The current run.
  bool mRunJoins = false;
  std::string mRunSalt;
  std::string mRunLora;
  /// Per request: its salt and adapter (the trace's), which it keeps through joins and retries.
  std::vector<EngineIdentity> mIdentities;
  std::deque<EngineSequence> mJoinQueue;
  std::deque<QueuedJoin> mQueuedTags;                      // request of each mJoinQueue entry
  std::unordered_map<std::size_t, std::size_t> mJoinStep;  // joiner -> run-local step
  std::vector<int64_t> mStepNanos;
  std::vector<int64_t> mStepPages;
};

}  // namespace

std::string_view toString(ReplayMode mode) noexcept {
  switch (mode) {
    case ReplayMode::kReuse:
      return "reuse";
    case ReplayMode::kSwa:
      return "swa";
    case ReplayMode::kFull:
      return "full";
  }
  return "unknown";
}

std::string_view toString(ReplayRole role) noexcept {
  switch (role) {
    case ReplayRole::kBoth:
      return "both";
    case ReplayRole::kPrefill:
      return "prefill";
    case ReplayRole::kDecode:
      return "decode";
  }
  return "unknown";
}

std::string_view toString(KvPoolKind kind) noexcept {
  switch (kind) {
    case KvPoolKind::kFull:
      return "full";
    case KvPoolKind::kSwa:
      return "swa";
    case KvPoolKind::kDraft:
      return "draft";
  }
  return "unknown";
}

std::string_view toString(SpeculativeKind kind) noexcept {
  switch (kind) {
    case SpeculativeKind::kNone:
      return "none";
    case SpeculativeKind::kEagle:
      return "eagle";
    case SpeculativeKind::kMtp:
      return "mtp";
  }
  return "unknown";
}

ReplayResult runReplay(RequestSource& source, ReplayConfig const& config,
                       ProgressCallback const& progress, RequestSource* attentionOnly) {
  ReplayResult result = Runner(source, config, progress).run();
  if (config.recurrentLayers > 0 && attentionOnly != nullptr) {
    // The same attention layers, pool and trace with block reuse; reuse does not depend on the
    // oracle, so it is off here.
    ReplayConfig shadow = config;
    shadow.recurrentLayers = 0;
    shadow.snapshotSlots = 0;
    shadow.checkpointInterval = 0;
    shadow.verify = testing::VerifyMode::kNone;
    shadow.kvEvents = nullptr;
    shadow.betweenRuns = nullptr;
    ReplayResult const plain = Runner(*attentionOnly, shadow, {}).run();
    result.hybrid.attentionOnlyRun = true;
    result.hybrid.attentionOnlyReusedTokens = plain.reusedTokens;
    result.hybrid.attentionOnlyHitRate = plain.hitRate;
  }
  return result;
}

ReplayResult runTensorParallelReplay(std::vector<RequestSource*> const& sources,
                                     ReplayConfig const& config, ProgressCallback const& progress) {
  int32_t const size = config.tensorParallel;
  if (size < 2 || sources.size() != static_cast<std::size_t>(size)) {
    configError(
        fmt::format("a tensor-parallel replay needs a size >= 2 and one workload per rank "
                    "(size {}, {} workloads)",
                    size, sources.size()));
  }
  LocalRankGroup group(size);
  int32_t const devices = config.device == DeviceType::kGPU ? cudaDeviceCount() : 0;
  auto const ranks = static_cast<std::size_t>(size);
  std::vector<ReplayResult> results(ranks);
  std::vector<std::exception_ptr> errors(ranks);
  std::vector<std::thread> threads;
  threads.reserve(ranks);
  for (int32_t rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      auto const r = static_cast<std::size_t>(rank);
      ReplayConfig rankConfig = config;
      rankConfig.tensorParallelRank = rank;
      rankConfig.rankAgreement = group.agreement(rank);
      if (rank != 0) {
        rankConfig.kvEvents = nullptr;  // the deployment publishes once
      }
      try {
        if (config.device == DeviceType::kGPU && devices > 0) {
          setCurrentCudaDevice(rank % devices);  // a GPU per rank where there are enough
        }
        results[r] =
            Runner(*sources[r], rankConfig, rank == 0 ? progress : ProgressCallback{}).run();
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) {
    thread.join();
  }
  for (std::exception_ptr const& error : errors) {
    if (error) {
      std::rethrow_exception(error);
    }
  }
  ReplayResult result = std::move(results[0]);
  ReplayResult::TensorParallel& tp = result.tensorParallel;
  tp.devices = devices > 0 ? std::min(devices, size) : 0;
  tp.oracleChecksAllRanks = result.oracleChecks;
  tp.oracleMismatchesAllRanks = result.oracleMismatches;
  for (std::size_t r = 1; r < ranks; ++r) {
    tp.oracleChecksAllRanks += results[r].oracleChecks;
    tp.oracleMismatchesAllRanks += results[r].oracleMismatches;
    std::string const difference = firstDifference(result, results[r]);
    if (tp.ranksIdentical && !difference.empty()) {
      tp.ranksIdentical = false;
      tp.firstDifference = fmt::format("rank {}: {}", r, difference);
    }
  }
  return result;
}

}  // namespace mkv::replay
