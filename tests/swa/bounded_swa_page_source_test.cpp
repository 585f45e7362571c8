/// BoundedSwaKVPageManager in cached mode (BoundedSwaResources::pageSource; docs/architecture.md,
/// "Sliding windows with context reuse"): admission at a reused start with held window pages,
/// all or nothing; prefill of every executed prompt position; retirement to the source in
/// prefill and decode; compaction, finish, abandonment, quarantine and shutdown releasing every
/// hold; the contract errors; random lifecycles checking that the manager's held pages and the
/// source's holder counts agree after every call.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/error.h"
#include "mkv/swa_page_source.h"
#include "swa/swa_test_rig.h"

namespace mkv::swa_test {
namespace {

/// The page source of these tests: a free list (lowest id first), holder counts and a published
/// set; cached pages nobody holds are handed out least recently released first (and then
/// unpublished). A release of a page nobody holds is recorded as a violation (release is
/// noexcept), so every test can assert there was none.
class TestPageSource final : public SwaPageSource {
 public:
  explicit TestPageSource(int32_t pages)
      : mHolders(static_cast<std::size_t>(pages), 0),
        mPublished(static_cast<std::size_t>(pages), 0) {
    for (PageId page = pages - 1; page >= 0; --page) {
      mFree.push_back(page);
    }
  }

  int32_t totalPages() const noexcept override { return static_cast<int32_t>(mHolders.size()); }
  int32_t availablePages() const noexcept override {
    return static_cast<int32_t>(mFree.size() + mCachedOrder.size());
  }
  bool allocate(int32_t count, std::vector<PageId>& out) override {
    ++allocateCalls;
    if (count > availablePages()) {
      ++failedAllocations;
      return false;
    }
    for (int32_t i = 0; i < count; ++i) {
      PageId page = kNoPage;
      if (!mFree.empty()) {
        page = mFree.back();
        mFree.pop_back();
      } else {
        page = mCachedOrder.front();
        mCachedOrder.pop_front();
        at(mPublished, page) = 0;  // the block is dropped
      }
      at(mHolders, page) = 1;
      out.push_back(page);
    }
    return true;
  }
  void hold(PageId page) override {
    ++holdCalls;
    if (page < 0 || page >= totalPages() || (holders(page) == 0 && !published(page))) {
      throw Error("TestPageSource::hold: page " + std::to_string(page) +
                  " is neither cached nor held");
    }
    if (at(mHolders, page)++ == 0) {
      mCachedOrder.erase(std::find(mCachedOrder.begin(), mCachedOrder.end(), page));
    }
  }
  void release(PageId page) noexcept override {
    ++releaseCalls;
    if (page < 0 || page >= totalPages() || holders(page) == 0) {
      violations.push_back("release of page " + std::to_string(page) + ", which nobody holds");
      return;
    }
    if (--at(mHolders, page) == 0) {
      if (published(page)) {
        mCachedOrder.push_back(page);
      } else {
        mFree.push_back(page);
      }
    }
  }

  /// Publishes a held page (what the composed adapter does with a complete prompt block).
  void publish(PageId page) {
    ASSERT_GT(holders(page), 0) << "page " << page;
    at(mPublished, page) = 1;
  }
  /// `count` published pages nobody holds (the window blocks an earlier request left).
  std::vector<PageId> makeCached(int32_t count) {
    std::vector<PageId> pages;
    EXPECT_TRUE(allocate(count, pages));
    for (PageId page : pages) {
      publish(page);
      release(page);
    }
    return pages;
  }
  int32_t holders(PageId page) const { return mHolders.at(static_cast<std::size_t>(page)); }
  bool published(PageId page) const { return mPublished.at(static_cast<std::size_t>(page)) != 0; }
  int32_t freePages() const { return static_cast<int32_t>(mFree.size()); }
  int32_t cachedUnheld() const { return static_cast<int32_t>(mCachedOrder.size()); }
  int64_t totalHolds() const {
    int64_t sum = 0;
    for (int32_t count : mHolders) sum += count;
    return sum;
  }
  /// Holder counts, published set, free order and the cached pages nobody holds: what
  /// "nothing changed" compares. Not their recency: a hold undone by a release refreshes it.
  std::vector<int32_t> snapshot() const {
    std::vector<int32_t> out(mHolders);
    out.insert(out.end(), mPublished.begin(), mPublished.end());
    out.insert(out.end(), mFree.begin(), mFree.end());
    std::vector<PageId> cached(mCachedOrder.begin(), mCachedOrder.end());
    std::sort(cached.begin(), cached.end());
    out.insert(out.end(), cached.begin(), cached.end());
    return out;
  }

  int64_t allocateCalls = 0, failedAllocations = 0, holdCalls = 0, releaseCalls = 0;
  std::vector<std::string> violations;

