// Host side of the CUDA all-to-all: create() in steps (the workspace plan and the grids,
// pure functions in moe/cuda_workspace.h; the kernels loaded; the memory allocated; the peer
// exchange and mapping; the argument block; the host proxy for ranks on other nodes), argument
// checks and kernel launches per call, and the translation of the device-side error record
// into a Status. See include/ferry/moe/cuda_all_to_all.h.
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
#include "common/enum_names.h"
#include "ferry/common/bytes.h"
#include "ferry/moe/numerics.h"
#include "moe/cuda/kernels.h"
#include "moe/cuda_workspace.h"
#include "moe/device_proxy.h"

namespace ferry::moe {

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

const char* phase_name(uint32_t phase) {
    static constexpr EnumName<uint32_t> kNames[] = {
        {cuda::DeviceError::kPlan, "dispatch_send (routing)"},
        {cuda::DeviceError::kSendWaitCounts, "dispatch_send (waiting for counts)"},
        {cuda::DeviceError::kRecvWaitRows, "dispatch_recv (waiting for rows)"},
        {cuda::DeviceError::kRecvRows, "dispatch_recv (reading rows)"},
        {cuda::DeviceError::kCombineSend, "combine_send"},
        {cuda::DeviceError::kCombineRecvWait, "combine_recv (waiting for results)"},
    };
    return name_of(kNames, phase, "an unknown phase").data();
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
    static constexpr EnumName<Phase> kNames[] = {
        {Phase::kIdle, "combine_recv (or nothing yet)"},
        {Phase::kDispatchSent, "dispatch_send"},
        {Phase::kDispatchReceived, "dispatch_recv"},
        {Phase::kCombineSent, "combine_send"},
    };
    return name_of(kNames, p, "a failed call").data();
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
    // Device views of the mapped host memory (err_host and the remote peers' buffers below).
    struct {
        cuda::DeviceError* err = nullptr;
        proxy::Publish* publish = nullptr;
        uint32_t* stream_ready = nullptr;
        uint8_t* outbox = nullptr;
        uint8_t* inbox = nullptr;
    } dev;
    uint64_t remote_mask = 0;   // bit r: rank r is on another node
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

    // The steps of create(), in order.
    Status allocate(const CudaWorkspace& ws, std::vector<uint8_t>* remote_blob);
    Status map_peers(const std::vector<PeerBlob>& peers,
                     const std::vector<std::vector<uint8_t>>& blobs, const PeerBlob& mine,
                     const CudaWorkspace& ws, DeviceProxySetup* ps);
    void fill_args(const CudaWorkspace& ws, const CudaGrids& grids, uint32_t plan_smem,
                   uint32_t recv_smem);
    void start_proxy(const CudaWorkspace& ws, int64_t clock_offset, DeviceProxySetup ps);

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

namespace {

// Every kernel family loaded into the device's context before any rank launches (see
// preload_dispatch_kernels), and the dispatch kernels' shared memory opted in.
Status load_kernels(const AllToAllConfig& cfg, int device, uint32_t* plan_smem,
                    uint32_t* recv_smem) {
    FERRY_CUDA_TRY(cuda::preload_dispatch_kernels());
    FERRY_CUDA_TRY(cuda::preload_combine_kernels());
    FERRY_CUDA_TRY(cuda::preload_quantize_kernels());
    FERRY_CUDA_TRY(cuda::preload_host_gate());
    const uint32_t w = cfg.world_size;
    // The plan kernel keeps a lane mask per (warp, expert) in shared memory.
    *plan_smem = cuda::dispatch_plan_smem(cfg.num_experts, w, cfg.experts_per_token);
    *recv_smem = cuda::dispatch_recv_smem(cfg.num_experts, w);
    int smem_optin = 0;
    FERRY_CUDA_TRY(
        cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    // Static shared memory of the plan kernel (its scan and per-rank words) stays below 8 KiB.
    if (uint64_t{*plan_smem} + 8192 > static_cast<uint64_t>(smem_optin) ||
        uint64_t{*recv_smem} + 8192 > static_cast<uint64_t>(smem_optin))
        return invalid_argument(fmt::format(
            "cuda all-to-all: {} experts over {} ranks need {} KiB of shared memory in the "
            "dispatch plan kernel; GPU {} allows {} KiB per block",
            cfg.num_experts, w, (*plan_smem + 8192) / 1024, device, smem_optin / 1024));
    FERRY_CUDA_TRY(cuda::set_dispatch_smem(*plan_smem, *recv_smem));
    return ok_status();
}

// Mapped pinned host memory, zeroed, and its device view.
template <typename T>
Status alloc_mapped(size_t bytes, void** host, T** dev) {
    FERRY_CUDA_TRY(cudaHostAlloc(host, bytes, cudaHostAllocMapped));
    std::memset(*host, 0, bytes);
    FERRY_CUDA_TRY(cudaHostGetDevicePointer(reinterpret_cast<void**>(dev), *host, 0));
    return ok_status();
}

// Every rank's setup blob, checked: its header, its rank, the same config on every rank.
// blobs[r] keeps the bytes after the header (what remote ranks need to reach rank r).
struct PeerExchange {
    std::vector<PeerBlob> peers;
    std::vector<std::vector<uint8_t>> blobs;
};

Result<PeerExchange> exchange_peers(const AllToAllConfig& cfg, const AllGatherFn& allgather,
                                    const PeerBlob& mine, std::span<const uint8_t> remote_blob) {
    const uint32_t w = cfg.world_size;
    std::vector<uint8_t> blob(sizeof(PeerBlob));
    std::memcpy(blob.data(), &mine, sizeof(mine));
    blob.insert(blob.end(), remote_blob.begin(), remote_blob.end());
    PeerExchange x;
    FERRY_ASSIGN_OR_RETURN(x.blobs, allgather(blob));
    if (x.blobs.size() != w)
        return invalid_argument(fmt::format(
            "cuda all-to-all: the allgather returned {} blobs for world {}", x.blobs.size(), w));
    x.peers.resize(w);
    std::vector<uint64_t> hashes(w);
    for (uint32_t r = 0; r < w; ++r) {
        const std::vector<uint8_t>& b = x.blobs[r];
        if (b.size() < sizeof(PeerBlob) ||
            b.size() !=
                sizeof(PeerBlob) + reinterpret_cast<const PeerBlob*>(b.data())->remote_bytes)
            return protocol_error(fmt::format(
                "cuda all-to-all: rank {} sent a {}-byte setup blob that does not match its "
                "header (another ferry version?)",
                r, b.size()));
        std::memcpy(&x.peers[r], b.data(), sizeof(PeerBlob));
        if (x.peers[r].magic != kBlobMagic || x.peers[r].rank != r)
            return protocol_error(fmt::format(
                "cuda all-to-all: setup blob {} is not a cuda all-to-all blob of rank {}", r, r));
        hashes[r] = x.peers[r].config_hash;
    }
    FERRY_RETURN_IF_ERROR(check_same_config(cfg, hashes));
    return x;
}

// Shapes every rank must share: arrival counts depend on the send grids, and a rank reads a
// peer's streamed combine by the peer's pieces.
Status check_same_shapes(const PeerBlob& p, uint32_t r, const PeerBlob& mine) {
    if (p.dispatch_blocks != mine.dispatch_blocks || p.combine_blocks != mine.combine_blocks)
        return invalid_argument(fmt::format(
            "cuda all-to-all: rank {} launches {}/{} dispatch/combine send blocks, this rank "
            "{}/{}; arrival counts depend on them, so every rank must use the same",
            r, p.dispatch_blocks, p.combine_blocks, mine.dispatch_blocks, mine.combine_blocks));
    if (p.piece_rows != mine.piece_rows)
        return invalid_argument(fmt::format(
            "cuda all-to-all: rank {} streams the combine in pieces of {} rows, this rank in "
            "pieces of {} (0: not streamed); a rank reads a peer's rows by the peer's pieces, "
            "so every rank must pass the same stream_combine and proxy_chunk_bytes",
            r, p.piece_rows, mine.piece_rows));
    return ok_status();
}

}  // namespace

// Device memory (the shared region, the scratch), the mapped error record and, with remote
// ranks, the proxy's pinned memory, registered with the engine; zeroed before any peer learns
// where it is. remote_blob gets what ranks on other nodes need to reach this one.
Status CudaAllToAll::Impl::allocate(const CudaWorkspace& ws, std::vector<uint8_t>* remote_blob) {
    FERRY_CUDA_TRY(cudaMalloc(&shared, ws.shared.total));
    FERRY_CUDA_TRY(cudaMemset(shared, 0, ws.shared.total));
    FERRY_CUDA_TRY(cudaMalloc(&local, ws.scratch.total));
    FERRY_CUDA_TRY(cudaMemset(local, 0, ws.scratch.total));
    void* err = nullptr;
    FERRY_RETURN_IF_ERROR(alloc_mapped(sizeof(cuda::DeviceError), &err, &dev.err));
    err_host = static_cast<cuda::DeviceError*>(err);
    if (ws.remote) {
        FERRY_RETURN_IF_ERROR(alloc_mapped(ws.publish_bytes, &publish, &dev.publish));
        if (ws.stream_ready_bytes)
            FERRY_RETURN_IF_ERROR(
                alloc_mapped(ws.stream_ready_bytes, &stream_ready, &dev.stream_ready));
        FERRY_RETURN_IF_ERROR(alloc_mapped(ws.outbox_bytes, &outbox, &dev.outbox));
        // Kernels read remote peers' bytes and counters straight from the inbox: the proxy
        // needs no CUDA stream (see device_proxy.h).
        FERRY_RETURN_IF_ERROR(alloc_mapped(ws.proxy_slab, &inbox, &dev.inbox));
        TransferEngine* engine = opt.engine;
        FERRY_ASSIGN_OR_RETURN(outbox_mr, engine->register_memory(outbox, ws.outbox_bytes));
        FERRY_ASSIGN_OR_RETURN(inbox_mr, engine->register_memory(inbox, ws.proxy_slab));
        ByteWriter bw;
        engine->address().encode(bw);
        inbox_mr->descriptor().encode(bw);
        *remote_blob = bw.take();
    }
    // Zeroed counters must be in place before any peer learns where they are.
    FERRY_CUDA_TRY(cudaDeviceSynchronize());
    return ok_status();
}

// This rank's view of every peer's region: its own allocation, a same-process peer's pointer
// (peer access enabled), an IPC-opened allocation, or for a rank on another node its outbox
// slab (and the proxy's engine peer and the rank's inbox), written into the scratch's peer
// table.
Status CudaAllToAll::Impl::map_peers(const std::vector<PeerBlob>& peers,
                                     const std::vector<std::vector<uint8_t>>& blobs,
                                     const PeerBlob& mine, const CudaWorkspace& ws,
                                     DeviceProxySetup* ps) {
    const uint32_t w = cfg.world_size;
    std::vector<uint8_t*> bases(w);
    ps->peer.resize(w);
    ps->inbox.resize(w);
    ps->outbox_offset.resize(w);
    ps->remote.resize(w);
    uint64_t remote_index = 0;  // outbox slabs in rank order of the remote ranks
    for (uint32_t r = 0; r < w; ++r) {
        const PeerBlob& p = peers[r];
        FERRY_RETURN_IF_ERROR(check_same_shapes(p, r, mine));
        if (!cfg.same_node(r, cfg.rank)) {
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
            FERRY_ASSIGN_OR_RETURN(ps->inbox[r], MemoryDescriptor::decode(rd));
            FERRY_ASSIGN_OR_RETURN(ps->peer[r], opt.engine->connect(*address));
            ps->remote[r] = true;
            ps->outbox_offset[r] = ws.proxy_slab * remote_index;
            bases[r] = dev.outbox + ws.proxy_slab * remote_index;
            remote_mask |= 1ull << r;
            ++remote_index;
            continue;
        }
        if (p.host_id != mine.host_id)
            return invalid_argument(fmt::format(
                "cuda all-to-all: ranks_per_node {} puts ranks {} and {} on one node, but they "
                "run on different hosts; set ranks_per_node to the ranks per host",
                cfg.ranks_per_node, cfg.rank, r));
        if (r == cfg.rank) {
            bases[r] = static_cast<uint8_t*>(shared);
        } else if (p.pid == mine.pid) {
            // Same process: the pointer is valid here; peer access makes it reachable.
            bases[r] = reinterpret_cast<uint8_t*>(p.base);
            if (p.device != device) {
                int can = 0;
                FERRY_CUDA_TRY(cudaDeviceCanAccessPeer(&can, device, p.device));
                if (!can)
                    return unavailable(
                        fmt::format("cuda all-to-all: GPU {} cannot access GPU {} (no peer access)",
                                    device, p.device));
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
            opened.push_back(ptr);
            bases[r] = static_cast<uint8_t*>(ptr);
        }
    }
    FERRY_CUDA_TRY(cudaMemcpy(static_cast<uint8_t*>(local) + ws.scratch.peers, bases.data(),
                              sizeof(uint8_t*) * w, cudaMemcpyHostToDevice));
    return ok_status();
}

// The argument block every kernel gets: the config's shapes and formats, the grids, and
// where each buffer of the workspace plan landed.
void CudaAllToAll::Impl::fill_args(const CudaWorkspace& ws, const CudaGrids& grids,
                                   uint32_t plan_smem, uint32_t recv_smem) {
    const uint32_t w = cfg.world_size, t = cfg.max_tokens_per_rank, k = cfg.experts_per_token;
    const RowFormat row = RowFormat::of(cfg);
    const CountsFormat cf = CountsFormat::of(cfg);
    const ScratchLayout& o = ws.scratch;
    const bool remote = ws.remote, per_rank = ws.per_rank, streamed = ws.piece_rows != 0;
    auto* l = static_cast<uint8_t*>(local);
    auto at = [l](bool used, uint64_t offset) { return used ? l + offset : nullptr; };
    dispatch_send_blocks = grids.dispatch_send;
    combine_send_blocks = grids.combine_send;
    combine_recv_blocks = grids.combine_recv;

    cuda::KernelArgs& a = args;
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
    a.max_rows = static_cast<uint32_t>(ws.max_rows);
    a.dispatch_send_blocks = grids.dispatch_send;
    a.combine_send_blocks = grids.combine_send;
    a.dispatch_recv_blocks = grids.dispatch_recv;
    a.timeout_ns = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(opt.timeout).count());
    a.lay = ws.shared;
    a.peers = reinterpret_cast<uint8_t* const*>(l + o.peers);
    a.self = static_cast<uint8_t*>(shared);
    a.state = reinterpret_cast<cuda::DeviceState*>(l + o.state);
    a.err = dev.err;
    a.dest_mask = reinterpret_cast<uint64_t*>(l + o.dest_mask);
    a.row_pos = reinterpret_cast<uint32_t*>(l + o.row_pos);
    a.place = reinterpret_cast<uint32_t*>(l + o.place);
    a.hit_base = reinterpret_cast<uint32_t*>(at(remote, o.hit_base));
    a.recv_hits = reinterpret_cast<uint32_t*>(l + o.recv_hits);
    a.counts_mirror = at(remote, o.counts_mirror);
    a.expert_counts = reinterpret_cast<uint32_t*>(l + o.expert_counts);
    a.rows_to = reinterpret_cast<uint32_t*>(l + o.rows_to);
    a.indices = reinterpret_cast<int32_t*>(l + o.indices);
    a.weights = reinterpret_cast<float*>(l + o.weights);
    a.row_src = reinterpret_cast<RowSource*>(l + o.row_src);
    a.out_row = reinterpret_cast<uint32_t*>(l + o.out_row);
    a.remote_mask = remote_mask;
    a.publish = dev.publish;
    a.inbox = dev.inbox;
    a.proxy_abort =
        remote ? reinterpret_cast<const uint32_t*>(dev.inbox + proxy_abort_offset(ws.shared, w))
               : nullptr;
    a.tickets = reinterpret_cast<unsigned long long*>(l + o.tickets);
    a.combine_slot = reinterpret_cast<uint32_t*>(at(remote, o.combine_slot));
    a.combine_pos = reinterpret_cast<uint32_t*>(at(remote, o.combine_pos));
    a.remote_combine = t * k;
    a.piece_rows = ws.piece_rows;
    a.max_pieces = ws.max_pieces;
    a.piece_done = reinterpret_cast<uint32_t*>(at(streamed, o.piece_done));
    a.stream_ready = dev.stream_ready;
    a.combine_inv = reinterpret_cast<uint32_t*>(at(streamed, o.combine_inv));
    a.piece_seen = reinterpret_cast<unsigned long long*>(at(streamed, o.piece_seen));
    a.combine_base = reinterpret_cast<uint32_t*>(at(streamed, o.combine_base));
    a.piece_words = proxy_piece_word_offset(ws.shared, w, 0);
    a.recv_o = reinterpret_cast<uint32_t*>(at(per_rank, o.recv_o));
    a.recv_w = reinterpret_cast<float*>(at(per_rank, o.recv_w));
    a.recv_token = reinterpret_cast<uint32_t*>(at(per_rank, o.recv_token));
    a.recv_start = reinterpret_cast<uint32_t*>(at(per_rank, o.recv_start));
    a.early_launch = opt.early_launch && grids.share == 1 ? 1u : 0u;
    a.fused_plan = opt.fuse_plan && grids.share <= 2 &&
                           cuda::dispatch_send_fuses_plan(opt.dispatch.send_threads)
                       ? 1u
                       : 0u;
    a.trace = reinterpret_cast<unsigned long long*>(at(opt.trace, o.trace));
}

// The host proxy of the ranks on other nodes: it follows what the kernels publish.
void CudaAllToAll::Impl::start_proxy(const CudaWorkspace& ws, int64_t clock_offset,
                                     DeviceProxySetup ps) {
    ps.engine = opt.engine;
    ps.rank = cfg.rank;
    ps.world = cfg.world_size;
    ps.imm_base = opt.imm_base;
    ps.layout = ws.shared;
    ps.counts_bytes = CountsFormat::of(cfg).bytes;
    ps.dispatch_blocks = dispatch_send_blocks;
    ps.combine_blocks = combine_send_blocks;
    ps.timeout = opt.timeout;
    ps.idle_spin = opt.proxy_idle_spin;
    ps.chunk_bytes = opt.proxy_chunk_bytes;
    ps.trace = opt.trace;
    ps.clock_offset_ns = clock_offset;
    ps.publish = static_cast<const proxy::Publish*>(publish);
    ps.stream_ready = static_cast<const uint32_t*>(stream_ready);
    ps.stream_piece_bytes = uint64_t{ws.piece_rows} * ws.combine_row_bytes;
    ps.stream_max_pieces = ws.max_pieces;
    ps.outbox = outbox_mr.get();
    ps.inbox_data = static_cast<uint8_t*>(inbox);
    proxy = std::make_unique<DeviceProxy>(std::move(ps));
    proxy->start();
}

// The workspace plan (checks that need no GPU, every buffer's size), the kernels loaded, the
// memory allocated, the peer exchange and mapping, the grids, the argument block, the proxy.
Result<std::unique_ptr<CudaAllToAll>> CudaAllToAll::create(const AllToAllConfig& cfg,
                                                           const AllGatherFn& allgather,
                                                           const CudaAllToAllOptions& options) {
    FERRY_ASSIGN_OR_RETURN(const CudaWorkspace ws, plan_cuda_workspace(cfg, options));
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
    uint32_t plan_smem = 0, recv_smem = 0;
    FERRY_RETURN_IF_ERROR(load_kernels(cfg, impl->device, &plan_smem, &recv_smem));
    int64_t clock_offset = 0;
    if (options.trace && ws.remote) FERRY_RETURN_IF_ERROR(gpu_clock_offset(&clock_offset));
    std::vector<uint8_t> remote_blob;
    FERRY_RETURN_IF_ERROR(impl->allocate(ws, &remote_blob));

    PeerBlob mine;
    mine.rank = cfg.rank;
    mine.config_hash = cfg.hash();
    mine.host_id = host_id();
    mine.pid = static_cast<int32_t>(getpid());
    mine.device = impl->device;
    mine.dispatch_blocks = options.dispatch.send_blocks;
    mine.combine_blocks = options.combine.send_blocks;
    mine.piece_rows = ws.piece_rows;
    int sms = 0;
    FERRY_CUDA_TRY(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, impl->device));
    mine.sm_count = static_cast<uint32_t>(sms);
    mine.base = reinterpret_cast<uint64_t>(impl->shared);
    FERRY_CUDA_TRY(cudaIpcGetMemHandle(&mine.handle, impl->shared));
    mine.remote_bytes = static_cast<uint32_t>(remote_blob.size());
    FERRY_ASSIGN_OR_RETURN(PeerExchange x, exchange_peers(cfg, allgather, mine, remote_blob));
    DeviceProxySetup ps;
    FERRY_RETURN_IF_ERROR(impl->map_peers(x.peers, x.blobs, mine, ws, &ps));

    std::vector<GpuSeat> seats;
    for (const PeerBlob& p : x.peers) seats.push_back({p.host_id, p.device, p.sm_count});
    const CudaGrids grids = choose_cuda_grids(seats, options.dispatch, options.combine);
    impl->fill_args(ws, grids, plan_smem, recv_smem);
    if (ws.remote) impl->start_proxy(ws, clock_offset, std::move(ps));
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
    cudaError_t e =
        cuda::launch_dispatch_recv(m.args, out.x, out.x_scale, out.counts, out.offsets, out.sources,
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
