// Every request checked before anything is posted: owners, bounds, and which path (fabric or
// same-host GPU copy) its memory allows. A bad request moves nothing.
#include <fmt/format.h>

#include "fabric/engine_impl.h"
#include "ferry/common/log.h"

namespace ferry::detail {

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
        return invalid_argument(
            fmt::format("{}: the local region was registered with another "
                        "engine",
                        what));
    }
    if (off > r->size() || len > r->size() - off) {
        return out_of_range(
            fmt::format("{}: {} bytes at offset {} overrun the local region of {} "
                        "bytes",
                        what, len, off, r->size()));
    }
    return ok_status();
}

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

void EngineImpl::note_route(const Peer& p, const MemoryRegion& local,
                            const MemoryDescriptor& remote, const RailRoute& r) {
    if (!r.local) return;
    if (!r.common) rail_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    std::atomic<bool>& logged = r.common ? local.route_logged_ : local.fallback_logged_;
    if (logged.load(std::memory_order_relaxed) || logged.exchange(true, std::memory_order_relaxed))
        return;
    // Greppable like the rail and region lines: "pairs 2->0,3->1".
    log(rails.size() > 1 ? LogLevel::kInfo : LogLevel::kDebug, "fabric",
        "engine {:x}: region {} (near rails {}) to a region of engine {:x} (peer {}, near its "
        "rails {}): pairs {} ({}{})",
        address.engine_id, local.id(), rail_set_text(local.send_rails() & rails.all()),
        remote.engine_id, p.id, rail_set_text(r.remote), r.pairs_text(),
        r.common ? "matching NICs" : "no common rail: each end on its own near NICs, across rails",
        r.common ? "" : "; counted in rail_fallbacks, this region's later ones only counted");
}

Status EngineImpl::no_common_rail(const Peer& p, const MemoryRegion& local,
                                  const MemoryDescriptor& remote, const char* what) const {
    return invalid_argument(fmt::format(
        "{}: no rail pair reaches both regions: the local region is on rails {} of this engine, "
        "the remote region on rails {} of engine {:x} (peer {} has {} rails); is the descriptor "
        "from this peer?",
        what, rail_set_text(local.descriptor().held_rails() & rails.all()),
        rail_set_text(remote.held_rails()), remote.engine_id, p.id, p.peer_rails));
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

}  // namespace ferry::detail
