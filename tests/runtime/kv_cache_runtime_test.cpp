// KVCacheRuntime (docs/architecture.md, "Backend selection (KVCacheRuntime)"): the support matrix
// that picks exactly one backend and sizes its pools, supportsSeatedAdmission() per backend, and
// config validation (mkv::Error naming the call and the offending value, before anything is
// allocated). Tests that create a runtime run on host tensors and on GPU tensors (the kGPU
// instances skip without a CUDA device); config validation stays on the host.
#include "mkv/kv_cache_runtime.h"

#include <gtest/gtest.h>

#include <functional>
#include <limits>
#include <numeric>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "context_cache/context_cache_manager.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/error.h"
#include "mkv/host_kv_tier.h"
#include "mkv/managed_kv_cache_request.h"
#include "mkv/testing/reference_engine.h"
#include "runtime_test_rig.h"
#include "support/test_util.h"
#include "support/token_runs.h"

namespace mkv {
using test::tokenRun;
namespace {

/// 4 rows of 256 tokens in pages of 16: 16 pages a row, a full pool of 64 pages by default.
KVCacheRuntimeConfig baseConfig(DeviceType device = DeviceType::kCPU) {
  KVCacheRuntimeConfig config;
  config.model.numFullAttentionLayers = 2;
  config.model.numKVHeads = 1;
  config.model.headDim = 4;
  config.maxBatchSize = 4;
  config.maxSequenceLength = 256;
  config.tokensPerPage = 16;
  config.deviceType = device;
  return config;
}

/// Adds `sliding` window layers of W = 24 tokens: M = 3, 2M + 1 = 7 pages a row, 28 for the batch.
KVCacheRuntimeConfig withWindow(KVCacheRuntimeConfig config, int32_t full, int32_t sliding) {
  config.model.numFullAttentionLayers = full;
  config.model.numSlidingWindowLayers = sliding;
  config.model.slidingWindowTokens = 24;
  return config;
}

constexpr int32_t kBoundedMinimum = 4 * 7;

/// Reuse on with an EAGLE draft {paged, 1} of 1 layer, 1 head of 4; `hybrid` adds 2 recurrent
/// layers of 24 + 8 bytes and a boundary hidden row of 8 (Hybrid-MTP) with 2 snapshot slots each.
KVCacheRuntimeConfig speculativeConfig(KVCacheRuntimeConfig config, bool hybrid) {
  config.contextReuse = true;
  KVCacheSpeculativeConfig spec;
  spec.numDraftLayers = 1;
  spec.numDraftKVHeads = 1;
  spec.draftHeadDim = 4;
  if (hybrid) {
    config.model.numRecurrentLayers = 2;
    config.model.recurrentStateBytes = 24;
    config.model.recurrentConvBytes = 8;
    spec.boundaryHiddenWidth = 8;
    config.contextCache.recurrentSnapshotPoolBytes = int64_t{2} * (2 * (24 + 8) + 8 * 2);
    config.contextCache.partialKvSnapshotPoolBytes = int64_t{2} * (2 + 1) * 2 * 16 * 4 * 2;
  }
  config.speculative = spec;
  return config;
}

struct MatrixCase {
  std::string name;
  KVCacheRuntimeConfig config;
  KVCacheBackend backend;
  int32_t fullPoolLayers;  ///< 0: no full pool
  int32_t fullPoolPages;
  int32_t swaPoolLayers;  ///< 0: no SWA pool
  int32_t swaPoolPages;
};

template <typename Case>
std::string caseName(::testing::TestParamInfo<Case> const& testCase) {
  return testCase.param.name;
}

void PrintTo(MatrixCase const& matrixCase, std::ostream* out) { *out << matrixCase.name; }

std::vector<MatrixCase> matrixCases() {
  std::vector<MatrixCase> cases;
  auto reuse = [](KVCacheRuntimeConfig config) {
    config.contextReuse = true;
    return config;
  };
  auto pages = [](KVCacheRuntimeConfig config, int32_t numPages) {
    config.numPages = numPages;
    return config;
  };
  KVCacheRuntimeConfig const mixed = withWindow(baseConfig(), 2, 3);
  KVCacheRuntimeConfig const slidingOnly = withWindow(baseConfig(), 0, 2);
  cases.push_back(
      {"reuse_full_attention", reuse(baseConfig()), KVCacheBackend::kContextReuse, 2, 64, 0, 0});
  // Reuse on a mixed model: full layers with reuse, sliding layers in their own pool of as many
  // pages as the full pool (sliding-window reuse).
  cases.push_back({"reuse_mixed", reuse(mixed), KVCacheBackend::kSlidingWindowReuse, 2, 64, 3, 64});
  cases.push_back(
      {"reuse_sliding_only", reuse(slidingOnly), KVCacheBackend::kContextReuse, 2, 64, 0, 0});
  cases.push_back(
      {"no_reuse_full_attention", baseConfig(), KVCacheBackend::kFullStorage, 2, 64, 0, 0});
  cases.push_back(
      {"bounded_sliding_only", slidingOnly, KVCacheBackend::kBoundedSwa, 0, 0, 2, kBoundedMinimum});
  // Gemma-style: full layers identity-mapped in their own pool, window layers bounded.
  cases.push_back({"bounded_mixed", mixed, KVCacheBackend::kBoundedSwa, 2, 64, 3, kBoundedMinimum});
  KVCacheRuntimeConfig roomy = slidingOnly;
  roomy.numSwaPages = 40;
  cases.push_back({"bounded_explicit_swa_pages", roomy, KVCacheBackend::kBoundedSwa, 0, 0, 2, 40});
  // maxBatchSize x (2M + 1) == full pool pages: not strictly smaller, full storage.
  cases.push_back({"boundary_equal", pages(slidingOnly, kBoundedMinimum),
                   KVCacheBackend::kFullStorage, 2, kBoundedMinimum, 0, 0});
  cases.push_back({"boundary_one_more", pages(slidingOnly, kBoundedMinimum + 1),
                   KVCacheBackend::kBoundedSwa, 0, 0, 2, kBoundedMinimum});
  cases.push_back({"boundary_equal_mixed", pages(mixed, kBoundedMinimum),
                   KVCacheBackend::kFullStorage, 5, kBoundedMinimum, 0, 0});
  // A window wider than the sequences: W = 300 needs 2 x 20 + 1 pages a row, more than 16.
  KVCacheRuntimeConfig wide = mixed;
  wide.model.slidingWindowTokens = 300;
  cases.push_back({"window_wider_than_rows", wide, KVCacheBackend::kFullStorage, 5, 64, 0, 0});
  // numSwaPages sizes the sliding pool of sliding-window reuse too.
  KVCacheRuntimeConfig slidingPages = reuse(mixed);
  slidingPages.numSwaPages = 40;
  cases.push_back({"reuse_mixed_explicit_swa_pages", slidingPages,
                   KVCacheBackend::kSlidingWindowReuse, 2, 64, 3, 40});
  return cases;
}

/// Every support-matrix case on every device.
class KVCacheRuntimeMatrixTest
    : public ::testing::TestWithParam<std::tuple<MatrixCase, DeviceType>> {
 protected:
  void SetUp() override { MKV_SKIP_WITHOUT_DEVICE(device()); }
  MatrixCase const& matrixCase() const { return std::get<0>(GetParam()); }
  DeviceType device() const { return std::get<1>(GetParam()); }
};

std::string matrixName(::testing::TestParamInfo<std::tuple<MatrixCase, DeviceType>> const& info) {
  return std::get<0>(info.param).name + "_" + std::string(toString(std::get<1>(info.param)));
}

TEST_P(KVCacheRuntimeMatrixTest, ChoosesOneBackendAndSizesItsPools) {
  MatrixCase const& c = matrixCase();
  KVCacheRuntimeConfig config = c.config;
  config.deviceType = device();
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), c.backend) << toString(runtime->backend());
  bool const bounded = c.backend == KVCacheBackend::kBoundedSwa;
  bool const composed = c.backend == KVCacheBackend::kSlidingWindowReuse;
  // One backend, or both halves of sliding-window reuse.
  EXPECT_EQ(runtime->contextCache() != nullptr, !bounded);
  EXPECT_EQ(runtime->swaPageManager() != nullptr, bounded || composed);
  EXPECT_EQ(runtime->windowBlockCache() != nullptr, composed);
  EXPECT_TRUE(runtime->supportsSeatedAdmission()) << "bounded SWA joiners prefill from 0";
  if (!bounded) {
    EXPECT_EQ(runtime->contextCache()->config().enabled,
              c.backend == KVCacheBackend::kContextReuse || composed);
    EXPECT_EQ(runtime->contextCache()->supportsLiveSequenceAdmission(), true);
  }
  EXPECT_EQ(runtime->maxPagesPerSequence(), 16);
  int64_t bytes = 0;
  if (c.fullPoolLayers > 0) {
    ASSERT_NE(runtime->fullPool(), nullptr);
    ASSERT_NE(runtime->fullPageTable(), nullptr);
    EXPECT_EQ(runtime->fullPool()->numLayers(), c.fullPoolLayers);
    EXPECT_EQ(runtime->fullPool()->numPages(), c.fullPoolPages);
    EXPECT_EQ(runtime->fullPageTable()->mode(), PageTableMode::kDense);
    EXPECT_EQ(runtime->fullPageTable()->numPages(), c.fullPoolPages);
    EXPECT_EQ(runtime->fullPageTable()->maxPagesPerSeq(), 16);
    EXPECT_EQ(&runtime->lengthPool(), runtime->fullPool());
    bytes += runtime->fullPool()->totalBytes();
  } else {
    EXPECT_EQ(runtime->fullPool(), nullptr);
    EXPECT_EQ(runtime->fullPageTable(), nullptr);
  }
  if (c.swaPoolLayers > 0) {
    ASSERT_NE(runtime->swaPool(), nullptr);
    ASSERT_NE(runtime->swaPageTable(), nullptr);
    EXPECT_EQ(runtime->swaPool()->numLayers(), c.swaPoolLayers);
    EXPECT_EQ(runtime->swaPool()->numPages(), c.swaPoolPages);
    EXPECT_EQ(runtime->swaPageTable()->mode(), PageTableMode::kSparseWindow);
    EXPECT_EQ(runtime->swaPageTable()->numPages(), c.swaPoolPages);
    EXPECT_EQ(runtime->swaPageManager()->totalPageCount(), c.swaPoolPages);
    EXPECT_EQ(runtime->swaPageManager()->windowTokens(), 24);
    EXPECT_EQ(runtime->swaPageManager()->privatePagesPerSequence(), 7);
    if (c.fullPoolLayers == 0) {
      EXPECT_EQ(&runtime->lengthPool(), runtime->swaPool());
    }
    bytes += runtime->swaPool()->totalBytes();
  } else {
    EXPECT_EQ(runtime->swaPool(), nullptr);
    EXPECT_EQ(runtime->swaPageTable(), nullptr);
  }
  EXPECT_EQ(runtime->kvBytes(), bytes);
  EXPECT_EQ(KVCacheRuntime::kvBytesFor(config), bytes) << "the bytes planned before allocating";
  EXPECT_EQ(runtime->recurrentState(), nullptr);
  EXPECT_EQ(runtime->residentSlots().capacity(), 4);
  for (KVCachePool const* pool : {runtime->fullPool(), runtime->swaPool()}) {
    if (pool != nullptr) {
      EXPECT_EQ(pool->deviceType(), device());
    }
  }
  for (KVPageTable const* table : {runtime->fullPageTable(), runtime->swaPageTable()}) {
    if (table != nullptr) {
      EXPECT_EQ(table->deviceType(), device());
    }
  }
  EXPECT_TRUE(runtime->shutdown());
}

