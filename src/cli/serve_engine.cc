// `ferry serve prefill` and `ferry serve decode`: one engine behind the OpenAI-style HTTP API.
// Compute is modelled by the cost model; the KV bytes are real.
#include <fmt/format.h>

#include <thread>

#include "cli/commands.h"
#include "cli/stop_signal.h"
#include "ferry/serve/engine_server.h"

namespace ferry::cli {
namespace {

struct EngineFlags {
    std::string host = "127.0.0.1";
    int port = 0;
    std::string engine_id;
    std::string model = "qwen3-32b";
    std::string gpu = "h200";
    int tp = 8;
    serve::CostModelConfig cost;
    serve::EngineConfig engine;
    double kv_wait_timeout_s = 30;
    size_t http_threads = 128;
};

void add_engine_flags(CLI::App* cmd, EngineFlags& f) {
    cmd->add_option("--host", f.host, "address to listen on")->capture_default_str();
    cmd->add_option("--port", f.port, "HTTP port")->capture_default_str();
    cmd->add_option("--engine-id", f.engine_id, "engine id (default: <role>-<port>)");
    cmd->add_option("--model", f.model, "model shape: qwen3-32b | tiny")->capture_default_str();
    cmd->add_option("--gpu", f.gpu, "GPU the cost model assumes: h200")->capture_default_str();
    cmd->add_option("--tp", f.tp, "tensor-parallel degree the cost model assumes")
        ->capture_default_str();
    cmd->add_option("--compute-efficiency", f.cost.compute_efficiency,
                    "achieved fraction of peak FLOP/s")
        ->capture_default_str();
    cmd->add_option("--bandwidth-efficiency", f.cost.bandwidth_efficiency,
                    "achieved fraction of HBM bandwidth")
        ->capture_default_str();
    cmd->add_option("--step-overhead-us", f.cost.step_overhead_us, "fixed cost per step")
        ->capture_default_str();
    cmd->add_option("--max-num-seqs", f.engine.max_num_seqs, "sequences per batch")
        ->capture_default_str();
    cmd->add_option("--max-model-len", f.engine.max_model_len, "prompt + output tokens")
        ->capture_default_str();
    cmd->add_option("--max-num-batched-tokens", f.engine.max_num_batched_tokens,
                    "prompt tokens per prefill step")
        ->capture_default_str();
    cmd->add_option("--num-blocks", f.engine.num_blocks, "KV blocks in the pool")
        ->capture_default_str();
    cmd->add_option("--block-size", f.engine.block_size, "tokens per KV block")
        ->capture_default_str();
    cmd->add_option("--time-scale", f.engine.time_scale,
                    "multiplies modelled step times (1 = real time)")
        ->capture_default_str();
    cmd->add_option("--kv-wait-timeout", f.kv_wait_timeout_s,
                    "seconds a decode leg waits for its KV")
        ->capture_default_str();
    cmd->add_option("--http-threads", f.http_threads, "concurrent HTTP requests")
        ->capture_default_str();
}

int run_engine(const std::string& role, EngineFlags f) {
    auto model = serve::model_by_name(f.model);
    auto gpu = serve::gpu_by_name(f.gpu);
    if (!model.ok() || !gpu.ok()) {
        fmt::print(stderr, "error: {}\n",
                   (!model.ok() ? model.status() : gpu.status()).to_string());
        return 2;
    }
    auto cost = serve::CostModel::create(*model, *gpu, f.tp, f.cost);
    if (!cost.ok()) {
        fmt::print(stderr, "error: {}\n", cost.status().to_string());
        return 2;
    }
    f.engine.engine_id = f.engine_id.empty() ? fmt::format("{}-{}", role, f.port) : f.engine_id;
    f.engine.kv_wait_timeout =
        std::chrono::duration_cast<Duration>(std::chrono::duration<double>(f.kv_wait_timeout_s));
    auto engine = serve::Engine::create(f.engine, *cost);
    if (!engine.ok()) {
        fmt::print(stderr, "error: {}\n", engine.status().to_string());
        return 2;
    }
    const auto& stop = stop_requested();
    if (Status st = (*engine)->start(); !st.ok()) {
        fmt::print(stderr, "error: {}\n", st.to_string());
        return 1;
    }
    auto server = serve::EngineServer::start(
        engine->get(), {.http = {.host = f.host, .port = f.port, .threads = f.http_threads}});
    if (!server.ok()) {
        fmt::print(stderr, "error: {}\n", server.status().to_string());
        return 1;
    }
    const serve::KvShape& kv = (*engine)->kv_slice().shape;
    fmt::print(stderr,
               "{} engine {} on http://{}:{}  model {} on {} x TP{} (compute modelled, KV real)\n"
               "  KV pool: {} blocks x {} tokens, {:.1f} MiB\n"
               "  no KV connector attached yet: disaggregated legs are refused with 503\n",
               role, f.engine.engine_id, f.host, (*server)->port(), model->name, gpu->name, f.tp,
               f.engine.num_blocks, kv.block_size,
               double((*engine)->pool().size_bytes()) / (1 << 20));
    while (!stop.load()) std::this_thread::sleep_for(milliseconds(100));
    (*server)->stop();
    (*engine)->stop();
    return 0;
}

}  // namespace

void register_serve(CLI::App& app) {
    auto* serve = app.add_subcommand("serve", "disaggregated serving processes");
    serve->require_subcommand(1);
    for (auto [role, port] : {std::pair{"prefill", 8100}, std::pair{"decode", 8200}}) {
        auto flags = std::make_shared<EngineFlags>();
        flags->port = port;
        auto* cmd = serve->add_subcommand(role, fmt::format("run a {} engine", role));
        add_engine_flags(cmd, *flags);
        std::string r = role;
        cmd->callback([flags, r] { set_exit_code(run_engine(r, *flags)); });
    }
}

}  // namespace ferry::cli
