#include "context_cache/coordinator_deployment.h"

#include <limits>

#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "mkv/host_kv_tier.h"

namespace mkv::detail {
namespace {

constexpr char const* kCall = "ContextCacheCoordinator";

/// The configuration and the profile on their own, then which resources the profile admits.
void validateProfile(ContextCacheConfig const& config, ContextCacheDeploymentProfile const& profile,
                     ContextCachePhysicalResources const& resources) {
  MKV_REQUIRE(config.maxRecords >= 0, kCall, "maxRecords must be >= 0, got {}", config.maxRecords);
  MKV_REQUIRE(config.evictionPolicy == EvictionPolicyKind::kLru ||
                  config.evictionPolicy == EvictionPolicyKind::kS3Fifo ||
                  config.evictionPolicy == EvictionPolicyKind::kLoopAware,
              kCall, "eviction policy {} out of range", static_cast<int>(config.evictionPolicy));
  MKV_REQUIRE(config.eventQueueCapacity >= 0, kCall, "eventQueueCapacity must be >= 0, got {}",
              config.eventQueueCapacity);
  MKV_REQUIRE(config.recurrentSnapshotPoolBytes >= 0 && config.partialKvSnapshotPoolBytes >= 0,
              kCall, "snapshot budgets must be >= 0, got recurrent {} and partial {} bytes",
              config.recurrentSnapshotPoolBytes, config.partialKvSnapshotPoolBytes);
  MKV_REQUIRE(
      static_cast<uint8_t>(profile.baseStateKind) <= static_cast<uint8_t>(BaseStateKind::kHybrid),
      kCall, "base state kind {} out of range", static_cast<int>(profile.baseStateKind));
  MKV_REQUIRE(config.checkpointInterval >= 0, kCall, "checkpointInterval must be >= 0, got {}",
              config.checkpointInterval);
  MKV_REQUIRE(config.checkpointInterval == 0 || profile.usesCheckpointReuse() ||
                  resources.windowCache != nullptr,
              kCall,
              "checkpointInterval {} is for hybrid, pure-recurrent and sliding-window reuse "
              "deployments: full attention reuses every page boundary already",
              config.checkpointInterval);
  if (profile.hasAttention() && resources.basePool != nullptr) {
    int32_t const pageSize = resources.basePool->tokensPerPage();
    MKV_REQUIRE(config.checkpointInterval % pageSize == 0, kCall,
                "checkpointInterval {} is not a multiple of the page size {}: a reuse point keeps "
                "no partial page",
                config.checkpointInterval, pageSize);
  }
  if (profile.isSpeculative()) {
    MKV_REQUIRE(profile.speculative->futureDependencyTokens >= 0, kCall,
                "speculative futureDependencyTokens must be >= 0, got {}",
                profile.speculative->futureDependencyTokens);
    MKV_REQUIRE(profile.hasAttention(), kCall,
                "a pure-recurrent deployment cannot be speculative (no KV for a draft to pair "
                "with)");
  }
  bool const mtp = profile.isHybridMtp();
  bool const paged = profile.ownsPagedSpecState();
  MKV_REQUIRE(!mtp || paged, kCall,
              "a Hybrid-MTP deployment needs an own-KV draft: the speculative contract must be "
              "paged");
  MKV_REQUIRE(mtp || profile.boundaryHiddenWidth == 0, kCall,
              "boundaryHiddenWidth {} is for Hybrid-MTP deployments only",
              profile.boundaryHiddenWidth);
  MKV_REQUIRE(!mtp || profile.boundaryHiddenWidth > 0, kCall,
              "a Hybrid-MTP deployment needs boundaryHiddenWidth > 0, got {}",
              profile.boundaryHiddenWidth);
  MKV_REQUIRE(!mtp || dataTypeSize(profile.boundaryHiddenType) > 0, kCall,
              "boundaryHiddenType {} out of range", static_cast<int>(profile.boundaryHiddenType));
  MKV_REQUIRE(paged || (resources.draftPool == nullptr && resources.draftPageTable == nullptr),
              kCall, "draft resources given to a {}",
              profile.isSpeculative() ? "speculative deployment whose draft has no paged KV"
                                      : "non-speculative deployment");
  MKV_REQUIRE(!profile.usesCheckpointReuse() || resources.recurrent != nullptr, kCall,
              "a {} deployment needs the recurrent state pool",
              profile.hasAttention() ? "hybrid" : "pure-recurrent");
}

/// The base KV (pool and dense table) of an attention deployment, or its absence; sets the
/// layout's rows and device.
void validateBase(ContextCacheDeploymentProfile const& profile,
                  ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
  if (!profile.hasAttention()) {
    MKV_REQUIRE(resources.basePool == nullptr && resources.basePageTable == nullptr, kCall,
                "a pure-recurrent deployment has no KV: basePool and basePageTable must be null");
    layout.maxBatch = resources.recurrent->numSlots();
    layout.device = resources.recurrent->deviceType();
    return;
  }
  MKV_REQUIRE(resources.basePool != nullptr && resources.basePageTable != nullptr, kCall,
              "an attention deployment needs basePool and basePageTable");
  KVCachePool const& pool = *resources.basePool;
  KVPageTable const& table = *resources.basePageTable;
  MKV_REQUIRE(table.mode() == PageTableMode::kDense, kCall, "the base page table must be dense");
  MKV_REQUIRE(table.numPages() == pool.numPages(), kCall,
              "base page table addresses {} pages but the pool has {}", table.numPages(),
              pool.numPages());
  MKV_REQUIRE(table.deviceType() == pool.deviceType(), kCall, "table on {} but pool on {}",
              toString(table.deviceType()), toString(pool.deviceType()));
  MKV_REQUIRE(pool.maxBatchSize() >= table.maxBatch(), kCall,
              "pool KV lengths hold {} rows but the table has {}", pool.maxBatchSize(),
              table.maxBatch());
  layout.maxBatch = table.maxBatch();
  layout.device = pool.deviceType();
}

/// The recurrent pool (when given) and the draft KV of a paged speculative deployment, against
/// the base's rows and device.
void validateCompanions(ContextCacheDeploymentProfile const& profile,
                        ContextCachePhysicalResources const& resources,
                        DeploymentLayout const& layout) {
  int32_t const maxBatch = layout.maxBatch;
  DeviceType const device = layout.device;
  if (RecurrentStatePool const* recurrent = resources.recurrent) {
    MKV_REQUIRE(recurrent->numSlots() >= maxBatch, kCall,
                "recurrent pool has {} slots but the table has {} rows", recurrent->numSlots(),
                maxBatch);
    MKV_REQUIRE(recurrent->deviceType() == device, kCall, "recurrent pool on {} but KV on {}",
                toString(recurrent->deviceType()), toString(device));
  }
  if (!profile.ownsPagedSpecState()) {
    return;
  }
  MKV_REQUIRE(resources.draftPool != nullptr && resources.draftPageTable != nullptr, kCall,
              "a paged speculative deployment needs draftPool and draftPageTable");
  KVCachePool const& draft = *resources.draftPool;
  KVPageTable const& table = *resources.draftPageTable;
  MKV_REQUIRE(table.mode() == PageTableMode::kDense, kCall, "the draft page table must be dense");
  MKV_REQUIRE(table.numPages() == draft.numPages(), kCall,
              "draft page table addresses {} pages but the draft pool has {}", table.numPages(),
              draft.numPages());
  MKV_REQUIRE(draft.tokensPerPage() == resources.basePool->tokensPerPage(), kCall,
              "draft pages hold {} tokens but base pages {}", draft.tokensPerPage(),
              resources.basePool->tokensPerPage());
  MKV_REQUIRE(table.deviceType() == device && draft.deviceType() == device, kCall,
              "draft table on {} and draft pool on {} but base KV on {}",
              toString(table.deviceType()), toString(draft.deviceType()), toString(device));
  MKV_REQUIRE(table.maxBatch() == maxBatch && draft.maxBatchSize() >= maxBatch, kCall,
              "draft table has {} rows and draft pool KV lengths {} but the base table has {}",
              table.maxBatch(), draft.maxBatchSize(), maxBatch);
}

/// Snapshot slots of a checkpoint deployment, from the byte budgets.
void layOutSnapshots(ContextCacheConfig const& config, ContextCacheDeploymentProfile const& profile,
                     ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
  auto slotsOf = [&](int64_t budget, int64_t bytesPerSlot, char const* field) {
    int64_t const slots = budget / bytesPerSlot;
    MKV_REQUIRE(slots <= std::numeric_limits<int32_t>::max(), kCall,
                "{} {} gives {} slots, more than int32 holds", field, budget, slots);
    MKV_REQUIRE(!config.enabled || slots >= 1, kCall, "{} {} holds no snapshot slot of {} bytes",
                field, budget, bytesPerSlot);
    return static_cast<int32_t>(slots);
  };
  bool const mtp = profile.isHybridMtp();
  SnapshotStorageConfig& snapshots = layout.snapshots;
  // A Hybrid-MTP slot also holds the boundary hidden row, and its partial page the draft's.
  int64_t recurrentBytes = SnapshotStorage::recurrentBytesPerSlot(*resources.recurrent);
  if (mtp) {
    snapshots.boundaryHiddenWidth = profile.boundaryHiddenWidth;
    snapshots.boundaryHiddenType = profile.boundaryHiddenType;
    recurrentBytes += SnapshotStorage::boundaryHiddenBytesPerSlot(profile.boundaryHiddenWidth,
                                                                  profile.boundaryHiddenType);
  }
  snapshots.recurrentSlots =
      slotsOf(config.recurrentSnapshotPoolBytes, recurrentBytes, "recurrentSnapshotPoolBytes");
  if (profile.hasAttention()) {
    int64_t partialBytes = SnapshotStorage::partialKvBytesPerSlot(*resources.basePool);
    if (mtp) {
      partialBytes += SnapshotStorage::partialKvBytesPerSlot(*resources.draftPool);
    }
    snapshots.partialKvSlots =
        slotsOf(config.partialKvSnapshotPoolBytes, partialBytes, "partialKvSnapshotPoolBytes");
  }
  layout.capacities.recurrentSnapshotSlots = snapshots.recurrentSlots;
  layout.capacities.partialKvSnapshotSlots = snapshots.partialKvSlots;
}

/// The host tier: attention-only, non-speculative reuse, on the base pool's device and geometry.
void validateHostTier(ContextCacheConfig const& config,
                      ContextCacheDeploymentProfile const& profile,
                      ContextCachePhysicalResources const& resources) {
  HostKvTier const* tier = resources.hostTier;
  if (tier == nullptr) {
    return;
  }
  MKV_REQUIRE(config.enabled, kCall, "a host tier needs context reuse enabled");
  MKV_REQUIRE(profile.baseStateKind == BaseStateKind::kAttentionOnly && !profile.isSpeculative(),
              kCall,
              "a host tier is supported on attention-only, non-speculative deployments only "
              "(this one is {}{})",
              profile.hasAttention() ? "hybrid" : "pure recurrent",
              profile.isSpeculative() ? ", speculative" : "");
  kernels::PagedBuffers const host = tier->pagedBuffers();
  kernels::PagedBuffers const gpu = resources.basePool->pagedBuffers();
  MKV_REQUIRE(
      host.deviceType == gpu.deviceType && host.numLayers() == gpu.numLayers() &&
          host.tokensPerPage == gpu.tokensPerPage && host.tokenBytes == gpu.tokenBytes,
      kCall,
      "the host tier's geometry ({} layers, {} tokens per page, {} bytes per token) differs "
      "from the base pool's ({}, {}, {})",
      host.numLayers(), host.tokensPerPage, host.tokenBytes, gpu.numLayers(), gpu.tokensPerPage,
      gpu.tokenBytes);
}

/// The window cache of the composed backend: vanilla attention-only reuse, no host tier, the
/// base pool's page size.
void validateWindowCache(ContextCacheConfig const& config,
                         ContextCacheDeploymentProfile const& profile,
                         ContextCachePhysicalResources const& resources) {
  WindowBlockCache const* window = resources.windowCache;
  if (window == nullptr) {
    return;
  }
  MKV_REQUIRE(config.enabled, kCall, "resources.windowCache needs context reuse enabled");
  MKV_REQUIRE(profile.baseStateKind == BaseStateKind::kAttentionOnly && !profile.isSpeculative(),
              kCall,
              "resources.windowCache is supported on attention-only, non-speculative deployments "
              "only (this one is {}{})",
              profile.usesCheckpointReuse() ? (profile.hasAttention() ? "hybrid" : "pure recurrent")
                                            : "attention-only",
              profile.isSpeculative() ? ", speculative" : "");
  MKV_REQUIRE(resources.hostTier == nullptr, kCall,
              "resources.windowCache cannot be combined with resources.hostTier");
  // Checked first (before the base pool's own checks, which refuse a missing pool).
  MKV_REQUIRE(resources.basePool == nullptr ||
                  window->index().pageSize() == resources.basePool->tokensPerPage(),
              kCall, "resources.windowCache has pages of {} tokens but the base pool {}",
              window->index().pageSize(), resources.basePool->tokensPerPage());
}

}  // namespace

DeploymentLayout validateDeployment(ContextCacheConfig const& config,
                                    ContextCacheDeploymentProfile const& profile,
                                    ContextCachePhysicalResources const& resources) {
  validateWindowCache(config, profile, resources);
  validateProfile(config, profile, resources);
  DeploymentLayout layout;
  validateBase(profile, resources, layout);
  validateCompanions(profile, resources, layout);
  bool const hasKv = profile.hasAttention();
  layout.blockTokens = hasKv ? resources.basePool->tokensPerPage() : kPureRecurrentBlockTokens;
  layout.capacities.baseKvPages = hasKv ? resources.basePool->numPages() : 0;
  layout.capacities.draftKvPages =
      profile.ownsPagedSpecState() ? resources.draftPool->numPages() : 0;
  if (profile.usesCheckpointReuse()) {
    layOutSnapshots(config, profile, resources, layout);
  }
  validateHostTier(config, profile, resources);
  return layout;
}

}  // namespace mkv::detail
