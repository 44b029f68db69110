// Formatting for `ferry bench gpu` (the measurement itself is in cuda/gpu.cc).
#include "bench/gpu.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "bench/limits.h"

namespace ferry {
namespace {
// The largest --bytes: the target holds twice it on one GPU (an H200 has 141 GB).
constexpr int64_t kMaxGpuBenchBytes = int64_t{64} << 30;
// Pages of one paged write: each has a 32-bit id on both sides, in host vectors built per
// page size (16 Mi pages are 128 MiB of ids; 1-byte pages of 64 GiB would be 512 GiB).
constexpr size_t kMaxGpuBenchPages = size_t{1} << 24;
}  // namespace

Status check_gpu_bench_config(const GpuBenchConfig& c) {
    // Both before anything looks for a GPU: `--iters 1000000000` ran for days on a GPU host,
    // `--bytes 1e19` overflowed the target's 2 x --bytes allocation.
    FERRY_RETURN_IF_ERROR(bench::check_bench_range(
        "gpu", "--bytes", static_cast<int64_t>(std::min<size_t>(c.bytes, INT64_MAX)), 1,
        kMaxGpuBenchBytes));
    FERRY_RETURN_IF_ERROR(bench::check_bench_range("gpu", "--iters", c.iters, 1, bench::kMaxIters));
    for (size_t p : c.pages) {
        if (p == 0 || p > c.bytes)
            return invalid_argument(
                fmt::format("bench gpu: --pages: {} is not in [1, --bytes {}]", p, c.bytes));
        if (c.bytes / p > kMaxGpuBenchPages)
            return invalid_argument(fmt::format(
                "bench gpu: --pages: {} B pages make {} pages of --bytes {}, at most {}; use "
                "larger pages",
                p, c.bytes / p, c.bytes, kMaxGpuBenchPages));
    }
    if (c.copy_modes.empty()) return invalid_argument("bench gpu: --modes: give at least one");
    for (const std::string& m : c.copy_modes) {
        if (m != "kernel" && m != "copy-engine" && m != "auto")
            return invalid_argument(fmt::format(
                "bench gpu: --modes: '{}' is not a copy mode (kernel, copy-engine or auto)", m));
    }
    return ok_status();
}

#ifndef FERRY_HAVE_CUDA
Result<GpuBenchReport> run_gpu_bench(const GpuBenchConfig& c) {
    FERRY_RETURN_IF_ERROR(check_gpu_bench_config(c));
    return unavailable("this build of ferry has no CUDA support; build where nvcc is found");
}
#endif

std::string format_gpu_table(const GpuBenchReport& r) {
    std::string out = fmt::format(
        "ferry bench gpu — {} (two processes, CUDA IPC)\n"
        "GPU-to-GPU copy ceiling (cudaMemcpyPeerAsync): {:.1f} GB/s\n\n",
        r.devices, r.ceiling_gbps);
    out += fmt::format("{:<22} {:<12} {:>9} {:>10} {:>10} {:>7}\n", "operation", "copy mode",
                       "size", "GB/s", "time us", "ratio");
    for (const auto& row : r.rows) {
        out += fmt::format("{:<22} {:<12} {:>9} {:>10.1f} {:>10.1f} {:>6.2f}x\n", row.kind,
                           row.mode, row.size, row.gbps_median, row.us_median, row.ratio);
    }
    return out;
}

nlohmann::json gpu_report_json(const GpuBenchReport& r) {
    nlohmann::json j;
    j["benchmark"] = "gpu";
    j["devices"] = r.devices;
    j["ceiling_gbps"] = r.ceiling_gbps;
    for (const auto& row : r.rows) {
        j["rows"].push_back({{"kind", row.kind},
                             {"mode", row.mode},
                             {"size", row.size},
                             {"gbps_median", row.gbps_median},
                             {"us_median", row.us_median},
                             {"ratio", row.ratio}});
    }
    return j;
}

}  // namespace ferry
