/// BoundedSwaKVPageManager: budget, admission, window mapping, decode rotation, compaction and
/// the request-handle lifecycle (docs/architecture.md, "Bounded SWA"). Faults:
/// bounded_swa_kv_page_manager_fault_test.cpp; random operation sequences with the KV oracle:
/// bounded_swa_kv_page_manager_property_test.cpp.

#include "mkv/bounded_swa_kv_page_manager.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "swa/swa_test_rig.h"

namespace mkv::swa_test {
namespace {

// ------------------------------------------------------------------------------------ budget

TEST(BoundedSwaBudgetTest, WindowAdmissionAndDecodeBudgets) {
  struct Case {
    int32_t window, pageSize, windowPages;
  };
  // M = ceil(W / P) + 1, admission 2M + 1, decode M + 1.
  for (Case const c : {Case{1024, 128, 9}, Case{129, 128, 3}, Case{128, 128, 2}, Case{127, 128, 2},
                       Case{64, 128, 2}, Case{256, 128, 3}, Case{1, 16, 2}, Case{16, 16, 2},
                       Case{17, 16, 3}, Case{4096, 1024, 5}}) {
    SCOPED_TRACE(::testing::Message() << "W " << c.window << " P " << c.pageSize);
    EXPECT_EQ(BoundedSwaKVPageManager::windowPages(c.window, c.pageSize), c.windowPages);
    EXPECT_EQ(BoundedSwaKVPageManager::admissionPagesPerSequence(c.window, c.pageSize),
              2 * c.windowPages + 1);
    EXPECT_EQ(BoundedSwaKVPageManager::decodePagesPerSequence(c.window, c.pageSize),
              c.windowPages + 1);
  }
  // The worked example of the issue.
  EXPECT_EQ(BoundedSwaKVPageManager::windowPages(1024, 128), 9);
  EXPECT_EQ(BoundedSwaKVPageManager::admissionPagesPerSequence(1024, 128), 19);
  EXPECT_EQ(BoundedSwaKVPageManager::decodePagesPerSequence(1024, 128), 10);
}

TEST(BoundedSwaBudgetTest, RejectsNonPositiveWindowOrPageSize) {
  expectContractError([] { (void)BoundedSwaKVPageManager::windowPages(0, 128); },
                      {"windowPages", "window 0"});
  expectContractError([] { (void)BoundedSwaKVPageManager::windowPages(64, -16); },
                      {"windowPages", "page size -16"});
}

TEST(BoundedSwaConstructionTest, RejectsInconsistentResources) {
  KVCachePoolConfig poolConfig;
  poolConfig.numLayers = 1;
  poolConfig.numKVHeads = 1;
  poolConfig.headDim = 4;
  poolConfig.tokensPerPage = 16;
  poolConfig.numPages = 7;  // W = 20: M = 3, admission 7
  poolConfig.maxBatchSize = 2;
  poolConfig.deviceType = DeviceType::kCPU;
  KVCachePool pool(poolConfig);
  KVPageTable sparse(2, 8, 7, PageTableMode::kSparseWindow, DeviceType::kCPU);
  KVPageTable dense(2, 8, 7, PageTableMode::kDense, DeviceType::kCPU);
  KVPageTable wrongPages(2, 8, 6, PageTableMode::kSparseWindow, DeviceType::kCPU);
  auto make = [&](int32_t window, KVPageTable* table) {
    BoundedSwaResources resources;
    resources.swaPool = &pool;
    resources.swaPageTable = table;
    BoundedSwaKVPageManager manager(BoundedSwaConfig{window}, resources, nullptr);
  };
  make(20, &sparse);  // consistent
  expectContractError([&] { make(0, &sparse); }, {"BoundedSwaKVPageManager", "got 0"});
  expectContractError([&] { make(20, &dense); }, {"BoundedSwaKVPageManager", "sparse-window"});
  expectContractError([&] { make(20, &wrongPages); }, {"BoundedSwaKVPageManager", "6 pages"});
  // W = 40: M = 4, admission 9 > 7 pages.
  expectContractError([&] { make(40, &sparse); }, {"BoundedSwaKVPageManager", "= 9"});
  expectContractError([&] { make(20, nullptr); }, {"BoundedSwaKVPageManager", "required"});
}

// ------------------------------------------------------------------------------- admission

class BoundedSwaAdmissionTest : public DeviceTest {};

TEST_P(BoundedSwaAdmissionTest, LongPromptHolds2MPlus1PagesThenMPlus1AfterCompletePrefill) {
  RigConfig config = rigConfig();
  config.window = 1024;
  config.pageSize = 128;
  config.maxBatch = 3;
  config.maxPagesPerSeq = 64;
  SwaRig rig(config);  // 3 * 19 = 57 pages
  BoundedSwaKVPageManager& manager = rig.manager();
  ASSERT_EQ(manager.totalPageCount(), 57);
  EXPECT_EQ(manager.privatePagesPerSequence(), 19);
  EXPECT_EQ(manager.decodePagesPerSequence(), 10);

  Handle handle = admit(rig, {0, 1, 2});
  ASSERT_TRUE(handle.valid());
  EXPECT_EQ(manager.freePageCount(), 0);
  for (int32_t row = 0; row < 3; ++row) {
    EXPECT_EQ(manager.state(handle, row).heldPages(), 19);
    EXPECT_EQ(manager.state(handle, row).reservedPages.size(), 19u);
  }
  std::vector<int32_t> const lengths{5000, 3000, 100};
  manager.preparePrefill(handle, lengths);
  // 5000: [floor(3976/128), ceil(5000/128)) = [31, 40); 3000: [15, 24); 100: [0, 1).
  std::vector<std::pair<int32_t, int32_t>> const ranges{{31, 40}, {15, 24}, {0, 1}};
  for (int32_t row = 0; row < 3; ++row) {
    SwaSequenceState const& state = manager.state(handle, row);
    auto const r = static_cast<std::size_t>(row);
    EXPECT_EQ(state.heldPages(), 19) << "row " << row;
    EXPECT_EQ(state.retainedBegin, ranges[r].first);
    EXPECT_EQ(state.retainedEnd, ranges[r].second);
    EXPECT_EQ(static_cast<int32_t>(state.bindings.size()), ranges[r].second - ranges[r].first);
  }
  EXPECT_EQ(manager.freePageCount(), 0);
  expectPagesAccountedFor(manager, {&handle});

  manager.completePrefill(handle);
  for (int32_t row = 0; row < 3; ++row) {
    SwaSequenceState const& state = manager.state(handle, row);
    auto const r = static_cast<std::size_t>(row);
    EXPECT_EQ(state.heldPages(), 10) << "row " << row;
    EXPECT_EQ(static_cast<int32_t>(state.reservedPages.size()),
              10 - (ranges[r].second - ranges[r].first));
    EXPECT_EQ(state.endpoint, lengths[r]);
  }
  EXPECT_EQ(manager.freePageCount(), 57 - 3 * 10);
  expectPagesAccountedFor(manager, {&handle});
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 57);
}

TEST_P(BoundedSwaAdmissionTest, AdmissionIsAtomicAndIndependentOfPromptLength) {
  RigConfig config = rigConfig();
  config.maxBatch = 4;
  config.numPages = 3 * 7;  // W = 129, P = 128: 2M + 1 = 7
  config.maxPagesPerSeq = 16;
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();

  // The same reservation whatever the prompt will be: 1 token or the whole table width.
  for (int32_t length : {1, 129, 16 * 128}) {
    SCOPED_TRACE(::testing::Message() << "length " << length);
    Handle handle = admit(rig, {0, 1, 2});
    ASSERT_TRUE(handle.valid());
    EXPECT_EQ(manager.freePageCount(), 0);
    // All pages are taken: one more resident is refused and nothing changes.
    auto const refused = manager.beginRequest(residentsFor({3}), SwaRig::stream());
    EXPECT_EQ(refused.status, SwaKVCacheStatus::kRequestFailed);
    EXPECT_FALSE(refused.request.has_value());
    EXPECT_EQ(manager.activeRequestCount(), 1);
    EXPECT_EQ(hostRow(rig.table(), 3), emptyRow(rig.table()));
    std::vector<int32_t> const lengths(3, length);
    manager.preparePrefill(handle, lengths);
    EXPECT_EQ(manager.freePageCount(), 0);
    manager.completePrefill(handle);
    // After completePrefill every sequence keeps M + 1 = 4 pages: 3 * 3 pages come back,
    // enough for a concurrent admission of one more resident (7 pages).
    EXPECT_EQ(manager.freePageCount(), 9);
    Handle second = admit(rig, {3});
    ASSERT_TRUE(second.valid());
    EXPECT_EQ(manager.freePageCount(), 2);
    EXPECT_EQ(manager.activeRequestCount(), 2);
    expectPagesAccountedFor(manager, {&handle, &second});
    EXPECT_EQ(manager.finish(second), SwaKVCacheStatus::kOk);
    EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
    EXPECT_EQ(manager.freePageCount(), 21);
  }
}

TEST_P(BoundedSwaAdmissionTest, RefusedAdmissionChangesNothing) {
  RigConfig config = rigConfig();
  config.numPages = 20;  // 3 * 7 = 21 needed for the full batch
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  int64_t const uploadsBefore = rig.table().totalUploadStats().entries;
  auto const refused = manager.beginRequest(residentsFor({0, 1, 2}), SwaRig::stream());
  EXPECT_EQ(refused.status, SwaKVCacheStatus::kRequestFailed);
  EXPECT_FALSE(refused.request.has_value());
  EXPECT_EQ(manager.freePageCount(), 20);
  EXPECT_EQ(manager.activeRequestCount(), 0);
  EXPECT_FALSE(manager.poisoned());
  EXPECT_EQ(rig.table().totalUploadStats().entries, uploadsBefore);
  for (CacheSlot slot = 0; slot < 3; ++slot) {
    EXPECT_EQ(hostRow(rig.table(), slot), emptyRow(rig.table()));
  }
  // The refused residents are not marked busy: a batch that fits admits them.
  Handle handle = admit(rig, {1, 2});
  ASSERT_TRUE(handle.valid());
  EXPECT_EQ(manager.freePageCount(), 6);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 20);
}

