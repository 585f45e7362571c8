list(APPEND MKV_LIBRARY_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/block_hash.cpp
  ${CMAKE_CURRENT_LIST_DIR}/block_index.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cache_record.cpp
  ${CMAKE_CURRENT_LIST_DIR}/cache_request_lease.cpp
  ${CMAKE_CURRENT_LIST_DIR}/context_cache_coordinator.cpp
  ${CMAKE_CURRENT_LIST_DIR}/context_cache_manager.cpp
  ${CMAKE_CURRENT_LIST_DIR}/context_cache_request.cpp
  ${CMAKE_CURRENT_LIST_DIR}/context_cache_metrics.cpp
  ${CMAKE_CURRENT_LIST_DIR}/eviction_planner.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_event_queue.cpp
  ${CMAKE_CURRENT_LIST_DIR}/recent_digest_set.cpp
  ${CMAKE_CURRENT_LIST_DIR}/record_store.cpp
  ${CMAKE_CURRENT_LIST_DIR}/resource_pools.cpp
  ${CMAKE_CURRENT_LIST_DIR}/reuse_plan.cpp
)
