// Rail: what the worker does when operations outlive their deadline. Expired operations are
// failed (and kept from libfabric's reuse until it returns them); on a rail that renews its
// initiator endpoint (shm, see Rail::renew_initiator), a timeout also checks whether the peer's
// process still exists, moves new posts to a fresh endpoint, and fails at once what a dead
// peer's unanswered response entry holds up.
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

}  // namespace

void Rail::abandon(FabricOp* op, const Status& why) {
    unlink_inflight(op);
    op->abandoned = true;
    abandoned_.insert(op);
    // The op stays until libfabric returns it, but is no piece of its operation any more.
    OpState* parent = std::exchange(op->parent, nullptr);
    parent->piece_done(why);
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
    if (!retired_.empty()) close_idle_retired();
    if (!release_watches_.empty()) check_release_watches(now);
    // Not only the front: operations to a peer that pushes back wait behind those posted
    // past them.
    for (FabricOp* op = pending_.head; op;) {
        if (op->deadline > now) {
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
        op->parent->piece_done(timeout_error(fmt::format(
            "{} could not be posted within {} ms: the provider kept pushing back (peer dead or "
            "overloaded?)",
            describe(op), to_ms(config_.op_timeout))));
        delete op;
        op = next;
    }
}

void Rail::fail_dead_peer_op(FabricOp* op) {
    if (op->slot >= 0) free_send_slots_.push_back(op->slot);
    stats_.op_errors.fetch_add(1, std::memory_order_relaxed);
    stats_.dead_peer_failures.fetch_add(1, std::memory_order_relaxed);
    op->parent->piece_done(unavailable(fmt::format(
        "{} failed: the peer's process is gone (an operation to it timed out and its process "
        "no longer exists); reconnect to its new incarnation",
        describe(op))));
    delete op;
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
    // Everything posted on that endpoint after the dead peer's operation waits behind its
    // response entry, which will never be answered: fail it now rather than at its deadline.
    for (FabricOp* o = inflight_.head; o;) {
        FabricOp* next = o->in_next;
        if (o->tx_gen == gen) {
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
    close_idle_retired();
}

size_t Rail::held_in(std::span<const std::span<const uint8_t>> spans) const {
    auto touches = [&](const FabricOp* op) {
        if (op->len == 0 || spans.empty()) return false;
        const auto* lo = static_cast<const uint8_t*>(op->local);
        const uint8_t* hi = lo + op->len;
        // The first span ending after lo is the only candidate that can start before hi.
        auto it = std::upper_bound(spans.begin(), spans.end(), lo,
                                   [](const uint8_t* p, const std::span<const uint8_t>& s) {
                                       return p < s.data() + s.size();
                                   });
        return it != spans.end() && it->data() < hi;
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
