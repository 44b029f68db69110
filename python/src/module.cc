// ferry._ferry: the TransferEngine for Python. A thin layer over the public C++ API
// (include/ferry/fabric/engine.h): argument checking that needs Python objects happens here
// or in python/ferry/__init__.py, everything else is ferry's own. Rules:
// - the GIL is released around every call into the engine that can block or wait;
// - nothing runs Python code on ferry's threads: completions are polled (Op.done, Op.wait),
//   and the one callback used (on_imm, for ImmExpectation) only sets C++ state;
// - every Status becomes a ferry.Error subclass (errors.h), never a crash.
#include <fmt/format.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "convert.h"
#include "errors.h"
#include "ferry/common/spin.h"
#include "ferry/fabric/engine.h"
#include "ferry/fabric/gpu_memory.h"
#include "ferry/fabric/types.h"
#include "fork.h"
#include "kv.h"
#include "log_sink.h"
#include "memory.h"
#include "moe.h"

namespace py = pybind11;

namespace ferry::python {
namespace {

// A wait that spins longer than this is a mistake (a second of a core per wait).
constexpr double kMaxWaitSpinUs = 1e6;

using Pages = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;
using Runs = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

// A peer's region, parsed once from its descriptor bytes.
// "cpu" for host memory (device -1), else "cuda:N".
std::string device_name(int device) {
    return device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device);
}

struct RemoteRegion {
    MemoryDescriptor desc;
    std::vector<uint8_t> blob;

    static std::shared_ptr<RemoteRegion> from_bytes(py::handle b) {
        auto r = std::make_shared<RemoteRegion>();
        r->blob = bytes_arg(b, "descriptor");
        auto d = MemoryDescriptor::deserialize(r->blob);
        if (!d.ok()) {
            check(d.status().with_context(
                "bad region descriptor (" + std::to_string(r->blob.size()) +
                " bytes; pass Region.descriptor of the peer's region, unchanged)"));
        }
        r->desc = std::move(d).value();
        return r;
    }
};

// A registered local region. Holds what keeps the memory valid: the buffer (BufferHold) or
// the Python owner of a tensor / pointer, in a Held that every call posting on the region
// shares until it has posted, so close() on another thread frees nothing under it.
struct Region {
    struct Held {
        std::unique_ptr<MemoryRegion> mr;
        BufferHold buffer;
        py::object owner;

        Held() = default;
        Held(const Held&) = delete;
        Held& operator=(const Held&) = delete;
        MadeIn made;

        ~Held() {
            if (made.inherited()) abandon(std::move(mr));  // a fork child: the parent's (fork.h)
            mr.reset();  // waits (up to op_timeout) for operations libfabric still holds on it
            py::gil_scoped_acquire gil;
            buffer.release();
            owner = py::object();
        }
    };
    std::shared_ptr<Held> held = std::make_shared<Held>();
    bool read_only = false;

    const MemoryRegion& get() const { return *hold()->mr; }
    std::shared_ptr<Held> hold() const {
        if (!held || !held->mr)
            throw StatusError(invalid_argument("region is closed (Region.close() was called)"));
        return held;
    }
    void close() {
        std::shared_ptr<Held> h = std::move(held);
        py::gil_scoped_release nogil;
        h.reset();  // the last share deregisters, then lets the memory go
    }
};

// What a submitted operation uses: the local region's registration and the Python objects of
// both sides. Kept until the operation completed, whether or not its Op is.
struct OpUses {
    OpHandle handle;
    std::shared_ptr<Region::Held> region;  // a share: Region.close() deregisters nothing in use
    py::object src;
    py::object dst;
};

// Operations whose Op Python dropped before they completed. A write whose Op, region and array
// were dropped at once deregistered the region and freed the array while the write was still
// queued: 93 of 200 16 MiB writes over shm landed wrong bytes or none, with one log line. Now
// the engine keeps what they use and lets go of it once they are done (at the next operation
// submitted, or at close()). Touched with the GIL held only.
struct Orphans {
    std::vector<OpUses> ops;
    MadeIn made;

    Orphans() = default;
    Orphans(const Orphans&) = delete;
    Orphans& operator=(const Orphans&) = delete;
    // With the GIL held (the engine's or the last Op's destruction). An operation ends within
    // its op_timeout, so the wait is bounded; it is there only for an engine dropped with
    // operations still running that nobody kept.
    ~Orphans() {
        if (made.inherited()) abandon(std::move(ops));  // the parent's (fork.h)
        if (ops.empty()) return;
        {
            py::gil_scoped_release nogil;
            for (const OpUses& u : ops) (void)u.handle.wait(std::chrono::minutes(10));
        }
        release(true);
    }

    // Lets go of what completed operations used: Python objects with the GIL, then the
    // registrations without it (the last share of one deregisters, which waits on a worker).
    void release(bool all) {
        if (ops.empty()) return;
        std::vector<OpUses> done;
        auto still = std::partition(ops.begin(), ops.end(),
                                    [&](const OpUses& u) { return !all && !u.handle.done(); });
        std::move(still, ops.end(), std::back_inserter(done));
        ops.erase(still, ops.end());
        for (OpUses& u : done) u.src = u.dst = py::object();
        py::gil_scoped_release nogil;
        done.clear();
    }
};

// The handle of one submitted operation; keeps what it uses alive until it completed.
struct Op {
    OpUses uses;
    std::shared_ptr<Orphans> orphans;  // the engine's: where an Op dropped early leaves `uses`
    Duration spin{};                   // the engine's wait_spin_us
    MadeIn made;

