#include "ferry/moe/host_proxy.h"

#include <fmt/format.h>

#include <algorithm>

#include "ferry/common/log.h"
#include "ferry/common/thread_name.h"

namespace ferry::moe {

uint64_t write_pieces(const EngineConfig& config, int num_rails, uint64_t len) {
    // Mirrors the engine's split: one 4 KiB-aligned piece per rail above the stripe
    // threshold, and never more than max_write_size per piece. The proxy checks every write
    // against OpHandle::imm_writes, so a change in the engine shows up as an error.
    uint64_t chunk = config.max_write_size;
    if (num_rails > 1 && len > config.stripe_threshold) {
        uint64_t per = (len + num_rails - 1) / num_rails;
        per = (per + 4095) & ~uint64_t{4095};
        chunk = std::min<uint64_t>(chunk, per);
    }
    return len == 0 ? 1 : (len + chunk - 1) / chunk;
}

HostProxy::HostProxy(Setup setup) : s_(std::move(setup)) {
    for (uint32_t r = 0; r < s_.world; ++r) {
        if (!s_.remote[r]) continue;
        for (int g = 0; g < kNumRegions; ++g) {
            watch_.push_back({static_cast<Region>(g), r});
            watch_imm_.push_back(imm_for(s_.imm_base, static_cast<Region>(g), r));
        }
    }
}

HostProxy::~HostProxy() { stop(); }

void HostProxy::start() {
    if (thread_.joinable()) return;
    thread_ = std::thread([this] {
        set_thread_name("ferry-moeproxy");
        loop();
    });
}

void HostProxy::stop() {
    {
        std::lock_guard lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    // Operations still in flight keep their own deadlines inside the engine; waiting for them
    // here keeps staging memory alive until the engine is done reading it.
    for (auto& h : inflight_) (void)h.wait(s_.engine->config().op_timeout + seconds(1));
    inflight_.clear();
    std::lock_guard lk(mu_);
    if (error_.ok()) error_ = cancelled("the MoE host proxy was stopped");
    idle_cv_.notify_all();
}

Status HostProxy::enqueue(const PutRequest& put) {
    {
        std::lock_guard lk(mu_);
        if (!error_.ok()) return error_;
        if (stop_) return cancelled("the MoE host proxy was stopped");
        queue_.push_back(put);
        ++pending_;
    }
    cv_.notify_one();
    return ok_status();
}

Status HostProxy::flush(TimePoint deadline) {
    std::unique_lock lk(mu_);
    if (!idle_cv_.wait_until(lk, deadline, [&] { return pending_ == 0 || !error_.ok(); }))
        return timeout_error(
            fmt::format("rank {}: {} fabric put(s) still in flight at the "
                        "deadline",
                        s_.rank, pending_));
    return error_;
}

Status HostProxy::error() const {
    std::lock_guard lk(mu_);
    return error_;
}

void HostProxy::record(const Status& s) {
    std::lock_guard lk(mu_);
    if (error_.ok()) {
        error_ = s;
        log(LogLevel::kError, "moe", "rank {} host proxy: {}", s_.rank, s.to_string());
    }
    idle_cv_.notify_all();
}

bool HostProxy::drain_arrivals() {
    bool any = false;
    for (size_t i = 0; i < watch_imm_.size(); ++i) {
        uint64_t n = s_.engine->imm_available(watch_imm_[i]);
        if (n == 0) continue;
        // Only this thread consumes these immediates, so n are there to take without waiting.
        Status st = s_.engine->wait_imm(watch_imm_[i], n, Duration::zero());
        if (!st.ok()) {
            record(st.with_context("taking arrivals"));
            continue;
        }
        s_.arrivals.at(watch_[i].first, watch_[i].second).fetch_add(n, std::memory_order_release);
        any = true;
    }
    return any;
}

bool HostProxy::reap(bool* failed) {
    size_t before = inflight_.size();
    uint64_t finished = 0;
    for (size_t i = 0; i < inflight_.size();) {
        if (!inflight_[i].done()) {
            ++i;
            continue;
        }
        Status st = inflight_[i].wait(Duration::zero());
        if (!st.ok()) {
            record(st.with_context(fmt::format("rank {}: fabric put", s_.rank)));
            *failed = true;
        }
        inflight_[i] = std::move(inflight_.back());
        inflight_.pop_back();
        ++finished;
    }
    if (finished) {
        std::lock_guard lk(mu_);
        pending_ -= finished;
        if (pending_ == 0) idle_cv_.notify_all();
    }
    return inflight_.size() != before;
}

void HostProxy::loop() {
    TimePoint last_activity = Clock::now();
    std::vector<PutRequest> batch;
    for (;;) {
        {
            std::lock_guard lk(mu_);
            if (stop_) return;
            batch.assign(queue_.begin(), queue_.end());
            queue_.clear();
        }
        bool active = !batch.empty();
        for (const PutRequest& p : batch) {
            const RemoteRank& rr = s_.peers[p.peer];
            int g = static_cast<int>(p.region);
            WriteOp op;
            op.peer = rr.peer;
            op.src = s_.stage;
            op.src_offset = s_.stage_offset[g] + p.src_offset;
            op.dst = &rr.shared;
            op.dst_offset = rr.recv_offset[g] + p.dst_offset;
            op.length = p.len;
            op.imm = imm_for(s_.imm_base, p.region, s_.rank);
            OpHandle h = s_.engine->write(op);
            uint64_t want = write_pieces(s_.engine->config(), s_.engine->num_rails(), p.len);
            if (h.imm_writes() != want && !h.done())
                record(internal_error(fmt::format(
                    "rank {}: the engine split a {}-byte write into {} immediates, the MoE "
                    "protocol expected {}; receivers would miscount",
                    s_.rank, p.len, h.imm_writes(), want)));
            inflight_.push_back(std::move(h));
        }
        bool failed = false;
        active |= reap(&failed);
        active |= drain_arrivals();
        if (active) {
            last_activity = Clock::now();
            continue;
        }
        // Idle: spin briefly for latency, then nap so oversubscribed ranks get the cores.
        if (Clock::now() - last_activity < microseconds(50)) {
            std::this_thread::yield();
            continue;
        }
        std::unique_lock lk(mu_);
        cv_.wait_for(lk, microseconds(inflight_.empty() ? 200 : 20),
                     [&] { return stop_ || !queue_.empty(); });
    }
}

}  // namespace ferry::moe
