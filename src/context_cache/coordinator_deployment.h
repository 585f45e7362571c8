#pragma once
/// \file coordinator_deployment.h
/// Deployment (profile) validation of ContextCacheCoordinator (not installed): the profile and
/// the physical resources are checked together, and what the coordinator derives from them
/// (rows, device, pool capacities, snapshot slots) is computed once, before anything is built.

#include <cstdint>

#include "context_cache/coordinator_validation.h"
#include "context_cache/resource_pools.h"
#include "mkv/context_cache/context_cache_coordinator.h"
#include "mkv/snapshot_storage.h"

namespace mkv::detail {

/// Block granularity of the digests of a pure-recurrent deployment (it has no pages; checkpoints
/// are keyed by exact prefix digests chained over blocks of this many tokens).
inline constexpr int32_t kPureRecurrentBlockTokens = 128;

/// What a validated deployment gives the coordinator.
struct DeploymentLayout {
  int32_t maxBatch = 0;                  ///< resident rows (base table rows, or recurrent slots)
  DeviceType device = DeviceType::kCPU;  ///< where every pool and table lives
  int32_t blockTokens = 0;               ///< page size, or kPureRecurrentBlockTokens
  ResourceDemand capacities;             ///< slots of the manager's four typed pools
  bool checkpoints = false;              ///< recurrent layers: snapshots, checkpoint reuse
  SnapshotStorageConfig snapshots;       ///< checkpoint deployments only (else zero slots)
  KVCachePool* snapshotDraftPool = nullptr;  ///< Hybrid-MTP: the draft pool of endpoint pages
  AdmissionLimits limits;                    ///< the deployment's shape for admission's checks
};

/// Throws mkv::Error (named "ContextCacheCoordinator") for an invalid configuration, a profile
/// that contradicts itself (see ContextCacheDeploymentProfile) or resources that do not fit it:
/// missing or extra pools and tables, tables that are not dense or address another pool, pools
/// on different devices, fewer rows than the base table, draft pages of another size, snapshot
/// budgets that hold no slot (reuse enabled) or more than int32 slots, a window cache beside
/// anything but vanilla attention-only reuse without a host tier, or of another page size.
DeploymentLayout validateDeployment(ContextCacheConfig const& config,
                                    ContextCacheDeploymentProfile const& profile,
                                    ContextCachePhysicalResources const& resources);

}  // namespace mkv::detail
