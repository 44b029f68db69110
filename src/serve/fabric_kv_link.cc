#include "ferry/serve/fabric_kv_link.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"
#include "ferry/fabric/engine.h"
#include "ferry/kv/connector.h"
#include "ferry/kv/handshake.h"
#include "ferry/serve/http.h"
#include "ferry/serve/kv_params_auth.h"

namespace ferry::serve {
namespace {

constexpr const char* kLog = "serve.kv";

// The KV layer keys transfers by a 64-bit id; serve's transfer ids are strings the router
// makes unique. FNV-1a gives both sides the same number without another message.
uint64_t transfer_key(const std::string& id) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char c : id) {
        h ^= c;
        h *= 0x100000001b3ull;
    }
    return h;
}

kv::KvLayout layout_of(const KvPool& pool) {
    const KvShape& s = pool.shape();
    kv::KvLayout l;
    l.num_layers = uint32_t(s.layers);
    l.num_kv_heads = uint32_t(s.kv_heads);
    l.head_dim = uint32_t(s.head_dim);
    l.elem_size = uint32_t(s.elem_bytes);
    l.block_size = uint32_t(s.block_size);
    l.num_blocks = uint32_t(pool.num_blocks());
    // KvPool: block b at b * block_bytes, [layer][K,V][slot][head][dim] inside.
    l.placement = kv::KvPlacement::kBlockMajor;
    l.order = kv::BlockOrder::kNHD;
    return l;
}

