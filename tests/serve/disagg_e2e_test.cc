// End to end with real processes: `ferry serve prefill`, `ferry serve decode` and
// `ferry serve router` over loopback, the KV moving through the libfabric connector (shm).
// Everything asserted is what a client or an operator sees: tokens, HTTP statuses, /metrics.
#include <gtest/gtest.h>

#include <future>

#include "serve_procs.h"

namespace ferry::serve::testing {
namespace {

constexpr const char* kHost = "127.0.0.1";

struct Stack {
    std::filesystem::path dir;
    std::vector<int> prefill_ports, decode_ports;
    int router_port = 0;
    std::vector<Proc> procs;
    bool up = false;

    Stack(const std::string& mode, int np, int nd,
          const std::vector<std::string>& engine_extra = {}, const std::string& provider = "shm",
          const std::vector<std::string>& prefill_extra = {}) {
        dir = std::filesystem::temp_directory_path() /
              fmt::format("ferry-e2e-{}-{}", ::getpid(), mode);
        std::filesystem::create_directories(dir);
        std::string prefills, decodes;
        auto engine = [&](const char* role, int i, std::vector<int>& ports, std::string& list) {
            int port = free_port();
            ports.push_back(port);
            std::vector<std::string> argv =
                engine_argv(role, port, {"--kv-mode", mode, "--provider", provider}) +
                short_kv_deadlines();
            argv.insert(argv.end(), engine_extra.begin(), engine_extra.end());
            if (std::string(role) == "prefill")
                argv.insert(argv.end(), prefill_extra.begin(), prefill_extra.end());
            procs.push_back(Proc::spawn(argv, (dir / fmt::format("{}{}.log", role, i)).string()));
            list += (list.empty() ? "" : ",") + fmt::format("{}:{}", kHost, port);
        };
        for (int i = 0; i < np; ++i) engine("prefill", i, prefill_ports, prefills);
        for (int i = 0; i < nd; ++i) engine("decode", i, decode_ports, decodes);
        router_port = free_port();
        procs.push_back(Proc::spawn(
            {ferry_binary(), "serve", "router", "--port", std::to_string(router_port), "--prefill",
             prefills, "--decode", decodes, "--mode", mode, "--request-timeout", "20"},
            (dir / "router.log").string()));
        up = true;
        for (int p : prefill_ports) up = up && wait_healthy(kHost, p);
        for (int p : decode_ports) up = up && wait_healthy(kHost, p);
        up = up && wait_healthy(kHost, router_port);
        if (!up) ADD_FAILURE() << "stack did not come up:\n" << logs();
    }
    ~Stack() {
        procs.clear();
        if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
    }
    std::string logs() const {
        std::string out;
        for (const auto& p : procs) out += p.log_text() + "\n";
        return out;
    }
    Proc& prefill_proc(int i) { return procs[size_t(i)]; }
    Proc& decode_proc(int i) { return procs[prefill_ports.size() + size_t(i)]; }
    bool pools_full() const {
        for (const auto* ports : {&prefill_ports, &decode_ports})
            for (int p : *ports)
                if (metric(kHost, p, "ferry_kv_blocks_used") != 0) return false;
        return true;
    }
};

TEST(DisaggE2E, StreamedRequestReturnsVerifiedTokensInPushPullAndPullInline) {
    for (std::string mode : {"push", "pull", "pull-inline"}) {
        SCOPED_TRACE(mode);
        Stack s(mode, 1, 1);
        ASSERT_TRUE(s.up);
        for (int i = 0; i < 3; ++i) {
            auto prompt = prompt_of(100 + 37 * i, i);  // partial last blocks
            Streamed r =
                stream(kHost, s.router_port,
                       {{"prompt", prompt}, {"max_tokens", 9}, {"stream", true}}, seconds(20));
            ASSERT_TRUE(r.transport.ok()) << r.transport.to_string();
            ASSERT_EQ(r.status, 200) << r.raw << s.logs();
            EXPECT_FALSE(r.error_event) << r.raw;
            EXPECT_TRUE(r.done);
            EXPECT_EQ(r.tokens, tiny_expected(prompt, 9)) << "request " << i;
        }
        EXPECT_EQ(metric(kHost, s.decode_ports[0], "ferry_kv_transfers_total"), 3);
        EXPECT_TRUE(eventually([&] { return s.pools_full(); })) << s.logs();
    }
}

// --kv-num-rails and --kv-rails reach the KV engine, and /metrics says which rails carried the
// KV: two shm rails (no NIC is nearer than another), both used by prefill's writes.
TEST(DisaggE2E, KvRailsFlagsReachTheEngineAndMetricsShowEachRail) {
    Stack s("push", 1, 1, {"--kv-num-rails", "2", "--kv-rails", "all"});
    ASSERT_TRUE(s.up);
    for (int i = 0; i < 2; ++i) {
        auto prompt = prompt_of(300 + 11 * i, i);
        Streamed r = stream(kHost, s.router_port,
                            {{"prompt", prompt}, {"max_tokens", 3}, {"stream", true}}, seconds(20));
        ASSERT_EQ(r.status, 200) << r.raw << s.logs();
        EXPECT_EQ(r.tokens, tiny_expected(prompt, 3));
    }
    const int prefill = s.prefill_ports[0], decode = s.decode_ports[0];
    for (const char* rail : {"0", "1"}) {
        SCOPED_TRACE(rail);
        EXPECT_GT(metric(kHost, prefill,
                         fmt::format("ferry_kv_rail_bytes_posted_total{{rail=\"{}\"}}", rail)),
                  0)
            << s.logs();
        EXPECT_GT(metric(kHost, prefill,
                         fmt::format("ferry_kv_rail_ops_posted_total{{rail=\"{}\"}}", rail)),
                  0);
    }
    EXPECT_EQ(metric(kHost, prefill, "ferry_kv_rail_bytes_posted_total{rail=\"2\"}"), -1);
    EXPECT_GT(metric(kHost, decode, "ferry_kv_rail_imm_arrivals_total{rail=\"0\"}") +
                  metric(kHost, decode, "ferry_kv_rail_imm_arrivals_total{rail=\"1\"}"),
              0);
    EXPECT_EQ(metric(kHost, prefill, "ferry_kv_rail_fallbacks_total"), 0);
}

// A client that hangs up through the router, mid-stream or before its first token, leaves no
// block held on either engine, and the stack serves the next request.
TEST(DisaggE2E, ClientThatHangsUpLeavesNoBlockHeld) {
    Stack s("push", 1, 1, {"--time-scale", "5"});  // 3000 tokens then take seconds
    ASSERT_TRUE(s.up);
    auto prompt = prompt_of(100, 7);
    for (bool stream : {true, false}) {
        SCOPED_TRACE(stream ? "mid-stream" : "before the answer");
        std::string body =
            json{{"prompt", prompt}, {"max_tokens", 3000}, {"stream", stream}}.dump();
        int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(uint16_t(s.router_port));
        ::inet_pton(AF_INET, kHost, &a.sin_addr);
        ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
        std::string req = fmt::format(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: {}\r\n\r\n{}",
            body.size(), body);
        ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
        if (stream) {  // the first token event, then gone
            std::string got;
            char buf[4096];
            while (got.find("data: ") == std::string::npos) {
                ssize_t n = ::recv(fd, buf, sizeof buf, 0);
                ASSERT_GT(n, 0) << got;
                got.append(buf, size_t(n));
            }
        } else {  // gone once decode holds the request's blocks
            EXPECT_TRUE(eventually(
                [&] { return metric(kHost, s.decode_ports[0], "ferry_kv_blocks_used") > 0; },
                seconds(10)));
        }
        // Still running when the client goes: its blocks are held.
        EXPECT_GT(metric(kHost, s.decode_ports[0], "ferry_kv_blocks_used"), 0);
        ::close(fd);
        EXPECT_TRUE(eventually([&] { return s.pools_full(); }, seconds(10)))
            << "prefill used " << metric(kHost, s.prefill_ports[0], "ferry_kv_blocks_used")
            << ", decode used " << metric(kHost, s.decode_ports[0], "ferry_kv_blocks_used") << "\n"
            << s.logs();
        EXPECT_TRUE(eventually(
            [&] { return metric(kHost, s.decode_ports[0], "ferry_requests_running") == 0; },
            seconds(10)))
            << "decode running " << metric(kHost, s.decode_ports[0], "ferry_requests_running")
            << ", prefill running " << metric(kHost, s.prefill_ports[0], "ferry_requests_running")
            << ", held " << metric(kHost, s.prefill_ports[0], "ferry_requests_held_for_transfer");
    }
    Streamed r = stream(kHost, s.router_port,
                        {{"prompt", prompt}, {"max_tokens", 4}, {"stream", true}}, seconds(20));
    ASSERT_EQ(r.status, 200) << r.raw << s.logs();
    EXPECT_EQ(r.tokens, tiny_expected(prompt, 4));
}

TEST(DisaggE2E, TwoPrefillTwoDecodeRoundRobin) {
    Stack s("push", 2, 2);
    ASSERT_TRUE(s.up);
    ASSERT_TRUE(wait_router_sees_all(kHost, s.router_port)) << s.logs();
    for (int i = 0; i < 4; ++i) {
        auto prompt = prompt_of(64 + i, i);
        Streamed r = stream(kHost, s.router_port,
                            {{"prompt", prompt}, {"max_tokens", 4}, {"stream", true}}, seconds(20));
        ASSERT_EQ(r.status, 200) << r.raw << s.logs();
        EXPECT_EQ(r.tokens, tiny_expected(prompt, 4));
    }
    for (const auto* ports : {&s.prefill_ports, &s.decode_ports})
        for (int p : *ports) EXPECT_EQ(metric(kHost, p, "ferry_requests_total"), 2) << p;
    EXPECT_TRUE(eventually([&] { return s.pools_full(); }));
}

TEST(DisaggE2E, InvalidBodiesGet400WithAMessage) {
    Stack s("push", 1, 1);
    ASSERT_TRUE(s.up);
    const std::pair<std::string, std::string> cases[] = {
        {"not json", "not valid JSON"},
        {R"({"prompt": 3})", "'prompt'"},
        {R"({"prompt": "hi", "max_tokens": -1})", "max_tokens"},
    };
    for (const auto& [body, words] : cases) {
        auto r = http_post_json(kHost, s.router_port, "/v1/completions", body, seconds(5));
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->status, 400) << body;
        EXPECT_NE(r->body.find(words), std::string::npos) << body << " -> " << r->body;
    }
    EXPECT_EQ(metric(kHost, s.prefill_ports[0], "ferry_requests_total"), 0);
}

TEST(DisaggE2E, DecodeKilledMidRequestGivesAClientErrorAndPrefillPoolIsFullAgain) {
    // Decode slowed down (time scale) so that the kill lands while tokens are streaming.
    Stack s("push", 1, 1, {"--time-scale", "200"});
    ASSERT_TRUE(s.up);
    double total = metric(kHost, s.prefill_ports[0], "ferry_kv_blocks_total");
    ASSERT_GT(total, 0);
    auto prompt = prompt_of(300, 5);
    bool killed = false;
    Streamed r =
        stream(kHost, s.router_port, {{"prompt", prompt}, {"max_tokens", 500}, {"stream", true}},
               seconds(20), [&](size_t n) {
                   if (n == 2 && !killed) {
                       s.decode_proc(0).kill_now();
                       killed = true;
                   }
               });
    ASSERT_TRUE(killed) << r.raw << s.logs();
    // The client notices: an error event, a broken stream, or a non-200 answer; never a
    // normal end with fewer tokens.
    EXPECT_TRUE(r.error_event || !r.transport.ok() || r.status != 200) << r.raw;
    EXPECT_LT(r.tokens.size(), 500u);
    EXPECT_TRUE(eventually(
        [&] { return metric(kHost, s.prefill_ports[0], "ferry_kv_blocks_free") == total; },
        seconds(10)));
    EXPECT_EQ(metric(kHost, s.prefill_ports[0], "ferry_kv_link_active"), 0);
}

// Decode dies while prefill still computes: in push it had registered its blocks, in pull it
// never reads. Either way prefill's blocks must come back (writes fail within the op timeout,
// or the lease ends) and the client must hear an error.
TEST(DisaggE2E, DecodeKilledWhilePrefillComputesFreesPrefillBlocks) {
    for (std::string mode : {"push", "pull"}) {
        SCOPED_TRACE(mode);
        // Prefill slowed down so that the kill lands before its KV is handed over.
        Stack s(mode, 1, 1, {"--kv-op-timeout", "2"}, "shm", {"--time-scale", "3000"});
        ASSERT_TRUE(s.up);
        double total = metric(kHost, s.prefill_ports[0], "ferry_kv_blocks_total");
        auto prompt = prompt_of(300, 9);
        auto killer = std::async(std::launch::async, [&] {
            // Kill once prefill holds blocks for this request: it is computing.
            bool seen = eventually(
                [&] { return metric(kHost, s.prefill_ports[0], "ferry_kv_blocks_used") > 0; },
                seconds(5));
            s.decode_proc(0).kill_now();
            return seen;
        });
        TimePoint t0 = Clock::now();
        Streamed r = stream(kHost, s.router_port,
                            {{"prompt", prompt}, {"max_tokens", 4}, {"stream", true}}, seconds(20));
        EXPECT_TRUE(killer.get()) << "prefill never held blocks: " << s.logs();
        EXPECT_TRUE(r.error_event || !r.transport.ok() || r.status != 200) << r.raw;
        fmt::print("{}: decode killed during prefill: HTTP {} after {:.0f} ms: {}\n", mode,
                   r.status, to_ms(Clock::now() - t0), r.raw.substr(0, 200));
        EXPECT_TRUE(eventually(
            [&] { return metric(kHost, s.prefill_ports[0], "ferry_kv_blocks_free") == total; },
            seconds(10)))
            << s.logs();
        EXPECT_EQ(metric(kHost, s.prefill_ports[0], "ferry_kv_link_active"), 0);
    }
}

// Chunked prefill in push: each chunk's KV leaves while the next computes; decode digests it
// as it lands. Prompt sizes that are multiples of neither the chunk (40, cut to 32 at block
// boundaries) nor the block (16).
TEST(DisaggE2E, ChunkedPushReturnsVerifiedTokensAtSizesNotMultiplesOfChunkOrBlock) {
    Stack s("push", 1, 1, {}, "shm", {"--prefill-chunk", "40"});
    ASSERT_TRUE(s.up);
    std::vector<size_t> sizes = {1, 17, 100, 137, 250};
    for (size_t i = 0; i < sizes.size(); ++i) {
        auto prompt = prompt_of(sizes[i], int(i) + 20);
        Streamed r = stream(kHost, s.router_port,
                            {{"prompt", prompt}, {"max_tokens", 7}, {"stream", true}}, seconds(20));
        ASSERT_TRUE(r.transport.ok()) << r.transport.to_string();
        ASSERT_EQ(r.status, 200) << r.raw << s.logs();
        EXPECT_EQ(r.tokens, tiny_expected(prompt, 7)) << sizes[i] << " tokens";
    }
    // 1 + 1 + 3 (32, 32, 36) + 5 (4 x 32, 9) + 8 (7 x 32, 26) chunks: a rest that fits the
    // budget runs whole.
    EXPECT_EQ(metric(kHost, s.prefill_ports[0], "ferry_prefill_steps_total"), 18);
    EXPECT_TRUE(eventually([&] { return s.pools_full(); })) << s.logs();
}

// Prefill dies between two chunks: decode has some of the KV, never all; the client hears an
// error and decode's blocks come back once the connector's lease ends.
TEST(DisaggE2E, PrefillKilledBetweenChunksGivesAClientErrorAndDecodePoolIsFullAgain) {
    Stack s("push", 1, 1, {"--kv-op-timeout", "2"}, "shm",
            {"--prefill-chunk", "32", "--time-scale", "20000"});
    ASSERT_TRUE(s.up);
    auto prompt = prompt_of(300, 11);
    auto killer = std::async(std::launch::async, [&] {
        // Decode holds blocks once prefill scheduled the request: chunks are being computed.
        bool seen =
            eventually([&] { return metric(kHost, s.decode_ports[0], "ferry_kv_blocks_used") > 0; },
                       seconds(5));
        std::this_thread::sleep_for(milliseconds(300));
        s.prefill_proc(0).kill_now();
        return seen;
    });
    Streamed r = stream(kHost, s.router_port,
                        {{"prompt", prompt}, {"max_tokens", 4}, {"stream", true}}, seconds(20));
    EXPECT_TRUE(killer.get()) << "decode never held blocks: " << s.logs();
    EXPECT_TRUE(r.error_event || !r.transport.ok() || r.status != 200) << r.raw;
    EXPECT_TRUE(eventually(
        [&] { return metric(kHost, s.decode_ports[0], "ferry_kv_blocks_used") == 0; }, seconds(10)))
        << s.logs();
    EXPECT_EQ(metric(kHost, s.decode_ports[0], "ferry_kv_link_active"), 0);
}

// Both legs leave at once, but decode reserves blocks only for what prefill has scheduled: a
// request still queueing at prefill holds nothing at decode.
TEST(DisaggE2E, PushDecodeReservesBlocksOnlyOncePrefillSchedules) {
    Stack s("push", 1, 1, {}, "shm", {"--max-num-seqs", "1", "--time-scale", "3000"});
    ASSERT_TRUE(s.up);
    auto p1 = prompt_of(300, 12), p2 = prompt_of(300, 13);
    auto send = [&](const std::vector<int32_t>& p) {
        return std::async(std::launch::async, [&, p] {
            return stream(kHost, s.router_port,
                          {{"prompt", p}, {"max_tokens", 4}, {"stream", true}}, seconds(20));
        });
    };
    auto f1 = send(p1), f2 = send(p2);
    // One request computes at prefill, the other queues there: decode holds the blocks of one
    // (300 + 4 - 1 tokens: 19 blocks of 16) and waits for prefill on the other.
    bool seen = eventually([&] {
        return metric(kHost, s.decode_ports[0], "ferry_requests_waiting_for_prefill") == 1 &&
               metric(kHost, s.decode_ports[0], "ferry_kv_blocks_used") == 19;
    });
    EXPECT_TRUE(seen) << "waiting_for_prefill "
                      << metric(kHost, s.decode_ports[0], "ferry_requests_waiting_for_prefill")
                      << ", blocks used "
                      << metric(kHost, s.decode_ports[0], "ferry_kv_blocks_used");
    Streamed r1 = f1.get(), r2 = f2.get();
    ASSERT_EQ(r1.status, 200) << r1.raw << s.logs();
    ASSERT_EQ(r2.status, 200) << r2.raw << s.logs();
    EXPECT_EQ(r1.tokens, tiny_expected(p1, 4));
    EXPECT_EQ(r2.tokens, tiny_expected(p2, 4));
    EXPECT_TRUE(eventually([&] { return s.pools_full(); })) << s.logs();
}

}  // namespace
}  // namespace ferry::serve::testing
