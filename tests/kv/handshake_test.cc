#include "ferry/kv/handshake.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "ferry/common/bytes.h"
#include "kv/kv_fixture.h"
#include "support/timing.h"

namespace ferry::kv {
namespace {

using namespace testing;

const auto kTimeout = std::chrono::seconds(5);

// The same in every process of a test (the push test runs two).
Secret test_secret(uint8_t fill = 0x5a) {
    return Secret::from_bytes(std::vector<uint8_t>(32, fill)).value();
}
HandshakeServerOptions options(Secret s = test_secret()) {
    HandshakeServerOptions o;
    o.secret = std::move(s);
    return o;
}

template <typename F>
bool eventually_ok(F pred, Duration budget = std::chrono::seconds(3)) {
    TimePoint deadline = Clock::now() + budget;
    while (Clock::now() < deadline) {
        if (pred()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
}

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
    h.pool.resize(1);
    h.pool[0].engine_id = 0x42;
    h.pool[0].base = 0x1000;
    h.pool[0].length = h.layout.pool_bytes();
    h.pool[0].rail_keys = {7};
    h.tp_rank = 1;
    h.tp_size = 2;
    return h;
}

TEST(Handshake, ServesInfoAndRefusesAnIncompatibleCaller) {
    HandshakeInfo info = fake_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, options());
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    uint64_t hash = info.layout.compatibility_hash();
    auto got = fetch_handshake("127.0.0.1", (*server)->port(), hash, test_secret(), kTimeout);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(got->epoch, (*server)->epoch());
    EXPECT_NE(got->epoch, 0u);
    info.epoch = got->epoch;
    EXPECT_EQ(got->serialize(), info.serialize());

    auto bad = fetch_handshake("127.0.0.1", (*server)->port(), hash ^ 1, test_secret(), kTimeout);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("incompatible KV layout"), std::string::npos)
        << bad.status().message();

    // A caller that passes its layout: both layouts and the differing field with its values.
    KvLayout mine = info.layout;
    mine.num_layers += 1;
    auto named = fetch_handshake("127.0.0.1", (*server)->port(), mine.compatibility_hash(),
                                 test_secret(), kTimeout, nullptr, &mine);
    ASSERT_FALSE(named.ok());
    const std::string& m = named.status().message();
    EXPECT_NE(m.find(fmt::format("num_layers differs ({} at the peer, {} here)",
                                 info.layout.num_layers, mine.num_layers)),
              std::string::npos)
        << m;
    EXPECT_NE(m.find(info.layout.to_string()), std::string::npos) << m;
    EXPECT_NE(m.find(mine.to_string()), std::string::npos) << m;

    // The cache ferry serve uses, made with its layout, says the same.
    HandshakeCache cache(mine, test_secret());
    auto cached = cache.get("127.0.0.1", (*server)->port(), kTimeout);
    ASSERT_FALSE(cached.ok());
    EXPECT_NE(cached.status().message().find("num_layers differs"), std::string::npos)
        << cached.status().message();
}

TEST(Handshake, CacheAnswersRepeatsAndDetectsARestartedPeer) {
    HandshakeInfo info = fake_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, options());
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    uint16_t port = (*server)->port();
    HandshakeCache cache(info.layout.compatibility_hash(), test_secret());
    auto a = cache.get("127.0.0.1", port, kTimeout);
    auto b = cache.get("127.0.0.1", port, kTimeout);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ((*server)->requests_served(), 1u);
    EXPECT_EQ(a->epoch, b->epoch);

    // Same port, new process start: a new epoch.
    server->reset();
    auto again = HandshakeServer::start("127.0.0.1", port, info, options());
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
    auto r = fetch_handshake("127.0.0.1", port, 1, test_secret(), kTimeout);
    EXPECT_EQ(r.status().code(), StatusCode::kUnavailable) << r.status().to_string();

