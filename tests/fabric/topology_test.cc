// Rails chosen by topology: on the documented layouts of p5en, p4d and DGX H100 nodes (hwloc
// XML fixtures with their fi_info lists, tests/fabric/topology/make_fixtures.py), every GPU
// gets the NICs of its own PCIe switch and every NUMA node its own NICs, as NIXL does.
#include "ferry/fabric/topology.h"

#include <gtest/gtest.h>
#include <rdma/fabric.h>

#include <cstring>
#include <fstream>
#include <sstream>

namespace ferry {
namespace {

std::string fixture(const std::string& name) {
    return std::string(FERRY_TOPOLOGY_FIXTURES) + "/" + name;
}

std::vector<FabricNic> nics_of(const std::string& stem) {
    std::ifstream in(fixture(stem + ".nics"));
    std::stringstream text;
    text << in.rdbuf();
    auto nics = parse_fabric_nics(text.str());
    EXPECT_TRUE(nics.ok()) << nics.status().to_string();
    return nics.ok() ? *nics : std::vector<FabricNic>{};
}

Topology load(const std::string& stem, std::vector<FabricNic> nics) {
    auto topo = Topology::load_xml(fixture(stem + ".xml"), std::move(nics));
    EXPECT_TRUE(topo.ok()) << topo.status().to_string();
    return topo.ok() ? *topo : Topology{};
}

std::vector<int> range(int from, int to) {
    std::vector<int> v;
    for (int i = from; i < to; ++i) v.push_back(i);
    return v;
}

// Every GPU i gets nics_per_gpu(i) by switch, every NUMA node its own NICs.
void expect_mapping(const Topology& t, int gpus, int numa_nodes, int nics,
                    const std::function<std::vector<int>(int)>& gpu_nics) {
    ASSERT_EQ(t.gpus().size(), size_t(gpus));
    ASSERT_EQ(t.numa_nodes().size(), size_t(numa_nodes));
    ASSERT_EQ(t.nics().size(), size_t(nics));
    for (const auto& n : t.nics()) EXPECT_TRUE(n.in_topology) << n.fabric.domain;
    for (int g = 0; g < gpus; ++g) {
        const auto& gpu = t.gpus()[g];
        EXPECT_EQ(gpu.rails, (RailChoice{gpu_nics(g), RailReach::kSwitch}))
            << "GPU " << g << " at " << gpu.pci.str();
        EXPECT_EQ(gpu.numa_node, g < gpus / 2 ? 0 : 1) << "GPU " << g;
        EXPECT_EQ(t.nearest(MemoryPlace{gpu.pci, gpu.numa_node}), gpu.rails);
    }
    int per_node = nics / numa_nodes;
    for (int n = 0; n < numa_nodes; ++n) {
        EXPECT_EQ(t.numa_nodes()[n].node, n);
        EXPECT_EQ(t.nearest(MemoryPlace{std::nullopt, n}),
                  (RailChoice{range(n * per_node, (n + 1) * per_node), RailReach::kNuma}))
            << "NUMA node " << n;
    }
}

TEST(Topology, P5enEachGpuGetsTheTwoEfaDevicesOfItsSwitch) {
    Topology t = load("p5en", nics_of("p5en"));
    expect_mapping(t, 8, 2, 16, [](int g) { return range(2 * g, 2 * g + 2); });
    // The management ENA device is a PCI network device in the tree but no rail.
    for (const auto& n : t.nics()) EXPECT_NE(n.fabric.pci->str(), "0000:00:00.0");
}

TEST(Topology, P4dTwoGpusShareTheEfaDeviceOfTheirSwitch) {
    Topology t = load("p4d", nics_of("p4d"));
    expect_mapping(t, 8, 2, 4, [](int g) { return std::vector<int>{g / 2}; });
}

TEST(Topology, DgxH100EachGpuGetsItsConnectX7) {
    Topology t = load("dgx_h100", nics_of("dgx_h100"));
    expect_mapping(t, 8, 2, 8, [](int g) { return std::vector<int>{g}; });
    EXPECT_EQ(t.nics()[3].fabric.domain, "mlx5_3");
    EXPECT_EQ(t.nics()[3].fabric.provider, "verbs;ofi_rxm");
}

TEST(Topology, AGpuWithoutASwitchNicGetsItsNumaNodesNics) {
    // p5en with GPU 0's two EFA devices missing from libfabric's list: GPU 0 falls back to the
    // other NICs of socket 0, the rest keep their switch's.
    auto nics = nics_of("p5en");
    nics.erase(nics.begin(), nics.begin() + 2);
    Topology t = load("p5en", nics);
    EXPECT_EQ(t.gpus()[0].rails, (RailChoice{range(0, 6), RailReach::kNuma}));
    EXPECT_EQ(t.gpus()[1].rails, (RailChoice{{0, 1}, RailReach::kSwitch}));
    EXPECT_EQ(t.gpus()[4].rails, (RailChoice{{6, 7}, RailReach::kSwitch}));
}

TEST(Topology, NothingNearFallsBackToEveryNic) {
    // A provider without PCI attributes (tcp) and a NIC whose address is not in the tree: no
    // GPU or NUMA node has a near NIC, so each gets all of them.
    auto nics = parse_fabric_nics("tcp;ofi_rxm eth0 -\nefa rdmap9s0 0000:09:00.0\n");
    ASSERT_TRUE(nics.ok()) << nics.status().to_string();
    Topology t = load("p5en", *nics);
    ASSERT_EQ(t.nics().size(), 2u);
    EXPECT_FALSE(t.nics()[0].in_topology);
    EXPECT_FALSE(t.nics()[1].in_topology);
    RailChoice all{{0, 1}, RailReach::kAll};
    for (const auto& g : t.gpus()) EXPECT_EQ(g.rails, all) << g.pci.str();
    for (const auto& n : t.numa_nodes()) EXPECT_EQ(n.rails, all) << n.node;
    // A GPU the topology does not know, and unknown host memory, get all NICs too.
    EXPECT_EQ(t.nearest(MemoryPlace{PciBusId{0, 0xee, 0, 0}, 7}), all);
    EXPECT_EQ(t.nearest(MemoryPlace{}), all);
}

TEST(Topology, SocketWithoutNicsGivesItsGpusEveryNic) {
    // Only socket 1's NICs listed: socket 0's GPUs and NUMA node have nothing near.
    auto nics = nics_of("p5en");
    nics.erase(nics.begin(), nics.begin() + 8);
    Topology t = load("p5en", nics);
    EXPECT_EQ(t.gpus()[0].rails, (RailChoice{range(0, 8), RailReach::kAll}));
    EXPECT_EQ(t.numa_nodes()[0].rails, (RailChoice{range(0, 8), RailReach::kAll}));
    EXPECT_EQ(t.gpus()[7].rails, (RailChoice{{6, 7}, RailReach::kSwitch}));
}

TEST(Topology, OverrideAllOrAListAppliesToEveryRegion) {
    Topology t = load("p5en", nics_of("p5en"));
    MemoryPlace gpu0{t.gpus()[0].pci, 0};
    auto all = RailSelection::parse("all");
    ASSERT_TRUE(all.ok());
    auto c = t.choose(*all, gpu0);
    ASSERT_TRUE(c.ok());
    EXPECT_EQ(c->nics, range(0, 16));
    auto list = RailSelection::parse("rdmap133s0, rdmap20s0");
    ASSERT_TRUE(list.ok());
    c = t.choose(*list, gpu0);
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    EXPECT_EQ(c->nics, (std::vector<int>{0, 15}));

    auto unknown = RailSelection::parse("rdmap20s0,mlx5_0");
    ASSERT_TRUE(unknown.ok());
    c = t.choose(*unknown, gpu0);
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("'mlx5_0'"), std::string::npos) << c.status().message();
    EXPECT_NE(c.status().message().find("rdmap133s0"), std::string::npos);
    EXPECT_FALSE(RailSelection::parse("rdmap20s0,,x").ok());
    auto nearest = RailSelection::parse("nearest");
    ASSERT_TRUE(nearest.ok());
    EXPECT_EQ(nearest->mode, RailSelection::Mode::kNearest);
}

TEST(Topology, LinesNameEachRailAndMapping) {
    Topology t = load("p5en", nics_of("p5en"));
    auto rails = t.rail_lines();
    ASSERT_EQ(rails.size(), 16u);
    EXPECT_EQ(rails[0], "rail 0 (device=rdmap20s0, provider=efa, pci=0000:14:00.0, numa=0)");
    auto maps = t.mapping_lines(RailSelection{});
    ASSERT_EQ(maps.size(), 10u);
    EXPECT_EQ(maps[0], "GPU 0 (pci=0000:13:00.0, numa=0) mapped to rails 0,1 (same PCIe switch)");
    EXPECT_EQ(maps[9],
              "NUMA node 1 host memory mapped to rails 8,9,10,11,12,13,14,15 (same NUMA "
              "node)");
}

TEST(Topology, BadFilesAndListsAreNamed) {
    auto missing = Topology::load_xml(fixture("nope.xml"), {});
    ASSERT_FALSE(missing.ok());
    EXPECT_NE(missing.status().message().find("nope.xml"), std::string::npos);
    auto not_xml = Topology::load_xml(fixture("p5en.nics"), {});
    ASSERT_FALSE(not_xml.ok());
    EXPECT_NE(not_xml.status().message().find("p5en.nics"), std::string::npos)
        << not_xml.status().message();
    auto bad = parse_fabric_nics("efa rdmap20s0\n");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("line 1"), std::string::npos);
    bad = parse_fabric_nics("# comment\nefa rdmap20s0 0000:zz:00.0\n");
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("line 2"), std::string::npos) << bad.status().message();
}

