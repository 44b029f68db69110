// Host side of the CUDA all-to-all: allocation, IPC mapping and (for ranks on other nodes) the
// host proxy's outboxes, inbox and engine peers at setup, argument checks and kernel launches
// per call, and the translation of the device-side error record into a Status. See
// include/ferry/moe/cuda_all_to_all.h.
#include "ferry/moe/cuda_all_to_all.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <iterator>
#include <thread>
#include <vector>

#include "common/cuda_check.h"
#include "ferry/common/bytes.h"
#include "ferry/moe/numerics.h"
#include "moe/cuda/kernels.h"
#include "moe/device_proxy.h"

namespace ferry::moe {

static_assert(sizeof(RowSource) == sizeof(cuda::RowSource) &&
              RowSource::kPadding == cuda::RowSource::kPadding);
static_assert(sizeof(RowHeader) == cuda::kRowHeaderBytes);
static_assert(CountsFormat::kSeq == cuda::CountsWords::kSeq &&
              CountsFormat::kConfigHash == cuda::CountsWords::kConfigHash &&
              CountsFormat::kCombineBase == cuda::CountsWords::kCombineBase &&
              CountsFormat::kHits == cuda::CountsWords::kHits &&
              CountsFormat::kRowsTo == cuda::CountsWords::kRowsTo);
static_assert(kFp8E4M3Max == cuda::kFp8Max && kFp8AmaxFloor == cuda::kFp8Floor);

namespace {

constexpr uint32_t kBlobMagic = 0x6d6f6763;  // "mogc"

// What every rank publishes at setup.
struct PeerBlob {
    uint32_t magic = kBlobMagic;
    uint32_t rank = 0;
    uint64_t config_hash = 0;
    uint64_t host_id = 0;
    int32_t pid = 0;
    int32_t device = 0;
    uint32_t dispatch_blocks = 0;
    uint32_t combine_blocks = 0;
    uint32_t sm_count = 0;
    uint32_t piece_rows = 0;  // KernelArgs::piece_rows: receivers read the senders' pieces
    uint64_t base = 0;        // the shared allocation in the owner's address space
    cudaIpcMemHandle_t handle{};
    // Followed by this many bytes when the rank has an engine: its EngineAddress and its
    // proxy inbox's MemoryDescriptor, what ranks on other nodes need to reach it.
    uint32_t remote_bytes = 0;
};

uint64_t host_id() {
    char name[256] = {};
    gethostname(name, sizeof(name) - 1);
    uint64_t h = 1469598103934665603ull;
    for (const char* p = name; *p; ++p) h = (h ^ static_cast<uint8_t>(*p)) * 1099511628211ull;
    return h;
}

uint64_t align256(uint64_t v) { return (v + 255) / 256 * 256; }
uint64_t align4k(uint64_t v) { return (v + 4095) / 4096 * 4096; }

const char* phase_name(uint32_t phase) {
    switch (phase) {
        case cuda::DeviceError::kPlan:
            return "dispatch_send (routing)";
        case cuda::DeviceError::kSendWaitCounts:
            return "dispatch_send (waiting for counts)";
        case cuda::DeviceError::kRecvWaitRows:
            return "dispatch_recv (waiting for rows)";
        case cuda::DeviceError::kRecvRows:
            return "dispatch_recv (reading rows)";
        case cuda::DeviceError::kCombineSend:
            return "combine_send";
        case cuda::DeviceError::kCombineRecvWait:
            return "combine_recv (waiting for results)";
        default:
            return "an unknown phase";
    }
}

// The GPU global timer's lead over the host's system clock, so the proxy's stamps and the
// kernels' share one time line: a kernel stores the timer when it sees a flag that the host
// sets between two clock reads. Of five tries the narrowest window counts (a PCIe round trip,
// a few us; the error is at most half of it).
Status gpu_clock_offset(int64_t* offset) {
    struct Probe {
        uint32_t flag;
        uint32_t pad;
        unsigned long long stamp;
    };
    Probe* p = nullptr;
    FERRY_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&p), sizeof(Probe), cudaHostAllocMapped));
    cudaStream_t st = nullptr;
    auto cleanup = [&] {
        if (st) cudaStreamDestroy(st);
        cudaFreeHost(p);
    };
    Probe* dev = nullptr;
    cudaError_t e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), p, 0);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < 5 && e == cudaSuccess; ++i) {
        auto* flag = reinterpret_cast<volatile uint32_t*>(&p->flag);
        auto* stamp = reinterpret_cast<volatile unsigned long long*>(&p->stamp);
        *flag = 0;
        *stamp = 0;
        e = cuda::launch_clock_probe(&dev->flag, &dev->stamp, 1000000000ull, st);
        if (e != cudaSuccess) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the kernel is running
        const uint64_t t0 = system_clock_ns();
        std::atomic_thread_fence(std::memory_order_seq_cst);
        *flag = 1;
        const TimePoint deadline = deadline_after(std::chrono::seconds(2));
        while (*stamp == 0 && Clock::now() < deadline) {
        }
        const uint64_t t1 = system_clock_ns();
        e = cudaStreamSynchronize(st);
        if (e == cudaSuccess && *stamp != 0 && t1 - t0 < best) {
            best = t1 - t0;
            *offset = static_cast<int64_t>(*stamp) - static_cast<int64_t>(t0 + (t1 - t0) / 2);
        }
    }
    cleanup();
    if (e != cudaSuccess) return FERRY_CUDA_ERROR(e, "cuda all-to-all trace: GPU clock probe");
    if (best == UINT64_MAX)
        return internal_error("cuda all-to-all trace: the GPU clock probe never answered");
    return ok_status();
}

enum class Phase { kIdle, kDispatchSent, kDispatchReceived, kCombineSent, kBroken };

const char* last_call(Phase p) {
    switch (p) {
        case Phase::kIdle:
            return "combine_recv (or nothing yet)";
        case Phase::kDispatchSent:
            return "dispatch_send";
        case Phase::kDispatchReceived:
            return "dispatch_recv";
        case Phase::kCombineSent:
            return "combine_send";
        default:
            return "a failed call";
    }
}

}  // namespace

