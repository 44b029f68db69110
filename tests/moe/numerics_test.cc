#include "ferry/moe/numerics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "support/multiproc.h"

namespace ferry::moe {
namespace {

float from_bits(uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}

TEST(MoeNumerics, Bf16RoundsToNearestEven) {
    EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
    EXPECT_EQ(float_to_bf16(-2.0f), 0xc000);
    EXPECT_EQ(float_to_bf16(from_bits(0x3f808000)), 0x3f80);  // tie, even stays
    EXPECT_EQ(float_to_bf16(from_bits(0x3f818000)), 0x3f82);  // tie, odd rounds up
    EXPECT_EQ(float_to_bf16(from_bits(0x3f808001)), 0x3f81);  // above the tie
    EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
    EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
    for (uint32_t h = 0; h < 0x7f80; h += 7) EXPECT_EQ(float_to_bf16(bf16_to_float(h)), h);
}

// Independent oracle: nearest finite e4m3 value by scanning every code, ties to the even
// code, saturating beyond 448.
uint8_t fp8_by_search(float f) {
    if (std::isnan(f)) return std::signbit(f) ? 0xff : 0x7f;
    uint8_t best = 0;
    double best_d = 1e300;
    for (int c = 0; c < 256; ++c) {
        if ((c & 0x7f) == 0x7f) continue;
        float v = fp8e4m3_to_float(static_cast<uint8_t>(c));
        if (std::signbit(v) != std::signbit(f)) continue;
        double d = std::fabs(double(v) - double(f));
        if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) {
            best = static_cast<uint8_t>(c);
            best_d = d;
        }
    }
    return best;
}

TEST(MoeNumerics, Fp8DecodesTheE4M3Format) {
    EXPECT_EQ(fp8e4m3_to_float(0x00), 0.0f);
    EXPECT_EQ(fp8e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
    EXPECT_EQ(fp8e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
    EXPECT_EQ(fp8e4m3_to_float(0x38), 1.0f);
    EXPECT_EQ(fp8e4m3_to_float(0x7e), 448.0f);
    EXPECT_EQ(fp8e4m3_to_float(0xfe), -448.0f);
    EXPECT_TRUE(std::isnan(fp8e4m3_to_float(0x7f)));
    for (int c = 0; c < 256; ++c) {
        if ((c & 0x7f) == 0x7f) continue;
        EXPECT_EQ(float_to_fp8e4m3(fp8e4m3_to_float(static_cast<uint8_t>(c))), c == 0x80 ? 0x80 : c)
            << "code " << c;
    }
}

TEST(MoeNumerics, Fp8RoundsToNearestEvenAndSaturates) {
    EXPECT_EQ(float_to_fp8e4m3(1.0625f), 0x38);                // tie between 1 and 1.125: even
    EXPECT_EQ(float_to_fp8e4m3(1.1875f), 0x3a);                // tie between 1.125 and 1.25: even
    EXPECT_EQ(float_to_fp8e4m3(std::ldexp(1.0f, -10)), 0x00);  // tie 0 / 2^-9
    EXPECT_EQ(float_to_fp8e4m3(3 * std::ldexp(1.0f, -10)), 0x02);  // tie 2^-9 / 2^-8
    EXPECT_EQ(float_to_fp8e4m3(464.0f), 0x7e);
    EXPECT_EQ(float_to_fp8e4m3(1e9f), 0x7e);
    EXPECT_EQ(float_to_fp8e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
    EXPECT_EQ(float_to_fp8e4m3(std::nanf("")), 0x7f);

    std::mt19937_64 rng(
        ferry::testing::test_seed("MoeNumerics.Fp8RoundsToNearestEvenAndSaturates"));
    std::uniform_real_distribution<float> mag(-12.0f, 10.0f);
    for (int i = 0; i < 20000; ++i) {
        float f = std::ldexp(1.0f, 0) * std::exp2(mag(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
        ASSERT_EQ(float_to_fp8e4m3(f), fp8_by_search(f)) << "value " << f;
    }
    // Every midpoint between neighbouring codes, where rounding ties are decided.
    for (int c = 0; c < 0x7e; ++c) {
        float a = fp8e4m3_to_float(static_cast<uint8_t>(c));
        float b = fp8e4m3_to_float(static_cast<uint8_t>(c + 1));
        float mid = (a + b) / 2;
        ASSERT_EQ(float_to_fp8e4m3(mid), fp8_by_search(mid)) << "midpoint " << mid;
    }
}

TEST(MoeNumerics, QuantizeUsesAmaxOver448PerBlock) {
    const uint32_t hidden = 256;
    std::vector<float> x(hidden);
    for (uint32_t c = 0; c < hidden; ++c) x[c] = (c < 128 ? 0.5f : -3.0f) * (c % 5 + 1) / 5.0f;
    std::vector<uint8_t> q(hidden);
    std::vector<float> s(2);
    ASSERT_TRUE(quantize_fp8(x, 1, hidden, q, s).ok());
    EXPECT_FLOAT_EQ(s[0], 0.5f / 448.0f);
    EXPECT_FLOAT_EQ(s[1], 3.0f / 448.0f);
    std::vector<float> back(hidden);
    ASSERT_TRUE(dequantize_fp8(q, s, 1, hidden, back).ok());
    for (uint32_t c = 0; c < hidden; ++c) {
        // e4m3 keeps 3 mantissa bits: relative error at most 2^-4 for normal codes.
        EXPECT_NEAR(back[c], x[c], std::fabs(x[c]) / 16 + s[c / 128] * std::ldexp(1.0f, -9))
            << "channel " << c;
    }
    std::vector<float> zeros(128, 0.0f);
    ASSERT_TRUE(quantize_fp8(zeros, 1, 128, q, s).ok());
    EXPECT_GT(s[0], 0.0f);  // the amax floor: no division by zero
    EXPECT_EQ(q[0], 0);
}

TEST(MoeNumerics, Fp8RoundTripIsExactForBlockConstantInputs) {
    // Every positive and negative bf16 value at or above the amax floor, one per block.
    std::vector<uint16_t> x;
    for (uint32_t h = 0; h < 0x7f80; ++h) {
        float v = bf16_to_float(static_cast<uint16_t>(h));
        if (v < kFp8AmaxFloor) continue;
        for (int i = 0; i < 128; ++i) x.push_back(static_cast<uint16_t>(h));
        for (int i = 0; i < 128; ++i) x.push_back(static_cast<uint16_t>(h | 0x8000));
    }
    uint32_t tokens = static_cast<uint32_t>(x.size() / 128);
    std::vector<uint8_t> q(x.size());
    std::vector<float> s(tokens);
    ASSERT_TRUE(quantize_fp8_bf16(x, tokens, 128, q, s).ok());
    std::vector<uint16_t> back(x.size());
    ASSERT_TRUE(dequantize_fp8_to_bf16(q, s, tokens, 128, back).ok());
    for (size_t i = 0; i < x.size(); i += 128) ASSERT_EQ(back[i], x[i]) << "bf16 " << x[i];
}

TEST(MoeNumerics, QuantizeRejectsBadShapes) {
    std::vector<float> x(100);
    std::vector<uint8_t> q(100);
    std::vector<float> s(1);
    Status st = quantize_fp8(x, 1, 100, q, s);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("hidden % 128"), std::string::npos) << st.message();
    std::vector<float> x2(256);
    st = quantize_fp8(x2, 2, 256, q, s);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry::moe
