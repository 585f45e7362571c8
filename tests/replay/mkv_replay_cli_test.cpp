// The mkv-replay executable: exit codes, the one-line messages for bad input, the output files,
// the plot, and silence on a non-terminal stderr.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "mkv/context_cache/context_cache_coordinator.h"
#include "replay_plot.h"
#include "support/test_inputs.h"

namespace mkv::replay {
namespace {

namespace fs = std::filesystem;

std::string quoted(std::string const& text) {
  std::string out = "'";
  for (char c : text) {
    out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  }
  return out + "'";
}

std::string slurp(fs::path const& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

struct CliResult {
  int exitCode = -1;
  std::string out;
  std::string err;
};

class MkvReplayCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "mkv-replay-cli-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    mDir = pattern;
    // The executable beside the suite's folder, in the build tree as in the GPU bundle.
    mExecutable = test::findBuildOutput("benchmarks/replay/mkv-replay");
    if (mExecutable.empty()) {
      GTEST_SKIP()
          << "benchmarks/replay/mkv-replay not found in the folders above the test executable";
    }
  }
  void TearDown() override { fs::remove_all(mDir); }

  /// Runs mkv-replay with `args` (stdout and stderr to files, so stderr is no terminal).
  CliResult run(std::vector<std::string> const& args, std::string const& environment = "") {
    // Appended piece by piece: GCC 12 -O3 warns falsely (-Wrestrict) on chains of operator+.
    std::string command = environment;
    command.append(" ").append(quoted(mExecutable.string()));
    for (std::string const& arg : args) {
      command.append(" ").append(quoted(arg));
    }
    command.append(" >").append(quoted((mDir / "stdout").string()));
    command.append(" 2>").append(quoted((mDir / "stderr").string()));
    int const status = std::system(command.c_str());
    CliResult result;
    result.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    result.out = slurp(mDir / "stdout");
    result.err = slurp(mDir / "stderr");
    return result;
  }

  std::string write(std::string const& name, std::string const& text) {
    fs::path const path = mDir / name;
    std::ofstream(path) << text;
    return path.string();
  }

  void expectBadInput(std::vector<std::string> const& args, std::string const& message) {
    CliResult const result = run(args);
    EXPECT_EQ(result.exitCode, 2) << result.err;
    EXPECT_EQ(result.err.rfind("mkv-replay: ", 0), 0u) << result.err;
    EXPECT_NE(result.err.find(message), std::string::npos) << result.err;
    EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;
    EXPECT_TRUE(result.out.empty()) << result.out;
  }

  fs::path mDir;
  fs::path mExecutable;
};

TEST_F(MkvReplayCliTest, TraceToJsonAndCsvWithTheHandComputedFigures) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const tiny = tinyPath.string();
  std::string const json = (mDir / "out.json").string();
  std::string const csv = (mDir / "out.csv").string();
  CliResult const result = run({"--trace", tiny, "--json", json, "--csv", csv});
  ASSERT_EQ(result.exitCode, 0) << result.err;
  EXPECT_TRUE(result.err.empty()) << result.err;  // no progress bar without a terminal
  EXPECT_NE(result.out.find("reused tokens             2,432  (hit rate 57.25%)"),
            std::string::npos)
      << result.out;
  nlohmann::json const figures = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(figures.at("requests"), 4);
  EXPECT_EQ(figures.at("prompt_tokens"), 4248);
  EXPECT_EQ(figures.at("reused_tokens"), 2432);
  EXPECT_NEAR(figures.at("hit_rate").get<double>(), 2432.0 / 4248.0, 1e-12);
  EXPECT_EQ(figures.at("oracle_mismatches"), 0);
  EXPECT_EQ(figures.at("pool_sizing"), "unbounded");
  // Every coordinator counter, under its one exported name.
  nlohmann::json const& counters = figures.at("coordinator_counters");
  nlohmann::json const& timings = figures.at("coordinator_timings");
  EXPECT_EQ(counters.size() + timings.size(), kCoordinatorCounterFields.size());
  for (CoordinatorCounterField const& counter : kCoordinatorCounterFields) {
    EXPECT_TRUE((counter.timing ? timings : counters).contains(std::string(counter.name)))
        << counter.name;
  }
  EXPECT_GE(counters.at("coordinator_requests").get<int64_t>(), 1);
  std::string const rows = slurp(csv);
  EXPECT_EQ(std::count(rows.begin(), rows.end(), '\n'), 5);
}

