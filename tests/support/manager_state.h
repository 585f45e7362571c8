#pragma once
/// \file manager_state.h
/// Every observable piece of a ContextCacheManager's state, comparable with ==: what a rejected
/// or rolled-back call must leave exactly as it was (the manager suites, and the coordinator's
/// part of BackendSnapshot).

#include <cstdint>
#include <optional>
#include <vector>

#include "context_cache/context_cache_manager.h"

namespace mkv::test {

struct ManagerState {
  std::vector<std::vector<int32_t>> active;     ///< active references, per resource type and id
  std::vector<std::vector<int32_t>> cache;      ///< cache references, per resource type and id
  std::vector<std::vector<int32_t>> freeLists;  ///< free rings in order, per resource type
  std::vector<std::optional<Hash128>> indexDigests;  ///< per base page
  std::vector<RecordId> lruOrder;
  std::vector<RecordId> victimOrder;      ///< RecordStore::victimOrder (priority, then the policy)
  std::vector<int32_t> recordPriorities;  ///< in lruOrder
  std::vector<std::vector<PageId>> recordBasePaths;
  std::vector<std::vector<PageId>> recordDraftPaths;
  int32_t indexSize = 0;
  friend bool operator==(ManagerState const&, ManagerState const&) = default;
};

ManagerState captureState(ContextCacheManager const& manager);

}  // namespace mkv::test
