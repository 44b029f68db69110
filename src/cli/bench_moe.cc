#include <fmt/format.h>

#include <cstdio>
#include <vector>

#include "bench/moe.h"
#include "cli/commands.h"
#include "cli/util.h"

namespace ferry::cli {

void register_bench_moe(CLI::App& bench) {
    auto* cmd = bench.add_subcommand(
        "moe",
        "MoE dispatch/combine latency per phase (p50/p99) and bytes moved, every rank a "
        "thread of this process");
    auto c = std::make_shared<moe::MoeBenchConfig>();
    auto dtype = std::make_shared<std::string>("fp8");
    auto json_path = std::make_shared<std::string>();
    auto combine = std::make_shared<std::string>("per-hit");
    cmd->add_option("--backend", c->backend,
                    "cpu | cuda (cuda: every rank a thread on this host's GPUs, rank r on GPU "
                    "r % count, timed with CUDA events)")
        ->capture_default_str();
    cmd->add_option("--ranks", c->ranks, "ranks (expert-parallel world size)")
        ->capture_default_str();
    auto* per_node = cmd->add_option(
        "--ranks-per-node", c->ranks_per_node,
        "ranks sharing memory, a divisor of --ranks (cpu: the largest divisor up to 4 unless "
        "given; cuda: all ranks unless given, ranks of other nodes then go through the host "
        "proxy and --provider)");
    cmd->add_option("--tokens", c->tokens, "tokens per rank and call")->capture_default_str();
    cmd->add_option("--hidden", c->hidden, "channels per token (fp8: a multiple of 128)")
        ->capture_default_str();
    cmd->add_option("--topk", c->topk, "experts per token")->capture_default_str();
    cmd->add_option("--experts", c->experts, "experts in all, a multiple of --ranks")
        ->capture_default_str();
    cmd->add_option("--dtype", *dtype, "dispatch type: fp8 | bf16")->capture_default_str();
    cmd->add_option("--combine", *combine,
                    "per-hit (every expert output row goes back) | per-rank (the expert's rank "
                    "sends one weighted partial per token, rounded to bf16)")
        ->capture_default_str();
    cmd->add_option("--private-slots", c->private_slots, "rows per sender written before counts")
        ->capture_default_str();
    cmd->add_option("--provider", c->provider, "between nodes: tcp | shm | efa | verbs | auto")
        ->capture_default_str();
    cmd->add_option("--warmup", c->warmup, "untimed layers first, 0..1000000")
        ->capture_default_str();
    std::vector<CLI::Option*> cuda_only;
    cuda_only.push_back(cmd->add_flag("--graph", c->graph,
                                      "cuda: capture one layer in a CUDA graph and replay it"));
    cuda_only.push_back(
        cmd->add_flag("--early-launch", c->early_launch,
                      "cuda: start the receive kernels while the send kernels run (programmatic "
                      "dependent launch; ignored when ranks share a GPU)"));
    cuda_only.push_back(
        cmd->add_flag("--separate-plan", c->separate_plan,
                      "cuda: plan each call in a one-block kernel of its own rather than in the "
                      "dispatch send kernel's first block"));
    cuda_only.push_back(cmd->add_flag(
        "--whole-combine", c->whole_combine,
        "cuda, ranks on other nodes: hand each remote rank's combine rows to the host "
        "proxy once the kernel wrote them all, rather than piece by piece as written"));
    cuda_only.push_back(
        cmd->add_flag("--trace", c->trace,
                      "cuda: print when each kernel's first and last block reached each phase"));
    cuda_only.push_back(
        cmd->add_option(
               "--send-blocks", c->send_blocks,
               "cuda: blocks of the dispatch and combine send kernels (0: library default)")
            ->capture_default_str());
    cuda_only.push_back(cmd->add_flag(
        "--floor", c->floor,
        "cuda, ranks on other nodes: also time the proxied path's floor in the same run "
        "(a plain write loop of each rank's remote bytes on --provider, plus the mapped "
        "path's layer) and print layer p50 / floor"));
    cuda_only.push_back(
        cmd->add_option("--proxy-chunk", c->proxy_chunk,
                        "cuda: bytes per host proxy write (longer puts go as several; 0: one write "
                        "per put); the --floor loop writes the same pieces")
            ->capture_default_str());
    cmd->add_option("--iters", c->iters, "timed layers, 1..1000000")->capture_default_str();
    cmd->add_option("--json", *json_path, "write the results as JSON to this file")
        ->check(output_file());
    cmd->callback([c, dtype, json_path, per_node, combine, cuda_only] {
        // A cuda flag on the cpu backend changed nothing, and the run did not say so.
        for (const CLI::Option* o : cuda_only) {
            if (c->backend == "cpu" && o->count() > 0) {
                fail(invalid_argument(fmt::format("bench moe: {} is for --backend cuda, not {}",
                                                  o->get_name(), c->backend)));
                return;
            }
        }
        if (per_node->count() == 0) {
            // The cuda backend puts every rank on one node unless asked to split them; the cpu
            // one makes nodes of 4 where 4 divides --ranks (`--ranks 2` was refused naming a
            // ranks_per_node 4 the user never gave).
            c->ranks_per_node = c->backend == "cuda" ? c->ranks : 4;
            while (c->ranks_per_node > 1 && c->ranks % c->ranks_per_node != 0) --c->ranks_per_node;
        } else if (c->ranks_per_node == 0 || c->ranks % c->ranks_per_node != 0) {
            fail(invalid_argument(
                fmt::format("bench moe: --ranks-per-node {} must divide --ranks {} (whole nodes)",
                            c->ranks_per_node, c->ranks)));
            return;
        }
        if (!moe::parse_dtype(*dtype, &c->dtype)) {
            fail(invalid_argument(fmt::format("--dtype {}: use fp8 or bf16", *dtype)));
            return;
        }
        if (!moe::parse_combine_mode(*combine, &c->combine)) {
            fail(invalid_argument(fmt::format("--combine {}: use per-hit or per-rank", *combine)));
            return;
        }
        auto rep = moe::run_moe_bench(*c);
        if (!rep.ok()) {
            fail(rep.status());
            return;
        }
        std::printf("%s", moe::format_moe_table(*rep).c_str());
        if (!rep->verified)
            fail(internal_error("bench moe: combine did not give back the dispatched values"));
        if (!json_path->empty()) {
            auto j = moe::moe_report_json(*rep);
            j["command"] = "ferry bench moe";
            Status s = write_json_file(*json_path, j);
            if (!s.ok()) fail(s);
        }
    });
}

}  // namespace ferry::cli
