// openRemoteKvStore (mkv/remote/open_remote_kv_store.h): the URLs it takes, the errors it throws,
// and describe() naming each store by a URL that opens it again. Nothing here is contacted.

#include "mkv/remote/open_remote_kv_store.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "mkv/error.h"
#include "mkv/remote_kv_store.h"
#include "support/redis_server.h"
#include "support/test_util.h"

namespace mkv {
namespace {

namespace fs = std::filesystem;
using test::throwsError;

class OpenRemoteKvStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = (fs::temp_directory_path() / "mkv-open-store-XXXXXX").string();
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    mRoot = pattern;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(mRoot, ignored);
  }

  fs::path mRoot;  ///< temporary, removed after the test
};

TEST(RemoteStoreStatusTest, NamesEachStatus) {
  EXPECT_STREQ(toString(RemoteStoreStatus::kOk), "ok");
  EXPECT_STREQ(toString(RemoteStoreStatus::kUnavailable), "unavailable");
  EXPECT_STREQ(toString(RemoteStoreStatus::kRejected), "rejected");
}

// Lazy: a store opens on a port nothing listens on; describe() spells the port out.
TEST_F(OpenRemoteKvStoreTest, RedisUrlsOpenWithoutConnecting) {
  int const port = test::RedisServer::freeLoopbackPort();
  ASSERT_GT(port, 0);
  std::string const url = "redis://127.0.0.1:" + std::to_string(port);
  EXPECT_EQ(openRemoteKvStore(url)->describe(), url);
  EXPECT_EQ(openRemoteKvStore("redis://cache-host.example")->describe(),
            "redis://cache-host.example:6379");
  EXPECT_EQ(openRemoteKvStore("REDIS://10.1.2.3:1")->describe(), "redis://10.1.2.3:1");
  EXPECT_EQ(openRemoteKvStore("redis://h:65535")->describe(), "redis://h:65535");
  EXPECT_EQ(openRemoteKvStore("redis://h:06379")->describe(), "redis://h:6379");
}

TEST_F(OpenRemoteKvStoreTest, FileUrlOpensAnAbsoluteDirectoryAndCreatesIt) {
  fs::path const directory = mRoot / "a" / "b";
  std::unique_ptr<RemoteKvStore> store = openRemoteKvStore("file://" + directory.string());
  EXPECT_TRUE(fs::is_directory(directory));
  EXPECT_EQ(store->describe(), "file://" + directory.string());
  EXPECT_EQ(openRemoteKvStore("file://" + directory.string() + "//")->describe(),
            store->describe());
  EXPECT_EQ(store->put("k", "v"), RemoteStoreStatus::kOk);
  EXPECT_TRUE(fs::is_regular_file(directory / "k"));
}

TEST_F(OpenRemoteKvStoreTest, DescribeOpensTheSameStoreAgain) {
  std::vector<std::string> const urls = {"redis://127.0.0.1:7000", "redis://localhost",
                                         "file://" + (mRoot / "dir").string() + "/"};
  for (std::string const& url : urls) {
    std::string const described = openRemoteKvStore(url)->describe();
    EXPECT_EQ(openRemoteKvStore(described)->describe(), described) << url;
  }
}

TEST_F(OpenRemoteKvStoreTest, MalformedUrlsThrowNamingTheCallAndTheUrl) {
  std::vector<std::string> const urls = {
      "",                     // nothing
      "redis",                // no scheme separator
      "127.0.0.1:6379",       // no scheme
      "http://host:80",       // unknown scheme
      "dir:///tmp/x",         // not a synonym
      "redis://",             // no host
      "redis://:6379",        // no host
      "redis://h:",           // empty port
      "redis://h:0",          // port out of range
      "redis://h:65536",      // port out of range
      "redis://h:123456",     // too many digits
      "redis://h:-1",         // sign
      "redis://h:+1",         // sign
      "redis://h:63a",        // not a number
      "redis://h:6379/0",     // database number
      "redis://u:p@h:6379",   // credentials
      "redis://h?x=1",        // options
      "redis://[::1]:6379",   // IPv6
      "redis://h h:1",        // a space
      "file://",              // no path
      "file://relative/dir",  // a host or a relative path
      "file:relative",        // no "//"
  };
  for (std::string const& url : urls) {
    EXPECT_TRUE(throwsError([&] { openRemoteKvStore(url); }, {"openRemoteKvStore", url}))
        << "url '" << url << "'";
  }
}

TEST_F(OpenRemoteKvStoreTest, OptionsOutOfRangeThrow) {
  std::string const file = "file://" + (mRoot / "dir").string();
  for (std::string const& url : {std::string("redis://127.0.0.1:7000"), file}) {
    RemoteKvStoreOptions options;
    options.ttlSeconds = -1;
    EXPECT_TRUE(throwsError([&] { openRemoteKvStore(url, options); },
                            {"openRemoteKvStore", url, "ttlSeconds -1"}));
    options = {};
    options.maxValueBytes = -1;
    EXPECT_TRUE(throwsError([&] { openRemoteKvStore(url, options); },
                            {"openRemoteKvStore", url, "maxValueBytes -1"}));
  }
  RemoteKvStoreOptions options;
  options.timeout = std::chrono::milliseconds(0);
  EXPECT_TRUE(throwsError([&] { openRemoteKvStore("redis://127.0.0.1:7000", options); },
                          {"openRemoteKvStore", "redis://127.0.0.1:7000", "timeout 0 ms"}));
}

TEST_F(OpenRemoteKvStoreTest, DirectoryThatCannotBeCreatedThrows) {
  fs::path const file = mRoot / "a-file";
  std::ofstream(file) << "not a directory";
  std::string const under = "file://" + (file / "store").string();
  EXPECT_TRUE(throwsError([&] { openRemoteKvStore(under); },
                          {"openRemoteKvStore", under, "cannot create"}));
  std::string const itself = "file://" + file.string();
  EXPECT_TRUE(
      throwsError([&] { openRemoteKvStore(itself); }, {"openRemoteKvStore", itself, "directory"}));
}

}  // namespace
}  // namespace mkv