TEST_F(MkvReplayCliTest, TokensTraceQuietAndEveryMode) {
  // A 300-token prompt twice: the second reuses two pages of 128.
  std::string prompt;
  for (int i = 0; i < 300; ++i) {
    prompt.append(i > 0 ? "," : "").append(std::to_string(5 + i));
  }
  std::string const tokens =
      write("t.jsonl", R"({"id": "x", "prompt": [)" + prompt +
                           "], \"max_new_tokens\": 3}\n"
                           "{\"id\": \"y\", \"prompt\": [" +
                           prompt + "], \"max_new_tokens\": 2, \"salt\": \"\"}\n");
  std::string const json = (mDir / "t.json").string();
  CliResult const reuse = run({"--trace", tokens, "--format", "tokens", "--quiet", "--json", json});
  ASSERT_EQ(reuse.exitCode, 0) << reuse.err;
  EXPECT_TRUE(reuse.out.empty());
  EXPECT_EQ(nlohmann::json::parse(slurp(json)).at("reused_tokens"), 256);
  CliResult const swa =
      run({"--trace", tokens, "--mode", "swa", "--window", "128", "--json", json, "--quiet"});
  ASSERT_EQ(swa.exitCode, 0) << swa.err;
  nlohmann::json const swaFigures = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(swaFigures.at("swa_pages_per_sequence").at("prefill"), 5);
  EXPECT_EQ(swaFigures.at("swa_pages_per_sequence").at("decode"), 3);
  EXPECT_EQ(swaFigures.at("backend"), "bounded-swa");
  CliResult const full = run({"--trace", tokens, "--mode", "full", "--dtype", "fp32", "--layers",
                              "2", "--verify", "all", "--json", json, "--quiet"});
  ASSERT_EQ(full.exitCode, 0) << full.err;
  EXPECT_EQ(nlohmann::json::parse(slurp(json)).at("reused_tokens"), 0);
}

TEST_F(MkvReplayCliTest, EngineStepDeviceWritesGiveTheSameFiguresInEveryMode) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const tiny = tinyPath.string();
  std::string const json = (mDir / "w.json").string();
  // Every figure but the timings: the timing moves launches, never a byte attention reads.
  auto figures = [&](std::vector<std::string> args, std::string const& writes) {
    for (std::string extra :
         {"--trace", tiny.c_str(), "--verify", "all", "--quiet", "--json", json.c_str()}) {
      args.push_back(extra);
    }
    args.emplace_back("--device-writes");
    args.push_back(writes);
    CliResult const result = run(args);
    EXPECT_EQ(result.exitCode, 0) << result.err;
    nlohmann::json report = nlohmann::json::parse(slurp(json));
    EXPECT_EQ(report.at("device_writes"), writes);
    EXPECT_EQ(report.at("oracle_mismatches"), 0);
    for (char const* timing :
         {"device_writes", "wall_s", "requests_per_s", "host_ns_per_step_p50",
          "host_ns_per_step_p99", "host_ns_per_step_mean", "gpu_ns_per_step_p50",
          "gpu_ns_per_step_p99", "gpu_ns_per_step_mean", "coordinator_timings"}) {
      report.erase(timing);
    }
    return report;
  };
  std::vector<std::vector<std::string>> const modes = {
      {"--mode", "reuse", "--max-batch", "3"},
      {"--mode", "swa", "--window", "128", "--full-layers", "1", "--max-batch", "2"},
      {"--mode", "reuse", "--window", "128", "--full-layers", "1", "--max-batch", "2"},
      {"--mode", "reuse", "--recurrent-layers", "2"},
      {"--mode", "reuse", "--speculative", "eagle", "--spec-width", "2"}};
  for (std::vector<std::string> const& mode : modes) {
    nlohmann::json const each = figures(mode, "each-call");
    nlohmann::json const step = figures(mode, "engine-step");
    EXPECT_EQ(each, step) << mode.at(1) << " " << mode.at(2);
    EXPECT_GT(step.at("oracle_checks").get<int64_t>(), 0);
  }
}

