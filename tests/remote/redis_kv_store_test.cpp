// RemoteKvStore on Redis (remote/redis_kv_store.h) against a redis-server of the test's own on
// 127.0.0.1 (test::RedisServer): values, missing keys, one round trip per call, time to live, the
// size bound, a full server, and a server stopped, restarted and paused under a live store.

#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mkv/remote/open_remote_kv_store.h"
#include "mkv/remote_kv_store.h"
#include "remote/redis_kv_store.h"
#include "support/redis_server.h"

namespace mkv {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

/// The bound every failing call must return within: its timeout plus this (generous: a
/// correctness bound, not a measurement).
constexpr milliseconds kSlack{5000};

std::string randomBytes(std::size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string bytes(count, '\0');
  for (char& c : bytes) {
    c = static_cast<char>(byte(rng));
  }
  return bytes;
}

std::vector<std::string> numberedKeys(std::string const& prefix, int count) {
  std::vector<std::string> keys;
  keys.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) {
    keys.push_back(prefix + std::to_string(i));
  }
  return keys;
}

/// How long `call` took.
template <typename Call>
milliseconds timed(Call&& call) {
  Clock::time_point const started = Clock::now();
  call();
  return std::chrono::duration_cast<milliseconds>(Clock::now() - started);
}

/// A connection of the test's own to the server, for what the store does not show (TTL, types).
class RawRedis {
 public:
  explicit RawRedis(int port)
      : mContext(redisConnectWithTimeout(test::RedisServer::kHost, port, timeval{2, 0})) {}
  RawRedis(RawRedis const&) = delete;
  RawRedis& operator=(RawRedis const&) = delete;
  ~RawRedis() {
    if (mContext != nullptr) {
      redisFree(mContext);
    }
  }
  /// The integer reply to `command` with one key argument (`TTL %b`, `RPUSH %b x`), or nothing.
  std::optional<long long> integer(char const* format, std::string const& key) {
    if (mContext == nullptr || mContext->err != 0) {
      return std::nullopt;
    }
    auto* reply = static_cast<redisReply*>(redisCommand(mContext, format, key.data(), key.size()));
    std::optional<long long> value;
    if (reply != nullptr && reply->type == REDIS_REPLY_INTEGER) {
      value = reply->integer;
    }
    if (reply != nullptr) {
      freeReplyObject(reply);
    }
    return value;
  }

 private:
  redisContext* mContext;
};