TEST(Topology, PciBusIdsInTheFormsToolsWrite) {
    for (const char* text : {"0000:53:00.0", "00000000:53:00.0", "0000:53:00.0", "53:00.0"}) {
        auto id = PciBusId::parse(text);
        ASSERT_TRUE(id.ok()) << text << ": " << id.status().to_string();
        EXPECT_EQ(id->str(), "0000:53:00.0") << text;
    }
    EXPECT_EQ(PciBusId::parse("0000:AB:1F.7")->str(), "0000:ab:1f.7");
    for (const char* text : {"", "53", "0000:53:00", "0000:53:20.0", "0000:153:00.0", "x:53:00.0"})
        EXPECT_FALSE(PciBusId::parse(text).ok()) << text;
}

TEST(Topology, FabricNicsFromAnFiInfoList) {
    // efa lists each device twice (rdm and dgram endpoints): one NIC per domain name, with the
    // PCI address from nic->bus_attr; an entry without a nic has no address.
    fi_bus_attr bus{};
    bus.bus_type = FI_BUS_PCI;
    bus.attr.pci = {0, 0x4f, 0, 0};
    fid_nic nic{};
    nic.bus_attr = &bus;
    fi_info* a = fi_allocinfo();
    fi_info* b = fi_allocinfo();
    fi_info* c = fi_allocinfo();
    ASSERT_TRUE(a && b && c);
    a->next = b;
    b->next = c;
    a->domain_attr->name = strdup("rdmap79s0");
    b->domain_attr->name = strdup("rdmap79s0");
    c->domain_attr->name = strdup("lo");
    a->fabric_attr->prov_name = strdup("efa");
    c->fabric_attr->prov_name = strdup("tcp");
    a->nic = &nic;
    b->nic = &nic;
    auto nics = fabric_nics(a);
    a->nic = b->nic = nullptr;  // ours, not libfabric's to close
    fi_freeinfo(a);
    ASSERT_EQ(nics.size(), 2u);
    EXPECT_EQ(nics[0].domain, "rdmap79s0");
    EXPECT_EQ(nics[0].provider, "efa");
    ASSERT_TRUE(nics[0].pci.has_value());
    EXPECT_EQ(nics[0].pci->str(), "0000:4f:00.0");
    EXPECT_EQ(nics[1].domain, "lo");
    EXPECT_FALSE(nics[1].pci.has_value());
}

TEST(Topology, ThisMachineLoads) {
    auto t = Topology::load_this_machine(rdma_nics_here());
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    EXPECT_GE(t->numa_nodes().size(), 1u);
    for (const auto& n : t->numa_nodes()) EXPECT_EQ(n.rails.nics.size(), t->nics().size());
}

}  // namespace
}  // namespace ferry
