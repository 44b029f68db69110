// The engine's HTTP API over loopback, the way a client or router uses it.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include "serve/engine_server.h"
#include "serve/inprocess_kv_link.h"
#include "serve/kv_params_auth.h"
#include "serve/openai_api.h"

namespace ferry::serve {
namespace {

using nlohmann::json;

constexpr const char* kHost = "127.0.0.1";

CostModel tiny_cost() { return CostModel::create(tiny_test_model(), h200(), 1).value(); }

struct Served {
    std::unique_ptr<Engine> engine;
    std::unique_ptr<EngineServer> server;

    explicit Served(EngineConfig cfg) {
        engine = Engine::create(std::move(cfg), tiny_cost()).value();
    }
    void start() {
        ASSERT_TRUE(engine->start().ok());
        auto s = EngineServer::start(engine.get(), {.http = {.host = kHost, .port = 0}});
        ASSERT_TRUE(s.ok()) << s.status().to_string();
        server = std::move(s).value();
    }
    ~Served() {
        if (server) server->stop();
        engine->stop();
    }
    int port() const { return server->port(); }
    double metric(const std::string& name) {
        auto r = http_get(kHost, port(), "/metrics", seconds(5));
        if (!r.ok()) return -1;
        size_t at = r->body.find("\n" + name + " ");
        if (at == std::string::npos) return -1;
        return std::stod(r->body.substr(at + name.size() + 2));
    }
};

struct Streamed {
    int status = 0;
    std::vector<int32_t> tokens;
    json final_event;
    json error;
    bool done = false;
};

Streamed stream_completion(int port, const json& body) {
    Streamed s;
    SseParser parser;
    std::string raw;
    Status st = http_post_stream(kHost, port, "/v1/completions", body.dump(), seconds(10),
                                 &s.status, [&](std::string_view data) {
                                     raw.append(data);
                                     for (auto& ev : parser.feed(data)) {
                                         if (ev == "[DONE]") {
                                             s.done = true;
                                             continue;
                                         }
                                         json j = json::parse(ev);
                                         if (j.contains("error")) {
                                             s.error = j;
                                             continue;
                                         }
                                         for (auto& t : j["choices"][0]["token_ids"])
                                             s.tokens.push_back(t.get<int32_t>());
                                         if (!j["choices"][0]["finish_reason"].is_null())
                                             s.final_event = j;
                                     }
                                     return true;
                                 });
    EXPECT_TRUE(st.ok()) << st.to_string();
    if (s.status != 200 && !raw.empty()) s.error = json::parse(raw, nullptr, false);
    return s;
}

std::vector<int32_t> prompt_of(size_t n) {
    std::vector<int32_t> p(n);
    for (size_t i = 0; i < n; ++i) p[i] = int32_t((i * 37 + 11) % 1000);
    return p;
}

TEST(EngineHttp, StreamedCompletionDeliversVerifiedTokensThenDone) {
    Served e({.engine_id = "e", .num_blocks = 64});
    e.start();
    auto prompt = prompt_of(30);
    Streamed s =
        stream_completion(e.port(), {{"prompt", prompt}, {"max_tokens", 9}, {"stream", true}});
    EXPECT_EQ(s.status, 200);
    EXPECT_TRUE(s.done);
    EXPECT_EQ(s.tokens, expected_tokens(e.engine->kv_slice(), prompt, 9));
    EXPECT_EQ(s.final_event["usage"]["completion_tokens"], 9);
    EXPECT_EQ(s.final_event["usage"]["prompt_tokens"], 30);
}

TEST(EngineHttp, NonStreamedCompletionOfATextPrompt) {
    Served e({.engine_id = "e", .num_blocks = 64});
    e.start();
    auto r = http_post_json(kHost, e.port(), "/v1/completions",
                            R"({"prompt": "hello ferry", "max_tokens": 4})", seconds(10));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    ASSERT_EQ(r->status, 200) << r->body;
    json j = json::parse(r->body);
    std::vector<int32_t> ids = j["choices"][0]["token_ids"];
    EXPECT_EQ(ids, expected_tokens(e.engine->kv_slice(), tokenize("hello ferry"), 4));
    EXPECT_EQ(j["object"], "text_completion");
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
    EXPECT_TRUE(j["kv_transfer_params"].is_null());
}

// docs/SERVING.md: `model` is a string, echoed. The answer named the engine's model shape
// whatever the client sent, so a client checking the model of its answer saw another one.
TEST(EngineHttp, TheModelTheClientNamedIsEchoed) {
    Served e({.engine_id = "e", .num_blocks = 64});
    e.start();
    const std::string own = e.engine->cost_model().model().name;
    for (const std::string& model : {std::string("my-model"), std::string()}) {
        json body = {{"prompt", prompt_of(5)}, {"max_tokens", 2}};
        if (!model.empty()) body["model"] = model;
        const std::string expect = model.empty() ? own : model;
        auto r = http_post_json(kHost, e.port(), "/v1/completions", body.dump(), seconds(10));
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        ASSERT_EQ(r->status, 200) << r->body;
        EXPECT_EQ(json::parse(r->body)["model"], expect) << r->body;
        body["stream"] = true;
        Streamed s = stream_completion(e.port(), body);
        ASSERT_EQ(s.status, 200);
        EXPECT_EQ(s.final_event["model"], expect) << s.final_event.dump();
    }
    auto r = http_post_json(kHost, e.port(), "/v1/completions",
                            json({{"prompt", "x"}, {"model", std::string(300, 'm')}}).dump(),
                            seconds(5));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->status, 400);
    EXPECT_NE(r->body.find("'model' is 300 bytes long, more than 256"), std::string::npos)
        << r->body;
}

// Any client may POST /ferry/abort, and its body was parsed whole before the tag was checked
// (16 MiB of nested arrays: a JSON tree of 870 MB). Bodies are now bounded well below.
TEST(EngineHttp, AnAbortBodyAboveItsLimitIsRefusedUnread) {
    Served e({.engine_id = "e", .num_blocks = 16});
    e.start();
    const std::string body =
        json({{"transfer_id", "t"}, {"reason", std::string(kMaxAbortBodyBytes, '[')}}).dump();
    auto big = http_post_json(kHost, e.port(), "/ferry/abort", body, seconds(5));
    ASSERT_TRUE(big.ok()) << big.status().to_string();
    EXPECT_EQ(big->status, 400);
    EXPECT_NE(big->body.find(fmt::format("POST /ferry/abort: a body of {} bytes; at most {}",
                                         body.size(), kMaxAbortBodyBytes)),
              std::string::npos)
        << big->body;
    auto small = http_post_json(kHost, e.port(), "/ferry/abort",
                                json({{"transfer_id", "t"}, {"reason", "r"}}).dump(), seconds(5));
    ASSERT_TRUE(small.ok());
    EXPECT_EQ(small->status, 200) << small->body;
}

TEST(EngineHttp, InvalidBodiesGet400WithAMessage) {
    Served e({.engine_id = "e", .max_model_len = 64, .num_blocks = 64});
    e.start();
    for (const char* body :
         {"{not json", R"({"max_tokens": 4})", R"({"prompt": "x", "max_tokens": -1})",
          R"({"prompt": [1, 2], "max_tokens": 100})"}) {
        auto r = http_post_json(kHost, e.port(), "/v1/completions", body, seconds(5));
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->status, 400) << body;
        json j = json::parse(r->body);
        EXPECT_FALSE(j["error"]["message"].get<std::string>().empty()) << r->body;
    }
    auto r = http_post_json(kHost, e.port(), "/v1/completions",
                            R"({"prompt": [1, 2], "max_tokens": 100})", seconds(5));
    EXPECT_NE(r->body.find("max_model_len 64"), std::string::npos) << r->body;
}

