#include "serve/engine.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/enum_names.h"
#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"
#include "ferry/kv/block_mapping.h"
#include "ferry/kv/kv_frontier.h"
#include "serve/kv_params_auth.h"

namespace ferry::serve {

// ---- RequestHandle -----------------------------------------------------------------------------

Result<RequestHandle::Event> RequestHandle::next(TimePoint deadline) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return !tokens_.empty() || finished_; }))
        return timeout_error(fmt::format("request {}: no token before the deadline", id_));
    if (!tokens_.empty()) {
        Event e{.finished = false, .token = tokens_.front()};
        tokens_.pop_front();
        return e;
    }
    return Event{.finished = true};
}

void RequestHandle::cancel() {
    if (!cancelled_.exchange(true) && on_cancel_) on_cancel_();
}

Status RequestHandle::status() const {
    std::lock_guard lock(mu_);
    return status_;
}

KvTransferParams RequestHandle::kv_out() const {
    std::lock_guard lock(mu_);
    return kv_out_;
}

RequestTiming RequestHandle::timing() const {
    std::lock_guard lock(mu_);
    return timing_;
}

void RequestHandle::push(int32_t token, TimePoint at) {
    {
        std::lock_guard lock(mu_);
        if (finished_) return;
        if (timing_.first_token == TimePoint{}) timing_.first_token = at;
        tokens_.push_back(token);
    }
    cv_.notify_all();
}

void RequestHandle::finish(Status status, KvTransferParams kv_out, TimePoint at) {
    {
        std::lock_guard lock(mu_);
        if (finished_) return;
        finished_ = true;
        status_ = std::move(status);
        kv_out_ = std::move(kv_out);
        timing_.finished = at;
    }
    cv_.notify_all();
}

// ---- Engine internals --------------------------------------------------------------------------

// Where a request is in this engine: each is in requests_, in exactly one stage, until
// retire() gives its blocks back and forgets it (docs/ARCHITECTURE.md draws the same).
//
//   push decode leg: kAwaitingPrefill --(prefill scheduled it)--.
//                                                                v
//   other requests: ------------------------------------> kWaiting
//                                                  (blocks) /      \ (blocks, decode leg)
//                                                          v        v
//                    kHeldByConnector <--(prefill leg)-- kRunning <--(KV in)-- kAwaitingKv
//                                                                                  |
//                                                    kDraining <--(answered: cancel, timeout)
//
// Any stage retires once nothing uses its blocks: kHeldByConnector when the connector releases
// them, kDraining when the connector confirmed and no digest job reads them, the others when
// the client is answered.
enum class Engine::Stage {
    // Queued, FIFO, for blocks and a place in the batch.
    kWaiting,
    // A push decode leg until prefill scheduled its transfer; holds no blocks.
    kAwaitingPrefill,
    // A decode leg with blocks: the connector fills them, digested as they land.
    kAwaitingKv,
    // Prefilling (chunk by chunk) or decoding.
    kRunning,
    // A prefill leg answered (or aborted): the connector still reads its blocks.
    kHeldByConnector,
    // A decode leg answered early: the connector or a digest job still uses its blocks.
    kDraining,
};

std::string_view Engine::stage_name(Stage stage) {
    static constexpr EnumName<Stage> kNames[] = {
        {Stage::kWaiting, "waiting"},
        {Stage::kAwaitingPrefill, "awaiting prefill"},
        {Stage::kAwaitingKv, "awaiting KV"},
        {Stage::kRunning, "running"},
        {Stage::kHeldByConnector, "held by the connector"},
        {Stage::kDraining, "draining"},
    };
    return name_of(kNames, stage);
}

struct Engine::Seq {
    RequestId id;
    GenerateRequest req;
    std::shared_ptr<RequestHandle> handle;
    Stage stage = Stage::kWaiting;
    uint64_t order = 0;  // when it entered its stage: FIFO within the stage
    // kAwaitingPrefill, kAwaitingKv: when the KV wait (kv_wait_timeout) of the stage ends.
    TimePoint deadline{};
    // The block table BlockPool gave at admission; retire() gives the blocks back.
    std::vector<BlockId> blocks;
    std::optional<DecodeStream> stream;
    size_t generated = 0;
    // A transfer's start: a decode leg's blocks allocated, a prefill leg's handed over.
    TimePoint kv_start{};
    // Prompt tokens whose KV this engine holds: computed here (prefill) or received and
    // digested (decode leg); and their digest terms.
    size_t computed = 0;
    uint64_t kv_terms = 0;
    size_t handovers = 0;  // prefill leg: on_prefill_progress calls so far
    // Decode leg.
    kv::KvFrontier kv_landed;  // what the connector reported in place
    // Of the chunk [computed, digested_end) after `computed`: layers [0, digested_layers) are
    // digested (a chunk pushed layer by layer).
    uint32_t digested_end = 0;
    uint32_t digested_layers = 0;
    bool kv_closed = false;       // the connector gave the blocks back (`arrived` came)
    bool digest_running = false;  // a digest job reads the blocks
    // kHeldByConnector: the connector was told to give the transfer up.
    bool abort_sent = false;

    bool prefilled() const { return computed >= req.prompt.size(); }
    // The id the connector knows this leg by (kv_connector.h): its transfer_id, or, for a
    // prefill leg that came without one (pull), the request id, which on_prefill_done's answer
    // then carries to the decode leg as its transfer_id.
    const std::string& transfer() const {
        return req.kv.transfer_id.empty() && req.kv.do_remote_decode ? id : req.kv.transfer_id;
    }
    // The client has its answer (finish() was called).
    bool answered() const { return handle->finished(); }

    void mark(TimePoint RequestTiming::*field, TimePoint t) {
        std::lock_guard lock(handle->mu_);
        handle->timing_.*field = t;
    }
};

enum class Engine::InboxKind {
    kNew,
    kCancel,
    kCancelTransfer,
    kScheduled,
    kKvProgress,
    kKvArrived,
    kReleased,
    kDigested
};

