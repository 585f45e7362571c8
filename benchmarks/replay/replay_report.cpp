#include "replay_report.h"
#include "mkv/context_cache/context_cache_coordinator.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <string>
#include <vector>

namespace mkv::replay {
namespace {

/// --preemption's spelling of `mode`.
char const* preemptionName(testing::PreemptionMode mode) {
  switch (mode) {
    case testing::PreemptionMode::kRecompute:
      return "recompute";
    case testing::PreemptionMode::kSwap:
      return "swap";
    case testing::PreemptionMode::kNone:
      break;
  }
  return "none";
}

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
    case testing::VerifyMode::kAll:
      return "all";
    case testing::VerifyMode::kSample:
      return "sample";
    case testing::VerifyMode::kNone:
      return "none";
  }
  return "unknown";
}

std::string_view dtypeName(DataType type) {
  switch (type) {
    case DataType::kFloat16:
      return "fp16";
    case DataType::kBFloat16:
      return "bf16";
    case DataType::kFloat32:
      return "fp32";
    case DataType::kFp8E4M3:
      return "fp8";
    default:
      return mkv::toString(type);
  }
}

std::string poolSizingText(ReplayResult const& r) {
  switch (r.config.poolSizing) {
    case PoolSizing::kUnbounded:
      return r.config.mode == ReplayMode::kReuse
                 ? "unbounded: sized from the workload so that nothing is evicted"
                 : "unbounded: every sequence of a full batch fits";
    case PoolSizing::kPages:
      return fmt::format("--pool-pages {}", r.config.poolAmount);
    case PoolSizing::kTokens:
      return fmt::format("--pool-tokens {}, rounded down to whole pages", r.config.poolAmount);
    case PoolSizing::kBudgetBytes:
      return fmt::format("--kv-budget-bytes {}, split between the KV pools", r.config.poolAmount);
  }
  return "";
}

