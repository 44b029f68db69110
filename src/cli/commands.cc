#include "cli/commands.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>

namespace ferry::cli {
namespace {
int g_exit_code = 0;

// Every count, size, port and duration of the CLI is non-negative and finite. CLI11 converts
// "-1" into a size_t as 2^64 - 1 (`bench serve --num-prompts -1` allocated until the machine
// ran out of memory) and takes "nan" for a double (no range check is ever true for it), so
// each numeric flag is checked here once, by its value's text, before any conversion.
std::string finite_non_negative(std::string& text) {
    const char* begin = text.c_str();
    char* end = nullptr;
    double v = std::strtod(begin, &end);
    if (end == begin) return {};  // not a number: CLI11's conversion names the problem
    if (!std::isfinite(v)) return "must be a finite number, not " + text;
    if (v < 0) return "must not be negative, got " + text;
    return {};
}

// Seconds flags become nanosecond durations: 1e300 overflowed into a negative one
// (`bench serve --wait-health 1e300` did not wait at all). 1e9 s is 31 years.
std::string not_absurd(std::string& text) {
    const char* begin = text.c_str();
    char* end = nullptr;
    double v = std::strtod(begin, &end);
    if (end != begin && v > 1e9) return "must be at most 1e9, got " + text;
    return {};
}

// CLI11 converts an empty value into 0 for a number (`--max-body-bytes ''` was a limit of 0
// bytes, `--tp ''` "TP degree must be >= 1, got 0") and keeps it for a string (`--engine-id ''`
// fell back to the default id, `--secret-file ''` to the default secret): an unset shell
// variable in a script. No flag of ferry takes an empty value, and none is needed to ask for a
// default (leave the flag out), so an empty value is refused here, naming the flag. (CLI11
// drops the empty items of a list itself: "4096,,8192" is two sizes.)
std::string not_empty(std::string& text) {
    return text.empty() ? "needs a value, got an empty string" : std::string();
}

void check_flag_values(CLI::App& app) {
    for (CLI::Option* opt : app.get_options()) {
        // Flags (--verify) take no value; their empty result is CLI11's own.
        if (opt->get_items_expected_min() == 0) continue;
        opt->check(CLI::Validator(not_empty, ""));
        // The type name is INT, UINT or FLOAT for numbers, followed by ":..." for validators.
        const std::string type = opt->get_type_name();
        const std::string base = type.substr(0, type.find(':'));
        if (base != "INT" && base != "UINT" && base != "FLOAT") continue;
        opt->check(CLI::Validator(finite_non_negative, ""));
        if (base == "FLOAT") opt->check(CLI::Validator(not_absurd, ""));
        if (opt->get_name().find("port") != std::string::npos)
            opt->check(CLI::Range(0, 65535).description(""));
    }
    for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
        check_flag_values(*sub);
}

}  // namespace

CLI::Validator positive_number() {
    return CLI::Validator(
        [](std::string& text) -> std::string {
            const char* begin = text.c_str();
            char* end = nullptr;
            double v = std::strtod(begin, &end);
            if (text.empty()) return not_empty(text);
            if (end != begin && !(v > 0)) return "must be greater than 0, got " + text;
            return {};
        },
        "> 0");
}

CLI::Validator at_most(double limit, const std::string& why) {
    return CLI::Validator(
        [limit, why](std::string& text) -> std::string {
            const char* begin = text.c_str();
            char* end = nullptr;
            double v = std::strtod(begin, &end);
            if (end != begin && v > limit)
                return fmt::format("must be at most {} ({}), got {}", limit, why, text);
            return {};
        },
        "");
}

CLI::Validator output_file() {
    return CLI::Validator(
        [](std::string& path) -> std::string {
            std::error_code ec;
            if (std::filesystem::is_directory(path, ec)) return path + " is a directory";
            // /dev/stdout, a FIFO: written in place (write_json_file), so that one must be
            // writable, not its folder.
            const auto kind = std::filesystem::status(path, ec).type();
            if (!ec && kind != std::filesystem::file_type::not_found &&
                kind != std::filesystem::file_type::regular) {
                if (::access(path.c_str(), W_OK) != 0)
                    return fmt::format("{}: cannot write it: {}", path, std::strerror(errno));
                return {};
            }
            // A symlink's file is written where it points.
            std::filesystem::path file = path;
            if (std::filesystem::is_symlink(path, ec)) {
                auto resolved = std::filesystem::weakly_canonical(path, ec);
                if (!ec) file = resolved;
            }
            std::filesystem::path dir = file.parent_path();
            if (dir.empty()) dir = ".";
            if (::access(dir.c_str(), W_OK) != 0)
                return fmt::format("{}: cannot write in {}: {}", path, dir.string(),
                                   std::strerror(errno));
            return {};
        },
        "");
}

int exit_code() { return g_exit_code; }
void set_exit_code(int code) { g_exit_code = code; }

void register_commands(CLI::App& app, CLI::App& bench) {
    register_bench_xfer(bench);
    register_bench_gpu(bench);
    register_bench_kv(bench);
    register_bench_moe(bench);
    register_topo(app);
#ifdef FERRY_HAVE_SERVE
    register_bench_serve(bench);
    register_bench_relay(bench);
    register_serve(app);
#endif
    check_flag_values(app);
}

}  // namespace ferry::cli
