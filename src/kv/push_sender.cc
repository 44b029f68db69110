// PushSender: see push_sender.h. Prefill's half of the push protocol in docs/PROTOCOL.md.
#include "push_sender.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/enum_names.h"
#include "ferry/common/log.h"
#include "segment_writes.h"

namespace ferry::kv::detail {
namespace {

using P = PrefillState;
using J = SendJobState;

constexpr EnumName<PrefillState> kPrefillNames[] = {
    {P::kQueued, "QUEUED"}, {P::kComputing, "COMPUTING"}, {P::kDone, "DONE"},
    {P::kFailed, "FAILED"}, {P::kAborted, "ABORTED"},     {P::kFinished, "FINISHED"},
};
constexpr EnumName<SendJobState> kJobNames[] = {
    {J::kSending, "SENDING"},       {J::kClosed, "CLOSED"},       {J::kFailing, "FAILING"},
    {J::kDropping, "DROPPING"},     {J::kServed, "SERVED"},       {J::kFailed, "FAILED"},
    {J::kCancelling, "CANCELLING"}, {J::kCancelled, "CANCELLED"},
};

// The arrows of PROTOCOL.md's "Prefill rank" diagram. A transfer leaves kQueued, kComputing or
// kDone also by being erased (lease, a failed result); kFailed may fail again (the later reason
// is reported).
constexpr bool legal(PrefillState from, PrefillState to) {
    switch (from) {
        case P::kQueued:
            return to == P::kComputing || to == P::kDone || to == P::kFailed;
        case P::kComputing:
            return to == P::kDone || to == P::kFailed;
        case P::kDone:
            return to == P::kAborted || to == P::kFinished;
        case P::kFailed:
            return to == P::kFailed || to == P::kFinished;
        case P::kAborted:
            return to == P::kFinished;
        case P::kFinished:
            return false;
    }
    return false;
}

// A job with writes in flight is kSending, kClosed or an -ing state; kServed, kFailed and
// kCancelled have none, and of them only a served job may still change: CANCEL after it makes
// it cancelled.
constexpr bool legal(SendJobState from, SendJobState to) {
    switch (from) {
        case J::kSending:
            return to != J::kSending && to != J::kFailed;  // FAIL goes out from kFailing
        case J::kClosed:
            return to == J::kServed || to == J::kFailing || to == J::kDropping ||
                   to == J::kCancelling;
        case J::kFailing:
            return to == J::kFailed || to == J::kDropping || to == J::kCancelling;
        case J::kDropping:
            return to == J::kCancelling || to == J::kCancelled;
        case J::kCancelling:
            return to == J::kCancelled;
        case J::kServed:
            return to == J::kCancelled;
        case J::kFailed:
        case J::kCancelled:
            return false;
    }
    return false;
}

// Decode asked for the job or a newer attempt replaced it: no more segments, no FINAL.
constexpr bool cancelled_state(SendJobState s) {
    return s == J::kDropping || s == J::kCancelling || s == J::kCancelled;
}

}  // namespace

std::string_view to_string(PrefillState s) { return name_of(kPrefillNames, s); }
std::string_view to_string(SendJobState s) { return name_of(kJobNames, s); }

void PushSender::set_state(uint64_t id, Producer& p, PrefillState to) {
    if (p.state == to && to != P::kFailed) return;
    if (!legal(p.state, to)) {
        log(LogLevel::kError, kLog,
            "transfer {:#x}: prefill state {} -> {} is not a transition "
            "of the push protocol; kept {}",
            id, to_string(p.state), to_string(to), to_string(p.state));
        return;
    }
    if (kv_trace_on()) {
        kv_trace(fmt::format("prefill {} -> {}", to_string(p.state), to_string(to)).c_str(), id);
    }
    p.state = to;
}

void PushSender::set_state(uint64_t id, JobKey key, SendJob& job, SendJobState to) {
    if (job.state == to) return;
    if (!legal(job.state, to)) {
        log(LogLevel::kError, kLog,
            "transfer {:#x} attempt {} decode rank {}: send job state {} -> {} is not a "
            "transition of the push protocol; kept {}",
            id, key.first, key.second, to_string(job.state), to_string(to), to_string(job.state));
        return;
    }
    if (kv_trace_on()) {
        kv_trace(fmt::format("job (attempt {}, decode rank {}) {} -> {}", key.first, key.second,
                             to_string(job.state), to_string(to))
                     .c_str(),
                 id);
    }
    job.state = to;
}

std::optional<PrefillState> PushSender::prefill_state(uint64_t id) const {
    auto it = producers_.find(id);
    if (it == producers_.end()) return std::nullopt;
    return it->second.state;
}

std::optional<SendJobState> PushSender::job_state(uint64_t id, uint32_t attempt,
                                                  uint32_t decode_rank) const {
    auto it = producers_.find(id);
    if (it == producers_.end()) return std::nullopt;
    auto jt = it->second.jobs.find({attempt, decode_rank});
    if (jt == it->second.jobs.end()) return std::nullopt;
    return jt->second.state;
}

void PushSender::on_register(RegisterMsg m) {
    kv_trace("REGISTER in", m.transfer_id);
    auto peer = ctx_.engine->connect(m.decode_address);
    if (!peer.ok()) {
        log(LogLevel::kWarn, kLog, "transfer {:#x}: cannot reach decode rank {}: {}", m.transfer_id,
            m.decode_rank, peer.status().to_string());
        return;
    }
    auto refuse = [&](const Status& s) {
        log(LogLevel::kWarn, kLog, "transfer {:#x}: refusing REGISTER from decode rank {}: {}",
            m.transfer_id, m.decode_rank, s.to_string());
        ctx_.send(*peer, FailMsg{m.transfer_id, m.attempt, ctx_.cfg.self.tp_rank, s.code(),
                                 s.message().substr(0, kMaxReasonLength)});
    };
    KvRank dst{m.layout, m.decode_rank, m.decode_tp};
    Status compat = check_compatible(ctx_.cfg.self, dst);
    if (!compat.ok()) return refuse(compat);
    auto consumers = consumers_for_producer(ctx_.cfg.self.total_heads(), ctx_.cfg.self.tp_size,
                                            m.decode_tp, ctx_.cfg.self.tp_rank);
    if (!consumers.ok()) return refuse(consumers.status());
    if (std::find(consumers->begin(), consumers->end(), m.decode_rank) == consumers->end()) {
        return refuse(
            invalid_argument(fmt::format("prefill rank {} holds no KV head of decode rank {}",
                                         ctx_.cfg.self.tp_rank, m.decode_rank)));
    }

    auto [it, fresh] = producers_.try_emplace(m.transfer_id);
    Producer& p = it->second;
    if (fresh) p.deadline = Clock::now() + ctx_.cfg.lease;
    if (!p.failure.ok()) return refuse(p.failure);
    if (p.state == P::kFinished) return refuse(finished_status(p));
    if (p.have_attempt && m.attempt < p.attempt) {
        // The decode side moved on; acknowledging lets its old attempt finish at once.
        ctx_.send(*peer, CancelAckMsg{m.transfer_id, m.attempt, ctx_.cfg.self.tp_rank});
        return ctx_.stale("REGISTER of a superseded attempt");
    }
    if (p.have_attempt && m.attempt > p.attempt) {
        for (auto& [key, job] : p.jobs) {
            if (key.first < m.attempt) drop_job(it->first, key, job);
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
    if (p.jobs.count(key)) return ctx_.stale("duplicate REGISTER");
    SendJob& job = p.jobs[key];
    job.peer = *peer;
    // Decode holds the tokens before first_token: the job starts as if they were sent.
    job.sent = KvFrontier{m.first_token};
    m.blocks = blocks_from_token0(m.blocks, m.first_token, m.layout.block_size);
    job.reg = std::move(m);
    // Renewed from now on, also before prefill schedules the request (see renew()).
    const TimePoint next = Clock::now() + renewal_period(p);
    p.renew_at = p.renew_at == TimePoint{} ? next : std::min(p.renew_at, next);
    advance_job(it->first, p, key, job);  // what is final already goes out now
    maybe_finish(it);                     // a job refused while planning is already served
}

void PushSender::on_intent(IntentMsg m) {
    auto peer = ctx_.engine->connect(m.decode_address);
    if (!peer.ok()) {
        log(LogLevel::kWarn, kLog, "transfer {:#x}: cannot reach decode rank {}: {}", m.transfer_id,
            m.decode_rank, peer.status().to_string());
        return;
    }
    auto [it, fresh] = producers_.try_emplace(m.transfer_id);
    Producer& p = it->second;
    if (fresh) p.deadline = Clock::now() + ctx_.cfg.lease;
    Status refused = !p.failure.ok()           ? p.failure
                     : p.state == P::kFinished ? finished_status(p)
                                               : ok_status();
    if (!refused.ok()) {
        ctx_.send(*peer, FailMsg{m.transfer_id, m.attempt, ctx_.cfg.self.tp_rank, refused.code(),
                                 refused.message().substr(0, kMaxReasonLength)});
        return;
    }
    p.intents[{m.attempt, m.decode_rank}] = Intent{*peer, m.decode_tp};
    if (p.state == P::kComputing || p.state == P::kDone)
        ctx_.send(*peer, ScheduledMsg{m.transfer_id, m.attempt, ctx_.cfg.self.tp_rank});
}

// Decode ranks that announced the transfer may now reserve their blocks.
void PushSender::mark_scheduled(uint64_t id, Producer& p) {
    if (p.state != P::kQueued) return;
    set_state(id, p, P::kComputing);
    const TimePoint next = Clock::now() + renewal_period(p);
    p.renew_at = p.renew_at == TimePoint{} ? next : std::min(p.renew_at, next);
    for (const auto& [key, intent] : p.intents) {
        ctx_.send(intent.peer, ScheduledMsg{id, key.first, ctx_.cfg.self.tp_rank});
    }
}

void PushSender::prefill_scheduled(uint64_t id) {
    auto [it, fresh] = producers_.try_emplace(id);
    Producer& p = it->second;
    if (p.state == P::kFinished || !p.failure.ok()) return;
    // Prefill is making progress: the lease counts from here.
    p.deadline = Clock::now() + ctx_.cfg.lease;
    mark_scheduled(id, p);
}

void PushSender::prefill_progress(uint64_t id, std::vector<uint32_t> blocks, KvFrontier ready) {
    auto [it, fresh] = producers_.try_emplace(id);
    Producer& p = it->second;
    if (p.state != P::kQueued && p.state != P::kComputing) {
        log(LogLevel::kWarn, kLog,
            "transfer {:#x}: prefill_progress after prefill_done or a failure; ignored", id);
        return;
    }
    KvPiece ahead;
    if (!next_piece(p.ready, ready, ctx_.cfg.self.layout.num_layers, &ahead)) return;
    p.blocks = std::move(blocks);
    p.ready = ready;
    p.deadline = Clock::now() + ctx_.cfg.lease;
    mark_scheduled(id, p);
    for (auto& [key, job] : p.jobs) {
        if (key.first == p.attempt) advance_job(id, p, key, job);
    }
}

void PushSender::prefill_done(uint64_t id, std::vector<uint32_t> blocks, uint32_t tokens) {
    auto [it, fresh] = producers_.try_emplace(id);
    Producer& p = it->second;
    if (p.state != P::kQueued && p.state != P::kComputing) {
        log(LogLevel::kWarn, kLog,
            "transfer {:#x}: prefill_done called twice or after a "
            "failure; ignored",
            id);
        return;
    }
    // SCHEDULED to the announced ranks first: they hear it before any segment.
    mark_scheduled(id, p);
    set_state(id, p, P::kDone);
    p.blocks = std::move(blocks);
    p.tokens = tokens;
    p.ready = KvFrontier{tokens};
    // The lease counts from when the blocks are held.
    p.deadline = Clock::now() + ctx_.cfg.lease;
    ctx_.counters.active_send.fetch_add(1);
    for (auto& [key, job] : p.jobs) {
        if (key.first == p.attempt) advance_job(id, p, key, job);
    }
    maybe_finish(it);
}

void PushSender::prefill_failed(uint64_t id, const Status& reason) {
    auto [it, fresh] = producers_.try_emplace(id);
    Producer& p = it->second;
    if (prompt_done(p) || p.state == P::kFinished) {
        log(LogLevel::kWarn, kLog,
            "transfer {:#x}: prefill_failed after prefill_done; "
            "ignored",
            id);
        return;
    }
    set_state(id, p, P::kFailed);
    p.failure = reason;
    p.deadline = Clock::now() + ctx_.cfg.lease;
    fail_all(id, p, reason);
    maybe_finish(it);
}

// The engine gave the transfer up after prefill_done (the router aborted it: decode failed
// or the client left). Without this the blocks stayed held until the lease, and under load
// a dead decode kept prefill's whole pool (issue 19). Unknown or finished: nothing to do.
void PushSender::abort(uint64_t id, const Status& reason) {
    auto it = producers_.find(id);
    if (it == producers_.end() || it->second.state == P::kFinished) return;
    Producer& p = it->second;
    if (!prompt_done(p)) return prefill_failed(id, reason);
    if (p.state == P::kAborted) return;
    // The blocks are only the source of the writes still in flight: reusing them changes
    // what lands in decode blocks that FAIL (sent once the writes ended) gives up anyway.
    // Waiting for those writes kept a dead decode's transfers' blocks for the whole op
    // timeout (10 s) after the router had aborted them.
    set_state(id, p, P::kAborted);
    p.failure = reason;
    ctx_.counters.active_send.fetch_sub(1);
    ctx_.send_done({id, p.attempt, reason, 0, 0});
    fail_all(id, p, reason);
    maybe_finish(it);
}

// prefill_failed or abort: the announced ranks get FAIL now, every open job once its writes
// ended (decode must not reuse its blocks before).
void PushSender::fail_all(uint64_t id, Producer& p, const Status& reason) {
    for (const auto& [key, intent] : p.intents) {
        ctx_.send(intent.peer, FailMsg{id, key.first, ctx_.cfg.self.tp_rank, reason.code(),
                                       reason.message().substr(0, kMaxReasonLength)});
    }
    p.intents.clear();
    for (auto jt = p.jobs.begin(); jt != p.jobs.end();) {
        auto next = std::next(jt);  // settling may erase an older attempt's job
        fail_job(id, p, jt->first, jt->second, reason);
        jt = next;
    }
}

// Posts what became final since the job's last segment, and sends FINAL once the prompt is
// complete with nothing left to post (its segments went out before prefill_done). A closed job
// is served once its last write completed.
void PushSender::advance_job(uint64_t id, Producer& p, JobKey key, SendJob& job) {
    if (job.state == J::kClosed && job.in_flight == 0) set_state(id, key, job, J::kServed);
    if (job.state != J::kSending) return;
    if (prompt_done(p) && p.tokens != job.reg.num_tokens) {
        // Checked here too, not only when a segment is planned: a registration whose tokens
        // were all held already (first_token) plans no segment.
        return fail_job(id, p, key, job,
                        invalid_argument(fmt::format("decode registered {} tokens, prefill "
                                                     "computed {}",
                                                     job.reg.num_tokens, p.tokens)));
    }
    const uint32_t layers = ctx_.cfg.self.layout.num_layers;
    KvPiece piece;
    while (next_piece(job.sent, p.ready, layers, &piece)) {
        // Immediates prefill_done may still need are kept for it: one for the tokens left,
        // and one more for the rest of a chunk sent layer by layer.
        uint32_t keep = 1 + (add_piece(job.sent, piece, layers).has_partial() ? 1 : 0);
        if (job.segments + 1 + keep > job.reg.imm_span && !prompt_done(p)) break;
        Status posted = post_segment(id, p, key, job, piece);
        if (!posted.ok()) return fail_job(id, p, key, job, posted);
    }
    if (job.state == J::kSending && all_posted(p, job)) {
        // Decode counts the segments' immediates: the totals need not wait for the writes.
        ctx_.send(job.peer, FinalMsg{id, key.first, ctx_.cfg.self.tp_rank, job.writes, job.bytes,
                                     job.segments});
        set_state(id, key, job, job.in_flight == 0 ? J::kServed : J::kClosed);
    }
}

Status PushSender::post_segment(uint64_t id, Producer& p, JobKey key, SendJob& job,
                                const KvPiece& piece) {
    const RegisterMsg& reg = job.reg;
    const uint32_t layers = ctx_.cfg.self.layout.num_layers;
    uint32_t total = prompt_done(p) ? p.tokens : reg.num_tokens;
    uint32_t computed = std::max(p.ready.tokens, p.ready.partial_end);
    if (computed > reg.num_tokens || total != reg.num_tokens) {
        return invalid_argument(fmt::format("decode registered {} tokens, prefill computed {}",
                                            reg.num_tokens, prompt_done(p) ? p.tokens : computed));
    }
    auto plan = plan_segment(
        {ctx_.cfg.self, p.blocks, KvRank{reg.layout, reg.decode_rank, reg.decode_tp}, reg.blocks,
         piece.first_token, piece.end_token, piece.first_layer, piece.end_layer},
        pools_on_gpu(*ctx_.engine, job.peer, ctx_.pool, reg.pool));
    if (!plan.ok()) return plan.status();
    kv_trace("segment planned", id);
    uint32_t index = job.segments++;
    bool whole = piece.first_layer == 0 && piece.end_layer == layers;
    SegmentMsg seg{id,
                   key.first,
                   ctx_.cfg.self.tp_rank,
                   index,
                   piece.first_token,
                   piece.end_token,
                   0,
                   plan->bytes(),
                   whole ? 0 : piece.first_layer,
                   whole ? 0 : piece.end_layer,
                   std::nullopt};  // set below when this segment completes the prompt
    job.sent = add_piece(job.sent, piece, layers);
    job.in_flight++;
    auto flight = ctx_.new_flight(
        [this, id, key, index](const Status& s) { on_segment_drained(id, key, index, s); });
    // One group of operations per (region, region) pair: an engine operation has one source
    // and one destination region.
    // Between GPUs of this host, one block copy for every region.
    seg.writes = 0;
    if (plan->on_gpu) {
        kv_trace("block copy to the engine", id);
        seg.writes = post_block_copy(*ctx_.engine, *plan, job.peer, false, ctx_.pool, job.reg.pool,
                                     reg.imm + index, *flight);
    }
    for (const RegionRuns& g : plan->runs.groups) {
        std::span<const ByteRun> runs(plan->runs.runs.data() + g.first, g.count);
        seg.writes += post_writes(*ctx_.engine, ctx_.pool.regions[g.src_region], job.peer,
                                  &job.reg.pool[g.dst_region], runs, reg.imm + index, *flight);
    }
    job.writes += seg.writes;
    job.bytes += plan->bytes();
    ctx_.counters.ops_posted.fetch_add(plan->operations());
    ctx_.counters.bytes_posted.fetch_add(plan->bytes());
    // SEGMENT goes out now, not once the writes completed (protocol 7): decode counts the
    // immediates, which arrive only with the data, so announcing the segment early costs it
    // nothing and takes a completion hand-off and a message off the end of every push (the
    // closing SEGMENT reached decode ~31 us after a 16k-token GPU copy completed, 2026-12-03).
    // A write that fails later is answered with FAIL once the segment's writes all ended.
    if (all_posted(p, job)) {
        seg.last = JobTotals{job.writes, job.bytes, job.segments};
        set_state(id, key, job, J::kClosed);  // this segment's writes are in flight
    }
    ctx_.send(job.peer, seg);
    flight->done(ok_status());
    kv_trace("segment posted", id);
    return ok_status();
}

void PushSender::on_segment_drained(uint64_t id, JobKey key, uint32_t index, const Status& s) {
    auto it = producers_.find(id);
    if (it == producers_.end()) return;
    auto jt = it->second.jobs.find(key);
    if (jt == it->second.jobs.end()) return;
    SendJob& job = jt->second;
    job.in_flight--;
    kv_trace("segment drained", id);
    if (!s.ok()) {
        if (job.error.ok()) {
            log(LogLevel::kWarn, kLog,
                "transfer {:#x} attempt {}: writing segment {} to decode rank {} failed: {}", id,
                key.first, index, key.second, s.to_string());
        }
        fail_job(id, it->second, key, job, s);
    } else if (job.in_flight == 0) {
        settle_job(id, it->second, key, job);
    }
    maybe_finish(it);
}

// An error for the job (a write, a plan, prefill failed or aborted, the lease): an open job
// answers FAIL once no write of it is in flight; a cancelled one keeps the error for the
// transfer's result but answers as cancelled.
void PushSender::fail_job(uint64_t id, Producer& p, JobKey key, SendJob& job, const Status& s) {
    if (resolved(job.state)) return;
    if (job.error.ok()) job.error = s;
    if (job.state == J::kSending || job.state == J::kClosed) set_state(id, key, job, J::kFailing);
    if (job.in_flight == 0) settle_job(id, p, key, job);
}

// A newer attempt or shutdown stops the job: no more segments, no FINAL, no FAIL; a CANCEL
// already asked for is still acknowledged.
void PushSender::drop_job(uint64_t id, JobKey key, SendJob& job) {
    if (resolved(job.state) || job.state == J::kCancelling) return;
    set_state(id, key, job, job.in_flight > 0 ? J::kDropping : J::kCancelled);
}

// A job with no write in flight: answer a cancel, report an error (also after the closing
// SEGMENT: decode may still be counting), or go on. May erase the job (an older attempt's,
// once answered).
void PushSender::settle_job(uint64_t id, Producer& p, JobKey key, SendJob& job) {
    switch (job.state) {
        case J::kServed:
        case J::kFailed:
        case J::kCancelled:
            return;
        case J::kCancelling:
            ctx_.send(job.peer, CancelAckMsg{id, key.first, ctx_.cfg.self.tp_rank});
            [[fallthrough]];
        case J::kDropping:
            set_state(id, key, job, J::kCancelled);
            if (key.first < p.attempt) p.jobs.erase(key);
            return;
        case J::kFailing:
            ctx_.send(job.peer, FailMsg{id, key.first, ctx_.cfg.self.tp_rank, job.error.code(),
                                        job.error.message().substr(0, kMaxReasonLength)});
            set_state(id, key, job, J::kFailed);
            return;
        case J::kSending:
        case J::kClosed:
            return advance_job(id, p, key, job);
    }
}

void PushSender::on_cancel(uint64_t sender, const CancelMsg& m) {
    auto ack_to_sender = [&] {
        auto peer = ctx_.engine->find_peer(sender);
        if (peer) ctx_.send(*peer, CancelAckMsg{m.transfer_id, m.attempt, ctx_.cfg.self.tp_rank});
    };
    auto it = producers_.find(m.transfer_id);
    if (it == producers_.end() || it->second.state == P::kFinished) return ack_to_sender();
    Producer& p = it->second;
    // Decode gave the request up before the prompt was computed: nobody wants it any more
    // (without this, prefill computed on until its own prefill_done, 0.2-4.1 s under load).
    if (m.given_up && (p.state == P::kQueued || p.state == P::kComputing) && !p.cancel_reported &&
        (!p.have_attempt || m.attempt >= p.attempt)) {
        p.cancel_reported = true;
        ctx_.send_cancelled(
            {m.transfer_id, m.attempt,
             cancelled(fmt::format("decode rank {} gave the transfer up", m.decode_rank)), 0, 0});
    }
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
            set_state(m.transfer_id, key, j, J::kCancelled);
        }
        return maybe_finish(it);
    }
    SendJob& job = jt->second;
    if (job.in_flight > 0) {
        // Acknowledged when the last write completed; no further segment.
        return set_state(m.transfer_id, key, job, J::kCancelling);
    }
    ctx_.send(job.peer, CancelAckMsg{m.transfer_id, m.attempt, ctx_.cfg.self.tp_rank});
    if (job.state != J::kFailed) set_state(m.transfer_id, key, job, J::kCancelled);
    if (m.attempt < p.attempt) p.jobs.erase(jt);
    maybe_finish(it);
}

// A transfer is finished on prefill once every decode rank of the current attempt was
// served (FINAL, FAIL or cancelled) and no write of any attempt is in flight; after
// prefill_failed, once no write is in flight.
void PushSender::maybe_finish(ProducerIt it) {
    Producer& p = it->second;
    if (p.state == P::kFinished) return;
    for (const auto& [key, job] : p.jobs) {
        if (job.in_flight > 0) return;
    }
    if (p.state == P::kFailed || p.state == P::kAborted) {
        const bool reported = p.state == P::kAborted;  // abort reported it
        p.jobs.clear();
        set_state(it->first, p, P::kFinished);  // kept until the lease, to answer with FAIL
        ctx_.counters.transfers_failed.fetch_add(1);
        if (!reported) ctx_.send_done({it->first, p.attempt, p.failure, 0, 0});
        return;
    }
    if (p.state != P::kDone || !p.have_attempt) return;
    auto consumers = consumers_for_producer(ctx_.cfg.self.total_heads(), ctx_.cfg.self.tp_size,
                                            p.decode_tp, ctx_.cfg.self.tp_rank);
    size_t expected = consumers.ok() ? consumers->size() : 0;
    size_t served = 0;
    for (const auto& [key, job] : p.jobs) {
        if (key.first == p.attempt && resolved(job.state)) ++served;
    }
    if (served < expected) return;
    TransferResult r{it->first, p.attempt, ok_status(), 0, 0};
    for (const auto& [key, job] : p.jobs) {
        if (key.first != p.attempt) continue;
        r.bytes += job.bytes;
        r.writes += job.writes;
        if (r.status.ok() && !job.error.ok()) r.status = job.error;
        if (r.status.ok() && cancelled_state(job.state)) {
            r.status = cancelled(fmt::format("decode rank {} cancelled", key.second));
        }
    }
    complete_send(it, r);
}

// Reports a transfer that holds the prompt's blocks (kDone, or kAborted, which reported
// already): served, it stays as a kFinished tombstone until the lease; otherwise it goes.
void PushSender::complete_send(ProducerIt it, const TransferResult& r) {
    (r.status.ok() ? ctx_.counters.transfers_sent : ctx_.counters.transfers_failed).fetch_add(1);
    const bool reported = it->second.state == P::kAborted;  // abort released the blocks already
    if (!reported) ctx_.counters.active_send.fetch_sub(1);
    // Served: a newer attempt registered from now on is refused at once (the blocks go back
    // to the engine below), until the lease, when nothing late can come any more.
    if (r.status.ok()) {
        Producer& p = it->second;
        set_state(it->first, p, P::kFinished);
        Producer tomb;
        tomb.state = P::kFinished;
        tomb.have_attempt = true;
        tomb.attempt = p.attempt;
        tomb.deadline = Clock::now() + ctx_.cfg.lease;
        p = std::move(tomb);
    } else {
        producers_.erase(it);
    }
    if (!reported) ctx_.send_done(r);
}

// What a late REGISTER or INTENT of a finished transfer gets (one that failed gets its failure).
Status PushSender::finished_status(const Producer& p) const {
    return unavailable(
        fmt::format("prefill already served attempt {} of this transfer and released its "
                    "blocks: a newer attempt cannot be served, retry the request",
                    p.attempt));
}

void PushSender::expire_producer(ProducerIt it) {
    Producer& p = it->second;
    if (p.state == P::kFinished) {
        producers_.erase(it);
        return;
    }
    for (const auto& [key, job] : p.jobs) {
        // Writes in flight end by the engine's op_timeout; the drain finishes the job.
        if (job.in_flight > 0) return;
    }
    ctx_.counters.leases_expired.fetch_add(1);
    Status why = prompt_done(p)
                     ? timeout_error(fmt::format(
                           "no registration from every decode rank within the {:.0f} ms "
                           "lease; blocks released",
                           to_ms(ctx_.cfg.lease)))
                     : timeout_error(fmt::format("prefill did not finish within the {:.0f} "
                                                 "ms lease",
                                                 to_ms(ctx_.cfg.lease)));
    log(LogLevel::kWarn, kLog, "transfer {:#x}: {}", it->first, why.message());
    for (auto& [key, job] : p.jobs) fail_job(it->first, p, key, job, why);
    for (const auto& [key, intent] : p.intents) {
        ctx_.send(intent.peer,
                  FailMsg{it->first, key.first, ctx_.cfg.self.tp_rank, why.code(), why.message()});
    }
    if (!prompt_done(p)) {
        producers_.erase(it);  // no blocks of the engine's are held
        return;
    }
    TransferResult r{it->first, p.attempt, why, 0, 0};
    complete_send(it, r);
}

// A third of the shortest lease that counts on the renewals: this rank's, and each registered
// decode rank's (REGISTER's lease_ms; the two sides may be configured apart).
Duration PushSender::renewal_period(const Producer& p) const {
    Duration lease = ctx_.cfg.lease;
    for (const auto& [key, job] : p.jobs) {
        if (job.reg.lease_ms > 0)
            lease = std::min<Duration>(lease, std::chrono::milliseconds(job.reg.lease_ms));
    }
    return lease / 3;
}

// A prefill that computes (kComputing) is alive however long the prompt takes: its lease and
// its registered decode ranks' leases are renewed, three times a lease, with SCHEDULED
// (PROTOCOL.md, "Renewals"). Inside vLLM one prefill step of 1500 tokens took 27 s on a loaded
// 2-core host, and a lease counted from the registration alone failed it at 30 s on both sides.
// Renewals stop with the process, so a dead prefill still ends in a lease.
// Before prefill schedules the request (kQueued: queued behind a long step, or its engine
// starved: 3 s and more between decode's REGISTER and vLLM's scheduling of the prompt on a
// loaded host), the registered decode ranks are renewed too, but not this rank's own lease,
// which counts from the first message: a request that is never scheduled ends by prefill's
// lease (FAIL to the decode ranks), decode's lease only then bounding the wait of a decode rank
// whose prefill died.
void PushSender::renew(uint64_t id, Producer& p, TimePoint now) {
    kv_trace("renewal (SCHEDULED) out", id);
    if (p.state == P::kComputing) p.deadline = now + ctx_.cfg.lease;
    p.renew_at = now + renewal_period(p);
    for (const auto& [key, job] : p.jobs) {
        if (key.first != p.attempt || resolved(job.state) || cancelled_state(job.state)) continue;
        ctx_.send(job.peer, ScheduledMsg{id, key.first, ctx_.cfg.self.tp_rank});
    }
}

void PushSender::expire(TimePoint now) {
    for (auto it = producers_.begin(); it != producers_.end();) {
        auto next = std::next(it);
        Producer& p = it->second;
        const bool computing =
            p.state == P::kComputing || (p.state == P::kQueued && !p.jobs.empty());
        if (computing && now >= p.renew_at) renew(it->first, p, now);
        if (now > p.deadline) expire_producer(it);
        it = next;
    }
}

void PushSender::begin_shutdown() {
    for (auto& [id, p] : producers_) {
        for (auto& [key, job] : p.jobs) drop_job(id, key, job);
    }
}

void PushSender::report_shut_down(const Status& why) {
    while (!producers_.empty()) {
        auto it = producers_.begin();
        if (!prompt_done(it->second)) {  // holds no blocks (kFinished: handed back already)
            producers_.erase(it);
            continue;
        }
        complete_send(it, {it->first, it->second.attempt, why, 0, 0});
    }
}

}  // namespace ferry::kv::detail