struct Engine::InboxEvent {
    InboxKind kind = InboxKind::kNew;
    RequestId id{};
    std::string transfer{};  // kCancelTransfer: the legs' id, as the connector knows them
    Status status{};
    std::unique_ptr<Seq> seq{};
    kv::KvFrontier ready{};  // kKvProgress: in place; kDigested: digested up to
    uint64_t terms = 0;      // kDigested: digest terms of the pieces
};

// Events reach the loop through here. Shared with connector callbacks, so a callback that fires
// after the engine is gone finds a closed inbox instead of a dangling engine.
struct Engine::Inbox {
    using Kind = InboxKind;
    using Event = InboxEvent;
    // Digest of pieces (prompt positions x layers) of a decode leg's blocks.
    struct DigestJob {
        RequestId id;
        std::vector<BlockId> blocks;
        std::vector<kv::KvPiece> pieces;
        kv::KvFrontier upto;  // digested once the pieces are
    };

    std::mutex mu;
    std::condition_variable cv;
    std::deque<Event> events;
    std::deque<DigestJob> digest_jobs;
    std::condition_variable digest_cv;
    bool closed = false;

    void post(Event e) {
        {
            std::lock_guard lock(mu);
            if (closed) return;
            events.push_back(std::move(e));
        }
        cv.notify_all();
    }
};

// Errors name EngineConfig's fields, and KvPool's name num_blocks (the CLI puts its flags in
// their place: serve_engine.cc).
Result<std::unique_ptr<Engine>> Engine::create(EngineConfig config, CostModel cost) {
    if (config.max_num_seqs == 0 || config.max_num_seqs > kMaxNumSeqs)
        return invalid_argument(fmt::format("max_num_seqs must be in [1, {}], got {}", kMaxNumSeqs,
                                            config.max_num_seqs));
    if (config.max_model_len == 0) return invalid_argument("max_model_len must be at least 1");
    // Token counts become 32-bit block math (kv::blocks_for_tokens): a larger limit would let a
    // request's block count wrap and pass the pool check.
    if (config.max_model_len > size_t(INT32_MAX))
        return invalid_argument(fmt::format("max_model_len {} is above the limit of {} tokens",
                                            config.max_model_len, INT32_MAX));
    // 0 admitted one prompt per step, whatever its length, as if there were no budget.
    if (config.max_num_batched_tokens == 0)
        return invalid_argument("max_num_batched_tokens must be at least 1, got 0");
    // 0 was taken as 1; a count above the model's layers means one group per layer.
    if (config.push_layer_groups < 1)
        return invalid_argument(fmt::format(
            "push_layer_groups must be at least 1 (1: each chunk whole after its step; at "
            "most one group per layer, {} for {}), got {}",
            cost.model().layers, cost.model().name, config.push_layer_groups));
    if (config.time_scale < 0) return invalid_argument("time_scale must not be negative");
    // 0 or less failed every decode leg as it arrived.
    if (config.kv_wait_timeout <= Duration::zero())
        return invalid_argument(fmt::format("kv_wait_timeout must be positive, got {} ms",
                                            to_ms(config.kv_wait_timeout)));
    if (config.engine_id.empty()) return invalid_argument("engine_id must not be empty");
    if (config.block_size < 1) return invalid_argument("block_size must be at least 1");
    // A chunk below a block computed a fraction of a block per step: push then sent a write per
    // layer for every partial block, and a prompt took a step per few tokens.
    if (config.prefill_chunk_tokens > 0 && config.prefill_chunk_tokens < size_t(config.block_size))
        return invalid_argument(fmt::format(
            "prefill_chunk_tokens {} is below block_size {}: a chunk is at least one block (or 0: "
            "whole prompts)",
            config.prefill_chunk_tokens, config.block_size));
    if (config.num_blocks == 0 || config.num_blocks > UINT32_MAX)
        return invalid_argument(
            fmt::format("num_blocks {} is outside [1, 2^32)", config.num_blocks));
    kv::KvLayout layout = cost.kv_layout(uint32_t(config.block_size), uint32_t(config.num_blocks));
    if (config.head_offset < 0 ||
        config.head_offset + int(layout.num_kv_heads) > cost.model().kv_heads)
        return invalid_argument(fmt::format("head_offset {} leaves the model's {} KV heads",
                                            config.head_offset, cost.model().kv_heads));
    FERRY_ASSIGN_OR_RETURN(auto pool, KvPool::create(layout));
    return std::unique_ptr<Engine>(new Engine(std::move(config), std::move(cost), std::move(pool)));
}

Engine::Engine(EngineConfig config, CostModel cost, std::unique_ptr<KvPool> pool)
    : config_(std::move(config)),
      cost_(std::move(cost)),
      pool_(std::move(pool)),
      blocks_(uint32_t(config_.num_blocks)),
      inbox_(std::make_shared<Inbox>()) {
    slice_.layout = pool_->layout();
    slice_.head_offset = config_.head_offset;
    slice_.vocab = cost_.model().vocab;
}

Engine::~Engine() { stop(); }

void Engine::attach_connector(KvProducer* producer, KvConsumer* consumer) {
    producer_ = producer;
    consumer_ = consumer;
    if (producer_ == nullptr) return;
    // As abort_transfer, through the inbox: the connector may call after the engine is gone.
    std::weak_ptr<Inbox> weak = inbox_;
    producer_->on_consumer_gave_up([weak](const std::string& transfer_id, const Status& why) {
        if (auto inbox = weak.lock())
            inbox->post(Inbox::Event{.kind = Inbox::Kind::kCancelTransfer,
                                     .transfer = transfer_id,
                                     .status = cancelled(why.message())});
    });
}

Status Engine::start() {
    if (running_.exchange(true)) return invalid_argument("engine already started");
    loop_thread_ = std::thread([this] {
        set_thread_name("ferry-step");
        loop();
    });
    digest_thread_ = std::thread([this] {
        set_thread_name("ferry-digest");
        digest_worker();
    });
    return ok_status();
}

void Engine::stop() {
    if (!running_.exchange(false)) return;
    inbox_->cv.notify_all();
    inbox_->digest_cv.notify_all();
    if (loop_thread_.joinable()) loop_thread_.join();
    if (digest_thread_.joinable()) digest_thread_.join();
}

