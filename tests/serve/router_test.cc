// The router in front of prefill and decode engines over loopback HTTP, with the in-process KV
// link moving the bytes. The network KV connector replaces the link later; the router does not
// change.
#include "serve/router.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "cli/setting_flags.h"
#include "serve/engine_server.h"
#include "serve/inprocess_kv_link.h"
#include "serve/openai_api.h"
#include "serve_procs.h"

namespace ferry::serve {
namespace {

using nlohmann::json;
constexpr const char* kHost = "127.0.0.1";

struct Node {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<EngineServer> server;
};

double metric(int port, const std::string& name) { return testing::metric(kHost, port, name); }
using testing::eventually;

// The names `ferry serve router` gives the router's settings (src/cli/setting_flags.cc): what
// an operator of the command reads in its answers is the flag to change.
SettingNames router_flags() { return cli::flag_names("--port", "--router-threads"); }

struct Cluster {
    std::vector<Node> prefill, decode;
    std::unique_ptr<InProcessKvLink> link;
    std::unique_ptr<Router> router;

    // `decode_step`: stretches the decode engines' modelled steps to about this long.
    kv::TransferMode mode;

    Cluster(size_t np, size_t nd, kv::TransferMode link_mode, Duration lease = seconds(5),
            Duration decode_step = Duration::zero())
        : mode(link_mode) {
        auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
        link = std::make_unique<InProcessKvLink>(InProcessKvLinkConfig{link_mode, lease});
        auto make = [&](const std::string& id) {
            Node n;
            double scale = 1.0;
            if (id[0] == 'd' && decode_step > Duration::zero()) {
                std::vector<int> one_seq = {64};
                scale = std::chrono::duration<double>(decode_step).count() /
                        cost.decode_seconds(one_seq);
            }
            n.engine = Engine::create({.engine_id = id,
                                       .num_blocks = 64,
                                       .time_scale = scale,
                                       .kv_wait_timeout = seconds(2)},
                                      cost)
                           .value();
            EXPECT_TRUE(link->add_engine(id, &n.engine->pool()).ok());
            return n;
        };
        for (size_t i = 0; i < np; ++i) prefill.push_back(make("p" + std::to_string(i)));
        for (size_t i = 0; i < nd; ++i) decode.push_back(make("d" + std::to_string(i)));
        EXPECT_TRUE(link->start().ok());
        RouterConfig rc;
        rc.mode = link_mode == kv::TransferMode::kPush ? RouterMode::kPush : RouterMode::kPull;
        rc.request_timeout = seconds(10);
        rc.secret = Secret::generate().value();
        for (auto& n : prefill) {
            n.engine->attach_connector(link->producer(n.engine->config().engine_id), nullptr);
            start(n);
            rc.prefill.push_back({kHost, n.server->port()});
        }
        for (auto& n : decode) {
            n.engine->attach_connector(nullptr, link->consumer(n.engine->config().engine_id));
            start(n);
            rc.decode.push_back({kHost, n.server->port()});
        }
        router = Router::start(rc).value();
    }
    // As `ferry serve prefill|decode` does, the engine states its role and KV mode.
    void start(Node& n) const {
        EXPECT_TRUE(n.engine->start().ok());
        EngineServerOptions so{.http = {.host = kHost}};
        so.role = n.engine->config().engine_id[0] == 'p' ? "prefill" : "decode";
        so.kv_mode = mode == kv::TransferMode::kPush   ? "push"
                     : mode == kv::TransferMode::kPull ? "pull"
                                                       : "pull-inline";
        n.server = EngineServer::start(n.engine.get(), so).value();
    }
    ~Cluster() {
        router->stop();
        for (auto* group : {&prefill, &decode})
            for (auto& n : *group) {
                n.server->stop();
                n.engine->stop();
            }
        link->stop();
    }
    bool pools_full() {
        for (auto* group : {&prefill, &decode})
            for (auto& n : *group)
                if (n.engine->stats().blocks_free != 64) return false;
        return true;
    }
};

struct Streamed {
    int status = 0;
    std::vector<int32_t> tokens;
    json final_event;
    std::string raw;
};

Streamed stream(int port, const json& body) {
    Streamed s;
    SseParser parser;
    Status st = http_post_stream(kHost, port, "/v1/completions", body.dump(), seconds(10),
                                 &s.status, [&](std::string_view data) {
                                     s.raw.append(data);
                                     if (s.status != 200) return true;
                                     for (auto& ev : parser.feed(data)) {
                                         if (ev == "[DONE]") continue;
                                         json j = json::parse(ev);
                                         if (j.contains("error")) continue;
                                         for (auto& t : j["choices"][0]["token_ids"])
                                             s.tokens.push_back(t.get<int32_t>());
                                         if (j.contains("ferry_timing")) s.final_event = j;
                                     }
                                     return true;
                                 });
    EXPECT_TRUE(st.ok()) << st.to_string();
    return s;
}

std::vector<int32_t> prompt_of(size_t n, int seed) {
    std::vector<int32_t> p(n);
    for (size_t i = 0; i < n; ++i) p[i] = int32_t((i * 31 + seed * 7) % 1000);
    return p;
}

TEST(Router, StreamedRequestReturnsVerifiedTokensInPushPullAndPullInline) {
    for (kv::TransferMode mode :
         {kv::TransferMode::kPush, kv::TransferMode::kPull, kv::TransferMode::kPullInline}) {
        Cluster c(1, 1, mode);
        auto prompt = prompt_of(70, 1);
        Streamed s =
            stream(c.router->port(), {{"prompt", prompt}, {"max_tokens", 7}, {"stream", true}});
        ASSERT_EQ(s.status, 200) << s.raw;
        EXPECT_EQ(s.tokens, expected_tokens(c.decode[0].engine->kv_slice(), prompt, 7));
        json t = s.final_event["ferry_timing"];
        for (const char* k : {"router_overhead_ms", "prefill_compute_ms", "decode_kv_wait_ms",
                              "decode_first_token_ms"})
            EXPECT_TRUE(t.contains(k)) << k << " " << t.dump();
        EXPECT_TRUE(eventually([&] { return c.pools_full(); }));
        EXPECT_EQ(c.decode[0].engine->stats().kv_transfers, 1u);
    }
}

// The router waits for the decode leg's next bytes in slices of 200 ms; a slice that ended
// without bytes used to feed the last relayed bytes to its parser again, so a stream with a pause
// longer than that got a token twice (one more token than max_tokens).
TEST(Router, StreamWithPausesLongerThanTheRoutersWaitSliceKeepsEveryTokenOnce) {
    for (kv::TransferMode mode :
         {kv::TransferMode::kPush, kv::TransferMode::kPull, kv::TransferMode::kPullInline}) {
        Cluster c(1, 1, mode, seconds(5), milliseconds(300));
        auto prompt = prompt_of(50, 4);
        Streamed s =
            stream(c.router->port(), {{"prompt", prompt}, {"max_tokens", 3}, {"stream", true}});
        ASSERT_EQ(s.status, 200) << s.raw;
        EXPECT_EQ(s.tokens, expected_tokens(c.decode[0].engine->kv_slice(), prompt, 3))
            << "mode " << int(mode) << ": " << s.raw;
        EXPECT_EQ(s.final_event["usage"]["completion_tokens"], 3) << s.raw;
    }
}

TEST(Router, NonStreamedRequestInPush) {
    Cluster c(1, 1, kv::TransferMode::kPush);
    auto prompt = prompt_of(40, 2);
    auto r = http_post_json(kHost, c.router->port(), "/v1/completions",
                            json{{"prompt", prompt}, {"max_tokens", 5}}.dump(), seconds(10));
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->status, 200) << r->body;
    json j = json::parse(r->body);
    std::vector<int32_t> ids = j["choices"][0]["token_ids"];
    EXPECT_EQ(ids, expected_tokens(c.decode[0].engine->kv_slice(), prompt, 5));
}

TEST(Router, RelaysTheClientsFieldsAndReplacesItsTransferParameters) {
    Cluster c(1, 1, kv::TransferMode::kPush);
    // A text prompt, fields the router does not know, and transfer parameters of the client's
    // own that would send the legs astray if they reached an engine.
    std::string text = "a \"quoted\" [prompt] {with} brackets";
    json body = {{"prompt", text},
                 {"max_tokens", 4},
                 {"stream", true},
                 {"temperature", 0},
                 {"ignore_eos", true},
                 {"kv_transfer_params",
                  {{"do_remote_decode", true},
                   {"remote_block_ids", {1, 2, 3}},
                   {"transfer_id", "client-chosen"}}}};
    Streamed s = stream(c.router->port(), body);
    ASSERT_EQ(s.status, 200) << s.raw;
    EXPECT_EQ(s.tokens, expected_tokens(c.decode[0].engine->kv_slice(), tokenize(text), 4));
    EXPECT_TRUE(s.final_event["ferry_timing"].contains("router_overhead_ms"));
    EXPECT_TRUE(eventually([&] { return c.pools_full(); }));
}

TEST(Router, TwoPrefillTwoDecodeRoundRobin) {
    Cluster c(2, 2, kv::TransferMode::kPush);
    for (int i = 0; i < 4; ++i) {
        auto prompt = prompt_of(30, i);
        Streamed s =
            stream(c.router->port(), {{"prompt", prompt}, {"max_tokens", 3}, {"stream", true}});
        ASSERT_EQ(s.status, 200);
        EXPECT_EQ(s.tokens, expected_tokens(c.decode[0].engine->kv_slice(), prompt, 3));
    }
    for (auto* group : {&c.prefill, &c.decode})
        for (auto& n : *group) EXPECT_EQ(n.engine->stats().requests_total, 2u);
    EXPECT_TRUE(eventually([&] { return c.pools_full(); }));
}

// An engine known down is skipped while another of its role is ready: every request is served.
TEST(Router, SkipsAnEngineKnownDownWhileAnotherIsReady) {
    Cluster c(1, 2, kv::TransferMode::kPush);
    c.decode[1].server->stop();
    std::string body;
    ASSERT_TRUE(eventually([&] {
        auto r = http_get(kHost, c.router->port(), "/health", seconds(2));
        body = r.ok() ? r->body : "";
        return r.ok() && r->status == 200 && body.find("\"ready\":false") != std::string::npos;
    })) << body;
    for (int i = 0; i < 4; ++i) {
        Streamed s = stream(c.router->port(),
                            {{"prompt", prompt_of(30, i)}, {"max_tokens", 3}, {"stream", true}});
        EXPECT_EQ(s.status, 200) << s.raw;
    }
    EXPECT_EQ(c.decode[0].engine->stats().requests_total, 4u);
    EXPECT_EQ(metric(c.router->port(), "ferry_router_failures_total"), 0);
}

TEST(Router, InvalidBodyGets400) {
    Cluster c(1, 1, kv::TransferMode::kPush);
    auto r =
        http_post_json(kHost, c.router->port(), "/v1/completions", R"({"prompt": 3})", seconds(5));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->status, 400);
    // The router's own errors have the engines' shape: message, type and code.
    json j = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r->body;
    EXPECT_NE(j["error"].value("message", "").find("'prompt'"), std::string::npos) << r->body;
    EXPECT_EQ(j["error"].value("type", ""), "invalid argument") << r->body;
    EXPECT_EQ(j["error"].value("code", 0), 400) << r->body;
    EXPECT_EQ(c.prefill[0].engine->stats().requests_total, 0u);
}