    Op() = default;
    Op(Op&&) = default;
    Op& operator=(Op&&) = default;
    Op(const Op&) = delete;
    Op& operator=(const Op&) = delete;
    ~Op() {
        if (made.inherited()) abandon(std::move(uses));  // the parent's (fork.h)
        if (orphans && uses.handle.valid() && !uses.handle.done())
            orphans->ops.push_back(std::move(uses));
    }
    const OpHandle& handle() const { return uses.handle; }

    bool done() const { return handle().done(); }  // a flag read: keeps the GIL
    void wait(py::handle timeout) const {
        Duration t = seconds_arg(timeout, "timeout");
        Duration first_spin = spin;
        check(wait_interruptible(
            t,
            [&](Duration slice) -> std::optional<Status> {
                Status s = handle().wait(slice, std::exchange(first_spin, Duration::zero()));
                // A timeout of the op itself (op_timeout) comes with the op done.
                if (s.code() == StatusCode::kTimeout && !handle().done()) return std::nullopt;
                return s;
            },
            [&] {
                return timeout_error("operation still running after " +
                                     std::to_string(static_cast<int64_t>(to_ms(t))) + " ms");
            }));
    }
};

// Target-side expectation of `count` writes carrying an immediate, armed with on_imm: the
// callback (on a ferry worker) only records the status and wakes waiters.
struct ImmExpectation {
    struct State {
        std::mutex mu;
        std::condition_variable cv;
        std::optional<Status> result;
        std::atomic<bool> done{false};  // set under mu with result; read without it
    };
    std::shared_ptr<State> state = std::make_shared<State>();
    uint32_t imm = 0;
    uint64_t count = 0;
    Duration spin{};  // the engine's wait_spin_us

    bool done() const { return state->done.load(std::memory_order_acquire); }
    void wait(py::handle timeout) const {
        Duration t = seconds_arg(timeout, "timeout");
        Duration first_spin = std::min(spin, t);
        check(wait_interruptible(
            t,
            [&](Duration slice) -> std::optional<Status> {
                spin_until([&] { return done(); }, std::exchange(first_spin, Duration::zero()));
                std::unique_lock<std::mutex> l(state->mu);
                if (!wait_for_or_test(state->cv, l, slice,
                                      [&] { return state->result.has_value(); }))
                    return std::nullopt;
                return *state->result;
            },
            [&] {
                return timeout_error("waiting for " + std::to_string(count) +
                                     " writes with immediate " + std::to_string(imm) +
                                     ": not all arrived yet (the expectation stays armed)");
            }));
    }
};

// Two references to one TransferEngine: users_ is held by this object and by the KV
// connectors and all-to-alls built on it, and shuts the engine down when the last of them
// lets go; core_ keeps the object itself alive, and every call that releases the GIL holds a
// copy of it. So close() on one thread while another waits in wait_imm (or connects,
// registers, posts) ends that wait with Cancelled instead of freeing the engine under it.
// The library's errors name EngineConfig's rail settings; here they are the arguments of
// TransferEngine(...).
Status in_argument_names(const Status& s) {
    static constexpr std::pair<std::string_view, std::string_view> kArgs[] = {
        {"EngineConfig::rails", "rail_selection"},
        {"EngineConfig::topology_xml", "topology_xml"},
        {"EngineConfig::rail_nics", "rail_nics"},
    };
    std::string m = s.message();
    for (auto [field, arg] : kArgs) {
        for (size_t at = m.find(field); at != std::string::npos; at = m.find(field, at)) {
            m.replace(at, field.size(), arg);
            at += arg.size();
        }
    }
    return Status(s.code(), std::move(m));
}

class Engine {
  public:
    Engine(const EngineConfig& config, Duration wait_spin) : wait_spin_(wait_spin) {
        Result<std::unique_ptr<TransferEngine>> r = internal_error("unset");
        {
            py::gil_scoped_release nogil;
            r = TransferEngine::create(config);
        }
        if (!r.ok()) r = in_argument_names(r.status());
        core_ = std::shared_ptr<TransferEngine>(take(std::move(r)));
        std::shared_ptr<TransferEngine> core = core_;
        users_ = std::shared_ptr<TransferEngine>(core.get(),
                                                 [core](TransferEngine* e) { e->shutdown(); });
    }

    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;
    ~Engine() {
        if (made_.inherited()) {  // a fork child: the engine and its threads are the parent's
            abandon(std::move(users_));
            abandon(std::move(core_));
        }
    }

    TransferEngine& get() const {
        if (made_.inherited())
            throw StatusError(unavailable(
                "this TransferEngine was made by the parent process before fork(): its threads "
                "stayed there; make a new TransferEngine in this process (or start it with the "
                "'spawn' or 'forkserver' start method)"));
        if (!users_) throw StatusError(cancelled("engine is closed (TransferEngine.close())"));
        return *users_;
    }

    // For a call that releases the GIL: the engine stays a valid object until the copy goes.
    std::shared_ptr<TransferEngine> hold() const {
        get();
        return core_;
    }

    // A KV connector or an all-to-all shares the engine (it must not outlive it): the engine's
    // workers are joined when the last of this object and those lets go.
    std::shared_ptr<TransferEngine> share() const {
        get();
        return users_;
    }