size_t Engine::blocks_needed(const GenerateRequest& r) const {
    // Room for the prompt and every generated token but the last (whose KV is never written).
    // Reserved up front: with no preemption, a running request can never run out of blocks.
    size_t tokens = r.kv.do_remote_decode ? r.prompt.size()
                                          : r.prompt.size() + std::max<size_t>(r.max_tokens, 1) - 1;
    return kv::blocks_for_tokens(uint32_t(tokens), uint32_t(config_.block_size));
}

Result<std::shared_ptr<RequestHandle>> Engine::submit(GenerateRequest r) {
    if (!running_) return unavailable("engine is not running");
    if (r.prompt.empty()) return invalid_argument("prompt is empty");
    if (r.max_tokens == 0) return invalid_argument("max_tokens must be at least 1");
    // A prefill leg produces exactly one token, as vLLM's disaggregated proxy asks of it.
    if (r.kv.do_remote_decode) r.max_tokens = 1;
    if (r.kv.do_remote_decode && r.kv.do_remote_prefill)
        return invalid_argument("do_remote_decode and do_remote_prefill are exclusive");
    if (r.prompt.size() + r.max_tokens > config_.max_model_len)
        return invalid_argument(
            fmt::format("prompt ({} tokens) plus max_tokens ({}) exceeds max_model_len {}",
                        r.prompt.size(), r.max_tokens, config_.max_model_len));
    for (int32_t t : r.prompt)
        if (t < 0 || t >= slice_.vocab)
            return invalid_argument(
                fmt::format("token id {} outside the vocabulary [0, {})", t, slice_.vocab));
    if (blocks_needed(r) > config_.num_blocks)
        return invalid_argument(fmt::format("request needs {} KV blocks, the pool has {}",
                                            blocks_needed(r), config_.num_blocks));
    if (r.kv.do_remote_decode && producer_ == nullptr)
        return unavailable("do_remote_decode: this engine has no KV connector to send KV with");
    if (r.kv.do_remote_prefill && consumer_ == nullptr)
        return unavailable("do_remote_prefill: this engine has no KV connector to receive KV");
    if (r.kv.do_remote_prefill && r.kv.transfer_id.empty() && r.kv.remote_block_ids.empty())
        return invalid_argument(
            "do_remote_prefill needs transfer_id (push) or "
            "remote_block_ids (pull) in kv_transfer_params");
    // What the leg's tag binds (kv_params_auth.h): this prompt and max_tokens, sent here.
    if (!r.kv.empty())
        r.kv.content =
            leg_content_digest({prompt_digest(r.prompt), r.max_tokens, config_.engine_id});
    // Before anything is queued: a leg the connector refuses costs no block and no connection.
    if (r.kv.do_remote_decode) FERRY_RETURN_IF_ERROR(producer_->authorize(r.kv));
    if (r.kv.do_remote_prefill) FERRY_RETURN_IF_ERROR(consumer_->authorize(r.kv));

    auto seq = std::make_unique<Seq>();
    seq->id = fmt::format("{}-{}", config_.engine_id, next_id_++);
    std::weak_ptr<Inbox> weak = inbox_;
    RequestId id = seq->id;
    seq->handle =
        std::shared_ptr<RequestHandle>(new RequestHandle(seq->id, r.prompt.size(), [weak, id] {
            if (auto in = weak.lock())
                in->post(Inbox::Event{.kind = Inbox::Kind::kCancel, .id = id});
        }));
    seq->req = std::move(r);
    seq->mark(&RequestTiming::arrived, Clock::now());
    auto handle = seq->handle;
    {
        std::lock_guard lock(stats_mu_);
        counters_.requests_total++;
        counters_.prompt_tokens += seq->req.prompt.size();
    }
    inbox_->post(Inbox::Event{.kind = Inbox::Kind::kNew, .seq = std::move(seq)});
    return handle;
}

void Engine::finish(Seq& seq, Status status, KvTransferParams kv_out) {
    if (seq.answered()) return;
    if (!status.ok()) {
        std::lock_guard lock(stats_mu_);
        counters_.requests_failed++;
        log(LogLevel::kInfo, "engine", "{}: request {} failed ({}): {}", config_.engine_id, seq.id,
            stage_name(seq.stage), status.to_string());
    }
    seq.handle->finish(std::move(status), std::move(kv_out), Clock::now());
}

Engine::Seq* Engine::find(const RequestId& id) {
    auto it = requests_.find(id);
    return it == requests_.end() ? nullptr : it->second.get();
}

void Engine::enter(Seq& seq, Stage stage) {
    seq.stage = stage;
    seq.order = next_order_++;
}

std::vector<Engine::Seq*> Engine::in_stage(Stage stage) const {
    std::vector<Seq*> out;
    for (const auto& [id, s] : requests_)
        if (s->stage == stage) out.push_back(s.get());
    std::sort(out.begin(), out.end(), [](Seq* a, Seq* b) { return a->order < b->order; });
    return out;
}

// The one place a request's blocks go back to the pool, and the request leaves the engine:
// called once neither the client's request, the connector nor a digest job uses them.
void Engine::retire(RequestId id) {
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    if (!it->second->blocks.empty()) (void)blocks_.free_owner(id);
    requests_.erase(it);
}

void Engine::drain(Seq& seq, const Status& why) {
    finish(seq, why);
    enter(seq, Stage::kDraining);
    // The client heard; the blocks stay until the connector confirms it stopped.
    if (!seq.kv_closed) consumer_->cancel(seq.transfer());
}

void Engine::hold(Seq& seq) {
    seq.kv_start = Clock::now();
    enter(seq, Stage::kHeldByConnector);
}