TEST_P(BoundedSwaAdmissionTest, InvalidAdmissionThrowsNamingTheValueAndChangesNothing) {
  SwaRig rig(rigConfig());  // maxBatch 3, 21 pages
  BoundedSwaKVPageManager& manager = rig.manager();
  auto begin = [&](std::vector<ResidentRef> const& refs, cudaStream_t stream = SwaRig::stream()) {
    return [&manager, refs, stream] { (void)manager.beginRequest(refs, stream); };
  };
  std::string const call = "BoundedSwaKVPageManager::beginRequest";
  expectContractError(begin(residentsFor({0, 1, 2, 0})), {call, "batch of 4", "[1, 3]"});
  expectContractError(begin({}), {call, "batch of 0"});
  expectContractError(begin(residentsFor({0, 3})), {call, "slot 3", "[0, 3)"});
  expectContractError(begin(residentsFor({-1})), {call, "slot -1"});
  expectContractError(begin({ResidentRef{0, 1}, ResidentRef{2, 0}}),
                      {call, "resident 1", "slot 2", "epoch 0"});
  expectContractError(begin(residentsFor({1, 2, 1})), {call, "slot 1", "twice"});
  // A stream that is not the rig's (never used: the admission refuses it).
  auto* const foreign = reinterpret_cast<cudaStream_t>(  // NOLINT(performance-no-int-to-ptr)
      uintptr_t{0x1234});
  expectContractError(begin(residentsFor({0}), foreign), {call, "stream", "0x1234"});
  EXPECT_EQ(manager.freePageCount(), 21);
  EXPECT_EQ(manager.activeRequestCount(), 0);
  EXPECT_EQ(rig.table().totalUploadStats().entries, 0);
  // Nothing was left half-admitted: the full batch still fits.
  Handle handle = admit(rig, {0, 1, 2});
  EXPECT_TRUE(handle.valid());
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
}

TEST_P(BoundedSwaAdmissionTest, ResidentHeldByAnotherActiveRequestIsRejected) {
  RigConfig config = rigConfig();
  config.numPages = 3 * 7;
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle first = admit(rig, {1});
  ASSERT_TRUE(first.valid());
  manager.preparePrefill(first, std::vector<int32_t>{300});
  std::vector<int32_t> const rowBefore = hostRow(rig.table(), 1);
  expectContractError(
      [&] {
        (void)manager.beginRequest(residentsFor({0, 1}), SwaRig::stream());
      },
      {"beginRequest", "slot 1", "another active request"});
  EXPECT_EQ(manager.freePageCount(), 14);
  EXPECT_EQ(manager.activeRequestCount(), 1);
  EXPECT_EQ(hostRow(rig.table(), 1), rowBefore);
  // Once the holder finished, the slot is free again.
  manager.completePrefill(first);
  EXPECT_EQ(manager.finish(first), SwaKVCacheStatus::kOk);
  Handle second = admit(rig, {0, 1});
  EXPECT_TRUE(second.valid());
  EXPECT_EQ(manager.finish(second), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 21);
}

