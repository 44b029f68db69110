// Fallback for builds without CUDA; the real transport is in cuda/cuda_transport.cc.
#include "fabric/gpu_transport.h"

#ifndef FERRY_HAVE_CUDA
namespace ferry::detail {
void* staging_alloc(size_t bytes) { return ::operator new(bytes); }
void staging_free(void* p, size_t) noexcept { ::operator delete(p); }
Result<std::unique_ptr<GpuTransport>> create_gpu_transport(const EngineConfig&) {
    return unavailable(
        "this build of ferry has no CUDA support (nvcc was not found at build "
        "time); GPU memory cannot be registered");
}
}  // namespace ferry::detail
#endif