bool Engine::sleep_until(TimePoint t) {
    // A decode leg's KV that lands while a step runs is digested meanwhile, and its arrival
    // taken when it comes: waiting for the step's end cost up to a step (3.7 ms) per hand-off
    // between the connector, this loop and the digest thread. Those events touch only legs
    // waiting for KV, never the batch of the running step; every other event waits.
    auto is_kv = [](const Inbox::Event& e) {
        return e.kind == Inbox::Kind::kKvProgress || e.kind == Inbox::Kind::kKvArrived ||
               e.kind == Inbox::Kind::kDigested;
    };
    while (true) {
        std::deque<Inbox::Event> kv_events;
        {
            std::unique_lock lock(inbox_->mu);
            inbox_->cv.wait_until(lock, t, [&] {
                return !running_ ||
                       std::any_of(inbox_->events.begin(), inbox_->events.end(), is_kv);
            });
            if (!running_) return false;
            for (auto it = inbox_->events.begin(); it != inbox_->events.end();) {
                if (is_kv(*it)) {
                    kv_events.push_back(std::move(*it));
                    it = inbox_->events.erase(it);
                } else {
                    ++it;
                }
            }
        }
        if (kv_events.empty()) return true;  // the deadline passed
        for (auto& e : kv_events) handle(e);
    }
}

void Engine::loop() {
    while (running_) {
        drain_inbox();
        expire_kv_waits();
        std::vector<Seq*> prefill_batch;
        admit(prefill_batch);
        std::vector<StepChunk> step = plan_prefill_step();
        if (!step.empty()) {
            run_prefill(step);
        } else if (std::any_of(requests_.begin(), requests_.end(), [](const auto& r) {
                       return r.second->stage == Stage::kRunning && r.second->prefilled();
                   })) {
            run_decode();
        } else {
            TimePoint wake = Clock::now() + milliseconds(100);
            for (const auto& [id, s] : requests_)
                if (s->stage == Stage::kAwaitingPrefill ||
                    (s->stage == Stage::kAwaitingKv && !s->kv_closed))
                    wake = std::min(wake, s->deadline);
            std::unique_lock lock(inbox_->mu);
            inbox_->cv.wait_until(lock, wake, [&] { return !inbox_->events.empty() || !running_; });
        }
        publish_gauges();
    }
    {
        std::lock_guard lock(inbox_->mu);
        inbox_->closed = true;
    }
    drain_inbox();
    fail_all(cancelled(fmt::format("engine {} is shutting down", config_.engine_id)));
    publish_gauges();
}

void Engine::drain_inbox() {
    std::deque<Inbox::Event> events;
    {
        std::lock_guard lock(inbox_->mu);
        events.swap(inbox_->events);
    }
    for (auto& e : events) handle(e);
}

void Engine::handle(InboxEvent& e) {
    switch (e.kind) {
        case Inbox::Kind::kNew:
            accept(std::move(e.seq));
            break;
        case Inbox::Kind::kScheduled: {
            Seq* s = find(e.id);
            if (s == nullptr || s->stage != Stage::kAwaitingPrefill) break;  // ended meanwhile
            if (!e.status.ok()) {
                finish(*s, e.status.with_context(
                               fmt::format("waiting for the prefill engine to schedule transfer {}",
                                           s->req.kv.transfer_id)));
                retire(e.id);
                break;
            }
            s->mark(&RequestTiming::remote_scheduled, Clock::now());
            enter(*s, Stage::kWaiting);
            break;
        }
        case Inbox::Kind::kKvProgress: {
            Seq* s = find(e.id);
            if (s == nullptr) break;
            kv::KvPiece ahead;
            if (s->stage == Stage::kAwaitingKv && !s->kv_closed &&
                kv::next_piece(s->kv_landed, e.ready, slice_.layout.num_layers, &ahead))
                s->kv_landed = e.ready;
            advance_kv(e.id);
            break;
        }
        case Inbox::Kind::kCancel:
            cancel_seq(e.id, cancelled(fmt::format("request {} cancelled by the client", e.id)));
            break;
        case Inbox::Kind::kCancelTransfer:
            cancel_transfer(e.transfer, e.status);
            break;
        case Inbox::Kind::kKvArrived:
            on_kv_arrived(e.id, e.status);
            break;
        case Inbox::Kind::kDigested: {
            Seq* s = find(e.id);
            if (s == nullptr || !s->digest_running) break;
            s->digest_running = false;
            if (s->stage == Stage::kAwaitingKv) {
                s->kv_terms += e.terms;
                s->computed = e.ready.tokens;
                s->digested_end = e.ready.partial_end;
                s->digested_layers = e.ready.partial_layers;
            }
            advance_kv(e.id);
            break;
        }
        case Inbox::Kind::kReleased: {
            Seq* s = find(e.id);
            if (s == nullptr || s->stage != Stage::kHeldByConnector) break;
            {
                std::lock_guard lock(stats_mu_);
                if (e.status.ok()) {
                    // An aborted prefill leg moved nothing.
                    counters_.kv_transfers++;
                    if (s->prefilled())
                        counters_.kv_transfer_bytes +=
                            uint64_t(kv::blocks_for_tokens(uint32_t(s->req.prompt.size()),
                                                           slice_.layout.block_size)) *
                            pool_->block_bytes();
                    transfer_latency_.observe(to_ms(Clock::now() - s->kv_start) / 1000.0);
                } else {
                    counters_.kv_transfer_failures++;
                    log(LogLevel::kWarn, "engine", "{}: KV hand-over of {} failed: {}",
                        config_.engine_id, e.id, e.status.to_string());
                }
            }
            retire(e.id);
            break;
        }
    }
}

void Engine::accept(std::unique_ptr<Seq> owned) {
    Seq& s = *owned;
    // An abort may overtake its request (they travel on different connections).
    auto a = s.req.kv.transfer_id.empty() ? aborted_.end() : aborted_.find(s.req.kv.transfer_id);
    if (a != aborted_.end()) {
        finish(s, cancelled(fmt::format("transfer {} was aborted", a->first)));
        return;
    }
    const RequestId id = s.id;
    requests_[id] = std::move(owned);
    if (!s.req.kv.do_remote_prefill || !s.req.kv.remote_block_ids.empty()) {
        enter(s, Stage::kWaiting);
        return;
    }
    // A push decode leg reserves blocks only once prefill scheduled the transfer: until then
    // they would sit idle while the request queues at prefill.
    enter(s, Stage::kAwaitingPrefill);
    s.deadline = Clock::now() + config_.kv_wait_timeout;
    std::weak_ptr<Inbox> weak = inbox_;
    Status st =
        consumer_->await_prefill_scheduled(s.transfer(), s.req.kv, [weak, id](Status scheduled) {
            if (auto in = weak.lock())
                in->post(Inbox::Event{
                    .kind = Inbox::Kind::kScheduled, .id = id, .status = std::move(scheduled)});
        });
    if (!st.ok()) {
        finish(s, st.with_context("KV connector refused the request"));
        retire(id);
    }
}

