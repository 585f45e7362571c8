#include "replay_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

namespace mkv::replay {
namespace {

std::string grouped(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) {
      out.push_back(',');
    }
    out.push_back(digits[i]);
  }
  if (value < 0) {
    out.insert(out.begin(), '-');
  }
  return out;
}

std::string bytes(int64_t value) {
  constexpr char const* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto scaled = static_cast<double>(value);
  std::size_t unit = 0;
  while (scaled >= 1024.0 && unit + 1 < std::size(kUnits)) {
    scaled /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", value) : fmt::format("{:.1f} {}", scaled, kUnits[unit]);
}

std::string_view verifyName(testing::VerifyMode mode) {
  switch (mode) {
    case testing::VerifyMode::kAll: return "all";
    case testing::VerifyMode::kSample: return "sample";
    case testing::VerifyMode::kNone: return "none";
  }
  return "unknown";
}

std::string_view dtypeName(DataType type) {
  switch (type) {
    case DataType::kFloat16: return "fp16";
    case DataType::kBFloat16: return "bf16";
    case DataType::kFloat32: return "fp32";
    case DataType::kFp8E4M3: return "fp8";
    default: return mkv::toString(type);
  }
}

std::string poolSizingText(ReplayResult const& r) {
  switch (r.config.poolSizing) {
    case PoolSizing::kUnbounded:
      return r.config.mode == ReplayMode::kReuse
                 ? "unbounded: sized from the workload so that nothing is evicted"
                 : "unbounded: every sequence of a full batch fits";
    case PoolSizing::kPages: return fmt::format("--pool-pages {}", r.config.poolAmount);
    case PoolSizing::kTokens:
      return fmt::format("--pool-tokens {}, rounded down to whole pages", r.config.poolAmount);
  }
  return "";
}

std::string_view poolSizingKey(PoolSizing sizing) {
  switch (sizing) {
    case PoolSizing::kUnbounded: return "unbounded";
    case PoolSizing::kPages: return "pages";
    case PoolSizing::kTokens: return "tokens";
  }
  return "unknown";
}

std::string finishName(RequestRecord const& record) {
  if (record.failed && record.reason == FinishReason::kNotFinished) {
    return "refused";
  }
  return std::string(mkv::toString(record.reason));
}

std::string csvField(std::string const& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) {
    return text;
  }
  std::string out = "\"";
  for (char c : text) {
    if (c == '"') {
      out.push_back('"');
    }
    out.push_back(c);
  }
  return out + "\"";
}

std::string number(double value) {
  if (!std::isfinite(value)) {
    return "null";
  }
  return fmt::format("{}", value);
}

double requestsPerSecond(ReplayResult const& r) {
  return r.wallSeconds > 0.0 ? static_cast<double>(r.requests) / r.wallSeconds : 0.0;
}

}  // namespace

std::string jsonString(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    auto const u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (u < 0x20) {
          out += fmt::format("\\u{:04x}", u);
        } else {
          out.push_back(c);
        }
    }
  }
  return out + "\"";
}

