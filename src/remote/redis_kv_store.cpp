#include "remote/redis_kv_store.h"

#include <hiredis/hiredis.h>
#include <poll.h>
#include <pthread.h>
#include <spdlog/spdlog.h>
#include <sys/time.h>

#include <cerrno>
#include <csignal>
#include <ctime>
#include <utility>

#include "core/check.h"
#include "mkv/logging.h"

namespace mkv::remote {

namespace {

constexpr char const* kOpen = "openRemoteKvStore";
constexpr int kMaxPort = 65535;

/// The signal set holding SIGPIPE alone.
sigset_t onlySigpipe() noexcept {
  sigset_t signals{};
  sigemptyset(&signals);
  sigaddset(&signals, SIGPIPE);
  return signals;
}

/// Whether a SIGPIPE is pending for the calling thread or the process.
bool sigpipePending() noexcept {
  sigset_t pending{};
  sigemptyset(&pending);
  return sigpending(&pending) == 0 && sigismember(&pending, SIGPIPE) == 1;
}

/// Blocks SIGPIPE in the calling thread while alive, so that writing to a connection the server
/// closed fails with EPIPE instead of killing the process (hiredis writes with write(), not
/// send(MSG_NOSIGNAL)); a SIGPIPE raised meanwhile is consumed before the mask is restored,
/// unless one was already pending. The process's signal dispositions are left alone.
class SigpipeBlock {
 public:
  SigpipeBlock() noexcept
      : mWasPending(sigpipePending()),
        mBlocked(pthread_sigmask(SIG_BLOCK, &mPipe, &mPrevious) == 0) {}
  ~SigpipeBlock() {
    if (!mBlocked) {
      return;
    }
    if (!mWasPending && sigpipePending()) {
      timespec const noWait{};
      while (sigtimedwait(&mPipe, nullptr, &noWait) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &mPrevious, nullptr);
  }
  SigpipeBlock(SigpipeBlock const&) = delete;
  SigpipeBlock& operator=(SigpipeBlock const&) = delete;

 private:
  sigset_t const mPipe = onlySigpipe();
  sigset_t mPrevious{};  ///< the thread's mask before, restored
  bool const mWasPending;
  bool const mBlocked;
};

/// The time left before `deadline` as a timeval, or nothing when under a millisecond is left
/// (hiredis reads a zero timeout as none).
std::optional<timeval> timeLeft(std::chrono::steady_clock::time_point deadline) {
  auto const left = std::chrono::duration_cast<std::chrono::microseconds>(
      deadline - std::chrono::steady_clock::now());
  if (left < std::chrono::milliseconds(1)) {
    return std::nullopt;
  }
  auto const seconds = std::chrono::duration_cast<std::chrono::seconds>(left);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(seconds.count());
  tv.tv_usec = static_cast<suseconds_t>((left - seconds).count());
  return tv;
}

/// Bounds the next socket operation of `context` by the time left before `deadline`.
bool boundNextOperation(redisContext* context, std::chrono::steady_clock::time_point deadline) {
  std::optional<timeval> const left = timeLeft(deadline);
  return left.has_value() && redisSetTimeout(context, *left) == REDIS_OK;
}

/// hiredis copies %b arguments with memcpy, which must not be handed a null pointer.
char const* bytes(std::string_view text) noexcept { return text.empty() ? "" : text.data(); }

std::string_view errorText(redisContext const* context) {
  return context == nullptr ? std::string_view("out of memory") : std::string_view(context->errstr);
}

}  // namespace

void RedisKvStore::ContextDeleter::operator()(redisContext* context) const noexcept {
  redisFree(context);
}

void RedisKvStore::ReplyDeleter::operator()(redisReply* reply) const noexcept {
  freeReplyObject(reply);
}

RedisKvStore::RedisKvStore(std::string host, int port, RemoteKvStoreOptions const& options)
    : mHost(std::move(host)), mPort(port), mOptions(options) {
  MKV_REQUIRE(!mHost.empty(), kOpen, "redis://{}:{}: empty host", mHost, mPort);
  MKV_REQUIRE(mPort >= 1 && mPort <= kMaxPort, kOpen, "redis://{}:{}: port {} outside 1..{}", mHost,
              mPort, mPort, kMaxPort);
  MKV_REQUIRE(mOptions.timeout >= std::chrono::milliseconds(1), kOpen,
              "{}: timeout {} ms, expected at least 1 ms", describe(), mOptions.timeout.count());
  MKV_REQUIRE(mOptions.ttlSeconds >= 0, kOpen, "{}: ttlSeconds {}, expected >= 0", describe(),
              mOptions.ttlSeconds);
  MKV_REQUIRE(mOptions.maxValueBytes >= 0, kOpen, "{}: maxValueBytes {}, expected >= 0", describe(),
              mOptions.maxValueBytes);
}

std::string RedisKvStore::describe() const { return fmt::format("redis://{}:{}", mHost, mPort); }

void RedisKvStore::fail(std::string_view what, std::string_view detail) {
  if (!mFailing) {
    logger()->warn("RedisKvStore {}: {} failed: {}; unavailable until a call reconnects",
                   describe(), what, detail);
  }
  mFailing = true;
  mContext.reset();  // last: `detail` may be the connection's error text
}

bool RedisKvStore::connect(Deadline deadline) {
  if (mContext) {
    // Redis sends nothing unasked to a client outside pub/sub: a readable idle connection is one
    // the server closed (a restart, its idle `timeout`), which the next write would find broken.
    pollfd idle{mContext->fd, POLLIN, 0};
    if (poll(&idle, 1, 0) == 0) {
      return true;
    }
    mContext.reset();
  }
  std::optional<timeval> const left = timeLeft(deadline);
  if (!left.has_value()) {
    fail("connect", "timed out");
    return false;
  }
  ContextPointer context(redisConnectWithTimeout(mHost.c_str(), mPort, *left));
  if (context == nullptr || context->err != 0) {
    fail("connect", errorText(context.get()));
    return false;
  }
  mContext = std::move(context);
  return true;
}

std::optional<std::vector<RedisKvStore::ReplyPointer>> RedisKvStore::exchange(
    Deadline deadline, std::size_t replyCount) {
  redisContext* context = mContext.get();
  {
    SigpipeBlock const noSigpipe;
    int done = 0;
    while (done == 0) {
      if (!boundNextOperation(context, deadline)) {
        fail("send", "timed out");
        return std::nullopt;
      }
      if (redisBufferWrite(context, &done) != REDIS_OK) {
        fail("send", errorText(context));
        return std::nullopt;
      }
    }
  }
  std::vector<ReplyPointer> replies;
  replies.reserve(replyCount);
  while (replies.size() < replyCount) {
    void* reply = nullptr;
    if (redisGetReplyFromReader(context, &reply) != REDIS_OK) {
      fail("receive", errorText(context));
      return std::nullopt;
    }
    if (reply != nullptr) {
      replies.emplace_back(static_cast<redisReply*>(reply));
      continue;
    }
    if (!boundNextOperation(context, deadline)) {
      fail("receive", "timed out");
      return std::nullopt;
    }
    if (redisBufferRead(context) != REDIS_OK) {
      fail("receive", errorText(context));
      return std::nullopt;
    }
  }
  if (mFailing) {
    logger()->info("RedisKvStore {}: available again", describe());
    mFailing = false;
  }
  return replies;
}

RemoteStoreStatus RedisKvStore::contains(std::span<std::string const> keys,
                                         std::vector<uint8_t>& held) {
  held.assign(keys.size(), 0);
  if (keys.empty()) {
    return RemoteStoreStatus::kOk;
  }
  Deadline const deadline = std::chrono::steady_clock::now() + mOptions.timeout;
  if (!connect(deadline)) {
    return RemoteStoreStatus::kUnavailable;
  }
  for (std::string const& key : keys) {
    if (redisAppendCommand(mContext.get(), "EXISTS %b", bytes(key), key.size()) != REDIS_OK) {
      fail("EXISTS", errorText(mContext.get()));
      return RemoteStoreStatus::kUnavailable;
    }
  }
  std::optional<std::vector<ReplyPointer>> const replies = exchange(deadline, keys.size());
  if (!replies.has_value()) {
    return RemoteStoreStatus::kUnavailable;
  }
  std::vector<uint8_t> found(keys.size(), 0);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    redisReply const& reply = *(*replies)[i];
    if (reply.type != REDIS_REPLY_INTEGER) {
      fail("EXISTS", reply.type == REDIS_REPLY_ERROR ? std::string_view(reply.str, reply.len)
                                                     : "a reply that is not an integer");
      return RemoteStoreStatus::kUnavailable;
    }
    found[i] = reply.integer > 0 ? 1 : 0;
  }
  held = std::move(found);
  return RemoteStoreStatus::kOk;
}

RemoteStoreStatus RedisKvStore::get(std::span<std::string const> keys,
                                    std::vector<std::optional<std::string>>& values) {
  values.assign(keys.size(), std::nullopt);
  if (keys.empty()) {
    return RemoteStoreStatus::kOk;
  }
  Deadline const deadline = std::chrono::steady_clock::now() + mOptions.timeout;
  if (!connect(deadline)) {
    return RemoteStoreStatus::kUnavailable;
  }
  // GETRANGE's end is inclusive: a reply longer than maxValueBytes has maxValueBytes + 1 bytes.
  auto const lastByte = static_cast<long long>(mOptions.maxValueBytes);
  for (std::string const& key : keys) {
    if (redisAppendCommand(mContext.get(), "EXISTS %b", bytes(key), key.size()) != REDIS_OK ||
        redisAppendCommand(mContext.get(), "GETRANGE %b 0 %lld", bytes(key), key.size(),
                           lastByte) != REDIS_OK) {
      fail("GETRANGE", errorText(mContext.get()));
      return RemoteStoreStatus::kUnavailable;
    }
  }
  std::optional<std::vector<ReplyPointer>> const replies = exchange(deadline, 2 * keys.size());
  if (!replies.has_value()) {
    return RemoteStoreStatus::kUnavailable;
  }
  std::vector<std::optional<std::string>> found(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    redisReply const& exists = *(*replies)[2 * i];
    redisReply const& range = *(*replies)[2 * i + 1];
    for (redisReply const* reply : {&exists, &range}) {
      if (reply->type == REDIS_REPLY_ERROR) {
        fail("GETRANGE", std::string_view(reply->str, reply->len));
        return RemoteStoreStatus::kUnavailable;
      }
    }
    if (exists.type != REDIS_REPLY_INTEGER || range.type != REDIS_REPLY_STRING) {
      fail("GETRANGE", "a reply of an unexpected type");
      return RemoteStoreStatus::kUnavailable;
    }
    bool const tooLong = static_cast<unsigned long long>(range.len) >
                         static_cast<unsigned long long>(mOptions.maxValueBytes);
    bool const missing = range.len == 0 && exists.integer == 0;
    if (!tooLong && !missing) {
      found[i].emplace(range.str, range.len);
    }
  }
  values = std::move(found);
  return RemoteStoreStatus::kOk;
}

RemoteStoreStatus RedisKvStore::put(std::string const& key, std::string_view value) {
  Deadline const deadline = std::chrono::steady_clock::now() + mOptions.timeout;
  if (!connect(deadline)) {
    return RemoteStoreStatus::kUnavailable;
  }
  int const appended = mOptions.ttlSeconds > 0
                           ? redisAppendCommand(mContext.get(), "SET %b %b EX %lld", bytes(key),
                                                key.size(), bytes(value), value.size(),
                                                static_cast<long long>(mOptions.ttlSeconds))
                           : redisAppendCommand(mContext.get(), "SET %b %b", bytes(key), key.size(),
                                                bytes(value), value.size());
  if (appended != REDIS_OK) {
    fail("SET", errorText(mContext.get()));
    return RemoteStoreStatus::kUnavailable;
  }
  std::optional<std::vector<ReplyPointer>> const replies = exchange(deadline, 1);
  if (!replies.has_value()) {
    return RemoteStoreStatus::kUnavailable;
  }
  redisReply const& reply = *replies->front();
  if (reply.type == REDIS_REPLY_STATUS) {
    return RemoteStoreStatus::kOk;
  }
  if (reply.type == REDIS_REPLY_ERROR) {
    // The connection is still in step (one command, one reply): a refusal (OOM under maxmemory
    // with noeviction, a value over proto-max-bulk-len, MOVED from a cluster) keeps it.
    logger()->debug("RedisKvStore {}: SET refused: {}", describe(),
                    std::string_view(reply.str, reply.len));
    return RemoteStoreStatus::kRejected;
  }
  fail("SET", "a reply of an unexpected type");
  return RemoteStoreStatus::kUnavailable;
}

}  // namespace mkv::remote
