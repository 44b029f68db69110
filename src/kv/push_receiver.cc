// PushReceiver: see push_receiver.h. Decode's half of the push protocol in docs/PROTOCOL.md.
#include "push_receiver.h"

#include <fmt/format.h>

#include <algorithm>

#include "ferry/common/log.h"

namespace ferry::kv::detail {

void PushReceiver::announce(uint64_t id, uint32_t attempt, std::vector<EngineAddress> ranks) {
    auto report_now = [&](const Status& s) {
        ctx_.ids.release(id, attempt, TransferIds::Kind::kAnnounced);
        ctx_.scheduled({id, attempt, s, 0, 0});
    };
    ConsumerKey key{id, attempt};
    if (announces_.count(key)) {
        // Refused by the id check before it was queued; the claim is the live one's.
        ctx_.scheduled({id, attempt,
                        already_exists(fmt::format("transfer {:#x} attempt {} is already announced",
                                                   id, attempt)),
                        0, 0});
        return;
    }
    auto producers =
        producers_for_consumer(ctx_.cfg.self.total_heads(), static_cast<uint32_t>(ranks.size()),
                               ctx_.cfg.self.tp_size, ctx_.cfg.self.tp_rank);
    if (!producers.ok()) return report_now(producers.status());
    Announce a;
    for (uint32_t rank : *producers) {
        auto peer = ctx_.engine->connect(ranks[rank]);
        if (!peer.ok()) {
            return report_now(
                peer.status().with_context(fmt::format("connecting to prefill rank {}", rank)));
        }
        a.ranks.emplace_back(rank, *peer);
    }
    a.deadline = Clock::now() + ctx_.cfg.lease;
    for (const auto& [rank, peer] : a.ranks) {
        // Posted again while the announcement waits for this rank (see send()).
        ctx_.send(peer,
                  IntentMsg{id, attempt, ctx_.cfg.self.tp_rank, ctx_.cfg.self.tp_size,
                            ctx_.engine->address()},
                  [this, key, rank = rank] {
                      auto it = announces_.find(key);
                      return it != announces_.end() &&
                             std::find(it->second.scheduled.begin(), it->second.scheduled.end(),
                                       rank) == it->second.scheduled.end();
                  });
    }
    announces_.emplace(key, std::move(a));
}

void PushReceiver::on_scheduled(const ScheduledMsg& m) {
    auto it = announces_.find({m.transfer_id, m.attempt});
    if (it == announces_.end()) {
        // A registered transfer whose prefill still computes: its lease is renewed.
        ConsumerIt c;
        Slot* s = find_slot({m.transfer_id, m.attempt}, m.producer_rank, &c);
        if (!s || resolved(s->state) || c->second.cancelling)
            return ctx_.stale("SCHEDULED for an unknown announcement or finished transfer");
        kv_trace("renewal (SCHEDULED) in", m.transfer_id);
        return renew(c->second, *s);
    }
    Announce& a = it->second;
    if (std::find(a.scheduled.begin(), a.scheduled.end(), m.producer_rank) == a.scheduled.end()) {
        a.scheduled.push_back(m.producer_rank);
    }
    if (a.scheduled.size() < a.ranks.size()) return;
    announces_.erase(it);
    ctx_.ids.release(m.transfer_id, m.attempt, TransferIds::Kind::kAnnounced);
    ctx_.scheduled({m.transfer_id, m.attempt, ok_status(), 0, 0});
}

// Ends an announcement that holds no blocks: prefill is told so it does not wait for a
// registration that will not come.
void PushReceiver::end_announce(AnnounceIt it, const Status& why, bool tell_prefill) {
    ConsumerKey key = it->first;
    if (tell_prefill) {
        for (const auto& [rank, peer] : it->second.ranks) {
            ctx_.send(peer, CancelMsg{key.first, key.second, ctx_.cfg.self.tp_rank, true});
        }
    }
    announces_.erase(it);
    ctx_.ids.release(key.first, key.second, TransferIds::Kind::kAnnounced);
    ctx_.scheduled({key.first, key.second, why, 0, 0});
}

void PushReceiver::register_push(PushRegistration reg) {
    auto report_now = [&](const Status& s) {
        ctx_.counters.transfers_failed.fetch_add(1);
        ctx_.ids.release(reg.transfer_id, reg.attempt, TransferIds::Kind::kRegistered);
        ctx_.recv_done({reg.transfer_id, reg.attempt, s, 0, 0});
    };
    for (auto& [key, c] : consumers_) {
        if (key.first != reg.transfer_id) continue;
        if (key.second >= reg.attempt) {
            // Refused by the id check before it was queued; the claim is the live one's.
            ctx_.counters.transfers_failed.fetch_add(1);
            return ctx_.recv_done(
                {reg.transfer_id, reg.attempt,
                 already_exists(fmt::format(
                     "transfer {:#x}: attempt {} is not newer than the registered attempt {}",
                     reg.transfer_id, reg.attempt, key.second)),
                 0, 0});
        }
        if (!c.cancelling) cancel_consumer(key, c, false);
    }
    uint32_t prefill_tp = static_cast<uint32_t>(reg.prefill_ranks.size());
    auto producers = producers_for_consumer(ctx_.cfg.self.total_heads(), prefill_tp,
                                            ctx_.cfg.self.tp_size, ctx_.cfg.self.tp_rank);
    if (!producers.ok()) return report_now(producers.status());
    const uint32_t span = imm_span();
    Consumer c;
    for (uint32_t rank : *producers) {
        auto peer = ctx_.engine->connect(reg.prefill_ranks[rank]);
        if (!peer.ok()) {
            return report_now(
                peer.status().with_context(fmt::format("connecting to prefill rank {}", rank)));
        }
        Slot s;
        s.rank = rank;
        s.peer = *peer;
        s.prefix = reg.first_token;  // decode holds the tokens before (its prefix cache)
        // A fresh span of immediates per (transfer, attempt, producer rank), none that a live
        // slot or waiter still counts on.
        const uint32_t spans = ctx_.cfg.imm_count / span;
        bool found = false;
        for (uint32_t tried = 0; tried < spans && !found; ++tried) {
            s.imm = ctx_.cfg.imm_base + (next_imm_++ % spans) * span;
            found = !live_spans_.count(s.imm);
        }
        if (!found) {
            return report_now(resource_exhausted(
                fmt::format("every one of the {} immediate spans is held by a live transfer; raise "
                            "ConnectorConfig::imm_count",
                            spans)));
        }
        c.slots.push_back(s);
    }
    for (const Slot& s : c.slots) hold_span(s.imm);
    c.deadline = Clock::now() + ctx_.cfg.lease;
    for (Slot& s : c.slots) s.deadline = c.deadline;
    c.progress = KvFrontier{reg.first_token};
    c.awake = ArrivalsExpected(ctx_.engine, Expected::kSignalled);
    for (const Slot& s : c.slots) {
        RegisterMsg m;
        m.transfer_id = reg.transfer_id;
        m.attempt = reg.attempt;
        m.decode_rank = ctx_.cfg.self.tp_rank;
        m.decode_tp = ctx_.cfg.self.tp_size;
        m.imm = s.imm;
        m.imm_span = span;
        m.num_tokens = reg.num_tokens;
        m.first_token = reg.first_token;
        m.lease_ms = to_ms_u32(ctx_.cfg.lease);
        m.decode_address = ctx_.engine->address();
        m.pool = ctx_.pool_descriptors;
        m.layout = ctx_.cfg.self.layout;
        m.blocks = reg.blocks;
        // The first message to a prefill rank often: posted again while this slot still
        // waits for it (see send()), not lost for the whole lease.
        ctx_.send(s.peer, m,
                  [this, key = ConsumerKey{reg.transfer_id, reg.attempt}, rank = s.rank] {
                      ConsumerIt it;
                      const Slot* slot = find_slot(key, rank, &it);
                      return slot && !resolved(slot->state) && !it->second.cancelling;
                  });
    }
    ctx_.counters.active_recv.fetch_add(1);
    consumers_.emplace(ConsumerKey{reg.transfer_id, reg.attempt}, std::move(c));
}

void PushReceiver::cancel_consumer(const ConsumerKey& key, Consumer& c, bool given_up) {
    c.cancelling = true;
    for (const Slot& s : c.slots) {
        // Complete slots need no ack: every segment of theirs was counted, every write landed.
        if (resolved(s.state)) continue;
        ctx_.send(s.peer, CancelMsg{key.first, key.second, ctx_.cfg.self.tp_rank, given_up});
    }
}

void PushReceiver::cancel(uint64_t id) {
    for (auto it = announces_.begin(); it != announces_.end(); ++it) {
        if (it->first.first == id) {
            return end_announce(it,
                                cancelled(fmt::format("transfer {:#x} was cancelled "
                                                      "before prefill scheduled it",
                                                      id)),
                                true);
        }
    }
    for (auto it = consumers_.begin(); it != consumers_.end(); ++it) {
        if (it->first.first == id && !it->second.cancelling) {
            cancel_consumer(it->first, it->second, true);
            check_consumer(it);
            return;
        }
    }
    log(LogLevel::kDebug, kLog, "cancel: transfer {:#x} is not registered here", id);
}

// Nothing of a gone process can land any more, and it will send neither FAIL nor CANCEL_ACK:
// waiting for them kept the blocks and the request until the lease (30 s by default).
void PushReceiver::peer_gone(PeerId peer, const Status& why) {
    for (auto it = announces_.begin(); it != announces_.end();) {
        auto next = std::next(it);
        bool theirs = std::any_of(it->second.ranks.begin(), it->second.ranks.end(),
                                  [&](const auto& r) { return r.second == peer; });
        if (theirs) end_announce(it, why, true);
        it = next;
    }
    for (auto it = consumers_.begin(); it != consumers_.end();) {
        auto next = std::next(it);
        for (Slot& s : it->second.slots) {
            if (s.peer != peer || resolved(s.state)) continue;
            // fail_slot may complete (and erase) the consumer: nothing of `it` is used after.
            fail_slot(it, s, why);
            break;
        }
        it = next;
    }
}

PushReceiver::Slot* PushReceiver::find_slot(const ConsumerKey& key, uint32_t producer_rank,
                                            ConsumerIt* out) {
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

// A closing SEGMENT (`last`) is this SEGMENT followed by FINAL, on one slot, as one message:
// one stale check, the totals taken first, so that counting the segment completes the slot.
void PushReceiver::on_segment(const SegmentMsg& m) {
    kv_trace("SEGMENT in", m.transfer_id);
    ConsumerIt it;
    Slot* s = find_slot({m.transfer_id, m.attempt}, m.producer_rank, &it);
    if (!s || resolved(s->state)) return ctx_.stale("SEGMENT for an unknown or finished transfer");
    if (m.last && s->have_final) return ctx_.stale("closing SEGMENT after the slot's FINAL");
    renew(it->second, *s);  // the producer is alive and sending
    const uint32_t span = imm_span();
    if (m.index < span) {
        // A second copy would wait for immediates that never come again.
        if (s->seen.empty()) s->seen.resize(span);
        if (s->seen[m.index]) return ctx_.stale("duplicate SEGMENT");
        s->seen[m.index] = true;
    }
    if (m.last) take_final(it->second, *s, *m.last);
    // Nothing to count for a transfer being cancelled (its CANCEL_ACK ends it), nor for a slot
    // the totals completed.
    if (it->second.cancelling || resolved(s->state)) return check_consumer(it);
    if (m.index >= span) {
        return fail_slot(
            it, *s,
            protocol_error(fmt::format("prefill rank {} sent segment {} beyond the span of {}",
                                       m.producer_rank, m.index, span)));
    }
    // Prefill announces a segment once its writes are posted (protocol 7), so the immediates
    // may all be here already (small writes, or a message that waited): count them at once,
    // with no waiter and no second pass through the inbox; else wait for the rest.
    if (m.writes == 0 || ctx_.engine->try_take_imm(s->imm + m.index, m.writes)) {
        return on_segment_counted(it->first, m.producer_rank, m, ok_status());
    }
    Duration left = std::max<Duration>(it->second.deadline - Clock::now(), Duration::zero());
    std::weak_ptr<Inbox> inbox = ctx_.inbox;
    ConsumerKey key = it->first;
    const uint32_t imm = s->imm;
    hold_span(imm);  // until the waiter fired: no registration gets these immediates
    ctx_.engine->on_imm(imm + m.index, m.writes, left,
                        [this, inbox, key, imm, m](const Status& st) {
                            auto in = inbox.lock();
                            if (!in) return;
                            in->post([this, key, imm, m, st] {
                                release_span(imm);
                                on_segment_counted(key, m.producer_rank, m, st);
                            });
                        });
}

void PushReceiver::on_segment_counted(const ConsumerKey& key, uint32_t rank, const SegmentMsg& m,
                                      const Status& st) {
    kv_trace("segment counted", m.transfer_id);
    ConsumerIt it;
    Slot* s = find_slot(key, rank, &it);
    if (!s || resolved(s->state)) return;
    if (!st.ok()) {
        return fail_slot(it, *s,
                         st.with_context(fmt::format("counting {} writes of segment {} from "
                                                     "prefill rank {}",
                                                     m.writes, m.index, rank)));
    }
    s->counted++;
    const uint32_t layers = ctx_.cfg.self.layout.num_layers;
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
    for (auto l = s->landed.find(s->prefix); l != s->landed.end(); l = s->landed.find(s->prefix)) {
        s->prefix = std::max(s->prefix, l->second);
        s->landed.erase(l);
    }
    Consumer& c = it->second;
    KvFrontier now = landed_frontier(c);
    KvPiece ahead;
    if (!c.cancelling && next_piece(c.progress, now, layers, &ahead)) {
        c.progress = now;
        ctx_.recv_progress(
            {key.first, key.second, now.tokens, now.partial_end, now.partial_layers});
    }
    if (s->have_final && s->counted == s->final_segments) s->state = SlotState::kComplete;
    check_consumer(it);
}

// What landed on every producer's slot: whole tokens up to the smallest prefix, and the
// layers every slot holds of the chunk after it (conservative where slots differ).
KvFrontier PushReceiver::landed_frontier(const Consumer& c) const {
    const uint32_t layers = ctx_.cfg.self.layout.num_layers;
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

void PushReceiver::fail_slot(ConsumerIt it, Slot& s, const Status& why) {
    s.state = SlotState::kFailed;
    Consumer& c = it->second;
    if (c.error.ok()) c.error = why;
    // Other producers may still be writing into these blocks: stop them and wait for
    // their acknowledgement before handing the blocks back.
    if (!c.cancelling) cancel_consumer(it->first, c, true);
    check_consumer(it);
}

void PushReceiver::on_final(const FinalMsg& m) {
    kv_trace("FINAL in", m.transfer_id);
    ConsumerIt it;
    Slot* s = find_slot({m.transfer_id, m.attempt}, m.producer_rank, &it);
    if (!s || resolved(s->state) || s->have_final) {
        return ctx_.stale("FINAL for an unknown, finished or superseded transfer");
    }
    take_final(it->second, *s, {m.writes, m.bytes, m.segments});
    check_consumer(it);
}

// FINAL's part (alone or in a closing SEGMENT): the slot completes once `segments` are counted.
void PushReceiver::take_final(Consumer& c, Slot& s, const JobTotals& t) {
    c.bytes += t.bytes;
    c.writes += t.writes;
    s.writes = t.writes;
    s.have_final = true;
    s.final_segments = t.segments;
    // The totals may come before the writes completed (protocol 7): only counting completes
    // the slot, and a cancelled one waits for its CANCEL_ACK (sent once the writes ended).
    if (t.segments <= s.counted) s.state = SlotState::kComplete;
}

void PushReceiver::on_fail(const FailMsg& m) {
    ConsumerIt it;
    Slot* s = find_slot({m.transfer_id, m.attempt}, m.sender_rank, &it);
    if (!s || resolved(s->state)) {
        auto a = announces_.find({m.transfer_id, m.attempt});
        if (a == announces_.end()) return ctx_.stale("FAIL for an unknown or finished transfer");
        return end_announce(
            a, Status(m.code, fmt::format("prefill rank {}: {}", m.sender_rank, m.reason)), false);
    }
    fail_slot(it, *s, Status(m.code, fmt::format("prefill rank {}: {}", m.sender_rank, m.reason)));
}

void PushReceiver::on_cancel_ack(const CancelAckMsg& m) {
    ConsumerIt it;
    Slot* s = find_slot({m.transfer_id, m.attempt}, m.producer_rank, &it);
    if (!s || resolved(s->state)) return ctx_.stale("CANCEL_ACK for an unknown or finished slot");
    s->state = SlotState::kAcked;
    check_consumer(it);
}

void PushReceiver::check_consumer(ConsumerIt it) {
    Consumer& c = it->second;
    for (const Slot& s : c.slots) {
        if (!resolved(s.state)) return;
    }
    TransferResult r{it->first.first, it->first.second, c.error, c.bytes, c.writes};
    if (r.status.ok() && c.cancelling) {
        r.status =
            cancelled(fmt::format("transfer {:#x} attempt {} was cancelled or "
                                  "superseded",
                                  r.transfer_id, r.attempt));
    }
    complete_recv(it, r);
}

void PushReceiver::hold_span(uint32_t imm) { live_spans_[imm]++; }

void PushReceiver::release_span(uint32_t imm) {
    auto it = live_spans_.find(imm);
    if (it != live_spans_.end() && --it->second == 0) live_spans_.erase(it);
}

uint32_t PushReceiver::imm_span() const {
    return std::max<uint32_t>(1, std::min(ctx_.cfg.imm_span, ctx_.cfg.imm_count));
}

void PushReceiver::complete_recv(ConsumerIt it, const TransferResult& r) {
    for (const Slot& s : it->second.slots) release_span(s.imm);
    (r.status.ok() ? ctx_.counters.transfers_received : ctx_.counters.transfers_failed)
        .fetch_add(1);
    ctx_.counters.active_recv.fetch_sub(1);
    consumers_.erase(it);
    ctx_.ids.release(r.transfer_id, r.attempt, TransferIds::Kind::kRegistered);
    kv_trace("recv_done", r.transfer_id);
    ctx_.recv_done(r);
}

void PushReceiver::expire_consumer(ConsumerIt it) {
    Consumer& c = it->second;
    ctx_.counters.leases_expired.fetch_add(1);
    std::string missing;
    for (const Slot& s : c.slots) {
        if (resolved(s.state)) continue;
        missing += fmt::format("{}{}", missing.empty() ? "" : ",", s.rank);
        ctx_.send(s.peer,
                  CancelMsg{it->first.first, it->first.second, ctx_.cfg.self.tp_rank, true});
    }
    Status why = timeout_error(
        fmt::format("prefill ranks {} did not complete transfer {:#x} within the {:.0f} ms lease",
                    missing, it->first.first, to_ms(ctx_.cfg.lease)));
    log(LogLevel::kWarn, kLog, "{}", why.message());
    complete_recv(
        it, {it->first.first, it->first.second, c.error.ok() ? why : c.error, c.bytes, c.writes});
}

void PushReceiver::renew(Consumer& c, Slot& s) {
    s.deadline = Clock::now() + ctx_.cfg.lease;
    c.deadline = std::max(c.deadline, s.deadline);
}

void PushReceiver::engine_failed(const Status& why, TimePoint at) {
    engine_error_ = why;
    engine_fail_at_ = at;
}

void PushReceiver::expire(TimePoint now) {
    if (!engine_error_.ok() && now >= engine_fail_at_) {
        while (!announces_.empty()) end_announce(announces_.begin(), engine_error_, false);
        // No CANCEL_ACK can come through the lost rail: the consumers end now (their CANCELs
        // are tried all the same, for a prefill rank reached on another rail).
        while (!consumers_.empty()) {
            auto it = consumers_.begin();
            for (const Slot& s : it->second.slots) {
                if (!resolved(s.state))
                    ctx_.send(s.peer, CancelMsg{it->first.first, it->first.second,
                                                ctx_.cfg.self.tp_rank, true});
            }
            complete_recv(it, {it->first.first, it->first.second, engine_error_, it->second.bytes,
                               it->second.writes});
        }
    }
    for (auto it = consumers_.begin(); it != consumers_.end();) {
        auto next = std::next(it);
        const auto& slots = it->second.slots;
        bool late = std::any_of(slots.begin(), slots.end(), [&](const Slot& s) {
            return !resolved(s.state) && now > s.deadline;
        });
        if (late || now > it->second.deadline) expire_consumer(it);
        it = next;
    }
    for (auto it = announces_.begin(); it != announces_.end();) {
        auto next = std::next(it);
        if (now > it->second.deadline) {
            ctx_.counters.leases_expired.fetch_add(1);
            end_announce(it,
                         timeout_error(fmt::format("prefill did not schedule transfer {:#x} "
                                                   "within the {:.0f} ms lease",
                                                   it->first.first, to_ms(ctx_.cfg.lease))),
                         true);
        }
        it = next;
    }
}

void PushReceiver::begin_shutdown() {
    for (auto& [key, c] : consumers_) {
        if (!c.cancelling) cancel_consumer(key, c, true);
    }
}

void PushReceiver::report_shut_down(const Status& why) {
    while (!consumers_.empty()) {
        auto it = consumers_.begin();
        complete_recv(it, {it->first.first, it->first.second, why, 0, 0});
    }
    while (!announces_.empty()) end_announce(announces_.begin(), why, false);
}

}  // namespace ferry::kv::detail
