// The machine's topology from hwloc, and the NICs nearest to each GPU and NUMA node.
#include "ferry/fabric/topology.h"

#include <fmt/format.h>
#include <hwloc.h>
#include <rdma/fabric.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <set>

#include "common/enum_names.h"
#include "fabric/provider.h"
#include "ferry/fabric/engine.h"

namespace ferry {

namespace {

bool parse_hex(std::string_view text, unsigned max, unsigned* out) {
    if (text.empty() || text.size() > 8) return false;  // nvidia-smi writes 8-digit domains
    unsigned v = 0;
    for (char c : text) {
        int d = (c >= '0' && c <= '9')   ? c - '0'
                : (c >= 'a' && c <= 'f') ? c - 'a' + 10
                : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                                         : -1;
        if (d < 0) return false;
        v = v * 16 + static_cast<unsigned>(d);
    }
    if (v > max) return false;
    *out = v;
    return true;
}

std::string trim(std::string_view s) {
    size_t b = s.find_first_not_of(" \t\r");
    if (b == std::string_view::npos) return "";
    size_t e = s.find_last_not_of(" \t\r");
    return std::string(s.substr(b, e - b + 1));
}

// "0,1" or "none".
std::string index_list(const std::vector<int>& v) {
    if (v.empty()) return "none";
    std::string s;
    for (int i : v) s += (s.empty() ? "" : ",") + std::to_string(i);
    return s;
}

struct HwlocDeleter {
    void operator()(hwloc_topology* t) const { hwloc_topology_destroy(t); }
};
using HwlocPtr = std::unique_ptr<hwloc_topology, HwlocDeleter>;

bool is_nvidia_gpu(hwloc_obj_t o) {
    if (o->type != HWLOC_OBJ_PCI_DEVICE) return false;
    unsigned cls = o->attr->pcidev.class_id;
    return o->attr->pcidev.vendor_id == 0x10de && (cls == 0x0302 || cls == 0x0300);
}

PciBusId bus_id_of(hwloc_obj_t o) {
    const auto& p = o->attr->pcidev;
    return PciBusId{static_cast<uint16_t>(p.domain), p.bus, p.dev, p.func};
}

// The NUMA node of the CPU-side object an I/O object hangs from; -1 if it spans several.
int numa_of(hwloc_topology_t t, hwloc_obj_t o) {
    hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(t, o);
    if (!anc || !anc->nodeset || hwloc_bitmap_weight(anc->nodeset) != 1) return -1;
    return hwloc_bitmap_first(anc->nodeset);
}

// The PCI bridge depth of the PCIe switch that `a` and `b` share (their lowest common ancestor
// being a PCI-to-PCI bridge, not a host bridge); -1 when they share none. hwloc's
// get_common_ancestor_obj compares depths, which I/O objects do not have.
int shared_switch_depth(hwloc_obj_t a, hwloc_obj_t b) {
    std::set<hwloc_obj_t> above_a;
    for (hwloc_obj_t o = a; o; o = o->parent) above_a.insert(o);
    hwloc_obj_t common = b;
    while (common && !above_a.count(common)) common = common->parent;
    if (!common || common->type != HWLOC_OBJ_BRIDGE ||
        common->attr->bridge.upstream_type != HWLOC_OBJ_BRIDGE_PCI) {
        return -1;
    }
    return static_cast<int>(common->attr->bridge.depth);
}

}  // namespace

std::string PciBusId::str() const {
    return fmt::format("{:04x}:{:02x}:{:02x}.{:x}", domain, bus, device, function);
}

Result<PciBusId> PciBusId::parse(std::string_view text) {
    auto bad = [&] {
        return invalid_argument(fmt::format(
            "'{}' is not a PCI address: expected dddd:bb:dd.f in hex, e.g. 0000:53:00.0", text));
    };
    std::string_view s = text;
    std::string_view dom = "0";
    size_t first = s.find(':');
    if (first == std::string_view::npos) return bad();
    if (s.find(':', first + 1) != std::string_view::npos) {
        dom = s.substr(0, first);
        s = s.substr(first + 1);
    }
    size_t colon = s.find(':'), dot = s.find('.');
    if (colon == std::string_view::npos || dot == std::string_view::npos || dot < colon)
        return bad();
    unsigned d = 0, b = 0, dev = 0, f = 0;
    if (!parse_hex(dom, 0xffff, &d) || !parse_hex(s.substr(0, colon), 0xff, &b) ||
        !parse_hex(s.substr(colon + 1, dot - colon - 1), 0x1f, &dev) ||
        !parse_hex(s.substr(dot + 1), 0x7, &f)) {
        return bad();
    }
    return PciBusId{static_cast<uint16_t>(d), static_cast<uint8_t>(b), static_cast<uint8_t>(dev),
                    static_cast<uint8_t>(f)};
}

FabricNic fabric_nic(const fi_info* i) {
    FabricNic nic;
    if (i->domain_attr && i->domain_attr->name) nic.domain = i->domain_attr->name;
    if (i->fabric_attr && i->fabric_attr->prov_name) nic.provider = i->fabric_attr->prov_name;
    if (i->nic && i->nic->bus_attr && i->nic->bus_attr->bus_type == FI_BUS_PCI) {
        const auto& p = i->nic->bus_attr->attr.pci;
        nic.pci = PciBusId{p.domain_id, p.bus_id, p.device_id, p.function_id};
    }
    return nic;
}

std::vector<FabricNic> fabric_nics(const fi_info* list) {
    std::vector<FabricNic> out;
    for (const fi_info* i = list; i; i = i->next) {
        FabricNic nic = fabric_nic(i);
        if (nic.domain.empty()) continue;
        bool seen = std::any_of(out.begin(), out.end(),
                                [&](const FabricNic& n) { return n.domain == nic.domain; });
        if (!seen) out.push_back(std::move(nic));
    }
    return out;
}

int numa_node_of(const void* ptr, size_t len) {
    if (!ptr || len == 0) return -1;
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t first = reinterpret_cast<uintptr_t>(ptr) & ~(page - 1);
    const uintptr_t last = (reinterpret_cast<uintptr_t>(ptr) + len - 1) & ~(page - 1);
    const uintptr_t pages = (last - first) / page + 1;
    constexpr uintptr_t kSamples = 16;
    const uintptr_t n = std::min(pages, kSamples);
    void* addrs[kSamples];
    int status[kSamples];
    for (uintptr_t i = 0; i < n; ++i) {
        uintptr_t at = n == 1 ? 0 : (pages - 1) * i / (n - 1);
        addrs[i] = reinterpret_cast<void*>(first + at * page);
    }
    // nodes == NULL: move_pages moves nothing and writes each page's node (or -errno) instead.
    if (syscall(SYS_move_pages, 0, n, addrs, nullptr, status, 0) != 0) return -1;
    int node = -1;
    for (uintptr_t i = 0; i < n; ++i) {
        if (status[i] < 0) continue;
        if (node >= 0 && status[i] != node) return -1;
        node = status[i];
    }
    return node;
}

Result<std::vector<FabricNic>> parse_fabric_nics(std::string_view text) {
    std::vector<FabricNic> out;
    int line_no = 0;
    size_t at = 0;
    while (at <= text.size()) {
        size_t end = text.find('\n', at);
        if (end == std::string_view::npos) end = text.size();
        std::string line = trim(text.substr(at, end - at));
        at = end + 1;
        ++line_no;
        if (size_t hash = line.find('#'); hash != std::string::npos)
            line = trim(line.substr(0, hash));
        if (line.empty()) continue;
        std::vector<std::string> words;
        for (size_t p = 0; p < line.size();) {
            size_t q = line.find_first_of(" \t", p);
            if (q == std::string::npos) q = line.size();
            if (q > p) words.push_back(line.substr(p, q - p));
            p = q + 1;
        }
        if (words.size() != 3) {
            return invalid_argument(fmt::format(
                "NIC list line {}: expected '<provider> <domain> <pci bus id or ->', got '{}'",
                line_no, line));
        }
        FabricNic nic{words[0], words[1], std::nullopt};
        if (words[2] != "-") {
            auto pci = PciBusId::parse(words[2]);
            if (!pci.ok())
                return pci.status().with_context(fmt::format("NIC list line {}", line_no));
            nic.pci = *pci;
        }
        out.push_back(std::move(nic));
    }
    return out;
}

std::vector<FabricNic> rdma_nics_here() {
    std::vector<FabricNic> out;
    EngineConfig config;
    for (const char* provider : {"efa", "verbs;ofi_rxm"}) {
        auto infos = detail::get_infos(provider, config);
        if (!infos.ok()) continue;
        for (auto& nic : fabric_nics(infos->get())) out.push_back(std::move(nic));
    }
    return out;
}

std::string_view rail_reach_name(RailReach reach) {
    static constexpr EnumName<RailReach> kNames[] = {
        {RailReach::kSwitch, "same PCIe switch"},
        {RailReach::kNuma, "same NUMA node"},
        {RailReach::kAll, "no NIC nearer: all"},
    };
    return name_of(kNames, reach, "?");
}

Result<RailSelection> RailSelection::parse(std::string_view text) {
    RailSelection s;
    std::string t = trim(text);
    if (t.empty() || t == "nearest") return s;
    if (t == "all") {
        s.mode = Mode::kAll;
        return s;
    }
    s.mode = Mode::kList;
    for (size_t p = 0; p <= t.size();) {
        size_t q = t.find(',', p);
        if (q == std::string::npos) q = t.size();
        std::string name = trim(t.substr(p, q - p));
        if (name.empty()) {
            return invalid_argument(fmt::format(
                "rail selection '{}': expected nearest, all, or NIC domain names separated by "
                "commas (an empty name)",
                text));
        }
        s.domains.push_back(name);
        p = q + 1;
    }
    return s;
}

// Builds a Topology from a loaded hwloc topology: every ranking decision is here.
class TopologyBuilder {
  public:
    static Result<Topology> build(hwloc_topology_t t, std::vector<FabricNic> fabric,
                                  std::string source) {
        Topology topo;
        topo.source_ = std::move(source);
        topo.has_tree_ = true;
        std::vector<hwloc_obj_t> nic_objs;
        for (auto& f : fabric) {
            hwloc_obj_t o = nullptr;
            if (f.pci) {
                o = hwloc_get_pcidev_by_busid(t, f.pci->domain, f.pci->bus, f.pci->device,
                                              f.pci->function);
            }
            TopoNic nic{std::move(f), o != nullptr, o ? numa_of(t, o) : -1};
            topo.nics_.push_back(std::move(nic));
            nic_objs.push_back(o);
        }
        std::vector<int> all(topo.nics_.size());
        for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);

