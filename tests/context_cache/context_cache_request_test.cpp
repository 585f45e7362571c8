// ContextCacheRequest (docs/architecture.md, "One request's path through the layers, from `begin`
// to `finish`"): the translation of the runtime's request view (LLMGenerationRequest +
// DecodingInferenceContext) into coordinator calls: identity keys (LoRA, salt, images), lookup
// policies, publication at decode end, compaction of the prefill starts and in-flight admission.
// KV is written and verified by the oracle throughout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "context_cache/context_cache_manager.h"
#include "coordinator_test_rig.h"

namespace mkv::test {
namespace {

using AdmitStatus = ContextCacheRequest::AdmitSequenceStatus;
constexpr int32_t kImageToken = 32000;

class ContextCacheRequestTest : public DeviceTest {};

/// Runs one single-row request (begin, prefill, finish) on `slot` and returns its prefill start.
int32_t runOnce(CoordinatorRig& rig, std::vector<int32_t> const& prompt, std::string lora = {},
                std::string salt = {}, std::vector<imageUtils::ImageData> images = {},
                CacheSlot slot = 0) {
  RequestDriver driver(rig, std::move(lora), std::move(salt));
  driver.add(prompt, slot, std::nullopt, std::move(images));
  if (!driver.request.requests[0].imageBuffers.empty()) {
    driver.useMedia({kImageToken});
  }
  EXPECT_TRUE(driver.begin());
  if (!driver.cache) {
    return -1;
  }
  int32_t const start = driver.cache->reuseTokenLength(0);
  EXPECT_TRUE(driver.prefill());
  EXPECT_TRUE(driver.cache->finish());
  return start;
}

imageUtils::ImageData hostImage(uint8_t seed) {
  auto pixels = std::make_shared<Tensor>(Coords{4, 4, 3}, DataType::kUInt8, DeviceType::kCPU);
  auto* bytes = static_cast<uint8_t*>(pixels->rawPointer());
  for (int i = 0; i < 48; ++i) {
    bytes[i] = static_cast<uint8_t>(seed + 7 * i);
  }
  return imageUtils::ImageData{pixels, 4, 4, 3};
}

/// text, a run of `run` image placeholders, text ...: the image lies inside the first block.
std::vector<int32_t> imagePrompt(std::vector<int32_t> const& runLengths, int32_t total) {
  std::vector<int32_t> tokens = tokenRun(10, 1);
  for (int32_t run : runLengths) {
    tokens.insert(tokens.end(), static_cast<std::size_t>(run), kImageToken);
    tokens.push_back(7);
  }
  std::vector<int32_t> const tail = tokenRun(total - static_cast<int32_t>(tokens.size()), 500);
  return concatenated(tokens, tail);
}

TEST_P(ContextCacheRequestTest, LoraIdentityKeysTheBlocks) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  EXPECT_EQ(runOnce(rig, prompt, "adapter-a"), 0);
  EXPECT_EQ(runOnce(rig, concatenated(prompt, {1}), "adapter-a"), 128);
  uint64_t const before = rig.coordinator.metrics().missCount(MissReason::kLoraMismatch);
  EXPECT_EQ(runOnce(rig, concatenated(prompt, {1}), "adapter-b"), 0);
  EXPECT_EQ(runOnce(rig, concatenated(prompt, {2})), 0) << "the base model is another identity";
  EXPECT_EQ(rig.coordinator.metrics().missCount(MissReason::kLoraMismatch), before + 2);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, CacheSaltIsolatesTenants) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  EXPECT_EQ(runOnce(rig, prompt, {}, "tenant-1"), 0);
  EXPECT_EQ(runOnce(rig, concatenated(prompt, {1}), {}, "tenant-1"), 128);
  EXPECT_EQ(runOnce(rig, concatenated(prompt, {1}), {}, "tenant-2"), 0);
  EXPECT_EQ(rig.coordinator.metrics().missCount(MissReason::kSaltMismatch), 1u);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, HostImageKeysThePlaceholderRunOnItsPixels) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = imagePrompt({64}, 140);
  EXPECT_EQ(runOnce(rig, prompt, {}, {}, {hostImage(1)}), 0);
  EXPECT_EQ(rig.coordinator.metrics().bypasses, 0u) << "a host RGB image is media-aware";
  EXPECT_EQ(runOnce(rig, prompt, {}, {}, {hostImage(1)}), 128);
  EXPECT_EQ(runOnce(rig, prompt, {}, {}, {hostImage(2)}), 0);
  EXPECT_EQ(rig.coordinator.metrics().missCount(MissReason::kMediaMismatch), 1u);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, TheSameImageAtAnotherPositionMisses) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = imagePrompt({40, 40}, 140);
  EXPECT_EQ(runOnce(rig, prompt, {}, {}, {hostImage(1), hostImage(2)}), 0);
  EXPECT_EQ(runOnce(rig, prompt, {}, {}, {hostImage(1), hostImage(2)}), 128);
  // Same tokens, same two images, swapped runs.
  EXPECT_EQ(runOnce(rig, prompt, {}, {}, {hostImage(2), hostImage(1)}), 0);
  EXPECT_EQ(rig.coordinator.metrics().missCount(MissReason::kMediaMismatch), 1u);
  // The first image one token later (the text before it is longer).
  std::vector<int32_t> shifted =
      concatenated(tokenRun(11, 1), std::vector<int32_t>(40, kImageToken));
  shifted = concatenated(concatenated(shifted, {7}), tokenRun(88, 500));
  EXPECT_EQ(runOnce(rig, shifted, {}, {}, {hostImage(1)}), 0);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AnImageTheHostCannotReadBypassesAndKeepsItsResidentRow) {
  auto floatPixels =
      std::make_shared<Tensor>(Coords{4, 4, 3}, DataType::kFloat32, DeviceType::kCPU);
  auto rgbaPixels = std::make_shared<Tensor>(Coords{4, 4, 4}, DataType::kUInt8, DeviceType::kCPU);
  std::memset(rgbaPixels->rawPointer(), 9, 64);
  std::memset(floatPixels->rawPointer(), 0, 192);
  for (imageUtils::ImageData const& image :
       {imageUtils::ImageData{floatPixels, 4, 4, 3}, imageUtils::ImageData{rgbaPixels, 4, 4, 4}}) {
    ASSERT_EQ(image.data(), nullptr);
    CoordinatorRig rig(device());
    std::vector<int32_t> const prompt = imagePrompt({64}, 140);
    runOnce(rig, prompt, {}, {}, {hostImage(1)});  // the same tokens are cached
    uint64_t const bypasses = rig.coordinator.metrics().bypasses;
    RequestDriver driver(rig);
    driver.add(prompt, 2, std::nullopt, {image});
    driver.rows[0].resident = ResidentRef{2, 7};
    driver.context.residentRefs[0] = ResidentRef{2, 7};
    driver.useMedia({kImageToken});
    ASSERT_TRUE(driver.begin()) << "bypass, not failure";
    EXPECT_EQ(driver.cache->prefillStarts(), std::vector<int32_t>{0});
    EXPECT_EQ(rig.coordinator.metrics().bypasses, bypasses + 1);
    ASSERT_TRUE(driver.prefill());
    EXPECT_EQ(rig.mirroredPages(2).size(), 2u);
    EXPECT_TRUE(rig.mirroredPages(0).empty());
    EXPECT_TRUE(rig.mirroredPages(1).empty());
    ASSERT_TRUE(driver.decode({{0, FinishReason::kLength}}));
    EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
    EXPECT_EQ(rig.coordinator.metrics().publishedRecords, 1u) << "the bypass published nothing";
    ASSERT_TRUE(driver.cache->finish());
    rig.expectQuiescent();
  }
}

