# ctest xfer_rails_cli: `ferry bench xfer --rails 2` reports the bytes each rail carried, and a
# striped 1 MiB+ write puts bytes on both (one region on every rail over tcp).
#   cmake -DFERRY=<ferry binary> -P xfer_rails_check.cmake
execute_process(COMMAND "${FERRY}" bench xfer --provider tcp --rails 2 --sizes 4194304
  --pages 65536 --seconds 0.1 --latency-iters 0
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ferry bench xfer --rails 2 failed (${rc}):\n${out}${err}")
endif()
string(REGEX MATCH "engine bytes per rail: ([0-9]+), ([0-9]+)\n" line "${out}")
if(NOT line OR CMAKE_MATCH_1 EQUAL 0 OR CMAKE_MATCH_2 EQUAL 0)
  message(FATAL_ERROR "expected bytes on both rails in a line 'engine bytes per rail: A, B':\n${out}")
endif()
