#include "ferry/moe/plan.h"

#include <fmt/format.h>

#include <algorithm>

namespace ferry::moe {
namespace {

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace

RowFormat RowFormat::of(const AllToAllConfig& cfg) {
    RowFormat f;
    f.place_offset = round_up(sizeof(RowHeader) + sizeof(int16_t) * cfg.experts_per_token, 4);
    f.hit_base_offset = f.place_offset + sizeof(uint32_t) * cfg.experts_per_token;
    f.weight_offset = f.hit_base_offset + sizeof(uint32_t);
    f.header_bytes = round_up(f.weight_offset + sizeof(float) * cfg.experts_per_token, 16);
    f.payload_offset = f.header_bytes;
    f.scale_offset = f.payload_offset + round_up(cfg.payload_bytes(), 16);
    f.row_bytes = f.scale_offset + round_up(cfg.scale_bytes(), 16);
    return f;
}

CountsFormat CountsFormat::of(const AllToAllConfig& cfg) {
    CountsFormat f;
    f.hits_per_expert = kRowsTo + cfg.world_size;
    f.words = f.hits_per_expert + cfg.num_local_experts();
    f.bytes = round_up(size_t{f.words} * sizeof(uint32_t), 64);
    return f;
}

BufferSizes BufferSizes::of(const AllToAllConfig& cfg) {
    BufferSizes b;
    size_t row = RowFormat::of(cfg).row_bytes;
    size_t counts = CountsFormat::of(cfg).bytes;
    size_t w = cfg.world_size, t = cfg.max_tokens_per_rank, k = cfg.experts_per_token;
    b.combine_row_bytes = size_t{cfg.hidden} * sizeof(uint16_t);
    b.recv_counts = w * counts;
    // Every sender may send every token here: private slots plus the overflow run together
    // hold max_tokens rows per sender.
    b.recv_dispatch = w * t * row;
    b.recv_combine = t * k * b.combine_row_bytes;
    b.stage_counts = w * counts;
    b.stage_dispatch = t * std::min<size_t>(w, k) * row;
    b.stage_combine = w * t * std::min<size_t>(k, cfg.num_local_experts()) * b.combine_row_bytes;
    return b;
}

size_t max_expert_rows(const AllToAllConfig& cfg) {
    size_t hits = size_t{cfg.world_size} * cfg.max_tokens_per_rank *
                  std::min(cfg.experts_per_token, cfg.num_local_experts());
    return hits + size_t{cfg.num_local_experts()} * (cfg.group_alignment - 1);
}

Result<SendPlan> plan_send(const AllToAllConfig& cfg, std::span<const int32_t> indices,
                           uint32_t num_tokens) {
    if (num_tokens > cfg.max_tokens_per_rank)
        return invalid_argument(fmt::format("dispatch of {} tokens exceeds max_tokens_per_rank {}",
                                            num_tokens, cfg.max_tokens_per_rank));
    const uint32_t k = cfg.experts_per_token, w = cfg.world_size;
    if (indices.size() < size_t{num_tokens} * k)
        return invalid_argument(fmt::format("indices hold {} entries; {} tokens x top-{} need {}",
                                            indices.size(), num_tokens, k, size_t{num_tokens} * k));
    SendPlan p;
    p.num_tokens = num_tokens;
    p.expert_counts.assign(cfg.num_experts, 0);
    p.rows_to.assign(w, 0);
    p.hits_to.assign(w, 0);
    p.combine_slot.assign(size_t{num_tokens} * k, -1);

    std::vector<uint8_t> seen_rank(w, 0);
    for (uint32_t t = 0; t < num_tokens; ++t) {
        const int32_t* row = indices.data() + size_t{t} * k;
        std::fill(seen_rank.begin(), seen_rank.end(), 0);
        for (uint32_t j = 0; j < k; ++j) {
            int32_t e = row[j];
            if (e == -1) continue;
            if (e < -1 || e >= static_cast<int32_t>(cfg.num_experts))
                return invalid_argument(fmt::format(
                    "token {} top-k {}: expert {} is outside [-1, {})", t, j, e, cfg.num_experts));
            for (uint32_t j2 = 0; j2 < j; ++j2) {
                if (row[j2] == e)
                    return invalid_argument(fmt::format(
                        "token {} selects expert {} twice (top-k {} and {})", t, e, j2, j));
            }
            uint32_t d = cfg.expert_owner(static_cast<uint32_t>(e));
            ++p.expert_counts[e];
            ++p.hits_to[d];
            if (!seen_rank[d]) {
                seen_rank[d] = 1;
                ++p.rows_to[d];
            }
        }
    }

    const bool per_rank = cfg.combine == CombineMode::kPerRank;
    p.row_begin.assign(w + 1, 0);
    p.combine_begin.assign(w + 1, 0);
    for (uint32_t d = 0; d < w; ++d) {
        p.row_begin[d + 1] = p.row_begin[d] + p.rows_to[d];
        p.combine_begin[d + 1] = p.combine_begin[d] + (per_rank ? p.rows_to[d] : p.hits_to[d]);
    }
    p.row_token.assign(p.row_begin[w], 0);
    // Second pass in token order, top-k order inside a token: the order the receiver walks
    // rows and hits when it sends results back, so slots line up without exchanging them.
    std::vector<uint32_t> next_row(p.row_begin.begin(), p.row_begin.end() - 1);
    std::vector<uint32_t> next_slot(p.combine_begin.begin(), p.combine_begin.end() - 1);
    for (uint32_t t = 0; t < num_tokens; ++t) {
        const int32_t* row = indices.data() + size_t{t} * k;
        std::fill(seen_rank.begin(), seen_rank.end(), 0);
        for (uint32_t j = 0; j < k; ++j) {
            if (row[j] < 0) continue;
            uint32_t d = cfg.expert_owner(static_cast<uint32_t>(row[j]));
            if (!seen_rank[d]) {
                seen_rank[d] = 1;
                const uint32_t r = next_row[d]++;
                p.row_token[r] = t;
                if (per_rank)
                    p.combine_slot[size_t{t} * k + j] =
                        static_cast<int32_t>(p.combine_begin[d] + (r - p.row_begin[d]));
            }
            if (!per_rank) p.combine_slot[size_t{t} * k + j] = static_cast<int32_t>(next_slot[d]++);
        }
    }
    return p;
}

RecvLayout::RecvLayout(const AllToAllConfig& cfg, std::span<const uint32_t> rows_from)
    : private_slots_(cfg.private_slots_per_sender),
      overflow_base_(uint64_t{cfg.world_size} * cfg.private_slots_per_sender),
      rows_from_(rows_from.begin(), rows_from.end()),
      overflow_begin_(rows_from.size(), 0) {
    uint64_t at = 0;
    for (size_t s = 0; s < rows_from_.size(); ++s) {
        overflow_begin_[s] = at;
        at += rows_from_[s] > private_slots_ ? rows_from_[s] - private_slots_ : 0;
    }
}

uint32_t RecvLayout::private_rows(uint32_t s) const {
    return std::min(rows_from_[s], private_slots_);
}

ExpertLayout expert_layout(const AllToAllConfig& cfg, std::span<const uint32_t> hits) {
    ExpertLayout l;
    uint32_t n = cfg.num_local_experts();
    l.counts.assign(hits.begin(), hits.begin() + n);
    l.offsets.assign(n + 1, 0);
    uint32_t a = cfg.group_alignment;
    for (uint32_t e = 0; e < n; ++e)
        l.offsets[e + 1] = l.offsets[e] + (l.counts[e] + a - 1) / a * a;
    return l;
}

}  // namespace ferry::moe
