# ctest bench_uses_public_api: the benchmarks (src/bench/) are users of the library, so they
# include the public headers (ferry/...), their own (bench/...), the serving stack's (serve/...,
# a library above libferry like them), and only the internal headers
# docs/ARCHITECTURE.md ("Benchmarks") names, each for a stated reason. A new internal include
# fails here until it is justified there and listed below.
#   cmake -DSRC=<repo>/src -P includes_check.cmake
set(allowed "fabric/provider.h" "common/cuda_check.h")
file(GLOB_RECURSE files "${SRC}/bench/*.h" "${SRC}/bench/*.cc" "${SRC}/bench/*.cu")
set(bad "")
foreach(f ${files})
  file(STRINGS "${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
  foreach(line ${lines})
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" inc "${line}")
    if(inc MATCHES "^(ferry|bench|serve)/")
      continue()
    endif()
    list(FIND allowed "${inc}" at)
    if(at EQUAL -1)
      file(RELATIVE_PATH rel "${SRC}/.." "${f}")
      string(APPEND bad "\n  ${rel}: #include \"${inc}\"")
    endif()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "src/bench/ includes internal headers that docs/ARCHITECTURE.md "
    "(\"Benchmarks\") does not name; use the public API (include/ferry/) or justify the header "
    "there and add it to tests/bench/includes_check.cmake:${bad}")
endif()
list(LENGTH files n)
message(STATUS "src/bench/: ${n} files include only public headers and the named internal ones")
