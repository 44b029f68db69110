// Latency targets in tests are checked on the best of a few attempts. The suite runs two tests
// at a time on a 2-core machine, some of them busy-polling processes, so one descheduling of
// the measuring thread can cost more than a 100 ms target. What such a target exists to catch
// (a server that serialises clients, a wait that restarts per byte) fails every attempt, so
// the best of three still catches it.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

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

// How late this process's threads get the CPU back while it lives: a thread sleeps 2 ms at a
// time and keeps the worst overshoot. A test that bounds how late something happens (a server
// closing a connection at its deadline) allows this much more, measured during the same run:
// on an idle machine it stays at a few ms and the bound is as tight as before, while a 2-core
// host running builds beside the suite stalled a nice 19 test process for over a second.
class StallWatch {
  public:
    StallWatch()
        : thread_([this] {
              constexpr auto kTick = std::chrono::milliseconds(2);
              while (!stop_.load()) {
                  auto t0 = std::chrono::steady_clock::now();
                  std::this_thread::sleep_for(kTick);
                  double late = std::chrono::duration<double, std::milli>(
                                    std::chrono::steady_clock::now() - t0 - kTick)
                                    .count();
                  if (late > worst_ms_.load()) worst_ms_.store(late);
              }
          }) {}
    ~StallWatch() {
        stop_.store(true);
        thread_.join();
    }
    StallWatch(const StallWatch&) = delete;
    StallWatch& operator=(const StallWatch&) = delete;

    // The worst lateness so far, in ms.
    double worst_ms() const { return worst_ms_.load(); }

  private:
    std::atomic<bool> stop_{false};
    std::atomic<double> worst_ms_{0};
    std::thread thread_;  // last: starts once the members it reads exist
};

}  // namespace ferry::testing
