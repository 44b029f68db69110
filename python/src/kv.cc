// ferry._ferry's KV side: KvLayout, KvConnector over a pool of registered regions, and the
// handshake side channel (include/ferry/kv/). python/ferry/kv.py checks the pool's tensors
// (dtype, contiguity, size, how they split the pool) where it can name the argument and hands
// this layer raw (ptr, nbytes, device) regions plus the objects that own them. Rules, as in
// module.cc:
// - the connector's callbacks run on its background thread and never touch Python: they queue
//   events under a C++ mutex, and poll() / wait() drain them on the caller's thread;
// - the GIL is released around every call that can block (create, close, handshakes, waits,
//   and the connector calls, which take the connector's lock);
// - every Status becomes a ferry.Error subclass carrying ferry's message.
#include "kv.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "convert.h"
#include "errors.h"
#include "ferry/common/auth.h"
#include "ferry/kv/connector.h"
#include "ferry/kv/handshake.h"
#include "ferry/kv/layout.h"
#include "ferry/kv/messages.h"
#include "ferry/kv/pool.h"
#include "fork.h"
#include "transfer_names.h"

namespace py = pybind11;

namespace ferry::python {
namespace {

using kv::BlockOrder;
using kv::KvLayout;
using kv::KvPlacement;
using kv::RegionSplit;

using Blocks = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;

// `b` is the one-dimensional array ferry.kv made (and checked) from the caller's block ids.
std::vector<uint32_t> to_blocks(const Blocks& b) { return {b.data(), b.data() + b.size()}; }

kv::PullCapability parse_capability(py::handle v) {
    std::vector<uint8_t> b = bytes_arg(v, "capability");
    kv::PullCapability cap{};
    if (b.size() != cap.size()) {
        throw StatusError(
            invalid_argument("capability must be 16 bytes, got " + std::to_string(b.size())));
    }
    std::copy(b.begin(), b.end(), cap.begin());
    return cap;
}

KvPlacement parse_placement(const std::string& s) {
    if (s == "separate") return KvPlacement::kSeparate;
    if (s == "joint") return KvPlacement::kJoint;
    if (s == "block-major") return KvPlacement::kBlockMajor;
    if (s == "head-joint") return KvPlacement::kHeadJoint;
    if (s == "head-joint-kt") return KvPlacement::kHeadJointKt;
    throw StatusError(invalid_argument(
        "unknown KV placement '" + s +
        "': separate (vLLM's [2, blocks, ...] per layer), joint ([blocks, 2, ...]), block-major "
        "head-joint ([blocks, heads, 2, block_size, head_dim]) or head-joint-kt (the same with "
        "each head's K page [head_dim, block_size]: vLLM's CPU attention)"));
}

BlockOrder parse_order(const std::string& s) {
    if (s == "NHD") return BlockOrder::kNHD;
    if (s == "HND") return BlockOrder::kHND;
    throw StatusError(invalid_argument("unknown block order '" + s +
                                       "': NHD ([block_size, heads, head_dim]) or HND"));
}

KvLayout make_layout(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                     uint32_t elem_size, uint32_t block_size, uint32_t num_blocks,
                     const std::string& placement, const std::string& order,
                     const std::string& regions) {
    KvLayout l;
    l.num_layers = num_layers;
    l.num_kv_heads = num_kv_heads;
    l.head_dim = head_dim;
    l.elem_size = elem_size;
    l.block_size = block_size;
    l.num_blocks = num_blocks;
    l.placement = parse_placement(placement);
    l.order = parse_order(order);
    l.regions = take(kv::parse_region_split(regions));
    check(l.validate());
    return l;
}

EngineAddress parse_address(const py::bytes& b, const std::string& what) {
    auto span = bytes_span(b);
    auto a = EngineAddress::deserialize(span);
    if (!a.ok()) {
        check(a.status().with_context("bad engine address in " + what + " (" +
                                      std::to_string(span.size()) +
                                      " bytes; pass TransferEngine.address of the peer, "
                                      "unchanged)"));
    }
    return std::move(a).value();
}

std::vector<EngineAddress> parse_addresses(const std::vector<py::bytes>& v) {
    std::vector<EngineAddress> out;
    for (size_t i = 0; i < v.size(); ++i) {
        out.push_back(parse_address(v[i], "prefill_ranks[" + std::to_string(i) + "]"));
    }
    return out;
}

Secret parse_secret(const py::bytes& b) {
    auto r = Secret::from_bytes(bytes_span(b));
    if (!r.ok()) check(r.status().with_context("deployment secret"));
    return std::move(r).value();
}

// What the connector reported, as poll() hands it to Python.
struct Event {
    std::string kind;  // "recv", "send", "scheduled", "progress", "overflow"
    uint64_t transfer_id = 0;
    uint32_t attempt = 0;
    Status status;
    uint64_t bytes = 0;
    uint32_t writes = 0;
    uint32_t tokens = 0;
    uint32_t partial_end = 0;
    uint32_t partial_layers = 0;
    uint64_t dropped = 0;  // overflow: events not kept
    // The caller's name of the transfer (str or bytes; TransferNames), set by poll() with the
    // GIL held; null (never touched by the connector's thread) for an int id.
    py::object name;