std::string formatSummary(ReplayResult const& r) {
  ReplayConfig const& c = r.config;
  std::string out;
  auto line = [&out](std::string_view label, std::string const& value) {
    out += fmt::format("  {:<26}{}\n", label, value);
  };
  out += fmt::format("mkv-replay: {}\n", r.workload);
  std::string mode = fmt::format(
      "{} (backend {}), {} tensors, verify {}, seed {}", toString(c.mode), mkv::toString(r.backend),
      c.device == DeviceType::kGPU ? "cuda" : "cpu", verifyName(c.verify), c.seed);
  line("mode", mode);
  std::string model =
      fmt::format("{} {}layer{} x {} KV head{} x head dim {}, {}", c.layers,
                  c.mode == ReplayMode::kSwa ? "sliding " : "", c.layers == 1 ? "" : "s", c.kvHeads,
                  c.kvHeads == 1 ? "" : "s", c.headDim, dtypeName(c.dtype));
  if (c.mode == ReplayMode::kSwa) {
    model += fmt::format(", window {} tokens", c.windowTokens);
    if (c.fullLayers > 0) {
      model += fmt::format(", + {} full layer{}", c.fullLayers, c.fullLayers == 1 ? "" : "s");
    }
  }
  line("model", model);
  line("page", fmt::format("{} tokens, {} per page (K+V, all layers of the pool)", c.pageSize,
                           bytes(r.bytesPerPage)));
  line("pool", fmt::format("{} pages = {} tokens, {} ({})", grouped(r.poolPages),
                           grouped(r.poolPages * c.pageSize), bytes(r.poolPages * r.bytesPerPage),
                           poolSizingText(r)));
  std::string batch = fmt::format("{}", r.maxBatch);
  if (r.maxBatch != c.maxBatch) {
    batch += fmt::format(" (--max-batch {} limited by the pool)", c.maxBatch);
  }
  if (c.maxOutputTokens > 0) {
    batch += fmt::format(", output capped at {} tokens", c.maxOutputTokens);
  }
  line("max batch", batch);
  out += "\n";
  line("requests",
       fmt::format("{}  (failed {}, retried {}, in-flight joins {})", grouped(r.requests),
                   r.failedRequests, r.retriedRequests, grouped(r.joins)));
  line("prompt tokens", grouped(r.promptTokens));
  line("reused tokens",
       fmt::format("{}  (hit rate {:.2f}%)", grouped(r.reusedTokens), 100.0 * r.hitRate));
  line("prefill tokens computed", grouped(r.prefillTokensComputed));
  line("generated tokens",
       fmt::format("{}  ({} decode steps)", grouped(r.generatedTokens), grouped(r.decodeSteps)));
  line(
      "peak pages in use",
      fmt::format("{} of {} ({:.1f}%), peak KV {}", grouped(r.peakPagesInUse), grouped(r.poolPages),
                  100.0 * static_cast<double>(r.peakPagesInUse) / static_cast<double>(r.poolPages),
                  bytes(r.peakKvBytes)));
  if (r.backend == KVCacheBackend::kBoundedSwa) {
    line("SWA pages per sequence",
         fmt::format("{} at prefill (2M + 1), {} in decode (M + 1)", r.swaPagesPerSequencePrefill,
                     r.swaPagesPerSequenceDecode));
  } else {
    line("evicted records",
         fmt::format("{}  (published {}, forced-cold retries {})", grouped(r.evictedRecords),
                     grouped(r.publishedRecords), r.forcedColdRetries));
    std::string misses;
    for (std::size_t i = 0; i < r.missesByReason.size(); ++i) {
      if (r.missesByReason[i] > 0) {
        misses += fmt::format("{}{} {}", misses.empty() ? "" : ", ",
                              toString(static_cast<MissReason>(i)), grouped(r.missesByReason[i]));
      }
    }
    line("misses by reason", misses.empty() ? "none" : misses);
  }
  line("oracle", fmt::format("{} positions checked, {} mismatches", grouped(r.oracleChecks),
                             grouped(r.oracleMismatches)));
  if (!r.firstMismatch.empty()) {
    line("first mismatch", r.firstMismatch);
  }
  line("host ns per decode step",
       fmt::format("p50 {}, p99 {}, mean {}", grouped(r.hostNsPerStepP50),
                   grouped(r.hostNsPerStepP99), grouped(r.hostNsPerStepMean)));
  line("GPU ns per decode step",
       r.gpuTimed ? fmt::format("p50 {}, p99 {}, mean {}", grouped(r.gpuNsPerStepP50),
                                grouped(r.gpuNsPerStepP99), grouped(r.gpuNsPerStepMean))
                  : std::string("n/a (CPU tensors)"));
  line("wall time",
       fmt::format("{:.2f} s, {:.1f} requests/s", r.wallSeconds, requestsPerSecond(r)));
  return out;
}

