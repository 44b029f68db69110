// ferry._ferry's MoE all-to-all (python/src/moe.cc): the C++ side of ferry.moe.
#pragma once

#include <pybind11/pybind11.h>

#include "convert.h"

namespace ferry::python {

void register_moe(pybind11::module_& m, EngineShare engine_share);

}  // namespace ferry::python
