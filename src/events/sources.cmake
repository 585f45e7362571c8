list(APPEND MKV_EVENTS_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/batch_queue.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_event_publisher.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kv_event_wire.cpp
)
