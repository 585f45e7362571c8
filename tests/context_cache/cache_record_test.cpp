#include "context_cache/cache_record.h"

#include <gtest/gtest.h>

#include "mkv/error.h"

namespace mkv {
namespace {

CacheRecord blockRecord(int32_t blocks) {
  CacheRecord r;
  for (int32_t b = 0; b < blocks; ++b) {
    r.logicalBlockDigests.push_back(Hash128{1, static_cast<uint64_t>(b)});
    r.basePagePath.push_back(b);
  }
  r.key = RecordKey{r.logicalBlockDigests.back(), blocks};
  return r;
}

CacheRecord checkpoint(int32_t blocks, bool attention) {
  CacheRecord r;
  for (int32_t b = 0; b < blocks; ++b) {
    r.logicalBlockDigests.push_back(Hash128{1, static_cast<uint64_t>(b)});
    if (attention) {
      r.basePagePath.push_back(b);
    }
  }
  r.key = RecordKey{Hash128{9, 9}, blocks};
  r.exactCheckpointLength = blocks * 4 + 1;
  r.recurrentSnapshotSlot = 0;
  r.partialKvSnapshotSlot = attention ? std::optional<SnapshotSlot>(0) : std::nullopt;
  return r;
}

TEST(CacheRecordTest, ValidRecordsPass) {
  EXPECT_NO_THROW(blockRecord(1).validate());
  CacheRecord spec = blockRecord(2);
  spec.specState = SpecState{{7, 8}};
  EXPECT_NO_THROW(spec.validate());
  EXPECT_NO_THROW(checkpoint(0, true).validate()) << "sub-page checkpoint";
  EXPECT_NO_THROW(checkpoint(2, false).validate()) << "pure recurrent: no base path";
  EXPECT_EQ(checkpoint(1, true).hybridKey(), (HybridKey{Hash128{9, 9}, 5, false}));
  CacheRecord mtp = checkpoint(1, true);
  mtp.specState = SpecState{{3}};
  EXPECT_EQ(mtp.hybridKey(), (HybridKey{Hash128{9, 9}, 5, true}));
  EXPECT_FALSE(blockRecord(1).hybridKey().has_value());
}

TEST(CacheRecordTest, EachBrokenRuleIsRejected) {
  CacheRecord empty = blockRecord(1);
  empty.logicalBlockDigests.clear();
  empty.basePagePath.clear();
  empty.key.fullBlockCount = 0;
  EXPECT_THROW(empty.validate(), Error) << "block record without blocks";

  CacheRecord countMismatch = blockRecord(2);
  countMismatch.key.fullBlockCount = 3;
  EXPECT_THROW(countMismatch.validate(), Error);

  CacheRecord wrongTerminal = blockRecord(2);
  wrongTerminal.key.terminal = Hash128{5, 5};
  EXPECT_THROW(wrongTerminal.validate(), Error);

  CacheRecord shortPath = blockRecord(2);
  shortPath.basePagePath.pop_back();
  EXPECT_THROW(shortPath.validate(), Error);

  CacheRecord shortDraft = blockRecord(2);
  shortDraft.specState = SpecState{{1}};
  EXPECT_THROW(shortDraft.validate(), Error);

  CacheRecord snapshotOnBlockRecord = blockRecord(1);
  snapshotOnBlockRecord.recurrentSnapshotSlot = 0;
  EXPECT_THROW(snapshotOnBlockRecord.validate(), Error);

  CacheRecord noRecurrent = checkpoint(1, true);
  noRecurrent.recurrentSnapshotSlot.reset();
  EXPECT_THROW(noRecurrent.validate(), Error);

  CacheRecord zeroLength = checkpoint(1, true);
  zeroLength.exactCheckpointLength = 0;
  EXPECT_THROW(zeroLength.validate(), Error);

  CacheRecord negativeId = blockRecord(1);
  negativeId.basePagePath[0] = -1;
  EXPECT_THROW(negativeId.validate(), Error);
}

TEST(CacheRecordTest, ResourcesListEveryReference) {
  CacheRecord r = checkpoint(2, true);
  r.specState = SpecState{{5, 6}};
  std::vector<ResourceId> const expected{
      {ResourceType::kBaseKvPage, 0},        {ResourceType::kBaseKvPage, 1},
      {ResourceType::kDraftKvPage, 5},       {ResourceType::kDraftKvPage, 6},
      {ResourceType::kRecurrentSnapshot, 0}, {ResourceType::kPartialKvSnapshot, 0}};
  EXPECT_EQ(r.resources(), expected);
}

TEST(CacheRecordTest, ASpeculationRanksBelowWhatItsRetentionGaveIt) {
  EXPECT_EQ(speculationPriority(0, kDefaultRetentionPriority), kMinRetentionPriority);
  EXPECT_EQ(speculationPriority(3, kDefaultRetentionPriority), 3);
  EXPECT_EQ(speculationPriority(31, kDefaultRetentionPriority), kMaxSpeculationRank);
  EXPECT_EQ(speculationPriority(-1, kDefaultRetentionPriority), kMinRetentionPriority);
  EXPECT_EQ(speculationPriority(12, 10), 9) << "below a lowered retention";
  EXPECT_EQ(speculationPriority(5, 1), kMinRetentionPriority);
  EXPECT_EQ(speculationPriority(5, kMinRetentionPriority), kMinRetentionPriority);
  EXPECT_EQ(speculationPriority(40, kMaxRetentionPriority), kMaxSpeculationRank);
}

}  // namespace
}  // namespace mkv
