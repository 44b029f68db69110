// Expert-parallel all-to-all on GPUs: the protocol of cpu_backend.h run by CUDA kernels. Ranks
// of one node (cfg.ranks_per_node consecutive ranks) map each other's buffers through CUDA IPC
// (NVLink between GPUs, plain device memory between ranks sharing a GPU) and kernels store
// straight into them. Ranks on other nodes are reached through a host proxy thread per rank and
// a TransferEngine (options.engine): kernels write those peers' bytes into pinned host memory
// and publish them there, the proxy writes them to the peer with immediates, and the peer's
// proxy copies them onto its GPU and raises the arrival counter its kernels wait for. That
// path costs a PCIe crossing and a host copy per put on each side (no GDRCopy, no GPUDirect
// RDMA); same-node peers pay nothing for it. This header is CUDA-free: device pointers are
// plain pointers and a stream is passed as `void*` (a cudaStream_t).
//
//   auto a2a = CudaAllToAll::create(cfg, allgather, {.engine = engine});  // collective
//   a2a->dispatch_send(in, stream);   // enqueue only: nothing here waits for the GPU
//   a2a->dispatch_recv(batch, stream);
//   ... experts on `stream` ...
//   a2a->combine_send(expert_out, stream);
//   a2a->combine_recv(out, stream);
//   a2a->synchronize(stream);         // waits and turns a device-side error into a Status
//
// Every argument the kernels read per call lives in device memory (token count included) and
// the call number is kept on the device, so a whole layer can be captured in a CUDA graph and
// replayed, remote peers included (the proxy follows what the kernels publish, not the host's
// calls). Waits inside kernels are bounded by options.timeout; a kernel that gives up records
// where it was stuck (phase, peer, counter value) and synchronize() reports it, together with
// any failure of the host proxy (a fabric write, a peer's bad record).
//
// Differences from the CPU backend, both deliberate: results of same-node ranks travel back into
// slot (token * top-k + k) at their sender instead of a compact run (kernel stores need no
// contiguity, and the receiver then needs no slot table; remote ranks do send one compact run,
// the fabric's unit), and duplicate experts within one token are not diagnosed on the device
// (the CPU backend refuses them).
//
// Several ranks may share a GPU (threads or processes): kernels wait inside for peers' kernels,
// so create() cuts every grid to SMs / (most ranks on one GPU), and all of them fit at once.
// Such ranks must finish their set-up (cudaMalloc, cudaFree and other calls that wait for the
// whole device) before any of them makes the first call, or that call waits for a kernel
// that waits for it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"
#include "ferry/moe/all_to_all.h"
#include "ferry/moe/config.h"
#include "ferry/moe/plan.h"

