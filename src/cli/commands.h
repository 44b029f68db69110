// Each subcommand registers itself here; main() only parses.
#pragma once

#include <CLI/CLI.hpp>

namespace ferry::cli {

void register_commands(CLI::App& app, CLI::App& bench);
void register_bench_xfer(CLI::App& bench);
void register_bench_gpu(CLI::App& bench);
void register_bench_kv(CLI::App& bench);
void register_bench_moe(CLI::App& bench);
void register_bench_serve(CLI::App& bench);
void register_bench_relay(CLI::App& bench);
void register_serve(CLI::App& app);
void register_topo(CLI::App& app);

// For flags where 0 means nothing useful (threads, body limit, timeouts): "must be greater
// than 0". Negative and non-finite values of every numeric flag are refused anyway
// (register_commands).
CLI::Validator positive_number();

// For counts with a ceiling: "must be at most <limit> (<why>), got <value>".
CLI::Validator at_most(double limit, const std::string& why);

// For flags naming a file the command writes at its end (--json, --result-file): checked when
// the flags are parsed, so a path that cannot be written fails at once rather than after a run
// of minutes.
CLI::Validator output_file();

// Exit status set by the subcommand that ran.
int exit_code();
void set_exit_code(int code);

}  // namespace ferry::cli
