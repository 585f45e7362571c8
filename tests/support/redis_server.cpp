#include "support/redis_server.h"

#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string_view>
#include <thread>

namespace mkv::test {

namespace {

using Clock = std::chrono::steady_clock;

constexpr auto kReadyWithin = std::chrono::seconds(5);
constexpr auto kExitWithin = std::chrono::seconds(5);
constexpr int kStartAttempts = 3;

struct ContextDeleter {
  void operator()(redisContext* context) const noexcept { redisFree(context); }
};
struct ReplyDeleter {
  void operator()(redisReply* reply) const noexcept { freeReplyObject(reply); }
};

/// The reply to `command` (no arguments) from the server on the loopback `port`, or null when it
/// cannot be reached within `timeout`.
std::unique_ptr<redisReply, ReplyDeleter> ask(int port, char const* command,
                                              std::chrono::milliseconds timeout) {
  timeval const limit{static_cast<time_t>(timeout.count() / 1000),
                      static_cast<suseconds_t>(timeout.count() % 1000 * 1000)};
  std::unique_ptr<redisContext, ContextDeleter> context(
      redisConnectWithTimeout(RedisServer::kHost, port, limit));
  if (context == nullptr || context->err != 0 ||
      redisSetTimeout(context.get(), limit) != REDIS_OK) {
    return nullptr;
  }
  return std::unique_ptr<redisReply, ReplyDeleter>(
      static_cast<redisReply*>(redisCommand(context.get(), command)));
}

bool isStatus(redisReply const* reply, std::string_view status) {
  return reply != nullptr && reply->type == REDIS_REPLY_STATUS &&
         std::string_view(reply->str, reply->len) == status;
}

/// `name`'s path in a folder of $PATH, or nothing.
std::optional<std::string> findOnPath(std::string_view name) {
  char const* path = std::getenv("PATH");
  std::stringstream folders(path == nullptr ? "" : path);
  for (std::string folder; std::getline(folders, folder, ':');) {
    std::string const candidate =
        (folder.empty() ? std::string(".") : folder) + "/" + std::string(name);
    if (::access(candidate.c_str(), X_OK) == 0) {
      return candidate;
    }
  }
  return std::nullopt;
}

std::string describeExit(int status) {
  if (WIFEXITED(status)) {
    return "exited with status " + std::to_string(WEXITSTATUS(status));
  }
  if (WIFSIGNALED(status)) {
    return "was killed by signal " + std::to_string(WTERMSIG(status));
  }
  return "stopped";
}

}  // namespace

RedisServer::~RedisServer() {
  stop();
  if (!mFolder.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(mFolder, ignored);
  }
}

std::string RedisServer::url() const {
  std::string address = "redis://";
  address += kHost;
  address += ':';
  address += std::to_string(mPort);
  return address;
}

int RedisServer::freeLoopbackPort() {
  int const probe = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (probe < 0) {
    return 0;
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = 0;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t size = sizeof address;
  int port = 0;
  if (::bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(probe, reinterpret_cast<sockaddr*>(&address), &size) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(probe);
  return port;
}

::testing::AssertionResult RedisServer::start(std::vector<std::string> extraArguments) {
  if (!mFolder.empty()) {
    return ::testing::AssertionFailure() << "RedisServer::start: called twice (use restart())";
  }
  std::optional<std::string> executable = findOnPath("redis-server");
  if (!executable.has_value()) {
    return ::testing::AssertionFailure()
           << "redis-server is not on PATH: scripts/install-deps.sh installs it (Debian package "
              "redis-server). The remote-tier tests start their own server on 127.0.0.1 and are "
              "never skipped.";
  }
  mExecutable = std::move(*executable);
  mExtraArguments = std::move(extraArguments);
  std::string pattern = (std::filesystem::temp_directory_path() / "mkv-redis-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    return ::testing::AssertionFailure()
           << "RedisServer::start: mkdtemp " << pattern << ": " << std::strerror(errno);
  }
  mFolder = pattern;
  ::testing::AssertionResult result = ::testing::AssertionFailure();
  for (int attempt = 0; attempt < kStartAttempts && !result; ++attempt) {
    mPort = freeLoopbackPort();  // another process may take it before the server binds it
    if (mPort == 0) {
      return ::testing::AssertionFailure() << "RedisServer::start: no free port on " << kHost;
    }
    result = launch();
  }
  return result;
}

::testing::AssertionResult RedisServer::restart() {
  if (mFolder.empty() || mPid > 0) {
    return ::testing::AssertionFailure() << "RedisServer::restart: start() and stop() first";
  }
  return launch();
}

::testing::AssertionResult RedisServer::launch() {
  std::vector<std::string> arguments = {mExecutable,
                                        "--port",
                                        std::to_string(mPort),
                                        "--bind",
                                        kHost,
                                        "--save",
                                        "",
                                        "--appendonly",
                                        "no",
                                        "--daemonize",
                                        "no",
                                        "--protected-mode",
                                        "yes",
                                        "--dir",
                                        mFolder.string()};
  arguments.insert(arguments.end(), mExtraArguments.begin(), mExtraArguments.end());
  std::vector<char*> argv;
  argv.reserve(arguments.size() + 1);
  for (std::string& argument : arguments) {
    argv.push_back(argument.data());
  }
  argv.push_back(nullptr);
  int const log = ::open(logPath().c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) {
    return ::testing::AssertionFailure()
           << "RedisServer: cannot open " << logPath() << ": " << std::strerror(errno);
  }
  pid_t const parent = ::getpid();
  pid_t const child = ::fork();
  if (child == 0) {
    // Only async-signal-safe calls between fork and exec. The server dies with the test process.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) {
      ::_exit(126);
    }
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(log);
  if (child < 0) {
    return ::testing::AssertionFailure() << "RedisServer: fork: " << std::strerror(errno);
  }
  mPid = child;
  mPaused = false;
  Clock::time_point const deadline = Clock::now() + kReadyWithin;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(mPid, &status, WNOHANG) == mPid) {
      mPid = -1;
      return ::testing::AssertionFailure()
             << "redis-server on port " << mPort << " " << describeExit(status)
             << " before answering PING; " << logPath() << " ends:\n"
             << logTail();
    }
    if (isStatus(ask(mPort, "PING", std::chrono::milliseconds(200)).get(), "PONG")) {
      return ::testing::AssertionSuccess();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop();
  return ::testing::AssertionFailure()
         << "redis-server on port " << mPort << " did not answer PING within 5 s; " << logPath()
         << " ends:\n"
         << logTail();
}

void RedisServer::stop() {
  if (mPid <= 0) {
    return;
  }
  ::kill(mPid, SIGTERM);
  if (mPaused) {
    ::kill(mPid, SIGCONT);
    mPaused = false;
  }
  Clock::time_point const deadline = Clock::now() + kExitWithin;
  int status = 0;
  while (::waitpid(mPid, &status, WNOHANG) == 0) {
    if (Clock::now() >= deadline) {
      ::kill(mPid, SIGKILL);
      ::waitpid(mPid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  mPid = -1;
}

void RedisServer::pause() {
  if (mPid > 0 && !mPaused) {
    ::kill(mPid, SIGSTOP);
    mPaused = true;
  }
}

void RedisServer::resume() {
  if (mPid > 0 && mPaused) {
    ::kill(mPid, SIGCONT);
    mPaused = false;
  }
}

::testing::AssertionResult RedisServer::flushAll() {
  if (mPid <= 0 || mPaused) {
    return ::testing::AssertionFailure() << "RedisServer::flushAll: the server is not answering";
  }
  auto const reply = ask(mPort, "FLUSHALL", std::chrono::milliseconds(2000));
  if (!isStatus(reply.get(), "OK")) {
    return ::testing::AssertionFailure() << "FLUSHALL on " << url() << " did not answer OK";
  }
  return ::testing::AssertionSuccess();
}

std::string RedisServer::logTail() const {
  constexpr std::size_t kLines = 20;
  std::ifstream log(logPath());
  std::vector<std::string> lines;
  for (std::string line; std::getline(log, line);) {
    lines.push_back(std::move(line));
  }
  std::string tail;
  for (std::size_t i = lines.size() > kLines ? lines.size() - kLines : 0; i < lines.size(); ++i) {
    tail += lines[i] + "\n";
  }
  return tail;
}

}  // namespace mkv::test
