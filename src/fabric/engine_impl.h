// Internals of TransferEngine. EngineImpl validates requests and turns them into operations;
// the state lives in the components it composes, one owner each:
//   RailGroup       the rails (one domain and worker thread each), how operations are split
//   PeerTable       connected peers (address per rail) and peer groups
//   MemoryRegistry  registrations on each region's rails, region ids, the GPU memory policy
//   GpuCopyPath     the same-host GPU transport and its copies in flight
//   CmaPath         same-host host memory written by process_vm_writev, decided per peer
//   ControlChannel  control-message framing, the handler, held messages
//   ImmTable        arrival counters per immediate and their waiters
// Files: engine_impl.cc (construction, watchdog, shutdown, entry points), op_checks.cc
// (validation, path choice), op_builder.cc (requests into per-rail operations or GPU copies),
// op_batch.cc (submit_batch, submit_all),
// op_block_copy.cc (block copies from block ids, GPU only).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "fabric/cma_path.h"
#include "fabric/control.h"
#include "fabric/gpu_copy_path.h"
#include "fabric/gpu_transport.h"
#include "fabric/imm_table.h"
#include "fabric/memory_registry.h"
#include "fabric/peer_table.h"
#include "fabric/rail.h"
#include "fabric/rail_group.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

// How long a rail's worker may stay inside one provider call before the watchdog declares the
// rail wedged. One call on a healthy rail returns in microseconds (a 1 MiB shm write copies in
// well under a millisecond) and a worker descheduled on a loaded host resumes within
// milliseconds; declaring a rail wedged is final, so the threshold never drops below 5 s,
// whatever op_timeout a test or a user picks.
inline constexpr Duration kMinWedgeTime = std::chrono::seconds(5);
inline Duration wedge_threshold(Duration op_timeout) {
    return std::max<Duration>(op_timeout, kMinWedgeTime);
}

class EngineImpl : public std::enable_shared_from_this<EngineImpl> {
  public:
    Status init(const EngineConfig& config);
    void shutdown();
    ~EngineImpl();

    Result<std::unique_ptr<MemoryRegion>> register_memory(
        void* ptr, size_t len, MemoryKind kind, int device,
        RemoteAccess access = RemoteAccess::kReadWrite);
    Result<std::vector<std::unique_ptr<MemoryRegion>>> register_memory(
        std::span<const std::span<uint8_t>> ranges, MemoryKind kind, int device,
        RemoteAccess access);
    // Peers' process_vm_writev into it end first (CmaPath::withdraw), then the provider's keys.
    void deregister(uint32_t id, const MemoryDescriptor& desc);
    void when_released(std::vector<std::span<const uint8_t>> spans, Duration timeout,
                       std::function<void(size_t)> then);
    Result<PeerId> connect(const EngineAddress& peer);
    std::optional<PeerId> find_peer(uint64_t engine_id) const;
    Result<GroupId> create_group(std::span<const PeerId> peers,
                                 std::span<const MemoryDescriptor> dsts);

    OpHandle write(const WriteOp& op, OpCallback done);
    OpHandle paged_write(const PagedWriteOp& op, OpCallback done);
    OpHandle write_runs(const WriteRunsOp& op, OpCallback done);
    OpHandle read(const ReadOp& op, OpCallback done);
    OpHandle read_runs(const ReadRunsOp& op, OpCallback done);
    OpHandle copy_blocks(const BlockCopyOp& op, OpCallback done);
    bool copies_on_gpu(PeerId peer, const MemoryRegion& local,
                       const MemoryDescriptor& remote) const;
    OpHandle scatter(const ScatterOp& op, OpCallback done);
    std::vector<OpHandle> submit_batch(std::span<const BatchEntry> ops, BatchCallback done);
    OpHandle submit_all(std::span<const BatchEntry> ops, OpCallback done);
    OpHandle signal(PeerId peer, uint32_t imm, OpCallback done);
    Status barrier(GroupId group, uint32_t imm, Duration timeout);
    OpHandle send_message(PeerId peer, std::span<const uint8_t> payload, OpCallback done);
    void set_message_handler(MessageHandler handler);
    void expect_arrivals(bool on, Expected what);
    EngineStats stats() const;
    std::vector<EngineStats> rail_stats() const;
    // OK until the watchdog finds a rail wedged; then the first wedge's error, for good.
    Status health() const;
    // Tests: runs a task on `rail`'s worker that stays inside one "provider call" (spinning,
    // as shm does on a lock no one will release) until the watchdog declares the rail wedged,
    // or `limit` passes. The real watchdog, the real failure of the rail's operations.
    Status wedge_rail_for_test(int rail, Duration limit);

