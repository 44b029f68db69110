// KvConnector: one background thread per rank owns every transfer's state; the public calls,
// engine completions and incoming messages only post tasks to it. That keeps the caller's
// thread time to a validation and a queue push, and the state machines free of locks.
#include "ferry/kv/connector.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "ferry/common/auth.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"

namespace ferry::kv {
namespace {

constexpr const char* kLog = "kv";
// How often leases are checked when nothing else happens.
constexpr Duration kTick = std::chrono::milliseconds(5);
// Pages per paged write: bounds one operation's batch so that the rails start on the first
// pages while later groups are still being built.
constexpr size_t kPagesPerOp = 1024;

// Hand-off queue into the connector thread. Engine callbacks hold it through a shared_ptr, so
// a completion that arrives after the connector is gone is dropped instead of touching freed
// state.
class Inbox {
   public:
    using Task = std::function<void()>;

    bool post(Task t) {
        {
            std::lock_guard lk(mu_);
            if (closed_) return false;
            tasks_.push_back(std::move(t));
        }
        cv_.notify_one();
        return true;
    }

    std::deque<Task> take(TimePoint until) {
        std::unique_lock lk(mu_);
        cv_.wait_until(lk, until, [&] { return !tasks_.empty() || closed_; });
        return std::exchange(tasks_, {});
    }

    void close() {
        std::lock_guard lk(mu_);
        closed_ = true;
        tasks_.clear();
    }

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Task> tasks_;
    bool closed_ = false;
};

// The operations of one job in flight: each completion decrements, the last one posts a
// single task to the connector thread (one task per job, not per write).
struct Flight : std::enable_shared_from_this<Flight> {
    explicit Flight(std::function<void(const Status&)> drained) : on_drained(std::move(drained)) {}

    void add() { outstanding.fetch_add(1, std::memory_order_relaxed); }
    void done(const Status& s) {
        if (!s.ok()) {
            std::lock_guard lk(mu);
            if (error.ok()) error = s;
        }
        if (outstanding.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            Status e;
            {
                std::lock_guard lk(mu);
                e = error;
            }
            on_drained(std::move(e));
        }
    }

    std::atomic<uint32_t> outstanding{1};  // the poster holds one until everything is posted
    std::mutex mu;
    Status error;
    std::function<void(const Status&)> on_drained;
};

Status check_blocks(const KvLayout& layout, const std::vector<uint32_t>& blocks,
                    uint32_t num_tokens) {
    if (num_tokens == 0) return invalid_argument("a KV transfer needs at least one token");
    uint32_t need = blocks_for_tokens(num_tokens, layout.block_size);
    if (blocks.size() < need) {
        return invalid_argument(fmt::format("{} tokens need {} blocks of {}, {} given", num_tokens,
                                            need, layout.block_size, blocks.size()));
    }
    for (uint32_t b : blocks) {
        if (b >= layout.num_blocks) {
            return out_of_range(
                fmt::format("block id {} is outside the pool of {} blocks", b, layout.num_blocks));
        }
    }
    return ok_status();
}

uint32_t to_ms_u32(Duration d) {
    return static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::milliseconds>(d).count());
}

}  // namespace

class KvConnector::Impl {
   public:
    Impl(TransferEngine* engine, const MemoryRegion* pool, const ConnectorConfig& config,
         ConnectorCallbacks callbacks)
        : engine_(engine),
          pool_(pool),
          cfg_(config),
          cb_(std::move(callbacks)),
          inbox_(std::make_shared<Inbox>()) {}