TEST_P(BoundedSwaAdmissionTest, SeveralRequestsAreActiveEachWithItsOwnResidents) {
  RigConfig config = rigConfig();
  config.window = 40;
  config.pageSize = 16;  // M = 4, admission 9, decode 5
  config.maxBatch = 4;
  config.maxPagesPerSeq = 64;
  config.withLengthPools = false;  // one KV-length tensor cannot follow three batches
  SwaRig rig(config);              // 36 pages
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle a = admit(rig, {0});
  Handle b = admit(rig, {1, 2});
  Handle c = admit(rig, {3});
  ASSERT_TRUE(a.valid() && b.valid() && c.valid());
  EXPECT_EQ(manager.activeRequestCount(), 3);
  EXPECT_EQ(manager.freePageCount(), 0);
  EXPECT_EQ(manager.state(b, 0).resident.slot, 1);
  EXPECT_EQ(manager.state(b, 1).resident.slot, 2);
  EXPECT_EQ(manager.batchSize(b), 2);

  std::vector<EngineSequence> sequences;
  sequences.reserve(4);
  for (CacheSlot slot = 0; slot < 4; ++slot) {
    sequences.emplace_back(slot, 100 + static_cast<uint64_t>(slot));
  }
  // Interleaved lifecycles: a prefills while b and c are only admitted, and so on.
  manager.preparePrefill(a, std::vector<int32_t>{70});
  sequences[0].prefill(rig.oracle(), 70, config.window);
  manager.preparePrefill(b, std::vector<int32_t>{33, 120});
  sequences[1].prefill(rig.oracle(), 33, config.window);
  sequences[2].prefill(rig.oracle(), 120, config.window);
  manager.completePrefill(a);
  manager.preparePrefill(c, std::vector<int32_t>{5});
  sequences[3].prefill(rig.oracle(), 5, config.window);
  manager.completePrefill(c);
  manager.completePrefill(b);
  EXPECT_EQ(manager.freePageCount(), 36 - 4 * 5);
  for (int32_t step = 0; step < 3 * config.window; ++step) {
    for (Handle* handle : {&a, &b, &c}) {
      ASSERT_EQ(manager.prepareDecodeStep(*handle), SwaKVCacheStatus::kOk);
    }
    for (EngineSequence& sequence : sequences) {
      sequence.decode(rig.oracle());
    }
    for (Handle* handle : {&c, &a, &b}) {
      manager.completeDecodeStep(*handle);
    }
    for (EngineSequence const& sequence : sequences) {
      auto const report = sequence.verifyWindow(rig.oracle(), config.window);
      ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.firstMismatch;
    }
    expectPagesAccountedFor(manager, {&a, &b, &c});
  }
  // Each request's rows carry only its own pages (checked disjoint above) at its own slots.
  EXPECT_EQ(manager.state(a, 0).resident.slot, 0);
  EXPECT_EQ(manager.state(c, 0).resident.slot, 3);
  EXPECT_EQ(manager.finish(b), SwaKVCacheStatus::kOk);
  EXPECT_EQ(hostRow(rig.table(), 1), emptyRow(rig.table()));
  EXPECT_EQ(hostRow(rig.table(), 2), emptyRow(rig.table()));
  EXPECT_NE(hostRow(rig.table(), 0), emptyRow(rig.table()));
  EXPECT_EQ(manager.freePageCount(), 36 - 2 * 5);
  EXPECT_EQ(manager.finish(a), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.finish(c), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 36);
}

