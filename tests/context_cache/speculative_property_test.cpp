// Random speculative and Hybrid-MTP workloads: seeded sequences of requests over prompts that
// share prefixes, mixing speculative and vanilla requests, decode rounds with random acceptance
// and draft lag, cancellation, compaction, finish and abandonment. Every execution verifies what
// it resumes from (base KV, draft KV, recurrent rows, boundary hidden rows) against the oracles,
// and every request leaves the pools quiescent.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "speculative_test_rig.h"

namespace mkv::test {
namespace {

using Handle = ContextCacheCoordinator::RequestHandle;
constexpr ContextCacheStatus kOk = ContextCacheStatus::kOk;

/// Half the time the next turn of an earlier conversation (its whole ledger, then a few new
/// tokens: what checkpoints are for), else a prompt of one of a few families: a shared head,
/// then a random tail.
std::vector<int32_t> promptOf(std::mt19937& rng, int32_t pageSize,
                              std::vector<std::vector<int32_t>> const& history) {
  std::uniform_int_distribution<int32_t> turn(1, 6);
  if (!history.empty() && std::bernoulli_distribution(0.5)(rng)) {
    std::uniform_int_distribution<std::size_t> pick(0, history.size() - 1);
    std::vector<int32_t> prompt = history[pick(rng)];
    if (static_cast<int32_t>(prompt.size()) <= 8 * pageSize) {
      std::vector<int32_t> const next = tokenRun(turn(rng), 50);
      prompt.insert(prompt.end(), next.begin(), next.end());
      return prompt;
    }
  }
  std::uniform_int_distribution<int32_t> family(0, 2);
  std::uniform_int_distribution<int32_t> head(1, 3 * pageSize);
  std::uniform_int_distribution<int32_t> tail(1, pageSize);
  std::uniform_int_distribution<int32_t> token(1, 4);
  std::vector<int32_t> prompt = tokenRun(head(rng), 1000 * (family(rng) + 1));
  int32_t const extra = tail(rng);
  for (int32_t i = 0; i < extra; ++i) {
    prompt.push_back(token(rng));  // few distinct tails: exact checkpoints repeat
  }
  return prompt;
}

void runWorkload(SpecRigOptions options, uint32_t seed, int32_t requests) {
  SpecRig rig(DeviceType::kCPU, options);
  std::mt19937 rng(seed);
  std::bernoulli_distribution coin(0.5);
  std::uniform_int_distribution<int32_t> rounds(0, 3);
  std::uniform_int_distribution<int32_t> accept(1, 3);
  std::uniform_int_distribution<int32_t> lag(0, 2);
  int32_t const pageSize = options.pageSize;
  int32_t reused = 0;
  int32_t mtpBatches = 0;  // Hybrid-MTP requests of two rows, each publishing its endpoint
  std::vector<std::vector<int32_t>> history;
  for (int32_t r = 0; r < requests; ++r) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " request " << r);
    bool const speculative = coin(rng);
    int32_t const batch = 1 + (coin(rng) ? 1 : 0);
    std::vector<Seq> seqs;
    seqs.reserve(static_cast<std::size_t>(batch));
    for (int32_t i = 0; i < batch; ++i) {
      seqs.emplace_back(promptOf(rng, pageSize, history), i);
    }
    std::vector<Seq*> rows;
    rows.reserve(seqs.size());
    for (Seq& seq : seqs) {
      rows.push_back(&seq);
    }
    auto const recordIds = [&rig] {
      std::vector<RecordId> ids;
      for (CacheRecord const& record : rig.records()) {
        ids.push_back(record.id);
      }
      return ids;
    };
    std::vector<RecordId> const recordsBefore = recordIds();
    ResourceDemand const freeBefore = rig.pools().freeCounts();
    int32_t const leasesBefore = rig.manager().liveLeaseCount();
    auto begun = rig.coordinator->beginRequest(rig.batchOf(rows, speculative),
                                               rig.headroomOf(speculative), nullptr);
    if (begun.status == ContextCacheStatus::kRequestFailed) {
      // Pool pressure: nothing changed (no record evicted or reordered, no slot taken).
      EXPECT_EQ(recordIds(), recordsBefore);
      EXPECT_EQ(rig.pools().freeCounts(), freeBefore);
      EXPECT_EQ(rig.manager().liveLeaseCount(), leasesBefore);
      continue;
    }
    ASSERT_EQ(begun.status, kOk);
    Handle handle = std::move(begun.admission->request);
    for (int32_t start : begun.admission->prefillStarts) {
      reused += start > 0 ? 1 : 0;
    }
    bool const mtp = speculative && options.hybrid;
    ContextCacheStatus const prefilled =
        mtp ? rig.mtpPrefill(handle, rows) : rig.prefill(handle, rows, speculative);
    mtpBatches += mtp && rows.size() > 1 ? 1 : 0;
    ASSERT_EQ(prefilled, kOk);
    bool failed = false;
    for (int32_t round = rounds(rng); round > 0 && !failed; --round) {
      std::vector<int32_t> accepted;
      std::vector<int32_t> lags;
      std::vector<int32_t> completed;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        bool const cancelled = rows.size() > 1 && coin(rng) && coin(rng);
        accepted.push_back(cancelled ? 0 : (speculative ? accept(rng) : 1));
        lags.push_back(lag(rng));
        if (!cancelled && coin(rng)) {
          completed.push_back(static_cast<int32_t>(i));
        }
      }
      ContextCacheStatus const stepped =
          rig.step(handle, rows, accepted, lags, completed, speculative);
      ASSERT_NE(stepped, ContextCacheStatus::kPoisoned);
      failed = stepped != kOk;  // a row could not grow: only finish remains
    }
    if (!failed && rows.size() > 1 && coin(rng)) {
      Tensor mapping({2}, DataType::kInt32, DeviceType::kCPU);
      std::vector<int32_t> const dropFirst{-1, 0};
      rig.coordinator->beginBatchCompaction(handle, dropFirst, 1, mapping);
      ASSERT_EQ(rig.coordinator->compactBatch(handle), kOk);
    }
    if (coin(rng)) {
      ASSERT_EQ(rig.coordinator->finish(handle), kOk);
    } else {
      handle = Handle{};  // abandoned
    }
    for (Seq const& seq : seqs) {
      history.push_back(seq.tokens);
    }
    if (history.size() > 32) {
      history.erase(history.begin());
    }
    ASSERT_EQ(rig.coordinator->activeRequestCount(), 0);
    rig.expectQuiescent();
    if (::testing::Test::HasFatalFailure() || ::testing::Test::HasNonfatalFailure()) {
      return;  // the first divergence is the interesting one
    }
  }
  EXPECT_GT(reused, requests / 20) << "the workload must exercise reuse";
  if (options.hybrid) {
    EXPECT_GT(mtpBatches, requests / 20) << "the workload must run Hybrid-MTP batches";
  }
}

SpecRigOptions small(bool hybrid) {
  SpecRigOptions options;
  options.hybrid = hybrid;
  options.pageSize = 16;
  options.maxPagesPerSeq = 20;
  options.numPages = 48;
  options.numDraftPages = 48;
  options.maxRecords = 24;
  options.recurrentSlots = 16;
  options.partialSlots = 16;
  return options;
}

TEST(SpeculativePropertyTest, RandomEagleWorkloadsKeepBaseAndDraftStateExact) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    runWorkload(small(false), seed, 1000);
  }
}

TEST(SpeculativePropertyTest, RandomHybridMtpWorkloadsKeepPairedCheckpointsExact) {
  for (uint32_t seed : {11u, 12u, 13u}) {
    runWorkload(small(true), seed, 1000);
  }
}

TEST(SpeculativePropertyTest, RandomSharedKvSpeculativeWorkloadsReuseTheBaseOnly) {
  SpecRigOptions options = small(false);
  options.contract = SpecReuseContract{false, 0};
  runWorkload(options, 21, 1000);
}

}  // namespace
}  // namespace mkv::test
