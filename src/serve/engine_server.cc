#include "serve/engine_server.h"

#include <fmt/format.h>

#include "serve/kv_params_auth.h"
#include "serve/openai_api.h"

namespace ferry::serve {
namespace {

void send_error(HttpReply& reply, const Status& st) {
    reply.status = http_status_for(st);
    reply.body = error_body(st);
}

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

// The next event, waited for in short slices: a client that closed its connection or a server that
// stops ends the wait within one slice instead of at the request's deadline (or the last token),
// and the caller cancels the request so that its blocks are freed now.
constexpr Duration kWaitSlice = milliseconds(50);

Result<RequestHandle::Event> next_event(RequestHandle& h, TimePoint deadline,
                                        const HttpRequest& req, const HttpServer& http) {
    while (true) {
        // Checked before every event too: tokens that keep coming must not hide the close.
        if (req.client_gone && req.client_gone())
            return cancelled(
                fmt::format("request {}: the client closed its connection; cancelled", h.id()));
        if (http.stopping()) return cancelled("server stopping");
        auto e = h.next(std::min(deadline, Clock::now() + kWaitSlice));
        if (e.ok() || e.status().code() != StatusCode::kTimeout || Clock::now() >= deadline)
            return e;
    }
}

}  // namespace

Result<std::unique_ptr<EngineServer>> EngineServer::start(Engine* engine,
                                                          EngineServerOptions options) {
    if (engine == nullptr) return invalid_argument("no engine to serve");
    std::unique_ptr<EngineServer> s(new EngineServer());
    s->engine_ = engine;
    if (options.model_name.empty()) options.model_name = engine->cost_model().model().name;
    s->options_ = options;
    EngineServer* p = s.get();
    std::vector<HttpRoute> routes;
    routes.push_back({"POST", "/v1/completions", [p](const HttpRequest& req, HttpReply& reply) {
                          p->completions(req, reply);
                      }});
    // /health and /metrics read counters under short locks: quick, so that streams holding every
    // worker never keep a router's probe waiting.
    routes.push_back(
        {"GET", "/health",
         [p](const HttpRequest&, HttpReply& reply) { reply.body = p->health(&reply.status); },
         true});
    // ferry's own: the router aborts the other leg of a transfer whose one leg failed.
    routes.push_back(
        {"POST", "/ferry/abort", [p](const HttpRequest& req, HttpReply& reply) {
             // Read before its tag is checked: any client may send one, and a 16 MiB body of
             // nested arrays was a JSON tree of 870 MB.
             if (req.body.size() > kMaxAbortBodyBytes)
                 return send_error(reply, invalid_argument(fmt::format(
                                              "POST /ferry/abort: a body of {} bytes; at most {}",
                                              req.body.size(), kMaxAbortBodyBytes)));
             nlohmann::json j = nlohmann::json::parse(req.body, nullptr, false);
             if (j.is_discarded() || !j.is_object() || !j.contains("transfer_id") ||
                 !j["transfer_id"].is_string())
                 return send_error(reply, invalid_argument("body must be {\"transfer_id\": "
                                                           "\"...\", \"reason\": \"...\"}"));
             const std::string id = j["transfer_id"].get<std::string>();
             if (!p->options_.secret.empty()) {
                 auto tag = j.find("ferry_auth");
                 Status auth = verify_abort(
                     p->options_.secret, id,
                     tag != j.end() && tag->is_string() ? tag->get<std::string>() : std::string());
                 if (!auth.ok()) return send_error(reply, auth);
             }
             std::string reason = "aborted";
             if (auto r = j.find("reason"); r != j.end() && r->is_string())
                 reason = r->get<std::string>();
             Status st = p->engine_->abort_transfer(id, reason);
             if (!st.ok()) return send_error(reply, st);
             reply.body = "{}";
         }});
    routes.push_back({"GET", "/metrics",
                      [p](const HttpRequest&, HttpReply& reply) {
                          reply.content_type = "text/plain; version=0.0.4";
                          reply.body = p->engine_->prometheus_text();
                          if (p->options_.extra_metrics) reply.body += p->options_.extra_metrics();
                      },
                      true});
    FERRY_ASSIGN_OR_RETURN(s->http_, HttpServer::start(options.http, std::move(routes)));
    return s;
}

std::string EngineServer::health(int* http_status) const {
    EngineStats st = engine_->stats();
    const EngineConfig& c = engine_->config();
    // The limits are what Engine::submit checks and a router can check before it sends any
    // leg, so that a request refused by decode never costs prefill its compute and blocks.
    nlohmann::json j = {{"status", "ok"},
                        {"engine_id", c.engine_id},
                        {"model", options_.model_name},
                        {"max_model_len", c.max_model_len},
                        {"vocab", engine_->kv_slice().vocab},
                        {"block_size", c.block_size},
                        {"kv_blocks_free", st.blocks_free},
                        {"kv_blocks_used", st.blocks_used},
                        {"kv_blocks_total", st.blocks_total}};
    if (!options_.role.empty()) j["role"] = options_.role;
    if (!options_.kv_mode.empty()) j["kv_mode"] = options_.kv_mode;
    if (!options_.incarnation.empty()) j["incarnation"] = options_.incarnation;
    if (options_.kv_side_channel_port > 0) {
        j["kv_side_channel_port"] = options_.kv_side_channel_port;
        j["kv_provider"] = options_.kv_provider;
    }
    Status ready = options_.ready ? options_.ready() : ok_status();
    *http_status = ready.ok() ? 200 : 503;
    if (!ready.ok()) {
        // kUnavailable: not reachable yet; anything else will not get better by waiting.
        j["status"] = ready.code() == StatusCode::kUnavailable ? "starting" : "failed";
        j["reason"] = ready.message();
    }
    return j.dump();
}

void EngineServer::completions(const HttpRequest& req, HttpReply& reply) {
    // The prompt's size is checked against the model length before it is built into tokens.
    auto parsed = parse_completion_request(req.body, engine_->config().max_model_len);
    if (!parsed.ok()) return send_error(reply, parsed.status());
    bool stream = parsed->stream;
    // The model the client named is echoed, as docs/SERVING.md says (it was always the
    // engine's own name); a request that names none gets the engine's.
    const std::string model = parsed->model.empty() ? options_.model_name : parsed->model;
    auto handle = engine_->submit(std::move(parsed->gen));
    if (!handle.ok()) return send_error(reply, handle.status());
    std::shared_ptr<RequestHandle> h = std::move(handle).value();
    TimePoint deadline = Clock::now() + options_.request_timeout;

    // Wait for the first event before answering, so a request that fails before its first
    // token (KV transfer failed, timed out) gets a real HTTP error rather than 200 + an error
    // event.
    auto first = next_event(*h, deadline, req, *http_);
    if (!first.ok()) {
        h->cancel();
        return send_error(reply, first.status());
    }
    if (first->finished && !h->status().ok()) return send_error(reply, h->status());

    if (!stream) {
        std::vector<int32_t> tokens;
        Result<RequestHandle::Event> e = *first;
        while (true) {
            if (!e.ok()) {
                h->cancel();
                return send_error(reply, e.status());
            }
            if (e->finished) break;
            tokens.push_back(e->token);
            e = next_event(*h, deadline, req, *http_);
        }
        if (!h->status().ok()) return send_error(reply, h->status());
        reply.body = completion_body(result_of(*h, model, std::move(tokens)));
        return;
    }

    reply.content_type = "text/event-stream";
    HttpServer* http = http_.get();
    RequestHandle::Event first_event = *first;
    reply.stream = [h, http, deadline, model, first_event](const ChunkWriter& write) {
        std::vector<int32_t> tokens;
        Result<RequestHandle::Event> e = first_event;
        while (true) {
            if (!e.ok()) {
                // Waits are sliced so a server stop ends the stream promptly.
                if (http->stopping() || Clock::now() >= deadline) {
                    h->cancel();
                    write(sse_error_event(http->stopping() ? cancelled("server stopping")
                                                           : e.status()));
                    return;
                }
            } else {
                std::string ev;
                if (!e->finished) {
                    tokens.push_back(e->token);
                    ev = sse_token_event("cmpl-" + h->id(), model, e->token);
                } else {
                    ev = h->status().ok() ? sse_final_event(result_of(*h, model, tokens))
                                          : sse_error_event(h->status());
                    ev += kSseDone;
                }
                if (!write(ev)) {
                    h->cancel();  // client gone: free the blocks now
                    return;
                }
                if (e->finished) return;
            }
            e = h->next(std::min(deadline, Clock::now() + milliseconds(200)));
        }
    };
}

}  // namespace ferry::serve
