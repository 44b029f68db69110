#include "ferry/moe/numerics.h"

#include <fmt/format.h>

#include <array>
#include <cmath>

#include "ferry/moe/config.h"

namespace ferry::moe {
namespace {

std::array<float, 256> make_fp8_table() {
    std::array<float, 256> t{};
    for (int v = 0; v < 256; ++v) {
        int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
        float mag;
        if (exp == 0xf && man == 7) {
            mag = std::nanf("");
        } else if (exp == 0) {
            mag = std::ldexp(static_cast<float>(man), -9);  // subnormal: man/8 * 2^-6
        } else {
            mag = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
        }
        t[v] = sign ? -mag : mag;
    }
    return t;
}

const std::array<float, 256> kFp8Table = make_fp8_table();

Status check_shapes(size_t x_len, uint32_t tokens, uint32_t hidden, size_t q_len,
                    size_t scales_len) {
    if (hidden == 0 || hidden % kScaleBlock != 0)
        return invalid_argument(fmt::format("fp8 block quantization needs hidden % {} == 0, got {}",
                                            kScaleBlock, hidden));
    size_t n = size_t{tokens} * hidden;
    size_t ns = n / kScaleBlock;
    if (x_len < n || q_len < n || scales_len < ns)
        return invalid_argument(fmt::format(
            "fp8 quantization of {} x {}: needs {} values, {} fp8 bytes and {} scales; got "
            "{}, {} and {}",
            tokens, hidden, n, n, ns, x_len, q_len, scales_len));
    return ok_status();
}

template <typename Load>
void quantize_blocks(Load load, size_t blocks, uint8_t* q, float* scales) {
    for (size_t b = 0; b < blocks; ++b) {
        float amax = 0.0f;
        for (uint32_t i = 0; i < kScaleBlock; ++i)
            amax = std::fmax(amax, std::fabs(load(b * kScaleBlock + i)));
        amax = std::fmax(amax, kFp8AmaxFloor);
        // Same order of operations as the common per-token cast (x * (448 / amax)), so a
        // kernel matching that format produces the same bytes.
        float inv = kFp8E4M3Max / amax;
        for (uint32_t i = 0; i < kScaleBlock; ++i)
            q[b * kScaleBlock + i] = float_to_fp8e4m3(load(b * kScaleBlock + i) * inv);
        scales[b] = amax / kFp8E4M3Max;
    }
}

}  // namespace

uint8_t float_to_fp8e4m3(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof(bits));
    uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
    uint32_t abs_bits = bits & 0x7fffffffu;
    if (abs_bits > 0x7f800000u) return sign | 0x7f;  // NaN
    float a;
    std::memcpy(&a, &abs_bits, sizeof(a));
    if (a >= kFp8E4M3Max) return sign | 0x7e;  // saturate, infinity included
    if (a < 0x1p-6f) {
        // Subnormal range: the code is the value in units of 2^-9 (8 rounds up to the
        // smallest normal, whose code is also 8). nearbyint rounds half to even.
        return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
    }
    // Normal: round the 23-bit mantissa to 3 bits, half to even; a carry moves into the
    // exponent, which is what rounding up to the next binade means.
    uint32_t lsb = (abs_bits >> 20) & 1u;
    uint32_t r = abs_bits + 0x7ffffu + lsb;
    uint32_t code = (r >> 20) - ((127u - 7u) << 3);
    if (code > 0x7e) code = 0x7e;  // rounded past 448
    return sign | static_cast<uint8_t>(code);
}

float fp8e4m3_to_float(uint8_t v) { return kFp8Table[v]; }

Status quantize_fp8(std::span<const float> x, uint32_t tokens, uint32_t hidden,
                    std::span<uint8_t> q, std::span<float> scales) {
    FERRY_RETURN_IF_ERROR(check_shapes(x.size(), tokens, hidden, q.size(), scales.size()));
    size_t blocks = size_t{tokens} * hidden / kScaleBlock;
    quantize_blocks([&](size_t i) { return x[i]; }, blocks, q.data(), scales.data());
    return ok_status();
}

Status quantize_fp8_bf16(std::span<const uint16_t> x, uint32_t tokens, uint32_t hidden,
                         std::span<uint8_t> q, std::span<float> scales) {
    FERRY_RETURN_IF_ERROR(check_shapes(x.size(), tokens, hidden, q.size(), scales.size()));
    size_t blocks = size_t{tokens} * hidden / kScaleBlock;
    quantize_blocks([&](size_t i) { return bf16_to_float(x[i]); }, blocks, q.data(), scales.data());
    return ok_status();
}

Status dequantize_fp8(std::span<const uint8_t> q, std::span<const float> scales, uint32_t tokens,
                      uint32_t hidden, std::span<float> out) {
    FERRY_RETURN_IF_ERROR(check_shapes(out.size(), tokens, hidden, q.size(), scales.size()));
    size_t n = size_t{tokens} * hidden;
    for (size_t i = 0; i < n; ++i) out[i] = fp8e4m3_to_float(q[i]) * scales[i / kScaleBlock];
    return ok_status();
}

Status dequantize_fp8_to_bf16(std::span<const uint8_t> q, std::span<const float> scales,
                              uint32_t tokens, uint32_t hidden, std::span<uint16_t> out) {
    FERRY_RETURN_IF_ERROR(check_shapes(out.size(), tokens, hidden, q.size(), scales.size()));
    size_t n = size_t{tokens} * hidden;
    for (size_t i = 0; i < n; ++i)
        out[i] = float_to_bf16(fp8e4m3_to_float(q[i]) * scales[i / kScaleBlock]);
    return ok_status();
}

}  // namespace ferry::moe
