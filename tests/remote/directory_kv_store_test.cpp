// RemoteKvStore on a shared directory (remote/directory_kv_store.h): values, missing keys, two
// stores on one directory, interrupted writes, time to live, the size bound and the key rules.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "mkv/remote/open_remote_kv_store.h"
#include "mkv/remote_kv_store.h"
#include "remote/directory_kv_store.h"

namespace mkv {
namespace {

namespace fs = std::filesystem;

std::string randomBytes(std::size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> byte(0, 255);
  std::string bytes(count, '\0');
  for (char& c : bytes) {
    c = static_cast<char>(byte(rng));
  }
  return bytes;
}

void writeFile(fs::path const& path, std::string const& bytes) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(file.good()) << path;
}

/// Sets the modification time of `path` to `age` ago.
void age(fs::path const& path, std::chrono::seconds age) {
  timespec times[2];
  ASSERT_EQ(clock_gettime(CLOCK_REALTIME, &times[0]), 0);
  times[0].tv_sec -= static_cast<time_t>(age.count());
  times[1] = times[0];
  ASSERT_EQ(utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path;
}

class DirectoryKvStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "mkv-directory-store-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    mRoot = pattern;
    mDirectory = mRoot / "store";
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(mRoot, ignored);
  }

  std::unique_ptr<remote::DirectoryKvStore> open(RemoteKvStoreOptions const& options = {}) {
    return std::make_unique<remote::DirectoryKvStore>(mDirectory, options);
  }
  /// The files in the store's directory, by name.
  std::vector<std::string> files() const {
    std::vector<std::string> names;
    for (fs::directory_entry const& entry : fs::directory_iterator(mDirectory)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path mRoot;       ///< temporary, removed after the test
  fs::path mDirectory;  ///< the store's directory, under mRoot (created by the store)
};

TEST_F(DirectoryKvStoreTest, RoundTripsBinaryValues) {
  auto store = open();
  EXPECT_TRUE(fs::is_directory(mDirectory)) << "the store creates its directory";
  std::string const withNuls("\0a\0\0b\xff\0", 7);
  std::string const mebibyte = randomBytes(std::size_t{1} << 20, 1);
  ASSERT_EQ(store->put("block:nul", withNuls), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("block:big", mebibyte), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("block:empty", ""), RemoteStoreStatus::kOk);

  std::vector<std::string> const keys = {"block:big", "block:missing", "block:nul", "block:empty"};
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  ASSERT_EQ(values.size(), keys.size());
  ASSERT_TRUE(values[0].has_value());
  EXPECT_TRUE(*values[0] == mebibyte) << "the 1 MiB value came back different";
  EXPECT_EQ(values[1], std::nullopt);
  EXPECT_EQ(values[2], withNuls);
  EXPECT_EQ(values[3], std::string());

  ASSERT_EQ(store->put("block:nul", "replaced"), RemoteStoreStatus::kOk);
  std::vector<std::string> const one = {"block:nul"};
  ASSERT_EQ(store->get(one, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{"replaced"}));
  // One file per key, ':' written as '=', no temporary file left.
  EXPECT_EQ(files(), (std::vector<std::string>{"block=big", "block=empty", "block=nul"}));
  EXPECT_EQ(store->describe(), "file://" + mDirectory.string());
}

TEST_F(DirectoryKvStoreTest, MissingKeysAreNeitherHeldNorRead) {
  auto store = open();
  std::vector<std::string> const keys = {"never:1", "never:2"};
  std::vector<uint8_t> held = {7};
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{0, 0}));
  std::vector<std::optional<std::string>> values = {"stale"};
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>(2)));
  // A folder where a key's file would be is not a value.
  fs::create_directory(mDirectory / "folder");
  std::vector<std::string> const folder = {"folder"};
  ASSERT_EQ(store->contains(folder, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{0}));
  ASSERT_EQ(store->get(folder, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>(1)));
}

TEST_F(DirectoryKvStoreTest, ContainsAndGetAnswerOneHundredKeys) {
  auto store = open();
  std::vector<std::string> keys;
  keys.reserve(100);
  for (int i = 0; i < 100; ++i) {
    keys.push_back("k" + std::to_string(i));
  }
  for (std::size_t i = 0; i < keys.size(); i += 2) {
    ASSERT_EQ(store->put(keys[i], "value" + keys[i]), RemoteStoreStatus::kOk);
  }
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    bool const written = i % 2 == 0;
    EXPECT_EQ(held[i], written ? 1 : 0) << keys[i];
    EXPECT_EQ(values[i], written ? std::optional<std::string>("value" + keys[i]) : std::nullopt);
  }
}

// The sharing property: what one store writes, another store on the same directory (another
// process in production, opened by URL here) reads, and the other way round.
TEST_F(DirectoryKvStoreTest, TwoStoresOnOneDirectorySeeEachOthersWrites) {
  std::string const url = "file://" + mDirectory.string();
  std::unique_ptr<RemoteKvStore> writer = openRemoteKvStore(url);
  std::unique_ptr<RemoteKvStore> reader = openRemoteKvStore(url + "/");
  EXPECT_EQ(reader->describe(), writer->describe());
  std::vector<std::string> const keys = {"shared:block"};
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(reader->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values[0], std::nullopt);

  ASSERT_EQ(writer->put("shared:block", "first"), RemoteStoreStatus::kOk);
  std::vector<uint8_t> held;
  ASSERT_EQ(reader->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{1}));
  ASSERT_EQ(reader->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values[0], "first");

  ASSERT_EQ(reader->put("shared:block", "second"), RemoteStoreStatus::kOk);
  ASSERT_EQ(writer->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values[0], "second");
}

