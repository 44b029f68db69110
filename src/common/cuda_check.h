// One way to check a CUDA runtime call. Host code turns a failure into a Status naming the
// call, where it was made and CUDA's own words:
//   "cudaMalloc(&p, n) failed at src/bench/cuda/moe.cc:57: out of memory
//    (cudaErrorMemoryAllocation, 2)"
// Kernel files (.cu, compiled by nvcc without ferry's Status) pass the cudaError_t up to the
// host code that launched them, which checks it like any other call.
#pragma once

#include <cuda_runtime.h>

// Kernel-file form: returns the error from the enclosing cudaError_t function (a launch
// check is FERRY_CUDA_RETURN_IF_ERROR(cudaGetLastError())).
#define FERRY_CUDA_RETURN_IF_ERROR(expr)                          \
    do {                                                          \
        cudaError_t ferry_cuda_rc_ = (expr);                      \
        if (ferry_cuda_rc_ != cudaSuccess) return ferry_cuda_rc_; \
    } while (0)

#ifndef __CUDACC__
#include <fmt/format.h>

#include <string_view>

#include "ferry/common/status.h"

namespace ferry {

// ok when e is cudaSuccess; else kProviderError naming call and file:line.
inline Status cuda_status(cudaError_t e, std::string_view call, const char* file, int line) {
    if (e == cudaSuccess) return ok_status();
    return provider_error(fmt::format("{} failed at {}:{}: {} ({}, {})", call, file, line,
                                      cudaGetErrorString(e), cudaGetErrorName(e),
                                      static_cast<int>(e)));
}

}  // namespace ferry

// The call's Status, as an expression: FERRY_CUDA_CHECK(cudaSetDevice(d)).
#define FERRY_CUDA_CHECK(expr) ::ferry::cuda_status((expr), #expr, __FILE__, __LINE__)
// The Status of an error already returned, with what was being done: for results checked
// later (a stream query) or calls that need their own words.
#define FERRY_CUDA_ERROR(err, what) ::ferry::cuda_status((err), (what), __FILE__, __LINE__)
// Returns the Status from the enclosing function (returning Status or Result<T>) on failure.
#define FERRY_CUDA_TRY(expr) FERRY_RETURN_IF_ERROR(FERRY_CUDA_CHECK(expr))
#endif  // __CUDACC__
