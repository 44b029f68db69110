// The HTTP server under hostile clients, seen from raw sockets as an attacker sees it: slow
// connections that must not stop /health, oversized bodies refused before they are read, absolute
// header deadlines, connection caps, malformed requests, half-close and disconnects.
#include <gtest/gtest.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <fstream>

#include "serve/engine_server.h"
#include "serve/router.h"
#include "serve_procs.h"
#include "support/timing.h"

namespace ferry::serve::testing {
namespace {

constexpr const char* kHost = "127.0.0.1";

// One client connection on a raw socket.
class Raw {
  public:
    explicit Raw(int port) {
        fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_port = htons(uint16_t(port));
        ::inet_pton(AF_INET, kHost, &a.sin_addr);
        if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) close();
    }
    ~Raw() { close(); }
    Raw(const Raw&) = delete;
    Raw& operator=(const Raw&) = delete;

    bool ok() const { return fd_ >= 0; }
    int fd() const { return fd_; }
    void close() {
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }
    bool send(std::string_view s) {
        while (!s.empty()) {
            ssize_t n = ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL);
            if (n <= 0) return false;
            s.remove_prefix(size_t(n));
        }
        return true;
    }

    struct Response {
        int status = 0;  // 0: the connection ended (or the deadline passed) before a response
        std::string body;
        bool closed = false;
        int interim = 0;  // 1xx responses seen before it
    };
    // One final response; interim 1xx responses are skipped (and counted).
    Response read(Duration budget = seconds(5)) {
        Response r;
        TimePoint deadline = Clock::now() + budget;
        while (true) {
            size_t end = buf_.find("\r\n\r\n");
            if (end != std::string::npos) {
                int status = std::atoi(buf_.c_str() + 9);
                if (status >= 100 && status < 200) {
                    ++r.interim;
                    buf_.erase(0, end + 4);
                    continue;
                }
                std::string head = buf_.substr(0, end);
                size_t cl = head.find("Content-Length: ");
                size_t need = cl == std::string::npos ? 0 : std::stoul(head.substr(cl + 16));
                bool chunked = head.find("Transfer-Encoding: chunked") != std::string::npos;
                if (!chunked && buf_.size() >= end + 4 + need) {
                    r.status = status;
                    r.body = buf_.substr(end + 4, need);
                    buf_.erase(0, end + 4 + need);
                    return r;
                }
                if (chunked && buf_.find("\r\n0\r\n\r\n", end) != std::string::npos) {
                    r.status = status;
                    std::string_view rest = std::string_view(buf_).substr(end + 4);
                    while (true) {  // de-chunk
                        size_t size =
                            std::stoul(std::string(rest.substr(0, rest.find("\r\n"))), nullptr, 16);
                        rest.remove_prefix(rest.find("\r\n") + 2);
                        if (size == 0) break;
                        r.body.append(rest.substr(0, size));
                        rest.remove_prefix(size + 2);
                    }
                    buf_.clear();
                    return r;
                }
            }
            int left = int(to_ms(deadline - Clock::now()));
            if (left <= 0) return r;
            pollfd p{fd_, POLLIN, 0};
            if (::poll(&p, 1, left) <= 0) continue;
            char tmp[65536];
            ssize_t n = ::recv(fd_, tmp, sizeof tmp, 0);
            if (n <= 0) {
                r.closed = true;
                return r;
            }
            buf_.append(tmp, size_t(n));
        }
    }

  private:
    int fd_ = -1;
    std::string buf_;
};

std::string post(std::string_view path, std::string_view body) {
    return fmt::format(
        "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: {}\r\n\r\n{}",
        path, body.size(), body);
}

std::string message_of(const std::string& body) {
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded() || !j.contains("error")) return "(not an error body: " + body + ")";
    return j["error"]["message"].get<std::string>();
}

size_t rss_bytes() {
    std::ifstream in("/proc/self/statm");
    size_t pages = 0, resident = 0;
    in >> pages >> resident;
    return resident * size_t(::sysconf(_SC_PAGESIZE));
}

double percentile(std::vector<double> v, double q) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(q * double(v.size())))];
}

// A server with a few handlers that show what the server did: /wait blocks until its client is gone
// (or 5 s), /slow answers after 300 ms, /throw throws.
struct Fixture {
    std::unique_ptr<HttpServer> server;
    std::atomic<bool> waiting{false};
    std::atomic<bool> saw_gone{false};
    std::atomic<int64_t> gone_at_ns{0};

