#include "ferry/kv/block_mapping.h"

#include <fmt/format.h>

#include <algorithm>

namespace ferry::kv {
namespace {

Status check_split(uint32_t total_heads, uint32_t producer_tp, uint32_t consumer_tp) {
    if (producer_tp == 0 || consumer_tp == 0 || total_heads == 0) {
        return invalid_argument("TP sizes and the number of KV heads must be positive");
    }
    if (total_heads % producer_tp || total_heads % consumer_tp) {
        return invalid_argument(
            fmt::format("{} KV heads do not split evenly over producer TP {} and consumer TP {}",
                        total_heads, producer_tp, consumer_tp));
    }
    return ok_status();
}

// Ranks of a TP group of size `other_tp` whose head ranges overlap [first, first + count).
std::vector<uint32_t> overlapping_ranks(uint32_t first, uint32_t count, uint32_t total_heads,
                                        uint32_t other_tp) {
    uint32_t per = total_heads / other_tp;
    std::vector<uint32_t> ranks;
    for (uint32_t r = first / per; r < other_tp && r * per < first + count; ++r) {
        ranks.push_back(r);
    }
    return ranks;
}

// Appends runs, extending the previous one when the new one continues it on both sides.
class Coalescer {
  public:
    explicit Coalescer(TransferPlan* plan) : plan_(plan) {}
    void add(uint64_t src, uint64_t dst, uint64_t len) {
        plan_->bytes += len;
        if (!plan_->runs.empty()) {
            ByteRun& last = plan_->runs.back();
            if (last.src_offset + last.length == src && last.dst_offset + last.length == dst) {
                last.length += len;
                return;
            }
        }
        plan_->runs.push_back({src, dst, len});
    }

