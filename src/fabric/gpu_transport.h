// Same-host GPU transfers (CUDA IPC over NVLink), behind an interface free of CUDA headers so
// the engine compiles the same with or without CUDA. Created on first use of GPU memory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

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
    virtual void submit(int device, std::vector<GpuCopy> copies,
                        std::function<void(const Status&)> done) = 0;
};

// Fails with a clear message when ferry was built without CUDA or no GPU is visible.
Result<std::unique_ptr<GpuTransport>> create_gpu_transport(const EngineConfig& config);

}  // namespace ferry::detail
