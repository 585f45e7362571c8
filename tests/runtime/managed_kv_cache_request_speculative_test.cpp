// ManagedKVCacheRequest on speculative runtimes (docs/context_cache.md, "Speculative deployments
// from `KVCacheRuntime`", "Speculative paired reuse" and "Hybrid-MTP endpoints"): KVCacheRuntime
// builds the draft pool and draft page table from KVCacheRuntimeConfig::speculative, and an
// engine drives EAGLE-style paired reuse and Hybrid-MTP endpoints through the facade only. The
// base KV, the draft KV, the recurrent rows and the boundary hidden rows of every execution are
// written and verified by the oracles, so reuse passes only when it is byte-exact for the
// consumer's own prefix. Every test runs on host tensors and on GPU tensors (the kGPU instances
// skip without a CUDA device).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/kv_cache_runtime.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/kv_oracle.h"
#include "runtime_test_rig.h"
#include "support/test_util.h"

namespace mkv::runtime_test {
namespace {

constexpr auto kLookahead = DecodingTokenStateContract::kCommittedPlusLookahead;
constexpr auto kCommitAll = ContextCacheCommitPolicy::kIncludingGeneratedTokens;
constexpr auto kPrefillOnly = ContextCacheCommitPolicy::kPrefillStateOnly;
constexpr DecodingKvHeadroom kSpecHeadroom{4, 4};
constexpr int64_t kHiddenWidth = 8;
constexpr ResourceType kDraftPage = ResourceType::kDraftKvPage;

/// configFor(kContextReuse) plus an EAGLE draft {paged, 1}: 1 layer, 1 head of 4 fp16.
KVCacheRuntimeConfig eagleConfig(DeviceType device) {
  KVCacheRuntimeConfig config = configFor(Backend::kContextReuse, device);
  KVCacheSpeculativeConfig spec;
  spec.numDraftLayers = 1;
  spec.numDraftKVHeads = 1;
  spec.draftHeadDim = 4;
  config.speculative = spec;
  return config;
}

/// The EAGLE config on a hybrid model (2 recurrent layers of 24 + 8 bytes): Hybrid-MTP, with 4
/// snapshot slots of each kind.
KVCacheRuntimeConfig mtpConfig(DeviceType device) {
  KVCacheRuntimeConfig config = eagleConfig(device);
  config.model.numRecurrentLayers = 2;
  config.model.recurrentStateBytes = 24;
  config.model.recurrentConvBytes = 8;
  config.speculative->boundaryHiddenWidth = kHiddenWidth;
  // A recurrent slot: 2 x (24 + 8) bytes of rows and one fp16 boundary hidden row. A partial slot:
  // one page (16 tokens x 4 fp16, K and V) of each of the 2 base layers and the draft layer.
  config.contextCache.recurrentSnapshotPoolBytes = 4 * (int64_t{2} * (24 + 8) + kHiddenWidth * 2);
  config.contextCache.partialKvSnapshotPoolBytes = int64_t{4} * (2 + 1) * 2 * kPageTokens * 4 * 2;
  return config;
}

/// The draft's digests of a ledger: entry p covers the prefix [0, p + 1] (the draft row depends on
/// one future token, as EAGLE's and MTP's do), so there is one entry fewer than tokens. A reused
/// draft row is correct only if the consumer's token after it is the producer's too.
testing::PrefixDigests draftDigestsOf(std::vector<int32_t> const& tokens) {
  testing::PrefixDigests draft(0xd7af7);
  if (tokens.size() < 2) {
    return draft;
  }
  uint64_t const first = (static_cast<uint64_t>(static_cast<uint32_t>(tokens[0])) << 32) |
                         static_cast<uint32_t>(tokens[1]);
  draft.extend(std::span<uint64_t const>(&first, 1));
  draft.extendTokens(std::span<int32_t const>(tokens).subspan(2));
  return draft;
}

/// The base hidden row after the prefix `digest` ([kHiddenWidth] fp16).
std::vector<uint8_t> hiddenRow(uint64_t digest) {
  std::vector<uint8_t> row(static_cast<std::size_t>(kHiddenWidth) * 2);
  testing::KvOracle::expectedRow(digest, 7, 0, row);
  return row;
}

/// No lease anywhere, every draft page free or cached, every draft table row empty (the base side
/// is RuntimeRig::expectIdle's).
void expectDraftIdle(RuntimeRig& rig) {
  KVCacheRuntime& runtime = rig.runtime();
  ResourcePools const& pools = runtime.contextCache()->manager().pools();
  int32_t cached = 0;
  for (int32_t page = 0; page < pools.capacity(kDraftPage); ++page) {
    EXPECT_EQ(pools.activeRefs({kDraftPage, page}), 0) << "draft page " << page;
    cached += pools.cacheRefs({kDraftPage, page}) > 0 ? 1 : 0;
  }
  EXPECT_EQ(pools.freeCount(kDraftPage) + cached, pools.capacity(kDraftPage));
  for (CacheSlot slot = 0; slot < runtime.config().maxBatchSize; ++slot) {
    EXPECT_EQ(runtime.draftPageTable()->liveEntryCount(slot), 0) << "slot " << slot;
  }
}

/// One sequence driven through ManagedKVCacheRequest as a speculative engine drives it: the base
/// executes and verifies, the draft initialises after the lookahead is sampled and catches up after
/// each verification round, and (hybrid) the recurrent rows follow the base. Declare after the rig.
class SpecDriver {
 public:
  SpecDriver(RuntimeRig& rig, std::vector<int32_t> prompt, bool speculative)
      : mRig(rig), mSpeculative(speculative), mPromptLength(static_cast<int32_t>(prompt.size())) {
    KVCacheRuntime& runtime = rig.runtime();
    mBase.emplace(*runtime.fullPool(), *runtime.fullPageTable());
    if (runtime.draftPool() != nullptr) {
      mDraft.emplace(*runtime.draftPool(), *runtime.draftPageTable());
    }
    if (runtime.recurrentState() != nullptr) {
      mRecurrent.emplace(*runtime.recurrentState());
    }
    mResident = runtime.residentSlots().acquire().value();
    tokens = prompt;
    digests.extendTokens(prompt);
    context.activeBatchSize = 1;
    context.rawBatchedInputIds = {std::move(prompt)};
    context.generatedTokenIds = {{}};
    context.residentRefs = {mResident};
    context.finishReasons = {FinishReason::kNotFinished};
    context.stream = runtime.config().stream;
    request.requests.emplace_back();
  }
  ~SpecDriver() {
    managed.reset();
    (void)mRig.runtime().residentSlots().release(mResident);
  }
  SpecDriver(SpecDriver const&) = delete;
  SpecDriver& operator=(SpecDriver const&) = delete;

