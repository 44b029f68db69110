// `ferry bench moe`: per-phase latency of the expert-parallel all-to-all with every rank of
// the group in this process (a thread, its own TransferEngine and AllToAll each). Ranks of
// one node share memory; nodes talk through the chosen provider.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/moe/config.h"

namespace ferry::moe {

struct MoeBenchConfig {
    // "cpu", or "cuda": every rank a thread on this host's GPUs (rank r on GPU r % count),
    // phases timed with CUDA events; ranks of other nodes (by ranks_per_node) then go through
    // the host proxy and an engine on `provider`, which times the proxied path on one host.
    std::string backend = "cpu";
    uint32_t ranks = 8;
    uint32_t ranks_per_node = 4;
    uint32_t tokens = 128;  // per rank and call
    uint32_t hidden = 7168;
    uint32_t topk = 8;
    uint32_t experts = 256;
    DType dtype = DType::kFp8E4M3;
    uint32_t private_slots = 32;
    uint32_t alignment = 1;
    CombineMode combine = CombineMode::kPerHit;
    std::string provider = "tcp";  // between nodes
    int warmup = 3;
    int iters = 20;
    uint64_t seed = 1;
    Duration timeout = std::chrono::seconds(60);
    bool graph = false;        // cuda: replay each layer as a captured CUDA graph
    uint32_t send_blocks = 0;  // cuda: blocks of the dispatch and combine send kernels (0: default)
    bool trace = false;        // cuda: stamps inside the kernels (CudaAllToAllOptions::trace)
    bool early_launch = false;   // cuda: CudaAllToAllOptions::early_launch
    bool separate_plan = false;  // cuda: !CudaAllToAllOptions::fuse_plan
    bool whole_combine = false;  // cuda: !CudaAllToAllOptions::stream_combine
    // cuda with ranks on other nodes: also time the floor of the proxied path in the same run,
    // a plain write loop moving each rank's remote bytes on `provider` plus the mapped path's
    // layer (the same ranks as one node).
    bool floor = false;
    uint64_t proxy_chunk = 256 * 1024;  // cuda: CudaAllToAllOptions::proxy_chunk_bytes
    std::function<void(const std::string&)> progress;
};

struct MoePhaseStats {
    std::string name;
    double p50_us = 0;
    double p99_us = 0;
    double mean_us = 0;
};

// --trace: one kernel stamp, microseconds after the call's first kernel began (medians over
// ranks and iterations): when the first and the last block of the kernel got there.
struct MoeTraceRow {
    std::string point;
    double first_us = 0;
    double last_us = 0;
};

struct MoeBenchReport {
    MoeBenchConfig config;
    std::string provider;               // as the engine resolved it
    std::vector<MoePhaseStats> phases;  // samples of every rank and iteration pooled
    uint64_t dispatch_bytes = 0;        // per call, all ranks together (rows incl. headers)
    uint64_t combine_bytes = 0;
    uint64_t dispatch_remote_bytes = 0;  // of those, to other ranks (cuda backend)
    uint64_t combine_remote_bytes = 0;
    double max_rel_error = 0;  // combine of identity experts against the input
    // max_rel_error within 1e-5, or 1/128 with per-rank partials (a bf16 rounding each)
    bool verified = false;
    std::vector<MoeTraceRow> trace;  // --trace only
    // --floor: the write loop's p50 (both rounds of a layer) and the mapped path's layer p50.
    double floor_write_us = 0;
    double mapped_layer_us = 0;
    double floor_write_pageable_us = 0;  // the write loop from pageable memory (for reference)
};

// Runs warm-up and timed iterations and checks the last combine against the input (identity
// experts, weights summing to 1: combine must give back the dispatched values).
Result<MoeBenchReport> run_moe_bench(const MoeBenchConfig& config);

std::string format_moe_table(const MoeBenchReport& report);
nlohmann::json moe_report_json(const MoeBenchReport& report);

}  // namespace ferry::moe
