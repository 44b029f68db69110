#include "fabric/imm_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>

#include "ferry/common/spin.h"

namespace ferry::detail {

void ImmTable::drain_locked(uint32_t imm, Entry& e, Fired& fired) {
    while (!e.waiters.empty() && e.available >= e.waiters.front().count) {
        e.available -= e.waiters.front().count;
        fired.emplace_back(std::move(e.waiters.front().cb), ok_status());
        e.waiters.pop_front();
        --num_waiters_;
    }
}

void ImmTable::arrive(uint32_t imm, uint64_t n) {
    Fired fired;
    {
        std::lock_guard lk(mu_);
        Entry& e = entries_[imm];
        e.available += n;
        if (!e.waiters.empty()) drain_locked(imm, e, fired);
        num_waiters_atomic_.store(num_waiters_, std::memory_order_relaxed);
    }
    for (auto& [cb, s] : fired) cb(s);
}

void ImmTable::add_waiter(uint32_t imm, uint64_t count, TimePoint deadline, OpCallback cb) {
    Fired fired;
    bool first = false;
    {
        std::lock_guard lk(mu_);
        first = num_waiters_ == 0;
        Entry& e = entries_[imm];
        e.waiters.push_back({count, deadline, std::move(cb)});
        ++num_waiters_;
        drain_locked(imm, e, fired);
        num_waiters_atomic_.store(num_waiters_, std::memory_order_relaxed);
    }
    if (first && first_waiter_hook_) first_waiter_hook_();
    for (auto& [c, s] : fired) c(s);
}

Status ImmTable::wait(uint32_t imm, uint64_t count, Duration timeout, Duration spin) {
    struct Sync {
        std::mutex mu;
        std::condition_variable cv;
        std::atomic<bool> done{false};  // written under mu, read without it while spinning
        Status status;
    };
    auto sync = std::make_shared<Sync>();
    TimePoint deadline = deadline_after(timeout);
    add_waiter(imm, count, deadline, [sync](const Status& s) {
        std::lock_guard lk(sync->mu);
        sync->status = s;
        sync->done.store(true, std::memory_order_release);
        sync->cv.notify_all();
    });
    spin_until([&] { return sync->done.load(std::memory_order_acquire); }, std::min(spin, timeout));
    std::unique_lock lk(sync->mu);
    // The expiry sweep fires the timeout; the extra second only guards against a stopped
    // engine, so this wait is bounded even then.
    if (!sync->cv.wait_until(lk, deadline + std::chrono::seconds(1),
                             [&] { return sync->done.load(std::memory_order_relaxed); })) {
        return timeout_error(fmt::format(
            "waiting for {} writes with immediate {:#x}: engine stopped sweeping", count, imm));
    }
    return sync->status;
}

void ImmTable::expire(TimePoint now) {
    Fired fired;
    {
        std::lock_guard lk(mu_);
        if (num_waiters_ == 0) return;
        for (auto& [imm, e] : entries_) {
            for (auto it = e.waiters.begin(); it != e.waiters.end();) {
                if (it->deadline <= now) {
                    fired.emplace_back(
                        std::move(it->cb),
                        timeout_error(fmt::format(
                            "waiting for {} writes with immediate {:#x}: {} had arrived when "
                            "the deadline passed",
                            it->count, imm, e.available)));
                    it = e.waiters.erase(it);
                    --num_waiters_;
                } else {
                    ++it;
                }
            }
            // A waiter that timed out at the front may have been holding back later ones.
            drain_locked(imm, e, fired);
        }
        num_waiters_atomic_.store(num_waiters_, std::memory_order_relaxed);
    }
    for (auto& [cb, s] : fired) cb(s);
}

bool ImmTable::try_take(uint32_t imm, uint64_t count) {
    std::lock_guard lk(mu_);
    auto it = entries_.find(imm);
    if (it == entries_.end()) return count == 0;
    Entry& e = it->second;
    if (!e.waiters.empty() || e.available < count) return false;
    e.available -= count;
    return true;
}

uint64_t ImmTable::available(uint32_t imm) const {
    std::lock_guard lk(mu_);
    auto it = entries_.find(imm);
    return it == entries_.end() ? 0 : it->second.available;
}

void ImmTable::cancel_all(const Status& why) {
    Fired fired;
    {
        std::lock_guard lk(mu_);
        for (auto& [imm, e] : entries_) {
            for (auto& w : e.waiters) fired.emplace_back(std::move(w.cb), why);
            e.waiters.clear();
        }
        num_waiters_ = 0;
        num_waiters_atomic_.store(0, std::memory_order_relaxed);
    }
    for (auto& [cb, s] : fired) cb(s);
}

}  // namespace ferry::detail
