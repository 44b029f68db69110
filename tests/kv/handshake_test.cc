#include "ferry/kv/handshake.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv/kv_fixture.h"

namespace ferry::kv {
namespace {

using ::ferry::testing::Exchange;
using ::ferry::testing::run_processes;
using testing::kPoison;

const auto kTimeout = std::chrono::seconds(5);

HandshakeInfo fake_info() {
    HandshakeInfo h;
    h.address.engine_id = 0x42;
    h.address.provider = "tcp;ofi_rxm";
    h.address.host_id = "host-a";
    h.address.rail_addrs = {{1, 2, 3, 4}};
    h.address.signal.engine_id = 0x42;
    h.address.signal.length = 64;
    h.address.signal.rail_keys = {1};
    h.layout = testing::test_layout(2, 16, BlockOrder::kNHD, KvPlacement::kSeparate, 8);
    h.pool.engine_id = 0x42;
    h.pool.base = 0x1000;
    h.pool.length = h.layout.pool_bytes();
    h.pool.rail_keys = {7};
    h.tp_rank = 1;
    h.tp_size = 2;
    return h;
}

TEST(Handshake, ServesInfoAndRefusesAnIncompatibleCaller) {
    HandshakeInfo info = fake_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info);
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    uint64_t hash = info.layout.compatibility_hash();
    auto got = fetch_handshake("127.0.0.1", (*server)->port(), hash, kTimeout);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(got->epoch, (*server)->epoch());
    EXPECT_NE(got->epoch, 0u);
    info.epoch = got->epoch;
    EXPECT_EQ(got->serialize(), info.serialize());

    auto bad = fetch_handshake("127.0.0.1", (*server)->port(), hash ^ 1, kTimeout);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("incompatible KV layout"), std::string::npos)
        << bad.status().message();
}

TEST(Handshake, CacheAnswersRepeatsAndDetectsARestartedPeer) {
    HandshakeInfo info = fake_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info);
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    uint16_t port = (*server)->port();
    HandshakeCache cache(info.layout.compatibility_hash());
    auto a = cache.get("127.0.0.1", port, kTimeout);
    auto b = cache.get("127.0.0.1", port, kTimeout);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ((*server)->requests_served(), 1u);
    EXPECT_EQ(a->epoch, b->epoch);

    // Same port, new process start: a new epoch.
    server->reset();
    auto again = HandshakeServer::start("127.0.0.1", port, info);
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    auto r = cache.refresh("127.0.0.1", port, kTimeout);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_TRUE(r->restarted);
    EXPECT_EQ(r->info.epoch, (*again)->epoch());
    r = cache.refresh("127.0.0.1", port, kTimeout);
    ASSERT_TRUE(r.ok());
    EXPECT_FALSE(r->restarted);
}

TEST(Handshake, DeadOrSilentPeerIsAnErrorWithinTheTimeout) {
    // Nobody listens: refused at once.
    int probe = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    ASSERT_EQ(::bind(probe, reinterpret_cast<sockaddr*>(&addr), len), 0);
    ::getsockname(probe, reinterpret_cast<sockaddr*>(&addr), &len);
    uint16_t port = ntohs(addr.sin_port);
    auto r = fetch_handshake("127.0.0.1", port, 1, kTimeout);
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().to_string();

    // Listening but never answering: a timeout, on time.
    ASSERT_EQ(::listen(probe, 4), 0);
    TimePoint t0 = Clock::now();
    r = fetch_handshake("127.0.0.1", port, 1, std::chrono::milliseconds(200));
    Duration took = Clock::now() - t0;
    EXPECT_EQ(r.status().code(), StatusCode::kTimeout) << r.status().to_string();
    EXPECT_LT(took, std::chrono::seconds(2));
    ::close(probe);
}

TEST(Handshake, InfoTruncatedAnywhereIsRefused) {
    auto blob = fake_info().serialize();
    for (size_t cut = 0; cut < blob.size(); ++cut) {
        auto r = HandshakeInfo::deserialize(std::span<const uint8_t>(blob).first(cut));
        ASSERT_FALSE(r.ok()) << cut;
        EXPECT_EQ(r.status().code(), StatusCode::kProtocol);
    }
    blob.push_back(0);
    EXPECT_FALSE(HandshakeInfo::deserialize(blob).ok());
}

class HandshakePushTest : public ::testing::TestWithParam<std::string> {};

// Decode learns prefill's engine, pool and layout through the side channel only (the test
// exchange carries just the port), then pushes and checks every byte.
TEST_P(HandshakePushTest, PushWithAddressesFromTheSideChannel) {
    std::string provider = GetParam();
    auto results = run_processes(
        2,
        [&](Exchange& ex) -> std::string {
            testing::NodeOptions opt;
            opt.provider = provider;
            KvRank self{testing::test_layout(4, 16, BlockOrder::kNHD, KvPlacement::kJoint, 32), 0,
                        1};
            CHILD_ASSIGN_OK(auto node,
                            testing::make_kv_node(ex, self, opt, 3, ex.rank() == 0 ? 0 : kPoison));
            auto& n = *node;
            std::unique_ptr<HandshakeServer> server;
            ByteWriter w;
            if (ex.rank() == 0) {
                HandshakeInfo info{0, n.engine->address(), n.mr->descriptor(), self.layout, 0, 1};
                CHILD_ASSIGN_OK(server, HandshakeServer::start("127.0.0.1", 0, info));
                w.put<uint16_t>(server->port());
            }
            CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
            uint16_t port = 0;
            std::memcpy(&port, all[0].data(), 2);
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(5));
            const uint64_t id = 0x99;
            if (ex.rank() == 1) {
                HandshakeCache cache(self.layout.compatibility_hash());
                CHILD_ASSIGN_OK(auto info, cache.get("127.0.0.1", port, kTimeout));
                CHILD_CHECK(info.tp_size == 1 && info.layout == self.layout);
                CHILD_CHECK_OK(n.conn->register_push({id, 1, {info.address}, blocks, 77}));
                CHILD_ASSIGN_OK(auto r, n.results.wait(false, id, std::chrono::seconds(20)));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
                std::vector<uint8_t> image(n.mem.size(), kPoison);
                testing::expect_request(self, image, id, blocks, 77);
                std::string diff = testing::compare_pool(n.mem, image);
                CHILD_CHECK_MSG(diff.empty(), "{}", diff);
            } else {
                testing::fill_request(n, id, blocks, 77);
                CHILD_CHECK_OK(n.conn->prefill_done(id, blocks, 77));
                CHILD_ASSIGN_OK(auto r, n.results.wait(true, id, std::chrono::seconds(20)));
                CHILD_CHECK_MSG(r.status.ok(), "{}", r.status.to_string());
            }
            CHILD_CHECK_OK(n.blocks->free(blocks));
            CHILD_CHECK_OK(ex.barrier());
            return "";
        },
        std::chrono::seconds(60));
    EXPECT_EQ(::ferry::testing::describe_failures(results), "");
}

INSTANTIATE_TEST_SUITE_P(Providers, HandshakePushTest, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace ferry::kv
