// The `ferry` binary: argument parsing and printing only; the work is in the library.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <exception>
#include <new>
#include <optional>

#include "cli/commands.h"
#include "ferry/common/log.h"

namespace {

std::vector<CLI::App*> subcommands_of(CLI::App* app) {
    return app->get_subcommands([](CLI::App*) { return true; });
}

// The command path argv names, checked before CLI11 parses it: CLI11 answers an unknown or a
// missing command alike with "A subcommand is required", naming neither the word it did not
// know nor the commands there are.
std::optional<std::string> command_error(CLI::App& app, int argc, char** argv) {
    CLI::App* at = &app;
    std::string path = "ferry";
    auto names = [](const std::vector<CLI::App*>& subs) {
        std::string s;
        for (const CLI::App* sub : subs) s += (s.empty() ? "" : ", ") + sub->get_name();
        return s;
    };
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        if (subcommands_of(at).empty()) return std::nullopt;  // a command: its own flags follow
        if (arg == "-h" || arg == "--help" || arg == "--help-all" || arg == "--version")
            return std::nullopt;
        if (arg.starts_with("-")) {
            // An option of this level (--log-level): its value is not a command. Any other was
            // answered with "a command is required" (`ferry --verbose bench xfer`).
            size_t eq = arg.find('=');
            CLI::Option* opt = at->get_option_no_throw(arg.substr(0, eq));
            if (opt == nullptr)
                return fmt::format("{}: unknown option '{}' ({} --help)", path, arg.substr(0, eq),
                                   path);
            if (opt != nullptr && eq == std::string::npos && opt->get_items_expected_min() > 0) ++i;
            continue;
        }
        CLI::App* next = nullptr;
        for (CLI::App* sub : subcommands_of(at))
            if (sub->check_name(arg)) next = sub;
        if (next == nullptr)
            return fmt::format("{}: unknown command '{}': use one of {} ({} --help)", path, arg,
                               names(subcommands_of(at)), path);
        at = next;
        path += " " + arg;
    }
    if (subcommands_of(at).empty()) return std::nullopt;
    return fmt::format("{}: a command is required: one of {} ({} --help)", path,
                       names(subcommands_of(at)), path);
}

// libfabric links libinfinipath (its psm provider), whose constructor installs handlers for
// SIGINT, SIGTERM and the crash signals that print a backtrace and call exit(1) inside the
// handler, and then spends ~0.1-0.2 s calibrating its clock on CPU 0 before main runs. A SIGTERM
// in that window (a supervisor stopping a process it just started) ended `ferry serve` with
// status 1 and no word. The executable's .preinit_array runs before any library's constructor:
// SIGINT and SIGTERM are blocked there, and main unblocks them once its own handling is in
// place, so a signal that came early is taken as if it came then.
void mask_stop_signals(int how) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigprocmask(how, &set, nullptr);
}
void block_stop_signals(int, char**, char**) { mask_stop_signals(SIG_BLOCK); }
__attribute__((section(".preinit_array"),
               used)) void (*g_block_stop_signals)(int, char**, char**) = block_stop_signals;

}  // namespace

int main(int argc, char** argv) {
    // libinfinipath's handlers (above): SIGTERM ran the exit path beside running threads (a
    // benchmark left behind by `timeout`, hung on a lock; an abort), Ctrl-C ended a run with
    // status 1, a crash looked like a failed run. The defaults come back before anything runs
    // (serve installs its own for SIGINT and SIGTERM), then a signal held since before main is
    // delivered: it ends the process as that signal.
    for (int sig : {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT}) std::signal(sig, SIG_DFL);
    mask_stop_signals(SIG_UNBLOCK);
    CLI::App app{"ferry: data movement for disaggregated and expert-parallel LLM inference"};
    app.require_subcommand(1);
    app.set_version_flag("--version", "ferry " FERRY_VERSION);
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

    if (auto error = command_error(app, argc, argv)) {
        fmt::print(stderr, "{}\n", *error);
        return 2;
    }
    // Not CLI11_PARSE: it lets anything but a parse error escape, and an exception out of a
    // command (std::bad_alloc from `bench relay --input-len 100000000000`) ended the process
    // with "terminate called" and a backtrace instead of a line saying what happened.
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e);
    } catch (const std::bad_alloc&) {
        fmt::print(stderr,
                   "ferry: out of memory: a size or count flag asks for more than this machine "
                   "has\n");
        return 1;
    } catch (const std::exception& e) {
        fmt::print(stderr, "ferry: {}\n", e.what());
        return 1;
    }
    return ferry::cli::exit_code();
}
