#include "serve/fabric_kv_link.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/worker_queue.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"
#include "ferry/fabric/engine.h"
#include "ferry/kv/connector.h"
#include "ferry/kv/handshake.h"
#include "ferry/kv/transfer_key.h"
#include "serve/http.h"
#include "serve/kv_params_auth.h"

namespace ferry::serve {
namespace {

constexpr const char* kLog = "serve.kv";

}  // namespace

class FabricKvLink::Impl {
  public:
    FabricKvLinkConfig cfg;
    KvPool* pool = nullptr;
    kv::KvLayout layout;
    std::unique_ptr<TransferEngine> engine;
    size_t max_handovers = 1;  // see KvProducer::max_progress_handovers
    std::unique_ptr<MemoryRegion> mr;
    std::unique_ptr<kv::KvConnector> conn;
    std::unique_ptr<kv::HandshakeServer> side;
    std::unique_ptr<kv::HandshakeCache> peers;
    // The legs authorize() took: each is taken once, until it expires, and only when signed for
    // this link's incarnation (drawn here, stated in the engine's /health).
    LegTagLedger ledger{LegTagLedger::kDefaultCapacity, new_incarnation()};

    std::string http_host = "127.0.0.1";
    int http_port = 0;

    // The link keeps of a transfer only the engine's side of it: the string id and the
    // callback to answer, and on decode the peer and whether the connector has it yet. The
    // transfer's own state (attempts, segments, writes, leases) is the connector's.
    struct Send {
        std::string transfer_id;
        KvDoneCallback release;
    };
    // A decode leg, from await_prefill_scheduled (kAwait) or on_blocks_allocated (kRecv) until
    // its callback ran.
    struct Recv {
        enum class Phase { kAwait, kRecv };
        Phase phase = Phase::kRecv;
        std::string transfer_id;
        KvDoneCallback done;  // `scheduled` (kAwait) or `arrived` (kRecv)
        std::string peer;     // host:http_port, forgotten when the transfer fails
        bool issued = false;  // handed to the connector
        bool cancelled = false;
        KvProgressCallback progress{};
    };
    using Phase = Recv::Phase;
    mutable std::mutex mu;
    std::map<uint64_t, Send> sends;         // by the connector's key
    std::map<uint64_t, Recv> recvs;         // by the connector's key
    std::map<std::string, int> side_ports;  // peer host:http_port -> side-channel port
    // Prefill, push: legs scheduled and not handed over yet, by key, so that a decode that
    // gives one up names it to the engine (gave_up) while its prompt still computes.
    std::map<uint64_t, std::string> computing;
    KvProducer::GaveUpHandler gave_up;
    // String transfer ids to the connector's keys; a second id on a key in use is refused.
    std::unique_ptr<kv::TransferKeys> keys;

    // Orders connector calls of one transfer: a cancel never overtakes its registration.
    std::mutex issue_mu;

    // The link's thread: connector calls that may block (a handshake) run there, in order.
    std::unique_ptr<WorkerQueue> jobs;
    std::mutex q_mu;
    bool stopping = false;
    std::thread watcher;  // peer_check_interval; waits on watch_cv for `stopping`
    std::condition_variable watch_cv;

    std::atomic<uint64_t> ok{0}, failed{0}, bytes{0}, handshakes{0};

    void on_send_done(const kv::TransferResult& r) {
        KvDoneCallback release;
        std::string id;
        {
            std::lock_guard lk(mu);
            auto it = sends.find(r.transfer_id);
            if (it == sends.end()) return;
            release = std::move(it->second.release);
            id = it->second.transfer_id;
            erase_send_locked(it);
        }
        (r.status.ok() ? ok : failed).fetch_add(1);
        bytes.fetch_add(r.bytes);
        if (!r.status.ok())
            log(LogLevel::kWarn, kLog, "transfer {} (send) failed: {}", id, r.status.to_string());
        release(r.status);
    }

    void erase_send_locked(std::map<uint64_t, Send>::iterator it) {
        keys->release(it->second.transfer_id);
        sends.erase(it);
    }

    void erase_recv_locked(std::map<uint64_t, Recv>::iterator it) {
        keys->release(it->second.transfer_id);
        recvs.erase(it);
    }

