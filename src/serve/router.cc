#include "serve/router.h"

#include <arpa/inet.h>
#include <fmt/format.h>

#include <charconv>
#include <random>

#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"
#include "ferry/kv/block_mapping.h"
#include "serve/kv_params_auth.h"
#include "serve/openai_api.h"

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
        std::string host(item.substr(0, colon));
        // Digits and dots are an IPv4 address or nothing: `999.1.1.1` went to DNS and the engine
        // stayed "not ready" forever. A name may resolve later (its engine not up yet): not
        // checked here.
        in_addr v4{};
        if (host.find_first_not_of("0123456789.") == std::string::npos &&
            ::inet_pton(AF_INET, host.c_str(), &v4) != 1)
            return invalid_argument(fmt::format("'{}': {} is not an IPv4 address", item, host));
        out.push_back({std::move(host), port});
    }
    if (out.empty()) return invalid_argument("no engine addresses given");
    return out;
}

namespace {

// What an engine needs in its vLLM command line to be fronted: the two lines of docs/VLLM.md.
constexpr const char* kVllmConnectorFlag =
    "--kv-transfer-config '{\"kv_connector\":\"FerryConnector\",\"kv_connector_module_path\":"
    "\"ferry.vllm\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"mode\":...}}'";

}  // namespace

Result<VllmConnectorInfo> parse_vllm_connector_info(std::string_view metrics) {
    constexpr std::string_view kName = "vllm:ferry_connector_info{";
    size_t at = 0;
    while ((at = metrics.find(kName, at)) != std::string_view::npos && at > 0 &&
           metrics[at - 1] != '\n')
        at += kName.size();
    if (at == std::string_view::npos)
        return not_found(fmt::format(
            "its /metrics has no vllm:ferry_connector_info: it runs no FerryConnector (or a ferry "
            "older than this router); start it with {}",
            kVllmConnectorFlag));
    std::string_view labels = metrics.substr(at + kName.size());
    labels = labels.substr(0, std::min(labels.find('}'), labels.find('\n')));
    VllmConnectorInfo info;
    bool has_port = false;
    // name="value",...: the values come from the connector's config, checked there (no quotes).
    while (!labels.empty()) {
        size_t eq = labels.find("=\"");
        size_t close = eq == std::string_view::npos ? eq : labels.find('"', eq + 2);
        if (close == std::string_view::npos)
            return invalid_argument(
                fmt::format("vllm:ferry_connector_info: malformed labels '{}'", labels));
        std::string_view name = labels.substr(0, eq);
        std::string_view value = labels.substr(eq + 2, close - eq - 2);
        labels = labels.substr(close + 1);
        if (!labels.empty() && labels[0] == ',') labels.remove_prefix(1);
        auto number = [&](int& out) {
            return std::from_chars(value.data(), value.data() + value.size(), out).ec ==
                   std::errc();
        };
        if (name == "mode") {
            info.mode = value;
        } else if (name == "host") {
            info.host = value;
        } else if (name == "port") {
            has_port = number(info.port);
        } else if (name == "tp_size" && !number(info.tp_size)) {
            info.tp_size = 0;
        }
    }
    if (info.mode != "push" && info.mode != "pull")
        return invalid_argument(fmt::format(
            "vllm:ferry_connector_info: mode '{}' is neither push nor pull", info.mode));
    if (info.host.empty() || !has_port || info.port <= 0 || info.port > 65535 || info.tp_size < 1)
        return invalid_argument(
            "vllm:ferry_connector_info: no usable side channel (host, port, tp_size)");
    return info;
}

namespace {

// What the router relays of an upstream's words (a reason from its /health, a leg's error) is
// cut to this: two routers given each other as engines nested each other's reasons into /health
// bodies of 59 MB within 30 s.
constexpr size_t kMaxRelayedBytes = 1024;

std::string bounded(std::string text) {
    if (text.size() <= kMaxRelayedBytes) return text;
    size_t cut = text.size() - kMaxRelayedBytes;
    text.resize(kMaxRelayedBytes);
    // Not inside a UTF-8 sequence (the JSON of /health must stay valid): its continuation bytes,
    // then its lead byte, go too.
    while (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xC0) == 0x80) {
        text.pop_back();
        ++cut;
    }
    if (!text.empty() && static_cast<unsigned char>(text.back()) >= 0xC0) {
        text.pop_back();
        ++cut;
    }
    return fmt::format("{}... ({} more bytes cut)", text, cut);
}

const char* mode_name(RouterMode m) { return m == RouterMode::kPush ? "push" : "pull"; }

// The engines' kv_mode values a router in `m` can use (pull-inline differs from pull only
// inside decode's connector).
bool kv_mode_serves(const std::string& kv_mode, RouterMode m) {
    return m == RouterMode::kPush ? kv_mode == "push"
                                  : kv_mode == "pull" || kv_mode == "pull-inline";
}

void send_error(HttpReply& reply, int status, const std::string& message) {
    reply.status = status;
    reply.body = http_error_body(status, message);
}