TEST_F(MkvReplayCliTest, AKvBudgetSizesThePoolsAndTheJsonListsThem) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const json = (mDir / "budget.json").string();
  // 16 pages of 4 KiB and 100 bytes left over: the hand-computed reuse of the tiny trace.
  CliResult const result =
      run({"--trace", tinyPath.string(), "--kv-budget-bytes", "65636", "--quiet", "--json", json});
  ASSERT_EQ(result.exitCode, 0) << result.err;
  nlohmann::json const figures = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(figures.at("kv_budget_bytes"), 65636);
  EXPECT_EQ(figures.at("pool_sizing"), "budget");
  EXPECT_EQ(figures.at("pool_pages"), 16);
  EXPECT_EQ(figures.at("kv_bytes"), 65536);
  EXPECT_EQ(figures.at("pools").size(), 1u);
  EXPECT_EQ(figures.at("pools")[0].at("pages"), 16);
  EXPECT_EQ(figures.at("reused_tokens"), 2432);
  EXPECT_EQ(figures.at("evicted_records"), 0);
  // swa, 2 sliding layers (8 KiB a page), W = 128 (2M + 1 = 5 pages): 5 sequences' pages limit
  // --max-batch 8 to 5.
  CliResult const swa = run({"--trace", tinyPath.string(), "--mode", "swa", "--window", "128",
                             "--layers", "2", "--max-batch", "8", "--kv-budget-bytes",
                             std::to_string(5 * 5 * 8192), "--quiet", "--json", json});
  ASSERT_EQ(swa.exitCode, 0) << swa.err;
  nlohmann::json const bounded = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(bounded.at("max_batch"), 5);
  EXPECT_EQ(bounded.at("pools")[0].at("name"), "swa");
  EXPECT_EQ(bounded.at("pools")[0].at("pages"), 25);
  EXPECT_EQ(bounded.at("pools")[0].at("bytes_per_page"), 8192);
  EXPECT_EQ(bounded.at("swa_pages_per_sequence").at("decode_peak_per_row"), 3);
}

TEST_F(MkvReplayCliTest, HelpExitsZeroAndListsEveryOption) {
  for (char const* flag : {"--help", "-h"}) {
    CliResult const result = run({flag});
    EXPECT_EQ(result.exitCode, 0);
    EXPECT_NE(result.out.find("usage: mkv-replay"), std::string::npos) << result.out;
    EXPECT_TRUE(result.err.empty()) << result.err;
    // Every option of docs/replay.md's table, each described on its own line.
    for (char const* option : {"--trace FILE",
                               "--format F",
                               "--limit N",
                               "--max-output N",
                               "--seed N",
                               "--mode M",
                               "--window W",
                               "--full-layers N",
                               "--page-size N",
                               "--pool-pages N",
                               "--pool-tokens N",
                               "--kv-budget-bytes B",
                               "--max-batch N",
                               "--preemption P",
                               "--layers N",
                               "--kv-heads N",
                               "--head-dim N",
                               "--dtype T",
                               "--device D",
                               "--device-writes W",
                               "--verify V",
                               "--speculative S",
                               "--draft-layers N",
                               "--spec-width K",
                               "--boundary-hidden-width N",
                               "--recurrent-layers N",
                               "--recurrent-state-bytes B",
                               "--recurrent-conv-bytes B",
                               "--snapshot-slots N",
                               "--no-attention-only",
                               "--kv-events ENDPOINT",
                               "--kv-events-replay ENDPOINT",
                               "--kv-events-encoding E",
                               "--kv-events-hold",
                               "--json FILE",
                               "--csv FILE",
                               "--plot FILE.png",
                               "--quiet",
                               "--log-level L",
                               "-h,--help"}) {
      EXPECT_NE(result.out.find(std::string("\n  ") + option), std::string::npos) << option;
    }
    EXPECT_NE(result.out.find("exit codes: 0 ok, 1 internal error, 2 bad input, 3 KV corruption"),
              std::string::npos);
  }
}

TEST_F(MkvReplayCliTest, AnOptionGivenTwiceTakesItsLastValue) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const json = (mDir / "twice.json").string();
  CliResult const result = run({"--trace", tinyPath.string(), "--page-size", "64",
                                "--page-size=256", "--quiet", "--json", json});
  ASSERT_EQ(result.exitCode, 0) << result.err;
  EXPECT_EQ(nlohmann::json::parse(slurp(json)).at("page_size"), 256);
}

TEST_F(MkvReplayCliTest, PoolsLargerThanTheDeviceAreRefusedBeforeAllocating) {
  // 32 layers x 8 KV heads x head dim 128, fp16, pages of 128 tokens: 16 MiB a page, so a
  // million pages (15,625 GiB) exceed any machine's memory. Before this check the run died in the
  // allocation ("internal error", exit 1) or was killed by the OOM killer.
  std::vector<std::string> const model = {"--layers",   "32",  "--kv-heads",  "8",
                                          "--head-dim", "128", "--page-size", "128"};
  for (char const* mode : {"reuse", "full"}) {
    SCOPED_TRACE(mode);
    std::vector<std::string> args = model;
    args.insert(args.end(), {"--mode", mode, "--pool-pages", "1000000"});
    expectBadInput(args, "the KV pools of this run need 16777216000000 bytes (15625.0 GiB)");
    CliResult const result = run(args);
    EXPECT_NE(result.err.find("pass --pool-tokens N (about "), std::string::npos) << result.err;
    EXPECT_NE(result.err.find("the cpu has "), std::string::npos) << result.err;
  }
}

