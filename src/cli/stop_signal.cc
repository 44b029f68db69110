#include "cli/stop_signal.h"

#include <csignal>

namespace ferry::cli {
namespace {

std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};

extern "C" void on_stop_signal(int sig) {
    g_signal.store(sig);
    g_stop.store(true);
}

}  // namespace

const std::atomic<bool>& stop_requested() {
    static const bool installed = [] {
        struct sigaction sa {};
        sa.sa_handler = on_stop_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, nullptr);
        sigaction(SIGTERM, &sa, nullptr);
        // The terminal a serve process was started from closing: a clean stop too (by
        // default SIGHUP ended it on the spot, its shm files left for the next engine).
        sigaction(SIGHUP, &sa, nullptr);
        return true;
    }();
    (void)installed;
    return g_stop;
}

const char* stop_signal_name() {
    switch (g_signal.load()) {
        case SIGINT:
            return "SIGINT";
        case SIGTERM:
            return "SIGTERM";
        case SIGHUP:
            return "SIGHUP";
        default:
            return "a stop signal";
    }
}

}  // namespace ferry::cli
