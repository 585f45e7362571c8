#include "remote/directory_kv_store.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>
#include <utility>

#include "core/check.h"
#include "mkv/logging.h"

namespace mkv::remote {

namespace {

constexpr char const* kOpen = "openRemoteKvStore";

/// Numbers the temporary files of this process (every store object of it: two objects on one
/// directory must not pick the same name).
std::atomic<uint64_t> gTemporaryFiles{0};

/// Closes a file descriptor when it goes out of scope.
class FileDescriptor {
 public:
  explicit FileDescriptor(int descriptor) noexcept : mDescriptor(descriptor) {}
  ~FileDescriptor() {
    if (mDescriptor >= 0) {
      ::close(mDescriptor);
    }
  }
  FileDescriptor(FileDescriptor const&) = delete;
  FileDescriptor& operator=(FileDescriptor const&) = delete;

  int get() const noexcept { return mDescriptor; }
  /// Closes it now; the errno of a failed close (NFS reports write errors there), or 0.
  int close() noexcept {
    int const descriptor = std::exchange(mDescriptor, -1);
    return ::close(descriptor) == 0 ? 0 : errno;
  }

 private:
  int mDescriptor;
};

bool isKeyCharacter(char c) noexcept {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == ':' ||
         c == '_' || c == '-';
}

/// A lookup that finds no file.
bool isMissing(int error) noexcept { return error == ENOENT || error == ENOTDIR; }

/// A write the filesystem refused for space, rather than failed.
bool isFull(int error) noexcept { return error == ENOSPC || error == EDQUOT || error == EFBIG; }

/// Whether a file last modified at `info.st_mtim` has outlived `ttlSeconds` (0: never).
bool expired(struct stat const& info, int64_t ttlSeconds) noexcept {
  if (ttlSeconds <= 0) {
    return false;
  }
  auto const modified = std::chrono::system_clock::time_point(
      std::chrono::duration_cast<std::chrono::system_clock::duration>(
          std::chrono::seconds(info.st_mtim.tv_sec) +
          std::chrono::nanoseconds(info.st_mtim.tv_nsec)));
  return std::chrono::system_clock::now() - modified >= std::chrono::seconds(ttlSeconds);
}

/// Removes the expired file at `path` if it is still the one `info` describes (a writer may have
/// renamed a new value over it since; removing that would only cost a miss, but is avoided).
void removeExpired(std::string const& path, struct stat const& info, int64_t ttlSeconds) {
  struct stat current {};
  if (::stat(path.c_str(), &current) == 0 && current.st_dev == info.st_dev &&
      current.st_ino == info.st_ino && expired(current, ttlSeconds)) {
    ::unlink(path.c_str());
  }
}

}  // namespace

DirectoryKvStore::DirectoryKvStore(std::filesystem::path const& directory,
                                   RemoteKvStoreOptions const& options)
    : mDirectory(directory.string()), mOptions(options) {
  while (mDirectory.size() > 1 && mDirectory.back() == '/') {
    mDirectory.pop_back();
  }
  MKV_REQUIRE(directory.is_absolute(), kOpen, "{}: the directory is not an absolute path",
              describe());
  MKV_REQUIRE(mOptions.ttlSeconds >= 0, kOpen, "{}: ttlSeconds {}, expected >= 0", describe(),
              mOptions.ttlSeconds);
  MKV_REQUIRE(mOptions.maxValueBytes >= 0, kOpen, "{}: maxValueBytes {}, expected >= 0", describe(),
              mOptions.maxValueBytes);
  std::error_code error;
  std::filesystem::create_directories(mDirectory, error);
  MKV_REQUIRE(!error, kOpen, "{}: cannot create the directory: {}", describe(), error.message());
  MKV_REQUIRE(std::filesystem::is_directory(mDirectory, error), kOpen, "{}: not a directory",
              describe());
}

std::string DirectoryKvStore::describe() const { return "file://" + mDirectory; }

std::optional<std::string> DirectoryKvStore::fileName(std::string_view key) {
  if (key.empty() || key.size() > kMaxKeyLength) {
    return std::nullopt;
  }
  std::string name(key);
  for (char& c : name) {
    if (!isKeyCharacter(c)) {
      return std::nullopt;
    }
    if (c == ':') {
      c = '=';  // not a key character, so no two keys share a file
    }
  }
  return name;
}

std::optional<std::filesystem::path> DirectoryKvStore::fileOf(std::string_view key) const {
  std::optional<std::string> name = fileName(key);
  if (!name.has_value()) {
    return std::nullopt;
  }
  return std::filesystem::path(mDirectory) / *name;
}

RemoteStoreStatus DirectoryKvStore::fail(std::string_view what, std::string const& path, int error,
                                         bool rejected) {
  if (!mFailing) {
    logger()->warn("DirectoryKvStore {}: {} {} failed: {}", describe(), what, path,
                   std::strerror(error));
  }
  mFailing = true;
  return rejected ? RemoteStoreStatus::kRejected : RemoteStoreStatus::kUnavailable;
}

RemoteStoreStatus DirectoryKvStore::succeed() {
  mFailing = false;
  return RemoteStoreStatus::kOk;
}

RemoteStoreStatus DirectoryKvStore::contains(std::span<std::string const> keys,
                                             std::vector<uint8_t>& held) {
  held.assign(keys.size(), 0);
  std::vector<uint8_t> found(keys.size(), 0);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    std::optional<std::string> const name = fileName(keys[i]);
    if (!name.has_value()) {
      continue;
    }
    std::string const path = mDirectory + "/" + *name;
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0) {
      if (isMissing(errno)) {
        continue;
      }
      return fail("stat", path, errno);
    }
    found[i] = S_ISREG(info.st_mode) && !expired(info, mOptions.ttlSeconds) ? 1 : 0;
  }
  held = std::move(found);
  return succeed();
}

