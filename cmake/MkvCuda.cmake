# Resolves MKV_ENABLE_CUDA (AUTO|ON|OFF) into MKV_WITH_CUDA and enables the CUDA language.
include(CheckLanguage)
set(MKV_WITH_CUDA OFF)
string(TOUPPER "${MKV_ENABLE_CUDA}" _mkv_cuda_mode)
if(_mkv_cuda_mode STREQUAL "ON" OR _mkv_cuda_mode STREQUAL "AUTO")
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(MKV_WITH_CUDA ON)
  elseif(_mkv_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "MKV_ENABLE_CUDA=ON but no CUDA compiler was found (set CUDACXX)")
  endif()
elseif(NOT _mkv_cuda_mode STREQUAL "OFF")
  message(FATAL_ERROR "MKV_ENABLE_CUDA must be AUTO, ON or OFF, not '${MKV_ENABLE_CUDA}'")
endif()

if(MKV_WITH_CUDA)
  # Hopper (H100/H200, sm_90) unless the caller names other architectures.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
    set(CMAKE_CUDA_ARCHITECTURES 90)
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
  else()
    # CMake < 3.26 does not know nvcc's C++20 flag (and rejects CUDA_STANDARD 20).
    add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
  endif()
  # The runtime comes from MKV_CUDART through managedkv only, never implicitly per target.
  set(CMAKE_CUDA_RUNTIME_LIBRARY None)
  if(MKV_STATIC_RUNTIME)
    set(MKV_CUDART CUDA::cudart_static)
  else()
    set(MKV_CUDART CUDA::cudart)
  endif()
endif()
message(STATUS "managedkv: CUDA kernels ${MKV_WITH_CUDA} (architectures: ${CMAKE_CUDA_ARCHITECTURES})")

# mkv_link_static_runtime(target): under MKV_STATIC_RUNTIME an executable also links libstdc++
# and libgcc statically, so a binary built here runs unchanged on the GPU test machine
# (docs/benchmarks.md). The library already links CUDA::cudart_static and header-only fmt.
function(mkv_link_static_runtime target)
  if(MKV_STATIC_RUNTIME)
    target_link_options(${target} PRIVATE -static-libstdc++ -static-libgcc)
  endif()
endfunction()
