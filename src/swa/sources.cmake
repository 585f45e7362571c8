list(APPEND MKV_LIBRARY_SOURCES ${CMAKE_CURRENT_LIST_DIR}/bounded_swa_kv_page_manager.cpp
            ${CMAKE_CURRENT_LIST_DIR}/bounded_swa_cached_mode.cpp
            ${CMAKE_CURRENT_LIST_DIR}/bounded_swa_inflight_admission.cpp
            ${CMAKE_CURRENT_LIST_DIR}/bounded_swa_request.cpp)
