// `ferry bench xfer`: TransferEngine bandwidth and latency between two local processes, with a
// plain libfabric write loop on the same provider measured in the same run as the ceiling.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/common/status.h"

namespace ferry {

struct XferBenchConfig {
    std::string provider = "shm";
    std::vector<size_t> sizes = {4096, 16384, 65536, 262144, 1048576, 4194304};
    std::vector<size_t> pages = {4096, 16384, 65536};
    int window = 64;        // fabric writes in flight
    int pages_per_op = 32;  // pages in one paged write
    double seconds_per_point = 0.5;
    int latency_iters = 2000;
    // Bytes of each ping and pong of the latency point (the latency yardstick's size).
    size_t latency_size = 64;
    // The latency yardstick's ping-pong waits in wait_imm on both sides, spinning this long
    // first (TransferEngine(wait_spin_us=...) in Python, whose benchmark passes its own).
    double wait_spin_us = 0;
    int rails = 1;
    // Each point is measured this many times, raw loop and engine alternating, and the best
    // of each kept: on a shared host the load moves between a raw and an engine measurement.
    int repeat = 1;
    // Message-rate section (opt-in): writes with immediates of rate_sizes to each count of
    // rate_peers, and 4 KiB scatters to each count of scatter_peers; the engine hands writes
    // over rate_batch at a time (submit_batch, and again as one operation with submit_all).
    bool rate = false;
    std::vector<size_t> rate_sizes = {64, 4096};
    std::vector<int> rate_peers = {1, 8, 64};
    std::vector<int> scatter_peers = {8, 64};
    int rate_batch = 32;
    // Which rows of the rate section run: "batch" (write+imm, submit_batch), "all" (batch+imm,
    // submit_all), "scatter".
    std::vector<std::string> rate_rows = {"batch", "all", "scatter"};
    // Only the rate section: no bandwidth points, no latency (a quick message-rate run, or one
    // under callgrind whose counts cover nothing else).
    bool rate_only = false;
    // The yardsticks (XferYardstick): 4 KiB writes with immediates to the peer's engine, one
    // write() per write and rate_batch per write_runs, `window` in flight; with the latency
    // point they are what `python3 -m ferry.bench_xfer` divides its figures by. yardsticks_only:
    // no bandwidth points and no rate section.
    bool yardsticks = true;
    bool yardsticks_only = false;
    // The engine's FI_INJECT and FI_MORE (EngineConfig::inject, post_more), to measure each.
    bool inject = true;
    bool post_more = true;
    bool inject_completions = false;
    // Writes rotate over this many bytes of source and destination (0: four slots of the
    // largest size, cache resident). A transfer of gigabytes streams from DRAM, and its
    // ceiling must too.
    size_t region_bytes = 0;
    std::function<void(const std::string&)> progress;  // one line per finished point
};

struct XferRow {
    std::string kind;  // "write", "paged write", "small write", "write+imm", "batch+imm",
                       // "scatter"
    size_t size = 0;   // bytes per write or per page
    int peers = 0;     // rate section: target peers (0: the one bandwidth target)
    double raw_gbps = 0;
    double engine_gbps = 0;
    double raw_ops = 0;  // operations (writes or pages) per second
    double engine_ops = 0;
    std::vector<double> samples;  // engine/raw ratio of each alternating pair
    // CPU time per operation (whole initiator process) of the best measurement of each, and
    // the engine's share spent in the submitting thread (the rest is the rail worker).
    double raw_cpu_us = 0;
    double engine_cpu_us = 0;
    double engine_caller_cpu_us = 0;
    double ratio() const { return raw_ops > 0 ? engine_ops / raw_ops : 0; }
    // The median of the pairs' ratios: on a host where the two sides' threads share few
    // cores, single passes swing by 2x, and a pair's two passes see the same neighbourhood.
    double median_ratio() const;
    // The pairs' ratios at quantile q (0..1, linear between ranks): the quartiles say how far
    // the pairs of one run spread around the median.
    double quantile_ratio(double q) const;
};

// One figure that `python3 -m ferry.bench_xfer` measures the same way from Python (same
// operation, size, provider, window, and the peer's TransferEngine as the target) and divides
// by this one. Named alike in both tools' tables and JSON and in docs/PYTHON.md.
struct XferYardstick {
    std::string name;  // "latency_64B", "rate_4KiB_write", "rate_4KiB_runs32"
    std::string what;  // the operation, in words
    std::string unit;  // "us" (one-way latency, p50) or "op/s" (writes per second, best pass)
    double value = 0;
    double p99 = 0;  // latencies
    double raw = 0;  // the plain fi_writedata loop doing the same writes (same unit)
};

struct XferReport {
    std::string provider;
    std::vector<XferRow> rows;
    double latency_p50_us = 0;  // one-way, latency_size write with immediate (half a round trip)
    double latency_p99_us = 0;  // (both: the ping-pong runs in the workers' callbacks)
    double waited_latency_p50_us = 0;  // the same, each side waiting in wait_imm (yardstick)
    double waited_latency_p99_us = 0;
    double raw_latency_p50_us = 0;
    int latency_iters = 0;
    size_t latency_size = 0;
    int repeat = 1;
    // The initiator engine's counters at the end: how well posts were batched.
    uint64_t ops_posted = 0;
    uint64_t post_rounds = 0;
    uint64_t ops_injected = 0;
    uint64_t posted_with_more = 0;
    std::vector<uint64_t> bytes_per_rail;  // which NICs carried the bytes (EngineConfig::rails)
    std::vector<XferYardstick> yardsticks;
};

// Forks the target process, runs every point, and returns the report. Call before this
// process has opened any libfabric object.
Result<XferReport> run_xfer_bench(const XferBenchConfig& config);

std::string format_xfer_table(const XferReport& report);
nlohmann::json xfer_report_json(const XferReport& report);

}  // namespace ferry
