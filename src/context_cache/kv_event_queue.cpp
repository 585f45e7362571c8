#include "mkv/context_cache/kv_event_queue.h"

#include <type_traits>

#include "core/check.h"

namespace mkv {

static_assert(std::is_nothrow_copy_assignable_v<KvEvent>, "push() relies on nothrow copies");

KvEventQueue::KvEventQueue(int32_t capacity) {
  MKV_REQUIRE(capacity >= 0, "KvEventQueue", "capacity must be non-negative, got {}", capacity);
  mRing.resize(static_cast<std::size_t>(capacity));
}

void KvEventQueue::push(KvEvent const& event) noexcept {
  if (mRing.empty()) {
    return;
  }
  auto const cap = static_cast<int32_t>(mRing.size());
  if (mSize == cap) {
    mHead = (mHead + 1) % cap;
    --mSize;
    ++mDropped;
  }
  mRing[static_cast<std::size_t>((mHead + mSize) % cap)] = event;
  ++mSize;
}

std::vector<KvEvent> KvEventQueue::drain() {
  std::vector<KvEvent> out;
  out.reserve(static_cast<std::size_t>(mSize));
  auto const cap = static_cast<int32_t>(mRing.size());
  for (int32_t k = 0; k < mSize; ++k) {
    out.push_back(mRing[static_cast<std::size_t>((mHead + k) % cap)]);
  }
  mHead = 0;
  mSize = 0;
  return out;
}

}  // namespace mkv
