# The layers' rule, checked at every build (target ferry_layers, in the default build): a layer
# includes only its own headers and those of the layers below it. Public headers are
# "ferry/<layer>/...", internal ones "<layer>/..." (from src/), a bare name is the file's own
# folder. A file that includes a layer above its own fails the build here, naming the file,
# the include and the layers it may use.
#   cmake -DROOT=<repo> -P cmake/check_layers.cmake
#
# Layer -> the layers it may include (itself included). bench and cli sit on top and may use
# every layer; src/bench has a stricter rule of its own on internal headers
# (tests/bench/includes_check.cmake).
set(FERRY_LAYER_common common)
set(FERRY_LAYER_fabric common fabric)
set(FERRY_LAYER_kv common fabric kv)
set(FERRY_LAYER_moe common fabric moe)
set(FERRY_LAYER_serve common fabric kv moe serve)
set(FERRY_LAYER_bench common fabric kv moe serve bench)
set(FERRY_LAYER_cli common fabric kv moe serve bench cli)
set(FERRY_LAYERS common fabric kv moe serve bench cli)

set(bad "")
set(n 0)
foreach(layer ${FERRY_LAYERS})
  file(GLOB_RECURSE files "${ROOT}/src/${layer}/*.h" "${ROOT}/src/${layer}/*.cc"
    "${ROOT}/src/${layer}/*.cu" "${ROOT}/src/${layer}/*.cuh" "${ROOT}/include/ferry/${layer}/*.h")
  foreach(f ${files})
    math(EXPR n "${n} + 1")
    file(STRINGS "${f}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
    foreach(line ${lines})
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*" "\\1" inc "${line}")
      if(NOT inc MATCHES "/")
        continue()  # the file's own folder
      endif()
      string(REGEX REPLACE "^(ferry/)?([^/]+)/.*" "\\2" target "${inc}")
      list(FIND FERRY_LAYERS "${target}" known)
      if(known EQUAL -1)
        continue()  # not a layer's header (a third-party one in quotes)
      endif()
      list(FIND FERRY_LAYER_${layer} "${target}" ok)
      if(ok EQUAL -1)
        file(RELATIVE_PATH rel "${ROOT}" "${f}")
        string(REPLACE ";" ", " may "${FERRY_LAYER_${layer}}")
        string(APPEND bad "\n  ${rel}: #include \"${inc}\" (layer ${layer} may include: ${may})")
      endif()
    endforeach()
  endforeach()
endforeach()
if(bad)
  message(FATAL_ERROR "a layer includes a layer above it (docs/ARCHITECTURE.md, \"Layers and "
    "targets\"); move the code down or the call up:${bad}")
endif()
