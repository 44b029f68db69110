#include <fmt/format.h>

#include <cstdio>
#include <fstream>

#include "bench/xfer.h"
#include "cli/commands.h"
#include "cli/util.h"

namespace ferry::cli {

void register_bench_xfer(CLI::App& bench) {
    auto* cmd = bench.add_subcommand(
        "xfer",
        "TransferEngine bandwidth and latency between two local processes, beside a "
        "plain fi_write loop on the same provider");
    auto c = std::make_shared<XferBenchConfig>();
    auto json_path = std::make_shared<std::string>();
    cmd->add_option("--provider", c->provider, "shm | tcp | efa | verbs | auto")
        ->capture_default_str();
    cmd->add_option("--sizes", c->sizes, "write sizes in bytes")->delimiter(',');
    cmd->add_option("--pages", c->pages, "page sizes for paged writes")->delimiter(',');
    cmd->add_option("--window", c->window, "writes in flight, 1..65536")->capture_default_str();
    cmd->add_option("--pages-per-op", c->pages_per_op, "pages per paged write, 1..512")
        ->capture_default_str();
    cmd->add_option("--seconds", c->seconds_per_point, "seconds per measurement")
        ->capture_default_str();
    cmd->add_option("--latency-iters", c->latency_iters,
                    "round trips of the write-with-immediate latency point (0: skip it)")
        ->capture_default_str();
    cmd->add_option("--latency-size", c->latency_size,
                    "bytes of each ping and pong of the latency point, 1..65536")
        ->capture_default_str();
    cmd->add_option("--wait-spin-us", c->wait_spin_us,
                    "the latency yardstick's wait_imm spin on both sides, microseconds")
        ->capture_default_str();
    cmd->add_flag("!--no-yardsticks", c->yardsticks,
                  "skip the 4 KiB rate yardsticks (the figures python3 -m ferry.bench_xfer "
                  "divides by)");
    cmd->add_flag("--yardsticks-only", c->yardsticks_only,
                  "only the yardsticks: the latency point and the 4 KiB write+imm rates to the "
                  "peer's engine, one write() per write and --rate-batch per write_runs");
    cmd->add_option("--rails", c->rails, "domains to open")->capture_default_str();
    cmd->add_option("--repeat", c->repeat,
                    "measure each point this many times, raw and engine alternating; best kept")
        ->capture_default_str();
    cmd->add_flag("--rate", c->rate,
                  "message-rate section: writes with immediates to 1/8/64 peers, scatters");
    cmd->add_option("--rate-sizes", c->rate_sizes, "rate section write sizes")->delimiter(',');
    cmd->add_option("--rate-peers", c->rate_peers, "rate section peer counts")->delimiter(',');
    cmd->add_option("--scatter-peers", c->scatter_peers, "scatter peer counts")->delimiter(',');
    cmd->add_flag("--rate-only", c->rate_only,
                  "the message-rate section alone (implies --rate): no bandwidth points, no "
                  "latency");
    cmd->add_option("--rate-rows", c->rate_rows,
                    "rate section rows to run: batch (write+imm through submit_batch), all "
                    "(batch+imm through submit_all), scatter")
        ->delimiter(',');
    cmd->add_option("--rate-batch", c->rate_batch, "writes per submit_batch in the rate section")
        ->capture_default_str();
    cmd->add_flag("!--no-inject", c->inject, "post small writes without FI_INJECT");
    cmd->add_flag("!--no-more", c->post_more, "post batches without FI_MORE");
    cmd->add_flag("--inject-completions", c->inject_completions,
                  "shm: injected writes keep their completion (EngineConfig::inject_completions)");
    cmd->add_option("--json", *json_path, "write the results as JSON to this file")
        ->check(output_file());
    cmd->callback([c, json_path] {
        c->progress = [](const std::string& line) { std::fprintf(stderr, "  %s\n", line.c_str()); };
        if (c->rate_only) c->rate = true;
        auto rep = run_xfer_bench(*c);
        if (!rep.ok()) {
            fail(rep.status());
            return;
        }
        std::printf("%s", format_xfer_table(*rep).c_str());
        if (!json_path->empty()) {
            auto j = xfer_report_json(*rep);
            j["command"] = "ferry bench xfer";
            Status s = write_json_file(*json_path, j);
            if (!s.ok()) fail(s);
        }
    });
}

}  // namespace ferry::cli
