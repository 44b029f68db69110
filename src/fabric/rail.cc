// Rail: the worker loop (submissions, posting, naps). Completions are in rail_completions.cc;
// opening and closing a rail (and its fresh initiator endpoints) in rail_setup.cc; deadlines
// and dead peers in rail_deadlines.cc.
#include "fabric/rail.h"

#include <fmt/format.h>
#include <pthread.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>

#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"

namespace ferry::detail {
namespace {

// Asks for an operation's other lines, and its owner's, while the worker is still popping the
// rest of the batch: the submitting thread wrote them all, so each is a miss on this core, and
// the post and the completion would otherwise take them one by one. Single 64 B writes on the
// 16-core host (shm, 2026-12-02, one build): 425k writes/s (0.65x) without, 564k (0.80x) with.
// Only the lines the submitting thread wrote: the context's (FabricOp::ctx) are this thread's.
void prefetch_op(const FabricOp* op) {
    const auto* p = reinterpret_cast<const char*>(op);
    for (size_t off = 64; off < kFabricOpSharedBytes; off += 64) __builtin_prefetch(p + off, 1, 3);
    if (const OpState* s = op->parent) {
        // An OpState is a block of whole lines of its own (OpPool, 64-byte aligned).
        const auto* base = reinterpret_cast<const char*>(s);
        for (size_t off = 0; off < sizeof(OpState); off += 64) __builtin_prefetch(base + off, 1, 3);
    }
}

// A RailStats counter that only the worker writes: a load and a store, no locked add.
void bump(std::atomic<uint64_t>& counter, uint64_t n) {
    counter.store(counter.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
}

// See post_pending: how many bytes of writes with completions a pass posts before it reads
// the completion queue.
constexpr size_t kPollAfterBytes = 256 * 1024;

}  // namespace

Status fi_status(const char* what, int rc) {
    return provider_error(fmt::format("{} failed: {} ({})", what, fi_strerror(-rc), rc));
}

Status Rail::post_recv(int slot) {
    void* desc = recv_mr_ ? fi_mr_desc(recv_mr_) : nullptr;
    CallGuard g(calls_);
    while (true) {
        ssize_t rc = fi_recv(ep_, recv_pool_.data() + slot * slot_size_, slot_size_, desc,
                             FI_ADDR_UNSPEC, &recv_ctx_[slot].fi);
        if (rc == 0) return ok_status();
        if (rc != -FI_EAGAIN) return fi_status("fi_recv", static_cast<int>(rc));
        // The receive queue is full only transiently; progress the CQ to drain it.
        fi_cq_data_entry e;
        fi_cq_read(cq_, &e, 0);
    }
}

void Rail::start() {
    running_ = true;
    worker_ = std::thread([this] {
        set_thread_name(fmt::format("ferry-rail{}", index_).c_str());
        run();
    });
    clockid_t id;
    if (pthread_getcpuclockid(worker_.native_handle(), &id) == 0) {
        cpu_clock_ = id;
        has_cpu_clock_ = true;
    }
}

std::optional<Duration> Rail::worker_cpu_time() const {
    timespec ts{};
    if (!has_cpu_clock_ || clock_gettime(cpu_clock_, &ts) != 0) return std::nullopt;
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

void Rail::wake() {
    if (!sleeping_.load(std::memory_order_relaxed)) return;
    std::lock_guard lk(nap_mu_);
    wake_ = true;
    nap_cv_.notify_one();
}

void Rail::submit(FabricOp* first, FabricOp* last) {
    if (wedged()) {
        for (FabricOp* op = first; op;) {
            FabricOp* next = op == last ? nullptr : static_cast<FabricOp*>(op->mpsc_next.load());
            op->parent->piece_done(unavailable(fmt::format(
                "rail {} is wedged inside the provider (a peer died mid-operation?); create a "
                "new engine to continue",
                index_)));
            delete op;
            op = next;
        }
        return;
    }
    queue_.push_chain(first, last);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_relaxed)) {
        std::lock_guard lk(nap_mu_);
        wake_ = true;
        nap_cv_.notify_one();
    }
}

Status Rail::run_task(std::shared_ptr<WorkerTask> task, Duration timeout) {
    // The task's result lives in `task`, owned by the caller and the worker together. fn used
    // to write it into the caller's frame (the MR register_on_rails opens, the fi_addr_t of
    // PeerTable::connect): a task still running when its caller gave up wrote into a dead
    // frame, and what it produced had no owner.
    OpHandle h(post_task(
        [task]() -> Status {
            int queued = WorkerTask::kQueued;
            if (!task->phase.compare_exchange_strong(queued, WorkerTask::kRunning))
                return cancelled("engine task abandoned by its caller");
            task->run();
            int running = WorkerTask::kRunning;
            if (!task->phase.compare_exchange_strong(running, WorkerTask::kDone)) {
                task->release();
                return cancelled("engine task finished after its caller gave up; released");
            }
            return ok_status();
        },
        OpCallback{}));
    Status s = h.wait(timeout);
    if (task->phase.load() == WorkerTask::kDone) return ok_status();
    if (h.done()) return s;  // never ran: the rail stopped or is wedged
    int queued = WorkerTask::kQueued;
    if (task->phase.compare_exchange_strong(queued, WorkerTask::kAbandoned)) {
        return timeout_error(fmt::format(
            "rail {}'s worker did not take an engine task within {:.0f} ms (busy, or inside a "
            "slow provider call); the task will not run",
            index_, to_ms(timeout)));
    }
    // Running: a slow provider call gets the caller's time once more. One that never returns
    // is the watchdog's to report (the rail is marked wedged).
    (void)h.wait(timeout);
    int running = WorkerTask::kRunning;
    if (task->phase.compare_exchange_strong(running, WorkerTask::kAbandoned)) {
        log(LogLevel::kError, "fabric",
            "rail {}: an engine task is still inside the provider after {:.0f} ms; giving up "
            "on it (what it produces is released when it returns)",
            index_, to_ms(2 * timeout));
        return timeout_error(fmt::format(
            "rail {}'s worker is still inside an engine task after {:.0f} ms (a slow provider "
            "call); what the task produces will be released when it returns",
            index_, to_ms(2 * timeout)));
    }
    return ok_status();  // it finished in the meantime
}

Status Rail::run_on_worker(std::function<Status()> fn, Duration timeout) {
    struct Done {};
    Result<Done> r = run_on_worker<Done>(
        [fn = std::move(fn)]() -> Result<Done> {
            Status s = fn();
            if (!s.ok()) return s;
            return Done{};
        },
        timeout);
    return r.ok() ? ok_status() : r.status();
}

OpRef Rail::post_task(std::function<Status()> fn, OpCallback done) {
    OpRef state = make_op_state(std::move(done));
    state->set_pieces(1);
    auto* op = new FabricOp();
    op->type = FabricOp::kTask;
    op->extra = std::make_unique<FabricOpExtra>();
    op->extra->task = std::move(fn);
    op->parent = state.get();
    op->deadline = TimePoint::max();  // tasks run when popped; stop() fails those left
    submit(op);
    return state;
}

std::string Rail::describe(const FabricOp* op) const {
    switch (op->type) {
        case FabricOp::kWrite:
            return op->has_imm ? fmt::format(
                                     "write of {} bytes with immediate {:#x} to peer {} "
                                     "on rail {}",
                                     op->bytes(), op->imm, op->peer, index_)
                               : fmt::format("write of {} bytes to peer {} on rail {}", op->bytes(),
                                             op->peer, index_);
        case FabricOp::kRead:
            return fmt::format("read of {} bytes from peer {} on rail {}", op->bytes(), op->peer,
                               index_);
        case FabricOp::kSend:
            return fmt::format("message of {} bytes to peer {}", op->extra->payload.size(),
                               op->peer);
        case FabricOp::kTask:
            return "engine task";
    }
    return "operation";
}

void Rail::fail_post(FabricOp* op, int rc) {
    stats_.op_errors.fetch_add(1, std::memory_order_relaxed);
    if (op->slot >= 0) free_send_slots_.push_back(op->slot);
    op->parent->piece_done(
        provider_error(fmt::format("posting {} failed: {}", describe(op), fi_strerror(-rc))));
    delete op;
}

// A write done at its post (completes_at_post) with nothing pending before it is posted and
// finished here, as it is popped: it skips the pending list (linked in, walked, unlinked), the
// pass's per-operation checks for pushed-back and dead peers, messages and FI_MORE, and the
// list of writes finished after the pass. 64 B writes with immediates to one peer, the
// worker's own instructions per write without its idle passes (scripts/op_cost.py, callgrind,
// shm, 2026-12-03): through submit_batch 355-417 before, 272-285 with this path inlined and
// posting without post_one's call; through submit_all 210-214 before, 127-141 (see
// docs/BENCHMARKS.md, issue 18, fourth round). Anything else, anything behind an operation
// still pending (order), and a write the provider pushes back go to the pending list.
[[gnu::always_inline]] inline bool Rail::take_popped(FabricOp* op, size_t& direct) {
    if (!pending_.empty() || !completes_at_post(op) || peer_dead(op->dest)) {
        add_pending(op);
        return true;
    }
    int rc;
    {
        CallGuard g(calls_);
        rc = post_unsignaled(op);
    }
    if (wedged()) return false;
    if (rc == -FI_EAGAIN) {
        stats_.eagain.fetch_add(1, std::memory_order_relaxed);
        add_pending(op);
        return true;
    }
    if (rc != 0) {
        fail_post(op, rc);
        return true;
    }
    // Counted before the operation finishes, so that a caller woken by it finds it in stats()
    // (see post_pending). The worker is the only writer of these counters: a load and a store
    // each, no locked read-modify-write per write.
    ++direct;
    bump(stats_.ops_posted, 1);
    bump(stats_.bytes_posted, op->len);
    bump(stats_.ops_injected, 1);
    piece_done(op, kOkStatus);
    delete op;
    return true;
}

bool Rail::drain_submissions() {
    bool any = false;
    // Each operation is handed on (take_popped) only once the next one is popped and its lines
    // prefetched, so that the prefetch of one overlaps the post of the one before it. One call
    // site, inlined: out of line its call was ~17 instructions per 64 B write (callgrind,
    // 2026-12-03).
    FabricOp* held = nullptr;
    size_t direct = 0;  // posted right away by take_popped
    // Bounded so a flood of submissions cannot starve completion polling.
    for (int i = 0;; ++i) {
        auto* op = i < 4096 ? static_cast<FabricOp*>(queue_.pop()) : nullptr;
        if (op) {
            any = true;
            prefetch_op(op);
            if (op->type == FabricOp::kTask) {
                // Tasks (registration, address insertion) are local and may legitimately take
                // long (pinning a large buffer): the watchdog does not time them.
                Status s = op->extra->task();
                if (wedged()) return false;
                op->parent->piece_done(s);
                delete op;
                continue;
            }
        }
        if (held && !take_popped(held, direct)) return false;
        held = op;
        if (!op) break;
    }
    if (direct) stats_.post_rounds.fetch_add(1, std::memory_order_relaxed);
    return any;
}

int Rail::post_one(FabricOp* op, bool more, bool unsignaled) {
    // No completion (completes_at_post, writes only), so no message to describe it either.
    // 16-core host, shm, 2026-12-02, one call: 4 KiB scatter to 64 peers 0.93x of the raw
    // loop this way, 0.65x with completions; 64 B writes with immediates to one peer through
    // submit_all 1.01x against 0.85x.
    if (unsignaled) return post_unsignaled(op);
    op->ctx.kind = FabricCtx::kOp;
    op->ctx.op = op;
    iovec iov[kMaxOpIovs];
    void* desc[kMaxOpIovs];
    fi_rma_iov rma[kMaxOpIovs];
    size_t n = 0;
    uint64_t total = 0;
    op->for_each_iov([&](void* local, uint64_t raddr, uint64_t len) {
        iov[n] = {local, len};
        desc[n] = op->desc;
        rma[n] = {raddr, len, op->rkey};
        total += len;
        ++n;
    });
    fi_msg_rma msg{};
    msg.msg_iov = iov;
    msg.desc = desc;
    msg.iov_count = n;
    msg.addr = op->dest;
    msg.rma_iov = rma;
    msg.rma_iov_count = n;
    msg.context = &op->ctx.fi;
    const uint64_t more_flag = more ? FI_MORE : 0;
    switch (op->type) {
        case FabricOp::kWrite: {
            msg.data = op->imm;
            uint64_t flags = FI_COMPLETION | more_flag | (op->has_imm ? FI_REMOTE_CQ_DATA : 0);
            // FI_INJECT, not fi_inject_write: the payload is copied at post time, but the
            // completion (and with it a dead peer's error) still comes back.
            if (total <= inject_size_) flags |= FI_INJECT;
            return static_cast<int>(fi_writemsg(tx_ep_, &msg, flags));
        }
        case FabricOp::kRead:
            return static_cast<int>(fi_readmsg(tx_ep_, &msg, FI_COMPLETION | more_flag));
        case FabricOp::kSend:
            return static_cast<int>(
                fi_send(tx_ep_, op->local, op->len, fi_mr_desc(send_mr_), op->dest, &op->ctx.fi));
        case FabricOp::kTask:
            break;
    }
    return -FI_EINVAL;
}

bool Rail::post_pending() {
    bool any = false;
    // A peer that pushes back (EAGAIN) holds up only its own operations, which keep their
    // order: a peer that died with its queue full used to stall every operation behind the
    // first one to it, those to the restarted incarnation of that peer included, until each
    // of the dead one's timed out (issue 19). EAGAIN may also mean the local queue is full;
    // the few peers tried per round bound what that costs.
    constexpr size_t kMaxPushbacksPerRound = 8;
    PeerId blocked[kMaxPushbacksPerRound];
    size_t nblocked = 0;
    auto is_blocked = [&](PeerId p) {
        return std::find(blocked, blocked + nblocked, p) != blocked + nblocked;
    };
    uint64_t posted = 0, bytes = 0, injected = 0, with_more = 0;
    size_t unpolled_bytes = 0;  // posted with a completion since the last CQ read
    TimePoint posted_at{};      // read once per pass, when a read or write is first posted
    // Operations done at their post are finished after the pass's counters are published, so
    // that a caller woken by one finds it in stats() (HotPathTest's inject-size test failed 4
    // of 8 runs on shm, 2026-12-02, when they were finished first). Counters once per pass.
    OpList done_at_post_ops;
    auto finish_pass = [&] {
        if (posted) {
            stats_.ops_posted.fetch_add(posted, std::memory_order_relaxed);
            stats_.bytes_posted.fetch_add(bytes, std::memory_order_relaxed);
            stats_.ops_injected.fetch_add(injected, std::memory_order_relaxed);
            stats_.posted_with_more.fetch_add(with_more, std::memory_order_relaxed);
            stats_.post_rounds.fetch_add(1, std::memory_order_relaxed);
        }
        for (FabricOp* op = done_at_post_ops.head; op;) {
            FabricOp* next = op->in_next;
            piece_done(op, kOkStatus);
            delete op;
            op = next;
        }
    };
    if (pending_.empty()) return false;
    for (FabricOp* op = pending_.head; op && inflight_.size < tx_depth_;) {
        if (is_blocked(op->peer)) {
            op = op->in_next;
            continue;
        }
        if (peer_dead(op->dest)) {
            FabricOp* next = pending_.erase(op);
            any = true;
            fail_dead_peer_op(op);
            op = next;
            continue;
        }
        if (op->type == FabricOp::kSend && op->slot < 0) {
            if (free_send_slots_.empty()) break;
            op->slot = free_send_slots_.back();
            free_send_slots_.pop_back();
            uint8_t* dst = send_pool_.data() + op->slot * slot_size_;
            const std::vector<uint8_t>& bytes = op->extra->payload;
            std::memcpy(dst, bytes.data(), bytes.size());
            op->local = dst;
            op->len = bytes.size();
        }
        // FI_MORE while another operation follows in this pass (and fits the queue): the
        // provider may hold its doorbell until the last one. If that next post is pushed
        // back, the provider's own progress (every fi_cq_read) still sends what it holds.
        // A write done at its post goes as fi_inject_writedata, which takes no flags: no
        // FI_MORE, and not counted as posted with it (the bench's 64 B rows counted nearly
        // every write so); the test is skipped (~11 of the worker's instructions per 64 B
        // write with immediate, callgrind, shm, 2026-12-03).
        const bool done_at_post = completes_at_post(op);
        const bool more =
            !done_at_post && config_.post_more && op->in_next && inflight_.size + 1 < tx_depth_;
        int rc;
        {
            CallGuard g(calls_);
            rc = post_one(op, more, done_at_post);
        }
        if (wedged()) {
            finish_pass();
            return false;
        }
        if (rc == -FI_EAGAIN) {
            stats_.eagain.fetch_add(1, std::memory_order_relaxed);
            blocked[nblocked++] = op->peer;
            if (!pending_mixed_ || nblocked == kMaxPushbacksPerRound) break;
            op = op->in_next;
            continue;
        }
        FabricOp* next = pending_.erase(op);
        any = true;
        if (rc != 0) {
            fail_post(op, rc);
            op = next;
            continue;
        }
        ++posted;
        const uint64_t op_bytes = op->bytes();
        bytes += op_bytes;
        injected += op->type == FabricOp::kWrite && op_bytes <= inject_size_;
        with_more += more;
        if (done_at_post) {
            done_at_post_ops.push_back(op);
        } else {
            op->tx_gen = tx_gen_;
            if (op->type != FabricOp::kSend) {
                // A read or write that waited in pending_ gets op_timeout from its post to
                // complete (see peer_answered_); a message keeps the deadline it was given.
                if (posted_at == TimePoint{}) posted_at = Clock::now();
                op->deadline = std::max(op->deadline, posted_at + config_.op_timeout);
            }
            link_inflight(op);
            unpolled_bytes += op_bytes;
        }
        op = next;
        // Completions between large posts, not only after the pass. shm copies a large write
        // or read inside its post (CMA) and completes it there, so a pass over 64 pending
        // writes of 1 MiB ran all 64 copies before the first callback: a submitter waiting for
        // room in its window heard of it only when the worker had nothing left to post, and
        // the worker then polled idle through the submitter's wake-up and refill.
        // HotPathShmTest's LargeReadsOfOneBatchCompleteOneByOne fails without this (3 of 3
        // runs, 2026-12-03). The throughput gain is not shown: on the loaded 2-core dev
        // machine (load 10-20) the 1 MiB point's medians before and after overlap
        // (docs/BENCHMARKS.md, "Issue 18 on the dev machine"). One CQ read per 256 KiB posted,
        // against ~25 us of CPU for the copy of 256 KiB there (bench CPU us/op).
        if (op && unpolled_bytes >= kPollAfterBytes) {
            unpolled_bytes = 0;
            poll_cq();
            if (wedged()) {
                finish_pass();
                return false;
            }
        }
    }
    finish_pass();
    return any;
}

bool Rail::expecting_within_spin(TimePoint now, TimePoint last_active) const {
    if (!hooks_.expecting_since) return false;
    const std::optional<TimePoint> since = hooks_.expecting_since();
    return since && now - std::max(*since, last_active) < config_.expect_spin;
}

void Rail::run() {
    TimePoint last_active = Clock::now();
    TimePoint next_tick = last_active + kTickPeriod;
    Duration nap_for = std::chrono::microseconds(20);
    while (running_.load(std::memory_order_relaxed)) {
        bool active = drain_submissions();
        if (wedged()) return;
        active |= post_pending();
        active |= poll_cq();
        TimePoint now = Clock::now();
        if (wedged()) return;
        retire_finished();
        if (now >= next_tick) {
            sweep_timeouts(now);
            next_tick = now + kTickPeriod;
        }
        if (active) {
            last_active = now;
            nap_for = std::chrono::microseconds(20);
            continue;
        }
        // In flight or expected: both sides of a shm or tcp transfer must poll for it to
        // progress, and a nap on either side stretches every step of it. Reads, and writes
        // without an immediate, complete nothing at their target: an expectation of kAny keeps
        // it polling throughout. One of kSignalled (arrivals the worker sees come) only for
        // expect_spin after the last activity: a decode engine expects a push for the whole of
        // prefill's compute, seconds, and polling all that time took a core from the prefill
        // engine it waited for on a shared host (issue 32's lease expiries).
        if (config_.busy_poll || now - last_active < config_.idle_spin || !pending_.empty() ||
            !inflight_.empty() || (hooks_.stay_awake && hooks_.stay_awake()) ||
            expecting_within_spin(now, last_active)) {
            idle_();
            continue;
        }
        // Idle: nap, woken at once by a submission. Arrivals wait at most one nap; naps grow
        // to max_nap so an idle engine costs little CPU (tests run many engines on 2 cores),
        // and past it to quiet_nap once nothing happened for quiet_after.
        const Duration nap_cap =
            config_.quiet_nap > config_.max_nap && now - last_active >= config_.quiet_after
                ? config_.quiet_nap
                : config_.max_nap;
        sleeping_.store(true, std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_seq_cst);
        if (auto* op = static_cast<FabricOp*>(queue_.pop())) {
            sleeping_.store(false, std::memory_order_relaxed);
            if (op->type == FabricOp::kTask) {
                Status ts = op->extra->task();
                if (wedged()) return;
                op->parent->piece_done(ts);
                delete op;
            } else {
                add_pending(op);
            }
            continue;
        }
        {
            std::unique_lock lk(nap_mu_);
            nap_cv_.wait_for(lk, std::min(nap_for, nap_cap), [&] { return wake_ || !running_; });
            wake_ = false;
        }
        sleeping_.store(false, std::memory_order_relaxed);
        nap_for = std::min<Duration>(nap_for * 2, nap_cap);
    }
}

}  // namespace ferry::detail
