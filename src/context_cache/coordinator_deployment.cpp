#include "context_cache/coordinator_deployment.h"

#include <limits>
#include <optional>

#include "context_cache/window_block_cache.h"
#include "core/check.h"
#include "mkv/host_kv_tier.h"

namespace mkv::detail {
namespace {

constexpr char const* kCall = "ContextCacheCoordinator";

/// The kinds of deployment a profile describes. Each has its own requirements (one function
/// each, below) and its own request modes (makeRequestModes).
enum class DeploymentKind : uint8_t {
  kAttention,             ///< attention-only
  kSpeculativeAttention,  ///< attention-only with a draft (EAGLE / MTP, or a shared-KV draft)
  kHybrid,                ///< attention + recurrent layers
  kHybridMtp,             ///< hybrid with an own-KV draft (Hybrid-MTP)
  kPureRecurrent,         ///< recurrent layers only
};

char const* describe(DeploymentKind kind) {
  switch (kind) {
    case DeploymentKind::kAttention:
      return "attention-only";
    case DeploymentKind::kSpeculativeAttention:
      return "attention-only, speculative";
    case DeploymentKind::kHybrid:
      return "hybrid";
    case DeploymentKind::kHybridMtp:
      return "hybrid, speculative";
    case DeploymentKind::kPureRecurrent:
      return "pure recurrent";
  }
  return "unknown";
}

/// The configuration on its own.
void validateConfig(ContextCacheConfig const& config) {
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
  MKV_REQUIRE(config.checkpointInterval >= 0, kCall, "checkpointInterval must be >= 0, got {}",
              config.checkpointInterval);
  MKV_REQUIRE(config.reusePointAdmission == ReusePointAdmission::kEveryInterval ||
                  config.reusePointAdmission == ReusePointAdmission::kBranchFirst,
              kCall, "reusePointAdmission {} out of range",
              static_cast<int>(config.reusePointAdmission));
  MKV_REQUIRE(config.joinerPages == JoinerPageAllocation::kWholePrompt ||
                  config.joinerPages == JoinerPageAllocation::kPerChunk,
              kCall, "joinerPages {} out of range", static_cast<int>(config.joinerPages));
}

/// The Hybrid-MTP boundary hidden row: described by a Hybrid-MTP profile only.
void validateBoundaryHidden(ContextCacheDeploymentProfile const& profile, bool hybridMtp) {
  if (!hybridMtp) {
    MKV_REQUIRE(profile.boundaryHiddenWidth == 0, kCall,
                "boundaryHiddenWidth {} is for Hybrid-MTP deployments only",
                profile.boundaryHiddenWidth);
    return;
  }
  MKV_REQUIRE(profile.speculative->pagedSpecState, kCall,
              "a Hybrid-MTP deployment needs an own-KV draft: the speculative contract must be "
              "paged");
  MKV_REQUIRE(profile.boundaryHiddenWidth > 0, kCall,
              "a Hybrid-MTP deployment needs boundaryHiddenWidth > 0, got {}",
              profile.boundaryHiddenWidth);
  MKV_REQUIRE(dataTypeSize(profile.boundaryHiddenType) > 0, kCall,
              "boundaryHiddenType {} out of range", static_cast<int>(profile.boundaryHiddenType));
}

/// The profile on its own: its kind, or a throw where it contradicts itself.
DeploymentKind kindOf(ContextCacheDeploymentProfile const& profile) {
  MKV_REQUIRE(
      static_cast<uint8_t>(profile.baseStateKind) <= static_cast<uint8_t>(BaseStateKind::kHybrid),
      kCall, "base state kind {} out of range", static_cast<int>(profile.baseStateKind));
  std::optional<SpecReuseContract> const& draft = profile.speculative;
  MKV_REQUIRE(!draft || draft->futureDependencyTokens >= 0, kCall,
              "speculative futureDependencyTokens must be >= 0, got {}",
              draft ? draft->futureDependencyTokens : 0);
  DeploymentKind kind = DeploymentKind::kPureRecurrent;
  switch (profile.baseStateKind) {
    case BaseStateKind::kAttentionOnly:
      kind = draft ? DeploymentKind::kSpeculativeAttention : DeploymentKind::kAttention;
      break;
    case BaseStateKind::kHybrid:
      kind = draft ? DeploymentKind::kHybridMtp : DeploymentKind::kHybrid;
      break;
    case BaseStateKind::kPureRecurrent:
      MKV_REQUIRE(!draft, kCall,
                  "a pure-recurrent deployment cannot be speculative (no KV for a draft to pair "
                  "with)");
      break;
  }
  validateBoundaryHidden(profile, kind == DeploymentKind::kHybridMtp);
  return kind;
}

// ---------------------------------------------------------------- the resources of each kind

/// The base KV (pool and dense table); sets the layout's rows and device.
void requireBase(ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
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
  layout.blockTokens = pool.tokensPerPage();
  layout.capacities.baseKvPages = pool.numPages();
  layout.limits.hasKv = true;
  layout.limits.baseRowPages = table.maxPagesPerSeq();
}

/// No draft KV: a non-speculative deployment, or a draft that shares the base KV.
void forbidDraft(ContextCachePhysicalResources const& resources, char const* deployment) {
  MKV_REQUIRE(resources.draftPool == nullptr && resources.draftPageTable == nullptr, kCall,
              "draft resources given to a {}", deployment);
}

/// The draft KV of an own-KV draft, against the base's page size, rows and device.
void requireDraft(ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
  MKV_REQUIRE(resources.draftPool != nullptr && resources.draftPageTable != nullptr, kCall,
              "a paged speculative deployment needs draftPool and draftPageTable");
  KVCachePool const& draft = *resources.draftPool;
  KVPageTable const& table = *resources.draftPageTable;
  int32_t const maxBatch = layout.maxBatch;
  DeviceType const device = layout.device;
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
  layout.capacities.draftKvPages = draft.numPages();
  layout.limits.pagedDraft = true;
  layout.limits.draftRowPages = table.maxPagesPerSeq();
}

/// The recurrent pool's presence for a kind with recurrent layers (before its rows are known).
void requireRecurrent(ContextCachePhysicalResources const& resources, DeploymentKind kind) {
  MKV_REQUIRE(resources.recurrent != nullptr, kCall,
              "a {} deployment needs the recurrent state pool",
              kind == DeploymentKind::kPureRecurrent ? "pure-recurrent" : "hybrid");
}

/// A recurrent pool (required, or given beside attention-only KV to have its dropped rows
/// zeroed at compaction) covers the rows, on the device.
void checkRecurrentRows(ContextCachePhysicalResources const& resources,
                        DeploymentLayout const& layout) {
  RecurrentStatePool const* recurrent = resources.recurrent;
  if (recurrent == nullptr) {
    return;
  }
  MKV_REQUIRE(recurrent->numSlots() >= layout.maxBatch, kCall,
              "recurrent pool has {} slots but the table has {} rows", recurrent->numSlots(),
              layout.maxBatch);
  MKV_REQUIRE(recurrent->deviceType() == layout.device, kCall, "recurrent pool on {} but KV on {}",
              toString(recurrent->deviceType()), toString(layout.device));
}

/// Reuse points: refused where full attention reuses every page boundary already.
void forbidInterval(ContextCacheConfig const& config) {
  MKV_REQUIRE(config.checkpointInterval == 0, kCall,
              "checkpointInterval {} is for hybrid, pure-recurrent and sliding-window reuse "
              "deployments: full attention reuses every page boundary already",
              config.checkpointInterval);
}

/// Reuse points with attention keep no partial page: the interval is a multiple of the page.
void requireIntervalInPages(ContextCacheConfig const& config, int32_t pageSize) {
  MKV_REQUIRE(config.checkpointInterval % pageSize == 0, kCall,
              "checkpointInterval {} is not a multiple of the page size {}: a reuse point keeps "
              "no partial page",
              config.checkpointInterval, pageSize);
}

/// Snapshot slots of a checkpoint deployment, from the byte budgets: a recurrent slot per
/// checkpoint (with the boundary hidden row on Hybrid-MTP) and, with attention, a partial-page
/// slot (with the draft's page on Hybrid-MTP).
void layOutSnapshots(ContextCacheConfig const& config, ContextCacheDeploymentProfile const& profile,
                     ContextCachePhysicalResources const& resources, DeploymentKind kind,
                     DeploymentLayout& layout) {
  auto slotsOf = [&](int64_t budget, int64_t bytesPerSlot, char const* field) {
    int64_t const slots = budget / bytesPerSlot;
    MKV_REQUIRE(slots <= std::numeric_limits<int32_t>::max(), kCall,
                "{} {} gives {} slots, more than int32 holds", field, budget, slots);
    MKV_REQUIRE(!config.enabled || slots >= 1, kCall, "{} {} holds no snapshot slot of {} bytes",
                field, budget, bytesPerSlot);
    return static_cast<int32_t>(slots);
  };
  SnapshotStorageConfig& snapshots = layout.snapshots;
  int64_t recurrentBytes = SnapshotStorage::recurrentBytesPerSlot(*resources.recurrent);
  int64_t partialBytes = 0;
  switch (kind) {
    case DeploymentKind::kHybridMtp:
      layout.snapshotDraftPool = resources.draftPool;
      snapshots.boundaryHiddenWidth = profile.boundaryHiddenWidth;
      snapshots.boundaryHiddenType = profile.boundaryHiddenType;
      recurrentBytes += SnapshotStorage::boundaryHiddenBytesPerSlot(profile.boundaryHiddenWidth,
                                                                    profile.boundaryHiddenType);
      partialBytes = SnapshotStorage::partialKvBytesPerSlot(*resources.basePool) +
                     SnapshotStorage::partialKvBytesPerSlot(*resources.draftPool);
      break;
    case DeploymentKind::kHybrid:
      partialBytes = SnapshotStorage::partialKvBytesPerSlot(*resources.basePool);
      break;
    default:  // pure recurrent: no pages
      break;
  }
  snapshots.recurrentSlots =
      slotsOf(config.recurrentSnapshotPoolBytes, recurrentBytes, "recurrentSnapshotPoolBytes");
  if (partialBytes > 0) {
    snapshots.partialKvSlots =
        slotsOf(config.partialKvSnapshotPoolBytes, partialBytes, "partialKvSnapshotPoolBytes");
  }
  layout.checkpoints = true;
  layout.capacities.recurrentSnapshotSlots = snapshots.recurrentSlots;
  layout.capacities.partialKvSnapshotSlots = snapshots.partialKvSlots;
}

/// The host tier: attention-only, non-speculative reuse, on the base pool's device and geometry.
void validateHostTier(ContextCacheConfig const& config, DeploymentKind kind,
                      ContextCachePhysicalResources const& resources) {
  HostKvTier const* tier = resources.hostTier;
  MKV_REQUIRE(!config.remoteTier || tier != nullptr, kCall,
              "a remote tier loads into and saves from the host tier: resources.hostTier is "
              "null");
  if (tier == nullptr) {
    return;
  }
  MKV_REQUIRE(config.enabled, kCall, "a host tier needs context reuse enabled");
  MKV_REQUIRE(kind == DeploymentKind::kAttention, kCall,
              "a host tier is supported on attention-only, non-speculative deployments only "
              "(this one is {})",
              describe(kind));
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
void validateWindowCache(ContextCacheConfig const& config, DeploymentKind kind,
                         ContextCachePhysicalResources const& resources) {
  WindowBlockCache const* window = resources.windowCache;
  if (window == nullptr) {
    return;
  }
  MKV_REQUIRE(config.enabled, kCall, "resources.windowCache needs context reuse enabled");
  MKV_REQUIRE(kind == DeploymentKind::kAttention, kCall,
              "resources.windowCache is supported on attention-only, non-speculative deployments "
              "only (this one is {})",
              describe(kind));
  MKV_REQUIRE(resources.hostTier == nullptr, kCall,
              "resources.windowCache cannot be combined with resources.hostTier");
  // Checked first (before the base pool's own checks, which refuse a missing pool).
  MKV_REQUIRE(resources.basePool == nullptr ||
                  window->index().pageSize() == resources.basePool->tokensPerPage(),
              kCall, "resources.windowCache has pages of {} tokens but the base pool {}",
              window->index().pageSize(), resources.basePool->tokensPerPage());
}

// ---------------------------------------------------------------- one function per kind

void layOutAttention(ContextCacheConfig const& config,
                     ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
  forbidDraft(resources, "non-speculative deployment");
  requireBase(resources, layout);
  if (resources.windowCache == nullptr) {
    forbidInterval(config);
  }
  requireIntervalInPages(config, layout.blockTokens);
  checkRecurrentRows(resources, layout);
}

void layOutSpeculativeAttention(ContextCacheConfig const& config,
                                ContextCacheDeploymentProfile const& profile,
                                ContextCachePhysicalResources const& resources,
                                DeploymentLayout& layout) {
  forbidInterval(config);
  requireBase(resources, layout);
  checkRecurrentRows(resources, layout);
  if (profile.speculative->pagedSpecState) {
    requireDraft(resources, layout);
  } else {
    forbidDraft(resources, "speculative deployment whose draft has no paged KV");
  }
}

/// What hybrid kinds share: the recurrent pool and the base KV.
void requireHybridState(ContextCacheConfig const& config,
                        ContextCachePhysicalResources const& resources, DeploymentKind kind,
                        DeploymentLayout& layout) {
  requireRecurrent(resources, kind);
  requireBase(resources, layout);
  requireIntervalInPages(config, layout.blockTokens);
  checkRecurrentRows(resources, layout);
}

void layOutHybrid(ContextCacheConfig const& config, ContextCacheDeploymentProfile const& profile,
                  ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
  forbidDraft(resources, "non-speculative deployment");
  requireHybridState(config, resources, DeploymentKind::kHybrid, layout);
  layOutSnapshots(config, profile, resources, DeploymentKind::kHybrid, layout);
}

void layOutHybridMtp(ContextCacheConfig const& config, ContextCacheDeploymentProfile const& profile,
                     ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
  requireHybridState(config, resources, DeploymentKind::kHybridMtp, layout);
  requireDraft(resources, layout);
  layOutSnapshots(config, profile, resources, DeploymentKind::kHybridMtp, layout);
}

void layOutPureRecurrent(ContextCacheConfig const& config,
                         ContextCacheDeploymentProfile const& profile,
                         ContextCachePhysicalResources const& resources, DeploymentLayout& layout) {
  forbidDraft(resources, "non-speculative deployment");
  requireRecurrent(resources, DeploymentKind::kPureRecurrent);
  MKV_REQUIRE(resources.basePool == nullptr && resources.basePageTable == nullptr, kCall,
              "a pure-recurrent deployment has no KV: basePool and basePageTable must be null");
  layout.maxBatch = resources.recurrent->numSlots();
  layout.device = resources.recurrent->deviceType();
  layout.blockTokens = kPureRecurrentBlockTokens;
  layOutSnapshots(config, profile, resources, DeploymentKind::kPureRecurrent, layout);
}

}  // namespace

DeploymentLayout validateDeployment(ContextCacheConfig const& config,
                                    ContextCacheDeploymentProfile const& profile,
                                    ContextCachePhysicalResources const& resources) {
  validateConfig(config);
  DeploymentKind const kind = kindOf(profile);
  validateWindowCache(config, kind, resources);
  DeploymentLayout layout;
  switch (kind) {
    case DeploymentKind::kAttention:
      layOutAttention(config, resources, layout);
      break;
    case DeploymentKind::kSpeculativeAttention:
      layOutSpeculativeAttention(config, profile, resources, layout);
      break;
    case DeploymentKind::kHybrid:
      layOutHybrid(config, profile, resources, layout);
      break;
    case DeploymentKind::kHybridMtp:
      layOutHybridMtp(config, profile, resources, layout);
      break;
    case DeploymentKind::kPureRecurrent:
      layOutPureRecurrent(config, profile, resources, layout);
      break;
  }
  validateHostTier(config, kind, resources);
  layout.limits.maxBatch = layout.maxBatch;
  layout.limits.pageSize = layout.blockTokens;
  layout.limits.speculativeDeployment = profile.speculative.has_value();
  layout.limits.hybridMtpDeployment = kind == DeploymentKind::kHybridMtp;
  return layout;
}

}  // namespace mkv::detail