    bool fabric_gpu() const { return memory_.fabric_gpu(); }
    const std::string& fabric_gpu_note() const { return memory_.fabric_gpu_note(); }

    EngineConfig config;
    std::string provider;
    EngineAddress address;
    RailGroup rails;
    ImmTable imm;

  private:
    // The MemoryRegion of a registration made by memory_.
    std::unique_ptr<MemoryRegion> region_of(MemoryRegistry::Registration reg, void* ptr, size_t len,
                                            RemoteAccess access);
    const Peer* peer(PeerId id) const { return peers_.peer(id); }
    FabricOp* make_rma(FabricOp::Type type, const Peer& p, int rail, int peer_rail,
                       const MemoryRegion& local, uint64_t local_off,
                       const MemoryDescriptor& remote, uint64_t remote_off, uint64_t len,
                       std::optional<uint32_t> imm, TimePoint deadline, OpState* state);
    // One operation per piece of [len], as the rail group splits it over route.local, owned
    // by `state`; each piece goes to the peer rail route pairs its rail with.
    void add_rma(RailBatch& b, FabricOp::Type type, const Peer& p, const MemoryRegion& local,
                 uint64_t local_off, const MemoryDescriptor& remote, uint64_t remote_off,
                 uint64_t len, std::optional<uint32_t> imm, TimePoint deadline, bool stripe,
                 const RailRoute& route, OpState* state);
    // The runs of one operation (paged_write, write_runs, read_runs) as few fabric operations as
    // the provider allows: add_run joins a run to the operation the previous run started while
    // that has iovecs left (Rail::max_iovs) and stays within Rail::join_bytes and
    // max_write_size, else starts one on
    // the next rail; a run that add_rma would split (or stripe) is split as add_rma splits it.
    struct RunGroup {
        FabricOp* open = nullptr;  // the operation later runs may join
        uint64_t bytes = 0;        // its bytes so far
        size_t max_iovs = 1;       // its rail's
        uint64_t join_bytes = 0;   // its rail's bound on its bytes (Rail::join_bytes)
    };
    void add_run(RailBatch& b, RunGroup& g, FabricOp::Type type, const Peer& p,
                 const MemoryRegion& local, uint64_t local_off, const MemoryDescriptor& remote,
                 uint64_t remote_off, uint64_t len, std::optional<uint32_t> imm, TimePoint deadline,
                 bool stripe, const RailRoute& route, OpState* state);
    // The NIC pairs a transfer between `local` and p's `remote` uses (route_rails): the local
    // region's near rails to the peer's rails near `remote`. No common rail index: counted
    // (rail_fallbacks) and logged once per local region. Empty route.local: no_common_rail.
    RailRoute route(const Peer& p, const MemoryRegion& local, const MemoryDescriptor& remote) {
        return route_towards(p, local, remote, p.near_rails(remote));
    }
    // The same with the peer's rails near `remote` known already (a group's rows).
    RailRoute route_towards(const Peer& p, const MemoryRegion& local,
                            const MemoryDescriptor& remote, RailSet theirs) {
        RailRoute r = route_rails(local.send_rails() & rails.all(), theirs);
        if (!r.common || !local.route_logged_.load(std::memory_order_relaxed)) {
            note_route(p, local, remote, r);
        }
        return r;
    }
    // Counts a route without a common rail and logs the first route of each kind per region.
    void note_route(const Peer& p, const MemoryRegion& local, const MemoryDescriptor& remote,
                    const RailRoute& r);
    Status no_common_rail(const Peer& p, const MemoryRegion& local, const MemoryDescriptor& remote,
                          const char* what) const;
    // The pieces of one operation were added to b (b.count - first_piece of them): records
    // the count on the state and registers it. Before the batch is posted.
    void arm(OpState* state, uint32_t pieces, bool counts_imm);
    OpHandle submit(RailBatch& b, OpRef state, bool counts_imm);
    // Validates a write or read and adds its fabric pieces to b. False when the operation is
    // already completed (it failed validation, or went the GPU IPC way).
    // gpu_ok false: a pair that would go the CUDA IPC way fails instead (submit_all).
    bool build_write(const WriteOp& w, OpState* state, RailBatch& b, TimePoint deadline,
                     bool gpu_ok);
    bool build_read(const ReadOp& r, OpState* state, RailBatch& b, TimePoint deadline, bool gpu_ok);
    // True when check_local, check_remote and choose_path would all pass for a transfer
    // between host memory here and host memory of p over the fabric, found without building
    // a Status: single writes and batches ask this first and run the three (which name what
    // is wrong) only when it says no. Stricter than they are, never looser. The three cost
    // ~90 instructions per 64 B write through submit_batch, this ~40 (callgrind, 2026-12-02).
    bool host_fabric_ok(const Peer& p, const MemoryRegion* local, uint64_t local_off,
                        const MemoryDescriptor* remote, uint64_t remote_off, uint64_t len) const {
        return local && remote && local->engine_.get() == this &&
               local->descriptor().kind == MemoryKind::kHost && remote->kind == MemoryKind::kHost &&
               !remote->rail_keys.empty() && remote->engine_id == p.engine_id &&
               local_off <= local->size() && len <= local->size() - local_off &&
               remote_off <= remote->length && len <= remote->length - remote_off;
    }
    Status check_remote(const Peer& p, const MemoryDescriptor* d, uint64_t off, uint64_t len,
                        const char* what) const;
    Status check_local(const MemoryRegion* r, uint64_t off, uint64_t len, const char* what) const;
    Status check_runs(const Peer& p, const MemoryRegion* local, const MemoryDescriptor* remote,
                      std::span<const WriteRun> runs, bool local_is_src, const char* what);
    enum class Path { kFabric, kGpuIpc };
    Result<Path> choose_path(const Peer& p, const MemoryRegion& local,
                             const MemoryDescriptor& remote, const char* what) const;
    // The address of a same-host peer's GPU region as seen from local's device.
    Result<uint64_t> map_gpu_peer(const MemoryDescriptor& remote, const MemoryRegion& local);
    // A paged write's pages inside both regions, given each side's largest page id.
    Status check_pages(const PagedWriteOp& w, const Peer& p, uint32_t max_src,
                       uint32_t max_dst) const;
    // A paged write between GPUs of this host: the page ids go to the copy kernel.
    OpHandle paged_write_gpu(const PagedWriteOp& w, const Peer& p, OpRef state);
    // Runs copies on the GPU transport; completion (and the immediate, sent as a signal once
    // the data is in place) like a fabric operation.
    OpHandle gpu_op(OpRef state, PeerId peer, int device, GpuWork work,
                    std::optional<uint32_t> imm);