    // Listening but never answering: a timeout, on time.
    ASSERT_EQ(::listen(probe, 4), 0);
    TimePoint t0 = Clock::now();
    r = fetch_handshake("127.0.0.1", port, 1, test_secret(), std::chrono::milliseconds(200));
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
                HandshakeInfo info{0, n.engine->address(), {n.mr->descriptor()}, self.layout, 0, 1};
                CHILD_ASSIGN_OK(server, HandshakeServer::start("127.0.0.1", 0, info, options()));
                w.put<uint16_t>(server->port());
            }
            CHILD_ASSIGN_OK(auto all, ex.allgather(w.bytes()));
            uint16_t port = 0;
            std::memcpy(&port, all[0].data(), 2);
            CHILD_ASSIGN_OK(auto blocks, n.blocks->allocate(5));
            const uint64_t id = 0x99;
            if (ex.rank() == 1) {
                HandshakeCache cache(self.layout.compatibility_hash(), test_secret());
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

namespace ferry::kv {
namespace {

// A handshake info whose secrets are easy to spot in captured bytes.
HandshakeInfo marked_info() {
    HandshakeInfo h = fake_info();
    h.address.host_id = "secret-engine-host";
    h.pool[0].base = 0x1234567890abcdefull;
    return h;
}

bool contains(const std::vector<uint8_t>& hay, std::span<const uint8_t> needle) {
    return std::search(hay.begin(), hay.end(), needle.begin(), needle.end()) != hay.end();
}

// Nothing a peer without the secret received may tell it about the rank.
void expect_nothing_revealed(const std::vector<uint8_t>& got, const HandshakeInfo& info) {
    std::string host = info.address.host_id;
    EXPECT_FALSE(contains(got, {reinterpret_cast<const uint8_t*>(host.data()), host.size()}))
        << "engine address revealed";
    uint64_t base = info.pool[0].base;
    EXPECT_FALSE(contains(got, {reinterpret_cast<const uint8_t*>(&base), 8}))
        << "pool descriptor revealed";
    uint64_t hash = info.layout.compatibility_hash();
    EXPECT_FALSE(contains(got, {reinterpret_cast<const uint8_t*>(&hash), 8}))
        << "compatibility hash revealed";
    std::string text(got.begin(), got.end());
    EXPECT_EQ(text.find("incompatible"), std::string::npos);
}

// `from`: the source address, another of 127.0.0.0/8 (Linux routes all of it to lo) to play
// a second client host.
int connect_loopback(uint16_t port, const char* from = nullptr) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (from != nullptr) {
        sockaddr_in src{};
        src.sin_family = AF_INET;
        ::inet_pton(AF_INET, from, &src.sin_addr);
        if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) {
            ::close(fd);
            return -1;
        }
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
        ::close(fd);
        return -1;
    }
    return fd;
}

// A listening socket on a free loopback port.
int listen_loopback(uint16_t* port) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), len);
    ::listen(fd, 4);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    *port = ntohs(a.sin_port);
    return fd;
}

void send_frame_raw(int fd, const std::vector<uint8_t>& payload) {
    uint32_t len = uint32_t(payload.size());
    std::vector<uint8_t> b(reinterpret_cast<uint8_t*>(&len), reinterpret_cast<uint8_t*>(&len) + 4);
    b.insert(b.end(), payload.begin(), payload.end());
    ASSERT_EQ(::send(fd, b.data(), b.size(), MSG_NOSIGNAL), ssize_t(b.size()));
}

// Everything the server sends until it closes, or until `budget` passes.
std::vector<uint8_t> read_until_close(int fd, Duration budget, bool* closed = nullptr) {
    std::vector<uint8_t> got;
    TimePoint deadline = Clock::now() + budget;
    if (closed) *closed = false;
    while (Clock::now() < deadline) {
        pollfd p{fd, POLLIN, 0};
        int ms = int(
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
        if (::poll(&p, 1, std::max(ms, 0)) <= 0) break;
        uint8_t buf[4096];
        ssize_t r = ::recv(fd, buf, sizeof buf, 0);
        if (r <= 0) {
            if (closed) *closed = true;
            break;
        }
        got.insert(got.end(), buf, buf + r);
    }
    return got;
}

std::vector<uint8_t> hello_frame(uint8_t nonce_fill) {
    ByteWriter w;
    w.put<uint32_t>(0x46524851);
    w.put<uint16_t>(HandshakeInfo::kVersion);
    w.put<uint8_t>(1);
    for (int i = 0; i < 32; ++i) w.put<uint8_t>(nonce_fill);
    return w.take();
}

std::vector<uint8_t> auth_frame(const Digest& proof, uint64_t hash) {
    ByteWriter w;
    w.put<uint32_t>(0x46524851);
    w.put<uint16_t>(HandshakeInfo::kVersion);
    w.put<uint8_t>(3);
    w.put(proof);
    w.put(hash);
    return w.take();
}

TEST(HandshakeAuth, WrongSecretIsRefusedWithoutLearningAnything) {
    HandshakeInfo info = marked_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, options());
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    uint16_t port = (*server)->port();
    uint64_t hash = info.layout.compatibility_hash();

    auto r = fetch_handshake("127.0.0.1", port, hash, test_secret(0x11), kTimeout);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status().to_string();
    EXPECT_NE(r.status().message().find("did not prove the deployment secret"), std::string::npos)
        << r.status().message();

    // A raw client without the secret: HELLO, then a made-up proof with the right hash.
    int fd = connect_loopback(port);
    ASSERT_GE(fd, 0);
    send_frame_raw(fd, hello_frame(7));
    auto challenge = read_until_close(fd, milliseconds(300));
    ASSERT_FALSE(challenge.empty());
    send_frame_raw(fd, auth_frame(Digest{}, hash));
    bool closed = false;
    auto rest = read_until_close(fd, kTimeout, &closed);
    ::close(fd);
    EXPECT_TRUE(closed);
    std::vector<uint8_t> all = challenge;
    all.insert(all.end(), rest.begin(), rest.end());
    expect_nothing_revealed(all, info);
    EXPECT_NE(std::string(rest.begin(), rest.end()).find("authentication failed"),
              std::string::npos);

    // A version 1 client (no challenge-response): the hash it sends gets nothing back.
    fd = connect_loopback(port);
    ASSERT_GE(fd, 0);
    ByteWriter v1;
    v1.put<uint32_t>(0x46524851);
    v1.put<uint16_t>(1);
    v1.put(hash);
    send_frame_raw(fd, v1.take());
    auto old = read_until_close(fd, kTimeout, &closed);
    ::close(fd);
    EXPECT_TRUE(closed);
    expect_nothing_revealed(old, info);
    EXPECT_NE(std::string(old.begin(), old.end()).find("version"), std::string::npos);

    EXPECT_EQ((*server)->requests_served(), 0u);
    EXPECT_GE((*server)->auth_failures(), 2u);
    // The real secret still works.
    EXPECT_TRUE(fetch_handshake("127.0.0.1", port, hash, test_secret(), kTimeout).ok());
}

