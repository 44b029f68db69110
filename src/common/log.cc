#include "ferry/common/log.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>

namespace ferry {
namespace {
std::atomic<LogLevel> g_level{LogLevel::kWarn};
std::atomic<LogSink> g_sink{nullptr};
}  // namespace

void set_log_sink(LogSink sink) { g_sink.store(sink, std::memory_order_release); }

void set_log_level(LogLevel level) { g_level.store(level, std::memory_order_relaxed); }
LogLevel log_level() { return g_level.load(std::memory_order_relaxed); }

bool parse_log_level(std::string_view name, LogLevel* out) {
    if (name == "debug")
        *out = LogLevel::kDebug;
    else if (name == "info")
        *out = LogLevel::kInfo;
    else if (name == "warn")
        *out = LogLevel::kWarn;
    else if (name == "error")
        *out = LogLevel::kError;
    else if (name == "off")
        *out = LogLevel::kOff;
    else
        return false;
    return true;
}

void log_line(LogLevel level, std::string_view component, std::string_view message) {
    static const char* names[] = {"debug", "info", "warn", "error", "off"};
    auto now = std::chrono::system_clock::now().time_since_epoch();
    double secs = std::chrono::duration<double>(now).count();
    if (LogSink sink = g_sink.load(std::memory_order_acquire)) {
        sink(level, component, message, secs);
        return;
    }
    // One fprintf per line so lines from several threads do not interleave.
    std::fprintf(stderr, "[%.6f %s %d %.*s] %.*s\n", secs, names[static_cast<int>(level)],
                 static_cast<int>(getpid()), static_cast<int>(component.size()), component.data(),
                 static_cast<int>(message.size()), message.data());
}

}  // namespace ferry