// An engine's error body carries {"error": {"message": ...}}; keep its message, say which leg.
std::string leg_message(const std::string& leg, const EngineAddress& a, int status,
                        const std::string& body) {
    // Any shape: an engine of another make passed the probe with a message of 5 or null, and
    // value() threw out of the handler (a 500 naming nlohmann's exception).
    const std::string msg = bounded(error_message_of(body));
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

// The setting that lists the engines of a role (what `ferry serve router` calls --prefill and
// --decode).
const char* engines_setting(bool prefill) {
    return prefill ? "RouterConfig::prefill" : "RouterConfig::decode";
}

// A leg given up for want of its first byte (RouterConfig::leg_answer_timeout).
std::string unanswered_leg(const char* leg, const EngineAddress& a, Duration timeout,
                           const SettingNames& names) {
    return fmt::format(
        "{} engine {} did not answer its leg within {} s ({}): it answers /health but not its "
        "legs (wedged, or queued beyond the limit)",
        leg, a.to_string(), to_ms(timeout) / 1000, setting_name(names, "leg_answer_timeout"));
}

// A number of an engine's ferry_timing, 0 when absent or not a number (value() throws then).
double number_in(const json& o, const char* key) {
    if (!o.is_object()) return 0;
    auto it = o.find(key);
    return it != o.end() && it->is_number() ? it->get<double>() : 0;
}

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

// What the engines check of a request, read from a body scan_completion_request accepted (so
// its fields are well formed): the prompt's length and largest id, and max_tokens.
struct RequestShape {
    size_t prompt_tokens = 0;
    int64_t max_id = -1;
    size_t max_tokens = GenerateRequest{}.max_tokens;
};

RequestShape shape_of(const JsonObjectText& body) {
    RequestShape s;
    if (const JsonMember* m = body.find("max_tokens")) {
        json v = parse_json_value(m->value);
        if (v.is_number_integer() && v.get<int64_t>() > 0) s.max_tokens = v.get<size_t>();
    }
    const JsonMember* p = body.find("prompt");
    if (p == nullptr || p->value.empty()) return s;
    if (p->value[0] == '[') {
        // Counted in the text, never built: the ids were checked by the scan.
        int64_t id = -1;
        for (char c : p->value) {
            if (c >= '0' && c <= '9') {
                id = std::min<int64_t>((id < 0 ? 0 : id) * 10 + (c - '0'), INT64_MAX / 16);
            } else if (id >= 0) {
                s.prompt_tokens++;
                s.max_id = std::max(s.max_id, id);
                id = -1;
            }
        }
        return s;
    }
    json v = parse_json_value(p->value);
    if (!v.is_string()) return s;
    for (int32_t t : tokenize(v.get<std::string>())) {
        s.prompt_tokens++;
        s.max_id = std::max<int64_t>(s.max_id, t);
    }
    return s;
}

// Engine::submit's checks, against one engine's limits from its /health (0: unknown, not
// checked). A prefill leg computes the prompt and one token.
Status check_limits(const RequestShape& r, const Router::EngineState& e, bool prefill) {
    const char* role = prefill ? "prefill" : "decode";
    const std::string name = e.address.to_string();
    size_t gen = prefill ? 1 : r.max_tokens;
    if (e.max_model_len > 0 && r.prompt_tokens + gen > e.max_model_len)
        return invalid_argument(
            prefill ? fmt::format("prompt ({} tokens) plus one token exceeds max_model_len {} of "
                                  "prefill engine {}",
                                  r.prompt_tokens, e.max_model_len, name)
                    : fmt::format("prompt ({} tokens) plus max_tokens ({}) exceeds max_model_len "
                                  "{} of decode engine {}",
                                  r.prompt_tokens, r.max_tokens, e.max_model_len, name));
    if (e.vocab > 0 && r.max_id >= int64_t(e.vocab))
        return invalid_argument(
            fmt::format("prompt: token id {} outside the vocabulary [0, {}) of "
                        "{} engine {}",
                        r.max_id, e.vocab, role, name));
    if (e.block_size > 0 && e.blocks_total > 0) {
        size_t tokens = prefill ? r.prompt_tokens : r.prompt_tokens + std::max<size_t>(gen, 1) - 1;
        size_t need = kv::blocks_for_tokens(uint32_t(tokens), uint32_t(e.block_size));
        if (need > e.blocks_total)
            return invalid_argument(
                fmt::format("{}: the request needs {} KV blocks, the pool of {} engine {} has {}",
                            prefill ? "prompt" : "max_tokens", need, role, name, e.blocks_total));
    }
    return ok_status();
}

// A request for vLLM engines, checked for what the router itself reads (stream) and for the
// member its legs cannot go without (prompt, messages); everything else is vLLM's to check, and
// its 400 reaches the client. The client's kv_transfer_params are replaced by the router's.
Result<CompletionRelayBody> scan_vllm_request(std::string_view body, bool chat) {
    auto object = scan_json_object(body);
    if (!object.ok()) return object.status();
    CompletionRelayBody out{std::move(object).value()};
    if (const JsonMember* m = out.object.find("stream")) {
        json v = parse_json_value(m->value);
        if (!v.is_boolean() && !v.is_null())
            return invalid_argument(fmt::format("stream: must be true or false, not {}",
                                                bounded(std::string(m->value))));
        out.stream = v.is_boolean() && v.get<bool>();
    }
    const char* need = chat ? "messages" : "prompt";
    const JsonMember* m = out.object.find(need);
    const char first = m == nullptr || m->value.empty() ? '\0' : m->value[0];
    if (m == nullptr)
        return invalid_argument(fmt::format("{}: missing; {} takes {}", need,
                                            chat ? "/v1/chat/completions" : "/v1/completions",
                                            chat ? "a list of messages" : "a prompt"));
    if (chat ? first != '[' : first != '"' && first != '[')
        return invalid_argument(chat ? "messages: must be a list of messages"
                                     : "prompt: must be a string, a list of strings or a list "
                                       "of token ids");
    return out;
}

}  // namespace

