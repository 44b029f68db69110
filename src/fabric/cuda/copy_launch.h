// Turns the work of one launch (irregular runs and paged copies of several jobs) into the lists
// the copy kernels read, uploads them and launches the kernels on one stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "fabric/gpu_transport.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"

namespace ferry::detail {

// The lists are built in pinned host memory and uploaded to a device buffer before the kernels
// run: read straight from mapped host memory, each warp paid a PCIe round trip per chunk
// (random 4 KiB pages ran at 0.27x of the NVLink ceiling, 2026-11-30).
struct PinnedBuffer {
    char* ptr = nullptr;
    char* dev = nullptr;  // device copy, on the device the buffer was taken for
    int device = -1;
    size_t capacity = 0;  // bytes
};

// Buffers reused across launches; owned by the transport's worker thread.
class PinnedBufferPool {
  public:
    PinnedBufferPool() = default;
    PinnedBufferPool(const PinnedBufferPool&) = delete;
    PinnedBufferPool& operator=(const PinnedBufferPool&) = delete;
    ~PinnedBufferPool();
    // A buffer of at least `bytes` on `device`; ptr is null when allocation failed.
    PinnedBuffer take(size_t bytes, int device);
    void give(PinnedBuffer b);
    static void free(PinnedBuffer& b);

  private:
    std::vector<PinnedBuffer> free_;
};

// When the steps of a launch ended (FERRY_GPU_TRACE): the lists built on the host, their
// uploads queued, the kernels queued.
struct LaunchStamps {
    TimePoint list_built, uploaded, launched;
};

// Launches `works` (on `device`, current, with `sms` SMs) as at most one batched-copy kernel
// (for their runs, unless !with_runs: the caller copied those) and one paged-copy kernel; *buf
// holds their lists until the stream passed the kernels, and the works their staged ids until
// the stream passed the uploads.
Status launch_copy_work(const std::vector<const GpuWork*>& works, uint64_t bytes, int device,
                        int sms, bool with_runs, cudaStream_t stream, PinnedBufferPool& pool,
                        PinnedBuffer* buf, LaunchStamps* stamps = nullptr);

}  // namespace ferry::detail
