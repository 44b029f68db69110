// Which NICs are nearest to a region's memory, from the machine's PCIe tree (hwloc): a GPU's
// memory goes on the NICs of its own PCIe switch, host memory on its NUMA node's NICs, as
// NIXL's LIBFABRIC backend does on p5en (2 of 16 EFA devices per GPU). See docs/ARCHITECTURE.md,
// "Rails and topology".
#pragma once

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/common/status.h"

struct fi_info;

namespace ferry {

// A PCI address, "dddd:bb:dd.f" (lower-case hex), as hwloc, sysfs and CUDA write it.
struct PciBusId {
    uint16_t domain = 0;
    uint8_t bus = 0;
    uint8_t device = 0;
    uint8_t function = 0;

    std::string str() const;
    // Accepts "dddd:bb:dd.f", CUDA's upper case and nvidia-smi's 8-digit domain; "bb:dd.f"
    // means domain 0.
    static Result<PciBusId> parse(std::string_view text);
    auto operator<=>(const PciBusId&) const = default;
};

// One NIC as libfabric lists it: an fi_info entry's provider, domain name and PCI address.
struct FabricNic {
    std::string provider;         // "efa", "verbs;ofi_rxm"
    std::string domain;           // fi_info's domain name: "rdmap79s0", "mlx5_0"
    std::optional<PciBusId> pci;  // fi_info's nic->bus_attr; none for a provider without it
};

// The NIC of one fi_info entry (its domain name is empty when the entry has none).
FabricNic fabric_nic(const fi_info* info);

// The NICs of an fi_info list, one per domain name, in list order. Entries without a domain
// name are left out.
std::vector<FabricNic> fabric_nics(const fi_info* list);

// The same from text, one NIC a line: "<provider> <domain> <pci bus id or ->"; '#' starts a
// comment. Tests and `ferry topo --nics` describe a machine's fi_info list this way.
Result<std::vector<FabricNic>> parse_fabric_nics(std::string_view text);

// The RDMA NICs libfabric lists on this machine (efa, verbs); none on a host without one.
std::vector<FabricNic> rdma_nics_here();

// How a region's rails were chosen, nearest first.
enum class RailReach {
    kSwitch,  // the NICs under the same PCIe switch as the GPU
    kNuma,    // the NICs on the memory's NUMA node
    kAll,     // no NIC is near: every NIC
};
std::string_view rail_reach_name(RailReach reach);

struct RailChoice {
    std::vector<int> nics;  // indexes into Topology::nics(), ascending
    RailReach reach = RailReach::kAll;
    bool operator==(const RailChoice&) const = default;
};

// Where a region's memory lives: a GPU (by PCI address) or host memory on a NUMA node (-1:
// unknown).
struct MemoryPlace {
    std::optional<PciBusId> gpu;
    int numa_node = -1;
};

// The NUMA node holding the pages of [ptr, ptr + len) (move_pages(2) on up to 16 pages spread
// over the range); -1 when they lie on several nodes, none is allocated yet, or the kernel
// does not say.
int numa_node_of(const void* ptr, size_t len);

// The operator's override, as NIXL and pplx-garden allow: "nearest" (the default), "all", or
// a comma-separated list of NIC domain names ("rdmap79s0,rdmap80s0") used for every region.
struct RailSelection {
    enum class Mode { kNearest, kAll, kList };
    Mode mode = Mode::kNearest;
    std::vector<std::string> domains;  // for kList

    static Result<RailSelection> parse(std::string_view text);
};

struct TopoGpu {
    PciBusId pci;
    int numa_node = -1;  // -1 when its nearest CPU-side object spans several NUMA nodes
    RailChoice rails;
};

struct TopoNuma {
    int node = 0;
    RailChoice rails;
};

struct TopoNic {
    FabricNic fabric;
    bool in_topology = false;  // its PCI address was found in the PCIe tree
    int numa_node = -1;
};

// The machine's GPUs (NVIDIA, by PCI address), NUMA nodes and NICs, and for each GPU and NUMA
// node the NICs nearest to it. Plain data, computed once when loaded.
class Topology {
  public:
    // This machine's topology (hwloc reads sysfs), matched against `nics`.
    static Result<Topology> load_this_machine(std::vector<FabricNic> nics);
    // A topology saved as hwloc XML (lstopo --of xml, or a test fixture).
    static Result<Topology> load_xml(const std::string& path, std::vector<FabricNic> nics);
    // The NICs alone, without a PCIe tree: every place maps to every NIC. For an engine whose
    // choice cannot depend on the tree (one rail, NICs without a PCI address: tcp, shm).
    static Topology nics_only(std::vector<FabricNic> nics);

    // False for nics_only: nearest() then always answers every NIC.
    bool has_tree() const { return has_tree_; }

    const std::vector<TopoGpu>& gpus() const { return gpus_; }
    const std::vector<TopoNuma>& numa_nodes() const { return numa_; }
    const std::vector<TopoNic>& nics() const { return nics_; }
    const std::string& source() const { return source_; }

    // The nearest NICs to `place`: its GPU's entry, else its NUMA node's, else every NIC.
    RailChoice nearest(const MemoryPlace& place) const;
    // `nearest` under the operator's override; a kList naming a NIC that is not here is an
    // error naming it and the NICs there are.
    Result<RailChoice> choose(const RailSelection& selection, const MemoryPlace& place) const;

    // Lines an operator can grep, one per rail ("rail 0 (device=rdmap79s0, ...)") and one per
    // GPU and NUMA node ("GPU 0 (pci=0000:53:00.0, numa=0) mapped to rails 0,1 (same PCIe
    // switch)"); the engine logs them and `ferry topo` prints them.
    std::vector<std::string> rail_lines() const;
    std::vector<std::string> mapping_lines(const RailSelection& selection) const;

  private:
    friend class TopologyBuilder;
    std::string source_;
    bool has_tree_ = false;
    std::vector<TopoGpu> gpus_;
    std::vector<TopoNuma> numa_;
    std::vector<TopoNic> nics_;
};

}  // namespace ferry
