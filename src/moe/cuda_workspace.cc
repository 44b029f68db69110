#include "moe/cuda_workspace.h"

#include <fmt/format.h>

#include <algorithm>

#include "ferry/moe/plan.h"
#include "ferry/moe/wire_format.h"
#include "moe/device_proxy.h"

namespace ferry::moe {
namespace {

uint64_t align256(uint64_t v) { return (v + 255) / 256 * 256; }
uint64_t align4k(uint64_t v) { return (v + 4095) / 4096 * 4096; }

Status check_shapes(const AllToAllConfig& cfg, const CudaAllToAllOptions& options) {
    const uint32_t w = cfg.world_size, k = cfg.experts_per_token;
    if (w > cfg.ranks_per_node && !options.engine)
        return invalid_argument(fmt::format(
            "cuda all-to-all: world {} with {} ranks per node has ranks on other nodes, reached "
            "through the host proxy: set CudaAllToAllOptions::engine to a TransferEngine",
            w, cfg.ranks_per_node));
    if (w > cuda::kMaxCudaWorld)
        return invalid_argument(
            fmt::format("cuda all-to-all: world {} exceeds {}", w, cuda::kMaxCudaWorld));
    if (k > cuda::kMaxCudaTopk)
        return invalid_argument(fmt::format(
            "cuda all-to-all: experts_per_token {} exceeds the {} the combine kernel supports", k,
            cuda::kMaxCudaTopk));
    const auto& dc = options.dispatch;
    const auto& cc = options.combine;
    auto bad_threads = [](uint32_t n, uint32_t need) {
        return n < need || n > 1024 || n % 32 != 0;
    };
    if (dc.send_blocks == 0 || cc.send_blocks == 0 || cc.recv_blocks == 0 ||
        bad_threads(dc.send_threads, std::max(w, k)) || bad_threads(cc.send_threads, w) ||
        bad_threads(cc.recv_threads, 32))
        return invalid_argument(fmt::format(
            "cuda all-to-all: kernel shapes need at least one block and a multiple of 32 "
            "threads up to 1024, at least max(world, top-k) = {} for the send kernels",
            std::max(w, k)));
    return ok_status();
}

// The region peers write: counters, counts messages, dispatch rows, combine rows.
SharedLayout shared_layout(const AllToAllConfig& cfg, bool remote) {
    const uint64_t w = cfg.world_size, t = cfg.max_tokens_per_rank, k = cfg.experts_per_token;
    SharedLayout lay;
    lay.ctr_counts = 0;
    lay.ctr_dispatch = 8 * w;
    lay.ctr_combine = 16 * w;
    lay.counts = align256(24 * w);
    lay.dispatch = lay.counts + align256(w * CountsFormat::of(cfg).bytes);
    lay.combine = lay.dispatch + align256(w * t * RowFormat::of(cfg).row_bytes);
    // With remote ranks, their results land in a compact area after the slots.
    const uint64_t combine_rows = t * k * (remote ? 2 : 1);
    lay.total = lay.combine + align256(combine_rows * cfg.hidden * sizeof(uint16_t));
    return lay;
}

ScratchLayout scratch_layout(const AllToAllConfig& cfg, const CudaWorkspace& ws, bool trace) {
    const uint64_t w = cfg.world_size, t = cfg.max_tokens_per_rank, k = cfg.experts_per_token;
    const uint64_t rows = ws.max_rows;
    const bool remote = ws.remote, per_rank = ws.per_rank, streamed = ws.piece_rows != 0;
    // One allocation carved in 256-byte aligned pieces.
    uint64_t at = 0;
    auto take = [&at](bool used, uint64_t bytes) {
        const uint64_t o = at;
        at += used ? align256(bytes) : 0;
        return o;
    };
    const uint64_t recv_rows = w * t;  // every sender may send every token here
    ScratchLayout s;
    s.state = take(true, sizeof(cuda::DeviceState));
    s.peers = take(true, sizeof(uint8_t*) * w);
    s.dest_mask = take(true, sizeof(uint64_t) * t);
    s.row_pos = take(true, sizeof(uint32_t) * t * w);
    s.expert_counts = take(true, sizeof(uint32_t) * cfg.num_experts);
    s.rows_to = take(true, sizeof(uint32_t) * w);
    s.indices = take(true, sizeof(int32_t) * t * k);
    s.weights = take(true, sizeof(float) * t * k);
    s.row_src = take(true, sizeof(RowSource) * rows);
    s.out_row = take(true, sizeof(uint32_t) * rows);
    s.tickets = take(true, sizeof(unsigned long long) * cuda::kTickets);
    s.combine_slot = take(remote, sizeof(uint32_t) * t * k);
    s.combine_pos = take(remote, sizeof(uint32_t) * rows);
    s.place = take(true, sizeof(uint32_t) * t * k);
    s.hit_base = take(remote, sizeof(uint32_t) * t * w);
    s.recv_hits = take(true, sizeof(uint32_t) * w);
    s.counts_mirror = take(remote, w * CountsFormat::of(cfg).bytes);
    s.recv_o = take(per_rank, sizeof(uint32_t) * recv_rows * k);
    s.recv_w = take(per_rank, sizeof(float) * recv_rows * k);
    s.recv_token = take(per_rank, sizeof(uint32_t) * recv_rows);
    s.recv_start = take(per_rank, sizeof(uint32_t) * (w + 1));
    s.piece_done = take(true, sizeof(uint32_t) * w * ws.max_pieces);
    s.combine_inv = take(streamed, sizeof(uint32_t) * rows);
    s.piece_seen = take(streamed, sizeof(unsigned long long) * w);
    s.combine_base = take(streamed, sizeof(uint32_t) * w);
    s.trace = take(trace, sizeof(unsigned long long) * 2 * cuda::kTracePoints);
    s.total = at;
    return s;
}

}  // namespace

Result<CudaWorkspace> plan_cuda_workspace(const AllToAllConfig& cfg,
                                          const CudaAllToAllOptions& options) {
    FERRY_RETURN_IF_ERROR(cfg.validate());
    FERRY_RETURN_IF_ERROR(check_shapes(cfg, options));
    const uint32_t w = cfg.world_size, t = cfg.max_tokens_per_rank, k = cfg.experts_per_token;
    CudaWorkspace ws;
    // Some rank is on another node exactly when the world spans several nodes.
    ws.remote = w > cfg.ranks_per_node;
    ws.per_rank = cfg.combine == CombineMode::kPerRank;
    ws.max_rows = max_expert_rows(cfg);
    ws.shared = shared_layout(cfg, ws.remote);
    ws.combine_row_bytes = uint64_t{cfg.hidden} * sizeof(uint16_t);
    if (ws.remote && !ws.per_rank && options.stream_combine &&
        options.proxy_chunk_bytes >= ws.combine_row_bytes) {
        ws.piece_rows = static_cast<uint32_t>(
            std::min<uint64_t>(options.proxy_chunk_bytes / ws.combine_row_bytes, uint64_t{t} * k));
        ws.max_pieces = (t * k + ws.piece_rows - 1) / ws.piece_rows;
    }
    // The proxy's immediates (DeviceProxy::data_imm, record_imm, piece_imm) must not wrap
    // around to values other users of the engine hold.
    ws.proxy_imms = uint64_t{2} * proxy::kParts * kMaxWorldSize + uint64_t{ws.max_pieces} * w;
    const uint64_t imm_end = uint64_t{options.imm_base} + ws.proxy_imms;
    if (ws.remote && imm_end > (uint64_t{1} << 32))
        return invalid_argument(fmt::format(
            "cuda all-to-all: CudaAllToAllOptions::imm_base {:#x} leaves no room for the {} "
            "immediates the host proxy uses here; choose a base at or below {:#x}",
            options.imm_base, ws.proxy_imms, (uint64_t{1} << 32) - ws.proxy_imms));
    ws.scratch = scratch_layout(cfg, ws, options.trace);
    if (ws.remote) {
        uint32_t remote_ranks = 0;
        for (uint32_t r = 0; r < w; ++r) remote_ranks += cfg.same_node(r, cfg.rank) ? 0 : 1;
        ws.publish_bytes = sizeof(proxy::Publish) * uint64_t{w} * proxy::kParts;
        ws.stream_ready_bytes = sizeof(uint32_t) * uint64_t{w} * ws.max_pieces;
        // An outbox slab is laid out like the peer's inbox (the region, then the record
        // slots), so kernels address remote and mapped peers alike.
        ws.proxy_slab = align4k(proxy_inbox_bytes(ws.shared, w));
        ws.outbox_bytes = ws.proxy_slab * remote_ranks;
    }
    return ws;
}

CudaGrids choose_cuda_grids(std::span<const GpuSeat> seats, const CudaDispatchKernelConfig& dc,
                            const CudaCombineKernelConfig& cc) {
    CudaGrids g;
    uint32_t min_sms = UINT32_MAX;
    for (const GpuSeat& r : seats) {
        uint32_t on_device = 0;
        for (const GpuSeat& q : seats)
            on_device += q.host_id == r.host_id && q.device == r.device ? 1 : 0;
        g.share = std::max(g.share, on_device);
        min_sms = std::min(min_sms, r.sm_count);
    }
    const uint32_t share = g.share;
    auto fit = [&](uint32_t blocks) {
        const uint32_t per_rank = min_sms / share;
        return share == 1 ? blocks : std::min(blocks, per_rank > 1 ? per_rank - 1 : 1u);
    };
    g.dispatch_send = fit(dc.send_blocks);
    g.combine_send = fit(cc.send_blocks);
    g.combine_recv = fit(cc.recv_blocks);
    g.dispatch_recv = fit(2 * min_sms);
    return g;
}

}  // namespace ferry::moe