TEST_F(MkvReplayCliTest, BadOptionsAreOneLineAndExitTwo) {
  expectBadInput({"--bogus"}, "unknown option '--bogus' (see --help)");
  expectBadInput({"extra"}, "unexpected argument 'extra'");
  expectBadInput({"--page-size", "abc"}, "--page-size expects an integer, got 'abc'");
  expectBadInput({"--page-size=100"}, "page size 100 is not a power of two in [16, 1024]");
  expectBadInput({"--page-size", "8"}, "--page-size 8 is outside [16, 1024]");
  expectBadInput({"--max-batch", "0"}, "--max-batch 0 is outside [1, 4096]");
  expectBadInput({"--limit", "99999999999999999999"}, "--limit 99999999999999999999 is outside");
  expectBadInput({"--mode", "turbo"}, "--mode expects one of reuse, swa, full, got 'turbo'");
  expectBadInput({"--verify"}, "--verify needs a value");
  expectBadInput({"--dtype", "int4"}, "--dtype expects one of fp16, bf16, fp32, fp8");
  expectBadInput({"--window", "64"},
                 "sliding-window reuse needs --full-layers >= 1 beside the sliding layers");
  expectBadInput({"--mode", "full", "--window", "64"},
                 "--window applies to --mode swa and reuse only");
  expectBadInput({"--full-layers", "1"},
                 "--full-layers in reuse mode needs --window (sliding-window reuse)");
  expectBadInput({"--window", "64", "--full-layers", "1", "--speculative", "eagle"},
                 "sliding-window reuse serves attention-only vanilla reuse");
  expectBadInput({"--window", "64", "--full-layers", "1", "--sliding-budget-share", "0.5"},
                 "--sliding-budget-share needs --mode reuse with --window and --kv-budget-bytes");
  expectBadInput({"--window", "64", "--full-layers", "1", "--kv-budget-bytes", "1000000",
                  "--sliding-budget-share", "1.5"},
                 "--sliding-budget-share 1.5: expected a number in (0, 1)");
  expectBadInput({"--format", "tokens"}, "--format applies to --trace only");
  expectBadInput({"--pool-pages", "4", "--pool-tokens", "4096"}, "give the pool size once");
  char const* const once =
      "give the pool size once: --pool-pages, --pool-tokens or --kv-budget-bytes";
  expectBadInput({"--kv-budget-bytes", "65536", "--pool-pages", "4"}, once);
  expectBadInput({"--pool-tokens", "4096", "--kv-budget-bytes", "65536"}, once);
  expectBadInput({"--kv-budget-bytes", "-1"}, "--kv-budget-bytes -1 is outside [0, ");
  expectBadInput({"--kv-budget-bytes", "4095"},
                 "--kv-budget-bytes 4095 is below the minimum of 4096 bytes: one page of the full "
                 "pool (4096 bytes)");
  expectBadInput({"--kv-budget-bytes", "8191", "--speculative", "eagle"},
                 "--kv-budget-bytes 8191 is below the minimum of 8192 bytes: one page of the full "
                 "pool (4096 bytes) and its paired draft page (4096 bytes)");
  expectBadInput({"--mode", "swa", "--kv-budget-bytes", "65536"},
                 "--kv-budget-bytes 65536 is below the minimum of 274432 bytes: one sequence's "
                 "bounded-SWA budget (2M + 1 = 67 pages of 4096 bytes)");
  expectBadInput({"--pool-pages", "0"}, "a pool of 0 pages is smaller than 1 page");
  expectBadInput({"--pool-tokens", "100"}, "a pool of 100 tokens is smaller than 1 page of 128");
  expectBadInput({"--mode", "swa", "--pool-pages", "3"},
                 "a pool of 3 pages is smaller than one sequence's bounded-SWA budget: 2M + 1 = "
                 "67 pages");
  expectBadInput({"--json", (mDir / "no" / "such" / "dir.json").string()}, "cannot write");
  expectBadInput({"--kv-events-hold"},
                 "--kv-events-replay, --kv-events-encoding and --kv-events-hold need --kv-events");
  expectBadInput({"--kv-events", "tcp://127.0.0.1:*", "--mode", "full"},
                 "--kv-events applies to --mode reuse only");
  expectBadInput({"--reset-cache-every", "5", "--mode", "swa"},
                 "--reset-cache-every applies to --mode reuse only");
  expectBadInput({"--reset-cache-every", "0"}, "--reset-cache-every 0 is outside [1, ");
  // The host tier: reuse mode on an attention-only, non-speculative model, whole pages.
  char const* const hostTierOnly =
      "--host-pool-tokens applies to --mode reuse on an attention-only model without "
      "--speculative";
  expectBadInput({"--host-pool-tokens", "4096", "--mode", "swa"}, hostTierOnly);
  expectBadInput({"--host-pool-tokens", "4096", "--recurrent-layers", "2"}, hostTierOnly);
  expectBadInput({"--host-pool-tokens", "4096", "--speculative", "eagle"}, hostTierOnly);
  expectBadInput({"--host-pool-tokens", "0"}, "--host-pool-tokens 0 is outside [1, ");
  expectBadInput({"--host-pool-tokens", "100"},
                 "a host tier of 100 tokens holds no page of 128 tokens");
  expectBadInput({"--kv-events", "tcp://127.0.0.1:*", "--kv-events-encoding", "json"},
                 "--kv-events-encoding expects one of map, array, got 'json'");
  expectBadInput({"--kv-events", "nonsense://x"},
                 "KvEventPublisher::create: cannot connect the PUB socket to endpoint "
                 "'nonsense://x'");
  if (MKV_WITH_CUDA == 0) {
    expectBadInput({"--device", "cuda"}, "--device cuda: this build has no CUDA");
  }
  // Speculative decoding: reuse mode only, an EAGLE head owns KV, its options need it.
  expectBadInput({"--speculative", "medusa"},
                 "--speculative expects one of none, eagle, mtp, got 'medusa'");
  expectBadInput({"--speculative", "eagle", "--mode", "swa"},
                 "--speculative applies to --mode reuse only (the bounded-SWA backend decodes "
                 "vanilla only)");
  expectBadInput({"--speculative", "mtp", "--mode", "full"},
                 "--speculative applies to --mode reuse only (the full-storage backend decodes "
                 "vanilla only)");
  expectBadInput({"--speculative", "eagle", "--draft-layers", "0"},
                 "--speculative eagle needs --draft-layers >= 1");
  expectBadInput({"--spec-width", "2"}, "--spec-width needs --speculative eagle or mtp");
  expectBadInput({"--draft-layers", "2", "--speculative", "none"},
                 "--draft-layers needs --speculative eagle or mtp");
  expectBadInput({"--speculative", "eagle", "--spec-width", "0"},
                 "--spec-width 0 is outside [1, 64]");
  expectBadInput({"--speculative", "mtp", "--draft-layers", "257"},
                 "--draft-layers 257 is outside [0, 256]");
  // Hybrid models: reuse mode only, and the recurrent options need recurrent layers.
  expectBadInput({"--recurrent-layers", "2", "--mode", "swa"},
                 "--recurrent-layers applies to --mode reuse only");
  expectBadInput({"--recurrent-layers", "2", "--mode", "full"},
                 "--recurrent-layers applies to --mode reuse only");
  expectBadInput({"--recurrent-layers", "129"}, "--recurrent-layers 129 is outside [0, 128]");
  expectBadInput({"--recurrent-layers", "2", "--recurrent-state-bytes", "0"},
                 "--recurrent-state-bytes 0 is outside [1, 1073741824]");
  expectBadInput({"--recurrent-layers", "2", "--snapshot-slots", "0"},
                 "--snapshot-slots 0 is outside [1, ");
  char const* const needsLayers =
      "--recurrent-state-bytes, --recurrent-conv-bytes, --snapshot-slots and --no-attention-only "
      "need --recurrent-layers N > 0";
  expectBadInput({"--snapshot-slots", "4"}, needsLayers);
  expectBadInput({"--max-batched-tokens", "512"},
                 "a token budget of 512 per step needs in-flight joins (--max-batch > 1");
  expectBadInput({"--max-batched-tokens", "0", "--max-batch", "4"},
                 "--max-batched-tokens 0 is outside [1, ");
  expectBadInput({"--preemption", "recompute"},
                 "preemption needs in-flight joins (--max-batch > 1");
  expectBadInput({"--preemption", "recompute", "--max-batch", "4", "--mode", "swa"},
                 "preemption needs in-flight joins");
  expectBadInput({"--preemption", "recompute", "--max-batch", "4", "--mode", "swa",
                  "--max-batched-tokens", "256"},
                 "preemption in swa mode: bounded SWA caches nothing");
  expectBadInput({"--preemption", "swap", "--max-batch", "4"},
                 "swap preemption moves the preempted sequences' blocks to the host tier: it "
                 "needs --mode reuse with --host-pool-tokens");
  expectBadInput({"--preemption", "offload"},
                 "--preemption expects one of none, recompute, swap, got 'offload'");
  expectBadInput({"--checkpoint-interval", "512"},
                 "--checkpoint-interval needs --recurrent-layers N > 0 or --window W (reuse mode)");
  expectBadInput({"--recurrent-layers", "2", "--checkpoint-interval", "100"},
                 "checkpoint interval 100 is not a multiple of the page size 128");
  expectBadInput({"--recurrent-conv-bytes", "4"}, needsLayers);
  expectBadInput({"--recurrent-layers", "0", "--no-attention-only"}, needsLayers);
  // Hybrid-MTP: an MTP draft with paged KV; the hidden width needs it.
  expectBadInput({"--recurrent-layers", "2", "--speculative", "eagle"},
                 "--speculative eagle with --recurrent-layers: the speculative hybrid deployment "
                 "is Hybrid-MTP (--speculative mtp)");
  expectBadInput({"--recurrent-layers", "2", "--speculative", "mtp", "--draft-layers", "0"},
                 "--speculative mtp with --recurrent-layers (Hybrid-MTP) needs --draft-layers >= 1 "
                 "(the draft owns paged KV)");
  char const* const needsHybridMtp =
      "--boundary-hidden-width needs --speculative mtp with --recurrent-layers N > 0";
  expectBadInput({"--boundary-hidden-width", "8"}, needsHybridMtp);
  expectBadInput({"--boundary-hidden-width", "8", "--speculative", "mtp"}, needsHybridMtp);
  expectBadInput({"--boundary-hidden-width", "8", "--recurrent-layers", "2"}, needsHybridMtp);
  expectBadInput(
      {"--recurrent-layers", "2", "--speculative", "mtp", "--boundary-hidden-width", "0"},
      "--boundary-hidden-width 0 is outside [1, 32768]");
}