std::vector<uint32_t> to_u32(const std::vector<BlockId>& b) { return {b.begin(), b.end()}; }

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

    std::string http_host = "127.0.0.1";
    int http_port = 0;

    struct Send {
        KvDoneCallback release;
    };
    // A decode-side wait: for SCHEDULED (waits) or for the KV (recvs).
    struct Recv {
        RequestId request;
        KvDoneCallback arrived;  // `scheduled` for a wait
        std::string peer;        // host:http_port, forgotten when the transfer fails
        bool issued = false;
        bool cancelled = false;
        KvProgressCallback progress{};
    };
    mutable std::mutex mu;
    std::map<uint64_t, Send> sends;
    std::map<uint64_t, Recv> recvs;
    std::map<uint64_t, Recv> waits;
    std::map<RequestId, uint64_t> recv_of_request;
    std::map<std::string, int> side_ports;  // peer host:http_port -> side-channel port

    // Orders connector calls of one transfer: a cancel never overtakes its registration.
    std::mutex issue_mu;

    std::mutex q_mu;
    std::condition_variable q_cv;
    std::deque<std::function<void()>> jobs;
    bool stopping = false;
    std::thread worker;

    std::atomic<uint64_t> ok{0}, failed{0}, bytes{0}, handshakes{0};

    void on_send_done(const kv::TransferResult& r) {
        KvDoneCallback release;
        {
            std::lock_guard lk(mu);
            auto it = sends.find(r.transfer_id);
            if (it == sends.end()) return;
            release = std::move(it->second.release);
            sends.erase(it);
        }
        (r.status.ok() ? ok : failed).fetch_add(1);
        bytes.fetch_add(r.bytes);
        if (!r.status.ok())
            log(LogLevel::kWarn, kLog, "transfer {:x} (send) failed: {}", r.transfer_id,
                r.status.to_string());
        release(r.status);
    }

    // Takes a wait or receive out of `m`; the caller calls its callback outside the lock.
    KvDoneCallback take_locked(std::map<uint64_t, Recv>& m, uint64_t tid, Status* st) {
        auto it = m.find(tid);
        if (it == m.end()) return nullptr;
        if (st->ok() && it->second.cancelled) *st = cancelled("transfer cancelled by decode");
        if (!st->ok()) forget_peer_locked(it->second.peer);
        KvDoneCallback cb = std::move(it->second.arrived);
        recv_of_request.erase(it->second.request);
        m.erase(it);
        return cb;
    }

    void on_recv_done(const kv::TransferResult& r) {
        Status st = r.status;
        KvDoneCallback arrived;
        {
            std::lock_guard lk(mu);
            arrived = take_locked(recvs, r.transfer_id, &st);
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
            if (it == recvs.end() || it->second.cancelled) return;
            progress = it->second.progress;
        }
        if (progress) progress(KvReady{p.tokens, p.partial_end, int(p.partial_layers)});
    }

    void on_scheduled(const kv::TransferResult& r) {
        Status st = r.status;
        KvDoneCallback scheduled;
        {
            std::lock_guard lk(mu);
            scheduled = take_locked(waits, r.transfer_id, &st);
        }
        if (scheduled) scheduled(st);
    }

    void forget_peer_locked(const std::string& peer) {
        auto it = side_ports.find(peer);
        if (it == side_ports.end()) return;
        auto colon = peer.rfind(':');
        peers->forget(peer.substr(0, colon), uint16_t(it->second));
        side_ports.erase(it);
    }

    void fail_recv(std::map<uint64_t, Recv>& m, uint64_t tid, Status st) {
        KvDoneCallback cb;
        {
            std::lock_guard lk(mu);
            cb = take_locked(m, tid, &st);
        }
        if (!cb) return;
        failed.fetch_add(1);
        cb(std::move(st));
    }

    // Marks a queued wait or receive as handed to the connector, unless it was cancelled
    // meanwhile: then it is answered here (nothing was posted) and false comes back.
    bool begin_issue(std::map<uint64_t, Recv>& m, uint64_t tid, const char* what) {
        KvDoneCallback cancelled_early;
        {
            std::lock_guard lk(mu);
            auto it = m.find(tid);
            if (it == m.end()) return false;
            if (!it->second.cancelled) {
                it->second.issued = true;
                return true;
            }
            cancelled_early = std::move(it->second.arrived);
            recv_of_request.erase(it->second.request);
            m.erase(it);
        }
        cancelled_early(cancelled(fmt::format("transfer cancelled by decode before {}", what)));
        return false;
    }

    // Decode side, push: handshake, then INTENT to prefill.
    void announce(uint64_t tid, const KvTransferParams& params) {
        auto info = resolve(params.remote_host, params.remote_port);
        if (!info.ok()) return fail_recv(waits, tid, info.status());
        std::lock_guard ilk(issue_mu);
        if (!begin_issue(waits, tid, "it was announced")) return;
        Status st = conn->announce(tid, params.attempt, {info->address});
        if (!st.ok()) fail_recv(waits, tid, st);
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
            std::string theirs = j.value("kv_provider", "");
            if (theirs != cfg.provider)
                return invalid_argument(fmt::format(
                    "engine {} moves KV over provider '{}', this one over '{}': start both with "
                    "the same --provider",
                    key, theirs, cfg.provider));
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
        if (!info.ok()) return fail_recv(recvs, tid, info.status());
        std::lock_guard ilk(issue_mu);
        // Cancelled before anything was posted: the blocks may be reused at once.
        if (!begin_issue(recvs, tid, "it started")) return;
        Status st;
        if (cfg.mode == KvLinkMode::kPush) {
            kv::PushRegistration reg;
            reg.transfer_id = tid;
            reg.attempt = params.attempt;
            reg.prefill_ranks = {info->address};
            reg.blocks = to_u32(blocks);
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
            p.blocks = to_u32(params.remote_block_ids);
            auto cap = from_hex(params.capability, p.capability.size(),
                                "kv_transfer_params.ferry_capability");
            if (!cap.ok()) return fail_recv(recvs, tid, cap.status());
            std::copy(cap->begin(), cap->end(), p.capability.begin());
            st = conn->pull(tid, {std::move(p)}, to_u32(blocks), uint32_t(tokens));
        }
        if (!st.ok()) fail_recv(recvs, tid, st);
    }

    // Queues a job on the link's thread; false when the link is stopping.
    bool enqueue(std::function<void()> job) {
        {
            std::lock_guard lk(q_mu);
            if (stopping) return false;
            jobs.push_back(std::move(job));
        }
        q_cv.notify_one();
        return true;
    }

    void run() {
        while (true) {
            std::function<void()> job;
            {
                std::unique_lock lk(q_mu);
                q_cv.wait(lk, [&] { return stopping || !jobs.empty(); });
                if (jobs.empty()) return;
                job = std::move(jobs.front());
                jobs.pop_front();
            }
            job();
        }
    }
};

