// The gate kernel waits on the same global timer as the MoE kernels' timeouts (global_ns, from
// the kernels' internal device_common.cuh: see docs/ARCHITECTURE.md, "Benchmarks").
#include "bench/cuda/moe_gate.h"
#include "moe/cuda/device_common.cuh"

namespace ferry::moe::cuda {
namespace {

__global__ void host_gate_kernel(const volatile uint32_t* flag, uint32_t want,
                                 uint64_t timeout_ns) {
    const uint64_t start = global_ns();
    while (*flag < want && global_ns() - start < timeout_ns) {
    }
}

}  // namespace

cudaError_t launch_host_gate(const volatile uint32_t* flag, uint32_t want, uint64_t timeout_ns,
                             cudaStream_t stream) {
    host_gate_kernel<<<1, 1, 0, stream>>>(flag, want, timeout_ns);
    return cudaGetLastError();
}

cudaError_t preload_host_gate() {
    cudaFuncAttributes attr;
    return cudaFuncGetAttributes(&attr, host_gate_kernel);
}

}  // namespace ferry::moe::cuda
