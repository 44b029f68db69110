// Shared between the MoE kernels (.cu, CUDA C++17) and their host side: the argument block
// every kernel gets, the device-side error record, and the launchers of each kernel family.
// The wire format both read is in ferry/moe/wire_format.h; the CUDA-free parts of what they
// agree on (the region layout, the state, tickets and trace points) in moe/device_layout.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ferry/moe/wire_format.h"
#include "moe/device_layout.h"

namespace ferry::moe::cuda {

// Written once per failure (first writer wins) into mapped pinned host memory, so the host can
// read it even while a kernel is stuck.
struct DeviceError {
    enum Code : uint32_t {
        kNone = 0,
        kTimeout = 1,
        kProtocol = 2,
        kConfig = 3,
        kTooMany = 4,
        kCapacity = 5,  // more rows for a local expert than its slab holds
    };
    enum Phase : uint32_t {
        kPlan = 1,
        kSendWaitCounts = 2,
        kRecvWaitRows = 3,
        kRecvRows = 4,
        kCombineSend = 5,
        kCombineRecvWait = 6,
    };
    uint32_t code;
    uint32_t phase;
    uint32_t peer;
    uint32_t seq;
    uint64_t value;  // what was seen (counter, seq in a row header, token count ...)
    uint64_t want;   // what was expected
};

struct KernelArgs {
    uint32_t rank, world, hidden, topk, num_experts, local_experts;
    uint32_t private_slots, max_tokens, alignment, hash32;
    uint32_t payload_bytes, scales_per_token, row_bytes, payload_offset, scale_offset;
    uint32_t place_offset, hit_base_offset;   // RowFormat: place[top-k], hit_base
    uint32_t weight_offset;                   // RowFormat: weight[top-k]
    uint32_t combine_per_rank;                // CombineMode::kPerRank
    uint32_t counts_bytes, counts_hits_word;  // CountsFormat::bytes, ::hits_per_expert
    uint32_t max_rows;                        // max_expert_rows
    uint32_t dispatch_send_blocks, combine_send_blocks;
    uint32_t dispatch_recv_blocks;  // grid of dispatch_recv (a warp per received row)
    uint32_t plan_smem, recv_smem;  // dynamic shared memory of the plan and recv kernels
    uint64_t timeout_ns;
    SharedLayout lay;
    // [world] device array: each rank's shared allocation mapped here, or for a rank on
    // another node its outbox (mapped pinned host memory with the same layout).
    uint8_t* const* peers;
    uint8_t* self;  // this rank's shared allocation
    DeviceState* state;
    DeviceError* err;  // device view of the mapped host record
    // Per-call scratch, local to this rank.
    uint64_t* dest_mask;      // [max_tokens] bit d: token goes to rank d
    uint32_t* row_pos;        // [max_tokens * world] row of the token among those sent to d
    uint32_t* place;          // [max_tokens * top-k] the RowFormat place of (token, k)
    uint32_t* hit_base;       // [max_tokens * world] RowFormat hit_base (remote d only)
    uint32_t* recv_hits;      // [world] hits dispatch_recv placed from each sender
    uint32_t* expert_counts;  // [num_experts]
    uint32_t* rows_to;        // [world]
    int32_t* indices;         // [max_tokens * top-k] copy of the call's routing
    float* weights;           // [max_tokens * top-k]
    RowSource* row_src;       // [max_rows] where each grouped row came from
    // [max_rows] the row of the caller's batch that grouped row o was written to, when the
    // last dispatch_recv wrote per-expert slabs (out_capacity != 0): combine_send reads the
    // expert output there.
    uint32_t* out_row;

