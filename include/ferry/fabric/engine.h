// TransferEngine: one-sided RDMA over libfabric.
//
// One worker thread owns each libfabric domain ("rail"): it alone posts operations and polls
// the completion queue. Any thread may call the methods below; they validate the request,
// split it into fabric operations and hand them to the rail workers through lock-free queues.
// Completion is reported through a callback (run on a worker thread: keep it short) or an
// OpHandle that can be waited on with a deadline.
//
// Completion at the target is signalled by writes carrying a 32-bit immediate: the target
// counts arrivals per immediate value (wait_imm / on_imm). Writes are never ordered relative
// to each other, so a target must count, not rely on the last write arriving last.
//
// A write's successful completion means the provider took it off the initiator's hands; it
// does not prove the bytes landed. A write into a region its owner has already closed is
// dropped at the target and still completes without error on tcp and shm (measured 2026-12-03).
// Whatever must know that bytes arrived counts their immediates at the target, as the KV
// connector does: a write that never lands leaves its count short, and the target's wait ends
// in an error at its deadline, never in wrong data taken for right.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "ferry/common/clock.h"
#include "ferry/common/status.h"
#include "ferry/fabric/types.h"

namespace ferry {

class TransferEngine;
namespace detail {
class EngineImpl;
struct OpState;
class OpRef;
// Tests (src/fabric/engine_impl.h): holds rail `rail`'s worker inside one call until the
// watchdog declares the rail wedged.
Status wedge_rail_for_test(TransferEngine& engine, int rail, Duration limit);
}  // namespace detail

struct EngineConfig {
    // "auto", "efa", "verbs" (verbs;ofi_rxm), "tcp" (tcp;ofi_rxm), "shm", or a full libfabric
    // provider string. auto prefers efa > verbs > shm (when peers_on_same_host) > tcp.
    std::string provider = "auto";
    bool peers_on_same_host = false;
    // Local address to bind for tcp and verbs providers.
    std::string node = "127.0.0.1";
    // Number of domains (NICs) to open. Large writes are striped across them.
    int num_rails = 1;
    // Which NICs carry each local region, which is registered on those only: "nearest" (a GPU's
    // memory on the NICs under its own PCIe switch, host memory on its NUMA node's NICs, every
    // rail when no NIC is nearer; on a p5en 2 of its 16 EFA devices per GPU), "all", or NIC
    // domain names separated by commas ("rdmap79s0,rdmap80s0"), the same for every region.
    // A region's descriptor names its rails (near_mask), so transfers go from a rail near the
    // local memory to one near the remote memory: the same rail index where both sides have
    // one (NIC to matching NIC), else the k-th local rail to the k-th remote one, across rails
    // (EngineStats::rail_fallbacks counts those). `ferry topo` prints the choice per GPU and
    // NUMA node. docs/ARCHITECTURE.md, "Rails and topology".
    std::string rails = "nearest";
    // The machine's topology as an hwloc XML file (lstopo --of xml) instead of this machine's.
    std::string topology_xml;
    // The NIC each rail stands for, one line per rail as `ferry topo --nics` reads them
    // ("<provider> <domain> <pci bus id or ->"), instead of the provider's own: lets tcp or shm
    // rails on one host stand in for the NICs of a multi-NIC machine (tests).
    std::string rail_nics;
    // Writes larger than this are split into one piece per rail.
    size_t stripe_threshold = 1 << 20;
    // Longest write handed to the provider in one operation.
    size_t max_write_size = 64ull << 20;
    // An operation not completed by then fails with kTimeout: this is how a peer that died
    // without closing its connection turns into errors instead of a hang.
    Duration op_timeout = std::chrono::seconds(10);
    // Control messages: largest payload, and receive buffers kept posted.
    size_t max_message_size = 64 * 1024;
    int message_recv_buffers = 64;
    // Worker polling: spin for idle_spin after the last activity, then nap (woken at once by
    // new submissions; arrivals wait for the end of the nap, at most max_nap, or quiet_nap
    // after quiet_after without any activity, below). The worker
    // does not nap while its operations are in flight, immediate waiters are pending, GPU
    // copies run or a caller expects arrivals (expect_arrivals; of Expected::kSignalled only
    // for expect_spin after it began or after the last activity); it yields the core between
    // polls then, so threads with work get it.
    // busy_poll never naps: lowest latency, one core per rail.
    bool busy_poll = false;
    // Writes no longer than the provider's inject_size (tx_attr) are posted with FI_INJECT:
    // the provider copies the payload at post time. They keep FI_COMPLETION, so a write to a
    // dead peer still fails (fi_inject_write would report nothing at all) -- except writes
    // with an immediate on shm, whose completion shm writes while posting, whatever the
    // peer's state: they go as fi_inject_writedata with no completion and finish when the
    // post returns (a dead shm peer's writes are pushed back once its queue is full and fail
    // at op_timeout, as before). inject_completions keeps the completion for them too.
    bool inject = true;
    bool inject_completions = false;
    // Operations the worker posts back to back carry FI_MORE on all but the last of a pass,
    // so a provider that honours it can ring one doorbell for the lot.
    bool post_more = true;
    // A paged write's runs of pages (and a write_runs' or read_runs' runs) go up to this many
    // to one fabric operation, one fi_writemsg or fi_readmsg with as many local and remote
    // iovecs, where the provider takes them (its rma_iov_limit and iov_limit; at most 4): the
    // provider then handles one command per group. 1: one operation per run, as before. On
    // shm only writes with an immediate are joined (TransferEngine::rma_iovs).
    size_t rma_iovs = 4;
    // Same-host GPU copies: "kernel" (one batched copy kernel per operation), "copy-engine"
    // (cudaMemcpyAsync per piece) or "auto" (the kernel, except one large contiguous copy).
    std::string gpu_copy = "auto";
    // GPU memory over the fabric: where the provider offers FI_HMEM with CUDA, kCuda regions
    // are registered with it on every rail (domains are then opened with FI_HMEM), so peers on
    // other hosts can reach them. false: domains are opened without FI_HMEM and GPU memory
    // travels through CUDA IPC only.
    bool fabric_gpu_memory = true;
    // Same-host GPU pairs copy over CUDA IPC (NVLink). false: no IPC export, GPU memory goes
    // through the provider like any other (needs fabric GPU memory on both sides).
    bool gpu_ipc = true;
    // Same-host host memory copied by the initiator itself (cross-memory attach): on shm, a
    // write above inject_size, a write_runs or a paged_write into a peer's host region whose
    // descriptor offers it is one process_vm_writev on the calling thread, then its immediate as a
    // signal through the provider, instead of a command the peer's worker carries out and
    // answers. A region offers it when its owner's engine has cma_writes on and registered it
    // for peer writes: both sides opt in. Off by default, and off whatever is asked while
    // FI_SHM_DISABLE_CMA=1 (libfabric's own switch, read at create). In place of shm's key
    // check at the target, each copy passes the owner's fence (shared memory the owner keeps,
    // one slot per region): a region deregistered is refused (kNotFound), bytes outside what
    // the owner registered too (kOutOfRange), and deregistration waits for copies already
    // inside (docs/PROTOCOL.md, "Same-host writes by process_vm_writev"). A peer whose
    // process_vm_writev or fence is refused (EPERM: Yama's ptrace scope, another user) or whose
    // pid is not the process that registered the region (another pid namespace) gets the
    // provider's path: decided once per peer, logged.
    bool cma_writes = false;
    // Set by the engine (random per engine): makes shm region names unique.
    uint64_t shm_name_salt = 0;
    Duration idle_spin = std::chrono::microseconds(200);
    Duration max_nap = std::chrono::microseconds(100);
    // A worker idle for quiet_after (nothing posted, completed or arrived, nothing in flight
    // or expected) naps up to quiet_nap instead of max_nap: ~10,000 wake-ups a second at
    // max_nap cost each rail of an idle engine ~11% of a core (one serve engine, 2026-12-03),
    // so 32 idle engines took both cores of a small host. After such a quiet spell the first
    // arrival waits at most quiet_nap; a submission still wakes the worker at once.
    // quiet_nap <= max_nap keeps every nap within max_nap.
    Duration quiet_nap = std::chrono::milliseconds(1);
    Duration quiet_after = std::chrono::seconds(1);
    // How long an expectation of Expected::kSignalled keeps the worker polling after it began
    // or after the worker's last activity (each message or immediate that arrives is one). A
    // decode engine waiting seconds for prefill's compute naps after it: one decode worker in
    // vLLM polled 60-100% of a core for all of prefill's step before, on the 2-core host that
    // ran the prefill engine too, whose step then outlasted decode's lease (2026-12-07).
    Duration expect_spin = std::chrono::milliseconds(50);
};

using PeerId = uint32_t;

// What a caller expects to arrive (TransferEngine::expect_arrivals).
enum class Expected { kAny, kSignalled };
using GroupId = uint32_t;
using OpCallback = std::function<void(const Status&)>;

// Waitable handle of one submitted operation.
class OpHandle {
  public:
    OpHandle() = default;
    // Takes the reference (the engine's; OpState counts its references itself).
    explicit OpHandle(detail::OpRef state);
    OpHandle(const OpHandle& o);
    OpHandle& operator=(const OpHandle& o);
    OpHandle(OpHandle&& o) noexcept : state_(std::exchange(o.state_, nullptr)) {}
    OpHandle& operator=(OpHandle&& o) noexcept {
        std::swap(state_, o.state_);
        return *this;
    }
    ~OpHandle();