namespace ferry::moe {

// Launch shape of the dispatch kernels. Counters at the receiver count one arrival per send
// block, so every rank must use the same send_blocks (it is part of the setup check).
struct CudaDispatchKernelConfig {
    uint32_t send_blocks = 128;  // a warp per token
    uint32_t send_threads = 512;
};

// Launch shape of the combine kernels; send_blocks must match across ranks as above.
struct CudaCombineKernelConfig {
    uint32_t send_blocks = 128;  // a warp per expert output row
    uint32_t send_threads = 512;
    uint32_t recv_blocks = 256;  // a block per token
    uint32_t recv_threads = 256;
};

struct CudaAllToAllOptions {
    Duration timeout = std::chrono::seconds(10);  // every spin-wait inside a kernel
    int device = -1;                              // -1: the calling thread's current device
    CudaDispatchKernelConfig dispatch;
    CudaCombineKernelConfig combine;
    // Ranks on other nodes (cfg.node_of differs) are reached through this engine; required
    // when world_size > ranks_per_node, and it must outlive the all-to-all. Ranks of one host
    // with different node numbers use it too (one GPU can test the remote path that way).
    TransferEngine* engine = nullptr;
    // Immediates used are [imm_base, imm_base + 8 * kMaxWorldSize + P * world_size), P the
    // most pieces of a streamed combine (max_tokens_per_rank * experts_per_token rows over the
    // rows of a piece; 0 without stream_combine): keep clear of other users of the same engine
    // (AllToAll's default base is 0x80000 above this one's; create() refuses a range that
    // would pass 2^32).
    uint32_t imm_base = 0x6d670000;
    // The host proxy spins (yielding its core) this long after its last work, then naps; the
    // first put after a nap waits for its end (tens of microseconds with the scheduler's
    // granularity). Set it above the gap between layers to keep the proxy spinning.
    Duration proxy_idle_spin = std::chrono::microseconds(200);
    // The host proxy's largest write: a longer put goes as several writes, posted at once (its
    // record counts them all). On shm a lone 256 KiB write moved 17 GB/s against 11 GB/s at
    // 4 MiB (`ferry bench xfer`, 16-core host, 2026-12-02); in the proxied decode layer, where
    // two ranks copy at once at ~5 GB/s each, 256 KiB pieces and whole puts timed within the
    // run-to-run spread (layer p50 2641 against 2756 us, one H200, 2026-12-02). 0: one write
    // per put.
    uint64_t proxy_chunk_bytes = 256 * 1024;
    // Per-hit combine with remote ranks: the combine send kernel writes each remote rank's
    // rows in order and hands them to the proxy in pieces of whole rows (as many as fit in
    // proxy_chunk_bytes), each as soon as it is in the outbox, so the fabric's copies run
    // beside the kernel's writes to host memory instead of after them; where each piece is one
    // write of the engine's, the receiver reads a piece's rows as soon as it is in. Needs
    // proxy_chunk_bytes of at least one row (hidden * 2 bytes); off: one put per call. Every
    // rank must pass the same stream_combine and proxy_chunk_bytes (create() checks).
    bool stream_combine = true;
    // Kernels stamp the GPU's global timer where each kernel starts and ends and where its
    // waits for peers end (first and last block each); last_trace() reads the last call's
    // stamps. A few atomics per block; for finding where a call spends its time.
    bool trace = false;
    // dispatch_recv and combine_recv are launched as programmatic dependents of the send
    // kernel before them (Hopper), so they start while it runs and their launch latency
    // overlaps it; they wait for data through the arrival counters either way. Off by
    // default: with two ranks sharing one H200 a captured layer took 97 us with it against
    // 94 us without (2026-12-01), and its waiting blocks can keep a peer's kernel from an SM
    // when ranks share a GPU, so create() turns it off there. Not yet timed one rank per GPU.
    bool early_launch = false;
    // dispatch_send plans the call in the first block of its send kernel instead of a
    // one-block kernel before it, which saves a kernel boundary per call. Used with the
    // default send_threads (512) where at most two ranks share a GPU: with more, a send block
    // holding the plan's registers and shared memory for its whole run could keep a peer's
    // kernel off the SMs it waits on.
    bool fuse_plan = true;
};

// One stamp of the last call (CudaAllToAllOptions::trace), in GPU global-timer nanoseconds:
// when the first and the last block of the kernel got to `point`. 0/0: no block got there.
struct CudaTraceStamp {
    const char* point = "";
    uint64_t first_ns = 0;
    uint64_t last_ns = 0;
};

// Device pointers. x: num_tokens rows of payload_bytes; x_scale: hidden/128 floats per token
// (fp8 only); indices/weights: top-k per token, -1 = no expert; num_tokens: one uint32 on the
// device, at most max_tokens_per_rank. x must be 16-byte aligned. The routing is read once, by
// dispatch_send's first kernel, and copied: the inputs may change once that kernel has run.
struct CudaDispatchInput {
    const void* x = nullptr;
    const float* x_scale = nullptr;
    const int32_t* indices = nullptr;
    const float* weights = nullptr;
    const uint32_t* num_tokens = nullptr;
    // Instead of indices: int64 routing (torch's index dtype, DeepEP's topk_idx), narrowed on
    // the device; a value outside [-1, experts) is reported as for int32.
    const int64_t* indices64 = nullptr;
};

// Device pointers. counts and offsets always describe the grouped batch: group e is rows
// offsets[e] .. offsets[e] + counts[e] of it, padded to the alignment. Where the rows go:
// - capacity 0: that grouped batch, max_expert_rows(cfg) rows of x (and x_scale), back to back;
// - capacity > 0: per-expert slabs, the layout of pplx-garden's and DeepEP's calls: row j of
//   group e at row e * capacity + j of x ([local experts, capacity, row]); rows of a slab past
//   the group's padding are not written, and a group larger than capacity is an error.
// sources (optional, max_expert_rows(cfg) entries) is in grouped numbering either way.
struct CudaExpertBatch {
    void* x = nullptr;
    float* x_scale = nullptr;
    uint32_t* counts = nullptr;   // [local experts]
    uint32_t* offsets = nullptr;  // [local experts + 1]
    RowSource* sources = nullptr;
    uint32_t capacity = 0;
};

class CudaAllToAll {
  public:
    // Collective over the ranks of the group (allgather as in AllToAll::create). Fails with
    // a clear error in builds without CUDA, without a GPU, on a config mismatch, when ranks of
    // one node run on different hosts, or when remote ranks exist and options.engine is null.
    static Result<std::unique_ptr<CudaAllToAll>> create(const AllToAllConfig& cfg,
                                                        const AllGatherFn& allgather,
                                                        const CudaAllToAllOptions& options = {});
    // Stops the host proxy, frees and unmaps. Every rank must have finished its last
    // combine_recv first (a barrier), or a late peer may write into freed memory.
    ~CudaAllToAll();
    CudaAllToAll(const CudaAllToAll&) = delete;
    CudaAllToAll& operator=(const CudaAllToAll&) = delete;