    void close() {
        if (made_.inherited()) return;  // nothing of it runs here; the destructor abandons it
        std::shared_ptr<TransferEngine> users = std::move(users_);
        std::shared_ptr<TransferEngine> core = std::move(core_);
        {
            py::gil_scoped_release nogil;
            users.reset();  // the last user shuts down: joins the workers, ends waits elsewhere
            core.reset();   // nothing there waits for the GIL
        }
        // What completed dropped Ops used; the rest (a KV connector may keep the engine
        // running) goes when they are done: at the engine's destruction at the latest.
        orphans_->release(false);
    }

    py::bytes address() const { return to_bytes(get().address().serialize()); }

    PeerId connect(const py::bytes& address) {
        auto span = bytes_span(address);
        auto a = EngineAddress::deserialize(span);
        if (!a.ok()) {
            check(a.status().with_context(
                "bad engine address (" + std::to_string(span.size()) +
                " bytes; pass TransferEngine.address of the peer, unchanged)"));
        }
        Result<PeerId> p = internal_error("unset");
        std::shared_ptr<TransferEngine> e = hold();
        {
            py::gil_scoped_release nogil;
            p = e->connect(*a);
        }
        return take(std::move(p));
    }

    std::shared_ptr<Region> register_buffer(py::handle obj, bool read_only) {
        auto region = std::make_shared<Region>();
        region->held->buffer = BufferHold::acquire(obj, !read_only);
        region->read_only = region->held->buffer.read_only();
        region->held->owner = py::reinterpret_borrow<py::object>(obj);
        if (region->held->buffer.size() == 0)
            throw StatusError(invalid_argument("cannot register 0 bytes"));
        return finish_register(region, region->held->buffer.data(), region->held->buffer.size(),
                               MemoryKind::kHost, -1);
    }

    std::shared_ptr<Region> register_ptr(uint64_t ptr, uint64_t nbytes, int device,
                                         py::object owner, bool read_only) {
        if (nbytes == 0) throw StatusError(invalid_argument("cannot register 0 bytes"));
        if (ptr == 0) throw StatusError(invalid_argument("cannot register a null pointer"));
        check_user_range(ptr, nbytes);
        auto region = std::make_shared<Region>();
        region->held->owner = std::move(owner);
        region->read_only = read_only;
        return finish_register(region, reinterpret_cast<void*>(ptr), nbytes,
                               device >= 0 ? MemoryKind::kCuda : MemoryKind::kHost, device);
    }

    // src_obj and dst_obj are the Python objects of src and dst, which the Op keeps alive.
    Op write(PeerId peer, const Region& src, py::handle src_obj, const RemoteRegion& dst,
             py::handle dst_obj, uint64_t src_offset, uint64_t dst_offset, uint64_t nbytes,
             std::optional<uint32_t> imm) {
        auto keep = src.hold();
        WriteOp w{peer, keep->mr.get(), src_offset, &dst.desc, dst_offset, nbytes, imm};
        return submit(std::move(keep), py::reinterpret_borrow<py::object>(src_obj),
                      py::reinterpret_borrow<py::object>(dst_obj),
                      [&](TransferEngine& e) { return e.write(w); });
    }

    Op paged_write(PeerId peer, std::shared_ptr<Region> src, const Pages& src_pages,
                   uint64_t src_stride, std::shared_ptr<RemoteRegion> dst, const Pages& dst_pages,
                   uint64_t dst_stride, uint64_t page_bytes, uint64_t src_offset,
                   uint64_t dst_offset, std::optional<uint32_t> imm) {
        auto keep = src->hold();
        PagedWriteOp w;
        w.peer = peer;
        w.src = keep->mr.get();
        w.dst = &dst->desc;
        w.page_size = page_bytes;
        w.src_stride = src_stride;
        w.dst_stride = dst_stride;
        w.src_offset = src_offset;
        w.dst_offset = dst_offset;
        w.src_pages = {src_pages.data(), static_cast<size_t>(src_pages.size())};
        w.dst_pages = {dst_pages.data(), static_cast<size_t>(dst_pages.size())};
        w.imm = imm;
        return submit(std::move(keep), py::cast(src), py::cast(dst),
                      [&](TransferEngine& e) { return e.paged_write(w); });
    }

    Op write_runs(PeerId peer, std::shared_ptr<Region> src, std::shared_ptr<RemoteRegion> dst,
                  const Runs& runs, std::optional<uint32_t> imm) {
        std::vector<WriteRun> rs = to_runs(runs);
        auto keep = src->hold();
        WriteRunsOp w{peer, keep->mr.get(), &dst->desc, rs, imm};
        return submit(std::move(keep), py::cast(src), py::cast(dst),
                      [&](TransferEngine& e) { return e.write_runs(w); });
    }

    Op read(PeerId peer, std::shared_ptr<Region> dst, uint64_t dst_offset,
            std::shared_ptr<RemoteRegion> src, uint64_t src_offset, uint64_t nbytes) {
        refuse_read_only(*dst, "read");
        auto keep = dst->hold();
        ReadOp r{peer, keep->mr.get(), dst_offset, &src->desc, src_offset, nbytes};
        return submit(std::move(keep), py::cast(src), py::cast(dst),
                      [&](TransferEngine& e) { return e.read(r); });
    }

    Op read_runs(PeerId peer, std::shared_ptr<Region> dst, std::shared_ptr<RemoteRegion> src,
                 const Runs& runs) {
        refuse_read_only(*dst, "read_runs");
        std::vector<WriteRun> rs = to_runs(runs);
        auto keep = dst->hold();
        ReadRunsOp r{peer, keep->mr.get(), &src->desc, rs};
        return submit(std::move(keep), py::cast(src), py::cast(dst),
                      [&](TransferEngine& e) { return e.read_runs(r); });
    }

