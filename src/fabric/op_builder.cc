// Turning requests (write, paged_write, write_runs, read, read_runs, scatter, signal, barrier,
// send_message; batches in op_batch.cc) into fabric operations per rail, split as the rail group
// decides, or into GPU copies for same-host GPU pairs, and handing them over with one OpState.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "fabric/engine_impl.h"

namespace ferry::detail {

#define FERRY_FAIL_OP(state, expr)             \
    do {                                       \
        Status s_ = (expr);                    \
        if (!s_.ok()) {                        \
            (state)->fail_now(std::move(s_));  \
            return OpHandle(std::move(state)); \
        }                                      \
    } while (0)

namespace {
Status no_peer(PeerId id, const char* what) {
    return not_found(fmt::format("{}: peer {} is not connected", what, id));
}
Status gpu_in_batch_op(const char* what) {
    return invalid_argument(
        fmt::format("submit_all: a {} between GPUs of this host (CUDA IPC) cannot be part of one "
                    "batch operation; use submit_batch",
                    what));
}
}  // namespace

// make_rma and add_rma are inline (every caller is in this file): out of line, the twelve
// arguments of each went through the stack for every piece, ~60 of build_write's ~294
// instructions per 64 B write (callgrind, shm, 2026-12-02). GCC keeps add_rma out of line
// unless told (it has seven callers), hence always_inline; and it kept make_rma out of line
// too (its call, with the twelve arguments, ~25 instructions per 64 B write, 2026-12-03).
[[gnu::always_inline]] inline FabricOp* EngineImpl::make_rma(
    FabricOp::Type type, const Peer& p, int rail, int peer_rail, const MemoryRegion& local,
    uint64_t local_off, const MemoryDescriptor& remote, uint64_t remote_off, uint64_t len,
    std::optional<uint32_t> imm, TimePoint deadline, OpState* state) {
    auto* op = new FabricOp();
    op->type = type;
    op->peer = p.id;
    op->dest = p.addr(rail, peer_rail);
    op->local = static_cast<uint8_t*>(local.data()) + local_off;
    op->len = len;
    op->desc = local.local_desc(rail);
    op->raddr = remote.wire_address(remote_off);
    op->rkey = remote.rail_keys[peer_rail];
    op->has_imm = imm.has_value();
    op->imm = imm.value_or(0);
    op->deadline = deadline;
    op->parent = state;
    state->rail_mask |= uint64_t{1} << rail;
    return op;
}

[[gnu::always_inline]] inline void EngineImpl::add_rma(
    RailBatch& b, FabricOp::Type type, const Peer& p, const MemoryRegion& local, uint64_t local_off,
    const MemoryDescriptor& remote, uint64_t remote_off, uint64_t len, std::optional<uint32_t> imm,
    TimePoint deadline, bool stripe, const RailRoute& route, OpState* state) {
    // One piece: made here, without the closure of twelve references that split would call
    // (~40 instructions per 64 B write, callgrind, shm, 2026-12-02).
    if (rails.one_piece(len, stripe, route.local)) {
        int rail = rails.next_rail(route.local);
        b.add(rail, make_rma(type, p, rail, route.peer_rail(rail), local, local_off, remote,
                             remote_off, len, imm, deadline, state));
        return;
    }
    rails.split(len, stripe, route.local, [&](int rail, uint64_t off, uint64_t n) {
        b.add(rail, make_rma(type, p, rail, route.peer_rail(rail), local, local_off + off, remote,
                             remote_off + off, n, imm, deadline, state));
    });
}

void EngineImpl::add_run(RailBatch& b, RunGroup& g, FabricOp::Type type, const Peer& p,
                         const MemoryRegion& local, uint64_t local_off,
                         const MemoryDescriptor& remote, uint64_t remote_off, uint64_t len,
                         std::optional<uint32_t> imm, TimePoint deadline, bool stripe,
                         const RailRoute& route, OpState* state) {
    if (!rails.one_piece(len, stripe, route.local)) {
        g.open = nullptr;
        add_rma(b, type, p, local, local_off, remote, remote_off, len, imm, deadline, stripe, route,
                state);
        return;
    }
    FabricOp* op = g.open;
    if (op && size_t{op->more_iovs} + 1 < g.max_iovs && len <= UINT32_MAX &&
        g.bytes + len <= g.join_bytes) {
        const uint8_t i = op->more_iovs++;
        op->more.local[i] = static_cast<uint8_t*>(local.data()) + local_off;
        op->more.raddr[i] = remote.wire_address(remote_off);
        op->more.len[i] = static_cast<uint32_t>(len);
        g.bytes += len;
        return;
    }
    const int rail = rails.next_rail(route.local);
    op = make_rma(type, p, rail, route.peer_rail(rail), local, local_off, remote, remote_off, len,
                  imm, deadline, state);
    b.add(rail, op);
    g.open = op;
    g.bytes = len;
    g.max_iovs = rails[rail].max_iovs(type, imm.has_value());
    g.join_bytes = std::min(rails.max_write_size(), rails[rail].join_bytes());
}

void EngineImpl::arm(OpState* state, uint32_t pieces, bool counts_imm) {
    if (counts_imm) state->imm_writes = pieces;
    state->set_pieces(pieces);
    state->registry = registry_.get();
}

OpHandle EngineImpl::submit(RailBatch& b, OpRef state, bool counts_imm) {
    if (stopped_) {
        RailGroup::discard(b);
        state->fail_now(cancelled("the transfer engine was shut down"));
        return OpHandle(std::move(state));
    }
    arm(state.get(), b.count, counts_imm);
    {
        std::lock_guard lk(registry_->mu);
        registry_->insert(state.get());
    }
    rails.post(b);
    return OpHandle(std::move(state));
}

Result<uint64_t> EngineImpl::map_gpu_peer(const MemoryDescriptor& remote,
                                          const MemoryRegion& local) {
    return gpu_.map_peer(remote, local.descriptor().device);
}

OpHandle EngineImpl::gpu_op(OpRef state, PeerId peer_id, int device, GpuWork work,
                            std::optional<uint32_t> imm_value) {
    auto g = gpu_.transport();
    if (!g.ok()) {
        state->fail_now(g.status());
        return OpHandle(std::move(state));
    }
    state->imm_writes = imm_value ? 1 : 0;
    state->set_pieces(1);
    auto self = shared_from_this();
    gpu_.submit(*g, device, std::move(work), [self, state, peer_id, imm_value](const Status& s) {
        if (!s.ok() || !imm_value) {
            state->piece_done(s);
            return;
        }
        // The data is in place: tell the target like a write with immediate.
        self->signal(peer_id, *imm_value, [state](const Status& s2) {
            state->piece_done(s2.with_context("signalling a finished GPU copy"));
        });
    });
    return OpHandle(std::move(state));
}

#define FERRY_FAIL_BUILD(state, expr)         \
    do {                                      \
        Status s_ = (expr);                   \
        if (!s_.ok()) {                       \
            (state)->fail_now(std::move(s_)); \
            return false;                     \
        }                                     \
    } while (0)

bool EngineImpl::build_write(const WriteOp& w, OpState* state, RailBatch& b, TimePoint deadline,
                             bool gpu_ok) {
    const Peer* p = peer(w.peer);
    if (!p) FERRY_FAIL_BUILD(state, no_peer(w.peer, "write"));
    if (w.length == 0 && !w.imm) FERRY_FAIL_BUILD(state, invalid_argument("write of 0 bytes"));
    if (host_fabric_ok(*p, w.src, w.src_offset, w.dst, w.dst_offset, w.length)) {
        if (const RailRoute use = route(*p, *w.src, *w.dst); use.local) {
            add_rma(b, FabricOp::kWrite, *p, *w.src, w.src_offset, *w.dst, w.dst_offset, w.length,
                    w.imm, deadline, true, use, state);
            return true;
        }
    }
    FERRY_FAIL_BUILD(state, check_local(w.src, w.src_offset, w.length, "write"));
    FERRY_FAIL_BUILD(state, check_remote(*p, w.dst, w.dst_offset, w.length, "write"));
    auto path = choose_path(*p, *w.src, *w.dst, "write");
    if (!path.ok()) FERRY_FAIL_BUILD(state, path.status());
    if (*path == Path::kGpuIpc) {
        if (!gpu_ok) FERRY_FAIL_BUILD(state, gpu_in_batch_op("write"));
        auto base = map_gpu_peer(*w.dst, *w.src);
        if (!base.ok()) FERRY_FAIL_BUILD(state, base.status());
        std::vector<GpuCopy> copies = {{*base + w.dst_offset,
                                        reinterpret_cast<uint64_t>(w.src->data()) + w.src_offset,
                                        w.length}};
        gpu_op(OpRef::share(state), w.peer, w.src->descriptor().device,
               GpuWork{std::move(copies), {}, {}}, w.imm);
        return false;
    }
    const RailRoute use = route(*p, *w.src, *w.dst);
    if (!use.local) FERRY_FAIL_BUILD(state, no_common_rail(*p, *w.src, *w.dst, "write"));
    add_rma(b, FabricOp::kWrite, *p, *w.src, w.src_offset, *w.dst, w.dst_offset, w.length, w.imm,
            deadline, true, use, state);
    return true;
}

std::optional<OpHandle> EngineImpl::cma_write(OpRef& state, const Peer& p,
                                              const MemoryDescriptor& dst,
                                              std::span<const CmaPiece> pieces,
                                              std::optional<uint32_t> imm, const char* what) {
    if (stopped_ || !cma_.usable(p, dst)) return std::nullopt;
    bool refused = false;
    Status s = cma_.copy(p, dst, pieces, &refused);
    if (refused) return std::nullopt;
    if (!s.ok()) {
        state->fail_now(s.with_context(what));
        return OpHandle(std::move(state));
    }
    if (!imm) {
        state->set_pieces(1);
        state->piece_done(ok_status());
        return OpHandle(std::move(state));
    }
    // The bytes are in place: the target learns of them like of a write with immediate.
    state->imm_writes = 1;
    state->set_pieces(1);
    signal(p.id, *imm, [done = state](const Status& s2) {
        done->piece_done(s2.with_context("signalling a write copied by process_vm_writev"));
    });
    return OpHandle(std::move(state));
}

OpHandle EngineImpl::write(const WriteOp& w, OpCallback done) {
    auto state = make_op_state(std::move(done));
    // A write of at most inject_size (shm: 4 KiB) stays shm's: its bytes go inline in the one
    // command the target's worker reads for the immediate anyway, where a copy by the caller
    // adds a system call to the same hand-off (bench_peers, 64 B writes one at a time: 0.92x,
    // 0.49x and 0.50x of shm's rate in three runs; BENCHMARKS.md, "writes copied by the
    // initiator").
    if (w.dst && w.dst->cma_pid && w.length > rails[0].inject_size()) {
        const Peer* p = peer(w.peer);
        if (p && host_fabric_ok(*p, w.src, w.src_offset, w.dst, w.dst_offset, w.length)) {
            const CmaPiece piece{static_cast<const uint8_t*>(w.src->data()) + w.src_offset,
                                 w.dst->base + w.dst_offset, w.length};
            if (auto h = cma_write(state, *p, *w.dst, {&piece, 1}, w.imm, "write"))
                return std::move(*h);
        }
    }
    RailBatch b(rails.size());
    if (!build_write(w, state.get(), b, deadline_after(config.op_timeout), true))
        return OpHandle(std::move(state));
    return submit(b, std::move(state), w.imm.has_value());
}

bool EngineImpl::build_read(const ReadOp& r, OpState* state, RailBatch& b, TimePoint deadline,
                            bool gpu_ok) {
    const Peer* p = peer(r.peer);
    if (!p) FERRY_FAIL_BUILD(state, no_peer(r.peer, "read"));
    if (r.length == 0) FERRY_FAIL_BUILD(state, invalid_argument("read of 0 bytes"));
    if (host_fabric_ok(*p, r.dst, r.dst_offset, r.src, r.src_offset, r.length)) {
        if (const RailRoute use = route(*p, *r.dst, *r.src); use.local) {
            add_rma(b, FabricOp::kRead, *p, *r.dst, r.dst_offset, *r.src, r.src_offset, r.length,
                    std::nullopt, deadline, true, use, state);
            return true;
        }
    }
    FERRY_FAIL_BUILD(state, check_local(r.dst, r.dst_offset, r.length, "read"));
    FERRY_FAIL_BUILD(state, check_remote(*p, r.src, r.src_offset, r.length, "read"));
    auto path = choose_path(*p, *r.dst, *r.src, "read");
    if (!path.ok()) FERRY_FAIL_BUILD(state, path.status());
    if (*path == Path::kGpuIpc) {
        if (!gpu_ok) FERRY_FAIL_BUILD(state, gpu_in_batch_op("read"));
        auto base = map_gpu_peer(*r.src, *r.dst);
        if (!base.ok()) FERRY_FAIL_BUILD(state, base.status());
        std::vector<GpuCopy> copies = {{reinterpret_cast<uint64_t>(r.dst->data()) + r.dst_offset,
                                        *base + r.src_offset, r.length}};
        gpu_op(OpRef::share(state), r.peer, r.dst->descriptor().device,
               GpuWork{std::move(copies), {}, {}}, std::nullopt);
        return false;
    }
    const RailRoute use = route(*p, *r.dst, *r.src);
    if (!use.local) FERRY_FAIL_BUILD(state, no_common_rail(*p, *r.dst, *r.src, "read"));
    add_rma(b, FabricOp::kRead, *p, *r.dst, r.dst_offset, *r.src, r.src_offset, r.length,
            std::nullopt, deadline, true, use, state);
    return true;
}

OpHandle EngineImpl::paged_write(const PagedWriteOp& w, OpCallback done) {
    auto state = make_op_state(std::move(done));
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
    auto path = choose_path(*p, *w.src, *w.dst, "paged write");
    if (!path.ok()) FERRY_FAIL_OP(state, path.status());
    // Between GPUs of this host the page ids go to the device (op_paged.cc).
    if (*path == Path::kGpuIpc) return paged_write_gpu(w, *p, std::move(state));
    // Bounds of every page before anything is posted: a bad index loses nothing. One pass
    // for the largest index on each side (pages lists run to 100k+ entries for a long
    // prompt); the slow per-page check only runs to name the offending page.
    uint32_t max_src = 0, max_dst = 0;
    for (size_t i = 0; i < w.src_pages.size(); ++i) {
        max_src = std::max(max_src, w.src_pages[i]);
        max_dst = std::max(max_dst, w.dst_pages[i]);
    }
    FERRY_FAIL_OP(state, check_pages(w, *p, max_src, max_dst));
    bool src_dense = ss == w.page_size, dst_dense = ds == w.page_size;
    // Pages as runs of adjacent pages: one write each on the fabric, one iovec each here.
    auto for_each_run = [&](auto&& run) {
        for (size_t i = 0; i < w.src_pages.size();) {
            size_t j = i + 1;
            if (src_dense && dst_dense) {
                while (j < w.src_pages.size() && w.src_pages[j] == w.src_pages[j - 1] + 1 &&
                       w.dst_pages[j] == w.dst_pages[j - 1] + 1) {
                    ++j;
                }
            }
            run(w.src_offset + uint64_t{w.src_pages[i]} * ss,
                w.dst_offset + uint64_t{w.dst_pages[i]} * ds, (j - i) * w.page_size);
            i = j;
        }
    };
    // A KV segment's pages into a same-host peer's host memory: copied by this thread
    // (process_vm_writev, cma_path.h) where both engines allow it, so the target's worker
    // does not copy them (shm's writes are copied at their target).
    if (w.dst->cma_pid && w.src->descriptor().kind == MemoryKind::kHost &&
        w.dst->kind == MemoryKind::kHost && cma_.usable(*p, *w.dst)) {
        const auto* src = static_cast<const uint8_t*>(w.src->data());
        std::vector<CmaPiece> pieces;
        pieces.reserve(w.src_pages.size());
        for_each_run([&](uint64_t so, uint64_t dof, uint64_t len) {
            pieces.push_back({src + so, w.dst->base + dof, len});
        });
        if (auto h = cma_write(state, *p, *w.dst, pieces, w.imm, "paged write"))
            return std::move(*h);
    }
    const RailRoute use = route(*p, *w.src, *w.dst);
    if (!use.local) FERRY_FAIL_OP(state, no_common_rail(*p, *w.src, *w.dst, "paged write"));
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    RunGroup g;
    for_each_run([&](uint64_t so, uint64_t dof, uint64_t len) {
        add_run(b, g, FabricOp::kWrite, *p, *w.src, so, *w.dst, dof, len, w.imm, deadline, false,
                use, state.get());
    });
    return submit(b, std::move(state), w.imm.has_value());
}

OpHandle EngineImpl::write_runs(const WriteRunsOp& w, OpCallback done) {
    auto state = make_op_state(std::move(done));
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
        return gpu_op(std::move(state), w.peer, w.src->descriptor().device,
                      GpuWork{std::move(copies), {}, {}}, w.imm);
    }
    if (w.dst->cma_pid && w.src->descriptor().kind == MemoryKind::kHost &&
        w.dst->kind == MemoryKind::kHost && cma_.usable(*p, *w.dst)) {
        const auto* src = static_cast<const uint8_t*>(w.src->data());
        std::vector<CmaPiece> pieces;
        pieces.reserve(w.runs.size());
        for (const WriteRun& r : w.runs)
            pieces.push_back({src + r.src_offset, w.dst->base + r.dst_offset, r.length});
        if (auto h = cma_write(state, *p, *w.dst, pieces, w.imm, "write_runs"))
            return std::move(*h);
    }
    const RailRoute use = route(*p, *w.src, *w.dst);
    if (!use.local) FERRY_FAIL_OP(state, no_common_rail(*p, *w.src, *w.dst, "write_runs"));
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    RunGroup g;
    for (const WriteRun& r : w.runs) {
        add_run(b, g, FabricOp::kWrite, *p, *w.src, r.src_offset, *w.dst, r.dst_offset, r.length,
                w.imm, deadline, true, use, state.get());
    }
    return submit(b, std::move(state), w.imm.has_value());
}

