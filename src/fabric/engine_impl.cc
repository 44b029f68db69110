#include "fabric/engine_impl.h"
#include "fabric/provider.h"

#include <fmt/format.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <cstring>
#include <fstream>
#include <random>

#include "ferry/common/bytes.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"

namespace ferry::detail {
namespace {


std::string read_host_id() {
    std::string boot;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, boot);
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    return std::string(host) + "/" + boot;
}

uint64_t random_engine_id() {
    std::random_device rd;
    uint64_t id = (uint64_t{rd()} << 32) ^ rd() ^ (uint64_t(getpid()) << 16);
    return id ? id : 1;
}

}  // namespace

namespace {
// shm regions of engines whose process is gone (killed with SIGKILL, crashed) stay in
// /dev/shm, a few MB each. Every new shm engine removes those whose owner no longer exists;
// a live process, or a zombie not reaped yet, keeps its regions.
void remove_stale_shm_regions() {
    DIR* d = opendir("/dev/shm");
    if (!d) return;
    size_t prefix_len = std::strlen(kShmNamePrefix);
    while (dirent* e = readdir(d)) {
        if (std::strncmp(e->d_name, kShmNamePrefix, prefix_len) != 0) continue;
        char* end = nullptr;
        long pid = std::strtol(e->d_name + prefix_len, &end, 10);
        if (pid <= 0 || !end || *end != '_') continue;
        if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
            ::unlink((std::string("/dev/shm/") + e->d_name).c_str());
        }
    }
    closedir(d);
}
}  // namespace

Status EngineImpl::init(const EngineConfig& cfg) {
    config = cfg;
    if (config.num_rails < 1 || config.num_rails > 32) {
        return invalid_argument(fmt::format("num_rails must be 1..32, got {}", config.num_rails));
    }
    if (config.max_message_size < 64) return invalid_argument("max_message_size must be >= 64");
    FERRY_ASSIGN_OR_RETURN(provider, resolve_provider_name(config));
    FERRY_ASSIGN_OR_RETURN(auto infos, get_infos(provider, config));
    bool fabric_gpu = false;
    std::string fabric_gpu_note;
    if (config.fabric_gpu_memory) {
        // Only a provider that can register CUDA memory gets FI_HMEM domains: host memory
        // then travels exactly as before on every other one.
        CudaHmem h = probe_cuda_hmem(provider, config);
        fabric_gpu_note = std::move(h.note);
        if (h.infos) {
            infos = std::move(h.infos);
            fabric_gpu = true;
        }
    } else {
        fabric_gpu_note = fmt::format(
            "GPU memory over provider {} is off (EngineConfig::fabric_gpu_memory)", provider);
    }
    if (provider == "shm") remove_stale_shm_regions();
    std::vector<const fi_info*> candidates;
    for (const fi_info* i = infos.get(); i; i = i->next) {
        if (provider == i->fabric_attr->prov_name) candidates.push_back(i);
    }
    if (candidates.empty()) candidates.push_back(infos.get());

    address.engine_id = random_engine_id();
    config.shm_name_salt = address.engine_id;
    address.provider = provider;
    address.host_id = read_host_id();
    address.signal.engine_id = address.engine_id;
    address.signal.length = 64;
    memory_.configure({address.engine_id, provider, config.gpu_ipc, fabric_gpu,
                       std::move(fabric_gpu_note)});

    Status opened = rails.open(candidates, config, [this](int r) {
        RailHooks hooks;
        hooks.on_imm = [this](uint32_t v) { imm.arrive(v); };
        hooks.stay_awake = [this] {
            return imm.has_waiters() || gpu_.busy() ||
                   expecting_.load(std::memory_order_relaxed) > 0;
        };
        if (r == 0) {
            hooks.on_message = [this](std::span<const uint8_t> m) { control_.deliver(m); };
        }
        return hooks;
    });
    FERRY_RETURN_IF_ERROR(opened);
    for (const auto& rail : rails) {
        address.rail_addrs.push_back(rail->name());
        address.signal.rail_keys.push_back(rail->signal_key());
    }
    // Immediate-only writes carry no bytes; the signal region is addressed by offset 0. Every
    // rail has its own 64-byte signal buffer; zero-length writes never touch it, so the
    // address of rail 0's is as good as any.
    address.signal.virt_addr = rails[0].virt_addr();
    address.signal.base = reinterpret_cast<uint64_t>(rails[0].signal_base());
    rails.start();
    watchdog_ = std::thread([this] {
        set_thread_name("ferry-watchdog");
        watchdog();
    });
    log(LogLevel::kInfo, "fabric", "engine {:x}: provider {}, {} rail(s); {}", address.engine_id,
        provider, rails.size(), memory_.fabric_gpu_note());
    return ok_status();
}