TEST_P(ContextCacheRequestTest, RequestLookupPolicyOverridesTheBatchDefaultPerSequence) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const prompt = tokenRun(129, 100);
  runOnce(rig, prompt);
  RequestDriver driver(rig);
  driver.add(concatenated(prompt, {1}), 0, ContextCacheLookupPolicy::kBypass);
  driver.add(concatenated(prompt, {2}), 1);
  ASSERT_TRUE(driver.begin());
  EXPECT_EQ(driver.cache->prefillStarts(), (std::vector<int32_t>{0, 128}));
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, DecodePublishesTheGeneratedPageBoundaryAndRejectsPairingMisuse) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  driver.add(tokenRun(255, 100), 0);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.cache->prepareDecodeStep(driver.context, kVanilla));
  EXPECT_TRUE(throwsError([&] { driver.cache->prepareDecodeStep(driver.context, kVanilla); },
                          {"prepareDecodeStep", "already prepared"}));
  rig.executeDecode(driver.rows[0], 0);
  driver.context.generatedTokenIds[0].push_back(driver.rows[0].tokens.back());
  driver.context.finishReasons[0] = FinishReason::kLength;
  ASSERT_TRUE(driver.cache->completeDecodeStep(driver.context, {}));
  EXPECT_TRUE(throwsError([&] { driver.cache->completeDecodeStep(driver.context, {}); },
                          {"completeDecodeStep", "no decode step"}));
  std::vector<CacheRecord> const records = rig.records();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_EQ(records.back().key.fullBlockCount, 2);
  ASSERT_TRUE(driver.cache->finish());
  std::vector<int32_t> const ledger = driver.rows[0].tokens;
  EXPECT_EQ(
      runOnce(rig, concatenated(std::vector<int32_t>(ledger.begin(), ledger.begin() + 256), {5}),
              {}, {}, {}, 1),
      256);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, CancelledAndErroredSlotsAreNeverPublished) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  driver.add(tokenRun(255, 100), 0);
  driver.add(tokenRun(255, 1000), 1);
  driver.add(tokenRun(255, 2000), 2);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_EQ(rig.coordinator.metrics().records, 3);
  // Rows 1 and 2 reach 256 committed tokens, then stop cancelled / errored.
  ASSERT_TRUE(driver.decode({{1, FinishReason::kCancelled}, {2, FinishReason::kError}}));
  EXPECT_EQ(rig.coordinator.metrics().records, 3);
  EXPECT_EQ(rig.coordinator.counters().decodePublications, 0u);
  // They hold (no token) while row 0 finishes and publishes its two blocks.
  ASSERT_TRUE(driver.decode({{0, FinishReason::kLength}}));
  EXPECT_EQ(rig.coordinator.metrics().records, 4);
  EXPECT_EQ(rig.coordinator.counters().decodePublications, 1u);
  // A row without a token must be cancelled or errored.
  EXPECT_TRUE(
      throwsError([&] { driver.decode(); }, {"completeDecodeStep", "not cancelled or errored"}));
  std::vector<Seq> const rows = driver.rows;
  driver.cache.reset();  // abandoned with the step pending: synchronised and released
  EXPECT_FALSE(rig.coordinator.poisoned());
  for (std::size_t row = 1; row < 3; ++row) {
    std::vector<int32_t> const& ledger = rows[row].tokens;
    EXPECT_EQ(runOnce(rig, std::vector<int32_t>(ledger.begin(), ledger.begin() + 257)), 128)
        << "row " << row << " published only its prompt block";
  }
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, MalformedProgressIsRejectedBeforeMutation) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  driver.add(tokenRun(255, 100), 0);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.cache->prepareDecodeStep(driver.context, kVanilla));
  rig.executeDecode(driver.rows[0], 0);
  std::vector<int32_t>& generated = driver.context.generatedTokenIds[0];
  generated.push_back(driver.rows[0].tokens.back());
  generated.push_back(77);  // vanilla decoding accepts one token per step
  driver.context.finishReasons[0] = FinishReason::kLength;
  EXPECT_TRUE(throwsError([&] { driver.cache->completeDecodeStep(driver.context, {}); },
                          {"completeDecodeStep", "vanilla decode accepts 1 token"}));
  generated.pop_back();
  ASSERT_TRUE(driver.cache->completeDecodeStep(driver.context, {}));
  EXPECT_EQ(rig.records().back().key.fullBlockCount, 2);
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, CompactionKeepsResidentRowsAndCompactsPrefillStarts) {
  CoordinatorRig rig(device());
  std::vector<int32_t> const shared = tokenRun(129, 7000);
  runOnce(rig, shared);
  RequestDriver driver(rig);
  driver.add(tokenRun(100, 1), 0);
  driver.add(tokenRun(200, 1000), 1);
  driver.add(
      concatenated(std::vector<int32_t>(shared.begin(), shared.begin() + 128), tokenRun(122, 1)),
      2);
  ASSERT_TRUE(driver.begin());
  EXPECT_EQ(driver.cache->prefillStarts(), (std::vector<int32_t>{0, 0, 128}));
  ASSERT_TRUE(driver.prefill());
  ASSERT_TRUE(driver.decode({{1, FinishReason::kEndOfSequence}}));
  std::vector<int32_t> const row0 = rig.hostRow(0);
  std::vector<int32_t> const row2 = rig.hostRow(2);
  std::vector<int32_t> const mapping{0, -1, 1};
  Tensor deviceMapping({3}, DataType::kInt32, device());
  ASSERT_TRUE(driver.cache->beginBatchCompaction(mapping, 2, deviceMapping));
  EXPECT_EQ(readAs<int32_t>(deviceMapping), mapping);
  ASSERT_TRUE(driver.cache->completeBatchCompaction(mapping));
  driver.compactView(mapping);
  EXPECT_EQ(driver.cache->prefillStarts(), (std::vector<int32_t>{0, 128}));
  EXPECT_EQ(driver.cache->reuseTokenLength(1), 128);
  EXPECT_EQ(rig.hostRow(0), row0);
  EXPECT_EQ(rig.deviceRow(0), row0);
  EXPECT_EQ(rig.hostRow(2), row2);
  EXPECT_EQ(rig.deviceRow(2), row2);
  EXPECT_TRUE(rig.mirroredPages(1).empty());
  EXPECT_EQ(rig.kvLengths(), (std::vector<int32_t>{101, 251}));
  // Growth after the compaction extends the survivors' own rows only.
  std::size_t const pages0 = rig.hostPages(0).size();
  std::size_t const pages2 = rig.hostPages(2).size();
  for (int step = 0; step < 28; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  std::vector<PageId> const grown0 = rig.mirroredPages(0);
  std::vector<PageId> const grown2 = rig.mirroredPages(2);
  EXPECT_EQ(grown0.size(), pages0 + 1);
  EXPECT_EQ(grown2.size(), pages2 + 1);
  EXPECT_TRUE(
      std::equal(row0.begin(), row0.begin() + static_cast<std::ptrdiff_t>(pages0), grown0.begin()));
  EXPECT_TRUE(
      std::equal(row2.begin(), row2.begin() + static_cast<std::ptrdiff_t>(pages2), grown2.begin()));
  EXPECT_TRUE(rig.mirroredPages(1).empty());
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  EXPECT_EQ(rig.kvLengths(), (std::vector<int32_t>{129, 279}));
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

// ---------------------------------------------------------------- in-flight admission

/// A founder on slot 0 whose 256-token system prompt is published at prefill.
struct JoinFixture {
  explicit JoinFixture(CoordinatorRig& rig) : driver(rig) {
    driver.add(concatenated(system, {1, 2, 3}), 0);
    EXPECT_TRUE(driver.begin());
    EXPECT_TRUE(driver.prefill());
    EXPECT_TRUE(driver.decode());
  }
  std::vector<int32_t> const system = tokenRun(256, 10);
  std::vector<int32_t> joinerPrompt() const { return concatenated(system, tokenRun(130, 8000)); }
  RequestDriver driver;
};

TEST_P(ContextCacheRequestTest, AJoinerReusesTheFoundersPrefixAndBindsOnlyItsRow) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  std::vector<int32_t> const founderRow = rig.hostRow(0);
  int64_t const records = rig.coordinator.metrics().records;
  int32_t start = -1;
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1, &start), AdmitStatus::kAdmitted);
  EXPECT_EQ(start, 256);
  EXPECT_EQ(driver.cache->prefillStarts(), (std::vector<int32_t>{0, 256}));
  std::vector<PageId> const joinerPages = rig.mirroredPages(1);
  std::vector<PageId> const founderPages = rig.mirroredPages(0);
  ASSERT_EQ(joinerPages.size(), 4u);
  EXPECT_EQ(std::vector<PageId>(joinerPages.begin(), joinerPages.begin() + 2),
            std::vector<PageId>(founderPages.begin(), founderPages.begin() + 2));
  EXPECT_EQ(rig.hostRow(0), founderRow);
  EXPECT_TRUE(rig.mirroredPages(2).empty());
  EXPECT_EQ(rig.activeRefs(joinerPages[0]), 2);
  EXPECT_EQ(rig.activeRefs(joinerPages[1]), 2);
  ASSERT_TRUE(driver.seatNewest());  // verifies the reused 256 positions, publishes
  EXPECT_EQ(rig.coordinator.metrics().records, records + 1);
  EXPECT_EQ(rig.records().back().key.fullBlockCount, 3);
  for (int step = 0; step < 3; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  EXPECT_EQ(rig.coordinator.counters().liveAdmissions, 1u);
  ASSERT_TRUE(driver.cache->finish());
  std::vector<int32_t> const prompt = fixture.joinerPrompt();
  EXPECT_EQ(
      runOnce(rig, concatenated(std::vector<int32_t>(prompt.begin(), prompt.begin() + 384), {9}),
              {}, {}, {}, 2),
      384);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, RetractingAnAdmissionUnwindsItAndTheRowStaysUsable) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  int32_t const free = rig.freePages();
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  EXPECT_EQ(rig.freePages(), free - 2);
  ASSERT_TRUE(driver.retractNewest());
  EXPECT_EQ(rig.freePages(), free);
  EXPECT_TRUE(rig.mirroredPages(1).empty());
  EXPECT_EQ(driver.cache->prefillStarts(), std::vector<int32_t>{0});
  EXPECT_EQ(rig.coordinator.counters().retractedAdmissions, 1u);
  // The founder cannot be retracted: nothing to undo, false, nothing changed.
  EXPECT_FALSE(driver.cache->retractSequenceAdmission());
  EXPECT_EQ(rig.freePages(), free);
  EXPECT_EQ(rig.coordinator.counters().retractedAdmissions, 1u);
  EXPECT_FALSE(rig.coordinator.poisoned());
  EXPECT_EQ(driver.cache->prefillStarts(), std::vector<int32_t>{0});
  ASSERT_TRUE(driver.decode());
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AnUnfinalizedJoinerHoldsAtZeroAdvance) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  int32_t const founderBefore = driver.rows[0].materialized;
  ASSERT_TRUE(driver.decode()) << "the never-finalised joiner holds";
  EXPECT_EQ(driver.rows[0].materialized, founderBefore + 1);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AChunkedJoinerPublishesEachChunksBlocksForTheNextJoiner) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  std::vector<int32_t> const prompt = fixture.joinerPrompt();  // 386 tokens, 256 shared
  std::size_t const records = rig.records().size();
  int32_t start = -1;
  ASSERT_EQ(driver.admit(prompt, 1, &start), AdmitStatus::kAdmitted);
  ASSERT_EQ(start, 256);
  ASSERT_TRUE(driver.prefillChunk(1, 300));  // no block completed
  EXPECT_EQ(rig.records().size(), records);
  ASSERT_TRUE(driver.decode()) << "the founder decodes, the joiner holds";
  ASSERT_TRUE(driver.prefillChunk(1, 384));  // completes block 2
  ASSERT_EQ(rig.records().size(), records + 1);
  EXPECT_EQ(rig.records().back().key.fullBlockCount, 3);
  EXPECT_EQ(rig.coordinator.counters().prefillChunks, 2u);
  // A sequence admitted meanwhile reuses the block the chunk published.
  int32_t next = -1;
  ASSERT_EQ(driver.admit(concatenated(std::vector<int32_t>(prompt.begin(), prompt.begin() + 384),
                                      tokenRun(20, 9100)),
                         2, &next),
            AdmitStatus::kAdmitted);
  EXPECT_EQ(next, 384);
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.seat(1)) << "the last chunk, [384, 386), then the lookahead";
  ASSERT_TRUE(driver.seat(2));
  ASSERT_TRUE(driver.decode());
  for (std::size_t row = 0; row < 3; ++row) {
    EXPECT_TRUE(rig.verify(driver.rows[row]).ok()) << row;
  }
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AChunkOutsideItsPlaceThrowsAndChangesNothing) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  ASSERT_TRUE(driver.prefillChunk(1, 300));
  std::size_t const records = rig.records().size();
  auto chunk = [&](int32_t row, int32_t tokens) {
    return [&driver, row, tokens] { (void)driver.cache->completePrefillChunk(row, tokens); };
  };
  EXPECT_TRUE(throwsError(chunk(1, 299), {"ContextCacheCoordinator::completePrefillChunk",
                                          "row 1: 299 prefilled tokens outside [300 (done so "
                                          "far), 386 (the prompt)]"}));
  EXPECT_TRUE(throwsError(chunk(1, 387), {"outside [300 (done so far), 386 (the prompt)]"}));
  EXPECT_TRUE(throwsError(chunk(0, 259), {"row 0 is not an unfinalised in-flight admission"}));
  ASSERT_TRUE(driver.cache->prepareDecodeStep(driver.context, kVanilla));
  EXPECT_TRUE(throwsError(chunk(1, 384), {"a chunk completes after the step that ran it"}));
  EXPECT_EQ(rig.records().size(), records);
  EXPECT_EQ(rig.coordinator.counters().prefillChunks, 1u);
  rig.executeDecode(driver.rows[0], 0);  // the step goes on: the founder decodes
  driver.context.generatedTokenIds[0].push_back(driver.rows[0].tokens.back());
  ASSERT_TRUE(driver.cache->completeDecodeStep(driver.context, {}));
  ASSERT_TRUE(driver.prefillChunk(1, 384));
  ASSERT_TRUE(driver.seat(1));
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

