// Host side of a block copy (BlockCopyOp): checks its shape and turns it into the geometry the
// copy kernel reads (block_copy_geom.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "fabric/block_copy_geom.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

// The geometry of op's copy. Errors name what does not fit: no heads, an empty or reversed
// token range, a side with too few block ids, planes that do not pair up, a zero stride.
Result<BlockCopyGeom> make_block_copy_geom(const BlockCopyOp& op);

// A stretch of a block copy where the blocks are consecutive on both sides: len bytes from
// src_off to dst_off, the same in every plane (offsets from the plane's address in the
// geometry, block 0 with the first head applied).
struct BlockCopyStretch {
    uint64_t src_off = 0;
    uint64_t dst_off = 0;
    uint64_t len = 0;
};

// The copy as stretches, where each side keeps a block's tokens and heads in one piece and its
// blocks packed (rows kRowsWhole, block_stride = block_size x token_stride), the block sizes
// match, and the stretches average at least min_avg bytes; else empty. A pool before traffic
// scatters its blocks gives one stretch per plane: copied as runs, they go to the GPU's tiled
// kernel instead of one 4 KiB item per block (block_ids from make_block_copy_geom's op, at
// least as many as the token range needs).
std::vector<BlockCopyStretch> block_copy_stretches(const BlockCopyGeom& g,
                                                   std::span<const uint32_t> src_blocks,
                                                   std::span<const uint32_t> dst_blocks,
                                                   uint64_t min_avg);

// Block ids of `side` that tokens [0, end_token) use: blocks[0, n).
inline uint32_t block_copy_ids(const BlockCopySide& side, uint32_t end_token) {
    return (end_token + side.block_size - 1) / side.block_size;
}

// Bytes from a plane's start that the copy may touch on `side`, up to and including block
// `max_block`: every slot of the block, the side's heads [first_head, first_head + heads).
uint64_t block_copy_reach(const BlockCopySide& side, uint32_t heads, uint64_t head_bytes,
                          uint32_t max_block);

}  // namespace ferry::detail