        for (hwloc_obj_t o = hwloc_get_next_pcidev(t, nullptr); o;
             o = hwloc_get_next_pcidev(t, o)) {
            if (!is_nvidia_gpu(o)) continue;
            TopoGpu gpu{bus_id_of(o), numa_of(t, o), {}};
            gpu.rails = nearest_to_gpu(o, gpu.numa_node, topo.nics_, nic_objs, all);
            topo.gpus_.push_back(std::move(gpu));
        }
        std::sort(topo.gpus_.begin(), topo.gpus_.end(),
                  [](const TopoGpu& a, const TopoGpu& b) { return a.pci < b.pci; });

        for (hwloc_obj_t o = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, nullptr); o;
             o = hwloc_get_next_obj_by_type(t, HWLOC_OBJ_NUMANODE, o)) {
            int node = static_cast<int>(o->os_index);
            topo.numa_.push_back(TopoNuma{node, on_numa(node, topo.nics_, all)});
        }
        return topo;
    }

  private:
    static RailChoice on_numa(int node, const std::vector<TopoNic>& nics,
                              const std::vector<int>& all) {
        RailChoice c{{}, RailReach::kNuma};
        for (size_t i = 0; i < nics.size(); ++i) {
            if (node >= 0 && nics[i].numa_node == node) c.nics.push_back(static_cast<int>(i));
        }
        if (c.nics.empty()) c = RailChoice{all, RailReach::kAll};
        return c;
    }

    // Same switch first (the deepest switch shared, when switches nest), then the GPU's NUMA
    // node, then every NIC.
    static RailChoice nearest_to_gpu(hwloc_obj_t gpu, int numa, const std::vector<TopoNic>& nics,
                                     const std::vector<hwloc_obj_t>& objs,
                                     const std::vector<int>& all) {
        RailChoice c{{}, RailReach::kSwitch};
        int best = -1;
        for (size_t i = 0; i < objs.size(); ++i) {
            if (!objs[i]) continue;
            int depth = shared_switch_depth(gpu, objs[i]);
            if (depth < 0 || depth < best) continue;
            if (depth > best) c.nics.clear();
            best = depth;
            c.nics.push_back(static_cast<int>(i));
        }
        if (!c.nics.empty()) return c;
        return on_numa(numa, nics, all);
    }
};

