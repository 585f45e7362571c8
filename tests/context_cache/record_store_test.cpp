#include "context_cache/record_store.h"

#include <gtest/gtest.h>

#include "mkv/error.h"

namespace mkv {
namespace {

/// A block record over digests {tag, 0..blocks-1} (so equal tags share prefixes).
CacheRecord blockRecord(uint64_t tag, int32_t blocks, PageId firstPage = 0) {
  CacheRecord r;
  for (int32_t b = 0; b < blocks; ++b) {
    r.logicalBlockDigests.push_back(Hash128{tag, static_cast<uint64_t>(b)});
    r.basePagePath.push_back(firstPage + b);
  }
  r.key = RecordKey{r.logicalBlockDigests.back(), blocks};
  return r;
}

CacheRecord checkpoint(uint64_t tag, int32_t exactLength) {
  CacheRecord r;
  r.key = RecordKey{Hash128{tag, 99}, 0};
  r.exactCheckpointLength = exactLength;
  r.recurrentSnapshotSlot = 0;
  return r;
}

std::vector<RecordId> lruIds(RecordStore const& store) {
  std::vector<RecordId> ids;
  for (CacheRecord const& r : store.lruToMru()) {
    ids.push_back(r.id);
  }
  return ids;
}

TEST(RecordStoreTest, InsertAssignsIdsAndKeepsLruOrder) {
  RecordStore store;
  RecordStore::InsertResult const a = store.insert(blockRecord(1, 1));
  RecordStore::InsertResult const b = store.insert(blockRecord(2, 1));
  ASSERT_TRUE(a.inserted && b.inserted);
  EXPECT_EQ(a.record->id, 1U);
  EXPECT_EQ(b.record->id, 2U);
  EXPECT_EQ(lruIds(store), (std::vector<RecordId>{1, 2}));
  store.touch(1);
  EXPECT_EQ(lruIds(store), (std::vector<RecordId>{2, 1}));
  EXPECT_EQ(store.find(a.record->key), a.record);
  EXPECT_EQ(store.get(2), b.record);
  EXPECT_EQ(store.get(3), nullptr);
}

TEST(RecordStoreTest, DuplicateKeyTouchesAndReturnsTheExistingRecord) {
  RecordStore store;
  store.insert(blockRecord(1, 2, 0));
  store.insert(blockRecord(2, 1));
  RecordStore::InsertResult const dup = store.insert(blockRecord(1, 2, 6));
  EXPECT_FALSE(dup.inserted);
  EXPECT_EQ(dup.record->id, 1U);
  EXPECT_EQ(dup.record->basePagePath, (std::vector<PageId>{0, 1})) << "first producer kept";
  EXPECT_EQ(lruIds(store), (std::vector<RecordId>{2, 1}));
  EXPECT_EQ(store.size(), 2U);
}

TEST(RecordStoreTest, HybridCheckpointsLiveInTheirOwnIndex) {
  RecordStore store;
  CacheRecord plain = blockRecord(1, 1);
  CacheRecord aligned = checkpoint(0, 4);
  aligned.key = plain.key;  // same terminal digest and block count as the block record
  aligned.logicalBlockDigests = plain.logicalBlockDigests;
  aligned.basePagePath = plain.basePagePath;
  EXPECT_TRUE(store.insert(plain).inserted);
  EXPECT_TRUE(store.insert(aligned).inserted) << "kinds do not shadow each other";
  EXPECT_FALSE(store.find(plain.key)->isHybrid());
  EXPECT_TRUE(store.findHybrid({plain.key.terminal, 4})->isHybrid());
  EXPECT_EQ(store.findHybrid({plain.key.terminal, 5}), nullptr);
  EXPECT_FALSE(store.insert(aligned).inserted);
}

TEST(RecordStoreTest, HybridCheckpointLengthsAreDistinctLongestFirst) {
  RecordStore store;
  store.insert(checkpoint(1, 129));
  store.insert(checkpoint(2, 3));
  store.insert(checkpoint(3, 129));
  store.insert(checkpoint(4, 300));
  EXPECT_EQ(store.hybridCheckpointLengths(300), (std::vector<int32_t>{129, 3}));
  EXPECT_EQ(store.hybridCheckpointLengths(301), (std::vector<int32_t>{300, 129, 3}));
  EXPECT_TRUE(store.hybridCheckpointLengths(3).empty());
  store.erase(store.findHybrid({Hash128{1, 99}, 129})->id);
  EXPECT_EQ(store.hybridCheckpointLengths(200), (std::vector<int32_t>{129, 3}));
  store.erase(store.findHybrid({Hash128{3, 99}, 129})->id);
  EXPECT_EQ(store.hybridCheckpointLengths(200), (std::vector<int32_t>{3}));
}

TEST(RecordStoreTest, SpecPathLookupFindsTheLongestCoherentPrefix) {
  RecordStore store;
  CacheRecord longer = blockRecord(1, 3);
  longer.specState = SpecState{{10, 11, 12}};
  store.insert(longer);
  store.insert(blockRecord(1, 4));  // base-only: ignored by spec lookups
  std::vector<Hash128> const keys{{1, 0}, {1, 1}, {1, 2}, {1, 3}};
  std::optional<RecordStore::SpecPathMatch> match = store.findLongestSpecPath(keys, 4);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->record->id, 1U);
  EXPECT_EQ(match->blockCount, 3);
  match = store.findLongestSpecPath(keys, 2);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->blockCount, 2) << "a prefix of the path";
  std::vector<Hash128> const other{{2, 0}};
  EXPECT_FALSE(store.findLongestSpecPath(other, 1).has_value());