/// A one-connection TCP server on 127.0.0.1 scripted by the test: accepts one connection, reads
/// until `ready` holds for what it received (or 5 s pass), sends `answer`, then closes the
/// connection when `closeAfterAnswer` or else keeps it until the client closes it.
class ScriptedServer {
 public:
  ScriptedServer(std::function<bool(std::string const&)> ready, std::string answer,
                 bool closeAfterAnswer)
      : mListener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t size = sizeof address;
    EXPECT_EQ(::bind(mListener, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
    EXPECT_EQ(::listen(mListener, 1), 0);
    EXPECT_EQ(::getsockname(mListener, reinterpret_cast<sockaddr*>(&address), &size), 0);
    mPort = ntohs(address.sin_port);
    mThread = std::thread([this, ready = std::move(ready), answer = std::move(answer),
                           closeAfterAnswer] { serve(ready, answer, closeAfterAnswer); });
  }
  ScriptedServer(ScriptedServer const&) = delete;
  ScriptedServer& operator=(ScriptedServer const&) = delete;
  ~ScriptedServer() { finish(); }

  int port() const { return mPort; }
  /// Stops serving (the client should have closed its connection first) and returns what the
  /// server received.
  std::string finish() {
    mStop = true;
    if (mThread.joinable()) {
      mThread.join();
      ::close(mListener);
    }
    return mReceived;
  }

 private:
  /// Waits up to 5 s (or until finish()) for `fd` to be readable; false when it is not.
  bool readable(int fd) const {
    for (int waited = 0; waited < 5000 && !mStop; waited += 20) {
      pollfd item{fd, POLLIN, 0};
      if (::poll(&item, 1, 20) > 0) {
        return true;
      }
    }
    return false;
  }

  void serve(std::function<bool(std::string const&)> const& ready, std::string const& answer,
             bool closeAfterAnswer) {
    if (!readable(mListener)) {
      return;
    }
    int const connection = ::accept4(mListener, nullptr, nullptr, SOCK_CLOEXEC);
    if (connection < 0) {
      return;
    }
    std::string received;
    std::vector<char> buffer(1 << 16);
    while (!ready(received) && readable(connection)) {
      ssize_t const count = ::read(connection, buffer.data(), buffer.size());
      if (count <= 0) {
        break;
      }
      received.append(buffer.data(), static_cast<std::size_t>(count));
    }
    if (ready(received)) {
      std::size_t sent = 0;
      while (sent < answer.size()) {
        ssize_t const count =
            ::send(connection, answer.data() + sent, answer.size() - sent, MSG_NOSIGNAL);
        if (count <= 0) {
          break;
        }
        sent += static_cast<std::size_t>(count);
      }
    }
    while (!closeAfterAnswer && readable(connection)) {  // until the client closes it
      if (::read(connection, buffer.data(), buffer.size()) <= 0) {
        break;
      }
    }
    ::close(connection);
    mReceived = std::move(received);
  }

  int mListener;
  int mPort = 0;
  std::atomic<bool> mStop{false};
  std::string mReceived;  ///< written by the thread before it ends, read after join
  std::thread mThread;
};

std::size_t occurrences(std::string const& text, std::string const& word) {
  std::size_t count = 0;
  for (std::size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    ++count;
  }
  return count;
}

class RedisKvStoreTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(mServer.start()); }

  std::unique_ptr<RemoteKvStore> open(RemoteKvStoreOptions const& options = {}) {
    return openRemoteKvStore(mServer.url(), options);
  }

  test::RedisServer mServer;
};

TEST_F(RedisKvStoreTest, RoundTripsBinaryValues) {
  std::unique_ptr<RemoteKvStore> store = open();
  std::string const withNuls("\0a\0\0b\xff\0", 7);
  std::string const mebibyte = randomBytes(std::size_t{1} << 20, 1);
  ASSERT_EQ(store->put("block:nul", withNuls), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("block:big", mebibyte), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("block:empty", ""), RemoteStoreStatus::kOk);
  std::string const binaryKey("key\0with\nbytes", 14);
  ASSERT_EQ(store->put(binaryKey, "v"), RemoteStoreStatus::kOk);

  std::vector<std::string> const keys = {"block:big", "block:missing", "block:nul", "block:empty",
                                         binaryKey};
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  ASSERT_EQ(values.size(), keys.size());
  ASSERT_TRUE(values[0].has_value());
  EXPECT_TRUE(*values[0] == mebibyte) << "the 1 MiB value came back different";
  EXPECT_EQ(values[1], std::nullopt);
  EXPECT_EQ(values[2], withNuls);
  EXPECT_EQ(values[3], std::string());  // an empty value is a value, not a missing key
  EXPECT_EQ(values[4], "v");

  ASSERT_EQ(store->put("block:nul", "replaced"), RemoteStoreStatus::kOk);
  std::vector<std::string> const one = {"block:nul"};
  ASSERT_EQ(store->get(one, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{"replaced"}));
  EXPECT_EQ(store->describe(), mServer.url());
}

TEST_F(RedisKvStoreTest, MissingKeysAreNeitherHeldNorRead) {
  std::unique_ptr<RemoteKvStore> store = open();
  std::vector<std::string> const keys = {"never:1", "never:2", ""};
  std::vector<uint8_t> held = {7};
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{0, 0, 0}));
  std::vector<std::optional<std::string>> values = {"stale"};
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>(3)));

  // No keys: nothing to ask, and the outputs are emptied.
  ASSERT_EQ(store->contains({}, held), RemoteStoreStatus::kOk);
  EXPECT_TRUE(held.empty());
  ASSERT_EQ(store->get({}, values), RemoteStoreStatus::kOk);
  EXPECT_TRUE(values.empty());
}