// ---------------------------------------------------------------- founders in chunks

TEST_P(ContextCacheRequestTest, AFoundersChunksAreReusedByAJoinerAdmittedWhileItPrefills) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  std::vector<int32_t> const prompt = tokenRun(450, 10);
  driver.add(prompt, 0);
  ASSERT_TRUE(driver.begin());
  std::size_t const records = rig.records().size();
  ASSERT_TRUE(driver.prefillFirstChunks({300})) << "the founder's first chunk, [0, 300)";
  ASSERT_EQ(rig.records().size(), records + 1) << "its two full blocks are published";
  EXPECT_EQ(rig.records().back().key.fullBlockCount, 2);
  EXPECT_TRUE(driver.cache->awaitsPrefill(0));
  EXPECT_TRUE(driver.context.generatedTokenIds[0].empty());
  EXPECT_EQ(rig.coordinator.counters().heldPrefills, 1u);
  EXPECT_EQ(rig.coordinator.counters().prefillChunks, 1u);
  EXPECT_EQ(rig.coordinator.counters().prefillPublications, 0u) << "its prompt is not done";
  // A sequence arriving now joins and reuses the founder's first chunk.
  int32_t start = -1;
  ASSERT_EQ(driver.admit(concatenated(std::vector<int32_t>(prompt.begin(), prompt.begin() + 280),
                                      tokenRun(40, 7000)),
                         1, &start),
            AdmitStatus::kAdmitted);
  EXPECT_EQ(start, 256);
  EXPECT_EQ(rig.mirroredPages(1)[0], rig.mirroredPages(0)[0]);
  ASSERT_TRUE(driver.seat(1));
  ASSERT_TRUE(driver.decode()) << "the joiner decodes, the founder holds";
  ASSERT_TRUE(driver.prefillChunk(0, 384));
  EXPECT_EQ(rig.records().back().key.fullBlockCount, 3);
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.seat(0)) << "the founder's last chunk, [384, 450), then its lookahead";
  EXPECT_FALSE(driver.cache->awaitsPrefill(0));
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.decode());
  for (std::size_t row = 0; row < 2; ++row) {
    EXPECT_TRUE(rig.verify(driver.rows[row]).ok()) << row;
  }
  EXPECT_EQ(rig.coordinator.counters().prefillChunks, 2u);
  ASSERT_TRUE(driver.cache->finish());
  EXPECT_EQ(
      runOnce(rig, concatenated(std::vector<int32_t>(prompt.begin(), prompt.begin() + 384), {9}),
              {}, {}, {}, 2),
      384);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AFounderAndAWholeFounderShareAPrefillAndTheHeldOneFinishesLater) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  driver.add(tokenRun(400, 10), 0);
  driver.add(tokenRun(200, 3000), 1);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefillFirstChunks({130, 200}));
  EXPECT_TRUE(driver.cache->awaitsPrefill(0));
  EXPECT_FALSE(driver.cache->awaitsPrefill(1));
  EXPECT_EQ(rig.coordinator.counters().prefillPublications, 1u) << "the whole founder only";
  ASSERT_TRUE(driver.decode()) << "the whole founder decodes, the held one holds";
  ASSERT_TRUE(driver.prefillChunk(0, 260));
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.seat(0));
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  EXPECT_EQ(rig.coordinator.counters().prefillPublications, 2u);
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AFoundersChunkOutsideItsPlaceThrowsAndChangesNothing) {
  CoordinatorRig rig(device());
  {
    // Under kFullyCommitted no row may hold (a held founder is finalised with a lookahead).
    RequestDriver driver(rig);
    driver.add(tokenRun(300, 10), 0);
    ASSERT_TRUE(driver.begin(DecodingTokenStateContract::kFullyCommitted));
    ASSERT_TRUE(driver.cache->preparePrefill());
    rig.oracle.write(driver.rows[0].resident.slot, driver.rows[0].digests, 0, 200);
    EXPECT_TRUE(throwsError([&] { (void)driver.cache->preparePrefillChunk(0, 200); },
                            {"ContextCacheCoordinator::preparePrefillChunk",
                             "row 0: a founder's prefill goes on in chunks as an in-flight "
                             "admission, which this request does not take"}));
    EXPECT_TRUE(throwsError([&] { (void)driver.cache->completePrefillChunk(0, 200); },
                            {"ContextCacheCoordinator::completePrefillChunk",
                             "row 0: a founder's prefill goes on in chunks as an in-flight "
                             "admission, which this request does not take"}));
    EXPECT_EQ(rig.coordinator.counters().prefillChunks, 0u);
    EXPECT_FALSE(driver.cache->awaitsPrefill(0));
    ASSERT_TRUE(driver.cache->finish());
  }
  RequestDriver driver(rig);
  driver.add(tokenRun(300, 10), 0);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.cache->preparePrefill());
  Seq& founder = driver.rows[0];
  // Preparing the founder's first chunk only checks: its whole prompt is bound already.
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->preparePrefillChunk(0, 301); },
                          {"ContextCacheCoordinator::preparePrefillChunk",
                           "row 0: chunk end 301 outside (0 (done so far), 300 (the prompt)]"}));
  EXPECT_EQ(driver.cache->prefillChunkDemand(0, 200), DecodeStepDemand{});
  ASSERT_TRUE(driver.cache->preparePrefillChunk(0, 200));
  rig.oracle.write(founder.resident.slot, founder.digests, 0, 200);
  founder.materialized = 200;
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->completePrefillChunk(0, 301); },
                          {"row 0: 301 prefilled tokens outside [0 (done so far), 300"}));
  std::size_t const records = rig.records().size();
  ASSERT_TRUE(driver.cache->completePrefillChunk(0, 200));
  EXPECT_EQ(rig.records().size(), records + 1);
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->completePrefillChunk(0, 199); },
                          {"outside [200 (done so far), 300 (the prompt)]"}));
  // One chunk in the prefill step: the next ones come after completePrefill, as a joiner's.
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->preparePrefillChunk(0, 250); },
                          {"ContextCacheCoordinator::preparePrefillChunk",
                           "its first chunk (to 200) completed in this prefill"}));
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->completePrefillChunk(0, 250); },
                          {"ContextCacheCoordinator::completePrefillChunk",
                           "its first chunk (to 200) completed in this prefill"}));
  EXPECT_EQ(rig.records().size(), records + 1);
  // A held founder samples nothing: completePrefill refuses a lookahead for it, changing nothing.
  driver.context.generatedTokenIds[0].push_back(1);
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->completePrefill(driver.context, {}); },
                          {"ContextCacheRequest::completePrefill",
                           "row 0: its prefill chunks stopped short of its prompt, so it samples "
                           "nothing yet, got 1 generated tokens"}));
  EXPECT_EQ(rig.coordinator.counters().heldPrefills, 0u);
  driver.context.generatedTokenIds[0].clear();
  ASSERT_TRUE(driver.cache->completePrefill(driver.context, {}));
  EXPECT_EQ(rig.coordinator.counters().heldPrefills, 1u);
  // Now an in-flight admission: preemption refuses it, its next chunks and finalisation work.
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->preemptSequence(0); },
                          {"row 0 is an unfinalised in-flight admission"}));
  ASSERT_TRUE(driver.cache->preparePrefillChunk(0, 300));
  rig.oracle.write(founder.resident.slot, founder.digests, 200, 300);
  founder.materialized = 300;
  int32_t const length = 300;
  rig.pool.writeLengths(0, std::span<int32_t const>(&length, 1), nullptr);
  int32_t const lookahead = founder.sample();
  driver.context.generatedTokenIds[0].push_back(lookahead);
  ASSERT_TRUE(driver.cache->finalizeSequenceAdmission(0, lookahead, 300));
  ASSERT_TRUE(driver.cache->finish());
  EXPECT_EQ(runOnce(rig, concatenated(tokenRun(256, 10), {5}), {}, {}, {}, 1), 256);
  rig.expectQuiescent();
}

