#include "context_cache/record_store.h"

#include <algorithm>

#include "core/check.h"

namespace mkv {

void RecordStore::indexSpecPath(CacheRecord const& record) {
  // One entry per prefix boundary; undone entry by entry if an insertion throws.
  std::size_t const blocks = record.logicalBlockDigests.size();
  std::size_t done = 0;
  try {
    for (; done < blocks; ++done) {
      mSpecPaths.emplace(record.logicalBlockDigests[done],
                         SpecPathEntry{record.id, static_cast<int32_t>(done + 1)});
    }
  } catch (...) {
    unindexSpecPath(record.id, std::span(record.logicalBlockDigests).first(done));
    throw;
  }
}

void RecordStore::unindexSpecPath(RecordId id, std::span<Hash128 const> digests) noexcept {
  for (Hash128 const& digest : digests) {
    auto [first, last] = mSpecPaths.equal_range(digest);
    for (auto it = first; it != last; ++it) {
      if (it->second.record == id) {
        mSpecPaths.erase(it);
        break;
      }
    }
  }
}

RecordStore::RecordStore(EvictionPolicyKind policy, int32_t ghostCapacity)
    : mPolicy(makeEvictionPolicy(policy, ghostCapacity)) {}

void RecordStore::reserveSlot() {
  if (!mFreeSlots.empty()) {
    return;
  }
  std::size_t const slots = mBySlot.size() + 1;
  if (slots > mBySlot.capacity()) {
    std::size_t const grown = std::max<std::size_t>(16, 2 * mBySlot.capacity());
    mFreeSlots.reserve(grown);
    mPolicy->reserveSlots(static_cast<int32_t>(grown));
    mBySlot.reserve(grown);
  }
  mPolicy->reserveSlots(static_cast<int32_t>(slots));
}

void RecordStore::indexRecord(LruList::iterator nodeIt, std::optional<HybridKey> const& hybridKey) {
  CacheRecord const& stored = *nodeIt;
  bool const specIndexed = stored.specState.has_value() && !hybridKey;
  mById.emplace(stored.id, Entry{nodeIt, kNoRecordSlot});
  try {
    if (stored.retentionExpiry) {
      mExpiries.emplace(*stored.retentionExpiry, stored.id);
    }
    try {
      if (hybridKey) {
        mByHybridKey.emplace(*hybridKey, stored.id);
        try {
          ++mHybridLengths[hybridKey->exactLength];
        } catch (...) {
          mByHybridKey.erase(*hybridKey);
          throw;
        }
      } else {
        mByKey.emplace(stored.key, stored.id);
        try {
          if (specIndexed) {
            indexSpecPath(stored);
          }
        } catch (...) {
          mByKey.erase(stored.key);
          throw;
        }
      }
    } catch (...) {
      if (stored.retentionExpiry) {
        mExpiries.erase({*stored.retentionExpiry, stored.id});
      }
      throw;
    }
  } catch (...) {
    mById.erase(stored.id);
    throw;
  }
}

void RecordStore::assignSlot(CacheRecord& stored, RecordInsertHint hint) {
  RecordSlot slot = kNoRecordSlot;
  if (!mFreeSlots.empty()) {
    slot = mFreeSlots.back();
    mFreeSlots.pop_back();
    mBySlot[static_cast<std::size_t>(slot)] = &stored;
  } else {
    slot = static_cast<RecordSlot>(mBySlot.size());
    mBySlot.push_back(&stored);
  }
  mById.find(stored.id)->second.slot = slot;
  int32_t weight = 0;
  stored.forEachResource([&weight](ResourceId) { ++weight; });
  mPolicy->onInsert(PolicyInsert{slot, stored.key.terminal, std::max(1, weight),
                                 stored.retentionPriority, hint.reused, hint.evictedPrefix});
}

RecordStore::InsertResult RecordStore::insert(CacheRecord record, RecordInsertHint hint) {
  record.validate();
  std::optional<HybridKey> const hybridKey = record.hybridKey();
  if (hybridKey) {
    if (auto const it = mByHybridKey.find(*hybridKey); it != mByHybridKey.end()) {
      touch(it->second);
      return {get(it->second), false};
    }
  } else if (auto const it = mByKey.find(record.key); it != mByKey.end()) {
    touch(it->second);
    return {get(it->second), false};
  }

  reserveSlot();
  record.id = mNextId;
  LruList node;
  node.push_back(std::move(record));  // may throw: nothing changed yet
  indexRecord(node.begin(), hybridKey);
  CacheRecord& stored = node.front();
  assignSlot(stored, hint);  // nothing below throws
  mLru.splice(mLru.end(), node);
  ++mNextId;
  return {&stored, true};
}

CacheRecord const* RecordStore::get(RecordId id) const noexcept {
  auto const it = mById.find(id);
  return it == mById.end() ? nullptr : &*it->second.record;
}

CacheRecord const* RecordStore::find(RecordKey const& key) const noexcept {
  auto const it = mByKey.find(key);
  return it == mByKey.end() ? nullptr : get(it->second);
}

CacheRecord const* RecordStore::findHybrid(HybridKey const& key) const noexcept {
  auto const it = mByHybridKey.find(key);
  return it == mByHybridKey.end() ? nullptr : get(it->second);
}

std::optional<RecordStore::SpecPathMatch> RecordStore::findLongestSpecPath(
    std::span<Hash128 const> keys, int32_t maxBlocks) const {
  int32_t const limit = std::min(maxBlocks, static_cast<int32_t>(keys.size()));
  for (int32_t k = limit; k >= 1; --k) {
    auto const [first, last] = mSpecPaths.equal_range(keys[static_cast<std::size_t>(k - 1)]);
    CacheRecord const* best = nullptr;
    for (auto it = first; it != last; ++it) {
      if (it->second.blockCount != k) {
        continue;
      }
      CacheRecord const* record = get(it->second.record);
      MKV_ASSERT(record != nullptr, "spec path entry of erased record {}", it->second.record);
      if ((best == nullptr || record->id > best->id) &&
          std::equal(keys.begin(), keys.begin() + k, record->logicalBlockDigests.begin())) {
        best = record;
      }
    }
    if (best != nullptr) {
      return SpecPathMatch{best, k};
    }
  }
  return std::nullopt;
}

std::vector<int32_t> RecordStore::hybridCheckpointLengths(int32_t below) const {
  std::vector<int32_t> out;
  for (auto it = mHybridLengths.lower_bound(below); it != mHybridLengths.begin();) {
    --it;
    out.push_back(it->first);
  }
  return out;
}

void RecordStore::setSpecState(RecordId id, SpecState state) {
  auto const it = mById.find(id);
  MKV_REQUIRE(it != mById.end(), "RecordStore::setSpecState", "unknown record {}", id);
  CacheRecord& record = *it->second.record;
  MKV_REQUIRE(!record.isHybrid(), "RecordStore::setSpecState", "record {} is a hybrid checkpoint",
              id);
  MKV_REQUIRE(state.draftPagePath.size() == record.basePagePath.size(), "RecordStore::setSpecState",
              "draft path of {} pages for record {} of {} blocks", state.draftPagePath.size(), id,
              record.basePagePath.size());
  if (record.specState) {
    MKV_REQUIRE(*record.specState == state, "RecordStore::setSpecState",
                "record {} already holds a different spec state", id);
  } else {
    indexSpecPath(record);
    record.specState = std::move(state);
  }
  mLru.splice(mLru.end(), mLru, it->second.record);
  mPolicy->onHit(it->second.slot);
}

void RecordStore::touch(RecordId id) {
  auto const it = mById.find(id);
  MKV_REQUIRE(it != mById.end(), "RecordStore::touch", "unknown record {}", id);
  mLru.splice(mLru.end(), mLru, it->second.record);
  CacheRecord& record = *it->second.record;
  ++record.hits;
  if (record.speculative) {  // a prompt came through it again: no longer a speculation
    record.speculative = false;
    record.retentionPriority = record.heldPriority;
    mPolicy->onPriorityChange(it->second.slot, record.retentionPriority);
  }
  mPolicy->onHit(it->second.slot);
}

void RecordStore::demote(RecordId id) noexcept {
  auto const it = mById.find(id);
  if (it == mById.end()) {
    return;
  }
  CacheRecord& record = *it->second.record;
  if (record.speculative || record.hits > 1 ||
      record.retentionPriority > kDefaultRetentionPriority) {
    return;
  }
  record.speculative = true;
  record.speculationRank = 0;
  record.heldPriority = record.retentionPriority;
  record.retentionPriority = kMinRetentionPriority;
  mPolicy->onPriorityChange(it->second.slot, record.retentionPriority);
}

void RecordStore::erase(RecordId id) noexcept { remove(id, /*evicted=*/false); }

void RecordStore::evict(RecordId id) noexcept { remove(id, /*evicted=*/true); }

int32_t RecordStore::expireRetention(int64_t now) noexcept {
  int32_t expired = 0;
  while (!mExpiries.empty() && mExpiries.begin()->first <= now) {
    RecordId const id = mExpiries.begin()->second;
    mExpiries.erase(mExpiries.begin());
    Entry const& entry = mById.find(id)->second;
    CacheRecord& record = *entry.record;
    record.retentionExpiry.reset();
    if (record.speculative) {  // still a speculation, of its rank; a promotion gives the default
      record.heldPriority = kDefaultRetentionPriority;
      int32_t const priority = speculationPriority(record.speculationRank, record.heldPriority);
      if (priority != record.retentionPriority) {
        record.retentionPriority = priority;
        mPolicy->onPriorityChange(entry.slot, priority);
      }
    } else if (record.retentionPriority != kDefaultRetentionPriority) {
      record.retentionPriority = kDefaultRetentionPriority;
      mPolicy->onPriorityChange(entry.slot, kDefaultRetentionPriority);
    }
    ++expired;
  }
  return expired;
}

std::optional<int64_t> RecordStore::nextRetentionExpiry() const noexcept {
  return mExpiries.empty() ? std::nullopt : std::optional(mExpiries.begin()->first);
}

RecordId RecordStore::firstVictim() const {
  RecordId first = kNoRecord;
  forEachVictim([&first](CacheRecord const& record) {
    first = record.id;
    return true;
  });
  return first;
}

std::vector<RecordId> RecordStore::victimOrder() const {
  std::vector<RecordId> order;
  order.reserve(mLru.size());
  forEachVictim([&order](CacheRecord const& record) {
    order.push_back(record.id);
    return false;
  });
  return order;
}

void RecordStore::remove(RecordId id, bool evicted) noexcept {
  auto const it = mById.find(id);
  if (it == mById.end()) {
    return;
  }
  CacheRecord const& record = *it->second.record;
  if (std::optional<HybridKey> const hybridKey = record.hybridKey()) {
    mByHybridKey.erase(*hybridKey);
    auto const length = mHybridLengths.find(hybridKey->exactLength);
    if (--length->second == 0) {
      mHybridLengths.erase(length);
    }
  } else {
    if (record.specState) {
      unindexSpecPath(record.id, record.logicalBlockDigests);
    }
    mByKey.erase(record.key);
  }
  if (record.retentionExpiry) {
    mExpiries.erase({*record.retentionExpiry, id});
  }
  RecordSlot const slot = it->second.slot;
  mPolicy->onErase(slot, evicted);
  mBySlot[static_cast<std::size_t>(slot)] = nullptr;
  mFreeSlots.push_back(slot);  // capacity reserved with the slot
  mLru.erase(it->second.record);
  mById.erase(it);
}

}  // namespace mkv
