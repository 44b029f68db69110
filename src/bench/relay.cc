#include "bench/relay.h"

#include <fmt/format.h>

#include <random>

#include "bench/limits.h"
#include "bench/serve.h"
#include "ferry/common/clock.h"
#include "serve/openai_api.h"

namespace ferry::serve {

using nlohmann::json;

namespace {

struct Legs {
    std::string prefill, decode;
};

const json kPrefillKv = {{"do_remote_decode", true},
                         {"transfer_id", "0badcafe-1"},
                         {"remote_host", "127.0.0.1"},
                         {"remote_port", 8200}};
const json kDecodeKv = {{"do_remote_prefill", true},
                        {"transfer_id", "0badcafe-1"},
                        {"remote_engine_id", "prefill-8100"},
                        {"remote_host", "127.0.0.1"},
                        {"remote_port", 8100}};

Result<Legs> relay(const std::string& body) {
    FERRY_ASSIGN_OR_RETURN(CompletionRelayBody r, scan_completion_request(body));
    return Legs{
        r.object.with({{"max_tokens", 1}, {"stream", false}, {"kv_transfer_params", kPrefillKv}}),
        r.object.with({{"kv_transfer_params", kDecodeKv}})};
}

Result<Legs> full_parse(const std::string& body) {
    json j = json::parse(body, nullptr, false);
    if (j.is_discarded()) return invalid_argument("request body is not valid JSON");
    FERRY_RETURN_IF_ERROR(parse_completion_json(j).status());
    json client_max_tokens = j["max_tokens"], client_stream = j["stream"];
    j["max_tokens"] = 1;
    j["stream"] = false;
    j["kv_transfer_params"] = kPrefillKv;
    Legs legs;
    legs.prefill = j.dump();
    j["max_tokens"] = client_max_tokens;
    j["stream"] = client_stream;
    j["kv_transfer_params"] = kDecodeKv;
    legs.decode = j.dump();
    return legs;
}

}  // namespace

Result<std::vector<RelayBenchRow>> run_relay_bench(const RelayBenchConfig& c) {
    if (c.iters == 0) return invalid_argument("--iters must be at least 1");
    // 10^11 ran for days; the other benchmarks stop at the same bound.
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("relay", "--iters", int64_t(c.iters), 1, bench::kMaxIters));
    if (c.vocab < 1) return invalid_argument("--vocab must be at least 1");
    std::mt19937_64 rng(c.seed);
    std::uniform_int_distribution<int32_t> token(0, c.vocab - 1);
    std::vector<RelayBenchRow> rows;
    for (size_t n : c.input_lens) {
        if (n == 0) return invalid_argument("input lengths must be at least 1");
        std::vector<int32_t> prompt(n);
        for (auto& t : prompt) t = token(rng);
        // The body `ferry bench serve` sends.
        json request = {{"model", "qwen3-32b"},
                        {"prompt", prompt},
                        {"max_tokens", 128},
                        {"stream", true},
                        {"ignore_eos", true}};
        std::string body = request.dump();
        // Both ways must build the same legs, or the timing compares different work.
        FERRY_ASSIGN_OR_RETURN(Legs a, relay(body));
        FERRY_ASSIGN_OR_RETURN(Legs b, full_parse(body));
        if (json::parse(a.prefill) != json::parse(b.prefill) ||
            json::parse(a.decode) != json::parse(b.decode))
            return internal_error(
                fmt::format("relayed legs differ from parsed ones at {} tokens", n));
        std::vector<double> relay_us, full_us;
        for (size_t i = 0; i < c.iters; ++i) {  // interleaved: both see the same machine load
            TimePoint t0 = Clock::now();
            auto r = relay(body);
            TimePoint t1 = Clock::now();
            auto f = full_parse(body);
            TimePoint t2 = Clock::now();
            if (!r.ok() || !f.ok()) return internal_error("a body that passed once failed");
            relay_us.push_back(to_ms(t1 - t0) * 1000);
            full_us.push_back(to_ms(t2 - t1) * 1000);
        }
        rows.push_back({n, body.size(), percentile(relay_us, 50), percentile(relay_us, 99),
                        percentile(full_us, 50), percentile(full_us, 99)});
    }
    return rows;
}

std::string format_relay_table(const std::vector<RelayBenchRow>& rows) {
    std::string out = fmt::format("{:>8} {:>10} {:>14} {:>14} {:>14} {:>14}\n", "tokens", "body B",
                                  "relay p50 us", "relay p99 us", "parse p50 us", "parse p99 us");
    for (const RelayBenchRow& r : rows)
        out +=
            fmt::format("{:>8} {:>10} {:>14.1f} {:>14.1f} {:>14.1f} {:>14.1f}\n", r.input_len,
                        r.body_bytes, r.relay_p50_us, r.relay_p99_us, r.full_p50_us, r.full_p99_us);
    return out;
}

}  // namespace ferry::serve