    // Takes a decode leg of this phase out (a result of the other phase is stale); the caller
    // calls its callback outside the lock.
    KvDoneCallback take_locked(uint64_t tid, Phase phase, Status* st) {
        auto it = recvs.find(tid);
        if (it == recvs.end() || it->second.phase != phase) return nullptr;
        if (st->ok() && it->second.cancelled) *st = cancelled("transfer cancelled by decode");
        if (!st->ok()) forget_peer_locked(it->second.peer);
        KvDoneCallback cb = std::move(it->second.done);
        erase_recv_locked(it);
        return cb;
    }

    void on_recv_done(const kv::TransferResult& r) {
        Status st = r.status;
        KvDoneCallback arrived;
        {
            std::lock_guard lk(mu);
            arrived = take_locked(r.transfer_id, Phase::kRecv, &st);
        }
        if (!arrived) return;
        (st.ok() ? ok : failed).fetch_add(1);
        bytes.fetch_add(r.bytes);
        arrived(st);
    }

    void on_recv_progress(const kv::TransferProgress& p) {
        KvProgressCallback progress;
        {
            std::lock_guard lk(mu);
            auto it = recvs.find(p.transfer_id);
            if (it == recvs.end() || it->second.phase != Phase::kRecv || it->second.cancelled)
                return;
            progress = it->second.progress;
        }
        if (progress) progress(kv::KvFrontier{p.tokens, p.partial_end, p.partial_layers});
    }

    void on_scheduled(const kv::TransferResult& r) {
        Status st = r.status;
        KvDoneCallback scheduled;
        {
            std::lock_guard lk(mu);
            scheduled = take_locked(r.transfer_id, Phase::kAwait, &st);
        }
        if (scheduled) scheduled(st);
    }

    // Prefill: decode gave a scheduled leg up; the engine stops computing it.
    void on_send_cancelled(const kv::TransferResult& r) {
        std::string id;
        KvProducer::GaveUpHandler stop;
        {
            std::lock_guard lk(mu);
            auto it = computing.find(r.transfer_id);
            if (it == computing.end() || !gave_up) return;
            id = it->second;
            stop = gave_up;
        }
        log(LogLevel::kInfo, kLog, "transfer {}: {}; prefill stops computing it", id,
            r.status.message());
        stop(id, r.status);
    }

    void stop_computing(const std::string& transfer_id) {
        auto tid = keys->key_of(transfer_id);
        if (!tid.ok()) return;
        std::lock_guard lk(mu);
        auto it = computing.find(*tid);
        if (it != computing.end() && it->second == transfer_id) computing.erase(it);
    }

    // One round of the peer watch: every cached peer handshaken again. A peer gone or replaced
    // takes its transfers here with it at once (the connector stops waiting for acks that
    // cannot come); one that is only slow is left to the lease.
    void check_peers() {
        std::map<std::string, int> known;
        {
            std::lock_guard lk(mu);
            known = side_ports;
        }
        for (const auto& [key, port] : known) {
            auto colon = key.rfind(':');
            std::string host = key.substr(0, colon);
            Duration timeout = std::min(cfg.handshake_timeout, cfg.peer_check_interval * 2);
            auto probe = peers->probe(host, uint16_t(port), timeout);
            using State = kv::HandshakeCache::Probe::State;
            if (probe.state == State::kSame || probe.state == State::kUnknown) continue;
            Status why =
                probe.state == State::kGone
                    ? unavailable(fmt::format("prefill engine {} is gone: its KV side channel "
                                              "refuses connections",
                                              key))
                    : unavailable(fmt::format("prefill engine {} restarted: the process this "
                                              "transfer was with is gone",
                                              key));
            log(LogLevel::kWarn, kLog, "{}; its transfers here fail now", why.message());
            {
                std::lock_guard lk(mu);
                // A restarted peer keeps its new answer; its side port is looked up again too.
                if (auto it = side_ports.find(key); it != side_ports.end() && it->second == port)
                    side_ports.erase(it);
            }
            if (probe.previous) (void)conn->peer_gone(probe.previous->address, why);
        }
    }

    void watch() {
        std::unique_lock lk(q_mu);
        while (!stopping) {
            watch_cv.wait_for(lk, cfg.peer_check_interval, [&] { return stopping; });
            if (stopping) return;
            lk.unlock();
            check_peers();
            lk.lock();
        }
    }

    void forget_peer_locked(const std::string& peer) {
        auto it = side_ports.find(peer);
        if (it == side_ports.end()) return;
        auto colon = peer.rfind(':');
        peers->forget(peer.substr(0, colon), uint16_t(it->second));
        side_ports.erase(it);
    }