void EngineImpl::watchdog() {
    std::unique_lock lk(watchdog_mu_);
    while (!stopped_) {
        watchdog_cv_.wait_for(lk, std::chrono::milliseconds(1));
        TimePoint now = Clock::now();
        imm.expire(now);
        for (auto& r : rails) {
            if (r->wedged() || !r->stuck_for(config.op_timeout, now)) continue;
            r->mark_wedged();
            Status why = unavailable(fmt::format(
                "rail {} ({}) has been stuck inside one provider call for over {:.0f} ms, most "
                "likely because a peer died while holding a lock in shared memory; its "
                "operations are failed and it takes no new work: create a new engine",
                r->index(), provider, to_ms(config.op_timeout)));
            log(LogLevel::kError, "fabric", "{}", why.message());
            fail_ops_on_rail(r->index(), why);
        }
    }
}

void EngineImpl::fail_ops_on_rail(int rail, const Status& why) {
    std::vector<std::shared_ptr<OpState>> victims;
    {
        std::lock_guard lk(registry_->mu);
        for (OpState* op : registry_->live) {
            if (op->rail_mask & (uint64_t{1} << rail)) victims.push_back(op->shared_from_this());
        }
    }
    for (auto& op : victims) op->fail_now(why);
}

void EngineImpl::shutdown() {
    if (stopped_.exchange(true)) return;
    Status why = cancelled("the transfer engine was shut down");
    // Pending GPU copies fail first; their callbacks may still signal through the rails.
    gpu_.shutdown();
    {
        std::lock_guard lk(watchdog_mu_);
    }
    watchdog_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    rails.stop(why);
    imm.cancel_all(why);
    memory_.close_all();
    rails.release();
}

EngineImpl::~EngineImpl() { shutdown(); }

Result<std::unique_ptr<MemoryRegion>> EngineImpl::register_memory(void* ptr, size_t len,
                                                                  MemoryKind kind, int device) {
    if (stopped_) return cancelled("the transfer engine was shut down");
    if (!ptr || len == 0) {
        return invalid_argument(fmt::format("cannot register {} bytes at {}", len, ptr));
    }
    FERRY_ASSIGN_OR_RETURN(MemoryRegistry::Registration reg, memory_.add(ptr, len, kind, device));
    std::unique_ptr<MemoryRegion> region(new MemoryRegion());
    region->engine_ = shared_from_this();
    region->id_ = reg.id;
    region->ptr_ = ptr;
    region->len_ = len;
    region->desc_ = std::move(reg.desc);
    region->local_descs_ = std::move(reg.local_descs);
    return region;
}

void EngineImpl::deregister(uint32_t id) { memory_.remove(id); }

Result<PeerId> EngineImpl::connect(const EngineAddress& a) {
    if (stopped_) return cancelled("the transfer engine was shut down");
    if (a.provider != provider) {
        return invalid_argument(fmt::format(
            "peer engine {:x} uses provider '{}' but this engine uses '{}'; both sides must "
            "open the same provider",
            a.engine_id, a.provider, provider));
    }
    if (a.rail_addrs.empty()) return invalid_argument("peer address has no rails");
    return peers_.connect(a, rails);
}

std::optional<PeerId> EngineImpl::find_peer(uint64_t engine_id) const {
    return peers_.find(engine_id);
}

Result<GroupId> EngineImpl::create_group(std::span<const PeerId> peers,
                                         std::span<const MemoryDescriptor> dsts) {
    return peers_.create_group(peers, dsts);
}

FabricOp* EngineImpl::make_rma(FabricOp::Type type, const Peer& p, int rail,
                               const MemoryRegion& local, uint64_t local_off,
                               const MemoryDescriptor& remote, uint64_t remote_off, uint64_t len,
                               std::optional<uint32_t> imm, TimePoint deadline) {
    auto* op = new FabricOp();
    op->type = type;
    op->peer = p.id;
    op->dest = p.fi_addr[rail];
    op->local = static_cast<uint8_t*>(local.data()) + local_off;
    op->len = len;
    op->desc = local.local_desc(rail);
    op->raddr = remote.wire_address(remote_off);
    op->rkey = remote.rail_keys[p.remote_rail[rail] % remote.rail_keys.size()];
    op->has_imm = imm.has_value();
    op->imm = imm.value_or(0);
    op->deadline = deadline;
    return op;
}

