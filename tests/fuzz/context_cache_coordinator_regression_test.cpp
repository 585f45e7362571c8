/// ContextCacheCoordinator: regressions found by the lifecycle fuzzer (docs/reliability.md). Each
/// test names the call order the fuzzer found and pins the documented outcome.

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/error.h"
#include "mkv/kv_cache_runtime.h"
#include "support/fault_arming.h"
#include "support/token_runs.h"

namespace mkv {
using test::tokenRun;
namespace {

constexpr int32_t kPage = 16;
constexpr DecodingKvHeadroom kVanilla{1, 0};

using Handle = ContextCacheCoordinator::RequestHandle;

/// A context-reuse runtime on host memory whose synchroniser counts its calls.
struct Rig {
  explicit Rig(int32_t pagesPerRow = 4, int32_t pages = 16) {
    KVCacheRuntimeConfig config;
    config.model.numFullAttentionLayers = 1;
    config.model.numKVHeads = 1;
    config.model.headDim = 4;
    config.maxBatchSize = 3;
    config.maxSequenceLength = pagesPerRow * kPage;
    config.tokensPerPage = kPage;
    config.numPages = pages;
    config.contextReuse = true;
    config.deviceType = DeviceType::kCPU;
    config.faults = syncs.injector();
    runtime = KVCacheRuntime::create(config);
  }
  ~Rig() { (void)runtime->shutdown(); }
  Rig(Rig const&) = delete;
  Rig& operator=(Rig const&) = delete;

  ContextCacheCoordinator& coordinator() { return *runtime->contextCache(); }
  KVPageTable& table() { return *runtime->fullPageTable(); }

  Handle admit(
      std::vector<std::vector<int32_t>> const& prompts,
      DecodingTokenStateContract contract = DecodingTokenStateContract::kCommittedPlusLookahead,
      std::vector<int32_t>* starts = nullptr) {
    ContextCacheBatchAdmission admission;
    admission.tokenStateContract = contract;
    for (auto const& prompt : prompts) {
      ContextCacheSequenceAdmission sequence;
      sequence.tokenIds = prompt;
      sequence.resident = *runtime->residentSlots().acquire();
      admission.sequences.push_back(sequence);
    }
    auto result = coordinator().beginRequest(admission, kVanilla, nullptr);
    EXPECT_EQ(result.status, ContextCacheStatus::kOk);
    if (starts != nullptr) {
      *starts = result.admission->prefillStarts;
    }
    return std::move(result.admission->request);
  }

  /// Live entries of a row that differ between the host copy and the device mirror.
  int32_t staleEntries(CacheSlot slot) {
    auto const width = 2 * static_cast<std::size_t>(table().maxPagesPerSeq());
    int32_t const* device =
        table().deviceTable().dataPointer<int32_t>() + width * static_cast<std::size_t>(slot);
    std::span<int32_t const> const host = table().hostRow(slot);
    int32_t stale = 0;
    for (std::size_t i = 0; i < width; ++i) {
      stale += host[i] != device[i] ? 1 : 0;
    }
    return stale;
  }

