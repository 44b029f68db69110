#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "fabric/cuda/copy_kernel.h"

namespace ferry::detail {
namespace {

constexpr int kWarpsPerBlock = kCopyWarpsPerBlock;
constexpr int kThreads = kWarpsPerBlock * 32;

// A warp copies [src, src + len). 16-byte vectors when both ends are aligned, unrolled 8x so
// each lane keeps eight loads in flight (a 4 KiB page is one round of loads; NVLink latency is
// ~1 us). With the page ids already on the device this loop, 512 threads x 2 blocks per SM,
// copied 256 MiB as one run or as random 4/16/64 KiB pages at 1824-1846 GB/s against
// 2030 GB/s for cudaMemcpyAsync (0.90-0.91x, one H200, 2026-12-02); streaming stores
// (st.global.cs), 4 KiB pieces, 4x unrolling over 256x8 threads and 16x over 256x4 were no
// faster (1520-1869 GB/s), so what the engine loses beyond that is on the host.
__device__ __forceinline__ void warp_copy(const char* src, char* dst, uint64_t len, int lane) {
    uint64_t done = 0;
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
        const int4* s4 = reinterpret_cast<const int4*>(src);
        int4* d4 = reinterpret_cast<int4*>(dst);
        uint64_t n4 = len / 16;
        uint64_t i = lane;
        for (; i + 224 < n4; i += 256) {
            int4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) v[u] = s4[i + 32 * u];
#pragma unroll
            for (int u = 0; u < 8; ++u) d4[i + 32 * u] = v[u];
        }
        for (; i + 96 < n4; i += 128) {
            int4 a = s4[i], b = s4[i + 32], x = s4[i + 64], y = s4[i + 96];
            d4[i] = a;
            d4[i + 32] = b;
            d4[i + 64] = x;
            d4[i + 96] = y;
        }
        for (; i < n4; i += 32) d4[i] = s4[i];
        done = n4 * 16;
    }
    for (uint64_t i = done + lane; i < len; i += 32) dst[i] = src[i];
}

// (local / per, local % per) for a page's pieces; 32-bit when local fits, as it does for any
// launch of fewer than 2^32 pieces: 64-bit division is a long instruction sequence, and in
// the tiled kernel, whose threads each copy only 128 bytes a tile, it cost ~1% of the copy
// (one H200, 2026-12-03: 0.964-0.974x -> 0.978-0.982x of cudaMemcpyAsync).
struct PagePiece {
    uint64_t page, piece;
};
__device__ __forceinline__ PagePiece split_piece(uint64_t local, uint32_t per) {
    if (local <= 0xffffffffu) {
        const uint32_t l = static_cast<uint32_t>(local);
        const uint32_t page = l / per;
        return {page, l - page * per};
    }
    const uint64_t page = local / per;
    return {page, local - page * per};
}

// A launch's list as the kernels get it: a pointer to the uploaded list, or the list itself as
// the kernel's parameter. Passed as __grid_constant__, so base() of the inline form is the
// parameter's own address (no per-thread copy).
struct UploadedList {
    const char* at;
    __device__ const char* base() const { return at; }
};
template <size_t N>
struct InlineList {
    alignas(16) char bytes[N];
    __device__ const char* base() const { return bytes; }
};

// One warp per chunk, chunks taken grid-stride; the next chunk's descriptor is fetched before
// this one's copy starts. The bounds keep two blocks of 16 warps resident per SM (64
// registers a thread), the occupancy the chunk sizes are planned for.
template <typename List>
__global__ void __launch_bounds__(kThreads, kCopyBlocksPerSm)
    batched_copy_kernel(const __grid_constant__ List list, size_t offset, int n) {
    const CopyChunk* __restrict__ chunks = reinterpret_cast<const CopyChunk*>(list.base() + offset);
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * kWarpsPerBlock) + (threadIdx.x >> 5);
    const int num_warps = gridDim.x * kWarpsPerBlock;
    CopyChunk next = warp < n ? chunks[warp] : CopyChunk{};
    for (int c = warp; c < n; c += num_warps) {
        const CopyChunk ch = next;
        if (c + num_warps < n) next = chunks[c + num_warps];
        warp_copy(static_cast<const char*>(ch.src), static_cast<char*>(ch.dst), ch.len, lane);
    }
}