// A relay between a real client and the server that records what the client sent.
class RecordingProxy {
  public:
    explicit RecordingProxy(uint16_t upstream) : upstream_(upstream) {
        listener_ = listen_loopback(&port_);
        thread_ = std::thread([this] { relay_once(); });
    }
    ~RecordingProxy() {
        if (thread_.joinable()) thread_.join();
        ::close(listener_);
    }
    uint16_t port() const { return port_; }
    std::vector<uint8_t> client_bytes() {
        if (thread_.joinable()) thread_.join();
        return from_client_;
    }

  private:
    void relay_once() {
        pollfd lp{listener_, POLLIN, 0};
        if (::poll(&lp, 1, 5000) <= 0) return;
        int c = ::accept(listener_, nullptr, nullptr);
        int s = connect_loopback(upstream_);
        TimePoint deadline = Clock::now() + seconds(5);
        bool open = true;
        while (open && Clock::now() < deadline) {
            pollfd p[2] = {{c, POLLIN, 0}, {s, POLLIN, 0}};
            if (::poll(p, 2, 100) <= 0) continue;
            for (int i = 0; i < 2; ++i) {
                if (!(p[i].revents & (POLLIN | POLLHUP))) continue;
                uint8_t buf[4096];
                ssize_t r = ::recv(p[i].fd, buf, sizeof buf, 0);
                if (r <= 0) {
                    open = false;
                    break;
                }
                if (i == 0) from_client_.insert(from_client_.end(), buf, buf + r);
                ::send(i == 0 ? s : c, buf, size_t(r), MSG_NOSIGNAL);
            }
        }
        ::close(c);
        ::close(s);
    }

    uint16_t upstream_;
    int listener_ = -1;
    uint16_t port_ = 0;
    std::thread thread_;
    std::vector<uint8_t> from_client_;
};

TEST(HandshakeAuth, ReplayOfACapturedExchangeIsRefused) {
    HandshakeInfo info = marked_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, options());
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    uint64_t hash = info.layout.compatibility_hash();
    RecordingProxy proxy((*server)->port());
    auto real = fetch_handshake("127.0.0.1", proxy.port(), hash, test_secret(), kTimeout);
    ASSERT_TRUE(real.ok()) << real.status().to_string();
    std::vector<uint8_t> captured = proxy.client_bytes();
    ASSERT_GT(captured.size(), 8u);

    // Replayed as it was: the server's fresh nonce makes the old proof worthless.
    int fd = connect_loopback((*server)->port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::send(fd, captured.data(), captured.size(), MSG_NOSIGNAL), ssize_t(captured.size()));
    bool closed = false;
    auto got = read_until_close(fd, kTimeout, &closed);
    ::close(fd);
    EXPECT_TRUE(closed);
    expect_nothing_revealed(got, info);
    EXPECT_NE(std::string(got.begin(), got.end()).find("authentication failed"), std::string::npos);
    EXPECT_EQ((*server)->requests_served(), 1u);  // the real one only
}

TEST(HandshakeAuth, ServerThatCannotProveTheSecretGetsNoRequest) {
    // The client checks the server's proof before it sends its own or its layout hash.
    HandshakeInfo info = marked_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, options(test_secret(0x22)));
    ASSERT_TRUE(server.ok());
    auto r = fetch_handshake("127.0.0.1", (*server)->port(), info.layout.compatibility_hash(),
                             test_secret(), kTimeout);
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied) << r.status().to_string();
    EXPECT_EQ((*server)->requests_served(), 0u);  // the client hung up before AUTH
}

TEST(HandshakeConcurrency, IdleConnectionsDoNotDelayAHandshake) {
    HandshakeInfo info = fake_info();
    HandshakeServerOptions o = options();
    o.max_connections_per_client = 256;  // all from 127.0.0.1, as the handshake below
    auto server = HandshakeServer::start("127.0.0.1", 0, info, std::move(o));
    ASSERT_TRUE(server.ok());
    uint16_t port = (*server)->port();
    std::vector<int> idle;
    for (int i = 0; i < 100; ++i) {
        int fd = connect_loopback(port);
        ASSERT_GE(fd, 0);
        idle.push_back(fd);
    }
    std::this_thread::sleep_for(milliseconds(100));  // all accepted and idling
    // Served one connection at a time, each idle one would hold a handshake for its whole
    // budget (1 s): every attempt would miss the target, not only an unlucky one.
    double ms = ferry::testing::best_of(
        3, 100.0, "handshake with 100 idle side-channel connections open", [&] {
            TimePoint t0 = Clock::now();
            auto r = fetch_handshake("127.0.0.1", port, info.layout.compatibility_hash(),
                                     test_secret(), kTimeout);
            EXPECT_TRUE(r.ok()) << r.status().to_string();
            return r.ok() ? to_ms(Clock::now() - t0) : 1e9;
        });
    EXPECT_LT(ms, 100.0);
    for (int fd : idle) ::close(fd);
}

