#pragma once
/// \file remote_kv_store.h
/// A key-value store outside the process that holds KV blocks (the remote tier,
/// docs/context_cache.md, "Remote tier"): the transport only. What a key names and what a value
/// holds (a block's identity, tokens and bytes, verified at load) is the remote tier's business;
/// a store moves opaque byte strings. managedkv::remote implements it on Redis and on a shared
/// directory (mkv/remote/open_remote_kv_store.h).

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mkv {

/// Outcome of one store call. A missing key is not a failure (contains/get report it per key).
enum class RemoteStoreStatus : uint8_t {
  kOk,
  kUnavailable,  ///< no connection, a timeout or a broken reply: nothing is known of any key
  kRejected,     ///< the store refused the write (full, value too large, an error reply)
};

char const* toString(RemoteStoreStatus status) noexcept;

struct RemoteKvStoreOptions {
  /// Bound on each call's network time (connect, send, receive); past it the call is kUnavailable.
  std::chrono::milliseconds timeout{1000};
  /// Time to live of each value written, in seconds; 0 = none (the store's own eviction bounds it,
  /// e.g. Redis maxmemory with an allkeys policy).
  int64_t ttlSeconds = 0;
  /// Largest value get accepts; a longer one is treated as missing (a reply is never buffered
  /// beyond this).
  int64_t maxValueBytes = int64_t{256} << 20;
};

/// The transport. Implementations connect lazily and reconnect on the call after a failure;
/// they never throw for what the store or the network does (that is a status). One thread per
/// object: the remote tier opens one store for its worker and one for the engine thread's
/// lookups.
class RemoteKvStore {
 public:
  virtual ~RemoteKvStore() = default;

  /// held[i] = whether the store holds keys[i] (held is resized to keys.size(), all false unless
  /// kOk). One round trip where the store allows it.
  virtual RemoteStoreStatus contains(std::span<std::string const> keys,
                                     std::vector<uint8_t>& held) = 0;
  /// values[i] = the value of keys[i], or nullopt when it is missing or longer than
  /// maxValueBytes (values resized to keys.size(), all nullopt unless kOk).
  virtual RemoteStoreStatus get(std::span<std::string const> keys,
                                std::vector<std::optional<std::string>>& values) = 0;
  /// Writes `value` under `key` (replacing any), with the options' time to live.
  virtual RemoteStoreStatus put(std::string const& key, std::string_view value) = 0;
  /// The store's address for logs and reports, e.g. "redis://127.0.0.1:6379".
  virtual std::string describe() const = 0;
};

}  // namespace mkv
