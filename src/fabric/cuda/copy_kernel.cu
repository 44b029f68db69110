#include "fabric/cuda/copy_kernel.h"

namespace ferry::detail {
namespace {

constexpr int kWarpsPerBlock = kCopyWarpsPerBlock;

// One warp per chunk, chunks taken grid-stride. 16-byte vectors when both ends are aligned,
// unrolled 8x so each lane keeps eight loads in flight (a 4 KiB page is one round of loads;
// NVLink latency is ~1 us), and the next chunk's descriptor is fetched before this one's
// copy starts.
__global__ void batched_copy_kernel(const CopyChunk* __restrict__ chunks, int n) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * kWarpsPerBlock) + (threadIdx.x >> 5);
    const int num_warps = gridDim.x * kWarpsPerBlock;
    CopyChunk next = warp < n ? chunks[warp] : CopyChunk{};
    for (int c = warp; c < n; c += num_warps) {
        const CopyChunk ch = next;
        if (c + num_warps < n) next = chunks[c + num_warps];
        const char* src = static_cast<const char*>(ch.src);
        char* dst = static_cast<char*>(ch.dst);
        uint64_t len = ch.len;
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
}

}  // namespace

cudaError_t launch_batched_copy(const CopyChunk* chunks, int num_chunks, int num_blocks,
                                cudaStream_t stream) {
    if (num_chunks <= 0) return cudaSuccess;
    int blocks = num_blocks;
    int needed = (num_chunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (blocks > needed) blocks = needed;
    batched_copy_kernel<<<blocks, kWarpsPerBlock * 32, 0, stream>>>(chunks, num_chunks);
    return cudaGetLastError();
}

}  // namespace ferry::detail
