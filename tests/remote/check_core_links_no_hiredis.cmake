# Fails when the core library (CORE) references or defines a hiredis symbol (redis*, freeReply*),
# and when the remote library (REMOTE) names none (the check would be vacuous).
# cmake -DNM=nm -DCORE=libmanagedkv.a -DREMOTE=libmanagedkv_remote.a -P this file
foreach(library CORE REMOTE)
  execute_process(COMMAND ${NM} ${${library}} OUTPUT_VARIABLE symbols RESULT_VARIABLE rc
                  ERROR_QUIET)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} ${${library}} failed (${rc})")
  endif()
  string(REGEX MATCHALL "[^\n]* (redis[A-Z][A-Za-z]*|freeReplyObject)\n" found "${symbols}\n")
  list(LENGTH found count)
  if(library STREQUAL "CORE" AND count GREATER 0)
    list(GET found 0 first)
    message(FATAL_ERROR "the core library names ${count} hiredis symbols, first: ${first}")
  elseif(library STREQUAL "REMOTE" AND count EQUAL 0)
    message(FATAL_ERROR "the remote library names no hiredis symbol: nothing was checked")
  endif()
  message(STATUS "${${library}}: ${count} hiredis symbols")
endforeach()
