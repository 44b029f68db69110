// fp8 e4m3 block quantization, the format of numerics.h: one warp per 128-channel block,
// scale = max(amax, floor) / 448, values x * (448 / amax) rounded to nearest even and
// saturated at 448 -- the same operations in the same order as the CPU reference.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>

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
    amax = fmaxf(amax, kFp8AmaxFloor);
    const float inv = __fdiv_rn(kFp8E4M3Max, amax);
    for (int i = 0; i < 4; ++i)
        q[b * 128 + lane * 4 + i] = static_cast<uint8_t>(
            __nv_cvt_float_to_fp8(__fmul_rn(v[i], inv), __NV_SATFINITE, __NV_E4M3));
    if (lane == 0) scales[b] = __fdiv_rn(amax, kFp8E4M3Max);
}

__device__ __forceinline__ uint16_t dequantize_one(uint8_t q, float scale) {
    __half_raw hr = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q), __NV_E4M3);
    return __bfloat16_as_ushort(__float2bfloat16_rn(__fmul_rn(__half2float(__half(hr)), scale)));
}

// Any alignment: a byte per thread and step.
__global__ void dequantize_kernel(const uint8_t* q, const float* scales, uint32_t tokens,
                                  const uint32_t* tokens_dev, uint32_t hidden, uint16_t* out) {
    const uint64_t n = uint64_t{tokens_dev ? min(*tokens_dev, tokens) : tokens} * hidden;
    for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n;
         i += uint64_t{gridDim.x} * blockDim.x)
        out[i] = dequantize_one(q[i], scales[i / 128]);
}

// 16-byte aligned q and 32-byte aligned out: 16 values per thread and step, one 16-byte load
// and two 16-byte stores (a byte per thread took ~0.8 ms for the 4096-token batch of the
// bench's expert stand-in, 2026-12-01). The same arithmetic per value as above.
__global__ void dequantize16_kernel(const uint4* q, const float* scales, uint32_t tokens,
                                    const uint32_t* tokens_dev, uint32_t hidden, uint4* out) {
    const uint64_t n16 = uint64_t{tokens_dev ? min(*tokens_dev, tokens) : tokens} * hidden / 16;
    for (uint64_t i = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n16;
         i += uint64_t{gridDim.x} * blockDim.x) {
        const uint4 v = q[i];
        const float scale = scales[i / 8];  // 8 vectors per 128-value scale block
        const uint32_t in[4] = {v.x, v.y, v.z, v.w};
        uint32_t o[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint16_t h[4];
#pragma unroll
            for (int b = 0; b < 4; ++b) h[b] = dequantize_one((in[j] >> (8 * b)) & 0xffu, scale);
            o[2 * j] = h[0] | (uint32_t{h[1]} << 16);
            o[2 * j + 1] = h[2] | (uint32_t{h[3]} << 16);
        }
        out[2 * i] = make_uint4(o[0], o[1], o[2], o[3]);
        out[2 * i + 1] = make_uint4(o[4], o[5], o[6], o[7]);
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
    const uint64_t n = uint64_t{tokens} * hidden;
    if (n == 0) return cudaSuccess;
    if (reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 32 == 0) {
        const uint64_t grid = std::min<uint64_t>((n / 16 + 255) / 256, 2048);
        dequantize16_kernel<<<static_cast<unsigned>(grid), 256, 0, stream>>>(
            reinterpret_cast<const uint4*>(q), scales, tokens, tokens_dev, hidden,
            reinterpret_cast<uint4*>(out));
    } else {
        dequantize_kernel<<<1024, 256, 0, stream>>>(q, scales, tokens, tokens_dev, hidden, out);
    }
    return cudaGetLastError();
}

cudaError_t preload_quantize_kernels() {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, quantize_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dequantize_kernel);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, dequantize16_kernel);
    return e;
}

}  // namespace ferry::moe::cuda