TEST(HandshakeConcurrency, IdleConnectionsAreClosedAtTheirDeadline) {
    HandshakeServerOptions o = options();
    o.connection_deadline = milliseconds(300);
    auto server = HandshakeServer::start("127.0.0.1", 0, fake_info(), std::move(o));
    ASSERT_TRUE(server.ok());
    int fd = connect_loopback((*server)->port());
    ASSERT_GE(fd, 0);
    TimePoint t0 = Clock::now();
    bool closed = false;
    auto got = read_until_close(fd, seconds(3), &closed);
    double ms = to_ms(Clock::now() - t0);
    ::close(fd);
    EXPECT_TRUE(closed);
    EXPECT_TRUE(got.empty());
    EXPECT_GT(ms, 200.0);
    EXPECT_LT(ms, 1500.0);
}

TEST(HandshakeConcurrency, ConnectionsBeyondTheCapAreClosedAtOnce) {
    HandshakeServerOptions o = options();
    o.max_connections = 4;
    o.connection_deadline = seconds(10);  // far from the "at once" below
    HandshakeInfo info = fake_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, std::move(o));
    ASSERT_TRUE(server.ok());
    uint16_t port = (*server)->port();
    std::vector<int> idle;
    for (int i = 0; i < 4; ++i) idle.push_back(connect_loopback(port));
    std::this_thread::sleep_for(milliseconds(150));
    int extra = connect_loopback(port);
    ASSERT_GE(extra, 0);
    TimePoint t0 = Clock::now();
    bool closed = false;
    auto got = read_until_close(extra, seconds(5), &closed);
    double ms = to_ms(Clock::now() - t0);
    ::close(extra);
    EXPECT_TRUE(closed);
    EXPECT_TRUE(got.empty());
    EXPECT_LT(ms, 500.0) << "connection N+1 was not closed at once";
    EXPECT_EQ((*server)->refused_over_cap(), 1u);
    // Once the idle ones go, a real handshake is served again.
    for (int fd : idle) ::close(fd);
    EXPECT_TRUE(eventually_ok([&] {
        return fetch_handshake("127.0.0.1", port, info.layout.compatibility_hash(), test_secret(),
                               seconds(1))
            .ok();
    }));
}

// The side channel locked by one client (issue 30): 300 idle connections from one address,
// reopened as the server closed them, held all 256 places, and 132 of 133 real handshakes
// failed. One address now holds at most max_connections_per_client of them.
TEST(HandshakeConcurrency, OneClientsIdleFloodDoesNotStopOtherClientsHandshakes) {
    HandshakeInfo info = fake_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, options());
    ASSERT_TRUE(server.ok());
    uint16_t port = (*server)->port();
    std::atomic<bool> stop{false};
    std::atomic<int> open{0};
    std::thread flood([&] {
        std::vector<int> fds(300, -1);
        while (!stop.load()) {
            int now_open = 0;
            for (int& fd : fds) {
                pollfd p{fd, POLLIN, 0};
                if (fd >= 0 && ::poll(&p, 1, 0) > 0) {  // closed by the server
                    ::close(fd);
                    fd = -1;
                }
                if (fd < 0) fd = connect_loopback(port, "127.0.0.2");
                now_open += fd >= 0;
            }
            open.store(now_open);
            std::this_thread::sleep_for(milliseconds(5));
        }
        for (int fd : fds)
            if (fd >= 0) ::close(fd);
    });
    ASSERT_TRUE(eventually_ok([&] { return open.load() == 300; }, seconds(10)));
    std::this_thread::sleep_for(milliseconds(200));  // the server accepted what it takes
    int ok = 0;
    std::string failed;
    double slowest_ms = 0;
    for (int i = 0; i < 30; ++i) {
        TimePoint t0 = Clock::now();
        auto r = fetch_handshake("127.0.0.1", port, info.layout.compatibility_hash(), test_secret(),
                                 seconds(2));
        slowest_ms = std::max(slowest_ms, to_ms(Clock::now() - t0));
        ok += r.ok();
        if (!r.ok() && failed.empty()) failed = r.status().to_string();
    }
    std::printf("30 handshakes beside a flood of 300 idle connections: %d ok, slowest %.2f ms\n",
                ok, slowest_ms);
    stop.store(true);
    flood.join();
    EXPECT_EQ(ok, 30) << "while one client held 300 idle connections, the first failure: "
                      << failed;
    EXPECT_GT((*server)->refused_over_cap(), 0u) << "the flood was never over its cap";
}