void EngineImpl::add_rma(RailBatch& b, FabricOp::Type type, const Peer& p,
                         const MemoryRegion& local, uint64_t local_off,
                         const MemoryDescriptor& remote, uint64_t remote_off, uint64_t len,
                         std::optional<uint32_t> imm, TimePoint deadline, bool stripe) {
    rails.split(len, stripe, [&](int rail, uint64_t off, uint64_t n) {
        b.add(rail, make_rma(type, p, rail, local, local_off + off, remote, remote_off + off, n,
                             imm, deadline));
    });
}

OpHandle EngineImpl::submit(RailBatch& b, std::shared_ptr<OpState> state, bool counts_imm) {
    if (counts_imm) state->imm_writes = b.count;
    if (stopped_) {
        RailGroup::discard(b);
        state->fail_now(cancelled("the transfer engine was shut down"));
        return OpHandle(state);
    }
    state->set_pieces(b.count);
    for (size_t r = 0; r < b.first.size(); ++r) {
        if (b.first[r]) state->rail_mask |= uint64_t{1} << r;
    }
    state->registry = registry_;
    {
        std::lock_guard lk(registry_->mu);
        registry_->live.insert(state.get());
    }
    for (size_t r = 0; r < b.first.size(); ++r) {
        b.for_each(r, [&](FabricOp* op) { op->parent = state; });
    }
    rails.post(b);
    return OpHandle(state);
}

Status EngineImpl::check_remote(const Peer& p, const MemoryDescriptor* d, uint64_t off,
                                uint64_t len, const char* what) const {
    if (!d) return invalid_argument(fmt::format("{}: no remote descriptor given", what));
    if (d->rail_keys.empty() && !d->has_ipc) {
        return invalid_argument(fmt::format("{}: remote descriptor has no rail keys", what));
    }
    if (d->engine_id != p.engine_id) {
        return invalid_argument(fmt::format(
            "{}: the descriptor belongs to engine {:x} but peer {} is engine {:x}; pass the "
            "descriptor that peer registered",
            what, d->engine_id, p.id, p.engine_id));
    }
    if (off > d->length || len > d->length - off) {
        return out_of_range(fmt::format(
            "{}: {} bytes at offset {} overrun the remote region of {} bytes (engine {:x}); "
            "rejected before posting",
            what, len, off, d->length, d->engine_id));
    }
    return ok_status();
}

Status EngineImpl::check_local(const MemoryRegion* r, uint64_t off, uint64_t len,
                               const char* what) const {
    if (!r) return invalid_argument(fmt::format("{}: no local region given", what));
    if (r->engine_.get() != this) {
        return invalid_argument(fmt::format("{}: the local region was registered with another "
                                            "engine",
                                            what));
    }
    if (off > r->size() || len > r->size() - off) {
        return out_of_range(fmt::format("{}: {} bytes at offset {} overrun the local region of {} "
                                        "bytes",
                                        what, len, off, r->size()));
    }
    return ok_status();
}

#define FERRY_FAIL_OP(state, expr)         \
    do {                                   \
        Status s_ = (expr);                \
        if (!s_.ok()) {                    \
            (state)->fail_now(std::move(s_)); \
            return OpHandle(state);        \
        }                                  \
    } while (0)

namespace {
Status no_peer(PeerId id, const char* what) {
    return not_found(fmt::format("{}: peer {} is not connected", what, id));
}
}  // namespace

