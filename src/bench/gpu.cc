// Formatting for `ferry bench gpu` (the measurement itself is in cuda/gpu.cc).
#include "bench/gpu.h"

#include <fmt/format.h>

namespace ferry {

Status check_gpu_bench_config(const GpuBenchConfig& c) {
    if (c.bytes == 0) return invalid_argument("bench gpu: --bytes must be at least 1");
    if (c.iters < 1) return invalid_argument("bench gpu: --iters must be at least 1");
    for (size_t p : c.pages) {
        if (p == 0 || p > c.bytes)
            return invalid_argument(
                fmt::format("bench gpu: --pages: {} is not in [1, --bytes {}]", p, c.bytes));
    }
    if (c.copy_modes.empty()) return invalid_argument("bench gpu: --modes: give at least one");
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
