// The engine's way to same-host GPU memory: the GPU transport (CUDA IPC over NVLink), created
// on first use, and the count of copies in flight that keeps the rail workers polling.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "fabric/gpu_transport.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/types.h"

namespace ferry::detail {

class GpuCopyPath {
  public:
    explicit GpuCopyPath(const EngineConfig& config) : config_(config) {}

    // The transport, created on first use; fails with a clear message without CUDA or a GPU.
    Result<GpuTransport*> transport();
    // Fills d's IPC fields for device memory [ptr, ptr + len) on d->device.
    Status export_memory(void* ptr, size_t len, MemoryDescriptor* d);
    // The address of a same-host peer's GPU region as seen from local_device.
    Result<uint64_t> map_peer(const MemoryDescriptor& remote, int local_device);
    // Runs the copies on `device`; done runs on the transport's thread once they completed.
    // The caller keeps this object alive until then (done holds the engine).
    void submit(GpuTransport* t, int device, GpuWork work, std::function<void(const Status&)> done);
    // Copies in flight: the rail workers must not nap (their signals follow).
    bool busy() const { return in_flight_.load(std::memory_order_relaxed) > 0; }
    // Fails pending copies and frees the transport; their callbacks may still signal through
    // the rails, so this runs before the rails stop.
    void shutdown();

  private:
    const EngineConfig& config_;
    std::mutex mu_;
    std::unique_ptr<GpuTransport> transport_;
    std::atomic<uint32_t> in_flight_{0};  // GPU operations not completed yet
};

}  // namespace ferry::detail
