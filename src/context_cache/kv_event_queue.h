#pragma once
/// \file kv_event_queue.h
/// Bounded queue of block-index events for KV-aware routers (docs/context_cache.md,
/// "Observability"). The wire publisher (mkv/events/kv_event_publisher.h) sends what the engine
/// drains from it.
///
/// Thread-safety: single writer; drain() is called by the same thread that mutates the manager.

#include <cstdint>
#include <span>
#include <variant>
#include <vector>

#include "mkv/context_cache/kv_events.h"
#include "mkv/types.h"

namespace mkv {

/// A fixed ring of events, and of `tokensPerBlock` token ids per event, allocated at construction:
/// pushing never allocates and never fails. When full, the oldest event is overwritten and
/// droppedCount() increments. Capacity 0 disables the queue (pushes are ignored and not counted
/// as drops); tokensPerBlock 0 keeps no token ids (drained BlockStored events have none).
class KvEventQueue {
 public:
  /// Throws mkv::Error for a negative capacity or tokensPerBlock.
  explicit KvEventQueue(int32_t capacity, int32_t tokensPerBlock = 0);

  /// Queues `event`; a BlockStored keeps its own `tokens` (see pushStored).
  void push(KvEvent const& event) noexcept;
  /// Queues `event` with `tokens` as its token ids (its own `tokens` member is ignored), so a
  /// caller need not build a vector. Token ids are kept when the queue keeps tokens and
  /// tokens.size() == event.tokenCount <= tokensPerBlock, otherwise the event comes back without.
  void pushStored(BlockStored const& event, std::span<int32_t const> tokens) noexcept;
  /// All queued events, oldest first; the queue is empty afterwards. Strong exception guarantee.
  std::vector<KvEvent> drain();

  int32_t size() const noexcept { return mSize; }
  int32_t capacity() const noexcept { return static_cast<int32_t>(mRing.size()); }
  int32_t tokensPerBlock() const noexcept { return mTokensPerBlock; }
  uint64_t droppedCount() const noexcept { return mDropped; }

 private:
  enum class Kind : uint8_t { kStored, kRemoved, kAllCleared };
  /// One queued event without its token ids (those live in mTokens at the slot's offset).
  struct Slot {
    Kind kind = Kind::kRemoved;
    Hash128 digest;
    Hash128 parent;
    Hash128 extras;
    PageId page = kNoPage;
    int32_t tokenCount = 0;
    int32_t keptTokens = 0;
    KvMedium medium = KvMedium::kGpu;
    KvCacheGroup group{};
  };
  /// The slot the next event goes to (overwriting the oldest when full).
  std::size_t claimSlot() noexcept;

  std::vector<Slot> mRing;
  std::vector<int32_t> mTokens;  ///< capacity * tokensPerBlock token ids, one run per slot
  int32_t mTokensPerBlock = 0;
  int32_t mHead = 0;
  int32_t mSize = 0;
  uint64_t mDropped = 0;
};

}  // namespace mkv