    bool valid() const { return state_ != nullptr; }
    bool done() const;
    // Waits until the operation completed or the timeout passed; returns its final status,
    // or kTimeout (the operation itself keeps its own deadline and fails on its own). With
    // `spin`, the caller polls for that long before it sleeps (spin_until in clock.h): no
    // wake-up to pay when the operation completes soon, a core used meanwhile.
    Status wait(Duration timeout = std::chrono::seconds(30),
                Duration spin = Duration::zero()) const;
    // Number of writes carrying the immediate that this operation put on the wire: what the
    // target must count.
    uint32_t imm_writes() const;

  private:
    detail::OpState* state_ = nullptr;
};

class TransferEngine;

// Registered local memory. Owned by the caller; deregisters when destroyed. Operations that
// use it must complete first.
class MemoryRegion {
  public:
    ~MemoryRegion();
    MemoryRegion(const MemoryRegion&) = delete;
    MemoryRegion& operator=(const MemoryRegion&) = delete;

    void* data() const { return ptr_; }
    size_t size() const { return len_; }
    const MemoryDescriptor& descriptor() const { return desc_; }
    // Provider descriptor for rail r (fi_mr_desc), null when the provider needs none.
    void* local_desc(int rail) const { return local_descs_[rail]; }
    uint32_t id() const { return id_; }
    // The rails nearest its memory (bit r: rail r) under EngineConfig::rails "nearest", else
    // every rail holding it: this engine's own operations on the region leave from these, and
    // peers aim theirs at them (descriptor().near_mask). descriptor().rail_mask is where
    // peers can reach it.
    uint64_t send_rails() const { return desc_.near_mask & desc_.rail_mask; }
    // What peers may do to it through the fabric (register_memory's `access`).
    RemoteAccess remote_access() const { return access_; }