Result<EngineImpl::Path> EngineImpl::choose_path(const Peer& p, const MemoryRegion& local,
                                                 const MemoryDescriptor& remote,
                                                 const char* what) const {
    bool local_gpu = local.descriptor().kind == MemoryKind::kCuda;
    bool remote_gpu = remote.kind == MemoryKind::kCuda;
    if (!local_gpu && !remote_gpu) return Path::kFabric;
    bool same_host = p.address.host_id == address.host_id;
    if (local_gpu && remote_gpu && remote.has_ipc && local.descriptor().has_ipc && same_host &&
        config.gpu_ipc) {
        return Path::kGpuIpc;
    }
    if (remote.rail_keys.empty()) {
        return invalid_argument(fmt::format(
            "{}: the remote region is GPU memory reachable only through CUDA IPC, which needs "
            "a peer on this host and GPU memory on this side too{}",
            what, same_host ? "" : " (peer engine is on another host)"));
    }
    if (local_gpu && local.descriptor().rail_keys.empty()) {
        return invalid_argument(fmt::format(
            "{}: local GPU memory is not registered with the provider ({}); it can only be "
            "copied to GPU memory of peers on this host",
            what, memory_.fabric_gpu_note()));
    }
    return Path::kFabric;
}

Result<uint64_t> EngineImpl::map_gpu_peer(const MemoryDescriptor& remote,
                                          const MemoryRegion& local) {
    return gpu_.map_peer(remote, local.descriptor().device);
}

OpHandle EngineImpl::gpu_op(std::shared_ptr<OpState> state, PeerId peer_id, int device,
                            std::vector<GpuCopy> copies, std::optional<uint32_t> imm_value) {
    auto g = gpu_.transport();
    if (!g.ok()) {
        state->fail_now(g.status());
        return OpHandle(state);
    }
    state->imm_writes = imm_value ? 1 : 0;
    state->set_pieces(1);
    auto self = shared_from_this();
    gpu_.submit(*g, device, std::move(copies), [self, state, peer_id, imm_value](const Status& s) {
        if (!s.ok() || !imm_value) {
            state->piece_done(s);
            return;
        }
        // The data is in place: tell the target like a write with immediate.
        self->signal(peer_id, *imm_value, [state](const Status& s2) {
            state->piece_done(s2.with_context("signalling a finished GPU copy"));
        });
    });
    return OpHandle(state);
}

OpHandle EngineImpl::write(const WriteOp& w, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Peer* p = peer(w.peer);
    if (!p) FERRY_FAIL_OP(state, no_peer(w.peer, "write"));
    if (w.length == 0 && !w.imm) FERRY_FAIL_OP(state, invalid_argument("write of 0 bytes"));
    FERRY_FAIL_OP(state, check_local(w.src, w.src_offset, w.length, "write"));
    FERRY_FAIL_OP(state, check_remote(*p, w.dst, w.dst_offset, w.length, "write"));
    auto path = choose_path(*p, *w.src, *w.dst, "write");
    if (!path.ok()) FERRY_FAIL_OP(state, path.status());
    if (*path == Path::kGpuIpc) {
        auto base = map_gpu_peer(*w.dst, *w.src);
        if (!base.ok()) FERRY_FAIL_OP(state, base.status());
        std::vector<GpuCopy> copies = {
            {*base + w.dst_offset, reinterpret_cast<uint64_t>(w.src->data()) + w.src_offset,
             w.length}};
        return gpu_op(state, w.peer, w.src->descriptor().device, std::move(copies), w.imm);
    }
    RailBatch b(rails.size());
    add_rma(b, FabricOp::kWrite, *p, *w.src, w.src_offset, *w.dst, w.dst_offset, w.length, w.imm,
            deadline_after(config.op_timeout), true);
    return submit(b, state, w.imm.has_value());
}

