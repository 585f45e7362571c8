list(APPEND MKV_LIBRARY_SOURCES ${CMAKE_CURRENT_LIST_DIR}/kv_cache_runtime.cpp ${CMAKE_CURRENT_LIST_DIR}/managed_kv_cache_request.cpp ${CMAKE_CURRENT_LIST_DIR}/sliding_reuse_request.cpp)
