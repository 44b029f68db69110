#include "serve/openai_api.h"

#include <fmt/format.h>

#include <optional>

namespace ferry::serve {

using nlohmann::json;

std::vector<int32_t> tokenize(std::string_view text) {
    std::vector<int32_t> out;
    out.reserve(text.size());
    for (unsigned char c : text) out.push_back(int32_t(c));
    return out;
}

std::string token_text(int32_t token) { return fmt::format(" tok{}", token); }

namespace {

Status field_error(std::string_view field, std::string_view what) {
    return invalid_argument(fmt::format("'{}' {}", field, what));
}

double ms_between(TimePoint a, TimePoint b) {
    if (a == TimePoint{} || b == TimePoint{}) return 0;
    return to_ms(b - a);
}

// Wall-clock time of a steady-clock point, in ms since the epoch: what lets the router put
// events of two engines on one time line (exact on one host, as good as clock sync across).
double unix_ms(TimePoint t) {
    auto wall = std::chrono::system_clock::now() - (Clock::now() - t);
    return std::chrono::duration<double, std::milli>(wall.time_since_epoch()).count();
}

}  // namespace

Result<KvTransferParams> kv_params_from_json(const json& j) {
    KvTransferParams kv;
    if (j.is_null()) return kv;
    if (!j.is_object()) return field_error("kv_transfer_params", "must be an object");
    auto get_bool = [&](const char* name, bool* out) -> Status {
        if (!j.contains(name) || j[name].is_null()) return ok_status();
        if (!j[name].is_boolean())
            return field_error(std::string("kv_transfer_params.") + name, "must be true or false");
        *out = j[name].get<bool>();
        return ok_status();
    };
    auto get_string = [&](const char* name, std::string* out) -> Status {
        if (!j.contains(name) || j[name].is_null()) return ok_status();
        if (j[name].is_number_integer()) {
            *out = std::to_string(j[name].get<int64_t>());
            return ok_status();
        }
        if (!j[name].is_string())
            return field_error(std::string("kv_transfer_params.") + name, "must be a string");
        *out = j[name].get<std::string>();
        return ok_status();
    };
    auto get_int = [&](const char* name, int64_t lo, int64_t hi, int64_t* out) -> Status {
        if (!j.contains(name) || j[name].is_null()) return ok_status();
        if (!j[name].is_number_integer() || j[name].get<int64_t>() < lo ||
            j[name].get<int64_t>() > hi)
            return field_error(std::string("kv_transfer_params.") + name,
                               fmt::format("must be an integer in [{}, {}]", lo, hi));
        *out = j[name].get<int64_t>();
        return ok_status();
    };
    FERRY_RETURN_IF_ERROR(get_bool("do_remote_decode", &kv.do_remote_decode));
    FERRY_RETURN_IF_ERROR(get_bool("do_remote_prefill", &kv.do_remote_prefill));
    FERRY_RETURN_IF_ERROR(get_string("transfer_id", &kv.transfer_id));
    FERRY_RETURN_IF_ERROR(get_string("remote_engine_id", &kv.remote_engine_id));
    FERRY_RETURN_IF_ERROR(get_string("remote_host", &kv.remote_host));
    FERRY_RETURN_IF_ERROR(get_string("ferry_capability", &kv.capability));
    FERRY_RETURN_IF_ERROR(get_string("ferry_pull_keys", &kv.pull_keys));
    FERRY_RETURN_IF_ERROR(get_string("ferry_auth", &kv.auth));
    FERRY_RETURN_IF_ERROR(get_string("ferry_incarnation", &kv.incarnation));
    int64_t v = 0;
    FERRY_RETURN_IF_ERROR(get_int("remote_port", 0, 65535, &v));
    kv.remote_port = int(v);
    v = kv.tp_size;
    FERRY_RETURN_IF_ERROR(get_int("tp_size", 1, 1 << 16, &v));
    kv.tp_size = int(v);
    v = 0;
    FERRY_RETURN_IF_ERROR(get_int("attempt", 0, UINT32_MAX, &v));
    kv.attempt = uint32_t(v);
    FERRY_RETURN_IF_ERROR(get_int("ferry_expires", 0, INT64_MAX, &kv.expires_unix_ms));
    if (j.contains("remote_block_ids") && !j["remote_block_ids"].is_null()) {
        const json& ids = j["remote_block_ids"];
        if (!ids.is_array())
            return field_error("kv_transfer_params.remote_block_ids",
                               "must be an array of block ids");
        for (const json& b : ids) {
            if (!b.is_number_integer() || b.get<int64_t>() < 0 ||
                b.get<int64_t>() > int64_t(UINT32_MAX))
                return field_error("kv_transfer_params.remote_block_ids",
                                   "must hold non-negative integers");
            kv.remote_block_ids.push_back(BlockId(b.get<int64_t>()));
        }
    }
    return kv;
}

json kv_params_to_json(const KvTransferParams& kv) {
    json j = {{"do_remote_decode", kv.do_remote_decode},
              {"do_remote_prefill", kv.do_remote_prefill},
              {"remote_engine_id", kv.remote_engine_id},
              {"remote_block_ids", kv.remote_block_ids},
              {"remote_host", kv.remote_host},
              {"remote_port", kv.remote_port},
              {"tp_size", kv.tp_size}};
    if (!kv.transfer_id.empty()) j["transfer_id"] = kv.transfer_id;
    if (kv.attempt != 0) j["attempt"] = kv.attempt;
    if (!kv.capability.empty()) j["ferry_capability"] = kv.capability;
    if (!kv.pull_keys.empty()) j["ferry_pull_keys"] = kv.pull_keys;
    if (kv.expires_unix_ms != 0) j["ferry_expires"] = kv.expires_unix_ms;
    if (!kv.incarnation.empty()) j["ferry_incarnation"] = kv.incarnation;
    if (!kv.auth.empty()) j["ferry_auth"] = kv.auth;
    return j;
}

namespace {

// A UTF-8 byte-order mark some clients put before a body. nlohmann skips it and the router's
// scanner did not (it answered 400 where the engines answered 200): both paths drop it here.
std::string_view without_bom(std::string_view body) {
    if (body.starts_with("\xEF\xBB\xBF")) body.remove_prefix(3);
    return body;
}

// What a JSON value is, for a message; never its text (a deeply nested value would recurse).
const char* json_kind(const json& v) {
    if (v.is_string()) return "a string";
    if (v.is_number_float()) return "a number that is not an integer";
    if (v.is_boolean()) return "a boolean";
    if (v.is_null()) return "null";
    if (v.is_array()) return "an array";
    if (v.is_object()) return "an object";
    return "a value of another kind";
}

Status prompt_too_long(size_t tokens, size_t max_prompt_tokens) {
    return field_error("prompt", fmt::format("has {} tokens, more than the engine's "
                                             "max_model_len {}: shorten it",
                                             tokens, max_prompt_tokens));
}

// What a completion body may be built into. nlohmann's DOM costs 30-50 times its text: one
// 16 MiB body of 1.3 million members the API ignores held 600 MB in an engine (and its RSS
// stayed there), one of 8 million nested arrays 870 MB, so a few such requests at once took the
// host's memory. Members the API does not read are checked but not kept, a field that holds a
// number, a string or a boolean is refused before a container there is built, and nothing
// nests deeper than kMaxJsonDepth (the API's own fields nest 3 deep).
constexpr int kMaxJsonDepth = 16;

bool is_completion_field(std::string_view key) {
    return key == "prompt" || key == "max_tokens" || key == "stream" || key == "model" ||
           key == "n" || key == "kv_transfer_params";
}

// The rule of a field that takes no container, for its error; nullptr for the others.
const char* scalar_field_rule(std::string_view key) {
    if (key == "max_tokens") return "must be a positive integer";
    if (key == "stream") return "must be true or false";
    if (key == "model") return "must be a string";
    if (key == "n") return "must be 1: one completion per request";
    return nullptr;
}

// A whole body (`member` empty), or the value of its member `member` (the router parses the
// members it relays one by one), parsed under the rules above. Members not kept leave a body's
// object without them; a member's value not kept comes back discarded. A prompt array of more
// than `max_prompt_tokens` ids (0: no limit) is refused by its count, its ids past the limit
// never built (a 16 MiB body holds 8 million, 16 bytes each in the DOM).
Result<json> parse_request_json(std::string_view text, std::string_view member,
                                size_t max_prompt_tokens = 0) {
    Status refused = ok_status();
    std::string key(member);
    size_t prompt_ids = 0;  // elements of the last "prompt" (the last of a repeated key wins)
    const int base = member.empty() ? 0 : 1;  // a member's value sits at depth 1 of the body
    auto keep = [&](int depth, json::parse_event_t event, json& parsed) {
        depth += base;
        if (depth > kMaxJsonDepth) {
            if (refused.ok())
                refused = invalid_argument(
                    fmt::format("request body nests deeper than {} levels", kMaxJsonDepth));
            return false;
        }
        if (depth == 1 && event == json::parse_event_t::key) {
            key = parsed.get<std::string>();
            if (key == "prompt") prompt_ids = 0;
            return is_completion_field(key);
        }
        if (depth >= 1 && !is_completion_field(key)) return false;
        if (depth == 2 && key == "prompt" &&
            (event == json::parse_event_t::value || event == json::parse_event_t::object_start ||
             event == json::parse_event_t::array_start) &&
            ++prompt_ids > max_prompt_tokens && max_prompt_tokens > 0)
            return false;
        const char* rule = scalar_field_rule(key);
        if (depth == 1 && rule != nullptr &&
            (event == json::parse_event_t::object_start ||
             event == json::parse_event_t::array_start)) {
            if (refused.ok()) refused = field_error(key, rule);
            return false;
        }
        return true;
    };
    json j;
    try {
        j = json::parse(text.begin(), text.end(), keep);
    } catch (const json::exception&) {
        return invalid_argument(
            member.empty() ? std::string("request body is not valid JSON")
                           : fmt::format("request body is not valid JSON (in '{}')", member));
    }
    if (!refused.ok()) return refused;
    if (max_prompt_tokens > 0 && prompt_ids > max_prompt_tokens)
        return prompt_too_long(prompt_ids, max_prompt_tokens);
    return j;
}

}  // namespace

Result<CompletionRequest> parse_completion_request(std::string_view body,
                                                   size_t max_prompt_tokens) {
    body = without_bom(body);
    FERRY_ASSIGN_OR_RETURN(json j, parse_request_json(body, {}, max_prompt_tokens));
    return parse_completion_json(j, max_prompt_tokens);
}

Result<CompletionRequest> parse_completion_json(const json& j, size_t max_prompt_tokens) {
    if (!j.is_object()) return invalid_argument("request body must be a JSON object");
    CompletionRequest r;
    if (!j.contains("prompt")) return field_error("prompt", "is required");
    const json& p = j["prompt"];
    if (p.is_string()) {
        const std::string& text = p.get_ref<const std::string&>();
        // One token per byte: checked before the 4-byte-per-byte token vector exists.
        if (max_prompt_tokens > 0 && text.size() > max_prompt_tokens)
            return prompt_too_long(text.size(), max_prompt_tokens);
        r.gen.prompt = tokenize(text);
    } else if (p.is_array()) {
        if (!p.empty() && (p[0].is_array() || p[0].is_string()))
            return field_error("prompt", "holds several prompts; send one prompt per request");
        if (max_prompt_tokens > 0 && p.size() > max_prompt_tokens)
            return prompt_too_long(p.size(), max_prompt_tokens);
        r.gen.prompt.reserve(p.size());
        for (size_t i = 0; i < p.size(); ++i) {
            const json& t = p[i];
            if (!t.is_number_integer())
                return field_error("prompt",
                                   fmt::format("must be a string or an array of token ids; index "
                                               "{} holds {}",
                                               i, json_kind(t)));
            // Unsigned first: get<int64_t> of an id above 2^63 wraps to a negative number.
            bool negative = !t.is_number_unsigned() && t.get<int64_t>() < 0;
            if (negative || (t.is_number_unsigned() && t.get<uint64_t>() > uint64_t(INT32_MAX)) ||
                (!t.is_number_unsigned() && t.get<int64_t>() > INT32_MAX))
                return field_error(
                    "prompt", fmt::format("has token id {} at index {}, out of range: ids are in "
                                          "[0, 2147483647]",
                                          t.dump(), i));
            r.gen.prompt.push_back(int32_t(t.get<int64_t>()));
        }
    } else {
        return field_error("prompt", "must be a string or an array of token ids");
    }
    if (r.gen.prompt.empty()) return field_error("prompt", "is empty");
    if (j.contains("max_tokens") && !j["max_tokens"].is_null()) {
        if (!j["max_tokens"].is_number_integer() || j["max_tokens"].get<int64_t>() < 1)
            return field_error("max_tokens", "must be a positive integer");
        r.gen.max_tokens = size_t(j["max_tokens"].get<int64_t>());
    }
    if (j.contains("stream") && !j["stream"].is_null()) {
        if (!j["stream"].is_boolean()) return field_error("stream", "must be true or false");
        r.stream = j["stream"].get<bool>();
    }
    if (j.contains("model") && !j["model"].is_null()) {
        if (!j["model"].is_string()) return field_error("model", "must be a string");
        r.model = j["model"].get<std::string>();
        // Echoed in every event of a stream: a 16 MiB name would be sent once per token.
        if (r.model.size() > kMaxModelNameBytes)
            return field_error("model", fmt::format("is {} bytes long, more than {}",
                                                    r.model.size(), kMaxModelNameBytes));
    }
    if (j.contains("n") && !(j["n"].is_number_integer() && j["n"].get<int64_t>() == 1))
        return field_error("n", "must be 1: one completion per request");
    if (j.contains("kv_transfer_params")) {
        FERRY_ASSIGN_OR_RETURN(r.gen.kv, kv_params_from_json(j["kv_transfer_params"]));
    }
    return r;
}

namespace {

// The ids of a non-empty array of token ids in plain notation ([1, 22, 333]), the prompt clients
// send, read in one pass without building any json (the ids are what the legs' tags bind).
// Other forms (negative or out-of-range ids, -0, exponents, empty, malformed) give nullopt and
// take the full check, which names the problem.
std::optional<std::vector<int32_t>> plain_token_ids(std::string_view text) {
    size_t i = 1, n = text.size();
    auto skip_ws = [&] {
        while (i < n && (text[i] == ' ' || text[i] == '\t' || text[i] == '\n' || text[i] == '\r'))
            ++i;
    };
    if (n < 3 || text[0] != '[') return std::nullopt;
    std::vector<int32_t> ids;
    while (true) {
        skip_ws();
        size_t start = i;
        int64_t id = 0;
        while (i < n && unsigned(text[i] - '0') < 10 && i - start <= 10)
            id = id * 10 + (text[i++] - '0');
        size_t digits = i - start;
        if (digits == 0 || digits > 10 || (text[start] == '0' && digits > 1) || id > INT32_MAX)
            return std::nullopt;
        ids.push_back(int32_t(id));
        skip_ws();
        if (i < n && text[i] == ',') {
            ++i;
            continue;
        }
        if (i + 1 == n && text[i] == ']') return ids;
        return std::nullopt;
    }
}

}  // namespace

Result<CompletionRelayBody> scan_completion_request(std::string_view body) {
    body = without_bom(body);
    auto object = scan_json_object(body);
    if (!object.ok()) {
        // The full parser names the problem as the engines do ("not valid JSON", "must be a
        // JSON object"); it is cheap here, as it stops at the first error.
        Status full = parse_completion_request(body).status();
        return full.ok() ? object.status() : full;
    }
    json head = json::object();
    std::optional<std::vector<int32_t>> plain;  // the last prompt's ids, when read here
    for (const JsonMember& m : object->members) {
        if (m.key == "prompt" && (plain = plain_token_ids(m.value))) {
            head["prompt"] = json::array({0});  // stands in for the ids just read
            continue;
        }
        FERRY_ASSIGN_OR_RETURN(json value, parse_request_json(m.value, m.key));
        if (is_completion_field(m.key)) head[m.key] = std::move(value);
    }
    FERRY_ASSIGN_OR_RETURN(CompletionRequest checked, parse_completion_json(head));
    CompletionRelayBody out{std::move(object).value(), checked.stream, checked.gen.max_tokens};
    out.prompt = plain ? std::move(*plain) : std::move(checked.gen.prompt);
    return out;
}

json timing_to_json(const RequestTiming& t) {
    // A push decode leg first waits for prefill to schedule its transfer, then for blocks.
    bool remote = t.remote_scheduled != TimePoint{};
    json j = {{"queue_ms", ms_between(remote ? t.remote_scheduled : t.arrived, t.scheduled)},
              {"prefill_ms", ms_between(t.prefill_start, t.prefill_end)},
              {"kv_wait_ms", ms_between(t.scheduled, t.kv_ready)},
              {"first_token_ms", ms_between(t.arrived, t.first_token)},
              {"e2e_ms", ms_between(t.arrived, t.finished)}};
    if (remote) j["prefill_wait_ms"] = ms_between(t.arrived, t.remote_scheduled);
    if (t.kv_ready != TimePoint{}) {
        j["decode_wait_ms"] = ms_between(t.kv_ready, t.first_token);
        j["kv_ready_unix_ms"] = unix_ms(t.kv_ready);
    }
    if (t.prefill_end != TimePoint{}) j["prefill_end_unix_ms"] = unix_ms(t.prefill_end);
    return j;
}

namespace {

json choice(std::string text, std::vector<int32_t> ids, const char* finish) {
    json c = {{"index", 0},
              {"text", std::move(text)},
              {"token_ids", std::move(ids)},
              {"logprobs", nullptr}};
    c["finish_reason"] = finish ? json(finish) : json(nullptr);
    return c;
}

int64_t unix_now() {
    return std::chrono::duration_cast<std::chrono::seconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
}

json final_fields(const CompletionResult& r) {
    json j;
    j["usage"] = {{"prompt_tokens", r.prompt_tokens},
                  {"completion_tokens", r.tokens.size()},
                  {"total_tokens", r.prompt_tokens + r.tokens.size()}};
    j["kv_transfer_params"] = r.kv_out.empty() ? json(nullptr) : kv_params_to_json(r.kv_out);
    j["ferry_timing"] = timing_to_json(r.timing);
    return j;
}

}  // namespace

std::string completion_body(const CompletionResult& r) {
    std::string text;
    for (int32_t t : r.tokens) text += token_text(t);
    json j = {{"id", r.id},
              {"object", "text_completion"},
              {"created", unix_now()},
              {"model", r.model},
              {"choices", json::array({choice(text, r.tokens, "length")})}};
    j.update(final_fields(r));
    return j.dump();
}

std::string sse_token_event(const std::string& id, const std::string& model, int32_t token) {
    json j = {{"id", id},
              {"object", "text_completion"},
              {"created", unix_now()},
              {"model", model},
              {"choices", json::array({choice(token_text(token), {token}, nullptr)})}};
    return "data: " + j.dump() + "\n\n";
}

std::string sse_final_event(const CompletionResult& r) {
    json j = {{"id", r.id},
              {"object", "text_completion"},
              {"created", unix_now()},
              {"model", r.model},
              {"choices", json::array({choice("", {}, "length")})}};
    j.update(final_fields(r));
    return "data: " + j.dump() + "\n\n";
}

int http_status_for(const Status& status) {
    switch (status.code()) {
        case StatusCode::kOk:
            return 200;
        case StatusCode::kInvalidArgument:
        case StatusCode::kOutOfRange:
        case StatusCode::kProtocol:
            return 400;
        case StatusCode::kPermissionDenied:
            return 403;
        case StatusCode::kNotFound:
            return 404;
        case StatusCode::kTimeout:
            return 504;
        case StatusCode::kUnavailable:
        case StatusCode::kResourceExhausted:
        case StatusCode::kCancelled:
            return 503;
        default:
            return 500;
    }
}

std::string error_body(const Status& status) {
    json j = {{"error",
               {{"message", status.to_string()},
                {"type", std::string(status_code_name(status.code()))},
                {"code", http_status_for(status)}}}};
    return j.dump();
}

std::string error_message_of(std::string_view body) {
    json j = json::parse(body, nullptr, false);
    if (!j.is_object() || !j.contains("error")) return std::string(body);
    const json& e = j["error"];
    if (!e.is_object()) return e.is_string() ? e.get<std::string>() : e.dump();
    if (!e.contains("message")) return e.dump();
    const json& m = e["message"];
    return m.is_string() ? m.get<std::string>() : m.dump();
}

std::string sse_error_event(const Status& status) { return "data: " + error_body(status) + "\n\n"; }

std::vector<std::string> SseParser::feed(std::string_view bytes) {
    buffer_.append(bytes);
    std::vector<std::string> out;
    size_t start = 0;
    while (true) {
        size_t end = buffer_.find("\n\n", start);
        if (end == std::string::npos) break;
        std::string_view event(buffer_.data() + start, end - start);
        // An event may hold several lines; only "data:" lines carry payload.
        size_t pos = 0;
        while (pos <= event.size()) {
            size_t nl = event.find('\n', pos);
            std::string_view line =
                event.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
            if (line.starts_with("data:")) {
                line.remove_prefix(5);
                if (line.starts_with(' ')) line.remove_prefix(1);
                out.emplace_back(line);
            }
            if (nl == std::string_view::npos) break;
            pos = nl + 1;
        }
        start = end + 2;
    }
    buffer_.erase(0, start);
    return out;
}

}  // namespace ferry::serve