TEST_F(RedisKvStoreTest, ContainsAndGetAnswerOneHundredKeys) {
  std::unique_ptr<RemoteKvStore> store = open();
  std::vector<std::string> const keys = numberedKeys("k", 100);
  for (std::size_t i = 0; i < keys.size(); i += 2) {
    ASSERT_EQ(store->put(keys[i], "value" + keys[i]), RemoteStoreStatus::kOk);
  }
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  ASSERT_EQ(held.size(), keys.size());
  ASSERT_EQ(values.size(), keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    bool const written = i % 2 == 0;
    EXPECT_EQ(held[i], written ? 1 : 0) << keys[i];
    EXPECT_EQ(values[i], written ? std::optional<std::string>("value" + keys[i]) : std::nullopt)
        << keys[i];
  }
}

// One round trip: a server that answers nothing until it has received all 100 EXISTS commands.
// A store that waited for each reply before sending the next command would time out instead.
TEST(RedisKvStorePipelineTest, ContainsSendsEveryKeyBeforeReadingAReply) {
  constexpr int kKeys = 100;
  std::string answer;
  for (int i = 0; i < kKeys; ++i) {
    answer += i % 3 == 0 ? ":1\r\n" : ":0\r\n";
  }
  ScriptedServer server(
      [](std::string const& received) { return occurrences(received, "EXISTS") == kKeys; }, answer,
      /*closeAfterAnswer=*/false);
  RemoteKvStoreOptions options;
  options.timeout = milliseconds(1000);
  auto store = std::make_unique<remote::RedisKvStore>("127.0.0.1", server.port(), options);
  std::vector<std::string> const keys = numberedKeys("pipelined:", kKeys);
  std::vector<uint8_t> held;
  EXPECT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  ASSERT_EQ(held.size(), keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(held[i], i % 3 == 0 ? 1 : 0) << keys[i];
  }
  store.reset();  // closes the connection: the scripted server stops waiting
  std::string const received = server.finish();
  EXPECT_EQ(occurrences(received, "EXISTS"), std::size_t{kKeys});
  EXPECT_NE(received.find("pipelined:99"), std::string::npos);
}

TEST_F(RedisKvStoreTest, TimeToLiveIsSetOnEachWrite) {
  RemoteKvStoreOptions options;
  options.ttlSeconds = 100;
  std::unique_ptr<RemoteKvStore> expiring = open(options);
  std::unique_ptr<RemoteKvStore> lasting = open();
  ASSERT_EQ(expiring->put("ttl:expiring", "v"), RemoteStoreStatus::kOk);
  ASSERT_EQ(lasting->put("ttl:lasting", "v"), RemoteStoreStatus::kOk);

  RawRedis raw(mServer.port());
  std::optional<long long> const ttl = raw.integer("TTL %b", "ttl:expiring");
  ASSERT_TRUE(ttl.has_value());
  EXPECT_GT(*ttl, 0);
  EXPECT_LE(*ttl, 100);
  EXPECT_EQ(raw.integer("TTL %b", "ttl:lasting"), -1);  // -1: no expiry

  // A rewrite by the expiring store sets the time to live again.
  ASSERT_EQ(expiring->put("ttl:lasting", "w"), RemoteStoreStatus::kOk);
  std::optional<long long> const renewed = raw.integer("TTL %b", "ttl:lasting");
  ASSERT_TRUE(renewed.has_value());
  EXPECT_GT(*renewed, 0);
}

TEST_F(RedisKvStoreTest, ValueLongerThanMaxValueBytesIsMissing) {
  RemoteKvStoreOptions options;
  options.maxValueBytes = 1000;
  std::unique_ptr<RemoteKvStore> store = open(options);
  std::string const fits = randomBytes(1000, 2);
  ASSERT_EQ(store->put("size:fits", fits), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("size:over", randomBytes(1001, 3)), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("size:far-over", randomBytes(std::size_t{1} << 20, 4)),
            RemoteStoreStatus::kOk);

  std::vector<std::string> const keys = {"size:fits", "size:over", "size:far-over"};
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{fits, std::nullopt, std::nullopt}));
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{1, 1, 1}));  // held, only too long to read

  options.maxValueBytes = 0;
  std::unique_ptr<RemoteKvStore> emptyOnly = open(options);
  ASSERT_EQ(store->put("size:empty", ""), RemoteStoreStatus::kOk);
  std::vector<std::string> const small = {"size:empty", "size:fits"};
  ASSERT_EQ(emptyOnly->get(small, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{std::string(), std::nullopt}));
}

