# Fails when the core library (CORE) references or defines a ZeroMQ (zmq_*) or msgpack symbol,
# and when the events library (EVENTS) holds none of either (the check would be vacuous).
# cmake -DNM=nm -DCORE=libmanagedkv.a -DEVENTS=libmanagedkv_events.a -P this file
foreach(library CORE EVENTS)
  execute_process(COMMAND ${NM} -C ${${library}} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc
                  ERROR_QUIET)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} -C ${${library}} failed (${rc})")
  endif()
  string(REGEX MATCHALL "[^\n]*(zmq_|msgpack::)[^\n]*" found "${symbols}")
  list(LENGTH found count)
  if(library STREQUAL "CORE" AND count GREATER 0)
    list(GET found 0 first)
    message(FATAL_ERROR "the core library names ${count} ZeroMQ/msgpack symbols, first: ${first}")
  elseif(library STREQUAL "EVENTS" AND count EQUAL 0)
    message(FATAL_ERROR "the events library names no ZeroMQ/msgpack symbol: nothing was checked")
  endif()
  message(STATUS "${${library}}: ${count} ZeroMQ/msgpack symbols")
endforeach()
