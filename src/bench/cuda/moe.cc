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
#include <cstring>
#include <random>
#include <thread>

#include "bench/moe_internal.h"
#include "common/cuda_check.h"
#include "ferry/common/bytes.h"
#include "ferry/fabric/engine.h"
#include "ferry/moe/cuda_all_to_all.h"
#include "ferry/moe/host_proxy.h"
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
    opts.proxy_chunk_bytes = bc.proxy_chunk;
    opts.fuse_plan = !bc.separate_plan;
    opts.stream_combine = !bc.whole_combine;
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

// --floor: what the fabric alone costs for one layer of the proxied path. Each rank writes its
// bytes for every rank of another node (bytes[0]: dispatch rows, bytes[1]: combine rows,
// [sender * world + receiver]) from pinned host memory into pinned host memory of the peer, on
// the same provider and in the same pieces as the host proxy, in the layer's two rounds: the
// combine round starts once this rank's dispatch writes completed and every peer's arrived.
// No GPU work and no proxy: a plain write loop. `pinned`: buffers from cudaHostAlloc, as the
// proxy's outboxes and inbox; else pageable memory (for reference).
Status run_floor_rank(const MoeBenchConfig& bc, const AllToAllConfig& cfg, uint32_t rank,
                      const std::vector<uint64_t> (&bytes)[2], bool pinned, ThreadExchange& ex,
                      std::vector<double>* samples) {
    const uint32_t w = cfg.world_size;
    EngineConfig ec;
    ec.provider = bc.provider;
    ec.op_timeout = bc.timeout;
    ec.busy_poll = true;
    FERRY_ASSIGN_OR_RETURN(auto engine, TransferEngine::create(ec));
    // Sources: this rank's bytes for every receiver, back to back; destinations: every sender's
    // bytes for this rank, back to back; the larger round sizes both.
    uint64_t src_bytes = 16, dst_bytes = 16;
    for (const auto& b : bytes) {
        uint64_t out = 0, in = 0;
        for (uint32_t q = 0; q < w; ++q) {
            out += b[uint64_t{rank} * w + q];
            in += b[uint64_t{q} * w + rank];
        }
        src_bytes = std::max(src_bytes, out);
        dst_bytes = std::max(dst_bytes, in);
    }
    struct HostBuffer {
        void* p = nullptr;
        bool pinned = false;
        std::vector<uint8_t> pageable;
        Status alloc(uint64_t n) {
            if (!pinned) {
                pageable.assign(n, 0);
                p = pageable.data();
                return ok_status();
            }
            FERRY_CUDA_TRY(cudaHostAlloc(&p, n, cudaHostAllocMapped));
            return ok_status();
        }
        ~HostBuffer() {
            if (pinned && p) cudaFreeHost(p);
        }
    } src, dst;
    src.pinned = dst.pinned = pinned;
    FERRY_RETURN_IF_ERROR(src.alloc(src_bytes));
    FERRY_RETURN_IF_ERROR(dst.alloc(dst_bytes));
    std::memset(src.p, 1, src_bytes);
    std::memset(dst.p, 0, dst_bytes);
    FERRY_ASSIGN_OR_RETURN(auto src_mr, engine->register_memory(src.p, src_bytes));
    FERRY_ASSIGN_OR_RETURN(auto dst_mr, engine->register_memory(dst.p, dst_bytes));
    ByteWriter bw;
    engine->address().encode(bw);
    dst_mr->descriptor().encode(bw);
    const std::vector<uint8_t> mine = bw.take();
    FERRY_ASSIGN_OR_RETURN(auto blobs, ex.allgather(rank, mine, bc.timeout));
    std::vector<PeerId> peer(w);
    std::vector<MemoryDescriptor> desc(w);
    for (uint32_t q = 0; q < w; ++q) {
        if (cfg.same_node(q, rank)) continue;
        ByteReader rd(std::span<const uint8_t>(blobs[q]));
        FERRY_ASSIGN_OR_RETURN(auto address, EngineAddress::decode(rd));
        FERRY_ASSIGN_OR_RETURN(desc[q], MemoryDescriptor::decode(rd));
        FERRY_ASSIGN_OR_RETURN(peer[q], engine->connect(address));
    }
    const uint64_t chunk = bc.proxy_chunk ? bc.proxy_chunk : UINT64_MAX;
    auto pieces = [&](uint64_t len) {
        uint64_t n = 0;
        for (uint64_t at = 0; at < len; at += chunk)
            n += write_pieces(engine->config(), engine->num_rails(), std::min(chunk, len - at));
        return n;
    };
    const uint32_t imm[2] = {0x666c0000, 0x666c0001};
    for (int it = 0; it < bc.warmup + bc.iters; ++it) {
        FERRY_ASSIGN_OR_RETURN(auto sync, ex.allgather(rank, {}, bc.timeout));
        (void)sync;
        const TimePoint t0 = Clock::now();
        for (int k = 0; k < 2; ++k) {
            const std::vector<uint64_t>& b = bytes[k];
            std::vector<OpHandle> ops;
            uint64_t src_at = 0, expect = 0;
            for (uint32_t d = 0; d < w; ++d) {
                const uint64_t len = b[uint64_t{rank} * w + d];
                const uint64_t len_in = b[uint64_t{d} * w + rank];
                expect += pieces(len_in);
                if (len == 0) continue;
                uint64_t dst_at = 0;  // after the bytes of senders before this rank
                for (uint32_t s = 0; s < rank; ++s) dst_at += b[uint64_t{s} * w + d];
                for (uint64_t at = 0; at < len; at += chunk) {
                    WriteOp op;
                    op.peer = peer[d];
                    op.src = src_mr.get();
                    op.src_offset = src_at + at;
                    op.dst = &desc[d];
                    op.dst_offset = dst_at + at;
                    op.length = std::min(chunk, len - at);
                    op.imm = imm[k];
                    ops.push_back(engine->write(op));
                }
                src_at += len;
            }
            for (OpHandle& op : ops) FERRY_RETURN_IF_ERROR(op.wait(bc.timeout));
            if (expect) FERRY_RETURN_IF_ERROR(engine->wait_imm(imm[k], expect, bc.timeout));
        }
        if (it >= bc.warmup) samples->push_back(to_us(Clock::now() - t0));
    }
    // Nobody deregisters while a peer may still write into it.
    FERRY_ASSIGN_OR_RETURN(auto done, ex.allgather(rank, {}, bc.timeout));
    (void)done;
    return ok_status();
}