TEST(EngineHttp, HealthAndMetricsReflectThePool) {
    Served e({.engine_id = "e7", .num_blocks = 32});
    e.start();
    auto h = http_get(kHost, e.port(), "/health", seconds(5));
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(h->status, 200);
    EXPECT_EQ(json::parse(h->body)["engine_id"], "e7");
    stream_completion(e.port(), {{"prompt", prompt_of(10)}, {"max_tokens", 2}, {"stream", true}});
    EXPECT_EQ(e.metric("ferry_requests_total"), 1);
    EXPECT_EQ(e.metric("ferry_kv_blocks_free"), 32);
    EXPECT_EQ(e.metric("ferry_kv_blocks_total"), 32);
    EXPECT_EQ(e.metric("ferry_generation_tokens_total"), 2);
}

TEST(EngineHttp, ClientThatDisconnectsMidStreamFreesTheBlocks) {
    Served e({.engine_id = "e", .num_blocks = 128});
    e.start();
    int status = 0;
    int seen = 0;
    json body = {{"prompt", prompt_of(20)}, {"max_tokens", 1500}, {"stream", true}};
    Status st = http_post_stream(kHost, e.port(), "/v1/completions", body.dump(), seconds(10),
                                 &status, [&](std::string_view) { return ++seen < 3; });
    EXPECT_TRUE(st.ok());
    TimePoint deadline = Clock::now() + seconds(5);
    while (e.metric("ferry_kv_blocks_free") != 128 && Clock::now() < deadline)
        std::this_thread::sleep_for(milliseconds(10));
    EXPECT_EQ(e.metric("ferry_kv_blocks_free"), 128);
}

