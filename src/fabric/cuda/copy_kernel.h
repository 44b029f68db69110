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

// Splits nothing: chunks must already be small enough to balance (see kMaxChunk).
constexpr uint64_t kMaxChunk = 256 * 1024;

// `chunks` must be readable by the device (mapped pinned host memory or device memory).
cudaError_t launch_batched_copy(const CopyChunk* chunks, int num_chunks, int num_blocks,
                                cudaStream_t stream);

}  // namespace ferry::detail