    static Event of(const char* kind, const kv::TransferResult& r) {
        Event e;
        e.kind = kind;
        e.transfer_id = r.transfer_id;
        e.attempt = r.attempt;
        e.status = r.status;
        e.bytes = r.bytes;
        e.writes = r.writes;
        return e;
    }

    // The id the caller gave: its name, or the 64-bit id.
    py::object request_id() const { return name ? name : py::int_(transfer_id); }

    std::string repr() const {
        std::string s = "ferry.kv.KvEvent(" + kind +
                        ", transfer_id=" + std::string(py::repr(request_id())) +
                        ", attempt=" + std::to_string(attempt);
        if (kind == "overflow")
            return "ferry.kv.KvEvent(overflow, dropped=" + std::to_string(dropped) + ")";
        if (kind == "progress") {
            s += ", tokens=" + std::to_string(tokens);
        } else {
            s += ", status=" + (status.ok() ? std::string("ok") : status.to_string());
        }
        if (kind == "recv" || kind == "send") {
            s += ", bytes=" + std::to_string(bytes) + ", writes=" + std::to_string(writes);
        }
        return s + ")";
    }
};

// Filled by the connector's thread, drained by the caller's. At most max_events wait: a caller
// that never polled grew it without bound (each event about 100 bytes). Beyond that, events are
// counted and dropped, and the next poll() ends with one "overflow" event saying how many.
struct EventQueue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Event> events;
    size_t max_events = 0;
    uint64_t dropped = 0;
    bool closed = false;  // KvConnector.close() ran: wakes the waiters, who raise Cancelled

    explicit EventQueue(size_t max) : max_events(max) {}

    void close() {
        {
            std::lock_guard<std::mutex> l(mu);
            closed = true;
        }
        cv.notify_all();
    }

    void push(Event e) {
        {
            std::lock_guard<std::mutex> l(mu);
            if (events.size() >= max_events)
                ++dropped;
            else
                events.push_back(std::move(e));
        }
        cv.notify_all();
    }
    std::vector<Event> drain() {
        std::lock_guard<std::mutex> l(mu);
        std::vector<Event> out(std::make_move_iterator(events.begin()),
                               std::make_move_iterator(events.end()));
        events.clear();
        if (dropped > 0) {
            Event e;
            e.kind = "overflow";
            e.dropped = std::exchange(dropped, 0);
            e.status = resource_exhausted(
                std::to_string(e.dropped) + " events were dropped: " + std::to_string(max_events) +
                " were waiting unpolled, the queue's limit (KvConfig.max_events); the transfers "
                "they reported are over, but which is lost: poll() more often or raise "
                "max_events");
            out.push_back(std::move(e));
        }
        return out;
    }
    // Whether events are there (or the queue was closed) within t.
    bool wait(Duration t) {
        std::unique_lock<std::mutex> l(mu);
        return wait_for_or_test(cv, l, t, [&] { return !events.empty() || dropped > 0 || closed; });
    }
};

struct PoolRegion {
    uint64_t ptr = 0;
    uint64_t nbytes = 0;
    int device = -1;
};

// What a running connector holds, destroyed bottom-up: the connector, then the regions it
// writes, then the tensors behind them (with the GIL), then (maybe) the engine. Every call that
// releases the GIL holds a share, so close() on another thread frees nothing under it.
struct LiveConnector {
    std::shared_ptr<TransferEngine> engine;
    py::object owners;  // the tensors behind the regions
    std::vector<std::unique_ptr<MemoryRegion>> mrs;
    std::unique_ptr<kv::KvConnector> conn;

    LiveConnector(std::shared_ptr<TransferEngine> e, py::object o)
        : engine(std::move(e)), owners(std::move(o)) {}
    LiveConnector(const LiveConnector&) = delete;
    LiveConnector& operator=(const LiveConnector&) = delete;
    MadeIn made;