TEST_P(BoundedSwaAdmissionTest, LengthPoolsFollowOneRequestAtATime) {
  RigConfig config = rigConfig();
  config.maxBatch = 3;
  SwaRig rig(config);  // W = 129, P = 128: 21 pages; the SWA and the full pool track lengths
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle a = admit(rig, {0, 1});
  manager.preparePrefill(a, std::vector<int32_t>{300, 400});
  manager.completePrefill(a);
  std::vector<int32_t> const lengthsA{300, 400};
  for (KVCachePool* pool : {&rig.pool(), rig.fullPool()}) {
    pool->writeLengths(0, lengthsA, SwaRig::stream());
  }
  Handle b = admit(rig, {2});
  ASSERT_TRUE(b.valid());
  // b's prefill would reset the KV-length tensors a's kernels read: a contract violation,
  // refused before anything changes.
  expectContractError([&] { manager.preparePrefill(b, std::vector<int32_t>{50}); },
                      {"preparePrefill", "length", "request"});
  EXPECT_EQ(hostRow(rig.table(), 2), emptyRow(rig.table()));
  EXPECT_FALSE(manager.state(b, 0).pendingEndpoint.has_value());
  for (KVCachePool* pool : {&rig.pool(), rig.fullPool()}) {
    EXPECT_EQ(pool->activeBatchSize(), 2);
    EXPECT_EQ(readInt32(pool->kvLengths()), lengthsA);
  }
  // a's compaction still sees its own lengths.
  manager.beginBatchCompaction(a, std::vector<int32_t>{-1, 0}, 1, rig.mapping());
  ASSERT_EQ(manager.compactBatch(a), SwaKVCacheStatus::kOk);
  EXPECT_EQ(readInt32(rig.pool().kvLengths()), (std::vector<int32_t>{400}));
  EXPECT_EQ(manager.finish(a), SwaKVCacheStatus::kOk);
  // Once a is gone, b owns the length tensors.
  manager.preparePrefill(b, std::vector<int32_t>{50});
  EXPECT_EQ(readInt32(rig.pool().kvLengths()), (std::vector<int32_t>{0}));
  manager.completePrefill(b);
  EXPECT_EQ(manager.finish(b), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 21);
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaAdmissionTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

// ---------------------------------------------------------------------------------- prefill

class BoundedSwaPrefillTest : public DeviceTest {};

TEST_P(BoundedSwaPrefillTest, MapsOnlyTheAbsoluteRetainedRangeAcrossGeometries) {
  int32_t cases = 0;
  for (int32_t const pageSize : {16, 128}) {
    for (int32_t const window : {64, 128, 256, 129, 1024}) {
      std::set<int32_t> lengths{1,
                                pageSize - 1,
                                pageSize,
                                pageSize + 1,
                                window - 1,
                                window,
                                window + 1,
                                3 * pageSize + 1,
                                2 * window + pageSize / 2};
      for (int32_t const length : lengths) {
        SCOPED_TRACE(::testing::Message()
                     << "W " << window << " P " << pageSize << " L " << length);
        RigConfig config = rigConfig();
        config.window = window;
        config.pageSize = pageSize;
        config.maxBatch = 2;
        config.maxPagesPerSeq = retainedEnd(2 * window + pageSize, pageSize) + 2;
        SwaRig rig(config);
        BoundedSwaKVPageManager& manager = rig.manager();
        KVPageTable& table = rig.table();
        Handle handle = admit(rig, {1});
        ASSERT_TRUE(handle.valid());
        PageTableUploadStats const before = table.totalUploadStats();
        manager.preparePrefill(handle, std::vector<int32_t>{length});
        ++cases;

        int32_t const begin = retainedBegin(length, window, pageSize);
        int32_t const end = retainedEnd(length, pageSize);
        SwaSequenceState const& state = manager.state(handle, 0);
        // Staged: the endpoint is still 0, the prefill length is pending, the range is the
        // pending endpoint's.
        EXPECT_EQ(state.endpoint, 0);
        ASSERT_TRUE(state.pendingEndpoint.has_value());
        EXPECT_EQ(*state.pendingEndpoint, length);
        EXPECT_EQ(state.retainedBegin, begin);
        EXPECT_EQ(state.retainedEnd, end);
        ASSERT_EQ(static_cast<int32_t>(state.bindings.size()), end - begin);
        for (int32_t i = 0; i < end - begin; ++i) {
          EXPECT_EQ(state.bindings[static_cast<std::size_t>(i)].logicalPage, begin + i);
        }
        EXPECT_EQ(std::vector<SwaPageBinding>(state.bindings.begin(), state.bindings.end()),
                  state.newBindings);
        EXPECT_TRUE(state.pendingRetire.empty());
        std::vector<int32_t> const expected = expectedRow(table, state.bindings);
        EXPECT_EQ(hostRow(table, 1), expected);
        EXPECT_EQ(deviceRow(table, 1), expected);
        EXPECT_EQ(deviceRow(table, 0), emptyRow(table));
        EXPECT_EQ(table.liveEntryCount(1), end - begin);
        std::string error;
        EXPECT_TRUE(table.checkInvariants(&error)) << error;
        // The first upload touches exactly the mapped K and V entries, in two runs.
        PageTableUploadStats const after = table.totalUploadStats();
        EXPECT_EQ(after.entries - before.entries, 2 * (end - begin));
        EXPECT_EQ(after.ranges - before.ranges, 2);
        EXPECT_EQ(manager.freePageCount(), manager.totalPageCount() - (2 * rig.M() + 1));

        manager.completePrefill(handle);
        EXPECT_EQ(state.endpoint, length);
        EXPECT_FALSE(state.pendingEndpoint.has_value());
        EXPECT_TRUE(state.newBindings.empty());
        EXPECT_EQ(state.heldPages(), rig.M() + 1);
        EXPECT_EQ(hostRow(table, 1), expected);
        EXPECT_EQ(manager.freePageCount(), manager.totalPageCount() - (rig.M() + 1));
        EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
        EXPECT_EQ(hostRow(table, 1), emptyRow(table));
        EXPECT_EQ(deviceRow(table, 1), emptyRow(table));
        EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
      }
    }
  }
  EXPECT_GT(cases, 70);
}

TEST_P(BoundedSwaPrefillTest, PrefillContractViolationsThrowAndChangeNothing) {
  RigConfig config = rigConfig();
  config.maxPagesPerSeq = 8;  // at most 1024 tokens
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 2});
  ASSERT_TRUE(handle.valid());
  std::string const prepare = "BoundedSwaKVPageManager::preparePrefill";
  expectContractError([&] { manager.preparePrefill(handle, std::vector<int32_t>{10}); },
                      {prepare, "1 lengths for a batch of 2"});
  expectContractError(
      [&] {
        manager.preparePrefill(handle, std::vector<int32_t>{10, 0});
      },
      {prepare, "length 0 of row 1"});
  expectContractError(
      [&] {
        manager.preparePrefill(handle, std::vector<int32_t>{1025, 10});
      },
      {prepare, "length 1025 of row 0", "1024"});
  expectContractError([&] { manager.completePrefill(handle); }, {"completePrefill"});
  expectContractError([&] { (void)manager.prepareDecodeStep(handle); }, {"prepareDecodeStep"});
  expectContractError([&] { manager.completeDecodeStep(handle); }, {"completeDecodeStep"});
  EXPECT_EQ(manager.state(handle, 0).heldPages(), 7);
  EXPECT_FALSE(manager.state(handle, 0).pendingEndpoint.has_value());
  EXPECT_EQ(hostRow(rig.table(), 0), emptyRow(rig.table()));
  EXPECT_EQ(hostRow(rig.table(), 2), emptyRow(rig.table()));

  manager.preparePrefill(handle, std::vector<int32_t>{1024, 1});
  expectContractError(
      [&] {
        manager.preparePrefill(handle, std::vector<int32_t>{5, 5});
      },
      {prepare});
  // A staged prefill is not a decode step: completing it as one would skip the trim to M + 1.
  expectContractError([&] { manager.completeDecodeStep(handle); }, {"completeDecodeStep"});
  EXPECT_EQ(manager.state(handle, 0).endpoint, 0);
  EXPECT_EQ(manager.state(handle, 0).heldPages(), 7);
  manager.completePrefill(handle);
  EXPECT_EQ(manager.state(handle, 0).heldPages(), 4);
  EXPECT_EQ(manager.state(handle, 1).heldPages(), 4);
  expectContractError([&] { manager.completePrefill(handle); }, {"completePrefill"});
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kRequestFailed);  // 1025 > 1024
  expectPagesAccountedFor(manager, {&handle});
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 21);
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaPrefillTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

// ----------------------------------------------------------------------------------- decode

/// Drives decode steps of one request and checks every step against the window arithmetic:
/// exact new bindings and retirements, deferred retirement, page reuse order, patch sizes.
class DecodeChecker {
 public:
  DecodeChecker(SwaRig& rig, Handle& handle) : mRig(rig), mHandle(handle) {
    int32_t const batch = rig.manager().batchSize(handle);
    mLastRetired.assign(static_cast<std::size_t>(batch), std::nullopt);
  }

