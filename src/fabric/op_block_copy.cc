// Block copies (copy_blocks): checked on the host in O(blocks + planes), then handed to the GPU
// transport as block ids, plane addresses and one geometry; the copy kernel computes every
// address itself.
#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "fabric/block_copy.h"
#include "fabric/checked_offset.h"
#include "fabric/engine_impl.h"

namespace ferry::detail {
namespace {

Status check_side(const BlockCopySide& s, uint32_t end_token, const char* name) {
    if (s.block_size == 0 || s.block_stride == 0 || s.token_stride == 0 || s.head_stride == 0) {
        return invalid_argument(fmt::format(
            "copy_blocks: the {} side has a zero block size or stride (block size {}, strides "
            "{} / {} / {})",
            name, s.block_size, s.block_stride, s.token_stride, s.head_stride));
    }
    const uint32_t need = block_copy_ids(s, end_token);
    if (s.blocks.size() < need) {
        return invalid_argument(
            fmt::format("copy_blocks: the {} side has {} block ids, tokens up to {} need {}", name,
                        s.blocks.size(), end_token, need));
    }
    return ok_status();
}

}  // namespace

Result<BlockCopyGeom> make_block_copy_geom(const BlockCopyOp& op) {
    if (op.heads == 0 || op.head_bytes == 0) {
        return invalid_argument(fmt::format("copy_blocks: {} heads of {} bytes: nothing to copy",
                                            op.heads, op.head_bytes));
    }
    if (op.first_token >= op.end_token) {
        return invalid_argument(fmt::format("copy_blocks: token range [{}, {}) is empty",
                                            op.first_token, op.end_token));
    }
    FERRY_RETURN_IF_ERROR(check_side(op.src, op.end_token, "source"));
    FERRY_RETURN_IF_ERROR(check_side(op.dst, op.end_token, "destination"));
    if (op.src.planes.size() != op.dst.planes.size() || op.src.planes.empty() ||
        op.src.planes.size() > UINT32_MAX) {
        return invalid_argument(
            fmt::format("copy_blocks: {} source planes and {} destination planes; they pair up "
                        "in order and there must be some",
                        op.src.planes.size(), op.dst.planes.size()));
    }
    BlockCopyGeom g;
    auto side = [](const BlockCopySide& s) {
        return BlockSideGeom{s.block_stride, s.token_stride, s.head_stride, s.block_size};
    };
    g.src = side(op.src);
    g.dst = side(op.dst);
    g.head_bytes = op.head_bytes;
    g.planes = static_cast<uint32_t>(op.src.planes.size());
    g.heads = op.heads;
    g.first_token = op.first_token;
    g.end_token = op.end_token;
    g.chunk_tokens = std::gcd(op.src.block_size, op.dst.block_size);
    if (uint64_t{g.chunk_tokens} * g.heads > (1u << 30)) {
        return invalid_argument(fmt::format(
            "copy_blocks: chunks of {} tokens x {} heads are too large", g.chunk_tokens, g.heads));
    }
    g.first_chunk = op.first_token / g.chunk_tokens;
    g.chunks = (op.end_token + g.chunk_tokens - 1) / g.chunk_tokens - g.first_chunk;
    const uint64_t hb = op.head_bytes;
    const bool heads_joined = op.src.head_stride == hb && op.dst.head_stride == hb;
    const uint64_t all_heads = hb * op.heads;
    if (heads_joined && op.src.token_stride == all_heads && op.dst.token_stride == all_heads) {
        g.rows = kRowsWhole;
    } else if (heads_joined) {
        g.rows = kRowsPerToken;
    } else if (op.src.token_stride == hb && op.dst.token_stride == hb) {
        g.rows = kRowsPerHead;
    } else {
        g.rows = kRowsPerElem;
    }
    uint32_t rows = 0;
    uint64_t row_len = 0;
    block_chunk_rows(g, g.chunk_tokens, &rows, &row_len);
    g.rows_per_item = row_len >= kBlockCopyPiece
                          ? 1
                          : static_cast<uint32_t>(std::min<uint64_t>(
                                rows, std::max<uint64_t>(1, kBlockCopyPiece / row_len)));
    g.pieces_per_row = static_cast<uint32_t>((row_len + kBlockCopyPiece - 1) / kBlockCopyPiece);
    const uint64_t groups = (rows + g.rows_per_item - 1) / g.rows_per_item;
    g.items_per_chunk = groups * g.pieces_per_row;
    g.items = uint64_t{g.planes} * g.chunks * g.items_per_chunk;
    if (g.items > UINT32_MAX) {
        return invalid_argument(fmt::format(
            "copy_blocks: {} pieces of at most {} bytes is more than one copy takes (2^32); "
            "split the token or layer range",
            g.items, kBlockCopyPiece));
    }
    return g;
}

std::vector<BlockCopyStretch> block_copy_stretches(const BlockCopyGeom& g,
                                                   std::span<const uint32_t> src_blocks,
                                                   std::span<const uint32_t> dst_blocks,
                                                   uint64_t min_avg) {
    const uint64_t bs = g.src.block_size;
    const uint64_t tb = g.src.token_stride;
    if (g.rows != kRowsWhole || g.src.block_size != g.dst.block_size || g.dst.token_stride != tb ||
        g.src.block_stride != bs * tb || g.dst.block_stride != bs * tb ||
        g.first_token >= g.end_token) {
        return {};
    }
    const uint64_t b0 = g.first_token / bs;
    const uint64_t b1 = (g.end_token + bs - 1) / bs;
    if (src_blocks.size() < b1 || dst_blocks.size() < b1) return {};
    auto follows = [&](uint64_t b) {
        return uint64_t{src_blocks[b]} == uint64_t{src_blocks[b - 1]} + 1 &&
               uint64_t{dst_blocks[b]} == uint64_t{dst_blocks[b - 1]} + 1;
    };
    uint64_t count = 1;
    for (uint64_t b = b0 + 1; b < b1; ++b) count += follows(b) ? 0 : 1;
    if (uint64_t{g.end_token - g.first_token} * tb / count < min_avg) return {};
    std::vector<BlockCopyStretch> out;
    out.reserve(count);
    for (uint64_t b = b0; b < b1; ++b) {
        const uint64_t first = std::max<uint64_t>(b * bs, g.first_token);
        const uint64_t end = std::min<uint64_t>((b + 1) * bs, g.end_token);
        if (b > b0 && follows(b)) {
            out.back().len += (end - first) * tb;
            continue;
        }
        out.push_back({src_blocks[b] * bs * tb + (first % bs) * tb,
                       dst_blocks[b] * bs * tb + (first % bs) * tb, (end - first) * tb});
    }
    return out;
}

uint64_t block_copy_reach(const BlockCopySide& side, uint32_t heads, uint64_t head_bytes,
                          uint32_t max_block) {
    // Where the sum does not fit in 64 bits the reach is the largest offset there is, so the
    // bounds check that follows names the plane as overrunning its region (checked_offset.h).
    std::optional<uint64_t> reach = checked_offset(head_bytes, max_block, side.block_stride);
    if (reach) reach = checked_offset(*reach, uint64_t{side.block_size} - 1, side.token_stride);
    if (reach) {
        reach = checked_offset(*reach, uint64_t{side.first_head} + heads - 1, side.head_stride);
    }
    return reach ? *reach : UINT64_MAX;
}

bool EngineImpl::copies_on_gpu(PeerId peer_id, const MemoryRegion& local,
                               const MemoryDescriptor& remote) const {
    const Peer* p = peer(peer_id);
    if (!p) return false;
    auto path = choose_path(*p, local, remote, "copies_on_gpu");
    return path.ok() && *path == Path::kGpuIpc;
}

OpHandle EngineImpl::copy_blocks(const BlockCopyOp& op, OpCallback done) {
    OpRef state = make_op_state(std::move(done));
    auto fail = [&](Status s) {
        state->fail_now(std::move(s));
        return OpHandle(state);
    };
    const Peer* p = peer(op.peer);
    if (!p) return fail(not_found(fmt::format("copy_blocks: peer {} is not connected", op.peer)));
    if (op.read && op.imm) {
        return fail(invalid_argument("copy_blocks: a read carries no immediate"));
    }
    auto geom = make_block_copy_geom(op);
    if (!geom.ok()) return fail(geom.status());
    if (op.local.empty() || op.remote.empty()) {
        return fail(invalid_argument("copy_blocks: no local or no remote regions given"));
    }
    const BlockCopySide& here = op.read ? op.dst : op.src;
    const BlockCopySide& there = op.read ? op.src : op.dst;
    // Every region the planes name: ours, the peer's, one GPU path between each pair used,
    // checked once per pair (a KV push names the same pair for all 128 planes of a 64-layer
    // pool in one region).
    const int device = op.local[0] ? op.local[0]->descriptor().device : -1;
    std::vector<std::pair<uint32_t, uint32_t>> checked;
    for (size_t i = 0; i < here.planes.size(); ++i) {
        const uint32_t lr = here.planes[i].region, rr = there.planes[i].region;
        if (lr >= op.local.size() || rr >= op.remote.size()) {
            return fail(out_of_range(fmt::format(
                "copy_blocks: plane {} names local region {} and remote region {}; {} and {} "
                "were given",
                i, lr, rr, op.local.size(), op.remote.size())));
        }
        if ((!checked.empty() && checked.back() == std::pair{lr, rr}) ||
            std::find(checked.begin(), checked.end(), std::pair{lr, rr}) != checked.end()) {
            continue;
        }
        checked.emplace_back(lr, rr);
        Status s = check_local(op.local[lr], 0, 0, "copy_blocks");
        if (s.ok()) s = check_remote(*p, &op.remote[rr], 0, 0, "copy_blocks");
        if (!s.ok()) return fail(s);
        auto path = choose_path(*p, *op.local[lr], op.remote[rr], "copy_blocks");
        if (!path.ok()) return fail(path.status());
        if (*path != Path::kGpuIpc || op.local[lr]->descriptor().device != device) {
            return fail(invalid_argument(
                "copy_blocks: only between GPU memory of this host (CUDA IPC), with every local "
                "region on one GPU; use write_runs / read_runs for the runs elsewhere"));
        }
    }
    // Bounds: the largest block id of each side the token range uses, every plane.
    auto max_id = [&](const BlockCopySide& s) {
        const uint32_t n = block_copy_ids(s, op.end_token);
        return *std::max_element(s.blocks.begin(), s.blocks.begin() + n);
    };
    const uint64_t here_reach = block_copy_reach(here, op.heads, op.head_bytes, max_id(here));
    const uint64_t there_reach = block_copy_reach(there, op.heads, op.head_bytes, max_id(there));
    for (size_t i = 0; i < here.planes.size(); ++i) {
        const BlockPlane& lp = here.planes[i];
        const BlockPlane& rp = there.planes[i];
        Status s = check_local(op.local[lp.region], lp.offset, here_reach, "copy_blocks");
        if (s.ok())
            s = check_remote(*p, &op.remote[rp.region], rp.offset, there_reach, "copy_blocks");
        if (!s.ok()) {
            return fail(s.with_context(
                fmt::format("plane {} up to the largest block id of each side ({} here, {} at "
                            "the peer)",
                            i, max_id(here), max_id(there))));
        }
    }
    // Region bases, mapped once per remote region.
    std::vector<uint64_t> remote_base(op.remote.size(), 0);
    std::vector<bool> mapped(op.remote.size(), false);
    GpuBlockCopy bc;
    bc.geom = *geom;
    auto& here_planes = op.read ? bc.dst_planes : bc.src_planes;
    auto& there_planes = op.read ? bc.src_planes : bc.dst_planes;
    here_planes.reserve(here.planes.size());
    there_planes.reserve(there.planes.size());
    for (size_t i = 0; i < here.planes.size(); ++i) {
        const BlockPlane& lp = here.planes[i];
        const BlockPlane& rp = there.planes[i];
        if (!mapped[rp.region]) {
            auto base = map_gpu_peer(op.remote[rp.region], *op.local[lp.region]);
            if (!base.ok()) return fail(base.status());
            remote_base[rp.region] = *base;
            mapped[rp.region] = true;
        }
        here_planes.push_back(reinterpret_cast<uint64_t>(op.local[lp.region]->data()) + lp.offset +
                              uint64_t{here.first_head} * here.head_stride);
        there_planes.push_back(remote_base[rp.region] + rp.offset +
                               uint64_t{there.first_head} * there.head_stride);
    }
    GpuWork work;
    // Long stretches of consecutive blocks on both sides go as runs (the tiled kernel: 0.98x of
    // cudaMemcpyAsync where the block copy kernel's 4 KiB items run at ~0.93x, one H200,
    // 2026-12-03); scattered blocks as the block copy.
    const std::vector<BlockCopyStretch> stretches =
        block_copy_stretches(*geom, op.src.blocks, op.dst.blocks, kTiledRunMin);
    if (!stretches.empty()) {
        work.copies.reserve(stretches.size() * bc.src_planes.size());
        for (size_t i = 0; i < bc.src_planes.size(); ++i) {
            for (const BlockCopyStretch& st : stretches) {
                work.copies.push_back(
                    {bc.dst_planes[i] + st.dst_off, bc.src_planes[i] + st.src_off, st.len});
            }
        }
        return gpu_op(std::move(state), op.peer, device, std::move(work), op.imm);
    }
    bc.src_blocks.assign(op.src.blocks.begin(),
                         op.src.blocks.begin() + block_copy_ids(op.src, op.end_token));
    bc.dst_blocks.assign(op.dst.blocks.begin(),
                         op.dst.blocks.begin() + block_copy_ids(op.dst, op.end_token));
    work.blocks.push_back(std::move(bc));
    return gpu_op(std::move(state), op.peer, device, std::move(work), op.imm);
}

}  // namespace ferry::detail
