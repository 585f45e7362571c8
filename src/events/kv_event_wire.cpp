#include "events/kv_event_wire.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

// Only the packer is used; msgpack-c's Boost-based adaptors are not needed.
#define MSGPACK_NO_BOOST
#include <msgpack.hpp>

namespace mkv::events {

namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

/// [begin, end) of the input events that become one wire event: a chain of BlockStored, a run of
/// BlockRemoved, or consecutive AllBlocksCleared (one event on the wire).
struct Run {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::size_t alternative = 0;  ///< KvEvent's index() of every event in the run
};

std::vector<Run> runsOf(std::span<KvEvent const> events) {
  std::vector<Run> runs;
  for (std::size_t i = 0; i < events.size();) {
    Run run{i, i + 1, events[i].index()};
    if (std::holds_alternative<BlockStored>(events[i])) {
      auto const* previous = &std::get<BlockStored>(events[i]);
      while (run.end < events.size()) {
        auto const* next = std::get_if<BlockStored>(&events[run.end]);
        if (next == nullptr || next->parent != previous->digest ||
            next->tokenCount != previous->tokenCount || next->medium != previous->medium ||
            next->group != previous->group) {
          break;
        }
        previous = next;
        ++run.end;
      }
    } else if (auto const* removed = std::get_if<BlockRemoved>(&events[i])) {
      while (run.end < events.size()) {
        auto const* next = std::get_if<BlockRemoved>(&events[run.end]);
        if (next == nullptr || next->medium != removed->medium || next->group != removed->group) {
          break;
        }
        ++run.end;
      }
    } else {
      while (run.end < events.size() && events[run.end].index() == run.alternative) {
        ++run.end;
      }
    }
    runs.push_back(run);
    i = run.end;
  }
  return runs;
}

void packString(Packer& p, std::string_view s) {
  p.pack_str(static_cast<uint32_t>(s.size()));
  p.pack_str_body(s.data(), static_cast<uint32_t>(s.size()));
}

/// The `medium` label of an event, from the config: the GPU's, the host tier's, the store's.
void packMedium(Packer& p, KvMedium kind, KvEventPublisherConfig const& config) {
  std::string const& medium = kind == KvMedium::kCpu      ? config.hostMedium
                              : kind == KvMedium::kRemote ? config.remoteMedium
                                                          : config.medium;
  if (medium.empty()) {
    p.pack_nil();
  } else {
    packString(p, medium);
  }
}

/// vLLM's name of a group's attention kind.
std::string_view specKindName(KvCacheSpecKind kind) {
  return kind == KvCacheSpecKind::kSlidingWindow ? "sliding_window" : "full_attention";
}

/// Writes the map key when the encoding is the tagged map (nothing in the positional one).
class Fields {
 public:
  Fields(Packer& p, KvEventEncoding encoding)
      : mP(p), mMap(encoding == KvEventEncoding::kTaggedMap) {}

  void begin(std::string_view type, uint32_t fields) {
    if (mMap) {
      mP.pack_map(fields + 1);
      packString(mP, "type");
    } else {
      mP.pack_array(fields + 1);
    }
    packString(mP, type);
  }
  /// The packer, positioned for the value of field `key`.
  Packer& operator[](std::string_view key) {
    if (mMap) {
      packString(mP, key);
    }
    return mP;
  }
  /// The packer, for the elements of an array value.
  Packer& elements() { return mP; }