OpHandle EngineImpl::read(const ReadOp& r, OpCallback done) {
    auto state = make_op_state(std::move(done));
    RailBatch b(rails.size());
    if (!build_read(r, state.get(), b, deadline_after(config.op_timeout), true))
        return OpHandle(std::move(state));
    return submit(b, std::move(state), false);
}

OpHandle EngineImpl::read_runs(const ReadRunsOp& r, OpCallback done) {
    auto state = make_op_state(std::move(done));
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
        return gpu_op(std::move(state), r.peer, r.dst->descriptor().device,
                      GpuWork{std::move(copies), {}, {}}, std::nullopt);
    }
    const RailRoute use = route(*p, *r.dst, *r.src);
    if (!use.local) FERRY_FAIL_OP(state, no_common_rail(*p, *r.dst, *r.src, "read_runs"));
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    RunGroup g;
    for (const WriteRun& run : r.runs) {
        add_run(b, g, FabricOp::kRead, *p, *r.dst, run.dst_offset, *r.src, run.src_offset,
                run.length, std::nullopt, deadline, true, use, state.get());
    }
    return submit(b, std::move(state), false);
}

OpHandle EngineImpl::scatter(const ScatterOp& sc, OpCallback done) {
    auto state = make_op_state(std::move(done));
    const Group* g = peers_.group(sc.group);
    if (!g) FERRY_FAIL_OP(state, not_found(fmt::format("scatter: no group {}", sc.group)));
    if (sc.slices.empty()) FERRY_FAIL_OP(state, invalid_argument("scatter: no slices"));
    FERRY_FAIL_OP(state, check_local(sc.src, 0, 0, "scatter"));
    const bool src_gpu = sc.src->descriptor().kind == MemoryKind::kCuda;
    const RailSet src_rails = sc.src->send_rails() & rails.all();
    // Every slice checked before anything is built, against the group's prepared rows (see
    // Group): from host memory the path of a member is known since the group was created.
    for (const auto& s : sc.slices) {
        if (s.member >= g->members.size()) {
            FERRY_FAIL_OP(state, invalid_argument(fmt::format(
                                     "scatter: slice for member {} but the group has {}", s.member,
                                     g->members.size())));
        }
        if (s.length == 0 && !sc.imm)
            FERRY_FAIL_OP(state, invalid_argument("scatter: empty slice"));
        FERRY_FAIL_OP(state, check_local(sc.src, s.src_offset, s.length, "scatter"));
        const GroupMember& m = g->members[s.member];
        if (src_gpu || !m.host_reachable) {
            auto path = choose_path(*peer(m.peer), *sc.src, g->dsts[s.member], "scatter");
            if (!path.ok()) FERRY_FAIL_OP(state, path.status());
            if (*path != Path::kFabric) {
                FERRY_FAIL_OP(state, invalid_argument("scatter between GPU regions over CUDA "
                                                      "IPC is not supported; use paged_write "
                                                      "per peer"));
            }
        }
        if (s.dst_offset > m.dst_length || s.length > m.dst_length - s.dst_offset) {
            FERRY_FAIL_OP(state, check_remote(*peer(m.peer), &g->dsts[s.member], s.dst_offset,
                                              s.length, "scatter"));
        }
        if (!src_rails || !m.near) {
            FERRY_FAIL_OP(state,
                          no_common_rail(*peer(m.peer), *sc.src, g->dsts[s.member], "scatter"));
        }
    }
    RailBatch b(rails.size());
    auto deadline = deadline_after(config.op_timeout);
    auto* src_base = static_cast<uint8_t*>(sc.src->data());
    for (const auto& s : sc.slices) {
        const GroupMember& m = g->members[s.member];
        const RailRoute use = route_towards(*m.p, *sc.src, g->dsts[s.member], m.near);
        rails.split(s.length, true, use.local, [&](int rail, uint64_t off, uint64_t n) {
            const int peer_rail = use.peer_rail(rail);
            auto* op = new FabricOp();
            op->type = FabricOp::kWrite;
            op->peer = m.peer;
            op->dest = m.p->addr(rail, peer_rail);
            op->local = src_base + s.src_offset + off;
            op->len = n;
            op->desc = sc.src->local_desc(rail);
            op->raddr = m.dst_wire_base + s.dst_offset + off;
            op->rkey = m.dst_keys[peer_rail];
            op->has_imm = sc.imm.has_value();
            op->imm = sc.imm.value_or(0);
            op->deadline = deadline;
            op->parent = state.get();
            state->rail_mask |= uint64_t{1} << rail;
            b.add(rail, op);
        });
    }
    return submit(b, std::move(state), sc.imm.has_value());
}

