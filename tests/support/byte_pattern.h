// Test helper: a seeded byte pattern that differs at every offset, written on one side of a
// transfer and checked on the other, and comparisons that name the first bytes that differ.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ferry::testing {

// Byte i of the pattern of `seed`: cheap, and different for every offset.
uint8_t pattern(uint64_t seed, uint64_t i);

void fill_pattern(std::span<uint8_t> b, uint64_t seed);

// "" when b[off, off + len) holds pattern(seed, from + k) at every k, else the first miss.
std::string check_pattern(std::span<const uint8_t> b, size_t off, size_t len, uint64_t seed,
                          uint64_t from);

// "" when b[off, off + len) is all `v`, else the first miss.
std::string check_fill(std::span<const uint8_t> b, size_t off, size_t len, uint8_t v);

// "" when every byte matches, else the first few mismatches and how many bytes differ.
std::string compare_bytes(std::span<const uint8_t> got, std::span<const uint8_t> want);

}  // namespace ferry::testing
