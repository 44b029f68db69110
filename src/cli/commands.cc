#include "cli/commands.h"

namespace ferry::cli {
namespace {
int g_exit_code = 0;
}

int exit_code() { return g_exit_code; }
void set_exit_code(int code) { g_exit_code = code; }

void register_commands(CLI::App& app, CLI::App& bench) {
    register_bench_xfer(bench);
    register_bench_gpu(bench);
    register_bench_kv(bench);
    register_bench_moe(bench);
#ifdef FERRY_HAVE_SERVE
    register_bench_serve(bench);
    register_bench_relay(bench);
    register_serve(app);
#endif
}

}  // namespace ferry::cli
