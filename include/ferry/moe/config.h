// Configuration of one rank's expert-parallel all-to-all. Every rank of a group builds its own
// config; all fields except `rank` must match across ranks, which setup checks through hash().
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "ferry/common/status.h"

namespace ferry::moe {

// Element type of the dispatched tokens. Combine always carries bf16 rows and accumulates in
// fp32.
enum class DType : uint8_t {
    kBf16 = 0,
    kFp8E4M3 = 1,  // OCP e4m3 ("fn"), one fp32 scale per kScaleBlock channels
};

// What travels back in combine. kPerHit: every (token, expert) output row, weighted and
// summed at the token's rank (DeepEP's low-latency layout). kPerRank: the expert's rank first
// sums weight * output over a token's experts it holds (fp32, top-k order), rounds that
// partial to bf16 and sends one row per (token, rank); the token's rank adds the partials.
// At 2 ranks and top-8 that is a quarter of the bytes, at top-8 of 8 ranks about two thirds;
// the price is one more bf16 rounding per rank's partial.
enum class CombineMode : uint8_t {
    kPerHit = 0,
    kPerRank = 1,
};
std::string_view combine_mode_name(CombineMode mode);
// "per-hit" or "per-rank"; false for anything else.
bool parse_combine_mode(std::string_view name, CombineMode* out);

std::string_view dtype_name(DType dtype);
// "bf16" or "fp8" (also "fp8_e4m3"); false for anything else.
bool parse_dtype(std::string_view name, DType* out);

// Channels sharing one fp8 scale: the block size DeepSeek-style fp8 inference uses.
inline constexpr uint32_t kScaleBlock = 128;

// Bounds that keep every protocol field inside its wire width (16-bit local expert ids in
// the row header, sender rank in the low bits of an immediate).
inline constexpr uint32_t kMaxWorldSize = 1024;
inline constexpr uint32_t kMaxExpertsPerToken = 64;
inline constexpr uint32_t kMaxLocalExperts = 32767;

struct AllToAllConfig {
    uint32_t max_tokens_per_rank = 0;  // most tokens one rank dispatches per call
    uint32_t hidden = 0;               // channels per token
    DType dtype = DType::kBf16;        // dispatch element type
    uint32_t num_experts = 0;          // global experts, split evenly over the ranks
    uint32_t experts_per_token = 0;    // top-k
    uint32_t rank = 0;
    uint32_t world_size = 1;
    uint32_t ranks_per_node = 1;  // ranks that map each other's memory (NVLink / shm)
    // Rows each sender may write into a peer before the counts are known: covers the whole
    // exchange of small (decode) batches with no second round trip.
    uint32_t private_slots_per_sender = 0;
    uint32_t group_alignment = 1;  // rows of each local expert group are padded to this
    CombineMode combine = CombineMode::kPerHit;

    // A message naming the bad field and the accepted range.
    Status validate() const;
    // FNV-1a over every field that all ranks must agree on (everything except rank).
    uint64_t hash() const;

    uint32_t num_local_experts() const { return num_experts / world_size; }
    uint32_t node_of(uint32_t r) const { return r / ranks_per_node; }
    bool same_node(uint32_t a, uint32_t b) const { return node_of(a) == node_of(b); }
    uint32_t expert_owner(uint32_t expert) const { return expert / num_local_experts(); }
    uint32_t local_expert(uint32_t expert) const { return expert % num_local_experts(); }

    size_t elem_bytes() const { return dtype == DType::kBf16 ? 2 : 1; }
    size_t payload_bytes() const { return size_t{hidden} * elem_bytes(); }
    uint32_t scales_per_token() const {
        return dtype == DType::kFp8E4M3 ? hidden / kScaleBlock : 0;
    }
    size_t scale_bytes() const { return size_t{scales_per_token()} * sizeof(float); }
};

// Setup check: hashes[r] is rank r's AllToAllConfig::hash(). Names every rank that
// disagrees with this one.
Status check_same_config(const AllToAllConfig& mine, std::span<const uint64_t> hashes);

}  // namespace ferry::moe