struct CudaAllToAll::Impl {
    AllToAllConfig cfg;
    CudaAllToAllOptions opt;
    int device = 0;
    cuda::KernelArgs args{};
    void* shared = nullptr;  // peers write here (IPC-exported)
    void* local = nullptr;   // state, peer table and per-call scratch
    cuda::DeviceError* err_host = nullptr;
    std::vector<void*> opened;  // peers' allocations opened through IPC
    Phase phase = Phase::kIdle;
    Status broken;
    uint32_t dispatch_send_blocks = 0, combine_send_blocks = 0, combine_recv_blocks = 0;
    // Remote peers: kernels' records, outboxes and the inbox they read (all mapped pinned),
    // their registrations, and the proxy.
    void* publish = nullptr;
    void* stream_ready = nullptr;  // the streamed combine's piece flags
    void* outbox = nullptr;
    void* inbox = nullptr;
    std::unique_ptr<MemoryRegion> outbox_mr, inbox_mr;
    std::unique_ptr<DeviceProxy> proxy;

    ~Impl() {
        // The proxy first (its writes read the outboxes, it writes the inbox's counters), then
        // the registrations, then the memory.
        proxy.reset();
        outbox_mr.reset();
        inbox_mr.reset();
        cudaSetDevice(device);
        for (void* p : opened) cudaIpcCloseMemHandle(p);
        if (shared) cudaFree(shared);
        if (local) cudaFree(local);
        if (err_host) cudaFreeHost(err_host);
        if (publish) cudaFreeHost(publish);
        if (stream_ready) cudaFreeHost(stream_ready);
        if (outbox) cudaFreeHost(outbox);
        if (inbox) cudaFreeHost(inbox);
    }

    Status fail(Status s) {
        if (phase != Phase::kBroken) {
            phase = Phase::kBroken;
            broken = s;
        }
        return s;
    }

    Status device_status() {
        volatile cuda::DeviceError* e = err_host;
        uint32_t code = e->code;
        // A proxy failure makes the kernels give up without a record of their own.
        const Status proxy_error = proxy ? proxy->error() : ok_status();
        if (code == cuda::DeviceError::kNone) {
            if (proxy_error.ok()) return ok_status();
            return fail(proxy_error.with_context(
                fmt::format("cuda all-to-all rank {}, host proxy", cfg.rank)));
        }
        std::atomic_thread_fence(std::memory_order_acquire);
        const uint32_t phase_id = e->phase, peer = e->peer, seq = e->seq;
        const uint64_t value = e->value, want = e->want;
        std::string where = fmt::format("cuda all-to-all rank {}, call {}, {}", cfg.rank, seq,
                                        phase_name(phase_id));
        if (!proxy_error.ok()) where += fmt::format(" (host proxy: {})", proxy_error.message());
        switch (code) {
            case cuda::DeviceError::kTimeout:
                return fail(timeout_error(fmt::format(
                    "{}: waited {} ms for rank {} (arrival counter at {}, expected {}); is every "
                    "rank making the same calls?",
                    where, to_ms(opt.timeout), peer, value, want)));
            case cuda::DeviceError::kConfig:
                return fail(invalid_argument(fmt::format(
                    "{}: rank {} runs a different AllToAllConfig (hash {:08x}, ours {:08x})", where,
                    peer, value, want)));
            case cuda::DeviceError::kCapacity:
                return fail(invalid_argument(fmt::format(
                    "{}: a local expert got row {} from rank {}, past the {} rows per expert of "
                    "the batch's slabs (CudaExpertBatch::capacity); size it for every token of "
                    "every rank (does a token name one expert twice?)",
                    where, value, peer, want)));
            case cuda::DeviceError::kTooMany:
                return fail(invalid_argument(
                    fmt::format("{}: the device token count is {}, above max_tokens_per_rank {}",
                                where, value, want)));
            default:
                return fail(protocol_error(fmt::format(
                    "{}: inconsistent data from rank {} (seen {:#x}, expected {:#x}); buffers were "
                    "overwritten or a rank skipped a call",
                    where, peer, value, want)));
        }
    }

    Status begin(Phase want, const char* call) {
        if (phase == Phase::kBroken)
            return broken.with_context(fmt::format(
                "{} refused: an earlier call failed and peers' buffers may be in an unknown "
                "state; recreate the all-to-all",
                call));
        FERRY_RETURN_IF_ERROR(device_status());
        if (phase != want)
            return invalid_argument(
                fmt::format("{} called out of order: the last call was {}; the order per layer is "
                            "dispatch_send, dispatch_recv, combine_send, combine_recv",
                            call, last_call(phase)));
        FERRY_CUDA_TRY(cudaSetDevice(device));
        return ok_status();
    }

    // combine_recv (bf16 false: out is fp32) and combine_recv_bf16.
    Status combine_recv(bool bf16, void* out, const float* weights, void* stream) {
        const char* call = bf16 ? "combine_recv_bf16" : "combine_recv";
        FERRY_RETURN_IF_ERROR(begin(Phase::kCombineSent, call));
        if (!out || reinterpret_cast<uintptr_t>(out) % 16 != 0)
            return invalid_argument(
                fmt::format("{}: out must be a 16-byte aligned device pointer", call));
        if (weights && cfg.combine != CombineMode::kPerHit)
            return invalid_argument(fmt::format(
                "{}: per-rank combine weights the partials at the expert's rank with the "
                "dispatched weights; pass no weights, or use CombineMode::kPerHit",
                call));
        float* out_f32 = bf16 ? nullptr : static_cast<float*>(out);
        uint16_t* out_bf16 = bf16 ? static_cast<uint16_t*>(out) : nullptr;
        cudaError_t e =
            cuda::launch_combine_recv(args, out_f32, out_bf16, weights, combine_recv_blocks,
                                      opt.combine.recv_threads, static_cast<cudaStream_t>(stream));
        return launched(e, call, Phase::kIdle);
    }

    Status launched(cudaError_t e, const char* call, Phase next) {
        if (e != cudaSuccess) return fail(FERRY_CUDA_ERROR(e, call));
        phase = next;
        return ok_status();
    }
};

