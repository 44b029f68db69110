#include "bench/serve.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>

#include "serve/http.h"
#include "serve/openai_api.h"

namespace ferry::serve {

using nlohmann::json;

double percentile(std::vector<double> v, double pct) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    double rank = pct / 100.0 * double(v.size() - 1);
    size_t lo = size_t(std::floor(rank));
    size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (rank - double(lo));
}

namespace {

double mean(const std::vector<double>& v) {
    return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
}

double stddev(const std::vector<double>& v) {
    if (v.empty()) return 0;
    double m = mean(v), acc = 0;
    for (double x : v) acc += (x - m) * (x - m);
    return std::sqrt(acc / double(v.size()));
}

void put_stats(json& j, const std::string& name, const std::vector<double>& v) {
    j["mean_" + name + "_ms"] = mean(v);
    j["median_" + name + "_ms"] = percentile(v, 50);
    j["std_" + name + "_ms"] = stddev(v);
    j["p99_" + name + "_ms"] = percentile(v, 99);
}

struct Planned {
    std::vector<int32_t> prompt;
    size_t max_tokens;
    Duration send_at;
};

constexpr double kMaxScheduleSeconds = 1e9;

std::vector<Planned> plan(const BenchServeConfig& c) {
    std::mt19937_64 rng(c.seed);
    std::uniform_int_distribution<int32_t> token(0, c.vocab - 1);
    auto pick = [&](size_t lo, size_t hi) {
        if (hi <= lo) return lo;
        return std::uniform_int_distribution<size_t>(lo, hi)(rng);
    };
    bool burst = !std::isfinite(c.request_rate) || c.request_rate <= 0;
    std::exponential_distribution<double> gap(burst ? 1.0 : c.request_rate);
    std::vector<Planned> out;
    double t = 0;
    for (size_t i = 0; i < c.num_prompts; ++i) {
        Planned p;
        p.prompt.resize(pick(c.input_len, c.input_len_max));
        for (auto& x : p.prompt) x = token(rng);
        p.max_tokens = pick(c.output_len, c.output_len_max);
        // Bounded by the rate check; the tail of one gap must not overflow the conversion.
        p.send_at = std::chrono::duration_cast<Duration>(
            std::chrono::duration<double>(std::min(t, kMaxScheduleSeconds)));
        out.push_back(std::move(p));
        if (!burst) t += gap(rng);
    }
    return out;
}

// choices[0].token_ids of a streamed event: an empty array where it has none (an event of a
// server that does not send ids), nullptr where it is there but not an array of int32 ids.
const json* token_ids_of(const json& event) {
    static const json kNone = json::array();
    if (!event.is_object() || !event.contains("choices")) return &kNone;
    const json& choices = event["choices"];
    if (!choices.is_array() || choices.empty() || !choices[0].is_object()) return nullptr;
    if (!choices[0].contains("token_ids")) return &kNone;
    const json& ids = choices[0]["token_ids"];
    if (!ids.is_array()) return nullptr;
    for (const json& t : ids)
        if (!t.is_number_integer() || t.get<int64_t>() < INT32_MIN || t.get<int64_t>() > INT32_MAX)
            return nullptr;
    return &ids;
}

RequestRecord run_one(const BenchServeConfig& c, const Planned& p) {
    RequestRecord r;
    r.prompt_len = p.prompt.size();
    json body = {{"model", c.model},
                 {"prompt", p.prompt},
                 {"max_tokens", p.max_tokens},
                 {"stream", true},
                 {"ignore_eos", true}};
    std::vector<int32_t> tokens;
    SseParser parser;
    TimePoint start = Clock::now(), last = start;
    std::string raw_error;
    bool done = false;
    int status = 0;
    Status st = http_post_stream(c.host, c.port, c.path, body.dump(), c.request_timeout, &status,
                                 [&](std::string_view data) {
                                     if (c.stop && c.stop->load()) return false;
                                     if (status != 0 && status != 200) {
                                         raw_error.append(data);
                                         return true;
                                     }
                                     for (const std::string& ev : parser.feed(data)) {
                                         if (ev == "[DONE]") {
                                             done = true;
                                             continue;
                                         }
                                         json j = json::parse(ev, nullptr, false);
                                         if (j.is_discarded()) {
                                             r.error = "server sent an event that is not JSON";
                                             return false;
                                         }
                                         // Events of another shape (another server's, a
                                         // proxy's) fail their request naming it: value(), []
                                         // and get<> threw here, out of this request's thread
                                         // (std::terminate).
                                         if (j.is_object() && j.contains("error")) {
                                             r.error = error_message_of(ev);
                                             return false;
                                         }
                                         const json* ids = token_ids_of(j);
                                         if (ids == nullptr) {
                                             r.error = fmt::format(
                                                 "server sent an event whose choices[0].token_ids "
                                                 "is not an array of token ids: {:.200}",
                                                 ev);
                                             return false;
                                         }
                                         if (j.contains("ferry_timing"))
                                             r.server_timing = j["ferry_timing"];
                                         if (ids->empty()) continue;
                                         TimePoint now = Clock::now();
                                         if (tokens.empty())
                                             r.ttft_ms = to_ms(now - start);
                                         else
                                             r.itl_ms.push_back(to_ms(now - last));
                                         last = now;
                                         for (const json& t : *ids)
                                             tokens.push_back(t.get<int32_t>());
                                     }
                                     return true;
                                 });
    r.e2e_ms = to_ms(Clock::now() - start);
    r.output_len = tokens.size();
    if (!st.ok()) {
        r.error = st.to_string();
    } else if (status != 200) {
        r.error = fmt::format("HTTP {}: {}", status, error_message_of(raw_error));
    } else if (r.error.empty() && !done) {
        r.error = c.stop && c.stop->load() ? "stopped" : "stream ended without [DONE]";
    }
    r.success = r.error.empty() && tokens.size() == p.max_tokens;
    if (r.error.empty() && tokens.size() != p.max_tokens)
        r.error = fmt::format("got {} tokens, asked for {}", tokens.size(), p.max_tokens);
    r.tokens = std::move(tokens);
    return r;
}

}  // namespace

