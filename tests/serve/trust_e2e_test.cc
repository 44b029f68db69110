// The trust model end to end, with real `ferry serve` processes: legs whose
// kv_transfer_params the deployment's router did not sign are refused before
// any connection or read, and a pull may read only the blocks prefill offered
// for that transfer (docs/SERVING.md, "Trust").
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>

#include "ferry/common/auth.h"
#include "ferry/serve/kv_params_auth.h"
#include "serve_procs.h"

namespace ferry::serve::testing {
namespace {

constexpr const char* kHost = "127.0.0.1";

// A TCP listener the test owns: it must never see a connection.
struct Listener {
    int fd = -1;
    int port = 0;
    Listener() {
        fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t len = sizeof a;
        ::bind(fd, reinterpret_cast<sockaddr*>(&a), len);
        ::listen(fd, 16);
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
        port = ntohs(a.sin_port);
    }
    ~Listener() { ::close(fd); }
    bool saw_a_connection(Duration wait) const {
        pollfd p{fd, POLLIN, 0};
        return ::poll(&p, 1, int(to_ms(wait))) > 0;
    }
};

// prefill + decode + router sharing a secret file of the test's own.
struct TrustStack {
    std::filesystem::path dir;
    std::string secret_file;
    int prefill_port = 0, decode_port = 0, router_port = 0;
    std::vector<Proc> procs;
    bool up = false;