CudaAllToAll::CudaAllToAll(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaAllToAll::~CudaAllToAll() = default;

const AllToAllConfig& CudaAllToAll::config() const { return impl_->cfg; }
int CudaAllToAll::device() const { return impl_->device; }

Result<std::unique_ptr<CudaAllToAll>> CudaAllToAll::create(const AllToAllConfig& cfg,
                                                           const AllGatherFn& allgather,
                                                           const CudaAllToAllOptions& options) {
    FERRY_RETURN_IF_ERROR(cfg.validate());
    const uint32_t w = cfg.world_size, t = cfg.max_tokens_per_rank, k = cfg.experts_per_token;
    // Some rank is on another node exactly when the world spans several nodes.
    const bool has_remote = w > cfg.ranks_per_node;
    if (has_remote && !options.engine)
        return invalid_argument(fmt::format(
            "cuda all-to-all: world {} with {} ranks per node has ranks on other nodes, reached "
            "through the host proxy: set CudaAllToAllOptions::engine to a TransferEngine",
            w, cfg.ranks_per_node));
    if (w > cuda::kMaxCudaWorld)
        return invalid_argument(
            fmt::format("cuda all-to-all: world {} exceeds {}", w, cuda::kMaxCudaWorld));
    if (k > cuda::kMaxCudaTopk)
        return invalid_argument(fmt::format(
            "cuda all-to-all: experts_per_token {} exceeds the {} the combine kernel supports", k,
            cuda::kMaxCudaTopk));
    const auto& dc = options.dispatch;
    const auto& cc = options.combine;
    auto bad_threads = [](uint32_t n, uint32_t need) {
        return n < need || n > 1024 || n % 32 != 0;
    };
    if (dc.send_blocks == 0 || cc.send_blocks == 0 || cc.recv_blocks == 0 ||
        bad_threads(dc.send_threads, std::max(w, k)) || bad_threads(cc.send_threads, w) ||
        bad_threads(cc.recv_threads, 32))
        return invalid_argument(fmt::format(
            "cuda all-to-all: kernel shapes need at least one block and a multiple of 32 "
            "threads up to 1024, at least max(world, top-k) = {} for the send kernels",
            std::max(w, k)));

    int count = 0;
    if (cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess || count == 0)
        return unavailable(fmt::format("cuda all-to-all: no usable GPU ({})",
                                       e == cudaSuccess ? "none visible" : cudaGetErrorString(e)));
    auto impl = std::make_unique<Impl>();
    impl->cfg = cfg;
    impl->opt = options;
    if (options.device >= 0) {
        impl->device = options.device;
    } else {
        FERRY_CUDA_TRY(cudaGetDevice(&impl->device));
    }
    FERRY_CUDA_TRY(cudaSetDevice(impl->device));
    FERRY_CUDA_TRY(cuda::preload_dispatch_kernels());
    FERRY_CUDA_TRY(cuda::preload_combine_kernels());
    FERRY_CUDA_TRY(cuda::preload_quantize_kernels());
    FERRY_CUDA_TRY(cuda::preload_host_gate());
    int64_t clock_offset = 0;
    if (options.trace && has_remote) FERRY_RETURN_IF_ERROR(gpu_clock_offset(&clock_offset));
    // The plan kernel keeps a lane mask per (warp, expert) in shared memory.
    const uint32_t plan_smem = cuda::dispatch_plan_smem(cfg.num_experts, w, k);
    const uint32_t recv_smem = cuda::dispatch_recv_smem(cfg.num_experts, w);
    int smem_optin = 0;
    FERRY_CUDA_TRY(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, impl->device));
    // Static shared memory of the plan kernel (its scan and per-rank words) stays below 8 KiB.
    if (uint64_t{plan_smem} + 8192 > static_cast<uint64_t>(smem_optin) ||
        uint64_t{recv_smem} + 8192 > static_cast<uint64_t>(smem_optin))
        return invalid_argument(fmt::format(
            "cuda all-to-all: {} experts over {} ranks need {} KiB of shared memory in the "
            "dispatch plan kernel; GPU {} allows {} KiB per block",
            cfg.num_experts, w, (plan_smem + 8192) / 1024, impl->device, smem_optin / 1024));
    FERRY_CUDA_TRY(cuda::set_dispatch_smem(plan_smem, recv_smem));

    const RowFormat row = RowFormat::of(cfg);
    const CountsFormat cf = CountsFormat::of(cfg);
    SharedLayout lay;
    lay.ctr_counts = 0;
    lay.ctr_dispatch = 8ull * w;
    lay.ctr_combine = 16ull * w;
    lay.counts = align256(24ull * w);
    lay.dispatch = lay.counts + align256(uint64_t{w} * cf.bytes);
    lay.combine = lay.dispatch + align256(uint64_t{w} * t * row.row_bytes);
    // With remote ranks, their results land in a compact area after the slots.
    const uint64_t combine_rows = uint64_t{t} * k * (has_remote ? 2 : 1);
    lay.total = lay.combine + align256(combine_rows * cfg.hidden * sizeof(uint16_t));

    const uint64_t max_rows = max_expert_rows(cfg);
    // Local scratch, one allocation carved in 256-byte aligned pieces.
    uint64_t at = 0;
    auto take = [&at](uint64_t bytes) {
        uint64_t o = at;
        at += align256(bytes);
        return o;
    };
    const uint64_t o_state = take(sizeof(cuda::DeviceState));
    const uint64_t o_peers = take(sizeof(uint8_t*) * w);
    const uint64_t o_mask = take(sizeof(uint64_t) * t);
    const uint64_t o_pos = take(sizeof(uint32_t) * uint64_t{t} * w);
    const uint64_t o_ecount = take(sizeof(uint32_t) * cfg.num_experts);
    const uint64_t o_rows = take(sizeof(uint32_t) * w);
    const uint64_t o_idx = take(sizeof(int32_t) * uint64_t{t} * k);
    const uint64_t o_wt = take(sizeof(float) * uint64_t{t} * k);
    const uint64_t o_src = take(sizeof(cuda::RowSource) * max_rows);
    const uint64_t o_out_row = take(sizeof(uint32_t) * max_rows);
    const uint64_t o_tickets = take(sizeof(unsigned long long) * cuda::kTickets);
    const uint64_t o_cslot = take(has_remote ? sizeof(uint32_t) * uint64_t{t} * k : 0);
    const uint64_t o_cpos = take(has_remote ? sizeof(uint32_t) * max_rows : 0);
    const uint64_t o_place = take(sizeof(uint32_t) * uint64_t{t} * k);
    const uint64_t o_hit_base = take(has_remote ? sizeof(uint32_t) * uint64_t{t} * w : 0);
    const uint64_t o_recv_hits = take(sizeof(uint32_t) * w);
    const uint64_t o_counts_mirror = take(has_remote ? uint64_t{w} * cf.bytes : 0);
    const bool per_rank = cfg.combine == CombineMode::kPerRank;
    const uint64_t recv_rows = uint64_t{w} * t;  // every sender may send every token here
    const uint64_t o_recv_o = take(per_rank ? sizeof(uint32_t) * recv_rows * k : 0);
    const uint64_t o_recv_w = take(per_rank ? sizeof(float) * recv_rows * k : 0);
    const uint64_t o_recv_token = take(per_rank ? sizeof(uint32_t) * recv_rows : 0);
    const uint64_t o_recv_start = take(per_rank ? sizeof(uint32_t) * (w + 1) : 0);
    // Streamed combine (KernelArgs::piece_rows): pieces of whole rows within a proxy write.
    const uint64_t combine_row = uint64_t{cfg.hidden} * sizeof(uint16_t);
    const uint32_t piece_rows = has_remote && !per_rank && options.stream_combine &&
                                        options.proxy_chunk_bytes >= combine_row
                                    ? static_cast<uint32_t>(std::min<uint64_t>(
                                          options.proxy_chunk_bytes / combine_row, uint64_t{t} * k))
                                    : 0;
    const uint32_t max_pieces = piece_rows ? (t * k + piece_rows - 1) / piece_rows : 0;
    // The proxy's immediates (DeviceProxy::data_imm, record_imm, piece_imm) must not wrap
    // around to values other users of the engine hold.
    const uint64_t imm_end = uint64_t{options.imm_base} +
                             uint64_t{2} * proxy::kParts * kMaxWorldSize + uint64_t{max_pieces} * w;
    if (has_remote && imm_end > (uint64_t{1} << 32))
        return invalid_argument(fmt::format(
            "cuda all-to-all: CudaAllToAllOptions::imm_base {:#x} leaves no room for the {} "
            "immediates the host proxy uses here; choose a base at or below {:#x}",
            options.imm_base, imm_end - options.imm_base,
            (uint64_t{1} << 32) - (imm_end - options.imm_base)));
    const uint64_t stream_words = uint64_t{w} * max_pieces;
    const uint64_t o_piece_done = take(sizeof(uint32_t) * stream_words);
    const uint64_t o_cinv = take(piece_rows ? sizeof(uint32_t) * max_rows : 0);
    const uint64_t o_piece_seen = take(piece_rows ? sizeof(unsigned long long) * w : 0);
    const uint64_t o_combine_base = take(piece_rows ? sizeof(uint32_t) * w : 0);
    const uint64_t o_trace =
        take(options.trace ? sizeof(unsigned long long) * 2 * cuda::kTracePoints : 0);

    FERRY_CUDA_TRY(cudaMalloc(&impl->shared, lay.total));
    FERRY_CUDA_TRY(cudaMemset(impl->shared, 0, lay.total));
    FERRY_CUDA_TRY(cudaMalloc(&impl->local, at));
    FERRY_CUDA_TRY(cudaMemset(impl->local, 0, at));
    FERRY_CUDA_TRY(cudaHostAlloc(reinterpret_cast<void**>(&impl->err_host),
                                 sizeof(cuda::DeviceError), cudaHostAllocMapped));
    std::memset(impl->err_host, 0, sizeof(cuda::DeviceError));
    cuda::DeviceError* err_dev = nullptr;
    FERRY_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev), impl->err_host, 0));

    // Remote peers: one outbox slab per remote rank, laid out like its inbox (the region, then
    // the record slots), so kernels address remote and mapped peers alike.
    std::vector<uint32_t> remotes;
    uint64_t remote_mask = 0;
    for (uint32_t r = 0; r < w; ++r) {
        if (cfg.same_node(r, cfg.rank)) continue;
        remotes.push_back(r);
        remote_mask |= 1ull << r;
    }
    const uint64_t slab = align4k(proxy_inbox_bytes(lay, w));
    proxy::Publish* publish_dev = nullptr;
    uint32_t* stream_ready_dev = nullptr;
    uint8_t* outbox_dev = nullptr;
    uint8_t* inbox_dev = nullptr;
    std::vector<uint8_t> remote_blob;
    if (has_remote) {
        TransferEngine* engine = options.engine;
        const size_t publish_bytes = sizeof(proxy::Publish) * w * proxy::kParts;
        FERRY_CUDA_TRY(cudaHostAlloc(&impl->publish, publish_bytes, cudaHostAllocMapped));
        std::memset(impl->publish, 0, publish_bytes);
        FERRY_CUDA_TRY(
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&publish_dev), impl->publish, 0));
        if (stream_words) {
            const size_t bytes = sizeof(uint32_t) * stream_words;
            FERRY_CUDA_TRY(cudaHostAlloc(&impl->stream_ready, bytes, cudaHostAllocMapped));
            std::memset(impl->stream_ready, 0, bytes);
            FERRY_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(&stream_ready_dev),
                                                    impl->stream_ready, 0));
        }
        const uint64_t outbox_bytes = slab * remotes.size();
        FERRY_CUDA_TRY(cudaHostAlloc(&impl->outbox, outbox_bytes, cudaHostAllocMapped));
        std::memset(impl->outbox, 0, outbox_bytes);
        FERRY_CUDA_TRY(
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&outbox_dev), impl->outbox, 0));
        // Kernels read remote peers' bytes and counters straight from the inbox: the proxy
        // needs no CUDA stream (see device_proxy.h).
        FERRY_CUDA_TRY(cudaHostAlloc(&impl->inbox, slab, cudaHostAllocMapped));
        std::memset(impl->inbox, 0, slab);
        FERRY_CUDA_TRY(
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&inbox_dev), impl->inbox, 0));
        FERRY_ASSIGN_OR_RETURN(impl->outbox_mr,
                               engine->register_memory(impl->outbox, outbox_bytes));
        FERRY_ASSIGN_OR_RETURN(impl->inbox_mr, engine->register_memory(impl->inbox, slab));
        ByteWriter bw;
        engine->address().encode(bw);
        impl->inbox_mr->descriptor().encode(bw);
        remote_blob = bw.take();
    }
    // Zeroed counters must be in place before any peer learns where they are.
    FERRY_CUDA_TRY(cudaDeviceSynchronize());

    PeerBlob mine;
    mine.rank = cfg.rank;
    mine.config_hash = cfg.hash();
    mine.host_id = host_id();
    mine.pid = static_cast<int32_t>(getpid());
    mine.device = impl->device;
    mine.dispatch_blocks = dc.send_blocks;
    mine.combine_blocks = cc.send_blocks;
    mine.piece_rows = piece_rows;
    int sms = 0;
    FERRY_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, impl->device));
    mine.sm_count = static_cast<uint32_t>(sms);
    mine.base = reinterpret_cast<uint64_t>(impl->shared);
    FERRY_CUDA_TRY(cudaIpcGetMemHandle(&mine.handle, impl->shared));
    mine.remote_bytes = static_cast<uint32_t>(remote_blob.size());
    std::vector<uint8_t> blob(sizeof(PeerBlob));
    std::memcpy(blob.data(), &mine, sizeof(mine));
    blob.insert(blob.end(), remote_blob.begin(), remote_blob.end());
    FERRY_ASSIGN_OR_RETURN(auto blobs, allgather(blob));
    if (blobs.size() != w)
        return invalid_argument(fmt::format(
            "cuda all-to-all: the allgather returned {} blobs for world {}", blobs.size(), w));
    std::vector<PeerBlob> peers(w);
    std::vector<uint64_t> hashes(w);
    for (uint32_t r = 0; r < w; ++r) {
        if (blobs[r].size() < sizeof(PeerBlob) ||
            blobs[r].size() !=
                sizeof(PeerBlob) + reinterpret_cast<const PeerBlob*>(blobs[r].data())->remote_bytes)
            return protocol_error(fmt::format(
                "cuda all-to-all: rank {} sent a {}-byte setup blob that does not match its "
                "header (another ferry version?)",
                r, blobs[r].size()));
        std::memcpy(&peers[r], blobs[r].data(), sizeof(PeerBlob));
        if (peers[r].magic != kBlobMagic || peers[r].rank != r)
            return protocol_error(fmt::format(
                "cuda all-to-all: setup blob {} is not a cuda all-to-all blob of rank {}", r, r));
        hashes[r] = peers[r].config_hash;
    }
    FERRY_RETURN_IF_ERROR(check_same_config(cfg, hashes));
    std::vector<uint8_t*> bases(w);
    DeviceProxySetup ps;
    ps.peer.resize(w);
    ps.inbox.resize(w);
    ps.outbox_offset.resize(w);
    for (uint32_t r = 0; r < w; ++r) {
        const PeerBlob& p = peers[r];
        if (p.dispatch_blocks != dc.send_blocks || p.combine_blocks != cc.send_blocks)
            return invalid_argument(fmt::format(
                "cuda all-to-all: rank {} launches {}/{} dispatch/combine send blocks, this rank "
                "{}/{}; arrival counts depend on them, so every rank must use the same",
                r, p.dispatch_blocks, p.combine_blocks, dc.send_blocks, cc.send_blocks));
        if (p.piece_rows != piece_rows)
            return invalid_argument(fmt::format(
                "cuda all-to-all: rank {} streams the combine in pieces of {} rows, this rank in "
                "pieces of {} (0: not streamed); a rank reads a peer's rows by the peer's pieces, "
                "so every rank must pass the same stream_combine and proxy_chunk_bytes",
                r, p.piece_rows, piece_rows));
        if ((remote_mask >> r) & 1) {
            // Its kernels' stores for this peer go to its outbox; the proxy does the rest.
            if (p.remote_bytes == 0)
                return invalid_argument(fmt::format(
                    "cuda all-to-all: rank {} is on another node but has no TransferEngine "
                    "(CudaAllToAllOptions::engine)",
                    r));
            ByteReader rd(std::span<const uint8_t>(blobs[r]).subspan(sizeof(PeerBlob)));
            auto address = EngineAddress::decode(rd);
            if (!address.ok())
                return address.status().with_context(fmt::format("cuda all-to-all rank {}", r));
            FERRY_ASSIGN_OR_RETURN(ps.inbox[r], MemoryDescriptor::decode(rd));
            FERRY_ASSIGN_OR_RETURN(ps.peer[r], options.engine->connect(*address));
            const size_t i = std::find(remotes.begin(), remotes.end(), r) - remotes.begin();
            ps.outbox_offset[r] = slab * i;
            bases[r] = outbox_dev + slab * i;
            continue;
        }
        if (p.host_id != mine.host_id)
            return invalid_argument(fmt::format(
                "cuda all-to-all: ranks_per_node {} puts ranks {} and {} on one node, but they "
                "run on different hosts; set ranks_per_node to the ranks per host",
                cfg.ranks_per_node, cfg.rank, r));
        if (r == cfg.rank) {
            bases[r] = static_cast<uint8_t*>(impl->shared);
        } else if (p.pid == mine.pid) {
            // Same process: the pointer is valid here; peer access makes it reachable.
            bases[r] = reinterpret_cast<uint8_t*>(p.base);
            if (p.device != impl->device) {
                int can = 0;
                FERRY_CUDA_TRY(cudaDeviceCanAccessPeer(&can, impl->device, p.device));
                if (!can)
                    return unavailable(
                        fmt::format("cuda all-to-all: GPU {} cannot access GPU {} (no peer access)",
                                    impl->device, p.device));
                cudaError_t e = cudaDeviceEnablePeerAccess(p.device, 0);
                if (e == cudaErrorPeerAccessAlreadyEnabled) {
                    cudaGetLastError();  // clears the sticky-free "already enabled"
                } else if (e != cudaSuccess) {
                    return FERRY_CUDA_ERROR(e, "cudaDeviceEnablePeerAccess");
                }
            }
        } else {
            void* ptr = nullptr;
            cudaError_t e = cudaIpcOpenMemHandle(&ptr, p.handle, cudaIpcMemLazyEnablePeerAccess);
            if (e != cudaSuccess)
                return FERRY_CUDA_ERROR(
                    e, fmt::format("cudaIpcOpenMemHandle of rank {} (GPU {})", r, p.device));
            impl->opened.push_back(ptr);
            bases[r] = static_cast<uint8_t*>(ptr);
        }
    }
    // Kernels wait inside for peers' kernels, so every rank's kernel must be resident at once.
    // With one rank per GPU that holds by itself; ranks sharing a GPU split its SMs: no grid
    // is larger than SMs / (most ranks on one GPU) - 1, so the blocks of all of them fit even
    // at one block per SM, with an SM left per rank for the one-block plan kernel (512
    // threads, which may not share an SM with a send block). Every rank derives the same
    // shapes from the same blobs.
    uint32_t share = 1, min_sms = UINT32_MAX;
    for (uint32_t r = 0; r < w; ++r) {
        uint32_t on_device = 0;
        for (uint32_t q = 0; q < w; ++q)
            on_device += peers[q].host_id == peers[r].host_id && peers[q].device == peers[r].device;
        share = std::max(share, on_device);
        min_sms = std::min(min_sms, peers[r].sm_count);
    }
    auto fit = [&](uint32_t blocks) {
        const uint32_t per_rank = min_sms / share;
        return share == 1 ? blocks : std::min(blocks, per_rank > 1 ? per_rank - 1 : 1u);
    };
    impl->dispatch_send_blocks = fit(dc.send_blocks);
    impl->combine_send_blocks = fit(cc.send_blocks);
    impl->combine_recv_blocks = fit(cc.recv_blocks);

    auto* local = static_cast<uint8_t*>(impl->local);
    FERRY_CUDA_TRY(
        cudaMemcpy(local + o_peers, bases.data(), sizeof(uint8_t*) * w, cudaMemcpyHostToDevice));

    cuda::KernelArgs& a = impl->args;
    a.rank = cfg.rank;
    a.world = w;
    a.hidden = cfg.hidden;
    a.topk = k;
    a.num_experts = cfg.num_experts;
    a.local_experts = cfg.num_local_experts();
    a.private_slots = cfg.private_slots_per_sender;
    a.max_tokens = t;
    a.alignment = cfg.group_alignment;
    a.hash32 = static_cast<uint32_t>(cfg.hash());
    a.payload_bytes = static_cast<uint32_t>(cfg.payload_bytes());
    a.scales_per_token = cfg.scales_per_token();
    a.row_bytes = static_cast<uint32_t>(row.row_bytes);
    a.payload_offset = static_cast<uint32_t>(row.payload_offset);
    a.scale_offset = static_cast<uint32_t>(row.scale_offset);
    a.place_offset = static_cast<uint32_t>(row.place_offset);
    a.hit_base_offset = static_cast<uint32_t>(row.hit_base_offset);
    a.weight_offset = static_cast<uint32_t>(row.weight_offset);
    a.combine_per_rank = per_rank ? 1u : 0u;
    a.plan_smem = plan_smem;
    a.recv_smem = recv_smem;
    a.counts_bytes = static_cast<uint32_t>(cf.bytes);
    a.counts_hits_word = cf.hits_per_expert;
    a.max_rows = static_cast<uint32_t>(max_rows);
    a.dispatch_send_blocks = impl->dispatch_send_blocks;
    a.combine_send_blocks = impl->combine_send_blocks;
    // A warp per received row; two blocks per SM when the GPU is this rank's alone.
    a.dispatch_recv_blocks = fit(2 * min_sms);
    a.timeout_ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(options.timeout).count());
    a.lay = lay;
    a.peers = reinterpret_cast<uint8_t* const*>(local + o_peers);
    a.self = static_cast<uint8_t*>(impl->shared);
    a.state = reinterpret_cast<cuda::DeviceState*>(local + o_state);
    a.err = err_dev;
    a.dest_mask = reinterpret_cast<uint64_t*>(local + o_mask);
    a.row_pos = reinterpret_cast<uint32_t*>(local + o_pos);
    a.place = reinterpret_cast<uint32_t*>(local + o_place);
    a.hit_base = has_remote ? reinterpret_cast<uint32_t*>(local + o_hit_base) : nullptr;
    a.recv_hits = reinterpret_cast<uint32_t*>(local + o_recv_hits);
    a.counts_mirror = has_remote ? local + o_counts_mirror : nullptr;
    a.expert_counts = reinterpret_cast<uint32_t*>(local + o_ecount);
    a.rows_to = reinterpret_cast<uint32_t*>(local + o_rows);
    a.indices = reinterpret_cast<int32_t*>(local + o_idx);
    a.weights = reinterpret_cast<float*>(local + o_wt);
    a.row_src = reinterpret_cast<cuda::RowSource*>(local + o_src);
    a.out_row = reinterpret_cast<uint32_t*>(local + o_out_row);
    a.remote_mask = remote_mask;
    a.publish = publish_dev;
    a.inbox = inbox_dev;
    a.proxy_abort = has_remote
                        ? reinterpret_cast<const uint32_t*>(inbox_dev + proxy_abort_offset(lay, w))
                        : nullptr;
    a.tickets = reinterpret_cast<unsigned long long*>(local + o_tickets);
    a.combine_slot = has_remote ? reinterpret_cast<uint32_t*>(local + o_cslot) : nullptr;
    a.combine_pos = has_remote ? reinterpret_cast<uint32_t*>(local + o_cpos) : nullptr;
    a.remote_combine = t * k;
    a.piece_rows = piece_rows;
    a.max_pieces = max_pieces;
    a.piece_done = piece_rows ? reinterpret_cast<uint32_t*>(local + o_piece_done) : nullptr;
    a.stream_ready = stream_ready_dev;
    a.combine_inv = piece_rows ? reinterpret_cast<uint32_t*>(local + o_cinv) : nullptr;
    a.piece_seen =
        piece_rows ? reinterpret_cast<unsigned long long*>(local + o_piece_seen) : nullptr;
    a.combine_base = piece_rows ? reinterpret_cast<uint32_t*>(local + o_combine_base) : nullptr;
    a.piece_words = proxy_piece_word_offset(lay, w, 0);
    a.recv_o = per_rank ? reinterpret_cast<uint32_t*>(local + o_recv_o) : nullptr;
    a.recv_w = per_rank ? reinterpret_cast<float*>(local + o_recv_w) : nullptr;
    a.recv_token = per_rank ? reinterpret_cast<uint32_t*>(local + o_recv_token) : nullptr;
    a.recv_start = per_rank ? reinterpret_cast<uint32_t*>(local + o_recv_start) : nullptr;
    a.early_launch = options.early_launch && share == 1 ? 1u : 0u;
    a.fused_plan =
        options.fuse_plan && share <= 2 && cuda::dispatch_send_fuses_plan(dc.send_threads) ? 1u
                                                                                           : 0u;
    a.trace = options.trace ? reinterpret_cast<unsigned long long*>(local + o_trace) : nullptr;

    if (has_remote) {
        ps.engine = options.engine;
        ps.rank = cfg.rank;
        ps.world = w;
        ps.imm_base = options.imm_base;
        ps.layout = lay;
        ps.counts_bytes = cf.bytes;
        ps.dispatch_blocks = impl->dispatch_send_blocks;
        ps.combine_blocks = impl->combine_send_blocks;
        ps.timeout = options.timeout;
        ps.idle_spin = options.proxy_idle_spin;
        ps.chunk_bytes = options.proxy_chunk_bytes;
        ps.trace = options.trace;
        ps.clock_offset_ns = clock_offset;
        ps.remote.resize(w);
        for (uint32_t r = 0; r < w; ++r) ps.remote[r] = (remote_mask >> r) & 1;
        ps.publish = static_cast<const proxy::Publish*>(impl->publish);
        ps.stream_ready = static_cast<const uint32_t*>(impl->stream_ready);
        ps.stream_piece_bytes = uint64_t{piece_rows} * combine_row;
        ps.stream_max_pieces = max_pieces;
        ps.outbox = impl->outbox_mr.get();
        ps.inbox_data = static_cast<uint8_t*>(impl->inbox);
        impl->proxy = std::make_unique<DeviceProxy>(std::move(ps));
        impl->proxy->start();
    }
    return std::unique_ptr<CudaAllToAll>(new CudaAllToAll(std::move(impl)));
}