    Op signal(PeerId peer, uint32_t imm) {
        return submit(nullptr, py::none(), py::none(),
                      [&](TransferEngine& e) { return e.signal(peer, imm); });
    }

    void wait_imm(uint32_t imm, uint64_t count, py::handle timeout) {
        Duration t = seconds_arg(timeout, "timeout");
        std::shared_ptr<TransferEngine> e = hold();
        // Each slice is a wait of its own: it consumes `count` arrivals or none, so slicing
        // changes nothing but where a signal can be raised.
        Duration spin = wait_spin_;
        Status last = timeout_error("waiting for writes with an immediate");  // set by a slice
        check(wait_interruptible(
            t,
            [&](Duration slice) -> std::optional<Status> {
                Status s = e->wait_imm(imm, count, slice, std::exchange(spin, Duration::zero()));
                if (s.code() != StatusCode::kTimeout) return s;
                last = s;
                return std::nullopt;
            },
            [&] { return last; }));
    }

    ImmExpectation expect_imm(uint32_t imm, uint64_t count, py::handle timeout) {
        Duration t = seconds_arg(timeout, "timeout");
        ImmExpectation x;
        x.imm = imm;
        x.count = count;
        x.spin = wait_spin_;
        std::shared_ptr<TransferEngine> e = hold();
        auto state = x.state;
        py::gil_scoped_release nogil;
        e->on_imm(imm, count, t, [state](const Status& s) {
            {
                std::lock_guard<std::mutex> l(state->mu);
                state->result = s;
                state->done.store(true, std::memory_order_release);
            }
            state->cv.notify_all();
        });
        return x;
    }

    // Target side of an acknowledged transfer (ferry.bench_peers' FerryAdapter): each write
    // carrying count_imm tells that the initiator's running total of writes carrying data_imm
    // is in one of the `slots` 8-byte slots of `box`; once that many have arrived here, the
    // answer is a signal with ack_imm to `peer`. All on the engine's worker (on_imm callbacks),
    // so the answer waits for no Python thread. Answers go in the order of the count writes'
    // arrival, each behind the data waits armed before it (ImmTable's waiters are served first
    // come, first served), and the total read is the highest of every slot, so that a count
    // write landing late cannot lower it. Runs until the engine closes; `box` must stay open
    // that long.
    void answer_counts(uint32_t count_imm, uint32_t data_imm, uint32_t ack_imm, PeerId peer,
                       const Region& box, uint64_t slots) {
        const MemoryRegion& mr = box.get();
        if (slots == 0 || slots > mr.size() / 8)
            throw StatusError(invalid_argument(
                fmt::format("answer_counts: {} slots of 8 bytes do not fit the {}-byte box", slots,
                            mr.size())));
        struct Answerer : std::enable_shared_from_this<Answerer> {
            std::weak_ptr<TransferEngine> engine;
            const volatile uint64_t* totals;
            uint64_t slots;
            uint32_t count_imm, data_imm, ack_imm;
            PeerId peer;
            uint64_t counted = 0;  // touched by one callback at a time (one count waiter armed)

            static void arm(const std::shared_ptr<Answerer>& a) {
                std::shared_ptr<TransferEngine> e = a->engine.lock();
                if (!e) return;
                e->on_imm(a->count_imm, 1, std::chrono::hours(24 * 365), [a](const Status& s) {
                    if (s.ok()) a->on_count();
                });
            }
            void on_count() {
                std::shared_ptr<TransferEngine> e = engine.lock();
                if (!e) return;
                uint64_t total = 0;
                for (uint64_t i = 0; i < slots; ++i)
                    total = std::max<uint64_t>(total, uint64_t{totals[i]});
                const uint64_t need = total > counted ? total - counted : 0;
                counted = std::max(counted, total);
                std::weak_ptr<TransferEngine> w = engine;
                PeerId to = peer;
                uint32_t ack = ack_imm;
                // need 0 still queues behind the data waits armed before it.
                e->on_imm(data_imm, need, std::chrono::hours(24 * 365),
                          [w, to, ack](const Status& s) {
                              if (!s.ok()) return;
                              if (auto e2 = w.lock()) e2->signal(to, ack);
                          });
                arm(shared_from_this());
            }
        };
        auto a = std::make_shared<Answerer>();
        a->engine = hold();
        a->totals = static_cast<const volatile uint64_t*>(mr.data());
        a->slots = slots;
        a->count_imm = count_imm;
        a->data_imm = data_imm;
        a->ack_imm = ack_imm;
        a->peer = peer;
        py::gil_scoped_release nogil;
        Answerer::arm(a);
    }

    uint64_t imm_available(uint32_t imm) const { return get().imm_available(imm); }

    double wait_spin_us() const {
        get();  // closed: raises, as every other property does
        return to_us(wait_spin_);
    }

    py::dict stats() const { return stats_dict(get().stats()); }

    py::list rail_stats() const {
        py::list out;
        for (const EngineStats& s : get().rail_stats()) out.append(stats_dict(s));
        return out;
    }

