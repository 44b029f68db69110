// Deployments put together wrong, with real `ferry serve` processes: what the operator sees
// is a router that says what is wrong and requests that fail at once saying so, never a hang.
#include <gtest/gtest.h>

#include "serve_procs.h"

namespace ferry::serve::testing {
namespace {

constexpr const char* kHost = "127.0.0.1";

// Engines started with --kv-mode pull behind a router left at --mode push (issue 30: every
// request hung for the 30 s lease, then 504, while the router's /health said ok).
TEST(TopologyE2E, EnginesInPullBehindARouterInPushAreNamedAndRequestsFailAtOnce) {
    auto dir = std::filesystem::temp_directory_path() / fmt::format("ferry-topo-{}", ::getpid());
    std::filesystem::create_directories(dir);
    int pport = free_port(), dport = free_port(), rport = free_port();
    auto engine = [&](const char* role, int port) {
        return Proc::spawn({ferry_binary(), "serve", role, "--port", std::to_string(port),
                            "--model", "tiny", "--tp", "1", "--num-blocks", "64", "--kv-mode",
                            "pull", "--provider", "shm", "--kv-port", "0"},
                           (dir / fmt::format("{}.log", role)).string());
    };
    Proc prefill = engine("prefill", pport);
    Proc decode = engine("decode", dport);
    Proc router = Proc::spawn(
        {ferry_binary(), "serve", "router", "--port", std::to_string(rport), "--prefill",
         fmt::format("{}:{}", kHost, pport), "--decode", fmt::format("{}:{}", kHost, dport)},
        (dir / "router.log").string());
    auto logs = [&] {
        return prefill.log_text() + "\n" + decode.log_text() + "\n" + router.log_text();
    };
    ASSERT_TRUE(wait_healthy(kHost, pport) && wait_healthy(kHost, dport)) << logs();
    auto h = http_get(kHost, pport, "/health", seconds(2));
    ASSERT_TRUE(h.ok());
    json j = json::parse(h->body, nullptr, false);
    EXPECT_EQ(j.value("role", ""), "prefill") << h->body;
    EXPECT_EQ(j.value("kv_mode", ""), "pull") << h->body;

    const std::string named = "the engine runs --kv-mode pull, this router --mode push";
    std::string body;
    EXPECT_TRUE(eventually(
        [&] {
            auto r = http_get(kHost, rport, "/health", seconds(2));
            body = r.ok() ? r->body : "";
            return r.ok() && r->status == 503 && body.find(named) != std::string::npos;
        },
        seconds(15)))
        << body << "\n"
        << logs();
    TimePoint t0 = Clock::now();
    Streamed s =
        stream(kHost, rport, {{"prompt", prompt_of(40, 1)}, {"max_tokens", 4}, {"stream", true}},
               seconds(40));
    double ms = to_ms(Clock::now() - t0);
    std::printf("completion through the mismatched router: HTTP %d after %.1f ms\n", s.status, ms);
    EXPECT_EQ(s.status, 503) << s.raw;
    EXPECT_NE(s.raw.find(named), std::string::npos) << s.raw;
    EXPECT_LT(ms, 2000.0);  // the lease is 30 s
    EXPECT_EQ(metric(kHost, pport, "ferry_requests_total"), 0);
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ferry::serve::testing