  // The newest of two equally long candidates wins.
  CacheRecord newer = blockRecord(1, 2, 20);
  newer.specState = SpecState{{30, 31}};
  RecordId const newerId = store.insert(newer).record->id;
  EXPECT_EQ(store.findLongestSpecPath(keys, 2)->record->id, newerId);
  store.erase(newerId);
  EXPECT_EQ(store.findLongestSpecPath(keys, 2)->record->id, 1U);
  store.erase(1);
  EXPECT_FALSE(store.findLongestSpecPath(keys, 4).has_value());
}

TEST(RecordStoreTest, SpecStateUpgradeOfABaseOnlyRecord) {
  RecordStore store;
  RecordId const id = store.insert(blockRecord(1, 2)).record->id;
  store.insert(blockRecord(2, 1));
  std::vector<Hash128> const keys{{1, 0}, {1, 1}};
  EXPECT_FALSE(store.findLongestSpecPath(keys, 2).has_value());
  store.setSpecState(id, SpecState{{4, 5}});
  EXPECT_EQ(lruIds(store), (std::vector<RecordId>{2, id})) << "upgrade touches";
  EXPECT_EQ(store.findLongestSpecPath(keys, 2)->blockCount, 2);
  EXPECT_NO_THROW(store.setSpecState(id, SpecState{{4, 5}}));
  EXPECT_THROW(store.setSpecState(id, SpecState{{4, 6}}), Error);
  EXPECT_THROW(store.setSpecState(id, SpecState{{4}}), Error);
  EXPECT_THROW(store.setSpecState(77, SpecState{{4, 5}}), Error);
  RecordId const hybrid = store.insert(checkpoint(5, 9)).record->id;
  EXPECT_THROW(store.setSpecState(hybrid, SpecState{}), Error);
  EXPECT_EQ(store.get(id)->specState->draftPagePath, (std::vector<PageId>{4, 5}));
}

TEST(RecordStoreTest, EraseRemovesEveryIndexEntry) {
  RecordStore store;
  CacheRecord spec = blockRecord(1, 2);
  spec.specState = SpecState{{1, 2}};
  RecordId const id = store.insert(spec).record->id;
  store.erase(id);
  store.erase(id);  // unknown ids are ignored
  EXPECT_TRUE(store.empty());
  EXPECT_EQ(store.find(spec.key), nullptr);
  std::vector<Hash128> const keys{{1, 0}, {1, 1}};
  EXPECT_FALSE(store.findLongestSpecPath(keys, 2).has_value());
  EXPECT_TRUE(store.insert(spec).inserted) << "key is free again";
  EXPECT_THROW(store.touch(id), Error);
}

TEST(RecordStoreTest, InvalidRecordIsRejectedWithoutChange) {
  RecordStore store;
  CacheRecord bad = blockRecord(1, 2);
  bad.basePagePath.pop_back();
  EXPECT_THROW(store.insert(bad), Error);
  EXPECT_TRUE(store.empty());
  EXPECT_EQ(store.insert(blockRecord(1, 1)).record->id, 1U) << "no id was consumed";
}

TEST(RecordStoreTest, ASpeculationWhoseRetentionExpiresRanksByItsRankAgain) {
  RecordStore store;
  CacheRecord low = checkpoint(1, 64);  // published under a retention range of priority 2
  low.speculative = true;
  low.speculationRank = 3;
  low.heldPriority = 2;
  low.retentionPriority = speculationPriority(3, 2);
  low.retentionExpiry = 10;
  RecordId const id = store.insert(low).record->id;
  CacheRecord peer = checkpoint(2, 64);  // a rank-2 speculation under the default retention
  peer.speculative = true;
  peer.speculationRank = 2;
  peer.heldPriority = kDefaultRetentionPriority;
  peer.retentionPriority = 2;
  RecordId const peerId = store.insert(peer).record->id;
  EXPECT_EQ(store.get(id)->retentionPriority, 1);
  EXPECT_EQ(store.victimOrder(), (std::vector<RecordId>{id, peerId}));
  EXPECT_EQ(store.expireRetention(10), 1);
  EXPECT_EQ(store.get(id)->retentionPriority, 3) << "its rank, now under the default priority";
  EXPECT_EQ(store.get(id)->heldPriority, kDefaultRetentionPriority);
  EXPECT_TRUE(store.get(id)->speculative);
  EXPECT_EQ(store.victimOrder(), (std::vector<RecordId>{peerId, id}));
  store.touch(id);  // a prompt came through it: proven
  EXPECT_EQ(store.get(id)->retentionPriority, kDefaultRetentionPriority);
}

}  // namespace
}  // namespace mkv
