#include <cstdio>

#include "bench/gpu.h"
#include "cli/commands.h"
#include "cli/util.h"

namespace ferry::cli {

void register_bench_gpu(CLI::App& bench) {
    auto* cmd = bench.add_subcommand("gpu",
                                     "TransferEngine between GPU memory of two processes "
                                     "(CUDA IPC over NVLink) beside the peer-copy ceiling");
    auto c = std::make_shared<GpuBenchConfig>();
    auto json_path = std::make_shared<std::string>();
    cmd->add_option("--bytes", c->bytes, "bytes per transfer")->capture_default_str();
    cmd->add_option("--pages", c->pages, "page sizes for paged writes")->delimiter(',');
    cmd->add_option("--modes", c->copy_modes, "kernel,copy-engine")->delimiter(',');
    cmd->add_option("--iters", c->iters, "timed transfers per point, 1..1000000")
        ->capture_default_str();
    cmd->add_option("--json", *json_path, "write the results as JSON to this file")
        ->check(output_file());
    cmd->callback([c, json_path] {
        c->progress = [](const std::string& l) { std::fprintf(stderr, "  %s\n", l.c_str()); };
        auto rep = run_gpu_bench(*c);
        if (!rep.ok()) {
            fail(rep.status());
            return;
        }
        std::printf("%s", format_gpu_table(*rep).c_str());
        if (!json_path->empty()) {
            Status s = write_json_file(*json_path, gpu_report_json(*rep));
            if (!s.ok()) fail(s);
        }
    });
}

}  // namespace ferry::cli
