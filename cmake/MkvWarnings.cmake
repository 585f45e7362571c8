# Warning flags for host code, applied per target through mkv_set_warnings().
function(mkv_set_warnings target)
  set(flags -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast
            -Wcast-align -Wunused -Woverloaded-virtual -Wconversion -Wsign-conversion
            -Wnull-dereference -Wdouble-promotion -Wformat=2 -Wimplicit-fallthrough)
  if(MKV_WARNINGS_AS_ERRORS)
    list(APPEND flags -Werror)
  endif()
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${flags}>)
  # GCC's -Wrestrict misfires on libstdc++'s own std::string assignment and concatenation once
  # -O3 inlines them (GCC bug 105329: "accessing 9223372036854775810 or more bytes"); it has
  # never flagged project code, so it is off for GCC rather than worked around call by call.
  target_compile_options(${target} PRIVATE $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-restrict>)
endfunction()

# Sanitizers apply to every target of the build when MKV_SANITIZE is on. The flags are also kept
# in MKV_SANITIZER_COMPILE_FLAGS / MKV_SANITIZER_LINK_FLAGS: code built outside this project
# against the installed library (tests/package) must use them too.
set(MKV_SANITIZER_COMPILE_FLAGS)
set(MKV_SANITIZER_LINK_FLAGS)
if(MKV_SANITIZE)
  set(MKV_SANITIZER_COMPILE_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer
                                  -fno-sanitize-recover=undefined)
  set(MKV_SANITIZER_LINK_FLAGS -fsanitize=address,undefined)
endif()

# libFuzzer builds (-DMKV_BUILD_FUZZERS=ON, clang only; the "fuzz" preset): every target is
# instrumented for coverage and sanitised (ASan + UBSan); only the fuzzer executables link libFuzzer
# itself (tests/fuzz/CMakeLists.txt).
if(MKV_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "MKV_BUILD_FUZZERS needs clang (libFuzzer); the compiler is "
                        "${CMAKE_CXX_COMPILER_ID}. Use the \"fuzz\" preset.")
  endif()
  set(MKV_SANITIZER_COMPILE_FLAGS -fsanitize=fuzzer-no-link,address,undefined
                                  -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  set(MKV_SANITIZER_LINK_FLAGS -fsanitize=address,undefined)
endif()
if(MKV_SANITIZER_COMPILE_FLAGS)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${MKV_SANITIZER_COMPILE_FLAGS}>")
  add_link_options(${MKV_SANITIZER_LINK_FLAGS})
endif()
