// Admission of a 32k-token prompt through ContextCacheManager (target: lookup + acquire
// <= 50 µs with token verification on, docs/benchmarks.md, "What is measured, and how"), cold
// and with 50 % / 95 % of its blocks cached, token verification on and off:
//   * BM_Lookup: hashing and planning only (pure);
//   * BM_LookupAcquire: admit, the coordinator's one call per sequence (lookup,
//     pins, private pages, metrics), and the lease's release (a few µs of it);
//   * BM_LookupAcquirePublish: lookup, acquire and publication of the whole prompt in the steady
//     state of a full record store: every iteration's prompt has its own suffix, so each
//     publication indexes the new blocks and evicts the first victim of the record store; at
//     page 128 with verification, under each eviction policy (BM_LookupAcquirePublishByPolicy,
//     `policy` 0 = LRU, 1 = S3-FIFO, 2 = loop-aware).

#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "host_bench_support.h"

namespace mkv::bench {
namespace {

constexpr int32_t kPromptTokens = 32768;
constexpr int32_t kRecordLimit = 4;

void managerCases(benchmark::internal::Benchmark* b) {
  b->ArgNames({"page", "hit", "verify"});
  for (int64_t page : {16, 64, 128}) {  // 128: KVCacheRuntimeConfig's default
    for (int64_t hit : {0, 50, 95}) {
      for (int64_t verify : {1, 0}) {
        b->Args({page, hit, verify});
      }
    }
  }
  b->Unit(benchmark::kMicrosecond);
}

/// BM_LookupAcquirePublishByPolicy's grid: page 128, verification on, each policy.
void publishCases(benchmark::internal::Benchmark* b) {
  b->ArgNames({"page", "hit", "verify", "policy"});
  for (int64_t policy : {0, 1, 2}) {
    for (int64_t hit : {0, 50, 95}) {
      b->Args({128, hit, 1, policy});
    }
  }
  b->Unit(benchmark::kMicrosecond);
}

ContextCacheManagerOptions managerOptions(bool verify, EvictionPolicyKind policy) {
  ContextCacheManagerOptions options;
  options.verifyTokens = verify;
  options.evictionPolicy = policy;
  return options;
}

/// A manager whose cache holds one published 32k prompt, and a query prompt that shares its
/// first `hit` percent of blocks with it and differs from there on.
class ManagerRig {
 public:
  ManagerRig(int32_t page, int32_t hitPercent, bool verify, EvictionPolicyKind policy)
      : mPage(page),
        mHitBlocks(kPromptTokens / page * hitPercent / 100),
        mManager(page, ResourceDemand{(kRecordLimit + 4) * (kPromptTokens / page + 1), 0, 0, 0},
                 kRecordLimit, managerOptions(verify, policy)),
        mCached(randomTokens(kPromptTokens, 11)),
        mQuery(mCached) {
    LookupRequest cached = requestOf(mCached);
    AdmissionResult admitted = mManager.admit(cached);
    mManager.publish(*admitted.lease, hashPromptBlocks(cached.prompt, page), kPromptTokens);
    makeUnique(0);
  }

  /// Gives the query a suffix no earlier query had (from its first uncached block on).
  void makeUnique(int64_t serial) {
    mQuery[static_cast<std::size_t>(mHitBlocks * mPage)] = uniqueToken(serial);
  }
  LookupRequest query() const { return requestOf(mQuery); }
  ContextCacheManager& manager() noexcept { return mManager; }
  int32_t hitTokens() const noexcept { return mHitBlocks * mPage; }

 private:
  static LookupRequest requestOf(std::vector<int32_t> const& tokens) {
    LookupRequest request;
    request.prompt = PromptView{tokens, {}, {}};
    request.baseExtraTokens = 1;  // the lookahead token's slot, as the coordinator asks
    return request;
  }