namespace {

// Polls GET /health until 200: kTimeout naming the URL and the last answer after
// c.wait_health, kCancelled when *c.stop is set.
Status wait_until_healthy(const BenchServeConfig& c) {
    const std::string url = fmt::format("http://{}:{}/health", c.host, c.port);
    auto say = [&](const std::string& line) {
        if (c.on_wait) c.on_wait(line);
    };
    TimePoint start = Clock::now();
    TimePoint deadline = start + c.wait_health;
    TimePoint next_note = start + seconds(5);
    std::string last;
    bool announced = false;
    while (true) {
        Duration left = deadline - Clock::now();
        auto r = http_get(c.host, c.port, "/health",
                          std::clamp<Duration>(left, milliseconds(100), seconds(2)));
        if (r.ok() && r->status == 200) {
            if (announced)
                say(fmt::format("{} is up after {:.1f} s", url, to_ms(Clock::now() - start) / 1e3));
            return ok_status();
        }
        last = r.ok() ? fmt::format("HTTP {} {}", r->status, r->body.substr(0, 200))
                      : r.status().message();
        if (!announced) {
            say(fmt::format("waiting up to {:g} s for {} to answer 200 (now: {})",
                            to_ms(c.wait_health) / 1e3, url, last));
            announced = true;
        }
        if (c.stop && c.stop->load()) return cancelled("interrupted while waiting for " + url);
        TimePoint now = Clock::now();
        if (now >= deadline)
            return timeout_error(fmt::format(
                "{} did not answer 200 within {:g} s (last: {}): is the router running on "
                "that port? (--host, --port; --wait-health to wait longer, 0 not to wait)",
                url, to_ms(c.wait_health) / 1e3, last));
        if (now >= next_note) {
            say(fmt::format("still waiting for {} ({:.0f} s; now: {})", url,
                            to_ms(now - start) / 1e3, last));
            next_note = now + seconds(5);
        }
        std::this_thread::sleep_for(std::min<Duration>(milliseconds(250), deadline - now));
    }
}

}  // namespace