Status CudaAllToAll::dispatch_send(const CudaDispatchInput& in, void* stream) {
    Impl& m = *impl_;
    FERRY_RETURN_IF_ERROR(m.begin(Phase::kIdle, "dispatch_send"));
    if (!in.x || (!in.indices && !in.indices64) || !in.weights || !in.num_tokens ||
        (m.cfg.dtype == DType::kFp8E4M3 && !in.x_scale))
        return invalid_argument(
            "dispatch_send: x, indices or indices64, weights, num_tokens (and x_scale for fp8) "
            "must be device pointers");
    if (in.indices && in.indices64)
        return invalid_argument("dispatch_send: give indices or indices64, not both");
    if (reinterpret_cast<uintptr_t>(in.x) % 16 != 0)
        return invalid_argument("dispatch_send: x must be 16-byte aligned");
    cudaError_t e = cuda::launch_dispatch_send(
        m.args, in.x, in.x_scale, in.indices, in.indices64, in.weights, in.num_tokens,
        m.dispatch_send_blocks, m.opt.dispatch.send_threads, static_cast<cudaStream_t>(stream));
    return m.launched(e, "dispatch_send launch", Phase::kDispatchSent);
}

Status CudaAllToAll::dispatch_recv(const CudaExpertBatch& out, void* stream) {
    Impl& m = *impl_;
    FERRY_RETURN_IF_ERROR(m.begin(Phase::kDispatchSent, "dispatch_recv"));
    if (!out.x || !out.counts || !out.offsets || (m.cfg.dtype == DType::kFp8E4M3 && !out.x_scale))
        return invalid_argument(
            "dispatch_recv: x, counts, offsets (and x_scale for fp8) must be device pointers "
            "sized for max_expert_rows(cfg) rows");
    if (uint64_t{out.capacity} * m.cfg.num_local_experts() > UINT32_MAX)
        return invalid_argument(
            fmt::format("dispatch_recv: {} local experts x capacity {} rows exceed 2^32 rows",
                        m.cfg.num_local_experts(), out.capacity));
    cudaError_t e = cuda::launch_dispatch_recv(m.args, out.x, out.x_scale, out.counts, out.offsets,
                                               reinterpret_cast<cuda::RowSource*>(out.sources),
                                               out.capacity, static_cast<cudaStream_t>(stream));
    return m.launched(e, "dispatch_recv launch", Phase::kDispatchReceived);
}

