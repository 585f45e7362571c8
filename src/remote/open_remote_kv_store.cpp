#include "mkv/remote/open_remote_kv_store.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "core/check.h"
#include "remote/directory_kv_store.h"
#include "remote/redis_kv_store.h"

namespace mkv {

namespace {

constexpr char const* kOpen = "openRemoteKvStore";
constexpr int kDefaultRedisPort = 6379;
constexpr int kMaxPort = 65535;
constexpr std::size_t kMaxPortDigits = 5;

bool isHostCharacter(char c) noexcept {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '-' || c == '_';
}

/// `redis://HOST[:PORT]`, `authority` being what follows "redis://".
std::unique_ptr<RemoteKvStore> openRedis(std::string_view url, std::string_view authority,
                                         RemoteKvStoreOptions const& options) {
  MKV_REQUIRE(!authority.starts_with('['), kOpen,
              "'{}': IPv6 addresses are not supported (expected redis://HOST[:PORT], HOST an "
              "IPv4 address or a host name)",
              url);
  MKV_REQUIRE(authority.find_first_of("/?#@") == std::string_view::npos, kOpen,
              "'{}': expected redis://HOST[:PORT] (a user, a database number, a path or options "
              "are not supported)",
              url);
  std::size_t const colon = authority.find(':');
  std::string_view const host = authority.substr(0, colon);
  MKV_REQUIRE(!host.empty(), kOpen, "'{}': no host (expected redis://HOST[:PORT])", url);
  MKV_REQUIRE(std::all_of(host.begin(), host.end(), isHostCharacter), kOpen,
              "'{}': host '{}' is not an IPv4 address or a host name (expected "
              "redis://HOST[:PORT]; a user, a database number or options are not supported)",
              url, host);
  int port = kDefaultRedisPort;
  if (colon != std::string_view::npos) {
    std::string_view const digits = authority.substr(colon + 1);
    bool const decimal =
        !digits.empty() && digits.size() <= kMaxPortDigits &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
    port = decimal ? std::stoi(std::string(digits)) : 0;
    MKV_REQUIRE(port >= 1 && port <= kMaxPort, kOpen,
                "'{}': port '{}' is not a number in 1..{} (expected redis://HOST[:PORT])", url,
                digits, kMaxPort);
  }
  return std::make_unique<remote::RedisKvStore>(std::string(host), port, options);
}

/// `file:///DIR`, `path` being what follows "file://".
std::unique_ptr<RemoteKvStore> openDirectory(std::string_view url, std::string_view path,
                                             RemoteKvStoreOptions const& options) {
  MKV_REQUIRE(!path.empty(), kOpen, "'{}': no directory (expected file:///ABSOLUTE/DIR)", url);
  MKV_REQUIRE(path.starts_with('/'), kOpen,
              "'{}': '{}' is not an absolute path (expected file:///ABSOLUTE/DIR; a host is not "
              "supported)",
              url, path);
  return std::make_unique<remote::DirectoryKvStore>(std::filesystem::path(path), options);
}

}  // namespace

std::unique_ptr<RemoteKvStore> openRemoteKvStore(std::string_view url,
                                                 RemoteKvStoreOptions const& options) {
  std::size_t const separator = url.find("://");
  MKV_REQUIRE(separator != std::string_view::npos, kOpen,
              "'{}' is not a store URL (expected redis://HOST[:PORT] or file:///ABSOLUTE/DIR)",
              url);
  std::string scheme(url.substr(0, separator));
  std::transform(scheme.begin(), scheme.end(), scheme.begin(), [](char c) {
    return static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  });
  std::string_view const rest = url.substr(separator + 3);
  if (scheme == "redis") {
    return openRedis(url, rest, options);
  }
  if (scheme == "file") {
    return openDirectory(url, rest, options);
  }
  detail::throwContract(kOpen, "'{}': unknown scheme '{}' (expected redis or file)", url, scheme);
}

}  // namespace mkv
