// Element conversions of the all-to-all: bf16 and fp8 e4m3 (OCP "fn": no infinities, one NaN
// pattern, largest finite 448), and the block quantization DeepSeek-style fp8 inference uses:
// one fp32 scale per 128 channels, scale = amax / 448.
#pragma once

#include <cstdint>
#include <cstring>
#include <span>

#include "ferry/common/status.h"
#include "ferry/moe/wire_format.h"

namespace ferry::moe {

// kFp8E4M3Max and kFp8AmaxFloor are in wire_format.h, which the CUDA kernels share.

inline float bf16_to_float(uint16_t h) {
    uint32_t bits = uint32_t{h} << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
}

// Round to nearest even; NaN stays NaN (quiet), infinities stay infinite.
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// Saturating (anything beyond ±448, infinities included, becomes ±448), round to nearest
// even, NaN -> 0x7f with the sign kept.
uint8_t float_to_fp8e4m3(float f);
float fp8e4m3_to_float(uint8_t v);

// Quantizes `tokens` rows of `hidden` channels (hidden % 128 == 0): q gets tokens*hidden fp8
// bytes, scales gets tokens*hidden/128 floats, row-major. Block-constant inputs of magnitude
// at least kFp8AmaxFloor come back exactly after dequantize_fp8_to_bf16 (each becomes ±448
// times its scale).
Status quantize_fp8(std::span<const float> x, uint32_t tokens, uint32_t hidden,
                    std::span<uint8_t> q, std::span<float> scales);
Status quantize_fp8_bf16(std::span<const uint16_t> x, uint32_t tokens, uint32_t hidden,
                         std::span<uint8_t> q, std::span<float> scales);
Status dequantize_fp8(std::span<const uint8_t> q, std::span<const float> scales, uint32_t tokens,
                      uint32_t hidden, std::span<float> out);
Status dequantize_fp8_to_bf16(std::span<const uint8_t> q, std::span<const float> scales,
                              uint32_t tokens, uint32_t hidden, std::span<uint16_t> out);

}  // namespace ferry::moe