// ---------------------------------------------------------------- pages per chunk

RigOptions perChunkPages(int32_t numPages = 16) {
  RigOptions options;
  options.numPages = numPages;
  options.joinerPages = JoinerPageAllocation::kPerChunk;
  return options;
}

TEST_P(ContextCacheRequestTest, APerChunkJoinerTakesEachChunksPagesWhenItIsPrepared) {
  CoordinatorRig rig(device(), perChunkPages());
  JoinFixture fixture(rig);  // the founder: 3 pages, its 256-token system prompt published
  RequestDriver& driver = fixture.driver;
  std::vector<int32_t> const prompt = fixture.joinerPrompt();  // 386 tokens, 256 shared
  int32_t const free = rig.freePages();
  int32_t start = -1;
  ASSERT_EQ(driver.admit(prompt, 1, &start), AdmitStatus::kAdmitted);
  ASSERT_EQ(start, 256);
  // Admission binds the reused prefix only: the founder's two pages, shared, nothing fresh.
  std::vector<PageId> const founderPages = rig.mirroredPages(0);
  EXPECT_EQ(rig.mirroredPages(1),
            std::vector<PageId>(founderPages.begin(), founderPages.begin() + 2));
  EXPECT_EQ(rig.freePages(), free);
  // A chunk's demand is what its prepare takes: one page for [256, 300).
  EXPECT_EQ(driver.cache->prefillChunkDemand(1, 300).basePages, 1);
  EXPECT_EQ(driver.cache->prefillChunkDemand(1, 386).basePages, 2);
  EXPECT_EQ(rig.freePages(), free) << "the demand changes nothing";
  ASSERT_TRUE(driver.cache->preparePrefillChunk(1, 300));
  EXPECT_EQ(rig.freePages(), free - 1);
  ASSERT_EQ(rig.mirroredPages(1).size(), 3u);
  EXPECT_EQ(driver.cache->prefillChunkDemand(1, 384).basePages, 0);
  ASSERT_TRUE(driver.cache->preparePrefillChunk(1, 300)) << "prepared twice: nothing more";
  EXPECT_EQ(rig.freePages(), free - 1);
  ASSERT_TRUE(driver.prefillChunk(1, 300));
  ASSERT_TRUE(driver.decode()) << "the founder decodes, the joiner holds";
  ASSERT_TRUE(driver.cache->preparePrefillChunk(1, 384));  // the page [256, 384) has it already
  EXPECT_EQ(rig.freePages(), free - 1);
  ASSERT_TRUE(driver.prefillChunk(1, 384));
  EXPECT_EQ(rig.records().back().key.fullBlockCount, 3);
  ASSERT_TRUE(driver.cache->preparePrefillChunk(1, 386));  // the last chunk takes its page
  EXPECT_EQ(rig.freePages(), free - 2);
  EXPECT_EQ(rig.coordinator.counters().chunkPageGrowths, 2u);
  ASSERT_TRUE(driver.seat(1));
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, APerChunkJoinerWhoseChunkHasNoPagesFailsAloneAndChangesNothing) {
  CoordinatorRig rig(device(), perChunkPages(8));
  JoinFixture fixture(rig);  // 3 pages, 2 of them published
  RequestDriver& driver = fixture.driver;
  Seq bystander(tokenRun(400, 50), 2);
  ContextCacheBatchAdmission batch = rig.batchOf({&bystander});
  batch.lookupPolicy = ContextCacheLookupPolicy::kBypass;
  auto held = rig.begin(batch);  // 4 pages
  ASSERT_EQ(held.status, ContextCacheStatus::kOk);
  ASSERT_EQ(rig.freePages(), 1);
  // Whole-prompt admission would need 2 fresh pages and be refused; per chunk it is admitted.
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  EXPECT_EQ(rig.freePages(), 1);
  ASSERT_TRUE(driver.cache->preparePrefillChunk(1, 384));
  ASSERT_TRUE(driver.prefillChunk(1, 384));
  ASSERT_EQ(rig.freePages(), 0);
  std::vector<int32_t> const founderRow = rig.hostRow(0);
  std::vector<int32_t> const joinerRow = rig.hostRow(1);
  // The last chunk's page: none free, nothing reclaimable (every cached page is leased).
  EXPECT_EQ(driver.cache->prefillChunkDemand(1, 386).basePages, 1);
  EXPECT_FALSE(driver.cache->preparePrefillChunk(1, 386));
  EXPECT_EQ(driver.cache->lastFailure(), (RowFailure{RowFailureReason::kNoCapacity, 1}));
  EXPECT_EQ(rig.coordinator.counters().growthFailures, 1u);
  EXPECT_FALSE(rig.coordinator.poisoned());
  EXPECT_EQ(rig.hostRow(0), founderRow);
  EXPECT_EQ(rig.hostRow(1), joinerRow);
  EXPECT_EQ(rig.freePages(), 0);
  // Finalising tokens whose pages were never prepared is the engine's bug: it throws.
  int32_t const lookahead = 7;
  EXPECT_TRUE(throwsError(
      [&] { (void)driver.cache->finalizeSequenceAdmission(1, lookahead, 386); },
      {"ContextCacheCoordinator::finalizeSequenceAdmission",
       "row 1: its first 386 tokens need 4 base pages and it holds 3", "preparePrefillChunk"}));
  // The batch goes on; once the bystander is gone the chunk gets its page.
  ASSERT_TRUE(driver.decode());
  ASSERT_EQ(rig.coordinator.finish(held.admission->request), ContextCacheStatus::kOk);
  ASSERT_TRUE(driver.cache->preparePrefillChunk(1, 386));
  ASSERT_TRUE(driver.seat(1));
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AChunkWithoutItsPagesCannotComplete) {
  CoordinatorRig rig(device(), perChunkPages());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  std::size_t const records = rig.records().size();
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->completePrefillChunk(1, 300); },
                          {"ContextCacheCoordinator::completePrefillChunk",
                           "row 1: its first 300 tokens need 3 base pages and it holds 2"}));
  EXPECT_EQ(rig.coordinator.counters().prefillChunks, 0u);
  EXPECT_EQ(rig.records().size(), records);
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->preparePrefillChunk(1, 387); },
                          {"ContextCacheCoordinator::preparePrefillChunk",
                           "chunk end 387 outside (256 (done so far), 386 (the prompt)]"}));
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->prefillChunkDemand(0, 300); },
                          {"ContextCacheCoordinator::prefillChunkDemand",
                           "row 0 is not an unfinalised in-flight admission"}));
  // Retracting it gives back the shared pages it pinned and nothing else.
  int32_t const free = rig.freePages();
  ASSERT_TRUE(driver.retractNewest());
  EXPECT_EQ(rig.freePages(), free);
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, APreemptedRowIsResumedFromWhatItPublished) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  driver.add(tokenRun(100, 1), 0);
  driver.add(tokenRun(200, 1000), 1);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  for (int step = 0; step < 60; ++step) {  // row 1 commits 260 tokens: two full blocks
    ASSERT_TRUE(driver.decode());
  }
  std::size_t const records = rig.records().size();
  int32_t const free = rig.freePages();
  ASSERT_TRUE(driver.cache->preemptSequence(1));
  ASSERT_EQ(rig.records().size(), records + 1);
  EXPECT_EQ(rig.records().back().key.fullBlockCount, 2) << "its prompt and reply, 256 tokens";
  EXPECT_EQ(rig.coordinator.counters().preemptions, 1u);
  EXPECT_EQ(rig.freePages(), free) << "its pages stay until the compaction";
  // The engine drops the row, then resumes it later: its prompt and tokens admitted again.
  std::vector<int32_t> const resumed(driver.rows[1].tokens.begin(), driver.rows[1].tokens.end());
  std::vector<int32_t> const mapping{0, -1};
  Tensor deviceMapping({2}, DataType::kInt32, device());
  ASSERT_TRUE(driver.cache->beginBatchCompaction(mapping, 1, deviceMapping));
  ASSERT_TRUE(driver.cache->completeBatchCompaction(mapping));
  driver.compactView(mapping);
  ASSERT_TRUE(driver.decode());
  int32_t start = -1;
  ASSERT_EQ(driver.admit(resumed, 1, &start), AdmitStatus::kAdmitted);
  EXPECT_EQ(start, 256) << "the published blocks, verified by the oracle at its seating";
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

