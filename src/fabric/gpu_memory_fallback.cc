// Builds without CUDA: every GPU memory call says so.
#include "ferry/fabric/gpu_memory.h"

#ifndef FERRY_HAVE_CUDA
namespace ferry {
namespace {
Status no_cuda() { return unavailable("this build of ferry has no CUDA support"); }
}  // namespace
int gpu_device_count() { return 0; }
Result<std::string> gpu_pci_bus_id(int) { return no_cuda(); }
Result<GpuBuffer> GpuBuffer::allocate(size_t, int) { return no_cuda(); }
GpuBuffer& GpuBuffer::operator=(GpuBuffer&&) noexcept { return *this; }
GpuBuffer::~GpuBuffer() = default;
Status GpuBuffer::copy_from_host(const void*, size_t, size_t) { return no_cuda(); }
Status GpuBuffer::copy_to_host(void*, size_t, size_t) const { return no_cuda(); }
Status GpuBuffer::fill(uint8_t) { return no_cuda(); }
Result<double> measure_gpu_copy_ceiling(int, int, size_t, int) { return no_cuda(); }
}  // namespace ferry
#endif
