// Time and deadlines. Every wait in ferry has one.
#pragma once

#include <chrono>
#include <cstdint>

namespace ferry {

using Clock = std::chrono::steady_clock;
using Duration = Clock::duration;
using TimePoint = Clock::time_point;
using std::chrono::microseconds;
using std::chrono::milliseconds;
using std::chrono::seconds;

inline TimePoint deadline_after(Duration d) { return Clock::now() + d; }

inline double to_us(Duration d) { return std::chrono::duration<double, std::micro>(d).count(); }
inline double to_ms(Duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

inline uint64_t now_ns() {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
            .count());
}

}  // namespace ferry