/// What a preemption of row 1 left behind: its two published blocks on each tier right after the
/// compaction that dropped it, and its resumption.
struct PreemptionTrace {
  int32_t freedPages = 0;  ///< free pages the compaction gained
  std::vector<bool> onGpu;
  std::vector<bool> onHost;
  uint64_t swappedOutBlocks = 0;
  int32_t resumedStart = -1;
  uint64_t onboardedPages = 0;
  std::vector<int32_t> tokens;  ///< row 1's ledger after its resumption and one decode step
};

/// Row 0 (`firstPrompt`) and row 1 (200 tokens) decode 60 steps (row 1 commits 260 tokens: two
/// full blocks), row 1 is preempted with `kind` and compacted away, one step runs, and row 1 is
/// admitted again with its prompt and tokens, seated and decoded once. The rig has a host tier of
/// 8 pages either way.
PreemptionTrace preemptAndResume(DeviceType device, PreemptionKind kind,
                                 std::vector<int32_t> const& firstPrompt) {
  RigOptions options;
  options.hostTierPages = 8;
  CoordinatorRig rig(device, options);
  RequestDriver driver(rig);
  driver.add(firstPrompt, 0);
  driver.add(tokenRun(200, 1000), 1);
  PreemptionTrace trace;
  EXPECT_TRUE(driver.begin() && driver.prefill());
  for (int step = 0; step < 60; ++step) {
    EXPECT_TRUE(driver.decode());
  }
  std::vector<int32_t> const resumed = driver.rows[1].tokens;
  std::vector<Hash128> const keys = hashFullBlocks(
      PromptView{std::span<int32_t const>(resumed).first(256), {}, {}}, rig.options.pageSize);
  int32_t const free = rig.freePages();
  EXPECT_TRUE(driver.cache->preemptSequence(1, kind));
  std::vector<int32_t> const mapping{0, -1};
  Tensor deviceMapping({2}, DataType::kInt32, device);
  EXPECT_TRUE(driver.cache->beginBatchCompaction(mapping, 1, deviceMapping));
  EXPECT_TRUE(driver.cache->completeBatchCompaction(mapping));
  driver.compactView(mapping);
  trace.freedPages = rig.freePages() - free;
  for (Hash128 const& key : keys) {
    trace.onGpu.push_back(rig.manager().index().find(key).has_value());
    trace.onHost.push_back(rig.manager().hostTier()->index().find(key).has_value());
  }
  trace.swappedOutBlocks = rig.coordinator.metrics().swappedOutBlocks;
  EXPECT_TRUE(driver.decode());
  EXPECT_EQ(driver.admit(resumed, 1, &trace.resumedStart), AdmitStatus::kAdmitted);
  trace.onboardedPages = rig.coordinator.metrics().onboardedPages;
  EXPECT_TRUE(driver.seatNewest()) << "the oracle verified the reused prefix";
  EXPECT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  trace.tokens = driver.rows[1].tokens;
  EXPECT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
  return trace;
}

