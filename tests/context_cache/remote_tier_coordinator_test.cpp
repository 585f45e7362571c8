// The remote tier through ContextCacheCoordinator, on CPU and GPU tensors (docs/context_cache.md,
// "Remote tier"): two engines share one store, the second reuses what only the first computed
// and the KV oracle reads every reused position; damaged, truncated and foreign values are
// misses; a store that is down, slow or full costs misses and nothing else; a save holds its host
// page until it finished. The store here is in memory (its faults are set by the test); the same
// engines over a real Redis server and a shared directory are in remote_tier_store_test.cpp.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "context_cache/block_hash.h"
#include "context_cache/context_cache_manager.h"
#include "coordinator_test_rig.h"
#include "mkv/host_kv_tier.h"
#include "mkv/remote_kv_store.h"
#include "remote_tier_engine.h"

namespace mkv {
namespace {

using test::RemoteTierEngine;
using test::Seq;
using test::tokenRun;

constexpr int32_t kPage = RemoteTierEngine::kPage;

/// A store in memory that several engines share, with the faults a real one has.
struct SharedMemoryStore {
  std::mutex mutex;
  std::map<std::string, std::string> values;
  std::atomic<bool> down{false};         ///< every call kUnavailable
  std::atomic<bool> full{false};         ///< every put kRejected
  std::atomic<bool> putsBlocked{false};  ///< puts wait until unblocked (a slow store)
  std::atomic<bool> getsBlocked{false};  ///< gets wait until unblocked
  std::condition_variable unblocked;
  std::condition_variable getsChanged;  ///< a get began waiting or finished
  int32_t puts = 0;
  int32_t waitingGets = 0;
  int32_t finishedGets = 0;

  void unblock() {
    {
      std::lock_guard const lock(mutex);
      putsBlocked = false;
      getsBlocked = false;
    }
    unblocked.notify_all();
  }
  /// Waits until a get is blocked (the worker is inside it); false after 30 s (a hang).
  bool awaitBlockedGet() {
    std::unique_lock lock(mutex);
    return getsChanged.wait_for(lock, std::chrono::seconds(30), [this] { return waitingGets > 0; });
  }
  /// Waits until `count` gets have finished; false after 30 s (a hang).
  bool awaitFinishedGets(int32_t count) {
    std::unique_lock lock(mutex);
    return getsChanged.wait_for(lock, std::chrono::seconds(30),
                                [this, count] { return finishedGets >= count; });
  }
};

class MemoryKvStore final : public RemoteKvStore {
 public:
  explicit MemoryKvStore(std::shared_ptr<SharedMemoryStore> shared) : mShared(std::move(shared)) {}

  RemoteStoreStatus contains(std::span<std::string const> keys,
                             std::vector<uint8_t>& held) override {
    held.assign(keys.size(), 0);
    if (mShared->down) {
      return RemoteStoreStatus::kUnavailable;
    }
    std::lock_guard const lock(mShared->mutex);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      held[i] = mShared->values.contains(keys[i]) ? 1 : 0;
    }
    return RemoteStoreStatus::kOk;
  }
  RemoteStoreStatus get(std::span<std::string const> keys,
                        std::vector<std::optional<std::string>>& values) override {
    values.assign(keys.size(), std::nullopt);
    if (mShared->down) {
      return RemoteStoreStatus::kUnavailable;
    }
    std::unique_lock lock(mShared->mutex);
    if (mShared->getsBlocked) {
      ++mShared->waitingGets;
      mShared->getsChanged.notify_all();
      mShared->unblocked.wait(lock, [this] { return !mShared->getsBlocked; });
      --mShared->waitingGets;
    }
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (auto const found = mShared->values.find(keys[i]); found != mShared->values.end()) {
        values[i] = found->second;
      }
    }
    ++mShared->finishedGets;
    mShared->getsChanged.notify_all();
    return RemoteStoreStatus::kOk;
  }
  RemoteStoreStatus put(std::string const& key, std::string_view value) override {
    std::unique_lock lock(mShared->mutex);
    mShared->unblocked.wait(lock, [this] { return !mShared->putsBlocked; });
    if (mShared->down) {
      return RemoteStoreStatus::kUnavailable;
    }
    if (mShared->full) {
      return RemoteStoreStatus::kRejected;
    }
    mShared->values[key] = std::string(value);
    ++mShared->puts;
    return RemoteStoreStatus::kOk;
  }
  std::string describe() const override { return "memory"; }

 private:
  std::shared_ptr<SharedMemoryStore> mShared;
};

