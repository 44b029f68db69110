#include "bench/moe.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "bench/limits.h"
#include "bench/moe_internal.h"
#include "ferry/fabric/engine.h"
#include "ferry/moe/all_to_all.h"
#include "ferry/moe/numerics.h"
#include "ferry/moe/transport.h"

namespace ferry::moe {
bench_detail::RandomInputs bench_detail::random_inputs(const AllToAllConfig& cfg, uint32_t n,
                                                       uint64_t seed, uint32_t rank) {
    const uint32_t h = cfg.hidden, k = cfg.experts_per_token;
    std::mt19937_64 rng(seed * 7919 + rank);
    std::uniform_real_distribution<float> val(-1.0f, 1.0f), wdist(0.1f, 1.0f);
    RandomInputs in;
    in.x.resize(size_t{n} * h);
    for (auto& v : in.x) v = float_to_bf16(val(rng));
    in.idx.resize(size_t{n} * k);
    in.w.resize(size_t{n} * k);
    for (uint32_t t = 0; t < n; ++t) {
        std::vector<int32_t> chosen;
        float sum = 0;
        while (chosen.size() < k) {
            auto e = static_cast<int32_t>(rng() % cfg.num_experts);
            if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
        }
        for (uint32_t j = 0; j < k; ++j) {
            in.idx[size_t{t} * k + j] = chosen[j];
            sum += in.w[size_t{t} * k + j] = wdist(rng);
        }
        for (uint32_t j = 0; j < k; ++j) in.w[size_t{t} * k + j] /= sum;
    }
    return in;
}

namespace {

using bench_detail::kCombine;
using bench_detail::kCombineRecv;
using bench_detail::kCombineSend;
using bench_detail::kDispatch;
using bench_detail::kDispatchRecv;
using bench_detail::kDispatchSend;
using bench_detail::kNumPhases;
using bench_detail::RankResult;
using bench_detail::ThreadExchange;

const char* kPhaseNames[kNumPhases] = {"dispatch_send", "dispatch_recv", "dispatch", "combine_send",
                                       "combine_recv",  "combine",       "layer"};

double percentile(std::vector<double> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    size_t i = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
    return v[std::min(v.size() - 1, i == 0 ? 0 : i - 1)];
}

Status run_rank(const MoeBenchConfig& bc, const AllToAllConfig& base, uint32_t rank,
                ThreadExchange& ex, RankResult* res) {
    AllToAllConfig cfg = base;
    cfg.rank = rank;
    EngineConfig ec;
    ec.provider = bc.provider;
    ec.op_timeout = bc.timeout;
    FERRY_ASSIGN_OR_RETURN(auto engine, TransferEngine::create(ec));
    res->provider = engine->provider();
    AllGatherFn ag = [&](std::span<const uint8_t> b) { return ex.allgather(rank, b, bc.timeout); };
    AllToAllOptions opts;
    opts.timeout = bc.timeout;
    FERRY_ASSIGN_OR_RETURN(auto a2a, AllToAll::create(cfg, engine.get(), ag, opts));

    const uint32_t n = bc.tokens, h = cfg.hidden;
    auto [x, idx, w] = bench_detail::random_inputs(cfg, n, bc.seed, rank);
    std::vector<uint8_t> payload;
    std::vector<float> scales;
    std::vector<uint16_t> expected = x;  // what identity experts give back
    if (cfg.dtype == DType::kBf16) {
        payload.resize(x.size() * 2);
        std::memcpy(payload.data(), x.data(), payload.size());
    } else {
        payload.resize(x.size());
        scales.resize(x.size() / kScaleBlock);
        FERRY_RETURN_IF_ERROR(quantize_fp8_bf16(x, n, h, payload, scales));
        FERRY_RETURN_IF_ERROR(dequantize_fp8_to_bf16(payload, scales, n, h, expected));
    }
    DispatchInput in{n, payload, scales, idx, w};

    const size_t rows = max_expert_rows(cfg);
    std::vector<uint8_t> bx(rows * cfg.payload_bytes());
    std::vector<float> bs(rows * cfg.scales_per_token());
    std::vector<uint32_t> counts(cfg.num_local_experts()), offsets(cfg.num_local_experts() + 1);
    ExpertBatch batch{bx, bs, counts, offsets, {}};
    std::vector<uint16_t> expert_out(rows * h);
    std::vector<float> out(size_t{n} * h);

    for (int it = 0; it < bc.warmup + bc.iters; ++it) {
        FERRY_ASSIGN_OR_RETURN(auto sync, ex.allgather(rank, {}, bc.timeout));
        (void)sync;
        TimePoint t0 = Clock::now();
        FERRY_RETURN_IF_ERROR(a2a->dispatch_send(in));
        TimePoint t1 = Clock::now();
        FERRY_RETURN_IF_ERROR(a2a->dispatch_recv(batch));
        TimePoint t2 = Clock::now();
        // Identity experts (untimed): the rows as bf16.
        uint32_t total = offsets[cfg.num_local_experts()];
        if (cfg.dtype == DType::kBf16) {
            std::memcpy(expert_out.data(), bx.data(), size_t{total} * h * 2);
        } else {
            FERRY_RETURN_IF_ERROR(dequantize_fp8_to_bf16(bx, bs, total, h, expert_out));
        }
        TimePoint t3 = Clock::now();
        FERRY_RETURN_IF_ERROR(a2a->combine_send(expert_out));
        TimePoint t4 = Clock::now();
        FERRY_RETURN_IF_ERROR(a2a->combine_recv(out));
        TimePoint t5 = Clock::now();
        if (it < bc.warmup) continue;
        double us[kNumPhases] = {to_us(t1 - t0), to_us(t2 - t1), to_us(t2 - t0), to_us(t4 - t3),
                                 to_us(t5 - t4), to_us(t5 - t3), to_us(t5 - t0)};
        for (int p = 0; p < kNumPhases; ++p) res->samples[p].push_back(us[p]);
        res->dispatch_bytes = a2a->last_bytes().dispatch;
        res->combine_bytes = a2a->last_bytes().combine;
    }
    for (size_t i = 0; i < out.size(); ++i) {
        float want = bf16_to_float(expected[i]);
        double err = std::fabs(out[i] - want) / std::max(std::fabs(want), 1e-30f);
        if (want == 0.0f) err = std::fabs(out[i]);
        res->max_rel_error = std::max(res->max_rel_error, err);
    }
    // Every rank is done writing into every other rank before anyone frees its buffers.
    FERRY_ASSIGN_OR_RETURN(auto done, ex.allgather(rank, {}, bc.timeout));
    (void)done;
    return ok_status();
}

}  // namespace

Result<MoeBenchReport> run_moe_bench(const MoeBenchConfig& bc) {
    if (bc.backend != "cpu" && bc.backend != "cuda")
        return invalid_argument(
            fmt::format("bench moe: unknown backend '{}' (cpu or cuda)", bc.backend));
    // --tokens 0 ran (as one token of buffers) and reported 0 bytes moved as a result.
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("moe", "--tokens", bc.tokens, 1, bench::kMaxMoeTokens));
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("moe", "--ranks", bc.ranks, 1, bench::kMaxRanks));
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("moe", "--iters", bc.iters, 1, bench::kMaxIters));
    FERRY_RETURN_IF_ERROR(
        bench::check_bench_range("moe", "--warmup", bc.warmup, 0, bench::kMaxIters));
    AllToAllConfig cfg;
    cfg.max_tokens_per_rank = bc.tokens;
    cfg.hidden = bc.hidden;
    cfg.dtype = bc.dtype;
    cfg.num_experts = bc.experts;
    cfg.experts_per_token = bc.topk;
    cfg.world_size = bc.ranks;
    cfg.ranks_per_node = bc.ranks_per_node;
    cfg.private_slots_per_sender = std::min(bc.private_slots, cfg.max_tokens_per_rank);
    cfg.group_alignment = bc.alignment;
    cfg.combine = bc.combine;
    FERRY_RETURN_IF_ERROR(cfg.validate());
    if (bc.backend == "cpu") {
        // Every rank's receive regions and staging live in this process: --hidden 10^9 failed
        // in rank 0 as "cannot allocate 144500006912 bytes of MoE staging", naming no flag.
        const double per_rank = double(RankMemoryLayout::of(cfg).total_bytes);
        FERRY_RETURN_IF_ERROR(bench::check_bench_memory(
            "moe",
            fmt::format("the receive regions and staging of --ranks {} x --tokens {} x --hidden {} "
                        "(--topk {}, --experts {})",
                        bc.ranks, bc.tokens, bc.hidden, bc.topk, bc.experts),
            per_rank * bc.ranks));
    }

    std::vector<RankResult> results(bc.ranks);
    if (bc.backend == "cuda") {
        FERRY_RETURN_IF_ERROR(bench_detail::run_cuda_ranks(bc, cfg, &results));
    } else {
        ThreadExchange ex(bc.ranks);
        std::vector<std::thread> threads;
        for (uint32_t r = 0; r < bc.ranks; ++r) {
            threads.emplace_back([&, r] {
                results[r].status = run_rank(bc, cfg, r, ex, &results[r]);
                if (!results[r].status.ok())
                    ex.abort(results[r].status.with_context(fmt::format("rank {} failed", r)));
            });
        }
        for (auto& t : threads) t.join();
    }
    for (uint32_t r = 0; r < bc.ranks; ++r)
        if (!results[r].status.ok())
            return results[r].status.with_context(fmt::format("bench moe rank {}", r));

    MoeBenchReport rep;
    rep.config = bc;
    rep.config.progress = nullptr;
    rep.provider = results[0].provider;
    for (int p = 0; p < kNumPhases; ++p) {
        std::vector<double> all;
        for (auto& r : results) all.insert(all.end(), r.samples[p].begin(), r.samples[p].end());
        if (all.empty()) continue;  // graph replay times the whole layer only
        MoePhaseStats s;
        s.name = kPhaseNames[p];
        s.p50_us = percentile(all, 0.5);
        s.p99_us = percentile(all, 0.99);
        double sum = 0;
        for (double v : all) sum += v;
        s.mean_us = all.empty() ? 0 : sum / static_cast<double>(all.size());
        rep.phases.push_back(s);
    }
    for (auto& r : results) {
        rep.dispatch_bytes += r.dispatch_bytes;
        rep.combine_bytes += r.combine_bytes;
        rep.dispatch_remote_bytes += r.dispatch_remote_bytes;
        rep.combine_remote_bytes += r.combine_remote_bytes;
        rep.max_rel_error = std::max(rep.max_rel_error, r.max_rel_error);
    }
    rep.verified = rep.max_rel_error <= (bc.combine == CombineMode::kPerRank ? 1.0 / 128 : 1e-5);
    std::vector<double> floor_write, mapped_layer, pageable;
    for (auto& r : results) {
        floor_write.insert(floor_write.end(), r.floor_write.begin(), r.floor_write.end());
        pageable.insert(pageable.end(), r.floor_write_pageable.begin(),
                        r.floor_write_pageable.end());
        mapped_layer.insert(mapped_layer.end(), r.mapped_layer.begin(), r.mapped_layer.end());
    }
    if (!floor_write.empty() && !mapped_layer.empty()) {
        rep.floor_write_us = percentile(floor_write, 0.5);
        rep.mapped_layer_us = percentile(mapped_layer, 0.5);
        if (!pageable.empty()) rep.floor_write_pageable_us = percentile(pageable, 0.5);
    }
    for (size_t i = 0; i < results[0].trace_points.size(); ++i) {
        std::vector<double> first, last;
        for (auto& r : results) {
            if (i >= r.trace_first.size()) continue;
            first.insert(first.end(), r.trace_first[i].begin(), r.trace_first[i].end());
            last.insert(last.end(), r.trace_last[i].begin(), r.trace_last[i].end());
        }
        if (first.empty()) continue;
        rep.trace.push_back(
            {results[0].trace_points[i], percentile(first, 0.5), percentile(last, 0.5)});
    }
    return rep;
}

