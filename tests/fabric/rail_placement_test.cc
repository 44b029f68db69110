// Regions sent on the rails nearest their memory (EngineConfig::rails), between real processes
// over tcp and shm: four rails stand in for four EFA devices of the p5en fixture (two on each
// NUMA node), and the per-rail counters show which rails a region's writes and reads took.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ferry/common/bytes.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/topology.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry {
namespace {

constexpr uint8_t kPoison = 0xCD;
constexpr uint32_t kImm = 9;
constexpr size_t kBig = 8 << 20;  // above stripe_threshold: one piece per usable rail
constexpr size_t kSmall = 4096;   // one piece each, rotated over the usable rails
constexpr uint64_t kEveryRail = 0b1111;
constexpr int kSmallWrites = 16;
const auto kRunTimeout = std::chrono::seconds(120);
const auto kWait = std::chrono::seconds(20);

const std::string kFixture = std::string(FERRY_TOPOLOGY_FIXTURES) + "/p5en.xml";
// p5en EFA devices: rdmap20s0/21s0 sit on NUMA node 0, rdmap116s0/117s0 and 132s0/133s0 on 1.
const std::string kNuma1First =
    "efa rdmap116s0 0000:74:00.0\nefa rdmap117s0 0000:75:00.0\n"
    "efa rdmap20s0 0000:14:00.0\nefa rdmap21s0 0000:15:00.0\n";
const std::string kNuma0First =
    "efa rdmap20s0 0000:14:00.0\nefa rdmap21s0 0000:15:00.0\n"
    "efa rdmap116s0 0000:74:00.0\nefa rdmap117s0 0000:75:00.0\n";
const std::string kAllNuma1 =
    "efa rdmap116s0 0000:74:00.0\nefa rdmap117s0 0000:75:00.0\n"
    "efa rdmap132s0 0000:84:00.0\nefa rdmap133s0 0000:85:00.0\n";

EngineConfig rails_config(const std::string& provider, const std::string& nics,
                          const std::string& rails = "nearest") {
    EngineConfig c = testing::test_engine_config(provider);
    c.num_rails = 4;
    c.stripe_threshold = 1 << 20;
    c.topology_xml = kFixture;
    c.rail_nics = nics;
    c.rails = rails;
    return c;
}

// The rails of kNuma1First / kNuma0First on the NUMA node of this host's memory: the test
// needs the kernel to say where the pages are (move_pages).
Result<uint64_t> near_rails(const std::vector<uint8_t>& buf, bool numa1_first) {
    int node = numa_node_of(buf.data(), buf.size());
    if (node != 0 && node != 1) {
        return unavailable(fmt::format("the buffer's NUMA node is {}, not 0 or 1", node));
    }
    return (node == 1) == numa1_first ? uint64_t{0b0011} : uint64_t{0b1100};
}

// Whether the kernel says where this process's pages are: move_pages(2) may be refused (a
// container's seccomp profile without CAP_SYS_NICE), and every region then goes on all rails.
bool numa_known() {
    std::vector<uint8_t> probe(1 << 16, 1);
    return numa_node_of(probe.data(), probe.size()) >= 0;
}

std::string bytes_wrong(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want) {
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
    return bad ? fmt::format("{} of {} bytes wrong", bad, got.size()) : "";
}

uint8_t byte_at(size_t i) { return static_cast<uint8_t>(i * 131 + (i >> 12)); }

using Want = std::function<Result<uint64_t>(const std::vector<uint8_t>&)>;
Want exactly(uint64_t rails) {
    return [rails](const std::vector<uint8_t>&) -> Result<uint64_t> { return rails; };
}

class RailPlacementTest : public ::testing::TestWithParam<std::string> {
  protected:
    // Rank r opens its engine with configs[r] and registers a poisoned buffer; registered[r]
    // and send[r] give the rails its region must be registered on (descriptor rail_mask) and
    // is near (send_rails, descriptor near_mask). Rank 0 writes one large and kSmallWrites
    // small pieces into rank 1's buffer, scatters the large part to it once more, then reads
    // it back into its own poisoned copy. The rails near both regions carry them, NIC to matching
    // NIC, when there are any: on both sides those rails and no other. Else (expect_cross) rank 0's
    // near rails carry them to rank 1's near rails, counted in rail_fallbacks: rank 0 posts only on
    // its near rails and rank 1's immediates arrive only on its near rails. Every byte arrives.
    void expect_transfers_on(const std::vector<EngineConfig>& configs,
                             const std::vector<Want>& registered, const std::vector<Want>& send,
                             bool expect_cross) {
        const size_t buf_size = kBig + kSmall * kSmallWrites;
        auto results = testing::run_processes(
            2,
            [&](testing::Exchange& ex) -> std::string {
                const int me = ex.rank();
                CHILD_ASSIGN_OK(testing::MeshNode n,
                                testing::make_mesh_node(ex, configs[me], buf_size, kPoison));
                CHILD_ASSIGN_OK(uint64_t reg, registered[me](n.buf));
                CHILD_ASSIGN_OK(uint64_t near, send[me](n.buf));
                CHILD_CHECK_MSG(n.mr->descriptor().rail_mask == reg, "region registered on {:#b}",
                                n.mr->descriptor().rail_mask);
                CHILD_CHECK_MSG(n.mr->send_rails() == near, "region sent on {:#b}",
                                n.mr->send_rails());
                CHILD_CHECK_MSG(n.mr->descriptor().near_mask == near, "descriptor near {:#b}",
                                n.mr->descriptor().near_mask);
                // Rank 0's near rails and rank 1's: the pairs NIC to matching NIC if any.
                const uint64_t near0 = n.desc[0].near_rails(), near1 = n.desc[1].near_rails();
                const uint64_t both = near0 & near1;
                std::vector<uint8_t> want_bytes(buf_size);
                for (size_t i = 0; i < buf_size; ++i) want_bytes[i] = byte_at(i);
                if (me == 1) {
                    CHILD_ASSIGN_OK(auto all, ex.allgather({}));
                    CHILD_CHECK_MSG(all[0].size() == 4, "rank 0 failed before it wrote");
                    uint32_t expect = 0;
                    std::memcpy(&expect, all[0].data(), 4);
                    CHILD_CHECK_OK(n.engine->wait_imm(kImm, expect, kWait));
                    std::string diff = bytes_wrong(n.buf, want_bytes);
                    CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                    // Receiver-side locality: the writes landed on this side's near rails.
                    const uint64_t landed = both ? both : near1;
                    auto per_rail = n.engine->rail_stats();
                    uint64_t arrivals = 0;
                    for (size_t r = 0; r < per_rail.size(); ++r) {
                        CHILD_CHECK_MSG((landed >> r & 1) ? per_rail[r].imm_arrivals > 0
                                                          : per_rail[r].imm_arrivals == 0,
                                        "rail {} (writes landing on {:#b}) had {} arrivals", r,
                                        landed, per_rail[r].imm_arrivals);
                        arrivals += per_rail[r].imm_arrivals;
                    }
                    CHILD_CHECK_MSG(arrivals == expect, "{} arrivals, {} written", arrivals,
                                    expect);
                    CHILD_CHECK(ex.barrier().ok());  // rank 0 reads it back
                    CHILD_CHECK(ex.barrier().ok());
                    return "";
                }
                const uint64_t used = both ? both : near0;
                CHILD_CHECK_MSG((both == 0) == expect_cross, "near rails {:#b}, peer's {:#b}",
                                near0, near1);
                std::memcpy(n.buf.data(), want_bytes.data(), buf_size);
                std::vector<OpHandle> ops;
                ops.push_back(
                    n.engine->write({n.peer[1], n.mr.get(), 0, &n.desc[1], 0, kBig, kImm}));
                for (int i = 0; i < kSmallWrites; ++i) {
                    uint64_t off = kBig + uint64_t(i) * kSmall;
                    ops.push_back(n.engine->write(
                        {n.peer[1], n.mr.get(), off, &n.desc[1], off, kSmall, kImm}));
                }
                // A scatter (what the MoE dispatch posts) takes the same route.
                CHILD_ASSIGN_OK(
                    GroupId group,
                    n.engine->create_group(std::vector<PeerId>{n.peer[1]}, std::vector{n.desc[1]}));
                const std::vector<ScatterSlice> slices = {{0, 0, 0, kBig}};
                ops.push_back(n.engine->scatter({group, n.mr.get(), slices, kImm}));
                uint32_t pieces = 0;
                for (auto& h : ops) {
                    CHILD_CHECK_OK(h.wait(kWait));
                    pieces += h.imm_writes();
                }
                ByteWriter bw;
                bw.put(pieces);
                CHILD_CHECK(ex.allgather(bw.bytes()).ok());
                CHILD_CHECK(ex.barrier().ok());
                std::fill(n.buf.begin(), n.buf.begin() + kBig, kPoison);
                CHILD_CHECK_OK(
                    n.engine->read({n.peer[1], n.mr.get(), 0, &n.desc[1], 0, kBig}).wait(kWait));
                std::string diff = bytes_wrong(n.buf, want_bytes);
                CHILD_CHECK_MSG(diff.empty(), "read back: {}", diff);
                CHILD_CHECK(ex.barrier().ok());
                auto per_rail = n.engine->rail_stats();
                CHILD_CHECK(per_rail.size() == 4);
                uint64_t total = 0;
                for (size_t r = 0; r < per_rail.size(); ++r) {
                    // Striped over every rail of `used`; nothing at all on the others.
                    CHILD_CHECK_MSG((used >> r & 1) ? per_rail[r].bytes_posted > 0
                                                    : per_rail[r].bytes_posted == 0 &&
                                                          per_rail[r].ops_posted == 0,
                                    "rail {} (operations on {:#b}) posted {} bytes in {} ops", r,
                                    used, per_rail[r].bytes_posted, per_rail[r].ops_posted);
                    total += per_rail[r].bytes_posted;
                }
                CHILD_CHECK_MSG(total == buf_size + 2 * kBig, "{} bytes posted, {} moved", total,
                                buf_size + 2 * kBig);
                const uint64_t fallbacks = n.engine->stats().rail_fallbacks;
                CHILD_CHECK_MSG(fallbacks == (expect_cross ? kSmallWrites + 3u : 0u),
                                "{} operations crossed rails", fallbacks);
                return "";
            },
            kRunTimeout);
        EXPECT_EQ(testing::describe_failures(results), "");
    }
    // Both ranks with `config`.
    void expect_transfers_on(const EngineConfig& config, const Want& registered, const Want& send) {
        expect_transfers_on({config, config}, {registered, registered}, {send, send}, false);
    }
};

TEST_P(RailPlacementTest, HostMemorySentOnlyOnItsNumaNodesRails) {
    if (!numa_known()) GTEST_SKIP() << "move_pages(2) does not say where pages are here";
    // Registered on the near two only (peers aim at them), sent on them.
    auto near = [](const std::vector<uint8_t>& b) { return near_rails(b, true); };
    expect_transfers_on(rails_config(GetParam(), kNuma1First), near, near);
}

TEST_P(RailPlacementTest, NoNicOnTheNumaNodeFallsBackToEveryRail) {
    // All four NICs on NUMA node 1 and the memory on node 0: none is nearer, so all of them
    // (on a host whose memory is on node 1 they are all near: every rail either way).
    expect_transfers_on(rails_config(GetParam(), kAllNuma1), exactly(kEveryRail),
                        exactly(kEveryRail));
}

TEST_P(RailPlacementTest, AllOverridesNearest) {
    expect_transfers_on(rails_config(GetParam(), kNuma1First, "all"), exactly(kEveryRail),
                        exactly(kEveryRail));
}

TEST_P(RailPlacementTest, ExplicitListPicksThoseNics) {
    expect_transfers_on(rails_config(GetParam(), kNuma1First, "rdmap117s0, rdmap20s0"),
                        exactly(0b0110), exactly(0b0110));
}

TEST_P(RailPlacementTest, PeerRegionNearOtherRailsGoesNicToItsNearNics) {
    if (!numa_known()) GTEST_SKIP() << "move_pages(2) does not say where pages are here";
    // A prefill on GPU0 writing into a decode region on GPU3: rank 0's memory is near rails
    // 0,1 (or 2,3), rank 1's near the other two. Rank 0 sends on its own near rails only, and
    // they write to rank 1's near rails (its descriptor says which): each end next to its
    // memory, across rails, counted; every byte arrives.
    auto near0 = [](const std::vector<uint8_t>& b) { return near_rails(b, true); };
    auto near1 = [](const std::vector<uint8_t>& b) { return near_rails(b, false); };
    expect_transfers_on(
        {rails_config(GetParam(), kNuma1First), rails_config(GetParam(), kNuma0First)},
        {near0, near1}, {near0, near1}, true);
}

TEST_P(RailPlacementTest, PeerRegionOnlyOnFarRailsIsReachedFromTheNearOnes) {
    if (!numa_known()) GTEST_SKIP() << "move_pages(2) does not say where pages are here";
    // Rank 1 lists the NICs away from rank 0's memory (rails 2,3 when its memory is on node 1,
    // else 0,1 — with kNuma1First, rdmap116s0/117s0 are rails 0,1): rank 0's near rails write
    // to those, counted once each, bytes intact.
    auto near0 = [](const std::vector<uint8_t>& b) { return near_rails(b, true); };
    std::vector<uint8_t> probe_buf(1 << 16, 1);
    auto probe = near_rails(probe_buf, true);
    ASSERT_TRUE(probe.ok()) << probe.status().to_string();
    const bool far_is_23 = *probe == 0b0011;
    const std::string far_list = far_is_23 ? "rdmap20s0,rdmap21s0" : "rdmap116s0,rdmap117s0";
    expect_transfers_on(
        {rails_config(GetParam(), kNuma1First), rails_config(GetParam(), kNuma1First, far_list)},
        {near0, exactly(far_is_23 ? 0b1100 : 0b0011)},
        {near0, exactly(far_is_23 ? 0b1100 : 0b0011)}, true);
}

TEST_P(RailPlacementTest, ListsWithNoRailInCommonPairTheListedNics) {
    // Rank 0 lists the NICs of rails 0,1, rank 1 those of rails 2,3: no rail holds both
    // regions, yet rank 0's rail 0 writes to rank 1's rail 2 and rail 1 to rail 3.
    expect_transfers_on({rails_config(GetParam(), kNuma1First, "rdmap116s0,rdmap117s0"),
                         rails_config(GetParam(), kNuma1First, "rdmap20s0,rdmap21s0")},
                        {exactly(0b0011), exactly(0b1100)}, {exactly(0b0011), exactly(0b1100)},
                        true);
}

INSTANTIATE_TEST_SUITE_P(Providers, RailPlacementTest,
                         ::testing::ValuesIn(testing::test_providers()),
                         [](const auto& info) { return info.param; });

// A descriptor naming only rails its peer does not have (another engine's, or corrupted) has
// no rail pair at all: the write fails at once naming both sets, and nothing is posted.
TEST(RailPlacement, ADescriptorOnRailsThePeerLacksFailsNamingBothSets) {
    auto results = testing::run_processes(
        1,
        [&](testing::Exchange&) -> std::string {
            EngineConfig c = testing::test_engine_config("tcp");
            c.num_rails = 2;
            CHILD_ASSIGN_OK(auto a, TransferEngine::create(c));
            CHILD_ASSIGN_OK(auto b, TransferEngine::create(c));
            std::vector<uint8_t> src(4096, 1), dst(4096, kPoison);
            CHILD_ASSIGN_OK(auto smr, a->register_memory(src.data(), src.size()));
            CHILD_ASSIGN_OK(auto dmr, b->register_memory(dst.data(), dst.size()));
            CHILD_ASSIGN_OK(PeerId peer, a->connect(b->address()));
            MemoryDescriptor d = dmr->descriptor();
            d.rail_keys = {0, 0, d.rail_keys[0], d.rail_keys[1]};  // as if on rails 2,3
            d.rail_mask = d.near_mask = 0b1100;
            Status s = a->write({peer, smr.get(), 0, &d, 0, 4096, kImm}).wait(kWait);
            CHILD_CHECK_MSG(
                s.code() == StatusCode::kInvalidArgument &&
                    s.message().find("no rail pair reaches both regions") != std::string::npos &&
                    s.message().find("rails 0,1 of this engine") != std::string::npos &&
                    s.message().find("remote region on rails 2,3") != std::string::npos,
                "{}", s.to_string());
            for (const auto& r : a->rail_stats()) CHILD_CHECK(r.ops_posted == 0);
            CHILD_CHECK(
                std::all_of(dst.begin(), dst.end(), [](uint8_t x) { return x == kPoison; }));
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

// Settings that cannot work fail at create(), naming the setting.
TEST(RailPlacement, BadSettingsNameTheSetting) {
    struct Case {
        std::string rails, nics, xml, says;
    } cases[] = {
        {"rdmap20s0,,rdmap21s0", kNuma1First, kFixture, "EngineConfig::rails"},
        {"rdmap99s0", kNuma1First, kFixture, "NIC 'rdmap99s0', which is not here"},
        {"nearest", "efa rdmap20s0 0000:14:00.0\n", kFixture,
         "rail_nics lists 1 NICs but the engine opens 4 rails"},
        {"nearest", "efa rdmap20s0 zz\n", kFixture, "EngineConfig::rail_nics"},
        {"nearest", kNuma1First, "/nonexistent/p5en.xml", "EngineConfig::topology_xml"},
    };
    for (const auto& c : cases) {
        EngineConfig config = rails_config("tcp", c.nics, c.rails);
        config.topology_xml = c.xml;
        auto e = TransferEngine::create(config);
        ASSERT_FALSE(e.ok()) << c.says;
        EXPECT_NE(e.status().message().find(c.says), std::string::npos) << e.status().message();
    }
}

}  // namespace
}  // namespace ferry