INSTANTIATE_TEST_SUITE_P(SupportMatrix, KVCacheRuntimeMatrixTest,
                         ::testing::Combine(::testing::ValuesIn(matrixCases()),
                                            test::allDeviceTypes()),
                         matrixName);

/// The tests that create a runtime, on each device.
class KVCacheRuntimeTest : public test::DeviceTest {};

INSTANTIATE_TEST_SUITE_P(Devices, KVCacheRuntimeTest, test::allDeviceTypes(), test::deviceName);

TEST_P(KVCacheRuntimeTest, PoolsLargerThanTheDeviceIsAvailableAreRefusedBeforeAllocating) {
  KVCacheRuntimeConfig config = baseConfig(device());
  config.model.numKVHeads = 64;
  config.model.headDim = 256;
  config.tokensPerPage = 1024;
  config.maxSequenceLength = 16 * 1024;
  // 2 layers x 2 x 1024 tokens x 64 heads x 256 x 2 bytes = 128 MiB a page: a million pages
  // (122 TiB) exceed any device's memory.
  config.numPages = 1'000'000;
  int64_t const needed = int64_t{1'000'000} * 128 * 1024 * 1024;
  ASSERT_EQ(KVCacheRuntime::kvBytesFor(config), needed);
  int64_t const available = KVCacheRuntime::availableMemoryBytes(device());
  ASSERT_GT(available, 0);
  ASSERT_LT(available, needed);
  EXPECT_TRUE(
      test::throwsError([&] { (void)KVCacheRuntime::create(config); },
                        {"KVCacheRuntime::create", "the KV pools need 134217728000000 bytes",
                         "available: lower numPages"}));
}