Status CudaAllToAll::combine_send(const uint16_t* expert_out, void* stream) {
    Impl& m = *impl_;
    FERRY_RETURN_IF_ERROR(m.begin(Phase::kDispatchReceived, "combine_send"));
    if (!expert_out || reinterpret_cast<uintptr_t>(expert_out) % 16 != 0)
        return invalid_argument(
            "combine_send: expert_out must be a 16-byte aligned device pointer");
    cudaError_t e =
        cuda::launch_combine_send(m.args, expert_out, m.combine_send_blocks,
                                  m.opt.combine.send_threads, static_cast<cudaStream_t>(stream));
    return m.launched(e, "combine_send launch", Phase::kCombineSent);
}

Status CudaAllToAll::combine_recv(float* out, void* stream, const float* weights) {
    return impl_->combine_recv(false, out, weights, stream);
}

Status CudaAllToAll::combine_recv_bf16(uint16_t* out, void* stream, const float* weights) {
    return impl_->combine_recv(true, out, weights, stream);
}

Result<std::vector<CudaTraceStamp>> CudaAllToAll::last_trace() {
    Impl& m = *impl_;
    if (!m.args.trace)
        return invalid_argument("cuda all-to-all: last_trace needs options.trace at create()");
    static constexpr const char* kNames[] = {
        "plan begin",         "plan routed",      "plan ranked",        "plan tiles done",
        "plan counts out",    "plan end",         "send begin",         "send counts in",
        "send end",           "recv begin",       "recv rows in",       "recv end",
        "combine send begin", "combine send end", "combine recv begin", "combine recv rows in",
        "combine recv end"};
    static_assert(std::size(kNames) == cuda::kTracePoints, "a name per trace point");
    unsigned long long raw[2 * cuda::kTracePoints];
    FERRY_CUDA_TRY(cudaSetDevice(m.device));
    FERRY_CUDA_TRY(cudaMemcpy(raw, m.args.trace, sizeof(raw), cudaMemcpyDeviceToHost));
    std::vector<CudaTraceStamp> out;
    for (uint32_t p = 0; p < cuda::kTracePoints; ++p) {
        const bool seen = raw[cuda::kTracePoints + p] != 0;
        out.push_back({kNames[p], seen ? raw[p] : 0, seen ? raw[cuda::kTracePoints + p] : 0});
    }
    if (!m.proxy) return out;
    static constexpr const char* kProxyNames[proxy::kParts][5] = {
        {"proxy counts published", "proxy counts seen", "proxy counts posted",
         "proxy counts written", "proxy counts arrived"},
        {"proxy private published", "proxy private seen", "proxy private posted",
         "proxy private written", "proxy private arrived"},
        {"proxy overflow published", "proxy overflow seen", "proxy overflow posted",
         "proxy overflow written", "proxy overflow arrived"},
        {"proxy combine published", "proxy combine seen", "proxy combine posted",
         "proxy combine written", "proxy combine arrived"}};
    const std::vector<ProxyStamps> stamps = m.proxy->last_stamps();
    for (uint32_t part = 0; part < proxy::kParts; ++part) {
        for (uint32_t stage = 0; stage < 5; ++stage) {
            uint64_t first = 0, last = 0;
            bool all = true;
            for (const ProxyStamps& s : stamps) {
                if (s.part != part) continue;
                const uint64_t v = stage == 0   ? s.published
                                   : stage == 1 ? s.seen
                                   : stage == 2 ? s.posted
                                   : stage == 3 ? s.written
                                                : s.arrived;
                all = all && v != 0;
                first = first == 0 ? v : std::min(first, v);
                last = std::max(last, v);
            }
            // A stage some peer has not reached (an empty put has no written) counts as none.
            out.push_back({kProxyNames[part][stage], all ? first : 0, all ? last : 0});
        }
    }
    return out;
}

