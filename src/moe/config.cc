#include "ferry/moe/config.h"

#include <fmt/format.h>

#include <string>

#include "common/enum_names.h"

namespace ferry::moe {

namespace {

constexpr EnumName<CombineMode> kCombineModeNames[] = {
    {CombineMode::kPerHit, "per-hit"},
    {CombineMode::kPerRank, "per-rank"},
};
// "fp8" is an alias of "fp8_e4m3", the name dtype_name gives.
constexpr EnumName<DType> kDTypeNames[] = {
    {DType::kBf16, "bf16"},
    {DType::kFp8E4M3, "fp8_e4m3"},
    {DType::kFp8E4M3, "fp8"},
};

template <typename E, size_t N>
bool parse_into(const EnumName<E> (&table)[N], std::string_view name, E* out) {
    const std::optional<E> v = parse_name(table, name);
    if (v) *out = *v;
    return v.has_value();
}

}  // namespace

std::string_view combine_mode_name(CombineMode mode) { return name_of(kCombineModeNames, mode); }

bool parse_combine_mode(std::string_view name, CombineMode* out) {
    return parse_into(kCombineModeNames, name, out);
}

std::string_view dtype_name(DType dtype) { return name_of(kDTypeNames, dtype); }

bool parse_dtype(std::string_view name, DType* out) { return parse_into(kDTypeNames, name, out); }

Status AllToAllConfig::validate() const {
    auto bad = [](std::string what) { return invalid_argument("AllToAllConfig: " + what); };
    if (dtype != DType::kBf16 && dtype != DType::kFp8E4M3)
        return bad(fmt::format("dtype {} is not bf16 or fp8_e4m3", static_cast<int>(dtype)));
    if (world_size == 0 || world_size > kMaxWorldSize)
        return bad(fmt::format("world_size {} must be in [1, {}]", world_size, kMaxWorldSize));
    if (rank >= world_size)
        return bad(fmt::format("rank {} must be below world_size {}", rank, world_size));
    if (ranks_per_node == 0 || world_size % ranks_per_node != 0)
        return bad(
            fmt::format("ranks_per_node {} must divide world_size {}", ranks_per_node, world_size));
    if (max_tokens_per_rank == 0) return bad("max_tokens_per_rank must be at least 1");
    if (hidden == 0) return bad("hidden must be at least 1");
    if (dtype == DType::kFp8E4M3 && hidden % kScaleBlock != 0)
        return bad(
            fmt::format("hidden {} must be a multiple of {} for fp8 (one scale per {} "
                        "channels)",
                        hidden, kScaleBlock, kScaleBlock));
    // 16-byte aligned rows keep every copy vectorisable; bf16 needs hidden % 8.
    if (payload_bytes() % 16 != 0)
        return bad(
            fmt::format("hidden {} gives {}-byte rows; rows must be a multiple of 16 "
                        "bytes (hidden % {} == 0)",
                        hidden, payload_bytes(), 16 / elem_bytes()));
    if (num_experts == 0 || num_experts % world_size != 0)
        return bad(fmt::format("num_experts {} must be a positive multiple of world_size {}",
                               num_experts, world_size));
    if (num_local_experts() > kMaxLocalExperts)
        return bad(fmt::format("{} experts per rank exceeds the limit of {}", num_local_experts(),
                               kMaxLocalExperts));
    if (experts_per_token == 0 || experts_per_token > num_experts ||
        experts_per_token > kMaxExpertsPerToken)
        return bad(fmt::format("experts_per_token {} must be in [1, min(num_experts {}, {})]",
                               experts_per_token, num_experts, kMaxExpertsPerToken));
    if (private_slots_per_sender > max_tokens_per_rank)
        return bad(fmt::format("private_slots_per_sender {} exceeds max_tokens_per_rank {}",
                               private_slots_per_sender, max_tokens_per_rank));
    if (combine != CombineMode::kPerHit && combine != CombineMode::kPerRank)
        return bad(
            fmt::format("combine mode {} is not per-hit or per-rank", static_cast<int>(combine)));
    if (group_alignment == 0 || group_alignment > 4096)
        return bad(fmt::format("group_alignment {} must be in [1, 4096]", group_alignment));
    return ok_status();
}

uint64_t AllToAllConfig::hash() const {
    uint64_t h = 0xcbf29ce484222325ull;
    auto mix = [&h](uint64_t v) {
        for (int i = 0; i < 8; ++i) {
            h ^= (v >> (8 * i)) & 0xff;
            h *= 0x100000001b3ull;
        }
    };
    mix(2);  // layout version: bump when the wire layout changes (2: weights in row headers)
    mix(max_tokens_per_rank);
    mix(hidden);
    mix(static_cast<uint64_t>(dtype));
    mix(num_experts);
    mix(experts_per_token);
    mix(world_size);
    mix(ranks_per_node);
    mix(private_slots_per_sender);
    mix(group_alignment);
    mix(static_cast<uint64_t>(combine));
    return h;
}

Status check_same_config(const AllToAllConfig& mine, std::span<const uint64_t> hashes) {
    if (hashes.size() != mine.world_size)
        return invalid_argument(fmt::format("config check: got {} hashes for a world of {}",
                                            hashes.size(), mine.world_size));
    std::string bad;
    for (size_t r = 0; r < hashes.size(); ++r) {
        if (hashes[r] == mine.hash()) continue;
        bad += bad.empty() ? "" : ", ";
        bad += std::to_string(r);
    }
    if (bad.empty()) return ok_status();
    return invalid_argument(fmt::format(
        "rank {}: AllToAllConfig differs on rank(s) {}; every rank must pass the same "
        "max_tokens_per_rank, hidden, dtype, num_experts, experts_per_token, world_size, "
        "ranks_per_node, private_slots_per_sender, group_alignment and combine mode",
        mine.rank, bad));
}

}  // namespace ferry::moe
