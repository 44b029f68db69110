// What CudaAllToAll::create allocates, and the grids it launches, as pure functions of the
// config and the options (DeepEP's buffer-size hints are the model): no CUDA here, so the
// arithmetic is tested without a GPU (tests/moe/cuda_workspace_test.cc).
//
// Per rank:
//   shared  device memory peers write (IPC-exported): counters, counts messages, dispatch
//           rows, combine rows (SharedLayout);
//   scratch device memory only this rank touches: the call's state, the peer table and the
//           per-call scratch the kernels keep (ScratchLayout, 256-byte aligned pieces);
//   pinned  mapped host memory, only with ranks on other nodes: the kernels' publish records,
//           the streamed combine's piece flags, an outbox slab per remote rank and the inbox.
#pragma once

#include <cstdint>
#include <span>

#include "ferry/common/status.h"
#include "ferry/moe/config.h"
#include "ferry/moe/cuda_all_to_all.h"
#include "moe/device_layout.h"

namespace ferry::moe {

// Byte offsets in the local scratch allocation, each 256-byte aligned. A piece the config
// does not use (no remote ranks, per-hit combine, no trace...) is empty: its offset equals
// the next one's.
struct ScratchLayout {
    uint64_t state = 0;          // cuda::DeviceState
    uint64_t peers = 0;          // [world] uint8_t*: each rank's shared region (or outbox)
    uint64_t dest_mask = 0;      // [max_tokens] uint64
    uint64_t row_pos = 0;        // [max_tokens * world] uint32
    uint64_t expert_counts = 0;  // [num_experts] uint32
    uint64_t rows_to = 0;        // [world] uint32
    uint64_t indices = 0;        // [max_tokens * top-k] int32
    uint64_t weights = 0;        // [max_tokens * top-k] float
    uint64_t row_src = 0;        // [max_rows] RowSource
    uint64_t out_row = 0;        // [max_rows] uint32
    uint64_t tickets = 0;        // [kTickets] uint64
    uint64_t combine_slot = 0;   // remote: [max_tokens * top-k] uint32
    uint64_t combine_pos = 0;    // remote: [max_rows] uint32
    uint64_t place = 0;          // [max_tokens * top-k] uint32
    uint64_t hit_base = 0;       // remote: [max_tokens * world] uint32
    uint64_t recv_hits = 0;      // [world] uint32
    uint64_t counts_mirror = 0;  // remote: [world] counts messages
    uint64_t recv_o = 0;         // per-rank combine: [world * max_tokens * top-k] uint32
    uint64_t recv_w = 0;         // per-rank combine: [world * max_tokens * top-k] float
    uint64_t recv_token = 0;     // per-rank combine: [world * max_tokens] uint32
    uint64_t recv_start = 0;     // per-rank combine: [world + 1] uint32
    uint64_t piece_done = 0;     // streamed combine: [world * max_pieces] uint32
    uint64_t combine_inv = 0;    // streamed combine: [max_rows] uint32
    uint64_t piece_seen = 0;     // streamed combine: [world] uint64
    uint64_t combine_base = 0;   // streamed combine: [world] uint32
    uint64_t trace = 0;          // trace: [2 * kTracePoints] uint64
    uint64_t total = 0;
};

struct CudaWorkspace {
    bool remote = false;    // some rank is on another node (world > ranks_per_node)
    bool per_rank = false;  // CombineMode::kPerRank
    uint64_t max_rows = 0;  // max_expert_rows(cfg)
    SharedLayout shared;
    ScratchLayout scratch;
    // Streamed combine (KernelArgs::piece_rows; 0: not streamed): pieces of whole bf16 rows
    // within one proxy write, and how many pieces the largest combine run has.
    uint64_t combine_row_bytes = 0;
    uint32_t piece_rows = 0;
    uint32_t max_pieces = 0;
    // Pinned host memory (all 0 without remote ranks).
    uint64_t publish_bytes = 0;       // [world][proxy::kParts] proxy::Publish
    uint64_t stream_ready_bytes = 0;  // [world * max_pieces] uint32 piece flags
    uint64_t proxy_slab = 0;          // the inbox, and one outbox slab per remote rank (4 KiB)
    uint64_t outbox_bytes = 0;        // proxy_slab * remote ranks
    // Immediates the host proxy uses from CudaAllToAllOptions::imm_base on.
    uint64_t proxy_imms = 0;

    uint64_t device_bytes() const { return shared.total + scratch.total; }
    uint64_t pinned_bytes() const {
        return remote ? publish_bytes + stream_ready_bytes + outbox_bytes + proxy_slab : 0;
    }
};

// Checks what needs no GPU (the config, the kernel shapes against the kernels' limits, an
// engine when ranks are on other nodes, room for the proxy's immediates) and sizes every
// buffer. The same inputs give the same plan on every rank.
Result<CudaWorkspace> plan_cuda_workspace(const AllToAllConfig& cfg,
                                          const CudaAllToAllOptions& options);

// Where one rank runs, as its setup blob announces it.
struct GpuSeat {
    uint64_t host_id = 0;
    int32_t device = 0;
    uint32_t sm_count = 0;
};

// Grids of the kernels that wait inside for peers' kernels.
struct CudaGrids {
    uint32_t share = 1;  // most ranks on one GPU
    uint32_t dispatch_send = 0, dispatch_recv = 0, combine_send = 0, combine_recv = 0;
};

// Kernels wait inside for peers' kernels, so every rank's kernel must be resident at once.
// With one rank per GPU that holds by itself; ranks sharing a GPU split its SMs: no grid is
// larger than SMs / (most ranks on one GPU) - 1, so the blocks of all of them fit even at
// one block per SM, with an SM left per rank for the one-block plan kernel (512 threads,
// which may not share an SM with a send block). Every rank derives the same grids from the
// same seats. dispatch_recv runs a warp per received row, two blocks per SM when the GPU is
// this rank's alone.
CudaGrids choose_cuda_grids(std::span<const GpuSeat> seats, const CudaDispatchKernelConfig& dc,
                            const CudaCombineKernelConfig& cc);

}  // namespace ferry::moe
