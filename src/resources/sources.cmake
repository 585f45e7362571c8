list(APPEND MKV_LIBRARY_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/attention_views.cpp
  ${CMAKE_CURRENT_LIST_DIR}/backend_requests.cpp
  ${CMAKE_CURRENT_LIST_DIR}/device_write_queue.cpp
  ${CMAKE_CURRENT_LIST_DIR}/host_kv_tier.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_cache_pool.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_page_table.cpp
  ${CMAKE_CURRENT_LIST_DIR}/recurrent_state_pool.cpp
  ${CMAKE_CURRENT_LIST_DIR}/resident_slot_pool.cpp
  ${CMAKE_CURRENT_LIST_DIR}/shared_synchronizer.cpp
  ${CMAKE_CURRENT_LIST_DIR}/snapshot_storage.cpp
)