TEST_F(MkvReplayCliTest, HybridMtpReportsEndpointsRestoresAndTheHiddenRowOracle) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const json = (mDir / "mtp.json").string();
  CliResult const result =
      run({"--trace", tinyPath.string(), "--speculative", "mtp", "--recurrent-layers", "2",
           "--boundary-hidden-width", "24", "--verify", "all", "--json", json});
  ASSERT_EQ(result.exitCode, 0) << result.err;
  // Request 2 resumes at request 1's 1024-token prompt endpoint; request 4 (request 1 again)
  // finds its own prompt's endpoint published and reuses nothing (no endpoint strictly shorter).
  EXPECT_NE(result.out.find("  speculative               mtp (Hybrid-MTP), 3 draft tokens per "
                            "round; draft 1 layer with paged KV, 4.0 KiB per page\n"),
            std::string::npos)
      << result.out;
  EXPECT_NE(result.out.find("  Hybrid-MTP                endpoints published 3, boundary hidden "
                            "rows restored 1 (24 fp16 a row)\n"),
            std::string::npos)
      << result.out;
  EXPECT_NE(result.out.find("  hidden-row oracle         1 rows checked, 0 mismatches\n"),
            std::string::npos)
      << result.out;
  nlohmann::json const figures = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(figures.at("reused_tokens"), 1024);
  EXPECT_EQ(figures.at("oracle_mismatches"), 0);
  nlohmann::json const& spec = figures.at("speculative");
  EXPECT_EQ(spec.at("kind"), "mtp");
  EXPECT_EQ(spec.at("hybrid_mtp"), true);
  EXPECT_EQ(spec.at("draft_reused_tokens"), 1023);
  EXPECT_EQ(spec.at("draft_oracle_mismatches"), 0);
  nlohmann::json const& hybrid = figures.at("hybrid");
  EXPECT_EQ(hybrid.at("hybrid_mtp"), true);
  EXPECT_EQ(hybrid.at("boundary_hidden_width"), 24);
  EXPECT_EQ(hybrid.at("mtp_endpoints_published"), 3);
  EXPECT_EQ(hybrid.at("boundary_hidden_restores"), 1);
  EXPECT_EQ(hybrid.at("boundary_hidden_checks"), 1);
  EXPECT_EQ(hybrid.at("boundary_hidden_mismatches"), 0);
  EXPECT_EQ(hybrid.at("recurrent_mismatches"), 0);
  // 10 slots of 2 x (64 + 16) + 24 x 2 bytes and of a base and a draft page (4 KiB each).
  EXPECT_EQ(hybrid.at("snapshot_bytes"), 10 * (2 * (64 + 16) + 24 * 2 + 2 * 4096));
  // A hybrid replay without a draft has no Hybrid-MTP figures.
  CliResult const plain =
      run({"--trace", tinyPath.string(), "--recurrent-layers", "2", "--quiet", "--json", json});
  ASSERT_EQ(plain.exitCode, 0) << plain.err;
  nlohmann::json const vanilla = nlohmann::json::parse(slurp(json)).at("hybrid");
  EXPECT_EQ(vanilla.at("hybrid_mtp"), false);
  EXPECT_FALSE(vanilla.contains("mtp_endpoints_published"));
}