  void step() {
    BoundedSwaKVPageManager& manager = mRig.manager();
    KVPageTable& table = mRig.table();
    int32_t const window = mRig.config().window;
    int32_t const pageSize = mRig.config().pageSize;
    int32_t const batch = manager.batchSize(mHandle);
    PageTableUploadStats const before = table.totalUploadStats();
    ASSERT_EQ(manager.prepareDecodeStep(mHandle), SwaKVCacheStatus::kOk);
    PageTableUploadStats const after = table.totalUploadStats();

    int64_t expectedEntries = 0;
    std::set<PageId> pendingRetirePages;
    for (int32_t row = 0; row < batch; ++row) {
      for (auto const& binding : manager.state(mHandle, row).pendingRetire) {
        pendingRetirePages.insert(binding.page);
      }
    }
    for (int32_t row = 0; row < batch; ++row) {
      SwaSequenceState const& state = manager.state(mHandle, row);
      auto const r = static_cast<std::size_t>(row);
      int32_t const e = state.endpoint;
      ASSERT_TRUE(state.pendingEndpoint.has_value());
      ASSERT_EQ(*state.pendingEndpoint, e + 1);
      int32_t const mapped = retainedEnd(e + 1, pageSize) > retainedEnd(e, pageSize) ? 1 : 0;
      int32_t const retired =
          retainedBegin(e + 1, window, pageSize) > retainedBegin(e, window, pageSize) ? 1 : 0;
      ASSERT_EQ(static_cast<int32_t>(state.newBindings.size()), mapped) << "e " << e;
      ASSERT_EQ(static_cast<int32_t>(state.pendingRetire.size()), retired) << "e " << e;
      EXPECT_EQ(state.retainedBegin, retainedBegin(e + 1, window, pageSize));
      EXPECT_EQ(state.retainedEnd, retainedEnd(e + 1, pageSize));
      EXPECT_LE(static_cast<int32_t>(state.bindings.size()), mRig.M());
      EXPECT_LE(state.heldPages(), mRig.M() + 1);
      if (mapped == 1) {
        SwaPageBinding const binding = state.newBindings.front();
        EXPECT_EQ(binding.logicalPage, retainedEnd(e + 1, pageSize) - 1);
        EXPECT_EQ(pendingRetirePages.count(binding.page), 0u)
            << "page " << binding.page << " mapped while it is still pending retirement";
        if (mLastRetired[r].has_value()) {
          // The page retired first (since the last mapping) is the one reused.
          EXPECT_EQ(binding.page, *mLastRetired[r]) << "e " << e;
          ++mReusedRetired;
          mLastRetired[r].reset();
        }
        ++mMaps;
      }
      // Deferred retirement: a leaving page stays mapped until completeDecodeStep.
      for (auto const& binding : state.pendingRetire) {
        EXPECT_EQ(table.entry(state.resident.slot, binding.logicalPage), binding.page);
      }
      std::vector<int32_t> expected = expectedRow(table, state.bindings);
      for (auto const& binding : state.pendingRetire) {
        expected[static_cast<std::size_t>(binding.logicalPage)] = binding.page;
        expected[static_cast<std::size_t>(table.maxPagesPerSeq()) +
                 static_cast<std::size_t>(binding.logicalPage)] = binding.page + table.numPages();
      }
      EXPECT_EQ(hostRow(table, state.resident.slot), expected);
      EXPECT_EQ(deviceRow(table, state.resident.slot), expected);
      // This upload carries this step's mapping and the previous completion's clears.
      int64_t const sequenceEntries = 2 * mapped + 2 * (mRetiredLastStep[r] ? 1 : 0);
      mMaxEntries = std::max(mMaxEntries, sequenceEntries);
      expectedEntries += sequenceEntries;
    }
    int64_t const entries = after.entries - before.entries;
    int64_t const ranges = after.ranges - before.ranges;
    EXPECT_EQ(entries, expectedEntries);
    EXPECT_EQ(ranges, expectedEntries);  // K and V entries, never adjacent in these tables
    EXPECT_LE(entries, 4 * batch);
    if (window % pageSize != 0) {
      EXPECT_LE(entries, 2 * batch);
    }
    if (entries == 0) {
      ++mSilentSteps;
    }
    std::string error;
    ASSERT_TRUE(table.checkInvariants(&error)) << error;
    expectPagesAccountedFor(manager, {&mHandle});
  }

  void complete() {
    BoundedSwaKVPageManager& manager = mRig.manager();
    int32_t const batch = manager.batchSize(mHandle);
    std::vector<std::vector<SwaPageBinding>> retiring(static_cast<std::size_t>(batch));
    for (int32_t row = 0; row < batch; ++row) {
      retiring[static_cast<std::size_t>(row)] = manager.state(mHandle, row).pendingRetire;
    }
    manager.completeDecodeStep(mHandle);
    mRetiredLastStep.assign(static_cast<std::size_t>(batch), false);
    for (int32_t row = 0; row < batch; ++row) {
      SwaSequenceState const& state = manager.state(mHandle, row);
      auto const r = static_cast<std::size_t>(row);
      EXPECT_FALSE(state.pendingEndpoint.has_value());
      EXPECT_TRUE(state.pendingRetire.empty());
      EXPECT_TRUE(state.newBindings.empty());
      for (auto const& binding : retiring[r]) {
        EXPECT_EQ(mRig.table().entry(state.resident.slot, binding.logicalPage), kNoPage);
        EXPECT_EQ(state.reservedPages.back(), binding.page);
        mLastRetired[r] = binding.page;
        mRetiredLastStep[r] = true;
        ++mRetires;
      }
      EXPECT_EQ(state.heldPages(), mRig.M() + 1);
    }
  }

  int64_t maps() const { return mMaps; }
  int64_t retires() const { return mRetires; }
  int64_t reusedRetired() const { return mReusedRetired; }
  int64_t maxEntriesPerSequence() const { return mMaxEntries; }
  int64_t silentSteps() const { return mSilentSteps; }

 private:
  SwaRig& mRig;
  Handle& mHandle;
  std::vector<std::optional<PageId>> mLastRetired;
  std::vector<bool> mRetiredLastStep = std::vector<bool>(8, false);
  int64_t mMaps = 0;
  int64_t mRetires = 0;
  int64_t mReusedRetired = 0;
  int64_t mMaxEntries = 0;
  int64_t mSilentSteps = 0;
};

class BoundedSwaDecodeTest : public DeviceTest {};

TEST_P(BoundedSwaDecodeTest, RotationUsesConstantPatchesAndRecyclesRetiredPages) {
  struct Geometry {
    int32_t window, pageSize;
  };
  for (Geometry const g :
       {Geometry{129, 128}, Geometry{128, 128}, Geometry{256, 128}, Geometry{64, 128},
        Geometry{1024, 128}, Geometry{64, 16}, Geometry{16, 16}, Geometry{129, 16}}) {
    SCOPED_TRACE(::testing::Message() << "W " << g.window << " P " << g.pageSize);
    int32_t const steps = 4 * g.window + 3;
    std::vector<int32_t> const lengths{384, 384 + g.pageSize / 2 + 1};
    RigConfig config = rigConfig();
    config.window = g.window;
    config.pageSize = g.pageSize;
    config.maxBatch = 3;
    config.maxPagesPerSeq = retainedEnd(lengths[1] + steps, g.pageSize) + 2;
    SwaRig rig(config);
    BoundedSwaKVPageManager& manager = rig.manager();
    Handle handle = admit(rig, {0, 2});
    ASSERT_TRUE(handle.valid());
    manager.preparePrefill(handle, lengths);
    manager.completePrefill(handle);
    int32_t const freeInDecode = manager.freePageCount();
    EXPECT_EQ(freeInDecode, manager.totalPageCount() - 2 * (rig.M() + 1));
    DecodeChecker checker(rig, handle);
    for (int32_t s = 0; s < steps; ++s) {
      checker.step();
      if (::testing::Test::HasFailure()) {
        FAIL() << "step " << s;
      }
      checker.complete();
      // Memory is bounded: decode never takes pages from the free list.
      ASSERT_EQ(manager.freePageCount(), freeInDecode) << "step " << s;
    }
    for (int32_t row = 0; row < 2; ++row) {
      EXPECT_EQ(manager.state(handle, row).endpoint,
                lengths[static_cast<std::size_t>(row)] + steps);
    }
    // Exactly one map per page boundary the end crosses and one retirement per boundary the
    // begin crosses; every retirement but a sequence's last is followed by a map reusing it.
    int64_t maps = 0;
    int64_t retires = 0;
    for (int32_t const length : lengths) {
      maps += retainedEnd(length + steps, g.pageSize) - retainedEnd(length, g.pageSize);
      retires += retainedBegin(length + steps, g.window, g.pageSize) -
                 retainedBegin(length, g.window, g.pageSize);
    }
    EXPECT_GE(maps, 2 * (4 * g.window / g.pageSize));
    EXPECT_EQ(checker.maps(), maps);
    EXPECT_EQ(checker.retires(), retires);
    EXPECT_GT(retires, 0);
    EXPECT_GE(checker.reusedRetired(), retires - 2);
    EXPECT_GT(checker.silentSteps(), steps / 2);  // tokens inside a page touch no entry
    // Worst case per sequence: 4 entries (W % P == 0: a retirement's clear and the next
    // step's mapping share one upload), else 2.
    EXPECT_EQ(checker.maxEntriesPerSequence(), g.window % g.pageSize == 0 ? 4 : 2);
    EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
    EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
  }
}