  private:
    friend class detail::EngineImpl;
    MemoryRegion() = default;

    std::shared_ptr<detail::EngineImpl> engine_;
    uint32_t id_ = 0;
    void* ptr_ = nullptr;
    size_t len_ = 0;
    MemoryDescriptor desc_;
    std::vector<void*> local_descs_;
    RemoteAccess access_ = RemoteAccess::kReadWrite;
    // The first transfer of the region NIC to matching NIC, and the first across rails, are
    // logged; later ones are not (EngineStats::rail_fallbacks counts the second kind).
    mutable std::atomic<bool> route_logged_{false};
    mutable std::atomic<bool> fallback_logged_{false};
};

struct WriteOp {
    PeerId peer = 0;
    const MemoryRegion* src = nullptr;
    uint64_t src_offset = 0;
    const MemoryDescriptor* dst = nullptr;
    uint64_t dst_offset = 0;
    uint64_t length = 0;
    std::optional<uint32_t> imm;  // write with immediate (remote CQ data)
};

// Pages (fixed-size chunks at index * stride) copied from src pages to dst pages; runs of
// pages contiguous on both sides are coalesced into one write.
struct PagedWriteOp {
    PeerId peer = 0;
    const MemoryRegion* src = nullptr;
    const MemoryDescriptor* dst = nullptr;
    uint64_t page_size = 0;
    uint64_t src_stride = 0;  // 0 means page_size
    uint64_t dst_stride = 0;
    uint64_t src_offset = 0;  // byte offset of page 0
    uint64_t dst_offset = 0;
    std::span<const uint32_t> src_pages;
    std::span<const uint32_t> dst_pages;
    std::optional<uint32_t> imm;
};

// Many runs from one local region to one remote region as one operation with one completion
// (a KV transfer's runs, one per layer and K/V). On fabric paths every run is a write of its
// own, split and striped like write(), each carrying `imm` (imm_writes() says how many). Between
// GPUs of one host the runs become one batched copy followed by one immediate.
struct WriteRunsOp {
    PeerId peer = 0;
    const MemoryRegion* src = nullptr;
    const MemoryDescriptor* dst = nullptr;
    std::span<const WriteRun> runs;
    std::optional<uint32_t> imm;
};

// One-sided read of remote memory into a local region.
struct ReadOp {
    PeerId peer = 0;
    const MemoryRegion* dst = nullptr;
    uint64_t dst_offset = 0;
    const MemoryDescriptor* src = nullptr;
    uint64_t src_offset = 0;
    uint64_t length = 0;
};

// Many runs from one remote region into one local region as one operation with one
// completion (a pull-mode KV transfer's runs): each run's src_offset is in the remote region,
// its dst_offset in the local one. On fabric paths every run is a read of its own; between
// GPUs of one host the runs become one batched copy.
struct ReadRunsOp {
    PeerId peer = 0;
    const MemoryRegion* dst = nullptr;
    const MemoryDescriptor* src = nullptr;
    std::span<const WriteRun> runs;
};

// One plane of a block copy (BlockCopySide): in a KV cache, the slabs of one (layer, K/V)
// across all blocks. Block 0 of the plane starts `offset` bytes into region `region` of the
// side's regions.
struct BlockPlane {
    uint32_t region = 0;
    uint64_t offset = 0;
};

// One side of a block copy as address strides: in plane p, token slot t of block b, head h
// starts at planes[p].offset + b * block_stride + t * token_stride + h * head_stride of its
// region. A KV pool's layout (kv::KvLayout) comes down to this, whatever its placement, block
// order or region split; the KV connector makes it (kv::plan_block_copy).
struct BlockCopySide {
    std::span<const uint32_t>
        blocks;  // block ids in token order: token t is in blocks[t / block_size]
    std::span<const BlockPlane> planes;
    uint32_t block_size = 0;  // tokens per block
    uint64_t block_stride = 0;
    uint64_t token_stride = 0;
    uint64_t head_stride = 0;
    uint32_t first_head = 0;  // the first head copied, in this side's numbering
};

// Tokens [first_token, end_token) of every plane, `heads` heads of head_bytes each, from the
// src side's blocks into the dst side's (planes paired in order). Between GPUs of one host
// (CUDA IPC) the copy kernel computes every address from the block ids, so the host hands over
// O(blocks) ids, not a run per (plane, block): a 16k-token KV push planned and uploaded as
// 130,816 runs of 4 KiB ran at 0.09x of the copy ceiling, bound by the host (2026-12-02).
// Only that path exists: elsewhere the operation fails (kInvalidArgument) and the runs go
// through write_runs / read_runs (copies_on_gpu says which applies). One completion; a write
// delivers `imm` once, after every byte is in place.
struct BlockCopyOp {
    PeerId peer = 0;
    // false: a write, the src side in `local` and the dst side in `remote`; true: a read,
    // the other way round (no immediate).
    bool read = false;
    std::span<const MemoryRegion* const> local;
    std::span<const MemoryDescriptor> remote;
    BlockCopySide src;
    BlockCopySide dst;
    uint32_t first_token = 0;
    uint32_t end_token = 0;
    uint32_t heads = 0;
    uint64_t head_bytes = 0;
    std::optional<uint32_t> imm;
};

// One entry of a batch (TransferEngine::submit_batch): a write or a read, each its own
// operation with its own completion.
using BatchEntry = std::variant<WriteOp, ReadOp>;
// Completion of entry `index` of a batch.
using BatchCallback = std::function<void(size_t index, const Status&)>;

struct ScatterSlice {
    uint32_t member = 0;  // index into the group's peers
    uint64_t src_offset = 0;
    uint64_t dst_offset = 0;
    uint64_t length = 0;
};

struct ScatterOp {
    GroupId group = 0;
    const MemoryRegion* src = nullptr;
    std::span<const ScatterSlice> slices;
    std::optional<uint32_t> imm;
};

// A control message as delivered to the handler: the sender's engine id and the payload,
// valid only during the call.
using MessageHandler = std::function<void(uint64_t sender_engine_id, std::span<const uint8_t>)>;

struct EngineStats {
    uint64_t ops_posted = 0;        // fabric operations handed to the provider
    uint64_t ops_injected = 0;      // of those, posted with FI_INJECT
    uint64_t posted_with_more = 0;  // of those, posted with FI_MORE
    uint64_t post_rounds = 0;       // worker passes that posted: ops_posted / this = batch size
    uint64_t bytes_posted = 0;
    uint64_t eagain = 0;  // times the provider pushed back
    uint64_t op_errors = 0;
    uint64_t op_timeouts = 0;
    uint64_t imm_arrivals = 0;
    uint64_t messages_received = 0;
    uint64_t messages_dropped = 0;
    uint64_t regions_registered = 0;  // memory regions registered now (none leak: tests count)
    // Transfers with no common rail: no rail index is near both the local and the remote
    // memory (GPU k to the peer's GPU j), so each went from a NIC near the local memory to a
    // peer NIC near the remote memory of another index (EngineConfig::rails).
    uint64_t rail_fallbacks = 0;
    // Bytes this engine copied into same-host peers with process_vm_writev
    // (EngineConfig::cma_writes) instead of handing them to the provider.
    uint64_t cma_bytes = 0;
};

class TransferEngine {
  public:
    static Result<std::unique_ptr<TransferEngine>> create(const EngineConfig& config);
    ~TransferEngine();  // stops and joins every worker, frees every libfabric object
    // Stops and joins every worker now: pending operations and waits (wait_imm, on_imm) end
    // with kCancelled and later calls are refused with it. The object itself stays valid, so
    // a thread still inside one of its calls returns from it safely; the destructor then only
    // frees memory. Idempotent.
    void shutdown();