Status CudaAllToAll::synchronize(void* stream) {
    Impl& m = *impl_;
    FERRY_CUDA_TRY(cudaSetDevice(m.device));
    // Kernels give up on their own after the timeout; the margin covers several waits in a
    // row plus the kernels' own work.
    TimePoint deadline = deadline_after(m.opt.timeout * 4 + std::chrono::seconds(5));
    auto s = static_cast<cudaStream_t>(stream);
    for (;;) {
        cudaError_t e = cudaStreamQuery(s);
        if (e == cudaSuccess) break;
        if (e != cudaErrorNotReady) return m.fail(FERRY_CUDA_ERROR(e, "cuda all-to-all stream"));
        if (Clock::now() > deadline) {
            FERRY_RETURN_IF_ERROR(m.device_status());
            return m.fail(timeout_error(fmt::format(
                "cuda all-to-all rank {}: the stream did not finish within {} ms and no kernel "
                "reported where it is stuck (is another kernel on this stream blocking?)",
                m.cfg.rank, to_ms(m.opt.timeout * 4 + std::chrono::seconds(5)))));
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return m.device_status();
}

Status CudaAllToAll::device_status() { return impl_->device_status(); }

Status CudaAllToAll::set_combine_weights(const float* weights, void* stream) {
    Impl& m = *impl_;
    if (m.phase == Phase::kIdle || m.phase == Phase::kBroken)
        return invalid_argument(
            "set_combine_weights: no dispatch in flight; call it between dispatch_send and "
            "combine_recv");
    if (m.cfg.combine != CombineMode::kPerHit)
        return invalid_argument(
            "set_combine_weights: per-rank combine weights the partials at the expert's rank "
            "with the dispatched weights; use CombineMode::kPerHit");
    if (!weights) return invalid_argument("set_combine_weights: weights must be a device pointer");
    FERRY_CUDA_TRY(cudaSetDevice(m.device));
    const size_t bytes =
        sizeof(float) * size_t{m.cfg.max_tokens_per_rank} * m.cfg.experts_per_token;
    cudaError_t e = cudaMemcpyAsync(m.args.weights, weights, bytes, cudaMemcpyDeviceToDevice,
                                    static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) return m.fail(FERRY_CUDA_ERROR(e, "set_combine_weights copy"));
    return ok_status();
}

Status cuda_quantize_fp8(const uint16_t* x, uint32_t tokens, uint32_t hidden, uint8_t* q,
                         float* scales, void* stream) {
    if (hidden == 0 || hidden % kScaleBlock != 0)
        return invalid_argument(fmt::format("fp8 block quantization needs hidden % {} == 0, got {}",
                                            kScaleBlock, hidden));
    cudaError_t e =
        cuda::launch_quantize_fp8(x, tokens, hidden, q, scales, static_cast<cudaStream_t>(stream));
    return FERRY_CUDA_ERROR(e, "fp8 quantize launch");
}

Status cuda_dequantize_fp8_to_bf16(const uint8_t* q, const float* scales, uint32_t tokens,
                                   uint32_t hidden, uint16_t* out, void* stream,
                                   const uint32_t* tokens_dev) {
    if (hidden == 0 || hidden % kScaleBlock != 0)
        return invalid_argument(
            fmt::format("fp8 block dequantization needs hidden % {} == 0, "
                        "got {}",
                        kScaleBlock, hidden));
    cudaError_t e = cuda::launch_dequantize_fp8(q, scales, tokens, tokens_dev, hidden, out,
                                                static_cast<cudaStream_t>(stream));
    return FERRY_CUDA_ERROR(e, "fp8 dequantize launch");
}

Status cuda_host_gate(const uint32_t* flag, uint32_t want, Duration timeout, void* stream) {
    uint32_t* dev = nullptr;
    if (cudaError_t e = cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev),
                                                 const_cast<uint32_t*>(flag), 0);
        e != cudaSuccess)
        return FERRY_CUDA_ERROR(
            e, "cuda_host_gate: the flag must be pinned host memory mapped into the device");
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
    cudaError_t e =
        cuda::launch_host_gate(dev, want, static_cast<uint64_t>(std::max<int64_t>(ns, 0)),
                               static_cast<cudaStream_t>(stream));
    return FERRY_CUDA_ERROR(e, "host gate launch");
}

}  // namespace ferry::moe
