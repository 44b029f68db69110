// ferry._ferry's KV-cache side (python/src/kv.cc): KvLayout, the KV connector over a pool of
// registered regions, and the handshake side channel; the C++ side of ferry.kv.
#pragma once

#include <pybind11/pybind11.h>

#include "convert.h"

namespace ferry::python {

void register_kv(pybind11::module_& m, EngineShare engine_share);

}  // namespace ferry::python