// Runs `fn(rank, result)` on one thread per rank; a failed rank releases the others.
template <typename Fn>
void on_rank_threads(uint32_t ranks, ThreadExchange& ex, std::vector<RankResult>* results, Fn fn) {
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < ranks; ++r) {
        threads.emplace_back([&, r] {
            RankResult& res = (*results)[r];
            res.status = fn(r, &res);
            if (!res.status.ok())
                ex.abort(res.status.with_context(fmt::format("rank {} failed", r)));
        });
    }
    for (auto& t : threads) t.join();
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
    {
        ThreadExchange ex(bc.ranks);
        on_rank_threads(bc.ranks, ex, results, [&](uint32_t r, RankResult* res) {
            return run_cuda_rank(bc, cfg, r, gpus, gate, ex, res);
        });
    }
    const uint32_t w = cfg.world_size;
    bool ok = true;
    for (auto& r : *results) ok = ok && r.status.ok();
    if (ok && bc.floor && w > cfg.ranks_per_node) {
        // The mapped path's layer: the same ranks as one node.
        MoeBenchConfig mb = bc;
        mb.trace = false;
        AllToAllConfig mc = cfg;
        mc.ranks_per_node = w;
        std::vector<RankResult> mapped(bc.ranks);
        *gate = 0;
        ThreadExchange ex(bc.ranks);
        on_rank_threads(bc.ranks, ex, &mapped, [&](uint32_t r, RankResult* res) {
            return run_cuda_rank(mb, mc, r, gpus, gate, ex, res);
        });
        // Each rank's remote bytes of one layer, as the proxied run moves them.
        const RowFormat row = RowFormat::of(cfg);
        const uint64_t crow = uint64_t{cfg.hidden} * sizeof(uint16_t);
        std::vector<uint64_t> bytes[2] = {std::vector<uint64_t>(uint64_t{w} * w),
                                          std::vector<uint64_t>(uint64_t{w} * w)};
        for (uint32_t s = 0; s < w && ok; ++s) {
            auto in = random_inputs(cfg, bc.tokens, bc.seed, s);
            auto plan = plan_send(cfg, in.idx, bc.tokens);
            if (!plan.ok()) return plan.status();
            for (uint32_t d = 0; d < w; ++d) {
                if (cfg.same_node(s, d)) continue;
                bytes[0][uint64_t{s} * w + d] = uint64_t{plan->rows_to[d]} * row.row_bytes;
                // d's results for s's tokens: a row per hit, or per dispatched row (per-rank).
                const uint32_t back =
                    cfg.combine == CombineMode::kPerRank ? plan->rows_to[d] : plan->hits_to[d];
                bytes[1][uint64_t{d} * w + s] = uint64_t{back} * crow;
            }
        }
        std::vector<RankResult> floor(bc.ranks);
        for (bool pinned : {true, false}) {
            ThreadExchange fex(bc.ranks);
            on_rank_threads(bc.ranks, fex, &floor, [&](uint32_t r, RankResult* res) {
                if (!res->status.ok()) return res->status;
                return run_floor_rank(bc, cfg, r, bytes, pinned, fex,
                                      pinned ? &res->floor_write : &res->floor_write_pageable);
            });
        }
        for (uint32_t r = 0; r < bc.ranks; ++r) {
            RankResult& res = (*results)[r];
            if (!mapped[r].status.ok()) {
                res.status = mapped[r].status.with_context("the mapped run of --floor");
            } else if (!floor[r].status.ok()) {
                res.status = floor[r].status.with_context("the write loop of --floor");
            }
            res.mapped_layer = mapped[r].samples[kLayer];
            res.floor_write = floor[r].floor_write;
            res.floor_write_pageable = floor[r].floor_write_pageable;
        }
    }
    cudaFreeHost(gate);
    return ok_status();
}

}  // namespace ferry::moe::bench_detail
