#include "mkv/context_cache/record_store.h"

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

RecordStore::InsertResult RecordStore::insert(CacheRecord record) {
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

  record.id = mNextId;
  LruList node;
  node.push_back(std::move(record));  // may throw: nothing changed yet
  auto const nodeIt = node.begin();
  CacheRecord const& stored = *nodeIt;
  bool const specIndexed = stored.specState.has_value() && !hybridKey;

  // Each allocating step is undone if a later one throws.
  mById.emplace(stored.id, nodeIt);
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
    mById.erase(stored.id);
    throw;
  }
  mLru.splice(mLru.end(), node);
  ++mNextId;
  return {&stored, true};
}

CacheRecord const* RecordStore::get(RecordId id) const noexcept {
  auto const it = mById.find(id);
  return it == mById.end() ? nullptr : &*it->second;
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
  CacheRecord& record = *it->second;
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
  mLru.splice(mLru.end(), mLru, it->second);
}

void RecordStore::touch(RecordId id) {
  auto const it = mById.find(id);
  MKV_REQUIRE(it != mById.end(), "RecordStore::touch", "unknown record {}", id);
  mLru.splice(mLru.end(), mLru, it->second);
}

void RecordStore::erase(RecordId id) noexcept {
  auto const it = mById.find(id);
  if (it == mById.end()) {
    return;
  }
  CacheRecord const& record = *it->second;
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
  mLru.erase(it->second);
  mById.erase(it);
}

}  // namespace mkv
