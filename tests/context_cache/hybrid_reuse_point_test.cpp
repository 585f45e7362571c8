// Reuse points on checkpoint deployments (docs/context_cache.md, "Reuse points"): with a
// checkpoint interval the coordinator names, at preparePrefill, a snapshot slot for every
// multiple of the interval inside each prompt; the engine writes the state there (here: the
// recurrent oracle, as a chunked scan would), finalizePrefillPublication commits them, and a
// later prompt that diverges inside the first one restores the last point before the divergence.
// Every restore is checked by the oracles (KV before the start, recurrent rows at the start).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "hybrid_test_rig.h"

namespace mkv::test {
namespace {

using Handle = ContextCacheCoordinator::RequestHandle;
constexpr ContextCacheStatus kOk = ContextCacheStatus::kOk;
constexpr ResourceType kRecurrent = ResourceType::kRecurrentSnapshot;

class HybridReusePointTest : public DeviceTest {};

/// Pages of 16 tokens, a point every 32, room for 100-token prompts and a few turns.
HybridRigOptions pointOptions(bool attention = true) {
  HybridRigOptions o;
  o.attention = attention;
  o.pageSize = 16;
  o.numPages = 48;
  o.maxPagesPerSeq = 12;
  o.maxRecords = 32;
  o.recurrentSlots = 16;
  o.partialSlots = 4;
  o.checkpointInterval = 32;
  return o;
}

/// Admits and prefills `seqs`, then finishes; returns the prefill starts.
std::vector<int32_t> serve(HybridRig& rig, std::vector<Seq*> const& seqs) {
  std::vector<int32_t> starts;
  Handle handle = rig.admit(seqs, &starts);
  EXPECT_EQ(rig.prefill(handle, seqs), kOk);
  EXPECT_EQ(rig.coordinator->finish(handle), kOk);
  return starts;
}

TEST_P(HybridReusePointTest, AFollowUpThatDivergesInsideThePromptRestoresTheLastPointBeforeIt) {
  HybridRig rig(device(), pointOptions());
  std::vector<int32_t> const first = tokenRun(100, 100);
  Seq producer(first, 0);
  EXPECT_EQ(serve(rig, {&producer}), std::vector<int32_t>{0});
  EXPECT_EQ(rig.capturedPoints, (std::vector<int32_t>{32, 64, 96})) << "short of the prompt end";
  EXPECT_EQ(checkpointLengths(rig, true), (std::vector<int32_t>{32, 64, 96}));
  EXPECT_EQ(checkpointLengths(rig, false), std::vector<int32_t>{100}) << "the prompt end";
  EXPECT_EQ(rig.coordinator->counters().reusePointCaptures, 3u);
  EXPECT_EQ(rig.coordinator->counters().reusePointPublications, 3u);

  // Diverges at 70: without points no checkpoint would be a prefix of it (the prompt end is not).
  Seq follower(
      concatenated(std::vector<int32_t>(first.begin(), first.begin() + 70), tokenRun(20, 5000)), 1);
  rig.capturedPoints.clear();
  EXPECT_EQ(serve(rig, {&follower}), std::vector<int32_t>{64})
      << "the oracles checked the restored KV and recurrent rows";
  EXPECT_EQ(rig.coordinator->counters().reusePointRestores, 1u);
  EXPECT_EQ(rig.coordinator->counters().checkpointRestores, 1u);
  EXPECT_TRUE(rig.capturedPoints.empty()) << "the next point, 96, is past its 90 tokens";
  rig.expectQuiescent();
}

TEST_P(HybridReusePointTest, PointsStartPastTheReuseLengthAndSkipThePromptEnd) {
  HybridRig rig(device(), pointOptions());
  std::vector<int32_t> const first = tokenRun(64, 100);
  Seq producer(first, 0);
  serve(rig, {&producer});
  EXPECT_EQ(rig.capturedPoints, std::vector<int32_t>{32}) << "64 is the prompt end's checkpoint";
  EXPECT_EQ(checkpointLengths(rig, false), std::vector<int32_t>{64});

  // The next turn restores the prompt end (64) and keeps points from 96 on only.
  Seq next(concatenated(first, tokenRun(60, 7000)), 1);
  rig.capturedPoints.clear();
  EXPECT_EQ(serve(rig, {&next}), std::vector<int32_t>{64});
  EXPECT_EQ(rig.capturedPoints, std::vector<int32_t>{96});
  EXPECT_EQ(rig.coordinator->counters().reusePointRestores, 0u) << "a prompt end was restored";
  rig.expectQuiescent();
}

TEST_P(HybridReusePointTest, TwoRowsOfOneBatchSharingAPrefixKeepOneRecordPerPoint) {
  HybridRig rig(device(), pointOptions());
  std::vector<int32_t> const shared = tokenRun(70, 100);
  Seq a(concatenated(shared, tokenRun(10, 3000)), 0);
  Seq b(concatenated(shared, tokenRun(10, 4000)), 1);
  serve(rig, {&a, &b});
  EXPECT_EQ(rig.capturedPoints, (std::vector<int32_t>{32, 64})) << "planned once, by row 0";
  EXPECT_EQ(checkpointLengths(rig, true), (std::vector<int32_t>{32, 64}));
  EXPECT_EQ(rig.coordinator->counters().reusePointCaptures, 2u);
  EXPECT_EQ(rig.coordinator->counters().reusePointPublications, 2u);
  rig.expectQuiescent();
  EXPECT_EQ(rig.freeSlots(kRecurrent), 16 - 2 - 2) << "two points, two prompt ends";
}

TEST_P(HybridReusePointTest, PointsLeaveTheSlotsThePromptEndsNeed) {
  HybridRigOptions options = pointOptions();
  options.recurrentSlots = 3;
  HybridRig rig(device(), options);
  Seq first(tokenRun(100, 100), 0);
  Seq second(tokenRun(100, 5000), 1);
  std::vector<int32_t> starts;
  Handle handle = rig.admit({&first, &second}, &starts);
  ASSERT_EQ(rig.prefill(handle, {&first, &second}), kOk);
  EXPECT_EQ(rig.capturedPoints, std::vector<int32_t>{32}) << "one slot for each prompt end kept";
  EXPECT_EQ(rig.coordinator->counters().snapshotPressureSkips, 2u) << "at 64, then row 1's 32";
  EXPECT_EQ(checkpointLengths(rig, false), (std::vector<int32_t>{100, 100})) << "both ends";
  ASSERT_EQ(rig.decode(handle, {&first, &second}), kOk) << "the request carries on";
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(checkpointLengths(rig, true), std::vector<int32_t>{32});
  rig.expectQuiescent();
}

/// Each checkpoint record's exact length, retention priority and whether it is speculative, in
/// victim order.
struct Ranked {
  int32_t length;
  int32_t priority;
  bool speculative;
  friend bool operator==(Ranked const&, Ranked const&) = default;
};
std::vector<Ranked> victimOrder(HybridRig const& rig) {
  std::vector<Ranked> ranked;
  for (RecordId id : rig.manager().records().victimOrder()) {
    CacheRecord const& record = *rig.manager().records().get(id);
    ranked.push_back({*record.exactCheckpointLength, record.retentionPriority, record.speculative});
  }
  return ranked;
}

TEST_P(HybridReusePointTest,
       BranchFirstKeepsTheBranchAndRanksSpeculativePointsBelowTheProvenRecords) {
  HybridRigOptions options = pointOptions();
  options.reusePointAdmission = ReusePointAdmission::kBranchFirst;
  HybridRig rig(device(), options);
  std::vector<int32_t> const first = tokenRun(100, 100);
  Seq producer(first, 0);
  serve(rig, {&producer});
  constexpr int32_t kLow = kMinRetentionPriority;
  constexpr int32_t kNormal = kDefaultRetentionPriority;
  // Nothing was cached: no branch; the interval points are speculations, the prompt end is not.
  // 64 is two intervals: it ranks above 32 and 96, which a thinning budget drops first.
  EXPECT_EQ(victimOrder(rig),
            (std::vector<Ranked>{
                {32, kLow, true}, {96, kLow, true}, {64, kLow + 1, true}, {100, kNormal, false}}));
  // Shares 80 tokens (5 cached pages): restores the point at 64, which a prompt has now passed
  // through again (promoted), and keeps a point where it branches, 80, as any checkpoint.
  Seq follower(
      concatenated(std::vector<int32_t>(first.begin(), first.begin() + 80), tokenRun(20, 5000)), 1);
  rig.capturedPoints.clear();
  EXPECT_EQ(serve(rig, {&follower}), std::vector<int32_t>{64}) << "the oracles checked the restore";
  EXPECT_EQ(rig.capturedPoints, (std::vector<int32_t>{80, 96}));
  std::vector<Ranked> const order = victimOrder(rig);
  ASSERT_EQ(order.size(), 7u);
  for (std::size_t i = 0; i < 3; ++i) {  // the three speculations go first: 32, A's 96, B's 96
    EXPECT_TRUE(order[i].speculative && order[i].priority == kLow) << i;
  }
  EXPECT_EQ(std::count(order.begin(), order.end(), Ranked{64, kNormal, false}), 1) << "promoted";
  EXPECT_EQ(std::count(order.begin(), order.end(), Ranked{80, kNormal, false}), 1) << "the branch";
  EXPECT_EQ(std::count(order.begin(), order.end(), Ranked{100, kNormal, false}), 2) << "the ends";
  rig.expectQuiescent();
}

TEST_P(HybridReusePointTest, BranchFirstThinsThePointsOfEveryPromptUnderABudget) {
  HybridRigOptions options = pointOptions();
  options.reusePointAdmission = ReusePointAdmission::kBranchFirst;
  options.checkpointInterval = 16;
  options.recurrentSlots = 12;
  HybridRig rig(device(), options);
  std::vector<int32_t> const first = tokenRun(128, 100);
  Seq a(first, 0);
  serve(rig, {&a});
  // A speculation at (2^r x odd) intervals ranks r: the points a budget keeps when it halves
  // the density, each saving a hit up to 2^r intervals more than the next coarser one would.
  EXPECT_EQ(victimOrder(rig), (std::vector<Ranked>{{16, 0, true},
                                                   {48, 0, true},
                                                   {80, 0, true},
                                                   {112, 0, true},
                                                   {32, 1, true},
                                                   {96, 1, true},
                                                   {64, 2, true},
                                                   {128, kDefaultRetentionPriority, false}}));
  // Another prompt needs 8 of the 12 slots: it takes A's odd points, not A's oldest ones.
  Seq b(tokenRun(128, 5000), 1);
  serve(rig, {&b});
  EXPECT_EQ(rig.coordinator->counters().snapshotPressureSkips, 0u);
  EXPECT_EQ(rig.manager().records().size(), 12u);
  // A follow-up of A diverging at 70 still lands one interval short of it (every point up to
  // 64, the oldest four, would have gone first by age alone).
  Seq follower(
      concatenated(std::vector<int32_t>(first.begin(), first.begin() + 70), tokenRun(20, 9000)), 0);
  EXPECT_EQ(serve(rig, {&follower}), std::vector<int32_t>{64}) << "the oracles checked the restore";
  EXPECT_EQ(rig.coordinator->counters().reusePointRestores, 1u);
  rig.expectQuiescent();
}

TEST_P(HybridReusePointTest, BranchFirstRanksATurnTheNextTurnExtendedAsASpeculation) {
  HybridRigOptions options = pointOptions();
  options.reusePointAdmission = ReusePointAdmission::kBranchFirst;
  HybridRig rig(device(), options);
  constexpr int32_t kLow = kMinRetentionPriority;
  constexpr int32_t kNormal = kDefaultRetentionPriority;
  auto ranked = [&](int32_t length) {
    for (Ranked const& record : victimOrder(rig)) {
      if (record.length == length) {
        return record;
      }
    }
    return Ranked{length, -1, false};
  };
  std::vector<int32_t> const turn1 = tokenRun(40, 100);
  Seq first(turn1, 0);
  serve(rig, {&first});
  EXPECT_EQ(ranked(40), (Ranked{40, kNormal, false})) << "a prompt end";
  // The next turn extends the first: it restores the first turn's end, publishes its own, and
  // the first turn's end now serves only a prompt that branches inside the second turn.
  std::vector<int32_t> const turn2 = concatenated(turn1, tokenRun(30, 3000));
  Seq second(turn2, 1);
  EXPECT_EQ(serve(rig, {&second}), std::vector<int32_t>{40});
  EXPECT_EQ(ranked(70), (Ranked{70, kNormal, false}));
  EXPECT_EQ(ranked(40), (Ranked{40, kLow, true})) << "superseded";
  // A prompt that branches right after the first turn restores it again: a second prompt came
  // through it, so it is a branch and ranks as any checkpoint from then on.
  Seq branch(concatenated(turn1, tokenRun(20, 7000)), 0);
  EXPECT_EQ(serve(rig, {&branch}), std::vector<int32_t>{40}) << "the oracles checked the restore";
  EXPECT_EQ(ranked(40), (Ranked{40, kNormal, false})) << "promoted, and not superseded again";
  EXPECT_EQ(ranked(60), (Ranked{60, kNormal, false}));
  // A point inside a prompt that a longer prompt passes through is a shared prefix, never
  // superseded: the second turn's interval point at 64 stays a speculation only until a hit.
  Seq third(concatenated(turn2, tokenRun(10, 9000)), 0);
  EXPECT_EQ(serve(rig, {&third}), std::vector<int32_t>{70});
  EXPECT_EQ(ranked(70), (Ranked{70, kLow, true})) << "the second turn's end, superseded";
  rig.expectQuiescent();
}

TEST_P(HybridReusePointTest, EveryIntervalRanksPointsAsAnyCheckpoint) {
  HybridRigOptions options = pointOptions();
  options.reusePointAdmission = ReusePointAdmission::kEveryInterval;
  HybridRig rig(device(), options);
  Seq producer(tokenRun(100, 100), 0);
  serve(rig, {&producer});
  for (Ranked const& record : victimOrder(rig)) {
    EXPECT_FALSE(record.speculative) << record.length;
    EXPECT_EQ(record.priority, kDefaultRetentionPriority) << record.length;
  }
}

TEST_P(HybridReusePointTest, AnAbandonedPrefillReturnsItsPointSlots) {
  HybridRig rig(device(), pointOptions());
  Seq producer(tokenRun(100, 100), 0);
  Handle handle = rig.admit({&producer});
  rig.coordinator->preparePrefill(handle);
  ASSERT_EQ(rig.coordinator->reusePointCaptures(handle, 0).size(), 3u);
  EXPECT_EQ(rig.freeSlots(kRecurrent), 16 - 3);
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
  EXPECT_EQ(rig.freeSlots(kRecurrent), 16) << "nothing committed, every reservation returned";
  EXPECT_EQ(rig.manager().records().size(), 0u);
  rig.expectQuiescent();
}

TEST_P(HybridReusePointTest, APureRecurrentModelKeepsPointsAtAnyInterval) {
  HybridRigOptions options = pointOptions(false);
  options.checkpointInterval = 30;  // no page to align with
  HybridRig rig(device(), options);
  std::vector<int32_t> const first = tokenRun(100, 100);
  Seq producer(first, 0);
  serve(rig, {&producer});
  EXPECT_EQ(rig.capturedPoints, (std::vector<int32_t>{30, 60, 90}));
  Seq follower(
      concatenated(std::vector<int32_t>(first.begin(), first.begin() + 75), tokenRun(5, 9000)), 1);
  EXPECT_EQ(serve(rig, {&follower}), std::vector<int32_t>{60});
  EXPECT_EQ(rig.coordinator->counters().reusePointRestores, 1u);
  rig.expectQuiescent();
}

TEST_P(HybridReusePointTest, TheCapturesAreNamedDuringThePrefillOnly) {
  HybridRig rig(device(), pointOptions());
  Seq producer(tokenRun(100, 100), 0);
  Handle handle = rig.admit({&producer});
  EXPECT_TRUE(throwsError([&] { (void)rig.coordinator->reusePointCaptures(handle, 0); },
                          {"ContextCacheCoordinator::reusePointCaptures",
                           "between preparePrefill and finalizePrefillPublication"}));
  rig.coordinator->preparePrefill(handle);
  EXPECT_TRUE(throwsError([&] { (void)rig.coordinator->reusePointCaptures(handle, 1); },
                          {"ContextCacheCoordinator::reusePointCaptures", "row 1 outside"}));
  ASSERT_EQ(rig.coordinator->finish(handle), kOk);
}

INSTANTIATE_TEST_SUITE_P(Devices, HybridReusePointTest, allDeviceTypes(), deviceName);

TEST(HybridReusePointConstructionTest, TheIntervalIsValidatedAgainstTheDeployment) {
  HybridRigOptions const o = pointOptions();
  RigOptions kv;
  kv.maxBatch = o.maxBatch;
  kv.pageSize = o.pageSize;
  KVCachePool pool(CoordinatorRig::poolConfig(DeviceType::kCPU, kv));
  KVPageTable table(o.maxBatch, o.maxPagesPerSeq, kv.numPages, PageTableMode::kDense,
                    DeviceType::kCPU);
  RecurrentStatePool recurrent(HybridRig::recurrentConfig(DeviceType::kCPU, o));
  ContextCacheConfig config;
  config.recurrentSnapshotPoolBytes = 4 * SnapshotStorage::recurrentBytesPerSlot(recurrent);
  config.partialKvSnapshotPoolBytes = 2 * SnapshotStorage::partialKvBytesPerSlot(pool);
  ContextCacheDeploymentProfile hybrid;
  hybrid.baseStateKind = BaseStateKind::kHybrid;
  auto construct = [&](int32_t interval, ContextCacheDeploymentProfile const& profile,
                       ContextCachePhysicalResources const& resources) {
    ContextCacheConfig c = config;
    c.checkpointInterval = interval;
    return [=] { ContextCacheCoordinator coordinator(c, profile, resources, nullptr); };
  };
  ContextCachePhysicalResources const withRecurrent{&pool, &table, nullptr, nullptr, &recurrent};
  EXPECT_NO_THROW(construct(64, hybrid, withRecurrent)());
  EXPECT_TRUE(throwsError(
      construct(40, hybrid, withRecurrent),
      {"ContextCacheCoordinator", "checkpointInterval 40 is not a multiple of the page size 16"}));
  EXPECT_TRUE(throwsError(construct(-16, hybrid, withRecurrent),
                          {"checkpointInterval must be >= 0, got -16"}));
  EXPECT_TRUE(throwsError(
      construct(64, ContextCacheDeploymentProfile{}, {&pool, &table, nullptr, nullptr, nullptr}),
      {"checkpointInterval 64 is for hybrid, pure-recurrent and sliding-window reuse"}));
}

}  // namespace
}  // namespace mkv::test
