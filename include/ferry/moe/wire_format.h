// The parts of the all-to-all's wire format that the host code (C++20) and the CUDA kernels
// (C++17 under nvcc, which cannot include plan.h or numerics.h for their std::span) both read:
// defined here once, so neither side keeps a copy of the other's. Plain C++17, no CUDA.
// plan.h and numerics.h include it; so does src/moe/cuda/kernels.h.
#pragma once

#include <cstdint>

namespace ferry::moe {

// Header at the start of every dispatched row (the rest of the row: RowFormat in plan.h).
struct RowHeader {
    uint32_t token;  // index of the token at its sender
    uint32_t seq;    // call number, to catch a row left over from another call
};
inline constexpr uint32_t kRowHeaderBytes = sizeof(RowHeader);

// Word indices of a counts message (uint32 words; the sizes are CountsFormat's, in plan.h).
struct CountsWords {
    static constexpr uint32_t kSeq = 0;
    static constexpr uint32_t kConfigHash = 1;   // low 32 bits of AllToAllConfig::hash()
    static constexpr uint32_t kCombineBase = 2;  // first combine row at the sender for d
    static constexpr uint32_t kHits = 3;         // (token, expert) pairs sent to d
    static constexpr uint32_t kRowsTo = 4;       // [world] rows the sender sends to each rank
};

// Where one dispatched row of the grouped output came from.
struct RowSource {
    static constexpr uint32_t kPadding = 0xffffffffu;
    uint32_t rank = kPadding;  // sender, kPadding for alignment padding
    uint32_t token = 0;        // token index at the sender
    uint32_t k = 0;            // top-k position that chose this expert
};

// fp8 e4m3 (OCP "fn"): the largest finite value.
inline constexpr float kFp8E4M3Max = 448.0f;
// Floor on a block's amax, as in the common per-token cast: keeps the scale away from zero
// so an all-zero block quantizes to zeros instead of dividing by zero.
inline constexpr float kFp8AmaxFloor = 1e-4f;

static_assert(sizeof(RowHeader) == 8 && sizeof(RowSource) == 12,
              "the kernels copy these records word by word");

}  // namespace ferry::moe