    void fail_recv(uint64_t tid, Phase phase, Status st) {
        KvDoneCallback cb;
        {
            std::lock_guard lk(mu);
            cb = take_locked(tid, phase, &st);
        }
        if (!cb) return;
        failed.fetch_add(1);
        cb(std::move(st));
    }

    // Marks a queued wait or receive as handed to the connector, unless it was cancelled
    // meanwhile: then it is answered here (nothing was posted) and false comes back.
    bool begin_issue(uint64_t tid, Phase phase, const char* what) {
        KvDoneCallback cancelled_early;
        {
            std::lock_guard lk(mu);
            auto it = recvs.find(tid);
            if (it == recvs.end() || it->second.phase != phase) return false;
            if (!it->second.cancelled) {
                it->second.issued = true;
                return true;
            }
            cancelled_early = std::move(it->second.done);
            erase_recv_locked(it);
        }
        cancelled_early(cancelled(fmt::format("transfer cancelled by decode before {}", what)));
        return false;
    }

    // Decode side, push: handshake, then INTENT to prefill.
    void announce(uint64_t tid, const KvTransferParams& params) {
        auto info = resolve(params.remote_host, params.remote_port);
        if (!info.ok()) return fail_recv(tid, Phase::kAwait, info.status());
        std::lock_guard ilk(issue_mu);
        if (!begin_issue(tid, Phase::kAwait, "it was announced")) return;
        Status st = conn->announce(tid, params.attempt, {info->address});
        if (!st.ok()) fail_recv(tid, Phase::kAwait, st);
    }

    // The peer's side channel: its /health names the port; the handshake result is cached.
    Result<kv::HandshakeInfo> resolve(const std::string& host, int http_port) {
        std::string key = fmt::format("{}:{}", host, http_port);
        int port = 0;
        {
            std::lock_guard lk(mu);
            if (auto it = side_ports.find(key); it != side_ports.end()) port = it->second;
        }
        if (port == 0) {
            FERRY_ASSIGN_OR_RETURN(HttpResponse h,
                                   http_get(host, http_port, "/health", cfg.handshake_timeout));
            auto j = nlohmann::json::parse(h.body, nullptr, false);
            if (h.status != 200 || j.is_discarded() || !j.contains("kv_side_channel_port") ||
                !j["kv_side_channel_port"].is_number_integer())
                return unavailable(fmt::format(
                    "engine {} runs no KV connector (its /health names no kv_side_channel_port)",
                    key));
            std::string theirs = j.contains("kv_provider") && j["kv_provider"].is_string()
                                     ? j["kv_provider"].get<std::string>()
                                     : std::string();
            if (theirs != cfg.provider)
                return invalid_argument(fmt::format(
                    "engine {} moves KV over provider '{}', this one over '{}': give both the "
                    "same {}",
                    key, theirs, cfg.provider, setting_name(cfg.setting_names, "provider")));
            port = j["kv_side_channel_port"].get<int>();
            std::lock_guard lk(mu);
            side_ports[key] = port;
        }
        handshakes.fetch_add(1);
        auto info = peers->get(host, uint16_t(port), cfg.handshake_timeout);
        if (!info.ok()) {
            std::lock_guard lk(mu);
            forget_peer_locked(key);
            return info.status().with_context(fmt::format("handshake with {}", key));
        }
        return info;
    }

