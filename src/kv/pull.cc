// PullServer and Puller: see pull.h; the pull protocol in docs/PROTOCOL.md.
#include "pull.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "ferry/common/auth.h"
#include "ferry/common/bytes.h"
#include "ferry/common/log.h"
#include "pull_windows.h"
#include "segment_writes.h"

namespace ferry::kv::detail {

void PullServer::offer(const PullParamsMsg& params,
                       std::vector<std::unique_ptr<MemoryRegion>> windows) {
    const uint64_t id = params.transfer_id;
    auto [it, fresh] = offers_.try_emplace(id);
    if (!fresh) {
        // offer_pull's id check refuses a second offer of a live id before it comes here.
        log(LogLevel::kWarn, kLog, "transfer {:#x}: offered for pull twice; ignored", id);
        return;
    }
    ended_.erase(id);
    it->second.deadline = Clock::now() + ctx_.cfg.lease;
    it->second.capability = params.capability;
    it->second.windows = std::move(windows);
    it->second.params = params;
    it->second.awake = ArrivalsExpected(ctx_.engine);
    ctx_.counters.active_send.fetch_add(1);
    auto [afirst, alast] = asks_.equal_range(id);
    for (auto a = afirst; a != alast; ++a) answer(a->second.from, a->second.ask, it->second);
    asks_.erase(afirst, alast);
    auto [first, last] = early_.equal_range(id);
    std::vector<DoneMsg> early;
    for (auto e = first; e != last; ++e) early.push_back(e->second.done);
    early_.erase(first, last);
    for (const DoneMsg& m : early) on_done(m);  // may end the offer
}

void PullServer::on_ask(const PullAskMsg& m) {
    auto peer = ctx_.engine->connect(m.decode_address);
    if (!peer.ok()) {
        log(LogLevel::kWarn, kLog, "transfer {:#x}: PULL_ASK from an unreachable decode: {}",
            m.transfer_id, peer.status().to_string());
        return ctx_.stale("PULL_ASK from an unreachable decode");
    }
    const PeerId from = *peer;
    auto it = offers_.find(m.transfer_id);
    if (it != offers_.end()) return answer(from, m, it->second);
    if (ended_.count(m.transfer_id)) {
        return refuse(
            from, m,
            not_found("the pull offer has ended (read and DONE'd, withdrawn, or its lease "
                      "passed): its blocks may hold another request's KV now; not served"));
    }
    if (asks_.size() >= kMaxEarlyAsks) {
        return refuse(from, m,
                      resource_exhausted(fmt::format("{} asks already wait for offers not made yet",
                                                     kMaxEarlyAsks)));
    }
    Duration wait = std::min<Duration>(std::chrono::milliseconds(m.wait_ms), ctx_.cfg.lease);
    asks_.emplace(m.transfer_id, EarlyAsk{from, m, Clock::now() + wait});
}

void PullServer::answer(PeerId from, const PullAskMsg& m, const Offer& o) {
    // Only the reader the offer was made to (its capability) learns the offer's keys.
    if (!constant_time_equal(o.capability, m.capability)) {
        log(LogLevel::kWarn, kLog,
            "transfer {:#x}: PULL_ASK with a wrong capability (not the reader it was offered "
            "to); refused",
            m.transfer_id);
        return refuse(from, m,
                      permission_denied("the ask's capability is not the offer's (parameters of "
                                        "another request, or altered ones)"));
    }
    PullParamsMsg p = o.params;
    auto left = std::chrono::ceil<std::chrono::milliseconds>(o.deadline - Clock::now());
    p.lease_ms = static_cast<uint32_t>(std::max<int64_t>(left.count(), 0));
    // The windows go in as many parts as they need, each a message of at most
    // max_message_size repeating what decode checks (PROTOCOL.md, "Pull offer keys").
    const size_t limit = ctx_.engine->config().max_message_size;
    std::vector<PullWindow> windows = std::move(p.windows);
    p.windows.clear();
    const size_t head = encode_message(p).size();
    std::vector<size_t> sizes;
    for (const PullWindow& win : windows) {
        ByteWriter w;
        w.put(win.region);
        w.put(win.offset);
        win.desc.encode(w);
        sizes.push_back(w.bytes().size());
    }
    const size_t widest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
    if (head + widest > limit) {
        return refuse(from, m,
                      resource_exhausted(fmt::format(
                          "the offer's parameters ({} bytes with its widest window) do not fit a "
                          "message of {} bytes (EngineConfig::max_message_size): raise it on "
                          "both sides",
                          head + widest, limit)));
    }
    std::vector<std::pair<size_t, size_t>> parts;  // [first, end) of `windows`
    size_t bytes = limit;
    for (size_t i = 0; i < windows.size(); ++i) {
        if (bytes + sizes[i] > limit) {
            parts.push_back({i, i});
            bytes = head;
        }
        parts.back().second = i + 1;
        bytes += sizes[i];
    }
    if (parts.size() <= 1) {
        p.windows = std::move(windows);
        return ctx_.send(from, p);
    }
    p.windows_total = static_cast<uint32_t>(windows.size());
    for (auto [first, end] : parts) {
        p.windows_first = static_cast<uint32_t>(first);
        p.windows.assign(windows.begin() + static_cast<std::ptrdiff_t>(first),
                         windows.begin() + static_cast<std::ptrdiff_t>(end));
        ctx_.send(from, p);
    }
}

void PullServer::refuse(PeerId from, const PullAskMsg& m, const Status& why) {
    log(LogLevel::kInfo, kLog, "transfer {:#x}: PULL_ASK refused: {}", m.transfer_id,
        why.to_string());
    ctx_.send(from, FailMsg{m.transfer_id, 0, ctx_.cfg.self.tp_rank, why.code(),
                            std::string(why.message())});
}

void PullServer::ended(uint64_t id) {
    if (ended_.size() < kMaxEnded) ended_[id] = Clock::now() + ctx_.cfg.lease;
}

void PullServer::on_done(const DoneMsg& m) {
    auto it = offers_.find(m.transfer_id);
    if (it == offers_.end()) {
        if (early_.size() >= kMaxEarlyDones) {
            return ctx_.stale("DONE for an unknown or expired pull offer (early DONEs full)");
        }
        early_.emplace(m.transfer_id, EarlyDone{m, Clock::now() + ctx_.cfg.lease});
        return;
    }
    Offer& o = it->second;
    // A DONE naming a transfer it was not offered must not free (or end) that transfer.
    if (!constant_time_equal(o.capability, m.capability)) {
        log(LogLevel::kWarn, kLog,
            "transfer {:#x}: DONE with a wrong capability (not the reader it was offered "
            "to); ignored",
            m.transfer_id);
        return ctx_.stale("DONE with a wrong capability");
    }
    if (std::find(o.done_ranks.begin(), o.done_ranks.end(), m.decode_rank) != o.done_ranks.end()) {
        return ctx_.stale("duplicate DONE");
    }
    o.done_ranks.push_back(m.decode_rank);
    o.all_ok = o.all_ok && m.ok;
    auto readers = consumers_for_producer(ctx_.cfg.self.total_heads(), ctx_.cfg.self.tp_size,
                                          m.decode_tp, ctx_.cfg.self.tp_rank);
    if (readers.ok() && o.done_ranks.size() < readers->size()) return;
    Status s = o.all_ok ? ok_status() : cancelled("a decode rank gave up reading");
    (s.ok() ? ctx_.counters.transfers_sent : ctx_.counters.transfers_failed).fetch_add(1);
    ctx_.counters.active_send.fetch_sub(1);
    offers_.erase(it);
    ended(m.transfer_id);
    ctx_.ids.release(m.transfer_id, 0, TransferIds::Kind::kOffered);
    ctx_.send_done({m.transfer_id, 0, s, 0, 0});
}

// Runs on the connector thread (background) or the caller's thread (inline); touches no
// connector state, only the job, the engine and atomics.

bool PullServer::withdraw(uint64_t id, const Status& reason) {
    auto o = offers_.find(id);
    if (o == offers_.end()) return false;
    // A read decode may still have in flight reads a transfer that is being aborted on both
    // legs; its result is thrown away.
    ctx_.counters.transfers_failed.fetch_add(1);
    ctx_.counters.active_send.fetch_sub(1);
    offers_.erase(o);
    ended(id);
    ctx_.ids.release(id, 0, TransferIds::Kind::kOffered);
    ctx_.send_done({id, 0, reason, 0, 0});
    return true;
}

void PullServer::expire(TimePoint now) {
    std::erase_if(ended_, [&](const auto& e) { return now > e.second; });
    for (auto a = asks_.begin(); a != asks_.end();) {
        if (now > a->second.deadline) {
            refuse(a->second.from, a->second.ask,
                   timeout_error("no offer of this transfer was made within the ask's wait"));
            a = asks_.erase(a);
        } else {
            ++a;
        }
    }
    for (auto e = early_.begin(); e != early_.end();) {
        if (now > e->second.deadline) {
            ctx_.stale("DONE for an unknown or expired pull offer");
            e = early_.erase(e);
        } else {
            ++e;
        }
    }
    for (auto it = offers_.begin(); it != offers_.end();) {
        auto next = std::next(it);
        if (now > it->second.deadline) {
            ctx_.counters.leases_expired.fetch_add(1);
            ctx_.counters.transfers_failed.fetch_add(1);
            ctx_.counters.active_send.fetch_sub(1);
            uint64_t id = it->first;
            offers_.erase(it);
            ended(id);
            ctx_.ids.release(id, 0, TransferIds::Kind::kOffered);
            log(LogLevel::kWarn, kLog, "transfer {:#x}: pull offer lease expired", id);
            ctx_.send_done({id, 0,
                            timeout_error("no DONE from decode within the lease; blocks released"),
                            0, 0});
        }
        it = next;
    }
}

void PullServer::report_shut_down(const Status& why) {
    early_.clear();
    for (auto& [id, a] : asks_) refuse(a.from, a.ask, why);
    asks_.clear();
    while (!offers_.empty()) {
        auto it = offers_.begin();
        uint64_t id = it->first;
        offers_.erase(it);
        ctx_.ids.release(id, 0, TransferIds::Kind::kOffered);
        ctx_.counters.transfers_failed.fetch_add(1);
        ctx_.counters.active_send.fetch_sub(1);
        ctx_.send_done({id, 0, why, 0, 0});
    }
}

void Puller::start(const std::shared_ptr<Job>& job) {
    auto fail = [&](const Status& s) { ctx_.inbox->post([this, job, s] { finish(job, s); }); };
    const PullParamsMsg& any = job->params.front();
    auto producers = producers_for_consumer(ctx_.cfg.self.total_heads(), any.producer_tp,
                                            ctx_.cfg.self.tp_size, ctx_.cfg.self.tp_rank);
    if (!producers.ok()) return fail(producers.status());
    std::vector<std::pair<size_t, SegmentPlan>> plans;
    std::vector<std::vector<std::vector<WindowRuns>>> windowed;  // per plan, per group
    for (uint32_t rank : *producers) {
        auto pit = std::find_if(job->params.begin(), job->params.end(),
                                [&](const PullParamsMsg& p) { return p.producer_rank == rank; });
        if (pit == job->params.end()) {
            return fail(invalid_argument(
                fmt::format("pull: no transfer parameters from prefill rank {}", rank)));
        }
        size_t idx = static_cast<size_t>(pit - job->params.begin());
        auto peer = ctx_.engine->connect(pit->prefill_address);
        if (!peer.ok()) {
            return fail(
                peer.status().with_context(fmt::format("connecting to prefill rank {}", rank)));
        }
        job->sources.push_back({*peer, idx});
        if (pit->num_tokens != job->tokens) {
            return fail(
                invalid_argument(fmt::format("prefill rank {} offers {} tokens, decode expects {}",
                                             rank, pit->num_tokens, job->tokens)));
        }
        Status pool_ok = check_pool_descriptors(pit->pool, pit->layout);
        if (!pool_ok.ok()) {
            return fail(pool_ok.with_context(fmt::format("pull offer of prefill rank {}", rank)));
        }
        auto plan =
            plan_segment({KvRank{pit->layout, pit->producer_rank, pit->producer_tp}, pit->blocks,
                          ctx_.cfg.self, job->blocks, job->first_token, job->tokens},
                         pools_on_gpu(*ctx_.engine, *peer, ctx_.pool, pit->pool));
        if (!plan.ok()) return fail(plan.status());
        // The offer's own registrations (PullKeys::kPerOffer): each run goes through the one
        // holding it, under its key; checked before anything is posted.
        std::vector<std::vector<WindowRuns>> split;
        if (!pit->windows.empty() && !plan->on_gpu) {
            for (const RegionRuns& g : plan->runs.groups) {
                auto by_window = runs_by_window(
                    pit->windows, g.src_region,
                    std::span<const ByteRun>(plan->runs.runs).subspan(g.first, g.count));
                if (!by_window.ok()) {
                    return fail(by_window.status().with_context(
                        fmt::format("pull offer of prefill rank {}", rank)));
                }
                split.push_back(std::move(*by_window));
            }
        }
        plans.emplace_back(idx, std::move(*plan));
        windowed.push_back(std::move(split));
    }
    kv_trace("pull planned", job->id);
    uint32_t lease_ms = UINT32_MAX;
    for (const PullParamsMsg& p : job->params) lease_ms = std::min(lease_ms, p.lease_ms);
    job->offers_end = Clock::now() + std::chrono::milliseconds(lease_ms);
    job->repost_until = job->offers_end - ctx_.engine->config().op_timeout;
    auto flight = ctx_.new_flight([this, job](const Status& s) { finish(job, s); });
    for (size_t i = 0; i < plans.size(); ++i) {
        const auto& [idx, plan] = plans[i];
        // One operation per source: between GPUs one batched copy instead of one per run
        // (a 16k-token pull was 128 copies, 0.62 ms against push's 0.44).
        // And one per (region, region) pair of a pool of several regions; between GPUs of
        // this host one block copy for every region.
        if (plan.on_gpu) {
            post_block_copy(*ctx_.engine, plan, job->sources[i].peer, true, ctx_.pool,
                            job->params[idx].pool, std::nullopt, *flight);
        }
        for (size_t gi = 0; gi < plan.runs.groups.size(); ++gi) {
            const RegionRuns& g = plan.runs.groups[gi];
            ReadRunsOp op;
            op.peer = job->sources[i].peer;
            op.dst = ctx_.pool.regions[g.dst_region];
            op.src = &job->params[idx].pool[g.src_region];
            op.runs = std::span<const ByteRun>(plan.runs.runs).subspan(g.first, g.count);
            if (windowed[i].empty()) {
                flight->add();
                post_read(job, op, flight, 0,
                          "reading prefill's pool under the pool's own keys (an offer under "
                          "PullKeys::kPool, or parameters built from its handshake): a prefill "
                          "under PullKeys::kPerOffer registers its pool without peer reads, so "
                          "such a read fails");
                continue;
            }
            for (const WindowRuns& w : windowed[i][gi]) {
                flight->add();
                op.src = &w.window->desc;
                op.runs = w.runs;  // kept in job->windowed until the job ends (read again)
                // The provider's own words say little: tcp reports a refused key as a cancelled
                // read, and drops the connection (the reads after it fail as not connected).
                post_read(job, op, flight, 0,
                          "reading a pull offer under its own keys, which prefill closes when the "
                          "offer ends (DONE sent, withdrawn, lease passed): a read after that "
                          "fails");
            }
        }
        job->reads += static_cast<uint32_t>(plan.operations());
        job->bytes += plan.bytes();
        ctx_.counters.ops_posted.fetch_add(plan.operations());
        ctx_.counters.bytes_posted.fetch_add(plan.bytes());
    }
    for (auto& p : plans) {
        if (!p.second.on_gpu) job->plans.push_back(std::move(p.second.runs));
    }
    job->windowed = std::move(windowed);  // the runs' storage stays where the reads point
    flight->done(ok_status());
    // Known to peer_gone from here (start may run on the caller's thread).
    ctx_.inbox->post([this, job] { running_.push_back(job); });
    kv_trace("pull posted", job->id);
}

void Puller::ask(const std::shared_ptr<Job>& job, Duration wait) {
    const uint32_t wait_ms = to_ms_u32(wait);
    for (const PullParamsMsg& p : job->params) {
        auto peer = ctx_.engine->connect(p.prefill_address);
        if (!peer.ok()) {
            return finish(job, peer.status().with_context(
                                   fmt::format("connecting to prefill rank {}", p.producer_rank)));
        }
        job->asked.emplace_back().peer = *peer;
    }
    job->ask_deadline = Clock::now() + wait + ctx_.engine->config().op_timeout;
    asking_[job->id] = job;
    for (size_t i = 0; i < job->params.size(); ++i) {
        const PullParamsMsg& p = job->params[i];
        ctx_.send(job->asked[i].peer,
                  PullAskMsg{job->id, ctx_.cfg.self.tp_rank, wait_ms, p.capability,
                             ctx_.engine->address()},
                  [this, id = job->id] { return asking_.count(id) != 0; });
    }
    kv_trace("pull asked", job->id);
}

void Puller::on_params(uint64_t sender, const PullParamsMsg& m) {
    auto it = asking_.find(m.transfer_id);
    if (it == asking_.end()) return ctx_.stale("PULL_PARAMS for no pull that asked");
    const std::optional<PeerId> from = ctx_.engine->find_peer(sender);
    std::shared_ptr<Job> job = it->second;
    size_t i = 0;
    while (i < job->params.size() && (job->asked[i].peer != from || job->asked[i].parts.complete ||
                                      job->params[i].producer_rank != m.producer_rank)) {
        ++i;
    }
    if (i == job->params.size()) return ctx_.stale("PULL_PARAMS from a rank that was not asked");
    const PullParamsMsg& mine = job->params[i];
    Job::Asked& a = job->asked[i];
    const bool first_part = !a.answered;
    a.answered = true;  // its offer runs: DONE{ok=0} ends it
    if (!constant_time_equal(mine.capability, m.capability) || mine.blocks != m.blocks ||
        mine.num_tokens != m.num_tokens || mine.producer_tp != m.producer_tp) {
        asking_.erase(it);
        return give_up(job, invalid_argument(fmt::format(
                                "prefill rank {}'s live offer is not the one the request named "
                                "(other blocks, tokens, TP size or capability)",
                                m.producer_rank)));
    }
    if (auto bad = collect_part(a.parts, m, first_part); !bad.ok()) {
        asking_.erase(it);
        return give_up(
            job, bad.with_context(fmt::format(
                     "prefill rank {}'s answer to the ask for its pull offer", m.producer_rank)));
    }
    if (!a.parts.complete) return;  // more parts to come (bounded by ask_deadline)
    job->params[i] = m;             // the offer's own keys, and the lease it has left
    job->params[i].windows = std::move(a.parts.windows);
    job->params[i].windows_first = job->params[i].windows_total = 0;
    a.parts.have.clear();
    if (std::all_of(job->asked.begin(), job->asked.end(),
                    [](const Job::Asked& x) { return x.parts.complete; })) {
        asking_.erase(it);
        start(job);
    }
}

bool Puller::on_refused(uint64_t sender, const FailMsg& m) {
    auto it = asking_.find(m.transfer_id);
    if (it == asking_.end()) return false;
    const std::optional<PeerId> from = ctx_.engine->find_peer(sender);
    std::shared_ptr<Job> job = it->second;
    bool ours = std::any_of(job->asked.begin(), job->asked.end(), [&](const Job::Asked& a) {
        return a.peer == from && !a.parts.complete;
    });
    if (!ours) return false;
    asking_.erase(it);
    give_up(job, Status(m.code, m.reason)
                     .with_context(fmt::format("prefill rank {} refused to give its pull offer",
                                               m.sender_rank)));
    return true;
}

void Puller::expire(TimePoint now) {
    std::vector<std::shared_ptr<Job>> late;
    for (auto it = asking_.begin(); it != asking_.end();) {
        if (now > it->second->ask_deadline) {
            late.push_back(it->second);
            it = asking_.erase(it);
        } else {
            ++it;
        }
    }
    for (const auto& job : late) {
        give_up(job, timeout_error("no answer from prefill to the ask for its pull offer (is "
                                   "prefill up, and did it offer this transfer?)"));
    }
}

void Puller::report_shut_down(const Status& why) {
    auto jobs = std::move(asking_);
    asking_.clear();
    for (auto& [id, job] : jobs) give_up(job, why);
}

void Puller::give_up(const std::shared_ptr<Job>& job, const Status& why) {
    // The ranks that answered hold a live offer for this pull: DONE{ok=0} ends it now rather
    // than at its lease (finish sends it to the sources).
    for (size_t i = 0; i < job->asked.size(); ++i) {
        if (job->asked[i].answered) job->sources.push_back({job->asked[i].peer, i});
    }
    finish(job, why);
}

void Puller::post_read(const std::shared_ptr<Job>& job, const ReadRunsOp& op,
                       const std::shared_ptr<Flight>& flight, uint32_t tries, const char* context) {
    std::weak_ptr<Inbox> weak = ctx_.inbox;
    ctx_.engine->read_runs(op, [this, weak, job, op, flight, tries, context](const Status& s) {
        if (s.code() == StatusCode::kTimeout && Clock::now() < job->repost_until) {
            // Posted again from the connector thread, which owns the job's state and sees a
            // job reported (failed by peer_gone meanwhile).
            auto in = weak.lock();
            if (in && in->post([this, job, op, flight, tries, context, s] {
                    if (job->reported) return flight->done(s);
                    if (!never_posted(s)) job->late_reads = true;
                    log(LogLevel::kWarn, kLog, "transfer {:#x}: {}; read again (try {})", job->id,
                        s.to_string(), tries + 2);
                    post_read(job, op, flight, tries + 1, context);
                })) {
                return;
            }
        }
        flight->done(context && !s.ok() ? s.with_context(context) : s);
    });
}

void Puller::peer_gone(PeerId peer, const Status& why) {
    std::vector<std::shared_ptr<Job>> asked_them;
    for (auto it = asking_.begin(); it != asking_.end();) {
        const auto& asked = it->second->asked;
        if (std::any_of(asked.begin(), asked.end(),
                        [&](const Job::Asked& a) { return a.peer == peer; })) {
            asked_them.push_back(it->second);
            it = asking_.erase(it);
        } else {
            ++it;
        }
    }
    for (const auto& job : asked_them) give_up(job, why);
    std::vector<std::shared_ptr<Job>> theirs;
    for (auto it = running_.begin(); it != running_.end();) {
        auto job = it->lock();
        if (!job || job->reported) {
            it = running_.erase(it);
            continue;
        }
        if (std::any_of(job->sources.begin(), job->sources.end(),
                        [&](const Job::Source& s) { return s.peer == peer; }))
            theirs.push_back(std::move(job));
        ++it;
    }
    for (const auto& job : theirs) {
        job->released = true;  // nothing of a gone process lands in the blocks any more
        finish(job, why);
    }
}

void Puller::finish(const std::shared_ptr<Job>& job, const Status& s) {
    if (job->reported) return;  // failed by peer_gone; its reads ended since
    kv_trace("pull drained", job->id);
    if ((!s.ok() || job->late_reads) && !job->plans.empty() && !job->released) {
        // A read that timed out (the pull failed, or it was read again) is still carried out
        // by a software provider (tcp) when prefill answers, however late: the blocks would be
        // handed back for reuse, or hold KV decode computes on, and then be overwritten (with
        // what prefill's reused blocks hold by then). Report once the engine holds no read into
        // them (or after one more op_timeout, logged).
        std::vector<std::span<const uint8_t>> spans;
        for (const TransferPlan& plan : job->plans) {
            for (const RegionRuns& g : plan.groups) {
                const auto* base =
                    static_cast<const uint8_t*>(ctx_.pool.regions[g.dst_region]->data());
                for (size_t i = g.first; i < g.first + g.count; ++i) {
                    spans.emplace_back(base + plan.runs[i].dst_offset, plan.runs[i].length);
                }
            }
        }
        job->released = true;
        auto flight = ctx_.new_flight([this, job, s](const Status&) { finish(job, s); });
        ctx_.engine->when_released(std::move(spans), ctx_.engine->config().op_timeout,
                                   [flight](size_t) { flight->done(ok_status()); });
        return;
    }
    job->plans.clear();
    job->reported = true;
    std::erase_if(running_, [&](const std::weak_ptr<Job>& w) {
        auto j = w.lock();
        return !j || j == job;
    });
    for (const Job::Source& src : job->sources) {
        // Posted again while the offers may still hold the blocks (see send()): a DONE the
        // provider never took left prefill holding them for its whole lease (issue 32).
        ctx_.send(src.peer,
                  DoneMsg{job->id, ctx_.cfg.self.tp_rank, ctx_.cfg.self.tp_size, s.ok(),
                          job->params[src.param].capability},
                  [until = job->offers_end] { return Clock::now() < until; });
    }
    (s.ok() ? ctx_.counters.transfers_received : ctx_.counters.transfers_failed).fetch_add(1);
    ctx_.counters.active_recv.fetch_sub(1);
    ctx_.ids.release(job->id, 0, TransferIds::Kind::kPulling);
    kv_trace("pull recv_done", job->id);
    ctx_.recv_done({job->id, 0, s, job->bytes, job->reads});
}

}  // namespace ferry::kv::detail