  private:
    static py::dict stats_dict(const EngineStats& s) {
        py::dict d;
        d["ops_posted"] = s.ops_posted;
        d["bytes_posted"] = s.bytes_posted;
        d["eagain"] = s.eagain;
        d["op_errors"] = s.op_errors;
        d["op_timeouts"] = s.op_timeouts;
        d["imm_arrivals"] = s.imm_arrivals;
        d["messages_received"] = s.messages_received;
        d["messages_dropped"] = s.messages_dropped;
        d["regions_registered"] = s.regions_registered;
        d["rail_fallbacks"] = s.rail_fallbacks;
        d["cma_bytes"] = s.cma_bytes;
        return d;
    }

    std::shared_ptr<Region> finish_register(std::shared_ptr<Region> region, void* ptr,
                                            uint64_t nbytes, MemoryKind kind, int device) {
        std::shared_ptr<TransferEngine> e = hold();
        Result<std::unique_ptr<MemoryRegion>> r = internal_error("unset");
        {
            py::gil_scoped_release nogil;
            r = e->register_memory(ptr, nbytes, kind, device);
        }
        region->held->mr = take(std::move(r));
        return region;
    }

    // A raw (ptr, nbytes) is taken on the caller's word: nbytes 2^63 was registered, and every
    // offset a peer named below it passed the range checks. Memory a process can use ends
    // below 2^56 (x86-64 user space with 5-level paging; arm64's ends at 2^52 at most), GPU
    // memory in CUDA's unified address space too.
    static void check_user_range(uint64_t ptr, uint64_t nbytes) {
        constexpr uint64_t kUserEnd = uint64_t{1} << 56;
        auto hex = [](uint64_t v) { return fmt::format("{:#x}", v); };
        if (nbytes > ~uint64_t{0} - ptr)
            throw StatusError(invalid_argument(
                fmt::format("cannot register {} bytes at {}: the range wraps past the end of the "
                            "address space",
                            nbytes, hex(ptr))));
        if (ptr + nbytes > kUserEnd)
            throw StatusError(invalid_argument(fmt::format(
                "cannot register {} bytes at {}: the range ends at {}, past the end of any "
                "process's address space (2^56); pass the memory's real size",
                nbytes, hex(ptr), hex(ptr + nbytes))));
    }

    static void refuse_read_only(const Region& r, const char* what) {
        if (r.read_only) {
            throw StatusError(invalid_argument(std::string(what) +
                                               " into a read-only region: register a writable "
                                               "buffer to read into it"));
        }
    }

    // `runs` is the n x 3 array ferry.TransferEngine made (and checked) from the caller's runs.
    static std::vector<WriteRun> to_runs(const Runs& runs) {
        std::vector<WriteRun> rs(static_cast<size_t>(runs.shape(0)));
        const uint64_t* p = runs.data();
        for (size_t i = 0; i < rs.size(); ++i) rs[i] = {p[3 * i], p[3 * i + 1], p[3 * i + 2]};
        return rs;
    }

    template <typename F>
    Op submit(std::shared_ptr<Region::Held> region, py::object src, py::object dst, F&& post) {
        std::shared_ptr<TransferEngine> e = hold();
        orphans_->release(false);  // a check of an empty vector unless Ops were dropped early
        Op op;
        {
            py::gil_scoped_release nogil;
            op.uses.handle = post(*e);
        }
        op.uses.region = std::move(region);
        op.uses.src = std::move(src);
        op.uses.dst = std::move(dst);
        op.orphans = orphans_;
        op.spin = wait_spin_;
        return op;
    }

    std::shared_ptr<TransferEngine> users_;
    std::shared_ptr<TransferEngine> core_;
    Duration wait_spin_{};  // how long waits poll before they sleep
    std::shared_ptr<Orphans> orphans_ = std::make_shared<Orphans>();
    MadeIn made_;
};

// Engine.write without pybind11's dispatch: the hot path of small writes. pybind11's argument
// conversions (seven of them, three class lookups by type name) and its call machinery cost
// about 2 us per call on the 2-core dev machine, where this function parses the same
// arguments in 0.3 us (a standalone module timed both, 2026-12-02). It takes exact types only:
// ints, a Region, a RemoteRegion and None or an int immediate; anything else raises TypeError,
// on which TransferEngine.write (python/ferry/__init__.py) checks each argument and names the
// bad one.
struct FastWrite {
    static inline const py::detail::type_info* engine_type = nullptr;
    static inline const py::detail::type_info* region_type = nullptr;
    static inline const py::detail::type_info* remote_type = nullptr;

    static void init() {
        engine_type = py::detail::get_type_info(typeid(Engine));
        region_type = py::detail::get_type_info(typeid(Region));
        remote_type = py::detail::get_type_info(typeid(RemoteRegion));
    }

    static bool exact_uint(PyObject* o, uint64_t limit, uint64_t* v) {
        if (!PyLong_Check(o)) return false;  // int and its subclasses (ferry.Peer)
        unsigned long long x = PyLong_AsUnsignedLongLong(o);
        if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
            PyErr_Clear();  // negative or too large: the wrapper names it
            return false;
        }
        *v = x;
        return x <= limit;
    }

    template <typename T>
    static T* exact_instance(PyObject* o, const py::detail::type_info* t) {
        if (Py_TYPE(o) != t->type) return nullptr;
        py::detail::type_caster_generic caster(t);
        return caster.load(o, false) ? static_cast<T*>(caster.value) : nullptr;
    }