// A writer that died between creating its temporary file and renaming it leaves the file behind:
// it is never read as the key's value, and the next write of the key succeeds beside it.
TEST_F(DirectoryKvStoreTest, InterruptedWriteIsNeverReadAsAValue) {
  auto store = open();
  std::string const leftover = ".block=a.12345.0.tmp";
  writeFile(mDirectory / leftover, "half of a val");
  std::vector<std::string> const keys = {"block:a"};
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{0}));
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values[0], std::nullopt);

  ASSERT_EQ(store->put("block:a", "the whole value"), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values[0], "the whole value");
  EXPECT_EQ(files(), (std::vector<std::string>{leftover, "block=a"}));
  // No key can name a temporary file: keys never hold '.'.
  EXPECT_EQ(store->put(leftover, "x"), RemoteStoreStatus::kRejected);
}

TEST_F(DirectoryKvStoreTest, FileOlderThanTheTimeToLiveIsMissingAndRemoved) {
  RemoteKvStoreOptions options;
  options.ttlSeconds = 60;
  auto store = open(options);
  ASSERT_EQ(store->put("ttl:old", "old"), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("ttl:young", "young"), RemoteStoreStatus::kOk);
  age(*store->fileOf("ttl:old"), std::chrono::seconds(61));
  age(*store->fileOf("ttl:young"), std::chrono::seconds(50));

  std::vector<std::string> const keys = {"ttl:old", "ttl:young"};
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{0, 1}));
  EXPECT_TRUE(fs::exists(*store->fileOf("ttl:old"))) << "contains removes nothing";
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{std::nullopt, "young"}));
  EXPECT_FALSE(fs::exists(*store->fileOf("ttl:old"))) << "get removes an expired file";

  // Without a time to live, age does not matter; a rewrite makes a value young again.
  auto lasting = open();
  age(*store->fileOf("ttl:young"), std::chrono::seconds(3600));
  ASSERT_EQ(lasting->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{0, 1}));
  ASSERT_EQ(store->put("ttl:young", "again"), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{std::nullopt, "again"}));
}

TEST_F(DirectoryKvStoreTest, ValueLongerThanMaxValueBytesIsMissing) {
  RemoteKvStoreOptions options;
  options.maxValueBytes = 1000;
  auto store = open(options);
  std::string const fits = randomBytes(1000, 2);
  ASSERT_EQ(store->put("size:fits", fits), RemoteStoreStatus::kOk);
  ASSERT_EQ(store->put("size:over", randomBytes(1001, 3)), RemoteStoreStatus::kOk);
  std::vector<std::string> const keys = {"size:fits", "size:over"};
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(keys, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>{fits, std::nullopt}));
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(keys, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, (std::vector<uint8_t>{1, 1}));
}

TEST_F(DirectoryKvStoreTest, KeysOutsideTheAlphabetAreRefusedAndMissing) {
  auto store = open();
  std::vector<std::string> const bad = {
      "",          "a/b",
      "../escape", "a.b",
      "a b",       "tab\t",
      "é",         std::string("a\0b", 3),
      "/abs",      std::string(remote::DirectoryKvStore::kMaxKeyLength + 1, 'k')};
  for (std::string const& key : bad) {
    EXPECT_EQ(store->put(key, "v"), RemoteStoreStatus::kRejected) << "key '" << key << "'";
    EXPECT_EQ(store->fileOf(key), std::nullopt);
  }
  std::vector<uint8_t> held;
  ASSERT_EQ(store->contains(bad, held), RemoteStoreStatus::kOk);
  EXPECT_EQ(held, std::vector<uint8_t>(bad.size(), 0));
  std::vector<std::optional<std::string>> values;
  ASSERT_EQ(store->get(bad, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(values, std::vector<std::optional<std::string>>(bad.size()));
  EXPECT_TRUE(files().empty());
  EXPECT_FALSE(fs::exists(mRoot / "escape"));

  // Every character of the alphabet, the longest key, and two keys that differ by ':' / '_'.
  std::string const longest(remote::DirectoryKvStore::kMaxKeyLength, 'k');
  std::vector<std::string> const good = {"AZaz09:_-", longest, "a:b", "a_b"};
  for (std::string const& key : good) {
    EXPECT_EQ(store->put(key, "value of " + key), RemoteStoreStatus::kOk) << key;
  }
  ASSERT_EQ(store->get(good, values), RemoteStoreStatus::kOk);
  for (std::size_t i = 0; i < good.size(); ++i) {
    EXPECT_EQ(values[i], "value of " + good[i]);
  }
}

TEST_F(DirectoryKvStoreTest, FileErrorsOtherThanMissingAreUnavailable) {
  auto store = open();
  // A symbolic link to itself: ELOOP, an error (permissions would not do: tests may run as root).
  fs::create_symlink(mDirectory / "loop", mDirectory / "loop");
  std::vector<std::string> const keys = {"loop"};
  std::vector<uint8_t> held = {1};
  EXPECT_EQ(store->contains(keys, held), RemoteStoreStatus::kUnavailable);
  EXPECT_EQ(held, (std::vector<uint8_t>{0}));
  std::vector<std::optional<std::string>> values = {"stale"};
  EXPECT_EQ(store->get(keys, values), RemoteStoreStatus::kUnavailable);
  EXPECT_EQ(values, (std::vector<std::optional<std::string>>(1)));

  // The directory removed under the store: reads find nothing, a write cannot be made.
  fs::remove_all(mDirectory);
  std::vector<std::string> const other = {"gone"};
  EXPECT_EQ(store->get(other, values), RemoteStoreStatus::kOk);
  EXPECT_EQ(store->put("gone", "v"), RemoteStoreStatus::kUnavailable);
}

}  // namespace
}  // namespace mkv