    explicit Fixture(HttpServerOptions o = {}) {
        std::vector<HttpRoute> routes;
        routes.push_back({"GET", "/health", [](const HttpRequest&, HttpReply& r) {
                              r.body = R"({"status": "ok"})";
                          }});
        routes.push_back({"POST", "/echo", [](const HttpRequest& q, HttpReply& r) {
                              r.body = json{{"bytes", q.body.size()}}.dump();
                          }});
        routes.push_back({"POST", "/slow", [](const HttpRequest&, HttpReply& r) {
                              std::this_thread::sleep_for(milliseconds(300));
                              r.body = R"({"done": true})";
                          }});
        routes.push_back({"POST", "/wait", [this](const HttpRequest& q, HttpReply& r) {
                              waiting = true;
                              TimePoint deadline = Clock::now() + seconds(5);
                              while (Clock::now() < deadline && !(q.client_gone && q.client_gone()))
                                  std::this_thread::sleep_for(milliseconds(1));
                              if (q.client_gone && q.client_gone()) {
                                  gone_at_ns = int64_t(now_ns());
                                  saw_gone = true;
                              }
                              r.body = "{}";
                          }});
        routes.push_back({"POST", "/status", [](const HttpRequest& q, HttpReply& r) {
                              r.status = std::stoi(q.body);
                              r.body = "{}";
                          }});
        routes.push_back({"GET", "/throw", [](const HttpRequest&, HttpReply&) {
                              throw std::runtime_error("boom in the handler");
                          }});
        auto s = HttpServer::start(o, std::move(routes));
        EXPECT_TRUE(s.ok()) << s.status().to_string();
        if (s.ok()) server = std::move(s).value();
    }
    int port() const { return server->port(); }
};

// 200 connections each holding a partial request and sending one byte every 1-2 s (the attack that
// stopped /health under cpp-httplib), while 50 /health probes run.
struct SlowLoris {
    std::vector<std::unique_ptr<Raw>> conns;
    std::atomic<bool> stop{false};
    std::thread dripper;

    explicit SlowLoris(int port, int n = 200) {
        for (int i = 0; i < n; ++i) {
            conns.push_back(std::make_unique<Raw>(port));
            conns.back()->send("POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ");
        }
        dripper = std::thread([this] {
            // Each connection gets a byte every ~1.5 s, spread over the interval.
            size_t i = 0;
            while (!stop) {
                conns[i % conns.size()]->send("a");
                ++i;
                std::this_thread::sleep_for(microseconds(1500000 / conns.size()));
            }
        });
    }
    ~SlowLoris() {
        stop = true;
        dripper.join();
    }
    size_t still_open() const {
        size_t open = 0;
        for (auto& c : conns) {
            pollfd p{c->fd(), POLLIN, 0};
            char b;
            if (::poll(&p, 1, 0) == 0 || ::recv(c->fd(), &b, 1, MSG_PEEK | MSG_DONTWAIT) > 0)
                ++open;
        }
        return open;
    }
};

std::vector<double> probe_health(int port, int n = 50) {
    std::vector<double> ms;
    for (int i = 0; i < n; ++i) {
        TimePoint t0 = Clock::now();
        auto r = http_get(kHost, port, "/health", seconds(2));
        // Any answer counts: what is measured is whether the server answers, not its verdict (a
        // router's /health may be 503 while it has no engine).
        ms.push_back(r.ok() && r->status > 0 ? to_ms(Clock::now() - t0) : 1e9);
        std::this_thread::sleep_for(milliseconds(30));
    }
    return ms;
}

// /health's p99 over `probes` probes, the best of three attempts (support/timing.h), each
// attempt's p50 and p99 printed under `what`.
double health_p99(int port, int probes, const std::string& what) {
    return ferry::testing::best_of(3, 100.0, what.c_str(), [&] {
        std::vector<double> ms = probe_health(port, probes);
        std::printf("%s: /health p50 %.2f ms p99 %.2f ms\n", what.c_str(), percentile(ms, 0.5),
                    percentile(ms, 0.99));
        return percentile(ms, 0.99);
    });
}

