// Bytes per second of the remote tier's transport on one store (docs/benchmarks.md, "Remote
// tier"): one put of a block value, and one pipelined get of 1 or 16 values, at the value sizes of
// a tiny model's page and of a Llama-3-8B page (32 layers, 8 KV heads, head size 128, fp16: 2 MiB
// per 16-token page, 8 MiB per 64-token page). The store is the one MKV_REMOTE_URL names
// (redis://127.0.0.1:PORT of a server started for the run, or file:///DIR); each benchmark
// writes its own keys first. Bytes counted are the values' bytes.

#include <benchmark/benchmark.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mkv/remote/open_remote_kv_store.h"

namespace mkv::bench {
namespace {

std::unique_ptr<RemoteKvStore> openFromEnvironment(benchmark::State& state) {
  char const* url = std::getenv("MKV_REMOTE_URL");
  if (url == nullptr || *url == '\0') {
    state.SkipWithError("set MKV_REMOTE_URL (redis://127.0.0.1:PORT or file:///DIR)");
    return nullptr;
  }
  RemoteKvStoreOptions options;
  options.timeout = std::chrono::milliseconds(10000);
  return openRemoteKvStore(url, options);
}

std::string valueOf(int64_t bytes) {
  std::string value(static_cast<std::size_t>(bytes), '\0');
  for (std::size_t i = 0; i < value.size(); ++i) {
    value[i] = static_cast<char>(i * 131 + 7);
  }
  return value;
}

void valueSizes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bytes", "batch"});
  for (int64_t bytes : {int64_t{64} << 10, int64_t{2} << 20, int64_t{8} << 20}) {
    for (int64_t batch : {1, 16}) {
      b->Args({bytes, batch});
    }
  }
  b->UseRealTime();
}

void remoteStorePut(benchmark::State& state) {
  std::unique_ptr<RemoteKvStore> store = openFromEnvironment(state);
  if (!store) {
    return;
  }
  std::string const value = valueOf(state.range(0));
  auto const batch = static_cast<int32_t>(state.range(1));
  int64_t round = 0;
  for (auto _ : state) {
    for (int32_t i = 0; i < batch; ++i) {
      std::string const key = "mkv-bench:put:" + std::to_string(i);
      if (store->put(key, value) != RemoteStoreStatus::kOk) {
        state.SkipWithError("put failed");
        return;
      }
    }
    ++round;
  }
  state.SetBytesProcessed(round * batch * state.range(0));
}
BENCHMARK(remoteStorePut)->Apply(valueSizes);

void remoteStoreGet(benchmark::State& state) {
  std::unique_ptr<RemoteKvStore> store = openFromEnvironment(state);
  if (!store) {
    return;
  }
  std::string const value = valueOf(state.range(0));
  auto const batch = static_cast<std::size_t>(state.range(1));
  std::vector<std::string> keys;
  for (std::size_t i = 0; i < batch; ++i) {
    keys.push_back("mkv-bench:get:" + std::to_string(i));
    if (store->put(keys.back(), value) != RemoteStoreStatus::kOk) {
      state.SkipWithError("put failed");
      return;
    }
  }
  std::vector<std::optional<std::string>> values;
  int64_t round = 0;
  for (auto _ : state) {
    if (store->get(keys, values) != RemoteStoreStatus::kOk || !values.back()) {
      state.SkipWithError("get failed");
      return;
    }
    benchmark::DoNotOptimize(values.back()->data());
    ++round;
  }
  state.SetBytesProcessed(round * static_cast<int64_t>(batch) * state.range(0));
}
BENCHMARK(remoteStoreGet)->Apply(valueSizes);

}  // namespace
}  // namespace mkv::bench