  /// The request pairs a paged draft (base and draft rows).
  bool paired() const { return mSpeculative && mDraft.has_value(); }
  DecodingKvHeadroom headroom() const { return paired() ? kSpecHeadroom : kVanilla; }

  bool begin(ContextCacheCommitPolicy policy = kCommitAll) {
    auto begun =
        ManagedKVCacheRequest::begin(mRig.runtime().contextCache(), nullptr, request, context,
                                     mSpeculative, headroom(), kLookahead, policy);
    if (!begun) {
      return false;
    }
    managed.emplace(std::move(*begun));
    start = managed->reuseTokenLength(0);
    context.effectivePrefillLengths = {mPromptLength - start};
    return true;
  }

  /// Appends the deterministic next token (a function of the prefix).
  void sample() {
    auto const token = static_cast<int32_t>(1000 + digests.at(digests.size() - 1) % 30000);
    tokens.push_back(token);
    context.generatedTokenIds[0].push_back(token);
    digests.extendTokens(std::span<int32_t const>(&token, 1));
  }
  /// The base executes [from, to): KV, the device KV length and (hybrid) the rows after `to`.
  void executeBase(int32_t from, int32_t to) {
    mBase->write(mResident.slot, digests, from, to);
    mRig.runtime().fullPool()->writeLengths(0, std::span<int32_t const>(&to, 1), context.stream);
    if (mRecurrent) {
      mRecurrent->write(mResident.slot, digests, to);
    }
    baseLength = to;
  }
  /// The draft executes [from, to); its row p needs token p + 1 in the ledger.
  void executeDraft(int32_t from, int32_t to) {
    mDraft->write(mResident.slot, draftDigestsOf(tokens), from, to);
    mRig.runtime().draftPool()->writeLengths(0, std::span<int32_t const>(&to, 1), context.stream);
    draftLength = to;
  }
  /// What attention and the draft read: base [0, base), draft [0, draft), recurrent rows at base.
  void verify(int32_t base, int32_t draft, char const* when) const {
    testing::OracleReport const report = mBase->verify(mResident.slot, digests, 0, base);
    EXPECT_TRUE(report.ok()) << when << ", base: " << report.firstMismatch;
    EXPECT_EQ(report.positionsChecked, base) << when;
    if (draft > 0) {
      testing::OracleReport const drafted =
          mDraft->verify(mResident.slot, draftDigestsOf(tokens), 0, draft);
      EXPECT_TRUE(drafted.ok()) << when << ", draft: " << drafted.firstMismatch;
      EXPECT_EQ(drafted.positionsChecked, draft) << when;
    }
    if (mRecurrent) {
      testing::OracleReport const rows = mRecurrent->verify(mResident.slot, digests, base);
      EXPECT_TRUE(rows.ok()) << when << ", recurrent: " << rows.firstMismatch;
    }
  }

