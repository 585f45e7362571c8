// Replays the first 500 requests of the Mooncake FAST'25 synthetic trace (tests/data, see its
// README) through KVCacheRuntime (context reuse) + ManagedKVCacheRequest + the reference engine,
// one request at a time on an unbounded pool, and checks the reuse against an independent
// page-aligned longest-prefix computation over the same token streams. The oracle samples the KV
// of every step (all reused positions are verified).
#include <gtest/gtest.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/testing/reference_engine.h"
#include "support/test_inputs.h"

namespace mkv::test {
namespace {

constexpr int32_t kPage = 128;
constexpr int32_t kTraceBlock = 512;  // tokens per Mooncake hash id

struct TraceRequest {
  int64_t timestamp = 0;
  int32_t inputLength = 0;
  int32_t outputLength = 0;
  std::vector<int64_t> hashIds;
};

/// The text after `"key":` in a flat JSON object, or nullopt.
std::optional<std::string_view> valueOf(std::string_view line, std::string_view key) {
  std::size_t position = 0;
  while (true) {
    position = line.find(key, position);
    if (position == std::string_view::npos) {
      return std::nullopt;
    }
    std::size_t const after = position + key.size();
    if (position > 0 && line[position - 1] == '"' && after < line.size() && line[after] == '"') {
      position = after + 1;
      break;
    }
    position = after;
  }
  position = line.find(':', position);
  if (position == std::string_view::npos) {
    return std::nullopt;
  }
  position = line.find_first_not_of(" \t", position + 1);
  if (position == std::string_view::npos) {
    return std::nullopt;
  }
  return line.substr(position);
}

/// The integer at the start of `text` (after blanks); nullopt when there is none.
std::optional<int64_t> integerAt(std::string_view text) {
  std::size_t const begin = text.find_first_not_of(" \t");
  if (begin == std::string_view::npos) {
    return std::nullopt;
  }
  int64_t value = 0;
  auto const [end, error] = std::from_chars(text.data() + begin, text.data() + text.size(), value);
  if (error != std::errc{}) {
    return std::nullopt;
  }
  return value;
}

/// A minimal reader of the trace's flat JSONL (integer fields and one integer array per line);
/// the full parser belongs to mkv-replay.
std::optional<TraceRequest> parseLine(std::string_view line) {
  TraceRequest request;
  auto const timestamp = valueOf(line, "timestamp");
  auto const input = valueOf(line, "input_length");
  auto const output = valueOf(line, "output_length");
  auto const ids = valueOf(line, "hash_ids");
  if (!timestamp || !input || !output || !ids || ids->empty() || ids->front() != '[') {
    return std::nullopt;
  }
  auto const t = integerAt(*timestamp);
  auto const n = integerAt(*input);
  auto const m = integerAt(*output);
  if (!t || !n || !m) {
    return std::nullopt;
  }
  request.timestamp = *t;
  request.inputLength = static_cast<int32_t>(*n);
  request.outputLength = static_cast<int32_t>(*m);
  std::string_view rest = ids->substr(1);
  while (true) {
    std::size_t const next = rest.find_first_not_of(" \t,");
    if (next == std::string_view::npos) {
      return std::nullopt;  // no closing bracket
    }
    if (rest[next] == ']') {
      break;
    }
    auto const id = integerAt(rest.substr(next));
    if (!id) {
      return std::nullopt;
    }
    request.hashIds.push_back(*id);
    rest = rest.substr(rest.find_first_of(",]", next));
  }
  return request;
}

std::vector<TraceRequest> readTrace(std::filesystem::path const& path, std::size_t limit) {
  std::ifstream in(path);
  std::vector<TraceRequest> requests;
  std::string line;
  while (requests.size() < limit && std::getline(in, line)) {
    if (line.empty()) {
      continue;
    }
    std::optional<TraceRequest> request = parseLine(line);
    EXPECT_TRUE(request.has_value()) << "unreadable trace line " << requests.size() + 1;
    if (request) {
      requests.push_back(std::move(*request));
    }
  }
  return requests;
}

uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

/// Block id -> its 512 token ids, deterministically; the last block is cut at input_length.
std::vector<int32_t> expandPrompt(TraceRequest const& request) {
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<std::size_t>(request.inputLength));
  for (int64_t id : request.hashIds) {
    for (int32_t i = 0;
         i < kTraceBlock && static_cast<int32_t>(tokens.size()) < request.inputLength; ++i) {
      constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;
      uint64_t const block = static_cast<uint64_t>(id);
      uint64_t const offset = static_cast<uint32_t>(i);
      uint64_t const h = mix64(block * kGolden + offset);
      tokens.push_back(1000 + static_cast<int32_t>(h % 30000));
    }
  }
  return tokens;
}

/// Independent reuse model: the set of published page-aligned prefixes, each named by a chained
/// 64-bit digest of its pages.
class PrefixSet {
 public:
  /// Longest published page-aligned prefix, one page less when it is the whole page-aligned
  /// prompt (its last token is recomputed for logits).
  int32_t reuse(std::vector<int32_t> const& prompt) const {
    int32_t const pages = static_cast<int32_t>(prompt.size()) / kPage;
    uint64_t chain = 0;
    int32_t matched = 0;
    while (matched < pages) {
      chain = step(chain, prompt, matched);
      if (!mPages.contains(chain)) {
        break;
      }
      ++matched;
    }
    if (matched == pages && pages > 0 && prompt.size() % kPage == 0) {
      --matched;
    }
    return matched * kPage;
  }
  /// Publishes the full pages of tokens[0, committed).
  void publish(std::vector<int32_t> const& tokens, int32_t committed) {
    uint64_t chain = 0;
    for (int32_t page = 0; page < committed / kPage; ++page) {
      chain = step(chain, tokens, page);
      mPages.insert(chain);
    }
  }
  std::size_t size() const { return mPages.size(); }

