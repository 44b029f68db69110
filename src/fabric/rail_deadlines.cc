// Rail: what the worker does when operations outlive their deadline. Expired operations are
// failed (and kept from libfabric's reuse until it returns them); on a rail that renews its
// initiator endpoint (shm, see Rail::renew_initiator), an operation unanswered for a fraction
// of a second, or a timeout, checks whether the peer's process still exists; a dead peer's
// operation fails, new posts move to a fresh endpoint, and what its unanswered response entry
// holds up is posted again there (reads) or failed at once (the rest).
#include <fmt/format.h>
#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <utility>

#include "fabric/rail.h"
#include "ferry/common/log.h"

namespace ferry::detail {
namespace {

// Whether a process of this host with that id still runs. A zombie does not: killed, it
// answers nothing, though its parent may reap it much later (the test harness reaps its
// children only at the end; a supervisor may be slow).
bool process_alive(long pid) {
    if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
    // /proc/<pid>/stat: "pid (comm) S ...", the state after the last ')'.
    std::ifstream f(fmt::format("/proc/{}/stat", pid));
    std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    size_t close = stat.rfind(')');
    if (close == std::string::npos || close + 2 >= stat.size()) return true;  // cannot tell
    char state = stat[close + 2];
    return state != 'Z' && state != 'X';
}

// shm: how long an operation waits for its answer before the worker asks whether its peer's
// process still exists, and how often a rail asks at most (each question reads /proc). A
// peer SIGKILLed with a read of it in flight was found only at the op timeout (10 s), and
// every operation posted behind it on the same initiator endpoint was given up with it.
constexpr auto kDeadPeerProbeAfter = std::chrono::milliseconds(200);
constexpr auto kDeadPeerProbeEvery = std::chrono::milliseconds(100);

// A copy of an operation to post again: the original stays abandoned (libfabric may still
// hold its context; Rail::abandoned_ owns it from then on), the copy takes over its piece and
// keeps its deadline. The copy joins inflight_ behind operations posted since, whose deadlines
// are later: sweep_timeouts, which looks at the front, finds it expired at most as late as the
// original was old when it was posted again.
FabricOp* repost_copy(const FabricOp* op) {
    auto* c = new FabricOp();
    c->dest = op->dest;
    c->local = op->local;
    c->len = op->len;
    c->desc = op->desc;
    c->raddr = op->raddr;
    c->rkey = op->rkey;
    c->more_iovs = op->more_iovs;
    if (op->more_iovs) c->more = op->more;
    c->imm = op->imm;
    c->type = op->type;
    c->has_imm = op->has_imm;
    c->peer = op->peer;
    c->deadline = op->deadline;
    return c;
}

}  // namespace

OpState* Rail::detach(FabricOp* op) {
    unlink_inflight(op);
    op->abandoned = true;
    abandoned_.insert(op);
    // The op stays until libfabric returns it, but is no piece of its operation any more.
    return std::exchange(op->parent, nullptr);
}

void Rail::abandon(FabricOp* op, const Status& why) { detach(op)->piece_done(why); }

TimePoint Rail::pending_deadline_after_progress(const FabricOp* op, TimePoint now) const {
    // Messages keep their own deadlines (a control message's may be shorter than op_timeout).
    if (op->type != FabricOp::kRead && op->type != FabricOp::kWrite) return TimePoint{};
    if (op->peer >= peer_answered_.size()) return TimePoint{};
    const TimePoint until = peer_answered_[op->peer] + config_.op_timeout;
    return until > now ? until : TimePoint{};
}

void Rail::sweep_timeouts(TimePoint now) {
    while (inflight_.head && inflight_.head->deadline <= now) {
        FabricOp* op = inflight_.head;
        stats_.op_timeouts.fetch_add(1, std::memory_order_relaxed);
        abandon(op, timeout_error(fmt::format(
                        "{} did not complete within {} ms; the peer may have died or the network "
                        "is down",
                        describe(op), to_ms(config_.op_timeout))));
        if (renew_on_stall_) on_inflight_timeout(op);
    }
    if (renew_on_stall_ && inflight_.head && now >= next_probe_) probe_stalled_peers(now);
    if (!retired_.empty()) close_idle_retired();
    if (!release_watches_.empty()) check_release_watches(now);
    // Not only the front: operations to a peer that pushes back wait behind those posted
    // past them. Only once the earliest deadline among them may have passed (see
    // pending_min_deadline_), which the walk then sets again.
    if (now < pending_min_deadline_) return;
    pending_min_deadline_ = TimePoint::max();
    for (FabricOp* op = pending_.head; op;) {
        if (op->deadline <= now && !peer_dead(op->dest)) {
            const TimePoint later = pending_deadline_after_progress(op, now);
            if (later != TimePoint{}) op->deadline = later;
        }
        if (op->deadline > now) {
            pending_min_deadline_ = std::min(pending_min_deadline_, op->deadline);
            op = op->in_next;
            continue;
        }
        FabricOp* next = pending_.erase(op);
        if (op->slot >= 0) free_send_slots_.push_back(op->slot);
        if (renew_on_stall_ && !peer_dead(op->dest)) {
            // Pushed back until its deadline: a dead shm peer's full command queue, likely.
            auto pid = peer_pid_.find(op->dest);
            if (pid != peer_pid_.end() && !process_alive(pid->second)) {
                dead_peers_.insert(op->dest);
            }
        }
        stats_.op_timeouts.fetch_add(1, std::memory_order_relaxed);
        op->parent->piece_done(timeout_error(
            fmt::format("{} {} {} ms: the provider kept pushing back and the peer answered "
                        "nothing meanwhile (peer dead or overloaded?)",
                        describe(op), kNeverPostedText, to_ms(config_.op_timeout))));
        delete op;
        op = next;
    }
}

Status Rail::dead_peer_error(const FabricOp* op) const {
    return unavailable(fmt::format(
        "{} failed: the peer's process is gone (an operation to it went unanswered and its "
        "process no longer exists); reconnect to its new incarnation",
        describe(op)));
}

void Rail::fail_dead_peer_op(FabricOp* op) {
    if (op->slot >= 0) free_send_slots_.push_back(op->slot);
    stats_.op_errors.fetch_add(1, std::memory_order_relaxed);
    stats_.dead_peer_failures.fetch_add(1, std::memory_order_relaxed);
    op->parent->piece_done(dead_peer_error(op));
    delete op;
}

void Rail::probe_stalled_peers(TimePoint now) {
    const TimePoint posted_by = now - kDeadPeerProbeAfter;
    // The common case, every tick while operations are in flight: the oldest is young.
    if (inflight_.head->deadline - config_.op_timeout > posted_by) return;
    // The oldest operation of each initiator endpoint in use (seldom more than two): what
    // the rest of that endpoint's response queue waits behind.
    next_probe_ = now + kDeadPeerProbeEvery;
    uint32_t gens[8];
    size_t ngens = 0;
    for (FabricOp* op = inflight_.head; op && ngens < std::size(gens); op = op->in_next) {
        if (std::find(gens, gens + ngens, op->tx_gen) != gens + ngens) continue;
        gens[ngens++] = op->tx_gen;
        if (op->deadline - config_.op_timeout > posted_by) continue;
        auto pid = peer_pid_.find(op->dest);
        if (pid == peer_pid_.end()) continue;
        if (process_alive(pid->second)) continue;
        const uint32_t gen = op->tx_gen;
        dead_peers_.insert(op->dest);
        stats_.op_errors.fetch_add(1, std::memory_order_relaxed);
        stats_.dead_peer_failures.fetch_add(1, std::memory_order_relaxed);
        log(LogLevel::kWarn, "fabric",
            "rail {}: {} is unanswered after {:.0f} ms and its peer's process is gone", index_,
            describe(op), to_ms(now - (op->deadline - config_.op_timeout)));
        abandon(op, dead_peer_error(op));
        if (gen == tx_gen_) {
            Status renewed = renew_initiator();
            if (!renewed.ok()) {
                // What waits behind it keeps its deadline.
                log(LogLevel::kError, "fabric", "rail {}: {}", index_, renewed.message());
                return;
            }
        }
        give_up_behind_dead_peer(gen);
        return;  // the list changed; another dead peer waits for the next probe
    }
}

void Rail::give_up_behind_dead_peer(uint32_t gen) {
    // Reads are posted again: reading the same bytes twice changes nothing, and the late data
    // of the abandoned original can land only in this side's buffer, which held_in counts
    // while its endpoint is open. Writes are not: the original may still be carried out after
    // the copy reported success, over bytes the target has moved on to (and a write with an
    // immediate, or a message, would arrive twice).
    OpList again;
    size_t given_up = 0;
    for (FabricOp* o = inflight_.head; o;) {
        FabricOp* next = o->in_next;
        if (o->tx_gen != gen) {
            o = next;
            continue;
        }
        if (peer_dead(o->dest)) {
            stats_.op_errors.fetch_add(1, std::memory_order_relaxed);
            stats_.dead_peer_failures.fetch_add(1, std::memory_order_relaxed);
            abandon(o, dead_peer_error(o));
        } else if (o->type == FabricOp::kRead) {
            FabricOp* copy = repost_copy(o);
            copy->parent = detach(o);
            again.push_back(copy);
        } else {
            ++given_up;
            stats_.op_errors.fetch_add(1, std::memory_order_relaxed);
            abandon(o,
                    unavailable(fmt::format(
                        "{} was given up: its completion waits behind an operation to a peer whose "
                        "process died, which will never be answered; it may or may not have been "
                        "carried out, retry it",
                        describe(o))));
        }
        o = next;
    }
    if (!again.empty()) {
        log(LogLevel::kInfo, "fabric",
            "rail {}: {} read(s) waiting behind a dead peer's operation posted again on the "
            "fresh initiator endpoint; {} other operation(s) given up",
            index_, again.size, given_up);
        // They were posted before anything still pending: they go first, in their order.
        for (FabricOp* c = again.head; c; c = c->in_next)
            pending_min_deadline_ = std::min(pending_min_deadline_, c->deadline);
        pending_.splice_front(again);
        pending_mixed_ = true;
    }
    close_idle_retired();
}

void Rail::on_inflight_timeout(const FabricOp* op) {
    const uint32_t gen = op->tx_gen;
    if (gen != tx_gen_) return;  // its endpoint was already given up on
    auto pid = peer_pid_.find(op->dest);
    const bool dead = pid != peer_pid_.end() && !process_alive(pid->second);
    if (dead) dead_peers_.insert(op->dest);
    Status renewed = renew_initiator();
    if (!renewed.ok()) {
        log(LogLevel::kError, "fabric", "rail {}: {}", index_, renewed.message());
        return;
    }
    log(LogLevel::kWarn, "fabric",
        "rail {}: {} timed out{}; new operations go through a fresh initiator endpoint", index_,
        describe(op), dead ? " and its peer's process is gone" : "");
    if (!dead) return;  // a slow peer: what follows it may still complete, by its deadline
    give_up_behind_dead_peer(gen);
}

size_t Rail::held_in(std::span<const std::span<const uint8_t>> spans) const {
    auto touches = [&](const FabricOp* op) {
        if (spans.empty()) return false;
        bool hit = false;
        op->for_each_iov([&](const void* local, uint64_t, uint64_t len) {
            if (hit || len == 0) return;
            const auto* lo = static_cast<const uint8_t*>(local);
            const uint8_t* hi = lo + len;
            // The first span ending after lo is the only candidate that can start before hi.
            auto it = std::upper_bound(spans.begin(), spans.end(), lo,
                                       [](const uint8_t* p, const std::span<const uint8_t>& s) {
                                           return p < s.data() + s.size();
                                       });
            hit = it != spans.end() && it->data() < hi;
        });
        return hit;
    };
    // An abandoned operation of an initiator endpoint already closed is out of libfabric's
    // hands; one of the current endpoint or of a retired one still open is not.
    auto endpoint_open = [&](uint32_t gen) {
        if (gen == tx_gen_) return true;
        for (const auto& r : retired_) {
            if (r.gen == gen) return true;
        }
        return false;
    };
    size_t n = 0;
    for (const FabricOp* o = inflight_.head; o; o = o->in_next) n += touches(o);
    for (const FabricOp* o : abandoned_) n += touches(o) && endpoint_open(o->tx_gen);
    return n;
}

size_t Rail::settle_local(const void* base, size_t len, TimePoint deadline) {
    const std::span<const uint8_t> one[] = {{static_cast<const uint8_t*>(base), len}};
    size_t n = held_in(one);
    TimePoint next_tick = Clock::now() + kTickPeriod;
    while (n > 0 && !wedged()) {
        TimePoint now = Clock::now();
        if (now >= deadline) break;
        if (now >= next_tick) {
            sweep_timeouts(now);
            next_tick = now + kTickPeriod;
        }
        bool active = post_pending();
        active |= poll_cq();
        if (!active) std::this_thread::sleep_for(std::chrono::microseconds(50));
        n = held_in(one);
    }
    if (n > 0) {
        log(LogLevel::kError, "fabric",
            "rail {}: memory at {} ({} bytes) is deregistered while the provider still holds {} "
            "operation(s) on it that timed out earlier; their late data may still land there",
            index_, base, len, n);
    }
    return n;
}

void Rail::watch_release(std::vector<std::span<const uint8_t>> spans, TimePoint deadline,
                         std::function<void(size_t)> then) {
    release_watches_.push_back({std::move(spans), deadline, std::move(then)});
    check_release_watches(Clock::now());
}

void Rail::check_release_watches(TimePoint now) {
    for (size_t i = 0; i < release_watches_.size();) {
        ReleaseWatch& w = release_watches_[i];
        size_t held = held_in(w.spans);
        if (held > 0 && now < w.deadline) {
            ++i;
            continue;
        }
        if (held > 0) {
            log(LogLevel::kWarn, "fabric",
                "rail {}: {} operation(s) that timed out earlier still hold memory handed back "
                "for reuse; their late data may still land there",
                index_, held);
        }
        auto then = std::move(w.then);
        release_watches_.erase(release_watches_.begin() + static_cast<std::ptrdiff_t>(i));
        then(held);
    }
}

}  // namespace ferry::detail