Result<BenchServeResult> run_bench_serve(const BenchServeConfig& c) {
    if (c.num_prompts == 0) return invalid_argument("--num-prompts must be at least 1");
    // Each prompt is a thread of its own and keeps its tokens: 10^11 prompts ran out of
    // memory planning them, slowly.
    if (c.num_prompts > kMaxBenchPrompts)
        return invalid_argument(fmt::format("--num-prompts {} is above the limit of {}",
                                            c.num_prompts, kMaxBenchPrompts));
    for (auto [flag, v] : {std::pair<const char*, size_t>{"--input-len", c.input_len},
                           {"--input-len-max", c.input_len_max},
                           {"--output-len", c.output_len},
                           {"--output-len-max", c.output_len_max}}) {
        if (v > kMaxBenchTokens)
            return invalid_argument(
                fmt::format("{} {} is above the limit of {} tokens", flag, v, kMaxBenchTokens));
    }
    if (c.input_len == 0) return invalid_argument("--input-len must be at least 1");
    if (c.output_len == 0) return invalid_argument("--output-len must be at least 1");
    // A maximum below the length was ignored: every prompt had --input-len tokens.
    for (auto [flag, lo_flag, hi, lo] :
         {std::tuple{"--input-len-max", "--input-len", c.input_len_max, c.input_len},
          std::tuple{"--output-len-max", "--output-len", c.output_len_max, c.output_len}})
        if (hi != 0 && hi < lo)
            return invalid_argument(
                fmt::format("{} {} is below {} {}: give a maximum of at least {} (or leave it "
                            "out for a fixed length)",
                            flag, hi, lo_flag, lo, lo));
    // The schedule is in nanoseconds from the start: --request-rate 1e-300 overflowed it and
    // sent every request at once, as a burst. 1e9 s is 31 years.
    if (std::isfinite(c.request_rate) &&
        !(double(c.num_prompts) / c.request_rate <= kMaxScheduleSeconds))
        return invalid_argument(fmt::format(
            "--request-rate {} makes {} prompts a run of about {:.3g} s, more than 1e9 s: give a "
            "higher rate",
            c.request_rate, c.num_prompts, double(c.num_prompts) / c.request_rate));
    // Every request failed with a connection error instead.
    if (c.port < 1 || c.port > 65535)
        return invalid_argument(fmt::format("--port must be in [1, 65535], got {}", c.port));
    FERRY_RETURN_IF_ERROR(serve::check_host_resolves(c.host).with_context("--host"));
    if (!c.path.starts_with('/'))
        return invalid_argument(
            fmt::format("--endpoint '{}' must be a path starting with '/'", c.path));
    if (c.vocab < 1) return invalid_argument("vocabulary must not be empty");
    if (c.verify && c.verify_slice.vocab != c.vocab)
        return invalid_argument("verification needs the model's vocabulary for prompts too");
    if (c.wait_health > Duration::zero()) FERRY_RETURN_IF_ERROR(wait_until_healthy(c));
    std::vector<Planned> planned = plan(c);

    BenchServeResult result;
    result.config = c;
    result.requests.resize(planned.size());
    std::mutex mu;
    BenchProgress progress{.total = planned.size()};
    std::vector<std::thread> threads;
    threads.reserve(planned.size());
    TimePoint start = Clock::now();
    for (size_t i = 0; i < planned.size(); ++i) {
        // Arrival times are absolute from the start, so a slow thread spawn does not drift
        // the whole schedule.
        TimePoint at = start + planned[i].send_at;
        while (Clock::now() < at && !(c.stop && c.stop->load()))
            std::this_thread::sleep_for(std::min<Duration>(at - Clock::now(), milliseconds(50)));
        if (c.stop && c.stop->load()) {
            for (size_t k = i; k < planned.size(); ++k) result.requests[k].error = "not sent";
            break;
        }
        threads.emplace_back([&, i] {
            RequestRecord rec = run_one(c, planned[i]);
            std::lock_guard lock(mu);
            progress.done++;
            if (!rec.success) progress.failed++;
            progress.elapsed_s = to_ms(Clock::now() - start) / 1000;
            result.requests[i] = std::move(rec);
            if (c.on_progress) c.on_progress(progress);
        });
    }
    for (auto& t : threads) t.join();
    result.duration_s = to_ms(Clock::now() - start) / 1000;
    if (c.verify) {
        // After the run: recomputing the expected tokens reads the whole prompt's synthetic KV
        // (32 MiB per 1k-token prompt), work that would otherwise compete for the cores with
        // the servers being measured.
        for (size_t i = 0; i < planned.size(); ++i) {
            RequestRecord& r = result.requests[i];
            if (!r.success) continue;
            r.verified = r.tokens ==
                         expected_tokens(c.verify_slice, planned[i].prompt, planned[i].max_tokens);
            if (!r.verified) progress.verify_failed++;
        }
        if (c.on_progress) c.on_progress(progress);
    }
    return result;
}