  /// The EAGLE-style prefill: resume check, base prefill, lookahead, draft initialisation,
  /// completion with the common length (the prompt; none for a vanilla request).
  bool prefill() {
    if (!managed->preparePrefill() || !managed->enqueuePrefillCaptures()) {
      return false;
    }
    verify(start, paired() ? start : 0, "resumed");
    executeBase(start, mPromptLength);
    sample();
    if (paired()) {
      executeDraft(start, mPromptLength);
    }
    std::vector<int32_t> common;
    if (mSpeculative) {
      common.push_back(mPromptLength);
    }
    return managed->completePrefill(context, common);
  }
  /// One verification round accepting `accepted` tokens; the draft catches up to committed - lag.
  bool round(int32_t accepted, int32_t lag = 0) {
    if (!managed->prepareDecodeStep(context, headroom())) {
      return false;
    }
    verify(baseLength, paired() ? draftLength : 0, "before the round");
    int32_t const before = baseLength;
    for (int32_t k = 0; k < accepted; ++k) {
      sample();
    }
    executeBase(before, before + accepted);
    if (paired()) {
      executeDraft(draftLength, std::max(draftLength, baseLength - lag));
    }
    std::vector<int32_t> common;
    if (mSpeculative) {
      common.push_back(paired() ? draftLength : baseLength);
    }
    return managed->completeDecodeStep(context, common);
  }

  LLMGenerationRequest request;
  DecodingInferenceContext context;
  std::optional<ManagedKVCacheRequest> managed;
  std::vector<int32_t> tokens;  ///< the ledger: prompt, then every sampled token
  testing::PrefixDigests digests;
  int32_t start = 0;
  int32_t baseLength = 0;
  int32_t draftLength = 0;