TEST_F(MkvReplayCliTest, SpeculativeReplaysReportDraftReuseAndBothOracles) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const json = (mDir / "eagle.json").string();
  CliResult const eagle = run({"--trace", tinyPath.string(), "--speculative", "eagle",
                               "--spec-width", "4", "--draft-layers", "2", "--json", json});
  ASSERT_EQ(eagle.exitCode, 0) << eagle.err;
  EXPECT_NE(eagle.out.find("  speculative               eagle, 4 draft tokens per round; draft 2 "
                           "layers with paged KV, 8.0 KiB per page\n"),
            std::string::npos)
      << eagle.out;
  nlohmann::json const figures = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(figures.at("reused_tokens"), 2176);
  nlohmann::json const& spec = figures.at("speculative");
  EXPECT_EQ(spec.at("draft_layers"), 2);
  EXPECT_EQ(spec.at("draft_bytes_per_page"), 8192);
  EXPECT_EQ(spec.at("draft_reused_tokens"), 2176);
  EXPECT_EQ(spec.at("draft_oracle_mismatches"), 0);
  EXPECT_GT(spec.at("draft_oracle_checks").get<int64_t>(), 0);
  CliResult const mtp = run({"--trace", tinyPath.string(), "--speculative", "mtp", "--draft-layers",
                             "0", "--quiet", "--json", json});
  ASSERT_EQ(mtp.exitCode, 0) << mtp.err;
  nlohmann::json const shared = nlohmann::json::parse(slurp(json)).at("speculative");
  EXPECT_EQ(shared.at("paged_draft"), false);
  EXPECT_EQ(shared.at("draft_oracle_checks"), 0);
}

