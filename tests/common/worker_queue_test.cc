#include "common/worker_queue.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace ferry {
namespace {

using namespace std::chrono_literals;

TEST(WorkerQueue, RunsJobsInOrderOffTheCallersThread) {
    std::mutex mu;
    std::vector<int> ran;
    std::thread::id worker;
    {
        WorkerQueue q({.thread_name = "test-worker"});
        for (int i = 0; i < 100; ++i) {
            ASSERT_TRUE(q.post([&, i] {
                std::lock_guard lk(mu);
                ran.push_back(i);
                worker = std::this_thread::get_id();
            }));
        }
    }  // the destructor runs what is queued
    ASSERT_EQ(ran.size(), 100u);
    for (int i = 0; i < 100; ++i) EXPECT_EQ(ran[i], i);
    EXPECT_NE(worker, std::this_thread::get_id());
}

// Holds the worker inside a job until released, so the test controls what is queued.
struct Gate {
    std::promise<void> entered, release;
    std::shared_future<void> released{release.get_future().share()};
    WorkerQueue::Job job() {
        return [this] {
            entered.set_value();
            released.wait_for(30s);  // bounded: a broken test fails instead of hanging
        };
    }
};

TEST(WorkerQueue, RefusesPastCapacityAndAfterStop) {
    Gate gate;
    WorkerQueue q({.capacity = 2});
    ASSERT_TRUE(q.post(gate.job()));
    ASSERT_EQ(gate.entered.get_future().wait_for(30s), std::future_status::ready);
    std::atomic<int> ran{0};
    EXPECT_TRUE(q.post([&] { ran++; }));
    EXPECT_TRUE(q.post([&] { ran++; }));
    EXPECT_FALSE(q.post([&] { ran++; }));  // two wait already
    EXPECT_EQ(q.queued(), 2u);
    gate.release.set_value();
    q.stop();
    EXPECT_EQ(ran.load(), 2);  // kRunQueued: both ran before stop returned
    EXPECT_FALSE(q.post([&] { ran++; }));
    q.stop();  // again: nothing to do
}

TEST(WorkerQueue, DropQueuedDestroysWaitingJobsUnrunButFinishesTheCurrentOne) {
    Gate gate;
    auto q = std::make_unique<WorkerQueue>(
        WorkerQueue::Options{.at_stop = WorkerQueue::AtStop::kDropQueued});
    std::atomic<bool> current_done{false};
    ASSERT_TRUE(q->post([&] {
        gate.job()();
        current_done = true;
    }));
    ASSERT_EQ(gate.entered.get_future().wait_for(30s), std::future_status::ready);
    auto token = std::make_shared<int>(0);
    std::atomic<int> ran{0};
    ASSERT_TRUE(q->post([&ran, token] { ran++; }));
    EXPECT_EQ(token.use_count(), 2);
    std::thread stopper([&] { q->stop(); });
    // stop() has begun (and dropped the waiting job) once posts are refused.
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (q->post([] {}) && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(1ms);
    gate.release.set_value();
    stopper.join();
    EXPECT_TRUE(current_done.load());
    EXPECT_EQ(ran.load(), 0);
    EXPECT_EQ(token.use_count(), 1);  // the dropped job's captures are gone
}

TEST(WorkerQueue, AJobMayPostTheNextOne) {
    std::promise<int> done;
    WorkerQueue q({});
    std::function<void(int)> step = [&](int n) {
        if (n == 10) return done.set_value(n);
        q.post([&, n] { step(n + 1); });
    };
    ASSERT_TRUE(q.post([&] { step(0); }));
    auto f = done.get_future();
    ASSERT_EQ(f.wait_for(30s), std::future_status::ready);
    EXPECT_EQ(f.get(), 10);
}

}  // namespace
}  // namespace ferry