TEST(HttpLimits, HealthStaysFastUnder200SlowConnections) {
    Fixture f;  // default options: the per-client cap must leave room for attack and probes
    SlowLoris attack(f.port());
    std::this_thread::sleep_for(milliseconds(200));
    double p99 = ferry::testing::best_of(3, 100.0, "health p99 under 200 slow connections", [&] {
        std::vector<double> ms = probe_health(f.port());
        std::printf("health under 200 slow connections: p50 %.2f ms p99 %.2f ms max %.2f ms\n",
                    percentile(ms, 0.5), percentile(ms, 0.99), percentile(ms, 1.0));
        return percentile(ms, 0.99);
    });
    auto r = http_post_json(kHost, f.port(), "/echo", R"({"a": 1})", seconds(2));
    EXPECT_LT(p99, 100.0);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(attack.still_open(), 200u);  // held, not dropped: they simply cost no thread
}

TEST(HttpLimits, FerryEngineAndRouterProcessesStayHealthyUnder200SlowConnections) {
    auto dir = std::filesystem::temp_directory_path() / fmt::format("ferry-slow-{}", ::getpid());
    std::filesystem::create_directories(dir);
    int eport = free_port(), rport = free_port();
    Proc engine =
        Proc::spawn({ferry_binary(), "serve", "decode", "--port", std::to_string(eport), "--model",
                     "tiny", "--tp", "1", "--num-blocks", "64", "--kv-mode", "none"},
                    (dir / "engine.log").string());
    Proc router = Proc::spawn(
        {ferry_binary(), "serve", "router", "--port", std::to_string(rport), "--prefill",
         fmt::format("{}:{}", kHost, eport), "--decode", fmt::format("{}:{}", kHost, eport)},
        (dir / "router.log").string());
    ASSERT_TRUE(wait_healthy(kHost, eport)) << engine.log_text();
    ASSERT_TRUE(
        eventually([&] { return http_get(kHost, rport, "/health", seconds(1)).ok(); }, seconds(15)))
        << router.log_text();
    for (int port : {eport, rport}) {
        SlowLoris attack(port);
        std::this_thread::sleep_for(milliseconds(200));
        const char* who = port == eport ? "engine" : "router";
        EXPECT_LT(health_p99(port, 40, fmt::format("ferry {} under 200 slow connections", who)),
                  100.0)
            << who;
        if (port == eport) {
            auto r = http_post_json(kHost, eport, "/v1/completions",
                                    R"({"prompt": [1, 2, 3], "max_tokens": 2})", seconds(5));
            ASSERT_TRUE(r.ok()) << r.status().to_string();
            EXPECT_EQ(r->status, 200) << r->body;
        }
    }
    std::filesystem::remove_all(dir);
}

// Long streams holding every handler worker, more of them queued: /health and /metrics are
// still answered at once, by an engine and by a router alike (issue 30: 300 streams on 128
// workers kept an engine's /health queued for ~20 s and its router declared it dead).
void expect_health_fast_while_streams_hold_every_worker(int port, const char* who) {
    EXPECT_LT(health_p99(port, 30, fmt::format("{}, every worker streaming", who)), 100.0) << who;
    auto m = http_get(kHost, port, "/metrics", seconds(2));
    ASSERT_TRUE(m.ok()) << who << ": " << m.status().to_string();
    EXPECT_EQ(m->status, 200) << who;
}

