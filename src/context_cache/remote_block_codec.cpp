// The remote tier's value format (remote_block_codec.h).

#include "context_cache/remote_block_codec.h"

#include <array>
#include <cstring>
#include <utility>

#include "core/check.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace mkv {

namespace {

constexpr uint32_t kMagic = 0x42564B4DU;  // "MKVB", little endian
constexpr uint32_t kVersion = 1;

/// The fixed part of the header, as stored (little-endian host: block_hash.h enforces it).
struct FixedHeader {
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  Hash128 deployment;
  Hash128 key;
  Hash128 parent;
  Hash128 extras;
  int32_t tokenCount = 0;
  int32_t reserved = 0;
  int64_t payloadBytes = 0;
  uint64_t payloadChecksum = 0;
};
static_assert(sizeof(FixedHeader) == 96);

int64_t headerBytes(int64_t tokenCount) noexcept {
  return static_cast<int64_t>(sizeof(FixedHeader)) + tokenCount * int64_t{sizeof(int32_t)};
}

}  // namespace

Hash128 remoteDeploymentIdentity(RemoteDeployment const& deployment) noexcept {
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_128bits_reset(&state);
  XXH3_128bits_update(&state, deployment.model.data(), deployment.model.size());
  std::array<int32_t, 6> const geometry{static_cast<int32_t>(deployment.model.size()),
                                        deployment.numLayers,
                                        deployment.tokensPerPage,
                                        deployment.numKVHeads,
                                        deployment.headDim,
                                        static_cast<int32_t>(deployment.dtype)};
  XXH3_128bits_update(&state, geometry.data(), sizeof(geometry));
  XXH128_hash_t const digest = XXH3_128bits_digest(&state);
  return Hash128{digest.high64, digest.low64};
}

std::string remoteBlockKey(Hash128 deployment, Hash128 block) {
  return "mkv1:" + toString(deployment) + ":" + toString(block);
}

std::string encodeRemoteBlock(RemoteBlockHeader const& header,
                              std::span<std::span<std::byte const> const> payload) {
  int64_t total = 0;
  XXH3_state_t state;
  XXH3_INITSTATE(&state);
  XXH3_64bits_reset(&state);
  for (std::span<std::byte const> chunk : payload) {
    total += static_cast<int64_t>(chunk.size());
    XXH3_64bits_update(&state, chunk.data(), chunk.size());
  }
  MKV_REQUIRE(total == header.payloadBytes, "encodeRemoteBlock",
              "the payload has {} bytes, the header says {}", total, header.payloadBytes);
  FixedHeader fixed;
  fixed.deployment = header.deployment;
  fixed.key = header.key;
  fixed.parent = header.parent;
  fixed.extras = header.extras;
  fixed.tokenCount = static_cast<int32_t>(header.tokens.size());
  fixed.payloadBytes = total;
  fixed.payloadChecksum = XXH3_64bits_digest(&state);
  std::string value;
  value.resize(static_cast<std::size_t>(headerBytes(fixed.tokenCount) + total));
  char* out = value.data();
  std::memcpy(out, &fixed, sizeof(fixed));
  out += sizeof(fixed);
  std::memcpy(out, header.tokens.data(), header.tokens.size_bytes());
  out += header.tokens.size_bytes();
  for (std::span<std::byte const> chunk : payload) {
    std::memcpy(out, chunk.data(), chunk.size());
    out += chunk.size();
  }
  return value;
}

char const* toString(RemoteBlockCheck check) noexcept {
  switch (check) {
    case RemoteBlockCheck::kValid:
      return "valid";
    case RemoteBlockCheck::kTruncated:
      return "truncated";
    case RemoteBlockCheck::kBadFormat:
      return "bad format";
    case RemoteBlockCheck::kOtherDeployment:
      return "other deployment";
    case RemoteBlockCheck::kOtherBlock:
      return "other block";
    case RemoteBlockCheck::kBadChecksum:
      return "bad checksum";
  }
  return "unknown";
}

RemoteBlockCheck checkRemoteBlock(std::string_view value, RemoteBlockHeader const& expected,
                                  std::span<std::byte const>& payload) noexcept {
  payload = {};
  if (value.size() < sizeof(FixedHeader)) {
    return RemoteBlockCheck::kTruncated;
  }
  FixedHeader fixed;
  std::memcpy(&fixed, value.data(), sizeof(fixed));
  if (fixed.magic != kMagic || fixed.version != kVersion || fixed.tokenCount < 0 ||
      fixed.payloadBytes < 0) {
    return RemoteBlockCheck::kBadFormat;
  }
  if (fixed.deployment != expected.deployment) {
    return RemoteBlockCheck::kOtherDeployment;
  }
  if (std::cmp_not_equal(value.size(), headerBytes(fixed.tokenCount) + fixed.payloadBytes)) {
    return RemoteBlockCheck::kTruncated;
  }
  bool const sameTokens = std::cmp_equal(fixed.tokenCount, expected.tokens.size()) &&
                          std::memcmp(value.data() + sizeof(fixed), expected.tokens.data(),
                                      expected.tokens.size_bytes()) == 0;
  if (fixed.key != expected.key || fixed.parent != expected.parent ||
      fixed.extras != expected.extras || !sameTokens ||
      fixed.payloadBytes != expected.payloadBytes) {
    return RemoteBlockCheck::kOtherBlock;
  }
  auto const* const bytes =
      reinterpret_cast<std::byte const*>(value.data()) + headerBytes(fixed.tokenCount);
  auto const size = static_cast<std::size_t>(fixed.payloadBytes);
  if (XXH3_64bits(bytes, size) != fixed.payloadChecksum) {
    return RemoteBlockCheck::kBadChecksum;
  }
  payload = std::span<std::byte const>(bytes, size);
  return RemoteBlockCheck::kValid;
}

}  // namespace mkv
