// fp8 e4m3 block quantization, the format of numerics.h: one warp per 128-channel block,
// scale = max(amax, floor) / 448, values x * (448 / amax) rounded to nearest even and
// saturated at 448 -- the same operations in the same order as the CPU reference.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "moe/cuda/kernels.h"

namespace ferry::moe::cuda {
namespace {

constexpr uint32_t kWarpsPerBlock = 8;

__global__ void quantize_kernel(const uint16_t* x, uint64_t blocks, uint8_t* q, float* scales) {
    const uint64_t b = uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / 32;
    const uint32_t lane = threadIdx.x % 32;
    if (b >= blocks) return;
    float v[4];
    float amax = 0.0f;
    for (int i = 0; i < 4; ++i) {
        uint16_t raw = x[b * 128 + lane * 4 + i];
        v[i] = __bfloat162float(__ushort_as_bfloat16(raw));
        amax = fmaxf(amax, fabsf(v[i]));
    }
    for (int off = 16; off > 0; off /= 2)
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    amax = fmaxf(amax, kFp8Floor);
    const float inv = __fdiv_rn(kFp8Max, amax);
    for (int i = 0; i < 4; ++i)
        q[b * 128 + lane * 4 + i] = static_cast<uint8_t>(
            __nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3));
    if (lane == 0) scales[b] = __fdiv_rn(amax, kFp8Max);
}

__global__ void dequantize_kernel(const uint8_t* q, const float* scales, uint32_t tokens,
                                  const uint32_t* tokens_dev, uint32_t hidden, uint16_t* out) {
    const uint64_t n = uint64_t{tokens_dev ? min(*tokens_dev, tokens) : tokens} * hidden;
    for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
         i += uint64_t{gridDim.x} * blockDim.x) {
        __half_raw hr = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q[i]), __NV_E4M3);
        float f = __half2float(__half(hr));
        out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(f, scales[i / 128])));
    }
}

}  // namespace

cudaError_t launch_quantize_fp8(const uint16_t* x, uint32_t tokens, uint32_t hidden, uint8_t* q,
                                float* scales, cudaStream_t stream) {
    uint64_t blocks = uint64_t{tokens} * hidden / 128;
    if (blocks == 0) return cudaSuccess;
    uint64_t grid = (blocks + kWarpsPerBlock - 1) / kWarpsPerBlock;
    quantize_kernel<<<static_cast<unsigned>(grid), kWarpsPerBlock * 32, 0, stream>>>(x, blocks, q,
                                                                                     scales);
    return cudaGetLastError();
}

cudaError_t launch_dequantize_fp8(const uint8_t* q, const float* scales, uint32_t tokens,
                                  const uint32_t* tokens_dev, uint32_t hidden, uint16_t* out,
                                  cudaStream_t stream) {
    if (uint64_t{tokens} * hidden == 0) return cudaSuccess;
    dequantize_kernel<<<1024, 256, 0, stream>>>(q, scales, tokens, tokens_dev, hidden, out);
    return cudaGetLastError();
}

cudaError_t preload_quantize_kernels() {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, quantize_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dequantize_kernel);
    return e;
}

}  // namespace ferry::moe::cuda
