// KvConnector: one background thread per rank owns every transfer's state; the public calls,
// engine completions and incoming messages only post tasks to it. That keeps the caller's
// thread time to a validation and a queue push, and the state machines free of locks.
//
// This file is the loop and the dispatch: the public calls are checked here and queued, and
// each task and message goes to the role that owns its state (docs/ARCHITECTURE.md):
// PushSender (prefill side of a push), PushReceiver (decode side), PullServer and Puller
// (pull), Leases (deadlines and shutdown).
#include "ferry/kv/connector.h"

#include <fmt/format.h>

#include <thread>

#include "connector_context.h"
#include "ferry/common/auth.h"
#include "ferry/common/log.h"
#include "ferry/common/spin.h"
#include "ferry/common/thread_name.h"
#include "ferry/kv/messages.h"
#include "leases.h"
#include "pull.h"
#include "pull_windows.h"
#include "push_receiver.h"
#include "push_sender.h"

namespace ferry::kv {

using namespace detail;

class KvConnector::Impl {
  public:
    Impl(TransferEngine* engine, KvPoolRegions pool, const ConnectorConfig& config,
         ConnectorCallbacks callbacks)
        : ctx_(engine, std::move(pool), config, std::move(callbacks)),
          sender_(ctx_),
          receiver_(ctx_),
          server_(ctx_),
          puller_(ctx_),
          leases_(ctx_, sender_, receiver_, server_, puller_) {}

    void start() {
        std::weak_ptr<Inbox> inbox = ctx_.inbox;
        ctx_.engine->set_message_handler(
            [this, inbox](uint64_t sender, std::span<const uint8_t> p) {
                auto in = inbox.lock();
                if (!in) return;
                in->post([this, sender, bytes = std::vector<uint8_t>(p.begin(), p.end())] {
                    on_message(sender, bytes);
                });
            });
        thread_ = std::thread([this] {
            set_thread_name("ferry-kvconn");
            run();
        });
    }

    void stop() {
        // A no-op handler, not an empty one: the engine holds messages while no handler is
        // set, and they would be delivered to whoever sets one next.
        ctx_.engine->set_message_handler([](uint64_t, std::span<const uint8_t>) {});
        (void)ctx_.post([this] { leases_.begin_shutdown(); });
        if (thread_.joinable()) thread_.join();
        ctx_.inbox->close();
    }

    // ---- public entry points (caller's thread) ----

    Status register_push(PushRegistration reg) {
        FERRY_RETURN_IF_ERROR(engine_usable());
        FERRY_RETURN_IF_ERROR(
            check_blocks(ctx_.cfg.self.layout, reg.blocks, reg.num_tokens, reg.first_token));
        if (reg.prefill_ranks.empty()) {
            return invalid_argument("register_push: no prefill rank addresses given");
        }
        auto producers = producers_for_consumer(ctx_.cfg.self.total_heads(),
                                                static_cast<uint32_t>(reg.prefill_ranks.size()),
                                                ctx_.cfg.self.tp_size, ctx_.cfg.self.tp_rank);
        if (!producers.ok()) return producers.status();
        FERRY_RETURN_IF_ERROR(
            ctx_.ids.claim(reg.transfer_id, reg.attempt, TransferIds::Kind::kRegistered));
        uint64_t id = reg.transfer_id;
        uint32_t attempt = reg.attempt;
        return claimed(
            id, attempt, TransferIds::Kind::kRegistered,
            post([this, r = std::move(reg)]() mutable { receiver_.register_push(std::move(r)); }));
    }

    Status announce(uint64_t id, uint32_t attempt, std::vector<EngineAddress> ranks) {
        FERRY_RETURN_IF_ERROR(engine_usable());
        if (ranks.empty()) return invalid_argument("announce: no prefill rank addresses given");
        auto producers =
            producers_for_consumer(ctx_.cfg.self.total_heads(), static_cast<uint32_t>(ranks.size()),
                                   ctx_.cfg.self.tp_size, ctx_.cfg.self.tp_rank);
        if (!producers.ok()) return producers.status();
        FERRY_RETURN_IF_ERROR(ctx_.ids.claim(id, attempt, TransferIds::Kind::kAnnounced));
        return claimed(id, attempt, TransferIds::Kind::kAnnounced,
                       post([this, id, attempt, r = std::move(ranks)]() mutable {
                           receiver_.announce(id, attempt, std::move(r));
                       }));
    }