json BenchServeResult::to_json() const {
    const BenchServeConfig& c = config;
    std::vector<double> ttft, tpot, itl, e2e;
    size_t completed = 0, in_tokens = 0, out_tokens = 0, verify_failures = 0;
    json input_lens = json::array(), output_lens = json::array(), ttfts = json::array(),
         errors = json::array();
    std::map<std::string, std::vector<double>> breakdown;
    std::vector<double> wait_share;
    for (const RequestRecord& r : requests) {
        input_lens.push_back(r.prompt_len);
        output_lens.push_back(r.output_len);
        errors.push_back(r.error);
        ttfts.push_back(r.success ? r.ttft_ms / 1000 : 0.0);
        if (!r.success) continue;
        completed++;
        in_tokens += r.prompt_len;
        out_tokens += r.output_len;
        if (c.verify && !r.verified) verify_failures++;
        ttft.push_back(r.ttft_ms);
        e2e.push_back(r.e2e_ms);
        itl.insert(itl.end(), r.itl_ms.begin(), r.itl_ms.end());
        if (r.output_len > 1) tpot.push_back((r.e2e_ms - r.ttft_ms) / double(r.output_len - 1));
        if (r.server_timing.is_object()) {
            for (auto& [k, v] : r.server_timing.items())
                if (v.is_number()) breakdown[k].push_back(v.get<double>());
            const json& t = r.server_timing;
            if (t.contains("transfer_wait_ms") && t["transfer_wait_ms"].is_number() &&
                t.contains("decode_wait_ms") && t["decode_wait_ms"].is_number() && r.ttft_ms > 0)
                wait_share.push_back(
                    (t["transfer_wait_ms"].get<double>() + t["decode_wait_ms"].get<double>()) /
                    r.ttft_ms);
        }
    }
    char date[32];
    std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y%m%d-%H%M%S", std::gmtime(&now));
    json j;
    j["note"] =
        "compute is modelled (roofline cost model, engines sleep for the step time); "
        "KV bytes and their transfers are real";
    j["date"] = date;
    j["backend"] = "ferry";
    j["label"] = c.label;
    j["model_id"] = c.model;
    j["num_prompts"] = requests.size();
    j["request_rate"] = std::isfinite(c.request_rate) ? json(c.request_rate) : json("inf");
    j["burstiness"] = 1.0;
    j["max_concurrency"] = nullptr;
    j["input_len"] = c.input_len;
    j["output_len"] = c.output_len;
    j["duration"] = duration_s;
    j["completed"] = completed;
    j["failed"] = requests.size() - completed;
    j["verified"] = c.verify;
    j["verification_failures"] = verify_failures;
    j["total_input_tokens"] = in_tokens;
    j["total_output_tokens"] = out_tokens;
    double d = duration_s > 0 ? duration_s : 1;
    j["request_throughput"] = double(completed) / d;
    j["output_throughput"] = double(out_tokens) / d;
    j["total_token_throughput"] = double(in_tokens + out_tokens) / d;
    put_stats(j, "ttft", ttft);
    put_stats(j, "tpot", tpot);
    put_stats(j, "itl", itl);
    put_stats(j, "e2el", e2e);
    json bd = json::object();
    for (auto& [k, v] : breakdown) bd[k] = {{"mean", mean(v)}, {"median", percentile(v, 50)}};
    j["server_timing_ms"] = bd;
    // (transfer wait + decode wait) / TTFT per request: how much of a TTFT is spent moving KV
    // after prefill computed it and waiting at decode (docs/SERVING.md).
    if (!wait_share.empty()) {
        j["mean_wait_share"] = mean(wait_share);
        j["median_wait_share"] = percentile(wait_share, 50);
        j["p99_wait_share"] = percentile(wait_share, 99);
    }
    j["input_lens"] = input_lens;
    j["output_lens"] = output_lens;
    j["ttfts"] = ttfts;
    j["errors"] = errors;
    return j;
}

}  // namespace ferry::serve
