// Which rails a region is registered on and which this engine sends it on (docs/ARCHITECTURE.md,
// "Rails and topology"): the NIC each rail stands for, the machine's PCIe tree, and the
// operator's rail selection.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/topology.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

// A set of rails of one engine: bit r is rail r (at most 64 rails).
using RailSet = uint64_t;

// "0,1,3", or "none".
std::string rail_set_text(RailSet rails);

class RailPlacement {
  public:
    // nics[r]: the NIC rail r opens (EngineConfig::rail_nics replaces them). Loads the PCIe
    // tree only where the choice can depend on it: "nearest" over more than one rail, some
    // with a PCI address, or an explicit EngineConfig::topology_xml. Errors name the setting.
    static Result<RailPlacement> open(const EngineConfig& config, std::vector<FabricNic> nics);

    struct Placed {
        // Where peers can reach the region: every rail, except under a NIC list (only those).
        RailSet registered = 0;
        // Where this engine's own operations on the region go first: the rails nearest its
        // memory under "nearest" (a subset of `registered`), else `registered`.
        RailSet send = 0;
        std::string where;  // "host memory on NUMA node 0", for the log
        std::string why;    // "same NUMA node", "set by the rail selection"
    };
    // The rails for [ptr, ptr + len) of `kind` (CUDA memory of `device`).
    Placed place(const void* ptr, size_t len, MemoryKind kind, int device) const;

    // "rail N (device=..., provider=..., pci=..., numa=...)", one per rail.
    std::vector<std::string> rail_lines() const { return topology_.rail_lines(); }

  private:
    Topology topology_;
    RailSelection selection_;
};

}  // namespace ferry::detail
