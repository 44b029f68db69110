#include "ferry/moe/cpu_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "ferry/moe/numerics.h"

namespace ferry::moe {
namespace {

const char* phase_call(int phase) {
    static const char* names[] = {"combine_recv (or nothing yet)", "dispatch_send", "dispatch_recv",
                                  "combine_send", "a failed call"};
    return names[phase];
}

// A NaN or infinite weight turned every output row it touched into NaN without a word. All
// tokens x top-k weights are checked, those of -1 entries too: it costs one pass over a few
// thousand floats, and garbage there is a bug in the caller's router as well.
Status check_finite_weights(const char* call, std::span<const float> weights, uint32_t k) {
    for (size_t i = 0; i < weights.size(); ++i) {
        if (!std::isfinite(weights[i]))
            return invalid_argument(
                fmt::format("{}: weights[{}, {}] is {}; combine weights must be finite numbers",
                            call, i / k, i % k, weights[i]));
    }
    return ok_status();
}

}  // namespace

CpuBackend::CpuBackend(const AllToAllConfig& cfg, Transport* transport, Duration timeout)
    : cfg_(cfg),
      tr_(transport),
      timeout_(timeout),
      row_(RowFormat::of(cfg)),
      counts_(CountsFormat::of(cfg)),
      sizes_(BufferSizes::of(cfg)),
      hash32_(static_cast<uint32_t>(cfg.hash())) {}

Status CpuBackend::expect_phase(Phase want, const char* call) {
    if (phase_ == Phase::kBroken)
        return broken_.with_context(
            fmt::format("{} refused: an earlier call failed and peers' buffers may be in an "
                        "unknown state; recreate the all-to-all",
                        call));
    if (phase_ != want)
        return invalid_argument(
            fmt::format("{} called out of order: the last call was {}; the order per layer is "
                        "dispatch_send, dispatch_recv, combine_send, combine_recv",
                        call, phase_call(static_cast<int>(phase_))));
    return ok_status();
}

Status CpuBackend::fail(Status s) {
    phase_ = Phase::kBroken;
    broken_ = s;
    return s;
}

Status CpuBackend::dispatch_send(const DispatchInput& in) {
    FERRY_RETURN_IF_ERROR(expect_phase(Phase::kIdle, "dispatch_send"));
    const uint32_t n = in.num_tokens, k = cfg_.experts_per_token, w = cfg_.world_size;
    if (in.x.size() < size_t{n} * cfg_.payload_bytes())
        return invalid_argument(
            fmt::format("dispatch_send: x holds {} bytes; {} tokens of {} "
                        "bytes need {}",
                        in.x.size(), n, cfg_.payload_bytes(), size_t{n} * cfg_.payload_bytes()));
    if (in.x_scale.size() < size_t{n} * cfg_.scales_per_token())
        return invalid_argument(
            fmt::format("dispatch_send: x_scale holds {} floats; {} tokens "
                        "need {} (one per {} channels)",
                        in.x_scale.size(), n, size_t{n} * cfg_.scales_per_token(), kScaleBlock));
    if (in.weights.size() < size_t{n} * k)
        return invalid_argument(fmt::format("dispatch_send: weights hold {} floats; need {}",
                                            in.weights.size(), size_t{n} * k));
    FERRY_RETURN_IF_ERROR(
        check_finite_weights("dispatch_send", in.weights.first(size_t{n} * k), k));
    FERRY_ASSIGN_OR_RETURN(plan_, plan_send(cfg_, in.indices, n));
    weights_.assign(in.weights.begin(), in.weights.begin() + size_t{n} * k);
    ++seq_;
    TimePoint deadline = deadline_after(timeout_);
    if (Status s = tr_->flush(deadline); !s.ok()) return fail(s.with_context("dispatch_send"));

    // Pack one row per (token, destination rank).
    uint8_t* stage = tr_->stage(Region::kDispatch).data();
    const uint32_t staged = plan_.row_begin[w];
    // Rows so far that chose each expert, and hits so far to the current destination.
    std::vector<uint32_t> placed(cfg_.num_experts, 0);
    uint32_t hits_before = 0;
    for (uint32_t j = 0, d = 0; j < staged; ++j) {
        while (j >= plan_.row_begin[d + 1]) {
            ++d;
            hits_before = 0;
        }
        uint32_t t = plan_.row_token[j];
        uint8_t* row = stage + size_t{j} * row_.row_bytes;
        RowHeader h{t, seq_};
        std::memcpy(row, &h, sizeof(h));
        auto* le = reinterpret_cast<int16_t*>(row + sizeof(RowHeader));
        auto* place = reinterpret_cast<uint32_t*>(row + row_.place_offset);
        auto* weight = reinterpret_cast<float*>(row + row_.weight_offset);
        const uint32_t hit_base = hits_before;
        for (uint32_t kk = 0; kk < k; ++kk) {
            int32_t e = in.indices[size_t{t} * k + kk];
            bool here = e >= 0 && cfg_.expert_owner(static_cast<uint32_t>(e)) == d;
            le[kk] = here ? static_cast<int16_t>(cfg_.local_expert(static_cast<uint32_t>(e)))
                          : int16_t{-1};
            place[kk] = here ? placed[static_cast<uint32_t>(e)]++ : 0;
            weight[kk] = here ? in.weights[size_t{t} * k + kk] : 0.0f;
            hits_before += here;
        }
        std::memcpy(row + row_.hit_base_offset, &hit_base, sizeof(hit_base));
        std::memcpy(row + row_.payload_offset, in.x.data() + size_t{t} * cfg_.payload_bytes(),
                    cfg_.payload_bytes());
        if (cfg_.scale_bytes())
            std::memcpy(row + row_.scale_offset,
                        in.x_scale.data() + size_t{t} * cfg_.scales_per_token(),
                        cfg_.scale_bytes());
    }

    // Counts to every rank, then the first rows straight into our private slots there: a
    // decode-sized batch is fully on its way before any count has come back.
    uint8_t* cstage = tr_->stage(Region::kCounts).data();
    std::vector<uint32_t> hits_le(cfg_.num_local_experts());
    const uint32_t p = cfg_.private_slots_per_sender;
    for (uint32_t i = 0; i < w; ++i) {
        uint32_t d = (cfg_.rank + i) % w;
        auto* msg = reinterpret_cast<uint32_t*>(cstage + d * counts_.bytes);
        msg[CountsFormat::kSeq] = seq_;
        msg[CountsFormat::kConfigHash] = hash32_;
        msg[CountsFormat::kCombineBase] = plan_.combine_begin[d];
        msg[CountsFormat::kHits] = plan_.hits_to[d];
        for (uint32_t r = 0; r < w; ++r) msg[CountsFormat::kRowsTo + r] = plan_.rows_to[r];
        uint32_t first = d * cfg_.num_local_experts();
        for (uint32_t e = 0; e < cfg_.num_local_experts(); ++e)
            msg[counts_.hits_per_expert + e] = plan_.expert_counts[first + e];
        Status s = tr_->put(d, Region::kCounts, uint64_t{cfg_.rank} * counts_.bytes,
                            uint64_t{d} * counts_.bytes, counts_.bytes);
        if (!s.ok()) return fail(s.with_context("dispatch_send: counts"));
        uint32_t rows = std::min(plan_.rows_to[d], p);
        s = tr_->put(d, Region::kDispatch, uint64_t{cfg_.rank} * p * row_.row_bytes,
                     uint64_t{plan_.row_begin[d]} * row_.row_bytes,
                     uint64_t{rows} * row_.row_bytes);
        if (!s.ok()) return fail(s.with_context("dispatch_send: private slots"));
    }

    if (Status s = read_counts(); !s.ok()) return fail(s.with_context("dispatch_send"));

    // The rest: one contiguous run per peer, at the offset every rank derives from the same
    // counts matrix.
    std::vector<uint32_t> column(w);
    for (uint32_t i = 0; i < w; ++i) {
        uint32_t d = (cfg_.rank + i) % w;
        for (uint32_t s = 0; s < w; ++s) column[s] = rows_[size_t{s} * w + d];
        RecvLayout layout(cfg_, column);
        uint32_t rows = layout.overflow_rows(cfg_.rank);
        Status s =
            tr_->put(d, Region::kDispatch, layout.overflow_row(cfg_.rank) * row_.row_bytes,
                     uint64_t{plan_.row_begin[d] + layout.private_rows(cfg_.rank)} * row_.row_bytes,
                     uint64_t{rows} * row_.row_bytes);
        if (!s.ok()) return fail(s.with_context("dispatch_send: overflow rows"));
    }
    bytes_.dispatch = uint64_t{staged} * row_.row_bytes;
    phase_ = Phase::kDispatchSent;
    return ok_status();
}

Status CpuBackend::read_counts() {
    const uint32_t w = cfg_.world_size, nl = cfg_.num_local_experts();
    TimePoint deadline = deadline_after(timeout_);
    rows_.assign(size_t{w} * w, 0);
    hits_from_.assign(w, 0);
    combine_base_.assign(w, 0);
    expert_hits_.assign(nl, 0);
    const uint8_t* recv = tr_->recv(Region::kCounts).data();
    const uint64_t combine_slots = uint64_t{cfg_.max_tokens_per_rank} * cfg_.experts_per_token;
    for (uint32_t i = 0; i < w; ++i) {
        uint32_t s = (cfg_.rank + w - i) % w;
        FERRY_RETURN_IF_ERROR(
            tr_->wait(Region::kCounts, s, tr_->arrivals_for(s, counts_.bytes), deadline));
        const auto* msg = reinterpret_cast<const uint32_t*>(recv + size_t{s} * counts_.bytes);
        if (msg[CountsFormat::kConfigHash] != hash32_)
            return invalid_argument(fmt::format(
                "rank {} runs a different AllToAllConfig (hash {:08x}, ours {:08x}): every "
                "rank must use the same sizes, dtype, experts, world and slots",
                s, msg[CountsFormat::kConfigHash], hash32_));
        if (msg[CountsFormat::kSeq] != seq_)
            return protocol_error(
                fmt::format("counts from rank {} are for call {}, this rank "
                            "is at call {}",
                            s, msg[CountsFormat::kSeq], seq_));
        uint32_t hits = msg[CountsFormat::kHits], sum = 0;
        for (uint32_t d = 0; d < w; ++d) {
            uint32_t r = msg[CountsFormat::kRowsTo + d];
            if (r > cfg_.max_tokens_per_rank)
                return protocol_error(
                    fmt::format("rank {} claims {} rows for rank {}, above "
                                "max_tokens_per_rank {}",
                                s, r, d, cfg_.max_tokens_per_rank));
            rows_[size_t{s} * w + d] = r;
        }
        for (uint32_t e = 0; e < nl; ++e) {
            expert_hits_[e] += msg[counts_.hits_per_expert + e];
            sum += msg[counts_.hits_per_expert + e];
        }
        uint32_t my_rows = rows_[size_t{s} * w + cfg_.rank];
        // Our results for s: a row per hit, or per row with per-rank partials.
        uint32_t results = cfg_.combine == CombineMode::kPerRank ? my_rows : hits;
        if (sum != hits || hits < my_rows ||
            uint64_t{msg[CountsFormat::kCombineBase]} + results > combine_slots)
            return protocol_error(fmt::format(
                "inconsistent counts from rank {}: {} rows, {} hits, per-expert sum {}, "
                "combine base {}",
                s, my_rows, hits, sum, msg[CountsFormat::kCombineBase]));
        hits_from_[s] = hits;
        combine_base_[s] = msg[CountsFormat::kCombineBase];
    }
    return ok_status();
}

Status CpuBackend::check_row_header(uint32_t s, uint32_t i, const uint8_t* row) const {
    RowHeader h;
    std::memcpy(&h, row, sizeof(h));
    if (h.seq != seq_ || h.token >= cfg_.max_tokens_per_rank)
        return protocol_error(
            fmt::format("row {} from rank {} has call {} token {}; expected "
                        "call {} and token below {}",
                        i, s, h.seq, h.token, seq_, cfg_.max_tokens_per_rank));
    return ok_status();
}

Status CpuBackend::dispatch_recv(const ExpertBatch& out) {
    FERRY_RETURN_IF_ERROR(expect_phase(Phase::kDispatchSent, "dispatch_recv"));
    const uint32_t w = cfg_.world_size, nl = cfg_.num_local_experts(), k = cfg_.experts_per_token;
    ExpertLayout groups = expert_layout(cfg_, expert_hits_);
    const uint32_t rows = groups.total_rows();
    const size_t spt = cfg_.scales_per_token(), pb = cfg_.payload_bytes();
    if (out.counts.size() < nl || out.offsets.size() < nl + 1 || out.x.size() < rows * pb ||
        out.x_scale.size() < rows * spt || (!out.sources.empty() && out.sources.size() < rows))
        return invalid_argument(fmt::format(
            "dispatch_recv: this call produces {} rows for {} local experts; the batch holds "
            "{} bytes of x, {} scales, {} counts, {} offsets, {} sources (size it with "
            "max_expert_rows)",
            rows, nl, out.x.size(), out.x_scale.size(), out.counts.size(), out.offsets.size(),
            out.sources.size()));

    std::vector<uint32_t> column(w);
    for (uint32_t s = 0; s < w; ++s) column[s] = rows_[size_t{s} * w + cfg_.rank];
    RecvLayout layout(cfg_, column);
    TimePoint deadline = deadline_after(timeout_);
    // Two puts from every sender: its private slots and its overflow run (either may be
    // empty, then it is a bare signal).
    for (uint32_t i = 0; i < w; ++i) {
        uint32_t s = (cfg_.rank + w - i) % w;
        uint64_t n = tr_->arrivals_for(s, uint64_t{layout.private_rows(s)} * row_.row_bytes) +
                     tr_->arrivals_for(s, uint64_t{layout.overflow_rows(s)} * row_.row_bytes);
        if (Status st = tr_->wait(Region::kDispatch, s, n, deadline); !st.ok())
            return fail(st.with_context("dispatch_recv"));
    }
    const bool per_rank = cfg_.combine == CombineMode::kPerRank;
    stage_begin_.assign(w + 1, 0);
    for (uint32_t s = 0; s < w; ++s)
        stage_begin_[s + 1] = stage_begin_[s] + (per_rank ? layout.rows_from(s) : hits_from_[s]);
    out_to_stage_.assign(rows, -1);
    part_begin_.assign(1, 0);
    part_hits_.clear();
    std::vector<uint32_t> fill(nl, 0), fill_from(nl);
    const uint8_t* recv = tr_->recv(Region::kDispatch).data();
    for (uint32_t s = 0; s < w; ++s) {
        // Hits of s placed so far: the position in s's run for per-hit results.
        uint64_t stage_pos = 0;
        std::fill(fill_from.begin(), fill_from.end(), 0);
        for (uint32_t i = 0; i < layout.rows_from(s); ++i) {
            const uint8_t* row = recv + layout.row_index(s, i) * row_.row_bytes;
            if (Status st = check_row_header(s, i, row); !st.ok()) return fail(st);
            uint32_t token, hit_base;
            std::memcpy(&token, row, sizeof(token));
            std::memcpy(&hit_base, row + row_.hit_base_offset, sizeof(hit_base));
            const auto* le = reinterpret_cast<const int16_t*>(row + sizeof(RowHeader));
            const auto* place = reinterpret_cast<const uint32_t*>(row + row_.place_offset);
            // This backend groups rows by reading them in order; the places and hit base
            // the header carries for receivers that place rows in parallel must agree.
            if (hit_base != stage_pos)
                return fail(protocol_error(fmt::format(
                    "row {} from rank {} (token {}) says {} hits come before it; its rank's "
                    "earlier rows carry {}",
                    i, s, token, hit_base, stage_pos)));
            const auto* weight = reinterpret_cast<const float*>(row + row_.weight_offset);
            for (uint32_t kk = 0; kk < k; ++kk) {
                if (le[kk] < 0) continue;
                uint32_t e = static_cast<uint32_t>(le[kk]);
                if (e >= nl || fill[e] >= groups.counts[e] || stage_pos >= hits_from_[s])
                    return fail(protocol_error(fmt::format(
                        "row {} from rank {} (token {}) routes to local expert {} beyond what "
                        "the counts announced",
                        i, s, token, le[kk])));
                if (place[kk] != fill_from[e]++)
                    return fail(protocol_error(fmt::format(
                        "row {} from rank {} (token {}) claims place {} among its rank's rows "
                        "for local expert {}; it is row {} of them",
                        i, s, token, place[kk], e, fill_from[e] - 1)));
                uint32_t o = groups.offsets[e] + fill[e]++;
                std::memcpy(out.x.data() + o * pb, row + row_.payload_offset, pb);
                if (spt)
                    std::memcpy(out.x_scale.data() + o * spt, row + row_.scale_offset,
                                cfg_.scale_bytes());
                if (!out.sources.empty()) out.sources[o] = RowSource{s, token, kk};
                if (per_rank)
                    part_hits_.push_back({o, weight[kk]});
                else
                    out_to_stage_[o] = static_cast<int64_t>(stage_begin_[s] + stage_pos);
                ++stage_pos;
            }
            if (per_rank) part_begin_.push_back(static_cast<uint32_t>(part_hits_.size()));
        }
        if (stage_pos != hits_from_[s])
            return fail(
                protocol_error(fmt::format("rank {} announced {} hits but its rows "
                                           "carry {}",
                                           s, hits_from_[s], stage_pos)));
    }
    for (uint32_t e = 0; e < nl; ++e) {
        // Zero padding so a grouped GEMM over whole groups reads defined values.
        uint32_t pad_begin = groups.offsets[e] + groups.counts[e];
        uint32_t pad_end = groups.offsets[e + 1];
        if (pad_end > pad_begin) {
            std::memset(out.x.data() + pad_begin * pb, 0, (pad_end - pad_begin) * pb);
            if (spt)
                std::fill(out.x_scale.begin() + pad_begin * spt,
                          out.x_scale.begin() + pad_end * spt, 0.0f);
            if (!out.sources.empty())
                std::fill(out.sources.begin() + pad_begin, out.sources.begin() + pad_end,
                          RowSource{});
        }
        out.counts[e] = groups.counts[e];
        out.offsets[e] = groups.offsets[e];
    }
    out.offsets[nl] = rows;
    out_rows_ = rows;
    phase_ = Phase::kDispatchReceived;
    return ok_status();
}

Status CpuBackend::combine_send(std::span<const uint16_t> expert_out) {
    FERRY_RETURN_IF_ERROR(expect_phase(Phase::kDispatchReceived, "combine_send"));
    const uint32_t w = cfg_.world_size;
    const size_t h = cfg_.hidden, crow = sizes_.combine_row_bytes;
    if (expert_out.size() < size_t{out_rows_} * h)
        return invalid_argument(
            fmt::format("combine_send: expert_out holds {} values; {} rows "
                        "of {} need {}",
                        expert_out.size(), out_rows_, h, size_t{out_rows_} * h));
    TimePoint deadline = deadline_after(timeout_);
    if (Status s = tr_->flush(deadline); !s.ok()) return fail(s.with_context("combine_send"));
    uint8_t* stage = tr_->stage(Region::kCombine).data();
    if (cfg_.combine == CombineMode::kPerRank) {
        // Per received row: weight * output summed over its hits in top-k order (fp32, the
        // same separately rounded steps as combine_recv), rounded once to bf16.
        std::vector<float> acc(h);
        for (size_t r = 0; r + 1 < part_begin_.size(); ++r) {
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (uint32_t i = part_begin_[r]; i < part_begin_[r + 1]; ++i) {
                const uint16_t* y = expert_out.data() + size_t{part_hits_[i].row} * h;
                const float wt = part_hits_[i].weight;
                for (size_t c = 0; c < h; ++c) acc[c] += wt * bf16_to_float(y[c]);
            }
            auto* dst = reinterpret_cast<uint16_t*>(stage + r * crow);
            for (size_t c = 0; c < h; ++c) dst[c] = float_to_bf16(acc[c]);
        }
    } else {
        for (uint32_t o = 0; o < out_rows_; ++o) {
            if (out_to_stage_[o] < 0) continue;
            std::memcpy(stage + static_cast<size_t>(out_to_stage_[o]) * crow,
                        expert_out.data() + size_t{o} * h, crow);
        }
    }
    for (uint32_t i = 0; i < w; ++i) {
        uint32_t s = (cfg_.rank + i) % w;
        Status st =
            tr_->put(s, Region::kCombine, uint64_t{combine_base_[s]} * crow, stage_begin_[s] * crow,
                     (stage_begin_[s + 1] - stage_begin_[s]) * crow);
        if (!st.ok()) return fail(st.with_context("combine_send"));
    }
    bytes_.combine = stage_begin_[w] * crow;
    phase_ = Phase::kCombineSent;
    return ok_status();
}

template <typename Sink>
Status CpuBackend::reduce(Sink sink) {
    FERRY_RETURN_IF_ERROR(expect_phase(Phase::kCombineSent, "combine_recv"));
    const uint32_t w = cfg_.world_size, k = cfg_.experts_per_token, h = cfg_.hidden;
    const bool per_rank = cfg_.combine == CombineMode::kPerRank;
    TimePoint deadline = deadline_after(timeout_);
    for (uint32_t i = 0; i < w; ++i) {
        uint32_t d = (cfg_.rank + w - i) % w;
        const uint32_t results = per_rank ? plan_.rows_to[d] : plan_.hits_to[d];
        uint64_t n = tr_->arrivals_for(d, uint64_t{results} * sizes_.combine_row_bytes);
        if (Status st = tr_->wait(Region::kCombine, d, n, deadline); !st.ok())
            return fail(st.with_context("combine_recv"));
    }
    const uint8_t* recv = tr_->recv(Region::kCombine).data();
    std::vector<float> acc(h);
    for (uint32_t t = 0; t < plan_.num_tokens; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (uint32_t kk = 0; kk < k; ++kk) {
            int32_t slot = plan_.combine_slot[size_t{t} * k + kk];
            if (slot < 0) continue;
            // Per-rank partials are weighted already: 1 * x is x exactly.
            float wt = per_rank ? 1.0f : weights_[size_t{t} * k + kk];
            const auto* src = reinterpret_cast<const uint16_t*>(
                recv + static_cast<size_t>(slot) * sizes_.combine_row_bytes);
            for (uint32_t c = 0; c < h; ++c) acc[c] += wt * bf16_to_float(src[c]);
        }
        sink(t, acc.data());
    }
    phase_ = Phase::kIdle;
    return ok_status();
}

Status CpuBackend::set_combine_weights(std::span<const float> weights) {
    if (phase_ == Phase::kIdle || phase_ == Phase::kBroken)
        return invalid_argument(
            "set_combine_weights: no dispatch in flight; call it between dispatch_send and "
            "combine_recv");
    if (cfg_.combine != CombineMode::kPerHit)
        return invalid_argument(
            "set_combine_weights: per-rank combine weights the partials at the expert's rank "
            "with the dispatched weights; use CombineMode::kPerHit");
    const size_t need = size_t{plan_.num_tokens} * cfg_.experts_per_token;
    if (weights.size() < need)
        return invalid_argument(
            fmt::format("set_combine_weights: {} floats given; {} tokens x "
                        "top-{} need {}",
                        weights.size(), plan_.num_tokens, cfg_.experts_per_token, need));
    FERRY_RETURN_IF_ERROR(
        check_finite_weights("set_combine_weights", weights.first(need), cfg_.experts_per_token));
    weights_.assign(weights.begin(), weights.begin() + need);
    return ok_status();
}

Status CpuBackend::check_out_size(size_t have) const {
    size_t need = size_t{plan_.num_tokens} * cfg_.hidden;
    if (have >= need) return ok_status();
    return invalid_argument(fmt::format("combine_recv: out holds {} values; {} tokens need {}",
                                        have, plan_.num_tokens, need));
}

Status CpuBackend::combine_recv(std::span<float> out) {
    FERRY_RETURN_IF_ERROR(check_out_size(out.size()));
    const size_t h = cfg_.hidden;
    return reduce([&](uint32_t t, const float* acc) {
        std::memcpy(out.data() + t * h, acc, h * sizeof(float));
    });
}

Status CpuBackend::combine_recv_bf16(std::span<uint16_t> out) {
    FERRY_RETURN_IF_ERROR(check_out_size(out.size()));
    const size_t h = cfg_.hidden;
    return reduce([&](uint32_t t, const float* acc) {
        for (size_t c = 0; c < h; ++c) out[t * h + c] = float_to_bf16(acc[c]);
    });
}

}  // namespace ferry::moe