Result<std::unique_ptr<Router>> Router::start(RouterConfig config) {
    if (config.prefill.empty() || config.decode.empty())
        return invalid_argument("the router needs at least one prefill and one decode engine");
    if (config.secret.empty() && config.engines == EngineKind::kFerry)
        return invalid_argument("the router needs the deployment secret to sign legs with");
    std::unique_ptr<Router> r(new Router());
    r->config_ = std::move(config);
    r->nonce_ = fmt::format("{:08x}", std::random_device{}());
    for (const auto& a : r->config_.prefill) r->prefill_state_.push_back({.address = a});
    for (const auto& a : r->config_.decode) r->decode_state_.push_back({.address = a});
    Router* p = r.get();
    std::vector<HttpRoute> routes;
    routes.push_back({"POST", "/v1/completions", [p](const HttpRequest& req, HttpReply& reply) {
                          p->completions(req, reply, "/v1/completions");
                      }});
    if (r->config_.engines == EngineKind::kVllm)
        routes.push_back(
            {"POST", "/v1/chat/completions", [p](const HttpRequest& req, HttpReply& reply) {
                 p->completions(req, reply, "/v1/chat/completions");
             }});
    // Both read the prober's state and counters: quick, answered while streams hold every worker.
    routes.push_back(
        {"GET", "/health", [p](const HttpRequest&, HttpReply& reply) { p->health(reply); }, true});
    routes.push_back({"GET", "/metrics",
                      [p](const HttpRequest&, HttpReply& reply) {
                          reply.content_type = "text/plain; version=0.0.4";
                          reply.body = p->prometheus_text();
                      },
                      true});
    r->prober_thread_ = std::thread([p] {
        set_thread_name("ferry-probe");
        p->prober();
    });
    r->aborts_ = std::make_unique<WorkerQueue>(
        WorkerQueue::Options{.thread_name = "ferry-abort",
                             .capacity = r->config_.abort_queue,
                             .at_stop = WorkerQueue::AtStop::kDropQueued});
    // On failure the destructor stops and joins the threads.
    FERRY_ASSIGN_OR_RETURN(r->http_, HttpServer::start(r->config_.http, std::move(routes)));
    return r;
}

Router::~Router() { stop(); }

void Router::stop() {
    // Requests first (they may still queue aborts), then the background threads; aborts still
    // queued are dropped: the engines' leases free what they would have.
    if (http_) http_->stop();
    {
        std::lock_guard lock(bg_mu_);
        bg_stop_ = true;
    }
    bg_cv_.notify_all();
    if (prober_thread_.joinable()) prober_thread_.join();
    if (aborts_) aborts_->stop();
}

Router::EngineState Router::probe_vllm(EngineState st, int health_status, const json& j,
                                       bool prefill) const {
    const EngineAddress& a = st.address;
    // ferry's own engines and routers answer /health with a JSON object naming their role.
    if (!j.is_discarded() && j.is_object() && j.contains("role") && j["role"].is_string()) {
        const std::string role = bounded(j["role"].get<std::string>());
        st.why = role == "router"
                     ? fmt::format(
                           "this is a ferry router, not a vLLM engine: {} takes the engines' "
                           "addresses",
                           setting(engines_setting(prefill)))
                     : fmt::format(
                           "this is ferry's own {} engine (ferry serve), not a vLLM engine: start "
                           "the router with {} ferry",
                           role, setting("RouterConfig::engines"));
        return st;
    }
    if (health_status != 200) {
        st.why = fmt::format("/health answered HTTP {}", health_status);
        return st;
    }
    auto m = http_get(a.host, a.port, "/metrics", config_.probe_timeout);
    if (!m.ok()) {
        // The engine answered /health: alive, not down (vLLM renders /metrics in the API
        // server's Python, which a loaded 2-core CI host left unanswered for over 5 s).
        st.why = bounded(m.status().with_context("/metrics").to_string());
        st.metrics_late = true;
        return st;
    }
    auto info = parse_vllm_connector_info(m->body);
    if (m->status != 200 || !info.ok()) {
        st.why = m->status != 200 ? fmt::format("/metrics answered HTTP {}", m->status)
                                  : info.status().message();
        return st;
    }
    // Only a prefill engine's mode matters: it is what its prefill requests do; a decode engine
    // follows each request's kv_transfer_params.
    if (prefill && info->mode != mode_name(config_.mode)) {
        st.why = fmt::format(
            "transfer modes differ: the engine's FerryConnector runs \"mode\":\"{}\" (its "
            "--kv-transfer-config kv_connector_extra_config), this router {} {}; give the "
            "prefill engines and the router one mode",
            info->mode, setting("RouterConfig::mode"), mode_name(config_.mode));
        return st;
    }
    // A side channel listening on every address is reached at the engine's own.
    if (info->host == "0.0.0.0" || info->host == "::") info->host = a.host;
    st.vllm = std::move(info).value();
    st.engine_id = a.to_string();
    st.ready = true;
    return st;
}