    // Decode side: handshake, then hand the transfer to the connector.
    void issue(uint64_t tid, const KvTransferParams& params, std::vector<BlockId> blocks,
               size_t tokens) {
        auto info = resolve(params.remote_host, params.remote_port);
        if (!info.ok()) return fail_recv(tid, Phase::kRecv, info.status());
        std::lock_guard ilk(issue_mu);
        // Cancelled before anything was posted: the blocks may be reused at once.
        if (!begin_issue(tid, Phase::kRecv, "it started")) return;
        Status st;
        if (cfg.mode == kv::TransferMode::kPush) {
            kv::PushRegistration reg;
            reg.transfer_id = tid;
            reg.attempt = params.attempt;
            reg.prefill_ranks = {info->address};
            reg.blocks = std::move(blocks);
            reg.num_tokens = uint32_t(tokens);
            st = conn->register_push(std::move(reg));
        } else {
            kv::PullParamsMsg p;
            p.transfer_id = tid;
            p.producer_rank = info->tp_rank;
            p.producer_tp = info->tp_size;
            p.num_tokens = uint32_t(tokens);
            p.lease_ms = uint32_t(to_ms(cfg.lease));
            p.prefill_address = info->address;
            p.pool = info->pool;
            p.layout = info->layout;
            p.blocks = params.remote_block_ids;
            auto cap = from_hex(params.capability, p.capability.size(),
                                "kv_transfer_params.ferry_capability");
            if (!cap.ok()) return fail_recv(tid, Phase::kRecv, cap.status());
            std::copy(cap->begin(), cap->end(), p.capability.begin());
            if (!params.pull_keys.empty()) {
                // The offer's own keys: the handshake's pool descriptor gives the layout.
                auto keys = from_hex(params.pull_keys);
                if (!keys.ok())
                    return fail_recv(
                        tid, Phase::kRecv,
                        keys.status().with_context("kv_transfer_params.ferry_pull_keys"));
                auto windows = kv::decode_pull_windows(*keys, p.layout, p.pool.size());
                if (!windows.ok())
                    return fail_recv(
                        tid, Phase::kRecv,
                        windows.status().with_context("kv_transfer_params.ferry_pull_keys"));
                p.windows = std::move(*windows);
            }
            st = conn->pull(tid, {std::move(p)}, std::move(blocks), uint32_t(tokens));
        }
        if (!st.ok()) fail_recv(tid, Phase::kRecv, st);
    }