    static PyObject* call(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
        constexpr uint64_t kU32 = 0xFFFFFFFFu, kU64 = ~uint64_t{0};
        uint64_t peer = 0, src_offset = 0, dst_offset = 0, nbytes = 0, imm = 0;
        Engine* engine = exact_instance<Engine>(self, engine_type);
        Region* src = nargs == 7 ? exact_instance<Region>(args[1], region_type) : nullptr;
        RemoteRegion* dst =
            nargs == 7 ? exact_instance<RemoteRegion>(args[3], remote_type) : nullptr;
        if (nargs != 7 || !engine || !src || !dst || !exact_uint(args[0], kU32, &peer) ||
            !exact_uint(args[2], kU64, &src_offset) || !exact_uint(args[4], kU64, &dst_offset) ||
            !exact_uint(args[5], kU64, &nbytes) ||
            (args[6] != Py_None && !exact_uint(args[6], kU32, &imm))) {
            PyErr_SetString(PyExc_TypeError,
                            "Engine.write(peer, src, src_offset, dst, dst_offset, nbytes, imm) "
                            "takes ints, a Region, a RemoteRegion and None or an int");
            return nullptr;
        }
        try {
            std::optional<uint32_t> imm_value;
            if (args[6] != Py_None) imm_value = static_cast<uint32_t>(imm);
            Op op = engine->write(static_cast<PeerId>(peer), *src, args[1], *dst, args[3],
                                  src_offset, dst_offset, nbytes, imm_value);
            return py::cast(std::move(op)).release().ptr();
        } catch (const StatusError& e) {
            set_python_error(e.status(), e.is_wrong_type());
        } catch (py::error_already_set& e) {
            e.restore();
        } catch (const std::exception& e) {
            PyErr_SetString(PyExc_RuntimeError, e.what());
        }
        return nullptr;
    }

    // Installs call() as the method Engine.write.
    static void install(py::handle engine_class) {
        static PyMethodDef def = {
            "write", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&call)),
            METH_FASTCALL,
            "write(peer, src, src_offset, dst, dst_offset, nbytes, imm) -> Op: exact types "
            "only (TypeError otherwise); use TransferEngine.write"};
        init();
        PyObject* m = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(engine_class.ptr()), &def);
        if (m == nullptr) throw py::error_already_set();
        engine_class.attr("write") = py::reinterpret_steal<py::object>(m);
    }
};

// The arguments ferry.TransferEngine passes on as the caller gave them (the numbers of seconds
// and microseconds) are checked here; the others it converted and checked itself.
EngineConfig make_config(const std::string& provider, bool same_host, const std::string& node,
                         int rails, py::handle op_timeout, bool busy_poll,
                         uint64_t stripe_threshold, uint64_t max_write_size,
                         const std::string& gpu_copy, bool fabric_gpu_memory, bool gpu_ipc,
                         py::handle idle_spin_us, const std::string& rail_selection,
                         const std::string& topology_xml, const std::string& rail_nics,
                         bool cma_writes, uint64_t rma_iovs) {
    EngineConfig c;
    c.provider = provider;
    c.peers_on_same_host = same_host;
    c.node = node;
    c.num_rails = rails;
    c.op_timeout = seconds_arg(op_timeout, "op_timeout");
    if (c.op_timeout <= Duration::zero()) {  // the library's message says "0 ms", rounded
        throw StatusError(
            invalid_argument(fmt::format("op_timeout must be a number of seconds > 0, got {}",
                                         std::string(py::str(op_timeout)))));
    }
    c.busy_poll = busy_poll;
    c.stripe_threshold = stripe_threshold;
    c.max_write_size = max_write_size;
    c.gpu_copy = gpu_copy;
    c.fabric_gpu_memory = fabric_gpu_memory;
    c.gpu_ipc = gpu_ipc;
    c.idle_spin = micros_arg(idle_spin_us, "idle_spin_us", 1e9);
    c.rails = rail_selection;
    c.topology_xml = topology_xml;
    c.rail_nics = rail_nics;
    c.cma_writes = cma_writes;
    c.rma_iovs = rma_iovs;
    return c;
}

}  // namespace
}  // namespace ferry::python