Router::EngineState Router::probe(const EngineAddress& a, bool prefill) const {
    EngineState st{.address = a, .probed = true};
    auto h = http_get(a.host, a.port, "/health", config_.probe_timeout);
    if (!h.ok()) {
        st.why = bounded(h.status().message());
        st.unanswered = 1;
        return st;
    }
    json j = json::parse(h->body, nullptr, false);
    if (config_.engines == EngineKind::kVllm)
        return probe_vllm(std::move(st), h->status, j, prefill);
    if (j.is_discarded() || !j.is_object()) {
        // vLLM's /health answers 200 with an empty body.
        st.why = fmt::format(
            "/health answered HTTP {} without a JSON object: not a ferry engine (a vLLM engine? "
            "start the router with {} vllm)",
            h->status, setting("RouterConfig::engines"));
        return st;
    }
    auto text = [&](const char* key) {
        return j.contains(key) && j[key].is_string() ? bounded(j[key].get<std::string>())
                                                     : std::string();
    };
    // What the engine says it is, checked before its readiness: a router, an engine of the other
    // role or of another KV mode stays unusable whatever its state (a push router in front of
    // pull engines hung every request for the whole lease, then answered 504).
    const char* role = prefill ? "prefill" : "decode";
    const std::string their_role = text("role"), kv_mode = text("kv_mode");
    if (their_role == "router") {
        st.why = fmt::format(
            "{}, not a {} engine: {} takes the engines' addresses (a router sending legs to a "
            "router would loop)",
            text("router_id") == nonce_ ? "this is the router itself" : "this is another router",
            role, setting(engines_setting(prefill)));
        return st;
    }
    if (!their_role.empty() && their_role != role) {
        st.why = their_role == "prefill" || their_role == "decode"
                     ? fmt::format("a {} engine given as a {} engine: move it to {}", their_role,
                                   role, setting(engines_setting(their_role == "prefill")))
                     : fmt::format("its /health says role '{}', not {}", their_role, role);
        return st;
    }
    if (!kv_mode.empty() && !kv_mode_serves(kv_mode, config_.mode)) {
        st.why = fmt::format(
            "transfer modes differ: the engine runs {} {}, this router {} {}; start every engine "
            "and the router with one mode",
            setting("kv_mode"), kv_mode, setting("RouterConfig::mode"), mode_name(config_.mode));
        return st;
    }
    auto size = [&](const char* key) {
        return j.contains(key) && j[key].is_number_unsigned() ? j[key].get<size_t>() : size_t(0);
    };
    st.max_model_len = size("max_model_len");
    st.vocab = size("vocab");
    st.block_size = size("block_size");
    st.blocks_total = size("kv_blocks_total");
    if (j.contains("engine_id") && j["engine_id"].is_string())
        st.engine_id = j["engine_id"].get<std::string>();
    st.incarnation = text("incarnation");
    if (h->status != 200) {
        const std::string reason = text("reason");
        st.why = fmt::format("/health answered HTTP {}: {}", h->status,
                             reason.empty() ? std::string("not ready") : reason);
    } else if (st.engine_id.empty()) {
        st.why = "/health names no engine_id";
    } else {
        st.ready = true;
    }
    return st;
}

void Router::store(bool prefill, size_t index, EngineState st) {
    std::lock_guard lock(state_mu_);
    auto& states = prefill ? prefill_state_ : decode_state_;
    if (st.unanswered > 0) st.unanswered += states[index].unanswered;
    // A vLLM engine whose /metrics came late keeps what its last answer said (its connector's
    // mode and side channel do not change while the process lives; a restart is another
    // process, whose /metrics is read once it answers).
    const EngineState& last = states[index];
    if (st.metrics_late && last.ready && !last.vllm.mode.empty()) {
        st.vllm = last.vllm;
        st.engine_id = last.engine_id;
        st.ready = true;
        st.why.clear();
    }
    // What the legs saw outlives the probe: an engine that answers /health may still leave its
    // legs unanswered.
    st.leg_timeouts = states[index].leg_timeouts;
    st.legs_down_until = states[index].legs_down_until;
    if (Clock::now() < st.legs_down_until && st.ready) {
        st.ready = false;
        st.why = fmt::format("{} legs in a row got no answer within the leg answer timeout",
                             st.leg_timeouts);
    }
    if (st.unanswered == config_.down_after_unanswered)
        log(LogLevel::kWarn, "router",
            "{} engine {} is down ({} health checks in a row unanswered): failing the requests "
            "in flight to it",
            prefill ? "prefill" : "decode", st.address.to_string(), st.unanswered);
    else if (!st.ready && states[index].ready)
        log(LogLevel::kWarn, "router", "{} engine {} is not ready: {}",
            prefill ? "prefill" : "decode", st.address.to_string(), st.why);
    states[index] = std::move(st);
}

void Router::refresh_if_restarted(int http_status, const std::string& body, const EngineAddress& P,
                                  const EngineAddress& D) {
    if (http_status != 403 || body.find(kOtherIncarnation) == std::string::npos) return;
    log(LogLevel::kInfo, "router",
        "a leg to {} or {} was refused as signed for an engine's previous incarnation (it "
        "restarted): their /health is read again now",
        P.to_string(), D.to_string());
    for (bool prefill : {true, false}) {
        const EngineAddress& engine = prefill ? P : D;
        const auto& addrs = prefill ? config_.prefill : config_.decode;
        for (size_t i = 0; i < addrs.size(); ++i)
            if (addrs[i].host == engine.host && addrs[i].port == engine.port)
                store(prefill, i, probe(addrs[i], prefill));
    }
}

bool Router::leg_overdue(TimePoint sent) const {
    return config_.leg_answer_timeout > Duration::zero() &&
           Clock::now() - sent >= config_.leg_answer_timeout;
}

void Router::note_leg_answer(bool prefill, const EngineAddress& engine, bool answered) {
    if (config_.leg_answer_timeout <= Duration::zero()) return;
    std::lock_guard lock(state_mu_);
    auto& states = prefill ? prefill_state_ : decode_state_;
    for (EngineState& e : states) {
        if (e.address.host != engine.host || e.address.port != engine.port) continue;
        if (answered) {
            e.leg_timeouts = 0;
            continue;
        }
        if (++e.leg_timeouts < config_.down_after_leg_timeouts) continue;
        e.legs_down_until = Clock::now() + config_.legs_down_period;
        e.ready = false;
        e.why = fmt::format("{} legs in a row got no answer within the leg answer timeout ({} s)",
                            e.leg_timeouts, to_ms(config_.leg_answer_timeout) / 1000);
        log(LogLevel::kWarn, "router",
            "{} engine {} is down for {} s: {} legs in a row unanswered within {} s (it answers "
            "/health): failing the requests in flight to it",
            prefill ? "prefill" : "decode", engine.to_string(),
            to_ms(config_.legs_down_period) / 1000, e.leg_timeouts,
            to_ms(config_.leg_answer_timeout) / 1000);
    }
}