std::string_view poolSizingKey(PoolSizing sizing) {
  switch (sizing) {
    case PoolSizing::kUnbounded:
      return "unbounded";
    case PoolSizing::kPages:
      return "pages";
    case PoolSizing::kTokens:
      return "tokens";
    case PoolSizing::kBudgetBytes:
      return "budget";
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

double ratio(int64_t part, int64_t whole) {
  return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

/// Every device KV pool: pages x bytes per page each, and their bytes in all (of the budget).
std::string kvPoolsText(ReplayResult const& r) {
  std::string out;
  for (KvPoolUsage const& pool : r.pools) {
    out += fmt::format("{}{} {} pages x {}", out.empty() ? "" : ", ", toString(pool.kind),
                       grouped(pool.pages), bytes(pool.bytesPerPage));
  }
  out += fmt::format(" = {}", bytes(r.kvBytes));
  if (r.config.poolSizing == PoolSizing::kBudgetBytes) {
    out += fmt::format(" of a {} budget", bytes(r.config.poolAmount));
  }
  return out;
}

nlohmann::ordered_json kvPoolsJson(ReplayResult const& r) {
  nlohmann::ordered_json pools = nlohmann::ordered_json::array();
  for (KvPoolUsage const& pool : r.pools) {
    pools.push_back({{"name", toString(pool.kind)},
                     {"pages", pool.pages},
                     {"bytes_per_page", pool.bytesPerPage},
                     {"bytes", pool.pages * pool.bytesPerPage},
                     {"peak_pages_in_use", pool.peakPagesInUse}});
  }
  return pools;
}

/// Hybrid checkpoint reuse: the summary's lines after the oracle's.
void hybridSummary(ReplayResult const& r, std::string& out) {
  ReplayResult::Hybrid const& h = r.hybrid;
  auto line = [&out](std::string_view label, std::string const& value) {
    out += fmt::format("  {:<26}{}\n", label, value);
  };
  line("snapshot budget",
       fmt::format("{} checkpoints ({} recurrent + {} partial-KV slots), {} ({})",
                   grouped(h.recurrentSnapshotSlots), grouped(h.recurrentSnapshotSlots),
                   grouped(h.partialKvSnapshotSlots), bytes(h.snapshotBytes),
                   r.config.snapshotSlots > 0
                       ? fmt::format("--snapshot-slots {}", r.config.snapshotSlots)
                       : std::string("unbounded: every capture finds a slot")));
  line("checkpoints",
       fmt::format("published {}, restored {}, skipped for snapshot pressure {} (captures {})",
                   grouped(h.checkpointsPublished), grouped(h.checkpointsRestored),
                   grouped(h.snapshotPressureSkips), grouped(h.checkpointCaptures)));
  if (r.config.checkpointInterval > 0 || h.chunkEndCaptures > 0) {
    line("reuse points",
         fmt::format("every {} tokens: captured {} (and {} at prefill chunks' ends), kept {}, hit "
                     "{}, evicted {}",
                     r.config.checkpointInterval, grouped(h.reusePointCaptures),
                     grouped(h.chunkEndCaptures), grouped(h.reusePointsPublished),
                     grouped(h.reusePointsRestored), grouped(h.reusePointsEvicted)));
  }
  if (h.attentionOnlyRun) {
    line("attention-only reuse",
         fmt::format("{}  (hit rate {:.2f}%; the hybrid model reuses {:.1f}% of it)",
                     grouped(h.attentionOnlyReusedTokens), 100.0 * h.attentionOnlyHitRate,
                     100.0 * ratio(r.reusedTokens, h.attentionOnlyReusedTokens)));
  }
  line("recurrent oracle", fmt::format("{} states checked, {} mismatches",
                                       grouped(h.recurrentChecks), grouped(h.recurrentMismatches)));
  if (h.hybridMtp) {
    line("Hybrid-MTP",
         fmt::format("endpoints published {}, boundary hidden rows restored {} ({} fp16 a row)",
                     grouped(h.mtpEndpointsPublished), grouped(h.boundaryHiddenRestores),
                     grouped(r.config.boundaryHiddenWidth)));
    line("hidden-row oracle",
         fmt::format("{} rows checked, {} mismatches", grouped(h.boundaryHiddenChecks),
                     grouped(h.boundaryHiddenMismatches)));
  }
}

double requestsPerSecond(ReplayResult const& r) {
  return r.wallSeconds > 0.0 ? static_cast<double>(r.requests) / r.wallSeconds : 0.0;
}

/// The summary lines of a speculative replay.
template <typename Line>
void speculativeSummary(ReplayResult const& r, Line const& line) {
  ReplayConfig const& c = r.config;
  std::string draft = r.draftBytesPerPage > 0
                          ? fmt::format("{} layer{} with paged KV, {} per page", c.draftLayers,
                                        c.draftLayers == 1 ? "" : "s", bytes(r.draftBytesPerPage))
                          : std::string("reads the base KV (no draft pool)");
  line("speculative",
       fmt::format("{}{}, {} draft tokens per round; draft {}", toString(c.speculative),
                   r.hybrid.hybridMtp ? " (Hybrid-MTP)" : "", c.specWidth, draft));
  line("verification rounds",
       fmt::format("{}  (proposed {}, accepted {} = {:.2f}%)", grouped(r.specRounds),
                   grouped(r.proposedTokens), grouped(r.acceptedTokens),
                   100.0 * ratio(r.acceptedTokens, r.proposedTokens)));
  if (r.draftBytesPerPage > 0) {
    line("draft reuse",
         fmt::format("{} tokens = {} pages  (last-page replays {}, paired publications {}, peak "
                     "draft pages {})",
                     grouped(r.draftReusedTokens), grouped(r.draftReusedPages),
                     grouped(r.specFullPageReplays), grouped(r.specPairPublications),
                     grouped(r.peakDraftPagesInUse)));
  }
}

nlohmann::ordered_json speculativeJson(ReplayResult const& r) {
  ReplayConfig const& c = r.config;
  return {
      {"kind", toString(c.speculative)},
      {"hybrid_mtp", r.hybrid.hybridMtp},  // its figures are in the "hybrid" object
      {"draft_layers", c.draftLayers},
      {"paged_draft", r.draftBytesPerPage > 0},
      {"width", c.specWidth},
      {"draft_bytes_per_page", r.draftBytesPerPage},
      {"rounds", r.specRounds},
      {"proposed_tokens", r.proposedTokens},
      {"accepted_tokens", r.acceptedTokens},
      {"acceptance_rate", ratio(r.acceptedTokens, r.proposedTokens)},
      {"draft_reused_tokens", r.draftReusedTokens},
      {"draft_reused_pages", r.draftReusedPages},
      {"full_page_replays", r.specFullPageReplays},
      {"pair_publications", r.specPairPublications},
      {"peak_draft_pages_in_use", r.peakDraftPagesInUse},
      {"base_oracle_checks", r.oracleChecks - r.draftOracleChecks},
      {"base_oracle_mismatches", r.oracleMismatches - r.draftOracleMismatches},
      {"draft_oracle_checks", r.draftOracleChecks},
      {"draft_oracle_mismatches", r.draftOracleMismatches},
  };
}

}  // namespace

std::string formatSummary(ReplayResult const& r) {
  ReplayConfig const& c = r.config;
  std::string out;
  auto line = [&out](std::string_view label, std::string const& value) {
    out += fmt::format("  {:<26}{}\n", label, value);
  };
  out += fmt::format("mkv-replay: {}\n", r.workload);
  std::string mode = fmt::format(
      "{} (backend {}), {} tensors, device writes {}, verify {}, seed {}", toString(c.mode),
      mkv::toString(r.backend), c.device == DeviceType::kGPU ? "cuda" : "cpu",
      mkv::toString(c.deviceWrites), verifyName(c.verify), c.seed);
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
  if (c.recurrentLayers > 0) {
    model +=
        fmt::format(", + {} recurrent layer{} ({} B state + {} B conv each)", c.recurrentLayers,
                    c.recurrentLayers == 1 ? "" : "s", c.recurrentStateBytes, c.recurrentConvBytes);
  }
  line("model", model);
  line("page", fmt::format("{} tokens, {} per page (K+V, all layers of the pool)", c.pageSize,
                           bytes(r.bytesPerPage)));
  line("pool", fmt::format("{} pages = {} tokens, {} ({})", grouped(r.poolPages),
                           grouped(r.poolPages * c.pageSize), bytes(r.poolPages * r.bytesPerPage),
                           poolSizingText(r)));
  line("KV pools", kvPoolsText(r));
  std::string batch = fmt::format("{}", r.maxBatch);
  if (r.maxBatch != c.maxBatch) {
    batch += fmt::format(" (--max-batch {} limited by the pool)", c.maxBatch);
  }
  if (c.maxOutputTokens > 0) {
    batch += fmt::format(", output capped at {} tokens", c.maxOutputTokens);
  }
  line("max batch", batch);
  if (c.mode == ReplayMode::kReuse) {
    line("eviction", fmt::format("{} (victim order of cached records)", mkv::toString(c.eviction)));
  }
  out += "\n";
  line("requests",
       fmt::format("{}  (failed {}, retried {}, in-flight joins {})", grouped(r.requests),
                   r.failedRequests, r.retriedRequests, grouped(r.joins)));
  if (r.config.maxBatchedTokens > 0) {
    line("chunked prefill",
         fmt::format("{} tokens a step: {} sequences in more than one chunk ({} founders), {} "
                     "chunks; steps to first token p50 {}, p99 {}",
                     grouped(r.config.maxBatchedTokens), grouped(r.chunkedPrefills),
                     grouped(r.heldFounders), grouped(r.prefillChunks), r.timeToFirstTokenStepsP50,
                     r.timeToFirstTokenStepsP99));
  }
  if (c.joinerPages != JoinerPageAllocation::kWholePrompt) {
    line("joiner pages", std::string(mkv::toString(c.joinerPages)));
  }
  if (c.preemption != testing::PreemptionMode::kNone) {
    bool const swap = c.preemption == testing::PreemptionMode::kSwap;
    std::string hostTier;
    if (r.hostTier.pages > 0) {
      hostTier = fmt::format(", {} of them from the host tier", grouped(r.resumedHostTierTokens));
    }
    if (swap) {
      hostTier += fmt::format("; {} blocks swapped out", grouped(r.hostTier.swappedOutBlocks));
    }
    line("preemption",
         fmt::format("{}: {} preempted, {} resumed ({} prompt tokens, {} of them generated "
                     "before the preemption; {} reused{})",
                     preemptionName(c.preemption), grouped(r.preemptions), grouped(r.resumed),
                     grouped(r.resumedPromptTokens), grouped(r.resumedGeneratedTokens),
                     grouped(r.resumedReusedTokens), hostTier));
  }
  line("steps between tokens",
       fmt::format("p50 {}, p99 {}", r.timeBetweenTokensStepsP50, r.timeBetweenTokensStepsP99));
  line("prompt tokens", grouped(r.promptTokens));
  line("reused tokens",
       fmt::format("{}  (hit rate {:.2f}%)", grouped(r.reusedTokens), 100.0 * r.hitRate));
  line("prefill tokens computed", grouped(r.prefillTokensComputed));
  line("generated tokens",
       fmt::format("{}  ({} decode steps)", grouped(r.generatedTokens), grouped(r.decodeSteps)));
  if (c.speculative != SpeculativeKind::kNone) {
    speculativeSummary(r, line);
  }
  line(
      "peak pages in use",
      fmt::format("{} of {} ({:.1f}%), peak KV {}", grouped(r.peakPagesInUse), grouped(r.poolPages),
                  100.0 * static_cast<double>(r.peakPagesInUse) / static_cast<double>(r.poolPages),
                  bytes(r.peakKvBytes)));
  if (r.backend == KVCacheBackend::kSlidingWindowReuse) {
    line("SWA pages per sequence",
         fmt::format("at most {} per row at prefill (window + executed prompt pages, measured), "
                     "{} in decode (M + 1); measured in decode: at most {} per running row",
                     r.swaPagesPerSequencePrefill, r.swaPagesPerSequenceDecode,
                     r.swaPeakPagesPerDecodingRow));
    ReplayResult::WindowCache const& w = r.windowCache;
    line("sliding window cache",
         fmt::format("{} blocks published, {} dropped, {} kept for capped hits' points; at the "
                     "end {} cached, {} of them in the read tier",
                     grouped(w.publishedBlocks), grouped(w.droppedBlocks), grouped(w.keptBlocks),
                     grouped(w.cachedBlocks), grouped(w.readBlocks)));
  }
  if (r.backend == KVCacheBackend::kBoundedSwa) {
    line("SWA pages per sequence",
         fmt::format("{} at prefill (2M + 1), {} in decode (M + 1); measured in decode: at most "
                     "{} per running row",
                     r.swaPagesPerSequencePrefill, r.swaPagesPerSequenceDecode,
                     r.swaPeakPagesPerDecodingRow));
  } else {
    line("evicted records",
         fmt::format("{}  (published {}; {} chunk records replaced)", grouped(r.evictedRecords),
                     grouped(r.publishedRecords), grouped(r.replacedChunkRecords)));
    if (r.cacheResets > 0) {
      line("prefix cache resets", grouped(r.cacheResets));
    }
    if (r.hostTier.pages > 0) {
      ReplayResult::HostTier const& h = r.hostTier;
      line(
          "host tier",
          fmt::format("{} pages ({}): {} tokens reused from it; {} pages offloaded ({}), {} "
                      "onboarded ({}), {} dropped",
                      grouped(h.pages), bytes(h.bytes), grouped(h.hitTokens),
                      grouped(h.offloadedPages), bytes(h.offloadedBytes), grouped(h.onboardedPages),
                      bytes(h.onboardedBytes), grouped(h.droppedPages)));
    }
    if (r.remoteTier.enabled) {
      RemoteTierCounters const& t = r.remoteTier.counters;
      auto count = [](uint64_t value) { return grouped(static_cast<int64_t>(value)); };
      line("remote tier",
           fmt::format("{} ({}): {} blocks loaded ({}), {} missing, {} refused, {} failed loads; "
                       "{} blocks saved ({}), {} failed, {} skipped; {:.1f} ms waiting for loads",
                       r.remoteTier.store, toString(c.role), count(t.loadedBlocks),
                       bytes(static_cast<int64_t>(t.loadedBytes)), count(t.missingBlocks),
                       count(t.rejectedBlocks), count(t.loadFailures), count(t.savedBlocks),
                       bytes(static_cast<int64_t>(t.savedBytes)), count(t.saveFailures),
                       count(t.savesSkipped),
                       static_cast<double>(r.remoteTier.loadWaitNanoseconds) / 1e6));
    }
    std::string misses;
    for (std::size_t i = 0; i < r.missesByReason.size(); ++i) {
      if (r.missesByReason[i] > 0) {
        misses += fmt::format("{}{} {}", misses.empty() ? "" : ", ",
                              toString(static_cast<MissReason>(i)), grouped(r.missesByReason[i]));
      }
    }
    line("misses by reason", misses.empty() ? "none" : misses);
  }
  std::string oracle = fmt::format("{} positions checked, {} mismatches", grouped(r.oracleChecks),
                                   grouped(r.oracleMismatches));
  if (r.draftBytesPerPage > 0) {
    oracle +=
        fmt::format(" (base {} / {}, draft {} / {})", grouped(r.oracleChecks - r.draftOracleChecks),
                    grouped(r.oracleMismatches - r.draftOracleMismatches),
                    grouped(r.draftOracleChecks), grouped(r.draftOracleMismatches));
  }
  line("oracle", oracle);
  if (!r.firstMismatch.empty()) {
    line("first mismatch", r.firstMismatch);
  }
  if (c.recurrentLayers > 0) {
    hybridSummary(r, out);
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
  nlohmann::ordered_json misses = nlohmann::ordered_json::object();
  for (std::size_t i = 0; i < r.missesByReason.size(); ++i) {
    misses[std::string(toString(static_cast<MissReason>(i)))] = r.missesByReason[i];
  }
  nlohmann::ordered_json json = {
      {"workload", r.workload},
      {"mode", toString(c.mode)},
      {"backend", mkv::toString(r.backend)},
      {"device", c.device == DeviceType::kGPU ? "cuda" : "cpu"},
      {"device_writes", mkv::toString(c.deviceWrites)},
      {"verify", verifyName(c.verify)},
      {"seed", c.seed},
      {"layers", c.layers},
      {"full_layers", c.fullLayers},
      {"kv_heads", c.kvHeads},
      {"head_dim", c.headDim},
      {"dtype", dtypeName(c.dtype)},
      {"window", c.mode == ReplayMode::kSwa ? c.windowTokens : 0},
      {"page_size", c.pageSize},
      {"bytes_per_page", r.bytesPerPage},
      {"pool_sizing", poolSizingKey(c.poolSizing)},
      {"pool_pages", r.poolPages},
      {"pool_tokens", r.poolPages * c.pageSize},
      {"kv_budget_bytes", c.poolSizing == PoolSizing::kBudgetBytes
                              ? nlohmann::ordered_json(c.poolAmount)
                              : nlohmann::ordered_json(nullptr)},
      {"pools", kvPoolsJson(r)},
      {"kv_bytes", r.kvBytes},
      {"eviction", mkv::toString(c.eviction)},
      {"max_batch", r.maxBatch},
      {"max_output", c.maxOutputTokens},
      {"requests", r.requests},
      {"failed_requests", r.failedRequests},
      {"retried_requests", r.retriedRequests},
      {"joins", r.joins},
      {"max_batched_tokens", c.maxBatchedTokens},
      {"chunked_prefills", r.chunkedPrefills},
      {"prefill_chunks", r.prefillChunks},
      {"held_founders", r.heldFounders},
      {"time_to_first_token_steps_p50", r.timeToFirstTokenStepsP50},
      {"time_to_first_token_steps_p99", r.timeToFirstTokenStepsP99},
      {"time_between_tokens_steps_p50", r.timeBetweenTokensStepsP50},
      {"time_between_tokens_steps_p99", r.timeBetweenTokensStepsP99},
      {"preemption", preemptionName(c.preemption)},
      {"joiner_pages", std::string(mkv::toString(c.joinerPages))},
      {"preemptions", r.preemptions},
      {"resumed", r.resumed},
      {"resumed_prompt_tokens", r.resumedPromptTokens},
      {"resumed_reused_tokens", r.resumedReusedTokens},
      {"resumed_generated_tokens", r.resumedGeneratedTokens},
      {"resumed_host_tier_tokens", r.resumedHostTierTokens},
      {"prompt_tokens", r.promptTokens},
      {"reused_tokens", r.reusedTokens},
      {"hit_rate", r.hitRate},  // NaN and infinities are written as null
      {"prefill_tokens_computed", r.prefillTokensComputed},
      {"generated_tokens", r.generatedTokens},
      {"decode_steps", r.decodeSteps},
      {"published_records", r.publishedRecords},
      {"evicted_records", r.evictedRecords},
      {"replaced_chunk_records", r.replacedChunkRecords},
      {"cache_resets", r.cacheResets},
      {"misses_by_reason", misses},
      {"peak_pages_in_use", r.peakPagesInUse},
      {"peak_kv_bytes", r.peakKvBytes},
      {"swa_pages_per_sequence",
       r.backend == KVCacheBackend::kBoundedSwa || r.backend == KVCacheBackend::kSlidingWindowReuse
           ? nlohmann::ordered_json{{"prefill", r.swaPagesPerSequencePrefill},
                                    {"decode", r.swaPagesPerSequenceDecode},
                                    {"decode_peak_per_row", r.swaPeakPagesPerDecodingRow}}
           : nlohmann::ordered_json(nullptr)},
      {"sliding_window_cache",
       r.backend == KVCacheBackend::kSlidingWindowReuse
           ? nlohmann::ordered_json{{"published_blocks", r.windowCache.publishedBlocks},
                                    {"dropped_blocks", r.windowCache.droppedBlocks},
                                    {"cached_blocks", r.windowCache.cachedBlocks},
                                    {"read_blocks", r.windowCache.readBlocks},
                                    {"kept_blocks", r.windowCache.keptBlocks}}
           : nlohmann::ordered_json(nullptr)},
      {"oracle_checks", r.oracleChecks},
      {"oracle_mismatches", r.oracleMismatches},
      {"first_mismatch", r.firstMismatch},
      {"host_ns_per_step_p50", r.hostNsPerStepP50},
      {"host_ns_per_step_p99", r.hostNsPerStepP99},
      {"host_ns_per_step_mean", r.hostNsPerStepMean},
      {"gpu_timed", r.gpuTimed},
      {"gpu_ns_per_step_p50", r.gpuNsPerStepP50},
      {"gpu_ns_per_step_p99", r.gpuNsPerStepP99},
      {"gpu_ns_per_step_mean", r.gpuNsPerStepMean},
      {"requests_per_s", std::round(requestsPerSecond(r) * 10.0) / 10.0},
      {"dropped_events", r.droppedEvents},
  };
  if (r.hostTier.pages > 0) {
    ReplayResult::HostTier const& h = r.hostTier;
    double const perRequest = r.requests > 0 ? 1.0 / static_cast<double>(r.requests) : 0.0;
    json["host_tier"] = {
        {"pages", h.pages},
        {"tokens", h.pages * c.pageSize},
        {"bytes", h.bytes},
        {"hit_tokens", h.hitTokens},
        {"offloaded_pages", h.offloadedPages},
        {"onboarded_pages", h.onboardedPages},
        {"offloaded_bytes", h.offloadedBytes},
        {"onboarded_bytes", h.onboardedBytes},
        {"bytes_moved_per_request",
         std::round(static_cast<double>(h.offloadedBytes + h.onboardedBytes) * perRequest)},
        {"dropped_pages", h.droppedPages},
        {"transfers", h.transfers},
        {"swapped_out_blocks", h.swappedOutBlocks},
    };
  }
  if (r.remoteTier.enabled) {
    RemoteTierCounters const& t = r.remoteTier.counters;
    json["remote_tier"] = {
        {"store", r.remoteTier.store},
        {"role", toString(c.role)},
        {"model", c.remoteModel},
        {"lookups", t.lookups},
        {"lookup_failures", t.lookupFailures},
        {"loads", t.loadsStarted},
        {"loads_refused", t.loadsRefused},
        {"load_failures", t.loadFailures},
        {"loaded_blocks", t.loadedBlocks},
        {"loaded_tokens", t.loadedBlocks * static_cast<uint64_t>(c.pageSize)},
        {"loaded_bytes", t.loadedBytes},
        {"missing_blocks", t.missingBlocks},
        {"rejected_blocks", t.rejectedBlocks},
        {"installs_deferred", t.installsDeferred},
        {"saved_blocks", t.savedBlocks},
        {"saved_bytes", t.savedBytes},
        {"save_failures", t.saveFailures},
        {"saves_skipped", t.savesSkipped},
        {"load_wait_ms", static_cast<double>(r.remoteTier.loadWaitNanoseconds) / 1e6},
        {"handoff_wait_ms", static_cast<double>(r.remoteTier.handoffWaitNanoseconds) / 1e6},
    };
  }
  json["recurrent_layers"] = c.recurrentLayers;
  if (c.recurrentLayers > 0) {
    ReplayResult::Hybrid const& h = r.hybrid;
    nlohmann::ordered_json hybrid = {
        {"recurrent_state_bytes", c.recurrentStateBytes},
        {"recurrent_conv_bytes", c.recurrentConvBytes},
        {"snapshot_sizing", c.snapshotSlots > 0 ? "slots" : "unbounded"},
        {"recurrent_snapshot_slots", h.recurrentSnapshotSlots},
        {"partial_kv_snapshot_slots", h.partialKvSnapshotSlots},
        {"snapshot_bytes", h.snapshotBytes},
        {"checkpoint_captures", h.checkpointCaptures},
        {"checkpoints_published", h.checkpointsPublished},
        {"checkpoints_restored", h.checkpointsRestored},
        {"snapshot_pressure_skips", h.snapshotPressureSkips},
        {"reuse_points",
         {{"interval", c.checkpointInterval},
          {"admission", std::string(mkv::toString(c.reusePointAdmission))},
          {"captured", h.reusePointCaptures},
          {"chunk_ends_captured", h.chunkEndCaptures},
          {"written", h.reusePointsWritten},
          {"kept", h.reusePointsPublished},
          {"hit", h.reusePointsRestored},
          {"evicted", h.reusePointsEvicted}}},
        {"recurrent_checks", h.recurrentChecks},
        {"recurrent_mismatches", h.recurrentMismatches},
        {"hybrid_mtp", h.hybridMtp},
    };
    if (h.hybridMtp) {
      hybrid["boundary_hidden_width"] = c.boundaryHiddenWidth;
      hybrid["mtp_endpoints_published"] = h.mtpEndpointsPublished;
      hybrid["boundary_hidden_restores"] = h.boundaryHiddenRestores;
      hybrid["boundary_hidden_checks"] = h.boundaryHiddenChecks;
      hybrid["boundary_hidden_mismatches"] = h.boundaryHiddenMismatches;
    }
    if (h.attentionOnlyRun) {
      hybrid["attention_only_reused_tokens"] = h.attentionOnlyReusedTokens;
      hybrid["attention_only_hit_rate"] = h.attentionOnlyHitRate;
      hybrid["reuse_vs_attention_only"] = ratio(r.reusedTokens, h.attentionOnlyReusedTokens);
    } else {
      hybrid["attention_only_reused_tokens"] = nullptr;
      hybrid["attention_only_hit_rate"] = nullptr;
      hybrid["reuse_vs_attention_only"] = nullptr;
    }
    json["hybrid"] = hybrid;
  }
  if (KvEventPublisher const* events = c.kvEvents) {
    json["kv_events"] = {{"batches_published", events->batchesPublished()},
                         {"batches_dropped", events->batchesDropped()},
                         {"indexed_block_hashes", r.indexedBlockHashes}};
    if (r.backend == KVCacheBackend::kSlidingWindowReuse) {
      json["kv_events"]["indexed_window_block_hashes"] = r.indexedWindowBlockHashes;
    }
  }
  if (c.speculative != SpeculativeKind::kNone) {
    json["speculative"] = speculativeJson(r);
  }
  if (r.coordinatorCounters) {
    nlohmann::ordered_json counters = nlohmann::ordered_json::object();
    nlohmann::ordered_json timings = nlohmann::ordered_json::object();
    for (CoordinatorCounterField const& counter : kCoordinatorCounterFields) {
      (counter.timing ? timings : counters)[std::string(counter.name)] =
          (*r.coordinatorCounters).*counter.value;
    }
    json["coordinator_counters"] = counters;
    json["coordinator_timings"] = timings;
  }
  if (r.tensorParallel.size > 1) {
    ReplayResult::TensorParallel const& tp = r.tensorParallel;
    json["tensor_parallel"] = {
        {"size", tp.size},
        {"devices", tp.devices},
        {"kv_head_layout",
         c.kvHeadLayout == KvHeadLayout::kSplitHeads ? "split-heads" : "replicated"},
        {"agreements", tp.agreements},
        {"divergences", tp.divergences},
        {"ranks_identical", tp.ranksIdentical},
        {"first_difference", tp.firstDifference},
        {"oracle_checks_all_ranks", tp.oracleChecksAllRanks},
        {"oracle_mismatches_all_ranks", tp.oracleMismatchesAllRanks},
    };
  }
  json["wall_s"] = std::round(r.wallSeconds * 1000.0) / 1000.0;
  // One top-level key per line, nested values on the line of their key; bytes that are not
  // UTF-8 (a trace path's, in `workload`) become U+FFFD.
  std::string out = "{\n";
  for (auto const& [key, value] : json.items()) {
    out += fmt::format("{}  {}: {}", out.size() > 2 ? ",\n" : "", nlohmann::json(key).dump(),
                       value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  }
  return out + "\n}\n";
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

std::string firstDifference(ReplayResult const& reference, ReplayResult const& other) {
  // What differs between two runs of one replay whatever they decided.
  auto const figures = [](ReplayResult const& r) {
    nlohmann::ordered_json json = nlohmann::ordered_json::parse(formatJson(r));
    for (char const* key :
         {"wall_s", "requests_per_s", "host_ns_per_step_p50", "host_ns_per_step_p99",
          "host_ns_per_step_mean", "gpu_timed", "gpu_ns_per_step_p50", "gpu_ns_per_step_p99",
          "gpu_ns_per_step_mean", "coordinator_timings", "tensor_parallel"}) {
      json.erase(key);
    }
    return json;
  };
  nlohmann::ordered_json const a = figures(reference);
  nlohmann::ordered_json const b = figures(other);
  for (auto const& [key, value] : a.items()) {
    if (!b.contains(key) || b[key] != value) {
      return fmt::format("{}: {} vs {}", key, value.dump(), b.contains(key) ? b[key].dump() : "");
    }
  }
  if (reference.records.size() != other.records.size()) {
    return fmt::format("{} vs {} requests", reference.records.size(), other.records.size());
  }
  // Each request's row without its last column (decode_host_ns, a timing).
  auto const rows = [](std::string const& csv) {
    std::vector<std::string> lines;
    for (std::size_t begin = csv.find('\n') + 1; begin < csv.size();) {
      std::size_t const end = csv.find('\n', begin);
      lines.push_back(csv.substr(begin, csv.rfind(',', end) - begin));
      begin = end + 1;
    }
    return lines;
  };
  std::vector<std::string> const rowsA = rows(formatCsv(reference));
  std::vector<std::string> const rowsB = rows(formatCsv(other));
  for (std::size_t i = 0; i < rowsA.size(); ++i) {
    if (rowsA[i] != rowsB[i]) {
      return fmt::format("request row {}: {} vs {}", i, rowsA[i], rowsB[i]);
    }
  }
  return {};
}

}  // namespace mkv::replay
