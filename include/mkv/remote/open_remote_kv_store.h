#pragma once
/// \file open_remote_kv_store.h
/// Opens the remote tier's transport (mkv/remote_kv_store.h) by URL; part of managedkv::remote
/// (libmanagedkv_remote.a, which links hiredis).

#include <memory>
#include <string_view>

#include "mkv/remote_kv_store.h"

namespace mkv {

/// Opens the store at `url`:
///   * `redis://HOST:PORT` or `redis://HOST` (port 6379): a Redis server (one node, not Redis
///     Cluster), HOST an IPv4 address or a host name; values are written with SET (EX when
///     options.ttlSeconds > 0) and read with EXISTS + GETRANGE, so a value longer than
///     options.maxValueBytes is never received beyond maxValueBytes + 1 bytes.
///   * `file:///ABSOLUTE/DIR`: a directory shared by the processes that open it (a shared
///     filesystem tier), one file per key, written to a temporary file then renamed; created
///     when missing. Keys are `[A-Za-z0-9:_-]`, at most 200 characters.
/// Nothing is contacted here: a Redis store connects on its first call (an unreachable server is
/// kUnavailable then, not an error now). Throws mkv::Error naming "openRemoteKvStore" and `url`
/// for a malformed URL, an unknown scheme, a port outside 1..65535, a relative or empty path, a
/// directory that cannot be created, and options out of range (timeout < 1 ms, ttlSeconds < 0,
/// maxValueBytes < 0). The store's describe() is the URL in its canonical form (the port
/// spelled out), which opens the same store again.
std::unique_ptr<RemoteKvStore> openRemoteKvStore(std::string_view url,
                                                 RemoteKvStoreOptions const& options = {});

}  // namespace mkv
