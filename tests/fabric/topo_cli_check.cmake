# ctest topo_cli: `ferry topo` on the p5en fixture prints 16 rails and, for each of the 8
# GPUs, the 2 rails of its own PCIe switch; on this machine (no RDMA NIC) it says so plainly.
#   cmake -DFERRY=<ferry binary> -DFIXTURES=<tests/fabric/topology> -P topo_cli_check.cmake
execute_process(COMMAND "${FERRY}" topo --xml "${FIXTURES}/p5en.xml" --nics "${FIXTURES}/p5en.nics"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ferry topo on the p5en fixture failed (${rc}):\n${out}${err}")
endif()
set(missing "")
set(want "NICs: 16" "NUMA nodes: 2 (0, 1)" "rail 0 (device=rdmap20s0, provider=efa, pci=0000:14:00.0, numa=0)"
  "rail 15 (device=rdmap133s0, provider=efa, pci=0000:85:00.0, numa=1)"
  "NUMA node 0 host memory mapped to rails 0,1,2,3,4,5,6,7 (same NUMA node)")
foreach(g RANGE 7)
  math(EXPR a "2 * ${g}")
  math(EXPR b "2 * ${g} + 1")
  math(EXPR bus "16 * (${g} + 1) + 3")
  math(EXPR numa "${g} / 4")
  # CMake's math gives decimal; the bus is written in hex ("13", "23", ... "83").
  math(EXPR bus_hex "${bus}" OUTPUT_FORMAT HEXADECIMAL)
  string(SUBSTRING "${bus_hex}" 2 -1 bus_hex)
  list(APPEND want "GPU ${g} (pci=0000:${bus_hex}:00.0, numa=${numa}) mapped to rails ${a},${b} (same PCIe switch)")
endforeach()
foreach(line ${want})
  string(FIND "${out}" "${line}\n" at)
  if(at EQUAL -1)
    string(APPEND missing "\n  ${line}")
  endif()
endforeach()
string(REGEX MATCHALL "\nrail [0-9]+ \\(device=" rails "\n${out}")
list(LENGTH rails nrails)
if(missing OR NOT nrails EQUAL 16)
  message(FATAL_ERROR "ferry topo on the p5en fixture: ${nrails} rail lines (want 16); "
    "missing lines:${missing}\noutput:\n${out}${err}")
endif()

execute_process(COMMAND "${FERRY}" topo RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ferry topo on this machine failed (${rc}):\n${out}${err}")
endif()
if(NOT out MATCHES "\nno NIC: libfabric lists no efa or verbs device here" AND NOT out MATCHES "\nrail 0 \\(device=")
  message(FATAL_ERROR "ferry topo on this machine neither lists rails nor says there is no NIC:\n${out}${err}")
endif()
message(STATUS "ferry topo: p5en fixture maps each GPU to its switch's 2 rails")
