// `ferry topo`: the machine's GPUs, NUMA nodes and NICs, and the rails the engine would
// register each one's memory on.
#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "cli/util.h"
#include "ferry/fabric/topology.h"

namespace ferry::cli {
namespace {

struct TopoFlags {
    std::string xml;
    std::string nics;
    std::string rails = "nearest";
};

Result<std::vector<FabricNic>> read_nics(const std::string& path) {
    std::ifstream in(path);
    if (!in) return not_found(fmt::format("--nics {}: cannot read the file", path));
    std::stringstream text;
    text << in.rdbuf();
    auto nics = parse_fabric_nics(text.str());
    if (!nics.ok()) return nics.status().with_context("--nics " + path);
    return nics;
}

void run_topo(const TopoFlags& f) {
    auto selection = RailSelection::parse(f.rails);
    if (!selection.ok()) return fail(selection.status().with_context("--rails"));
    Result<std::vector<FabricNic>> nics = f.nics.empty() ? rdma_nics_here() : read_nics(f.nics);
    if (!nics.ok()) return fail(nics.status());
    auto topo = f.xml.empty() ? Topology::load_this_machine(std::move(*nics))
                              : Topology::load_xml(f.xml, std::move(*nics));
    if (!topo.ok()) return fail(topo.status().with_context(f.xml.empty() ? "topology" : "--xml"));

    fmt::print("topology: {}\n", topo->source());
    std::string gpus;
    for (const auto& g : topo->gpus())
        gpus += fmt::format("{}{} (numa {})", gpus.empty() ? "" : ", ", g.pci.str(), g.numa_node);
    fmt::print("GPUs: {}{}\n", topo->gpus().size(), gpus.empty() ? "" : ": " + gpus);
    std::string nodes;
    for (const auto& n : topo->numa_nodes())
        nodes += (nodes.empty() ? "" : ", ") + std::to_string(n.node);
    fmt::print("NUMA nodes: {} ({})\n", topo->numa_nodes().size(), nodes);
    fmt::print("NICs: {}\n", topo->nics().size());
    if (topo->nics().empty()) {
        fmt::print(
            "no NIC: libfabric lists no efa or verbs device{}; the engine opens its rails on "
            "tcp or shm and registers every region on all of them\n",
            f.nics.empty() ? " here" : fmt::format(" in {}", f.nics));
        return;
    }
    for (const auto& line : topo->rail_lines()) fmt::print("{}\n", line);
    for (const auto& line : topo->mapping_lines(*selection)) fmt::print("{}\n", line);
}

}  // namespace

void register_topo(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "topo",
        "GPUs, NUMA nodes and NICs of this machine (or a topology file), and the rails the "
        "engine would register each one's memory on");
    auto f = std::make_shared<TopoFlags>();
    cmd->add_option("--xml", f->xml,
                    "read the topology from this hwloc XML file (lstopo --of xml)");
    cmd->add_option("--nics", f->nics,
                    "read the NICs from this file, one '<provider> <domain> <pci bus id>' a "
                    "line, instead of asking libfabric");
    cmd->add_option("--rails", f->rails, "nearest, all, or NIC domain names separated by commas")
        ->capture_default_str();
    cmd->callback([f] { run_topo(*f); });
}

}  // namespace ferry::cli