class RemoteTierCoordinatorTest : public test::DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (IsSkipped()) {
      return;
    }
    mStore = std::make_shared<SharedMemoryStore>();
    mFirst = makeEngine("model-a");
    mSecond = makeEngine("model-a");
  }

  std::unique_ptr<RemoteTierEngine> makeEngine(std::string model) {
    RemoteTierConfig remote;
    remote.openStore = [store = mStore] { return std::make_unique<MemoryKvStore>(store); };
    remote.model = std::move(model);
    return std::make_unique<RemoteTierEngine>(device(), std::move(remote));
  }

  /// The store's value of block `block` of `prompt` under the engines' deployment.
  std::string& valueOf(std::vector<int32_t> const& prompt, int32_t block) {
    PromptBlocks const blocks = hashPromptBlocks(PromptView{prompt, {}, {}}, kPage);
    std::string const suffix = ":" + toString(blocks.keys[static_cast<std::size_t>(block)]);
    for (auto& [key, value] : mStore->values) {
      if (key.ends_with(suffix)) {
        return value;
      }
    }
    ADD_FAILURE() << "block " << block << " is not in the store";
    static std::string none;
    return none;
  }

  std::shared_ptr<SharedMemoryStore> mStore;
  std::unique_ptr<RemoteTierEngine> mFirst;
  std::unique_ptr<RemoteTierEngine> mSecond;
};

TEST_P(RemoteTierCoordinatorTest, ASecondEngineReusesWhatOnlyTheFirstComputed) {
  std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
  Seq first(prompt, 0);
  ASSERT_EQ(mFirst->serve(first), 0);
  (void)mFirst->coordinator->drainRemoteTier();
  RemoteTierCounters const saved = mFirst->coordinator->remoteTierCounters();
  EXPECT_EQ(saved.savedBlocks, 3U);
  EXPECT_EQ(saved.saveFailures, 0U);
  EXPECT_EQ(mFirst->coordinator->pendingRemoteSaves(), 0);
  EXPECT_EQ(mFirst->coordinator->manager().hostTier()->pinnedPages(), 0);
  int32_t storedRemotely = 0;
  for (KvEvent const& event : mFirst->coordinator->drainEvents()) {
    if (auto const* stored = std::get_if<BlockStored>(&event);
        stored != nullptr && stored->medium == KvMedium::kRemote) {
      ++storedRemotely;
      EXPECT_EQ(stored->tokens.size(), std::size_t{kPage}) << "the saved block's token ids";
    }
  }
  EXPECT_EQ(storedRemotely, 3) << "one BlockStored on the store's medium per saved block";

  Seq again(test::concatenated(prompt, tokenRun(7, 900)), 0);
  ContextCacheSequenceAdmission const admission = test::promptAdmissionOf(again);
  RemoteTierLookup const looked = mSecond->coordinator->lookupRemoteTier(admission);
  EXPECT_TRUE(looked.storeAvailable);
  EXPECT_EQ(looked.localTokens, 0);
  EXPECT_EQ(looked.remoteTokens, 3 * kPage);
  RemoteLoadStart const started = mSecond->coordinator->loadFromRemoteTier(admission);
  ASSERT_NE(started.ticket, 0U);
  EXPECT_EQ(started.requestedBlocks, 3);
  std::vector<RemoteLoadResult> const loaded = mSecond->coordinator->drainRemoteTier();
  ASSERT_EQ(loaded.size(), 1U);
  EXPECT_EQ(loaded[0].ticket, started.ticket);
  EXPECT_EQ(loaded[0].loadedBlocks, 3);
  EXPECT_EQ(mSecond->coordinator->lookupRemoteTier(admission).localTokens, 3 * kPage)
      << "the loaded blocks are host-tier blocks now";

  EXPECT_EQ(mSecond->serve(again), 3 * kPage) << "the oracle checked every reused position";
  ContextCacheMetrics const metrics = mSecond->coordinator->metrics();
  EXPECT_EQ(metrics.onboardedPages, 3U);
  RemoteTierCounters const counters = mSecond->coordinator->remoteTierCounters();
  EXPECT_EQ(counters.loadedBlocks, 3U);
  EXPECT_EQ(counters.loadedBytes, 3U * static_cast<uint64_t>(mSecond->tier->bytesPerPage()));
  EXPECT_EQ(counters.rejectedBlocks + counters.missingBlocks + counters.loadFailures, 0U);
}

