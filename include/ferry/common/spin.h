// Polling: bounded spin-waits (a waiter that polls a flag for a while before it sleeps), and
// what a polling thread (a rail's worker, the bench's raw loop) does on a pass that found
// nothing to do while work is outstanding: spin on the core when the host has cores to spare,
// give the core away when busy threads outnumber cores.
#pragma once

#include <sched.h>

#include <thread>

#include "ferry/common/clock.h"

namespace ferry {

// One spin-wait step: tells the core this thread is polling (x86 pause, Arm yield), so its
// sibling hyperthread and the power management see it.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
}

// Polls ready() for at most `spin`, then says whether it holds. A waiter that spins before it
// sleeps on a condition variable skips the wake-up (a futex wake, and on a VM an idle vCPU
// brought back) when the event comes soon. It costs a core while it spins, so callers spin
// only where there are cores to spare (docs/BENCHMARKS.md has the figures).
template <typename Ready>
bool spin_until(Ready&& ready, Duration spin) {
    if (spin <= Duration::zero()) return ready();
    TimePoint end = Clock::now() + spin;
    for (;;) {
        for (int i = 0; i < 32; ++i) {
            if (ready()) return true;
            cpu_relax();
        }
        if (Clock::now() >= end) return ready();
    }
}

// CPUs this process may run on (its affinity mask), at least 1.
inline int usable_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) != 0) {
        unsigned n = std::thread::hardware_concurrency();
        return n ? static_cast<int>(n) : 1;
    }
    int n = CPU_COUNT(&set);
    return n > 0 ? n : 1;
}

// An empty pass costs a sched_yield system call when cores are scarce (the submitter may be
// waiting for this core: on the 2-core dev machine, before the yield, 64 KiB writes ran at
// 0.2-0.4x of the raw loop), and a pause instruction otherwise, with a yield every 256th
// empty pass so that an unexpectedly crowded host still gets its turn. Measured on the 16-core
// host (shm, `ferry bench xfer --repeat 3 --seconds 0.2`, 2026-12-02, same build, one run):
// the rail worker yielding on every empty pass gave 64 KiB writes 0.71x of the raw loop and
// single 64 B writes 0.70x; pausing instead, 0.92x-1.08x and 0.80x.
class IdleWait {
  public:
    IdleWait() : spin_(usable_cpus() >= kSpinFromCpus) {}
    explicit IdleWait(bool spin) : spin_(spin) {}

    void operator()() {
        if (spin_ && (++passes_ & 255) != 0) {
            cpu_relax();
            return;
        }
        std::this_thread::yield();
    }
    bool spins() const { return spin_; }

    // Below this many usable CPUs the polling threads of two engines (a worker and a submitter
    // each) and the build beside them outnumber the cores.
    static constexpr int kSpinFromCpus = 4;

  private:
    bool spin_;
    unsigned passes_ = 0;
};

}  // namespace ferry