TEST(RedisKvStoreFullTest, FullServerRejectsWritesAndStillServesReads) {
  test::RedisServer server;
  ASSERT_TRUE(server.start({"--maxmemory", "2mb", "--maxmemory-policy", "noeviction"}));
  std::unique_ptr<RemoteKvStore> store = openRemoteKvStore(server.url());
  ASSERT_EQ(store->put("full:kept", "kept value"), RemoteStoreStatus::kOk);

  std::string const chunk = randomBytes(64 << 10, 5);
  RemoteStoreStatus status = RemoteStoreStatus::kOk;
  int written = 0;
  for (; written < 200 && status == RemoteStoreStatus::kOk; ++written) {
    status = store->put("full:" + std::to_string(written), chunk);
  }
  ASSERT_EQ(status, RemoteStoreStatus::kRejected)
      << "2 MiB of maxmemory still took " << written << " values of 64 KiB";
  EXPECT_GT(written, 1);
  // Refused, not broken: the connection stays, reads work, and so does the next refusal.
  std::vector<std::string> const keys = {"full:kept", "full:0"};
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values[0], "kept value");
  EXPECT_EQ(values[1], chunk);
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{1, 1}));
  EXPECT_EQ(store->put("full:again", chunk), RemoteStoreStatus::kRejected);

  ASSERT_TRUE(server.flushAll());
  EXPECT_EQ(store->put("full:again", chunk), RemoteStoreStatus::kOk);
}

TEST_F(RedisKvStoreTest, StoppedServerIsUnavailableUntilItIsBack) {
  RemoteKvStoreOptions options;
  options.timeout = milliseconds(500);
  std::unique_ptr<RemoteKvStore> store = open(options);
  ASSERT_EQ(store->put("stop:a", "before"), RemoteStoreStatus::kOk);
  std::vector<std::string> const keys = {"stop:a", "stop:b"};
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);

  mServer.stop();
  std::string const big = randomBytes(std::size_t{4} << 20, 6);
  for (int round = 0; round < 2; ++round) {  // the live connection's failure, then refusals
    milliseconds const took = timed([&] {
      EXPECT_EQ(store->put("stop:big", big), RemoteStoreStatus::kUnavailable);
      held = {1};
      EXPECT_EQ(store->contains(keys, held), RemoteStoreStatus::kUnavailable);
      EXPECT_EQ(held, (std::vector<uint8_t>{0, 0}));
      std::vector<std::optional<std::string>> values = {"stale"};
      EXPECT_EQ(store->get(keys, values), RemoteStoreStatus::kUnavailable);
      EXPECT_EQ(values, (std::vector<std::optional<std::string>>(2)));
    });
    EXPECT_LT(took, 3 * (options.timeout + kSlack)) << "three calls, round " << round;
  }

  ASSERT_TRUE(mServer.restart());  // an empty server: nothing was persisted
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{0, 0}));
  ASSERT_EQ(store->put("stop:a", "after"), RemoteStoreStatus::kOk);
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{"after", std::nullopt}));
}

// The server restarts between two calls: the store finds its idle connection closed and opens a
// new one, so the first call after the restart already succeeds.
TEST_F(RedisKvStoreTest, IdleConnectionClosedByARestartIsReopenedAtOnce) {
  std::unique_ptr<RemoteKvStore> store = open();
  ASSERT_EQ(store->put("restart:a", "v"), RemoteStoreStatus::kOk);
  mServer.stop();
  ASSERT_TRUE(mServer.restart());
  EXPECT_EQ(store->put("restart:a", "w"), RemoteStoreStatus::kOk);
  std::vector<std::string> const keys = {"restart:a"};
  std::vector<std::optional<std::string>> values;
  EXPECT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{"w"}));
}

