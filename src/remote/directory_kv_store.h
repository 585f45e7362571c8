#pragma once
/// \file directory_kv_store.h
/// RemoteKvStore on a directory shared by the processes that open it (internal;
/// openRemoteKvStore opens it for `file:///DIR`): the shared-filesystem tier that vLLM and llm-d
/// ship, on a local disk, NFS or any POSIX filesystem with an atomic rename.
///
/// One file per key, `DIR/KEY` with ':' written as '=' (keys are `[A-Za-z0-9:_-]`, 1 to
/// kMaxKeyLength characters; any other key is refused by put and missing for contains and get).
/// put writes `DIR/.KEY.PID.N.tmp` and renames it over `DIR/KEY`, so a reader sees the old value
/// or the new one, never a part (the temporary names start with '.', which no key does: an
/// interrupted write's leftover is never read as a value, nor removed). Files are not synced:
/// after a machine crash a value may read short or empty, which the remote tier's verification
/// at load rejects. With ttlSeconds > 0 a file whose mtime is ttlSeconds or more in the past is
/// missing, and get unlinks it (only if it is still the file it found expired). Nothing else
/// removes files: the directory grows until its owner prunes it.
///
/// The timeout option does not apply (file calls are not bounded; a hung NFS server hangs the
/// call). Errors other than a missing file (ENOENT) are kUnavailable, and for put also a full
/// filesystem (ENOSPC, EDQUOT, EFBIG) is kRejected. Never throws after construction.

#include <cstddef>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/remote_kv_store.h"

namespace mkv::remote {

class DirectoryKvStore final : public RemoteKvStore {
 public:
  /// Longest key a directory store accepts (its temporary file name stays under NAME_MAX).
  static constexpr std::size_t kMaxKeyLength = 200;

  /// A store in `directory` (an absolute path), created with its parents when missing. Throws
  /// mkv::Error naming "openRemoteKvStore" and the directory for a relative path, a directory
  /// that cannot be created or a path that is not one, a negative ttlSeconds or maxValueBytes.
  DirectoryKvStore(std::filesystem::path const& directory, RemoteKvStoreOptions const& options);

  RemoteStoreStatus contains(std::span<std::string const> keys,
                             std::vector<uint8_t>& held) override;
  RemoteStoreStatus get(std::span<std::string const> keys,
                        std::vector<std::optional<std::string>>& values) override;
  RemoteStoreStatus put(std::string const& key, std::string_view value) override;
  /// "file://" followed by the directory (without a trailing '/').
  std::string describe() const override;

  /// The file that holds `key`'s value, or nothing for a key the store does not accept.
  std::optional<std::filesystem::path> fileOf(std::string_view key) const;

 private:
  /// `key`'s file name in the directory, or nothing for a key the store does not accept.
  static std::optional<std::string> fileName(std::string_view key);
  /// Logs a failed file call (once per run of failures) and returns kUnavailable, or kRejected
  /// when `rejected`.
  RemoteStoreStatus fail(std::string_view what, std::string const& path, int error,
                         bool rejected = false);
  /// Records a call that succeeded (the next failure is logged again).
  RemoteStoreStatus succeed();

  std::string mDirectory;  ///< absolute, no trailing '/' (but for the root)
  RemoteKvStoreOptions mOptions;
  bool mFailing = false;  ///< the last call failed (its failure was logged; the next is not)
};

}  // namespace mkv::remote