TEST_P(ContextCacheRequestTest, ASwappedOutRowLeavesItsBlocksOnTheHostAndResumesAsRecompute) {
  PreemptionTrace const recompute =
      preemptAndResume(device(), PreemptionKind::kRecompute, tokenRun(100, 1));
  PreemptionTrace const swap = preemptAndResume(device(), PreemptionKind::kSwap, tokenRun(100, 1));
  // Recompute keeps both published blocks cached on the GPU (only the partial page is freed);
  // swap moves both to the host and frees all three of the row's pages.
  EXPECT_EQ(recompute.freedPages, 1);
  EXPECT_EQ(recompute.onGpu, (std::vector<bool>{true, true}));
  EXPECT_EQ(recompute.onHost, (std::vector<bool>{false, false}));
  EXPECT_EQ(recompute.swappedOutBlocks, 0U);
  EXPECT_EQ(swap.freedPages, 3);
  EXPECT_EQ(swap.onGpu, (std::vector<bool>{false, false}));
  EXPECT_EQ(swap.onHost, (std::vector<bool>{true, true}));
  EXPECT_EQ(swap.swappedOutBlocks, 2U);
  // Both resume from the same 256 tokens, swap's onboarded from the host; the same tokens follow.
  EXPECT_EQ(recompute.resumedStart, 256);
  EXPECT_EQ(swap.resumedStart, 256);
  EXPECT_EQ(recompute.onboardedPages, 0U);
  EXPECT_EQ(swap.onboardedPages, 2U);
  EXPECT_EQ(swap.tokens, recompute.tokens);
}

