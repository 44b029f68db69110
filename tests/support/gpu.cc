#include "support/gpu.h"

#ifdef FERRY_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace ferry::testing {

int gpu_count() {
#ifdef FERRY_HAVE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
#else
    return 0;
#endif
}

std::string no_gpu_reason() {
#ifdef FERRY_HAVE_CUDA
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) return std::string("no usable GPU: ") + cudaGetErrorString(e);
    return "no GPU visible";
#else
    return "built without CUDA";
#endif
}

}  // namespace ferry::testing