// Idle before the proof (nothing sent, or HELLO and then nothing) is closed at proof_deadline,
// however long the whole exchange may take.
TEST(HandshakeConcurrency, ConnectionsWithoutAProofAreClosedAtTheProofDeadline) {
    const ::ferry::testing::StallWatch stalls;
    HandshakeServerOptions o = options();
    o.connection_deadline = seconds(10);
    o.proof_deadline = milliseconds(300);
    auto server = HandshakeServer::start("127.0.0.1", 0, fake_info(), std::move(o));
    ASSERT_TRUE(server.ok());
    int silent = connect_loopback((*server)->port());
    int hello_only = connect_loopback((*server)->port());
    ASSERT_GE(silent, 0);
    ASSERT_GE(hello_only, 0);
    TimePoint t0 = Clock::now();
    send_frame_raw(hello_only, hello_frame(7));
    for (int fd : {silent, hello_only}) {
        bool closed = false;
        auto got = read_until_close(fd, seconds(5), &closed);
        double ms = to_ms(Clock::now() - t0);
        ::close(fd);
        EXPECT_TRUE(closed) << "an unproven connection still open after 5 s";
        EXPECT_GT(ms, 200.0);
        EXPECT_LT(ms, 1500.0 + stalls.worst_ms());
    }
}

// ---- hostile clients and servers ---------------------------------------------------------------

// Open descriptors of this process (the directory's own descriptor not counted).
size_t open_fds() {
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return n - 1;
}

// Waits until this process holds `want` descriptors again; the count it saw last otherwise.
size_t fds_settle_at(size_t want, Duration budget = seconds(3)) {
    size_t now = open_fds();
    TimePoint deadline = Clock::now() + budget;
    while (now != want && Clock::now() < deadline) {
        std::this_thread::sleep_for(milliseconds(20));
        now = open_fds();
    }
    return now;
}

std::vector<uint8_t> length_prefix(uint32_t len) {
    return std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&len),
                                reinterpret_cast<uint8_t*>(&len) + 4);
}

std::vector<uint8_t> framed(std::vector<uint8_t> payload) {
    std::vector<uint8_t> b = length_prefix(uint32_t(payload.size()));
    b.insert(b.end(), payload.begin(), payload.end());
    return b;
}

std::vector<uint8_t> concat(std::vector<uint8_t> a, const std::vector<uint8_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
}

// What a hostile client sends, and what it must see.
struct HostileClient {
    std::string name;
    std::vector<uint8_t> bytes;
    enum { kRefused, kCutAtDeadline, kHangsUp } outcome;
    Duration drip = {};  // sends a byte at a time this far apart
    bool reset = false;  // kHangsUp: an RST (SO_LINGER 0) rather than a FIN
};

// Runs one hostile client against `port`; "" when it saw what it must, else what it saw. A
// time bound allows the worst scheduling stall `stalls` saw, twice (the server's wake-up at the
// deadline and this client's): see StallWatch.
std::string run_hostile(const HostileClient& h, uint16_t port, Duration deadline,
                        const ::ferry::testing::StallWatch& stalls) {
    int fd = connect_loopback(port);
    if (fd < 0) return "could not connect";
    TimePoint t0 = Clock::now();
    size_t sent = 0;
    while (sent < h.bytes.size()) {
        size_t n = h.drip > Duration{} ? 1 : h.bytes.size() - sent;
        // The server may close in between; a failed send is not this client's business.
        if (::send(fd, h.bytes.data() + sent, n, MSG_NOSIGNAL) <= 0) break;
        sent += n;
        if (h.drip > Duration{} && sent < h.bytes.size()) {
            // The pause between two bytes, cut short when the server closes: the close is
            // timed when it happens, not at the next byte's failed send.
            pollfd p{fd, POLLIN, 0};
            if (::poll(&p, 1, int(std::chrono::duration_cast<milliseconds>(h.drip).count())) > 0)
                break;
        }
    }
    if (h.outcome == HostileClient::kHangsUp) {
        if (h.reset) {
            linger l{1, 0};
            ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        }
        ::close(fd);
        return "";
    }
    bool closed = false;
    auto got = read_until_close(fd, deadline + seconds(3), &closed);
    double ms = to_ms(Clock::now() - t0);
    ::close(fd);
    std::string text(got.begin(), got.end());
    if (!closed) return fmt::format("not closed after {:.0f} ms", ms);
    const double slack = 2 * stalls.worst_ms();
    if (h.outcome == HostileClient::kRefused) {
        if (text.find("authentication failed") == std::string::npos)
            return fmt::format("closed after {:.0f} ms without the refusal ({} bytes)", ms,
                               got.size());
        if (ms > 300 + slack)
            return fmt::format("refused only after {:.0f} ms (stalls of up to {:.0f} ms seen)", ms,
                               slack / 2);
        return "";
    }
    // Cut at the deadline: no answer at all (nothing was wrong yet, and no request complete:
    // a deadline that restarted with every dripped byte would let the HELLO complete and
    // answer it), on time.
    if (!text.empty())
        return fmt::format("{} bytes of answer after {} of {} bytes sent: {}", got.size(), sent,
                           h.bytes.size(),
                           text.find("authentication failed") != std::string::npos
                               ? "refused, not cut"
                               : "a request completed before the cut");
    double want = to_ms(deadline);
    if (ms < want - 50 || ms > want + 700 + slack)
        return fmt::format(
            "closed after {:.0f} ms, the deadline is {:.0f} ms (stalls of up to "
            "{:.0f} ms seen)",
            ms, want, slack / 2);
    return "";
}

