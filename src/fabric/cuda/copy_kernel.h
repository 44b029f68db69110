// Batched device copy: many (src, dst, len) pieces in one launch. Over NVLink a kernel moves
// thousands of small KV blocks where one cudaMemcpy per block would pay ~2 us of copy-engine
// launch each.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ferry::detail {

struct CopyChunk {
    const void* src;
    void* dst;
    uint64_t len;
};

// One warp copies one chunk, so a copy must be cut into many chunks for the whole GPU to
// work on it: a 4 MiB KV run cut at 256 KiB kept 16 warps busy and moved 35 GB/s over NVLink
// (2026-11-30). 16 KiB gives a 4 MiB run 256 warps, and 256 MiB 16k chunks.
constexpr uint64_t kMaxChunk = 16 * 1024;  // the smallest chunk; large launches use more
constexpr int kCopyWarpsPerBlock = 16;
constexpr int kCopyBlocksPerSm = 2;

// `chunks` must be readable by the device (mapped pinned host memory or device memory).
cudaError_t launch_batched_copy(const CopyChunk* chunks, int num_chunks, int num_blocks,
                                cudaStream_t stream);

}  // namespace ferry::detail