Result<std::unique_ptr<FabricKvLink>> FabricKvLink::create(const FabricKvLinkConfig& config,
                                                           KvPool* pool) {
    if (pool == nullptr) return invalid_argument("no KV pool for the KV link");
    auto impl = std::make_unique<Impl>();
    Impl* p = impl.get();
    p->cfg = config;
    p->pool = pool;
    p->layout = layout_of(*pool);
    FERRY_RETURN_IF_ERROR(p->layout.validate().with_context("KV pool"));
    EngineConfig ec;
    ec.provider = config.provider;
    ec.node = config.host;
    ec.peers_on_same_host = config.provider == "shm";
    ec.op_timeout = config.op_timeout;
    FERRY_ASSIGN_OR_RETURN(p->engine, TransferEngine::create(ec));
    FERRY_ASSIGN_OR_RETURN(p->mr, p->engine->register_memory(pool->base(), pool->size_bytes()));
    kv::ConnectorConfig cc;
    cc.self = {p->layout, 0, 1};
    // The lease must outlast the engine's op timeout (see ConnectorConfig::lease).
    cc.lease = std::max(config.lease, config.op_timeout + seconds(1));
    cc.pull_mode =
        config.mode == KvLinkMode::kPullInline ? kv::PullMode::kInline : kv::PullMode::kBackground;
    // Segments per transfer are bounded by decode's immediate span (every engine runs the
    // defaults), less the two the connector keeps for on_prefill_done.
    p->max_handovers = std::max<uint32_t>(std::min(cc.imm_span, cc.imm_count), 3) - 2;
    kv::ConnectorCallbacks cb;
    cb.on_send_done = [p](const kv::TransferResult& r) { p->on_send_done(r); };
    cb.on_recv_done = [p](const kv::TransferResult& r) { p->on_recv_done(r); };
    cb.on_recv_progress = [p](const kv::TransferProgress& r) { p->on_recv_progress(r); };
    cb.on_scheduled = [p](const kv::TransferResult& r) { p->on_scheduled(r); };
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
    auto side =
        kv::HandshakeServer::start(config.host, uint16_t(config.side_port), info, std::move(so));
    if (!side.ok())
        return side.status().with_context(
            fmt::format("KV side channel on {}:{} (pick another with --kv-port)", config.host,
                        config.side_port));
    p->side = std::move(side).value();
    p->peers = std::make_unique<kv::HandshakeCache>(p->layout.compatibility_hash(), config.secret);
    p->worker = std::thread([p] {
        set_thread_name("ferry-kvlink");
        p->run();
    });
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
    return ok_status();
}

int FabricKvLink::side_port() const { return impl_->side ? impl_->side->port() : 0; }
const std::string& FabricKvLink::provider() const { return impl_->cfg.provider; }

FabricKvLinkStats FabricKvLink::stats() const {
    FabricKvLinkStats s;
    s.transfers_ok = impl_->ok.load();
    s.transfers_failed = impl_->failed.load();
    s.bytes = impl_->bytes.load();
    s.handshakes = impl_->handshakes.load();
    std::lock_guard lk(impl_->mu);
    s.active = impl_->sends.size() + impl_->recvs.size();
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
        s.transfers_ok, s.transfers_failed, s.bytes, s.active);
}

void FabricKvLink::stop() {
    Impl* p = impl_.get();
    {
        std::lock_guard lk(p->q_mu);
        if (p->stopping && !p->worker.joinable()) return;
        p->stopping = true;
    }
    p->q_cv.notify_all();
    if (p->worker.joinable()) p->worker.join();
    // Queued jobs never ran: their transfers are failed below.
    p->jobs.clear();
    p->conn.reset();  // reports every open transfer through the callbacks, joins its thread
    p->side.reset();
    std::map<uint64_t, Impl::Send> sends;
    std::map<uint64_t, Impl::Recv> recvs, waits;
    {
        std::lock_guard lk(p->mu);
        sends.swap(p->sends);
        recvs.swap(p->recvs);
        waits.swap(p->waits);
        p->recv_of_request.clear();
    }
    Status why = cancelled("KV link stopped");
    for (auto& [id, s] : sends) s.release(why);
    for (auto& [id, r] : recvs) r.arrived(why);
    for (auto& [id, r] : waits) r.arrived(why);
}

void FabricKvLink::on_prefill_scheduled(const RequestId& request, const KvTransferParams& params) {
    Impl* p = impl_.get();
    if (p->cfg.mode != KvLinkMode::kPush || params.transfer_id.empty()) return;
    (void)p->conn->prefill_scheduled(transfer_key(params.transfer_id));
}

size_t FabricKvLink::max_progress_handovers() const { return impl_->max_handovers; }

