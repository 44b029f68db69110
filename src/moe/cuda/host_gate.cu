// The start gate of the MoE benchmarks (cuda_host_gate in cuda_all_to_all.h): in the library
// because both `ferry bench moe` and `python3 -m ferry.bench_moe` need it, and the Python
// extension sees only the library. It waits on the same global timer as the MoE kernels'
// timeouts.
#include "moe/cuda/device_common.cuh"
#include "moe/cuda/kernels.h"

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