int health_status(int port, std::string* body = nullptr) {
    auto r = http_get(kHost, port, "/health", seconds(2));
    if (!r.ok()) return 0;
    if (body) *body = r->body;
    return r->status;
}

TEST(Router, DecodeEngineKnownDownGives503BeforeAnyLegLeaves) {
    Cluster c(1, 1, kv::TransferMode::kPush, milliseconds(300));
    c.decode[0].server->stop();
    ASSERT_TRUE(eventually([&] { return health_status(c.router->port()) == 503; }));
    Streamed s = stream(c.router->port(),
                        {{"prompt", prompt_of(30, 1)}, {"max_tokens", 3}, {"stream", true}});
    EXPECT_EQ(s.status, 503);
    EXPECT_NE(s.raw.find(fmt::format("decode engine 127.0.0.1:{} is not ready",
                                     c.decode[0].server->port())),
              std::string::npos)
        << s.raw;
    EXPECT_EQ(c.prefill[0].engine->stats().requests_total, 0u);
    EXPECT_EQ(metric(c.router->port(), "ferry_router_failures_total"), 1);
}

// Engines in pull behind a router in push (issue 30: every request hung for the 30 s lease,
// then 504; the other way round every request got a 400 blaming the client): the router is not
// ready, its /health names both flags, and a request fails at once with 503 saying why, before
// any leg leaves.
TEST(Router, EnginesOfAnotherTransferModeLeaveItNotReadyAndRequestsFailAtOnce) {
    for (auto [engines, router_mode] : {std::pair{kv::TransferMode::kPull, RouterMode::kPush},
                                        std::pair{kv::TransferMode::kPush, RouterMode::kPull}}) {
        const bool push_router = router_mode == RouterMode::kPush;
        SCOPED_TRACE(push_router ? "pull engines, push router" : "push engines, pull router");
        Cluster c(1, 1, engines);
        RouterConfig rc;
        rc.http.setting_names = router_flags();
        rc.mode = router_mode;
        rc.secret = Secret::generate().value();
        rc.request_timeout = seconds(10);
        rc.prefill = {{kHost, c.prefill[0].server->port()}};
        rc.decode = {{kHost, c.decode[0].server->port()}};
        auto router = Router::start(rc).value();
        const std::string named = push_router ? "--kv-mode pull, this router --mode push"
                                              : "--kv-mode push, this router --mode pull";
        std::string body;
        EXPECT_TRUE(eventually([&] {
            return health_status(router->port(), &body) == 503 &&
                   body.find(named) != std::string::npos;
        })) << body;
        EXPECT_NE(body.find("no prefill engine is ready"), std::string::npos) << body;
        EXPECT_NE(body.find("no decode engine is ready"), std::string::npos) << body;
        TimePoint t0 = Clock::now();
        Streamed s = stream(router->port(),
                            {{"prompt", prompt_of(30, 1)}, {"max_tokens", 3}, {"stream", true}});
        double ms = to_ms(Clock::now() - t0);
        EXPECT_EQ(s.status, 503) << s.raw;
        EXPECT_NE(s.raw.find(named), std::string::npos) << s.raw;
        EXPECT_LT(ms, 2000.0);  // the lease is 5 s, the router's request timeout 10 s
        EXPECT_EQ(c.prefill[0].engine->stats().requests_total, 0u);
        EXPECT_EQ(c.decode[0].engine->stats().requests_total, 0u);
        // The matching router next to it serves.
        Streamed ok = stream(c.router->port(),
                             {{"prompt", prompt_of(30, 1)}, {"max_tokens", 3}, {"stream", true}});
        EXPECT_EQ(ok.status, 200) << ok.raw;
        router->stop();
    }
}