PYBIND11_MODULE(_ferry, m) {
    using namespace ferry;          // NOLINT(google-build-using-namespace)
    using namespace ferry::python;  // NOLINT(google-build-using-namespace)
    m.doc() = "ferry's C++ TransferEngine; use the `ferry` package, not this module directly.";
    register_errors(m);
    count_forks();

    py::class_<RemoteRegion, std::shared_ptr<RemoteRegion>> remote_region(
        m, "RemoteRegion",
        "A peer's registered region, parsed from its descriptor bytes. Picklable.");
    obtained_from(remote_region, "ferry.RemoteRegion",
                  "use RemoteRegion.from_bytes(descriptor) with a peer's Region.descriptor");
    remote_region
        .def_static(
            "from_bytes", &RemoteRegion::from_bytes, py::arg("descriptor"),
            "Parses ``Region.descriptor`` bytes of a peer; raises ProtocolError when they are\n"
            "truncated, corrupted or from an incompatible build, InvalidArgument when they are\n"
            "not bytes.")
        .def(
            "to_bytes", [](const RemoteRegion& r) { return to_bytes(r.blob); },
            "The descriptor bytes this was parsed from.")
        .def_property_readonly(
            "engine_id", [](const RemoteRegion& r) { return r.desc.engine_id; },
            "Id of the engine that registered the region.")
        .def_property_readonly(
            "length", [](const RemoteRegion& r) { return r.desc.length; },
            "Size of the region in bytes.")
        .def_property_readonly(
            "device", [](const RemoteRegion& r) { return r.desc.device; },
            "CUDA device of GPU memory, -1 for host memory.")
        .def_property_readonly(
            "is_gpu", [](const RemoteRegion& r) { return r.desc.kind == MemoryKind::kCuda; },
            "True for CUDA memory.")
        .def("__repr__",
             [](const RemoteRegion& r) {
                 return fmt::format("ferry.RemoteRegion(engine_id={:#x}, length={}, device={})",
                                    r.desc.engine_id, r.desc.length, device_name(r.desc.device));
             })
        .def(py::pickle([](const RemoteRegion& r) { return py::make_tuple(to_bytes(r.blob)); },
                        [](const py::tuple& t) {
                            if (t.size() != 1) {
                                throw StatusError(protocol_error("bad pickled RemoteRegion"));
                            }
                            return RemoteRegion::from_bytes(t[0]);
                        }));

    py::class_<Region, std::shared_ptr<Region>> region(
        m, "Region",
        "Local memory registered with an engine; keeps the registered object alive and\n"
        "deregisters when garbage-collected or closed.");
    obtained_from(region, "ferry.Region",
                  "TransferEngine.register(buffer) registers a buffer and returns its Region");
    region
        .def_property_readonly(
            "descriptor",
            [](const Region& r) {
                if (r.read_only) {
                    throw StatusError(
                        invalid_argument("a read-only region has no descriptor: peers would "
                                         "write into it; register a writable buffer"));
                }
                return to_bytes(r.get().descriptor().serialize());
            },
            "What a peer needs to write into or read from this region (send it by any channel).\n"
            "Raises InvalidArgument for a read-only region.")
        .def_property_readonly(
            "nbytes", [](const Region& r) { return r.get().size(); }, "Size in bytes.")
        .def_property_readonly(
            "data_ptr", [](const Region& r) { return reinterpret_cast<uint64_t>(r.get().data()); },
            "Address of byte 0.")
        .def_property_readonly(
            "device", [](const Region& r) { return r.get().descriptor().device; },
            "CUDA device, or -1 for host memory.")
        .def_property_readonly(
            "read_only", [](const Region& r) { return r.read_only; },
            "Registered with read_only=True: usable only as a source.")
        .def_property_readonly(
            "owner", [](const Region& r) { return r.held ? r.held->owner : py::none(); },
            "The registered object (array, tensor, buffer), or None for a raw pointer.")
        .def_property_readonly(
            "closed", [](const Region& r) { return !r.held || !r.held->mr; }, "True after close().")
        .def("close", &Region::close,
             "Deregisters now and drops the reference to the object. Operations using the\n"
             "region must have completed.")
        .def("__repr__",
             [](const Region& r) {
                 if (!r.held || !r.held->mr) return std::string("ferry.Region(closed)");
                 return fmt::format("ferry.Region(nbytes={}, device={}, data_ptr={:#x}{})",
                                    r.get().size(), device_name(r.get().descriptor().device),
                                    reinterpret_cast<uint64_t>(r.get().data()),
                                    r.read_only ? ", read_only" : "");
             })
        .def("__enter__", [](py::object self) { return self; })
        .def(
            "__exit__", [](Region& r, const py::args&) { r.close(); },
            "Closes the region on leaving a ``with`` block.");

    py::class_<Op> op(m, "Op",
                      "Handle of one submitted operation. Keeps the regions it uses alive.");
    obtained_from(op, "ferry.Op",
                  "every transfer call of a TransferEngine (write, read, write_paged, signal, "
                  "...) returns the Op to wait on");
    op.def("done", &Op::done,
           "True once the operation completed, successfully or not (never blocks).")
        .def(
            "wait", &Op::wait, py::arg("timeout") = 30.0,
            "Waits up to ``timeout`` seconds, GIL released (polling for the engine's wait_spin_us\n"
            "before it sleeps). Returns when the operation succeeded; raises its error\n"
            "(OutOfRange, Unavailable, TimeoutError...) otherwise, or TimeoutError when\n"
            "``timeout`` passed first. Completion of a write means the source may be reused; the\n"
            "bytes are known to be at the target once it counted the immediate. ``timeout``: a\n"
            "number of seconds in [0, 1e9], else InvalidArgument.")
        .def_property_readonly(
            "imm_writes", [](const Op& o) { return o.handle().imm_writes(); },
            "Number of writes carrying the immediate that this operation put on the wire: the\n"
            "count the target waits for (wait_imm / expect_imm).")
        .def("__repr__", [](const Op& o) {
            return fmt::format("ferry.Op(done={}, imm_writes={})",
                               o.handle().done() ? "True" : "False", o.handle().imm_writes());
        });

    py::class_<ImmExpectation> imm_expectation(
        m, "ImmExpectation",
        "Target-side expectation of ``count`` writes carrying ``imm``, consumed when\n"
        "complete.");
    obtained_from(imm_expectation, "ferry.ImmExpectation",
                  "TransferEngine.expect_imm(imm, count) returns one");
    imm_expectation
        .def("done", &ImmExpectation::done,
             "True once the writes arrived (or the expectation's own timeout passed).")
        .def(
            "wait", &ImmExpectation::wait, py::arg("timeout") = 30.0,
            "Waits up to ``timeout`` seconds, GIL released (polling for the engine's wait_spin_us\n"
            "before it sleeps); raises TimeoutError if the writes are not all there (the\n"
            "expectation stays armed), or the expectation's error.")
        .def_readonly("imm", &ImmExpectation::imm, "The immediate value expected.")
        .def_readonly("count", &ImmExpectation::count, "How many writes carrying it are expected.");

    py::class_<Engine> engine_class(
        m, "Engine",
        "The C++ TransferEngine behind ferry.TransferEngine, which converts and checks the "
        "arguments.");
    engine_class
        .def(py::init([](const std::string& provider, bool same_host, const std::string& node,
                         int rails, py::handle op_timeout, bool busy_poll,
                         uint64_t stripe_threshold, uint64_t max_write_size,
                         const std::string& gpu_copy, bool fabric_gpu_memory, bool gpu_ipc,
                         py::handle idle_spin_us, py::handle wait_spin_us,
                         const std::string& rail_selection, const std::string& topology_xml,
                         const std::string& rail_nics, bool cma_writes, uint64_t rma_iovs) {
                 return std::make_unique<Engine>(
                     make_config(provider, same_host, node, rails, op_timeout, busy_poll,
                                 stripe_threshold, max_write_size, gpu_copy, fabric_gpu_memory,
                                 gpu_ipc, idle_spin_us, rail_selection, topology_xml, rail_nics,
                                 cma_writes, rma_iovs),
                     micros_arg(wait_spin_us, "wait_spin_us", kMaxWaitSpinUs, " or None (auto)"));
             }),
             py::arg("provider"), py::arg("same_host"), py::arg("node"), py::arg("rails"),
             py::arg("op_timeout"), py::arg("busy_poll"), py::arg("stripe_threshold"),
             py::arg("max_write_size"), py::arg("gpu_copy"), py::arg("fabric_gpu_memory"),
             py::arg("gpu_ipc"), py::arg("idle_spin_us"), py::arg("wait_spin_us"),
             py::arg("rail_selection"), py::arg("topology_xml"), py::arg("rail_nics"),
             py::arg("cma_writes"), py::arg("rma_iovs"))
        .def_property_readonly("wait_spin_us", &Engine::wait_spin_us)
        .def_property_readonly("address", &Engine::address)
        .def_property_readonly("engine_id", [](const Engine& e) { return e.get().engine_id(); })
        .def_property_readonly("provider", [](const Engine& e) { return e.get().provider(); })
        .def_property_readonly("num_rails", [](const Engine& e) { return e.get().num_rails(); })
        .def_property_readonly("inject_size", [](const Engine& e) { return e.get().inject_size(); })
        .def_property_readonly("rma_iovs", [](const Engine& e) { return e.get().rma_iovs(); })
        .def_property_readonly("health",
                               [](const Engine& e) {
                                   Status h = e.get().health();
                                   return h.ok() ? std::string() : h.message();
                               })
        // Tests: rail `rail`'s worker stays inside one call until the watchdog declares the rail
        // wedged (the engine's real response to a provider that never returns).
        .def(
            "_wedge_rail_for_test",
            [](const Engine& e, int rail, double limit_s) {
                TransferEngine& te = e.get();
                Status s;
                {
                    py::gil_scoped_release nogil;
                    s = detail::wedge_rail_for_test(te, rail,
                                                    std::chrono::duration_cast<Duration>(
                                                        std::chrono::duration<double>(limit_s)));
                }
                if (!s.ok()) throw StatusError(s);
            },
            py::arg("rail"), py::arg("limit_s"))
        .def_property_readonly("supports_gpu_memory",
                               [](const Engine& e) { return e.get().supports_gpu_memory(); })
        .def_property_readonly("gpu_memory_note",
                               [](const Engine& e) { return e.get().gpu_memory_note(); })
        .def("connect", &Engine::connect, py::arg("address"))
        .def("register_buffer", &Engine::register_buffer, py::arg("obj"), py::arg("read_only"))
        .def("register_ptr", &Engine::register_ptr, py::arg("ptr"), py::arg("nbytes"),
             py::arg("device"), py::arg("owner"), py::arg("read_only"))
        .def("paged_write", &Engine::paged_write)
        .def("write_runs", &Engine::write_runs)
        .def("read", &Engine::read)
        .def("read_runs", &Engine::read_runs)
        .def("signal", &Engine::signal)
        .def("wait_imm", &Engine::wait_imm)
        .def("expect_imm", &Engine::expect_imm)
        .def("answer_counts", &Engine::answer_counts)
        .def("imm_available", &Engine::imm_available)
        .def("stats", &Engine::stats)
        .def("rail_stats", &Engine::rail_stats)
        .def("close", &Engine::close);

    FastWrite::install(engine_class);

    register_moe(m, [](py::handle engine) { return engine.cast<Engine&>().share(); });
    register_kv(m, [](py::handle engine) { return engine.cast<Engine&>().share(); });
    register_log(m);

    m.def(
        "seconds",
        [](py::handle value, const std::string& name) {
            return std::chrono::duration<double>(seconds_arg(value, name.c_str())).count();
        },
        py::arg("value"), py::arg("name"),
        "`value` as a float of seconds, checked as every timeout of ferry's is (a number in\n"
        "[0, 1e9], else InvalidArgument naming `name`): for a timeout the package keeps before\n"
        "it reaches the extension (ferry.moe).");
    m.def(
        "gpu_device_count",
        [] {
            py::gil_scoped_release nogil;
            return gpu_device_count();
        },
        "CUDA devices visible to ferry (0 in builds without CUDA or without a GPU). Initialises\n"
        "CUDA in this process.");
}
