// `ferry bench relay`: the router's work on one request body, relayed against fully parsed.
#include <cstdio>

#include "bench/relay.h"
#include "cli/commands.h"
#include "cli/util.h"

namespace ferry::cli {

void register_bench_relay(CLI::App& bench) {
    auto* cmd = bench.add_subcommand(
        "relay",
        "router body handling per request: scan and splice (what it does) against a full JSON "
        "parse and dump, token-id prompts, no sockets");
    auto c = std::make_shared<serve::RelayBenchConfig>();
    auto json_path = std::make_shared<std::string>();
    cmd->add_option("--input-len", c->input_lens, "prompt lengths in tokens")
        ->delimiter(',')
        ->capture_default_str();
    cmd->add_option("--vocab", c->vocab, "token ids drawn below this (qwen3-32b's by default)")
        ->capture_default_str();
    cmd->add_option("--iters", c->iters, "timed bodies per length")->capture_default_str();
    cmd->add_option("--seed", c->seed, "random seed of the token ids")->capture_default_str();
    cmd->add_option("--json", *json_path, "write the results as JSON to this file")
        ->check(output_file());
    cmd->callback([c, json_path] {
        auto rows = serve::run_relay_bench(*c);
        if (!rows.ok()) return fail(rows.status());
        std::printf("%s", serve::format_relay_table(*rows).c_str());
        if (json_path->empty()) return;
        nlohmann::json j = {{"command", "ferry bench relay"}, {"iters", c->iters}};
        for (const serve::RelayBenchRow& r : *rows)
            j["rows"].push_back({{"input_len", r.input_len},
                                 {"body_bytes", r.body_bytes},
                                 {"relay_p50_us", r.relay_p50_us},
                                 {"relay_p99_us", r.relay_p99_us},
                                 {"full_parse_p50_us", r.full_p50_us},
                                 {"full_parse_p99_us", r.full_p99_us}});
        Status s = write_json_file(*json_path, j);
        if (!s.ok()) fail(s);
    });
}

}  // namespace ferry::cli
