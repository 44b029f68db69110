// Regions on the rails nearest their memory (EngineConfig::rails), between real processes over
// tcp and shm: four rails stand in for four EFA devices of the p5en fixture (two on each NUMA
// node), and the per-rail counters show which rails a region's writes took.
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

class RailPlacementTest : public ::testing::TestWithParam<std::string> {
  protected:
    // Both ranks open engines with `config`; rank 0 writes one large and kSmallWrites small
    // pieces into rank 1's poisoned buffer. want(buffer) gives the rails rank 0's region must
    // be on: those, and only those, carry its bytes, and every byte arrives.
    void expect_writes_on(
        const EngineConfig& config,
        const std::function<Result<uint64_t>(const std::vector<uint8_t>&)>& want) {
        const size_t buf_size = kBig + kSmall * kSmallWrites;
        auto results = testing::run_processes(
            2,
            [&](testing::Exchange& ex) -> std::string {
                CHILD_ASSIGN_OK(testing::MeshNode n,
                                testing::make_mesh_node(ex, config, buf_size, kPoison));
                CHILD_ASSIGN_OK(uint64_t rails, want(n.buf));
                CHILD_CHECK_MSG(n.mr->descriptor().rail_mask == rails, "region on rails {:#b}",
                                n.mr->descriptor().rail_mask);
                if (ex.rank() == 1) {
                    CHILD_ASSIGN_OK(auto all, ex.allgather({}));
                    CHILD_CHECK_MSG(all[0].size() == 4, "rank 0 failed before it wrote");
                    uint32_t expect = 0;
                    std::memcpy(&expect, all[0].data(), 4);
                    CHILD_CHECK_OK(n.engine->wait_imm(kImm, expect, kWait));
                    std::vector<uint8_t> want_bytes(buf_size);
                    for (size_t i = 0; i < buf_size; ++i) want_bytes[i] = byte_at(i);
                    std::string diff = bytes_wrong(n.buf, want_bytes);
                    CHILD_CHECK_MSG(diff.empty(), "{}", diff);
                    return "";
                }
                for (size_t i = 0; i < buf_size; ++i) n.buf[i] = byte_at(i);
                std::vector<OpHandle> ops;
                ops.push_back(
                    n.engine->write({n.peer[1], n.mr.get(), 0, &n.desc[1], 0, kBig, kImm}));
                for (int i = 0; i < kSmallWrites; ++i) {
                    uint64_t off = kBig + uint64_t(i) * kSmall;
                    ops.push_back(n.engine->write(
                        {n.peer[1], n.mr.get(), off, &n.desc[1], off, kSmall, kImm}));
                }
                uint32_t pieces = 0;
                for (auto& h : ops) {
                    CHILD_CHECK_OK(h.wait(kWait));
                    pieces += h.imm_writes();
                }
                ByteWriter bw;
                bw.put(pieces);
                CHILD_CHECK(ex.allgather(bw.bytes()).ok());
                auto per_rail = n.engine->rail_stats();
                CHILD_CHECK(per_rail.size() == 4);
                uint64_t total = 0;
                for (size_t r = 0; r < per_rail.size(); ++r) {
                    const bool used = rails >> r & 1;
                    // Striped over every rail of the region; nothing at all on the others.
                    CHILD_CHECK_MSG(
                        used ? per_rail[r].bytes_posted > 0
                             : per_rail[r].bytes_posted == 0 && per_rail[r].ops_posted == 0,
                        "rail {} (region on {:#b}) posted {} bytes in {} ops", r, rails,
                        per_rail[r].bytes_posted, per_rail[r].ops_posted);
                    total += per_rail[r].bytes_posted;
                }
                CHILD_CHECK_MSG(total == buf_size, "{} bytes posted, {} written", total, buf_size);
                return "";
            },
            kRunTimeout);
        EXPECT_EQ(testing::describe_failures(results), "");
    }
};

