// Two "hosts": network namespaces joined by a veth pair, a private /30 between them, the tcp
// provider. Prefill runs in one, decode and the router in the other; the test's client talks
// from inside the second. Needs root (CAP_NET_ADMIN); skipped with the reason otherwise.
// Namespaces and links are removed at the end whatever happened.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <cstdlib>
#include <future>

#include "serve_procs.h"

namespace ferry::serve::testing {
namespace {

int sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); }

// Two namespaces and the veth between them; torn down by the destructor.
struct NetPair {
    std::string a, b, va, vb, addr_a, addr_b;
    std::string error;

    NetPair() {
        int id = ::getpid() % 10000;
        a = fmt::format("ferry-t{}-a", id);
        b = fmt::format("ferry-t{}-b", id);
        va = fmt::format("fva{}", id);
        vb = fmt::format("fvb{}", id);
        // A /30 from a private range, derived from the pid so parallel runs do not collide.
        int net = (id % 60) * 4;
        addr_a = fmt::format("10.213.{}.{}", id % 250, net + 1);
        addr_b = fmt::format("10.213.{}.{}", id % 250, net + 2);
        if (::geteuid() != 0) {
            error = "not root: network namespaces cannot be created";
            return;
        }
        if (sh("ip netns add " + a) != 0 || sh("ip netns add " + b) != 0) {
            error = "`ip netns add` failed (no CAP_SYS_ADMIN or no iproute2)";
            return;
        }
        const std::string cmds[] = {
            fmt::format("ip link add {} type veth peer name {}", va, vb),
            fmt::format("ip link set {} netns {}", va, a),
            fmt::format("ip link set {} netns {}", vb, b),
            fmt::format("ip -n {} addr add {}/30 dev {}", a, addr_a, va),
            fmt::format("ip -n {} addr add {}/30 dev {}", b, addr_b, vb),
            fmt::format("ip -n {} link set {} up", a, va),
            fmt::format("ip -n {} link set {} up", b, vb),
            fmt::format("ip -n {} link set lo up", a),
            fmt::format("ip -n {} link set lo up", b),
        };
        for (const auto& c : cmds) {
            if (sh(c) != 0) {
                error = "failed: " + c;
                return;
            }
        }
    }
    ~NetPair() {
        sh("ip netns del " + a);  // takes the veth pair with it
        sh("ip netns del " + b);
    }
    void set_link(bool up) {
        sh(fmt::format("ip -n {} link set {} {}", a, va, up ? "up" : "down"));
    }
};

// Runs fn on a thread that lives in namespace `ns`: its sockets are that namespace's.
template <typename F>
auto in_ns(const std::string& ns, F fn) -> decltype(fn()) {
    return std::async(std::launch::async,
                      [&] {
                          int fd = ::open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
                          if (fd >= 0) {
                              ::setns(fd, CLONE_NEWNET);
                              ::close(fd);
                          }
                          return fn();
                      })
        .get();
}

