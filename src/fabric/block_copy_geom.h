// Where every piece of a block copy (BlockCopyOp) goes: pure address arithmetic, shared by the
// copy kernel, which computes each address on the device from the block ids, and the host, whose
// tests run the same functions against the KV planner's runs. No CUDA headers here.
//
// The tokens of the copy are cut into chunks of gcd(src block size, dst block size) tokens at
// multiples of that size: no chunk crosses a block boundary on either side, so inside a chunk
// both sides are strided (token, head) grids. What is contiguous on both sides becomes a row
// (the whole chunk, one token's heads, one head's tokens, or one head of one token), and an
// item, one warp's work, is a group of short rows or a piece of a long one.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define FERRY_HD __host__ __device__ __forceinline__
#else
#define FERRY_HD inline
#endif

namespace ferry::detail {

// Longest stretch one item copies, and the most bytes of short rows it takes: 16 KiB kept
// every warp busy for 4 MiB runs and loses nothing at 256 MiB (the paged kernel's piece).
constexpr uint64_t kBlockCopyPiece = 16 * 1024;

// What is contiguous on both sides of a chunk.
enum BlockRows : uint32_t {
    kRowsWhole = 0,     // every token and head of the chunk (NHD both sides, all heads)
    kRowsPerToken = 1,  // one token's heads (NHD both sides, a head range)
    kRowsPerHead = 2,   // one head's tokens (HND both sides)
    kRowsPerElem = 3,   // one head of one token (the orders differ)
};

struct BlockSideGeom {
    uint64_t block_stride = 0;
    uint64_t token_stride = 0;
    uint64_t head_stride = 0;
    uint32_t block_size = 0;
};

struct BlockCopyGeom {
    BlockSideGeom src, dst;
    uint64_t head_bytes = 0;
    uint64_t chunks = 0;           // per plane
    uint64_t items_per_chunk = 0;  // row groups x pieces per row
    uint64_t items = 0;            // planes x chunks x items_per_chunk
    uint32_t planes = 0;
    uint32_t heads = 0;
    uint32_t first_token = 0;
    uint32_t end_token = 0;
    uint32_t chunk_tokens = 0;
    uint32_t first_chunk = 0;
    uint32_t rows = kRowsWhole;  // BlockRows
    uint32_t rows_per_item = 1;
    uint32_t pieces_per_row = 1;

    FERRY_HD uint64_t bytes() const {
        return uint64_t{planes} * (end_token - first_token) * heads * head_bytes;
    }
};

// One item: rows [row_begin, row_end) of a chunk, `len` bytes of each starting at src / dst
// (row 0's address, the item's piece offset included).
struct BlockCopyItem {
    uint64_t src = 0;
    uint64_t dst = 0;
    uint64_t len = 0;
    uint32_t tokens = 0;  // in the chunk
    uint32_t row_begin = 0;
    uint32_t row_end = 0;
};

// Rows and row length of a chunk of `tokens` tokens.
FERRY_HD void block_chunk_rows(const BlockCopyGeom& g, uint32_t tokens, uint32_t* rows,
                               uint64_t* row_len) {
    switch (g.rows) {
        case kRowsWhole:
            *rows = 1;
            *row_len = uint64_t{tokens} * g.heads * g.head_bytes;
            return;
        case kRowsPerToken:
            *rows = tokens;
            *row_len = uint64_t{g.heads} * g.head_bytes;
            return;
        case kRowsPerHead:
            *rows = g.heads;
            *row_len = uint64_t{tokens} * g.head_bytes;
            return;
        default:
            *rows = tokens * g.heads;
            *row_len = g.head_bytes;
            return;
    }
}

// Item `item` of the copy; false when it is empty (a short chunk at either end of the token
// range has fewer or shorter rows than a full one). src_planes / dst_planes hold the address
// of each plane's block 0 with the side's first head applied.
FERRY_HD bool block_copy_item(const BlockCopyGeom& g, const uint32_t* src_blocks,
                              const uint32_t* dst_blocks, const uint64_t* src_planes,
                              const uint64_t* dst_planes, uint64_t item, BlockCopyItem* out) {
    // 32-bit division (a copy has fewer than 2^32 items, make_block_copy_geom checks): 64-bit
    // division is a long instruction sequence on the GPU, paid per item.
    const uint32_t i = static_cast<uint32_t>(item);
    const uint32_t ipc = static_cast<uint32_t>(g.items_per_chunk);
    const uint32_t per_plane = static_cast<uint32_t>(g.chunks) * ipc;
    const uint32_t plane = i / per_plane;
    const uint32_t rest = i - plane * per_plane;
    const uint32_t chunk = rest / ipc;
    const uint32_t j = rest - chunk * ipc;
    const uint32_t group = j / g.pieces_per_row;
    const uint32_t piece = j - group * g.pieces_per_row;
    const uint32_t c = g.first_chunk + chunk;
    const uint32_t lo = c * g.chunk_tokens;
    const uint32_t a = lo > g.first_token ? lo : g.first_token;
    const uint32_t hi = lo + g.chunk_tokens;
    const uint32_t b = hi < g.end_token ? hi : g.end_token;
    uint32_t rows = 0;
    uint64_t row_len = 0;
    block_chunk_rows(g, b - a, &rows, &row_len);
    const uint32_t first_row = group * g.rows_per_item;
    const uint64_t off = uint64_t{piece} * kBlockCopyPiece;
    if (first_row >= rows || off >= row_len) return false;
    out->tokens = b - a;
    out->row_begin = first_row;
    out->row_end = rows - first_row < g.rows_per_item ? rows : first_row + g.rows_per_item;
    out->len = row_len - off < kBlockCopyPiece ? row_len - off : kBlockCopyPiece;
    const BlockSideGeom& s = g.src;
    const BlockSideGeom& d = g.dst;
    out->src = src_planes[plane] + uint64_t{src_blocks[a / s.block_size]} * s.block_stride +
               uint64_t{a % s.block_size} * s.token_stride + off;
    out->dst = dst_planes[plane] + uint64_t{dst_blocks[a / d.block_size]} * d.block_stride +
               uint64_t{a % d.block_size} * d.token_stride + off;
    return true;
}

// Offsets of row r of an item from its src / dst.
FERRY_HD void block_copy_row(const BlockCopyGeom& g, uint32_t r, uint64_t* src, uint64_t* dst) {
    switch (g.rows) {
        case kRowsWhole:
            *src = 0;
            *dst = 0;
            return;
        case kRowsPerToken:
            *src = uint64_t{r} * g.src.token_stride;
            *dst = uint64_t{r} * g.dst.token_stride;
            return;
        case kRowsPerHead:
            *src = uint64_t{r} * g.src.head_stride;
            *dst = uint64_t{r} * g.dst.head_stride;
            return;
        default: {
            const uint32_t t = r / g.heads;
            const uint32_t h = r - t * g.heads;
            *src = uint64_t{t} * g.src.token_stride + uint64_t{h} * g.src.head_stride;
            *dst = uint64_t{t} * g.dst.token_stride + uint64_t{h} * g.dst.head_stride;
            return;
        }
    }
}

}  // namespace ferry::detail