void FabricKvLink::on_prefill_progress(const RequestId& request, const KvTransferParams& params,
                                       const std::vector<BlockId>& blocks, const KvReady& ready) {
    Impl* p = impl_.get();
    if (p->cfg.mode != KvLinkMode::kPush || params.transfer_id.empty()) return;
    Status st = p->conn->prefill_progress(
        transfer_key(params.transfer_id), to_u32(blocks),
        kv::KvFrontier{uint32_t(ready.tokens), uint32_t(ready.partial_end),
                       uint32_t(std::max(ready.partial_layers, 0))});
    // Not fatal: what progress did not send, prefill_done sends.
    if (!st.ok())
        log(LogLevel::kWarn, kLog, "transfer {}: progress not handed over: {}", params.transfer_id,
            st.to_string());
}

void FabricKvLink::on_prefill_aborted(const RequestId& request, const KvTransferParams& params,
                                      const Status& why, KvDoneCallback release) {
    Impl* p = impl_.get();
    if (p->cfg.mode != KvLinkMode::kPush || params.transfer_id.empty()) return release(why);
    uint64_t tid = transfer_key(params.transfer_id);
    {
        std::lock_guard lk(p->mu);
        if (!p->conn || !p->sends.emplace(tid, Impl::Send{release}).second) {
            release(why);  // stopped, or the transfer already has a prefill side
            return;
        }
    }
    // FAIL to decode once writes of earlier chunks completed; on_send_done releases.
    Status st = p->conn->prefill_failed(tid, why);
    if (!st.ok()) {
        {
            std::lock_guard lk(p->mu);
            p->sends.erase(tid);
        }
        release(why);
    }
}

void FabricKvLink::on_transfer_aborted(const RequestId& request, const KvTransferParams& params,
                                       const Status& why) {
    Impl* p = impl_.get();
    // The key on_prefill_done used.
    uint64_t tid = transfer_key(params.transfer_id.empty() ? request : params.transfer_id);
    {
        std::lock_guard lk(p->mu);
        if (!p->conn || !p->sends.count(tid)) return;  // released already
    }
    // on_send_done(why) releases once no write reads the blocks.
    Status st = p->conn->abort_send(tid, why.ok() ? cancelled("transfer aborted") : why);
    if (!st.ok())
        log(LogLevel::kWarn, kLog, "transfer {}: abort not handed over: {}", params.transfer_id,
            st.to_string());
}

Result<KvTransferParams> FabricKvLink::on_prefill_done(const RequestId& request,
                                                       const KvTransferParams& params,
                                                       std::vector<BlockId> blocks,
                                                       size_t num_tokens, KvDoneCallback release) {
    Impl* p = impl_.get();
    bool push = p->cfg.mode == KvLinkMode::kPush;
    if (push && params.transfer_id.empty())
        return invalid_argument("push mode needs a transfer_id in kv_transfer_params");
    FERRY_RETURN_IF_ERROR(verify_kv_params(p->cfg.secret, params));
    std::string id = params.transfer_id.empty() ? request : params.transfer_id;
    uint64_t tid = transfer_key(id);
    KvTransferParams out;
    {
        std::lock_guard lk(p->mu);
        if (!p->conn) return unavailable("KV link is stopped");
        if (!p->sends.emplace(tid, Impl::Send{std::move(release)}).second)
            return invalid_argument(fmt::format("transfer {} already has a prefill side", id));
        out.remote_host = p->http_host;
        out.remote_port = p->http_port;
    }
    out.do_remote_prefill = true;
    out.transfer_id = id;
    out.remote_engine_id = p->cfg.engine_id;
    out.remote_block_ids = blocks;
    Status st;
    if (push) {
        st = p->conn->prefill_done(tid, to_u32(blocks), uint32_t(num_tokens));
    } else {
        auto offer = p->conn->offer_pull(tid, to_u32(blocks), uint32_t(num_tokens));
        st = offer.status();
        if (offer.ok()) out.capability = to_hex(offer->capability);
    }
    if (!st.ok()) {
        std::lock_guard lk(p->mu);
        p->sends.erase(tid);  // refused: the engine frees the blocks itself
        return st;
    }
    // Signed here too, so the offer is proven by its maker; the router signs it again with the
    // decode leg's fields.
    sign_kv_params(p->cfg.secret, &out);
    return out;
}

Status FabricKvLink::authorize(const KvTransferParams& params) const {
    return verify_kv_params(impl_->cfg.secret, params);
}