    Status cancel(uint64_t id) {
        return post([this, id] { receiver_.cancel(id); });
    }

    Status peer_gone(const EngineAddress& peer, Status why) {
        if (why.ok()) return invalid_argument("peer_gone needs an error status");
        return post([this, engine_id = peer.engine_id, why] {
            if (auto pid = ctx_.engine->find_peer(engine_id)) {
                receiver_.peer_gone(*pid, why);
                puller_.peer_gone(*pid, why);
            }
        });
    }

    Status prefill_scheduled(uint64_t id) {
        return post([this, id] { sender_.prefill_scheduled(id); });
    }

    Status prefill_progress(uint64_t id, std::vector<uint32_t> blocks, KvFrontier ready) {
        if (ready.has_partial() && ready.partial_layers >= ctx_.cfg.self.layout.num_layers)
            return invalid_argument(fmt::format("{} layers of a chunk ready, the model has {}",
                                                ready.partial_layers,
                                                ctx_.cfg.self.layout.num_layers));
        if (!ready.has_partial()) ready.partial_end = ready.partial_layers = 0;
        FERRY_RETURN_IF_ERROR(
            check_blocks(ctx_.cfg.self.layout, blocks, std::max(ready.tokens, ready.partial_end)));
        return post([this, id, b = std::move(blocks), ready]() mutable {
            sender_.prefill_progress(id, std::move(b), ready);
        });
    }

    Status prefill_done(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens) {
        FERRY_RETURN_IF_ERROR(check_blocks(ctx_.cfg.self.layout, blocks, tokens));
        kv_trace("prefill_done called", id);
        return post([this, id, b = std::move(blocks), tokens]() mutable {
            kv_trace("prefill_done runs", id);
            sender_.prefill_done(id, std::move(b), tokens);
        });
    }

    Status prefill_failed(uint64_t id, const Status& reason) {
        if (reason.ok()) return invalid_argument("prefill_failed needs an error status");
        return post([this, id, reason] { sender_.prefill_failed(id, reason); });
    }

    Status abort_send(uint64_t id, const Status& reason) {
        if (reason.ok()) return invalid_argument("abort_send needs an error status");
        return post([this, id, reason] { abort_send_now(id, reason); });
    }

    Result<PullParamsMsg> offer_pull(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens,
                                     const PullCapability* capability) {
        FERRY_RETURN_IF_ERROR(engine_usable());
        FERRY_RETURN_IF_ERROR(check_blocks(ctx_.cfg.self.layout, blocks, tokens));
        if (capability && *capability == PullCapability{}) {
            return invalid_argument(
                "a pull capability of 16 zero bytes: draw 16 random bytes (it is what "
                "authorises decode's DONE)");
        }
        PullParamsMsg m;
        m.transfer_id = id;
        m.producer_rank = ctx_.cfg.self.tp_rank;
        m.producer_tp = ctx_.cfg.self.tp_size;
        m.num_tokens = tokens;
        m.lease_ms = to_ms_u32(ctx_.cfg.lease);
        m.prefill_address = ctx_.engine->address();
        m.pool = ctx_.pool_descriptors;
        m.layout = ctx_.cfg.self.layout;
        if (capability) {
            m.capability = *capability;
        } else {
            FERRY_RETURN_IF_ERROR(random_bytes(m.capability));
        }
        // The offer's own keys, closed when it ends (PullServer): its parameters carry no key
        // of the pool itself.
        auto windows = std::make_shared<OfferWindows>();
        if (ctx_.cfg.pull_keys == PullKeys::kPerOffer) {
            const size_t used = (uint64_t{tokens} + ctx_.cfg.self.layout.block_size - 1) /
                                ctx_.cfg.self.layout.block_size;
            FERRY_ASSIGN_OR_RETURN(
                *windows, register_offer_windows(*ctx_.engine, ctx_.pool, ctx_.cfg.self.layout,
                                                 std::span(blocks).first(used)));
            m.windows = windows->windows;
            if (!m.windows.empty()) {
                for (MemoryDescriptor& d : m.pool)
                    std::fill(d.rail_keys.begin(), d.rail_keys.end(), 0);
            }
        }
        m.blocks = std::move(blocks);
        FERRY_RETURN_IF_ERROR(ctx_.ids.claim(id, 0, TransferIds::Kind::kOffered));
        // The blocks stay the engine's; the connector only needs the lease and the DONEs.
        FERRY_RETURN_IF_ERROR(claimed(id, 0, TransferIds::Kind::kOffered, post([this, m, windows] {
                                          server_.offer(m, std::move(windows->regions));
                                      })));
        return m;
    }

