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

// Which NIC pairs carry a transfer between a local region and a peer's region: local rails
// near the local memory, each writing to (or reading from) a peer rail near the remote memory
// (MemoryDescriptor::near_mask). Every local rail holds every peer rail's address (PeerTable),
// so any pair can be used. docs/ARCHITECTURE.md, "Rails and topology".
struct RailRoute {
    RailSet local = 0;    // the local rails carrying the transfer (empty: none can)
    RailSet remote = 0;   // the peer's rails near the remote region
    bool common = false;  // NIC to matching NIC (same rail index on both sides)

    // The peer rail local rail `l` (one of `local`) talks to: the same index when that rail is
    // near the remote region, else the remote rail of the same rank (the k-th local rail to
    // the k-th remote rail, round the remote ones when there are more local ones).
    int peer_rail(int l) const {
        if (remote >> l & 1) return l;
        const int n = __builtin_popcountll(remote);
        const RailSet below = l >= 64 ? local : local & ((RailSet{1} << l) - 1);
        int k = __builtin_popcountll(below) % n;
        RailSet r = remote;
        while (k-- > 0) r &= r - 1;
        return __builtin_ctzll(r);
    }
    // "2->0,3->1", for the log.
    std::string pairs_text() const;
};

// The route between memory near `local_near` here and memory near `remote_near` on the peer
// (both non-empty; `remote_near` only rails the peer has). Rails near both memories with the
// same index, NIC to matching NIC, when there are any (two alike nodes, GPU k to the peer's
// GPU k); else (GPU k to the peer's GPU j) every local near rail, each to a remote near rail:
// both ends stay next to their memory and the pair crosses rails in the network (counted in
// EngineStats::rail_fallbacks).
RailRoute route_rails(RailSet local_near, RailSet remote_near);

class RailPlacement {
  public:
    // nics[r]: the NIC rail r opens (EngineConfig::rail_nics replaces them). Loads the PCIe
    // tree only where the choice can depend on it: "nearest" over more than one rail, some
    // with a PCI address, or an explicit EngineConfig::topology_xml. Errors name the setting.
    static Result<RailPlacement> open(const EngineConfig& config, std::vector<FabricNic> nics);

    struct Placed {
        // Where peers can reach the region: the rails below.
        RailSet registered = 0;
        // The rails nearest its memory under "nearest", every rail under "all", the listed
        // ones under a NIC list: this engine's own operations on the region leave from them
        // and peers' arrive on them (MemoryDescriptor::near_mask).
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