 private:
  template <typename T>
  static T& at(std::vector<T>& v, PageId page) {
    return v.at(static_cast<std::size_t>(page));
  }
  std::vector<int32_t> mHolders;
  std::vector<int32_t> mPublished;
  std::vector<PageId> mFree;
  std::deque<PageId> mCachedOrder;
};

/// Every page's holder count in the source is the number of live sequences of `handles` that
/// hold it, plus `foreign` holds the test took itself; quarantined requests account for the
/// rest (quarantinedPageCount). No sequence holds a page twice; a decoding sequence holds at
/// most M + 1 pages; the manager's free count is the source's available count.
void expectSourceAgrees(TestPageSource const& source, BoundedSwaKVPageManager const& manager,
                        std::vector<Handle const*> const& handles,
                        std::vector<PageId> const& foreign = {}) {
  std::vector<int32_t> expected(static_cast<std::size_t>(source.totalPages()), 0);
  for (PageId page : foreign) ++expected[static_cast<std::size_t>(page)];
  std::string problem;
  for (Handle const* handle : handles) {
    if (handle == nullptr || !handle->valid()) continue;
    for (int32_t row = 0; row < manager.batchSize(*handle); ++row) {
      SwaSequenceState const& state = manager.state(*handle, row);
      std::vector<PageId> pages(state.reservedPages);
      for (auto const& binding : state.bindings) pages.push_back(binding.page);
      for (auto const& binding : state.pendingRetire) pages.push_back(binding.page);
      std::sort(pages.begin(), pages.end());
      if (std::adjacent_find(pages.begin(), pages.end()) != pages.end()) {
        problem = "slot " + std::to_string(state.resident.slot) + " holds a page twice";
      }
      for (PageId page : pages) ++expected[static_cast<std::size_t>(page)];
    }
  }
  EXPECT_TRUE(problem.empty()) << problem;
  int64_t expectedHolds = manager.quarantinedPageCount();
  for (PageId page = 0; page < source.totalPages(); ++page) {
    int32_t const want = expected[static_cast<std::size_t>(page)];
    expectedHolds += want;
    if (manager.quarantinedPageCount() == 0) {
      EXPECT_EQ(source.holders(page), want) << "page " << page;
    } else {
      EXPECT_GE(source.holders(page), want) << "page " << page;
    }
  }
  EXPECT_EQ(source.totalHolds(), expectedHolds);
  EXPECT_EQ(manager.freePageCount(), source.availablePages());
  EXPECT_TRUE(source.violations.empty()) << source.violations.front();
}

// W = 40, P = 16: M = 4, a decoding sequence holds at most 5 pages; the table is 32 pages
// (512 tokens) wide. A start at 64 reuses the window pages of logical pages [1, 4).
constexpr int32_t kWindow = 40;
constexpr int32_t kPage = 16;
constexpr int32_t kPool = 40;

class BoundedSwaPageSourceTest : public DeviceTest {
 protected:
  RigConfig cachedConfig(TestPageSource& source) const {
    RigConfig config = rigConfig();
    config.window = kWindow;
    config.pageSize = kPage;
    config.numPages = source.totalPages();
    config.pageSource = &source;
    return config;
  }
  static Handle admitCached(SwaRig& rig, std::vector<int32_t> const& slots,
                            std::vector<SwaReuseStart> const& starts) {
    auto result = rig.manager().beginRequest(residentsFor(slots), SwaRig::stream(), starts);
    EXPECT_EQ(result.status, SwaKVCacheStatus::kOk) << toString(result.status);
    return result.request.has_value() ? std::move(*result.request) : Handle();
  }
  /// Every live row of the device table mirrors its bindings.
  static void expectRowsMirrorBindings(SwaRig& rig, Handle const& handle) {
    for (int32_t row = 0; row < rig.manager().batchSize(handle); ++row) {
      SwaSequenceState const& state = rig.manager().state(handle, row);
      EXPECT_EQ(hostRow(rig.table(), state.resident.slot),
                expectedRow(rig.table(), state.bindings));
      EXPECT_EQ(deviceRow(rig.table(), state.resident.slot),
                expectedRow(rig.table(), state.bindings));
    }
  }
};

TEST_P(BoundedSwaPageSourceTest, TheSourceMustCoverThePoolAndReportsTheFreeCount) {
  TestPageSource small(kPool - 10);
  RigConfig config = cachedConfig(small);
  config.numPages = kPool;
  expectContractError(
      [&] { SwaRig rig(config); },
      {"BoundedSwaKVPageManager", "page source has 30 pages but the SWA pool has 40"});
  TestPageSource source(kPool);
  SwaRig rig(cachedConfig(source));
  (void)source.makeCached(3);
  EXPECT_EQ(rig.manager().freePageCount(), kPool) << "cached pages nobody holds are available";
  std::vector<PageId> foreign;
  ASSERT_TRUE(source.allocate(5, foreign));
  EXPECT_EQ(rig.manager().freePageCount(), kPool - 5);
  EXPECT_EQ(rig.manager().totalPageCount(), kPool);
}

TEST_P(BoundedSwaPageSourceTest,
       AdmissionInTheOtherModeOrWithInvalidStartsThrowsAndChangesNothing) {
  TestPageSource source(kPool);
  SwaRig rig(cachedConfig(source));
  BoundedSwaKVPageManager& manager = rig.manager();
  std::vector<PageId> const cached = source.makeCached(3);  // pages 0, 1, 2
  PageId const freePage = kPool - 1;
  std::vector<int32_t> const before = source.snapshot();
  auto const one = residentsFor({0});
  auto const two = residentsFor({0, 1});
  auto begin = [&](auto const& residents, std::vector<SwaReuseStart> const& starts) {
    (void)manager.beginRequest(residents, SwaRig::stream(), starts);
  };
  expectContractError([&] { (void)manager.beginRequest(one, SwaRig::stream()); },
                      {"BoundedSwaKVPageManager::beginRequest", "page source", "1 residents"});
  expectContractError(
      [&] {
        begin(one, {{100, 64, cached}, {100, 0, {}}});
      },
      {"beginRequest", "2 reuse starts for a batch of 1"});
  expectContractError(
      [&] {
        begin(one, {{0, 0, {}}});
      },
      {"beginRequest", "promptTokens 0 of row 0 outside (0, 512]"});
  expectContractError(
      [&] {
        begin(two, {{100, 0, {}}, {513, 0, {}}});
      },
      {"promptTokens 513 of row 1 outside (0, 512]"});
  expectContractError(
      [&] {
        begin(one, {{100, 20, {}}});
      },
      {"startTokens 20 of row 0 is not a multiple of 16 in [0, 100)"});
  expectContractError(
      [&] {
        begin(one, {{64, 64, cached}});
      },
      {"startTokens 64 of row 0 is not a multiple of 16 in [0, 64)"});
  expectContractError(
      [&] {
        begin(one, {{100, 64, {0, 1}}});
      },
      {"row 0 starts at 64 with 2 window pages; logical pages [1, 4) need 3"});
  expectContractError(
      [&] {
        begin(one, {{100, 64, {0, 1, kPool}}});
      },
      {"window page 40 of row 0 outside [0, 40)"});
  expectContractError(
      [&] {
        begin(one, {{100, 64, {0, 1, 1}}});
      },
      {"window page 1 of row 0 is given twice"});
  // The source refuses the third hold: the two taken before it are released.
  expectContractError(
      [&] {
        begin(two, {{100, 64, cached}, {100, 64, {0, 1, freePage}}});
      },
      {"TestPageSource::hold", "page 39 is neither cached nor held"});
  EXPECT_EQ(source.holdCalls, 6);
  EXPECT_EQ(source.releaseCalls, 3 + 5);  // makeCached's 3, then the 5 holds undone
  EXPECT_EQ(source.snapshot(), before);
  EXPECT_EQ(manager.activeRequestCount(), 0);
  EXPECT_EQ(manager.residentRowState(0), ResidentRowState::kFree);
  EXPECT_TRUE(source.violations.empty());

  RigConfig uncached = rigConfig();
  SwaRig plain(uncached);
  expectContractError(
      [&] {
        (void)plain.manager().beginRequest(one, SwaRig::stream(),
                                           std::vector<SwaReuseStart>{{100, 0, {}}});
      },
      {"BoundedSwaKVPageManager::beginRequest",
       "1 reuse starts for a manager without a page source"});
  EXPECT_EQ(plain.manager().freePageCount(), plain.manager().totalPageCount());
}

TEST_P(BoundedSwaPageSourceTest, AdmissionIsAllOrNothingWithSharedWindowPages) {
  TestPageSource source(kPool);
  SwaRig rig(cachedConfig(source));
  BoundedSwaKVPageManager& manager = rig.manager();
  std::vector<PageId> const cached = source.makeCached(3);
  // Two rows reuse the same window: 3 shared holds, 2 x (ceil(100/16) - 4 + 1) = 8 private pages.
  std::vector<SwaReuseStart> const starts{{100, 64, cached}, {100, 64, cached}};
  std::vector<PageId> foreign;
  ASSERT_TRUE(source.allocate(30, foreign));
  // 10 available, enough before the window is held; 7 once it is: refused, nothing changed.
  ASSERT_EQ(manager.freePageCount(), 10);
  std::vector<int32_t> const before = source.snapshot();
  auto refused = manager.beginRequest(residentsFor({0, 1}), SwaRig::stream(), starts);
  EXPECT_EQ(refused.status, SwaKVCacheStatus::kRequestFailed);
  EXPECT_FALSE(refused.request.has_value());
  EXPECT_EQ(source.holdCalls, 6);
  EXPECT_EQ(source.failedAllocations, 1);
  EXPECT_EQ(source.snapshot(), before) << "the holds were released, the window blocks kept";
  for (PageId page : cached) EXPECT_TRUE(source.published(page));
  EXPECT_EQ(manager.activeRequestCount(), 0);
  EXPECT_EQ(manager.residentRowState(1), ResidentRowState::kFree);

  source.release(foreign.back());
  foreign.pop_back();
  Handle handle = admitCached(rig, {0, 1}, starts);
  ASSERT_TRUE(handle.valid());
  EXPECT_EQ(manager.freePageCount(), 0);
  for (PageId page : cached) EXPECT_EQ(source.holders(page), 2);
  for (int32_t row = 0; row < 2; ++row) {
    SwaSequenceState const& state = manager.state(handle, row);
    EXPECT_EQ(state.endpoint, 64);
    EXPECT_EQ(state.retainedBegin, 1);
    EXPECT_EQ(state.retainedEnd, 4);
    EXPECT_EQ(state.bindings,
              (std::deque<SwaPageBinding>{{1, cached[0]}, {2, cached[1]}, {3, cached[2]}}));
    EXPECT_EQ(state.reservedPages.size(), 4u);
    EXPECT_EQ(state.heldPages(), 7);
  }
  expectSourceAgrees(source, manager, {&handle}, foreign);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  expectSourceAgrees(source, manager, {}, foreign);
  for (PageId page : cached) EXPECT_TRUE(source.published(page) && source.holders(page) == 0);
}

TEST_P(BoundedSwaPageSourceTest, PrefillFromAStartMapsEveryPromptPageAndRetiresOutsideTheWindow) {
  TestPageSource source(kPool);
  SwaRig rig(cachedConfig(source));
  BoundedSwaKVPageManager& manager = rig.manager();
  std::vector<PageId> const cached = source.makeCached(3);
  Handle handle = admitCached(rig, {1}, {{100, 64, cached}});
  ASSERT_TRUE(handle.valid());
  SwaSequenceState const& state = manager.state(handle, 0);
  expectContractError(
      [&] { manager.preparePrefill(handle, std::vector<int32_t>{99}); },
      {"preparePrefill", "length 99 of row 0 differs from its admitted promptTokens 100"});
  EXPECT_EQ(state.bindings.size(), 3u);
  EXPECT_EQ(state.reservedPages.size(), 4u);
  EXPECT_EQ(hostRow(rig.table(), 1), emptyRow(rig.table()));

  manager.preparePrefill(handle, std::vector<int32_t>{100});
  // Logical pages [1, 7): the window before 64, then the prompt's pages 4, 5, 6.
  ASSERT_EQ(state.bindings.size(), 6u);
  for (int32_t k = 0; k < 6; ++k) {
    EXPECT_EQ(state.bindings[static_cast<std::size_t>(k)].logicalPage, 1 + k);
  }
  EXPECT_EQ(state.bindings[0].page, cached[0]);
  EXPECT_EQ(state.reservedPages.size(), 1u);
  EXPECT_EQ(state.pendingEndpoint, 100);
  EXPECT_EQ(state.retainedBegin, 3);
  EXPECT_EQ(state.retainedEnd, 7);
  expectRowsMirrorBindings(rig, handle);
  EXPECT_EQ(readInt32(rig.pool().kvLengths()), std::vector<int32_t>{64}) << "KV exists up to 64";
  EXPECT_EQ(readInt32(rig.fullPool()->kvLengths()), std::vector<int32_t>{64});
  expectSourceAgrees(source, manager, {&handle});
  // The adapter publishes the complete prompt blocks [64, 96) between the prefill's
  // synchronisation and completePrefill.
  PageId const block4 = state.bindings[3].page;
  PageId const block5 = state.bindings[4].page;
  source.publish(block4);
  source.publish(block5);
  int64_t const releasesBefore = source.releaseCalls;

  manager.completePrefill(handle);
  EXPECT_EQ(state.endpoint, 100);
  EXPECT_EQ(state.bindings.front().logicalPage, 3);
  EXPECT_EQ(state.bindings.size(), 4u);
  EXPECT_EQ(state.reservedPages.size(), 1u);
  EXPECT_EQ(state.heldPages(), manager.decodePagesPerSequence());
  EXPECT_EQ(source.releaseCalls - releasesBefore, 2) << "logical pages 1 and 2 left the window";
  EXPECT_EQ(source.holders(cached[0]), 0);
  EXPECT_EQ(source.holders(cached[1]), 0);
  EXPECT_EQ(source.holders(cached[2]), 1);
  EXPECT_EQ(hostRow(rig.table(), 1), expectedRow(rig.table(), state.bindings));
  expectSourceAgrees(source, manager, {&handle});

  // Decode to 200 tokens: every retired page goes back, the published ones stay cached.
  for (int32_t step = 0; step < 100; ++step) {
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk) << "step " << step;
    EXPECT_LE(state.heldPages(), manager.decodePagesPerSequence());
    std::deque<SwaPageBinding> mapped = state.bindings;  // a retiring page stays mapped
    mapped.insert(mapped.end(), state.pendingRetire.begin(), state.pendingRetire.end());
    EXPECT_EQ(hostRow(rig.table(), 1), expectedRow(rig.table(), mapped));
    manager.completeDecodeStep(handle);
    ASSERT_EQ(state.reservedPages.size(), 1u) << "a spare after every step";
    EXPECT_LE(state.heldPages(), manager.decodePagesPerSequence());
    expectSourceAgrees(source, manager, {&handle});
  }
  EXPECT_EQ(state.endpoint, 200);
  EXPECT_EQ(state.retainedBegin, (200 - kWindow) / kPage);
  EXPECT_EQ(source.holders(block4), 0);
  EXPECT_TRUE(source.published(block4) && source.published(block5)) << "cached, not freed";
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(source.totalHolds(), 0);
  EXPECT_EQ(source.cachedUnheld(), 5);
  EXPECT_EQ(source.freePages(), kPool - 5);
  EXPECT_TRUE(source.violations.empty());
}

// In-flight admission: a joiner of an executing request has its prefill mapped at once, decode
// steps skip it until it is finalised (the same retirement as completePrefill), and a
// retraction gives every page back; misuse changes nothing.
TEST_P(BoundedSwaPageSourceTest, AJoinerIsMappedSkippedByDecodeThenRetractedOrFinalised) {
  TestPageSource source(kPool);
  SwaRig rig(cachedConfig(source));
  BoundedSwaKVPageManager& manager = rig.manager();
  std::vector<PageId> const cached = source.makeCached(3);
  Handle handle = admitCached(rig, {0}, {{50, 0, {}}});
  ResidentRef const joiner = residentsFor({2}).front();
  SwaReuseStart const start{100, 64, cached};
  expectContractError([&] { (void)manager.admitSequence(handle, joiner, start); },
                      {"BoundedSwaKVPageManager::admitSequence", "no pending work"});
  manager.preparePrefill(handle, std::vector<int32_t>{50});
  manager.completePrefill(handle);
  std::vector<int32_t> const before = source.snapshot();
  expectContractError(
      [&] { (void)manager.admitSequence(handle, residentsFor({0}).front(), start); },
      {"admitSequence", "resident slot 0 is held by another active request"});
  expectContractError(
      [&] {
        (void)manager.admitSequence(handle, joiner, {100, 60, cached});
      },
      {"admitSequence", "startTokens 60 of row 1"});
  EXPECT_EQ(source.snapshot(), before);
  EXPECT_EQ(manager.batchSize(handle), 1);

  SwaSequenceState const& founder = manager.state(handle, 0);
  ASSERT_EQ(manager.admitSequence(handle, joiner, start), SwaKVCacheStatus::kOk);
  ASSERT_EQ(manager.batchSize(handle), 2);
  SwaSequenceState const& state = manager.state(handle, 1);
  EXPECT_TRUE(state.joining);
  ASSERT_EQ(state.bindings.size(), 6u);  // logical pages [1, 7): the window, then 4, 5, 6
  EXPECT_EQ(state.bindings[0].page, cached[0]);
  EXPECT_EQ(state.reservedPages.size(), 1u);
  EXPECT_EQ(state.pendingEndpoint, 100);
  EXPECT_EQ(manager.residentRowState(2), ResidentRowState::kActive);
  expectRowsMirrorBindings(rig, handle);
  expectSourceAgrees(source, manager, {&handle});
  // The founder decodes; the joiner's staged prefill stays as it is.
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
  expectContractError([&] { manager.finalizeSequenceAdmission(handle, 1); },
                      {"finalizeSequenceAdmission", "work is pending"});
  // Nothing to undo while work is pending: false, nothing changed (the checks below).
  EXPECT_FALSE(manager.hasRetractableAdmission(handle));
  EXPECT_FALSE(manager.retractSequenceAdmission(handle));
  EXPECT_EQ(manager.batchSize(handle), 2);
  manager.completeDecodeStep(handle);
  EXPECT_EQ(founder.endpoint, 51);
  EXPECT_EQ(state.pendingEndpoint, 100);
  EXPECT_EQ(state.bindings.size(), 6u);

  EXPECT_TRUE(manager.hasRetractableAdmission(handle));
  EXPECT_TRUE(manager.retractSequenceAdmission(handle));
  EXPECT_EQ(manager.batchSize(handle), 1);
  EXPECT_EQ(hostRow(rig.table(), 2), emptyRow(rig.table()));
  EXPECT_EQ(deviceRow(rig.table(), 2), emptyRow(rig.table()));
  EXPECT_EQ(manager.residentRowState(2), ResidentRowState::kFree);
  EXPECT_EQ(source.holders(cached[0]), 0);
  expectSourceAgrees(source, manager, {&handle});
  EXPECT_FALSE(manager.retractSequenceAdmission(handle));  // the founder: nothing to undo
  EXPECT_EQ(manager.batchSize(handle), 1);
  EXPECT_FALSE(manager.poisoned());

  ASSERT_EQ(manager.admitSequence(handle, joiner, start), SwaKVCacheStatus::kOk);
  expectContractError([&] { manager.finalizeSequenceAdmission(handle, 0); },
                      {"finalizeSequenceAdmission", "row 0 is not an unfinalised"});
  manager.finalizeSequenceAdmission(handle, 1);
  SwaSequenceState const& seated = manager.state(handle, 1);
  EXPECT_FALSE(seated.joining);
  EXPECT_EQ(seated.endpoint, 100);
  EXPECT_EQ(seated.bindings.front().logicalPage, 3);  // pages 1 and 2 left the window of 100
  EXPECT_EQ(seated.heldPages(), manager.decodePagesPerSequence());
  expectSourceAgrees(source, manager, {&handle});
  for (int32_t step = 0; step < 30; ++step) {
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk) << "step " << step;
    manager.completeDecodeStep(handle);
    EXPECT_LE(seated.heldPages(), manager.decodePagesPerSequence());
    expectSourceAgrees(source, manager, {&handle});
  }
  EXPECT_EQ(seated.endpoint, 130);
  EXPECT_EQ(founder.endpoint, 81);
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(source.totalHolds(), 0);
  EXPECT_TRUE(source.violations.empty());
}

