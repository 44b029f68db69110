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

__global__ void clock_probe_kernel(const volatile uint32_t* flag, unsigned long long* out,
                                   uint64_t timeout_ns) {
    const uint64_t start = global_ns();
    while (*flag == 0 && global_ns() - start < timeout_ns) {
    }
    *reinterpret_cast<volatile unsigned long long*>(out) = global_ns();
    __threadfence_system();
}

}  // namespace

cudaError_t launch_clock_probe(const volatile uint32_t* flag, unsigned long long* out,
                               uint64_t timeout_ns, cudaStream_t stream) {
    clock_probe_kernel<<<1, 1, 0, stream>>>(flag, out, timeout_ns);
    return cudaGetLastError();
}

cudaError_t launch_host_gate(const volatile uint32_t* flag, uint32_t want, uint64_t timeout_ns,
                             cudaStream_t stream) {
    host_gate_kernel<<<1, 1, 0, stream>>>(flag, want, timeout_ns);
    return cudaGetLastError();
}

cudaError_t preload_host_gate() {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, host_gate_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, clock_probe_kernel);
    return e;
}

}  // namespace ferry::moe::cuda