std::string format_moe_table(const MoeBenchReport& rep) {
    const MoeBenchConfig& c = rep.config;
    std::string s = fmt::format(
        "bench moe: backend {}, {} ranks ({} per node, provider {}), {} tokens/rank, hidden {}, "
        "top-{} of {} experts, {} dispatch, {} combine, {} iterations after {} warm-up\n",
        c.backend, c.ranks, c.ranks_per_node, rep.provider, c.tokens, c.hidden, c.topk, c.experts,
        dtype_name(c.dtype), combine_mode_name(c.combine), c.iters, c.warmup);
    s += fmt::format("{:<14} {:>12} {:>12} {:>12}\n", "phase", "p50 us", "p99 us", "mean us");
    for (const auto& p : rep.phases)
        s += fmt::format("{:<14} {:>12.1f} {:>12.1f} {:>12.1f}\n", p.name, p.p50_us, p.p99_us,
                         p.mean_us);
    s += fmt::format(
        "bytes per call, all ranks: dispatch {} ({:.2f} MiB), combine {} ({:.2f} "
        "MiB)\n",
        rep.dispatch_bytes, rep.dispatch_bytes / 1048576.0, rep.combine_bytes,
        rep.combine_bytes / 1048576.0);
    // Per-rank rates at the median: bytes one rank moves per call over its median latency.
    const double n = std::max(1u, c.ranks);
    auto rate = [&](uint64_t bytes, const char* phase) {
        for (const auto& p : rep.phases)
            if (p.name == phase && p.p50_us > 0) return bytes / n / (p.p50_us * 1e3);
        return 0.0;
    };
    if (rep.dispatch_remote_bytes || rep.combine_remote_bytes)
        s += fmt::format(
            "per rank at p50: dispatch {:.1f} GB/s ({:.1f} GB/s to other ranks), combine {:.1f} "
            "GB/s ({:.1f} GB/s to other ranks)\n",
            rate(rep.dispatch_bytes, "dispatch"), rate(rep.dispatch_remote_bytes, "dispatch"),
            rate(rep.combine_bytes, "combine"), rate(rep.combine_remote_bytes, "combine"));
    s += fmt::format("combine check (identity experts): max relative error {:.2e} -> {}\n",
                     rep.max_rel_error, rep.verified ? "ok" : "FAILED");
    if (rep.floor_write_us > 0) {
        const double floor = rep.floor_write_us + rep.mapped_layer_us;
        double layer = 0;
        for (const auto& p : rep.phases)
            if (p.name == "layer") layer = p.p50_us;
        s += fmt::format(
            "floor: write loop {:.1f} us (each rank's remote bytes on {}, dispatch then combine) "
            "+ mapped layer {:.1f} us = {:.1f} us; layer p50 / floor = {:.2f}x\n",
            rep.floor_write_us, c.provider, rep.mapped_layer_us, floor, layer / floor);
        s += fmt::format(
            "floor, from pinned host memory as the proxy's buffers (proxy writes of {} bytes); "
            "the same loop from pageable memory: {:.1f} us\n",
            c.proxy_chunk, rep.floor_write_pageable_us);
    }
    if (!rep.trace.empty()) {
        s += "kernel (and host proxy) stamps, us after the call's first kernel began (p50 over "
             "ranks and calls; proxy rows: first and last remote peer):\n";
        s += fmt::format("{:<26} {:>12} {:>12}\n", "point", "first block", "last block");
        for (const auto& t : rep.trace)
            s += fmt::format("{:<26} {:>12.1f} {:>12.1f}\n", t.point, t.first_us, t.last_us);
    }
    return s;
}

