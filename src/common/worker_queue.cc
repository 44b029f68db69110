#include "common/worker_queue.h"

#include <utility>

#include "ferry/common/thread_name.h"

namespace ferry {

WorkerQueue::WorkerQueue(Options options) : options_(std::move(options)) {
    thread_ = std::thread([this] {
        set_thread_name(options_.thread_name.c_str());
        run();
    });
}

WorkerQueue::~WorkerQueue() { stop(); }

bool WorkerQueue::post(Job job) {
    {
        std::lock_guard lk(mu_);
        if (stopping_ || jobs_.size() >= options_.capacity) return false;
        jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
    return true;
}

void WorkerQueue::stop() {
    std::deque<Job> dropped;
    {
        std::lock_guard lk(mu_);
        stopping_ = true;
        if (options_.at_stop == AtStop::kDropQueued) dropped.swap(jobs_);
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    // Destroyed outside the lock: a job's captures may post to this queue (refused) on the way.
    dropped.clear();
}

size_t WorkerQueue::queued() const {
    std::lock_guard lk(mu_);
    return jobs_.size();
}

void WorkerQueue::run() {
    std::unique_lock lk(mu_);
    while (true) {
        cv_.wait(lk, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, nothing (left) to run
        Job job = std::move(jobs_.front());
        jobs_.pop_front();
        lk.unlock();
        job();
        job = nullptr;  // its captures go before the lock is taken again
        lk.lock();
    }
}

}  // namespace ferry