void Engine::cancel_transfer(const std::string& transfer_id, const Status& reason) {
    TimePoint now = Clock::now();
    std::erase_if(aborted_, [&](auto& kv) { return kv.second < now; });
    aborted_[transfer_id] = now + seconds(60);
    Status why = cancelled(fmt::format("transfer {} aborted: {}", transfer_id, reason.message()));
    // Legs of this transfer not answered yet, wherever they are; normally exactly one.
    std::vector<RequestId> ids;
    for (const auto& [id, s] : requests_)
        if (s->transfer() == transfer_id && s->stage != Stage::kHeldByConnector &&
            s->stage != Stage::kDraining)
            ids.push_back(id);
    for (const auto& id : ids) cancel_seq(id, why);
    // Prefill legs already handed over: the connector holds their blocks for decode (push:
    // writes; pull: the offer's lease) and must let them go now.
    for (auto& [id, s] : requests_) {
        if (s->stage != Stage::kHeldByConnector || s->abort_sent || s->transfer() != transfer_id)
            continue;
        s->abort_sent = true;
        producer_->on_transfer_aborted(s->transfer(), s->req.kv, why);
    }
}

void Engine::cancel_seq(const RequestId& id, const Status& why) {
    Seq* s = find(id);
    if (s == nullptr) return;
    switch (s->stage) {
        case Stage::kAwaitingPrefill:
        case Stage::kWaiting:
        case Stage::kRunning:
            if (s->stage == Stage::kRunning && s->req.kv.do_remote_decode && !s->prefilled()) {
                abort_prefill(*s, why);  // earlier chunks may still be on the wire
                return;
            }
            finish(*s, why);
            // A push decode leg holds no blocks yet: the connector only stops waiting.
            if (s->stage == Stage::kAwaitingPrefill) consumer_->cancel(s->transfer());
            retire(id);
            return;
        case Stage::kAwaitingKv:
            drain(*s, why);
            advance_kv(id);
            return;
        case Stage::kHeldByConnector:
        case Stage::kDraining:
            return;  // answered already
    }
}

void Engine::abort_prefill(Seq& s, const Status& why) {
    finish(s, why);
    // The connector may still read the blocks for writes of earlier chunks: they are held
    // until it releases them.
    hold(s);
    s.abort_sent = true;
    std::weak_ptr<Inbox> weak = inbox_;
    RequestId id = s.id;
    producer_->on_prefill_aborted(s.transfer(), s.req.kv, why, [weak, id](Status released) {
        if (auto in = weak.lock())
            in->post(Inbox::Event{
                .kind = Inbox::Kind::kReleased, .id = id, .status = std::move(released)});
    });
}

void Engine::on_kv_arrived(const RequestId& id, const Status& status) {
    Seq* found = find(id);
    if (found == nullptr || found->kv_closed ||
        (found->stage != Stage::kAwaitingKv && found->stage != Stage::kDraining))
        return;  // stale callback
    Seq& s = *found;
    TimePoint now = Clock::now();
    {
        std::lock_guard lock(stats_mu_);
        if (status.ok()) {
            counters_.kv_transfers++;
            counters_.kv_transfer_bytes +=
                kv::blocks_for_tokens(uint32_t(s.req.prompt.size()), slice_.layout.block_size) *
                pool_->block_bytes();
            transfer_latency_.observe(to_ms(now - s.kv_start) / 1000.0);
        } else {
            counters_.kv_transfer_failures++;
        }
    }
    s.kv_closed = true;
    if (s.stage == Stage::kAwaitingKv && !status.ok()) {
        drain(s, status.with_context(fmt::format("KV transfer for request {}", s.id)));
    } else if (s.stage == Stage::kAwaitingKv) {
        s.mark(&RequestTiming::kv_ready, now);
        s.kv_landed = kv::KvFrontier{uint32_t(s.req.prompt.size())};
    }
    advance_kv(id);
}

// A decode leg's KV: digests what landed (one job at a time), and once all of it arrived and
// is digested, the request decodes. A drained leg retires once neither the connector nor a
// digest job uses its blocks.
void Engine::advance_kv(const RequestId& id) {
    Seq* found = find(id);
    if (found == nullptr || found->digest_running) return;
    Seq& s = *found;
    if (s.stage == Stage::kDraining) {
        if (s.kv_closed) retire(id);
        return;
    }
    if (s.stage != Stage::kAwaitingKv) return;
    // What landed beyond what is digested: whole chunks, and layers of a chunk pushed layer
    // by layer.
    kv::KvFrontier digested{uint32_t(s.computed), s.digested_end, s.digested_layers};
    auto pieces = kv::pieces_between(digested, s.kv_landed, slice_.layout.num_layers);
    if (!pieces.empty()) {
        s.digest_running = true;
        {
            std::lock_guard lock(inbox_->mu);
            inbox_->digest_jobs.push_back({s.id, s.blocks, std::move(pieces), s.kv_landed});
        }
        inbox_->digest_cv.notify_one();
        return;
    }
    if (!s.kv_closed || !s.prefilled()) return;
    s.stream.emplace(slice_, s.req.prompt, kEmptyPrefixState + s.kv_terms);
    if (config_.first_token == EngineConfig::FirstToken::kPrefill && s.generated == 0) {
        // The token prefill sampled, as the KV that arrived implies it: no step needed.
        auto tok = s.stream->next(*pool_, s.blocks);
        if (!tok.ok()) {
            finish(s, tok.status());
            retire(id);  // the connector is done with the blocks
            return;
        }
        s.generated = 1;
        s.handle->push(*tok, Clock::now());
        {
            std::lock_guard lock(stats_mu_);
            counters_.generated_tokens++;
        }
        if (s.generated >= s.req.max_tokens) {
            finish(s, ok_status());
            retire(id);
            return;
        }
    }
    enter(s, Stage::kRunning);
}