    TransferEngine(const TransferEngine&) = delete;
    TransferEngine& operator=(const TransferEngine&) = delete;

    const EngineAddress& address() const;
    uint64_t engine_id() const;
    const std::string& provider() const;
    int num_rails() const;
    const EngineConfig& config() const;

    // Memory. kHost is registered with its NUMA node's NICs under EngineConfig::rails
    // "nearest" (every rail when none is nearer; MemoryDescriptor::rail_mask says which), and
    // sent from and reached on those (MemoryRegion::send_rails). kCuda (cudaMalloc'd
    // memory on `device`) is exported through CUDA IPC: writes, paged writes and reads between GPU
    // regions of peers on the same host become copies over NVLink, completed like fabric writes
    // (immediates included). Where supports_gpu_memory(), it is also registered with the provider
    // (FI_HMEM_CUDA), so any peer reaches it over the fabric. GPU memory is refused with a
    // clear error when neither way is available. `access` limits what peers may do through the
    // fabric registration (RemoteAccess: a region peers only write into, or only this engine
    // reads and writes); a CUDA IPC export is not limited by it.
    Result<std::unique_ptr<MemoryRegion>> register_memory(
        void* ptr, size_t len, MemoryKind kind = MemoryKind::kHost, int device = -1,
        RemoteAccess access = RemoteAccess::kReadWrite);
    // Several ranges of one kind at once, each its own region as above (in the order given),
    // with one round trip to each rail's worker for all of them where they are host memory: a
    // KV pull offer registers one region per run of its blocks, and 128 one by one took 2.2 ms
    // of its caller's time. All or nothing: on failure none stays registered.
    Result<std::vector<std::unique_ptr<MemoryRegion>>> register_memory(
        std::span<const std::span<uint8_t>> ranges, MemoryKind kind = MemoryKind::kHost,
        int device = -1, RemoteAccess access = RemoteAccess::kReadWrite);
    // True when the provider registers CUDA memory (FI_HMEM with CUDA), so GPU regions reach
    // peers on other hosts; false when GPU memory only goes to same-host GPU peers.
    bool supports_gpu_memory() const;
    // Why or why not, naming the provider ("provider tcp;ofi_rxm does not offer FI_HMEM").
    const std::string& gpu_memory_note() const;

