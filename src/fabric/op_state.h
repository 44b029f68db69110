// Shared state of one user-visible operation, which may be split into many fabric
// operations across rails. The last piece to finish runs the callback, then wakes waiters.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "ferry/common/status.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

struct OpState {
    explicit OpState(OpCallback cb) : callback(std::move(cb)) {}

    // Must be called with the final piece count before any piece is handed to a worker.
    void set_pieces(uint32_t n) { remaining.store(n, std::memory_order_relaxed); }

    void piece_done(const Status& s) {
        if (!s.ok()) {
            std::lock_guard lk(mu);
            if (status.ok()) status = s;
        }
        if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish();
    }

    // Completes an operation that never reached the wire.
    void fail_now(Status s) {
        {
            std::lock_guard lk(mu);
            status = std::move(s);
        }
        finish();
    }

    void finish() {
        Status final_status;
        {
            std::lock_guard lk(mu);
            final_status = status;
        }
        if (callback) callback(final_status);
        {
            std::lock_guard lk(mu);
            done = true;
        }
        cv.notify_all();
    }

    std::atomic<uint32_t> remaining{0};
    uint32_t imm_writes = 0;
    OpCallback callback;
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
};

}  // namespace ferry::detail
