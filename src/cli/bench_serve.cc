// `ferry bench serve`: load against a /v1/completions endpoint, results in vllm-bench JSON.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>

#include "bench/serve.h"
#include "cli/commands.h"
#include "cli/setting_flags.h"
#include "cli/stop_signal.h"
#include "cli/util.h"
#include "serve/cost_model.h"

namespace ferry::cli {
namespace {

struct BenchFlags {
    serve::BenchServeConfig cfg;
    std::string request_rate = "inf";
    int tp = 8;
    int head_offset = 0;
    std::string result_file;
    double wait_health_s = 120;
};

int run(BenchFlags f) {
    serve::BenchServeConfig& c = f.cfg;
    if (f.request_rate == "inf") {
        c.request_rate = std::numeric_limits<double>::infinity();
    } else {
        char* end = nullptr;
        c.request_rate = std::strtod(f.request_rate.c_str(), &end);
        // NaN fails the comparison too; a negative or zero rate never sends anything.
        if (f.request_rate.empty() || *end != '\0' || !(c.request_rate > 0)) {
            fmt::print(stderr, "error: --request-rate must be a number above 0 or inf, not '{}'\n",
                       f.request_rate);
            return 2;
        }
    }
    auto model = serve::model_by_name(c.model);
    if (!model.ok()) {
        fmt::print(stderr, "error: {}\n", model.status().to_string());
        return 2;
    }
    c.vocab = model->vocab;
    if (c.verify) {
        // The client needs the decode rank's slice of the model to recompute its tokens.
        auto cost = serve::CostModel::create(*model, serve::h200(), f.tp);
        if (!cost.ok()) {
            fmt::print(stderr, "error: {}\n", in_flag_names(cost.status()).to_string());
            return 2;
        }
        c.verify_slice = {
            .layout = cost->kv_layout(16, 1), .head_offset = f.head_offset, .vocab = model->vocab};
        const int rank_heads = int(c.verify_slice.layout.num_kv_heads);
        if (f.head_offset + rank_heads > model->kv_heads) {
            fmt::print(stderr,
                       "error: --head-offset {} with --tp {} leaves the {} KV heads of {}: use a "
                       "multiple of {} below {}\n",
                       f.head_offset, f.tp, model->kv_heads, model->name, rank_heads,
                       model->kv_heads);
            return 2;
        }
    }
    c.stop = &stop_requested();
    c.wait_health =
        std::chrono::duration_cast<Duration>(std::chrono::duration<double>(f.wait_health_s));
    c.on_wait = [](const std::string& line) { fmt::print(stderr, "bench serve: {}\n", line); };
    bool tty = isatty(STDERR_FILENO);
    std::mutex mu;
    c.on_progress = [&](const serve::BenchProgress& p) {
        std::lock_guard lock(mu);
        if (!tty && p.done != p.total) return;
        int width = 30;
        int filled = int(width * p.done / std::max<size_t>(p.total, 1));
        fmt::print(stderr, "\r[{:<{}}] {}/{} failed {} unverified {} {:.1f}s",
                   std::string(filled, '='), width, p.done, p.total, p.failed, p.verify_failed,
                   p.elapsed_s);
        if (p.done == p.total) fmt::print(stderr, "\n");
    };
    fmt::print(stderr, "bench serve: {} prompts at {} req/s against http://{}:{}{}\n",
               c.num_prompts, f.request_rate, c.host, c.port, c.path);
    auto r = serve::run_bench_serve(c);
    if (!r.ok()) {
        fmt::print(stderr, "error: {}\n", r.status().to_string());
        return stop_requested().load() ? 130 : 2;  // interrupted while waiting for /health
    }
    nlohmann::json j = r->to_json();
    fmt::print("{:<28}{:>12}\n", "completed / failed",
               fmt::format("{} / {}", j["completed"].get<size_t>(), j["failed"].get<size_t>()));
    if (c.verify)
        fmt::print("{:<28}{:>12}\n", "verification failures",
                   j["verification_failures"].get<size_t>());
    fmt::print("{:<28}{:>12.2f}\n", "duration (s)", j["duration"].get<double>());
    fmt::print("{:<28}{:>12.2f}\n", "request throughput (req/s)",
               j["request_throughput"].get<double>());
    fmt::print("{:<28}{:>12.1f}\n", "output throughput (tok/s)",
               j["output_throughput"].get<double>());
    for (const char* m : {"ttft", "tpot", "itl", "e2el"})
        fmt::print("{:<28}{:>12.2f}{:>12.2f}{:>12.2f}\n", fmt::format("{} ms mean/median/p99", m),
                   j[fmt::format("mean_{}_ms", m)].get<double>(),
                   j[fmt::format("median_{}_ms", m)].get<double>(),
                   j[fmt::format("p99_{}_ms", m)].get<double>());
    if (j.contains("median_wait_share")) {
        const auto& bd = j["server_timing_ms"];
        auto median = [&](const char* k) {
            return bd.contains(k) ? bd[k]["median"].get<double>() : 0.0;
        };
        fmt::print("{:<28}{:>12.2f}{:>12.2f}\n", "transfer / decode wait ms",
                   median("transfer_wait_ms"), median("decode_wait_ms"));
        fmt::print("{:<28}{:>12.3f}{:>12.3f}{:>12.3f}\n", "wait share mean/median/p99",
                   j["mean_wait_share"].get<double>(), j["median_wait_share"].get<double>(),
                   j["p99_wait_share"].get<double>());
    }
    // What failed, not only how many: the distinct errors, most frequent first.
    std::map<std::string, size_t> errors;
    for (const auto& e : j["errors"])
        if (e.is_string() && !e.get<std::string>().empty()) errors[e.get<std::string>()]++;
    std::vector<std::pair<size_t, std::string>> by_count;
    for (auto& [e, n] : errors) by_count.emplace_back(n, e);
    std::sort(by_count.rbegin(), by_count.rend());
    for (size_t i = 0; i < std::min<size_t>(by_count.size(), 3); ++i)
        fmt::print(stderr, "failed x{}: {}\n", by_count[i].first, by_count[i].second);
    if (by_count.size() > 3)
        fmt::print(stderr, "... and {} other errors (all in the result file)\n",
                   by_count.size() - 3);
    if (!f.result_file.empty()) {
        if (Status st = write_json_file(f.result_file, j); !st.ok()) {
            fmt::print(stderr, "error: {}\n", st.to_string());
            return 1;
        }
        fmt::print(stderr, "wrote {}\n", f.result_file);
    }
    if (stop_requested().load()) return 130;  // interrupted: callers (sweeps) should stop too
    bool all_good = j["failed"].get<size_t>() == 0 && j["verification_failures"].get<size_t>() == 0;
    return all_good ? 0 : 3;
}

}  // namespace

void register_bench_serve(CLI::App& bench) {
    auto f = std::make_shared<BenchFlags>();
    auto& c = f->cfg;
    auto* cmd = bench.add_subcommand("serve",
                                     "load generator for /v1/completions (vllm-bench "
                                     "metrics)");
    cmd->add_option("--host", c.host, "router (or engine) to load")->capture_default_str();
    cmd->add_option("--port", c.port, "its HTTP port")->capture_default_str();
    cmd->add_option("--endpoint", c.path, "path of the completions API")->capture_default_str();
    cmd->add_option("--model", c.model, "model shape: vocabulary and verification")
        ->capture_default_str();
    cmd->add_option("--num-prompts", c.num_prompts, "requests to send")->capture_default_str();
    cmd->add_option("--request-rate", f->request_rate, "requests/s (Poisson) or inf (burst)")
        ->capture_default_str();
    cmd->add_option("--input-len", c.input_len, "prompt tokens per request")->capture_default_str();
    cmd->add_option("--input-len-max", c.input_len_max, "draw input lengths up to this")
        ->capture_default_str();
    cmd->add_option("--output-len", c.output_len, "max_tokens per request")->capture_default_str();
    cmd->add_option("--output-len-max", c.output_len_max, "draw output lengths up to this")
        ->capture_default_str();
    cmd->add_option("--seed", c.seed, "random seed of prompts, lengths and arrivals")
        ->capture_default_str();
    cmd->add_flag("--verify", c.verify,
                  "check every token against the prompt's expected tokens (after the run, so "
                  "the check does not compete with the servers for the cores)");
    cmd->add_option("--tp", f->tp, "decode TP degree (for --verify)")->capture_default_str();
    cmd->add_option("--head-offset", f->head_offset, "decode rank's first KV head (--verify)")
        ->capture_default_str();
    cmd->add_option("--label", c.label, "mode label stored in the result (push, pull, ...)");
    cmd->add_option("--result-file", f->result_file, "write the JSON result here")
        ->check(output_file());
    cmd->add_option("--wait-health", f->wait_health_s,
                    "seconds to wait for GET /health to answer 200 before the first request "
                    "(0: do not wait)")
        ->capture_default_str();
    cmd->callback([f] { set_exit_code(run(*f)); });
}

}  // namespace ferry::cli