TEST_P(ContextCacheRequestTest, ABlockARunningRowSharesStaysOnTheGpuWhenItsRowIsSwappedOut) {
  // Row 0 runs on row 1's first block (it published it first, so row 1's records name its page).
  std::vector<int32_t> const prompt = tokenRun(200, 1000);
  std::vector<int32_t> const sharing =
      concatenated(std::vector<int32_t>(prompt.begin(), prompt.begin() + 128), tokenRun(10, 5000));
  PreemptionTrace const swap = preemptAndResume(device(), PreemptionKind::kSwap, sharing);
  EXPECT_EQ(swap.onGpu, (std::vector<bool>{true, false}));
  EXPECT_EQ(swap.onHost, (std::vector<bool>{false, true}));
  EXPECT_EQ(swap.swappedOutBlocks, 1U);
  EXPECT_EQ(swap.freedPages, 3) << "row 1's own copy of block 0, block 1 and its partial page";
  EXPECT_EQ(swap.resumedStart, 256);
  EXPECT_EQ(swap.onboardedPages, 1U);
  PreemptionTrace const recompute = preemptAndResume(device(), PreemptionKind::kRecompute, sharing);
  EXPECT_EQ(recompute.freedPages, 2);
  EXPECT_EQ(swap.tokens, recompute.tokens);
}

TEST_P(ContextCacheRequestTest, ASwapPreemptionWithoutAHostTierThrowsAndChangesNothing) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  driver.add(tokenRun(100, 1), 0);
  driver.add(tokenRun(200, 1000), 1);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  for (int step = 0; step < 60; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  std::size_t const records = rig.records().size();
  EXPECT_TRUE(throwsError(
      [&] { (void)driver.cache->preemptSequence(1, PreemptionKind::kSwap); },
      {"ContextCacheCoordinator::preemptSequence",
       "row 1: swap preemption moves the row's blocks to the host tier", "resources.hostTier"}));
  EXPECT_EQ(rig.records().size(), records);
  EXPECT_EQ(rig.coordinator.counters().preemptions, 0u);
  ASSERT_TRUE(driver.cache->preemptSequence(1, PreemptionKind::kRecompute));
  EXPECT_EQ(rig.records().size(), records + 1);
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AFailedSwapOffloadPoisonsAndForgetsTheSwappedBlocks) {
  RigOptions options;
  options.hostTierPages = 8;
  CoordinatorRig rig(device(), options);
  RequestDriver driver(rig);
  driver.add(tokenRun(100, 1), 0);
  driver.add(tokenRun(200, 1000), 1);
  ASSERT_TRUE(driver.begin());
  ASSERT_TRUE(driver.prefill());
  for (int step = 0; step < 60; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  ASSERT_TRUE(driver.cache->preemptSequence(1, PreemptionKind::kSwap));
  rig.sync.failFromNow(FaultSite::kHostTierOffload);
  std::vector<int32_t> const mapping{0, -1};
  Tensor deviceMapping({2}, DataType::kInt32, device());
  ASSERT_TRUE(driver.cache->beginBatchCompaction(mapping, 1, deviceMapping));
  EXPECT_FALSE(driver.cache->completeBatchCompaction(mapping));
  EXPECT_TRUE(rig.coordinator.poisoned());
  EXPECT_EQ(rig.sync.failures(FaultSite::kHostTierOffload), 1);
  EXPECT_EQ(rig.manager().hostTier()->size(), 0) << "the failed offloads are forgotten";
  EXPECT_EQ(rig.coordinator.metrics().swappedOutBlocks, 2U);
  driver.compactView(mapping);
  EXPECT_FALSE(driver.cache->finish());
  rig.sync.disarm();
  EXPECT_EQ(rig.coordinator.shutdown(), ContextCacheStatus::kOk);
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, APreemptionOutsideItsPlaceThrowsAndChangesNothing) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  std::size_t const records = rig.records().size();
  EXPECT_TRUE(throwsError(
      [&] { (void)driver.cache->preemptSequence(1); },
      {"ContextCacheCoordinator::preemptSequence", "row 1 is an unfinalised in-flight admission"}));
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->preemptSequence(2); },
                          {"ContextCacheCoordinator::preemptSequence", "row 2 outside"}));
  ASSERT_TRUE(driver.cache->prepareDecodeStep(driver.context, kVanilla));
  EXPECT_TRUE(throwsError([&] { (void)driver.cache->preemptSequence(0); },
                          {"row 0: a sequence is preempted between steps"}));
  EXPECT_EQ(rig.records().size(), records);
  EXPECT_EQ(rig.coordinator.counters().preemptions, 0u);
  rig.executeDecode(driver.rows[0], 0);
  driver.context.generatedTokenIds[0].push_back(driver.rows[0].tokens.back());
  ASSERT_TRUE(driver.cache->completeDecodeStep(driver.context, {}));
  ASSERT_TRUE(driver.seat(1));
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, TheFounderRetiresWhileTheJoinerKeepsTheSharedPages) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted);
  ASSERT_TRUE(driver.seatNewest());
  std::vector<PageId> const joinerPages = rig.mirroredPages(1);
  EXPECT_EQ(rig.activeRefs(joinerPages[0]), 2);
  ASSERT_TRUE(driver.decode({{0, FinishReason::kLength}}));
  std::vector<int32_t> const mapping{-1, 0};
  Tensor deviceMapping({3}, DataType::kInt32, device());
  ASSERT_TRUE(driver.cache->beginBatchCompaction(mapping, 1, deviceMapping));
  ASSERT_TRUE(driver.cache->completeBatchCompaction(mapping));
  driver.compactView(mapping);
  EXPECT_EQ(driver.cache->prefillStarts(), std::vector<int32_t>{256});
  EXPECT_TRUE(rig.mirroredPages(0).empty());
  EXPECT_EQ(rig.mirroredPages(1), joinerPages);
  for (PageId page : {joinerPages[0], joinerPages[1]}) {
    EXPECT_EQ(rig.activeRefs(page), 1) << "page " << page;
    EXPECT_GE(rig.cacheRefs(page), 1) << "page " << page;
  }
  for (int step = 0; step < 2; ++step) {
    ASSERT_TRUE(driver.decode());
  }
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, JoinersInheritTheRequestPolicyNotTheFirstSurvivingRow) {
  CoordinatorRig rig(device());
  JoinFixture fixture(rig);
  RequestDriver& driver = fixture.driver;
  // A joiner whose image the host cannot read goes on bypass ...
  auto rgba = std::make_shared<Tensor>(Coords{2, 2, 4}, DataType::kUInt8, DeviceType::kCPU);
  std::memset(rgba->rawPointer(), 3, 16);
  std::vector<int32_t> const withImage =
      concatenated(fixture.system, concatenated(std::vector<int32_t>(8, kImageToken), {4}));
  int32_t start = -1;
  ASSERT_EQ(
      driver.admit(withImage, 1, &start, {kImageToken}, {imageUtils::ImageData{rgba, 2, 2, 4}}),
      AdmitStatus::kAdmitted);
  EXPECT_EQ(start, 0);
  ASSERT_TRUE(driver.seatNewest());
  // ... and becomes the first row once the founder retires.
  ASSERT_TRUE(driver.decode({{0, FinishReason::kLength}}));
  std::vector<int32_t> const mapping{-1, 0};
  Tensor deviceMapping({3}, DataType::kInt32, device());
  ASSERT_TRUE(driver.cache->beginBatchCompaction(mapping, 1, deviceMapping));
  ASSERT_TRUE(driver.cache->completeBatchCompaction(mapping));
  driver.compactView(mapping);
  // A plain text joiner still uses the cache: it inherits the request's policy.
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 0, &start), AdmitStatus::kAdmitted);
  EXPECT_EQ(start, 256);
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[1]).ok());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, AdmissionRefusedUnderPoolPressureLeavesTheRequestIntact) {
  RigOptions options;
  options.numPages = 8;
  CoordinatorRig rig(device(), options);
  JoinFixture fixture(rig);  // 3 pages, 2 of them published
  RequestDriver& driver = fixture.driver;
  Seq bystander(tokenRun(400, 50), 2);
  ContextCacheBatchAdmission batch = rig.batchOf({&bystander});
  batch.lookupPolicy = ContextCacheLookupPolicy::kBypass;
  auto held = rig.begin(batch);  // overlapping lease of 4 pages
  ASSERT_EQ(held.status, ContextCacheStatus::kOk);
  ASSERT_EQ(rig.freePages(), 1);
  std::vector<int32_t> const founderRow = rig.hostRow(0);
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kNoCapacity);
  EXPECT_EQ(driver.cache->prefillStarts(), std::vector<int32_t>{0});
  EXPECT_EQ(rig.coordinator.counters().liveAdmissionRefusals, 1u);
  EXPECT_EQ(rig.coordinator.metrics().missCount(MissReason::kCapacity), 1u);
  EXPECT_TRUE(rig.mirroredPages(1).empty());
  EXPECT_EQ(rig.hostRow(0), founderRow);
  EXPECT_EQ(rig.freePages(), 1);
  ASSERT_TRUE(driver.decode());
  EXPECT_TRUE(rig.verify(driver.rows[0]).ok());
  ASSERT_EQ(rig.coordinator.finish(held.admission->request), ContextCacheStatus::kOk);
  ASSERT_EQ(driver.admit(fixture.joinerPrompt(), 1), AdmitStatus::kAdmitted) << "retry later";
  ASSERT_TRUE(driver.seatNewest());
  ASSERT_TRUE(driver.decode());
  ASSERT_TRUE(driver.cache->finish());
  rig.expectQuiescent();
}