namespace {

Result<Topology> load(const std::string* xml, std::vector<FabricNic> nics) {
    hwloc_topology_t raw = nullptr;
    if (hwloc_topology_init(&raw) != 0) return internal_error("hwloc_topology_init failed");
    HwlocPtr t(raw);
    hwloc_topology_set_io_types_filter(raw, HWLOC_TYPE_FILTER_KEEP_ALL);
    std::string source = "this machine";
    if (xml) {
        std::error_code ec;
        if (!std::filesystem::is_regular_file(*xml, ec)) {
            return not_found(fmt::format("topology file {} does not exist", *xml));
        }
        if (hwloc_topology_set_xml(raw, xml->c_str()) != 0) {
            return invalid_argument(fmt::format("topology file {}: hwloc cannot read it as XML: {}",
                                                *xml, std::strerror(errno)));
        }
        source = *xml;
    }
    if (hwloc_topology_load(raw) != 0) {
        return xml ? invalid_argument(fmt::format("topology file {}: hwloc cannot load it: {} "
                                                  "(write it with lstopo --of xml)",
                                                  *xml, std::strerror(errno)))
                   : internal_error(fmt::format("hwloc could not read this machine's topology: {}",
                                                std::strerror(errno)));
    }
    return TopologyBuilder::build(raw, std::move(nics), std::move(source));
}

}  // namespace

