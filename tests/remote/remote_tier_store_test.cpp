// The remote tier on real stores (docs/context_cache.md, "Remote tier"): two engines (each its own
// coordinator, pools and host tier) share a redis-server the test starts on loopback, or a
// directory; the second reuses prefixes only the first computed, the KV oracle checking every
// onboarded position; the server stopped in the middle of a run, or paused (slow), costs counted
// misses and the engines go on; on CPU and GPU tensors.

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>

#include "context_cache/remote_tier_engine.h"
#include "mkv/remote/open_remote_kv_store.h"
#include "mkv/remote_kv_store.h"
#include "support/redis_server.h"

namespace mkv {
namespace {

using test::RemoteTierEngine;
using test::Seq;
using test::tokenRun;

constexpr int32_t kPage = RemoteTierEngine::kPage;

std::unique_ptr<RemoteTierEngine> engineOn(DeviceType device, std::string const& url,
                                           std::chrono::milliseconds timeout) {
  RemoteTierConfig remote;
  remote.openStore = [url, timeout] {
    RemoteKvStoreOptions options;
    options.timeout = timeout;
    return openRemoteKvStore(url, options);
  };
  remote.model = "tiny";
  return std::make_unique<RemoteTierEngine>(device, std::move(remote));
}

/// Loads `seq`'s prompt into `engine`'s host tier from the store and returns the blocks loaded.
int32_t load(RemoteTierEngine& engine, Seq const& seq) {
  RemoteLoadStart const started =
      engine.coordinator->loadFromRemoteTier(test::promptAdmissionOf(seq));
  if (started.ticket == 0) {
    return 0;
  }
  std::vector<RemoteLoadResult> const results = engine.coordinator->drainRemoteTier();
  EXPECT_EQ(results.size(), 1U);
  return results.empty() ? -1 : results[0].loadedBlocks;
}

class RemoteTierRedisTest : public test::DeviceTest {};

TEST_P(RemoteTierRedisTest, TwoEnginesShareOneServerAndSurviveItsFaults) {
  test::RedisServer server;
  ASSERT_TRUE(server.start());
  std::unique_ptr<RemoteTierEngine> first =
      engineOn(device(), server.url(), std::chrono::milliseconds(300));
  std::unique_ptr<RemoteTierEngine> second =
      engineOn(device(), server.url(), std::chrono::milliseconds(300));

  std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
  Seq computed(prompt, 0);
  ASSERT_EQ(first->serve(computed), 0);
  (void)first->coordinator->drainRemoteTier();
  EXPECT_EQ(first->coordinator->remoteTierCounters().savedBlocks, 3U);

  Seq reused(test::concatenated(prompt, tokenRun(4, 700)), 0);
  EXPECT_EQ(second->coordinator->lookupRemoteTier(test::promptAdmissionOf(reused)).remoteTokens,
            3 * kPage);
  EXPECT_EQ(load(*second, reused), 3);
  EXPECT_EQ(second->serve(reused), 3 * kPage) << "the oracle read every onboarded position";

  // Stopped mid-run: lookups, loads and saves fail and are counted; serving goes on.
  server.stop();
  std::vector<int32_t> const other = tokenRun(2 * kPage + 3, 4000);
  Seq whileDown(other, 0);
  EXPECT_EQ(first->serve(whileDown), 0);
  (void)first->coordinator->drainRemoteTier();
  EXPECT_EQ(first->coordinator->remoteTierCounters().saveFailures, 2U);
  EXPECT_EQ(first->coordinator->manager().hostTier()->pinnedPages(), 0);
  Seq missed(other, 1);
  RemoteTierLookup const down =
      second->coordinator->lookupRemoteTier(test::promptAdmissionOf(missed));
  EXPECT_FALSE(down.storeAvailable);
  EXPECT_EQ(load(*second, missed), 0);
  EXPECT_EQ(second->coordinator->remoteTierCounters().loadFailures, 1U);
  EXPECT_EQ(second->serve(missed), 0);

  // Back (empty: nothing persisted): the engines reconnect and share again.
  ASSERT_TRUE(server.restart());
  std::vector<int32_t> const third = tokenRun(2 * kPage + 3, 9000);
  Seq again(third, 0);
  ASSERT_EQ(first->serve(again), 0);
  (void)first->coordinator->drainRemoteTier();
  Seq shared(third, 1);
  EXPECT_EQ(load(*second, shared), 2);
  EXPECT_EQ(second->serve(shared), 2 * kPage);

  // Paused (a store that does not answer): the lookup gives up within its timeout.
  server.pause();
  Seq unseen(tokenRun(2 * kPage, 12000), 0);  // held nowhere locally: the store is asked
  auto const before = std::chrono::steady_clock::now();
  EXPECT_FALSE(
      second->coordinator->lookupRemoteTier(test::promptAdmissionOf(unseen)).storeAvailable);
  EXPECT_LT(std::chrono::steady_clock::now() - before, std::chrono::seconds(10))
      << "a lookup of a store that does not answer returns (its timeout: 300 ms)";
  server.resume();
}

INSTANTIATE_TEST_SUITE_P(Devices, RemoteTierRedisTest, test::allDeviceTypes(), test::deviceName);

class RemoteTierDirectoryTest : public test::DeviceTest {};

TEST_P(RemoteTierDirectoryTest, TwoEnginesShareOneDirectory) {
  std::filesystem::path const folder =
      std::filesystem::temp_directory_path() / ("mkv_remote_tier_" + std::to_string(::getpid()) +
                                                (device() == DeviceType::kGPU ? "_gpu" : "_cpu"));
  std::filesystem::remove_all(folder);
  std::string const url = "file://" + folder.string();
  {
    std::unique_ptr<RemoteTierEngine> first = engineOn(device(), url, std::chrono::seconds(1));
    std::unique_ptr<RemoteTierEngine> second = engineOn(device(), url, std::chrono::seconds(1));
    std::vector<int32_t> const prompt = tokenRun(3 * kPage + 5, 100);
    Seq computed(prompt, 0);
    ASSERT_EQ(first->serve(computed), 0);
    (void)first->coordinator->drainRemoteTier();
    Seq reused(prompt, 0);
    EXPECT_EQ(load(*second, reused), 3);
    EXPECT_EQ(second->serve(reused), 3 * kPage);
  }
  std::filesystem::remove_all(folder);
}

INSTANTIATE_TEST_SUITE_P(Devices, RemoteTierDirectoryTest, test::allDeviceTypes(),
                         test::deviceName);

}  // namespace
}  // namespace mkv
