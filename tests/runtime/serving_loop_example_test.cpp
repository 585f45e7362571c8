// Builds and runs docs/examples/serving_loop_example.cpp, the serving engine's loop (a token budget
// per step, chunked prefill of joiners, preemption under pool pressure), and checks that
// docs/integration.md shows exactly that file, so the documented example cannot drift from
// compiling code. The loop runs on host tensors and, as its header promises, with deviceType =
// kGPU (skipped without a CUDA device): the figures are the same on both.

// NOLINTNEXTLINE(bugprone-suspicious-include): the test compiles the documented example itself
#include "../../docs/examples/serving_loop_example.cpp"

#include <gtest/gtest.h>

#include <numeric>
#include <optional>
#include <string>

#include "support/test_inputs.h"
#include "support/test_util.h"

namespace {

using serving_example::Outcome;
using serving_example::Sequence;

std::vector<int32_t> range(int32_t first, int32_t count) {
  std::vector<int32_t> tokens(static_cast<std::size_t>(count));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

std::vector<int32_t> concat(std::vector<int32_t> head, std::vector<int32_t> const& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

constexpr int32_t kBudget = 32;       // tokens per step
constexpr int32_t kRoomyPool = 1000;  // pages: nothing is ever preempted
constexpr int32_t kTightPool = 15;    // pages: the decoding rows outgrow it once

/// Pages hold 16 tokens; the shared document is six of them.
std::vector<Sequence> workload() {
  std::vector<int32_t> const document = range(500, 96);
  return {
      {range(1, 40), 30},                           // 0: founds the request: chunks of 32, 8
      {concat(document, {901, 902, 903, 904}), 6},  // 1: 100 tokens, chunks of 24, 31, 31, 14
      {concat(document, {911, 912, 913}), 6},       // 2: joins before 1's last chunk
      {range(2000, 60), 20},                        // 3
      {range(3000, 70), 24},  // 4: the newest row when the tight pool runs out
  };
}

struct Served {
  std::vector<Outcome> outcomes;
  serving_example::Stats stats;
  mkv::PagePoolUsage pool;  // after the run
  int32_t freeResidents = 0;
  int32_t residents = 0;
};

class ServingLoopExampleTest : public mkv::test::DeviceTest {
 protected:
  Served serve(int32_t numPages) const {
    auto runtime = serving_example::makeRuntime(numPages, device());
    serving_example::Engine engine(*runtime, kBudget);
    Served served;
    served.outcomes = engine.serve(workload());
    served.stats = engine.stats();
    served.pool = runtime->capacity().base.value();
    served.freeResidents = runtime->residentSlots().available();
    served.residents = runtime->residentSlots().capacity();
    EXPECT_TRUE(runtime->shutdown());
    return served;
  }
};

INSTANTIATE_TEST_SUITE_P(Devices, ServingLoopExampleTest, mkv::test::allDeviceTypes(),
                         mkv::test::deviceName);

/// Every sequence sampled its maxNewTokens, and every page and resident came back.
void expectAllServed(Served const& served) {
  std::vector<Sequence> const sequences = workload();
  ASSERT_EQ(served.outcomes.size(), sequences.size());
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    EXPECT_EQ(served.outcomes[i].generated.size(),
              static_cast<std::size_t>(sequences[i].maxNewTokens))
        << "sequence " << i;
  }
  EXPECT_EQ(served.pool.leasedPages, 0);
  EXPECT_EQ(served.freeResidents, served.residents);
}

// (a) and (b) on a pool that never runs short. The founder's 40 tokens pass the budget: 32 run in
// the prefill step and its last 8 in the first decode step, beside sequence 1's first 24; from
// then on the founder decodes and a step has 31 tokens for chunks: sequence 1's next ones are 31,
// 31 and 14. Sequence 2 is admitted before that last chunk, once the budget has tokens left after
// sequence 1's 14 remaining: it reuses the 80 tokens (five full pages) that sequence 1's first
// three chunks published (86 tokens done; its finalisation would have published 96), and runs
// its other 19 in two chunks (17, and 2 beside two decodes).
TEST_P(ServingLoopExampleTest, LongPromptsAreChunkedAndAJoinerReusesWhatAChunkPublished) {
  Served const served = serve(kRoomyPool);
  expectAllServed(served);
  EXPECT_EQ(served.stats.requests, 1);
  EXPECT_EQ(served.stats.steps, 35);
  EXPECT_EQ(served.stats.joins, 4);
  EXPECT_EQ(served.stats.prefillChunks, 14);
  EXPECT_GT(served.stats.prefillChunks, served.stats.joins) << "prompts were chunked";
  EXPECT_EQ(served.stats.preemptions, 0);
  std::vector<int32_t> reused;
  std::vector<int32_t> chunks;
  for (Outcome const& outcome : served.outcomes) {
    reused.push_back(outcome.reusedTokens);
    chunks.push_back(outcome.prefillChunks);
    EXPECT_EQ(outcome.preemptions, 0);
    EXPECT_EQ(outcome.resumedReusedTokens, 0);
  }
  EXPECT_EQ(reused, (std::vector<int32_t>{0, 0, 80, 0, 0}));
  EXPECT_EQ(chunks, (std::vector<int32_t>{2, 4, 2, 3, 3})) << "the founder's prefill too";
}

// With a budget no prompt exceeds, every joiner prefills in the step it joins: one chunk each.
// Sequence 2 then joins beside sequence 1, before anything of the document is published.
TEST_P(ServingLoopExampleTest, ABudgetAboveEveryPromptRunsEachPrefillInOneStep) {
  auto runtime = serving_example::makeRuntime(kRoomyPool, device());
  serving_example::Engine engine(*runtime, 1024);
  std::vector<Outcome> const outcomes = engine.serve(workload());
  EXPECT_EQ(engine.stats().joins, 4);
  EXPECT_EQ(engine.stats().prefillChunks, 4);
  EXPECT_EQ(outcomes[2].reusedTokens, 0);
  EXPECT_TRUE(runtime->shutdown());
}

// (c) and (d) on a pool of 15 pages. Sequence 4, the newest row, is preempted when the running
// rows' growth no longer fits the pool: it had sampled 11 of its 24 tokens. preemptSequence
// published its committed 80 tokens (the 70 of its prompt and the first 10 it generated). Its 81
// tokens fit beside the running rows no more, so it waits until the batch empties and founds the
// next request, which reuses those 80 (more than the 64 its prompt's full pages hold): its one
// token in the prefill step, then it samples the remaining 13. Every sequence samples exactly the
// tokens it samples on the roomy pool.
TEST_P(ServingLoopExampleTest, APreemptedSequenceResumesFromWhatItPublishedWithTheSameTokens) {
  Served const roomy = serve(kRoomyPool);
  Served const tight = serve(kTightPool);
  expectAllServed(tight);
  EXPECT_EQ(tight.stats.requests, 2) << "the resumption founds the second";
  EXPECT_EQ(tight.stats.steps, 41);
  EXPECT_EQ(tight.stats.joins, 4);
  EXPECT_EQ(tight.stats.prefillChunks, 14);
  EXPECT_EQ(tight.stats.preemptions, 1);
  ASSERT_EQ(tight.outcomes.size(), roomy.outcomes.size());
  for (std::size_t i = 0; i < tight.outcomes.size(); ++i) {
    EXPECT_EQ(tight.outcomes[i].generated, roomy.outcomes[i].generated) << "sequence " << i;
    EXPECT_EQ(tight.outcomes[i].preemptions, i == 4 ? 1 : 0) << "sequence " << i;
  }
  EXPECT_EQ(tight.outcomes[4].reusedTokens, 0);
  EXPECT_EQ(tight.outcomes[4].resumedReusedTokens, 80);
  EXPECT_EQ(tight.outcomes[4].prefillChunks, 4) << "1, 30, 30, 9; then one token, whole";
  EXPECT_EQ(tight.outcomes[2].reusedTokens, 80) << "a chunk's pages are reused here too";
}

TEST(ServingLoopExampleDocTest, TheDocumentShowsTheCompiledExample) {
  // Copies beside the binary (the GPU bundle carries them) or the source tree (test_inputs.h).
  MKV_TEST_INPUT_OR_SKIP(docPath, "docs/integration.md");
  MKV_TEST_INPUT_OR_SKIP(codePath, "docs/examples/serving_loop_example.cpp");
  EXPECT_TRUE(mkv::test::pageShowsFile(docPath.string(), "serving-example", codePath.string()));
}

}  // namespace