TEST_F(MkvReplayCliTest, HybridTraceReportsCheckpointsAgainstAttentionOnlyReuse) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const json = (mDir / "hybrid.json").string();
  CliResult const result = run({"--trace", tinyPath.string(), "--recurrent-layers", "2", "--json",
                                json, "--recurrent-state-bytes", "24"});
  ASSERT_EQ(result.exitCode, 0) << result.err;
  // Request 2 restores request 1's 1024-token prompt checkpoint; request 3 ([1, 9]) and request
  // 4 (request 1 again: no checkpoint strictly shorter than its prompt) reuse nothing, where
  // attention-only reuse binds 512 and 896 tokens of whole pages.
  EXPECT_NE(result.out.find("checkpoints               published 6, restored 1, skipped for "
                            "snapshot pressure 0 (captures 6)"),
            std::string::npos)
      << result.out;
  EXPECT_NE(result.out.find("attention-only reuse      2,432  (hit rate 57.25%; the hybrid model "
                            "reuses 42.1% of it)"),
            std::string::npos)
      << result.out;
  nlohmann::json const figures = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(figures.at("recurrent_layers"), 2);
  EXPECT_EQ(figures.at("reused_tokens"), 1024);
  EXPECT_EQ(figures.at("oracle_mismatches"), 0);
  nlohmann::json const& hybrid = figures.at("hybrid");
  EXPECT_EQ(hybrid.at("recurrent_state_bytes"), 24);
  EXPECT_EQ(hybrid.at("recurrent_conv_bytes"), 16);
  EXPECT_EQ(hybrid.at("snapshot_sizing"), "unbounded");
  EXPECT_EQ(hybrid.at("recurrent_snapshot_slots"), 2 * 4 + 2);
  EXPECT_EQ(hybrid.at("checkpoints_restored"), 1);
  EXPECT_EQ(hybrid.at("snapshot_pressure_skips"), 0);
  EXPECT_EQ(hybrid.at("recurrent_mismatches"), 0);
  EXPECT_GT(hybrid.at("recurrent_checks").get<int64_t>(), 0);
  EXPECT_EQ(hybrid.at("attention_only_reused_tokens"), 2432);
  EXPECT_NEAR(hybrid.at("reuse_vs_attention_only").get<double>(), 1024.0 / 2432.0, 1e-12);
  // A bounded budget, and no attention-only replay.
  CliResult const bounded =
      run({"--trace", tinyPath.string(), "--recurrent-layers", "2", "--snapshot-slots", "1",
           "--no-attention-only", "--quiet", "--json", json});
  ASSERT_EQ(bounded.exitCode, 0) << bounded.err;
  nlohmann::json const one = nlohmann::json::parse(slurp(json)).at("hybrid");
  EXPECT_EQ(one.at("snapshot_sizing"), "slots");
  EXPECT_EQ(one.at("recurrent_snapshot_slots"), 1);
  EXPECT_EQ(one.at("partial_kv_snapshot_slots"), 1);
  EXPECT_TRUE(one.at("attention_only_reused_tokens").is_null());
  EXPECT_TRUE(one.at("reuse_vs_attention_only").is_null());
  // Attention-only replays have no hybrid figures.
  CliResult const plain = run({"--trace", tinyPath.string(), "--quiet", "--json", json});
  ASSERT_EQ(plain.exitCode, 0) << plain.err;
  nlohmann::json const attention = nlohmann::json::parse(slurp(json));
  EXPECT_EQ(attention.at("recurrent_layers"), 0);
  EXPECT_FALSE(attention.contains("hybrid"));
}