OpHandle EngineImpl::paged_write(const PagedWriteOp& w, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Peer* p = peer(w.peer);
    if (!p) FERRY_FAIL_OP(state, no_peer(w.peer, "paged write"));
    if (w.page_size == 0) FERRY_FAIL_OP(state, invalid_argument("paged write: page_size is 0"));
    if (w.src_pages.size() != w.dst_pages.size()) {
        FERRY_FAIL_OP(state, invalid_argument(fmt::format(
                                 "paged write: {} source pages but {} destination pages",
                                 w.src_pages.size(), w.dst_pages.size())));
    }
    if (w.src_pages.empty()) FERRY_FAIL_OP(state, invalid_argument("paged write: no pages"));
    uint64_t ss = w.src_stride ? w.src_stride : w.page_size;
    uint64_t ds = w.dst_stride ? w.dst_stride : w.page_size;
    FERRY_FAIL_OP(state, check_local(w.src, 0, 0, "paged write"));
    FERRY_FAIL_OP(state, check_remote(*p, w.dst, 0, 0, "paged write"));
    // Bounds of every page before anything is posted: a bad index loses nothing. One pass
    // for the largest index on each side (pages lists run to 100k+ entries for a long
    // prompt); the slow per-page check only runs to name the offending page.
    uint32_t max_src = 0, max_dst = 0;
    for (size_t i = 0; i < w.src_pages.size(); ++i) {
        max_src = std::max(max_src, w.src_pages[i]);
        max_dst = std::max(max_dst, w.dst_pages[i]);
    }
    if (!check_local(w.src, w.src_offset + uint64_t{max_src} * ss, w.page_size, "").ok() ||
        !check_remote(*p, w.dst, w.dst_offset + uint64_t{max_dst} * ds, w.page_size, "").ok()) {
        for (size_t i = 0; i < w.src_pages.size(); ++i) {
            uint64_t so = w.src_offset + uint64_t{w.src_pages[i]} * ss;
            uint64_t dof = w.dst_offset + uint64_t{w.dst_pages[i]} * ds;
            Status s = check_local(w.src, so, w.page_size, "paged write");
            if (s.ok()) s = check_remote(*p, w.dst, dof, w.page_size, "paged write");
            if (!s.ok()) {
                FERRY_FAIL_OP(state, s.with_context(fmt::format("page {} ({} -> {})", i,
                                                                 w.src_pages[i],
                                                                 w.dst_pages[i])));
            }
        }
    }
    auto path = choose_path(*p, *w.src, *w.dst, "paged write");
    if (!path.ok()) FERRY_FAIL_OP(state, path.status());
    uint64_t gpu_base = 0;
    std::vector<GpuCopy> copies;
    if (*path == Path::kGpuIpc) {
        copies.reserve(w.src_pages.size());
        auto base = map_gpu_peer(*w.dst, *w.src);
        if (!base.ok()) FERRY_FAIL_OP(state, base.status());
        gpu_base = *base;
    }
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    bool src_dense = ss == w.page_size, dst_dense = ds == w.page_size;
    size_t i = 0;
    while (i < w.src_pages.size()) {
        size_t j = i + 1;
        if (src_dense && dst_dense) {
            while (j < w.src_pages.size() && w.src_pages[j] == w.src_pages[j - 1] + 1 &&
                   w.dst_pages[j] == w.dst_pages[j - 1] + 1) {
                ++j;
            }
        }
        uint64_t so = w.src_offset + uint64_t{w.src_pages[i]} * ss;
        uint64_t dof = w.dst_offset + uint64_t{w.dst_pages[i]} * ds;
        if (*path == Path::kGpuIpc) {
            copies.push_back({gpu_base + dof, reinterpret_cast<uint64_t>(w.src->data()) + so,
                              (j - i) * w.page_size});
        } else {
            add_rma(b, FabricOp::kWrite, *p, *w.src, so, *w.dst, dof, (j - i) * w.page_size,
                    w.imm, deadline, false);
        }
        i = j;
    }
    if (*path == Path::kGpuIpc) {
        return gpu_op(state, w.peer, w.src->descriptor().device, std::move(copies), w.imm);
    }
    return submit(b, state, w.imm.has_value());
}

// Every run in bounds before anything is posted: a bad run moves nothing. local_is_src: the
// runs' src offsets are in the local region (writes), else their dst offsets (reads).
Status EngineImpl::check_runs(const Peer& p, const MemoryRegion* local,
                              const MemoryDescriptor* remote, std::span<const WriteRun> runs,
                              bool local_is_src, const char* what) {
    if (runs.empty()) return invalid_argument(fmt::format("{}: no runs", what));
    FERRY_RETURN_IF_ERROR(check_local(local, 0, 0, what));
    FERRY_RETURN_IF_ERROR(check_remote(p, remote, 0, 0, what));
    for (size_t i = 0; i < runs.size(); ++i) {
        const WriteRun& r = runs[i];
        const uint64_t here = local_is_src ? r.src_offset : r.dst_offset;
        const uint64_t there = local_is_src ? r.dst_offset : r.src_offset;
        Status s = r.length == 0 ? invalid_argument(fmt::format("{}: a run of 0 bytes", what))
                                 : check_local(local, here, r.length, what);
        if (s.ok()) s = check_remote(p, remote, there, r.length, what);
        if (!s.ok())
            return s.with_context(fmt::format("run {} ({} bytes, {} -> {})", i, r.length,
                                              r.src_offset, r.dst_offset));
    }
    return ok_status();
}