// Two engines, the test as the router: both legs of a push request at once, and pull.
struct HttpPD {
    Served prefill{{.engine_id = "p", .num_blocks = 64}};
    Served decode{{.engine_id = "d", .num_blocks = 64, .kv_wait_timeout = milliseconds(300)}};
    InProcessKvLink link;

    explicit HttpPD(kv::TransferMode mode) : link({mode, seconds(5)}) {
        EXPECT_TRUE(link.add_engine("p", &prefill.engine->pool()).ok());
        EXPECT_TRUE(link.add_engine("d", &decode.engine->pool()).ok());
        prefill.engine->attach_connector(link.producer("p"), nullptr);
        decode.engine->attach_connector(nullptr, link.consumer("d"));
        EXPECT_TRUE(link.start().ok());
        prefill.start();
        decode.start();
    }
    ~HttpPD() {
        prefill.server->stop();
        decode.server->stop();
        prefill.engine->stop();
        decode.engine->stop();
        link.stop();
    }
};

TEST(EngineHttp, PushBothLegsAtOnceReturnsVerifiedTokens) {
    HttpPD pd(kv::TransferMode::kPush);
    auto prompt = prompt_of(45);
    json decode_body = {
        {"prompt", prompt},
        {"max_tokens", 6},
        {"stream", true},
        {"kv_transfer_params",
         {{"do_remote_prefill", true}, {"transfer_id", "x1"}, {"remote_engine_id", "p"}}}};
    json prefill_body = {
        {"prompt", prompt},
        {"max_tokens", 1},
        {"kv_transfer_params", {{"do_remote_decode", true}, {"transfer_id", "x1"}}}};
    Streamed s;
    std::thread decode_leg([&] { s = stream_completion(pd.decode.port(), decode_body); });
    auto p = http_post_json(kHost, pd.prefill.port(), "/v1/completions", prefill_body.dump(),
                            seconds(10));
    decode_leg.join();
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(p->status, 200) << p->body;
    EXPECT_EQ(s.status, 200);
    EXPECT_EQ(s.tokens, expected_tokens(pd.decode.engine->kv_slice(), prompt, 6));
    EXPECT_GT(s.final_event["ferry_timing"]["kv_wait_ms"].get<double>(), 0);
    EXPECT_EQ(pd.decode.metric("ferry_kv_transfers_total"), 1);
    EXPECT_GT(pd.decode.metric("ferry_kv_transfer_bytes_total"), 0);
}

