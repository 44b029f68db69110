#include <fmt/format.h>

#include <cstdio>

#include "bench/kv.h"
#include "cli/commands.h"
#include "cli/util.h"

namespace ferry::cli {

void register_bench_kv(CLI::App& bench) {
    auto* cmd = bench.add_subcommand(
        "kv",
        "KV-cache transfer per request (push, pull, pull-inline) beside the provider's raw "
        "write ceiling");
    auto c = std::make_shared<kv::KvBenchConfig>();
    auto json_path = std::make_shared<std::string>();
    cmd->add_option("--mode", c->mode, "push | pull | pull-inline")->capture_default_str();
    cmd->add_option("--tokens", c->tokens, "tokens per request")->delimiter(',');
    cmd->add_option("--layers", c->layers, "model layers")->capture_default_str();
    cmd->add_option("--kv-heads", c->kv_heads, "KV heads in total")->capture_default_str();
    cmd->add_option("--head-dim", c->head_dim, "elements per head")->capture_default_str();
    cmd->add_option("--elem-size", c->elem_size, "bytes per element")->capture_default_str();
    cmd->add_option("--block-size", c->block_size, "tokens per block")->capture_default_str();
    cmd->add_option("--tp-prefill", c->tp_prefill, "prefill TP degree (ranks writing), 1..64")
        ->capture_default_str();
    cmd->add_option("--tp-decode", c->tp_decode, "decode TP degree (ranks receiving), 1..64")
        ->capture_default_str();
    // One region, one per layer (vLLM) or one per layer and K/V (SGLang), on both sides or
    // on one.
    auto split_option = [cmd](const std::string& name, std::vector<kv::RegionSplit*> into,
                              const std::string& help) {
        cmd->add_option_function<std::string>(
               name,
               [into](const std::string& v) {
                   auto s = kv::parse_region_split(v);
                   if (!s.ok()) throw CLI::ValidationError(s.status().message());
                   for (kv::RegionSplit* p : into) *p = *s;
               },
               help)
            ->check(CLI::IsMember({"one", "per-layer", "per-layer-kv"}));
    };
    split_option("--regions", {&c->regions_prefill, &c->regions_decode},
                 "how both sides register their pools: one | per-layer | per-layer-kv");
    split_option("--regions-prefill", {&c->regions_prefill}, "the prefill side's split only");
    split_option("--regions-decode", {&c->regions_decode}, "the decode side's split only");
    cmd->add_option("--provider", c->provider, "shm | tcp | efa | verbs | auto")
        ->capture_default_str();
    cmd->add_option("--iters", c->iters, "timed requests per token count")->capture_default_str();
    cmd->add_option("--max-write", c->max_write_size,
                    fmt::format("longest single write the engine posts, bytes, at least {} (0: "
                                "engine default)",
                                kv::kMinBenchMaxWrite));
    cmd->add_flag("--random-blocks", c->random_blocks,
                  "scattered block ids, as in a long-running server's pool");
    cmd->add_flag("!--no-ceiling", c->measure_ceiling, "skip the raw fi_write measurement");
    cmd->add_flag("--gpu", c->gpu,
                  "KV pools in GPU memory (prefill on GPU 0, decode on GPU 1), CUDA IPC");
    cmd->add_flag("!--no-verify", c->verify, "skip checking the bytes of the first request");
    cmd->add_flag("!--no-busy-poll", c->busy_poll,
                  "let engine workers nap when idle (default: they poll, one core each)");
    cmd->add_flag("!--no-run-on-caller", c->run_on_caller,
                  "always hand the connector calls to its thread (default: an idle connector's "
                  "work runs on the calling thread)");
    cmd->add_option_function<std::string>(
           "--pull-keys",
           [c](const std::string& v) {
               c->pull_keys = v == "pool" ? kv::PullKeys::kPool : kv::PullKeys::kPerOffer;
           },
           "pull: 'offer' registers each offer's blocks under a key of their own, closed when "
           "the offer ends (default); 'pool' hands out the pool's key (protocol 9)")
        ->check(CLI::IsMember({"offer", "pool"}));
    cmd->add_option("--settle-us", c->settle_us,
                    "push: microseconds from the REGISTERs' arrival to prefill_done, prefill's "
                    "compute (0: the call meets the REGISTER's handling)")
        ->check(CLI::Range(0u, 1000000u))
        ->capture_default_str();
    cmd->add_option("--offer-wait-ms", c->offer_wait_ms,
                    "pull: milliseconds from prefill's offers to decode's pull (the router's "
                    "round trip and decode's scheduling), not counted in the time")
        ->check(CLI::Range(0u, 60000u))
        ->capture_default_str();
    cmd->add_option("--json", *json_path, "write the results as JSON to this file")
        ->check(output_file());
    cmd->callback([c, json_path] {
        c->progress = [](const std::string& line) { std::fprintf(stderr, "  %s\n", line.c_str()); };
        auto rep = kv::run_kv_bench(*c);
        if (!rep.ok()) {
            fail(rep.status());
            return;
        }
        std::printf("%s", kv::format_kv_table(*c, *rep).c_str());
        if (!json_path->empty()) {
            auto j = kv::kv_report_json(*c, *rep);
            j["command"] = "ferry bench kv";
            Status s = write_json_file(*json_path, j);
            if (!s.ok()) fail(s);
        }
    });
}

}  // namespace ferry::cli
