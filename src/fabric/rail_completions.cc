// Rail: what the worker does with completions (reading the CQ, finishing operations and
// retiring them, arrivals, errors). Split from rail.cc, which keeps the loop and the posting.
#include <fmt/format.h>
#include <rdma/fi_errno.h>

#include <cerrno>
#include <string>

#include "fabric/rail.h"
#include "ferry/common/log.h"

namespace ferry::detail {
namespace {

constexpr size_t kCqBatch = 64;
constexpr size_t kMessageHeader = 0;  // the engine frames messages itself

bool is_peer_gone(int err) {
    return err == FI_ECONNREFUSED || err == FI_ECONNRESET || err == FI_EHOSTUNREACH ||
           err == FI_ENOTCONN || err == FI_ECONNABORTED || err == FI_ESHUTDOWN || err == EPIPE ||
           err == FI_ETIMEDOUT || err == FI_EIO;
}

}  // namespace

void Rail::finish_op(FabricOp* op, const Status& s) {
    if (op->abandoned) {
        // Timed out earlier and already reported; libfabric is done with it only now.
        abandoned_.erase(op);
        if (op->slot >= 0) free_send_slots_.push_back(op->slot);
        delete op;
        return;
    }
    unlink_inflight(op);
    if (op->slot >= 0) free_send_slots_.push_back(op->slot);
    if (!s.ok()) {
        stats_.op_errors.fetch_add(1, std::memory_order_relaxed);
    } else if (!pending_.empty()) {
        note_answered(op->peer);
    }
    piece_done(op, s);
    delete op;
}

void Rail::retire_finished() {
    OpState* first = std::exchange(finished_ops_, nullptr);
    if (!first) return;
    // Every operation on a rail is its engine's: one registry (none for engine tasks).
    OpRegistry* registry = nullptr;
    for (OpState* s = first; s && !registry; s = s->retired_next) registry = s->registry;
    if (registry) {
        std::lock_guard lk(registry->mu);
        for (OpState* s = first; s; s = s->retired_next) registry->erase(s);
    }
    while (first) {
        OpState* next = first->retired_next;
        first->release();  // the pieces' reference
        first = next;
    }
}

void Rail::handle_completion(FabricCtx* ctx, uint64_t flags, size_t len, uint64_t data) {
    if ((flags & FI_REMOTE_CQ_DATA) && (flags & FI_REMOTE_WRITE)) {
        stats_.imm_arrivals.fetch_add(1, std::memory_order_relaxed);
        if (hooks_.on_imm) hooks_.on_imm(static_cast<uint32_t>(data));
        return;
    }
    if (!ctx) return;
    if (ctx->kind == FabricCtx::kRecv) {
        int slot = static_cast<int>(ctx - recv_ctx_.data());
        stats_.messages_received.fetch_add(1, std::memory_order_relaxed);
        if (hooks_.on_message) {
            hooks_.on_message({recv_pool_.data() + slot * slot_size_ + kMessageHeader, len});
        }
        Status s = post_recv(slot);
        if (!s.ok()) log(LogLevel::kError, "fabric", "reposting receive buffer: {}", s.message());
        return;
    }
    finish_op(ctx->op, kOkStatus);
}

void Rail::handle_error(const fi_cq_err_entry& err) {
    auto* ctx = static_cast<FabricCtx*>(err.op_context);
    char prov[256] = {0};
    const char* prov_text = fi_cq_strerror(cq_, err.prov_errno, err.err_data, prov, sizeof(prov));
    if (!ctx) {
        log(LogLevel::kWarn, "fabric", "rail {}: completion error without context: {} ({})", index_,
            fi_strerror(err.err), prov_text ? prov_text : "");
        return;
    }
    if (ctx->kind == FabricCtx::kRecv) {
        if (err.err == FI_ECANCELED || !running_) return;
        stats_.messages_dropped.fetch_add(1, std::memory_order_relaxed);
        log(LogLevel::kWarn, "fabric", "rail {}: receive failed: {} ({}); buffer reposted", index_,
            fi_strerror(err.err), prov_text ? prov_text : "");
        int slot = static_cast<int>(ctx - recv_ctx_.data());
        Status s = post_recv(slot);
        if (!s.ok()) log(LogLevel::kError, "fabric", "reposting receive buffer: {}", s.message());
        return;
    }
    FabricOp* op = ctx->op;
    std::string text = fmt::format("{} failed: {} ({})", describe(op), fi_strerror(err.err),
                                   prov_text ? prov_text : "no provider detail");
    finish_op(op, is_peer_gone(err.err) ? unavailable(text + "; the peer is unreachable or died")
                                        : provider_error(text));
}

bool Rail::poll_cq() {
    fi_cq_data_entry entries[kCqBatch];
    bool any = false;
    for (int round = 0; round < 8; ++round) {
        ssize_t n;
        {
            CallGuard g(calls_);
            n = fi_cq_read(cq_, entries, kCqBatch);
        }
        if (wedged()) return false;
        if (n > 0) {
            any = true;
            for (ssize_t i = 0; i < n; ++i) {
                handle_completion(static_cast<FabricCtx*>(entries[i].op_context), entries[i].flags,
                                  entries[i].len, entries[i].data);
            }
            if (static_cast<size_t>(n) < kCqBatch) break;
        } else if (n == -FI_EAVAIL) {
            any = true;
            fi_cq_err_entry err{};
            ssize_t got;
            {
                CallGuard g(calls_);
                got = fi_cq_readerr(cq_, &err, 0);
            }
            if (wedged()) return false;
            if (got > 0) handle_error(err);
        } else {
            if (n != -FI_EAGAIN) {
                log(LogLevel::kError, "fabric", "rail {}: fi_cq_read: {}", index_,
                    fi_strerror(static_cast<int>(-n)));
            }
            break;
        }
    }
    return any;
}

}  // namespace ferry::detail