RemoteStoreStatus DirectoryKvStore::get(std::span<std::string const> keys,
                                        std::vector<std::optional<std::string>>& values) {
  values.assign(keys.size(), std::nullopt);
  std::vector<std::optional<std::string>> found(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    std::optional<std::string> const name = fileName(keys[i]);
    if (!name.has_value()) {
      continue;
    }
    std::string const path = mDirectory + "/" + *name;
    FileDescriptor file(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (file.get() < 0) {
      if (isMissing(errno)) {
        continue;
      }
      return fail("open", path, errno);
    }
    struct stat info {};
    if (::fstat(file.get(), &info) != 0) {
      return fail("fstat", path, errno);
    }
    if (!S_ISREG(info.st_mode) || info.st_size > mOptions.maxValueBytes) {
      continue;
    }
    if (expired(info, mOptions.ttlSeconds)) {
      removeExpired(path, info, mOptions.ttlSeconds);
      continue;
    }
    // The file is never written in place (put renames a new one over it): its size is final.
    std::string value(static_cast<std::size_t>(info.st_size), '\0');
    std::size_t done = 0;
    while (done < value.size()) {
      ssize_t const count = ::read(file.get(), value.data() + done, value.size() - done);
      if (count < 0) {
        if (errno == EINTR) {
          continue;
        }
        return fail("read", path, errno);
      }
      if (count == 0) {
        break;  // cut short in place by someone else: not a value
      }
      done += static_cast<std::size_t>(count);
    }
    if (done == value.size()) {
      found[i] = std::move(value);
    }
  }
  values = std::move(found);
  return succeed();
}

RemoteStoreStatus DirectoryKvStore::put(std::string const& key, std::string_view value) {
  std::optional<std::string> const name = fileName(key);
  if (!name.has_value()) {
    logger()->debug("DirectoryKvStore {}: refused key '{}' (not [A-Za-z0-9:_-]{{1,{}}})",
                    describe(), key, kMaxKeyLength);
    return RemoteStoreStatus::kRejected;
  }
  std::string const path = mDirectory + "/" + *name;
  std::string temporary;
  int descriptor = -1;
  while (descriptor < 0) {
    temporary = fmt::format("{}/.{}.{}.{}.tmp", mDirectory, *name, ::getpid(),
                            gTemporaryFiles.fetch_add(1, std::memory_order_relaxed));
    descriptor = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    int const error = errno;
    if (descriptor < 0 && error != EEXIST) {  // EEXIST: a leftover of a process with our pid
      return fail("create", temporary, error, isFull(error));
    }
  }
  FileDescriptor file(descriptor);
  auto const abandon = [&](std::string_view what, int error) {
    ::unlink(temporary.c_str());
    return fail(what, temporary, error, isFull(error));
  };
  std::size_t done = 0;
  while (done < value.size()) {
    ssize_t const count = ::write(file.get(), value.data() + done, value.size() - done);
    if (count < 0) {
      if (errno == EINTR) {
        continue;
      }
      return abandon("write", errno);
    }
    done += static_cast<std::size_t>(count);
  }
  if (int const error = file.close(); error != 0) {
    return abandon("close", error);
  }
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    return abandon("rename", errno);
  }
  return succeed();
}

}  // namespace mkv::remote
