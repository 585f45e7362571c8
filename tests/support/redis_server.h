#pragma once
/// \file redis_server.h
/// A redis-server of the test's own, for suites that test the remote tier on Redis: started from
/// PATH on a free port of 127.0.0.1, without persistence, its files (log, working directory) in a
/// temporary folder removed with it. Nothing here contacts any other address. A missing
/// redis-server fails the test (scripts/install-deps.sh installs it); it is never skipped.
///
///   test::RedisServer server;
///   ASSERT_TRUE(server.start({"--maxmemory", "2mb", "--maxmemory-policy", "noeviction"}));
///   auto store = openRemoteKvStore(server.url());
///
/// One thread drives it (the test's).

#include <gtest/gtest.h>
#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace mkv::test {

class RedisServer {
 public:
  /// The address the server listens on, the only one.
  static constexpr char const* kHost = "127.0.0.1";

  RedisServer() = default;
  /// Stops the server when it runs (resuming it first when paused) and removes its folder.
  ~RedisServer();
  RedisServer(RedisServer const&) = delete;
  RedisServer& operator=(RedisServer const&) = delete;

  /// Starts `redis-server --port P --bind 127.0.0.1 --save "" --appendonly no --daemonize no
  /// --protected-mode yes --dir FOLDER` followed by `extraArguments` (e.g. {"--maxmemory", "1mb"}),
  /// its output in FOLDER/redis.log, P a free port (another is tried when the first is taken
  /// meanwhile); returns once it answers PING with PONG, within 5 s. The failure says why:
  /// redis-server not on PATH, exited (with the log's tail), no answer in time. Once per object.
  ::testing::AssertionResult start(std::vector<std::string> extraArguments = {});
  /// SIGTERM (SIGCONT too, when paused), then waits for the exit (SIGKILL after 5 s). Keeps the
  /// port and folder for restart(). Nothing when not running.
  void stop();
  /// Starts it again after stop(), on the same port with the same arguments (an empty server:
  /// nothing is persisted), and waits for PONG as start() does.
  ::testing::AssertionResult restart();
  /// SIGSTOP: the server answers nothing, its connections stay open and the kernel still accepts
  /// new ones into its backlog (so a client connects, then times out waiting for a reply).
  void pause();
  /// SIGCONT after pause(): it answers again, the requests queued meanwhile first.
  void resume();
  /// FLUSHALL over a connection of its own (fails when the server does not answer OK in 2 s).
  ::testing::AssertionResult flushAll();

  /// The port it listens on (0 before start()).
  int port() const noexcept { return mPort; }
  /// "redis://127.0.0.1:PORT", for openRemoteKvStore.
  std::string url() const;
  /// Whether the process runs (paused included).
  bool running() const noexcept { return mPid > 0; }
  bool paused() const noexcept { return mPaused; }
  /// The server's log (stdout and stderr).
  std::filesystem::path logPath() const { return mFolder / "redis.log"; }

  /// A loopback port nothing listened on a moment ago (bound to 127.0.0.1:0, read, released).
  static int freeLoopbackPort();

 private:
  /// Forks and execs the server on mPort; waits for PONG (false: the process is reaped).
  ::testing::AssertionResult launch();
  /// The last lines of the server's log, for failure messages.
  std::string logTail() const;

  std::string mExecutable;  ///< redis-server's path, found on PATH by start()
  std::vector<std::string> mExtraArguments;
  std::filesystem::path mFolder;  ///< temporary: log and working directory
  int mPort = 0;
  pid_t mPid = -1;  ///< the running server, -1 when none
  bool mPaused = false;
};

}  // namespace mkv::test