    // A write into a same-host peer's host region by process_vm_writev on this thread
    // (CmaPath), then its immediate as a signal through the provider: one operation, done
    // once the bytes are in place (and the signal is sent). Empty when CMA does not apply to
    // this peer or region, or the peer refused its first copy (nothing written): the caller
    // then goes the provider's way. Callers checked bounds and memory kinds.
    std::optional<OpHandle> cma_write(OpRef& state, const Peer& p, const MemoryDescriptor& dst,
                                      std::span<const CmaPiece> pieces, std::optional<uint32_t> imm,
                                      const char* what);

    // Watchdog: expires immediate waiters and detects rails wedged inside the provider.
    void watchdog();
    void fail_ops_on_rail(int rail, const Status& why);

    std::atomic<bool> stopped_{false};
    std::atomic<bool> wedged_{false};  // health_ holds the first wedge's error
    mutable std::mutex health_mu_;
    Status health_;
    std::shared_ptr<OpRegistry> registry_ = std::make_shared<OpRegistry>();
    std::thread watchdog_;
    std::mutex watchdog_mu_;
    std::condition_variable watchdog_cv_;
    bool watchdog_poke_ = false;  // a first immediate waiter came: sweep every millisecond

    PeerTable peers_;
    GpuCopyPath gpu_{config};
    CmaPath cma_;
    MemoryRegistry memory_{rails, gpu_};
    ControlChannel control_{config};
    std::atomic<int32_t> expecting_{0};              // open expect_arrivals(true, kAny) calls
    std::atomic<int32_t> expecting_signalled_{0};    // open expect_arrivals(true, kSignalled)
    std::atomic<Duration::rep> signalled_since_{0};  // the newest kSignalled's start
    std::atomic<uint64_t> rail_fallbacks_{0};        // EngineStats::rail_fallbacks
};

}  // namespace ferry::detail
