// The compute side of the all-to-all as CPU code over host memory: packs rows, runs the
// protocol through a Transport, groups received rows per local expert, and reduces combine
// results. It is the reference the CUDA kernels are checked against.
//
// Calls go in this order, once each per layer: dispatch_send, dispatch_recv, combine_send,
// combine_recv. That order is also what makes buffer reuse safe without an extra barrier:
// a peer can only start writing call N+1 into our buffers after it finished combine_recv of
// call N, which needed our combine_send of call N, which comes after we finished reading
// every buffer of call N. (See docs/MOE.md.)
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/moe/config.h"
#include "ferry/moe/plan.h"
#include "ferry/moe/transport.h"

namespace ferry::moe {

struct DispatchInput {
    uint32_t num_tokens = 0;
    std::span<const uint8_t> x;        // num_tokens rows of payload_bytes (bf16 or fp8 bytes)
    std::span<const float> x_scale;    // num_tokens * hidden/128 scales (fp8 only)
    std::span<const int32_t> indices;  // num_tokens * top-k experts; -1 = no expert
    std::span<const float> weights;    // num_tokens * top-k combine weights
};

// Caller-owned output of dispatch_recv: rows grouped per local expert, each group starting at
// offsets[e] and padded (with zero rows) to the group alignment. Size x and sources for
// max_expert_rows(cfg) rows.
struct ExpertBatch {
    std::span<uint8_t> x;          // rows of payload_bytes
    std::span<float> x_scale;      // rows * hidden/128 (fp8 only)
    std::span<uint32_t> counts;    // [local experts] real rows per expert
    std::span<uint32_t> offsets;   // [local experts + 1] first row of each group
    std::span<RowSource> sources;  // optional: where each row came from
};

// Bytes moved by one rank in one call, per phase (payload as written to peers, self included).
struct PhaseBytes {
    uint64_t dispatch = 0;
    uint64_t combine = 0;
};

class CpuBackend {
  public:
    CpuBackend(const AllToAllConfig& cfg, Transport* transport, Duration timeout);

    const AllToAllConfig& config() const { return cfg_; }

    Status dispatch_send(const DispatchInput& in);
    Status dispatch_recv(const ExpertBatch& out);
    // expert_out: bf16 rows laid out like the ExpertBatch of dispatch_recv (padding rows are
    // ignored).
    Status combine_send(std::span<const uint16_t> expert_out);
    // out: num_tokens * hidden; sum over the token's experts of weight * expert output,
    // accumulated in fp32 (kPerRank: the sum of the ranks' bf16 partials, in the order of
    // each rank's first top-k choice). Tokens with no expert get zeros.
    Status combine_recv(std::span<float> out);
    Status combine_recv_bf16(std::span<uint16_t> out);
    // Replaces the combine weights given to dispatch_send (num_tokens * top-k floats), for
    // callers that only know them at combine time (DeepEP's and pplx-garden's combine take
    // them there). Between dispatch_send and combine_recv; CombineMode::kPerHit only (per-rank
    // partials are weighted at the expert's rank with the dispatched weights).
    Status set_combine_weights(std::span<const float> weights);

    // Per-expert token counts of the last dispatch_send: a bincount of its valid indices.
    const std::vector<uint32_t>& sent_expert_counts() const { return plan_.expert_counts; }
    PhaseBytes last_bytes() const { return bytes_; }
    uint32_t calls() const { return seq_; }

  private:
    enum class Phase { kIdle, kDispatchSent, kDispatchReceived, kCombineSent, kBroken };
    Status expect_phase(Phase want, const char* call);
    Status fail(Status s);
    Status read_counts();
    Status check_out_size(size_t have) const;
    Status check_row_header(uint32_t s, uint32_t i, const uint8_t* row) const;
    template <typename Sink>
    Status reduce(Sink sink);

    AllToAllConfig cfg_;
    Transport* tr_;
    Duration timeout_;
    RowFormat row_;
    CountsFormat counts_;
    BufferSizes sizes_;
    uint32_t hash32_;

    Phase phase_ = Phase::kIdle;
    Status broken_;
    uint32_t seq_ = 0;
    PhaseBytes bytes_;

    // Sender state of the current call.
    SendPlan plan_;
    std::vector<float> weights_;
    // Counts matrix of the current call: rows_[s * world + d] = rows s sends to d.
    std::vector<uint32_t> rows_;
    std::vector<uint32_t> hits_from_;     // [world] hits each sender sent here
    std::vector<uint32_t> combine_base_;  // [world] where our results go at each sender
    std::vector<uint32_t> expert_hits_;   // [local experts] sum over senders
    // Receiver state: per grouped output row, its slot in the combine staging (-1: padding).
    std::vector<int64_t> out_to_stage_;
    std::vector<uint64_t> stage_begin_;  // [world + 1] combine staging rows per sender
    // CombineMode::kPerRank: the hits of every received row (in staging order), as batch row
    // and weight, row r's from part_hits_[part_begin_[r]] to part_hits_[part_begin_[r + 1]].
    struct PartHit {
        uint32_t row;
        float weight;
    };
    std::vector<uint32_t> part_begin_;
    std::vector<PartHit> part_hits_;
    uint32_t out_rows_ = 0;
};

}  // namespace ferry::moe
