// mkv-replay: replays a request trace (or an embedded multi-turn workload) through
// KVCacheRuntime + ManagedKVCacheRequest + the reference engine and reports reuse, pages, oracle
// checks and host time (docs/replay.md).
//
// Exit codes: 0 success, 1 internal error (a library or tool bug), 2 bad input (usage, trace,
// impossible configuration, unwritable output), 3 the KV oracle found corrupted KV (or the
// recurrent oracle a corrupted recurrent state).

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/error.h"
#include "mkv/events/kv_event_publisher.h"
#include "mkv/logging.h"
#include "multi_turn_workload.h"
#include "progress_bar.h"
#include "replay_plot.h"
#include "replay_report.h"
#include "replay_runner.h"
#include "trace.h"

namespace {

using mkv::replay::formatCsv;
using mkv::replay::formatJson;
using mkv::replay::formatSummary;
using mkv::replay::kMaxTraceTokens;
using mkv::replay::loadTrace;
using mkv::replay::MultiTurnWorkload;
using mkv::replay::MultiTurnWorkloadConfig;
using mkv::replay::PlotOutcome;
using mkv::replay::PlotStatus;
using mkv::replay::PoolSizing;
using mkv::replay::ProgressBar;
using mkv::replay::ProgressCallback;
using mkv::replay::ReplayConfig;
using mkv::replay::ReplayConfigError;
using mkv::replay::ReplayMode;
using mkv::replay::ReplayResult;
using mkv::replay::RequestSource;
using mkv::replay::runReplay;
using mkv::replay::runTensorParallelReplay;
using mkv::replay::SpeculativeKind;
using mkv::replay::toString;
using mkv::replay::TraceError;
using mkv::replay::TraceFormat;
using mkv::replay::TraceRecord;
using mkv::replay::TraceSource;
using mkv::replay::writePlot;

constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitCorruption = 3;

constexpr char const* kDescription =
    "Replays requests through KVCacheRuntime + ManagedKVCacheRequest + the reference engine (CPU\n"
    "tensors by default) and prints a summary. Without --trace it replays an embedded workload of\n"
    "24 interleaved 5-turn conversations. Full reference: docs/replay.md.";

constexpr char const* kFooter =
    "exit codes: 0 ok, 1 internal error, 2 bad input, 3 KV corruption found by the oracle";

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CliOptions {
  ReplayConfig config;
  std::optional<std::string> trace;
  std::optional<TraceFormat> format;
  std::optional<std::string> json;
  std::optional<std::string> csv;
  std::optional<std::string> plot;
  spdlog::level::level_enum logLevel = spdlog::level::off;
  mkv::KvEventPublisherConfig kvEvents;  ///< endpoint empty: no publisher
  bool kvEventsHold = false;
  bool attentionOnlyBaseline = true;  ///< hybrid: replay the trace attention-only as well
  bool quiet = false;
  std::string help;  ///< the usage text when --help was given
};

int64_t parseInteger(std::string_view flag, std::string_view text, int64_t min, int64_t max) {
  int64_t value = 0;
  auto const result = std::from_chars(text.data(), text.data() + text.size(), value);
  if (result.ec == std::errc::result_out_of_range ||
      (result.ec == std::errc() && result.ptr == text.data() + text.size() &&
       (value < min || value > max))) {
    throw UsageError(fmt::format("{} {} is outside [{}, {}]", flag, text, min, max));
  }
  if (result.ec != std::errc() || result.ptr != text.data() + text.size()) {
    throw UsageError(fmt::format("{} expects an integer, got '{}'", flag, text));
  }
  return value;
}

template <typename T>
T parseChoice(std::string_view flag, std::string_view text,
              std::initializer_list<std::pair<std::string_view, T>> choices) {
  std::string names;
  for (auto const& [name, value] : choices) {
    if (name == text) {
      return value;
    }
    names += fmt::format("{}{}", names.empty() ? "" : ", ", name);
  }
  throw UsageError(fmt::format("{} expects one of {}, got '{}'", flag, names, text));
}

/// CLI11 parses the command line (option names, `--flag value` and `--flag=value`, help text);
/// values are converted here so that every message is the one docs/replay.md documents.
CliOptions parseArguments(int argc, char** argv) {
  CliOptions options;
  ReplayConfig& c = options.config;
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  CLI::App app(kDescription, "mkv-replay");
  app.set_help_flag();
  app.allow_extras();  // reported below, as documented
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.footer(kFooter);
  app.get_formatter()->label("Usage", "usage");
  app.get_formatter()->column_width(26);

  std::string_view group;
  // An option with a value, converted by `set(flag, value)` when the parse ends.
  auto option = [&](std::string const& flag, std::string const& type, std::string const& help,
                    auto set) {
    return app
        .add_option_function<std::string>(
            flag, [flag, set](std::string const& value) { set(flag, value); }, help)
        ->type_name(type)
        ->group(std::string(group));
  };
  auto int32 = [](int64_t min, int64_t max, int32_t& target) {
    return [min, max, &target](std::string_view flag, std::string_view value) {
      target = static_cast<int32_t>(parseInteger(flag, value, min, max));
    };
  };
  auto text = [](std::optional<std::string>& target) {
    return [&target](std::string_view, std::string const& value) { target = value; };
  };

  group = "input";
  option("--trace", "FILE", "JSONL trace: Mooncake FAST'25 records or token records",
         text(options.trace));
  option("--format", "F", "auto (default: per line, by its keys), mooncake, tokens",
         [&](std::string_view flag, std::string_view value) {
           options.format = parseChoice<TraceFormat>(flag, value,
                                                     {{"auto", TraceFormat::kAuto},
                                                      {"mooncake", TraceFormat::kMooncake},
                                                      {"tokens", TraceFormat::kTokens}});
         });
  option("--limit", "N", "replay only the first N requests",
         [&](std::string_view flag, std::string_view value) {
           c.limit = static_cast<std::size_t>(
               parseInteger(flag, value, 1, std::numeric_limits<int64_t>::max()));
         });
  option("--max-output", "N", "cap the tokens sampled per request at N",
         int32(1, kMaxTraceTokens, c.maxOutputTokens));
  auto* resetEvery = option(
      "--reset-cache-every", "N",
      "reuse: clear the prefix cache after every N requests (between runs; AllBlocksCleared)",
      [&](std::string_view flag, std::string_view value) {
        c.resetCacheEvery = parseInteger(flag, value, 1, std::numeric_limits<int64_t>::max());
      });
  option("--seed", "N", "workload and sampling seed (default 1)",
         [&](std::string_view flag, std::string_view value) {
           c.seed = static_cast<uint64_t>(
               parseInteger(flag, value, 0, std::numeric_limits<int64_t>::max()));
         });

  group = "runtime";
  option("--mode", "M",
         "reuse (default: context reuse), swa (bounded sliding-window pages), full (full "
         "storage, no reuse)",
         [&](std::string_view flag, std::string_view value) {
           c.mode = parseChoice<ReplayMode>(flag, value,
                                            {{"reuse", ReplayMode::kReuse},
                                             {"swa", ReplayMode::kSwa},
                                             {"full", ReplayMode::kFull}});
         });
  auto* window = option("--window", "W",
                        "sliding window in tokens (default 4096): in swa mode the window of the "
                        "bounded layers; in reuse mode it makes the --layers sliding and selects "
                        "sliding-window reuse (needs --full-layers >= 1)",
                        int32(1, kInt32Max / 4, c.windowTokens));
  auto* fullLayers = option("--full-layers", "N",
                            "swa, or reuse with --window: N full-attention layers besides the "
                            "sliding ones (default 0)",
                            int32(0, 256, c.fullLayers));
  auto* slidingShare = option(
      "--sliding-budget-share", "F",
      "reuse with --window and --kv-budget-bytes: the share of the budget that buys sliding pages, "
      "in (0, 1) (default 0.45: within a point of the best of 0.4 to 0.7 on the Mooncake sample "
      "at every budget where full storage evicts much; the rest buys full-pool pages)",
      [&](std::string_view flag, std::string_view value) {
        std::string const number(value);
        char* end = nullptr;
        double const share = std::strtod(number.c_str(), &end);
        if (number.empty() || end != number.c_str() + number.size() ||
            !(share > 0.0 && share < 1.0)) {
          throw UsageError(fmt::format("{} {}: expected a number in (0, 1)", flag, value));
        }
        c.slidingBudgetShare = share;
      });
  option("--page-size", "N", "tokens per page, power of two in [16, 1024] (default 128)",
         int32(16, 1024, c.pageSize));
  auto pool = [&](PoolSizing sizing) {
    return [&c, sizing](std::string_view flag, std::string_view value) {
      c.poolSizing = sizing;
      c.poolAmount = parseInteger(flag, value, 0, std::numeric_limits<int64_t>::max());
    };
  };
  auto* poolPages = option("--pool-pages", "N",
                           "pool size in pages (default: unbounded, sized from the workload)",
                           pool(PoolSizing::kPages));
  auto* poolTokens =
      option("--pool-tokens", "N", "pool size in tokens, rounded down to whole pages",
             pool(PoolSizing::kTokens));
  auto* budget = option(
      "--kv-budget-bytes", "B",
      "device bytes for every KV pool (K and V of every layer: full, sliding, draft), split by "
      "the mode (docs/replay.md, \"KV budget\"); the host tier, recurrent state and snapshots "
      "are not KV and not in B",
      pool(PoolSizing::kBudgetBytes));
  auto* eviction =
      option("--eviction", "P",
             "reuse: victim order of cached records, s3fifo (default), lru or loopaware "
             "(docs/context_cache.md)",
             [&](std::string_view flag, std::string_view value) {
               c.eviction = parseChoice<mkv::EvictionPolicyKind>(
                   flag, value,
                   {{"lru", mkv::EvictionPolicyKind::kLru},
                    {"s3fifo", mkv::EvictionPolicyKind::kS3Fifo},
                    {"loopaware", mkv::EvictionPolicyKind::kLoopAware}});
             });
  auto* hostPool =
      option("--host-pool-tokens", "N",
             "reuse: a host tier of N tokens (pinned host memory) that keeps evicted blocks "
             "(docs/context_cache.md, \"Host tier\")",
             [&](std::string_view flag, std::string_view value) {
               c.hostPoolTokens = parseInteger(flag, value, 1, std::numeric_limits<int64_t>::max());
             });
  option("--remote-tier", "URL",
         "reuse with a host tier: a KV store shared with other engines, redis://HOST:PORT or "
         "file:///DIR; each request first loads the blocks the store holds past its local hit, "
         "and published blocks are saved (docs/context_cache.md, \"Remote tier\")",
         [&](std::string_view, std::string_view value) { c.remoteTier = std::string(value); });
  option("--remote-model", "NAME",
         "with --remote-tier: the model name in the blocks' deployment identity (default "
         "mkv-replay); engines of another name never load each other's blocks",
         [&](std::string_view, std::string_view value) { c.remoteModel = std::string(value); });
  option("--remote-ttl", "S",
         "with --remote-tier: each saved value expires after S seconds (default 0: never; the "
         "store's own eviction, e.g. Redis maxmemory with an allkeys policy, bounds it)",
         [&](std::string_view flag, std::string_view value) {
           c.remoteTtlSeconds = parseInteger(flag, value, 1, int64_t{1} << 31);
         });
  option("--role", "R",
         "with --remote-tier: both (default), prefill (outputs capped at the first token; saves "
         "for a decode instance) or decode (loads what a prefill instance saved; saves nothing)",
         [&](std::string_view flag, std::string_view value) {
           c.role =
               parseChoice<mkv::replay::ReplayRole>(flag, value,
                                                    {{"both", mkv::replay::ReplayRole::kBoth},
                                                     {"prefill", mkv::replay::ReplayRole::kPrefill},
                                                     {"decode", mkv::replay::ReplayRole::kDecode}});
         });
  option("--max-batch", "N",
         "sequences executing at once (default 1); reuse/full: in-flight joins, swa: batches of "
         "N consecutive requests (in-flight joins with --max-batched-tokens)",
         int32(1, 4096, c.maxBatch));
  option("--max-batched-tokens", "N",
         "a serving engine's token budget per step: decodes first, then prefill chunks of the "
         "joiners (vLLM's policy; needs --max-batch > 1 with in-flight joins, which it turns on "
         "in swa mode; default 0: a joiner prefills in the step it joins)",
         int32(1, kInt32Max, c.maxBatchedTokens));
  option("--preemption", "P",
         "none (default), recompute or swap: before a decode step whose page growth the pool "
         "cannot give, preempt the newest running sequences and admit them again first, reusing "
         "what they published (vLLM's recompute; needs in-flight joins); swap also moves their "
         "published blocks to the host tier when they are compacted away (needs "
         "--host-pool-tokens)",
         [&](std::string_view flag, std::string_view value) {
           c.preemption = parseChoice<mkv::testing::PreemptionMode>(
               flag, value,
               {{"none", mkv::testing::PreemptionMode::kNone},
                {"recompute", mkv::testing::PreemptionMode::kRecompute},
                {"swap", mkv::testing::PreemptionMode::kSwap}});
         });
  option("--joiner-pages", "A",
         "whole-prompt (default: a joiner takes its prompt's pages when it is admitted) or "
         "per-chunk (vLLM's allocation: admission binds the reused prefix, each prefill chunk "
         "allocates its pages before its step; needs in-flight joins)",
         [&](std::string_view flag, std::string_view value) {
           c.joinerPages = parseChoice<mkv::JoinerPageAllocation>(
               flag, value,
               {{"whole-prompt", mkv::JoinerPageAllocation::kWholePrompt},
                {"per-chunk", mkv::JoinerPageAllocation::kPerChunk}});
         });
  option("--tensor-parallel", "N",
         "replay on N tensor-parallel ranks at once, one runtime and thread each, every rank "
         "holding its share of the KV heads and agreeing at every completion point; the figures "
         "are rank 0's, and every rank's must equal them (default 1)",
         int32(1, 64, c.tensorParallel));
  option("--kv-head-layout", "L",
         "split-heads (default: each rank holds kv-heads / N heads) or replicated (MLA-style "
         "latent KV: every rank holds the same bytes)",
         [&](std::string_view flag, std::string_view value) {
           c.kvHeadLayout =
               parseChoice<mkv::KvHeadLayout>(flag, value,
                                              {{"split-heads", mkv::KvHeadLayout::kSplitHeads},
                                               {"replicated", mkv::KvHeadLayout::kReplicated}});
         });
  option("--layers", "N", "attention layers (swa: sliding layers) (default 1)",
         int32(1, 256, c.layers));
  option("--kv-heads", "N", "KV heads (default 1)", int32(1, 4096, c.kvHeads));
  option("--head-dim", "N", "head dimension (default 8)", int32(1, 4096, c.headDim));
  option("--dtype", "T", "fp16 (default), bf16, fp32, fp8",
         [&](std::string_view flag, std::string_view value) {
           c.dtype = parseChoice<mkv::DataType>(flag, value,
                                                {{"fp16", mkv::DataType::kFloat16},
                                                 {"bf16", mkv::DataType::kBFloat16},
                                                 {"fp32", mkv::DataType::kFloat32},
                                                 {"fp8", mkv::DataType::kFp8E4M3}});
         });
  option("--device", "D", "cpu (default) or cuda (CUDA build with a visible device)",
         [&](std::string_view flag, std::string_view value) {
           c.device = parseChoice<mkv::DeviceType>(
               flag, value, {{"cpu", mkv::DeviceType::kCPU}, {"cuda", mkv::DeviceType::kGPU}});
         });
  option("--device-writes", "W",
         "each-call (default) or engine-step: the library's table and length writes reach the "
         "device at the end of each call, or at the engine's one flush per step",
         [&](std::string_view flag, std::string_view value) {
           c.deviceWrites = parseChoice<mkv::DeviceWriteTiming>(
               flag, value,
               {{"each-call", mkv::DeviceWriteTiming::kEachCall},
                {"engine-step", mkv::DeviceWriteTiming::kEngineStep}});
         });
  option("--verify", "V", "KV oracle: all, sample (default), none",
         [&](std::string_view flag, std::string_view value) {
           c.verify =
               parseChoice<mkv::testing::VerifyMode>(flag, value,
                                                     {{"all", mkv::testing::VerifyMode::kAll},
                                                      {"sample", mkv::testing::VerifyMode::kSample},
                                                      {"none", mkv::testing::VerifyMode::kNone}});
         });

  group = "speculative decoding (reuse mode; docs/replay.md, \"Speculative decoding\")";
  option("--speculative", "S",
         "none (default), eagle (draft head with paged KV: paired base + draft reuse), mtp "
         "(an MTP draft with paged KV, or reading the base KV with --draft-layers 0; with "
         "--recurrent-layers, Hybrid-MTP)",
         [&](std::string_view flag, std::string_view value) {
           c.speculative = parseChoice<SpeculativeKind>(flag, value,
                                                        {{"none", SpeculativeKind::kNone},
                                                         {"eagle", SpeculativeKind::kEagle},
                                                         {"mtp", SpeculativeKind::kMtp}});
         });
  auto* draftLayers =
      option("--draft-layers", "N",
             "attention layers of the draft, with the base's heads, head dim and dtype (default "
             "1); mtp: 0 = the draft reads the base KV",
             int32(0, 256, c.draftLayers));
  auto* specWidth = option(
      "--spec-width", "K", "draft tokens proposed per verification round, in [1, 64] (default 3)",
      int32(1, mkv::testing::ReferenceEngine::kMaxSpeculativeWidth, c.specWidth));
  auto* hiddenWidth = option(
      "--boundary-hidden-width", "N",
      "Hybrid-MTP (mtp with --recurrent-layers): fp16 elements of the base hidden row kept with "
      "each prompt endpoint, in [1, 32768] (default 16)",
      [&c](std::string_view flag, std::string_view value) {
        c.boundaryHiddenWidth = parseInteger(flag, value, 1, int64_t{1} << 15);
      });
  group = "hybrid model (reuse mode: exact checkpoints of the recurrent layers)";
  option("--recurrent-layers", "N",
         "Mamba / linear-attention layers besides the attention ones (default 0: attention-only)",
         int32(0, 128, c.recurrentLayers));
  auto bytes = [](int64_t& target) {
    return [&target](std::string_view flag, std::string_view value) {
      target = parseInteger(flag, value, 1, int64_t{1} << 30);
    };
  };
  auto* stateBytes = option("--recurrent-state-bytes", "B",
                            "recurrent state bytes per layer and sequence (default 64)",
                            bytes(c.recurrentStateBytes));
  auto* convBytes = option("--recurrent-conv-bytes", "B",
                           "recurrent conv bytes per layer and sequence (default 16)",
                           bytes(c.recurrentConvBytes));
  auto* snapshotSlots =
      option("--snapshot-slots", "N",
             "snapshot budget in checkpoints (default: unbounded, every capture finds a slot)",
             [&](std::string_view flag, std::string_view value) {
               c.snapshotSlots = parseInteger(flag, value, 1, kInt32Max / 2);
             });
  auto* checkpointInterval = option(
      "--checkpoint-interval", "N",
      "tokens between reuse points, a multiple of the page size: hybrid models keep a checkpoint "
      "there, sliding-window reuse the window before it (default 0: none; docs/replay.md)",
      int32(0, kInt32Max, c.checkpointInterval));
  auto* pointAdmission = option(
      "--reuse-point-admission", "A",
      "hybrid models with --checkpoint-interval: branch-first (default: also where a prompt "
      "branches from cached content; interval points and chunk ends rank below the proven records, "
      "the finest first, until a prompt passes through them again) or every (every interval point, "
      "ranked as any checkpoint); docs/context_cache.md",
      [&](std::string_view flag, std::string_view value) {
        c.reusePointAdmission = parseChoice<mkv::ReusePointAdmission>(
            flag, value,
            {{"every", mkv::ReusePointAdmission::kEveryInterval},
             {"branch-first", mkv::ReusePointAdmission::kBranchFirst}});
      });
  bool noBaseline = false;
  auto* noBaselineFlag =
      app.add_flag("--no-attention-only", noBaseline,
                   "skip the second, attention-only replay of the trace (the reuse comparison)")
          ->group(std::string(group));

  group = "KV events (reuse mode; vLLM's ZeroMQ wire format, for KV-aware routers)";
  option("--kv-events", "ENDPOINT",
         "publish each engine step's KV events on a ZeroMQ PUB socket: bound for a wildcard "
         "(tcp://*:5557), connected otherwise",
         [&](std::string_view, std::string const& value) { options.kvEvents.endpoint = value; });
  auto* replay = option(
      "--kv-events-replay", "ENDPOINT",
      "bind a ROUTER socket that replays buffered batches on request",
      [&](std::string_view, std::string const& value) { options.kvEvents.replayEndpoint = value; });
  auto* encoding =
      option("--kv-events-encoding", "E",
             "map (default: events as tagged maps) or array (positional; what llm-d decodes)",
             [&](std::string_view flag, std::string_view value) {
               options.kvEvents.encoding = parseChoice<mkv::KvEventEncoding>(
                   flag, value,
                   {{"map", mkv::KvEventEncoding::kTaggedMap},
                    {"array", mkv::KvEventEncoding::kPositionalArray}});
             });
  auto* hold = app.add_flag("--kv-events-hold", options.kvEventsHold,
                            "start the replay after a line on standard input (subscribers "
                            "connect first), and after it keep the sockets open until standard "
                            "input closes")
                   ->group(std::string(group));

  group = "output";
  option("--json", "FILE", "summary figures as one JSON object", text(options.json));
  option("--csv", "FILE", "one row per request", text(options.csv));
  option("--plot", "FILE.png", "pages in use and hit rate over the replay (needs gnuplot)",
         text(options.plot));
  app.add_flag("--quiet", options.quiet, "no summary table and no progress bar")->group("output");
  option("--log-level", "L", "the library's own log lines: off (default), error, warn, info, debug",
         [&](std::string_view flag, std::string_view value) {
           options.logLevel =
               parseChoice<spdlog::level::level_enum>(flag, value,
                                                      {{"off", spdlog::level::off},
                                                       {"error", spdlog::level::err},
                                                       {"warn", spdlog::level::warn},
                                                       {"info", spdlog::level::info},
                                                       {"debug", spdlog::level::debug}});
         });
  bool help = false;
  app.add_flag("-h,--help", help, "this text")->group("output");

  try {
    app.parse(argc, argv);
  } catch (CLI::ArgumentMismatch const& error) {
    // "--verify: 1 required V missing": CLI11 names the option first.
    std::string_view const what = error.what();
    throw UsageError(fmt::format("{} needs a value", what.substr(0, what.find(':'))));
  } catch (CLI::ParseError const& error) {
    throw UsageError(error.what());
  }
  if (help) {
    options.help = app.help();
    return options;
  }
  if (std::vector<std::string> const extras = app.remaining(); !extras.empty()) {
    std::string_view const arg = extras.front();
    if (arg.substr(0, 2) != "--") {
      throw UsageError(fmt::format("unexpected argument '{}' (options start with --)", arg));
    }
    throw UsageError(fmt::format("unknown option '{}' (see --help)", arg.substr(0, arg.find('='))));
  }
  auto const given = [](auto const* flag) { return flag->count() > 0 ? 1 : 0; };
  if (given(poolPages) + given(poolTokens) + given(budget) > 1) {
    throw UsageError("give the pool size once: --pool-pages, --pool-tokens or --kv-budget-bytes");
  }
  if (options.format && !options.trace) {
    throw UsageError("--format applies to --trace only");
  }
  if (options.kvEvents.endpoint.empty() &&
      replay->count() + encoding->count() + hold->count() > 0) {
    throw UsageError(
        "--kv-events-replay, --kv-events-encoding and --kv-events-hold need --kv-events");
  }
  if (resetEvery->count() > 0 && c.mode != ReplayMode::kReuse) {
    throw UsageError("--reset-cache-every applies to --mode reuse only");
  }
  if (!options.kvEvents.endpoint.empty() && c.mode != ReplayMode::kReuse) {
    throw UsageError("--kv-events applies to --mode reuse only");
  }
  if (c.mode != ReplayMode::kReuse && eviction->count() > 0) {
    throw UsageError("--eviction applies to --mode reuse only");
  }
  if (hostPool->count() > 0 && (c.mode != ReplayMode::kReuse ||
                                c.speculative != SpeculativeKind::kNone || c.recurrentLayers > 0)) {
    throw UsageError(
        "--host-pool-tokens applies to --mode reuse on an attention-only model without "
        "--speculative");
  }
  if (c.speculative == SpeculativeKind::kNone && draftLayers->count() + specWidth->count() > 0) {
    throw UsageError(fmt::format("{} needs --speculative eagle or mtp",
                                 draftLayers->count() > 0 ? "--draft-layers" : "--spec-width"));
  }
  if (c.speculative != SpeculativeKind::kNone && c.mode != ReplayMode::kReuse) {
    throw UsageError(
        fmt::format("--speculative applies to --mode reuse only (the {} backend "
                    "decodes vanilla only)",
                    c.mode == ReplayMode::kSwa ? "bounded-SWA" : "full-storage"));
  }
  if (c.speculative == SpeculativeKind::kEagle && c.draftLayers == 0) {
    throw UsageError(
        "--speculative eagle needs --draft-layers >= 1 (an EAGLE head owns paged KV; a draft "
        "reading the base KV is --speculative mtp --draft-layers 0)");
  }
  if (c.recurrentLayers > 0 && c.mode != ReplayMode::kReuse) {
    throw UsageError("--recurrent-layers applies to --mode reuse only");
  }
  if (c.recurrentLayers == 0 &&
      stateBytes->count() + convBytes->count() + snapshotSlots->count() + noBaselineFlag->count() >
          0) {
    throw UsageError(
        "--recurrent-state-bytes, --recurrent-conv-bytes, --snapshot-slots and "
        "--no-attention-only need --recurrent-layers N > 0");
  }
  if (c.speculative == SpeculativeKind::kEagle && c.recurrentLayers > 0) {
    throw UsageError(
        "--speculative eagle with --recurrent-layers: the speculative hybrid deployment is "
        "Hybrid-MTP (--speculative mtp)");
  }
  bool const hybridMtp = c.speculative == SpeculativeKind::kMtp && c.recurrentLayers > 0;
  if (hybridMtp && c.draftLayers == 0) {
    throw UsageError(
        "--speculative mtp with --recurrent-layers (Hybrid-MTP) needs --draft-layers >= 1 (the "
        "draft owns paged KV)");
  }
  if (!hybridMtp && hiddenWidth->count() > 0) {
    throw UsageError(
        "--boundary-hidden-width needs --speculative mtp with --recurrent-layers N > 0");
  }
  options.attentionOnlyBaseline = !noBaseline;
  c.slidingReuse = c.mode == ReplayMode::kReuse && window->count() > 0;
  if (pointAdmission->count() > 0 && (c.recurrentLayers == 0 || c.checkpointInterval == 0)) {
    throw UsageError(
        "--reuse-point-admission needs --recurrent-layers N > 0 and --checkpoint-interval N > 0");
  }
  if (checkpointInterval->count() > 0 && c.recurrentLayers == 0 && !c.slidingReuse) {
    throw UsageError(
        "--checkpoint-interval needs --recurrent-layers N > 0 or --window W (reuse mode)");
  }
  if (c.mode == ReplayMode::kFull && window->count() + fullLayers->count() > 0) {
    throw UsageError(fmt::format("{} applies to --mode swa and reuse only",
                                 window->count() > 0 ? "--window" : "--full-layers"));
  }
  if (c.mode == ReplayMode::kReuse && fullLayers->count() > 0 && !c.slidingReuse) {
    throw UsageError("--full-layers in reuse mode needs --window (sliding-window reuse)");
  }
  if (slidingShare->count() > 0 && !(c.slidingReuse && c.poolSizing == PoolSizing::kBudgetBytes)) {
    throw UsageError(
        "--sliding-budget-share needs --mode reuse with --window and --kv-budget-bytes");
  }
  return options;
}

/// An output file opened before the replay, so an unwritable path fails at once.
std::unique_ptr<std::ofstream> openOutput(std::optional<std::string> const& path) {
  if (!path) {
    return nullptr;
  }
  auto file = std::make_unique<std::ofstream>(*path, std::ios::binary | std::ios::trunc);
  if (!*file) {
    throw UsageError(fmt::format("cannot write {}", *path));
  }
  return file;
}

void writeOutput(std::ofstream* file, std::optional<std::string> const& path,
                 std::string const& text) {
  if (file == nullptr) {
    return;
  }
  *file << text;
  file->close();
  if (!*file) {
    throw UsageError(fmt::format("writing {} failed", *path));
  }
}

int run(int argc, char** argv) {
  CliOptions const options = parseArguments(argc, argv);
  if (!options.help.empty()) {
    std::fputs(options.help.c_str(), stdout);
    return kExitOk;
  }
  // Refusals and failed growth are expected under a bounded pool and counted in the summary;
  // the library's own lines about them are opt-in.
  mkv::logger()->set_level(options.logLevel);
  ReplayConfig config = options.config;
  // Hybrid: a second, fresh copy of the workload for the attention-only replay (not with
  // --tensor-parallel); tensor parallelism: one fresh copy per rank.
  bool const baseline =
      config.recurrentLayers > 0 && options.attentionOnlyBaseline && config.tensorParallel == 1;
  std::size_t const copies = static_cast<std::size_t>(config.tensorParallel) + (baseline ? 1 : 0);
  std::vector<std::unique_ptr<RequestSource>> sources;
  if (options.trace) {
    TraceFormat const format = options.format.value_or(TraceFormat::kAuto);
    std::vector<TraceRecord> records = loadTrace(*options.trace, format, config.limit);
    if (records.empty()) {
      throw TraceError(fmt::format("{}: no requests", *options.trace));
    }
    std::string const description = fmt::format("trace {} ({} requests, format {})", *options.trace,
                                                records.size(), toString(format));
    while (sources.size() < copies) {
      sources.push_back(std::make_unique<TraceSource>(records, description));
    }
  } else {
    MultiTurnWorkloadConfig workload;
    workload.seed = config.seed;
    while (sources.size() < copies) {
      sources.push_back(std::make_unique<MultiTurnWorkload>(workload));
    }
  }
  auto const json = openOutput(options.json);
  auto const csv = openOutput(options.csv);
  std::unique_ptr<mkv::KvEventPublisher> events;
  if (!options.kvEvents.endpoint.empty()) {
    try {
      events = mkv::KvEventPublisher::create(options.kvEvents);
    } catch (mkv::Error const& error) {
      throw UsageError(error.what());
    }
    fmt::print(stderr, "mkv-replay: kv events on {}{}\n", events->endpoint(),
               events->replayEndpoint().empty()
                   ? std::string()
                   : fmt::format(", replay on {}", events->replayEndpoint()));
    config.kvEvents = events.get();
    if (options.kvEventsHold) {
      fmt::print(stderr,
                 "mkv-replay: kv events: the replay starts after a line on standard input\n");
      std::fflush(stderr);
      for (int c = std::fgetc(stdin); c != EOF && c != '\n'; c = std::fgetc(stdin)) {
      }
    }
  }

  ProgressBar bar(stderr, !options.quiet && ::isatty(STDERR_FILENO) != 0);
  ProgressCallback const progress = [&bar](std::size_t done, std::size_t total) {
    bar.update(done, total);
  };
  ReplayResult result;
  if (config.tensorParallel > 1) {
    std::vector<RequestSource*> ranks;
    ranks.reserve(sources.size());
    for (auto const& source : sources) {
      ranks.push_back(source.get());
    }
    result = runTensorParallelReplay(ranks, config, progress);
  } else {
    result = runReplay(*sources[0], config, progress, baseline ? sources[1].get() : nullptr);
  }
  bar.clear();
  if (events) {
    events->flush();
    fmt::print(stderr, "mkv-replay: kv events: {} batches published, {} dropped\n",
               events->batchesPublished(), events->batchesDropped());
  }

  if (!options.quiet) {
    std::fputs(formatSummary(result).c_str(), stdout);
    std::fflush(stdout);
  }
  writeOutput(json.get(), options.json, formatJson(result));
  writeOutput(csv.get(), options.csv, formatCsv(result));
  int code = kExitOk;
  if (options.plot) {
    PlotOutcome const plot = writePlot(result, *options.plot);
    if (plot.status == PlotStatus::kFailed) {
      fmt::print(stderr, "mkv-replay: {}\n", plot.message);
      code = kExitInternal;
    } else if (plot.status == PlotStatus::kNoGnuplot || !options.quiet) {
      fmt::print(stderr, "mkv-replay: {}\n", plot.message);
    }
  }
  if (events && options.kvEventsHold) {
    fmt::print(stderr, "mkv-replay: kv event sockets open until standard input closes\n");
    std::fflush(stderr);
    for (int c = std::fgetc(stdin); c != EOF; c = std::fgetc(stdin)) {
    }
  }
  if (!result.tensorParallel.ranksIdentical) {
    fmt::print(stderr, "mkv-replay: the tensor-parallel ranks decided differently; {}\n",
               result.tensorParallel.firstDifference);
    return kExitCorruption;
  }
  if (result.tensorParallel.oracleMismatchesAllRanks > result.oracleMismatches) {
    fmt::print(stderr, "mkv-replay: the KV oracle found {} corrupted positions in other ranks\n",
               result.tensorParallel.oracleMismatchesAllRanks - result.oracleMismatches);
    return kExitCorruption;
  }
  if (result.oracleMismatches > 0) {
    if (result.hybrid.recurrentMismatches > 0) {
      fmt::print(stderr,
                 "mkv-replay: the oracles found {} corrupted positions and recurrent states ({} "
                 "recurrent); first: {}\n",
                 result.oracleMismatches, result.hybrid.recurrentMismatches, result.firstMismatch);
    } else {
      fmt::print(stderr, "mkv-replay: the KV oracle found {} corrupted positions; first: {}\n",
                 result.oracleMismatches, result.firstMismatch);
    }
    return kExitCorruption;
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // The handlers write with std::fprintf, which does not throw (fmt::print may).
  try {
    return run(argc, argv);
  } catch (UsageError const& error) {
    std::fprintf(stderr, "mkv-replay: %s\n", error.what());
  } catch (TraceError const& error) {
    std::fprintf(stderr, "mkv-replay: %s\n", error.what());
  } catch (ReplayConfigError const& error) {
    std::fprintf(stderr, "mkv-replay: %s\n", error.what());
  } catch (mkv::Error const& error) {
    std::fprintf(stderr, "mkv-replay: internal error: %s\n", error.what());
    return kExitInternal;
  } catch (std::exception const& error) {
    std::fprintf(stderr, "mkv-replay: internal error: %s\n", error.what());
    return kExitInternal;
  } catch (...) {
    std::fprintf(stderr, "mkv-replay: internal error: an unknown exception\n");
    return kExitInternal;
  }
  return kExitBadInput;
}
