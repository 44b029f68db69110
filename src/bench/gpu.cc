// Formatting for `ferry bench gpu` (the measurement itself is in cuda/gpu.cc).
#include "bench/gpu.h"

#include <fmt/format.h>

namespace ferry {

#ifndef FERRY_HAVE_CUDA
Result<GpuBenchReport> run_gpu_bench(const GpuBenchConfig&) {
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
