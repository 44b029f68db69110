// Bounds on the benchmarks' counts, checked before anything is allocated or started: a typo
// (`--iters 1000000000`, `--ranks 1024`) is refused at once, naming the flag, instead of running
// for days or spawning a thread and a set of buffers per rank until the host runs out of memory.
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <cstdint>
#include <string_view>

#include "ferry/common/status.h"

namespace ferry::bench {

// Timed (or warm-up) iterations of one measurement: a million is hours at the slowest points.
inline constexpr int64_t kMaxIters = 1'000'000;
// Ranks (threads, each with its own buffers) one benchmark process runs: 64 is 8 nodes of 8
// GPUs, the largest expert-parallel group measured (docs/BENCHMARKS.md uses up to 8).
inline constexpr int64_t kMaxRanks = 64;
// MoE tokens per rank and call: prefill batches reach a few thousand, decode a few hundred.
inline constexpr int64_t kMaxMoeTokens = 65'536;

// "bench moe: --iters must be in [1, 1000000], got 0".
inline Status check_bench_range(std::string_view bench, std::string_view flag, int64_t value,
                                int64_t lo, int64_t hi) {
    if (value >= lo && value <= hi) return ok_status();
    return invalid_argument(
        fmt::format("bench {}: {} must be in [{}, {}], got {}", bench, flag, lo, hi, value));
}

// What one benchmark may allocate: half of this host's memory, the rest left to the system and
// to whatever else runs there. A size flag past it was a std::bad_alloc out of the forked
// target (or, below what overcommit refuses, minutes of zero-filling and the OOM killer).
inline double bench_memory_limit() {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return 1e300;  // unknown: let the allocation tell
    return 0.5 * static_cast<double>(pages) * static_cast<double>(page);
}

// `what` names the flags and how they add up; `bytes` is a double so that no product of
// flag values overflows before it is checked.
inline Status check_bench_memory(std::string_view bench, std::string_view what, double bytes) {
    const double limit = bench_memory_limit();
    if (bytes <= limit) return ok_status();
    constexpr double kGiB = 1024.0 * 1024 * 1024;
    return resource_exhausted(fmt::format(
        "bench {}: {} need {:.1f} GiB of memory, more than half of this host's {:.1f} GiB; "
        "use smaller values",
        bench, what, bytes / kGiB, 2 * limit / kGiB));
}

}  // namespace ferry::bench