Status Engine::abort_transfer(const std::string& transfer_id, const std::string& reason) {
    if (transfer_id.empty()) return invalid_argument("abort needs a transfer_id");
    inbox_->post(Inbox::Event{.kind = Inbox::Kind::kCancelTransfer,
                              .transfer = transfer_id,
                              .status = cancelled(reason)});
    return ok_status();
}

void Engine::expire_kv_waits() {
    TimePoint now = Clock::now();
    std::vector<RequestId> unscheduled;
    for (auto& [id, s] : requests_) {
        if (now < s->deadline) continue;
        if (s->stage == Stage::kAwaitingPrefill) {
            unscheduled.push_back(id);
        } else if (s->stage == Stage::kAwaitingKv && !s->kv_closed) {
            drain(*s, timeout_error(fmt::format(
                          "KV for request {} (transfer {}) did not arrive within {:.0f} ms", s->id,
                          s->req.kv.transfer_id, to_ms(config_.kv_wait_timeout))));
        }
    }
    for (const RequestId& id : unscheduled) {
        Seq& s = *find(id);
        finish(s, timeout_error(fmt::format(
                      "the prefill engine did not schedule transfer {} of request {} within "
                      "{:.0f} ms",
                      s.req.kv.transfer_id, s.id, to_ms(config_.kv_wait_timeout))));
        consumer_->cancel(s.transfer());
        retire(id);
    }
}

void Engine::admit(std::vector<Seq*>& prefill_batch) {
    const bool chunked = config_.prefill_chunk_tokens > 0;
    size_t batch_tokens = 0;
    // Chunked: prompt tokens admitted but not computed yet. A prompt is admitted only while
    // the next step's budget is not spoken for, so it is scheduled (and, in push, decode
    // reserves blocks for it) about when its compute starts.
    size_t pending = 0;
    // Requests holding a place in the batch (max_num_seqs): running (this round's admissions
    // included), or decode legs with blocks for KV.
    size_t placed = 0;
    for (const auto& [id, r] : requests_) {
        if (r->stage == Stage::kRunning && !r->prefilled())
            pending += r->req.prompt.size() - r->computed;
        if (r->stage == Stage::kRunning || r->stage == Stage::kAwaitingKv ||
            r->stage == Stage::kDraining)
            placed++;
    }
    for (Seq* waiting : in_stage(Stage::kWaiting)) {
        Seq& s = *waiting;
        if (placed >= config_.max_num_seqs) return;
        bool remote_prefill = s.req.kv.do_remote_prefill;
        if (!remote_prefill && chunked && pending >= config_.prefill_chunk_tokens) return;
        if (!remote_prefill && !chunked && !prefill_batch.empty() &&
            batch_tokens + s.req.prompt.size() > config_.max_num_batched_tokens)
            return;
        size_t need = blocks_needed(s.req);
        // FIFO: the head waits for blocks rather than being overtaken, as vLLM's scheduler does.
        if (!blocks_.can_allocate(uint32_t(need))) return;
        auto got = blocks_.allocate(s.id, uint32_t(need));
        if (!got.ok()) return;
        s.blocks = std::move(got).value();
        s.mark(&RequestTiming::scheduled, Clock::now());
        placed++;
        if (remote_prefill) {
            s.kv_start = Clock::now();
            s.deadline = s.kv_start + config_.kv_wait_timeout;
            enter(s, Stage::kAwaitingKv);
            std::weak_ptr<Inbox> weak = inbox_;
            RequestId id = s.id;
            Status st = consumer_->on_blocks_allocated(
                s.transfer(), s.req.kv, s.blocks, s.req.prompt.size(),
                [weak, id](Status arrived) {
                    if (auto in = weak.lock())
                        in->post(Inbox::Event{.kind = Inbox::Kind::kKvArrived,
                                              .id = id,
                                              .status = std::move(arrived)});
                },
                [weak, id](const kv::KvFrontier& landed) {
                    if (auto in = weak.lock())
                        in->post(Inbox::Event{
                            .kind = Inbox::Kind::kKvProgress, .id = id, .ready = landed});
                });
            if (!st.ok()) {
                finish(s, st.with_context("KV connector refused the request"));
                retire(id);
                placed--;
                std::lock_guard lock(stats_mu_);
                counters_.kv_transfer_failures++;
            }
        } else {
            batch_tokens += s.req.prompt.size();
            pending += s.req.prompt.size();
            if (s.req.kv.do_remote_decode) producer_->on_prefill_scheduled(s.transfer(), s.req.kv);
            prefill_batch.push_back(&s);
            enter(s, Stage::kRunning);
        }
    }
}

std::vector<Engine::StepChunk> Engine::plan_prefill_step() const {
    const size_t bs = size_t(config_.block_size);
    size_t budget =
        config_.prefill_chunk_tokens > 0 ? config_.prefill_chunk_tokens : SIZE_MAX;  // whole
    std::vector<StepChunk> step;
    for (Seq* r : in_stage(Stage::kRunning)) {
        Seq& s = *r;
        if (s.prefilled()) continue;
        if (budget == 0) break;
        size_t left = s.req.prompt.size() - s.computed;
        size_t take = std::min(left, budget);
        if (take < left) {
            // A chunk that does not finish its prompt ends on a block boundary: whole blocks
            // are one write each in push, partial ones a write per layer.
            size_t aligned = (s.computed + take) / bs * bs - s.computed;
            if (aligned > 0) take = aligned;
        }
        step.push_back({&s, take});
        budget -= take;
    }
    return step;
}

int layer_group_end(int g, int groups, int layers) {
    if (g <= 0) return 0;
    if (g >= groups) return layers;
    const int64_t left = groups - g, sq = int64_t(groups) * groups;
    int end = layers - int((int64_t(layers) * left * left + sq / 2) / sq);
    // At least one layer in every group before and after this boundary.
    return std::clamp(end, g, layers - (groups - g));
}

