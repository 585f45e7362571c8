#pragma once
/// \file remote_block_codec.h
/// One block of the remote tier as a store value (docs/context_cache.md, "Remote tier"): a header
/// naming what the bytes are — format, deployment identity, block key, parent key, extras digest,
/// token ids, payload size and checksum — then the page's bytes, every layer's K then V. A load
/// accepts a value only when every field equals what the requesting prompt expects, so a value of
/// another model, another prefix or damaged in the store is a miss, never a hit on wrong bytes.
///
/// Thread-safety: pure functions; any thread (the remote tier's worker encodes and checks).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mkv/context_cache/context_cache_types.h"
#include "mkv/types.h"

namespace mkv {

/// What a deployment's blocks are: blocks written under another identity never load. Covers the
/// model name the engine gives (weights, revision, quantisation: the bytes differ) and the pool
/// geometry a page's bytes are laid out in.
struct RemoteDeployment {
  std::string model;
  int32_t numLayers = 0;
  int32_t tokensPerPage = 0;
  int32_t numKVHeads = 0;
  int32_t headDim = 0;
  DataType dtype = DataType::kFloat16;
};

/// The 128-bit identity of a deployment (XXH3-128 of its fields).
Hash128 remoteDeploymentIdentity(RemoteDeployment const& deployment) noexcept;

/// The store key of block `block` (its chained key) under `deployment`:
/// "mkv1:<deployment hex>:<block hex>". Chained keys name the whole prefix, so a key addresses
/// the bytes of exactly one prefix of one deployment.
std::string remoteBlockKey(Hash128 deployment, Hash128 block);

/// The header fields of one block.
struct RemoteBlockHeader {
  Hash128 deployment;
  Hash128 key;                      ///< the block's chained key
  Hash128 parent;                   ///< the previous block's key (kBlockChainRoot for block 0)
  Hash128 extras;                   ///< PromptBlocks::extrasDigest of the block
  std::span<int32_t const> tokens;  ///< the block's token ids (tokensPerPage of them)
  int64_t payloadBytes = 0;         ///< bytes after the header: every layer, K then V
};

/// The value of a block: the header, then the concatenation of `payload` (whose total size must
/// be header.payloadBytes; throws mkv::Error otherwise).
std::string encodeRemoteBlock(RemoteBlockHeader const& header,
                              std::span<std::span<std::byte const> const> payload);

/// Why a value was refused (kValid: accepted).
enum class RemoteBlockCheck : uint8_t {
  kValid,
  kTruncated,        ///< shorter or longer than its header says
  kBadFormat,        ///< not a managedkv block value of this format version
  kOtherDeployment,  ///< written by another model or geometry
  kOtherBlock,       ///< another key, parent, extras or token ids than the prompt's block
  kBadChecksum,      ///< the payload does not match its checksum
};

char const* toString(RemoteBlockCheck check) noexcept;

/// Checks `value` against the block the requester expects (`expected.payloadBytes` included). On
/// kValid, `payload` is the view of the value's payload bytes.
RemoteBlockCheck checkRemoteBlock(std::string_view value, RemoteBlockHeader const& expected,
                                  std::span<std::byte const>& payload) noexcept;

}  // namespace mkv
