#include "ferry/serve/http.h"

#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>

#include <thread>

#include "ferry/common/log.h"
#include "ferry/serve/openai_api.h"

namespace ferry::serve {

namespace {

void send_error(httplib::Response& res, const Status& st) {
    res.status = http_status_for(st);
    res.set_content(error_body(st), "application/json");
}

// Collects a finished request's summary for the final response or event.
CompletionResult result_of(const RequestHandle& h, const std::string& model,
                           std::vector<int32_t> tokens) {
    CompletionResult r;
    r.id = "cmpl-" + h.id();
    r.model = model;
    r.tokens = std::move(tokens);
    r.prompt_tokens = h.prompt_tokens();
    r.kv_out = h.kv_out();
    r.timing = h.timing();
    return r;
}

}  // namespace

struct EngineServer::Impl {
    Engine* engine;
    HttpServerOptions options;
    httplib::Server server;
    std::thread thread;
    int port = 0;
    std::atomic<bool> stopping{false};
    std::atomic<bool> exited{false};

    void completions(const httplib::Request& req, httplib::Response& res) {
        auto parsed = parse_completion_request(req.body);
        if (!parsed.ok()) return send_error(res, parsed.status());
        bool stream = parsed->stream;
        auto handle = engine->submit(std::move(parsed->gen));
        if (!handle.ok()) return send_error(res, handle.status());
        std::shared_ptr<RequestHandle> h = std::move(handle).value();
        TimePoint deadline = Clock::now() + options.request_timeout;
        const std::string& model = options.model_name;

        if (!stream) {
            std::vector<int32_t> tokens;
            while (true) {
                auto e = h->next(deadline);
                if (!e.ok()) {
                    h->cancel();
                    return send_error(res, e.status());
                }
                if (e->finished) break;
                tokens.push_back(e->token);
            }
            if (!h->status().ok()) return send_error(res, h->status());
            res.set_content(completion_body(result_of(*h, model, std::move(tokens))),
                            "application/json");
            return;
        }

        // Wait for the first event before answering, so a request that fails before its first
        // token (KV transfer failed, timed out) gets a real HTTP error rather than 200 + an
        // error event.
        auto first = h->next(deadline);
        if (!first.ok()) {
            h->cancel();
            return send_error(res, first.status());
        }
        if (first->finished && !h->status().ok()) return send_error(res, h->status());
        auto tokens = std::make_shared<std::vector<int32_t>>();
        auto pending = std::make_shared<std::optional<RequestHandle::Event>>(*first);
        res.set_header("Cache-Control", "no-cache");
        res.set_chunked_content_provider(
            "text/event-stream",
            [this, h, tokens, pending, deadline, model](size_t, httplib::DataSink& sink) {
                // Waits in short slices so a server stop ends the stream promptly.
                Result<RequestHandle::Event> e =
                    pending->has_value()
                        ? Result<RequestHandle::Event>(**pending)
                        : h->next(std::min(deadline, Clock::now() + milliseconds(200)));
                pending->reset();
                if (!e.ok()) {
                    if (stopping || Clock::now() >= deadline) {
                        h->cancel();
                        Status why = stopping ? cancelled("server stopping") : e.status();
                        std::string ev = sse_error_event(why);
                        sink.write(ev.data(), ev.size());
                        sink.done();
                    }
                    return true;  // called again
                }
                std::string ev;
                if (!e->finished) {
                    tokens->push_back(e->token);
                    ev = sse_token_event("cmpl-" + h->id(), model, e->token);
                } else {
                    ev = h->status().ok() ? sse_final_event(result_of(*h, model, *tokens))
                                          : sse_error_event(h->status());
                    ev += kSseDone;
                }
                if (!sink.write(ev.data(), ev.size())) {
                    h->cancel();  // client gone: free the blocks now
                    return false;
                }
                if (e->finished) sink.done();
                return true;
            },
            [h](bool success) {
                if (!success) h->cancel();
            });
    }
};

EngineServer::EngineServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

EngineServer::~EngineServer() { stop(); }

Result<std::unique_ptr<EngineServer>> EngineServer::start(Engine* engine,
                                                          HttpServerOptions options) {
    if (engine == nullptr) return invalid_argument("no engine to serve");
    auto impl = std::make_unique<Impl>();
    impl->engine = engine;
    if (options.model_name.empty()) options.model_name = engine->cost_model().model().name;
    impl->options = options;
    Impl* p = impl.get();
    size_t threads = std::max<size_t>(options.threads, 2);
    p->server.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    p->server.set_read_timeout(std::chrono::seconds(30));
    p->server.set_write_timeout(std::chrono::seconds(30));
    p->server.Post("/v1/completions", [p](const httplib::Request& req, httplib::Response& res) {
        p->completions(req, res);
    });
    p->server.Get("/health", [p](const httplib::Request&, httplib::Response& res) {
        EngineStats st = p->engine->stats();
        nlohmann::json j = {{"status", "ok"},
                            {"engine_id", p->engine->config().engine_id},
                            {"model", p->options.model_name},
                            {"kv_blocks_free", st.blocks_free},
                            {"kv_blocks_total", st.blocks_total}};
        res.set_content(j.dump(), "application/json");
    });
    p->server.Get("/metrics", [p](const httplib::Request&, httplib::Response& res) {
        res.set_content(p->engine->prometheus_text(), "text/plain; version=0.0.4");
    });
    p->server.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
        if (res.status == 404)
            send_error(res, not_found(fmt::format("no route {} {}: use POST /v1/completions, "
                                                  "GET /health or GET /metrics",
                                                  req.method, req.path)));
    });
    // The library listens with a backlog of 5: a burst of clients then loses SYNs and waits a
    // full second for the retry (measured: a 10-request burst took 1.0 s instead of 0.05 s).
    // Its socket hook hands us the fd, and listening again raises the backlog.
    int listen_fd = -1;
    p->server.set_socket_options([&listen_fd](socket_t sock) {
        httplib::default_socket_options(sock);
        listen_fd = sock;
    });
    if (options.port == 0) {
        p->port = p->server.bind_to_any_port(options.host);
        if (p->port <= 0)
            return unavailable(fmt::format("cannot bind an HTTP port on {}", options.host));
    } else {
        if (!p->server.bind_to_port(options.host, options.port))
            return unavailable(fmt::format("cannot bind {}:{} (in use? pick another --port)",
                                           options.host, options.port));
        p->port = options.port;
    }
    if (listen_fd >= 0) ::listen(listen_fd, SOMAXCONN);
    p->thread = std::thread([p] {
        p->server.listen_after_bind();
        p->exited = true;
    });
    // stop() before the listen loop runs would be lost and leave it running forever.
    TimePoint deadline = Clock::now() + seconds(5);
    while (!p->server.is_running() && Clock::now() < deadline)
        std::this_thread::sleep_for(milliseconds(1));
    if (!p->server.is_running()) {
        EngineServer failed(std::move(impl));  // its stop() joins the thread
        return internal_error("HTTP server did not start listening within 5 s");
    }
    return std::unique_ptr<EngineServer>(new EngineServer(std::move(impl)));
}