TEST_P(BoundedSwaPageSourceTest, AJoinerTheSourceCannotHoldIsRefusedWithNothingChanged) {
  // 12 pages: the founder keeps M + 1 = 5 once decoding; a 100-token joiner from scratch needs
  // 7 + 1 private pages, one more than the source has left.
  TestPageSource source(12);
  SwaRig rig(cachedConfig(source));
  BoundedSwaKVPageManager& manager = rig.manager();
  Handle handle = admitCached(rig, {0}, {{50, 0, {}}});
  manager.preparePrefill(handle, std::vector<int32_t>{50});
  manager.completePrefill(handle);
  std::vector<int32_t> const before = source.snapshot();
  EXPECT_EQ(manager.admitSequence(handle, residentsFor({1}).front(), {100, 0, {}}),
            SwaKVCacheStatus::kRequestFailed);
  EXPECT_EQ(source.snapshot(), before);
  EXPECT_EQ(manager.batchSize(handle), 1);
  EXPECT_EQ(manager.residentRowState(1), ResidentRowState::kFree);
  EXPECT_EQ(manager.admitSequence(handle, residentsFor({1}).front(), {90, 0, {}}),
            SwaKVCacheStatus::kOk);  // 6 + 1 pages fit
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  EXPECT_EQ(source.totalHolds(), 0);
}

