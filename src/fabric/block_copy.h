// Host side of a block copy (BlockCopyOp): checks its shape and turns it into the geometry the
// copy kernel reads (block_copy_geom.h).
#pragma once

#include <cstdint>

#include "fabric/block_copy_geom.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

// The geometry of op's copy. Errors name what does not fit: no heads, an empty or reversed
// token range, a side with too few block ids, planes that do not pair up, a zero stride.
Result<BlockCopyGeom> make_block_copy_geom(const BlockCopyOp& op);

// Block ids of `side` that tokens [0, end_token) use: blocks[0, n).
inline uint32_t block_copy_ids(const BlockCopySide& side, uint32_t end_token) {
    return (end_token + side.block_size - 1) / side.block_size;
}

// Bytes from a plane's start that the copy may touch on `side`, up to and including block
// `max_block`: every slot of the block, the side's heads [first_head, first_head + heads).
uint64_t block_copy_reach(const BlockCopySide& side, uint32_t heads, uint64_t head_bytes,
                          uint32_t max_block);

}  // namespace ferry::detail
