// Target-side arrival counters per immediate value, credit style: arrivals accumulate and
// each waiter consumes the count it asked for, first come first served.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <unordered_map>

#include "ferry/common/clock.h"
#include "ferry/fabric/engine.h"

namespace ferry::detail {

class ImmTable {
  public:
    void arrive(uint32_t imm, uint64_t n = 1);
    // Registers a waiter; it fires (consuming `count`) as soon as enough arrived, possibly
    // right away on this thread, or with kTimeout at the deadline.
    void add_waiter(uint32_t imm, uint64_t count, TimePoint deadline, OpCallback cb);
    // Blocks until `count` arrivals of imm are consumed or the timeout passes, polling for
    // `spin` before it sleeps.
    Status wait(uint32_t imm, uint64_t count, Duration timeout, Duration spin = Duration::zero());
    // Fires the waiters whose deadline passed. Called periodically by a worker.
    void expire(TimePoint now);
    // Consumes `count` arrivals of imm if that many are there and no waiter is queued ahead;
    // false (nothing consumed) otherwise. Lets a caller that usually finds the arrivals in
    // already skip the waiter and its callback.
    bool try_take(uint32_t imm, uint64_t count);
    uint64_t available(uint32_t imm) const;
    bool has_waiters() const { return num_waiters_atomic_.load(std::memory_order_relaxed) > 0; }
    // Called (outside the table's lock) when a waiter comes while none waited: the sweeper
    // that calls expire() ticks slowly with no waiter and must speed up. Set before use.
    void set_first_waiter_hook(std::function<void()> hook) { first_waiter_hook_ = std::move(hook); }
    // Fails every waiter (shutdown).
    void cancel_all(const Status& why);

  private:
    std::function<void()> first_waiter_hook_;
    struct Waiter {
        uint64_t count;
        TimePoint deadline;
        OpCallback cb;
    };
    struct Entry {
        uint64_t available = 0;
        std::deque<Waiter> waiters;
    };
    using Fired = std::deque<std::pair<OpCallback, Status>>;
    void drain_locked(uint32_t imm, Entry& e, Fired& fired);

    mutable std::mutex mu_;
    std::unordered_map<uint32_t, Entry> entries_;
    size_t num_waiters_ = 0;
    std::atomic<size_t> num_waiters_atomic_{0};  // mirror of num_waiters_ for lock-free reads
};

}  // namespace ferry::detail
