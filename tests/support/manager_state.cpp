#include "support/manager_state.h"

namespace mkv::test {

ManagerState captureState(ContextCacheManager const& manager) {
  ManagerState s;
  ResourcePools const& pools = manager.pools();
  for (ResourceType type : kAllResourceTypes) {
    std::vector<int32_t> active;
    std::vector<int32_t> cache;
    for (int32_t i = 0; i < pools.capacity(type); ++i) {
      active.push_back(pools.activeRefs({type, i}));
      cache.push_back(pools.cacheRefs({type, i}));
    }
    s.active.push_back(active);
    s.cache.push_back(cache);
    s.freeLists.push_back(pools.freeList(type));
  }
  for (int32_t page = 0; page < pools.capacity(ResourceType::kBaseKvPage); ++page) {
    s.indexDigests.push_back(manager.index().digestOf(page));
  }
  for (CacheRecord const& record : manager.records().lruToMru()) {
    s.lruOrder.push_back(record.id);
    s.recordPriorities.push_back(record.retentionPriority);
    s.recordBasePaths.push_back(record.basePagePath);
    s.recordDraftPaths.push_back(record.specState ? record.specState->draftPagePath
                                                  : std::vector<PageId>{});
  }
  s.victimOrder = manager.records().victimOrder();
  s.indexSize = manager.index().size();
  return s;
}

}  // namespace mkv::test