// A retired page that another window still holds frees nothing: the replacement spare may then
// be missing, and the next step that needs a page tries again (kRequestFailed when the source
// still has none).
TEST_P(BoundedSwaPageSourceTest, ARetiredSharedPageLeavesNoSpareUntilTheSourceHasOne) {
  for (bool const sourceRecovers : {true, false}) {
    SCOPED_TRACE(sourceRecovers ? "a page comes back" : "the source stays empty");
    TestPageSource source(kPool);
    SwaRig rig(cachedConfig(source));
    BoundedSwaKVPageManager& manager = rig.manager();
    std::vector<PageId> const cached = source.makeCached(3);
    // Two rows start at 64 on the same window, prompt 65: 2 private pages each.
    Handle handle = admitCached(rig, {0, 1}, {{65, 64, cached}, {65, 64, cached}});
    ASSERT_TRUE(handle.valid());
    manager.preparePrefill(handle, std::vector<int32_t>{65, 65});
    manager.completePrefill(handle);
    std::vector<PageId> foreign;
    ASSERT_TRUE(source.allocate(source.availablePages(), foreign));
    ASSERT_EQ(manager.freePageCount(), 0);
    auto decodeTo = [&](int32_t endpoint) {
      while (manager.state(handle, 0).endpoint < endpoint) {
        ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
        manager.completeDecodeStep(handle);
      }
    };
    SwaSequenceState const& first = manager.state(handle, 0);
    SwaSequenceState const& second = manager.state(handle, 1);
    // 71 -> 72 retires logical page 1 (cached[0], held by both rows) and maps nothing.
    decodeTo(72);
    EXPECT_EQ(source.holders(cached[0]), 0);
    EXPECT_EQ(first.reservedPages.size(), 1u);
    // The foreign holder takes what that made available; 80 -> 81 maps logical page 5 from
    // each spare and retires nothing: no spare follows.
    ASSERT_TRUE(source.allocate(source.availablePages(), foreign));
    decodeTo(81);
    EXPECT_TRUE(first.reservedPages.empty());
    EXPECT_TRUE(second.reservedPages.empty());
    EXPECT_EQ(first.heldPages(), 4);
    // 87 -> 88 retires logical page 2 (cached[1]): row 0's release leaves it held by row 1 and
    // frees nothing; row 1's makes it available, and row 1 takes it as its spare.
    decodeTo(88);
    EXPECT_TRUE(first.reservedPages.empty()) << "no page for row 0";
    ASSERT_EQ(second.reservedPages.size(), 1u);
    EXPECT_EQ(second.reservedPages.front(), cached[1]);
    EXPECT_FALSE(source.published(cached[1])) << "handed out again: the block was dropped";
    expectSourceAgrees(source, manager, {&handle}, foreign);
    // 96 -> 97 needs a page for both rows.
    decodeTo(96);
    if (sourceRecovers) {
      source.release(foreign.back());
      foreign.pop_back();
      ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
      EXPECT_EQ(first.bindings.back().logicalPage, 6);
      manager.completeDecodeStep(handle);
    } else {
      std::deque<SwaPageBinding> const bindings = first.bindings;
      EXPECT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kRequestFailed);
      EXPECT_EQ(first.bindings, bindings) << "nothing staged";
      EXPECT_FALSE(first.pendingEndpoint.has_value());
    }
    expectSourceAgrees(source, manager, {&handle}, foreign);
    EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
    expectSourceAgrees(source, manager, {}, foreign);
    for (PageId page : foreign) source.release(page);
    EXPECT_EQ(source.totalHolds(), 0);
  }
}