    ~LiveConnector() {
        if (made.inherited()) {  // a fork child: its thread and regions are the parent's
            abandon(std::move(conn));
            abandon(std::move(mrs));
            abandon(std::move(engine));
        }
        conn.reset();  // reports open transfers as cancelled; joins its thread
        mrs.clear();
        py::gil_scoped_acquire gil;
        owners = py::object();
    }
};

class Connector {
  public:
    Connector(std::shared_ptr<TransferEngine> engine, const KvLayout& layout, uint32_t tp_rank,
              uint32_t tp_size, const std::vector<std::tuple<uint64_t, uint64_t, int>>& regions,
              py::object owners, double lease_s, uint32_t imm_base, uint32_t imm_count,
              uint32_t imm_span, bool pull_inline, bool pull_pool_keys, uint64_t max_events) {
        if (max_events == 0)
            throw StatusError(invalid_argument(
                "max_events must be at least 1 (events the connector keeps until poll())"));
        events_ = std::make_shared<EventQueue>(max_events);
        auto live = std::make_shared<LiveConnector>(std::move(engine), std::move(owners));
        kv::ConnectorConfig cc;
        cc.self = {layout, tp_rank, tp_size};
        // ferry.kv checked lease_s with _ferry.seconds() before it refused a second connector.
        cc.lease = std::chrono::duration_cast<Duration>(std::chrono::duration<double>(lease_s));
        cc.imm_base = imm_base;
        cc.imm_count = imm_count;
        cc.imm_span = imm_span;
        cc.pull_mode = pull_inline ? kv::PullMode::kInline : kv::PullMode::kBackground;
        cc.pull_keys = pull_pool_keys ? kv::PullKeys::kPool : kv::PullKeys::kPerOffer;
        kv::ConnectorCallbacks cb;
        auto q = events_;
        cb.on_recv_done = [q](const kv::TransferResult& r) { q->push(Event::of("recv", r)); };
        cb.on_send_done = [q](const kv::TransferResult& r) { q->push(Event::of("send", r)); };
        cb.on_scheduled = [q](const kv::TransferResult& r) { q->push(Event::of("scheduled", r)); };
        cb.on_recv_progress = [q](const kv::TransferProgress& p) {
            Event e;
            e.kind = "progress";
            e.transfer_id = p.transfer_id;
            e.attempt = p.attempt;
            e.tokens = p.tokens;
            e.partial_end = p.partial_end;
            e.partial_layers = p.partial_layers;
            q->push(std::move(e));
        };
        Status s;
        {
            py::gil_scoped_release nogil;
            s = open(*live, regions, cc, std::move(cb));
            if (!s.ok()) live.reset();  // nothing registered stays behind a refused pool
        }
        check(s);
        live_ = std::move(live);
    }

    // A share of the running connector, for a call; Cancelled once closed.
    std::shared_ptr<LiveConnector> live() const {
        if (!live_) throw StatusError(cancelled("KV connector is closed (KvConnector.close())"));
        return live_;
    }

    kv::KvConnector& get() const { return *live()->conn; }

    void close() {
        std::shared_ptr<LiveConnector> live = std::move(live_);
        events_->close();
        py::gil_scoped_release nogil;
        live.reset();  // the last share reports open transfers as cancelled, into events_
    }

    void announce(py::handle name, uint32_t attempt, const std::vector<py::bytes>& prefill_ranks) {
        auto addrs = parse_addresses(prefill_ranks);
        named_call(name, TransferNames::kScheduled, false, [&](kv::KvConnector& c, uint64_t id) {
            return c.announce(id, attempt, std::move(addrs));
        });
    }

    void register_push(py::handle name, uint32_t attempt,
                       const std::vector<py::bytes>& prefill_ranks, const Blocks& blocks,
                       uint32_t num_tokens, uint32_t first_token) {
        kv::PushRegistration r{
            0, attempt, parse_addresses(prefill_ranks), to_blocks(blocks), num_tokens, first_token};
        named_call(name, TransferNames::kRecv, false, [&](kv::KvConnector& c, uint64_t id) {
            r.transfer_id = id;
            return c.register_push(std::move(r));
        });
    }

    void cancel(py::handle name) {
        uint64_t id = names_.key(name);
        call([&](kv::KvConnector& c) { return c.cancel(id); });
    }

    void prefill_scheduled(py::handle name) {
        named_call(name, TransferNames::kSend, true,
                   [&](kv::KvConnector& c, uint64_t id) { return c.prefill_scheduled(id); });
    }

    void prefill_progress(py::handle name, const Blocks& blocks, uint32_t tokens,
                          uint32_t partial_end, uint32_t partial_layers) {
        auto b = to_blocks(blocks);
        kv::KvFrontier f{tokens, partial_end, partial_layers};
        named_call(name, TransferNames::kSend, true, [&](kv::KvConnector& c, uint64_t id) {
            return c.prefill_progress(id, std::move(b), f);
        });
    }

    void prefill_done(py::handle name, const Blocks& blocks, uint32_t num_tokens) {
        auto b = to_blocks(blocks);
        named_call(name, TransferNames::kSend, true, [&](kv::KvConnector& c, uint64_t id) {
            return c.prefill_done(id, std::move(b), num_tokens);
        });
    }

    void prefill_failed(py::handle name, const std::string& reason) {
        named_call(name, TransferNames::kSend, true, [&](kv::KvConnector& c, uint64_t id) {
            return c.prefill_failed(id, unavailable(reason));
        });
    }

    void abort_send(py::handle name, const std::string& reason) {
        uint64_t id = names_.key(name);
        call([&](kv::KvConnector& c) { return c.abort_send(id, cancelled(reason)); });
    }

    py::bytes offer_pull(py::handle name, const Blocks& blocks, uint32_t num_tokens,
                         py::handle capability) {
        auto b = to_blocks(blocks);
        std::optional<kv::PullCapability> cap;
        if (!capability.is_none()) cap = parse_capability(capability);
        Result<kv::PullParamsMsg> r = internal_error("unset");
        named_call(name, TransferNames::kSend, true, [&](kv::KvConnector& c, uint64_t id) {
            r = cap ? c.offer_pull(id, std::move(b), num_tokens, *cap)
                    : c.offer_pull(id, std::move(b), num_tokens);
            return r.status();
        });
        return to_bytes(kv::encode_message(take(std::move(r))));
    }

