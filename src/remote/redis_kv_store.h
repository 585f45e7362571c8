#pragma once
/// \file redis_kv_store.h
/// RemoteKvStore on one Redis server through hiredis (internal; openRemoteKvStore opens it).
///
/// One blocking connection, opened on the first call and again on the call after any failure
/// (and before a call that finds the server closed the idle connection, e.g. after a restart or
/// Redis's `timeout`). Every call runs under one deadline of options.timeout covering connect,
/// send and receive: each socket operation waits at most the time left. A call that fails for the
/// network (no connection, a timeout, a closed or broken connection, a reply it cannot parse) or
/// receives an error reply to a read drops the connection and is kUnavailable; it never throws
/// for the network and never raises SIGPIPE.
///
/// Commands: contains = one EXISTS per key; get = EXISTS + GETRANGE key 0 maxValueBytes per key;
/// put = SET (with EX when ttlSeconds > 0); a call's commands are pipelined (one round trip).
/// GETRANGE bounds a reply to maxValueBytes + 1 bytes, so a longer value is reported missing
/// without being received whole (GET would make hiredis buffer all of it); EXISTS tells a missing
/// key from an empty value (an empty value deleted between the two commands reads as empty, the
/// only race, and no block is empty). Reads are allowed on a full server (maxmemory with
/// noeviction), where SET is refused: kRejected.
///
/// Redis Cluster is not supported: a MOVED or ASK error reply is kRejected for put and
/// kUnavailable for reads. The host name is resolved by getaddrinfo, which the timeout does not
/// bound (pass an address to avoid DNS).

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/remote_kv_store.h"

struct redisContext;
struct redisReply;

namespace mkv::remote {

class RedisKvStore final : public RemoteKvStore {
 public:
  /// A store on the server at `host`:`port` (not contacted here). Throws mkv::Error naming
  /// "openRemoteKvStore" for an empty host, a port outside 1..65535, a timeout under 1 ms, a
  /// negative ttlSeconds or maxValueBytes.
  RedisKvStore(std::string host, int port, RemoteKvStoreOptions const& options);

  RemoteStoreStatus contains(std::span<std::string const> keys,
                             std::vector<uint8_t>& held) override;
  RemoteStoreStatus get(std::span<std::string const> keys,
                        std::vector<std::optional<std::string>>& values) override;
  RemoteStoreStatus put(std::string const& key, std::string_view value) override;
  /// "redis://HOST:PORT".
  std::string describe() const override;

 private:
  using Deadline = std::chrono::steady_clock::time_point;
  struct ContextDeleter {
    void operator()(redisContext* context) const noexcept;
  };
  struct ReplyDeleter {
    void operator()(redisReply* reply) const noexcept;
  };
  using ContextPointer = std::unique_ptr<redisContext, ContextDeleter>;
  using ReplyPointer = std::unique_ptr<redisReply, ReplyDeleter>;

  /// A connection ready for commands (a new one when there is none or the server closed the idle
  /// one) before `deadline`; false (logged) when none could be opened.
  bool connect(Deadline deadline);
  /// Sends the commands appended to the connection and receives `replyCount` replies, all before
  /// `deadline`; nothing (the connection dropped, logged) on a network failure.
  std::optional<std::vector<ReplyPointer>> exchange(Deadline deadline, std::size_t replyCount);
  /// Drops the connection after a failure of `what` (`detail` may point into the connection),
  /// logging it when the store was available.
  void fail(std::string_view what, std::string_view detail);

  std::string mHost;
  int mPort;
  RemoteKvStoreOptions mOptions;
  ContextPointer mContext;  ///< null until the first call and after a failure
  bool mFailing = false;    ///< the last call failed (its failure was logged; the next is not)
};

}  // namespace mkv::remote
