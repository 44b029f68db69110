// Device memory for code that must not include CUDA headers (KV pools, benchmarks, tests).
// Every call fails with a clear message in builds without CUDA or on hosts without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ferry/common/status.h"

namespace ferry {

// Visible CUDA devices; 0 without CUDA or a GPU. Initialises CUDA in this process: a process
// that forks afterwards cannot use the GPU in its children.
int gpu_device_count();

// The PCI address of CUDA device `device` ("0000:53:00.0"), for matching it to the machine's
// PCIe tree (docs/ARCHITECTURE.md, "Rails and topology").
Result<std::string> gpu_pci_bus_id(int device);

class GpuBuffer {
  public:
    static Result<GpuBuffer> allocate(size_t bytes, int device);
    GpuBuffer() = default;
    GpuBuffer(GpuBuffer&& o) noexcept { *this = static_cast<GpuBuffer&&>(o); }
    GpuBuffer& operator=(GpuBuffer&& o) noexcept;
    GpuBuffer(const GpuBuffer&) = delete;
    GpuBuffer& operator=(const GpuBuffer&) = delete;
    ~GpuBuffer();

    void* data() const { return ptr_; }
    size_t size() const { return len_; }
    int device() const { return device_; }

    Status copy_from_host(const void* src, size_t n, size_t offset = 0);
    Status copy_to_host(void* dst, size_t n, size_t offset = 0) const;
    Status fill(uint8_t value);

  private:
    void* ptr_ = nullptr;
    size_t len_ = 0;
    int device_ = -1;
};

// GPU-to-GPU copy ceiling: median GB/s of cudaMemcpyPeerAsync of `bytes` between the devices.
Result<double> measure_gpu_copy_ceiling(int src_device, int dst_device, size_t bytes, int iters);

}  // namespace ferry