TEST(HttpLimits, HealthAnswersAtOnceWhileStreamsHoldEveryWorker) {
    constexpr size_t kWorkers = 4, kStreams = 12;
    // Engine: 12 streams of 20k tokens at a fiftieth of the modelled speed on 4 workers.
    auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
    auto engine =
        Engine::create({.engine_id = "e", .num_blocks = 8192, .time_scale = 50}, cost).value();
    ASSERT_TRUE(engine->start().ok());
    auto server =
        EngineServer::start(engine.get(), {.http = {.host = kHost, .threads = kWorkers}}).value();
    {
        std::vector<std::unique_ptr<Raw>> streams;
        for (size_t i = 0; i < kStreams; ++i) {
            streams.push_back(std::make_unique<Raw>(server->port()));
            json body = {
                {"prompt", prompt_of(20, int(i))}, {"max_tokens", 20000}, {"stream", true}};
            ASSERT_TRUE(streams.back()->send(post("/v1/completions", body.dump())));
        }
        ASSERT_TRUE(
            eventually([&] { return engine->stats().requests_total >= kWorkers; }, seconds(5)));
        expect_health_fast_while_streams_hold_every_worker(server->port(), "engine");
        EXPECT_EQ(engine->stats().requests_total, kWorkers);  // the rest still queued for a worker
    }

    // Router: its streams relay a decode leg that never ends; 12 of them on 4 router workers.
    std::atomic<bool> release{false};
    std::vector<HttpRoute> routes;
    routes.push_back({"GET", "/health", [](const HttpRequest&, HttpReply& r) {
                          r.body = R"({"status": "ok", "engine_id": "stub"})";
                      }});
    routes.push_back({"POST", "/v1/completions", [&release](const HttpRequest& q, HttpReply& r) {
                          if (q.body.find("do_remote_decode") != std::string::npos) {
                              r.body = R"({"choices": [{"token_ids": [1]}]})";
                              return;
                          }
                          r.content_type = "text/event-stream";
                          r.stream = [&release](const ChunkWriter& write) {
                              TimePoint end = Clock::now() + seconds(60);
                              while (!release && Clock::now() < end)
                                  if (!write("data: {\"choices\": []}\n\n"))
                                      return;
                                  else
                                      std::this_thread::sleep_for(milliseconds(20));
                          };
                      }});
    routes.push_back(
        {"POST", "/ferry/abort", [](const HttpRequest&, HttpReply& r) { r.body = "{}"; }});
    auto stub = HttpServer::start({.host = kHost}, std::move(routes)).value();
    RouterConfig rc;
    rc.http = {.host = kHost, .threads = kWorkers};
    rc.secret = Secret::generate().value();
    rc.prefill = {{kHost, stub->port()}};
    rc.decode = {{kHost, stub->port()}};
    auto router = Router::start(rc).value();
    ASSERT_TRUE(wait_healthy(kHost, router->port()));
    {
        std::vector<std::unique_ptr<Raw>> streams;
        for (size_t i = 0; i < kStreams; ++i) {
            streams.push_back(std::make_unique<Raw>(router->port()));
            ASSERT_TRUE(streams.back()->send(
                post("/v1/completions", R"({"prompt": "hi", "max_tokens": 5, "stream": true})")));
        }
        ASSERT_TRUE(eventually(
            [&] {
                return metric(kHost, router->port(), "ferry_router_requests_total") >= kWorkers;
            },
            seconds(5)));
        expect_health_fast_while_streams_hold_every_worker(router->port(), "router");
        EXPECT_EQ(metric(kHost, router->port(), "ferry_router_requests_total"), double(kWorkers));
    }
    release = true;
    router->stop();
    stub->stop();
    server->stop();
    engine->stop();
}

TEST(HttpLimits, ContentLengthOverTheLimitGets413BeforeTheBody) {
    Fixture f;
    Raw::Response r;
    double ms = ferry::testing::best_of(3, 100.0, "413 for a 50 MB Content-Length", [&] {
        Raw c(f.port());
        TimePoint t0 = Clock::now();
        c.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 52428800\r\n\r\n");
        r = c.read(seconds(2));
        return to_ms(Clock::now() - t0);
    });
    EXPECT_EQ(r.status, 413);
    EXPECT_LT(ms, 100.0);
    EXPECT_NE(message_of(r.body).find("limit of 16777216 bytes"), std::string::npos) << r.body;
    EXPECT_NE(message_of(r.body).find("max_body_bytes"), std::string::npos) << r.body;
}

// The body really sent, as Content-Length and as chunks: 413 soon after the headers (chunked: once
// it grows past the limit), and the server's memory grows by less than 2x the body.
TEST(HttpLimits, A50MBBodyReallySentGets413AndMemoryStaysBounded) {
    Fixture f;
    const size_t kBody = 50u << 20;
    std::string block(1 << 20, '7');  // allocated before the baseline
    // One body sent; returns the ms from the headers to the 413.
    auto send_body = [&](bool chunked) {
        size_t before = rss_bytes();
        Raw c(f.port());
        // Stamped before the headers go out: the 413 can reach the reader before send() returns
        // in the sender, so a stamp taken after it could still be unset when the reader looks.
        const int64_t headers_at = int64_t(now_ns());
        std::thread sender([&] {
            c.send(chunked ? "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                           : fmt::format("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                         "{}\r\n\r\n",
                                         kBody));
            std::string frame = fmt::format("{:x}\r\n", block.size()) + block + "\r\n";
            for (size_t sent = 0; sent < kBody; sent += block.size())
                if (!c.send(chunked ? std::string_view(frame) : std::string_view(block))) break;
            if (chunked) c.send("0\r\n\r\n");
        });
        auto r = c.read(seconds(10));
        double ms = double(int64_t(now_ns()) - headers_at) / 1e6;
        size_t growth = rss_bytes() - std::min(before, rss_bytes());
        ::shutdown(c.fd(), SHUT_RDWR);  // ends the sender
        sender.join();
        std::printf(
            "50 MB %s body: 413 after %.2f ms from the headers, server RSS growth %.1f MiB\n",
            chunked ? "chunked" : "Content-Length", ms, double(growth) / (1 << 20));
        EXPECT_EQ(r.status, 413) << (chunked ? "chunked" : "Content-Length");
        EXPECT_NE(message_of(r.body).find("16777216"), std::string::npos) << r.body;
        EXPECT_LT(growth, 2 * kBody);
        return ms;
    };
    EXPECT_LT(ferry::testing::best_of(3, 100.0, "50 MB Content-Length body",
                                      [&] { return send_body(false); }),
              100.0);
    send_body(true);  // chunked: the 413 comes once 16 MiB arrived, so only memory is checked
}

