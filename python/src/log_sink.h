// ferry._ferry's log routing (python/src/log_sink.cc): the library's log lines go to a queue
// that ferry's Python side empties into the logging module (ferry/_log.py).
#pragma once

#include <pybind11/pybind11.h>

namespace ferry::python {

void register_log(pybind11::module_& m);

}  // namespace ferry::python