// Items [0, total) of a launch, one warp each, taken grid-stride across every segment; body
// gets the item's segment, its index in the segment and the lane. A warp's items only grow, so
// it finds its segment by walking forward from the last one.
template <typename Segment, typename Body>
__device__ __forceinline__ void for_each_item(const Segment* __restrict__ segs, int num_segs,
                                              uint64_t total, Body body) {
    const int lane = threadIdx.x & 31;
    const uint64_t warp = (uint64_t{blockIdx.x} * kWarpsPerBlock) + (threadIdx.x >> 5);
    const uint64_t num_warps = uint64_t{gridDim.x} * kWarpsPerBlock;
    int s = 0;
    for (uint64_t item = warp; item < total; item += num_warps) {
        while (s + 1 < num_segs && segs[s + 1].first_item <= item) ++s;
        body(segs[s], item - segs[s].first_item, lane);
    }
}

// One warp per piece of a page. Loading the next item's page ids before copying this piece
// measured no better (random 16/64 KiB pages 0.58/0.69x against 0.65/0.75x without, one H200,
// 2026-12-02).
template <typename List>
__global__ void __launch_bounds__(kThreads, kCopyBlocksPerSm)
    paged_copy_kernel(const __grid_constant__ List list, size_t offset, int num_segs,
                      uint64_t total) {
    const auto* segs = reinterpret_cast<const PagedSegment*>(list.base() + offset);
    for_each_item(segs, num_segs, total, [](const PagedSegment& g, uint64_t local, int lane) {
        const uint64_t page = local / g.pieces_per_page;
        const uint64_t off = (local - page * g.pieces_per_page) * kPagePiece;
        const uint64_t len = g.page_size - off < kPagePiece ? g.page_size - off : kPagePiece;
        const uint64_t sp = g.src_pages ? g.src_pages[page] : page;
        const uint64_t dp = g.dst_pages ? g.dst_pages[page] : page;
        warp_copy(g.src + sp * g.src_stride + off, g.dst + dp * g.dst_stride + off, len, lane);
    });
}

// Tiles: a block of T threads copies one tile of T x 128 bytes of a large page at a time, every
// thread eight 16-byte loads T x 16 bytes apart, then their stores, with the L2 told to evict
// these lines first (the copy reads and writes each byte once). Against the warp form above on
// the same 256 MiB (one H200, 2026-12-03, CUDA events, median of 20): warp per 16 KiB piece
// 0.947-0.953x of cudaMemcpyAsync; tiles of 64 KiB (512 threads) 0.966-0.973x, with the evict
// hint 0.971-0.976x; tiles of 128 KiB (1024 threads) 0.981-0.986x, with the hint 0.990x.
// Non-coherent loads and streaming stores were slower in both forms.
__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    return pol;
}
__device__ __forceinline__ int4 load_evict_first(const int4* p, uint64_t pol) {
    int4 v;
    asm volatile("ld.global.L2::cache_hint.v4.s32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(pol));
    return v;
}
__device__ __forceinline__ void store_evict_first(int4* p, int4 v, uint64_t pol) {
    asm volatile("st.global.L2::cache_hint.v4.s32 [%0], {%1,%2,%3,%4}, %5;" ::"l"(p), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w), "l"(pol)
                 : "memory");
}

template <int T>
__device__ __forceinline__ void block_copy_tile(const char* src, char* dst, uint64_t len,
                                                uint64_t pol) {
    constexpr uint64_t kTile = uint64_t{T} * kTileBytesPerThread;
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) != 0) {
        for (uint64_t i = threadIdx.x; i < len; i += T) dst[i] = src[i];
        return;
    }
    const int4* s4 = reinterpret_cast<const int4*>(src);
    int4* d4 = reinterpret_cast<int4*>(dst);
    if (len == kTile) {
        int4 v[kTileBytesPerThread / 16];
#pragma unroll
        for (int u = 0; u < kTileBytesPerThread / 16; ++u)
            v[u] = load_evict_first(s4 + threadIdx.x + T * u, pol);
#pragma unroll
        for (int u = 0; u < kTileBytesPerThread / 16; ++u)
            store_evict_first(d4 + threadIdx.x + T * u, v[u], pol);
        return;
    }
    const uint64_t n4 = len / 16;
    for (uint64_t i = threadIdx.x; i < n4; i += T)
        store_evict_first(d4 + i, load_evict_first(s4 + i, pol), pol);
    for (uint64_t i = n4 * 16 + threadIdx.x; i < len; i += T) dst[i] = src[i];
}

