// From a producer's blocks to a consumer's blocks: the list of contiguous byte runs to copy
// between the two pools. Block sizes, TP degrees, placements and block orders may differ on
// the two sides; head dim, element size and layer count may not.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/types.h"
#include "ferry/kv/layout.h"

namespace ferry::kv {

// One rank of a tensor-parallel group and its pool layout. KV heads are split evenly and in
// order: rank r holds global heads [r * heads_per_rank, (r + 1) * heads_per_rank).
struct KvRank {
    KvLayout layout;
    uint32_t tp_rank = 0;
    uint32_t tp_size = 1;

    uint32_t first_head() const { return tp_rank * layout.num_kv_heads; }
    uint32_t total_heads() const { return tp_size * layout.num_kv_heads; }
};

// Which ranks of the other side a rank exchanges KV with: those whose head ranges overlap its
// own. Both sides call these, so producer and consumer agree on who writes where without
// exchanging it. total_heads must be divisible by both TP sizes.
Result<std::vector<uint32_t>> producers_for_consumer(uint32_t total_heads, uint32_t producer_tp,
                                                     uint32_t consumer_tp, uint32_t consumer_rank);
Result<std::vector<uint32_t>> consumers_for_producer(uint32_t total_heads, uint32_t producer_tp,
                                                     uint32_t consumer_tp, uint32_t producer_rank);

// A contiguous copy: `length` bytes at src_offset of the producer pool go to dst_offset of the
// consumer pool.
using ByteRun = WriteRun;  // what TransferEngine::write_runs takes

// Runs [first, first + count) of a plan go from region src_region of the producer's pool to
// region dst_region of the consumer's (KvPoolRegions); one engine operation cannot span two.
struct RegionRuns {
    uint32_t src_region = 0;
    uint32_t dst_region = 0;
    size_t first = 0;
    size_t count = 0;
};

struct TransferPlan {
    // Coalesced: no run continues where the previous one ends. Offsets are inside the regions
    // `groups` names (for one-region pools: pool offsets). No run crosses a region boundary.
    std::vector<ByteRun> runs;
    uint64_t bytes = 0;  // sum of run lengths
    // Consecutive runs of one (src region, dst region) pair, in run order; one group when
    // both pools are one region.
    std::vector<RegionRuns> groups;

    // Descriptors (writes before any splitting by the engine) this transfer costs.
    size_t descriptor_count() const { return runs.size(); }
};

// What to move: tokens [first_token, end_token) of one request. Block lists start at the
// request's token 0 on both sides; only the blocks the range touches must be present.
struct TransferSpec {
    KvRank src;
    std::span<const uint32_t> src_blocks;
    KvRank dst;
    std::span<const uint32_t> dst_blocks;
    uint32_t first_token = 0;
    uint32_t end_token = 0;
    // Layers [first_layer, end_layer) only (end_layer 0: up to the last layer): a chunk's KV
    // can go out layer by layer as prefill computes it.
    uint32_t first_layer = 0;
    uint32_t end_layer = 0;
};

// The heads two ranks share, in each side's local numbering; count 0 when none.
struct SharedHeads {
    uint32_t count = 0;
    uint32_t src_first = 0;
    uint32_t dst_first = 0;
};

// What plan_transfer and plan_block_copy check before planning: compatible layouts, token and
// layer ranges inside the request and the layers, enough block ids, every id inside its pool
// (ids only when the token range is not empty). Returns the heads the ranks share.
Result<SharedHeads> check_transfer(const TransferSpec& spec);

// The runs that copy the heads the two ranks share, for every layer of the range, K and V,
// token of the range. An empty plan when the ranks share no head. Errors name what does not fit
// (incompatible layouts, too few blocks, block id out of the pool).
Result<TransferPlan> plan_transfer(const TransferSpec& spec);

// The same transfer as plan_transfer's, in the form TransferEngine::copy_blocks takes: both
// layouts as strides, one plane per (layer, K/V) of the layer range on each side (K first,
// layer-major), each in the region of the pool that holds it, and the spec's block lists as
// they are. Made in O(layers) whatever the number of blocks: between GPUs of one host the copy
// kernel computes every address, where the runs cost the host a run per (layer, K/V, block).
struct BlockCopyPlan {
    BlockCopySide src;  // planes left empty: op() points them at src_planes / dst_planes
    BlockCopySide dst;
    std::vector<BlockPlane> src_planes;
    std::vector<BlockPlane> dst_planes;
    uint32_t first_token = 0;
    uint32_t end_token = 0;
    uint32_t heads = 0;
    uint64_t head_bytes = 0;
    uint64_t bytes = 0;  // what plan_transfer's runs add up to; 0: nothing to copy

    // The operation without peer, direction, regions and immediate. It points into this plan
    // and the spec's block lists, which must outlive posting it.
    BlockCopyOp op() const;
};
Result<BlockCopyPlan> plan_block_copy(const TransferSpec& spec);

// Checks that two layouts can exchange KV at all (same hash, same total heads).
Status check_compatible(const KvRank& src, const KvRank& dst);

// Blocks needed to hold `tokens` tokens with `block_size` tokens per block.
inline uint32_t blocks_for_tokens(uint32_t tokens, uint32_t block_size) {
    return (tokens + block_size - 1) / block_size;
}

}  // namespace ferry::kv