    Status pull(uint64_t id, std::vector<PullParamsMsg> params, std::vector<uint32_t> blocks,
                uint32_t tokens, uint32_t first_token, std::optional<Duration> ask_wait) {
        FERRY_RETURN_IF_ERROR(engine_usable());
        if (ask_wait && *ask_wait <= Duration::zero()) {
            return invalid_argument("pull: the wait for prefill's offer must be positive");
        }
        FERRY_RETURN_IF_ERROR(check_blocks(ctx_.cfg.self.layout, blocks, tokens, first_token));
        if (params.empty()) return invalid_argument("pull: no transfer parameters given");
        FERRY_RETURN_IF_ERROR(ctx_.ids.claim(id, 0, TransferIds::Kind::kPulling));
        kv_trace("pull called", id);
        auto job = std::make_shared<Puller::Job>();
        job->id = id;
        job->params = std::move(params);
        job->blocks = blocks_from_token0(blocks, first_token, ctx_.cfg.self.layout.block_size);
        job->tokens = tokens;
        job->first_token = first_token;
        if (ask_wait) {
            // The reads start on the connector thread once every prefill rank answered.
            return claimed(id, 0, TransferIds::Kind::kPulling, post([this, job, wait = *ask_wait] {
                               ctx_.counters.active_recv.fetch_add(1);
                               puller_.ask(job, wait);
                           }));
        }
        if (ctx_.cfg.pull_mode == PullMode::kInline) {
            ctx_.counters.active_recv.fetch_add(1);
            puller_.start(job);
            return ok_status();
        }
        return claimed(id, 0, TransferIds::Kind::kPulling, post([this, job] {
                           kv_trace("pull runs", job->id);
                           ctx_.counters.active_recv.fetch_add(1);
                           puller_.start(job);
                       }));
    }

    ConnectorStats stats() const { return ctx_.counters.snapshot(); }
    const ConnectorConfig& config() const { return ctx_.cfg; }

  private:
    Status post(Inbox::Task t) { return ctx_.run_or_post(std::move(t)); }

    // A claim whose work could not be queued (shut down) ends with it.
    Status claimed(uint64_t id, uint32_t attempt, TransferIds::Kind kind, Status queued) {
        if (!queued.ok()) ctx_.ids.release(id, attempt, kind);
        return queued;
    }

    void run() {
        std::unique_lock state(ctx_.inbox->state_lock());
        TimePoint last_task = Clock::now();
        while (true) {
            // Poll instead of sleeping while a transfer is active (ConnectorConfig::idle_spin).
            const TimePoint poll_until = ctx_.active() ? last_task + ctx_.poll_spin : TimePoint{};
            auto tasks = ctx_.inbox->take(state, Clock::now() + Leases::kTick, poll_until);
            for (auto& task : tasks) task();
            TimePoint now = Clock::now();
            if (!tasks.empty()) last_task = now;
            if (!engine_failed_) {
                Status health = ctx_.engine->health();
                if (!health.ok()) {
                    engine_failed_ = true;
                    log(LogLevel::kError, kLog,
                        "the transfer engine lost a rail ({}): transfers waiting for arrivals "
                        "end, and new ones are refused; create a new engine and connector",
                        health.message());
                    leases_.engine_failed(health, now);
                }
            }
            leases_.sweep(now);
            if (leases_.shut_down(now)) break;
        }
        leases_.report_all_as_shut_down();
        ctx_.inbox->close();  // with the state lock held: no call runs a task after this
    }