TEST_P(RemoteTierCoordinatorTest, TheWorkerCopiesALoadIntoItsHostPagesBeforeAnyLookupFindsThem) {
  std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
  std::vector<int32_t> const otherPrompt = tokenRun(2 * kPage + 5, 4000);
  Seq first(prompt, 0);
  ASSERT_EQ(mFirst->serve(first), 0);
  Seq second(otherPrompt, 1);
  ASSERT_EQ(mFirst->serve(second), 0);
  (void)mFirst->coordinator->drainRemoteTier();

  // Load A is fetched; load B then holds the worker inside its get, so A's placement (the copy
  // into host pages) waits behind it.
  Seq again(test::concatenated(prompt, tokenRun(7, 900)), 0);
  ContextCacheSequenceAdmission const admission = test::promptAdmissionOf(again);
  ContextCacheCoordinator& coordinator = *mSecond->coordinator;
  RemoteLoadStart const a = coordinator.loadFromRemoteTier(admission);
  ASSERT_NE(a.ticket, 0U);
  ASSERT_TRUE(mStore->awaitFinishedGets(1)) << "load A never reached the store";
  mStore->getsBlocked = true;
  Seq const otherAgain(test::concatenated(otherPrompt, tokenRun(3, 700)), 1);
  RemoteLoadStart const b = coordinator.loadFromRemoteTier(test::promptAdmissionOf(otherAgain));
  ASSERT_NE(b.ticket, 0U);
  ASSERT_TRUE(mStore->awaitBlockedGet()) << "load B never reached the store";

  HostBlockTier const& host = *coordinator.manager().hostTier();
  EXPECT_TRUE(coordinator.pollRemoteTier().empty()) << "A is placed, not yet in the host tier";
  EXPECT_EQ(host.reservedPages(), 3) << "one reserved host page per loaded block of A";
  EXPECT_EQ(host.size(), 0);
  EXPECT_EQ(coordinator.lookupRemoteTier(admission).localTokens, 0)
      << "no lookup finds a page the worker has not filled";
  EXPECT_TRUE(coordinator.pollRemoteTier().empty()) << "the copy waits behind load B";

  mStore->unblock();
  std::vector<RemoteLoadResult> const loaded = coordinator.drainRemoteTier();
  ASSERT_EQ(loaded.size(), 2U);
  EXPECT_EQ(loaded[0].ticket, a.ticket);
  EXPECT_EQ(loaded[0].loadedBlocks, 3);
  EXPECT_EQ(loaded[1].ticket, b.ticket);
  EXPECT_EQ(loaded[1].loadedBlocks, 2);
  EXPECT_EQ(host.reservedPages(), 0);
  EXPECT_EQ(host.size(), 5);
  EXPECT_EQ(coordinator.lookupRemoteTier(admission).localTokens, 3 * kPage);
  EXPECT_EQ(mSecond->serve(again), 3 * kPage) << "the oracle read every byte the worker copied";
}

TEST_P(RemoteTierCoordinatorTest, DamagedTruncatedOrForeignValuesAreMissesNeverHits) {
  std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
  Seq first(prompt, 0);
  ASSERT_EQ(mFirst->serve(first), 0);
  (void)mFirst->coordinator->drainRemoteTier();
  ASSERT_EQ(mStore->values.size(), 3U);
  valueOf(prompt, 2).back() ^= 0x01;                         // one payload byte of block 2
  valueOf(prompt, 1).resize(valueOf(prompt, 1).size() - 1);  // block 1 cut short

  Seq again(test::concatenated(prompt, tokenRun(7, 900)), 0);
  ContextCacheSequenceAdmission const admission = test::promptAdmissionOf(again);
  (void)mSecond->coordinator->loadFromRemoteTier(admission);
  std::vector<RemoteLoadResult> const loaded = mSecond->coordinator->drainRemoteTier();
  ASSERT_EQ(loaded.size(), 1U);
  EXPECT_EQ(loaded[0].loadedBlocks, 1) << "the run ends at the truncated block";
  EXPECT_EQ(mSecond->coordinator->remoteTierCounters().rejectedBlocks, 1U);
  EXPECT_EQ(mSecond->serve(again), kPage);

  // Another deployment (other weights under the same geometry) never loads these blocks.
  std::unique_ptr<RemoteTierEngine> other = makeEngine("model-b");
  EXPECT_EQ(other->coordinator->lookupRemoteTier(admission).remoteTokens, 0);
  (void)other->coordinator->loadFromRemoteTier(admission);
  std::vector<RemoteLoadResult> const foreign = other->coordinator->drainRemoteTier();
  ASSERT_EQ(foreign.size(), 1U);
  EXPECT_EQ(foreign[0].loadedBlocks, 0);
  EXPECT_EQ(other->coordinator->remoteTierCounters().missingBlocks, 1U);
  Seq cold(test::concatenated(prompt, tokenRun(7, 900)), 0);
  EXPECT_EQ(other->serve(cold), 0);
}

