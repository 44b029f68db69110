#include "fabric/rail_placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "ferry/common/log.h"
#include "ferry/fabric/gpu_memory.h"

namespace ferry::detail {

std::string rail_set_text(RailSet rails) {
    std::string s;
    for (int r = 0; r < 64; ++r) {
        if (rails >> r & 1) s += (s.empty() ? "" : ",") + std::to_string(r);
    }
    return s.empty() ? "none" : s;
}

std::string RailRoute::pairs_text() const {
    std::string s;
    for (RailSet l = local; l; l &= l - 1) {
        const int r = __builtin_ctzll(l);
        s += fmt::format("{}{}->{}", s.empty() ? "" : ",", r, peer_rail(r));
    }
    return s.empty() ? "none" : s;
}

RailRoute route_rails(RailSet local_near, RailSet remote_near) {
    RailRoute route;
    route.remote = remote_near;
    if (!local_near || !remote_near) return route;
    const RailSet both = local_near & remote_near;
    route.common = both != 0;
    route.local = both ? both : local_near;
    return route;
}

Result<RailPlacement> RailPlacement::open(const EngineConfig& config, std::vector<FabricNic> nics) {
    RailPlacement p;
    auto selection = RailSelection::parse(config.rails);
    if (!selection.ok()) return selection.status().with_context("EngineConfig::rails");
    p.selection_ = std::move(*selection);
    if (!config.rail_nics.empty()) {
        auto listed = parse_fabric_nics(config.rail_nics);
        if (!listed.ok()) return listed.status().with_context("EngineConfig::rail_nics");
        if (listed->size() != nics.size()) {
            return invalid_argument(
                fmt::format("EngineConfig::rail_nics lists {} NICs but the engine opens {} rails "
                            "(num_rails): give one line per rail",
                            listed->size(), nics.size()));
        }
        nics = std::move(*listed);
    }
    const bool some_pci =
        std::any_of(nics.begin(), nics.end(), [](const FabricNic& n) { return n.pci; });
    if (!config.topology_xml.empty()) {
        auto t = Topology::load_xml(config.topology_xml, std::move(nics));
        if (!t.ok()) return t.status().with_context("EngineConfig::topology_xml");
        p.topology_ = std::move(*t);
    } else if (p.selection_.mode == RailSelection::Mode::kNearest && nics.size() > 1 && some_pci) {
        auto t = Topology::load_this_machine(nics);
        if (t.ok()) {
            p.topology_ = std::move(*t);
        } else {
            log(LogLevel::kWarn, "fabric",
                "every region goes on every rail: this machine's topology is unknown ({})",
                t.status().message());
            p.topology_ = Topology::nics_only(std::move(nics));
        }
    } else {
        p.topology_ = Topology::nics_only(std::move(nics));
    }
    // A listed NIC that is not here fails now, not at the first registration.
    auto check = p.topology_.choose(p.selection_, MemoryPlace{});
    if (!check.ok()) return check.status().with_context("EngineConfig::rails");
    return p;
}

RailPlacement::Placed RailPlacement::place(const void* ptr, size_t len, MemoryKind kind,
                                           int device) const {
    Placed out;
    MemoryPlace at;
    const bool nearest = selection_.mode == RailSelection::Mode::kNearest;
    if (kind == MemoryKind::kCuda) {
        out.where = fmt::format("GPU memory of device {}", device);
        if (nearest && topology_.has_tree()) {
            auto id = gpu_pci_bus_id(device);
            auto pci = id.ok() ? PciBusId::parse(*id) : Result<PciBusId>(id.status());
            if (pci.ok()) at.gpu = *pci;
            out.where += pci.ok()
                             ? fmt::format(" (pci={})", pci->str())
                             : fmt::format(" (PCI address unknown: {})", pci.status().message());
        }
    } else {
        out.where = "host memory";
        if (nearest && topology_.has_tree()) {
            at.numa_node = numa_node_of(ptr, len);
            out.where += at.numa_node >= 0 ? fmt::format(" on NUMA node {}", at.numa_node)
                                           : std::string(" (NUMA node unknown)");
        }
    }
    // choose() fails only for a listed NIC that is not here, which open() refused.
    auto chosen = topology_.choose(selection_, at);
    RailChoice choice = chosen.ok() ? *chosen : topology_.nearest(at);
    for (int r : choice.nics) out.send |= RailSet{1} << r;
    // Registered on those rails only, as NIXL does: a peer aims its transfers at the rails
    // the region's descriptor names near it (near_mask), whichever of its own rails it sends
    // from (every local rail holds every peer rail's address), so no peer needs another.
    // On p5en that is 2 registrations of a GPU's KV cache instead of 16.
    out.registered = out.send;
    out.why = nearest ? std::string(rail_reach_name(choice.reach)) : "set by the rail selection";
    return out;
}

}  // namespace ferry::detail
