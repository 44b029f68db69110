// Minimal leveled logging, to stderr unless the program sets a sink (the Python module hands
// the lines to Python's logging). The level is set by the program (the CLI reads --log-level,
// the Python module follows the "ferry" logger's); the library never reads the environment.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace ferry {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
bool parse_log_level(std::string_view name, LogLevel* out);
void log_line(LogLevel level, std::string_view component, std::string_view message);

// Where log_line's lines go: sink(level, component, message, seconds since the epoch) instead
// of stderr; nullptr, the default, is stderr. The sink runs on the thread that logs (any of the
// library's) and must neither block nor call back into the library.
using LogSink = void (*)(LogLevel level, std::string_view component, std::string_view message,
                         double epoch_seconds);
void set_log_sink(LogSink sink);

template <typename... Args>
void log(LogLevel level, std::string_view component, fmt::format_string<Args...> f,
         Args&&... args) {
    if (level < log_level()) return;
    log_line(level, component, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace ferry