int Engine::progress_handovers(const Seq& s, size_t chunk_end, int groups) const {
    const size_t prompt = s.req.prompt.size();
    if (chunk_end >= prompt) return groups;  // the last chunk: every group, then done
    // The connector sends at most max_progress_handovers() pieces per prompt. Keep one per
    // later chunk and a full set for the last; this chunk gets what is left, at least one.
    const size_t chunk = std::max<size_t>(config_.prefill_chunk_tokens, 1);
    const size_t later = (prompt - chunk_end + chunk - 1) / chunk;  // the last one included
    const size_t reserve = (later - 1) + size_t(groups - 1);
    const size_t limit = producer_->max_progress_handovers();
    const size_t used = s.handovers + reserve;
    if (limit <= used) return 1;
    return int(std::clamp<size_t>(limit - used, 1, size_t(groups)));
}

void Engine::run_prefill(const std::vector<StepChunk>& step) {
    TimePoint start = Clock::now();
    std::vector<PrefillChunk> chunks;
    std::vector<uint64_t> terms(step.size());
    std::vector<Status> errors(step.size());
    // A step with a push leg is computed in layer groups, its modelled time split evenly over
    // the layers; a push leg's KV goes to the connector group by group as the time passes, so
    // the copy runs alongside compute and after the step only the last group's copy and
    // digest remain. Earlier chunks used to go out whole at their step's end: at 1k tokens the
    // first chunk's copy then ran into the last chunk's and the backlog, not the last group,
    // was what decode waited for (2026-12-01).
    const int layers = int(slice_.layout.num_layers);
    const int groups_wanted = std::clamp(config_.push_layer_groups, 1, layers);
    std::vector<int> handovers(step.size(), 1);  // per chunk, the last one at the step's end
    int groups = 1;
    for (size_t i = 0; i < step.size(); ++i) {
        Seq& s = *step[i].seq;
        if (s.computed == 0) s.mark(&RequestTiming::prefill_start, start);
        size_t end = s.computed + step[i].tokens;
        chunks.push_back({.tokens = int(step[i].tokens),
                          .context = int(s.computed),
                          .last = end == s.req.prompt.size()});
        if (!s.req.kv.do_remote_decode) continue;
        groups = groups_wanted;
        handovers[i] = progress_handovers(s, end, groups_wanted);
    }
    double modelled = cost_.prefill_seconds(chunks) * config_.time_scale;
    for (int g = 0; g < groups; ++g) {
        LayerRange group{layer_group_end(g, groups, layers),
                         layer_group_end(g + 1, groups, layers)};
        for (size_t i = 0; i < step.size(); ++i) {
            if (!errors[i].ok()) continue;
            Seq& s = *step[i].seq;
            auto t = write_prompt_kv_range(*pool_, s.blocks, slice_, s.req.prompt, s.computed,
                                           s.computed + step[i].tokens, group);
            if (t.ok())
                terms[i] += *t;
            else
                errors[i] = t.status();
        }
        double until = modelled * double(group.end) / double(layers);
        if (!sleep_until(
                start + std::chrono::duration_cast<Duration>(std::chrono::duration<double>(until))))
            return;
        if (g + 1 == groups) break;
        for (size_t i = 0; i < step.size(); ++i) {
            Seq& s = *step[i].seq;
            // handovers[i] hand-overs spread evenly over the groups, the last at the end.
            const int h = handovers[i];
            if (!errors[i].ok() || !s.req.kv.do_remote_decode ||
                (g + 1) * h / groups == g * h / groups)
                continue;
            s.handovers++;
            producer_->on_prefill_progress(
                s.transfer(), s.req.kv, s.blocks,
                kv::KvFrontier{uint32_t(s.computed), uint32_t(s.computed + step[i].tokens),
                               uint32_t(group.end)});
        }
    }
    TimePoint now = Clock::now();
    {
        std::lock_guard lock(stats_mu_);
        counters_.prefill_steps++;
    }
    for (size_t i = 0; i < step.size(); ++i) {
        Seq& s = *step[i].seq;
        if (!errors[i].ok()) {
            if (s.req.kv.do_remote_decode) {
                abort_prefill(s, errors[i]);
            } else {
                finish(s, errors[i]);
                retire(s.id);
            }
            continue;
        }
        s.computed += step[i].tokens;
        s.kv_terms += terms[i];
        if (!s.prefilled()) {
            // Push writes this chunk's KV while the next chunks compute.
            if (s.req.kv.do_remote_decode) {
                s.handovers++;
                producer_->on_prefill_progress(s.transfer(), s.req.kv, s.blocks,
                                               kv::KvFrontier{uint32_t(s.computed)});
            }
            continue;
        }
        s.mark(&RequestTiming::prefill_end, now);
        s.stream.emplace(slice_, s.req.prompt, kEmptyPrefixState + s.kv_terms);
        auto tok = s.stream->next(*pool_, s.blocks);
        if (!tok.ok()) {
            finish(s, tok.status());
            retire(s.id);
            continue;
        }
        s.generated = 1;
        s.handle->push(*tok, now);
        {
            std::lock_guard lock(stats_mu_);
            counters_.generated_tokens++;
        }
        if (s.req.kv.do_remote_decode) {
            std::weak_ptr<Inbox> weak = inbox_;
            RequestId id = s.id;
            auto out = producer_->on_prefill_done(
                s.transfer(), s.req.kv, s.blocks, s.req.prompt.size(), [weak, id](Status released) {
                    if (auto in = weak.lock())
                        in->post(Inbox::Event{.kind = Inbox::Kind::kReleased,
                                              .id = id,
                                              .status = std::move(released)});
                });
            if (!out.ok()) {
                finish(s, out.status().with_context("KV connector refused the hand-over"));
                retire(s.id);
                std::lock_guard lock(stats_mu_);
                counters_.kv_transfer_failures++;
                continue;
            }
            // The connector reads the blocks until it releases them.
            hold(s);
            finish(s, ok_status(), std::move(out).value());
        } else if (s.generated >= s.req.max_tokens) {
            finish(s, ok_status());
            retire(s.id);
        }
    }
}