OpHandle EngineImpl::write_runs(const WriteRunsOp& w, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Peer* p = peer(w.peer);
    if (!p) FERRY_FAIL_OP(state, no_peer(w.peer, "write_runs"));
    FERRY_FAIL_OP(state, check_runs(*p, w.src, w.dst, w.runs, true, "write_runs"));
    auto path = choose_path(*p, *w.src, *w.dst, "write_runs");
    if (!path.ok()) FERRY_FAIL_OP(state, path.status());
    if (*path == Path::kGpuIpc) {
        auto base = map_gpu_peer(*w.dst, *w.src);
        if (!base.ok()) FERRY_FAIL_OP(state, base.status());
        const uint64_t src = reinterpret_cast<uint64_t>(w.src->data());
        std::vector<GpuCopy> copies;
        copies.reserve(w.runs.size());
        for (const WriteRun& r : w.runs)
            copies.push_back({*base + r.dst_offset, src + r.src_offset, r.length});
        return gpu_op(state, w.peer, w.src->descriptor().device, std::move(copies), w.imm);
    }
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    for (const WriteRun& r : w.runs) {
        add_rma(b, FabricOp::kWrite, *p, *w.src, r.src_offset, *w.dst, r.dst_offset, r.length,
                w.imm, deadline, true);
    }
    return submit(b, state, w.imm.has_value());
}

OpHandle EngineImpl::read(const ReadOp& r, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Peer* p = peer(r.peer);
    if (!p) FERRY_FAIL_OP(state, no_peer(r.peer, "read"));
    if (r.length == 0) FERRY_FAIL_OP(state, invalid_argument("read of 0 bytes"));
    FERRY_FAIL_OP(state, check_local(r.dst, r.dst_offset, r.length, "read"));
    FERRY_FAIL_OP(state, check_remote(*p, r.src, r.src_offset, r.length, "read"));
    auto path = choose_path(*p, *r.dst, *r.src, "read");
    if (!path.ok()) FERRY_FAIL_OP(state, path.status());
    if (*path == Path::kGpuIpc) {
        auto base = map_gpu_peer(*r.src, *r.dst);
        if (!base.ok()) FERRY_FAIL_OP(state, base.status());
        std::vector<GpuCopy> copies = {{reinterpret_cast<uint64_t>(r.dst->data()) + r.dst_offset,
                                         *base + r.src_offset, r.length}};
        return gpu_op(state, r.peer, r.dst->descriptor().device, std::move(copies), std::nullopt);
    }
    RailBatch b(rails.size());
    add_rma(b, FabricOp::kRead, *p, *r.dst, r.dst_offset, *r.src, r.src_offset, r.length,
            std::nullopt, deadline_after(config.op_timeout), true);
    return submit(b, state, false);
}

OpHandle EngineImpl::read_runs(const ReadRunsOp& r, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Peer* p = peer(r.peer);
    if (!p) FERRY_FAIL_OP(state, no_peer(r.peer, "read_runs"));
    FERRY_FAIL_OP(state, check_runs(*p, r.dst, r.src, r.runs, false, "read_runs"));
    auto path = choose_path(*p, *r.dst, *r.src, "read_runs");
    if (!path.ok()) FERRY_FAIL_OP(state, path.status());
    if (*path == Path::kGpuIpc) {
        auto base = map_gpu_peer(*r.src, *r.dst);
        if (!base.ok()) FERRY_FAIL_OP(state, base.status());
        const uint64_t dst = reinterpret_cast<uint64_t>(r.dst->data());
        std::vector<GpuCopy> copies;
        copies.reserve(r.runs.size());
        for (const WriteRun& run : r.runs)
            copies.push_back({dst + run.dst_offset, *base + run.src_offset, run.length});
        return gpu_op(state, r.peer, r.dst->descriptor().device, std::move(copies), std::nullopt);
    }
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    for (const WriteRun& run : r.runs) {
        add_rma(b, FabricOp::kRead, *p, *r.dst, run.dst_offset, *r.src, run.src_offset,
                run.length, std::nullopt, deadline, true);
    }
    return submit(b, state, false);
}

