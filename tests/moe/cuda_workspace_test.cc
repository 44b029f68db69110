// The CUDA all-to-all's workspace plan and grid choice, without a GPU: exact sizes for a
// DeepSeek-V3-shaped decode config worked by hand, and the invariants every plan keeps
// (256-byte aligned, non-overlapping scratch pieces; unused pieces empty; pinned memory only
// with ranks on other nodes).
#include "moe/cuda_workspace.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "moe/device_proxy.h"

namespace ferry::moe {
namespace {

// 8 ranks on one node, fp8 hidden 7168, 256 experts, top-8, 128 tokens per rank.
AllToAllConfig decode_config() {
    return {.max_tokens_per_rank = 128,
            .hidden = 7168,
            .dtype = DType::kFp8E4M3,
            .num_experts = 256,
            .experts_per_token = 8,
            .world_size = 8,
            .ranks_per_node = 8,
            .private_slots_per_sender = 8};
}

// The plan only checks that an engine is set; it never calls it.
TransferEngine* some_engine() {
    static int placeholder = 0;
    return reinterpret_cast<TransferEngine*>(&placeholder);
}

// (offset, bytes the piece needs) of every scratch piece, in allocation order.
std::vector<std::pair<uint64_t, uint64_t>> pieces(const AllToAllConfig& cfg,
                                                  const CudaWorkspace& ws, bool trace) {
    const uint64_t w = cfg.world_size, t = cfg.max_tokens_per_rank, k = cfg.experts_per_token;
    const uint64_t rows = ws.max_rows, cbytes = CountsFormat::of(cfg).bytes;
    const bool r = ws.remote, p = ws.per_rank, s = ws.piece_rows != 0;
    const ScratchLayout& o = ws.scratch;
    return {{o.state, sizeof(cuda::DeviceState)},
            {o.peers, 8 * w},
            {o.dest_mask, 8 * t},
            {o.row_pos, 4 * t * w},
            {o.expert_counts, 4 * uint64_t{cfg.num_experts}},
            {o.rows_to, 4 * w},
            {o.indices, 4 * t * k},
            {o.weights, 4 * t * k},
            {o.row_src, sizeof(RowSource) * rows},
            {o.out_row, 4 * rows},
            {o.tickets, 8 * uint64_t{cuda::kTickets}},
            {o.combine_slot, r ? 4 * t * k : 0},
            {o.combine_pos, r ? 4 * rows : 0},
            {o.place, 4 * t * k},
            {o.hit_base, r ? 4 * t * w : 0},
            {o.recv_hits, 4 * w},
            {o.counts_mirror, r ? w * cbytes : 0},
            {o.recv_o, p ? 4 * w * t * k : 0},
            {o.recv_w, p ? 4 * w * t * k : 0},
            {o.recv_token, p ? 4 * w * t : 0},
            {o.recv_start, p ? 4 * (w + 1) : 0},
            {o.piece_done, 4 * w * ws.max_pieces},
            {o.combine_inv, s ? 4 * rows : 0},
            {o.piece_seen, s ? 8 * w : 0},
            {o.combine_base, s ? 4 * w : 0},
            {o.trace, trace ? 16 * uint64_t{cuda::kTracePoints} : 0},
            {o.total, 0}};
}

void expect_scratch_invariants(const AllToAllConfig& cfg, const CudaWorkspace& ws, bool trace) {
    const auto ps = pieces(cfg, ws, trace);
    EXPECT_EQ(ps.front().first, 0u);
    for (size_t i = 0; i + 1 < ps.size(); ++i) {
        SCOPED_TRACE(::testing::Message() << "scratch piece " << i);
        EXPECT_EQ(ps[i].first % 256, 0u);
        // Room for the piece, nothing more than its 256-byte rounding: no overlap, no gap.
        EXPECT_EQ(ps[i + 1].first - ps[i].first, (ps[i].second + 255) / 256 * 256);
    }
}

TEST(CudaWorkspace, DecodeConfigSizesWorkedByHand) {
    const AllToAllConfig cfg = decode_config();
    auto ws = plan_cuda_workspace(cfg, CudaAllToAllOptions{});
    ASSERT_TRUE(ws.ok()) << ws.status().message();
    EXPECT_FALSE(ws->remote);
    // A row: header 8 + local ids 2*8 -> place at 24, hit_base 56, weights 60..92, payload at
    // 96 (16-aligned), 7168 fp8 bytes, then 56 fp32 scales: 7488 bytes. A counts message:
    // 4 + 8 + 32 words = 176 bytes, padded to 192.
    const SharedLayout& s = ws->shared;
    EXPECT_EQ(s.ctr_counts, 0u);
    EXPECT_EQ(s.ctr_dispatch, 64u);
    EXPECT_EQ(s.ctr_combine, 128u);
    EXPECT_EQ(s.counts, 256u);
    EXPECT_EQ(s.dispatch, 256u + 1536u);
    EXPECT_EQ(s.combine, 1792u + 8u * 128 * 7488);  // 7669504
    EXPECT_EQ(s.total, 7669504u + 128u * 8 * 7168 * 2);
    EXPECT_EQ(s.total, 22349568u);
    // Every sender may send every token to one rank, and each hits at most top-8 experts.
    EXPECT_EQ(ws->max_rows, 8u * 128 * 8);
    EXPECT_EQ(ws->scratch.out_row - ws->scratch.row_src, 12u * 8192);
    // Single node: no proxy, no pinned memory, no streamed combine, no per-rank scratch.
    EXPECT_EQ(ws->piece_rows, 0u);
    EXPECT_EQ(ws->pinned_bytes(), 0u);
    EXPECT_EQ(ws->scratch.combine_slot, ws->scratch.combine_pos);
    EXPECT_EQ(ws->scratch.recv_o, ws->scratch.recv_w);
    EXPECT_EQ(ws->scratch.trace, ws->scratch.total);
    EXPECT_EQ(ws->device_bytes(), s.total + ws->scratch.total);
    expect_scratch_invariants(cfg, *ws, false);
}

TEST(CudaWorkspace, SharedRegionPartsAreAlignedAndDisjoint) {
    for (uint32_t world : {1u, 2u, 3u, 8u, 64u}) {
        for (DType dtype : {DType::kBf16, DType::kFp8E4M3}) {
            AllToAllConfig cfg = decode_config();
            cfg.world_size = cfg.ranks_per_node = world;
            cfg.num_experts = 64 * world;
            cfg.dtype = dtype;
            SCOPED_TRACE(::testing::Message() << "world " << world);
            auto ws = plan_cuda_workspace(cfg, CudaAllToAllOptions{});
            ASSERT_TRUE(ws.ok()) << ws.status().message();
            const SharedLayout& s = ws->shared;
            // Three counters per sender, then the counts, rows and combine rows, 256-aligned.
            EXPECT_LE(s.ctr_combine + 8 * world, s.counts);
            EXPECT_EQ(s.counts % 256, 0u);
            EXPECT_EQ(s.dispatch % 256, 0u);
            EXPECT_EQ(s.combine % 256, 0u);
            EXPECT_GE(s.dispatch - s.counts, uint64_t{world} * CountsFormat::of(cfg).bytes);
            EXPECT_GE(s.combine - s.dispatch, uint64_t{world} * 128 * RowFormat::of(cfg).row_bytes);
            EXPECT_EQ(s.total - s.combine, 128u * 8 * 7168 * 2);
            expect_scratch_invariants(cfg, *ws, false);
        }
    }
}

TEST(CudaWorkspace, RanksOnOtherNodesGetTheProxyBuffersAndAStreamedCombine) {
    AllToAllConfig cfg = decode_config();
    cfg.world_size = 16;  // two nodes of 8
    cfg.rank = 3;
    CudaAllToAllOptions opt;
    opt.engine = some_engine();
    opt.trace = true;
    auto ws = plan_cuda_workspace(cfg, opt);
    ASSERT_TRUE(ws.ok()) << ws.status().message();
    EXPECT_TRUE(ws->remote);
    // Remote results land in a second combine area of the same size.
    EXPECT_EQ(ws->shared.total - ws->shared.combine, 2u * 128 * 8 * 7168 * 2);
    // 256 KiB proxy chunks of 14336-byte rows: 18 rows a piece, 57 pieces for 1024 rows.
    EXPECT_EQ(ws->piece_rows, 18u);
    EXPECT_EQ(ws->max_pieces, 57u);
    EXPECT_EQ(ws->stream_ready_bytes, 4u * 16 * 57);
    EXPECT_EQ(ws->publish_bytes, 32u * 16 * proxy::kParts);
    // An inbox holds the whole region plus the proxy's records, in whole pages; one outbox
    // slab per rank of the other node.
    EXPECT_EQ(ws->proxy_slab % 4096, 0u);
    EXPECT_GT(ws->proxy_slab, ws->shared.total);
    EXPECT_GE(ws->proxy_slab, proxy_inbox_bytes(ws->shared, 16));
    EXPECT_LT(ws->proxy_slab - proxy_inbox_bytes(ws->shared, 16), 4096u);
    EXPECT_EQ(ws->outbox_bytes, 8 * ws->proxy_slab);
    EXPECT_EQ(ws->pinned_bytes(), ws->publish_bytes + ws->stream_ready_bytes + 9 * ws->proxy_slab);
    EXPECT_EQ(ws->proxy_imms, 2u * proxy::kParts * kMaxWorldSize + 57u * 16);
    EXPECT_LT(ws->scratch.trace, ws->scratch.total);
    expect_scratch_invariants(cfg, *ws, true);

    // Per-rank combine: no streamed pieces, the per-rank scratch instead.
    cfg.combine = CombineMode::kPerRank;
    ws = plan_cuda_workspace(cfg, opt);
    ASSERT_TRUE(ws.ok()) << ws.status().message();
    EXPECT_EQ(ws->piece_rows, 0u);
    EXPECT_EQ(ws->stream_ready_bytes, 0u);
    EXPECT_EQ(ws->scratch.recv_w - ws->scratch.recv_o, 4u * 16 * 128 * 8);
    expect_scratch_invariants(cfg, *ws, true);
}

TEST(CudaWorkspace, RefusesWhatNoGpuCouldRunWithAClearError) {
    AllToAllConfig cfg = decode_config();
    cfg.world_size = 16;
    auto no_engine = plan_cuda_workspace(cfg, CudaAllToAllOptions{});
    ASSERT_FALSE(no_engine.ok());
    EXPECT_NE(no_engine.status().message().find("CudaAllToAllOptions::engine"), std::string::npos);

    CudaAllToAllOptions opt;
    opt.engine = some_engine();
    opt.imm_base = 0xffffff00u;
    auto imms = plan_cuda_workspace(cfg, opt);
    ASSERT_FALSE(imms.ok());
    EXPECT_NE(imms.status().message().find("imm_base 0xffffff00"), std::string::npos)
        << imms.status().message();
    EXPECT_NE(imms.status().message().find("at or below 0xffffdc70"), std::string::npos)
        << imms.status().message();  // 2^32 - 9104 immediates

    AllToAllConfig wide = decode_config();
    wide.world_size = wide.ranks_per_node = 128;
    auto too_wide = plan_cuda_workspace(wide, CudaAllToAllOptions{});
    ASSERT_FALSE(too_wide.ok());
    EXPECT_NE(too_wide.status().message().find("world 128 exceeds 64"), std::string::npos);

    CudaAllToAllOptions odd;
    odd.dispatch.send_threads = 48;
    auto shapes = plan_cuda_workspace(decode_config(), odd);
    ASSERT_FALSE(shapes.ok());
    EXPECT_NE(shapes.status().message().find("multiple of 32"), std::string::npos);

    AllToAllConfig bad = decode_config();
    bad.hidden = 0;
    EXPECT_FALSE(plan_cuda_workspace(bad, CudaAllToAllOptions{}).ok());
}

TEST(CudaGrids, OneRankPerGpuKeepsTheRequestedGrids) {
    std::vector<GpuSeat> seats;
    for (int d = 0; d < 8; ++d) seats.push_back({7, d, 132});
    const CudaGrids g = choose_cuda_grids(seats, {}, {});
    EXPECT_EQ(g.share, 1u);
    EXPECT_EQ(g.dispatch_send, 128u);
    EXPECT_EQ(g.combine_send, 128u);
    EXPECT_EQ(g.combine_recv, 256u);
    EXPECT_EQ(g.dispatch_recv, 264u);  // two blocks per SM
}

TEST(CudaGrids, RanksSharingAGpuSplitItsSmsWithOneLeftForThePlanKernel) {
    // Four ranks on two GPUs of one host; a rank of another host on its device 0 does not
    // share with them.
    std::vector<GpuSeat> seats = {{7, 0, 132}, {7, 0, 132}, {7, 1, 132}, {7, 1, 132}};
    CudaGrids g = choose_cuda_grids(seats, {}, {});
    EXPECT_EQ(g.share, 2u);
    EXPECT_EQ(g.dispatch_send, 65u);  // 132 / 2 - 1
    EXPECT_EQ(g.combine_send, 65u);
    EXPECT_EQ(g.combine_recv, 65u);
    EXPECT_EQ(g.dispatch_recv, 65u);
    CudaDispatchKernelConfig small;
    small.send_blocks = 16;
    g = choose_cuda_grids(seats, small, {});
    EXPECT_EQ(g.dispatch_send, 16u);

    // The smallest GPU of the world bounds everyone's grids.
    seats = {{1, 0, 132}, {2, 0, 78}, {2, 0, 78}};
    g = choose_cuda_grids(seats, {}, {});
    EXPECT_EQ(g.share, 2u);
    EXPECT_EQ(g.dispatch_send, 38u);  // 78 / 2 - 1
}

}  // namespace
}  // namespace ferry::moe