OpHandle EngineImpl::signal(PeerId id, uint32_t imm_value, OpCallback done) {
    auto state = make_op_state(std::move(done));
    const Peer* p = peer(id);
    if (!p) FERRY_FAIL_OP(state, no_peer(id, "signal"));
    RailBatch b(rails.size());
    int rail = rails.next_rail();
    auto* op = new FabricOp();
    op->type = FabricOp::kWrite;
    op->peer = id;
    op->dest = p->addr(rail, p->matching_rail(rail));
    op->local = rails[rail].signal_base();
    op->len = 0;
    op->raddr = p->address.signal.wire_address(0);
    op->rkey = p->signal_key(p->matching_rail(rail));
    op->has_imm = true;
    op->imm = imm_value;
    op->deadline = deadline_after(config.op_timeout);
    op->parent = state.get();
    state->rail_mask |= uint64_t{1} << rail;
    b.add(rail, op);
    return submit(b, std::move(state), true);
}

Status EngineImpl::barrier(GroupId group, uint32_t imm_value, Duration timeout) {
    const Group* g = peers_.group(group);
    if (!g) return not_found(fmt::format("barrier: no group {}", group));
    auto deadline = deadline_after(timeout);
    // One operation, one hand-off: a signal per member from the group's prepared rows.
    auto state = make_op_state(OpCallback{});
    RailBatch b(rails.size());
    auto op_deadline = deadline_after(config.op_timeout);
    for (size_t i = 0; i < g->members.size(); ++i) {
        const GroupMember& m = g->members[i];
        int rail = rails.next_rail();
        auto* op = new FabricOp();
        op->type = FabricOp::kWrite;
        op->peer = m.peer;
        const int peer_rail = m.p->matching_rail(rail);
        op->dest = m.p->addr(rail, peer_rail);
        op->local = rails[rail].signal_base();
        op->len = 0;
        op->raddr = m.signal_wire;
        op->rkey = m.p->signal_key(peer_rail);
        op->has_imm = true;
        op->imm = imm_value;
        op->deadline = op_deadline;
        op->parent = state.get();
        state->rail_mask |= uint64_t{1} << rail;
        b.add(rail, op);
    }
    OpHandle sent = g->members.empty() ? OpHandle() : submit(b, std::move(state), true);
    Status arrived = imm.wait(imm_value, g->members.size(), timeout);
    if (sent.valid()) {
        Status s = sent.wait(std::max<Duration>(deadline - Clock::now(), Duration::zero()));
        if (!s.ok()) return s.with_context("barrier");
    }
    return arrived.with_context(fmt::format("barrier over {} peers", g->members.size()));
}

OpHandle EngineImpl::send_message(PeerId id, std::span<const uint8_t> payload, OpCallback done) {
    auto state = make_op_state(std::move(done));
    const Peer* p = peer(id);
    if (!p) FERRY_FAIL_OP(state, no_peer(id, "send_message"));
    FERRY_FAIL_OP(state, control_.check_size(payload.size()));
    RailBatch b(rails.size());
    FabricOp* op = control_.make_send(address.engine_id, id, p->addr(0, 0), payload,
                                      deadline_after(config.op_timeout));
    op->parent = state.get();
    state->rail_mask |= 1;
    b.add(0, op);
    return submit(b, std::move(state), false);
}

}  // namespace ferry::detail