// A prefill engine given as decode and the reverse: not ready, the reason says where it belongs.
TEST(Router, AnEngineGivenForTheOtherRoleIsNotReadyAndSaysWhereItBelongs) {
    Cluster c(1, 1, kv::TransferMode::kPush);
    RouterConfig rc;
    rc.http.setting_names = router_flags();
    rc.secret = Secret::generate().value();
    rc.prefill = {{kHost, c.decode[0].server->port()}};
    rc.decode = {{kHost, c.prefill[0].server->port()}};
    auto router = Router::start(rc).value();
    std::string body;
    EXPECT_TRUE(eventually([&] {
        return health_status(router->port(), &body) == 503 &&
               body.find("a decode engine given as a prefill engine: move it to --decode") !=
                   std::string::npos &&
               body.find("a prefill engine given as a decode engine: move it to --prefill") !=
                   std::string::npos;
    })) << body;
    router->stop();
}

// The library's router, given no names for its settings, names them as RouterConfig's fields
// (the engines' KV mode by their /health's kv_mode): no flag of a command it does not know.
TEST(Router, WithoutSettingNamesItsReasonsNameItsOwnSettings) {
    Cluster c(1, 1, kv::TransferMode::kPull);
    RouterConfig swapped;
    swapped.secret = Secret::generate().value();
    swapped.mode = RouterMode::kPull;
    swapped.prefill = {{kHost, c.decode[0].server->port()}};
    swapped.decode = {{kHost, c.prefill[0].server->port()}};
    RouterConfig push = swapped;
    push.mode = RouterMode::kPush;
    push.prefill = swapped.decode;
    push.decode = swapped.prefill;
    for (auto& [rc, words] :
         {std::pair{swapped, std::vector<std::string>{"move it to RouterConfig::decode",
                                                      "move it to RouterConfig::prefill"}},
          std::pair{push,
                    std::vector<std::string>{
                        "the engine runs kv_mode pull, this router RouterConfig::mode push"}}}) {
        SCOPED_TRACE(words[0]);
        auto router = Router::start(rc).value();
        std::string body;
        EXPECT_TRUE(eventually([&] {
            if (health_status(router->port(), &body) != 503) return false;
            for (const std::string& w : words)
                if (body.find(w) == std::string::npos) return false;
            return true;
        })) << body;
        EXPECT_EQ(body.find("--"), std::string::npos) << body;
        router->stop();
    }
}

// Routers in a loop (issue 30: a router given itself, or two routers given each other, nested
// each other's reasons into /health bodies of 59 MB and 430 MB of memory in 30 s): each says
// its engine is a router, /health stays small, and a request fails at once without a leg.
TEST(Router, RoutersGivenAsEnginesAreNamedAndTheirHealthStaysSmall) {
    int self_port = testing::free_port(), a_port = testing::free_port(),
        b_port = testing::free_port();
    auto config = [](int port, int engines) {
        RouterConfig rc;
        rc.http = {.host = kHost, .port = port};
        rc.secret = Secret::generate().value();
        rc.request_timeout = seconds(5);
        rc.probe_period = milliseconds(20);  // 25 probes a half-second
        rc.prefill = {{kHost, engines}};
        rc.decode = {{kHost, engines}};
        return rc;
    };
    auto self = Router::start(config(self_port, self_port)).value();
    auto a = Router::start(config(a_port, b_port)).value();
    auto b = Router::start(config(b_port, a_port)).value();
    struct Case {
        int port;
        std::string named;
    };
    for (const Case& k : {Case{self_port, "this is the router itself, not a prefill engine"},
                          Case{a_port, "this is another router, not a decode engine"},
                          Case{b_port, "this is another router, not a prefill engine"}}) {
        std::string body;
        EXPECT_TRUE(eventually([&] {
            return health_status(k.port, &body) == 503 && body.find(k.named) != std::string::npos;
        })) << body;
    }
    size_t largest = 0;
    TimePoint end = Clock::now() + seconds(1);
    while (Clock::now() < end) {
        for (int port : {self_port, a_port, b_port}) {
            std::string body;
            health_status(port, &body);
            largest = std::max(largest, body.size());
        }
        std::this_thread::sleep_for(milliseconds(20));
    }
    std::printf("largest router /health body in a loop: %zu bytes\n", largest);
    EXPECT_LT(largest, 2048u);
    auto r = http_post_json(kHost, a_port, "/v1/completions",
                            R"({"prompt": "hi", "max_tokens": 2})", seconds(5));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->status, 503) << r->body;
    EXPECT_NE(r->body.find("another router"), std::string::npos) << r->body;
    for (Router* r : {self.get(), a.get(), b.get()}) r->stop();
}