    const AllToAllConfig& config() const;
    int device() const;

    Status dispatch_send(const CudaDispatchInput& in, void* stream);
    Status dispatch_recv(const CudaExpertBatch& out, void* stream);
    // expert_out: bf16 rows laid out like the batch of dispatch_recv (grouped or slabs, as that
    // call's capacity said; padding ignored).
    Status combine_send(const uint16_t* expert_out, void* stream);
    // out: num_tokens * hidden, sum over the token's experts of weight * output in fp32
    // (cfg.combine kPerRank: the sum of the ranks' bf16 partials, see config.h). weights:
    // null for the dispatched ones, else num_tokens * top-k floats on the device that replace
    // them for this call (read by the kernel; CombineMode::kPerHit only).
    Status combine_recv(float* out, void* stream, const float* weights = nullptr);
    Status combine_recv_bf16(uint16_t* out, void* stream, const float* weights = nullptr);
    // Replaces the combine weights of the call in flight (max_tokens_per_rank * top-k floats
    // on the device; rows past the call's token count are not read), enqueued on `stream`
    // (a device-to-device copy, so it can be captured). Between dispatch_send and
    // combine_recv; CombineMode::kPerHit only, as CpuBackend::set_combine_weights.
    Status set_combine_weights(const float* weights, void* stream);

    // Waits for the stream (bounded by a few timeouts) and reports the first device-side
    // error of any call so far. After an error the object refuses further calls.
    Status synchronize(void* stream);
    // The device-side error record only, without waiting (e.g. after a graph replay).
    Status device_status();
    // The stamps of the last call, in kernel order (synchronize first), then, with ranks on
    // other nodes, the host proxy's per part ("proxy <part> <stage>": published by the kernel,
    // seen by the proxy, posted to the engine, written (its last write completed), arrived
    // (here, from the peer)), first and last over remote peers, converted to the GPU's timer
    // with an offset measured at create(). Fails unless created with options.trace.
    Result<std::vector<CudaTraceStamp>> last_trace();

  private:
    struct Impl;
    explicit CudaAllToAll(std::unique_ptr<Impl> impl);
    std::unique_ptr<Impl> impl_;
};

// fp8 e4m3 block quantization on the device, the format of quantize_fp8_bf16 (one fp32 scale
// per 128 channels, scale = amax/448, same amax floor and rounding): x is tokens * hidden bf16.
Status cuda_quantize_fp8(const uint16_t* x, uint32_t tokens, uint32_t hidden, uint8_t* q,
                         float* scales, void* stream);
// And back, to bf16 (what a test "expert" or the benchmark's identity expert reads).
// tokens_dev (optional, device): the row count is min(*tokens_dev, tokens), read at run
// time, e.g. offsets[local experts] of a batch, so a captured graph converts only real rows.
Status cuda_dequantize_fp8_to_bf16(const uint8_t* q, const float* scales, uint32_t tokens,
                                   uint32_t hidden, uint16_t* out, void* stream,
                                   const uint32_t* tokens_dev = nullptr);

// For benchmarks that time work enqueued ahead (`ferry bench moe`, `python3 -m
// ferry.bench_moe`): holds `stream` until the uint32 at `flag`, pinned host memory mapped
// into the device, is at least `want`, or `timeout` passed. Every rank enqueues its layer
// behind one, then one host store opens them all: events then time the GPU's work rather than
// host launch gaps and the ranks' skew.
Status cuda_host_gate(const uint32_t* flag, uint32_t want, Duration timeout, void* stream);

}  // namespace ferry::moe
