// Same-host GPU transfers (CUDA IPC over NVLink), behind an interface free of CUDA headers so
// the engine compiles the same with or without CUDA. Created on first use of GPU memory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "fabric/block_copy_geom.h"
#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

struct GpuCopy {
    uint64_t dst;  // device-visible addresses
    uint64_t src;
    uint64_t len;
};

// Pages of one size: page k goes from src + src_pages[k] * src_stride to
// dst + dst_pages[k] * dst_stride. The device computes the addresses from the ids, so a paged
// write costs the host 8 bytes a page instead of a copy descriptor per run.
struct GpuPagedCopy {
    uint64_t dst;  // device-visible addresses of page 0
    uint64_t src;
    uint64_t page_size;
    uint64_t src_stride;
    uint64_t dst_stride;
    std::vector<uint32_t> src_pages;
    std::vector<uint32_t> dst_pages;
};

// A block copy (BlockCopyOp): the kernel computes each piece's addresses from the geometry,
// the block ids and the planes' addresses (block 0, first head applied; device-visible).
struct GpuBlockCopy {
    BlockCopyGeom geom;
    std::vector<uint32_t> src_blocks;
    std::vector<uint32_t> dst_blocks;
    std::vector<uint64_t> src_planes;
    std::vector<uint64_t> dst_planes;
};

// What one operation hands the transport: irregular runs, paged copies, block copies.
struct GpuWork {
    std::vector<GpuCopy> copies;
    std::vector<GpuPagedCopy> paged;
    std::vector<GpuBlockCopy> blocks;
    uint64_t bytes() const;
};

class GpuTransport {
  public:
    virtual ~GpuTransport() = default;
    // Fills the descriptor's IPC fields for device memory [ptr, ptr+len) on `device`.
    virtual Status export_memory(void* ptr, size_t len, int device, MemoryDescriptor* d) = 0;
    // Maps a same-host peer's GPU region into this process (opened once, cached); returns the
    // address of its byte 0 as seen from `local_device`.
    virtual Result<uint64_t> map_remote(const MemoryDescriptor& d, int local_device) = 0;
    // Runs the copies on `device` (the source of a push, the destination of a pull) and calls
    // done once they all completed. Never blocks the caller.
    virtual void submit(int device, GpuWork work, std::function<void(const Status&)> done) = 0;
    // Jobs submitted and not completed yet.
    virtual size_t in_flight() const = 0;
};

// Fails with a clear message when ferry was built without CUDA or no GPU is visible.
Result<std::unique_ptr<GpuTransport>> create_gpu_transport(const EngineConfig& config);

}  // namespace ferry::detail