TEST(HandshakeHostile, MalformedSlowAndVanishingClientsAreRefusedOrCutAndOthersAreServed) {
    unsigned seed = std::random_device{}();
    std::printf("seed %u\n", seed);
    std::mt19937 rng(seed);
    std::vector<uint8_t> garbage(60);
    for (auto& b : garbage) b = uint8_t(rng());
    std::vector<uint8_t> hello = hello_frame(3);
    std::vector<uint8_t> wrong_magic = hello;
    wrong_magic[0] ^= 0xff;
    std::vector<uint8_t> long_hello = hello;
    long_hello.push_back(0);
    std::vector<uint8_t> half_hello = framed(hello);
    half_hello.resize(20);
    const std::vector<HostileClient> kinds = {
        {"length prefix 2^32-1", concat(length_prefix(0xffffffffu), garbage),
         HostileClient::kRefused},
        {"length prefix 257 (cap + 1)", length_prefix(257), HostileClient::kRefused},
        {"random garbage of a plausible length", framed(garbage), HostileClient::kRefused},
        {"zero-length frame", length_prefix(0), HostileClient::kRefused},
        {"wrong magic", framed(wrong_magic), HostileClient::kRefused},
        {"HELLO with a trailing byte", framed(long_hello), HostileClient::kRefused},
        {"AUTH before HELLO", framed(auth_frame(Digest{}, 1)), HostileClient::kRefused},
        {"two HELLOs", concat(framed(hello), framed(hello)), HostileClient::kRefused},
        {"a length, then silence", length_prefix(uint32_t(hello.size())),
         HostileClient::kCutAtDeadline},
        {"half a HELLO, then silence", half_hello, HostileClient::kCutAtDeadline},
        // 43 bytes 100 ms apart: 4.2 s to complete, over 8 deadlines, so that even a server
        // stalled for seconds cuts it before the HELLO is whole.
        {"HELLO a byte every 100 ms (8 times the deadline)", framed(hello),
         HostileClient::kCutAtDeadline, milliseconds(100)},
        {"half a HELLO, then FIN", half_hello, HostileClient::kHangsUp},
        {"half a HELLO, then RST", half_hello, HostileClient::kHangsUp, {}, true},
        {"HELLO, then RST before the challenge is read",
         framed(hello),
         HostileClient::kHangsUp,
         {},
         true},
    };
    const size_t before = open_fds();
    {
        const ::ferry::testing::StallWatch stalls;
        HandshakeServerOptions o = options();
        o.connection_deadline = milliseconds(500);
        // 42 hostile clients and the honest one, all from 127.0.0.1: above the default cap per
        // client (32), which this test is not about (the test at "One address now holds at most"
        // is). With the cap, a loaded machine, where refused clients linger, had the honest
        // client and the clients due to be cut at the deadline refused at once instead.
        o.max_connections_per_client = 64;
        HandshakeInfo info = fake_info();
        auto server = HandshakeServer::start("127.0.0.1", 0, info, std::move(o));
        ASSERT_TRUE(server.ok()) << server.status().to_string();
        uint16_t port = (*server)->port();
        const size_t serving = open_fds();

        // Three of each at once, while an honest client handshakes again and again.
        std::vector<std::string> failures(kinds.size() * 3);
        std::vector<std::thread> clients;
        for (size_t i = 0; i < failures.size(); ++i) {
            clients.emplace_back([&, i] {
                const HostileClient& h = kinds[i % kinds.size()];
                std::string why = run_hostile(h, port, milliseconds(500), stalls);
                if (!why.empty()) failures[i] = h.name + ": " + why;
            });
        }
        const int kHonest = 20;
        double worst_ms = 0;
        for (int i = 0; i < kHonest; ++i) {
            TimePoint t0 = Clock::now();
            auto r = fetch_handshake("127.0.0.1", port, info.layout.compatibility_hash(),
                                     test_secret(), seconds(2));
            worst_ms = std::max(worst_ms, to_ms(Clock::now() - t0));
            EXPECT_TRUE(r.ok()) << r.status().to_string();
            std::this_thread::sleep_for(milliseconds(20));
        }
        for (auto& t : clients) t.join();
        for (const std::string& f : failures) EXPECT_EQ(f, "");
        // Not held up by any of them: served from the same loop, none waits for another (a
        // server that waited for a slow client would hold this one 500 ms or more per client).
        EXPECT_LT(worst_ms, 400.0 + 2 * stalls.worst_ms())
            << "stalls of up to " << stalls.worst_ms() << " ms seen";
        EXPECT_EQ((*server)->requests_served(), uint64_t(kHonest));
        EXPECT_GE((*server)->auth_failures(), 3u * 8);
        // Every connection the server accepted is closed again.
        EXPECT_EQ(fds_settle_at(serving), serving);
    }
    EXPECT_EQ(fds_settle_at(before), before) << "descriptors left after the server stopped";
}