// One block per tile, tiles taken grid-stride across every segment (a segment's
// pieces_per_page counts tiles here); the grid asks for every tile, so the block scheduler
// hands tiles out as blocks finish.
template <typename List, int T>
__global__ void __launch_bounds__(T, 1024 / T)
    tiled_copy_kernel(const __grid_constant__ List list, size_t offset, int num_segs,
                      uint64_t total) {
    constexpr uint64_t kTile = uint64_t{T} * kTileBytesPerThread;
    const auto* segs = reinterpret_cast<const PagedSegment*>(list.base() + offset);
    const uint64_t pol = evict_first_policy();
    for (uint64_t tile = blockIdx.x; tile < total; tile += gridDim.x) {
        // Most blocks copy one tile: the segment by binary search, not a walk from the first.
        int lo = 0, hi = num_segs - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (segs[mid].first_item <= tile) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        const PagedSegment& g = segs[lo];
        const uint64_t local = tile - g.first_item;
        const PagePiece pp = split_piece(local, g.pieces_per_page);
        const uint64_t page = pp.page;
        const uint64_t off = pp.piece * kTile;
        const uint64_t len = g.page_size - off < kTile ? g.page_size - off : kTile;
        const uint64_t sp = g.src_pages ? g.src_pages[page] : page;
        const uint64_t dp = g.dst_pages ? g.dst_pages[page] : page;
        block_copy_tile<T>(g.src + sp * g.src_stride + off, g.dst + dp * g.dst_stride + off, len,
                           pol);
    }
}

// One warp per item of a block copy; the addresses come from block_copy_geom.h, the functions
// the host tests run against the KV planner.
template <typename List>
__global__ void __launch_bounds__(kThreads, kCopyBlocksPerSm)
    block_copy_kernel(const __grid_constant__ List list, size_t offset, int num_segs,
                      uint64_t total) {
    const char* base = list.base();
    const auto* segs = reinterpret_cast<const BlockCopySegment*>(base + offset);
    for_each_item(
        segs, num_segs, total, [base](const BlockCopySegment& seg, uint64_t local, int lane) {
            BlockCopyItem it;
            if (!block_copy_item(seg.g, reinterpret_cast<const uint32_t*>(base + seg.src_blocks_at),
                                 reinterpret_cast<const uint32_t*>(base + seg.dst_blocks_at),
                                 reinterpret_cast<const uint64_t*>(base + seg.src_planes_at),
                                 reinterpret_cast<const uint64_t*>(base + seg.dst_planes_at), local,
                                 &it)) {
                return;
            }
            for (uint32_t r = it.row_begin; r < it.row_end; ++r) {
                uint64_t so = 0, dof = 0;
                block_copy_row(seg.g, r, &so, &dof);
                warp_copy(reinterpret_cast<const char*>(it.src + so),
                          reinterpret_cast<char*>(it.dst + dof), it.len, lane);
            }
        });
}

// Blocks for a launch of `items` one-warp items, at most num_blocks.
int grid_for(uint64_t items, int num_blocks) {
    const uint64_t needed = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
    return needed < static_cast<uint64_t>(num_blocks) ? static_cast<int>(needed) : num_blocks;
}

template <size_t N, typename Launch>
cudaError_t launch_inline(const CopyList& list, int grid, cudaStream_t stream, Launch& launch) {
    InlineList<N> inline_list;
    memcpy(inline_list.bytes, list.host, list.bytes);
    return launch(inline_list, grid, stream);
}