void Engine::run_decode() {
    TimePoint start = Clock::now();
    std::vector<Seq*> batch;  // prompts still in chunked prefill wait for their last chunk
    for (Seq* s : in_stage(Stage::kRunning))
        if (s->prefilled()) batch.push_back(s);
    std::vector<int> ctx;
    std::vector<Result<int32_t>> toks;
    ctx.reserve(batch.size());
    toks.reserve(batch.size());
    for (Seq* s : batch) {
        ctx.push_back(int(s->req.prompt.size() + s->generated));
        toks.push_back(s->stream->next(*pool_, s->blocks));
    }
    double modelled = cost_.decode_seconds(ctx) * config_.time_scale;
    if (!sleep_until(start +
                     std::chrono::duration_cast<Duration>(std::chrono::duration<double>(modelled))))
        return;
    TimePoint now = Clock::now();
    uint64_t produced = 0;
    for (size_t i = 0; i < batch.size(); ++i) {
        Seq& s = *batch[i];
        if (!toks[i].ok()) {
            finish(s, toks[i].status());
            retire(s.id);
            continue;
        }
        s.handle->push(*toks[i], now);
        s.generated++;
        produced++;
        if (s.generated >= s.req.max_tokens) {
            finish(s, ok_status());
            retire(s.id);
        }
    }
    {
        std::lock_guard lock(stats_mu_);
        counters_.decode_steps++;
        counters_.generated_tokens += produced;
    }
}

void Engine::digest_worker() {
    // Reading the whole prompt KV of a decode leg is real CPU work proportional to its size;
    // done here so the step loop keeps the modelled pace for the other requests.
    while (true) {
        Inbox::DigestJob job;
        {
            std::unique_lock lock(inbox_->mu);
            inbox_->digest_cv.wait(lock, [&] { return !inbox_->digest_jobs.empty() || !running_; });
            if (!running_) return;
            job = std::move(inbox_->digest_jobs.front());
            inbox_->digest_jobs.pop_front();
        }
        uint64_t terms = 0;
        for (const kv::KvPiece& p : job.pieces)
            terms += prompt_kv_terms(*pool_, job.blocks, slice_, p.first_token, p.end_token,
                                     {int(p.first_layer), int(p.end_layer)});
        inbox_->post(Inbox::Event{
            .kind = Inbox::Kind::kDigested, .id = job.id, .ready = job.upto, .terms = terms});
    }
}

void Engine::publish_gauges() {
    size_t by_stage[6] = {};
    for (const auto& [id, s] : requests_) by_stage[size_t(s->stage)]++;
    std::lock_guard lock(stats_mu_);
    counters_.waiting = by_stage[size_t(Stage::kWaiting)];
    counters_.running = by_stage[size_t(Stage::kRunning)];
    counters_.waiting_for_kv =
        by_stage[size_t(Stage::kAwaitingKv)] + by_stage[size_t(Stage::kDraining)];
    counters_.held_for_transfer = by_stage[size_t(Stage::kHeldByConnector)];
    counters_.waiting_for_prefill = by_stage[size_t(Stage::kAwaitingPrefill)];
}

void Engine::fail_all(const Status& status) {
    // Legs held by the connector stay until it releases them. The others leave without
    // retire(): the connector may still write into a draining leg's blocks, and nothing is
    // allocated any more.
    for (auto& [id, s] : requests_) finish(*s, status);
    std::erase_if(requests_,
                  [](const auto& r) { return r.second->stage != Stage::kHeldByConnector; });
}

EngineStats Engine::stats() const {
    EngineStats st;
    {
        std::lock_guard lock(stats_mu_);
        st = counters_;
    }
    st.blocks_total = blocks_.num_blocks();
    st.blocks_used = blocks_.used_count();
    st.blocks_free = blocks_.free_count();
    return st;
}

std::string Engine::prometheus_text() const {
    EngineStats st = stats();
    std::string out;
    render_counter(out, "ferry_requests_total", "requests accepted", double(st.requests_total));
    render_counter(out, "ferry_requests_failed_total", "requests that ended in an error",
                   double(st.requests_failed));
    render_gauge(out, "ferry_requests_waiting", "requests waiting for blocks", double(st.waiting));
    render_gauge(out, "ferry_requests_running", "requests prefilling or decoding",
                 double(st.running));
    render_gauge(out, "ferry_requests_waiting_for_kv", "decode legs waiting for remote KV",
                 double(st.waiting_for_kv));
    render_gauge(out, "ferry_requests_waiting_for_prefill",
                 "push decode legs waiting for the prefill engine to schedule them",
                 double(st.waiting_for_prefill));
    render_gauge(out, "ferry_requests_held_for_transfer",
                 "prefill legs whose blocks the connector still holds",
                 double(st.held_for_transfer));
    render_counter(out, "ferry_prompt_tokens_total", "prompt tokens accepted",
                   double(st.prompt_tokens));
    render_counter(out, "ferry_generation_tokens_total", "tokens generated",
                   double(st.generated_tokens));
    render_counter(out, "ferry_prefill_steps_total", "prefill steps", double(st.prefill_steps));
    render_counter(out, "ferry_decode_steps_total", "decode steps", double(st.decode_steps));
    render_gauge(out, "ferry_kv_blocks_total", "KV blocks in the pool", double(st.blocks_total));
    render_gauge(out, "ferry_kv_blocks_used", "KV blocks allocated", double(st.blocks_used));
    render_gauge(out, "ferry_kv_blocks_free", "KV blocks free", double(st.blocks_free));
    render_counter(out, "ferry_kv_transfers_total", "KV transfers completed",
                   double(st.kv_transfers));
    render_counter(out, "ferry_kv_transfer_failures_total", "KV transfers failed or refused",
                   double(st.kv_transfer_failures));
    render_counter(out, "ferry_kv_transfer_bytes_total", "KV bytes moved",
                   double(st.kv_transfer_bytes));
    transfer_latency_.render(out, "ferry_kv_transfer_latency_seconds",
                             "from hand-over to the connector to its completion callback");
    return out;
}

}  // namespace ferry::serve