// An engine's words the router relays (a /health reason, a leg's error) are cut with a marker.
TEST(Router, AnUpstreamsLongReasonIsCutWithAMarker) {
    const std::string huge(1 << 20, 'r');
    std::vector<HttpRoute> routes;
    routes.push_back({"GET", "/health", [&huge](const HttpRequest&, HttpReply& r) {
                          r.status = 503;
                          r.body = json({{"status", "starting"}, {"reason", huge}}).dump();
                      }});
    auto engine = HttpServer::start({.host = kHost}, std::move(routes)).value();
    RouterConfig rc;
    rc.secret = Secret::generate().value();
    rc.prefill = {{kHost, engine->port()}};
    rc.decode = {{kHost, engine->port()}};
    auto router = Router::start(rc).value();
    std::string body;
    EXPECT_TRUE(eventually([&] {
        return health_status(router->port(), &body) == 503 &&
               body.find("more bytes cut") != std::string::npos;
    })) << body.substr(0, 300);
    EXPECT_LT(body.size(), 8192u);
    router->stop();
    engine->stop();
}

// Decode refuses its leg after prefill computed (push: waiting for decode's registration;
// pull: offered under the lease): the router aborts the prefill leg, whose blocks come back
// well before the 5 s lease.
TEST(Router, DecodeLegRefusedAbortsThePrefillLegAtOnce) {
    for (kv::TransferMode mode : {kv::TransferMode::kPush, kv::TransferMode::kPull}) {
        SCOPED_TRACE(mode == kv::TransferMode::kPush ? "push" : "pull");
        Cluster c(1, 1, mode, seconds(5));
        c.decode[0].engine->stop();  // its server answers 503 "engine is not running"
        Streamed s = stream(c.router->port(),
                            {{"prompt", prompt_of(30, 1)}, {"max_tokens", 3}, {"stream", true}});
        EXPECT_EQ(s.status, 503) << s.raw;
        EXPECT_NE(s.raw.find("decode leg"), std::string::npos) << s.raw;
        EXPECT_TRUE(eventually([&] { return c.prefill[0].engine->stats().blocks_free == 64; },
                               milliseconds(1500)));
        EXPECT_TRUE(eventually(
            [&] { return metric(c.router->port(), "ferry_router_aborts_sent_total") >= 1; }));
    }
}

// What decode would refuse (max_model_len, the vocabulary, the pool) is refused before either
// leg leaves: prefill computes nothing and pins no block.
TEST(Router, RequestBeyondTheEnginesLimitsIsRefusedBeforeAnyLeg) {
    Cluster c(1, 1, kv::TransferMode::kPush);
    struct Case {
        json body;
        std::vector<std::string> names;
    };
    std::vector<Case> cases = {
        {{{"prompt", prompt_of(30, 1)}, {"max_tokens", 40000}}, {"max_tokens", "max_model_len"}},
        {{{"prompt", json::array({1, 2, 999999})}, {"max_tokens", 3}}, {"prompt", "vocabulary"}},
        {{{"prompt", prompt_of(30, 1)}, {"max_tokens", 64 * 16}}, {"max_tokens", "KV blocks"}},
        {{{"prompt", prompt_of(64 * 16 + 1, 1)}, {"max_tokens", 1}}, {"prompt", "KV blocks"}},
    };
    for (const Case& k : cases) {
        auto r =
            http_post_json(kHost, c.router->port(), "/v1/completions", k.body.dump(), seconds(5));
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->status, 400) << r->body;
        for (const auto& n : k.names) EXPECT_NE(r->body.find(n), std::string::npos) << r->body;
    }
    EXPECT_EQ(c.prefill[0].engine->stats().requests_total, 0u);
    EXPECT_EQ(c.decode[0].engine->stats().requests_total, 0u);
    EXPECT_EQ(c.prefill[0].engine->stats().blocks_free, 64u);
    EXPECT_EQ(metric(c.router->port(), "ferry_router_rejected_before_legs_total"), 4);
}

// /health is a readiness probe: 503 naming the engines not reachable, 200 once a prefill and
// a decode engine are up, 503 again when the decode goes.
TEST(Router, HealthSaysWhetherItCanServeAndNamesWhatIsMissing) {
    int pport = testing::free_port(), dport = testing::free_port();
    RouterConfig rc;
    rc.prefill = {{kHost, pport}};
    rc.decode = {{kHost, dport}};
    rc.secret = Secret::generate().value();  // a router refuses to start without one
    auto started = Router::start(rc);
    ASSERT_TRUE(started.ok()) << started.status().to_string();
    auto router = std::move(started).value();
    std::string body;
    EXPECT_EQ(health_status(router->port(), &body), 503);
    EXPECT_NE(body.find("no prefill engine is ready"), std::string::npos) << body;
    EXPECT_NE(body.find("no decode engine is ready"), std::string::npos) << body;
    EXPECT_NE(body.find(fmt::format("127.0.0.1:{}", dport)), std::string::npos) << body;

    auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
    std::vector<Node> nodes(2);
    for (int i = 0; i < 2; ++i) {
        nodes[i].engine =
            Engine::create({.engine_id = i ? "d" : "p", .num_blocks = 64}, cost).value();
        ASSERT_TRUE(nodes[i].engine->start().ok());
    }
    nodes[0].server =
        EngineServer::start(nodes[0].engine.get(), {.http = {.host = kHost, .port = pport}})
            .value();
    EXPECT_TRUE(eventually([&] {
        return health_status(router->port(), &body) == 503 &&
               body.find("no prefill engine") == std::string::npos;
    })) << body;
    EXPECT_NE(body.find("no decode engine is ready"), std::string::npos) << body;
    nodes[1].server =
        EngineServer::start(nodes[1].engine.get(), {.http = {.host = kHost, .port = dport}})
            .value();
    EXPECT_TRUE(eventually([&] { return health_status(router->port(), &body) == 200; })) << body;
    EXPECT_NE(body.find("\"status\":\"ok\""), std::string::npos) << body;
    nodes[1].server->stop();
    EXPECT_TRUE(eventually([&] { return health_status(router->port(), &body) == 503; })) << body;
    EXPECT_NE(body.find(fmt::format("no decode engine is ready: 127.0.0.1:{}", dport)),
              std::string::npos)
        << body;
    router->stop();
    for (auto& n : nodes) {
        n.server->stop();
        n.engine->stop();
    }
}

