// Device copies for the CUDA IPC transport, three forms in one launch each:
// - batched runs: many (src, dst, len) pieces listed by the host, for irregular runs;
// - paged copies: pages of one size at index * stride on both sides, where the host uploads
//   only the page ids (8 bytes a page) and the kernel computes the addresses. Listing every
//   page as a 24-byte chunk on the host was what held random 4 KiB pages at 0.10x of the copy
//   ceiling (2026-12-01);
// - block copies: a KV transfer's block ids of both sides and both sides' strides, the kernel
//   computing every (plane, chunk, row) address (block_copy_geom.h).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "fabric/block_copy_geom.h"

namespace ferry::detail {

struct CopyChunk {
    const void* src;
    void* dst;
    uint64_t len;
};

// One paged copy inside a launch: page k goes from src + src_pages[k] * src_stride to
// dst + dst_pages[k] * dst_stride (null id lists: page k is k, as for one long run). A page is
// cut into pieces of at most kPagePiece bytes, one warp each; first_item numbers the segment's
// first piece across the launch. The tiled kernel takes the same entries with tiles for pieces
// (launch_tiled_copy).
struct PagedSegment {
    const char* src;
    char* dst;
    const uint32_t* src_pages;  // device memory, num_pages entries each, or null
    const uint32_t* dst_pages;
    uint64_t page_size;
    uint64_t src_stride;
    uint64_t dst_stride;
    uint64_t first_item;
    uint32_t pieces_per_page;
    uint32_t num_pages;
};

// One block copy inside a launch; first_item numbers its first item across the launch. Its
// block ids and plane addresses are in the launch's list, at these byte offsets from the
// list's start: the list is the same whether it was uploaded or passed as the kernel's
// parameter (CopyList).
struct BlockCopySegment {
    BlockCopyGeom g;
    uint64_t src_blocks_at;  // uint32_t ids
    uint64_t dst_blocks_at;
    uint64_t src_planes_at;  // uint64_t addresses
    uint64_t dst_planes_at;
    uint64_t first_item;
};

// Where a launch's list is: uploaded to `device`, or, when it is at most inline_list_limit()
// bytes, at `host`, from where the launchers pass it by value as the kernels' parameter (no
// upload before the kernels: copying a short list to the device took 4-6 us of each launch,
// 2026-12-02; a 16k-token KV push's ~10 KB list, 4.5 us). Each launcher reads its section at an
// offset from the list's start. The parameter comes in tiers, the smallest that holds the
// list, so a short list does not pay for copying 32 KB of parameter at every launch.
// A one-run write or one paged copy has a list of 64 bytes; 448 holds a few segments.
constexpr size_t kInlineListSmall = 448;
constexpr size_t kInlineList = 3840;  // within the 4 KiB of parameters every CUDA allows
// CUDA 12.1+ on Volta and later: up to 32764 bytes of parameters, less the launchers' other
// parameters (24 bytes) and the list's 16-byte alignment.
constexpr size_t kInlineListMid = 16 * 1024 - 64;
constexpr size_t kInlineListLarge = 32 * 1024 - 64;
// kInlineListLarge where both the toolkit this was built with and the driver are CUDA 12.1 or
// later, else kInlineList.
size_t inline_list_limit();
struct CopyList {
    const char* device = nullptr;
    const char* host = nullptr;
    size_t bytes = 0;
};

// One warp copies one chunk, so a copy must be cut into many chunks for the whole GPU to
// work on it: a 4 MiB KV run cut at 256 KiB kept 16 warps busy and moved 35 GB/s over NVLink
// (2026-11-30). 16 KiB gives a 4 MiB run 256 warps, and 256 MiB 16k chunks.
constexpr uint64_t kMaxChunk = 16 * 1024;  // the smallest chunk; large launches use more
constexpr uint64_t kPagePiece = 16 * 1024;
constexpr int kCopyWarpsPerBlock = 16;
constexpr int kCopyBlocksPerSm = 2;
// Launches ask for this many times the blocks that fit at once (chunks are still planned for
// what fits): the block scheduler then hands out work as blocks finish instead of each
// resident warp walking a fixed share. One H200, 2026-12-02, `ferry bench gpu`, two rounds
// each, alternating in one session: 256 MiB write 0.82-0.85x -> 0.86x of the ceiling, random
// 4 / 16 / 64 KiB pages 0.42-0.47 / 0.67-0.70 / 0.76-0.77x -> 0.51-0.53 / 0.71-0.72 / 0.79x.
constexpr int kCopyGridFactor = 4;

// Pages (and runs) of at least kTilePage bytes are copied in tiles, one block each
// (tiled_copy_kernel): kTileThreadsLarge threads (128 KiB tiles) when every such page of the
// launch is at least that long, else kTileThreadsSmall (64 KiB). 256 MiB as one page, these
// kernels timed by CUDA events against cudaMemcpyAsync (one H200, 2026-12-03): the paged
// kernel (one warp per 16 KiB piece) 0.92-0.94x, tiles of 64 KiB 0.95-0.96x, of 128 KiB
// 0.98x. Shorter pages stay one warp a piece: a tile would leave threads idle.
constexpr int kTileBytesPerThread = 128;
constexpr int kTileThreadsLarge = 1024;
constexpr int kTileThreadsSmall = 512;
constexpr uint64_t kTilePage = uint64_t{kTileThreadsSmall} * kTileBytesPerThread;
constexpr uint64_t kTileLarge = uint64_t{kTileThreadsLarge} * kTileBytesPerThread;
constexpr uint64_t kMaxTileGrid = 1u << 20;

// Each launcher reads its section at `offset` in `list` (list.at, when set, else list.bytes).
cudaError_t launch_batched_copy(const CopyList& list, size_t offset, int num_chunks, int num_blocks,
                                cudaStream_t stream);

// num_segments entries whose pieces add up to total_items.
cudaError_t launch_paged_copy(const CopyList& list, size_t offset, int num_segments,
                              uint64_t total_items, int num_blocks, cudaStream_t stream);

// num_segments paged entries whose tiles (pieces_per_page counting tiles of threads x
// kTileBytesPerThread bytes) add up to total_tiles; threads is kTileThreadsLarge or
// kTileThreadsSmall.
cudaError_t launch_tiled_copy(const CopyList& list, size_t offset, int num_segments,
                              uint64_t total_tiles, int threads, cudaStream_t stream);

// num_segments entries whose items add up to total_items.
cudaError_t launch_block_copy(const CopyList& list, size_t offset, int num_segments,
                              uint64_t total_items, int num_blocks, cudaStream_t stream);

}  // namespace ferry::detail
