// ferry._ferry's KV-cache side (python/src/kv.cc): KvLayout, the KV connector over a pool of
// registered regions, and the handshake side channel; the C++ side of ferry.kv.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "ferry/fabric/engine.h"

namespace ferry::python {

// engine_share turns a _ferry.Engine into a share of its TransferEngine (module.cc owns that
// class): a connector keeps the engine alive for as long as it runs on it.
using EngineShare = std::shared_ptr<TransferEngine> (*)(pybind11::handle engine);
void register_kv(pybind11::module_& m, EngineShare engine_share);

}  // namespace ferry::python