  int32_t mPage;
  int32_t mHitBlocks;
  ContextCacheManager mManager;
  std::vector<int32_t> mCached;
  std::vector<int32_t> mQuery;
};

ManagerRig makeRig(benchmark::State const& state,
                   EvictionPolicyKind policy = EvictionPolicyKind::kLru) {
  return ManagerRig(static_cast<int32_t>(state.range(0)), static_cast<int32_t>(state.range(1)),
                    state.range(2) != 0, policy);
}

void BM_Lookup(benchmark::State& state) {
  ManagerRig rig = makeRig(state);
  LookupRequest const request = rig.query();
  for (auto _ : state) {
    LookupResult result = rig.manager().lookup(request);
    benchmark::DoNotOptimize(result.plan.reuseTokenLength);
  }
  if (rig.manager().lookup(request).plan.reuseTokenLength != rig.hitTokens()) {
    state.SkipWithError("unexpected reuse length");
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_Lookup)->Apply(managerCases);

void BM_LookupAcquire(benchmark::State& state) {
  ManagerRig rig = makeRig(state);
  LookupRequest const request = rig.query();
  for (auto _ : state) {
    AdmissionResult admitted = rig.manager().admit(request);
    if (!admitted.lease || admitted.plan.reuseTokenLength != rig.hitTokens()) {
      state.SkipWithError("admission failed or reused an unexpected length");
      break;
    }
  }  // the lease is released at the end of every iteration
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_LookupAcquire)->Apply(managerCases);

void lookupAcquirePublish(benchmark::State& state, EvictionPolicyKind policy) {
  ManagerRig rig = makeRig(state, policy);
  ContextCacheManager& manager = rig.manager();
  int64_t serial = 1;
  for (auto _ : state) {
    rig.makeUnique(serial++);
    LookupRequest const request = rig.query();
    LookupResult looked = manager.lookup(request);
    AcquireResult acquired = manager.acquire(looked.plan);
    if (!acquired.lease) {
      state.SkipWithError("acquisition failed");
      break;
    }
    PublishResult const published = manager.publish(*acquired.lease, looked.blocks, kPromptTokens);
    if (published.status != PublishStatus::kPublished ||
        looked.plan.reuseTokenLength != rig.hitTokens()) {
      state.SkipWithError("publication failed or reused an unexpected length");
      break;
    }
  }
  state.counters["records"] = static_cast<double>(manager.records().size());
  setTokenCounters(state, kPromptTokens);
}
void BM_LookupAcquirePublish(benchmark::State& state) {
  lookupAcquirePublish(state, EvictionPolicyKind::kLru);
}
BENCHMARK(BM_LookupAcquirePublish)->Apply(managerCases);

void BM_LookupAcquirePublishByPolicy(benchmark::State& state) {
  constexpr EvictionPolicyKind kPolicies[] = {EvictionPolicyKind::kLru, EvictionPolicyKind::kS3Fifo,
                                              EvictionPolicyKind::kLoopAware};
  lookupAcquirePublish(state, kPolicies[state.range(3)]);
}
BENCHMARK(BM_LookupAcquirePublishByPolicy)->Apply(publishCases);

/// The host tier's lookup cost: the cached 32k prompt was evicted from a GPU pool that holds one
/// prompt into a host tier, so the query's `hit` percent of blocks are all on the host (page 128,
/// verification on). Next to BM_Lookup / BM_LookupAcquire with the same page and hit, where the
/// blocks are on the GPU: the same walk, in the host tier's index instead.
class HostTierRig {
 public:
  explicit HostTierRig(int32_t hitPercent)
      : mHitBlocks(kPromptTokens / kPage * hitPercent / 100),
        mManager(kPage, ResourceDemand{kPromptTokens / kPage + 2, 0, 0, 0}, kRecordLimit,
                 options()),
        mCached(randomTokens(kPromptTokens, 11)),
        mQuery(mCached) {
    publish(mCached);
    publish(randomTokens(kPromptTokens, 12));  // evicts the first prompt to the host tier
    (void)mManager.takeHostTransfers();
    mQuery[static_cast<std::size_t>(mHitBlocks * kPage)] = uniqueToken(0);
  }

  LookupRequest query() const {
    LookupRequest request;
    request.prompt = PromptView{mQuery, {}, {}};
    request.baseExtraTokens = 1;
    return request;
  }
  ContextCacheManager& manager() noexcept { return mManager; }
  int32_t hitTokens() const noexcept { return mHitBlocks * kPage; }

 private:
  static constexpr int32_t kPage = 128;
  static ContextCacheManagerOptions options() {
    ContextCacheManagerOptions o = managerOptions(true, EvictionPolicyKind::kLru);
    o.hostTierPages = 2 * (kPromptTokens / kPage + 2);
    return o;
  }
  void publish(std::vector<int32_t> const& tokens) {
    LookupRequest request;
    request.prompt = PromptView{tokens, {}, {}};
    request.policy = ContextCacheLookupPolicy::kBypass;
    AdmissionResult admitted = mManager.admit(request);
    mManager.publish(*admitted.lease, hashPromptBlocks(request.prompt, kPage), kPromptTokens);
  }

  int32_t mHitBlocks;
  ContextCacheManager mManager;
  std::vector<int32_t> mCached;
  std::vector<int32_t> mQuery;
};

void hostTierCases(benchmark::internal::Benchmark* b) {
  b->ArgNames({"hit"});
  for (int64_t hit : {50, 95}) {
    b->Args({hit});
  }
  b->Unit(benchmark::kMicrosecond);
}

void BM_LookupFromHostTier(benchmark::State& state) {
  HostTierRig rig(static_cast<int32_t>(state.range(0)));
  LookupRequest const request = rig.query();
  for (auto _ : state) {
    LookupResult result = rig.manager().lookup(request);
    benchmark::DoNotOptimize(result.plan.reuseTokenLength);
  }
  LookupResult const check = rig.manager().lookup(request);
  if (check.plan.reuseTokenLength != rig.hitTokens() ||
      check.plan.hostOnboardPages.size() * 128 != static_cast<std::size_t>(rig.hitTokens())) {
    state.SkipWithError("the hit is not all on the host tier");
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_LookupFromHostTier)->Apply(hostTierCases);

/// admit with onboarding: lookup, the host pins, private pages, the onboarding list; the lease's
/// release and the (discarded) transfer list every iteration.
void BM_LookupAcquireFromHostTier(benchmark::State& state) {
  HostTierRig rig(static_cast<int32_t>(state.range(0)));
  LookupRequest const request = rig.query();
  for (auto _ : state) {
    AdmissionResult admitted = rig.manager().admit(request);
    if (!admitted.lease || admitted.plan.hostOnboardPages.empty()) {
      state.SkipWithError("admission failed or onboarded nothing");
      break;
    }
    HostTransfers const moves = rig.manager().takeHostTransfers();
    benchmark::DoNotOptimize(moves.onboards.size());
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_LookupAcquireFromHostTier)->Apply(hostTierCases);

}  // namespace
}  // namespace mkv::bench
