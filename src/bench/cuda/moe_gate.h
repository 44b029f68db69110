// The start gate of `ferry bench moe --backend cuda` (moe_gate.cu): benchmark-only, so it lives
// here rather than among the MoE kernels. Declared for plain C++ (cuda/moe.cc) and nvcc alike.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace ferry::moe::cuda {

// Holds `stream` until *flag >= want (mapped pinned host memory) or timeout_ns passed. A
// benchmark enqueues a whole layer behind it on every rank, then opens the gate, so events time
// the GPU's work rather than host launch gaps and skew between ranks.
cudaError_t launch_host_gate(const volatile uint32_t* flag, uint32_t want, uint64_t timeout_ns,
                             cudaStream_t stream);
// Loads the gate kernel into the current device's context before the first launch (see
// preload_dispatch_kernels in moe/cuda/kernels.h for why a lazy load can deadlock).
cudaError_t preload_host_gate();

}  // namespace ferry::moe::cuda
