// Rail: what the worker does when operations outlive their deadline. Expired operations are
// failed (and kept from libfabric's reuse until it returns them); on a rail that renews its
// initiator endpoint (shm, see Rail::renew_initiator), a timeout also checks whether the peer's
// process still exists, moves new posts to a fresh endpoint, and fails at once what a dead
// peer's unanswered response entry holds up.
#include <fmt/format.h>
#include <signal.h>

#include <cerrno>
#include <fstream>
#include <iterator>
#include <string>

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
    auto parent = std::move(op->parent);
    parent->piece_done(why);
}

void Rail::sweep_timeouts(TimePoint now) {
    while (in_head_ && in_head_->deadline <= now) {
        FabricOp* op = in_head_;
        stats_.op_timeouts.fetch_add(1, std::memory_order_relaxed);
        abandon(op, timeout_error(fmt::format(
                        "{} did not complete within {} ms; the peer may have died or the network "
                        "is down",
                        describe(op), to_ms(config_.op_timeout))));
        if (renew_on_stall_) on_inflight_timeout(op);
    }
    if (!retired_.empty()) close_idle_retired();
    // Not only the front: operations to a peer that pushes back wait behind those posted
    // past them.
    for (auto it = pending_.begin(); it != pending_.end();) {
        FabricOp* op = *it;
        if (op->deadline > now) {
            ++it;
            continue;
        }
        it = pending_.erase(it);
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
    for (FabricOp* o = in_head_; o;) {
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

}  // namespace ferry::detail