// An engine's /health is 503 with the reason until its KV side is ready.
TEST(EngineServer, HealthIs503UntilReady) {
    auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
    auto engine = Engine::create({.engine_id = "e", .num_blocks = 64}, cost).value();
    ASSERT_TRUE(engine->start().ok());
    std::atomic<bool> ready{false};
    EngineServerOptions so{.http = {.host = kHost}};
    so.ready = [&]() -> Status {
        return ready ? ok_status() : unavailable("the KV side channel is not up yet");
    };
    auto server = EngineServer::start(engine.get(), so).value();
    std::string body;
    EXPECT_EQ(health_status(server->port(), &body), 503);
    EXPECT_NE(body.find("the KV side channel is not up yet"), std::string::npos) << body;
    ready = true;
    EXPECT_EQ(health_status(server->port(), &body), 200);
    json j = json::parse(body);
    EXPECT_EQ(j["max_model_len"], 32768);
    EXPECT_EQ(j["kv_blocks_total"], 64);
    server->stop();
    engine->stop();
}

TEST(Router, PrefillLegRejectedGivesTheClientItsErrorAndDecodeFreesItsBlocks) {
    Cluster c(1, 1, kv::TransferMode::kPush);
    c.prefill[0].engine->stop();  // prefill answers 503 "engine is not running"
    Streamed s = stream(c.router->port(),
                        {{"prompt", prompt_of(30, 1)}, {"max_tokens", 3}, {"stream", true}});
    EXPECT_EQ(s.status, 503) << s.raw;
    EXPECT_NE(s.raw.find("prefill leg"), std::string::npos) << s.raw;
    // Freed through /ferry/abort, well before the decode leg's 2 s KV wait would end.
    EXPECT_TRUE(eventually([&] { return c.decode[0].engine->stats().blocks_free == 64; },
                           milliseconds(1000)));
    EXPECT_EQ(c.decode[0].engine->stats().requests_failed, 1u);
}

// An engine of another make (or a proxy in front of one) that passes the probe may answer an
// error whose message is not a string, or a body that is not JSON: the router relays the leg's
// status and says which leg failed, never a 500 naming a JSON exception of its own.
TEST(Router, AnEngineErrorOfAnotherShapeIsRelayedNotThrown) {
    for (const std::string body :
         {R"({"error": {"message": 5}})", R"({"error": {"message": null}})", R"({"error": 7})",
          R"(not json)", R"({"error": {"message": ["a", "b"]}})"}) {
        SCOPED_TRACE(body);
        std::vector<HttpRoute> routes;
        routes.push_back({"GET", "/health", [](const HttpRequest&, HttpReply& r) {
                              r.body = R"({"status": "ok", "engine_id": "other-make"})";
                          }});
        routes.push_back({"POST", "/v1/completions", [body](const HttpRequest&, HttpReply& r) {
                              r.status = 400;
                              r.body = body;
                          }});
        routes.push_back(
            {"POST", "/ferry/abort", [](const HttpRequest&, HttpReply& r) { r.body = "{}"; }});
        auto engine = HttpServer::start({.host = kHost}, std::move(routes)).value();
        RouterConfig rc;
        rc.request_timeout = seconds(5);
        rc.secret = Secret::generate().value();
        rc.prefill = {{kHost, engine->port()}};
        rc.decode = {{kHost, engine->port()}};
        auto router = Router::start(rc).value();
        ASSERT_TRUE(testing::wait_healthy(kHost, router->port()));
        for (bool streamed : {false, true}) {
            auto r = http_post_json(
                kHost, router->port(), "/v1/completions",
                json({{"prompt", "hello"}, {"max_tokens", 2}, {"stream", streamed}}).dump(),
                seconds(5));
            ASSERT_TRUE(r.ok()) << r.status().to_string();
            EXPECT_EQ(r->status, 400) << r->body;
            EXPECT_NE(r->body.find("leg on 127.0.0.1:" + std::to_string(engine->port()) +
                                   " failed (HTTP 400)"),
                      std::string::npos)
                << r->body;
            EXPECT_EQ(r->body.find("exception"), std::string::npos) << r->body;
        }
        router->stop();
        engine->stop();
    }
}

// A router whose only prefill and decode engine is the fake HTTP server on `port`, which takes
// aborts.
RouterConfig one_fake_engine(std::vector<HttpRoute>* routes, std::unique_ptr<HttpServer>* engine) {
    routes->push_back(
        {"POST", "/ferry/abort", [](const HttpRequest&, HttpReply& r) { r.body = "{}"; }});
    *engine = HttpServer::start({.host = kHost}, std::move(*routes)).value();
    RouterConfig rc;
    rc.secret = Secret::generate().value();
    rc.prefill = {{kHost, (*engine)->port()}};
    rc.decode = {{kHost, (*engine)->port()}};
    return rc;
}

// Issue 30: an engine restarted within one probe period refuses the router's legs as signed for
// its previous incarnation. That request fails at once, naming it, and the router reads the
// engines' /health again then rather than at its next probe, so the next request is signed for
// the new incarnation. (A fake engine that checks only the incarnation; probes a minute apart.)
TEST(Router, ALegRefusedForAnotherIncarnationMakesTheRouterReadTheEngineAgain) {
    std::mutex mu;
    std::string current = "incarnation-1";
    std::vector<std::string> signed_for;  // each leg's ferry_incarnation
    std::vector<HttpRoute> routes;
    routes.push_back(
        {"GET", "/health", [&](const HttpRequest&, HttpReply& r) {
             std::lock_guard lk(mu);
             r.body = json({{"status", "ok"}, {"engine_id", "e"}, {"incarnation", current}}).dump();
         }});
    routes.push_back({"POST", "/v1/completions", [&](const HttpRequest& req, HttpReply& r) {
                          json kv = json::parse(req.body)["kv_transfer_params"];
                          std::string theirs = kv.value("ferry_incarnation", "");
                          std::lock_guard lk(mu);
                          signed_for.push_back(theirs);
                          Status st = theirs == current
                                          ? invalid_argument("taken (a fake engine)")
                                          : permission_denied(fmt::format(
                                                "kv_transfer_params were {}", kOtherIncarnation));
                          r.status = http_status_for(st);
                          r.body = error_body(st);
                      }});
    std::unique_ptr<HttpServer> engine;
    RouterConfig rc = one_fake_engine(&routes, &engine);
    rc.request_timeout = seconds(5);
    rc.probe_period = seconds(60);
    auto router = Router::start(rc).value();
    ASSERT_TRUE(testing::wait_healthy(kHost, router->port()));
    {
        std::lock_guard lk(mu);
        current = "incarnation-2";  // restarted since the router's probe
    }
    auto send = [&] {
        auto r = http_post_json(kHost, router->port(), "/v1/completions",
                                json({{"prompt", "hello"}, {"max_tokens", 2}}).dump(), seconds(5));
        EXPECT_TRUE(r.ok()) << r.status().to_string();
        return r.ok() ? *r : HttpResponse{};
    };
    TimePoint t0 = Clock::now();
    HttpResponse first = send();
    EXPECT_LT(to_ms(Clock::now() - t0), 3000);
    EXPECT_EQ(first.status, 403) << first.body;
    EXPECT_NE(first.body.find(kOtherIncarnation), std::string::npos) << first.body;
    {
        std::lock_guard lk(mu);
        signed_for.clear();
    }
    HttpResponse second = send();
    EXPECT_EQ(second.status, 400) << second.body;  // the fake's answer to a leg it takes
    EXPECT_NE(second.body.find("taken (a fake engine)"), std::string::npos) << second.body;
    {
        std::lock_guard lk(mu);
        ASSERT_FALSE(signed_for.empty());
        for (const std::string& inc : signed_for) EXPECT_EQ(inc, "incarnation-2");
    }
    auto h = http_get(kHost, router->port(), "/health", seconds(2));
    ASSERT_TRUE(h.ok());
    EXPECT_NE(h->body.find("incarnation-2"), std::string::npos) << h->body;
    router->stop();
    engine->stop();
}

