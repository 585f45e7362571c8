# Launchers and host reference twins always build; the CUDA implementations only with CUDA.
list(APPEND MKV_LIBRARY_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/launchers.cpp
  ${CMAKE_CURRENT_LIST_DIR}/host_reference.cpp
  ${CMAKE_CURRENT_LIST_DIR}/inline_patch_batch.cpp
  ${CMAKE_CURRENT_LIST_DIR}/patch_ring.cpp
)
if(MKV_WITH_CUDA)
  list(APPEND MKV_LIBRARY_SOURCES
    ${CMAKE_CURRENT_LIST_DIR}/copy_pages.cu
    ${CMAKE_CURRENT_LIST_DIR}/compact_batch.cu
    ${CMAKE_CURRENT_LIST_DIR}/copy_rows.cu
    ${CMAKE_CURRENT_LIST_DIR}/zero_rows.cu
    ${CMAKE_CURRENT_LIST_DIR}/int32_patch.cu
    ${CMAKE_CURRENT_LIST_DIR}/attention_views.cu
  )
endif()
