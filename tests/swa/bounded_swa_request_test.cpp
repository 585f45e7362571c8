// BoundedSwaRequest: the bounded-SWA request adapter on a KVCacheRuntime of the bounded-SWA
// backend. Its lifecycle with the KV oracle reading every window; its refusals (mkv::Error naming
// the call and the value, the runtime's whole backend state unchanged); the calls the backend
// does not offer; a failed synchronisation poisoning the manager until shutdown.

#include "mkv/bounded_swa_request.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "mkv/kv_cache_runtime.h"
#include "mkv/tensor.h"
#include "mkv/testing/kv_oracle.h"
#include "support/backend_snapshot.h"
#include "support/fault_arming.h"
#include "support/token_runs.h"
#include "swa/swa_test_rig.h"

namespace mkv::swa_test {
namespace {

constexpr int32_t kPageTokens = 16;
constexpr int32_t kWindowTokens = 24;  // M = ceil(24 / 16) + 1 = 3 pages
constexpr DecodingKvHeadroom kVanilla{1, 0};

/// A KVCacheRuntime on the bounded-SWA backend (1 full and 1 sliding layer, 4 resident rows,
/// 4 x (2M + 1) = 28 SWA pages, rows of 16 pages) synchronising through FaultArming, the KV oracle
/// over its SWA pool, and the engine's view of one request: context, residents, sequences.
/// Declare the request after the rig, so that it is destroyed first.
class AdapterRig {
 public:
  explicit AdapterRig(DeviceType device) {
    KVCacheRuntimeConfig config;
    config.model.numKVHeads = 1;
    config.model.headDim = 4;
    config.model.kvDataType = DataType::kFloat16;
    config.model.numFullAttentionLayers = 1;
    config.model.numSlidingWindowLayers = 1;
    config.model.slidingWindowTokens = kWindowTokens;
    config.maxBatchSize = 4;
    config.maxSequenceLength = 256;
    config.tokensPerPage = kPageTokens;
    config.deviceType = device;
    config.faults = mFaults.injector();
    mRuntime = KVCacheRuntime::create(config);
    mOracle = std::make_unique<testing::KvOracle>(*mRuntime->swaPool(), *mRuntime->swaPageTable());
    mapping = Tensor({config.maxBatchSize}, DataType::kInt32, device);
  }
  /// Drains what a failed test left quarantined (the manager's destructor would terminate).
  ~AdapterRig() {
    mFaults.disarm();
    if (manager().activeRequestCount() == 0) {
      (void)mRuntime->shutdown();
    }
  }
  AdapterRig(AdapterRig const&) = delete;
  AdapterRig& operator=(AdapterRig const&) = delete;

  KVCacheRuntime& runtime() { return *mRuntime; }
  BoundedSwaKVPageManager& manager() { return *mRuntime->swaPageManager(); }
  FaultArming& faults() { return mFaults; }

  /// A context of one row per prompt length, each on a fresh resident, no token sampled yet.
  DecodingInferenceContext context(std::vector<int32_t> const& promptLengths) {
    DecodingInferenceContext context;
    context.activeBatchSize = static_cast<int32_t>(promptLengths.size());
    for (int32_t length : promptLengths) {
      std::optional<ResidentRef> resident = mRuntime->residentSlots().acquire();
      EXPECT_TRUE(resident.has_value());
      context.residentRefs.push_back(resident.value_or(ResidentRef{}));
      context.rawBatchedInputIds.push_back(test::tokenRun(length, 100 * length));
      context.generatedTokenIds.emplace_back();
      context.finishReasons.push_back(FinishReason::kNotFinished);
    }
    return context;
  }

  /// Everything a rejected call must leave as it was: the runtime's backend state, the
  /// synchronisations made and, for a live request, what the manager reports about it.
  test::BackendSnapshot snapshot(BoundedSwaRequest const* request = nullptr) {
    test::BackendSnapshot s = test::captureBackend(*mRuntime);
    s.synchronizations = mFaults.calls();
    if (request != nullptr) {
      test::appendRequestView(manager(), request->handle(), s.requests);
    }
    return s;
  }