// Launches kernel<UploadedList> or kernel<InlineList<tier>> on `list`, grid blocks of kThreads.
template <typename Launch>
cudaError_t launch_on(const CopyList& list, int grid, cudaStream_t stream, Launch launch) {
    if (list.device) return launch(UploadedList{list.device}, grid, stream);
    if (list.bytes > inline_list_limit()) return cudaErrorInvalidValue;
    if (list.bytes <= kInlineListSmall) {
        return launch_inline<kInlineListSmall>(list, grid, stream, launch);
    }
    if (list.bytes <= kInlineList) return launch_inline<kInlineList>(list, grid, stream, launch);
#if CUDART_VERSION >= 12010
    if (list.bytes <= kInlineListMid) {
        return launch_inline<kInlineListMid>(list, grid, stream, launch);
    }
    return launch_inline<kInlineListLarge>(list, grid, stream, launch);
#else
    return cudaErrorInvalidValue;
#endif
}

}  // namespace

size_t inline_list_limit() {
    static const size_t limit = [] {
#if CUDART_VERSION >= 12010
        int driver = 0;
        size_t l = cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12010
                       ? kInlineListLarge
                       : kInlineList;
#else
        size_t l = kInlineList;
#endif
        // FERRY_GPU_INLINE_LIST=<bytes>: a lower limit (0: every list uploaded), to time a
        // launch with its list as the parameter against one with the list uploaded.
        if (const char* e = std::getenv("FERRY_GPU_INLINE_LIST")) {
            char* end = nullptr;
            unsigned long long v = std::strtoull(e, &end, 10);
            if (end != e && *end == '\0' && v < l) l = static_cast<size_t>(v);
        }
        return l;
    }();
    return limit;
}

cudaError_t launch_block_copy(const CopyList& list, size_t offset, int num_segments,
                              uint64_t total_items, int num_blocks, cudaStream_t stream) {
    if (num_segments <= 0 || total_items == 0) return cudaSuccess;
    return launch_on(list, grid_for(total_items, num_blocks), stream,
                     [&](const auto& l, int grid, cudaStream_t st) {
                         block_copy_kernel<<<grid, kThreads, 0, st>>>(l, offset, num_segments,
                                                                      total_items);
                         return cudaGetLastError();
                     });
}

cudaError_t launch_tiled_copy(const CopyList& list, size_t offset, int num_segments,
                              uint64_t total_tiles, int threads, cudaStream_t stream) {
    if (num_segments <= 0 || total_tiles == 0) return cudaSuccess;
    const int grid = static_cast<int>(std::min<uint64_t>(total_tiles, kMaxTileGrid));
    return launch_on(list, grid, stream, [&](const auto& l, int g, cudaStream_t st) {
        using L = std::decay_t<decltype(l)>;
        if (threads == kTileThreadsLarge) {
            tiled_copy_kernel<L, kTileThreadsLarge>
                <<<g, kTileThreadsLarge, 0, st>>>(l, offset, num_segments, total_tiles);
        } else if (threads == kTileThreadsSmall) {
            tiled_copy_kernel<L, kTileThreadsSmall>
                <<<g, kTileThreadsSmall, 0, st>>>(l, offset, num_segments, total_tiles);
        } else {
            return cudaErrorInvalidValue;
        }
        return cudaGetLastError();
    });
}

cudaError_t launch_batched_copy(const CopyList& list, size_t offset, int num_chunks, int num_blocks,
                                cudaStream_t stream) {
    if (num_chunks <= 0) return cudaSuccess;
    return launch_on(list, grid_for(num_chunks, num_blocks), stream,
                     [&](const auto& l, int grid, cudaStream_t st) {
                         batched_copy_kernel<<<grid, kThreads, 0, st>>>(l, offset, num_chunks);
                         return cudaGetLastError();
                     });
}

cudaError_t launch_paged_copy(const CopyList& list, size_t offset, int num_segments,
                              uint64_t total_items, int num_blocks, cudaStream_t stream) {
    if (num_segments <= 0 || total_items == 0) return cudaSuccess;
    return launch_on(list, grid_for(total_items, num_blocks), stream,
                     [&](const auto& l, int grid, cudaStream_t st) {
                         paged_copy_kernel<<<grid, kThreads, 0, st>>>(l, offset, num_segments,
                                                                      total_items);
                         return cudaGetLastError();
                     });
}

}  // namespace ferry::detail
