#include "cli/stop_signal.h"

#include <csignal>

namespace ferry::cli {
namespace {

std::atomic<bool> g_stop{false};

extern "C" void on_stop_signal(int) { g_stop.store(true); }

}  // namespace

const std::atomic<bool>& stop_requested() {
    static const bool installed = [] {
        struct sigaction sa {};
        sa.sa_handler = on_stop_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, nullptr);
        sigaction(SIGTERM, &sa, nullptr);
        return true;
    }();
    (void)installed;
    return g_stop;
}

}  // namespace ferry::cli
