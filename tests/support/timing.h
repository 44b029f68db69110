// Latency targets in tests are checked on the best of a few attempts. The suite runs two tests
// at a time on a 2-core machine, some of them busy-polling processes, so one descheduling of
// the measuring thread can cost more than a 100 ms target. What such a target exists to catch
// (a server that serialises clients, a wait that restarts per byte) fails every attempt, so
// the best of three still catches it.
#pragma once

#include <algorithm>
#include <cstdio>

namespace ferry::testing {

// Runs `attempt` (returning a time in ms) until one is under `target_ms` or `attempts` ran;
// returns the fastest. Every attempt's time is printed, so a slow first one is visible.
template <class F>
double best_of(int attempts, double target_ms, const char* what, F&& attempt) {
    double best = 1e300;
    for (int i = 0; i < attempts && best >= target_ms; ++i) {
        double ms = attempt();
        std::printf("%s, attempt %d: %.2f ms\n", what, i + 1, ms);
        best = std::min(best, ms);
    }
    return best;
}

}  // namespace ferry::testing
