// The protocol's arithmetic, shared by every backend (CPU today, CUDA kernels later): wire
// formats, what a sender sends where, where each row lands at the receiver, and how received
// rows are grouped per local expert and mapped back for combine. Pure functions of the
// routing and the exchanged counts; no I/O.
//
// Per call, sender s and receiver d exchange:
//   counts   one CountsMessage s -> d (rows s sends to every rank, hits per local expert of d,
//            where d's results go back at s);
//   dispatch one row per (token, destination rank): header + payload + fp8 scales. The first
//            private_slots rows land in d's private slots for s (no offsets needed); the rest
//            in one contiguous run at an offset every rank derives from the counts matrix;
//   combine  one bf16 row per (token, expert) hit, in the order the rows came (rows of s in
//            token order, hits of a row in top-k order), written as one run to s; with
//            CombineMode::kPerRank one row per dispatched row instead (the weighted partial
//            sum over the row's hits), in the order of s's rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "ferry/common/status.h"
#include "ferry/moe/config.h"
#include "ferry/moe/wire_format.h"

namespace ferry::moe {

// Header at the start of every dispatched row, followed by int16 local_expert[top-k]
// (-1 where that top-k choice lives on another rank), then uint32 place[top-k]: the row's
// index among the rows this sender sends to this rank that chose that expert (0 where the
// choice lives elsewhere), then uint32 hit_base: the (token, expert) hits of the sender's
// earlier rows to this rank, then float weight[top-k] (0 where the choice lives elsewhere;
// CombineMode::kPerRank weights the partial sums with them). With them a receiver puts every
// row straight into its place in the grouped batch, and knows where the row's results go in
// the sender's compact combine run, without looking at any other row (the CUDA kernels copy
// rows in parallel that way). RowHeader itself is in wire_format.h, which the kernels share.

// Byte layout of one dispatched row; every part starts 16-byte aligned.
struct RowFormat {
    size_t place_offset = 0;     // uint32 place[top-k]
    size_t hit_base_offset = 0;  // uint32 hit_base
    size_t weight_offset = 0;    // float weight[top-k]
    size_t header_bytes = 0;
    size_t payload_offset = 0;
    size_t scale_offset = 0;
    size_t row_bytes = 0;
    static RowFormat of(const AllToAllConfig& cfg);
};

// Counts message, as uint32 words: the word indices (CountsWords, wire_format.h), then
// hits_per_expert.
struct CountsFormat : CountsWords {
    uint32_t hits_per_expert = 0;  // [local experts] hits per local expert of d
    uint32_t words = 0;
    size_t bytes = 0;  // padded to a cache line
    static CountsFormat of(const AllToAllConfig& cfg);
};

// Sizes of the per-rank buffers. recv_* are written by peers; stage_* are this rank's
// sources for writes into the matching region of a peer.
struct BufferSizes {
    size_t recv_counts = 0, recv_dispatch = 0, recv_combine = 0;
    size_t stage_counts = 0, stage_dispatch = 0, stage_combine = 0;
    size_t combine_row_bytes = 0;
    static BufferSizes of(const AllToAllConfig& cfg);
};

// Most rows dispatch_recv can produce, padding included: what an ExpertBatch must hold.
size_t max_expert_rows(const AllToAllConfig& cfg);

// Sender side, from the top-k indices of one call.
struct SendPlan {
    uint32_t num_tokens = 0;
    std::vector<uint32_t> expert_counts;  // [num_experts] bincount of valid indices
    std::vector<uint32_t> rows_to;        // [world] tokens sent to each rank
    std::vector<uint32_t> row_begin;      // [world + 1] first staged row of each destination
    std::vector<uint32_t> row_token;      // [staged rows] source token of each staged row
    std::vector<uint32_t> hits_to;        // [world] (token, expert) pairs sent to each rank
    std::vector<uint32_t> combine_begin;  // [world + 1] first combine row of each rank
    // [tokens * top-k] combine row of each choice, -1 for no expert. kPerRank: the row of the
    // token's partial from that choice's rank, on the first choice of each rank only (-1 on
    // the others), so summing slots in top-k order adds each rank's partial once.
    std::vector<int32_t> combine_slot;
};

// Checks indices (in [-1, num_experts), no expert twice in one token) and plans the sends.
Result<SendPlan> plan_send(const AllToAllConfig& cfg, std::span<const int32_t> indices,
                           uint32_t num_tokens);

// Where the rows of every sender land in one receiver's dispatch region, from the rows each
// sender sends to that receiver. Senders compute it for each destination; the receiver for
// itself; both get the same answer from the same counts.
class RecvLayout {
  public:
    RecvLayout(const AllToAllConfig& cfg, std::span<const uint32_t> rows_from);
    // Row index (in rows of RowFormat::row_bytes) of sender s's i-th row.
    uint64_t row_index(uint32_t s, uint32_t i) const {
        return i < private_slots_ ? uint64_t{s} * private_slots_ + i
                                  : overflow_base_ + overflow_begin_[s] + (i - private_slots_);
    }
    uint32_t rows_from(uint32_t s) const { return rows_from_[s]; }
    uint32_t private_rows(uint32_t s) const;
    uint32_t overflow_rows(uint32_t s) const { return rows_from_[s] - private_rows(s); }
    // First row of sender s's run past its private slots.
    uint64_t overflow_row(uint32_t s) const { return overflow_base_ + overflow_begin_[s]; }

  private:
    uint32_t private_slots_;
    uint64_t overflow_base_;
    std::vector<uint32_t> rows_from_;
    std::vector<uint64_t> overflow_begin_;
};

// Receiver side: grouped output layout per local expert.
struct ExpertLayout {
    std::vector<uint32_t> counts;   // [local experts] rows per expert
    std::vector<uint32_t> offsets;  // [local experts + 1] first row of each group (aligned)
    uint32_t total_rows() const { return offsets.empty() ? 0 : offsets.back(); }
};
ExpertLayout expert_layout(const AllToAllConfig& cfg, std::span<const uint32_t> hits_per_expert);

}  // namespace ferry::moe