TEST(KVCacheRuntimeConfigTest, BackendNames) {
  EXPECT_EQ(toString(KVCacheBackend::kContextReuse), "context-reuse");
  EXPECT_EQ(toString(KVCacheBackend::kBoundedSwa), "bounded-swa");
  EXPECT_EQ(toString(KVCacheBackend::kFullStorage), "full-storage");
}

TEST_P(KVCacheRuntimeTest, MixedBoundedModelMapsFullLayersByIdentityAndRunsBothPools) {
  auto runtime = KVCacheRuntime::create(withWindow(baseConfig(device()), 1, 2));
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kBoundedSwa);
  KVPageTable const& full = *runtime->fullPageTable();
  // The device table as attention reads it: [slot][K, V][logical page].
  std::vector<int32_t> const uploaded = test::readAs<int32_t>(full.deviceTable());
  ASSERT_EQ(uploaded.size(), 4u * 2 * 16);
  for (CacheSlot slot = 0; slot < 4; ++slot) {
    for (int32_t page = 0; page < 16; ++page) {
      EXPECT_EQ(full.entry(slot, page), slot * 16 + page) << "slot " << slot;
      std::size_t const k =
          (static_cast<std::size_t>(slot) * 2) * 16 + static_cast<std::size_t>(page);
      EXPECT_EQ(uploaded[k], slot * 16 + page) << "K, slot " << slot;
      EXPECT_EQ(uploaded[k + 16], slot * 16 + page + 64) << "V, slot " << slot;
    }
  }
  EXPECT_FALSE(full.dirty()) << "the identity rows are uploaded at creation";
  // Both pools serve a request: the oracle reads every full-layer position and the last W
  // positions of the window layers, and the KV lengths of both pools.
  testing::ReferenceEngine engine(*runtime);
  testing::EngineRequest request;
  request.sequences.push_back({tokenRun(70, 3), 30, {}, {}, {}, -1, 0});
  request.sequences.push_back({tokenRun(20, 900), 50, {}, {}, {}, -1, 1});
  auto const outcome = engine.run(request);
  ASSERT_TRUE(outcome.admitted);
  EXPECT_FALSE(outcome.failed);
  EXPECT_EQ(outcome.decodeSteps, 49);
  EXPECT_EQ(engine.stats().oracleMismatches, 0);
  EXPECT_GE(engine.stats().oracleChecks, 70 + 20 + 49 * 24);
  EXPECT_EQ(engine.stats().peakPagesInUse, 2 * 7) << "2M + 1 pages per sequence at admission";
  EXPECT_EQ(runtime->swaPageManager()->freePageCount(), kBoundedMinimum);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(KVCacheRuntimeTest, FullStorageNeverReuses) {
  auto runtime = KVCacheRuntime::create(baseConfig(device()));
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kFullStorage);
  testing::ReferenceEngine engine(*runtime);
  testing::EngineRequest request;
  request.sequences.push_back({tokenRun(50, 3), 4, {}, {}, {}, -1, 0});
  for (int run = 0; run < 2; ++run) {
    auto const outcome = engine.run(request);
    ASSERT_TRUE(outcome.admitted);
    EXPECT_EQ(outcome.sequences.at(0).prefillStart, 0) << "run " << run;
  }
  EXPECT_EQ(engine.stats().reusedTokens, 0);
  EXPECT_EQ(runtime->contextCache()->manager().records().size(), 0u);
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(KVCacheRuntimeTest, RecurrentLayersGetARowPerResident) {
  for (bool withWindowLayers : {false, true}) {
    KVCacheRuntimeConfig config =
        withWindowLayers ? withWindow(baseConfig(device()), 1, 1) : baseConfig(device());
    config.model.numRecurrentLayers = 3;
    config.model.recurrentStateBytes = 32;
    config.model.recurrentConvBytes = 8;
    auto runtime = KVCacheRuntime::create(config);
    EXPECT_EQ(runtime->backend(),
              withWindowLayers ? KVCacheBackend::kBoundedSwa : KVCacheBackend::kFullStorage);
    ASSERT_NE(runtime->recurrentState(), nullptr);
    EXPECT_EQ(runtime->recurrentState()->numLayers(), 3);
    EXPECT_EQ(runtime->recurrentState()->numSlots(), 4);
    EXPECT_EQ(runtime->recurrentState()->config().stateBytesPerSlot, 32);
    EXPECT_EQ(runtime->recurrentState()->deviceType(), device());
    EXPECT_TRUE(runtime->shutdown());
  }
}

