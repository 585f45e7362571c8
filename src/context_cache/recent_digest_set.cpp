#include "context_cache/recent_digest_set.h"

#include <bit>

#include "core/check.h"

namespace mkv {

RecentDigestSet::RecentDigestSet(int32_t capacity) {
  MKV_REQUIRE(capacity >= 0, "RecentDigestSet", "capacity must be non-negative, got {}", capacity);
  if (capacity == 0) {
    return;
  }
  mRing.resize(static_cast<std::size_t>(capacity));
  mTable.assign(std::bit_ceil(2 * static_cast<std::size_t>(capacity)), -1);
}

std::size_t RecentDigestSet::home(Hash128 digest) const noexcept {
  return Hash128Hasher{}(digest) & (mTable.size() - 1);
}

bool RecentDigestSet::contains(Hash128 digest) const noexcept {
  if (mTable.empty()) {
    return false;
  }
  std::size_t const mask = mTable.size() - 1;
  for (std::size_t slot = home(digest); mTable[slot] >= 0; slot = (slot + 1) & mask) {
    if (mRing[static_cast<std::size_t>(mTable[slot])] == digest) {
      return true;
    }
  }
  return false;
}

void RecentDigestSet::eraseRingPosition(int32_t position) noexcept {
  std::size_t const mask = mTable.size() - 1;
  std::size_t hole = home(mRing[static_cast<std::size_t>(position)]);
  while (mTable[hole] != position) {
    hole = (hole + 1) & mask;
  }
  mTable[hole] = -1;
  // Backward-shift: pull later entries of the probe run into the hole when their home slot does
  // not lie cyclically in (hole, next], so every entry stays reachable from its home.
  for (std::size_t next = (hole + 1) & mask; mTable[next] >= 0; next = (next + 1) & mask) {
    std::size_t const want = home(mRing[static_cast<std::size_t>(mTable[next])]);
    bool const wantInRange =
        hole <= next ? (hole < want && want <= next) : (hole < want || want <= next);
    if (!wantInRange) {
      mTable[hole] = mTable[next];
      mTable[next] = -1;
      hole = next;
    }
  }
}

void RecentDigestSet::insert(Hash128 digest) noexcept {
  if (mRing.empty()) {
    return;
  }
  auto const cap = static_cast<int32_t>(mRing.size());
  if (mSize == cap) {
    eraseRingPosition(mHead);
    mHead = (mHead + 1) % cap;
    --mSize;
  }
  int32_t const position = (mHead + mSize) % cap;
  mRing[static_cast<std::size_t>(position)] = digest;
  ++mSize;
  std::size_t const mask = mTable.size() - 1;
  std::size_t slot = home(digest);
  while (mTable[slot] >= 0) {
    slot = (slot + 1) & mask;
  }
  mTable[slot] = position;
}

}  // namespace mkv