TEST_P(BoundedSwaDecodeTest, LongDecodeRunKeepsTheWindowExactInBoundedMemory) {
  RigConfig config = rigConfig();
  config.window = 64;
  config.pageSize = 32;  // M = 3: 7 pages at admission, 4 in decode; 640 rotations
  config.maxBatch = 2;
  int32_t const steps = 20500;
  std::vector<int32_t> const lengths{100, 37};
  config.maxPagesPerSeq = retainedEnd(lengths[0] + steps, config.pageSize) + 1;
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 1});
  ASSERT_TRUE(handle.valid());
  std::vector<EngineSequence> sequences{EngineSequence(0, 11), EngineSequence(1, 12)};
  manager.preparePrefill(handle, lengths);
  for (std::size_t i = 0; i < 2; ++i) {
    sequences[i].prefill(rig.oracle(), lengths[i], config.window);
  }
  manager.completePrefill(handle);
  ASSERT_EQ(manager.totalPageCount(), 14);
  EXPECT_EQ(manager.freePageCount(), 14 - 2 * 4);
  DecodeChecker checker(rig, handle);
  int64_t checked = 0;
  for (int32_t s = 0; s < steps; ++s) {
    checker.step();
    if (::testing::Test::HasFailure()) {
      FAIL() << "step " << s;
    }
    for (EngineSequence& sequence : sequences) {
      sequence.decode(rig.oracle());
    }
    checker.complete();
    for (EngineSequence const& sequence : sequences) {
      auto const report = sequence.verifyWindow(rig.oracle(), config.window);
      checked += report.positionsChecked;
      ASSERT_TRUE(report.ok()) << "step " << s << ": " << report.firstMismatch;
    }
    ASSERT_EQ(manager.freePageCount(), 6);
  }
  // Every step checks min(W, e) positions of each sequence (37 + s + 1 < 64 early on).
  int64_t expectedChecked = 0;
  for (int32_t const length : lengths) {
    for (int32_t s = 0; s < steps; ++s) {
      expectedChecked += std::min(config.window, length + s + 1);
    }
  }
  EXPECT_EQ(checked, expectedChecked);
  EXPECT_EQ(expectedChecked, int64_t{2} * steps * config.window - (64 - 38 + 1) * (64 - 38) / 2);
  EXPECT_EQ(manager.state(handle, 0).endpoint, 100 + steps);
  // Begin pages crossed: 100 -> 20600 retires 641 - 1, 37 -> 20537 retires 639 - 0.
  EXPECT_EQ(checker.retires(), 640 + 639);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 14);
}

TEST_P(BoundedSwaDecodeTest, DecodePastTheTableWidthFailsThatRowAlone) {
  RigConfig config = rigConfig();
  config.window = 20;
  config.pageSize = 16;
  config.maxPagesPerSeq = 4;  // 64 tokens
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 1});
  ASSERT_TRUE(handle.valid());
  manager.preparePrefill(handle, std::vector<int32_t>{60, 10});
  manager.completePrefill(handle);
  for (int32_t s = 0; s < 4; ++s) {
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    manager.completeDecodeStep(handle);
  }
  std::vector<int32_t> const row0 = hostRow(rig.table(), 0);
  std::vector<int32_t> const row1 = hostRow(rig.table(), 1);
  // Row 0 reached 64 tokens; its next token needs logical page 4: the step fails, naming row 0,
  // and no sequence (not even row 1, which had room) staged anything. Asked again, the same.
  for (int attempt = 0; attempt < 2; ++attempt) {
    EXPECT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kRequestFailed);
    EXPECT_EQ(manager.lastFailure(handle), (RowFailure{RowFailureReason::kTableFull, 0}));
    EXPECT_EQ(manager.state(handle, 0).endpoint, 64);
    EXPECT_EQ(manager.state(handle, 1).endpoint, 14);
    EXPECT_FALSE(manager.state(handle, 1).pendingEndpoint.has_value());
    EXPECT_EQ(hostRow(rig.table(), 0), row0);
    EXPECT_EQ(hostRow(rig.table(), 1), row1);
  }
  expectPagesAccountedFor(manager, {&handle});
  // The request goes on: row 0 compacted away, row 1 decodes (before, the request was finishing).
  manager.beginBatchCompaction(handle, std::vector<int32_t>{-1, 0}, 1, rig.mapping());
  ASSERT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kOk);
  for (int32_t s = 0; s < 3; ++s) {
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    manager.completeDecodeStep(handle);
  }
  EXPECT_EQ(manager.state(handle, 0).endpoint, 17);
  expectPagesAccountedFor(manager, {&handle});
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaDecodeTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

// ------------------------------------------------------------------------------- compaction

class BoundedSwaCompactionTest : public DeviceTest {
 protected:
  static uint8_t pattern(int32_t buffer, int64_t row, int64_t byte) {
    return static_cast<uint8_t>(((int64_t{buffer} * 31 + row * 17 + byte) % 255) + 1);  // never 0
  }
  /// Fills every recurrent buffer with a non-zero pattern.
  static void fillRecurrent(RecurrentStatePool& pool) {
    int32_t index = 0;
    for (kernels::RowBuffer const& buffer : pool.rowBuffers()) {
      std::vector<uint8_t> bytes(static_cast<std::size_t>(buffer.rowBytes * buffer.numRows));
      for (int64_t row = 0; row < buffer.numRows; ++row) {
        for (int64_t b = 0; b < buffer.rowBytes; ++b) {
          bytes[static_cast<std::size_t>(row * buffer.rowBytes + b)] = pattern(index, row, b);
        }
      }
      writeBytes(buffer.data, pool.deviceType(), bytes);
      ++index;
    }
  }
  /// Expects each recurrent row to hold the pattern, or zeroes for the slots in `zeroed`.
  static void expectRecurrent(RecurrentStatePool const& pool, std::set<int64_t> const& zeroed) {
    int32_t index = 0;
    EXPECT_EQ(pool.rowBuffers().size(), 4u);  // 2 layers: state, conv, state, conv
    for (kernels::RowBuffer const& buffer : pool.rowBuffers()) {
      auto const bytes = readBytes(buffer.data, pool.deviceType(),
                                   static_cast<std::size_t>(buffer.rowBytes * buffer.numRows));
      for (int64_t row = 0; row < buffer.numRows; ++row) {
        for (int64_t b = 0; b < buffer.rowBytes; ++b) {
          uint8_t const expected = zeroed.contains(row) ? 0 : pattern(index, row, b);
          ASSERT_EQ(bytes[static_cast<std::size_t>(row * buffer.rowBytes + b)], expected)
              << "buffer " << index << " row " << row << " byte " << b;
        }
      }
      ++index;
    }
  }
};