    // Peers on other nodes, reached through the host proxy (all zero/null without them).
    uint64_t remote_mask;     // bit d: rank d is remote
    proxy::Publish* publish;  // [world][kParts] mapped host records for the proxy
    // The proxy's inbox (mapped pinned host memory laid out like `self`): what remote ranks
    // sent, and their arrival counters, which the proxy stores; kernels read both from here.
    uint8_t* inbox;
    const uint32_t* proxy_abort;  // mapped word the proxy sets to 1 when it fails
    unsigned long long* tickets;  // [kTickets] blocks done so far, over all calls
    uint32_t* combine_slot;       // [max_tokens * top-k] combine row of (token, k)
    uint32_t* combine_pos;        // [max_rows] a remote sender's row among its hits here
    uint32_t remote_combine;      // first combine row of the remote area (max_tokens * top-k)
    // [world * counts_bytes] the remote senders' counts messages of this call, copied from the
    // inbox into device memory by the block of dispatch_send that waited for them (see
    // wait_remote_counters); every later read of them (the overflow offsets, dispatch_recv's
    // layout, combine_send's runs) is a device load. A read of host memory is a PCIe round
    // trip, and it waits behind the GPU's earlier writes there: combine_send, which writes
    // megabytes to host memory, published 90 us late reading three such words (EP2,
    // 2026-12-03).
    uint8_t* counts_mirror;
    // Streamed combine (piece_rows != 0: per-hit combine with remote ranks and proxy pieces):
    // a few warps write the remote runs in run order, and each piece of piece_rows rows goes
    // to the proxy as soon as its rows are in the outbox (proxy::Publish::streamed), so the
    // proxy's writes run beside the kernel's instead of after it.
    uint32_t piece_rows, max_pieces;
    uint32_t* piece_done;    // [world * max_pieces] rows of each piece written (reset when full)
    uint32_t* stream_ready;  // [world * max_pieces] device view of the proxy's piece flags
    uint32_t* combine_inv;   // [max_rows] received row at each remote run position (runs of
                             // the remote senders back to back in rank order)
    // Streamed combine, received by piece (with piece_rows; null otherwise): combine_recv's
    // polling block copies each remote sender's inbox piece word (at inbox + piece_words, see
    // proxy_piece_word_offset) into piece_seen[sender] as it moves, and a token's rows from a
    // sender are read once the pieces holding them are in; combine_base[d] is the first row
    // of remote rank d's run here (the plan's, as announced in the counts message). Every
    // rank's piece_rows is the same: it is part of hash32.
    unsigned long long* piece_seen;  // [world]
    uint32_t* combine_base;          // [world]
    uint64_t piece_words;
    // CombineMode::kPerRank only (null otherwise): what dispatch_recv leaves combine_send
    // about every received row g (senders in rank order, a sender's rows in its order).
    uint32_t* recv_o;      // [world * max_tokens * top-k] batch row of each choice, ~0u: none
    float* recv_w;         // [world * max_tokens * top-k] its weight
    uint32_t* recv_token;  // [world * max_tokens] the row's token at its sender
    uint32_t* recv_start;  // [world + 1] first received row of each sender
    // CudaAllToAllOptions::trace: [2 * kTracePoints] global-timer stamps of the current call,
    // the first block's at [p], the last block's at [kTracePoints + p]; null: no stamps.
    unsigned long long* trace;
    // CudaAllToAllOptions::early_launch: dispatch_recv and combine_recv start while the send
    // kernel before them runs (programmatic dependent launch).
    uint32_t early_launch;
    // Block 0 of dispatch_send plans the call (no plan kernel before it): set by create()
    // when dispatch_send_fuses_plan(send threads) and at most two ranks share a GPU.
    uint32_t fused_plan;
};

// Every kernel of a family loaded into the current device's context. CUDA loads modules
// lazily by default, at a kernel's first launch, and loading may wait for the kernels already
// running: a rank's first launch would then wait for a peer's kernel that waits for that very
// launch (ranks sharing a GPU deadlocked that way, 2026-12-01). create() loads them all first.
cudaError_t preload_dispatch_kernels();
// Dynamic shared memory the plan and recv kernels need for a config (bytes), and the opt-in
// both get so they may use more than the default 48 KiB.
uint32_t dispatch_plan_smem(uint32_t num_experts, uint32_t world, uint32_t topk);
uint32_t dispatch_recv_smem(uint32_t num_experts, uint32_t world);
cudaError_t set_dispatch_smem(uint32_t plan_bytes, uint32_t recv_bytes);
// Whether dispatch_send can plan in its own block 0 with this many threads per block.
bool dispatch_send_fuses_plan(uint32_t send_threads);
cudaError_t preload_combine_kernels();
cudaError_t preload_quantize_kernels();

// Launches `kernel`, as a programmatic dependent of the kernel before it on the stream when
// `early` (see let_receiver_start in device_common.cuh).
template <typename... Params, typename... Args>
cudaError_t launch_after(bool early, void (*kernel)(Params...), uint32_t blocks, uint32_t threads,
                         size_t smem, cudaStream_t stream, Args... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = early ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// dispatch.cu
// indices or indices64 (the other null): the call's routing as int32 or int64.
cudaError_t launch_dispatch_send(const KernelArgs& a, const void* x, const float* x_scale,
                                 const int32_t* indices, const int64_t* indices64,
                                 const float* weights, const uint32_t* num_tokens,
                                 uint32_t send_blocks, uint32_t send_threads, cudaStream_t stream);
// capacity 0: rows grouped back to back (offsets); else group e at rows e * capacity.. of x
// and x_scale (CudaExpertBatch::capacity).
cudaError_t launch_dispatch_recv(const KernelArgs& a, void* x, float* x_scale, uint32_t* counts,
                                 uint32_t* offsets, RowSource* sources, uint32_t capacity,
                                 cudaStream_t stream);
// combine.cu
cudaError_t launch_combine_send(const KernelArgs& a, const uint16_t* expert_out, uint32_t blocks,
                                uint32_t threads, cudaStream_t stream);
// weights: null, the dispatched ones; else [num_tokens * top-k] on the device.
cudaError_t launch_combine_recv(const KernelArgs& a, float* out_f32, uint16_t* out_bf16,
                                const float* weights, uint32_t blocks, uint32_t threads,
                                cudaStream_t stream);
// host_gate.cu: holds `stream` until *flag >= want (device view of mapped host memory) or
// timeout_ns passed.
cudaError_t launch_host_gate(const volatile uint32_t* flag, uint32_t want, uint64_t timeout_ns,
                             cudaStream_t stream);
cudaError_t preload_host_gate();
// One thread waits until *flag != 0 (or timeout_ns passes), then stores the global timer into
// *out: the host, stamping its clock around the flag store, learns the timer's offset.
cudaError_t launch_clock_probe(const volatile uint32_t* flag, unsigned long long* out,
                               uint64_t timeout_ns, cudaStream_t stream);
// quantize.cu
cudaError_t launch_quantize_fp8(const uint16_t* x, uint32_t tokens, uint32_t hidden, uint8_t* q,
                                float* scales, cudaStream_t stream);
cudaError_t launch_dequantize_fp8(const uint8_t* q, const float* scales, uint32_t tokens,
                                  const uint32_t* tokens_dev, uint32_t hidden, uint16_t* out,
                                  cudaStream_t stream);

}  // namespace ferry::moe::cuda
