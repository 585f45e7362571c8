// Block digest throughput of a 32k-token prompt (target: <= 1 ns per token incl. chaining,
// docs/benchmarks.md, "What is measured, and how"), side by side with the schemes of peer
// systems, every one chained parent -> block:
//   * managedkv: hashPromptBlocks (keys, token and media digests: what a lookup hashes),
//     hashPromptBlocks + every content key (what a cold publication adds: the token-only chain,
//     computed on demand) and hashFullBlocks (keys only), chained XXH3-128;
//   * SHA-256 (OpenSSL EVP): digest = SHA-256(parent digest || block token bytes), vLLM's default
//     since v0.10.2 (its pickling of the tuple is left out, which only favours it);
//   * FNV-1a-128, byte-wise: state = (state ^ byte) * prime mod 2^128 over the parent digest bytes
//     then the token bytes, little-endian (the reference engine's scheme).
// Token verification does not enter a digest; its cost shows in the lookup benchmarks
// (context_cache_manager_bench.cpp). Ratios: docs/benchmarks.md, "What is measured, and how".

#include <benchmark/benchmark.h>
#include <openssl/evp.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "context_cache/block_hash.h"
#include "host_bench_support.h"

namespace mkv::bench {
namespace {

constexpr int32_t kPromptTokens = 32768;

void pageSizes(benchmark::internal::Benchmark* b) {
  b->ArgName("page");
  for (int64_t page : {16, 64, 128}) {
    b->Arg(page);
  }
}

std::vector<int32_t> const& prompt() {
  static std::vector<int32_t> const tokens = randomTokens(kPromptTokens, 7);
  return tokens;
}

void BM_HashPromptBlocks(benchmark::State& state) {
  auto const page = static_cast<int32_t>(state.range(0));
  PromptView const view{prompt(), {}, {}};
  for (auto _ : state) {
    PromptBlocks blocks = hashPromptBlocks(view, page);
    benchmark::DoNotOptimize(blocks.keys.data());
    benchmark::DoNotOptimize(blocks.tokenDigests.data());
    benchmark::ClobberMemory();
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_HashPromptBlocks)->Apply(pageSizes);

void BM_HashPromptBlocksAndContentChain(benchmark::State& state) {
  auto const page = static_cast<int32_t>(state.range(0));
  PromptView const view{prompt(), {}, {}};
  for (auto _ : state) {
    PromptBlocks blocks = hashPromptBlocks(view, page);
    Hash128 last = blocks.contentKey(blocks.fullBlockCount() - 1);
    benchmark::DoNotOptimize(blocks.keys.data());
    benchmark::DoNotOptimize(last);
    benchmark::ClobberMemory();
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_HashPromptBlocksAndContentChain)->Apply(pageSizes);

void BM_HashFullBlocks(benchmark::State& state) {
  auto const page = static_cast<int32_t>(state.range(0));
  PromptView const view{prompt(), {}, {}};
  for (auto _ : state) {
    std::vector<Hash128> keys = hashFullBlocks(view, page);
    benchmark::DoNotOptimize(keys.data());
    benchmark::ClobberMemory();
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_HashFullBlocks)->Apply(pageSizes);

// ---------------------------------------------------------------- SHA-256 (OpenSSL EVP)

using Sha256Digest = std::array<unsigned char, 32>;

struct EvpMdDeleter {
  void operator()(EVP_MD* md) const noexcept { EVP_MD_free(md); }
};
struct EvpContextDeleter {
  void operator()(EVP_MD_CTX* ctx) const noexcept { EVP_MD_CTX_free(ctx); }
};

/// Chained SHA-256 block digests; false when OpenSSL reports an error.
bool sha256Chain(EVP_MD_CTX* ctx, EVP_MD const* md, std::span<int32_t const> tokens,
                 std::size_t page, std::vector<Sha256Digest>& out) {
  Sha256Digest parent{};  // root: all zero
  std::size_t const count = tokens.size() / page;
  out.resize(count);
  for (std::size_t b = 0; b < count; ++b) {
    if (EVP_DigestInit_ex(ctx, md, nullptr) != 1 ||
        EVP_DigestUpdate(ctx, parent.data(), parent.size()) != 1 ||
        EVP_DigestUpdate(ctx, tokens.data() + b * page, page * sizeof(int32_t)) != 1 ||
        EVP_DigestFinal_ex(ctx, parent.data(), nullptr) != 1) {
      return false;
    }
    out[b] = parent;
  }
  return true;
}

void BM_Sha256Chain(benchmark::State& state) {
  auto const page = static_cast<std::size_t>(state.range(0));
  // Fetched once, as a long-lived hasher would (an implicit fetch per Init costs extra).
  std::unique_ptr<EVP_MD, EvpMdDeleter> const md(EVP_MD_fetch(nullptr, "SHA256", nullptr));
  std::unique_ptr<EVP_MD_CTX, EvpContextDeleter> const ctx(EVP_MD_CTX_new());
  if (!md || !ctx) {
    state.SkipWithError("OpenSSL: SHA256 unavailable");
    return;
  }
  std::vector<Sha256Digest> keys;
  for (auto _ : state) {
    keys.clear();
    keys.shrink_to_fit();  // a fresh output per prompt, as hashFullBlocks returns one
    if (!sha256Chain(ctx.get(), md.get(), prompt(), page, keys)) {
      state.SkipWithError("OpenSSL: digest failed");
      return;
    }
    benchmark::DoNotOptimize(keys.data());
    benchmark::ClobberMemory();
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_Sha256Chain)->Apply(pageSizes);

// ---------------------------------------------------------------- FNV-1a-128, byte-wise

__extension__ typedef unsigned __int128 Uint128;  // GCC/Clang extension; -Wpedantic otherwise

constexpr Uint128 kFnvOffsetBasis =
    (static_cast<Uint128>(0x6C62272E07BB0142ULL) << 64) | 0x62B821756295C58DULL;
constexpr Uint128 kFnvPrime = (static_cast<Uint128>(1) << 88) | 0x13BU;  // 2^88 + 2^8 + 0x3B

Uint128 fnv1a(Uint128 state, unsigned char const* bytes, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    state = (state ^ bytes[i]) * kFnvPrime;
  }
  return state;
}

void fnv1aChain(std::span<int32_t const> tokens, std::size_t page, std::vector<Uint128>& out) {
  Uint128 parent = 0;  // root
  std::size_t const count = tokens.size() / page;
  out.resize(count);
  for (std::size_t b = 0; b < count; ++b) {
    std::array<unsigned char, sizeof(Uint128)> parentBytes{};
    std::memcpy(parentBytes.data(), &parent, sizeof(parent));  // little-endian host
    Uint128 state = fnv1a(kFnvOffsetBasis, parentBytes.data(), parentBytes.size());
    state = fnv1a(state, reinterpret_cast<unsigned char const*>(tokens.data() + b * page),
                  page * sizeof(int32_t));
    parent = state;
    out[b] = state;
  }
}

void BM_Fnv1a128Chain(benchmark::State& state) {
  auto const page = static_cast<std::size_t>(state.range(0));
  std::vector<Uint128> keys;
  for (auto _ : state) {
    keys.clear();
    keys.shrink_to_fit();
    fnv1aChain(prompt(), page, keys);
    benchmark::DoNotOptimize(keys.data());
    benchmark::ClobberMemory();
  }
  setTokenCounters(state, kPromptTokens);
}
BENCHMARK(BM_Fnv1a128Chain)->Apply(pageSizes);

}  // namespace
}  // namespace mkv::bench