 private:
  RuntimeRig& mRig;
  bool mSpeculative;
  int32_t mPromptLength;
  ResidentRef mResident;
  std::optional<testing::KvOracle> mBase;
  std::optional<testing::KvOracle> mDraft;
  std::optional<testing::RecurrentOracle> mRecurrent;
};

std::vector<CacheRecord> records(RuntimeRig& rig) {
  auto const& lru = rig.runtime().contextCache()->manager().records().lruToMru();
  return {lru.begin(), lru.end()};
}

class SpeculativeFacadeTest : public test::DeviceTest {};
class HybridMtpFacadeTest : public test::DeviceTest {};

// ------------------------------------------------------------------------------- EAGLE

TEST_P(SpeculativeFacadeTest, PairedReuseWithAFullPageReplayAndBaseOnlyVanillaReuse) {
  RuntimeRig rig(eagleConfig(device()));
  KVCacheRuntime& runtime = rig.runtime();
  ASSERT_NE(runtime.draftPool(), nullptr);
  EXPECT_TRUE(runtime.supportsSeatedAdmission());
  std::vector<int32_t> const shared = tokenRun(40, 1);
  {
    SpecDriver producer(rig, shared, true);
    ASSERT_TRUE(producer.begin());
    ASSERT_TRUE(producer.prefill());
    EXPECT_TRUE(records(rig).empty()) << "the draft initialisation may still run: nothing yet";
    ASSERT_TRUE(producer.round(3));
    ASSERT_EQ(records(rig).size(), 1u) << "the frozen prompt endpoint, after the first round";
    EXPECT_EQ(records(rig).front().basePagePath.size(), 2u);
    ASSERT_TRUE(records(rig).front().specState.has_value());
    EXPECT_EQ(records(rig).front().specState->draftPagePath.size(), 2u);
    EXPECT_EQ(runtime.contextCache()->counters().specPairPublications, 1u);
    ASSERT_TRUE(producer.managed->finish());
  }
  rig.expectIdle();
  expectDraftIdle(rig);

  // The producer's two blocks, then another token: both paired blocks match, but the draft row 31
  // depends on token 32, which differs, so the path's last page is replayed (the draft oracle
  // would catch a reused row 31).
  {
    SpecDriver consumer(rig, concatenated(tokenRun(32, 1), tokenRun(38, 7000)), true);
    ASSERT_TRUE(consumer.begin());
    EXPECT_EQ(consumer.start, kPageTokens);
    EXPECT_EQ(runtime.contextCache()->manager().metrics().specFullPageReplays, 1u);
    ASSERT_TRUE(consumer.prefill());  // verifies base and draft [0, 16) first
    EXPECT_EQ(test::readAs<int32_t>(runtime.draftPool()->kvLengths()).at(0), 70);
    ASSERT_TRUE(consumer.round(2, 1));
    consumer.verify(consumer.baseLength, consumer.draftLength, "after the round");
    ASSERT_TRUE(consumer.managed->finish());
  }
  rig.expectIdle();
  expectDraftIdle(rig);

  // A vanilla request reuses the base side only (no replay: base KV needs no successor) and never
  // touches a draft page or row.
  int32_t const freeDraft = runtime.contextCache()->manager().pools().freeCount(kDraftPage);
  std::vector<int32_t> const draftTable =
      test::readAs<int32_t>(runtime.draftPageTable()->deviceTable());
  {
    SpecDriver vanilla(rig, concatenated(shared, tokenRun(5, 9000)), false);
    ASSERT_TRUE(vanilla.begin());
    EXPECT_EQ(vanilla.start, 2 * kPageTokens);
    ASSERT_TRUE(vanilla.prefill());
    ASSERT_TRUE(vanilla.round(1));
    ASSERT_TRUE(vanilla.round(1));
    vanilla.verify(vanilla.baseLength, 0, "vanilla");
    ASSERT_TRUE(vanilla.managed->finish());
  }
  EXPECT_EQ(runtime.contextCache()->manager().pools().freeCount(kDraftPage), freeDraft);
  EXPECT_EQ(test::readAs<int32_t>(runtime.draftPageTable()->deviceTable()), draftTable);
  rig.expectIdle();
  expectDraftIdle(rig);
}

TEST_P(SpeculativeFacadeTest, AnAbandonedSpeculativeRequestPublishesNothing) {
  RuntimeRig rig(eagleConfig(device()));
  {
    SpecDriver abandoned(rig, tokenRun(50, 3), true);
    ASSERT_TRUE(abandoned.begin());
    ASSERT_TRUE(abandoned.prefill());
    int64_t const syncs = rig.faults().calls();
    abandoned.managed.reset();  // the engine drops the request before the first round
    EXPECT_EQ(rig.faults().calls(), syncs + 1) << "the draft initialisation is waited for";
  }
  EXPECT_TRUE(records(rig).empty());
  rig.expectIdle();
  expectDraftIdle(rig);
  SpecDriver later(rig, tokenRun(50, 3), true);
  ASSERT_TRUE(later.begin());
  EXPECT_EQ(later.start, 0) << "nothing of the abandoned request is reused";
  ASSERT_TRUE(later.managed->finish());
}

TEST_P(SpeculativeFacadeTest, WithoutARoundThePromptEndpointIsPublishedOnceFinishSynchronised) {
  RuntimeRig rig(eagleConfig(device()));
  {
    SpecDriver producer(rig, tokenRun(48, 11), true);
    ASSERT_TRUE(producer.begin());
    ASSERT_TRUE(producer.prefill());
    EXPECT_TRUE(records(rig).empty());
    int64_t const syncs = rig.faults().calls();
    ASSERT_TRUE(producer.managed->finish());
    EXPECT_EQ(rig.faults().calls(), syncs + 1);
    ASSERT_EQ(records(rig).size(), 1u) << "after the synchronisation of finish";
    ASSERT_TRUE(records(rig).front().specState.has_value());
    EXPECT_EQ(records(rig).front().specState->draftPagePath.size(), 3u);
  }
  // A consumer diverging at token 48: three paired blocks match, the last page is replayed, and
  // the oracles check the reused base and draft rows [0, 32) before its prefill.
  SpecDriver consumer(rig, concatenated(tokenRun(48, 11), tokenRun(9, 4000)), true);
  ASSERT_TRUE(consumer.begin());
  EXPECT_EQ(consumer.start, 2 * kPageTokens);
  ASSERT_TRUE(consumer.prefill());
  ASSERT_TRUE(consumer.round(4, 2));
  consumer.verify(consumer.baseLength, consumer.draftLength, "after the round");
  ASSERT_TRUE(consumer.managed->finish());
}

// docs/context_cache.md, "Publication points": a row cancelled before the first verification
// round is held by that round and its frozen prompt endpoint is never published, as a cancelled
// row publishes nothing; the other row's is. Two 45-token prompts, completePrefill(ctx, {45, 45}),
// row 1 cancelled before the first prepareDecodeStep / completeDecodeStep, then finish.
TEST_P(SpeculativeFacadeTest, ARowCancelledBeforeTheFirstRoundPublishesNoPromptEndpoint) {
  RuntimeRig rig(eagleConfig(device()));
  KVCacheRuntime& runtime = rig.runtime();
  std::vector<std::vector<int32_t>> const prompts{tokenRun(45, 21), tokenRun(45, 900)};
  auto contextOf = [&](std::vector<ResidentRef> const& residents) {
    DecodingInferenceContext context;
    context.stream = runtime.config().stream;
    context.activeBatchSize = 2;
    context.rawBatchedInputIds = prompts;
    context.generatedTokenIds.assign(2, {});
    context.residentRefs = residents;
    context.finishReasons.assign(2, FinishReason::kNotFinished);
    return context;
  };
  LLMGenerationRequest request;
  request.requests.resize(2);
  std::vector<ResidentRef> const residents{runtime.residentSlots().acquire().value(),
                                           runtime.residentSlots().acquire().value()};
  {
    DecodingInferenceContext context = contextOf(residents);
    std::optional<ManagedKVCacheRequest> managed =
        ManagedKVCacheRequest::begin(runtime.contextCache(), nullptr, request, context, true,
                                     kSpecHeadroom, kLookahead, kCommitAll);
    ASSERT_TRUE(managed.has_value());
    ASSERT_TRUE(managed->preparePrefill());
    ASSERT_TRUE(managed->enqueuePrefillCaptures());
    context.generatedTokenIds = {{7001}, {7002}};
    ASSERT_TRUE(managed->completePrefill(context, {45, 45}));
    context.finishReasons[1] = FinishReason::kCancelled;
    ASSERT_TRUE(managed->prepareDecodeStep(context, kSpecHeadroom));
    context.generatedTokenIds[0].push_back(7003);
    ASSERT_TRUE(managed->completeDecodeStep(context, {45, 45}));
    ASSERT_TRUE(managed->finish());
  }
  ASSERT_EQ(records(rig).size(), 1u) << "row 0's prompt endpoint only";
  DecodingInferenceContext later = contextOf(residents);
  std::optional<ManagedKVCacheRequest> consumer = ManagedKVCacheRequest::begin(
      runtime.contextCache(), nullptr, request, later, true, kSpecHeadroom, kLookahead, kCommitAll);
  ASSERT_TRUE(consumer.has_value());
  EXPECT_GT((*consumer->prefillStarts())[0], 0) << "row 0's prompt is reused";
  EXPECT_EQ((*consumer->prefillStarts())[1], 0) << "the cancelled row's prompt is not";
  ASSERT_TRUE(consumer->finish());
  consumer.reset();
  for (ResidentRef const& resident : residents) {
    ASSERT_TRUE(runtime.residentSlots().release(resident));
  }
}

// A backend's contract error reaches the engine as data: call() is the facade call it made, and
// detail() names no internal call (the coordinator validated it: "ContextCacheCoordinator::...").
TEST_P(SpeculativeFacadeTest, AContractErrorCarriesTheFacadeCallAsItsCall) {
  RuntimeRig plain(configFor(Backend::kContextReuse, device()));
  SpecDriver onPlain(plain, tokenRun(20, 1), true);
  try {
    (void)onPlain.begin();
    FAIL() << "a speculative begin on a plain runtime did not throw";
  } catch (Error const& error) {
    EXPECT_EQ(error.call(), "ManagedKVCacheRequest::begin");
    EXPECT_NE(error.detail().find("speculative request on a non-speculative"), std::string::npos)
        << error.detail();
    EXPECT_EQ(error.detail().find("ContextCacheCoordinator"), std::string::npos) << error.detail();
    EXPECT_EQ(std::string(error.what()), error.call() + ": " + error.detail());
  }
}

TEST_P(SpeculativeFacadeTest, SpeculativeRequestsNeedASpeculativeReuseRuntime) {
  RuntimeRig plain(configFor(Backend::kContextReuse, device()));
  ASSERT_EQ(plain.runtime().draftPool(), nullptr);
  SpecDriver onPlain(plain, tokenRun(20, 1), true);
  BackendState const before = plain.observe();
  EXPECT_TRUE(test::throwsError(
      [&] { (void)onPlain.begin(); },
      {"ManagedKVCacheRequest::begin", "speculative request on a non-speculative"}));
  plain.expectUnchanged(before);

  RuntimeRig swa(configFor(Backend::kBoundedSwa, device()));
  SpecDriver driver(swa, tokenRun(20, 1), true);
  BackendState const swaBefore = swa.observe();
  EXPECT_TRUE(test::throwsError(
      [&] {
        (void)ManagedKVCacheRequest::begin(nullptr, swa.runtime().swaPageManager(), driver.request,
                                           driver.context, true, kVanilla, kLookahead, kCommitAll);
      },
      {"ManagedKVCacheRequest::begin", "does not decode speculatively"}));
  swa.expectUnchanged(swaBefore);
}

// finish publishes a frozen prompt endpoint best effort: a publication that throws (a failure
// injected at FaultSite::kPublication) is logged and finish goes on, releasing every row and page,
// and reports success (the request ended).
TEST_P(SpeculativeFacadeTest, APublicationThatThrowsInFinishIsLoggedAndTheRequestStillEnds) {
  RuntimeRig rig(eagleConfig(device()));
  {
    SpecDriver producer(rig, tokenRun(48, 11), true);
    ASSERT_TRUE(producer.begin());
    ASSERT_TRUE(producer.prefill());
    int64_t const before = rig.faults().calls(FaultSite::kPublication);
    rig.faults().failCall(before + 1, /*fromThenOn=*/true, FaultSite::kPublication);
    EXPECT_TRUE(producer.managed->finish());
    rig.faults().disarm();
    EXPECT_EQ(rig.faults().calls(FaultSite::kPublication) - before, 1);
    EXPECT_EQ(rig.faults().failures(FaultSite::kPublication), 1);
    EXPECT_FALSE(rig.poisoned());
    EXPECT_TRUE(records(rig).empty()) << "the failed publication left nothing behind";
  }
  rig.expectIdle();
  expectDraftIdle(rig);
  SpecDriver later(rig, tokenRun(48, 11), true);
  ASSERT_TRUE(later.begin());
  EXPECT_EQ(later.start, 0);
  ASSERT_TRUE(later.prefill());
  ASSERT_TRUE(later.managed->finish());
  EXPECT_EQ(records(rig).size(), 1u) << "the backend publishes again";
}

INSTANTIATE_TEST_SUITE_P(Devices, SpeculativeFacadeTest, test::allDeviceTypes(), test::deviceName);

// ------------------------------------------------------------------------------- Hybrid-MTP

/// The Hybrid-MTP prefill of a driver: base prefill from the reuse length, the draft from the
/// boundary row (reuse - 1) to the row before the lookahead, and the endpoint at the prompt end
/// with the base hidden row of the prompt's last token.
bool mtpPrefill(SpecDriver& driver, int32_t promptLength, DeviceType device) {
  int32_t const reuse = driver.start;
  driver.executeBase(reuse, promptLength);
  driver.executeDraft(std::max(0, reuse - 1), promptLength - 1);
  Tensor hidden({promptLength - reuse, kHiddenWidth}, DataType::kFloat16, device);
  std::vector<uint8_t> bytes;
  for (int32_t p = reuse; p < promptLength; ++p) {
    std::vector<uint8_t> const row = hiddenRow(driver.digests.at(p));
    bytes.insert(bytes.end(), row.begin(), row.end());
  }
  test::writeBytes(hidden, bytes);
  if (!driver.managed->publishHybridMtpEndpoint(0, promptLength, hidden,
                                                promptLength - 1 - reuse)) {
    return false;
  }
  driver.sample();
  return driver.managed->completePrefill(driver.context, {});
}

TEST_P(HybridMtpFacadeTest, EndpointThenByteExactBoundaryHiddenRestoreIntoAGivenRow) {
  RuntimeRig rig(mtpConfig(device()));
  KVCacheRuntime& runtime = rig.runtime();
  ASSERT_EQ(runtime.contextCache()->profile().baseStateKind, BaseStateKind::kHybrid);
  ASSERT_TRUE(runtime.contextCache()->profile().isHybridMtp());
  std::vector<int32_t> const shared = tokenRun(40, 100);
  {
    SpecDriver producer(rig, shared, true);
    ASSERT_TRUE(producer.begin(kPrefillOnly));
    ASSERT_TRUE(producer.managed->preparePrefill());
    ASSERT_TRUE(mtpPrefill(producer, 40, device()));
    EXPECT_EQ(runtime.contextCache()->counters().hybridMtpPublications, 1u);
    ASSERT_TRUE(producer.managed->finish());
  }
  ASSERT_EQ(records(rig).size(), 1u);

  {
    SpecDriver consumer(rig, concatenated(shared, tokenRun(20, 5000)), true);
    ASSERT_TRUE(consumer.begin(kPrefillOnly));
    EXPECT_EQ(consumer.start, 40) << "the exact endpoint, mid-page";
    ASSERT_TRUE(consumer.managed->preparePrefill());
    EXPECT_EQ(test::readAs<int32_t>(runtime.fullPool()->kvLengths()).at(0), 40);
    EXPECT_EQ(test::readAs<int32_t>(runtime.draftPool()->kvLengths()).at(0), 39)
        << "the boundary token's draft row is recomputed";
    consumer.verify(40, 39, "restored");  // base KV, draft KV and the recurrent rows

    // The boundary hidden row into row 2 of a poisoned [3, width] tensor; the other rows untouched.
    Tensor restored({3, kHiddenWidth}, DataType::kFloat16, device());
    std::size_t const rowBytes = static_cast<std::size_t>(kHiddenWidth) * 2;
    std::vector<uint8_t> expected(3 * rowBytes, 0xa5);
    test::writeBytes(restored, expected);
    ASSERT_TRUE(consumer.managed->restoreHybridMtpBoundaryHidden(0, restored, 2));
    std::vector<uint8_t> const boundary = hiddenRow(consumer.digests.at(39));
    std::copy(boundary.begin(), boundary.end(),
              expected.begin() + 2 * static_cast<std::ptrdiff_t>(rowBytes));
    EXPECT_EQ(test::readBytes(restored), expected);
    EXPECT_EQ(runtime.contextCache()->counters().boundaryHiddenRestores, 1u);

    ASSERT_TRUE(mtpPrefill(consumer, 60, device()));
    consumer.verify(60, 59, "after the prefill");
    ASSERT_TRUE(consumer.managed->finish());
    EXPECT_EQ(records(rig).size(), 2u) << "the consumer's own endpoint at 60";
  }
  rig.expectIdle();
  expectDraftIdle(rig);
}

// With engine-step writes, an endpoint copies pages through rows that must have reached the
// device: before the engine's flush it is refused, naming the call, and nothing changes.
TEST_P(HybridMtpFacadeTest, AnEndpointBeforeItsRowsReachedTheDeviceIsRefused) {
  KVCacheRuntimeConfig config = mtpConfig(device());
  config.deviceWrites = DeviceWriteTiming::kEngineStep;
  RuntimeRig rig(config);
  {
    SpecDriver producer(rig, tokenRun(40, 100), true);
    ASSERT_TRUE(producer.begin(kPrefillOnly));
    ASSERT_TRUE(producer.managed->preparePrefill());
    ASSERT_TRUE(rig.runtime().deviceWritesPending());
    // (The step's kernels would have read the stale rows: the endpoint would copy other pages.)
    Tensor hidden({40, kHiddenWidth}, DataType::kFloat16, device());
    BackendState const before = rig.observe();
    EXPECT_TRUE(test::throwsError(
        [&] { (void)producer.managed->publishHybridMtpEndpoint(0, 40, hidden, 39); },
        {"publishHybridMtpEndpoint", "never reached the device", "flushDeviceWrites"}));
    rig.expectUnchanged(before);
    EXPECT_TRUE(records(rig).empty());
    rig.runtime().flushDeviceWrites();
    producer.executeBase(0, 40);
    producer.executeDraft(0, 39);
    ASSERT_TRUE(producer.managed->publishHybridMtpEndpoint(0, 40, hidden, 39));
    EXPECT_EQ(records(rig).size(), 1u);
    producer.sample();
    ASSERT_TRUE(producer.managed->completePrefill(producer.context, {}));
    ASSERT_TRUE(producer.managed->finish());
  }
  rig.runtime().flushDeviceWrites();
  rig.expectIdle();
}

TEST_P(HybridMtpFacadeTest, MisuseThrowsAndAFailedEndpointSyncReturnsFalse) {
  RuntimeRig rig(mtpConfig(device()));
  {  // Hybrid-MTP requests take several sequences (each publishes its own endpoint; the
     // replay tests drive them through whole lifecycles) and commit the prefill state only.
    SpecDriver a(rig, tokenRun(30, 1), true);
    SpecDriver b(rig, tokenRun(30, 500), true);
    a.context.activeBatchSize = 2;
    a.context.rawBatchedInputIds.push_back(b.context.rawBatchedInputIds[0]);
    a.context.generatedTokenIds.emplace_back();
    a.context.residentRefs.push_back(b.context.residentRefs[0]);
    a.context.finishReasons.push_back(FinishReason::kNotFinished);
    a.request.requests.emplace_back();
    ASSERT_TRUE(a.begin(kPrefillOnly));
    ASSERT_NE(a.managed->prefillStarts(), nullptr);
    EXPECT_EQ(*a.managed->prefillStarts(), (std::vector<int32_t>{0, 0}));
    ASSERT_TRUE(a.managed->finish());
  }
  SpecDriver wrongPolicy(rig, tokenRun(30, 1), true);
  BackendState const before = rig.observe();
  EXPECT_TRUE(test::throwsError([&] { (void)wrongPolicy.begin(kCommitAll); },
                                {"needs commit policy kPrefillStateOnly"}));
  rig.expectUnchanged(before);

  // A request that restored nothing has no boundary row; a vanilla one publishes no endpoint.
  SpecDriver cold(rig, tokenRun(30, 1), true);
  ASSERT_TRUE(cold.begin(kPrefillOnly));
  ASSERT_TRUE(cold.managed->preparePrefill());
  Tensor hidden({30, kHiddenWidth}, DataType::kFloat16, device());
  EXPECT_TRUE(
      test::throwsError([&] { (void)cold.managed->restoreHybridMtpBoundaryHidden(0, hidden, 0); },
                        {"restoreHybridMtpBoundaryHidden", "restored no Hybrid-MTP checkpoint"}));
  // The endpoint's capture synchronisation fails: false, the request quarantined, nothing kept.
  cold.executeBase(0, 30);
  cold.executeDraft(0, 29);
  rig.faults().failNext();
  EXPECT_FALSE(cold.managed->publishHybridMtpEndpoint(0, 30, hidden, 29));
  EXPECT_TRUE(rig.poisoned());
  EXPECT_EQ(rig.runtime().contextCache()->quarantinedRequestCount(), 1);
  EXPECT_FALSE(cold.managed->finish()) << "the coordinator is poisoned";
  EXPECT_TRUE(records(rig).empty());
  EXPECT_TRUE(rig.runtime().shutdown()) << "drains the quarantine and clears the poison";

  SpecDriver vanilla(rig, tokenRun(30, 1), false);
  ASSERT_TRUE(vanilla.begin());
  ASSERT_TRUE(vanilla.managed->preparePrefill());
  EXPECT_TRUE(
      test::throwsError([&] { (void)vanilla.managed->publishHybridMtpEndpoint(0, 30, hidden, 29); },
                        {"publishHybridMtpEndpoint", "is not speculative"}));
  ASSERT_TRUE(vanilla.managed->finish());
}

// The endpoint reserves its snapshot slots before it touches the hit's pins, and a capture that
// throws (a failed launch, injected at FaultSite::kSnapshotCapture) retires the reservation: the
// request is left as it was, its boundary hidden row can still be restored, and a retry publishes.
TEST_P(HybridMtpFacadeTest, ACaptureThatThrowsLeavesTheRequestAndItsPinsAsTheyWere) {
  RuntimeRig rig(mtpConfig(device()));
  ContextCacheCoordinator& coordinator = *rig.runtime().contextCache();
  std::vector<int32_t> const shared = tokenRun(40, 100);
  {
    SpecDriver producer(rig, shared, true);
    ASSERT_TRUE(producer.begin(kPrefillOnly));
    ASSERT_TRUE(producer.managed->preparePrefill());
    ASSERT_TRUE(mtpPrefill(producer, 40, device()));
    ASSERT_TRUE(producer.managed->finish());
  }
  SpecDriver consumer(rig, concatenated(shared, tokenRun(20, 5000)), true);
  ASSERT_TRUE(consumer.begin(kPrefillOnly));
  ASSERT_EQ(consumer.start, 40);
  ASSERT_TRUE(consumer.managed->preparePrefill());
  consumer.executeBase(40, 60);
  consumer.executeDraft(39, 59);
  Tensor hidden({20, kHiddenWidth}, DataType::kFloat16, device());
  for (int failing : {1, 2, 3}) {  // each of the three captures in turn
    FaultArming& faults = rig.faults();
    int64_t const failures = faults.failures(FaultSite::kSnapshotCapture);
    faults.failCall(faults.calls(FaultSite::kSnapshotCapture) + failing, /*fromThenOn=*/false,
                    FaultSite::kSnapshotCapture);
    BackendState const before = rig.observe();
    EXPECT_TRUE(test::throwsError(
        [&] { (void)consumer.managed->publishHybridMtpEndpoint(0, 60, hidden, 19); },
        {"ManagedKVCacheRequest::publishHybridMtpEndpoint", "snapshot capture",
         "cudaErrorUnknown"}))
        << "capture " << failing;
    EXPECT_EQ(faults.failures(FaultSite::kSnapshotCapture), failures + 1) << "capture " << failing;
    rig.expectUnchanged(before);
  }
  rig.faults().disarm();
  EXPECT_EQ(coordinator.counters().hybridMtpPublications, 1u) << "the producer's only";
  Tensor restored({1, kHiddenWidth}, DataType::kFloat16, device());
  ASSERT_TRUE(consumer.managed->restoreHybridMtpBoundaryHidden(0, restored, 0))
      << "the hit's pins are still held";
  EXPECT_EQ(test::readBytes(restored), hiddenRow(consumer.digests.at(39)));
  ASSERT_TRUE(consumer.managed->publishHybridMtpEndpoint(0, 60, hidden, 19));
  EXPECT_EQ(coordinator.counters().hybridMtpPublications, 2u);
  consumer.sample();
  ASSERT_TRUE(consumer.managed->completePrefill(consumer.context, {}));
  ASSERT_TRUE(consumer.managed->finish());
  consumer.managed.reset();
  EXPECT_EQ(records(rig).size(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Devices, HybridMtpFacadeTest, test::allDeviceTypes(), test::deviceName);

}  // namespace
}  // namespace mkv::runtime_test