struct InvalidCase {
  std::string name;
  std::function<void(KVCacheRuntimeConfig&)> mutate;
  std::vector<std::string_view> fragments;  ///< besides the call name
};

void PrintTo(InvalidCase const& invalidCase, std::ostream* out) { *out << invalidCase.name; }

std::vector<InvalidCase> invalidCases() {
  constexpr int32_t kIntMax = std::numeric_limits<int32_t>::max();
  auto recurrent = [](int64_t state, int64_t conv) {
    return [state, conv](KVCacheRuntimeConfig& c) {
      c.model.numRecurrentLayers = 1;
      c.model.recurrentStateBytes = state;
      c.model.recurrentConvBytes = conv;
    };
  };
  auto pageSize = [](int32_t tokens) {
    return [tokens](KVCacheRuntimeConfig& c) { c.tokensPerPage = tokens; };
  };
  // Reuse on with a draft: EAGLE, or Hybrid-MTP with recurrent layers; then `mutate` the draft.
  auto draft = [](bool hybrid, std::function<void(KVCacheSpeculativeConfig&)> const& mutate) {
    return [hybrid, mutate](KVCacheRuntimeConfig& c) {
      c = speculativeConfig(c, hybrid);
      mutate(*c.speculative);
    };
  };
  return {
      {"negative_full_layers",
       [](auto& c) { c.model.numFullAttentionLayers = -1; },
       {"layer counts", "full -1"}},
      {"negative_sliding_layers",
       [](auto& c) { c.model.numSlidingWindowLayers = -2; },
       {"layer counts", "sliding -2"}},
      {"negative_recurrent_layers",
       [](auto& c) { c.model.numRecurrentLayers = -3; },
       {"layer counts", "recurrent -3"}},
      {"no_attention_layer",
       [](auto& c) { c.model.numFullAttentionLayers = 0; },
       {"at least one attention layer"}},
      {"sliding_without_window",
       [](auto& c) {
         c.model.numSlidingWindowLayers = 1;
         c.model.slidingWindowTokens = 0;
       },
       {"slidingWindowTokens > 0, got 0"}},
      {"negative_window",
       [](auto& c) {
         c.model.numSlidingWindowLayers = 1;
         c.model.slidingWindowTokens = -8;
       },
       {"slidingWindowTokens > 0, got -8"}},
      {"no_kv_heads", [](auto& c) { c.model.numKVHeads = 0; }, {"numKVHeads must be > 0, got 0"}},
      {"negative_head_dim", [](auto& c) { c.model.headDim = -4; }, {"headDim must be > 0, got -4"}},
      {"recurrent_without_state", recurrent(0, 8), {"recurrentStateBytes", "got 0 and 8"}},
      {"recurrent_without_conv", recurrent(16, 0), {"recurrentConvBytes", "got 16 and 0"}},
      {"no_batch", [](auto& c) { c.maxBatchSize = 0; }, {"maxBatchSize must be > 0, got 0"}},
      {"negative_sequence",
       [](auto& c) { c.maxSequenceLength = -1; },
       {"maxSequenceLength must be > 0, got -1"}},
      {"page_of_zero_tokens", pageSize(0), {"tokensPerPage", "[16, 1024], got 0"}},
      {"page_of_8_tokens", pageSize(8), {"tokensPerPage", "got 8"}},
      {"page_not_a_power_of_two", pageSize(48), {"power of two", "got 48"}},
      {"page_of_2048_tokens", pageSize(2048), {"tokensPerPage", "got 2048"}},
      {"negative_page_size", pageSize(-16), {"tokensPerPage", "got -16"}},
      {"negative_pages", [](auto& c) { c.numPages = -1; }, {"numPages", "got -1"}},
      {"pages_beyond_int32_ids",
       [](auto& c) { c.numPages = kIntMax; },
       {"numPages must be in [0, 1073741823], got 2147483647"}},
      {"negative_swa_pages", [](auto& c) { c.numSwaPages = -5; }, {"numSwaPages", "got -5"}},
      {"swa_pages_below_the_admission_minimum",
       [](auto& c) {
         c = withWindow(c, 0, 1);
         c.numSwaPages = kBoundedMinimum - 1;
       },
       {"numSwaPages 27 is below", "= 28"}},
      {"sliding_reuse_pages_below_one_prefill",
       [](auto& c) {
         c = withWindow(c, 2, 3);
         c.contextReuse = true;
         c.numSwaPages = 18;  // a row of 16 pages + 1 spare + 2 window pages = 19
       },
       {"numSwaPages 18 is below one sequence's sliding-window reuse prefill", "= 19"}},
      {"bounded_mixed_full_pool_too_small",
       [](auto& c) {
         c = withWindow(c, 1, 1);
         c.numPages = 40;  // > 28: bounded SWA is chosen, but 4 rows x 16 pages do not fit
       },
       {"identity-mapped", "numPages 40", "= 64"}},
      {"default_full_pool_overflows",
       [](auto& c) {
         c.maxBatchSize = 1 << 16;
         c.maxSequenceLength = 1 << 24;
       },
       {"default full pool of 68719476736 pages overflows int32"}},
      {"speculative_without_reuse",
       [](auto& c) {
         c = speculativeConfig(c, false);
         c.contextReuse = false;
       },
       {"speculative needs contextReuse"}},
      {"negative_future_dependency",
       draft(false, [](auto& s) { s.futureDependencyTokens = -1; }),
       {"speculative.futureDependencyTokens must be >= 0, got -1"}},
      {"paged_draft_without_layers",
       draft(false, [](auto& s) { s.numDraftLayers = 0; }),
       {"speculative.numDraftLayers > 0, got 0"}},
      {"draft_without_kv_heads",
       draft(false, [](auto& s) { s.numDraftKVHeads = 0; }),
       {"speculative.numDraftKVHeads must be > 0, got 0"}},
      {"negative_draft_head_dim",
       draft(false, [](auto& s) { s.draftHeadDim = -4; }),
       {"speculative.draftHeadDim must be > 0, got -4"}},
      {"negative_draft_pages",
       draft(false, [](auto& s) { s.numDraftPages = -3; }),
       {"speculative.numDraftPages must be in [0, 1073741823], got -3"}},
      {"draft_pages_beyond_int32_ids",
       draft(false, [](auto& s) { s.numDraftPages = kIntMax; }),
       {"speculative.numDraftPages", "got 2147483647"}},
      {"shared_kv_draft_with_layers",
       draft(false,
             [](auto& s) {
               s.pagedDraft = false;
               s.futureDependencyTokens = 0;
               s.numDraftPages = 5;
             }),
       {"owns no pool", "numDraftLayers and numDraftPages must be 0, got 1 and 5"}},
      {"boundary_hidden_width_without_recurrent_layers",
       draft(false, [](auto& s) { s.boundaryHiddenWidth = 8; }),
       {"speculative.boundaryHiddenWidth 8 is for Hybrid-MTP"}},
      {"hybrid_mtp_without_boundary_hidden_width",
       draft(true, [](auto& s) { s.boundaryHiddenWidth = 0; }),
       {"Hybrid-MTP", "speculative.boundaryHiddenWidth > 0, got 0"}},
      {"hybrid_mtp_negative_boundary_hidden_width",
       draft(true, [](auto& s) { s.boundaryHiddenWidth = -2; }),
       {"speculative.boundaryHiddenWidth > 0, got -2"}},
      {"hybrid_mtp_without_paged_draft",
       draft(true,
             [](auto& s) {
               s.pagedDraft = false;
               s.numDraftLayers = 0;
             }),
       {"Hybrid-MTP", "needs speculative.pagedDraft"}},
      {"host_pool_without_reuse",
       [](auto& c) { c.hostPoolTokens = 64; },
       {"hostPoolTokens 64 needs contextReuse", "contextReuse false"}},
      {"host_pool_of_part_of_a_page",
       [](auto& c) {
         c.contextReuse = true;
         c.hostPoolTokens = 40;
       },
       {"hostPoolTokens must be a multiple of tokensPerPage (16)", "got 40"}},
      {"negative_host_pool",
       [](auto& c) {
         c.contextReuse = true;
         c.hostPoolTokens = -16;
       },
       {"hostPoolTokens", "got -16"}},
      {"host_pool_on_a_hybrid_model",
       [recurrent](auto& c) {
         recurrent(16, 8)(c);
         c.contextReuse = true;
         c.hostPoolTokens = 64;
       },
       {"attention-only model", "recurrent layers 1"}},
      {"host_pool_with_speculative_decoding",
       [draft](auto& c) {
         draft(false, [](KVCacheSpeculativeConfig&) {})(c);
         c.hostPoolTokens = 64;
       },
       {"speculative decoding", "speculative true"}},
      {"hybrid_mtp_boundary_hidden_type_out_of_range",
       draft(true, [](auto& s) { s.boundaryHiddenType = static_cast<DataType>(99); }),
       {"speculative.boundaryHiddenType 99 out of range"}},
  };
}