TEST_P(ContextCacheRequestTest, EarlyDestructionAbandonsAPendingRequest) {
  CoordinatorRig rig(device());
  {
    RequestDriver driver(rig);
    driver.add(tokenRun(300, 1), 0);
    ASSERT_TRUE(driver.begin());
    ASSERT_TRUE(driver.cache->preparePrefill());
  }  // dropped with work pending: synchronised, then released
  EXPECT_EQ(rig.sync.calls(), 1);
  EXPECT_FALSE(rig.coordinator.poisoned());
  rig.expectQuiescent();
  EXPECT_EQ(runOnce(rig, tokenRun(300, 1)), 0);
}

TEST_P(ContextCacheRequestTest, ASpeculativeRequestOnAVanillaDeploymentThrows) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig);
  driver.add(tokenRun(10, 1), 0);
  EXPECT_TRUE(throwsError(
      [&] {
        ContextCacheRequest::begin(rig.coordinator, driver.request, driver.context, true, kVanilla);
      },
      {"beginRequest", "speculative"}));
  EXPECT_EQ(rig.coordinator.activeRequestCount(), 0);
}

TEST_P(ContextCacheRequestTest, RequestsThatDisagreeWithTheirContextOrMediaThrowAndAdmitNothing) {
  CoordinatorRig rig(device());
  RequestDriver driver(rig, "adapter");
  driver.add(tokenRun(20, 1), 0);
  auto begin = [&](LLMGenerationRequest const& request, DecodingInferenceContext const& context,
                   std::vector<int32_t> const& mediaTokenIds = {}) {
    return [&, mediaTokenIds] {
      (void)ContextCacheRequest::begin(rig.coordinator, request, context, false, kVanilla,
                                       mediaTokenIds);
    };
  };
  DecodingInferenceContext wrongBatch = driver.context;
  wrongBatch.activeBatchSize = 2;
  EXPECT_TRUE(throwsError(begin(driver.request, wrongBatch),
                          {"ContextCacheRequest::begin", "activeBatchSize 2 but 1 prompts"}));
  DecodingInferenceContext noResidents = driver.context;
  noResidents.residentRefs.clear();
  EXPECT_TRUE(throwsError(begin(driver.request, noResidents), {"0 residents for 1 prompts"}));
  LLMGenerationRequest twoInputs = driver.request;
  twoInputs.requests.emplace_back();
  EXPECT_TRUE(
      throwsError(begin(twoInputs, driver.context), {"2 per-sequence inputs for 1 prompts"}));
  LLMGenerationRequest otherAdapter = driver.request;
  otherAdapter.loraWeightsName = "other";
  EXPECT_TRUE(throwsError(begin(otherAdapter, driver.context),
                          {"request LoRA 'other' differs from the context's 'adapter'"}));

  // Two image runs but one image; an audio run without a clip.
  constexpr int32_t kAudioToken = 32001;
  DecodingInferenceContext media = driver.context;
  media.rawBatchedInputIds[0] = imagePrompt({3, 3}, 20);
  LLMGenerationRequest oneImage = driver.request;
  oneImage.requests[0].imageBuffers = {hostImage(1)};
  EXPECT_TRUE(throwsError(begin(oneImage, media, {kImageToken}),
                          {"buildMediaPositions", "image run 2", "only 1 given"}));
  media.rawBatchedInputIds[0] = concatenated(tokenRun(4, 1), std::vector<int32_t>(3, kAudioToken));
  EXPECT_TRUE(throwsError(begin(oneImage, media, {kImageToken, kAudioToken}),
                          {"buildMediaPositions", "audio run 1", "only 0 given"}));
  // Called directly, an image the host cannot read is an error (begin checks first and bypasses).
  EXPECT_TRUE(throwsError(
      [&] {
        (void)buildMediaPositions(imagePrompt({3}, 20), {kImageToken},
                                  {imageUtils::ImageData{nullptr, 4, 4, 3}}, {});
      },
      {"buildMediaPositions", "image 0 is not host-readable"}));

  EXPECT_EQ(rig.coordinator.activeRequestCount(), 0);
  EXPECT_EQ(rig.coordinator.manager().liveLeaseCount(), 0);
  EXPECT_EQ(rig.coordinator.counters().requests, 0U);
}

INSTANTIATE_TEST_SUITE_P(Devices, ContextCacheRequestTest, allDeviceTypes(), deviceName);

}  // namespace
}  // namespace mkv::test