TEST_P(RailPlacementTest, HostMemoryWritesOnlyOnItsNumaNodesRails) {
    if (!numa_known()) GTEST_SKIP() << "move_pages(2) does not say where pages are here";
    expect_writes_on(rails_config(GetParam(), kNuma1First),
                     [](const std::vector<uint8_t>& b) { return near_rails(b, true); });
}

TEST_P(RailPlacementTest, NoNicOnTheNumaNodeFallsBackToEveryRail) {
    // All four NICs on NUMA node 1 and the memory on node 0: none is nearer, so all of them
    // (on a host whose memory is on node 1 they are all near: every rail either way).
    expect_writes_on(rails_config(GetParam(), kAllNuma1),
                     [](const std::vector<uint8_t>&) -> Result<uint64_t> { return 0b1111; });
}

TEST_P(RailPlacementTest, AllOverridesNearest) {
    expect_writes_on(rails_config(GetParam(), kNuma1First, "all"),
                     [](const std::vector<uint8_t>&) -> Result<uint64_t> { return 0b1111; });
}

TEST_P(RailPlacementTest, ExplicitListPicksThoseNics) {
    expect_writes_on(rails_config(GetParam(), kNuma1First, "rdmap117s0, rdmap20s0"),
                     [](const std::vector<uint8_t>&) -> Result<uint64_t> { return 0b0110; });
}

TEST_P(RailPlacementTest, NoRailHoldingBothRegionsFailsNamingBothSets) {
    if (!numa_known()) GTEST_SKIP() << "move_pages(2) does not say where pages are here";
    // Rank 0 puts its memory on rails 2,3 (or 0,1), rank 1 on the other two: rail r here talks
    // to the peer's rail r, so no rail holds both. Every operation fails at once, naming both
    // sets, and nothing is posted.
    auto results = testing::run_processes(
        2,
        [&](testing::Exchange& ex) -> std::string {
            const bool numa1_first = ex.rank() == 0;
            EngineConfig c = rails_config(GetParam(), numa1_first ? kNuma1First : kNuma0First);
            CHILD_ASSIGN_OK(testing::MeshNode n, testing::make_mesh_node(ex, c, kBig, kPoison));
            CHILD_ASSIGN_OK(uint64_t mine, near_rails(n.buf, numa1_first));
            CHILD_CHECK(n.mr->descriptor().rail_mask == mine);
            if (ex.rank() == 0) {
                std::vector<OpHandle> ops;
                ops.push_back(n.engine->write({n.peer[1], n.mr.get(), 0, &n.desc[1], 0, 64, kImm}));
                ops.push_back(n.engine->write({n.peer[1], n.mr.get(), 0, &n.desc[1], 0, kBig}));
                ops.push_back(n.engine->read({n.peer[1], n.mr.get(), 0, &n.desc[1], 0, 4096}));
                std::vector<WriteRun> runs = {{0, 0, 4096}, {8192, 8192, 4096}};
                ops.push_back(
                    n.engine->write_runs({n.peer[1], n.mr.get(), &n.desc[1], runs, kImm}));
                for (auto& h : ops) {
                    Status s = h.wait(kWait);
                    CHILD_CHECK_MSG(s.code() == StatusCode::kInvalidArgument, "{}", s.to_string());
                    const std::string& m = s.message();
                    CHILD_CHECK_MSG(m.find("no rail holds both regions") != std::string::npos &&
                                        m.find("rails 0,1") != std::string::npos &&
                                        m.find("rails 2,3") != std::string::npos,
                                    "{}", m);
                }
                for (const auto& r : n.engine->rail_stats()) CHILD_CHECK(r.ops_posted == 0);
            }
            CHILD_CHECK(ex.barrier().ok());
            if (ex.rank() == 1) {
                CHILD_CHECK(std::all_of(n.buf.begin(), n.buf.end(),
                                        [](uint8_t b) { return b == kPoison; }));
            }
            return "";
        },
        kRunTimeout);
    EXPECT_EQ(testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, RailPlacementTest,
                         ::testing::ValuesIn(testing::test_providers()),
                         [](const auto& info) { return info.param; });

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
