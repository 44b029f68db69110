// Connecting to peers: what a connect that fails part-way leaves behind (nothing), on every
// provider this machine has (tcp, shm), with engines of two rails.
#include "fabric/peer_table.h"

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fabric/engine_impl.h"
#include "support/engine_fixture.h"
#include "support/multiproc.h"

namespace ferry::detail {
namespace {

using std::chrono::seconds;

class PeerTableTest : public ::testing::TestWithParam<std::string> {};

// The peer addresses in each rail's address vector now.
std::vector<uint64_t> addresses(EngineImpl& e) {
    std::vector<uint64_t> n;
    for (size_t r = 0; r < e.rails.size(); ++r) {
        n.push_back(e.rails[r].stats().peer_addresses.load());
    }
    return n;
}

// A connect whose rail-1 address is refused has already inserted the peer's rail 0 (every
// local rail inserts every peer rail). It must take those entries back: left there, they have
// no owner and are never removed (a process that retries a bad address leaks them per try). A
// later connect with the right address works, over both rails, bytes checked.
TEST_P(PeerTableTest, AConnectThatFailsOnALaterRailLeavesNoAddressBehind) {
    const uint64_t seed = ::ferry::testing::test_seed("ConnectRollback");
    const std::string provider = GetParam();
    auto results = ::ferry::testing::run_processes(
        1,
        [&](::ferry::testing::Exchange&) -> std::string {
            EngineConfig c = ::ferry::testing::test_engine_config(provider);
            c.num_rails = 2;
            auto a = std::make_shared<EngineImpl>();
            auto b = std::make_shared<EngineImpl>();
            CHILD_CHECK_OK(a->init(c));
            CHILD_CHECK_OK(b->init(c));
            CHILD_CHECK(a->rails.size() == 2 && b->address.rail_addrs.size() == 2);
            CHILD_CHECK(addresses(*a) == std::vector<uint64_t>({0, 0}));

            std::mt19937_64 rng(seed);
            for (int round = 0; round < 3; ++round) {
                EngineAddress bad = b->address;
                // Garbage of a wrong length, without a string terminator: no provider's address.
                bad.rail_addrs[1].assign(1 + rng() % 7, 0);
                for (auto& byte : bad.rail_addrs[1]) byte = static_cast<uint8_t>('a' + rng() % 26);
                Result<PeerId> r = a->connect(bad);
                CHILD_CHECK_MSG(!r.ok(), "round {}: a garbage address was accepted", round);
                CHILD_CHECK_MSG(
                    r.status().code() == StatusCode::kInvalidArgument &&
                        r.status().message().find("the peer's rail 1") != std::string::npos,
                    "round {}: {}", round, r.status().to_string());
                std::vector<uint64_t> left = addresses(*a);
                CHILD_CHECK_MSG(left == std::vector<uint64_t>({0, 0}),
                                "round {}: the failed connect left {} address(es) on rail 0 and {} "
                                "on rail 1",
                                round, left[0], left[1]);
            }

            CHILD_ASSIGN_OK(PeerId peer, a->connect(b->address));
            // Both of b's rails on each rail of a.
            CHILD_CHECK(addresses(*a) == std::vector<uint64_t>({2, 2}));
            CHILD_ASSIGN_OK(PeerId again, a->connect(b->address));
            CHILD_CHECK(again == peer && addresses(*a) == std::vector<uint64_t>({2, 2}));

            // A read above the stripe threshold goes out as one piece per rail.
            const size_t kLen = 3 << 20;
            std::vector<uint8_t> remote(kLen), local(kLen, 0);
            for (auto& byte : remote) byte = static_cast<uint8_t>(rng());
            CHILD_ASSIGN_OK(auto rmr,
                            b->register_memory(remote.data(), kLen, MemoryKind::kHost, -1));
            CHILD_ASSIGN_OK(auto lmr,
                            a->register_memory(local.data(), kLen, MemoryKind::kHost, -1));
            const MemoryDescriptor desc = rmr->descriptor();
            const uint64_t posted_before = a->stats().ops_posted;
            ReadOp rd{peer, lmr.get(), 0, &desc, 0, kLen};
            CHILD_CHECK_OK(a->read(rd, OpCallback{}).wait(seconds(20)));
            CHILD_CHECK_MSG(a->stats().ops_posted - posted_before == 2, "{} pieces",
                            a->stats().ops_posted - posted_before);
            CHILD_CHECK_MSG(local == remote, "the read brought other bytes (seed {})", seed);
            lmr.reset();
            rmr.reset();
            a->shutdown();
            b->shutdown();
            return "";
        },
        seconds(120));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, PeerTableTest,
                         ::testing::ValuesIn(::ferry::testing::test_providers()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry::detail
