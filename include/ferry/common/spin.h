// Bounded spin-waits, for a waiter that polls a flag for a while before it sleeps.
#pragma once

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

}  // namespace ferry