TEST_P(BoundedSwaPageSourceTest, CompactionFinishAndAbandonmentReleaseEveryHold) {
  TestPageSource source(kPool);
  SwaRig rig(cachedConfig(source));
  BoundedSwaKVPageManager& manager = rig.manager();
  std::vector<PageId> const cached = source.makeCached(3);
  {
    Handle handle =
        admitCached(rig, {0, 1, 2}, {{100, 64, cached}, {50, 0, {}}, {120, 64, cached}});
    ASSERT_TRUE(handle.valid());
    manager.preparePrefill(handle, std::vector<int32_t>{100, 50, 120});
    EXPECT_EQ(readInt32(rig.pool().kvLengths()), (std::vector<int32_t>{64, 0, 64}));
    manager.completePrefill(handle);
    ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
    manager.completeDecodeStep(handle);
    for (int32_t row = 0; row < 3; ++row) {
      EXPECT_LE(manager.state(handle, row).heldPages(), manager.decodePagesPerSequence());
    }
    expectSourceAgrees(source, manager, {&handle});
    writeInt32(rig.pool().kvLengths(), {101, 51, 121});
    writeInt32(rig.fullPool()->kvLengths(), {101, 51, 121});
    manager.beginBatchCompaction(handle, std::vector<int32_t>{0, 1, -1}, 2, rig.mapping());
    ASSERT_EQ(manager.compactBatch(handle), SwaKVCacheStatus::kOk);
    EXPECT_EQ(manager.batchSize(handle), 2);
    EXPECT_EQ(hostRow(rig.table(), 2), emptyRow(rig.table()));
    expectSourceAgrees(source, manager, {&handle});
    EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kOk);
  }
  EXPECT_EQ(source.totalHolds(), 0);
  {
    Handle admitted = admitCached(rig, {0}, {{100, 64, cached}});
    EXPECT_EQ(source.holders(cached[0]), 1);
  }  // abandoned before its prefill
  EXPECT_EQ(source.totalHolds(), 0);
  {
    Handle prefilling = admitCached(rig, {2}, {{300, 64, cached}});
    manager.preparePrefill(prefilling, std::vector<int32_t>{300});
    expectSourceAgrees(source, manager, {&prefilling});
  }  // abandoned with its prefill pending: synchronised, then released
  EXPECT_EQ(rig.faults().calls(), 2) << "the compaction and the pending prefill synchronised";
  EXPECT_EQ(source.totalHolds(), 0);
  EXPECT_EQ(manager.freePageCount(), kPool);
  for (PageId page : cached) EXPECT_TRUE(source.published(page));
  EXPECT_TRUE(source.violations.empty());
}