    void pull(py::handle name, const std::vector<py::bytes>& params, const Blocks& blocks,
              uint32_t num_tokens, uint32_t first_token, py::handle live_offer_wait) {
        std::optional<Duration> wait;
        if (!live_offer_wait.is_none()) wait = seconds_arg(live_offer_wait, "live_offer_wait");
        std::vector<kv::PullParamsMsg> ps;
        for (size_t i = 0; i < params.size(); ++i) {
            auto span = bytes_span(params[i]);
            auto m = kv::decode_message(span);
            if (!m.ok() || !std::holds_alternative<kv::PullParamsMsg>(*m)) {
                Status why = m.ok() ? protocol_error(std::string("a ") + kv::message_name(*m) +
                                                     " message, not pull parameters")
                                    : m.status();
                check(why.with_context("bad pull parameters in params[" + std::to_string(i) +
                                       "] (" + std::to_string(span.size()) +
                                       " bytes; pass what the prefill rank's offer_pull "
                                       "returned, unchanged)"));
            }
            ps.push_back(std::get<kv::PullParamsMsg>(std::move(*m)));
        }
        auto b = to_blocks(blocks);
        named_call(name, TransferNames::kRecv, false, [&](kv::KvConnector& c, uint64_t id) {
            return wait ? c.pull_live_offer(id, std::move(ps), std::move(b), num_tokens,
                                            first_token, *wait)
                        : c.pull(id, std::move(ps), std::move(b), num_tokens, first_token);
        });
    }

    // Both raise Cancelled once closed, as every other call does: a loop that polls a closed
    // connector would otherwise see "no events" for ever.
    std::vector<Event> poll() {
        live();
        std::vector<Event> out = events_->drain();
        for (Event& e : out) {
            if (e.kind != "overflow") e.name = names_.on_event(e.transfer_id, e.kind);
        }
        return out;
    }

    bool wait(py::handle timeout) {
        Duration t = seconds_arg(timeout, "timeout");
        live();
        bool got = false;
        Status s = wait_interruptible(
            t,
            [&](Duration slice) -> std::optional<Status> {
                if (!events_->wait(slice)) return std::nullopt;
                got = true;
                return ok_status();
            },
            [] { return ok_status(); });
        check(s);
        live();  // closed meanwhile (by another thread)
        return got;
    }

    kv::HandshakeInfo handshake_info() const {
        std::shared_ptr<LiveConnector> l = live();
        kv::HandshakeInfo info;
        info.address = l->engine->address();
        for (const auto& mr : l->mrs) info.pool.push_back(mr->descriptor());
        const kv::ConnectorConfig& c = l->conn->config();
        info.layout = c.self.layout;
        info.tp_rank = c.self.tp_rank;
        info.tp_size = c.self.tp_size;
        return info;
    }

    py::dict stats() const {
        kv::ConnectorStats s = get().stats();
        py::dict d;
        d["messages_received"] = s.messages_received;
        d["messages_malformed"] = s.messages_malformed;
        d["messages_stale"] = s.messages_stale;
        d["leases_expired"] = s.leases_expired;
        d["transfers_sent"] = s.transfers_sent;
        d["transfers_received"] = s.transfers_received;
        d["transfers_failed"] = s.transfers_failed;
        d["ops_posted"] = s.ops_posted;
        d["bytes_posted"] = s.bytes_posted;
        d["active_send"] = s.active_send;
        d["active_recv"] = s.active_recv;
        return d;
    }

    KvLayout layout() const { return get().config().self.layout; }
    size_t open_names() const { return names_.size(); }

  private:
    static Status open(LiveConnector& live,
                       const std::vector<std::tuple<uint64_t, uint64_t, int>>& regions,
                       const kv::ConnectorConfig& cc, kv::ConnectorCallbacks cb) {
        kv::KvPoolRegions pool;
        for (size_t i = 0; i < regions.size(); ++i) {
            auto [ptr, nbytes, device] = regions[i];
            const MemoryKind kind = device >= 0 ? MemoryKind::kCuda : MemoryKind::kHost;
            // Under per-offer keys peers read only the offers' own registrations.
            auto mr =
                live.engine->register_memory(reinterpret_cast<void*>(ptr), nbytes, kind, device,
                                             kv::pool_remote_access(cc.pull_keys, kind));
            if (!mr.ok()) return mr.status().with_context("pool[" + std::to_string(i) + "]");
            pool.regions.push_back(mr->get());
            live.mrs.push_back(std::move(mr).value());
        }
        auto c = kv::KvConnector::create(live.engine.get(), pool, cc, std::move(cb));
        if (!c.ok()) return c.status();
        live.conn = std::move(c).value();
        return ok_status();
    }