 private:
  static uint64_t step(uint64_t chain, std::vector<int32_t> const& tokens, int32_t page) {
    uint64_t h = mix64(chain + 0x632BE59BD9B4E019ULL);
    for (int32_t i = page * kPage; i < (page + 1) * kPage; ++i) {
      h = mix64(h ^ static_cast<uint32_t>(tokens[static_cast<std::size_t>(i)]));
    }
    return h;
  }
  std::unordered_set<uint64_t> mPages;
};

TEST(MooncakeReuseTest, First500RequestsReuseWhatALongestPrefixModelPredicts) {
  MKV_TEST_INPUT_OR_SKIP(path, "tests/data/mooncake_first500.jsonl");
  std::vector<TraceRequest> const trace = readTrace(path, 500);
  ASSERT_EQ(trace.size(), 500u);
  std::vector<std::vector<int32_t>> prompts;
  int64_t pagesWithoutSharing = 0;
  int32_t longest = 0;
  for (TraceRequest const& request : trace) {
    ASSERT_GT(request.inputLength, 0);
    ASSERT_GT(request.outputLength, 0);
    ASSERT_EQ(request.hashIds.size(),
              static_cast<std::size_t>((request.inputLength + kTraceBlock - 1) / kTraceBlock));
    prompts.push_back(expandPrompt(request));
    int32_t const total = request.inputLength + request.outputLength;
    pagesWithoutSharing += (total + kPage) / kPage;
    longest = std::max(longest, total + 1);
  }

  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 1;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.model.kvDataType = DataType::kFloat16;
  config.maxBatchSize = 1;
  config.maxSequenceLength = longest;
  config.tokensPerPage = kPage;
  config.numPages = static_cast<int32_t>(pagesWithoutSharing);  // unbounded: nothing is evicted
  config.contextReuse = true;
  config.contextCache.maxRecords = 1 << 20;
  config.deviceType = DeviceType::kCPU;
  auto runtime = KVCacheRuntime::create(config);
  testing::ReferenceEngineOptions options;
  options.verify = testing::VerifyMode::kSample;
  testing::ReferenceEngine engine(*runtime, options);

  PrefixSet model;
  int64_t predicted = 0;
  int64_t promptTokens = 0;
  int32_t mismatchedRequests = 0;
  for (std::size_t r = 0; r < trace.size(); ++r) {
    testing::EngineRequest request;
    testing::EngineSequence sequence;
    sequence.prompt = prompts[r];
    sequence.maxNewTokens = trace[r].outputLength;
    sequence.tag = static_cast<int64_t>(r);
    request.sequences.push_back(std::move(sequence));
    testing::RequestOutcome const outcome = engine.run(request);
    ASSERT_TRUE(outcome.admitted) << "request " << r;
    ASSERT_FALSE(outcome.failed) << "request " << r;
    testing::SequenceOutcome const& result = outcome.sequences.at(0);
    ASSERT_EQ(result.reason, FinishReason::kLength);
    ASSERT_EQ(result.generated.size(), static_cast<std::size_t>(trace[r].outputLength));

    int32_t const expected = model.reuse(prompts[r]);
    predicted += expected;
    promptTokens += static_cast<int64_t>(prompts[r].size());
    if (result.prefillStart != expected && ++mismatchedRequests <= 5) {
      ADD_FAILURE() << "request " << r << " reused " << result.prefillStart << ", the model "
                    << expected;
    }
    // Published: the prompt at prefill, then every token with KV (the last sampled one has none).
    std::vector<int32_t> ledger = prompts[r];
    ledger.insert(ledger.end(), result.generated.begin(), result.generated.end());
    model.publish(ledger, static_cast<int32_t>(ledger.size()) - 1);
  }
  testing::EngineStats const& stats = engine.stats();
  EXPECT_EQ(mismatchedRequests, 0);
  EXPECT_EQ(stats.reusedTokens, predicted);
  EXPECT_EQ(stats.promptTokens, promptTokens);
  EXPECT_EQ(static_cast<int64_t>(runtime->contextCache()->metrics().reusedTokens), predicted);
  EXPECT_EQ(runtime->contextCache()->metrics().evictedRecords, 0u);
  EXPECT_EQ(stats.oracleMismatches, 0);
  EXPECT_GT(stats.oracleChecks, stats.reusedTokens);
  EXPECT_GT(predicted, 0);
  double const hitRate =
      static_cast<double>(stats.reusedTokens) / static_cast<double>(promptTokens);
  std::cout << "[ mooncake ] " << trace.size() << " requests, " << promptTokens
            << " prompt tokens, " << stats.reusedTokens << " reused (hit rate " << hitRate << "), "
            << stats.prefillTokensComputed << " computed, " << model.size()
            << " published pages, peak " << stats.peakPagesInUse << " pages, " << stats.oracleChecks
            << " oracle checks\n";
  RecordProperty("prompt_tokens", std::to_string(promptTokens));
  RecordProperty("reused_tokens", std::to_string(stats.reusedTokens));
  EXPECT_TRUE(runtime->shutdown());
}

}  // namespace
}  // namespace mkv::test
