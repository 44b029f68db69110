// `ferry bench kv`: per-request KV transfer latency and bandwidth in push, pull (background) and
// pull-inline modes, beside the provider's raw write ceiling measured in the same run.
//
// Every rank (prefill and decode, any TP) is an engine with its own pool and connector in this
// process, each driven from its own calls; the transfers go through the provider exactly as
// between processes. Call before this process opened any libfabric object (the ceiling
// measurement forks).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/kv/connector.h"
#include "ferry/kv/layout.h"

namespace ferry::kv {

// Smallest --max-write `bench kv` takes: one page.
inline constexpr size_t kMinBenchMaxWrite = 4096;

struct KvBenchConfig {
    std::string mode = "push";  // push | pull | pull-inline
    std::vector<uint32_t> tokens = {1024, 4096, 16384};
    uint32_t layers = 64;
    uint32_t kv_heads = 8;  // in total, split over the TP ranks
    uint32_t head_dim = 128;
    uint32_t elem_size = 2;
    uint32_t block_size = 16;
    uint32_t tp_prefill = 1;
    uint32_t tp_decode = 1;
    // How each side's pool is registered: one region, one per layer, one per layer and K/V.
    RegionSplit regions_prefill = RegionSplit::kOne;
    RegionSplit regions_decode = RegionSplit::kOne;
    std::string provider = "shm";
    int iters = 5;
    // Scattered block ids (a long-running server's pool) instead of consecutive ones.
    bool random_blocks = false;
    bool measure_ceiling = true;
    // The engine's longest single write, at least kMinBenchMaxWrite; 0 keeps the engine default.
    size_t max_write_size = 0;
    // Pools in GPU memory: prefill ranks on GPU 0, decode ranks on GPU 1 (or 0 when only one
    // is visible); transfers go over CUDA IPC / NVLink and the ceiling is the GPU-to-GPU copy.
    bool gpu = false;
    // Check every transferred byte of the first (untimed) request of each size.
    bool verify = true;
    // Engine workers poll without napping, as a serving process with a core per worker would
    // run them (and as the raw ceiling's target does): shm copies large writes on the
    // receiving side while it polls, so a napping decode engine throttles the transfer.
    bool busy_poll = true;
    bool run_on_caller = true;                 // ConnectorConfig::run_on_caller
    PullKeys pull_keys = PullKeys::kPerOffer;  // ConnectorConfig::pull_keys
    // Push: how long after prefill's connectors counted the REGISTERs prefill_done is called
    // (prefill's compute in serving; at 0 the call meets the REGISTER's own handling).
    uint32_t settle_us = 1000;
    // Pull: how long decode waits after prefill's offers before it pulls (the router's round
    // trip and decode's scheduling in serving); not in the time measured.
    uint32_t offer_wait_ms = 0;
    std::function<void(const std::string&)> progress;
};

struct KvBenchRow {
    std::string mode;
    uint32_t tokens = 0;
    uint64_t bytes = 0;        // KV bytes per request, all ranks together
    uint64_t descriptors = 0;  // writes or reads per request, all rank pairs together
    double p50_ms = 0, p99_ms = 0;
    double gbps = 0;           // bytes / p50 latency
    double caller_us_p50 = 0;  // time in the caller's thread per request (busiest rank)
    double caller_us_p99 = 0;
    double caller_cpu_us_p50 = 0;  // CPU time of those calls (excludes being preempted)
};

struct KvBenchReport {
    std::string provider;
    // Same run: a raw fi_write loop of 1 MiB writes on the provider, or with --gpu the plain
    // GPU-to-GPU copy.
    double ceiling_gbps = 0;
    std::vector<KvBenchRow> rows;
};

Result<KvBenchReport> run_kv_bench(const KvBenchConfig& config);
std::string format_kv_table(const KvBenchConfig& config, const KvBenchReport& report);
nlohmann::json kv_report_json(const KvBenchConfig& config, const KvBenchReport& report);

}  // namespace ferry::kv