    // Memory about to be reused after a failed transfer: calls then(still_held) once
    // libfabric has given back every operation whose local buffer overlaps one of `spans`,
    // those that timed out and were reported failed included, or after `timeout` with how
    // many it still holds (0: nothing can land there any more). A software provider (tcp)
    // carries out a timed-out read when its answer comes, whenever that is. Runs on an engine
    // thread (or at once): keep it short.
    void when_released(std::vector<std::span<const uint8_t>> spans, Duration timeout,
                       std::function<void(size_t still_held)> then);

    // Peers. connect() inserts every rail of the peer on every local rail; connecting twice
    // returns the same id. Transfers between a local region and a peer's go from the local
    // region's send_rails() to the peer's rails near the remote region (its descriptor's
    // near_mask): rail r to the peer's rail r for each r near both, else the k-th local near
    // rail to the k-th remote near rail (counted in EngineStats::rail_fallbacks).
    Result<PeerId> connect(const EngineAddress& peer);
    // The peer id of an engine connected before, if any.
    std::optional<PeerId> find_peer(uint64_t engine_id) const;
    // A group of peers with one destination region each, for scatter and barrier.
    Result<GroupId> create_group(std::span<const PeerId> peers,
                                 std::span<const MemoryDescriptor> dsts);

    // Operations. Errors found before posting (bad descriptor, out of range) come back through
    // the handle and the callback like any other error.
    OpHandle write(const WriteOp& op, OpCallback done = {});
    OpHandle paged_write(const PagedWriteOp& op, OpCallback done = {});
    OpHandle write_runs(const WriteRunsOp& op, OpCallback done = {});
    OpHandle read(const ReadOp& op, OpCallback done = {});
    OpHandle read_runs(const ReadRunsOp& op, OpCallback done = {});
    OpHandle copy_blocks(const BlockCopyOp& op, OpCallback done = {});
    OpHandle scatter(const ScatterOp& op, OpCallback done = {});
    // Many writes and reads, to any peers, handed to each rail's worker in one queue hand-off
    // and posted back to back (FI_MORE between them where the provider honours it). Every
    // entry is an operation of its own: one handle each, in order, and done(index, status)
    // once per entry; an entry that fails validation fails alone, and one peer's failure
    // does not touch the others' entries. Same-host GPU entries go the CUDA IPC way, one
    // by one. (Single write() calls coalesce too: the worker posts whatever queued up since
    // its last pass back to back.)
    std::vector<OpHandle> submit_batch(std::span<const BatchEntry> ops, BatchCallback done = {});
    // Many writes and reads, to any peers, as ONE operation: one handle, one completion once
    // every entry is done, with the first failure's status if any failed (the other entries
    // still run to completion; imm_writes() counts every write carrying an immediate).
    // Every entry is validated before anything is posted: an invalid one fails the whole
    // operation and nothing moves. Entries between GPUs of this host (CUDA IPC) are refused
    // (use submit_batch). What a dispatch to many peers wants: per entry it costs a post and
    // nothing else (no state, callback or handle of its own).
    OpHandle submit_all(std::span<const BatchEntry> ops, OpCallback done = {});
    // True when operations between `local` and the peer's `remote` region are copies between
    // GPUs of this host (CUDA IPC), the path copy_blocks takes.
    bool copies_on_gpu(PeerId peer, const MemoryRegion& local,
                       const MemoryDescriptor& remote) const;
    // Sends one immediate-only write to every member, then waits until as many writes with
    // `imm` arrived here. Members call it with the same imm; consecutive rounds need no reset.
    Status barrier(GroupId group, uint32_t imm, Duration timeout);
    // Immediate-only write to one peer (a signal).
    OpHandle signal(PeerId peer, uint32_t imm, OpCallback done = {});

