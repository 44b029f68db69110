// The `ferry` binary: argument parsing and printing only; the work is in the library.
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "ferry/common/log.h"

int main(int argc, char** argv) {
    CLI::App app{"ferry: data movement for disaggregated and expert-parallel LLM inference"};
    app.require_subcommand(1);
    std::string level = "warn";
    app.add_option("--log-level", level, "debug|info|warn|error|off")->capture_default_str();
    app.parse_complete_callback([&] {
        ferry::LogLevel l;
        if (!ferry::parse_log_level(level, &l))
            throw CLI::ValidationError("--log-level",
                                       "must be debug, info, warn, error or off, not " + level);
        ferry::set_log_level(l);
    });

    auto* bench = app.add_subcommand("bench", "benchmarks");
    bench->require_subcommand(1);
    ferry::cli::register_commands(app, *bench);

    CLI11_PARSE(app, argc, argv);
    return ferry::cli::exit_code();
}
