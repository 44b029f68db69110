// What `ferry bench moe` collects per rank, shared by the CPU path (moe.cc) and the CUDA
// path (cuda/moe.cc, or moe_cuda_fallback.cc without CUDA).
#pragma once

#include <fmt/format.h>

#include <condition_variable>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "bench/moe.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/moe/config.h"

namespace ferry::moe::bench_detail {

// One rank's benchmark input: random bf16 tokens and a uniform top-k routing (distinct
// experts per token) with weights summing to 1. The same for the CPU and CUDA paths.
struct RandomInputs {
    std::vector<uint16_t> x;
    std::vector<int32_t> idx;
    std::vector<float> w;
};
RandomInputs random_inputs(const AllToAllConfig& cfg, uint32_t tokens, uint64_t seed,
                           uint32_t rank);

// Allgather among the rank threads of this process, with a deadline.
class ThreadExchange {
  public:
    explicit ThreadExchange(uint32_t n) : n_(n), slots_(n) {}

    Result<std::vector<std::vector<uint8_t>>> allgather(uint32_t rank,
                                                        std::span<const uint8_t> mine,
                                                        Duration timeout) {
        std::unique_lock lk(mu_);
        if (!failed_.ok()) return failed_;
        slots_[rank].assign(mine.begin(), mine.end());
        uint64_t gen = gen_;
        if (++arrived_ == n_) {
            result_ = slots_;
            arrived_ = 0;
            ++gen_;
            cv_.notify_all();
            return result_;
        }
        if (!cv_.wait_for(lk, timeout, [&] { return gen_ != gen || !failed_.ok(); })) {
            failed_ =
                timeout_error(fmt::format("bench: rank {} waited {} ms for the other ranks "
                                          "at an exchange; {} of {} had arrived",
                                          rank, to_ms(timeout), arrived_, n_));
        }
        if (!failed_.ok()) return failed_;
        return result_;
    }
    // A rank that failed releases the others at once instead of leaving them to time out.
    void abort(const Status& why) {
        std::lock_guard lk(mu_);
        if (failed_.ok()) failed_ = why;
        cv_.notify_all();
    }

  private:
    uint32_t n_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::vector<uint8_t>> slots_, result_;
    uint32_t arrived_ = 0;
    uint64_t gen_ = 0;
    Status failed_;
};

enum Phase {
    kDispatchSend,
    kDispatchRecv,
    kDispatch,
    kCombineSend,
    kCombineRecv,
    kCombine,
    kLayer,  // dispatch_send through combine_recv, the (untimed elsewhere) experts included
    kNumPhases
};

struct RankResult {
    Status status;
    std::vector<double> samples[kNumPhases];
    uint64_t dispatch_bytes = 0, combine_bytes = 0;
    uint64_t dispatch_remote_bytes = 0, combine_remote_bytes = 0;  // to other ranks only
    double max_rel_error = 0;
    std::string provider;
    // --trace: per stamp, microseconds after the call's first stamp (first block, last block).
    std::vector<std::string> trace_points;
    std::vector<std::vector<double>> trace_first, trace_last;
    // --floor: the plain write loop's time per layer, and the mapped path's layer time (us).
    std::vector<double> floor_write, mapped_layer;
    std::vector<double> floor_write_pageable;  // the same loop from pageable host memory
};

// Runs every rank of `cfg` on the GPUs of this host (rank r on GPU r % count), one thread per
// rank, phases timed with CUDA events; fills one result per rank.
Status run_cuda_ranks(const MoeBenchConfig& bc, const AllToAllConfig& cfg,
                      std::vector<RankResult>* results);

}  // namespace ferry::moe::bench_detail