TEST_P(RemoteTierCoordinatorTest, AValueOfAnotherPrefixUnderThisKeyIsRefused) {
  std::vector<int32_t> const prompt = tokenRun(2 * kPage + 5, 100);
  std::vector<int32_t> const otherPrompt = tokenRun(2 * kPage + 5, 4000);
  Seq first(prompt, 0);
  ASSERT_EQ(mFirst->serve(first), 0);
  Seq second(otherPrompt, 1);
  ASSERT_EQ(mFirst->serve(second), 0);
  (void)mFirst->coordinator->drainRemoteTier();
  valueOf(prompt, 0) = valueOf(otherPrompt, 0);  // a store handing back another block's bytes

  Seq again(prompt, 0);
  (void)mSecond->coordinator->loadFromRemoteTier(test::promptAdmissionOf(again));
  std::vector<RemoteLoadResult> const loaded = mSecond->coordinator->drainRemoteTier();
  ASSERT_EQ(loaded.size(), 1U);
  EXPECT_EQ(loaded[0].loadedBlocks, 0);
  EXPECT_EQ(mSecond->coordinator->remoteTierCounters().rejectedBlocks, 1U);
  EXPECT_EQ(mSecond->serve(again), 0);
}

TEST_P(RemoteTierCoordinatorTest, AStoreThatIsDownOrFullCostsMissesAndNothingElse) {
  std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
  mStore->down = true;
  Seq first(prompt, 0);
  ASSERT_EQ(mFirst->serve(first), 0);
  (void)mFirst->coordinator->drainRemoteTier();
  RemoteTierCounters const failed = mFirst->coordinator->remoteTierCounters();
  EXPECT_EQ(failed.saveFailures, 3U);
  EXPECT_EQ(failed.savedBlocks, 0U);
  EXPECT_EQ(mFirst->coordinator->manager().hostTier()->pinnedPages(), 0)
      << "a failed save releases its page";

  ContextCacheSequenceAdmission const admission = test::promptAdmissionOf(first);
  RemoteTierLookup const looked = mSecond->coordinator->lookupRemoteTier(admission);
  EXPECT_FALSE(looked.storeAvailable);
  EXPECT_EQ(looked.remoteTokens, 0);
  (void)mSecond->coordinator->loadFromRemoteTier(admission);
  std::vector<RemoteLoadResult> const loaded = mSecond->coordinator->drainRemoteTier();
  ASSERT_EQ(loaded.size(), 1U);
  EXPECT_FALSE(loaded[0].storeAvailable);
  EXPECT_EQ(loaded[0].loadedBlocks, 0);
  RemoteTierCounters const counters = mSecond->coordinator->remoteTierCounters();
  EXPECT_EQ(counters.lookupFailures, 1U);
  EXPECT_EQ(counters.loadFailures, 1U);
  Seq cold(prompt, 0);
  EXPECT_EQ(mSecond->serve(cold), 0) << "the engine goes on without the store";

  mStore->down = false;
  mStore->full = true;
  Seq other(tokenRun(2 * kPage, 3000), 1);
  ASSERT_EQ(mFirst->serve(other), 0);
  (void)mFirst->coordinator->drainRemoteTier();
  EXPECT_EQ(mFirst->coordinator->remoteTierCounters().saveFailures, 5U) << "refused as full";
  EXPECT_EQ(mFirst->coordinator->manager().hostTier()->pinnedPages(), 0);
}

TEST_P(RemoteTierCoordinatorTest, ASaveHoldsItsHostPageUntilItFinished) {
  mStore->putsBlocked = true;
  std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
  Seq first(prompt, 0);
  ASSERT_EQ(mFirst->serve(first), 0);
  (void)mFirst->coordinator->pollRemoteTier();  // hands the saves to the worker
  EXPECT_EQ(mFirst->coordinator->pendingRemoteSaves(), 3);
  EXPECT_EQ(mFirst->coordinator->manager().hostTier()->pinnedPages(), 3)
      << "the pages a save reads are held";
  // Evicting everything from the GPU and offloading more than the host tier holds cannot take
  // the held pages.
  for (int32_t i = 0; i < 3; ++i) {
    Seq filler(tokenRun(5 * kPage, 5000 + 1000 * i), 0);
    ASSERT_EQ(mFirst->serve(filler), 0);
  }
  HostBlockTier const& host = *mFirst->coordinator->manager().hostTier();
  PromptBlocks const blocks = hashPromptBlocks(PromptView{prompt, {}, {}}, kPage);
  for (int32_t b = 0; b < 3; ++b) {
    EXPECT_TRUE(host.index().find(blocks.keys[static_cast<std::size_t>(b)]).has_value()) << b;
  }
  EXPECT_EQ(mFirst->coordinator->pendingRemoteSaves(), host.pinnedPages());
  mStore->unblock();
  (void)mFirst->coordinator->drainRemoteTier();
  EXPECT_EQ(mFirst->coordinator->pendingRemoteSaves(), 0);
  EXPECT_EQ(host.pinnedPages(), 0);
  EXPECT_GE(mFirst->coordinator->remoteTierCounters().savedBlocks, 3U);

  Seq again(prompt, 0);
  (void)mSecond->coordinator->loadFromRemoteTier(test::promptAdmissionOf(again));
  std::vector<RemoteLoadResult> const loaded = mSecond->coordinator->drainRemoteTier();
  ASSERT_EQ(loaded.size(), 1U);
  EXPECT_EQ(loaded[0].loadedBlocks, 3);
  EXPECT_EQ(mSecond->serve(again), 3 * kPage) << "saved from the held pages, bit for bit";
}

