#include "context_cache/kv_event_queue.h"

#include <algorithm>

#include "core/check.h"

namespace mkv {

KvEventQueue::KvEventQueue(int32_t capacity, int32_t tokensPerBlock)
    : mTokensPerBlock(tokensPerBlock) {
  MKV_REQUIRE(capacity >= 0, "KvEventQueue", "capacity must be non-negative, got {}", capacity);
  MKV_REQUIRE(tokensPerBlock >= 0, "KvEventQueue", "tokensPerBlock must be non-negative, got {}",
              tokensPerBlock);
  mRing.resize(static_cast<std::size_t>(capacity));
  mTokens.resize(static_cast<std::size_t>(capacity) * static_cast<std::size_t>(tokensPerBlock));
}

std::size_t KvEventQueue::claimSlot() noexcept {
  auto const cap = static_cast<int32_t>(mRing.size());
  if (mSize == cap) {
    mHead = (mHead + 1) % cap;
    --mSize;
    ++mDropped;
  }
  auto const slot = static_cast<std::size_t>((mHead + mSize) % cap);
  ++mSize;
  return slot;
}

void KvEventQueue::push(KvEvent const& event) noexcept {
  if (auto const* stored = std::get_if<BlockStored>(&event)) {
    pushStored(*stored, stored->tokens);
    return;
  }
  if (mRing.empty()) {
    return;
  }
  Slot& slot = mRing[claimSlot()];
  slot = Slot{};
  if (auto const* removed = std::get_if<BlockRemoved>(&event)) {
    slot.digest = removed->digest;
    slot.page = removed->page;
    slot.medium = removed->medium;
    slot.group = removed->group;
  } else {
    slot.kind = Kind::kAllCleared;
  }
}

void KvEventQueue::pushStored(BlockStored const& event, std::span<int32_t const> tokens) noexcept {
  if (mRing.empty()) {
    return;
  }
  std::size_t const index = claimSlot();
  bool const keep = mTokensPerBlock > 0 && event.tokenCount <= mTokensPerBlock &&
                    tokens.size() == static_cast<std::size_t>(event.tokenCount);
  mRing[index] = Slot{Kind::kStored,
                      event.digest,
                      event.parent,
                      event.extras,
                      event.page,
                      event.tokenCount,
                      keep ? event.tokenCount : 0,
                      event.medium,
                      event.group};
  if (keep) {
    std::copy(tokens.begin(), tokens.end(),
              mTokens.begin() + static_cast<std::ptrdiff_t>(index) * mTokensPerBlock);
  }
}

std::vector<KvEvent> KvEventQueue::drain() {
  std::vector<KvEvent> out;
  out.reserve(static_cast<std::size_t>(mSize));
  auto const cap = static_cast<int32_t>(mRing.size());
  for (int32_t k = 0; k < mSize; ++k) {
    auto const index = static_cast<std::size_t>((mHead + k) % cap);
    Slot const& slot = mRing[index];
    if (slot.kind == Kind::kRemoved) {
      out.emplace_back(BlockRemoved{slot.digest, slot.page, slot.medium, slot.group});
      continue;
    }
    if (slot.kind == Kind::kAllCleared) {
      out.emplace_back(AllBlocksCleared{});
      continue;
    }
    auto const first = mTokens.begin() + static_cast<std::ptrdiff_t>(index) * mTokensPerBlock;
    out.emplace_back(BlockStored{slot.digest, slot.parent, slot.page, slot.tokenCount,
                                 std::vector<int32_t>(first, first + slot.keptTokens), slot.extras,
                                 slot.medium, slot.group});
  }
  mHead = 0;
  mSize = 0;
  return out;
}

}  // namespace mkv
