// Inputs and checks shared by the MoE tests (single-process reference and multi-process).
//
// Every 128-channel block of every token holds one value that encodes (source rank, token):
// any received row can be traced back, and the blocks are constant, so the fp8 path must
// reproduce them exactly.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ferry/moe/config.h"
#include "ferry/moe/cpu_backend.h"
#include "ferry/moe/numerics.h"
#include "ferry/moe/plan.h"

namespace ferry::moe::testing {

inline constexpr uint32_t kTokenIdSpan = 256;  // tokens per rank the encoding can name

// bf16 value of block b of token t from rank s: mantissa = low 7 bits of the id, exponent
// from the high bits, sign and a shift from the block; never below the fp8 amax floor.
inline uint16_t encode_value(uint32_t s, uint32_t t, uint32_t b) {
    uint32_t id = s * kTokenIdSpan + t;
    uint32_t exp = 127 - 8 + (id >> 7) + (b % 4);
    uint32_t sign = (b & 1) ? 0x8000 : 0;
    return static_cast<uint16_t>(sign | (exp << 7) | (id & 127));
}

// The (rank, token) a block value encodes, or -1 when it is not a valid encoding for b.
inline int64_t decode_value(uint16_t v, uint32_t b) {
    if (((v & 0x8000) != 0) != ((b & 1) != 0)) return -1;
    uint32_t exp = (v >> 7) & 0xff;
    if (exp < 127 - 8 + (b % 4)) return -1;
    uint32_t id = ((exp - (127 - 8) - (b % 4)) << 7) | (v & 127);
    return id;
}

struct RankInput {
    uint32_t num_tokens = 0;
    std::vector<uint16_t> x;       // bf16
    std::vector<uint8_t> payload;  // what is dispatched: bf16 bytes or fp8
    std::vector<float> scales;     // fp8 only
    std::vector<int32_t> indices;
    std::vector<float> weights;  // sum to 1 over a token's valid experts