    explicit TrustStack(const std::string& mode) {
        dir = std::filesystem::temp_directory_path() /
              fmt::format("ferry-trust-{}-{}", ::getpid(), mode);
        std::filesystem::create_directories(dir);
        secret_file = (dir / "deployment.secret").string();
        if (!load_or_create_secret_file(secret_file).ok()) ADD_FAILURE() << "no secret file";
        auto engine = [&](const char* role, int* port) {
            *port = free_port();
            procs.push_back(Proc::spawn({ferry_binary(),
                                         "serve",
                                         role,
                                         "--port",
                                         std::to_string(*port),
                                         "--model",
                                         "tiny",
                                         "--tp",
                                         "1",
                                         "--num-blocks",
                                         "256",
                                         "--kv-mode",
                                         mode,
                                         "--kv-port",
                                         "0",
                                         "--kv-lease",
                                         "3",
                                         "--kv-wait-timeout",
                                         "5",
                                         "--secret-file",
                                         secret_file},
                                        (dir / fmt::format("{}.log", role)).string()));
        };
        engine("prefill", &prefill_port);
        engine("decode", &decode_port);
        router_port = free_port();
        procs.push_back(
            Proc::spawn({ferry_binary(), "serve", "router", "--port", std::to_string(router_port),
                         "--prefill", fmt::format("{}:{}", kHost, prefill_port), "--decode",
                         fmt::format("{}:{}", kHost, decode_port), "--mode", mode, "--secret-file",
                         secret_file},
                        (dir / "router.log").string()));
        up = wait_healthy(kHost, prefill_port) && wait_healthy(kHost, decode_port) &&
             wait_healthy(kHost, router_port);
        if (!up) ADD_FAILURE() << "stack did not come up:\n" << logs();
    }
    ~TrustStack() {
        procs.clear();
        if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir);
    }
    std::string logs() const {
        std::string out;
        for (const auto& p : procs) out += p.log_text() + "\n";
        return out;
    }
    Secret secret() const { return load_secret_file(secret_file).value(); }
    bool pools_free() const {
        return metric(kHost, prefill_port, "ferry_kv_blocks_used") == 0 &&
               metric(kHost, decode_port, "ferry_kv_blocks_used") == 0;
    }
};

HttpResponse post(int port, const json& body) {
    auto r = http_post_json(kHost, port, "/v1/completions", body.dump(), seconds(10));
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    return r.ok() ? *r : HttpResponse{};
}

void expect_refused(const HttpResponse& r, const std::string& words) {
    EXPECT_EQ(r.status, 403) << r.body;
    EXPECT_NE(r.body.find("not signed by this deployment's router"), std::string::npos) << r.body;
    EXPECT_NE(r.body.find(words), std::string::npos) << r.body;
}

TEST(TrustE2E, LegsNamingAHostWithoutTheRoutersTagAreRefusedAndConnectNowhere) {
    TrustStack s("push");
    ASSERT_TRUE(s.up);
    Listener target;
    auto prompt = prompt_of(80, 1);
    Secret other = Secret::generate().value();
    for (bool decode_leg : {true, false}) {
        SCOPED_TRACE(decode_leg ? "decode leg" : "prefill leg");
        KvTransferParams kv;
        (decode_leg ? kv.do_remote_prefill : kv.do_remote_decode) = true;
        kv.transfer_id = decode_leg ? "forged-d" : "forged-p";
        kv.remote_engine_id = "prefill-x";
        kv.remote_host = kHost;
        kv.remote_port = target.port;
        int port = decode_leg ? s.decode_port : s.prefill_port;

        json body = {{"prompt", prompt}, {"max_tokens", 4}};
        body["kv_transfer_params"] = kv_params_to_json(kv);  // no tag
        expect_refused(post(port, body), "no ferry_auth");
        body["kv_transfer_params"]["ferry_auth"] = std::string(64, '0');
        expect_refused(post(port, body), "does not match");
        sign_kv_params(other, &kv);  // another deployment's secret
        body["kv_transfer_params"] = kv_params_to_json(kv);
        expect_refused(post(port, body), "does not match");
        body["stream"] = true;
        expect_refused(post(port, body), "does not match");
    }
    EXPECT_FALSE(target.saw_a_connection(milliseconds(300)))
        << "an engine connected to a host named by a client";
    EXPECT_TRUE(s.pools_free());
    // The deployment itself works: the router's legs are signed under the shared
    // file.
    Streamed r = stream(kHost, s.router_port,
                        {{"prompt", prompt}, {"max_tokens", 5}, {"stream", true}}, seconds(20));
    ASSERT_EQ(r.status, 200) << r.raw << s.logs();
    EXPECT_EQ(r.tokens, tiny_expected(prompt, 5));
}

TEST(TrustE2E, PullOfBlocksNotOfferedIsRefusedAndTheRealTransferIsUnaffected) {
    TrustStack s("pull");
    ASSERT_TRUE(s.up);
    Secret secret = s.secret();
    auto prompt = prompt_of(150, 3);
    // A prefill leg as the router makes it; its answer is the offer.
    KvTransferParams leg;
    leg.do_remote_decode = true;
    leg.transfer_id = "t-real";
    leg.remote_host = kHost;
    leg.remote_port = s.decode_port;
    sign_kv_params(secret, &leg);
    HttpResponse pr = post(
        s.prefill_port,
        {{"prompt", prompt}, {"max_tokens", 1}, {"kv_transfer_params", kv_params_to_json(leg)}});
    ASSERT_EQ(pr.status, 200) << pr.body << s.logs();
    json offer = json::parse(pr.body)["kv_transfer_params"];
    ASSERT_TRUE(offer.contains("ferry_capability")) << offer.dump();
    ASSERT_GE(offer["remote_block_ids"].size(), 2u);
    offer["do_remote_prefill"] = true;
    offer["do_remote_decode"] = false;
    ASSERT_TRUE(sign_kv_params_json(secret, &offer).ok());  // what the router hands decode
    double used_before = metric(kHost, s.prefill_port, "ferry_kv_blocks_used");
    EXPECT_GT(used_before, 0);

    auto decode_with = [&](const json& kv) {
        return post(s.decode_port,
                    {{"prompt", prompt}, {"max_tokens", 6}, {"kv_transfer_params", kv}});
    };
    json forged = offer;  // other blocks under the real tag
    std::vector<int> ids = forged["remote_block_ids"].get<std::vector<int>>();
    for (int& b : ids) b = (b + 17) % 256;
    forged["remote_block_ids"] = ids;
    expect_refused(decode_with(forged), "does not match");
    forged = offer;  // the real blocks with another capability
    forged["ferry_capability"] = std::string(32, 'a');
    expect_refused(decode_with(forged), "does not match");
    forged = offer;  // the real blocks, no tag: what a client could name
    forged.erase("ferry_auth");
    expect_refused(decode_with(forged), "no ferry_auth");

    // Nothing read: decode counted no transfer and holds no block; prefill still
    // holds the offer.
    EXPECT_EQ(metric(kHost, s.decode_port, "ferry_kv_transfers_total"), 0);
    EXPECT_EQ(metric(kHost, s.decode_port, "ferry_kv_link_transfers_total{result=\"ok\"}"), 0);
    EXPECT_EQ(metric(kHost, s.decode_port, "ferry_kv_blocks_used"), 0);
    EXPECT_EQ(metric(kHost, s.prefill_port, "ferry_kv_blocks_used"), used_before);

    // The real transfer goes through untouched, and every block comes back.
    HttpResponse ok = decode_with(offer);
    ASSERT_EQ(ok.status, 200) << ok.body << s.logs();
    json answer = json::parse(ok.body);
    std::vector<int32_t> tokens = answer["choices"][0]["token_ids"];
    EXPECT_EQ(tokens, tiny_expected(prompt, 6));
    EXPECT_TRUE(eventually([&] { return s.pools_free(); })) << s.logs();
}

// No --secret-file: every process takes the default file, and the three starting at once
// (none of them finds it) agree on the one that wins the race.
TEST(TrustE2E, AbortWithoutTheRoutersTagIsRefusedAndEndsNothing) {
    TrustStack s("push");
    ASSERT_TRUE(s.up);
    auto abort = [&](int port, const json& body) {
        auto r = http_post_json(kHost, port, "/ferry/abort", body.dump(), seconds(5));
        EXPECT_TRUE(r.ok()) << r.status().to_string();
        return r.ok() ? *r : HttpResponse{};
    };
    Secret other = Secret::generate().value();
    for (int port : {s.prefill_port, s.decode_port}) {
        auto unsigned_abort = abort(port, {{"transfer_id", "t-1"}, {"reason", "x"}});
        EXPECT_EQ(unsigned_abort.status, 403) << unsigned_abort.body;
        EXPECT_NE(unsigned_abort.body.find("/ferry/abort is not signed"), std::string::npos)
            << unsigned_abort.body;
        auto foreign =
            abort(port, {{"transfer_id", "t-1"}, {"ferry_auth", abort_tag(other, "t-1")}});
        EXPECT_EQ(foreign.status, 403) << foreign.body;
        // A tag of another transfer id does not pass for this one.
        auto moved =
            abort(port, {{"transfer_id", "t-2"}, {"ferry_auth", abort_tag(s.secret(), "t-1")}});
        EXPECT_EQ(moved.status, 403) << moved.body;
        // The router's own form is taken (an unknown transfer: nothing to end).
        auto routers =
            abort(port, {{"transfer_id", "t-1"}, {"ferry_auth", abort_tag(s.secret(), "t-1")}});
        EXPECT_EQ(routers.status, 200) << routers.body;
    }
    // Requests through the router still complete and leave both pools free.
    auto prompt = prompt_of(80, 3);
    auto r = post(s.router_port, {{"prompt", prompt}, {"max_tokens", 4}});
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_TRUE(eventually([&] { return s.pools_free(); })) << s.logs();
}

TEST(TrustE2E, DefaultSecretIsGeneratedOnceForProcessesStartingTogether) {
    std::filesystem::path home =
        std::filesystem::temp_directory_path() / fmt::format("ferry-trust-home-{}", ::getpid());
    std::filesystem::remove_all(home);
    std::filesystem::create_directories(home);
    const char* old = std::getenv("XDG_CONFIG_HOME");
    std::string saved = old ? old : "";
    ::setenv("XDG_CONFIG_HOME", home.c_str(), 1);  // inherited by the processes spawned below
    int pp = free_port(), dp = free_port(), rp = free_port();
    std::vector<Proc> procs;
    auto engine = [&](const char* role, int port) {
        procs.push_back(
            Proc::spawn({ferry_binary(), "serve", role, "--port", std::to_string(port), "--model",
                         "tiny", "--tp", "1", "--num-blocks", "128", "--kv-port", "0"},
                        (home / fmt::format("{}.log", role)).string()));
    };
    engine("prefill", pp);
    engine("decode", dp);
    procs.push_back(
        Proc::spawn({ferry_binary(), "serve", "router", "--port", std::to_string(rp), "--prefill",
                     fmt::format("{}:{}", kHost, pp), "--decode", fmt::format("{}:{}", kHost, dp)},
                    (home / "router.log").string()));
    if (old)
        ::setenv("XDG_CONFIG_HOME", saved.c_str(), 1);
    else
        ::unsetenv("XDG_CONFIG_HOME");
    auto logs = [&] {
        std::string out;
        for (const auto& p : procs) out += p.log_text() + "\n";
        return out;
    };
    ASSERT_TRUE(wait_healthy(kHost, pp) && wait_healthy(kHost, dp) && wait_healthy(kHost, rp))
        << logs();
    std::string file = (home / "ferry" / "deployment.secret").string();
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(st.st_size, off_t(Secret::kGeneratedBytes));
    auto prompt = prompt_of(70, 2);
    Streamed r =
        stream(kHost, rp, {{"prompt", prompt}, {"max_tokens", 4}, {"stream", true}}, seconds(20));
    ASSERT_EQ(r.status, 200) << r.raw << logs();
    EXPECT_EQ(r.tokens, tiny_expected(prompt, 4));
    procs.clear();
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(home);
}

TEST(TrustE2E, ABadSecretFileStopsTheProcessWithAnErrorNamingIt) {
    std::filesystem::path dir =
        std::filesystem::temp_directory_path() / fmt::format("ferry-trust-bad-{}", ::getpid());
    std::filesystem::create_directories(dir);
    std::string file = (dir / "open.secret").string();
    std::ofstream(file) << std::string(32, 'k');
    ::chmod(file.c_str(), 0644);
    Proc p = Proc::spawn({ferry_binary(), "serve", "router", "--port", std::to_string(free_port()),
                          "--secret-file", file},
                         (dir / "router.log").string());
    EXPECT_TRUE(eventually([&] { return !p.running(); }, seconds(10)));
    std::string log = p.log_text();
    EXPECT_NE(log.find(file), std::string::npos) << log;
    EXPECT_NE(log.find("group or others"), std::string::npos) << log;
    std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ferry::serve::testing