  private:
    TransferPlan* plan_;
};

struct Span {
    uint32_t src_block, src_slot, dst_block, dst_slot, tokens;
};

Status check_blocks(std::span<const uint32_t> blocks, uint32_t needed, const KvLayout& layout,
                    const char* side) {
    if (blocks.size() < needed) {
        return invalid_argument(fmt::format("{} has {} block ids, the token range needs {}", side,
                                            blocks.size(), needed));
    }
    for (uint32_t i = 0; i < needed; ++i) {
        if (blocks[i] >= layout.num_blocks) {
            return out_of_range(
                fmt::format("{} block id {} (index {}) is outside the pool of {} "
                            "blocks",
                            side, blocks[i], i, layout.num_blocks));
        }
    }
    return ok_status();
}

}  // namespace

namespace {

// Ranks of the other side overlapping rank `rank` of a TP group of size `own_tp`.
Result<std::vector<uint32_t>> peers_of(uint32_t total_heads, uint32_t own_tp, uint32_t other_tp,
                                       uint32_t rank, const char* role) {
    if (rank >= own_tp) {
        return invalid_argument(
            fmt::format("{} rank {} is outside TP size {}", role, rank, own_tp));
    }
    uint32_t per = total_heads / own_tp;
    return overlapping_ranks(rank * per, per, total_heads, other_tp);
}

}  // namespace

Result<std::vector<uint32_t>> producers_for_consumer(uint32_t total_heads, uint32_t producer_tp,
                                                     uint32_t consumer_tp, uint32_t consumer_rank) {
    FERRY_RETURN_IF_ERROR(check_split(total_heads, producer_tp, consumer_tp));
    return peers_of(total_heads, consumer_tp, producer_tp, consumer_rank, "consumer");
}

Result<std::vector<uint32_t>> consumers_for_producer(uint32_t total_heads, uint32_t producer_tp,
                                                     uint32_t consumer_tp, uint32_t producer_rank) {
    FERRY_RETURN_IF_ERROR(check_split(total_heads, producer_tp, consumer_tp));
    return peers_of(total_heads, producer_tp, consumer_tp, producer_rank, "producer");
}

Status check_compatible(const KvRank& src, const KvRank& dst) {
    FERRY_RETURN_IF_ERROR(src.layout.validate().with_context("producer layout"));
    FERRY_RETURN_IF_ERROR(dst.layout.validate().with_context("consumer layout"));
    if (src.layout.compatibility_hash() != dst.layout.compatibility_hash()) {
        return invalid_argument(fmt::format(
            "KV layouts are incompatible: {}: producer {} vs consumer {}",
            compatibility_difference(src.layout, dst.layout, "at the producer", "at the consumer"),
            src.layout.to_string(), dst.layout.to_string()));
    }
    if (src.total_heads() != dst.total_heads()) {
        return invalid_argument(fmt::format(
            "producer holds {} KV heads in total ({} per rank x TP {}), consumer {} ({} x TP {})",
            src.total_heads(), src.layout.num_kv_heads, src.tp_size, dst.total_heads(),
            dst.layout.num_kv_heads, dst.tp_size));
    }
    if (src.tp_rank >= src.tp_size || dst.tp_rank >= dst.tp_size) {
        return invalid_argument("TP rank outside its TP size");
    }
    return ok_status();
}

namespace {

// Cuts pool-offset runs where either side's regions end and makes the offsets region-local.
// Runs that coalesced across a boundary (a layer's V ends where the next layer's K starts)
// become one run per region; within a region they stay whole.
void cut_at_regions(TransferPlan& plan, const KvLayout& sl, const KvLayout& dl) {
    if (plan.runs.empty()) return;
    if (sl.regions == RegionSplit::kOne && dl.regions == RegionSplit::kOne) {
        plan.groups = {{0, 0, 0, plan.runs.size()}};
        return;
    }
    const uint64_t srb = sl.region_bytes(), drb = dl.region_bytes();
    std::vector<ByteRun> out;
    out.reserve(plan.runs.size() + sl.region_count() + dl.region_count());
    for (const ByteRun& r : plan.runs) {
        for (uint64_t done = 0; done < r.length;) {
            auto s = sl.region_of(r.src_offset + done);
            auto d = dl.region_of(r.dst_offset + done);
            uint64_t n = std::min({r.length - done, srb - s.offset, drb - d.offset});
            if (plan.groups.empty() || plan.groups.back().src_region != s.region ||
                plan.groups.back().dst_region != d.region) {
                plan.groups.push_back({s.region, d.region, out.size(), 0});
            }
            out.push_back({s.offset, d.offset, n});
            plan.groups.back().count++;
            done += n;
        }
    }
    plan.runs = std::move(out);
}

Result<TransferPlan> plan_pool_offsets(const TransferSpec& spec);

}  // namespace

Result<SharedHeads> check_transfer(const TransferSpec& spec) {
    const KvLayout& sl = spec.src.layout;
    const KvLayout& dl = spec.dst.layout;
    FERRY_RETURN_IF_ERROR(check_compatible(spec.src, spec.dst));
    if (spec.first_token > spec.end_token) {
        return invalid_argument(
            fmt::format("token range [{}, {}) is reversed", spec.first_token, spec.end_token));
    }
    const uint32_t layer_end = spec.end_layer == 0 ? sl.num_layers : spec.end_layer;
    if (spec.first_layer >= layer_end || layer_end > sl.num_layers) {
        return invalid_argument(fmt::format("layer range [{}, {}) is not inside the {} layers",
                                            spec.first_layer, layer_end, sl.num_layers));
    }
    if (spec.first_token < spec.end_token) {
        FERRY_RETURN_IF_ERROR(check_blocks(
            spec.src_blocks, blocks_for_tokens(spec.end_token, sl.block_size), sl, "producer"));
        FERRY_RETURN_IF_ERROR(check_blocks(
            spec.dst_blocks, blocks_for_tokens(spec.end_token, dl.block_size), dl, "consumer"));
    }
    // Heads both ranks hold, in each side's local numbering.
    const uint32_t lo = std::max(spec.src.first_head(), spec.dst.first_head());
    const uint32_t hi =
        std::min(spec.src.first_head() + sl.num_kv_heads, spec.dst.first_head() + dl.num_kv_heads);
    if (lo >= hi) return SharedHeads{};
    return SharedHeads{hi - lo, lo - spec.src.first_head(), lo - spec.dst.first_head()};
}

Result<TransferPlan> plan_transfer(const TransferSpec& spec) {
    FERRY_ASSIGN_OR_RETURN(TransferPlan plan, plan_pool_offsets(spec));
    cut_at_regions(plan, spec.src.layout, spec.dst.layout);
    return plan;
}

namespace {

Result<TransferPlan> plan_pool_offsets(const TransferSpec& spec) {
    const KvLayout& sl = spec.src.layout;
    const KvLayout& dl = spec.dst.layout;
    FERRY_ASSIGN_OR_RETURN(const SharedHeads shared, check_transfer(spec));
    const uint32_t layer_end = spec.end_layer == 0 ? sl.num_layers : spec.end_layer;
    TransferPlan plan;
    if (spec.first_token == spec.end_token || shared.count == 0) return plan;
    const uint32_t heads = shared.count;
    const uint32_t src_h0 = shared.src_first;
    const uint32_t dst_h0 = shared.dst_first;
    uint64_t hb = sl.head_bytes();
    bool all_heads = heads == sl.num_kv_heads && heads == dl.num_kv_heads;

    // Token spans inside which neither side crosses a block boundary.
    std::vector<Span> spans;
    for (uint32_t t = spec.first_token; t < spec.end_token;) {
        Span s{spec.src_blocks[t / sl.block_size], t % sl.block_size,
               spec.dst_blocks[t / dl.block_size], t % dl.block_size, 0};
        s.tokens =
            std::min({sl.block_size - s.src_slot, dl.block_size - s.dst_slot, spec.end_token - t});
        spans.push_back(s);
        t += s.tokens;
    }

    // Runs are emitted into `out`; for layouts whose layers are outermost the spans are walked
    // for layer 0 only (into `first`), see below.
    TransferPlan first;
    const bool block_major =
        sl.placement == KvPlacement::kBlockMajor && dl.placement == KvPlacement::kBlockMajor;
    Coalescer out(block_major ? &plan : &first);
    auto emit_span = [&](uint32_t layer, KvPart part, const Span& s) {
        auto so = [&](uint32_t slot, uint32_t h) {
            return sl.offset(layer, part, s.src_block, slot, h);
        };
        auto dof = [&](uint32_t slot, uint32_t h) {
            return dl.offset(layer, part, s.dst_block, slot, h);
        };
        if (part == KvPart::kK && (sl.k_transposed() || dl.k_transposed())) {
            // A transposed K (head-joint-kt) keeps a head's tokens of one dim together: runs of
            // the span's tokens per (head, dim) when both sides are transposed (one run per
            // head when whole blocks of one size move), else one element at a time.
            const uint32_t es = sl.elem_size;
            auto se = [&](uint32_t slot, uint32_t h, uint32_t d) {
                return sl.elem_offset(layer, part, s.src_block, slot, h, d);
            };
            auto de = [&](uint32_t slot, uint32_t h, uint32_t d) {
                return dl.elem_offset(layer, part, s.dst_block, slot, h, d);
            };
            const bool both = sl.k_transposed() && dl.k_transposed();
            for (uint32_t h = 0; h < heads; ++h) {
                for (uint32_t d = 0; d < sl.head_dim; ++d) {
                    if (both) {
                        out.add(se(s.src_slot, src_h0 + h, d), de(s.dst_slot, dst_h0 + h, d),
                                uint64_t{s.tokens} * es);
                        continue;
                    }
                    for (uint32_t i = 0; i < s.tokens; ++i) {
                        out.add(se(s.src_slot + i, src_h0 + h, d),
                                de(s.dst_slot + i, dst_h0 + h, d), es);
                    }
                }
            }
            return;
        }
        if (sl.order == BlockOrder::kNHD && dl.order == BlockOrder::kNHD) {
            if (all_heads) {
                out.add(so(s.src_slot, 0), dof(s.dst_slot, 0), s.tokens * sl.token_bytes());
                return;
            }
            for (uint32_t i = 0; i < s.tokens; ++i) {
                out.add(so(s.src_slot + i, src_h0), dof(s.dst_slot + i, dst_h0), heads * hb);
            }
        } else if (sl.order == BlockOrder::kHND && dl.order == BlockOrder::kHND) {
            for (uint32_t h = 0; h < heads; ++h) {
                out.add(so(s.src_slot, src_h0 + h), dof(s.dst_slot, dst_h0 + h), s.tokens * hb);
            }
        } else {
            // Orders differ: only one head of one token is contiguous on both sides.
            for (uint32_t i = 0; i < s.tokens; ++i) {
                for (uint32_t h = 0; h < heads; ++h) {
                    out.add(so(s.src_slot + i, src_h0 + h), dof(s.dst_slot + i, dst_h0 + h), hb);
                }
            }
        }
    };

    // Emission order decides what can coalesce: with K and V side by side on both sides, a
    // block's K and V are emitted back to back; otherwise a layer's K blocks run, then its V.
    // Block-major on both sides: a span's layers are adjacent, so walking spans outermost
    // makes a whole block (every layer, K and V) one run.
    bool joint = sl.placement == KvPlacement::kJoint && dl.placement == KvPlacement::kJoint;
    if (block_major) {
        for (const Span& s : spans) {
            for (uint32_t layer = spec.first_layer; layer < layer_end; ++layer) {
                emit_span(layer, KvPart::kK, s);
                emit_span(layer, KvPart::kV, s);
            }
        }
        return plan;
    }
    if (joint) {
        for (const Span& s : spans) {
            emit_span(0, KvPart::kK, s);
            emit_span(0, KvPart::kV, s);
        }
    } else {
        for (KvPart part : {KvPart::kK, KvPart::kV}) {
            for (const Span& s : spans) emit_span(0, part, s);
        }
    }
    // Offsets are linear in the layer on both sides, so every layer's runs are layer 0's
    // shifted by a constant per side: the spans are walked once, not once per layer (a 16k-token
    // plan of 64 layers took 1.8 ms, longer than its copy over NVLink, 2026-12-01). The shifted
    // runs still go through the coalescer, which joins a layer's last run to the next one's
    // first where they touch.
    plan.runs.reserve(first.runs.size() * (layer_end - spec.first_layer));
    Coalescer all(&plan);
    for (uint32_t layer = spec.first_layer; layer < layer_end; ++layer) {
        const uint64_t ds = sl.slab_offset(layer, KvPart::kK, 0) - sl.slab_offset(0, KvPart::kK, 0);
        const uint64_t dd = dl.slab_offset(layer, KvPart::kK, 0) - dl.slab_offset(0, KvPart::kK, 0);
        for (const ByteRun& r : first.runs) all.add(r.src_offset + ds, r.dst_offset + dd, r.length);
    }
    return plan;
}

}  // namespace
}  // namespace ferry::kv