int EngineServer::port() const { return impl_->port; }

void EngineServer::stop() {
    if (!impl_ || impl_->stopping.exchange(true)) return;
    // Repeated because a stop() that lands before the listen loop starts is lost.
    TimePoint deadline = Clock::now() + seconds(10);
    while (!impl_->exited && Clock::now() < deadline) {
        impl_->server.stop();
        std::this_thread::sleep_for(milliseconds(1));
    }
    if (!impl_->exited) {
        log(LogLevel::kError, "http", "HTTP listen thread did not stop within 10 s; leaving it");
        impl_->thread.detach();
        return;
    }
    if (impl_->thread.joinable()) impl_->thread.join();
}

namespace {

std::unique_ptr<httplib::Client> client_for(const std::string& host, int port, Duration timeout) {
    auto c = std::make_unique<httplib::Client>(host, port);
    auto secs = std::chrono::duration_cast<std::chrono::microseconds>(timeout);
    c->set_connection_timeout(secs);
    c->set_read_timeout(secs);
    c->set_write_timeout(secs);
    return c;
}

Status transport_error(const std::string& host, int port, const std::string& path,
                       httplib::Error err) {
    std::string what = httplib::to_string(err);
    if (err == httplib::Error::Connection) what = "cannot connect (is the server up?)";
    if (err == httplib::Error::Read) what = "connection closed or read timed out";
    return unavailable(fmt::format("HTTP {}:{}{} failed: {}", host, port, path, what));
}

}  // namespace

Result<HttpResponse> http_get(const std::string& host, int port, const std::string& path,
                              Duration timeout) {
    auto c = client_for(host, port, timeout);
    auto r = c->Get(path);
    if (!r) return transport_error(host, port, path, r.error());
    return HttpResponse{r->status, r->body};
}

Result<HttpResponse> http_post_json(const std::string& host, int port, const std::string& path,
                                    const std::string& body, Duration timeout) {
    auto c = client_for(host, port, timeout);
    auto r = c->Post(path, body, "application/json");
    if (!r) return transport_error(host, port, path, r.error());
    return HttpResponse{r->status, r->body};
}

Status http_post_stream(const std::string& host, int port, const std::string& path,
                        const std::string& body, Duration timeout, int* status,
                        const std::function<bool(std::string_view)>& on_data) {
    auto c = client_for(host, port, timeout);
    httplib::Request req;
    req.method = "POST";
    req.path = path;
    req.body = body;
    req.set_header("Content-Type", "application/json");
    req.set_header("Accept", "text/event-stream");
    bool stopped_by_caller = false;
    req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
        if (on_data(std::string_view(data, len))) return true;
        stopped_by_caller = true;
        return false;
    };
    auto r = c->send(req);
    if (r && status) *status = r->status;
    if (!r && !stopped_by_caller) return transport_error(host, port, path, r.error());
    return ok_status();
}

}  // namespace ferry::serve