    // A call on a transfer the caller named by `name` (int, str or bytes): `fn(conn, key)`. A
    // refused call keeps no hold of the name.
    template <typename F>
    void named_call(py::handle name, TransferNames::Part part, bool once, F&& fn) {
        TransferNames::Hold h = names_.hold(name, part, once);
        try {
            call([&](kv::KvConnector& c) { return fn(c, h.key); });
        } catch (...) {
            names_.release(h);
            throw;
        }
    }

    template <typename F>
    void call(F&& fn) {
        std::shared_ptr<LiveConnector> l = live();
        Status s;
        {
            py::gil_scoped_release nogil;
            s = fn(*l->conn);
            l.reset();  // the last share (close() ran meanwhile) is let go without the GIL
        }
        check(s);
    }

    std::shared_ptr<EventQueue> events_;
    std::shared_ptr<LiveConnector> live_;
    TransferNames names_;
};

class HandshakeServer {
  public:
    HandshakeServer(const std::string& host, uint16_t port, kv::HandshakeInfo info,
                    const py::bytes& secret, py::handle connection_deadline) {
        kv::HandshakeServerOptions o;
        o.secret = parse_secret(secret);
        o.connection_deadline = seconds_arg(connection_deadline, "connection_deadline");
        Result<std::unique_ptr<kv::HandshakeServer>> r = internal_error("unset");
        {
            py::gil_scoped_release nogil;
            r = kv::HandshakeServer::start(host, port, std::move(info), std::move(o));
        }
        server_ = take(std::move(r));
    }
    kv::HandshakeServer& get() const {
        if (!server_) throw StatusError(cancelled("handshake server is closed"));
        return *server_;
    }
    void close() {
        if (made_.inherited()) return abandon(std::move(server_));  // the parent's (fork.h)
        py::gil_scoped_release nogil;
        server_.reset();  // joins its thread
    }
    ~HandshakeServer() {
        if (made_.inherited()) abandon(std::move(server_));
    }
    HandshakeServer(const HandshakeServer&) = delete;
    HandshakeServer& operator=(const HandshakeServer&) = delete;

  private:
    std::unique_ptr<kv::HandshakeServer> server_;
    MadeIn made_;
};

py::list descriptors_of(const kv::HandshakeInfo& i) {
    py::list out;
    for (const auto& d : i.pool) out.append(to_bytes(d.serialize()));
    return out;
}

}  // namespace