    // Target-side counters. Credit style: arrivals accumulate per immediate value; a waiter
    // for n consumes n of them, so consecutive rounds need no reset, in any arrival order.
    // `spin`: poll for that long before sleeping, as OpHandle::wait.
    Status wait_imm(uint32_t imm, uint64_t count, Duration timeout,
                    Duration spin = Duration::zero());
    // Calls done(ok) once `count` arrivals of imm are available (consuming them), or
    // done(timeout) when the timeout passes first. Runs on a worker thread.
    void on_imm(uint32_t imm, uint64_t count, Duration timeout, OpCallback done);
    // Consumes `count` arrivals of imm if they are all in and no waiter on imm is queued
    // ahead; false, consuming nothing, otherwise. The check on_imm would do, without a
    // waiter or a callback on a worker thread.
    bool try_take_imm(uint32_t imm, uint64_t count);
    // Arrivals of imm not yet consumed.
    uint64_t imm_available(uint32_t imm) const;
    // While a caller expects writes from peers (a KV transfer registered and not finished),
    // the workers keep polling instead of napping: on providers whose transfers need both
    // sides' progress (shm copies at the target, tcp reads there), a napping target slowed a
    // 2 MiB write to 5 ms on a busy 2-core host (2026-12-01). Calls nest; each
    // expect_arrivals(true) needs one expect_arrivals(false) of the same kind.
    // Expected::kAny: reads, or writes without an immediate, which complete nothing at this
    // target: the workers poll for as long as the expectation lasts. Expected::kSignalled:
    // messages and writes with an immediate, which the workers see arrive: they poll for
    // EngineConfig::expect_spin after the expectation began or after their last activity,
    // then nap as when idle (a decode engine expecting a push for all of prefill's compute).
    void expect_arrivals(bool on, Expected what = Expected::kAny);

