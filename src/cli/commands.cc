#include "cli/commands.h"

#include <cmath>
#include <cstdlib>

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

void check_numeric_flags(CLI::App& app) {
    for (CLI::Option* opt : app.get_options()) {
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
        check_numeric_flags(*sub);
}

}  // namespace

CLI::Validator positive_number() {
    return CLI::Validator(
        [](std::string& text) -> std::string {
            const char* begin = text.c_str();
            char* end = nullptr;
            double v = std::strtod(begin, &end);
            if (end != begin && !(v > 0)) return "must be greater than 0, got " + text;
            return {};
        },
        "> 0");
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
    check_numeric_flags(app);
}

}  // namespace ferry::cli