// A failed exchange is logged with the client's address and what was wrong; the client itself
// learns only "authentication failed" (or the version). Before, the server logged nothing at
// all: a peer with another deployment's secret, a stray client or a truncated frame showed as
// a counter only. A flood is held to a line a second, the next line counting what was held.
TEST(HandshakeHostile, FailedExchangesAreLoggedNamingTheClientAndWhat) {
    HandshakeServerOptions o = options();
    o.connection_deadline = milliseconds(300);
    HandshakeInfo info = fake_info();
    auto server = HandshakeServer::start("127.0.0.1", 0, info, std::move(o));
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    const uint16_t port = (*server)->port();
    // Sends `bytes`, then hangs up at once or reads until the server closes.
    auto poke = [&](const std::vector<uint8_t>& bytes, bool hang_up) {
        int fd = connect_loopback(port);
        ASSERT_GE(fd, 0);
        ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
        if (!hang_up) read_until_close(fd, seconds(3));
        ::close(fd);
    };
    std::vector<uint8_t> v99 = hello_frame(3);
    v99[4] = 99;  // the version, after the magic
    v99[5] = 0;
    std::vector<uint8_t> half_hello = framed(hello_frame(3));
    half_hello.resize(20);
    struct Case {
        std::string name;
        std::function<void()> client;
        std::string logged;
    };
    const std::vector<Case> cases = {
        {"length 2^32-1", [&] { poke(length_prefix(0xffffffffu), false); },
         "a frame of 4294967295 bytes, more than the 256 a handshake request may have"},
        {"version 99", [&] { poke(framed(v99), false); },
         "field 'version' is 99, this build speaks"},
        {"AUTH first", [&] { poke(framed(auth_frame(Digest{}, 1)), false); },
         "a frame of type 3 (AUTH) where HELLO was due: refused"},
        {"a length, then silence", [&] { poke(length_prefix(39), false); },
         "no valid AUTH within 300 ms (connection_deadline; 4 bytes received): closed"},
        {"half a HELLO, then FIN", [&] { poke(half_hello, true); },
         "hung up mid-exchange after 20 bytes"},
        {"another deployment's secret",
         [&] {
             auto r = fetch_handshake("127.0.0.1", port, info.layout.compatibility_hash(),
                                      test_secret(0x11), seconds(2));
             EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
         },
         "hung up after the CHALLENGE without sending AUTH: it could not verify this server's "
         "proof (a peer holding another deployment's secret?)"},
        {"a made-up proof",
         [&] {
             int fd = connect_loopback(port);
             ASSERT_GE(fd, 0);
             send_frame_raw(fd, hello_frame(7));
             // The CHALLENGE, read well within the 300 ms deadline.
             ASSERT_FALSE(read_until_close(fd, milliseconds(100)).empty());
             send_frame_raw(fd, auth_frame(Digest{}, info.layout.compatibility_hash()));
             read_until_close(fd, seconds(3));
             ::close(fd);
         },
         "a wrong proof: the peer does not hold this deployment's secret: refused"},
    };
    for (const Case& k : cases) {
        SCOPED_TRACE(k.name);
        ::testing::internal::CaptureStderr();
        k.client();
        std::this_thread::sleep_for(milliseconds(1100));  // logged, and past the rate limit
        const std::string err = ::testing::internal::GetCapturedStderr();
        EXPECT_NE(err.find(fmt::format("handshake server on port {}: client 127.0.0.1:", port)),
                  std::string::npos)
            << err;
        EXPECT_NE(err.find(k.logged), std::string::npos) << err;
    }

    // A flood: a line, then none until a second passed, then one that counts the rest.
    ::testing::internal::CaptureStderr();
    for (int i = 0; i < 40; ++i) poke(length_prefix(0xffffffffu), false);
    std::this_thread::sleep_for(milliseconds(1100));
    poke(length_prefix(0xffffffffu), false);
    std::this_thread::sleep_for(milliseconds(100));
    const std::string flood = ::testing::internal::GetCapturedStderr();
    size_t lines = 0;
    for (size_t at = flood.find("handshake server on port"); at != std::string::npos;
         at = flood.find("handshake server on port", at + 1))
        ++lines;
    EXPECT_GE(lines, 2u) << flood;
    EXPECT_LE(lines, 3u) << flood;
    EXPECT_NE(flood.find("more failed exchanges not logged)"), std::string::npos) << flood;
    // And it still serves.
    auto ok = fetch_handshake("127.0.0.1", port, info.layout.compatibility_hash(), test_secret(),
                              seconds(2));
    EXPECT_TRUE(ok.ok()) << ok.status().to_string();
}

TEST(HandshakeHostile, OptionsThatWouldServeNobodyAreRefused) {
    HandshakeServerOptions o = options();
    o.connection_deadline = Duration::zero();
    auto r = HandshakeServer::start("127.0.0.1", 0, fake_info(), o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("connection_deadline"), std::string::npos)
        << r.status().to_string();
    o.connection_deadline = -milliseconds(5);
    EXPECT_EQ(HandshakeServer::start("127.0.0.1", 0, fake_info(), o).status().code(),
              StatusCode::kInvalidArgument);
}

// Lowers this process's descriptor limit for as long as it lives.
class FdLimit {
  public:
    explicit FdLimit(rlim_t soft) {
        ::getrlimit(RLIMIT_NOFILE, &saved_);
        rlimit l = saved_;
        l.rlim_cur = soft;
        ok_ = ::setrlimit(RLIMIT_NOFILE, &l) == 0;
    }
    ~FdLimit() { ::setrlimit(RLIMIT_NOFILE, &saved_); }
    bool ok() const { return ok_; }

  private:
    rlimit saved_{};
    bool ok_ = false;
};

double process_cpu_ms() {
    timespec ts{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) / 1e6;
}