TEST(HttpLimits, HeadersSlowerThanTheDeadlineAreCutAtTheDeadline) {
    Fixture f({.header_timeout = milliseconds(500)});
    Raw c(f.port());
    TimePoint t0 = Clock::now();
    std::atomic<bool> stop{false};
    std::thread dripper([&] {
        std::string line = "GET /health HTTP/1.1\r\nX-A: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
        for (size_t i = 0; i < line.size() && !stop; ++i) {
            c.send(line.substr(i, 1));  // a byte every 50 ms: would never time out per read
            std::this_thread::sleep_for(milliseconds(50));
        }
    });
    auto r = c.read(seconds(3));
    double ms = to_ms(Clock::now() - t0);
    stop = true;
    dripper.join();
    EXPECT_EQ(r.status, 408);
    EXPECT_NE(message_of(r.body).find("header_timeout"), std::string::npos) << r.body;
    EXPECT_GE(ms, 450.0);
    EXPECT_LT(ms, 700.0);
}

TEST(HttpLimits, BodySlowerThanItsDeadlineGets408) {
    Fixture f({.body_timeout = milliseconds(300)});
    Raw c(f.port());
    c.send("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{");
    TimePoint t0 = Clock::now();
    auto r = c.read(seconds(3));
    EXPECT_EQ(r.status, 408);
    EXPECT_NE(message_of(r.body).find("body_timeout"), std::string::npos) << r.body;
    EXPECT_LT(to_ms(Clock::now() - t0), 500.0);
}

TEST(HttpLimits, ConnectionCapsAnswer429PerClientAnd503InAll) {
    {
        Fixture f({.max_connections_per_client = 3});
        std::vector<std::unique_ptr<Raw>> held;
        for (int i = 0; i < 3; ++i) held.push_back(std::make_unique<Raw>(f.port()));
        std::this_thread::sleep_for(milliseconds(100));  // accepted
        Raw extra(f.port());
        extra.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        auto r = extra.read(seconds(2));
        EXPECT_EQ(r.status, 429);
        EXPECT_NE(message_of(r.body).find("limit of 3 open connections"), std::string::npos)
            << r.body;
        EXPECT_NE(message_of(r.body).find("127.0.0.1"), std::string::npos) << r.body;
        held.pop_back();  // a place frees up
        std::this_thread::sleep_for(milliseconds(100));
        auto h = http_get(kHost, f.port(), "/health", seconds(2));
        ASSERT_TRUE(h.ok());
        EXPECT_EQ(h->status, 200);
    }
    {
        Fixture f({.max_connections = 2});
        Raw a(f.port()), b(f.port());
        std::this_thread::sleep_for(milliseconds(100));
        Raw extra(f.port());
        extra.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
        auto r = extra.read(seconds(2));
        EXPECT_EQ(r.status, 503);
        EXPECT_NE(message_of(r.body).find("max_connections"), std::string::npos) << r.body;
    }
}

TEST(HttpLimits, IdleKeepAliveConnectionIsClosedAfterTheIdleTimeout) {
    Fixture f({.idle_timeout = milliseconds(300)});
    Raw c(f.port());
    c.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(c.read().status, 200);
    EXPECT_EQ(c.read().status, 200);  // pipelined on the same connection
    TimePoint t0 = Clock::now();
    auto r = c.read(seconds(2));
    EXPECT_TRUE(r.closed);
    EXPECT_LT(to_ms(Clock::now() - t0), 500.0);
}

struct Answer {
    std::string request;
    int status;
    std::string says;  // in the error's message, or in the body of a success
};

