// Offsets computed from caller-given ids and strides (paged writes, block copies), with 64-bit
// overflow reported instead of wrapped: a wrapped offset passes a bounds check and then points
// anywhere (a paged write with a stride of 2^63 crashed the rail worker in the provider's copy
// before this check).
#pragma once

#include <cstdint>
#include <optional>

namespace ferry::detail {

// base + index * stride, or nothing where that does not fit in 64 bits.
inline std::optional<uint64_t> checked_offset(uint64_t base, uint64_t index, uint64_t stride) {
    uint64_t product = 0, sum = 0;
    if (__builtin_mul_overflow(index, stride, &product) ||
        __builtin_add_overflow(base, product, &sum)) {
        return std::nullopt;
    }
    return sum;
}

}  // namespace ferry::detail