class KVCacheRuntimeValidationTest : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(KVCacheRuntimeValidationTest, ThrowsNamingTheCallAndTheValue) {
  KVCacheRuntimeConfig config = baseConfig();
  GetParam().mutate(config);
  try {
    auto runtime = KVCacheRuntime::create(config);
    FAIL() << "created a " << toString(runtime->backend()) << " runtime";
  } catch (Error const& error) {
    std::string const message = error.what();
    EXPECT_EQ(message.rfind("KVCacheRuntime::create: ", 0), 0u) << message;
    for (std::string_view fragment : GetParam().fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "\"" << message << "\" lacks \"" << fragment << "\"";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(InvalidConfigs, KVCacheRuntimeValidationTest,
                         ::testing::ValuesIn(invalidCases()), caseName<InvalidCase>);

TEST_P(KVCacheRuntimeTest, ReuseForAHybridModelIsCheckpointReuseWithSeatedAdmission) {
  KVCacheRuntimeConfig config = baseConfig(device());
  config.contextReuse = true;
  config.model.numRecurrentLayers = 2;
  config.model.recurrentStateBytes = 24;
  config.model.recurrentConvBytes = 8;
  try {
    (void)KVCacheRuntime::create(config);
    FAIL() << "created a hybrid reuse runtime without snapshot budgets";
  } catch (Error const& error) {
    std::string const message = error.what();
    EXPECT_NE(message.find("ContextCacheCoordinator"), std::string::npos) << message;
    EXPECT_NE(message.find("recurrentSnapshotPoolBytes 0 holds no snapshot slot of 64 bytes"),
              std::string::npos)
        << message;
  }
  config.contextCache.recurrentSnapshotPoolBytes = int64_t{5} * 64;
  config.contextCache.partialKvSnapshotPoolBytes =
      int64_t{3} * 2 * 2 * 16 * 4 * 2;  // 2 layers, fp16
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kContextReuse);
  ContextCacheCoordinator const& coordinator = *runtime->contextCache();
  EXPECT_EQ(coordinator.profile().baseStateKind, BaseStateKind::kHybrid);
  EXPECT_EQ(coordinator.manager().pools().capacity(ResourceType::kRecurrentSnapshot), 5);
  EXPECT_EQ(coordinator.manager().pools().capacity(ResourceType::kPartialKvSnapshot), 3);
  EXPECT_TRUE(runtime->supportsSeatedAdmission()) << "joiners restore their checkpoint";
  EXPECT_TRUE(runtime->shutdown());

  config.contextReuse = false;  // full storage keeps the attention-only profile
  runtime = KVCacheRuntime::create(config);
  EXPECT_EQ(runtime->contextCache()->profile().baseStateKind, BaseStateKind::kAttentionOnly);
  EXPECT_TRUE(runtime->supportsSeatedAdmission());
  EXPECT_TRUE(runtime->shutdown());
}

TEST_P(KVCacheRuntimeTest, SpeculativeReuseOwnsTheDraftPoolAndTableAndPassesTheContract) {
  KVCacheRuntimeConfig config = speculativeConfig(baseConfig(device()), false);
  config.speculative->draftKvDataType = DataType::kBFloat16;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_EQ(runtime->backend(), KVCacheBackend::kContextReuse);
  KVCachePool const* draft = runtime->draftPool();
  ASSERT_NE(draft, nullptr);
  ASSERT_NE(runtime->draftPageTable(), nullptr);
  EXPECT_EQ(draft->numLayers(), 1);
  EXPECT_EQ(draft->numPages(), 64) << "0 pages: as many as the full pool";
  EXPECT_EQ(draft->tokensPerPage(), 16);
  EXPECT_EQ(draft->maxBatchSize(), 4);
  EXPECT_EQ(draft->deviceType(), device());
  EXPECT_EQ(draft->config().numKVHeads, 1);
  EXPECT_EQ(draft->config().headDim, 4);
  EXPECT_EQ(draft->config().dataType, DataType::kBFloat16);
  EXPECT_EQ(runtime->draftPageTable()->mode(), PageTableMode::kDense);
  EXPECT_EQ(runtime->draftPageTable()->numPages(), 64);
  EXPECT_EQ(runtime->draftPageTable()->maxBatch(), 4);
  EXPECT_EQ(runtime->draftPageTable()->maxPagesPerSeq(), 16);
  EXPECT_EQ(runtime->kvBytes(), runtime->fullPool()->totalBytes() + draft->totalBytes());
  EXPECT_EQ(KVCacheRuntime::kvBytesFor(config), runtime->kvBytes());
  std::optional<PagePoolUsage> const draftPages = runtime->capacity().draft;
  ASSERT_TRUE(draftPages.has_value()) << "capacity() reports the draft pool";
  EXPECT_EQ(draftPages->totalPages, 64);
  EXPECT_EQ(draftPages->freePages, 64);
  ContextCacheCoordinator const& coordinator = *runtime->contextCache();
  EXPECT_EQ(coordinator.profile().speculative, (SpecReuseContract{true, 1}));
  EXPECT_EQ(coordinator.profile().baseStateKind, BaseStateKind::kAttentionOnly);
  EXPECT_EQ(coordinator.manager().pools().capacity(ResourceType::kDraftKvPage), 64);
  EXPECT_TRUE(runtime->supportsSeatedAdmission()) << "a joiner gets base and draft rows";
  EXPECT_TRUE(runtime->shutdown());

  config.speculative->numDraftPages = 20;
  config.speculative->futureDependencyTokens = 0;  // DFlash-like: paired, no replay
  runtime = KVCacheRuntime::create(config);
  EXPECT_EQ(runtime->draftPool()->numPages(), 20);
  EXPECT_EQ(runtime->draftPageTable()->numPages(), 20);
  EXPECT_EQ(runtime->contextCache()->profile().speculative, (SpecReuseContract{true, 0}));
  EXPECT_EQ(runtime->contextCache()->manager().pools().capacity(ResourceType::kDraftKvPage), 20);
  EXPECT_TRUE(runtime->shutdown());

  config.speculative = KVCacheSpeculativeConfig{};  // a draft reading the base KV
  config.speculative->pagedDraft = false;
  config.speculative->futureDependencyTokens = 0;
  runtime = KVCacheRuntime::create(config);
  EXPECT_EQ(runtime->draftPool(), nullptr);
  EXPECT_EQ(runtime->draftPageTable(), nullptr);
  EXPECT_EQ(runtime->contextCache()->profile().speculative, (SpecReuseContract{false, 0}));
  EXPECT_EQ(runtime->kvBytes(), runtime->fullPool()->totalBytes());
  EXPECT_TRUE(runtime->shutdown());

  runtime = KVCacheRuntime::create(speculativeConfig(baseConfig(device()), true));
  ContextCacheDeploymentProfile const& mtp = runtime->contextCache()->profile();
  EXPECT_TRUE(mtp.isHybridMtp());
  EXPECT_EQ(mtp.boundaryHiddenWidth, 8);
  EXPECT_EQ(mtp.boundaryHiddenType, DataType::kFloat16);
  ResourcePools const& pools = runtime->contextCache()->manager().pools();
  EXPECT_EQ(pools.capacity(ResourceType::kRecurrentSnapshot), 2) << "rows + hidden row a slot";
  EXPECT_EQ(pools.capacity(ResourceType::kPartialKvSnapshot), 2) << "base + draft page a slot";
  EXPECT_NE(runtime->draftPool(), nullptr);
  EXPECT_TRUE(runtime->supportsSeatedAdmission()) << "Hybrid-MTP joiners";
  EXPECT_TRUE(runtime->shutdown());
}

TEST(KVCacheRuntimeConfigTest, AFieldAResourceValidatesIsRejectedUnderThatResourcesName) {
  KVCacheRuntimeConfig config = baseConfig();
  config.contextReuse = true;
  config.contextCache.maxRecords = -1;
  try {
    (void)KVCacheRuntime::create(config);
    FAIL() << "created a runtime with maxRecords -1";
  } catch (Error const& error) {
    std::string const message = error.what();
    EXPECT_NE(message.find("ContextCacheCoordinator"), std::string::npos) << message;
    EXPECT_NE(message.find("maxRecords must be >= 0, got -1"), std::string::npos) << message;
  }
}

TEST_P(KVCacheRuntimeTest, AHostPoolGivesTheReuseBackendAHostTierOfThatManyPages) {
  KVCacheRuntimeConfig config = baseConfig(device());
  config.contextReuse = true;
  config.hostPoolTokens = 96;
  auto runtime = KVCacheRuntime::create(config);
  ASSERT_NE(runtime->hostTier(), nullptr);
  EXPECT_EQ(runtime->hostTier()->numPages(), 6);
  EXPECT_EQ(runtime->hostTier()->bytesPerPage(), 2 * runtime->fullPool()->pageBytes() * 2);
  EXPECT_EQ(runtime->contextCache()->metrics().hostTierCapacityPages, 6);
  std::optional<PagePoolUsage> const host = runtime->capacity().hostTier;
  ASSERT_TRUE(host.has_value()) << "capacity() reports the host tier";
  EXPECT_EQ(host->totalPages, 6);
  EXPECT_EQ(host->freePages, 6);
  EXPECT_EQ(host->reclaimablePages + host->leasedPages, 0);
  config.hostPoolTokens = 0;
  EXPECT_EQ(KVCacheRuntime::create(config)->hostTier(), nullptr);
}

TEST_P(KVCacheRuntimeTest, ShutdownReportsActiveRequestsAndSucceedsOnceTheyEnded) {
  for (bool reuse : {true, false}) {
    KVCacheRuntimeConfig config = baseConfig(device());
    config.contextReuse = reuse;
    if (!reuse) {  // bounded SWA: sliding layers, far fewer window pages than full pages
      config.model.numFullAttentionLayers = 0;
      config.model.numSlidingWindowLayers = 1;
      config.model.slidingWindowTokens = 16;
      config.maxSequenceLength = 1024;
    }
    auto runtime = KVCacheRuntime::create(config);
    ASSERT_EQ(runtime->backend(),
              reuse ? KVCacheBackend::kContextReuse : KVCacheBackend::kBoundedSwa);
    DecodingInferenceContext context;
    context.activeBatchSize = 1;
    context.rawBatchedInputIds = {{1, 2, 3}};
    context.effectivePrefillLengths = {3};
    context.generatedTokenIds = {{}};
    context.residentRefs = {*runtime->residentSlots().acquire()};
    context.finishReasons = {FinishReason::kNotFinished};
    auto request = ManagedKVCacheRequest::begin(
        runtime->contextCache(), runtime->swaPageManager(), LLMGenerationRequest{}, context, false,
        DecodingKvHeadroom{1, 0}, DecodingTokenStateContract::kCommittedPlusLookahead,
        ContextCacheCommitPolicy::kIncludingGeneratedTokens);
    ASSERT_TRUE(request.has_value());
    EXPECT_FALSE(runtime->shutdown()) << "a request is still active";
    EXPECT_TRUE(request->finish());
    EXPECT_TRUE(runtime->shutdown());
  }
}

}  // namespace
}  // namespace mkv