TEST_P(BoundedSwaPageSourceTest, AFailedSynchronisationKeepsTheHoldsUntilShutdown) {
  TestPageSource source(kPool);
  SwaRig rig(cachedConfig(source));
  BoundedSwaKVPageManager& manager = rig.manager();
  std::vector<PageId> const cached = source.makeCached(3);
  Handle handle = admitCached(rig, {0, 1}, {{200, 64, cached}, {100, 64, cached}});
  ASSERT_TRUE(handle.valid());
  manager.preparePrefill(handle, std::vector<int32_t>{200, 100});
  manager.completePrefill(handle);
  ASSERT_EQ(manager.prepareDecodeStep(handle), SwaKVCacheStatus::kOk);
  int32_t const held = heldPages(manager, {&handle});
  rig.faults().failNext();
  EXPECT_EQ(manager.finish(handle), SwaKVCacheStatus::kPoisoned);
  EXPECT_EQ(manager.quarantinedPageCount(), held);
  EXPECT_EQ(source.totalHolds(), held) << "quarantined pages stay held";
  expectSourceAgrees(source, manager, {});
  int64_t const holds = source.holdCalls;
  auto const refused = manager.beginRequest(residentsFor({2}), SwaRig::stream(),
                                            std::vector<SwaReuseStart>{{100, 64, cached}});
  EXPECT_EQ(refused.status, SwaKVCacheStatus::kPoisoned);
  EXPECT_EQ(source.holdCalls, holds);
  EXPECT_EQ(manager.shutdown(), SwaKVCacheStatus::kOk);
  EXPECT_EQ(manager.quarantinedPageCount(), 0);
  EXPECT_EQ(source.totalHolds(), 0);
  EXPECT_EQ(source.availablePages(), kPool);
  EXPECT_TRUE(source.violations.empty());
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaPageSourceTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

// ------------------------------------------------------------------- random lifecycles

struct CachedGeometry {
  int32_t window;
  int32_t pageSize;
  uint64_t seed;
};

/// Random lifecycles of concurrent cached-mode requests (admission at random reused starts over
/// the published pages, prefill with random publication, decode, compaction, finish,
/// abandonment, failed synchronisations and shutdowns); after every call the manager's held
/// pages and the source's holder counts agree, and admission is refused exactly when the
/// source cannot cover the batch once its window pages are held.
class CachedLifecycleRun {
 public:
  CachedLifecycleRun(DeviceType device, CachedGeometry const& geometry)
      : mSource(kPages), mRandom(geometry.seed) {
    RigConfig config;
    config.device = device;
    config.window = geometry.window;
    config.pageSize = geometry.pageSize;
    config.maxBatch = kSlots;
    config.numPages = kPages;
    config.maxPagesPerSeq = 24;
    config.withLengthPools = false;  // concurrent requests
    config.pageSource = &mSource;
    mRig = std::make_unique<SwaRig>(config);
    mSlotBusy.assign(kSlots, false);
  }
  ~CachedLifecycleRun() { mLive.clear(); }
  CachedLifecycleRun(CachedLifecycleRun const&) = delete;
  CachedLifecycleRun& operator=(CachedLifecycleRun const&) = delete;

  void step() {
    double const r = uniform();
    bool const slotsLeft = std::count(mSlotBusy.begin(), mSlotBusy.end(), false) > 0;
    if (manager().poisoned() && (mLive.empty() || r < 0.2)) {
      shutdown();
    } else if (mLive.empty() || (slotsLeft && r < 0.3)) {
      admit();
    } else {
      act(pick(mLive.size()));
    }
    check();
  }
  void drain() {
    mRig->faults().disarm();
    mLive.clear();  // abandoned: synchronised, released
    EXPECT_EQ(manager().shutdown(), SwaKVCacheStatus::kOk);
    check();
    EXPECT_EQ(mSource.totalHolds(), 0);
    EXPECT_EQ(mSource.availablePages(), kPages);
  }
  int64_t admitted = 0, refused = 0, reusedStarts = 0, decodeSteps = 0, quarantines = 0;

 private:
  static constexpr int32_t kPages = 24;
  static constexpr int32_t kSlots = 4;
  enum class Stage { kAdmitted, kPrefilling, kDecoding, kFinishing };
  struct Live {
    Handle handle;
    Stage stage = Stage::kAdmitted;
    std::vector<int32_t> prompts;
  };

  BoundedSwaKVPageManager& manager() { return mRig->manager(); }
  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(mRandom); }
  std::size_t pick(std::size_t n) {
    return std::uniform_int_distribution<std::size_t>(0, n - 1)(mRandom);
  }
  int32_t page() const { return mRig->config().pageSize; }

  /// A random start for a prompt of `prompt` tokens over the published pages, or 0.
  SwaReuseStart randomStart(int32_t prompt) {
    SwaReuseStart start{prompt, 0, {}};
    std::vector<PageId> published;
    for (PageId p = 0; p < kPages; ++p) {
      if (mSource.published(p)) published.push_back(p);
    }
    auto const startPage =
        static_cast<int32_t>(pick(static_cast<std::size_t>((prompt - 1) / page() + 1)));
    int32_t const s = startPage * page();
    int32_t const first = static_cast<int32_t>(std::max(0, s - mRig->config().window) / page());
    auto const need = static_cast<std::size_t>(startPage - first);
    if (s == 0 || need > published.size()) return start;
    std::shuffle(published.begin(), published.end(), mRandom);
    start.startTokens = s;
    start.windowPages.assign(published.begin(),
                             published.begin() + static_cast<std::ptrdiff_t>(need));
    return start;
  }

  void admit() {
    std::vector<int32_t> slots;
    for (int32_t slot = 0; slot < kSlots; ++slot) {
      if (!mSlotBusy[static_cast<std::size_t>(slot)] && uniform() < 0.6) slots.push_back(slot);
    }
    if (slots.empty()) return;
    std::vector<SwaReuseStart> starts;
    int64_t privatePages = 0;
    std::vector<PageId> toHold;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      int32_t const prompt = 1 + static_cast<int32_t>(pick(static_cast<std::size_t>(8 * page())));
      starts.push_back(randomStart(prompt));
      privatePages += (prompt + page() - 1) / page() - starts.back().startTokens / page() + 1;
      toHold.insert(toHold.end(), starts.back().windowPages.begin(),
                    starts.back().windowPages.end());
    }
    std::sort(toHold.begin(), toHold.end());
    toHold.erase(std::unique(toHold.begin(), toHold.end()), toHold.end());
    int64_t const unheldWindow = std::count_if(toHold.begin(), toHold.end(),
                                               [&](PageId p) { return mSource.holders(p) == 0; });
    bool const fits = privatePages <= mSource.availablePages() - unheldWindow;
    std::vector<int32_t> const before = mSource.snapshot();
    auto result = manager().beginRequest(residentsFor(slots), SwaRig::stream(), starts);
    if (manager().poisoned()) {
      EXPECT_EQ(result.status, SwaKVCacheStatus::kPoisoned);
      return;
    }
    EXPECT_EQ(result.status, fits ? SwaKVCacheStatus::kOk : SwaKVCacheStatus::kRequestFailed);
    if (!result.request.has_value()) {
      ++refused;
      EXPECT_EQ(mSource.snapshot(), before);
      return;
    }
    ++admitted;
    for (SwaReuseStart const& start : starts) reusedStarts += start.startTokens > 0 ? 1 : 0;
    for (int32_t slot : slots) mSlotBusy[static_cast<std::size_t>(slot)] = true;
    Live live{std::move(*result.request), Stage::kAdmitted, {}};
    for (SwaReuseStart const& start : starts) live.prompts.push_back(start.promptTokens);
    mLive.push_back(std::make_unique<Live>(std::move(live)));
  }

  void act(std::size_t index) {
    Live& live = *mLive[index];
    double const r = uniform();
    if (r < 0.08 || live.stage == Stage::kFinishing) {
      finish(index);
    } else if (r < 0.12) {
      freeSlots(live);
      mLive.erase(mLive.begin() + static_cast<std::ptrdiff_t>(index));  // abandoned
    } else if (live.stage == Stage::kAdmitted) {
      manager().preparePrefill(live.handle, live.prompts);
      live.stage = Stage::kPrefilling;
    } else if (live.stage == Stage::kPrefilling) {
      publishPromptBlocks(live);
      manager().completePrefill(live.handle);
      live.stage = Stage::kDecoding;
    } else if (r < 0.2 && manager().batchSize(live.handle) > 1) {
      compact(index);
    } else {
      decode(live);
    }
  }

  /// What the composed adapter does before completePrefill: publishes complete prompt blocks.
  void publishPromptBlocks(Live& live) {
    for (int32_t row = 0; row < manager().batchSize(live.handle); ++row) {
      SwaSequenceState const& state = manager().state(live.handle, row);
      for (SwaPageBinding const& binding : state.bindings) {
        bool const complete = (binding.logicalPage + 1) * page() <= *state.pendingEndpoint;
        if (complete && uniform() < 0.5) mSource.publish(binding.page);
      }
    }
  }

  void decode(Live& live) {
    SwaKVCacheStatus const status = manager().prepareDecodeStep(live.handle);
    if (status != SwaKVCacheStatus::kOk) {
      EXPECT_EQ(status, SwaKVCacheStatus::kRequestFailed);
      live.stage = Stage::kFinishing;
      return;
    }
    check();
    manager().completeDecodeStep(live.handle);
    ++decodeSteps;
  }

  void compact(std::size_t index) {
    Live& live = *mLive[index];
    auto const batch = static_cast<std::size_t>(manager().batchSize(live.handle));
    std::vector<int32_t> mapping(batch, -1);
    int32_t kept = 0;
    std::vector<CacheSlot> dropped;
    for (std::size_t i = 0; i < batch; ++i) {
      if (uniform() < 0.6) {
        mapping[i] = kept++;
      } else {
        dropped.push_back(manager().state(live.handle, static_cast<int32_t>(i)).resident.slot);
      }
    }
    manager().beginBatchCompaction(live.handle, mapping, kept, mRig->mapping());
    bool const fail = uniform() < 0.15;
    if (fail) mRig->faults().failNext();
    SwaKVCacheStatus const status = manager().compactBatch(live.handle);
    mRig->faults().disarm();
    if (fail) {
      EXPECT_EQ(status, SwaKVCacheStatus::kPoisoned);
      ++quarantines;
      mLive.erase(mLive.begin() + static_cast<std::ptrdiff_t>(index));  // slots stay busy
      return;
    }
    EXPECT_EQ(status, SwaKVCacheStatus::kOk);
    for (CacheSlot slot : dropped) {
      EXPECT_EQ(manager().residentRowState(slot), ResidentRowState::kFree);
      mSlotBusy[static_cast<std::size_t>(slot)] = false;
    }
    if (kept == 0) live.stage = Stage::kFinishing;
  }

  void finish(std::size_t index) {
    Live& live = *mLive[index];
    bool const fail = live.stage == Stage::kPrefilling && uniform() < 0.3;
    std::vector<CacheSlot> slots;
    for (int32_t row = 0; row < manager().batchSize(live.handle); ++row) {
      slots.push_back(manager().state(live.handle, row).resident.slot);
    }
    if (fail) mRig->faults().failNext();
    SwaKVCacheStatus const status = manager().finish(live.handle);
    mRig->faults().disarm();
    if (fail) {
      EXPECT_EQ(status, SwaKVCacheStatus::kPoisoned);
      ++quarantines;
    } else {
      EXPECT_EQ(status, manager().poisoned() ? SwaKVCacheStatus::kPoisoned : SwaKVCacheStatus::kOk);
      for (CacheSlot slot : slots) mSlotBusy[static_cast<std::size_t>(slot)] = false;
    }
    mLive.erase(mLive.begin() + static_cast<std::ptrdiff_t>(index));
  }

  void shutdown() {
    SwaKVCacheStatus const status = manager().shutdown();
    EXPECT_EQ(status, mLive.empty() ? SwaKVCacheStatus::kOk : SwaKVCacheStatus::kRequestFailed);
    EXPECT_EQ(manager().quarantinedPageCount(), 0);
    refreshSlots();
  }

  void freeSlots(Live const& live) {
    for (int32_t row = 0; row < manager().batchSize(live.handle); ++row) {
      mSlotBusy[static_cast<std::size_t>(manager().state(live.handle, row).resident.slot)] = false;
    }
  }
  /// After shutdown: the quarantined requests' rows are free again.
  void refreshSlots() {
    for (int32_t slot = 0; slot < kSlots; ++slot) {
      mSlotBusy[static_cast<std::size_t>(slot)] =
          manager().residentRowState(slot) != ResidentRowState::kFree;
    }
  }

  void check() {
    std::vector<Handle const*> handles;
    for (auto const& live : mLive) {
      handles.push_back(&live->handle);
      if (live->stage != Stage::kDecoding) continue;
      for (int32_t row = 0; row < manager().batchSize(live->handle); ++row) {
        EXPECT_LE(manager().state(live->handle, row).heldPages(),
                  manager().decodePagesPerSequence());
      }
    }
    expectSourceAgrees(mSource, manager(), handles);
  }

  TestPageSource mSource;
  std::unique_ptr<SwaRig> mRig;
  std::mt19937_64 mRandom;
  std::vector<std::unique_ptr<Live>> mLive;
  std::vector<bool> mSlotBusy;
};