TEST_F(MkvReplayCliTest, BadTracesNameTheFileAndLineAndExitTwo) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const tiny = tinyPath.string();
  expectBadInput(
      {"--trace", (mDir / "missing.jsonl").string()},
      "cannot open trace " + (mDir / "missing.jsonl").string() + ": No such file or directory");
  std::string const good = "{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n";
  std::string const broken = write("broken.jsonl", good + "\n" + good + "{\"input_length\": 10,\n");
  expectBadInput({"--trace", broken},
                 broken + ":4: column 21: JSON document ended early in the middle of an object");
  std::string const longer = write(
      "longer.jsonl", good + "{\"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}\n");
  expectBadInput({"--trace", longer},
                 longer + ":2: \"input_length\" 600 is longer than the 512 tokens of its 1");
  std::string const wrong = write("wrong.jsonl", good);
  expectBadInput({"--trace", wrong, "--format", "tokens"}, wrong + ":1: missing \"prompt\"");
  std::string const empty = write("empty.jsonl", "\n\n");
  expectBadInput({"--trace", empty}, empty + ": no requests");
  // --limit stops reading before a later malformed line.
  CliResult const limited = run({"--trace", broken, "--limit", "2", "--quiet"});
  EXPECT_EQ(limited.exitCode, 0) << limited.err;
}

TEST_F(MkvReplayCliTest, PlotWithoutGnuplotIsOneMessageAndExitZero) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const tiny = tinyPath.string();
  std::string const png = (mDir / "p.png").string();
  CliResult const result = run({"--trace", tiny, "--plot", png}, "PATH=/nonexistent");
  EXPECT_EQ(result.exitCode, 0) << result.err;
  EXPECT_EQ(result.err, "mkv-replay: gnuplot is not installed (not found in PATH); " + png +
                            " was not written\n");
  EXPECT_FALSE(fs::exists(png));
  EXPECT_FALSE(result.out.empty());
}

TEST_F(MkvReplayCliTest, PlotWritesAPng) {
  MKV_TEST_INPUT_OR_SKIP(tinyPath, "tests/replay/tiny_mooncake.jsonl");
  std::string const tiny = tinyPath.string();
  if (!findInPath("gnuplot")) {
    GTEST_SKIP() << "gnuplot is not installed";
  }
  std::string const png = (mDir / "p.png").string();
  CliResult const result = run({"--trace", tiny, "--plot", png, "--quiet"});
  EXPECT_EQ(result.exitCode, 0) << result.err;
  ASSERT_TRUE(fs::exists(png));
  std::string const bytes = slurp(png);
  EXPECT_EQ(bytes.substr(1, 3), "PNG");
  EXPECT_GT(bytes.size(), 1000u);
}

}  // namespace
}  // namespace mkv::replay
