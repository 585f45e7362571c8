// mkv-replay: replays a request trace (or an embedded multi-turn workload) through
// KVCacheRuntime + ManagedKVCacheRequest + the reference engine and reports reuse, pages, oracle
// checks and host time (SPEC §14, docs/replay.md).
//
// Exit codes: 0 success, 1 internal error (a library or tool bug), 2 bad input (usage, trace,
// impossible configuration, unwritable output), 3 the KV oracle found corrupted KV.

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <charconv>
#include <cstdio>
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

using namespace mkv::replay;

constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitBadInput = 2;
constexpr int kExitCorruption = 3;

constexpr char const* kUsage = R"(usage: mkv-replay [options]

Replays requests through KVCacheRuntime + ManagedKVCacheRequest + the reference engine (CPU
tensors by default) and prints a summary. Without --trace it replays an embedded workload of 24
interleaved 5-turn conversations. Full reference: docs/replay.md.

input
  --trace FILE          JSONL trace: Mooncake FAST'25 records or token records
  --format F            auto (default: per line, by its keys), mooncake, tokens
  --limit N             replay only the first N requests
  --max-output N        cap the tokens sampled per request at N
  --seed N              workload and sampling seed (default 1)
runtime
  --mode M              reuse (default: context reuse), swa (bounded sliding-window pages),
                        full (full storage, no reuse)
  --window W            swa: sliding window in tokens (default 4096)
  --full-layers N       swa: N full-attention layers besides the sliding ones (default 0)
  --page-size N         tokens per page, power of two in [16, 1024] (default 128)
  --pool-pages N        pool size in pages (default: unbounded, sized from the workload)
  --pool-tokens N       pool size in tokens, rounded down to whole pages
  --max-batch N         sequences executing at once (default 1); reuse/full: in-flight joins,
                        swa: batches of N consecutive requests
  --layers N            attention layers (swa: sliding layers) (default 1)
  --kv-heads N          KV heads (default 1)
  --head-dim N          head dimension (default 8)
  --dtype T             fp16 (default), bf16, fp32, fp8
  --device D            cpu (default) or cuda (CUDA build with a visible device)
  --verify V            KV oracle: all, sample (default), none