    DispatchInput input() const {
        DispatchInput in;
        in.num_tokens = num_tokens;
        in.x = payload;
        in.x_scale = scales;
        in.indices = indices;
        in.weights = weights;
        return in;
    }
};

enum class Routing { kUniform, kSkewed };

// Top-k distinct experts per token with probability `hole` of -1 per choice. kSkewed draws
// 90% of choices from rank 0's experts (when it has enough of them).
inline RankInput make_input(const AllToAllConfig& cfg, uint32_t rank, uint32_t num_tokens,
                            Routing routing, double hole, std::mt19937_64& rng) {
    RankInput in;
    const uint32_t k = cfg.experts_per_token, h = cfg.hidden, nl = cfg.num_local_experts();
    in.num_tokens = num_tokens;
    in.x.resize(size_t{num_tokens} * h);
    for (uint32_t t = 0; t < num_tokens; ++t)
        for (uint32_t c = 0; c < h; ++c) in.x[size_t{t} * h + c] = encode_value(rank, t, c / 128);
    in.indices.assign(size_t{num_tokens} * k, -1);
    in.weights.assign(size_t{num_tokens} * k, 0.0f);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    for (uint32_t t = 0; t < num_tokens; ++t) {
        std::vector<uint32_t> chosen;
        while (chosen.size() < k) {
            uint32_t e;
            if (routing == Routing::kSkewed && nl >= k && u(rng) < 0.9) {
                e = static_cast<uint32_t>(rng() % nl);
            } else {
                e = static_cast<uint32_t>(rng() % cfg.num_experts);
            }
            if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
        }
        float sum = 0.0f;
        for (uint32_t j = 0; j < k; ++j) {
            if (u(rng) < hole) continue;
            in.indices[size_t{t} * k + j] = static_cast<int32_t>(chosen[j]);
            float w = 0.1f + static_cast<float>(u(rng));
            in.weights[size_t{t} * k + j] = w;
            sum += w;
        }
        for (uint32_t j = 0; j < k; ++j) in.weights[size_t{t} * k + j] /= sum > 0 ? sum : 1.0f;
    }
    if (cfg.dtype == DType::kBf16) {
        in.payload.resize(in.x.size() * 2);
        std::memcpy(in.payload.data(), in.x.data(), in.payload.size());
    } else {
        in.payload.resize(in.x.size());
        in.scales.resize(in.x.size() / kScaleBlock);
        (void)quantize_fp8_bf16(in.x, num_tokens, h, in.payload, in.scales);
    }
    return in;
}

// Caller-side storage of an ExpertBatch.
struct BatchStorage {
    std::vector<uint8_t> x;
    std::vector<float> scales;
    std::vector<uint32_t> counts, offsets;
    std::vector<RowSource> sources;
    explicit BatchStorage(const AllToAllConfig& cfg)
        : x(max_expert_rows(cfg) * cfg.payload_bytes()),
          scales(max_expert_rows(cfg) * cfg.scales_per_token()),
          counts(cfg.num_local_experts()),
          offsets(cfg.num_local_experts() + 1),
          sources(max_expert_rows(cfg)) {}
    ExpertBatch batch() { return ExpertBatch{x, scales, counts, offsets, sources}; }
};

// Row o of the batch as bf16 (dequantized for fp8).
inline std::vector<uint16_t> row_bf16(const AllToAllConfig& cfg, const BatchStorage& b,
                                      uint32_t o) {
    std::vector<uint16_t> r(cfg.hidden);
    if (cfg.dtype == DType::kBf16) {
        std::memcpy(r.data(), b.x.data() + size_t{o} * cfg.payload_bytes(), cfg.payload_bytes());
    } else {
        (void)dequantize_fp8_to_bf16(
            std::span<const uint8_t>(b.x.data() + size_t{o} * cfg.hidden, cfg.hidden),
            std::span<const float>(b.scales.data() + size_t{o} * cfg.scales_per_token(),
                                   cfg.scales_per_token()),
            1, cfg.hidden, r);
    }
    return r;
}

// What an "expert" computes in the tests: scale * x in bf16, with scale 2 for the plain
// case or an expert-dependent one to catch rows returned to the wrong (token, expert) slot.
inline float expert_factor(uint32_t global_expert, bool per_expert) {
    return per_expert ? 1.0f + static_cast<float>(global_expert % 8) / 8.0f : 2.0f;
}

// Checks one rank's dispatch output against every rank's input: per-expert counts equal the
// bincount of the routing, each row decodes to the source its metadata names, and the set
// of rows per expert is the expected set. Returns "" or what is wrong.
inline std::string check_dispatch(const AllToAllConfig& cfg, const std::vector<RankInput>& all,
                                  const BatchStorage& b) {
    const uint32_t nl = cfg.num_local_experts(), k = cfg.experts_per_token;
    for (uint32_t e = 0; e < nl; ++e) {
        uint32_t ge = cfg.rank * nl + e;
        std::set<std::tuple<uint32_t, uint32_t, uint32_t>> expected, got;
        for (uint32_t s = 0; s < all.size(); ++s)
            for (uint32_t t = 0; t < all[s].num_tokens; ++t)
                for (uint32_t j = 0; j < k; ++j)
                    if (all[s].indices[size_t{t} * k + j] == static_cast<int32_t>(ge))
                        expected.insert({s, t, j});
        if (b.counts[e] != expected.size())
            return fmt::format("rank {} expert {}: count {} but the routing bincount is {}",
                               cfg.rank, ge, b.counts[e], expected.size());
        if (b.offsets[e] % cfg.group_alignment != 0 ||
            b.offsets[e + 1] < b.offsets[e] + b.counts[e])
            return fmt::format("rank {} expert {}: group [{}, {}) is misaligned or too small",
                               cfg.rank, ge, b.offsets[e], b.offsets[e + 1]);
        for (uint32_t o = b.offsets[e]; o < b.offsets[e + 1]; ++o) {
            std::vector<uint16_t> r = row_bf16(cfg, b, o);
            if (o >= b.offsets[e] + b.counts[e]) {
                if (b.sources[o].rank != RowSource::kPadding ||
                    std::any_of(r.begin(), r.end(), [](uint16_t v) { return v != 0; }))
                    return fmt::format("rank {} expert {}: padding row {} is not zero", cfg.rank,
                                       ge, o);
                continue;
            }
            const RowSource& src = b.sources[o];
            for (uint32_t c = 0; c < cfg.hidden; ++c) {
                int64_t id = decode_value(r[c], c / 128);
                if (id != int64_t{src.rank} * kTokenIdSpan + src.token)
                    return fmt::format(
                        "rank {} expert {} row {} channel {}: value {:04x} "
                        "decodes to id {}, metadata says rank {} token {}",
                        cfg.rank, ge, o, c, r[c], id, src.rank, src.token);
            }
            if (!got.insert({src.rank, src.token, src.k}).second)
                return fmt::format("rank {} expert {}: row from rank {} token {} arrived twice",
                                   cfg.rank, ge, src.rank, src.token);
        }
        if (got != expected)
            return fmt::format(
                "rank {} expert {}: received {} distinct rows, expected {}; "
                "sets differ",
                cfg.rank, ge, got.size(), expected.size());
    }
    return "";
}

// Runs the test "experts" over a dispatch output: bf16 rows, padding left zero.
inline std::vector<uint16_t> run_experts(const AllToAllConfig& cfg, const BatchStorage& b,
                                         bool per_expert) {
    const uint32_t nl = cfg.num_local_experts();
    std::vector<uint16_t> out(size_t{b.offsets[nl]} * cfg.hidden, 0);
    for (uint32_t e = 0; e < nl; ++e) {
        float f = expert_factor(cfg.rank * nl + e, per_expert);
        for (uint32_t o = b.offsets[e]; o < b.offsets[e] + b.counts[e]; ++o) {
            std::vector<uint16_t> r = row_bf16(cfg, b, o);
            for (uint32_t c = 0; c < cfg.hidden; ++c)
                out[size_t{o} * cfg.hidden + c] = float_to_bf16(bf16_to_float(r[c]) * f);
        }
    }
    return out;
}

// Checks combine output of one rank: against an fp32 sum computed here from the source
// tokens (1e-5 relative), and, for factor 2 with weights summing to 1, against 2x within
// bf16 tolerance. CombineMode::kPerRank: the reference is what that mode promises, each
// rank's weighted partial (fp32, top-k order) rounded to bf16, the partials summed in the
// order of each rank's first choice.
// rel_tol: 1e-5 for fp32 output; one bf16 step (2^-8) when the output was rounded to bf16.
inline std::string check_combine(const AllToAllConfig& cfg, const RankInput& in,
                                 std::span<const float> out, bool per_expert,
                                 float rel_tol = 1e-5f) {
    const uint32_t k = cfg.experts_per_token, h = cfg.hidden;
    const bool per_rank = cfg.combine == CombineMode::kPerRank;
    for (uint32_t t = 0; t < in.num_tokens; ++t) {
        bool any = false;
        const int32_t* idx = in.indices.data() + size_t{t} * k;
        const float* wts = in.weights.data() + size_t{t} * k;
        for (uint32_t c = 0; c < h; ++c) {
            float x = bf16_to_float(in.x[size_t{t} * h + c]);
            auto y = [&](int32_t e) {
                return bf16_to_float(
                    float_to_bf16(x * expert_factor(static_cast<uint32_t>(e), per_expert)));
            };
            float ref = 0.0f;
            for (uint32_t j = 0; j < k; ++j) {
                if (idx[j] < 0) continue;
                any = true;
                if (!per_rank) {
                    ref += wts[j] * y(idx[j]);
                    continue;
                }
                const uint32_t d = cfg.expert_owner(static_cast<uint32_t>(idx[j]));
                bool first = true;
                for (uint32_t j0 = 0; j0 < j; ++j0)
                    first = first && !(idx[j0] >= 0 &&
                                       cfg.expert_owner(static_cast<uint32_t>(idx[j0])) == d);
                if (!first) continue;
                float partial = 0.0f;
                for (uint32_t j2 = j; j2 < k; ++j2)
                    if (idx[j2] >= 0 && cfg.expert_owner(static_cast<uint32_t>(idx[j2])) == d)
                        partial += wts[j2] * y(idx[j2]);
                ref += bf16_to_float(float_to_bf16(partial));
            }
            float got = out[size_t{t} * h + c];
            if (std::fabs(got - ref) > rel_tol * std::fabs(ref) + 1e-30f)
                return fmt::format("rank {} token {} channel {}: combine {} vs fp32 reference {}",
                                   cfg.rank, t, c, got, ref);
            if (!per_expert && any && std::fabs(got - 2 * x) > std::fabs(2 * x) / 128)
                return fmt::format(
                    "rank {} token {} channel {}: combine {} is not 2x = {} within "
                    "bf16 tolerance",
                    cfg.rank, t, c, got, 2 * x);
            if (!any && got != 0.0f)
                return fmt::format("rank {} token {}: no expert, but combine gave {}", cfg.rank, t,
                                   got);
        }
    }
    return "";
}

}  // namespace ferry::moe::testing