TEST_F(RedisKvStoreTest, PausedServerTimesOutThenAnswersOnceResumed) {
  RemoteKvStoreOptions options;
  options.timeout = milliseconds(200);
  std::unique_ptr<RemoteKvStore> store = open(options);
  ASSERT_EQ(store->put("pause:a", "v"), RemoteStoreStatus::kOk);
  std::vector<std::string> const keys = {"pause:a"};
  std::vector<std::optional<std::string>> values;

  mServer.pause();
  // On the open connection, then on a new one (the kernel accepts it for the stopped server),
  // then with a write larger than the socket buffers can take.
  milliseconds took =
      timed([&] { EXPECT_EQ(store->get(keys, values), RemoteStoreStatus::kUnavailable); });
  EXPECT_GE(took, milliseconds(150)) << "gave up before the timeout";
  EXPECT_LT(took, options.timeout + kSlack);
  took = timed([&] {
    std::vector<uint8_t> held;
    EXPECT_EQ(store->contains(keys, held), RemoteStoreStatus::kUnavailable);
  });
  EXPECT_LT(took, options.timeout + kSlack);
  std::string const big = randomBytes(std::size_t{32} << 20, 7);  // made before the clock starts
  took = timed([&] { EXPECT_EQ(store->put("pause:big", big), RemoteStoreStatus::kUnavailable); });
  EXPECT_LT(took, options.timeout + kSlack);

  mServer.resume();
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{"v"}));
}

TEST(RedisKvStoreRefusedTest, NothingListeningIsUnavailable) {
  int const port = test::RedisServer::freeLoopbackPort();
  ASSERT_GT(port, 0);
  RemoteKvStoreOptions options;
  options.timeout = milliseconds(300);
  std::unique_ptr<RemoteKvStore> store =
      openRemoteKvStore("redis://127.0.0.1:" + std::to_string(port), options);
  std::vector<std::string> const keys = {"a"};
  milliseconds const took = timed([&] {
    std::vector<uint8_t> held;
    EXPECT_EQ(store->contains(keys, held), RemoteStoreStatus::kUnavailable);
    std::vector<std::optional<std::string>> values;
    EXPECT_EQ(store->get(keys, values), RemoteStoreStatus::kUnavailable);
    EXPECT_EQ(values.size(), 1U);
    EXPECT_EQ(store->put("a", "v"), RemoteStoreStatus::kUnavailable);
  });
  EXPECT_LT(took, 3 * (options.timeout + kSlack));
}

// A server that drops the connection while a large value is being sent: the write fails with
// EPIPE, which must be a status, not a SIGPIPE that ends the process.
TEST(RedisKvStoreBrokenConnectionTest, ConnectionClosedDuringAWriteIsUnavailable) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    ScriptedServer server([](std::string const&) { return true; }, "",
                          /*closeAfterAnswer=*/true);
    RemoteKvStoreOptions options;
    options.timeout = milliseconds(1000);
    remote::RedisKvStore store("127.0.0.1", server.port(), options);
    EXPECT_EQ(store.put("broken", randomBytes(std::size_t{16} << 20, 8)),
              RemoteStoreStatus::kUnavailable);
  }
}

TEST_F(RedisKvStoreTest, ErrorReplyToAReadIsUnavailableAndTheNextCallReconnects) {
  std::unique_ptr<RemoteKvStore> store = open();
  RawRedis raw(mServer.port());
  ASSERT_EQ(raw.integer("RPUSH %b x", "list:key"), 1);  // GETRANGE on a list: WRONGTYPE
  ASSERT_EQ(store->put("string:key", "v"), RemoteStoreStatus::kOk);
  std::vector<std::string> const keys = {"string:key", "list:key"};
  std::vector<std::optional<std::string>> values;
  EXPECT_EQ(store->get(keys, values), RemoteStoreStatus::kUnavailable);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>(2)));
  std::vector<std::string> const good = {"string:key"};
  ASSERT_EQ(store->get(good, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{"v"}));
  std::vector<uint8_t> held;
  EXPECT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);  // EXISTS takes any type
  EXPECT_EQ(held, (std::vector<uint8_t>{1, 1}));
}

}  // namespace
}  // namespace mkv
