// `ferry bench moe --backend cuda`: every rank a thread of this process on this host's GPUs
// (rank r on GPU r % count, peers of its node reached through peer access over NVLink, the
// same path the IPC mapping of separate processes takes; ranks of other nodes through the host
// proxy and an engine per rank on --provider, which times the proxied path on one host). Phases are
// timed with CUDA events on each rank's stream. Each iteration every rank enqueues its whole layer
// behind a gate kernel, and the gate opens for all ranks at once after a host barrier: the events
// then time the GPUs' work (as a captured, pre-enqueued layer runs) rather than host launch gaps,
// and a rank's latency still includes waiting for the slowest peer, as in a real layer. --graph
// replays one captured layer and times it as a whole (events cannot sit inside the capture).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <thread>

#include "bench/moe_internal.h"
#include "common/cuda_check.h"
#include "ferry/moe/cuda_all_to_all.h"
#include "ferry/moe/numerics.h"
#include "ferry/moe/plan.h"

namespace ferry::moe::bench_detail {
namespace {

// Owns every CUDA object of one rank, released on any return path.
struct RankResources {
    int device = 0;
    cudaStream_t stream = nullptr;
    cudaEvent_t ev[6] = {};
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    std::vector<void*> mem;
    ~RankResources() {
        cudaSetDevice(device);
        if (exec) cudaGraphExecDestroy(exec);
        if (graph) cudaGraphDestroy(graph);
        for (cudaEvent_t e : ev)
            if (e) cudaEventDestroy(e);
        if (stream) cudaStreamDestroy(stream);
        for (void* p : mem) cudaFree(p);
    }
    template <typename T>
    Result<T*> alloc(size_t count) {
        void* p = nullptr;
        cudaError_t e = cudaMalloc(&p, std::max<size_t>(count * sizeof(T), 16));
        if (e != cudaSuccess)
            return FERRY_CUDA_ERROR(e, fmt::format("cudaMalloc of {} bytes", count));
        mem.push_back(p);
        return static_cast<T*>(p);
    }
};

Status run_cuda_rank(const MoeBenchConfig& bc, const AllToAllConfig& base, uint32_t rank, int gpus,
                     volatile uint32_t* gate, ThreadExchange& ex, RankResult* res) {
    AllToAllConfig cfg = base;
    cfg.rank = rank;
    RankResources rr;
    rr.device = static_cast<int>(rank % static_cast<uint32_t>(gpus));
    FERRY_CUDA_TRY(cudaSetDevice(rr.device));
    FERRY_CUDA_TRY(cudaStreamCreateWithFlags(&rr.stream, cudaStreamNonBlocking));
    for (cudaEvent_t& e : rr.ev) FERRY_CUDA_TRY(cudaEventCreate(&e));
    res->provider = fmt::format("cuda (rank {} on GPU {} of {})", rank, rr.device, gpus);

    CudaAllToAllOptions opts;
    opts.timeout = bc.timeout;
    opts.device = rr.device;
    opts.trace = bc.trace;
    opts.early_launch = bc.early_launch;
    opts.fuse_plan = !bc.separate_plan;
    if (bc.send_blocks) {
        opts.dispatch.send_blocks = bc.send_blocks;
        opts.combine.send_blocks = bc.send_blocks;
    }
    std::unique_ptr<TransferEngine> engine;  // outlives the all-to-all
    if (cfg.world_size > cfg.ranks_per_node) {
        EngineConfig ec;
        ec.provider = bc.provider;
        ec.op_timeout = bc.timeout;
        ec.busy_poll = true;  // tcp and shm deliver arrivals only when polled
        FERRY_ASSIGN_OR_RETURN(engine, TransferEngine::create(ec));
        opts.engine = engine.get();
        // Serving keeps the proxy busy layer after layer; here iterations are apart by host
        // barriers, and a proxy that naps would add its wake-up to every first put.
        opts.proxy_idle_spin = bc.timeout;
        res->provider += fmt::format(", other nodes over {}", engine->provider());
    }
    AllGatherFn ag = [&](std::span<const uint8_t> b) { return ex.allgather(rank, b, bc.timeout); };
    FERRY_ASSIGN_OR_RETURN(auto a2a, CudaAllToAll::create(cfg, ag, opts));

    // The same inputs as the CPU path, quantized on the device.
    const uint32_t n = bc.tokens, h = cfg.hidden;
    auto [x, idx, w] = bench_detail::random_inputs(cfg, n, bc.seed, rank);
    std::vector<uint16_t> expected = x;  // what identity experts give back
    if (cfg.dtype == DType::kFp8E4M3) {
        std::vector<uint8_t> q(x.size());
        std::vector<float> s(x.size() / kScaleBlock);
        FERRY_RETURN_IF_ERROR(quantize_fp8_bf16(x, n, h, q, s));
        FERRY_RETURN_IF_ERROR(dequantize_fp8_to_bf16(q, s, n, h, expected));
    }
    FERRY_ASSIGN_OR_RETURN(SendPlan plan, plan_send(cfg, idx, n));
    const RowFormat row = RowFormat::of(cfg);
    const uint64_t crow = uint64_t{h} * sizeof(uint16_t);
    for (uint32_t d = 0; d < cfg.world_size; ++d) {
        uint64_t db = uint64_t{plan.rows_to[d]} * row.row_bytes;
        // Results coming back from d: a row per hit, or per dispatched row (per-rank).
        const uint32_t back =
            cfg.combine == CombineMode::kPerRank ? plan.rows_to[d] : plan.hits_to[d];
        uint64_t cb = uint64_t{back} * crow;
        res->dispatch_bytes += db;
        res->combine_bytes += cb;
        if (d != rank) {
            res->dispatch_remote_bytes += db;
            res->combine_remote_bytes += cb;
        }
    }

    const size_t rows = max_expert_rows(cfg), pb = cfg.payload_bytes();
    const size_t spt = cfg.scales_per_token();
    const uint32_t nl = cfg.num_local_experts();
    FERRY_ASSIGN_OR_RETURN(uint16_t * dx16, rr.alloc<uint16_t>(x.size()));
    FERRY_ASSIGN_OR_RETURN(uint8_t * dq, rr.alloc<uint8_t>(size_t{n} * pb));
    FERRY_ASSIGN_OR_RETURN(float* ds, rr.alloc<float>(size_t{n} * spt));
    FERRY_ASSIGN_OR_RETURN(int32_t * didx, rr.alloc<int32_t>(idx.size()));
    FERRY_ASSIGN_OR_RETURN(float* dw, rr.alloc<float>(w.size()));
    FERRY_ASSIGN_OR_RETURN(uint32_t * dn, rr.alloc<uint32_t>(1));
    FERRY_ASSIGN_OR_RETURN(uint8_t * bx, rr.alloc<uint8_t>(rows * pb));
    FERRY_ASSIGN_OR_RETURN(float* bs, rr.alloc<float>(rows * spt));
    FERRY_ASSIGN_OR_RETURN(uint32_t * bcnt, rr.alloc<uint32_t>(nl));
    FERRY_ASSIGN_OR_RETURN(uint32_t * boff, rr.alloc<uint32_t>(nl + 1));
    FERRY_ASSIGN_OR_RETURN(uint16_t * y, rr.alloc<uint16_t>(rows * h));
    FERRY_ASSIGN_OR_RETURN(float* out, rr.alloc<float>(size_t{n} * h));
    cudaStream_t st = rr.stream;
    FERRY_CUDA_TRY(cudaMemcpyAsync(dx16, x.data(), x.size() * 2, cudaMemcpyHostToDevice, st));
    FERRY_CUDA_TRY(cudaMemcpyAsync(didx, idx.data(), idx.size() * 4, cudaMemcpyHostToDevice, st));
    FERRY_CUDA_TRY(cudaMemcpyAsync(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice, st));
    FERRY_CUDA_TRY(cudaMemcpyAsync(dn, &n, 4, cudaMemcpyHostToDevice, st));
    if (cfg.dtype == DType::kFp8E4M3) {
        FERRY_RETURN_IF_ERROR(cuda_quantize_fp8(dx16, n, h, dq, ds, st));
    } else {
        FERRY_CUDA_TRY(cudaMemcpyAsync(dq, dx16, x.size() * 2, cudaMemcpyDeviceToDevice, st));
    }
    FERRY_CUDA_TRY(cudaStreamSynchronize(st));

    CudaDispatchInput din{dq, spt ? ds : nullptr, didx, dw, dn};
    CudaExpertBatch batch{bx, spt ? bs : nullptr, bcnt, boff, nullptr};
    // One layer: dispatch, identity experts (between events 2 and 3: no phase of its own, but
    // inside `layer`; fp8 -> bf16 of every received row, padding included, the least a real
    // expert reads and writes), combine.
    // `timed`: with events between the phases (not inside a graph capture).
    auto enqueue = [&](bool timed) -> Status {
        auto mark = [&](int i) { return timed ? cudaEventRecord(rr.ev[i], st) : cudaSuccess; };
        FERRY_CUDA_TRY(mark(0));
        FERRY_RETURN_IF_ERROR(a2a->dispatch_send(din, st));
        FERRY_CUDA_TRY(mark(1));
        FERRY_RETURN_IF_ERROR(a2a->dispatch_recv(batch, st));
        FERRY_CUDA_TRY(mark(2));
        if (cfg.dtype == DType::kFp8E4M3) {
            FERRY_RETURN_IF_ERROR(cuda_dequantize_fp8_to_bf16(bx, bs, static_cast<uint32_t>(rows),
                                                              h, y, st, boff + nl));
        } else {
            FERRY_CUDA_TRY(cudaMemcpyAsync(y, bx, rows * pb, cudaMemcpyDeviceToDevice, st));
        }
        FERRY_CUDA_TRY(mark(3));
        FERRY_RETURN_IF_ERROR(a2a->combine_send(y, st));
        FERRY_CUDA_TRY(mark(4));
        FERRY_RETURN_IF_ERROR(a2a->combine_recv(out, st));
        FERRY_CUDA_TRY(mark(5));
        return ok_status();
    };
    if (bc.graph) {
        // The token count and call number live on the device, so one capture replays
        // correctly call after call.
        FERRY_CUDA_TRY(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        Status s = enqueue(false);
        cudaError_t end = cudaStreamEndCapture(st, &rr.graph);
        FERRY_RETURN_IF_ERROR(s);
        if (end != cudaSuccess) return FERRY_CUDA_ERROR(end, "cudaStreamEndCapture");
        FERRY_CUDA_TRY(cudaGraphInstantiate(&rr.exec, rr.graph, 0));
    }

    for (int it = 0; it < bc.warmup + bc.iters; ++it) {
        const uint32_t want = static_cast<uint32_t>(it + 1);
        FERRY_RETURN_IF_ERROR(
            cuda_host_gate(const_cast<const uint32_t*>(gate), want, bc.timeout, st));
        if (bc.graph) {
            FERRY_CUDA_TRY(cudaEventRecord(rr.ev[0], st));
            FERRY_CUDA_TRY(cudaGraphLaunch(rr.exec, st));
            FERRY_CUDA_TRY(cudaEventRecord(rr.ev[5], st));
        } else {
            FERRY_RETURN_IF_ERROR(enqueue(true));
        }
        // Every rank's layer waits behind its gate; one store opens them all.
        FERRY_ASSIGN_OR_RETURN(auto sync, ex.allgather(rank, {}, bc.timeout));
        (void)sync;
        if (rank == 0) *gate = want;
        FERRY_RETURN_IF_ERROR(a2a->synchronize(st));
        if (it < bc.warmup) continue;
        if (bc.trace) {
            FERRY_ASSIGN_OR_RETURN(auto stamps, a2a->last_trace());
            const uint64_t t0 = stamps.front().first_ns;
            res->trace_first.resize(stamps.size());
            res->trace_last.resize(stamps.size());
            res->trace_points.clear();
            for (size_t i = 0; i < stamps.size(); ++i) {
                res->trace_points.push_back(stamps[i].point);
                if (stamps[i].last_ns == 0 || t0 == 0) continue;
                res->trace_first[i].push_back(
                    static_cast<double>(static_cast<int64_t>(stamps[i].first_ns - t0)) / 1e3);
                res->trace_last[i].push_back(
                    static_cast<double>(static_cast<int64_t>(stamps[i].last_ns - t0)) / 1e3);
            }
        }
        const int from[kNumPhases] = {0, 1, 0, 3, 4, 3, 0};
        const int to[kNumPhases] = {1, 2, 2, 4, 5, 5, 5};
        for (int p = 0; p < kNumPhases; ++p) {
            if (bc.graph && p != bench_detail::kLayer) continue;
            float ms = 0;
            FERRY_CUDA_TRY(cudaEventElapsedTime(&ms, rr.ev[from[p]], rr.ev[to[p]]));
            res->samples[p].push_back(static_cast<double>(ms) * 1e3);
        }
    }
    std::vector<float> got(size_t{n} * h);
    FERRY_CUDA_TRY(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < got.size(); ++i) {
        float want = bf16_to_float(expected[i]);
        double err = std::fabs(got[i] - want) / std::max(std::fabs(want), 1e-30f);
        if (want == 0.0f) err = std::fabs(got[i]);
        res->max_rel_error = std::max(res->max_rel_error, err);
    }
    // Every rank is done writing into every other rank before anyone frees its buffers.
    FERRY_ASSIGN_OR_RETURN(auto done, ex.allgather(rank, {}, bc.timeout));
    (void)done;
    return ok_status();
}

}  // namespace

Status run_cuda_ranks(const MoeBenchConfig& bc, const AllToAllConfig& cfg,
                      std::vector<RankResult>* results) {
    int gpus = 0;
    if (cudaError_t e = cudaGetDeviceCount(&gpus); e != cudaSuccess || gpus == 0)
        return unavailable(fmt::format("bench moe --backend cuda: no usable GPU ({})",
                                       e == cudaSuccess ? "none visible" : cudaGetErrorString(e)));
    // The gate every rank's stream waits on: pinned, mapped into every device (UVA).
    uint32_t* gate = nullptr;
    if (cudaError_t e = cudaHostAlloc(reinterpret_cast<void**>(&gate), sizeof(uint32_t),
                                      cudaHostAllocMapped | cudaHostAllocPortable);
        e != cudaSuccess)
        return FERRY_CUDA_ERROR(e, "cudaHostAlloc of the start gate");
    *gate = 0;
    ThreadExchange ex(bc.ranks);
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < bc.ranks; ++r) {
        threads.emplace_back([&, r] {
            RankResult& res = (*results)[r];
            res.status = run_cuda_rank(bc, cfg, r, gpus, gate, ex, &res);
            if (!res.status.ok())
                ex.abort(res.status.with_context(fmt::format("rank {} failed", r)));
        });
    }
    for (auto& t : threads) t.join();
    cudaFreeHost(gate);
    return ok_status();
}

}  // namespace ferry::moe::bench_detail