// Issue 30: an engine that answers /health but never its legs (a wedged worker) was never
// declared down: each request waited for the request timeout. With --leg-answer-timeout a leg
// without a first byte by then fails with 504 naming the engine, and two in a row take the
// engine out: later requests get 503 at once instead of another wait.
TEST(Router, AnEngineThatAnswersHealthButNotItsLegsIsGivenUpAndDeclaredDown) {
    std::mutex mu;
    std::condition_variable cv;
    bool release = false;
    std::vector<HttpRoute> routes;
    routes.push_back({"GET", "/health",
                      [](const HttpRequest&, HttpReply& r) {
                          r.body = R"({"status": "ok", "engine_id": "wedged"})";
                      },
                      true});
    routes.push_back({"POST", "/v1/completions", [&](const HttpRequest&, HttpReply& r) {
                          std::unique_lock lk(mu);
                          cv.wait_for(lk, seconds(20), [&] { return release; });
                          r.status = 503;
                          r.body = error_body(unavailable("released"));
                      }});
    std::unique_ptr<HttpServer> engine;
    RouterConfig rc = one_fake_engine(&routes, &engine);
    rc.request_timeout = seconds(15);
    rc.leg_answer_timeout = milliseconds(300);
    rc.legs_down_period = seconds(60);
    auto router = Router::start(rc).value();
    ASSERT_TRUE(testing::wait_healthy(kHost, router->port()));
    auto send = [&](double* ms) {
        TimePoint t0 = Clock::now();
        auto r = http_post_json(kHost, router->port(), "/v1/completions",
                                json({{"prompt", "hello"}, {"max_tokens", 2}}).dump(), seconds(20));
        *ms = to_ms(Clock::now() - t0);
        EXPECT_TRUE(r.ok()) << r.status().to_string();
        return r.ok() ? *r : HttpResponse{};
    };
    const std::string name = fmt::format("127.0.0.1:{}", engine->port());
    double ms[3] = {};
    for (int i = 0; i < 2; ++i) {
        HttpResponse r = send(&ms[i]);
        EXPECT_EQ(r.status, 504) << r.body;
        EXPECT_NE(r.body.find("did not answer its leg within"), std::string::npos) << r.body;
        EXPECT_NE(r.body.find("(leg_answer_timeout)"), std::string::npos) << r.body;
        EXPECT_NE(r.body.find(name), std::string::npos) << r.body;
        EXPECT_LT(ms[i], 5000) << "held past the leg answer timeout";
    }
    HttpResponse third = send(&ms[2]);
    fmt::print("WEDGED_ENGINE answered_after_ms={:.0f},{:.0f},{:.0f} third HTTP {}\n", ms[0], ms[1],
               ms[2], third.status);
    EXPECT_EQ(third.status, 503) << third.body;
    EXPECT_NE(third.body.find("legs in a row"), std::string::npos) << third.body;
    EXPECT_LT(ms[2], 2000);
    auto h = http_get(kHost, router->port(), "/health", seconds(2));
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->status, 503) << h->body;
    {
        std::lock_guard lk(mu);
        release = true;
    }
    cv.notify_all();
    router->stop();
    engine->stop();
}

// A /health of another shape while not ready ({"reason": 5}): value() threw in the prober
// thread, which ended the router process (std::terminate).
TEST(Router, AnEngineHealthOfAnotherShapeIsNotReadyNotACrash) {
    std::vector<HttpRoute> routes;
    routes.push_back({"GET", "/health", [](const HttpRequest&, HttpReply& r) {
                          r.status = 503;
                          r.body = R"({"status": "starting", "engine_id": "x", "reason": 5})";
                      }});
    auto engine = HttpServer::start({.host = kHost}, std::move(routes)).value();
    RouterConfig rc;
    rc.secret = Secret::generate().value();
    rc.probe_period = milliseconds(20);
    rc.prefill = {{kHost, engine->port()}};
    rc.decode = {{kHost, engine->port()}};
    auto router = Router::start(rc).value();
    const std::string why = "/health answered HTTP 503: not ready";
    EXPECT_TRUE(eventually([&] {
        auto h = http_get(kHost, router->port(), "/health", seconds(2));
        return h.ok() && h->status == 503 && h->body.find(why) != std::string::npos;
    }));
    std::this_thread::sleep_for(milliseconds(100));  // a few more probes
    router->stop();
    engine->stop();
}

TEST(Router, ParsesEngineAddressLists) {
    auto a = parse_engine_addresses("127.0.0.1:8100,localhost:8101");
    ASSERT_TRUE(a.ok());
    ASSERT_EQ(a->size(), 2u);
    EXPECT_EQ((*a)[1].host, "localhost");
    EXPECT_EQ((*a)[1].port, 8101);
    EXPECT_FALSE(parse_engine_addresses("nohost").ok());
    EXPECT_FALSE(parse_engine_addresses("h:99999").ok());
    // Digits and dots are an IPv4 address or an error now, not a name for DNS; names that may
    // resolve only later (their engine not up yet) are kept.
    auto bad = parse_engine_addresses("127.0.0.1:8100,999.1.1.1:8101");
    ASSERT_FALSE(bad.ok());
    EXPECT_EQ(bad.status().message(), "'999.1.1.1:8101': 999.1.1.1 is not an IPv4 address");
    EXPECT_FALSE(parse_engine_addresses("10.0.0:8100").ok());
    EXPECT_TRUE(parse_engine_addresses("10.0.0.7:8100,engine-3.cluster.local:8100").ok());
}

}  // namespace
}  // namespace ferry::serve