TEST_P(BoundedSwaCompactionTest, KeepsSurvivorRowsAndReleasesTheDroppedResident) {
  RigConfig config = rigConfig();  // W = 129, P = 128, maxBatch 3, 21 pages
  SwaRig rig(config);
  BoundedSwaKVPageManager& manager = rig.manager();
  KVPageTable& table = rig.table();
  Handle handle = admit(rig, {0, 1, 2});
  ASSERT_TRUE(handle.valid());
  std::vector<int32_t> const lengths{384, 500, 700};
  std::vector<EngineSequence> sequences{EngineSequence(0, 1), EngineSequence(1, 2),
                                        EngineSequence(2, 3)};
  manager.preparePrefill(handle, lengths);
  for (std::size_t i = 0; i < 3; ++i) {
    sequences[i].prefill(rig.oracle(), lengths[i], config.window);
  }
  manager.completePrefill(handle);
  for (int32_t s = 0; s < 5; ++s) {
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    for (EngineSequence& sequence : sequences) {
      sequence.decode(rig.oracle());
    }
    manager.completeDecodeStep(handle);
  }
  fillRecurrent(*rig.recurrent());
  std::vector<int32_t> const lengthValues{10, 20, 30};
  for (KVCachePool* pool : {&rig.pool(), rig.fullPool()}) {
    pool->writeLengths(0, lengthValues, SwaRig::stream());
  }
  std::vector<int32_t> const host0 = hostRow(table, 0);
  std::vector<int32_t> const host2 = hostRow(table, 2);
  ASSERT_NE(hostRow(table, 1), emptyRow(table));
  ASSERT_EQ(deviceRow(table, 0), host0);
  ASSERT_EQ(deviceRow(table, 2), host2);
  EXPECT_EQ(manager.freePageCount(), 21 - 3 * 4);

  std::vector<int32_t> const oldToNew{0, -1, 1};
  manager.beginBatchCompaction(handle, oldToNew, 2, rig.mapping());
  EXPECT_EQ(rig.mapping().shape(), Coords({3}));
  EXPECT_EQ(readInt32(rig.mapping()), oldToNew);
  // Pages are released only after the compaction's synchronisation.
  EXPECT_EQ(manager.freePageCount(), 21 - 3 * 4);
  int64_t const syncsBefore = rig.faults().calls();
  ASSERT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(rig.faults().calls(), syncsBefore + 1);

  EXPECT_EQ(hostRow(table, 0), host0);
  EXPECT_EQ(hostRow(table, 2), host2);
  EXPECT_EQ(deviceRow(table, 0), host0);
  EXPECT_EQ(deviceRow(table, 2), host2);
  EXPECT_EQ(hostRow(table, 1), emptyRow(table));
  EXPECT_EQ(deviceRow(table, 1), emptyRow(table));
  expectRecurrent(*rig.recurrent(), {1});
  for (KVCachePool* pool : {&rig.pool(), rig.fullPool()}) {
    EXPECT_EQ(pool->activeBatchSize(), 2);
    EXPECT_EQ(readInt32(pool->kvLengths()), (std::vector<int32_t>{10, 30}));
  }
  EXPECT_EQ(manager.batchSize(handle), 2);
  EXPECT_EQ(manager.state(handle, 0).resident.slot, 0);
  EXPECT_EQ(manager.state(handle, 1).resident.slot, 2);
  EXPECT_EQ(manager.state(handle, 1).endpoint, 705);
  EXPECT_EQ(manager.freePageCount(), 21 - 2 * 4);
  expectPagesAccountedFor(manager, {&handle});

  // Survivors keep decoding with exact windows; the dropped resident's slot is free again.
  sequences.erase(sequences.begin() + 1);
  DecodeChecker checker(rig, handle);
  for (int32_t s = 0; s < 2 * config.window + config.pageSize; ++s) {
    checker.step();
    ASSERT_FALSE(::testing::Test::HasFatalFailure()) << "step " << s;
    for (EngineSequence& sequence : sequences) {
      sequence.decode(rig.oracle());
    }
    checker.complete();
    for (EngineSequence const& sequence : sequences) {
      auto const report = sequence.verifyWindow(rig.oracle(), config.window);
      ASSERT_TRUE(report.ok()) << "step " << s << ": " << report.firstMismatch;
    }
  }
  Handle other = admit(rig, {1});
  EXPECT_TRUE(other.valid());
  EXPECT_EQ(manager.finish(other), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), 21);
}

TEST_P(BoundedSwaCompactionTest, MalformedMappingsThrowAndChangeNothing) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 1, 2});
  ASSERT_TRUE(handle.valid());
  std::string const call = "BoundedSwaKVPageManager::beginBatchCompaction";
  std::vector<int32_t> const identity{0, 1, 2};
  expectContractError([&] { manager.beginBatchCompaction(handle, identity, 3, rig.mapping()); },
                      {call, "executing"});  // before prefill
  manager.preparePrefill(handle, std::vector<int32_t>{200, 300, 400});
  expectContractError([&] { manager.beginBatchCompaction(handle, identity, 3, rig.mapping()); },
                      {call, "pending"});
  manager.completePrefill(handle);

  std::vector<int32_t> const sentinel{77, 77, 77};
  writeInt32(rig.mapping(), sentinel);
  std::vector<std::vector<int32_t>> rows;
  rows.reserve(3);
  for (CacheSlot slot = 0; slot < 3; ++slot) {
    rows.push_back(hostRow(rig.table(), slot));
  }
  int32_t const freeBefore = manager.freePageCount();
  auto expectUnchanged = [&] {
    EXPECT_EQ(manager.batchSize(handle), 3);
    EXPECT_EQ(manager.freePageCount(), freeBefore);
    EXPECT_EQ(readInt32(rig.mapping()), sentinel);
    for (CacheSlot slot = 0; slot < 3; ++slot) {
      EXPECT_EQ(hostRow(rig.table(), slot), rows[static_cast<std::size_t>(slot)]);
    }
  };
  auto compaction = [&](std::vector<int32_t> const& mapping, int32_t newBatch, Tensor* tensor) {
    return [&manager, &handle, &rig, mapping, newBatch, tensor] {
      manager.beginBatchCompaction(handle, mapping, newBatch,
                                   tensor != nullptr ? *tensor : rig.mapping());
    };
  };
  expectContractError(compaction({1, 0, -1}, 2, nullptr),
                      {call, "not order-preserving", "oldToNew[0] = 1"});
  expectContractError(compaction({0, 0, -1}, 2, nullptr), {call, "oldToNew[1] = 0"});
  expectContractError(compaction({0, 1}, 2, nullptr), {call, "2 entries for a batch of 3"});
  expectContractError(compaction({0, -1, 2}, 2, nullptr), {call, "oldToNew[2] = 2"});
  expectContractError(compaction({0, -2, 1}, 2, nullptr), {call, "oldToNew[1] = -2"});
  expectContractError(compaction({0, -1, -1}, 2, nullptr), {call, "1 survivors", "of 2"});
  expectContractError(compaction({0, 1, 2}, 4, nullptr), {call, "new batch size 4"});
  expectContractError(compaction({-1, -1, -1}, -1, nullptr), {call, "new batch size -1"});
  Tensor wrongType({3}, DataType::kInt64, GetParam());
  expectContractError(compaction({0, -1, 1}, 2, &wrongType), {call, "int32"});
  Tensor tooSmall({2}, DataType::kInt32, GetParam());
  expectContractError(compaction({0, -1, 1}, 2, &tooSmall), {call, "8 bytes", "12"});
  expectContractError([&] { (void)manager.compactBatch(handle); },
                      {"compactBatch", "no batch compaction"});
  expectUnchanged();

  // Still fully usable: a decode step, then a valid compaction.
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
  manager.completeDecodeStep(handle);
  manager.beginBatchCompaction(handle, std::vector<int32_t>{-1, 0, 1}, 2, rig.mapping());
  EXPECT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.state(handle, 0).resident.slot, 1);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
}