    // An offer is withdrawn at once; a push's send side ends once its writes drained.
    void abort_send_now(uint64_t id, const Status& reason) {
        if (!server_.withdraw(id, reason)) sender_.abort(id, reason);
    }

    void on_message(uint64_t sender, const std::vector<uint8_t>& bytes) {
        ctx_.counters.messages_received.fetch_add(1);
        auto msg = decode_message(bytes);
        if (!msg.ok()) {
            ctx_.counters.messages_malformed.fetch_add(1);
            log(LogLevel::kWarn, kLog, "dropped a malformed KV message of {} bytes from {:x}: {}",
                bytes.size(), sender, msg.status().to_string());
            return;
        }
        std::visit(
            [&](auto& m) {
                using M = std::decay_t<decltype(m)>;
                if constexpr (std::is_same_v<M, RegisterMsg>)
                    sender_.on_register(std::move(m));
                else if constexpr (std::is_same_v<M, IntentMsg>)
                    sender_.on_intent(std::move(m));
                else if constexpr (std::is_same_v<M, CancelMsg>)
                    sender_.on_cancel(sender, m);
                else if constexpr (std::is_same_v<M, ScheduledMsg>)
                    receiver_.on_scheduled(m);
                else if constexpr (std::is_same_v<M, SegmentMsg>)
                    receiver_.on_segment(m);
                else if constexpr (std::is_same_v<M, FinalMsg>)
                    receiver_.on_final(m);
                else if constexpr (std::is_same_v<M, FailMsg>) {
                    if (!puller_.on_refused(sender, m)) receiver_.on_fail(m);
                } else if constexpr (std::is_same_v<M, CancelAckMsg>)
                    receiver_.on_cancel_ack(m);
                else if constexpr (std::is_same_v<M, DoneMsg>)
                    server_.on_done(m);
                else if constexpr (std::is_same_v<M, PullAskMsg>)
                    server_.on_ask(m);
                else
                    puller_.on_params(sender, m);  // the answer to a PULL_ASK
            },
            *msg);
    }

    // A new transfer on an engine that lost a rail for good (TransferEngine::health) would
    // wait for its lease: refused at once instead.
    Status engine_usable() const {
        Status h = ctx_.engine->health();
        if (h.ok()) return h;
        return unavailable(fmt::format(
            "this connector's transfer engine can take no new transfer: {}", h.message()));
    }