namespace ferry::serve {
namespace {

// A fake vLLM OpenAI server with FerryConnector: /health 200 with an empty body, the
// connector's info gauge on /metrics, and completions that record their bodies.
struct FakeVllm {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::pair<std::string, json>> legs;  // (path, body)
    // /metrics answers only after this (a starved API server renders it late).
    std::atomic<int> metrics_delay_ms{0};
    std::unique_ptr<HttpServer> server;

    // `info`: the /metrics line's labels (empty: no connector). `answer(body)`: the reply.
    FakeVllm(const std::string& info, std::function<std::string(FakeVllm&, const json&)> answer) {
        std::vector<HttpRoute> routes;
        routes.push_back({"GET", "/health", [](const HttpRequest&, HttpReply& r) {
                              r.content_type = "text/plain";
                              r.body = "";
                          }});
        routes.push_back({"GET", "/metrics", [this, info](const HttpRequest&, HttpReply& r) {
                              std::this_thread::sleep_for(milliseconds(metrics_delay_ms.load()));
                              r.content_type = "text/plain";
                              r.body =
                                  "# HELP vllm:num_requests_running x\n"
                                  "vllm:num_requests_running{engine=\"0\"} 0.0\n";
                              if (!info.empty())
                                  r.body +=
                                      "vllm:ferry_connector_info{model_name=\"tiny\","
                                      "engine=\"0\"," +
                                      info + "} 1.0\n";
                          }});
        for (const char* path : {"/v1/completions", "/v1/chat/completions"})
            routes.push_back(
                {"POST", path, [this, answer, path](const HttpRequest& req, HttpReply& r) {
                     json body = json::parse(req.body);
                     {
                         std::lock_guard lock(mu);
                         legs.emplace_back(path, body);
                     }
                     cv.notify_all();
                     r.body = answer(*this, body);
                 }});
        server = HttpServer::start({.host = kHost}, std::move(routes)).value();
    }
    // Waits (bounded) until `n` legs arrived.
    bool wait_legs(size_t n, Duration budget = seconds(5)) {
        std::unique_lock lock(mu);
        return cv.wait_for(lock, budget, [&] { return legs.size() >= n; });
    }
};

RouterConfig vllm_router(RouterMode mode, const FakeVllm& p, const FakeVllm& d) {
    RouterConfig rc;
    rc.http.setting_names = router_flags();
    rc.engines = EngineKind::kVllm;
    rc.mode = mode;
    rc.request_timeout = seconds(10);
    rc.probe_period = milliseconds(50);
    rc.prefill = {{kHost, p.server->port()}};
    rc.decode = {{kHost, d.server->port()}};
    return rc;
}

// Push: both legs leave at once, with FerryConnector's kv_transfer_params: the fake prefill
// answers only once the decode leg has arrived (within 5 s), as vLLM's example proxies, which
// send the decode leg after prefill's answer, never would. The decode leg names prefill's side
// channel as its /metrics states it; the chat route takes the same legs.
TEST(RouterVllm, PushSendsBothLegsAtOnceWithTheConnectorsParameters) {
    FakeVllm decode("mode=\"pull\",host=\"127.0.0.1\",port=\"7001\",tp_size=\"1\"",
                    [](FakeVllm&, const json&) {
                        return json({{"choices", {{{"text", "decoded"}}}}}).dump();
                    });
    std::atomic<int> apart{0};  // prefill legs answered without their decode leg
    FakeVllm prefill("mode=\"push\",host=\"0.0.0.0\",port=\"7777\",tp_size=\"2\"",
                     [&decode, &apart](FakeVllm& self, const json&) {
                         size_t n;
                         {
                             std::lock_guard lock(self.mu);
                             n = self.legs.size();
                         }
                         if (!decode.wait_legs(n)) apart++;
                         return json({{"choices", {{{"text", "p"}}}}}).dump();
                     });
    auto router = Router::start(vllm_router(RouterMode::kPush, prefill, decode)).value();
    ASSERT_TRUE(testing::wait_healthy(kHost, router->port()));
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
        SCOPED_TRACE(path);
        json req = {{"model", "tiny"}, {"max_tokens", 5}};
        if (std::string(path) == "/v1/completions") {
            req["prompt"] = "hello";
        } else {
            req["messages"] = {{{"role", "user"}, {"content", "hello"}}};
            req["max_completion_tokens"] = 5;
        }
        req["kv_transfer_params"] = {{"do_remote_decode", true}};  // the client's: replaced
        auto r = http_post_json(kHost, router->port(), path, req.dump(), seconds(10));
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        EXPECT_EQ(r->status, 200) << r->body;
        EXPECT_NE(r->body.find("decoded"), std::string::npos) << r->body;
        std::lock_guard lp(prefill.mu), ld(decode.mu);
        ASSERT_FALSE(prefill.legs.empty());
        ASSERT_FALSE(decode.legs.empty());
        const auto& [ppath, p] = prefill.legs.back();
        const auto& [dpath, d] = decode.legs.back();
        EXPECT_EQ(ppath, path);
        EXPECT_EQ(dpath, path);
        EXPECT_EQ(p["max_tokens"], 1);
        EXPECT_EQ(p["stream"], false);
        if (p.contains("max_completion_tokens")) {
            EXPECT_EQ(p["max_completion_tokens"], 1);
        }
        EXPECT_EQ(d["max_tokens"], 5);
        const json& pk = p["kv_transfer_params"];
        const json& dk = d["kv_transfer_params"];
        ASSERT_TRUE(pk["ferry_transfer_id"].is_number_unsigned()) << pk;
        uint64_t tid = pk["ferry_transfer_id"].get<uint64_t>();
        EXPECT_TRUE(tid >= 1 && tid < (uint64_t(1) << 63)) << tid;
        EXPECT_EQ(
            pk,
            json({{"do_remote_decode", true}, {"ferry_transfer_id", tid}, {"ferry_mode", "push"}}));
        // 0.0.0.0: the side channel listens everywhere; reached at the engine's address.
        EXPECT_EQ(dk, json({{"do_remote_prefill", true},
                            {"ferry_transfer_id", tid},
                            {"remote_host", "127.0.0.1"},
                            {"remote_port", 7777},
                            {"remote_tp_size", 2}}));
    }
    EXPECT_EQ(apart.load(), 0) << "a prefill leg's decode leg came only after its answer";
    auto h = http_get(kHost, router->port(), "/health", seconds(2));
    ASSERT_TRUE(h.ok());
    EXPECT_NE(h->body.find("\"side_channel\":\"127.0.0.1:7777\""), std::string::npos) << h->body;
    router->stop();
}

// Pull: prefill first; decode gets prefill's kv_transfer_params unchanged.
TEST(RouterVllm, PullPassesPrefillsParametersToDecodeUnchanged) {
    const json offered = {{"do_remote_prefill", true},  {"do_remote_decode", false},
                          {"ferry_transfer_id", 9},     {"ferry_mode", "pull"},
                          {"remote_host", "127.0.0.1"}, {"remote_port", 7001},
                          {"remote_block_ids", {3, 4}}, {"ferry_capability", "ab"}};
    FakeVllm prefill(
        "mode=\"pull\",host=\"127.0.0.1\",port=\"7001\",tp_size=\"1\"",
        [&offered](FakeVllm&, const json&) {
            return json({{"choices", {{{"text", "x"}}}}, {"kv_transfer_params", offered}}).dump();
        });
    FakeVllm decode("mode=\"push\",host=\"127.0.0.1\",port=\"7002\",tp_size=\"1\"",
                    [](FakeVllm&, const json&) {
                        return json({{"choices", {{{"text", "decoded"}}}}}).dump();
                    });
    auto router = Router::start(vllm_router(RouterMode::kPull, prefill, decode)).value();
    ASSERT_TRUE(testing::wait_healthy(kHost, router->port()));
    auto r = http_post_json(kHost, router->port(), "/v1/completions",
                            R"({"model":"tiny","prompt":"hi","max_tokens":3})", seconds(10));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->status, 200) << r->body;
    std::lock_guard lp(prefill.mu), ld(decode.mu);
    ASSERT_EQ(prefill.legs.size(), 1u);
    ASSERT_EQ(decode.legs.size(), 1u);
    EXPECT_EQ(prefill.legs[0].second["kv_transfer_params"]["ferry_mode"], "pull");
    EXPECT_EQ(decode.legs[0].second["kv_transfer_params"], offered);
    router->stop();
}