// Checks a decode leg's parameters against the link's mode and the deployment secret (again:
// no connection or read on unsigned parameters even if an engine did not ask authorize());
// the transfer's 64-bit key.
static Result<uint64_t> decode_leg_key(const FabricKvLinkConfig& cfg,
                                       const KvTransferParams& params) {
    FERRY_RETURN_IF_ERROR(verify_kv_params(cfg.secret, params));
    KvLinkMode mode = cfg.mode;
    bool pull = !params.remote_block_ids.empty();
    if (pull && mode == KvLinkMode::kPush)
        return invalid_argument("remote_block_ids given, but this engine runs in push mode");
    if (!pull && mode != KvLinkMode::kPush)
        return invalid_argument("pull mode needs remote_block_ids from the prefill response");
    if (params.transfer_id.empty())
        return invalid_argument("kv_transfer_params needs a transfer_id");
    if (params.remote_host.empty() || params.remote_port <= 0)
        return invalid_argument(
            "kv_transfer_params needs remote_host and remote_port (the prefill engine's HTTP "
            "address)");
    return transfer_key(params.transfer_id);
}

Status FabricKvLink::await_prefill_scheduled(const RequestId& request,
                                             const KvTransferParams& params,
                                             KvDoneCallback scheduled) {
    Impl* p = impl_.get();
    if (p->cfg.mode != KvLinkMode::kPush) {
        scheduled(ok_status());  // pull legs come after prefill finished
        return ok_status();
    }
    FERRY_ASSIGN_OR_RETURN(uint64_t tid, decode_leg_key(p->cfg, params));
    {
        std::lock_guard lk(p->mu);
        if (!p->conn) return unavailable("KV link is stopped");
        if (p->waits.count(tid) || p->recvs.count(tid))
            return invalid_argument(
                fmt::format("transfer {} already has a decode side", params.transfer_id));
        p->waits[tid] = Impl::Recv{request, std::move(scheduled),
                                   fmt::format("{}:{}", params.remote_host, params.remote_port)};
        p->recv_of_request[request] = tid;
    }
    if (p->enqueue([p, tid, params] { p->announce(tid, params); })) return ok_status();
    std::lock_guard lk(p->mu);
    p->recv_of_request.erase(request);
    p->waits.erase(tid);
    return unavailable("KV link is stopping");
}

Status FabricKvLink::on_blocks_allocated(const RequestId& request, const KvTransferParams& params,
                                         std::vector<BlockId> blocks, size_t num_tokens,
                                         KvDoneCallback arrived, KvProgressCallback progress) {
    Impl* p = impl_.get();
    FERRY_ASSIGN_OR_RETURN(uint64_t tid, decode_leg_key(p->cfg, params));
    {
        std::lock_guard lk(p->mu);
        if (!p->conn) return unavailable("KV link is stopped");
        if (p->recvs.count(tid) || p->waits.count(tid))
            return invalid_argument(
                fmt::format("transfer {} already has a decode side", params.transfer_id));
        Impl::Recv r{request, std::move(arrived),
                     fmt::format("{}:{}", params.remote_host, params.remote_port)};
        r.progress = std::move(progress);
        p->recvs[tid] = std::move(r);
        p->recv_of_request[request] = tid;
    }
    if (p->cfg.mode == KvLinkMode::kPullInline) {
        // The baseline: handshake (cached after the first), planning and posting in the loop.
        p->issue(tid, params, std::move(blocks), num_tokens);
        return ok_status();
    }
    if (p->enqueue([p, tid, params, b = std::move(blocks), num_tokens]() mutable {
            p->issue(tid, params, std::move(b), num_tokens);
        }))
        return ok_status();
    std::lock_guard lk(p->mu);
    p->recv_of_request.erase(request);
    p->recvs.erase(tid);
    return unavailable("KV link is stopping");
}

void FabricKvLink::cancel(const RequestId& request) {
    Impl* p = impl_.get();
    std::lock_guard ilk(p->issue_mu);
    uint64_t tid = 0;
    {
        std::lock_guard lk(p->mu);
        auto it = p->recv_of_request.find(request);
        if (it == p->recv_of_request.end()) return;
        tid = it->second;
        auto w = p->waits.find(tid);
        Impl::Recv& r = w != p->waits.end() ? w->second : p->recvs[tid];
        r.cancelled = true;
        // Not handed to the connector yet: announce() / issue() answer when they get to it.
        if (!r.issued) return;
    }
    // Push: CANCEL to prefill, answered once no write can land (an announcement: at once).
    // Pull: reads are bounded by the op timeout; the result is reported as cancelled when
    // they end.
    if (p->cfg.mode == KvLinkMode::kPush) (void)p->conn->cancel(tid);
}

}  // namespace ferry::serve