    ConnectorContext ctx_;
    bool engine_failed_ = false;  // connector thread: the engine's loss was handled
    PushSender sender_;
    PushReceiver receiver_;
    PullServer server_;
    Puller puller_;
    Leases leases_;
    std::thread thread_;
};

RemoteAccess pool_remote_access(PullKeys keys, MemoryKind /*kind*/) {
    return keys == PullKeys::kPerOffer ? RemoteAccess::kWrite : RemoteAccess::kReadWrite;
}

Result<std::unique_ptr<KvConnector>> KvConnector::create(TransferEngine* engine,
                                                         const MemoryRegion* pool,
                                                         const ConnectorConfig& config,
                                                         ConnectorCallbacks callbacks) {
    if (!pool) return invalid_argument("KvConnector needs an engine and a pool");
    return create(engine, KvPoolRegions::one(pool), config, std::move(callbacks));
}

Result<std::unique_ptr<KvConnector>> KvConnector::create(TransferEngine* engine, KvPoolRegions pool,
                                                         const ConnectorConfig& config,
                                                         ConnectorCallbacks callbacks) {
    if (!engine) return invalid_argument("KvConnector needs an engine and a pool");
    FERRY_RETURN_IF_ERROR(config.self.layout.validate());
    if (config.self.tp_size == 0 || config.self.tp_rank >= config.self.tp_size) {
        return invalid_argument(fmt::format("TP rank {} is outside TP size {}", config.self.tp_rank,
                                            config.self.tp_size));
    }
    FERRY_RETURN_IF_ERROR(pool.check(config.self.layout));
    if (config.imm_count == 0) return invalid_argument("imm_count must be positive");
    // Past 2^32 the immediates wrapped onto other users' low ones, and a registration whose
    // span straddled 2^32 was dropped by every prefill rank as malformed, as was one of a span
    // over kMaxImmSpan: the transfer failed only when its lease ran out, as a timeout.
    if (uint64_t{config.imm_base} + config.imm_count > (uint64_t{1} << 32)) {
        return invalid_argument(fmt::format(
            "immediates [{:#x}, {:#x}) (imm_base + imm_count) run past the largest 32-bit "
            "immediate: lower imm_base or imm_count",
            config.imm_base, uint64_t{config.imm_base} + config.imm_count));
    }
    if (config.imm_span > kMaxImmSpan) {
        return invalid_argument(
            fmt::format("imm_span {} is more than the {} immediates a registration may reserve",
                        config.imm_span, kMaxImmSpan));
    }
    if (config.lease <= Duration::zero()) return invalid_argument("the lease must be positive");
    for (size_t i = 0; i < pool.regions.size(); ++i) {
        const MemoryRegion* r = pool.regions[i];
        if (r->remote_access() == RemoteAccess::kReadWrite &&
            pool_remote_access(config.pull_keys, r->descriptor().kind) != r->remote_access()) {
            log(LogLevel::kWarn, "kv",
                "pool region {} is registered for peers' reads although the connector hands out "
                "per-offer keys (PullKeys::kPerOffer): anyone holding the handshake can read "
                "the whole region; register it with pool_remote_access()",
                i);
        }
    }
    auto impl = std::make_unique<Impl>(engine, std::move(pool), config, std::move(callbacks));
    impl->start();
    return std::unique_ptr<KvConnector>(new KvConnector(std::move(impl)));
}

KvConnector::KvConnector(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvConnector::~KvConnector() { impl_->stop(); }

Status KvConnector::register_push(PushRegistration r) { return impl_->register_push(std::move(r)); }
Status KvConnector::cancel(uint64_t id) { return impl_->cancel(id); }
Status KvConnector::announce(uint64_t id, uint32_t attempt, std::vector<EngineAddress> ranks) {
    return impl_->announce(id, attempt, std::move(ranks));
}
Status KvConnector::peer_gone(const EngineAddress& peer, Status why) {
    return impl_->peer_gone(peer, std::move(why));
}
Status KvConnector::prefill_scheduled(uint64_t id) { return impl_->prefill_scheduled(id); }
Status KvConnector::prefill_progress(uint64_t id, std::vector<uint32_t> blocks, uint32_t ready) {
    return impl_->prefill_progress(id, std::move(blocks), KvFrontier{ready});
}
Status KvConnector::prefill_progress(uint64_t id, std::vector<uint32_t> blocks, KvFrontier ready) {
    return impl_->prefill_progress(id, std::move(blocks), ready);
}
Status KvConnector::prefill_done(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens) {
    return impl_->prefill_done(id, std::move(blocks), tokens);
}
Status KvConnector::prefill_failed(uint64_t id, Status reason) {
    return impl_->prefill_failed(id, std::move(reason));
}
Status KvConnector::abort_send(uint64_t id, Status reason) { return impl_->abort_send(id, reason); }
Result<PullParamsMsg> KvConnector::offer_pull(uint64_t id, std::vector<uint32_t> blocks,
                                              uint32_t tokens) {
    return impl_->offer_pull(id, std::move(blocks), tokens, nullptr);
}
Result<PullParamsMsg> KvConnector::offer_pull(uint64_t id, std::vector<uint32_t> blocks,
                                              uint32_t tokens, const PullCapability& capability) {
    return impl_->offer_pull(id, std::move(blocks), tokens, &capability);
}
Status KvConnector::pull(uint64_t id, std::vector<PullParamsMsg> params,
                         std::vector<uint32_t> blocks, uint32_t tokens, uint32_t first_token) {
    return impl_->pull(id, std::move(params), std::move(blocks), tokens, first_token, std::nullopt);
}
Status KvConnector::pull_live_offer(uint64_t id, std::vector<PullParamsMsg> params,
                                    std::vector<uint32_t> blocks, uint32_t tokens,
                                    uint32_t first_token, Duration wait) {
    return impl_->pull(id, std::move(params), std::move(blocks), tokens, first_token, wait);
}
ConnectorStats KvConnector::stats() const { return impl_->stats(); }
const ConnectorConfig& KvConnector::config() const { return impl_->config(); }

}  // namespace ferry::kv
