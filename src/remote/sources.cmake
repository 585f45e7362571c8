list(APPEND MKV_REMOTE_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/directory_kv_store.cpp
  ${CMAKE_CURRENT_LIST_DIR}/open_remote_kv_store.cpp
  ${CMAKE_CURRENT_LIST_DIR}/redis_kv_store.cpp
)