Result<Topology> Topology::load_this_machine(std::vector<FabricNic> nics) {
    return load(nullptr, std::move(nics));
}

Result<Topology> Topology::load_xml(const std::string& path, std::vector<FabricNic> nics) {
    return load(&path, std::move(nics));
}

Topology Topology::nics_only(std::vector<FabricNic> nics) {
    Topology t;
    t.source_ = "no PCIe tree";
    for (auto& n : nics) t.nics_.push_back(TopoNic{std::move(n), false, -1});
    return t;
}

RailChoice Topology::nearest(const MemoryPlace& place) const {
    if (place.gpu) {
        for (const auto& g : gpus_) {
            if (g.pci == *place.gpu) return g.rails;
        }
    }
    for (const auto& n : numa_) {
        if (n.node == place.numa_node) return n.rails;
    }
    RailChoice c{{}, RailReach::kAll};
    for (size_t i = 0; i < nics_.size(); ++i) c.nics.push_back(static_cast<int>(i));
    return c;
}

Result<RailChoice> Topology::choose(const RailSelection& selection,
                                    const MemoryPlace& place) const {
    if (selection.mode == RailSelection::Mode::kNearest) return nearest(place);
    RailChoice c{{}, RailReach::kAll};
    for (size_t i = 0; i < nics_.size(); ++i) {
        bool listed = selection.mode == RailSelection::Mode::kAll ||
                      std::count(selection.domains.begin(), selection.domains.end(),
                                 nics_[i].fabric.domain) > 0;
        if (listed) c.nics.push_back(static_cast<int>(i));
    }
    for (const auto& name : selection.domains) {
        bool known = std::any_of(nics_.begin(), nics_.end(),
                                 [&](const TopoNic& n) { return n.fabric.domain == name; });
        if (known) continue;
        std::string names;
        for (const auto& n : nics_) names += (names.empty() ? "" : ", ") + n.fabric.domain;
        return not_found(fmt::format("rail selection names NIC '{}', which is not here (NICs: {})",
                                     name, names.empty() ? "none" : names));
    }
    return c;
}

std::vector<std::string> Topology::rail_lines() const {
    std::vector<std::string> out;
    for (size_t i = 0; i < nics_.size(); ++i) {
        const auto& n = nics_[i];
        out.push_back(fmt::format("rail {} (device={}, provider={}, pci={}, numa={}{})", i,
                                  n.fabric.domain, n.fabric.provider,
                                  n.fabric.pci ? n.fabric.pci->str() : "none", n.numa_node,
                                  n.in_topology ? "" : ", not in the PCIe tree"));
    }
    return out;
}

std::vector<std::string> Topology::mapping_lines(const RailSelection& selection) const {
    std::vector<std::string> out;
    auto line = [&](const std::string& what, const MemoryPlace& place) {
        auto c = choose(selection, place);
        if (!c.ok()) {
            out.push_back(fmt::format("{}: {}", what, c.status().message()));
            return;
        }
        std::string why = selection.mode == RailSelection::Mode::kNearest
                              ? std::string(rail_reach_name(c->reach))
                              : "set by the rail selection";
        out.push_back(fmt::format("{} mapped to rails {} ({})", what, index_list(c->nics), why));
    };
    for (size_t i = 0; i < gpus_.size(); ++i) {
        line(fmt::format("GPU {} (pci={}, numa={})", i, gpus_[i].pci.str(), gpus_[i].numa_node),
             MemoryPlace{gpus_[i].pci, gpus_[i].numa_node});
    }
    for (const auto& n : numa_) {
        line(fmt::format("NUMA node {} host memory", n.node), MemoryPlace{std::nullopt, n.node});
    }
    return out;
}

}  // namespace ferry
