#include "cli/commands.h"

namespace ferry::cli {

void register_bench_xfer(CLI::App& bench) {
    auto* cmd = bench.add_subcommand("xfer", "TransferEngine bandwidth and latency");
    (void)cmd;
}

}  // namespace ferry::cli