nlohmann::json moe_report_json(const MoeBenchReport& rep) {
    const MoeBenchConfig& c = rep.config;
    nlohmann::json j;
    j["backend"] = c.backend;
    j["ranks"] = c.ranks;
    j["ranks_per_node"] = c.ranks_per_node;
    j["provider"] = rep.provider;
    j["tokens"] = c.tokens;
    j["hidden"] = c.hidden;
    j["topk"] = c.topk;
    j["experts"] = c.experts;
    j["dtype"] = std::string(dtype_name(c.dtype));
    j["combine"] = std::string(combine_mode_name(c.combine));
    j["private_slots"] = c.private_slots;
    if (c.backend == "cuda") {
        j["early_launch"] = c.early_launch;
        j["proxy_chunk"] = c.proxy_chunk;
        j["separate_plan"] = c.separate_plan;
        j["whole_combine"] = c.whole_combine;
    }
    j["iters"] = c.iters;
    j["warmup"] = c.warmup;
    for (const auto& p : rep.phases)
        j["phases"][p.name] = {{"p50_us", p.p50_us}, {"p99_us", p.p99_us}, {"mean_us", p.mean_us}};
    j["dispatch_bytes"] = rep.dispatch_bytes;
    j["combine_bytes"] = rep.combine_bytes;
    j["dispatch_remote_bytes"] = rep.dispatch_remote_bytes;
    j["combine_remote_bytes"] = rep.combine_remote_bytes;
    j["max_rel_error"] = rep.max_rel_error;
    if (!rep.trace.empty()) {
        nlohmann::json tr = nlohmann::json::array();
        for (const auto& t : rep.trace)
            tr.push_back({{"point", t.point}, {"first_us", t.first_us}, {"last_us", t.last_us}});
        j["trace"] = tr;
    }
    if (rep.floor_write_us > 0) {
        j["floor_write_us"] = rep.floor_write_us;
        j["mapped_layer_us"] = rep.mapped_layer_us;
        j["floor_write_pageable_us"] = rep.floor_write_pageable_us;
    }
    j["verified"] = rep.verified;
    return j;
}

}  // namespace ferry::moe