TEST_P(RemoteTierCoordinatorTest, SavesBeyondTheBoundAreSkippedAndCounted) {
  RemoteTierConfig remote;
  remote.openStore = [store = mStore] { return std::make_unique<MemoryKvStore>(store); };
  remote.model = "model-a";
  remote.maxPendingSaves = 2;
  RemoteTierEngine bounded(device(), std::move(remote));
  mStore->putsBlocked = true;
  Seq first(tokenRun(3 * kPage + 5, 100), 0);
  ASSERT_EQ(bounded.serve(first), 0);
  EXPECT_EQ(bounded.coordinator->pendingRemoteSaves(), 2);
  EXPECT_EQ(bounded.coordinator->remoteTierCounters().savesSkipped, 1U);
  mStore->unblock();
  EXPECT_EQ(bounded.coordinator->shutdown(), ContextCacheStatus::kOk)
      << "shutdown waits for the saves";
  EXPECT_EQ(bounded.coordinator->remoteTierCounters().savedBlocks, 2U);
  EXPECT_EQ(bounded.coordinator->manager().hostTier()->pinnedPages(), 0);
}

TEST_P(RemoteTierCoordinatorTest, TheLookupChangesNothingInTheCache) {
  std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
  Seq first(prompt, 0);
  ASSERT_EQ(mFirst->serve(first), 0);
  (void)mFirst->coordinator->drainRemoteTier();
  (void)mSecond->coordinator->drainEvents();
  ContextCacheMetrics const before = mSecond->coordinator->metrics();
  RemoteTierLookup const looked =
      mSecond->coordinator->lookupRemoteTier(test::promptAdmissionOf(first));
  EXPECT_EQ(looked.remoteTokens, 3 * kPage);
  ContextCacheMetrics const after = mSecond->coordinator->metrics();
  EXPECT_EQ(after.lookups, before.lookups);
  EXPECT_EQ(after.matchedTokens, before.matchedTokens);
  EXPECT_EQ(after.queriedTokens, before.queriedTokens);
  EXPECT_TRUE(mSecond->coordinator->drainEvents().empty());
  EXPECT_EQ(mSecond->coordinator->manager().hostTier()->size(), 0);
}

TEST_P(RemoteTierCoordinatorTest, ContractViolationsNameTheCall) {
  ContextCacheSequenceAdmission empty;
  empty.resident = ResidentRef{0, 1};
  EXPECT_THROW(
      {
        try {
          (void)mFirst->coordinator->lookupRemoteTier(empty);
        } catch (Error const& error) {
          EXPECT_NE(std::string(error.what()).find("ContextCacheCoordinator::lookupRemoteTier"),
                    std::string::npos)
              << error.what();
          throw;
        }
      },
      Error);
  RemoteTierConfig noStore;
  EXPECT_THROW(RemoteTierEngine(device(), noStore), Error);
  RemoteTierConfig noHostTier;
  noHostTier.openStore = [store = mStore] { return std::make_unique<MemoryKvStore>(store); };
  EXPECT_THROW(RemoteTierEngine(device(), noHostTier, /*hostPages=*/0), Error);
  RemoteTierConfig badBound = noHostTier;
  badBound.maxBlocksPerLoad = 0;
  EXPECT_THROW(RemoteTierEngine(device(), badBound), Error);
}

INSTANTIATE_TEST_SUITE_P(Devices, RemoteTierCoordinatorTest, test::allDeviceTypes(),
                         test::deviceName);

}  // namespace
}  // namespace mkv