// A vLLM engine that answers /health but renders /metrics late (its API server starved: 2 of
// 4 real-engine requests of a loaded CI run were failed as "decode engine ... is down") stays
// ready with what its last /metrics said, and its requests are served.
TEST(RouterVllm, AnEngineWhoseMetricsComeLateStaysReady) {
    FakeVllm decode("mode=\"push\",host=\"127.0.0.1\",port=\"7002\",tp_size=\"1\"",
                    [](FakeVllm&, const json&) {
                        return json({{"choices", {{{"text", "decoded"}}}}}).dump();
                    });
    FakeVllm prefill("mode=\"push\",host=\"127.0.0.1\",port=\"7001\",tp_size=\"1\"",
                     [](FakeVllm&, const json&) {
                         return json({{"choices", {{{"text", "p"}}}}}).dump();
                     });
    RouterConfig rc = vllm_router(RouterMode::kPush, prefill, decode);
    rc.probe_timeout = milliseconds(150);
    auto router = Router::start(rc).value();
    ASSERT_TRUE(testing::wait_healthy(kHost, router->port()));
    prefill.metrics_delay_ms = 400;
    decode.metrics_delay_ms = 400;
    std::this_thread::sleep_for(milliseconds(1500));  // many probes, every /metrics late
    auto h = http_get(kHost, router->port(), "/health", seconds(2));
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    EXPECT_EQ(h->status, 200) << h->body;
    auto r = http_post_json(kHost, router->port(), "/v1/completions",
                            R"({"model":"tiny","prompt":"hi","max_tokens":3})", seconds(10));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_NE(r->body.find("decoded"), std::string::npos) << r->body;
    prefill.metrics_delay_ms = 0;
    decode.metrics_delay_ms = 0;
    router->stop();
}

// Readiness: a prefill engine of another mode, an engine without FerryConnector, and ferry's own
// engine leave a vLLM router not ready, its /health naming the flag to change.
TEST(RouterVllm, AnEngineOfAnotherModeOrWithoutTheConnectorIsNotReadyAndNamesTheFlag) {
    auto no_legs = [](FakeVllm&, const json&) { return std::string("{}"); };
    FakeVllm pull("mode=\"pull\",host=\"127.0.0.1\",port=\"7001\",tp_size=\"1\"", no_legs);
    FakeVllm none("", no_legs);
    struct Case {
        RouterMode mode;
        FakeVllm* prefill;
        std::vector<std::string> words;
    } cases[] = {
        {RouterMode::kPush, &pull, {"--mode push", "\\\"mode\\\":\\\"pull\\\""}},
        {RouterMode::kPull, &none, {"vllm:ferry_connector_info", "--kv-transfer-config"}},
    };
    for (const Case& c : cases) {
        SCOPED_TRACE(c.words[0]);
        auto router = Router::start(vllm_router(c.mode, *c.prefill, pull)).value();
        std::string body;
        EXPECT_TRUE(eventually([&] {
            auto h = http_get(kHost, router->port(), "/health", seconds(2));
            body = h.ok() ? h->body : "";
            return h.ok() && h->status == 503 && body.find(c.words[0]) != std::string::npos;
        })) << body;
        for (const auto& w : c.words) EXPECT_NE(body.find(w), std::string::npos) << w << body;
        auto r = http_post_json(kHost, router->port(), "/v1/completions",
                                R"({"model":"tiny","prompt":"hi"})", seconds(5));
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->status, 503) << r->body;
        router->stop();
    }
}

TEST(RouterVllm, ParsesTheConnectorInfoGauge) {
    auto i = parse_vllm_connector_info(
        "# TYPE vllm:ferry_connector_info gauge\n"
        "vllm:ferry_connector_info{model_name=\"m\",engine=\"0\",mode=\"pull\",host=\"10.0.0.2\","
        "port=\"7710\",tp_size=\"4\"} 1.0\n");
    ASSERT_TRUE(i.ok()) << i.status().to_string();
    EXPECT_EQ(i->mode, "pull");
    EXPECT_EQ(i->host, "10.0.0.2");
    EXPECT_EQ(i->port, 7710);
    EXPECT_EQ(i->tp_size, 4);
    EXPECT_FALSE(parse_vllm_connector_info("vllm:other 1\n").ok());
    EXPECT_FALSE(parse_vllm_connector_info(
                     "vllm:ferry_connector_info{mode=\"both\",host=\"h\",port=\"1\"} 1\n")
                     .ok());
    EXPECT_FALSE(parse_vllm_connector_info(
                     "vllm:ferry_connector_info{mode=\"push\",host=\"h\",port=\"x\"} 1\n")
                     .ok());
}

}  // namespace
}  // namespace ferry::serve