TEST_P(BoundedSwaCompactionTest, DroppingEverySequenceFinishesTheRequest) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admit(rig, {0, 2});
  ASSERT_TRUE(handle.valid());
  manager.preparePrefill(handle, std::vector<int32_t>{129, 1000});
  manager.completePrefill(handle);
  fillRecurrent(*rig.recurrent());
  manager.beginBatchCompaction(handle, std::vector<int32_t>{-1, -1}, 0, rig.mapping());
  ASSERT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.batchSize(handle), 0);
  EXPECT_EQ(manager.freePageCount(), manager.totalPageCount());
  EXPECT_EQ(hostRow(rig.table(), 0), emptyRow(rig.table()));
  EXPECT_EQ(deviceRow(rig.table(), 2), emptyRow(rig.table()));
  expectRecurrent(*rig.recurrent(), {0, 2});
  EXPECT_EQ(rig.pool().activeBatchSize(), 0);
  expectContractError([&] { (void)manager.prepareDecodeStep(handle); }, {"prepareDecodeStep"});
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.activeRequestCount(), 0);
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaCompactionTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

// -------------------------------------------------------------------------------- lifecycle

class BoundedSwaHandleTest : public DeviceTest {};

TEST_P(BoundedSwaHandleTest, DroppingOrReplacingAHandleReturnsItsPages) {
  SwaRig rig(rigConfig());
  BoundedSwaKVPageManager& manager = rig.manager();
  {
    Handle admitted = admit(rig, {0, 1});
    EXPECT_EQ(manager.freePageCount(), 7);
  }  // dropped while merely admitted: nothing pending, so no synchronisation
  EXPECT_EQ(rig.faults().calls(), 0);
  EXPECT_EQ(manager.freePageCount(), 21);
  EXPECT_EQ(manager.activeRequestCount(), 0);
  {
    Handle prepared = admit(rig, {2});
    manager.preparePrefill(prepared, std::vector<int32_t>{300});
    EXPECT_NE(hostRow(rig.table(), 2), emptyRow(rig.table()));
  }  // dropped with a pending prefill: one synchronisation, rows cleared, pages back
  EXPECT_EQ(rig.faults().calls(), 1);
  EXPECT_EQ(manager.freePageCount(), 21);
  EXPECT_EQ(hostRow(rig.table(), 2), emptyRow(rig.table()));
  EXPECT_EQ(deviceRow(rig.table(), 2), emptyRow(rig.table()));

  Handle a = admit(rig, {0});
  Handle moved(std::move(a));
  EXPECT_FALSE(a.valid());  // NOLINT(bugprone-use-after-move): the moved-from state is the API
  EXPECT_TRUE(moved.valid());
  EXPECT_EQ(manager.finish(a), SwaKVCacheStatus::kOk);  // an invalid handle is a no-op
  EXPECT_EQ(manager.activeRequestCount(), 1);
  Handle b = admit(rig, {1});
  EXPECT_EQ(manager.freePageCount(), 7);
  moved = std::move(b);  // abandons the request `moved` held
  EXPECT_EQ(manager.activeRequestCount(), 1);
  EXPECT_EQ(manager.freePageCount(), 14);
  EXPECT_EQ(manager.state(moved, 0).resident.slot, 1);
  expectContractError([&] { (void)manager.state(moved, 1); }, {"state", "row 1"});
  // NOLINTNEXTLINE(bugprone-use-after-move): the moved-from handle is what is tested
  expectContractError([&] { (void)manager.state(b, 0); }, {"state", "invalid"});

  SwaRig otherRig(rigConfig());
  expectContractError([&] { otherRig.manager().completePrefill(moved); },
                      {"completePrefill", "another manager"});
  EXPECT_EQ(manager.finish(moved), SwaKVCacheStatus::kOk);
  EXPECT_FALSE(moved.valid());
  EXPECT_EQ(manager.freePageCount(), 21);
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaHandleTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

/// Destroys a manager while one of its requests is active (the handle outlives it).
void destroyTheManagerWithAnActiveRequest() {
  KVCachePoolConfig poolConfig;
  poolConfig.numLayers = 1;
  poolConfig.numKVHeads = 1;
  poolConfig.headDim = 4;
  poolConfig.tokensPerPage = 16;
  poolConfig.numPages = 8;
  poolConfig.maxBatchSize = 1;
  poolConfig.deviceType = DeviceType::kCPU;
  KVCachePool pool(poolConfig);
  KVPageTable table(1, 4, 8, PageTableMode::kSparseWindow, DeviceType::kCPU);
  BoundedSwaResources resources;
  resources.swaPool = &pool;
  resources.swaPageTable = &table;
  std::optional<BoundedSwaKVPageManager::RequestHandle> handle;
  BoundedSwaKVPageManager manager(BoundedSwaConfig{16}, resources, nullptr);
  ResidentRef const resident{0, 1};
  handle = std::move(manager.beginRequest(std::span(&resident, 1), nullptr).request);
}

TEST(BoundedSwaDeathTest, DestroyingTheManagerWithAnActiveRequestTerminates) {
  EXPECT_DEATH(destroyTheManagerWithAnActiveRequest(), "destroyed with 1 active");
}

}  // namespace
}  // namespace mkv::swa_test
