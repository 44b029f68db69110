# ctest libferry_exports_no_serving_stack: libferry.so is what an inference engine links
# (fabric, KV, MoE); the serving stack (ferry::serve) is a library of its own above it. Fails
# when libferry.so defines a symbol of ferry::serve, or defines none of the layers it should.
#   cmake -DLIB=<libferry.so> -DNM=<nm> -P library_symbols_check.cmake
execute_process(COMMAND "${NM}" -D -C --defined-only "${LIB}" OUTPUT_VARIABLE syms
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D ${LIB} failed (${rc})")
endif()
string(REGEX MATCHALL "[^\n]*ferry::serve::[^\n]*" serve "${syms}")
list(LENGTH serve n)
if(n GREATER 0)
  list(SUBLIST serve 0 5 some)
  string(REPLACE ";" "\n  " some "${some}")
  message(FATAL_ERROR "libferry.so defines ${n} symbols of the serving stack, e.g.:\n  ${some}")
endif()
foreach(what "ferry::TransferEngine::" "ferry::kv::" "ferry::moe::")
  if(NOT syms MATCHES "${what}")
    message(FATAL_ERROR "libferry.so defines no symbol of ${what}")
  endif()
endforeach()
message(STATUS "libferry.so: fabric, kv and moe symbols, none of ferry::serve")