 private:
  Packer& mP;
  bool mMap;
};

/// `extra_keys`: one entry per block, nil or [hex of its extras digest].
void packExtraKeys(Fields& f, std::span<KvEvent const> run) {
  f["extra_keys"].pack_array(static_cast<uint32_t>(run.size()));
  for (KvEvent const& e : run) {
    Hash128 const h = std::get<BlockStored>(e).extras;
    if (h.isZero()) {
      f.elements().pack_nil();
    } else {
      f.elements().pack_array(1);
      packString(f.elements(), toString(h));
    }
  }
}

/// `group_idx`, `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` (nil for full attention).
void packGroupSpec(Fields& f, KvCacheGroup const& group) {
  f["group_idx"].pack_int32(group.index);
  packString(f["kv_cache_spec_kind"], specKindName(group.kind));
  if (group.kind == KvCacheSpecKind::kSlidingWindow) {
    f["kv_cache_spec_sliding_window"].pack_int32(group.slidingWindowTokens);
  } else {
    f["kv_cache_spec_sliding_window"].pack_nil();
  }
}

void packStored(Fields& f, std::span<KvEvent const> run, KvEventPublisherConfig const& config) {
  auto const& first = std::get<BlockStored>(run.front());
  bool const extras = std::any_of(run.begin(), run.end(), [](KvEvent const& e) {
    return !std::get<BlockStored>(e).extras.isZero();
  });
  // A grouped event carries every field up to the group's (extra_keys nil when it has none).
  bool const grouped = first.group.specified();
  f.begin("BlockStored", grouped ? 11 : (extras ? 8 : 7));
  f["block_hashes"].pack_array(static_cast<uint32_t>(run.size()));
  for (KvEvent const& e : run) {
    f.elements().pack_uint64(std::get<BlockStored>(e).digest.lo);
  }
  if (first.parent == kBlockChainRoot) {
    f["parent_block_hash"].pack_nil();
  } else {
    f["parent_block_hash"].pack_uint64(first.parent.lo);
  }
  std::size_t tokens = 0;
  for (KvEvent const& e : run) {
    tokens += std::get<BlockStored>(e).tokens.size();
  }
  f["token_ids"].pack_array(static_cast<uint32_t>(tokens));
  for (KvEvent const& e : run) {
    for (int32_t token : std::get<BlockStored>(e).tokens) {
      f.elements().pack_uint32(static_cast<uint32_t>(token));
    }
  }
  f["block_size"].pack_int32(first.tokenCount);
  f["lora_id"].pack_nil();
  packMedium(f["medium"], first.medium, config);
  f["lora_name"].pack_nil();
  if (extras) {
    packExtraKeys(f, run);
  } else if (grouped) {
    f["extra_keys"].pack_nil();
  }
  if (grouped) {
    packGroupSpec(f, first.group);
  }
}

void packRemoved(Fields& f, std::span<KvEvent const> run, KvEventPublisherConfig const& config) {
  KvCacheGroup const& group = std::get<BlockRemoved>(run.front()).group;
  f.begin("BlockRemoved", group.specified() ? 3 : 2);
  f["block_hashes"].pack_array(static_cast<uint32_t>(run.size()));
  for (KvEvent const& e : run) {
    f.elements().pack_uint64(std::get<BlockRemoved>(e).digest.lo);
  }
  packMedium(f["medium"], std::get<BlockRemoved>(run.front()).medium, config);
  if (group.specified()) {
    f["group_idx"].pack_int32(group.index);
  }
}

void packCleared(Fields& f) { f.begin("AllBlocksCleared", 0); }

}  // namespace

std::string encodeBatch(double timestamp, std::span<KvEvent const> events,
                        KvEventPublisherConfig const& config) {
  std::vector<Run> const runs = runsOf(events);
  msgpack::sbuffer buffer;
  Packer p(buffer);
  p.pack_array(3);
  p.pack_double(timestamp);
  p.pack_array(static_cast<uint32_t>(runs.size()));
  Fields fields(p, config.encoding);
  for (Run const& run : runs) {
    std::span<KvEvent const> const slice = events.subspan(run.begin, run.end - run.begin);
    if (std::holds_alternative<BlockStored>(slice.front())) {
      packStored(fields, slice, config);
    } else if (std::holds_alternative<BlockRemoved>(slice.front())) {
      packRemoved(fields, slice, config);
    } else {
      packCleared(fields);
    }
  }
  p.pack_int32(config.dataParallelRank);
  return {buffer.data(), buffer.size()};
}

}  // namespace mkv::events
