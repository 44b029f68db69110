// The load generator behind `ferry bench serve`: Poisson (or burst) arrivals of random prompts
// against an OpenAI-style /v1/completions endpoint, every request streamed, per-request TTFT,
// inter-token latencies and end-to-end latency measured at the client, and optionally every
// token checked against what the synthetic model must produce from that prompt.
// Results use the metric names of `vllm bench serve`.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "serve/synthetic_model.h"

namespace ferry::serve {

struct BenchProgress {
    size_t total = 0, done = 0, failed = 0, verify_failed = 0;
    double elapsed_s = 0;
};

inline constexpr size_t kMaxBenchPrompts = 100000;
inline constexpr size_t kMaxBenchTokens = size_t(1) << 24;

struct BenchServeConfig {
    std::string host = "127.0.0.1";
    int port = 8000;
    std::string path = "/v1/completions";
    std::string label;  // e.g. push / pull; copied into the result
    std::string model = "qwen3-32b";
    size_t num_prompts = 100;
    // Requests per second with exponential gaps; infinity sends all at once (burst).
    double request_rate = std::numeric_limits<double>::infinity();
    size_t input_len = 1024;
    size_t input_len_max = 0;  // > input_len: uniform in [input_len, input_len_max]
    size_t output_len = 128;
    size_t output_len_max = 0;
    uint64_t seed = 0;
    int vocab = 151936;  // random prompt ids are drawn below this
    // When set, every received token is compared with expected_tokens(verify_slice, ...).
    bool verify = false;
    KvSlice verify_slice{};
    Duration request_timeout = seconds(600);
    // Before the first request, GET /health is polled until it answers 200, for at most this
    // long (0: not at all); engines answer 503 while they allocate their KV pools, and requests
    // sent then would only count as failed. on_wait gets a line when the wait starts and every
    // few seconds of it.
    Duration wait_health = Duration::zero();
    std::function<void(const std::string&)> on_wait{};
    std::function<void(const BenchProgress&)> on_progress{};
    // Set from another thread (Ctrl-C) to stop issuing requests and abandon those in flight.
    const std::atomic<bool>* stop = nullptr;
};

struct RequestRecord {
    bool success = false;
    bool verified = false;  // tokens matched (only meaningful with verify)
    std::string error;
    size_t prompt_len = 0;
    size_t output_len = 0;
    double ttft_ms = 0;
    double e2e_ms = 0;
    std::vector<double> itl_ms;
    nlohmann::json server_timing;  // the server's ferry_timing, when it sent one
    std::vector<int32_t> tokens;   // what came back
};

struct BenchServeResult {
    BenchServeConfig config;
    double duration_s = 0;
    std::vector<RequestRecord> requests;

    // vllm-bench names: completed, request_throughput, mean_ttft_ms, median_tpot_ms,
    // p99_itl_ms, mean_e2el_ms, ... plus failed, verification_failures and a note that compute is
    // modelled and transfers are real.
    nlohmann::json to_json() const;
};

Result<BenchServeResult> run_bench_serve(const BenchServeConfig& config);

// numpy.percentile's linear interpolation, so numbers compare with vllm bench serve's.
double percentile(std::vector<double> values, double pct);

}  // namespace ferry::serve
