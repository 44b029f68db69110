// `ferry bench gpu`: TransferEngine writes between GPU memory of two processes on one host
// (CUDA IPC over NVLink), beside the GPU-to-GPU copy ceiling measured in the same run.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/common/status.h"

namespace ferry {

struct GpuBenchConfig {
    size_t bytes = 256ull << 20;  // per transfer
    std::vector<size_t> pages = {4096, 16384, 65536};
    std::vector<std::string> copy_modes = {"kernel", "copy-engine"};
    int iters = 10;
    int src_device = 0;
    int dst_device = 1;  // falls back to 0 when only one GPU is visible
    std::function<void(const std::string&)> progress;
};

struct GpuBenchRow {
    std::string kind;  // "ceiling memcpy peer", "write", "paged write"
    std::string mode;  // copy mode
    size_t size = 0;   // page size for paged writes, bytes for writes
    double gbps_median = 0;
    double us_median = 0;
    double ratio = 0;  // against the ceiling
};

struct GpuBenchReport {
    std::string devices;
    double ceiling_gbps = 0;
    std::vector<GpuBenchRow> rows;
};

Result<GpuBenchReport> run_gpu_bench(const GpuBenchConfig& config);
// The flags' values, checked before anything looks for a GPU (run_gpu_bench calls it).
Status check_gpu_bench_config(const GpuBenchConfig& config);
std::string format_gpu_table(const GpuBenchReport& r);
nlohmann::json gpu_report_json(const GpuBenchReport& r);

}  // namespace ferry