    // Small two-sided control messages over rail 0, with receive buffers kept posted.
    OpHandle send_message(PeerId peer, std::span<const uint8_t> payload, OpCallback done = {});
    // Messages received before a handler is set are held (up to message_recv_buffers * 16).
    // The handler runs on rail 0's worker, one message at a time. It may set another handler
    // itself (a one-shot handler): the next message goes to that one. Set from another
    // thread, this returns once the old handler's running call (if any) has returned. A
    // handler that throws loses that message (logged, counted in messages_dropped).
    void set_message_handler(MessageHandler handler);

    EngineStats stats() const;
    // Each rail's counters, in rail order (stats() is their sum, with the engine's own): which
    // NICs a region's transfers used (EngineConfig::rails).
    std::vector<EngineStats> rail_stats() const;
    // Longest write posted with FI_INJECT (the provider copies the payload while posting):
    // the provider's inject_size, 0 when EngineConfig::inject is off.
    size_t inject_size() const;
    // Runs of pages (paged_write) or runs (write_runs, read_runs) one fabric operation carries
    // at most, each one iovec: EngineConfig::rma_iovs capped by the provider's limits. Each
    // such operation with an immediate delivers one (OpHandle::imm_writes counts them). On shm
    // only writes with an immediate are joined: reads and writes without one stay one run per
    // operation, which shm copies from the initiator without the target's worker.
    size_t rma_iovs() const;
    // OK while every rail works. Once the watchdog found a rail wedged inside the provider (a
    // worker spinning in one call: libfabric's shm on a lock in shared memory that is never
    // released), that error, for good: the rail's operations fail and it takes no new work.
    // Whoever sees it creates a new engine (the KV connector fails its waiting transfers).
    Status health() const;

  private:
    friend Status detail::wedge_rail_for_test(TransferEngine&, int, Duration);
    explicit TransferEngine(std::shared_ptr<detail::EngineImpl> impl);
    std::shared_ptr<detail::EngineImpl> impl_;
};

// expect_arrivals(true, what) for as long as it lives (movable; the engine must outlive it).
class ArrivalsExpected {
  public:
    ArrivalsExpected() = default;
    explicit ArrivalsExpected(TransferEngine* engine, Expected what = Expected::kAny)
        : engine_(engine), what_(what) {
        engine_->expect_arrivals(true, what_);
    }
    ArrivalsExpected(ArrivalsExpected&& o) noexcept
        : engine_(std::exchange(o.engine_, nullptr)), what_(o.what_) {}
    ArrivalsExpected& operator=(ArrivalsExpected&& o) noexcept {
        if (this != &o) {
            reset();
            engine_ = std::exchange(o.engine_, nullptr);
            what_ = o.what_;
        }
        return *this;
    }
    ~ArrivalsExpected() { reset(); }
    bool active() const { return engine_ != nullptr; }
    void reset() {
        if (engine_) engine_->expect_arrivals(false, what_);
        engine_ = nullptr;
    }

  private:
    TransferEngine* engine_ = nullptr;
    Expected what_ = Expected::kAny;
};

// Resolves a provider name from the config ("tcp" -> "tcp;ofi_rxm", "auto" -> first available
// in preference order).
Result<std::string> resolve_provider(const EngineConfig& config);

// Whether an operation failed without the provider ever taking it: the provider pushed it back
// (EAGAIN) until op_timeout, as tcp;ofi_rxm does while it opens the connection its first send
// to a peer asks for and the peer has not answered yet (a loaded or stopped process). Nothing
// of it reached the peer, so posting it again cannot deliver it twice. (A timeout of an
// operation the provider took, "did not complete within", may have been carried out.)
bool never_posted(const Status& s);

}  // namespace ferry