KV events (reuse mode; vLLM's ZeroMQ wire format, for KV-aware routers)
  --kv-events ENDPOINT  publish each engine step's KV events on a ZeroMQ PUB socket: bound
                        for a wildcard (tcp://*:5557), connected otherwise
  --kv-events-replay ENDPOINT
                        bind a ROUTER socket that replays buffered batches on request
  --kv-events-encoding E
                        map (default: events as tagged maps) or array (positional;
                        what llm-d decodes)
  --kv-events-hold      start the replay after a line on standard input (subscribers connect
                        first), and after it keep the sockets open until standard input closes
output
  --json FILE           summary figures as one JSON object
  --csv FILE            one row per request
  --plot FILE.png       pages in use and hit rate over the replay (needs gnuplot)
  --quiet               no summary table and no progress bar
  --log-level L         the library's own log lines: off (default), error, warn, info, debug
  --help                this text

exit codes: 0 ok, 1 internal error, 2 bad input, 3 KV corruption found by the oracle
)";

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
  bool windowGiven = false;
  bool quiet = false;
  bool help = false;
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

CliOptions parseArguments(int argc, char** argv) {
  CliOptions options;
  ReplayConfig& c = options.config;
  bool poolGiven = false;
  bool fullLayersGiven = false;
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  for (int i = 1; i < argc; ++i) {
    std::string_view arg(argv[i]);
    if (arg == "--help" || arg == "-h") {
      options.help = true;
      continue;
    }
    if (arg == "--quiet") {
      options.quiet = true;
      continue;
    }
    if (arg == "--kv-events-hold") {
      options.kvEventsHold = true;
      continue;
    }
    if (arg.substr(0, 2) != "--") {
      throw UsageError(fmt::format("unexpected argument '{}' (options start with --)", arg));
    }
    std::string_view flag = arg;
    std::optional<std::string_view> inlineValue;
    if (std::size_t const eq = arg.find('='); eq != std::string_view::npos) {
      flag = arg.substr(0, eq);
      inlineValue = arg.substr(eq + 1);
    }
    auto value = [&]() -> std::string_view {
      if (inlineValue) {
        return *inlineValue;
      }
      if (i + 1 >= argc) {
        throw UsageError(fmt::format("{} needs a value", flag));
      }
      return argv[++i];
    };
    auto integer = [&](int64_t min, int64_t max) { return parseInteger(flag, value(), min, max); };
    auto int32 = [&](int64_t min, int64_t max) { return static_cast<int32_t>(integer(min, max)); };
    if (flag == "--trace") {
      options.trace = std::string(value());
    } else if (flag == "--format") {
      options.format = parseChoice<TraceFormat>(flag, value(),
                                                {{"auto", TraceFormat::kAuto},
                                                 {"mooncake", TraceFormat::kMooncake},
                                                 {"tokens", TraceFormat::kTokens}});
    } else if (flag == "--mode") {
      c.mode = parseChoice<ReplayMode>(
          flag, value(),
          {{"reuse", ReplayMode::kReuse}, {"swa", ReplayMode::kSwa}, {"full", ReplayMode::kFull}});
    } else if (flag == "--window") {
      c.windowTokens = int32(1, kInt32Max / 4);
      options.windowGiven = true;
    } else if (flag == "--full-layers") {
      c.fullLayers = int32(0, 256);
      fullLayersGiven = true;
    } else if (flag == "--page-size") {
      c.pageSize = int32(16, 1024);
    } else if (flag == "--pool-pages" || flag == "--pool-tokens") {
      if (poolGiven) {
        throw UsageError("give the pool size once: --pool-pages or --pool-tokens");
      }
      poolGiven = true;
      c.poolSizing = flag == "--pool-pages" ? PoolSizing::kPages : PoolSizing::kTokens;
      c.poolAmount = integer(0, std::numeric_limits<int64_t>::max());
    } else if (flag == "--max-batch") {
      c.maxBatch = int32(1, 4096);
    } else if (flag == "--max-output") {
      c.maxOutputTokens = int32(1, kMaxTraceTokens);
    } else if (flag == "--layers") {
      c.layers = int32(1, 256);
    } else if (flag == "--kv-heads") {
      c.kvHeads = int32(1, 4096);
    } else if (flag == "--head-dim") {
      c.headDim = int32(1, 4096);
    } else if (flag == "--dtype") {
      c.dtype = parseChoice<mkv::DataType>(flag, value(),
                                           {{"fp16", mkv::DataType::kFloat16},
                                            {"bf16", mkv::DataType::kBFloat16},
                                            {"fp32", mkv::DataType::kFloat32},
                                            {"fp8", mkv::DataType::kFp8E4M3}});
    } else if (flag == "--device") {
      c.device = parseChoice<mkv::DeviceType>(
          flag, value(), {{"cpu", mkv::DeviceType::kCPU}, {"cuda", mkv::DeviceType::kGPU}});
    } else if (flag == "--verify") {
      c.verify =
          parseChoice<mkv::testing::VerifyMode>(flag, value(),
                                                {{"all", mkv::testing::VerifyMode::kAll},
                                                 {"sample", mkv::testing::VerifyMode::kSample},
                                                 {"none", mkv::testing::VerifyMode::kNone}});
    } else if (flag == "--limit") {
      c.limit = static_cast<std::size_t>(integer(1, std::numeric_limits<int64_t>::max()));
    } else if (flag == "--seed") {
      c.seed = static_cast<uint64_t>(integer(0, std::numeric_limits<int64_t>::max()));
    } else if (flag == "--log-level") {
      options.logLevel = parseChoice<spdlog::level::level_enum>(flag, value(),
                                                                {{"off", spdlog::level::off},
                                                                 {"error", spdlog::level::err},
                                                                 {"warn", spdlog::level::warn},
                                                                 {"info", spdlog::level::info},
                                                                 {"debug", spdlog::level::debug}});
    } else if (flag == "--kv-events") {
      options.kvEvents.endpoint = std::string(value());
    } else if (flag == "--kv-events-replay") {
      options.kvEvents.replayEndpoint = std::string(value());
    } else if (flag == "--kv-events-encoding") {
      options.kvEvents.encoding = parseChoice<mkv::KvEventEncoding>(
          flag, value(),
          {{"map", mkv::KvEventEncoding::kTaggedMap},
           {"array", mkv::KvEventEncoding::kPositionalArray}});
    } else if (flag == "--json") {
      options.json = std::string(value());
    } else if (flag == "--csv") {
      options.csv = std::string(value());
    } else if (flag == "--plot") {
      options.plot = std::string(value());
    } else {
      throw UsageError(fmt::format("unknown option '{}' (see --help)", flag));
    }
  }
  if (options.format && !options.trace) {
    throw UsageError("--format applies to --trace only");
  }
  bool const kvEventOptions = !options.kvEvents.replayEndpoint.empty() || options.kvEventsHold ||
                              options.kvEvents.encoding != mkv::KvEventEncoding::kTaggedMap;
  if (options.kvEvents.endpoint.empty() && kvEventOptions) {
    throw UsageError("--kv-events-replay, --kv-events-encoding and --kv-events-hold need --kv-events");
  }
  if (!options.kvEvents.endpoint.empty() && c.mode != ReplayMode::kReuse) {
    throw UsageError("--kv-events applies to --mode reuse only");
  }
  if (c.mode != ReplayMode::kSwa && (options.windowGiven || fullLayersGiven)) {
    throw UsageError(fmt::format("{} applies to --mode swa only",
                                 options.windowGiven ? "--window" : "--full-layers"));
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
  if (options.help) {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  // Refusals and failed growth are expected under a bounded pool and counted in the summary;
  // the library's own lines about them are opt-in.
  mkv::logger()->set_level(options.logLevel);
  ReplayConfig config = options.config;
  std::unique_ptr<RequestSource> source;
  if (options.trace) {
    TraceFormat const format = options.format.value_or(TraceFormat::kAuto);
    std::vector<TraceRecord> records = loadTrace(*options.trace, format, config.limit);
    if (records.empty()) {
      throw TraceError(fmt::format("{}: no requests", *options.trace));
    }
    std::string description = fmt::format("trace {} ({} requests, format {})", *options.trace,
                                          records.size(), toString(format));
    source = std::make_unique<TraceSource>(std::move(records), std::move(description));
  } else {
    MultiTurnWorkloadConfig workload;
    workload.seed = config.seed;
    source = std::make_unique<MultiTurnWorkload>(workload);
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
      fmt::print(stderr, "mkv-replay: kv events: the replay starts after a line on standard input\n");
      std::fflush(stderr);
      for (int c = std::fgetc(stdin); c != EOF && c != '\n'; c = std::fgetc(stdin)) {
      }
    }
  }

  ProgressBar bar(stderr, !options.quiet && ::isatty(STDERR_FILENO) != 0);
  ReplayResult const result = runReplay(
      *source, config, [&bar](std::size_t done, std::size_t total) { bar.update(done, total); });
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
  if (result.oracleMismatches > 0) {
    fmt::print(stderr, "mkv-replay: the KV oracle found {} corrupted positions; first: {}\n",
               result.oracleMismatches, result.firstMismatch);
    return kExitCorruption;
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (UsageError const& error) {
    fmt::print(stderr, "mkv-replay: {}\n", error.what());
  } catch (TraceError const& error) {
    fmt::print(stderr, "mkv-replay: {}\n", error.what());
  } catch (ReplayConfigError const& error) {
    fmt::print(stderr, "mkv-replay: {}\n", error.what());
  } catch (mkv::Error const& error) {
    fmt::print(stderr, "mkv-replay: internal error: {}\n", error.what());
    return kExitInternal;
  } catch (std::exception const& error) {
    fmt::print(stderr, "mkv-replay: internal error: {}\n", error.what());
    return kExitInternal;
  } catch (...) {
    fmt::print(stderr, "mkv-replay: internal error: an unknown exception\n");
    return kExitInternal;
  }
  return kExitBadInput;
}
