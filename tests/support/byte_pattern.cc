#include "support/byte_pattern.h"

#include <fmt/format.h>

namespace ferry::testing {

uint8_t pattern(uint64_t seed, uint64_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 29;
    return static_cast<uint8_t>(x * 0xBF58476D1CE4E5B9ull >> 56);
}

void fill_pattern(std::span<uint8_t> b, uint64_t seed) {
    for (size_t i = 0; i < b.size(); ++i) b[i] = pattern(seed, i);
}

std::string check_pattern(std::span<const uint8_t> b, size_t off, size_t len, uint64_t seed,
                          uint64_t from) {
    for (size_t k = 0; k < len; ++k) {
        if (b[off + k] != pattern(seed, from + k)) {
            return fmt::format("byte {} of {}: got {:#x} want {:#x}", k, len, b[off + k],
                               pattern(seed, from + k));
        }
    }
    return "";
}

std::string check_fill(std::span<const uint8_t> b, size_t off, size_t len, uint8_t v) {
    for (size_t k = 0; k < len; ++k) {
        if (b[off + k] != v)
            return fmt::format("byte {} of {}: got {:#x} want {:#x}", off + k, b.size(), b[off + k],
                               v);
    }
    return "";
}

std::string compare_bytes(std::span<const uint8_t> got, std::span<const uint8_t> want) {
    if (got.size() != want.size()) return "size differs";
    size_t bad = 0;
    std::string out;
    for (size_t i = 0; i < got.size(); ++i) {
        if (got[i] != want[i]) {
            if (bad < 5) out += fmt::format("byte {}: got {:#x} want {:#x}; ", i, got[i], want[i]);
            ++bad;
        }
    }
    if (bad) out += fmt::format("{} bytes wrong", bad);
    return out;
}

}  // namespace ferry::testing
