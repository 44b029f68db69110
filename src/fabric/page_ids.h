// Page ids staged for the GPU: both lists copied as they are, then each side's largest id for
// the bounds check, four vectors of four ids at a time. One fused loop (copy, then compare each
// id) took ~40 us for 65,536 pairs on the 2-core dev machine; this takes ~6 us there
// (2026-12-02): that loop's compares carried a dependency from one id to the next.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ferry::detail {

// The largest of p[0, n); 0 when n is 0.
inline uint32_t largest_id(const uint32_t* p, size_t n) {
    using V = uint32_t __attribute__((vector_size(16)));
    auto vmax = [](V a, V b) {
        const V gt = (V)(a > b);
        return (a & gt) | (b & ~gt);
    };
    V m[4] = {};
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (int k = 0; k < 4; ++k) {
            V v;
            std::memcpy(&v, p + i + 4 * k, sizeof(v));
            m[k] = vmax(v, m[k]);
        }
    }
    const V all = vmax(vmax(m[0], m[1]), vmax(m[2], m[3]));
    uint32_t r = 0;
    for (int k = 0; k < 4; ++k) r = all[k] > r ? all[k] : r;
    for (; i < n; ++i) r = p[i] > r ? p[i] : r;
    return r;
}

struct LargestIds {
    uint32_t src = 0, dst = 0;
};

// Copies n source ids to out and n destination ids to out + n; returns each side's largest.
inline LargestIds stage_page_ids(const uint32_t* src, const uint32_t* dst, size_t n,
                                 uint32_t* out) {
    std::memcpy(out, src, n * sizeof(uint32_t));
    std::memcpy(out + n, dst, n * sizeof(uint32_t));
    return {largest_id(out, n), largest_id(out + n, n)};
}

}  // namespace ferry::detail