class BoundedSwaPageSourcePropertyTest
    : public ::testing::TestWithParam<std::tuple<DeviceType, CachedGeometry>> {};

TEST_P(BoundedSwaPageSourcePropertyTest, RandomLifecyclesKeepTheSourceAndTheManagerInAgreement) {
  auto const [device, geometry] = GetParam();
  if (device == DeviceType::kGPU && !cudaDeviceAvailable()) {
    GTEST_SKIP() << "no CUDA device";
  }
  CachedLifecycleRun run(device, geometry);
  int64_t const steps = device == DeviceType::kCPU ? 4000 : 800;
  for (int64_t i = 0; i < steps && !HasFailure(); ++i) {
    run.step();
  }
  run.drain();
  RecordProperty("coverage", "admitted " + std::to_string(run.admitted) + ", refused " +
                                 std::to_string(run.refused) + ", reused starts " +
                                 std::to_string(run.reusedStarts) + ", decode steps " +
                                 std::to_string(run.decodeSteps) + ", quarantines " +
                                 std::to_string(run.quarantines));
  // Every path was taken.
  EXPECT_GT(run.admitted, 20);
  EXPECT_GT(run.refused, 0);
  EXPECT_GT(run.reusedStarts, 10);
  EXPECT_GT(run.decodeSteps, 200);
  EXPECT_GT(run.quarantines, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Random, BoundedSwaPageSourcePropertyTest,
    ::testing::Combine(::testing::Values(DeviceType::kCPU, DeviceType::kGPU),
                       ::testing::Values(CachedGeometry{40, 16, 7}, CachedGeometry{17, 16, 11},
                                         CachedGeometry{64, 16, 23})),
    [](auto const& testInfo) {
      auto const& geometry = std::get<1>(testInfo.param);
      return std::string(std::get<0>(testInfo.param) == DeviceType::kCPU ? "Cpu" : "Gpu") + "_W" +
             std::to_string(geometry.window) + "_P" + std::to_string(geometry.pageSize);
    });

}  // namespace
}  // namespace mkv::swa_test
