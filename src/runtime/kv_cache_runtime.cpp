#include "mkv/kv_cache_runtime.h"

#include <bit>
#include <limits>
#include <optional>
#include <vector>

#include "context_cache/block_hash.h"
#include "context_cache/context_cache_manager.h"
#include "context_cache/coordinator_validation.h"
#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "core/device.h"
#include "core/faults.h"
#include "mkv/bounded_swa_kv_page_manager.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/host_kv_tier.h"
#include "mkv/kernels.h"
#include "mkv/kv_cache_pool.h"
#include "mkv/kv_page_table.h"
#include "mkv/recurrent_state_pool.h"
#include "mkv/sliding_reuse_request.h"
#include "resources/device_write_queue.h"
#include "resources/shared_synchronizer.h"
#include "runtime/rank_agreement.h"

namespace mkv {

std::string_view toString(KVCacheBackend backend) noexcept {
  switch (backend) {
    case KVCacheBackend::kContextReuse:
      return "context-reuse";
    case KVCacheBackend::kBoundedSwa:
      return "bounded-swa";
    case KVCacheBackend::kFullStorage:
      return "full-storage";
    case KVCacheBackend::kSlidingWindowReuse:
      return "sliding-window-reuse";
  }
  return "unknown";
}

namespace {

constexpr char const* kCall = "KVCacheRuntime::create";

int32_t ceilDiv(int64_t a, int64_t b) { return static_cast<int32_t>((a + b - 1) / b); }

/// The support matrix (docs/architecture.md, "Backend selection (KVCacheRuntime)") and the draft
/// of the speculative reuse contract.
void validateSpeculative(KVCacheRuntimeConfig const& config, KVCacheSpeculativeConfig const& spec,
                         int32_t maxPages) {
  MKV_REQUIRE(config.contextReuse, kCall,
              "speculative needs contextReuse (the bounded-SWA and full-storage backends decode "
              "vanilla only)");
  MKV_REQUIRE(spec.futureDependencyTokens >= 0, kCall,
              "speculative.futureDependencyTokens must be >= 0, got {}",
              spec.futureDependencyTokens);
  if (spec.pagedDraft) {
    MKV_REQUIRE(spec.numDraftLayers > 0, kCall,
                "a paged draft needs speculative.numDraftLayers > 0, got {}", spec.numDraftLayers);
    MKV_REQUIRE(spec.numDraftKVHeads > 0, kCall, "speculative.numDraftKVHeads must be > 0, got {}",
                spec.numDraftKVHeads);
    MKV_REQUIRE(spec.draftHeadDim > 0, kCall, "speculative.draftHeadDim must be > 0, got {}",
                spec.draftHeadDim);
    MKV_REQUIRE(spec.numDraftPages >= 0 && spec.numDraftPages <= maxPages, kCall,
                "speculative.numDraftPages must be in [0, {}], got {}", maxPages,
                spec.numDraftPages);
  } else {
    MKV_REQUIRE(spec.numDraftLayers == 0 && spec.numDraftPages == 0, kCall,
                "a draft without paged KV owns no pool: speculative.numDraftLayers and "
                "numDraftPages must be 0, got {} and {}",
                spec.numDraftLayers, spec.numDraftPages);
  }
  if (config.model.numRecurrentLayers > 0) {  // Hybrid-MTP
    MKV_REQUIRE(spec.pagedDraft, kCall,
                "Hybrid-MTP (a model with recurrent layers) needs speculative.pagedDraft");
    MKV_REQUIRE(spec.boundaryHiddenWidth > 0, kCall,
                "Hybrid-MTP (a model with recurrent layers) needs speculative.boundaryHiddenWidth "
                "> 0, got {}",
                spec.boundaryHiddenWidth);
    MKV_REQUIRE(dataTypeSize(spec.boundaryHiddenType) > 0, kCall,
                "speculative.boundaryHiddenType {} out of range",
                static_cast<int>(spec.boundaryHiddenType));
  } else {
    MKV_REQUIRE(spec.boundaryHiddenWidth == 0, kCall,
                "speculative.boundaryHiddenWidth {} is for Hybrid-MTP (a model with recurrent "
                "layers) only; must be 0",
                spec.boundaryHiddenWidth);
  }
}

/// hostPoolTokens: whole pages, at most a pool's page limit, on a deployment the tier serves.
void validateHostPool(KVCacheRuntimeConfig const& config, int32_t maxPages) {
  int64_t const tokens = config.hostPoolTokens;
  if (tokens == 0) {
    return;
  }
  MKV_REQUIRE(
      tokens > 0 && tokens % config.tokensPerPage == 0 && tokens / config.tokensPerPage <= maxPages,
      kCall, "hostPoolTokens must be a multiple of tokensPerPage ({}) in [0, {}], got {}",
      config.tokensPerPage, int64_t{maxPages} * config.tokensPerPage, tokens);
  MKV_REQUIRE(
      config.contextReuse && config.model.numRecurrentLayers == 0 && !config.speculative, kCall,
      "hostPoolTokens {} needs contextReuse on an attention-only model without "
      "speculative decoding (contextReuse {}, recurrent layers {}, speculative {})",
      tokens, config.contextReuse, config.model.numRecurrentLayers, config.speculative.has_value());
}

void validate(KVCacheRuntimeConfig const& config) {
  KVCacheModelConfig const& model = config.model;
  MKV_REQUIRE(model.numFullAttentionLayers >= 0 && model.numSlidingWindowLayers >= 0 &&
                  model.numRecurrentLayers >= 0,
              kCall, "layer counts must be >= 0 (full {}, sliding {}, recurrent {})",
              model.numFullAttentionLayers, model.numSlidingWindowLayers, model.numRecurrentLayers);
  MKV_REQUIRE(model.numFullAttentionLayers + model.numSlidingWindowLayers > 0, kCall,
              "the model needs at least one attention layer");
  MKV_REQUIRE(model.numSlidingWindowLayers == 0 || model.slidingWindowTokens > 0, kCall,
              "sliding layers need slidingWindowTokens > 0, got {}", model.slidingWindowTokens);
  MKV_REQUIRE(model.numKVHeads > 0, kCall, "numKVHeads must be > 0, got {}", model.numKVHeads);
  MKV_REQUIRE(model.headDim > 0, kCall, "headDim must be > 0, got {}", model.headDim);
  MKV_REQUIRE(model.numRecurrentLayers == 0 ||
                  (model.recurrentStateBytes > 0 && model.recurrentConvBytes > 0),
              kCall,
              "recurrent layers need recurrentStateBytes > 0 and recurrentConvBytes > 0 (got {} "
              "and {})",
              model.recurrentStateBytes, model.recurrentConvBytes);
  MKV_REQUIRE(config.maxBatchSize > 0, kCall, "maxBatchSize must be > 0, got {}",
              config.maxBatchSize);
  MKV_REQUIRE(config.maxSequenceLength > 0, kCall, "maxSequenceLength must be > 0, got {}",
              config.maxSequenceLength);
  // Checked here, before it divides anything (0 would), with the pools' own rule.
  MKV_REQUIRE(config.tokensPerPage >= 16 && config.tokensPerPage <= 1024 &&
                  std::has_single_bit(static_cast<uint32_t>(config.tokensPerPage)),
              kCall, "tokensPerPage must be a power of two in [16, 1024], got {}",
              config.tokensPerPage);
  // Page-table entries hold V ids as K id + numPages, so a pool may not exceed int32 max / 2.
  constexpr int32_t kMaxPages = std::numeric_limits<int32_t>::max() / 2;
  MKV_REQUIRE(config.numPages >= 0 && config.numPages <= kMaxPages, kCall,
              "numPages must be in [0, {}], got {}", kMaxPages, config.numPages);
  MKV_REQUIRE(config.numSwaPages >= 0 && config.numSwaPages <= kMaxPages, kCall,
              "numSwaPages must be in [0, {}], got {}", kMaxPages, config.numSwaPages);
  if (config.speculative) {
    validateSpeculative(config, *config.speculative, kMaxPages);
  }
  validateHostPool(config, kMaxPages);
  detail::validateTensorParallel(config, kCall);
}

/// The pools' sizes, checked: `width` pages per sequence (a page-table row), the full pool's
/// pages (`fullDefault` = maxBatchSize x width when numPages is 0), and whether the deployment
/// gets the bounded-SWA backend with its `swaPages` (admission minimum or numSwaPages).
struct PoolSizes {
  int32_t width = 0;
  int64_t fullDefault = 0;
  int32_t fullPages = 0;
  bool bounded = false;
  bool slidingReuse = false;  ///< the sliding-window reuse backend (swaPages: its sliding pool)
  int32_t swaPages = 0;
};

/// Whether reuse on this model gets the sliding-window reuse backend: vanilla attention-only
/// reuse (no recurrent layers, no speculative decoding, no host tier) of a model with full and
/// sliding layers whose decode window, M + 1 pages, is shorter than a sequence's page row. The
/// other reuse deployments keep every attention layer in the full pool.
bool usesSlidingReuse(KVCacheRuntimeConfig const& config, int32_t width) {
  KVCacheModelConfig const& model = config.model;
  return config.contextReuse && model.numSlidingWindowLayers > 0 &&
         model.numFullAttentionLayers > 0 && model.numRecurrentLayers == 0 && !config.speculative &&
         config.hostPoolTokens == 0 &&
         BoundedSwaKVPageManager::decodePagesPerSequence(model.slidingWindowTokens,
                                                         config.tokensPerPage) < width;
}

/// The sliding pool of the sliding-window reuse backend: numSwaPages, or as many pages as the
/// full pool; at least one sequence's largest prefill (a whole row, one spare and the reused
/// window before it).
int32_t slidingReusePages(KVCacheRuntimeConfig const& config, PoolSizes const& sizes) {
  int32_t const windowBlocks = ceilDiv(config.model.slidingWindowTokens, config.tokensPerPage);
  int64_t const minimum = int64_t{sizes.width} + 1 + windowBlocks;
  MKV_REQUIRE(config.numSwaPages == 0 || config.numSwaPages >= minimum, kCall,
              "numSwaPages {} is below one sequence's sliding-window reuse prefill: pages per "
              "sequence {} + 1 spare + window {} = {} (0 selects as many as the full pool)",
              config.numSwaPages, sizes.width, windowBlocks, minimum);
  int64_t const pages = config.numSwaPages > 0 ? config.numSwaPages : sizes.fullPages;
  return static_cast<int32_t>(
      std::min<int64_t>(std::max(pages, minimum), std::numeric_limits<int32_t>::max() / 2));
}

PoolSizes sizePools(KVCacheRuntimeConfig const& config) {
  KVCacheModelConfig const& model = config.model;
  PoolSizes sizes;
  sizes.width = ceilDiv(config.maxSequenceLength, config.tokensPerPage);
  sizes.fullDefault = int64_t{config.maxBatchSize} * sizes.width;
  MKV_REQUIRE(config.numPages > 0 || sizes.fullDefault <= std::numeric_limits<int32_t>::max() / 2,
              kCall, "default full pool of {} pages overflows int32", sizes.fullDefault);
  sizes.fullPages = config.numPages > 0 ? config.numPages : static_cast<int32_t>(sizes.fullDefault);
  if (!config.contextReuse && model.numSlidingWindowLayers > 0) {
    int32_t const perSequence = BoundedSwaKVPageManager::admissionPagesPerSequence(
        model.slidingWindowTokens, config.tokensPerPage);
    int64_t const minimum = int64_t{config.maxBatchSize} * perSequence;
    sizes.bounded = minimum < sizes.fullPages;
    MKV_REQUIRE(!sizes.bounded || config.numSwaPages == 0 || config.numSwaPages >= minimum, kCall,
                "numSwaPages {} is below the bounded-SWA admission minimum maxBatchSize {} x "
                "(2M + 1) {} = {} (0 selects the minimum)",
                config.numSwaPages, config.maxBatchSize, perSequence, minimum);
    sizes.swaPages = static_cast<int32_t>(std::max<int64_t>(minimum, config.numSwaPages));
  }
  if (usesSlidingReuse(config, sizes.width)) {
    sizes.slidingReuse = true;
    sizes.swaPages = slidingReusePages(config, sizes);
  }
  if (sizes.bounded && model.numFullAttentionLayers > 0) {
    MKV_REQUIRE(sizes.fullPages >= sizes.fullDefault, kCall,
                "bounded SWA keeps full layers identity-mapped: numPages {} must cover "
                "maxBatchSize x pages per sequence = {}",
                sizes.fullPages, sizes.fullDefault);
  }
  return sizes;
}

/// The config of a KV pool of `layers` x `pages` with the model's heads, head size and type
/// unless given.
KVCachePoolConfig kvPoolConfig(KVCacheRuntimeConfig const& config, int32_t layers, int32_t pages,
                               int32_t heads = 0, int32_t headDim = 0,
                               std::optional<DataType> type = std::nullopt) {
  KVCachePoolConfig pool;
  pool.numLayers = layers;
  pool.numKVHeads = heads > 0 ? heads : config.model.numKVHeads;
  pool.headDim = headDim > 0 ? headDim : config.model.headDim;
  pool.tokensPerPage = config.tokensPerPage;
  pool.numPages = pages;
  pool.maxBatchSize = config.maxBatchSize;
  pool.dataType = type.value_or(config.model.kvDataType);
  pool.deviceType = config.deviceType;
  return pool;
}

/// The pool pair of the draft layers (a paged speculative draft), else nullopt.
std::optional<KVCachePoolConfig> draftPoolConfig(KVCacheRuntimeConfig const& config,
                                                 int32_t fullPages) {
  if (!config.speculative || !config.speculative->pagedDraft) {
    return std::nullopt;  // validated: a draft needs reuse on
  }
  KVCacheSpeculativeConfig const& spec = *config.speculative;
  int32_t const draftPages = spec.numDraftPages > 0 ? spec.numDraftPages : fullPages;
  return kvPoolConfig(config, spec.numDraftLayers, draftPages, spec.numDraftKVHeads,
                      spec.draftHeadDim, spec.draftKvDataType);
}

/// Every KV pool create() allocates for `sizes`, in the order full, SWA, draft (a pool with no
/// layers is left out).
std::vector<KVCachePoolConfig> kvPoolConfigs(KVCacheRuntimeConfig const& config,
                                             PoolSizes const& sizes) {
  KVCacheModelConfig const& model = config.model;
  std::vector<KVCachePoolConfig> pools;
  if (sizes.bounded || sizes.slidingReuse) {
    if (model.numFullAttentionLayers > 0) {
      pools.push_back(kvPoolConfig(config, model.numFullAttentionLayers, sizes.fullPages));
    }
    pools.push_back(kvPoolConfig(config, model.numSlidingWindowLayers, sizes.swaPages));
    return pools;
  }
  pools.push_back(kvPoolConfig(config, model.numFullAttentionLayers + model.numSlidingWindowLayers,
                               sizes.fullPages));
  if (std::optional<KVCachePoolConfig> draft = draftPoolConfig(config, sizes.fullPages)) {
    pools.push_back(*draft);
  }
  return pools;
}

/// The device bytes of every KV pool create() allocates for `sizes`; INT64_MAX when they would
/// not fit in int64 (an absurd geometry that the pools' own checks refuse later).
int64_t kvPoolBytes(KVCacheRuntimeConfig const& config, PoolSizes const& sizes) {
  int64_t bytes = 0;
  for (KVCachePoolConfig const& pool : kvPoolConfigs(config, sizes)) {
    int64_t poolBytes = 0;
    if (__builtin_mul_overflow(int64_t{pool.numPages}, KVCachePool::bytesPerPage(pool),
                               &poolBytes) ||
        __builtin_add_overflow(bytes, poolBytes, &bytes)) {
      return std::numeric_limits<int64_t>::max();
    }
  }
  return bytes;
}

/// Throws, before anything is allocated, when the KV pools exceed what `config.deviceType` has
/// available: the message names the bytes, so that the caller can size numPages down.
void requireMemoryFor(KVCacheRuntimeConfig const& config, PoolSizes const& sizes) {
  int64_t const needed = kvPoolBytes(config, sizes);
  int64_t const available = KVCacheRuntime::availableMemoryBytes(config.deviceType);
  MKV_REQUIRE(available < 0 || needed <= available, "KVCacheRuntime::create",
              "the KV pools need {} bytes ({:.1f} GiB: {} full pages, {} SWA pages) and the {} has "
              "{} bytes ({:.1f} GiB) available: lower numPages, numSwaPages or maxBatchSize",
              needed, static_cast<double>(needed) / double(1 << 30), sizes.fullPages,
              sizes.swaPages, toString(config.deviceType), available,
              static_cast<double>(available) / double(1 << 30));
}

std::unique_ptr<KVCachePool> makeKvPool(KVCacheRuntimeConfig const& config, int32_t layers,
                                        int32_t pages) {
  return std::make_unique<KVCachePool>(kvPoolConfig(config, layers, pages));
}

/// The recurrent rows of a model with recurrent layers (one per resident slot), else null.
std::unique_ptr<RecurrentStatePool> makeRecurrentPool(KVCacheRuntimeConfig const& config) {
  KVCacheModelConfig const& model = config.model;
  if (model.numRecurrentLayers == 0) {
    return nullptr;
  }
  RecurrentStatePoolConfig recurrent;
  recurrent.numLayers = model.numRecurrentLayers;
  recurrent.numSlots = config.maxBatchSize;
  recurrent.stateBytesPerSlot = model.recurrentStateBytes;
  recurrent.convBytesPerSlot = model.recurrentConvBytes;
  recurrent.deviceType = config.deviceType;
  return std::make_unique<RecurrentStatePool>(recurrent);
}

/// The full layers' table of a bounded-SWA deployment: resident slot s owns pages
/// [s x width, (s + 1) x width), uploaded once.
std::unique_ptr<KVPageTable> makeIdentityTable(KVCacheRuntimeConfig const& config,
                                               PoolSizes const& sizes) {
  auto table = std::make_unique<KVPageTable>(config.maxBatchSize, sizes.width, sizes.fullPages,
                                             PageTableMode::kDense, config.deviceType);
  std::vector<PageId> row(static_cast<std::size_t>(sizes.width));
  for (CacheSlot slot = 0; slot < config.maxBatchSize; ++slot) {
    for (int32_t p = 0; p < sizes.width; ++p) {
      row[static_cast<std::size_t>(p)] = slot * sizes.width + p;
    }
    table->setRow(slot, row);
  }
  table->upload(config.stream);
  return table;
}

/// What the coordinator serves: checkpoint reuse for a hybrid model with reuse on (snapshot
/// budgets in config.contextCache; without reuse the recurrent rows are only zeroed when
/// compaction drops them), and the speculative contract.
ContextCacheDeploymentProfile deploymentProfile(KVCacheRuntimeConfig const& config) {
  ContextCacheDeploymentProfile profile;
  if (config.contextReuse && config.model.numRecurrentLayers > 0) {
    profile.baseStateKind = BaseStateKind::kHybrid;
  }
  if (config.speculative) {
    KVCacheSpeculativeConfig const& spec = *config.speculative;
    profile.speculative = SpecReuseContract{spec.pagedDraft, spec.futureDependencyTokens};
    profile.boundaryHiddenWidth = spec.boundaryHiddenWidth;
    profile.boundaryHiddenType = spec.boundaryHiddenType;
  }
  return profile;
}

}  // namespace

KVCacheRuntime::KVCacheRuntime(KVCacheRuntimeConfig const& config) : mConfig(config) {}

KVCacheRuntime::~KVCacheRuntime() = default;

std::unique_ptr<KVCacheRuntime> KVCacheRuntime::create(KVCacheRuntimeConfig const& requested) {
  validate(requested);
  // A tensor-parallel rank builds its share: from here on `config` is what it allocates.
  KVCacheRuntimeConfig config = detail::rankShare(requested);
  PoolSizes const sizes = sizePools(config);  // the last checks: nothing is allocated before
  requireMemoryFor(config, sizes);
  KVCacheModelConfig const& model = config.model;
  if (config.deviceType == DeviceType::kGPU) {
    kernels::loadKernels();  // no lazy kernel load (which may wait for other streams) later
  }
  std::shared_ptr<detail::RankAgreementPoint> agreement;
  if (config.tensorParallel.size > 1) {
    // Every completion point agrees once, after this rank's wait and its injected sync fault;
    // every other fault site agrees where it is consulted.
    agreement = std::make_shared<detail::RankAgreementPoint>(config.tensorParallel.agreement);
    StreamSynchronizer const own =
        config.synchronizer ? config.synchronizer : defaultStreamSynchronizer(config.deviceType);
    config.synchronizer =
        detail::withRankAgreement(detail::withSyncFaults(own, config.faults), agreement);
    config.faults = detail::withoutSite(detail::withRankAgreement(config.faults, agreement),
                                        FaultSite::kStreamSynchronize);
  }
  std::unique_ptr<KVCacheRuntime> runtime(new KVCacheRuntime(config));
  runtime->mMaxPagesPerSequence = sizes.width;
  StreamSynchronizer const synchronizer =
      config.synchronizer ? config.synchronizer : defaultStreamSynchronizer(config.deviceType);
  runtime->mRecurrent = makeRecurrentPool(config);
  runtime->mResidentSlots.reset(config.maxBatchSize);
  runtime->mDeviceWrites = std::make_unique<detail::DeviceWriteQueue>(
      config.deviceType, config.deviceWrites, config.faults);
  if (agreement) {
    runtime->mDeviceWrites->recordDecisions();
    agreement->setDecisions(runtime->mDeviceWrites.get());
    runtime->mRankAgreement = std::move(agreement);
  }

  if (sizes.bounded) {
    runtime->mBackend = KVCacheBackend::kBoundedSwa;
    runtime->mSwaPool = makeKvPool(config, model.numSlidingWindowLayers, sizes.swaPages);
    runtime->mSwaTable =
        std::make_unique<KVPageTable>(config.maxBatchSize, sizes.width, sizes.swaPages,
                                      PageTableMode::kSparseWindow, config.deviceType);
    BoundedSwaResources resources;
    resources.swaPool = runtime->mSwaPool.get();
    resources.swaPageTable = runtime->mSwaTable.get();
    resources.recurrent = runtime->mRecurrent.get();
    resources.residentSlots = &runtime->mResidentSlots;
    resources.deviceWrites = runtime->mDeviceWrites.get();
    if (model.numFullAttentionLayers > 0) {  // identity-mapped full layers
      runtime->mFullPool = makeKvPool(config, model.numFullAttentionLayers, sizes.fullPages);
      runtime->mFullTable = makeIdentityTable(config, sizes);
      resources.lengthPools.push_back(runtime->mFullPool.get());
    }
    resources.lengthPools.push_back(runtime->mSwaPool.get());
    runtime->mSwaManager = std::make_unique<BoundedSwaKVPageManager>(
        BoundedSwaConfig{model.slidingWindowTokens}, resources, config.stream, synchronizer,
        config.faults);
    return runtime;
  }

  if (sizes.slidingReuse) {
    runtime->createSlidingReuse(sizes.fullPages, sizes.width, sizes.swaPages, synchronizer);
    return runtime;
  }
  runtime->mBackend =
      config.contextReuse ? KVCacheBackend::kContextReuse : KVCacheBackend::kFullStorage;
  runtime->mFullPool = makeKvPool(
      config, model.numFullAttentionLayers + model.numSlidingWindowLayers, sizes.fullPages);
  runtime->mFullTable = std::make_unique<KVPageTable>(
      config.maxBatchSize, sizes.width, sizes.fullPages, PageTableMode::kDense, config.deviceType);
  ContextCacheConfig cache = config.contextCache;
  cache.enabled = config.contextReuse;
  ContextCachePhysicalResources resources;
  resources.basePool = runtime->mFullPool.get();
  resources.basePageTable = runtime->mFullTable.get();
  resources.recurrent = runtime->mRecurrent.get();
  resources.residentSlots = &runtime->mResidentSlots;
  resources.deviceWrites = runtime->mDeviceWrites.get();
  runtime->createDraft(sizes.fullPages, sizes.width);
  resources.draftPool = runtime->mDraftPool.get();
  resources.draftPageTable = runtime->mDraftTable.get();
  runtime->createHostTier();
  resources.hostTier = runtime->mHostTier.get();
  runtime->mCoordinator = std::make_unique<ContextCacheCoordinator>(
      cache, deploymentProfile(config), resources, config.stream, synchronizer, config.faults);
  return runtime;
}

void KVCacheRuntime::createSlidingReuse(int32_t fullPages, int32_t width, int32_t swaPages,
                                        StreamSynchronizer const& synchronizer) {
  KVCacheModelConfig const& model = mConfig.model;
  mBackend = KVCacheBackend::kSlidingWindowReuse;
  mFullPool = makeKvPool(mConfig, model.numFullAttentionLayers, fullPages);
  mFullTable = std::make_unique<KVPageTable>(mConfig.maxBatchSize, width, fullPages,
                                             PageTableMode::kDense, mConfig.deviceType);
  mSwaPool = makeKvPool(mConfig, model.numSlidingWindowLayers, swaPages);
  mSwaTable = std::make_unique<KVPageTable>(mConfig.maxBatchSize, width, swaPages,
                                            PageTableMode::kSparseWindow, mConfig.deviceType);
  mWindowCache =
      std::make_unique<WindowBlockCache>(swaPages, mConfig.tokensPerPage, model.slidingWindowTokens,
                                         mConfig.contextCache.verifyTokens);
  // Both halves complete together: each completion point of the composed request waits once, and
  // consults the injector once (before the sharing); the halves get it without that site.
  mSharedSync = std::make_unique<detail::SharedSynchronizer>(
      detail::withSyncFaults(synchronizer, mConfig.faults));
  FaultInjector const halves = detail::withoutSite(mConfig.faults, FaultSite::kStreamSynchronize);
  ContextCacheConfig cache = mConfig.contextCache;
  cache.enabled = true;
  ContextCachePhysicalResources resources;
  resources.basePool = mFullPool.get();
  resources.basePageTable = mFullTable.get();
  resources.residentSlots = &mResidentSlots;
  resources.windowCache = mWindowCache.get();
  resources.deviceWrites = mDeviceWrites.get();
  mCoordinator = std::make_unique<ContextCacheCoordinator>(
      cache, deploymentProfile(mConfig), resources, mConfig.stream, mSharedSync->view(), halves);
  BoundedSwaResources swa;
  swa.swaPool = mSwaPool.get();
  swa.swaPageTable = mSwaTable.get();
  swa.residentSlots = &mResidentSlots;
  swa.pageSource = mWindowCache.get();
  swa.lengthPools.push_back(mSwaPool.get());  // the full pool's lengths are the coordinator's
  swa.sharedSynchronizer = mSharedSync.get();
  swa.deviceWrites = mDeviceWrites.get();
  mSwaManager =
      std::make_unique<BoundedSwaKVPageManager>(BoundedSwaConfig{model.slidingWindowTokens}, swa,
                                                mConfig.stream, mSharedSync->view(), halves);
}

void KVCacheRuntime::createDraft(int32_t fullPages, int32_t width) {
  std::optional<KVCachePoolConfig> const draft = draftPoolConfig(mConfig, fullPages);
  if (!draft) {
    return;
  }
  mDraftPool = std::make_unique<KVCachePool>(*draft);
  mDraftTable = std::make_unique<KVPageTable>(mConfig.maxBatchSize, width, draft->numPages,
                                              PageTableMode::kDense, mConfig.deviceType);
}

void KVCacheRuntime::createHostTier() {
  if (mConfig.hostPoolTokens == 0) {
    return;  // validated: reuse on, attention only, not speculative
  }
  HostKvTierConfig tier;
  tier.numPages = static_cast<int32_t>(mConfig.hostPoolTokens / mConfig.tokensPerPage);
  tier.faults = mConfig.faults;
  mHostTier = std::make_unique<HostKvTier>(tier, *mFullPool);
}

bool KVCacheRuntime::supportsSeatedAdmission() const noexcept {
  if (mBackend == KVCacheBackend::kBoundedSwa) {
    return true;  // never speculative; a joiner prefills from 0 in its own 2M + 1 pages
  }
  return mCoordinator != nullptr && mCoordinator->supportsLiveSequenceAdmission();
}

KVCachePool& KVCacheRuntime::lengthPool() noexcept { return mFullPool ? *mFullPool : *mSwaPool; }

int64_t KVCacheRuntime::kvBytesFor(KVCacheRuntimeConfig const& config) {
  validate(config);
  KVCacheRuntimeConfig const share = detail::rankShare(config);
  return kvPoolBytes(share, sizePools(share));
}

int64_t KVCacheRuntime::availableMemoryBytes(DeviceType device) {
  return detail::availableMemoryBytes(device);
}

namespace {
PagePoolUsage poolUsage(int32_t total, int32_t free, int32_t reclaimable) noexcept {
  return PagePoolUsage{total, free, reclaimable, total - free - reclaimable};
}
}  // namespace

KVCacheCapacity KVCacheRuntime::capacity() const {
  KVCacheCapacity capacity;
  if (mCoordinator) {
    ResourcePools const& pools = mCoordinator->manager().pools();
    auto usageOf = [&pools](ResourceType type) {
      return poolUsage(pools.capacity(type), pools.freeCount(type), pools.reclaimableCount(type));
    };
    capacity.base = usageOf(ResourceType::kBaseKvPage);
    if (mDraftPool) {
      capacity.draft = usageOf(ResourceType::kDraftKvPage);
    }
    if (mHostTier) {
      ContextCacheMetrics const metrics = mCoordinator->metrics();
      auto const total = static_cast<int32_t>(metrics.hostTierCapacityPages);
      auto const blocks = static_cast<int32_t>(metrics.hostTierBlocks);
      capacity.hostTier = poolUsage(total, total - blocks, blocks);
    }
  }
  if (mWindowCache) {
    capacity.sliding = poolUsage(mWindowCache->totalPages(), mWindowCache->freePages(),
                                 mWindowCache->evictablePages());
  } else if (mSwaManager) {
    capacity.sliding = poolUsage(mSwaManager->totalPageCount(), mSwaManager->freePageCount(), 0);
  }
  return capacity;
}

AdmissionEstimate KVCacheRuntime::estimateAdmission(std::vector<int32_t> const& promptTokens,
                                                    std::string_view loraWeightsName,
                                                    std::string_view cacheSalt,
                                                    DecodingKvHeadroom const& headroom) const {
  constexpr char const* kEstimateCall = "KVCacheRuntime::estimateAdmission";
  MKV_REQUIRE(!promptTokens.empty(), kEstimateCall, "the prompt is empty");
  detail::validateHeadroom(kEstimateCall, headroom, false);
  if (mCoordinator) {
    ContextCacheSequenceAdmission sequence;
    sequence.tokenIds = promptTokens;
    sequence.keyExtras = BlockKeyExtras{digestIdentity(loraWeightsName), digestIdentity(cacheSalt)};
    try {
      AdmissionEstimate estimate = mCoordinator->estimateAdmission(sequence, headroom);
      if (mBackend == KVCacheBackend::kSlidingWindowReuse) {
        // The sliding half admits too: its pages from the reuse start, plus the cached window
        // pages before it that admission pins.
        SlidingReuseRequest::SlidingPoolEstimate const sliding =
            SlidingReuseRequest::estimateSlidingPool(*mCoordinator, *mSwaManager, sequence);
        estimate.slidingPages = sliding.privatePages + sliding.unheldWindowPages;
        bool const poisoned = mSwaManager->poisoned();
        estimate.fitsWithoutEviction = estimate.fitsWithoutEviction && !poisoned &&
                                       sliding.privatePages <= mWindowCache->freePages();
        estimate.fitsAfterEviction = estimate.fitsAfterEviction && !poisoned &&
                                     estimate.slidingPages <= mWindowCache->availablePages();
      }
      return estimate;
    } catch (Error const& error) {  // the coordinator's check, named under the caller's call
      detail::throwContract(kEstimateCall, "{}", error.what());
    }
  }
  AdmissionEstimate estimate;  // bounded SWA: no reuse, one window budget of sliding pages
  estimate.promptTokens = static_cast<int32_t>(promptTokens.size());
  estimate.slidingPages = BoundedSwaKVPageManager::admissionPagesPerSequence(
      mConfig.model.slidingWindowTokens, mConfig.tokensPerPage);
  estimate.fitsWithoutEviction =
      !mSwaManager->poisoned() && mSwaManager->freePageCount() >= estimate.slidingPages;
  estimate.fitsAfterEviction = estimate.fitsWithoutEviction;
  return estimate;
}

int64_t KVCacheRuntime::kvBytes() const noexcept {
  int64_t bytes = 0;
  if (mFullPool) {
    bytes += mFullPool->totalBytes();
  }
  if (mSwaPool) {
    bytes += mSwaPool->totalBytes();
  }
  if (mDraftPool) {
    bytes += mDraftPool->totalBytes();
  }
  return bytes;
}

void KVCacheRuntime::flushDeviceWrites() {
  try {
    mDeviceWrites->flush(mConfig.stream);
  } catch (Error const& error) {
    detail::throwContract("KVCacheRuntime::flushDeviceWrites", "{}", error.what());
  }
}

bool KVCacheRuntime::deviceWritesPending() const noexcept { return mDeviceWrites->pending(); }

int64_t KVCacheRuntime::deviceWriteLaunches() const noexcept { return mDeviceWrites->launches(); }

TensorParallelStats KVCacheRuntime::tensorParallelStats() const noexcept {
  return mRankAgreement ? mRankAgreement->stats() : TensorParallelStats{};
}

bool KVCacheRuntime::shutdown() noexcept {
  detail::SharedSynchronizer::Scope const once(mSharedSync.get());  // the composed backend
  bool ok = true;
  if (mCoordinator) {
    ok = mCoordinator->shutdown() == ContextCacheStatus::kOk;
  }
  if (mSwaManager) {
    ok = mSwaManager->shutdown() == SwaKVCacheStatus::kOk && ok;
  }
  return ok;
}

ResidentRowState KVCacheRuntime::residentRowState(CacheSlot slot) const noexcept {
  // The sliding-window reuse backend holds a row in both halves: quarantined by either is
  // quarantined, held by either is active.
  ResidentRowState const full =
      mCoordinator ? mCoordinator->residentRowState(slot) : ResidentRowState::kFree;
  ResidentRowState const sliding =
      mSwaManager ? mSwaManager->residentRowState(slot) : ResidentRowState::kFree;
  if (full == ResidentRowState::kQuarantined || sliding == ResidentRowState::kQuarantined) {
    return ResidentRowState::kQuarantined;
  }
  return full == ResidentRowState::kActive || sliding == ResidentRowState::kActive
             ? ResidentRowState::kActive
             : ResidentRowState::kFree;
}

}  // namespace mkv