OpHandle EngineImpl::scatter(const ScatterOp& sc, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Group* g = peers_.group(sc.group);
    if (!g) FERRY_FAIL_OP(state, not_found(fmt::format("scatter: no group {}", sc.group)));
    if (sc.slices.empty()) FERRY_FAIL_OP(state, invalid_argument("scatter: no slices"));
    for (const auto& s : sc.slices) {
        if (s.member >= g->peers.size()) {
            FERRY_FAIL_OP(state, invalid_argument(fmt::format(
                                     "scatter: slice for member {} but the group has {}",
                                     s.member, g->peers.size())));
        }
        if (s.length == 0 && !sc.imm) FERRY_FAIL_OP(state, invalid_argument("scatter: empty slice"));
        FERRY_FAIL_OP(state, check_local(sc.src, s.src_offset, s.length, "scatter"));
        auto path = choose_path(*peer(g->peers[s.member]), *sc.src, g->dsts[s.member], "scatter");
        if (!path.ok()) FERRY_FAIL_OP(state, path.status());
        if (*path != Path::kFabric) {
            FERRY_FAIL_OP(state, invalid_argument("scatter between GPU regions over CUDA IPC is not "
                                                  "supported; use paged_write per peer"));
        }
        FERRY_FAIL_OP(state, check_remote(*peer(g->peers[s.member]), &g->dsts[s.member],
                                          s.dst_offset, s.length, "scatter"));
    }
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    for (const auto& s : sc.slices) {
        add_rma(b, FabricOp::kWrite, *peer(g->peers[s.member]), *sc.src, s.src_offset,
                g->dsts[s.member], s.dst_offset, s.length, sc.imm, deadline, true);
    }
    return submit(b, state, sc.imm.has_value());
}

OpHandle EngineImpl::signal(PeerId id, uint32_t imm_value, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Peer* p = peer(id);
    if (!p) FERRY_FAIL_OP(state, no_peer(id, "signal"));
    RailBatch b(rails.size());
    int rail = rails.next_rail();
    auto* op = new FabricOp();
    op->type = FabricOp::kWrite;
    op->peer = id;
    op->dest = p->fi_addr[rail];
    op->local = rails[rail].signal_base();
    op->len = 0;
    op->raddr = p->address.signal.wire_address(0);
    op->rkey = p->address.signal.rail_keys[p->remote_rail[rail] %
                                           p->address.signal.rail_keys.size()];
    op->has_imm = true;
    op->imm = imm_value;
    op->deadline = deadline_after(config.op_timeout);
    b.add(rail, op);
    return submit(b, state, true);
}

Status EngineImpl::barrier(GroupId group, uint32_t imm_value, Duration timeout) {
    const Group* g = peers_.group(group);
    if (!g) return not_found(fmt::format("barrier: no group {}", group));
    const std::vector<PeerId>& members = g->peers;
    auto deadline = deadline_after(timeout);
    std::vector<OpHandle> sent;
    for (PeerId m : members) sent.push_back(signal(m, imm_value, {}));
    Status arrived = imm.wait(imm_value, members.size(), timeout);
    for (auto& h : sent) {
        Status s = h.wait(std::max<Duration>(deadline - Clock::now(), Duration::zero()));
        if (!s.ok()) return s.with_context("barrier");
    }
    return arrived.with_context(fmt::format("barrier over {} peers", members.size()));
}

void EngineImpl::expect_arrivals(bool on) {
    if (!on) {
        expecting_.fetch_sub(1, std::memory_order_relaxed);
        return;
    }
    if (expecting_.fetch_add(1, std::memory_order_relaxed) == 0)
        rails.wake_all();
}

OpHandle EngineImpl::send_message(PeerId id, std::span<const uint8_t> payload, OpCallback done) {
    auto state = std::make_shared<OpState>(std::move(done));
    const Peer* p = peer(id);
    if (!p) FERRY_FAIL_OP(state, no_peer(id, "send_message"));
    FERRY_FAIL_OP(state, control_.check_size(payload.size()));
    RailBatch b(rails.size());
    b.add(0, control_.make_send(address.engine_id, id, p->fi_addr[0], payload,
                                deadline_after(config.op_timeout)));
    return submit(b, state, false);
}

void EngineImpl::set_message_handler(MessageHandler handler) {
    control_.set_handler(std::move(handler));
}

EngineStats EngineImpl::stats() const {
    EngineStats s = rails.stats();
    s.messages_dropped += control_.dropped();
    return s;
}

}  // namespace ferry::detail