TEST(NetnsE2E, RequestsCrossHostsLinkDownFailsCleanlyAndServiceResumes) {
    NetPair net;
    if (!net.error.empty()) GTEST_SKIP() << "skipped: " << net.error;
    auto dir = std::filesystem::temp_directory_path() / fmt::format("ferry-netns-{}", ::getpid());
    std::filesystem::create_directories(dir);
    const int pport = 8100, dport = 8200, rport = 8000;  // each namespace has its own ports
    auto engine = [&](const std::string& ns, const char* role, const std::string& host, int port,
                      const std::string& time_scale) {
        return Proc::spawn(std::vector<std::string>{"ip", "netns", "exec", ns} +
                               engine_argv(role, port,
                                           {"--host", host, "--num-blocks", "256", "--provider",
                                            "tcp", "--kv-lease", "4", "--kv-op-timeout", "2",
                                            "--kv-wait-timeout", "4", "--time-scale", time_scale}),
                           (dir / fmt::format("{}.log", role)).string());
    };
    std::vector<Proc> procs;
    // Prefill slowed (a few hundred ms per prompt) so that the link can go down while a
    // request is between its legs.
    procs.push_back(engine(net.a, "prefill", net.addr_a, pport, "3000"));
    procs.push_back(engine(net.b, "decode", net.addr_b, dport, "1"));
    procs.push_back(Proc::spawn(
        {"ip", "netns", "exec", net.b, ferry_binary(), "serve", "router", "--host", net.addr_b,
         "--port", std::to_string(rport), "--prefill", fmt::format("{}:{}", net.addr_a, pport),
         "--decode", fmt::format("{}:{}", net.addr_b, dport), "--request-timeout", "6"},
        (dir / "router.log").string()));
    auto logs = [&] {
        std::string s;
        for (auto& p : procs) s += p.log_text() + "\n";
        return s;
    };
    std::string A = net.addr_a, B = net.addr_b;
    bool up = in_ns(net.b, [&] {
        return wait_healthy(A, pport) && wait_healthy(B, dport) && wait_healthy(B, rport);
    });
    ASSERT_TRUE(up) << logs();

    auto request = [&](int seed, int max_tokens) {
        return in_ns(net.b, [&] {
            auto prompt = prompt_of(200, seed);
            Streamed r =
                stream(B, rport, {{"prompt", prompt}, {"max_tokens", max_tokens}, {"stream", true}},
                       seconds(15));
            bool ok = r.transport.ok() && r.status == 200 && !r.error_event &&
                      r.tokens == tiny_expected(prompt, max_tokens);
            return std::make_pair(ok, r);
        });
    };
    auto pools_full = [&] {
        return in_ns(net.b, [&] {
            return metric(A, pport, "ferry_kv_blocks_used") == 0 &&
                   metric(B, dport, "ferry_kv_blocks_used") == 0;
        });
    };

    for (int i = 0; i < 3; ++i) {
        auto [ok, r] = request(i, 6);
        ASSERT_TRUE(ok) << "across hosts, request " << i << ": " << r.raw << logs();
    }

    // Link down: requests end with an error the client can read, within the router's timeout.
    net.set_link(false);
    for (int i = 0; i < 2; ++i) {
        TimePoint t0 = Clock::now();
        auto [ok, r] = request(10 + i, 6);
        EXPECT_FALSE(ok);
        EXPECT_TRUE(r.status >= 400 || r.error_event || !r.transport.ok()) << r.raw;
        EXPECT_LT(to_ms(Clock::now() - t0), 12000.0);
        if (r.status >= 400) {
            EXPECT_NE(r.raw.find("error"), std::string::npos) << r.raw;
        }
        fmt::print("link down, request {}: HTTP {} after {:.0f} ms: {}\n", i, r.status,
                   to_ms(Clock::now() - t0), r.raw.substr(0, 200));
    }

    // Down while a request is in flight (prefill computing, KV not sent yet): the client gets
    // an error, and once the link is back every block on both sides is free again.
    net.set_link(true);
    bool resumed_once = false;
    Duration one_request{};
    for (int i = 0; i < 10 && !resumed_once; ++i) {
        TimePoint t0 = Clock::now();
        resumed_once = request(30 + i, 6).first;
        one_request = Clock::now() - t0;
        if (!resumed_once) std::this_thread::sleep_for(milliseconds(500));
    }
    ASSERT_TRUE(resumed_once) << logs();
    {
        TimePoint t0 = Clock::now();
        auto in_flight = std::async(std::launch::async, [&] { return request(40, 6); });
        std::this_thread::sleep_for(one_request / 3);
        net.set_link(false);
        auto [ok, r] = in_flight.get();
        EXPECT_FALSE(ok);
        EXPECT_TRUE(r.status >= 400 || r.error_event || !r.transport.ok()) << r.raw;
        fmt::print(
            "link down mid-request ({:.0f} ms into a {:.0f} ms request): HTTP {} after "
            "{:.0f} ms: {}\n",
            to_ms(one_request / 3), to_ms(one_request), r.status, to_ms(Clock::now() - t0),
            r.raw.substr(0, 240));
        EXPECT_LT(to_ms(Clock::now() - t0), 15000.0);
    }

    // Back up: nothing leaked, and service resumes (a few tries while connections re-form).
    net.set_link(true);
    EXPECT_TRUE(eventually(pools_full, seconds(15))) << logs();
    bool resumed = false;
    for (int i = 0; i < 10 && !resumed; ++i) {
        resumed = request(20 + i, 6).first;
        if (!resumed) std::this_thread::sleep_for(milliseconds(500));
    }
    EXPECT_TRUE(resumed) << logs();
    EXPECT_TRUE(eventually(pools_full, seconds(10)));
    procs.clear();
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ferry::serve::testing