    void start() {
        std::weak_ptr<Inbox> inbox = inbox_;
        engine_->set_message_handler([this, inbox](uint64_t sender, std::span<const uint8_t> p) {
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
        engine_->set_message_handler([](uint64_t, std::span<const uint8_t>) {});
        inbox_->post([this] { begin_shutdown(); });
        if (thread_.joinable()) thread_.join();
        inbox_->close();
    }

    // ---- public entry points (caller's thread) ----

    Status register_push(PushRegistration reg) {
        FERRY_RETURN_IF_ERROR(check_blocks(cfg_.self.layout, reg.blocks, reg.num_tokens));
        if (reg.prefill_ranks.empty()) {
            return invalid_argument("register_push: no prefill rank addresses given");
        }
        auto producers = producers_for_consumer(cfg_.self.total_heads(),
                                                static_cast<uint32_t>(reg.prefill_ranks.size()),
                                                cfg_.self.tp_size, cfg_.self.tp_rank);
        if (!producers.ok()) return producers.status();
        return post([this, r = std::move(reg)]() mutable { on_register_push(std::move(r)); });
    }

    Status announce(uint64_t id, uint32_t attempt, std::vector<EngineAddress> ranks) {
        if (ranks.empty()) return invalid_argument("announce: no prefill rank addresses given");
        auto producers =
            producers_for_consumer(cfg_.self.total_heads(), static_cast<uint32_t>(ranks.size()),
                                   cfg_.self.tp_size, cfg_.self.tp_rank);
        if (!producers.ok()) return producers.status();
        return post([this, id, attempt, r = std::move(ranks)]() mutable {
            on_announce(id, attempt, std::move(r));
        });
    }

    Status cancel(uint64_t id) {
        return post([this, id] { on_user_cancel(id); });
    }

    Status prefill_scheduled(uint64_t id) {
        return post([this, id] { on_prefill_scheduled(id); });
    }

    Status prefill_progress(uint64_t id, std::vector<uint32_t> blocks, KvFrontier ready) {
        if (ready.has_partial() && ready.partial_layers >= cfg_.self.layout.num_layers)
            return invalid_argument(fmt::format("{} layers of a chunk ready, the model has {}",
                                                ready.partial_layers, cfg_.self.layout.num_layers));
        if (!ready.has_partial()) ready.partial_end = ready.partial_layers = 0;
        FERRY_RETURN_IF_ERROR(
            check_blocks(cfg_.self.layout, blocks, std::max(ready.tokens, ready.partial_end)));
        return post([this, id, b = std::move(blocks), ready]() mutable {
            on_prefill_progress(id, std::move(b), ready);
        });
    }

    Status prefill_done(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens) {
        FERRY_RETURN_IF_ERROR(check_blocks(cfg_.self.layout, blocks, tokens));
        return post([this, id, b = std::move(blocks), tokens]() mutable {
            on_prefill_done(id, std::move(b), tokens);
        });
    }

    Status prefill_failed(uint64_t id, const Status& reason) {
        if (reason.ok()) return invalid_argument("prefill_failed needs an error status");
        return post([this, id, reason] { on_prefill_failed(id, reason); });
    }

    Status abort_send(uint64_t id, const Status& reason) {
        if (reason.ok()) return invalid_argument("abort_send needs an error status");
        return post([this, id, reason] { on_abort_send(id, reason); });
    }

    Result<PullParamsMsg> offer_pull(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens) {
        FERRY_RETURN_IF_ERROR(check_blocks(cfg_.self.layout, blocks, tokens));
        PullParamsMsg m;
        m.transfer_id = id;
        m.producer_rank = cfg_.self.tp_rank;
        m.producer_tp = cfg_.self.tp_size;
        m.num_tokens = tokens;
        m.lease_ms = to_ms_u32(cfg_.lease);
        m.prefill_address = engine_->address();
        m.pool = pool_->descriptor();
        m.layout = cfg_.self.layout;
        m.blocks = std::move(blocks);
        FERRY_RETURN_IF_ERROR(random_bytes(m.capability));
        // The blocks stay the engine's; the connector only needs the lease and the DONEs.
        FERRY_RETURN_IF_ERROR(post([this, id, cap = m.capability] { on_offer(id, cap); }));
        return m;
    }

    Status pull(uint64_t id, std::vector<PullParamsMsg> params, std::vector<uint32_t> blocks,
                uint32_t tokens) {
        FERRY_RETURN_IF_ERROR(check_blocks(cfg_.self.layout, blocks, tokens));
        if (params.empty()) return invalid_argument("pull: no transfer parameters given");
        auto job = std::make_shared<PullJob>();
        job->id = id;
        job->params = std::move(params);
        job->blocks = std::move(blocks);
        job->tokens = tokens;
        if (cfg_.pull_mode == PullMode::kInline) {
            active_recv_.fetch_add(1);
            start_pull(job);
            return ok_status();
        }
        return post([this, job] {
            active_recv_.fetch_add(1);
            start_pull(job);
        });
    }

    ConnectorStats stats() const {
        ConnectorStats s;
        s.messages_received = messages_received_.load();
        s.messages_malformed = messages_malformed_.load();
        s.messages_stale = messages_stale_.load();
        s.leases_expired = leases_expired_.load();
        s.transfers_sent = transfers_sent_.load();
        s.transfers_received = transfers_received_.load();
        s.transfers_failed = transfers_failed_.load();
        s.ops_posted = ops_posted_.load();
        s.bytes_posted = bytes_posted_.load();
        s.active_send = active_send_.load();
        s.active_recv = active_recv_.load();
        return s;
    }

    const ConnectorConfig& config() const { return cfg_; }

   private:
    // ---- state, touched only on the connector thread ----

    // Prefill side: one decode rank of one attempt. Its writes go out in segments, one per
    // prefill_progress (or prefill_done) that found new final tokens.
    struct SendJob {
        RegisterMsg reg;
        PeerId peer = 0;
        KvFrontier sent;                         // what segments posted so far cover
        uint32_t segments = 0;                   // segments posted
        uint32_t in_flight = 0;                  // segments with writes not yet complete
        std::map<uint32_t, SegmentMsg> pending;  // by index, sent once its writes completed
        bool cancelled = false;                  // by CANCEL or a newer attempt: no FINAL
        bool ack_wanted = false;                 // CANCEL came while writes were in flight
        bool resolved = false;                   // nothing more will be sent for it
        uint32_t writes = 0;
        uint64_t bytes = 0;
        Status error;
    };
    using JobKey = std::pair<uint32_t, uint32_t>;  // (attempt, decode rank)

    struct Intent {
        PeerId peer = 0;
        uint32_t decode_tp = 1;
    };

    struct Producer {
        bool have_prefill = false;
        bool scheduled = false;
        std::vector<uint32_t> blocks;
        KvFrontier ready;                  // KV that is final (progress or done)
        uint32_t tokens = 0;               // the prompt's tokens, known at prefill_done
        std::map<JobKey, Intent> intents;  // decode ranks waiting for SCHEDULED
        bool have_attempt = false;
        uint32_t attempt = 0;
        uint32_t decode_tp = 0;
        std::map<JobKey, SendJob> jobs;
        TimePoint deadline;
        Status failure;          // prefill_failed: later registrations get FAIL
        bool tombstone = false;  // already reported; kept only to answer late messages
        // abort_send told the engine its blocks are free before the writes in flight ended:
        // they only read the blocks, for a transfer both legs of which are given up.
        bool released = false;
    };

    // Decode side: one producer rank of a registration. Open until FINAL came and every
    // segment it announced was counted (or FAIL, or CANCEL_ACK).
    enum class SlotState { kOpen, kComplete, kFailed, kAcked };
    struct Slot {
        uint32_t rank = 0;
        PeerId peer = 0;
        uint32_t imm = 0;  // segment i counts immediate imm + i
        SlotState state = SlotState::kOpen;
        uint32_t writes = 0;
        bool have_final = false;
        uint32_t final_segments = 0;
        uint32_t counted = 0;                 // segments whose writes all arrived
        std::map<uint32_t, uint32_t> landed;  // token ranges counted beyond `prefix`
        uint32_t prefix = 0;                  // tokens [0, prefix) landed
        // Chunks sent layer by layer, by token range: which layers landed.
        std::map<std::pair<uint32_t, uint32_t>, std::vector<bool>> layers_landed;
    };
    struct Consumer {
        std::vector<Slot> slots;
        TimePoint deadline;
        bool cancelling = false;
        Status error;
        uint64_t bytes = 0;
        uint32_t writes = 0;
        KvFrontier progress;  // last reported through on_recv_progress
        ArrivalsExpected awake;  // prefill's writes need this side's polling to progress
    };
    // Decode side before registration: the prefill ranks asked to say SCHEDULED.
    struct Announce {
        std::vector<std::pair<uint32_t, PeerId>> ranks;  // (prefill rank, peer)
        std::vector<uint32_t> scheduled;
        TimePoint deadline;
    };
    using ConsumerKey = std::pair<uint64_t, uint32_t>;  // (transfer id, attempt)

    struct Offer {
        TimePoint deadline;
        PullCapability capability{};  // a DONE without it is ignored
        std::vector<uint32_t> done_ranks;
        bool all_ok = true;
        ArrivalsExpected awake;  // decode's reads need this side's polling to progress
    };

    struct PullSource {
        PeerId peer = 0;
        size_t param = 0;
    };
    struct PullJob {
        uint64_t id = 0;
        std::vector<PullParamsMsg> params;
        std::vector<uint32_t> blocks;
        uint32_t tokens = 0;
        std::vector<PullSource> sources;
        uint32_t reads = 0;
        uint64_t bytes = 0;
    };

    static bool resolved(SlotState s) { return s != SlotState::kOpen; }

    Status post(Inbox::Task t) {
        if (!inbox_->post(std::move(t))) return cancelled("the KV connector is shut down");
        return ok_status();
    }

    void run() {
        while (true) {
            for (auto& task : inbox_->take(Clock::now() + kTick)) task();
            TimePoint now = Clock::now();
            check_leases(now);
            if (stopping_ && (flights_open_.load() == 0 || now > shutdown_deadline_)) break;
        }
        report_all_as_shut_down();
    }

    void send(PeerId peer, const KvMessage& msg) {
        auto bytes = encode_message(msg);
        const char* name = message_name(msg);
        engine_->send_message(peer, bytes, [name, peer](const Status& s) {
            if (!s.ok()) {
                log(LogLevel::kWarn, kLog, "sending {} to peer {} failed: {}", name, peer,
                    s.to_string());
            }
        });
    }

    // Starts a flight whose completion runs `drained` on this thread.
    std::shared_ptr<Flight> new_flight(std::function<void(const Status&)> drained) {
        flights_open_.fetch_add(1);
        std::weak_ptr<Inbox> inbox = inbox_;
        return std::make_shared<Flight>([inbox, d = std::move(drained), this](const Status& s) {
            auto in = inbox.lock();
            if (!in) return;
            in->post([this, d, s] {
                flights_open_.fetch_sub(1);
                d(s);
            });
        });
    }

    // ---- messages ----

    void on_message(uint64_t sender, const std::vector<uint8_t>& bytes) {
        messages_received_.fetch_add(1);
        auto msg = decode_message(bytes);
        if (!msg.ok()) {
            messages_malformed_.fetch_add(1);
            log(LogLevel::kWarn, kLog, "dropped a malformed KV message of {} bytes from {:x}: {}",
                bytes.size(), sender, msg.status().to_string());
            return;
        }
        std::visit(
            [&](auto& m) {
                using M = std::decay_t<decltype(m)>;
                if constexpr (std::is_same_v<M, RegisterMsg>)
                    on_register(std::move(m));
                else if constexpr (std::is_same_v<M, FinalMsg>)
                    on_final(m);
                else if constexpr (std::is_same_v<M, FailMsg>)
                    on_fail(m);
                else if constexpr (std::is_same_v<M, CancelMsg>)
                    on_cancel(sender, m);
                else if constexpr (std::is_same_v<M, CancelAckMsg>)
                    on_cancel_ack(m);
                else if constexpr (std::is_same_v<M, DoneMsg>)
                    on_done(m);
                else if constexpr (std::is_same_v<M, IntentMsg>)
                    on_intent(std::move(m));
                else if constexpr (std::is_same_v<M, ScheduledMsg>)
                    on_scheduled_msg(m);
                else if constexpr (std::is_same_v<M, SegmentMsg>)
                    on_segment(m);
                else
                    stale("PULL_PARAMS travels through the router, not between engines");
            },
            *msg);
    }

    void stale(std::string_view what) {
        messages_stale_.fetch_add(1);
        log(LogLevel::kDebug, kLog, "dropped a stale KV message: {}", what);
    }

    // ---- push, prefill side ----

    void on_register(RegisterMsg m) {
        auto peer = engine_->connect(m.decode_address);
        if (!peer.ok()) {
            log(LogLevel::kWarn, kLog, "transfer {:x}: cannot reach decode rank {}: {}",
                m.transfer_id, m.decode_rank, peer.status().to_string());
            return;
        }
        auto refuse = [&](const Status& s) {
            log(LogLevel::kWarn, kLog, "transfer {:x}: refusing REGISTER from decode rank {}: {}",
                m.transfer_id, m.decode_rank, s.to_string());
            send(*peer, FailMsg{m.transfer_id, m.attempt, cfg_.self.tp_rank, s.code(),
                                s.message().substr(0, kMaxReasonLength)});
        };
        KvRank dst{m.layout, m.decode_rank, m.decode_tp};
        Status compat = check_compatible(cfg_.self, dst);
        if (!compat.ok()) return refuse(compat);
        auto consumers = consumers_for_producer(cfg_.self.total_heads(), cfg_.self.tp_size,
                                                m.decode_tp, cfg_.self.tp_rank);
        if (!consumers.ok()) return refuse(consumers.status());
        if (std::find(consumers->begin(), consumers->end(), m.decode_rank) == consumers->end()) {
            return refuse(
                invalid_argument(fmt::format("prefill rank {} holds no KV head of decode rank {}",
                                             cfg_.self.tp_rank, m.decode_rank)));
        }

        auto [it, fresh] = producers_.try_emplace(m.transfer_id);
        Producer& p = it->second;
        if (fresh) p.deadline = Clock::now() + cfg_.lease;
        if (!p.failure.ok()) return refuse(p.failure);
        if (p.tombstone) return refuse(cancelled("the transfer already finished on prefill"));
        if (p.have_attempt && m.attempt < p.attempt) {
            // The decode side moved on; acknowledging lets its old attempt finish at once.
            send(*peer, CancelAckMsg{m.transfer_id, m.attempt, cfg_.self.tp_rank});
            return stale("REGISTER of a superseded attempt");
        }
        if (p.have_attempt && m.attempt > p.attempt) {
            for (auto& [key, job] : p.jobs) {
                if (key.first < m.attempt) job.cancelled = true;
            }
            std::erase_if(p.jobs, [&](const auto& kv) {
                return kv.first.first < m.attempt && kv.second.in_flight == 0;
            });
        }
        p.have_attempt = true;
        p.attempt = m.attempt;
        p.decode_tp = m.decode_tp;
        JobKey key{m.attempt, m.decode_rank};
        p.intents.erase(key);
        if (p.jobs.count(key)) return stale("duplicate REGISTER");
        SendJob& job = p.jobs[key];
        job.peer = *peer;
        job.reg = std::move(m);
        advance_job(it->first, p, key, job);  // what is final already goes out now
        maybe_finish(it);                     // a job refused while planning is already served
    }

    void on_intent(IntentMsg m) {
        auto peer = engine_->connect(m.decode_address);
        if (!peer.ok()) {
            log(LogLevel::kWarn, kLog, "transfer {:x}: cannot reach decode rank {}: {}",
                m.transfer_id, m.decode_rank, peer.status().to_string());
            return;
        }
        auto [it, fresh] = producers_.try_emplace(m.transfer_id);
        Producer& p = it->second;
        if (fresh) p.deadline = Clock::now() + cfg_.lease;
        Status refused = !p.failure.ok() ? p.failure
                         : p.tombstone   ? cancelled("the transfer already finished on prefill")
                                         : ok_status();
        if (!refused.ok()) {
            send(*peer, FailMsg{m.transfer_id, m.attempt, cfg_.self.tp_rank, refused.code(),
                                refused.message().substr(0, kMaxReasonLength)});
            return;
        }
        p.intents[{m.attempt, m.decode_rank}] = Intent{*peer, m.decode_tp};
        if (p.scheduled) send(*peer, ScheduledMsg{m.transfer_id, m.attempt, cfg_.self.tp_rank});
    }

    // Decode ranks that announced the transfer may now reserve their blocks.
    void mark_scheduled(uint64_t id, Producer& p) {
        if (p.scheduled) return;
        p.scheduled = true;
        for (const auto& [key, intent] : p.intents) {
            send(intent.peer, ScheduledMsg{id, key.first, cfg_.self.tp_rank});
        }
    }

    void on_prefill_scheduled(uint64_t id) {
        auto [it, fresh] = producers_.try_emplace(id);
        Producer& p = it->second;
        if (p.tombstone || !p.failure.ok()) return;
        // Prefill is making progress: the lease counts from here.
        p.deadline = Clock::now() + cfg_.lease;
        mark_scheduled(id, p);
    }

    void on_prefill_progress(uint64_t id, std::vector<uint32_t> blocks, KvFrontier ready) {
        auto [it, fresh] = producers_.try_emplace(id);
        Producer& p = it->second;
        if (p.have_prefill || p.tombstone || !p.failure.ok()) {
            log(LogLevel::kWarn, kLog,
                "transfer {:x}: prefill_progress after prefill_done or a failure; ignored", id);
            return;
        }
        KvPiece ahead;
        if (!next_piece(p.ready, ready, cfg_.self.layout.num_layers, &ahead)) return;
        p.blocks = std::move(blocks);
        p.ready = ready;
        p.deadline = Clock::now() + cfg_.lease;
        mark_scheduled(id, p);
        for (auto& [key, job] : p.jobs) {
            if (key.first == p.attempt) advance_job(id, p, key, job);
        }
    }

    void on_prefill_done(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens) {
        auto [it, fresh] = producers_.try_emplace(id);
        Producer& p = it->second;
        if (p.have_prefill || p.tombstone || !p.failure.ok()) {
            log(LogLevel::kWarn, kLog,
                "transfer {:x}: prefill_done called twice or after a "
                "failure; ignored",
                id);
            return;
        }
        p.have_prefill = true;
        p.blocks = std::move(blocks);
        p.tokens = tokens;
        p.ready = KvFrontier{tokens};
        // The lease counts from when the blocks are held.
        p.deadline = Clock::now() + cfg_.lease;
        active_send_.fetch_add(1);
        mark_scheduled(id, p);
        for (auto& [key, job] : p.jobs) {
            if (key.first == p.attempt) advance_job(id, p, key, job);
        }
        maybe_finish(it);
    }

    void on_prefill_failed(uint64_t id, const Status& reason) {
        auto [it, fresh] = producers_.try_emplace(id);
        Producer& p = it->second;
        if (p.have_prefill || p.tombstone) {
            log(LogLevel::kWarn, kLog,
                "transfer {:x}: prefill_failed after prefill_done; "
                "ignored",
                id);
            return;
        }
        p.failure = reason;
        p.deadline = Clock::now() + cfg_.lease;
        for (const auto& [key, intent] : p.intents) {
            send(intent.peer, FailMsg{id, key.first, cfg_.self.tp_rank, reason.code(),
                                      reason.message().substr(0, kMaxReasonLength)});
        }
        p.intents.clear();
        // Jobs with writes in flight send FAIL once they drained: decode must not reuse its
        // blocks before.
        for (auto it2 = p.jobs.begin(); it2 != p.jobs.end();) {
            auto next = std::next(it2);
            SendJob& job = it2->second;
            if (!job.resolved && job.error.ok()) job.error = reason;
            if (job.in_flight == 0) settle_job(id, p, it2->first, job);
            it2 = next;
        }
        maybe_finish(it);
    }

    // The engine gave the transfer up after prefill_done (the router aborted it: decode failed
    // or the client left). Without this the blocks stayed held until the lease, and under load
    // a dead decode kept prefill's whole pool (issue 19). Unknown or finished: nothing to do.
    void on_abort_send(uint64_t id, const Status& reason) {
        if (auto o = offers_.find(id); o != offers_.end()) {
            // A read decode may still have in flight reads a transfer that is being aborted on
            // both legs; its result is thrown away.
            transfers_failed_.fetch_add(1);
            active_send_.fetch_sub(1);
            offers_.erase(o);
            if (cb_.on_send_done) cb_.on_send_done({id, 0, reason, 0, 0});
            return;
        }
        auto it = producers_.find(id);
        if (it == producers_.end() || it->second.tombstone) return;
        Producer& p = it->second;
        if (!p.have_prefill) return on_prefill_failed(id, reason);
        if (!p.failure.ok()) return;
        p.failure = reason;
        for (const auto& [key, intent] : p.intents) {
            send(intent.peer, FailMsg{id, key.first, cfg_.self.tp_rank, reason.code(),
                                      reason.message().substr(0, kMaxReasonLength)});
        }
        p.intents.clear();
        // The blocks are only the source of the writes still in flight: reusing them changes
        // what lands in decode blocks that FAIL (sent once the writes ended) gives up anyway.
        // Waiting for those writes kept a dead decode's transfers' blocks for the whole op
        // timeout (10 s) after the router had aborted them.
        p.released = true;
        active_send_.fetch_sub(1);
        if (cb_.on_send_done) cb_.on_send_done({id, p.attempt, reason, 0, 0});
        for (auto jt = p.jobs.begin(); jt != p.jobs.end();) {
            auto next = std::next(jt);
            SendJob& job = jt->second;
            if (!job.resolved && job.error.ok()) job.error = reason;
            if (job.in_flight == 0) settle_job(id, p, jt->first, job);
            jt = next;
        }
        maybe_finish(it);
    }

    // Posts what became final since the job's last segment, and sends FINAL once the prompt
    // is complete and every segment drained.
    void advance_job(uint64_t id, Producer& p, JobKey key, SendJob& job) {
        if (job.cancelled || job.resolved || !job.error.ok()) return;
        const uint32_t layers = cfg_.self.layout.num_layers;
        KvPiece piece;
        while (next_piece(job.sent, p.ready, layers, &piece)) {
            // Immediates prefill_done may still need are kept for it: one for the tokens left,
            // and one more for the rest of a chunk sent layer by layer.
            uint32_t keep = 1 + (add_piece(job.sent, piece, layers).has_partial() ? 1 : 0);
            if (job.segments + 1 + keep > job.reg.imm_span && !p.have_prefill) break;
            Status posted = post_segment(id, p, key, job, piece);
            if (!posted.ok()) return fail_job(id, p, key, job, posted);
        }
        if (p.have_prefill && job.sent == KvFrontier{p.tokens} && job.in_flight == 0) {
            send(job.peer,
                 FinalMsg{id, key.first, cfg_.self.tp_rank, job.writes, job.bytes, job.segments});
            job.resolved = true;
        }
    }

    Status post_segment(uint64_t id, Producer& p, JobKey key, SendJob& job, const KvPiece& piece) {
        const RegisterMsg& reg = job.reg;
        const uint32_t layers = cfg_.self.layout.num_layers;
        uint32_t total = p.have_prefill ? p.tokens : reg.num_tokens;
        uint32_t computed = std::max(p.ready.tokens, p.ready.partial_end);
        if (computed > reg.num_tokens || total != reg.num_tokens) {
            return invalid_argument(fmt::format("decode registered {} tokens, prefill computed {}",
                                                reg.num_tokens,
                                                p.have_prefill ? p.tokens : computed));
        }
        auto plan = plan_transfer(
            {cfg_.self, p.blocks, KvRank{reg.layout, reg.decode_rank, reg.decode_tp}, reg.blocks,
             piece.first_token, piece.end_token, piece.first_layer, piece.end_layer});
        if (!plan.ok()) return plan.status();
        uint32_t index = job.segments++;
        bool whole = piece.first_layer == 0 && piece.end_layer == layers;
        SegmentMsg seg{id,
                       key.first,
                       cfg_.self.tp_rank,
                       index,
                       piece.first_token,
                       piece.end_token,
                       0,
                       plan->bytes,
                       whole ? 0 : piece.first_layer,
                       whole ? 0 : piece.end_layer};
        job.sent = add_piece(job.sent, piece, layers);
        job.in_flight++;
        auto flight = new_flight(
            [this, id, key, index](const Status& s) { on_segment_drained(id, key, index, s); });
        seg.writes = post_writes(plan->runs, job, reg.imm + index, *flight);
        job.writes += seg.writes;
        job.bytes += plan->bytes;
        job.pending[index] = seg;
        ops_posted_.fetch_add(plan->runs.size());
        bytes_posted_.fetch_add(plan->bytes);
        flight->done(ok_status());
        return ok_status();
    }

    // Posts the runs as writes carrying `imm`; returns how many immediates they deliver. Short
    // runs of one length (one block or one head slice each, the scattered-blocks case) go out
    // as paged writes of up to kPagesPerOp pages; the long runs (one per layer and K/V when
    // blocks are consecutive) go out together as one write_runs. Either way one engine
    // operation and one completion per group instead of one per run: between GPUs a 16k-token
    // push was 128 copies and 128 immediates (2026-12-01). On fabric paths the engine still
    // stripes long runs across rails.
    uint32_t post_writes(const std::vector<ByteRun>& runs, const SendJob& job, uint32_t imm,
                         Flight& flight) {
        auto cb = [f = flight.shared_from_this()](const Status& s) { f->done(s); };
        uint32_t writes = 0;
        std::vector<uint32_t> src_pages, dst_pages;
        std::vector<ByteRun> long_runs;
        uint64_t page = 0;
        auto flush = [&] {
            if (src_pages.empty()) return;
            flight.add();
            PagedWriteOp op;
            op.peer = job.peer;
            op.src = pool_;
            op.dst = &job.reg.pool;
            op.page_size = page;
            op.src_pages = src_pages;
            op.dst_pages = dst_pages;
            op.imm = imm;
            writes += engine_->paged_write(op, cb).imm_writes();
            src_pages.clear();
            dst_pages.clear();
        };
        auto pageable = [&](const ByteRun& r) {
            return r.length < engine_->config().stripe_threshold && r.src_offset % r.length == 0 &&
                   r.dst_offset % r.length == 0 && r.src_offset / r.length <= UINT32_MAX &&
                   r.dst_offset / r.length <= UINT32_MAX;
        };
        for (const ByteRun& run : runs) {
            if (!pageable(run)) {
                long_runs.push_back(run);
                continue;
            }
            if (run.length != page || src_pages.size() == kPagesPerOp) {
                flush();
                page = run.length;
            }
            src_pages.push_back(static_cast<uint32_t>(run.src_offset / page));
            dst_pages.push_back(static_cast<uint32_t>(run.dst_offset / page));
        }
        flush();
        if (!long_runs.empty()) {
            flight.add();
            WriteRunsOp op;
            op.peer = job.peer;
            op.src = pool_;
            op.dst = &job.reg.pool;
            op.runs = long_runs;
            op.imm = imm;
            writes += engine_->write_runs(op, cb).imm_writes();
        }
        return writes;
    }

    void on_segment_drained(uint64_t id, JobKey key, uint32_t index, const Status& s) {
        auto it = producers_.find(id);
        if (it == producers_.end()) return;
        auto jt = it->second.jobs.find(key);
        if (jt == it->second.jobs.end()) return;
        SendJob& job = jt->second;
        job.in_flight--;
        SegmentMsg seg = job.pending[index];
        job.pending.erase(index);
        if (!s.ok() && job.error.ok()) {
            job.error = s;
            log(LogLevel::kWarn, kLog,
                "transfer {:x} attempt {}: writing to decode rank {} failed: {}", id, key.first,
                key.second, s.to_string());
        }
        if (!job.cancelled && job.error.ok()) send(job.peer, seg);
        if (job.in_flight == 0) settle_job(id, it->second, key, job);
        maybe_finish(it);
    }

    void fail_job(uint64_t id, Producer& p, JobKey key, SendJob& job, const Status& s) {
        if (job.error.ok()) job.error = s;
        if (job.in_flight == 0) settle_job(id, p, key, job);
    }

    // A job with no write in flight: answer a cancel, report an error, or go on. May erase
    // the job (an older attempt's, once answered).
    void settle_job(uint64_t id, Producer& p, JobKey key, SendJob& job) {
        if (job.resolved) return;
        if (job.cancelled) {
            if (job.ack_wanted) send(job.peer, CancelAckMsg{id, key.first, cfg_.self.tp_rank});
            job.resolved = true;
            if (key.first < p.attempt) p.jobs.erase(key);
            return;
        }
        if (!job.error.ok()) {
            send(job.peer, FailMsg{id, key.first, cfg_.self.tp_rank, job.error.code(),
                                   job.error.message().substr(0, kMaxReasonLength)});
            job.resolved = true;
            return;
        }
        advance_job(id, p, key, job);
    }

    void on_cancel(uint64_t sender, const CancelMsg& m) {
        auto ack_to_sender = [&] {
            auto peer = engine_->find_peer(sender);
            if (peer) send(*peer, CancelAckMsg{m.transfer_id, m.attempt, cfg_.self.tp_rank});
        };
        auto it = producers_.find(m.transfer_id);
        if (it == producers_.end()) return ack_to_sender();
        Producer& p = it->second;
        JobKey key{m.attempt, m.decode_rank};
        auto jt = p.jobs.find(key);
        if (jt == p.jobs.end()) {
            ack_to_sender();
            auto in = p.intents.find(key);
            if (in != p.intents.end()) {
                // Announced, never registered: this attempt is the one prefill serves.
                if (!p.have_attempt || m.attempt > p.attempt) {
                    p.have_attempt = true;
                    p.attempt = m.attempt;
                    p.decode_tp = in->second.decode_tp;
                }
                p.intents.erase(in);
            }
            if (m.attempt >= p.attempt && p.have_attempt) {
                // Cancelled before this rank registered: remember it, so the transfer can
                // finish without waiting for a registration that will not come.
                SendJob& j = p.jobs[key];
                j.cancelled = j.resolved = true;
            }
            return maybe_finish(it);
        }
        SendJob& job = jt->second;
        if (job.in_flight > 0) {
            job.cancelled = true;
            job.ack_wanted = true;  // acknowledged when the last write completed
            return;
        }
        send(job.peer, CancelAckMsg{m.transfer_id, m.attempt, cfg_.self.tp_rank});
        if (!job.resolved || job.error.ok()) job.cancelled = true;
        job.resolved = true;
        if (m.attempt < p.attempt) p.jobs.erase(jt);
        maybe_finish(it);
    }

    // A transfer is finished on prefill once every decode rank of the current attempt was
    // served (FINAL, FAIL or cancelled) and no write of any attempt is in flight; after
    // prefill_failed, once no write is in flight.
    void maybe_finish(std::map<uint64_t, Producer>::iterator it) {
        Producer& p = it->second;
        if (p.tombstone) return;
        for (const auto& [key, job] : p.jobs) {
            if (job.in_flight > 0) return;
        }
        if (!p.failure.ok()) {
            p.jobs.clear();
            p.tombstone = true;  // kept until the lease, to answer late messages with FAIL
            transfers_failed_.fetch_add(1);
            if (p.released) return;  // abort_send reported it
            if (cb_.on_send_done) cb_.on_send_done({it->first, p.attempt, p.failure, 0, 0});
            return;
        }
        if (!p.have_prefill || !p.have_attempt) return;
        auto consumers = consumers_for_producer(cfg_.self.total_heads(), cfg_.self.tp_size,
                                                p.decode_tp, cfg_.self.tp_rank);
        size_t expected = consumers.ok() ? consumers->size() : 0;
        size_t served = 0;
        for (const auto& [key, job] : p.jobs) {
            if (key.first == p.attempt && job.resolved) ++served;
        }
        if (served < expected) return;
        TransferResult r{it->first, p.attempt, ok_status(), 0, 0};
        for (const auto& [key, job] : p.jobs) {
            if (key.first != p.attempt) continue;
            r.bytes += job.bytes;
            r.writes += job.writes;
            if (r.status.ok() && !job.error.ok()) r.status = job.error;
            if (r.status.ok() && job.cancelled) {
                r.status = cancelled(fmt::format("decode rank {} cancelled", key.second));
            }
        }
        complete_send(it, r);
    }

    void complete_send(std::map<uint64_t, Producer>::iterator it, const TransferResult& r) {
        (r.status.ok() ? transfers_sent_ : transfers_failed_).fetch_add(1);
        bool reported = it->second.released;  // abort_send released the blocks already
        if (it->second.have_prefill && !reported) active_send_.fetch_sub(1);
        producers_.erase(it);
        if (cb_.on_send_done && !reported) cb_.on_send_done(r);
    }

    // ---- push, decode side ----

    void on_announce(uint64_t id, uint32_t attempt, std::vector<EngineAddress> ranks) {
        auto report_now = [&](const Status& s) {
            if (cb_.on_scheduled) cb_.on_scheduled({id, attempt, s, 0, 0});
        };
        ConsumerKey key{id, attempt};
        if (announces_.count(key)) {
            return report_now(invalid_argument(
                fmt::format("transfer {:x} attempt {} is already announced", id, attempt)));
        }
        auto producers =
            producers_for_consumer(cfg_.self.total_heads(), static_cast<uint32_t>(ranks.size()),
                                   cfg_.self.tp_size, cfg_.self.tp_rank);
        if (!producers.ok()) return report_now(producers.status());
        Announce a;
        for (uint32_t rank : *producers) {
            auto peer = engine_->connect(ranks[rank]);
            if (!peer.ok()) {
                return report_now(
                    peer.status().with_context(fmt::format("connecting to prefill rank {}", rank)));
            }
            a.ranks.emplace_back(rank, *peer);
        }
        a.deadline = Clock::now() + cfg_.lease;
        for (const auto& [rank, peer] : a.ranks) {
            send(peer,
                 IntentMsg{id, attempt, cfg_.self.tp_rank, cfg_.self.tp_size, engine_->address()});
        }
        announces_.emplace(key, std::move(a));
    }

    void on_scheduled_msg(const ScheduledMsg& m) {
        auto it = announces_.find({m.transfer_id, m.attempt});
        if (it == announces_.end()) return stale("SCHEDULED for an unknown announcement");
        Announce& a = it->second;
        if (std::find(a.scheduled.begin(), a.scheduled.end(), m.producer_rank) ==
            a.scheduled.end()) {
            a.scheduled.push_back(m.producer_rank);
        }
        if (a.scheduled.size() < a.ranks.size()) return;
        announces_.erase(it);
        if (cb_.on_scheduled) cb_.on_scheduled({m.transfer_id, m.attempt, ok_status(), 0, 0});
    }

    // Ends an announcement that holds no blocks: prefill is told so it does not wait for a
    // registration that will not come.
    void end_announce(std::map<ConsumerKey, Announce>::iterator it, const Status& why,
                      bool tell_prefill) {
        ConsumerKey key = it->first;
        if (tell_prefill) {
            for (const auto& [rank, peer] : it->second.ranks) {
                send(peer, CancelMsg{key.first, key.second, cfg_.self.tp_rank});
            }
        }
        announces_.erase(it);
        if (cb_.on_scheduled) cb_.on_scheduled({key.first, key.second, why, 0, 0});
    }

    void on_register_push(PushRegistration reg) {
        auto report_now = [&](const Status& s) {
            transfers_failed_.fetch_add(1);
            if (cb_.on_recv_done) cb_.on_recv_done({reg.transfer_id, reg.attempt, s, 0, 0});
        };
        for (auto& [key, c] : consumers_) {
            if (key.first != reg.transfer_id) continue;
            if (key.second >= reg.attempt) {
                return report_now(invalid_argument(fmt::format(
                    "transfer {:x}: attempt {} is not newer than the registered attempt {}",
                    reg.transfer_id, reg.attempt, key.second)));
            }
            if (!c.cancelling) cancel_consumer(key, c);
        }
        uint32_t prefill_tp = static_cast<uint32_t>(reg.prefill_ranks.size());
        auto producers = producers_for_consumer(cfg_.self.total_heads(), prefill_tp,
                                                cfg_.self.tp_size, cfg_.self.tp_rank);
        if (!producers.ok()) return report_now(producers.status());
        uint32_t span = std::max<uint32_t>(1, std::min(cfg_.imm_span, cfg_.imm_count));
        Consumer c;
        for (uint32_t rank : *producers) {
            auto peer = engine_->connect(reg.prefill_ranks[rank]);
            if (!peer.ok()) {
                return report_now(
                    peer.status().with_context(fmt::format("connecting to prefill rank {}", rank)));
            }
            Slot s;
            s.rank = rank;
            s.peer = *peer;
            // A fresh span of immediates per (transfer, attempt, producer rank).
            s.imm = cfg_.imm_base + (next_imm_++ % (cfg_.imm_count / span)) * span;
            c.slots.push_back(s);
        }
        c.deadline = Clock::now() + cfg_.lease;
        c.awake = ArrivalsExpected(engine_);
        for (const Slot& s : c.slots) {
            RegisterMsg m;
            m.transfer_id = reg.transfer_id;
            m.attempt = reg.attempt;
            m.decode_rank = cfg_.self.tp_rank;
            m.decode_tp = cfg_.self.tp_size;
            m.imm = s.imm;
            m.imm_span = span;
            m.num_tokens = reg.num_tokens;
            m.lease_ms = to_ms_u32(cfg_.lease);
            m.decode_address = engine_->address();
            m.pool = pool_->descriptor();
            m.layout = cfg_.self.layout;
            m.blocks = reg.blocks;
            send(s.peer, m);
        }
        active_recv_.fetch_add(1);
        consumers_.emplace(ConsumerKey{reg.transfer_id, reg.attempt}, std::move(c));
    }

    void cancel_consumer(const ConsumerKey& key, Consumer& c) {
        c.cancelling = true;
        for (const Slot& s : c.slots) {
            // Complete slots need no ack: their FINAL already said every write landed.
            if (resolved(s.state)) continue;
            send(s.peer, CancelMsg{key.first, key.second, cfg_.self.tp_rank});
        }
    }

    void on_user_cancel(uint64_t id) {
        for (auto it = announces_.begin(); it != announces_.end(); ++it) {
            if (it->first.first == id) {
                return end_announce(it,
                                    cancelled(fmt::format("transfer {:x} was cancelled "
                                                          "before prefill scheduled it",
                                                          id)),
                                    true);
            }
        }
        for (auto it = consumers_.begin(); it != consumers_.end(); ++it) {
            if (it->first.first == id && !it->second.cancelling) {
                cancel_consumer(it->first, it->second);
                check_consumer(it);
                return;
            }
        }
        log(LogLevel::kDebug, kLog, "cancel: transfer {:x} is not registered here", id);
    }

    Slot* find_slot(const ConsumerKey& key, uint32_t producer_rank,
                    std::map<ConsumerKey, Consumer>::iterator* out) {
        auto it = consumers_.find(key);
        if (it == consumers_.end()) return nullptr;
        for (Slot& s : it->second.slots) {
            if (s.rank == producer_rank) {
                *out = it;
                return &s;
            }
        }
        return nullptr;
    }

    void on_segment(const SegmentMsg& m) {
        std::map<ConsumerKey, Consumer>::iterator it;
        Slot* s = find_slot({m.transfer_id, m.attempt}, m.producer_rank, &it);
        if (!s || resolved(s->state)) return stale("SEGMENT for an unknown or finished transfer");
        // Nothing to count for a transfer being cancelled: FINAL or CANCEL_ACK ends it.
        if (it->second.cancelling) return;
        uint32_t span = std::max<uint32_t>(1, std::min(cfg_.imm_span, cfg_.imm_count));
        if (m.index >= span) {
            return fail_slot(
                it, *s,
                protocol_error(fmt::format("prefill rank {} sent segment {} beyond the span of {}",
                                           m.producer_rank, m.index, span)));
        }
        if (m.writes == 0) return on_segment_counted(it->first, m.producer_rank, m, ok_status());
        Duration left = std::max<Duration>(it->second.deadline - Clock::now(), Duration::zero());
        std::weak_ptr<Inbox> inbox = inbox_;
        ConsumerKey key = it->first;
        engine_->on_imm(s->imm + m.index, m.writes, left, [this, inbox, key, m](const Status& st) {
            auto in = inbox.lock();
            if (in)
                in->post([this, key, m, st] { on_segment_counted(key, m.producer_rank, m, st); });
        });
    }

    void on_segment_counted(const ConsumerKey& key, uint32_t rank, const SegmentMsg& m,
                            const Status& st) {
        std::map<ConsumerKey, Consumer>::iterator it;
        Slot* s = find_slot(key, rank, &it);
        if (!s || resolved(s->state)) return;
        if (!st.ok()) {
            return fail_slot(it, *s,
                             st.with_context(fmt::format("counting {} writes of segment {} from "
                                                         "prefill rank {}",
                                                         m.writes, m.index, rank)));
        }
        s->counted++;
        const uint32_t layers = cfg_.self.layout.num_layers;
        if (m.end_layer == 0 || (m.first_layer == 0 && m.end_layer >= layers)) {
            s->landed[m.first_token] = m.end_token;
        } else {
            auto range = std::make_pair(m.first_token, m.end_token);
            std::vector<bool>& got = s->layers_landed[range];
            got.resize(layers);
            for (uint32_t l = m.first_layer; l < std::min(m.end_layer, layers); ++l) got[l] = true;
            if (std::find(got.begin(), got.end(), false) == got.end()) {
                s->layers_landed.erase(range);
                s->landed[m.first_token] = m.end_token;
            }
        }
        for (auto l = s->landed.find(s->prefix); l != s->landed.end();
             l = s->landed.find(s->prefix)) {
            s->prefix = std::max(s->prefix, l->second);
            s->landed.erase(l);
        }
        Consumer& c = it->second;
        KvFrontier now = landed_frontier(c);
        KvPiece ahead;
        if (!c.cancelling && next_piece(c.progress, now, layers, &ahead)) {
            c.progress = now;
            if (cb_.on_recv_progress)
                cb_.on_recv_progress(
                    {key.first, key.second, now.tokens, now.partial_end, now.partial_layers});
        }
        if (s->have_final && s->counted == s->final_segments) s->state = SlotState::kComplete;
        check_consumer(it);
    }

    // What landed on every producer's slot: whole tokens up to the smallest prefix, and the
    // layers every slot holds of the chunk after it (conservative where slots differ).
    KvFrontier landed_frontier(const Consumer& c) const {
        const uint32_t layers = cfg_.self.layout.num_layers;
        uint32_t tokens = UINT32_MAX;
        for (const Slot& s : c.slots) tokens = std::min(tokens, s.prefix);
        uint32_t end = UINT32_MAX, got = layers;
        for (const Slot& s : c.slots) {
            if (s.prefix > tokens) {
                end = std::min(end, s.prefix);
                continue;
            }
            auto l = s.layers_landed.lower_bound({s.prefix, 0});
            if (l == s.layers_landed.end() || l->first.first != s.prefix) return {tokens};
            uint32_t n = 0;
            while (n < layers && l->second[n]) ++n;
            end = std::min(end, l->first.second);
            got = std::min(got, n);
        }
        if (got == 0 || got >= layers || end == UINT32_MAX) return {tokens};
        return {tokens, end, got};
    }

    void fail_slot(std::map<ConsumerKey, Consumer>::iterator it, Slot& s, const Status& why) {
        s.state = SlotState::kFailed;
        Consumer& c = it->second;
        if (c.error.ok()) c.error = why;
        // Other producers may still be writing into these blocks: stop them and wait for
        // their acknowledgement before handing the blocks back.
        if (!c.cancelling) cancel_consumer(it->first, c);
        check_consumer(it);
    }

    void on_final(const FinalMsg& m) {
        std::map<ConsumerKey, Consumer>::iterator it;
        Slot* s = find_slot({m.transfer_id, m.attempt}, m.producer_rank, &it);
        if (!s || resolved(s->state) || s->have_final) {
            return stale("FINAL for an unknown, finished or superseded transfer");
        }
        Consumer& c = it->second;
        c.bytes += m.bytes;
        c.writes += m.writes;
        s->writes = m.writes;
        s->have_final = true;
        s->final_segments = m.segments;
        // FINAL is sent after every write completed at the producer, so even a cancelled
        // transfer needs no acknowledgement for this rank any more.
        if (m.segments <= s->counted || c.cancelling) s->state = SlotState::kComplete;
        check_consumer(it);
    }

    void on_fail(const FailMsg& m) {
        std::map<ConsumerKey, Consumer>::iterator it;
        Slot* s = find_slot({m.transfer_id, m.attempt}, m.sender_rank, &it);
        if (!s || resolved(s->state)) {
            auto a = announces_.find({m.transfer_id, m.attempt});
            if (a == announces_.end()) return stale("FAIL for an unknown or finished transfer");
            return end_announce(
                a, Status(m.code, fmt::format("prefill rank {}: {}", m.sender_rank, m.reason)),
                false);
        }
        fail_slot(it, *s,
                  Status(m.code, fmt::format("prefill rank {}: {}", m.sender_rank, m.reason)));
    }

    void on_cancel_ack(const CancelAckMsg& m) {
        std::map<ConsumerKey, Consumer>::iterator it;
        Slot* s = find_slot({m.transfer_id, m.attempt}, m.producer_rank, &it);
        if (!s || resolved(s->state)) return stale("CANCEL_ACK for an unknown or finished slot");
        s->state = SlotState::kAcked;
        check_consumer(it);
    }

    void check_consumer(std::map<ConsumerKey, Consumer>::iterator it) {
        Consumer& c = it->second;
        for (const Slot& s : c.slots) {
            if (!resolved(s.state)) return;
        }
        TransferResult r{it->first.first, it->first.second, c.error, c.bytes, c.writes};
        if (r.status.ok() && c.cancelling) {
            r.status =
                cancelled(fmt::format("transfer {:x} attempt {} was cancelled or "
                                      "superseded",
                                      r.transfer_id, r.attempt));
        }
        complete_recv(it, r);
    }

    void complete_recv(std::map<ConsumerKey, Consumer>::iterator it, const TransferResult& r) {
        (r.status.ok() ? transfers_received_ : transfers_failed_).fetch_add(1);
        active_recv_.fetch_sub(1);
        consumers_.erase(it);
        if (cb_.on_recv_done) cb_.on_recv_done(r);
    }

    // ---- pull ----

    void on_offer(uint64_t id, const PullCapability& capability) {
        auto [it, fresh] = offers_.try_emplace(id);
        if (!fresh) {
            log(LogLevel::kWarn, kLog, "transfer {:x}: offered for pull twice; ignored", id);
            return;
        }
        it->second.deadline = Clock::now() + cfg_.lease;
        it->second.capability = capability;
        it->second.awake = ArrivalsExpected(engine_);
        active_send_.fetch_add(1);
    }

    void on_done(const DoneMsg& m) {
        auto it = offers_.find(m.transfer_id);
        if (it == offers_.end()) return stale("DONE for an unknown or expired pull offer");
        Offer& o = it->second;
        // A DONE naming a transfer it was not offered must not free (or end) that transfer.
        if (!constant_time_equal(o.capability, m.capability)) {
            log(LogLevel::kWarn, kLog,
                "transfer {:x}: DONE with a wrong capability (not the reader it was offered "
                "to); ignored",
                m.transfer_id);
            return stale("DONE with a wrong capability");
        }
        if (std::find(o.done_ranks.begin(), o.done_ranks.end(), m.decode_rank) !=
            o.done_ranks.end()) {
            return stale("duplicate DONE");
        }
        o.done_ranks.push_back(m.decode_rank);
        o.all_ok = o.all_ok && m.ok;
        auto readers = consumers_for_producer(cfg_.self.total_heads(), cfg_.self.tp_size,
                                              m.decode_tp, cfg_.self.tp_rank);
        if (readers.ok() && o.done_ranks.size() < readers->size()) return;
        Status s = o.all_ok ? ok_status() : cancelled("a decode rank gave up reading");
        (s.ok() ? transfers_sent_ : transfers_failed_).fetch_add(1);
        active_send_.fetch_sub(1);
        offers_.erase(it);
        if (cb_.on_send_done) cb_.on_send_done({m.transfer_id, 0, s, 0, 0});
    }

    // Runs on the connector thread (background) or the caller's thread (inline); touches no
    // connector state, only the job, the engine and atomics.
    void start_pull(const std::shared_ptr<PullJob>& job) {
        auto fail = [&](const Status& s) { inbox_->post([this, job, s] { finish_pull(job, s); }); };
        const PullParamsMsg& any = job->params.front();
        auto producers = producers_for_consumer(cfg_.self.total_heads(), any.producer_tp,
                                                cfg_.self.tp_size, cfg_.self.tp_rank);
        if (!producers.ok()) return fail(producers.status());
        std::vector<std::pair<size_t, TransferPlan>> plans;
        for (uint32_t rank : *producers) {
            auto pit =
                std::find_if(job->params.begin(), job->params.end(),
                             [&](const PullParamsMsg& p) { return p.producer_rank == rank; });
            if (pit == job->params.end()) {
                return fail(invalid_argument(
                    fmt::format("pull: no transfer parameters from prefill rank {}", rank)));
            }
            size_t idx = static_cast<size_t>(pit - job->params.begin());
            auto peer = engine_->connect(pit->prefill_address);
            if (!peer.ok()) {
                return fail(
                    peer.status().with_context(fmt::format("connecting to prefill rank {}", rank)));
            }
            job->sources.push_back({*peer, idx});
            if (pit->num_tokens != job->tokens) {
                return fail(invalid_argument(
                    fmt::format("prefill rank {} offers {} tokens, decode expects {}", rank,
                                pit->num_tokens, job->tokens)));
            }
            auto plan = plan_transfer({KvRank{pit->layout, pit->producer_rank, pit->producer_tp},
                                       pit->blocks, cfg_.self, job->blocks, 0, job->tokens});
            if (!plan.ok()) return fail(plan.status());
            plans.emplace_back(idx, std::move(*plan));
        }
        auto flight = new_flight([this, job](const Status& s) { finish_pull(job, s); });
        for (size_t i = 0; i < plans.size(); ++i) {
            const auto& [idx, plan] = plans[i];
            // One operation per source: between GPUs one batched copy instead of one per run
            // (a 16k-token pull was 128 copies, 0.62 ms against push's 0.44).
            flight->add();
            ReadRunsOp op;
            op.peer = job->sources[i].peer;
            op.dst = pool_;
            op.src = &job->params[idx].pool;
            op.runs = plan.runs;
            engine_->read_runs(op, [flight](const Status& s) { flight->done(s); });
            job->reads += static_cast<uint32_t>(plan.runs.size());
            job->bytes += plan.bytes;
            ops_posted_.fetch_add(plan.runs.size());
            bytes_posted_.fetch_add(plan.bytes);
        }
        flight->done(ok_status());
    }

    void finish_pull(const std::shared_ptr<PullJob>& job, const Status& s) {
        for (const PullSource& src : job->sources) {
            send(src.peer, DoneMsg{job->id, cfg_.self.tp_rank, cfg_.self.tp_size, s.ok(),
                                   job->params[src.param].capability});
        }
        (s.ok() ? transfers_received_ : transfers_failed_).fetch_add(1);
        active_recv_.fetch_sub(1);
        if (cb_.on_recv_done) cb_.on_recv_done({job->id, 0, s, job->bytes, job->reads});
    }

    // ---- leases and shutdown ----

    void check_leases(TimePoint now) {
        for (auto it = producers_.begin(); it != producers_.end();) {
            auto next = std::next(it);
            Producer& p = it->second;
            if (now > p.deadline) expire_producer(it);
            it = next;
        }
        for (auto it = consumers_.begin(); it != consumers_.end();) {
            auto next = std::next(it);
            if (now > it->second.deadline) expire_consumer(it);
            it = next;
        }
        for (auto it = announces_.begin(); it != announces_.end();) {
            auto next = std::next(it);
            if (now > it->second.deadline) {
                leases_expired_.fetch_add(1);
                end_announce(it,
                             timeout_error(fmt::format("prefill did not schedule transfer {:x} "
                                                       "within the {:.0f} ms lease",
                                                       it->first.first, to_ms(cfg_.lease))),
                             true);
            }
            it = next;
        }
        for (auto it = offers_.begin(); it != offers_.end();) {
            auto next = std::next(it);
            if (now > it->second.deadline) {
                leases_expired_.fetch_add(1);
                transfers_failed_.fetch_add(1);
                active_send_.fetch_sub(1);
                uint64_t id = it->first;
                offers_.erase(it);
                log(LogLevel::kWarn, kLog, "transfer {:x}: pull offer lease expired", id);
                if (cb_.on_send_done) {
                    cb_.on_send_done({id, 0,
                                      timeout_error("no DONE from decode within the "
                                                    "lease; blocks released"),
                                      0, 0});
                }
            }
            it = next;
        }
    }

    void expire_producer(std::map<uint64_t, Producer>::iterator it) {
        Producer& p = it->second;
        if (p.tombstone) {
            producers_.erase(it);
            return;
        }
        for (const auto& [key, job] : p.jobs) {
            // Writes in flight end by the engine's op_timeout; the drain finishes the job.
            if (job.in_flight > 0) return;
        }
        leases_expired_.fetch_add(1);
        Status why = p.have_prefill
                         ? timeout_error(fmt::format(
                               "no registration from every decode rank within the {:.0f} ms "
                               "lease; blocks released",
                               to_ms(cfg_.lease)))
                         : timeout_error(fmt::format("prefill did not finish within the {:.0f} "
                                                     "ms lease",
                                                     to_ms(cfg_.lease)));
        log(LogLevel::kWarn, kLog, "transfer {:x}: {}", it->first, why.message());
        for (auto& [key, job] : p.jobs) {
            if (job.resolved) continue;
            send(job.peer,
                 FailMsg{it->first, key.first, cfg_.self.tp_rank, why.code(), why.message()});
            job.resolved = true;
        }
        for (const auto& [key, intent] : p.intents) {
            send(intent.peer,
                 FailMsg{it->first, key.first, cfg_.self.tp_rank, why.code(), why.message()});
        }
        if (!p.have_prefill) {
            producers_.erase(it);  // no blocks of the engine's are held
            return;
        }
        TransferResult r{it->first, p.attempt, why, 0, 0};
        complete_send(it, r);
    }

    void expire_consumer(std::map<ConsumerKey, Consumer>::iterator it) {
        Consumer& c = it->second;
        leases_expired_.fetch_add(1);
        std::string missing;
        for (const Slot& s : c.slots) {
            if (resolved(s.state)) continue;
            missing += fmt::format("{}{}", missing.empty() ? "" : ",", s.rank);
            send(s.peer, CancelMsg{it->first.first, it->first.second, cfg_.self.tp_rank});
        }
        Status why = timeout_error(fmt::format(
            "prefill ranks {} did not complete transfer {:x} within the {:.0f} ms lease", missing,
            it->first.first, to_ms(cfg_.lease)));
        log(LogLevel::kWarn, kLog, "{}", why.message());
        complete_recv(it, {it->first.first, it->first.second, c.error.ok() ? why : c.error, c.bytes,
                           c.writes});
    }

    void begin_shutdown() {
        stopping_ = true;
        shutdown_deadline_ = Clock::now() + engine_->config().op_timeout + std::chrono::seconds(1);
        for (auto& [id, p] : producers_) {
            for (auto& [key, job] : p.jobs) job.cancelled = true;
        }
        for (auto& [key, c] : consumers_) {
            if (!c.cancelling) cancel_consumer(key, c);
        }
    }

    void report_all_as_shut_down() {
        Status s = cancelled("the KV connector was shut down");
        while (!producers_.empty()) {
            auto it = producers_.begin();
            if (!it->second.have_prefill || it->second.tombstone) {
                producers_.erase(it);
                continue;
            }
            complete_send(it, {it->first, it->second.attempt, s, 0, 0});
        }
        while (!consumers_.empty()) {
            auto it = consumers_.begin();
            complete_recv(it, {it->first.first, it->first.second, s, 0, 0});
        }
        while (!announces_.empty()) end_announce(announces_.begin(), s, false);
        while (!offers_.empty()) {
            auto it = offers_.begin();
            uint64_t id = it->first;
            offers_.erase(it);
            transfers_failed_.fetch_add(1);
            active_send_.fetch_sub(1);
            if (cb_.on_send_done) cb_.on_send_done({id, 0, s, 0, 0});
        }
    }

    TransferEngine* engine_;
    const MemoryRegion* pool_;
    ConnectorConfig cfg_;
    ConnectorCallbacks cb_;
    std::shared_ptr<Inbox> inbox_;
    std::thread thread_;

    std::map<uint64_t, Producer> producers_;
    std::map<ConsumerKey, Consumer> consumers_;
    std::map<ConsumerKey, Announce> announces_;
    std::map<uint64_t, Offer> offers_;
    uint32_t next_imm_ = 0;
    bool stopping_ = false;
    TimePoint shutdown_deadline_;

    std::atomic<uint64_t> flights_open_{0};
    std::atomic<uint64_t> messages_received_{0}, messages_malformed_{0}, messages_stale_{0};
    std::atomic<uint64_t> leases_expired_{0}, transfers_sent_{0}, transfers_received_{0};
    std::atomic<uint64_t> transfers_failed_{0}, ops_posted_{0}, bytes_posted_{0};
    std::atomic<uint64_t> active_send_{0}, active_recv_{0};
};

Result<std::unique_ptr<KvConnector>> KvConnector::create(TransferEngine* engine,
                                                         const MemoryRegion* pool,
                                                         const ConnectorConfig& config,
                                                         ConnectorCallbacks callbacks) {
    if (!engine || !pool) return invalid_argument("KvConnector needs an engine and a pool");
    FERRY_RETURN_IF_ERROR(config.self.layout.validate());
    if (config.self.tp_size == 0 || config.self.tp_rank >= config.self.tp_size) {
        return invalid_argument(fmt::format("TP rank {} is outside TP size {}", config.self.tp_rank,
                                            config.self.tp_size));
    }
    if (pool->size() < config.self.layout.pool_bytes()) {
        return invalid_argument(
            fmt::format("the registered pool has {} bytes, the layout {} needs {}", pool->size(),
                        config.self.layout.to_string(), config.self.layout.pool_bytes()));
    }
    if (config.imm_count == 0) return invalid_argument("imm_count must be positive");
    if (config.lease <= Duration::zero()) return invalid_argument("the lease must be positive");
    auto impl = std::make_unique<Impl>(engine, pool, config, std::move(callbacks));
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
Status KvConnector::abort_send(uint64_t id, Status reason) {
    return impl_->abort_send(id, reason);
}
Result<PullParamsMsg> KvConnector::offer_pull(uint64_t id, std::vector<uint32_t> blocks,
                                              uint32_t tokens) {
    return impl_->offer_pull(id, std::move(blocks), tokens);
}
Status KvConnector::pull(uint64_t id, std::vector<PullParamsMsg> params,
                         std::vector<uint32_t> blocks, uint32_t tokens) {
    return impl_->pull(id, std::move(params), std::move(blocks), tokens);
}
ConnectorStats KvConnector::stats() const { return impl_->stats(); }
const ConnectorConfig& KvConnector::config() const { return impl_->config(); }

}  // namespace ferry::kv