  testing::KvOracle& oracle() { return *mOracle; }
  Tensor mapping;

 private:
  FaultArming mFaults;
  std::unique_ptr<KVCacheRuntime> mRuntime;
  std::unique_ptr<testing::KvOracle> mOracle;
};

std::optional<BoundedSwaRequest> beginVanilla(AdapterRig& rig,
                                              DecodingInferenceContext const& context) {
  return BoundedSwaRequest::begin(rig.manager(), LLMGenerationRequest{}, context, false, kVanilla);
}

/// Prepares and completes the prefill of every row at its full prompt length, one lookahead
/// token sampled per row (no KV written: the refusal tests read no bytes).
void prefill(BoundedSwaRequest& request, DecodingInferenceContext& context) {
  std::vector<int32_t> lengths;
  for (auto const& prompt : context.rawBatchedInputIds) {
    lengths.push_back(static_cast<int32_t>(prompt.size()));
  }
  ASSERT_TRUE(request.prepareSwaPrefill(lengths));
  for (auto& generated : context.generatedTokenIds) {
    generated = {7};
  }
  ASSERT_TRUE(request.completePrefill(context, {}));
}

/// Drops row `row` from the engine's view of the batch (a completed compaction).
void dropRow(DecodingInferenceContext& context, std::size_t row) {
  auto const at = static_cast<std::ptrdiff_t>(row);
  context.rawBatchedInputIds.erase(context.rawBatchedInputIds.begin() + at);
  context.generatedTokenIds.erase(context.generatedTokenIds.begin() + at);
  context.residentRefs.erase(context.residentRefs.begin() + at);
  context.finishReasons.erase(context.finishReasons.begin() + at);
  --context.activeBatchSize;
}

class BoundedSwaRequestLifecycleTest : public DeviceTest {};

TEST_P(BoundedSwaRequestLifecycleTest,
       EveryWindowReadsBackThroughPrefillDecodeCompactionAndFinish) {
  AdapterRig rig(GetParam());
  DecodingInferenceContext context = rig.context({40, 20});
  std::optional<BoundedSwaRequest> request = beginVanilla(rig, context);
  ASSERT_TRUE(request.has_value());
  EXPECT_EQ(request->prefillStarts(), nullptr);
  int32_t const decodePages = rig.manager().decodePagesPerSequence();

  std::vector<EngineSequence> rows;
  for (std::size_t i = 0; i < context.residentRefs.size(); ++i) {
    rows.emplace_back(context.residentRefs[i].slot, 1000 + i);
  }
  EXPECT_TRUE(request->preparePrefill());
  ASSERT_TRUE(request->prepareSwaPrefill({40, 20}));
  EXPECT_TRUE(request->enqueuePrefillCaptures());
  rows[0].prefill(rig.oracle(), 40, kWindowTokens);
  rows[1].prefill(rig.oracle(), 20, kWindowTokens);
  for (auto& generated : context.generatedTokenIds) {
    generated = {7};
  }
  ASSERT_TRUE(request->completePrefill(context, {}));

  // 30 steps: row 0 runs from 40 to 70 tokens, across two page boundaries and retirements.
  for (int32_t step = 0; step < 30; ++step) {
    ASSERT_TRUE(request->prepareDecodeStep(context, kVanilla)) << "step " << step;
    for (std::size_t i = 0; i < rows.size(); ++i) {
      rows[i].decode(rig.oracle());
      context.generatedTokenIds[i].push_back(step);
    }
    ASSERT_TRUE(request->completeDecodeStep(context, {}));
    for (std::size_t i = 0; i < rows.size(); ++i) {
      testing::OracleReport const report = rows[i].verifyWindow(rig.oracle(), kWindowTokens);
      ASSERT_TRUE(report.ok()) << "step " << step << ", row " << i << ": " << report.firstMismatch;
      EXPECT_LE(rig.manager().state(request->handle(), static_cast<int32_t>(i)).heldPages(),
                decodePages);
    }
  }

  // Row 0 leaves: its resident row is cleared and its pages return; row 1 reads on.
  ASSERT_TRUE(request->beginBatchCompaction({-1, 0}, 1, rig.mapping));
  EXPECT_EQ(readInt32(rig.mapping), (std::vector<int32_t>{-1, 0}));
  ASSERT_TRUE(request->completeBatchCompaction({-1, 0}));
  EXPECT_EQ(hostRow(*rig.runtime().swaPageTable(), rows[0].slot()),
            emptyRow(*rig.runtime().swaPageTable()));
  dropRow(context, 0);
  rows.erase(rows.begin());
  ASSERT_TRUE(request->prepareDecodeStep(context, kVanilla));
  rows[0].decode(rig.oracle());
  context.generatedTokenIds[0].push_back(99);
  ASSERT_TRUE(request->completeDecodeStep(context, {}));
  testing::OracleReport const report = rows[0].verifyWindow(rig.oracle(), kWindowTokens);
  EXPECT_TRUE(report.ok()) << report.firstMismatch;

  EXPECT_TRUE(request->finish());
  EXPECT_FALSE(request->handle().valid());
  EXPECT_EQ(request->handle().id(), 0u);
  EXPECT_EQ(rig.manager().freePageCount(), rig.manager().totalPageCount());
  EXPECT_EQ(rig.manager().activeRequestCount(), 0);
}

INSTANTIATE_TEST_SUITE_P(Devices, BoundedSwaRequestLifecycleTest,
                         ::testing::Values(DeviceType::kCPU, DeviceType::kGPU), deviceName);

TEST(BoundedSwaRequestTest, BeginRefusesWhatTheBackendCannotRunAndAdmitsNothing) {
  AdapterRig rig(DeviceType::kCPU);
  DecodingInferenceContext const context = rig.context({40, 20});
  LLMGenerationRequest const request;
  test::BackendSnapshot const before = rig.snapshot();
  auto expectRefused = [&](auto&& begin, std::vector<std::string> const& fragments) {
    expectContractError(begin, fragments);
    test::BackendSnapshot const after = rig.snapshot();
    EXPECT_EQ(after, before) << test::differences(after, before);
  };
  expectRefused([&] { BoundedSwaRequest::begin(rig.manager(), request, context, true, kVanilla); },
                {"BoundedSwaRequest::begin: ", "does not decode speculatively"});
  expectRefused(
      [&] {
        BoundedSwaRequest::begin(rig.manager(), request, context, false, {2, 1});
      },
      {"BoundedSwaRequest::begin: ", "needs headroom {1, 0}, got {2, 1}"});
  expectRefused(
      [&] {
        BoundedSwaRequest::begin(rig.manager(), request, context, false, kVanilla, {},
                                 DecodingTokenStateContract::kFullyCommitted);
      },
      {"BoundedSwaRequest::begin: ", "committed-plus-lookahead contract"});
  DecodingInferenceContext wider = context;
  wider.activeBatchSize = 3;
  expectRefused([&] { BoundedSwaRequest::begin(rig.manager(), request, wider, false, kVanilla); },
                {"BoundedSwaRequest::begin: ", "activeBatchSize 3 with 2 prompts and 2 residents"});
  DecodingInferenceContext stale = context;
  stale.residentRefs[1].epoch += 1;
  expectRefused([&] { BoundedSwaRequest::begin(rig.manager(), request, stale, false, kVanilla); },
                {"BoundedSwaKVPageManager::beginRequest: ", "epoch"});
  EXPECT_EQ(rig.manager().activeRequestCount(), 0);
}

TEST(BoundedSwaRequestTest, CallsTheBackendDoesNotOfferThrowOrAnswerWithoutChangingAnything) {
  AdapterRig rig(DeviceType::kCPU);
  DecodingInferenceContext context = rig.context({40, 20});
  std::optional<BoundedSwaRequest> request = beginVanilla(rig, context);
  ASSERT_TRUE(request.has_value());
  prefill(*request, context);
  test::BackendSnapshot const before = rig.snapshot(&*request);

  Tensor hidden({2, 4}, DataType::kFloat16, DeviceType::kCPU);
  expectContractError([&] { (void)request->reuseTokenLength(3); },
                      {"BoundedSwaRequest::reuseTokenLength: row 3: ", "no context reuse"});
  expectContractError([&] { request->publishHybridMtpEndpoint(1, 40, hidden, 0); },
                      {"BoundedSwaRequest::publishHybridMtpEndpoint: row 1: ", "no context reuse"});
  expectContractError(
      [&] { request->restoreHybridMtpBoundaryHidden(0, hidden, 1); },
      {"BoundedSwaRequest::restoreHybridMtpBoundaryHidden: row 0: ", "no context reuse"});
  int32_t const lookahead = 5;
  expectContractError(
      [&] { (void)request->finalizeSequenceAdmission(1, lookahead, 20); },
      {"BoundedSwaRequest::finalizeSequenceAdmission", "row 1 is not an unfinalised"});
  expectContractError([&] { (void)request->preparePrefillChunk(0, 30); },
                      {"BoundedSwaKVPageManager::prepareSequenceChunk", "row 0 is not"});
  expectContractError([&] { (void)request->completePrefillChunk(0, 30); },
                      {"BoundedSwaKVPageManager::completeSequenceChunk", "row 0 is not"});
  EXPECT_FALSE(request->retractSequenceAdmission());  // nothing was admitted: nothing to undo
  EXPECT_TRUE(request->preparePrefill());
  EXPECT_TRUE(request->enqueuePrefillCaptures());
  EXPECT_EQ(request->prefillStarts(), nullptr);

  test::BackendSnapshot const after = rig.snapshot(&*request);
  EXPECT_EQ(after, before) << test::differences(after, before);
  EXPECT_FALSE(request->poisoned());
  EXPECT_TRUE(request->finish());
}

TEST(BoundedSwaRequestTest, MisusedLifecycleCallsThrowNamingTheCallAndTheValueAndChangeNothing) {
  AdapterRig rig(DeviceType::kCPU);
  DecodingInferenceContext context = rig.context({40, 20});
  std::optional<BoundedSwaRequest> request = beginVanilla(rig, context);
  ASSERT_TRUE(request.has_value());
  auto expectRefused = [&](auto&& call, std::vector<std::string> const& fragments) {
    test::BackendSnapshot const before = rig.snapshot(&*request);
    expectContractError(call, fragments);
    test::BackendSnapshot const after = rig.snapshot(&*request);
    EXPECT_EQ(after, before) << test::differences(after, before);
  };
  expectRefused([&] { request->prepareSwaPrefill({40}); },
                {"BoundedSwaKVPageManager::preparePrefill: ", "1 lengths for a batch of 2"});
  prefill(*request, context);

  DecodingInferenceContext narrower = context;
  dropRow(narrower, 1);
  expectRefused([&] { request->completeDecodeStep(narrower, {}); },
                {"BoundedSwaRequest::completeDecodeStep: ",
                 "context has 1 prompts / 1 generated lists for a batch of 2"});
  expectRefused(
      [&] {
        request->prepareDecodeStep(context, {1, 1});
      },
      {"BoundedSwaRequest::prepareDecodeStep: ", "needs headroom {1, 0}, got {1, 1}"});
  expectRefused([&] { request->prepareDecodeStep(narrower, kVanilla); },
                {"BoundedSwaRequest::prepareDecodeStep: ", "for a batch of 2"});
  expectRefused(
      [&] {
        request->completeBatchCompaction({0, 1});
      },
      {"BoundedSwaRequest::completeBatchCompaction: ",
       "no batch compaction was begun (keepMapping [0, 1]"});
  expectRefused(
      [&] {
        request->beginBatchCompaction({1, 0}, 2, rig.mapping);
      },
      {"BoundedSwaKVPageManager::beginBatchCompaction: "});

  ASSERT_TRUE(request->beginBatchCompaction({0, -1}, 1, rig.mapping));
  expectRefused(
      [&] {
        request->completeBatchCompaction({-1, 0});
      },
      {"BoundedSwaRequest::completeBatchCompaction: ",
       "keepMapping [-1, 0] differs from the mapping [0, -1]"});
  EXPECT_TRUE(request->completeBatchCompaction({0, -1}));  // the begun mapping survived
  EXPECT_EQ(rig.manager().batchSize(request->handle()), 1);
  EXPECT_TRUE(request->finish());
}

TEST(BoundedSwaRequestTest, AFailedCompactionSynchronisationPoisonsUntilShutdown) {
  AdapterRig rig(DeviceType::kCPU);
  DecodingInferenceContext context = rig.context({40, 20});
  std::optional<BoundedSwaRequest> request = beginVanilla(rig, context);
  ASSERT_TRUE(request.has_value());
  prefill(*request, context);
  ASSERT_TRUE(request->beginBatchCompaction({0, -1}, 1, rig.mapping));
  rig.faults().failNext();
  EXPECT_FALSE(request->completeBatchCompaction({0, -1}));
  EXPECT_EQ(rig.faults().failures(), 1);
  EXPECT_TRUE(request->poisoned());
  EXPECT_FALSE(request->handle().valid());
  EXPECT_GT(rig.manager().quarantinedPageCount(), 0);
  EXPECT_EQ(rig.runtime().residentRowState(context.residentRefs[0].slot),
            ResidentRowState::kQuarantined);
  EXPECT_FALSE(request->finish());  // the handle is gone, the manager poisoned

  // Poisoned: a new batch is refused (nullopt) and changes nothing.
  DecodingInferenceContext const next = rig.context({8});
  test::BackendSnapshot const before = rig.snapshot();
  EXPECT_FALSE(beginVanilla(rig, next).has_value());
  test::BackendSnapshot const after = rig.snapshot();
  EXPECT_EQ(after, before) << test::differences(after, before);

  request.reset();
  ASSERT_TRUE(rig.runtime().shutdown());
  EXPECT_FALSE(rig.manager().poisoned());
  EXPECT_EQ(rig.manager().freePageCount(), rig.manager().totalPageCount());
  std::optional<BoundedSwaRequest> again = beginVanilla(rig, next);
  ASSERT_TRUE(again.has_value());
  EXPECT_TRUE(again->finish());
}

TEST(BoundedSwaRequestTest, AFailedFinishSynchronisationQuarantinesThePreparedStep) {
  AdapterRig rig(DeviceType::kCPU);
  DecodingInferenceContext context = rig.context({40, 20});
  std::optional<BoundedSwaRequest> request = beginVanilla(rig, context);
  ASSERT_TRUE(request.has_value());
  prefill(*request, context);
  ASSERT_TRUE(request->prepareDecodeStep(context, kVanilla));  // device work pending
  rig.faults().failNext();
  EXPECT_FALSE(request->finish());
  EXPECT_EQ(rig.faults().failures(), 1);
  EXPECT_TRUE(request->poisoned());
  EXPECT_FALSE(request->handle().valid());
  for (ResidentRef const& resident : context.residentRefs) {
    EXPECT_EQ(rig.runtime().residentRowState(resident.slot), ResidentRowState::kQuarantined);
  }
  ASSERT_TRUE(rig.runtime().shutdown());
  EXPECT_EQ(rig.manager().freePageCount(), rig.manager().totalPageCount());
  EXPECT_EQ(rig.runtime().residentRowState(context.residentRefs[0].slot), ResidentRowState::kFree);
}

}  // namespace
}  // namespace mkv::swa_test
