// What the CUDA all-to-all's kernels and their host side agree on, in plain C++17 (the .cu
// files include it through kernels.h; the proxy, device_proxy.h, and the workspace plan,
// cuda_workspace.h, are CUDA-free): the layout of each rank's peer-written region, the limits,
// state, tickets and trace points the kernels size their buffers by, and the records that
// carry a put to a remote rank.
#pragma once

#include <cstdint>

namespace ferry::moe {

// Byte offsets inside each rank's peer-written region (identical on every rank). Same-node
// peers store into it over NVLink; the host proxy copies remote peers' bytes into it.
struct SharedLayout {
    uint64_t ctr_counts = 0;    // [world] uint64: +1 per call from each sender
    uint64_t ctr_dispatch = 0;  // [world] uint64: +send_blocks per call from each sender
    uint64_t ctr_combine = 0;   // [world] uint64: +combine send_blocks per call from each sender
    uint64_t counts = 0;        // [world] counts messages
    uint64_t dispatch = 0;      // [world * max_tokens] rows
    uint64_t combine = 0;       // [max_tokens * top-k] bf16 rows, then as many for remote peers
    uint64_t total = 0;
};

namespace cuda {

// One bit per destination rank in a token's mask (and in remote_mask).
inline constexpr uint32_t kMaxCudaWorld = 64;
// combine_recv keeps one row vector per top-k slot in registers.
inline constexpr uint32_t kMaxCudaTopk = 16;

// Device-local state of one rank: the call number and token count of the current call.
struct DeviceState {
    uint64_t seq;
    uint32_t num_tokens;
    uint32_t out_rows;       // rows of the last dispatch_recv, padding included
    uint32_t out_capacity;   // its CudaExpertBatch::capacity (0: grouped back to back)
    uint32_t error_claimed;  // set once by the first failure (see record_error)
};

// Where the kernels stamp the trace: each kernel's first and last block, and the moments its
// waits for peers ended. The plan kernel clears the stamps of the previous call.
enum TracePoint : uint32_t {
    kTrPlanBegin,
    kTrPlanRouted,  // the first tile's routing is in shared memory
    kTrPlanRanked,  // the first tile's prefix over warps is done
    kTrPlanTiles,   // every tile is done
    kTrPlanCounts,  // counts messages stored, before the fence and the signal
    kTrPlanEnd,
    kTrSendBegin,
    kTrSendCountsIn,  // every peer's counts are here
    kTrSendEnd,
    kTrRecvBegin,
    kTrRecvRowsIn,  // every peer's rows are here
    kTrRecvEnd,
    kTrCombineSendBegin,
    kTrCombineSendEnd,
    kTrCombineRecvBegin,
    kTrCombineRecvRowsIn,
    kTrCombineRecvEnd,
    kTracePoints
};

// Tickets: the last block of a call to finish a phase publishes that phase's remote puts.
enum Ticket : uint32_t {
    kTicketPrivate = 0,
    kTicketDispatch = 1,
    kTicketCombine = 2,
    kTicketRecv = 3,  // the last dispatch_recv block checks every announced hit was placed
    // The fused dispatch send (KernelArgs::fused_plan): the call number whose plan block 0
    // finished, and how many of the other blocks entered so far (their call number).
    kTicketPlan = 4,
    kTicketSendEntry = 5,
    // wait_remote_counters: a ticket electing the block that polls the inbox, and the call
    // number it publishes once the remote counters are there, per wait.
    kTicketCountsPoll = 6,
    kTicketCountsRelay = 7,
    kTicketDispatchPoll = 8,
    kTicketDispatchRelay = 9,
    kTicketCombinePoll = 10,
    kTicketCombineRelay = 11,
    kTickets = 12
};

}  // namespace cuda

namespace proxy {

// The puts of one call to one remote rank. The private-slot rows go as soon as they are
// written (before any count is known, as on NVLink); the overflow rows once counts are in.
enum Part : uint32_t { kCounts = 0, kPrivate = 1, kOverflow = 2, kCombine = 3 };
inline constexpr uint32_t kParts = 4;

// Written by a kernel into mapped host memory, [peer][part], once its bytes for that put are
// in the peer's outbox: offset and len first, then (after a system fence) the call number.
// The outbox is laid out like the peer's region, so offset is the same on both sides.
// streamed != 0: published before the bytes are there; they follow in pieces of the proxy's
// stream_piece_bytes, piece i ready once its word in the stream flags ([peer][piece], mapped
// host memory) holds the call number, so the proxy posts each piece as the kernel finishes
// it rather than after the whole put.
// stamp_ns: the GPU's global timer when the kernel published (CudaAllToAllOptions::trace).
struct Publish {
    uint64_t offset;
    uint64_t len;
    uint32_t seq;
    uint32_t streamed;
    uint64_t stamp_ns;
};

// What the sender's proxy writes into the receiver's record slot [part][sender] after the
// bytes: which bytes, and how many writes carrying the data immediate to count before them.
// by_piece != 0: a streamed put whose piece i went as one write carrying the piece immediate
// of (sender, i) instead (DeviceProxy::piece_imm); `pieces` counts them. The receiving proxy
// takes those as they come and tells the kernels how many pieces are in from the first on
// (the inbox's piece words, proxy_piece_word_offset), so they can read a piece before the rest.
struct PutRecord {
    uint64_t offset;
    uint64_t len;
    uint32_t seq;
    uint32_t pieces;
    uint32_t by_piece;
    uint32_t reserved;
};

static_assert(sizeof(Publish) == 32 && sizeof(PutRecord) == 32);

}  // namespace proxy
}  // namespace ferry::moe