TEST(EngineHttp, PullUsesTheParametersThePrefillResponseReturns) {
    HttpPD pd(kv::TransferMode::kPull);
    auto prompt = prompt_of(45);
    json prefill_body = {{"prompt", prompt},
                         {"max_tokens", 1},
                         {"kv_transfer_params", {{"do_remote_decode", true}}}};
    auto p = http_post_json(kHost, pd.prefill.port(), "/v1/completions", prefill_body.dump(),
                            seconds(10));
    ASSERT_TRUE(p.ok());
    ASSERT_EQ(p->status, 200) << p->body;
    json kv = json::parse(p->body)["kv_transfer_params"];
    EXPECT_EQ(kv["do_remote_prefill"], true);
    EXPECT_EQ(kv["remote_engine_id"], "p");
    EXPECT_EQ(kv["remote_block_ids"].size(), 3u);
    Streamed s = stream_completion(
        pd.decode.port(),
        {{"prompt", prompt}, {"max_tokens", 6}, {"stream", true}, {"kv_transfer_params", kv}});
    EXPECT_EQ(s.tokens, expected_tokens(pd.decode.engine->kv_slice(), prompt, 6));
    EXPECT_EQ(pd.prefill.metric("ferry_kv_blocks_free"), 64);
}

TEST(EngineHttp, DecodeLegWithoutItsPrefillGetsAnHttpErrorAndNoBlockLeaks) {
    HttpPD pd(kv::TransferMode::kPush);
    Streamed s = stream_completion(
        pd.decode.port(),
        {{"prompt", prompt_of(20)},
         {"max_tokens", 4},
         {"stream", true},
         {"kv_transfer_params", {{"do_remote_prefill", true}, {"transfer_id", "never"}}}});
    EXPECT_EQ(s.status, 504);
    EXPECT_NE(s.error["error"]["message"].get<std::string>().find("did not arrive"),
              std::string::npos);
    TimePoint deadline = Clock::now() + seconds(5);
    while (pd.decode.metric("ferry_kv_blocks_free") != 64 && Clock::now() < deadline)
        std::this_thread::sleep_for(milliseconds(10));
    EXPECT_EQ(pd.decode.metric("ferry_kv_blocks_free"), 64);
    EXPECT_EQ(pd.decode.metric("ferry_requests_failed_total"), 1);
}

}  // namespace
}  // namespace ferry::serve

namespace ferry::serve {
namespace {

// A peer that accepts and resets at once, reading nothing: every client form (blocking, streamed,
// HttpStream) returns an error, none hangs or ends the process. (The calls also block SIGPIPE:
// cpp-httplib sends without MSG_NOSIGNAL; this test does not force an EPIPE.)
TEST(HttpClient, BodyToAPeerThatResetsIsAnErrorOfEveryClientForm) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), len), 0);
    ASSERT_EQ(::listen(fd, 16), 0);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    int port = ntohs(a.sin_port);
    std::atomic<bool> done{false};
    std::thread closer([&] {
        while (!done) {
            pollfd p{fd, POLLIN, 0};
            if (::poll(&p, 1, 20) <= 0) continue;
            int c = ::accept(fd, nullptr, nullptr);
            if (c < 0) continue;
            linger l{1, 0};  // a reset, so the client's next write fails at once
            ::setsockopt(c, SOL_SOCKET, SO_LINGER, &l, sizeof l);
            ::close(c);
        }
    });
    std::string body(16 << 20, 'x');
    for (int i = 0; i < 3; ++i) {
        auto r = http_post_json("127.0.0.1", port, "/v1/completions", body, seconds(5));
        EXPECT_FALSE(r.ok());
        int status = 0;
        Status s = http_post_stream("127.0.0.1", port, "/v1/completions", body, seconds(5), &status,
                                    [](std::string_view) { return true; });
        EXPECT_FALSE(s.ok());
        auto stream = HttpStream::post("127.0.0.1", port, "/v1/completions", body, seconds(5));
        auto next = stream->next(Clock::now() + seconds(5));
        EXPECT_FALSE(next.ok());
    }
    done = true;
    closer.join();
    ::close(fd);
}

}  // namespace
}  // namespace ferry::serve
