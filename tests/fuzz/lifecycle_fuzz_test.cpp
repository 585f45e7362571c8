/// The lifecycle driver under a fixed set of pseudo-random inputs (CI), and the seed corpus of the
/// libFuzzer target replayed as regression inputs. docs/reliability.md.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz/lifecycle_driver.h"
#include "support/test_inputs.h"

namespace mkv::fuzz {
namespace {

// Under AddressSanitizer (GCC defines __SANITIZE_ADDRESS__, clang reports it through
// __has_feature) the runtimes of a recurrent or draft model run a third of their seeds, so the
// sanitised trees stay within their per-test time limit.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

std::vector<uint8_t> readFile(std::filesystem::path const& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

/// At least 10^5 operations over many short lifecycles (every backend and geometry the set-up
/// bytes pick), each checked after every operation.
TEST(LifecycleFuzzTest, SeededLifecyclesKeepEveryInvariant) {
  constexpr int64_t kOperations = 100'000;
  LifecycleStats total;
  for (uint64_t seed = 1; total.operations < kOperations; ++seed) {
    std::vector<uint8_t> const input = seededInput(seed, 1500);
    LifecycleResult const result = runLifecycle(input);
    ASSERT_TRUE(result.ok) << "seed " << seed << ": " << result.failure;
    total += result.stats;
  }
  // The run exercised what it is meant to (a driver that stopped exercising something would
  // otherwise pass silently).
  EXPECT_GE(total.operations, kOperations);
  EXPECT_GT(total.rejectedCalls, total.operations / 20);
  EXPECT_GT(total.refusals, 100);
  EXPECT_GT(total.prefills, 1000);
  EXPECT_GT(total.decodeSteps, 1000);
  EXPECT_GT(total.compactions, 100);
  EXPECT_GT(total.joins, 50);
  EXPECT_GT(total.prefillChunks, 10);  // chunked prefill of joiners
  EXPECT_GT(total.heldFounders, 100);  // and of founders, whose first chunk ran in the prefill
  EXPECT_GT(total.preemptions, 10);
  EXPECT_GT(total.retractions, 10);
  // Joiners that take their pages per chunk: chunks prepared with pages, and refused for want of
  // them (the model decides which, exactly).
  EXPECT_GT(total.chunkPagePrepares, 50);
  EXPECT_GT(total.chunkPageRefusals, 10);
  EXPECT_GT(total.failedSynchronizations, 100);
  EXPECT_GT(total.quarantines, 100);
  EXPECT_GT(total.shutdowns, 100);
  EXPECT_GT(total.cacheResets, 100);
  EXPECT_GT(total.cacheResetRecords, 100);
  EXPECT_GT(total.drops, 100);
  EXPECT_GT(total.oraclePositions, 1'000'000);
  EXPECT_GT(total.slidingReuseLifecycles, 0);  // one bounded-SWA input in four
  // Bounded SWA's joiners: admitted in 2M + 1 pages, prefilled in chunks (some within the batch's
  // decode steps) whose window rotates, finalised or retracted.
  EXPECT_GT(total.swaJoins, 50);
  EXPECT_GT(total.swaChunksRun, total.swaJoins);
  EXPECT_GT(total.swaStepChunks, 10);
  EXPECT_GT(total.swaPrefillChunks, 10);
  EXPECT_GT(total.swaFinalizations, 10);
  EXPECT_GT(total.swaRetractions, 10);
  EXPECT_GT(total.swaHeldFounders, 10);  // founders whose window rotates from their first chunk
  RecordProperty("operations", std::to_string(total.operations));
  std::printf(
      "operations %lld, library calls %lld, rejected %lld, refusals %lld, requests %lld, "
      "prefills %lld, decode steps %lld, compactions %lld, joins %lld (prefill chunks %lld), "
      "preemptions %lld, retractions %lld, failed syncs %lld, quarantines %lld, shutdowns %lld, "
      "cache resets %lld, "
      "oracle positions %lld\n",
      static_cast<long long>(total.operations), static_cast<long long>(total.libraryCalls),
      static_cast<long long>(total.rejectedCalls), static_cast<long long>(total.refusals),
      static_cast<long long>(total.requests), static_cast<long long>(total.prefills),
      static_cast<long long>(total.decodeSteps), static_cast<long long>(total.compactions),
      static_cast<long long>(total.joins), static_cast<long long>(total.prefillChunks),
      static_cast<long long>(total.preemptions), static_cast<long long>(total.retractions),
      static_cast<long long>(total.failedSynchronizations),
      static_cast<long long>(total.quarantines), static_cast<long long>(total.shutdowns),
      static_cast<long long>(total.cacheResets), static_cast<long long>(total.oraclePositions));
  std::printf("pages per chunk: %lld chunks prepared with pages, %lld refused\n",
              static_cast<long long>(total.chunkPagePrepares),
              static_cast<long long>(total.chunkPageRefusals));
  std::printf(
      "bounded SWA: joins %lld, prefill chunks run %lld (%lld in decode steps), completed %lld, "
      "finalised %lld, retracted %lld; founders held after a first chunk %lld\n",
      static_cast<long long>(total.swaJoins), static_cast<long long>(total.swaChunksRun),
      static_cast<long long>(total.swaStepChunks), static_cast<long long>(total.swaPrefillChunks),
      static_cast<long long>(total.swaFinalizations), static_cast<long long>(total.swaRetractions),
      static_cast<long long>(total.swaHeldFounders));
}

/// Synchronisation faults at fixed points instead of where the input asks: for each seed the
/// k-th synchronisation fails (once, or from then on until teardown), for every k up to kPoints.
/// Every failed synchronisation must poison and quarantine as documented, with the invariants and
/// the KV oracle holding throughout, and shutdown must bring every page back.
/// Seeds 13-24 force the runtimes of a recurrent or draft model (runtime byte 0xC0 + seed % 3),
/// whose capture, endpoint and draft-initialisation synchronisations fail too; seeds 25-31
/// engine-step device writes on runtime kind seed % 7; seeds 32-37 sliding-window reuse, whose
/// two halves share each completion point's synchronisation.
TEST(LifecycleFuzzTest, EverySynchronisationPointMayFail) {
  constexpr int64_t kPoints = 8;
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= 37; ++seed) {
    std::vector<uint8_t> input = seededInput(seed, 400);
    if (seed > 31) {
      forceRuntime(input, 6);
    } else if (seed > 24) {
      forceRuntime(input, static_cast<int32_t>(seed % 7));
      forceEngineStep(input, true);
    } else if (seed > 12) {
      input[1] = static_cast<uint8_t>(0xC0 + seed % 3);
    }
    for (int64_t failAt = 1; failAt <= kPoints; ++failAt) {
      for (bool persistent : {false, true}) {
        LifecycleOptions options;
        options.inputFaults = false;
        options.syncFaults = SyncFaultPlan{failAt, persistent};
        LifecycleResult const result = runLifecycle(input, options);
        ASSERT_TRUE(result.ok) << "seed " << seed << ", synchronisation " << failAt
                               << (persistent ? " onwards" : "") << ": " << result.failure;
        total += result.stats;
      }
    }
  }
  EXPECT_GT(total.failedSynchronizations, 100);
  EXPECT_GT(total.quarantines, 50);
  EXPECT_GT(total.shutdowns, 50);
  EXPECT_GE(total.hybridLifecycles, 4 * kPoints * 2);
  EXPECT_GE(total.speculativeLifecycles, 4 * kPoints * 2);
  EXPECT_GE(total.mtpLifecycles, 4 * kPoints * 2);
  EXPECT_GE(total.engineStepLifecycles, 7 * kPoints * 2);
  EXPECT_GE(total.slidingReuseLifecycles, 7 * kPoints * 2);
}

/// Every file of the libFuzzer seed corpus (and every regression input added there) passes.
TEST(LifecycleFuzzTest, CorpusInputsPass) {
  MKV_TEST_INPUT_OR_SKIP(corpus, "tests/fuzz/corpus");
  int32_t files = 0;
  for (auto const& entry : std::filesystem::directory_iterator(corpus)) {
    if (!entry.is_regular_file()) {
      continue;
    }
    std::vector<uint8_t> const input = readFile(entry.path());
    LifecycleResult const result = runLifecycle(input);
    EXPECT_TRUE(result.ok) << entry.path().filename() << ": " << result.failure;
    ++files;
  }
  EXPECT_GT(files, 0);
}

/// The runtimes of a recurrent or draft model (hybrid checkpoints, EAGLE-style speculative
/// reuse, Hybrid-MTP), forced by the runtime byte (the second: 0xC0 + k picks runtime k % 3 of
/// them) on seeded inputs, until each has run many lifecycles; every operation checked as above,
/// plus the recurrent rows, the draft KV, snapshot slots and boundary hidden rows.
TEST(LifecycleFuzzTest, HybridSpeculativeAndMtpRuntimesKeepEveryInvariant) {
  constexpr uint64_t kSeeds = kSanitized ? 300 : 900;
  constexpr int64_t kScale = static_cast<int64_t>(kSeeds / 300);  // thresholds per 300 seeds
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::vector<uint8_t> input = seededInput(seed + 1'000'000, 1500);
    input[1] = static_cast<uint8_t>(0xC0 + seed % 3 + uint64_t{3} * (input[1] % 21));
    LifecycleResult const result = runLifecycle(input);
    ASSERT_TRUE(result.ok) << "seed " << seed << " (runtime byte " << int{input[1]}
                           << "): " << result.failure;
    total += result.stats;
  }
  EXPECT_EQ(total.hybridLifecycles + total.speculativeLifecycles + total.mtpLifecycles,
            static_cast<int64_t>(kSeeds));
  EXPECT_EQ(total.hybridLifecycles, static_cast<int64_t>(kSeeds / 3));
  EXPECT_EQ(total.speculativeLifecycles, static_cast<int64_t>(kSeeds / 3));
  EXPECT_EQ(total.mtpLifecycles, static_cast<int64_t>(kSeeds / 3));
  EXPECT_GT(total.rejectedCalls, total.operations / 20);
  EXPECT_GT(total.recurrentChecks, 10'000 * kScale);
  EXPECT_GT(total.checkpointsRestored, 50 * kScale);
  EXPECT_GT(total.checkpointsPublished, 300 * kScale);
  EXPECT_GT(total.checkpointSlabChecks, 10'000 * kScale);
  EXPECT_GT(total.snapshotPressureSkips, 10 * kScale);
  EXPECT_GT(total.reusePointsWritten, 0);
  EXPECT_GT(total.reusePointsRestored, 0);
  EXPECT_GT(total.draftOraclePositions, 100'000 * kScale);
  EXPECT_GT(total.pairedReuses, 30 * kScale);
  EXPECT_GT(total.heldFounders, 100 * kScale);  // hybrid and EAGLE founders in chunks
  EXPECT_GT(total.pairedJoins, 0);
  EXPECT_GT(total.verificationRounds, 1000 * kScale);
  EXPECT_GT(total.acceptedTokens, total.verificationRounds);  // rounds accept several tokens
  EXPECT_GT(total.mtpEndpoints, 100 * kScale);
  EXPECT_GT(total.mtpBatchEndpoints, 30 * kScale);   // rows of Hybrid-MTP batches
  EXPECT_GT(total.mtpJoinerEndpoints, 10 * kScale);  // Hybrid-MTP joiners
  EXPECT_GT(total.boundaryHiddenRestores, 12 * kScale);
  EXPECT_GT(total.failedSynchronizations, 100 * kScale);
  EXPECT_GT(total.quarantines, 100 * kScale);
  EXPECT_GT(total.compactions, 100 * kScale);
  EXPECT_GT(total.checkpointPreemptions, 10 * kScale);  // rows preempted, their state captured
  EXPECT_GT(total.checkpointPreemptionQuarantines, 0);  // ... or that capture's sync failed
  std::printf(
      "operations %lld, rejected %lld, lifecycles hybrid %lld / speculative %lld / Hybrid-MTP "
      "%lld, recurrent checks %lld, checkpoints restored %lld / published %lld / slabs checked "
      "%lld, pressure skips %lld, reuse points written %lld / restored %lld, draft oracle "
      "positions %lld, paired reuses %lld, paired joiners %lld, verification "
      "rounds %lld (%lld tokens accepted), "
      "Hybrid-MTP endpoints %lld (%lld by rows of batches, %lld joiners'), boundary hidden "
      "restores %lld, preemptions captured %lld (and %lld quarantined by their capture), failed "
      "syncs "
      "%lld, quarantines %lld\n",
      static_cast<long long>(total.operations), static_cast<long long>(total.rejectedCalls),
      static_cast<long long>(total.hybridLifecycles),
      static_cast<long long>(total.speculativeLifecycles),
      static_cast<long long>(total.mtpLifecycles), static_cast<long long>(total.recurrentChecks),
      static_cast<long long>(total.checkpointsRestored),
      static_cast<long long>(total.checkpointsPublished),
      static_cast<long long>(total.checkpointSlabChecks),
      static_cast<long long>(total.snapshotPressureSkips),
      static_cast<long long>(total.reusePointsWritten),
      static_cast<long long>(total.reusePointsRestored),
      static_cast<long long>(total.draftOraclePositions),
      static_cast<long long>(total.pairedReuses), static_cast<long long>(total.pairedJoins),
      static_cast<long long>(total.verificationRounds),
      static_cast<long long>(total.acceptedTokens), static_cast<long long>(total.mtpEndpoints),
      static_cast<long long>(total.mtpBatchEndpoints),
      static_cast<long long>(total.mtpJoinerEndpoints),
      static_cast<long long>(total.boundaryHiddenRestores),
      static_cast<long long>(total.checkpointPreemptions),
      static_cast<long long>(total.checkpointPreemptionQuarantines),
      static_cast<long long>(total.failedSynchronizations),
      static_cast<long long>(total.quarantines));
}

/// The sliding-window reuse runtime (forceRuntime kind 6: a full-attention coordinator and a
/// cached-mode SWA manager behind one facade request) on seeded inputs: every operation checked
/// as above, plus both halves' accounting, the sliding rows' windows and every reused window's
/// bytes. Its admissions, decode steps, joins and finalisations are checked on both halves before
/// either changes; a refusal or a rejected call must leave both (and the sliding pool) as they
/// were.
TEST(LifecycleFuzzTest, SlidingWindowReuseKeepsEveryInvariant) {
  constexpr uint64_t kSeeds = kSanitized ? 100 : 300;
  constexpr int64_t kScale = static_cast<int64_t>(kSeeds / 100);  // thresholds per 100 seeds
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::vector<uint8_t> input = seededInput(seed + 5'000'000, 1500);
    forceRuntime(input, 6);
    LifecycleResult const result = runLifecycle(input);
    ASSERT_TRUE(result.ok) << "seed " << seed << " (set-up bytes " << int{input[0]} << ", "
                           << int{input[1]} << ", " << int{input[2]} << "): " << result.failure;
    total += result.stats;
  }
  EXPECT_EQ(total.slidingReuseLifecycles, static_cast<int64_t>(kSeeds));
  EXPECT_EQ(total.runtimeOperations[6], total.operations);
  EXPECT_GT(total.rejectedCalls, total.operations / 20);
  EXPECT_GT(total.refusals, 500 * kScale);
  EXPECT_GT(total.slidingWindowReuses, 50 * kScale);
  EXPECT_GT(total.joins, 50 * kScale);
  EXPECT_GT(total.retractions, 10 * kScale);
  EXPECT_GT(total.prefillChunks, 5 * kScale);
  EXPECT_GT(total.heldFounders, 50 * kScale);  // their sliding halves keep the staged prompt
  EXPECT_GT(total.preemptions, 10 * kScale);
  EXPECT_GT(total.compactions, 100 * kScale);
  EXPECT_GT(total.failedSynchronizations, 100 * kScale);
  EXPECT_GT(total.quarantines, 50 * kScale);
  EXPECT_GT(total.cacheResets, 10 * kScale);
  std::printf(
      "operations %lld, rejected %lld, refusals %lld, reused windows verified %lld, joins %lld "
      "(prefill chunks %lld), retractions %lld, preemptions %lld, compactions %lld, failed syncs "
      "%lld, quarantines %lld, cache resets %lld\n",
      static_cast<long long>(total.operations), static_cast<long long>(total.rejectedCalls),
      static_cast<long long>(total.refusals), static_cast<long long>(total.slidingWindowReuses),
      static_cast<long long>(total.joins), static_cast<long long>(total.prefillChunks),
      static_cast<long long>(total.retractions), static_cast<long long>(total.preemptions),
      static_cast<long long>(total.compactions),
      static_cast<long long>(total.failedSynchronizations),
      static_cast<long long>(total.quarantines), static_cast<long long>(total.cacheResets));
}

/// Engine-step device writes (forced: bits 6 and 7 of the first byte) on seeded inputs, each
/// of the seven runtime kinds in turn. Every operation checked as above, plus the engine's flushes
/// (nothing waits after one, every device row is its host row) and the completions refused for a
/// forgotten flush.
TEST(LifecycleFuzzTest, EngineStepWritesKeepEveryInvariant) {
  constexpr uint64_t kSeeds = kSanitized ? 120 : 360;
  constexpr int64_t kScale = static_cast<int64_t>(kSeeds / 120);  // thresholds per 120 seeds
  LifecycleStats total;
  for (uint64_t seed = 1; seed <= kSeeds; ++seed) {
    std::vector<uint8_t> input = seededInput(seed + 3'000'000, 1500);
    forceRuntime(input, static_cast<int32_t>(seed % 7));
    forceEngineStep(input, true);
    LifecycleResult const result = runLifecycle(input);
    ASSERT_TRUE(result.ok) << "seed " << seed << " (set-up bytes " << int{input[0]} << ", "
                           << int{input[1]} << ", " << int{input[2]} << "): " << result.failure;
    total += result.stats;
  }
  EXPECT_EQ(total.engineStepLifecycles, static_cast<int64_t>(kSeeds));
  EXPECT_GT(total.rejectedCalls, total.operations / 20);
  EXPECT_GT(total.deviceFlushes, 1000 * kScale);
  EXPECT_GT(total.forgottenFlushes, 20 * kScale);
  EXPECT_GT(total.heldFounders, 50 * kScale);
  EXPECT_GT(total.joins, 10 * kScale);
  EXPECT_GT(total.compactions, 30 * kScale);
  EXPECT_GT(total.failedSynchronizations, 30 * kScale);
  EXPECT_GT(total.quarantines, 30 * kScale);
  EXPECT_GT(total.cacheResets, 10 * kScale);
  for (std::size_t k = 0; k < 7; ++k) {
    EXPECT_GT(total.runtimeOperations[k], 0) << kRuntimeNames[k];
  }
  EXPECT_GT(total.swaChunksRun, 10 * kScale);  // bounded SWA's joiners' chunks, flushed first
  std::printf(
      "operations %lld (engine-step %lld), rejected %lld, engine flushes %lld, completions refused "
      "for a forgotten flush "
      "%lld, joins %lld (bounded SWA %lld, %lld chunks run), compactions %lld, failed syncs %lld, "
      "quarantines %lld\n",
      static_cast<long long>(total.operations), static_cast<long long>(total.engineStepOperations),
      static_cast<long long>(total.rejectedCalls), static_cast<long long>(total.deviceFlushes),
      static_cast<long long>(total.forgottenFlushes), static_cast<long long>(total.joins),
      static_cast<long long>(total.swaJoins), static_cast<long long>(total.swaChunksRun),
      static_cast<long long>(total.compactions),
      static_cast<long long>(total.failedSynchronizations),
      static_cast<long long>(total.quarantines));
}

}  // namespace
}  // namespace mkv::fuzz