void register_kv(py::module_& m, EngineShare engine_share) {
    py::class_<KvLayout>(
        m, "KvLayout",
        "Where each (layer, K/V, block, token, head) of one rank's pool lives\n"
        "(ferry::kv::KvLayout).\n"
        "\n"
        "placement: \"separate\" (per layer, K of all blocks then V: vLLM's [2, blocks, ...]\n"
        "    per layer), \"joint\" ([blocks, 2, ...] per layer), \"block-major\" (each block\n"
        "    holds every layer) or \"head-joint\" ([blocks, heads, 2, block_size, head_dim] per\n"
        "    layer: each head's K rows then its V rows; order \"HND\" only) or \"head-joint-kt\"\n"
        "    (head-joint with each head's K page transposed, [head_dim, block_size]: what vLLM\n"
        "    0.32's CPU attention writes with its vector kernels; order \"HND\" only).\n"
        "order: \"NHD\" ([block_size, heads, head_dim] per block slab) or \"HND\".\n"
        "regions: \"one\", \"per-layer\" or \"per-layer-kv\": how the pool is split into tensors.\n"
        "Sizes are this rank's: num_kv_heads is the heads this TP rank holds. Raises\n"
        "InvalidArgument for zero sizes, unknown names and splits the placement does not keep\n"
        "contiguous. Two sides may differ in block size, heads per rank, order and split;\n"
        "head_dim and elem_size must agree (compatibility_hash).")
        .def(py::init([](py::handle layers, py::handle heads, py::handle head_dim,
                         py::handle elem_size, py::handle block_size, py::handle blocks,
                         py::handle placement, py::handle order, py::handle regions) {
                 return make_layout(u32_arg(layers, "num_layers"), u32_arg(heads, "num_kv_heads"),
                                    u32_arg(head_dim, "head_dim"), u32_arg(elem_size, "elem_size"),
                                    u32_arg(block_size, "block_size"),
                                    u32_arg(blocks, "num_blocks"), str_arg(placement, "placement"),
                                    str_arg(order, "order"), str_arg(regions, "regions"));
             }),
             py::arg("num_layers"), py::arg("num_kv_heads"), py::arg("head_dim"),
             py::arg("elem_size"), py::arg("block_size"), py::arg("num_blocks"),
             py::arg("placement") = "separate", py::arg("order") = "NHD",
             py::arg("regions") = "one")
        .def_readonly("num_layers", &KvLayout::num_layers, "Transformer layers in the pool.")
        .def_readonly("num_kv_heads", &KvLayout::num_kv_heads, "KV heads this TP rank holds.")
        .def_readonly("head_dim", &KvLayout::head_dim, "Elements per head.")
        .def_readonly("elem_size", &KvLayout::elem_size, "Bytes per element (2 for bf16/fp16).")
        .def_readonly("block_size", &KvLayout::block_size, "Tokens per block.")
        .def_readonly("num_blocks", &KvLayout::num_blocks, "Blocks in the pool.")
        .def_property_readonly(
            "placement", [](const KvLayout& l) { return placement_name(l.placement); },
            "\"separate\", \"joint\", \"block-major\", \"head-joint\" or \"head-joint-kt\" (see "
            "the "
            "class).")
        .def_property_readonly(
            "order", [](const KvLayout& l) { return l.order == BlockOrder::kNHD ? "NHD" : "HND"; },
            "\"NHD\" or \"HND\" (see the class).")
        .def_property_readonly(
            "regions", [](const KvLayout& l) { return kv::region_split_name(l.regions); },
            "\"one\", \"per-layer\" or \"per-layer-kv\": how many tensors make the pool.")
        .def_property_readonly("token_bytes", &KvLayout::token_bytes,
                               "Bytes of one token's K (or V) across this rank's heads.")
        .def_property_readonly("slab_bytes", &KvLayout::slab_bytes,
                               "Bytes of one block's K (or V) for one layer.")
        .def_property_readonly("layer_bytes", &KvLayout::layer_bytes,
                               "Bytes of one layer's K and V over all blocks.")
        .def_property_readonly("block_bytes", &KvLayout::block_bytes,
                               "Bytes of one block's K and V over all layers.")
        .def_property_readonly("pool_bytes", &KvLayout::pool_bytes,
                               "Bytes of the whole pool, all regions together.")
        .def_property_readonly(
            "region_count", &KvLayout::region_count,
            "Tensors the pool is made of (regions: 1, num_layers or 2 * num_layers).")
        .def_property_readonly("region_bytes", &KvLayout::region_bytes,
                               "Bytes each pool tensor must hold at least.")
        .def_property_readonly(
            "compatibility_hash", &KvLayout::compatibility_hash,
            "What two sides must agree on (head_dim, elem_size); the handshake checks it.")
        .def(
            "slab_offset",
            [](const KvLayout& l, py::handle layer_arg, py::handle part_arg, py::handle block_arg) {
                uint32_t layer = u32_arg(layer_arg, "layer"), part = u32_arg(part_arg, "part"),
                         block = u32_arg(block_arg, "block");
                if (part > 1) throw StatusError(invalid_argument("part is 0 (K) or 1 (V)"));
                if (layer >= l.num_layers || block >= l.num_blocks) {
                    throw StatusError(out_of_range("slab_offset(layer " + std::to_string(layer) +
                                                   ", block " + std::to_string(block) +
                                                   ") is outside the layout's " +
                                                   std::to_string(l.num_layers) + " layers x " +
                                                   std::to_string(l.num_blocks) + " blocks"));
                }
                return l.slab_offset(layer, static_cast<kv::KvPart>(part), block);
            },
            py::arg("layer"), py::arg("part"), py::arg("block"),
            "Pool byte offset of a (layer, K=0/V=1, block) slab; OutOfRange past the layout.")
        .def("__eq__",
             [](const KvLayout& a, py::handle b) -> py::object {
                 if (!py::isinstance<KvLayout>(b))
                     return py::reinterpret_borrow<py::object>(Py_NotImplemented);
                 return py::bool_(a == b.cast<const KvLayout&>());
             })
        .def("__repr__",
             [](const KvLayout& l) { return "ferry.kv.KvLayout(" + l.to_string() + ")"; })
        .def(py::pickle(
            [](const KvLayout& l) {
                return py::make_tuple(l.num_layers, l.num_kv_heads, l.head_dim, l.elem_size,
                                      l.block_size, l.num_blocks, placement_name(l.placement),
                                      l.order == BlockOrder::kNHD ? "NHD" : "HND",
                                      kv::region_split_name(l.regions));
            },
            [](const py::tuple& t) {
                if (t.size() != 9) throw StatusError(protocol_error("bad pickled KvLayout"));
                return make_layout(u32_arg(t[0], "num_layers"), u32_arg(t[1], "num_kv_heads"),
                                   u32_arg(t[2], "head_dim"), u32_arg(t[3], "elem_size"),
                                   u32_arg(t[4], "block_size"), u32_arg(t[5], "num_blocks"),
                                   str_arg(t[6], "placement"), str_arg(t[7], "order"),
                                   str_arg(t[8], "regions"));
            }));

    py::class_<Event> event(
        m, "KvEvent",
        "What the connector reports, drained by KvConnector.poll().\n"
        "\n"
        "kind: \"recv\" (decode: the transfer attempt is over; ok means the KV is complete and\n"
        "    intact, and either way the blocks are the engine's again), \"send\" (prefill:\n"
        "    ferry no longer reads the blocks; free them), \"scheduled\" (decode: every prefill\n"
        "    rank of an announce() scheduled the transfer, or why not), \"progress\" (decode,\n"
        "    push: tokens [0, tokens) landed, plus [tokens, partial_end) in layers [0,\n"
        "    partial_layers)), \"overflow\" (the last of a poll() when KvConfig.max_events were\n"
        "    waiting and more came: `dropped` of them were not kept; its code is \"resource\n"
        "    exhausted\").\n"
        "code: \"ok\" or the status code's name (\"cancelled\", \"timeout\", \"unavailable\", "
        "...);\n"
        "message: ferry's message. bytes / writes: what this rank moved (recv, send).");
    obtained_from(event, "ferry.kv.KvEvent",
                  "KvConnector.poll() returns the finished transfers' events");
    event
        .def_readonly(
            "kind", &Event::kind,
            "\"recv\", \"send\", \"scheduled\", \"progress\" or \"overflow\" (see the class).")
        .def_readonly(
            "transfer_id", &Event::transfer_id,
            "The transfer's 64-bit id: the int the calls gave, or transfer_key() of their name.")
        .def_property_readonly(
            "request_id", &Event::request_id,
            "The transfer id as the calls gave it: the engine's name (str or bytes) or the int.")
        .def_readonly("attempt", &Event::attempt,
                      "The attempt of the transfer this event is about.")
        .def_property_readonly(
            "ok", [](const Event& e) { return e.status.ok(); },
            "Whether the transfer (or announcement) succeeded; see code and message if not.")
        .def_property_readonly(
            "code", [](const Event& e) { return std::string(status_code_name(e.status.code())); },
            "\"ok\" or the status code's name (\"cancelled\", \"timeout\", \"unavailable\", ...).")
        .def_property_readonly(
            "message", [](const Event& e) { return e.status.message(); },
            "ferry's message: what failed and why (\"\" when ok).")
        .def_readonly("bytes", &Event::bytes, "Bytes this rank moved (recv, send).")
        .def_readonly("writes", &Event::writes, "Writes this rank posted or counted (recv, send).")
        .def_readonly("tokens", &Event::tokens,
                      "progress: tokens [0, tokens) of every layer landed.")
        .def_readonly(
            "partial_end", &Event::partial_end,
            "progress: tokens [tokens, partial_end) landed in layers [0, partial_layers).")
        .def_readonly("partial_layers", &Event::partial_layers, "progress: see partial_end.")
        .def_readonly("dropped", &Event::dropped,
                      "overflow: events dropped since the previous poll() (0 for other kinds).")
        .def(
            "raise_if_error", [](const Event& e) { check(e.status); },
            "Raises the ferry.Error subclass of the event's status (nothing when ok).")
        .def("__repr__", &Event::repr);

    py::class_<kv::HandshakeInfo> handshake_info(
        m, "HandshakeInfo",
        "A rank's side-channel answer: how to reach it and what its pool looks like.");
    obtained_from(handshake_info, "ferry.kv.HandshakeInfo",
                  "KvConnector.handshake_info(), ferry.kv.fetch_handshake(...) or "
                  "HandshakeInfo.from_bytes(blob) give one");
    handshake_info
        .def_readonly("epoch", &kv::HandshakeInfo::epoch,
                      "Random per server start: a new value means the peer restarted.")
        .def_property_readonly(
            "address", [](const kv::HandshakeInfo& i) { return to_bytes(i.address.serialize()); },
            "The rank's TransferEngine.address: pass it as a prefill_ranks entry.")
        .def_property_readonly("pool", &descriptors_of,
                               "One region descriptor per pool region, in layout order.")
        .def_readonly("layout", &kv::HandshakeInfo::layout, "The rank's KvLayout.")
        .def_readonly("tp_rank", &kv::HandshakeInfo::tp_rank, "The rank's TP position.")
        .def_readonly("tp_size", &kv::HandshakeInfo::tp_size, "The TP size of the rank's engine.")
        .def(
            "to_bytes", [](const kv::HandshakeInfo& i) { return to_bytes(i.serialize()); },
            "This answer as bytes (what the handshake sends).")
        .def_static(
            "from_bytes",
            [](py::handle b) {
                auto r = kv::HandshakeInfo::deserialize(bytes_arg(b, "handshake info"));
                if (!r.ok()) check(r.status().with_context("bad handshake info"));
                return std::move(r).value();
            },
            "Parses to_bytes() output; ProtocolError when it does not parse.");

    py::class_<Connector>(m, "KvConnector",
                          "ferry::kv::KvConnector over raw (ptr, nbytes, device) regions; "
                          "ferry.kv.KvConnector checks the pool's tensors first. Events are "
                          "queued by ferry's thread and drained by poll().")
        .def(
            py::init([engine_share](py::handle engine, const KvLayout& layout, uint32_t tp_rank,
                                    uint32_t tp_size,
                                    const std::vector<std::tuple<uint64_t, uint64_t, int>>& regions,
                                    py::object owners, double lease, uint32_t imm_base,
                                    uint32_t imm_count, uint32_t imm_span, bool pull_inline,
                                    bool pull_pool_keys, uint64_t max_events) {
                return std::make_unique<Connector>(
                    engine_share(engine), layout, tp_rank, tp_size, regions, std::move(owners),
                    lease, imm_base, imm_count, imm_span, pull_inline, pull_pool_keys, max_events);
            }),
            py::arg("engine"), py::arg("layout"), py::arg("tp_rank"), py::arg("tp_size"),
            py::arg("regions"), py::arg("owners"), py::arg("lease"), py::arg("imm_base"),
            py::arg("imm_count"), py::arg("imm_span"), py::arg("pull_inline"),
            py::arg("pull_pool_keys"), py::arg("max_events"))
        .def_property_readonly("layout", &Connector::layout)
        .def("announce", &Connector::announce)
        .def("register_push", &Connector::register_push)
        .def("cancel", &Connector::cancel)
        .def("prefill_scheduled", &Connector::prefill_scheduled)
        .def("prefill_progress", &Connector::prefill_progress)
        .def("prefill_done", &Connector::prefill_done)
        .def("prefill_failed", &Connector::prefill_failed)
        .def("abort_send", &Connector::abort_send)
        .def("offer_pull", &Connector::offer_pull, py::arg("transfer_id"), py::arg("blocks"),
             py::arg("num_tokens"), py::arg("capability") = py::none())
        .def("pull", &Connector::pull, py::arg("transfer_id"), py::arg("params"), py::arg("blocks"),
             py::arg("num_tokens"), py::arg("first_token"), py::arg("live_offer_wait") = py::none())
        .def("poll", &Connector::poll)
        .def("wait", &Connector::wait)
        .def("handshake_info", &Connector::handshake_info)
        .def("stats", &Connector::stats)
        .def_property_readonly("open_names", [](const Connector& c) { return c.open_names(); })
        .def("close", &Connector::close);

    m.def(
        "transfer_key",
        [](py::handle name) {
            if (!PyUnicode_Check(name.ptr()) && !PyBytes_Check(name.ptr()) &&
                !PyByteArray_Check(name.ptr()) && !PyMemoryView_Check(name.ptr())) {
                throw StatusError::wrong_type("transfer_key takes a str or bytes id, got " +
                                              type_name(name));
            }
            return TransferNames().key(name);
        },
        py::arg("name"),
        "The 64-bit id a str (UTF-8) or bytes transfer id travels as: FNV-1a of its bytes (the\n"
        "C++ library's ferry::kv::transfer_key, which ferry serve uses too). Stable across\n"
        "builds and hosts, so both sides of a transfer compute it alike; KvEvent.transfer_id is\n"
        "it.");

    py::class_<HandshakeServer>(m, "HandshakeServer",
                                "ferry::kv::HandshakeServer; ferry.kv.HandshakeServer wraps it.")
        .def(py::init<const std::string&, uint16_t, kv::HandshakeInfo, const py::bytes&,
                      py::handle>(),
             py::arg("host"), py::arg("port"), py::arg("info"), py::arg("secret"),
             py::arg("connection_deadline"))
        .def_property_readonly("port", [](const HandshakeServer& s) { return s.get().port(); })
        .def_property_readonly("epoch", [](const HandshakeServer& s) { return s.get().epoch(); })
        .def_property_readonly("requests_served",
                               [](const HandshakeServer& s) { return s.get().requests_served(); })
        .def_property_readonly("auth_failures",
                               [](const HandshakeServer& s) { return s.get().auth_failures(); })
        .def("close", &HandshakeServer::close);

    m.def(
        "pull_params",
        [](const kv::HandshakeInfo& info, uint64_t transfer_id, const Blocks& blocks,
           uint32_t num_tokens, py::handle capability, py::handle lease_arg) {
            kv::PullParamsMsg m;
            m.transfer_id = transfer_id;
            m.producer_rank = info.tp_rank;
            m.producer_tp = info.tp_size;
            m.num_tokens = num_tokens;
            Duration lease = seconds_arg(lease_arg, "lease");
            m.lease_ms = static_cast<uint32_t>(std::min<int64_t>(
                std::chrono::duration_cast<std::chrono::milliseconds>(lease).count(), UINT32_MAX));
            m.prefill_address = info.address;
            m.pool = info.pool;
            m.layout = info.layout;
            m.blocks = to_blocks(blocks);
            m.capability = parse_capability(capability);
            return to_bytes(kv::encode_message(m));
        },
        py::arg("info"), py::arg("transfer_id"), py::arg("blocks"), py::arg("num_tokens"),
        py::arg("capability"), py::arg("lease"));

    m.def(
        "fetch_handshake",
        [](const std::string& host, uint16_t port, const KvLayout& mine, const py::bytes& secret,
           py::handle timeout) {
            Secret s = parse_secret(secret);
            Duration t = seconds_arg(timeout, "timeout");
            Result<kv::HandshakeInfo> r = internal_error("unset");
            {
                py::gil_scoped_release nogil;
                r = kv::fetch_handshake(host, port, mine.compatibility_hash(), s, t, nullptr,
                                        &mine);
            }
            return take(std::move(r));
        },
        py::arg("host"), py::arg("port"), py::arg("layout"), py::arg("secret"), py::arg("timeout"));
}

}  // namespace ferry::python
