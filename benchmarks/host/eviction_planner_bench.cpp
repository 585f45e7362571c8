// EvictionPlanner::plan over a full cache: linear in the victims, not in the records
// (docs/context_cache.md, "Eviction").
// Every record holds kPagesPerRecord pages of its own, cached and unpinned; no page is free, so a
// demand of v * kPagesPerRecord pages needs exactly the v least recently used records. The grid
// varies the records (10^4, 10^5) at a fixed number of victims and the victims at a fixed number
// of records: the time per plan should follow the victims column only. `policy` 0 is LRU, 1 is
// S3-FIFO (records never hit: its walk reads the small queue, then the main one).

#include <benchmark/benchmark.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "context_cache/eviction_planner.h"
#include "host_bench_support.h"

namespace mkv::bench {
namespace {

constexpr int32_t kPagesPerRecord = 8;

/// Pools, records and a planner of `records` disjoint records; built once per size.
struct FullCache {
  FullCache(int32_t records, EvictionPolicyKind policy)
      : pools(ResourceDemand{records * kPagesPerRecord, 0, 0, 0}),
        store(policy),
        planner(pools.capacities()) {
    for (int32_t r = 0; r < records; ++r) {
      CacheRecord record;
      if (!pools.allocate(ResourceDemand{kPagesPerRecord, 0, 0, 0},
                          {&record.basePagePath, nullptr, nullptr, nullptr})) {
        throw std::runtime_error("FullCache: allocation failed");
      }
      for (int32_t b = 0; b < kPagesPerRecord; ++b) {
        record.logicalBlockDigests.push_back(
            Hash128{static_cast<uint64_t>(r) + 1, static_cast<uint64_t>(b) + 1});
      }
      record.key = RecordKey{record.logicalBlockDigests.back(), kPagesPerRecord};
      for (PageId page : record.basePagePath) {
        pools.addCache({ResourceType::kBaseKvPage, page});
        pools.dropActive({ResourceType::kBaseKvPage, page});  // published, no lease left
      }
      store.insert(std::move(record));
    }
  }

  ResourcePools pools;
  RecordStore store;
  EvictionPlanner planner;
};

FullCache& fullCache(int32_t records, EvictionPolicyKind policy) {
  static std::map<std::pair<int32_t, EvictionPolicyKind>, std::unique_ptr<FullCache>> caches;
  std::unique_ptr<FullCache>& cache = caches[{records, policy}];
  if (!cache) {
    cache = std::make_unique<FullCache>(records, policy);
  }
  return *cache;
}

void BM_EvictionPlan(benchmark::State& state) {
  auto const records = static_cast<int32_t>(state.range(0));
  auto const victims = static_cast<int32_t>(state.range(1));
  auto const policy = static_cast<EvictionPolicyKind>(state.range(2));
  FullCache& cache = fullCache(records, policy);
  ResourceDemand const demand{victims * kPagesPerRecord, 0, 0, 0};
  for (auto _ : state) {
    EvictionPlan plan = cache.planner.plan(demand, cache.pools, cache.store);
    benchmark::DoNotOptimize(plan.victims.data());
    if (!plan.feasible || plan.victims.size() != static_cast<std::size_t>(victims)) {
      state.SkipWithError("unexpected plan");
      break;
    }
  }
  state.counters["records"] = static_cast<double>(records);
  state.counters["victims"] = static_cast<double>(victims);
  state.counters["ns_per_victim"] = secondsPer(static_cast<double>(victims));
}
void planCases(benchmark::internal::Benchmark* b) {
  b->ArgNames({"records", "victims", "policy"});
  for (int64_t policy : {0, 1}) {
    for (auto [records, victims] : {std::pair<int64_t, int64_t>{10000, 10},
                                    {100000, 10},
                                    {10000, 100},
                                    {100000, 100},
                                    {10000, 1000},
                                    {100000, 1000},
                                    {100000, 10000}}) {
      b->Args({records, victims, policy});
    }
  }
  b->Unit(benchmark::kMicrosecond);
}
BENCHMARK(BM_EvictionPlan)->Apply(planCases);

}  // namespace
}  // namespace mkv::bench