TEST(HandshakeHostile, OutOfDescriptorsTheServerBacksOffRatherThanSpin) {
    HandshakeInfo info = fake_info();
    HandshakeServerOptions o = options();
    o.connection_deadline = seconds(5);
    auto server = HandshakeServer::start("127.0.0.1", 0, info, std::move(o));
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    uint16_t port = (*server)->port();
    // Client sockets made first: they connect under the lowered limit, the server cannot
    // accept them all.
    std::vector<int> clients;
    for (int i = 0; i < 16; ++i) {
        clients.push_back(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
        ASSERT_GE(clients.back(), 0);
    }
    {
        FdLimit limit(open_fds() + 4);
        ASSERT_TRUE(limit.ok());
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons(port);
        for (int fd : clients)
            ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
        std::this_thread::sleep_for(milliseconds(200));  // accepted what it could
        // The server's thread is the only one that could be busy meanwhile.
        double cpu0 = process_cpu_ms();
        TimePoint t0 = Clock::now();
        std::this_thread::sleep_for(milliseconds(1000));
        double cpu = process_cpu_ms() - cpu0;
        double wall = to_ms(Clock::now() - t0);
        EXPECT_LT(cpu, 0.2 * wall) << "the server's loop used " << cpu << " ms of CPU in " << wall
                                   << " ms while it could not accept";
    }
    // Descriptors again: the waiting connections are taken and served.
    auto r = fetch_handshake("127.0.0.1", port, info.layout.compatibility_hash(), test_secret(),
                             seconds(3));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    for (int fd : clients) ::close(fd);
}

// A server that answers the first connection's HELLO with `reply`, then holds or closes it.
class FakeServer {
  public:
    FakeServer(std::vector<uint8_t> reply, bool close_after) {
        listener_ = listen_loopback(&port_);
        thread_ = std::thread([this, reply = std::move(reply), close_after] {
            pollfd lp{listener_, POLLIN, 0};
            if (::poll(&lp, 1, 5000) <= 0) return;
            int c = ::accept(listener_, nullptr, nullptr);
            std::vector<uint8_t> hello(4 + 39);
            ::recv(c, hello.data(), hello.size(), MSG_WAITALL);
            ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
            if (!close_after) read_until_close(c, seconds(5));  // until the client gives up
            ::close(c);
        });
    }
    ~FakeServer() {
        if (thread_.joinable()) thread_.join();
        ::close(listener_);
    }
    uint16_t port() const { return port_; }

  private:
    int listener_ = -1;
    uint16_t port_ = 0;
    std::thread thread_;
};

std::vector<uint8_t> text_bytes(std::string_view t) { return {t.begin(), t.end()}; }

TEST(HandshakeHostile, AHostileServerGivesTheClientAClearErrorOnTime) {
    ByteWriter bad_type;
    bad_type.put<uint32_t>(0x46524852);
    bad_type.put<uint16_t>(HandshakeInfo::kVersion);
    bad_type.put<uint8_t>(9);
    struct Case {
        std::string name;
        std::vector<uint8_t> reply;
        bool close_after;
        StatusCode code;
        std::string says;
    };
    const std::vector<Case> cases = {
        {"length prefix 2^32-1", length_prefix(0xffffffffu), false, StatusCode::kProtocol,
         "exceeds"},
        {"garbage", framed({1, 2, 3, 4, 5, 6, 7, 8}), false, StatusCode::kProtocol,
         "not a ferry handshake reply"},
        {"an unknown frame type", framed(bad_type.take()), false, StatusCode::kProtocol,
         "field 'type' is 9"},
        {"a client's frame sent back", framed(hello_frame(1)), false, StatusCode::kProtocol,
         "not a ferry handshake reply"},
        {"a length, then silence", length_prefix(100), false, StatusCode::kTimeout, "timed out"},
        {"half a frame, then a close", concat(length_prefix(100), {1, 2, 3}), true,
         StatusCode::kUnavailable, "closed the connection"},
        // An engine's HTTP port given for its KV port: its 400 was "a frame of 1347703880
        // bytes".
        {"an HTTP server", text_bytes("HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"),
         true, StatusCode::kProtocol, "an HTTP server (an engine's HTTP port given instead of"},
        {"some other text", text_bytes("220 smtp.example ESMTP\r\n"), true, StatusCode::kProtocol,
         "the peer answered in text (\"220 ...\")"},
    };
    const size_t before = open_fds();
    for (const Case& k : cases) {
        SCOPED_TRACE(k.name);
        FakeServer fake(k.reply, k.close_after);
        TimePoint t0 = Clock::now();
        auto r = fetch_handshake("127.0.0.1", fake.port(), 1, test_secret(), milliseconds(400));
        double ms = to_ms(Clock::now() - t0);
        ASSERT_FALSE(r.ok());
        EXPECT_EQ(r.status().code(), k.code) << r.status().to_string();
        EXPECT_NE(r.status().message().find(k.says), std::string::npos) << r.status().to_string();
        EXPECT_NE(r.status().message().find(fmt::format("127.0.0.1:{}", fake.port())),
                  std::string::npos)
            << r.status().to_string();
        EXPECT_LT(ms, 1000.0);
    }
    EXPECT_EQ(fds_settle_at(before), before);
}

}  // namespace
}  // namespace ferry::kv