std::string formatJson(ReplayResult const& r) {
  ReplayConfig const& c = r.config;
  std::string misses;
  for (std::size_t i = 0; i < r.missesByReason.size(); ++i) {
    misses += fmt::format("{}{}: {}", i == 0 ? "" : ", ",
                          jsonString(toString(static_cast<MissReason>(i))), r.missesByReason[i]);
  }
  std::string out = "{\n";
  bool first = true;
  auto field = [&](std::string_view key, std::string const& value) {
    out += fmt::format("{}  {}: {}", first ? "" : ",\n", jsonString(key), value);
    first = false;
  };
  auto integer = [&](std::string_view key, int64_t value) { field(key, std::to_string(value)); };
  field("workload", jsonString(r.workload));
  field("mode", jsonString(toString(c.mode)));
  field("backend", jsonString(mkv::toString(r.backend)));
  field("device", jsonString(c.device == DeviceType::kGPU ? "cuda" : "cpu"));
  field("verify", jsonString(verifyName(c.verify)));
  integer("seed", static_cast<int64_t>(c.seed));
  integer("layers", c.layers);
  integer("full_layers", c.fullLayers);
  integer("kv_heads", c.kvHeads);
  integer("head_dim", c.headDim);
  field("dtype", jsonString(dtypeName(c.dtype)));
  integer("window", c.mode == ReplayMode::kSwa ? c.windowTokens : 0);
  integer("page_size", c.pageSize);
  integer("bytes_per_page", r.bytesPerPage);
  field("pool_sizing", jsonString(poolSizingKey(c.poolSizing)));
  integer("pool_pages", r.poolPages);
  integer("pool_tokens", r.poolPages * c.pageSize);
  integer("max_batch", r.maxBatch);
  integer("max_output", c.maxOutputTokens);
  integer("requests", r.requests);
  integer("failed_requests", r.failedRequests);
  integer("retried_requests", r.retriedRequests);
  integer("joins", r.joins);
  integer("prompt_tokens", r.promptTokens);
  integer("reused_tokens", r.reusedTokens);
  field("hit_rate", number(r.hitRate));
  integer("prefill_tokens_computed", r.prefillTokensComputed);
  integer("generated_tokens", r.generatedTokens);
  integer("decode_steps", r.decodeSteps);
  integer("published_records", r.publishedRecords);
  integer("evicted_records", r.evictedRecords);
  integer("forced_cold_retries", r.forcedColdRetries);
  field("misses_by_reason", "{" + misses + "}");
  integer("peak_pages_in_use", r.peakPagesInUse);
  integer("peak_kv_bytes", r.peakKvBytes);
  integer("swa_pages_per_sequence_prefill", r.swaPagesPerSequencePrefill);
  integer("swa_pages_per_sequence_decode", r.swaPagesPerSequenceDecode);
  integer("oracle_checks", r.oracleChecks);
  integer("oracle_mismatches", r.oracleMismatches);
  field("first_mismatch", jsonString(r.firstMismatch));
  integer("host_ns_per_step_p50", r.hostNsPerStepP50);
  integer("host_ns_per_step_p99", r.hostNsPerStepP99);
  integer("host_ns_per_step_mean", r.hostNsPerStepMean);
  field("gpu_timed", r.gpuTimed ? "true" : "false");
  integer("gpu_ns_per_step_p50", r.gpuNsPerStepP50);
  integer("gpu_ns_per_step_p99", r.gpuNsPerStepP99);
  integer("gpu_ns_per_step_mean", r.gpuNsPerStepMean);
  field("requests_per_s", fmt::format("{:.1f}", requestsPerSecond(r)));
  integer("dropped_events", r.droppedEvents);
  if (KvEventPublisher const* events = c.kvEvents) {
    field("kv_events",
          fmt::format("{{\"batches_published\": {}, \"batches_dropped\": {}, "
                      "\"indexed_block_hashes\": [{}]}}",
                      events->batchesPublished(), events->batchesDropped(),
                      fmt::join(r.indexedBlockHashes, ", ")));
  }
  field("wall_s", fmt::format("{:.3f}", r.wallSeconds));
  out += "\n}\n";
  return out;
}

std::string formatCsv(ReplayResult const& r) {
  std::string out =
      "index,id,timestamp_ms,prompt_tokens,max_new_tokens,reused_tokens,prefill_tokens,"
      "generated_tokens,finish_reason,joined,attempts,pages_in_use_after,decode_host_ns\n";
  for (RequestRecord const& record : r.records) {
    out += fmt::format(
        "{},{},{},{},{},{},{},{},{},{},{},{},{}\n", record.index, csvField(record.id),
        record.timestampMs ? number(*record.timestampMs) : std::string(), record.promptTokens,
        record.maxNewTokens, record.reusedTokens, record.prefillTokens, record.generatedTokens,
        finishName(record), record.joinedInFlight ? 1 : 0, record.attempts, record.pagesInUseAfter,
        record.decodeHostNanoseconds);
  }
  return out;
}

}  // namespace mkv::replay
