#include "ferry/serve/router.h"

#include <fmt/format.h>

#include <charconv>
#include <random>

#include "ferry/common/log.h"
#include "ferry/serve/kv_params_auth.h"
#include "ferry/serve/openai_api.h"

namespace ferry::serve {

using nlohmann::json;

Result<std::vector<EngineAddress>> parse_engine_addresses(std::string_view list) {
    std::vector<EngineAddress> out;
    while (!list.empty()) {
        size_t comma = list.find(',');
        std::string_view item = list.substr(0, comma);
        list = comma == std::string_view::npos ? std::string_view() : list.substr(comma + 1);
        size_t colon = item.rfind(':');
        int port = 0;
        if (colon == std::string_view::npos || colon == 0 ||
            std::from_chars(item.data() + colon + 1, item.data() + item.size(), port).ec !=
                std::errc() ||
            port <= 0 || port > 65535)
            return invalid_argument(fmt::format("'{}' is not HOST:PORT", item));
        out.push_back({std::string(item.substr(0, colon)), port});
    }
    if (out.empty()) return invalid_argument("no engine addresses given");
    return out;
}

namespace {

void send_error(HttpReply& reply, int status, const std::string& message) {
    reply.status = status;
    reply.body = json{{"error", {{"message", message}, {"code", status}}}}.dump();
}

// An engine's error body carries {"error": {"message": ...}}; keep its message, say which leg.
std::string leg_message(const std::string& leg, const EngineAddress& a, int status,
                        const std::string& body) {
    json j = json::parse(body, nullptr, false);
    std::string msg = !j.is_discarded() && j.contains("error") && j["error"].is_object()
                          ? j["error"].value("message", body)
                          : body;
    return fmt::format("{} leg on {} failed (HTTP {}): {}", leg, a.to_string(), status, msg);
}

// Reads a whole non-streamed response from an HttpStream.
struct Collected {
    Status status;  // transport
    int http = 0;
    std::string body;
    bool ended = false;
};

// Takes what has arrived without waiting past `deadline`.
void poll(HttpStream& s, Collected& c, TimePoint deadline) {
    while (!c.ended) {
        auto r = s.next(deadline);
        if (!r.ok()) {
            if (r.status().code() == StatusCode::kTimeout) return;
            c.status = r.status();
            c.ended = true;
            return;
        }
        if (!r->has_value()) {
            c.ended = true;
            c.http = s.status();
            return;
        }
        c.body += **r;
    }
}

double ms_since(TimePoint t) { return to_ms(Clock::now() - t); }

// A decode reply or event with its ferry_timing replaced by merged(its ferry_timing), the rest
// byte for byte; text that is not a JSON object passes unchanged.
template <typename Merge>
std::string with_router_timing(const std::string& reply, const Merge& merged) {
    auto object = scan_json_object(reply);
    if (!object.ok()) return reply;
    const JsonMember* timing = object->find("ferry_timing");
    return object->with(
        {{"ferry_timing", merged(timing ? parse_json_value(timing->value) : json())}});
}

}  // namespace

Result<std::unique_ptr<Router>> Router::start(RouterConfig config) {
    if (config.prefill.empty() || config.decode.empty())
        return invalid_argument("the router needs at least one prefill and one decode engine");
    if (config.secret.empty())
        return invalid_argument("the router needs the deployment secret to sign legs with");
    std::unique_ptr<Router> r(new Router());
    r->config_ = std::move(config);
    r->nonce_ = fmt::format("{:08x}", std::random_device{}());
    Router* p = r.get();
    std::vector<HttpRoute> routes;
    routes.push_back({"POST", "/v1/completions", [p](const HttpRequest& req, HttpReply& reply) {
                          p->completions(req, reply);
                      }});
    routes.push_back({"GET", "/health", [p](const HttpRequest&, HttpReply& reply) {
                          reply.body =
                              json{{"status", "ok"},
                                   {"mode", p->config_.mode == RouterMode::kPush ? "push" : "pull"}}
                                  .dump();
                      }});
    routes.push_back({"GET", "/metrics", [p](const HttpRequest&, HttpReply& reply) {
                          reply.content_type = "text/plain; version=0.0.4";
                          reply.body = p->prometheus_text();
                      }});
    FERRY_ASSIGN_OR_RETURN(r->http_, HttpServer::start(r->config_.http, std::move(routes)));
    return r;
}

Router::~Router() { stop(); }

void Router::stop() {
    if (http_) http_->stop();
}

Result<std::string> Router::engine_id(const EngineAddress& a) {
    std::string key = a.to_string();
    {
        std::lock_guard lock(ids_mu_);
        for (auto& [addr, id] : ids_)
            if (addr == key) return id;
    }
    FERRY_ASSIGN_OR_RETURN(HttpResponse h, http_get(a.host, a.port, "/health", seconds(5)));
    json j = json::parse(h.body, nullptr, false);
    if (h.status != 200 || j.is_discarded() || !j.contains("engine_id"))
        return unavailable(fmt::format("engine {} answered /health with HTTP {}", key, h.status));
    std::string id = j["engine_id"].get<std::string>();
    std::lock_guard lock(ids_mu_);
    ids_.emplace_back(key, id);
    return id;
}

std::string Router::prometheus_text() const {
    std::string out;
    render_counter(out, "ferry_router_requests_total", "requests routed", double(requests_));
    render_counter(out, "ferry_router_failures_total", "requests answered with an error",
                   double(failures_));
    render_counter(out, "ferry_router_prefill_leg_failures_total", "prefill legs that failed",
                   double(prefill_failures_));
    render_counter(out, "ferry_router_decode_leg_failures_total", "decode legs that failed",
                   double(decode_failures_));
    overhead_.render(out, "ferry_router_overhead_seconds",
                     "time the router itself adds before the legs leave and to the first token");
    return out;
}

void Router::completions(const HttpRequest& req, HttpReply& reply) {
    TimePoint t0 = Clock::now();
    requests_++;
    auto fail = [&](int status, const std::string& message) {
        failures_++;
        send_error(reply, status, message);
    };
    auto scanned = scan_completion_request(req.body);
    if (!scanned.ok()) return fail(400, scanned.status().to_string());
    const JsonObjectText& body = scanned->object;
    bool stream = scanned->stream;

    const EngineAddress& P = config_.prefill[next_prefill_++ % config_.prefill.size()];
    const EngineAddress& D = config_.decode[next_decode_++ % config_.decode.size()];
    auto pid = engine_id(P);
    if (!pid.ok()) return fail(503, "prefill engine unreachable: " + pid.status().to_string());
    std::string tid = fmt::format("{}-{}", nonce_, next_transfer_++);
    TimePoint deadline = t0 + config_.request_timeout;

    // Both legs are the client's body with a few fields set; everything else, the prompt above
    // all, is copied as it came.
    json prefill_kv = {{"do_remote_decode", true},
                       {"transfer_id", tid},
                       {"remote_host", D.host},
                       {"remote_port", D.port}};
    if (Status st = sign_kv_params_json(config_.secret, &prefill_kv); !st.ok())
        return fail(500, st.to_string());
    std::string prefill_body =
        body.with({{"max_tokens", 1}, {"stream", false}, {"kv_transfer_params", prefill_kv}});
    json decode_kv = {{"do_remote_prefill", true},
                      {"transfer_id", tid},
                      {"remote_engine_id", *pid},
                      {"remote_host", P.host},
                      {"remote_port", P.port}};

    auto prefill_call = std::make_shared<std::unique_ptr<HttpStream>>();
    auto prefill = std::make_shared<Collected>();
    TimePoint prefill_sent = Clock::now();
    double overhead_ms = 0;
    TimePoint prefill_answered = prefill_sent;
    if (config_.mode == RouterMode::kPush) {
        *prefill_call = HttpStream::post(P.host, P.port, "/v1/completions", std::move(prefill_body),
                                         config_.request_timeout);
    } else {
        overhead_ms += to_ms(prefill_sent - t0);
        auto r = http_post_json(P.host, P.port, "/v1/completions", prefill_body,
                                config_.request_timeout);
        prefill_answered = Clock::now();
        prefill->ended = true;
        if (!r.ok()) {
            prefill_failures_++;
            return fail(502, fmt::format("prefill leg on {} failed: {}", P.to_string(),
                                         r.status().to_string()));
        }
        prefill->http = r->status;
        prefill->body = r->body;
        if (r->status != 200) {
            prefill_failures_++;
            return fail(r->status, leg_message("prefill", P, r->status, r->body));
        }
        json pj = json::parse(r->body, nullptr, false);
        if (pj.is_discarded() || !pj.contains("kv_transfer_params") ||
            !pj["kv_transfer_params"].is_object()) {
            prefill_failures_++;
            return fail(502, fmt::format("prefill leg on {} returned no kv_transfer_params",
                                         P.to_string()));
        }
        decode_kv = pj["kv_transfer_params"];
        decode_kv["do_remote_prefill"] = true;
        decode_kv["do_remote_decode"] = false;
        decode_kv["transfer_id"] = tid;
    }
    if (Status st = sign_kv_params_json(config_.secret, &decode_kv); !st.ok())
        return fail(502, st.with_context("kv_transfer_params for the decode leg").to_string());
    TimePoint decode_sent = Clock::now();
    auto decode_call = std::shared_ptr<HttpStream>(
        HttpStream::post(D.host, D.port, "/v1/completions",
                         body.with({{"kv_transfer_params", decode_kv}}), config_.request_timeout));
    // Router time before the legs left: all of it in push; in pull, before the prefill leg and
    // between its answer and the decode leg.
    overhead_ms += config_.mode == RouterMode::kPush ? ms_since(t0) : ms_since(prefill_answered);

    // Wait for the decode leg's first bytes, watching the prefill leg meanwhile: a failed
    // prefill means the KV will never come, so the client hears now and decode is closed.
    std::string first;
    while (true) {
        auto r = decode_call->next(std::min(deadline, Clock::now() + milliseconds(20)));
        if (r.ok()) {
            if (r->has_value()) first = std::move(**r);
            break;
        }
        if (r.status().code() != StatusCode::kTimeout || Clock::now() >= deadline) {
            decode_failures_++;
            if (*prefill_call) (*prefill_call)->cancel();
            return fail(502, fmt::format("decode leg on {} failed: {}", D.to_string(),
                                         r.status().to_string()));
        }
        if (*prefill_call && !prefill->ended) {
            poll(**prefill_call, *prefill, Clock::now());
            if (prefill->ended && (!prefill->status.ok() || prefill->http != 200)) {
                prefill_failures_++;
                decode_call->cancel();
                // Closing the decode leg is not seen by an engine still waiting for KV.
                (void)http_post_json(
                    D.host, D.port, "/ferry/abort",
                    json{{"transfer_id", tid}, {"reason", "prefill leg failed"}}.dump(),
                    seconds(5));
                return fail(
                    prefill->status.ok() ? (prefill->http >= 400 ? prefill->http : 502) : 502,
                    prefill->status.ok() ? leg_message("prefill", P, prefill->http, prefill->body)
                                         : fmt::format("prefill leg on {} failed: {}",
                                                       P.to_string(), prefill->status.to_string()));
            }
        }
    }
    TimePoint first_at = Clock::now();
    if (decode_call->status() != 200) {
        decode_failures_++;
        Collected rest;
        rest.body = first;
        poll(*decode_call, rest, Clock::now() + seconds(5));
        if (*prefill_call) (*prefill_call)->cancel();
        int st = decode_call->status() ? decode_call->status() : 502;
        return fail(st, leg_message("decode", D, st, rest.body));
    }

    // Adds what the router saw to the decode engine's ferry_timing: together they explain TTFT.
    auto merged_timing = [this, prefill, prefill_call, prefill_sent, decode_sent, t0,
                          overhead_ms](json decode_timing) {
        if (*prefill_call) poll(**prefill_call, *prefill, Clock::now() + seconds(1));
        json t = {{"router_overhead_ms", overhead_ms},
                  {"decode_leg_sent_ms", to_ms(decode_sent - t0)}};
        json pj = json::parse(prefill->body, nullptr, false);
        if (!pj.is_discarded() && pj.contains("ferry_timing")) {
            t["prefill_queue_ms"] = pj["ferry_timing"].value("queue_ms", 0.0);
            t["prefill_compute_ms"] = pj["ferry_timing"].value("prefill_ms", 0.0);
            t["prefill_e2e_ms"] = pj["ferry_timing"].value("e2e_ms", 0.0);
        }
        t["prefill_leg_sent_ms"] = to_ms(prefill_sent - t0);
        if (decode_timing.is_object()) {
            t["decode_kv_wait_ms"] = decode_timing.value("kv_wait_ms", 0.0);
            t["decode_queue_ms"] = decode_timing.value("queue_ms", 0.0);
            t["decode_first_token_ms"] = decode_timing.value("first_token_ms", 0.0);
            t["decode_e2e_ms"] = decode_timing.value("e2e_ms", 0.0);
            t["decode_prefill_wait_ms"] = decode_timing.value("prefill_wait_ms", 0.0);
            t["decode_wait_ms"] = decode_timing.value("decode_wait_ms", 0.0);
            // KV complete at decode minus prefill's compute end, on the engines' wall clocks.
            double kv_at = decode_timing.value("kv_ready_unix_ms", 0.0);
            double computed_at = pj.is_discarded() || !pj.contains("ferry_timing")
                                     ? 0.0
                                     : pj["ferry_timing"].value("prefill_end_unix_ms", 0.0);
            if (kv_at > 0 && computed_at > 0) t["transfer_wait_ms"] = kv_at - computed_at;
        }
        t["router_e2e_ms"] = ms_since(t0);
        return t;
    };

    if (!stream) {
        Collected rest;
        rest.body = first;
        poll(*decode_call, rest, deadline);
        if (!rest.ended || !rest.status.ok()) {
            decode_failures_++;
            return fail(502, fmt::format("decode leg on {} broke off: {}", D.to_string(),
                                         rest.status.ok() ? "deadline" : rest.status.to_string()));
        }
        reply.body = with_router_timing(rest.body, merged_timing);
        overhead_.observe((overhead_ms + ms_since(first_at)) / 1000);
        return;
    }

    reply.content_type = "text/event-stream";
    HttpServer* http = http_.get();
    reply.stream = [this, decode_call, first, deadline, http, merged_timing, first_at,
                    overhead_ms](const ChunkWriter& write) {
        SseParser parser;
        std::string chunk = first;
        bool first_written = false;
        while (true) {
            std::string out;
            for (std::string& ev : parser.feed(chunk)) {
                // Only the final event carries ferry_timing; tokens pass through unparsed.
                if (ev.find("\"ferry_timing\"") != std::string::npos)
                    ev = with_router_timing(ev, merged_timing);
                out += "data: " + ev + "\n\n";
            }
            if (!out.empty()) {
                if (!write(out)) {
                    decode_call->cancel();  // client gone: the decode engine frees the blocks
                    return;
                }
                if (!first_written) {
                    first_written = true;
                    overhead_.observe((overhead_ms + ms_since(first_at)) / 1000);
                }
            }
            // The bytes just relayed are spent: a wait that times out must not feed them to the
            // parser again (that repeated the last token of a stream with a gap over 200 ms).
            chunk.clear();
            auto r = decode_call->next(std::min(deadline, Clock::now() + milliseconds(200)));
            if (!r.ok()) {
                if (r.status().code() == StatusCode::kTimeout && !http->stopping() &&
                    Clock::now() < deadline)
                    continue;
                decode_failures_++;
                failures_++;
                decode_call->cancel();
                write(sse_error_event(r.status().with_context("decode leg")));
                return;
            }
            if (!r->has_value()) return;  // decode finished its stream ([DONE] relayed)
            chunk = std::move(**r);
        }
    };
}

}  // namespace ferry::serve
