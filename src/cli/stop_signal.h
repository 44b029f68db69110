// Ctrl-C and SIGTERM at the CLI edge: long-running commands poll this flag and shut down.
#pragma once

#include <atomic>

namespace ferry::cli {

// Installs SIGINT/SIGTERM handlers (once) and returns the flag they set.
const std::atomic<bool>& stop_requested();

// The signal that set the flag ("SIGINT", "SIGTERM"), for the line a command prints as it stops.
const char* stop_signal_name();

}  // namespace ferry::cli
