// Minimal leveled logging to stderr. The level is set by the program (the CLI reads
// --log-level); the library never reads the environment.
#pragma once

#include <fmt/format.h>

#include <string_view>

namespace ferry {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

void set_log_level(LogLevel level);
LogLevel log_level();
bool parse_log_level(std::string_view name, LogLevel* out);
void log_line(LogLevel level, std::string_view component, std::string_view message);

template <typename... Args>
void log(LogLevel level, std::string_view component, fmt::format_string<Args...> f,
         Args&&... args) {
    if (level < log_level()) return;
    log_line(level, component, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace ferry
