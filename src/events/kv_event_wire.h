#pragma once
/// \file kv_event_wire.h
/// msgpack encoding of one KV event batch in vLLM's layout (internal; see kv_event_publisher.h).

#include <span>
#include <string>

#include "context_cache/kv_event_queue.h"
#include "mkv/events/kv_event_publisher.h"

namespace mkv::events {

/// The payload frame of one batch: `[timestamp, [events], dataParallelRank]`. Consecutive
/// BlockStored events that extend one chain (each one's parent is the previous one's digest, same
/// token count) become one BlockStored with several block hashes; consecutive BlockRemoved events
/// become one BlockRemoved. Digests go out as their low 64 bits; a parent equal to
/// kBlockChainRoot as nil; token ids as unsigned 32-bit integers.
std::string encodeBatch(double timestamp, std::span<KvEvent const> events,
                        KvEventPublisherConfig const& config);

}  // namespace mkv::events
