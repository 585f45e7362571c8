# Installs BUILD_DIR into WORK_DIR/prefix, then configures, builds and runs the consumer project
# CONSUMER_DIR against that prefix alone. Any failing step fails the test with its output.
# Usage (see tests/package/CMakeLists.txt): cmake -DBUILD_DIR=... -DCONFIG=... -DWORK_DIR=...
#   -DCONSUMER_DIR=... -DGENERATOR=... -DMAKE_PROGRAM=... -DCXX_COMPILER=... -DCXX_FLAGS=...
#   -DLINKER_FLAGS=... -DCUDA_ROOT=... -DEXPECT_TESTING=0|1 -P check_consumer.cmake
set(prefix ${WORK_DIR}/prefix)
set(build ${WORK_DIR}/build)
file(REMOVE_RECURSE ${WORK_DIR})

function(run_step name)
  string(TIMESTAMP started "%s")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(TIMESTAMP finished "%s")
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " command "${ARGN}")
    message(FATAL_ERROR "${name} failed (${rc}): ${command}\n${out}")
  endif()
  math(EXPR seconds "${finished} - ${started}")
  message(STATUS "${name}: ok (${seconds} s)")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

set(build_type_args)
set(config_args)
if(CONFIG)
  set(build_type_args -DCMAKE_BUILD_TYPE=${CONFIG})
  set(config_args --config ${CONFIG})
endif()
set(cuda_args)
if(CUDA_ROOT)
  set(cuda_args -DCUDAToolkit_ROOT=${CUDA_ROOT})
endif()

run_step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix} ${config_args})

# The exported targets as a consumer reads them: each include directory once, no empty
# $<LINK_ONLY:> entry (what a build-only dependency leaves behind when exported carelessly).
file(GLOB_RECURSE exports ${prefix}/managedkvTargets.cmake)
list(LENGTH exports found)
if(NOT found EQUAL 1)
  message(FATAL_ERROR "expected one installed managedkvTargets.cmake, found: ${exports}")
endif()
file(READ ${exports} exported)
string(FIND "${exported}" "LINK_ONLY:>" empty_link_only)
if(NOT empty_link_only EQUAL -1)
  message(FATAL_ERROR "${exports} carries an empty $<LINK_ONLY:> entry")
endif()
# Semicolons separate list items in CMake: hide them while splitting the file into properties.
string(REPLACE ";" "<semicolon>" exported "${exported}")
string(REGEX MATCHALL "INTERFACE_INCLUDE_DIRECTORIES \"[^\"]*\"" include_lists "${exported}")
foreach(entry IN LISTS include_lists)
  string(REGEX REPLACE "^INTERFACE_INCLUDE_DIRECTORIES \"(.*)\"$" "\\1" dirs "${entry}")
  string(REPLACE "<semicolon>" ";" dirs "${dirs}")
  set(unique ${dirs})
  list(REMOVE_DUPLICATES unique)
  if(NOT dirs STREQUAL unique)
    message(FATAL_ERROR "${exports} lists an include directory twice: ${dirs}")
  endif()
endforeach()
message(STATUS "exported targets: no empty LINK_ONLY entry, no repeated include directory")
run_step("configure" ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${build} -G ${GENERATOR}
         -DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM} -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
         ${build_type_args} "-DCMAKE_CXX_FLAGS=${CXX_FLAGS}"
         "-DCMAKE_EXE_LINKER_FLAGS=${LINKER_FLAGS}" -DCMAKE_PREFIX_PATH=${prefix}
         -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF ${cuda_args}
         -DMKV_EXPECT_TESTING=${EXPECT_TESTING} -DMKV_EXPECTED_PREFIX=${prefix})
run_step("build" ${CMAKE_COMMAND} --build ${build} ${config_args})

set(consumer ${build}/managedkv_consumer)
if(NOT EXISTS ${consumer})
  set(consumer ${build}/${CONFIG}/managedkv_consumer)  # multi-config generators
endif()
run_step("run" ${consumer})
message(STATUS "${step_output}")