    // Queues a job on the link's thread; false when the link is stopping.
    bool enqueue(std::function<void()> job) { return jobs && jobs->post(std::move(job)); }
};

Result<std::unique_ptr<FabricKvLink>> FabricKvLink::create(const FabricKvLinkConfig& config,
                                                           KvPool* pool) {
    if (pool == nullptr) return invalid_argument("no KV pool for the KV link");
    auto impl = std::make_unique<Impl>();
    Impl* p = impl.get();
    p->cfg = config;
    p->pool = pool;
    p->layout = pool->layout();
    p->keys = config.transfer_hash ? std::make_unique<kv::TransferKeys>(config.transfer_hash)
                                   : std::make_unique<kv::TransferKeys>();
    FERRY_RETURN_IF_ERROR(p->layout.validate().with_context("KV pool"));
    EngineConfig ec;
    ec.provider = config.provider;
    ec.node = config.host;
    ec.peers_on_same_host = config.provider == "shm";
    ec.op_timeout = config.op_timeout;
    ec.num_rails = config.num_rails;
    ec.rails = config.rails;
    FERRY_ASSIGN_OR_RETURN(p->engine, TransferEngine::create(ec));
    // Under per-offer keys peers read only the offers' own registrations: the pool key the
    // handshake carries reads nothing.
    FERRY_ASSIGN_OR_RETURN(p->mr, p->engine->register_memory(
                                      pool->base(), pool->size_bytes(), MemoryKind::kHost, -1,
                                      kv::pool_remote_access(config.pull_keys, MemoryKind::kHost)));
    kv::ConnectorConfig cc;
    cc.self = {p->layout, 0, 1};
    // The lease must outlast the engine's op timeout (see ConnectorConfig::lease).
    cc.lease = std::max(config.lease, config.op_timeout + seconds(1));
    cc.pull_mode = config.mode == kv::TransferMode::kPullInline ? kv::PullMode::kInline
                                                                : kv::PullMode::kBackground;
    cc.pull_keys = config.pull_keys;
    // Segments per transfer are bounded by decode's immediate span (every engine runs the
    // defaults), less the two the connector keeps for on_prefill_done.
    p->max_handovers = std::max<uint32_t>(std::min(cc.imm_span, cc.imm_count), 3) - 2;
    kv::ConnectorCallbacks cb;
    cb.on_send_done = [p](const kv::TransferResult& r) { p->on_send_done(r); };
    cb.on_recv_done = [p](const kv::TransferResult& r) { p->on_recv_done(r); };
    cb.on_recv_progress = [p](const kv::TransferProgress& r) { p->on_recv_progress(r); };
    cb.on_scheduled = [p](const kv::TransferResult& r) { p->on_scheduled(r); };
    cb.on_send_cancelled = [p](const kv::TransferResult& r) { p->on_send_cancelled(r); };
    FERRY_ASSIGN_OR_RETURN(
        p->conn, kv::KvConnector::create(p->engine.get(), p->mr.get(), cc, std::move(cb)));
    kv::HandshakeInfo info;
    info.address = p->engine->address();
    info.pool = {p->mr->descriptor()};
    info.layout = p->layout;
    if (config.secret.empty()) return invalid_argument("the KV link needs the deployment secret");
    kv::HandshakeServerOptions so;
    so.secret = config.secret;
    so.max_connections = config.side_max_connections;
    so.max_connections_per_client = config.side_max_connections_per_client;
    so.proof_deadline = config.side_proof_deadline;
    auto side =
        kv::HandshakeServer::start(config.host, uint16_t(config.side_port), info, std::move(so));
    if (!side.ok())
        return side.status().with_context(
            fmt::format("KV side channel on {}:{} (pick another {})", config.host, config.side_port,
                        setting_name(config.setting_names, "side_port")));
    p->side = std::move(side).value();
    p->peers = std::make_unique<kv::HandshakeCache>(p->layout, config.secret);
    p->jobs = std::make_unique<WorkerQueue>(WorkerQueue::Options{.thread_name = "ferry-kvlink"});
    if (config.peer_check_interval > Duration::zero()) {
        p->watcher = std::thread([p] {
            set_thread_name("ferry-kvwatch");
            p->watch();
        });
    }
    return std::unique_ptr<FabricKvLink>(new FabricKvLink(std::move(impl)));
}

FabricKvLink::FabricKvLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

FabricKvLink::~FabricKvLink() { stop(); }

void FabricKvLink::set_http_address(const std::string& host, int port) {
    std::lock_guard lk(impl_->mu);
    impl_->http_host = host;
    impl_->http_port = port;
}

Status FabricKvLink::ready() const {
    std::lock_guard lk(impl_->mu);
    if (!impl_->conn || !impl_->side) return unavailable("the KV link is stopped");
    if (impl_->http_port <= 0)
        return unavailable("the KV link does not know this engine's HTTP address yet");
    Status health = impl_->engine->health();
    if (!health.ok())
        return provider_error(fmt::format(
            "the KV link's transfer engine lost a rail for good ({}): restart this engine",
            health.message()));
    return ok_status();
}

TransferEngine& FabricKvLink::transfer_engine() const { return *impl_->engine; }

int FabricKvLink::side_port() const { return impl_->side ? impl_->side->port() : 0; }
const std::string& FabricKvLink::provider() const { return impl_->cfg.provider; }

namespace {
// Prometheus lines of the engine's per-rail counters: which NICs carried the KV
// (docs/ARCHITECTURE.md, "Rails and topology").
std::string rail_metrics(const TransferEngine& engine) {
    std::string out =
        "# HELP ferry_kv_rail_bytes_posted_total bytes this engine posted on each rail\n"
        "# TYPE ferry_kv_rail_bytes_posted_total counter\n";
    const std::vector<EngineStats> rails = engine.rail_stats();
    for (size_t r = 0; r < rails.size(); ++r)
        out += fmt::format("ferry_kv_rail_bytes_posted_total{{rail=\"{}\"}} {}\n", r,
                           rails[r].bytes_posted);
    out += "# TYPE ferry_kv_rail_ops_posted_total counter\n";
    for (size_t r = 0; r < rails.size(); ++r)
        out += fmt::format("ferry_kv_rail_ops_posted_total{{rail=\"{}\"}} {}\n", r,
                           rails[r].ops_posted);
    out +=
        "# HELP ferry_kv_rail_imm_arrivals_total peers' writes with immediate data landed on "
        "each rail\n"
        "# TYPE ferry_kv_rail_imm_arrivals_total counter\n";
    for (size_t r = 0; r < rails.size(); ++r)
        out += fmt::format("ferry_kv_rail_imm_arrivals_total{{rail=\"{}\"}} {}\n", r,
                           rails[r].imm_arrivals);
    out += fmt::format(
        "# HELP ferry_kv_rail_fallbacks_total transfers with no rail near both memories\n"
        "# TYPE ferry_kv_rail_fallbacks_total counter\n"
        "ferry_kv_rail_fallbacks_total {}\n",
        engine.stats().rail_fallbacks);
    return out;
}
}  // namespace

FabricKvLinkStats FabricKvLink::stats() const {
    FabricKvLinkStats s;
    s.transfers_ok = impl_->ok.load();
    s.transfers_failed = impl_->failed.load();
    s.bytes = impl_->bytes.load();
    s.handshakes = impl_->handshakes.load();
    std::lock_guard lk(impl_->mu);
    s.active = impl_->sends.size();
    for (auto& [id, r] : impl_->recvs) s.active += r.phase == Impl::Phase::kRecv;
    return s;
}

std::string FabricKvLink::prometheus_text() const {
    FabricKvLinkStats s = stats();
    return fmt::format(
               "# HELP ferry_kv_link_transfers_total KV transfers over the fabric link, by result\n"
               "# TYPE ferry_kv_link_transfers_total counter\n"
               "ferry_kv_link_transfers_total{{result=\"ok\"}} {}\n"
               "ferry_kv_link_transfers_total{{result=\"failed\"}} {}\n"
               "# TYPE ferry_kv_link_bytes_total counter\n"
               "ferry_kv_link_bytes_total {}\n"
               "# TYPE ferry_kv_link_active gauge\n"
               "ferry_kv_link_active {}\n",
               s.transfers_ok, s.transfers_failed, s.bytes, s.active) +
           rail_metrics(*impl_->engine);
}

void FabricKvLink::stop() {
    Impl* p = impl_.get();
    {
        std::lock_guard lk(p->q_mu);
        if (p->stopping && !p->watcher.joinable()) return;
        p->stopping = true;
    }
    p->watch_cv.notify_all();
    // Jobs queued before now still run; later ones are refused (their callers fail them).
    if (p->jobs) p->jobs->stop();
    if (p->watcher.joinable()) p->watcher.join();
    p->conn.reset();  // reports every open transfer through the callbacks, joins its thread
    p->side.reset();
    std::map<uint64_t, Impl::Send> sends;
    std::map<uint64_t, Impl::Recv> recvs;
    {
        std::lock_guard lk(p->mu);
        while (!p->sends.empty()) {
            auto leg = p->sends.extract(p->sends.begin());
            p->keys->release(leg.mapped().transfer_id);
            sends.insert(std::move(leg));
        }
        while (!p->recvs.empty()) {
            auto leg = p->recvs.extract(p->recvs.begin());
            p->keys->release(leg.mapped().transfer_id);
            recvs.insert(std::move(leg));
        }
    }
    Status why = cancelled("KV link stopped");
    for (auto& [id, s] : sends) s.release(why);
    for (auto& [id, r] : recvs) r.done(why);
}

void FabricKvLink::on_prefill_scheduled(const std::string& transfer,
                                        const KvTransferParams& params) {
    Impl* p = impl_.get();
    if (p->cfg.mode != kv::TransferMode::kPush || params.transfer_id.empty()) return;
    auto tid = p->keys->key_of(transfer);
    // on_prefill_done refuses the leg with this error.
    if (!tid.ok()) return log(LogLevel::kWarn, kLog, "{}", tid.status().message());
    {
        std::lock_guard lk(p->mu);
        p->computing[*tid] = transfer;
    }
    (void)p->conn->prefill_scheduled(*tid);
}

void FabricKvLink::on_consumer_gave_up(GaveUpHandler stop) {
    std::lock_guard lk(impl_->mu);
    impl_->gave_up = std::move(stop);
}

size_t FabricKvLink::max_progress_handovers() const { return impl_->max_handovers; }

void FabricKvLink::on_prefill_progress(const std::string& transfer, const KvTransferParams& params,
                                       const std::vector<BlockId>& blocks,
                                       const kv::KvFrontier& ready) {
    Impl* p = impl_.get();
    if (p->cfg.mode != kv::TransferMode::kPush || params.transfer_id.empty()) return;
    auto tid = p->keys->key_of(transfer);
    Status st = tid.ok() ? p->conn->prefill_progress(*tid, blocks, ready) : tid.status();
    // Not fatal: what progress did not send, prefill_done sends.
    if (!st.ok())
        log(LogLevel::kWarn, kLog, "transfer {}: progress not handed over: {}", transfer,
            st.to_string());
}

void FabricKvLink::on_prefill_aborted(const std::string& transfer, const KvTransferParams& params,
                                      const Status& why, KvDoneCallback release) {
    Impl* p = impl_.get();
    if (p->cfg.mode != kv::TransferMode::kPush || params.transfer_id.empty()) return release(why);
    p->stop_computing(transfer);
    uint64_t tid = 0;
    {
        std::lock_guard lk(p->mu);
        auto key = p->conn ? p->keys->acquire(transfer)
                           : Result<uint64_t>(unavailable("KV link is stopped"));
        if (!key.ok()) return release(why);  // stopped, or the key is another transfer's
        tid = *key;
        if (!p->sends.emplace(tid, Impl::Send{transfer, release}).second) {
            p->keys->release(transfer);
            release(why);  // the transfer already has a prefill side
            return;
        }
    }
    // FAIL to decode once writes of earlier chunks completed; on_send_done releases.
    Status st = p->conn->prefill_failed(tid, why);
    if (!st.ok()) {
        {
            std::lock_guard lk(p->mu);
            if (auto it = p->sends.find(tid); it != p->sends.end()) p->erase_send_locked(it);
        }
        release(why);
    }
}

void FabricKvLink::on_transfer_aborted(const std::string& transfer, const KvTransferParams& params,
                                       const Status& why) {
    Impl* p = impl_.get();
    uint64_t tid = 0;
    {
        std::lock_guard lk(p->mu);
        auto key = p->keys->key_of(transfer);
        if (!key.ok()) return;  // the key is another transfer's: this one is not here
        tid = *key;
        auto it = p->sends.find(tid);
        if (!p->conn || it == p->sends.end() || it->second.transfer_id != transfer)
            return;  // released
    }
    // on_send_done(why) releases once no write reads the blocks.
    Status st = p->conn->abort_send(tid, why.ok() ? cancelled("transfer aborted") : why);
    if (!st.ok())
        log(LogLevel::kWarn, kLog, "transfer {}: abort not handed over: {}", transfer,
            st.to_string());
}

Result<KvTransferParams> FabricKvLink::on_prefill_done(const std::string& transfer,
                                                       const KvTransferParams& params,
                                                       std::vector<BlockId> blocks,
                                                       size_t num_tokens, KvDoneCallback release) {
    Impl* p = impl_.get();
    bool push = p->cfg.mode == kv::TransferMode::kPush;
    if (push && params.transfer_id.empty())
        return invalid_argument("push mode needs a transfer_id in kv_transfer_params");
    if (push) p->stop_computing(transfer);
    FERRY_RETURN_IF_ERROR(verify_kv_params(p->cfg.secret, params));
    uint64_t tid = 0;
    KvTransferParams out;
    {
        std::lock_guard lk(p->mu);
        if (!p->conn) return unavailable("KV link is stopped");
        FERRY_ASSIGN_OR_RETURN(tid, p->keys->acquire(transfer));
        if (!p->sends.emplace(tid, Impl::Send{transfer, std::move(release)}).second) {
            p->keys->release(transfer);
            return invalid_argument(
                fmt::format("transfer {} already has a prefill side", transfer));
        }
        out.remote_host = p->http_host;
        out.remote_port = p->http_port;
    }
    out.do_remote_prefill = true;
    out.transfer_id = transfer;
    out.remote_engine_id = p->cfg.engine_id;
    out.remote_block_ids = blocks;
    Status st;
    if (push) {
        st = p->conn->prefill_done(tid, std::move(blocks), uint32_t(num_tokens));
    } else {
        auto offer = p->conn->offer_pull(tid, std::move(blocks), uint32_t(num_tokens));
        st = offer.status();
        if (offer.ok()) {
            out.capability = to_hex(offer->capability);
            if (!offer->windows.empty())
                out.pull_keys = to_hex(kv::encode_pull_windows(offer->windows));
        }
    }
    if (!st.ok()) {
        std::lock_guard lk(p->mu);
        // Refused: the engine frees the blocks itself.
        if (auto it = p->sends.find(tid); it != p->sends.end()) p->erase_send_locked(it);
        return st;
    }
    // Unsigned: the router signs the decode leg it builds from the offer.
    return out;
}

const std::string& FabricKvLink::incarnation() const { return impl_->ledger.incarnation(); }

Status FabricKvLink::authorize(const KvTransferParams& params) const {
    return impl_->ledger.admit(impl_->cfg.secret, params, unix_ms_now());
}

// Checks a decode leg's parameters against the link's mode and the deployment secret (again:
// no connection or read on unsigned parameters even if an engine did not ask authorize()).
static Status check_decode_leg(const FabricKvLinkConfig& cfg, const KvTransferParams& params) {
    FERRY_RETURN_IF_ERROR(verify_kv_params(cfg.secret, params));
    bool pull = !params.remote_block_ids.empty();
    if (pull && cfg.mode == kv::TransferMode::kPush)
        return invalid_argument("remote_block_ids given, but this engine runs in push mode");
    if (!pull && cfg.mode != kv::TransferMode::kPush)
        return invalid_argument("pull mode needs remote_block_ids from the prefill response");
    if (params.transfer_id.empty())
        return invalid_argument("kv_transfer_params needs a transfer_id");
    if (params.remote_host.empty() || params.remote_port <= 0)
        return invalid_argument(
            "kv_transfer_params needs remote_host and remote_port (the prefill engine's HTTP "
            "address)");
    return ok_status();
}

// Registers a decode leg under the connector's key of its transfer id; an error (nothing
// registered) when the link stopped, the transfer has a decode side already, or another
// transfer id in progress holds the key.
static Result<uint64_t> add_decode_leg(FabricKvLink::Impl& p, FabricKvLink::Impl::Recv leg) {
    std::lock_guard lk(p.mu);
    if (!p.conn) return unavailable("KV link is stopped");
    FERRY_ASSIGN_OR_RETURN(uint64_t tid, p.keys->acquire(leg.transfer_id));
    if (p.recvs.count(tid)) {
        p.keys->release(leg.transfer_id);
        return invalid_argument(
            fmt::format("transfer {} already has a decode side", leg.transfer_id));
    }
    p.recvs.emplace(tid, std::move(leg));
    return tid;
}

// Undoes add_decode_leg when the job could not be queued.
static Status drop_decode_leg(FabricKvLink::Impl& p, uint64_t tid) {
    std::lock_guard lk(p.mu);
    if (auto it = p.recvs.find(tid); it != p.recvs.end()) p.erase_recv_locked(it);
    return unavailable("KV link is stopping");
}

Status FabricKvLink::await_prefill_scheduled(const std::string& transfer,
                                             const KvTransferParams& params,
                                             KvDoneCallback scheduled) {
    Impl* p = impl_.get();
    if (p->cfg.mode != kv::TransferMode::kPush) {
        scheduled(ok_status());  // pull legs come after prefill finished
        return ok_status();
    }
    FERRY_RETURN_IF_ERROR(check_decode_leg(p->cfg, params));
    Impl::Recv leg{.phase = Impl::Phase::kAwait,
                   .transfer_id = transfer,
                   .done = std::move(scheduled),
                   .peer = fmt::format("{}:{}", params.remote_host, params.remote_port)};
    FERRY_ASSIGN_OR_RETURN(uint64_t tid, add_decode_leg(*p, std::move(leg)));
    if (p->enqueue([p, tid, params] { p->announce(tid, params); })) return ok_status();
    return drop_decode_leg(*p, tid);
}

Status FabricKvLink::on_blocks_allocated(const std::string& transfer,
                                         const KvTransferParams& params,
                                         std::vector<BlockId> blocks, size_t num_tokens,
                                         KvDoneCallback arrived, KvProgressCallback progress) {
    Impl* p = impl_.get();
    FERRY_RETURN_IF_ERROR(check_decode_leg(p->cfg, params));
    Impl::Recv leg{.phase = Impl::Phase::kRecv,
                   .transfer_id = transfer,
                   .done = std::move(arrived),
                   .peer = fmt::format("{}:{}", params.remote_host, params.remote_port),
                   .progress = std::move(progress)};
    FERRY_ASSIGN_OR_RETURN(uint64_t tid, add_decode_leg(*p, std::move(leg)));
    if (p->cfg.mode == kv::TransferMode::kPullInline) {
        // The baseline: handshake (cached after the first), planning and posting in the loop.
        p->issue(tid, params, std::move(blocks), num_tokens);
        return ok_status();
    }
    if (p->enqueue([p, tid, params, b = std::move(blocks), num_tokens]() mutable {
            p->issue(tid, params, std::move(b), num_tokens);
        }))
        return ok_status();
    return drop_decode_leg(*p, tid);
}

void FabricKvLink::cancel(const std::string& transfer) {
    Impl* p = impl_.get();
    std::lock_guard ilk(p->issue_mu);
    uint64_t tid = 0;
    {
        std::lock_guard lk(p->mu);
        auto key = p->keys->key_of(transfer);
        if (!key.ok()) return;  // the key is another transfer's: this one is not here
        tid = *key;
        auto leg = p->recvs.find(tid);
        if (leg == p->recvs.end() || leg->second.transfer_id != transfer) return;
        Impl::Recv& r = leg->second;
        r.cancelled = true;
        // Not handed to the connector yet: announce() / issue() answer when they get to it.
        if (!r.issued) return;
    }
    // Push: CANCEL to prefill, answered once no write can land (an announcement: at once).
    // Pull: reads are bounded by the op timeout; the result is reported as cancelled when
    // they end.
    if (p->cfg.mode == kv::TransferMode::kPush) (void)p->conn->cancel(tid);
}

}  // namespace ferry::serve