std::string Router::down_reason(const EngineAddress& engine) const {
    std::lock_guard lock(state_mu_);
    TimePoint now = Clock::now();
    for (const auto* states : {&prefill_state_, &decode_state_}) {
        for (const EngineState& e : *states) {
            if (e.address.host != engine.host || e.address.port != engine.port) continue;
            if (now < e.legs_down_until)
                return fmt::format(
                    "{} engine {} is down: {} legs in a row got no answer within {} s ({}) "
                    "although it answers /health; the request is failed rather than held until "
                    "it answers",
                    states == &prefill_state_ ? "prefill" : "decode", engine.to_string(),
                    e.leg_timeouts, to_ms(config_.leg_answer_timeout) / 1000,
                    setting("leg_answer_timeout"));
            if (e.unanswered < config_.down_after_unanswered) continue;
            return fmt::format(
                "{} engine {} is down: {} health checks in a row unanswered (last: {}); the "
                "request is failed rather than held until it answers",
                states == &prefill_state_ ? "prefill" : "decode", engine.to_string(), e.unanswered,
                e.why);
        }
    }
    return {};
}

void Router::prober() {
    std::unique_lock lock(bg_mu_);
    while (!bg_stop_) {
        lock.unlock();
        for (size_t i = 0; i < config_.prefill.size(); ++i)
            store(true, i, probe(config_.prefill[i], true));
        for (size_t i = 0; i < config_.decode.size(); ++i)
            store(false, i, probe(config_.decode[i], false));
        lock.lock();
        bg_cv_.wait_for(lock, config_.probe_period, [&] { return bg_stop_; });
    }
}

Router::EngineState Router::pick(bool prefill) {
    const auto& addrs = prefill ? config_.prefill : config_.decode;
    uint64_t start = (prefill ? next_prefill_ : next_decode_)++;
    size_t chosen = start % addrs.size();
    {
        std::lock_guard lock(state_mu_);
        const auto& states = prefill ? prefill_state_ : decode_state_;
        for (size_t i = 0; i < addrs.size(); ++i) {
            size_t k = (start + i) % addrs.size();
            if (states[k].ready) {
                chosen = k;
                break;
            }
        }
        if (states[chosen].ready) return states[chosen];
    }
    // None known ready: ask now, it may have come up since the last probe. What is stored, as
    // store() keeps an engine whose legs went unanswered out whatever its /health says.
    store(prefill, chosen, probe(addrs[chosen], prefill));
    std::lock_guard lock(state_mu_);
    return (prefill ? prefill_state_ : decode_state_)[chosen];
}

void Router::health(HttpReply& reply) const {
    std::lock_guard lock(state_mu_);
    // role and router_id: a router given a router as an engine (itself included) says so.
    json out = {{"role", "router"},
                {"router_id", nonce_},
                {"mode", mode_name(config_.mode)},
                {"engines", config_.engines == EngineKind::kVllm ? "vllm" : "ferry"}};
    std::string reason;
    auto role = [&](const char* name, const std::vector<EngineState>& states) {
        json list = json::array();
        bool any = false;
        std::string missing;
        for (const EngineState& e : states) {
            json one = {{"engine", e.address.to_string()}, {"ready", e.ready}};
            if (!e.incarnation.empty()) one["incarnation"] = e.incarnation;
            if (!e.vllm.mode.empty())
                one["connector"] = {
                    {"mode", e.vllm.mode},
                    {"side_channel", fmt::format("{}:{}", e.vllm.host, e.vllm.port)},
                    {"tp_size", e.vllm.tp_size}};
            std::string why = e.probed ? e.why : "not probed yet";
            if (!e.ready) {
                one["reason"] = why;
                missing += fmt::format("{}{} ({})", missing.empty() ? "" : ", ",
                                       e.address.to_string(), why);
            }
            any = any || e.ready;
            list.push_back(std::move(one));
        }
        out[name] = std::move(list);
        if (!any)
            reason += fmt::format("{}no {} engine is ready: {}", reason.empty() ? "" : "; ", name,
                                  missing);
    };
    role("prefill", prefill_state_);
    role("decode", decode_state_);
    if (reason.empty()) {
        out["status"] = "ok";
    } else {
        reply.status = 503;
        out["status"] = "unavailable";
        out["reason"] = reason;
    }
    reply.body = out.dump();
}

void Router::abort_leg(const EngineAddress& engine, const std::string& transfer_id,
                       const std::string& reason) {
    // vLLM has no /ferry/abort: its request ends when the leg's connection closes (the callers
    // cancel it), and a pull offer nobody reads when prefill's lease ends.
    if (config_.engines == EngineKind::kVllm) return;
    // A down engine would hold the one sender for abort_timeout per abort, delaying those to
    // the engines that answer (prefill's blocks for the requests failed with it); what the
    // down engine holds, its lease (or its client connection closing) frees.
    if (!down_reason(engine).empty()) {
        aborts_dropped_++;
        return;
    }
    const bool queued = aborts_ && aborts_->post([this, engine, transfer_id, reason] {
        send_abort(engine, transfer_id, reason);
    });
    if (!queued) aborts_dropped_++;
}

void Router::send_abort(const EngineAddress& engine, const std::string& transfer_id,
                        const std::string& reason) {
    // Engines take abort bodies of at most kMaxAbortBodyBytes.
    json body = {{"transfer_id", transfer_id},
                 {"reason", reason.substr(0, kMaxAbortReasonBytes)},
                 {"ferry_auth", abort_tag(config_.secret, transfer_id)}};
    auto r = http_post_json(engine.host, engine.port, "/ferry/abort", body.dump(),
                            config_.abort_timeout);
    if (r.ok() && r->status == 200) {
        aborts_sent_++;
    } else {
        aborts_dropped_++;
        log(LogLevel::kInfo, "router", "abort of transfer {} on {} not delivered: {}", transfer_id,
            engine.to_string(),
            r.ok() ? fmt::format("HTTP {}", r->status) : r.status().to_string());
    }
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
    render_counter(out, "ferry_router_rejected_before_legs_total",
                   "requests refused against the engines' limits before any leg left",
                   double(rejected_early_));
    render_counter(out, "ferry_router_aborts_sent_total",
                   "legs aborted on their engine after the other leg failed or the client left",
                   double(aborts_sent_));
    render_counter(out, "ferry_router_aborts_dropped_total",
                   "aborts not delivered (queue full, engine unreachable, stopping)",
                   double(aborts_dropped_));
    overhead_.render(out, "ferry_router_overhead_seconds",
                     "time the router itself adds before the legs leave and to the first token");
    return out;
}