// Sends each request on a connection of its own: the status, and for an error the shape every
// ferry error has, its message naming the problem.
void expect_answers(int port, const std::vector<Answer>& cases) {
    for (const Answer& k : cases) {
        Raw c(port);
        c.send(k.request);
        auto r = c.read(seconds(2));
        std::string what = k.request.substr(0, 70);
        EXPECT_EQ(r.status, k.status) << what;
        if (k.status < 400) {
            EXPECT_NE(r.body.find(k.says), std::string::npos) << what << ": " << r.body;
            continue;
        }
        EXPECT_NE(message_of(r.body).find(k.says), std::string::npos) << what << ": " << r.body;
        json j = json::parse(r.body, nullptr, false);
        EXPECT_EQ(j["error"]["code"], k.status) << what;
        EXPECT_TRUE(j["error"]["type"].is_string()) << what << ": " << r.body;
    }
}

TEST(HttpLimits, MalformedRequestsGet400Or431WithAMessage) {
    Fixture f;
    expect_answers(
        f.port(),
        {
            {"GARBAGE\r\n\r\n", 400, "malformed request line"},
            {"GET nopath HTTP/1.1\r\n\r\n", 400, "malformed request line"},
            {"GET / HTTP/9.9\r\n\r\n", 505, "HTTP version"},
            {"POST /echo HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400,
             "invalid Content-Length '-1'"},
            {"POST /echo HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400, "invalid Content-Length"},
            {"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400,
             "conflicting Content-Length values 2 and 3"},
            {"POST /echo HTTP/1.1\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n", 400,
             "both Content-Length and Transfer-Encoding"},
            {"POST /echo HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "not supported"},
            {"GET /health HTTP/1.1\r\nBad Header\r\n\r\n", 400, "malformed header line"},
            {"GET /health HTTP/1.1\r\nX-Big: " + std::string(70000, 'b') + "\r\n\r\n", 431,
             "exceed the limit of 65536 bytes"},
            {"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400,
             "invalid chunk size"},
            {"GET /nope HTTP/1.1\r\n\r\n", 404, "no route GET /nope"},
            {"DELETE /health HTTP/1.1\r\n\r\n", 405,
             "method DELETE not allowed on /health: use GET"},
            {"GET /throw HTTP/1.1\r\n\r\n", 500, "boom in the handler"},
            // Waited for the header deadline, then 408 as if the client were slow.
            {"GET /health HTTP/1.1\nHost: x\n\n", 400,
             "request lines end with CRLF (\\r\\n), not a bare LF (\\n)"},
            {"GET /health HTTP/1.1\r\nHost: x\r\n\n", 400, "not a bare LF"},
        });
    // A good chunked body still works, as does the server after all of the above.
    Raw c(f.port());
    c.send(
        "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        "3\r\n{\"a\r\n5\r\n\": 1}\r\n0\r\n\r\n");
    auto r = c.read();
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, R"({"bytes":8})");
}

// Each status the engines and the router answer with carries its own reason phrase: a 403 (a
// leg or an abort not signed by the router) went out as "403 Error".
TEST(HttpLimits, EveryStatusTheServersSendHasItsReasonPhrase) {
    Fixture f;
    for (const auto& [status, phrase] :
         std::vector<std::pair<int, std::string>>{{200, "OK"},
                                                  {400, "Bad Request"},
                                                  {403, "Forbidden"},
                                                  {404, "Not Found"},
                                                  {500, "Internal Server Error"},
                                                  {502, "Bad Gateway"},
                                                  {503, "Service Unavailable"},
                                                  {504, "Gateway Timeout"}}) {
        Raw c(f.port());
        c.send(post("/status", std::to_string(status)));
        std::string head(4096, '\0');
        pollfd p{c.fd(), POLLIN, 2000};
        ASSERT_EQ(::poll(&p, 1, 2000), 1);
        head.resize(size_t(std::max<ssize_t>(0, ::recv(c.fd(), head.data(), head.size(), 0))));
        EXPECT_TRUE(head.starts_with(fmt::format("HTTP/1.1 {} {}\r\n", status, phrase))) << head;
    }
}

// A known path asked with another method is 405 naming the method to use (404 "no route" said
// the path did not exist), and a POST body sent as something other than JSON is 415 naming the
// type, before the handler runs; JSON with parameters, a +json type, a form's type (what
// `curl -d` sends) or no Content-Type at all are taken.
TEST(HttpLimits, WrongMethodIs405AndANonJsonBodyIs415) {
    Fixture f;
    auto with_type = [](const std::string& type) {
        return fmt::format(
            "POST /echo HTTP/1.1\r\nContent-Type: {}\r\nContent-Length: 2\r\n\r\n{{}}", type);
    };
    const std::string echoed = R"({"bytes":2})";
    expect_answers(
        f.port(),
        {
            {"GET /echo HTTP/1.1\r\n\r\n", 405, "method GET not allowed on /echo: use POST"},
            {"PUT /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 405, "use POST"},
            {"POST /health HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 405, "use GET"},
            {with_type("text/plain"), 415, "Content-Type 'text/plain' not supported on POST /echo"},
            {with_type("multipart/form-data; boundary=x"), 415,
             "send the body as application/json"},
            {with_type("application/x-www-form-urlencoded"), 200, echoed},
            {with_type("application/json; charset=utf-8"), 200, echoed},
            {with_type("Application/JSON"), 200, echoed},
            {with_type("application/merge-patch+json"), 200, echoed},
            {"POST /echo HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}", 200, echoed},
        });
    // The 405 says which methods the path has in an Allow header too.
    Raw c(f.port());
    c.send("GET /echo HTTP/1.1\r\n\r\n");
    std::string head(4096, '\0');
    pollfd p{c.fd(), POLLIN, 2000};
    ASSERT_EQ(::poll(&p, 1, 2000), 1);
    head.resize(size_t(std::max<ssize_t>(0, ::recv(c.fd(), head.data(), head.size(), 0))));
    EXPECT_NE(head.find("\r\nAllow: POST\r\n"), std::string::npos) << head;
}

// A client that shuts its sending side part way through a request still reads: it is told what
// was missing (it got no answer at all: "Empty reply from server").
TEST(HttpLimits, ARequestCutShortByAHalfCloseGets400SayingWhatWasMissing) {
    Fixture f;
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"POST /echo HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"prompt\"",
         "the request ended after 9 of the 100 body bytes its Content-Length announced"},
        {"POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n",
         "the request ended before the last chunk of its chunked body"},
        {"GET /health HTTP/1.1\r\nHost: x\r\n",
         "the request ended before the blank line that ends its headers"},
    };
    for (const auto& [request, says] : cases) {
        Raw c(f.port());
        c.send(request);
        ::shutdown(c.fd(), SHUT_WR);
        auto r = c.read(seconds(2));
        EXPECT_EQ(r.status, 400) << request;
        EXPECT_EQ(message_of(r.body), says) << request;
    }
    // An idle connection closed without a byte is not a request: nothing comes back.
    Raw idle(f.port());
    ::shutdown(idle.fd(), SHUT_WR);
    auto r = idle.read(seconds(2));
    EXPECT_EQ(r.status, 0);
    EXPECT_TRUE(r.closed);
}

TEST(HttpLimits, HalfCloseAfterTheRequestStillGetsTheWholeResponse) {
    Fixture f;
    Raw c(f.port());
    c.send(post("/slow", "{}"));
    ::shutdown(c.fd(), SHUT_WR);
    auto r = c.read(seconds(3));
    EXPECT_EQ(r.status, 200);
    EXPECT_EQ(r.body, R"({"done": true})");
    EXPECT_TRUE(c.read(seconds(1)).closed);  // and then the server closes its side
}

TEST(HttpLimits, FullCloseWhileAHandlerWaitsIsSeenWithin100Ms) {
    for (bool half_then_full : {false, true}) {
        double ms = ferry::testing::best_of(
            3, 100.0,
            half_then_full ? "client_gone() after a half-close, then close"
                           : "client_gone() after a close",
            [&] {
                Fixture f;
                Raw c(f.port());
                c.send(post("/wait", "{}"));
                if (half_then_full) ::shutdown(c.fd(), SHUT_WR);
                EXPECT_TRUE(eventually([&] { return f.waiting.load(); }, seconds(2)));
                std::this_thread::sleep_for(milliseconds(50));
                EXPECT_FALSE(f.saw_gone.load());  // a half-close is not gone
                int64_t closed_at = int64_t(now_ns());
                c.close();
                bool seen = eventually([&] { return f.saw_gone.load(); }, seconds(2));
                EXPECT_TRUE(seen);
                return seen ? double(f.gone_at_ns - closed_at) / 1e6 : 1e9;
            });
        EXPECT_LT(ms, 100.0);
    }
}

// Every worker busy (here the one worker holds /wait until its client leaves): a complete
// request waiting for one gets 503 naming the limit at queue_timeout, not whenever a worker
// frees up; a queued request whose client left is dropped; once a worker is free, requests
// are served again.
TEST(HttpLimits, ARequestQueuedBehindBusyWorkersGets503AtTheQueueTimeout) {
    HttpServerOptions o;
    o.threads = 1;
    o.queue_timeout = milliseconds(300);
    Fixture f(o);
    Raw busy(f.port());
    ASSERT_TRUE(busy.send(post("/wait", "{}")));
    ASSERT_TRUE(eventually([&] { return f.waiting.load(); }, seconds(2)));
    Raw queued(f.port()), leaves(f.port());
    TimePoint t0 = Clock::now();
    ASSERT_TRUE(queued.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    ASSERT_TRUE(leaves.send("GET /health HTTP/1.1\r\nHost: x\r\n\r\n"));
    leaves.close();
    Raw::Response r = queued.read(seconds(3));
    double ms = to_ms(Clock::now() - t0);
    EXPECT_EQ(r.status, 503) << r.body;
    // The library names its own setting; `ferry serve` gives its flag's name (CliFlags).
    EXPECT_NE(r.body.find("queue_timeout"), std::string::npos) << r.body;
    EXPECT_EQ(r.body.find("--"), std::string::npos) << r.body;
    EXPECT_GT(ms, 250.0);
    EXPECT_LT(ms, 1500.0);
    EXPECT_FALSE(f.saw_gone.load());  // the busy one is still being handled
    busy.close();
    ASSERT_TRUE(eventually([&] { return f.saw_gone.load(); }, seconds(2)));
    auto h = http_get(kHost, f.port(), "/health", seconds(2));
    ASSERT_TRUE(h.ok()) << h.status().to_string();
    EXPECT_EQ(h->status, 200);

    o.queue_timeout = Duration::zero();
    auto bad = HttpServer::start(o, {});
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("queue_timeout"), std::string::npos);
}

// An engine's non-streamed completion whose client went away: cancelled, blocks freed.
TEST(HttpLimits, EngineCancelsANonStreamedRequestWhoseClientLeft) {
    auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
    auto engine =
        Engine::create({.engine_id = "e", .num_blocks = 128, .time_scale = 4}, cost).value();
    ASSERT_TRUE(engine->start().ok());
    auto server = EngineServer::start(engine.get(), {.http = {.host = kHost}}).value();
    Raw c(server->port());
    json body = {{"prompt", prompt_of(20, 1)}, {"max_tokens", 1500}};
    c.send(post("/v1/completions", body.dump()));
    ASSERT_TRUE(eventually([&] { return engine->stats().blocks_free < 128; }, seconds(2)));
    c.close();
    TimePoint t0 = Clock::now();
    EXPECT_TRUE(eventually([&] { return engine->stats().blocks_free == 128; }, seconds(2)));
    std::printf("blocks freed %.1f ms after the client closed\n", to_ms(Clock::now() - t0));
    EXPECT_LT(to_ms(Clock::now() - t0), 500.0);
    EXPECT_EQ(engine->stats().blocks_free, 128u);
    server->stop();
    engine->stop();
}

TEST(HttpLimits, EngineRefusesAPromptLongerThanTheModelBeforeTokenising) {
    auto cost = CostModel::create(tiny_test_model(), h200(), 1).value();
    auto engine =
        Engine::create({.engine_id = "e", .max_model_len = 1000, .num_blocks = 64}, cost).value();
    ASSERT_TRUE(engine->start().ok());
    auto server = EngineServer::start(engine.get(), {.http = {.host = kHost}}).value();
    std::string ids = "[1";
    for (int i = 0; i < 1000000; ++i) ids += ",1";
    ids += "]";
    for (const std::string& prompt : {ids, "\"" + std::string(5000, 'x') + "\""}) {
        auto r = http_post_json(kHost, server->port(), "/v1/completions",
                                R"({"max_tokens": 1, "prompt": )" + prompt + "}", seconds(10));
        ASSERT_TRUE(r.ok());
        EXPECT_EQ(r->status, 400);
        EXPECT_NE(message_of(r->body).find("max_model_len 1000"), std::string::npos) << r->body;
    }
    server->stop();
    engine->stop();
}

}  // namespace
}  // namespace ferry::serve::testing