  test::FaultArming syncs;  ///< counts the synchronisations (none fails)
  std::unique_ptr<KVCacheRuntime> runtime;
};

int32_t const kToken = 7;

/// Found by the fuzzer: under kFullyCommitted a prefill advance ({0 tokens, committed == ledger})
/// also matched the state during a decode step, so finalizePrefillPublication was accepted there
/// and cleared the pending flag; finish then skipped the synchronisation of the step's kernels.
TEST(ContextCacheCoordinatorRegressionTest, FinalizePrefillDuringADecodeStepThrows) {
  Rig rig;
  ContextCacheCoordinator& coordinator = rig.coordinator();
  Handle handle = rig.admit({tokenRun(20, 100)}, DecodingTokenStateContract::kFullyCommitted);
  coordinator.preparePrefill(handle);
  std::vector<ContextCacheSequenceAdvance> const prefill{{nullptr, 0, 20}};
  ASSERT_EQ(coordinator.finalizePrefillPublication(handle, prefill), ContextCacheStatus::kOk);
  ASSERT_EQ(coordinator.prepareDecodeStep(handle, kVanilla), ContextCacheStatus::kOk);
  EXPECT_THROW((void)coordinator.finalizePrefillPublication(handle, prefill), Error);
  // The step is still pending: completing it works, and finish after a second step synchronises.
  std::vector<ContextCacheSequenceAdvance> const step{{&kToken, 1, 21}};
  EXPECT_EQ(coordinator.completeDecodeStep(handle, step, {}), ContextCacheStatus::kOk);
  ASSERT_EQ(coordinator.prepareDecodeStep(handle, kVanilla), ContextCacheStatus::kOk);
  int64_t const before = rig.syncs.calls();
  EXPECT_EQ(coordinator.finish(handle), ContextCacheStatus::kOk);
  EXPECT_EQ(rig.syncs.calls(), before + 1);
}

/// Found by the fuzzer: with a reused prefix one token shorter than the prompt, a vanilla decode
/// advance ({1 token, committed = reuse + 1}) matched the state of a pending *prefill*, so
/// completeDecodeStep was accepted before the prefill was finalised.
TEST(ContextCacheCoordinatorRegressionTest, CompleteDecodeStepDuringAPrefillThrows) {
  Rig rig;
  ContextCacheCoordinator& coordinator = rig.coordinator();
  {  // publish the first page of the prompt
    Handle first = rig.admit({tokenRun(kPage, 100)});
    coordinator.preparePrefill(first);
    std::vector<ContextCacheSequenceAdvance> const prefill{{&kToken, 1, kPage}};
    ASSERT_EQ(coordinator.finalizePrefillPublication(first, prefill), ContextCacheStatus::kOk);
    ASSERT_EQ(coordinator.finish(first), ContextCacheStatus::kOk);
    rig.runtime->residentSlots().release({0, 1});
  }
  std::vector<int32_t> starts;
  Handle handle = rig.admit({tokenRun(kPage + 1, 100)},
                            DecodingTokenStateContract::kCommittedPlusLookahead, &starts);
  ASSERT_EQ(starts, std::vector<int32_t>{kPage});  // the page is reused, one token to compute
  coordinator.preparePrefill(handle);
  std::vector<ContextCacheSequenceAdvance> const decodeLike{{&kToken, 1, kPage + 1}};
  EXPECT_THROW((void)coordinator.completeDecodeStep(handle, decodeLike, {}), Error);
  EXPECT_EQ(coordinator.committedLength(handle, 0), kPage);
  EXPECT_EQ(coordinator.finalizePrefillPublication(handle, decodeLike), ContextCacheStatus::kOk);
  EXPECT_EQ(coordinator.finish(handle), ContextCacheStatus::kOk);
}

/// Found by the fuzzer: enqueuePrefillCaptures says "between preparePrefill and
/// finalizePrefillPublication" but was accepted while a decode step or a compaction was pending.
TEST(ContextCacheCoordinatorRegressionTest, PrefillCapturesOutsideThePrefillThrow) {
  Rig rig;
  ContextCacheCoordinator& coordinator = rig.coordinator();
  Handle handle = rig.admit({tokenRun(20, 100), tokenRun(5, 300)});
  EXPECT_THROW(coordinator.enqueuePrefillCaptures(handle), Error);  // before preparePrefill
  coordinator.preparePrefill(handle);
  EXPECT_NO_THROW(coordinator.enqueuePrefillCaptures(handle));
  std::vector<ContextCacheSequenceAdvance> const prefill{{&kToken, 1, 20}, {&kToken, 1, 5}};
  ASSERT_EQ(coordinator.finalizePrefillPublication(handle, prefill), ContextCacheStatus::kOk);
  ASSERT_EQ(coordinator.prepareDecodeStep(handle, kVanilla), ContextCacheStatus::kOk);
  EXPECT_THROW(coordinator.enqueuePrefillCaptures(handle), Error);  // decode step pending
  std::vector<ContextCacheSequenceAdvance> const step{{&kToken, 1, 21}, {&kToken, 1, 6}};
  ASSERT_EQ(coordinator.completeDecodeStep(handle, step, {}), ContextCacheStatus::kOk);
  Tensor mapping({3}, DataType::kInt32, DeviceType::kCPU);
  coordinator.beginBatchCompaction(handle, std::vector<int32_t>{0, -1}, 1, mapping);
  EXPECT_THROW(coordinator.enqueuePrefillCaptures(handle), Error);  // compaction pending
  EXPECT_EQ(coordinator.compactBatch(handle), ContextCacheStatus::kOk);
  EXPECT_EQ(coordinator.finish(handle), ContextCacheStatus::kOk);
}

/// Found by the fuzzer (by reading its model): retracting the newest never-finalised joiner
/// while a decode step was pending released its lease, so its pages could be handed to another
/// request while the step's kernels might still read its row. Now refused (false, poisoned),
/// and the pages stay pinned until the request ends.
TEST(ContextCacheCoordinatorRegressionTest, RetractDuringADecodeStepReturnsFalseAndKeepsThePages) {
  Rig rig;
  ContextCacheCoordinator& coordinator = rig.coordinator();
  Handle handle = rig.admit({tokenRun(20, 100)});
  coordinator.preparePrefill(handle);
  std::vector<ContextCacheSequenceAdvance> const prefill{{&kToken, 1, 20}};
  ASSERT_EQ(coordinator.finalizePrefillPublication(handle, prefill), ContextCacheStatus::kOk);
  ContextCacheSequenceAdmission joiner;
  joiner.tokenIds = tokenRun(30, 500);
  joiner.resident = *rig.runtime->residentSlots().acquire();
  ASSERT_EQ(coordinator.admitSequence(handle, joiner, kVanilla).status, ContextCacheStatus::kOk);
  ASSERT_EQ(coordinator.prepareDecodeStep(handle, kVanilla), ContextCacheStatus::kOk);
  std::vector<PageId> const pages(coordinator.basePages(handle, 1).begin(),
                                  coordinator.basePages(handle, 1).end());
  ASSERT_FALSE(pages.empty());
  EXPECT_FALSE(coordinator.retractSequenceAdmission(handle))
      << "retracting during a decode step has nothing to undo";
  EXPECT_FALSE(coordinator.poisoned()) << "nothing to undo returns false; it does not poison";
  ASSERT_EQ(coordinator.batchSize(handle), 2);
  ResourcePools const& pools = coordinator.manager().pools();
  for (PageId page : pages) {
    EXPECT_EQ(pools.activeRefs({ResourceType::kBaseKvPage, page}), 1) << "page " << page;
  }
  EXPECT_EQ(rig.table().entry(joiner.resident.slot, 0), pages.front());
  // The step completes (the joiner holds), then the retraction is possible.
  std::vector<ContextCacheSequenceAdvance> const step{{&kToken, 1, 21},
                                                      {nullptr, 0, kHoldCommittedStateLength}};
  ASSERT_EQ(coordinator.completeDecodeStep(handle, step, {}), ContextCacheStatus::kOk);
  EXPECT_TRUE(coordinator.retractSequenceAdmission(handle));
  EXPECT_EQ(coordinator.batchSize(handle), 1);
  EXPECT_EQ(rig.table().liveEntryCount(joiner.resident.slot), 0);
  EXPECT_EQ(coordinator.finish(handle), ContextCacheStatus::kOk);
  EXPECT_EQ(coordinator.shutdown(), ContextCacheStatus::kOk);
  EXPECT_FALSE(coordinator.poisoned());
}

/// Found by the fuzzer: a joiner is finalised with its lookahead token (committed == prompt),
/// but a kFullyCommitted request requires ledger == committed at every decode step, so the
/// joiner's first decode advance was always rejected and the request could not go on. In-flight
/// admission into such a request is now a contract violation.
TEST(ContextCacheCoordinatorRegressionTest, InFlightAdmissionIntoAFullyCommittedRequestThrows) {
  Rig rig;
  ContextCacheCoordinator& coordinator = rig.coordinator();
  Handle handle = rig.admit({tokenRun(20, 100)}, DecodingTokenStateContract::kFullyCommitted);
  coordinator.preparePrefill(handle);
  std::vector<ContextCacheSequenceAdvance> const prefill{{nullptr, 0, 20}};
  ASSERT_EQ(coordinator.finalizePrefillPublication(handle, prefill), ContextCacheStatus::kOk);
  ContextCacheSequenceAdmission joiner;
  joiner.tokenIds = tokenRun(10, 500);
  joiner.resident = *rig.runtime->residentSlots().acquire();
  int32_t const freeBefore = coordinator.manager().pools().freeCount(ResourceType::kBaseKvPage);
  EXPECT_THROW((void)coordinator.admitSequence(handle, joiner, kVanilla), Error);
  EXPECT_EQ(coordinator.batchSize(handle), 1);
  EXPECT_EQ(coordinator.manager().pools().freeCount(ResourceType::kBaseKvPage), freeBefore);
  EXPECT_EQ(rig.table().liveEntryCount(joiner.resident.slot), 0);
  EXPECT_EQ(coordinator.finish(handle), ContextCacheStatus::kOk);
}

/// Found by the fuzzer: when a later row of the batch passed the row width, prepareDecodeStep
/// returned kRequestFailed without uploading the pages it had already grown for earlier rows,
/// leaving the page table dirty (device mirror behind the host).
TEST(ContextCacheCoordinatorRegressionTest, GrowthRefusedAtTheRowWidthUploadsEarlierGrowth) {
  Rig rig(/*pagesPerRow=*/2);
  ContextCacheCoordinator& coordinator = rig.coordinator();
  Handle handle = rig.admit({tokenRun(15, 100), tokenRun(31, 300)});
  coordinator.preparePrefill(handle);
  std::vector<ContextCacheSequenceAdvance> const prefill{{&kToken, 1, 15}, {&kToken, 1, 31}};
  ASSERT_EQ(coordinator.finalizePrefillPublication(handle, prefill), ContextCacheStatus::kOk);
  ASSERT_EQ(coordinator.prepareDecodeStep(handle, kVanilla), ContextCacheStatus::kOk);
  std::vector<ContextCacheSequenceAdvance> const step{{&kToken, 1, 16}, {&kToken, 1, 32}};
  ASSERT_EQ(coordinator.completeDecodeStep(handle, step, {}), ContextCacheStatus::kOk);
  // Row 0 needs a second page for position 16; row 1 would need a third page: refused.
  EXPECT_EQ(coordinator.prepareDecodeStep(handle, kVanilla), ContextCacheStatus::kRequestFailed);
  EXPECT_EQ(coordinator.basePages(handle, 0).size(), 2u);
  EXPECT_FALSE(rig.table().dirty());
  EXPECT_EQ(rig.staleEntries(0), 0);
  EXPECT_EQ(coordinator.finish(handle), ContextCacheStatus::kOk);
}

}  // namespace
}  // namespace mkv