void Router::completions(const HttpRequest& req, HttpReply& reply, const char* path) {
    TimePoint t0 = Clock::now();
    requests_++;
    auto fail = [&](int status, const std::string& message) {
        failures_++;
        send_error(reply, status, message);
    };
    auto client_gone = [&req] { return req.client_gone && req.client_gone(); };
    const bool vllm = config_.engines == EngineKind::kVllm;
    auto scanned = vllm ? scan_vllm_request(req.body, std::string_view(path) != "/v1/completions")
                        : scan_completion_request(req.body);
    if (!scanned.ok()) return fail(400, scanned.status().to_string());
    const JsonObjectText& body = scanned->object;
    bool stream = scanned->stream;

    const EngineState P_state = pick(true);
    if (!P_state.ready)
        return fail(503, fmt::format("prefill engine {} is not ready: {}",
                                     P_state.address.to_string(), P_state.why));
    const EngineState D_state = pick(false);
    if (!D_state.ready)
        return fail(503, fmt::format("decode engine {} is not ready: {}",
                                     D_state.address.to_string(), D_state.why));
    const EngineAddress& P = P_state.address;
    const EngineAddress& D = D_state.address;
    const std::string* pid = &P_state.engine_id;
    // What decode would refuse is refused here, before prefill computes and pins blocks for a
    // leg nobody will read (issue 19).
    // (vLLM's engines state no limits; they check their requests themselves.)
    RequestShape shape = shape_of(body);
    for (Status st : {check_limits(shape, P_state, true), check_limits(shape, D_state, false)}) {
        if (st.ok()) continue;
        rejected_early_++;
        return fail(400, st.to_string());
    }
    const uint64_t transfer_number = next_transfer_++;
    // vLLM's connector takes integer ids in [1, 2^63): this router's nonce above a counter.
    const uint64_t vllm_tid =
        std::max<uint64_t>(1, ((std::stoull(nonce_, nullptr, 16) & 0x7fffffffULL) << 32) |
                                  (transfer_number & 0xffffffffULL));
    std::string tid =
        vllm ? std::to_string(vllm_tid) : fmt::format("{}-{}", nonce_, transfer_number);
    TimePoint deadline = t0 + config_.request_timeout;
    // The engines hold a leg's blocks until its KV moved or the lease ends; a leg whose other
    // half failed, or whose client left, is aborted so they come back at once.
    auto abort_prefill = [&](const std::string& why) { abort_leg(P, tid, why); };
    auto abort_decode = [&](const std::string& why) { abort_leg(D, tid, why); };
    auto abort_both = [&](const std::string& why) {
        abort_prefill(why);
        abort_decode(why);
    };

    // Both legs are the client's body with a few fields set; everything else, the prompt above
    // all, is copied as it came.
    // Each leg's tag binds the prompt, the leg's max_tokens and the engine it goes to (its id
    // and, as last probed, its incarnation), and expires leg_ttl after it was signed
    // (kv_params_auth.h).
    const Digest prompt = prompt_digest(scanned->prompt);
    auto leg_tag_expiry = [this] { return unix_ms_now() + int64_t(to_ms(config_.leg_ttl)); };
    json prefill_kv = {{"do_remote_decode", true},
                       {"transfer_id", tid},
                       {"remote_host", D.host},
                       {"remote_port", D.port}};
    json decode_kv = {{"do_remote_prefill", true},
                      {"transfer_id", tid},
                      {"remote_engine_id", *pid},
                      {"remote_host", P.host},
                      {"remote_port", P.port}};
    json prefill_fields = {{"max_tokens", 1}, {"stream", false}};
    if (vllm) {
        // FerryConnector's names (docs/VLLM.md): prefill's mode said, so that it never depends
        // on the engine's default; in push, decode registers with prefill's side channel.
        prefill_kv = {{"do_remote_decode", true},
                      {"ferry_transfer_id", vllm_tid},
                      {"ferry_mode", mode_name(config_.mode)}};
        decode_kv = {{"do_remote_prefill", true},
                     {"ferry_transfer_id", vllm_tid},
                     {"remote_host", P_state.vllm.host},
                     {"remote_port", P_state.vllm.port},
                     {"remote_tp_size", P_state.vllm.tp_size}};
        // What vLLM refuses beside max_tokens 1 and no stream: stream_options without a stream,
        // min_tokens above max_tokens; max_completion_tokens wins over max_tokens (chat).
        if (body.find("stream_options")) prefill_fields["stream_options"] = nullptr;
        if (body.find("min_tokens")) prefill_fields["min_tokens"] = 0;
        if (body.find("max_completion_tokens")) prefill_fields["max_completion_tokens"] = 1;
    } else if (Status st = sign_kv_params_json(config_.secret, &prefill_kv,
                                               leg_content_digest({prompt, 1, P_state.engine_id}),
                                               leg_tag_expiry(), P_state.incarnation);
               !st.ok()) {
        return fail(500, st.to_string());
    }
    prefill_fields["kv_transfer_params"] = prefill_kv;
    std::string prefill_body = body.with(prefill_fields);

    auto prefill_call = std::make_shared<std::unique_ptr<HttpStream>>();
    auto prefill = std::make_shared<Collected>();
    TimePoint prefill_sent = Clock::now();
    double overhead_ms = 0;
    TimePoint prefill_answered = prefill_sent;
    if (config_.mode == RouterMode::kPush) {
        *prefill_call = HttpStream::post(P.host, P.port, path, std::move(prefill_body),
                                         config_.request_timeout);
    } else {
        overhead_ms += to_ms(prefill_sent - t0);
        // In slices, watching the client and the engine: a prefill declared down (frozen)
        // held the client until request_timeout.
        auto call = HttpStream::post(P.host, P.port, path, std::move(prefill_body),
                                     config_.request_timeout);
        std::string down;
        bool overdue = false;
        while (!prefill->ended && Clock::now() < deadline && !client_gone() &&
               (down = down_reason(P)).empty() &&
               !(overdue = prefill->body.empty() && leg_overdue(prefill_sent)))
            poll(*call, *prefill, std::min(deadline, Clock::now() + milliseconds(20)));
        prefill_answered = Clock::now();
        if (overdue) {
            call->cancel();
            prefill_failures_++;
            note_leg_answer(true, P, false);
            abort_prefill("the prefill leg did not answer in time");
            return fail(504, unanswered_leg("prefill", P, config_.leg_answer_timeout,
                                            config_.http.setting_names));
        }
        if (prefill->ended && prefill->status.ok()) note_leg_answer(true, P, true);
        if (!prefill->ended || !prefill->status.ok()) {
            call->cancel();
            if (prefill->status.ok() && down.empty() && client_gone()) {
                abort_prefill("the client went away");
                return fail(499, "the client went away");
            }
            prefill_failures_++;
            // A transport failure (timeout, reset) says nothing of the leg: it may still run.
            abort_prefill("the router lost the prefill leg");
            if (!down.empty()) return fail(502, down);
            return fail(502, fmt::format("prefill leg on {} failed: {}", P.to_string(),
                                         prefill->status.ok() ? std::string("deadline")
                                                              : prefill->status.to_string()));
        }
        if (prefill->http != 200) {
            prefill_failures_++;
            refresh_if_restarted(prefill->http, prefill->body, P, D);
            int st = prefill->http ? prefill->http : 502;
            return fail(st, leg_message("prefill", P, st, prefill->body));
        }
        json pj = json::parse(prefill->body, nullptr, false);
        if (pj.is_discarded() || !pj.contains("kv_transfer_params") ||
            !pj["kv_transfer_params"].is_object()) {
            prefill_failures_++;
            abort_prefill("the prefill answer had no kv_transfer_params");
            return fail(502, fmt::format("prefill leg on {} returned no kv_transfer_params",
                                         P.to_string()));
        }
        if (client_gone()) {
            abort_prefill("the client went away");  // the offered blocks, held under the lease
            return fail(499, "the client went away");
        }
        // vLLM's connector answers the decode leg's parameters whole: passed unchanged.
        decode_kv = pj["kv_transfer_params"];
        if (!vllm) {
            decode_kv["do_remote_prefill"] = true;
            decode_kv["do_remote_decode"] = false;
            decode_kv["transfer_id"] = tid;
        }
    }
    if (Status st = vllm ? ok_status()
                         : sign_kv_params_json(
                               config_.secret, &decode_kv,
                               leg_content_digest({prompt, scanned->max_tokens, D_state.engine_id}),
                               leg_tag_expiry(), D_state.incarnation);
        !st.ok()) {
        abort_prefill("the decode leg could not be signed");
        return fail(502, st.with_context("kv_transfer_params for the decode leg").to_string());
    }
    TimePoint decode_sent = Clock::now();
    auto decode_call = std::shared_ptr<HttpStream>(
        HttpStream::post(D.host, D.port, path, body.with({{"kv_transfer_params", decode_kv}}),
                         config_.request_timeout));
    // Router time before the legs left: all of it in push; in pull, before the prefill leg and
    // between its answer and the decode leg.
    overhead_ms += config_.mode == RouterMode::kPush ? ms_since(t0) : ms_since(prefill_answered);

    // Wait for the decode leg's first bytes, watching the prefill leg and the client
    // meanwhile: a failed prefill means the KV will never come, so the client hears now and
    // decode is closed.
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
            abort_both("the decode leg failed");
            return fail(502, fmt::format("decode leg on {} failed: {}", D.to_string(),
                                         r.status().to_string()));
        }
        if (client_gone()) {
            decode_call->cancel();
            if (*prefill_call) (*prefill_call)->cancel();
            abort_both("the client went away");
            return fail(499, "the client went away");
        }
        // An engine that answers /health but not its legs: prefill first in push (decode's
        // first token waits for its KV).
        bool prefill_overdue =
            *prefill_call && !prefill->ended && prefill->body.empty() && leg_overdue(prefill_sent);
        if (prefill_overdue || leg_overdue(decode_sent)) {
            (prefill_overdue ? prefill_failures_ : decode_failures_)++;
            note_leg_answer(prefill_overdue, prefill_overdue ? P : D, false);
            decode_call->cancel();
            if (*prefill_call) (*prefill_call)->cancel();
            abort_both(prefill_overdue ? "the prefill leg did not answer in time"
                                       : "the decode leg did not answer in time");
            return fail(504, prefill_overdue
                                 ? unanswered_leg("prefill", P, config_.leg_answer_timeout,
                                                  config_.http.setting_names)
                                 : unanswered_leg("decode", D, config_.leg_answer_timeout,
                                                  config_.http.setting_names));
        }
        // An engine declared down (a frozen process accepts connections and answers nothing)
        // would hold the client until request_timeout.
        if (std::string down = down_reason(D); !down.empty()) {
            decode_failures_++;
            decode_call->cancel();
            if (*prefill_call) (*prefill_call)->cancel();
            abort_prefill("the decode engine is down");
            return fail(502, down);
        }
        if (*prefill_call && !prefill->ended) {
            if (std::string down = down_reason(P); !down.empty()) {
                prefill_failures_++;
                decode_call->cancel();
                (*prefill_call)->cancel();
                abort_decode("the prefill engine is down");
                return fail(502, down);
            }
            poll(**prefill_call, *prefill, Clock::now());
            if (prefill->ended && (!prefill->status.ok() || prefill->http != 200)) {
                prefill_failures_++;
                if (prefill->status.ok()) refresh_if_restarted(prefill->http, prefill->body, P, D);
                decode_call->cancel();
                // Closing the decode leg is not seen by an engine still waiting for KV.
                abort_decode("prefill leg failed");
                if (!prefill->status.ok()) abort_prefill("the router lost the prefill leg");
                return fail(
                    prefill->status.ok() ? (prefill->http >= 400 ? prefill->http : 502) : 502,
                    prefill->status.ok() ? leg_message("prefill", P, prefill->http, prefill->body)
                                         : fmt::format("prefill leg on {} failed: {}",
                                                       P.to_string(), prefill->status.to_string()));
            }
        }
    }
    TimePoint first_at = Clock::now();
    // Decode answered; in push its first byte also means prefill computed the KV.
    note_leg_answer(false, D, true);
    if (config_.mode == RouterMode::kPush) note_leg_answer(true, P, true);
    if (decode_call->status() != 200) {
        decode_failures_++;
        // Decode refused or failed the leg: prefill's (computing, writing, or offered under the
        // lease) has no reader any more.
        abort_prefill(fmt::format("the decode leg failed with HTTP {}", decode_call->status()));
        Collected rest;
        rest.body = first;
        poll(*decode_call, rest, Clock::now() + seconds(5));
        if (*prefill_call) (*prefill_call)->cancel();
        int st = decode_call->status() ? decode_call->status() : 502;
        refresh_if_restarted(st, rest.body, P, D);
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
            t["prefill_queue_ms"] = number_in(pj["ferry_timing"], "queue_ms");
            t["prefill_compute_ms"] = number_in(pj["ferry_timing"], "prefill_ms");
            t["prefill_e2e_ms"] = number_in(pj["ferry_timing"], "e2e_ms");
        }
        t["prefill_leg_sent_ms"] = to_ms(prefill_sent - t0);
        if (decode_timing.is_object()) {
            t["decode_kv_wait_ms"] = number_in(decode_timing, "kv_wait_ms");
            t["decode_queue_ms"] = number_in(decode_timing, "queue_ms");
            t["decode_first_token_ms"] = number_in(decode_timing, "first_token_ms");
            t["decode_e2e_ms"] = number_in(decode_timing, "e2e_ms");
            t["decode_prefill_wait_ms"] = number_in(decode_timing, "prefill_wait_ms");
            t["decode_wait_ms"] = number_in(decode_timing, "decode_wait_ms");
            // KV complete at decode minus prefill's compute end, on the engines' wall clocks.
            double kv_at = number_in(decode_timing, "kv_ready_unix_ms");
            double computed_at = pj.is_discarded() || !pj.contains("ferry_timing")
                                     ? 0.0
                                     : number_in(pj["ferry_timing"], "prefill_end_unix_ms");
            if (kv_at > 0 && computed_at > 0) t["transfer_wait_ms"] = kv_at - computed_at;
        }
        t["router_e2e_ms"] = ms_since(t0);
        return t;
    };

    if (!stream) {
        Collected rest;
        rest.body = first;
        // In slices, so that a client that left, or decode declared down, is noticed within one.
        std::string down;
        while (!rest.ended && Clock::now() < deadline && !client_gone() &&
               (down = down_reason(D)).empty())
            poll(*decode_call, rest, std::min(deadline, Clock::now() + milliseconds(100)));
        if (!rest.ended || !rest.status.ok()) {
            decode_call->cancel();
            bool gone = rest.status.ok() && down.empty() && client_gone();
            abort_both(gone ? "the client went away" : "the decode leg broke off");
            if (gone) return fail(499, "the client went away");
            decode_failures_++;
            if (!down.empty()) return fail(502, down);
            return fail(502, fmt::format("decode leg on {} broke off: {}", D.to_string(),
                                         rest.status.ok() ? "deadline" : rest.status.to_string()));
        }
        reply.body = with_router_timing(rest.body, merged_timing);
        overhead_.observe((overhead_ms + ms_since(first_at)) / 1000);
        return;
    }

    reply.content_type = "text/event-stream";
    HttpServer* http = http_.get();
    // Runs after the handler returned: captures by value only.
    auto abort_later = [this, P, D, tid](const std::string& why) {
        abort_leg(P, tid, why);
        abort_leg(D, tid, why);
    };
    reply.stream = [this, decode_call, first, deadline, http, merged_timing, first_at, overhead_ms,
                    abort_later, D](const ChunkWriter& write) {
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
                    decode_call->cancel();  // client gone: the engines free the blocks
                    abort_later("the client went away");
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
                std::string down;
                if (r.status().code() == StatusCode::kTimeout && !http->stopping() &&
                    Clock::now() < deadline && (down = down_reason(D)).empty())
                    continue;
                decode_failures_++;
                failures_++;
                decode_call->cancel();
                abort_later(down.empty() ? "the decode leg broke off"
                                         : "the decode engine is down");
                write(sse_error_event(down.empty() ? r.status().with_context("decode leg")
                                                   : unavailable(down)));
                return;
            }
            if (!r->has_value()) return;  // decode finished its stream ([DONE] relayed)
            chunk = std::move(**r);
        }
    };
}

}  // namespace ferry::serve
