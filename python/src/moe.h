// ferry._ferry's MoE all-to-all (python/src/moe.cc): the C++ side of ferry.moe.
#pragma once

#include <pybind11/pybind11.h>

#include "ferry/fabric/engine.h"

namespace ferry::python {

// engine_of turns a _ferry.Engine into its TransferEngine (module.cc owns that class).
using EngineOf = TransferEngine* (*)(pybind11::handle engine);
void register_moe(pybind11::module_& m, EngineOf engine_of);

}  // namespace ferry::python
