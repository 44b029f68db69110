// Which NIC pairs carry a transfer between two nodes (RailRoute): the local memory's nearest
// NICs to the peer's NICs nearest its memory, as the peer's descriptor names them. Decided on
// the hwloc XML fixtures of p5en-, p4d- and DGX H100-like nodes, two of a kind facing each
// other, through the same Topology answers the engine puts in a region's near_mask.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fabric/peer_table.h"
#include "fabric/rail_placement.h"
#include "ferry/fabric/topology.h"

namespace ferry::detail {
namespace {

Topology load(const std::string& stem) {
    const std::string dir = FERRY_TOPOLOGY_FIXTURES;
    std::ifstream in(dir + "/" + stem + ".nics");
    std::stringstream text;
    text << in.rdbuf();
    auto nics = parse_fabric_nics(text.str());
    EXPECT_TRUE(nics.ok()) << nics.status().to_string();
    auto topo =
        Topology::load_xml(dir + "/" + stem + ".xml", nics.ok() ? *nics : std::vector<FabricNic>{});
    EXPECT_TRUE(topo.ok()) << topo.status().to_string();
    return topo.ok() ? *topo : Topology{};
}

RailSet set_of(const RailChoice& c) {
    RailSet s = 0;
    for (int r : c.nics) s |= RailSet{1} << r;
    return s;
}

// GPU k's memory on one node, GPU j's on the other, both nodes alike.
RailRoute gpu_to_gpu(const Topology& t, size_t k, size_t j) {
    return route_rails(set_of(t.gpus()[k].rails), set_of(t.gpus()[j].rails));
}

// Every local rail of the route, and the peer rail it pairs with, as NIC names.
std::vector<std::string> nic_pairs(const Topology& t, const RailRoute& r) {
    std::vector<std::string> out;
    for (RailSet l = r.local; l; l &= l - 1) {
        const int rail = __builtin_ctzll(l);
        out.push_back(t.nics()[rail].fabric.domain + "->" +
                      t.nics()[r.peer_rail(rail)].fabric.domain);
    }
    return out;
}

TEST(RailRoute, P5enGpuToSameGpuGoesNicToMatchingNicOnItsSwitch) {
    Topology t = load("p5en");
    ASSERT_EQ(t.gpus().size(), 8u);
    for (size_t k = 0; k < 8; ++k) {
        const RailSet own = set_of(t.gpus()[k].rails);
        ASSERT_EQ(__builtin_popcountll(own), 2) << "GPU " << k;
        RailRoute r = gpu_to_gpu(t, k, k);
        EXPECT_TRUE(r.common) << "GPU " << k;
        EXPECT_EQ(r.local, own) << "GPU " << k;  // both NICs of its switch, nothing else
        for (RailSet l = r.local; l; l &= l - 1) {
            const int rail = __builtin_ctzll(l);
            EXPECT_EQ(r.peer_rail(rail), rail) << "GPU " << k;  // the peer's GPU k's NIC
        }
    }
    // GPU 0 (bus 0x13) sits under the switch of rdmap20s0/rdmap21s0, rails 0 and 1.
    EXPECT_EQ(nic_pairs(t, gpu_to_gpu(t, 0, 0)),
              (std::vector<std::string>{"rdmap20s0->rdmap20s0", "rdmap21s0->rdmap21s0"}));
}

TEST(RailRoute, P5enGpuToAnotherGpuPairsTheNicsOfBothSwitches) {
    // GPU k to the peer's GPU j: no rail is near both, so GPU k's first NIC writes to GPU j's
    // first NIC and its second to the second: each end under its own GPU's switch, the pair
    // crossing rails in the network. Both of GPU j's NICs are used.
    Topology t = load("p5en");
    for (size_t k = 0; k < 8; ++k) {
        for (size_t j = 0; j < 8; ++j) {
            if (j == k) continue;
            const RailSet mine = set_of(t.gpus()[k].rails), theirs = set_of(t.gpus()[j].rails);
            RailRoute r = gpu_to_gpu(t, k, j);
            EXPECT_FALSE(r.common) << k << "->" << j;
            EXPECT_EQ(r.local, mine) << k << "->" << j;
            RailSet landed = 0;
            for (RailSet l = r.local; l; l &= l - 1)
                landed |= RailSet{1} << r.peer_rail(__builtin_ctzll(l));
            EXPECT_EQ(landed, theirs) << k << "->" << j;
        }
    }
    EXPECT_EQ(gpu_to_gpu(t, 0, 3).pairs_text(), "0->6,1->7");
    EXPECT_EQ(nic_pairs(t, gpu_to_gpu(t, 0, 3)),
              (std::vector<std::string>{"rdmap20s0->rdmap68s0", "rdmap21s0->rdmap69s0"}));
}

TEST(RailRoute, P5enHostMemoryAndGpu) {
    Topology t = load("p5en");
    ASSERT_EQ(t.numa_nodes().size(), 2u);
    const RailSet numa0 = set_of(t.numa_nodes()[0].rails);
    ASSERT_EQ(numa0, RailSet{0xff});
    // Host memory on NUMA node 0 into the peer's GPU 1 (a NUMA node 0 GPU): the two rails of
    // GPU 1's switch are near both, so only those carry it, rail to same rail.
    RailRoute in = route_rails(numa0, set_of(t.gpus()[1].rails));
    EXPECT_TRUE(in.common);
    EXPECT_EQ(in.pairs_text(), "2->2,3->3");
    // Into the peer's GPU 5 (NUMA node 1): all eight NUMA node 0 rails carry it, four onto
    // each of GPU 5's two NICs.
    RailRoute far = route_rails(numa0, set_of(t.gpus()[5].rails));
    EXPECT_FALSE(far.common);
    EXPECT_EQ(far.pairs_text(), "0->10,1->11,2->10,3->11,4->10,5->11,6->10,7->11");
}

TEST(RailRoute, P4dTwoGpusShareANic) {
    // p4d: 4 EFA devices, GPUs 2i and 2i+1 under NIC i's switch.
    Topology t = load("p4d");
    ASSERT_EQ(t.gpus().size(), 8u);
    RailRoute same_switch = gpu_to_gpu(t, 0, 1);
    EXPECT_TRUE(same_switch.common);
    EXPECT_EQ(same_switch.pairs_text(), "0->0");
    RailRoute other = gpu_to_gpu(t, 0, 5);
    EXPECT_FALSE(other.common);
    EXPECT_EQ(other.pairs_text(), "0->2");
}

TEST(RailRoute, DgxGpuKToGpuJUsesNicKToNicJ) {
    Topology t = load("dgx_h100");
    ASSERT_EQ(t.gpus().size(), 8u);
    for (size_t k = 0; k < 8; ++k) {
        for (size_t j = 0; j < 8; ++j) {
            RailRoute r = gpu_to_gpu(t, k, j);
            EXPECT_EQ(r.common, k == j);
            EXPECT_EQ(r.pairs_text(),
                      fmt::format("{}->{}", t.gpus()[k].rails.nics[0], t.gpus()[j].rails.nics[0]));
        }
    }
}

TEST(RailRoute, UnevenSetsAndNothingToRoute) {
    // Three local rails onto two remote ones: round the remote ones, in rank order.
    EXPECT_EQ(route_rails(0b0111, 0b110000).pairs_text(), "0->4,1->5,2->4");
    // Interleaved rail numbers pair by rank, not by index.
    EXPECT_EQ(route_rails(0b1010, 0b0101).pairs_text(), "1->0,3->2");
    EXPECT_EQ(route_rails(0, 0b11).local, 0u);
    EXPECT_EQ(route_rails(0b11, 0).local, 0u);
}

TEST(RailRoute, PeerReadsTheNearRailsFromTheDescriptor) {
    Peer p;
    p.peer_rails = 4;
    MemoryDescriptor d;
    d.rail_keys = {1, 2, 3, 4};
    d.rail_mask = 0b1111;
    d.near_mask = 0b1100;
    EXPECT_EQ(p.near_rails(d), 0b1100u);
    // A descriptor naming no near rail it is held on: every rail holding it.
    d.near_mask = 0;
    EXPECT_EQ(p.near_rails(d), 0b1111u);
    // Rails the peer does not have are never aimed at.
    d.rail_keys = {1, 2, 3, 4, 5, 6, 7, 8};
    d.rail_mask = 0b11000000;
    d.near_mask = 0b11000000;
    EXPECT_EQ(p.near_rails(d), 0u);
}

}  // namespace
}  // namespace ferry::detail
